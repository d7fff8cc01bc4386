//! Configuration in two tiers: [`file`] mirrors the YAML and refuses unknown keys; this module
//! validates it once, at load, into the runtime [`Config`]. Every error names the file, the key
//! path and the rule broken, e.g.
//! `conf/sluice.yaml: pools[0].timeouts.first_byte: must not be longer than pools[0].timeouts.total (90s > 60s)`.

pub mod file;
mod limits;
mod listeners;
pub(crate) mod pools;

use crate::chain::ResolvedPlugins;
use crate::discovery::PoolDiscovery;
use crate::edge::ConnectionLimits;
use ipnet::IpNet;
use pingora_core::server::configuration::ServerConf;
use sluice_sdk::calls::PoolCalls;
use sluice_sdk::ConfigError as Invalid;
use sluice_sdk::{HeaderRules, Host, MemoryBudget, Pool, Pools};
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use file::FileConfig;
pub use file::LogFormat;

/// A config that cannot be used: where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// The key path, e.g. `pools[0].backends[1].address`; empty for the whole file.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}: {}: {}",
                self.file.display(),
                self.path,
                self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

/// The validated, runtime configuration.
#[derive(Debug)]
pub struct Config {
    pub source: PathBuf,
    /// Pingora's own settings.
    pub server: ServerConf,
    pub listeners: Vec<Listener>,
    pub admin: Option<SocketAddr>,
    /// Host names the admin answers to, besides IP addresses and `localhost` (lower case).
    pub admin_hosts: Vec<String>,
    pub limits: Limits,
    pub log: LogSettings,
    pub pools: Arc<Pools>,
    /// The pools whose backends come from a discovery source, with it.
    pub discovery: Vec<PoolDiscovery>,
    /// The budget of bytes held in memory for requests, shared with the plugins.
    pub memory: Arc<MemoryBudget>,
    pub routes: Vec<RouteRule>,
    /// The enabled plugins, resolved, in chain order: the chain starts them.
    pub plugins: ResolvedPlugins,
    /// Where stored responses' notes are kept.
    pub responses: ResponsesSettings,
    /// The Redis the pools' sessions are shared in (`sessions.store: redis`), if any.
    pub shared_sessions: Option<sluice_sdk::RedisSettings>,
    /// Traces over OTLP, when on.
    pub telemetry: Option<TelemetrySettings>,
}

/// `telemetry`: where traces go and which are kept.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySettings {
    pub endpoint: String,
    pub protocol: TraceProtocol,
    /// The share of new traces kept, 0 to 1.
    pub sampling: f64,
    pub service_name: String,
    pub continue_client_traces: bool,
}

/// How spans are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceProtocol {
    HttpProtobuf,
    Grpc,
}

/// `responses`: how long a stored response's note is kept, and in Redis (shared by a fleet's
/// proxies) or, without it, in this process's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponsesSettings {
    pub ttl: Duration,
    pub redis: Option<sluice_sdk::RedisSettings>,
}

#[derive(Debug, Clone)]
pub struct Listener {
    pub address: SocketAddr,
    pub tls: Option<TlsFiles>,
    /// TLS: `h2` is offered by ALPN beside `http/1.1`.
    pub http2: bool,
    /// Plain: a connection opening with the HTTP/2 preface is served as h2c.
    pub h2c: bool,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What one client may cost, and all clients together.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_request_body_bytes: usize,
    /// Between two reads of a request body.
    pub client_body_timeout: Duration,
    /// The whole request body, from its first read.
    pub client_body_deadline: Duration,
    /// Between two writes to the client: a client that stops reading is cut after it.
    pub send_timeout: Duration,
    /// Requests in flight, per client address and in total.
    pub max_requests_in_flight: usize,
    pub max_requests_in_flight_per_client: usize,
    /// Bytes of request bodies and held answers kept in memory at once.
    pub max_buffered_bytes: usize,
    /// Streams open at once on one HTTP/2 connection (advertised in SETTINGS).
    pub h2_max_concurrent_streams: u32,
    /// Connection caps and the header deadline, applied below HTTP.
    pub connections: ConnectionLimits,
    /// Proxies whose `X-Forwarded-For` names the client.
    pub trusted_proxies: Vec<IpNet>,
}

