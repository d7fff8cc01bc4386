//! The KV-pressure circuit breaker: sheds load before vLLM's KV cache runs out.
//!
//! Stock vLLM has no admission control: it queues without limit until its KV cache is full,
//! then preempts or fails. This plugin decides in the request phase, per pool, whether a
//! request may enter, from the pool's *projected* KV usage (`Pool::pressure`): the usage its
//! backends last published, plus what this proxy sent since that scrape and what its requests
//! in flight may still grow to, plus the request itself. So a burst inside one scrape
//! interval cannot overshoot. A request the engine has finished holds nothing, however slowly
//! its client reads the rest of the answer (`BackendLive::finished_tokens`).
//!
//! - Priority classes: `sheddable`, `standard`, `critical`, each with its own `shed_above` and
//!   `resume_below` (hysteresis), so low priority is shed first and a pool does not flap at
//!   the threshold. The class comes from a header (`x-sluice-priority`), else the tenant's
//!   default, else `priority.default`; capped by the tenant's highest class, else
//!   `priority.max`. The tenant is the one the `tenants` plugin identified (an API key), never
//!   a header the client may set.
//! - When the preferred pool sheds a request and another pool serving its model admits it,
//!   the request goes there (`reroute`). Otherwise it waits in the pool's queue (`queue`:
//!   the pool's flow control, highest class first and the pool's fair order inside a class,
//!   up to its class's `max_wait`, none for `sheddable` by default), so a short burst is
//!   absorbed.
//! - Graded shedding (`graded_shedding: {from, to}`): a sheddable request is dropped with a
//!   chance rising from 0 at `from` to 1 at `to` of projected usage, so the fleet does not
//!   swing between all in and all out at one threshold. When no capacity comes: 503 (or
//!   `overload_status`), the OpenAI error body with the reason (`kv-pressure`,
//!   `queue-timeout`, `queue-full`), and a `retry-after` from how fast the pool is draining,
//!   bounded by the config.
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
//!     stale_as: unknown           # a backend whose metrics are stale is left out
//!     queue:
//!       enabled: true
//!       max_wait: {sheddable: 0s, standard: 2s, critical: 2s}
//!       max_queued: 256            # per pool
//!     min_retry_after: 1s
//!     max_retry_after: 30s
//! ```

pub mod config;
mod drain;
mod metrics;

pub use config::KvBreakerConfig;

use async_trait::async_trait;
use config::Thresholds;
use drain::Drain;
use http::HeaderName;
use metrics::WaitResult;
use sluice_sdk::client::while_connected;
use sluice_sdk::config::header_name;
use sluice_sdk::{
    Admission, Client, ConfigError, Error, ErrorReply, Flow, Host, LlmCall, Place, Plugin,
    PluginBuilder, Pool, Pools, Pressure, Priority, Reason, RequestCtx, Result, StaleAs, WaitFor,
};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// The section, checked, with its header names parsed.
pub struct KvBreakerBuilder {
    config: KvBreakerConfig,
    priority_header: HeaderName,
    pools: Arc<Pools>,
}

impl PluginBuilder for KvBreakerBuilder {
    const NAME: &'static str = "kv_breaker";
    type Config = KvBreakerConfig;

    fn resolve(
        config: KvBreakerConfig,
        host: &Host,
    ) -> std::result::Result<Option<Self>, ConfigError> {
        config.validate()?;
        let priority_header = header_name("priority.header", &config.priority.header)?;
        Ok(config.enabled.then(|| Self {
            config,
            priority_header,
            pools: Arc::clone(&host.pools),
        }))
    }

    fn start(self) -> Arc<dyn Plugin> {
        Arc::new(self.build())
    }
}

