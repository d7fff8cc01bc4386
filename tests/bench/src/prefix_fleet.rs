//! Scenario 24 (issue #36, "Routing where it pays most"): a fleet that behaves like vLLM V1
//! (chunked prefill, automatic prefix caching, KV cache events, the same tokenizer folder as
//! Sluice's pools) of 4 draft and 4 target simulators, and a seeded, open-loop, bursty
//! schedule of the traffic whose prefixes repeat: multi-turn conversations whose history
//! grows (3-12 turns, a few long shared system prompts), agent sessions (a long system prompt
//! and tool list resent with every call, a tool result added each time) and RAG questions
//! over a shared document set; streams and non-streams. Every strategy replays the same
//! schedule on a fresh fleet (cold caches): `round_robin`, `kv_aware`, `ttft` with the
//! approximate affinity (the prompt's first 256 bytes), `ttft` with the exact prefix index,
//! and an oracle that keeps every session on the backend of its previous turn (`session
//! affinity: hard` with a session header).
//!
//! Answers are deterministic (`temperature: 0`), so each session's later turns carry the same
//! history whatever the strategy. Reported per strategy: streams' TTFT over all requests and
//! over turns ≥ 2, the engines' own prefix-cache hit rate and the prompt tokens they computed
//! (`vllm:prefix_cache_queries_total` − `_hits_total`), output tokens per second, errors, and
//! the spread of KV usage across each pool (max − min, sampled every 250 ms). A second table
//! measures what tokenizing a request costs the request path.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::Full;
use serde_json::{json, Value};
use sluice_llm::{Endpoint, LlmCall};
use sluice_pools::prefix::{KvEventSource, PrefixRouting};
use sluice_pools::prefix_index::block_keys;
use tokio::sync::Mutex;
use vllm_sim::text::Rng;

use crate::contenders::{free_addr, start_sluice_with, Contender};
use crate::phased::{checkout, read_answer, Idle};
use crate::reference_policy::{
    limit_engine_tokens, send_direct, EngineTokens, Reference, ENGINE_BLOCK,
};
use crate::report::{Check, Noise, ScenarioReport, Table};
use crate::resilience::{labelled_sum, metric_sum};
use crate::scenarios::{title, CHAT};
use crate::Ctx;

const ID: u8 = 24;
/// The longest a request may take before it counts as unanswered.
const REQUEST_LIMIT: Duration = Duration::from_secs(120);
const SEED: u64 = 0x5eed_0036;
const BIG: &str = "big";
const SMALL: &str = "small";
/// Answers are cut here (the simulators answer 32 to 96 tokens).
const MAX_TOKENS: u32 = 96;

/// The tokenizer folder the simulators and Sluice's pools share.
pub(crate) fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer-chatml")
}

/// One pool's engines: the simulator's draft and target speeds, chunked prefill of 8,192
/// tokens a step.
#[derive(Clone, Copy)]
pub(crate) struct Engine {
    pub(crate) model: &'static str,
    pub(crate) overhead_ms: u64,
    pub(crate) prefill_us: u64,
    pub(crate) itl_ms: u64,
    pub(crate) kv_blocks: u32,
    /// The longest prompt and answer it takes.
    pub(crate) max_model_len: u32,
}

const TARGET: Engine = Engine {
    model: BIG,
    overhead_ms: 20,
    // 13,300 tokens a second.
    prefill_us: 75,
    itl_ms: 30,
    kv_blocks: 8192,
    max_model_len: 32_768,
};
const DRAFT: Engine = Engine {
    model: SMALL,
    overhead_ms: 5,
    prefill_us: 20,
    itl_ms: 8,
    kv_blocks: 4096,
    max_model_len: 32_768,
};

impl Engine {
    pub(crate) fn config(&self) -> vllm_sim::SimConfig {
        vllm_sim::SimConfig::default()
            .with_served_model_names(vec![self.model.to_string()])
            .with_latency(vllm_sim::Latency {
                overhead: Duration::from_millis(self.overhead_ms),
                prefill_per_token: Duration::from_micros(self.prefill_us),
                inter_token: Duration::from_millis(self.itl_ms),
                jitter: 0.1,
            })
            .with_kv(self.kv_blocks, 16)
            .with_max_model_len(self.max_model_len)
            .with_max_num_seqs(256)
            .with_answer_tokens(32, 96)
            .with_record_requests(0)
            .with_tokenizer(tokenizer_dir())
            .v1_engine(8192)
            .with_kv_events(vllm_sim::KvEventsConfig::default())
    }

    pub(crate) fn tokens_per_second(&self) -> f64 {
        1e6 / self.prefill_us as f64
    }
}

/// A strategy under test.
struct Strategy {
    contender: Contender,
    name: &'static str,
    /// The pool's `balancing` keys, and more pool keys.
    balancing: &'static str,
    exact: bool,
    session_header: bool,
}

