//! Scenario 13 (issue #18, "Time to first token at the tail"): a draft and target fleet of
//! simulators with realistic prefill and decode speeds, each prefilling one request at a
//! time, behind Sluice with the speculative selector, the cache (coalescing) and the KV
//! breaker; a seeded, open-loop, bursty schedule with long prompts, exact repeats that arrive
//! while their first copy is still generating, and streams; the same schedule replayed with
//! each balancing strategy (`round_robin`, `kv_aware`, `ttft`) on both pools.
//!
//! Every request is recorded: its time to first token (a stream's first data chunk), its
//! total time, its status, `x-cache` and `x-sluice-pool`, and the prompt it carried, so the
//! report can take each stream's own prefill (its prompt tokens × the per-token prefill of
//! the pool that served it) out of its time to first token: what is left is the wait a
//! router controls (queueing behind other prefills, plus the fixed overhead).
//!
//! Scenario 25 replays the same schedule on the fleet vLLM V1 makes by default: chunked
//! prefill (8,192-token steps shared by the decodes and the prefills, the prompts queued taking
//! them in arrival order, as vLLM does without a `long_prefill_token_threshold`: a short prompt
//! behind a long one waits for the step where the long one ends) and prefix caching, with 4
//! targets.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::Full;
use tokio::sync::Mutex;

use crate::contenders::{free_addr, start_sluice_with, Contender, RunningSim, SimSpec, MODEL};
use crate::loadgen::{fetch, Target};
use crate::phased::{checkout, read_answer, Idle};
use crate::report::{pairwise, Check, Noise, ScenarioReport, Series};
use crate::resilience::metric_sum;
use crate::scenarios::{title, CHAT};
use crate::{Ctx, Params};

/// The longest a request may take before it counts as unanswered.
const REQUEST_LIMIT: Duration = Duration::from_secs(60);
/// Every request asks for this many tokens, and every simulated answer has exactly as many.
const MAX_TOKENS: u32 = 32;
/// The draft pool's `max_model_len` in Sluice (the draft profile's context): longer prompts
/// go to the target (`prompt-too-long`).
const DRAFT_MAX_MODEL_LEN: u32 = 8192;
/// A "short" prompt: at most this many bytes of message (about 1,000 tokens).
const SHORT_MAX_BYTES: usize = 4096;
/// The first round's schedule seed (round `k` replays `SEED + k`): within a round every
/// strategy replays the same requests at the same times.
const SEED: u64 = 0x5eed_0018;

/// The workload's shares.
const LONG_SHARE: f64 = 0.12;
const STREAM_SHARE: f64 = 0.5;
const FORCED_TARGET_SHARE: f64 = 0.25;
const BURST_FACTOR: f64 = 3.0;

/// One pool's simulated instances (the simulator's `Draft` and `Target` profiles' speeds
/// and KV caches, without their jitter).
#[derive(Clone, Copy, Debug)]
struct Speed {
    name: &'static str,
    overhead_ms: f64,
    prefill_us: f64,
    itl_ms: f64,
    kv_blocks: u32,
}

const DRAFT: Speed = Speed {
    name: "draft",
    overhead_ms: 5.0,
    prefill_us: 20.0,
    itl_ms: 5.0,
    kv_blocks: 2048,
};
const TARGET: Speed = Speed {
    name: "target",
    overhead_ms: 20.0,
    prefill_us: 200.0,
    itl_ms: 30.0,
    kv_blocks: 8192,
};

/// The fleet's shape: scenario 13's engines prefill one request at a time (vLLM without
/// chunked prefill), scenario 25's are vLLM V1's (chunked prefill with this step budget,
/// prefix caching), with more targets.
#[derive(Clone, Copy, Debug)]
struct Shape {
    scenario: u8,
    targets: usize,
    v1_budget: Option<u32>,
}

const SERIAL_FLEET: Shape = Shape {
    scenario: 13,
    targets: 2,
    v1_budget: None,
};
const V1_FLEET: Shape = Shape {
    scenario: 25,
    targets: 4,
    v1_budget: Some(8192),
};

impl Speed {
    fn spec(&self, scale: f64, shape: Shape) -> SimSpec {
        SimSpec {
            itl_ms: self.itl_ms * scale,
            answer_tokens: Some(MAX_TOKENS),
            kv_blocks: Some(self.kv_blocks),
            oom: true,
            prefill_us: self.prefill_us * scale,
            overhead_ms: self.overhead_ms * scale,
            serial_prefill: shape.v1_budget.is_none(),
            v1_engine: shape.v1_budget,
        }
    }

    /// The prompt's own prefill here, ms (the overhead not included).
    fn prefill_ms(&self, tokens: u32, scale: f64) -> f64 {
        f64::from(tokens) * self.prefill_us * scale / 1e3
    }

    /// How long a request takes here with nothing ahead of it, ms.
    fn unloaded_ms(&self, tokens: u32, scale: f64) -> f64 {
        (self.overhead_ms + f64::from(MAX_TOKENS) * self.itl_ms) * scale
            + self.prefill_ms(tokens, scale)
    }

