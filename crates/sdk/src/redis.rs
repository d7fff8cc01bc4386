//! One way for plugins to talk to Redis, on a single node or a Redis Cluster, as an
//! optimisation never a dependency: a [`RedisLink`] is made without touching the network,
//! connects on first use inside a Tokio runtime and reconnects by itself, bounds every call, and
//! after consecutive failures skips Redis for a cool-down (calls then fail at once) until one
//! probe answers.
//!
//! A plugin keeps its own config section (its keys and defaults are its users'), turns the
//! shared part into [`RedisSettings`] to validate it and to make the link, and keeps only its
//! own logic: what it sends, and what a failure means for its requests and its metrics.

use crate::config::ConfigError;
use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::io::tcp::TcpSettings;
use ::redis::{
    Client, Cmd, FromRedisValue, IntoConnectionInfo, Pipeline, RedisFuture, ScriptInvocation, Value,
};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
// Tokio's clock: the same as std's in production, and paused time moves it in tests.
use tokio::time::Instant;

/// The default `connect_timeout` of a plugin's Redis section: `1s`.
pub fn default_connect_timeout() -> Duration {
    Duration::from_secs(1)
}

/// The default `failure_threshold` of a plugin's Redis section: 3.
pub fn default_failure_threshold() -> u32 {
    3
}

/// A Redis URL as a config gives it: written out (`redis://…`), or, so that its password
/// need not be in the file, `{from_env: VAR}` or `{from_file: /path}`, read when the config
/// is loaded (surrounding whitespace trimmed). For every Redis URL of every plugin:
/// `#[serde(deserialize_with = "sluice_sdk::redis::url")]` (and [`urls`], [`required_url`]).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum UrlSource {
    Written(String),
    Env { from_env: String },
    File { from_file: std::path::PathBuf },
}

impl UrlSource {
    fn read(self) -> Result<String, String> {
        let url = match self {
            UrlSource::Written(url) => return Ok(url),
            UrlSource::Env { from_env } => std::env::var(&from_env).map_err(|_| {
                format!("the environment variable `{from_env}` is not set (or not UTF-8)")
            })?,
            UrlSource::File { from_file } => std::fs::read_to_string(&from_file)
                .map_err(|e| format!("cannot read {}: {e}", from_file.display()))?,
        };
        let url = url.trim();
        if url.is_empty() {
            return Err("the URL read is empty".into());
        }
        Ok(url.to_string())
    }
}

/// An optional Redis URL (see [`UrlSource`]).
pub fn url<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    use serde::Deserialize;
    Option::<UrlSource>::deserialize(d)?
        .map(UrlSource::read)
        .transpose()
        .map_err(serde::de::Error::custom)
}

/// A required Redis URL (see [`UrlSource`]).
pub fn required_url<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::Deserialize;
    UrlSource::deserialize(d)?
        .read()
        .map_err(serde::de::Error::custom)
}

/// A list of Redis URLs, each as [`url`] takes it.
pub fn urls<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    use serde::Deserialize;
    Vec::<UrlSource>::deserialize(d)?
        .into_iter()
        .map(UrlSource::read)
        .collect::<Result<_, _>>()
        .map_err(serde::de::Error::custom)
}

/// The default `cooldown` of a plugin's Redis section: `5s`.
pub fn default_cooldown() -> Duration {
    Duration::from_secs(5)
}

/// The keys every plugin's Redis section has, whatever each names them; made from the
/// plugin's own config type (serde's `flatten` and `deny_unknown_fields` do not mix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// A single node, `redis://host:port`. Exactly one of `url` and `cluster_nodes` is set.
    pub url: Option<String>,
    /// Redis Cluster seed nodes; the rest of the cluster is discovered from them.
    pub cluster_nodes: Vec<String>,
    /// The longest a request waits on Redis (the cache's `lookup_timeout`, the tenants'
    /// `timeout`); see [`RedisLink::timeout`].
    pub timeout: Duration,
    /// Bounds each connection attempt, and the calls nobody waits for.
    pub connect_timeout: Duration,
    /// Consecutive failures (errors or timeouts) after which Redis is skipped for `cooldown`.
    pub failure_threshold: u32,
    /// How long Redis is skipped; the first call after it is a probe.
    pub cooldown: Duration,
}

