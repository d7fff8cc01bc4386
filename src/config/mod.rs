//! Configuration in two tiers: [`file`] mirrors the YAML and refuses unknown keys; this module
//! validates it once, at load, into the runtime [`Config`]. Every error names the file, the key
//! path and the rule broken, e.g.
//! `conf/sluice.yaml: pools[0].timeouts.first_byte: must not be longer than pools[0].timeouts.total (90s > 60s)`.

pub mod file;

use crate::chain::ResolvedPlugins;
use crate::discovery::{dns, kubernetes, PoolDiscovery, Source};
use crate::edge::ConnectionLimits;
use ipnet::IpNet;
use pingora_core::server::configuration::ServerConf;
use sluice_sdk::pool::{SessionAffinity, SessionMode, TtftBalancing};
use sluice_sdk::ConfigError as Invalid;
use sluice_sdk::{
    AnswerModel, BackendSpec, Balancing, Capabilities, HeaderRules, HealthPolicy, OutlierPolicy,
    Pool, PoolSettings, Pools, RetryOn, RetryPolicy, ServedModel, StaleAs, Timeouts,
    TokensPerSecond, UpstreamAuth,
};
use sluice_sdk::{Host, MemoryBudget};
use std::collections::HashSet;
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

/// The largest request body limit accepted: bodies are held in memory whole.
const MAX_BODY_LIMIT: usize = 1 << 30;

/// The longest timeout accepted: longer ones are mistakes, and deadlines past it overflow
/// nothing but help nobody.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Beyond this many streams per connection, one client holds a thousand requests' worth of
/// buffers on one socket; nginx allows 128, Envoy 100.
const MAX_H2_STREAMS: u32 = 1000;

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_path_buf(),
            path: String::new(),
            message: format!("cannot read the file: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// Validates `text` as if it were the file at `path` (relative paths inside the config,
    /// like TLS certificates, are resolved against that file's folder).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
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
        validate(raw, path).map_err(|e| at(&e.key, e.message))
    }
}

