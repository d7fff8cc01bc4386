//! The scenarios. Each is a function that starts the contenders it needs ([`Stack`]), runs
//! them in interleaved rounds and fills a [`ScenarioReport`]. To add one: a line in [`ALL`], a
//! branch in [`run`], a function.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;

use crate::abuse::{raw_post, Attack, AttackSpec, AttackStats};
use crate::contenders::{
    children_of, free_addr, hash_key, reset_peak_rss, start_bare_pingora, start_fleet_sluice,
    start_nginx, start_redis, start_sluice, start_sluice_admin, status_bytes, tree_usage, usage,
    Contender, EdgeLimits, Proc, RunningSim, Setup, SimMode, SimSpec, MODEL, TENANT_KEY,
};
use crate::loadgen::{closed_loop, fetch, open_loop, send_one, LoadResult, Target};
use crate::own_clock::{OwnClock, Phase};
use crate::public::{with_own_clock, Timed};
use crate::report::{pairwise, Check, Noise, ScenarioReport, Series};
use crate::sse::{self, SseLoad};
use crate::Ctx;

/// Every scenario: number and title.
pub const ALL: &[(u8, &str)] = &[
    (
        1,
        "Non-stream chat: maximum throughput at fixed concurrency",
    ),
    (
        2,
        "Latency at a fixed request rate (open loop), half of nginx's maximum",
    ),
    (
        3,
        "Streams: 100 tokens at 10 ms, added TTFT and inter-chunk gap",
    ),
    (4, "1,000 concurrent open streams: RSS and CPU"),
    (
        5,
        "Cache hits: memory and Redis stores against nginx serving a static file",
    ),
    (6, "1 MiB prompts: throughput"),
    (
        7,
        "Health scraping of 50 backends every 250 ms: CPU at idle",
    ),
    (
        8,
        "Abuse: normal traffic's latency and errors, quiet and under attack",
    ),
    (9, "Large request bodies: the proxy's peak memory"),
    (
        10,
        "Backend killed under load: failed requests and attempts on the dead backend",
    ),
    (
        11,
        "Burst over KV capacity: the breaker refusing at once against waiting in its queue",
    ),
    (
        12,
        "Tenants plugin: its cost with local and Redis-shared limits against plugins off",
    ),
    (
        13,
        "Time to first token at the tail: a draft and target fleet under bursty long prompts, per balancing strategy",
    ),
    (15, "Public method: added latency at concurrency 1"),
    (
        16,
        "Public method: highest rate sustained behind a 20 ms mock, and RSS before, during, after",
    ),
    (17, "Public method: streams of 64 deltas 20 ms apart"),
    (18, "Each plugin's cost: CPU per request and added p99"),
    (19, "Long prompts: 220 KB streamed prompts at concurrency 150"),
    (20, "HTTP/2 from clients: streams on one h2c connection beside HTTP/1.1 streams"),
    (
        21,
        "The Pingora floor: bare Pingora with its own knobs turned, against nginx",
    ),
    (
        22,
        "Discovery: a fleet scaled 2 → 4 → 2 under load with every plugin on, a pod killed with discovery on, and CPU at idle with 200 discovered endpoints",
    ),
    (
        23,
        "Soak: 30 minutes of mixed traffic with faults (backend kills, Redis restarts, reloads, stalled and abusive clients): RSS growth after warm-up and lost requests",
    ),
    (
        24,
        "Prefix routing on a vLLM V1-like fleet: conversations, agents and RAG, per strategy, the exact prefix index against the approximate affinity and a session oracle",
    ),
    (
        25,
        "Time to first token at the tail on a vLLM V1-like fleet (chunked prefill, prefix caching): scenario 13 with 2 drafts and 4 targets",
    ),
    (
        26,
        "Tracing's cost: CPU per stream and added TTFT p99 with traces at sampling 0.1 and 1.0 against tracing off",
    ),
    (
        27,
        "A production trace of long multi-turn chat (Mooncake's, 10 minutes 4× faster): TTFT and prompt tokens computed per placement, against an infinite shared cache",
    ),
    (
        28,
        "Scale from zero: a pool with no backend under steady requests, its first backend joining after 20 s, with and without the waiting room",
    ),
    (
        29,
        "Agent sessions at saturation: long agent sessions and short chats on engines that queue first come, first served, swept past capacity; FIFO, priority classes and fair flow control",
    ),
    (
        30,
        "Prefill and decode on separate pools: long prompts with long answers on 4 engines aggregated and split 2 + 2, and the split fleet losing half its transfers",
    ),
    (
        31,
        "The semantic cache on labelled question pairs (STS-B) with a real embedding model: wrong hits and hits under a 2 % bound beside a fixed threshold at the same measured error, and what a semantic miss adds",
    ),
    (
        32,
        "Where each feature's cost goes as the prompt grows: Sluice's CPU per request against the prompt's size, plugins off, each feature alone and every feature on, with each curve's slope",
    ),
    (
        33,
        "The fleet at scale: what one replica pays per backend it follows (health checks and scrapes, KV events at an engine's rate) and per million indexed blocks",
    ),
    (
        34,
        "Instructions per request under callgrind: bare Pingora, plugins off and plugins on, counted rather than timed",
    ),
];

pub async fn run(id: u8, ctx: &mut Ctx) -> Result<ScenarioReport> {
    match id {
        1 => throughput(ctx).await,
        2 => fixed_rate(ctx).await,
        3 => streams(ctx).await,
        4 => open_streams(ctx).await,
        5 => cache_hits(ctx).await,
        6 => big_prompts(ctx).await,
        7 => health_scraping(ctx).await,
        8 => abuse(ctx).await,
        9 => large_bodies(ctx).await,
        10 => crate::resilience::killed_backend(ctx).await,
        11 => crate::resilience::burst(ctx).await,
        12 => crate::tenants::tenants_cost(ctx).await,
        13 => crate::fleet::fleet(ctx).await,
        15 => crate::public::concurrency_one(ctx).await,
        16 => crate::public::max_rate(ctx).await,
        17 => crate::public::public_streams(ctx).await,
        18 => crate::plugin_cost::each_plugin(ctx).await,
        19 => crate::plugin_cost::long_prompts(ctx).await,
        20 => crate::h2_streams::h2_streams(ctx).await,
        21 => pingora_floor(ctx).await,
        22 => crate::discovery::discovery(ctx).await,
        23 => crate::soak::soak(ctx).await,
        24 => crate::prefix_fleet::prefix_fleet(ctx).await,
        25 => crate::fleet::fleet_v1(ctx).await,
        26 => crate::plugin_cost::tracing_cost(ctx).await,
        27 => crate::trace_replay::trace_replay(ctx).await,
        28 => crate::scale_from_zero::scale_from_zero(ctx).await,
        29 => crate::flow_fairness::flow_fairness(ctx).await,
        30 => crate::disaggregation::disaggregation(ctx).await,
        31 => crate::semantic::semantic_cache(ctx).await,
        32 => crate::cost_curves::cost_curves(ctx).await,
        33 => crate::fleet_scale::fleet_scale(ctx).await,
        34 => crate::instructions::instructions(ctx).await,
        _ => bail!("no scenario {id}"),
    }
}

pub(crate) fn title(id: u8) -> &'static str {
    ALL.iter()
        .find(|(i, _)| *i == id)
        .map(|(_, t)| *t)
        .unwrap_or("")
}

/// A contender that is up, with its address.
pub struct Up {
    pub contender: Contender,
    pub addr: SocketAddr,
    pub proc: Option<Proc>,
    /// Sluice's admin listener (`/metrics`), for the scenarios that read it.
    pub admin: Option<SocketAddr>,
    /// A process of its own that works for this contender alone and whose CPU is shown beside
    /// its own (the Redis of `SluiceTenantsRedis`).
    pub helper: Option<u32>,
}

impl Up {
    /// A contender with nothing but an address and maybe a process.
    pub(crate) fn plain(contender: Contender, addr: SocketAddr, proc: Option<Proc>) -> Up {
        Up {
            contender,
            addr,
            proc,
            admin: None,
            helper: None,
        }
    }

    /// The pid whose resources count (the simulator's for `direct`).
    pub(crate) fn pid(&self, sim: &RunningSim) -> Option<u32> {
        match &self.proc {
            Some(p) => p.pid(),
            None => sim.pid(),
        }
    }
}

/// `up`'s requests: `body` to `path`. "Plugins on" gets a prompt of its own per request, so
/// that its cache misses (and stores) every time instead of answering from memory.
pub(crate) fn target_for(up: &Up, path: &str, body: &Bytes) -> Arc<Target> {
    let t = Target::post_json(up.addr, path, body.clone());
    // Every contender with the cache on gets a prompt of its own per request: misses.
    let cache_on = matches!(
        up.contender,
        Contender::SluiceOn | Contender::SluiceTraced01 | Contender::SluiceTraced10
    );
    Arc::new(if cache_on { t.varied() } else { t })
}

/// The simulator and the contenders in front of it.
pub struct Stack {
    pub sim: RunningSim,
    pub up: Vec<Up>,
    /// Contenders that could not run, and why.
    pub down: Vec<(Contender, String)>,
    /// The Redis servers behind `SluiceRedisHit` and `SluiceTenantsRedis`, if started.
    _redis: Vec<Proc>,
    /// The OTLP receivers of the traced contenders (scenario 26), with what each received.
    pub receivers: Vec<(Contender, sluice_testkit::OtlpReceiver)>,
    dir: tempfile::TempDir,
}

impl Stack {
    pub async fn start(ctx: &Ctx, spec: &SimSpec, want: &[Contender]) -> Result<Stack> {
        Stack::start_limited(ctx, spec, want, None).await
    }

