//! vLLM's Prometheus metrics, rendered by hand exactly as prometheus_client writes them
//! (HELP/TYPE lines, sorted labels, `_total` on counters, `_created` gauges in V1, Go-style
//! float formatting).
//!
//! V1 is vLLM 0.32's set of families (`tests/fixtures/vllm-0.32/metric-names.txt`, less the
//! process, Python, HTTP, FLOPs and LoRA ones); V0 is vLLM ~0.6's. [`FlavorNames`] holds the
//! names and help texts that differ, and `render` adds the families only one generation has.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{MetricsFlavor, SimConfig, SpecDecode};
use crate::engine::EngineSnapshot;
use crate::openai::python_float;
use crate::text::Finish;

const V1_TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const V1_ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const V1_E2E: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const V0_TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
const V0_TPOT: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
const V0_E2E: &[f64] = &[1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0];
/// vLLM 0.32's tokens per engine step.
const V1_ITERATION_TOKENS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
const V1_PARAMS_N: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
const V1_PREEMPTIONS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];

/// vLLM's 1-2-5 buckets up to `max`: 1, 2, 5, 10, 20, 50, ... (token-count histograms go
/// up to the context length).
fn buckets_1_2_5(max: u32) -> Vec<f64> {
    let max = f64::from(max.max(1));
    let mut bounds = Vec::new();
    let mut exponent = 1.0;
    'outer: loop {
        for mantissa in [1.0, 2.0, 5.0] {
            let bound = mantissa * exponent;
            if bound > max {
                break 'outer;
            }
            bounds.push(bound);
        }
        exponent *= 10.0;
    }
    bounds
}

#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    bucket_counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Histogram {
            bounds: bounds.to_vec(),
            bucket_counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(bucket) = self.bounds.iter().position(|bound| value <= *bound) {
            if let Some(counter) = self.bucket_counts.get(bucket) {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }
}

#[derive(Debug)]
pub struct Metrics {
    flavor: MetricsFlavor,
    model_name: String,
    block_size: u32,
    num_gpu_blocks: u32,
    max_model_len: u32,
    speculative: Option<SpecDecode>,
    created: f64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens the prefix cache served.
    pub cached_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// `vllm:request_success_total` by finished_reason, in [`FINISHED_REASONS`] order.
    finished: [AtomicU64; 5],
    /// `vllm:admission_rejections_total{reason="max_num_queued_reqs"}`: the queue was full.
    rejected: AtomicU64,
    pub oom: AtomicU64,
    spec_drafts: AtomicU64,
    spec_draft_tokens: AtomicU64,
    spec_accepted: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Inter-token latency (V0: time per output token).
    pub itl: Histogram,
    /// End-to-end request latency.
    pub e2e: Histogram,
    /// Tokens per engine step (the prefill's, then each step's).
    pub iteration_tokens: Histogram,
    /// The per-request histograms of vLLM 0.32 (V1 only).
    requests: RequestHistograms,
}

/// vLLM 0.32's histograms of finished requests.
#[derive(Debug)]
struct RequestHistograms {
    prompt_tokens: Histogram,
    generation_tokens: Histogram,
    max_num_generation_tokens: Histogram,
    params_n: Histogram,
    params_max_tokens: Histogram,
    time_per_output_token: Histogram,
    queue_time: Histogram,
    inference_time: Histogram,
    prefill_time: Histogram,
    decode_time: Histogram,
    num_preemptions: Histogram,
    prefill_kv_computed_tokens: Histogram,
}

impl RequestHistograms {
    fn new(max_model_len: u32) -> Self {
        let tokens = buckets_1_2_5(max_model_len);
        RequestHistograms {
            prompt_tokens: Histogram::new(&tokens),
            generation_tokens: Histogram::new(&tokens),
            max_num_generation_tokens: Histogram::new(&tokens),
            params_n: Histogram::new(V1_PARAMS_N),
            params_max_tokens: Histogram::new(&tokens),
            time_per_output_token: Histogram::new(V1_ITL),
            queue_time: Histogram::new(V1_E2E),
            inference_time: Histogram::new(V1_E2E),
            prefill_time: Histogram::new(V1_E2E),
            decode_time: Histogram::new(V1_E2E),
            num_preemptions: Histogram::new(V1_PREEMPTIONS),
            prefill_kv_computed_tokens: Histogram::new(&tokens),
        }
    }

