//! The contenders and the processes behind them: the simulator (the upstream, and the
//! "direct" contender), Sluice with plugins off and on, and nginx. Every process runs in a
//! temporary directory on free ports and is stopped when its handle is dropped (also on a
//! panic or when the run is cancelled).

use std::fmt;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::bare::Knobs;
use sluice_testkit::free_port;

/// The model name the simulator serves and the benchmarks ask for.
pub const MODEL: &str = "bench-model";

/// Every plugin section of conf/sluice.yaml, with the extra keys it needs when switched on.
/// "Plugins on" enables each of these; "plugins off" sets `enabled: false` for each.
/// Add a plugin here when it lands. The cache is on as shipped (memory store); "plugins on"
/// makes it miss from the client side: every request it gets has a prompt of its own
/// ([`crate::loadgen::Target::varied`]), so each one is a real lookup miss and a store. The
/// load generator sends no API key, so the cache shares the anonymous partition (otherwise
/// it would bypass every request).
pub const PLUGINS: &[(&str, &str)] = &[
    ("request_id", ""),
    ("cache", "store: memory\ntenant: {anonymous: share}"),
    // The draft pool answers (confidence checks off, as by default); the target is a second
    // pool on the same simulator.
    (
        "speculative",
        "models:\n  - model: MODEL\n    drafts: [{pool: sim}]\n    target: sim-target",
    ),
    ("kv_breaker", ""),
];

/// The cache section of the cache-hit contenders (scenario 5), replacing `PLUGINS`' one.
fn cache_section(setup: &Setup) -> Option<String> {
    match setup {
        Setup::MemoryHits => Some("store: memory\ntenant: {anonymous: share}".into()),
        // Every answer must be a hit: a lookup that outlives the default 25 ms bound on a
        // busy machine would be a miss, counted as an error. The p99 still shows slow ones.
        Setup::RedisHits(url) => Some(format!(
            "store: redis\nredis:\n  url: {url}\n  lookup_timeout: 1s\ntenant: {{anonymous: share}}"
        )),
        Setup::Off
        | Setup::On
        | Setup::Traced(..)
        | Setup::Only(_)
        | Setup::TenantsLocal(_)
        | Setup::TenantsRedis(..) => None,
    }
}

/// The API key every request of scenario 12 carries (`Authorization: Bearer`), and the one
/// tenant that has it.
pub const TENANT_KEY: &str = "sk-sluice-bench-tenant";
pub const TENANT_NAME: &str = "bench";

/// Scenario 12's tenant limits: every limit the `tenants` plugin has, each set so high that
/// no request is ever refused, so every request runs the whole admission and settlement.
/// `requests_per_minute` is a `u32`; the token limits may be at most 10^12
/// (plugins/tenants/src/limits/config.rs).
pub const TENANT_REQUESTS_PER_MINUTE: &str = "100000000";
pub(crate) const TENANT_LIMITS: &str = "{requests_per_minute: 100000000, \
     input_tokens_per_minute: 1000000000000, output_tokens_per_minute: 1000000000000, \
     max_concurrent: 1000000}";

