//! Scenario 22: pools that follow the fleet (`pools[].discovery`), under load and at idle.
//!
//! - **The fleet scales 2 → 4 → 2 under load.** Four simulators share one port on 127.0.0.2
//!   to 127.0.0.5 (DNS records carry addresses only), a real DNS server (dnsmasq, the
//!   testkit's [`DnsServer`]) names the first two, and Sluice runs every plugin of
//!   [`crate::contenders::PLUGINS`] with its draft pool discovered by that name and its target
//!   pool a static simulator on 127.0.0.1. Under a steady open load ([`crate::phased`]) the
//!   name gets four records (scale out), then the first two again (scale in); the removed
//!   simulators are killed once `/status` no longer lists them (drained), and then one of the
//!   two left is killed without any DNS change: with discovery on, a dead pod still in DNS
//!   must still get no traffic 2 s after it died (scenario 10's case). Every request is judged
//!   from the client's record (due time, answer) and Sluice's JSON log (the access log's pool
//!   and backend, `upstream attempt failed`, the discovery changes).
//! - **CPU at idle with many endpoints.** One simulator on `0.0.0.0` answers every address of
//!   127.0.0.0/8; a DNS name lists N of them (127.0.1.1, ...). An idle Sluice whose pool
//!   discovers them beside an idle Sluice with the same addresses as static `backends`, both
//!   checking every endpoint every 250 ms: the CPU share of each process over the same
//!   window, and its RSS.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use serde_json::Value;
use sluice_testkit::DnsServer;

use crate::contenders::{
    free_addr, start_sluice_with, usage, Contender, Proc, RunningSim, SimMode, SimSpec, MODEL,
    PLUGINS,
};
use crate::loadgen::{fetch, Target};
use crate::phased::{self, percentile_ms, Answer, Phase, Sent};
use crate::report::{Check, Noise, ScenarioReport, Series, Table};
use crate::resilience::{first_answer, metric_sum, unix_secs};
use crate::scenarios::{chat_body, title, CHAT};
use crate::{Ctx, Params};

/// The draft pool's DNS name, and the idle fleet's.
const DRAFT_NAME: &str = "draft.fleet.test";
const IDLE_NAME: &str = "idle.fleet.test";

/// The TTL of the DNS server's answers; the pools refresh at it, clamped to
/// [`MIN_REFRESH`, `MAX_REFRESH`].
const DNS_TTL: Duration = Duration::from_secs(1);
const MIN_REFRESH: &str = "1s";
const MAX_REFRESH: &str = "2s";

/// The longest a request may take before it counts as unanswered.
const REQUEST_LIMIT: Duration = Duration::from_secs(30);

/// The longest the scenario waits for `/status` to show a change (new backends ready, removed
/// ones gone, every idle endpoint checked) before it reports that it did not come.
const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// How often `/status` is asked while waiting for a change.
const POLL: Duration = Duration::from_millis(25);

/// The grace a killed pod has: no attempt on it later than this after it died.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// The window after the new backends are ready in which their share is judged.
const SHARE_WINDOW: Duration = Duration::from_secs(2);

/// The share the new backends must carry in [`SHARE_WINDOW`]: of their fair share.
const SHARE_FLOOR: f64 = 0.8;

/// What the scenario needs of [`Ctx`], owned: it runs in a task of its own.
struct Env {
    sluice_bin: PathBuf,
    sim: SimMode,
    p: Params,
    root: PathBuf,
}

/// Aborts the task when dropped: a cancelled run (Ctrl-C) takes the scenario's processes
/// with it.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Scenario 22. It runs in a task of its own: the testkit's DNS server panics when dnsmasq is
/// missing or does not take a change, and the panic then fails this scenario alone.
pub async fn discovery(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let env = Env {
        sluice_bin: ctx.sluice_bin.clone(),
        sim: ctx.sim.clone(),
        p: ctx.p.clone(),
        root: ctx.root.path().to_path_buf(),
    };
    let mut task = AbortOnDrop(tokio::spawn(run(env)));
    match (&mut task.0).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let why = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "no message".into());
            bail!("the scenario panicked: {why}")
        }
        Err(e) => bail!("the scenario's task: {e}"),
    }
}

async fn run(env: Env) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(22, title(22));
    let dir = tempfile::tempdir_in(&env.root)?;
    let mut dns = DnsServer::start(DNS_TTL).await;
    scaling(&env, &dns, dir.path(), &mut report).await?;
    idle(&env, &mut dns, dir.path(), &mut report).await?;
    Ok(report)
}

fn loopback(a: u8, b: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, a, b))
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Simulators on `ips`, all on one port (the pods behind a DNS name): a free port of the
/// testkit's is tried on every address, and another one when a bind fails.
async fn sims_on_one_port(
    env: &Env,
    spec: &SimSpec,
    ips: &[IpAddr],
    dir: &Path,
) -> Result<(u16, Vec<RunningSim>)> {
    let mut last = String::new();
    for attempt in 0..20 {
        let port = sluice_testkit::free_port();
        let mut sims = Vec::with_capacity(ips.len());
        for (i, ip) in ips.iter().enumerate() {
            let d = dir.join(format!("sim-{port}-{i}"));
            std::fs::create_dir_all(&d).with_context(|| format!("creating {d:?}"))?;
            match RunningSim::start_on(&env.sim, spec, &d, SocketAddr::new(*ip, port)).await {
                Ok(s) => sims.push(s),
                Err(e) => {
                    last = format!("attempt {attempt}, {ip}:{port}: {e:#}");
                    break;
                }
            }
        }
        if sims.len() == ips.len() {
            return Ok((port, sims));
        }
    }
    bail!("no port was free on all of {ips:?}; last: {last}")
}

/// The common head of a generated Sluice config: 2 threads, its files in `dir`, per-client
/// caps above what one address's load opens (every request comes from 127.0.0.1).
fn head(dir: &Path, name: &str, listen: SocketAddr, admin: SocketAddr, log: &str) -> String {
    format!(
        "# Generated by sluice-bench.\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         limits:\n  max_connections_per_client: 8192\n  max_requests_in_flight_per_client: 8192\n\
         log:\n{log}",
        pid = dir.join(format!("{name}.pid")).display(),
        sock = dir.join(format!("{name}.sock")).display(),
    )
}

