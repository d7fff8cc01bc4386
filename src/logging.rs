//! Logging: `tracing` for Sluice, with Pingora's `log` records bridged in. `RUST_LOG`, when
//! set, wins over the config's level.

use crate::config::{LogFormat, LogSettings};
use tracing_subscriber::EnvFilter;

pub fn init(settings: &LogSettings) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
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
