//! The cache's series. SPEC.md fixes `llm_cache_hit_ratio` and the per-result counters; the
//! rest are `sluice_cache_*`.

use prometheus::{
    register_gauge, register_histogram_vec, register_int_counter_vec, register_int_gauge, Gauge,
    HistogramVec, IntCounterVec, IntGauge,
};
use sluice_sdk::window::RatioWindow;
use std::sync::LazyLock;

fn registered<T>(metric: prometheus::Result<T>) -> Option<T> {
    metric
        .map_err(|e| tracing::error!("cannot register a cache metric: {e}"))
        .ok()
}

static REQUESTS: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    registered(register_int_counter_vec!(
        "llm_cache_requests_total",
        "LLM requests seen by the cache, by result: hit, miss, bypass, coalesced.",
        &["result"]
    ))
});

static HIT_RATIO: LazyLock<Option<Gauge>> = LazyLock::new(|| {
    registered(register_gauge!(
        "llm_cache_hit_ratio",
        "Share of cache lookups answered from the cache (hits and coalesced) over the last 5 minutes."
    ))
});

static LOOKUP: LazyLock<Option<HistogramVec>> = LazyLock::new(|| {
    registered(register_histogram_vec!(
        "sluice_cache_lookup_seconds",
        "Time of cache lookups, by store.",
        &["store"],
        vec![0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
    ))
});

static WRITES: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    registered(register_int_counter_vec!(
        "sluice_cache_writes_total",
        "Write-backs by outcome: stored (handed to the store), too_big, incomplete, not_ok, dropped.",
        &["outcome"]
    ))
});

static STORE_ERRORS: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    registered(register_int_counter_vec!(
        "sluice_cache_lookup_errors_total",
        "Lookups that failed (the request went on as a miss), by store and kind.",
        &["store", "kind"]
    ))
});

static MEMORY_ENTRIES: LazyLock<Option<IntGauge>> = LazyLock::new(|| {
    registered(register_int_gauge!(
        "sluice_cache_memory_entries",
        "Entries held by the memory store."
    ))
});

static MEMORY_BYTES: LazyLock<Option<IntGauge>> = LazyLock::new(|| {
    registered(register_int_gauge!(
        "sluice_cache_memory_bytes",
        "Bytes held by the memory store (entries weighed in KiB)."
    ))
});

/// Every series at zero from start-up.
pub fn init(store: &str) {
    if let Some(c) = REQUESTS.as_ref() {
        for r in ["hit", "miss", "bypass", "coalesced"] {
            let _ = c.get_metric_with_label_values(&[r]);
        }
    }
    if let Some(c) = WRITES.as_ref() {
        for o in ["stored", "too_big", "incomplete", "not_ok", "dropped"] {
            let _ = c.get_metric_with_label_values(&[o]);
        }
    }
    if let Some(h) = LOOKUP.as_ref() {
        let _ = h.get_metric_with_label_values(&[store]);
    }
    let _ = (
        &*HIT_RATIO,
        &*STORE_ERRORS,
        &*MEMORY_ENTRIES,
        &*MEMORY_BYTES,
    );
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Hit,
    Miss,
    Bypass,
    Coalesced,
}

/// Hits (and coalesced requests) over lookups, last 5 minutes.
static WINDOW: LazyLock<RatioWindow> = LazyLock::new(RatioWindow::default);

pub fn request(result: Outcome) {
    let label = match result {
        Outcome::Hit => "hit",
        Outcome::Miss => "miss",
        Outcome::Bypass => "bypass",
        Outcome::Coalesced => "coalesced",
    };
    if let Some(c) = REQUESTS.as_ref() {
        c.with_label_values(&[label]).inc();
    }
    if result != Outcome::Bypass {
        let ratio = WINDOW.record(matches!(result, Outcome::Hit | Outcome::Coalesced));
        if let Some(g) = HIT_RATIO.as_ref() {
            g.set(ratio);
        }
    }
}

pub fn lookup(store: &str, seconds: f64) {
    if let Some(h) = LOOKUP.as_ref() {
        h.with_label_values(&[store]).observe(seconds);
    }
}

pub fn lookup_error(store: &str, kind: &str) {
    if let Some(c) = STORE_ERRORS.as_ref() {
        c.with_label_values(&[store, kind]).inc();
    }
}

pub fn write(outcome: &str) {
    if let Some(c) = WRITES.as_ref() {
        c.with_label_values(&[outcome]).inc();
    }
}

pub fn memory_usage(entries: i64, bytes: i64) {
    if let (Some(e), Some(b)) = (MEMORY_ENTRIES.as_ref(), MEMORY_BYTES.as_ref()) {
        e.set(entries);
        b.set(bytes);
    }
}
