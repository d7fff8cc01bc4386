//! One generation of the running config, as the request path sees it: the pools, the
//! router, the plugin chain and the limits, with what every generation shares (the in-flight
//! caps, the upstream connections). A request holds the generation it began on to its end
//! (`crate::reload`).

use super::attempt;
use crate::caps::Caps;
use crate::chain::Chain;
use crate::config::{Config, Limits};
use crate::router::Router;
use bytes::Bytes;
use pingora_core::connectors::http::v1::Connector;
use sluice_sdk::{MemoryBudget, Pools};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Everything the proxy needs at run time, built once from config.
pub struct Sluice {
    pub limits: Limits,
    /// Requests in flight, per client and in total.
    pub requests: Arc<Caps>,
    /// Turns `true` when the server's grace period is ending: running streams end then.
    pub streams_end: tokio::sync::watch::Receiver<bool>,
    /// Bytes held in memory for requests (bodies, held answers).
    pub memory: Arc<MemoryBudget>,
    pub pools: Arc<Pools>,
    /// The `/v1/models` answer, built once per generation.
    pub models: Bytes,
    pub router: Router,
    pub chain: Chain,
    /// What makes the LLM attempts' connections to backends: HTTP/1.1, as vLLM serves.
    /// Shared by every generation.
    pub connector: Arc<Connector>,
    /// The LLM attempts' idle connections. Shared by every generation.
    pub upstream_pool: Arc<super::upstream_pool::UpstreamPool>,
    /// Small `GET`s to backends (see [`Lasting::probes`]). Shared by every generation.
    pub probes: Arc<pingora_core::connectors::http::v1::Connector>,
    /// Which backend made each stored response (Responses API). Shared by every generation.
    pub response_homes: Arc<super::stored_responses::ResponseHomes>,
    /// The pools' sessions shared with the fleet in Redis (`sessions.store: redis`).
    pub shared_sessions: Option<super::shared_sessions::SharedSessions>,
    /// A newer generation replaced this one (`SIGHUP`): its plugins finish their queued work
    /// once its last request has ended.
    pub retired: std::sync::atomic::AtomicBool,
}

/// The most a retired generation's plugins get to finish their queued work.
const RETIRED_FLUSH_WITHIN: Duration = Duration::from_secs(2);

impl Drop for Sluice {
    fn drop(&mut self) {
        if !self.retired.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let plugins = self.chain.plugins();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for plugin in plugins {
                    plugin.stop(RETIRED_FLUSH_WITHIN).await;
                }
            });
        }
    }
}

impl Sluice {
    /// What an upstream attempt uses of this generation (see [`attempt::Upstreams`]).
    pub(super) fn upstreams(&self) -> attempt::Upstreams<'_> {
        attempt::Upstreams {
            connector: &self.connector,
            pool: &self.upstream_pool,
            memory: &self.memory,
            streams_end: &self.streams_end,
            chain: &self.chain,
        }
    }
}

/// This process has handed its listeners to a new one (a binary upgrade): no connection is
/// kept alive past its current answer, so that the next request goes to the new process.
pub static HANDED_OVER: AtomicBool = AtomicBool::new(false);

/// What every generation shares.
pub struct Lasting {
    /// Requests in flight, per client and in total.
    pub requests: Arc<Caps>,
    /// Turns `true` when the server's grace period is ending.
    pub streams_end: tokio::sync::watch::Receiver<bool>,
    /// The upstream connections' maker.
    pub connector: Arc<Connector>,
    /// What the health checks and other small `GET`s to backends (a Mooncake prefill
    /// engine's bootstrap server) connect with.
    pub probes: Arc<pingora_core::connectors::http::v1::Connector>,
    /// The LLM attempts' idle upstream connections.
    pub upstream_pool: Arc<super::upstream_pool::UpstreamPool>,
    /// Which backend made each stored response.
    pub response_homes: Arc<super::stored_responses::ResponseHomes>,
}

impl Sluice {
    /// What a config makes of the proxy, for new requests: its pools (live state, health),
    /// its plugin chain started, its routes and limits; `lasting` is what every generation
    /// shares.
    pub fn new(config: Config, lasting: &Lasting) -> Sluice {
        let pools = config.pools;
        let chain = Chain::start(
            config.plugins,
            crate::observers::enabled(config.log.access_log),
        );
        let names = chain.names();
        tracing::info!(
            "plugin chain: [{}]{}",
            names.join(" → "),
            if names.is_empty() {
                " (no plugins)"
            } else {
                ""
            }
        );
        for pool in pools.iter() {
            let members = pool.members();
            let backends: Vec<_> = members.iter().map(|e| e.spec.address.as_str()).collect();
            tracing::info!(pool = &*pool.name, models = ?pool.models(), backends = ?backends, source = %pool.settings.source, "pool");
        }
        crate::metrics::init(&pools);
        Sluice {
            requests: lasting.requests.clone(),
            streams_end: lasting.streams_end.clone(),
            memory: config.memory,
            limits: config.limits,
            models: crate::models::list(&pools),
            pools,
            router: Router::new(config.routes),
            chain,
            connector: Arc::clone(&lasting.connector),
            upstream_pool: Arc::clone(&lasting.upstream_pool),
            probes: Arc::clone(&lasting.probes),
            response_homes: Arc::clone(&lasting.response_homes),
            shared_sessions: config
                .shared_sessions
                .as_ref()
                .map(super::shared_sessions::SharedSessions::new),
            retired: std::sync::atomic::AtomicBool::new(false),
        }
    }
}