/// The `sha256:<hex>` digest of `key`, as an operator writes it in the config: from the
/// binary's own `sluice hash-key`, which reads the key on standard input.
pub fn hash_key(sluice_bin: &Path, key: &str) -> Result<String> {
    use std::io::Write as _;
    let mut child = Command::new(sluice_bin)
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {} hash-key", sluice_bin.display()))?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow!("no stdin"))?
        .write_all(key.as_bytes())
        .context("writing the key to sluice hash-key")?;
    let out = child.wait_with_output().context("sluice hash-key")?;
    let digest = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let hex = digest.strip_prefix("sha256:").unwrap_or("");
    if !out.status.success() || hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        bail!(
            "sluice hash-key answered {digest:?} ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(digest)
}

/// The `tenants` section of scenario 12's contenders (every other plugin is off): one tenant
/// with the key `digest` and [`TENANT_LIMITS`], counted in this process or in Redis at `redis`.
pub(crate) fn tenants_section(digest: &str, redis: Option<&str>) -> String {
    let store = match redis {
        None => "{kind: local}".to_string(),
        Some(url) => format!("{{kind: redis, on_redis_error: allow, redis: {{url: \"{url}\"}}}}"),
    };
    format!(
        "  tenants:\n    enabled: true\n    tenants:\n      {TENANT_NAME}:\n        \
         keys: [\"{digest}\"]\n        limits: {TENANT_LIMITS}\n    limits_store: {store}\n"
    )
}

/// How a Sluice contender is configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Setup {
    /// Every plugin `enabled: false`.
    Off,
    /// Every plugin of [`PLUGINS`] on.
    On,
    /// Plugins on, the cache with its memory store (scenario 5: answered from it).
    MemoryHits,
    /// Plugins on, the cache with a Redis store at this URL.
    RedisHits(String),
    /// Scenario 12: only `tenants` on, one tenant whose key has this digest, limits local.
    TenantsLocal(String),
    /// Scenario 12: the same, the limits in the Redis at this URL (digest, URL).
    TenantsRedis(String, String),
    /// Scenario 16: one section of [`PLUGINS`] on alone, every other off.
    Only(&'static str),
    /// Scenario 26: every plugin on, traced at this sampling ratio to the OTLP/HTTP receiver
    /// at this URL.
    Traced(&'static str, String),
}

impl Setup {
    pub fn name(&self) -> &'static str {
        match self {
            Setup::Off => "sluice-off",
            Setup::On => "sluice-on",
            Setup::MemoryHits => "sluice-memory-hits",
            Setup::RedisHits(_) => "sluice-redis-hits",
            Setup::TenantsLocal(_) => "sluice-tenants-local",
            Setup::TenantsRedis(..) => "sluice-tenants-redis",
            Setup::Traced("1.0", _) => "sluice-traced-1",
            Setup::Traced(..) => "sluice-traced",
            Setup::Only(section) => match *section {
                "request_id" => "sluice-only-request-id",
                "cache" => "sluice-only-cache",
                "speculative" => "sluice-only-speculative",
                "kv_breaker" => "sluice-only-kv-breaker",
                _ => "sluice-only",
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Contender {
    /// The client talks to the simulator itself: the floor.
    Direct,
    SluiceOff,
    SluiceOn,
    Nginx,
    /// Scenarios 1, 3, 4, 6, 15-17, 19 and 21: the smallest Pingora proxy (`bare.rs`), the
    /// floor of any proxy built on Pingora.
    BarePingora,
    /// Scenario 21: the bare Pingora proxy with one of Pingora's knobs turned
    /// ([`Contender::bare_knobs`]).
    BarePingoraNoWorkStealing,
    BarePingoraOneThread,
    BarePingoraTwoListenerTasks,
    /// Scenario 5: Sluice answering from its cache, memory store.
    SluiceMemoryHit,
    /// Scenario 5: Sluice answering from its cache, Redis store.
    SluiceRedisHit,
    /// Scenario 7: Sluice in front of a fleet, idle, checking every backend's health.
    SluiceHealthChecks,
    /// Scenario 7: the same, health checks off: the idle floor.
    SluiceNoHealthChecks,
    /// Scenario 10: Sluice in front of a pool of simulators, one of which is killed.
    SluiceBackendKilled,
    /// Scenario 11: Sluice with the KV breaker refusing at once (admission queue off).
    SluiceBreakerRefuses,
    /// Scenario 11: Sluice with the KV breaker's admission queue on.
    SluiceBreakerWaits,
    /// Scenario 12: only the `tenants` plugin on, limits counted in the process.
    SluiceTenantsLocal,
    /// Scenario 12: only the `tenants` plugin on, limits shared through Redis.
    SluiceTenantsRedis,
    /// Scenario 13: Sluice in front of a draft and a target pool, balancing `round_robin`.
    SluiceRoundRobin,
    /// Scenario 13: the same, balancing `kv_aware`.
    SluiceKvAware,
    /// Scenario 13: the same, balancing `ttft`.
    SluiceTtft,
    /// Scenario 16: one plugin on alone (cache misses for the cache).
    SluiceOnlyRequestId,
    SluiceOnlyCache,
    SluiceOnlySpeculative,
    SluiceOnlyKvBreaker,
    /// Scenario 22: Sluice with every plugin on, its draft pool discovered by DNS while the
    /// fleet scales out and in and a pod is killed.
    SluiceDiscovery,
    /// Scenario 22: an idle Sluice whose pool discovers its endpoints by DNS.
    SluiceDiscoveredIdle,
    /// Scenario 22: an idle Sluice with the same endpoints as static `backends`.
    SluiceStaticIdle,
    /// Scenario 23: Sluice with every plugin on in front of a fleet, for a long run with
    /// faults (backends killed, Redis restarted, reloads, abusive clients).
    SluiceSoak,
    /// Scenario 24: `ttft` with the approximate prefix affinity (the prompt's leading bytes).
    SluicePrefixGuess,
    /// Scenario 24: `ttft` with the approximate affinity and the sessions' ids (soft
    /// sessions: a session's backend credited with its last turn).
    SluicePrefixGuessSessions,
    /// Scenario 24: `ttft` with the exact prefix index (tokenizer and KV events).
    SluicePrefixExact,
    /// Scenario 27: the exact prefix index and the conversations' session ids (soft).
    SluicePrefixExactSessions,
    /// Scenario 24: every turn on its session's previous backend (`session_affinity: hard`
    /// with a session header): the oracle of conversation locality.
    SluiceSessionOracle,
    /// Scenario 26: plugins on, traced (`telemetry`) at sampling 0.1, to an OTLP receiver.
    SluiceTraced01,
    /// Scenario 26: the same at sampling 1.0.
    SluiceTraced10,
    /// Scenario 28: a pool at zero, requests held until a backend joins (`no_backend_wait`).
    SluiceWaitingRoom,
    /// Scenario 28: the same pool answering at once (`no_backend_wait: 0s`, as before #53).
    SluiceNoWait,
    /// Scenario 29: `fairness: off`, first come, first served (vLLM's queue orders).
    SluiceFifo,
    /// Scenario 29: `fairness: off`, the KV breaker's classes (the agents sheddable).
    SluicePriorityOnly,
    /// Scenario 29: `fairness: on`.
    SluiceFair,
    /// Scenario 30: one pool, every engine prefilling and decoding.
    SluiceAggregated,
    /// Scenario 30: two engines prefill, two decode (`pools[].prefill`).
    SluiceDisaggregated,
    /// Scenario 30: the split fleet losing half its transfers.
    SluiceDisaggregatedLossy,
    /// Scenario 31: the cache with its semantic part, on labelled question pairs.
    SluiceSemanticCache,
    /// Scenario 32: the exact prefix index alone, every prompt's text new to its tokenizer.
    SluiceIndexNewText,
    /// Scenario 32: the same, every prompt's long text seen before (only its question new).
    SluiceIndexSeenText,
    /// Scenario 32: traces at sampling 1.0, every plugin off.
    SluiceTracedOnly,
    /// Scenario 32: the cache, tenants, the exact index, traces, request ids, the KV breaker.
    SluiceEveryFeature,
    /// Scenario 33: one replica following a fleet's health and KV events.
    SluiceFleetFollower,
}

impl Contender {
    pub const ALL: [Contender; 4] = [
        Contender::Direct,
        Contender::SluiceOff,
        Contender::SluiceOn,
        Contender::Nginx,
    ];
    /// The throughput scenarios add the bare Pingora proxy.
    pub const WITH_BARE_PINGORA: [Contender; 5] = [
        Contender::Direct,
        Contender::BarePingora,
        Contender::SluiceOff,
        Contender::SluiceOn,
        Contender::Nginx,
    ];
    pub const PROXIES: [Contender; 3] =
        [Contender::SluiceOff, Contender::SluiceOn, Contender::Nginx];
    /// The proxies, with the bare Pingora proxy as the floor of what Pingora itself holds.
    pub const PROXIES_WITH_BARE_PINGORA: [Contender; 4] = [
        Contender::BarePingora,
        Contender::SluiceOff,
        Contender::SluiceOn,
        Contender::Nginx,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Contender::Direct => "direct",
            Contender::SluiceOff => "sluice (plugins off)",
            Contender::SluiceOn => "sluice (plugins on)",
            Contender::Nginx => "nginx",
            Contender::BarePingora => "pingora (bare)",
            Contender::BarePingoraNoWorkStealing => "pingora (bare, work_stealing: false)",
            Contender::BarePingoraOneThread => "pingora (bare, threads: 1)",
            Contender::BarePingoraTwoListenerTasks => "pingora (bare, listener_tasks_per_fd: 2)",
            Contender::SluiceMemoryHit => "sluice (cache hits, memory)",
            Contender::SluiceRedisHit => "sluice (cache hits, redis)",
            Contender::SluiceHealthChecks => "sluice (health checks on)",
            Contender::SluiceNoHealthChecks => "sluice (health checks off)",
            Contender::SluiceBackendKilled => "sluice (one backend killed)",
            Contender::SluiceBreakerRefuses => "sluice (kv breaker, wait off)",
            Contender::SluiceBreakerWaits => "sluice (kv breaker, wait on)",
            Contender::SluiceTenantsLocal => "sluice (tenants, local limits)",
            Contender::SluiceTenantsRedis => "sluice (tenants, redis limits)",
            Contender::SluiceRoundRobin => "sluice (round_robin)",
            Contender::SluiceKvAware => "sluice (kv_aware)",
            Contender::SluiceTtft => "sluice (ttft)",
            Contender::SluiceOnlyRequestId => "sluice (request_id only)",
            Contender::SluiceOnlyCache => "sluice (cache only, miss)",
            Contender::SluiceOnlySpeculative => "sluice (speculative only)",
            Contender::SluiceOnlyKvBreaker => "sluice (kv_breaker only)",
            Contender::SluiceDiscovery => "sluice (draft pool discovered by DNS, plugins on)",
            Contender::SluiceDiscoveredIdle => "sluice (endpoints discovered by DNS)",
            Contender::SluiceStaticIdle => "sluice (the same endpoints as static backends)",
            Contender::SluiceSoak => "sluice (soak: plugins on, faults)",
            Contender::SluicePrefixGuess => "sluice (ttft, approximate affinity)",
            Contender::SluicePrefixGuessSessions => "sluice (ttft, approximate affinity, sessions)",
            Contender::SluicePrefixExact => "sluice (ttft, exact prefix index)",
            Contender::SluicePrefixExactSessions => "sluice (ttft, exact prefix index, sessions)",
            Contender::SluiceSessionOracle => "sluice (oracle: session affinity)",
            Contender::SluiceTraced01 => "sluice (plugins on, traced at 0.1)",
            Contender::SluiceTraced10 => "sluice (plugins on, traced at 1.0)",
            Contender::SluiceWaitingRoom => "sluice (waiting room, no_backend_wait: 60s)",
            Contender::SluiceNoWait => "sluice (no_backend_wait: 0s)",
            Contender::SluiceFifo => "sluice (fairness: off, FIFO)",
            Contender::SluicePriorityOnly => "sluice (fairness: off, priority classes)",
            Contender::SluiceFair => "sluice (fairness: on)",
            Contender::SluiceAggregated => "sluice (aggregated: 4 engines)",
            Contender::SluiceDisaggregated => "sluice (disaggregated: 2 prefill + 2 decode)",
            Contender::SluiceDisaggregatedLossy => {
                "sluice (disaggregated, half the transfers lost)"
            }
            Contender::SluiceSemanticCache => "sluice (semantic cache)",
            Contender::SluiceIndexNewText => "sluice (exact index only, new text)",
            Contender::SluiceIndexSeenText => "sluice (exact index only, text seen before)",
            Contender::SluiceTracedOnly => "sluice (traces only, sampling 1.0)",
            Contender::SluiceEveryFeature => "sluice (every feature on)",
            Contender::SluiceFleetFollower => "sluice (following the fleet)",
        }
    }

    /// The bare Pingora proxy's knobs, for its contenders; `None` for the others.
    pub fn bare_knobs(self) -> Option<Knobs> {
        let default = Knobs::default();
        match self {
            Contender::BarePingora => Some(default),
            Contender::BarePingoraNoWorkStealing => Some(Knobs {
                work_stealing: false,
                ..default
            }),
            Contender::BarePingoraOneThread => Some(Knobs {
                threads: 1,
                ..default
            }),
            Contender::BarePingoraTwoListenerTasks => Some(Knobs {
                listener_tasks_per_fd: 2,
                ..default
            }),
            _ => None,
        }
    }
}

impl fmt::Display for Contender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A local address for a process about to start: the testkit's port, which no other
/// contender of this run is handed.
pub fn free_addr() -> Result<SocketAddr> {
    Ok(SocketAddr::from(([127, 0, 0, 1], free_port())))
}

/// A child process, stopped on drop.
pub struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    /// nginx: stop with SIGTERM so the master takes its workers down with it.
    term_first: bool,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: &Path, term_first: bool) -> Result<Proc> {
        let file = std::fs::File::create(log).with_context(|| format!("creating {log:?}"))?;
        let err = file.try_clone().context("log file")?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(Proc {
            name: name.to_string(),
            child: Some(child),
            log: log.to_path_buf(),
            term_first,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The last lines of the process's output.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Fails when the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait().context("waiting")? {
                bail!("{} exited ({status}):\n{}", self.name, self.log_tail());
            }
        }
        Ok(())
    }

    /// Waits until `addrs` accept connections.
    pub async fn wait_ready(&mut self, addrs: &[SocketAddr]) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            self.check_alive()?;
            let mut up = true;
            for a in addrs {
                up &= tokio::net::TcpStream::connect(a).await.is_ok();
            }
            if up {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} did not start:\n{}", self.name, self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if self.term_first {
            let pid = child.id();
            let workers = children_of(pid);
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            for w in workers {
                if Path::new(&format!("/proc/{w}")).exists() {
                    let _ = Command::new("kill")
                        .args(["-KILL", &w.to_string()])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Pids whose parent is `pid` (nginx's workers).
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| stat_fields(*p).and_then(|f| f.get(1)?.parse::<u32>().ok()) == Some(pid))
        .collect()
}

/// The fields of /proc/PID/stat after the command name (index 0 is the state).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// Resident memory (bytes) and CPU time (user + system) of a process.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub rss_bytes: u64,
    pub cpu: Duration,
}

/// Clock ticks per second of /proc's CPU times, asked once: `usage` runs while the
/// contenders are measured, and a process started per sample would disturb them.
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|t: &u64| *t > 0)
            .unwrap_or(100)
    })
}

