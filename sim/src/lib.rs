//! # vllm-sim: a simulated vLLM OpenAI-compatible server
//!
//! It speaks vLLM 0.32's wire format by default (chat and text completions as JSON and SSE,
//! errors, V1 `/metrics`; `ErrorShape::New`/`Old` and `MetricsFlavor::V0` give older
//! generations'), generates deterministic text, models latency, the KV cache and the request
//! queue, and injects faults at run time. Sluice's tests, demo and
//! benchmarks run it in process; the `vllm-sim` binary serves the same thing on a port.
//!
//! [`start`] binds an instance described by a [`SimConfig`] and returns a [`Sim`] handle. The
//! handle switches [`Faults`] ([`Sim::set_faults`]), adds phantom KV pressure
//! ([`Sim::set_phantom_kv`]), shows what reached the instance ([`Sim::stats`]) and the state of
//! its engine ([`Sim::engine_state`]). The same controls are served over HTTP under `/sim/`;
//! `README.md` describes them and the wire details.
//!
//! ```
//! use vllm_sim::{Faults, Profile, SimConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Builder::new_current_thread()
//!     .enable_all()
//!     .build()?;
//! runtime.block_on(async {
//!     let sim = vllm_sim::start(SimConfig::profile(Profile::Zero).with_model("small")).await?;
//!     assert!(sim.url().starts_with("http://127.0.0.1:"));
//!     // From now on every second completion request is answered with a 503.
//!     sim.set_faults(Faults::error_rate(0.5, 503));
//!     assert_eq!(sim.stats().requests_total, 0);
//!     // Nine tenths of the KV cache taken by something else: a nearly full GPU.
//!     sim.set_phantom_kv(0.9);
//!     assert!(sim.kv_usage() >= 0.9);
//!     assert!(sim.metrics_text().contains("vllm:kv_cache_usage_perc"));
//!     sim.shutdown();
//!     Ok(())
//! })
//! # }
//! ```

mod config;
mod control;
mod engine;
mod faults;
mod handlers;
mod kv_events;
mod kv_transfer;
mod lora;
mod metrics;
mod openai;
mod prefill;
mod prefix_cache;
mod responses;
mod server;
mod stats;
pub mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

pub use config::{
    ErrorShape, KvEventsConfig, Latency, LoraConfig, LoraModule, MetricsFlavor, Profile, SimConfig,
    SpecDecode,
};
pub use engine::EngineSnapshot;
pub use faults::Faults;
pub use kv_transfer::{
    Connector as KvConnector, KvTransferConfig, KvTransferJson, LoadFailurePolicy,
};
pub use prefix_cache::KvEvent;
pub use stats::{RecordedRequest, Stats};
pub use text::{CONFIDENT_LOGPROB, LOW_CONFIDENCE_LOGPROB};

use engine::Engine;
use metrics::Metrics;
use stats::Recorder;

/// State shared by the accept loop, connections and handlers.
pub(crate) struct Shared {
    config: SimConfig,
    served_names: Vec<String>,
    faults: RwLock<Arc<Faults>>,
    /// Completion requests since the faults were last set, for the counter-mode error rate.
    fault_counter: AtomicU64,
    engine: Arc<Engine>,
    metrics: Metrics,
    stats: Recorder,
    refuse_tx: watch::Sender<bool>,
    shutdown_tx: watch::Sender<bool>,
    /// Bumped to make every open connection close (refuse-connections, shutdown).
    kill_tx: watch::Sender<u64>,
    addr: SocketAddr,
    id_counter: AtomicU64,
    /// Random per instance, so two instances never hand out the same ids.
    nonce: u64,
    started: u64,
    /// Held through each prefill when `serial_prefill` is on.
    prefill_turn: tokio::sync::Mutex<()>,
    /// Chunked prefill's step loop, when `max_num_batched_tokens` is set.
    prefill_queue: Option<Arc<prefill::PrefillQueue>>,
    /// The prefix cache, when `prefix_caching` is on.
    prefix_cache: Option<prefix_cache::PrefixCache>,
    /// The tokenizer folder, loaded.
    tokenizer: Option<sluice_tokenizer::PromptTokenizer>,
    /// Where the KV events are published (`GET /kv_event_sources`).
    kv_events: Option<kv_events::Endpoints>,
    /// The LoRA adapters, with `--enable-lora`.
    lora: Option<lora::Adapters>,
    /// Disaggregated prefill's leases and side channel, with `--kv-transfer-config`.
    kv_transfer: Option<Arc<kv_transfer::KvTransfer>>,
    /// The Responses API's responses, with `responses_store`.
    responses: Option<handlers::responses_api::Store>,
}

