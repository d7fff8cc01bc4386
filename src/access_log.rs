//! What the end of every request records: the request metrics (`conf/README.md` lists them)
//! and one access-log line, each by a core observer of its own (`crate::observers`).

use crate::metrics::{self, status_class};
use pingora_error::Error;
use sluice_sdk::{Reason, RequestCtx, Route};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::LazyLock;
use std::time::Instant;

/// The longest a client-chosen value (a model name, an error message that quotes one) is
/// logged: a client must not be able to write megabytes into the log.
const MAX_LOGGED_CHARS: usize = 256;

/// `text`, cut to [`MAX_LOGGED_CHARS`] characters.
pub fn truncated(text: &str) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(MAX_LOGGED_CHARS) {
        Some((end, _)) => format!("{}…", text.get(..end).unwrap_or_default()).into(),
        None => text.into(),
    }
}

/// Counts a finished client request in the request metrics.
pub fn count(ctx: &RequestCtx) {
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
}

/// Writes a finished client request's access-log line.
pub fn write(ctx: &RequestCtx, error: Option<&Error>) {
    let elapsed = ctx.started().elapsed();
    let progress = ctx.progress();
    let status = progress.status.unwrap_or(0);
    let pool = ctx.pool_name();
    let placement = progress.placement;
    tracing::info!(
        target: "sluice::access",
        request_id = ctx.request_id().unwrap_or("-"),
        route = ctx.route().label(),
        model = %truncated(ctx.model().unwrap_or("-")),
        pool,
        backend = %progress.backend.map_or_else(|| "-".to_string(), |b| b.to_string()),
        attempts = progress.attempts,
        status,
        upstream_status = progress.upstream_status.unwrap_or(0),
        bytes = progress.response_bytes,
        duration_ms = %Millis(Some(elapsed)),
        ttfb_ms = %Millis(progress.first_byte),
        ttft_predicted_ms = %SecondsAsMillis(placement.map(|p| p.predicted_ttft)),
        ttft_runner_up_ms = %SecondsAsMillis(placement.and_then(|p| p.runner_up).map(|(_, t)| t)),
        session_moved = placement.is_some_and(|p| p.session_moved),
        cache_hit = ctx.answered_locally(),
        incomplete = progress.response_incomplete,
        trace_id = %crate::telemetry::trace_id(ctx).unwrap_or_else(|| "-".into()),
        error = %error.map_or_else(String::new, |e| truncated(&e.to_string()).into_owned()),
        "request"
    );
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

/// Seconds (a prediction) as milliseconds with one decimal; `-` when unknown or not finite.
struct SecondsAsMillis(Option<f64>);

impl std::fmt::Display for SecondsAsMillis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.filter(|s| s.is_finite()) {
            Some(s) => write!(f, "{:.1}", s * 1000.0),
            None => f.write_str("-"),
        }
    }
}

/// Refusals that come in floods exactly when the log matters most (shed by the breaker, over
/// a cap, the memory budget spent, nothing healthy to send to) are counted by reason and
/// logged as one summary at most every [`SUMMARY_EVERY_SECS`], never one line each.
pub fn overload_refusal(reason: Reason) -> bool {
    let Some(index) = OVERLOAD.iter().position(|r| *r == reason) else {
        return false;
    };
    SUMMARY.note(index);
    true
}

const OVERLOAD: [Reason; 7] = [
    Reason::KvPressure,
    Reason::QueueTimeout,
    Reason::QueueFull,
    Reason::NoHealthyBackend,
    Reason::BackendWaitTimeout,
    Reason::TooManyRequests,
    Reason::MemoryBudget,
];

const SUMMARY_EVERY_SECS: u64 = 10;

static SUMMARY: LazyLock<Summary> = LazyLock::new(|| Summary {
    start: Instant::now(),
    counts: Default::default(),
    logged_at: AtomicU64::new(0),
});

struct Summary {
    start: Instant,
    counts: [AtomicU64; OVERLOAD.len()],
    /// Seconds since `start` (+1) of the last summary; 0: none yet.
    logged_at: AtomicU64,
}

impl Summary {
    fn note(&self, index: usize) {
        if let Some(count) = self.counts.get(index) {
            count.fetch_add(1, Relaxed);
        }
        let now = self.start.elapsed().as_secs() + 1;
        let last = self.logged_at.load(Relaxed);
        let due = last == 0 || now >= last + SUMMARY_EVERY_SECS;
        // One caller per period writes the summary.
        if !due
            || self
                .logged_at
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_err()
        {
            return;
        }
        let counts: Vec<String> = OVERLOAD
            .iter()
            .zip(&self.counts)
            .map(|(reason, count)| (reason, count.swap(0, Relaxed)))
            .filter(|(_, n)| *n > 0)
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        let since = if last == 0 {
            "so far".to_string()
        } else {
            format!("in the last {} s", now - last)
        };
        tracing::warn!(
            "refused requests {since} (by reason): {}",
            counts.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_values_are_cut_for_the_log() {
        assert_eq!(truncated("llama"), "llama");
        let long = "é".repeat(10_000);
        let cut = truncated(&long);
        assert_eq!(cut.chars().count(), MAX_LOGGED_CHARS + 1);
        assert!(cut.ends_with('…'));
    }
}