    /// As [`Stack::start`], Sluice and nginx with scenario 8's bounds when `limits` is given.
    pub async fn start_limited(
        ctx: &Ctx,
        spec: &SimSpec,
        want: &[Contender],
        limits: Option<&EdgeLimits>,
    ) -> Result<Stack> {
        let dir = tempfile::tempdir_in(ctx.root.path())?;
        let sim = RunningSim::start(&ctx.sim, spec, dir.path()).await?;
        let mut up = Vec::new();
        let mut down = Vec::new();
        let mut redis = Vec::new();
        let mut receivers = Vec::new();
        // Scenario 12's tenant key digest, asked of the binary once.
        let mut digest: Option<String> = None;
        for &c in want {
            match c {
                Contender::Direct => up.push(Up::plain(c, sim.addr, None)),
                Contender::SluiceOff
                | Contender::SluiceOn
                | Contender::SluiceMemoryHit
                | Contender::SluiceOnlyRequestId
                | Contender::SluiceOnlyCache
                | Contender::SluiceOnlySpeculative
                | Contender::SluiceOnlyKvBreaker => {
                    let setup = match c {
                        Contender::SluiceOff => Setup::Off,
                        Contender::SluiceOn => Setup::On,
                        Contender::SluiceOnlyRequestId => Setup::Only("request_id"),
                        Contender::SluiceOnlyCache => Setup::Only("cache"),
                        Contender::SluiceOnlySpeculative => Setup::Only("speculative"),
                        Contender::SluiceOnlyKvBreaker => Setup::Only("kv_breaker"),
                        _ => Setup::MemoryHits,
                    };
                    let (proc, addr, admin) =
                        start_sluice_admin(&ctx.sluice_bin, dir.path(), sim.addr, &setup, limits)
                            .await?;
                    up.push(Up {
                        admin: Some(admin),
                        ..Up::plain(c, addr, Some(proc))
                    });
                }
                Contender::SluiceTraced01 | Contender::SluiceTraced10 => {
                    let receiver = sluice_testkit::OtlpReceiver::http().await;
                    let sampling = if c == Contender::SluiceTraced01 {
                        "0.1"
                    } else {
                        "1.0"
                    };
                    let setup = Setup::Traced(sampling, format!("http://{}", receiver.addr));
                    let (proc, addr) =
                        start_sluice(&ctx.sluice_bin, dir.path(), sim.addr, &setup, limits).await?;
                    up.push(Up::plain(c, addr, Some(proc)));
                    receivers.push((c, receiver));
                }
                Contender::SluiceTenantsLocal | Contender::SluiceTenantsRedis => {
                    let key = match &digest {
                        Some(d) => d.clone(),
                        None => digest
                            .insert(hash_key(&ctx.sluice_bin, TENANT_KEY)?)
                            .clone(),
                    };
                    let mut helper = None;
                    let setup = if c == Contender::SluiceTenantsLocal {
                        Setup::TenantsLocal(key)
                    } else {
                        let (proc, redis_addr) = match start_redis(dir.path()).await {
                            Ok(r) => r,
                            Err(e) => {
                                down.push((c, format!("redis-server: {e:#}")));
                                continue;
                            }
                        };
                        helper = proc.pid();
                        redis.push(proc);
                        Setup::TenantsRedis(key, format!("redis://{redis_addr}"))
                    };
                    let (proc, addr, admin) =
                        start_sluice_admin(&ctx.sluice_bin, dir.path(), sim.addr, &setup, limits)
                            .await?;
                    up.push(Up {
                        contender: c,
                        addr,
                        proc: Some(proc),
                        admin: Some(admin),
                        helper,
                    });
                }
                Contender::SluiceRedisHit => {
                    let (proc, redis_addr) = match start_redis(dir.path()).await {
                        Ok(r) => r,
                        Err(e) => {
                            down.push((c, format!("redis-server: {e:#}")));
                            continue;
                        }
                    };
                    redis.push(proc);
                    let setup = Setup::RedisHits(format!("redis://{redis_addr}"));
                    let (proc, addr) =
                        start_sluice(&ctx.sluice_bin, dir.path(), sim.addr, &setup, limits).await?;
                    up.push(Up::plain(c, addr, Some(proc)));
                }
                Contender::Nginx => {
                    let started = match &ctx.nginx {
                        Ok(bin) => start_nginx(bin, dir.path(), sim.addr, limits)
                            .await
                            .map_err(|e| format!("{e:#}")),
                        Err(e) => Err(e.clone()),
                    };
                    match started {
                        Ok((proc, addr)) => up.push(Up::plain(c, addr, Some(proc))),
                        Err(e) if ctx.require_nginx => bail!("nginx: {e}"),
                        Err(e) => down.push((c, e)),
                    }
                }
                Contender::BarePingora
                | Contender::BarePingoraNoWorkStealing
                | Contender::BarePingoraOneThread
                | Contender::BarePingoraTwoListenerTasks => match &ctx.sim {
                    SimMode::Process(exe) => {
                        let knobs = c.bare_knobs().unwrap_or_default();
                        let (proc, addr) =
                            start_bare_pingora(exe, dir.path(), sim.addr, knobs).await?;
                        up.push(Up::plain(c, addr, Some(proc)));
                    }
                    SimMode::InProcess => down.push((
                        c,
                        "runs from the bench binary; this run has none (smoke test)".into(),
                    )),
                },
                Contender::SluiceHealthChecks
                | Contender::SluiceNoHealthChecks
                | Contender::SluiceBackendKilled
                | Contender::SluiceBreakerRefuses
                | Contender::SluiceBreakerWaits
                | Contender::SluiceRoundRobin
                | Contender::SluiceKvAware
                | Contender::SluiceTtft
                | Contender::SluiceDiscovery
                | Contender::SluiceDiscoveredIdle
                | Contender::SluiceStaticIdle
                | Contender::SluiceSoak
                | Contender::SluicePrefixGuess
                | Contender::SluicePrefixGuessSessions
                | Contender::SluicePrefixExact
                | Contender::SluicePrefixExactSessions
                | Contender::SluiceSessionOracle
                | Contender::SluiceWaitingRoom
                | Contender::SluiceNoWait
                | Contender::SluiceFifo
                | Contender::SluicePriorityOnly
                | Contender::SluiceFair
                | Contender::SluiceAggregated
                | Contender::SluiceDisaggregated
                | Contender::SluiceDisaggregatedLossy
                | Contender::SluiceSemanticCache
                | Contender::SluiceIndexNewText
                | Contender::SluiceIndexSeenText
                | Contender::SluiceTracedOnly
                | Contender::SluiceEveryFeature
                | Contender::SluiceFleetFollower => {
                    bail!("{c} runs only in the scenario that starts it itself")
                }
            }
        }
        Ok(Stack {
            sim,
            up,
            down,
            _redis: redis,
            receivers,
            dir,
        })
    }

    /// The stack's temporary directory (nginx's files are under `nginx/`).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub(crate) fn note_down(&self, report: &mut ScenarioReport) {
        for (c, why) in &self.down {
            report.notes.push(format!("{c} unavailable: {why}"));
        }
    }
}

pub(crate) fn chat_body(content: &str, stream: bool, max_tokens: u32) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "stream": stream,
            "temperature": 0,
            "max_tokens": max_tokens,
        })
        .to_string(),
    )
}

pub(crate) const CHAT: &str = "/v1/chat/completions";

/// What closed-loop rounds measured, per contender and round.
pub(crate) struct Rounds {
    pub(crate) runs: BTreeMap<Contender, Vec<LoadResult>>,
    /// CPU time (user + system) per request of the contender's processes: the proxy's own,
    /// the simulator's for `direct`.
    pub(crate) cpu_us: BTreeMap<Contender, Vec<f64>>,
    /// The same for the contender's helper process ([`Up::helper`]), when it has one.
    pub(crate) helper_cpu_us: BTreeMap<Contender, Vec<f64>>,
}

/// Closed-loop rounds: every contender once per round, in order, `rounds` times.
async fn closed_rounds(
    ctx: &Ctx,
    stack: &Stack,
    body: &Bytes,
    conns: usize,
    report: &mut ScenarioReport,
) -> Result<Rounds> {
    closed_rounds_with(ctx, stack, conns, report, |up| target_for(up, CHAT, body)).await
}

/// As [`closed_rounds`], each contender's requests made by `target`.
pub(crate) async fn closed_rounds_with(
    ctx: &Ctx,
    stack: &Stack,
    conns: usize,
    report: &mut ScenarioReport,
    target: impl Fn(&Up) -> Arc<Target>,
) -> Result<Rounds> {
    let mut out = Rounds {
        runs: BTreeMap::new(),
        cpu_us: BTreeMap::new(),
        helper_cpu_us: BTreeMap::new(),
    };
    for _ in 0..ctx.p.rounds {
        for up in &stack.up {
            let target = target(up);
            let pid = up.pid(&stack.sim);
            let before = pid.and_then(|p| tree_usage(p).ok());
            let helper_before = up.helper.and_then(|p| usage(p).ok());
            let r = closed_loop(target, conns, ctx.p.warmup, ctx.p.duration).await?;
            let after = pid.and_then(|p| tree_usage(p).ok());
            let helper_after = up.helper.and_then(|p| usage(p).ok());
            // The CPU counts the warm-up too, so it is divided by the requests of the whole
            // run, estimated from the measured rate.
            let requests = r.rps() * (ctx.p.warmup + ctx.p.duration).as_secs_f64();
            if requests > 0.0 {
                for (b, a, to) in [
                    (before, after, &mut out.cpu_us),
                    (helper_before, helper_after, &mut out.helper_cpu_us),
                ] {
                    if let (Some(b), Some(a)) = (b, a) {
                        let cpu = a.cpu.saturating_sub(b.cpu).as_secs_f64();
                        to.entry(up.contender)
                            .or_default()
                            .push(cpu * 1e6 / requests);
                    }
                }
            }
            report.measured(up.contender, r.ok, r.errors, r.first_error.clone());
            out.runs.entry(up.contender).or_default().push(r);
        }
    }
    Ok(out)
}

/// What a measurement reports to [`ScenarioReport::measured`]: requests (or streams), failed
/// ones, and the first failure.
pub(crate) trait Tally {
    fn tally(&self) -> (u64, u64, Option<String>);
}

impl Tally for LoadResult {
    fn tally(&self) -> (u64, u64, Option<String>) {
        (self.ok, self.errors, self.first_error.clone())
    }
}

