//! The market's public benchmark method (how gateways publish their overhead figures)
//! as three scenarios: 15, added latency at concurrency 1 over going direct; 16, the highest
//! rate sustained behind a 20 ms mock (p99 under 1 s, under 0.1 % errors), with the proxy's
//! RSS before, during and after; 17, streams of 64 deltas 20 ms apart: added TTFT and
//! inter-frame gaps. Contenders: direct, nginx, bare Pingora, Sluice plugins off and on.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

use crate::contenders::{Contender, SimSpec};
use crate::loadgen::{closed_loop, open_loop, LoadResult, Target};
use crate::own_clock::{OwnClock, Phase};
use crate::report::{pairwise, Check, Noise, ScenarioReport, Series};
use crate::scenarios::{
    chat_body, each_round, errors_cell, errors_cell_sse, proxy_pids, rss_sum, series,
    stream_rounds, target_for, title, RssSampler, Stack, Tally, Up, CHAT,
};
use crate::sse::{SseLoad, SseResult};
use crate::{Ctx, Params};

/// The public method's contenders.
const PUBLIC: [Contender; 5] = Contender::WITH_BARE_PINGORA;

/// `c`'s value over `base`'s in each round, for a per-round measure `f`.
fn added<T>(
    runs: &BTreeMap<Contender, Vec<T>>,
    c: Contender,
    base: Contender,
    f: impl Fn(&T) -> f64 + Copy,
) -> Series {
    pairwise(
        &series(runs.get(&c), f),
        &series(runs.get(&base), f),
        |a, b| a - b,
    )
}

/// `c`'s added value over `base`'s added value (both over direct), per round: the ratio of
/// what each proxy adds.
fn added_ratio<T>(
    runs: &BTreeMap<Contender, Vec<T>>,
    c: Contender,
    base: Contender,
    f: impl Fn(&T) -> f64 + Copy,
) -> Series {
    pairwise(
        &added(runs, c, Contender::Direct, f),
        &added(runs, base, Contender::Direct, f),
        |a, b| a / b,
    )
}

/// 15. Added latency at concurrency 1 over direct.
pub async fn concurrency_one(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(15, title(15));
    let stack = Stack::start(ctx, &SimSpec::zero(), &PUBLIC).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", false, 16);
    let p = ctx.p.clone();
    let timed = each_round(p.rounds, &stack, &mut report, |up| {
        let load = closed_loop(target_for(up, CHAT, &body), 1, p.warmup, p.duration);
        with_own_clock(up.admin, load)
    })
    .await?;
    let runs: BTreeMap<Contender, Vec<LoadResult>> = timed
        .iter()
        .map(|(c, rounds)| (*c, rounds.iter().map(|t| t.result.clone()).collect()))
        .collect();
    report.header = [
        "contender",
        "req/s",
        "p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
        "added p99 × nginx's",
        "added p99 × bare Pingora's",
        "own p50 / p99 µs: request",
        "own p50 / p99 µs: answer",
        "own p99 µs: both",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let p = |q: f64| move |r: &LoadResult| r.ms(q);
    let own = |c: Contender, phase: Option<Phase>, q: f64| {
        series(timed.get(&c), |t: &Timed| {
            t.own.as_ref().map_or(f64::NAN, |o| match phase {
                Some(phase) => o.quantile_us(phase, q),
                None => o.quantile_us(Phase::Request, q) + o.quantile_us(Phase::Chunk, q),
            })
        })
    };
    for (c, results) in &runs {
        let c = *c;
        let sluice = timed
            .get(&c)
            .is_some_and(|t| t.iter().any(|t| t.own.is_some()));
        let own_cell = |phase| {
            if sluice {
                format!(
                    "{} / {}",
                    own(c, Some(phase), 0.5).show(0),
                    own(c, Some(phase), 0.99).show(0)
                )
            } else {
                "–".into()
            }
        };
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(results), LoadResult::rps).show(0),
            series(Some(results), p(50.0)).show(3),
            series(Some(results), p(99.0)).show(3),
            added(&runs, c, Contender::Direct, p(50.0)).show(3),
            added(&runs, c, Contender::Direct, p(99.0)).show(3),
            added_ratio(&runs, c, Contender::Nginx, p(99.0)).show(2),
            added_ratio(&runs, c, Contender::BarePingora, p(99.0)).show(2),
            own_cell(Phase::Request),
            own_cell(Phase::Chunk),
            if sluice {
                own(c, None, 0.99).show(0)
            } else {
                "–".into()
            },
            errors_cell(results),
        ]);
    }
    report.notes.push(format!(
        "One connection, one request at a time (closed loop), {:?} per contender per round after \
         {:?} of warm-up; zero-latency simulator. \"Added\" is over direct in the same round. \
         \"Own\": Sluice's clocks (`sluice_added_seconds`, interpolated within its 10 µs \
         buckets): \"request\" from the body read whole to the request written upstream, \
         \"answer\" from the answer's chunk read to its write to the client returning; \
         \"both\" adds the two p99s, an upper estimate of a request's p99. The targets are \
         judged on every round of \"both\": SPLIT when the rounds fall on both sides.",
        ctx.p.duration, ctx.p.warmup
    ));
    for (c, bound) in [(Contender::SluiceOff, 110.0), (Contender::SluiceOn, 150.0)] {
        report.checks.push(Check::at_most_rounds(
            &format!(
                "{}: own time p99 at concurrency 1 (request + answer)",
                c.label()
            ),
            &own(c, None, 0.99),
            bound,
            "µs",
            Noise::Tail,
        ));
    }
    Ok(report)
}