    fn observe(&self, request: &FinishedRequest) {
        let prompt_tokens = f64::from(request.prompt_tokens);
        self.prompt_tokens.observe(prompt_tokens);
        self.generation_tokens.observe(request.generated as f64);
        self.max_num_generation_tokens
            .observe(f64::from(request.max_tokens));
        self.params_n.observe(f64::from(request.choices));
        self.params_max_tokens
            .observe(f64::from(request.max_tokens));
        if let Some(time_per_output_token) = request.time_per_output_token {
            self.time_per_output_token.observe(time_per_output_token);
        }
        self.queue_time.observe(request.queued);
        self.inference_time
            .observe(request.prefill + request.decode);
        self.prefill_time.observe(request.prefill);
        self.decode_time.observe(request.decode);
        self.num_preemptions.observe(f64::from(request.preemptions));
        // What the prefix cache did not serve was computed.
        self.prefill_kv_computed_tokens
            .observe(prompt_tokens - f64::from(request.cached_tokens));
    }
}

/// What /metrics records of a request that finished (seconds for the times).
#[derive(Clone, Copy, Debug)]
pub struct FinishedRequest {
    pub prompt_tokens: u32,
    /// Tokens of every choice.
    pub generated: u64,
    pub choices: u32,
    /// The token budget it ran with.
    pub max_tokens: u32,
    pub e2e: f64,
    /// Waiting for a place in the batch.
    pub queued: f64,
    /// From its place in the batch to its first token.
    pub prefill: f64,
    /// From its first token to its last.
    pub decode: f64,
    /// The mean time between its tokens, when it had two or more.
    pub time_per_output_token: Option<f64>,
    pub preemptions: u32,
    /// Of its prompt, the tokens the prefix cache served.
    pub cached_tokens: u32,
}

const FINISHED_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];
/// V0 knew only the first three.
const V0_FINISHED_REASONS: usize = 3;

/// How a request ended, for `vllm:request_success_total{finished_reason}`.
#[derive(Clone, Copy, Debug)]
pub enum Ended {
    Finished(Finish),
    Abort,
    /// An error part-way through (an injected error event in a stream).
    Error,
}

/// The names and help texts that differ between vLLM generations.
struct FlavorNames {
    running_help: &'static str,
    kv_usage: &'static str,
    kv_usage_help: &'static str,
    inter_token: &'static str,
    inter_token_help: &'static str,
    e2e_help: &'static str,
}

impl FlavorNames {
    fn of(flavor: MetricsFlavor) -> Self {
        match flavor {
            MetricsFlavor::V1 => FlavorNames {
                running_help: "Number of requests in model execution batches.",
                kv_usage: "vllm:kv_cache_usage_perc",
                kv_usage_help: "KV-cache usage. 1 means 100 percent usage.",
                inter_token: "vllm:inter_token_latency_seconds",
                inter_token_help: "Histogram of inter-token latency in seconds.",
                e2e_help: "Histogram of e2e request latency in seconds.",
            },
            MetricsFlavor::V0 => FlavorNames {
                running_help: "Number of requests currently running on GPU.",
                kv_usage: "vllm:gpu_cache_usage_perc",
                kv_usage_help: "GPU KV-cache usage. 1 means 100 percent usage.",
                inter_token: "vllm:time_per_output_token_seconds",
                inter_token_help: "Histogram of time per output token in seconds.",
                e2e_help: "Histogram of end to end request latency in seconds.",
            },
        }
    }
}

/// The speculative-decoding counters, read once per render.
struct SpecCounts {
    drafts: f64,
    draft_tokens: f64,
    accepted: f64,
}

