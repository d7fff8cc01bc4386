//! # vllm-sim: a simulated vLLM OpenAI-compatible server
//!
//! Byte-level vLLM wire shapes (chat/completions JSON and SSE, both error shapes, V0/V1
//! `/metrics`), deterministic text, a latency model, a KV-cache/queue model and run-time fault
//! injection. Used as the `vllm-sim` binary and in-process from tests.
//!
//! ## In-process API
//! ```ignore
//! pub async fn start(config: SimConfig) -> std::io::Result<Sim>;   // binds, spawns, returns
//! impl Sim {                                                      // cheap Clone (Arc inside)
//!     pub fn addr(&self) -> SocketAddr;
//!     pub fn url(&self) -> String;                                // "http://127.0.0.1:PORT"
//!     pub fn config(&self) -> &SimConfig;
//!     pub fn set_faults(&self, faults: Faults);
//!     pub fn faults(&self) -> Faults;
//!     pub fn stats(&self) -> Stats;                               // counters + last N requests
//!     pub fn kv_usage(&self) -> f64;
//!     pub fn engine_state(&self) -> EngineSnapshot;               // running, waiting, blocks
//!     pub fn metrics_text(&self) -> String;                       // what GET /metrics returns
//!     pub async fn serve_admin(&self, addr: SocketAddr) -> io::Result<SocketAddr>;
//!     pub fn shutdown(&self);                                     // closes listener + connections
//! }
//! SimConfig::default()                    // = SimConfig::profile(Profile::Zero)
//! SimConfig::profile(Profile::Draft).with_model("x").with_oom(true)...
//! ```
//! HTTP control: `GET|POST /sim/faults` (JSON `Faults`), `GET /sim/stats`.

mod config;
mod engine;
mod faults;
mod handlers;
mod metrics;
mod openai;
mod server;
mod stats;
pub mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

pub use config::{ErrorShape, Latency, MetricsFlavor, Profile, SimConfig, SpecDecode};
pub use engine::EngineSnapshot;
pub use faults::Faults;
pub use stats::{RecordedRequest, Stats};
pub use text::{CONFIDENT_LOGPROB, LOW_CONFIDENCE_LOGPROB};

use engine::Engine;
use metrics::Metrics;
use stats::Recorder;

/// State shared by the accept loop, connections and handlers.
pub(crate) struct Shared {
    cfg: SimConfig,
    served: Vec<String>,
    faults: RwLock<Arc<Faults>>,
    fault_counter: AtomicU64,
    engine: Arc<Engine>,
    metrics: Metrics,
    stats: Recorder,
    refuse_tx: watch::Sender<bool>,
    shutdown_tx: watch::Sender<bool>,
    /// Bumped to make every open connection close (refuse-connections, shutdown).
    kill_tx: watch::Sender<u64>,
    addr: SocketAddr,
    ids: AtomicU64,
    nonce: u64,
    started: u64,
}

impl Shared {
    fn model_name(&self) -> &str {
        self.served
            .first()
            .map(String::as_str)
            .unwrap_or(self.cfg.model.as_str())
    }

    fn faults(&self) -> Arc<Faults> {
        Arc::clone(&self.faults.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn set_faults(&self, f: Faults) {
        let refuse = f.refuse_connections;
        *self.faults.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(f);
        self.fault_counter.store(0, Ordering::Relaxed);
        let was = *self.refuse_tx.borrow();
        if refuse != was {
            self.refuse_tx.send_replace(refuse);
            if refuse {
                // A stopped server also drops the connections it had.
                self.kill_tx.send_modify(|g| *g += 1);
            }
        }
    }

    fn next_id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        let a = text::mix(self.nonce ^ n);
        let b = text::mix(a ^ n.rotate_left(17));
        format!("{prefix}{a:016x}{b:016x}")
    }

    fn stats(&self) -> Stats {
        let mut s = self.stats.snapshot();
        let e = self.engine.snapshot();
        s.oom = self.metrics.oom.load(Ordering::Relaxed);
        s.running = e.running;
        s.waiting = e.waiting;
        s.kv_usage = e.kv_usage();
        s
    }

    /// Resolves when the instance shuts down; hangs use it so they end with the instance.
    async fn shutdown_signal(&self) {
        let mut rx = self.shutdown_tx.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }

    fn metrics_text(&self) -> String {
        self.metrics.render(&self.engine.snapshot())
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A running simulated vLLM instance. Clones share the instance.
#[derive(Clone)]
pub struct Sim {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("addr", &self.shared.addr)
            .field("model", &self.shared.model_name())
            .finish()
    }
}

/// Bind `config.listen` and serve on the current tokio runtime. Returns once listening.
pub async fn start(config: SimConfig) -> std::io::Result<Sim> {
    let listener = server::bind(config.listen)?;
    let addr = listener.local_addr()?;
    let served = config.served_names();
    let model_name = served
        .first()
        .cloned()
        .unwrap_or_else(|| config.model.clone());
    let shared = Arc::new(Shared {
        engine: Engine::new(
            config.num_gpu_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_waiting,
            config.oom_on_overload,
        ),
        metrics: Metrics::new(
            config.metrics,
            model_name,
            config.block_size,
            config.num_gpu_blocks,
            config.speculative.clone(),
        ),
        stats: Recorder::new(config.record_requests),
        faults: RwLock::new(Arc::new(Faults::default())),
        fault_counter: AtomicU64::new(0),
        refuse_tx: watch::channel(false).0,
        shutdown_tx: watch::channel(false).0,
        kill_tx: watch::channel(0).0,
        addr,
        ids: AtomicU64::new(0),
        nonce: rand::random(),
        started: unix_now(),
        served,
        cfg: config.clone(),
    });
    shared.set_faults(config.faults.clone());
    let listener = if config.faults.refuse_connections {
        None
    } else {
        Some(listener)
    };
    tokio::spawn(server::accept_loop(Arc::clone(&shared), listener, false));
    tracing::info!(%addr, model = shared.model_name(), "vllm-sim listening");
    Ok(Sim { shared })
}

impl Sim {
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }
    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }
    /// The model name reported in answers (first served name).
    pub fn model(&self) -> &str {
        self.shared.model_name()
    }
    /// Replace every fault switch (and restart the error-rate counter).
    pub fn set_faults(&self, faults: Faults) {
        self.shared.set_faults(faults);
    }
    pub fn faults(&self) -> Faults {
        (*self.shared.faults()).clone()
    }
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }
    pub fn kv_usage(&self) -> f64 {
        self.shared.engine.snapshot().kv_usage()
    }
    pub fn engine_state(&self) -> EngineSnapshot {
        self.shared.engine.snapshot()
    }
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }
    /// Serve only `/sim/*` and `/metrics` on a second address; it keeps answering while the
    /// main port refuses connections. Returns the bound address.
    pub async fn serve_admin(&self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        let listener = server::bind(addr)?;
        let bound = listener.local_addr()?;
        tokio::spawn(server::accept_loop(
            Arc::clone(&self.shared),
            Some(listener),
            true,
        ));
        Ok(bound)
    }
    /// Stop listening and close every connection. Idempotent.
    pub fn shutdown(&self) {
        self.shared.shutdown_tx.send_replace(true);
        self.shared.kill_tx.send_modify(|g| *g += 1);
    }
}
