//! Sluice's benchmark harness: Sluice against direct access and nginx, side by side in one run.
//!
//! [`run`] starts the simulator, Sluice (plugins off and on) and nginx as processes on free
//! ports, drives them with the in-process load generator ([`loadgen`], [`sse`]) in interleaved
//! rounds and returns a [`report::Report`]. [`smoke`] is the same with tiny loads, for CI.
//! See README.md.

pub mod abuse;
pub mod bare;
pub mod contenders;
pub mod cost_curves;
pub mod disaggregation;
pub mod discovery;
pub mod fleet;
pub mod fleet_scale;
pub mod flow_fairness;
pub mod h2_streams;
pub mod instructions;
pub mod loadgen;
pub mod own_clock;
pub mod phased;
pub mod plugin_cost;
pub mod prefix_fleet;
pub mod public;
pub(crate) mod reference_policy;
pub mod report;
pub mod resilience;
pub mod scale_from_zero;
pub mod scenarios;
pub mod semantic;
pub mod soak;
pub mod sse;
pub mod tenants;
pub mod trace_replay;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

pub use contenders::{Contender, SimMode, SimSpec};
pub use report::{Outcome, Report, ScenarioReport};

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// The `sluice` binary (a release build for real numbers).
    pub sluice_bin: PathBuf,
    pub sim: SimMode,
    /// A few seconds with small loads: checks that the harness works, measures nothing.
    pub smoke: bool,
    /// Scenario numbers to run; empty means all.
    pub scenarios: Vec<u8>,
    /// Fail when nginx is unavailable instead of reporting it as such.
    pub require_nginx: bool,
    /// Scenario 23's length instead of [`Params::soak`] (`--soak-minutes`).
    pub soak: Option<Duration>,
    /// Where the report so far is written after each scenario, so that a run stopped part
    /// way (a full run takes hours) keeps what it measured.
    pub progress: Option<PathBuf>,
}

