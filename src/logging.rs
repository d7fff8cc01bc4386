//! Logging: `tracing` for Sluice, with Pingora's `log` records bridged in. `RUST_LOG`, when
//! set, wins over the config's level.

use crate::config::{LogFormat, LogSettings};
use tracing_subscriber::EnvFilter;

/// Pingora's HTTP/1 client logs each upstream request's raw header at `trace`, the pool's
/// credential included: that target never logs below `debug`, whatever the level asked.
const NEVER_TRACED: &str = "pingora_core::protocols::http::v1::client=debug";

pub fn init(settings: &LogSettings) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let filter = match NEVER_TRACED.parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // A second call (tests, the demo) keeps the first subscriber.
    let _ = match settings.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
