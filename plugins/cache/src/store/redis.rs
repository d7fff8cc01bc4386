//! The Redis store: entries shared by several proxies, on a single node or a Redis Cluster.
//!
//! Redis is an optimisation, never a dependency: the store starts while Redis is down and
//! connects by itself later, every lookup is bounded by `lookup_timeout`, repeated failures put
//! the store in a cool-down during which it is skipped without touching the network, and writes
//! go through a bounded queue drained by a background task, so a request never waits on a write.

use super::{CacheKey, Store, StoreError, WriteOutcome};
use crate::entry::Entry;
use async_trait::async_trait;
use serde::Deserialize;
use sluice_sdk::redis::{
    default_connect_timeout, default_cooldown, default_failure_threshold, RedisFailure, RedisLink,
    RedisSettings,
};
use sluice_sdk::{duration, metric, metrics, ConfigError, Held, MemoryBudget};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// `plugins.cache.redis`: where the Redis store lives and how much it may cost a request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// A single node, e.g. `redis://127.0.0.1:6379`. Exactly one of `url` and `cluster_nodes`
    /// is set. Default: none.
    #[serde(default, deserialize_with = "sluice_sdk::redis::url")]
    pub url: Option<String>,
    /// Redis Cluster seed nodes, e.g. `["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]`;
    /// the rest of the cluster is discovered from them. Default: empty.
    #[serde(default, deserialize_with = "sluice_sdk::redis::urls")]
    pub cluster_nodes: Vec<String>,
    /// The longest a lookup may wait on Redis before it counts as a miss (and a failure).
    /// Default: `25ms`.
    #[serde(
        default = "default_lookup_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub lookup_timeout: Duration,
    /// Bounds each connection attempt, and each write. Default: `1s`.
    #[serde(
        default = "default_connect_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub connect_timeout: Duration,
    /// Consecutive failures (errors or timeouts) after which the store is skipped for
    /// `cooldown`. Default: 3.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// How long the store is skipped after `failure_threshold` consecutive failures; the next
    /// lookup after it is a probe. Default: `5s`.
    #[serde(
        default = "default_cooldown",
        deserialize_with = "duration::deserialize"
    )]
    pub cooldown: Duration,
    /// Writes waiting for the writer task; a write that finds the queue full, or the process's
    /// memory budget (`limits.max_buffered_bytes`) spent, is dropped. Default: 1024.
    #[serde(default = "default_write_queue")]
    pub write_queue: usize,
}

fn default_lookup_timeout() -> Duration {
    Duration::from_millis(25)
}
fn default_write_queue() -> usize {
    1024
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            cluster_nodes: Vec::new(),
            lookup_timeout: default_lookup_timeout(),
            connect_timeout: default_connect_timeout(),
            failure_threshold: default_failure_threshold(),
            cooldown: default_cooldown(),
            write_queue: default_write_queue(),
        }
    }
}

impl RedisConfig {
    /// Checks what serde cannot; keys are relative to this section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.settings().validate("lookup_timeout")?;
        if self.write_queue == 0 {
            return Err(ConfigError::new("write_queue", "must be at least 1"));
        }
        Ok(())
    }

    /// The keys every plugin's Redis section shares, `lookup_timeout` as the request timeout.
    pub fn settings(&self) -> RedisSettings {
        RedisSettings {
            url: self.url.clone(),
            cluster_nodes: self.cluster_nodes.clone(),
            timeout: self.lookup_timeout,
            connect_timeout: self.connect_timeout,
            failure_threshold: self.failure_threshold,
            cooldown: self.cooldown,
        }
    }
}

metric!(STORE_ERRORS: IntCounterVec = register_int_counter_vec!(
    "sluice_cache_store_errors_total",
    "Cache store operations that failed, timed out or were skipped during a cool-down",
    &["store", "op", "kind"]
));

metric!(WRITES_DROPPED: IntCounterVec = register_int_counter_vec!(
    "sluice_cache_write_queue_dropped_total",
    "Cache writes dropped because the store's write queue was full",
    &["store"]
));