fn validate(raw: FileConfig, path: &Path) -> Result<Config, Invalid> {
    let base = path.parent().unwrap_or(Path::new("."));
    let server = server_conf(&raw)?;

    if raw.listeners.is_empty() {
        return Err(Invalid::new("listeners", "at least one listener is needed"));
    }
    let mut addresses: Vec<SocketAddr> = Vec::new();
    let mut listeners = Vec::new();
    for (i, l) in raw.listeners.iter().enumerate() {
        let key = format!("listeners[{i}]");
        let address =
            socket_address(&l.address).map_err(|m| Invalid::new(format!("{key}.address"), m))?;
        if let Some(other) = clash(&addresses, address) {
            return Err(Invalid::new(
                format!("{key}.address"),
                format!("{address} clashes with {other}"),
            ));
        }
        addresses.push(address);
        let tls = match &l.tls {
            None => None,
            Some(t) => Some(TlsFiles {
                cert: existing_file(base, &t.cert)
                    .map_err(|m| Invalid::new(format!("{key}.tls.cert"), m))?,
                key: existing_file(base, &t.key)
                    .map_err(|m| Invalid::new(format!("{key}.tls.key"), m))?,
            }),
        };
        if tls.is_some() && l.h2c {
            return Err(Invalid::new(
                format!("{key}.h2c"),
                "is for plain listeners; a TLS listener offers h2 by ALPN (see http2)",
            ));
        }
        if tls.is_none() && l.http2.is_some() {
            return Err(Invalid::new(
                format!("{key}.http2"),
                "is for TLS listeners (ALPN); a plain listener takes HTTP/2 with h2c: true",
            ));
        }
        listeners.push(Listener {
            address,
            http2: tls.is_some() && l.http2.unwrap_or(true),
            h2c: l.h2c,
            tls,
        });
    }

    let admin = if raw.admin.enabled {
        let address =
            socket_address(&raw.admin.address).map_err(|m| Invalid::new("admin.address", m))?;
        if let Some(other) = clash(&addresses, address) {
            return Err(Invalid::new(
                "admin.address",
                format!("{address} clashes with the proxy listener {other}"),
            ));
        }
        Some(address)
    } else {
        None
    };

    let limits = &raw.limits;
    if limits.max_request_body_bytes == 0 || limits.max_request_body_bytes > MAX_BODY_LIMIT {
        return Err(Invalid::new(
            "limits.max_request_body_bytes",
            format!("must be between 1 and {MAX_BODY_LIMIT}"),
        ));
    }
    for (key, value) in [
        ("client_header_timeout", limits.client_header_timeout),
        ("client_body_timeout", limits.client_body_timeout),
        ("client_body_deadline", limits.client_body_deadline),
        ("send_timeout", limits.send_timeout),
    ] {
        if value.is_zero() || value > MAX_TIMEOUT {
            return Err(Invalid::new(
                format!("limits.{key}"),
                format!(
                    "must be longer than 0 and at most {}",
                    humantime::format_duration(MAX_TIMEOUT)
                ),
            ));
        }
    }
    for (key, value) in [
        ("max_connections", limits.max_connections),
        (
            "max_connections_per_client",
            limits.max_connections_per_client,
        ),
        ("max_requests_in_flight", limits.max_requests_in_flight),
        (
            "max_requests_in_flight_per_client",
            limits.max_requests_in_flight_per_client,
        ),
    ] {
        if value == 0 {
            return Err(Invalid::new(format!("limits.{key}"), "must be at least 1"));
        }
    }
    if !(1..=MAX_H2_STREAMS).contains(&limits.h2_max_concurrent_streams) {
        return Err(Invalid::new(
            "limits.h2_max_concurrent_streams",
            format!("must be between 1 and {MAX_H2_STREAMS}"),
        ));
    }
    if limits.max_buffered_bytes < limits.max_request_body_bytes {
        return Err(Invalid::new(
            "limits.max_buffered_bytes",
            format!(
                "must be at least limits.max_request_body_bytes ({} < {})",
                limits.max_buffered_bytes, limits.max_request_body_bytes
            ),
        ));
    }
    let trusted_proxies = raw
        .trusted_proxies
        .iter()
        .enumerate()
        .map(|(i, text)| {
            address_or_network(text).map_err(|m| Invalid::new(format!("trusted_proxies[{i}]"), m))
        })
        .collect::<Result<Vec<_>, _>>()?;

    if !is_log_filter(&raw.log.level) {
        return Err(Invalid::new(
            "log.level",
            format!(
                "`{}` is not a log level or filter (try info, debug, warn)",
                raw.log.level
            ),
        ));
    }

    let (pools, discovery) = pools(&raw, base)?;
    let pools = Arc::new(pools);
    let routes = routes(&raw, &pools)?;
    let host = Host {
        pools: Arc::clone(&pools),
        memory: MemoryBudget::new(limits.max_buffered_bytes),
    };
    let plugins = crate::chain::resolve(raw.plugins, &host)?;

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
        limits: Limits {
            max_request_body_bytes: limits.max_request_body_bytes,
            client_body_timeout: limits.client_body_timeout,
            client_body_deadline: limits.client_body_deadline,
            send_timeout: limits.send_timeout,
            max_requests_in_flight: limits.max_requests_in_flight,
            max_requests_in_flight_per_client: limits.max_requests_in_flight_per_client,
            max_buffered_bytes: limits.max_buffered_bytes,
            h2_max_concurrent_streams: limits.h2_max_concurrent_streams,
            connections: ConnectionLimits {
                max_connections: limits.max_connections,
                max_connections_per_client: limits.max_connections_per_client,
                header_timeout: limits.client_header_timeout,
            },
            trusted_proxies,
        },
        log: LogSettings {
            level: raw.log.level.clone(),
            format: raw.log.format,
            access_log: raw.log.access_log,
        },
        pools: host.pools,
        discovery,
        memory: host.memory,
        routes,
        plugins,
    })
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

