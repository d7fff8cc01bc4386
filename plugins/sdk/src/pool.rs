//! Upstream pools as plugins see them: named sets of backends serving some models.
//!
//! A pool is built once from config and shared (`Arc<Pool>`). Choosing a backend is lock-free:
//! Pingora's weighted round robin over an immutable selector.

use pingora_core::upstreams::peer::HttpPeer;
use pingora_load_balancing::{discovery, selection::RoundRobin, Backend, Backends, LoadBalancer};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Timeouts of one pool's upstream requests.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeouts {
    /// TCP (and TLS) connect.
    pub connect: Duration,
    /// From the request being sent to the response header, and the longest silence allowed
    /// between two chunks of a response.
    pub first_byte: Duration,
    /// The whole exchange, unless sized from `max_tokens` (below).
    pub total: Duration,
    /// How long an idle upstream connection is kept for reuse.
    pub keepalive_idle: Duration,
    /// When set, the total timeout of a request that states `max_tokens` is
    /// `first_byte + max_tokens / min_tokens_per_second + margin`, capped by `total`.
    pub sized_by_max_tokens: Option<TokensPerSecond>,
}

/// The slowest generation a pool is trusted to sustain, and the slack added to it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokensPerSecond {
    pub min_tokens_per_second: f64,
    pub margin: Duration,
}

impl Timeouts {
    /// The total timeout of a request that may generate `max_tokens` tokens.
    pub fn total_for(&self, max_tokens: Option<u32>) -> Duration {
        match (&self.sized_by_max_tokens, max_tokens) {
            (Some(rate), Some(tokens)) if rate.min_tokens_per_second > 0.0 => {
                let generation =
                    Duration::from_secs_f64(f64::from(tokens) / rate.min_tokens_per_second);
                (self.first_byte + generation + rate.margin).min(self.total)
            }
            _ => self.total,
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(2),
            first_byte: Duration::from_secs(60),
            total: Duration::from_secs(600),
            keepalive_idle: Duration::from_secs(60),
            sized_by_max_tokens: None,
        }
    }
}

/// One backend as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// As written in the config (`host:port`), for logs and `/status`.
    pub address: String,
    pub resolved: SocketAddr,
    pub weight: usize,
}

/// A named pool of backends.
pub struct Pool {
    pub name: Arc<str>,
    /// The model names this pool serves (the `model` field of requests).
    pub models: Vec<String>,
    /// The longest context (prompt + output tokens) its model accepts, if known.
    pub max_model_len: Option<u32>,
    pub timeouts: Timeouts,
    pub backends: Vec<BackendSpec>,
    /// Use TLS to the backends, with this SNI.
    pub tls_sni: Option<String>,
    balancer: LoadBalancer<RoundRobin>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("models", &self.models)
            .field("backends", &self.backends)
            .finish_non_exhaustive()
    }
}

impl Pool {
    pub fn new(
        name: &str,
        models: Vec<String>,
        max_model_len: Option<u32>,
        timeouts: Timeouts,
        backends: Vec<BackendSpec>,
        tls_sni: Option<String>,
    ) -> Self {
        let set: BTreeSet<Backend> = backends
            .iter()
            .map(|b| Backend {
                addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(b.resolved),
                weight: b.weight,
                ext: Default::default(),
            })
            .collect();
        let balancer = LoadBalancer::from_backends(Backends::new(discovery::Static::new(set)));
        // A static discovery answers at once; polling the future once builds the selector.
        let _ = futures_lite_poll(balancer.update());
        Self {
            name: Arc::from(name),
            models,
            max_model_len,
            timeouts,
            backends,
            tls_sni,
            balancer,
        }
    }

    /// Whether the pool serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }

    /// The next backend in weighted round-robin order that is not in `tried`.
    pub fn select(&self, tried: &[SocketAddr]) -> Option<SocketAddr> {
        let iterations = self.backends.len().max(1) * 4;
        self.balancer
            .select_with(b"", iterations, |backend, healthy| {
                healthy && backend.addr.as_inet().is_some_and(|a| !tried.contains(a))
            })
            .and_then(|b| b.addr.as_inet().copied())
    }

    /// The Pingora peer for `backend`, with this pool's timeouts.
    pub fn peer(&self, backend: SocketAddr) -> HttpPeer {
        let mut peer = HttpPeer::new(
            backend,
            self.tls_sni.is_some(),
            self.tls_sni.clone().unwrap_or_default(),
        );
        let o = &mut peer.options;
        o.connection_timeout = Some(self.timeouts.connect);
        o.total_connection_timeout = Some(self.timeouts.connect);
        o.read_timeout = Some(self.timeouts.first_byte);
        o.write_timeout = Some(self.timeouts.first_byte);
        o.idle_timeout = Some(self.timeouts.keepalive_idle);
        peer
    }
}

/// Polls a future that is known to be ready at once (static discovery), without a runtime.
fn futures_lite_poll<F: std::future::Future>(fut: F) -> Option<F::Output> {
    use std::task::{Context, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// All pools, in config order, with the model → pool map the router uses.
#[derive(Debug, Default)]
pub struct Pools {
    pools: Vec<Arc<Pool>>,
}

impl Pools {
    pub fn new(pools: Vec<Arc<Pool>>) -> Self {
        Self { pools }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.pools.iter()
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| &*p.name == name)
    }

    /// The first pool (in config order) that serves `model`.
    pub fn for_model(&self, model: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| p.serves(model))
    }

    /// The pool for requests that name no model: the first one.
    pub fn default_pool(&self) -> Option<&Arc<Pool>> {
        self.pools.first()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(port: u16, weight: usize) -> BackendSpec {
        let resolved: SocketAddr = ([127, 0, 0, 1], port).into();
        BackendSpec {
            address: resolved.to_string(),
            resolved,
            weight,
        }
    }

    #[test]
    fn round_robin_respects_weights_and_exclusions() {
        let pool = Pool::new(
            "p",
            vec!["m".into()],
            None,
            Timeouts::default(),
            vec![spec(1, 1), spec(2, 3)],
            None,
        );
        let picks: Vec<u16> = (0..8).map(|_| pool.select(&[]).unwrap().port()).collect();
        assert_eq!(picks.iter().filter(|p| **p == 2).count(), 6, "{picks:?}");
        let only_other = pool.select(&[spec(2, 3).resolved]).unwrap();
        assert_eq!(only_other.port(), 1);
        assert_eq!(
            pool.select(&[spec(1, 1).resolved, spec(2, 3).resolved]),
            None
        );
    }

    #[test]
    fn total_timeout_is_sized_by_max_tokens_and_capped() {
        let t = Timeouts {
            first_byte: Duration::from_secs(10),
            total: Duration::from_secs(100),
            sized_by_max_tokens: Some(TokensPerSecond {
                min_tokens_per_second: 10.0,
                margin: Duration::from_secs(5),
            }),
            ..Timeouts::default()
        };
        assert_eq!(t.total_for(Some(200)), Duration::from_secs(35));
        assert_eq!(t.total_for(Some(100_000)), Duration::from_secs(100));
        assert_eq!(t.total_for(None), Duration::from_secs(100));
    }
}
