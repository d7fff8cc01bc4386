//! What a pool is built from (`pools[]` in the config, resolved): its timeouts, what its model
//! supports, its balancing strategy's settings, session affinity, and the rest. A
//! [`Pool`](super::Pool) keeps these as they were given, in its `settings`; what it learns at run time lives
//! beside them.

use crate::header_rules::{HeaderRules, UpstreamAuth};
use crate::health::{HealthPolicy, OutlierPolicy, DEFAULT_PREFILL_SPEED};
use crate::members::BackendSpec;
use crate::prefix::PrefixRouting;
use crate::retry::RetryPolicy;
use sluice_llm::model_name::ServedModel;
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
    /// The share of requests (0..=1) sent to a random usable backend with nothing ahead of
    /// them (no prefill of ours, no queue at the last scrape) instead of the best, so that
    /// every backend's speed keeps being learned.
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

/// Where a request may name its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionKey {
    /// A request header (its name in lower case).
    Header(String),
    /// A top-level body member the parse notes (one of `sluice_llm::request::SESSION_MEMBERS`),
    /// or with `inner`, a member of that object (`metadata.user_id`).
    Body {
        /// The top-level member.
        member: &'static str,
        /// Its member that names the session, when it is an object.
        inner: Option<String>,
    },
}

impl std::fmt::Display for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionKey::Header(name) => write!(f, "header:{name}"),
            SessionKey::Body {
                member,
                inner: None,
            } => write!(f, "body:{member}"),
            SessionKey::Body {
                member,
                inner: Some(inner),
            } => write!(f, "body:{member}.{inner}"),
        }
    }
}

/// Session affinity: requests naming the same session go to one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionAffinity {
    /// Where a session is named, in order: the first the request has names it.
    pub keys: Vec<SessionKey>,
    /// Soft or hard.
    pub mode: SessionMode,
    /// A session not seen for this long is forgotten.
    pub idle_ttl: Duration,
    /// The most sessions remembered at once; older ones are forgotten first when more come.
    pub capacity: usize,
}

/// How long a request waits for a pool with no usable backend to get one, by default: about
/// what a pod scaled from zero takes to start and load a small model.
pub const DEFAULT_NO_BACKEND_WAIT: Duration = Duration::from_secs(60);

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
    /// Where the backends come from, for `/status` and the logs: `static`, or the discovery
    /// source (`dns vllm.llm.svc:8000`, ...).
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
    /// How long a request waits for a usable backend when the pool has none (scaled to
    /// zero, warming up); zero: it fails at once.
    pub no_backend_wait: Duration,
    /// Fair order among the flows waiting in each class, and holding requests that an
    /// engine would queue; `None` (`fairness: off`): first come, first served, and nothing
    /// held for the engines.
    pub fairness: Option<super::Fairness>,
    /// This pool decodes, and long prompts are prefilled on another pool first
    /// (`prefill`); `None`: every request is served whole here.
    pub prefill: Option<super::PrefillRoute>,
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
            no_backend_wait: DEFAULT_NO_BACKEND_WAIT,
            fairness: Some(super::Fairness::default()),
            prefill: None,
        }
    }
}
