//! Scenario 33 (issue #56, "the fleet at scale"): what one Sluice replica pays for each
//! backend it follows and for each block its exact index holds, measured against a fleet of
//! simulated engines as large as this machine drives, for RESULTS.md's estimate of a thousand
//! engines behind ten replicas.
//!
//! - **The fleet**: `scale_engines` simulators (in this process, on a runtime of their own),
//!   each with vLLM 0.32's `/metrics` page and its KV event publisher (ZMQ PUB and replay),
//!   all in one pool of one Sluice: health checks and scrapes at their defaults (every
//!   250 ms), `balancing: ttft` with the pool's tokenizer and `kv_events: auto`, the cache,
//!   request ids and the KV breaker on. No request is sent: the engines publish what a loaded
//!   engine would ([`vllm_sim::Sim::publish_kv_events`]), so the harness's CPU goes to
//!   encoding events, not to simulating prefills.
//! - **Memory per indexed block**: the engines' caches are filled until they hold
//!   `scale_blocks` blocks in all (prompts of 256 tokens, 16 blocks of 16, chained), paced so
//!   that no ZMQ queue overflows; Sluice's RSS before and after, over the blocks its index
//!   says it holds (`sluice_prefix_index_blocks`).
//! - **Per backend, quiet**: Sluice's CPU over a window with only the checks running: per
//!   backend, and per check (`sluice_health_checks_total`).
//! - **Per backend, publishing**: every engine at a steady rate of about 10,000 prompt
//!   tokens a second, in 40 steps a second, each step's batch storing one new 256-token
//!   prompt (16 blocks) and evicting the oldest one (16 blocks): 1,280 block events a second
//!   an engine, its cache's size steady. Sluice's CPU over the quiet window's, per block
//!   event; the batches Sluice took against those sent (a ZMQ PUB drops what a slow
//!   subscriber cannot take).
//! - Quiet and publishing windows alternate, `rounds` of each; medians with their ranges.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::contenders::{free_addr, start_sluice_with, tree_usage, Contender, Usage, MODEL};
use crate::fleet::page_of;
use crate::prefix_fleet::{subscribers_live, tokenizer_dir, Fleet};
use crate::report::{Check, ScenarioReport, Series};
use crate::resilience::metric_sum;
use crate::scenarios::title;
use crate::Ctx;
use vllm_sim::KvEvent;

const ID: u8 = 33;

/// Tokens per block, as vLLM's default.
const BLOCK: u32 = 16;
/// Blocks per prompt published: a 256-token prompt.
const PROMPT_BLOCKS: usize = 16;
/// An engine's steps a second when publishing at its steady rate.
const STEPS_PER_SECOND: u32 = 40;

/// One engine's cache as the harness publishes it: its prompts, oldest first.
struct Cache {
    prompts: VecDeque<Vec<u64>>,
    /// The next block hash of this engine's own (engines never share a hash).
    next_hash: u64,
    /// Token ids made so far (they only need to differ between prompts).
    next_token: u32,
}

impl Cache {
    fn new(engine: usize) -> Cache {
        Cache {
            prompts: VecDeque::new(),
            next_hash: (engine as u64 + 1) << 40,
            next_token: 0,
        }
    }

    /// A new prompt stored: its event.
    fn store(&mut self) -> KvEvent {
        let hashes: Vec<u64> = (0..PROMPT_BLOCKS as u64)
            .map(|i| self.next_hash + i)
            .collect();
        self.next_hash += PROMPT_BLOCKS as u64;
        let token_ids: Vec<u32> = (0..PROMPT_BLOCKS as u32 * BLOCK)
            .map(|_| {
                self.next_token = self.next_token.wrapping_add(7919) % 150_000;
                self.next_token
            })
            .collect();
        self.prompts.push_back(hashes.clone());
        KvEvent::Stored {
            hashes,
            parent: None,
            token_ids,
            block_size: BLOCK,
            salt: None,
            lora: None,
        }
    }

    /// The oldest prompt evicted: its event.
    fn evict(&mut self) -> Option<KvEvent> {
        self.prompts
            .pop_front()
            .map(|hashes| KvEvent::Removed { hashes })
    }
}

/// One window's reading.
struct Window {
    /// Sluice's CPU time over the window, and the window's length (seconds).
    spent: f64,
    elapsed: f64,
    /// How long the engines published (the window without the wait for the last batches).
    published: f64,
    checks: f64,
    block_events: u64,
    /// Batches Sluice took, and the gaps it found in their sequence.
    batches_taken: f64,
    gaps: f64,
}

impl Window {
    fn share(&self) -> f64 {
        self.spent / self.elapsed
    }
}

