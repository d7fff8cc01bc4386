//! Scenario 23: a soak. Sluice with every plugin that fits one pool on runs for a long time
//! (30 minutes in the full run) under steady mixed traffic while faults come on a schedule,
//! and two things are judged: whether its memory keeps growing once warm, and whether any
//! request is lost.
//!
//! - **The stack.** Three simulators (a process each; threads in the smoke test) in one pool,
//!   health checks on (every 250 ms); a redis-server; Sluice with `request_id`, `tenants` (one
//!   tenant with a key and limits too high to refuse, counted in Redis with `on_redis_error:
//!   allow`), `cache` (Redis store) and `kv_breaker`. `speculative` stays off: it needs a
//!   draft and a target pool, and its escalation retries a failed draft on the other pool,
//!   which would hide what a single pool does when a backend dies. Without `redis-server` the
//!   limits are local, the cache is in memory (a small budget, full within the warm-up) and
//!   there are no Redis restarts.
//! - **The traffic**, from this process for the whole run: an open loop at `soak_rate`, each
//!   request sent when due on an idle kept-alive connection or a new one, all with the
//!   tenant's key; non-stream and streamed chat, some with a prompt of their own (half
//!   deterministic, so the cache misses and stores them; half sampled, so it lets them by),
//!   some one of a few repeated prompts (cache hits once stored, in either form). Every
//!   request is recorded: when it was due, its status, when its head came, the SSE events it
//!   got, when and how it ended.
//! - **The faults**, on a schedule of six equal cycles, the first of which is the warm-up;
//!   each cycle: a reload (the file rewritten with a new comment, then SIGHUP, waited for in
//!   `sluice_config_reloads_total`), a simulator killed (SIGKILL) and started again on its
//!   address a few seconds later (up when it answers `/health`), Redis killed and started
//!   again empty on its port (up when it answers `PING`), a second reload, a minute of abuse
//!   (scenario 8's stalled readers, slowloris connections and a connection sending big bodies
//!   back to back), another simulator killed and restarted, then a quiet tenth. So the
//!   warm-up saw every fault once, and the RSS at its end and at the run's end are taken at
//!   the same quiet point of a cycle.
//! - **Lying peers**, for the whole run: the pool follows its backends' KV events (a tokenizer,
//!   `kv_events` on a port where a publisher of the bench's lies in turn: a frame header
//!   declaring a terabyte, a 100 MB message, a batch naming a block size of 2^40, a greeting
//!   and then silence, bytes that are not ZMTP), and a second pool is discovered by DNS from a
//!   real DNS server (dnsmasq, when installed) whose answer for it flaps between the first
//!   backend and no record every few seconds. The traffic goes to the first pool only: the
//!   peers' lies must cost it nothing, and their churn no memory.
//! - **Memory.** Sluice's VmRSS every 10 s (a thirtieth of a cycle, at least 250 ms, in
//!   shorter runs). Pass: the RSS at the end is less than 5 % above the RSS at the warm-up's
//!   end.
//! - **Lost requests.** A failure is the fault's by design only when the request had its
//!   `200` (its first byte) and failed within 2 s after a backend of the pool was killed: a
//!   stream cut midway, which Sluice cannot replay, ends with an SSE error event. A request
//!   that failed before its first byte was not answered by anyone, and Sluice must have sent
//!   it to another backend; a reload, a Redis restart or an attacker must fail nothing. Every
//!   other failure is lost. Pass: none lost. The failures are shown by cause with Sluice's
//!   access-log line for an example of each.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use serde_json::Value;
use tokio::sync::Mutex;

use crate::abuse::{Attack, AttackSpec, AttackStats};
use crate::contenders::{
    free_addr, hash_key, redis_pong, start_redis_on, start_sluice_with, status_bytes, Contender,
    Proc, RunningSim, SimMode, SimSpec, MODEL, TENANT_KEY, TENANT_LIMITS, TENANT_NAME,
};
use crate::loadgen::{connect, fetch, Target};
use crate::report::{Check, Noise, ScenarioReport, Table};
use crate::resilience::{labelled_sum, metric_sum};
use crate::scenarios::{sized_chat_body, title, CHAT};
use crate::sse::count_events;
use crate::Ctx;
use sluice_testkit::DnsServer;

/// The schedule's cycles; the first is the warm-up.
const CYCLES: u32 = 6;

/// The pool's tokenizer, for its exact prefix index (whose events lie).
const TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer-chatml");

/// The DNS-discovered pool whose answer flaps: its name and model.
const FLAP_NAME: &str = "flap.soak.test.";
const FLAP_MODEL: &str = "flapping-model";

/// How long the flapping name has its record, then none.
const FLAP_UP: Duration = Duration::from_secs(3);
const FLAP_DOWN: Duration = Duration::from_secs(4);

/// The simulators of the pool.
const BACKENDS: usize = 3;

/// The simulators' inter-token interval, and every normal request's `max_tokens`: answers of
/// 160 ms, so that streams and non-stream answers are in flight when a backend dies.
const ITL_MS: f64 = 5.0;
const MAX_TOKENS: u32 = 32;

/// A stalled reader's `max_tokens` and the simulators' answer length (the normal requests'
/// `max_tokens` cuts theirs).
const STALL_TOKENS: u32 = 5000;

/// The repeated prompts: cache hits once stored.
const REPEATS: u64 = 8;

/// A failure this long after a backend was killed may be the kill's (a stream cut midway).
const KILL_WINDOW: Duration = Duration::from_secs(2);

/// The longest a request may take before it counts as unanswered.
const REQUEST_LIMIT: Duration = Duration::from_secs(60);

/// The longest a restarted simulator or Redis, a reload, or Sluice's first answer may take.
const READY_LIMIT: Duration = Duration::from_secs(30);

/// Kept-alive client connections idle longer than this are not reused: a connection the proxy
/// closes while idle would fail the next request sent on it, a failure of the client's own.
const IDLE_MAX: Duration = Duration::from_secs(2);

/// Sluice's `send_timeout` and `client_header_timeout` (short, so that they act within an
/// abuse window, as in scenario 8).
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The pass line of the RSS growth after the warm-up, percent.
const GROWTH_LIMIT: f64 = 5.0;

/// Sluice's config and log file names.
const NAME: &str = "sluice-soak";

/// The memory store's budget when there is no Redis: small, so that it is full within the
/// warm-up and its filling is not taken for growth.
const MEMORY_CACHE_BYTES: usize = 4 << 20;

/// One kind of request of the mix.
#[derive(Clone, Copy, Debug)]
struct Kind {
    stream: bool,
    /// One of the [`REPEATS`] prompts (`temperature: 0`): a cache hit once stored.
    repeat: bool,
    /// A prompt of its own with `temperature: 0.7`, which the cache lets by; without it,
    /// `temperature: 0`, a miss that is stored.
    sampled: bool,
}

const fn kind(stream: bool, repeat: bool, sampled: bool) -> Kind {
    Kind {
        stream,
        repeat,
        sampled,
    }
}

/// Request `i` is `MIX[i % 10]`: 4 streams in 10, 3 repeats in 10.
const MIX: [Kind; 10] = [
    kind(false, false, false),
    kind(false, false, true),
    kind(false, true, false),
    kind(true, false, false),
    kind(true, false, true),
    kind(true, true, false),
    kind(false, false, true),
    kind(true, false, true),
    kind(false, true, false),
    kind(false, false, false),
];