fn pools(raw: &FileConfig, base: &Path) -> Result<(Pools, Vec<PoolDiscovery>), Invalid> {
    if raw.pools.is_empty() {
        return Err(Invalid::new("pools", "at least one pool is needed"));
    }
    let mut names = HashSet::new();
    let mut pools = Vec::new();
    let mut discovery = Vec::new();
    for (i, p) in raw.pools.iter().enumerate() {
        let key = format!("pools[{i}]");
        if p.name.is_empty()
            || !p
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
        {
            return Err(Invalid::new(
                format!("{key}.name"),
                format!("`{}` is not a name: use letters, digits, - and _", p.name),
            ));
        }
        if !names.insert(p.name.as_str()) {
            return Err(Invalid::new(
                format!("{key}.name"),
                format!("pool `{}` is defined twice", p.name),
            ));
        }
        let (backends, source) = backends_and_source(p, &key, base)?;
        let (models, auto_models) = match &p.models {
            file::ModelsFile::Names(names) => (names.clone(), false),
            file::ModelsFile::Word(word) if word == "auto" => (Vec::new(), true),
            file::ModelsFile::Word(word) => {
                return Err(Invalid::new(
                    format!("{key}.models"),
                    format!("`{word}` is neither a list of model names nor `auto`"),
                ))
            }
        };
        let t = &p.timeouts;
        let tkey = format!("{key}.timeouts");
        for (name, d) in [
            ("connect", t.connect),
            ("first_byte", t.first_byte),
            ("total", t.total),
            ("keepalive_idle", t.keepalive_idle),
            ("margin", t.margin),
        ] {
            if d > MAX_TIMEOUT {
                return Err(Invalid::new(
                    format!("{tkey}.{name}"),
                    format!(
                        "must be at most {}",
                        humantime::format_duration(MAX_TIMEOUT)
                    ),
                ));
            }
        }
        for (name, d) in [
            ("connect", t.connect),
            ("first_byte", t.first_byte),
            ("total", t.total),
        ] {
            if d.is_zero() {
                return Err(Invalid::new(
                    format!("{tkey}.{name}"),
                    "must be longer than 0",
                ));
            }
        }
        if t.first_byte > t.total {
            return Err(Invalid::new(
                format!("{tkey}.first_byte"),
                format!(
                    "must not be longer than {tkey}.total ({} > {})",
                    humantime::format_duration(t.first_byte),
                    humantime::format_duration(t.total)
                ),
            ));
        }
        if t.connect > t.total {
            return Err(Invalid::new(
                format!("{tkey}.connect"),
                format!("must not be longer than {tkey}.total"),
            ));
        }
        let sized_by_max_tokens = match t.min_tokens_per_second {
            None => None,
            Some(rate) if rate.is_finite() && rate > 0.0 => Some(TokensPerSecond {
                min_tokens_per_second: rate,
                margin: t.margin,
            }),
            Some(rate) => {
                return Err(Invalid::new(
                    format!("{tkey}.min_tokens_per_second"),
                    format!("must be a number above 0 (got {rate})"),
                ))
            }
        };
        if p.max_model_len == Some(0) {
            return Err(Invalid::new(
                format!("{key}.max_model_len"),
                "must be at least 1",
            ));
        }
        let timeouts = Timeouts {
            connect: t.connect,
            first_byte: t.first_byte,
            total: t.total,
            keepalive_idle: t.keepalive_idle,
            sized_by_max_tokens,
        };
        let health = health_policy(&p.health, &format!("{key}.health"))?;
        if auto_models && !health.enabled {
            return Err(Invalid::new(
                format!("{key}.models"),
                "`auto` learns the models from the backends' /v1/models with the health checks: \
                 they must be on (or list the models)",
            ));
        }
        let pool = Arc::new(Pool::new(PoolSettings {
            name: p.name.clone(),
            models,
            auto_models,
            max_model_len: p.max_model_len,
            timeouts,
            backends,
            source: source
                .as_ref()
                .map_or_else(|| "static".to_string(), Source::describe),
            tls_sni: p.tls.as_ref().map(|t| t.sni.clone()),
            health,
            outlier: outlier_policy(&p.outlier_detection, &format!("{key}.outlier_detection"))?,
            balancing: balancing(&p.balancing, &format!("{key}.balancing"))?,
            supports: Capabilities {
                tools: p.supports.tools,
                logprobs: p.supports.logprobs,
                multiple_choices: p.supports.multiple_choices,
                best_of: p.supports.best_of,
            },
            retry: retry_policy(&p.retry, &format!("{key}.retry"))?,
            price_per_million_tokens: price(p.price_per_million_tokens, &key)?,
            headers: header_rules(&p.headers, &format!("{key}.headers"))?,
            upstream_auth: match &p.upstream_auth {
                Some(auth) => Some(upstream_auth(auth, &format!("{key}.upstream_auth"))?),
                None => None,
            },
            forward_client_key: p.forward_client_key,
            sessions: session_affinity(&p.balancing, &format!("{key}.balancing"))?,
            served_model: served_model(p, &key)?,
        }));
        if let Some(source) = source {
            discovery.push(PoolDiscovery {
                pool: Arc::clone(&pool),
                source,
            });
        }
        pools.push(pool);
    }
    Ok((Pools::new(pools), discovery))
}

