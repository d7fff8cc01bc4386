//! The one `ProxyHttp` implementation. It knows nothing of caching, pressure or pools'
//! policies: it routes each request to its path and drives the plugin chain through it.
//!
//! A request's life, with the plugin hooks (`chain.*`) where they fire. LLM routes answer
//! from `request_filter` with attempts of their own ([`llm_route`]); plain routes go through
//! Pingora's proxy loop, whose phases are the `ProxyHttp` methods below ([`plain_route`]).
//! Every answer, Sluice's own included, passes `chain.response_header` and
//! `chain.response_body` in [`downstream`]; every request ends in `logging`.
//!
//! ```text
//! early_request_filter ─ chain.early_request
//!         │
//! request_filter ─ router ─┬─ LLM route ─ llm_route::serve
//!         │                │    read + parse the body, pool by model
//!         │                │    chain.request ─── a plugin answers (cache hit) ─ reply::local ─┐
//!         │                │    attempt loop, per attempt:                                     │
//!         │                │      select   chain.upstream_select, pool.select                  │
//!         │                │      prepare  the pool's body (served model name, usage asked)│
//!         │                │               and headers (forwarding), chain.upstream_request    │
//!         │                │      run      attempt::run ─ downstream: the pool's rules,        │
//!         │                │               chain.response_header; per chunk the model name     │
//!         │                │               back, the usage found, chain.response_body ─────────┤
//!         │                │      decide   done │ next backend │ retry │ escalate │ fail       │
//!         │                ├─ GET /v1/models ─ chain.request, reply::send ─────────────────────┤
//!         │                ├─ no route, wrong method ─ Err ─► fail_to_proxy                    │
//!         │                └─ plain route ─ chain.request, then Pingora's loop:                │
//! upstream_peer ─ chain.upstream_select, plain_route: next backend                             │
//! fail_to_connect, error_while_proxy ─ plain_route: judge the try, retry or not;             │
//!                                       a refused one: chain.attempt_end                       │
//! upstream_request_filter ─ forwarding (pool, route), chain.upstream_request (the try)        │
//! response_filter ─ downstream::prepare_upstream_header ─ chain.response_header               │
//! response_body_filter ─ chain.response_body ──────────────────────────────────────────────────┤
//! fail_to_proxy ─ reply::error ─ chain.error, chain.response_header, chain.response_body ──────┤
//! logging ─ plain: chain.attempt_end (the last try); chain.logging ◄──────────────────────────┘
//! ```
//!
//! The core's own metrics, traces and access log are observers in the chain
//! (`crate::observers`): they hear `upstream_request`, `attempt_end` and `logging` as
//! plugins do.

mod attempt;
mod body;
mod client;
pub(crate) mod disaggregation;
mod downstream;
mod forwarding;
mod llm_route;
mod plain_route;
pub(crate) mod pool_calls;
mod reply;
pub(crate) mod shared_sessions;
mod state;
pub(crate) mod stored_responses;
mod tries;
pub(crate) mod upstream_pool;
mod usage;

pub use pool_calls::CoreCalls;
pub use state::{Lasting, Sluice, HANDED_OVER};

use crate::caps::Slot;
use crate::router::Decision;
use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use plain_route::PlainTries;
use sluice_sdk::{AttemptStart, ErrorReply, HeaderRules, Reason, RequestCtx, Verdict};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// The proxy service: each request runs on the generation of [`Sluice`] current when it
/// begins (see `crate::reload`: `SIGHUP` swaps in a new one for new requests).
pub struct Proxy {
    pub current: Arc<ArcSwap<Sluice>>,
}

/// Per-session state: the plugins' view, plus what only the core uses.
pub struct ProxyCtx {
    /// The generation this request runs on, to its end.
    sluice: Arc<Sluice>,
    pub req: RequestCtx,
    plain: PlainTries,
    /// The request's place under the in-flight caps, until it ends.
    slot: Option<Slot>,
    /// A plain route's header rules, applied after its pool's.
    route_headers: Option<Arc<HeaderRules>>,
    /// Plain routes: the request body's bytes so far, and when the request came.
    body_read: usize,
    body_deadline: Option<Instant>,
}

