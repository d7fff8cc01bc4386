//! Writing to the client, for every path: an upstream's answer (plain routes through
//! Pingora, LLM attempts), a held answer, and Sluice's own answers. Every response header
//! passes the plugins' `response_header` hooks and every chunk their `response_body` hooks
//! here, and the bytes that reach the client are counted here.
//!
//! An LLM answer's token usage is read here too, once for every plugin, before the body
//! hooks (see [`super::usage`]).
//!
//! An answer from a pool that serves another model name than the client asked for has its
//! `model` field rewritten back here, first, chunk by chunk ([`ModelRewriter`]): every hook,
//! the cache's tee included, sees the answer as the client gets it.

use super::{forwarding, usage};
use crate::chain::Chain;
use bytes::Bytes;
use pingora_error::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use sluice_sdk::error::internal;
use sluice_sdk::headers::is_event_stream;
use sluice_sdk::model_name::ModelRewriter;
use sluice_sdk::{headers, HeaderRules, RequestCtx, Route};
use std::sync::Arc;

/// The headers the core adds to an LLM answer: the pool, the escalation.
const CORE_HEADERS_ADDED: usize = 2;

/// Turns an upstream's response header into the client's: hop-by-hop headers out, on LLM
/// routes the pool (and the escalation) named, then the plugins' `response_header` hooks.
pub fn prepare_upstream_header(
    chain: &Chain,
    response: &mut ResponseHeader,
    ctx: &mut RequestCtx,
    route: Option<&HeaderRules>,
) -> Result<()> {
    let status = response.status.as_u16();
    let progress = ctx.progress_mut();
    progress.upstream_status = Some(status);
    progress.status = Some(status);
    forwarding::strip_response(response);
    forwarding::from_pool(response, ctx.pool().map(|p| &**p), route)?;
    let strip = is_event_stream(response) && usage::usage_kept_from_client(ctx);
    usage::strip_usage_chunk(ctx, strip);
    // Error answers pass as they are: only an answer carries the model's name.
    let rewriter = match (ctx.pool(), ctx.route()) {
        (Some(pool), Route::Llm(_)) if response.status.is_success() => pool
            .served_model_for(ctx.model())
            .and_then(|served| served.answer_rewriter(ctx.model())),
        _ => None,
    };
    if let Some(rewriter) = rewriter {
        // The rewritten body's length is known only once it has passed.
        if !is_event_stream(response) {
            response.remove_header(&http::header::CONTENT_LENGTH);
            response
                .insert_header(http::header::TRANSFER_ENCODING, "chunked")
                .map_err(internal)?;
        }
        ctx.state.insert(ModelRewrite(rewriter));
    }
    if let (Some(pool), Route::Llm(_)) = (ctx.pool(), ctx.route()) {
        let pool_value = pool.header_value();
        let escalated = ctx.escalated().map(http::HeaderValue::from_static);
        headers::edit(response, |map| {
            // Room for what the core and the chain's plugins add to an answer: the map grows
            // at most once, here, and no more than they need.
            map.reserve(CORE_HEADERS_ADDED + chain.response_headers_added());
            map.insert(headers::POOL, pool_value);
            if let Some(reason) = escalated {
                map.insert(headers::ESCALATED, reason);
            }
        });
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
    if let Some(ModelRewrite(rewriter)) = ctx.state.get_mut::<ModelRewrite>() {
        data = rewriter.rewrite(data, end);
    }
    usage::read_usage(ctx, &mut data, end);
    note_stored_response(ctx, data.as_ref());
    chain.response_body(&mut data, end, ctx)?;
    count_sent(ctx, data.as_ref());
    if end {
        // A stored response's note is shared before its answer ends (see `stored_responses`),
        // and learns the conversation's size.
        let sharing = ctx
            .state
            .get_mut::<super::stored_responses::NoteHome>()
            .and_then(super::stored_responses::NoteHome::take_sharing);
        if let Some(sharing) = sharing {
            let _ = sharing.await;
        }
        // After the note is written: its size goes over it, never before it.
        let usage = ctx.usage();
        if let Some(note) = ctx.state.get_mut::<super::stored_responses::NoteHome>() {
            note.ended(usage);
        }
    }
    session.write_response_body(data, end).await
}

/// Notes which backend made a stored response, from an upstream's answer (not a local one).
fn note_stored_response(ctx: &mut RequestCtx, chunk: Option<&Bytes>) {
    use super::stored_responses::{Home, NoteHome};
    let (Some(chunk), false) = (chunk, ctx.answered_locally()) else {
        return;
    };
    if !ctx.state.get::<NoteHome>().is_some_and(NoteHome::looking) {
        return;
    }
    let status = ctx.progress().upstream_status;
    let home = match (ctx.pool(), ctx.progress().backend) {
        (Some(pool), Some(backend)) => Some(Home {
            pool: Arc::clone(&pool.name),
            backend,
            tenant: ctx.tenant().map(|t| Arc::clone(&t.name)),
            tokens: 0,
        }),
        _ => None,
    };
    if let Some(note) = ctx.state.get_mut::<NoteHome>() {
        note.feed(chunk, status, home);
    }
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

/// The rewriter of an upstream answer's `model` field, when its pool serves another name than
/// the client asked for: in the request's state under this type of the core's.
#[derive(Debug)]
pub struct ModelRewrite(ModelRewriter);