/// How hard and how long each scenario pushes.
#[derive(Clone, Debug)]
pub struct Params {
    pub rounds: usize,
    pub warmup: Duration,
    /// Each contender's measured time per round (closed and open loop).
    pub duration: Duration,
    /// Connections of the throughput scenarios.
    pub conns: usize,
    /// Connections available to the open-loop generator.
    pub open_conns: usize,
    pub stream_concurrency: usize,
    pub stream_tokens: u32,
    pub stream_itl_ms: f64,
    pub stream_duration: Duration,
    pub open_streams: usize,
    pub open_stream_tokens: u32,
    pub open_stream_itl_ms: f64,
    pub open_stream_ramp: Duration,
    pub big_prompt_bytes: usize,
    pub big_conns: usize,
    /// Scenario 7: backends checked, and the idle time measured per round.
    pub health_backends: usize,
    pub health_idle: Duration,
    /// Scenario 8: the normal traffic's rate (requests/s, well under capacity).
    pub abuse_rate: f64,
    /// Scenario 8's attackers: stalled readers, slowloris connections, big-body connections.
    pub abuse_stalled: usize,
    pub abuse_slowloris: usize,
    pub abuse_bodies: usize,
    pub abuse_body_bytes: usize,
    /// A stalled reader's `max_tokens`, and the simulator's answer length for it.
    pub abuse_stream_tokens: u32,
    /// How long the attack runs before the normal traffic is measured under it.
    pub abuse_lead: Duration,
    /// Scenario 9: bodies in flight at once, each one's size, and how many each sends.
    pub memory_conns: usize,
    pub memory_body_bytes: usize,
    pub memory_repeats: usize,
    /// Scenario 10: backends of the pool (one is killed), the open-loop rate, how long it
    /// runs, when the kill comes, and the simulator's inter-token interval (16 tokens each).
    pub kill_backends: usize,
    pub kill_rate: f64,
    pub kill_duration: Duration,
    pub kill_at: Duration,
    pub kill_itl_ms: f64,
    /// Scenario 11: simulators, each one's KV blocks (16 tokens), the steady phase, the
    /// burst (3× the steady rate) and the steady phase after it.
    pub burst_backends: usize,
    pub burst_kv_blocks: u32,
    pub burst_itl_ms: f64,
    pub burst_steady: Duration,
    pub burst_len: Duration,
    pub burst_after: Duration,
    /// Scenario 13: how long each strategy's schedule runs, the arrival rate of first copies
    /// in its calm phases (3× in its bursts), the calm and burst phases' lengths, and a factor
    /// on every simulated latency (1 in the full run; the smoke run shrinks them).
    pub fleet_duration: Duration,
    pub fleet_rate: f64,
    pub fleet_calm: Duration,
    pub fleet_burst: Duration,
    pub fleet_time_scale: f64,
    /// Scenarios 13 and 25: how many schedules (seeds) each strategy replays, one a round.
    pub fleet_rounds: usize,
    /// Scenario 16: the rate search's first step (req/s), its doubling steps' cap, the
    /// bisections after the first failing step, each step's measured time, and connections.
    pub public_rate_start: f64,
    pub public_rate_max: f64,
    pub public_bisections: usize,
    pub public_step: Duration,
    pub public_conns: usize,
    /// How long memory is left to settle before the "after" RSS (scenarios 4 and 16).
    pub settle: Duration,
    /// Scenario 18: the fixed rate at which each plugin's cost is measured (req/s).
    pub plugin_rate: f64,
    /// Scenario 19: each prompt's size and the streams open at once.
    pub long_prompt_bytes: usize,
    pub long_prompt_concurrency: usize,
    /// Scenario 22: the open-loop rate, the simulators' inter-token interval (16 tokens each),
    /// when the fleet scales out, how long the four backends serve together after the new
    /// ones are ready, the pause between killing the drained backends and killing a pod
    /// still in DNS, and how long the load runs after that kill.
    pub discovery_rate: f64,
    pub discovery_itl_ms: f64,
    pub discovery_scale_out_at: Duration,
    pub discovery_hold: Duration,
    pub discovery_kill_after: Duration,
    pub discovery_tail: Duration,
    /// Scenario 22: the idle fleet's endpoints (one DNS name's A records, and the same as
    /// static backends), and the idle time measured per round.
    pub discovery_endpoints: usize,
    pub discovery_idle: Duration,
    /// Scenario 23: how long the soak runs (its first sixth is the warm-up), its open-loop
    /// rate (req/s), the stalled readers and slowloris connections of each abuse window (as
    /// many of each), and the size of the body its one big-body connection sends again and
    /// again.
    pub soak: Duration,
    pub soak_rate: f64,
    pub soak_attackers: usize,
    pub soak_body_bytes: usize,
    /// Scenario 24: how long sessions keep starting, and how many start.
    pub prefix_duration: Duration,
    pub prefix_sessions: usize,
    /// Scenario 24: each session cut to this many requests, its waits scaled by this.
    pub prefix_max_steps: usize,
    pub prefix_think_scale: f64,
    /// Scenario 27: the part of the trace replayed (zero: made-up lines, `trace_smoke_requests`
    /// of them), and how much faster.
    pub trace_window: Duration,
    pub trace_speedup: f64,
    /// Scenario 31: made-up question pairs and the simulator's embedding model (the smoke
    /// run), not STS-B and the real one.
    pub semantic_made_up: bool,
    /// Scenario 32: the prompt sizes measured (bytes) and the requests per size and contender
    /// in each round.
    pub curve_sizes: Vec<usize>,
    pub curve_requests: usize,
    /// Scenario 33: the fleet sizes (engines followed), the blocks their caches hold in all, and how long
    /// each measured window lasts.
    pub scale_engines: Vec<usize>,
    pub scale_blocks: usize,
    pub scale_window: Duration,
    /// Scenario 34: the requests counted per contender and round under callgrind.
    pub instr_requests: usize,
    pub trace_smoke_requests: usize,
    /// Scenario 28: when the pool's first backend joins, how long the requests keep coming
    /// after that, and at what rate (per second).
    pub zero_join_after: Duration,
    pub zero_after_join: Duration,
    pub zero_rate: f64,
    /// Scenario 29: how long each row runs, how many short sessions come in that time, and
    /// the numbers of long sessions swept.
    pub fair_window: Duration,
    pub fair_short_sessions: usize,
    pub fair_levels: Vec<usize>,
    /// Scenario 30: how many long requests each row sends, one every so often.
    pub pd_requests: usize,
    pub pd_every: Duration,
}