/// A pool's configured backends, and the source that changes them at run time: its
/// `discovery`, or the re-resolution of the host names among its `backends`.
fn backends_and_source(
    p: &file::PoolFile,
    key: &str,
    base: &Path,
) -> Result<(Vec<BackendSpec>, Option<Source>), Invalid> {
    if let Some(d) = &p.discovery {
        if !p.backends.is_empty() {
            return Err(Invalid::new(
                format!("{key}.discovery"),
                "a pool has `backends` or `discovery`, not both",
            ));
        }
        let dkey = format!("{key}.discovery");
        let source = match (&d.dns, &d.kubernetes) {
            (Some(dns), None) => Source::Dns(dns_source(dns, &format!("{dkey}.dns"))?),
            (None, Some(k)) => {
                Source::Kubernetes(kubernetes_source(k, &format!("{dkey}.kubernetes"), base)?)
            }
            _ => return Err(Invalid::new(dkey, "give one source: `dns` or `kubernetes`")),
        };
        return Ok((Vec::new(), Some(source)));
    }
    if p.backends.is_empty() {
        return Err(Invalid::new(
            format!("{key}.backends"),
            "at least one backend is needed (or a `discovery` source)",
        ));
    }
    let mut backends = Vec::new();
    let mut named = Vec::new();
    for (j, b) in p.backends.iter().enumerate() {
        let bkey = format!("{key}.backends[{j}]");
        if b.weight == 0 {
            return Err(Invalid::new(format!("{bkey}.weight"), "must be at least 1"));
        }
        let resolved =
            socket_address(&b.address).map_err(|m| Invalid::new(format!("{bkey}.address"), m))?;
        if backends
            .iter()
            .any(|x: &BackendSpec| x.resolved == resolved)
        {
            return Err(Invalid::new(
                format!("{bkey}.address"),
                format!("{resolved} is listed twice in this pool"),
            ));
        }
        let host = b.address.rsplit_once(':').map_or("", |(host, _)| {
            host.trim_start_matches('[').trim_end_matches(']')
        });
        named.push(dns::NamedBackend {
            address: b.address.clone(),
            host: host.to_string(),
            port: resolved.port(),
            weight: b.weight,
            resolved,
        });
        backends.push(BackendSpec {
            address: b.address.clone(),
            resolved,
            weight: b.weight,
        });
    }
    // Re-resolved when some backend is given by name; the others are listed as they are,
    // since an update lists all of a pool's backends.
    let by_name = named
        .iter()
        .any(|n| n.host.parse::<std::net::IpAddr>().is_err());
    let source = by_name.then_some(Source::Names(named));
    Ok((backends, source))
}

/// The longest refresh or debounce accepted.
const MAX_REFRESH: Duration = Duration::from_secs(3600);

