//! Per-tenant rate limits and budgets, kept in this process or shared through Redis.
//!
//! One [`Limiter`] per process holds every tenant's limits. The plugin adds each tenant to
//! it once, at start ([`Limiter::add`]), and keeps the [`TenantLimits`] it gets back to serve
//! each of the tenant's requests: [`TenantLimits::admit`] once the body is parsed, with the
//! estimate ([`Want`]: the prompt's tokens, and `max_tokens` × sequences);
//! [`Admitted::settle`] after the answer, with its `usage`; dropping the [`Admitted`] ends
//! the request's concurrency slot.
//!
//! # What is limited, and how
//!
//! - **Requests per minute**: GCRA (burst of the whole minute, refilled evenly). Locally it is
//!   governor's, one direct limiter per tenant on a tokio-based clock.
//! - **Input and output tokens per minute**: GCRA *with debt*, written here (`gcra.rs`),
//!   because governor cannot do what these need: it cannot refund cells, cannot charge cells
//!   after the fact beyond its burst (into debt), and counts in `u32` cells. The estimate is
//!   charged at admission; `settle` refunds what was over-estimated and charges what was
//!   under-estimated, even into debt, so a tenant that overshot waits it off. A request
//!   wanting more than a whole minute's tokens is let in only on a full bucket (then owes the
//!   rest): refusing it for ever would give a client without `max_tokens` nothing to back off
//!   to. With no usage (`None`: an answer cut short), the estimate stays charged.
//! - **Concurrent requests**: a counter per tenant in this process, **local only, also with
//!   the Redis store**: `max_concurrent` is per replica (N replicas admit up to N ×). Shared
//!   slots would need leases renewed for the length of a stream and expired for a crashed
//!   replica; not done.
//! - **Budgets**: spend in whole micro-dollars per UTC calendar day and month, charged by
//!   `settle` with `usage.usd`. A tenant is refused (429 `budget-exceeded`, `retry-after` until
//!   the window renews) once the spend reached the budget: the request that crosses it is
//!   let through, as its cost is known only afterwards. `mode: shadow` counts the spend and
//!   the admissions over budget (`sluice_tenant_budget_overruns_total{mode="shadow"}`) and
//!   never refuses.
//!
//! The checks of one admission run as one step and charge only if all pass, in this order:
//! concurrency, budget, input tokens, output tokens, requests (the refusal names the first
//! that refused). A refused request costs nothing.
//!
//! # Answers
//!
//! Over a limit: 429 `rate-limited`, `retry-after` in whole seconds (at least 1), and the
//! headers OpenAI sends, which its SDKs read to back off: `x-ratelimit-limit-requests`,
//! `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` (time until the limit is
//! back to full, in OpenAI's format: `20ms`, `1s`, `6m0s`), and the same for `-tokens`. OpenAI
//! has one token limit where Sluice has two: the `-tokens` headers report the one that
//! refused, else the one nearest exhaustion (least remaining as a share of its limit).
//! Successful answers of a limited tenant carry the same headers ([`Admitted::headers`]).
//! Over `max_concurrent`: 429 `rate-limited` with `retry-after: 1` and no per-minute headers.
//! Locally, `-requests` headers of an admission refused before the request limiter was asked
//! (by a token limit) are derived from that limiter's last answer: governor cannot be read
//! without taking a cell.
//!
//! # Shared through Redis (`limits_store.kind: redis`)
//!
//! One Lua script call (EVALSHA through redis-rs' `Script`, which reloads it on NOSCRIPT)
//! does every per-minute and budget check of an admission atomically,
//! with the same GCRA-with-debt arithmetic as the local buckets (requests included, as Redis
//! has no governor), on Redis' own clock (`TIME`) so replicas' clocks do not matter. Keys are
//! `<key_prefix>{<tenant>}:req|in|out|usd:d:<day>|usd:m:<month>`: the hash tag keeps a
//! tenant's keys on one Redis Cluster slot. Token keys expire when their bucket is full again,
//! spend keys a day after their window. The correction after the answer is a second script,
//! sent from a spawned task. A replica keeps at most one admission call per tenant in flight:
//! the admissions that arrive meanwhile go in the next call together, which checks them in
//! order, each seeing the charges of those before it, as separate calls arriving at the same
//! instant would. An admission that gives up while queued (timed out, or its client left) is
//! dropped from the queue, not charged. Under load a round trip then serves a batch (up to
//! 64), not one request; an admission alone goes at once. Budget windows (day, month) are
//! those of this replica's UTC clock. [`Limiter::snapshot`] shows what a recent admission of
//! each tenant saw on this replica.
//!
//! When Redis does not answer within `timeout` (or errs, or is in its cool-down after
//! `failure_threshold` consecutive failed calls), each failed admission is counted in
//! `sluice_tenant_limit_store_errors_total{op,kind}` and `on_redis_error` decides:
//! - `local` (default): this replica's own buckets decide, with the same arithmetic as the
//!   `local` store, as if it were the only replica (N replicas: at most N times the limits,
//!   where failing open let a flood through: 78 requests over a limit of 5 while a restarted
//!   Redis was not used again). The answer's usage corrects the local buckets and is sent to
//!   Redis too, if it is back by then, as with `allow`. A cooling link asks Redis every 250 ms
//!   whether it is back and uses it again at its first answer.
//! - `allow`: fail open. The request is admitted without the shared limits (the
//!   local concurrency limit still applies) and without `x-ratelimit-*` headers; its usage is
//!   still sent to Redis by `settle`, if Redis is back by then.
//! - `deny`: fail closed, with **503** `rate-limited` and `retry-after: 1`. Not 429: the
//!   tenant is not over its limit, Sluice cannot tell, and 503 is what clients retry on
//!   without treating it as their own fault.
//!
//! A replica keeps at most one correction call per tenant in flight: the corrections of the
//! answers that end meanwhile are summed and sent in the next call, so a busy tenant costs
//! Redis one settle per batch rather than one per answer. A lost correction (Redis down at
//! `settle`) is counted (`op="settle"`) and dropped, with whatever was summed into it: the
//! estimates stay charged and the spend is not counted.
//!
//! Tenants not given to [`Limiter::start`] are not limited.

