//! Upstream pools as plugins see them: named sets of backends serving some models.
//!
//! A pool is built once from config and shared (`Arc<Pool>`); its backends may change at run
//! time through one door ([`Pool::update`], see `crate::members`). Choosing a backend is
//! lock-free: it loads the current set and each backend's live state (`crate::health`), then
//! balances by KV-cache room, predicted time to first token, or weighted round robin.

use crate::header_rules::{HeaderRules, UpstreamAuth};
use crate::health::{BackendLive, HealthPolicy, OutlierPolicy, StaleAs, DEFAULT_PREFILL_SPEED};
use crate::members::{self, Change, Member, Members, Wanted};
use crate::prefix::{Credit, PrefixKeys, PrefixRouting};
use crate::retry::{RetryBudget, RetryPolicy};
use arc_swap::{ArcSwap, ArcSwapOption, Guard};
use pingora_core::upstreams::peer::HttpPeer;
use sluice_llm::model_name::ServedModel;
use sluice_llm::{Demand, LlmCall};
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

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
    /// The slowest generation speed the pool is trusted to sustain, in tokens per second; > 0.
    pub min_tokens_per_second: f64,
    /// The slack added to the sized total timeout.
    pub margin: Duration,
}

impl Timeouts {
    /// The total timeout of a request that may generate `max_tokens` tokens.
    pub fn total_for(&self, max_tokens: Option<u32>) -> Duration {
        match (&self.sized_by_max_tokens, max_tokens) {
            (Some(rate), Some(tokens)) if rate.min_tokens_per_second > 0.0 => {
                // Saturating: a tiny rate and a huge `max_tokens` (the client's) must not
                // overflow, only hit the cap.
                let generation =
                    Duration::try_from_secs_f64(f64::from(tokens) / rate.min_tokens_per_second)
                        .unwrap_or(Duration::MAX);
                self.first_byte
                    .saturating_add(generation)
                    .saturating_add(rate.margin)
                    .min(self.total)
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

/// One backend as configured or discovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// As written in the config (`host:port`) or discovered (`ip:port`), for logs and
    /// `/status`.
    pub address: String,
    /// The address `address` resolves to now; attempts connect here.
    pub resolved: SocketAddr,
    /// Its share of the pool's requests under round robin (≥ 1); KV-aware balancing ignores it.
    pub weight: usize,
}

/// What a pool's model can do, as declared in its config: requests asking for more go
/// elsewhere (the speculative selector's `unsupported`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The model takes `tools` (function calling).
    pub tools: bool,
    /// The model can return `logprobs`.
    pub logprobs: bool,
    /// `n` > 1.
    pub multiple_choices: bool,
    /// `best_of` > 1 and beam search, which speculative decoding does not support.
    pub best_of: bool,
}

/// What of a client's request body reaches the pool's engine as sent (`pools[].client_fields`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFields {
    /// Each tenant's requests get a `cache_salt` of their own, so that vLLM's prefix cache is
    /// shared only within a tenant (`cache_salt: per_tenant`, the default); off: the client's
    /// `cache_salt` goes as sent (`as_sent`).
    pub tenant_cache_salt: bool,
    /// The fields that act on the engine beyond the request (`priority`,
    /// `kv_transfer_params`, `vllm_xargs`, `request_id`) are reset (`engine_controls: reset`,
    /// the default; see [`sluice_llm::model_name::ENGINE_CONTROLS`]); off: passed (`pass`).
    pub reset_engine_controls: bool,
}

impl Default for ClientFields {
    fn default() -> Self {
        Self {
            tenant_cache_salt: true,
            reset_engine_controls: true,
        }
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            tools: true,
            logprobs: true,
            multiple_choices: true,
            best_of: true,
        }
    }
}

/// How a pool chooses among its usable backends.
#[derive(Debug, Clone, PartialEq)]
pub enum Balancing {
    /// Weighted round robin.
    RoundRobin,
    /// By scraped KV-cache room and queue depth, the better of two random backends (power of
    /// two choices), so that a burst does not herd onto the emptiest one. With
    /// `prefix_affinity`, requests sharing their first that many bytes of prompt prefer the
    /// same backend (rendezvous hashing), to use vLLM's prefix cache, unless it is clearly
    /// busier than the alternative.
    KvAware {
        /// Leading prompt bytes hashed for prefix affinity; `None` turns affinity off.
        prefix_affinity: Option<usize>,
    },
    /// By predicted time to first token: the backend whose prefill backlog (this proxy's
    /// outstanding prompt tokens, and queues others left there), plus this prompt less what
    /// its prefix cache probably holds, takes the least time at its learned prefill speed.
    Ttft(TtftBalancing),
}

impl Balancing {
    /// Leading prompt bytes hashed for prefix affinity, when the strategy uses it.
    pub fn prefix_affinity(&self) -> Option<usize> {
        match self {
            Balancing::RoundRobin => None,
            Balancing::KvAware { prefix_affinity } => *prefix_affinity,
            Balancing::Ttft(ttft) => ttft.prefix_affinity,
        }
    }

    /// The strategy's name in config and `/status`.
    pub fn name(&self) -> &'static str {
        match self {
            Balancing::RoundRobin => "round_robin",
            Balancing::KvAware { .. } => "kv_aware",
            Balancing::Ttft(_) => "ttft",
        }
    }
}

/// The settings of [`Balancing::Ttft`].
#[derive(Debug, Clone, PartialEq)]
pub struct TtftBalancing {
    /// Leading prompt bytes hashed for prefix affinity; `None` turns affinity off.
    pub prefix_affinity: Option<usize>,
    /// The prefill speed each backend starts from, in prompt tokens per second, until its
    /// own TTFTs teach it better.
    pub prefill_tokens_per_second: f64,
    /// The share of requests (0..=1) sent to a random usable backend instead of the best,
    /// so that every backend's speed keeps being learned.
    pub exploration: f64,
}

impl Default for TtftBalancing {
    fn default() -> Self {
        Self {
            prefix_affinity: None,
            prefill_tokens_per_second: DEFAULT_PREFILL_SPEED,
            exploration: 0.02,
        }
    }
}

/// Whether a session may leave its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionMode {
    /// The session stays while its backend is usable and not overloaded.
    Soft,
    /// The session stays while its backend is usable, however loaded.
    Hard,
}

/// Session affinity: requests naming the same session (a header) go to one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionAffinity {
    /// The request header that names the session (lower case).
    pub header: String,
    /// Soft or hard.
    pub mode: SessionMode,
    /// A session not seen for this long is forgotten.
    pub idle_ttl: Duration,
    /// The most sessions remembered at once; older ones are forgotten first when more come.
    pub capacity: usize,
}

/// A prompt scale of 1 ([`Pool::prompt_tokens`]), in thousandths.
const PROMPT_SCALE_ONE: u64 = 1000;
/// The shortest estimated prompt a pool learns its prompt scale from.
const MIN_PROMPT_TO_LEARN: u64 = 64;

/// The backend chosen for an attempt.
#[derive(Debug, Clone)]
pub struct Selected {
    /// The backend's address: connect here, and add it to `tried` for the next attempt.
    pub addr: SocketAddr,
    /// The backend's live state; [`BackendLive::begin`] counts the attempt in flight.
    pub live: Arc<BackendLive>,
    /// The time to first token predicted for the request there, in seconds, when it has a
    /// prompt.
    pub predicted_ttft: Option<f64>,
    /// The prompt tokens (estimated) its prefix cache is taken to serve: the exact index's
    /// count, 0 when nothing is credited, `None` when the approximate affinity guessed (the
    /// backend's TTFT then cannot teach its prefill speed).
    pub cached_tokens: Option<u64>,
    /// With the exact index: the prompt tokens (the engine's) it predicts the backend's
    /// prefix cache serves.
    pub predicted_cached: Option<u64>,
}

/// A request's class: who is shed first when a pool is under pressure. Written in config
/// files in lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Shed first when a pool comes under pressure.
    Sheddable = 0,
    /// The usual class: shed after sheddable requests.
    Standard = 1,
    /// Shed last.
    Critical = 2,
}

impl Priority {
    /// Every class, lowest first.
    pub const ALL: [Priority; 3] = [Priority::Sheddable, Priority::Standard, Priority::Critical];

    /// The class as written in config, headers and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Sheddable => "sheddable",
            Priority::Standard => "standard",
            Priority::Critical => "critical",
        }
    }

    /// The class named by `s` (a header's value), ignoring case and surrounding spaces; `None`
    /// for an unknown name.
    pub fn parse(s: &str) -> Option<Self> {
        Priority::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
    }
}

/// How much headroom a pool has, from its usable backends' projected KV usage.
///
/// Stale backends (alive, without fresh metrics) are left out of `kv_usage` and counted in
/// `stale`: whether they count as full is the reader's call
/// ([`Pressure::kv_usage_counting_stale`]), so that a monitoring problem (a metrics format the
/// parser does not read) does not by itself make a healthy pool look full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    /// Projected KV usage over the usable backends with fresh metrics (weighted by cache size),
    /// `None` when no backend's usage is known.
    pub kv_usage: Option<f64>,
    /// The backends `kv_usage` is over.
    pub measured: usize,
    /// Backends that may take a request now, stale ones included.
    pub usable: usize,
    /// Usable backends whose metrics are stale: alive, their load unknown.
    pub stale: usize,
    /// The KV cache in tokens of the usable backends that are not stale, when every one of
    /// them publishes its size.
    pub kv_capacity_tokens: Option<f64>,
}

impl Pressure {
    /// The usage with stale backends counted as `stale_as` says: each as a full backend of the
    /// measured ones' average size when [`StaleAs::Saturated`] (1 when all are stale), left out
    /// when [`StaleAs::Unknown`] (that is `kv_usage`).
    pub fn kv_usage_counting_stale(&self, stale_as: StaleAs) -> Option<f64> {
        if stale_as == StaleAs::Unknown || self.stale == 0 {
            return self.kv_usage;
        }
        let stale = self.stale as f64;
        Some(match self.kv_usage {
            Some(usage) => {
                let measured = self.measured as f64;
                (usage * measured + stale) / (measured + stale)
            }
            None => 1.0,
        })
    }

    /// The usage after adding a request that may hold `tokens`: its share of the pool's
    /// cache when the size is known, else the usage as it is.
    pub fn with_demand(&self, tokens: u64) -> Option<f64> {
        let usage = self.kv_usage?;
        Some(match self.kv_capacity_tokens {
            Some(capacity) if capacity > 0.0 => usage + tokens as f64 / capacity,
            _ => usage,
        })
    }
}

/// Why a pool cannot serve a request at all, whatever its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfit {
    /// The request asks for what the pool's model does not support (its `supports`).
    Unsupported,
    /// The prompt and the output budget exceed the model's `max_model_len`.
    TooLong,
}

/// A pool's admission control: the KV breaker installs one per pool at start-up, and anyone
/// who chooses a pool (the speculative selector, a reroute) asks the pool, not the breaker.
///
/// Both answers must come from the pool's live state ([`Pool::pressure`]) on every call:
/// state kept between calls (hysteresis) may only refine that, never stand in for it, or a
/// pool that nobody sends to would keep the answer it had when traffic left it.
pub trait Admission: Send + Sync {
    /// Whether `pool` sheds every request of class `priority` now.
    fn sheds(&self, pool: &Pool, priority: Priority) -> bool;
    /// Whether `pool` takes a request of `priority` that may hold `tokens` KV tokens now.
    fn admits(&self, pool: &Pool, priority: Priority, tokens: u64) -> bool;
}