impl Params {
    pub fn full() -> Params {
        Params {
            rounds: 3,
            warmup: Duration::from_millis(500),
            duration: Duration::from_secs(4),
            conns: 32,
            open_conns: 64,
            stream_concurrency: 50,
            stream_tokens: 100,
            stream_itl_ms: 10.0,
            stream_duration: Duration::from_secs(4),
            open_streams: 1000,
            open_stream_tokens: 100,
            open_stream_itl_ms: 50.0,
            open_stream_ramp: Duration::from_secs(1),
            big_prompt_bytes: 1 << 20,
            big_conns: 8,
            health_backends: 50,
            health_idle: Duration::from_secs(5),
            abuse_rate: 1000.0,
            abuse_stalled: 50,
            abuse_slowloris: 50,
            abuse_bodies: 8,
            abuse_body_bytes: 8 << 20,
            abuse_stream_tokens: 50_000,
            abuse_lead: Duration::from_secs(1),
            memory_conns: 4,
            memory_body_bytes: 8 << 20,
            memory_repeats: 3,
            kill_backends: 3,
            kill_rate: 800.0,
            kill_duration: Duration::from_secs(6),
            kill_at: Duration::from_secs(2),
            kill_itl_ms: 1.0,
            burst_backends: 2,
            burst_kv_blocks: 600,
            burst_itl_ms: 25.0,
            burst_steady: Duration::from_secs(3),
            burst_len: Duration::from_secs(2),
            burst_after: Duration::from_secs(3),
            fleet_duration: Duration::from_secs(40),
            fleet_rate: 2.0,
            fleet_calm: Duration::from_secs(6),
            fleet_burst: Duration::from_secs(2),
            fleet_time_scale: 1.0,
            fleet_rounds: 3,
            public_rate_start: 250.0,
            public_rate_max: 32_000.0,
            public_bisections: 3,
            public_step: Duration::from_secs(2),
            public_conns: 512,
            settle: Duration::from_secs(2),
            plugin_rate: 1000.0,
            long_prompt_bytes: 220_000,
            long_prompt_concurrency: 150,
            discovery_rate: 300.0,
            discovery_itl_ms: 2.0,
            discovery_scale_out_at: Duration::from_secs(2),
            discovery_hold: Duration::from_secs(4),
            discovery_kill_after: Duration::from_secs(1),
            discovery_tail: Duration::from_secs(4),
            discovery_endpoints: 200,
            discovery_idle: Duration::from_secs(5),
            soak: Duration::from_secs(30 * 60),
            soak_rate: 60.0,
            soak_attackers: 20,
            soak_body_bytes: 8 << 20,
            prefix_duration: Duration::from_secs(75),
            prefix_sessions: 192,
            prefix_max_steps: usize::MAX,
            prefix_think_scale: 1.0,
            trace_window: Duration::from_secs(600),
            trace_speedup: 4.0,
            trace_smoke_requests: 0,
            semantic_made_up: false,
            curve_sizes: vec![1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20],
            curve_requests: 16,
            scale_engines: vec![50, 200],
            scale_blocks: 1_000_000,
            scale_window: Duration::from_secs(5),
            instr_requests: 200,
            zero_join_after: Duration::from_secs(20),
            zero_after_join: Duration::from_secs(10),
            zero_rate: 5.0,
            fair_window: Duration::from_secs(30),
            fair_short_sessions: 40,
            fair_levels: vec![4, 12, 24],
            pd_requests: 120,
            pd_every: Duration::from_millis(400),
        }
    }

