//! The pools' housekeeping, beside discovery and the health checks: on each pool's health
//! interval it lets drained backends go once nothing runs on them, learns the models and LoRA
//! adapters its backends list, asks its admission control (so that what that reports, the
//! breaker's shedding gauge, follows the pool's load even while no request comes), and
//! publishes its membership and prefix-index counters. So the health service only checks
//! health, and discovery only says what the sources list.

use crate::metrics;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use sluice_sdk::{Pool, Pools, Priority};
use std::sync::Arc;
use tokio::time::{interval, MissedTickBehavior};

/// The background service that keeps every pool of the current generation.
pub struct KeeperService {
    pools: tokio::sync::watch::Receiver<Arc<Pools>>,
}

impl KeeperService {
    pub fn new(pools: tokio::sync::watch::Receiver<Arc<Pools>>) -> Self {
        Self { pools }
    }
}

#[async_trait]
impl BackgroundService for KeeperService {
    async fn start(&self, shutdown: ShutdownWatch) {
        per_pool(self.pools.clone(), shutdown, keep).await;
    }
}

/// Runs `task` for every pool of the current generation, until the next generation replaces
/// them (its own tasks then start) or the server shuts down: the shape of every per-pool
/// background service (this keeper, the health checks).
pub async fn per_pool<F, Fut>(
    mut pools: tokio::sync::watch::Receiver<Arc<Pools>>,
    mut shutdown: ShutdownWatch,
    task: F,
) where
    F: Fn(Arc<Pool>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        // Dropped (its tasks aborted) when the generation changes.
        let mut tasks = tokio::task::JoinSet::new();
        for pool in pools.borrow_and_update().iter() {
            tasks.spawn(task(Arc::clone(pool)));
        }
        tokio::select! {
            _ = shutdown.changed() => return,
            changed = pools.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

/// Keeps one pool, on its health interval, until the next generation replaces it.
async fn keep(pool: Arc<Pool>) {
    // From what the pool's index counted so far: a reload hands a pool the running one's
    // index, whose counts were published already.
    let mut prefix_seen = PrefixCounts::default();
    prefix_seen.seen_up_to_now(&pool);
    let mut tick = interval(pool.settings.health.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let left = pool.sweep();
        if !left.is_empty() {
            crate::discovery::drained(&pool, &left);
        }
        pool.learn_adapters();
        if let Some(models) = pool.learn_models() {
            tracing::info!(pool = &*pool.name, models = ?models, "pool serves the models its backends list");
        }
        for priority in Priority::ALL {
            pool.sheds(priority);
        }
        publish_membership(&pool);
        prefix_seen.publish(&pool);
    }
}

/// The pool's prefix index counters (atomics of the pool's), as last published to the
/// `sluice_prefix_tokens_total` counters.
#[derive(Default)]
struct PrefixCounts {
    looked_up: u64,
    predicted: u64,
    reported: u64,
}

impl PrefixCounts {
    /// Takes what the pool counted so far as published.
    fn seen_up_to_now(&mut self, pool: &Pool) {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(routing) = pool.prefix() {
            self.looked_up = routing.looked_up_tokens.load(Relaxed);
            self.predicted = routing.predicted_tokens.load(Relaxed);
            self.reported = routing.reported_tokens.load(Relaxed);
        }
    }

    /// Adds what the pool counted since the last call.
    fn publish(&mut self, pool: &Pool) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(routing) = pool.prefix() else {
            return;
        };
        for (kind, seen, now) in [
            (
                "looked_up",
                &mut self.looked_up,
                routing.looked_up_tokens.load(Relaxed),
            ),
            (
                "predicted",
                &mut self.predicted,
                routing.predicted_tokens.load(Relaxed),
            ),
            (
                "reported",
                &mut self.reported,
                routing.reported_tokens.load(Relaxed),
            ),
        ] {
            let delta = now.saturating_sub(*seen);
            if delta > 0 {
                sluice_sdk::metrics::inc_by(&metrics::PREFIX_TOKENS, &[&pool.name, kind], delta);
            }
            *seen = now;
        }
    }
}

/// Counts the pool's backends by discovery state (`sluice_discovery_endpoints`).
fn publish_membership(pool: &Pool) {
    const STATES: [&str; 4] = ["ready", "draining", "unknown", "ejected"];
    let mut counts = [0i64; 4];
    for member in pool.members().iter() {
        let state = member.discovery_state();
        if let Some(i) = STATES.iter().position(|s| *s == state) {
            counts[i] += 1;
        }
    }
    for (state, count) in STATES.iter().zip(counts) {
        metrics::set(&metrics::DISCOVERY_ENDPOINTS, &[&pool.name, state], count);
    }
}
