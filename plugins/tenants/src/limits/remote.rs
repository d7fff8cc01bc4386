//! The shared store: every check of one admission in one Lua script call (EVALSHA through
//! redis-rs' `Script`), on a single node or a Redis Cluster, the corrections after answers in a
//! second script sent from a spawned task.
//!
//! Redis is never waited on for long: each admission is bounded by `timeout`, and after
//! `failure_threshold` consecutive failures Redis is skipped for `cooldown` (admissions then
//! follow `on_redis_error` at once), the first admission after it probing.

use super::budget::{Period, Windows};
use super::config::{redacted, LimitsConfig, RedisConfig};
use super::gcra::WINDOW_US;
use super::metrics::{self, Kind, Op};
use super::reply::{Reading, Readings, Refusal};
use super::tenant::TenantState;
use super::Want;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, RedisResult, Script, ScriptInvocation};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

/// One admission, atomically: the budget, then the input, output and request buckets (the
/// GCRA with debt of `gcra.rs`, on Redis' own clock so replicas agree), all charged only if
/// none refuses. Keys that reach a full bucket expire, so idle tenants leave nothing behind.
const ADMIT_LUA: &str = r"
-- KEYS: requests TAT, input TAT, output TAT, day spend, month spend (one hash tag).
-- ARGV: window us, requests/min, input/min, output/min (0: none), input wanted,
--       output wanted, day budget, month budget (micro-dollars, 0: none), enforce (1|0).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local W = tonumber(ARGV[1])

local function remaining(tat, limit)
  local used = math.max(tat - now, 0)
  if used >= W then return 0 end
  return math.floor((W - used) * limit / W)
end

-- ok, TAT to store, remaining, reset, retry
local function take(key, limit, n)
  if limit <= 0 then return true, nil, 0, 0, 0 end
  local tat = tonumber(redis.call('GET', key) or '0') or 0
  local nxt = math.max(tat, now) + math.ceil(n * W / limit)
  if nxt - now <= W or tat <= now then
    return true, nxt, remaining(nxt, limit), nxt - now, 0
  end
  local retry = tat - now
  if n <= limit then retry = nxt - W - now end
  return false, nil, remaining(tat, limit), math.max(tat - now, 0), math.max(retry, 1)
end

local day = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
local month = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
local day_limit, month_limit = tonumber(ARGV[7]), tonumber(ARGV[8])
local spent = (day_limit > 0 and day >= day_limit) or (month_limit > 0 and month >= month_limit)

local rok, rtat, rrem, rreset, rretry = take(KEYS[1], tonumber(ARGV[2]), 1)
local iok, itat, irem, ireset, iretry = take(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[5]))
local ook, otat, orem, oreset, oretry = take(KEYS[3], tonumber(ARGV[4]), tonumber(ARGV[6]))

-- 0 admitted, 1 budget, 2 input, 3 output, 4 requests: the first refusal, in the order
-- the local limiter checks them; retry is the longest wait of any that refuses.
local verdict, retry = 0, 0
if not rok then verdict = 4; retry = math.max(retry, rretry) end
if not ook then verdict = 3; retry = math.max(retry, oretry) end
if not iok then verdict = 2; retry = math.max(retry, iretry) end
if spent and ARGV[9] == '1' then verdict = 1 end

if verdict == 0 then
  local function store(key, tat)
    if tat ~= nil and tat > now then
      redis.call('SET', key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
    end
  end
  store(KEYS[1], rtat)
  store(KEYS[2], itat)
  store(KEYS[3], otat)
end
return {verdict, retry, rrem, rreset, irem, ireset, orem, oreset, day, month}
";

/// The correction after an answer: the token buckets moved by what the usage differs from
/// the admission's charge (into debt, or refunded up to full), and the spend added.
const SETTLE_LUA: &str = r"
-- KEYS: input TAT, output TAT, day spend, month spend (one hash tag).
-- ARGV: window us, input/min, output/min (0: none), input delta, output delta,
--       micro-dollars, day key TTL s, month key TTL s.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local W = tonumber(ARGV[1])

local function adjust(key, limit, delta)
  if limit <= 0 or delta == 0 then return end
  local tat = tonumber(redis.call('GET', key) or '0') or 0
  local nxt
  if delta > 0 then
    nxt = math.max(tat, now) + math.ceil(delta * W / limit)
  elseif tat > now then
    nxt = math.max(tat - math.ceil(-delta * W / limit), now)
  else
    return
  end
  if nxt > now then
    redis.call('SET', key, string.format('%.0f', nxt), 'PX', math.ceil((nxt - now) / 1000) + 1000)
  else
    redis.call('DEL', key)
  end
end

adjust(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[4]))
adjust(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[5]))
if tonumber(ARGV[6]) > 0 then
  redis.call('INCRBY', KEYS[3], ARGV[6])
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  redis.call('INCRBY', KEYS[4], ARGV[6])
  redis.call('EXPIRE', KEYS[4], ARGV[8])
