//! `pools`: each pool's backends or discovery source, models, timeouts, health checks, outlier
//! detection, balancing, sessions, retries, price, header rules and upstream credential.

use super::file::{self, FileConfig};
use super::{existing_file, MAX_TIMEOUT};
use crate::discovery::{dns, inference_pool, kubernetes, PoolDiscovery, Source};
use sluice_sdk::pool::disaggregation::{self, Connector, PrefillRoute};
use sluice_sdk::pool::{SessionAffinity, SessionKey, SessionMode, TtftBalancing};
use sluice_sdk::prefix::{KvEventSource, PrefixRouting};
use sluice_sdk::request::SESSION_MEMBERS;
use sluice_sdk::ConfigError as Invalid;
use sluice_sdk::{
    AnswerModel, BackendSpec, Balancing, Capabilities, ClientFields, Fairness, HeaderRules,
    HealthPolicy, OutlierPolicy, Pool, PoolSettings, Pools, RetryOn, RetryPolicy, ServedModel,
    StaleAs, Timeouts, TokensPerSecond, UpstreamAuth,
};
use sluice_tokenizer::PromptTokenizer;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The pools, in file order, and the discovery source of each pool that has one.
pub(super) fn pools(raw: &FileConfig, base: &Path) -> Result<(Pools, Vec<PoolDiscovery>), Invalid> {
    if raw.pools.is_empty() {
        return Err(Invalid::new("pools", "at least one pool is needed"));
    }
    let mut names = HashSet::new();
    let mut pools = Vec::new();
    let mut discovery = Vec::new();
    for (i, p) in raw.pools.iter().enumerate() {
        let key = format!("pools[{i}]");
        check_name(p, &key, &mut names)?;
        let (pool, source) = pool(p, &key, base)?;
        if let Some(source) = source {
            discovery.push(PoolDiscovery {
                pool: Arc::clone(&pool),
                source,
            });
        }
        pools.push(pool);
    }
    check_prefill_routes(&pools)?;
    Ok((Pools::new(pools), discovery))
}

/// A pool's name is a plain word (it is a metric label and a route's target), and unique.
fn check_name<'a>(
    p: &'a file::PoolFile,
    key: &str,
    names: &mut HashSet<&'a str>,
) -> Result<(), Invalid> {
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
    Ok(())
}

/// One pool, and the source that changes its backends at run time, if any.
fn pool(
    p: &file::PoolFile,
    key: &str,
    base: &Path,
) -> Result<(Arc<Pool>, Option<Source>), Invalid> {
    let (backends, source) = backends_and_source(p, key, base)?;
    let (models, auto_models) = models(&p.models, key)?;
    let timeouts = timeouts(&p.timeouts, &format!("{key}.timeouts"))?;
    if p.max_model_len == Some(0) {
        return Err(Invalid::new(
            format!("{key}.max_model_len"),
            "must be at least 1",
        ));
    }
    let health = health_policy(&p.health, &format!("{key}.health"))?;
    if auto_models && !health.enabled {
        return Err(Invalid::new(
            format!("{key}.models"),
            "`auto` learns the models from the backends' /v1/models with the health checks: \
             they must be on (or list the models)",
        ));
    }
    // The fallible fields are checked in the order they are written.
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
        price_per_million_tokens: price(p.price_per_million_tokens, key)?,
        headers: header_rules(&p.headers, &format!("{key}.headers"))?,
        upstream_auth: match &p.upstream_auth {
            Some(auth) => Some(upstream_auth(auth, &format!("{key}.upstream_auth"))?),
            None => None,
        },
        forward_client_key: p.forward_client_key,
        sessions: session_affinity(&p.balancing, &format!("{key}.balancing"))?,
        served_model: served_model(p, key)?,
        client_fields: ClientFields {
            tenant_cache_salt: matches!(p.client_fields.cache_salt, file::CacheSaltFile::PerTenant),
            reset_engine_controls: matches!(
                p.client_fields.engine_controls,
                file::EngineControlsFile::Reset
            ),
        },
        prefix: prefix_routing(p, key, base)?,
        no_backend_wait: no_backend_wait(p, key)?,
        fairness: fairness(p, key)?,
        prefill: prefill_route(p, key)?,
    }));
    Ok((pool, source))
}