mod budget;
mod config;
mod gcra;
mod metrics;
mod remote;
mod reply;

pub(crate) use reply::anthropic_header;
mod tenant;

#[cfg(test)]
mod tests;

pub use config::{
    BudgetConfig, BudgetMode, LimitsConfig, OnRedisError, RedisConfig, StoreConfig, StoreKind,
};

use budget::{unix_now, Windows};
use http::HeaderValue;
use remote::RedisStore;
use reply::Readings;
use serde::Serialize;
use sluice_sdk::ErrorReply;
use std::collections::HashMap;
use std::sync::Arc;
use tenant::{Clock, Slot, TenantState};

/// What an admission is expected to cost, estimated from the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Want {
    /// The prompt's tokens.
    pub input_tokens: u64,
    /// The most the answer may produce: `max_tokens` × sequences.
    pub output_tokens: u64,
}

/// What an answer cost, from its `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub input_tokens: u64,
    /// `usage.completion_tokens`.
    pub output_tokens: u64,
    /// Its price in dollars; negative or not finite counts as nothing.
    pub usd: f64,
}

/// One tenant's limits and use, for `/status`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantUse {
    pub tenant: String,
    /// `local`: exact, now. `redis`: as this replica's last admission of the tenant saw it
    /// (`None` before any).
    pub store: &'static str,
    pub requests_per_minute: Option<u32>,
    pub requests_remaining: Option<u64>,
    pub input_tokens_per_minute: Option<u64>,
    pub input_tokens_remaining: Option<u64>,
    pub output_tokens_per_minute: Option<u64>,
    pub output_tokens_remaining: Option<u64>,
    pub max_concurrent: Option<u32>,
    /// Requests of the tenant in flight in this replica.
    pub in_flight: u32,
    pub usd_per_day: Option<f64>,
    /// Spend in the current UTC day (`None` unknown: Redis keeps spend only for budgets).
    pub usd_spent_today: Option<f64>,
    pub usd_per_month: Option<f64>,
    pub usd_spent_this_month: Option<f64>,
    pub budget_mode: BudgetMode,
}

