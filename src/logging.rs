//! Logging: `tracing` for Sluice, with Pingora's `log` records bridged in. `RUST_LOG`, when
//! set, wins over the config's level.
//!
//! Pingora's own lines are rate-limited per target ([`PingoraLines`]): it logs an ERROR line
//! for every failed TLS or HTTP/2 handshake and every broken downstream, so a client opening
//! and dropping connections could write as many lines as it likes (1,000 connections, 1,000
//! lines). Sluice's own lines, the access log included, are never dropped.

use crate::config::{LogFormat, LogSettings};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use tracing::subscriber::Interest;
use tracing::Metadata;
use tracing_subscriber::filter::{DynFilterFn, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Pingora's HTTP/1 client logs each upstream request's raw header at `trace`, the pool's
/// credential included: that target never logs below `debug`, whatever the level asked.
const NEVER_TRACED: &str = "pingora_core::protocols::http::v1::client=debug";

pub fn init(settings: &LogSettings, telemetry: Option<&crate::config::TelemetrySettings>) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let filter = match NEVER_TRACED.parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let lines = PingoraLines::new(PINGORA_LINES_PER_SECOND);
    // Asked at every event of Pingora's (and of the `log` bridge's shared callsites, which
    // carry them), never for Sluice's own callsites, whose interest stays cached.
    let rate = DynFilterFn::new(move |meta, _| lines.admit(meta)).with_callsite_filter(|meta| {
        if is_pingoras(meta) || meta.target() == "log" {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    });
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let layer = match settings.format {
        LogFormat::Json => fmt.json().with_filter(filter.and(rate)).boxed(),
        LogFormat::Text => fmt.with_filter(filter.and(rate)).boxed(),
    };
    // Traces of requests and attempts, when the config asks for them.
    let traces = telemetry.map(crate::telemetry::start);
    // A second call (tests, the demo) keeps the first subscriber.
    let _ = tracing_subscriber::registry()
        .with(layer)
        .with(traces)
        .try_init();
}

fn is_pingoras(meta: &Metadata<'_>) -> bool {
    meta.target().starts_with("pingora")
}

/// Lines each Pingora target may write per second, on average (a burst of as many first).
const PINGORA_LINES_PER_SECOND: f64 = 10.0;

/// A token bucket per Pingora target (`pingora_core::services::listening`, say): a target
/// over its rate loses lines until it is back under it, each counted in
/// `sluice_log_lines_dropped_total`.
struct PingoraLines {
    per_second: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl PingoraLines {
    fn new(per_second: f64) -> Self {
        Self {
            per_second,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Whether this event may be written (every event but Pingora's, always).
    fn admit(&self, meta: &Metadata<'_>) -> bool {
        if !meta.is_event() || !is_pingoras(meta) {
            return true;
        }
        let Ok(mut buckets) = self.buckets.lock() else {
            return true;
        };
        let now = Instant::now();
        // A few targets at most: Pingora's modules.
        let (tokens, at) = buckets
            .entry(meta.target().to_string())
            .or_insert((self.per_second, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.per_second)
            .min(self.per_second);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            crate::metrics::inc(&crate::metrics::LOG_LINES_DROPPED, &[meta.target()]);
            false
        }
    }
}