/// What one fleet size measured: a column of the table, and what the checks and notes use.
struct Followed {
    /// Each measure's name and value, in the table's order.
    column: Vec<(String, String)>,
    gaps: f64,
    block_events: u64,
    checks_failed: f64,
    prompts_each: usize,
}

/// 33. The fleet at scale, at each fleet size.
pub async fn fleet_scale(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    let p = ctx.p.clone();
    let mut columns = Vec::new();
    let (mut gaps, mut block_events, mut checks_failed) = (0.0, 0, 0.0);
    let mut filled = Vec::new();
    for &n in &p.scale_engines {
        let followed = follow(ctx, n.max(1)).await?;
        gaps += followed.gaps;
        block_events += followed.block_events;
        checks_failed += followed.checks_failed;
        filled.push(format!(
            "{} prompts an engine at {n} engines",
            followed.prompts_each
        ));
        columns.push(followed.column);
    }
    report.measured(
        Contender::SluiceFleetFollower,
        block_events,
        checks_failed as u64,
        (checks_failed > 0.0).then(|| format!("{checks_failed} health checks failed")),
    );
    report.header = std::iter::once("measure".to_string())
        .chain(
            p.scale_engines
                .iter()
                .map(|n| format!("{n} engines (median of rounds; range)")),
        )
        .collect();
    let names: Vec<String> = columns
        .first()
        .map(|c| c.iter().map(|(name, _)| name.clone()).collect())
        .unwrap_or_default();
    report.rows = names
        .into_iter()
        .enumerate()
        .map(|(i, name)| {
            std::iter::once(name)
                .chain(
                    columns
                        .iter()
                        .map(|c| c.get(i).map(|(_, v)| v.clone()).unwrap_or_default()),
                )
                .collect()
        })
        .collect();
    report.checks.push(Check::new(
        "KV event batches missed at an engine's steady rate",
        "0",
        format!("{gaps:.0}"),
        Some(gaps == 0.0),
    ));
    report.notes.push(format!(
        "Simulated engines (in the harness's process) in one pool of one Sluice (threads 2), \
         fresh for each fleet size: health checks and scrapes every 250 ms (vLLM 0.32's page), \
         `balancing: ttft` with the pool's tokenizer and `kv_events: auto`, the cache, request \
         ids and the KV breaker on; no requests. Memory: the caches filled with prompts of \
         {PROMPT_BLOCKS} blocks ({}), Sluice's RSS before and after over the blocks its index \
         holds (MB per million blocks = bytes per block). Windows of {:?}, {} rounds, quiet \
         (checks only) and publishing alternating: each engine's step ({STEPS_PER_SECOND} a \
         second) stores one new prompt of {PROMPT_BLOCKS} blocks and evicts its oldest, {} \
         block events a second an engine. CPU: Sluice's threads' run time; per block event, \
         over the quiet windows' median.",
        filled.join(", "),
        p.scale_window,
        p.rounds,
        2 * PROMPT_BLOCKS as u32 * STEPS_PER_SECOND,
    ));
    Ok(report)
}

