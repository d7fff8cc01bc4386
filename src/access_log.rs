//! What the end of every request records: the request metrics (`conf/README.md` lists them)
//! and one access-log line.

use crate::metrics::{self, status_class};
use pingora_error::Error;
use sluice_sdk::{RequestCtx, Route};

/// Records a finished client request. `access_log` turns the log line on.
pub fn record(access_log: bool, ctx: &RequestCtx, error: Option<&Error>) {
    let elapsed = ctx.started().elapsed();
    let progress = ctx.progress();
    let status = progress.status.unwrap_or(0);
    metrics::inc(
        &metrics::REQUESTS,
        &[ctx.route().label(), status_class(status)],
    );

    let pool = ctx.pool_name();
    if let Route::Llm(_) = ctx.route() {
        // The model label only takes names a pool serves: clients cannot add series.
        let model = ctx
            .model()
            .filter(|m| ctx.pool().is_some_and(|p| p.serves(m)))
            .unwrap_or("-");
        let hit = if ctx.answered_locally() {
            "true"
        } else {
            "false"
        };
        metrics::observe(
            &metrics::LLM_REQUEST_DURATION,
            &[hit, model],
            elapsed.as_secs_f64(),
        );
        let streamed = ctx.llm().is_some_and(|c| c.request.is_stream());
        if let (true, Some(ttfb)) = (streamed, progress.first_byte) {
            metrics::observe(&metrics::STREAM_FIRST_BYTE, &[pool], ttfb.as_secs_f64());
        }
    }
    if progress.upstream_status.is_some() {
        metrics::observe(
            &metrics::ROUTER_REQUEST_DURATION,
            &[pool],
            elapsed.as_secs_f64(),
        );
    }

    if access_log {
        tracing::info!(
            target: "sluice::access",
            request_id = ctx.request_id().unwrap_or("-"),
            route = ctx.route().label(),
            model = ctx.model().unwrap_or("-"),
            pool,
            backend = %progress.backend.map_or_else(|| "-".to_string(), |b| b.to_string()),
            attempts = progress.attempts,
            status,
            upstream_status = progress.upstream_status.unwrap_or(0),
            bytes = progress.response_bytes,
            duration_ms = %Millis(Some(elapsed)),
            ttfb_ms = %Millis(progress.first_byte),
            cache_hit = ctx.answered_locally(),
            incomplete = progress.response_incomplete,
            error = %error.map_or_else(String::new, |e| e.to_string()),
            "request"
        );
    }
}

/// Milliseconds with three decimals in the log; `-` when unknown.
struct Millis(Option<std::time::Duration>);

impl std::fmt::Display for Millis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, "{:.3}", d.as_secs_f64() * 1000.0),
            None => f.write_str("-"),
        }
    }
}