#[derive(Debug, Clone)]
pub struct LogSettings {
    pub level: String,
    pub format: LogFormat,
    pub access_log: bool,
}

/// A plain-HTTP route: requests whose path starts with `path_prefix` (and whose `Host` is
/// `host`, when set) are proxied to `pool`.
#[derive(Debug, Clone)]
pub struct RouteRule {
    pub name: Arc<str>,
    pub path_prefix: String,
    pub host: Option<String>,
    pub pool: Arc<Pool>,
    /// Applied after the pool's.
    pub headers: Arc<HeaderRules>,
}

/// The longest timeout accepted: longer ones are mistakes, and deadlines past it overflow
/// nothing but help nobody.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

impl Config {
    /// Reads and validates the file at `path`. `calls` is how the plugins will send requests
    /// of their own to pools (the core's, `proxy::pool_calls`): handed in, so that the config
    /// knows nothing of the proxy.
    pub fn load(path: &Path, calls: &Arc<dyn PoolCalls>) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_path_buf(),
            path: String::new(),
            message: format!("cannot read the file: {e}"),
        })?;
        Self::parse(&text, path, calls)
    }

    /// Validates `text` as if it were the file at `path` (relative paths inside the config,
    /// like TLS certificates, are resolved against that file's folder).
    pub fn parse(text: &str, path: &Path, calls: &Arc<dyn PoolCalls>) -> Result<Self, ConfigError> {
        let at = |key: &str, message: String| ConfigError {
            file: path.to_path_buf(),
            path: key.to_string(),
            message,
        };
        let deserializer = serde_yaml_ng::Deserializer::from_str(text);
        let raw: FileConfig = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let key = e.path().to_string();
            // `.` is the whole document; a `?` segment is where a syntax error stopped the
            // parser, which the message's line and column say better.
            let key = key.strip_suffix(".?").unwrap_or(&key);
            let key = if key == "." || key == "?" {
                String::new()
            } else {
                key.to_string()
            };
            let message = e.into_inner().to_string();
            // The YAML parser starts its message with the (shorter) path it knew: drop it.
            let message = match message.split_once(": ") {
                Some((head, rest)) if !head.contains(' ') && key.starts_with(head) => {
                    rest.to_string()
                }
                _ => message,
            };
            at(&key, message)
        })?;
        validate(raw, path, calls).map_err(|e| at(&e.key, e.message))
    }
}

/// Checks the file section by section, in this order: the first rule broken is the error.
fn validate(raw: FileConfig, path: &Path, calls: &Arc<dyn PoolCalls>) -> Result<Config, Invalid> {
    let base = path.parent().unwrap_or(Path::new("."));
    let server = server_conf(&raw)?;
    let listeners = listeners::listeners(&raw.listeners, base)?;
    let admin = listeners::admin(&raw.admin, &listeners)?;
    let limits = limits::limits(&raw)?;
    let log = log_settings(&raw.log)?;
    let (pools, discovery) = pools::pools(&raw, base)?;
    let pools = Arc::new(pools);
    let routes = routes(&raw, &pools)?;
    let host = Host {
        pools: Arc::clone(&pools),
        memory: MemoryBudget::new(limits.max_buffered_bytes),
        calls: Arc::clone(calls),
    };
    let plugins = crate::chain::resolve(raw.plugins, &host)?;
    let responses = responses(&raw.responses)?;
    let shared_sessions = redis_store(
        raw.sessions.store,
        raw.sessions.redis.as_ref(),
        "sessions.redis",
    )?;
    let telemetry = raw.telemetry.as_ref().map(telemetry).transpose()?;

    Ok(Config {
        source: path.to_path_buf(),
        server,
        listeners,
        admin,
        admin_hosts: raw
            .admin
            .hosts
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect(),
        limits,
        log,
        pools: host.pools,
        discovery,
        memory: host.memory,
        routes,
        plugins,
        responses,
        shared_sessions,
        telemetry,
    })
}

