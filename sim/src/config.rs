//! Configuration of one simulated vLLM instance: model, latency model, KV cache, wire flavours.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::faults::Faults;

/// Ready-made instance shapes. `Zero` is the default: no latency, large KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// meta-llama/Llama-3.1-8B-Instruct, 32768 context, zero latency, 1M KV blocks.
    #[default]
    Zero,
    /// meta-llama/Llama-3.2-1B-Instruct, 8192 context, fast, 2048 KV blocks.
    Draft,
    /// meta-llama/Llama-3.1-70B-Instruct, 32768 context, slower, 8192 KV blocks.
    Target,
}

/// Which generation of vLLM's Prometheus names to expose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsFlavor {
    /// vLLM V1 as of 0.32: `vllm:kv_cache_usage_perc`, 0.32's families, labels `engine` and
    /// `model_name`, `_created` series, exposition format 1.0.0.
    #[default]
    V1,
    /// vLLM V0 (~0.6): `vllm:gpu_cache_usage_perc`, label `model_name` only, no `_created`.
    V0,
}

/// Which vLLM generation's wire format to speak: its error bodies and messages, and (for
/// `V0_32`) its answers, chunks and stream layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorShape {
    /// vLLM 0.32 (the default): `New`'s body, with `param` naming the field at fault
    /// (`input_tokens`, `max_tokens`, `body.messages`), validation errors typed `"Bad
    /// Request"`; a prompt that fits but leaves less room than `max_tokens` is no longer
    /// refused: the answer stops at the context's end. Answers and chunks carry 0.32's fields
    /// (`system_fingerprint`, `token_ids`, `stop_reason` of EOS and stop strings...), and
    /// streams put the finish reason on the last token's chunk. See README.md.
    #[default]
    #[serde(rename = "0.32")]
    V0_32,
    /// vLLM 0.10.1 to 0.31 (answers as vLLM 0.11 sends them): errors are
    /// `{"error":{"message","type","param","code"}}`.
    New,
    /// vLLM < 0.10.1: `{"object":"error","message","type","param","code"}`.
    Old,
}

impl ErrorShape {
    /// Whether this is vLLM 0.32's format (the default).
    pub fn is_v0_32(self) -> bool {
        self == ErrorShape::V0_32
    }
}

/// Latency model: TTFT = overhead + prompt_tokens * prefill_per_token (+ time queued),
/// then one token every `inter_token`. Every delay is multiplied by a factor drawn uniformly
/// from [1 - jitter, 1 + jitter] and by the fault `slowdown`.
#[derive(Clone, Debug, PartialEq)]
pub struct Latency {
    pub overhead: Duration,
    pub prefill_per_token: Duration,
    pub inter_token: Duration,
    pub jitter: f64,
}

impl Latency {
    pub fn zero() -> Self {
        Latency {
            overhead: Duration::ZERO,
            prefill_per_token: Duration::ZERO,
            inter_token: Duration::ZERO,
            jitter: 0.0,
        }
    }

