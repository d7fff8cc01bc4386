//! Scenario 27 (issue #52, "The tail of time to first token"): a public production trace of
//! long multi-turn chat replayed through each placement on a vLLM V1-like fleet, beside the
//! prompt tokens an infinite cache shared by every engine would compute (the physical limit).
//!
//! **The trace** is Mooncake's `conversation_trace.jsonl` (Kimi's production chat, one hour
//! sampled, published with the FAST'25 paper in `kvcache-ai/Mooncake`, Apache-2.0): each line
//! is `{timestamp (ms), input_length, output_length, hash_ids}`, the ids naming the prompt's
//! 512-token blocks (equal ids: equal prefixes). Chosen because it is the one public trace of a
//! long-context chat service that publishes its prefixes, so a replay reproduces its cache
//! reuse, not just its sizes. It is data, not code of ours: it is not in the repository. The
//! harness reads it from `SLUICE_BENCH_TRACE`, else from `../shared/traces/mooncake/` beside
//! the checkout; without it the full run reports the scenario as not run. The smoke run uses
//! a few made-up lines of the same shape.
//!
//! **The replay**: the first 10 minutes (1,750 requests), 4× faster, each second's arrivals
//! spread evenly over it (the trace's timestamps are whole seconds). Sizes are scaled down 4×
//! with the engines' speeds (a block is 128 tokens of made-up text, each id its own; a prompt
//! is its blocks in order, the last one cut to the request's length), so every time is the
//! trace's while the machine tokenizes a quarter of it. Every request streams, with
//! `max_tokens` of its output length ÷ 4.
//!
//! **The rows**: round robin; `ttft` with the approximate affinity (the prompt's first 256
//! bytes); `ttft` with the exact prefix index; the exact index with each conversation's
//! session id (soft sessions); the placement that keeps each conversation on one engine
//! (hard sessions); and the reference cost policy, written here and sending to the
//! engines itself: the engine where this request's uncached tokens plus the uncached prompt
//! tokens already sent there and not yet at their first token are least, each engine's cache
//! known from what was sent to it (the trace's block ids, LRU at the engine's capacity). The trace names no conversations: a request continues the earlier one it
//! shares the longest prefix with (more than 2 blocks), else starts one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::sync::Mutex;
use vllm_sim::text::Rng;

use crate::contenders::{free_addr, start_sluice_with, Contender};
use crate::phased::Idle;
use crate::prefix_fleet::{
    exchange, ms, pct, prediction_accuracy, subscribers_live, text, tokenizer_dir, Engine, Fleet,
    Got,
};
use crate::reference_policy::{limit_engine_tokens, send_direct, Reference};
use crate::report::{Check, Noise, ScenarioReport};
use crate::scenarios::title;
use crate::Ctx;

const ID: u8 = 27;
const MODEL: &str = "chat";
/// The trace's block, in its tokens, and the factor sizes and speeds are scaled down by.
const TRACE_BLOCK: u64 = 512;
const SCALE: u64 = 4;
/// Words of made-up text per scaled block (about 128 tokens of the tokenizer used).
const BLOCK_WORDS: usize = 110;
/// The longest a request may take before it counts as unanswered.
const REQUEST_LIMIT: Duration = Duration::from_secs(120);

/// The engines: 66k prompt tokens a second of the trace's (16.7k scaled: the replayed part
/// needs about 70 % of the four with no cache), 10 ms a token, KV caches that together hold
/// 94 % of its working set (35,010 blocks of the trace: 4.48 M tokens scaled, against 4 × 1.05
/// M), as the fleet did, and room for its longest prompt (126k tokens, 32k scaled).
const ENGINE: Engine = Engine {
    model: MODEL,
    overhead_ms: 10,
    prefill_us: 60,
    itl_ms: 10,
    kv_blocks: 65_536,
    max_model_len: 65_536,
};
const ENGINES: usize = 4;