/// An address no backend has, for a candidate that vanished between two reads.
const UNSPECIFIED: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// How close to the best-of-two score the prefix-affine backend must be to be taken.
const AFFINITY_SLACK: f64 = 0.15;

/// The prompt size the per-backend predicted TTFT (`/status`, metrics) is given for.
pub const REFERENCE_PROMPT_TOKENS: u64 = 1_000;

/// What a predicted TTFT adds for a backend whose KV cache cannot take the request now: it
/// would wait in the engine's queue for running requests to finish, for an unknown time.
const KV_FULL_WAIT: f64 = 5.0;

/// What a predicted TTFT adds for a backend that must load a request's LoRA adapter into a
/// free slot (from the engine's CPU cache: milliseconds to tens of them), so that a backend
/// already running it is preferred unless it is clearly busier.
const ADAPTER_LOAD: f64 = 0.05;

/// How much lower the `kv_aware` score of a backend that must load the adapter is.
const ADAPTER_LOAD_SCORE: f64 = 0.1;

/// How ready a backend is for a request's LoRA adapter (see [`adapter_readiness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum AdapterReadiness {
    /// It lists the adapter, and runs it now or has a slot free for it.
    Now,
    /// It lists the adapter but every slot holds another one (the request waits for one),
    /// or which adapters it has is not known yet.
    Waits,
    /// It does not list the adapter: it would answer 404.
    Lacks,
}

/// How ready `live` is for `adapter` (see [`AdapterReadiness`]).
fn adapter_readiness(live: &BackendLive, adapter: &str) -> AdapterReadiness {
    match live.lists_adapter(adapter) {
        None => return AdapterReadiness::Waits,
        Some(false) => return AdapterReadiness::Lacks,
        Some(true) => {}
    }
    let load = live.load();
    match load.as_deref().and_then(|l| l.lora.as_ref()) {
        Some(slots) if !slots.runs(adapter) && !slots.has_free_slot() => AdapterReadiness::Waits,
        _ => AdapterReadiness::Now,
    }
}

/// Whether `live` must load `adapter` before running the request (it lists it, and has no
/// request of it now).
fn loads_adapter(live: &BackendLive, adapter: Option<&str>) -> bool {
    let Some(adapter) = adapter else {
        return false;
    };
    let load = live.load();
    !load
        .as_deref()
        .and_then(|l| l.lora.as_ref())
        .is_some_and(|slots| slots.runs(adapter))
}

/// A soft session leaves a backend whose projected KV usage reaches this...
const SESSION_KV_LIMIT: f64 = 0.95;

/// ...or where it would wait this long (seconds) behind other prefills.
const SESSION_MAX_WAIT: f64 = 1.0;

/// A backend that left the pool and is listed again within this long comes back with the
/// state it left with (its ejection, its learned speed): a DNS answer that briefly lacked
/// it, or a pod that restarted in place, does not make it a stranger.
const RETURN_WINDOW: Duration = Duration::from_secs(300);

/// The most departed backends whose state is kept for their return.
const MAX_DEPARTED: usize = 1024;

/// A named pool of backends.
pub struct Pool {
    /// The pool's name: in `x-sluice-pool`, metric labels and `/status`.
    pub name: Arc<str>,
    /// The model names this pool serves (the `model` field of requests): as configured, or
    /// as its backends list them (`models: auto`, see [`Pool::learn_models`]).
    models: ArcSwap<Vec<String>>,
    /// The LoRA adapters its backends list (see [`Pool::learn_adapters`]).
    adapters: ArcSwap<Vec<String>>,
    /// Whether the model names are learned from the backends.
    pub auto_models: bool,
    /// The longest context (prompt + output tokens) its model accepts, if known.
    pub max_model_len: Option<u32>,
    /// The pool's upstream timeouts.
    pub timeouts: Timeouts,
    /// Where the pool's backends come from, for `/status` and the logs: `static`, or the
    /// discovery source (`dns vllm.llm.svc:8000`, ...).
    pub source: String,
    /// Use TLS to the backends, with this SNI.
    pub tls_sni: Option<String>,
    /// Active health checks of the pool's backends.
    pub health: HealthPolicy,
    /// Passive ejection of the pool's backends that fail real traffic.
    pub outlier: OutlierPolicy,
    /// How a backend is chosen for each attempt.
    pub balancing: Balancing,
    /// What the pool's model can do; the speculative selector sends requests that need more
    /// elsewhere.
    pub supports: Capabilities,
    /// Retries within the pool on a 5xx or 429.
    pub retry: RetryPolicy,
    /// What a million tokens (prompt and completion alike) cost on this pool, in dollars:
    /// for the cost metrics and the tenants' budgets.
    pub price_per_million_tokens: f64,
    /// What the pool changes in requests sent upstream and answers sent back.
    pub headers: HeaderRules,
    /// The credential its backends demand, sent with every request.
    pub upstream_auth: Option<UpstreamAuth>,
    /// Whether the client's own API key headers go upstream (off: removed).
    pub forward_client_key: bool,
    /// The pool's retry budget, shared by its requests: the core deposits for each request sent to
    /// the pool and spends one for each retry.
    pub retry_budget: RetryBudget,
    /// Session affinity, when the pool has it.
    pub sessions: Option<SessionAffinity>,
    /// The model name the pool's engine serves, when it is not the client's (see
    /// [`sluice_llm::model_name`]).
    pub served_model: Option<ServedModel>,
    /// What of the client's body the engine gets as sent.
    pub client_fields: ClientFields,
    /// The pool's tokenizer and exact prefix index (`tokenizer` and `kv_events`), if set;
    /// swapped only by [`Pool::inherit`], for the running pool's index.
    prefix: ArcSwapOption<PrefixRouting>,
    /// Who decides whether the pool takes a request now, if anyone (see [`Admission`]).
    admission: OnceLock<Arc<dyn Admission>>,
    /// The pool's tokens per estimated prompt token, in thousandths: learned from its
    /// answers' `usage.prompt_tokens` (see [`Pool::prompt_tokens`]).
    prompt_scale: AtomicU64,
    /// `name` as an `x-sluice-pool` value, made once: each answer takes a reference to it.
    name_value: http::HeaderValue,
    /// The backends now: read without a lock, replaced whole by [`Pool::update`].
    members: ArcSwap<Members>,
    /// Serialises updates (rare); readers never take it.
    updating: Mutex<()>,
    /// Counts changes of `members`, for whoever follows them (the health service).
    changes: tokio::sync::watch::Sender<u64>,
    /// The prefill speed a backend that joins starts from.
    prefill_seed: f64,
    session_table: Option<SessionTable>,
    /// The backends that left within [`RETURN_WINDOW`], their state kept for their return;
    /// oldest first. Taken only under `updating`.
    departed: Mutex<std::collections::VecDeque<(SocketAddr, Arc<BackendLive>, Instant)>>,
}

/// Everything a pool is built from.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// The pool's name: letters, digits, `-` and `_`; unique.
    pub name: String,
    /// The `model` values the pool serves; empty for a catch-all (unless `auto_models`).
    pub models: Vec<String>,
    /// Learn the model names from the backends' `/v1/models` (`models: auto`).
    pub auto_models: bool,
    /// The model's longest context (prompt + output tokens), as vLLM's `--max-model-len`.
    pub max_model_len: Option<u32>,
    /// The pool's upstream timeouts.
    pub timeouts: Timeouts,
    /// The pool's backends at start; a pool with a discovery source starts with none.
    pub backends: Vec<BackendSpec>,
    /// Where the backends come from (see [`Pool::source`]).
    pub source: String,
    /// Reach the backends over TLS with this SNI; `None`: plain HTTP.
    pub tls_sni: Option<String>,
    /// Active health checks of the backends.
    pub health: HealthPolicy,
    /// Passive ejection of backends that fail real traffic.
    pub outlier: OutlierPolicy,
    /// How a backend is chosen for each attempt.
    pub balancing: Balancing,
    /// What the pool's model can do.
    pub supports: Capabilities,
    /// Retries within the pool on a 5xx or 429.
    pub retry: RetryPolicy,
    /// Dollars per million tokens.
    pub price_per_million_tokens: f64,
    /// Header rules.
    pub headers: HeaderRules,
    /// The backends' credential.
    pub upstream_auth: Option<UpstreamAuth>,
    /// Send the client's API key headers upstream.
    pub forward_client_key: bool,
    /// Session affinity; `None`: off.
    pub sessions: Option<SessionAffinity>,
    /// The name sent upstream as `model`; `None`: the client's.
    pub served_model: Option<ServedModel>,
    /// What of the client's body the engine gets as sent.
    pub client_fields: ClientFields,
    /// The tokenizer and exact prefix index; `None`: the approximate affinity only.
    pub prefix: Option<Arc<PrefixRouting>>,
}

