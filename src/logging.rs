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
use tracing_subscriber::filter::{DynFilterFn, FilterExt, LevelFilter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Pingora's HTTP/1 client logs each upstream request's raw header at `trace`, the pool's
/// credential included: that target never logs below `debug`, whatever the level asked.
const NEVER_TRACED: &str = "pingora_core::protocols::http::v1::client=debug";

/// Span events (`sluice_sdk::SPAN_EVENTS`) are for traces, never log lines.
const SPAN_EVENTS_OFF: &str = "sluice::span_event=off";

pub fn init(settings: &LogSettings, telemetry: Option<&crate::config::TelemetrySettings>) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // A second call (tests, the demo) keeps the first subscriber.
    let _ = subscriber(filter, settings.format, telemetry).try_init();
}

/// The log layer under `filter` (in `format`), and the traces layer when `telemetry` is set.
///
/// Both give a level hint: the most verbose level any layer wants is the `log` bridge's
/// maximum level, and below it a `log::trace!` of Pingora's (one per chunk of a chunked
/// answer) skips even the evaluation of its arguments.
fn subscriber(
    filter: EnvFilter,
    format: LogFormat,
    telemetry: Option<&crate::config::TelemetrySettings>,
) -> impl tracing::Subscriber + Send + Sync {
    // The cap on Pingora's client only where `trace` was asked for: added to a quieter filter,
    // its `debug` would raise the filter's level hint.
    let tracing_asked = filter
        .max_level_hint()
        .is_none_or(|l| l == LevelFilter::TRACE);
    let directives: &[&str] = if tracing_asked {
        &[NEVER_TRACED, SPAN_EVENTS_OFF]
    } else {
        &[SPAN_EVENTS_OFF]
    };
    let filter = directives
        .iter()
        .filter_map(|directive| directive.parse().ok())
        .fold(filter, EnvFilter::add_directive);
    let lines = PingoraLines::new(PINGORA_LINES_PER_SECOND);
    // Asked at every event of Pingora's (and of the `log` bridge's shared callsites, which
    // carry them), never for Sluice's own callsites, whose interest stays cached. It only
    // drops lines, so it takes any level: without a hint the pair would have none.
    let rate = DynFilterFn::new(move |meta, _| lines.admit(meta))
        .with_callsite_filter(|meta| {
            if is_pingoras(meta) || meta.target() == "log" {
                Interest::sometimes()
            } else {
                Interest::always()
            }
        })
        .with_max_level_hint(LevelFilter::TRACE);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let layer = match format {
        LogFormat::Json => fmt.json().with_filter(filter.and(rate)).boxed(),
        LogFormat::Text => fmt.with_filter(filter.and(rate)).boxed(),
    };
    // Traces of requests and attempts, when the config asks for them.
    let traces = telemetry.map(crate::telemetry::start);
    tracing_subscriber::registry().with(layer).with(traces)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{TelemetrySettings, TraceProtocol};
    use tracing::Subscriber as _;

    /// The `log` bridge's maximum level is the subscriber's hint: it must be the level asked
    /// for, traces on or off, so that Pingora's `log::trace!` arguments are never evaluated.
    #[test]
    fn the_level_hint_is_the_level_asked_for_traces_on_or_off() {
        let telemetry = TelemetrySettings {
            endpoint: "http://127.0.0.1:9/".into(),
            protocol: TraceProtocol::HttpProtobuf,
            sampling: 1.0,
            service_name: "sluice".into(),
            continue_client_traces: true,
        };
        for (level, traces, hint) in [
            ("info", None, LevelFilter::INFO),
            ("warn", None, LevelFilter::WARN),
            ("info", Some(&telemetry), LevelFilter::INFO),
            // Traces need their spans and events, at `info`.
            ("warn", Some(&telemetry), LevelFilter::INFO),
            ("debug", Some(&telemetry), LevelFilter::DEBUG),
            // Pingora's client capped at `debug` (its `trace` shows credentials).
            ("trace", None, LevelFilter::TRACE),
        ] {
            let subscriber = subscriber(EnvFilter::new(level), LogFormat::Text, traces);
            assert_eq!(
                subscriber.max_level_hint(),
                Some(hint),
                "{level}, traces {}",
                traces.is_some()
            );
        }
    }
}
