//! The KV-pressure circuit breaker: sheds load before vLLM's KV cache runs out.
//!
//! Stock vLLM has no admission control: it queues without limit until its KV cache is full,
//! then preempts or fails. This plugin decides in the request phase, per pool, whether a
//! request may enter, from the pool's *projected* KV usage (`Pool::pressure`): the usage its
//! backends last published, plus what this proxy sent since that scrape and what its requests
//! in flight may still grow to, plus the request itself. So a burst inside one scrape
//! interval cannot overshoot.
//!
//! - Priority classes: `sheddable`, `standard`, `critical`, each with its own `shed_above` and
//!   `resume_below` (hysteresis), so low priority is shed first and a pool does not flap at
//!   the threshold. The class comes from a header (`x-sluice-priority`) or the tenant's
//!   config, capped by policy.
//! - When the preferred pool sheds a request and another pool serving its model admits it,
//!   the request goes there (`reroute`). Otherwise: 503, the OpenAI error body, and a
//!   `retry-after` from how fast the pool is draining, bounded by the config.
//! - The per-backend failure breaker (closed / open / half-open on errors) is not here: it is
//!   the passive half of health checking, in `sluice_sdk::health`, because it is about one
//!   backend's faults rather than the pool's capacity.
//!
//! ```yaml
//! plugins:
//!   kv_breaker:
//!     enabled: true
//!     thresholds:
//!       sheddable: {shed_above: 0.75, resume_below: 0.70}
//!       standard:  {shed_above: 0.85, resume_below: 0.80}
//!       critical:  {shed_above: 0.95, resume_below: 0.90}
//!     priority:
//!       header: x-sluice-priority
//!       default: standard
//!       max: critical              # the highest class a header may ask for
//!       tenant_header: x-tenant    # optional: per-tenant defaults and caps
//!       tenants:
//!         batch-jobs: {default: sheddable, max: standard}
//!     min_retry_after: 1s
//!     max_retry_after: 30s
//! ```

pub mod config;
mod drain;
mod metrics;

pub use config::KvBreakerConfig;

use async_trait::async_trait;
use drain::Drain;
use http::HeaderName;
use pingora_proxy::Session;
use sluice_sdk::{ErrorReply, Flow, Plugin, Pool, Pools, Pressure, Priority, RequestCtx, Result};
use std::sync::Arc;

pub struct KvBreaker {
    config: KvBreakerConfig,
    pools: Arc<Pools>,
    /// Each pool's drain-rate tracker, in the order of `pools`.
    drains: Vec<Drain>,
    /// `priority.header` and `priority.tenant_header`, parsed once.
    priority_header: HeaderName,
    tenant_header: Option<HeaderName>,
}

impl KvBreaker {
    pub fn new(config: KvBreakerConfig, pools: Arc<Pools>) -> std::result::Result<Self, String> {
        config
            .validate()
            .map_err(|(key, message)| format!("plugins.kv_breaker.{key}: {message}"))?;
        let header = |name: &str, key: &str| {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("plugins.kv_breaker.{key}: is not a header name"))
        };
        let priority_header = header(&config.priority.header, "priority.header")?;
        let tenant_header = match &config.priority.tenant_header {
            Some(name) => Some(header(name, "priority.tenant_header")?),
            None => None,
        };
        metrics::init(&pools);
        let drains = pools.iter().map(|_| Drain::default()).collect();
        Ok(Self {
            config,
            pools,
            drains,
            priority_header,
            tenant_header,
        })
    }

    /// The request's class: header, else tenant default, else the default; capped.
    fn priority(&self, session: &Session) -> Priority {
        let p = &self.config.priority;
        let headers = &session.req_header().headers;
        let tenant = self
            .tenant_header
            .as_ref()
            .and_then(|h| headers.get(h))
            .and_then(|v| v.to_str().ok())
            .and_then(|t| p.tenants.get(t));
        let asked = headers
            .get(&self.priority_header)
            .and_then(|v| v.to_str().ok())
            .and_then(Priority::parse);
        let default = tenant.and_then(|t| t.default).unwrap_or(p.default).into();
        let cap: Priority = tenant.and_then(|t| t.max).unwrap_or(p.max).into();
        asked.unwrap_or(default).min(cap)
    }

    fn drain(&self, pool: &Arc<Pool>) -> Option<&Drain> {
        self.pools
            .iter()
            .position(|p| Arc::ptr_eq(p, pool))
            .and_then(|i| self.drains.get(i))
    }

    /// Whether `pool` admits a request of `priority` that may hold `tokens` KV tokens, and
    /// updates the pool's shedding state (with hysteresis) on the way.
    ///
    /// The state follows the pool's own projected usage, never one request's: a large
    /// request that would take the pool past `shed_above` is refused on its own, without
    /// turning shedding on for the small ones behind it (which would flap the state, its
    /// gauge and its logs with every large request).
    fn admits(
        &self,
        pool: &Arc<Pool>,
        pressure: &Pressure,
        priority: Priority,
        tokens: u64,
    ) -> bool {
        if let (Some(drain), Some(usage)) = (self.drain(pool), pressure.kv_usage) {
            drain.observe(usage);
        }
        // No usable backend, or nothing known: not this plugin's call. The core answers
        // "no healthy backend" in the first case; unknown load is admitted.
        let Some(usage) = pressure.kv_usage else {
            return true;
        };
        let threshold = self.config.thresholds.of(priority);
        let was_shedding = pool.is_shedding(priority);
        let shed = if was_shedding {
            usage >= threshold.resume_below
        } else {
            usage >= threshold.shed_above
        };
        if shed != was_shedding {
            pool.set_shedding(priority, shed);
            metrics::set_shedding(&pool.name, priority, shed);
            if shed {
                tracing::warn!(
                    pool = &*pool.name,
                    priority = priority.as_str(),
                    "KV breaker: shedding (projected KV usage {usage:.2} ≥ {})",
                    threshold.shed_above
                );
            } else {
                tracing::info!(
                    pool = &*pool.name,
                    priority = priority.as_str(),
                    "KV breaker: admitting again (projected KV usage {usage:.2} < {})",
                    threshold.resume_below
                );
            }
        }
        if shed {
            return false;
        }
        pressure
            .with_demand(tokens)
            .is_none_or(|after| after < threshold.shed_above)
    }

    /// Seconds a shed client should wait: the time the pool needs, at its recent drain
    /// rate, to fall below the class's resume threshold; bounded.
    fn retry_after(&self, pool: &Arc<Pool>, pressure: &Pressure, priority: Priority) -> u32 {
        let min = self.config.min_retry_after.as_secs_f64();
        let max = self.config.max_retry_after.as_secs_f64();
        let resume = self.config.thresholds.of(priority).resume_below;
        let wait = match (self.drain(pool), pressure.kv_usage) {
            (Some(drain), Some(usage)) => drain.seconds_to_reach(usage, resume).unwrap_or(max),
            _ => max,
        };
        wait.clamp(min, max).ceil() as u32
    }
}