const STRATEGIES: [Strategy; 6] = [
    Strategy {
        contender: Contender::SluiceRoundRobin,
        name: "round_robin",
        balancing: "{strategy: round_robin}",
        exact: false,
        session_header: false,
    },
    Strategy {
        contender: Contender::SluiceKvAware,
        name: "kv_aware",
        balancing: "{strategy: kv_aware}",
        exact: false,
        session_header: false,
    },
    Strategy {
        contender: Contender::SluicePrefixGuess,
        name: "ttft, approximate",
        balancing: "{strategy: ttft, prefix_affinity_bytes: 256, prefill_tokens_per_second: SPEED}",
        exact: false,
        session_header: false,
    },
    Strategy {
        contender: Contender::SluicePrefixGuessSessions,
        name: "ttft, approximate, sessions",
        balancing: "{strategy: ttft, prefix_affinity_bytes: 256, prefill_tokens_per_second: SPEED, session_affinity: soft}",
        exact: false,
        session_header: true,
    },
    Strategy {
        contender: Contender::SluicePrefixExact,
        name: "ttft, exact index",
        balancing: "{strategy: ttft, prefill_tokens_per_second: SPEED}",
        exact: true,
        session_header: false,
    },
    Strategy {
        contender: Contender::SluiceSessionOracle,
        name: "oracle (session)",
        balancing: "{strategy: ttft, prefill_tokens_per_second: SPEED, session_affinity: hard}",
        exact: false,
        session_header: true,
    },
];

/// What the schedule draws of the simulator's seeded generator (splitmix64), besides its own
/// draws: every strategy gets the same schedule.
trait Draws {
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize;
    /// An exponential draw of mean `mean` seconds, capped at 4× it.
    fn think(&mut self, mean: f64) -> Duration;
}

impl Draws for Rng {
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
    fn think(&mut self, mean: f64) -> Duration {
        let draw = -mean * (1.0 - self.unit()).max(1e-9).ln();
        Duration::from_secs_f64(draw.min(mean * 4.0))
    }
}

/// Words for made-up text: prose the tokenizer cuts like English.
const WORDS: &[&str] = &[
    "the", "request", "cache", "engine", "prefix", "block", "token", "model", "answer", "system",
    "history", "agent", "tool", "result", "document", "shared", "within", "every", "turn", "route",
    "backend", "memory", "prompt", "stream", "server", "value", "first", "last", "next", "time",
    "data", "file", "line", "check", "error", "state", "queue", "write", "read", "index",
];

pub(crate) fn text(rng: &mut Rng, words: usize) -> String {
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        if i > 0 {
            out.push(if i % 13 == 0 { '.' } else { ' ' });
            if i % 13 == 0 {
                out.push(' ');
            }
        }
        out.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    out
}

/// Text of `lo` to `hi` words.
fn words(rng: &mut Rng, lo: usize, hi: usize) -> String {
    let count = rng.range(lo, hi);
    text(rng, count)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Conversation,
    Agent,
    Rag,
}

/// One request of a session: what it adds to the session's messages.
#[derive(Clone, Debug)]
struct Step {
    /// Messages added before this request (a user question, a tool result).
    adds: Vec<Value>,
    /// The wait after the previous answer.
    think: Duration,
    stream: bool,
}

#[derive(Clone, Debug)]
struct Session {
    kind: Kind,
    model: &'static str,
    start: Duration,
    /// The messages every request of it starts with (system prompt, documents).
    opening: Vec<Value>,
    tools: Option<Value>,
    steps: Vec<Step>,
    /// RAG questions are single requests: no history carried between them.
    carries_history: bool,
}

/// The seeded schedule: `count` sessions starting over `over`, half of them in three bursts;
/// each session cut to `max_steps` requests and its waits scaled by `think_scale` (the smoke
/// run's).
fn schedule(count: usize, over: Duration, max_steps: usize, think_scale: f64) -> Vec<Session> {
    let mut sessions = full_schedule(count, over);
    for session in &mut sessions {
        session.steps.truncate(max_steps);
        for step in &mut session.steps {
            step.think = step.think.mul_f64(think_scale);
        }
    }
    sessions
}