impl Tally for sse::SseResult {
    fn tally(&self) -> (u64, u64, Option<String>) {
        (self.streams, self.errors, self.first_error.clone())
    }
}

/// Interleaved rounds: `measure` for every contender once per round, in order, `rounds`
/// times; each result counted in `report` and kept per contender.
pub(crate) async fn each_round<T: Tally, F: std::future::Future<Output = Result<T>>>(
    rounds: usize,
    stack: &Stack,
    report: &mut ScenarioReport,
    mut measure: impl FnMut(&Up) -> F,
) -> Result<BTreeMap<Contender, Vec<T>>> {
    let mut runs: BTreeMap<Contender, Vec<T>> = BTreeMap::new();
    for _ in 0..rounds {
        for up in &stack.up {
            let r = measure(up).await?;
            let (requests, errors, first) = r.tally();
            report.measured(up.contender, requests, errors, first);
            runs.entry(up.contender).or_default().push(r);
        }
    }
    Ok(runs)
}

/// Interleaved rounds of `load`'s streams, each contender asked with `body` ([`target_for`]).
pub(crate) async fn stream_rounds(
    rounds: usize,
    stack: &Stack,
    report: &mut ScenarioReport,
    body: &Bytes,
    load: &SseLoad,
) -> Result<BTreeMap<Contender, Vec<sse::SseResult>>> {
    each_round(rounds, stack, report, |up| {
        sse::run(
            target_for(up, CHAT, body),
            load.clone(),
            Arc::new(AtomicUsize::new(0)),
        )
    })
    .await
}

pub(crate) fn series<T>(runs: Option<&Vec<T>>, f: impl Fn(&T) -> f64) -> Series {
    Series(runs.map(|v| v.iter().map(f).collect()).unwrap_or_default())
}

pub(crate) fn errors_cell(results: &[LoadResult]) -> String {
    let errors: u64 = results.iter().map(|r| r.errors).sum();
    let missed: u64 = results.iter().map(|r| r.missed).sum();
    let first = results.iter().find_map(|r| r.first_error.clone());
    let mut s = format!("{errors}");
    if missed > 0 {
        s.push_str(&format!(" (+{missed} not sent)"));
    }
    if let Some(e) = first {
        s.push_str(&format!(": {}", e.chars().take(80).collect::<String>()));
    }
    s
}

/// Per-round ratio of `c`'s throughput to `base`'s.
pub(crate) fn ratio(
    runs: &BTreeMap<Contender, Vec<LoadResult>>,
    c: Contender,
    base: Contender,
) -> Series {
    let rps = |k| series(runs.get(&k), LoadResult::rps);
    pairwise(&rps(c), &rps(base), |a, b| a / b)
}

fn throughput_table(report: &mut ScenarioReport, rounds: &Rounds, bytes_in: Option<usize>) {
    let runs = &rounds.runs;
    report.header = [
        "contender",
        "req/s",
        "× direct",
        "× nginx",
        "CPU µs/req",
        "p50 ms",
        "p99 ms",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    if bytes_in.is_some() {
        report.header.insert(5, "MiB/s sent".into());
    }
    for (c, results) in runs {
        let mut row = vec![
            c.label().to_string(),
            series(Some(results), LoadResult::rps).show(0),
            ratio(runs, *c, Contender::Direct).show(2),
            ratio(runs, *c, Contender::Nginx).show(2),
            series(rounds.cpu_us.get(c), |v| *v).show(1),
            series(Some(results), |r| r.ms(50.0)).show(3),
            series(Some(results), |r| r.ms(99.0)).show(3),
            errors_cell(results),
        ];
        if let Some(b) = bytes_in {
            let mib = series(Some(results), |r| r.rps() * b as f64 / (1 << 20) as f64);
            row.insert(5, mib.show(0));
        }
        report.rows.push(row);
    }
}

/// Where the bare Pingora proxy ran: how far Sluice is from it, and it from nginx.
fn pingora_floor_note(report: &mut ScenarioReport, runs: &BTreeMap<Contender, Vec<LoadResult>>) {
    if !runs.contains_key(&Contender::BarePingora) {
        return;
    }
    report.notes.push(format!(
        "pingora (bare) is the smallest Pingora proxy (one `upstream_peer`, no filters, 2 \
         threads as Sluice): the floor of a proxy built on Pingora. Sluice with plugins off \
         runs at {:.2}× its throughput, and it at {:.2}× nginx's.",
        ratio(runs, Contender::SluiceOff, Contender::BarePingora).median(),
        ratio(runs, Contender::BarePingora, Contender::Nginx).median(),
    ));
}

/// 1. Non-stream chat, maximum throughput at fixed concurrency.
async fn throughput(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(1, title(1));
    let stack = Stack::start(ctx, &SimSpec::zero(), &Contender::WITH_BARE_PINGORA).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", false, 16);
    let rounds = closed_rounds(ctx, &stack, &body, ctx.p.conns, &mut report).await?;
    throughput_table(&mut report, &rounds, None);
    let runs = &rounds.runs;
    pingora_floor_note(&mut report, runs);
    report.notes.push(format!(
        "{} connections, keep-alive, {:?} per contender per round after {:?} of warm-up; \
         simulator in zero-latency mode.",
        ctx.p.conns, ctx.p.duration, ctx.p.warmup
    ));
    let vs_nginx = |c| ratio(runs, c, Contender::Nginx);
    report.checks.push(Check::at_least_rounds(
        "plugins off: throughput vs nginx",
        &vs_nginx(Contender::SluiceOff),
        1.0,
        "×",
        Noise::Share,
    ));
    report.checks.push(Check::at_least_rounds(
        "plugins on (cache miss): throughput vs nginx",
        &vs_nginx(Contender::SluiceOn),
        0.9,
        "×",
        Noise::Share,
    ));
    ctx.max_rps = runs
        .iter()
        .map(|(c, r)| (*c, series(Some(r), LoadResult::rps).median()))
        .collect();
    Ok(report)
}

/// Scenario 21, what the distance from Sluice to nginx is made of: the bare Pingora proxy as
/// it runs in scenario 1, then with each of Pingora's own knobs turned, beside nginx and
/// Sluice with plugins off, at scenario 1's load.
async fn pingora_floor(ctx: &mut Ctx) -> Result<ScenarioReport> {
    const WANT: [Contender; 6] = [
        Contender::BarePingora,
        Contender::BarePingoraNoWorkStealing,
        Contender::BarePingoraOneThread,
        Contender::BarePingoraTwoListenerTasks,
        Contender::SluiceOff,
        Contender::Nginx,
    ];
    let mut report = ScenarioReport::new(21, title(21));
    let stack = Stack::start(ctx, &SimSpec::zero(), &WANT).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", false, 16);
    let rounds = closed_rounds(ctx, &stack, &body, ctx.p.conns, &mut report).await?;
    let runs = &rounds.runs;
    let cpu = |c: Contender| series(rounds.cpu_us.get(&c), |v| *v);
    report.header = [
        "contender",
        "req/s",
        "× nginx",
        "× pingora (bare)",
        "CPU µs/req",
        "CPU × pingora (bare)",
        "p99 ms",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    for (c, results) in runs {
        let c = *c;
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(results), LoadResult::rps).show(0),
            ratio(runs, c, Contender::Nginx).show(2),
            ratio(runs, c, Contender::BarePingora).show(2),
            cpu(c).show(1),
            pairwise(&cpu(c), &cpu(Contender::BarePingora), |a, b| a / b).show(2),
            series(Some(results), |r| r.ms(99.0)).show(3),
            errors_cell(results),
        ]);
    }
    report.notes.push(format!(
        "Scenario 1's load: {} connections, keep-alive, {:?} per contender per round after {:?} \
         of warm-up; the non-stream chat request; simulator in zero-latency mode. pingora \
         (bare) is scenario 1's (`threads: 2`, no L4 read buffer as Sluice's plain listeners, \
         Pingora's defaults otherwise); each variant turns one `ServerConf` knob. nginx runs 2 workers. The load generator and the \
         simulator share the 2 cores, so fewer proxy threads can mean more for them.",
        ctx.p.conns, ctx.p.duration, ctx.p.warmup
    ));
    report.notes.push(
        "Measured by hand beside this scenario (callgrind, 1,000 requests on one connection, \
         plugins off, at 28c185c): Sluice does about 150k instructions per request. Pingora \
         boxes its per-request future (`HttpServerApp::process_new_http`, 16.7 KB) for every \
         request on a keep-alive connection, and the copy into the box is 16.7k of them (11 %); \
         bare Pingora pays it too. Sluice's own request future, boxed by `async_trait` \
         around `request_filter`, is 12.5 KB (12.3k instructions to copy): it was 25 KB, \
         and Sluice 204k instructions per request, until the 18 KB connect future was taken \
         out of it. perf puts 39 % of Sluice's samples in the kernel (sockets, wake-ups), \
         plugins off; this table shows how much of the rest Pingora's knobs move."
            .to_string(),
    );
    Ok(report)
}

