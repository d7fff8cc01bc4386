//! Scenario 34 (issue #56, "verdicts that hold"): instructions per request, counted by
//! callgrind (valgrind's instruction counter) rather than timed. A count does not move with
//! the machine's load, its caches or its scheduler, so the cost targets (plugins off against
//! bare Pingora, plugins on against plugins off) get a verdict that a second run repeats.
//!
//! - Each contender runs under `valgrind --tool=callgrind` in front of the zero-latency
//!   simulator (not under valgrind), health checks at their defaults.
//! - Per round: the counters zeroed (`callgrind_control --zero`), `instr_requests` requests
//!   sent one at a time on one connection (non-stream chat, 16 tokens; plugins on gets a
//!   prompt of its own per request, so that its cache misses), the counters dumped; then the
//!   same wall time with no request, to take out what the process does when idle (its health
//!   checks, timers). Instructions per request = (the batch's − the idle window's) ÷ requests.
//! - Instruction counts are not time: a cache miss or a system call's kernel work is not in
//!   them (callgrind counts the process's own user-space instructions). They are the cost
//!   Sluice's code decides, measured exactly.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bare::Knobs;
use crate::contenders::{
    bare_pingora_command, free_addr, sluice_config, Contender, Proc, RunningSim, Setup, SimMode,
    SimSpec,
};
use crate::loadgen::send_one;
use crate::report::{pairwise, Check, Noise, ScenarioReport, Series};
use crate::scenarios::{chat_body, title, Up, CHAT};
use crate::Ctx;

const ID: u8 = 34;

/// How long a process under valgrind may take to start listening.
const START_WITHIN: Duration = Duration::from_secs(180);

/// One contender under callgrind.
struct Counted {
    contender: Contender,
    addr: SocketAddr,
    proc: Proc,
    /// Where its dumps go: `PREFIX.N` for the Nth.
    out: PathBuf,
}

/// 34. Instructions per request under callgrind.
pub async fn instructions(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    if Command::new("valgrind").arg("--version").output().is_err() {
        bail!("valgrind is not installed (scripts/bootstrap --test installs it)");
    }
    let p = ctx.p.clone();
    let dir = tempfile::Builder::new()
        .prefix("callgrind.")
        .tempdir_in(ctx.root.path())
        .context("the scenario's directory")?;
    let sim = RunningSim::start(&ctx.sim, &SimSpec::zero(), dir.path()).await?;
    let mut counted = Vec::new();
    if let SimMode::Process(exe) = &ctx.sim {
        let listen = free_addr()?;
        let (cmd, name) = bare_pingora_command(exe, dir.path(), listen, sim.addr, Knobs::default());
        counted.push(start(Contender::BarePingora, cmd, &name, dir.path(), &[listen]).await?);
    } else {
        report.notes.push(
            "pingora (bare) runs from the bench binary; this run has none (smoke test)."
                .to_string(),
        );
    }
    for (contender, setup) in [
        (Contender::SluiceOff, Setup::Off),
        (Contender::SluiceOn, Setup::On),
    ] {
        let name = setup.name();
        let (listen, admin) = (free_addr()?, free_addr()?);
        let config = dir.path().join(format!("{name}.yaml"));
        let yaml = sluice_config(dir.path(), name, listen, admin, sim.addr, &setup, None);
        std::fs::write(&config, yaml).with_context(|| format!("writing {config:?}"))?;
        let mut cmd = Command::new(&ctx.sluice_bin);
        cmd.arg("-c").arg(&config).env_remove("RUST_LOG");
        counted.push(start(contender, cmd, name, dir.path(), &[listen, admin]).await?);
    }

    let body = chat_body("Hello! Say something short.", false, 16);
    // Contender → instructions per request, one per round.
    let mut per_request: Vec<(Contender, Series)> = counted
        .iter()
        .map(|c| (c.contender, Series::default()))
        .collect();
    for _ in 0..p.rounds {
        for (c, (_, series)) in counted.iter().zip(per_request.iter_mut()) {
            let up = Up::plain(c.contender, c.addr, None);
            let target = crate::scenarios::target_for(&up, CHAT, &body);
            let mut conn = None;
            // A warm connection, and every lazy start-up done.
            for _ in 0..3 {
                send_one(&mut conn, &target).await?;
            }
            let pid = c.proc.pid().context("the contender's pid")?;
            control(pid, "--zero")?;
            let started = Instant::now();
            let mut errors = 0u64;
            for _ in 0..p.instr_requests {
                if send_one(&mut conn, &target).await.is_err() {
                    errors += 1;
                }
            }
            let took = started.elapsed();
            let batch = dump(pid, &c.out).await?;
            // The same time with nothing to do: the checks' and timers' share.
            control(pid, "--zero")?;
            tokio::time::sleep(took).await;
            let idle = dump(pid, &c.out).await?;
            report.measured(c.contender, p.instr_requests as u64 - errors, errors, None);
            let done = (p.instr_requests as u64 - errors).max(1) as f64;
            series.push(batch.saturating_sub(idle) as f64 / done);
        }
    }

    let of = |c: Contender| per_request.iter().find(|(x, _)| *x == c).map(|(_, s)| s);
    let ratio = |a: Contender, b: Contender| match (of(a), of(b)) {
        (Some(a), Some(b)) => pairwise(a, b, |a, b| a / b),
        _ => Series::default(),
    };
    report.header = [
        "contender",
        "instructions per request (median of rounds; range)",
        "× plugins off",
    ]
    .map(String::from)
    .to_vec();
    for (c, series) in &per_request {
        report.rows.push(vec![
            c.label().to_string(),
            series.show(0),
            ratio(*c, Contender::SluiceOff).show(3),
        ]);
    }
    if of(Contender::BarePingora).is_some() {
        report.checks.push(Check::at_most_rounds(
            "plugins off: instructions per request vs bare Pingora",
            &ratio(Contender::SluiceOff, Contender::BarePingora),
            1.05,
            "×",
            Noise::Count,
        ));
    }
    report.checks.push(Check::at_most_rounds(
        "plugins on (cache miss): instructions per request vs plugins off",
        &ratio(Contender::SluiceOn, Contender::SluiceOff),
        1.15,
        "×",
        Noise::Count,
    ));
    report.notes.push(format!(
        "Each contender under `valgrind --tool=callgrind` (user-space instructions of the whole \
         process, every thread), in front of the zero-latency simulator. {} rounds; per round \
         {} non-stream chat requests (`max_tokens: 16`) one at a time on one connection after \
         3 unmeasured, less the instructions of an idle window as long as the batch (health \
         checks, timers). Plugins on: a prompt of its own per request (cache misses). Counts \
         are exact and do not depend on the machine's load; they leave out the kernel's work \
         and every stall (cache misses, waits).",
        p.rounds, p.instr_requests
    ));
    Ok(report)
}