pub(crate) enum Store {
    Local,
    Redis(RedisStore),
}

/// Where every tenant's limits are kept: one per process, shared by the tenants' states.
pub(crate) struct Backing {
    pub clock: Clock,
    pub store: Store,
    pub on_error: OnRedisError,
}

/// Every tenant's limits; one per process, shared by all requests.
pub struct Limiter {
    backing: Arc<Backing>,
    tenants: HashMap<Arc<str>, TenantLimits>,
}

/// One tenant's limits, handed out once (when the plugin starts), not looked up per request.
#[derive(Clone)]
pub struct TenantLimits(Arc<TenantState>);

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("tenants", &self.tenants.len())
            .finish_non_exhaustive()
    }
}

impl Limiter {
    /// Built in the plugin's start(), before its tenants are added. Redis connects in the
    /// background: this never waits for it.
    pub fn new(store: &StoreConfig) -> Limiter {
        let store_kind = match store.kind {
            StoreKind::Local => Store::Local,
            StoreKind::Redis => {
                metrics::init_store();
                Store::Redis(RedisStore::connect(store.redis.as_ref()))
            }
        };
        let backing = Arc::new(Backing {
            clock: Clock::new(),
            store: store_kind,
            on_error: store.on_redis_error,
        });
        Limiter {
            backing,
            tenants: HashMap::new(),
        }
    }

    /// A tenant's limits (the anonymous tenant's under `sluice_sdk::Tenant::ANONYMOUS`): kept
    /// here for `/status`, and handed back for the plugin to admit the tenant's requests with.
    pub fn add(
        &mut self,
        name: Arc<str>,
        limits: LimitsConfig,
        budget: BudgetConfig,
    ) -> TenantLimits {
        if budget.is_set() {
            metrics::init_budget(&name, budget.mode().as_str());
        }
        let state = TenantState::new(Arc::clone(&name), limits, budget, Arc::clone(&self.backing));
        let tenant = TenantLimits(Arc::new(state));
        self.tenants.insert(name, tenant.clone());
        tenant
    }

    /// A limiter with `tenants` added.
    #[cfg(test)]
    pub fn start(
        store: &StoreConfig,
        tenants: Vec<(Arc<str>, LimitsConfig, BudgetConfig)>,
    ) -> Limiter {
        let mut limiter = Limiter::new(store);
        for (name, limits, budget) in tenants {
            limiter.add(name, limits, budget);
        }
        limiter
    }

    /// [`TenantLimits::admit`] by the tenant's name; a tenant not added is admitted
    /// unlimited.
    #[cfg(test)]
    pub async fn admit(&self, tenant: &str, want: Want) -> Result<Admitted, ErrorReply> {
        match self.tenants.get(tenant) {
            Some(limits) => limits.admit(want).await,
            None => Ok(Admitted {
                readings: None,
                grant: None,
            }),
        }
    }

    /// Every configured tenant's limits and use, by name.
    pub fn snapshot(&self) -> Vec<TenantUse> {
        let windows = Windows::at(unix_now());
        let shared = matches!(self.backing.store, Store::Redis(_));
        let mut all: Vec<TenantUse> = self
            .tenants
            .values()
            .map(|t| t.0.snapshot(&windows, shared))
            .collect();
        all.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        all
    }
}

