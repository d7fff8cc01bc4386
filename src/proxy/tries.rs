//! One try of one backend, for both paths: counted against the backend while it runs (the
//! balancer and the breaker see it before the next scrape does), and judged once it ends
//! (passive health: failures in a row eject the backend for a while). Each try has a span,
//! a child of the request's: [`span`] opens it, and the core's trace observer records how it
//! ended (`crate::observers`).
//!
//! ```text
//! request span    early_request hooks done ─────────────────────────── logging: status, pool… ┐
//!  (RequestCtx)     │                                                                        closed
//!   attempt span    ├─ begin (backend chosen) ── run ── ended: status, outcome ─ attempt_end ┘
//!   attempt span    └─ begin (next backend / retry / escalation) ── … ─ ended ─ attempt_end
//! ```

use crate::metrics;
use pingora_error::Error;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use sluice_sdk::client::Watched;
use sluice_sdk::headers::is_event_stream;
use sluice_sdk::{BackendLive, ErrorReply, InFlight, Pool, Reason, RequestCtx, Selected, Verdict};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Starts a try of `backend`, which may come to hold `tokens` KV tokens: it joins `tried`,
/// becomes the request's backend, and counts as in flight until the guard is dropped; an
/// LLM request's prompt, less what the backend's prefix cache is credited with, counts as
/// prefilling there until [`first_byte`], and only that part's TTFT teaches the backend's
/// prefill speed (none when the credit is a guess).
pub fn begin(
    ctx: &mut RequestCtx,
    tried: &mut Vec<SocketAddr>,
    backend: &Selected,
    tokens: u64,
) -> InFlight {
    tried.push(backend.addr);
    let prompt_tokens = ctx.llm().map_or(0, |call| call.demand.prompt_tokens);
    let pool = ctx.pool().map(|pool| Arc::clone(&pool.name));
    let progress = ctx.progress_mut();
    progress.backend = Some(backend.addr);
    progress.attempts += 1;
    let computed = prompt_tokens.saturating_sub(backend.cached_tokens.unwrap_or(0));
    // The flow is served its prefill now, before the next of its pool's waiters is let in.
    if let (Some(flow), Some(pool)) = (ctx.flow(), ctx.pool()) {
        pool.flow_control().charge(flow, computed);
    }
    let mut in_flight = backend.live.begin_request(tokens, computed);
    if backend.cached_tokens.is_none() {
        in_flight.without_learning();
    }
    if let Some(pool) = pool.filter(|_| prompt_tokens > 0) {
        in_flight.predict(backend.predicted_ttft, backend.predicted_wait, pool);
    }
    in_flight
}

/// The trace span of a try of `backend` of `pool`, the request's `number`th, under the
/// request's span; none (no cost but a branch) when the request is not traced. Only traces
/// see it: no log line is written inside an attempt's span.
pub fn span(ctx: &RequestCtx, pool: &Pool, backend: SocketAddr) -> tracing::Span {
    leg_span(ctx, pool, backend, ctx.progress().attempts, false)
}

/// [`span`] of the `attempt`th attempt, or of the prefill leg before it (which comes before
/// the attempt is counted).
fn leg_span(
    ctx: &RequestCtx,
    pool: &Pool,
    backend: SocketAddr,
    attempt: u32,
    prefill_leg: bool,
) -> tracing::Span {
    if !ctx.traced() {
        return tracing::Span::none();
    }
    let span = crate::telemetry::kept(true, || {
        tracing::info_span!(
            target: "sluice::attempt",
            parent: ctx.span(),
            "attempt",
            sluice.attempt = attempt,
            http.response.status_code = tracing::field::Empty,
            sluice.outcome = tracing::field::Empty,
            otel.name = tracing::field::Empty,
            otel.kind = tracing::field::Empty,
        )
    });
    crate::telemetry::describe_attempt(&span, ctx, pool, backend, prefill_leg);
    span
}

/// The span of a disaggregated request's prefill leg, sent to `pool`'s `backend` before
/// the request's next attempt.
pub fn prefill_span(ctx: &RequestCtx, pool: &Pool, backend: SocketAddr) -> tracing::Span {
    leg_span(ctx, pool, backend, ctx.progress().attempts + 1, true)
}

/// The attempt's first answer byte came (`header` is the upstream's response header): the
/// request stops counting as prefill on its backend. A 200 event stream's first chunk is its
/// first token: its time teaches the backend's prefill speed and is compared with what was
/// predicted, and is an event of the attempt's `span`. Only the first call counts.
pub fn first_byte(in_flight: &mut InFlight, header: Option<&ResponseHeader>, span: &tracing::Span) {
    let first_token = header.is_some_and(|h| h.status.as_u16() == 200 && is_event_stream(h));
    let Some(waited) = in_flight.first_byte(first_token) else {
        return;
    };
    if first_token {
        tracing::info!(target: sluice_sdk::SPAN_EVENTS, parent: span, "first_token");
    }
    if let (true, Some(predicted), Some(pool)) = (first_token, waited.predicted, in_flight.pool()) {
        metrics::ttft_prediction(pool, predicted, waited.observed);
    }
}

/// Counts a try's end for or against its backend, which is ejected for a while after the
/// pool's `outlier_detection.consecutive_failures` failures in a row, unless the pool has
/// its `max_ejection_percent` out already.
pub fn judge(pool: &Pool, addr: SocketAddr, live: &BackendLive, verdict: Verdict) {
    let may_eject = verdict == Verdict::Success || pool.may_eject_another();
    if let Some(cool_down) = live.record_in_pool(verdict, &pool.settings.outlier, may_eject) {
        metrics::inc(&metrics::EJECTIONS, &[&pool.name]);
        tracing::warn!(
            pool = &*pool.name,
            backend = %addr,
            "backend ejected for {} after failing",
            humantime::format_duration(cool_down)
        );
    }
}