/// One line of the trace.
#[derive(Debug, Clone)]
struct Line {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// One request of the replay.
#[derive(Debug, Clone)]
struct Request {
    at: Duration,
    blocks: Vec<u64>,
    /// Words of the last block (it is cut to the request's length).
    last_words: usize,
    max_tokens: u64,
    conversation: usize,
}

/// A placement under test.
struct Placement {
    contender: Contender,
    name: &'static str,
    balancing: &'static str,
    exact: bool,
    sessions: bool,
}

const PLACEMENTS: [Placement; 5] = [
    Placement {
        contender: Contender::SluiceRoundRobin,
        name: "round_robin",
        balancing: "{strategy: round_robin, session_affinity: off}",
        exact: false,
        sessions: false,
    },
    Placement {
        contender: Contender::SluicePrefixGuess,
        name: "ttft, approximate",
        balancing: "{strategy: ttft, prefix_affinity_bytes: 256, prefill_tokens_per_second: SPEED}",
        exact: false,
        sessions: false,
    },
    Placement {
        contender: Contender::SluicePrefixExact,
        name: "ttft, exact index",
        balancing: "{strategy: ttft, prefill_tokens_per_second: SPEED}",
        exact: true,
        sessions: false,
    },
    Placement {
        contender: Contender::SluicePrefixExactSessions,
        name: "ttft, exact index, sessions",
        balancing: "{strategy: ttft, prefill_tokens_per_second: SPEED}",
        exact: true,
        sessions: true,
    },
    Placement {
        contender: Contender::SluiceSessionOracle,
        name: "conversation-keeping",
        balancing: "{strategy: ttft, prefill_tokens_per_second: SPEED, session_affinity: hard}",
        exact: false,
        sessions: true,
    },
];

/// Where the trace is: `SLUICE_BENCH_TRACE`, else `../shared/traces/mooncake/` beside the
/// checkout.
fn trace_path() -> PathBuf {
    match std::env::var_os("SLUICE_BENCH_TRACE") {
        Some(path) => PathBuf::from(path),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/traces/mooncake/conversation_trace.jsonl"),
    }
}

fn line_of(raw: &str) -> Result<Line> {
    let v: Value = serde_json::from_str(raw)?;
    let number = |key: &str| v[key].as_u64().with_context(|| format!("no `{key}`"));
    Ok(Line {
        timestamp: number("timestamp")?,
        input_length: number("input_length")?,
        output_length: number("output_length")?,
        hash_ids: v["hash_ids"]
            .as_array()
            .context("no `hash_ids`")?
            .iter()
            .map(|id| id.as_u64().context("a hash id that is not a number"))
            .collect::<Result<_>>()?,
    })
}

/// The lines of the trace's first `window`.
fn read_trace(path: &Path, window: Duration) -> Result<Vec<Line>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = line_of(raw).with_context(|| format!("line {} of the trace", i + 1))?;
        if line.timestamp >= window.as_millis() as u64 {
            break;
        }
        lines.push(line);
    }
    Ok(lines)
}

/// A few made-up lines of the trace's shape, for the smoke run: conversations whose prompts
/// grow by a block a turn, behind two shared system prompts.
fn made_up_trace(requests: usize) -> Vec<Line> {
    (0..requests)
        .map(|i| {
            let conversation = (i % 4) as u64;
            let turn = (i / 4) as u64;
            let mut hash_ids = vec![conversation % 2, 100 + conversation];
            hash_ids.extend((0..turn).map(|t| 1000 + conversation * 100 + t));
            Line {
                timestamp: (i as u64) * 150,
                input_length: hash_ids.len() as u64 * TRACE_BLOCK - 100,
                output_length: 40,
                hash_ids,
            }
        })
        .collect()
}

