//! The shared store: every check of an admission in one Lua script call (EVALSHA through
//! redis-rs' `Script`), on a single node or a Redis Cluster, with the tenant's other
//! admissions that queued while its last call was in flight (`Queue`); the corrections after
//! answers in a second script sent from a spawned task, summed while one is in flight
//! (`Unsent`).
//!
//! Redis is never waited on for long: each admission is bounded by `timeout`, and after
//! `failure_threshold` consecutive failures Redis is skipped for `cooldown` (admissions then
//! follow `on_redis_error` at once), the first admission after it probing.

use super::budget::{Period, Windows};
use super::config::{LimitsConfig, RedisConfig};
use super::gcra::WINDOW_US;
use super::metrics::{self, Kind, Op};
use super::reply::{Reading, Readings, Refusal};
use super::tenant::TenantState;
use super::Want;
use redis::Script;
use sluice_sdk::redis::RedisLink;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use tokio::sync::oneshot;

/// A batch of one tenant's admissions, in order, each as atomic as if alone: the budget, then
/// the input, output and request buckets (the GCRA with debt of `gcra.rs`, on Redis' own
/// clock so replicas agree), each admission charged only if none of its checks refuses, and
/// seeing the charges of those before it. Keys that reach a full bucket expire, so idle
/// tenants leave nothing behind.
const ADMIT_LUA: &str = r"
-- KEYS: requests TAT, input TAT, output TAT, day spend, month spend (one hash tag).
-- ARGV: window us, requests/min, input/min, output/min (0: none), day budget, month budget
--       (micro-dollars, 0: none), enforce (1|0), then for each admission in order: input
--       wanted, output wanted.
-- Returns, space-separated: day spend, month spend, then per admission: verdict, retry,
-- and the remaining and reset of the requests, input and output buckets.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local W = tonumber(ARGV[1])
local limit = {tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local tat, moved = {0, 0, 0}, {false, false, false}
for k = 1, 3 do
  if limit[k] > 0 then tat[k] = tonumber(redis.call('GET', KEYS[k]) or '0') or 0 end
end

local function remaining(at, lim)
  local used = math.max(at - now, 0)
  if used >= W then return 0 end
  return math.floor((W - used) * lim / W)
end

-- ok, TAT after, remaining, reset, retry
local function take(k, n)
  local lim = limit[k]
  if lim <= 0 then return true, nil, 0, 0, 0 end
  local nxt = math.max(tat[k], now) + math.ceil(n * W / lim)
  if nxt - now <= W or tat[k] <= now then
    return true, nxt, remaining(nxt, lim), nxt - now, 0
  end
  local retry = tat[k] - now
  if n <= lim then retry = nxt - W - now end
  return false, nil, remaining(tat[k], lim), math.max(tat[k] - now, 0), math.max(retry, 1)
end

local day = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
local month = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
local day_limit, month_limit = tonumber(ARGV[5]), tonumber(ARGV[6])
local refuse_all = ARGV[7] == '1' and
  ((day_limit > 0 and day >= day_limit) or (month_limit > 0 and month >= month_limit))

local out = {day, month}
for i = 8, #ARGV - 1, 2 do
  local rok, rtat, rrem, rreset, rretry = take(1, 1)
  local iok, itat, irem, ireset, iretry = take(2, tonumber(ARGV[i]))
  local ook, otat, orem, oreset, oretry = take(3, tonumber(ARGV[i + 1]))
  -- 0 admitted, 1 budget, 2 input, 3 output, 4 requests: the first refusal, in the order
  -- the local limiter checks them; retry is the longest wait of any that refuses.
  local verdict, retry = 0, 0
  if not rok then verdict = 4; retry = math.max(retry, rretry) end
  if not ook then verdict = 3; retry = math.max(retry, oretry) end
  if not iok then verdict = 2; retry = math.max(retry, iretry) end
  if refuse_all then verdict = 1 end
  if verdict == 0 then
    local after = {rtat, itat, otat}
    for k = 1, 3 do
      if after[k] ~= nil then tat[k] = after[k]; moved[k] = true end
    end
  end
  local n = #out
  out[n + 1], out[n + 2] = verdict, retry
  out[n + 3], out[n + 4], out[n + 5], out[n + 6] = rrem, rreset, irem, ireset
  out[n + 7], out[n + 8] = orem, oreset
end

for k = 1, 3 do
  if moved[k] and tat[k] > now then
    redis.call('SET', KEYS[k], string.format('%.0f', tat[k]), 'PX', math.ceil((tat[k] - now) / 1000) + 1000)
  end
end
-- One string, not an array of numbers: the client reads it in one piece.
return table.concat(out, ' ')
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
    /// The answers of a batch of `n` admissions, in order, from the script's reply: the
    /// spend, then 8 numbers each, space-separated. Lua writes a number of 15 digits or more
    /// in exponent form, so each is read as a float (a few minutes' rounding on a wait of
    /// years is no loss).
    fn parse_reply(reply: &str, n: usize) -> Option<Vec<Answer>> {
        let numbers: Option<Vec<i64>> = reply
            .split(' ')
            // Every number the script sends is an integer; `as` saturates what i64 cannot hold.
            .map(|t| t.parse::<f64>().ok().map(|f| f as i64))
            .collect();
        Self::parse_batch(&numbers?, n)
    }

    /// The answers of a batch of `n` admissions, in order: the spend, then 8 numbers each.
    fn parse_batch(v: &[i64], n: usize) -> Option<Vec<Answer>> {
        let count = |x: i64| u64::try_from(x).unwrap_or(0);
        let (&day, &month) = (v.first()?, v.get(1)?);
        let each = v.get(2..)?;
        if each.len() != n * 8 {
            return None;
        }
        let answers = each.chunks_exact(8).map(|a| Answer {
            refused: match a[0] {
                2 => Some(Refusal::InputTokens),
                3 => Some(Refusal::OutputTokens),
                4 => Some(Refusal::Requests),
                // The budget's refusal is decided from the spend, in Rust, for both stores.
                _ => None,
            },
            retry_us: a[1],
            requests: (count(a[2]), a[3]),
            input: (count(a[4]), a[5]),
            output: (count(a[6]), a[7]),
            day_micros: count(day),
            month_micros: count(month),
        });
        Some(answers.collect())
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

struct Shared {
    link: RedisLink,
    prefix: String,
}

impl Shared {
    /// `<prefix>{<tenant>}:<what>`: the braces keep a tenant's keys on one Cluster slot,
    /// which a script touching several of them needs.
    fn key(&self, tenant: &str, what: &str) -> String {
        format!("{}{{{tenant}}}:{what}", self.prefix)
    }

    /// The keys of `tenant`'s spend in the day and the month of `windows`.
    fn spend_keys(&self, tenant: &str, windows: &Windows) -> [String; 2] {
        [
            self.key(tenant, &format!("usd:d:{}", windows.day)),
            self.key(tenant, &format!("usd:m:{}", windows.month)),
        ]
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
        const NAME: &str = "tenant limits store";
        let (link, prefix) = match config {
            Some(c) => (RedisLink::new(NAME, &c.settings()), c.key_prefix.clone()),
            None => (
                RedisLink::broken(NAME, "limits_store.redis is not set"),
                RedisConfig::default().key_prefix,
            ),
        };
        if let Some(e) = link.unusable() {
            tracing::error!(error = %e, "tenant limits store unusable; on_redis_error applies to every admission");
        }
        let store = RedisStore {
            shared: Arc::new(Shared { link, prefix }),
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let shared = Arc::clone(&store.shared);
            // Connect and load the scripts now, so the first admission does not spend its
            // short timeout on a handshake and a NOSCRIPT round trip.
            runtime.spawn(async move {
                if let Ok(mut connection) = shared.link.connection() {
                    let within = shared.link.connect_timeout();
                    for script in [&*ADMIT, &*SETTLE] {
                        let _ =
                            tokio::time::timeout(within, script.load_async(&mut connection)).await;
                    }
                }
            });
        }
        store
    }

    /// Runs `tenant`'s admission through the script; `Err` when Redis did not answer usably
    /// within the store's timeout. Admissions of one tenant that arrive while its call is in
    /// flight wait for the next, which takes them all (`Queue`).
    pub(crate) async fn admit(
        &self,
        tenant: &Arc<TenantState>,
        want: Want,
    ) -> Result<Answer, Kind> {
        let answer = if tokio::runtime::Handle::try_current().is_err() {
            // Nothing could send the call, nor time the wait.
            Err(Kind::Error)
        } else {
            self.queued(tenant, want).await
        };
        // Counted here, once per admission, before anyone can see its outcome.
        if let Err(kind) = answer {
            metrics::store_error(Op::Admit, kind);
        }
        answer
    }

    /// Queues the admission and waits for its answer, at most the store's timeout.
    async fn queued(&self, tenant: &Arc<TenantState>, want: Want) -> Result<Answer, Kind> {
        let (reply, answer) = oneshot::channel();
        let deadline = tokio::time::Instant::now() + self.shared.link.timeout();
        if tenant.queue.push(Waiting { want, reply }) {
            match tenant.queue.next_batch() {
                // Alone: this admission sends its own call, with no task to wake on the way
                // there or back unless Redis is slow; given up mid-call (its client left), it
                // loses only its own answer.
                Some(batch) if batch.len() == 1 => {
                    let own = OwnCall {
                        shared: &self.shared,
                        tenant,
                    };
                    let (shared, owner) = (Arc::clone(&self.shared), Arc::clone(tenant));
                    let mut call = Box::pin(async move {
                        shared.admit_batch(&owner, batch).await;
                        if let Some(rest) = owner.queue.next_batch() {
                            hand_over(&shared, &owner, Some(rest));
                        }
                    });
                    tokio::select! {
                        () = &mut call => {}
                        // Past the admission's wait, the call goes on in a task: its answer
                        // says what the script charged, which is then given back.
                        () = tokio::time::sleep_until(deadline) => {
                            tokio::spawn(call);
                        }
                    }
                    std::mem::forget(own);
                }
                // Others queued with it: a task sends, so that none of them depends on
                // this admission staying.
                first => hand_over(&self.shared, tenant, first),
            }
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(answer)) => answer,
            // The sender is gone without an answer (its task was dropped).
            Ok(Err(_)) => Err(Kind::Error),
            Err(_) => Err(Kind::Timeout),
        }
    }

    /// Adds a correction to the tenant's unsent ones and makes sure a sender runs: the
    /// answer is done, nobody waits for this.
    pub(crate) fn settle(&self, tenant: &Arc<TenantState>, amounts: (i64, i64, u64)) {
        settle_with(&self.shared, tenant, amounts);
    }
}

/// [`RedisStore::settle`]'s work: adds the correction to the tenant's unsent ones and makes
/// sure a sender runs.
fn settle_with(
    shared: &Arc<Shared>,
    tenant: &Arc<TenantState>,
    (input, output, usd_micros): (i64, i64, u64),
) {
    if input == 0 && output == 0 && usd_micros == 0 {
        return;
    }
    let unsent = &tenant.unsent;
    unsent.add(input, output, usd_micros);
    if !unsent.claim_sender() {
        // The running sender sends this with what it sends next.
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // Nothing can send it: lost, and counted.
        unsent.take();
        unsent.release_sender();
        metrics::store_error(Op::Settle, Kind::Error);
        return;
    };
    let shared = Arc::clone(shared);
    let tenant = Arc::clone(tenant);
    runtime.spawn(async move {
        // Dropped before the end (the runtime stopping), it lets a later settle send.
        let sending = SettleSender(&tenant.unsent);
        while let Some(sum) = tenant.unsent.next_batch() {
            shared.send_settle(&tenant, sum).await;
        }
        std::mem::forget(sending);
    });
}

/// How many times an admission's timeout its script call waits for Redis' answer.
const CALL_PATIENCE: u32 = 4;

impl Shared {
    /// One script call for a batch of one tenant's admissions; each gets its answer, or the
    /// call's failure (which each admission counts).
    async fn admit_batch(self: &Arc<Self>, tenant: &Arc<TenantState>, batch: Vec<Waiting>) {
        let windows = Windows::at(super::budget::unix_now());
        let (name, limits, budget) = (&tenant.name, &tenant.limits, &tenant.budget);
        let mut call = ADMIT.prepare_invoke();
        let [day, month] = self.spend_keys(name, &windows);
        call.key(self.key(name, "req"))
            .key(self.key(name, "in"))
            .key(self.key(name, "out"))
            .key(day)
            .key(month)
            .arg(WINDOW_US)
            .arg(limits.requests_per_minute.unwrap_or(0))
            .arg(limits.input_tokens_per_minute.unwrap_or(0))
            .arg(limits.output_tokens_per_minute.unwrap_or(0))
            .arg(budget_micros(budget.usd_per_day))
            .arg(budget_micros(budget.usd_per_month))
            .arg(u8::from(budget.mode() == super::BudgetMode::Enforce));
        for waiting in &batch {
            call.arg(waiting.want.input_tokens)
                .arg(waiting.want.output_tokens);
        }
        // The call waits longer than its admissions do: an admission that gave up still
        // learns what the script charged it, which is then given back (below).
        let patience = self.link.timeout().saturating_mul(CALL_PATIENCE);
        let answers = match self.link.invoke::<String>(&call, patience).await {
            Ok(reply) => Answer::parse_reply(&reply, batch.len()).ok_or(Kind::Error),
            Err(failure) => Err(Kind::of(&failure)),
        };
        match answers {
            Ok(answers) => {
                for (waiting, answer) in batch.into_iter().zip(answers) {
                    let charged = answer.refused.is_none();
                    let want = waiting.want;
                    // A waiter that gave up (timed out, or its client left) is gone: what
                    // the script charged it is given back, or its request (admitted
                    // uncharged when the store fails open) would be charged twice.
                    if waiting.reply.send(Ok(answer)).is_err() && charged {
                        self.refund(tenant, want);
                    }
                }
            }
            Err(kind) => {
                for waiting in batch {
                    // A call that timed out most likely ran in a slow Redis and charged
                    // its admissions, which were answered as failures: given back too.
                    // (Had it not run, the refund only empties the buckets sooner: the
                    // settle script never takes a bucket below empty.)
                    if kind == Kind::Timeout {
                        self.refund(tenant, waiting.want);
                    }
                    let _ = waiting.reply.send(Err(kind));
                }
            }
        }
    }

    /// Gives back what an admission's script call charged, through the settle path.
    fn refund(self: &Arc<Self>, tenant: &Arc<TenantState>, want: Want) {
        metrics::refunded_admission();
        settle_with(
            self,
            tenant,
            (
                -i64::try_from(want.input_tokens).unwrap_or(i64::MAX),
                -i64::try_from(want.output_tokens).unwrap_or(i64::MAX),
                0,
            ),
        );
    }

    /// One settle call for a sum of corrections, in the spend windows of now. A lost one is
    /// counted; the next admissions run on the estimates.
    async fn send_settle(
        &self,
        tenant: &TenantState,
        (input, output, usd_micros): (i64, i64, u64),
    ) {
        let windows = Windows::at(super::budget::unix_now());
        // The spend keys outlive their window by a day, for late corrections.
        let day_ttl = windows.left(Period::Day) + 86_400;
        let month_ttl = windows.left(Period::Month) + 86_400;
        let (name, limits) = (&tenant.name, &tenant.limits);
        let mut call = SETTLE.prepare_invoke();
        let [day, month] = self.spend_keys(name, &windows);
        call.key(self.key(name, "in"))
            .key(self.key(name, "out"))
            .key(day)
            .key(month)
            .arg(WINDOW_US)
            .arg(limits.input_tokens_per_minute.unwrap_or(0))
            .arg(limits.output_tokens_per_minute.unwrap_or(0))
            .arg(input)
            .arg(output)
            .arg(usd_micros)
            .arg(day_ttl)
            .arg(month_ttl);
        let sent = self
            .link
            .invoke::<i64>(&call, self.link.connect_timeout())
            .await;
        if let Err(failure) = sent {
            metrics::store_error(Op::Settle, Kind::of(&failure));
        }
    }
}

/// Admissions at most this many to a script call: its arguments stay small, and a burst is
/// spread over a few calls rather than one long one.
const MAX_BATCH: usize = 64;

/// An admission waiting for its tenant's next script call.
pub(crate) struct Waiting {
    want: Want,
    reply: oneshot::Sender<Result<Answer, Kind>>,
}

/// A tenant's admissions waiting for Redis. At most one admission call per tenant is in
/// flight from a replica; the admissions that arrive meanwhile go together in the next one,
/// checked one after the other by the script as if each were alone. Under load that takes
/// one round trip per batch instead of one per request, which is most of what a Redis-shared
/// limit costs the proxy and Redis; alone, an admission goes at once.
#[derive(Default)]
pub(crate) struct Queue(Mutex<Queued>);

#[derive(Default)]
struct Queued {
    waiting: Vec<Waiting>,
    /// Someone sends: an admission its own call, or a task; either takes what queues before
    /// it lets go.
    claimed: bool,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Queued> {
        // A queue of waiters is valid whatever a panicking holder left.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `waiting`; whether the caller must start the sender.
    fn push(&self, waiting: Waiting) -> bool {
        let mut q = self.lock();
        q.waiting.push(waiting);
        !std::mem::replace(&mut q.claimed, true)
    }

    /// For the sender: the next batch, or `None` (and the sender's claim given up) once
    /// nothing waits. Admissions given up meanwhile (timed out, or their client left) are
    /// dropped here, not charged.
    fn next_batch(&self) -> Option<Vec<Waiting>> {
        let mut q = self.lock();
        q.waiting.retain(|w| !w.reply.is_closed());
        if q.waiting.is_empty() {
            q.claimed = false;
            return None;
        }
        let n = q.waiting.len().min(MAX_BATCH);
        Some(q.waiting.drain(..n).collect())
    }

    fn fail_all(&self, kind: Kind) {
        let waiting = {
            let mut q = self.lock();
            q.claimed = false;
            std::mem::take(&mut q.waiting)
        };
        for w in waiting {
            let _ = w.reply.send(Err(kind));
        }
    }
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("waiting", &self.lock().waiting.len())
            .finish()
    }
}

/// Held by the admission that sends its own call. Dropped before the call ends (that
/// admission was given up), it hands the queue to a task, so that the admissions queued
/// meanwhile are still sent.
struct OwnCall<'a> {
    shared: &'a Arc<Shared>,
    tenant: &'a Arc<TenantState>,
}