/// Reads /proc/PID/status (VmRSS) and the process's CPU time: the time its threads ran, in
/// nanoseconds, from each thread's /proc/PID/task/TID/schedstat. /proc/PID/stat's utime +
/// stime come in clock ticks (10 ms), 2 µs per request at 1,000 requests/s over a 5 s round,
/// as large as the plugin costs being measured; it is the fallback when schedstat is missing
/// (a kernel without CONFIG_SCHED_INFO, or with its statistics off: all zeros). A running
/// thread's count lags until its next tick or switch (a few ms). A thread that ends between
/// two samples takes its time with it: the contenders' threads live as long as they do, but
/// for Sluice's blocking-pool threads (large bodies), which end after 10 s without work,
/// longer than a measured run.
pub fn usage(pid: u32) -> Result<Usage> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow!("no VmRSS in /proc/{pid}/status"))?;
    let cpu = match threads_run_time(pid) {
        Some(ran) => ran,
        None => {
            let f = stat_fields(pid).ok_or_else(|| anyhow!("cannot read /proc/{pid}/stat"))?;
            let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            Duration::from_secs_f64((ticks(11) + ticks(12)) as f64 / clock_ticks() as f64)
        }
    };
    Ok(Usage {
        rss_bytes: rss_kb * 1024,
        cpu,
    })
}

