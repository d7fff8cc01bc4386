//! What each plugin costs, and long prompts. Scenario 18: Sluice with plugins off, each plugin
//! on alone, and all on (cache misses), at one fixed moderate rate: the proxy's CPU time per
//! request (its threads' run time over the run ÷ requests) and added p99, each against plugins off in
//! the same round. Scenario 19: streams with 220 KB prompts at concurrency 150: added TTFT and
//! the proxy's CPU per stream.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use anyhow::{Context, Result};
use http::header::{HeaderValue, AUTHORIZATION};

use crate::contenders::{tree_usage, Contender, SimSpec, TENANT_KEY};
use crate::loadgen::{open_loop, LoadResult, Target};
use crate::report::{pairwise, Check, Noise, ScenarioReport, Series};
use crate::scenarios::{
    chat_body, each_round, errors_cell, errors_cell_sse, series, target_for, title, Stack, Tally,
    CHAT,
};
use crate::sse::{self, SseLoad, SseResult};
use crate::Ctx;

/// Scenario 18's contenders: the floor, plugins off, each plugin alone, all on.
const EACH_PLUGIN: [Contender; 8] = [
    Contender::Direct,
    Contender::SluiceOff,
    Contender::SluiceOnlyRequestId,
    Contender::SluiceTenantsLocal,
    Contender::SluiceOnlyCache,
    Contender::SluiceOnlyKvBreaker,
    Contender::SluiceOnlySpeculative,
    Contender::SluiceOn,
];

/// A measure of one round: its load and the proxy's CPU per request (µs).
struct Measured<T> {
    result: T,
    cpu_us: f64,
}

impl<T: Tally> Tally for Measured<T> {
    fn tally(&self) -> (u64, u64, Option<String>) {
        self.result.tally()
    }
}

/// Runs `load` and measures the CPU time of `pid`'s processes over it, in µs per `per` of its
/// result (requests or streams).
async fn with_cpu<T>(
    pid: Option<u32>,
    load: impl Future<Output = Result<T>>,
    per: impl FnOnce(&T) -> f64,
) -> Result<Measured<T>> {
    let cpu = || {
        pid.and_then(|p| tree_usage(p).ok())
            .map(|u| u.cpu.as_secs_f64())
    };
    let before = cpu();
    let result = load.await?;
    let cpu_us = match (before, cpu()) {
        // Never below zero, as the other scenarios' `saturating_sub` (see `usage`).
        (Some(b), Some(a)) => (a - b).max(0.0) * 1e6 / per(&result).max(1.0),
        _ => f64::NAN,
    };
    Ok(Measured { result, cpu_us })
}

/// `f` of `c` over `f` of `base`, round by round.
fn per_round<T>(
    runs: &BTreeMap<Contender, Vec<Measured<T>>>,
    c: Contender,
    base: Contender,
    f: impl Fn(&Measured<T>) -> f64 + Copy,
    op: impl Fn(f64, f64) -> f64,
) -> Series {
    pairwise(&series(runs.get(&c), f), &series(runs.get(&base), f), op)
}

/// Interleaved rounds of `load`'s streams, each contender asked with `body`
/// ([`target_for`]), each round with the proxy's CPU per stream.
async fn measured_streams(
    rounds: usize,
    stack: &Stack,
    report: &mut ScenarioReport,
    body: &bytes::Bytes,
    load: &SseLoad,
) -> Result<BTreeMap<Contender, Vec<Measured<SseResult>>>> {
    each_round(rounds, stack, report, |up| {
        let load = sse::run(
            target_for(up, CHAT, body),
            load.clone(),
            Arc::new(AtomicUsize::new(0)),
        );
        with_cpu(up.pid(&stack.sim), load, |r: &SseResult| r.streams as f64)
    })
    .await
}