/// A fault of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Reload,
    Kill(usize),
    Restart(usize),
    StopRedis,
    StartRedis,
    AttackStart,
    AttackStop,
    /// Not a fault: the end of a cycle, when progress is printed.
    CycleEnd(u32),
}

/// The schedule's lengths, from the soak's.
#[derive(Clone, Copy, Debug)]
struct Plan {
    length: Duration,
    cycle: Duration,
    /// How long a killed simulator stays dead, Redis stays down, and an abuse window lasts.
    backend_down: Duration,
    redis_down: Duration,
    abuse: Duration,
    /// How often the RSS is sampled.
    sample_every: Duration,
}

impl Plan {
    fn new(length: Duration) -> Plan {
        let cycle = length / CYCLES;
        Plan {
            length,
            cycle,
            backend_down: (cycle / 10).min(Duration::from_secs(10)),
            redis_down: (cycle / 20).min(Duration::from_secs(5)),
            abuse: (cycle / 5).min(Duration::from_secs(60)),
            sample_every: (cycle / 30).clamp(Duration::from_millis(250), Duration::from_secs(10)),
        }
    }

    /// Every fault, in order of time from the start of the traffic.
    fn schedule(&self, redis: bool) -> Vec<(Duration, Fault)> {
        let mut v = Vec::new();
        let n = BACKENDS;
        for c in 0..CYCLES {
            let base = self.cycle * c;
            let at = |f: f64| base + self.cycle.mul_f64(f);
            let (first, second) = ((2 * c as usize) % n, (2 * c as usize + 1) % n);
            v.push((at(0.10), Fault::Reload));
            v.push((at(0.20), Fault::Kill(first)));
            v.push((at(0.20) + self.backend_down, Fault::Restart(first)));
            if redis {
                v.push((at(0.40), Fault::StopRedis));
                v.push((at(0.40) + self.redis_down, Fault::StartRedis));
            }
            v.push((at(0.50), Fault::Reload));
            v.push((at(0.55), Fault::AttackStart));
            v.push((at(0.55) + self.abuse, Fault::AttackStop));
            v.push((at(0.80), Fault::Kill(second)));
            v.push((at(0.80) + self.backend_down, Fault::Restart(second)));
            if c + 1 < CYCLES {
                v.push((self.cycle * (c + 1), Fault::CycleEnd(c + 1)));
            }
        }
        v.sort_by_key(|(at, _)| *at);
        v
    }
}

/// The pool's simulators, each on an address of its own that it keeps across restarts.
struct Fleet {
    mode: SimMode,
    spec: SimSpec,
    dir: PathBuf,
    addrs: Vec<SocketAddr>,
    sims: Vec<Option<RunningSim>>,
}

impl Fleet {
    async fn start(mode: &SimMode, spec: &SimSpec, dir: &Path, n: usize) -> Result<Fleet> {
        let mut fleet = Fleet {
            mode: mode.clone(),
            spec: spec.clone(),
            dir: dir.to_path_buf(),
            addrs: Vec::with_capacity(n),
            sims: Vec::with_capacity(n),
        };
        for _ in 0..n {
            fleet.addrs.push(free_addr()?);
            fleet.sims.push(None);
        }
        for i in 0..n {
            fleet.restart(i).await?;
        }
        Ok(fleet)
    }

    /// Kills simulator `i` (SIGKILL for a process; a thread's closes its listener and every
    /// connection at once); returns its address, or `None` when it was not running.
    fn kill(&mut self, i: usize) -> Option<SocketAddr> {
        let sim = self.sims.get_mut(i)?.take()?;
        let addr = sim.addr;
        drop(sim);
        Some(addr)
    }

