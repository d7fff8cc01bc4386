//! The breaker's own series; its rejections are counted by the core in
//! `router_rejections_total{reason="kv-pressure",priority}`.

use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, observe, set, touch};
use sluice_sdk::{Pools, Priority};

metric!(SHEDDING: IntGaugeVec = register_int_gauge_vec!(
    "sluice_breaker_shedding",
    "1 while the KV breaker sheds requests of this priority class on this pool.",
    &["pool", "priority"]
));

metric!(REROUTED: IntCounterVec = register_int_counter_vec!(
    "sluice_breaker_rerouted_total",
    "Requests the KV breaker sent to another pool serving their model, because their \
     preferred pool was over pressure.",
    &["from", "to"]
));

metric!(SHED_PROBABILITY: GaugeVec = register_gauge_vec!(
    "sluice_breaker_shed_probability",
    "The chance a sheddable request was dropped at the pool's projected KV usage when one \
     last came (graded_shedding).",
    &["pool"]
));

metric!(GRADED_SHEDS: IntCounterVec = register_int_counter_vec!(
    "sluice_breaker_graded_sheds_total",
    "Sheddable requests dropped by graded shedding (also in \
     router_rejections_total{reason=\"kv-pressure\"}).",
    &["pool"]
));

metric!(QUEUE_WAIT: HistogramVec = register_histogram_vec!(
    "sluice_admission_wait_seconds",
    "Time requests waited in the admission queue, by how the wait ended: admitted, timeout \
     (answered queue-timeout) or client_gone.",
    &["pool", "result"],
    vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0]
));

/// How a wait in the admission queue ended.
#[derive(Clone, Copy)]
pub enum WaitResult {
    Admitted,
    Timeout,
    ClientGone,
}

impl WaitResult {
    const ALL: [WaitResult; 3] = [
        WaitResult::Admitted,
        WaitResult::Timeout,
        WaitResult::ClientGone,
    ];

    fn as_str(self) -> &'static str {
        match self {
            WaitResult::Admitted => "admitted",
            WaitResult::Timeout => "timeout",
            WaitResult::ClientGone => "client_gone",
        }
    }
}

/// Creates every pool's series at 0 (closed), so dashboards see them from start-up.
pub fn init(pools: &Pools) {
    for pool in pools.iter() {
        for p in Priority::ALL {
            set_shedding(&pool.name, p, false);
        }
        touch(&GRADED_SHEDS, &[&pool.name]);
        for result in WaitResult::ALL {
            touch(&QUEUE_WAIT, &[&pool.name, result.as_str()]);
        }
    }
}

pub fn set_shedding(pool: &str, priority: Priority, shedding: bool) {
    set(&SHEDDING, &[pool, priority.as_str()], i64::from(shedding));
}

/// A sheddable request was judged at drop chance `probability`; `dropped` or not.
pub fn graded(pool: &str, probability: f64, dropped: bool) {
    set(&SHED_PROBABILITY, &[pool], probability);
    if dropped {
        inc(&GRADED_SHEDS, &[pool]);
    }
}

pub fn rerouted(from: &str, to: &str) {
    inc(&REROUTED, &[from, to]);
}

pub fn waited(pool: &str, result: WaitResult, seconds: f64) {
    observe(&QUEUE_WAIT, &[pool, result.as_str()], seconds);
}
