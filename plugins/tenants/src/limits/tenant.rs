//! One tenant's limits and the state kept in this process: the request limiter (governor),
//! the token buckets' TATs and the spend when the store is local, the concurrency count
//! always, and what Redis last said when it is not.

use super::budget::{self, micros, unix_now, usd, Spend, Windows};
use super::config::{BudgetConfig, BudgetMode, LimitsConfig};
use super::gcra;
use super::metrics;
use super::reply::{self, Reading, Readings, Refusal};
use super::{Backing, TenantUse, Usage, Want};
use governor::clock::Clock as _;
use governor::middleware::StateInformationMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use sluice_sdk::ErrorReply;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Monotonic time for the local limits, from the limiter's start: tokio's clock, so that a
/// test with paused time moves governor and the token buckets together.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    base: tokio::time::Instant,
}

impl Clock {
    pub(crate) fn new() -> Clock {
        Clock {
            base: tokio::time::Instant::now(),
        }
    }

    pub(crate) fn now_us(&self) -> i64 {
        i64::try_from(self.base.elapsed().as_micros()).unwrap_or(i64::MAX / 4)
    }
}

impl governor::clock::Clock for Clock {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        Nanos::new(u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}

type RequestLimiter = RateLimiter<NotKeyed, InMemoryState, Clock, StateInformationMiddleware>;

/// What the shared store said at this tenant's last admission through this replica.
#[derive(Debug, Clone, Default)]
pub(crate) struct RemoteSeen {
    pub readings: Readings,
    pub day_micros: u64,
    pub month_micros: u64,
}

#[derive(Debug, Default)]
struct Local {
    input_tat: i64,
    output_tat: i64,
    /// When the request limiter is full again (clock µs), as of its last answer: governor
    /// cannot be read without taking a cell, and admissions refused before reaching it
    /// still report the requests' headers.
    requests_full_at: i64,
    spend: Spend,
    remote: Option<RemoteSeen>,
}

pub(crate) struct TenantState {
    pub name: Arc<str>,
    pub limits: LimitsConfig,
    pub budget: BudgetConfig,
    /// The clock and the store, shared by every tenant.
    pub backing: Arc<Backing>,
    requests: Option<RequestLimiter>,
    in_flight: AtomicU32,
    /// Admissions waiting for the shared store, and corrections on their way to it (Redis
    /// only).
    pub queue: super::remote::Queue,
    pub unsent: super::remote::Unsent,
    /// Held only for arithmetic, never across an await: every check of one admission and
    /// its charge happen as one step, as the Lua script does in Redis.
    state: Mutex<Local>,
}

/// A request in flight, counted until dropped.
pub(crate) struct Slot(Arc<TenantState>);

impl Slot {
    pub(crate) fn tenant(&self) -> &Arc<TenantState> {
        &self.0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `used - charged`, as a signed correction.
fn delta(used: u64, charged: u64) -> i64 {
    let d = i128::from(used) - i128::from(charged);
    i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX })
}

/// A token bucket's limit and what taking from it would do; `None` when the tenant has no
/// such limit.
type Taken = Option<(u64, gcra::Take)>;

/// Takes `n` tokens from a bucket of `limit` a minute, at `tat`, without charging yet.
fn take_tokens(limit: Option<u64>, tat: i64, now: i64, n: u64) -> Taken {
    limit.map(|l| (l, gcra::take(tat, now, n, l)))
}

fn bucket_reading((limit, t): (u64, gcra::Take)) -> Reading {
    Reading {
        limit,
        remaining: t.remaining,
        reset_us: t.reset_us,
    }
}

/// Refuses when a token bucket is short: in the name of the first one (with the tokens it
/// was asked for), retried after the longest wait of all.
fn refuse_short_buckets(
    readings: &Readings,
    buckets: [(Refusal, Taken, u64); 2],
) -> Result<(), ErrorReply> {
    let refused = buckets
        .into_iter()
        .filter_map(|(r, t, n)| t.filter(|(_, t)| !t.ok).map(|(_, t)| (r, t.retry_us, n)));
    let mut first: Option<(Refusal, u64)> = None;
    let mut retry = 0;
    for (refusal, retry_us, wanted) in refused {
        first.get_or_insert((refusal, wanted));
        retry = retry.max(retry_us);
    }
    match first {
        Some((refusal, wanted)) => Err(reply::rate_limited(readings, refusal, wanted, retry)),
        None => Ok(()),
    }
}

impl TenantState {
    pub(crate) fn new(
        name: Arc<str>,
        limits: LimitsConfig,
        budget: BudgetConfig,
        backing: Arc<Backing>,
    ) -> TenantState {
        let requests = limits
            .requests_per_minute
            .and_then(NonZeroU32::new)
            .map(|n| {
                RateLimiter::direct_with_clock(Quota::per_minute(n), backing.clock)
                    .with_middleware::<StateInformationMiddleware>()
            });
        TenantState {
            name,
            limits,
            budget,
            backing,
            requests,
            in_flight: AtomicU32::new(0),
            queue: super::remote::Queue::default(),
            unsent: super::remote::Unsent::default(),
            state: Mutex::new(Local::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Local> {
        // The state is plain numbers, valid whatever a panicking holder left.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether an admission must ask the shared store anything.
    pub(crate) fn needs_store(&self) -> bool {
        self.limits.has_rates() || self.budget.is_set()
    }

    /// Counts one more request in flight, or refuses over `max_concurrent`.
    ///
    /// One add, taken back when over, rather than a read and a compare-and-swap: every
    /// worker thread writes this counter, and each access can move its cache line. At the
    /// limit, a request racing others being refused may see the count too high by as many
    /// and be refused too, and `/status` may show it over `max_concurrent` for that instant.
    pub(crate) fn enter(self: &Arc<Self>) -> Result<Slot, ErrorReply> {
        let max = self.limits.max_concurrent.unwrap_or(u32::MAX);
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        // Made at once: refused, it takes its count back as it drops, before the reply is
        // written.
        let slot = Slot(Arc::clone(self));
        if before < max {
            return Ok(slot);
        }
        drop(slot);
        Err(reply::too_many_in_flight(max))
    }

    /// The request limiter as of `now`, from its last answer.
    fn requests_reading(&self, local: &Local, now: i64) -> Option<Reading> {
        let limit = u64::from(self.limits.requests_per_minute?);
        let per = gcra::cost(1, limit).max(1);
        let to_full = (local.requests_full_at - now).max(0);
        let used = u64::try_from(gcra::div_ceil(to_full, per)).unwrap_or(u64::MAX);
        Some(Reading {
            limit,
            remaining: limit.saturating_sub(used),
            reset_us: to_full,
        })
    }

    /// Counts (and, enforced, refuses) an admission over a spent budget.
    fn over_budget(
        &self,
        day_micros: u64,
        month_micros: u64,
        windows: &Windows,
        readings: &Readings,
    ) -> Result<(), ErrorReply> {
        let Some((period, spent, limit)) = budget::spent(
            self.budget.usd_per_day,
            self.budget.usd_per_month,
            day_micros,
            month_micros,
        ) else {
            return Ok(());
        };
        let mode = self.budget.mode();
        metrics::budget_overrun(&self.name, mode.as_str());
        match mode {
            BudgetMode::Shadow => Ok(()),
            BudgetMode::Enforce => Err(reply::budget_exceeded(
                period,
                spent,
                limit,
                windows.left(period),
                readings,
            )),
        }
    }

    /// Every check of one admission against this process's state, charged only when all pass.
    pub(crate) fn admit_local(&self, want: Want) -> Result<Readings, ErrorReply> {
        let mut local = self.lock();
        let now = self.backing.clock.now_us();
        let input = take_tokens(
            self.limits.input_tokens_per_minute,
            local.input_tat,
            now,
            want.input_tokens,
        );
        let output = take_tokens(
            self.limits.output_tokens_per_minute,
            local.output_tat,
            now,
            want.output_tokens,
        );
        let mut readings = Readings {
            requests: self.requests_reading(&local, now),
            input: input.map(bucket_reading),
            output: output.map(bucket_reading),
        };
        // The budget first: once spent it refuses for hours, whatever the minute says.
        self.check_local_budget(&mut local, &readings)?;
        refuse_short_buckets(
            &readings,
            [
                (Refusal::InputTokens, input, want.input_tokens),
                (Refusal::OutputTokens, output, want.output_tokens),
            ],
        )?;
        // Requests last: governor takes its cell when it says yes, so nothing after it may
        // refuse.
        self.take_request(&mut local, now, &mut readings)?;
        if let Some((_, t)) = input {
            local.input_tat = t.tat;
        }
        if let Some((_, t)) = output {
            local.output_tat = t.tat;
        }
        Ok(readings)
    }

    /// Rolls this process's spend into the current windows and counts (and, enforced,
    /// refuses) an admission over a spent budget. The calendar is read only for a tenant
    /// with a budget.
    fn check_local_budget(&self, local: &mut Local, readings: &Readings) -> Result<(), ErrorReply> {
        if !self.budget.is_set() {
            return Ok(());
        }
        let windows = Windows::at(unix_now());
        local.spend.roll(&windows);
        let (day, month) = (local.spend.day_micros, local.spend.month_micros);
        self.over_budget(day, month, &windows, readings)
    }

    /// Takes a cell of the request limiter, if the tenant has one, and records when it is
    /// full again; `readings.requests` says what it has left, refused or not.
    fn take_request(
        &self,
        local: &mut Local,
        now: i64,
        readings: &mut Readings,
    ) -> Result<(), ErrorReply> {
        let (Some(limiter), Some(limit)) = (&self.requests, self.limits.requests_per_minute) else {
            return Ok(());
        };
        let limit = u64::from(limit);
        let per = gcra::cost(1, limit);
        match limiter.check() {
            Ok(state) => {
                let left = u64::from(state.remaining_burst_capacity());
                let to_full =
                    per.saturating_mul(i64::try_from(limit - left.min(limit)).unwrap_or(0));
                local.requests_full_at = now.saturating_add(to_full);
                readings.requests = Some(Reading {
                    limit,
                    remaining: left,
                    reset_us: to_full,
                });
                Ok(())
            }
            Err(not_until) => {
                let wait = not_until.wait_time_from(limiter.clock().now());
                let wait = i64::try_from(wait.as_micros())
                    .unwrap_or(i64::MAX / 4)
                    .max(1);
                // Full once the next cell is due and the rest of the burst refilled.
                let to_full =
                    wait.saturating_add(per.saturating_mul(i64::try_from(limit - 1).unwrap_or(0)));
                local.requests_full_at = now.saturating_add(to_full);
                readings.requests = Some(Reading {
                    limit,
                    remaining: 0,
                    reset_us: to_full,
                });
                Err(reply::rate_limited(readings, Refusal::Requests, 1, wait))
            }
        }
    }

    /// Corrects the local buckets from the usage, and adds its cost to the spend.
    pub(crate) fn settle_local(&self, charged: Want, usage: Usage) {
        let spend = micros(usage.usd);
        let (input, output) = self.token_corrections(charged, usage);
        // An estimate that was right and an answer that cost nothing: nothing to write.
        if input == 0 && output == 0 && spend == 0 {
            return;
        }
        let mut local = self.lock();
        let now = self.backing.clock.now_us();
        if let Some(limit) = self.limits.input_tokens_per_minute.filter(|_| input != 0) {
            local.input_tat = gcra::adjust(local.input_tat, now, input, limit);
        }
        if let Some(limit) = self.limits.output_tokens_per_minute.filter(|_| output != 0) {
            local.output_tat = gcra::adjust(local.output_tat, now, output, limit);
        }
        // Nothing to add (a cached answer, a pool without a price): no calendar to read.
        if spend > 0 {
            local.spend.add(&Windows::at(unix_now()), spend);
        }
    }

    /// The corrections to send to the shared store: (input, output, micro-dollars), zero for
    /// what the tenant does not limit.
    pub(crate) fn corrections(&self, charged: Want, usage: Usage) -> (i64, i64, u64) {
        let (input, output) = self.token_corrections(charged, usage);
        let usd = if self.budget.is_set() {
            micros(usage.usd)
        } else {
            0
        };
        (input, output, usd)
    }

    /// The token buckets' part of [`TenantState::corrections`]: (input, output).
    fn token_corrections(&self, charged: Want, usage: Usage) -> (i64, i64) {
        let input = self
            .limits
            .input_tokens_per_minute
            .map_or(0, |_| delta(usage.input_tokens, charged.input_tokens));
        let output = self
            .limits
            .output_tokens_per_minute
            .map_or(0, |_| delta(usage.output_tokens, charged.output_tokens));
        (input, output)
    }

    /// The verdict of the shared store's answer: counted, remembered for snapshots, and
    /// turned into headers or a refusal.
    pub(crate) fn decide_remote(
        &self,
        answer: &super::remote::Answer,
        want: Want,
    ) -> Result<Readings, ErrorReply> {
        let readings = answer.readings(&self.limits);
        self.lock().remote = Some(RemoteSeen {
            readings: readings.clone(),
            day_micros: answer.day_micros,
            month_micros: answer.month_micros,
        });
        if self.budget.is_set() {
            let windows = Windows::at(unix_now());
            self.over_budget(answer.day_micros, answer.month_micros, &windows, &readings)?;
        }
        match answer.refused {
            Some(Refusal::Requests) => Err(reply::rate_limited(
                &readings,
                Refusal::Requests,
                1,
                answer.retry_us,
            )),
            Some(r @ Refusal::InputTokens) => Err(reply::rate_limited(
                &readings,
                r,
                want.input_tokens,
                answer.retry_us,
            )),
            Some(r @ Refusal::OutputTokens) => Err(reply::rate_limited(
                &readings,
                r,
                want.output_tokens,
                answer.retry_us,
            )),
            None => Ok(readings),
        }
    }

    /// What /status shows of this tenant: exact for the local store, as last seen by this
    /// replica for Redis.
    pub(crate) fn snapshot(&self, windows: &Windows, shared: bool) -> TenantUse {
        let local = self.lock();
        let now = self.backing.clock.now_us();
        let (readings, day, month) = if shared {
            match &local.remote {
                Some(seen) => (
                    seen.readings.clone(),
                    Some(seen.day_micros),
                    Some(seen.month_micros),
                ),
                None => (Readings::default(), None, None),
            }
        } else {
            let mut spend = local.spend;
            spend.roll(windows);
            let bucket = |limit: Option<u64>, tat: i64| {
                limit.map(|limit| Reading {
                    limit,
                    remaining: gcra::remaining(tat, now, limit),
                    reset_us: (tat - now).max(0),
                })
            };
            (
                Readings {
                    requests: self.requests_reading(&local, now),
                    input: bucket(self.limits.input_tokens_per_minute, local.input_tat),
                    output: bucket(self.limits.output_tokens_per_minute, local.output_tat),
                },
                Some(spend.day_micros),
                Some(spend.month_micros),
            )
        };
        let remaining = |r: Option<Reading>| r.map(|r| r.remaining);
        // The shared store keeps no spend for tenants without a budget.
        let spend = |m: Option<u64>| m.filter(|_| !shared || self.budget.is_set()).map(usd);
        TenantUse {
            tenant: self.name.to_string(),
            store: if shared { "redis" } else { "local" },
            requests_per_minute: self.limits.requests_per_minute,
            requests_remaining: remaining(readings.requests),
            input_tokens_per_minute: self.limits.input_tokens_per_minute,
            input_tokens_remaining: remaining(readings.input),
            output_tokens_per_minute: self.limits.output_tokens_per_minute,
            output_tokens_remaining: remaining(readings.output),
            max_concurrent: self.limits.max_concurrent,
            in_flight: self.in_flight.load(Ordering::Acquire),
            usd_per_day: self.budget.usd_per_day,
            usd_spent_today: spend(day),
            usd_per_month: self.budget.usd_per_month,
            usd_spent_this_month: spend(month),
            budget_mode: self.budget.mode(),
        }
    }
}