/// A pool's `discovery.dns` section, indented under the pool.
fn dns_discovery(name: &str, port: u16, resolver: SocketAddr) -> String {
    format!(
        "    discovery:\n      dns: {{name: {name}, port: {port}, resolver: \"{resolver}\", \
         min_refresh: {MIN_REFRESH}, max_refresh: {MAX_REFRESH}}}\n"
    )
}

/// Every plugin of [`PLUGINS`] on, the speculative selector's draft pool `draft` and its
/// target `target` (PLUGINS names scenario 1's pools `sim` and `sim-target`).
fn all_plugins() -> Result<String> {
    let mut s = String::from("plugins:\n");
    for (section, extra) in PLUGINS {
        s.push_str(&format!("  {section}:\n    enabled: true\n"));
        let extra = extra
            .replace("{pool: sim}", "{pool: draft}")
            .replace("target: sim-target", "target: target");
        if *section == "speculative"
            && !(extra.contains("{pool: draft}") && extra.contains("target: target"))
        {
            bail!("PLUGINS' speculative section no longer names its pools as expected: {extra}");
        }
        for line in extra.lines().filter(|l| !l.trim().is_empty()) {
            s.push_str(&format!("    {}\n", line.replace("MODEL", MODEL)));
        }
    }
    Ok(s)
}

/// A pool's backends as `/status` lists them: address, membership, health, whether it was
/// scraped.
#[derive(Clone, Debug)]
struct Listed {
    address: String,
    membership: String,
    health: String,
    scraped: bool,
}