    pub fn smoke() -> Params {
        Params {
            rounds: 1,
            warmup: Duration::from_millis(100),
            duration: Duration::from_millis(300),
            conns: 4,
            open_conns: 8,
            stream_concurrency: 4,
            stream_tokens: 10,
            stream_itl_ms: 10.0,
            stream_duration: Duration::from_millis(200),
            open_streams: 20,
            open_stream_tokens: 10,
            open_stream_itl_ms: 20.0,
            open_stream_ramp: Duration::from_millis(100),
            // A debug build's body work on two busy cores finished no 1 MiB prompt in the
            // 300 ms window: the smoke run checks that the scenario measures, not its size.
            big_prompt_bytes: 128 << 10,
            big_conns: 2,
            health_backends: 5,
            health_idle: Duration::from_secs(1),
            abuse_rate: 100.0,
            abuse_stalled: 3,
            abuse_slowloris: 3,
            abuse_bodies: 1,
            abuse_body_bytes: 256 << 10,
            abuse_stream_tokens: 5_000,
            abuse_lead: Duration::from_millis(200),
            memory_conns: 4,
            memory_body_bytes: 256 << 10,
            memory_repeats: 1,
            kill_backends: 3,
            kill_rate: 100.0,
            kill_duration: Duration::from_millis(1500),
            kill_at: Duration::from_millis(700),
            kill_itl_ms: 1.0,
            burst_backends: 2,
            burst_kv_blocks: 100,
            burst_itl_ms: 10.0,
            burst_steady: Duration::from_millis(700),
            burst_len: Duration::from_millis(300),
            burst_after: Duration::from_millis(500),
            fleet_duration: Duration::from_millis(1200),
            fleet_rate: 8.0,
            fleet_calm: Duration::from_millis(400),
            fleet_burst: Duration::from_millis(200),
            fleet_time_scale: 0.05,
            fleet_rounds: 1,
            public_rate_start: 50.0,
            public_rate_max: 100.0,
            public_bisections: 0,
            public_step: Duration::from_millis(300),
            public_conns: 16,
            settle: Duration::from_millis(100),
            plugin_rate: 50.0,
            long_prompt_bytes: 220_000,
            long_prompt_concurrency: 4,
            discovery_rate: 40.0,
            discovery_itl_ms: 2.0,
            discovery_scale_out_at: Duration::from_millis(500),
            discovery_hold: Duration::from_millis(500),
            discovery_kill_after: Duration::from_millis(200),
            discovery_tail: Duration::from_secs(1),
            discovery_endpoints: 20,
            discovery_idle: Duration::from_secs(1),
            soak: Duration::from_secs(20),
            soak_rate: 40.0,
            soak_attackers: 3,
            soak_body_bytes: 256 << 10,
            prefix_duration: Duration::from_secs(3),
            prefix_sessions: 8,
            prefix_max_steps: 3,
            prefix_think_scale: 0.1,
            trace_window: Duration::ZERO,
            trace_speedup: 1.0,
            trace_smoke_requests: 12,
            semantic_made_up: true,
            curve_sizes: vec![1 << 10, 16 << 10],
            curve_requests: 2,
            scale_engines: vec![4],
            scale_blocks: 8_000,
            scale_window: Duration::from_secs(1),
            instr_requests: 5,
            zero_join_after: Duration::from_secs(2),
            zero_after_join: Duration::from_secs(1),
            zero_rate: 5.0,
            fair_window: Duration::from_secs(5),
            fair_short_sessions: 4,
            fair_levels: vec![2],
            pd_requests: 6,
            pd_every: Duration::from_millis(400),
        }
    }
}

/// What every scenario shares: binaries, where processes live, nginx's availability, and
/// what earlier scenarios learned (nginx's maximum throughput).
pub struct Ctx {
    pub sluice_bin: PathBuf,
    pub sim: SimMode,
    /// The nginx binary, or why there is none.
    pub nginx: std::result::Result<PathBuf, String>,
    pub require_nginx: bool,
    pub p: Params,
    pub root: tempfile::TempDir,
    /// Scenario 1's median throughput per contender, for scenario 2's rate.
    pub max_rps: Vec<(Contender, f64)>,
}

/// The CI smoke run: every scenario for a few seconds, the simulator in-process, nginx
/// required; the report so far written to `progress` after each scenario.
pub async fn smoke(sluice_bin: PathBuf, progress: Option<PathBuf>) -> Result<Report> {
    run(Options {
        sluice_bin,
        sim: SimMode::InProcess,
        smoke: true,
        scenarios: Vec::new(),
        require_nginx: true,
        soak: None,
        progress,
    })
    .await
}

