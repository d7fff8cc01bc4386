//! Scenario 29 (issue #53, "Flow control"): agent sessions at saturation. Two simulators run as
//! vLLM 0.32 does by default (chunked prefill of 8,192 tokens a step with no
//! `long_prefill_token_threshold`, so prompts take whole steps in arrival order; prefix
//! caching). Long agent sessions send turn after turn (a 16k-token context that grows by a
//! 4k-token tool result each turn, compacted back past 36k), while short chat sessions (three
//! turns of a few hundred tokens, half a second apart) arrive at a steady rate. The number of
//! long sessions is swept from below the fleet's prefill capacity to twice over it. Each level
//! runs three ways on a fresh fleet: `fairness: off` (first come, first served: vLLM's queue
//! orders), priority only (`fairness: off`, the KV breaker on with the agents sent as
//! `sheddable`: classes alone, as Sluice ordered before #53), and `fairness: on`.
//!
//! Reported per row: the short sessions' TTFT p50 / p99 (what a person at a chat window
//! feels), the long sessions' TTFT p50 / p99, turns answered per second over the run, the
//! engines' prefix-cache hit rate (tokens),
//! requests held by flow control, and Jain's index of the flows' service as Sluice exports it
//! (fairness on only). Every session names itself with `x-session-id`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::contenders::{free_addr, start_sluice_with, Contender};
use crate::phased::Idle;
use crate::prefix_fleet::{exchange, pct, Fleet, Got};
use crate::report::{Check, Noise, ScenarioReport};
use crate::resilience::{labelled_sum, metric_sum};
use crate::scenarios::title;
use crate::Ctx;

const ID: u8 = 29;
const MODEL: &str = "agent-model";
/// The longest a request may take before it counts as unanswered.
const REQUEST_LIMIT: Duration = Duration::from_secs(120);
/// Bytes a token, as the simulator counts them without a tokenizer.
const BYTES_PER_TOKEN: usize = 4;
const LONG_OPENING_TOKENS: usize = 16_384;
const LONG_TOOL_RESULT_TOKENS: usize = 4_096;
/// A long session compacts its context back to its opening past this.
const LONG_COMPACT_TOKENS: usize = 36_864;
const SHORT_OPENING_TOKENS: usize = 320;
const SHORT_TURN_TOKENS: usize = 160;
const SHORT_TURNS: usize = 3;
const SHORT_THINK: Duration = Duration::from_millis(500);
const MAX_TOKENS: u32 = 32;

/// A row's way of running the pool.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    Fifo,
    PriorityOnly,
    Fair,
}

impl Way {
    fn contender(self) -> Contender {
        match self {
            Way::Fifo => Contender::SluiceFifo,
            Way::PriorityOnly => Contender::SluicePriorityOnly,
            Way::Fair => Contender::SluiceFair,
        }
    }
}

/// One engine: 40,000 prompt tokens a second, 15 ms a decode step.
fn engine() -> vllm_sim::SimConfig {
    vllm_sim::SimConfig::default()
        .with_served_model_names(vec![MODEL.to_string()])
        .with_latency(vllm_sim::Latency {
            overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(25),
            inter_token: Duration::from_millis(15),
            jitter: 0.05,
        })
        .with_kv(65_536, 16)
        .with_max_model_len(65_536)
        .with_max_num_seqs(256)
        .with_answer_tokens(MAX_TOKENS, MAX_TOKENS)
        .with_record_requests(0)
        .v1_engine(8192)
        .with_long_prefill_token_threshold(0)
}

/// Text of `tokens` tokens that no other session's text shares a block with.
fn filler(owner: &str, part: usize, tokens: usize) -> String {
    let mut text = String::with_capacity(tokens * BYTES_PER_TOKEN);
    let mut i = 0;
    while text.len() < tokens * BYTES_PER_TOKEN {
        text.push_str(&format!("{owner}.{part}.{i} "));
        i += 1;
    }
    text.truncate(tokens * BYTES_PER_TOKEN);
    text
}

/// Every turn's outcome: which kind of session sent it.
struct Turn {
    long: bool,
    got: Got,
}

#[derive(Clone)]
struct Target {
    addr: std::net::SocketAddr,
    idle: Idle,
    /// The agents' class header (priority only).
    agents_sheddable: bool,
}

async fn send(target: &Target, session: usize, messages: &[Value], long: bool) -> Turn {
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS,
                      "temperature": 0, "stream": true});
    let mut got = Got {
        stream: true,
        ..Got::default()
    };
    let sent = Instant::now();
    let exchange = exchange(
        target.addr,
        &target.idle,
        &body,
        Some(session),
        &mut got,
        sent,
        (long && target.agents_sheddable).then_some(("x-sluice-priority", "sheddable")),
    );
    match tokio::time::timeout(REQUEST_LIMIT, exchange).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => got.error = Some(format!("{e:#}")),
        Err(_) => got.error = Some(format!("no answer within {REQUEST_LIMIT:?}")),
    }
    got.total = sent.elapsed();
    Turn { long, got }
}