/// 18. Each plugin's cost at a fixed rate.
pub async fn each_plugin(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(18, title(18));
    let p = ctx.p.clone();
    let stack = Stack::start(ctx, &SimSpec::zero(), &EACH_PLUGIN).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", false, 16);
    let auth = HeaderValue::from_str(&format!("Bearer {TENANT_KEY}"))
        .context("the Authorization header")?;
    // The CPU counts the warm-up too: divided by every request due in the run.
    let due = p.plugin_rate * (p.warmup + p.duration).as_secs_f64();
    let runs = each_round(p.rounds, &stack, &mut report, |up| {
        // Every request a prompt of its own for every contender, so that the cache misses and
        // the contenders differ by their plugins only; the tenant's key for tenants.
        let mut target = Target::post_json(up.addr, CHAT, body.clone()).varied();
        if up.contender == Contender::SluiceTenantsLocal {
            target = target.with_header(AUTHORIZATION, auth.clone());
        }
        let load = open_loop(
            Arc::new(target),
            p.open_conns,
            p.plugin_rate,
            p.warmup,
            p.duration,
        );
        with_cpu(up.pid(&stack.sim), load, move |_| due)
    })
    .await?;
    report.header = [
        "contender",
        "req/s done",
        "CPU µs/req",
        "CPU × plugins off",
        "CPU µs/req over plugins off",
        "p50 ms",
        "p99 ms",
        "added p99 ms over plugins off",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let cpu = |m: &Measured<LoadResult>| m.cpu_us;
    let p99 = |m: &Measured<LoadResult>| m.result.ms(99.0);
    let off = Contender::SluiceOff;
    for (c, rounds) in &runs {
        let c = *c;
        let results: Vec<LoadResult> = rounds.iter().map(|m| m.result.clone()).collect();
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(&results), LoadResult::rps).show(0),
            series(Some(rounds), cpu).show(1),
            per_round(&runs, c, off, cpu, |a, b| a / b).show(2),
            per_round(&runs, c, off, cpu, |a, b| a - b).show(1),
            series(Some(&results), |r| r.ms(50.0)).show(3),
            series(Some(&results), |r| r.ms(99.0)).show(3),
            per_round(&runs, c, off, p99, |a, b| a - b).show(3),
            errors_cell(&results),
        ]);
    }
    report.notes.push(format!(
        "Non-stream chat at {:.0} requests/s (open loop, up to {} connections, {:?} warm-up + \
         {:?} measured per contender per round), zero-latency simulator. Every contender gets \
         a prompt of its own per request (the cache misses and stores). CPU: the run time of \
         the proxy's threads (/proc/PID/task/*/schedstat, in ns) over the whole run (warm-up \
         included) ÷ the requests due in it (the simulator's for direct). `tenants` alone: one tenant whose \
         key every request carries, limits local and too high to refuse (scenario 12's). \
         \"all on\" is `PLUGINS` of src/contenders.rs (request_id, cache, speculative, \
         kv_breaker), without tenants.",
        p.plugin_rate, p.open_conns, p.warmup, p.duration
    ));
    report.checks.push(Check::at_most_rounds(
        "all plugins on (cache miss): CPU per request vs plugins off",
        &per_round(&runs, Contender::SluiceOn, off, cpu, |a, b| a / b),
        1.15,
        "×",
        Noise::Share,
    ));
    Ok(report)
}