    pub fn new(overhead: Duration, prefill_per_token: Duration, inter_token: Duration) -> Self {
        Latency {
            overhead,
            prefill_per_token,
            inter_token,
            jitter: 0.0,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.overhead.is_zero() && self.prefill_per_token.is_zero() && self.inter_token.is_zero()
    }
}

impl Default for Latency {
    fn default() -> Self {
        Latency::zero()
    }
}

/// Speculative decoding as configured with vLLM's `--speculative-config`: only drives the
/// spec-decode counters on /metrics (k draft tokens per step, a share of them accepted).
#[derive(Clone, Debug, PartialEq)]
pub struct SpecDecode {
    pub num_speculative_tokens: u32,
    pub acceptance_rate: f64,
}

/// Everything about one instance. Public fields; setters return `Self` for chaining.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Address to bind; port 0 picks a free port (see `Sim::addr`).
    pub listen: SocketAddr,
    /// The model path (`root` in /v1/models).
    pub model: String,
    /// Names the server answers to (`--served-model-name`); empty means `[model]`.
    /// The first one is reported in answers, like vLLM.
    pub served_model_names: Vec<String>,
    /// Context length in tokens (`--max-model-len`): a prompt longer than it gets vLLM's 400
    /// (before 0.32, a prompt plus `max_tokens` over it). Every served name of this instance
    /// shares it.
    pub max_model_len: u32,
    /// Prompt bytes per token, as the served model's tokenizer makes them: 4 (English prose,
    /// the default), 2.5-3 for code, numbers and most other languages.
    pub bytes_per_token: f64,
    pub latency: Latency,
    pub num_gpu_blocks: u32,
    pub block_size: u32,
    /// Cap on the running batch; the rest wait in a FIFO queue.
    pub max_num_seqs: u32,
    /// Optional bound on the waiting queue (stock vLLM has none): over it, 503.
    pub max_waiting: Option<usize>,
    /// When the KV blocks would be oversubscribed, fail with a CUDA OOM 500 instead of waiting.
    pub oom_on_overload: bool,
    pub metrics: MetricsFlavor,
    pub error_shape: ErrorShape,
    pub speculative: Option<SpecDecode>,
    /// Share of prompts (chosen by prompt hash) that produce low-confidence logprobs.
    pub low_confidence_share: f64,
    /// Temperature used when a request does not give one (vLLM's default is 1.0).
    pub default_temperature: f64,
    /// Natural answer length range in tokens (chosen by hash), before `max_tokens` cuts it.
    pub min_answer_tokens: u32,
    pub max_answer_tokens: u32,
    /// How many received requests (with full bodies) `stats()` keeps; 0 disables recording.
    pub record_requests: usize,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Faults active from the start.
    pub faults: Faults,
    /// One prefill at a time per instance, as vLLM without chunked prefill runs them: a
    /// backlog of long prompts delays the next request's first token. Off by default, so
    /// prefills overlap and other tests keep their timing.
    pub serial_prefill: bool,
    /// vLLM's `--api-key`: every `/v1` request must carry `Authorization: Bearer <key>`, else
    /// 401 `{"error": "Unauthorized"}`, as vLLM answers. `/health` and `/metrics` stay open.
    pub api_key: Option<String>,
    /// A Hugging Face tokenizer folder (`--tokenizer`): prompts are tokenized and chat
    /// templates applied with it, so token counts, block hashes and KV events are what a real
    /// engine with that tokenizer makes. Without one, a prompt's tokens are made up from its
    /// bytes (about four a token, as counted above).
    pub tokenizer: Option<std::path::PathBuf>,
    /// Automatic prefix caching (`--enable-prefix-caching`, on by default in vLLM V1): see
    /// `prefix_cache.rs`. Off by default here, so that other tests keep their timing.
    pub prefix_caching: bool,
    /// Chunked prefill with this per-step token budget (`--max-num-batched-tokens`): see
    /// `prefill.rs`. Takes precedence over `serial_prefill`.
    pub max_num_batched_tokens: Option<u32>,
    /// With chunked prefill, the most tokens one prompt takes in a step while others wait
    /// (vLLM's `--long-prefill-token-threshold`). `None` or `Some(0)`: no cap, vLLM's
    /// default, so the prompts ahead in the queue take whole steps and a short one waits for
    /// them; a quarter of the budget lets a short prompt through beside a few long ones.
    pub long_prefill_token_threshold: Option<u32>,
    /// KV cache events (`--kv-events-config`): a ZMQ publisher, announced on
    /// `GET /kv_event_sources`. Needs `prefix_caching`.
    pub kv_events: Option<KvEventsConfig>,
    /// Disaggregated prefill on vLLM's `NixlConnector` wire (`--kv-transfer-config`): see
    /// `kv_transfer.rs`.
    pub kv_transfer: Option<crate::KvTransferConfig>,
    /// What `GET /kv_event_sources` answers instead of the publisher's config: a lying or
    /// broken backend, for the tests of what a backend can make a proxy connect to.
    pub kv_event_sources: Option<serde_json::Value>,
    /// `--enable-prompt-tokens-details`: answers' usage carries
    /// `prompt_tokens_details.cached_tokens` (else `null`, as vLLM's default).
    pub prompt_tokens_details: bool,
    /// LoRA adapters (`--enable-lora`): see `lora.rs`.
    pub lora: Option<LoraConfig>,
    /// Keep the Responses API's responses (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`), in
    /// this instance's memory: see `handlers/responses_api.rs`.
    pub responses_store: bool,
    /// What the model does (`--runner`): generate text, or, as an embedding model
    /// (`pooling`), answer `POST /v1/embeddings` and nothing that generates.
    pub runner: Runner,
    /// The length of an embedding model's vectors (all-MiniLM-L6-v2's 384 unless set).
    pub embedding_dimensions: u32,
    /// Answer by the prompt's words (lowercased letters and digits), not its bytes: a model
    /// that gives one question the same answer whatever its case, spacing and punctuation,
    /// as the semantic cache's tests need (see `openai::words_hash`).
    pub answers_by_words: bool,
}

/// vLLM's `--runner`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Runner {
    /// A generative model: completions, chat, messages, responses.
    #[default]
    Generate,
    /// An embedding model: `POST /v1/embeddings` (see `handlers/embeddings.rs`).
    Pooling,
}