/// The replay of `lines`, `speedup` times faster: arrivals spread over each second, sizes
/// scaled, each request given its conversation.
fn replay(lines: &[Line], speedup: f64) -> Vec<Request> {
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for line in lines {
        *per_second.entry(line.timestamp / 1000).or_default() += 1;
    }
    let mut seen_in_second: HashMap<u64, usize> = HashMap::new();
    let conversations = conversations(lines);
    lines
        .iter()
        .zip(conversations)
        .map(|(line, conversation)| {
            let second = line.timestamp / 1000;
            let n = per_second.get(&second).copied().unwrap_or(1);
            let k = seen_in_second.entry(second).or_default();
            let offset = *k as f64 / n as f64;
            *k += 1;
            let at = (second as f64 + offset) / speedup;
            let full_blocks = line.hash_ids.len().saturating_sub(1) as u64;
            let last_tokens = line
                .input_length
                .saturating_sub(full_blocks * TRACE_BLOCK)
                .clamp(1, TRACE_BLOCK);
            Request {
                at: Duration::from_secs_f64(at),
                blocks: line.hash_ids.clone(),
                last_words: ((BLOCK_WORDS as u64 * last_tokens).div_ceil(TRACE_BLOCK)) as usize,
                max_tokens: (line.output_length / SCALE).max(1),
                conversation,
            }
        })
        .collect()
}

/// Each line's conversation: the one of the earlier line it shares the longest prefix with,
/// more than 2 blocks (a shared system prompt alone is 1 or 2), else a new one.
fn conversations(lines: &[Line]) -> Vec<usize> {
    let mut by_head: HashMap<(u64, u64), Vec<usize>> = HashMap::new();
    let mut out: Vec<usize> = Vec::with_capacity(lines.len());
    let mut next = 0;
    for (i, line) in lines.iter().enumerate() {
        let head = match line.hash_ids.as_slice() {
            [a, b, ..] => Some((*a, *b)),
            _ => None,
        };
        let parent = head.and_then(|head| {
            let candidates = by_head.get(&head)?;
            candidates
                .iter()
                .rev()
                .take(64)
                .map(|&j| {
                    let shared = lines[j]
                        .hash_ids
                        .iter()
                        .zip(&line.hash_ids)
                        .take_while(|(a, b)| a == b)
                        .count();
                    (shared, j)
                })
                .filter(|(shared, _)| *shared > 2)
                .max_by_key(|(shared, j)| (*shared, *j))
                .map(|(_, j)| j)
        });
        let conversation = match parent.and_then(|j| out.get(j).copied()) {
            Some(c) => c,
            None => {
                next += 1;
                next - 1
            }
        };
        out.push(conversation);
        if let Some(head) = head {
            by_head.entry(head).or_default().push(i);
        }
    }
    out
}

/// The prompt tokens (scaled) an infinite cache shared by every engine computes: each block
/// the first time its id is seen, whole blocks only (as a prefix cache reuses them).
fn limit_tokens(requests: &[Request]) -> u64 {
    let block = TRACE_BLOCK / SCALE;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut total = 0;
    for r in requests {
        let mut cached = true;
        for (i, id) in r.blocks.iter().enumerate() {
            let last = i + 1 == r.blocks.len();
            let tokens = if last {
                (block * r.last_words as u64).div_ceil(BLOCK_WORDS as u64)
            } else {
                block
            };
            // A prefix cache serves the leading blocks it holds, and never a partial last one.
            cached &= !last && seen.contains(id);
            if !cached {
                total += tokens;
            }
            seen.insert(*id);
        }
    }
    total
}