impl Metrics {
    pub fn new(config: &SimConfig, model_name: String) -> Self {
        let flavor = config.metrics;
        let (ttft, itl, e2e) = match flavor {
            MetricsFlavor::V1 => (V1_TTFT, V1_ITL, V1_E2E),
            MetricsFlavor::V0 => (V0_TTFT, V0_TPOT, V0_E2E),
        };
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since_epoch| since_epoch.as_secs_f64())
            .unwrap_or(0.0);
        Metrics {
            flavor,
            model_name,
            block_size: config.block_size,
            num_gpu_blocks: config.num_gpu_blocks,
            max_model_len: config.max_model_len,
            speculative: config.speculative.clone(),
            created,
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Default::default(),
            rejected: AtomicU64::new(0),
            oom: AtomicU64::new(0),
            spec_drafts: AtomicU64::new(0),
            spec_draft_tokens: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            ttft: Histogram::new(ttft),
            itl: Histogram::new(itl),
            e2e: Histogram::new(e2e),
            iteration_tokens: Histogram::new(V1_ITERATION_TOKENS),
            requests: RequestHistograms::new(config.max_model_len),
        }
    }

    /// A request was refused because the waiting queue was full.
    pub fn admission_rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// A request ended after generating `generated` tokens; `finished` is what a request that
    /// ran to its end records in the latency and per-request histograms.
    pub fn ended(&self, how: Ended, generated: u64, finished: Option<&FinishedRequest>) {
        let reason = match how {
            Ended::Finished(Finish::Stop) => 0,
            Ended::Finished(Finish::Length) => 1,
            Ended::Abort => 2,
            Ended::Error => 3,
        };
        if let Some(counter) = self.finished.get(reason) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(request) = finished {
            self.e2e.observe(request.e2e);
            self.requests.observe(request);
        }
        if let Some(spec) = &self.speculative {
            // Each step proposes k draft tokens; accepted ones plus the bonus token are emitted.
            let per_draft = u64::from(spec.num_speculative_tokens.max(1));
            let rate = spec.acceptance_rate.clamp(0.0, 1.0);
            let tokens_per_step = 1.0 + per_draft as f64 * rate;
            let drafts = (generated as f64 / tokens_per_step).ceil() as u64;
            let draft_tokens = drafts * per_draft;
            let accepted = ((draft_tokens as f64) * rate).round() as u64;
            self.spec_drafts.fetch_add(drafts, Ordering::Relaxed);
            self.spec_draft_tokens
                .fetch_add(draft_tokens, Ordering::Relaxed);
            self.spec_accepted.fetch_add(accepted, Ordering::Relaxed);
        }
    }

    /// The whole exposition, families in the order vLLM registers them.
    pub fn render(&self, engine: &EngineSnapshot, lora: Option<&LoraInfo>) -> String {
        let v1 = self.flavor == MetricsFlavor::V1;
        let names = FlavorNames::of(self.flavor);
        let spec = self.speculative.as_ref().map(|_| SpecCounts {
            drafts: load(&self.spec_drafts),
            draft_tokens: load(&self.spec_draft_tokens),
            accepted: load(&self.spec_accepted),
        });
        let mut out = Renderer::new(v1, &self.model_name, self.created);
        if let (true, Some(spec)) = (v1, &spec) {
            render_spec_counters_v1(&mut out, spec);
        }
        render_scheduler(&mut out, &names, engine);
        if v1 {
            self.render_caches(&mut out);
        }
        if let (false, Some(spec)) = (v1, &spec) {
            self.render_spec_gauges_v0(&mut out, spec);
        }
        out.counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            engine.preemptions as f64,
        );
        self.render_token_counters(&mut out);
        if let (false, Some(spec)) = (v1, &spec) {
            render_spec_counters_v0(&mut out, spec);
        }
        self.render_finished(&mut out);
        if v1 {
            self.render_request_histograms(&mut out);
        }
        self.render_latencies(&mut out, &names);
        if v1 {
            self.render_phase_histograms(&mut out);
        }
        out.counter(
            "sim_oom",
            "Requests failed with a simulated CUDA out-of-memory error.",
            load(&self.oom),
        );
        if let (true, Some(lora)) = (v1, lora) {
            render_lora(&mut out, lora);
        }
        self.render_cache_info(&mut out);
        out.text
    }

    /// vLLM 0.32's cache counters: every prompt token is a prefix-cache query, the tokens the
    /// prefix cache served are its hits (none without prefix caching), and there is no
    /// external or multi-modal cache.
    fn render_caches(&self, out: &mut Renderer) {
        let queried = load(&self.prompt_tokens);
        let hits = load(&self.cached_tokens);
        for (name, help, value) in [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                queried,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                hits,
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
                0.0,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
                0.0,
            ),
            (
                "vllm:mm_cache_queries",
                "Multi-modal cache queries, in terms of number of queried items.",
                0.0,
            ),
            (
                "vllm:mm_cache_hits",
                "Multi-modal cache hits, in terms of number of cached items.",
                0.0,
            ),
        ] {
            out.counter(name, help, value);
        }
    }

    /// vLLM 0.32's per-request histograms that come before the latencies.
    fn render_request_histograms(&self, out: &mut Renderer) {
        let requests = &self.requests;
        out.histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &requests.prompt_tokens,
        );
        out.histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &requests.generation_tokens,
        );
        out.histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &self.iteration_tokens,
        );
        out.histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            &requests.max_num_generation_tokens,
        );
        out.histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            &requests.params_n,
        );
        out.histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            &requests.params_max_tokens,
        );
    }

    /// vLLM 0.32's per-request histograms that come after the latencies.
    fn render_phase_histograms(&self, out: &mut Renderer) {
        let requests = &self.requests;
        for (name, help, histogram) in [
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                &requests.queue_time,
            ),
            (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                &requests.inference_time,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                &requests.prefill_time,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                &requests.decode_time,
            ),
            (
                "vllm:request_num_preemptions",
                "Histogram of the number of times a request was preempted.",
                &requests.num_preemptions,
            ),
            (
                "vllm:request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                &requests.prefill_kv_computed_tokens,
            ),
        ] {
            out.histogram(name, help, histogram);
        }
    }

    fn render_token_counters(&self, out: &mut Renderer) {
        let prompt_tokens = load(&self.prompt_tokens);
        let cached = load(&self.cached_tokens);
        out.counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            prompt_tokens,
        );
        if out.v1 {
            out.labeled_counter(
                "vllm:prompt_tokens_by_source",
                "Number of prompt tokens by source.",
                "source",
                &[
                    ("local_compute", prompt_tokens - cached),
                    ("local_cache_hit", cached),
                    ("external_kv_transfer", 0.0),
                ],
                true,
            );
            out.counter(
                "vllm:prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                cached,
            );
            out.labeled_counter(
                "vllm:prompt_tokens_cached_by_source",
                "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
                "source",
                &[
                    ("device", cached),
                    ("host", 0.0),
                    ("p2p", 0.0),
                    ("disk", 0.0),
                    ("external_unspecified", 0.0),
                ],
                true,
            );
        }
        out.counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            load(&self.generation_tokens),
        );
    }

    fn render_spec_gauges_v0(&self, out: &mut Renderer, spec: &SpecCounts) {
        let rate = if spec.draft_tokens > 0.0 {
            spec.accepted / spec.draft_tokens
        } else {
            0.0
        };
        out.gauge(
            "vllm:spec_decode_draft_acceptance_rate",
            "Speulative token acceptance rate.",
            rate,
        );
        let per_draft = self.speculative.as_ref().map_or(1.0, |config| {
            f64::from(config.num_speculative_tokens.max(1))
        });
        let emitted = spec.accepted + spec.drafts;
        let efficiency = if spec.drafts > 0.0 {
            emitted / (spec.drafts * (per_draft + 1.0))
        } else {
            0.0
        };
        out.gauge(
            "vllm:spec_decode_efficiency",
            "Speculative decoding system efficiency.",
            efficiency,
        );
    }

    fn render_finished(&self, out: &mut Renderer) {
        let known = if out.v1 {
            FINISHED_REASONS.len()
        } else {
            V0_FINISHED_REASONS
        };
        let counts: Vec<(&str, f64)> = FINISHED_REASONS
            .iter()
            .zip(&self.finished)
            .take(known)
            .map(|(reason, counter)| (*reason, load(counter)))
            .collect();
        out.labeled_counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            &counts,
            true,
        );
        if out.v1 {
            // vLLM labels these with the model only, not the engine.
            out.labeled_counter(
                "vllm:admission_rejections",
                "Number of admission attempts rejected by a queue limit, by reason.",
                "reason",
                &[
                    ("max_num_queued_reqs", load(&self.rejected)),
                    ("max_num_queued_tokens", 0.0),
                ],
                false,
            );
        }
    }

    fn render_latencies(&self, out: &mut Renderer, names: &FlavorNames) {
        out.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &self.ttft,
        );
        out.histogram(names.inter_token, names.inter_token_help, &self.itl);
        if out.v1 {
            out.histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                &self.requests.time_per_output_token,
            );
        }
        out.histogram(
            "vllm:e2e_request_latency_seconds",
            names.e2e_help,
            &self.e2e,
        );
    }

    fn render_cache_info(&self, out: &mut Renderer) {
        let block_size = self.block_size;
        let num_gpu_blocks = self.num_gpu_blocks;
        // The label sets differ: V1 has `engine`, and the two print their defaults differently.
        let (help, labels) = if out.v1 {
            // vLLM 0.32's labels (sorted), with this instance's sizes.
            let tokens = u64::from(block_size) * u64::from(num_gpu_blocks);
            let concurrency = python_float(tokens as f64 / f64::from(self.max_model_len.max(1)));
            (
                "Information of the LLMEngine CacheConfig",
                format!("_block_size_resolved=\"True\",block_size=\"{block_size}\",cache_dtype=\"auto\",cache_hit_alignment_tokens=\"None\",effective_attention_block_size=\"{block_size}\",enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",hash_block_size=\"None\",is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"None\",kv_cache_max_concurrency=\"{concurrency}\",kv_cache_memory_bytes=\"None\",kv_cache_size_tokens=\"{tokens}\",kv_offloading_backend=\"native\",kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"auto\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{num_gpu_blocks}\",num_gpu_blocks_override=\"None\",prefix_cache_retention_interval=\"0\",prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",replayssm_buffer_len=\"16\",skip_page_size_padded=\"None\",sliding_window=\"None\",swa_bounded_replay=\"True\",use_kda_recoverssm=\"False\",use_replayssm=\"False\",user_specified_block_size=\"False\""),
            )
        } else {
            (
                "information of cache_config",
                format!("block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"False\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"2048\",num_gpu_blocks=\"{num_gpu_blocks}\",swap_space=\"4\""),
            )
        };
        out.header("vllm:cache_config_info", help, "gauge");
        out.sample("vllm:cache_config_info", &labels, 1.0);
    }
}

