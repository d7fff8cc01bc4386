//! `SIGHUP` reloads the config in place, as nginx does: the file is read and checked as
//! `sluice -t` checks it, and a bad one leaves the running config as it is (the log says why).
//! A good one becomes a new generation of the proxy (its pools, plugins, routes, limits,
//! tenants and keys) for every request that begins from then on, on every connection, kept
//! alive ones included; requests already running, streams included, finish on the generation
//! they began on, whose plugins then finish their queued work.
//!
//! What is bound at start-up stays until an upgrade (`-u`) or a restart, and a reload that
//! changes it says so: the listeners and the admin address (their sockets), the `pingora`
//! section, the connection caps and the in-flight caps.

use crate::caps::Caps;
use crate::config::Config;
use crate::discovery::PoolDiscovery;
use crate::proxy::Sluice;
use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::connectors::http::v1::Connector;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use sluice_sdk::Pools;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::signal::unix::{signal, SignalKind};

/// What every generation shares.
pub struct Lasting {
    /// Requests in flight, per client and in total.
    pub requests: Arc<Caps>,
    /// Turns `true` when the server's grace period is ending.
    pub streams_end: tokio::sync::watch::Receiver<bool>,
    /// The upstream connections, pooled.
    pub connector: Arc<Connector>,
}

/// What a reload cannot change, as the running process has it: compared with each new file.
pub struct Frozen {
    listeners: String,
    admin: String,
    server: String,
    caps: String,
}

impl Frozen {
    pub fn of(config: &Config) -> Self {
        let limits = &config.limits;
        Self {
            listeners: format!("{:?}", config.listeners),
            admin: format!("{:?} {:?}", config.admin, config.admin_hosts),
            server: format!("{:?}", config.server),
            caps: format!(
                "{:?} {} {}",
                limits.connections,
                limits.max_requests_in_flight,
                limits.max_requests_in_flight_per_client
            ),
        }
    }

    /// The parts of `config` that differ from what is bound, by name.
    fn changed_in(&self, config: &Config) -> Vec<&'static str> {
        let new = Frozen::of(config);
        [
            ("listeners", self.listeners != new.listeners),
            ("admin", self.admin != new.admin),
            ("pingora", self.server != new.server),
            (
                "limits' connection and in-flight caps",
                self.caps != new.caps,
            ),
        ]
        .into_iter()
        .filter_map(|(name, changed)| changed.then_some(name))
        .collect()
    }
}

/// The background service that waits for `SIGHUP`.
pub struct Reload {
    pub source: PathBuf,
    pub current: Arc<ArcSwap<Sluice>>,
    pub lasting: Lasting,
    pub frozen: Frozen,
    /// The health checks follow the pools of the current generation.
    pub pools_now: tokio::sync::watch::Sender<Arc<Pools>>,
    /// Discovery follows the sources of the current generation.
    pub discovery_now: tokio::sync::watch::Sender<Arc<Vec<PoolDiscovery>>>,
}

#[async_trait]
impl BackgroundService for Reload {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        // Installed at once: from here on `SIGHUP` no longer ends the process.
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(e) => {
                tracing::error!("cannot listen for SIGHUP, reloads are off: {e}");
                return;
            }
        };
        loop {
            tokio::select! {
                _ = hangups.recv() => self.reload(),
                _ = shutdown.changed() => return,
            }
        }
    }
}

impl Reload {
    fn reload(&self) {
        let mut config = match Config::load(&self.source) {
            Ok(config) => config,
            Err(e) => {
                tracing::error!("config reload refused, the running config stays: {e}");
                crate::metrics::reload(false);
                return;
            }
        };
        let kept = self.frozen.changed_in(&config);
        if !kept.is_empty() {
            tracing::warn!(
                "config reload: {} changed, and take effect only at an upgrade (-u) or restart",
                kept.join(", ")
            );
        }
        let discovery = Arc::new(std::mem::take(&mut config.discovery));
        let next = crate::server::generation(config, &self.lasting);
        let pools = Arc::clone(&next.pools);
        // A pool that stays keeps what is known of its backends (and a discovered pool its
        // backends): a reload must not make the fleet unknown, or empty, for a moment.
        let running = self.current.load();
        for pool in pools.iter() {
            if let Some(old) = running.pools.get(&pool.name) {
                pool.inherit(old);
            }
        }
        drop(running);
        let previous = self.current.swap(Arc::new(next));
        previous.retired.store(true, Relaxed);
        self.pools_now.send_replace(pools);
        self.discovery_now.send_replace(discovery);
        crate::metrics::reload(true);
        tracing::info!(
            "config reloaded from {}: new requests use it; running ones finish on the old",
            self.source.display()
        );
    }
}
