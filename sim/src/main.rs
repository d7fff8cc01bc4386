//! `vllm-sim` binary: one simulated vLLM instance on a port.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use vllm_sim::{ErrorShape, Faults, MetricsFlavor, Profile, SimConfig, SpecDecode};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ProfileArg {
    Zero,
    Draft,
    Target,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum MetricsArg {
    V1,
    V0,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ShapeArg {
    #[value(name = "0.32")]
    V0_32,
    New,
    Old,
}

/// A simulated vLLM OpenAI-compatible server.
#[derive(Parser, Debug)]
#[command(name = "vllm-sim", version)]
struct Args {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 = any free port; the bound address is logged).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Separate port for /sim/* and /metrics that keeps answering while the main port refuses
    /// connections.
    #[arg(long)]
    admin_port: Option<u16>,
    #[arg(long, value_enum, default_value = "zero")]
    profile: ProfileArg,
    /// Model path (overrides the profile's).
    #[arg(long)]
    model: Option<String>,
    /// Names served (repeatable or comma-separated); the first is reported in answers.
    #[arg(long = "served-model-name", value_delimiter = ',')]
    served_model_name: Vec<String>,
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Prompt bytes per token of the simulated tokenizer (4: English prose).
    #[arg(long)]
    bytes_per_token: Option<f64>,
    /// Prometheus names: v1 (vLLM 0.32's families) or v0 (vLLM ~0.6's).
    #[arg(long, value_enum, default_value = "v1")]
    metrics: MetricsArg,
    /// The vLLM generation whose wire format to speak: 0.32 (answers, streams and errors as
    /// vLLM 0.32), new (0.10.1 to 0.31) or old (before 0.10.1).
    #[arg(long, value_enum, default_value = "0.32")]
    error_shape: ShapeArg,
    /// vLLM's `--api-key`: `/v1` requests must carry `Authorization: Bearer <key>`.
    #[arg(long)]
    api_key: Option<String>,
    /// No latency at all (overrides the profile's latency).
    #[arg(long)]
    zero_latency: bool,
    /// Fixed part of TTFT, milliseconds.
    #[arg(long)]
    overhead_ms: Option<f64>,
    /// Prefill time per prompt token, microseconds.
    #[arg(long)]
    prefill_us_per_token: Option<f64>,
    /// Inter-token latency, milliseconds.
    #[arg(long)]
    itl_ms: Option<f64>,
    /// Jitter fraction (0..1) applied to every delay.
    #[arg(long)]
    jitter: Option<f64>,
    #[arg(long)]
    num_gpu_blocks: Option<u32>,
    #[arg(long)]
    block_size: Option<u32>,
    #[arg(long)]
    max_num_seqs: Option<u32>,
    /// Bound on the waiting queue (default: unbounded, like vLLM).
    #[arg(long)]
    max_waiting: Option<usize>,
    /// Fail with a CUDA OOM 500 when KV blocks would be oversubscribed, instead of queueing.
    #[arg(long)]
    oom: bool,
    /// Speculative decoding: draft tokens per step (enables spec-decode metrics).
    #[arg(long)]
    spec_tokens: Option<u32>,
    /// Speculative decoding acceptance rate (0..1).
    #[arg(long, default_value_t = 0.7)]
    spec_acceptance: f64,
    /// Share of prompts giving low-confidence logprobs (0..1).
    #[arg(long)]
    low_confidence_share: Option<f64>,
    /// Answer by the prompt's words, whatever their case, spacing and punctuation.
    #[arg(long)]
    answers_by_words: bool,
    /// Temperature when a request gives none.
    #[arg(long)]
    default_temperature: Option<f64>,
    /// Requests kept for /sim/stats (0 disables recording, for benchmarks).
    #[arg(long)]
    record: Option<usize>,
    /// Initial faults as JSON (same shape as POST /sim/faults).
    #[arg(long)]
    faults: Option<String>,
    /// A Hugging Face tokenizer folder: tokenize and apply the chat template with it.
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// vLLM's automatic prefix caching.
    #[arg(long)]
    enable_prefix_caching: bool,
    /// Chunked prefill with this per-step token budget.
    #[arg(long)]
    max_num_batched_tokens: Option<u32>,
    /// With chunked prefill, the most tokens one prompt takes in a step while others wait;
    /// absent or 0: no cap (vLLM's default).
    #[arg(long)]
    long_prefill_token_threshold: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens` in answers.
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// vLLM's `--kv-events-config` JSON: `{"enable_kv_cache_events": true, "publisher":
    /// "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "",
    /// "buffer_steps": 10000}` (the host part is this instance's).
    #[arg(long)]
    kv_events_config: Option<String>,
    /// vLLM's `--kv-transfer-config` JSON, `NixlConnector` only: `{"kv_connector":
    /// "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
    /// "kv_connector_extra_config": {"kv_lease_duration": 30, "transfer_us_per_token": 1}}`.
    #[arg(long)]
    kv_transfer_config: Option<String>,
    /// Serve LoRA adapters.
    #[arg(long)]
    enable_lora: bool,
    /// Adapters one batch may use at once.
    #[arg(long, default_value_t = 1)]
    max_loras: u32,
    /// Accepted as vLLM takes it; the simulator has no weights.
    #[arg(long)]
    max_lora_rank: Option<u32>,
    /// Adapters loaded at start: `NAME=PATH`, or vLLM's JSON `{"name": ..., "path": ...}`.
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<String>,
    /// Time to load an adapter into a free slot (not a vLLM flag).
    #[arg(long, default_value_t = 0.0)]
    lora_load_time_ms: f64,
    /// Keep the Responses API's responses, as vLLM with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`.
    #[arg(long)]
    responses_store: bool,
    /// `generate` (the default) or `pooling`: an embedding model, which answers
    /// `POST /v1/embeddings` and nothing that generates.
    #[arg(long, default_value = "generate")]
    runner: String,
    /// An embedding model's vector length (not a vLLM flag: the model's own).
    #[arg(long, default_value_t = 384)]
    embedding_dimensions: u32,
}

/// The LoRA serving of `--enable-lora` and the flags beside it.
fn lora(args: &Args) -> Result<Option<vllm_sim::LoraConfig>, String> {
    if !args.enable_lora {
        return Ok(None);
    }
    let mut lora =
        vllm_sim::LoraConfig::new(args.max_loras).with_load_time(millis(args.lora_load_time_ms));
    for module in &args.lora_modules {
        let (name, path) = match serde_json::from_str::<serde_json::Value>(module) {
            Ok(json) => (
                json["name"].as_str().map(str::to_string),
                json["path"].as_str().map(str::to_string),
            ),
            Err(_) => match module.split_once('=') {
                Some((name, path)) => (Some(name.to_string()), Some(path.to_string())),
                None => (None, None),
            },
        };
        match (name, path) {
            (Some(name), Some(path)) => lora = lora.with_module(name, path),
            _ => {
                return Err(format!(
                    "--lora-modules: {module:?} is neither NAME=PATH nor JSON with name and path"
                ))
            }
        }
    }
    Ok(Some(lora))
}

/// The ports and topic of a `--kv-events-config`.
fn kv_events(json: &str) -> Result<Option<vllm_sim::KvEventsConfig>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|error| format!("--kv-events-config: {error}"))?;
    if value["enable_kv_cache_events"] != serde_json::Value::Bool(true) {
        return Ok(None);
    }
    let port = |field: &str| -> Result<Option<u16>, String> {
        match value[field].as_str() {
            None => Ok(None),
            Some(endpoint) => endpoint
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .map(Some)
                .ok_or_else(|| format!("--kv-events-config: {field} {endpoint:?} has no port")),
        }
    };
    let defaults = vllm_sim::KvEventsConfig::default();
    Ok(Some(vllm_sim::KvEventsConfig {
        port: port("endpoint")?.unwrap_or(5557),
        replay_port: port("replay_endpoint")?,
        topic: value["topic"].as_str().unwrap_or("").to_string(),
        buffer_steps: value["buffer_steps"]
            .as_u64()
            .map_or(defaults.buffer_steps, |n| n as usize),
    }))
}

/// Milliseconds as a `Duration`; negative or absurd values become zero.
fn millis(value: f64) -> Duration {
    Duration::try_from_secs_f64((value / 1000.0).max(0.0)).unwrap_or(Duration::ZERO)
}

/// The instance the arguments describe: the profile's, then each flag that was given.
fn config(args: &Args) -> Result<SimConfig, String> {
    let mut config = SimConfig::profile(match args.profile {
        ProfileArg::Zero => Profile::Zero,
        ProfileArg::Draft => Profile::Draft,
        ProfileArg::Target => Profile::Target,
    });
    config.listen = SocketAddr::new(args.host, args.port);
    if let Some(model) = &args.model {
        config.model = model.clone();
    }
    config.served_model_names = args.served_model_name.clone();
    if let Some(max_model_len) = args.max_model_len {
        config.max_model_len = max_model_len;
    }
    if let Some(bytes_per_token) = args.bytes_per_token {
        config.bytes_per_token = bytes_per_token;
    }
    config.metrics = match args.metrics {
        MetricsArg::V1 => MetricsFlavor::V1,
        MetricsArg::V0 => MetricsFlavor::V0,
    };
    config.error_shape = match args.error_shape {
        ShapeArg::V0_32 => ErrorShape::V0_32,
        ShapeArg::New => ErrorShape::New,
        ShapeArg::Old => ErrorShape::Old,
    };
    apply_latency(args, &mut config);
    apply_engine(args, &mut config);
    config.api_key.clone_from(&args.api_key);
    apply_answers(args, &mut config);
    config.tokenizer.clone_from(&args.tokenizer);
    config.prefix_caching = args.enable_prefix_caching;
    config.max_num_batched_tokens = args.max_num_batched_tokens;
    config.long_prefill_token_threshold = args.long_prefill_token_threshold;
    config.prompt_tokens_details = args.enable_prompt_tokens_details;
    if let Some(json) = &args.kv_events_config {
        config.kv_events = kv_events(json)?;
        if config.kv_events.is_some() {
            config.prefix_caching = true;
        }
    }
    if let Some(json) = &args.kv_transfer_config {
        let mut transfer = vllm_sim::KvTransferConfig::from_vllm_json(json)?;
        if transfer.connector == vllm_sim::KvConnector::Mooncake {
            // As vLLM: the bootstrap server's port from the environment, 8998 unless set.
            transfer.bootstrap_port = match std::env::var("VLLM_MOONCAKE_BOOTSTRAP_PORT") {
                Ok(port) => port
                    .parse()
                    .map_err(|e| format!("VLLM_MOONCAKE_BOOTSTRAP_PORT {port:?}: {e}"))?,
                Err(_) => 8998,
            };
        }
        config.kv_transfer = Some(transfer);
    }
    config.lora = lora(args)?;
    config.responses_store = args.responses_store;
    match args.runner.as_str() {
        "generate" | "auto" => {}
        "pooling" => config = config.embedding_model(args.embedding_dimensions),
        other => return Err(format!("--runner {other:?}: `generate` or `pooling`")),
    }
    if let Some(faults) = &args.faults {
        config.faults =
            serde_json::from_str::<Faults>(faults).map_err(|error| format!("--faults: {error}"))?;
    }
    Ok(config)
}

fn apply_latency(args: &Args, config: &mut SimConfig) {
    if args.zero_latency {
        config.latency = vllm_sim::Latency::zero();
    }
    if let Some(overhead_ms) = args.overhead_ms {
        config.latency.overhead = millis(overhead_ms);
    }
    if let Some(prefill_us) = args.prefill_us_per_token {
        config.latency.prefill_per_token = millis(prefill_us / 1000.0);
    }
    if let Some(itl_ms) = args.itl_ms {
        config.latency.inter_token = millis(itl_ms);
    }
    if let Some(jitter) = args.jitter {
        config.latency.jitter = jitter.clamp(0.0, 1.0);
    }
}

/// The KV cache, the batch and the queue.
fn apply_engine(args: &Args, config: &mut SimConfig) {
    if let Some(num_gpu_blocks) = args.num_gpu_blocks {
        config.num_gpu_blocks = num_gpu_blocks.max(1);
    }
    if let Some(block_size) = args.block_size {
        config.block_size = block_size.max(1);
    }
    if let Some(max_num_seqs) = args.max_num_seqs {
        config.max_num_seqs = max_num_seqs.max(1);
    }
    config.max_waiting = args.max_waiting;
    config.oom_on_overload = args.oom;
}

fn apply_answers(args: &Args, config: &mut SimConfig) {
    if let Some(draft_tokens) = args.spec_tokens {
        config.speculative = Some(SpecDecode {
            num_speculative_tokens: draft_tokens,
            acceptance_rate: args.spec_acceptance.clamp(0.0, 1.0),
        });
    }
    config.answers_by_words = args.answers_by_words;
    if let Some(share) = args.low_confidence_share {
        config.low_confidence_share = share.clamp(0.0, 1.0);
    }
    if let Some(temperature) = args.default_temperature {
        config.default_temperature = temperature;
    }
    if let Some(count) = args.record {
        config.record_requests = count;
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let config = match config(&args) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("vllm-sim: {error}");
            return std::process::ExitCode::from(2);
        }
    };
    let sim = match vllm_sim::start(config).await {
        Ok(sim) => sim,
        Err(error) => {
            eprintln!(
                "vllm-sim: cannot listen on {}:{}: {error}",
                args.host, args.port
            );
            return std::process::ExitCode::from(1);
        }
    };
    if let Some(admin_port) = args.admin_port {
        match sim
            .serve_admin(SocketAddr::new(args.host, admin_port))
            .await
        {
            Ok(admin_addr) => {
                tracing::info!(%admin_addr, "admin endpoints (/sim/*, /metrics) listening")
            }
            Err(error) => {
                eprintln!("vllm-sim: cannot listen on admin port {admin_port}: {error}");
                return std::process::ExitCode::from(1);
            }
        }
    }
    // Print the bound address on stdout so scripts using --port 0 can find it.
    println!("vllm-sim listening on {}", sim.addr());
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("shutting down");
    sim.shutdown();
    std::process::ExitCode::SUCCESS
}
