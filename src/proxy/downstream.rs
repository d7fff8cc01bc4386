//! Writing to the client, for every path: an upstream's answer (plain routes through
//! Pingora, LLM attempts), a held answer, and Sluice's own answers. Every response header
//! passes the plugins' `response_header` hooks and every chunk their `response_body` hooks
//! here, and the bytes that reach the client are counted here.

use super::forwarding;
use crate::chain::Chain;
use bytes::Bytes;
use pingora_error::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use sluice_sdk::error::internal;
use sluice_sdk::{headers, RequestCtx, Route};

/// Turns an upstream's response header into the client's: hop-by-hop headers out, on LLM
/// routes the pool (and the escalation) named, then the plugins' `response_header` hooks.
pub fn prepare_upstream_header(
    chain: &Chain,
    response: &mut ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let status = response.status.as_u16();
    let progress = ctx.progress_mut();
    progress.upstream_status = Some(status);
    progress.status = Some(status);
    forwarding::strip_response(response);
    if let (Some(pool), Route::Llm(_)) = (ctx.pool(), ctx.route()) {
        response
            .insert_header(headers::POOL, &*pool.name)
            .map_err(internal)?;
        if let Some(reason) = ctx.escalated() {
            response
                .insert_header(headers::ESCALATED, reason)
                .map_err(internal)?;
        }
    }
    chain.response_header(response, ctx)
}

/// Runs the body hooks on a chunk and writes it to the client.
pub async fn forward(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    mut data: Option<Bytes>,
    end: bool,
) -> Result<()> {
    chain.response_body(&mut data, end, ctx)?;
    count_sent(ctx, data.as_ref());
    session.write_response_body(data, end).await
}

/// Writes a response whose header is ready (hooks run) and whose whole body is in hand.
pub async fn write_whole(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    header: Box<ResponseHeader>,
    body: Bytes,
) -> Result<()> {
    ctx.progress_mut().status = Some(header.status.as_u16());
    session.write_response_header(header, false).await?;
    forward(chain, session, ctx, Some(body), true).await
}

/// Frames a response whose whole body is in hand by its length.
pub fn frame_by_length(header: &mut ResponseHeader, len: usize) -> Result<()> {
    header.remove_header(&http::header::TRANSFER_ENCODING);
    header.insert_header(http::header::CONTENT_LENGTH, len)
}

/// Book-keeping for bytes that reach the client.
pub fn count_sent(ctx: &mut RequestCtx, chunk: Option<&Bytes>) {
    let Some(chunk) = chunk else {
        return;
    };
    if !chunk.is_empty() && ctx.progress().first_byte.is_none() {
        let since_start = ctx.started().elapsed();
        ctx.progress_mut().first_byte = Some(since_start);
    }
    ctx.progress_mut().response_bytes += chunk.len();
}