impl ProxyCtx {
    fn new(sluice: Arc<Sluice>) -> Self {
        Self {
            sluice,
            req: RequestCtx::default(),
            plain: PlainTries::default(),
            slot: None,
            route_headers: None,
            body_read: 0,
            body_deadline: None,
        }
    }
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = ProxyCtx;

    /// The request runs on the generation current when it begins, to its end.
    fn new_ctx(&self) -> ProxyCtx {
        ProxyCtx::new(self.current.load_full())
    }

    async fn early_request_filter(&self, session: &mut Session, ctx: &mut ProxyCtx) -> Result<()> {
        let this = Arc::clone(&ctx.sluice);
        // Every write to this client is bounded: one that stops reading is cut, and what its
        // request held (an upstream attempt, its KV accounting) is released.
        session.set_write_timeout(Some(this.limits.send_timeout));
        session.set_read_timeout(Some(this.limits.client_body_timeout));
        if HANDED_OVER.load(std::sync::atomic::Ordering::Relaxed) {
            // A new process has the listeners: this connection's next request goes there.
            session.set_keepalive(None);
        }
        let address = client::address(session, &this.limits.trusted_proxies);
        ctx.slot = Some(client::admit(&this.requests, address)?);
        let decided = this.chain.early_request(session, &mut ctx.req).await;
        // The request's span opens once its identity is known (the request-id plugin gave
        // it its id), and closes with the context, after `logging`.
        let header = session.req_header();
        let (span, traced) = crate::telemetry::open_request_span(header, || {
            tracing::info_span!(
                target: "sluice::request",
                "request",
                request_id = ctx.req.request_id().unwrap_or("-"),
                // Set only when tracing: see `crate::telemetry`.
                otel.name = tracing::field::Empty,
                otel.kind = tracing::field::Empty,
                // Recorded by the KV breaker when it admits the request.
                sluice.admission.wait_ms = tracing::field::Empty,
                sluice.kv.projection = tracing::field::Empty,
            )
        });
        ctx.req.set_span(span, traced);
        decided
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut ProxyCtx) -> Result<bool> {
        let this = Arc::clone(&ctx.sluice);
        let decision = this.router.route(session.req_header());
        ctx.req.set_route(decision.route());
        if let Decision::Plain(rule) = &decision {
            ctx.route_headers = Some(Arc::clone(&rule.headers));
        }
        let ProxyCtx {
            req: ctx, plain, ..
        } = ctx;
        match decision {
            Decision::Llm(endpoint, found) => {
                let span = ctx.span().clone();
                llm_route::serve(&this, session, ctx, endpoint, found)
                    .instrument(span)
                    .await?;
                Ok(true)
            }
            Decision::Models => {
                if !this.answered_by_plugins(session, ctx).await? {
                    // Built once, unless some pool learns its models from its backends.
                    let body = if this.pools.any_auto_models() {
                        crate::models::list(&this.pools)
                    } else {
                        this.models.clone()
                    };
                    reply::send(&this.chain, session, ctx, "application/json", body).await?;
                }
                Ok(true)
            }
            Decision::Plain(rule) => {
                body::refuse_declared_over_limit(session, &this.limits)?;
                ctx.send_to(rule.pool.clone());
                this.answered_by_plugins(session, ctx).await
            }
            Decision::StoredResponse(id) => {
                body::refuse_declared_over_limit(session, &this.limits)?;
                let (pool, backend, _) = llm_route::home_of(&this, ctx, &id).await?;
                ctx.send_to(pool);
                plain.pin(backend);
                this.answered_by_plugins(session, ctx).await
            }
            Decision::NotFound => {
                if this.answered_by_plugins(session, ctx).await? {
                    return Ok(true);
                }
                let path = session.req_header().uri.path();
                let message = format!("No route for {path}.");
                Err(ErrorReply::not_found(Reason::NoRoute, message).into_error())
            }
            Decision::EngineOnly => {
                let path = session.req_header().uri.path();
                let message = format!(
                    "{path} is the engine's own endpoint: it is not served through this proxy."
                );
                Err(ErrorReply::not_found(Reason::NoRoute, message).into_error())
            }
            Decision::MethodNotAllowed(allowed) => Err(ErrorReply::new(
                405,
                Reason::MethodNotAllowed,
                format!("Only {allowed} is allowed here."),
            )
            .into_error()),
        }
    }

