//! The cache's series. `llm_cache_hit_ratio` and the per-result counters are names the seeds'
//! dashboards use; the rest are `sluice_cache_*`.

use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, observe, set, set_gauge, touch};
use sluice_sdk::ratio::RatioWindow;
use std::sync::LazyLock;

metric!(REQUESTS: IntCounterVec = register_int_counter_vec!(
    "llm_cache_requests_total",
    "LLM requests seen by the cache, by result: hit, miss, bypass, coalesced.",
    &["result"]
));

metric!(HIT_RATIO: Gauge = register_gauge!(
    "llm_cache_hit_ratio",
    "Share of cache lookups answered from the cache (hits and coalesced) over the last 5 minutes."
));

metric!(LOOKUP: HistogramVec = register_histogram_vec!(
    "sluice_cache_lookup_seconds",
    "Time of cache lookups, by store.",
    &["store"],
    vec![0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
));

metric!(COALESCED_FIRST_BYTE: HistogramVec = register_histogram_vec!(
    "sluice_cache_coalesced_first_byte_seconds",
    "Time to first byte of coalesced followers, by how they were served: live (the leader's \
     stream as it came) or answer (its stored answer).",
    &["via"],
    vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
));

metric!(WRITES: IntCounterVec = register_int_counter_vec!(
    "sluice_cache_writes_total",
    format!(
        "Write-backs by outcome: {} (stored: handed to the store).",
        WRITE_OUTCOMES.join(", ")
    ),
    &["outcome"]
));

metric!(STORE_ERRORS: IntCounterVec = register_int_counter_vec!(
    "sluice_cache_lookup_errors_total",
    "Lookups that failed (the request went on as a miss), by store and kind.",
    &["store", "kind"]
));

metric!(MEMORY_ENTRIES: IntGauge = register_int_gauge!(
    "sluice_cache_memory_entries",
    "Entries held by the memory store."
));

metric!(MEMORY_BYTES: IntGauge = register_int_gauge!(
    "sluice_cache_memory_bytes",
    "Bytes held by the memory store (entries weighed in KiB)."
));

metric!(SEMANTIC_LOOKUPS: IntCounterVec = register_int_counter_vec!(
    "sluice_cache_semantic_lookups_total",
    format!(
        "Semantic lookups after an exact miss, by result: {}.",
        SEMANTIC_RESULTS.join(", ")
    ),
    &["result"]
));

metric!(SEMANTIC_VERIFIED: IntCounterVec = register_int_counter_vec!(
    "sluice_cache_semantic_verifications_total",
    "Upstream answers compared with a semantic neighbour's, by embeddings pool and result: \
     right (the same answer) or wrong (a hit would have been a wrong answer).",
    &["pool", "result"]
));

metric!(SEMANTIC_ERROR_RATE: GaugeVec = register_gauge_vec!(
    "sluice_cache_semantic_error_rate",
    "The learned upper bound on the error of a semantic hit at the similarity from which \
     entries without examples of their own are served (1 while none is), by embeddings pool.",
    &["pool"]
));

metric!(SEMANTIC_THRESHOLD: GaugeVec = register_gauge_vec!(
    "sluice_cache_semantic_threshold",
    "The similarity from which entries without examples of their own are served (1 while \
     none is), by embeddings pool; entries with examples have thresholds of their own.",
    &["pool"]
));

metric!(SEMANTIC_EMBED: HistogramVec = register_histogram_vec!(
    "sluice_cache_semantic_embed_seconds",
    "Time of the embedding calls of semantic lookups, by embeddings pool.",
    &["pool"],
    vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
));

metric!(SEMANTIC_OVERHEAD: HistogramVec = register_histogram_vec!(
    "sluice_cache_semantic_lookup_overhead_seconds",
    "What a semantic lookup added to its request besides the embedding call (reading the \
     question, the group's digest, the index's scan, the neighbour's entry), by embeddings \
     pool.",
    &["pool"],
    vec![
        0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025,
        0.005, 0.01, 0.025
    ]
));

metric!(SEMANTIC_ENTRIES: IntGauge = register_int_gauge!(
    "sluice_cache_semantic_entries",
    "Questions held by the semantic index."
));

/// Every result `semantic_lookup` is called with.
pub const SEMANTIC_RESULTS: [&str; 10] = [
    "hit",
    "verify",
    "explore",
    "miss",
    "no_question",
    "too_long",
    "agent",
    "unavailable",
    "bad_answer",
    "index_failed",
];

/// Every outcome `write` is called with.
const WRITE_OUTCOMES: [&str; 5] = ["stored", "too_big", "incomplete", "not_ok", "dropped"];

/// Every series at zero from start-up.
pub fn init(store: &str) {
    for result in ["hit", "miss", "bypass", "coalesced"] {
        touch(&REQUESTS, &[result]);
    }
    for outcome in WRITE_OUTCOMES {
        touch(&WRITES, &[outcome]);
    }
    touch(&LOOKUP, &[store]);
    for via in ["live", "answer"] {
        touch(&COALESCED_FIRST_BYTE, &[via]);
    }
    let _ = (
        &*SEMANTIC_ENTRIES,
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
    inc(&REQUESTS, &[label]);
    if result != Outcome::Bypass {
        let hit = matches!(result, Outcome::Hit | Outcome::Coalesced);
        set_gauge(&HIT_RATIO, WINDOW.record(hit));
    }
}

pub fn lookup(store: &str, seconds: f64) {
    observe(&LOOKUP, &[store], seconds);
}

pub fn coalesced_first_byte(live: bool, seconds: f64) {
    let via = if live { "live" } else { "answer" };
    observe(&COALESCED_FIRST_BYTE, &[via], seconds);
}

pub fn lookup_error(store: &str, kind: &str) {
    inc(&STORE_ERRORS, &[store, kind]);
}

pub fn write(outcome: &str) {
    inc(&WRITES, &[outcome]);
}

pub fn memory_usage(entries: i64, bytes: i64) {
    set_gauge(&MEMORY_ENTRIES, entries);
    set_gauge(&MEMORY_BYTES, bytes);
}

/// The semantic series at zero (and the bound at 1) from start-up, for embeddings `pool`.
pub fn init_semantic(pool: &str) {
    for result in SEMANTIC_RESULTS {
        touch(&SEMANTIC_LOOKUPS, &[result]);
    }
    for result in ["right", "wrong"] {
        touch(&SEMANTIC_VERIFIED, &[pool, result]);
    }
    touch(&SEMANTIC_EMBED, &[pool]);
    touch(&SEMANTIC_OVERHEAD, &[pool]);
    semantic_bound(pool, None);
}

pub fn semantic_lookup(result: &str) {
    inc(&SEMANTIC_LOOKUPS, &[result]);
}

pub fn semantic_embed(pool: &str, seconds: f64) {
    observe(&SEMANTIC_EMBED, &[pool], seconds);
}

pub fn semantic_overhead(pool: &str, seconds: f64) {
    observe(&SEMANTIC_OVERHEAD, &[pool], seconds);
}

pub fn semantic_verified(pool: &str, right: bool) {
    inc(
        &SEMANTIC_VERIFIED,
        &[pool, if right { "right" } else { "wrong" }],
    );
}

/// The serving threshold and the error bound there, `None` while there is none.
pub fn semantic_bound(pool: &str, bound: Option<(f32, f64)>) {
    let (threshold, error) = bound.map_or((1.0, 1.0), |(t, e)| (f64::from(t), e));
    set(&SEMANTIC_THRESHOLD, &[pool], threshold);
    set(&SEMANTIC_ERROR_RATE, &[pool], error);
}

pub fn semantic_entries(entries: usize) {
    set_gauge(&SEMANTIC_ENTRIES, entries as i64);
}
