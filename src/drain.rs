//! Stopping when the work is done, not when a timer says so.
//!
//! On `SIGTERM`, or when a new process takes the listeners over (`-u`, then `SIGQUIT`),
//! Pingora stops accepting and then waits out the whole `grace_period_seconds` before it
//! stops its runtimes, however little is running: an idle proxy took the full period to exit
//! (30 s by default; nginx quits at once). A watcher beside the server follows Pingora's
//! execution phases, and once the grace period has begun:
//!
//! - as soon as no request is in flight, it lets the plugins finish what they queued (the
//!   cache's Redis writes), for a bounded time, and exits;
//! - shortly before the grace period ends, it tells the running streams, which end with an
//!   SSE error event and `[DONE]` (a clean end the client can tell from a cut), rather than
//!   being cut when Pingora stops its runtimes.
//!
//! A plain thread, not a task: it must keep watching while the runtimes are stopping. It is
//! started by a background service, so after Pingora has daemonized (`-d` forks): a thread
//! waiting on the phase channel across a fork leaves the child a waiter that does not exist,
//! and the child panicked on the first phase sent.

use crate::caps::Caps;
use crate::proxy::Sluice;
use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::{ExecutionPhase, Server, ShutdownWatch};
use pingora_core::services::background::BackgroundService;
use sluice_sdk::Plugin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, watch};

/// How long before the grace period's end the running streams are ended.
const END_STREAMS_BEFORE: Duration = Duration::from_secs(1);

/// How often the watcher looks at what is in flight.
const POLL: Duration = Duration::from_millis(25);

/// The most the plugins get to finish their queued work once nothing is in flight.
const FLUSH_WITHIN: Duration = Duration::from_secs(2);

/// Prepares the watcher for `server`: subscribes to its phases now (so none is missed) and
/// returns the background service that starts the watching thread once the server runs.
/// `grace_over` is set when running streams are to end (each attempt watches it); the
/// plugins finished at the end are the current generation's (`current`).
pub fn watch(
    server: &Server,
    requests: Arc<Caps>,
    current: Arc<ArcSwap<Sluice>>,
    grace: Duration,
    grace_over: watch::Sender<bool>,
) -> DrainService {
    let phases = server.watch_execution_phase();
    let start: Box<dyn FnOnce() + Send> =
        Box::new(move || spawn(phases, requests, current, grace, grace_over));
    DrainService {
        start: Mutex::new(Some(start)),
    }
}

/// Starts the watching thread when the server's services start, after any fork.
pub struct DrainService {
    start: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

#[async_trait]
impl BackgroundService for DrainService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let start = match self.start.lock() {
            Ok(mut start) => start.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(start) = start {
            start();
        }
        let _ = shutdown.changed().await;
    }
}

fn spawn(
    phases: broadcast::Receiver<ExecutionPhase>,
    requests: Arc<Caps>,
    current: Arc<ArcSwap<Sluice>>,
    grace: Duration,
    grace_over: watch::Sender<bool>,
) {
    let spawned = std::thread::Builder::new()
        .name("sluice drain".into())
        .spawn(move || run(phases, requests, current, grace, grace_over));
    if let Err(e) = spawned {
        tracing::error!("cannot start the drain watcher, stops will take the grace period: {e}");
    }
}

fn run(
    mut phases: broadcast::Receiver<ExecutionPhase>,
    requests: Arc<Caps>,
    current: Arc<ArcSwap<Sluice>>,
    grace: Duration,
    grace_over: watch::Sender<bool>,
) {
    loop {
        match phases.blocking_recv() {
            Ok(ExecutionPhase::ShutdownGracePeriod) => break,
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
    let started = Instant::now();
    // The stored responses' notes, for the process that takes over (or the next start);
    // written again at the exit, with the notes the running requests add.
    current.load().response_homes.hand_over();
    let end_streams_at = grace.saturating_sub(END_STREAMS_BEFORE);
    loop {
        if requests.total() == 0 {
            tracing::info!(
                "nothing in flight {:?} into the grace period: stopping now",
                started.elapsed()
            );
            current.load().response_homes.hand_over();
            finish(&current.load().chain.plugins());
            crate::telemetry::stop(FLUSH_WITHIN);
            std::process::exit(0);
        }
        if started.elapsed() >= end_streams_at && !*grace_over.borrow() {
            tracing::info!(
                in_flight = requests.total(),
                "the grace period ends: ending the running streams"
            );
            let _ = grace_over.send(true);
        }
        std::thread::sleep(POLL);
    }
}

/// Gives every plugin a bounded chance to finish its queued work.
fn finish(plugins: &[Arc<dyn Plugin>]) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let deadline = Instant::now() + FLUSH_WITHIN;
    runtime.block_on(async {
        for plugin in plugins {
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, plugin.stop(left)).await;
        }
    });
}