/// `vllm:lora_requests_info`, as vLLM 0.32 sets it: `max_lora`, and the adapters with requests
/// in the engine (the same names as running and as waiting), each label set seen with the time
/// it was last set.
pub struct LoraInfo {
    pub max_lora: u32,
    pub samples: Vec<(String, f64)>,
}

fn render_lora(out: &mut Renderer, lora: &LoraInfo) {
    let name = "vllm:lora_requests_info";
    out.header(name, "Running stats on lora requests.", "gauge");
    for (adapters, set_at) in &lora.samples {
        let adapters = escape(adapters);
        let labels = format!(
            "max_lora=\"{}\",running_lora_adapters=\"{adapters}\",waiting_lora_adapters=\"{adapters}\"",
            lora.max_lora
        );
        out.sample(name, &labels, *set_at);
    }
}

/// Running and waiting requests and the KV-cache usage (V0 adds its swap and CPU families).
fn render_scheduler(out: &mut Renderer, names: &FlavorNames, engine: &EngineSnapshot) {
    out.gauge(
        "vllm:num_requests_running",
        names.running_help,
        f64::from(engine.running),
    );
    if !out.v1 {
        out.gauge(
            "vllm:num_requests_swapped",
            "Number of requests swapped to CPU.",
            0.0,
        );
    }
    out.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        f64::from(engine.waiting),
    );
    if out.v1 {
        // Every waiting request waits for capacity: nothing defers one in the simulator.
        out.labeled_gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason",
            &[("capacity", f64::from(engine.waiting)), ("deferred", 0.0)],
        );
        out.labeled_gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "sleep_state",
            &[("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)],
        );
    }
    out.gauge(names.kv_usage, names.kv_usage_help, engine.kv_usage());
    if !out.v1 {
        out.gauge(
            "vllm:cpu_cache_usage_perc",
            "CPU KV-cache usage. 1 means 100 percent usage.",
            0.0,
        );
    }
}

