//! Plain routes (`proxy_pass`): Pingora's own proxy loop moves the bytes; this keeps what the
//! loop's hooks share about the current try, so that each try counts once for or against
//! its backend and a refused connection moves on to another backend of the pool.

use super::attempt::{is_connect_failure, is_timeout};
use super::tries::{self, no_backend};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, Result};
use pingora_http::ResponseHeader;
use sluice_sdk::error::ErrorReply;
use sluice_sdk::{AttemptOutcome, AttemptReport, Demand, InFlight, RequestCtx, Verdict};
use std::net::SocketAddr;

/// The tries of one plain-route request.
pub struct PlainTries {
    /// The backends already tried, for connect-failure retries.
    tried: Vec<SocketAddr>,
    /// The current try, counted against its backend.
    in_flight: Option<InFlight>,
    /// The current try has counted for or against its backend.
    judged: bool,
    /// When the current try started.
    started: Option<std::time::Instant>,
    /// The current try's span (see `tries::span`); none before the first try.
    span: tracing::Span,
    /// The current try's end was told to the observers already (a refused connection).
    reported: bool,
    /// The one backend the request may go to (the one that holds its state), if so.
    pinned: Option<SocketAddr>,
    /// It waited for its pool to have a usable backend (once is all it waits).
    waited: bool,
}

impl Default for PlainTries {
    fn default() -> Self {
        Self {
            tried: Vec::new(),
            in_flight: None,
            judged: false,
            started: None,
            span: tracing::Span::none(),
            reported: false,
            pinned: None,
            waited: false,
        }
    }
}

impl PlainTries {
    /// The request's pool, when the request should wait for it to have a usable backend
    /// before its first try: the pool has no ready backend (scaled to zero, starting).
    /// Asked once.
    pub fn waits_for(&mut self, ctx: &RequestCtx) -> Option<std::sync::Arc<sluice_sdk::Pool>> {
        let first = self.tried.is_empty() && self.pinned.is_none() && !self.waited;
        let pool = ctx
            .pool()
            .filter(|pool| first && !pool.has_ready_member())?;
        self.waited = true;
        Some(std::sync::Arc::clone(pool))
    }

    /// The peer for the next try: a backend of the request's pool not tried yet.
    pub fn next_peer(&mut self, ctx: &mut RequestCtx) -> Result<Box<HttpPeer>> {
        let pool = ctx
            .pool()
            .cloned()
            .ok_or_else(|| ErrorReply::internal("No pool chosen.").into_error())?;
        let backend = match self.pinned {
            Some(addr) => pool.select_backend(addr, &self.tried),
            None => pool.select(&self.tried, &Demand::default()),
        }
        .ok_or_else(|| no_backend(&pool))?;
        self.in_flight = Some(tries::begin(ctx, &mut self.tried, &backend, 0));
        self.span = tries::span(ctx, &pool, backend.addr);
        self.judged = false;
        self.reported = false;
        self.started = Some(std::time::Instant::now());
        Ok(Box::new(pool.peer(backend.addr)))
    }

    /// Sends every try to `backend` alone.
    pub fn pin(&mut self, backend: SocketAddr) {
        self.pinned = Some(backend);
    }

    /// Whether the pool has a backend left to try after a refused connection.
    pub fn backends_left(&self, ctx: &RequestCtx) -> bool {
        self.pinned.is_none()
            && ctx
                .pool()
                .is_some_and(|pool| self.tried.len() < pool.members().ready())
    }

    /// Honours the backend's back-pressure (a 429 or 503 with `Retry-After`).
    pub fn honour_back_pressure(&self, ctx: &RequestCtx, header: &ResponseHeader) {
        if let Some(in_flight) = &self.in_flight {
            tries::honour_back_pressure(ctx, in_flight.backend(), header);
        }
    }

    /// Judges the current try, once: a failure when it fails (no connection, an upstream
    /// error, a 5xx), else a success when the request ends.
    pub fn judge(&mut self, ctx: &RequestCtx, verdict: Verdict) {
        let (Some(pool), Some(addr), Some(in_flight)) =
            (ctx.pool(), ctx.progress().backend, &self.in_flight)
        else {
            return;
        };
        if !std::mem::replace(&mut self.judged, true) {
            tries::judge(pool, addr, in_flight.backend(), verdict);
        }
    }

    /// The current try's span (see `tries::span`): the upstream request's trace context.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The current try, refused its connection, for the observers' `attempt_end` (then
    /// another backend may be tried); `None` when no try was made.
    pub fn refused(&mut self, ctx: &RequestCtx) -> Option<AttemptReport> {
        let report = self.report(ctx, AttemptOutcome::ConnectError)?;
        self.reported = true;
        Some(report)
    }

    /// The last try, as it ended with the request (`error`, if it failed), for the
    /// observers' `attempt_end`; `None` when no try was made or its end was told already.
    pub fn last_attempt(&self, ctx: &RequestCtx, error: Option<&Error>) -> Option<AttemptReport> {
        if self.reported {
            return None;
        }
        let status = ctx.progress().upstream_status;
        let outcome = match error {
            None => AttemptOutcome::Response,
            Some(e) if e.esource() == &ErrorSource::Downstream => AttemptOutcome::ClientGone,
            Some(_) if status.is_some() => AttemptOutcome::Broken,
            Some(e) if is_connect_failure(e) => AttemptOutcome::ConnectError,
            Some(e) if is_timeout(e) => AttemptOutcome::Timeout,
            Some(_) => AttemptOutcome::Error,
        };
        self.report(ctx, outcome)
    }

    fn report(&self, ctx: &RequestCtx, outcome: AttemptOutcome) -> Option<AttemptReport> {
        let (Some(started), Some(pool), Some(backend)) =
            (self.started, ctx.pool(), ctx.progress().backend)
        else {
            return None;
        };
        Some(AttemptReport {
            number: ctx.progress().attempts,
            pool: std::sync::Arc::clone(&pool.name),
            backend,
            started,
            elapsed: started.elapsed(),
            status: ctx.progress().upstream_status,
            outcome,
            span: self.span.clone(),
        })
    }
}