/// The sum of the first field (time on the CPU, ns) of every thread's schedstat.
fn threads_run_time(pid: u32) -> Option<Duration> {
    let mut ns = 0u64;
    let mut any = false;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        // A thread that ended since the directory was listed is skipped.
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        // One unreadable line loses that thread, not the sample.
        if let Some(ran) = text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
        {
            ns += ran;
            any = true;
        }
    }
    (any && ns > 0).then(|| Duration::from_nanos(ns))
}

/// The usage of a process and its children (nginx: master and workers).
pub fn tree_usage(pid: u32) -> Result<Usage> {
    let mut u = usage(pid)?;
    for c in children_of(pid) {
        if let Ok(cu) = usage(c) {
            u.rss_bytes += cu.rss_bytes;
            u.cpu += cu.cpu;
        }
    }
    Ok(u)
}

/// A `kB` line of /proc/PID/status (`VmRSS`, `VmHWM`), in bytes.
pub fn status_bytes(pid: u32, key: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow!("no {key} in /proc/{pid}/status"))?;
    Ok(kb * 1024)
}

/// Resets a process's peak RSS (`VmHWM`) to its current RSS (`clear_refs`, Linux 4.0+), so
/// that the peak of one measurement excludes what came before it.
pub fn reset_peak_rss(pid: u32) -> Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
        .with_context(|| format!("writing /proc/{pid}/clear_refs"))
}

