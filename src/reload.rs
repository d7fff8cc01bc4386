//! `SIGHUP` reloads the config in place, as nginx does: the file is read and checked as
//! `sluice -t` checks it, and a bad one leaves the running config as it is (the log says why).
//! A good one becomes a new generation of the proxy (its pools, plugins, routes, limits,
//! tenants and keys) for every request that begins from then on, on every connection, kept
//! alive ones included; requests already running, streams included, finish on the generation
//! they began on, whose plugins then finish their queued work.
//!
//! At a binary upgrade (`-u`, then `SIGQUIT` to the old process), Pingora's old process
//! still accepts on the listeners it handed over, and serves the connections it keeps alive,
//! for 5 s before it stops: fresh connections met the old and the new key sets in turn, and
//! a key revoked in the file served on. So the old process, once it has handed its listeners
//! over, reloads the file as `SIGHUP` would (both processes then agree), and closes each
//! connection after its current answer (`crate::proxy::HANDED_OVER`). The file is the new process's: it
//! may have been started with another (`sluice -u -c new.yaml`), so it leaves its path beside
//! the upgrade socket ([`upgrade_note`]) for the old process to read.
//!
//! What is bound at start-up stays until an upgrade (`-u`) or a restart, and a reload that
//! changes it says so: the listeners and the admin address (their sockets), the `pingora`
//! section, the connection caps and the in-flight caps.

use crate::config::Config;
use crate::discovery::PoolDiscovery;
use crate::proxy::{Lasting, Sluice};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::{ExecutionPhase, ShutdownWatch};
use pingora_core::services::background::BackgroundService;
use sluice_sdk::calls::PoolCalls;
use sluice_sdk::Pools;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::broadcast;

/// What a reload cannot change, as the running process has it: compared with each new file.
pub struct Frozen {
    listeners: String,
    admin: String,
    server: String,
    caps: String,
    /// The stored responses' notes live as long as the process, in the store it started with;
    /// so do the traces' exporter and sampler.
    responses: String,
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
            responses: format!("{:?} {:?}", config.responses, config.telemetry),
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
            ("responses or telemetry", self.responses != new.responses),
        ]
        .into_iter()
        .filter_map(|(name, changed)| changed.then_some(name))
        .collect()
    }
}

/// The background service that waits for `SIGHUP`.
pub struct Reload {
    pub source: PathBuf,
    /// Where a new process of an upgrade leaves the path of its config file.
    pub upgrade_note: PathBuf,
    pub current: Arc<ArcSwap<Sluice>>,
    pub lasting: Lasting,
    pub frozen: Frozen,
    /// The health checks follow the pools of the current generation.
    pub pools_now: tokio::sync::watch::Sender<Arc<Pools>>,
    /// Discovery follows the sources of the current generation.
    pub discovery_now: tokio::sync::watch::Sender<Arc<Vec<PoolDiscovery>>>,
    /// Pingora's execution phases (subscribed at build, so none is missed; taken by `start`,
    /// after a daemon's fork).
    pub phases: Mutex<Option<broadcast::Receiver<ExecutionPhase>>>,
}

/// The next phase; never, once the channel is closed.
async fn next_phase(
    phases: &mut Option<broadcast::Receiver<ExecutionPhase>>,
) -> Option<ExecutionPhase> {
    loop {
        let Some(receiver) = phases.as_mut() else {
            return std::future::pending().await;
        };
        match receiver.recv().await {
            Ok(phase) => return Some(phase),
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => *phases = None,
        }
    }
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
        let mut phases = self.phases.lock().ok().and_then(|mut p| p.take());
        loop {
            tokio::select! {
                _ = hangups.recv() => self.reload().await,
                phase = next_phase(&mut phases) => {
                    if matches!(phase, Some(ExecutionPhase::GracefulUpgradeTransferringFds)) {
                        crate::proxy::HANDED_OVER.store(true, Relaxed);
                        let source = read_upgrade_note(&self.upgrade_note)
                            .unwrap_or_else(|| self.source.clone());
                        tracing::info!(
                            "listeners handed to the new process: its config ({}) is read, and connections close after their answer",
                            source.display()
                        );
                        self.reload_from(&source).await;
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// The file beside the upgrade socket where a new process of an upgrade leaves its config's
/// path (the run directory is this user's alone: see `run_dir`).
pub fn upgrade_note(upgrade_sock: &str) -> PathBuf {
    PathBuf::from(format!("{upgrade_sock}.config"))
}

/// Leaves `config`'s absolute path in `note`, for the old process.
pub fn leave_upgrade_note(note: &std::path::Path, config: &std::path::Path) -> Result<(), String> {
    let path = std::path::absolute(config).map_err(|e| format!("{}: {e}", config.display()))?;
    std::fs::write(note, path.as_os_str().as_encoded_bytes())
        .map_err(|e| format!("cannot write {}: {e}", note.display()))
}

/// The new process's config path, taken from `note` (which goes with it).
fn read_upgrade_note(note: &std::path::Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    let bytes = std::fs::read(note).ok()?;
    let _ = std::fs::remove_file(note);
    (!bytes.is_empty()).then(|| PathBuf::from(std::ffi::OsString::from_vec(bytes)))
}

impl Reload {
    async fn reload(&self) {
        self.reload_from(&self.source).await;
    }

    async fn reload_from(&self, source: &std::path::Path) {
        // Loading blocks (files, tokenizers, backends' host names): on a thread for it, not
        // on this runtime's.
        let path = source.to_path_buf();
        let calls: Arc<dyn PoolCalls> = Arc::new(crate::proxy::CoreCalls);
        let loaded = tokio::task::spawn_blocking(move || Config::load(&path, &calls))
            .await
            .map_err(|e| format!("the load did not finish: {e}"));
        let mut config = match loaded.and_then(|r| r.map_err(|e| e.to_string())) {
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
        let next = Sluice::new(config, &self.lasting);
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
            source.display()
        );
    }
}
