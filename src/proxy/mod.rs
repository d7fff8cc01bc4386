//! The one `ProxyHttp` implementation. It knows nothing of caching, pressure or pools'
//! policies: it routes and drives the plugin chain through Pingora's phases.
//!
//! Routes take one of two paths upstream:
//! - LLM routes go to [`llm`], which reads the whole body, runs the request hooks, and sends
//!   the request itself, one [`attempt`] per backend tried, answering from `request_filter`;
//! - plain routes go through Pingora's own proxy loop (`upstream_peer` and the filters below).

mod attempt;
mod body;
mod llm;
mod reply;

use crate::chain::Chain;
use crate::config::Limits;
use crate::metrics;
use crate::router::{Decision, Router};
use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::connectors::http::Connector;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use sluice_sdk::{
    BackendLive, Demand, ErrorReply, InFlight, Pool, Pools, RequestCtx, Route, Verdict,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Everything the proxy needs at run time, built once from config.
pub struct Sluice {
    pub limits: Limits,
    pub pools: Arc<Pools>,
    /// The `/v1/models` answer, built once: pools do not change while running.
    pub models: Bytes,
    pub router: Router,
    pub chain: Chain,
    pub access_log: bool,
    /// The LLM attempts' connections to backends, pooled.
    pub connector: Connector,
}

/// Per-session state: the plugins' view, plus what only the core uses.
#[derive(Default)]
pub struct ProxyCtx {
    pub req: RequestCtx,
    /// Plain routes: the backends already tried, for connect-failure retries.
    tried: Vec<SocketAddr>,
    /// Plain routes: the current try, counted against its backend.
    in_flight: Option<InFlight>,
    /// Plain routes: the current try has counted for or against its backend.
    judged: bool,
}

/// The header that names the pool that produced an answer.
pub const POOL_HEADER: &str = "x-sluice-pool";
/// The header that says why a request went to its escalation target (SPEC.md).
pub const ESCALATED_HEADER: &str = "x-sluice-escalated";

#[async_trait]
impl ProxyHttp for Sluice {
    type CTX = ProxyCtx;

    fn new_ctx(&self) -> ProxyCtx {
        ProxyCtx::default()
    }

    async fn early_request_filter(&self, session: &mut Session, ctx: &mut ProxyCtx) -> Result<()> {
        self.chain.early_request(session, &mut ctx.req).await
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut ProxyCtx) -> Result<bool> {
        let decision = self.router.route(session.req_header());
        ctx.req.route = decision.route();
        match decision {
            Decision::Llm(endpoint) => {
                llm::serve(self, session, ctx, endpoint).await?;
                Ok(true)
            }
            Decision::Models => {
                if self.request_hooks(session, &mut ctx.req).await? {
                    return Ok(true);
                }
                let body = self.models.clone();
                reply::send(self, session, &mut ctx.req, 200, "application/json", body).await?;
                Ok(true)
            }
            Decision::Plain(rule) => {
                ctx.req.pool = Some(rule.pool.clone());
                self.request_hooks(session, &mut ctx.req).await
            }
            Decision::NotFound => {
                if self.request_hooks(session, &mut ctx.req).await? {
                    return Ok(true);
                }
                let path = session.req_header().uri.path().to_string();
                Err(ErrorReply::not_found("no-route", format!("No route for {path}.")).into_error())
            }
            Decision::MethodNotAllowed(allowed) => Err(ErrorReply::new(
                405,
                "method-not-allowed",
                format!("Only {allowed} is allowed here."),
            )
            .into_error()),
        }
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut ProxyCtx,
    ) -> Result<Box<HttpPeer>> {
        // A plain route (LLM routes answer in `request_filter`): one backend per try.
        self.chain.upstream_select(&mut ctx.req)?;
        let pool = ctx
            .req
            .pool
            .clone()
            .ok_or_else(|| ErrorReply::new(500, "internal", "No pool chosen.").into_error())?;
        let backend = pool
            .select(&ctx.tried, &Demand::default())
            .ok_or_else(|| llm::no_backend(&pool))?;
        ctx.tried.push(backend.addr);
        ctx.req.backend = Some(backend.addr);
        ctx.req.attempts += 1;
        ctx.in_flight = Some(backend.live.begin(0));
        ctx.judged = false;
        Ok(Box::new(pool.peer(backend.addr)))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut ProxyCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        metrics::inc(
            &metrics::UPSTREAM_ATTEMPTS,
            &[ctx.req.pool_name(), "connect_error"],
        );
        plain_verdict(ctx, Verdict::Failure);
        // Nothing was sent, so another backend of the pool is safe to try.
        let left = ctx
            .req
            .pool
            .as_ref()
            .is_some_and(|p| ctx.tried.len() < p.backends.len());
        e.set_retry(left);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut ProxyCtx,
        client_reused: bool,
    ) -> Box<Error> {
        if e.esource() == &ErrorSource::Upstream {
            plain_verdict(ctx, Verdict::Failure);
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

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut ProxyCtx,
    ) -> Result<()> {
        self.chain.upstream_request(upstream_request, &mut ctx.req)
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut ProxyCtx,
    ) -> Result<()> {
        metrics::inc(
            &metrics::UPSTREAM_ATTEMPTS,
            &[ctx.req.pool_name(), "response"],
        );
        // A 5xx fails the try now; a success is known only once the body has come whole
        // (`logging`), since the upstream may still break it.
        if response.status.is_server_error() {
            plain_verdict(ctx, Verdict::Failure);
        }
        prepare_client_response(self, response, &mut ctx.req)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut ProxyCtx,
    ) -> Result<Option<Duration>> {
        self.chain
            .response_body(body, end_of_stream, &mut ctx.req)?;
        count_sent(&mut ctx.req, body.as_ref());
        Ok(None)
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut ProxyCtx,
    ) -> FailToProxy {
        reply::error(self, session, &mut ctx.req, ErrorReply::from_error(e)).await
    }

    fn suppress_error_log(&self, _session: &Session, _ctx: &ProxyCtx, e: &Error) -> bool {
        // Refusals Sluice chose are not errors.
        ErrorReply::from_error(e).status < 500
    }

    async fn logging(&self, _session: &mut Session, e: Option<&Error>, ctx: &mut ProxyCtx) {
        // A plain route's last try that nothing failed: it answered (a client that left
        // does not count against the backend).
        if ctx.req.upstream_status.is_some()
            && e.is_none_or(|e| e.esource() != &ErrorSource::Upstream)
        {
            plain_verdict(ctx, Verdict::Success);
        }
        self.chain.logging(e, &mut ctx.req);
        crate::accounting::record(self.access_log, &ctx.req, e);
    }
}

impl Sluice {
    /// Runs the plugins' `request` hooks; when one answers, sends its answer. `Ok(true)`: the
    /// request has been answered.
    async fn request_hooks(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        match self.chain.request(session, ctx).await? {
            Some(response) => {
                reply::local(self, session, ctx, response).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// Turns an upstream response header into the client's: hop-by-hop headers out, the pool
/// named, plugins' `response_header` hooks run. Used by plain routes and LLM attempts alike.
fn prepare_client_response(
    sluice: &Sluice,
    response: &mut ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let status = response.status.as_u16();
    ctx.upstream_status = Some(status);
    ctx.status = Some(status);
    for name in ["connection", "keep-alive", "proxy-connection"] {
        response.remove_header(name);
    }
    if let Some(pool) = &ctx.pool {
        if matches!(ctx.route, Route::Llm(_)) {
            response
                .insert_header(POOL_HEADER, &*pool.name)
                .map_err(|e| ErrorReply::new(500, "internal", e.to_string()).into_error())?;
            if let Some(reason) = ctx.escalated {
                response
                    .insert_header(ESCALATED_HEADER, reason)
                    .map_err(|e| ErrorReply::new(500, "internal", e.to_string()).into_error())?;
            }
        }
    }
    sluice.chain.response_header(response, ctx)
}

/// Passive health: an answer counts for or against its backend, which is ejected for a while
/// after `outlier.consecutive_failures` failures in a row.
fn record_verdict(pool: &Pool, addr: SocketAddr, live: &BackendLive, verdict: Verdict) {
    if let Some(cool_down) = live.record(verdict, &pool.outlier) {
        metrics::inc(&metrics::EJECTIONS, &[&pool.name]);
        tracing::warn!(
            pool = &*pool.name,
            backend = %addr,
            "backend ejected for {} after failing",
            humantime::format_duration(cool_down)
        );
    }
}

/// [`record_verdict`] for a plain route's current try, once: a failure when it fails (no
/// connection, an upstream error, a 5xx), else a success when the request ends.
fn plain_verdict(ctx: &mut ProxyCtx, verdict: Verdict) {
    let (Some(pool), Some(addr), Some(in_flight)) =
        (&ctx.req.pool, ctx.req.backend, &ctx.in_flight)
    else {
        return;
    };
    if !std::mem::replace(&mut ctx.judged, true) {
        record_verdict(pool, addr, in_flight.backend(), verdict);
    }
}

/// Runs the body hooks on a chunk and writes it to the client.
async fn forward(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    mut data: Option<Bytes>,
    end: bool,
) -> Result<()> {
    sluice.chain.response_body(&mut data, end, ctx)?;
    count_sent(ctx, data.as_ref());
    session.write_response_body(data, end).await
}

/// Book-keeping for bytes that reach the client.
fn count_sent(ctx: &mut RequestCtx, chunk: Option<&Bytes>) {
    if let Some(chunk) = chunk {
        if !chunk.is_empty() && ctx.first_byte.is_none() {
            ctx.first_byte = Some(ctx.started.elapsed());
        }
        ctx.response_bytes += chunk.len();
    }
}