fn telemetry(raw: &file::TelemetryFile) -> Result<TelemetrySettings, Invalid> {
    if !(0.0..=1.0).contains(&raw.sampling) {
        return Err(Invalid::new(
            "telemetry.sampling",
            "must be between 0 and 1",
        ));
    }
    let endpoint = raw.otlp.endpoint.trim();
    let scheme_ok = endpoint.starts_with("http://") || endpoint.starts_with("https://");
    if !scheme_ok || endpoint.parse::<http::Uri>().is_err() {
        return Err(Invalid::new(
            "telemetry.otlp.endpoint",
            format!("`{endpoint}` is not an http:// or https:// URL"),
        ));
    }
    if raw.service_name.trim().is_empty() {
        return Err(Invalid::new("telemetry.service_name", "must not be empty"));
    }
    Ok(TelemetrySettings {
        endpoint: endpoint.to_string(),
        protocol: match raw.otlp.protocol {
            file::OtlpProtocol::HttpProtobuf => TraceProtocol::HttpProtobuf,
            file::OtlpProtocol::Grpc => TraceProtocol::Grpc,
        },
        sampling: raw.sampling,
        service_name: raw.service_name.clone(),
        continue_client_traces: raw.otlp_client_traces_continue(),
    })
}

fn responses(raw: &file::ResponsesFile) -> Result<ResponsesSettings, Invalid> {
    if raw.ttl.is_zero() {
        return Err(Invalid::new("responses.ttl", "must be more than 0"));
    }
    let redis = redis_store(raw.store, raw.redis.as_ref(), "responses.redis")?;
    Ok(ResponsesSettings {
        ttl: raw.ttl,
        redis,
    })
}

/// A store's Redis settings (`key`: its section), when the store is Redis.
fn redis_store(
    store: file::ResponsesStore,
    raw: Option<&file::ResponsesRedisFile>,
    key: &str,
) -> Result<Option<sluice_sdk::RedisSettings>, Invalid> {
    match (store, raw) {
        (file::ResponsesStore::Memory, _) => Ok(None),
        (file::ResponsesStore::Redis, None) => {
            Err(Invalid::new(key, "store: redis needs a redis section"))
        }
        (file::ResponsesStore::Redis, Some(r)) => {
            let settings = sluice_sdk::RedisSettings {
                url: r.url.clone(),
                cluster_nodes: r.cluster_nodes.clone(),
                timeout: r.timeout,
                connect_timeout: r.connect_timeout,
                failure_threshold: r.failure_threshold,
                cooldown: r.cooldown,
            };
            settings.validate("timeout").map_err(|e| e.under(key))?;
            Ok(Some(settings))
        }
    }
}

fn server_conf(raw: &FileConfig) -> Result<ServerConf, Invalid> {
    let p = &raw.pingora;
    if p.threads == 0 {
        return Err(Invalid::new("pingora.threads", "must be at least 1"));
    }
    if p.listener_tasks_per_fd == 0 {
        return Err(Invalid::new(
            "pingora.listener_tasks_per_fd",
            "must be at least 1",
        ));
    }
    if let Some(path) = &p.ca_file {
        check_ca_file(path).map_err(|e| Invalid::new("pingora.ca_file", format!("{path}: {e}")))?;
    }
    if p.daemon && p.error_log.is_none() {
        return Err(Invalid::new(
            "pingora.error_log",
            "a daemon has no terminal: set error_log to a file",
        ));
    }
    Ok(ServerConf {
        threads: p.threads,
        work_stealing: p.work_stealing,
        pid_file: p.pid_file.clone(),
        upgrade_sock: p.upgrade_sock.clone(),
        error_log: p.error_log.clone(),
        user: p.user.clone(),
        group: p.group.clone(),
        daemon: p.daemon,
        grace_period_seconds: p.grace_period_seconds,
        graceful_shutdown_timeout_seconds: p.graceful_shutdown_timeout_seconds,
        upstream_keepalive_pool_size: p.upstream_keepalive_pool_size,
        listener_tasks_per_fd: p.listener_tasks_per_fd,
        ca_file: p.ca_file.clone(),
        ..ServerConf::default()
    })
}