/// The text of block `id`: its own words, the same in every request.
fn block_text(id: u64, words: usize, cache: &mut HashMap<u64, String>) -> String {
    let full = cache
        .entry(id)
        .or_insert_with(|| {
            let mut rng = Rng::new(0x7ace_0000 ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            format!("[{id}] {}. ", text(&mut rng, BLOCK_WORDS))
        })
        .clone();
    if words >= BLOCK_WORDS {
        return full;
    }
    full.split_inclusive(' ')
        .take(words.max(1))
        .collect::<String>()
}

fn prompt(r: &Request, cache: &mut HashMap<u64, String>) -> String {
    let mut out = String::new();
    for (i, id) in r.blocks.iter().enumerate() {
        let words = if i + 1 == r.blocks.len() {
            r.last_words
        } else {
            BLOCK_WORDS
        };
        out.push_str(&block_text(*id, words, cache));
    }
    out
}

fn sluice_yaml(
    dir: &Path,
    (listen, admin): (std::net::SocketAddr, std::net::SocketAddr),
    fleet: &Fleet,
    p: &Placement,
) -> String {
    let balancing = p
        .balancing
        .replace("SPEED", &format!("{:.0}", ENGINE.tokens_per_second()));
    let mut y = format!(
        "# Generated by sluice-bench (scenario 27).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         limits:\n  max_connections_per_client: 8192\n  max_requests_in_flight_per_client: 8192\n\
         log:\n  level: warn\n\
         pools:\n  - name: {MODEL}\n    models: [\"{MODEL}\"]\n    balancing: {balancing}\n    \
         timeouts: {{first_byte: 120s, total: 300s}}\n    \
         health: {{interval: 250ms, timeout: 1s, stale_after: 2s}}\n",
        pid = dir.join("trace.pid").display(),
        sock = dir.join("trace.sock").display(),
    );
    if p.exact {
        let _ = write!(
            y,
            "    tokenizer: {}\n    kv_events: auto\n",
            tokenizer_dir().display()
        );
    }
    y.push_str("    backends:\n");
    for b in fleet.addrs(MODEL) {
        let _ = writeln!(y, "      - address: {b}");
    }
    y
}

/// A request's prompt tokens, scaled.
fn request_tokens(r: &Request) -> u64 {
    let block = TRACE_BLOCK / SCALE;
    let full = r.blocks.len().saturating_sub(1) as u64;
    full * block + (block * r.last_words as u64).div_ceil(BLOCK_WORDS as u64)
}

/// The reference policy's run: no proxy, the harness places each request itself.
async fn run_reference(requests: &[Request], bodies: &[Arc<Value>]) -> Result<Run> {
    let fleet = Fleet::of(vec![ENGINE; ENGINES])?;
    let addrs = fleet.addrs(MODEL);
    let idles: Vec<Idle> = addrs
        .iter()
        .map(|_| Arc::new(Mutex::new(Vec::new())))
        .collect();
    let capacity = ENGINE.kv_blocks as usize * 16 / (TRACE_BLOCK / SCALE) as usize;
    let policy = Arc::new(std::sync::Mutex::new(Reference::new(addrs.len(), capacity)));
    let start = Instant::now() + Duration::from_millis(100);
    let tasks: Vec<_> = requests
        .iter()
        .cloned()
        .zip(bodies)
        .map(|(r, body)| {
            let (policy, body, addrs, idles) = (
                Arc::clone(&policy),
                Arc::clone(body),
                addrs.clone(),
                idles.clone(),
            );
            tokio::spawn(async move {
                tokio::time::sleep_until((start + r.at).into()).await;
                let mut got = Got {
                    stream: true,
                    turn: 1,
                    ..Got::default()
                };
                let full = r.blocks.len().saturating_sub(1);
                let tokens = request_tokens(&r);
                let placed = policy
                    .lock()
                    .map(|mut p| p.place(&r.blocks, full, tokens, TRACE_BLOCK / SCALE))
                    .map_err(|_| ());
                let Ok((engine, uncached)) = placed else {
                    got.error = Some("the policy's lock".into());
                    return got;
                };
                let first = || {
                    if let Ok(mut p) = policy.lock() {
                        p.first_token(engine, uncached);
                    }
                };
                let sent = Instant::now();
                let outcome = tokio::time::timeout(
                    REQUEST_LIMIT,
                    send_direct(addrs[engine], &idles[engine], &body, true, &mut got, first),
                )
                .await;
                settle(got, sent, outcome.map(|r| r.map(drop)))
            })
        })
        .collect();
    let mut got = Vec::with_capacity(tasks.len());
    for task in tasks {
        got.push(task.await.context("a request's task")?);
    }
    let (queries, hits, _) = fleet.counters();
    Ok(Run {
        got,
        computed: queries - hits,
        hits,
        queries,
        accuracy: None,
    })
}

/// A request's record once its exchange ended (`outcome`, or no answer in time).
fn settle(
    mut got: Got,
    sent: Instant,
    outcome: Result<Result<()>, tokio::time::error::Elapsed>,
) -> Got {
    got.total = sent.elapsed();
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => got.error = Some(format!("{e:#}")),
        Err(_) => got.error = Some(format!("no answer within {REQUEST_LIMIT:?}")),
    }
    got
}