/// 2. Latency at a fixed rate, open loop: half of nginx's maximum.
async fn fixed_rate(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(2, title(2));
    let stack = Stack::start(ctx, &SimSpec::zero(), &Contender::ALL).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", false, 16);
    // Half of nginx's maximum from scenario 1, else measured now; without nginx, Sluice's.
    let known = |c| ctx.max_rps.iter().find(|(k, _)| *k == c).map(|(_, v)| *v);
    let basis = if stack.up.iter().any(|u| u.contender == Contender::Nginx) {
        Contender::Nginx
    } else {
        Contender::SluiceOff
    };
    let max = match known(basis) {
        Some(v) if v.is_finite() && v > 0.0 => v,
        _ => {
            let Some(up) = stack.up.iter().find(|u| u.contender == basis) else {
                bail!("{basis} is not up");
            };
            let target = target_for(up, CHAT, &body);
            closed_loop(target, ctx.p.conns, ctx.p.warmup, ctx.p.duration)
                .await?
                .rps()
        }
    };
    let rate = (max / 2.0).max(10.0);
    // Requests a contender could not send in time are a measurement (the table shows them as
    // "not sent"), not an error: only failed requests count in the report's tally.
    let p = ctx.p.clone();
    let runs = each_round(p.rounds, &stack, &mut report, |up| {
        open_loop(
            target_for(up, CHAT, &body),
            p.open_conns,
            rate,
            p.warmup,
            p.duration,
        )
    })
    .await?;
    report.header = [
        "contender",
        "req/s done",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "added p50 ms",
        "added p99 ms",
        "added p99.9 ms",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let pct = |c: Contender, p: f64| series(runs.get(&c), |r| r.ms(p));
    let added = |c, p| pairwise(&pct(c, p), &pct(Contender::Direct, p), |a, b| a - b);
    for (c, results) in &runs {
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(results), LoadResult::rps).show(0),
            pct(*c, 50.0).show(3),
            pct(*c, 99.0).show(3),
            pct(*c, 99.9).show(3),
            added(*c, 50.0).show(3),
            added(*c, 99.0).show(3),
            added(*c, 99.9).show(3),
            errors_cell(results),
        ]);
    }
    report.notes.push(format!(
        "{rate:.0} requests/s (half of {basis}'s {max:.0}), up to {} connections; latency from \
         each request's intended send time (coordinated omission corrected, as wrk2).",
        ctx.p.open_conns
    ));
    report.checks.push(Check::at_most_rounds(
        "plugins off: added p50 over direct",
        &added(Contender::SluiceOff, 50.0),
        0.15,
        "ms",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most_rounds(
        "plugins off: added p99 over direct",
        &added(Contender::SluiceOff, 99.0),
        1.0,
        "ms",
        Noise::Tail,
    ));
    Ok(report)
}

