//! `sluice-bench`: builds Sluice in release mode, runs every scenario, prints the Markdown
//! table and writes it to tests/bench/RESULTS.md. See README.md.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sluice_bench::{Options, SimMode, SimSpec};

#[derive(Parser, Debug)]
#[command(
    name = "sluice-bench",
    about = "Sluice against direct access and nginx"
)]
struct Args {
    /// A few seconds with tiny loads: checks the harness, the numbers mean nothing.
    #[arg(long)]
    smoke: bool,
    /// Run only this scenario (repeatable).
    #[arg(long = "scenario")]
    scenarios: Vec<u8>,
    /// Do not run `cargo build --release -p sluice -p vllm-sim --bins` first.
    #[arg(long)]
    no_build: bool,
    /// The sluice binary (default: target/release/sluice of this workspace).
    #[arg(long)]
    sluice: Option<PathBuf>,
    /// Where to write the Markdown (default: tests/bench/RESULTS.md; the smoke run and
    /// single scenarios write nothing unless given). While the run goes on, the report so far
    /// is in the same name with `.partial` added, removed at the end.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Scenario 23 (the soak) runs this many minutes instead of 30 (fractions allowed; also
    /// from the environment variable SLUICE_BENCH_SOAK_MINUTES).
    #[arg(long)]
    soak_minutes: Option<f64>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Runs the simulator in this process (used by the harness itself).
    #[command(hide = true)]
    SimServe {
        /// The address it listens on: several simulators share one port on different
        /// loopback addresses (scenario 22's fleet, whose DNS records carry addresses only),
        /// or one answers every address of 127.0.0.0/8 on `0.0.0.0`.
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        #[arg(long)]
        port: u16,
        #[command(flatten)]
        spec: SimSpec,
    },
    /// Runs the bare Pingora proxy (used by the harness itself).
    #[command(hide = true)]
    BarePingora {
        #[arg(long)]
        listen: std::net::SocketAddr,
        #[arg(long)]
        upstream: std::net::SocketAddr,
        /// Where its pid file and upgrade socket go.
        #[arg(long)]
        dir: PathBuf,
        /// The name of its pid file and upgrade socket in `dir`.
        #[arg(long, default_value = "bare-pingora")]
        name: String,
        /// Pingora's `threads`.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Pingora's `work_stealing: false`.
        #[arg(long)]
        no_work_stealing: bool,
        /// Pingora's `listener_tasks_per_fd`.
        #[arg(long, default_value_t = 1)]
        listener_tasks: usize,
    },
}

fn workspace() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"))
}

fn build() -> Result<()> {
    eprintln!("sluice-bench: cargo build --release -p sluice -p vllm-sim --bins");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "sluice",
            "-p",
            "vllm-sim",
            "--bins",
        ])
        .current_dir(workspace())
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build failed ({status})");
    }
    Ok(())
}

async fn sim_serve(host: std::net::IpAddr, port: u16, spec: SimSpec) -> Result<()> {
    let listen = std::net::SocketAddr::new(host, port);
    let sim = vllm_sim::start(spec.config(listen))
        .await
        .with_context(|| format!("starting the simulator on {listen}"))?;
    println!("vllm-sim listening on {}", sim.addr());
    tokio::signal::ctrl_c()
        .await
        .context("waiting for a signal")?;
    sim.shutdown();
    Ok(())
}

/// The soak's length from `--soak-minutes`, else from SLUICE_BENCH_SOAK_MINUTES; `None`:
/// the scenario's own (30 minutes, or the smoke run's seconds).
fn soak_length(flag: Option<f64>) -> Result<Option<std::time::Duration>> {
    const VAR: &str = "SLUICE_BENCH_SOAK_MINUTES";
    let minutes = match flag {
        Some(m) => m,
        None => match std::env::var(VAR) {
            Ok(v) if !v.trim().is_empty() => v
                .trim()
                .parse::<f64>()
                .with_context(|| format!("{VAR}={v:?} is not a number of minutes"))?,
            _ => return Ok(None),
        },
    };
    if !(minutes.is_finite() && minutes > 0.0 && minutes <= 24.0 * 60.0) {
        bail!("the soak's length must be more than 0 and at most a day, not {minutes} minutes");
    }
    Ok(Some(std::time::Duration::from_secs_f64(minutes * 60.0)))
}

fn main() -> Result<()> {
    let args = Args::parse();
    // Pingora starts its own runtimes, so the bare proxy runs outside tokio's.
    if let Some(Cmd::BarePingora {
        listen,
        upstream,
        dir,
        name,
        threads,
        no_work_stealing,
        listener_tasks,
    }) = &args.command
    {
        let knobs = sluice_bench::bare::Knobs {
            threads: *threads,
            work_stealing: !no_work_stealing,
            listener_tasks_per_fd: *listener_tasks,
        };
        return sluice_bench::bare::run(*listen, *upstream, dir, name, knobs);
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(harness(args))
}

async fn harness(args: Args) -> Result<()> {
    if let Some(Cmd::SimServe { host, port, spec }) = args.command {
        return sim_serve(host, port, spec).await;
    }
    // Checked before the build, which takes minutes.
    let soak = soak_length(args.soak_minutes)?;
    if !args.no_build && args.sluice.is_none() {
        build()?;
    }
    let sluice_bin = args
        .sluice
        .clone()
        .unwrap_or_else(|| target_dir().join("release/sluice"));
    let exe = std::env::current_exe().context("finding this executable")?;
    let out = args.out.clone().or_else(|| {
        (!args.smoke && args.scenarios.is_empty())
            .then(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/RESULTS.md")))
    });
    // The report so far, beside the file the run writes at its end.
    let progress = out.as_ref().map(|out| {
        let mut name = out.file_name().unwrap_or_default().to_os_string();
        name.push(".partial");
        out.with_file_name(name)
    });
    let opts = Options {
        sluice_bin,
        sim: SimMode::Process(exe),
        smoke: args.smoke,
        scenarios: args.scenarios.clone(),
        require_nginx: false,
        soak,
        progress: progress.clone(),
    };
    // Ctrl-C drops the run, and with it every process it started.
    let report = tokio::select! {
        r = sluice_bench::run(opts) => r?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    };
    let text = report.markdown();
    println!("{text}");
    if let Some(out) = out {
        std::fs::write(&out, &text).with_context(|| format!("writing {out:?}"))?;
        eprintln!("sluice-bench: wrote {}", out.display());
    }
    if let Some(progress) = progress {
        let _ = std::fs::remove_file(progress);
    }
    Ok(())
}