impl TenantLimits {
    /// At admission, once the body is parsed: `want` is the estimate (prompt tokens, and the
    /// output budget = max_tokens × sequences). Checks, in one go, concurrency, requests/min,
    /// input and output tokens/min, and the budget (day and month).
    pub async fn admit(&self, want: Want) -> Result<Admitted, ErrorReply> {
        let state = &self.0;
        let slot = state.enter()?;
        let (readings, charged) = match &state.backing.store {
            Store::Local => (Some(state.admit_local(want)?), want),
            Store::Redis(_) if !state.needs_store() => (None, Want::default()),
            Store::Redis(redis) => match redis.admit(state, want).await {
                Ok(answer) => (Some(state.decide_remote(&answer, want)?), want),
                Err(_) => match state.backing.on_error {
                    // Nothing was charged in Redis: settle sends the whole usage there.
                    OnRedisError::Local => {
                        let readings = state.admit_local(want)?;
                        return Ok(Admitted {
                            readings: Some(readings),
                            grant: Some(Grant {
                                slot,
                                charged: Want::default(),
                                charged_locally: Some(want),
                            }),
                        });
                    }
                    OnRedisError::Allow => (None, Want::default()),
                    OnRedisError::Deny => return Err(reply::store_unavailable()),
                },
            },
        };
        Ok(Admitted {
            readings,
            grant: Some(Grant {
                slot,
                charged,
                charged_locally: None,
            }),
        })
    }
}

struct Grant {
    /// The tenant's state; dropped with the grant: the request is no longer in flight.
    slot: Slot,
    /// What the admission charged to the token buckets (nothing when it failed open).
    charged: Want,
    /// What a Redis-backed admission charged to this replica's buckets instead, when Redis
    /// could not answer (`on_redis_error: local`).
    charged_locally: Option<Want>,
}

/// An admitted request, held for its life; dropping it ends its concurrency slot.
pub struct Admitted {
    /// What the limits said; the headers are made from it only when the answer is written.
    readings: Option<Readings>,
    grant: Option<Grant>,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted")
            .field("readings", &self.readings)
            .finish_non_exhaustive()
    }
}

impl Admitted {
    /// The most `x-ratelimit-*` headers [`Admitted::each_header`] gives.
    pub const MAX_HEADERS: usize = reply::HEADER_COUNT;

    /// The x-ratelimit-* headers for a successful answer of a limited tenant (empty when
    /// unlimited), as a list for the tests; answers use [`Admitted::each_header`].
    #[cfg(test)]
    pub fn headers(&self) -> Vec<(http::HeaderName, HeaderValue)> {
        self.readings
            .as_ref()
            .map(|r| r.headers(None))
            .unwrap_or_default()
    }

    /// Whether the answer gets `x-ratelimit-*` headers: the tenant has a per-minute limit
    /// and the store answered.
    pub fn has_headers(&self) -> bool {
        self.readings.is_some()
    }

    /// The same headers handed to `f` one by one with static names, as the response writes
    /// them, until `f` fails: no list is built per request.
    pub fn each_header<E>(
        &self,
        f: impl FnMut(http::HeaderName, HeaderValue) -> Result<(), E>,
    ) -> Result<(), E> {
        match &self.readings {
            Some(readings) => readings.each_header(None, f),
            None => Ok(()),
        }
    }

    /// After the answer: corrects the token buckets from the real usage (refunds the
    /// over-estimate, charges the under-estimate) and charges the budget with `usage.usd`.
    /// Never waits on the network. `None` usage: the estimate stays charged, and no dollars
    /// are (the plugin always settles with a usage: the estimate when none is known).
    pub fn settle(self, usage: Option<Usage>) {
        let (Some(grant), Some(usage)) = (self.grant, usage) else {
            return;
        };
        let tenant = grant.slot.tenant();
        match &tenant.backing.store {
            Store::Local => tenant.settle_local(grant.charged, usage),
            Store::Redis(redis) => {
                if let Some(charged) = grant.charged_locally {
                    tenant.settle_local(charged, usage);
                }
                let corrections = tenant.corrections(grant.charged, usage);
                redis.settle(tenant, corrections);
            }
        }
    }
}