/// A round's load and what Sluice's own clocks counted over it (`None` for the other
/// contenders).
pub(crate) struct Timed {
    pub(crate) result: LoadResult,
    /// Sluice's own clocks over the load, when it has an admin listener.
    pub(crate) own: Option<OwnClock>,
}

impl Tally for Timed {
    fn tally(&self) -> (u64, u64, Option<String>) {
        self.result.tally()
    }
}

/// Runs `load`, reading Sluice's clocks at `admin` (when it has one) before and after.
pub(crate) async fn with_own_clock(
    admin: Option<std::net::SocketAddr>,
    load: impl std::future::Future<Output = Result<LoadResult>>,
) -> Result<Timed> {
    let before = match admin {
        Some(admin) => Some(OwnClock::read(admin).await?),
        None => None,
    };
    let result = load.await?;
    let own = match (admin, before) {
        (Some(admin), Some(before)) => Some(OwnClock::read(admin).await?.since(&before)),
        _ => None,
    };
    Ok(Timed { result, own })
}

/// One step of the rate search.
struct Step {
    rate: f64,
    result: LoadResult,
}

impl Step {
    /// Errors and requests not sent, as a share of every request due in the window.
    fn error_share(&self) -> f64 {
        let r = &self.result;
        let bad = (r.errors + r.missed) as f64;
        bad / ((r.ok + r.errors + r.missed) as f64).max(1.0)
    }

    /// Sustained: p99 under 1 s, under 0.1 % errors, and nearly every request due done.
    fn sustained(&self) -> bool {
        self.result.ms(99.0) < 1000.0
            && self.error_share() < 0.001
            && self.result.rps() >= 0.95 * self.rate
    }
}

/// What one contender's search found.
struct Search {
    steps: Vec<Step>,
    /// The highest sustained rate (0 when even the first step failed).
    best: f64,
    rss_before: u64,
    rss_peak: u64,
    rss_after: u64,
}