/// vLLM's LoRA serving, as far as a router sees it: `--max-loras` (adapters one batch may
/// use, each in a GPU slot), the adapters `--lora-modules` loads at start, and how long
/// loading an adapter into a slot takes (not a vLLM flag: its cost on the GPU).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub max_loras: u32,
    pub modules: Vec<LoraModule>,
    pub load_time: Duration,
}

/// One `--lora-modules NAME=PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
}

impl LoraConfig {
    /// vLLM's default: one slot; no adapter yet.
    pub fn new(max_loras: u32) -> Self {
        LoraConfig {
            max_loras: max_loras.max(1),
            modules: Vec::new(),
            load_time: Duration::ZERO,
        }
    }

    /// Adds an adapter loaded at start.
    pub fn with_module(mut self, name: impl Into<String>, path: impl Into<String>) -> Self {
        self.modules.push(LoraModule {
            name: name.into(),
            path: path.into(),
        });
        self
    }

    pub fn with_load_time(mut self, load_time: Duration) -> Self {
        self.load_time = load_time;
        self
    }
}

/// vLLM's `KVEventsConfig`, as far as the simulator publishes: the ZMQ PUB socket's port
/// (0: a free one), the replay socket's (`None`: no replay), the topic, and how many batches
/// the replay keeps (`buffer_steps`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub port: u16,
    pub replay_port: Option<u16>,
    pub topic: String,
    pub buffer_steps: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            port: 0,
            replay_port: Some(0),
            topic: String::new(),
            buffer_steps: 10_000,
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig::profile(Profile::Zero)
    }
}

