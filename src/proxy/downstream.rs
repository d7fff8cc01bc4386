//! Writing to the client, for every path: an upstream's answer (plain routes through
//! Pingora, LLM attempts), a held answer, and Sluice's own answers. Every response header
//! passes the plugins' `response_header` hooks and every chunk their `response_body` hooks
//! here, and the bytes that reach the client are counted here.
//!
//! An LLM answer passes the core's own stages first, each chunk in one order written once
//! ([`forward`]), their state one typed value the request's path owns ([`Answer`]), not
//! the plugins' state:
//! 1. an answer from a pool that serves another model name than the client asked for has
//!    its `model` field rewritten back ([`ModelRewriter`]): every hook, the cache's tee
//!    included, sees the answer as the client gets it;
//! 2. its token usage is read, once for every plugin (see [`super::usage`]);
//! 3. a stored response's id is noted with the backend that made it
//!    ([`super::stored_responses`]);
//! 4. the plugins' body hooks;
//! 5. the bytes sent are counted, and the chunk written.

use super::forwarding;
use super::stored_responses::{NoteHome, ResponseHomes};
use super::usage::{self, AnswerUsage};
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

/// The core's stages of a request's answers (see the module's header): what each chunk of an
/// LLM answer passes before the plugins' hooks. Owned by the request's path (the LLM
/// route, then its attempt loop); Sluice's own answers and plain routes have none.
#[derive(Debug, Default)]
pub struct Answer {
    /// The pool's model name written back as the client asked for it: set by each answer's
    /// header, when the pool renames.
    rewrite: Option<ModelRewriter>,
    /// The answer's usage, read as it passes.
    usage: Option<AnswerUsage>,
    /// A stored response's home, noted as its answer passes (Responses API).
    note: Option<NoteHome>,
}

impl Answer {
    /// The stages of an LLM request's answers (an upstream's, a cache hit's), set up before
    /// the plugins' request hooks.
    pub fn for_llm(ctx: &RequestCtx, homes: &Arc<ResponseHomes>) -> Self {
        // A response the engine keeps (`store` not false) is noted with its backend.
        let stores = ctx
            .llm()
            .is_some_and(|call| call.endpoint.family().stores_answer(&call.request));
        Answer {
            rewrite: None,
            usage: Some(AnswerUsage::of(ctx)),
            note: stores.then(|| NoteHome::new(Arc::clone(homes))),
        }
    }

    /// What the answer's usage scan has read, for the backend's speed sample.
    pub fn usage(&self) -> Option<&AnswerUsage> {
        self.usage.as_ref()
    }

    /// An upstream answer's header is known: the stages that depend on it are set.
    fn started(&mut self, response: &mut ResponseHeader, ctx: &RequestCtx) -> Result<()> {
        if let Some(usage) = self.usage.as_mut() {
            let strip = is_event_stream(response) && usage::usage_kept_from_client(ctx);
            usage::strip_usage_chunk(ctx, usage, strip);
        }
        // Error answers pass as they are: only an answer carries the model's name.
        self.rewrite = match (ctx.pool(), ctx.route()) {
            (Some(pool), Route::Llm(_)) if response.status.is_success() => pool
                .served_model_for(ctx.model())
                .and_then(|served| served.answer_rewriter(ctx.model())),
            _ => None,
        };
        // The rewritten body's length is known only once it has passed.
        if self.rewrite.is_some() && !is_event_stream(response) {
            response.remove_header(&http::header::CONTENT_LENGTH);
            response
                .insert_header(http::header::TRANSFER_ENCODING, "chunked")
                .map_err(internal)?;
        }
        Ok(())
    }
}

/// Turns an upstream's response header into the client's: hop-by-hop headers out, on LLM
/// routes the answer's stages set (`answer`) and the pool (and the escalation) named, then
/// the plugins' `response_header` hooks.
pub fn prepare_upstream_header(
    chain: &Chain,
    response: &mut ResponseHeader,
    ctx: &mut RequestCtx,
    route: Option<&HeaderRules>,
    answer: Option<&mut Answer>,
) -> Result<()> {
    let status = response.status.as_u16();
    let progress = ctx.progress_mut();
    progress.upstream_status = Some(status);
    progress.status = Some(status);
    forwarding::strip_response(response);
    forwarding::from_pool(response, ctx.pool().map(|p| &**p), route)?;
    if let Some(answer) = answer {
        answer.started(response, ctx)?;
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

/// Passes a chunk through the answer's stages, in their one order (see the module's
/// header), and writes it to the client.
pub async fn forward(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    mut data: Option<Bytes>,
    end: bool,
) -> Result<()> {
    if let Some(rewriter) = answer.rewrite.as_mut() {
        data = rewriter.rewrite(data, end);
    }
    if let Some(usage) = answer.usage.as_mut() {
        usage::read_usage(ctx, usage, &mut data, end);
    }
    if let Some(note) = answer.note.as_mut() {
        note.passed(ctx, data.as_ref());
    }
    chain.response_body(&mut data, end, ctx)?;
    count_sent(ctx, data.as_ref());
    if let (true, Some(note)) = (end, answer.note.as_mut()) {
        note.answer_ended(ctx.usage()).await;
    }
    session.write_response_body(data, end).await
}

/// Writes a response whose header is ready (hooks run) and whose whole body is in hand.
pub async fn write_whole(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    header: Box<ResponseHeader>,
    body: Bytes,
) -> Result<()> {
    ctx.progress_mut().status = Some(header.status.as_u16());
    session.write_response_header(header, false).await?;
    forward(chain, session, ctx, answer, Some(body), true).await
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