fn render_spec_counters_v1(out: &mut Renderer, spec: &SpecCounts) {
    out.counter(
        "vllm:spec_decode_num_drafts",
        "Number of spec decoding drafts.",
        spec.drafts,
    );
    out.counter(
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        spec.draft_tokens,
    );
    out.counter(
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        spec.accepted,
    );
}

fn render_spec_counters_v0(out: &mut Renderer, spec: &SpecCounts) {
    out.counter(
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        spec.accepted,
    );
    out.counter(
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        spec.draft_tokens,
    );
    out.counter(
        "vllm:spec_decode_num_emitted_tokens",
        "Number of emitted tokens.",
        spec.accepted + spec.drafts,
    );
}

fn load(counter: &AtomicU64) -> f64 {
    counter.load(Ordering::Relaxed) as f64
}

/// Writes families in prometheus_client's format, with the instance's labels.
struct Renderer {
    text: String,
    v1: bool,
    model: String,
    created: f64,
}

impl Renderer {
    fn new(v1: bool, model_name: &str, created: f64) -> Self {
        Renderer {
            text: String::with_capacity(16 * 1024),
            v1,
            model: escape(model_name),
            created,
        }
    }

    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// The instance labels plus `extra`, sorted by name like the fixtures.
    fn labels(&self, extra: &[(&str, &str)]) -> String {
        self.labels_with(extra, true)
    }

