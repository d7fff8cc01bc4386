//! DNS discovery: every A/AAAA record of a name is one backend (routing is per pod, as
//! Envoy's `STRICT_DNS`), re-resolved when the records' TTL ends, clamped to
//! `[min_refresh, max_refresh]`, with jitter. The same loop re-resolves the host names of a
//! static pool's `backends[]`, each staying one backend.
//!
//! An answer with no records (NXDOMAIN or NODATA: a headless Service scaled to zero) does
//! what `on_empty` says, `drain` only once [`EMPTY_TO_DRAIN`] answers in a row said so (one
//! empty answer is as likely a DNS hiccup or a spoofed UDP reply as a fleet scaled to zero);
//! a resolver that errs or times out leaves the pool as it was.

use super::{apply, jittered, report_error, report_recovery};
use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use sluice_sdk::{BackendSpec, Pool, Wanted};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an answer with no records does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnEmpty {
    /// Every backend drains: the name says the fleet is gone (scaled to zero).
    Drain,
    /// The pool keeps the last set: an empty answer is taken for a DNS mistake.
    Keep,
}

/// `pools[].discovery.dns`.
#[derive(Debug, Clone, PartialEq)]
pub struct DnsSource {
    pub name: String,
    pub port: u16,
    /// The name server asked; `None`: the system's (`/etc/resolv.conf`).
    pub resolver: Option<SocketAddr>,
    pub min_refresh: Duration,
    pub max_refresh: Duration,
    /// One lookup's bound, retries included.
    pub timeout: Duration,
    pub on_empty: OnEmpty,
}

/// A `backends[]` entry of a pool some of whose backends are given by host name (those
/// given by address are listed as they are).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedBackend {
    /// As written: `host:port`.
    pub address: String,
    pub host: String,
    pub port: u16,
    pub weight: usize,
    /// What the name resolved to when the config was loaded; `None` when it did not in time.
    pub resolved: Option<SocketAddr>,
}

/// Empty answers in a row (a refresh apart, `min_refresh`) before `on_empty: drain` drains.
pub const EMPTY_TO_DRAIN: u32 = 3;

/// The refresh bounds of re-resolved `backends[]` names.
const NAMES_MIN_REFRESH: Duration = Duration::from_secs(1);
const NAMES_MAX_REFRESH: Duration = Duration::from_secs(30);
const NAMES_TIMEOUT: Duration = Duration::from_secs(2);

/// The resolver a source asks: the given name server (UDP, then TCP for long answers), or
/// the system's configuration. Its own cache is off: each refresh asks, and the answer's TTL
/// says when to ask next.
fn resolver(server: Option<SocketAddr>, timeout: Duration) -> Result<TokioResolver, String> {
    let mut builder = match server {
        Some(addr) => {
            let mut udp = ConnectionConfig::udp();
            udp.port = addr.port();
            let mut tcp = ConnectionConfig::tcp();
            tcp.port = addr.port();
            let ns = NameServerConfig::new(addr.ip(), true, vec![udp, tcp]);
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![ns]),
                TokioRuntimeProvider::default(),
            )
        }
        None => TokioResolver::builder_tokio()
            .map_err(|e| format!("cannot read the system's resolver configuration: {e}"))?,
    };
    let options: &mut ResolverOpts = builder.options_mut();
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    options.cache_size = 0;
    options.attempts = 2;
    options.timeout = timeout / 2;
    builder
        .build()
        .map_err(|e| format!("cannot build the resolver: {e}"))
}

/// One lookup's outcome.
enum Answer {
    /// The addresses, and how long they are valid.
    Records(Vec<IpAddr>, Duration),
    /// The name has no records.
    Empty,
}

async fn lookup(resolver: &TokioResolver, name: &str, bound: Duration) -> Result<Answer, String> {
    match tokio::time::timeout(bound, resolver.lookup_ip(name)).await {
        Err(_) => Err(format!("no answer for {name} within {bound:?}")),
        Ok(Err(e)) if e.is_no_records_found() => Ok(Answer::Empty),
        Ok(Err(e)) => Err(format!("looking up {name}: {e}")),
        Ok(Ok(lookup)) => {
            let mut ips: Vec<IpAddr> = lookup.iter().collect();
            ips.sort();
            ips.dedup();
            let ttl = lookup
                .valid_until()
                .saturating_duration_since(Instant::now());
            if ips.is_empty() {
                Ok(Answer::Empty)
            } else {
                Ok(Answer::Records(ips, ttl))
            }
        }
    }
}