fn dns_source(d: &file::DnsFile, key: &str) -> Result<dns::DnsSource, Invalid> {
    let name = d.name.trim_end_matches('.');
    let valid_name = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        });
    if !valid_name {
        return Err(Invalid::new(
            format!("{key}.name"),
            format!("`{}` is not a DNS name", d.name),
        ));
    }
    if d.port == 0 {
        return Err(Invalid::new(format!("{key}.port"), "must be at least 1"));
    }
    let resolver = match &d.resolver {
        None => None,
        Some(text) => Some(
            text.parse::<SocketAddr>()
                .or_else(|_| {
                    text.parse::<std::net::IpAddr>()
                        .map(|ip| SocketAddr::new(ip, 53))
                })
                .map_err(|_| {
                    Invalid::new(
                        format!("{key}.resolver"),
                        format!("`{text}` is not an IP address or ip:port"),
                    )
                })?,
        ),
    };
    if d.min_refresh.is_zero() || d.min_refresh > MAX_REFRESH {
        return Err(Invalid::new(
            format!("{key}.min_refresh"),
            "must be longer than 0 and at most 1h",
        ));
    }
    if d.max_refresh < d.min_refresh || d.max_refresh > MAX_REFRESH {
        return Err(Invalid::new(
            format!("{key}.max_refresh"),
            "must be at least min_refresh and at most 1h",
        ));
    }
    if d.timeout.is_zero() || d.timeout > Duration::from_secs(60) {
        return Err(Invalid::new(
            format!("{key}.timeout"),
            "must be longer than 0 and at most 60s",
        ));
    }
    Ok(dns::DnsSource {
        name: name.to_string(),
        port: d.port,
        resolver,
        min_refresh: d.min_refresh,
        max_refresh: d.max_refresh,
        timeout: d.timeout,
        on_empty: match d.on_empty {
            file::OnEmptyFile::Drain => dns::OnEmpty::Drain,
            file::OnEmptyFile::Keep => dns::OnEmpty::Keep,
        },
    })
}

/// Whether `text` is a Kubernetes object name of the DNS-label kind (a Service, a namespace).
fn is_dns_label(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

fn kubernetes_source(
    k: &file::KubernetesFile,
    key: &str,
    base: &Path,
) -> Result<kubernetes::KubernetesSource, Invalid> {
    if !is_dns_label(&k.service) {
        return Err(Invalid::new(
            format!("{key}.service"),
            format!(
                "`{}` is not a Service name (lower-case letters, digits and -)",
                k.service
            ),
        ));
    }
    if let Some(namespace) = k.namespace.as_deref().filter(|n| !is_dns_label(n)) {
        return Err(Invalid::new(
            format!("{key}.namespace"),
            format!("`{namespace}` is not a namespace name (lower-case letters, digits and -)"),
        ));
    }
    let port = match &k.port {
        file::PortFile::Number(0) => {
            return Err(Invalid::new(format!("{key}.port"), "must be at least 1"))
        }
        file::PortFile::Number(n) => kubernetes::PortRef::Number(*n),
        file::PortFile::Name(name) if name.len() <= 15 && is_dns_label(name) => {
            kubernetes::PortRef::Name(name.clone())
        }
        file::PortFile::Name(name) => {
            return Err(Invalid::new(
                format!("{key}.port"),
                format!("`{name}` is not a port number or port name"),
            ))
        }
    };
    let kubeconfig = match &k.kubeconfig {
        None => None,
        Some(path) => Some(
            existing_file(base, path).map_err(|m| Invalid::new(format!("{key}.kubeconfig"), m))?,
        ),
    };
    if k.debounce > Duration::from_secs(10) {
        return Err(Invalid::new(
            format!("{key}.debounce"),
            "must be at most 10s",
        ));
    }
    Ok(kubernetes::KubernetesSource {
        service: k.service.clone(),
        namespace: k.namespace.clone(),
        port,
        kubeconfig,
        debounce: k.debounce,
    })
}

/// The pool's served model name, and what its answers say.
fn served_model(p: &file::PoolFile, key: &str) -> Result<Option<ServedModel>, Invalid> {
    let answer = match p.answer_model {
        None | Some(file::AnswerModelFile::Requested) => AnswerModel::Requested,
        Some(file::AnswerModelFile::Served) => AnswerModel::Served,
    };
    let Some(name) = &p.served_model else {
        if p.answer_model.is_some() {
            return Err(Invalid::new(
                format!("{key}.answer_model"),
                "is only read with served_model (without it, answers say what the engine serves)",
            ));
        }
        return Ok(None);
    };
    ServedModel::new(name, answer)
        .map(Some)
        .map_err(|m| Invalid::new(format!("{key}.served_model"), m))
}

/// Headers a rule may not touch: the message's framing and the hops are the proxy's.
const UNRULED_HEADERS: [&str; 8] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

fn ruled_header_name(key: &str, name: &str) -> Result<http::HeaderName, Invalid> {
    let parsed = sluice_sdk::config::header_name(key, name)?;
    if UNRULED_HEADERS.contains(&parsed.as_str()) {
        return Err(Invalid::new(
            key,
            format!("`{name}` frames the message or the connection: the proxy sets it"),
        ));
    }
    Ok(parsed)
}

fn header_pairs(
    set: &std::collections::BTreeMap<String, String>,
    key: &str,
) -> Result<Vec<(http::HeaderName, http::HeaderValue)>, Invalid> {
    set.iter()
        .map(|(name, value)| {
            let key = format!("{key}.{name}");
            let name = ruled_header_name(&key, name)?;
            let value = http::HeaderValue::from_str(value).map_err(|_| {
                Invalid::new(
                    &key,
                    "is not a valid header value (visible ASCII, no line breaks)",
                )
            })?;
            Ok((name, value))
        })
        .collect()
}

fn header_names(names: &[String], key: &str) -> Result<Vec<http::HeaderName>, Invalid> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| ruled_header_name(&format!("{key}[{i}]"), name))
        .collect()
}