#[derive(Clone, Copy)]
enum Op {
    Get,
    Set,
}

#[derive(Clone, Copy)]
enum Kind {
    Timeout,
    Error,
    Cooldown,
}

fn count_error(op: Op, kind: Kind) {
    let op = match op {
        Op::Get => "get",
        Op::Set => "set",
    };
    let kind = match kind {
        Kind::Timeout => "timeout",
        Kind::Error => "error",
        Kind::Cooldown => "cooldown",
    };
    metrics::inc(&STORE_ERRORS, &["redis", op, kind]);
}

fn count_dropped() {
    metrics::inc(&WRITES_DROPPED, &["redis"]);
}

/// Counts a write of the semantic index's in Redis that failed (`dropped`: never sent, too
/// many on their way).
pub(crate) fn count_semantic_write(dropped: bool) {
    if dropped {
        metrics::inc(&WRITES_DROPPED, &["redis_semantic"]);
    } else {
        metrics::inc(&STORE_ERRORS, &["redis_semantic", "set", "error"]);
    }
}

struct Shared {
    link: RedisLink,
    /// When a write error was last logged (nanoseconds since `started`, 0 = never).
    last_write_log: AtomicU64,
    started: Instant,
    /// Writes queued or being written.
    pending: AtomicUsize,
}

impl Shared {
    fn log_write_error(&self, error: &str) {
        let now = u64::try_from(self.started.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        let last = self.last_write_log.load(Ordering::Acquire);
        let every = u64::try_from(self.link.cooldown().as_nanos()).unwrap_or(u64::MAX);
        if (last == 0 || now.saturating_sub(last) >= every)
            && self
                .last_write_log
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            tracing::warn!(
                store = "redis",
                error,
                "cache write failed (logged once per cool-down)"
            );
        }
    }
}

struct Write {
    key: String,
    value: Vec<u8>,
    ttl_ms: u64,
    /// The value's bytes, taken from the memory budget until it is written or dropped: the
    /// queue is bounded in bytes as well as in entries.
    _held: Held,
    /// Counted as pending until it is written or dropped.
    _pending: Pending,
}

/// One queued write, counted in [`Shared::pending`] while it lives.
struct Pending(Arc<Shared>);

impl Pending {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.pending.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(shared))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The Redis [`Store`]. Cheap to share behind an `Arc`; dropping it stops its writer task once
/// the queued writes are done.
pub struct RedisStore {
    shared: Arc<Shared>,
    writes: mpsc::Sender<Write>,
    /// What queued writes take their bytes from.
    memory: Arc<MemoryBudget>,
    /// The writer's end of the queue until the writer task is started (once, in a runtime).
    pending_writer: Mutex<Option<mpsc::Receiver<Write>>>,
    writer_started: AtomicBool,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Never fails and never waits on the network: an unreachable Redis only makes lookups
    /// miss until it answers. Called inside a Tokio runtime, it starts connecting and the
    /// writer at once; otherwise on first use.
    pub fn connect(config: RedisConfig, memory: Arc<MemoryBudget>) -> RedisStore {
        let link = RedisLink::new("cache store", &config.settings());
        if let Some(e) = link.unusable() {
            tracing::error!(store = "redis", error = %e, "cache store unusable, every lookup misses");
        }
        let (writes, queue) = mpsc::channel(config.write_queue.max(1));
        let store = RedisStore {
            shared: Arc::new(Shared {
                link,
                last_write_log: AtomicU64::new(0),
                started: Instant::now(),
                pending: AtomicUsize::new(0),
            }),
            writes,
            memory,
            pending_writer: Mutex::new(Some(queue)),
            writer_started: AtomicBool::new(false),
        };
        store.start();
        store
    }