    // ---- plain routes only: Pingora's proxy loop ----

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut ProxyCtx,
    ) -> Result<Box<HttpPeer>> {
        let this = Arc::clone(&ctx.sluice);
        this.chain.upstream_select(&mut ctx.req)?;
        if let Some(pool) = ctx.plain.waits_for(&ctx.req) {
            if let Some(newest) = tries::wait_for_backend(None, &pool).await? {
                // The pool's newest generation: a reload may have come while it waited.
                ctx.req.send_to(newest);
            }
        }
        ctx.plain.next_peer(&mut ctx.req)
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut ProxyCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        ctx.plain.judge(&ctx.req, Verdict::Failure);
        if let Some(attempt) = ctx.plain.refused(&ctx.req) {
            Arc::clone(&ctx.sluice)
                .chain
                .attempt_end(&attempt, &mut ctx.req);
        }
        // Nothing was sent, so another backend of the pool is safe to try.
        e.set_retry(ctx.plain.backends_left(&ctx.req));
        e
    }

    /// Plain routes stream the request body through: counted against the body limit and its
    /// deadline as it passes (the LLM routes read theirs whole, in `body`).
    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut ProxyCtx,
    ) -> Result<()> {
        let this = Arc::clone(&ctx.sluice);
        let deadline = *ctx
            .body_deadline
            .get_or_insert_with(|| Instant::now() + this.limits.client_body_deadline);
        ctx.body_read += body.as_ref().map_or(0, Bytes::len);
        if ctx.body_read > this.limits.max_request_body_bytes {
            return Err(
                ErrorReply::payload_too_large(this.limits.max_request_body_bytes).into_error(),
            );
        }
        if Instant::now() > deadline {
            return Err(body::too_slow(&this.limits));
        }
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut ProxyCtx,
    ) -> Result<()> {
        let this = Arc::clone(&ctx.sluice);
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        forwarding::prepare_request(upstream_request, peer, &this.limits.trusted_proxies)?;
        let Some(pool) = ctx.req.pool().cloned() else {
            return Err(ErrorReply::internal("No pool chosen.").into_error());
        };
        let tenant_key = ctx.req.tenant().is_some();
        forwarding::to_pool(
            upstream_request,
            &pool,
            ctx.route_headers.as_deref(),
            tenant_key,
        )?;
        let Some(backend) = ctx.req.progress().backend else {
            return Err(ErrorReply::internal("No backend chosen.").into_error());
        };
        let attempt = AttemptStart {
            number: ctx.req.progress().attempts,
            pool: &pool.name,
            backend,
            span: ctx.plain.span(),
            prefill_leg: false,
        };
        this.chain
            .upstream_request(upstream_request, &attempt, &mut ctx.req)
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut ProxyCtx,
    ) -> Result<()> {
        let this = Arc::clone(&ctx.sluice);
        ctx.plain.honour_back_pressure(&ctx.req, response);
        // A 5xx fails the try now; a success is known only once the body has come whole
        // (`logging`), since the upstream may still break it.
        if response.status.is_server_error() && tries::back_pressure(response).is_none() {
            ctx.plain.judge(&ctx.req, Verdict::Failure);
        }
        let route = ctx.route_headers.as_deref();
        downstream::prepare_upstream_header(&this.chain, response, &mut ctx.req, route, None)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut ProxyCtx,
    ) -> Result<Option<Duration>> {
        let this = Arc::clone(&ctx.sluice);
        this.chain
            .response_body(body, end_of_stream, &mut ctx.req)?;
        downstream::count_sent(&mut ctx.req, body.as_ref());
        Ok(None)
    }

    /// A plain route's upstream failed while proxying (after the connection was made).
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut ProxyCtx,
        client_reused: bool,
    ) -> Box<Error> {
        if e.esource() == &ErrorSource::Upstream {
            ctx.plain.judge(&ctx.req, Verdict::Failure);
        }
        let mut e = e.more_context(format!("Peer: {peer}"));
        // As Pingora decides by default: only an idempotent request whose body is still in
        // hand may be sent again, and only when a pooled connection was closed under it.
        if session.req_header().method.is_idempotent() && !session.retry_buffer_truncated() {
            e.retry.decide_reuse(client_reused);
        } else {
            e.set_retry(false);
        }
        e
    }

    // ---- every request ----

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut ProxyCtx,
    ) -> FailToProxy {
        let this = Arc::clone(&ctx.sluice);
        reply::error(
            &this.chain,
            session,
            &mut ctx.req,
            ErrorReply::from_error(e),
        )
        .await
    }

    fn suppress_error_log(&self, _session: &Session, _ctx: &ProxyCtx, e: &Error) -> bool {
        // Refusals Sluice chose are not errors; overload refusals are summarized instead.
        let reply = ErrorReply::from_error(e);
        reply.status < 500 || crate::access_log::overload_refusal(reply.reason)
    }

    async fn logging(&self, _session: &mut Session, e: Option<&Error>, ctx: &mut ProxyCtx) {
        let this = Arc::clone(&ctx.sluice);
        // A plain route's last try that nothing failed: it answered (a client that left
        // does not count against the backend).
        if ctx.req.progress().upstream_status.is_some()
            && e.is_none_or(|e| e.esource() != &ErrorSource::Upstream)
        {
            ctx.plain.judge(&ctx.req, Verdict::Success);
        }
        if let Some(attempt) = ctx.plain.last_attempt(&ctx.req, e) {
            this.chain.attempt_end(&attempt, &mut ctx.req);
        }
        // The plugins, then the core's observers: metrics, traces, the access log.
        this.chain.logging(e, &mut ctx.req);
        charge_output(&ctx.req);
    }
}