/// 3. Streams: added TTFT and inter-chunk gap over direct; no chunk merging.
async fn streams(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(3, title(3));
    let spec = SimSpec::streaming(ctx.p.stream_itl_ms, ctx.p.stream_tokens);
    let stack = Stack::start(ctx, &spec, &Contender::WITH_BARE_PINGORA).await?;
    stack.note_down(&mut report);
    let body = chat_body("Tell me a story.", true, 4096);
    let load = SseLoad::steady(
        ctx.p.stream_concurrency,
        ctx.p.stream_duration,
        ctx.p.stream_tokens,
        ctx.p.stream_itl_ms,
    );
    let runs = stream_rounds(ctx.p.rounds, &stack, &mut report, &body, &load).await?;
    let s = |c: Contender, f: &dyn Fn(&sse::SseResult) -> f64| series(runs.get(&c), f);
    let ttft99 = |c| s(c, &|r| r.ttft_ms(99.0));
    let gap50 = |c| s(c, &|r| r.gap_ms(50.0));
    let added = |a: Series, b: Series| pairwise(&a, &b, |x, y| x - y);
    report.header = [
        "contender",
        "streams",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "added TTFT p99 ms",
        "gap p50 ms",
        "added gap p50 ms",
        "gap p99 ms",
        "chunks/stream",
        "events/stream",
        "chunks with >1 event",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    for (c, results) in &runs {
        let c = *c;
        report.rows.push(vec![
            c.label().to_string(),
            s(c, &|r| r.streams as f64).show(0),
            s(c, &|r| r.ttft_ms(50.0)).show(3),
            ttft99(c).show(3),
            added(ttft99(c), ttft99(Contender::Direct)).show(3),
            gap50(c).show(3),
            added(gap50(c), gap50(Contender::Direct)).show(3),
            s(c, &|r| r.gap_ms(99.0)).show(3),
            s(c, &|r| r.chunks_per_stream()).show(1),
            s(c, &|r| r.events_per_stream()).show(1),
            format!("{}", results.iter().map(|r| r.merged).sum::<u64>()),
            errors_cell_sse(results),
        ]);
    }
    report.notes.push(format!(
        "{} streams open at a time, each on a fresh connection; {} tokens every {} ms (no jitter, \
         TTFT 0 at the simulator), their starts spread over {:?}; a chunk is one read of the \
         chunked body.",
        ctx.p.stream_concurrency, ctx.p.stream_tokens, ctx.p.stream_itl_ms, load.ramp
    ));
    for c in [Contender::SluiceOff, Contender::SluiceOn] {
        let name = if c == Contender::SluiceOff {
            "plugins off"
        } else {
            "plugins on"
        };
        report.checks.push(Check::at_most_rounds(
            &format!("{name}: added TTFT p99"),
            &added(ttft99(c), ttft99(Contender::Direct)),
            1.0,
            "ms",
            Noise::Tail,
        ));
        report.checks.push(Check::at_most_rounds(
            &format!("{name}: added inter-chunk gap, median"),
            &added(gap50(c), gap50(Contender::Direct)),
            0.1,
            "ms",
            Noise::Tail,
        ));
        let chunks = |k| s(k, &|r| r.chunks_per_stream()).median();
        let (mine, direct) = (chunks(c), chunks(Contender::Direct));
        report.checks.push(Check::new(
            &format!("{name}: no chunk merging (chunks per stream)"),
            "≥ direct's",
            format!("{mine:.1} vs {direct:.1}"),
            (mine.is_finite() && direct.is_finite()).then_some(mine >= direct - 0.05),
        ));
    }
    Ok(report)
}

pub(crate) fn errors_cell_sse(results: &[sse::SseResult]) -> String {
    let errors: u64 = results.iter().map(|r| r.errors).sum();
    match results.iter().find_map(|r| r.first_error.clone()) {
        Some(e) => format!("{errors}: {}", e.chars().take(80).collect::<String>()),
        None => format!("{errors}"),
    }
}

/// One round of scenario 4 for one contender.
struct OpenRound {
    streams: u64,
    errors: u64,
    first_error: Option<String>,
    peak_open: usize,
    rss_idle_mb: f64,
    rss_peak_mb: f64,
    /// After the streams ended and memory settled.
    rss_after_mb: f64,
    cpu_cores: f64,
}

impl OpenRound {
    /// RSS the streams added, per stream open at the peak.
    fn kb_per_stream(&self) -> f64 {
        (self.rss_peak_mb - self.rss_idle_mb) * 1000.0 / (self.peak_open.max(1) as f64)
    }
}

/// The first round's KB per stream: the process had served nothing before it.
fn fresh_kb_per_stream(rounds: &[OpenRound]) -> f64 {
    rounds.first().map_or(f64::NAN, OpenRound::kb_per_stream)
}

/// 4. 1,000 concurrent open streams: Sluice's RSS and CPU (nginx's for context).
async fn open_streams(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(4, title(4));
    let spec = SimSpec::streaming(ctx.p.open_stream_itl_ms, ctx.p.open_stream_tokens);
    let stack = Stack::start(ctx, &spec, &Contender::PROXIES_WITH_BARE_PINGORA).await?;
    stack.note_down(&mut report);
    let body = chat_body("Tell me a long story.", true, 4096);
    let n = ctx.p.open_streams;
    let mut runs: BTreeMap<Contender, Vec<OpenRound>> = BTreeMap::new();
    for _ in 0..ctx.p.rounds {
        for up in &stack.up {
            let Some(pid) = up.pid(&stack.sim) else {
                continue;
            };
            let idle = tree_usage(pid)?;
            let open = Arc::new(AtomicUsize::new(0));
            let load = SseLoad {
                concurrency: n,
                duration: Duration::ZERO,
                once: true,
                ramp: ctx.p.open_stream_ramp,
            };
            let target = target_for(up, CHAT, &body);
            let started = Instant::now();
            let mut task = tokio::spawn(sse::run(target, load, open.clone()));
            let (mut peak_open, mut peak_rss) = (0usize, idle.rss_bytes);
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let result = loop {
                tokio::select! {
                    r = &mut task => break r,
                    _ = tick.tick() => {
                        peak_open = peak_open.max(open.load(Ordering::SeqCst));
                        if let Ok(u) = tree_usage(pid) {
                            peak_rss = peak_rss.max(u.rss_bytes);
                        }
                    }
                }
            };
            let r = result??;
            let wall = started.elapsed();
            let after = tree_usage(pid)?;
            tokio::time::sleep(ctx.p.settle).await;
            let settled = tree_usage(pid)?;
            report.measured(up.contender, r.streams, r.errors, r.first_error.clone());
            runs.entry(up.contender).or_default().push(OpenRound {
                streams: r.streams,
                errors: r.errors,
                first_error: r.first_error,
                peak_open,
                rss_idle_mb: idle.rss_bytes as f64 / 1e6,
                rss_peak_mb: peak_rss as f64 / 1e6,
                rss_after_mb: settled.rss_bytes as f64 / 1e6,
                cpu_cores: (after.cpu.saturating_sub(idle.cpu)).as_secs_f64()
                    / wall.as_secs_f64().max(1e-9),
            });
        }
    }
    report.header = [
        "contender",
        "streams done",
        "peak open",
        "RSS before MB",
        "RSS peak MB",
        "RSS after MB",
        "after × before",
        "KB per stream",
        "KB per stream, fresh process",
        "CPU (cores, avg)",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    for (c, rounds) in &runs {
        let s = |f: &dyn Fn(&OpenRound) -> f64| Series(rounds.iter().map(f).collect());
        let errors: u64 = rounds.iter().map(|r| r.errors).sum();
        let first = rounds.iter().find_map(|r| r.first_error.clone());
        report.rows.push(vec![
            c.label().to_string(),
            s(&|r| r.streams as f64).show(0),
            s(&|r| r.peak_open as f64).show(0),
            s(&|r| r.rss_idle_mb).show(1),
            s(&|r| r.rss_peak_mb).show(1),
            s(&|r| r.rss_after_mb).show(1),
            s(&|r| r.rss_after_mb / r.rss_idle_mb.max(1e-9)).show(2),
            s(&|r| r.kb_per_stream()).show(1),
            format!("{:.1}", fresh_kb_per_stream(rounds)),
            s(&|r| r.cpu_cores).show(2),
            match first {
                Some(e) => format!("{errors}: {}", e.chars().take(80).collect::<String>()),
                None => format!("{errors}"),
            },
        ]);
    }
    report.notes.push(format!(
        "{n} streams opened over {:?}, each {} tokens every {} ms; RSS (VmRSS) before the \
         streams, sampled every 100 ms during them (peak), and {:?} after the last ended; CPU = \
         the threads' run time over the round's wall time; nginx is master + workers. The same process \
         serves every round, so later rounds start from a warm heap. KB per stream is (peak − \
         before) over the streams open; its fresh-process figure is the first round's, the only \
         one that compares allocators: Sluice's jemalloc hands freed pages back between rounds \
         (RSS after ≈ before) and grows again in each, where bare Pingora's glibc malloc keeps \
         its heap, so its later rounds count only growth beyond the last round's peak.",
        ctx.p.open_stream_ramp, ctx.p.open_stream_tokens, ctx.p.open_stream_itl_ms, ctx.p.settle
    ));
    let fresh = |c: Contender| runs.get(&c).map_or(f64::NAN, |r| fresh_kb_per_stream(r));
    report.checks.push(Check::at_most(
        "plugins on: KB per open stream (fresh process) × bare Pingora's",
        fresh(Contender::SluiceOn) / fresh(Contender::BarePingora),
        1.5,
        "×",
        Noise::Share,
    ));
    let median = |c: Contender, f: fn(&OpenRound) -> f64| {
        runs.get(&c)
            .map(|r| Series(r.iter().map(f).collect()).median())
            .unwrap_or(f64::NAN)
    };
    let (on_peak, bare_peak) = (
        median(Contender::SluiceOn, |r| r.rss_peak_mb),
        median(Contender::BarePingora, |r| r.rss_peak_mb),
    );
    report.checks.push(
        Check::at_most(
            &format!("plugins on: RSS with {n} open streams over bare Pingora's"),
            on_peak / bare_peak,
            1.0,
            "×",
            Noise::Share,
        )
        .showing(format!("{on_peak:.1} vs {bare_peak:.1} MB")),
    );
    report.checks.push(Check::at_most(
        "plugins on: RSS after the streams over RSS before",
        median(Contender::SluiceOn, |r| {
            r.rss_after_mb / r.rss_idle_mb.max(1e-9)
        }),
        1.10,
        "×",
        Noise::Share,
    ));
    for c in [Contender::SluiceOff, Contender::SluiceOn] {
        let name = if c == Contender::SluiceOff {
            "plugins off"
        } else {
            "plugins on"
        };
        let peak = runs
            .get(&c)
            .map(|r| Series(r.iter().map(|x| x.rss_peak_mb).collect()).median())
            .unwrap_or(f64::NAN);
        report.checks.push(Check::at_most(
            &format!("{name}: RSS with {n} open streams"),
            peak,
            150.0,
            "MB",
            Noise::Share,
        ));
    }
    Ok(report)
}

/// Asks `addr` once, then until the answer is a cache hit; returns the hit's body.
async fn prime(addr: SocketAddr, body: &Bytes) -> Result<Bytes> {
    let target = Target::post_json(addr, CHAT, body.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, headers, answer) = fetch(&target).await?;
        if !status.is_success() {
            bail!(
                "priming: HTTP {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        if headers.get("x-cache").is_some_and(|v| v == "HIT") {
            return Ok(answer);
        }
        if Instant::now() > deadline {
            bail!("priming: no cache hit within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Scenario 5, cache hits with the memory and Redis stores: throughput and p99 at half load,
/// against Sluice's pass-through on the same request and nginx serving the same bytes from a
/// static file.
async fn cache_hits(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(5, title(5));
    let want = [
        Contender::SluiceOff,
        Contender::SluiceMemoryHit,
        Contender::SluiceRedisHit,
        Contender::Nginx,
    ];
    let stack = Stack::start(ctx, &SimSpec::zero(), &want).await?;
    stack.note_down(&mut report);
    let body = chat_body("What is the capital of France?", false, 16);
    const STATIC: &str = "/static/answer.json";

    // Prime the caches; the memory store's answer becomes nginx's static file.
    let mut answer = None;
    for up in &stack.up {
        if matches!(
            up.contender,
            Contender::SluiceMemoryHit | Contender::SluiceRedisHit
        ) {
            let hit = prime(up.addr, &body)
                .await
                .with_context(|| format!("{}", up.contender))?;
            if up.contender == Contender::SluiceMemoryHit {
                answer = Some(hit);
            }
        }
    }
    let Some(answer) = answer else {
        bail!("the memory-store Sluice did not start");
    };
    let static_dir = stack.dir().join("nginx/static");
    std::fs::create_dir_all(&static_dir).with_context(|| format!("creating {static_dir:?}"))?;
    std::fs::write(static_dir.join("answer.json"), &answer)?;
    let targets: Vec<(Contender, SocketAddr, Arc<Target>)> = stack
        .up
        .iter()
        .map(|up| {
            let t = match up.contender {
                Contender::Nginx => Target::get(up.addr, STATIC),
                Contender::SluiceMemoryHit | Contender::SluiceRedisHit => {
                    Target::post_json(up.addr, CHAT, body.clone()).expecting(X_CACHE, "HIT")
                }
                _ => Target::post_json(up.addr, CHAT, body.clone()),
            };
            (up.contender, up.addr, Arc::new(t))
        })
        .collect();
    if let Some((_, _, t)) = targets.iter().find(|(c, _, _)| *c == Contender::Nginx) {
        let (status, headers, bytes) = fetch(t).await?;
        let ct = headers.get("content-type").map(|v| v.as_bytes().to_vec());
        if !status.is_success() || bytes != answer || ct.as_deref() != Some(b"application/json") {
            bail!("nginx does not serve the cached answer as application/json ({status}, {ct:?})");
        }
    }

    // Maximum throughput (closed loop), interleaved rounds.
    let mut closed: BTreeMap<Contender, Vec<LoadResult>> = BTreeMap::new();
    for _ in 0..ctx.p.rounds {
        for (c, _, t) in &targets {
            let r = closed_loop(t.clone(), ctx.p.conns, ctx.p.warmup, ctx.p.duration).await?;
            report.measured(*c, r.ok, r.errors, r.first_error.clone());
            closed.entry(*c).or_default().push(r);
        }
    }
    // Latency at half of each contender's own maximum (open loop).
    let max = |c: Contender| series(closed.get(&c), LoadResult::rps).median();
    let rate = |c: Contender| (max(c) / 2.0).max(10.0);
    let mut open: BTreeMap<Contender, Vec<LoadResult>> = BTreeMap::new();
    for _ in 0..ctx.p.rounds {
        for (c, _, t) in &targets {
            let r = open_loop(
                t.clone(),
                ctx.p.open_conns,
                rate(*c),
                ctx.p.warmup,
                ctx.p.duration,
            )
            .await?;
            report.measured(*c, r.ok, r.errors, r.first_error.clone());
            open.entry(*c).or_default().push(r);
        }
    }

    report.header = [
        "contender",
        "req/s",
        "× pass-through",
        "× nginx static",
        "p99 ms (max load)",
        "half load req/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let pct = |c: Contender, p: f64| series(open.get(&c), |r| r.ms(p));
    for (c, results) in &closed {
        let c = *c;
        let all: Vec<LoadResult> = results
            .iter()
            .chain(open.get(&c).into_iter().flatten())
            .cloned()
            .collect();
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(results), LoadResult::rps).show(0),
            ratio(&closed, c, Contender::SluiceOff).show(2),
            ratio(&closed, c, Contender::Nginx).show(2),
            series(Some(results), |r| r.ms(99.0)).show(3),
            series(open.get(&c), LoadResult::rps).show(0),
            pct(c, 50.0).show(3),
            pct(c, 99.0).show(3),
            pct(c, 99.9).show(3),
            errors_cell(&all),
        ]);
    }
    report.notes.push(format!(
        "The same deterministic chat request (`temperature: 0`) for every Sluice: pass-through \
         (plugins off) goes to the zero-latency simulator; the cache contenders were primed by \
         one request and every answer must carry `x-cache: HIT` (any other counts as an \
         error). nginx serves the memory store's hit ({} bytes) from `{STATIC}` as \
         `application/json`. Max load: {} connections, closed loop; half load: open loop at \
         half of each contender's own median maximum, latency from the intended send time.",
        answer.len(),
        ctx.p.conns
    ));
    report.checks.push(Check::at_least_rounds(
        "memory-store hits: throughput vs pass-through",
        &ratio(&closed, Contender::SluiceMemoryHit, Contender::SluiceOff),
        1.5,
        "×",
        Noise::Share,
    ));
    report.checks.push(Check::at_most_rounds(
        "memory-store hits: p99 at half load",
        &pct(Contender::SluiceMemoryHit, 99.0),
        0.5,
        "ms",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most_rounds(
        "Redis-store hits: p99 at half load",
        &pct(Contender::SluiceRedisHit, 99.0),
        2.0,
        "ms",
        Noise::Tail,
    ));
    Ok(report)
}

/// 6. 1 MiB prompts: throughput against nginx.
async fn big_prompts(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(6, title(6));
    let stack = Stack::start(ctx, &SimSpec::zero(), &Contender::WITH_BARE_PINGORA).await?;
    stack.note_down(&mut report);
    let words = "the quick brown fox jumps over the lazy dog ";
    let content: String = words.chars().cycle().take(ctx.p.big_prompt_bytes).collect();
    let body = chat_body(&content, false, 16);
    let rounds = closed_rounds(ctx, &stack, &body, ctx.p.big_conns, &mut report).await?;
    throughput_table(&mut report, &rounds, Some(body.len()));
    let runs = &rounds.runs;
    pingora_floor_note(&mut report, runs);
    report.notes.push(format!(
        "{} connections, each request a {} byte chat body.",
        ctx.p.big_conns,
        body.len()
    ));
    for c in [Contender::SluiceOff, Contender::SluiceOn] {
        let name = if c == Contender::SluiceOff {
            "plugins off"
        } else {
            "plugins on"
        };
        report.checks.push(Check::at_least_rounds(
            &format!("{name}: 1 MiB prompts, throughput vs nginx"),
            &ratio(runs, c, Contender::Nginx),
            0.8,
            "×",
            Noise::Share,
        ));
    }
    Ok(report)
}

/// One idle round of a scenario-7 contender.
struct IdleRound {
    checks_per_sec: f64,
    cpu_share: f64,
    rss_mb: f64,
}

/// Scenario 7: an idle Sluice in front of 50 backends, each probed (`/health`) and scraped
/// (`/metrics`, vLLM V1's page) every 250 ms; its CPU, against the same Sluice with health
/// checks off.
async fn health_scraping(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(7, title(7));
    let n = ctx.p.health_backends;
    let dir = tempfile::tempdir_in(ctx.root.path())?;
    // The backends are simulators in this process: they answer the checks, and their CPU is
    // not what is measured.
    let mut sims = Vec::with_capacity(n);
    for _ in 0..n {
        sims.push(vllm_sim::start(SimSpec::zero().config(free_addr()?)).await?);
    }
    let backends: Vec<SocketAddr> = sims.iter().map(|s| s.addr()).collect();
    let mut fleet = Vec::new();
    for (contender, checks) in [
        (Contender::SluiceHealthChecks, true),
        (Contender::SluiceNoHealthChecks, false),
    ] {
        let (proc, admin) =
            start_fleet_sluice(&ctx.sluice_bin, dir.path(), &backends, checks).await?;
        fleet.push((contender, proc, admin));
    }
    // Every backend checked at least once before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut runs: BTreeMap<Contender, Vec<IdleRound>> = BTreeMap::new();
    for _ in 0..ctx.p.rounds {
        for (contender, proc, admin) in &fleet {
            let pid = proc.pid().context("the fleet sluice is not running")?;
            let (before, checks_before) = (usage(pid)?, health_checks(*admin).await?);
            let started = Instant::now();
            tokio::time::sleep(ctx.p.health_idle).await;
            let (after, checks_after) = (usage(pid)?, health_checks(*admin).await?);
            let wall = started.elapsed().as_secs_f64();
            let checks = checks_after.0 - checks_before.0;
            if *contender == Contender::SluiceHealthChecks {
                // A check that failed (a scrape the health service could not read) counts
                // as an error: the CPU figure is only worth something for working checks.
                let failed = checks_after.1 - checks_before.1;
                report.measured(*contender, checks as u64, failed as u64, None);
            }
            runs.entry(*contender).or_default().push(IdleRound {
                checks_per_sec: checks / wall,
                cpu_share: after.cpu.saturating_sub(before.cpu).as_secs_f64() / wall,
                rss_mb: after.rss_bytes as f64 / 1e6,
            });
        }
    }
    report.header = [
        "contender",
        "backends",
        "checks/s",
        "CPU (% of a core)",
        "CPU µs per check",
        "RSS MB",
    ]
    .map(String::from)
    .to_vec();
    let idle_cpu = runs
        .get(&Contender::SluiceNoHealthChecks)
        .map(|r| Series(r.iter().map(|x| x.cpu_share).collect()).median())
        .unwrap_or(0.0);
    for (c, rounds) in &runs {
        let s = |f: &dyn Fn(&IdleRound) -> f64| Series(rounds.iter().map(f).collect());
        let per_check = |r: &IdleRound| {
            if r.checks_per_sec > 0.0 {
                (r.cpu_share - idle_cpu).max(0.0) * 1e6 / r.checks_per_sec
            } else {
                0.0
            }
        };
        report.rows.push(vec![
            c.label().to_string(),
            n.to_string(),
            s(&|r| r.checks_per_sec).show(0),
            s(&|r| r.cpu_share * 100.0).show(2),
            s(&per_check).show(1),
            s(&|r| r.rss_mb).show(1),
        ]);
    }
    let checked = runs
        .get(&Contender::SluiceHealthChecks)
        .map(|r| Series(r.iter().map(|x| x.cpu_share * 100.0).collect()).median())
        .unwrap_or(f64::NAN);
    report.checks.push(Check::new(
        &format!("CPU at idle, {n} backends checked every 250 ms"),
        "",
        format!("{checked:.2}% of a core"),
        None,
    ));
    report.notes.push(format!(
        "{n} simulated backends (in the harness's process), each probed and scraped every 250 ms: \
         a check is one `/health` probe or one `/metrics` scrape, counted by \
         `sluice_health_checks_total`. CPU = the run time of the Sluice process's threads over {:?} of \
         idling; per check, above the health-checks-off floor. No requests are sent.",
        ctx.p.health_idle
    ));
    Ok(report)
}

/// The totals of `sluice_health_checks_total` on an admin listener: (all, failed).
async fn health_checks(admin: SocketAddr) -> Result<(f64, f64)> {
    let (status, _, body) = fetch(&Target::get(admin, "/metrics")).await?;
    if !status.is_success() {
        bail!("GET /metrics on {admin}: {status}");
    }
    let (mut all, mut failed) = (0.0, 0.0);
    for line in String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with("sluice_health_checks_total{"))
    {
        let Some(n) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        all += n;
        if !line.contains("result=\"ok\"") {
            failed += n;
        }
    }
    Ok((all, failed))
}

/// Samples the summed VmRSS of some processes on a timer until stopped: the peak between.
pub(crate) struct RssSampler {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<u64>,
}

impl RssSampler {
    pub(crate) fn start(pids: Vec<u32>, every: Duration) -> RssSampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut peak = 0;
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => peak = peak.max(rss_sum(&pids)),
                }
            }
            peak.max(rss_sum(&pids))
        });
        RssSampler {
            stop: Some(stop),
            task,
        }
    }

    /// The peak, bytes.
    pub(crate) async fn stop(mut self) -> Result<u64> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.context("the RSS sampler panicked")
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The summed VmRSS of `pids`, bytes (a process that is gone counts 0).
pub(crate) fn rss_sum(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| status_bytes(*p, "VmRSS").ok())
        .sum()
}