impl RedisSettings {
    /// Checks what serde cannot; keys are relative to the plugin's section, where the request
    /// timeout is named `timeout_key`.
    pub fn validate(&self, timeout_key: &str) -> Result<(), ConfigError> {
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
            (Some(url), true) => parses("url", url)?,
            (None, false) => {
                for (i, node) in self.cluster_nodes.iter().enumerate() {
                    parses(&format!("cluster_nodes[{i}]"), node)?;
                }
            }
        }
        for (key, value) in [
            (timeout_key, self.timeout),
            ("connect_timeout", self.connect_timeout),
            ("cooldown", self.cooldown),
        ] {
            if value.is_zero() {
                return Err(ConfigError::new(key, "must be more than 0"));
            }
        }
        if self.failure_threshold == 0 {
            return Err(ConfigError::new("failure_threshold", "must be at least 1"));
        }
        Ok(())
    }
}

fn parses(key: &str, url: &str) -> Result<(), ConfigError> {
    url.into_connection_info()
        .map(|_| ())
        .map_err(|e| ConfigError::new(key, format!("{:?} is not a Redis URL: {e}", redacted(url))))
}

/// `url` with its password (anything between `://` and `@`) hidden: URLs reach error
/// messages and logs, secrets must not.
pub fn redacted(url: &str) -> String {
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

/// Why a call through a [`RedisLink`] has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisFailure {
    /// Redis is skipped for a cool-down after repeated failures; nothing was sent.
    CoolingDown,
    /// No answer within the call's bound.
    Timeout,
    /// Redis answered with an error, could not be reached, or the link is unusable.
    Error(String),
}

/// A connection to either deployment: multiplexed, cheap to clone, reconnecting by itself.
/// Any redis-rs command, pipeline or script runs on it ([`ConnectionLike`]).
#[derive(Clone)]
pub struct RedisConnection(Backend);

#[derive(Clone)]
enum Backend {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Backend::Single(c) => c.req_packed_command(cmd),
            Backend::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Backend::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Backend::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Backend::Single(c) => c.get_db(),
            Backend::Cluster(c) => c.get_db(),
        }
    }
}

/// What it takes to make a [`RedisConnection`]: parsed at once, turned into a connection
/// inside a Tokio runtime (redis-rs spawns its driver tasks there).
enum Target {
    Single(Client),
    /// Boxed: far larger than a `Client`, and made once.
    Cluster(Box<ClusterClient>),
    /// The configuration was unusable (not validated): every call fails, nothing panics.
    Invalid(String),
}

/// A plugin's way to Redis. Never fails to make and never waits on the network; share it
/// behind an `Arc`.
pub struct RedisLink {
    target: Target,
    connection: OnceLock<RedisConnection>,
    cool_down: Arc<CoolDown>,
    timeout: Duration,
    connect_timeout: Duration,
}

impl std::fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLink")
            .field("name", &self.cool_down.name)
            .finish_non_exhaustive()
    }
}

impl RedisLink {
    /// A link to what `settings` names; `name` (`"cache store"`) starts its log lines. An
    /// unusable `settings` (not validated) makes a link whose every call fails: see
    /// [`RedisLink::unusable`].
    pub fn new(name: &'static str, settings: &RedisSettings) -> RedisLink {
        // Nagle's algorithm off, as Redis sets it on its side: a multiplexed connection writes
        // a command while others are still unanswered, and Nagle would hold each such write
        // until the reply acknowledging the previous one arrives (redis-rs leaves it on).
        let tcp = TcpSettings::default().set_nodelay(true);
        let target = match (&settings.url, settings.cluster_nodes.is_empty()) {
            (Some(url), true) => match url
                .as_str()
                .into_connection_info()
                .and_then(|info| Client::open(info.set_tcp_settings(tcp)))
            {
                Ok(c) => Target::Single(c),
                Err(e) => Target::Invalid(format!("redis url {:?}: {e}", redacted(url))),
            },
            (None, false) => {
                match ClusterClient::builder(settings.cluster_nodes.iter().map(String::as_str))
                    .tcp_settings(tcp)
                    .connection_timeout(settings.connect_timeout)
                    .response_timeout(settings.connect_timeout)
                    .build()
                {
                    Ok(c) => Target::Cluster(Box::new(c)),
                    Err(e) => Target::Invalid(format!("redis cluster_nodes: {e}")),
                }
            }
            _ => Target::Invalid("set exactly one of url and cluster_nodes".into()),
        };
        Self::with_target(name, target, settings)
    }