#[async_trait]
impl Plugin for KvBreaker {
    fn name(&self) -> &'static str {
        "kv_breaker"
    }

    async fn request(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<Flow> {
        let priority = self.priority(session);
        ctx.priority = Some(priority);
        let (Some(pool), Some(call)) = (ctx.pool.clone(), ctx.llm.as_ref()) else {
            return Ok(Flow::Continue);
        };
        let tokens = call.demand.tokens();
        let pressure = pool.pressure();
        if self.admits(&pool, &pressure, priority, tokens) {
            return Ok(Flow::Continue);
        }
        if self.config.reroute {
            if let Some(model) = ctx.model() {
                let other = self
                    .pools
                    .iter()
                    .filter(|p| !Arc::ptr_eq(p, &pool) && p.serves(model))
                    .find(|p| {
                        let other = p.pressure();
                        other.usable > 0 && self.admits(p, &other, priority, tokens)
                    });
                if let Some(other) = other {
                    metrics::rerouted(&pool.name, &other.name);
                    ctx.pool = Some(Arc::clone(other));
                    return Ok(Flow::Continue);
                }
            }
        }
        let retry_after = self.retry_after(&pool, &pressure, priority);
        Err(ErrorReply::unavailable(
            "kv-pressure",
            format!(
                "Pool `{}` is near its KV-cache capacity and sheds {} requests; retry after {retry_after} s.",
                pool.name,
                priority.as_str()
            ),
            retry_after,
        )
        .into_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::pool::{BackendSpec, PoolSettings};

    fn breaker() -> (KvBreaker, Arc<Pool>) {
        let backend = BackendSpec {
            address: "127.0.0.1:9".into(),
            resolved: "127.0.0.1:9".parse().unwrap(),
            weight: 1,
        };
        let pool = Arc::new(Pool::new(PoolSettings::new(
            "p",
            vec!["m".into()],
            vec![backend],
        )));
        let pools = Arc::new(Pools::new(vec![Arc::clone(&pool)]));
        let config = KvBreakerConfig {
            enabled: true,
            ..KvBreakerConfig::default()
        };
        (KvBreaker::new(config, pools).unwrap(), pool)
    }

    fn pressure(kv_usage: f64) -> Pressure {
        Pressure {
            kv_usage: Some(kv_usage),
            usable: 1,
            kv_capacity_tokens: Some(100_000.0),
        }
    }

    #[test]
    fn one_large_request_is_refused_without_shedding_the_small_ones() {
        let (breaker, pool) = breaker();
        let line = breaker.config.thresholds.of(Priority::Standard).shed_above;
        let below = pressure(line - 0.1);
        // Its own 20% of the cache would take the pool past the line: refused alone.
        assert!(!breaker.admits(&pool, &below, Priority::Standard, 20_000));
        assert!(!pool.is_shedding(Priority::Standard));
        assert!(breaker.admits(&pool, &below, Priority::Standard, 100));

        // The pool itself past the line: shedding, until it falls below `resume_below`.
        let resume = breaker
            .config
            .thresholds
            .of(Priority::Standard)
            .resume_below;
        assert!(!breaker.admits(&pool, &pressure(line + 0.01), Priority::Standard, 0));
        assert!(pool.is_shedding(Priority::Standard));
        let between = pressure((line + resume) / 2.0);
        assert!(!breaker.admits(&pool, &between, Priority::Standard, 0));
        assert!(breaker.admits(&pool, &pressure(resume - 0.01), Priority::Standard, 0));
        assert!(!pool.is_shedding(Priority::Standard));
    }
}