end
return 0
";

static ADMIT: LazyLock<Script> = LazyLock::new(|| Script::new(ADMIT_LUA));
static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(SETTLE_LUA));

/// The admission script's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub refused: Option<Refusal>,
    pub retry_us: i64,
    requests: (u64, i64),
    input: (u64, i64),
    output: (u64, i64),
    pub day_micros: u64,
    pub month_micros: u64,
}

impl Answer {
    fn parse(v: &[i64]) -> Option<Answer> {
        let get = |i: usize| v.get(i).copied();
        let count = |i: usize| get(i).map(|n| u64::try_from(n).unwrap_or(0));
        let refused = match get(0)? {
            2 => Some(Refusal::InputTokens),
            3 => Some(Refusal::OutputTokens),
            4 => Some(Refusal::Requests),
            // The budget's refusal is decided from the spend, in Rust, for both stores.
            _ => None,
        };
        Some(Answer {
            refused,
            retry_us: get(1)?,
            requests: (count(2)?, get(3)?),
            input: (count(4)?, get(5)?),
            output: (count(6)?, get(7)?),
            day_micros: count(8)?,
            month_micros: count(9)?,
        })
    }

    pub(crate) fn readings(&self, limits: &LimitsConfig) -> Readings {
        let reading = |limit: Option<u64>, (remaining, reset_us): (u64, i64)| {
            limit.map(|limit| Reading {
                limit,
                remaining,
                reset_us,
            })
        };
        Readings {
            requests: reading(limits.requests_per_minute.map(u64::from), self.requests),
            input: reading(limits.input_tokens_per_minute, self.input),
            output: reading(limits.output_tokens_per_minute, self.output),
        }
    }
}

/// A connection to either deployment; both multiplex, are cheap to clone and reconnect.
#[derive(Clone)]
enum Backend {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Backend {
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        call: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            Backend::Single(c) => call.invoke_async(&mut c.clone()).await,
            Backend::Cluster(c) => call.invoke_async(&mut c.clone()).await,
        }
    }
}

enum Target {
    Single(Client),
    /// Boxed: far larger than a `Client`, and made once.
    Cluster(Box<ClusterClient>),
    /// Unusable configuration (not validated): every call fails, and is counted.
    Invalid(String),
}

/// Consecutive failures, and the end of the cool-down (µs since `base`, 0 = none).
struct CoolDown {
    base: Instant,
    failures: AtomicU32,
    until: AtomicU64,
    threshold: u32,
    cooldown: Duration,
}

impl CoolDown {
    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn deadline(&self) -> u64 {
        let cooldown = u64::try_from(self.cooldown.as_micros()).unwrap_or(u64::MAX);
        self.now().saturating_add(cooldown).max(1)
    }

    /// Whether a call may go to Redis now.
    fn go(&self) -> bool {
        let until = self.until.load(Ordering::Acquire);
        if until == 0 {
            return true;
        }
        if self.now() < until {
            return false;
        }
        // Over: whoever moves the deadline sends the one probe; the rest keep skipping.
        self.until
            .compare_exchange(until, self.deadline(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Release);
        if self.until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!("tenant limits store answers again, cool-down over");
        }
    }

    fn failure(&self, why: &str) {
        let n = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if n >= self.threshold && self.until.swap(self.deadline(), Ordering::AcqRel) == 0 {
            // Logged on entering a cool-down only: a dead Redis logs once, not per request.
            tracing::warn!(
                failures = n,
                cooldown = ?self.cooldown,
                error = why,
                "tenant limits store (redis) failing, skipping it for a cool-down"
            );
        }
    }
}