    /// Starts simulator `i` on its address and waits until it answers `/health`; returns how
    /// long that took. The port may take a moment to be free again.
    async fn restart(&mut self, i: usize) -> Result<Duration> {
        let t0 = Instant::now();
        let addr = *self
            .addrs
            .get(i)
            .ok_or_else(|| anyhow!("no simulator {i}"))?;
        let dir = self.dir.join(format!("sim{i}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {dir:?}"))?;
        let sim = loop {
            match RunningSim::start_on(&self.mode, &self.spec, &dir, addr).await {
                Ok(sim) => break sim,
                Err(e) if t0.elapsed() > READY_LIMIT => {
                    return Err(e.context(format!("starting the simulator on {addr} again")))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        loop {
            let answer = fetch(&Target::get(addr, "/health")).await;
            if matches!(&answer, Ok((status, _, _)) if status.is_success()) {
                break;
            }
            if t0.elapsed() > READY_LIMIT {
                anyhow::bail!("the simulator on {addr} did not answer /health: {answer:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(slot) = self.sims.get_mut(i) {
            *slot = Some(sim);
        }
        Ok(t0.elapsed())
    }
}

/// The Redis behind the tenants' limits and the cache, restarted on its port.
struct Redis {
    addr: SocketAddr,
    dir: PathBuf,
    proc: Option<Proc>,
}

impl Redis {
    /// Starts it on `addr` and waits until it answers `PING`; returns how long that took. A
    /// restart tries again while the port is not free yet; the first start does not (no
    /// redis-server fails at once).
    async fn start(&mut self, restart: bool) -> Result<Duration> {
        let t0 = Instant::now();
        let proc = loop {
            match start_redis_on(&self.dir, self.addr).await {
                Ok(p) => break p,
                Err(e) if !restart || t0.elapsed() > READY_LIMIT => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        self.proc = Some(proc);
        while !redis_pong(self.addr).await {
            if t0.elapsed() > READY_LIMIT {
                anyhow::bail!("redis-server on {} does not answer PING", self.addr);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(t0.elapsed())
    }
}

/// Sluice's config: everything but the comment that makes each reload a change.
struct Config {
    dir: PathBuf,
    listen: SocketAddr,
    admin: SocketAddr,
    backends: Vec<SocketAddr>,
    digest: String,
    redis: Option<SocketAddr>,
    /// The lying KV-event publisher's port, on the backends' address.
    publisher: u16,
    /// The flapping pool's DNS server, when dnsmasq is installed.
    dns: Option<SocketAddr>,
}

impl Config {
    fn path(&self) -> PathBuf {
        self.dir.join(format!("{NAME}.yaml"))
    }

    fn yaml(&self, generation: u32) -> String {
        let mut y = format!(
            "# Generated by sluice-bench (scenario 23). Generation {generation}.\n\
             pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
             grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
             listeners:\n  - address: {listen}\n\
             admin:\n  address: {admin}\n\
             limits:\n  max_connections_per_client: 8192\n  \
             max_requests_in_flight_per_client: 8192\n  send_timeout: {st}ms\n  \
             client_header_timeout: {st}ms\n  client_body_deadline: 5s\n  \
             max_buffered_bytes: 268435456\n\
             log:\n  level: \"warn,sluice::access=info\"\n  access_log: true\n  format: json\n\
             pools:\n  - name: fleet\n    models: [\"{MODEL}\"]\n    \
             health: {{enabled: true, interval: 250ms}}\n    \
             tokenizer: {tokenizer}\n    kv_events: {{port: {publisher}}}\n    \
             balancing: {{strategy: kv_aware}}\n    backends:\n",
            pid = self.dir.join(format!("{NAME}.pid")).display(),
            sock = self.dir.join(format!("{NAME}.sock")).display(),
            listen = self.listen,
            admin = self.admin,
            st = SEND_TIMEOUT.as_millis(),
            tokenizer = TOKENIZER,
            publisher = self.publisher,
        );
        for b in &self.backends {
            y.push_str(&format!("      - address: {b}\n"));
        }
        if let (Some(resolver), Some(first)) = (self.dns, self.backends.first()) {
            y.push_str(&format!(
                "  - name: flapping\n    models: [\"{FLAP_MODEL}\"]\n    \
                 health: {{enabled: true, interval: 250ms}}\n    discovery:\n      \
                 dns: {{name: {FLAP_NAME}, port: {port}, resolver: \"{resolver}\", \
                 min_refresh: 500ms, max_refresh: 1s}}\n",
                port = first.port(),
            ));
        }
        let (store, cache) = match self.redis {
            Some(addr) => (
                format!(
                    "{{kind: redis, on_redis_error: allow, redis: {{url: \"redis://{addr}\"}}}}"
                ),
                format!("    store: redis\n    redis:\n      url: \"redis://{addr}\"\n"),
            ),
            None => (
                "{kind: local}".to_string(),
                format!("    store: memory\n    memory:\n      max_bytes: {MEMORY_CACHE_BYTES}\n"),
            ),
        };
        y.push_str(&format!(
            "plugins:\n  request_id:\n    enabled: true\n  \
             tenants:\n    enabled: true\n    tenants:\n      {TENANT_NAME}:\n        \
             keys: [\"{digest}\"]\n        limits: {TENANT_LIMITS}\n    limits_store: {store}\n  \
             cache:\n    enabled: true\n{cache}  \
             speculative:\n    enabled: false\n  kv_breaker:\n    enabled: true\n",
            digest = self.digest,
        ));
        y
    }
}

/// One request of the run. Times are from the start of the traffic.
#[derive(Clone, Debug)]
struct Record {
    i: u64,
    due: Duration,
    kind: Kind,
    /// When its answer's head came.
    head: Option<Duration>,
    status: Option<u16>,
    rejected: Option<String>,
    cache_hit: bool,
    /// SSE data events received (not counting `[DONE]`).
    events: u64,
    end: Duration,
    /// Why it failed; `None`: a whole, valid answer.
    error: Option<String>,
}

impl Record {
    fn request_id(&self) -> String {
        format!("soak-{}", self.i)
    }
}

/// Connections kept alive between requests, with when each was last used.
type Idle = Arc<Mutex<Vec<(SendRequest<Full<Bytes>>, Instant)>>>;

/// What the request tasks share.
struct Shared {
    addr: SocketAddr,
    auth: HeaderValue,
    start: Instant,
    idle: Idle,
    /// Requests finished and failed so far, for the progress lines.
    done: AtomicU64,
    failed: AtomicU64,
}

/// A connection for a request: a kept-alive one used within [`IDLE_MAX`] that is still open
/// and ready, else a new one.
async fn checkout(sh: &Shared) -> Result<SendRequest<Full<Bytes>>> {
    loop {
        let kept = sh.idle.lock().await.pop();
        let Some((mut c, since)) = kept else { break };
        if since.elapsed() < IDLE_MAX && !c.is_closed() && c.ready().await.is_ok() {
            return Ok(c);
        }
    }
    let mut c = connect(sh.addr).await?;
    c.ready().await.context("connection closed")?;
    Ok(c)
}

fn request(sh: &Shared, i: u64, kind: Kind) -> Result<Request<Full<Bytes>>> {
    let content = if kind.repeat {
        format!("Soak question {}: what does a sluice do?", i % REPEATS)
    } else {
        format!("Soak request {i}: tell me about rivers.")
    };
    let temperature = if kind.sampled { 0.7 } else { 0.0 };
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": kind.stream,
        "temperature": temperature,
        "max_tokens": MAX_TOKENS,
    })
    .to_string();
    Request::builder()
        .method(Method::POST)
        .uri(CHAT)
        .header(HOST, sh.addr.to_string())
        .header(CONTENT_TYPE, "application/json")
        .header(AUTHORIZATION, sh.auth.clone())
        .header("x-request-id", format!("soak-{i}"))
        .body(Full::new(Bytes::from(body)))
        .context("building the request")
}

/// Sends request `i` and reads its answer whole, filling `rec` as it goes (so that what came
/// before a timeout is kept).
async fn exchange(sh: &Shared, rec: &mut Record) -> Result<()> {
    let mut sender = checkout(sh).await?;
    let resp = sender
        .send_request(request(sh, rec.i, rec.kind)?)
        .await
        .context("sending")?;
    rec.head = Some(sh.start.elapsed());
    let status = resp.status();
    rec.status = Some(status.as_u16());
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    rec.rejected = header("x-sluice-rejected");
    rec.cache_hit = header("x-cache").as_deref() == Some("HIT");
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    let read: Result<()> = async {
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.context("reading the answer")?.into_data() {
                buf.extend_from_slice(&data);
            }
        }
        Ok(())
    }
    .await;
    let has = |s: &[u8]| buf.windows(s.len()).any(|w| w == s);
    let (done, error_event) = (has(b"data: [DONE]"), has(b"data: {\"error\""));
    if rec.kind.stream {
        rec.events = count_events(&buf)
            .saturating_sub(u64::from(done))
            .saturating_sub(u64::from(error_event));
    }
    read?;
    if !status.is_success() {
        let shown = String::from_utf8_lossy(&buf[..buf.len().min(200)]).into_owned();
        anyhow::bail!("HTTP {status}: {shown}");
    }
    if rec.kind.stream {
        if error_event {
            let at = buf
                .windows(14)
                .position(|w| w == b"data: {\"error\"")
                .unwrap_or(0);
            let shown = String::from_utf8_lossy(&buf[at..buf.len().min(at + 200)]).into_owned();
            anyhow::bail!("the stream ended with an error event: {}", shown.trim());
        }
        if !done {
            anyhow::bail!("the stream ended without data: [DONE]");
        }
    } else {
        let v: Value = serde_json::from_slice(&buf).context("the answer is not JSON")?;
        if !v["choices"].is_array() {
            anyhow::bail!("the answer has no choices");
        }
    }
    sh.idle.lock().await.push((sender, Instant::now()));
    Ok(())
}

async fn one(sh: Arc<Shared>, i: u64, due: Duration) -> Record {
    let kind = MIX[(i % MIX.len() as u64) as usize];
    let mut rec = Record {
        i,
        due,
        kind,
        head: None,
        status: None,
        rejected: None,
        cache_hit: false,
        events: 0,
        end: Duration::ZERO,
        error: None,
    };
    rec.error = match tokio::time::timeout(REQUEST_LIMIT, exchange(&sh, &mut rec)).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(_) => Some(format!("no whole answer within {REQUEST_LIMIT:?}")),
    };
    rec.end = sh.start.elapsed();
    sh.done.fetch_add(1, Ordering::Relaxed);
    if rec.error.is_some() {
        sh.failed.fetch_add(1, Ordering::Relaxed);
    }
    rec
}

/// The open loop: request `i` due at `i / rate` from `sh.start`, until `length`; every
/// request recorded.
async fn traffic(sh: Arc<Shared>, rate: f64, length: Duration) -> Result<Vec<Record>> {
    let every = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let start = sh.start;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Duration)>();
    // The pacer is a thread of its own, as in `phased`: std's sleep is precise.
    let pacer = std::thread::spawn(move || {
        let mut i: u64 = 0;
        loop {
            let due = every.mul_f64(i as f64);
            if due >= length {
                break;
            }
            let at = start + due;
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if tx.send((i, due)).is_err() {
                break;
            }
            i += 1;
        }
    });
    let mut tasks = tokio::task::JoinSet::new();
    let mut out = Vec::new();
    loop {
        tokio::select! {
            next = rx.recv() => match next {
                Some((i, due)) => {
                    tasks.spawn(one(sh.clone(), i, due));
                }
                None => break,
            },
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                out.push(done.context("a request task panicked")?);
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        out.push(done.context("a request task panicked")?);
    }
    pacer
        .join()
        .map_err(|_| anyhow!("the pacer thread panicked"))?;
    out.sort_by_key(|r| r.i);
    Ok(out)
}

/// Samples a process's VmRSS every `every` from `start` until stopped.
struct Sampler {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Vec<(Duration, u64)>>,
}

impl Sampler {
    fn start(pid: u32, start: Instant, every: Duration) -> Sampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start.into(), every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut samples = Vec::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {
                        if let Ok(rss) = status_bytes(pid, "VmRSS") {
                            samples.push((start.elapsed(), rss));
                        }
                    }
                }
            }
            samples
        });
        Sampler {
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) -> Result<Vec<(Duration, u64)>> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.context("the RSS sampler panicked")
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The lying KV-event publisher: a ZMTP peer on 127.0.0.1 (the backends' address) that
/// greets as vLLM's PUB socket does, then tells each connection the next of its lies, and
/// holds it until Sluice drops it. Returns its port and its task, whose connections are
/// counted in [`lies_made`].
async fn lying_publisher() -> Result<(u16, Lies)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let made = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&made);
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let n = counted.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
                greeting.extend_from_slice(b"NULL");
                greeting.resize(64, 0);
                if n % 5 == 4 {
                    // Not ZMTP at all.
                    let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
                    return;
                }
                let mut theirs = [0u8; 64];
                if stream.write_all(&greeting).await.is_err()
                    || stream.read_exact(&mut theirs).await.is_err()
                {
                    return;
                }
                let ready = b"\x05READY\x0bSocket-Type\0\0\0\x03PUB";
                let mut lie = vec![0x04, ready.len() as u8];
                lie.extend_from_slice(ready);
                match n % 5 {
                    0 => {
                        lie.push(0x02);
                        lie.extend_from_slice(&(1u64 << 40).to_be_bytes());
                    }
                    1 => {
                        lie.push(0x02);
                        lie.extend_from_slice(&(100u64 << 20).to_be_bytes());
                        lie.resize(lie.len() + (1 << 20), 0);
                    }
                    2 => {
                        // [topic, seq, batch]: one BlockStored naming a block size of 2^40,
                        // msgpack written by hand (array of 2: ts, [event]).
                        let mut batch = vec![0x92, 0xcb];
                        batch.extend_from_slice(&0f64.to_be_bytes());
                        batch.extend_from_slice(&[0x91, 0x97, 0xab]);
                        batch.extend_from_slice(b"BlockStored");
                        batch.extend_from_slice(&[0x90, 0xc0, 0x90, 0xcf]);
                        batch.extend_from_slice(&(1u64 << 40).to_be_bytes());
                        batch.extend_from_slice(&[0xc0, 0xa3]);
                        batch.extend_from_slice(b"GPU");
                        for (more, frame) in [
                            (true, &b""[..]),
                            (true, &0u64.to_be_bytes()[..]),
                            (false, &batch),
                        ] {
                            lie.push(u8::from(more));
                            lie.push(frame.len() as u8);
                            lie.extend_from_slice(frame);
                        }
                    }
                    _ => {}
                }
                if stream.write_all(&lie).await.is_err() {
                    return;
                }
                // Held until Sluice drops it.
                let mut sink = [0u8; 4096];
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    Ok((port, Lies { task, made }))
}

/// The lying publisher's task and the connections it was given.
struct Lies {
    task: tokio::task::JoinHandle<()>,
    made: Arc<AtomicU64>,
}

impl Lies {
    fn abort(&self) {
        self.task.abort();
    }
}

impl Drop for Lies {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lies_made(lies: &Lies) -> u64 {
    lies.made.load(Ordering::Relaxed)
}

fn config_has_dns(config: &Config) -> bool {
    config.dns.is_some()
}

/// Aborts the task when dropped: a cancelled run stops its traffic.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the faults did.
#[derive(Debug, Default)]
struct Faults {
    /// When each backend was killed, and which.
    kills: Vec<(Duration, SocketAddr)>,
    /// How long each restarted simulator took to answer `/health`.
    restarts: Vec<Duration>,
    /// Redis stops, and how long each start took to answer `PING`.
    redis_stops: u32,
    redis_starts: Vec<Duration>,
    reloads_sent: u32,
    /// How long each reload took to show in `sluice_config_reloads_total`.
    reloads_seen: Vec<Duration>,
    attacks: u32,
    attack: AttackStats,
    /// Faults that could not be applied (a process that would not start again).
    errors: Vec<String>,
}

/// The totals of `sluice_config_reloads_total`: (ok, refused).
async fn reloads(admin: SocketAddr) -> Result<(f64, f64)> {
    let page = metrics_page(admin).await?;
    let with = |result: &str| labelled_sum(&page, "sluice_config_reloads_total", "result", result);
    Ok((with("ok"), with("refused")))
}

async fn metrics_page(admin: SocketAddr) -> Result<String> {
    let (status, _, body) = fetch(&Target::get(admin, "/metrics")).await?;
    if !status.is_success() {
        anyhow::bail!("GET /metrics on {admin}: HTTP {status}");
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// A counter's values by one label's value, summed over the other labels.
fn by_label(page: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let key = format!("{label}=\"");
    for l in page.lines() {
        let Some(rest) = l.strip_prefix(name) else {
            continue;
        };
        if !rest.starts_with('{') {
            continue;
        }
        let Some(value) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        let Some(at) = rest.find(&key) else { continue };
        let tail = &rest[at + key.len()..];
        let v = tail.split('"').next().unwrap_or_default().to_string();
        *out.entry(v).or_insert(0.0) += value;
    }
    out
}

fn show_counts(m: &BTreeMap<String, f64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The soak's running parts, and what the faults did to them.
struct Soak {
    fleet: Fleet,
    redis: Option<Redis>,
    config: Config,
    sluice: Proc,
    attack: Option<Attack>,
    attack_spec: AttackSpec,
    faults: Faults,
    start: Instant,
}

impl Soak {
    async fn apply(&mut self, fault: Fault) -> Result<()> {
        match fault {
            Fault::Reload => {
                self.faults.reloads_sent += 1;
                let n = self.faults.reloads_sent;
                let path = self.config.path();
                std::fs::write(&path, self.config.yaml(n))
                    .with_context(|| format!("writing {path:?}"))?;
                let pid = self.sluice.pid().context("Sluice is not running")?;
                let t0 = Instant::now();
                let sent = std::process::Command::new("kill")
                    .args(["-HUP", &pid.to_string()])
                    .status()
                    .context("running kill -HUP")?;
                if !sent.success() {
                    anyhow::bail!("kill -HUP {pid}: {sent}");
                }
                loop {
                    let (ok, refused) = reloads(self.config.admin).await?;
                    if ok + refused >= f64::from(n) {
                        if refused > 0.0 {
                            self.faults
                                .errors
                                .push(format!("reload {n}: Sluice refused the file"));
                        }
                        self.faults.reloads_seen.push(t0.elapsed());
                        break;
                    }
                    if t0.elapsed() > READY_LIMIT {
                        self.faults
                            .errors
                            .push(format!("reload {n}: not counted within {READY_LIMIT:?}"));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Fault::Kill(i) => {
                let at = self.start.elapsed();
                if let Some(addr) = self.fleet.kill(i) {
                    self.faults.kills.push((at, addr));
                }
            }
            Fault::Restart(i) => match self.fleet.restart(i).await {
                Ok(took) => self.faults.restarts.push(took),
                Err(e) => self.faults.errors.push(format!("{e:#}")),
            },
            Fault::StopRedis => {
                if let Some(r) = self.redis.as_mut() {
                    if r.proc.take().is_some() {
                        self.faults.redis_stops += 1;
                    }
                }
            }
            Fault::StartRedis => {
                if let Some(r) = self.redis.as_mut() {
                    match r.start(true).await {
                        Ok(took) => self.faults.redis_starts.push(took),
                        Err(e) => self.faults.errors.push(format!("{e:#}")),
                    }
                }
            }
            Fault::AttackStart => {
                if self.attack.is_none() {
                    self.attack = Some(Attack::start(&self.attack_spec));
                    self.faults.attacks += 1;
                }
            }
            Fault::AttackStop => {
                if let Some(a) = self.attack.take() {
                    self.faults.attack.merge(a.stop().await?);
                }
            }
            Fault::CycleEnd(_) => {}
        }
        Ok(())
    }
}

/// Asks until an answer is a 200 and, with Redis, carries the limiter's header: Redis is
/// connected in the background after Sluice starts, and until then admissions fail open.
async fn until_ready(addr: SocketAddr, auth: &HeaderValue, redis: bool) -> Result<()> {
    let body = crate::scenarios::chat_body("Hello! Say something short.", false, 8);
    let target = Target::post_json(addr, CHAT, body).with_header(AUTHORIZATION, auth.clone());
    let t0 = Instant::now();
    loop {
        let (status, headers, answer) = fetch(&target).await?;
        let admitted = !redis || headers.contains_key("x-ratelimit-limit-requests");
        if status.is_success() && admitted {
            return Ok(());
        }
        if t0.elapsed() > READY_LIMIT {
            anyhow::bail!(
                "Sluice did not answer with the limiter's admission within {READY_LIMIT:?}; last: \
                 HTTP {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How a request ended, as the soak judges it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    Ok,
    /// A failure by design of a backend kill.
    Fault(String),
    Lost(String),
}

fn judge(r: &Record, kills: &[(Duration, SocketAddr)]) -> Verdict {
    let Some(error) = &r.error else {
        return Verdict::Ok;
    };
    let what = if r.kind.stream { "stream" } else { "answer" };
    let answered = r.status == Some(200);
    let after_kill = kills
        .iter()
        .any(|(k, _)| r.end >= *k && r.end <= *k + KILL_WINDOW);
    if answered && after_kill {
        return Verdict::Fault(format!(
            "{what} cut after its 200, within 2 s after a backend was killed"
        ));
    }
    Verdict::Lost(match (r.status, &r.rejected) {
        (Some(200), _) => format!("{what} cut after its 200, no backend killed in the 2 s before"),
        (Some(s), Some(why)) => format!("HTTP {s} `{why}`"),
        (Some(s), None) => format!("HTTP {s}"),
        (None, _) => {
            let short: String = error.chars().take(90).collect();
            format!("no answer: {short}")
        }
    })
}

/// Sluice's JSON log: the access-log line of some requests, and its warnings and errors
/// counted by message.
struct LogFacts {
    access: BTreeMap<String, String>,
    messages: BTreeMap<String, u64>,
}

fn read_log(path: &Path, wanted: &HashSet<String>) -> Result<LogFacts> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path:?}"))?;
    let mut facts = LogFacts {
        access: BTreeMap::new(),
        messages: BTreeMap::new(),
    };
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let field = |k: &str| match &v["fields"][k] {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        if v["target"] == "sluice::access" {
            let id = field("request_id");
            if wanted.contains(&id) {
                facts.access.insert(
                    id,
                    format!(
                        "status {} upstream {} backend {} attempts {} incomplete {} error `{}`",
                        field("status"),
                        field("upstream_status"),
                        field("backend"),
                        field("attempts"),
                        field("incomplete"),
                        field("error")
                    ),
                );
            }
            continue;
        }
        let message: String = field("message").chars().take(100).collect();
        let level = v["level"].as_str().unwrap_or("?");
        *facts
            .messages
            .entry(format!("{level} {message}"))
            .or_default() += 1;
    }
    Ok(facts)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// The median of `v`, in milliseconds.
fn median_ms(v: &[Duration]) -> String {
    let mut v = v.to_vec();
    v.sort();
    match v.get(v.len() / 2) {
        Some(d) => format!("{:.0} ms", d.as_secs_f64() * 1e3),
        None => "–".into(),
    }
}

/// The RSS sample taken first at `at` or later (the last one if none).
fn sample_at(samples: &[(Duration, u64)], at: Duration) -> Option<(Duration, u64)> {
    samples
        .iter()
        .find(|(t, _)| *t >= at)
        .or(samples.last())
        .copied()
}

/// Scenario 23: the soak.
pub async fn soak(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(23, title(23));
    let p = ctx.p.clone();
    let plan = Plan::new(p.soak);
    let dir = tempfile::tempdir_in(ctx.root.path())?;

    let mut redis = None;
    let redis_addr = free_addr()?;
    let mut r = Redis {
        addr: redis_addr,
        dir: dir.path().to_path_buf(),
        proc: None,
    };
    match r.start(false).await {
        Ok(_) => redis = Some(r),
        Err(e) => report.notes.push(format!(
            "redis-server unavailable ({e:#}): the tenants' limits are local, the cache is in \
             memory ({MEMORY_CACHE_BYTES} bytes), and there are no Redis restarts"
        )),
    }
    let spec = SimSpec {
        itl_ms: ITL_MS,
        answer_tokens: Some(STALL_TOKENS),
        ..SimSpec::zero()
    };
    let fleet = Fleet::start(&ctx.sim, &spec, dir.path(), BACKENDS).await?;
    let (publisher, lies) = lying_publisher().await?;
    // The testkit's DNS server panics when dnsmasq is missing or fails: started in a task.
    let dns = match tokio::spawn(DnsServer::start(Duration::from_secs(1))).await {
        Ok(dns) => Some(dns),
        Err(_) => {
            report
                .notes
                .push("dnsmasq unavailable: no DNS-discovered pool flaps in this run".to_string());
            None
        }
    };
    let config = Config {
        dir: dir.path().to_path_buf(),
        listen: free_addr()?,
        admin: free_addr()?,
        backends: fleet.addrs.clone(),
        digest: hash_key(&ctx.sluice_bin, TENANT_KEY)?,
        redis: redis.as_ref().map(|r| r.addr),
        publisher,
        dns: dns.as_ref().map(DnsServer::addr),
    };
    let flapper = dns.map(|dns| {
        let ip = fleet.addrs.first().map_or(
            std::net::IpAddr::from([127, 0, 0, 1]),
            std::net::SocketAddr::ip,
        );
        AbortOnDrop(tokio::spawn(async move {
            loop {
                dns.set(FLAP_NAME, &[ip]).await;
                tokio::time::sleep(FLAP_UP).await;
                dns.set(FLAP_NAME, &[]).await;
                tokio::time::sleep(FLAP_DOWN).await;
            }
        }))
    });
    let (listen, admin) = (config.listen, config.admin);
    let sluice = start_sluice_with(
        &ctx.sluice_bin,
        dir.path(),
        NAME,
        &config.yaml(0),
        &[listen, admin],
    )
    .await?;
    let pid = sluice.pid().context("Sluice is not running")?;
    let auth = HeaderValue::from_str(&format!("Bearer {TENANT_KEY}")).context("the key")?;
    until_ready(listen, &auth, redis.is_some()).await?;

    // The attackers, as scenario 8's, with the tenant's key (without it, Sluice refuses them
    // before reading a body).
    let stall_body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "stream": true,
        "temperature": 1.0,
        "max_tokens": STALL_TOKENS,
    })
    .to_string();
    let mut stall_request = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: {listen}\r\nAuthorization: Bearer {TENANT_KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        stall_body.len()
    )
    .into_bytes();
    stall_request.extend_from_slice(stall_body.as_bytes());
    let big = sized_chat_body(p.soak_body_bytes, 16);
    let attack_spec = AttackSpec {
        addr: listen,
        stalled: p.soak_attackers,
        stall_request: Bytes::from(stall_request),
        stall_rcvbuf: 4096,
        stall_hold: SEND_TIMEOUT * 2,
        slowloris: p.soak_attackers,
        slowloris_every: Duration::from_millis(500),
        bodies: 1,
        body: Arc::new(
            Target::post_json(listen, CHAT, big.clone()).with_header(AUTHORIZATION, auth.clone()),
        ),
        ramp: (plan.abuse / 4).min(Duration::from_secs(1)),
    };

    let start = Instant::now() + Duration::from_millis(50);
    let shared = Arc::new(Shared {
        addr: listen,
        auth: auth.clone(),
        start,
        idle: Arc::new(Mutex::new(Vec::new())),
        done: AtomicU64::new(0),
        failed: AtomicU64::new(0),
    });
    let sampler = Sampler::start(pid, start, plan.sample_every);
    let mut load = AbortOnDrop(tokio::spawn(traffic(
        shared.clone(),
        p.soak_rate,
        plan.length,
    )));
    let mut soak = Soak {
        fleet,
        redis,
        config,
        sluice,
        attack: None,
        attack_spec,
        faults: Faults::default(),
        start,
    };
    let has_redis = soak.redis.is_some();
    for (at, fault) in plan.schedule(has_redis) {
        tokio::time::sleep_until((start + at).into()).await;
        // A fault that could not be applied is reported; the run goes on (a Sluice that died
        // fails the scenario below).
        if let Err(e) = soak.apply(fault).await {
            soak.faults.errors.push(format!("{fault:?}: {e:#}"));
        }
        if let Fault::CycleEnd(c) = fault {
            eprintln!(
                "sluice-bench: soak: cycle {c} of {CYCLES} done at {}: {} requests finished, {} \
                 failed, RSS {:.1} MB",
                secs(start.elapsed()),
                shared.done.load(Ordering::Relaxed),
                shared.failed.load(Ordering::Relaxed),
                mb(status_bytes(pid, "VmRSS").unwrap_or(0)),
            );
        }
    }
    if let Some(a) = soak.attack.take() {
        soak.faults.attack.merge(a.stop().await?);
    }
    let records = (&mut load.0).await.context("the traffic task")??;
    drop(flapper);
    lies.abort();
    let samples = sampler.stop().await?;
    soak.sluice.check_alive()?;
    let hwm = status_bytes(pid, "VmHWM").ok();
    let page = metrics_page(admin).await?;

    // Judge every request.
    let faults = &soak.faults;
    let verdicts: Vec<Verdict> = records.iter().map(|r| judge(r, &faults.kills)).collect();
    let failed: HashSet<String> = records
        .iter()
        .filter(|r| r.error.is_some())
        .map(Record::request_id)
        .collect();
    let log = read_log(&dir.path().join(format!("{NAME}.log")), &failed)?;
    let total = records.len() as u64;
    let ok = verdicts.iter().filter(|v| **v == Verdict::Ok).count() as u64;
    let by_fault = verdicts
        .iter()
        .filter(|v| matches!(v, Verdict::Fault(_)))
        .count() as u64;
    let lost = verdicts
        .iter()
        .filter(|v| matches!(v, Verdict::Lost(_)))
        .count() as u64;
    let first_lost = records.iter().zip(&verdicts).find_map(|(r, v)| match v {
        Verdict::Lost(why) => Some(format!("{}: {why}", r.request_id())),
        _ => None,
    });
    report.measured(Contender::SluiceSoak, total, lost, first_lost);

    let warm = sample_at(&samples, plan.cycle);
    let end = sample_at(&samples, plan.length);
    let max = samples.iter().max_by_key(|(_, rss)| *rss).copied();
    let growth = match (warm, end) {
        (Some((_, w)), Some((_, e))) if w > 0 => (e as f64 - w as f64) / w as f64 * 100.0,
        _ => f64::NAN,
    };
    let rss_cell = |s: Option<(Duration, u64)>| {
        s.map_or_else(
            || "–".to_string(),
            |(t, rss)| format!("{:.1} (at {})", mb(rss), secs(t)),
        )
    };
    let hits = records
        .iter()
        .filter(|r| r.error.is_none() && r.cache_hit)
        .count();
    let streams_ok = records
        .iter()
        .filter(|r| r.error.is_none() && r.kind.stream)
        .count();
    report.header = [
        "contender",
        "length",
        "requests",
        "ok (streams, cache hits)",
        "failed",
        "failed by a fault (by design)",
        "lost",
        "RSS MB at warm-up end",
        "RSS MB at the end",
        "RSS MB max (sampled / VmHWM)",
        "growth after warm-up",
    ]
    .map(String::from)
    .to_vec();
    report.rows.push(vec![
        Contender::SluiceSoak.label().to_string(),
        format!("{} (warm-up {})", secs(plan.length), secs(plan.cycle)),
        total.to_string(),
        format!("{ok} ({streams_ok}, {hits})"),
        (total - ok).to_string(),
        by_fault.to_string(),
        lost.to_string(),
        rss_cell(warm),
        rss_cell(end),
        format!(
            "{} / {}",
            rss_cell(max),
            hwm.map_or_else(|| "–".to_string(), |h| format!("{:.1}", mb(h)))
        ),
        format!("{growth:+.2} %"),
    ]);

    // The faults applied.
    let attack = &faults.attack;
    let (reloads_ok, reloads_refused) = (
        by_label(&page, "sluice_config_reloads_total", "result")
            .get("ok")
            .copied()
            .unwrap_or(0.0),
        by_label(&page, "sluice_config_reloads_total", "result")
            .get("refused")
            .copied()
            .unwrap_or(0.0),
    );
    let fault_rows = vec![
        vec![
            "backend killed (SIGKILL), started again on its address".to_string(),
            format!(
                "{} kills, {} restarts",
                faults.kills.len(),
                faults.restarts.len()
            ),
            format!(
                "down {} each; answering /health again after a median {} of starting",
                secs(plan.backend_down),
                median_ms(&faults.restarts)
            ),
        ],
        vec![
            "Redis killed, started again empty on its port".to_string(),
            format!(
                "{} stops, {} starts",
                faults.redis_stops,
                faults.redis_starts.len()
            ),
            if has_redis {
                format!(
                    "down {} each; answering PING after a median {} of starting",
                    secs(plan.redis_down),
                    median_ms(&faults.redis_starts)
                )
            } else {
                "no redis-server".to_string()
            },
        ],
        vec![
            "config reload (file rewritten, SIGHUP)".to_string(),
            faults.reloads_sent.to_string(),
            format!(
                "`sluice_config_reloads_total`: ok {reloads_ok:.0}, refused {reloads_refused:.0}; \
                 counted a median {} after the signal",
                median_ms(&faults.reloads_seen)
            ),
        ],
        vec![
            "abuse window (stalled readers, slowloris, big bodies)".to_string(),
            faults.attacks.to_string(),
            format!(
                "{} each: {} stalled readers sent {} streams ({} stalling); {} slowloris \
                 connections opened, {} cut by Sluice; {} big bodies of {} bytes sent ({} \
                 failed{}); {} attacker connections failed",
                secs(plan.abuse),
                p.soak_attackers,
                attack.stalled_sent,
                attack.stalled_streaming,
                attack.slowloris_opened,
                attack.slowloris_cut,
                attack.bodies_ok + attack.bodies_failed,
                big.len(),
                attack.bodies_failed,
                attack
                    .first_body_error
                    .as_ref()
                    .map(|e| format!(": {}", e.chars().take(80).collect::<String>()))
                    .unwrap_or_default(),
                attack.connect_errors,
            ),
        ],
    ];
    let kv_errors = by_label(&page, "sluice_kv_event_errors_total", "reason");
    let flapping: f64 = by_label(&page, "sluice_discovery_updates_total", "pool")
        .get("flapping")
        .copied()
        .unwrap_or(0.0);
    let mut fault_rows = fault_rows;
    fault_rows.push(vec![
        "lying KV-event publisher (terabyte frame, 100 MB message, block size 2^40, silence, \
         not ZMTP), in turn, for the whole run"
            .to_string(),
        format!("{} connections", lies_made(&lies)),
        format!(
            "`sluice_kv_event_errors_total` by reason: {}",
            show_counts(&kv_errors)
        ),
    ]);
    fault_rows.push(vec![
        "DNS answer flapping (the record, then none)".to_string(),
        format!("every {}", secs(FLAP_UP + FLAP_DOWN)),
        if config_has_dns(&soak.config) {
            format!("the flapping pool's membership changes: {flapping:.0}")
        } else {
            "no dnsmasq".to_string()
        },
    ]);
    report.tables.push(Table {
        caption: "Faults applied".into(),
        header: ["fault", "times", "how"].map(String::from).to_vec(),
        rows: fault_rows,
    });

    // The failures by cause, each with an example.
    let mut causes: BTreeMap<Verdict, Vec<&Record>> = BTreeMap::new();
    for (r, v) in records.iter().zip(&verdicts) {
        if *v != Verdict::Ok {
            causes.entry(v.clone()).or_default().push(r);
        }
    }
    let mut cause_rows = Vec::new();
    for (v, rs) in &causes {
        let (judged, why) = match v {
            Verdict::Fault(w) => ("by a fault", w.as_str()),
            Verdict::Lost(w) => ("lost", w.as_str()),
            Verdict::Ok => continue,
        };
        let examples: Vec<String> = rs
            .iter()
            .take(2)
            .map(|r| {
                let since_kill = faults
                    .kills
                    .iter()
                    .filter(|(k, _)| *k <= r.end)
                    .map(|(k, a)| {
                        format!("{:.2} s after {a} was killed", (r.end - *k).as_secs_f64())
                    })
                    .next_back()
                    .unwrap_or_else(|| "before any kill".into());
                format!(
                    "`{}` ({}, due {}, ended {since_kill}, {} events): {}; Sluice logged {}",
                    r.request_id(),
                    if r.kind.stream { "stream" } else { "JSON" },
                    secs(r.due),
                    r.events,
                    r.error
                        .as_deref()
                        .unwrap_or("")
                        .chars()
                        .take(160)
                        .collect::<String>(),
                    log.access
                        .get(&r.request_id())
                        .cloned()
                        .unwrap_or_else(|| "no access-log line".into())
                )
            })
            .collect();
        cause_rows.push(vec![
            judged.to_string(),
            why.to_string(),
            rs.len().to_string(),
            examples.join("<br>"),
        ]);
    }
    if cause_rows.is_empty() {
        cause_rows.push(vec![
            "–".into(),
            "no request failed".into(),
            "0".into(),
            String::new(),
        ]);
    }
    report.tables.push(Table {
        caption: "Failures by cause".into(),
        header: ["judged", "cause", "requests", "examples"]
            .map(String::from)
            .to_vec(),
        rows: cause_rows,
    });

    // The RSS and the failures cycle by cycle.
    let mut cycle_rows = Vec::new();
    for c in 0..CYCLES {
        let (from, to) = (plan.cycle * c, plan.cycle * (c + 1));
        let in_cycle: Vec<(&Record, &Verdict)> = records
            .iter()
            .zip(&verdicts)
            .filter(|(r, _)| r.due >= from && r.due < to)
            .collect();
        let count = |f: &dyn Fn(&Verdict) -> bool| in_cycle.iter().filter(|(_, v)| f(v)).count();
        let peak = samples
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, rss)| *rss)
            .max();
        cycle_rows.push(vec![
            format!("{}{}", c + 1, if c == 0 { " (warm-up)" } else { "" }),
            format!("{}–{}", secs(from), secs(to)),
            in_cycle.len().to_string(),
            count(&|v| matches!(v, Verdict::Fault(_))).to_string(),
            count(&|v| matches!(v, Verdict::Lost(_))).to_string(),
            rss_cell(sample_at(&samples, to)),
            peak.map_or_else(|| "–".into(), |p| format!("{:.1}", mb(p))),
        ]);
    }
    report.tables.push(Table {
        caption: "Cycle by cycle".into(),
        header: [
            "cycle",
            "time",
            "requests due",
            "failed by a fault",
            "lost",
            "RSS MB at its end",
            "RSS MB max in it",
        ]
        .map(String::from)
        .to_vec(),
        rows: cycle_rows,
    });

    report.notes.push(format!(
        "{BACKENDS} simulators ({where_}) in one pool, answers {MAX_TOKENS} tokens {ITL_MS} ms \
         apart, health checks every 250 ms; {redis}; Sluice (threads 2) with `request_id`, \
         `tenants` (one tenant, its key on every request, limits too high to refuse, {limits}), \
         `cache` ({cache}) and `kv_breaker` on, `speculative` off (it needs a draft and a target \
         pool, and its escalation would retry a failed draft on the other pool), `send_timeout` \
         and `client_header_timeout` {st:?}, per-client caps 8192 (every client is 127.0.0.1).",
        where_ = match ctx.sim {
            SimMode::Process(_) => "a process each",
            SimMode::InProcess => "threads of the harness, smoke test",
        },
        redis = if has_redis {
            "one redis-server for the limits and the cache"
        } else {
            "no redis-server"
        },
        limits = if has_redis {
            "counted in Redis with `on_redis_error: allow`"
        } else {
            "counted locally"
        },
        cache = if has_redis {
            "Redis store".to_string()
        } else {
            format!("memory store of {MEMORY_CACHE_BYTES} bytes")
        },
        st = SEND_TIMEOUT,
    ));
    report.notes.push(format!(
        "Traffic: {rate} requests/s, open loop (each sent when due on an idle kept-alive \
         connection or a new one; a connection idle over {IDLE_MAX:?} is not reused), for \
         {len}; of every 10 requests, 4 are streams and 6 not, 3 ask one of {REPEATS} repeated \
         prompts (`temperature: 0`: cache hits once stored, in either form), 5 a prompt of \
         their own with `temperature: 0` (a miss, stored) or `0.7` (let by), all with \
         `max_tokens: {MAX_TOKENS}`. A request has {REQUEST_LIMIT:?} to be answered whole: a \
         200 and a JSON body with `choices`, or a stream ending in `data: [DONE]` with no \
         error event.",
        rate = p.soak_rate,
        len = secs(plan.length),
    ));
    report.notes.push(format!(
        "Faults: {CYCLES} cycles of {cyc}, the first the warm-up; in each, at 10 % a reload, at \
         20 % a backend killed ({down} down), at 40 % Redis killed ({rdown} down), at 50 % a \
         reload, at 55 % an abuse window of {abuse}, at 80 % another backend killed, the last \
         tenth quiet. Each restart waits until the process answers (`/health`, `PING`), each \
         reload until `sluice_config_reloads_total` counts it. RSS: Sluice's VmRSS every {every:?} \
         from the traffic's start; the warm-up's end and the end are both the first sample of a \
         cycle's start (after a quiet tenth); growth = end ÷ warm-up end − 1.",
        cyc = secs(plan.cycle),
        down = secs(plan.backend_down),
        rdown = secs(plan.redis_down),
        abuse = secs(plan.abuse),
        every = plan.sample_every,
    ));
    report.notes.push(
        "Judging a failure: by a fault only when the request had its 200 (its first byte) and \
         failed within 2 s after a backend of the pool was killed (a stream cut midway ends \
         with an SSE error event: Sluice cannot replay it). Before its first byte a request \
         must be sent to another backend, so failing then is lost, as is any failure a reload, \
         a Redis restart or the attackers cause. Examples show the client's view and Sluice's \
         access-log line (JSON log, `warn,sluice::access=info`)."
            .to_string(),
    );
    let counters = [
        (
            "upstream attempts",
            "sluice_upstream_attempts_total",
            "outcome",
        ),
        ("Sluice's own refusals", "router_rejections_total", "reason"),
        ("cache lookups", "llm_cache_requests_total", "result"),
        (
            "cache lookup errors",
            "sluice_cache_lookup_errors_total",
            "kind",
        ),
        ("cache writes", "sluice_cache_writes_total", "outcome"),
        (
            "limit store errors",
            "sluice_tenant_limit_store_errors_total",
            "kind",
        ),
    ];
    let mut shown: Vec<String> = counters
        .iter()
        .map(|(what, name, label)| {
            format!("{what}: {}", show_counts(&by_label(&page, name, label)))
        })
        .collect();
    for (what, name) in [
        ("pool retries", "sluice_pool_retries_total"),
        (
            "retries of unanswered requests",
            "sluice_upstream_unanswered_retries_total",
        ),
        ("ejections", "sluice_backend_ejections_total"),
    ] {
        // + 0.0: an empty sum is -0.0.
        shown.push(format!("{what}: {:.0}", metric_sum(&page, name) + 0.0));
    }
    report.notes.push(format!(
        "Sluice's counters at the end: {}.",
        shown.join("; ")
    ));
    let mut messages: Vec<(&String, &u64)> = log.messages.iter().collect();
    messages.sort_by(|a, b| b.1.cmp(a.1));
    if !messages.is_empty() {
        report.notes.push(format!(
            "Sluice's log, warnings and errors by message (the 8 most frequent): {}.",
            messages
                .iter()
                .take(8)
                .map(|(m, n)| format!("{n} × `{m}`"))
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    for e in &faults.errors {
        report
            .notes
            .push(format!("A fault could not be applied: {e}"));
    }
    report.checks.push(
        Check::at_most(
            "soak: RSS growth from the warm-up's end to the end",
            growth,
            GROWTH_LIMIT,
            "%",
            Noise::Share,
        )
        .showing(format!("{growth:+.2} %")),
    );
    report.checks.push(Check::new(
        "soak: lost requests (failures no backend kill explains)",
        "= 0",
        lost.to_string(),
        Some(lost == 0),
    ));
    drop(soak);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_in_every_cycle() {
        let plan = Plan::new(Duration::from_secs(20));
        let s = plan.schedule(true);
        let count = |f: &dyn Fn(&Fault) -> bool| s.iter().filter(|(_, x)| f(x)).count();
        let cycles = CYCLES as usize;
        assert_eq!(count(&|f| matches!(f, Fault::Kill(_))), 2 * cycles);
        assert_eq!(count(&|f| matches!(f, Fault::Restart(_))), 2 * cycles);
        assert_eq!(count(&|f| *f == Fault::StopRedis), cycles);
        assert_eq!(count(&|f| *f == Fault::Reload), 2 * cycles);
        assert_eq!(count(&|f| *f == Fault::AttackStart), cycles);
        assert!(s.windows(2).all(|w| w[0].0 <= w[1].0));
        assert!(s.iter().all(|(at, _)| *at < plan.length));
        // A restart follows its kill before the next kill.
        let kills: Vec<_> = s
            .iter()
            .filter(|(_, f)| matches!(f, Fault::Kill(_) | Fault::Restart(_)))
            .collect();
        assert!(kills
            .chunks(2)
            .all(|c| matches!((c[0].1, c[1].1), (Fault::Kill(a), Fault::Restart(b)) if a == b)));
        let full = Plan::new(Duration::from_secs(30 * 60));
        assert_eq!(full.cycle, Duration::from_secs(300));
        assert_eq!(full.sample_every, Duration::from_secs(10));
        assert_eq!(full.abuse, Duration::from_secs(60));
    }

    fn record(status: Option<u16>, end_ms: u64, error: bool) -> Record {
        Record {
            i: 0,
            due: Duration::ZERO,
            kind: MIX[3],
            head: None,
            status,
            rejected: None,
            cache_hit: false,
            events: 3,
            end: Duration::from_millis(end_ms),
            error: error.then(|| "cut".to_string()),
        }
    }

    #[test]
    fn judging_failures() {
        let a = SocketAddr::from(([127, 0, 0, 1], 1));
        let kills = [(Duration::from_secs(10), a)];
        assert_eq!(
            judge(&record(Some(200), 10_500, false), &kills),
            Verdict::Ok
        );
        assert!(matches!(
            judge(&record(Some(200), 10_500, true), &kills),
            Verdict::Fault(_)
        ));
        // Too late after the kill, before it, or without a 200: lost.
        for r in [
            record(Some(200), 12_500, true),
            record(Some(200), 9_000, true),
            record(None, 10_500, true),
            record(Some(502), 10_500, true),
        ] {
            assert!(matches!(judge(&r, &kills), Verdict::Lost(_)), "{r:?}");
        }
    }

    #[test]
    fn counters_by_label() {
        let page = "# HELP x\nx_total{pool=\"a\",outcome=\"response\"} 3\n\
                    x_total{pool=\"b\",outcome=\"response\"} 2\nx_total{outcome=\"error\"} 1\n\
                    x_total_created 5\n";
        let m = by_label(page, "x_total", "outcome");
        assert_eq!(m.get("response"), Some(&5.0));
        assert_eq!(m.get("error"), Some(&1.0));
        assert_eq!(m.len(), 2);
    }
}