/// What one placement's run measured.
struct Run {
    got: Vec<Got>,
    computed: f64,
    hits: f64,
    queries: f64,
    /// Sluice's: the share of predicted TTFTs within ±25 % of the measured, and how many.
    accuracy: Option<(f64, f64)>,
}

async fn run_placement(
    ctx: &Ctx,
    p: &Placement,
    requests: &[Request],
    bodies: &[Arc<Value>],
) -> Result<Run> {
    let fleet = Fleet::of(vec![ENGINE; ENGINES])?;
    let dir = ctx.root.path().join("trace");
    std::fs::create_dir_all(&dir)?;
    let (listen, admin) = (free_addr()?, free_addr()?);
    let yaml = sluice_yaml(&dir, (listen, admin), &fleet, p);
    let _sluice =
        start_sluice_with(&ctx.sluice_bin, &dir, "trace", &yaml, &[listen, admin]).await?;
    if p.exact {
        subscribers_live(admin, &fleet).await?;
    }
    let idle: Idle = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now() + Duration::from_millis(100);
    let tasks: Vec<_> = requests
        .iter()
        .zip(bodies)
        .map(|(r, body)| {
            let (idle, body) = (idle.clone(), Arc::clone(body));
            let at = start + r.at;
            let session = p.sessions.then_some(r.conversation);
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let mut got = Got {
                    stream: true,
                    turn: 1,
                    ..Got::default()
                };
                let sent = Instant::now();
                let outcome = tokio::time::timeout(
                    REQUEST_LIMIT,
                    exchange(listen, &idle, &body, session, &mut got, sent, None),
                )
                .await;
                settle(got, sent, outcome.map(|r| r.map(drop)))
            })
        })
        .collect();
    let mut got = Vec::with_capacity(tasks.len());
    for task in tasks {
        got.push(task.await.context("a request's task")?);
    }
    let (queries, hits, _) = fleet.counters();
    let page = crate::fleet::page_of(admin).await.unwrap_or_default();
    Ok(Run {
        got,
        computed: queries - hits,
        hits,
        queries,
        accuracy: prediction_accuracy(&page),
    })
}

/// Counts `run` for `contender` and adds its row as `name`, its prompt tokens over the
/// infinite cache's `limit`; its TTFT p99 (ms) and failed requests.
fn record(
    report: &mut ScenarioReport,
    contender: Contender,
    name: &str,
    run: &Run,
    limit: f64,
) -> (f64, usize) {
    let ttft: Vec<f64> = run
        .got
        .iter()
        .filter(|g| g.error.is_none())
        .filter_map(|g| g.ttft.map(ms))
        .collect();
    let failed = run.got.iter().filter(|g| g.error.is_some()).count();
    report.measured(
        contender,
        run.got.len() as u64,
        failed as u64,
        run.got.iter().find_map(|g| g.error.clone()),
    );
    report.rows.push(vec![
        name.to_string(),
        format!(
            "{:.0} / {:.0} / {:.0}",
            pct(&ttft, 0.5),
            pct(&ttft, 0.9),
            pct(&ttft, 0.99)
        ),
        format!("{:.0}", run.computed),
        format!("{:.3}", run.computed / limit.max(1.0)),
        format!("{:.1} %", 100.0 * run.hits / run.queries.max(1.0)),
        failed.to_string(),
        run.accuracy.map_or("-".to_string(), |(share, n)| {
            format!("{:.0} % of {n:.0}", 100.0 * share)
        }),
    ]);
    (pct(&ttft, 0.99), failed)
}