/// The pool's tokenizer and exact prefix index (`tokenizer`, `kv_events`): the index needs
/// both, and a balancing that reads it (`ttft` or `kv_aware`).
fn prefix_routing(
    p: &file::PoolFile,
    key: &str,
    base: &Path,
) -> Result<Option<Arc<PrefixRouting>>, Invalid> {
    let source = match &p.kv_events {
        None => None,
        Some(file::KvEventsFile::Word(word)) if word == "auto" => Some(KvEventSource::Auto),
        Some(file::KvEventsFile::Port(port)) if port.port > 0 => {
            Some(KvEventSource::Port(port.port))
        }
        Some(_) => {
            return Err(Invalid::new(
                format!("{key}.kv_events"),
                "must be `auto` (each backend's GET /kv_event_sources) or `{port: N}`",
            ))
        }
    };
    let (Some(dir), Some(source)) = (&p.tokenizer, source) else {
        return match (&p.tokenizer, source) {
            (None, Some(_)) => Err(Invalid::new(
                format!("{key}.kv_events"),
                "needs `tokenizer`: the index is looked up by the prompt's tokens, as the engine makes them",
            )),
            (Some(_), None) => Err(Invalid::new(
                format!("{key}.tokenizer"),
                "is used by the exact prefix index: set `kv_events` too",
            )),
            _ => Ok(None),
        };
    };
    if matches!(p.balancing.strategy, file::StrategyFile::RoundRobin) {
        return Err(Invalid::new(
            format!("{key}.kv_events"),
            "the prefix index is read by the `ttft` and `kv_aware` strategies, not `round_robin`",
        ));
    }
    let dir = base.join(dir);
    let tokenizer = PromptTokenizer::load(&dir)
        .map_err(|e| Invalid::new(format!("{key}.tokenizer"), e.to_string()))?;
    Ok(Some(Arc::new(PrefixRouting::new(
        Arc::new(tokenizer),
        source,
    ))))
}

/// The pool's model names, and whether they are learned (`auto`) instead.
fn models(m: &file::ModelsFile, key: &str) -> Result<(Vec<String>, bool), Invalid> {
    match m {
        file::ModelsFile::Names(names) => Ok((names.clone(), false)),
        file::ModelsFile::Word(word) if word == "auto" => Ok((Vec::new(), true)),
        file::ModelsFile::Word(word) => Err(Invalid::new(
            format!("{key}.models"),
            format!("`{word}` is neither a list of model names nor `auto`"),
        )),
    }
}

/// `tkey` is the section's key, `pools[i].timeouts`.
fn timeouts(t: &file::TimeoutsFile, tkey: &str) -> Result<Timeouts, Invalid> {
    check_timeout_bounds(t, tkey)?;
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
    Ok(Timeouts {
        connect: t.connect,
        first_byte: t.first_byte,
        total: t.total,
        keepalive_idle: t.keepalive_idle,
        sized_by_max_tokens,
    })
}

/// `d`, the duration at `key`, is at most [`MAX_TIMEOUT`] (a day).
fn at_most_a_day(d: Duration, key: &str) -> Result<(), Invalid> {
    if d > MAX_TIMEOUT {
        return Err(Invalid::new(
            key,
            format!(
                "must be at most {}",
                humantime::format_duration(MAX_TIMEOUT)
            ),
        ));
    }
    Ok(())
}

/// `pools[].no_backend_wait`: at most [`MAX_TIMEOUT`]; absent, about a minute.
fn no_backend_wait(p: &file::PoolFile, key: &str) -> Result<Duration, Invalid> {
    let wait = p
        .no_backend_wait
        .unwrap_or(sluice_sdk::pool::DEFAULT_NO_BACKEND_WAIT);
    at_most_a_day(wait, &format!("{key}.no_backend_wait"))?;
    Ok(wait)
}