struct Shared {
    target: Target,
    backend: OnceLock<Backend>,
    cool_down: CoolDown,
    timeout: Duration,
    connect_timeout: Duration,
    prefix: String,
}

impl Shared {
    /// The connection, made on first use inside a runtime (redis-rs spawns its tasks there).
    fn backend(&self) -> Result<&Backend, String> {
        if let Some(b) = self.backend.get() {
            return Ok(b);
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err("no Tokio runtime to run the Redis connection on".into());
        }
        let made = match &self.target {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.connect_timeout))
                    // One attempt per reconnect: the cool-down keeps admissions away
                    // meanwhile, and retries inside redis-rs would only hold them longer.
                    .set_number_of_retries(0);
                ConnectionManager::new_lazy_with_config(client.clone(), config)
                    .map(Backend::Single)
                    .map_err(|e| e.to_string())?
            }
            Target::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(self.connect_timeout)
                    .set_response_timeout(self.connect_timeout);
                Backend::Cluster(client.get_pending_async_connection_with_config(config))
            }
            Target::Invalid(e) => return Err(e.clone()),
        };
        // Another thread may have won the race; its connection is as good as ours.
        Ok(self.backend.get_or_init(|| made))
    }

    /// `<prefix>{<tenant>}:<what>`: the braces keep a tenant's keys on one Cluster slot,
    /// which a script touching several of them needs.
    fn key(&self, tenant: &str, what: &str) -> String {
        format!("{}{{{tenant}}}:{what}", self.prefix)
    }

    /// One script call, bounded by `within`, counted and fed to the cool-down.
    async fn call<T: redis::FromRedisValue>(
        &self,
        op: Op,
        within: Duration,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, Kind> {
        if !self.cool_down.go() {
            metrics::store_error(op, Kind::Cooldown);
            return Err(Kind::Cooldown);
        }
        let backend = match self.backend() {
            Ok(b) => b,
            Err(e) => {
                self.cool_down.failure(&e);
                metrics::store_error(op, Kind::Error);
                return Err(Kind::Error);
            }
        };
        match tokio::time::timeout(within, backend.invoke::<T>(invocation)).await {
            Ok(Ok(v)) => {
                self.cool_down.success();
                Ok(v)
            }
            Ok(Err(e)) => {
                self.cool_down.failure(&e.to_string());
                metrics::store_error(op, Kind::Error);
                Err(Kind::Error)
            }
            Err(_) => {
                self.cool_down.failure("timed out");
                metrics::store_error(op, Kind::Timeout);
                Err(Kind::Timeout)
            }
        }
    }
}

/// The Redis store; cheap to clone.
#[derive(Clone)]
pub(crate) struct RedisStore {
    shared: Arc<Shared>,
}

/// Micro-dollars, 0 for no budget.
fn budget_micros(usd: Option<f64>) -> u64 {
    usd.map_or(0, super::budget::micros)
}

impl RedisStore {
    /// Never fails and never waits: inside a runtime it starts connecting (and loading the
    /// scripts) in the background, otherwise on the first admission.
    pub(crate) fn connect(config: Option<&RedisConfig>) -> RedisStore {
        let fallback = RedisConfig::default();
        let c = config.unwrap_or(&fallback);
        let target = match (config, &c.url, c.cluster_nodes.is_empty()) {
            (None, _, _) => Target::Invalid("limits_store.redis is not set".into()),
            (Some(_), Some(url), true) => match Client::open(url.as_str()) {
                Ok(client) => Target::Single(client),
                Err(e) => Target::Invalid(format!("redis url {:?}: {e}", redacted(url))),
            },
            (Some(_), None, false) => {
                match ClusterClient::builder(c.cluster_nodes.iter().map(String::as_str))
                    .connection_timeout(c.connect_timeout)
                    .response_timeout(c.connect_timeout)
                    .build()
                {
                    Ok(client) => Target::Cluster(Box::new(client)),
                    Err(e) => Target::Invalid(format!("redis cluster_nodes: {e}")),
                }
            }
            _ => Target::Invalid("set exactly one of url and cluster_nodes".into()),
        };
        if let Target::Invalid(e) = &target {
            tracing::error!(error = %e, "tenant limits store unusable; on_redis_error applies to every admission");
        }
        let store = RedisStore {
            shared: Arc::new(Shared {
                target,
                backend: OnceLock::new(),
                cool_down: CoolDown {
                    base: Instant::now(),
                    failures: AtomicU32::new(0),
                    until: AtomicU64::new(0),
                    threshold: c.failure_threshold.max(1),
                    cooldown: c.cooldown,
                },
                timeout: c.timeout,
                connect_timeout: c.connect_timeout,
                prefix: c.key_prefix.clone(),
            }),
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let shared = Arc::clone(&store.shared);
            // Connect and load the scripts now, so the first admission does not spend its
            // short timeout on a handshake and a NOSCRIPT round trip.
            runtime.spawn(async move {
                if let Ok(backend) = shared.backend() {
                    let within = shared.connect_timeout;
                    for script in [&*ADMIT, &*SETTLE] {
                        let load = async {
                            match backend {
                                Backend::Single(c) => script.load_async(&mut c.clone()).await,
                                Backend::Cluster(c) => script.load_async(&mut c.clone()).await,
                            }
                        };
                        let _ = tokio::time::timeout(within, load).await;
                    }
                }
            });
        }
        store
    }

