//! One try of one backend, for both paths: counted against the backend while it runs (the
//! balancer and the breaker see it before the next scrape does), and judged once it ends
//! (passive health: failures in a row eject the backend for a while).

use crate::metrics;
use pingora_error::Error;
use sluice_sdk::{BackendLive, ErrorReply, InFlight, Pool, Reason, RequestCtx, Selected, Verdict};
use std::net::SocketAddr;

/// Starts a try of `backend`, which may come to hold `tokens` KV tokens: it joins `tried`,
/// becomes the request's backend, and counts as in flight until the guard is dropped.
pub fn begin(
    ctx: &mut RequestCtx,
    tried: &mut Vec<SocketAddr>,
    backend: &Selected,
    tokens: u64,
) -> InFlight {
    tried.push(backend.addr);
    let progress = ctx.progress_mut();
    progress.backend = Some(backend.addr);
    progress.attempts += 1;
    backend.live.begin(tokens)
}

/// Counts a try's end for or against its backend, which is ejected for a while after the
/// pool's `outlier_detection.consecutive_failures` failures in a row, unless the pool has
/// its `max_ejection_percent` out already.
pub fn judge(pool: &Pool, addr: SocketAddr, live: &BackendLive, verdict: Verdict) {
    let may_eject = verdict == Verdict::Success || pool.may_eject_another();
    if let Some(cool_down) = live.record_in_pool(verdict, &pool.outlier, may_eject) {
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