    /// A link whose every call fails with `why`, for a plugin whose Redis section is missing.
    pub fn broken(name: &'static str, why: impl Into<String>) -> RedisLink {
        let settings = RedisSettings {
            url: None,
            cluster_nodes: Vec::new(),
            timeout: default_connect_timeout(),
            connect_timeout: default_connect_timeout(),
            failure_threshold: default_failure_threshold(),
            cooldown: default_cooldown(),
        };
        Self::with_target(name, Target::Invalid(why.into()), &settings)
    }

    fn with_target(name: &'static str, target: Target, settings: &RedisSettings) -> RedisLink {
        RedisLink {
            target,
            connection: OnceLock::new(),
            cool_down: Arc::new(CoolDown::new(
                name,
                settings.failure_threshold,
                settings.cooldown,
            )),
            timeout: settings.timeout,
            connect_timeout: settings.connect_timeout,
        }
    }

    /// Why every call fails, when the settings were unusable; the plugin logs it with what
    /// that means for its requests.
    pub fn unusable(&self) -> Option<&str> {
        match &self.target {
            Target::Invalid(why) => Some(why),
            _ => None,
        }
    }

    /// The longest a request waits on Redis.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Bounds each connection attempt, and the calls nobody waits for.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long Redis is skipped after `failure_threshold` consecutive failures.
    pub fn cooldown(&self) -> Duration {
        self.cool_down.cooldown
    }

    /// The connection, made on first use inside a Tokio runtime; `Err` outside one or with
    /// unusable settings. Calls on it bypass the cool-down: for warming up, not for requests.
    pub fn connection(&self) -> Result<RedisConnection, String> {
        if let Some(c) = self.connection.get() {
            return Ok(c.clone());
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err("no Tokio runtime to run the Redis connection on".into());
        }
        let made = match &self.target {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.connect_timeout))
                    // One attempt per reconnect: the next command starts another, and the
                    // cool-down keeps calls away meanwhile, so retrying inside redis-rs only
                    // holds waiting commands longer.
                    .set_number_of_retries(0);
                ConnectionManager::new_lazy_with_config(client.clone(), config)
                    .map(Backend::Single)
                    .map_err(|e| e.to_string())?
            }
            Target::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(self.connect_timeout)
                    .set_response_timeout(self.connect_timeout);
                Backend::Cluster(client.get_pending_async_connection_with_config(config))
            }
            Target::Invalid(e) => return Err(e.clone()),
        };
        // Another thread may have won the race; its connection is as good as ours.
        Ok(self
            .connection
            .get_or_init(|| RedisConnection(made))
            .clone())
    }

    /// Whether a call may go to Redis now: `false` during a cool-down, and for all but the one
    /// probe when it ends. [`RedisLink::query`] and [`RedisLink::invoke`] ask it themselves.
    pub fn admit(&self) -> bool {
        self.cool_down.admit()
    }

    /// Records an answer: the failures in a row start again from 0, a cool-down ends.
    pub fn success(&self) {
        self.cool_down.success();
    }

    /// Records a failure (`why` is logged when it starts a cool-down). A cool-down that
    /// starts here is ended as soon as Redis answers again (see [`RedisLink::probe_until_back`]).
    pub fn failure(&self, why: &str) {
        if self.cool_down.failure(why) {
            self.probe_until_back();
        }
    }

    /// PINGs Redis every [`PROBE_EVERY`] while the link cools down, and ends the cool-down at
    /// the first answer. Otherwise the cool-down ends only with the first request after it,
    /// whose call on a connection Redis's restart broke fails and starts another: a Redis
    /// restarted in a second went unused for two cool-downs (10 s), the requests meanwhile
    /// following `on_redis_error`.
    fn probe_until_back(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let Ok(mut connection) = self.connection() else {
            return;
        };
        let (cool_down, within) = (Arc::downgrade(&self.cool_down), self.connect_timeout);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                let Some(cool_down) = cool_down.upgrade().filter(|c| c.cooling()) else {
                    return;
                };
                let ping = ::redis::cmd("PING");
                let answer = tokio::time::timeout(
                    within,
                    ping.query_async::<::redis::Value>(&mut connection),
                )
                .await;
                if let Ok(Ok(_)) = answer {
                    cool_down.success();
                    return;
                }
            }
        });
    }

    /// Sends `cmd` unless Redis is cooling down, waits for its answer at most `within`, and
    /// feeds the outcome to the cool-down.
    pub async fn query<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        within: Duration,
    ) -> Result<T, RedisFailure> {
        let mut c = self.admitted()?;
        self.settle(tokio::time::timeout(within, cmd.query_async(&mut c)).await)
    }

    /// Runs a script as [`RedisLink::query`] sends a command (EVALSHA, loading the script on
    /// `NOSCRIPT`).
    pub async fn invoke<T: FromRedisValue>(
        &self,
        call: &ScriptInvocation<'_>,
        within: Duration,
    ) -> Result<T, RedisFailure> {
        let mut c = self.admitted()?;
        self.settle(tokio::time::timeout(within, call.invoke_async(&mut c)).await)
    }

    fn admitted(&self) -> Result<RedisConnection, RedisFailure> {
        if !self.admit() {
            return Err(RedisFailure::CoolingDown);
        }
        self.connection().map_err(|e| {
            self.failure(&e);
            RedisFailure::Error(e)
        })
    }

    fn settle<T>(
        &self,
        answer: Result<::redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, RedisFailure> {
        match answer {
            Ok(Ok(v)) => {
                self.success();
                Ok(v)
            }
            Ok(Err(e)) => {
                // Redis answered with an error of the command (a script's, say): it serves,
                // and one caller's bad command must not cool the link down for every other.
                if says_unavailable(&e) {
                    self.failure(&e.to_string());
                } else {
                    self.success();
                }
                Err(RedisFailure::Error(e.to_string()))
            }
            Err(_) => {
                self.failure("timed out");
                Err(RedisFailure::Timeout)
            }
        }
    }
}