/// One Sluice following `n` engines.
async fn follow(ctx: &Ctx, n: usize) -> Result<Followed> {
    let p = &ctx.p;
    let window = p.scale_window;
    let fleet = Fleet::of_configs((0..n).map(|_| engine()).collect())?;
    let dir = tempfile::Builder::new()
        .prefix("scale.")
        .tempdir_in(ctx.root.path())
        .context("the scenario's directory")?;
    let (listen, admin) = (free_addr()?, free_addr()?);
    let backends: Vec<SocketAddr> = fleet.sims.iter().map(vllm_sim::Sim::addr).collect();
    let proc = start_sluice_with(
        &ctx.sluice_bin,
        dir.path(),
        "scale",
        &yaml(dir.path(), listen, admin, &backends),
        &[listen, admin],
    )
    .await?;
    let pid = proc.pid().context("Sluice's pid")?;
    subscribers_live(admin, &fleet).await?;
    let mut caches: Vec<Cache> = (0..n).map(Cache::new).collect();

    // Memory: the caches filled to `scale_blocks` in all, in steps an engine could make
    // (a few prompts each), so that no publisher's queue overflows.
    settle(pid).await?;
    let empty = tree_usage(pid)?;
    let prompts_each = (p.scale_blocks / PROMPT_BLOCKS / n).max(1);
    let fill_started = Instant::now();
    let mut sent = 0;
    while sent < prompts_each {
        let now = (prompts_each - sent).min(4);
        for (sim, cache) in fleet.sims.iter().zip(&mut caches) {
            if !sim.publish_kv_events((0..now).map(|_| cache.store())) {
                bail!("the simulator at {} publishes no KV events", sim.addr());
            }
        }
        sent += now;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let wanted = (prompts_each * PROMPT_BLOCKS * n) as f64;
    let indexed = until_indexed(admin, wanted).await?;
    let fill_time = fill_started.elapsed();
    settle(pid).await?;
    let full = tree_usage(pid)?;
    let grown = full.rss_bytes.saturating_sub(empty.rss_bytes) as f64;
    let bytes_per_block = if indexed > 0.0 {
        grown / indexed
    } else {
        f64::NAN
    };

    // Quiet and publishing windows, alternating.
    let (mut quiet, mut publishing) = (Vec::new(), Vec::new());
    for _ in 0..p.rounds {
        quiet.push(measure(pid, admin, window, None).await?);
        publishing.push(measure(pid, admin, window, Some((&fleet, &mut caches))).await?);
    }
    let checks_failed = failed_checks(admin).await?;
    let still_indexed = metric_sum(&page_of(admin).await?, "sluice_prefix_index_blocks");
    drop(proc);
    let taken: f64 = publishing.iter().map(|w| w.batches_taken).sum();
    let gaps: f64 = publishing.iter().map(|w| w.gaps).sum();
    let block_events: u64 = publishing.iter().map(|w| w.block_events).sum();
    let quiet_share = Series(quiet.iter().map(Window::share).collect());
    let quiet_median = quiet_share.median();
    let per_backend = Series(quiet.iter().map(|w| w.share() * 1e6 / n as f64).collect());
    let per_check = Series(
        quiet
            .iter()
            .map(|w| w.spent * 1e6 / w.checks.max(1.0))
            .collect(),
    );
    // Over what the checks alone cost in as long.
    let per_event = Series(
        publishing
            .iter()
            .map(|w| {
                (w.spent - quiet_median * w.elapsed).max(0.0) * 1e6 / (w.block_events.max(1) as f64)
            })
            .collect(),
    );
    let publishing_share = Series(publishing.iter().map(Window::share).collect());
    let events_rate = Series(
        publishing
            .iter()
            .map(|w| w.block_events as f64 / w.published.max(f64::EPSILON))
            .collect(),
    );
    let row = |what: &str, value: String| (what.to_string(), value);
    let percent = |s: &Series| Series(s.0.iter().map(|x| x * 100.0).collect()).show(2);
    let column = vec![
        row("engines followed", n.to_string()),
        row(
            "blocks indexed (of those published), fill time",
            format!(
                "{indexed:.0} of {wanted:.0}, {:.1} s",
                fill_time.as_secs_f64()
            ),
        ),
        row(
            "Sluice RSS: empty index → full (MB)",
            format!(
                "{:.1} → {:.1}",
                empty.rss_bytes as f64 / 1e6,
                full.rss_bytes as f64 / 1e6
            ),
        ),
        row(
            "memory per million indexed blocks (MB)",
            format!("{bytes_per_block:.0}"),
        ),
        row("CPU, checks only (% of a core)", percent(&quiet_share)),
        row(
            "CPU per backend followed, checks only (µs per second)",
            per_backend.show(1),
        ),
        row(
            "CPU per check (µs; Sluice's idle floor included)",
            per_check.show(1),
        ),
        row(
            "CPU, checks and KV events, until every batch is taken (% of a core)",
            percent(&publishing_share),
        ),
        row(
            "block events a second, all engines (publishing)",
            events_rate.show(0),
        ),
        row(
            "CPU per block event, over the checks (µs)",
            per_event.show(3),
        ),
        row(
            "batches taken; gaps in their sequences; blocks indexed at the end",
            format!("{taken:.0}; {gaps:.0}; {still_indexed:.0}"),
        ),
    ];
    Ok(Followed {
        column,
        gaps,
        block_events,
        checks_failed,
        prompts_each,
    })
}

/// An engine of the fleet: vLLM 0.32's pages, the pool's tokenizer, KV events.
fn engine() -> vllm_sim::SimConfig {
    vllm_sim::SimConfig::default()
        .with_served_model_names(vec![MODEL.to_string()])
        .with_kv(1 << 20, BLOCK)
        .with_tokenizer(tokenizer_dir())
        .with_kv_events(vllm_sim::KvEventsConfig::default())
}

/// The Sluice following `backends`.
fn yaml(dir: &Path, listen: SocketAddr, admin: SocketAddr, backends: &[SocketAddr]) -> String {
    let backends: String = backends
        .iter()
        .map(|b| format!("      - address: {b}\n"))
        .collect();
    format!(
        "# Generated by sluice-bench (scenario {ID}).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         log:\n  level: warn\n\
         pools:\n  - name: fleet\n    models: [\"{MODEL}\"]\n    \
         balancing: {{strategy: ttft}}\n    tokenizer: {tokenizer}\n    kv_events: auto\n    \
         backends:\n{backends}\
         plugins:\n  request_id:\n    enabled: true\n  cache:\n    enabled: true\n    \
         store: memory\n  speculative:\n    enabled: false\n  kv_breaker:\n    enabled: true\n",
        pid = dir.join("scale.pid").display(),
        sock = dir.join("scale.sock").display(),
        tokenizer = tokenizer_dir().display(),
    )
}

/// Sluice's CPU, checks and taken batches over one window; with `publishing`, every engine
/// publishing at its steady rate meanwhile, and the window lasting until Sluice has taken
/// every batch (its CPU for them counted whole).
async fn measure(
    pid: u32,
    admin: SocketAddr,
    window: Duration,
    publishing: Option<(&Fleet, &mut Vec<Cache>)>,
) -> Result<Window> {
    let before = counters(admin).await?;
    let cpu_before: Usage = tree_usage(pid)?;
    let started = Instant::now();
    let mut block_events = 0u64;
    let mut published = 0.0;
    match publishing {
        Some((fleet, caches)) => {
            let mut step = tokio::time::interval(Duration::from_secs(1) / STEPS_PER_SECOND);
            step.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while started.elapsed() < window {
                step.tick().await;
                for (sim, cache) in fleet.sims.iter().zip(caches.iter_mut()) {
                    // One step's batch: a prompt stored, the oldest evicted.
                    let stored = cache.store();
                    let evicted = cache.evict();
                    block_events += 2 * PROMPT_BLOCKS as u64;
                    if !sim.publish_kv_events(std::iter::once(stored).chain(evicted)) {
                        bail!("the simulator at {} publishes no KV events", sim.addr());
                    }
                }
            }
            published = started.elapsed().as_secs_f64();
            // Until the batches stop coming: what was sent has been taken.
            let mut taken = counters(admin).await?.batches;
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let now = counters(admin).await?.batches;
                if now == taken || started.elapsed() > window * 3 {
                    break;
                }
                taken = now;
            }
        }
        None => tokio::time::sleep(window).await,
    }
    let spent = tree_usage(pid)?.cpu.saturating_sub(cpu_before.cpu);
    let elapsed = started.elapsed().as_secs_f64();
    let after = counters(admin).await?;
    Ok(Window {
        spent: spent.as_secs_f64(),
        elapsed,
        published,
        checks: after.checks - before.checks,
        block_events,
        batches_taken: after.batches - before.batches,
        gaps: after.gaps - before.gaps,
    })
}

