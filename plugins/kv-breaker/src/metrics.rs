//! The breaker's own series; its rejections are counted by the core in
//! `router_rejections_total{reason="kv-pressure",priority}`.

use prometheus::{register_int_counter_vec, register_int_gauge_vec, IntCounterVec, IntGaugeVec};
use sluice_sdk::{Pools, Priority};
use std::sync::LazyLock;

static SHEDDING: LazyLock<Option<IntGaugeVec>> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "sluice_breaker_shedding",
        "1 while the KV breaker sheds requests of this priority class on this pool.",
        &["pool", "priority"]
    )
    .ok()
});

static REROUTED: LazyLock<Option<IntCounterVec>> = LazyLock::new(|| {
    register_int_counter_vec!(
        "sluice_breaker_rerouted_total",
        "Requests the KV breaker sent to another pool serving their model, because their \
         preferred pool was over pressure.",
        &["from", "to"]
    )
    .ok()
});

/// Creates every pool's series at 0 (closed), so dashboards see them from start-up.
pub fn init(pools: &Pools) {
    for pool in pools.iter() {
        for p in Priority::ALL {
            set_shedding(&pool.name, p, false);
        }
    }
}

pub fn set_shedding(pool: &str, priority: Priority, shedding: bool) {
    if let Some(g) = SHEDDING.as_ref() {
        if let Ok(g) = g.get_metric_with_label_values(&[pool, priority.as_str()]) {
            g.set(i64::from(shedding));
        }
    }
}

pub fn rerouted(from: &str, to: &str) {
    if let Some(c) = REROUTED.as_ref() {
        if let Ok(c) = c.get_metric_with_label_values(&[from, to]) {
            c.inc();
        }
    }
}