    /// Prompt tokens per second, `ttft`'s seed (`prefill_tokens_per_second`).
    fn tokens_per_second(&self, scale: f64) -> f64 {
        1e6 / (self.prefill_us * scale)
    }
}

/// The balancing strategies compared, each with its contender.
const STRATEGIES: [(&str, Contender); 3] = [
    ("round_robin", Contender::SluiceRoundRobin),
    ("kv_aware", Contender::SluiceKvAware),
    ("ttft", Contender::SluiceTtft),
];

/// splitmix64: a small seeded generator, so the schedule is the same on every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
}

/// One request of the schedule.
#[derive(Clone, Debug)]
struct Planned {
    due: Duration,
    body: Bytes,
    stream: bool,
    /// Carries `x-sluice-tier: target`.
    forced: bool,
    /// The message's bytes and the simulator's count of its prompt tokens.
    prompt_bytes: usize,
    prompt_tokens: u32,
    /// For an exact repeat: the schedule index of its first copy.
    first_copy: Option<usize>,
    /// Due in a burst phase.
    in_burst: bool,
}

/// The simulator's prompt tokens for one chat message: ceil((bytes + 16) / 4).
fn prompt_tokens(bytes: usize) -> u32 {
    u32::try_from((bytes + 16).div_ceil(4)).unwrap_or(u32::MAX)
}

fn body(content: &str, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "stream": stream,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        })
        .to_string(),
    )
}

/// A message of `bytes` bytes that no other request of the run has: a tag, then filler.
fn content(tag: &str, i: usize, bytes: usize) -> String {
    const FILLER: &str = "the retrieved passage says that the quick brown fox jumps over the \
                          lazy dog while the engine keeps its cache warm and its queue short. ";
    let mut s = format!("[{tag} {i}] ");
    while s.len() < bytes {
        s.push_str(FILLER);
    }
    s.truncate(bytes.max(1));
    s
}

/// The pool a request should land on (the speculative selector: forced, or too long for
/// the draft), and so how long it takes unloaded, for the repeats' delays.
fn expected_pool(forced: bool, tokens: u32) -> Speed {
    if forced || tokens + MAX_TOKENS > DRAFT_MAX_MODEL_LEN {
        TARGET
    } else {
        DRAFT
    }
}

/// The seeded schedule: first copies arrive as a Poisson process at `fleet_rate` per second
/// in calm phases and 3× that in bursts; 12 % have a RAG-sized prompt (20 to 60 KB), the
/// rest 256 B to 4 KB (log-uniform); half are streams; a quarter ask for the target tier.
/// Each first copy gets 0, 1 or 2 exact repeats (probabilities 1/2, 1/3, 1/6: 40 % of all
/// requests are repeats), each due 5 % to 60 % of the first copy's unloaded duration after
/// it, so while it is still generating.
fn schedule(p: &Params, tag: &str, seed: u64) -> Vec<Planned> {
    let mut rng = Rng(seed);
    let cycle = (p.fleet_calm + p.fleet_burst).as_secs_f64();
    let in_burst = |t: f64| cycle > 0.0 && t % cycle >= p.fleet_calm.as_secs_f64();
    let end = p.fleet_duration.as_secs_f64();
    let mut out: Vec<Planned> = Vec::new();
    let mut t = 0.0;
    let mut n = 0usize;
    loop {
        let rate = p.fleet_rate * if in_burst(t) { BURST_FACTOR } else { 1.0 };
        t += -(1.0 - rng.unit()).ln() / rate.max(1e-3);
        if t >= end {
            break;
        }
        let long = rng.unit() < LONG_SHARE;
        let bytes = if long {
            rng.range(20_000.0, 60_000.0)
        } else {
            (rng.range(256f64.ln(), (SHORT_MAX_BYTES as f64).ln())).exp()
        } as usize;
        let stream = rng.unit() < STREAM_SHARE;
        let forced = rng.unit() < FORCED_TARGET_SHARE;
        let tokens = prompt_tokens(bytes);
        let first = out.len();
        let b = body(&content(tag, n, bytes), stream);
        n += 1;
        let planned = Planned {
            due: Duration::from_secs_f64(t),
            body: b,
            stream,
            forced,
            prompt_bytes: bytes,
            prompt_tokens: tokens,
            first_copy: None,
            in_burst: in_burst(t),
        };
        let u = rng.unit();
        let repeats = if u < 0.5 {
            0
        } else if u < 0.5 + 1.0 / 3.0 {
            1
        } else {
            2
        };
        let unloaded = expected_pool(forced, tokens).unloaded_ms(tokens, p.fleet_time_scale);
        let mut copies = Vec::new();
        for _ in 0..repeats {
            let after = rng.range(0.05, 0.6) * unloaded / 1e3;
            let at = t + after;
            copies.push(Planned {
                due: Duration::from_secs_f64(at),
                first_copy: Some(first),
                in_burst: in_burst(at),
                ..planned.clone()
            });
        }
        out.push(planned);
        out.extend(copies);
    }
    // Sorted by due time; first-copy indices follow their requests.
    let mut order: Vec<usize> = (0..out.len()).collect();
    order.sort_by_key(|&i| (out[i].due, i));
    let mut new_index = vec![0usize; out.len()];
    for (new, &old) in order.iter().enumerate() {
        new_index[old] = new;
    }
    order
        .iter()
        .map(|&old| {
            let mut r = out[old].clone();
            r.first_copy = r.first_copy.map(|f| new_index[f]);
            r
        })
        .collect()
}