/// Runs the scenarios and returns the report; a scenario that fails is reported as failed and
/// the others still run.
pub async fn run(opts: Options) -> Result<Report> {
    let started = Instant::now();
    if !opts.sluice_bin.is_file() {
        anyhow::bail!("no sluice binary at {:?}", opts.sluice_bin);
    }
    let nginx = contenders::find_or_install_nginx().map_err(|e| format!("{e:#}"));
    if opts.require_nginx {
        if let Err(e) = &nginx {
            anyhow::bail!("nginx is required: {e}");
        }
    }
    let root = tempfile::Builder::new()
        .prefix("sluice-bench.")
        .tempdir()
        .context("creating the temporary directory")?;
    let mut p = if opts.smoke {
        Params::smoke()
    } else {
        Params::full()
    };
    if let Some(soak) = opts.soak {
        p.soak = soak;
    }
    let mut ctx = Ctx {
        sluice_bin: opts.sluice_bin.clone(),
        sim: opts.sim.clone(),
        nginx,
        require_nginx: opts.require_nginx,
        p,
        root,
        max_rps: Vec::new(),
    };
    let mut out = Vec::new();
    for (id, title) in scenarios::ALL {
        if !opts.scenarios.is_empty() && !opts.scenarios.contains(id) {
            continue;
        }
        eprintln!("sluice-bench: scenario {id}: {title}");
        let report = match scenarios::run(*id, &mut ctx).await {
            Ok(r) => r,
            Err(e) => {
                let mut r = ScenarioReport::new(*id, title);
                r.outcome = Outcome::Failed(format!("{e:#}"));
                r
            }
        };
        out.push(report);
        if let Some(path) = &opts.progress {
            let so_far = Report {
                smoke: opts.smoke,
                context: context(&ctx, &opts),
                scenarios: std::mem::take(&mut out),
                elapsed_secs: started.elapsed().as_secs_f64(),
            };
            if let Err(e) = std::fs::write(path, so_far.markdown()) {
                eprintln!("sluice-bench: cannot write the report so far to {path:?}: {e}");
            }
            out = so_far.scenarios;
        }
    }
    Ok(Report {
        smoke: opts.smoke,
        context: context(&ctx, &opts),
        scenarios: out,
        elapsed_secs: started.elapsed().as_secs_f64(),
    })
}

fn command_line(cmd: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(cmd).args(args).output().ok()?;
    let text = String::from_utf8_lossy(&o.stdout).trim().to_string();
    (o.status.success() && !text.is_empty()).then_some(text)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn context(ctx: &Ctx, opts: &Options) -> Vec<(String, String)> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let repo = repo.to_string_lossy();
    let git = command_line("git", &["-C", &repo, "describe", "--always", "--dirty"])
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let nginx = match &ctx.nginx {
        Ok(bin) => contenders::nginx_version(bin),
        Err(e) => format!("unavailable: {e}"),
    };
    let sim = match opts.sim {
        SimMode::Process(_) => "vllm-sim library in its own process (`sluice-bench sim-serve`)",
        SimMode::InProcess => "vllm-sim library in a thread of the harness",
    };
    vec![
        (
            "date".into(),
            command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default(),
        ),
        ("machine".into(), format!("{cores} cores, {}", cpu_model())),
        (
            "kernel".into(),
            command_line("uname", &["-sr"]).unwrap_or_default(),
        ),
        (
            "sluice".into(),
            format!(
                "git {git}, Pingora 0.9.1, `pingora.threads: 2`, `log.level: warn` (access log on, \
                 so below the level), binary {}",
                opts.sluice_bin.display()
            ),
        ),
        (
            "nginx".into(),
            format!(
                "{nginx}, 2 workers, upstream keepalive 64, proxy_buffering off, \
                 proxy_request_buffering off, access_log off"
            ),
        ),
        (
            "rustc".into(),
            command_line("rustc", &["-V"]).unwrap_or_else(|| "unknown".into()),
        ),
        ("simulator".into(), sim.into()),
        (
            "load generator".into(),
            "in-process (hyper 1 HTTP/1.1 client, tokio, hdrhistogram), sharing the 2 cores".into(),
        ),
    ]
}