/// Sluice's counters the scenario reads.
struct Counters {
    checks: f64,
    batches: f64,
    gaps: f64,
}

/// The totals of checks made, KV event batches taken and gaps in their sequences.
async fn counters(admin: SocketAddr) -> Result<Counters> {
    let page = page_of(admin).await?;
    Ok(Counters {
        checks: metric_sum(&page, "sluice_health_checks_total"),
        batches: metric_sum(&page, "sluice_kv_event_batches_total"),
        gaps: metric_sum(&page, "sluice_kv_event_gaps_total"),
    })
}

/// Checks that did not succeed so far.
async fn failed_checks(admin: SocketAddr) -> Result<f64> {
    let page = page_of(admin).await?;
    Ok(metric_sum(&page, "sluice_health_checks_total")
        - crate::resilience::labelled_sum(&page, "sluice_health_checks_total", "result", "ok"))
}

/// Waits until the index holds `wanted` blocks, or stops growing for 5 s: what it holds.
async fn until_indexed(admin: SocketAddr, wanted: f64) -> Result<f64> {
    let mut last = (0.0, Instant::now());
    loop {
        let held = metric_sum(&page_of(admin).await?, "sluice_prefix_index_blocks");
        if held >= wanted || last.1.elapsed() > Duration::from_secs(5) {
            return Ok(held);
        }
        if held > last.0 {
            last = (held, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until Sluice is idle between checks: under 2 ms of CPU in 100 ms (its checks
/// every 250 ms cost a few hundred µs each round).
async fn settle(pid: u32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let before = tree_usage(pid)?.cpu;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let spent = tree_usage(pid)?.cpu.saturating_sub(before);
        if spent < Duration::from_millis(2) || Instant::now() > deadline {
            return Ok(());
        }
    }
}