fn header_rules(h: &file::HeaderRulesFile, key: &str) -> Result<HeaderRules, Invalid> {
    Ok(HeaderRules {
        request_set: header_pairs(&h.request.set, &format!("{key}.request.set"))?,
        request_remove: header_names(&h.request.remove, &format!("{key}.request.remove"))?,
        response_set: header_pairs(&h.response.set, &format!("{key}.response.set"))?,
        response_hide: header_names(&h.response.hide, &format!("{key}.response.hide"))?,
    })
}

/// The pool's credential, read now from the environment or a file: a missing one is a
/// config error (`sluice -t` says so), and the secret is never in an error or a log.
fn upstream_auth(a: &file::UpstreamAuthFile, key: &str) -> Result<UpstreamAuth, Invalid> {
    let secret = match (&a.from_env, &a.from_file) {
        (Some(var), None) => std::env::var(var).map_err(|_| {
            Invalid::new(
                format!("{key}.from_env"),
                format!("the environment variable `{var}` is not set (or not UTF-8)"),
            )
        })?,
        (None, Some(path)) => std::fs::read_to_string(path).map_err(|e| {
            Invalid::new(
                format!("{key}.from_file"),
                format!("cannot read {}: {e}", path.display()),
            )
        })?,
        _ => {
            return Err(Invalid::new(
                key,
                "needs exactly one of from_env and from_file: the secret is never written in the config",
            ))
        }
    };
    let secret = secret.trim();
    if secret.is_empty() {
        return Err(Invalid::new(key, "the secret is empty"));
    }
    let header = match &a.header {
        Some(name) => ruled_header_name(&format!("{key}.header"), name)?,
        None => http::header::AUTHORIZATION,
    };
    let text = if header == http::header::AUTHORIZATION {
        format!("Bearer {secret}")
    } else {
        secret.to_owned()
    };
    let mut value = http::HeaderValue::from_str(&text)
        .map_err(|_| Invalid::new(key, "the secret is not a valid header value"))?;
    value.set_sensitive(true);
    Ok(UpstreamAuth { header, value })
}

fn price(dollars: f64, key: &str) -> Result<f64, Invalid> {
    if dollars.is_finite() && dollars >= 0.0 {
        Ok(dollars)
    } else {
        Err(Invalid::new(
            format!("{key}.price_per_million_tokens"),
            format!("must be a number of dollars, 0 or more (got {dollars})"),
        ))
    }
}

/// The shortest health-check interval: faster scraping costs the backends more than it helps.
const MIN_HEALTH_INTERVAL: Duration = Duration::from_millis(50);