    /// Runs the admission script for `tenant`; `Err` when Redis did not answer usably.
    pub(crate) async fn admit(
        &self,
        tenant: &TenantState,
        want: Want,
        windows: &Windows,
    ) -> Result<Answer, Kind> {
        let s = &self.shared;
        let name = &tenant.name;
        let limits = &tenant.limits;
        let mut call = ADMIT.prepare_invoke();
        call.key(s.key(name, "req"))
            .key(s.key(name, "in"))
            .key(s.key(name, "out"))
            .key(s.key(name, &format!("usd:d:{}", windows.day)))
            .key(s.key(name, &format!("usd:m:{}", windows.month)))
            .arg(WINDOW_US)
            .arg(limits.requests_per_minute.unwrap_or(0))
            .arg(limits.input_tokens_per_minute.unwrap_or(0))
            .arg(limits.output_tokens_per_minute.unwrap_or(0))
            .arg(want.input_tokens)
            .arg(want.output_tokens)
            .arg(budget_micros(tenant.budget.usd_per_day))
            .arg(budget_micros(tenant.budget.usd_per_month))
            .arg(u8::from(tenant.budget.mode() == super::BudgetMode::Enforce));
        let values: Vec<i64> = s.call(Op::Admit, s.timeout, &call).await?;
        Answer::parse(&values).ok_or_else(|| {
            metrics::store_error(Op::Admit, Kind::Error);
            Kind::Error
        })
    }

    /// Sends a correction from a spawned task: the answer is done, nobody waits for this.
    pub(crate) fn settle(
        &self,
        tenant: &TenantState,
        (input, output, usd_micros): (i64, i64, u64),
        windows: &Windows,
    ) {
        if input == 0 && output == 0 && usd_micros == 0 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            metrics::store_error(Op::Settle, Kind::Error);
            return;
        };
        let s = Arc::clone(&self.shared);
        let name = Arc::clone(&tenant.name);
        let limits = tenant.limits.clone();
        // The spend keys outlive their window by a day, for late corrections.
        let day_ttl = windows.left(Period::Day) + 86_400;
        let month_ttl = windows.left(Period::Month) + 86_400;
        let (day, month) = (windows.day, windows.month);
        runtime.spawn(async move {
            let mut call = SETTLE.prepare_invoke();
            call.key(s.key(&name, "in"))
                .key(s.key(&name, "out"))
                .key(s.key(&name, &format!("usd:d:{day}")))
                .key(s.key(&name, &format!("usd:m:{month}")))
                .arg(WINDOW_US)
                .arg(limits.input_tokens_per_minute.unwrap_or(0))
                .arg(limits.output_tokens_per_minute.unwrap_or(0))
                .arg(input)
                .arg(output)
                .arg(usd_micros)
                .arg(day_ttl)
                .arg(month_ttl);
            // A lost correction is counted; the next admissions run on the estimate.
            let _ = s.call::<i64>(Op::Settle, s.connect_timeout, &call).await;
        });
    }
}