/// What the simulator does. Its fields are also the `sim-serve` command line of the bench
/// binary, which runs the simulator library in a process of its own.
#[derive(Clone, Debug, clap::Args)]
pub struct SimSpec {
    /// Inter-token interval in ms; 0 is the zero-latency mode (no sleeps, no per-token loop).
    #[arg(long, default_value_t = 0.0)]
    pub itl_ms: f64,
    /// Every answer has exactly this many tokens (default: 8 to 64, from the prompt).
    #[arg(long)]
    pub answer_tokens: Option<u32>,
    /// KV-cache blocks of 16 tokens (default: 2^24, more than any scenario fills).
    #[arg(long)]
    pub kv_blocks: Option<u32>,
    /// A request whose KV reservation does not fit gets vLLM's `500 CUDA out of memory`
    /// instead of waiting (scenario 11).
    #[arg(long)]
    pub oom: bool,
    /// Prefill time per prompt token, microseconds (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub prefill_us: f64,
    /// The fixed part of every time to first token, milliseconds (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub overhead_ms: f64,
    /// One prefill at a time, as vLLM without chunked prefill (scenario 13).
    #[arg(long)]
    pub serial_prefill: bool,
    /// vLLM V1's engine: chunked prefill with this per-step token budget, and automatic
    /// prefix caching (scenario 25).
    #[arg(long)]
    pub v1_engine: Option<u32>,
}

impl SimSpec {
    pub fn zero() -> SimSpec {
        SimSpec {
            itl_ms: 0.0,
            answer_tokens: None,
            kv_blocks: None,
            oom: false,
            prefill_us: 0.0,
            overhead_ms: 0.0,
            serial_prefill: false,
            v1_engine: None,
        }
    }

    pub fn streaming(itl_ms: f64, tokens: u32) -> SimSpec {
        SimSpec {
            itl_ms,
            answer_tokens: Some(tokens),
            ..SimSpec::zero()
        }
    }

    fn args(&self) -> Vec<String> {
        let mut a = vec!["--itl-ms".to_string(), self.itl_ms.to_string()];
        if let Some(n) = self.answer_tokens {
            a.extend(["--answer-tokens".to_string(), n.to_string()]);
        }
        if let Some(n) = self.kv_blocks {
            a.extend(["--kv-blocks".to_string(), n.to_string()]);
        }
        if self.oom {
            a.push("--oom".to_string());
        }
        if self.prefill_us > 0.0 {
            a.extend(["--prefill-us".to_string(), self.prefill_us.to_string()]);
        }
        if self.overhead_ms > 0.0 {
            a.extend(["--overhead-ms".to_string(), self.overhead_ms.to_string()]);
        }
        if self.serial_prefill {
            a.push("--serial-prefill".to_string());
        }
        if let Some(budget) = self.v1_engine {
            a.extend(["--v1-engine".to_string(), budget.to_string()]);
        }
        a
    }

    /// The simulator's configuration: room for 8 MiB prompts (scenario 9 sends 4M token ids,
    /// one token each) and 1,000 streams, no request recording, no jitter; scenario 11 gives
    /// it a small KV cache (`kv_blocks`) that runs out (`oom`); scenario 13 a prefill speed,
    /// a fixed overhead and one prefill at a time; scenario 25 vLLM V1's engine.
    pub fn config(&self, listen: SocketAddr) -> vllm_sim::SimConfig {
        let mut c = vllm_sim::SimConfig::default()
            .with_listen(listen)
            .with_model(MODEL)
            .with_max_model_len(1 << 23)
            .with_max_num_seqs(4096)
            // 268M tokens of KV cache: eight 1 MiB prompts at once stay far below the KV
            // breaker's thresholds, so it admits everything (its shedding is tested, not
            // benchmarked).
            .with_kv(1 << 24, 16)
            .with_record_requests(0);
        if self.itl_ms > 0.0 || self.prefill_us > 0.0 || self.overhead_ms > 0.0 {
            c = c.with_latency(vllm_sim::Latency::new(
                Duration::from_secs_f64(self.overhead_ms.max(0.0) / 1e3),
                Duration::from_secs_f64(self.prefill_us.max(0.0) / 1e6),
                Duration::from_secs_f64(self.itl_ms.max(0.0) / 1e3),
            ));
        }
        if let Some(n) = self.answer_tokens {
            c = c.with_answer_tokens(n, n);
        }
        if let Some(blocks) = self.kv_blocks {
            c = c.with_kv(blocks, 16);
        }
        c = c
            .with_oom(self.oom)
            .with_serial_prefill(self.serial_prefill);
        match self.v1_engine {
            Some(budget) => c.v1_engine(budget),
            None => c,
        }
    }
}

/// Where the simulator runs.
#[derive(Clone, Debug)]
pub enum SimMode {
    /// A process of its own: this executable with `sim-serve` (the full benchmark).
    Process(PathBuf),
    /// A thread with its own tokio runtime in this process (the CI smoke test).
    InProcess,
}