impl PoolSettings {
    /// A pool of `backends` serving `models`, with every other setting at its default.
    pub fn new(name: &str, models: Vec<String>, backends: Vec<BackendSpec>) -> Self {
        Self {
            name: name.to_string(),
            models,
            auto_models: false,
            max_model_len: None,
            timeouts: Timeouts::default(),
            backends,
            source: "static".into(),
            tls_sni: None,
            health: HealthPolicy::default(),
            outlier: OutlierPolicy::default(),
            balancing: Balancing::KvAware {
                prefix_affinity: None,
            },
            supports: Capabilities::default(),
            retry: RetryPolicy::default(),
            price_per_million_tokens: 0.0,
            headers: HeaderRules::default(),
            upstream_auth: None,
            forward_client_key: false,
            sessions: None,
            served_model: None,
            client_fields: ClientFields::default(),
            prefix: None,
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("models", &self.models.load())
            .field("source", &self.source)
            .field("members", &self.members.load().len())
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Builds the pool: a live state per backend, a retry budget holding `min_retries`, and no
    /// admission control until one is installed.
    pub fn new(settings: PoolSettings) -> Self {
        let seed = match &settings.balancing {
            Balancing::Ttft(ttft) => ttft.prefill_tokens_per_second,
            _ => DEFAULT_PREFILL_SPEED,
        };
        let session_table = settings
            .sessions
            .as_ref()
            .map(|s| SessionTable::new(s.capacity, s.idle_ttl));
        // A pool's name is letters, digits, `-` and `_` (checked with the config).
        let name_value = http::HeaderValue::from_str(&settings.name)
            .unwrap_or_else(|_| http::HeaderValue::from_static("-"));
        Self {
            name: Arc::from(settings.name.as_str()),
            name_value,
            models: ArcSwap::from_pointee(settings.models),
            adapters: ArcSwap::from_pointee(Vec::new()),
            auto_models: settings.auto_models,
            max_model_len: settings.max_model_len,
            timeouts: settings.timeouts,
            members: ArcSwap::from_pointee(first_members(settings.backends, seed)),
            updating: Mutex::new(()),
            changes: tokio::sync::watch::channel(0).0,
            prefill_seed: seed,
            source: settings.source,
            tls_sni: settings.tls_sni,
            health: settings.health,
            outlier: settings.outlier,
            balancing: settings.balancing,
            supports: settings.supports,
            retry_budget: RetryBudget::new(&settings.retry),
            retry: settings.retry,
            price_per_million_tokens: settings.price_per_million_tokens,
            headers: settings.headers,
            upstream_auth: settings.upstream_auth,
            forward_client_key: settings.forward_client_key,
            sessions: settings.sessions,
            served_model: settings.served_model,
            client_fields: settings.client_fields,
            prefix: ArcSwapOption::new(settings.prefix),
            admission: OnceLock::new(),
            prompt_scale: AtomicU64::new(PROMPT_SCALE_ONE),
            session_table,
            departed: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// The pool's tokenizer and exact prefix index (`tokenizer` and `kv_events`), if set.
    pub fn prefix(&self) -> Option<Arc<PrefixRouting>> {
        self.prefix.load_full()
    }

    /// The pool's backends now: a snapshot, cheap to take, that an update does not change.
    pub fn members(&self) -> Guard<Arc<Members>> {
        self.members.load()
    }

    /// The live state of the backend at `index` of [`Pool::members`] now.
    pub fn live_at(&self, index: usize) -> Option<Arc<BackendLive>> {
        self.members().get(index).map(|e| Arc::clone(&e.live))
    }

    /// The one door through which the backends change: a source now lists `wanted`.
    /// Addresses kept keep what is known about them; new ones join and warm up; ones no
    /// longer listed as ready drain (see `crate::members`). Returns what changed.
    pub fn update(&self, wanted: &[Wanted]) -> Change {
        let _one_at_a_time = self.updating.lock().unwrap_or_else(|e| e.into_inner());
        let seed = self.prefill_seed;
        let mut departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        departed.retain(|(_, _, left)| left.elapsed() < RETURN_WINDOW);
        let now = self.members.load();
        let (next, change) = now.updated(wanted, |addr| {
            match departed.iter().position(|(a, _, _)| *a == addr) {
                Some(i) => departed
                    .remove(i)
                    .map_or_else(|| fresh_live(seed), |(_, live, _)| live),
                None => fresh_live(seed),
            }
        });
        if !change.is_empty() {
            remember_departed(&mut departed, &now, &next);
            self.members.store(Arc::new(next));
            self.changes.send_modify(|n| *n += 1);
        }
        change
    }

    /// Removes the draining backends that have nothing running any more; returns their
    /// addresses. Called on a tick by whoever runs the pool's discovery.
    pub fn sweep(&self) -> Vec<String> {
        let _one_at_a_time = self.updating.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.members.load();
        let Some((next, left)) = now.swept() else {
            return Vec::new();
        };
        let mut departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        remember_departed(&mut departed, &now, &next);
        self.members.store(Arc::new(next));
        self.changes.send_modify(|n| *n += 1);
        left
    }

    /// Takes over what `old` (this pool in the generation a reload replaces) knows: the live
    /// state of every backend both have, and, for a pool that starts without backends (a
    /// discovered one), `old`'s backends themselves until its source answers.
    pub fn inherit(&self, old: &Pool) {
        let _one_at_a_time = self.updating.lock().unwrap_or_else(|e| e.into_inner());
        let theirs = old.members();
        let mine = self.members.load();
        let list: Vec<Member> = if mine.is_empty() {
            theirs.iter().cloned().collect()
        } else {
            mine.iter()
                .map(|m| match theirs.find(m.spec.resolved) {
                    // With its session slot, which the inherited sessions name it by.
                    Some(old) => Member {
                        live: Arc::clone(&old.live),
                        slot: old.slot,
                        ..m.clone()
                    },
                    None => Member {
                        slot: 0,
                        ..m.clone()
                    },
                })
                .collect()
        };
        let mut list = list;
        members::give_slots(&mut list);
        self.members.store(Arc::new(Members::new(list)));
        // What the pool learned: the engines' cached blocks (while the tokenizer and the
        // events' source are the same), its sessions, its prompt scale.
        if let (Some(mine), Some(theirs)) = (self.prefix(), old.prefix()) {
            if mine.same_index_as(&theirs) {
                self.prefix.store(Some(theirs));
            }
        }
        if let (Some(mine), Some(theirs)) = (&self.session_table, &old.session_table) {
            mine.copy_from(theirs);
        }
        self.prompt_scale
            .store(old.prompt_scale.load(Relaxed), Relaxed);
        self.changes.send_modify(|n| *n += 1);
    }

    /// Tells of each change of the backends (a counter), for whoever follows them.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// `call`'s demand as this pool balances: with the prompt-prefix hash when the pool uses
    /// prefix affinity.
    pub fn demand_for(&self, call: &LlmCall) -> Demand {
        call.demand_with_prefix(self.balancing.prefix_affinity())
    }

    /// The pool's name as an `x-sluice-pool` header value.
    pub fn header_value(&self) -> http::HeaderValue {
        self.name_value.clone()
    }

    /// Whether the pool's model can serve `call` at all: it supports what the request asks
    /// for, and its context holds the request. Asked wherever a pool is chosen (the first
    /// draft, a fallback draft, a reroute), so that no choice sends a request where it can
    /// only be refused.
    pub fn fit(&self, call: &LlmCall) -> Result<(), Unfit> {
        let (request, supports) = (&call.request, self.supports);
        let wants_tools = request.tools.as_ref().is_some_and(|t| !t.is_empty());
        let wants_best_of =
            request.best_of.is_some_and(|n| n > 1) || request.use_beam_search == Some(true);
        let supported = (supports.tools || !wants_tools)
            && (supports.logprobs || !request.asks_for_logprobs())
            && (supports.multiple_choices || request.n.unwrap_or(1) <= 1)
            && (supports.best_of || !wants_best_of);
        if !supported {
            return Err(Unfit::Unsupported);
        }
        let context = self
            .prompt_tokens(call.demand.prompt_tokens)
            .saturating_add(call.demand.output_tokens);
        let too_long = self
            .max_model_len
            .is_some_and(|max| context > u64::from(max));
        if too_long {
            return Err(Unfit::TooLong);
        }
        Ok(())
    }

    /// The prompt tokens this pool's tokenizer makes of `estimate` (a request's
    /// [`Demand::prompt_tokens`]): the estimate counts about four bytes a token, and real
    /// tokenizers make 2.5-3 bytes a token of code, numbers and most languages; the scale is
    /// learned from what the pool's answers report ([`Pool::learn_prompt_tokens`]).
    pub fn prompt_tokens(&self, estimate: u64) -> u64 {
        let scale = self.prompt_scale.load(Relaxed);
        u64::try_from(u128::from(estimate) * u128::from(scale) / u128::from(PROMPT_SCALE_ONE))
            .unwrap_or(u64::MAX)
    }

    /// Learns the pool's prompt scale from one answer: `estimated` prompt tokens were
    /// `reported` by the engine (`usage.prompt_tokens`). A moving average, bounded, so that
    /// one odd prompt (mostly token ids, say) moves it little; prompts too short to say
    /// anything (the template's own tokens dominate) are skipped.
    pub fn learn_prompt_tokens(&self, estimated: u64, reported: u64) {
        if estimated < MIN_PROMPT_TO_LEARN {
            return;
        }
        let ratio = (reported.saturating_mul(PROMPT_SCALE_ONE) / estimated)
            .clamp(PROMPT_SCALE_ONE / 2, PROMPT_SCALE_ONE * 4);
        // Two answers learning at once may lose one sample: harmless for an average.
        let old = self.prompt_scale.load(Relaxed);
        let new = (old * 3 + ratio) / 4;
        self.prompt_scale.store(new, Relaxed);
    }

    /// The learned prompt scale: the pool's tokens per estimated token.
    pub fn prompt_scale(&self) -> f64 {
        self.prompt_scale.load(Relaxed) as f64 / PROMPT_SCALE_ONE as f64
    }

    /// Whether one more backend may be ejected: fewer than the pool's
    /// `max_ejection_percent` are out (one always may be).
    pub fn may_eject_another(&self) -> bool {
        let members = self.members();
        let ready = members.iter().filter(|e| e.is_ready());
        let ejected = ready.clone().filter(|e| e.live.is_ejected()).count();
        let share = ready.count() * self.outlier.max_ejection_percent as usize / 100;
        ejected < share.max(1)
    }

    /// Whether one more backend may be paused for its back-pressure (a 429 or 503 with
    /// `Retry-After`): fewer than the pool's `max_ejection_percent` are out, paused or ejected
    /// (one always may be). A backend that asks for a pause while the rest are out keeps
    /// taking requests, and answering its own 429s: the client then hears the upstream's
    /// own `retry-after`, not a 503 of Sluice's.
    pub fn may_pause_another(&self) -> bool {
        let members = self.members();
        let ready = members.iter().filter(|e| e.is_ready());
        let out = ready
            .clone()
            .filter(|e| e.live.is_ejected() || e.live.is_cooling())
            .count();
        let share = ready.count() * self.outlier.max_ejection_percent as usize / 100;
        out < share.max(1)
    }

    /// Whether the pool serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.load().iter().any(|m| m == model)
    }

    /// The model names the pool serves now.
    pub fn models(&self) -> Arc<Vec<String>> {
        self.models.load_full()
    }

    /// Whether the pool takes requests for any model (it names none, and learns none).
    pub fn is_catch_all(&self) -> bool {
        !self.auto_models && self.models.load().is_empty()
    }

    /// For a pool that learns its models: sets them to what its ready backends list now
    /// (their union, sorted). A backend not yet asked adds nothing; a pool none of whose
    /// backends has answered keeps what it had. Returns the names when they changed.
    pub fn learn_models(&self) -> Option<Arc<Vec<String>>> {
        if !self.auto_models {
            return None;
        }
        let members = self.members();
        let mut names: Vec<String> = Vec::new();
        let mut asked = false;
        for listed in members
            .iter()
            .filter(|m| m.is_ready())
            .filter_map(|m| m.live.served_models())
        {
            asked = true;
            names.extend(listed.iter().cloned());
        }
        names.sort();
        names.dedup();
        if !asked || **self.models.load() == names {
            return None;
        }
        let names = Arc::new(names);
        self.models.store(Arc::clone(&names));
        Some(names)
    }

    /// The backend for the next attempt: a usable one (not unhealthy, not ejected) that is
    /// not in `tried`, chosen by the pool's balancing.
    /// A request of a session ([`Demand::session`]) goes to the session's backend while the
    /// pool's [`SessionAffinity`] allows, and binds the session to wherever it goes.
    pub fn select(&self, tried: &[SocketAddr], demand: &Demand) -> Option<Selected> {
        self.select_prefixed(tried, demand, None, None)
    }

    /// The backend at `addr`, when it is still one of the pool's and not in `tried`,
    /// whatever its health: for a request whose state lives there only (a stored response's
    /// follow-up), which no other backend could answer.
    pub fn select_backend(&self, addr: SocketAddr, tried: &[SocketAddr]) -> Option<Selected> {
        if tried.contains(&addr) {
            return None;
        }
        let members = self.members();
        let member = members.iter().find(|m| m.spec.resolved == addr)?;
        Some(Selected {
            addr,
            live: Arc::clone(&member.live),
            predicted_ttft: None,
            cached_tokens: None,
            predicted_cached: None,
        })
    }

    /// Whether `addr` is one of the pool's backends now.
    pub fn has_backend(&self, addr: SocketAddr) -> bool {
        self.members().iter().any(|m| m.spec.resolved == addr)
    }

    /// The name the pool's engines get for a request for `requested` (`served_model`): none
    /// when it names one of the backends' LoRA adapters, which the engine serves under the
    /// adapter's own name.
    pub fn served_model_for(&self, requested: Option<&str>) -> Option<&ServedModel> {
        self.served_model
            .as_ref()
            .filter(|_| self.adapter(requested).is_none())
    }

    /// `model` when it names a LoRA adapter one of the pool's backends lists (their
    /// `/v1/models`: see [`Pool::learn_adapters`]). One load on the request path.
    pub fn adapter<'m>(&self, model: Option<&'m str>) -> Option<&'m str> {
        let model = model?;
        self.adapters
            .load()
            .iter()
            .any(|a| a == model)
            .then_some(model)
    }

    /// Sets the adapters the pool knows to those its backends list now (their union); the
    /// health service calls it when a backend's list is read, and as backends come and go.
    pub fn learn_adapters(&self) {
        let members = self.members();
        let mut names: Vec<String> = Vec::new();
        for listed in members.iter().filter_map(|m| m.live.adapters()) {
            names.extend(listed.iter().cloned());
        }
        names.sort();
        names.dedup();
        if **self.adapters.load() != names {
            self.adapters.store(Arc::new(names));
        }
    }

    /// [`Pool::select`] for a request whose prompt blocks are `prefix` (see
    /// [`PrefixRouting::keys`]) and which asks for the LoRA adapter `adapter` (see
    /// [`Pool::adapter`]): with the pool's exact index, each backend is credited with the
    /// prompt tokens its prefix cache holds; an adapter's request goes only where the adapter
    /// is listed, to a backend that can run it now when one can (one running it preferred,
    /// then one with a free slot).
    pub fn select_prefixed(
        &self,
        tried: &[SocketAddr],
        demand: &Demand,
        prefix: Option<&PrefixKeys>,
        adapter: Option<&str>,
    ) -> Option<Selected> {
        let members = self.members();
        let mut m = Choice {
            members: &members,
            tried,
            warm_only: members.has_late_joiners(),
            adapter: None,
        };
        if let Some(adapter) = adapter {
            let best = m
                .candidates()
                .filter_map(|i| members.get(i))
                .map(|e| adapter_readiness(&e.live, adapter))
                .min()
                .unwrap_or(AdapterReadiness::Lacks);
            m.adapter = Some((adapter, best.min(AdapterReadiness::Waits)));
        }
        let credit = self.credit(demand, prefix);
        let session = demand.session.zip(self.session_table.as_ref());
        let kept = session.and_then(|(key, table)| {
            let index = members.by_slot(table.get(key)?)?;
            self.session_stays(&m, index, demand).then_some(index)
        });
        let index = match kept {
            Some(index) => index,
            // Endpoints warming up at their share are left out, unless nothing else is left.
            None => self.balance(&m, demand, &credit).or_else(|| {
                m.warm_only
                    .then(|| {
                        self.balance(
                            &Choice {
                                warm_only: false,
                                ..m
                            },
                            demand,
                            &credit,
                        )
                    })
                    .flatten()
            })?,
        };
        let endpoint = members.get(index)?;
        if let Some((key, table)) = session {
            table.bind(key, endpoint.slot);
        }
        let cached_tokens = self.cached_at(&m, index, demand, &credit);
        let predicted_ttft = (demand.prompt_tokens > 0).then(|| {
            endpoint.live.predicted_ttft(
                demand.prompt_tokens,
                cached_tokens.unwrap_or_else(|| self.cached_tokens(demand)),
                &self.health,
            )
        });
        // The index's prediction, in the prompt's own tokens, to be set beside what the
        // engine reports it served.
        let predicted_cached = match (self.prefix.load().as_ref(), prefix, &credit) {
            (Some(routing), Some(keys), Credit::Exact { matches, .. }) => {
                routing
                    .looked_up_tokens
                    .fetch_add(keys.tokens as u64, Relaxed);
                Some(matches.served_tokens(endpoint.spec.resolved, keys.tokens as u64))
            }
            _ => None,
        };
        Some(Selected {
            addr: endpoint.spec.resolved,
            live: Arc::clone(&endpoint.live),
            predicted_ttft,
            cached_tokens,
            predicted_cached,
        })
    }

    /// What this selection credits the backends' prefix caches with: the exact index when
    /// the pool has one and the request's blocks are known, else the approximate affinity's
    /// guess when the pool uses it, else nothing.
    fn credit(&self, demand: &Demand, prefix: Option<&PrefixKeys>) -> Credit {
        match (self.prefix.load().as_ref(), prefix) {
            (Some(routing), Some(keys)) => Credit::Exact {
                matches: routing.index.lookup(&keys.keys),
                tokens: keys.tokens as u64,
                estimate: demand.prompt_tokens,
            },
            _ if self.balancing.prefix_affinity().is_some() && demand.affinity.is_some() => {
                Credit::Guess
            }
            _ => Credit::Nothing,
        }
    }

    /// The prompt tokens backend `index`'s cache is credited with (see
    /// [`Selected::cached_tokens`]): `None` for the approximate affinity's home.
    fn cached_at(
        &self,
        m: &Choice<'_>,
        index: usize,
        demand: &Demand,
        credit: &Credit,
    ) -> Option<u64> {
        let addr = m.members.get(index)?.spec.resolved;
        match credit {
            Credit::Exact { .. } => credit.exact(addr),
            Credit::Guess if self.prefix_home(m, demand) == Some(index) => None,
            _ => Some(0),
        }
    }

    /// The pool's balancing among `m`'s candidates.
    fn balance(&self, m: &Choice<'_>, demand: &Demand, credit: &Credit) -> Option<usize> {
        match &self.balancing {
            Balancing::RoundRobin => self.select_round_robin(m),
            Balancing::KvAware { .. } => self.select_kv_aware(m, demand, credit),
            Balancing::Ttft(ttft) => self.select_ttft(m, demand, ttft, credit),
        }
    }

    /// The session key of a request that names its session in the pool's session header;
    /// `None` when the pool has no session affinity or the request names none. Hashed with
    /// a per-process key: client-chosen ids cannot aim at one another's slots. Scoped to
    /// `tenant`: one tenant's session id never joins another's session (and its backend).
    pub fn session_key(
        &self,
        header: &pingora_http::RequestHeader,
        tenant: Option<&str>,
    ) -> Option<u64> {
        static KEY: LazyLock<RandomState> = LazyLock::new(RandomState::new);
        let name = &self.sessions.as_ref()?.header;
        let value = header.headers.get(name.as_str())?.as_bytes();
        (!value.is_empty()).then(|| KEY.hash_one((tenant, value)))
    }

    /// Whether a session bound to backend `index` stays there for this request.
    fn session_stays(&self, m: &Choice<'_>, index: usize, demand: &Demand) -> bool {
        let (Some(sessions), Some(endpoint)) = (&self.sessions, m.members.get(index)) else {
            return false;
        };
        if !m.candidate(index) {
            return false;
        }
        let live = &endpoint.live;
        if sessions.mode == SessionMode::Hard {
            return true;
        }
        let outlook = live.outlook(&self.health);
        let full = outlook
            .projected_kv_counting_stale(self.health.stale_as)
            .is_some_and(|kv| kv >= SESSION_KV_LIMIT)
            || outlook
                .free_kv_tokens()
                .is_some_and(|free| free < demand.tokens() as f64);
        // Others' requests queued there, beyond what this proxy is still waiting on.
        let queued = outlook.waiting > f64::from(live.accounting().prefilling);
        let behind = live.predicted_ttft(0, 0, &self.health) > SESSION_MAX_WAIT;
        !(full || queued || behind)
    }

    /// The backend prefix affinity prefers for `demand` among the usable ones not tried.
    fn prefix_home(&self, m: &Choice<'_>, demand: &Demand) -> Option<usize> {
        self.balancing.prefix_affinity()?;
        let key = demand.affinity?;
        m.candidates().max_by_key(|&i| m.rendezvous(key, i))
    }

    /// The prompt tokens prefix affinity says the prefix's home probably has cached:
    /// requests that share their first bytes mostly share a system prompt or a
    /// conversation's history, taken as half the prompt, and at least the bytes hashed.
    fn cached_tokens(&self, demand: &Demand) -> u64 {
        let hashed = self.balancing.prefix_affinity().unwrap_or(0) as u64 / 4;
        hashed
            .max(demand.prompt_tokens / 2)
            .min(demand.prompt_tokens)
    }

    /// The usable backend, not in `tried`, with the least predicted time to first token;
    /// a random one for an `exploration` share of requests.
    fn select_ttft(
        &self,
        m: &Choice<'_>,
        demand: &Demand,
        ttft: &TtftBalancing,
        credit: &Credit,
    ) -> Option<usize> {
        let n = m.members.len();
        let count = m.candidates().count();
        if count == 0 {
            return None;
        }
        // Exploring costs nothing when no backend holds the prompt (it is prefilled whole
        // wherever it goes); when one does, it would throw the cache away.
        let explores = count > 1 && ttft.exploration > 0.0 && !credit.any_exact();
        if explores && fastrand::f64() < ttft.exploration {
            return m.candidates().nth(fastrand::usize(..count));
        }
        let home = self.prefix_home(m, demand);
        // From a random start, so that ties rotate rather than pile onto the first backend.
        let start = fastrand::usize(..n);
        let mut best: Option<(usize, f64)> = None;
        for i in (0..n).map(|k| (start + k) % n) {
            if !m.candidate(i) {
                continue;
            }
            let cached =
                match credit.exact(m.members.get(i).map_or(UNSPECIFIED, |e| e.spec.resolved)) {
                    Some(exact) => exact,
                    None if home == Some(i) => self.cached_tokens(demand),
                    None => 0,
                };
            let mut cost = self.ttft_cost(m.members, i, demand, cached);
            if m.loads_adapter(i) {
                cost += ADAPTER_LOAD;
            }
            if best.is_none_or(|(_, b)| cost < b) {
                best = Some((i, cost));
            }
        }
        best.map(|(i, _)| i)
    }

    /// The predicted time to first token of `demand` on backend `index` (seconds), its
    /// prefix cache credited with `cached` prompt tokens (the exact index's count, or the
    /// approximate affinity's guess for the prefix's home): so a backend that holds the
    /// prefix keeps the request only while the wait it adds is less than the prefill its
    /// cache saves. A backend whose KV cache cannot take the request also waits for room.
    fn ttft_cost(&self, members: &Members, index: usize, demand: &Demand, cached: u64) -> f64 {
        let Some(live) = members.get(index).map(|e| &e.live) else {
            return f64::MAX;
        };
        let mut cost = live.predicted_ttft(demand.prompt_tokens, cached, &self.health);
        let outlook = live.outlook(&self.health);
        let full = outlook
            .projected_kv_counting_stale(self.health.stale_as)
            .is_some_and(|kv| kv >= 1.0)
            || outlook
                .free_kv_tokens()
                .is_some_and(|free| free < demand.tokens() as f64);
        if full {
            cost += KV_FULL_WAIT;
        }
        cost
    }

    /// The time to first token a [`REFERENCE_PROMPT_TOKENS`] prompt may expect on backend
    /// `live` now, in seconds (`/status` and the metrics).
    pub fn reference_ttft(&self, live: &BackendLive) -> f64 {
        live.predicted_ttft(REFERENCE_PROMPT_TOKENS, 0, &self.health)
    }

    /// Sessions remembered now (bounded by [`SessionAffinity::capacity`]).
    pub fn sessions_remembered(&self) -> usize {
        self.session_table.as_ref().map_or(0, SessionTable::len)
    }

    /// The next candidate of the weighted cycle: one turn of it at most.
    fn select_round_robin(&self, m: &Choice<'_>) -> Option<usize> {
        m.members.round_robin().find(|&i| m.candidate(i))
    }

    fn select_kv_aware(&self, m: &Choice<'_>, demand: &Demand, credit: &Credit) -> Option<usize> {
        let candidates = m.candidates();
        let count = candidates.clone().count();
        let scored = |i: usize| (i, self.adapter_score(m, i, demand));
        let (best, best_score) = match count {
            0 => return None,
            1 => scored(candidates.clone().next()?),
            // Two random candidates (with two, both, in random order so ties alternate).
            n => {
                let first = fastrand::usize(..n);
                let second = (first + 1 + fastrand::usize(..n - 1)) % n;
                let a = scored(candidates.clone().nth(first)?);
                let b = scored(candidates.clone().nth(second)?);
                if b.1 > a.1 {
                    b
                } else {
                    a
                }
            }
        };
        // Prefix affinity: the prefix's home backend, unless clearly worse: with the exact
        // index, the backend holding most of the prompt; else the approximate affinity's
        // (`demand.affinity` is only set for pools that use it).
        let home = if credit.any_exact() {
            candidates.max_by_key(|&i| {
                m.members
                    .get(i)
                    .and_then(|e| credit.exact(e.spec.resolved))
                    .unwrap_or(0)
            })
        } else {
            demand
                .affinity
                .and_then(|key| candidates.max_by_key(|&i| m.rendezvous(key, i)))
        };
        match home {
            Some(h)
                if h != best && self.adapter_score(m, h, demand) >= best_score - AFFINITY_SLACK =>
            {
                Some(h)
            }
            _ => Some(best),
        }
    }

    /// [`Pool::score`], lower for a backend that must load the request's adapter first.
    fn adapter_score(&self, m: &Choice<'_>, index: usize, demand: &Demand) -> f64 {
        let score = self.score(m.members, index, demand);
        if m.loads_adapter(index) {
            score - ADAPTER_LOAD_SCORE
        } else {
            score
        }
    }

    /// How good a home backend `index` is for `demand`; higher is better. Free KV cache
    /// counts most, and more so for large prompts; queued requests and a cache that cannot
    /// hold the request count against it.
    fn score(&self, members: &Members, index: usize, demand: &Demand) -> f64 {
        let Some(live) = members.get(index).map(|e| &e.live) else {
            return f64::MIN;
        };
        let outlook = live.outlook(&self.health);
        let Some(projected) = outlook.projected_kv_counting_stale(self.health.stale_as) else {
            // Nothing known: balance by what this proxy has in flight there.
            return 0.5 - 0.01 * f64::from(live.in_flight());
        };
        let free = (1.0 - projected).max(0.0);
        let kv_weight = 1.0 + (demand.prompt_tokens as f64 / 4096.0).min(3.0);
        // What was sent since the scrape is already in `projected`.
        let mut score = kv_weight * free - 0.05 * outlook.waiting;
        if outlook
            .free_kv_tokens()
            .is_some_and(|free_tokens| free_tokens < demand.tokens() as f64)
        {
            score -= 1.0;
        }
        score
    }

    /// Whether some backend may take a request now (not unhealthy, ejected or cooling down):
    /// cheaper than [`Pool::pressure`] when that is all one needs to know.
    pub fn has_usable_backend(&self) -> bool {
        self.members()
            .iter()
            .any(|e| e.is_ready() && e.live.is_usable())
    }

    /// The pool's headroom now.
    pub fn pressure(&self) -> Pressure {
        let (mut usable, mut stale, mut measured) = (0, 0, 0);
        let (mut weighted, mut weights) = (0.0, 0.0);
        let mut capacity = Some(0.0);
        let members = self.members();
        for live in members
            .iter()
            .filter(|e| e.is_ready() && e.live.is_usable())
            .map(|e| &e.live)
        {
            usable += 1;
            let outlook = live.outlook(&self.health);
            if outlook.stale {
                stale += 1;
                continue;
            }
            let size = outlook.kv_capacity_tokens;
            capacity = capacity.zip(size).map(|(sum, c)| sum + c);
            if let Some(kv) = outlook.projected_kv {
                let weight = size.unwrap_or(1.0);
                weighted += kv * weight;
                weights += weight;
                measured += 1;
            }
        }
        Pressure {
            kv_usage: (weights > 0.0).then(|| weighted / weights),
            measured,
            usable,
            stale,
            kv_capacity_tokens: capacity.filter(|c| *c > 0.0),
        }
    }

    /// Whether the pool takes a request of class `priority` that may come to hold `tokens`
    /// KV tokens, now. Asked live every time, so an answer reflects the pool's load as
    /// it is, never as it was when someone last looked. Always `true` without admission
    /// control.
    pub fn admits(&self, priority: Priority, tokens: u64) -> bool {
        self.admission
            .get()
            .is_none_or(|gate| gate.admits(self, priority, tokens))
    }

    /// Whether the pool turns away every request of class `priority` now (it is shedding the
    /// class), from its live load.
    pub fn sheds(&self, priority: Priority) -> bool {
        self.admission
            .get()
            .is_some_and(|gate| gate.sheds(self, priority))
    }

    /// Installs the pool's admission control, once, at start-up. `false` when one is
    /// installed already (two plugins cannot both decide).
    pub fn install_admission(&self, gate: Arc<dyn Admission>) -> bool {
        self.admission.set(gate).is_ok()
    }

    /// The Pingora peer for `backend`, with this pool's timeouts.
    pub fn peer(&self, backend: SocketAddr) -> HttpPeer {
        let mut peer = HttpPeer::new(
            backend,
            self.tls_sni.is_some(),
            self.tls_sni.clone().unwrap_or_default(),
        );
        let options = &mut peer.options;
        options.connection_timeout = Some(self.timeouts.connect);
        options.total_connection_timeout = Some(self.timeouts.connect);
        options.read_timeout = Some(self.timeouts.first_byte);
        options.write_timeout = Some(self.timeouts.first_byte);
        options.idle_timeout = Some(self.timeouts.keepalive_idle);
        peer
    }
}

/// One choice of a backend: the set it is made from, the backends already tried, and whether
/// backends warming up at their share are left out.
#[derive(Clone, Copy)]
struct Choice<'a> {
    members: &'a Members,
    tried: &'a [SocketAddr],
    warm_only: bool,
    /// The request's LoRA adapter, and the readiness a backend needs for it: the best any
    /// candidate has (never [`AdapterReadiness::Lacks`]).
    adapter: Option<(&'a str, AdapterReadiness)>,
}

impl Choice<'_> {
    /// Whether the backend at `index` may take this attempt: ready, usable (not unhealthy,
    /// ejected or cooling down), not tried, not warming up at its share, and as ready for
    /// the request's adapter as the best one.
    fn candidate(&self, index: usize) -> bool {
        self.members.get(index).is_some_and(|e| {
            e.is_ready()
                && e.live.is_usable()
                && !self.tried.contains(&e.spec.resolved)
                && !(self.warm_only && e.warming_full())
                && self
                    .adapter
                    .is_none_or(|(name, needed)| adapter_readiness(&e.live, name) <= needed)
        })
    }

