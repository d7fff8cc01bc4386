//! The Redis store: entries shared by several proxies, on a single node or a Redis Cluster.
//!
//! Redis is an optimisation, never a dependency: the store starts while Redis is down and
//! connects by itself later, every lookup is bounded by `lookup_timeout`, repeated failures put
//! the store in a cool-down during which it is skipped without touching the network, and writes
//! go through a bounded queue drained by a background task, so a request never waits on a write.

use super::{CacheKey, Store, StoreError, WriteOutcome};
use crate::entry::Entry;
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, IntoConnectionInfo, RedisResult};
use serde::Deserialize;
use sluice_sdk::{duration, metric, metrics, ConfigError, Held, MemoryBudget};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// `plugins.cache.redis`: where the Redis store lives and how much it may cost a request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// A single node, e.g. `redis://127.0.0.1:6379`. Exactly one of `url` and `cluster_nodes`
    /// is set. Default: none.
    #[serde(default)]
    pub url: Option<String>,
    /// Redis Cluster seed nodes, e.g. `["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]`;
    /// the rest of the cluster is discovered from them. Default: empty.
    #[serde(default)]
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
fn default_connect_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_failure_threshold() -> u32 {
    3
}
fn default_cooldown() -> Duration {
    Duration::from_secs(5)
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
        match (&self.url, self.cluster_nodes.is_empty()) {
            (Some(_), false) => {
                return Err(ConfigError::new(
                    "url",
                    "set url or cluster_nodes, not both",
                ));
            }
            (None, true) => {
                return Err(ConfigError::new(
                    "url",
                    "set url (single node) or cluster_nodes",
                ));
            }
            (Some(url), true) => {
                url.as_str().into_connection_info().map_err(|e| {
                    ConfigError::new(
                        "url",
                        format!("{:?} is not a Redis URL: {e}", redacted(url)),
                    )
                })?;
            }
            (None, false) => {
                for (i, node) in self.cluster_nodes.iter().enumerate() {
                    node.as_str().into_connection_info().map_err(|e| {
                        ConfigError::new(
                            format!("cluster_nodes[{i}]"),
                            format!("{:?} is not a Redis URL: {e}", redacted(node)),
                        )
                    })?;
                }
            }
        }
        let positive = [
            ("lookup_timeout", self.lookup_timeout),
            ("connect_timeout", self.connect_timeout),
            ("cooldown", self.cooldown),
        ];
        for (key, value) in positive {
            if value.is_zero() {
                return Err(ConfigError::new(key, "must be more than 0"));
            }
        }
        if self.failure_threshold == 0 {
            return Err(ConfigError::new("failure_threshold", "must be at least 1"));
        }
        if self.write_queue == 0 {
            return Err(ConfigError::new("write_queue", "must be at least 1"));
        }
        Ok(())
    }
}