async fn members(admin: SocketAddr, pool: &str) -> Result<Vec<Listed>> {
    let (status, _, body) = fetch(&Target::get(admin, "/status")).await?;
    if !status.is_success() {
        bail!("GET /status on {admin}: HTTP {status}");
    }
    let v: Value = serde_json::from_slice(&body).context("/status is not JSON")?;
    let pool = v["pools"]
        .as_array()
        .and_then(|pools| pools.iter().find(|p| p["name"] == pool))
        .ok_or_else(|| anyhow!("/status has no pool {pool}"))?;
    let text = |b: &Value, k: &str| b[k].as_str().unwrap_or_default().to_string();
    Ok(pool["backends"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|b| Listed {
                    address: text(b, "address"),
                    membership: text(b, "membership"),
                    health: text(b, "health"),
                    scraped: !b["scraped_seconds_ago"].is_null(),
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Asks `/status` until `done` holds for the pool's backends, at most [`WAIT_LIMIT`]; `seen`
/// is told of every answer. Returns when `done` first held.
async fn until(
    admin: SocketAddr,
    pool: &str,
    mut seen: impl FnMut(&[Listed]),
    done: impl Fn(&[Listed]) -> bool,
) -> Result<Option<Instant>> {
    let deadline = Instant::now() + WAIT_LIMIT;
    loop {
        let list = members(admin, pool).await?;
        let now = Instant::now();
        seen(&list);
        if done(&list) {
            return Ok(Some(now));
        }
        if now > deadline {
            return Ok(None);
        }
        tokio::time::sleep(POLL).await;
    }
}

fn all_ready(list: &[Listed], addrs: &[String]) -> bool {
    addrs.iter().all(|a| {
        list.iter()
            .any(|l| l.address == *a && l.membership == "ready")
    })
}

// ---------------------------------------------------------------------------------------
// The fleet scaled under load.

/// One request as Sluice's access log tells it.
#[derive(Clone, Debug, Default)]
struct Access {
    pool: String,
    backend: String,
    line: String,
}

/// What Sluice's JSON log says about a round; times in seconds from the load's start.
#[derive(Debug, Default)]
struct LogFacts {
    access: BTreeMap<String, Access>,
    /// `upstream attempt failed`: when, and on which backend.
    failed_attempts: Vec<(f64, String)>,
    /// `backend unhealthy` and `backend ejected`: when, and which backend.
    unhealthy: Vec<(f64, String)>,
    ejected: Vec<(f64, String)>,
    /// The draft pool's `pool backends changed` lines.
    changes: Vec<Changed>,
    /// Other warnings, for the notes.
    warnings: Vec<String>,
}

/// One `pool backends changed` line: when, and the lists as the log writes them.
#[derive(Debug, Default)]
struct Changed {
    at: f64,
    joined: String,
    draining: String,
}

impl LogFacts {
    /// When a change of the draft pool first listed `addr` as joined, at `from` or later.
    fn joined(&self, addr: &str, from: f64) -> Option<f64> {
        self.changes
            .iter()
            .find(|c| c.at >= from && c.joined.contains(addr))
            .map(|c| c.at)
    }

    /// When a change of the draft pool first listed `addr` as draining, at `from` or later.
    fn draining(&self, addr: &str, from: f64) -> Option<f64> {
        self.changes
            .iter()
            .find(|c| c.at >= from && c.draining.contains(addr))
            .map(|c| c.at)
    }
}

fn read_log(path: &Path, start_unix: f64) -> Result<LogFacts> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path:?}"))?;
    let mut facts = LogFacts::default();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let field = |k: &str| match &v["fields"][k] {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        let message = field("message");
        let Some(at) = v["timestamp"].as_str().and_then(unix_secs) else {
            continue;
        };
        let at = at - start_unix;
        if v["target"] == "sluice::access" {
            facts.access.insert(
                field("request_id"),
                Access {
                    pool: field("pool"),
                    backend: field("backend"),
                    line: format!(
                        "status {} pool {} backend {} attempts {} error `{}`",
                        field("status"),
                        field("pool"),
                        field("backend"),
                        field("attempts"),
                        field("error")
                    ),
                },
            );
        } else if message.starts_with("upstream attempt failed") {
            facts.failed_attempts.push((at, field("backend")));
        } else if message.starts_with("backend unhealthy") {
            facts.unhealthy.push((at, field("backend")));
        } else if message.starts_with("backend ejected") {
            facts.ejected.push((at, field("backend")));
        } else if message == "pool backends changed" && field("pool") == "draft" {
            facts.changes.push(Changed {
                at,
                joined: field("joined"),
                draining: field("draining"),
            });
        } else if v["level"] == "WARN" && facts.warnings.len() < 5 {
            facts.warnings.push(
                format!("{message} {}", v["fields"])
                    .chars()
                    .take(300)
                    .collect(),
            );
        }
    }
    Ok(facts)
}

/// One round of the scaling run. Times are seconds from the load's start.
struct ScaleRound {
    sent: Vec<Sent>,
    facts: LogFacts,
    /// The first two backends, and the two that join and leave.
    old: Vec<String>,
    new: Vec<String>,
    /// The pod killed while still in DNS.
    killed_addr: String,
    /// DNS answers with four records from here (the testkit's `set` returned).
    out_at: f64,
    /// `/status` first listed both new backends (any state), and first showed both `ready`.
    seen: Option<f64>,
    ready: Option<f64>,
    /// DNS answers with the first two again from here.
    in_at: f64,
    /// `/status` first listed a removed backend `draining` (a poll may miss it), and no
    /// longer listed either.
    draining_seen: Option<f64>,
    gone: Option<f64>,
    /// The pod still in DNS was killed (from the load's start, and from its start in Unix
    /// time: the log's clock).
    kill: f64,
    kill_unix_offset: f64,
}

impl ScaleRound {
    fn due(s: &Sent) -> f64 {
        secs(s.due)
    }

    fn done(s: &Sent) -> f64 {
        secs(s.done())
    }

    fn access(&self, s: &Sent) -> Option<&Access> {
        self.facts.access.get(&s.request_id)
    }

    fn on(&self, s: &Sent, addrs: &[String]) -> bool {
        self.access(s).is_some_and(|a| addrs.contains(&a.backend))
    }

    fn failed(&self) -> impl Iterator<Item = &Sent> {
        self.sent.iter().filter(|s| !s.answer.is_ok())
    }

    /// Requests still unanswered when the pod was killed, and those of them that failed.
    fn in_flight_at_kill(&self) -> (usize, usize) {
        let v: Vec<&Sent> = self
            .sent
            .iter()
            .filter(|s| Self::due(s) < self.kill && Self::done(s) > self.kill)
            .collect();
        (v.len(), v.iter().filter(|s| !s.answer.is_ok()).count())
    }

    /// Failed requests, those in flight at the kill left out (scenario 10 shows them apart:
    /// Sluice does not retry an attempt the backend may have acted on).
    fn failed_not_in_flight_at_kill(&self) -> Vec<&Sent> {
        self.failed()
            .filter(|s| !(Self::due(s) < self.kill && Self::done(s) > self.kill))
            .collect()
    }

    /// Failed requests due before the scale-out, after it, after the scale-in, after the kill.
    fn failed_by_event(&self) -> [usize; 4] {
        let mut n = [0; 4];
        for s in self.failed() {
            let d = Self::due(s);
            let i = if d < self.out_at {
                0
            } else if d < self.in_at {
                1
            } else if d < self.kill {
                2
            } else {
                3
            };
            n[i] += 1;
        }
        n
    }

    /// Of the draft pool's requests due in `[from, to)`: how many ran on a new backend, of
    /// how many.
    fn new_share(&self, from: f64, to: f64) -> (usize, usize) {
        let mut on_new = 0;
        let mut all = 0;
        for s in self
            .sent
            .iter()
            .filter(|s| Self::due(s) >= from && Self::due(s) < to)
        {
            let Some(a) = self.access(s) else { continue };
            if a.pool != "draft" || a.backend == "-" {
                continue;
            }
            all += 1;
            if self.new.contains(&a.backend) {
                on_new += 1;
            }
        }
        (on_new, all)
    }

    fn fair(&self) -> f64 {
        self.new.len() as f64 / (self.new.len() + self.old.len()) as f64
    }

    /// The new backends' share in the window after they were ready, and after that until
    /// the scale-in: (share, on new, all).
    fn shares(&self) -> [(f64, usize, usize); 2] {
        let Some(ready) = self.ready else {
            return [(f64::NAN, 0, 0); 2];
        };
        // Both windows end at the scale-in at the latest (a short hold, the smoke run's, cuts
        // the first and leaves the second empty).
        let w = (ready + secs(SHARE_WINDOW)).min(self.in_at);
        [(ready, w), (w, self.in_at)].map(|(a, b)| {
            let (n, all) = self.new_share(a, b);
            let share = if all > 0 {
                n as f64 / all as f64
            } else {
                f64::NAN
            };
            (share, n, all)
        })
    }

    /// The first request due on a new backend, from the DNS change.
    fn first_on_new(&self) -> Option<f64> {
        self.sent
            .iter()
            .filter(|s| self.on(s, &self.new))
            .map(Self::due)
            .reduce(f64::min)
            .map(|t| t - self.out_at)
    }

    /// When the removed backends began draining: Sluice's log line for the change that
    /// listed them, else when `/status` first showed one draining.
    fn drain_began(&self) -> Option<f64> {
        self.new
            .iter()
            .filter_map(|a| self.facts.draining(a, self.in_at))
            .reduce(f64::min)
            .or(self.draining_seen)
    }

    /// When Sluice's log says the new backends joined (the later of the two), from the DNS
    /// change.
    fn joined(&self) -> Option<f64> {
        let lines: Vec<f64> = self
            .new
            .iter()
            .filter_map(|a| self.facts.joined(a, self.out_at - 1.0))
            .collect();
        (lines.len() == self.new.len())
            .then(|| lines.into_iter().reduce(f64::max))
            .flatten()
            .map(|t| t - self.out_at)
    }

    /// Requests that ran on a removed backend while it drained (answered after draining
    /// began), and those of them that failed.
    fn on_draining(&self) -> (usize, usize) {
        let from = self.drain_began().unwrap_or(self.in_at);
        let v: Vec<&Sent> = self
            .sent
            .iter()
            .filter(|s| self.on(s, &self.new) && Self::done(s) > from)
            .collect();
        (v.len(), v.iter().filter(|s| !s.answer.is_ok()).count())
    }

    /// Requests due after draining began that still went to a removed backend (a draining
    /// backend takes no new request).
    fn new_on_draining(&self) -> usize {
        let Some(from) = self.drain_began() else {
            return 0;
        };
        self.sent
            .iter()
            .filter(|s| Self::due(s) > from && self.on(s, &self.new))
            .count()
    }

    /// Failed attempts on the killed pod after the kill, seconds after it.
    fn dead_attempts(&self) -> Vec<f64> {
        self.facts
            .failed_attempts
            .iter()
            .filter(|(t, b)| *b == self.killed_addr && *t >= self.kill_unix_offset)
            .map(|(t, _)| t - self.kill_unix_offset)
            .collect()
    }

    /// Requests due later than the kill + grace whose answer came from the killed pod.
    fn late_answers_from_dead(&self) -> usize {
        let after = self.kill + secs(KILL_GRACE);
        let dead = std::slice::from_ref(&self.killed_addr);
        self.sent
            .iter()
            .filter(|s| Self::due(s) > after && self.on(s, dead))
            .count()
    }

    fn late_attempts(&self) -> usize {
        self.dead_attempts()
            .iter()
            .filter(|t| **t > secs(KILL_GRACE))
            .count()
    }

    fn first_after_kill(&self, list: &[(f64, String)]) -> Option<f64> {
        list.iter()
            .filter(|(t, b)| *b == self.killed_addr && *t >= self.kill_unix_offset)
            .map(|(t, _)| t - self.kill_unix_offset)
            .reduce(f64::min)
    }
}

/// The scaling part: rounds of a fresh fleet and a fresh Sluice.
async fn scaling(
    env: &Env,
    dns: &DnsServer,
    dir: &Path,
    report: &mut ScenarioReport,
) -> Result<()> {
    let p = &env.p;
    let spec = SimSpec {
        itl_ms: p.discovery_itl_ms,
        answer_tokens: Some(16),
        ..SimSpec::zero()
    };
    let body = chat_body("Hello! Say something short.", false, 16);
    let plugins = all_plugins()?;
    let mut rounds = Vec::new();
    for round in 0..p.rounds {
        let rdir = dir.join(format!("scale-{round}"));
        std::fs::create_dir_all(&rdir).with_context(|| format!("creating {rdir:?}"))?;
        rounds.push(scale_round(env, dns, &rdir, &spec, &body, &plugins).await?);
    }

    report.header = [
        "round",
        "requests",
        "failed",
        "failed, due before scale-out / after it / after scale-in / after the kill",
        "in flight at the kill (failed)",
        "DNS change → joined (log) / listed in `/status` / first request on a new backend / both `ready`",
        "new backends' share, 2 s from ready (fair 50 %)",
        "new backends' share, then until scale-in",
        "scale-in → draining (log) / gone from `/status`",
        "requests on draining backends (failed)",
        "requests due after draining began sent to them",
        "attempts on the killed pod after the kill / later than +2 s / last at",
        "killed pod unhealthy / ejected at kill +",
        "p99 ms",
    ]
    .map(String::from)
    .to_vec();
    let ms = |v: Option<f64>| v.map_or_else(|| "–".to_string(), |s| format!("{:.0}", s * 1e3));
    let pct = |(share, n, all): (f64, usize, usize)| {
        if share.is_finite() {
            format!("{:.1} % ({n} of {all})", share * 100.0)
        } else {
            "–".to_string()
        }
    };
    for (i, r) in rounds.iter().enumerate() {
        let [a, b, c, d] = r.failed_by_event();
        let (in_flight, in_flight_failed) = r.in_flight_at_kill();
        let [first_share, later_share] = r.shares();
        let (draining, draining_failed) = r.on_draining();
        let dead = r.dead_attempts();
        report.rows.push(vec![
            format!("{}", i + 1),
            r.sent.len().to_string(),
            r.failed().count().to_string(),
            format!("{a} / {b} / {c} / {d}"),
            format!("{in_flight} ({in_flight_failed})"),
            format!(
                "{} / {} / {} / {} ms",
                ms(r.joined()),
                ms(r.seen.map(|t| t - r.out_at)),
                ms(r.first_on_new()),
                ms(r.ready.map(|t| t - r.out_at))
            ),
            pct(first_share),
            pct(later_share),
            format!(
                "{} / {} ms",
                ms(r.drain_began().map(|t| t - r.in_at)),
                ms(r.gone.map(|t| t - r.in_at))
            ),
            format!("{draining} ({draining_failed})"),
            r.new_on_draining().to_string(),
            format!(
                "{} / {} / {} ms",
                dead.len(),
                r.late_attempts(),
                ms(dead.iter().copied().reduce(f64::max))
            ),
            format!(
                "{} / {} ms",
                ms(r.first_after_kill(&r.facts.unhealthy)),
                ms(r.first_after_kill(&r.facts.ejected))
            ),
            format!("{:.1}", percentile_ms(&r.sent, 99.0)),
        ]);
        let errors = r.failed_not_in_flight_at_kill();
        report.measured(
            Contender::SluiceDiscovery,
            r.sent.len() as u64,
            errors.len() as u64,
            errors.first().map(|s| format!("{:?}", s.answer)),
        );
    }

    let (first, last) = (rounds.first(), rounds.last());
    report.notes.push(format!(
        "Fleet: 4 simulators ({where_}) on 127.0.0.2 to 127.0.0.5, one port, answering 16 \
         tokens {itl} ms apart (non-stream chat); a static target simulator on 127.0.0.1. \
         DNS: dnsmasq (the testkit's `DnsServer`), TTL {ttl:?}, `{DRAFT_NAME}` listing \
         127.0.0.2 and 127.0.0.3. Sluice (threads 2): every plugin of `PLUGINS` on \
         (`request_id`, `cache` with the memory store and every request a prompt of its own, \
         so every one goes upstream, `speculative` with the draft pool `draft` discovered by \
         `discovery.dns` (`min_refresh: {MIN_REFRESH}`, `max_refresh: {MAX_REFRESH}`) and the \
         static pool `target`, `kv_breaker`); health checks and outlier detection at their \
         defaults; JSON log at `warn,sluice::access=info,sluice::discovery=info` (the access \
         log, and discovery's one line per change). Each round starts a fresh fleet and Sluice \
         and waits until both draft backends are scraped (`ready`) before the load.",
        where_ = match env.sim {
            SimMode::Process(_) => "each a process of its own",
            SimMode::InProcess => "threads of the harness, smoke test",
        },
        itl = p.discovery_itl_ms,
        ttl = DNS_TTL,
    ));
    report.notes.push(format!(
        "Load: open loop at {rate:.0} requests/s, each request sent when due on an idle \
         kept-alive connection or a new one, latency from the due time (`phased::run_until`). \
         {out:?} in, the name gets 127.0.0.4 and 127.0.0.5 too (scale out; \"DNS change\" is \
         when dnsmasq answers with the new records); {hold:?} after `/status` first shows both \
         new backends `ready` (scraped), the name lists the first two again (scale in); once \
         `/status` no longer lists the removed two, they are killed{how}; {after:?} later \
         {killed} is killed too while still in DNS; the load runs {tail:?} more. Times are \
         from the DNS change that preceded them, in ms.",
        rate = p.discovery_rate,
        out = p.discovery_scale_out_at,
        hold = p.discovery_hold,
        after = p.discovery_kill_after,
        tail = p.discovery_tail,
        killed = first.map_or("–", |r| {
            r.killed_addr
                .split_once(':')
                .map_or(r.killed_addr.as_str(), |(ip, _)| ip)
        }),
        how = match env.sim {
            SimMode::Process(_) => " (SIGKILL)",
            SimMode::InProcess =>
                " (a thread's simulator shut down: listener and connections closed at once)",
        },
    ));
    report.notes.push(
        "How it is read: the client records every request (due time, answer, the \
         `x-request-id` it sent); Sluice's access log gives each request's pool and backend. \
         The new backends' share counts the draft pool's requests due in the window that \
         ended on 127.0.0.4 or .5, against the fair 50 % (2 of 4). \"Requests on draining \
         backends\" ended on a removed backend after Sluice logged it draining; \"due after \
         draining began sent to them\" should be 0 (a draining backend takes no new request). \
         Attempts on the killed pod are Sluice's `upstream attempt failed` lines for its \
         address (after the kill nothing listens there, so every attempt fails and is logged), \
         timed against the wall clock read just before the kill; `backend unhealthy` (health \
         checks) and `backend ejected` (outlier detection) give when each took it out. \
         Failed requests are judged by due time; those in flight at the kill are shown apart, \
         as in scenario 10."
            .to_string(),
    );
    for r in &rounds {
        for s in r.failed().take(5) {
            let log = r
                .access(s)
                .map_or_else(|| "no access-log line".to_string(), |a| a.line.clone());
            report.notes.push(format!(
                "failed: `{}`, due {:.3} s in: the client saw {}; Sluice logged {log}",
                s.request_id,
                ScaleRound::due(s),
                match &s.answer {
                    Answer::Failed(e) =>
                        format!("no answer ({})", e.chars().take(100).collect::<String>()),
                    a => a.label(),
                }
            ));
        }
        let late = r.late_answers_from_dead();
        if late > 0 {
            report.notes.push(format!(
                "{late} requests due later than kill + 2 s were answered by the killed pod's address"
            ));
        }
        for w in &r.facts.warnings {
            report.notes.push(format!("Sluice warned: {w}"));
        }
    }
    if let Some(r) = last {
        if r.facts.changes.is_empty() {
            report.notes.push(
                "Sluice's log has no `pool backends changed` line for the draft pool.".into(),
            );
        }
    }

    let failed: usize = rounds
        .iter()
        .map(|r| r.failed_not_in_flight_at_kill().len())
        .sum();
    let in_flight_failed: usize = rounds.iter().map(|r| r.in_flight_at_kill().1).sum();
    report.checks.push(Check::new(
        "failed requests while the fleet scaled and a pod died (those in flight at the kill apart)",
        "= 0",
        format!("{failed} ({in_flight_failed} more in flight at the kill)"),
        Some(failed == 0),
    ));
    let shares = Series(rounds.iter().map(|r| r.shares()[0].0 * 100.0).collect());
    let fair = first.map_or(0.5, ScaleRound::fair) * 100.0;
    let wanted = SHARE_FLOOR * fair;
    report.checks.push(
        Check::at_least_rounds(
            &format!(
                "new backends' share of the draft pool in the 2 s after they are ready \
                 (≥ {SHARE_FLOOR} × fair)"
            ),
            &shares,
            wanted,
            "%",
            Noise::Share,
        )
        .showing(format!("{} % (fair {fair:.0} %)", shares.show(1))),
    );
    let (draining, draining_failed) = rounds.iter().fold((0, 0), |(n, f), r| {
        let (a, b) = r.on_draining();
        (n + a, f + b)
    });
    let all_gone = rounds.iter().all(|r| r.gone.is_some());
    let drain = Series(
        rounds
            .iter()
            .filter_map(|r| r.gone.map(|g| (g - r.in_at) * 1e3))
            .collect(),
    );
    report.checks.push(Check::new(
        "removed backends: their requests all finished, and they left",
        "0 failed, gone",
        format!(
            "{draining_failed} failed of {draining}; gone {} ms after the scale-in{}",
            drain.show(0),
            if all_gone {
                ""
            } else {
                " (not in every round)"
            }
        ),
        Some(draining_failed == 0 && all_gone),
    ));
    let late: usize = rounds.iter().map(ScaleRound::late_attempts).sum();
    report.checks.push(Check::new(
        "attempts on the killed pod (still in DNS) later than 2 s after the kill",
        "= 0",
        late.to_string(),
        Some(late == 0),
    ));
    Ok(())
}

async fn scale_round(
    env: &Env,
    dns: &DnsServer,
    dir: &Path,
    spec: &SimSpec,
    body: &Bytes,
    plugins: &str,
) -> Result<ScaleRound> {
    let p = &env.p;
    let ips: Vec<IpAddr> = (2..=5).map(|i| loopback(0, i)).collect();
    let (port, mut sims) = sims_on_one_port(env, spec, &ips, dir).await?;
    let addrs: Vec<String> = ips
        .iter()
        .map(|ip| SocketAddr::new(*ip, port).to_string())
        .collect();
    let (old, new) = (addrs[..2].to_vec(), addrs[2..].to_vec());
    let tdir = dir.join("target");
    std::fs::create_dir_all(&tdir).with_context(|| format!("creating {tdir:?}"))?;
    let target_sim = RunningSim::start(&env.sim, spec, &tdir).await?;
    dns.set(DRAFT_NAME, &ips[..2]).await;

    let (listen, admin) = (free_addr()?, free_addr()?);
    let name = "sluice-discovery";
    let log =
        "  level: \"warn,sluice::access=info,sluice::discovery=info\"\n  access_log: true\n  \
               format: json\n";
    let yaml = format!(
        "{head}pools:\n  - name: draft\n    models: [\"{MODEL}\"]\n{discovery}\
         \x20 - name: target\n    models: [\"{MODEL}\"]\n    backends:\n      - address: {target}\n\
         {plugins}",
        head = head(dir, name, listen, admin, log),
        discovery = dns_discovery(DRAFT_NAME, port, dns.addr()),
        target = target_sim.addr,
    );
    let mut proc = start_sluice_with(&env.sluice_bin, dir, name, &yaml, &[listen, admin]).await?;
    let up = until(
        admin,
        "draft",
        |_| {},
        |l| l.len() == 2 && all_ready(l, &old),
    )
    .await?;
    if up.is_none() {
        bail!(
            "the draft pool did not list {old:?} as ready within {WAIT_LIMIT:?}: {:?}",
            members(admin, "draft").await?
        );
    }
    first_answer(listen, body).await?;

    let target = Arc::new(Target::post_json(listen, CHAT, body.clone()).varied());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now() + Duration::from_millis(20);
    let start_unix = unix_now() + secs(start.saturating_duration_since(Instant::now()));
    // The longest it could run; it is stopped after the last event.
    let phases = vec![Phase {
        rate: p.discovery_rate,
        duration: Duration::from_secs(600),
    }];
    let load = AbortOnDrop(tokio::spawn({
        let stop = stop.clone();
        async move { phased::run_until(target, &phases, start, REQUEST_LIMIT, stop).await }
    }));
    let at = |t: Instant| secs(t.saturating_duration_since(start));

    // Scale out.
    tokio::time::sleep_until((start + p.discovery_scale_out_at).into()).await;
    dns.set(DRAFT_NAME, &ips).await;
    let out_at = Instant::now();
    let mut seen = None;
    let ready = until(
        admin,
        "draft",
        |l| {
            if seen.is_none() && new.iter().all(|a| l.iter().any(|x| x.address == *a)) {
                seen = Some(Instant::now());
            }
        },
        |l| all_ready(l, &new),
    )
    .await?;

    // Scale in, after the four served together.
    let hold_from = ready.unwrap_or_else(Instant::now);
    tokio::time::sleep_until((hold_from + p.discovery_hold).into()).await;
    dns.set(DRAFT_NAME, &ips[..2]).await;
    let in_at = Instant::now();
    let mut draining_seen = None;
    let gone = until(
        admin,
        "draft",
        |l| {
            if draining_seen.is_none()
                && l.iter()
                    .any(|x| new.contains(&x.address) && x.membership == "draining")
            {
                draining_seen = Some(Instant::now());
            }
        },
        |l| !l.iter().any(|x| new.contains(&x.address)),
    )
    .await?;
    // Drained (or given up on): the removed pods go away.
    let removed: Vec<RunningSim> = sims.drain(2..).collect();
    drop(removed);

    // A pod dies while DNS still lists it.
    tokio::time::sleep(p.discovery_kill_after).await;
    let victim = sims.remove(0);
    let killed_addr = old[0].clone();
    let kill = Instant::now();
    let kill_unix = unix_now();
    drop(victim);
    tokio::time::sleep(p.discovery_tail).await;
    stop.store(true, Ordering::Relaxed);
    let mut load = load;
    let run = (&mut load.0).await.context("the load task")??;
    proc.check_alive()?;
    let facts = read_log(&dir.join(format!("{name}.log")), start_unix)?;
    drop(proc);
    drop(sims);
    drop(target_sim);
    Ok(ScaleRound {
        sent: run.sent,
        facts,
        old,
        new,
        killed_addr,
        out_at: at(out_at),
        seen: seen.map(at),
        ready: ready.map(at),
        in_at: at(in_at),
        draining_seen: draining_seen.map(at),
        gone: gone.map(at),
        kill: at(kill),
        kill_unix_offset: kill_unix - start_unix,
    })
}

// ---------------------------------------------------------------------------------------
// CPU at idle with many endpoints.

/// One idle window, per Sluice.
#[derive(Clone, Copy, Debug, Default)]
struct IdleRound {
    cpu_share: f64,
    checks_per_sec: f64,
    failed_checks: f64,
    rss_mb: f64,
    lookups_per_sec: f64,
    updates: f64,
    errors: f64,
}

/// Sluice's counters read at the start and end of a window.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    checks: f64,
    failed_checks: f64,
    updates: f64,
    errors: f64,
}

async fn counters(admin: SocketAddr) -> Result<Counters> {
    let (status, _, body) = fetch(&Target::get(admin, "/metrics")).await?;
    if !status.is_success() {
        bail!("GET /metrics on {admin}: HTTP {status}");
    }
    let page = String::from_utf8_lossy(&body);
    let all = metric_sum(&page, "sluice_health_checks_total");
    let ok: f64 = page
        .lines()
        .filter(|l| l.starts_with("sluice_health_checks_total{") && l.contains("result=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Ok(Counters {
        checks: all,
        failed_checks: all - ok,
        updates: metric_sum(&page, "sluice_discovery_updates_total"),
        errors: metric_sum(&page, "sluice_discovery_errors_total"),
    })
}

/// The value of `sluice_discovery_endpoints{pool="fleet",state="ready"}`.
async fn ready_gauge(admin: SocketAddr) -> Result<f64> {
    let (_, _, body) = fetch(&Target::get(admin, "/metrics")).await?;
    let page = String::from_utf8_lossy(&body);
    Ok(page
        .lines()
        .find(|l| {
            l.starts_with("sluice_discovery_endpoints{")
                && l.contains("pool=\"fleet\"")
                && l.contains("state=\"ready\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0))
}

/// Every one of `n` endpoints listed, healthy and scraped.
fn all_checked(list: &[Listed], n: usize) -> bool {
    list.len() == n
        && list
            .iter()
            .all(|l| l.health == "healthy" && l.scraped && l.membership == "ready")
}

async fn idle(
    env: &Env,
    dns: &mut DnsServer,
    dir: &Path,
    report: &mut ScenarioReport,
) -> Result<()> {
    let p = &env.p;
    let n = p.discovery_endpoints;
    if n == 0 || n > 250 * 254 {
        bail!("{n} idle endpoints: 1 to 63,500 (127.0.1.1 to 127.0.250.254)");
    }
    let idir = dir.join("idle");
    std::fs::create_dir_all(&idir).with_context(|| format!("creating {idir:?}"))?;
    // One simulator on 0.0.0.0 answers every 127.0.x.y of the port.
    let unspecified = [IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
    let (port, sim) = sims_on_one_port(env, &SimSpec::zero(), &unspecified, &idir).await?;
    let ips: Vec<IpAddr> = (0..n)
        .map(|i| loopback(1 + (i / 254) as u8, 1 + (i % 254) as u8))
        .collect();
    // So many records do not fit a DNS answer over UDP without EDNS, which is what the
    // testkit's own check of `set` asks: the records are written while dnsmasq is stopped,
    // and dnsmasq started again serves them. Sluice's count of ready endpoints checks them.
    dns.stop().await;
    dns.set(IDLE_NAME, &ips).await;
    dns.start_again().await;

    let log = "  level: warn\n  access_log: true\n";
    let mut fleet: Vec<(Contender, Proc, SocketAddr)> = Vec::new();
    for c in [Contender::SluiceDiscoveredIdle, Contender::SluiceStaticIdle] {
        let (listen, admin) = (free_addr()?, free_addr()?);
        let name = match c {
            Contender::SluiceDiscoveredIdle => "sluice-idle-discovered",
            _ => "sluice-idle-static",
        };
        let mut yaml = head(&idir, name, listen, admin, log);
        yaml.push_str(&format!(
            "pools:\n  - name: fleet\n    models: [\"{MODEL}\"]\n"
        ));
        if c == Contender::SluiceDiscoveredIdle {
            yaml.push_str(&dns_discovery(IDLE_NAME, port, dns.addr()));
        } else {
            yaml.push_str("    backends:\n");
            for ip in &ips {
                yaml.push_str(&format!(
                    "      - address: {}\n",
                    SocketAddr::new(*ip, port)
                ));
            }
        }
        let proc = start_sluice_with(&env.sluice_bin, &idir, name, &yaml, &[listen, admin]).await?;
        fleet.push((c, proc, admin));
    }
    // Every endpoint checked before measuring.
    let mut ready_before = BTreeMap::new();
    for (c, _, admin) in &fleet {
        let mut last = 0;
        let done = until(
            *admin,
            "fleet",
            |l| {
                last = l
                    .iter()
                    .filter(|x| x.health == "healthy" && x.scraped)
                    .count()
            },
            |l| all_checked(l, n),
        )
        .await?;
        // The gauge follows on the health service's next tick (250 ms).
        let deadline = Instant::now() + WAIT_LIMIT;
        let mut gauge = ready_gauge(*admin).await?;
        while *c == Contender::SluiceDiscoveredIdle
            && (gauge - n as f64).abs() >= 0.5
            && Instant::now() < deadline
        {
            tokio::time::sleep(POLL).await;
            gauge = ready_gauge(*admin).await?;
        }
        if done.is_none() {
            report.notes.push(format!(
                "{c}: only {last} of {n} endpoints healthy and scraped after {WAIT_LIMIT:?}; measured anyway"
            ));
        }
        ready_before.insert(*c, (done.is_some(), gauge));
    }
    let discovered_ready = ready_before
        .get(&Contender::SluiceDiscoveredIdle)
        .map_or(0.0, |(_, g)| *g);

    let mut runs: BTreeMap<Contender, Vec<IdleRound>> = BTreeMap::new();
    for _ in 0..p.rounds {
        // Both Sluices over the same window: the same machine, the same simulator's load.
        let mut before = Vec::new();
        for (_, proc, admin) in &fleet {
            let pid = proc.pid().context("an idle sluice is not running")?;
            before.push((usage(pid)?, counters(*admin).await?));
        }
        let lookups_before = dns.queries(IDLE_NAME);
        let started = Instant::now();
        tokio::time::sleep(p.discovery_idle).await;
        let lookups = dns.queries(IDLE_NAME) - lookups_before;
        let mut after = Vec::new();
        for (_, proc, admin) in &fleet {
            let pid = proc.pid().context("an idle sluice is not running")?;
            after.push((usage(pid)?, counters(*admin).await?));
        }
        let wall = secs(started.elapsed());
        for (((c, proc, _), (u0, c0)), (u1, c1)) in fleet.iter_mut().zip(&before).zip(&after) {
            proc.check_alive()?;
            let discovered = *c == Contender::SluiceDiscoveredIdle;
            let r = IdleRound {
                cpu_share: secs(u1.cpu.saturating_sub(u0.cpu)) / wall,
                checks_per_sec: (c1.checks - c0.checks) / wall,
                failed_checks: c1.failed_checks - c0.failed_checks,
                rss_mb: u1.rss_bytes as f64 / 1e6,
                lookups_per_sec: if discovered {
                    lookups as f64 / wall
                } else {
                    0.0
                },
                updates: c1.updates - c0.updates,
                errors: c1.errors - c0.errors,
            };
            report.measured(
                *c,
                (c1.checks - c0.checks) as u64,
                r.failed_checks as u64,
                None,
            );
            runs.entry(*c).or_default().push(r);
        }
    }

    let header = [
        "contender",
        "endpoints",
        "all checked before measuring (ready gauge)",
        "checks/s",
        "failed checks",
        "CPU (% of a core)",
        "CPU µs per check",
        "RSS MB",
        "DNS queries/s",
        "discovery updates / errors",
    ]
    .map(String::from)
    .to_vec();
    let mut rows = Vec::new();
    for (c, rs) in &runs {
        let s = |f: &dyn Fn(&IdleRound) -> f64| Series(rs.iter().map(f).collect());
        let per_check = |r: &IdleRound| {
            if r.checks_per_sec > 0.0 {
                r.cpu_share * 1e6 / r.checks_per_sec
            } else {
                f64::NAN
            }
        };
        let (checked, gauge) = ready_before.get(c).copied().unwrap_or((false, 0.0));
        rows.push(vec![
            c.label().to_string(),
            n.to_string(),
            format!("{} ({gauge:.0})", if checked { "yes" } else { "no" }),
            s(&|r| r.checks_per_sec).show(0),
            format!("{:.0}", rs.iter().map(|r| r.failed_checks).sum::<f64>()),
            s(&|r| r.cpu_share * 100.0).show(2),
            s(&per_check).show(1),
            s(&|r| r.rss_mb).show(1),
            if *c == Contender::SluiceDiscoveredIdle {
                s(&|r| r.lookups_per_sec).show(1)
            } else {
                "–".into()
            },
            format!(
                "{:.0} / {:.0}",
                rs.iter().map(|r| r.updates).sum::<f64>(),
                rs.iter().map(|r| r.errors).sum::<f64>()
            ),
        ]);
    }
    report.tables.push(Table {
        caption: format!("**CPU at idle, {n} endpoints**"),
        header,
        rows,
    });
    report.notes.push(format!(
        "CPU at idle: one simulator (zero-latency; {where_}) on 0.0.0.0 answers every address of \
         the port; `{IDLE_NAME}` lists {n} A records (127.0.1.1 on), and an idle Sluice's one \
         pool discovers them (`discovery.dns`, the refresh bounds above), beside an idle Sluice \
         with the same {n} addresses as static `backends`. Both check every endpoint at the \
         defaults (a `/health` probe and a `/metrics` scrape every 250 ms; a check is one of \
         either, `sluice_health_checks_total`), no plugins, `log.level: warn`. Before \
         measuring, `/status` must list every endpoint healthy and scraped (`ready`), and the \
         discovered pool's `sluice_discovery_endpoints{{state=\"ready\"}}` is shown beside. \
         Both are measured over the same {idle:?} window in each of {rounds} rounds (the \
         simulator serves both all along): CPU is the run time of the Sluice process's threads \
         over the window (`/proc/PID/task/*/schedstat`), RSS its VmRSS at the end; DNS queries \
         are dnsmasq's log lines for the name (A and AAAA each count, and an A answer of more \
         than 512 bytes, which comes truncated over UDP, is asked again over TCP and counts \
         again). No requests are sent.",
        where_ = match env.sim {
            SimMode::Process(_) => "its own process",
            SimMode::InProcess => "a thread of the harness, smoke test",
        },
        idle = p.discovery_idle,
        rounds = p.rounds,
    ));
    let cpu = |c: Contender| {
        runs.get(&c).map_or(f64::NAN, |rs| {
            Series(rs.iter().map(|r| r.cpu_share * 100.0).collect()).median()
        })
    };
    let (disc, stat) = (
        cpu(Contender::SluiceDiscoveredIdle),
        cpu(Contender::SluiceStaticIdle),
    );
    report.checks.push(Check::new(
        &format!("every one of {n} discovered endpoints ready before measuring"),
        &format!("= {n}"),
        format!("{discovered_ready:.0}"),
        Some((discovered_ready - n as f64).abs() < 0.5),
    ));
    report.checks.push(Check::new(
        &format!("CPU at idle, {n} endpoints discovered by DNS against the same static"),
        "",
        format!("{disc:.2} % against {stat:.2} % of a core"),
        None,
    ));
    drop(fleet);
    drop(sim);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugins_name_the_discovered_draft_pool() {
        let s = all_plugins().unwrap();
        assert!(s.contains("drafts: [{pool: draft}]"), "{s}");
        assert!(s.contains("target: target"), "{s}");
        assert!(s.contains(MODEL), "{s}");
        for (section, _) in PLUGINS {
            assert!(
                s.contains(&format!("  {section}:\n    enabled: true\n")),
                "{s}"
            );
        }
    }

    fn sent(id: &str, due_ms: u64, ok: bool) -> Sent {
        Sent {
            due: Duration::from_millis(due_ms),
            latency: Duration::from_millis(10),
            request_id: id.into(),
            answer: if ok {
                Answer::Ok
            } else {
                Answer::Failed("x".into())
            },
        }
    }

    #[test]
    fn shares_count_the_draft_pools_requests_by_backend() {
        let mut facts = LogFacts::default();
        let backends = ["a", "c", "b", "d", "a", "c"];
        let mut list = Vec::new();
        for (i, b) in backends.iter().enumerate() {
            let id = format!("r{i}");
            facts.access.insert(
                id.clone(),
                Access {
                    pool: "draft".into(),
                    backend: b.to_string(),
                    line: String::new(),
                },
            );
            list.push(sent(&id, 1000 + 100 * i as u64, true));
        }
        let round = ScaleRound {
            sent: list,
            facts,
            old: vec!["a".into(), "b".into()],
            new: vec!["c".into(), "d".into()],
            killed_addr: "a".into(),
            out_at: 0.5,
            seen: None,
            ready: Some(1.0),
            in_at: 5.0,
            draining_seen: None,
            gone: None,
            kill: 7.0,
            kill_unix_offset: 7.0,
        };
        let [(share, n, all), _] = round.shares();
        assert_eq!((n, all), (3, 6));
        assert!((share - 0.5).abs() < 1e-9);
        assert_eq!(round.fair(), 0.5);
        assert_eq!(round.first_on_new().map(|t| (t * 1e3).round()), Some(600.0));
    }
}