/// How one request ended, times from when it was due.
#[derive(Clone, Debug, Default)]
struct Got {
    /// The first body chunk (a stream's first data chunk; a JSON answer's whole body).
    first: Option<Duration>,
    end: Duration,
    status: Option<u16>,
    rejected: Option<String>,
    /// No answer, a non-2xx, or a stream that ended with an error event or without `[DONE]`.
    error: Option<String>,
    cache: Option<String>,
    pool: Option<String>,
}

impl StrategyRun {
    /// The strategy, and its round when there are several.
    fn label(&self, rounds: usize) -> String {
        if rounds > 1 {
            format!("{} (round {})", self.strategy, self.round + 1)
        } else {
            self.strategy.to_string()
        }
    }
}

impl Got {
    fn ok(&self) -> bool {
        self.error.is_none()
    }

    fn hit(&self) -> bool {
        self.cache.as_deref() == Some("HIT")
    }

    fn label(&self) -> String {
        match (self.status, &self.rejected) {
            (Some(s), Some(r)) => format!("{s} {r}"),
            (Some(s), None) if !(200..300).contains(&s) => s.to_string(),
            (Some(_), None) => "broken stream".into(),
            (None, _) => "no answer".into(),
        }
    }
}

/// Sends one request when due (on an idle kept-alive connection or a new one) and reads its
/// answer whole, timing the first chunk.
async fn one(addr: SocketAddr, idle: Idle, r: Planned, start: Instant, id: String) -> Got {
    let due = start + r.due;
    tokio::time::sleep_until(due.into()).await;
    let mut got = Got::default();
    let res = tokio::time::timeout(REQUEST_LIMIT, exchange(addr, &idle, &r, due, &id, &mut got));
    match res.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => got.error = Some(format!("{e:#}")),
        Err(_) => got.error = Some(format!("no answer within {REQUEST_LIMIT:?}")),
    }
    got.end = Instant::now().saturating_duration_since(due);
    got
}

async fn exchange(
    addr: SocketAddr,
    idle: &Idle,
    r: &Planned,
    due: Instant,
    id: &str,
    got: &mut Got,
) -> Result<()> {
    let mut sender = checkout(idle, addr).await?;
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(CHAT)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", id);
    if r.forced {
        req = req.header("x-sluice-tier", "target");
    }
    let req = req
        .body(Full::new(r.body.clone()))
        .context("building the request")?;
    let resp = sender.send_request(req).await.context("sending")?;
    let status = resp.status();
    let text = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    got.status = Some(status.as_u16());
    got.rejected = text("x-sluice-rejected");
    got.cache = text("x-cache");
    got.pool = text("x-sluice-pool");
    let (all, first) = read_answer(idle, sender, resp).await?;
    got.first = first.map(|at| at.saturating_duration_since(due));
    if r.stream {
        let has = |pat: &[u8]| all.windows(pat.len()).any(|w| w == pat);
        if has(b"data: {\"error\"") {
            bail!("the stream ended with an error event");
        }
        if !has(b"data: [DONE]") {
            bail!("the stream ended without data: [DONE]");
        }
    }
    Ok(())
}

/// Runs the schedule against `addr`; the results in schedule order.
async fn replay(addr: SocketAddr, plan: &[Planned], run: usize) -> Result<Vec<Got>> {
    let idle: Idle = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(plan.len());
    for (i, r) in plan.iter().enumerate() {
        let id = format!("fleet-{run}-{i}");
        tasks.push(tokio::spawn(one(addr, idle.clone(), r.clone(), start, id)));
    }
    let mut out = Vec::with_capacity(plan.len());
    for t in tasks {
        out.push(t.await.context("a request task panicked")?);
    }
    Ok(out)
}