/// Follows `source` for `pool`, for ever (until the service aborts it).
pub async fn follow(pool: Arc<Pool>, source: DnsSource) {
    let resolver = match resolver(source.resolver, source.timeout) {
        Ok(r) => r,
        Err(e) => {
            let mut streak = None;
            report_error(&pool, "dns", &e, &mut streak);
            return;
        }
    };
    let mut streak = None;
    let mut empty_answers = 0u32;
    loop {
        let wait = match lookup(&resolver, &source.name, source.timeout).await {
            Ok(Answer::Records(ips, ttl)) => {
                empty_answers = 0;
                report_recovery(&pool, "dns", &mut streak);
                let wanted: Vec<Wanted> = ips
                    .into_iter()
                    .map(|ip| Wanted::discovered(SocketAddr::new(ip, source.port), true))
                    .collect();
                apply(&pool, "dns", &wanted);
                ttl.clamp(source.min_refresh, source.max_refresh)
            }
            Ok(Answer::Empty) => {
                report_recovery(&pool, "dns", &mut streak);
                empty_answers = empty_answers.saturating_add(1);
                match source.on_empty {
                    OnEmpty::Drain if empty_answers >= EMPTY_TO_DRAIN => {
                        apply(&pool, "dns", &[]);
                    }
                    OnEmpty::Drain => tracing::info!(
                        pool = &*pool.name,
                        "{} has no records ({empty_answers} answers in a row): the pool \
                         drains at {EMPTY_TO_DRAIN}",
                        source.name
                    ),
                    OnEmpty::Keep => tracing::debug!(
                        pool = &*pool.name,
                        "{} has no records; on_empty: keep keeps the pool as it is",
                        source.name
                    ),
                }
                source.min_refresh
            }
            Err(e) => {
                report_error(&pool, "dns", &e, &mut streak);
                source.min_refresh
            }
        };
        tokio::time::sleep(jittered(wait)).await;
    }
}

/// Re-resolves a static pool's host names, for ever: each entry stays one backend (the first
/// address its name resolves to, as at load), and moves when its name does.
pub async fn follow_names(pool: Arc<Pool>, names: Vec<NamedBackend>) {
    let resolver = match resolver(None, NAMES_TIMEOUT) {
        Ok(r) => r,
        Err(e) => {
            let mut streak = None;
            report_error(&pool, "static_dns", &e, &mut streak);
            return;
        }
    };
    let mut current: Vec<Option<SocketAddr>> = names.iter().map(|n| n.resolved).collect();
    let mut streak = None;
    loop {
        let mut shortest = NAMES_MAX_REFRESH;
        let mut failed = None;
        for (named, now) in names.iter().zip(current.iter_mut()) {
            if named.host.parse::<IpAddr>().is_ok() {
                continue;
            }
            match lookup(&resolver, &named.host, NAMES_TIMEOUT).await {
                Ok(Answer::Records(ips, ttl)) => {
                    // Kept while the name still lists it, so an entry does not hop between
                    // the addresses of a round-robin name.
                    if !now.is_some_and(|now| ips.contains(&now.ip())) {
                        if let Some(ip) = ips.first() {
                            *now = Some(SocketAddr::new(*ip, named.port));
                        }
                    }
                    shortest = shortest.min(ttl);
                }
                Ok(Answer::Empty) => failed = Some(format!("{} has no records", named.host)),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => report_error(&pool, "static_dns", &e, &mut streak),
            None => report_recovery(&pool, "static_dns", &mut streak),
        }
        // A name that never resolved is left out until it does.
        let wanted: Vec<Wanted> = names
            .iter()
            .zip(&current)
            .filter_map(|(named, resolved)| {
                Some(Wanted {
                    spec: BackendSpec {
                        address: named.address.clone(),
                        resolved: (*resolved)?,
                        weight: named.weight,
                    },
                    ready: true,
                })
            })
            .collect();
        apply(&pool, "static_dns", &wanted);
        tokio::time::sleep(jittered(
            shortest.clamp(NAMES_MIN_REFRESH, NAMES_MAX_REFRESH),
        ))
        .await;
    }
}