fn full_schedule(count: usize, over: Duration) -> Vec<Session> {
    let mut rng = Rng::new(SEED);
    let systems: Vec<String> = (0..4)
        .map(|_| {
            let words = rng.range(1500, 2500);
            text(&mut rng, words)
        })
        .collect();
    let agent_system = format!("You are a coding agent. {}", text(&mut rng, 1800));
    let tools: Vec<Value> = (0..32)
        .map(|i| {
            json!({"type": "function", "function": {
                "name": format!("tool_{i}"),
                "description": text(&mut rng, 40),
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": text(&mut rng, 12)},
                    "limit": {"type": "integer"}},
                    "required": ["path"]}}})
        })
        .collect();
    let documents: Vec<String> = (0..16).map(|_| text(&mut rng, 900)).collect();
    let burst_centres = [0.2, 0.5, 0.8].map(|f| over.as_secs_f64() * f);
    (0..count)
        .map(|i| {
            let start = if i % 2 == 0 {
                over.as_secs_f64() * rng.unit()
            } else {
                let centre = burst_centres[i % 3];
                (centre + 2.5 * (rng.unit() - 0.5)).clamp(0.0, over.as_secs_f64())
            };
            let pick = rng.unit();
            let kind = if pick < 0.55 {
                Kind::Conversation
            } else if pick < 0.8 {
                Kind::Agent
            } else {
                Kind::Rag
            };
            let model = if kind == Kind::Rag || rng.unit() < 0.5 {
                BIG
            } else {
                SMALL
            };
            let stream = |rng: &mut Rng| rng.unit() < 0.7;
            // The session's system prompt, tools, steps, and whether each step resends
            // the history.
            let (system, tools, steps, carries_history) = match kind {
                Kind::Conversation => {
                    let system = &systems[(rng.next_u64() % systems.len() as u64) as usize];
                    let steps = (0..rng.range(3, 12))
                        .map(|_| Step {
                            adds: vec![
                                json!({"role": "user", "content": words(&mut rng, 20, 120)}),
                            ],
                            think: rng.think(2.0),
                            stream: stream(&mut rng),
                        })
                        .collect();
                    (json!(system), None, steps, true)
                }
                Kind::Agent => {
                    let task = text(&mut rng, 80);
                    let mut steps = vec![Step {
                        adds: vec![json!({"role": "user", "content": task})],
                        think: Duration::ZERO,
                        stream: stream(&mut rng),
                    }];
                    for _ in 1..rng.range(5, 12) {
                        steps.push(Step {
                            adds: vec![
                                json!({"role": "tool", "content": words(&mut rng, 60, 500)}),
                            ],
                            think: rng.think(0.5),
                            stream: stream(&mut rng),
                        });
                    }
                    let tools = Some(Value::Array(tools.clone()));
                    (json!(agent_system), tools, steps, true)
                }
                Kind::Rag => {
                    let a = rng.next_u64() as usize % documents.len();
                    let b =
                        (a + 1 + rng.next_u64() as usize % (documents.len() - 1)) % documents.len();
                    let context = format!(
                        "Answer from these documents only.\n\n{}\n\n{}",
                        documents[a], documents[b]
                    );
                    let steps = (0..rng.range(1, 3))
                        .map(|_| Step {
                            adds: vec![json!({"role": "user", "content": text(&mut rng, 25)})],
                            think: rng.think(1.0),
                            stream: stream(&mut rng),
                        })
                        .collect();
                    (json!(context), None, steps, false)
                }
            };
            Session {
                kind,
                model,
                start: Duration::from_secs_f64(start),
                opening: vec![json!({"role": "system", "content": system})],
                tools,
                steps,
                carries_history,
            }
        })
        .collect()
}

/// What one request did.
#[derive(Clone, Debug, Default)]
pub(crate) struct Got {
    pub(crate) kind: Option<Kind>,
    pub(crate) turn: usize,
    pub(crate) stream: bool,
    pub(crate) status: Option<u16>,
    /// Streams: to the first data chunk.
    pub(crate) ttft: Option<Duration>,
    pub(crate) total: Duration,
    pub(crate) error: Option<String>,
}

/// The answer's text, from a JSON answer or a stream's deltas.
fn answer_text(body: &[u8], stream: bool) -> String {
    if !stream {
        return serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| {
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .unwrap_or_default();
    }
    let mut out = String::new();
    for line in String::from_utf8_lossy(body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if let Ok(v) = serde_json::from_str::<Value>(data) {
            if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
                out.push_str(piece);
            }
        }
    }
    out
}

/// Where a run's requests go.
#[derive(Clone)]
enum Via {
    /// Through a Sluice at `addr`, naming each session in `x-session-id` when asked.
    Proxy {
        addr: SocketAddr,
        idle: Idle,
        session_header: bool,
    },
    /// Straight to the engines, placed by the reference policy.
    Reference(Arc<Direct>),
}

/// The reference policy's run: per model its engines and their placement, and every body
/// sent (in order) for the infinite cache's limit.
struct Direct {
    tokens: EngineTokens,
    pools: BTreeMap<&'static str, DirectPool>,
    sent: std::sync::Mutex<Vec<Value>>,
}

struct DirectPool {
    addrs: Vec<SocketAddr>,
    idles: Vec<Idle>,
    policy: std::sync::Mutex<Reference>,
}