/// A running simulator.
pub struct RunningSim {
    pub addr: SocketAddr,
    proc: Option<Proc>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RunningSim {
    /// A simulator on a free port of 127.0.0.1.
    pub async fn start(mode: &SimMode, spec: &SimSpec, dir: &Path) -> Result<RunningSim> {
        RunningSim::start_on(mode, spec, dir, free_addr()?).await
    }

    /// A simulator listening on `addr`: another loopback address than 127.0.0.1 (several
    /// simulators on one port, as the pods behind one DNS name), or `0.0.0.0` (one simulator
    /// answering every address of 127.0.0.0/8). Fails when `addr` cannot be bound; the
    /// caller picks another port.
    pub async fn start_on(
        mode: &SimMode,
        spec: &SimSpec,
        dir: &Path,
        addr: SocketAddr,
    ) -> Result<RunningSim> {
        // Where readiness is checked: 0.0.0.0 is reached through 127.0.0.1.
        let probe = if addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], addr.port()))
        } else {
            addr
        };
        match mode {
            SimMode::Process(exe) => {
                let mut cmd = Command::new(exe);
                cmd.arg("sim-serve")
                    .arg("--host")
                    .arg(addr.ip().to_string())
                    .arg("--port")
                    .arg(addr.port().to_string())
                    .args(spec.args())
                    .env("RUST_LOG", "warn");
                let mut proc = Proc::spawn("vllm-sim", cmd, &dir.join("sim.log"), false)?;
                proc.wait_ready(&[probe]).await?;
                Ok(RunningSim {
                    addr,
                    proc: Some(proc),
                    stop: None,
                    thread: None,
                })
            }
            SimMode::InProcess => {
                let config = spec.config(addr);
                let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
                let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<()>>();
                let thread = std::thread::Builder::new()
                    .name("vllm-sim".into())
                    .spawn(move || {
                        let rt = match tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                        {
                            Ok(rt) => rt,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e.into()));
                                return;
                            }
                        };
                        rt.block_on(async move {
                            match vllm_sim::start(config).await {
                                Ok(sim) => {
                                    let _ = ready_tx.send(Ok(()));
                                    let _ = stop_rx.await;
                                    sim.shutdown();
                                }
                                Err(e) => {
                                    let _ = ready_tx.send(Err(e.into()));
                                }
                            }
                        });
                    })
                    .context("starting the simulator thread")?;
                ready_rx
                    .await
                    .context("the simulator thread ended")?
                    .context("starting the simulator")?;
                Ok(RunningSim {
                    addr,
                    proc: None,
                    stop: Some(stop_tx),
                    thread: Some(thread),
                })
            }
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().and_then(Proc::pid)
    }
}

impl Drop for RunningSim {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.proc.take();
    }
}

/// Scenario 8's edge bounds, for Sluice and nginx alike: timeouts short enough to act within
/// a measured window, and per-client caps above what the scenario opens, since its normal
/// traffic and its attackers all come from 127.0.0.1 and would otherwise share one client's
/// caps (which is a different test).
#[derive(Clone, Debug)]
pub struct EdgeLimits {
    /// Sluice's and nginx's `send_timeout`: a client that stops reading is cut after it.
    pub send_timeout: Duration,
    /// Sluice's and nginx's `client_header_timeout`: the whole header, slowloris or not.
    pub client_header_timeout: Duration,
    /// Sluice's `client_body_deadline` (nginx has only a per-read body timeout).
    pub client_body_deadline: Duration,
    /// Sluice's `max_connections_per_client` and `max_requests_in_flight_per_client`.
    pub per_client: usize,
    /// Sluice's `max_buffered_bytes`.
    pub max_buffered_bytes: usize,
}

impl EdgeLimits {
    /// The keys under Sluice's `limits:`, indented for it.
    fn sluice_yaml(&self) -> String {
        format!(
            "  send_timeout: {}ms\n  client_header_timeout: {}ms\n  \
             client_body_deadline: {}ms\n  max_connections_per_client: {n}\n  \
             max_requests_in_flight_per_client: {n}\n  max_buffered_bytes: {}\n",
            self.send_timeout.as_millis(),
            self.client_header_timeout.as_millis(),
            self.client_body_deadline.as_millis(),
            self.max_buffered_bytes,
            n = self.per_client,
        )
    }

    /// The same bounds as nginx directives of its `http` block.
    fn nginx_directives(&self) -> String {
        format!(
            "  send_timeout {}ms;\n  client_header_timeout {}ms;\n",
            self.send_timeout.as_millis(),
            self.client_header_timeout.as_millis(),
        )
    }
}

/// The YAML of a Sluice instance in front of `upstream`; `limits` adds scenario 8's bounds.
pub fn sluice_config(
    dir: &Path,
    name: &str,
    listen: SocketAddr,
    admin: SocketAddr,
    upstream: SocketAddr,
    setup: &Setup,
    limits: Option<&EdgeLimits>,
) -> String {
    let all_on = matches!(
        setup,
        Setup::On | Setup::MemoryHits | Setup::RedisHits(_) | Setup::Traced(..)
    );
    let cache = cache_section(setup);
    let mut plugins = String::new();
    for (section, extra) in PLUGINS {
        let plugins_on = all_on || *setup == Setup::Only(section);
        plugins.push_str(&format!("  {section}:\n    enabled: {plugins_on}\n"));
        if plugins_on {
            let extra = match (*section, &cache) {
                ("cache", Some(c)) => c.as_str(),
                _ => extra,
            };
            for line in extra.lines().filter(|l| !l.trim().is_empty()) {
                let line = line.replace("MODEL", MODEL);
                plugins.push_str(&format!("    {line}\n"));
            }
        }
    }
    match setup {
        Setup::TenantsLocal(digest) => plugins.push_str(&tenants_section(digest, None)),
        Setup::TenantsRedis(digest, url) => {
            plugins.push_str(&tenants_section(digest, Some(url)));
        }
        _ => {}
    }
    let telemetry = match setup {
        Setup::Traced(sampling, endpoint) => format!(
            "telemetry:\n  otlp: {{endpoint: \"{endpoint}\", protocol: http/protobuf}}\n  sampling: {sampling}\n"
        ),
        _ => String::new(),
    };
    format!(
        "# Generated by sluice-bench.\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         limits:\n  max_request_body_bytes: 8388608\n{limits}\
         # A user's logging (access log on), at warn so the log is not what is measured.\n\
         log:\n  level: warn\n  access_log: true\n\
         pools:\n  - name: sim\n    models: [\"{MODEL}\"]\n    backends:\n      - address: {upstream}\n\
         \x20 - name: sim-target\n    models: [\"{MODEL}\"]\n    backends:\n      - address: {upstream}\n\
         {telemetry}plugins:\n{plugins}",
        pid = dir.join(format!("{name}.pid")).display(),
        sock = dir.join(format!("{name}.sock")).display(),
        limits = limits.map(EdgeLimits::sluice_yaml).unwrap_or_default(),
    )
}

