//! The health service: beside the request path, it probes every backend's `/health` and
//! scrapes its vLLM `/metrics` on the pool's interval, and publishes what it learns in the
//! backend's live state (`sluice_sdk::health`), which the balancer, the KV breaker and the
//! speculative selector read without locks.
//!
//! One task per backend, on the service's own thread, so a slow backend delays only its own
//! checks. A pool's backends may change at run time (discovery): one task per pool follows
//! its set, starts a backend's checks when it joins and stops them when it leaves (letting
//! drained backends go is the pool keeper's, `crate::keeper`). Probes reuse their connections
//! (Pingora's connector pool). A large page is parsed on Tokio's blocking pool, within the
//! pool's health timeout, so that a hostile or broken page cannot hold that one thread and
//! stall every other backend's checks.
//!
//! A page with some invalid lines is read without them (they are counted in
//! `sluice_health_metric_lines_skipped_total`); one that cannot be trusted as a whole (cut
//! short, not a metrics page, too slow to read) publishes nothing, so the backend's load goes
//! stale rather than wrong.
//!
//! - [`exposition`]: the Prometheus text-format parser.
//! - [`vllm`]: what Sluice reads from vLLM's metrics (V0 and V1 names).
//! - [`probe`]: one HTTP GET with a deadline.
//! - [`kv_events`]: a backend's KV cache events, followed into its pool's prefix index
//!   (pools with `kv_events`): a subscriber per backend, beside its checker.

pub mod exposition;
pub mod kv_events;
pub mod probe;
pub mod vllm;
mod zmtp;

use crate::metrics;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use exposition::{Limits, PageError, ParseError};
use pingora_core::connectors::http::v1::Connector;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::upstreams::peer::HttpPeer;
use sluice_sdk::{BackendLive, BackendState, Load, Member, Pool, Pools, Probe};
use std::collections::HashMap;
use std::net::SocketAddr;
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
    async fn start(&self, shutdown: ShutdownWatch) {
        let connector = &self.connector;
        crate::keeper::per_pool(self.pools.clone(), shutdown, |pool| {
            follow(pool, Arc::clone(connector))
        })
        .await;
    }
}