/// A proxy's processes: Sluice's one, or nginx's master and workers.
pub(crate) fn proxy_pids(proc: &Proc) -> Vec<u32> {
    let Some(pid) = proc.pid() else {
        return Vec::new();
    };
    let mut pids = vec![pid];
    pids.extend(children_of(pid));
    pids
}

/// A chat request of exactly `bytes` bytes (when that is more than its JSON around the
/// message): one user message of plain ASCII words, so nothing needs escaping.
pub(crate) fn sized_chat_body(bytes: usize, max_tokens: u32) -> Bytes {
    let overhead = chat_body("", false, max_tokens).len();
    let words = "the quick brown fox jumps over the lazy dog ";
    let content: String = words
        .chars()
        .cycle()
        .take(bytes.saturating_sub(overhead))
        .collect();
    chat_body(&content, false, max_tokens)
}

/// A completion request of exactly `bytes` bytes whose prompt is a list of token ids, all 1
/// (`[1,1,...]`: two bytes per token, so 8 MiB holds 4M of them), padded with blanks; and the
/// number of ids.
fn sized_token_ids_body(bytes: usize, max_tokens: u32) -> (Bytes, usize) {
    let head = format!(
        "{{\"model\":\"{MODEL}\",\"max_tokens\":{max_tokens},\"temperature\":0,\"prompt\":["
    );
    let tail = "]}";
    let room = bytes.saturating_sub(head.len() + tail.len());
    let ids = room.div_ceil(2).max(1);
    let mut body = Vec::with_capacity(bytes.max(head.len() + tail.len() + 1));
    body.extend_from_slice(head.as_bytes());
    for i in 0..ids {
        if i > 0 {
            body.push(b',');
        }
        body.push(b'1');
    }
    // "1,1,...,1" is 2n-1 bytes: a blank before the bracket makes up an even room.
    body.resize(bytes.saturating_sub(tail.len()).max(body.len()), b' ');
    body.extend_from_slice(tail.as_bytes());
    (Bytes::from(body), ids)
}

/// One round of scenario 8 for one contender.
struct AbuseRound {
    quiet: LoadResult,
    attacked: LoadResult,
    /// Sluice's own clocks over the quiet and the attacked load (`None` for nginx).
    own_quiet: Option<OwnClock>,
    own_attacked: Option<OwnClock>,
    attack: AttackStats,
    /// How long the attack ran.
    attack_secs: f64,
    rss_before: u64,
    rss_peak: u64,
}