/// `pools[].prefill`: its own settings here; the pool it names is checked against the
/// others once all are read ([`check_prefill_routes`]).
fn prefill_route(p: &file::PoolFile, key: &str) -> Result<Option<PrefillRoute>, Invalid> {
    let Some(given) = &p.prefill else {
        return Ok(None);
    };
    let key = format!("{key}.prefill");
    let connector = prefill_connector(given, &key)?;
    let route = PrefillRoute {
        pool: given.pool.clone(),
        connector,
        min_prefill_tokens: given
            .min_prefill_tokens
            .unwrap_or(PrefillRoute::DEFAULT_MIN_PREFILL_TOKENS),
        fail_after: given.fail_after.unwrap_or(PrefillRoute::DEFAULT_FAIL_AFTER),
        recover_after: given
            .recover_after
            .unwrap_or(PrefillRoute::DEFAULT_RECOVER_AFTER),
        kv_lease_duration: given
            .kv_lease_duration
            .unwrap_or(PrefillRoute::DEFAULT_KV_LEASE_DURATION),
    };
    if route.pool == p.name {
        return Err(Invalid::new(
            format!("{key}.pool"),
            "names this pool: a pool cannot prefill for itself",
        ));
    }
    if matches!(
        p.client_fields.engine_controls,
        file::EngineControlsFile::Pass
    ) {
        return Err(Invalid::new(
            format!("{key}.pool"),
            "a disaggregated pool's clients may not send `kv_transfer_params`: set \
             `client_fields.engine_controls: reset` (the default)",
        ));
    }
    if route.min_prefill_tokens == 0 {
        return Err(Invalid::new(
            format!("{key}.min_prefill_tokens"),
            "must be at least 1",
        ));
    }
    if !(1..=disaggregation::WINDOW).contains(&route.fail_after) {
        return Err(Invalid::new(
            format!("{key}.fail_after"),
            format!(
                "must be 1 to {} (of the last {} transfers)",
                disaggregation::WINDOW,
                disaggregation::WINDOW
            ),
        ));
    }
    at_most_a_day(route.recover_after, &format!("{key}.recover_after"))?;
    at_most_a_day(route.kv_lease_duration, &format!("{key}.kv_lease_duration"))?;
    if route.kv_lease_duration.is_zero() {
        return Err(Invalid::new(
            format!("{key}.kv_lease_duration"),
            "must be more than 0 (vLLM's default is 30s)",
        ));
    }
    Ok(Some(route))
}

/// `pools[].prefill`'s connector (`key` is the section's) and Mooncake's bootstrap port.
fn prefill_connector(given: &file::PrefillFile, key: &str) -> Result<Connector, Invalid> {
    let connector = match given.connector.as_deref() {
        None | Some("nixl") => Connector::Nixl,
        Some("mooncake") => Connector::Mooncake {
            bootstrap_port: given
                .bootstrap_port
                .unwrap_or(Connector::DEFAULT_BOOTSTRAP_PORT),
        },
        Some(other) => {
            return Err(Invalid::new(
                format!("{key}.connector"),
                format!("`{other}` is not a connector: `nixl` or `mooncake`"),
            ))
        }
    };
    if given.bootstrap_port.is_some() && connector == Connector::Nixl {
        return Err(Invalid::new(
            format!("{key}.bootstrap_port"),
            "is Mooncake's: set `connector: mooncake`, or leave it out",
        ));
    }
    if given.bootstrap_port == Some(0) {
        return Err(Invalid::new(
            format!("{key}.bootstrap_port"),
            "must be a port, 1 to 65535",
        ));
    }
    Ok(connector)
}