impl Direct {
    fn new(fleet: &Fleet) -> Result<Self> {
        let mut pools = BTreeMap::new();
        for engine in [DRAFT, TARGET] {
            let addrs = fleet.addrs(engine.model);
            let idles = addrs.iter().map(|_| Idle::default()).collect();
            let policy = Reference::new(addrs.len(), engine.kv_blocks as usize);
            pools.insert(
                engine.model,
                DirectPool {
                    addrs,
                    idles,
                    policy: std::sync::Mutex::new(policy),
                },
            );
        }
        Ok(Direct {
            tokens: EngineTokens::load()?,
            pools,
            sent: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Places `body` (for `model`) by the policy and sends it to that engine.
    async fn send(&self, model: &str, body: &Value, stream: bool, got: &mut Got) -> Result<String> {
        let pool = self.pools.get(model).context("no such model")?;
        let (tokens, blocks) = self.tokens.blocks(body)?;
        let full = blocks.len();
        let (engine, uncached) = pool
            .policy
            .lock()
            .map_err(|_| anyhow::anyhow!("the policy's lock"))?
            .place(&blocks, full, tokens, ENGINE_BLOCK as u64);
        if let Ok(mut sent) = self.sent.lock() {
            sent.push(body.clone());
        }
        let first = || {
            if let Ok(mut p) = pool.policy.lock() {
                p.first_token(engine, uncached);
            }
        };
        let all = send_direct(
            pool.addrs[engine],
            &pool.idles[engine],
            body,
            stream,
            got,
            first,
        )
        .await?;
        Ok(answer_text(&all, stream))
    }
}

/// Runs every session from `start`, each `via()` (a proxy or the reference); their records.
async fn run_all(sessions: &[Session], start: Instant, via: impl Fn() -> Via) -> Result<Vec<Got>> {
    let tasks: Vec<_> = sessions
        .iter()
        .enumerate()
        .map(|(i, session)| tokio::spawn(run_session(via(), session.clone(), i, start)))
        .collect();
    let mut got = Vec::new();
    for task in tasks {
        got.extend(task.await.context("a session's task")?);
    }
    Ok(got)
}

/// Runs one session `via` a proxy or the reference: each step after the previous answer
/// and its think time.
async fn run_session(via: Via, session: Session, index: usize, start: Instant) -> Vec<Got> {
    tokio::time::sleep_until((start + session.start).into()).await;
    let mut messages = session.opening.clone();
    let mut out = Vec::with_capacity(session.steps.len());
    for (turn, step) in session.steps.iter().enumerate() {
        if !step.think.is_zero() {
            tokio::time::sleep(step.think).await;
        }
        let mut asked = if session.carries_history {
            messages.clone()
        } else {
            session.opening.clone()
        };
        asked.extend(step.adds.iter().cloned());
        let mut body = json!({
            "model": session.model, "messages": asked, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": step.stream,
        });
        if let Some(tools) = &session.tools {
            body["tools"] = tools.clone();
        }
        let mut got = Got {
            kind: Some(session.kind),
            turn: turn + 1,
            stream: step.stream,
            ..Got::default()
        };
        let sent = Instant::now();
        let outcome = match &via {
            Via::Proxy {
                addr,
                idle,
                session_header,
            } => {
                let session = session_header.then_some(index);
                let exchange = exchange(*addr, idle, &body, session, &mut got, sent, None);
                tokio::time::timeout(REQUEST_LIMIT, exchange).await
            }
            Via::Reference(direct) => {
                let send = direct.send(session.model, &body, step.stream, &mut got);
                tokio::time::timeout(REQUEST_LIMIT, send).await
            }
        };
        got.total = sent.elapsed();
        let answer = match outcome {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                got.error = Some(format!("{e:#}"));
                String::new()
            }
            Err(_) => {
                got.error = Some(format!("no answer within {REQUEST_LIMIT:?}"));
                String::new()
            }
        };
        out.push(got);
        messages.extend(step.adds.iter().cloned());
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    out
}

pub(crate) async fn exchange(
    addr: SocketAddr,
    idle: &Idle,
    body: &Value,
    session: Option<usize>,
    got: &mut Got,
    sent: Instant,
    extra_header: Option<(&str, &str)>,
) -> Result<String> {
    let stream = body["stream"].as_bool().unwrap_or(false);
    let mut sender = checkout(idle, addr).await?;
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(CHAT)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(session) = session {
        req = req.header("x-session-id", format!("session-{session}"));
    }
    if let Some((name, value)) = extra_header {
        req = req.header(name, value);
    }
    let req = req
        .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))
        .context("building the request")?;
    let resp = sender.send_request(req).await.context("sending")?;
    got.status = Some(resp.status().as_u16());
    let (all, first) = read_answer(idle, sender, resp).await?;
    got.ttft = first.map(|at| at.saturating_duration_since(sent));
    if stream && !all.windows(12).any(|w| w == b"data: [DONE]") {
        bail!("the stream ended without data: [DONE]");
    }
    Ok(answer_text(&all, stream))
}

/// The simulators of one run, on a runtime of their own (so the load's tasks do not slow
/// them), stopped when dropped.
pub(crate) struct Fleet {
    pub(crate) sims: Vec<vllm_sim::Sim>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Fleet {
    fn start() -> Result<Fleet> {
        Self::of(vec![
            DRAFT, DRAFT, DRAFT, DRAFT, TARGET, TARGET, TARGET, TARGET,
        ])
    }

    /// A fleet of `engines`, on a runtime of its own.
    pub(crate) fn of(engines: Vec<Engine>) -> Result<Fleet> {
        Self::of_configs(engines.iter().map(Engine::config).collect())
    }

    /// A fleet of simulators made from `configs`, on a runtime of its own.
    pub(crate) fn of_configs(configs: Vec<vllm_sim::SimConfig>) -> Result<Fleet> {
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let mut sims = Vec::new();
                for config in configs {
                    match vllm_sim::start(config).await {
                        Ok(sim) => sims.push(sim),
                        Err(e) => {
                            let _ =
                                ready_tx.send(Err(anyhow::anyhow!("starting a simulator: {e}")));
                            return;
                        }
                    }
                }
                let _ = ready_tx.send(Ok(sims.clone()));
                let _ = stopped.await;
                for sim in &sims {
                    sim.shutdown();
                }
            });
        });
        let sims = ready.recv().context("the fleet's thread")??;
        Ok(Fleet {
            sims,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub(crate) fn addrs(&self, model: &str) -> Vec<SocketAddr> {
        self.sims
            .iter()
            .filter(|s| s.model() == model)
            .map(vllm_sim::Sim::addr)
            .collect()
    }

    /// Summed over the fleet: (prefix-cache queries, hits, generation tokens).
    pub(crate) fn counters(&self) -> (f64, f64, f64) {
        let mut sums = (0.0, 0.0, 0.0);
        for sim in &self.sims {
            let page = sim.metrics_text();
            sums.0 += metric(&page, "vllm:prefix_cache_queries_total");
            sums.1 += metric(&page, "vllm:prefix_cache_hits_total");
            sums.2 += metric(&page, "vllm:generation_tokens_total");
        }
        sums
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How well a Sluice's pools predicted its streams' times to first token, from its metrics
/// page: the share of predictions within ±25 % (measured over predicted between 0.8 and
/// 1.25, `sluice_pool_ttft_measured_over_predicted`) and how many were compared.
pub(crate) fn prediction_accuracy(page: &str) -> Option<(f64, f64)> {
    let bucket = |le: &str| {
        labelled_sum(
            page,
            "sluice_pool_ttft_measured_over_predicted_bucket",
            "le",
            le,
        )
    };
    let count = metric_sum(page, "sluice_pool_ttft_measured_over_predicted_count");
    (count > 0.0).then(|| ((bucket("1.25") - bucket("0.8")) / count, count))
}

pub(crate) fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn sluice_yaml(
    dir: &Path,
    (listen, admin): (SocketAddr, SocketAddr),
    fleet: &Fleet,
    s: &Strategy,
) -> String {
    let mut y = format!(
        "# Generated by sluice-bench (scenario 24).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         limits:\n  max_connections_per_client: 8192\n  max_requests_in_flight_per_client: 8192\n\
         log:\n  level: warn\n\
         pools:\n",
        pid = dir.join("prefix.pid").display(),
        sock = dir.join("prefix.sock").display(),
    );
    for engine in [DRAFT, TARGET] {
        let balancing = s
            .balancing
            .replace("SPEED", &format!("{:.0}", engine.tokens_per_second()));
        let _ = write!(
            y,
            "  - name: {m}\n    models: [\"{m}\"]\n    balancing: {balancing}\n    \
             health: {{interval: 250ms, timeout: 1s, stale_after: 2s}}\n",
            m = engine.model
        );
        if s.exact {
            let _ = write!(
                y,
                "    tokenizer: {}\n    kv_events: auto\n",
                tokenizer_dir().display()
            );
        }
        y.push_str("    backends:\n");
        for b in fleet.addrs(engine.model) {
            let _ = writeln!(y, "      - address: {b}");
        }
    }
    y
}

/// With the exact index, waits until every backend's subscriber hears its engine: each engine
/// resets its (empty) cache, publishing a batch, until Sluice has counted one from each.
pub(crate) async fn subscribers_live(admin: SocketAddr, fleet: &Fleet) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for sim in &fleet.sims {
            sim.reset_prefix_cache();
        }
        let page = crate::fleet::page_of(admin).await?;
        let heard = page
            .lines()
            .filter(|l| l.starts_with("sluice_kv_event_batches_total{"))
            .filter(|l| {
                l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v > 0.0)
            })
            .count();
        if heard >= fleet.sims.len() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "only {heard} of {} subscribers heard their engine in 30 s",
                fleet.sims.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What one strategy's run measured.
struct Run {
    got: Vec<Got>,
    queries: f64,
    hits: f64,
    generated: f64,
    seconds: f64,
    /// Per pool, the KV usage spread (max − min over its engines) at each sample.
    spread: BTreeMap<&'static str, Vec<f64>>,
    predicted: f64,
    reported: f64,
    /// The share of predicted TTFTs within ±25 % of the measured, and how many.
    accuracy: Option<(f64, f64)>,
}

async fn run_strategy(ctx: &Ctx, s: &Strategy, sessions: &[Session]) -> Result<Run> {
    let fleet = Fleet::start()?;
    let dir = ctx.root.path().join("prefix");
    std::fs::create_dir_all(&dir)?;
    let (listen, admin) = (free_addr()?, free_addr()?);
    let yaml = sluice_yaml(&dir, (listen, admin), &fleet, s);
    let _sluice =
        start_sluice_with(&ctx.sluice_bin, &dir, "prefix", &yaml, &[listen, admin]).await?;
    if s.exact {
        subscribers_live(admin, &fleet).await?;
    }
    let idle: Idle = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now() + Duration::from_millis(100);
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sims = fleet.sims.clone();
        let sampling = Arc::clone(&sampling);
        tokio::spawn(async move {
            let mut spread: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                for model in [SMALL, BIG] {
                    let usage: Vec<f64> = sims
                        .iter()
                        .filter(|s| s.model() == model)
                        .map(vllm_sim::Sim::kv_usage)
                        .collect();
                    let max = usage.iter().copied().fold(0.0, f64::max);
                    let min = usage.iter().copied().fold(1.0, f64::min);
                    spread.entry(model).or_default().push(max - min);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            spread
        })
    };
    let got = run_all(sessions, start, || Via::Proxy {
        addr: listen,
        idle: idle.clone(),
        session_header: s.session_header,
    })
    .await?;
    let seconds = start.elapsed().as_secs_f64();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let spread = sampler.await.context("the sampler")?;
    let (queries, hits, generated) = fleet.counters();
    let page = crate::fleet::page_of(admin).await.unwrap_or_default();
    let labelled = |kind: &str| labelled_sum(&page, "sluice_prefix_tokens_total", "kind", kind);
    Ok(Run {
        got,
        queries,
        hits,
        generated,
        seconds,
        spread,
        predicted: labelled("predicted"),
        reported: labelled("reported"),
        accuracy: prediction_accuracy(&page),
    })
}

/// The reference policy's run (no proxy: the harness places each turn and sends it to the
/// engine), and the prompt tokens an infinite cache shared by every engine computes for the
/// bodies it sent.
async fn run_reference(sessions: &[Session]) -> Result<(Run, u64)> {
    let fleet = Fleet::start()?;
    let direct = Arc::new(Direct::new(&fleet)?);
    let start = Instant::now() + Duration::from_millis(100);
    let got = run_all(sessions, start, || Via::Reference(Arc::clone(&direct))).await?;
    let seconds = start.elapsed().as_secs_f64();
    let (queries, hits, generated) = fleet.counters();
    let sent = std::mem::take(
        &mut *direct
            .sent
            .lock()
            .map_err(|_| anyhow::anyhow!("the bodies' lock"))?,
    );
    let limit = limit_engine_tokens(&sent)?;
    let run = Run {
        got,
        queries,
        hits,
        generated,
        seconds,
        spread: BTreeMap::new(),
        predicted: 0.0,
        reported: 0.0,
        accuracy: None,
    };
    Ok((run, limit))
}

/// The reference policy's row (it is not a Sluice strategy: no proxy at all).
const REFERENCE: Strategy = Strategy {
    contender: Contender::Direct,
    name: "reference cost policy (the harness, direct)",
    balancing: "",
    exact: false,
    session_header: false,
};

/// Adds `run`'s rows for `s` (its prompt tokens over the infinite cache's `limit`, when
/// known); returns its failed requests.
fn record(
    report: &mut ScenarioReport,
    by_kind: &mut Table,
    s: &Strategy,
    run: &Run,
    limit: Option<f64>,
) -> usize {
    let (all, later) = ttfts(run);
    let failed: Vec<&Got> = run.got.iter().filter(|g| g.error.is_some()).collect();
    report.measured(
        s.contender,
        run.got.len() as u64,
        failed.len() as u64,
        failed.first().and_then(|g| g.error.clone()),
    );
    let spread = |model: &str| run.spread.get(model).map_or(f64::NAN, |v| pct(v, 0.5));
    let three = |v: &[f64]| {
        format!(
            "{:.0} / {:.0} / {:.0}",
            pct(v, 0.5),
            pct(v, 0.9),
            pct(v, 0.99)
        )
    };
    let computed = run.queries - run.hits;
    report.rows.push(vec![
        s.name.to_string(),
        three(&all),
        three(&later),
        format!("{:.1} %", 100.0 * run.hits / run.queries.max(1.0)),
        format!("{computed:.0}"),
        limit.map_or("-".to_string(), |l| format!("{:.3}", computed / l)),
        format!("{:.0}", run.generated / run.seconds.max(1e-9)),
        failed.len().to_string(),
        format!("{:.2} / {:.2}", spread(SMALL), spread(BIG)),
        if s.exact {
            format!("{:.0} / {:.0}", run.predicted, run.reported)
        } else {
            "-".to_string()
        },
        run.accuracy.map_or("-".to_string(), |(share, n)| {
            format!("{:.0} % of {n:.0}", 100.0 * share)
        }),
    ]);
    let mut row = vec![s.name.to_string()];
    for kind in [Kind::Conversation, Kind::Agent, Kind::Rag] {
        let of_kind: Vec<f64> = run
            .got
            .iter()
            .filter(|g| g.kind == Some(kind) && g.stream && g.turn >= 2 && g.error.is_none())
            .filter_map(|g| g.ttft.map(ms))
            .collect();
        row.push(format!(
            "{:.0} / {:.0}",
            pct(&of_kind, 0.5),
            pct(&of_kind, 0.99)
        ));
    }
    by_kind.rows.push(row);
    failed.len()
}

pub(crate) fn pct(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// TTFT of streams (ms): all of them, and turns ≥ 2.
fn ttfts(run: &Run) -> (Vec<f64>, Vec<f64>) {
    let ok = run.got.iter().filter(|g| g.stream && g.error.is_none());
    let all = ok.clone().filter_map(|g| g.ttft.map(ms)).collect();
    let later = ok
        .filter(|g| g.turn >= 2)
        .filter_map(|g| g.ttft.map(ms))
        .collect();
    (all, later)
}

/// What tokenizing costs the request path: microseconds per chat request of each size. The
/// request path keys a prompt from the core's parse ([`PrefixRouting::keys`]: tokens and
/// block keys); the body read again is what it did before.
fn tokenizing_cost() -> Result<Vec<Vec<String>>> {
    let tokenizer = Arc::new(
        sluice_tokenizer::PromptTokenizer::load(&tokenizer_dir())
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let routing = PrefixRouting::new(Arc::clone(&tokenizer), KvEventSource::Port(1));
    let mut rng = Rng::new(SEED ^ 7);
    let mut rows = Vec::new();
    for words in [150, 2_500, 16_000] {
        let body = serde_json::to_vec(&json!({"model": BIG, "messages": [
            {"role": "system", "content": text(&mut rng, words / 2)},
            {"role": "user", "content": text(&mut rng, words / 2)}]}))?;
        // New: every body unseen (its pieces never tokenized); seen before: the same body
        // again (its pieces remembered, as a conversation's history is at its next turn),
        // keyed from the core's parse, then read again whole as before.
        let mut new = Vec::new();
        let mut seen = Vec::new();
        let mut read_again = Vec::new();
        let mut tokens = 0;
        for round in 0..40 {
            let fresh = serde_json::to_vec(&json!({"model": BIG, "messages": [
                {"role": "system", "content": format!("{round} {}", text(&mut rng, words / 2))},
                {"role": "user", "content": text(&mut rng, words / 2)}]}))?;
            let call = LlmCall::parse(Endpoint::ChatCompletions, Bytes::from(fresh.clone()))
                .map_err(|e| anyhow::anyhow!("{}", e.message))?;
            let started = Instant::now();
            tokens = routing
                .keys(&call, None, None)
                .ok_or_else(|| anyhow::anyhow!("no keys"))?
                .tokens;
            new.push(started.elapsed().as_secs_f64() * 1e6);
            // The two ways in turn, each first every other round (the second of two calls
            // finds the processor's caches warmer).
            for way in [round % 2, 1 - round % 2] {
                let started = Instant::now();
                if way == 0 {
                    routing.keys(&call, None, None);
                } else {
                    let ids = tokenizer.chat(&fresh).map_err(|e| anyhow::anyhow!("{e}"))?;
                    block_keys(&ids, routing.index.block_size(), None, None);
                }
                let took = started.elapsed().as_secs_f64() * 1e6;
                if way == 0 { &mut seen } else { &mut read_again }.push(took);
            }
        }
        rows.push(vec![
            format!("{:.1} KB", body.len() as f64 / 1024.0),
            tokens.to_string(),
            format!("{:.0} / {:.0}", pct(&new, 0.5), pct(&new, 0.99)),
            format!("{:.0} / {:.0}", pct(&seen, 0.5), pct(&seen, 0.99)),
            format!(
                "{:.0} / {:.0}",
                pct(&read_again, 0.5),
                pct(&read_again, 0.99)
            ),
            format!("{:.0}", tokens as f64 / TARGET.tokens_per_second() * 1e6),
        ]);
    }
    Ok(rows)
}

pub async fn prefix_fleet(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    let sessions = schedule(
        ctx.p.prefix_sessions,
        ctx.p.prefix_duration,
        ctx.p.prefix_max_steps,
        ctx.p.prefix_think_scale,
    );
    let requests: usize = sessions.iter().map(|s| s.steps.len()).sum();
    report.header = [
        "strategy",
        "TTFT p50 / p90 / p99 ms (streams)",
        "turns ≥ 2: p50 / p90 / p99 ms",
        "engine prefix hits",
        "prompt tokens computed",
        "÷ the limit",
        "output tok/s",
        "errors",
        "KV spread p50 (small / big)",
        "index: predicted / reported cached",
        "predicted TTFT within ±25 %",
    ]
    .map(String::from)
    .to_vec();
    let mut by_kind = Table {
        caption: "Turns ≥ 2, streams' TTFT p50 / p99 ms by kind of session".into(),
        header: ["strategy", "conversations", "agents", "RAG (questions ≥ 2)"]
            .map(String::from)
            .to_vec(),
        rows: Vec::new(),
    };
    let mut p99_later: BTreeMap<&str, f64> = BTreeMap::new();
    let mut computed: BTreeMap<&str, f64> = BTreeMap::new();
    let mut errors: BTreeMap<&str, usize> = BTreeMap::new();
    // The reference first: its bodies give the limit every row is set against.
    let reference = run_reference(&sessions).await;
    let limit = reference.as_ref().ok().map(|(_, limit)| *limit as f64);
    for s in &STRATEGIES {
        let run = match run_strategy(ctx, s, &sessions).await {
            Ok(run) => run,
            Err(e) => {
                report.notes.push(format!("{}: did not run: {e:#}", s.name));
                report.measured(s.contender, 0, 1, Some(format!("did not run: {e:#}")));
                continue;
            }
        };
        let failed = record(&mut report, &mut by_kind, s, &run, limit);
        p99_later.insert(s.name, pct(&ttfts(&run).1, 0.99));
        computed.insert(s.name, run.queries - run.hits);
        errors.insert(s.name, failed);
    }
    match reference {
        Ok((run, limit)) => {
            record(
                &mut report,
                &mut by_kind,
                &REFERENCE,
                &run,
                Some(limit as f64),
            );
            p99_later.insert(REFERENCE.name, pct(&ttfts(&run).1, 0.99));
            let mut row = vec![
                "the limit: an infinite cache shared by every engine".to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
                limit.to_string(),
                "1.000".into(),
            ];
            row.resize(report.header.len(), "-".into());
            report.rows.push(row);
        }
        Err(e) => report
            .notes
            .push(format!("the reference policy did not run: {e:#}")),
    }
    let get = |m: &BTreeMap<&str, f64>, k: &str| m.get(k).copied().unwrap_or(f64::NAN);
    let exact = get(&p99_later, "ttft, exact index");
    report.checks.push(Check::at_least(
        "turns ≥ 2, TTFT p99: round_robin ÷ exact index",
        get(&p99_later, "round_robin") / exact,
        2.0,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_least(
        "turns ≥ 2, TTFT p99: approximate affinity ÷ exact index",
        get(&p99_later, "ttft, approximate") / exact,
        1.5,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most(
        "turns ≥ 2, TTFT p99: exact index ÷ oracle",
        exact / get(&p99_later, "oracle (session)"),
        1.1,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most(
        "prompt tokens computed: exact index ÷ oracle",
        get(&computed, "ttft, exact index") / get(&computed, "oracle (session)"),
        1.0,
        "×",
        Noise::Share,
    ));
    report.checks.push(Check::at_most(
        "errors: exact index − round_robin",
        errors
            .get("ttft, exact index")
            .copied()
            .unwrap_or(usize::MAX) as f64
            - errors.get("round_robin").copied().unwrap_or(0) as f64,
        0.0,
        "",
        Noise::Exact,
    ));
    report.notes.push(format!(
        "{} sessions ({requests} requests) starting over {:?}, the same schedule for every strategy, each on a fresh fleet: 4 `small` engines (50k prompt tokens/s, 8 ms a token, 4,096 blocks) and 4 `big` (13.3k tokens/s, 30 ms, 8,192 blocks), chunked prefill of 8,192 tokens a step, prefix caching, KV events; Sluice's pools balance as the row says. The reference cost policy is the harness's own (no proxy): each turn goes where its uncached tokens (by the engines' tokenizer, against the blocks the policy sent to each engine, LRU at its capacity) plus the uncached tokens sent there and not yet at their first token are least. The limit: the prompt tokens an infinite cache shared by every engine computes for the bodies the reference sent (answers differ a little between runs, so the limit is that run's).",
        sessions.len(),
        ctx.p.prefix_duration
    ));
    report.tables.push(by_kind);
    match tokenizing_cost() {
        Ok(rows) => report.tables.push(Table {
            caption: "Tokenizing a chat request for the index (this machine, one thread; bodies over 16 KB are tokenized on the blocking pool), against the prefill it can save on a `big` engine".into(),
            header: ["body", "tokens", "new: p50 / p99 µs", "seen before: p50 / p99 µs", "seen before, body read again: p50 / p99 µs", "the prefill of those tokens, µs"].map(String::from).to_vec(),
            rows,
        }),
        Err(e) => report.notes.push(format!("tokenizing cost not measured: {e:#}")),
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_seeded_and_mixed() {
        let a = schedule(60, Duration::from_secs(30), usize::MAX, 1.0);
        let b = schedule(60, Duration::from_secs(30), usize::MAX, 1.0);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        for kind in [Kind::Conversation, Kind::Agent, Kind::Rag] {
            assert!(a.iter().any(|s| s.kind == kind), "{kind:?}");
        }
        assert!(a.iter().all(|s| s.start <= Duration::from_secs(30)));
        assert!(a
            .iter()
            .filter(|s| s.kind == Kind::Conversation)
            .all(|s| (3..=12).contains(&s.steps.len())));
        let short = schedule(60, Duration::from_secs(30), 2, 0.5);
        assert!(short.iter().all(|s| s.steps.len() <= 2));
        assert_eq!(
            short[0].steps[0].adds, a[0].steps[0].adds,
            "the same sessions, cut"
        );
    }

    #[test]
    fn answers_are_read_from_json_and_streams() {
        let json = br#"{"choices":[{"message":{"content":"a b"}}]}"#;
        assert_eq!(answer_text(json, false), "a b");
        let sse = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" x\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(answer_text(sse, true), " x");
    }
}
