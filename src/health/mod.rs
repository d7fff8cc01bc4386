//! The health service: beside the request path, it probes every backend's `/health` and
//! scrapes its vLLM `/metrics` on the pool's interval, and publishes what it learns in the
//! backend's live state (`sluice_sdk::health`), which the balancer, the KV breaker and the
//! speculative selector read without locks.
//!
//! One task per backend, on the service's own thread, so a slow backend delays only its own
//! checks. Probes reuse their connections (Pingora's connector pool). A large page is parsed
//! on Tokio's blocking pool, within the pool's health timeout, so that a hostile or broken page
//! cannot hold that one thread and stall every other backend's checks.
//!
//! A page with some invalid lines is read without them (they are counted in
//! `sluice_health_metric_lines_skipped_total`); one that cannot be trusted as a whole (cut
//! short, not a metrics page, too slow to read) publishes nothing, so the backend's load goes
//! stale rather than wrong.
//!
//! - [`exposition`]: the Prometheus text-format parser.
//! - [`vllm`]: what Sluice reads from vLLM's metrics (V0 and V1 names).
//! - [`probe`]: one HTTP GET with a deadline.

pub mod exposition;
mod probe;
pub mod vllm;

use crate::metrics;
use async_trait::async_trait;
use bytes::Bytes;
use exposition::{Limits, PageError, ParseError};
use pingora_core::connectors::http::Connector;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::upstreams::peer::HttpPeer;
use sluice_sdk::{BackendLive, BackendState, Load, Pool, Pools, Priority, Probe};
use std::sync::Arc;
use std::time::Instant;
use tokio::time::{interval, MissedTickBehavior};

/// The background service that keeps every backend's live state current.
pub struct HealthService {
    /// The current generation's pools: checked from when they come (a `SIGHUP` reload) to
    /// when the next ones replace them.
    pools: tokio::sync::watch::Receiver<Arc<Pools>>,
    /// Built from the server's upstream settings (`pingora.ca_file`, ...) as the proxy's own
    /// connector is, so a probe reaches a backend exactly as a request does. Built before the
    /// server starts: a daemon has changed its directory (and maybe its user) by then.
    connector: Arc<Connector>,
}

impl HealthService {
    pub fn new(pools: tokio::sync::watch::Receiver<Arc<Pools>>, connector: Arc<Connector>) -> Self {
        Self { pools, connector }
    }
}

#[async_trait]
impl BackgroundService for HealthService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut pools = self.pools.clone();
        loop {
            let mut tasks = self.check(&pools.borrow_and_update());
            tokio::select! {
                _ = shutdown.changed() => {
                    tasks.abort_all();
                    return;
                }
                changed = pools.changed() => {
                    tasks.abort_all();
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

impl HealthService {
    /// Starts a checker for every backend of `pools`.
    fn check(&self, pools: &Pools) -> tokio::task::JoinSet<()> {
        let mut tasks = tokio::task::JoinSet::new();
        for pool in pools.iter() {
            for index in 0..pool.backends.len() {
                let Some(spec) = pool.backends.get(index) else {
                    continue;
                };
                let checker = Checker {
                    peer: probe::peer(pool, spec.resolved),
                    pool: Arc::clone(pool),
                    index,
                    connector: Arc::clone(&self.connector),
                    spec: None,
                    page: PageState::Clean,
                };
                tasks.spawn(checker.run());
            }
        }
        tasks
    }
}

/// Checks one backend, forever.
struct Checker {
    pool: Arc<Pool>,
    index: usize,
    connector: Arc<Connector>,
    /// Where the checks go: the pool's TLS settings, the checks' timeout.
    peer: HttpPeer,
    /// The spec-decode counters of the previous scrape, for the acceptance rate.
    spec: Option<vllm::SpecCounters>,
    /// How the last `/metrics` page read: a change is logged once, not every scrape.
    page: PageState,
}

/// How a `/metrics` page that was fetched read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageState {
    Clean,
    /// Read, without some bad lines.
    Skipping,
    /// Not read at all.
    Rejected,
}

/// What a readable page gave.
struct Read {
    load: Load,
    skipped: usize,
    first_skipped: Option<ParseError>,
}

/// Why a fetched page gave no load.
enum Unread {
    /// Cut short, not a metrics page, or the parse was lost.
    Unparsable(String),
    /// Not read within the pool's health timeout.
    TooSlow,
}

impl std::fmt::Display for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unread::Unparsable(why) => f.write_str(why),
            Unread::TooSlow => f.write_str("not read within the health timeout"),
        }
    }
}