    /// Starts the writer task and the first connection attempt, if there is a runtime and it
    /// was not done yet.
    fn start(&self) {
        if self.writer_started.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.writer_started.swap(true, Ordering::AcqRel) {
            return;
        }
        // Taken once, by the one caller that flipped `writer_started`.
        let queue = match self.pending_writer.lock() {
            Ok(mut guard) => guard.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(queue) = queue {
            runtime.spawn(writer(self.shared.clone(), queue));
        }
        // Connect now rather than on the first lookup, which would otherwise spend its short
        // timeout on the handshake.
        let shared = self.shared.clone();
        runtime.spawn(async move {
            if let Ok(mut connection) = shared.link.connection() {
                let ping = redis::cmd("PING");
                let within = shared.link.connect_timeout();
                let _ = tokio::time::timeout(within, ping.query_async::<()>(&mut connection)).await;
            }
        });
    }

    async fn lookup(&self, key: &CacheKey) -> Result<Option<Arc<Entry>>, StoreError> {
        let link = &self.shared.link;
        let mut cmd = redis::cmd("GET");
        cmd.arg(&key.storage_key);
        let bytes = match link.query::<Option<Vec<u8>>>(&cmd, link.timeout()).await {
            Ok(bytes) => bytes,
            Err(RedisFailure::CoolingDown) => {
                count_error(Op::Get, Kind::Cooldown);
                return Err(StoreError::CoolingDown);
            }
            Err(RedisFailure::Error(e)) => {
                count_error(Op::Get, Kind::Error);
                return Err(StoreError::Failed(e));
            }
            Err(RedisFailure::Timeout) => {
                count_error(Op::Get, Kind::Timeout);
                return Err(StoreError::Timeout);
            }
        };
        let Some(bytes) = bytes else {
            return Ok(None);
        };
        match Entry::decode(&bytes) {
            // A different digest under the same name is another prompt's answer.
            Ok(entry) if entry.digest == key.digest => Ok(Some(Arc::new(entry))),
            Ok(_) => Ok(None),
            Err(e) => {
                tracing::debug!(store = "redis", key = %key.storage_key, error = %e, "undecodable entry, a miss");
                Ok(None)
            }
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn get(&self, key: &CacheKey) -> Result<Option<Arc<Entry>>, StoreError> {
        self.start();
        self.lookup(key).await
    }

    fn put(&self, key: &CacheKey, entry: Arc<Entry>, ttl: Duration) -> WriteOutcome {
        self.start();
        let value = entry.encode();
        // A full memory budget drops the write, as a full queue does: caching is optional.
        let Some(held) = self.memory.take(value.len()) else {
            count_dropped();
            return WriteOutcome::Dropped;
        };
        let write = Write {
            key: key.storage_key.clone(),
            value,
            // PX 0 is an error in Redis; a sub-millisecond TTL keeps the entry for 1 ms.
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1),
            _held: held,
            _pending: Pending::new(&self.shared),
        };
        match self.writes.try_send(write) {
            Ok(()) => WriteOutcome::Accepted,
            Err(_) => {
                count_dropped();
                WriteOutcome::Dropped
            }
        }
    }

    async fn flush(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while self.shared.pending.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Drains the write queue until the store is dropped. Shares the cool-down with lookups: while
/// Redis is cooling down, writes are dropped at once rather than each waiting out a timeout,
/// so the queue keeps moving and resumes by itself when Redis does.
async fn writer(shared: Arc<Shared>, mut queue: mpsc::Receiver<Write>) {
    let link = &shared.link;
    while let Some(write) = queue.recv().await {
        let mut cmd = redis::cmd("SET");
        cmd.arg(&write.key)
            .arg(write.value)
            .arg("PX")
            .arg(write.ttl_ms);
        match link.query::<()>(&cmd, link.connect_timeout()).await {
            Ok(()) => {}
            Err(RedisFailure::CoolingDown) => count_error(Op::Set, Kind::Cooldown),
            Err(RedisFailure::Error(e)) => {
                count_error(Op::Set, Kind::Error);
                shared.log_write_error(&e);
            }
            Err(RedisFailure::Timeout) => {
                count_error(Op::Set, Kind::Timeout);
                shared.log_write_error("write timed out");
            }
        }
    }
}
