//! Discovery: the background service that keeps each pool's backends equal to the fleet that
//! exists, beside the request path.
//!
//! Each pool has at most one source; what a source learns goes through the pool's one door
//! (`Pool::update`), which keeps what is known about addresses that stay and drains the ones
//! that go (`sluice_sdk::members`). Nothing here runs on the request path: a request only
//! loads the pool's current set.
//!
//! - [`dns`]: every A/AAAA record of a name is a backend, re-resolved at the records' TTL
//!   (with `hickory-resolver`); also the re-resolution of `backends[]` host names.
//! - [`kubernetes`]: a watch of a Service's EndpointSlices (with `kube`'s watcher).
//! - [`inference_pool`]: a watch of a Gateway API Inference Extension `InferencePool` and of
//!   the pods its selector picks, one backend per pod and target port.
//!
//! On a source's error the pool keeps what it last knew; the error is counted in
//! `sluice_discovery_errors_total` and logged once per streak.

pub mod dns;
pub mod inference_pool;
pub mod kubernetes;

use crate::metrics;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use sluice_sdk::{Change, Pool, Wanted};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Where a pool's backends come from, when not only from its config.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// `backends[]` with host names: each re-resolved at its TTL, one backend each.
    Names(Vec<dns::NamedBackend>),
    /// `discovery.dns`.
    Dns(dns::DnsSource),
    /// `discovery.kubernetes`.
    Kubernetes(kubernetes::KubernetesSource),
    /// `discovery.inference_pool`.
    InferencePool(inference_pool::InferencePoolSource),
}

impl Source {
    /// The source's name in metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Source::Names(_) => "static_dns",
            Source::Dns(_) => "dns",
            Source::Kubernetes(_) => "kubernetes",
            Source::InferencePool(_) => "inference_pool",
        }
    }

    /// How `/status` and the logs describe it.
    pub fn describe(&self) -> String {
        match self {
            Source::Names(_) => "static (host names re-resolved)".into(),
            Source::Dns(d) => format!("dns {}:{}", d.name, d.port),
            Source::Kubernetes(k) => format!(
                "kubernetes {}/{} port {}",
                k.namespace.as_deref().unwrap_or("-"),
                k.service,
                k.port
            ),
            Source::InferencePool(p) => format!(
                "inferencepool {}/{}",
                p.namespace.as_deref().unwrap_or("-"),
                p.name
            ),
        }
    }
}

/// One pool and its source.
#[derive(Debug, Clone)]
pub struct PoolDiscovery {
    pub pool: Arc<Pool>,
    pub source: Source,
}

/// The background service that runs every pool's source, for the current generation of the
/// config: a reload (`SIGHUP`) stops the old sources and starts the new.
pub struct DiscoveryService {
    sources: tokio::sync::watch::Receiver<Arc<Vec<PoolDiscovery>>>,
}

impl DiscoveryService {
    pub fn new(sources: tokio::sync::watch::Receiver<Arc<Vec<PoolDiscovery>>>) -> Self {
        Self { sources }
    }
}