/// 503 when a pool has no backend left to try: all unhealthy, ejected or already tried.
pub fn no_backend(pool: &Pool) -> Box<Error> {
    ErrorReply::unavailable(
        Reason::NoHealthyBackend,
        format!("No healthy backend of pool `{}` is available.", pool.name),
        1,
    )
    .into_error()
}

/// Waits for `pool`, which has no ready backend, to get a usable one (a pod scaled from zero
/// joining, one starting becoming ready), up to its `no_backend_wait`. Returns the pool to
/// send the request to once one is usable (the pool's newest generation: a reload may have
/// come meanwhile); `None` when the request does not wait (no wait configured, the waiting
/// room full: the caller answers `no-healthy-backend`); a 503 `backend-wait-timeout` when
/// none came in time. With `session`, whose body has been read whole, a client that leaves
/// ends the wait (a plain route's body may still be on its way: watching would eat it).
pub async fn wait_for_backend(
    session: Option<&mut Session>,
    pool: &Arc<Pool>,
) -> Result<Option<Arc<Pool>>, Box<Error>> {
    let wait = pool.settings.no_backend_wait;
    if wait.is_zero() {
        return Ok(None);
    }
    let Some(_waiting) = pool.waiting_room().enter() else {
        return Ok(None);
    };
    let deadline = tokio::time::Instant::now() + wait;
    let waited = match session {
        Some(session) => {
            sluice_sdk::client::session::watch(session, pool.usable_backend(), deadline).await
        }
        None => match tokio::time::timeout_at(deadline, pool.usable_backend()).await {
            Ok(newest) => Watched::Done(newest),
            Err(_) => Watched::Deadline,
        },
    };
    match waited {
        Watched::Done(newest) => Ok(Some(newest)),
        Watched::ClientGone(e) => Err(e),
        Watched::Deadline => Err(ErrorReply::unavailable(
            Reason::BackendWaitTimeout,
            format!(
                "Pool `{}` had no ready backend within {}.",
                pool.name,
                humantime::format_duration(wait)
            ),
            1,
        )
        .into_error()),
    }
}

/// The longest pause a backend's back-pressure buys it: a lying or broken upstream cannot
/// take itself out for longer.
const MAX_BACK_PRESSURE: Duration = Duration::from_secs(60);

/// The pause a backend asks for with a 429 or 503: its `Retry-After` (seconds), or OpenAI's
/// `x-ratelimit-reset-requests` / `-tokens` (`1s`, `6m0s`), the longest of them, capped.
pub fn back_pressure(header: &ResponseHeader) -> Option<Duration> {
    if !matches!(header.status.as_u16(), 429 | 503) {
        return None;
    }
    let value = |name: &str| header.headers.get(name).and_then(|v| v.to_str().ok());
    let retry_after = value("retry-after")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|secs| Duration::try_from_secs_f64(secs).ok());
    let resets = ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"]
        .into_iter()
        .filter_map(value)
        .filter_map(|v| humantime::parse_duration(v.trim()).ok());
    retry_after
        .into_iter()
        .chain(resets)
        .max()
        .filter(|pause| !pause.is_zero())
        .map(|pause| pause.min(MAX_BACK_PRESSURE))
}

/// Honours a backend's back-pressure: no new request goes to it until its pause is over.
///
/// Scoped to what caused it. When the pool forwards the client's own API key and no tenant
/// was identified, the 429 may be about that key's quota upstream (another Sluice, a
/// provider), not the backend: one client's limit must not pause the backend for everyone.
/// And a pause is bounded as ejections are ([`Pool::may_pause_another`]).
pub fn honour_back_pressure(ctx: &RequestCtx, live: &BackendLive, header: &ResponseHeader) {
    let Some(pause) = back_pressure(header) else {
        return;
    };
    let Some(pool) = ctx.pool() else {
        return;
    };
    let clients_own = pool.settings.forward_client_key && ctx.tenant().is_none();
    if clients_own || !pool.may_pause_another() {
        tracing::info!(
            pool = &*pool.name,
            "backend asked for a pause of {}; not taken: {}",
            humantime::format_duration(pause),
            if clients_own {
                "it may be about the client's own key"
            } else {
                "too many of the pool's backends are out"
            }
        );
        return;
    }
    live.cool_down(pause);
    tracing::info!(
        pool = &*pool.name,
        "backend asked for a pause of {}",
        humantime::format_duration(pause)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)]) -> ResponseHeader {
        let mut h = ResponseHeader::build(status, None).unwrap();
        for (name, value) in headers {
            h.insert_header(name.to_string(), *value).unwrap();
        }
        h
    }

    #[test]
    fn a_backend_asks_for_a_pause_with_429_or_503_only() {
        let pause = |status, headers| back_pressure(&answer(status, headers));
        assert_eq!(
            pause(429, &[("retry-after", "2")]),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            pause(503, &[("retry-after", "0.5")]),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            pause(
                429,
                &[("retry-after", "1"), ("x-ratelimit-reset-tokens", "6m0s")]
            ),
            Some(MAX_BACK_PRESSURE),
            "the longest, capped"
        );
        assert_eq!(
            pause(429, &[("x-ratelimit-reset-requests", "1s")]),
            Some(Duration::from_secs(1))
        );
        assert_eq!(pause(500, &[("retry-after", "2")]), None);
        assert_eq!(pause(429, &[("retry-after", "soon")]), None);
        assert_eq!(pause(429, &[]), None);
    }
}