impl SimConfig {
    pub fn profile(profile: Profile) -> Self {
        let base = SimConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "meta-llama/Llama-3.1-8B-Instruct".to_string(),
            served_model_names: Vec::new(),
            max_model_len: 32768,
            bytes_per_token: 4.0,
            latency: Latency::zero(),
            num_gpu_blocks: 1_000_000,
            block_size: 16,
            max_num_seqs: 1024,
            max_waiting: None,
            oom_on_overload: false,
            metrics: MetricsFlavor::V1,
            error_shape: ErrorShape::V0_32,
            speculative: None,
            low_confidence_share: 0.0,
            default_temperature: 1.0,
            min_answer_tokens: 8,
            max_answer_tokens: 64,
            record_requests: 64,
            max_body_bytes: 64 << 20,
            faults: Faults::default(),
            serial_prefill: false,
            api_key: None,
            tokenizer: None,
            prefix_caching: false,
            max_num_batched_tokens: None,
            long_prefill_token_threshold: None,
            kv_events: None,
            kv_transfer: None,
            kv_event_sources: None,
            prompt_tokens_details: false,
            lora: None,
            responses_store: false,
            runner: Runner::Generate,
            embedding_dimensions: 384,
            answers_by_words: false,
        };
        match profile {
            Profile::Zero => base,
            Profile::Draft => SimConfig {
                model: "meta-llama/Llama-3.2-1B-Instruct".to_string(),
                max_model_len: 8192,
                latency: Latency {
                    overhead: Duration::from_millis(5),
                    prefill_per_token: Duration::from_micros(20),
                    inter_token: Duration::from_millis(5),
                    jitter: 0.1,
                },
                num_gpu_blocks: 2048,
                max_num_seqs: 64,
                ..base
            },
            Profile::Target => SimConfig {
                model: "meta-llama/Llama-3.1-70B-Instruct".to_string(),
                max_model_len: 32768,
                latency: Latency {
                    overhead: Duration::from_millis(20),
                    prefill_per_token: Duration::from_micros(200),
                    inter_token: Duration::from_millis(30),
                    jitter: 0.1,
                },
                num_gpu_blocks: 8192,
                max_num_seqs: 256,
                ..base
            },
        }
    }

    /// The names this instance answers to; the first is the one reported in answers.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_names.is_empty() {
            vec![self.model.clone()]
        } else {
            self.served_model_names.clone()
        }
    }

    pub fn with_listen(mut self, listen: SocketAddr) -> Self {
        self.listen = listen;
        self
    }
    pub fn with_port(mut self, port: u16) -> Self {
        self.listen.set_port(port);
        self
    }
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }
    pub fn with_served_model_names(mut self, names: Vec<String>) -> Self {
        self.served_model_names = names;
        self
    }
    pub fn with_bytes_per_token(mut self, bytes_per_token: f64) -> Self {
        self.bytes_per_token = bytes_per_token;
        self
    }
    pub fn with_max_model_len(mut self, len: u32) -> Self {
        self.max_model_len = len;
        self
    }
    pub fn with_latency(mut self, latency: Latency) -> Self {
        self.latency = latency;
        self
    }
    pub fn zero_latency(mut self) -> Self {
        self.latency = Latency::zero();
        self
    }
    pub fn with_kv(mut self, num_gpu_blocks: u32, block_size: u32) -> Self {
        self.num_gpu_blocks = num_gpu_blocks.max(1);
        self.block_size = block_size.max(1);
        self
    }
    pub fn with_max_num_seqs(mut self, max_num_seqs: u32) -> Self {
        self.max_num_seqs = max_num_seqs.max(1);
        self
    }
    pub fn with_max_waiting(mut self, max_waiting: Option<usize>) -> Self {
        self.max_waiting = max_waiting;
        self
    }
    pub fn with_oom(mut self, on: bool) -> Self {
        self.oom_on_overload = on;
        self
    }
    pub fn with_metrics(mut self, flavor: MetricsFlavor) -> Self {
        self.metrics = flavor;
        self
    }
    pub fn with_error_shape(mut self, shape: ErrorShape) -> Self {
        self.error_shape = shape;
        self
    }
    pub fn with_speculative(mut self, spec: Option<SpecDecode>) -> Self {
        self.speculative = spec;
        self
    }
    pub fn with_low_confidence_share(mut self, share: f64) -> Self {
        self.low_confidence_share = share.clamp(0.0, 1.0);
        self
    }
    pub fn with_answer_tokens(mut self, min: u32, max: u32) -> Self {
        self.min_answer_tokens = min.max(1);
        self.max_answer_tokens = max.max(self.min_answer_tokens);
        self
    }
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    pub fn with_record_requests(mut self, count: usize) -> Self {
        self.record_requests = count;
        self
    }
    /// One prefill at a time (see [`SimConfig::serial_prefill`]).
    pub fn with_serial_prefill(mut self, on: bool) -> Self {
        self.serial_prefill = on;
        self
    }

    /// The engine of vLLM V1 as the seeds run it: chunked prefill with `max_num_batched_tokens`
    /// per step, automatic prefix caching, `prompt_tokens_details` in usage.
    pub fn v1_engine(mut self, max_num_batched_tokens: u32) -> Self {
        self.max_num_batched_tokens = Some(max_num_batched_tokens.max(1));
        self.prefix_caching = true;
        self.prompt_tokens_details = true;
        self
    }
    /// The most tokens one prompt takes in a chunked-prefill step while others wait (see
    /// [`SimConfig::long_prefill_token_threshold`]); 0: none, as vLLM's default.
    pub fn with_long_prefill_token_threshold(mut self, tokens: u32) -> Self {
        self.long_prefill_token_threshold = Some(tokens);
        self
    }

    /// Tokenize with a Hugging Face tokenizer folder (see [`SimConfig::tokenizer`]).
    pub fn with_tokenizer(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.tokenizer = Some(dir.into());
        self
    }
    /// Publish KV cache events (turns prefix caching on).
    /// Serve both legs of disaggregated prefill (see [`SimConfig::kv_transfer`]).
    pub fn with_kv_transfer(mut self, transfer: crate::KvTransferConfig) -> Self {
        self.kv_transfer = Some(transfer);
        self
    }

    pub fn with_kv_events(mut self, events: KvEventsConfig) -> Self {
        self.prefix_caching = true;
        self.kv_events = Some(events);
        self
    }
    /// Answers `GET /kv_event_sources` with `sources`, whatever it publishes.
    pub fn with_kv_event_sources(mut self, sources: serde_json::Value) -> Self {
        self.kv_event_sources = Some(sources);
        self
    }
    /// Keeps the Responses API's responses (`VLLM_ENABLE_RESPONSES_API_STORE=1`).
    pub fn with_responses_store(mut self, store: bool) -> Self {
        self.responses_store = store;
        self
    }
    /// An embedding model (`--runner pooling`) whose vectors have `dimensions`.
    pub fn embedding_model(mut self, dimensions: u32) -> Self {
        self.runner = Runner::Pooling;
        self.embedding_dimensions = dimensions.max(1);
        self
    }

    /// Answers by the prompt's words (see [`SimConfig::answers_by_words`]).
    pub fn answering_by_words(mut self) -> Self {
        self.answers_by_words = true;
        self
    }

    /// Serves LoRA adapters (`--enable-lora`).
    pub fn with_lora(mut self, lora: LoraConfig) -> Self {
        self.lora = Some(lora);
        self
    }

    pub fn with_faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }
}