/// Starts the bare Pingora proxy (`exe bare-pingora`) in front of `upstream`; returns the
/// process and its listener address.
pub async fn start_bare_pingora(
    exe: &Path,
    dir: &Path,
    upstream: SocketAddr,
    knobs: Knobs,
) -> Result<(Proc, SocketAddr)> {
    let listen = free_addr()?;
    let (cmd, name) = bare_pingora_command(exe, dir, listen, upstream, knobs);
    let mut proc = Proc::spawn(&name, cmd, &dir.join(format!("{name}.log")), false)?;
    proc.wait_ready(&[listen]).await?;
    Ok((proc, listen))
}

/// Starts Sluice (with scenario 8's bounds if given); returns the process and its listener
/// address.
pub async fn start_sluice(
    bin: &Path,
    dir: &Path,
    upstream: SocketAddr,
    setup: &Setup,
    limits: Option<&EdgeLimits>,
) -> Result<(Proc, SocketAddr)> {
    let (proc, listen, _) = start_sluice_admin(bin, dir, upstream, setup, limits).await?;
    Ok((proc, listen))
}

/// As [`start_sluice`]; also returns the admin listener's address (`/metrics`).
pub async fn start_sluice_admin(
    bin: &Path,
    dir: &Path,
    upstream: SocketAddr,
    setup: &Setup,
    limits: Option<&EdgeLimits>,
) -> Result<(Proc, SocketAddr, SocketAddr)> {
    let name = setup.name();
    let (listen, admin) = (free_addr()?, free_addr()?);
    let yaml = sluice_config(dir, name, listen, admin, upstream, setup, limits);
    let proc = start_sluice_with(bin, dir, name, &yaml, &[listen, admin]).await?;
    Ok((proc, listen, admin))
}

/// The bare Pingora proxy's command (run by the bench binary `exe`) listening on `listen`,
/// and its name (each variant its own pid file, socket and log).
pub fn bare_pingora_command(
    exe: &Path,
    dir: &Path,
    listen: SocketAddr,
    upstream: SocketAddr,
    knobs: Knobs,
) -> (Command, String) {
    let name = format!(
        "bare-pingora-t{}-ws{}-l{}",
        knobs.threads, knobs.work_stealing as u8, knobs.listener_tasks_per_fd
    );
    let mut cmd = Command::new(exe);
    cmd.arg("bare-pingora")
        .arg("--listen")
        .arg(listen.to_string())
        .arg("--upstream")
        .arg(upstream.to_string())
        .arg("--dir")
        .arg(dir)
        .arg("--name")
        .arg(&name)
        .arg("--threads")
        .arg(knobs.threads.to_string())
        .arg("--listener-tasks")
        .arg(knobs.listener_tasks_per_fd.to_string());
    if !knobs.work_stealing {
        cmd.arg("--no-work-stealing");
    }
    (cmd, name)
}

/// Starts Sluice with `yaml` as `dir/NAME.yaml`, once it listens on `addrs`.
pub async fn start_sluice_with(
    bin: &Path,
    dir: &Path,
    name: &str,
    yaml: &str,
    addrs: &[SocketAddr],
) -> Result<Proc> {
    let config = dir.join(format!("{name}.yaml"));
    std::fs::write(&config, yaml).with_context(|| format!("writing {config:?}"))?;
    let mut cmd = Command::new(bin);
    cmd.arg("-c").arg(&config).env_remove("RUST_LOG");
    let mut proc = Proc::spawn(name, cmd, &dir.join(format!("{name}.log")), false)?;
    proc.wait_ready(addrs).await?;
    Ok(proc)
}

/// Scenario 7: starts an idle Sluice with one pool of `backends`, checked every 250 ms (the
/// default) or not at all; returns the process and its admin address.
pub async fn start_fleet_sluice(
    bin: &Path,
    dir: &Path,
    backends: &[SocketAddr],
    health_checks: bool,
) -> Result<(Proc, SocketAddr)> {
    let name = if health_checks {
        "sluice-fleet-checked"
    } else {
        "sluice-fleet-unchecked"
    };
    let (listen, admin) = (free_addr()?, free_addr()?);
    let mut yaml = format!(
        "# Generated by sluice-bench.\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         log:\n  level: warn\n  access_log: true\n\
         pools:\n  - name: fleet\n    models: [\"{MODEL}\"]\n    \
         health: {{enabled: {health_checks}, interval: 250ms}}\n    backends:\n",
        pid = dir.join(format!("{name}.pid")).display(),
        sock = dir.join(format!("{name}.sock")).display(),
    );
    for b in backends {
        yaml.push_str(&format!("      - address: {b}\n"));
    }
    let proc = start_sluice_with(bin, dir, name, &yaml, &[listen, admin]).await?;
    Ok((proc, admin))
}

/// Starts a redis-server on a free port in `dir` (no persistence); returns the process and
/// its address.
pub async fn start_redis(dir: &Path) -> Result<(Proc, SocketAddr)> {
    let addr = free_addr()?;
    let proc = start_redis_on(dir, addr).await?;
    Ok((proc, addr))
}

