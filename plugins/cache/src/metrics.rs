//! The cache's series. SPEC.md fixes `llm_cache_hit_ratio` and the per-result counters; the
//! rest are `sluice_cache_*`.

use prometheus::{
    register_gauge, register_histogram_vec, register_int_counter_vec, register_int_gauge, Gauge,
    HistogramVec, IntCounterVec, IntGauge,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{SystemTime, UNIX_EPOCH};

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
        "Write-backs by outcome: stored, too_big, incomplete, not_ok, dropped, error.",
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
        for o in [
            "stored",
            "too_big",
            "incomplete",
            "not_ok",
            "dropped",
            "error",
        ] {
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
        WINDOW.record(matches!(result, Outcome::Hit | Outcome::Coalesced));
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

/// The hit ratio over a sliding window: 30 slots of 10 seconds, each a pair of counters
/// tagged with the slot's epoch. Lock-free; a slot is reset by whoever first writes in a new
/// epoch (a racing increment may be lost then, which a ratio can afford).
struct Window {
    slots: [Slot; SLOTS],
}

const SLOTS: usize = 30;
const SLOT_SECONDS: u64 = 10;

struct Slot {
    epoch: AtomicU64,
    hits: AtomicU64,
    lookups: AtomicU64,
}

static WINDOW: LazyLock<Window> = LazyLock::new(|| Window {
    slots: std::array::from_fn(|_| Slot {
        epoch: AtomicU64::new(0),
        hits: AtomicU64::new(0),
        lookups: AtomicU64::new(0),
    }),
});

impl Window {
    fn record(&self, hit: bool) {
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / SLOT_SECONDS);
        let slot = &self.slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch.swap(epoch, Ordering::Relaxed) != epoch {
            slot.hits.store(0, Ordering::Relaxed);
            slot.lookups.store(0, Ordering::Relaxed);
        }
        slot.lookups.fetch_add(1, Ordering::Relaxed);
        if hit {
            slot.hits.fetch_add(1, Ordering::Relaxed);
        }
        let (mut hits, mut lookups) = (0, 0);
        for s in &self.slots {
            if epoch.saturating_sub(s.epoch.load(Ordering::Relaxed)) < SLOTS as u64 {
                hits += s.hits.load(Ordering::Relaxed);
                lookups += s.lookups.load(Ordering::Relaxed);
            }
        }
        if let (Some(g), true) = (HIT_RATIO.as_ref(), lookups > 0) {
            g.set(hits as f64 / lookups as f64);
        }
    }
}