    /// Whether the backend at `index` must load the request's adapter first.
    fn loads_adapter(&self, index: usize) -> bool {
        self.members
            .get(index)
            .is_some_and(|e| loads_adapter(&e.live, self.adapter.map(|(name, _)| name)))
    }

    fn candidates(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        (0..self.members.len()).filter(|&i| self.candidate(i))
    }

    /// The rendezvous weight of `key` on the backend at `index`.
    fn rendezvous(&self, key: u64, index: usize) -> u64 {
        self.members
            .get(index)
            .map_or(0, |e| rendezvous(key, e.key))
    }
}

/// The first members of a pool: its configured backends, there from the start.
fn first_members(backends: Vec<BackendSpec>, seed: f64) -> Members {
    let mut list: Vec<Member> = backends
        .into_iter()
        .map(|spec| Member {
            key: members::address_key(spec.resolved),
            spec,
            live: fresh_live(seed),
            membership: members::Membership::Ready,
            joined: None,
            slot: 0,
        })
        .collect();
    members::give_slots(&mut list);
    Members::new(list)
}

/// Keeps the state of the backends of `before` that `after` no longer has, for their return.
fn remember_departed(
    departed: &mut std::collections::VecDeque<(SocketAddr, Arc<BackendLive>, Instant)>,
    before: &Members,
    after: &Members,
) {
    for gone in before
        .iter()
        .filter(|m| after.find(m.spec.resolved).is_none())
    {
        departed.push_back((gone.spec.resolved, Arc::clone(&gone.live), Instant::now()));
    }
    while departed.len() > MAX_DEPARTED {
        departed.pop_front();
    }
}