impl Shared {
    fn model_name(&self) -> &str {
        self.served_names
            .first()
            .map(String::as_str)
            .unwrap_or(self.config.model.as_str())
    }

    fn faults(&self) -> Arc<Faults> {
        // A poisoned lock only means a panic elsewhere; the switches are still valid.
        Arc::clone(
            &self
                .faults
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    fn set_faults(&self, faults: Faults) {
        let refuse = faults.refuse_connections;
        *self
            .faults
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(faults);
        self.fault_counter.store(0, Ordering::Relaxed);
        let was_refusing = *self.refuse_tx.borrow();
        if refuse != was_refusing {
            self.refuse_tx.send_replace(refuse);
            if refuse {
                // A stopped server also drops the connections it had.
                self.kill_tx.send_modify(|generation| *generation += 1);
            }
        }
    }

    /// A vLLM-looking id, unique per instance: `prefix` + 16 hex digits as vLLM 0.32 makes
    /// them, 32 before.
    fn next_id(&self, prefix: &str) -> String {
        let count = self.id_counter.fetch_add(1, Ordering::Relaxed);
        let high = text::mix(self.nonce ^ count);
        if self.config.error_shape.is_v0_32() {
            return format!("{prefix}{high:016x}");
        }
        let low = text::mix(high ^ count.rotate_left(17));
        format!("{prefix}{high:016x}{low:016x}")
    }

    /// vLLM 0.32's `system_fingerprint`: the version and a hash of the instance's model and
    /// context, so it stays the same for the life of a configuration.
    fn system_fingerprint(&self) -> String {
        let mut hasher = text::Hasher::default();
        hasher.bytes(self.config.model.as_bytes());
        hasher.u64(u64::from(self.config.max_model_len));
        format!("vllm-{VLLM_0_32}-{:08x}", hasher.finish() >> 32)
    }

    fn stats(&self) -> Stats {
        let mut stats = self.stats.snapshot();
        let engine = self.engine.snapshot();
        stats.oom = self.metrics.oom.load(Ordering::Relaxed);
        stats.running = engine.running;
        stats.waiting = engine.waiting;
        stats.kv_usage = engine.kv_usage();
        stats
    }

    /// Resolves when the instance shuts down; hangs use it so they end with the instance.
    async fn shutdown_signal(&self) {
        let mut shutdown = self.shutdown_tx.subscribe();
        let _ = shutdown.wait_for(|stopped| *stopped).await;
    }

    /// `vllm:lora_requests_info` now, with `--enable-lora`.
    fn lora_info(&self) -> Option<metrics::LoraInfo> {
        let adapters = self.lora.as_ref()?;
        let engine = self.engine.snapshot();
        let names = self
            .engine
            .lora_requests()
            .iter()
            .filter_map(|requests| adapters.name_of(requests.adapter))
            .collect::<Vec<_>>()
            .join(",");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Some(metrics::LoraInfo {
            max_lora: adapters.max_loras,
            samples: adapters.report(
                &names,
                now,
                engine.running + engine.waiting > 0,
                self.metrics.prompt_tokens.load(Ordering::Relaxed) > 0,
            ),
        })
    }

    fn metrics_text(&self) -> String {
        match &self.faults().metrics_page {
            Some(page) => page.clone(),
            None => self
                .metrics
                .render(&self.engine.snapshot(), self.lora_info().as_ref()),
        }
    }
}

/// The vLLM version that `ErrorShape::V0_32` speaks.
pub(crate) const VLLM_0_32: &str = "0.32.0";

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since_epoch| since_epoch.as_secs())
        .unwrap_or(0)
}

/// A running simulated vLLM instance. Clones share the instance.
#[derive(Clone)]
pub struct Sim {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Sim")
            .field("addr", &self.shared.addr)
            .field("model", &self.shared.model_name())
            .finish()
    }
}