impl KvBreakerBuilder {
    /// The breaker, its gate installed on every pool.
    fn build(self) -> KvBreaker {
        metrics::init(&self.pools);
        let lanes: Vec<Lane> = self
            .pools
            .iter()
            .map(|pool| {
                let gate = Arc::new(Gate {
                    thresholds: self.config.thresholds.clone(),
                    stale_as: self.config.stale_as,
                    drain: Drain::default(),
                    shedding: AtomicU8::new(0),
                });
                if !pool.install_admission(gate.clone()) {
                    tracing::error!(pool = &*pool.name, "the pool has admission control already");
                }
                Lane { gate }
            })
            .collect();
        KvBreaker {
            min_retry_after: self.config.min_retry_after,
            max_retry_after: self.config.max_retry_after,
            graded: self.config.graded_shedding,
            reroute: self.config.reroute,
            overload_status: self.config.overload_status,
            max_wait: self.config.queue.max_wait,
            queue: self
                .config
                .queue
                .enabled
                .then_some(self.config.queue.max_queued),
            priority: self.config.priority,
            priority_header: self.priority_header,
            pools: self.pools,
            lanes,
        }
    }
}

pub struct KvBreaker {
    min_retry_after: Duration,
    max_retry_after: Duration,
    graded: Option<config::GradedShedding>,
    reroute: bool,
    overload_status: u16,
    max_wait: config::MaxWait,
    /// The most requests waiting for headroom in each pool's queue; `None`: no wait.
    queue: Option<usize>,
    priority: config::PriorityConfig,
    priority_header: HeaderName,
    pools: Arc<Pools>,
    /// Each pool's gate and queue, in the order of `pools`.
    lanes: Vec<Lane>,
}

/// What the breaker keeps for one pool.
struct Lane {
    gate: Arc<Gate>,
}

/// A request let in from the queue keeps its place at the head until its attempt starts.
struct Admitted {
    _place: Place,
}

/// The pool the breaker admitted the request to. A request the core moves to another pool at
/// run time (an escalation after a draft attempt) is judged again for that pool before its
/// attempt there.
struct AdmittedTo(Arc<Pool>);

/// One pool's admission control, installed on the pool: everyone who asks the pool whether
/// it takes a request (this plugin, the speculative selector, `/status`) gets an answer
/// computed from the pool's live pressure.
struct Gate {
    thresholds: Thresholds,
    stale_as: StaleAs,
    /// How fast the pool's usage is falling, for `retry-after`.
    drain: Drain,
    /// The classes being shed, one bit per [`Priority`]: the hysteresis between `shed_above`
    /// and `resume_below`. Only a refinement of the live numbers (see [`Gate::shedding`]).
    shedding: AtomicU8,
}

impl Gate {
    /// Whether `priority` is shed at `pressure`, updating the hysteresis state on the way.
    ///
    /// The state follows the pool's own projected usage, never one request's: a large
    /// request that would take the pool past `shed_above` is refused on its own (in
    /// [`Admission::admits`]), without turning shedding on for the small ones behind it.
    fn shedding(&self, pool: &Pool, pressure: &Pressure, priority: Priority) -> bool {
        // No usable backend, or nothing known: not this gate's call. The core answers
        // "no healthy backend" in the first case; unknown load is admitted.
        let Some(usage) = self.usage(pressure) else {
            return false;
        };
        self.drain.observe(usage);
        let threshold = self.thresholds.of(priority);
        let bit = 1 << priority as u8;
        let was_shedding = self.shedding.load(Relaxed) & bit != 0;
        let shed = if was_shedding {
            usage >= threshold.resume_below
        } else {
            usage >= threshold.shed_above
        };
        if shed != was_shedding {
            let before = if shed {
                self.shedding.fetch_or(bit, Relaxed)
            } else {
                self.shedding.fetch_and(!bit, Relaxed)
            };
            // Whoever flipped the bit reports it, once.
            if (before & bit != 0) != shed {
                report_change(pool, priority, shed, usage, threshold);
            }
        }
        shed
    }
}

impl Gate {
    /// The pool's projected usage, stale backends counted as configured.
    fn usage(&self, pressure: &Pressure) -> Option<f64> {
        pressure.kv_usage_counting_stale(self.stale_as)
    }
}

impl Admission for Gate {
    fn sheds(&self, pool: &Pool, priority: Priority) -> bool {
        self.shedding(pool, &pool.pressure(), priority)
    }