#[async_trait]
impl BackgroundService for DiscoveryService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut sources = self.sources.clone();
        loop {
            let mut tasks = tokio::task::JoinSet::new();
            for d in sources.borrow_and_update().iter() {
                let pool = Arc::clone(&d.pool);
                match d.source.clone() {
                    Source::Names(names) => tasks.spawn(dns::follow_names(pool, names)),
                    Source::Dns(source) => tasks.spawn(dns::follow(pool, source)),
                    Source::Kubernetes(source) => tasks.spawn(kubernetes::follow(pool, source)),
                    Source::InferencePool(source) => {
                        tasks.spawn(inference_pool::follow(pool, source))
                    }
                };
            }
            tokio::select! {
                _ = shutdown.changed() => {
                    tasks.abort_all();
                    return;
                }
                changed = sources.changed() => {
                    tasks.abort_all();
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// What a Kubernetes watch has listed (EndpointSlices, or an InferencePool's pods): each
/// object's backends by its name, and when they are next applied to the pool. A burst of
/// changes is applied once, `debounce` after its first (a steady trickle of events cannot
/// hold it off); a relist builds the next set aside until it is whole, so a list that fails
/// part way empties nothing.
#[derive(Default)]
pub(crate) struct Listed {
    by_name: std::collections::BTreeMap<String, Vec<Wanted>>,
    relisting: Option<std::collections::BTreeMap<String, Vec<Wanted>>>,
    /// When the changes not yet applied are.
    pub(crate) apply_at: Option<tokio::time::Instant>,
}

impl Listed {
    /// A list begins (the watch's start, or a relist).
    pub(crate) fn relist(&mut self) {
        self.relisting = Some(std::collections::BTreeMap::new());
    }

    /// The list under way is given up (it is started again).
    pub(crate) fn abandon_relist(&mut self) {
        self.relisting = None;
    }

    /// One object of the list under way.
    pub(crate) fn listed(&mut self, name: String, backends: Vec<Wanted>) {
        if let Some(next) = self.relisting.as_mut() {
            next.insert(name, backends);
        }
    }

    /// The list is whole: it replaces what was seen.
    pub(crate) fn relisted(&mut self, debounce: Duration) {
        if let Some(next) = self.relisting.take() {
            self.by_name = next;
            self.changed(debounce);
        }
    }

    /// An object was added or changed.
    pub(crate) fn insert(&mut self, name: String, backends: Vec<Wanted>, debounce: Duration) {
        self.by_name.insert(name, backends);
        self.changed(debounce);
    }

    /// An object was deleted.
    pub(crate) fn remove(&mut self, name: &str, debounce: Duration) {
        self.by_name.remove(name);
        self.changed(debounce);
    }

    /// Everything is gone (the object that selects them).
    pub(crate) fn clear(&mut self, debounce: Duration) {
        self.by_name.clear();
        self.changed(debounce);
    }

    /// The backends to apply now, the debounce over.
    pub(crate) fn take_wanted(&mut self) -> Vec<Wanted> {
        self.apply_at = None;
        self.by_name.values().flatten().cloned().collect()
    }

    fn changed(&mut self, debounce: Duration) {
        self.apply_at
            .get_or_insert_with(|| tokio::time::Instant::now() + debounce);
    }
}

/// Applies what a source now lists to its pool, and says so: one log line per change, and
/// the discovery metrics.
///
/// Public for the property tests of what discovery does with its sources' answers
/// (`tests/discovery_answers.rs`); only the sources here use it.
pub fn apply(pool: &Pool, source: &str, wanted: &[Wanted]) -> Change {
    let change = pool.update(wanted);
    if change.over_limit > 0 {
        tracing::warn!(
            pool = &*pool.name,
            source,
            "the source lists {} endpoints; the pool takes the first {}",
            wanted.len(),
            sluice_sdk::members::MAX_ENDPOINTS
        );
    }
    if change.is_empty() {
        return change;
    }
    let name = &*pool.name;
    count_change(name);
    let members = pool.members();
    tracing::info!(
        pool = name,
        source,
        joined = ?change.joined,
        draining = ?change.draining,
        ready_again = ?change.ready_again,
        left = ?change.left,
        respecified = ?change.respecified,
        ready = members.ready(),
        total = members.len(),
        "pool backends changed"
    );
    change
}

/// Counts a change of a pool's backends, and when it came.
fn count_change(pool: &str) {
    metrics::inc(&metrics::DISCOVERY_UPDATES, &[pool]);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    metrics::set(&metrics::DISCOVERY_LAST_CHANGE, &[pool], now.as_secs_f64());
}

/// Says that drained backends, with nothing running on them any more, left the pool: the
/// change their source began.
pub(crate) fn drained(pool: &Pool, left: &[String]) {
    let name = &*pool.name;
    count_change(name);
    let members = pool.members();
    tracing::info!(
        pool = name,
        left = ?left,
        ready = members.ready(),
        total = members.len(),
        "pool backends changed: drained backends left"
    );
}

/// Counts a source's error, and logs it when a streak of errors begins (`first`) or goes on
/// with another cause; the pool keeps what it last knew.
pub(crate) fn report_error(
    pool: &Pool,
    source: &'static str,
    error: &str,
    streak: &mut Option<String>,
) {
    metrics::inc(&metrics::DISCOVERY_ERRORS, &[&pool.name, source]);
    if streak.as_deref() != Some(error) {
        tracing::warn!(
            pool = &*pool.name,
            source,
            "discovery failed, the pool keeps the {} backends it knows: {error}",
            pool.members().len()
        );
        *streak = Some(error.to_string());
    }
}

/// Ends a streak of errors, saying so once.
pub(crate) fn report_recovery(pool: &Pool, source: &'static str, streak: &mut Option<String>) {
    if streak.take().is_some() {
        tracing::info!(pool = &*pool.name, source, "discovery answers again");
    }
}

/// `d` give or take 10 %: refreshes of many proxies (and pools) do not fall in step.
pub(crate) fn jittered(d: Duration) -> Duration {
    d.mul_f64(0.9 + fastrand::f64() * 0.2)
}
