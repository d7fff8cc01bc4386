//! The breaker's own series; its rejections are counted by the core in
//! `router_rejections_total{reason="kv-pressure",priority}`.

use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, set};
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

/// Creates every pool's series at 0 (closed), so dashboards see them from start-up.
pub fn init(pools: &Pools) {
    for pool in pools.iter() {
        for p in Priority::ALL {
            set_shedding(&pool.name, p, false);
        }
    }
}

pub fn set_shedding(pool: &str, priority: Priority, shedding: bool) {
    set(&SHEDDING, &[pool, priority.as_str()], i64::from(shedding));
}

pub fn rerouted(from: &str, to: &str) {
    inc(&REROUTED, &[from, to]);
}