fn health_policy(h: &file::HealthFile, key: &str) -> Result<HealthPolicy, Invalid> {
    if h.interval < MIN_HEALTH_INTERVAL {
        return Err(Invalid::new(
            format!("{key}.interval"),
            format!(
                "must be at least {} (got {})",
                humantime::format_duration(MIN_HEALTH_INTERVAL),
                humantime::format_duration(h.interval)
            ),
        ));
    }
    if h.timeout.is_zero() {
        return Err(Invalid::new(
            format!("{key}.timeout"),
            "must be longer than 0",
        ));
    }
    if h.stale_after < h.interval {
        return Err(Invalid::new(
            format!("{key}.stale_after"),
            format!("must not be shorter than {key}.interval"),
        ));
    }
    for (name, n) in [
        ("unhealthy_after", h.unhealthy_after),
        ("healthy_after", h.healthy_after),
    ] {
        if n == 0 {
            return Err(Invalid::new(format!("{key}.{name}"), "must be at least 1"));
        }
    }
    for (name, path) in [
        ("health_path", &h.health_path),
        ("metrics_path", &h.metrics_path),
    ] {
        if !path.starts_with('/') {
            return Err(Invalid::new(format!("{key}.{name}"), "must start with /"));
        }
    }
    Ok(HealthPolicy {
        enabled: h.enabled,
        interval: h.interval,
        timeout: h.timeout,
        unhealthy_after: h.unhealthy_after,
        healthy_after: h.healthy_after,
        stale_after: h.stale_after,
        stale_as: match h.stale_as {
            file::StaleAsFile::Saturated => StaleAs::Saturated,
            file::StaleAsFile::Unknown => StaleAs::Unknown,
        },
        health_path: h.health_path.clone(),
        metrics_path: h.metrics_path.clone(),
    })
}

fn outlier_policy(o: &file::OutlierFile, key: &str) -> Result<OutlierPolicy, Invalid> {
    if o.consecutive_failures > 0 && o.base_ejection.is_zero() {
        return Err(Invalid::new(
            format!("{key}.base_ejection"),
            "must be longer than 0",
        ));
    }
    if o.max_ejection < o.base_ejection {
        return Err(Invalid::new(
            format!("{key}.max_ejection"),
            format!("must not be shorter than {key}.base_ejection"),
        ));
    }
    if o.max_ejection_percent > 100 {
        return Err(Invalid::new(
            format!("{key}.max_ejection_percent"),
            format!("must be between 0 and 100 (got {})", o.max_ejection_percent),
        ));
    }
    Ok(OutlierPolicy {
        consecutive_failures: o.consecutive_failures,
        base_ejection: o.base_ejection,
        max_ejection: o.max_ejection,
        max_ejection_percent: o.max_ejection_percent,
    })
}

fn balancing(b: &file::BalancingFile, key: &str) -> Result<Balancing, Invalid> {
    use file::StrategyFile;
    if b.strategy != StrategyFile::Ttft {
        for (name, set) in [
            (
                "prefill_tokens_per_second",
                b.prefill_tokens_per_second.is_some(),
            ),
            ("exploration", b.exploration.is_some()),
        ] {
            if set {
                return Err(Invalid::new(
                    format!("{key}.{name}"),
                    "needs strategy: ttft",
                ));
            }
        }
    }
    match (b.strategy, b.prefix_affinity_bytes) {
        (_, Some(0)) => Err(Invalid::new(
            format!("{key}.prefix_affinity_bytes"),
            "must be at least 1",
        )),
        (StrategyFile::RoundRobin, Some(_)) => Err(Invalid::new(
            format!("{key}.prefix_affinity_bytes"),
            "needs strategy: kv_aware or ttft",
        )),
        (StrategyFile::RoundRobin, None) => Ok(Balancing::RoundRobin),
        (StrategyFile::KvAware, prefix_affinity) => Ok(Balancing::KvAware { prefix_affinity }),
        (StrategyFile::Ttft, prefix_affinity) => {
            let defaults = TtftBalancing::default();
            let speed = b
                .prefill_tokens_per_second
                .unwrap_or(defaults.prefill_tokens_per_second);
            if !(speed.is_finite() && speed > 0.0) {
                return Err(Invalid::new(
                    format!("{key}.prefill_tokens_per_second"),
                    format!("must be a number above 0 (got {speed})"),
                ));
            }
            let exploration = b.exploration.unwrap_or(defaults.exploration);
            if !(0.0..=1.0).contains(&exploration) {
                return Err(Invalid::new(
                    format!("{key}.exploration"),
                    format!("must be between 0 and 1 (got {exploration})"),
                ));
            }
            Ok(Balancing::Ttft(TtftBalancing {
                prefix_affinity,
                prefill_tokens_per_second: speed,
                exploration,
            }))
        }
    }
}

/// The header sessions are named by when `session_header` is absent.
const DEFAULT_SESSION_HEADER: &str = "x-session-id";
/// How long an idle session is remembered when `session_idle_ttl` is absent.
const DEFAULT_SESSION_IDLE_TTL: Duration = Duration::from_secs(30 * 60);
/// The most sessions remembered per pool when `session_capacity` is absent.
const DEFAULT_SESSION_CAPACITY: usize = 65_536;
/// The largest `session_capacity`: the table is allocated whole (8 bytes a session).
const MAX_SESSION_CAPACITY: usize = 1 << 24;

