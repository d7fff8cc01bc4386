//! The limits' own series; their refusals are counted by the core in
//! `router_rejections_total{reason="rate-limited"|"budget-exceeded"}`.

use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, touch};

metric!(STORE_ERRORS: IntCounterVec = register_int_counter_vec!(
    "sluice_tenant_limit_store_errors_total",
    "What the shared limits store (Redis) did not take because it failed, timed out or was \
     skipped during a cool-down: op admit counts admissions (on_redis_error then decided \
     each), op settle counts calls (the corrections summed into one were lost).",
    &["op", "kind"]
));

metric!(BUDGET_OVERRUNS: IntCounterVec = register_int_counter_vec!(
    "sluice_tenant_budget_overruns_total",
    "Admissions of a tenant whose day or month budget was spent: refused (mode enforce) or \
     let through and only counted (mode shadow).",
    &["tenant", "mode"]
));

metric!(REFUNDED_ADMISSIONS: IntCounter = register_int_counter!(
    "sluice_tenant_limit_refunded_admissions_total",
    "Admissions the shared store (Redis) charged after the request had stopped waiting for \
     it (timed out, or its client left): their charge is given back, so that a request \
     admitted without the shared limits is not charged twice.",
));

/// Counts an admission charged after its request stopped waiting, and given back.
pub(crate) fn refunded_admission() {
    if let Some(c) = REFUNDED_ADMISSIONS.as_ref() {
        c.inc();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Admit,
    Settle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Timeout,
    Error,
    Cooldown,
}

impl Op {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Op::Admit => "admit",
            Op::Settle => "settle",
        }
    }
}

impl Kind {
    pub(crate) fn of(failure: &sluice_sdk::redis::RedisFailure) -> Kind {
        use sluice_sdk::redis::RedisFailure;
        match failure {
            RedisFailure::CoolingDown => Kind::Cooldown,
            RedisFailure::Error(_) => Kind::Error,
            RedisFailure::Timeout => Kind::Timeout,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Timeout => "timeout",
            Kind::Error => "error",
            Kind::Cooldown => "cooldown",
        }
    }
}

/// Creates the store's series at zero, so alerts find them from start-up.
pub(crate) fn init_store() {
    for op in [Op::Admit, Op::Settle] {
        for kind in [Kind::Timeout, Kind::Error, Kind::Cooldown] {
            touch(&STORE_ERRORS, &[op.as_str(), kind.as_str()]);
        }
    }
}

pub(crate) fn init_budget(tenant: &str, mode: &str) {
    touch(&BUDGET_OVERRUNS, &[tenant, mode]);
}

pub(crate) fn store_error(op: Op, kind: Kind) {
    inc(&STORE_ERRORS, &[op.as_str(), kind.as_str()]);
}

pub(crate) fn budget_overrun(tenant: &str, mode: &str) {
    inc(&BUDGET_OVERRUNS, &[tenant, mode]);
}