/// Whether an error means Redis cannot serve now (no connection, a dump loading after a
/// restart, a cluster down or read-only), rather than that it refused one command.
fn says_unavailable(e: &::redis::RedisError) -> bool {
    use ::redis::{ErrorKind, ServerErrorKind};
    match e.kind() {
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        ),
        ErrorKind::Extension | ErrorKind::UnexpectedReturnType | ErrorKind::Parse => false,
        _ => true,
    }
}

/// How often a cooling link asks Redis whether it is back.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// The cool-down after consecutive failures, lock-free: a failure count and a cool-down
/// deadline in nanoseconds since `base` (0 = not cooling down).
struct CoolDown {
    name: &'static str,
    base: Instant,
    failures: AtomicU32,
    cooling_until: AtomicU64,
    threshold: u32,
    cooldown: Duration,
}

impl CoolDown {
    fn new(name: &'static str, threshold: u32, cooldown: Duration) -> Self {
        Self {
            name,
            base: Instant::now(),
            failures: AtomicU32::new(0),
            cooling_until: AtomicU64::new(0),
            threshold: threshold.max(1),
            cooldown,
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn deadline(&self) -> u64 {
        let cooldown = u64::try_from(self.cooldown.as_nanos()).unwrap_or(u64::MAX);
        // Never 0, which means "not cooling down".
        self.now().saturating_add(cooldown).max(1)
    }

    fn admit(&self) -> bool {
        let until = self.cooling_until.load(Ordering::Acquire);
        if until == 0 {
            return true;
        }
        if self.now() < until {
            return false;
        }
        // Cool-down over: whoever moves the deadline forward sends the one probe; the others
        // keep skipping until it answers.
        self.cooling_until
            .compare_exchange(until, self.deadline(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Release);
        if self.cooling_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!(
                store = "redis",
                "{} answers again, cool-down over",
                self.name
            );
        }
    }

    fn cooling(&self) -> bool {
        self.cooling_until.load(Ordering::Acquire) != 0
    }

    /// Counts a failure; `true` when it starts a cool-down.
    fn failure(&self, why: &str) -> bool {
        let n = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        // Logged when entering a cool-down only, so a dead Redis logs once, not per call.
        let starts =
            n >= self.threshold && self.cooling_until.swap(self.deadline(), Ordering::AcqRel) == 0;
        if starts {
            tracing::warn!(
                store = "redis",
                failures = n,
                cooldown = ?self.cooldown,
                error = why,
                "{} failing, skipping it for a cool-down",
                self.name
            );
        }
        starts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redacted("redis://:s3cret@10.0.0.1:6379"),
            "redis://***@10.0.0.1:6379"
        );
        assert_eq!(redacted("redis://user:pw@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redacted("redis://h:1"), "redis://h:1");
    }

    /// A multiplexed connection sends commands while others are unanswered: with Nagle's
    /// algorithm on, each would wait for the acknowledgement of the one before.
    #[test]
    fn connections_are_made_with_nagle_off() {
        let settings = RedisSettings {
            url: Some("redis://127.0.0.1:6379".into()),
            cluster_nodes: Vec::new(),
            timeout: Duration::from_millis(50),
            connect_timeout: default_connect_timeout(),
            failure_threshold: default_failure_threshold(),
            cooldown: default_cooldown(),
        };
        let link = RedisLink::new("test store", &settings);
        let Target::Single(client) = &link.target else {
            panic!("not a single-node link: {link:?}");
        };
        assert!(client.get_connection_info().tcp_settings().nodelay());
    }

    #[tokio::test(start_paused = true)]
    async fn failures_cool_down_then_one_probe() {
        let c = CoolDown::new("test store", 3, Duration::from_secs(5));
        c.failure("x");
        c.failure("x");
        assert!(c.admit(), "below the threshold, Redis is still asked");
        c.failure("x");
        assert!(!c.admit(), "skipped during the cool-down");
        tokio::time::advance(Duration::from_millis(4_900)).await;
        assert!(!c.admit());
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(c.admit(), "the one probe after the cool-down");
        assert!(!c.admit(), "the others wait for the probe's answer");
        // The probe fails: another full cool-down.
        c.failure("x");
        tokio::time::advance(Duration::from_millis(4_900)).await;
        assert!(!c.admit());
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(c.admit());
        c.success();
        assert!(c.admit() && c.admit(), "an answer ends the cool-down");
        c.failure("x");
        assert!(c.admit(), "and the count starts again");
    }

    fn settings() -> RedisSettings {
        RedisSettings {
            url: Some("redis://127.0.0.1:6379".into()),
            cluster_nodes: Vec::new(),
            timeout: Duration::from_millis(25),
            connect_timeout: default_connect_timeout(),
            failure_threshold: default_failure_threshold(),
            cooldown: default_cooldown(),
        }
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(settings().validate("timeout"), Ok(()));
        let both = RedisSettings {
            cluster_nodes: vec!["redis://a:1".into()],
            ..settings()
        };
        assert_eq!(
            both.validate("timeout").map_err(|e| e.key),
            Err("url".into())
        );
        let bad_node = RedisSettings {
            url: None,
            cluster_nodes: vec!["redis://a:1".into(), "http://:pw@b".into()],
            ..settings()
        };
        let e = bad_node.validate("timeout").err();
        assert_eq!(e.as_ref().map(|e| e.key.as_str()), Some("cluster_nodes[1]"));
        assert!(e.is_some_and(|e| !e.message.contains("pw")));
        let zero = RedisSettings {
            timeout: Duration::ZERO,
            ..settings()
        };
        assert_eq!(
            zero.validate("lookup_timeout").map_err(|e| e.key),
            Err("lookup_timeout".into())
        );
        let never = RedisSettings {
            failure_threshold: 0,
            ..settings()
        };
        assert!(never.validate("timeout").is_err());
    }

    #[tokio::test]
    async fn an_unusable_link_fails_every_call_and_cools_down() {
        let link = RedisLink::broken("test store", "no section");
        assert_eq!(link.unusable(), Some("no section"));
        let ping = ::redis::cmd("PING");
        for _ in 0..3 {
            let r = link.query::<()>(&ping, link.timeout()).await;
            assert_eq!(r, Err(RedisFailure::Error("no section".into())));
        }
        let r = link.query::<()>(&ping, link.timeout()).await;
        assert_eq!(r, Err(RedisFailure::CoolingDown));
    }

    /// A server's error reply, as the client reads it.
    fn reply_error(resp: &[u8]) -> ::redis::RedisError {
        let value = ::redis::parse_redis_value(resp).unwrap();
        value.extract_error().unwrap_err()
    }

    #[test]
    fn only_errors_saying_redis_cannot_serve_cool_the_link_down() {
        // A command's own error (a script's): Redis serves.
        assert!(!says_unavailable(&reply_error(
            b"-ERR user_script:1: boom\r\n"
        )));
        assert!(!says_unavailable(&reply_error(
            b"-NOSCRIPT No matching script\r\n"
        )));
        // A dump loading after a restart, a cluster down: it does not.
        assert!(says_unavailable(&reply_error(
            b"-LOADING Redis is loading\r\n"
        )));
        assert!(says_unavailable(&reply_error(
            b"-CLUSTERDOWN The cluster is down\r\n"
        )));
        let io = ::redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(says_unavailable(&io));
    }
}