/// Scenario 8, abuse: the latency and errors of normal traffic (plugins on), quiet and then
/// with 50 stalled readers, 50 slowloris connections and 8 connections sending 8 MiB bodies
/// beside it; nginx under the same attack for reference.
async fn abuse(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(8, title(8));
    let p = ctx.p.clone();
    let limits = EdgeLimits {
        send_timeout: Duration::from_secs(2),
        client_header_timeout: Duration::from_secs(2),
        client_body_deadline: Duration::from_secs(5),
        per_client: 4096,
        max_buffered_bytes: 256 << 20,
    };
    // Every answer is as long as a stalled reader's `max_tokens` asks; the normal requests and
    // the big bodies ask for 16 tokens, so theirs stay short.
    let spec = SimSpec {
        answer_tokens: Some(p.abuse_stream_tokens),
        ..SimSpec::zero()
    };
    let want = [Contender::SluiceOn, Contender::Nginx];
    let stack = Stack::start_limited(ctx, &spec, &want, Some(&limits)).await?;
    stack.note_down(&mut report);
    let normal = chat_body("Hello! Say something short.", false, 16);
    let big = sized_chat_body(p.abuse_body_bytes, 16);
    // Not deterministic (temperature 1), so neither a cache nor coalescing can serve the
    // stalled readers from one upstream stream: each holds a stream of its own.
    let stall_body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "stream": true,
        "temperature": 1.0,
        "max_tokens": p.abuse_stream_tokens,
    })
    .to_string();
    let mut runs: BTreeMap<Contender, Vec<AbuseRound>> = BTreeMap::new();
    for _ in 0..p.rounds {
        for up in &stack.up {
            let target = target_for(up, CHAT, &normal);
            let Timed {
                result: quiet,
                own: own_quiet,
            } = with_own_clock(
                up.admin,
                open_loop(
                    target.clone(),
                    p.open_conns,
                    p.abuse_rate,
                    p.warmup,
                    p.duration,
                ),
            )
            .await?;
            let pids = up.proc.as_ref().map(proxy_pids).unwrap_or_default();
            let rss_before = rss_sum(&pids);
            let sampler = RssSampler::start(pids, Duration::from_millis(100));
            let attack = Attack::start(&AttackSpec {
                addr: up.addr,
                stalled: p.abuse_stalled,
                stall_request: raw_post(up.addr, CHAT, stall_body.as_bytes()),
                stall_rcvbuf: 4096,
                stall_hold: limits.send_timeout * 2,
                slowloris: p.abuse_slowloris,
                slowloris_every: Duration::from_millis(500),
                bodies: p.abuse_bodies,
                body: Arc::new(Target::post_json(up.addr, CHAT, big.clone())),
                ramp: p.abuse_lead / 2,
            });
            let started = Instant::now();
            tokio::time::sleep(p.abuse_lead).await;
            let Timed {
                result: attacked,
                own: own_attacked,
            } = with_own_clock(
                up.admin,
                open_loop(target, p.open_conns, p.abuse_rate, p.warmup, p.duration),
            )
            .await?;
            let stats = attack.stop().await?;
            let attack_secs = started.elapsed().as_secs_f64();
            let rss_peak = sampler.stop().await?;
            for r in [&quiet, &attacked] {
                report.measured(up.contender, r.ok, r.errors, r.first_error.clone());
            }
            runs.entry(up.contender).or_default().push(AbuseRound {
                quiet,
                attacked,
                own_quiet,
                own_attacked,
                attack: stats,
                attack_secs,
                rss_before,
                rss_peak,
            });
            // What the attack left behind (bodies the simulator is still parsing, connections
            // being torn down) drains before the next quiet run.
            tokio::time::sleep(p.warmup).await;
        }
    }

    report.header = [
        "contender",
        "quiet p50 ms",
        "quiet p99 ms",
        "quiet errors",
        "attacked p50 ms",
        "attacked p99 ms",
        "attacked errors",
        "p99 attacked ÷ quiet",
        "own p99 µs quiet → attacked (request p99 + answer p99)",
        "RSS MB before → peak",
        "stalled streams (stalling)",
        "slowloris cut / opened",
        "slowloris lived s",
        "big bodies/s (failed)",
    ]
    .map(String::from)
    .to_vec();
    let p99 = |rounds: &[AbuseRound], f: fn(&AbuseRound) -> &LoadResult| {
        Series(rounds.iter().map(|r| f(r).ms(99.0)).collect())
    };
    let p99_ratio = |rounds: &[AbuseRound]| {
        pairwise(
            &p99(rounds, |r| &r.attacked),
            &p99(rounds, |r| &r.quiet),
            |a, q| a / q,
        )
    };
    for (c, rounds) in &runs {
        let s = |f: &dyn Fn(&AbuseRound) -> f64| Series(rounds.iter().map(f).collect());
        let m = |f: &dyn Fn(&AbuseRound) -> f64| s(f).median();
        let quiet: Vec<LoadResult> = rounds.iter().map(|r| r.quiet.clone()).collect();
        let attacked: Vec<LoadResult> = rounds.iter().map(|r| r.attacked.clone()).collect();
        let failed = rounds.iter().map(|r| r.attack.bodies_failed).sum::<u64>();
        let mut bodies = format!(
            "{:.1} ({failed})",
            m(&|r| r.attack.bodies_ok as f64 / r.attack_secs)
        );
        if let Some(e) = rounds
            .iter()
            .find_map(|r| r.attack.first_body_error.clone())
        {
            bodies.push_str(&format!(": {}", e.chars().take(60).collect::<String>()));
        }
        report.rows.push(vec![
            c.label().to_string(),
            s(&|r| r.quiet.ms(50.0)).show(3),
            s(&|r| r.quiet.ms(99.0)).show(3),
            errors_cell(&quiet),
            s(&|r| r.attacked.ms(50.0)).show(3),
            s(&|r| r.attacked.ms(99.0)).show(3),
            errors_cell(&attacked),
            p99_ratio(rounds).show(2),
            if rounds.iter().any(|r| r.own_quiet.is_some()) {
                format!(
                    "{} → {}",
                    s(&|r| own_p99(&r.own_quiet)).show(0),
                    s(&|r| own_p99(&r.own_attacked)).show(0)
                )
            } else {
                "–".to_string()
            },
            format!(
                "{:.1} → {:.1}",
                m(&|r| r.rss_before as f64 / 1e6),
                m(&|r| r.rss_peak as f64 / 1e6)
            ),
            format!(
                "{:.0} ({:.0})",
                m(&|r| r.attack.stalled_sent as f64),
                m(&|r| r.attack.stalled_streaming as f64)
            ),
            format!(
                "{:.0} / {:.0}",
                m(&|r| r.attack.slowloris_cut as f64),
                m(&|r| r.attack.slowloris_opened as f64)
            ),
            // Only rounds in which the proxy cut one (none in the smoke run's short window).
            Series(
                rounds
                    .iter()
                    .filter(|r| r.attack.slowloris_cut > 0)
                    .map(|r| r.attack.slowloris_median_lived())
                    .collect(),
            )
            .show(2),
            bodies,
        ]);
    }
    let other: Vec<String> = runs
        .iter()
        .flat_map(|(c, rounds)| {
            rounds.iter().flat_map(move |r| {
                let mut v = Vec::new();
                if let Some(line) = &r.attack.stalled_other {
                    v.push(format!("{c}: a stalled reader was answered `{line}`"));
                }
                if let Some(e) = &r.attack.first_connect_error {
                    v.push(format!(
                        "{c}: {} attacker connections failed ({e})",
                        r.attack.connect_errors
                    ));
                }
                v
            })
        })
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for n in other {
        if seen.insert(n.clone()) {
            report.notes.push(n);
        }
    }
    report.notes.push(format!(
        "Normal traffic: {rate:.0} non-stream chat requests/s (`max_tokens: 16`), open loop over up \
         to {conns} connections, latency from each request's intended send time; plugins on \
         with a prompt of its own per request (cache misses). Each round runs it quiet ({w:?} \
         warm-up + {d:?} measured), then again with the attack running: started {lead:?} before \
         the normal traffic, stopped when it ends.",
        rate = p.abuse_rate,
        conns = p.open_conns,
        w = p.warmup,
        d = p.duration,
        lead = p.abuse_lead,
    ));
    report.notes.push(format!(
        "The attack, all from 127.0.0.1, each attacker's first connection spread over {ramp:?}: \
         {stalled} stalled readers (a socket with `SO_RCVBUF` 4096 posts a streamed chat request \
         with `max_tokens: {tokens}` and `temperature: 1` to the zero-latency simulator, never \
         reads, and lets go with a reset after {hold:?} to {hold_max:?}, then starts over: it \
         cannot see a proxy's cut, whose FIN waits behind the unread answer; \"stalling\" counts \
         the requests whose `200` was waiting unread when it let go); {slow} slowloris \
         connections (a header trickled one byte per 500 ms, never finished; a new one as soon \
         as the proxy closes one; \"lived\" is the median life of those it closed); {bodies} \
         connections sending a {size} byte chat request (one huge message, `temperature: 0`, \
         `max_tokens: 16`) back to back. With plugins on, those big bodies are cache hits after \
         the first (a deterministic request), but each is still read and parsed whole.",
        ramp = p.abuse_lead / 2,
        stalled = p.abuse_stalled,
        tokens = p.abuse_stream_tokens,
        hold = limits.send_timeout * 2,
        hold_max = limits.send_timeout * 3,
        slow = p.abuse_slowloris,
        bodies = p.abuse_bodies,
        size = big.len(),
    ));
    report.notes.push(format!(
        "Bounds, short so that they act within the measured window: Sluice `limits` \
         `send_timeout: {st:?}`, `client_header_timeout: {ht:?}`, `client_body_deadline: \
         {bd:?}`, `max_buffered_bytes: {mb}` (the attack's bodies in flight, {inflight} bytes, \
         fit); nginx `send_timeout {st:?}` and `client_header_timeout {ht:?}`. Every client is \
         127.0.0.1, so Sluice's per-client caps (`max_connections_per_client`, \
         `max_requests_in_flight_per_client`) are set to {pc}: one address's normal traffic and \
         attack together fit, and the caps are not what this measures.",
        st = limits.send_timeout,
        ht = limits.client_header_timeout,
        bd = limits.client_body_deadline,
        mb = limits.max_buffered_bytes,
        inflight = big.len() * p.abuse_bodies,
        pc = limits.per_client,
    ));
    report.notes.push(
        "The attack shares the 2 cores with the proxy, the simulator and the load generator \
         (writing and parsing the big bodies costs CPU everywhere), so some of the attacked \
         latency is the machine's: nginx under the same attack is the reference. RSS: the \
         proxy's processes (nginx: master and workers) before the attack and at its peak, \
         sampled every 100 ms. The attack columns are medians per round."
            .to_string(),
    );
    let sluice = runs.get(&Contender::SluiceOn);
    let failed = sluice.map(|rounds| {
        rounds
            .iter()
            .map(|r| r.attacked.errors + r.attacked.missed)
            .sum::<u64>()
    });
    report.checks.push(Check::new(
        "plugins on, under attack: failed normal requests (errors and not sent)",
        "= 0",
        failed.map(|n| n.to_string()).unwrap_or_else(|| "–".into()),
        failed.map(|n| n == 0),
    ));
    // Judged on Sluice's own time, round by round: the end-to-end figure carries the attack's
    // load on the load generator and the simulator (they share the 2 cores), which is not
    // Sluice's.
    let own_ratio = Series(
        sluice
            .map(|rounds| {
                rounds
                    .iter()
                    .map(|r| own_p99(&r.own_attacked) / own_p99(&r.own_quiet))
                    .collect()
            })
            .unwrap_or_default(),
    );
    report.checks.push(Check::at_most_rounds(
        "plugins on: Sluice's own time under attack over quiet (request p99 + answer p99)",
        &own_ratio,
        2.0,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most_rounds(
        "plugins on: normal p99 under attack over quiet p99 (end to end)",
        &sluice.map(|r| p99_ratio(r)).unwrap_or_default(),
        2.0,
        "×",
        Noise::Tail,
    ));
    Ok(report)
}

