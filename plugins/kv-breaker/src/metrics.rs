//! The breaker's own series; its rejections are counted by the core in
//! `router_rejections_total{reason="kv-pressure",priority}`.

use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, observe, series, set, touch};
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

metric!(QUEUE_DEPTH: IntGaugeVec = register_int_gauge_vec!(
    "sluice_admission_queue_depth",
    "Requests waiting in the KV breaker's admission queue of this pool for capacity.",
    &["pool", "priority"]
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
            set(&QUEUE_DEPTH, &[&pool.name, p.as_str()], 0);
        }
        for result in WaitResult::ALL {
            touch(&QUEUE_WAIT, &[&pool.name, result.as_str()]);
        }
    }
}

pub fn set_shedding(pool: &str, priority: Priority, shedding: bool) {
    set(&SHEDDING, &[pool, priority.as_str()], i64::from(shedding));
}

pub fn rerouted(from: &str, to: &str) {
    inc(&REROUTED, &[from, to]);
}

/// A request joined (`+1`) or left (`-1`) a pool's admission queue.
pub fn queued(pool: &str, priority: Priority, delta: i64) {
    if let Some(depth) = series(&QUEUE_DEPTH, &[pool, priority.as_str()]) {
        depth.add(delta);
    }
}

pub fn waited(pool: &str, result: WaitResult, seconds: f64) {
    observe(&QUEUE_WAIT, &[pool, result.as_str()], seconds);
}