/// Bind `config.listen` and serve on the current tokio runtime. Returns once listening.
pub async fn start(config: SimConfig) -> std::io::Result<Sim> {
    let listener = server::bind(config.listen)?;
    let addr = listener.local_addr()?;
    let served_names = config.served_names();
    let model_name = served_names
        .first()
        .cloned()
        .unwrap_or_else(|| config.model.clone());
    let tokenizer = match &config.tokenizer {
        Some(dir) => Some(
            sluice_tokenizer::PromptTokenizer::load(dir)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
        ),
        None => None,
    };
    let (kv_events, event_sink) = match &config.kv_events {
        Some(events) if config.prefix_caching => {
            let (endpoints, sink) = kv_events::publish(addr.ip(), events).await?;
            (Some(endpoints), Some(sink))
        }
        _ => (None, None),
    };
    let kv_transfer = match &config.kv_transfer {
        Some(transfer) => Some(kv_transfer::KvTransfer::start(transfer.clone(), addr.ip()).await?),
        None => None,
    };
    let prefix_cache = config
        .prefix_caching
        .then(|| prefix_cache::PrefixCache::new(config.block_size, event_sink));
    let shared = Arc::new_cyclic(|weak| Shared {
        prefill_queue: config.max_num_batched_tokens.map(|budget| {
            prefill::PrefillQueue::start(budget, config.long_prefill_token_threshold, weak.clone())
        }),
        prefix_cache,
        tokenizer,
        kv_events,
        engine: Engine::new(
            config.num_gpu_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_waiting,
            config.oom_on_overload,
            config.lora.as_ref().map_or(0, |l| l.max_loras),
        ),
        lora: config.lora.as_ref().map(lora::Adapters::new),
        kv_transfer,
        responses: config
            .responses_store
            .then(handlers::responses_api::Store::default),
        metrics: Metrics::new(&config, model_name),
        stats: Recorder::new(config.record_requests),
        faults: RwLock::new(Arc::new(Faults::default())),
        fault_counter: AtomicU64::new(0),
        refuse_tx: watch::channel(false).0,
        shutdown_tx: watch::channel(false).0,
        kill_tx: watch::channel(0).0,
        addr,
        id_counter: AtomicU64::new(0),
        nonce: rand::random(),
        started: unix_now(),
        prefill_turn: tokio::sync::Mutex::new(()),
        served_names,
        config: config.clone(),
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
    /// The disaggregated prefill's counts (`GET /sim/kv_transfer`), with `kv_transfer` set.
    pub fn kv_transfer(&self) -> Option<KvTransferJson> {
        self.shared.kv_transfer.as_ref().map(|t| t.json())
    }

    /// The bound address (the real port when the config asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }
    /// `http://ADDR`, the base URL for requests.
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }
    pub fn config(&self) -> &SimConfig {
        &self.shared.config
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
    /// Counters and the last recorded requests.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }
    /// The KV-cache usage /metrics reports (0..=1).
    pub fn kv_usage(&self) -> f64 {
        self.shared.engine.snapshot().kv_usage()
    }
    /// Running and waiting requests, and the KV blocks in use.
    pub fn engine_state(&self) -> EngineSnapshot {
        self.shared.engine.snapshot()
    }
    /// Blocks the prefix cache holds now (0 without prefix caching).
    pub fn cached_blocks(&self) -> usize {
        self.shared
            .prefix_cache
            .as_ref()
            .map_or(0, prefix_cache::PrefixCache::len)
    }
    /// Empties the prefix cache, as vLLM's `POST /reset_prefix_cache` does (its KV event
    /// publisher sends `AllBlocksCleared`).
    pub fn reset_prefix_cache(&self) {
        if let Some(cache) = &self.shared.prefix_cache {
            cache.clear();
        }
    }
    /// The KV event publisher's endpoints (`tcp://HOST:PORT`), when events are on: the
    /// publisher's and the replay's.
    pub fn kv_event_endpoints(&self) -> Option<(String, Option<String>)> {
        self.shared
            .kv_events
            .as_ref()
            .map(|e| (e.publisher.clone(), e.replay.clone()))
    }
    /// Publishes `events` on the KV event publisher as if the engine had made them, in the
    /// publisher's next batch: what a loaded engine would send, without its load (the
    /// benchmark's fleet at scale). `false` when events are off.
    pub fn publish_kv_events(&self, events: impl IntoIterator<Item = KvEvent>) -> bool {
        self.shared
            .prefix_cache
            .as_ref()
            .is_some_and(|cache| cache.publish(events))
    }
    /// What `GET /metrics` returns.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }
    /// Take `usage` (0..=1, clamped) of the KV cache with phantom blocks, held on top of the
    /// requests' own, as if something else used that GPU memory; 0 gives them back. The usage
    /// on /metrics (and [`Sim::kv_usage`]) is then at least `usage`; a new request that does
    /// not fit waits (or gets the OOM error in OOM mode); a running request that needs a block
    /// that is not free is preempted until there is room. Over HTTP: `POST /sim/kv`.
    pub fn set_phantom_kv(&self, usage: f64) {
        tracing::info!(usage, "phantom KV usage set");
        self.shared.engine.set_phantom_usage(usage);
    }
    /// The phantom share set with [`Sim::set_phantom_kv`] (0.0 when there is none).
    pub fn phantom_kv(&self) -> f64 {
        self.shared.engine.phantom_usage()
    }
    /// Give the phantom blocks back: `set_phantom_kv(0.0)`.
    pub fn clear_phantom_kv(&self) {
        self.set_phantom_kv(0.0);
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
        self.shared
            .kill_tx
            .send_modify(|generation| *generation += 1);
    }
}