/// 16. The highest request rate sustained behind a 20 ms mock, and RSS before, during, after.
pub async fn max_rate(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(16, title(16));
    let p = ctx.p.clone();
    let spec = SimSpec {
        overhead_ms: 20.0,
        answer_tokens: Some(16),
        ..SimSpec::zero()
    };
    let stack = Stack::start(ctx, &spec, &PUBLIC).await?;
    stack.note_down(&mut report);
    let body = chat_body("Hello! Say something short.", false, 16);
    // The cache on, every request its own prompt: the memory store grows to its bound over
    // the first search, by how many requests this machine sends in it. Filled first, so that
    // "RSS after ÷ before" is what a load leaves behind, not how far the cache got.
    let filled = match stack.up.iter().find(|u| u.contender == Contender::SluiceOn) {
        Some(
            up @ Up {
                admin: Some(admin), ..
            },
        ) => Some(fill_cache(*admin, target_for(up, CHAT, &body), &p).await?),
        _ => None,
    };
    let mut found: BTreeMap<Contender, Vec<Search>> = BTreeMap::new();
    for _ in 0..p.rounds {
        for up in &stack.up {
            let target = target_for(up, CHAT, &body);
            let pids = up.proc.as_ref().map(proxy_pids).unwrap_or_default();
            let rss_before = rss_sum(&pids);
            let sampler = RssSampler::start(pids.clone(), Duration::from_millis(100));
            let mut steps = Vec::new();
            let run = |rate: f64| {
                let target = target.clone();
                async move {
                    let result =
                        open_loop(target, p.public_conns, rate, p.warmup, p.public_step).await?;
                    Ok::<_, anyhow::Error>(Step { rate, result })
                }
            };
            // Doubling steps until one fails, then bisections between the last good one and it.
            let (mut good, mut bad) = (0.0, f64::NAN);
            let mut rate = p.public_rate_start;
            while rate <= p.public_rate_max {
                let step = run(rate).await?;
                let ok = step.sustained();
                steps.push(step);
                if !ok {
                    bad = rate;
                    break;
                }
                good = rate;
                rate *= 2.0;
            }
            if bad.is_finite() {
                for _ in 0..p.public_bisections {
                    let mid = (good + bad) / 2.0;
                    let step = run(mid).await?;
                    if step.sustained() {
                        good = mid;
                    } else {
                        bad = mid;
                    }
                    steps.push(step);
                }
            }
            let rss_peak = sampler.stop().await?;
            tokio::time::sleep(p.settle).await;
            let rss_after = rss_sum(&pids);
            let (ok, errors) = steps
                .iter()
                .fold((0, 0), |(o, e), s| (o + s.result.ok, e + s.result.errors));
            let first = steps.iter().find_map(|s| s.result.first_error.clone());
            report.measured(up.contender, ok, errors, first);
            found.entry(up.contender).or_default().push(Search {
                steps,
                best: good,
                rss_before,
                rss_peak,
                rss_after,
            });
        }
    }
    report.header = [
        "contender",
        "max sustained req/s",
        "× nginx",
        "× bare Pingora",
        "p99 ms at it",
        "steps (req/s: p99 ms, errors %)",
        "RSS before MB",
        "RSS peak MB",
        "RSS after MB",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let best = |c| series(found.get(&c), |s: &Search| s.best);
    let mb = |f: fn(&Search) -> u64| move |s: &Search| f(s) as f64 / 1e6;
    for (c, searches) in &found {
        let c = *c;
        let at_best = series(Some(searches), |s| {
            s.steps
                .iter()
                .find(|st| st.rate == s.best)
                .map(|st| st.result.ms(99.0))
                .unwrap_or(f64::NAN)
        });
        let steps = searches
            .last()
            .map(|s| {
                s.steps
                    .iter()
                    .map(|st| {
                        format!(
                            "{:.0}: {:.1}, {:.2}",
                            st.rate,
                            st.result.ms(99.0),
                            st.error_share() * 100.0
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            })
            .unwrap_or_default();
        let results: Vec<LoadResult> = searches
            .iter()
            .flat_map(|s| s.steps.iter().map(|st| st.result.clone()))
            .collect();
        let proxy = c != Contender::Direct;
        let rss = |f: fn(&Search) -> u64| {
            if proxy {
                series(Some(searches), mb(f)).show(1)
            } else {
                "–".to_string()
            }
        };
        report.rows.push(vec![
            c.label().to_string(),
            best(c).show(0),
            pairwise(&best(c), &best(Contender::Nginx), |a, b| a / b).show(2),
            pairwise(&best(c), &best(Contender::BarePingora), |a, b| a / b).show(2),
            at_best.show(1),
            steps,
            rss(|s| s.rss_before),
            rss(|s| s.rss_peak),
            rss(|s| s.rss_after),
            errors_cell(&results),
        ]);
    }
    report.notes.push(format!(
        "The simulator answers every request (16 tokens, non-stream) 20 ms after it arrives. Per \
         contender, open-loop steps of {:?} (after {:?} of warm-up) over up to {} connections, \
         from {:.0} req/s doubling until a step fails, then {} bisections; a step is sustained \
         when its p99 (from each request's intended send time) is under 1 s, errors and \
         requests not sent are under 0.1 %, and at least 95 % of the rate was done. The steps \
         column shows the last round's. RSS: the proxy's processes (nginx: master + workers) \
         before the search, its peak during (VmRSS every 100 ms) and {:?} after it.",
        p.public_step, p.warmup, p.public_conns, p.public_rate_start, p.public_bisections, p.settle,
    ));
    report.notes.push(
        "The load generator shares the 2 cores: on this machine the ceiling found is partly the \
         client's. Compare contenders within the run, not with published numbers."
            .to_string(),
    );
    if let Some(fill) = filled {
        report.notes.push(format!(
            "Plugins on: before its first search, its memory store was {} by {} requests of \
             their own ({:.1} MB held, as `sluice_cache_memory_bytes` weighs entries), so that \
             every round's RSS before holds a full cache and \"after ÷ before\" counts what \
             the load left behind. Without it the first round's after held however much of the \
             cache that machine's search had filled (from 1.02× to 2.27× in the last five full \
             runs).",
            if fill.at_bound {
                "filled to its bound (until it stopped growing)"
            } else {
                "filled as far as the time allowed, still growing,"
            },
            fill.requests,
            fill.bytes / 1e6
        ));
    }
    let after_vs_before = series(found.get(&Contender::SluiceOn), |s| {
        s.rss_after as f64 / (s.rss_before as f64).max(1.0)
    });
    report.checks.push(Check::at_most_rounds(
        "plugins on (cache full): RSS after the load over RSS before",
        &after_vs_before,
        1.10,
        "×",
        Noise::Share,
    ));
    Ok(report)
}

/// How far [`fill_cache`] filled a memory store.
struct Fill {
    requests: u64,
    /// What `sluice_cache_memory_bytes` said at the end.
    bytes: f64,
    /// It stopped growing: the store is at its bound.
    at_bound: bool,
}

/// Sends requests of their own to a Sluice whose cache stores each answer until its memory
/// store stops growing (it is at its bound), or 60 batches of `public_step` have gone.
async fn fill_cache(admin: SocketAddr, target: Arc<Target>, p: &Params) -> Result<Fill> {
    let held = || async {
        let page = crate::fleet::page_of(admin).await?;
        Ok::<_, anyhow::Error>(crate::resilience::metric_sum(
            &page,
            "sluice_cache_memory_bytes",
        ))
    };
    let mut fill = Fill {
        requests: 0,
        bytes: held().await?,
        at_bound: false,
    };
    for _ in 0..60 {
        let batch = closed_loop(target.clone(), 256, Duration::ZERO, p.public_step).await?;
        fill.requests += batch.ok;
        let now = held().await?;
        fill.at_bound = batch.ok > 0 && now <= fill.bytes * 1.001;
        fill.bytes = now;
        if fill.at_bound {
            break;
        }
    }
    Ok(fill)
}

/// 17. Streams of 64 deltas 20 ms apart: added TTFT and inter-frame gaps over direct.
pub async fn public_streams(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(17, title(17));
    let spec = SimSpec::streaming(20.0, 64);
    let stack = Stack::start(ctx, &spec, &PUBLIC).await?;
    stack.note_down(&mut report);
    let body = chat_body("Tell me a story.", true, 4096);
    let load = SseLoad::steady(ctx.p.stream_concurrency, ctx.p.stream_duration, 64, 20.0);
    let runs = stream_rounds(ctx.p.rounds, &stack, &mut report, &body, &load).await?;
    report.header = [
        "contender",
        "streams",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "added TTFT p99 ms",
        "added TTFT p99 × nginx's",
        "gap p50 ms",
        "gap p99 ms",
        "added gap p50 ms",
        "added gap p99 ms",
        "chunks/stream",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let ttft = |q: f64| move |r: &SseResult| r.ttft_ms(q);
    let gap = |q: f64| move |r: &SseResult| r.gap_ms(q);
    for (c, results) in &runs {
        let c = *c;
        report.rows.push(vec![
            c.label().to_string(),
            series(Some(results), |r| r.streams as f64).show(0),
            series(Some(results), ttft(50.0)).show(3),
            series(Some(results), ttft(99.0)).show(3),
            added(&runs, c, Contender::Direct, ttft(99.0)).show(3),
            added_ratio(&runs, c, Contender::Nginx, ttft(99.0)).show(2),
            series(Some(results), gap(50.0)).show(3),
            series(Some(results), gap(99.0)).show(3),
            added(&runs, c, Contender::Direct, gap(50.0)).show(3),
            added(&runs, c, Contender::Direct, gap(99.0)).show(3),
            series(Some(results), SseResult::chunks_per_stream).show(1),
            errors_cell_sse(results),
        ]);
    }
    report.notes.push(format!(
        "{} streams open at a time, each on a fresh connection, each 64 deltas 20 ms apart (no \
         jitter, TTFT 0 at the simulator), their starts spread over {:?}; a frame is one read of \
         the chunked body, the gap the time between two frames of a stream.",
        ctx.p.stream_concurrency, load.ramp
    ));
    report.checks.push(Check::at_most_rounds(
        "plugins on: added TTFT p99",
        &added(&runs, Contender::SluiceOn, Contender::Direct, ttft(99.0)),
        1.0,
        "ms",
        Noise::Tail,
    ));
    Ok(report)
}
