//! The selector's series. `speculative_acceptance_ratio` is a name the seeds' dashboards use;
//! the rest are `sluice_speculative_*` and the target-equivalent cost (the core counts every
//! answer's tokens and cost, `sluice_tokens_total` and `sluice_cost_dollars_total`).

use sluice_sdk::escalation::reason;
use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, inc_by, set_gauge, touch};
use sluice_sdk::ratio::RatioWindow;
use std::sync::LazyLock;

metric!(ACCEPTANCE: Gauge = register_gauge!(
    "speculative_acceptance_ratio",
    "Share of the selector's requests served by a draft pool without escalation, last 5 minutes."
));

metric!(REQUESTS: IntCounterVec = register_int_counter_vec!(
    "sluice_speculative_requests_total",
    "Requests the speculative selector handled, by the pool that answered and whether they \
     were escalated.",
    &["pool", "escalated"]
));

metric!(ESCALATIONS: IntCounterVec = register_int_counter_vec!(
    "sluice_speculative_escalations_total",
    format!("Requests sent to the target pool, by reason ({}).", REASONS.join(", ")),
    &["reason"]
));

metric!(COST: CounterVec = register_counter_vec!(
    "sluice_speculative_cost_dollars_total",
    "What the selector's answers cost, by the pool that answered, at its price: the part of \
     sluice_cost_dollars_total that sluice_cost_target_equivalent_dollars_total is set \
     against.",
    &["pool"]
));

metric!(COST_ON_TARGET: CounterVec = register_counter_vec!(
    "sluice_cost_target_equivalent_dollars_total",
    "What the tokens of the selector's answers would have cost on the model's target pool: \
     the saving is this minus sluice_speculative_cost_dollars_total.",
    &["pool"]
));

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
    for r in REASONS {
        touch(&ESCALATIONS, &[r]);
    }
    for pool in pools {
        touch(&COST, &[pool]);
        touch(&COST_ON_TARGET, &[pool]);
    }
    let _ = &*ACCEPTANCE;
}

/// One finished request: which pool answered, and why it was escalated, if it was.
pub fn request(pool: &str, escalated: Option<&str>) {
    let was_escalated = if escalated.is_some() { "yes" } else { "no" };
    inc(&REQUESTS, &[pool, was_escalated]);
    if let Some(reason) = escalated {
        inc(&ESCALATIONS, &[reason]);
    }
    set_gauge(&ACCEPTANCE, WINDOW.record(escalated.is_none()));
}

/// What the tokens one answer of the selector's used on `pool` cost there, and would have
/// cost on the target.
pub fn cost(pool: &str, prompt: u64, completion: u64, price: f64, target_price: f64) {
    // Counts come from the upstream: never trusted not to overflow.
    let millions = prompt.saturating_add(completion) as f64 / 1e6;
    inc_by(&COST, &[pool], millions * price);
    inc_by(&COST_ON_TARGET, &[pool], millions * target_price);
}
