//! The core's own observers of a request, on the plugins' hooks (see `crate::chain` for when
//! they are called): what Sluice records of its requests and attempts goes through the seam a
//! plugin uses, not through calls from the request path (its timing of its own work,
//! `sluice_added_seconds`, aside).
//!
//! - [`AttemptMetrics`]: `sluice_upstream_attempts_total`, from each attempt's end.
//! - [`RequestMetrics`]: the request counters and durations, and an engine's answer's tokens
//!   and cost, from each request's end.
//! - [`Traces`], only with `telemetry`: the trace context an upstream request carries, each
//!   attempt span's outcome and answer, the request span's facts.
//! - [`AccessLog`], only with `log.access_log`: one line per request.

use crate::{access_log, metrics, telemetry};
use pingora_error::{Error, Result};
use pingora_http::RequestHeader;
use sluice_sdk::{AttemptReport, AttemptStart, Plugin, RequestCtx, Route};
use std::sync::Arc;

/// The observers this process's config turns on, in the order they hear of a request's end
/// (the access log last: it reads the trace id).
pub fn enabled(access_log: bool) -> Vec<Arc<dyn Plugin>> {
    let mut observers: Vec<Arc<dyn Plugin>> =
        vec![Arc::new(AttemptMetrics), Arc::new(RequestMetrics)];
    if telemetry::enabled() {
        observers.push(Arc::new(Traces));
    }
    if access_log {
        observers.push(Arc::new(AccessLog));
    }
    observers
}

/// Counts each attempt by pool and outcome.
pub struct AttemptMetrics;

impl Plugin for AttemptMetrics {
    fn name(&self) -> &'static str {
        "attempt_metrics"
    }

    fn attempt_end(&self, attempt: &AttemptReport, _ctx: &mut RequestCtx) {
        metrics::attempt(&attempt.pool, attempt.outcome);
    }
}

/// Counts each request, and an engine's answer's tokens and their cost (once: not a cache
/// hit's).
pub struct RequestMetrics;

impl Plugin for RequestMetrics {
    fn name(&self) -> &'static str {
        "request_metrics"
    }

    fn logging(&self, _error: Option<&Error>, ctx: &mut RequestCtx) {
        if let (Some(usage), Some(pool), false) = (ctx.usage(), ctx.pool(), ctx.answered_locally())
        {
            metrics::answered_usage(pool, usage);
        }
        access_log::count(ctx);
    }
}

/// Traces: the upstream's trace context, the attempt spans' ends, the request span's facts.
pub struct Traces;

impl Plugin for Traces {
    fn name(&self) -> &'static str {
        "traces"
    }

    /// An LLM route's engine is always told how the attempt is traced (the client's trace
    /// headers never reach it: see `telemetry::trace_upstream`). A plain route's upstream is
    /// the client's to trace: it gets Sluice's context only when the request is traced, and
    /// the client's headers as they came otherwise.
    fn upstream_request(
        &self,
        request: &mut RequestHeader,
        attempt: &AttemptStart<'_>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if ctx.traced() || matches!(ctx.route(), Route::Llm(_)) {
            telemetry::trace_upstream(request, attempt.span, ctx.traced())
        } else {
            Ok(())
        }
    }

    fn attempt_end(&self, attempt: &AttemptReport, ctx: &mut RequestCtx) {
        telemetry::attempt_ended(attempt, ctx);
    }

    fn logging(&self, _error: Option<&Error>, ctx: &mut RequestCtx) {
        telemetry::request_ended(ctx);
    }
}

/// One access-log line per request.
pub struct AccessLog;

impl Plugin for AccessLog {
    fn name(&self) -> &'static str {
        "access_log"
    }

    fn logging(&self, error: Option<&Error>, ctx: &mut RequestCtx) {
        access_log::write(ctx, error);
    }
}