    fn admits(&self, pool: &Pool, priority: Priority, tokens: u64) -> bool {
        let pressure = pool.pressure();
        if self.shedding(pool, &pressure, priority) {
            return false;
        }
        let line = self.thresholds.of(priority).shed_above;
        let Some(usage) = self.usage(&pressure) else {
            return true;
        };
        let demand = match pressure.kv_capacity_tokens {
            Some(capacity) if capacity > 0.0 => tokens as f64 / capacity,
            _ => 0.0,
        };
        usage + demand < line
    }
}

/// The request's trace span (when sampled) gets what its admission waited and the pool's
/// projected KV usage then.
fn admitted_on_span(ctx: &RequestCtx, pool: &Pool, waited: std::time::Duration) {
    // Only when sampled: the projection is worked out for nobody otherwise.
    if !ctx.traced() {
        return;
    }
    let span = ctx.span();
    span.record("sluice.admission.wait_ms", waited.as_secs_f64() * 1000.0);
    if let Some(usage) = pool.pressure().kv_usage {
        span.record("sluice.kv.projection", usage);
    }
}

fn report_change(
    pool: &Pool,
    priority: Priority,
    shed: bool,
    usage: f64,
    threshold: config::Threshold,
) {
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

impl KvBreaker {
    /// The request's class: the header, else the tenant's default, else the default; capped
    /// by the tenant's highest class, else by `priority.max`.
    fn priority(&self, client: &dyn Client, ctx: &RequestCtx) -> Priority {
        let p = &self.priority;
        let tenant = ctx.tenant();
        let asked = client
            .request_header()
            .headers
            .get(&self.priority_header)
            .and_then(|v| v.to_str().ok())
            .and_then(Priority::parse);
        let default = tenant.and_then(|t| t.default_priority).unwrap_or(p.default);
        let cap = tenant.and_then(|t| t.max_priority).unwrap_or(p.max);
        asked.unwrap_or(default).min(cap)
    }

    fn lane(&self, pool: &Arc<Pool>) -> Option<&Lane> {
        self.pools
            .iter()
            .position(|p| Arc::ptr_eq(p, pool))
            .and_then(|i| self.lanes.get(i))
    }

    /// Seconds a shed client should wait: the time the pool needs, at its recent drain
    /// rate, to fall below the class's resume threshold; bounded.
    fn retry_after(&self, pool: &Arc<Pool>, priority: Priority) -> u32 {
        let min = self.min_retry_after.as_secs_f64();
        let max = self.max_retry_after.as_secs_f64();
        let lane = self.lane(pool);
        let usage = lane.and_then(|Lane { gate, .. }| gate.usage(&pool.pressure()));
        let wait = match (lane, usage) {
            (Some(Lane { gate, .. }), Some(usage)) => {
                let resume = gate.thresholds.of(priority).resume_below;
                gate.drain.seconds_to_reach(usage, resume).unwrap_or(max)
            }
            _ => max,
        };
        wait.clamp(min, max).ceil() as u32
    }

    /// Another pool serving `model` that can serve the request at all (its context and
    /// capabilities) and admits it now.
    fn reroute_target(
        &self,
        from: &Arc<Pool>,
        call: &LlmCall,
        model: &str,
        priority: Priority,
    ) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| {
            !Arc::ptr_eq(p, from)
                && p.serves(model)
                && p.fit(call).is_ok()
                && p.has_usable_backend()
                && p.admits(priority, call.demand.tokens())
        })
    }
}