impl Drop for OwnCall<'_> {
    fn drop(&mut self) {
        hand_over(self.shared, self.tenant, None);
    }
}

/// A task sends `first`, then every batch that queues, until none does. If the task is
/// dropped before (the runtime stopping), the queue's waiters are failed and its claim
/// released, rather than left to time out for good.
fn hand_over(shared: &Arc<Shared>, tenant: &Arc<TenantState>, first: Option<Vec<Waiting>>) {
    let (shared, tenant) = (Arc::clone(shared), Arc::clone(tenant));
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tenant.queue.fail_all(Kind::Error);
        return;
    };
    runtime.spawn(async move {
        let sending = QueueSender(&tenant.queue);
        if let Some(batch) = first {
            shared.admit_batch(&tenant, batch).await;
        }
        while let Some(batch) = tenant.queue.next_batch() {
            shared.admit_batch(&tenant, batch).await;
        }
        // The queue was empty and its claim released by `next_batch`.
        std::mem::forget(sending);
    });
}

/// Held by a queue's sender task: dropped before its end, it fails what waits.
struct QueueSender<'a>(&'a Queue);

impl Drop for QueueSender<'_> {
    fn drop(&mut self) {
        self.0.fail_all(Kind::Error);
    }
}

/// Held by a settle task: dropped before its end, it gives up the sender's claim.
struct SettleSender<'a>(&'a Unsent);