/// An OpenAI-style stream chunk's bytes per token: vLLM sends a token a chunk, about 210
/// bytes of JSON with its `data: ` framing (its 0.32 captures).
const STREAM_BYTES_PER_TOKEN: usize = 200;

/// Counts an engine's answer's output tokens to the request's flow (its pool's fair order):
/// its usage's, or, for a stream whose client did not ask for it, an estimate from the bytes
/// sent (asking the engine for it would change every stream's body for an estimate).
fn charge_output(req: &RequestCtx) {
    let (Some(pool), Some(flow), false) = (req.pool(), req.flow(), req.answered_locally()) else {
        return;
    };
    let tokens = match req.usage() {
        Some(usage) => usage.completion_tokens,
        None => (req.progress().response_bytes / STREAM_BYTES_PER_TOKEN) as u64,
    };
    pool.flow_control().charge_output(flow, tokens);
}

impl Sluice {
    /// Runs the plugins' `request` hooks; when one answers, sends its answer. `Ok(true)`: the
    /// request has been answered.
    async fn answered_by_plugins(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<bool> {
        match self.chain.request(session, ctx).await? {
            Some(answer) => {
                // Not an LLM route's: no stage of an LLM answer applies to it.
                let stages = &mut downstream::Answer::default();
                reply::local(&self.chain, session, ctx, stages, answer).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}