impl Checker {
    async fn run(mut self) {
        let mut tick = interval(self.pool.health.interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.pool.health.enabled {
                self.check().await;
            }
            self.publish_state();
        }
    }

    fn live(&self) -> Option<&Arc<BackendLive>> {
        self.pool.live.get(self.index)
    }

    fn address(&self) -> &str {
        self.pool
            .backends
            .get(self.index)
            .map_or("-", |b| b.address.as_str())
    }

    /// Probes `/health` and scrapes `/metrics` at once; each has the pool's timeout.
    async fn check(&mut self) {
        let pool = Arc::clone(&self.pool);
        let (Some(spec), Some(live)) = (pool.backends.get(self.index), pool.live.get(self.index))
        else {
            return;
        };
        let (policy, name, host) = (&pool.health, &*pool.name, spec.address.as_str());
        let get = |path| probe::get(&self.connector, &self.peer, host, path, policy.timeout);
        let (health, scrape) = tokio::join!(get(&policy.health_path), get(&policy.metrics_path));

        let alive = matches!(&health, Ok(answer) if answer.status == 200);
        metrics::inc(
            &metrics::HEALTH_CHECKS,
            &[name, "health", probe::result_label(&health, alive)],
        );
        match live.record_probe(alive, policy) {
            Some(Probe::Unhealthy) => tracing::warn!(
                pool = name,
                backend = host,
                "backend unhealthy: {}",
                probe::describe(&health)
            ),
            Some(_) => tracing::info!(pool = name, backend = host, "backend healthy"),
            None => {}
        }

        let result = match &scrape {
            Ok(answer) if answer.status == 200 => {
                let read = self.read_metrics(answer.body.clone()).await;
                self.report_page(&read, name, host);
                match read {
                    Ok(read) => {
                        live.publish_load(read.load);
                        "ok"
                    }
                    Err(Unread::TooSlow) => "parse_timeout",
                    Err(Unread::Unparsable(_)) => "unparsable",
                }
            }
            other => probe::result_label(other, false),
        };
        metrics::inc(&metrics::HEALTH_CHECKS, &[name, "metrics", result]);
    }

    /// Counts a read page's skipped lines, and logs when the way pages read changes: once,
    /// not on every scrape of a page that stays broken.
    fn report_page(&mut self, read: &Result<Read, Unread>, pool: &str, backend: &str) {
        let state = match read {
            Ok(read) if read.skipped > 0 => {
                let skipped = u64::try_from(read.skipped).unwrap_or(u64::MAX);
                sluice_sdk::metrics::inc_by(
                    &metrics::METRIC_LINES_SKIPPED,
                    &[pool, backend],
                    skipped,
                );
                PageState::Skipping
            }
            Ok(_) => PageState::Clean,
            Err(e) => {
                tracing::debug!(pool, backend, "cannot read /metrics: {e}");
                PageState::Rejected
            }
        };
        if state == self.page {
            return;
        }
        self.page = state;
        match read {
            Ok(Read {
                skipped,
                first_skipped: Some(first),
                ..
            }) => tracing::warn!(
                pool,
                backend,
                "reading /metrics without its {skipped} invalid lines; the first: {first}"
            ),
            Ok(_) => tracing::info!(pool, backend, "/metrics reads cleanly again"),
            Err(e) => tracing::warn!(pool, backend, "cannot read /metrics: {e}"),
        }
    }

