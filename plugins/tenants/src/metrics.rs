//! Per-tenant series. Their `tenant` label takes configured names only (and `anonymous`), since
//! every key, from the file or from Redis, names a configured tenant: the cardinality is the
//! operator's. Refusals before a tenant is known (a 401) are under `-`.

use crate::limits::Usage;
use sluice_sdk::metric;
use sluice_sdk::metrics::prometheus::{Counter, IntCounter};
use sluice_sdk::metrics::{inc, series};
use sluice_sdk::Reason;

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

/// One tenant's series, looked up once when the plugin starts (and so created at zero, for
/// dashboards to see from start-up): counting a request then takes no label lookup.
pub struct Series {
    requests: Option<IntCounter>,
    input_tokens: Option<IntCounter>,
    output_tokens: Option<IntCounter>,
    cost: Option<Counter>,
}

impl Series {
    pub fn of(tenant: &str) -> Series {
        Series {
            requests: series(&REQUESTS, &[tenant]),
            input_tokens: series(&TOKENS, &[tenant, "input"]),
            output_tokens: series(&TOKENS, &[tenant, "output"]),
            cost: series(&COST, &[tenant]),
        }
    }

    pub fn request(&self) {
        if let Some(c) = &self.requests {
            c.inc();
        }
    }

    /// Zero counts are not added: an add is a write to a line every worker thread shares.
    pub fn used(&self, usage: &Usage) {
        let add = |counter: &Option<IntCounter>, n: u64| {
            if let Some(c) = counter.as_ref().filter(|_| n > 0) {
                c.inc_by(n);
            }
        };
        add(&self.input_tokens, usage.input_tokens);
        add(&self.output_tokens, usage.output_tokens);
        if let Some(c) = self.cost.as_ref().filter(|_| usage.usd > 0.0) {
            c.inc_by(usage.usd);
        }
    }
}

pub fn rejected(tenant: &str, reason: Reason) {
    // 499 (the client left) is never answered, so never a rejection.
    if reason != Reason::ClientClosed {
        inc(&REJECTIONS, &[tenant, reason.as_str()]);
    }
}