impl Drop for SettleSender<'_> {
    fn drop(&mut self) {
        self.0.release_sender();
    }
}

/// A tenant's corrections not yet sent to Redis. At most one settle call per tenant is in
/// flight from a replica; the corrections of answers that end meanwhile are summed and go in
/// the next one. A busy tenant so costs one round trip per batch, not one per answer, and an
/// idle one still sends each correction at once.
#[derive(Debug, Default)]
pub(crate) struct Unsent {
    input: AtomicI64,
    output: AtomicI64,
    usd_micros: AtomicU64,
    /// A sender task is running and will send what is added before it stops.
    sending: AtomicBool,
}

impl Unsent {
    fn add(&self, input: i64, output: i64, usd_micros: u64) {
        // SeqCst here and in `next_batch`: a correction added just as the sender stops must
        // be seen either by the sender's last look or by a new claim (store, then load, on
        // both sides).
        let saturating = |a: &AtomicI64, d: i64| {
            let _ = a.fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_add(d)));
        };
        saturating(&self.input, input);
        saturating(&self.output, output);
        let _ = self
            .usd_micros
            .fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_add(usd_micros)));
    }

    /// Whether the caller became the sender.
    fn claim_sender(&self) -> bool {
        !self.sending.swap(true, SeqCst)
    }

    fn release_sender(&self) {
        self.sending.store(false, SeqCst);
    }

    fn take(&self) -> (i64, i64, u64) {
        (
            self.input.swap(0, SeqCst),
            self.output.swap(0, SeqCst),
            self.usd_micros.swap(0, SeqCst),
        )
    }

    /// For the sender: the sum to send next, or `None` once nothing is left, the sender's
    /// claim then given up (or kept, if a correction came in as it let go).
    fn next_batch(&self) -> Option<(i64, i64, u64)> {
        loop {
            let sum = self.take();
            if sum != (0, 0, 0) {
                return Some(sum);
            }
            self.release_sender();
            let (i, o, u) = (
                self.input.load(SeqCst),
                self.output.load(SeqCst),
                self.usd_micros.load(SeqCst),
            );
            if (i, o, u) == (0, 0, 0) || !self.claim_sender() {
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_read_whole_or_not_at_all() {
        // Lua writes 15 digits or more in exponent form: a wait of years still reads.
        let reply = "120 3400 4 59000 0 0 3 1.2345678901234e+15 0 0";
        let answers = Answer::parse_reply(reply, 1).unwrap();
        let a = &answers[0];
        assert_eq!(a.refused, Some(Refusal::Requests));
        assert_eq!(a.retry_us, 59_000);
        assert_eq!(a.input, (3, 1_234_567_890_123_400));
        assert_eq!((a.day_micros, a.month_micros), (120, 3400));
        // Two admissions' worth, in order.
        let two = Answer::parse_reply("0 0 0 0 9 6 0 0 0 0 2 5 8 6 0 0 0 0", 2).unwrap();
        assert_eq!(
            two.iter()
                .map(|a| (a.refused, a.requests.0))
                .collect::<Vec<_>>(),
            [(None, 9), (Some(Refusal::InputTokens), 8)]
        );
        // A reply of the wrong length or with a word in it is no answer.
        assert!(Answer::parse_reply(reply, 2).is_none());
        assert!(Answer::parse_reply("0 0 0 0 x 6 0 0 0 0", 1).is_none());
    }

    proptest::proptest! {
        /// Redis is a network peer: whatever its reply says, it is read whole or refused,
        /// never a panic, and a reply of the right length gives one answer per admission.
        #[test]
        fn any_reply_is_read_whole_or_refused(
            text in "[0-9eE+. -]{0,80}|\\PC{0,40}",
            numbers in proptest::collection::vec(proptest::num::f64::ANY, 0..40),
            n in 0usize..5,
        ) {
            let _ = Answer::parse_reply(&text, n);
            // Numbers as Lua may write them (exponents, `inf`, `nan` included).
            let reply: Vec<String> = numbers.iter().map(|f| f.to_string()).collect();
            let parsed = Answer::parse_reply(&reply.join(" "), n);
            if numbers.len() == 2 + 8 * n {
                proptest::prop_assert_eq!(parsed.map(|a| a.len()), Some(n));
            } else {
                proptest::prop_assert!(parsed.is_none());
            }
        }
    }
}