#[async_trait]
impl Plugin for KvBreaker {
    fn name(&self) -> &'static str {
        KvBreakerBuilder::NAME
    }

    /// The thresholds each class is shed and resumed at, for the admin page's KV bars.
    fn status(&self) -> Option<serde_json::Value> {
        let thresholds = self.lanes.first()?.gate.thresholds.clone();
        let classes: serde_json::Map<String, serde_json::Value> = Priority::ALL
            .into_iter()
            .map(|p| {
                let t = thresholds.of(p);
                let v =
                    serde_json::json!({"shed_above": t.shed_above, "resume_below": t.resume_below});
                (p.as_str().to_string(), v)
            })
            .collect();
        Some(serde_json::json!({ "thresholds": classes }))
    }

    /// The class is a fact about the request: decided here, before any plugin's `request`
    /// hook (the selector's among them) reads it. The tenant is known by now.
    async fn early_request(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<()> {
        let priority = self.priority(client, ctx);
        ctx.set_priority(priority);
        Ok(())
    }

    async fn request(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<Flow> {
        let flow = self.admit(client, ctx).await?;
        if let Some(pool) = ctx.pool().cloned() {
            ctx.state.insert(AdmittedTo(pool));
        }
        Ok(flow)
    }

    fn upstream_select(&self, ctx: &mut RequestCtx) -> Result<()> {
        // The attempt starts now: the next waiter may ask the pool.
        ctx.state.remove::<Admitted>();
        let Some(pool) = ctx.pool().cloned() else {
            return Ok(());
        };
        let moved = ctx
            .state
            .get::<AdmittedTo>()
            .is_some_and(|admitted| !Arc::ptr_eq(&admitted.0, &pool));
        if !moved {
            return Ok(());
        }
        // Escalated at run time (a draft's timeout, error or weak answer): the target's line
        // holds for it as for any request sent there first. No wait: the client has waited
        // for the draft already.
        ctx.state.insert(AdmittedTo(Arc::clone(&pool)));
        let priority = ctx.priority().unwrap_or(self.priority.default);
        let tokens = ctx.llm().map_or(0, |call| call.demand.tokens());
        if self.lane(&pool).is_some() && !pool.admits(priority, tokens) {
            return Err(self.refusal(&pool, priority, Reason::KvPressure));
        }
        Ok(())
    }
}

impl KvBreaker {
    /// Admits the request to its pool, moves it to another that admits it, waits in the
    /// pool's queue, or refuses it.
    async fn admit(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<Flow> {
        let priority = ctx.priority().unwrap_or(self.priority.default);
        let (Some(pool), Some(call)) = (ctx.pool().cloned(), ctx.llm()) else {
            return Ok(Flow::Continue);
        };
        let tokens = call.demand.tokens();
        let dropped = self.graded_drop(&pool, priority, tokens);
        // A request that fits is admitted whatever waits (see the pool's flow control).
        if !dropped && pool.admits(priority, tokens) {
            admitted_on_span(ctx, &pool, std::time::Duration::ZERO);
            return Ok(Flow::Continue);
        }
        if self.reroute {
            let other = ctx
                .model()
                .and_then(|model| self.reroute_target(&pool, call, model, priority));
            if let Some(other) = other {
                metrics::rerouted(&pool.name, &other.name);
                ctx.send_to(Arc::clone(other));
                return Ok(Flow::Continue);
            }
        }
        // The dice were cast: waiting to cast them again would undo the curve.
        if dropped {
            return Err(self.refusal(&pool, priority, Reason::KvPressure));
        }
        let max_wait = self.max_wait.of(priority);
        let waits = !max_wait.is_zero() && !self.never_fits(&pool, priority, tokens);
        let Some(max_queued) = self.queue.filter(|_| waits && self.lane(&pool).is_some()) else {
            return Err(self.refusal(&pool, priority, Reason::KvPressure));
        };
        // In the pool's own queue, in its fair order (`pools[].fairness`).
        let joined = pool.flow_control().join(
            WaitFor::Headroom,
            priority,
            ctx.flow(),
            ctx.ttft_deadline(),
            call.demand.prompt_tokens,
            max_queued,
        );
        let Some(mut place) = joined else {
            return Err(self.refusal(&pool, priority, Reason::QueueFull));
        };
        let started = tokio::time::Instant::now();
        let deadline = started + max_wait;
        let admits = || pool.admits(priority, tokens);
        let (result, answer) = match while_connected(client, place.wait_for(deadline, admits)).await
        {
            Ok(true) => (WaitResult::Admitted, Ok(())),
            Ok(false) => (
                WaitResult::Timeout,
                Err(self.refusal(&pool, priority, Reason::QueueTimeout)),
            ),
            Err(gone) => (WaitResult::ClientGone, Err(gone)),
        };
        metrics::waited(&pool.name, result, started.elapsed().as_secs_f64());
        answer?;
        admitted_on_span(ctx, &pool, started.elapsed());
        ctx.state.insert(Admitted { _place: place });
        Ok(Flow::Continue)
    }

    /// Graded shedding: whether a sheddable request that may hold `tokens` is dropped, by
    /// the curve's chance at the pool's projected usage with it.
    fn graded_drop(&self, pool: &Arc<Pool>, priority: Priority, tokens: u64) -> bool {
        let (Some(curve), Priority::Sheddable) = (self.graded, priority) else {
            return false;
        };
        let Some(Lane { gate }) = self.lane(pool) else {
            return false;
        };
        let pressure = pool.pressure();
        let Some(usage) = gate.usage(&pressure) else {
            return false;
        };
        let demand = match pressure.kv_capacity_tokens {
            Some(capacity) if capacity > 0.0 => tokens as f64 / capacity,
            _ => 0.0,
        };
        let probability = curve.probability(usage + demand);
        let dropped = probability > 0.0 && fastrand::f64() < probability;
        metrics::graded(&pool.name, probability, dropped);
        dropped
    }

    /// Whether the request alone would take the pool past its class's line, however empty
    /// the pool: no wait can help it.
    fn never_fits(&self, pool: &Arc<Pool>, priority: Priority, tokens: u64) -> bool {
        let Some(Lane { gate }) = self.lane(pool) else {
            return false;
        };
        let line = gate.thresholds.of(priority).shed_above;
        pool.pressure()
            .kv_capacity_tokens
            .is_some_and(|capacity| capacity > 0.0 && tokens as f64 / capacity >= line)
    }

    /// The answer to a request the pool could not take: the overload status, the reason, and
    /// when to try again.
    fn refusal(&self, pool: &Arc<Pool>, priority: Priority, reason: Reason) -> Box<Error> {
        let retry_after = self.retry_after(pool, priority);
        tracing::event!(
            target: sluice_sdk::SPAN_EVENTS,
            tracing::Level::INFO,
            sluice.reason = reason.as_str(),
            sluice.pool = &*pool.name,
            sluice.priority = priority.as_str(),
            "shed"
        );
        let why = match reason {
            Reason::QueueTimeout => "no capacity came within the admission wait",
            Reason::QueueFull => "its admission queue is full",
            _ => "it sheds requests of this class",
        };
        let message = format!(
            "Pool `{}` is near its KV-cache capacity and {why} ({} request); retry after {retry_after} s.",
            pool.name,
            priority.as_str()
        );
        ErrorReply {
            status: self.overload_status,
            ..ErrorReply::unavailable(reason, message, retry_after)
        }
        .into_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::Load;
    use sluice_sdk::{BackendSpec, PoolSettings};
    use sluice_testkit::{routed_chat, run_until_waiting, FakeClient};

    fn breaker() -> (Arc<dyn Plugin>, Arc<Pool>, Thresholds) {
        breaker_with(KvBreakerConfig {
            enabled: true,
            ..KvBreakerConfig::default()
        })
    }

    fn breaker_with(config: KvBreakerConfig) -> (Arc<dyn Plugin>, Arc<Pool>, Thresholds) {
        let thresholds = config.thresholds.clone();
        let (breaker, pool) = built(config);
        (Arc::new(breaker), pool, thresholds)
    }

    /// The breaker of `config` on a pool of one backend.
    fn built(config: KvBreakerConfig) -> (KvBreaker, Arc<Pool>) {
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
        let host = Host {
            pools: Arc::new(Pools::new(vec![Arc::clone(&pool)])),
            memory: sluice_sdk::MemoryBudget::new(1 << 20),
            calls: Arc::new(sluice_sdk::calls::NoPools),
        };
        let builder = KvBreakerBuilder::resolve(config, &host).unwrap().unwrap();
        (builder.build(), pool)
    }

    /// The pool's one backend reports `kv_usage` of a 100,000-token cache.
    fn set_usage(pool: &Pool, kv_usage: f64) {
        pool.live_at(0).unwrap().publish_load(Load {
            kv_usage: Some(kv_usage),
            running: 1.0,
            waiting: 0.0,
            kv_capacity_tokens: Some(100_000),
            spec_acceptance: None,
            lora: None,
            computed_prompt_tokens: None,
            engine: None,
            scraped_at: std::time::Instant::now(),
        });
    }

    #[test]
    fn a_pool_whose_metrics_went_stale_is_shed_only_when_told_to_fail_closed() {
        for (stale_as, shed) in [(StaleAs::Unknown, false), (StaleAs::Saturated, true)] {
            let (_breaker, pool, _) = breaker_with(KvBreakerConfig {
                enabled: true,
                stale_as,
                ..KvBreakerConfig::default()
            });
            let live = &pool.live_at(0).unwrap();
            for _ in 0..pool.settings.health.healthy_after {
                live.record_probe(true, &pool.settings.health);
            }
            // Its last readable page is long gone: the backend is alive, its load unknown.
            live.publish_load(Load {
                kv_usage: Some(0.1),
                running: 1.0,
                waiting: 0.0,
                kv_capacity_tokens: Some(100_000),
                spec_acceptance: None,
                lora: None,
                computed_prompt_tokens: None,
                engine: None,
                scraped_at: std::time::Instant::now() - pool.settings.health.stale_after * 2,
            });
            assert_eq!(pool.sheds(Priority::Critical), shed, "{stale_as:?}");
            assert_eq!(pool.admits(Priority::Standard, 10), !shed, "{stale_as:?}");
        }
    }

    #[test]
    fn one_large_request_is_refused_without_shedding_the_small_ones() {
        let (_breaker, pool, thresholds) = breaker();
        let standard = thresholds.of(Priority::Standard);
        let line = standard.shed_above;
        set_usage(&pool, line - 0.1);
        // Its own 20% of the cache would take the pool past the line: refused alone.
        assert!(!pool.admits(Priority::Standard, 20_000));
        assert!(!pool.sheds(Priority::Standard));
        assert!(pool.admits(Priority::Standard, 100));

        // The pool itself past the line: shedding, until it falls below `resume_below`.
        set_usage(&pool, line + 0.01);
        assert!(!pool.admits(Priority::Standard, 0));
        assert!(pool.sheds(Priority::Standard));
        set_usage(&pool, (line + standard.resume_below) / 2.0);
        assert!(!pool.admits(Priority::Standard, 0));
        set_usage(&pool, standard.resume_below - 0.01);
        assert!(pool.admits(Priority::Standard, 0));
        assert!(!pool.sheds(Priority::Standard));
    }

    #[test]
    fn graded_shedding_drops_sheddable_requests_by_the_curve() {
        let (breaker, pool) = built(KvBreakerConfig {
            enabled: true,
            graded_shedding: Some(config::GradedShedding { from: 0.5, to: 0.7 }),
            ..KvBreakerConfig::default()
        });
        let drops = |usage: f64, priority: Priority| {
            set_usage(&pool, usage);
            (0..2000)
                .filter(|_| breaker.graded_drop(&pool, priority, 0))
                .count()
        };
        assert_eq!(drops(0.45, Priority::Sheddable), 0, "below the curve");
        let half = drops(0.6, Priority::Sheddable);
        assert!(
            (800..=1200).contains(&half),
            "about half at its middle: {half}"
        );
        assert_eq!(drops(0.7, Priority::Sheddable), 2000, "all at its end");
        assert_eq!(
            drops(0.6, Priority::Standard),
            0,
            "only the sheddable class"
        );
        // A request's own share of the cache counts: 10% more is the curve's end.
        set_usage(&pool, 0.6);
        assert!((0..100).all(|_| breaker.graded_drop(&pool, Priority::Sheddable, 10_000)));
    }

    #[test]
    fn whoever_asks_sees_the_pressure_of_now() {
        // The latch this replaced: the shedding state was only recomputed when the breaker
        // judged a request for the pool, so a pool nobody sent to stayed "shedding".
        let (_breaker, pool, thresholds) = breaker();
        set_usage(&pool, 0.99);
        assert!(pool.sheds(Priority::Standard));
        set_usage(&pool, 0.1);
        // No request passes through the breaker: asking the pool is enough.
        assert!(!pool.sheds(Priority::Standard));
        assert!(pool.admits(Priority::Standard, 10));
        assert!(0.1 < thresholds.of(Priority::Sheddable).resume_below);
    }

    /// A chat request for the pool's model, routed to the pool, as the core leaves it
    /// before `request`.
    fn routed_to(pool: &Arc<Pool>) -> RequestCtx {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}"#;
        let mut ctx = routed_chat(body);
        ctx.send_to(Arc::clone(pool));
        ctx
    }

    /// A breaker whose standard requests wait up to a minute in the pool's queue.
    fn queueing() -> (Arc<dyn Plugin>, Arc<Pool>) {
        let mut config = KvBreakerConfig {
            enabled: true,
            ..KvBreakerConfig::default()
        };
        config.queue.max_wait.standard = std::time::Duration::from_secs(60);
        let (breaker, pool, _) = breaker_with(config);
        (breaker, pool)
    }

    #[tokio::test]
    async fn a_request_waits_in_the_queue_until_the_pool_has_room() {
        let (breaker, pool) = queueing();
        set_usage(&pool, 0.99);
        let mut client = FakeClient::post("/v1/chat/completions");
        let mut ctx = routed_to(&pool);
        breaker.early_request(&mut client, &mut ctx).await.unwrap();
        {
            let asked = breaker.request(&mut client, &mut ctx);
            tokio::pin!(asked);
            run_until_waiting(&mut asked, || {
                pool.flow_control().depth(Priority::Standard) == 1
            })
            .await;
            set_usage(&pool, 0.1);
            assert!(matches!(asked.await, Ok(Flow::Continue)));
        }
        assert!(
            ctx.state.get::<Admitted>().is_some(),
            "its place is held until it is sent"
        );
        breaker.upstream_select(&mut ctx).unwrap();
        assert_eq!(pool.flow_control().depth(Priority::Standard), 0);
    }

    #[tokio::test]
    async fn a_client_that_leaves_the_queue_is_let_go_and_its_place_freed() {
        let (breaker, pool) = queueing();
        set_usage(&pool, 0.99);
        let mut client = FakeClient::post("/v1/chat/completions");
        let leave = client.leaving();
        let mut ctx = routed_to(&pool);
        let asked = breaker.request(&mut client, &mut ctx);
        tokio::pin!(asked);
        run_until_waiting(&mut asked, || {
            pool.flow_control().depth(Priority::Standard) == 1
        })
        .await;
        leave.now();
        let e = asked.await.unwrap_err();
        assert_eq!(e.etype(), &sluice_sdk::ErrorType::ConnectionClosed);
        assert!(
            ErrorReply::carried_by(&e).is_none(),
            "nobody is left to answer"
        );
        assert_eq!(pool.flow_control().depth(Priority::Standard), 0);
    }

    #[tokio::test]
    async fn a_request_the_full_queue_cannot_take_is_refused_at_once() {
        let mut config = KvBreakerConfig {
            enabled: true,
            ..KvBreakerConfig::default()
        };
        config.queue.max_queued = 1;
        config.queue.max_wait.standard = std::time::Duration::from_secs(60);
        let (breaker, pool, _) = breaker_with(config);
        set_usage(&pool, 0.99);
        let mut first = FakeClient::post("/v1/chat/completions");
        let mut first_ctx = routed_to(&pool);
        let queued = breaker.request(&mut first, &mut first_ctx);
        tokio::pin!(queued);
        run_until_waiting(&mut queued, || {
            pool.flow_control().depth(Priority::Standard) == 1
        })
        .await;
        // The one place is taken: even a critical request is not made to wait.
        let mut client =
            FakeClient::post("/v1/chat/completions").with_header("x-sluice-priority", "critical");
        let mut ctx = routed_to(&pool);
        breaker.early_request(&mut client, &mut ctx).await.unwrap();
        assert_eq!(ctx.priority(), Some(Priority::Critical));
        let e = breaker.request(&mut client, &mut ctx).await.unwrap_err();
        let reply = ErrorReply::carried_by(&e).unwrap();
        assert_eq!((reply.status, reply.reason), (503, Reason::QueueFull));
        assert!(reply.retry_after.is_some());
    }
}
