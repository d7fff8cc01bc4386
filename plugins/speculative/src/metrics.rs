//! The selector's series. SPEC.md fixes `speculative_acceptance_ratio`; the rest are
//! `sluice_speculative_*`, `sluice_tokens_total` and the cost counters.

use prometheus::{
    register_counter_vec, register_gauge, register_int_counter_vec, CounterVec, Gauge,
    IntCounterVec,
};
use sluice_sdk::escalation::reason;
use sluice_sdk::window::RatioWindow;
use std::sync::LazyLock;

static ACCEPTANCE: LazyLock<Option<Gauge>> = LazyLock::new(|| {
    register_gauge!(
        "speculative_acceptance_ratio",
        "Share of the selector's requests served by a draft pool without escalation, last 5 minutes."
    )
    .ok()
});

static REQUESTS: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    register_int_counter_vec!(
        "sluice_speculative_requests_total",
        "Requests the speculative selector handled, by the pool that answered and whether they \
         were escalated.",
        &["pool", "escalated"]
    )
    .ok()
});

static ESCALATIONS: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    register_int_counter_vec!(
        "sluice_speculative_escalations_total",
        "Requests sent to the target pool, by reason (draft-unavailable, prompt-too-long, \
         unsupported, forced, draft-error, draft-timeout, low-confidence).",
        &["reason"]
    )
    .ok()
});

static TOKENS: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    register_int_counter_vec!(
        "sluice_tokens_total",
        "Tokens by pool and kind (prompt, completion), from the answers' usage.",
        &["pool", "kind"]
    )
    .ok()
});

static COST: LazyLock<Option<CounterVec>> = LazyLock::new(|| {
    register_counter_vec!(
        "sluice_cost_dollars_total",
        "Estimated cost of the tokens each pool produced, at its configured price.",
        &["pool"]
    )
    .ok()
});

static COST_ON_TARGET: LazyLock<Option<CounterVec>> = LazyLock::new(|| {
    register_counter_vec!(
        "sluice_cost_target_equivalent_dollars_total",
        "What the same tokens would have cost on the model's target pool: the saving is this \
         minus sluice_cost_dollars_total.",
        &["pool"]
    )
    .ok()
});

static WINDOW: LazyLock<RatioWindow> = LazyLock::new(RatioWindow::default);

const REASONS: [&str; 7] = [
    reason::DRAFT_UNAVAILABLE,
    reason::PROMPT_TOO_LONG,
    reason::UNSUPPORTED,
    reason::FORCED,
    reason::DRAFT_ERROR,
    reason::DRAFT_TIMEOUT,
    reason::LOW_CONFIDENCE,
];

/// Creates the series at zero so that dashboards find them from start-up.
pub fn init(pools: &[&str]) {
    if let Some(c) = ESCALATIONS.as_ref() {
        for r in REASONS {
            let _ = c.get_metric_with_label_values(&[r]);
        }
    }
    for pool in pools {
        if let Some(c) = COST.as_ref() {
            let _ = c.get_metric_with_label_values(&[pool]);
        }
        if let Some(c) = COST_ON_TARGET.as_ref() {
            let _ = c.get_metric_with_label_values(&[pool]);
        }
    }
    let _ = &*ACCEPTANCE;
}

/// One finished request: which pool answered, and why it was escalated, if it was.
pub fn request(pool: &str, escalated: Option<&str>) {
    if let Some(c) = REQUESTS.as_ref() {
        if let Ok(c) =
            c.get_metric_with_label_values(&[pool, if escalated.is_some() { "yes" } else { "no" }])
        {
            c.inc();
        }
    }
    if let (Some(reason), Some(c)) = (escalated, ESCALATIONS.as_ref()) {
        if let Ok(c) = c.get_metric_with_label_values(&[reason]) {
            c.inc();
        }
    }
    let ratio = WINDOW.record(escalated.is_none());
    if let Some(g) = ACCEPTANCE.as_ref() {
        g.set(ratio);
    }
}

/// Tokens one answer used on `pool`, and their cost there and on the target.
pub fn tokens(pool: &str, prompt: u64, completion: u64, price: f64, target_price: f64) {
    if let Some(c) = TOKENS.as_ref() {
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            if let Ok(c) = c.get_metric_with_label_values(&[pool, kind]) {
                c.inc_by(n);
            }
        }
    }
    let millions = (prompt + completion) as f64 / 1e6;
    for (metric, p) in [(&COST, price), (&COST_ON_TARGET, target_price)] {
        if let Some(c) = metric.as_ref() {
            if let Ok(c) = c.get_metric_with_label_values(&[pool]) {
                c.inc_by(millions * p);
            }
        }
    }
}
