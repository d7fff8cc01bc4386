//! Fault injection switches, changeable at run time (Rust API or `POST /sim/faults`).

use serde::{Deserialize, Serialize};

/// All fault switches. A `POST /sim/faults` body replaces the whole set: missing fields take
/// these defaults, so `{}` clears every fault.
///
/// "Chunks" count SSE events (`data: ...` lines) of a stream, the role chunk included; for a
/// non-stream answer any `*_after_chunks` fault cuts the JSON body in half instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Share (0..1) of completion requests answered with `error_status`.
    pub error_rate: f64,
    /// 429, 500, 503 (any 4xx/5xx works), in the configured error shape.
    pub error_status: u16,
    /// false: deterministic by request counter (exactly `error_rate` of every run of requests);
    /// true: each request draws at random.
    pub error_random: bool,
    /// Completion requests never get response headers.
    pub hang_before_headers: bool,
    /// Streams stop sending after K chunks and keep the connection open.
    pub hang_after_chunks: Option<u32>,
    /// Streams abort the TCP connection after K chunks (no chunked terminator).
    pub drop_after_chunks: Option<u32>,
    /// Streams send `data: {"error": ...}` + `data: [DONE]` after K chunks (a 500 inside the stream).
    pub error_after_chunks: Option<u32>,
    /// Close the listening socket (connects get ECONNREFUSED) and open connections; reopened
    /// on the same port when switched off.
    pub refuse_connections: bool,
    /// `/health` answers 503 and completions 500 with vLLM's EngineDeadError message.
    pub engine_dead: bool,
    /// Multiplies every latency (1.0 = normal).
    pub slowdown: f64,
    /// `/metrics` answers this text (200, `text/plain`) instead of the engine's page: a broken
    /// or foreign exporter, while completions and `/health` work as usual.
    pub metrics_page: Option<String>,
    /// Share (0..1) of prefill legs (`kv_transfer_params.do_remote_decode`) answered with
    /// transfer parameters for blocks that were not kept: the decode side's read fails.
    pub kv_transfer_lost: f64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            error_rate: 0.0,
            error_status: 500,
            error_random: false,
            hang_before_headers: false,
            hang_after_chunks: None,
            drop_after_chunks: None,
            error_after_chunks: None,
            refuse_connections: false,
            engine_dead: false,
            slowdown: 1.0,
            metrics_page: None,
            kv_transfer_lost: 0.0,
        }
    }
}

impl Faults {
    pub fn none() -> Self {
        Faults::default()
    }
    pub fn error_rate(rate: f64, status: u16) -> Self {
        Faults {
            error_rate: rate,
            error_status: status,
            ..Faults::default()
        }
    }

    /// Whether request number `request_number` (0-based, counted since the faults were set)
    /// gets the injected error. The counter mode spreads errors evenly: exactly
    /// floor(n * rate) of the first n requests fail.
    pub(crate) fn should_error(&self, request_number: u64) -> bool {
        let rate = self.error_rate.clamp(0.0, 1.0);
        if rate <= 0.0 {
            return false;
        }
        if self.error_random {
            return rand::random::<f64>() < rate;
        }
        let before = (request_number as f64 * rate).floor();
        let after = ((request_number + 1) as f64 * rate).floor();
        after > before
    }

    pub(crate) fn slowdown_factor(&self) -> f64 {
        if self.slowdown.is_finite() && self.slowdown > 0.0 {
            self.slowdown
        } else {
            1.0
        }
    }

    pub(crate) fn affects_streams(&self) -> bool {
        self.hang_after_chunks.is_some()
            || self.drop_after_chunks.is_some()
            || self.error_after_chunks.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_mode_is_exact() {
        let quarter = Faults::error_rate(0.25, 503);
        let hits = (0..100)
            .filter(|request| quarter.should_error(*request))
            .count();
        assert_eq!(hits, 25);
        let all = Faults::error_rate(1.0, 500);
        assert!((0..10).all(|request| all.should_error(request)));
        assert!(!(0..10).any(|request| Faults::none().should_error(request)));
    }

    #[test]
    fn empty_json_clears() {
        let cleared: Faults = serde_json::from_str("{}").unwrap();
        assert_eq!(cleared, Faults::default());
        assert!(serde_json::from_str::<Faults>(r#"{"bogus":1}"#).is_err());
    }
}
