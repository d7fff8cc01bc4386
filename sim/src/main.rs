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
    #[arg(long, value_enum, default_value = "v1")]
    metrics: MetricsArg,
    #[arg(long, value_enum, default_value = "new")]
    error_shape: ShapeArg,
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
    /// Temperature when a request gives none.
    #[arg(long)]
    default_temperature: Option<f64>,
    /// Requests kept for /sim/stats (0 disables recording, for benchmarks).
    #[arg(long)]
    record: Option<usize>,
    /// Initial faults as JSON (same shape as POST /sim/faults).
    #[arg(long)]
    faults: Option<String>,
}

fn ms(v: f64) -> Duration {
    Duration::try_from_secs_f64((v / 1000.0).max(0.0)).unwrap_or(Duration::ZERO)
}

fn config(a: &Args) -> Result<SimConfig, String> {
    let mut c = SimConfig::profile(match a.profile {
        ProfileArg::Zero => Profile::Zero,
        ProfileArg::Draft => Profile::Draft,
        ProfileArg::Target => Profile::Target,
    });
    c.listen = SocketAddr::new(a.host, a.port);
    if let Some(m) = &a.model {
        c.model = m.clone();
    }
    c.served_model_names = a.served_model_name.clone();
    if let Some(v) = a.max_model_len {
        c.max_model_len = v;
    }
    c.metrics = match a.metrics {
        MetricsArg::V1 => MetricsFlavor::V1,
        MetricsArg::V0 => MetricsFlavor::V0,
    };
    c.error_shape = match a.error_shape {
        ShapeArg::New => ErrorShape::New,
        ShapeArg::Old => ErrorShape::Old,
    };
    if a.zero_latency {
        c.latency = vllm_sim::Latency::zero();
    }
    if let Some(v) = a.overhead_ms {
        c.latency.overhead = ms(v);
    }
    if let Some(v) = a.prefill_us_per_token {
        c.latency.prefill_per_token = ms(v / 1000.0);
    }
    if let Some(v) = a.itl_ms {
        c.latency.inter_token = ms(v);
    }
    if let Some(v) = a.jitter {
        c.latency.jitter = v.clamp(0.0, 1.0);
    }
    if let Some(v) = a.num_gpu_blocks {
        c.num_gpu_blocks = v.max(1);
    }
    if let Some(v) = a.block_size {
        c.block_size = v.max(1);
    }
    if let Some(v) = a.max_num_seqs {
        c.max_num_seqs = v.max(1);
    }
    c.max_waiting = a.max_waiting;
    c.oom_on_overload = a.oom;
    if let Some(k) = a.spec_tokens {
        c.speculative = Some(SpecDecode {
            num_speculative_tokens: k,
            acceptance_rate: a.spec_acceptance.clamp(0.0, 1.0),
        });
    }
    if let Some(v) = a.low_confidence_share {
        c.low_confidence_share = v.clamp(0.0, 1.0);
    }
    if let Some(v) = a.default_temperature {
        c.default_temperature = v;
    }
    if let Some(v) = a.record {
        c.record_requests = v;
    }
    if let Some(f) = &a.faults {
        c.faults = serde_json::from_str::<Faults>(f).map_err(|e| format!("--faults: {e}"))?;
    }
    Ok(c)
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
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let sim = match vllm_sim::start(cfg).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "vllm-sim: cannot listen on {}:{}: {e}",
                args.host, args.port
            );
            return std::process::ExitCode::from(1);
        }
    };
    if let Some(p) = args.admin_port {
        match sim.serve_admin(SocketAddr::new(args.host, p)).await {
            Ok(a) => tracing::info!(%a, "admin endpoints (/sim/*, /metrics) listening"),
            Err(e) => {
                eprintln!("vllm-sim: cannot listen on admin port {p}: {e}");
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