fn session_affinity(
    b: &file::BalancingFile,
    key: &str,
) -> Result<Option<SessionAffinity>, Invalid> {
    let mode = match b.session_affinity {
        file::SessionModeFile::Off => {
            for (name, set) in [
                ("session_header", b.session_header.is_some()),
                ("session_idle_ttl", b.session_idle_ttl.is_some()),
                ("session_capacity", b.session_capacity.is_some()),
            ] {
                if set {
                    return Err(Invalid::new(
                        format!("{key}.{name}"),
                        "needs session_affinity: soft or hard",
                    ));
                }
            }
            return Ok(None);
        }
        file::SessionModeFile::Soft => SessionMode::Soft,
        file::SessionModeFile::Hard => SessionMode::Hard,
    };
    let header = b
        .session_header
        .as_deref()
        .unwrap_or(DEFAULT_SESSION_HEADER)
        .to_ascii_lowercase();
    if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
        return Err(Invalid::new(
            format!("{key}.session_header"),
            format!("is not a header name (got `{header}`)"),
        ));
    }
    let idle_ttl = b.session_idle_ttl.unwrap_or(DEFAULT_SESSION_IDLE_TTL);
    if idle_ttl < Duration::from_secs(1) {
        return Err(Invalid::new(
            format!("{key}.session_idle_ttl"),
            "must be at least 1s",
        ));
    }
    let capacity = b.session_capacity.unwrap_or(DEFAULT_SESSION_CAPACITY);
    if !(2..=MAX_SESSION_CAPACITY).contains(&capacity) {
        return Err(Invalid::new(
            format!("{key}.session_capacity"),
            format!("must be between 2 and {MAX_SESSION_CAPACITY} (got {capacity})"),
        ));
    }
    Ok(Some(SessionAffinity {
        header,
        mode,
        idle_ttl,
        capacity,
    }))
}

fn retry_policy(r: &file::RetryFile, key: &str) -> Result<RetryPolicy, Invalid> {
    if !(0.0..=1.0).contains(&r.budget_ratio) {
        return Err(Invalid::new(
            format!("{key}.budget_ratio"),
            format!("must be between 0 and 1 (got {})", r.budget_ratio),
        ));
    }
    if r.backoff_max < r.backoff_base {
        return Err(Invalid::new(
            format!("{key}.backoff_max"),
            format!("must not be shorter than {key}.backoff_base"),
        ));
    }
    let mut on = RetryOn::NONE;
    for (i, name) in r.on.iter().enumerate() {
        match RetryOn::named(name) {
            Some(condition) => on = on.with(condition),
            // Always on: what failed before reaching the upstream's application.
            None if name == "error" => {}
            None => {
                let known: Vec<&str> = RetryOn::NAMED.iter().map(|(n, _)| *n).collect();
                return Err(Invalid::new(
                    format!("{key}.on[{i}]"),
                    format!(
                        "unknown condition `{name}`; known: error, {}",
                        known.join(", ")
                    ),
                ));
            }
        }
    }
    Ok(RetryPolicy {
        max_retries: r.max_retries,
        on,
        budget_ratio: r.budget_ratio,
        min_retries: r.min_retries,
        backoff_base: r.backoff_base,
        backoff_max: r.backoff_max,
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
            headers: Arc::new(header_rules(&r.headers, &format!("{key}.headers"))?),
        });
    }
    Ok(routes)
}

/// An address in `taken` that `address` cannot bind beside: the same port on the same IP,
/// or on a wildcard (0.0.0.0, ::) that covers it.
fn clash(taken: &[SocketAddr], address: SocketAddr) -> Option<SocketAddr> {
    taken.iter().copied().find(|t| {
        t.port() == address.port()
            && (t.ip() == address.ip() || t.ip().is_unspecified() || address.ip().is_unspecified())
    })
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

/// An address (`10.0.0.1`) or a network (`10.0.0.0/8`).
fn address_or_network(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| format!("`{text}` is not an IP address or a network (10.0.0.0/8)"))
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