/// Every `pools[].prefill` names another pool that exists and does not itself decode for a
/// prefill pool.
fn check_prefill_routes(pools: &[Arc<Pool>]) -> Result<(), Invalid> {
    for (i, pool) in pools.iter().enumerate() {
        let Some(route) = &pool.settings.prefill else {
            continue;
        };
        let key = format!("pools[{i}].prefill.pool");
        match pools.iter().find(|p| *p.name == *route.pool) {
            None => {
                return Err(Invalid::new(
                    key,
                    format!("no pool is named `{}`", route.pool),
                ))
            }
            Some(prefill) if prefill.settings.prefill.is_some() => {
                return Err(Invalid::new(
                    key,
                    format!("`{}` decodes for a prefill pool itself", route.pool),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// `pools[].fairness`: on by default. Flows are named by the pool's session keys, else by
/// the agents' own ([`DEFAULT_SESSION_KEYS`]).
fn fairness(p: &file::PoolFile, key: &str) -> Result<Option<Fairness>, Invalid> {
    let key = format!("{key}.fairness");
    let given = match &p.fairness {
        None => file::FairnessSettingsFile::default(),
        Some(file::FairnessFile::Switch(false)) => return Ok(None),
        Some(file::FairnessFile::Word(word)) if word == "off" => return Ok(None),
        Some(file::FairnessFile::Switch(true)) => file::FairnessSettingsFile::default(),
        Some(file::FairnessFile::Word(word)) if word == "on" => {
            file::FairnessSettingsFile::default()
        }
        Some(file::FairnessFile::Word(word)) => {
            return Err(Invalid::new(
                key,
                format!("`{word}` is neither `on`, `off` nor a map of settings"),
            ))
        }
        Some(file::FairnessFile::Settings(settings)) => settings.clone(),
    };
    let d = Fairness::default();
    let fairness = Fairness {
        half_life: given.half_life.unwrap_or(d.half_life),
        output_weight: given.output_weight.unwrap_or(d.output_weight),
        hold_above_tokens: given.hold_above_tokens.unwrap_or(d.hold_above_tokens),
        max_hold: given.max_hold.unwrap_or(d.max_hold),
        max_held: given.max_held.unwrap_or(d.max_held),
        session_keys: match session_affinity(&p.balancing, "")? {
            Some(sessions) => sessions.keys,
            None => DEFAULT_SESSION_KEYS
                .iter()
                .map(|k| session_key(k, &key))
                .collect::<Result<Vec<_>, _>>()?,
        },
    };
    if fairness.half_life < Duration::from_secs(1) {
        return Err(Invalid::new(
            format!("{key}.half_life"),
            "must be at least 1s",
        ));
    }
    at_most_a_day(fairness.half_life, &format!("{key}.half_life"))?;
    at_most_a_day(fairness.max_hold, &format!("{key}.max_hold"))?;
    if !(fairness.output_weight.is_finite() && (0.0..=1000.0).contains(&fairness.output_weight)) {
        return Err(Invalid::new(
            format!("{key}.output_weight"),
            "must be between 0 and 1000",
        ));
    }
    if fairness.hold_above_tokens == 0 {
        return Err(Invalid::new(
            format!("{key}.hold_above_tokens"),
            "must be at least 1",
        ));
    }
    if !(1..=100_000).contains(&fairness.max_held) {
        return Err(Invalid::new(
            format!("{key}.max_held"),
            "must be between 1 and 100000",
        ));
    }
    Ok(Some(fairness))
}

/// Every timeout is at most a day; those a request waits on are above 0.
fn check_timeout_bounds(t: &file::TimeoutsFile, tkey: &str) -> Result<(), Invalid> {
    for (name, d) in [
        ("connect", t.connect),
        ("first_byte", t.first_byte),
        ("total", t.total),
        ("keepalive_idle", t.keepalive_idle),
        ("margin", t.margin),
    ] {
        at_most_a_day(d, &format!("{tkey}.{name}"))?;
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
    Ok(())
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
        let source = discovery_source(d, &format!("{key}.discovery"), base)?;
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
    let mut addresses = Vec::with_capacity(p.backends.len());
    for (j, b) in p.backends.iter().enumerate() {
        let at = host_and_port(&b.address)
            .map_err(|m| Invalid::new(format!("{key}.backends[{j}].address"), m))?;
        addresses.push(at);
    }
    // The pool's names, asked all at once: a start or reload waits for the slowest, not
    // for their sum.
    let resolved = resolve_all(&addresses, NAME_AT_LOAD);
    for (j, ((b, (host, port)), resolved)) in
        p.backends.iter().zip(addresses).zip(resolved).enumerate()
    {
        let at = Resolved {
            host,
            port,
            resolved,
        };
        let (backend, name) = backend(b, &format!("{key}.backends[{j}]"), &backends, at)?;
        named.push(name);
        backends.extend(backend);
    }
    // Re-resolved when some backend is given by name; the others are listed as they are,
    // since an update lists all of a pool's backends.
    let by_name = named
        .iter()
        .any(|n| n.host.parse::<std::net::IpAddr>().is_err());
    let source = by_name.then_some(Source::Names(named));
    Ok((backends, source))
}

/// `dkey` is the section's key, `pools[i].discovery`.
fn discovery_source(d: &file::DiscoveryFile, dkey: &str, base: &Path) -> Result<Source, Invalid> {
    match (&d.dns, &d.kubernetes, &d.inference_pool) {
        (Some(dns), None, None) => Ok(Source::Dns(dns_source(dns, &format!("{dkey}.dns"))?)),
        (None, Some(k), None) => Ok(Source::Kubernetes(kubernetes_source(
            k,
            &format!("{dkey}.kubernetes"),
            base,
        )?)),
        (None, None, Some(p)) => Ok(Source::InferencePool(inference_pool_source(
            p,
            &format!("{dkey}.inference_pool"),
            base,
        )?)),
        _ => Err(Invalid::new(
            dkey,
            "give one source: `dns`, `kubernetes` or `inference_pool`",
        )),
    }
}

/// One listed backend, as the name re-resolution knows it, and as the pool starts with it
/// when its address is known; `listed` are the pool's backends before it.
fn backend(
    b: &file::BackendFile,
    bkey: &str,
    listed: &[BackendSpec],
    at: Resolved,
) -> Result<(Option<BackendSpec>, dns::NamedBackend), Invalid> {
    if b.weight == 0 {
        return Err(Invalid::new(format!("{bkey}.weight"), "must be at least 1"));
    }
    let Resolved {
        host,
        port,
        resolved,
    } = at;
    if let Some(resolved) = resolved {
        if listed.iter().any(|x| x.resolved == resolved) {
            return Err(Invalid::new(
                format!("{bkey}.address"),
                format!("{resolved} is listed twice in this pool"),
            ));
        }
    }
    let named = dns::NamedBackend {
        address: b.address.clone(),
        host,
        port,
        weight: b.weight,
        resolved,
    };
    let spec = resolved.map(|resolved| BackendSpec {
        address: b.address.clone(),
        resolved,
        weight: b.weight,
    });
    Ok((spec, named))
}

/// How long a backend's host name may take to resolve at load: one that does not (a
/// resolver timing out, a name not there yet) leaves the pool without it until the name
/// re-resolution finds it, rather than refusing the start or the reload.
const NAME_AT_LOAD: Duration = Duration::from_secs(2);

/// `host:port` (a bracketed IPv6 host too), split.
fn host_and_port(text: &str) -> Result<(String, u16), String> {
    if let Ok(addr) = text.parse::<std::net::SocketAddr>() {
        return Ok((addr.ip().to_string(), addr.port()));
    }
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("`{text}` is not a host:port address"))?;
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("`{text}` is not a host:port address (the port)"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains(':') && host.parse::<std::net::IpAddr>().is_err() {
        return Err(format!("`{text}` is not a host:port address (the host)"));
    }
    Ok((host.to_string(), port))
}

/// A backend's host and port, and the address its host had at load, if it had one in time.
struct Resolved {
    host: String,
    port: u16,
    resolved: Option<std::net::SocketAddr>,
}

/// Each `(host, port)`'s first address: an IP literal as it is; a name asked of the system's
/// resolver (`getaddrinfo`, hosts file included), each on a thread of its own, all waited for
/// at most `bound` together; `None` for one that did not answer with an address in time (said
/// in the log). A thread still in `getaddrinfo` then ends with the resolver's own timeout.
fn resolve_all(hosts: &[(String, u16)], bound: Duration) -> Vec<Option<std::net::SocketAddr>> {
    use std::net::ToSocketAddrs;
    /// Where a host's address stands.
    enum Asked {
        /// An IP literal.
        Known(std::net::SocketAddr),
        /// A name, asked on a thread that answers here.
        Waiting(std::sync::mpsc::Receiver<std::io::Result<Option<std::net::SocketAddr>>>),
        /// A name no thread could be started for.
        Unasked,
    }
    let asked: Vec<Asked> = hosts
        .iter()
        .map(|(host, port)| {
            if let Ok(ip) = host.parse::<std::net::IpAddr>() {
                return Asked::Known(std::net::SocketAddr::new(ip, *port));
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let (name, port) = (host.clone(), *port);
            let spawned = std::thread::Builder::new()
                .name("resolve-at-load".into())
                .spawn(move || {
                    let _ = tx.send(
                        (name.as_str(), port)
                            .to_socket_addrs()
                            .map(|mut a| a.next()),
                    );
                });
            match spawned {
                Ok(_) => Asked::Waiting(rx),
                Err(e) => {
                    tracing::warn!("cannot start a thread to resolve {host}: {e}");
                    Asked::Unasked
                }
            }
        })
        .collect();
    let deadline = std::time::Instant::now() + bound;
    asked
        .into_iter()
        .zip(hosts)
        .map(|(asked, (host, port))| {
            let rx = match asked {
                Asked::Known(addr) => return Some(addr),
                Asked::Unasked => return None,
                Asked::Waiting(rx) => rx,
            };
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let why = match rx.recv_timeout(left) {
                Ok(Ok(Some(addr))) => return Some(addr),
                Ok(Ok(None)) => "resolves to no address yet".to_string(),
                Ok(Err(e)) => format!("does not resolve ({e})"),
                Err(_) => format!("did not resolve within {bound:?}"),
            };
            tracing::warn!(
                "backend {host}:{port} {why}: the pool starts without it, and asks again every \
                 few seconds"
            );
            None
        })
        .collect()
}

/// The longest refresh or debounce accepted.
const MAX_REFRESH: Duration = Duration::from_secs(3600);

fn dns_source(d: &file::DnsFile, key: &str) -> Result<dns::DnsSource, Invalid> {
    let name = d.name.trim_end_matches('.');
    if !is_dns_name(name) {
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

/// Whether `name` (without its final dot) is a DNS name: labels of letters, digits, - and _.
fn is_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
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

fn inference_pool_source(
    p: &file::InferencePoolFile,
    key: &str,
    base: &Path,
) -> Result<inference_pool::InferencePoolSource, Invalid> {
    // An object name: a DNS subdomain (lower-case labels joined by dots), at most 253.
    let is_name = p.name.len() <= 253 && p.name.split('.').all(is_dns_label);
    if !is_name {
        return Err(Invalid::new(
            format!("{key}.name"),
            format!(
                "`{}` is not an object name (lower-case letters, digits, - and .)",
                p.name
            ),
        ));
    }
    if let Some(namespace) = p.namespace.as_deref().filter(|n| !is_dns_label(n)) {
        return Err(Invalid::new(
            format!("{key}.namespace"),
            format!("`{namespace}` is not a namespace name (lower-case letters, digits and -)"),
        ));
    }
    let kubeconfig = match &p.kubeconfig {
        None => None,
        Some(path) => Some(
            existing_file(base, path).map_err(|m| Invalid::new(format!("{key}.kubeconfig"), m))?,
        ),
    };
    if p.debounce > Duration::from_secs(10) {
        return Err(Invalid::new(
            format!("{key}.debounce"),
            "must be at most 10s",
        ));
    }
    Ok(inference_pool::InferencePoolSource {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        kubeconfig,
        debounce: p.debounce,
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

/// Headers a rule may not touch: the message's framing, and the hop-by-hop ones (the
/// proxy's).
fn unruled(name: &str) -> bool {
    ["content-length", "transfer-encoding"].contains(&name)
        || sluice_sdk::headers::HOP_BY_HOP.contains(&name)
}

fn ruled_header_name(key: &str, name: &str) -> Result<http::HeaderName, Invalid> {
    let parsed = sluice_sdk::config::header_name(key, name)?;
    if unruled(parsed.as_str()) {
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

pub(super) fn header_rules(h: &file::HeaderRulesFile, key: &str) -> Result<HeaderRules, Invalid> {
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

/// Where sessions are named when neither `session_keys` nor `session_header` is set: what
/// the agents and gateways send, in order. Headers: Sluice's own `x-session-id` (opencode's
/// too), Dynamo's, Claude Code's, Codex's (`session-id`, and `session_id` before 0.131),
/// opencode's, LiteLLM's; body: OpenAI's `prompt_cache_key` (Codex; opencode's camel-case
/// spelling), Qwen Code's and LiteLLM's `metadata` members and LiteLLM's own, and last
/// Anthropic's `metadata.user_id` (Claude Code puts its session id in it; another client's
/// may name a user, not a session).
pub const DEFAULT_SESSION_KEYS: &[&str] = &[
    "header:x-session-id",
    "header:x-dynamo-session-id",
    "header:x-claude-code-session-id",
    "header:session-id",
    "header:session_id",
    "header:x-session-affinity",
    "header:x-opencode-session",
    "header:x-litellm-session-id",
    "body:prompt_cache_key",
    "body:promptCacheKey",
    "body:metadata.sessionId",
    "body:metadata.session_id",
    "body:litellm_session_id",
    "body:metadata.user_id",
];
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
                ("session_keys", b.session_keys.is_some()),
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
    let keys = match (&b.session_keys, &b.session_header) {
        (Some(_), Some(_)) => {
            return Err(Invalid::new(
                format!("{key}.session_header"),
                "is `session_keys: [header:<name>]`: set one of the two",
            ))
        }
        (Some(keys), None) => keys
            .iter()
            .enumerate()
            .map(|(i, k)| session_key(k, &format!("{key}.session_keys[{i}]")))
            .collect::<Result<Vec<_>, _>>()?,
        (None, Some(header)) => {
            vec![session_key(
                &format!("header:{header}"),
                &format!("{key}.session_header"),
            )?]
        }
        (None, None) => DEFAULT_SESSION_KEYS
            .iter()
            .map(|k| session_key(k, key))
            .collect::<Result<Vec<_>, _>>()?,
    };
    if keys.is_empty() {
        return Err(Invalid::new(
            format!("{key}.session_keys"),
            "must name at least one place (or set session_affinity: off)",
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
        keys,
        mode,
        idle_ttl,
        capacity,
    }))
}

/// One of `session_keys`: `header:<name>`, or `body:<member>` for a top-level member the
/// parse notes (`SESSION_MEMBERS`) or `body:metadata.<name>`.
fn session_key(text: &str, key: &str) -> Result<SessionKey, Invalid> {
    if let Some(name) = text.strip_prefix("header:") {
        let name = name.trim().to_ascii_lowercase();
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(Invalid::new(
                key,
                format!("is not a header name (got `{name}`)"),
            ));
        }
        return Ok(SessionKey::Header(name));
    }
    let Some(path) = text.strip_prefix("body:") else {
        return Err(Invalid::new(
            key,
            format!("must be `header:<name>` or `body:<member>` (got `{text}`)"),
        ));
    };
    let (top, inner) = match path.split_once('.') {
        Some((top, inner)) => (top, Some(inner)),
        None => (path, None),
    };
    let member = SESSION_MEMBERS.iter().find(|m| **m == top);
    match (member, inner) {
        (Some(&"metadata"), Some(inner)) if !inner.is_empty() && !inner.contains('.') => {
            Ok(SessionKey::Body {
                member: "metadata",
                inner: Some(inner.to_string()),
            })
        }
        (Some(member), None) if *member != "metadata" => Ok(SessionKey::Body {
            member,
            inner: None,
        }),
        _ => Err(Invalid::new(
            key,
            format!(
                "names no body member a session is read from (got `{path}`): one of \
                 prompt_cache_key, promptCacheKey, litellm_session_id, metadata.<name>"
            ),
        )),
    }
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