/// A long agent session: turn after turn until `until`, its context growing by a tool result
/// each turn.
async fn long_session(target: Target, index: usize, start: Instant, until: Instant) -> Vec<Turn> {
    tokio::time::sleep_until(start.into()).await;
    let owner = format!("agent{index}");
    let opening = vec![
        json!({"role": "system", "content": filler(&owner, 0, 1024)}),
        json!({"role": "user", "content": filler(&owner, 1, LONG_OPENING_TOKENS - 1024)}),
    ];
    let mut messages = opening.clone();
    let (mut tokens, mut turn) = (LONG_OPENING_TOKENS, 0);
    let mut out = Vec::new();
    while Instant::now() < until {
        let t = send(&target, index, &messages, true).await;
        let failed = t.got.error.is_some();
        out.push(t);
        if failed {
            break;
        }
        turn += 1;
        if tokens + LONG_TOOL_RESULT_TOKENS > LONG_COMPACT_TOKENS {
            messages = opening.clone();
            tokens = LONG_OPENING_TOKENS;
            // A compacted context starts its own prefix.
            messages.push(json!({"role": "user", "content": filler(&owner, 10_000 + turn, 64)}));
        }
        messages.push(json!({"role": "assistant", "content": format!("calling a tool ({turn})")}));
        messages.push(
            json!({"role": "user", "content": filler(&owner, 2 + turn, LONG_TOOL_RESULT_TOKENS)}),
        );
        tokens += LONG_TOOL_RESULT_TOKENS;
    }
    out
}

/// A short chat session: three turns, half a second apart.
async fn short_session(target: Target, index: usize, start: Instant) -> Vec<Turn> {
    tokio::time::sleep_until(start.into()).await;
    let owner = format!("chat{index}");
    let mut messages =
        vec![json!({"role": "user", "content": filler(&owner, 0, SHORT_OPENING_TOKENS)})];
    let mut out = Vec::new();
    for turn in 0..SHORT_TURNS {
        if turn > 0 {
            tokio::time::sleep(SHORT_THINK).await;
        }
        let t = send(&target, index, &messages, false).await;
        out.push(t);
        messages.push(json!({"role": "assistant", "content": "sure"}));
        messages
            .push(json!({"role": "user", "content": filler(&owner, 1 + turn, SHORT_TURN_TOKENS)}));
    }
    out
}

/// One row's outcome.
struct Run {
    turns: Vec<Turn>,
    elapsed: Duration,
    held: f64,
    index: Option<f64>,
    /// The engines' prefix-cache hits over queries, in tokens.
    hit_rate: f64,
}

async fn run(ctx: &Ctx, way: Way, long_sessions: usize) -> Result<Run> {
    let fleet = Fleet::of_configs(vec![engine(), engine()])?;
    let (listen, admin) = (free_addr()?, free_addr()?);
    let dir = tempfile::tempdir_in(ctx.root.path())?;
    let name = format!("fair-{long_sessions}");
    let backends: String = fleet
        .sims
        .iter()
        .map(|s| format!("      - address: {}\n", s.addr()))
        .collect();
    let fairness = if way == Way::Fair { "on" } else { "off" };
    let breaker = if way == Way::PriorityOnly {
        "plugins:\n  kv_breaker:\n    enabled: true\n"
    } else {
        ""
    };
    let yaml = format!(
        "# Generated by sluice-bench (scenario 29).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         log:\n  level: warn\n\
         pools:\n  - name: agents\n    models: [\"{MODEL}\"]\n    fairness: {fairness}\n    \
         health: {{interval: 250ms}}\n    backends:\n{backends}{breaker}",
        pid = dir.path().join(format!("{name}.pid")).display(),
        sock = dir.path().join(format!("{name}.sock")).display(),
    );
    let _sluice = start_sluice_with(&ctx.sluice_bin, dir.path(), &name, &yaml, &[listen, admin])
        .await
        .context("starting sluice")?;
    let target = Target {
        addr: listen,
        idle: Arc::new(Mutex::new(Vec::new())),
        agents_sheddable: way == Way::PriorityOnly,
    };
    let p = &ctx.p;
    let start = Instant::now();
    let until = start + p.fair_window;
    let mut tasks = Vec::new();
    for i in 0..long_sessions {
        // Staggered over the first two seconds.
        let at = start + Duration::from_millis((i as u64 * 2000) / long_sessions.max(1) as u64);
        tasks.push(tokio::spawn(long_session(target.clone(), i, at, until)));
    }
    let shorts = p.fair_short_sessions;
    for i in 0..shorts {
        // From the third second on, evenly over the rest of the window.
        let span = p.fair_window.saturating_sub(Duration::from_secs(3));
        let at = start + Duration::from_secs(2) + span.mul_f64(i as f64 / shorts.max(1) as f64);
        tasks.push(tokio::spawn(short_session(target.clone(), 1000 + i, at)));
    }
    let mut turns = Vec::new();
    for task in tasks {
        turns.extend(task.await?);
    }
    let elapsed = start.elapsed();
    let (queries, hits, _) = fleet.counters();
    let page = crate::fleet::page_of(admin).await.unwrap_or_default();
    let held = labelled_sum(&page, "sluice_flow_hold_seconds_count", "result", "sent")
        + labelled_sum(
            &page,
            "sluice_flow_hold_seconds_count",
            "result",
            "max_hold",
        );
    let index = (way == Way::Fair)
        .then(|| metric_sum(&page, "sluice_pool_fairness_index"))
        .filter(|i| *i > 0.0);
    Ok(Run {
        turns,
        elapsed,
        held,
        index,
        hit_rate: hits / queries.max(1.0),
    })
}