/// A backend's live state as it joins: nothing known, its prefill speed seeded.
fn fresh_live(seed: f64) -> Arc<BackendLive> {
    let live = BackendLive::default();
    live.seed_prefill_speed(seed);
    Arc::new(live)
}

/// Rendezvous (highest random weight) hashing: each key prefers one backend, and removing
/// a backend moves only the keys that preferred it. Backends are named by a hash of their
/// address, so every proxy agrees.
fn rendezvous(key: u64, backend: u64) -> u64 {
    // SplitMix64's finaliser: a good mix of key and backend in a few instructions.
    let mut z = key ^ backend.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sessions and their backends: a fixed table of atomic slots, two per session (2-way set
/// associative), so it never grows whatever ids clients send, and neither lookup nor
/// binding takes a lock. A new session takes an empty or expired slot of its two, else the
/// one seen longest ago; a session whose slots were taken is just balanced afresh.
///
/// A slot packs, in one `u64`: 24 bits of the session's hash (a tag), the backend's session
/// slot (12 bits; 0: empty; see `crate::members`) and when it was last seen (28 bits of
/// seconds, wrapping). A backend keeps its slot while it stays in the pool.
struct SessionTable {
    slots: Box<[AtomicU64]>,
    idle_ttl_secs: u64,
}

const SESSION_INDEX_BITS: u32 = 12;
const SESSION_TIME_BITS: u32 = 28;
const SESSION_TIME_MASK: u64 = (1 << SESSION_TIME_BITS) - 1;

impl SessionTable {
    fn new(capacity: usize, idle_ttl: Duration) -> Self {
        let len = capacity.clamp(2, 1 << 24).next_multiple_of(2);
        Self {
            slots: (0..len).map(|_| AtomicU64::new(0)).collect(),
            idle_ttl_secs: idle_ttl.as_secs().max(1),
        }
    }

    fn now() -> u64 {
        static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
        EPOCH.elapsed().as_secs() & SESSION_TIME_MASK
    }

    fn tag(key: u64) -> u64 {
        key >> 40
    }

    /// The two slots of `key`.
    fn pair(&self, key: u64) -> [usize; 2] {
        let first = (key as usize % self.slots.len()) & !1;
        [first, first + 1]
    }

    /// The slot's backend (its session slot), when it holds `tag` and has not expired at
    /// `now`.
    fn live_index(&self, entry: u64, tag: Option<u64>, now: u64) -> Option<u16> {
        let slot = (entry >> SESSION_TIME_BITS) & ((1 << SESSION_INDEX_BITS) - 1);
        let seen = entry & SESSION_TIME_MASK;
        let idle = now.wrapping_sub(seen) & SESSION_TIME_MASK;
        let matches = tag.is_none_or(|t| entry >> (SESSION_TIME_BITS + SESSION_INDEX_BITS) == t);
        (slot > 0 && matches && idle <= self.idle_ttl_secs)
            .then(|| u16::try_from(slot).ok())
            .flatten()
    }

    /// Takes `old`'s sessions, when the two are the same size (a changed `capacity` starts
    /// afresh: a session's slots depend on it).
    fn copy_from(&self, old: &SessionTable) {
        if self.slots.len() == old.slots.len() {
            for (mine, theirs) in self.slots.iter().zip(old.slots.iter()) {
                mine.store(theirs.load(Relaxed), Relaxed);
            }
        }
    }

    fn get(&self, key: u64) -> Option<u16> {
        let (tag, now) = (Self::tag(key), Self::now());
        self.pair(key).into_iter().find_map(|slot| {
            let entry = self.slots.get(slot)?.load(Relaxed);
            self.live_index(entry, Some(tag), now)
        })
    }

    /// Binds the session `key` to the backend with session slot `slot`.
    fn bind(&self, key: u64, slot: u16) {
        if slot == 0 {
            return; // A backend beyond what slots can name: balanced without sessions.
        }
        let (tag, now) = (Self::tag(key), Self::now());
        let entry = tag << (SESSION_TIME_BITS + SESSION_INDEX_BITS)
            | (u64::from(slot) << SESSION_TIME_BITS)
            | now;
        let [a, b] = self.pair(key);
        let (Some(sa), Some(sb)) = (self.slots.get(a), self.slots.get(b)) else {
            return;
        };
        let (ea, eb) = (sa.load(Relaxed), sb.load(Relaxed));
        let mine = |e: u64| e >> (SESSION_TIME_BITS + SESSION_INDEX_BITS) == tag && e != 0;
        let free = |e: u64| self.live_index(e, None, now).is_none();
        let age = |e: u64| now.wrapping_sub(e & SESSION_TIME_MASK) & SESSION_TIME_MASK;
        let slot = if mine(ea) {
            sa
        } else if mine(eb) {
            sb
        } else if free(ea) {
            sa
        } else if free(eb) || age(eb) > age(ea) {
            sb
        } else {
            sa
        };
        // Skipped when nothing changed, so a busy session does not keep writing one line.
        if slot.load(Relaxed) != entry {
            slot.store(entry, Relaxed);
        }
    }

    fn len(&self) -> usize {
        let now = Self::now();
        self.slots
            .iter()
            .filter(|s| self.live_index(s.load(Relaxed), None, now).is_some())
            .count()
    }
}

/// All pools, in config order, with the model → pool map the router uses.
#[derive(Debug, Default)]
pub struct Pools {
    pools: Vec<Arc<Pool>>,
}

impl Pools {
    /// The pools in config order, which [`Pools::for_model`] and [`Pools::default_pool`] rely on.
    pub fn new(pools: Vec<Arc<Pool>>) -> Self {
        Self { pools }
    }

    /// Every pool, in config order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.pools.iter()
    }

    /// The pool named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| &*p.name == name)
    }

    /// Whether some pool learns its models from its backends: the model list then changes.
    pub fn any_auto_models(&self) -> bool {
        self.pools.iter().any(|p| p.auto_models)
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
    use crate::health::{Load, Verdict};
    use std::collections::BTreeSet;

    fn spec(port: u16, weight: usize) -> BackendSpec {
        let resolved: SocketAddr = ([127, 0, 0, 1], port).into();
        BackendSpec {
            address: resolved.to_string(),
            resolved,
            weight,
        }
    }

    fn pool(backends: Vec<BackendSpec>, balancing: Balancing) -> Pool {
        Pool::new(PoolSettings {
            balancing,
            ..PoolSettings::new("p", vec!["m".into()], backends)
        })
    }

    /// The live state of the backend at `addr`.
    fn live_of(pool: &Pool, addr: SocketAddr) -> Arc<BackendLive> {
        Arc::clone(&pool.members().find(addr).unwrap().live)
    }

    fn load(kv: f64, waiting: f64) -> Load {
        Load {
            kv_usage: Some(kv),
            running: 1.0,
            waiting,
            kv_capacity_tokens: Some(100_000),
            spec_acceptance: None,
            lora: None,
            scraped_at: std::time::Instant::now(),
        }
    }

    /// Backend `port` of `pool` lists `adapters`, and runs `active` of its `max_loras` slots.
    fn serve_adapters(pool: &Pool, port: u16, adapters: &[&str], active: &[&str], max_loras: u32) {
        let live = live_of(pool, spec(port, 1).resolved);
        let names: Vec<String> = adapters.iter().map(|a| a.to_string()).collect();
        live.publish_models(names.clone(), names);
        pool.learn_adapters();
        live.publish_load(Load {
            lora: Some(crate::health::LoraSlots {
                max_loras,
                active: active.iter().map(|a| a.to_string()).collect(),
            }),
            ..load(0.1, 0.0)
        });
    }

    #[test]
    fn an_adapters_requests_go_where_it_is_listed_and_can_run_now() {
        for balancing in [
            Balancing::RoundRobin,
            Balancing::KvAware {
                prefix_affinity: None,
            },
            Balancing::Ttft(TtftBalancing {
                exploration: 0.0,
                ..TtftBalancing::default()
            }),
        ] {
            let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], balancing.clone());
            let ports = |adapter: Option<&str>| -> BTreeSet<u16> {
                (0..40)
                    .filter_map(|_| pool.select_prefixed(&[], &Demand::default(), None, adapter))
                    .map(|s| s.addr.port())
                    .collect()
            };
            // Nothing known of adapters yet: any backend.
            assert_eq!(pool.adapter(Some("sql")), None);
            serve_adapters(&pool, 1, &["sql"], &["poet"], 1);
            serve_adapters(&pool, 2, &["sql", "poet"], &[], 1);
            serve_adapters(&pool, 3, &["poet"], &[], 2);
            assert_eq!(pool.adapter(Some("sql")), Some("sql"));
            assert_eq!(
                pool.adapter(Some("m")),
                None,
                "the base model is no adapter"
            );
            // `sql`: 3 lacks it, 1's only slot holds `poet`: 2, which has a free slot.
            assert_eq!(ports(Some("sql")), BTreeSet::from([2]), "{balancing:?}");
            // Every slot holding another adapter: it waits there rather than going where the
            // adapter is not.
            serve_adapters(&pool, 2, &["sql", "poet"], &["poet"], 1);
            assert_eq!(ports(Some("sql")), BTreeSet::from([1, 2]), "{balancing:?}");
            // Tried where it is listed: nowhere left.
            let tried = [spec(1, 1).resolved, spec(2, 1).resolved];
            assert!(pool
                .select_prefixed(&tried, &Demand::default(), None, Some("sql"))
                .is_none());
            // Requests without an adapter go anywhere.
            assert_eq!(ports(None), BTreeSet::from([1, 2, 3]), "{balancing:?}");
        }
    }

    #[test]
    fn a_backend_running_the_adapter_is_preferred_to_one_loading_it() {
        for balancing in [
            Balancing::KvAware {
                prefix_affinity: None,
            },
            Balancing::Ttft(TtftBalancing {
                exploration: 0.0,
                ..TtftBalancing::default()
            }),
        ] {
            let pool = pool(vec![spec(1, 1), spec(2, 1)], balancing.clone());
            serve_adapters(&pool, 1, &["sql", "poet"], &[], 2);
            serve_adapters(&pool, 2, &["sql", "poet"], &["poet"], 2);
            for _ in 0..20 {
                let picked = pool.select_prefixed(&[], &Demand::default(), None, Some("poet"));
                assert_eq!(picked.unwrap().addr.port(), 2, "{balancing:?}");
            }
        }
    }

    #[test]
    fn round_robin_respects_weights_and_exclusions() {
        let pool = pool(vec![spec(1, 1), spec(2, 3)], Balancing::RoundRobin);
        let none = Demand::default();
        let picks: Vec<u16> = (0..8)
            .map(|_| pool.select(&[], &none).unwrap().addr.port())
            .collect();
        assert_eq!(picks.iter().filter(|p| **p == 2).count(), 6, "{picks:?}");
        let only_other = pool.select(&[spec(2, 3).resolved], &none).unwrap();
        assert_eq!(only_other.addr.port(), 1);
        assert!(pool
            .select(&[spec(1, 1).resolved, spec(2, 3).resolved], &none)
            .is_none());
    }

    #[test]
    fn unusable_backends_are_never_selected() {
        for balancing in [
            Balancing::RoundRobin,
            Balancing::KvAware {
                prefix_affinity: None,
            },
            Balancing::Ttft(TtftBalancing::default()),
        ] {
            let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], balancing);
            let policy = HealthPolicy {
                unhealthy_after: 1,
                ..HealthPolicy::default()
            };
            pool.live_at(0).unwrap().record_probe(false, &policy);
            let outlier = OutlierPolicy {
                consecutive_failures: 1,
                ..OutlierPolicy::default()
            };
            pool.live_at(2).unwrap().record(Verdict::Failure, &outlier);
            for _ in 0..20 {
                let picked = pool.select(&[], &Demand::default()).unwrap();
                assert_eq!(picked.addr.port(), 2);
            }
            assert!(pool
                .select(&[spec(2, 1).resolved], &Demand::default())
                .is_none());
            assert_eq!(pool.pressure().usable, 1);
        }
    }

    #[test]
    fn kv_aware_prefers_free_cache_and_spreads_a_burst() {
        let pool = pool(
            vec![spec(1, 1), spec(2, 1), spec(3, 1)],
            Balancing::KvAware {
                prefix_affinity: None,
            },
        );
        pool.live_at(0).unwrap().publish_load(load(0.9, 4.0));
        pool.live_at(1).unwrap().publish_load(load(0.2, 0.0));
        pool.live_at(2).unwrap().publish_load(load(0.25, 0.0));
        let demand = Demand {
            prompt_tokens: 500,
            output_tokens: 500,
            affinity: None,
            sequences: 1,
            session: None,
        };
        let mut guards = Vec::new();
        let mut counts = [0usize; 3];
        for _ in 0..40 {
            let s = pool.select(&[], &demand).unwrap();
            counts[usize::from(s.addr.port()) - 1] += 1;
            guards.push(s.live.begin(demand.tokens()));
        }
        // The busy backend gets nothing; the two free ones share the burst, because what
        // was sent since the scrape counts.
        assert_eq!(counts[0], 0, "{counts:?}");
        assert!(counts[1] >= 12 && counts[2] >= 12, "{counts:?}");
        let p = pool.pressure().kv_usage.unwrap();
        assert!(p > 0.55, "the burst shows in the pressure: {p}"); // 0.45 before
    }

    #[test]
    fn a_request_that_does_not_fit_goes_where_it_fits() {
        let pool = pool(
            vec![spec(1, 1), spec(2, 1)],
            Balancing::KvAware {
                prefix_affinity: None,
            },
        );
        pool.live_at(0).unwrap().publish_load(load(0.7, 0.0)); // 30,000 tokens free
        pool.live_at(1).unwrap().publish_load(load(0.6, 3.0)); // 40,000 free, but a queue
        let small = Demand {
            prompt_tokens: 100,
            output_tokens: 100,
            affinity: None,
            sequences: 1,
            session: None,
        };
        let big = Demand {
            prompt_tokens: 30_000,
            output_tokens: 5_000,
            affinity: None,
            sequences: 1,
            session: None,
        };
        assert_eq!(pool.select(&[], &small).unwrap().addr.port(), 1);
        assert_eq!(pool.select(&[], &big).unwrap().addr.port(), 2);
    }

    #[test]
    fn prefix_affinity_is_sticky_unless_the_backend_is_busy() {
        let pool = pool(
            vec![spec(1, 1), spec(2, 1), spec(3, 1), spec(4, 1)],
            Balancing::KvAware {
                prefix_affinity: Some(256),
            },
        );
        for live in pool.members().iter().map(|e| &e.live) {
            live.publish_load(load(0.3, 0.0));
        }
        let demand = Demand {
            prompt_tokens: 10,
            output_tokens: 10,
            affinity: Some(42),
            sequences: 1,
            session: None,
        };
        let home = pool.select(&[], &demand).unwrap().addr;
        for _ in 0..20 {
            assert_eq!(pool.select(&[], &demand).unwrap().addr, home);
        }
        live_of(&pool, home).publish_load(load(0.95, 8.0));
        for _ in 0..20 {
            assert_ne!(pool.select(&[], &demand).unwrap().addr, home);
        }
    }

    /// A pool of three with an exact prefix index in which backend 2 holds `tokens`.
    fn indexed_pool(tokens: &[u32], exploration: f64) -> Pool {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tokenizer-chatml");
        let tokenizer = sluice_tokenizer::PromptTokenizer::load(&dir).unwrap();
        let routing = Arc::new(PrefixRouting::new(
            Arc::new(tokenizer),
            crate::prefix::KvEventSource::Port(1),
        ));
        routing.index.apply(
            spec(2, 1).resolved,
            &[crate::prefix_index::KvEvent::Stored {
                hashes: (0..tokens.len() as u64 / 16).collect(),
                parent: None,
                token_ids: tokens.to_vec(),
                block_size: 16,
                extra: Vec::new(),
            }],
        );
        Pool::new(PoolSettings {
            balancing: Balancing::Ttft(TtftBalancing {
                prefix_affinity: None,
                prefill_tokens_per_second: 1_000.0,
                exploration,
            }),
            prefix: Some(routing),
            ..PoolSettings::new(
                "p",
                vec!["m".into()],
                vec![spec(1, 1), spec(2, 1), spec(3, 1)],
            )
        })
    }

    #[test]
    fn the_exact_index_sends_a_prompt_where_it_is_held_and_never_explores_away() {
        let tokens: Vec<u32> = (0..1024).collect();
        let keys = PrefixKeys {
            keys: crate::prefix_index::block_keys(&tokens, 16, None, None),
            tokens: 1030,
        };
        let demand = prompt(1030, None);
        // Even exploring every request: the held prompt goes where it is held.
        let pool = indexed_pool(&tokens, 1.0);
        for _ in 0..30 {
            let s = pool
                .select_prefixed(&[], &demand, Some(&keys), None)
                .unwrap();
            assert_eq!(s.addr.port(), 2);
            assert_eq!(s.predicted_cached, Some(1024));
            assert_eq!(s.cached_tokens, Some(1024));
        }
        // Another prompt, held nowhere: explored, spread over the three.
        let other: Vec<u32> = (5000..6024).collect();
        let keys = PrefixKeys {
            keys: crate::prefix_index::block_keys(&other, 16, None, None),
            tokens: 1024,
        };
        let ports: std::collections::HashSet<u16> = (0..60)
            .map(|_| {
                pool.select_prefixed(&[], &demand, Some(&keys), None)
                    .unwrap()
                    .addr
                    .port()
            })
            .collect();
        assert_eq!(ports.len(), 3, "{ports:?}");
        // Busy enough, the holder is left: its queue costs more than the prefill it saves.
        let pool = indexed_pool(&tokens, 0.0);
        let holder = pool.live_at(1).unwrap();
        let _queue: Vec<_> = (0..4).map(|_| holder.begin_request(3000, 3000)).collect();
        let s = pool
            .select_prefixed(&[], &demand, Some(&keys_of(&tokens)), None)
            .unwrap();
        assert_ne!(
            s.addr.port(),
            2,
            "12,000 tokens queued there outweigh 1,024 cached"
        );
        assert_eq!(s.cached_tokens, Some(0));
    }

    fn keys_of(tokens: &[u32]) -> PrefixKeys {
        PrefixKeys {
            keys: crate::prefix_index::block_keys(tokens, 16, None, None),
            tokens: tokens.len() + 6,
        }
    }

    fn ttft(prefix_affinity: Option<usize>) -> Balancing {
        Balancing::Ttft(TtftBalancing {
            prefix_affinity,
            prefill_tokens_per_second: 1_000.0,
            exploration: 0.0,
        })
    }

    fn prompt(tokens: u64, affinity: Option<u64>) -> Demand {
        Demand {
            prompt_tokens: tokens,
            output_tokens: 10,
            affinity,
            sequences: 1,
            session: None,
        }
    }

    #[test]
    fn ttft_avoids_a_backend_busy_prefilling() {
        let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], ttft(None));
        let busy = pool.live_at(1).unwrap().begin_request(20_000, 16_000);
        let mut queued = pool.live_at(2).unwrap().begin_request(5_000, 3_000);
        for _ in 0..20 {
            let s = pool.select(&[], &prompt(100, None)).unwrap();
            assert_eq!(s.addr.port(), 1);
            assert!((s.predicted_ttft.unwrap() - 0.1).abs() < 1e-9);
        }
        // Once its prefill is over, the third is as good as the first: ties rotate.
        queued.first_byte(false); // Not a first token: nothing learned of its speed.
        drop(queued);
        let ports: BTreeSet<u16> = (0..40)
            .map(|_| pool.select(&[], &prompt(100, None)).unwrap().addr.port())
            .collect();
        assert!(ports.contains(&1) && ports.contains(&3), "{ports:?}");
        assert_eq!(
            pool.select(&[spec(1, 1).resolved], &prompt(100, None))
                .unwrap()
                .addr
                .port(),
            3,
            "tried backends are left out"
        );
        drop(busy);
    }

    #[test]
    fn ttft_explores_a_share_of_requests() {
        let pool = pool(
            vec![spec(1, 1), spec(2, 1)],
            Balancing::Ttft(TtftBalancing {
                exploration: 0.5,
                ..TtftBalancing::default()
            }),
        );
        let _busy = pool.live_at(1).unwrap().begin_request(200_000, 100_000);
        let to_busy = (0..200)
            .filter(|_| pool.select(&[], &prompt(100, None)).unwrap().addr.port() == 2)
            .count();
        // Half the requests explore, and half of those draw the busy backend.
        assert!((20..=90).contains(&to_busy), "{to_busy}");
        let none = pool.live_at(0).unwrap().speed_samples();
        assert_eq!(none, 0);
    }

    #[test]
    fn ttft_keeps_prefix_affinity_while_the_cache_saves_more_than_the_wait() {
        let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], ttft(Some(256)));
        let shared = prompt(2_000, Some(7));
        let home = pool.select(&[], &shared).unwrap().addr;
        for _ in 0..10 {
            assert_eq!(
                pool.select(&[], &shared).unwrap().addr,
                home,
                "idle: sticky"
            );
        }
        // 500 tokens ahead cost 0.5 s, less than the 1,000 cached tokens save: it stays.
        let small = live_of(&pool, home).begin_request(600, 500);
        assert_eq!(pool.select(&[], &shared).unwrap().addr, home);
        // 5,000 ahead cost more than the cache saves: it goes elsewhere.
        let long = live_of(&pool, home).begin_request(6_000, 5_000);
        for _ in 0..10 {
            assert_ne!(pool.select(&[], &shared).unwrap().addr, home);
        }
        drop((small, long));
        assert_eq!(pool.select(&[], &shared).unwrap().addr, home, "back home");
    }

    #[test]
    fn ttft_sends_nothing_where_the_kv_cache_is_full() {
        let pool = pool(vec![spec(1, 1), spec(2, 1)], ttft(None));
        pool.live_at(0).unwrap().publish_load(load(0.999, 0.0));
        pool.live_at(1).unwrap().publish_load(load(0.1, 0.0));
        let _backlog = pool.live_at(1).unwrap().begin_request(2_000, 1_000); // 1 s of prefill
        assert_eq!(pool.select(&[], &prompt(500, None)).unwrap().addr.port(), 2);
    }

    fn sessions(mode: SessionMode, capacity: usize) -> Pool {
        Pool::new(PoolSettings {
            balancing: ttft(None),
            sessions: Some(SessionAffinity {
                header: "x-session-id".into(),
                mode,
                idle_ttl: Duration::from_secs(600),
                capacity,
            }),
            ..PoolSettings::new(
                "p",
                vec!["m".into()],
                vec![spec(1, 1), spec(2, 1), spec(3, 1)],
            )
        })
    }

    fn in_session(pool: &Pool, id: &str) -> Demand {
        let mut header = pingora_http::RequestHeader::build("POST", b"/", None).unwrap();
        header.insert_header("x-session-id", id).unwrap();
        Demand {
            session: pool.session_key(&header, None),
            ..prompt(100, None)
        }
    }

    #[test]
    fn a_session_stays_on_its_backend() {
        for mode in [SessionMode::Soft, SessionMode::Hard] {
            let pool = sessions(mode, 1_024);
            let demand = in_session(&pool, "conversation-1");
            assert!(demand.session.is_some());
            let home = pool.select(&[], &demand).unwrap().addr;
            // Its backend gets busier than the others, but not overloaded: it stays.
            let _a = live_of(&pool, home).begin_request(400, 300);
            for _ in 0..10 {
                assert_eq!(pool.select(&[], &demand).unwrap().addr, home, "{mode:?}");
            }
            // Not when it is tried already, or unusable.
            assert_ne!(pool.select(&[home], &demand).unwrap().addr, home);
            assert_eq!(pool.sessions_remembered(), 1);
        }
        let pool = sessions(SessionMode::Soft, 1_024);
        let mut header = pingora_http::RequestHeader::build("POST", b"/", None).unwrap();
        assert_eq!(
            pool.session_key(&header, None),
            None,
            "no header: no session"
        );
        header.insert_header("x-session-id", "").unwrap();
        assert_eq!(pool.session_key(&header, None), None);
        // One tenant's session id is not another's session (N21).
        header.insert_header("x-session-id", "shared-id").unwrap();
        let alpha = pool.session_key(&header, Some("alpha"));
        assert!(alpha.is_some());
        assert_eq!(alpha, pool.session_key(&header, Some("alpha")));
        assert_ne!(alpha, pool.session_key(&header, Some("beta")));
        assert_ne!(alpha, pool.session_key(&header, None));
    }

    #[test]
    fn a_soft_session_leaves_an_overloaded_backend_and_a_hard_one_does_not() {
        for (mode, stays) in [(SessionMode::Soft, false), (SessionMode::Hard, true)] {
            let pool = sessions(mode, 1_024);
            let demand = in_session(&pool, "conversation-2");
            let home = pool.select(&[], &demand).unwrap().addr;
            // Five seconds of prefill queued ahead.
            let _backlog = live_of(&pool, home).begin_request(6_000, 5_000);
            let next = pool.select(&[], &demand).unwrap().addr;
            assert_eq!(next == home, stays, "{mode:?}");
            // A soft session moved with the request: it stays where it went.
            assert_eq!(pool.select(&[], &demand).unwrap().addr, next, "{mode:?}");
            // A full KV cache is overload too.
            let pool = sessions(mode, 1_024);
            let home = pool.select(&[], &demand).unwrap().addr;
            live_of(&pool, home).publish_load(load(0.97, 0.0));
            assert_eq!(pool.select(&[], &demand).unwrap().addr == home, stays);
        }
    }

    #[test]
    fn the_session_table_is_bounded() {
        let pool = sessions(SessionMode::Hard, 64);
        for i in 0..10_000 {
            let demand = in_session(&pool, &format!("client-chosen-{i}"));
            pool.select(&[], &demand).unwrap();
        }
        assert!(pool.sessions_remembered() <= 64);
        // The latest sessions are still remembered (each evicts only older ones).
        let demand = in_session(&pool, "client-chosen-9999");
        let home = pool.select(&[], &demand).unwrap().addr;
        let _busy = pool
            .members()
            .find(home)
            .unwrap()
            .live
            .begin_request(60_000, 50_000);
        assert_eq!(pool.select(&[], &demand).unwrap().addr, home);
    }

    #[test]
    fn no_more_than_the_configured_share_of_a_pool_is_ejected() {
        let pool = pool(
            vec![spec(1, 1), spec(2, 1), spec(3, 1), spec(4, 1)],
            Balancing::RoundRobin,
        );
        let outlier = OutlierPolicy {
            consecutive_failures: 1,
            ..OutlierPolicy::default()
        };
        for live in pool.members().iter().map(|e| &e.live) {
            live.record_in_pool(Verdict::Failure, &outlier, pool.may_eject_another());
        }
        let ejected = pool
            .members()
            .iter()
            .filter(|e| e.live.is_ejected())
            .count();
        assert_eq!(ejected, 2, "50% of 4");
        let one = self::pool(vec![spec(1, 1)], Balancing::RoundRobin);
        assert!(one.may_eject_another(), "one backend may always be ejected");
    }

    /// A pool of a backend with fresh metrics at `kv` and one alive without any, its balancer
    /// counting stale backends as `stale_as` says.
    fn pool_with_a_stale_backend(kv: f64, stale_as: StaleAs) -> Pool {
        let pool = Pool::new(PoolSettings {
            health: HealthPolicy {
                stale_as,
                ..HealthPolicy::default()
            },
            ..PoolSettings::new("p", vec!["m".into()], vec![spec(1, 1), spec(2, 1)])
        });
        for live in pool.members().iter().map(|e| &e.live) {
            live.record_probe(true, &pool.health);
        }
        pool.live_at(0).unwrap().publish_load(load(kv, 0.0));
        pool
    }

    #[test]
    fn pressure_leaves_stale_backends_to_the_reader() {
        for stale_as in [StaleAs::Saturated, StaleAs::Unknown] {
            // The pool's `stale_as` is the balancer's: the pressure is the same either way.
            let pressure = pool_with_a_stale_backend(0.5, stale_as).pressure();
            assert_eq!(pressure.kv_usage, Some(0.5), "fresh backends only");
            assert_eq!(
                (pressure.usable, pressure.measured, pressure.stale),
                (2, 1, 1)
            );
            assert_eq!(pressure.kv_capacity_tokens, Some(100_000.0));
            assert_eq!(
                pressure.kv_usage_counting_stale(StaleAs::Saturated),
                Some(0.75),
                "a stale backend counts as a full one of average size"
            );
            assert_eq!(
                pressure.kv_usage_counting_stale(StaleAs::Unknown),
                Some(0.5)
            );
        }

        // Every backend stale: nothing known, unless stale counts as full.
        let pool = pool_with_a_stale_backend(0.5, StaleAs::Saturated);
        pool.live_at(0).unwrap().publish_load(Load {
            scraped_at: std::time::Instant::now() - Duration::from_secs(60),
            ..load(0.5, 0.0)
        });
        let pressure = pool.pressure();
        assert_eq!((pressure.kv_usage, pressure.stale), (None, 2));
        assert_eq!(pressure.kv_capacity_tokens, None);
        assert_eq!(pressure.with_demand(1_000), None);
        assert_eq!(
            pressure.kv_usage_counting_stale(StaleAs::Saturated),
            Some(1.0)
        );
        assert_eq!(pressure.kv_usage_counting_stale(StaleAs::Unknown), None);
    }

    #[test]
    fn the_balancer_applies_the_pools_stale_as() {
        let demand = Demand {
            prompt_tokens: 10,
            output_tokens: 10,
            affinity: None,
            sequences: 1,
            session: None,
        };
        // Saturated: the stale backend looks full, so the fresh one, 60 % used, wins.
        let pool = pool_with_a_stale_backend(0.6, StaleAs::Saturated);
        for _ in 0..20 {
            assert_eq!(pool.select(&[], &demand).unwrap().addr.port(), 1);
        }
        // Unknown: it is balanced by what is in flight there (nothing), which beats 60 %.
        let pool = pool_with_a_stale_backend(0.6, StaleAs::Unknown);
        for _ in 0..20 {
            assert_eq!(pool.select(&[], &demand).unwrap().addr.port(), 2);
        }
    }

    /// Sheds above a fixed line, reading the pool's pressure on every call.
    struct Line(f64);

    impl Admission for Line {
        fn sheds(&self, pool: &Pool, _priority: Priority) -> bool {
            pool.pressure().kv_usage.is_some_and(|kv| kv >= self.0)
        }
        fn admits(&self, pool: &Pool, priority: Priority, _tokens: u64) -> bool {
            !self.sheds(pool, priority)
        }
    }

    #[test]
    fn admission_is_asked_of_the_pool_and_follows_its_load() {
        let pool = pool(vec![spec(1, 1)], Balancing::RoundRobin);
        pool.live_at(0).unwrap().publish_load(load(0.9, 0.0));
        assert!(pool.admits(Priority::Sheddable, 100), "no gate: everything");
        assert!(!pool.sheds(Priority::Sheddable));
        assert!(pool.install_admission(Arc::new(Line(0.8))));
        assert!(
            !pool.install_admission(Arc::new(Line(0.5))),
            "one gate only"
        );
        assert!(pool.sheds(Priority::Standard));
        assert!(!pool.admits(Priority::Standard, 100));
        pool.live_at(0).unwrap().publish_load(load(0.1, 0.0));
        assert!(!pool.sheds(Priority::Standard));
        assert!(pool.admits(Priority::Standard, 100));
        assert_eq!(Priority::parse(" Critical"), Some(Priority::Critical));
        assert_eq!(Priority::parse("vip"), None);
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
        let tiny = Timeouts {
            sized_by_max_tokens: Some(TokensPerSecond {
                min_tokens_per_second: 1e-300,
                margin: Duration::MAX,
            }),
            ..t
        };
        assert_eq!(tiny.total_for(Some(u32::MAX)), Duration::from_secs(100));
    }

    fn wanted(port: u16, ready: bool) -> Wanted {
        Wanted {
            spec: spec(port, 1),
            ready,
        }
    }

    #[test]
    fn a_joiner_gets_a_small_share_until_scraped_and_a_drainer_none() {
        for balancing in [
            Balancing::RoundRobin,
            Balancing::KvAware {
                prefix_affinity: None,
            },
            Balancing::Ttft(TtftBalancing::default()),
        ] {
            let pool = pool(vec![spec(1, 1)], balancing);
            pool.update(&[wanted(1, true), wanted(2, true)]);
            // The newcomer takes one request at a time while nothing is known of it...
            let mut held = Vec::new();
            for _ in 0..20 {
                let picked = pool.select(&[], &Demand::default()).unwrap();
                held.push(picked.live.begin(10));
            }
            let on_new = |pool: &Pool| {
                pool.members()
                    .find(spec(2, 1).resolved)
                    .unwrap()
                    .live
                    .in_flight()
            };
            assert_eq!(on_new(&pool), 1, "{:?}", pool.balancing);
            // ...but is not starved when it is all there is.
            let only = pool.select(&[spec(1, 1).resolved], &Demand::default());
            assert_eq!(only.unwrap().addr, spec(2, 1).resolved);
            // Scraped, it is balanced as any other.
            pool.members()
                .find(spec(2, 1).resolved)
                .unwrap()
                .live
                .publish_load(load(0.0, 0.0));
            assert!(pool.members().get(1).unwrap().warming_cap().is_none());
            drop(held);

            // Draining: no new request, even when it is the only backend left.
            pool.update(&[wanted(1, true), wanted(2, false)]);
            for _ in 0..10 {
                assert_eq!(pool.select(&[], &Demand::default()).unwrap().addr.port(), 1);
            }
            assert!(pool
                .select(&[spec(1, 1).resolved], &Demand::default())
                .is_none());
            assert_eq!(pool.pressure().usable, 1);
            // Nothing runs there: the next sweep lets it go.
            assert_eq!(pool.sweep(), vec![spec(2, 1).address]);
            assert_eq!(pool.members().len(), 1);
        }
    }

    #[test]
    fn a_session_and_a_prefix_home_survive_an_update_that_keeps_their_backend() {
        let mut settings = PoolSettings::new("p", vec!["m".into()], vec![spec(1, 1), spec(2, 1)]);
        settings.balancing = Balancing::KvAware {
            prefix_affinity: Some(64),
        };
        settings.sessions = Some(SessionAffinity {
            header: "x-session-id".into(),
            mode: SessionMode::Hard,
            idle_ttl: Duration::from_secs(60),
            capacity: 64,
        });
        let pool = Pool::new(settings);
        let session = Demand {
            session: Some(42),
            ..Demand::default()
        };
        let home = pool.select(&[], &session).unwrap().addr;
        // Two backends join (before it, in the list) and the other one leaves.
        let other = if home.port() == 1 { 2 } else { 1 };
        let mut next = vec![wanted(7, true), wanted(8, true), wanted(home.port(), true)];
        next.retain(|w| w.spec.resolved.port() != other);
        let change = pool.update(&next);
        assert_eq!(change.joined.len(), 2);
        assert_eq!(change.left, vec![spec(other, 1).address]);
        for _ in 0..10 {
            assert_eq!(pool.select(&[], &session).unwrap().addr, home);
        }
    }

    #[test]
    fn a_source_listing_too_many_endpoints_is_cut_at_the_limit() {
        let pool = pool(vec![], Balancing::RoundRobin);
        let many: Vec<Wanted> = (1..=5000).map(|p| wanted(p, true)).collect();
        let change = pool.update(&many);
        assert_eq!(change.over_limit, 5000 - crate::MAX_ENDPOINTS);
        assert_eq!(pool.members().len(), crate::MAX_ENDPOINTS);
        assert!(pool.select(&[], &Demand::default()).is_some());
    }
}