/// Scenario 26, what traces cost: streams through Sluice with every plugin on, traces off,
/// at sampling 0.1 and at 1.0 (each to an OTLP/HTTP receiver of its own), CPU per stream
/// and TTFT.
pub async fn tracing_cost(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(26, title(26));
    let p = ctx.p.clone();
    let contenders = [
        Contender::SluiceOn,
        Contender::SluiceTraced01,
        Contender::SluiceTraced10,
    ];
    let stack = Stack::start(ctx, &SimSpec::streaming(0.0, 16), &contenders).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", true, 16);
    let load = SseLoad {
        concurrency: p.stream_concurrency,
        duration: p.stream_duration,
        once: false,
        ramp: p.open_stream_ramp,
    };
    let runs = measured_streams(p.rounds, &stack, &mut report, &body, &load).await?;
    report.header = [
        "contender",
        "streams",
        "CPU µs/stream",
        "CPU × traces off",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "added TTFT p99 ms over traces off",
        "spans received",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let cpu = |m: &Measured<SseResult>| m.cpu_us;
    let ttft = |q: f64| move |m: &Measured<SseResult>| m.result.ttft_ms(q);
    let off = Contender::SluiceOn;
    for (c, rounds) in &runs {
        let c = *c;
        let results: Vec<SseResult> = rounds.iter().map(|m| m.result.clone()).collect();
        let received = stack
            .receivers
            .iter()
            .find(|(rc, _)| *rc == c)
            .map_or_else(|| "-".to_string(), |(_, r)| r.spans().len().to_string());
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(&results), |r| r.streams as f64).show(0),
            series(Some(rounds), cpu).show(1),
            per_round(&runs, c, off, cpu, |a, b| a / b).show(3),
            series(Some(rounds), ttft(50.0)).show(3),
            series(Some(rounds), ttft(99.0)).show(3),
            per_round(&runs, c, off, ttft(99.0), |a, b| a - b).show(3),
            received,
            errors_cell_sse(&results),
        ]);
    }
    report.notes.push(format!(
        "{} streams open at a time, each a streamed chat request of its own (the cache misses) \
         of 16 tokens from the zero-latency simulator, through Sluice with every plugin on. \
         Traced: `telemetry` to an OTLP/HTTP receiver in the harness's process, at sampling \
         0.1 or 1.0 (a request is 2 spans: the request's and its attempt's). CPU: the run time \
         of the proxy's threads (its export thread included) over the round ÷ streams done.",
        p.stream_concurrency
    ));
    for (c, target) in [
        (Contender::SluiceTraced01, 1.02),
        (Contender::SluiceTraced10, 1.10),
    ] {
        report.checks.push(Check::at_most_rounds(
            &format!("{}: CPU per stream × traces off", c.label()),
            &per_round(&runs, c, off, cpu, |a, b| a / b),
            target,
            "×",
            Noise::Share,
        ));
    }
    Ok(report)
}

/// 19. Streams with long prompts: added TTFT and CPU per stream.
pub async fn long_prompts(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(19, title(19));
    let p = ctx.p.clone();
    let stack = Stack::start(
        ctx,
        &SimSpec::streaming(0.0, 16),
        &Contender::WITH_BARE_PINGORA,
    )
    .await?;
    stack.note_down(&mut report);
    let words = "the quick brown fox jumps over the lazy dog ";
    let content: String = words.chars().cycle().take(p.long_prompt_bytes).collect();
    let body = chat_body(&content, true, 16);
    let load = SseLoad {
        concurrency: p.long_prompt_concurrency,
        duration: p.stream_duration,
        once: false,
        ramp: p.open_stream_ramp,
    };
    let runs = measured_streams(p.rounds, &stack, &mut report, &body, &load).await?;
    report.header = [
        "contender",
        "streams",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "added TTFT p50 ms",
        "added TTFT p99 ms",
        "CPU µs/stream",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let ttft = |q: f64| move |m: &Measured<SseResult>| m.result.ttft_ms(q);
    let direct = Contender::Direct;
    for (c, rounds) in &runs {
        let c = *c;
        let results: Vec<SseResult> = rounds.iter().map(|m| m.result.clone()).collect();
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(&results), |r| r.streams as f64).show(0),
            series(Some(rounds), ttft(50.0)).show(3),
            series(Some(rounds), ttft(99.0)).show(3),
            per_round(&runs, c, direct, ttft(50.0), |a, b| a - b).show(3),
            per_round(&runs, c, direct, ttft(99.0), |a, b| a - b).show(3),
            series(Some(rounds), |m| m.cpu_us).show(0),
            errors_cell_sse(&results),
        ]);
    }
    report.notes.push(format!(
        "{} streams open at a time, each on a fresh connection, each a streamed chat request \
         with a {} byte body (one user message of plain words; plugins on: a prompt of its \
         own per request, so the cache misses), 16 tokens from the zero-latency simulator. \
         TTFT counts from sending the request, so it includes sending the body. CPU: the \
         run time of the proxy's threads over the round ÷ streams done.",
        p.long_prompt_concurrency,
        body.len()
    ));
    report.checks.push(Check::at_most_rounds(
        "plugins on: added TTFT p99 with 220 KB prompts",
        &per_round(&runs, Contender::SluiceOn, direct, ttft(99.0), |a, b| a - b),
        5.0,
        "ms",
        Noise::Tail,
    ));
    Ok(report)
}