/// Percentile (nearest rank) of `v`, NaN when empty.
fn pct(v: &[f64], p: f64) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The sum of the series of `name` whose labels include `label` (`result="coalesced"`).
fn metric_with(page: &str, name: &str, label: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `addr`'s `/metrics` page.
pub(crate) async fn page_of(addr: SocketAddr) -> Result<String> {
    page(addr).await
}

async fn page(addr: SocketAddr) -> Result<String> {
    let (status, _, body) = fetch(&Target::get(addr, "/metrics")).await?;
    if !status.is_success() {
        bail!("{addr}/metrics: HTTP {status}");
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The simulators' OOMs and preemptions, summed.
async fn sim_counts(sims: &[SocketAddr]) -> Result<(f64, f64)> {
    let (mut oom, mut pre) = (0.0, 0.0);
    for a in sims {
        let p = page(*a).await?;
        oom += metric_sum(&p, "sim_oom_total");
        pre += metric_sum(&p, "vllm:num_preemptions_total");
    }
    Ok((oom, pre))
}

/// Sluice's cache counters: coalesced followers and hits.
async fn cache_counts(admin: SocketAddr) -> Result<(f64, f64)> {
    let p = page(admin).await?;
    Ok((
        metric_with(&p, "llm_cache_requests_total", "result=\"coalesced\""),
        metric_with(&p, "llm_cache_requests_total", "result=\"hit\""),
    ))
}

fn sluice_yaml(
    dir: &Path,
    name: &str,
    (listen, admin): (SocketAddr, SocketAddr),
    drafts: &[SocketAddr],
    targets: &[SocketAddr],
    strategy: &str,
    scale: f64,
) -> String {
    let mut y = format!(
        "# Generated by sluice-bench (scenario 13).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         limits:\n  max_connections_per_client: 8192\n  max_requests_in_flight_per_client: 8192\n\
         log:\n  level: warn\n  access_log: true\n\
         pools:\n",
        pid = dir.join(format!("{name}.pid")).display(),
        sock = dir.join(format!("{name}.sock")).display(),
    );
    for (speed, backends) in [(DRAFT, drafts), (TARGET, targets)] {
        let _ = write!(y, "  - name: {}\n    models: [\"{MODEL}\"]\n", speed.name);
        if speed.name == DRAFT.name {
            let _ = writeln!(y, "    max_model_len: {DRAFT_MAX_MODEL_LEN}");
        }
        let _ = write!(y, "    balancing:\n      strategy: {strategy}\n");
        if strategy == "ttft" {
            let _ = writeln!(
                y,
                "      prefill_tokens_per_second: {:.0}",
                speed.tokens_per_second(scale)
            );
        }
        y.push_str("    backends:\n");
        for b in backends {
            let _ = writeln!(y, "      - address: {b}");
        }
    }
    let _ = write!(
        y,
        "plugins:\n  request_id:\n    enabled: true\n  cache:\n    enabled: true\n    \
         store: memory\n    tenant: {{anonymous: share}}\n  speculative:\n    enabled: true\n    \
         models:\n      - model: {MODEL}\n        drafts: [{{pool: draft}}]\n        \
         target: target\n  kv_breaker:\n    enabled: true\n"
    );
    y
}

/// Sends a short request of its own until one answer is a 200 (Sluice and its pools are up).
async fn first_answer(addr: SocketAddr, tag: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 0;
    loop {
        let b = body(&content(&format!("{tag} warm-up"), i, 64), false);
        i += 1;
        let (status, _, answer) = fetch(&Target::post_json(addr, CHAT, b)).await?;
        if status.is_success() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "no 200 within 10 s; last: HTTP {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One strategy's run and what it measured.
struct StrategyRun {
    /// The round, and so the schedule (`plans[round]`) it replayed.
    round: usize,
    strategy: &'static str,
    got: Vec<Got>,
    coalesced: f64,
    hits: f64,
    oom: f64,
    preemptions: f64,
}

/// The numbers of one run, derived from the per-request records.
#[derive(Debug, Default)]
struct Derived {
    errors: usize,
    errors_by: BTreeMap<String, usize>,
    streams: usize,
    stream_ttft: Vec<f64>,
    short_stream_ttft: Vec<f64>,
    json_total: Vec<f64>,
    /// Streams answered by a coalesced follower, their TTFT, their leaders' TTFT, and how
    /// much later than its leader's (or its own sending, when later) the first chunk came.
    follower_ttft: Vec<f64>,
    leader_ttft: Vec<f64>,
    follower_lag: Vec<f64>,
    /// Streams that went upstream: TTFT minus the prompt's own prefill on their pool.
    wait: Vec<f64>,
    /// (index, wait ms, TTFT ms) of every upstream stream, for the notes.
    waits: Vec<(usize, f64, f64)>,
    upstream_ok: usize,
    upstream_draft: usize,
}

fn derive(plan: &[Planned], got: &[Got], scale: f64) -> Derived {
    let mut d = Derived::default();
    for (i, (r, g)) in plan.iter().zip(got).enumerate() {
        if !g.ok() {
            d.errors += 1;
            *d.errors_by.entry(g.label()).or_default() += 1;
            continue;
        }
        if !g.hit() {
            d.upstream_ok += 1;
            if g.pool.as_deref() == Some(DRAFT.name) {
                d.upstream_draft += 1;
            }
        }
        if !r.stream {
            d.json_total.push(ms(g.end));
            continue;
        }
        d.streams += 1;
        let Some(first) = g.first.map(ms) else {
            continue;
        };
        d.stream_ttft.push(first);
        if r.prompt_bytes <= SHORT_MAX_BYTES {
            d.short_stream_ttft.push(first);
        }
        if g.hit() {
            // A coalesced follower: a repeat sent while its first copy was still in flight,
            // which went upstream itself.
            let Some(j) = r.first_copy else { continue };
            let (lr, lg) = (&plan[j], &got[j]);
            let leader_end = lr.due + lg.end;
            if !lg.ok() || lg.hit() || r.due >= leader_end {
                continue;
            }
            let Some(lfirst) = lg.first else { continue };
            d.follower_ttft.push(first);
            d.leader_ttft.push(ms(lfirst));
            let own = r.due + Duration::from_secs_f64(first / 1e3);
            let after = (lr.due + lfirst).max(r.due);
            d.follower_lag.push(ms(own.saturating_sub(after)));
        } else {
            let speed = match g.pool.as_deref() {
                Some(n) if n == TARGET.name => TARGET,
                Some(n) if n == DRAFT.name => DRAFT,
                _ => continue,
            };
            let wait = first - speed.prefill_ms(r.prompt_tokens, scale);
            d.wait.push(wait);
            d.waits.push((i, wait, first));
        }
    }
    d
}

fn f1(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.1}")
    } else {
        "–".into()
    }
}

/// Scenario 13: the same seeded schedule through Sluice balancing both pools with each
/// strategy.
pub async fn fleet(ctx: &mut Ctx) -> Result<ScenarioReport> {
    fleet_of(ctx, SERIAL_FLEET).await
}

/// Scenario 25: scenario 13 on vLLM V1's engines, 2 drafts and 4 targets.
pub async fn fleet_v1(ctx: &mut Ctx) -> Result<ScenarioReport> {
    fleet_of(ctx, V1_FLEET).await
}

async fn fleet_of(ctx: &mut Ctx, shape: Shape) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(shape.scenario, title(shape.scenario));
    let p = ctx.p.clone();
    let scale = p.fleet_time_scale;
    let tag = format!(
        "fleet-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    );
    let plans: Vec<Vec<Planned>> = (0..p.fleet_rounds.max(1))
        .map(|round| schedule(&p, &tag, SEED + round as u64))
        .collect();
    let mut runs = Vec::new();
    // Round by round, each strategy in turn: a slow spell of the machine falls on every
    // strategy's runs alike, and each round's schedule is a tail of its own.
    let order = (0..plans.len()).flat_map(|round| STRATEGIES.iter().map(move |s| (round, s)));
    for (k, (round, (strategy, contender))) in order.enumerate() {
        let plan = &plans[round];
        let dir = tempfile::tempdir_in(ctx.root.path())?;
        let mut sims = Vec::new();
        let (mut drafts, mut targets) = (Vec::new(), Vec::new());
        let fleet = [DRAFT, DRAFT]
            .into_iter()
            .chain(std::iter::repeat_n(TARGET, shape.targets));
        for (i, speed) in fleet.enumerate() {
            let d = dir.path().join(format!("sim{i}-{}", speed.name));
            std::fs::create_dir_all(&d).with_context(|| format!("creating {d:?}"))?;
            let sim = RunningSim::start(&ctx.sim, &speed.spec(scale, shape), &d).await?;
            if speed.name == DRAFT.name {
                drafts.push(sim.addr);
            } else {
                targets.push(sim.addr);
            }
            sims.push(sim);
        }
        let all: Vec<SocketAddr> = drafts.iter().chain(&targets).copied().collect();
        let (listen, admin) = (free_addr()?, free_addr()?);
        let name = format!("sluice-{strategy}");
        let yaml = sluice_yaml(
            dir.path(),
            &name,
            (listen, admin),
            &drafts,
            &targets,
            strategy,
            scale,
        );
        let mut proc =
            start_sluice_with(&ctx.sluice_bin, dir.path(), &name, &yaml, &[listen, admin]).await?;
        first_answer(listen, &tag).await?;
        // Let the health checks scrape every simulator once more.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (oom0, pre0) = sim_counts(&all).await?;
        let (co0, hit0) = cache_counts(admin).await?;
        let got = replay(listen, plan, k).await?;
        proc.check_alive()?;
        let (oom1, pre1) = sim_counts(&all).await?;
        let (co1, hit1) = cache_counts(admin).await?;
        let errors: Vec<&Got> = got.iter().filter(|g| !g.ok()).collect();
        report.measured(
            *contender,
            got.len() as u64,
            errors.len() as u64,
            errors.first().and_then(|g| g.error.clone()),
        );
        runs.push(StrategyRun {
            round,
            strategy,
            got,
            coalesced: co1 - co0,
            hits: hit1 - hit0,
            oom: oom1 - oom0,
            preemptions: pre1 - pre0,
        });
        drop(proc);
        drop(sims);
    }

    report.header = [
        "strategy",
        "requests",
        "errors",
        "streams",
        "stream TTFT p50 / p99 ms",
        "short-prompt stream TTFT p99 ms",
        "JSON total p50 / p99 ms",
        "coalesced stream followers: n, TTFT p99 ms (their leaders' p99)",
        "follower lag behind its leader p99 ms",
        "wait (TTFT − own prefill) p50 / p99 ms",
        "coalesced / hits (Sluice's count)",
        "draft share",
        "simulator OOMs / preemptions",
    ]
    .map(String::from)
    .to_vec();
    let mut derived = Vec::new();
    for r in &runs {
        let d = derive(&plans[r.round], &r.got, scale);
        report.rows.push(vec![
            r.label(plans.len()),
            r.got.len().to_string(),
            if d.errors == 0 {
                "0".into()
            } else {
                let by: Vec<String> = d
                    .errors_by
                    .iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .collect();
                format!("{} ({})", d.errors, by.join(", "))
            },
            d.streams.to_string(),
            format!(
                "{} / {}",
                f1(pct(&d.stream_ttft, 50.0)),
                f1(pct(&d.stream_ttft, 99.0))
            ),
            f1(pct(&d.short_stream_ttft, 99.0)),
            format!(
                "{} / {}",
                f1(pct(&d.json_total, 50.0)),
                f1(pct(&d.json_total, 99.0))
            ),
            format!(
                "{}, {} ({})",
                d.follower_ttft.len(),
                f1(pct(&d.follower_ttft, 99.0)),
                f1(pct(&d.leader_ttft, 99.0))
            ),
            f1(pct(&d.follower_lag, 99.0)),
            format!("{} / {}", f1(pct(&d.wait, 50.0)), f1(pct(&d.wait, 99.0))),
            format!("{:.0} / {:.0}", r.coalesced, r.hits),
            format!(
                "{:.0} % ({} of {})",
                100.0 * d.upstream_draft as f64 / d.upstream_ok.max(1) as f64,
                d.upstream_draft,
                d.upstream_ok
            ),
            format!("{:.0} / {:.0}", r.oom, r.preemptions),
        ]);
        derived.push(d);
    }

    let plan = &plans[0];
    let originals = plan.iter().filter(|r| r.first_copy.is_none()).count();
    let long = plan
        .iter()
        .filter(|r| r.prompt_bytes > SHORT_MAX_BYTES)
        .count();
    let streams = plan.iter().filter(|r| r.stream).count();
    let forced = plan.iter().filter(|r| r.forced).count();
    let too_long = plan
        .iter()
        .filter(|r| r.prompt_tokens + MAX_TOKENS > DRAFT_MAX_MODEL_LEN)
        .count();
    let bursts = plan.iter().filter(|r| r.in_burst).count();
    report.notes.push(format!(
        "Schedules: {rounds} rounds, round k's seeded {SEED:#x} + k − 1, the same for every \
         strategy within the round (the strategies take turns, round by round), open loop: each \
         request sent when due on an idle kept-alive connection or a new one, times from the due \
         time. Round 1's: {n} requests over {dur:?}, {originals} first copies and {repeats} \
         exact repeats; first copies arrive as a Poisson process at {rate}/s, {bf}× that in \
         bursts ({burst:?} of every {cycle:?}; {bursts} requests due in bursts). {long} \
         requests ({lp:.0} %) carry a RAG-sized prompt (20 to 60 KB, 5k to 15k tokens), the \
         rest 256 B to 4 KB; {streams} are streams, {forced} ask for the target \
         (`x-sluice-tier: target`), {too_long} are too long for the draft pool's \
         `max_model_len: {DRAFT_MAX_MODEL_LEN}` (`prompt-too-long`). \
         A first copy gets 0, 1 or 2 repeats (1/2, 1/3, 1/6), each due 5 to 60 % of its \
         unloaded duration after it, so while it is still generating. Every request: chat, \
         `temperature: 0`, `max_tokens: {MAX_TOKENS}`.",
        rounds = plans.len(),
        n = plan.len(),
        dur = p.fleet_duration,
        repeats = plan.len() - originals,
        rate = p.fleet_rate,
        bf = BURST_FACTOR,
        burst = p.fleet_burst,
        cycle = p.fleet_calm + p.fleet_burst,
        lp = 100.0 * long as f64 / plan.len().max(1) as f64,
    ));
    report.notes.push(format!(
        "Fleet, fresh for each strategy: 2 draft and {targets} target simulators ({where_}), \
         the simulator's Draft and Target profiles' speeds{scaled}: draft {do} ms + {dp} µs per \
         prompt token to the first token, then {di} ms per token, {dk} KV blocks; target {to} \
         ms + {tp} µs per token, {ti} ms per token, {tk} KV blocks; no jitter; {engine}; \
         vLLM's OOM answer when a request's KV does not fit; {MAX_TOKENS}-token answers. \
         Sluice: pools `draft` (`max_model_len: {DRAFT_MAX_MODEL_LEN}`) and `target`, both \
         serving `{MODEL}`, `balancing.strategy` set on both; for `ttft`, \
         `prefill_tokens_per_second` seeded to the simulators' speed ({dtps:.0} draft, \
         {ttps:.0} target); `speculative` on (draft first), `cache` on (memory, \
         `tenant: {{anonymous: share}}`, coalescing at its defaults), `kv_breaker` on at its \
         defaults, health checks at their defaults.",
        targets = shape.targets,
        engine = match shape.v1_budget {
            None => "one prefill at a time per instance (`serial_prefill`)".to_string(),
            Some(budget) => format!(
                "vLLM V1's engine (`v1_engine({budget})`): chunked prefill in steps of \
                 {budget} tokens shared by the decodes and the prefills, taken by the prompts \
                 queued in arrival order (vLLM's default: no `long_prefill_token_threshold`, \
                 so a short prompt behind a long one waits for the step where the long one \
                 ends), a step lasting its decode or its prefill tokens' time, whichever is \
                 longer; prefix caching (the prompts' token ids made up from their bytes)"
            ),
        },
        where_ = match ctx.sim {
            crate::SimMode::Process(_) => "each a process of its own",
            crate::SimMode::InProcess => "threads of the harness, smoke test",
        },
        scaled = if (scale - 1.0).abs() > f64::EPSILON {
            format!(" × {scale} (smoke run)")
        } else {
            String::new()
        },
        do = DRAFT.overhead_ms * scale,
        dp = DRAFT.prefill_us * scale,
        di = DRAFT.itl_ms * scale,
        dk = DRAFT.kv_blocks,
        to = TARGET.overhead_ms * scale,
        tp = TARGET.prefill_us * scale,
        ti = TARGET.itl_ms * scale,
        tk = TARGET.kv_blocks,
        dtps = DRAFT.tokens_per_second(scale),
        ttps = TARGET.tokens_per_second(scale),
    ));
    report.notes.push(
        "How to read: TTFT is a stream's first data chunk; JSON answers count their total time. \
         A short prompt is at most 4 KB. Coalesced stream followers are repeats answered \
         `x-cache: HIT` that were sent before their first copy's answer ended (the first copy \
         a `MISS`, their leader); their lag is the follower's first chunk minus the later of \
         its leader's first chunk and its own due time (what coalescing adds). The wait is \
         computed for streams that went upstream (`MISS`): TTFT minus the prompt's tokens × the \
         per-token prefill of the pool in `x-sluice-pool`; it keeps the fixed overhead (above), \
         the proxy's time and every prefill queued ahead. Draft share: of \
         the answers that went upstream, those from the draft pool. Coalesced and hits are \
         Sluice's `llm_cache_requests_total` over the run; OOMs and preemptions the \
         simulators' `sim_oom_total` and `vllm:num_preemptions_total`."
            .to_string(),
    );
    // What dominates each strategy's tail: its largest waits and short-stream TTFTs.
    for (r, d) in runs.iter().zip(&derived) {
        let describe = |i: usize, extra: String| {
            let (q, g) = (&plans[r.round][i], &r.got[i]);
            format!(
                "#{i} ({}, {} tokens{}{}, due {:.1} s{}) {extra}",
                g.pool.as_deref().unwrap_or("?"),
                q.prompt_tokens,
                if q.forced { ", forced" } else { "" },
                if q.first_copy.is_some() {
                    ", repeat"
                } else {
                    ""
                },
                q.due.as_secs_f64(),
                if q.in_burst { " in a burst" } else { "" },
            )
        };
        let mut waits = d.waits.clone();
        waits.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top: Vec<String> = waits
            .iter()
            .take(3)
            .map(|(i, w, t)| describe(*i, format!("wait {w:.0} ms, TTFT {t:.0} ms")))
            .collect();
        let mut shorts: Vec<(usize, f64)> = plans[r.round]
            .iter()
            .zip(&r.got)
            .enumerate()
            .filter(|(_, (q, g))| q.stream && q.prompt_bytes <= SHORT_MAX_BYTES && g.ok())
            .filter_map(|(i, (_, g))| Some((i, ms(g.first?))))
            .collect();
        shorts.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top_short: Vec<String> = shorts
            .iter()
            .take(3)
            .map(|(i, t)| {
                describe(
                    *i,
                    format!(
                        "TTFT {t:.0} ms, {}",
                        r.got[*i].cache.as_deref().unwrap_or("no x-cache")
                    ),
                )
            })
            .collect();
        report.notes.push(format!(
            "{}: largest waits: {}; largest short-prompt stream TTFTs: {}.",
            r.label(plans.len()),
            if top.is_empty() {
                "none".into()
            } else {
                top.join("; ")
            },
            if top_short.is_empty() {
                "none".into()
            } else {
                top_short.join("; ")
            },
        ));
    }

    // Each strategy's figure per round, judged round by round: one schedule's p99 is its
    // second-largest stream, so a single request can move it by seconds.
    let per_round = |strategy: &str, f: &dyn Fn(&Derived) -> f64| {
        Series(
            runs.iter()
                .zip(&derived)
                .filter(|(r, _)| r.strategy == strategy)
                .map(|(_, d)| f(d))
                .collect(),
        )
    };
    let total = |strategy: &str, f: &dyn Fn(&StrategyRun, &Derived) -> f64| -> f64 {
        runs.iter()
            .zip(&derived)
            .filter(|(r, _)| r.strategy == strategy)
            .map(|(r, d)| f(r, d))
            .sum()
    };
    for (strategy, _) in STRATEGIES {
        let lag = per_round(strategy, &|d| pct(&d.follower_lag, 99.0));
        let followers = total(strategy, &|_, d| d.follower_ttft.len() as f64);
        report.checks.push(
            Check::at_most_rounds(
                &format!(
                    "{strategy}: a coalesced stream follower's first chunk within 10 ms of its \
                     leader's (p99 of the lag)"
                ),
                &lag,
                10.0,
                "ms",
                Noise::Tail,
            )
            .showing(format!(
                "{} ms (followers' TTFT p99 {} ms, their leaders' {} ms; {followers:.0} followers)",
                lag.show(1),
                per_round(strategy, &|d| pct(&d.follower_ttft, 99.0)).show(0),
                per_round(strategy, &|d| pct(&d.leader_ttft, 99.0)).show(0),
            )),
        );
    }
    let ratio_checks = |what: &str, f: &dyn Fn(&Derived) -> f64| -> Vec<Check> {
        let t = per_round("ttft", f);
        [("round_robin", 3.0), ("kv_aware", 2.0)]
            .iter()
            .map(|(name, want)| {
                let o = per_round(name, f);
                let ratio = pairwise(&o, &t, |o, t| if t > 0.0 { o / t } else { f64::NAN });
                Check::at_least_rounds(
                    &format!("ttft: {what} lower than {name}'s (× lower)"),
                    &ratio,
                    *want,
                    "×",
                    Noise::Tail,
                )
                .showing(format!(
                    "{}× ({name} {} ms, ttft {} ms)",
                    ratio.show(2),
                    o.show(0),
                    t.show(0)
                ))
            })
            .collect()
    };
    let short = ratio_checks("short-prompt stream TTFT p99", &|d| {
        pct(&d.short_stream_ttft, 99.0)
    });
    report.checks.extend(short);
    let wait = ratio_checks("p99 wait", &|d| pct(&d.wait, 99.0));
    report.checks.extend(wait);
    let errs = |s: &str| total(s, &|_, d| d.errors as f64);
    report.checks.push(Check::new(
        "ttft: errors no more than round_robin's and kv_aware's (all rounds)",
        "≤ both",
        format!(
            "ttft {}, round_robin {}, kv_aware {}",
            errs("ttft"),
            errs("round_robin"),
            errs("kv_aware")
        ),
        Some(errs("ttft") <= errs("round_robin") && errs("ttft") <= errs("kv_aware")),
    ));
    let co = |s: &str| total(s, &|r, _| r.coalesced);
    report.checks.push(Check::new(
        "ttft: coalesced requests no fewer than round_robin's and kv_aware's (all rounds)",
        "≥ both",
        format!(
            "ttft {:.0}, round_robin {:.0}, kv_aware {:.0}",
            co("ttft"),
            co("round_robin"),
            co("kv_aware")
        ),
        Some(co("ttft") >= co("round_robin") && co("ttft") >= co("kv_aware")),
    ));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_is_seeded_and_shaped() {
        let p = Params::full();
        let a = schedule(&p, "t", SEED);
        let b = schedule(&p, "t", SEED);
        let other = schedule(&p, "t", SEED + 1);
        assert!(
            other.len() != a.len() || other.iter().zip(&a).any(|(x, y)| x.due != y.due),
            "each round's seed gives a schedule of its own"
        );
        assert_eq!(a.len(), b.len());
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.due == y.due && x.body == y.body));
        assert!(a.windows(2).all(|w| w[0].due <= w[1].due));
        for (i, r) in a.iter().enumerate() {
            if let Some(j) = r.first_copy {
                assert!(j < i, "a repeat after its first copy");
                assert_eq!(a[j].body, r.body);
                assert!(a[j].first_copy.is_none());
            }
        }
        let repeats = a.iter().filter(|r| r.first_copy.is_some()).count();
        let share = repeats as f64 / a.len() as f64;
        assert!((0.3..0.5).contains(&share), "{share}");
    }

    #[test]
    fn prompt_tokens_as_the_simulator_counts() {
        assert_eq!(prompt_tokens(0), 4);
        assert_eq!(prompt_tokens(4), 5);
        assert_eq!(content("x", 1, 100).len(), 100);
    }

    #[test]
    fn labelled_metric_sums() {
        let page = "llm_cache_requests_total{result=\"coalesced\"} 3\n\
                    llm_cache_requests_total{result=\"hit\"} 2\n";
        assert_eq!(
            metric_with(page, "llm_cache_requests_total", "result=\"coalesced\""),
            3.0
        );
    }
}