/// Starts `cmd` under callgrind and waits until it listens on `addrs`.
async fn start(
    contender: Contender,
    cmd: Command,
    name: &str,
    dir: &Path,
    addrs: &[SocketAddr],
) -> Result<Counted> {
    let out = dir.join(format!("{name}.callgrind"));
    let mut valgrind = Command::new("valgrind");
    valgrind
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => valgrind.env(key, value),
            None => valgrind.env_remove(key),
        };
    }
    let mut proc = Proc::spawn(name, valgrind, &dir.join(format!("{name}.log")), false)?;
    let deadline = Instant::now() + START_WITHIN;
    loop {
        proc.check_alive()?;
        let mut up = true;
        for a in addrs {
            up &= tokio::net::TcpStream::connect(a).await.is_ok();
        }
        if up {
            break;
        }
        if Instant::now() > deadline {
            bail!("{name} under valgrind did not start:\n{}", proc.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Counted {
        contender,
        addr: addrs[0],
        proc,
        out,
    })
}

/// Runs `callgrind_control ARG PID`.
fn control(pid: u32, arg: &str) -> Result<()> {
    let status = Command::new("callgrind_control")
        .arg(arg)
        .arg(pid.to_string())
        .output()
        .context("callgrind_control")?;
    if !status.status.success() {
        bail!(
            "callgrind_control {arg} {pid}: {}",
            String::from_utf8_lossy(&status.stderr)
        );
    }
    Ok(())
}

/// Dumps the counters of `pid` and reads the instructions counted since they were zeroed:
/// the `totals:` line of the newest dump (`summary:` when it has none).
async fn dump(pid: u32, out: &Path) -> Result<u64> {
    let before = newest(out);
    control(pid, "--dump")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = newest(out);
        if let Some((path, _)) = now.as_ref().filter(|n| Some(*n) != before.as_ref()) {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let line = |key: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse::<u64>().ok())
            };
            if let Some(total) = line("totals:").or_else(|| line("summary:")) {
                return Ok(total);
            }
        }
        if Instant::now() > deadline {
            bail!("no callgrind dump of {pid} in {:?}", out.parent());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The newest dump of `out` (`out.N`), by its number.
fn newest(out: &Path) -> Option<(PathBuf, u32)> {
    let dir = out.parent()?;
    let stem = out.file_name()?.to_str()?.to_string();
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n: u32 = name.strip_prefix(&format!("{stem}."))?.parse().ok()?;
            Some((e.path(), n))
        })
        .max_by_key(|(_, n)| *n)
}
