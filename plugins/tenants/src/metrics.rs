//! Per-tenant series. Their `tenant` label takes configured names only (and `anonymous`), since
//! every key, from the file or from Redis, names a configured tenant: the cardinality is the
//! operator's. Refusals before a tenant is known (a 401) are under `-`.

use crate::limits::Usage;
use sluice_sdk::metric;
use sluice_sdk::metrics::{inc, inc_by, touch};
use sluice_sdk::Reason;
use std::sync::Arc;

metric!(REQUESTS: IntCounterVec = register_int_counter_vec!(
    "sluice_tenant_requests_total",
    "Requests by tenant, whatever their outcome.",
    &["tenant"]
));

metric!(TOKENS: IntCounterVec = register_int_counter_vec!(
    "sluice_tenant_tokens_total",
    "Tokens used by tenant, from the answers' usage (cached answers use none), by kind: \
     input or output.",
    &["tenant", "kind"]
));

metric!(COST: CounterVec = register_counter_vec!(
    "sluice_tenant_cost_dollars_total",
    "What the tenant's answers cost, in dollars, at the answering pool's \
     price_per_million_tokens.",
    &["tenant"]
));

metric!(REJECTIONS: IntCounterVec = register_int_counter_vec!(
    "sluice_tenant_rejections_total",
    "Errors Sluice answered itself, by tenant and reason (as router_rejections_total).",
    &["tenant", "reason"]
));

/// Creates every tenant's series at zero, so dashboards see them from start-up.
pub fn init(tenants: &[Arc<str>]) {
    for tenant in tenants {
        touch(&REQUESTS, &[tenant]);
        touch(&COST, &[tenant]);
        for kind in ["input", "output"] {
            touch(&TOKENS, &[tenant, kind]);
        }
    }
}

pub fn request(tenant: &str) {
    inc(&REQUESTS, &[tenant]);
}

pub fn used(tenant: &str, usage: &Usage) {
    inc_by(&TOKENS, &[tenant, "input"], usage.input_tokens);
    inc_by(&TOKENS, &[tenant, "output"], usage.output_tokens);
    inc_by(&COST, &[tenant], usage.usd);
}

pub fn rejected(tenant: &str, reason: Reason) {
    // 499 (the client left) is never answered, so never a rejection.
    if reason != Reason::ClientClosed {
        inc(&REJECTIONS, &[tenant, reason.as_str()]);
    }
}