/// Keeps one pool's backends checked as its set changes: a checker (and, with an exact
/// prefix index, a KV event subscriber) per backend, started when it joins and stopped when
/// it leaves. The pool's housekeeping is the keeper's (`crate::keeper`).
async fn follow(pool: Arc<Pool>, connector: Arc<Connector>) {
    let mut changes = pool.subscribe();
    // Each backend's checker, and the address its series are labelled with.
    let mut checkers: HashMap<SocketAddr, (tokio::task::AbortHandle, String)> = HashMap::new();
    // Each backend's KV event subscriber, when the pool has an exact prefix index.
    let mut subscribers: HashMap<SocketAddr, tokio::task::AbortHandle> = HashMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        changes.borrow_and_update();
        let members = pool.members();
        checkers.retain(|addr, (task, label)| {
            let stays = members.find(*addr).is_some();
            if !stays {
                task.abort();
                if let Some(subscriber) = subscribers.remove(addr) {
                    subscriber.abort();
                }
                if let Some(routing) = pool.prefix() {
                    routing.index.remove(*addr);
                }
                if !members.iter().any(|e| &e.spec.address == label) {
                    forget_backend(&pool.name, label);
                }
            }
            stays
        });
        for endpoint in members.iter() {
            let addr = endpoint.spec.resolved;
            if checkers.contains_key(&addr) {
                continue;
            }
            let checker = Checker {
                peer: probe::peer(&pool, addr),
                pool: Arc::clone(&pool),
                endpoint: endpoint.clone(),
                connector: Arc::clone(&connector),
                spec: None,
                phases: None,
                page: PageState::Clean,
                models_due: 0,
                page_buffer: BytesMut::new(),
            };
            let label = endpoint.spec.address.clone();
            if let Some(routing) = pool.prefix() {
                let subscriber = kv_events::Subscriber {
                    pool: Arc::clone(&pool),
                    routing,
                    addr,
                    label: label.clone(),
                    connector: Arc::clone(&connector),
                    peer: probe::peer(&pool, addr),
                };
                subscribers.insert(addr, tasks.spawn(subscriber.run()));
            }
            checkers.insert(addr, (tasks.spawn(checker.run()), label));
        }
        drop(members);
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            // Reaps finished checkers (they only end when aborted).
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

/// Removes the per-backend series of a backend that left its pool.
fn forget_backend(pool: &str, backend: &str) {
    use sluice_sdk::metrics::forget;
    for s in BackendState::ALL {
        forget(&metrics::BACKEND_STATE, &[pool, backend, s.as_str()]);
    }
    for gauge in [
        &metrics::BACKEND_KV_USAGE,
        &metrics::BACKEND_RUNNING,
        &metrics::BACKEND_WAITING,
        &metrics::BACKEND_PREFILL_SPEED,
        &metrics::BACKEND_PREDICTED_TTFT,
    ] {
        forget(gauge, &[pool, backend]);
    }
    for gauge in [
        &metrics::BACKEND_HEALTHY,
        &metrics::BACKEND_IN_FLIGHT,
        &metrics::BACKEND_PREFILL_TOKENS,
    ] {
        forget(gauge, &[pool, backend]);
    }
    forget(&metrics::METRIC_LINES_SKIPPED, &[pool, backend]);
    forget(&metrics::PREFIX_INDEX_BLOCKS, &[pool, backend]);
    forget(&metrics::KV_EVENT_BATCHES, &[pool, backend]);
    forget(&metrics::KV_EVENT_LAG, &[pool, backend]);
    for outcome in ["replayed", "cleared", "restarted", "joined"] {
        forget(&metrics::KV_EVENT_GAPS, &[pool, backend, outcome]);
    }
    for reason in ["connect", "too_large", "protocol", "closed", "silent"] {
        forget(&metrics::KV_EVENT_ERRORS, &[pool, backend, reason]);
    }
}

/// Checks one backend, until its pool's follower stops it.
struct Checker {
    pool: Arc<Pool>,
    /// The backend: its address, and its live state (the same `Arc` the pool's set holds).
    endpoint: Member,
    connector: Arc<Connector>,
    /// Where the checks go: the pool's TLS settings, the checks' timeout.
    peer: HttpPeer,
    /// The spec-decode counters of the previous scrape, for the acceptance rate.
    spec: Option<vllm::SpecCounters>,
    /// The engine's phase histograms at the scrape the last interval was measured from.
    phases: Option<vllm::PhaseCounters>,
    /// How the last `/metrics` page read: a change is logged once, not every scrape.
    page: PageState,
    /// Checks until `/v1/models` is asked again; 0: now.
    models_due: u32,
    /// The last `/metrics` page's buffer, for the next (see `probe::get_into`).
    page_buffer: BytesMut,
}

/// The largest `/metrics` buffer a checker keeps between scrapes: vLLM's page is about
/// 100 KiB with its histograms.
const KEPT_PAGE_BUFFER: usize = 1 << 20;

/// How often a backend is asked for its models, in checks: every 10 s at the default
/// interval, when its pool has `models: auto` or it reports LoRA use; every backend is asked
/// at its first check.
const MODELS_EVERY: u32 = 40;

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
        let mut tick = interval(self.pool.settings.health.interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.pool.settings.health.enabled {
                self.check().await;
            }
            self.publish_state();
        }
    }

    fn live(&self) -> &Arc<BackendLive> {
        &self.endpoint.live
    }

    fn address(&self) -> &str {
        &self.endpoint.spec.address
    }

    /// Probes `/health` and scrapes `/metrics` at once; each has the pool's timeout.
    async fn check(&mut self) {
        let (pool, endpoint) = (Arc::clone(&self.pool), self.endpoint.clone());
        let live = &endpoint.live;
        let (policy, name, host) = (
            &pool.settings.health,
            &*pool.name,
            endpoint.spec.address.as_str(),
        );
        let probe = probe::get(
            &self.connector,
            &self.peer,
            host,
            &policy.health_path,
            policy.timeout,
        );
        let buffer = std::mem::take(&mut self.page_buffer);
        let scrape = probe::get_into(
            &self.connector,
            &self.peer,
            host,
            &policy.metrics_path,
            policy.timeout,
            buffer,
        );
        live.scrape_started();
        let (health, scrape) = tokio::join!(probe, scrape);

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

        // Every vLLM (its scrape has a KV usage) is asked once which models it serves: the
        // LoRA adapters among them route their requests (and are sent under their own name).
        // Then again, now and then, for a pool that learns its models, and a backend that
        // reports LoRA use (adapters are loaded and unloaded at run time).
        let load = live.load();
        let is_vllm = load.as_ref().is_some_and(|l| l.kv_usage.is_some());
        let serves_lora = load.as_ref().is_some_and(|l| l.lora.is_some());
        let never_asked = live.adapters().is_none();
        if pool.settings.auto_models || serves_lora || (never_asked && is_vllm) {
            self.ask_models().await;
        }

        let result = self.take_scrape(&scrape, name, host).await;
        metrics::inc(&metrics::HEALTH_CHECKS, &[name, "metrics", result]);
        // Kept while it is the size of a page; a huge one is not held between scrapes.
        if let Some(buffer) = scrape.ok().and_then(probe::Answer::into_buffer) {
            if buffer.capacity() <= KEPT_PAGE_BUFFER {
                self.page_buffer = buffer;
            }
        }
    }

    /// Reads a `/metrics` answer into the backend's load (and shares what it taught of the
    /// prefill speed with the pool); the check's result label.
    async fn take_scrape(
        &mut self,
        scrape: &Result<probe::Answer, probe::Failure>,
        name: &str,
        host: &str,
    ) -> &'static str {
        let answer = match scrape {
            Ok(answer) if answer.status == 200 => answer,
            other => return probe::result_label(other, false),
        };
        let read = self.read_metrics(answer.body.clone()).await;
        self.report_page(&read, name, host);
        match read {
            Ok(read) => {
                let live = &self.endpoint.live;
                let taught = live.engine_speed_samples();
                live.publish_load(read.load);
                if live.engine_speed_samples() > taught {
                    self.pool.share_prefill_speed(live.prefill_speed());
                }
                "ok"
            }
            Err(Unread::TooSlow) => "parse_timeout",
            Err(Unread::Unparsable(_)) => "unparsable",
        }
    }

    /// Asks the backend's `/v1/models` when it is due, and records the names it lists (and
    /// which are LoRA adapters). An answer that cannot be read leaves what was known.
    async fn ask_models(&mut self) {
        if self.models_due > 0 {
            self.models_due -= 1;
            return;
        }
        let pool = &self.pool;
        let answer = probe::get_with(
            &self.connector,
            &self.peer,
            &self.endpoint.spec.address,
            "/v1/models",
            pool.settings.health.timeout,
            pool.settings.upstream_auth.as_ref(),
        )
        .await;
        let names = match &answer {
            Ok(a) if a.status == 200 => model_names(&a.body),
            _ => None,
        };
        match names {
            Some((names, adapters)) => {
                self.endpoint.live.publish_models(names, adapters);
                pool.learn_adapters();
                self.models_due = MODELS_EVERY;
            }
            None => {
                tracing::debug!(
                    pool = &*pool.name,
                    backend = self.address(),
                    "cannot read /v1/models: {}",
                    probe::describe(&answer)
                );
                // A pool that learns its models asks until it can.
                if !pool.settings.auto_models {
                    self.models_due = MODELS_EVERY;
                }
            }
        }
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
        let budget = self.pool.settings.health.timeout;
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
        let engine = match (self.phases, m.phases) {
            (Some(previous), Some(current)) => vllm::phase_rates(previous, current),
            _ => None,
        };
        // An interval in which nothing finished is folded into the next one; a restart
        // (counters gone backwards) starts over.
        let folded = match (self.phases, m.phases) {
            (Some(previous), Some(current)) => {
                engine.is_none() && current.prefilled >= previous.prefilled
            }
            _ => false,
        };
        if !folded {
            self.phases = m.phases;
        }
        let load = Load {
            kv_usage: m.kv_usage,
            running: m.running.unwrap_or(0.0),
            waiting: m.waiting.unwrap_or(0.0),
            kv_capacity_tokens: match (m.block_size, m.num_gpu_blocks) {
                (Some(size), Some(blocks)) => Some(u64::from(size) * u64::from(blocks)),
                _ => None,
            },
            spec_acceptance,
            lora: m.lora,
            computed_prompt_tokens: m.computed_prompt_tokens,
            engine,
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
        let live = self.live();
        live.decay_ejections(&self.pool.settings.outlier);
        let (pool, backend) = (&*self.pool.name, self.address());
        let state = live.state(&self.pool.settings.health);
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
        metrics::set(
            &metrics::BACKEND_PREDICTED_TTFT,
            &[pool, backend],
            self.pool.reference_ttft(live),
        );
        if let Some(load) = live.load() {
            if let Some(kv) = load.kv_usage {
                metrics::set(&metrics::BACKEND_KV_USAGE, &[pool, backend], kv);
            }
            metrics::set(&metrics::BACKEND_RUNNING, &[pool, backend], load.running);
            metrics::set(&metrics::BACKEND_WAITING, &[pool, backend], load.waiting);
        }
    }
}

/// The `id`s of a `/v1/models` answer (OpenAI's list shape, as vLLM serves it), and of those
/// the LoRA adapters (vLLM lists them with their base model as `parent`); `None` when it is
/// not one.
fn model_names(body: &[u8]) -> Option<(Vec<String>, Vec<String>)> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: List = serde_json::from_slice(body).ok()?;
    let adapters = list
        .data
        .iter()
        .filter(|e| e.parent.is_some())
        .map(|e| e.id.clone())
        .collect();
    Some((list.data.into_iter().map(|e| e.id).collect(), adapters))
}

/// Reads a page: what Sluice uses of it, and the lines skipped. Runs off the async thread for
/// large pages, so it owns nothing borrowed.
fn read_page(
    body: &[u8],
    limits: &Limits,
) -> Result<(vllm::VllmMetrics, usize, Option<ParseError>), PageError> {
    let page = exposition::read_page(body, limits, vllm::wanted, vllm::wanted_family)?;
    Ok((vllm::read(&page.samples), page.skipped, page.first_skipped))
}