    /// As `labels`, with the `engine` label (V1) only when `engine`.
    fn labels_with(&self, extra: &[(&str, &str)], engine: bool) -> String {
        let mut all: Vec<(&str, &str)> = vec![("model_name", self.model.as_str())];
        if self.v1 && engine {
            all.push(("engine", "0"));
        }
        all.extend_from_slice(extra);
        all.sort_by(|left, right| left.0.cmp(right.0));
        let pairs: Vec<String> = all
            .iter()
            .map(|(label, value)| format!("{label}=\"{value}\""))
            .collect();
        pairs.join(",")
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.text, "{name}{{{labels}}} {}", go_float(value));
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, help, "gauge");
        let labels = self.labels(&[]);
        self.sample(name, &labels, value);
    }

    /// A gauge with one sample per value of `label`.
    fn labeled_gauge(&mut self, name: &str, help: &str, label: &str, values: &[(&str, f64)]) {
        self.header(name, help, "gauge");
        for (label_value, value) in values {
            let labels = self.labels(&[(label, label_value)]);
            self.sample(name, &labels, *value);
        }
    }

    /// A counter with one sample per value of `label`, then its `_created` family (V1).
    fn labeled_counter(
        &mut self,
        base: &str,
        help: &str,
        label: &str,
        values: &[(&str, f64)],
        engine: bool,
    ) {
        let total = format!("{base}_total");
        self.header(&total, help, "counter");
        for (label_value, value) in values {
            let labels = self.labels_with(&[(label, label_value)], engine);
            self.sample(&total, &labels, *value);
        }
        if self.v1 {
            let created = format!("{base}_created");
            self.header(&created, help, "gauge");
            for (label_value, _) in values {
                let labels = self.labels_with(&[(label, label_value)], engine);
                let timestamp = self.created;
                self.sample(&created, &labels, timestamp);
            }
        }
    }

    fn counter(&mut self, base: &str, help: &str, value: f64) {
        let total = format!("{base}_total");
        self.header(&total, help, "counter");
        let labels = self.labels(&[]);
        self.sample(&total, &labels, value);
        self.created_family(base, help);
    }

    fn created_family(&mut self, base: &str, help: &str) {
        if self.v1 {
            let created = format!("{base}_created");
            self.header(&created, help, "gauge");
            let labels = self.labels(&[]);
            let timestamp = self.created;
            self.sample(&created, &labels, timestamp);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (bound, counter) in histogram.bounds.iter().zip(&histogram.bucket_counts) {
            cumulative += counter.load(Ordering::Relaxed);
            let labels = self.labels(&[("le", &go_float(*bound))]);
            self.sample(&bucket, &labels, cumulative as f64);
        }
        let count = histogram.count.load(Ordering::Relaxed);
        let labels = self.labels(&[("le", "+Inf")]);
        self.sample(&bucket, &labels, count as f64);
        let labels = self.labels(&[]);
        self.sample(&format!("{name}_count"), &labels, count as f64);
        let sum = f64::from_bits(histogram.sum_bits.load(Ordering::Relaxed));
        self.sample(&format!("{name}_sum"), &labels, sum);
        self.created_family(name, help);
    }
}

fn escape(label_value: &str) -> String {
    label_value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// prometheus_client's floatToGoString: Python repr, with an exponent once there are more
/// than 6 digits before the point (2412903.0 -> 2.412903e+06).
pub fn go_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value == f64::INFINITY {
        return "+Inf".into();
    }
    if value == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    let repr = if value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{value:.1}")
    } else {
        format!("{value:?}")
    };
    if value > 0.0 && !repr.contains('e') {
        if let Some((whole, fraction)) = repr.split_once('.') {
            // ASCII digits only, so splitting off the first character is safe.
            let (first, rest) = whole.split_at(1.min(whole.len()));
            if whole.len() > 6 {
                let mantissa = format!("{first}.{rest}{fraction}");
                let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
                return format!("{mantissa}e+0{}", whole.len() - 1);
            }
        }
    }
    repr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_float_matches_prometheus_client() {
        assert_eq!(go_float(48.0), "48.0");
        assert_eq!(go_float(0.2346), "0.2346");
        assert_eq!(go_float(2412903.0), "2.412903e+06");
        assert_eq!(go_float(1048576.0), "1.048576e+06");
        assert_eq!(go_float(9134512.0), "9.134512e+06");
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(802114.0), "802114.0");
    }
}