/// Loads the CA file as Pingora's TLS connector will, so that a missing or broken file is a
/// configuration error here instead of a panic when the connector is built.
fn check_ca_file(path: &str) -> Result<(), String> {
    use pingora_core::tls::{load_ca_file_into_store, RootCertStore};
    std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    let mut store = RootCertStore::empty();
    load_ca_file_into_store(path, &mut store).map_err(|e| e.to_string().trim().to_string())?;
    if store.is_empty() {
        return Err("holds no PEM certificate".into());
    }
    Ok(())
}

fn log_settings(raw: &file::LogFile) -> Result<LogSettings, Invalid> {
    if !is_log_filter(&raw.level) {
        return Err(Invalid::new(
            "log.level",
            format!(
                "`{}` is not a log level or filter (try info, debug, warn)",
                raw.level
            ),
        ));
    }
    Ok(LogSettings {
        level: raw.level.clone(),
        format: raw.format,
        access_log: raw.access_log,
    })
}

fn routes(raw: &FileConfig, pools: &Pools) -> Result<Vec<RouteRule>, Invalid> {
    let mut routes = Vec::new();
    for (i, r) in raw.routes.iter().enumerate() {
        let key = format!("routes[{i}]");
        if !r.path_prefix.starts_with('/') {
            return Err(Invalid::new(
                format!("{key}.path_prefix"),
                "must start with /",
            ));
        }
        let pool = pools.get(&r.pool).ok_or_else(|| {
            Invalid::new(
                format!("{key}.pool"),
                format!("no pool is named `{}`", r.pool),
            )
        })?;
        let name = r.name.clone().unwrap_or_else(|| r.path_prefix.clone());
        routes.push(RouteRule {
            name: Arc::from(name),
            path_prefix: r.path_prefix.clone(),
            host: r.host.as_ref().map(|h| h.to_ascii_lowercase()),
            pool: pool.clone(),
            headers: Arc::new(pools::header_rules(&r.headers, &format!("{key}.headers"))?),
        });
    }
    Ok(routes)
}

/// A log level (`info`) or a list of directives (`info,pingora=warn`). A bare word that is not
/// a level would be taken as a target name and silence everything else: a typo, refused.
fn is_log_filter(text: &str) -> bool {
    const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
    let directives_ok = text.split(',').all(|d| {
        let d = d.trim();
        match d.split_once('=') {
            Some((target, level)) => {
                !target.is_empty() && LEVELS.contains(&level.to_ascii_lowercase().as_str())
            }
            None => LEVELS.contains(&d.to_ascii_lowercase().as_str()),
        }
    });
    directives_ok && tracing_subscriber::EnvFilter::try_new(text).is_ok()
}

/// `host:port` → one socket address (host names are resolved once, at load).
fn socket_address(text: &str) -> Result<SocketAddr, String> {
    let mut addrs = text
        .to_socket_addrs()
        .map_err(|e| format!("`{text}` is not a host:port address ({e})"))?;
    addrs
        .next()
        .ok_or_else(|| format!("`{text}` resolves to no address"))
}

fn existing_file(base: &Path, name: &str) -> Result<PathBuf, String> {
    let path = base.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("no file at {}", path.display()))
    }
}

#[cfg(test)]
mod tests;