/// `url` with its password (anything between `://` and `@`) hidden: URLs reach error
/// messages and logs, secrets must not.
fn redacted(url: &str) -> String {
    let parts = url
        .find("://")
        .zip(url.rfind('@'))
        .and_then(|(scheme, at)| {
            Some((url.get(..scheme + 3)?, url.get(at..)?)).filter(|_| at > scheme + 3)
        });
    match parts {
        Some((scheme, host)) => format!("{scheme}***{host}"),
        None => url.to_string(),
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

/// A connection to either deployment; both are multiplexed and cheap to clone, and both
/// reconnect by themselves.
#[derive(Clone)]
enum Backend {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Backend {
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        match self {
            Backend::Single(c) => cmd.query_async(&mut c.clone()).await,
            Backend::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }
}

/// What it takes to make a [`Backend`]: parsed at `connect`, turned into a connection inside a
/// Tokio runtime (redis-rs spawns its driver tasks there).
enum Target {
    Single(Client),
    /// Boxed: far larger than a `Client`, and made once.
    Cluster(Box<ClusterClient>),
    /// The configuration was unusable (not validated): every lookup fails, nothing panics.
    Invalid(String),
}

/// Whether a lookup may go to Redis.
enum Admit {
    Go,
    Skip,
}

/// The store's cool-down after consecutive failures, lock-free: a failure count and a cool-down deadline in
/// nanoseconds since `base` (0 = not cooling down).
struct CoolDown {
    base: Instant,
    failures: AtomicU32,
    cooling_until: AtomicU64,
    threshold: u32,
    cooldown: Duration,
}

impl CoolDown {
    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn deadline(&self) -> u64 {
        let cooldown = u64::try_from(self.cooldown.as_nanos()).unwrap_or(u64::MAX);
        // Never 0, which means "not cooling down".
        self.now().saturating_add(cooldown).max(1)
    }

    fn admit(&self) -> Admit {
        let until = self.cooling_until.load(Ordering::Acquire);
        if until == 0 {
            return Admit::Go;
        }
        if self.now() < until {
            return Admit::Skip;
        }
        // Cool-down over: whoever moves the deadline forward sends the one probe; the others
        // keep skipping until it answers.
        match self.cooling_until.compare_exchange(
            until,
            self.deadline(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Admit::Go,
            Err(_) => Admit::Skip,
        }
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Release);
        if self.cooling_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!(store = "redis", "cache store answers again, cool-down over");
        }
    }

    fn failure(&self, why: &str) {
        let n = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if n >= self.threshold {
            let previous = self.cooling_until.swap(self.deadline(), Ordering::AcqRel);
            // Logged when entering a cool-down only, so a dead Redis logs once, not per lookup.
            if previous == 0 {
                tracing::warn!(
                    store = "redis",
                    failures = n,
                    cooldown = ?self.cooldown,
                    error = why,
                    "cache store failing, skipping it for a cool-down"
                );
            }
        }
    }
}

struct Shared {
    target: Target,
    backend: OnceLock<Backend>,
    cool_down: CoolDown,
    lookup_timeout: Duration,
    /// Bounds each write (connect_timeout).
    write_timeout: Duration,
    /// When a write error was last logged (nanoseconds since `cool_down.base`, 0 = never).
    last_write_log: AtomicU64,
    /// Writes queued or being written.
    pending: AtomicUsize,
}

impl Shared {
    /// The connection, made on first use inside a runtime. `None` outside a Tokio runtime or
    /// with an unusable configuration.
    fn backend(&self) -> Result<&Backend, String> {
        if let Some(b) = self.backend.get() {
            return Ok(b);
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err("no Tokio runtime to run the Redis connection on".into());
        }
        let made = match &self.target {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.write_timeout))
                    .set_response_timeout(Some(self.write_timeout))
                    // One attempt per reconnect: the next command starts another, and the
                    // cool-down keeps lookups away meanwhile, so retrying inside redis-rs only
                    // holds waiting commands longer.
                    .set_number_of_retries(0);
                ConnectionManager::new_lazy_with_config(client.clone(), config)
                    .map(Backend::Single)
                    .map_err(|e| e.to_string())?
            }
            Target::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(self.write_timeout)
                    .set_response_timeout(self.write_timeout);
                Backend::Cluster(client.get_pending_async_connection_with_config(config))
            }
            Target::Invalid(e) => return Err(e.clone()),
        };
        // Another thread may have won the race; its connection is as good as ours.
        Ok(self.backend.get_or_init(|| made))
    }

    fn log_write_error(&self, error: &str) {
        let now = self.cool_down.now().max(1);
        let last = self.last_write_log.load(Ordering::Acquire);
        let every = u64::try_from(self.cool_down.cooldown.as_nanos()).unwrap_or(u64::MAX);
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
        let target = match (&config.url, config.cluster_nodes.is_empty()) {
            (Some(url), true) => match Client::open(url.as_str()) {
                Ok(c) => Target::Single(c),
                Err(e) => Target::Invalid(format!("redis url {:?}: {e}", redacted(url))),
            },
            (None, false) => {
                match ClusterClient::builder(config.cluster_nodes.iter().map(String::as_str))
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.connect_timeout)
                    .build()
                {
                    Ok(c) => Target::Cluster(Box::new(c)),
                    Err(e) => Target::Invalid(format!("redis cluster_nodes: {e}")),
                }
            }
            _ => Target::Invalid("set exactly one of url and cluster_nodes".into()),
        };
        if let Target::Invalid(e) = &target {
            tracing::error!(store = "redis", error = %e, "cache store unusable, every lookup misses");
        }
        let (writes, queue) = mpsc::channel(config.write_queue.max(1));
        let store = RedisStore {
            shared: Arc::new(Shared {
                target,
                backend: OnceLock::new(),
                cool_down: CoolDown {
                    base: Instant::now(),
                    failures: AtomicU32::new(0),
                    cooling_until: AtomicU64::new(0),
                    threshold: config.failure_threshold.max(1),
                    cooldown: config.cooldown,
                },
                lookup_timeout: config.lookup_timeout,
                write_timeout: config.connect_timeout,
                last_write_log: AtomicU64::new(0),
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
            if let Ok(backend) = shared.backend() {
                let ping = redis::cmd("PING");
                let _ =
                    tokio::time::timeout(shared.write_timeout, backend.query::<()>(&ping)).await;
            }
        });
    }

    async fn lookup(&self, key: &CacheKey) -> Result<Option<Arc<Entry>>, StoreError> {
        let backend = match self.shared.backend() {
            Ok(b) => b,
            Err(e) => {
                count_error(Op::Get, Kind::Error);
                self.shared.cool_down.failure(&e);
                return Err(StoreError::Failed(e));
            }
        };
        let mut cmd = redis::cmd("GET");
        cmd.arg(&key.storage_key);
        let answer = tokio::time::timeout(
            self.shared.lookup_timeout,
            backend.query::<Option<Vec<u8>>>(&cmd),
        )
        .await;
        let bytes = match answer {
            Ok(Ok(bytes)) => {
                self.shared.cool_down.success();
                bytes
            }
            Ok(Err(e)) => {
                count_error(Op::Get, Kind::Error);
                let e = e.to_string();
                self.shared.cool_down.failure(&e);
                return Err(StoreError::Failed(e));
            }
            Err(_) => {
                count_error(Op::Get, Kind::Timeout);
                self.shared.cool_down.failure("lookup timed out");
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
        match self.shared.cool_down.admit() {
            Admit::Skip => {
                count_error(Op::Get, Kind::Cooldown);
                Err(StoreError::CoolingDown)
            }
            Admit::Go => self.lookup(key).await,
        }
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
    while let Some(write) = queue.recv().await {
        if let Admit::Skip = shared.cool_down.admit() {
            count_error(Op::Set, Kind::Cooldown);
            continue;
        }
        let backend = match shared.backend() {
            Ok(b) => b,
            Err(e) => {
                count_error(Op::Set, Kind::Error);
                shared.cool_down.failure(&e);
                shared.log_write_error(&e);
                continue;
            }
        };
        let mut cmd = redis::cmd("SET");
        cmd.arg(&write.key)
            .arg(write.value)
            .arg("PX")
            .arg(write.ttl_ms);
        match tokio::time::timeout(shared.write_timeout, backend.query::<()>(&cmd)).await {
            Ok(Ok(())) => shared.cool_down.success(),
            Ok(Err(e)) => {
                count_error(Op::Set, Kind::Error);
                let e = e.to_string();
                shared.cool_down.failure(&e);
                shared.log_write_error(&e);
            }
            Err(_) => {
                count_error(Op::Set, Kind::Timeout);
                shared.cool_down.failure("write timed out");
                shared.log_write_error("write timed out");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redacted("redis://:s3cret@10.0.0.1:6379"),
            "redis://***@10.0.0.1:6379"
        );
        assert_eq!(redacted("redis://user:pw@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redacted("redis://h:1"), "redis://h:1");
    }
}