fn ms(turns: &[&Turn]) -> Vec<f64> {
    turns
        .iter()
        .filter_map(|t| t.got.ttft)
        .map(|d| d.as_secs_f64() * 1e3)
        .collect()
}

pub async fn flow_fairness(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    report.header = [
        "long sessions",
        "contender",
        "short sessions' TTFT p50 / p99 ms",
        "long sessions' TTFT p50 / p99 ms",
        "turns answered / s",
        "engines' prefix-cache hits",
        "held",
        "Jain's index",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let levels = ctx.p.fair_levels.clone();
    let top = levels.iter().copied().max().unwrap_or(0);
    let bottom = levels.iter().copied().min().unwrap_or(0);
    // (short p99, turns/s) of FIFO and fair, at the lowest and highest level.
    let mut fifo_at = std::collections::BTreeMap::new();
    let mut fair_at = std::collections::BTreeMap::new();
    for &level in &levels {
        for way in [Way::Fifo, Way::PriorityOnly, Way::Fair] {
            let r = run(ctx, way, level).await?;
            let short: Vec<&Turn> = r.turns.iter().filter(|t| !t.long).collect();
            let long: Vec<&Turn> = r.turns.iter().filter(|t| t.long).collect();
            let errors: Vec<&Turn> = r.turns.iter().filter(|t| t.got.error.is_some()).collect();
            let answered = r.turns.len() - errors.len();
            let rate = answered as f64 / r.elapsed.as_secs_f64();
            let (s, l) = (ms(&short), ms(&long));
            let short_p99 = pct(&s, 0.99);
            report.rows.push(vec![
                level.to_string(),
                way.contender().label().to_string(),
                format!("{:.0} / {:.0}", pct(&s, 0.5), short_p99),
                format!("{:.0} / {:.0}", pct(&l, 0.5), pct(&l, 0.99)),
                format!("{rate:.2}"),
                format!("{:.1} %", r.hit_rate * 100.0),
                format!("{:.0}", r.held.max(0.0)),
                r.index.map_or("-".into(), |i| format!("{i:.3}")),
                errors.len().to_string(),
            ]);
            report.measured(
                way.contender(),
                r.turns.len() as u64,
                errors.len() as u64,
                errors.first().and_then(|t| t.got.error.clone()),
            );
            match way {
                Way::Fifo => fifo_at.insert(level, (short_p99, rate)),
                Way::Fair => fair_at.insert(level, (short_p99, rate)),
                Way::PriorityOnly => None,
            };
        }
    }
    let ratio = |level: usize, f: fn(&(f64, f64)) -> f64| match (
        fifo_at.get(&level),
        fair_at.get(&level),
    ) {
        (Some(fifo), Some(fair)) => f(fifo) / f(fair),
        _ => f64::NAN,
    };
    report.checks.push(Check::at_least(
        &format!("{top} long sessions: short sessions' TTFT p99, FIFO over fair"),
        ratio(top, |v| v.0),
        2.0,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_least(
        &format!("{top} long sessions: turns answered / s, fair over FIFO"),
        1.0 / ratio(top, |v| v.1),
        0.95,
        "×",
        Noise::Share,
    ));
    report.notes.push(format!(
        "Below saturation ({bottom} long sessions) the fair row's short-session TTFT p99 is \
         {:.2}× FIFO's and its turns / s {:.2}× (no row should differ by more than noise). \
         Each row on a fresh fleet of 2 simulators (40,000 prompt tokens / s each, chunked \
         prefill of 8,192 tokens a step, no long_prefill_token_threshold), {:?} of long \
         agent sessions and {} short chat sessions of {SHORT_TURNS} turns. Priority only: \
         the agents sent as sheddable, the KV breaker on; the classes order only what the \
         breaker holds for KV headroom, which this fleet never lacks.",
        1.0 / ratio(bottom, |v| v.0),
        1.0 / ratio(bottom, |v| v.1),
        ctx.p.fair_window,
        ctx.p.fair_short_sessions,
    ));
    Ok(report)
}