    /// Reads a `/metrics` page within the pool's health timeout, a large one off this
    /// thread. A valid page without vLLM's series gives a load with no KV usage, which counts
    /// as stale.
    async fn read_metrics(&mut self, body: Bytes) -> Result<Read, Unread> {
        let budget = self.pool.health.timeout;
        // The parse stops itself at the deadline; the timeout below only stops waiting for it.
        let limits = Limits {
            deadline: Instant::now().checked_add(budget),
            ..Limits::default()
        };
        let work = sluice_sdk::cpu::body_work(body.len(), move || read_page(&body, &limits));
        let (m, skipped, first_skipped) = match tokio::time::timeout(budget, work).await {
            Ok(Some(Ok(read))) => read,
            Ok(Some(Err(PageError::OutOfTime { .. }))) | Err(_) => return Err(Unread::TooSlow),
            Ok(Some(Err(e))) => return Err(Unread::Unparsable(e.to_string())),
            Ok(None) => return Err(Unread::Unparsable("the parse was lost".into())),
        };
        let spec_acceptance = match (self.spec, m.spec) {
            (Some(previous), Some(current)) => vllm::acceptance_rate(previous, current),
            _ => None,
        };
        self.spec = m.spec;
        let load = Load {
            kv_usage: m.kv_usage,
            running: m.running.unwrap_or(0.0),
            waiting: m.waiting.unwrap_or(0.0),
            kv_capacity_tokens: match (m.block_size, m.num_gpu_blocks) {
                (Some(size), Some(blocks)) => Some(u64::from(size) * u64::from(blocks)),
                _ => None,
            },
            spec_acceptance,
            scraped_at: Instant::now(),
        };
        Ok(Read {
            load,
            skipped,
            first_skipped,
        })
    }

    /// Mirrors the backend's state into the per-backend gauges.
    fn publish_state(&self) {
        let Some(live) = self.live() else {
            return;
        };
        if self.index == 0 {
            // Asks the pool's admission control once a tick, so that what it reports (the
            // breaker's shedding gauge) follows the pool's load even while no request comes.
            for priority in Priority::ALL {
                self.pool.sheds(priority);
            }
        }
        live.decay_ejections(&self.pool.outlier);
        let (pool, backend) = (&*self.pool.name, self.address());
        let state = live.state(&self.pool.health);
        for s in BackendState::ALL {
            metrics::set(
                &metrics::BACKEND_STATE,
                &[pool, backend, s.as_str()],
                i64::from(s == state),
            );
        }
        metrics::set(
            &metrics::BACKEND_HEALTHY,
            &[pool, backend],
            i64::from(live.is_usable()),
        );
        metrics::set(
            &metrics::BACKEND_IN_FLIGHT,
            &[pool, backend],
            i64::from(live.in_flight()),
        );
        metrics::set(
            &metrics::BACKEND_PREFILL_TOKENS,
            &[pool, backend],
            i64::try_from(live.accounting().prefill_tokens).unwrap_or(i64::MAX),
        );
        metrics::set(
            &metrics::BACKEND_PREFILL_SPEED,
            &[pool, backend],
            live.prefill_speed(),
        );
        if let Some(ttft) = self.pool.reference_ttft(self.index) {
            metrics::set(&metrics::BACKEND_PREDICTED_TTFT, &[pool, backend], ttft);
        }
        if let Some(load) = live.load() {
            if let Some(kv) = load.kv_usage {
                metrics::set(&metrics::BACKEND_KV_USAGE, &[pool, backend], kv);
            }
            metrics::set(&metrics::BACKEND_RUNNING, &[pool, backend], load.running);
            metrics::set(&metrics::BACKEND_WAITING, &[pool, backend], load.waiting);
        }
    }
}

/// Reads a page: what Sluice uses of it, and the lines skipped. Runs off the async thread for
/// large pages, so it owns nothing borrowed.
fn read_page(
    body: &[u8],
    limits: &Limits,
) -> Result<(vllm::VllmMetrics, usize, Option<ParseError>), PageError> {
    let page = exposition::read_page(body, limits, vllm::wanted)?;
    Ok((vllm::read(&page.samples), page.skipped, page.first_skipped))
}