/// Sluice's own time in µs over a load: its request phase's p99 and its answer's p99, added
/// (an upper bound of the two phases' p99 together, as scenario 15 shows it).
fn own_p99(own: &Option<OwnClock>) -> f64 {
    own.as_ref().map_or(f64::NAN, |o| {
        o.quantile_us(Phase::Request, 0.99) + o.quantile_us(Phase::Chunk, 0.99)
    })
}

/// One measurement of scenario 9: a fresh proxy, large bodies through it.
struct MemoryRound {
    requests: u64,
    errors: u64,
    first_error: Option<String>,
    idle: u64,
    /// The peak of VmRSS sampled every 20 ms.
    sampled_peak: u64,
    /// VmHWM after it was reset at idle (None when it could not be reset).
    hwm_peak: Option<u64>,
}

impl MemoryRound {
    /// The rise above idle: VmHWM's when it was reset (exact), else the samples'.
    fn rise(&self) -> u64 {
        self.hwm_peak
            .unwrap_or(self.sampled_peak)
            .max(self.sampled_peak)
            .saturating_sub(self.idle)
    }
}

/// Starts a fresh scenario-9 contender in `dir` in front of `upstream`.
async fn start_fresh(
    ctx: &Ctx,
    c: Contender,
    dir: &std::path::Path,
    upstream: SocketAddr,
) -> Result<(Proc, SocketAddr)> {
    match c {
        Contender::SluiceOff => {
            start_sluice(&ctx.sluice_bin, dir, upstream, &Setup::Off, None).await
        }
        Contender::SluiceOn => start_sluice(&ctx.sluice_bin, dir, upstream, &Setup::On, None).await,
        Contender::Nginx => match &ctx.nginx {
            Ok(bin) => start_nginx(bin, dir, upstream, None).await,
            Err(e) => bail!("nginx: {e}"),
        },
        _ => bail!("{c} is not a scenario-9 contender"),
    }
}

/// One kind of large body of scenario 9.
struct BodyCase {
    name: &'static str,
    path: &'static str,
    body: Bytes,
    /// Where "plugins on" writes its per-request counter, and what follows the counter.
    mark: &'static [u8],
    sep: &'static [u8],
}

/// Room left in each body for the per-request counter of "plugins on" (see `Target::varied`),
/// so that the varied body stays within `max_request_body_bytes`.
const VARY_ROOM: usize = 24;

/// Scenario 5's cache contenders: only hits count.
const X_CACHE: http::HeaderName = http::HeaderName::from_static("x-cache");

/// Scenario 9, large request bodies: a fresh proxy's peak RSS above idle while 4 connections
/// send 8 MiB bodies (a chat message; a completion's token ids), plugins off and on; nginx for
/// context.
async fn large_bodies(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(9, title(9));
    let p = ctx.p.clone();
    // The simulator only: each measurement starts its proxy afresh, so that no heap kept from
    // an earlier one hides a rise.
    let stack = Stack::start(ctx, &SimSpec::zero(), &[]).await?;
    let mut want = vec![Contender::SluiceOff, Contender::SluiceOn];
    match &ctx.nginx {
        Ok(_) => want.push(Contender::Nginx),
        Err(e) if ctx.require_nginx => bail!("nginx: {e}"),
        Err(e) => report
            .notes
            .push(format!("{} unavailable: {e}", Contender::Nginx)),
    }
    let size = p.memory_body_bytes.saturating_sub(VARY_ROOM);
    let (ids_body, ids) = sized_token_ids_body(size, 16);
    const COMPLETIONS: &str = "/v1/completions";
    let cases = [
        BodyCase {
            name: "chat, one huge message",
            path: CHAT,
            body: sized_chat_body(size, 16),
            mark: b"\"content\":\"",
            sep: b" ",
        },
        BodyCase {
            name: "completions, token ids",
            path: COMPLETIONS,
            body: ids_body,
            mark: b"\"prompt\":[",
            sep: b",",
        },
    ];
    let hello = chat_body("Hello!", false, 16);
    let mut runs: BTreeMap<(usize, Contender), Vec<MemoryRound>> = BTreeMap::new();
    for _ in 0..p.rounds {
        for (case, bc) in cases.iter().enumerate() {
            for &c in &want {
                let (proc, addr) = start_fresh(ctx, c, stack.dir(), stack.sim.addr).await?;
                // One small request first: connection pools, worker threads and whatever is
                // built lazily exist before the idle reading.
                let (status, _, answer) = fetch(&Target::post_json(addr, CHAT, hello.clone()))
                    .await
                    .with_context(|| format!("{c}: the first request"))?;
                if !status.is_success() {
                    bail!(
                        "{c}: the first request: HTTP {status}: {}",
                        String::from_utf8_lossy(&answer)
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let pids = proxy_pids(&proc);
                let hwm_reset = pids.iter().all(|p| reset_peak_rss(*p).is_ok());
                let idle = rss_sum(&pids);
                let sampler = RssSampler::start(pids.clone(), Duration::from_millis(20));
                let mut target = Target::post_json(addr, bc.path, bc.body.clone());
                if c == Contender::SluiceOn {
                    target = target.varied_after(bc.mark, bc.sep);
                }
                let target = Arc::new(target);
                let mut tasks = Vec::new();
                for _ in 0..p.memory_conns {
                    let target = target.clone();
                    let repeats = p.memory_repeats;
                    tasks.push(tokio::spawn(async move {
                        let mut conn = None;
                        let (mut ok, mut errors, mut first) = (0u64, 0u64, None);
                        for _ in 0..repeats {
                            match send_one(&mut conn, &target).await {
                                Ok(_) => ok += 1,
                                Err(e) => {
                                    errors += 1;
                                    first = first.or(Some(format!("{e:#}")));
                                }
                            }
                        }
                        (ok, errors, first)
                    }));
                }
                let mut round = MemoryRound {
                    requests: 0,
                    errors: 0,
                    first_error: None,
                    idle,
                    sampled_peak: 0,
                    hwm_peak: None,
                };
                for t in tasks {
                    let (ok, errors, first) = t.await.context("a sender panicked")?;
                    round.requests += ok + errors;
                    round.errors += errors;
                    round.first_error = round.first_error.take().or(first);
                }
                round.sampled_peak = sampler.stop().await?;
                if hwm_reset {
                    let hwm: Result<Vec<u64>> =
                        pids.iter().map(|p| status_bytes(*p, "VmHWM")).collect();
                    round.hwm_peak = hwm.ok().map(|v| v.iter().sum());
                }
                report.measured(c, round.requests, round.errors, round.first_error.clone());
                runs.entry((case, c)).or_default().push(round);
                drop(proc);
            }
        }
    }

    let in_flight = (p.memory_conns * p.memory_body_bytes) as f64;
    report.header = [
        "contender",
        "bodies",
        "requests",
        "RSS idle MB",
        "peak rise MB (sampled)",
        "peak rise MB (VmHWM)",
        "rise per MB in flight",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    for ((case, c), rounds) in &runs {
        let s = |f: &dyn Fn(&MemoryRound) -> f64| Series(rounds.iter().map(f).collect());
        let errors: u64 = rounds.iter().map(|r| r.errors).sum();
        let first = rounds.iter().find_map(|r| r.first_error.clone());
        report.rows.push(vec![
            c.label().to_string(),
            cases[*case].name.to_string(),
            s(&|r| r.requests as f64).show(0),
            s(&|r| r.idle as f64 / 1e6).show(1),
            s(&|r| r.sampled_peak.saturating_sub(r.idle) as f64 / 1e6).show(1),
            s(&|r| {
                r.hwm_peak
                    .map(|h| h.saturating_sub(r.idle) as f64 / 1e6)
                    .unwrap_or(f64::NAN)
            })
            .show(1),
            s(&|r| r.rise() as f64 / in_flight).show(2),
            match first {
                Some(e) => format!("{errors}: {}", e.chars().take(80).collect::<String>()),
                None => errors.to_string(),
            },
        ]);
    }
    report.notes.push(format!(
        "{conns} connections at once, each sending {repeats} bodies of {chat} bytes (chat: one \
         user message of plain words) or {ids} bytes (`/v1/completions`, `prompt` a list of \
         token ids `[1,1,...]`, {n} of them, one token each) back to back, `max_tokens: 16`, \
         `temperature: 0`; {mib:.0} MiB of body in flight at once. Plugins on gets a counter at \
         the head of each prompt (a cache miss and a store every time), hence the bodies are \
         {VARY_ROOM} bytes short of {full}.",
        conns = p.memory_conns,
        repeats = p.memory_repeats,
        chat = cases[0].body.len(),
        ids = cases[1].body.len(),
        n = ids,
        mib = in_flight / f64::from(1 << 20),
        full = p.memory_body_bytes,
    ));
    report.notes.push(
        "Each measurement starts its proxy afresh, sends one small request, waits 100 ms and \
         takes the idle RSS; then VmRSS is sampled every 20 ms, and VmHWM (the kernel's exact \
         peak, reset to the idle RSS through `/proc/PID/clear_refs` first) read at the end. The \
         rise is the peak above idle (VmHWM's when it could be reset); per MB in flight it is \
         divided by the bytes of body in flight at once. nginx (master and workers, summed; \
         `proxy_request_buffering off`, so it streams bodies through) is context, unchecked."
            .to_string(),
    );
    for &c in &[Contender::SluiceOff, Contender::SluiceOn] {
        let name = if c == Contender::SluiceOff {
            "plugins off"
        } else {
            "plugins on"
        };
        for (case, bc) in cases.iter().enumerate() {
            let rise = runs
                .get(&(case, c))
                .map(|r| Series(r.iter().map(|x| x.rise() as f64 / 1e6).collect()).median())
                .unwrap_or(f64::NAN);
            report.checks.push(Check::at_most(
                &format!("{name}, {}: peak RSS rise", bc.name),
                rise,
                80.0,
                "MB",
                Noise::Share,
            ));
        }
    }
    Ok(report)
}