/// Starts a redis-server on `addr` (no persistence, so empty: scenario 23 restarts one on its
/// port); returns once it accepts connections.
pub async fn start_redis_on(dir: &Path, addr: SocketAddr) -> Result<Proc> {
    let rdir = dir.join(format!("redis-{}", addr.port()));
    std::fs::create_dir_all(&rdir).with_context(|| format!("creating {rdir:?}"))?;
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &addr.port().to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&rdir);
    let mut proc = Proc::spawn("redis-server", cmd, &rdir.join("redis.log"), false)?;
    proc.wait_ready(&[addr]).await?;
    Ok(proc)
}

/// Whether the Redis at `addr` answers `PING` with `+PONG` (it accepts connections a moment
/// before it serves them, while it loads).
pub async fn redis_pong(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"PING\r\n").await?;
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).await?;
        Ok::<bool, std::io::Error>(buf.get(..n).is_some_and(|b| b.starts_with(b"+PONG")))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), exchange).await,
        Ok(Ok(true))
    )
}

/// Finds nginx, installing Debian's `nginx-light` when it is missing. The error says why
/// nginx is unavailable.
pub fn find_or_install_nginx() -> Result<PathBuf> {
    if let Some(p) = find_nginx() {
        return Ok(p);
    }
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    let sudo: &[&str] = if root { &[] } else { &["sudo", "-n"] };
    let apt = |args: &[&str]| -> bool {
        let mut all: Vec<&str> = sudo.to_vec();
        all.extend(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]);
        all.extend(args);
        eprintln!("sluice-bench: nginx is missing, running {}", all.join(" "));
        Command::new(all[0])
            .args(&all[1..])
            .stdout(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let installed = apt(&["install", "-y", "-qq", "nginx-light"])
        || (apt(&["update", "-qq"]) && apt(&["install", "-y", "-qq", "nginx-light"]));
    match find_nginx() {
        Some(p) => Ok(p),
        None if installed => bail!("nginx-light was installed but no nginx binary was found"),
        None => bail!("nginx is not installed and `apt-get install -y nginx-light` failed"),
    }
}

fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|d| d.join("nginx"))
        .find(|p| p.is_file())
}

/// nginx's version line (`nginx/1.22.1`).
pub fn nginx_version(bin: &Path) -> String {
    Command::new(bin)
        .arg("-v")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
        .map(|s| s.trim_start_matches("nginx version: ").to_string())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// The nginx configuration: a plain reverse proxy with upstream keep-alive and no buffering,
/// two workers (Sluice runs two threads), and static files under `/static/` from
/// `DIR/static/`, served as `application/json` (scenario 5 puts a cached answer there);
/// `limits` adds scenario 8's timeouts.
pub fn nginx_config(
    dir: &Path,
    listen: SocketAddr,
    upstream: SocketAddr,
    limits: Option<&EdgeLimits>,
) -> String {
    let user = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    format!(
        "# Generated by sluice-bench.\n\
         daemon off;\nmaster_process on;\nworker_processes 2;\n{user}\
         pid {dir}/nginx.pid;\nerror_log {dir}/nginx-error.log warn;\n\
         events {{\n  worker_connections 8192;\n}}\n\
         http {{\n  access_log off;\n  client_max_body_size 8m;\n  \
         client_body_temp_path {dir}/client_body;\n  proxy_temp_path {dir}/proxy_temp;\n  \
         keepalive_requests 1000000;\n  keepalive_timeout 75s;\n{limits}\
         \x20 upstream sim {{\n    server {upstream};\n    keepalive 64;\n    \
         keepalive_requests 1000000;\n  }}\n\
         \x20 server {{\n    listen {listen};\n\
         \x20   location /static/ {{\n      root {dir};\n      types {{ }}\n      \
         default_type application/json;\n    }}\n\
         \x20   location / {{\n      proxy_pass http://sim;\n      proxy_http_version 1.1;\n      \
         proxy_set_header Connection \"\";\n      proxy_buffering off;\n      \
         proxy_request_buffering off;\n      proxy_read_timeout 600s;\n    }}\n  }}\n}}\n",
        user = if user { "user root;\n" } else { "" },
        dir = dir.display(),
        limits = limits.map(EdgeLimits::nginx_directives).unwrap_or_default(),
    )
}

/// Starts nginx in front of `upstream` (with scenario 8's timeouts if given); returns the
/// process and its listener address.
pub async fn start_nginx(
    bin: &Path,
    dir: &Path,
    upstream: SocketAddr,
    limits: Option<&EdgeLimits>,
) -> Result<(Proc, SocketAddr)> {
    let listen = free_addr()?;
    let ndir = dir.join("nginx");
    std::fs::create_dir_all(&ndir).with_context(|| format!("creating {ndir:?}"))?;
    let conf = ndir.join("nginx.conf");
    std::fs::write(&conf, nginx_config(&ndir, listen, upstream, limits))
        .with_context(|| format!("writing {conf:?}"))?;
    let mut cmd = Command::new(bin);
    cmd.arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(&ndir)
        .arg("-e")
        .arg(ndir.join("nginx-error.log"));
    let mut proc = Proc::spawn("nginx", cmd, &ndir.join("nginx.out"), true)?;
    if let Err(e) = proc.wait_ready(&[listen]).await {
        let mut err_log = String::new();
        let _ = std::fs::File::open(ndir.join("nginx-error.log"))
            .and_then(|mut f| f.read_to_string(&mut err_log));
        return Err(e.context(err_log));
    }
    Ok((proc, listen))
}