pub async fn trace_replay(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    let (lines, source) = if ctx.p.trace_window.is_zero() {
        (
            made_up_trace(ctx.p.trace_smoke_requests),
            "made-up lines (smoke run)".to_string(),
        )
    } else {
        let path = trace_path();
        match read_trace(&path, ctx.p.trace_window) {
            Ok(lines) => (
                lines,
                format!("{} (first {:?})", path.display(), ctx.p.trace_window),
            ),
            Err(e) => {
                bail!(
                    "the trace is not here ({e:#}): put Mooncake's conversation_trace.jsonl \
                     there or name it in SLUICE_BENCH_TRACE"
                )
            }
        }
    };
    let requests = replay(&lines, ctx.p.trace_speedup);
    let mut cache = HashMap::new();
    let bodies: Vec<Arc<Value>> = requests
        .iter()
        .map(|r| {
            Arc::new(json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt(r, &mut cache)}],
                "max_tokens": r.max_tokens,
                "temperature": 0,
                "ignore_eos": true,
                "stream": true,
            }))
        })
        .collect();
    let limit = limit_engine_tokens(bodies.iter().map(|b| b.as_ref()))? as f64;
    // The trace's own reuse, for the record: its blocks seen before, of all.
    let trace_limit = limit_tokens(&requests) as f64;
    let trace_all: f64 = requests.iter().map(|r| request_tokens(r) as f64).sum();
    let conversations = requests
        .iter()
        .map(|r| r.conversation)
        .max()
        .map_or(0, |c| c + 1);
    report.header = [
        "placement",
        "TTFT p50 / p90 / p99 ms",
        "prompt tokens computed",
        "÷ the limit",
        "engine prefix hits",
        "errors",
        "predicted TTFT within ±25 %",
    ]
    .map(String::from)
    .to_vec();
    let mut p99: BTreeMap<&str, f64> = BTreeMap::new();
    let mut computed: BTreeMap<&str, f64> = BTreeMap::new();
    let mut errors: BTreeMap<&str, usize> = BTreeMap::new();
    let mut accuracy = None;
    for p in &PLACEMENTS {
        let run = match run_placement(ctx, p, &requests, &bodies).await {
            Ok(run) => run,
            Err(e) => {
                report.notes.push(format!("{}: did not run: {e:#}", p.name));
                report.measured(p.contender, 0, 1, Some(format!("did not run: {e:#}")));
                continue;
            }
        };
        let (p99_ms, failed) = record(&mut report, p.contender, p.name, &run, limit);
        if let (true, Some((share, _))) = (p.exact && !p.sessions, run.accuracy) {
            accuracy = Some(share);
        }
        p99.insert(p.name, p99_ms);
        computed.insert(p.name, run.computed);
        errors.insert(p.name, failed);
    }
    match run_reference(&requests, &bodies).await {
        Ok(run) => {
            let name = "reference cost policy (the harness, direct)";
            let (p99_ms, _) = record(&mut report, Contender::Direct, name, &run, limit);
            p99.insert("reference", p99_ms);
        }
        Err(e) => report
            .notes
            .push(format!("the reference policy did not run: {e:#}")),
    }
    report.rows.push(vec![
        "the limit: an infinite cache shared by every engine".into(),
        "-".into(),
        format!("{limit:.0}"),
        "1.000".into(),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    let get = |m: &BTreeMap<&str, f64>, k: &str| m.get(k).copied().unwrap_or(f64::NAN);
    report.checks.push(Check::at_most(
        "TTFT p99: exact index ÷ conversation-keeping",
        get(&p99, "ttft, exact index") / get(&p99, "conversation-keeping"),
        1.1,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most(
        "TTFT p99: exact index ÷ the reference policy",
        get(&p99, "ttft, exact index") / get(&p99, "reference"),
        0.9,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most(
        "prompt tokens computed: exact index ÷ the limit",
        get(&computed, "ttft, exact index") / limit,
        1.05,
        "×",
        Noise::Share,
    ));
    report.checks.push(Check::at_least(
        "predicted TTFT within ±25 % of the measured: exact index",
        accuracy.map_or(f64::NAN, |share| 100.0 * share),
        90.0,
        "%",
        Noise::Share,
    ));
    report.checks.push(Check::at_most(
        "errors: exact index",
        errors
            .get("ttft, exact index")
            .copied()
            .unwrap_or(usize::MAX) as f64,
        0.0,
        "",
        Noise::Exact,
    ));
    report.notes.push(format!(
        "{} requests of {conversations} conversations from {source}, replayed {}× faster; \
         sizes and engine speeds ÷ {SCALE}: {ENGINES} engines of {:.0} prompt tokens/s (the \
         trace's {:.0}k), {} ms a token, {} KV blocks of 16, chunked prefill, prefix caching, \
         KV events. Prompt tokens are the engines' (`prefix_cache_queries − hits`); the limit \
         tokenizes every prompt as they do and computes each 16-token block once. By the \
         trace's own block ids an infinite cache computes {:.1} % of the prompt tokens.",
        requests.len(),
        ctx.p.trace_speedup,
        ENGINE.tokens_per_second(),
        ENGINE.tokens_per_second() * SCALE as f64 / 1000.0,
        ENGINE.itl_ms,
        ENGINE.kv_blocks,
        100.0 * trace_limit / trace_all.max(1.0),
    ));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_follow_the_longest_shared_prefix() {
        let line = |hash_ids: Vec<u64>| Line {
            timestamp: 0,
            input_length: hash_ids.len() as u64 * TRACE_BLOCK,
            output_length: 1,
            hash_ids,
        };
        let lines = vec![
            line(vec![1, 2, 3]),
            line(vec![1, 2, 9]),
            line(vec![1, 2, 3, 4, 5]),
            line(vec![1, 2, 9, 10]),
            line(vec![7]),
            line(vec![1, 2, 3, 4, 5, 6]),
        ];
        assert_eq!(conversations(&lines), vec![0, 1, 0, 1, 2, 0]);
    }

    #[test]
    fn the_limit_computes_each_block_once_and_never_a_partial_last() {
        let lines = made_up_trace(8);
        let requests = replay(&lines, 1.0);
        let limit = limit_tokens(&requests);
        let all: u64 = requests
            .iter()
            .map(|r| r.blocks.len() as u64 * TRACE_BLOCK / SCALE)
            .sum();
        assert!(limit > 0 && limit < all, "{limit} of {all}");
        // The same requests twice: the second time only the partial last blocks count.
        let twice: Vec<Request> = requests.iter().chain(&requests).cloned().collect();
        assert!(limit_tokens(&twice) < 2 * limit);
    }

    #[test]
    fn blocks_are_the_same_text_wherever_they_are() {
        let mut cache = HashMap::new();
        let a = block_text(42, BLOCK_WORDS, &mut cache);
        let mut other = HashMap::new();
        assert_eq!(a, block_text(42, BLOCK_WORDS, &mut other));
        assert_ne!(a, block_text(43, BLOCK_WORDS, &mut other));
        assert!(a.starts_with(&block_text(42, 10, &mut other)));
    }
}
