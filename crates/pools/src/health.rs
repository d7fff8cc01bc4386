//! The live state of each backend, as the request path reads it.
//!
//! Two writers feed it: the core's health service (active: it probes `/health` and scrapes
//! vLLM's `/metrics` on an interval, see `src/health/`) and the request path itself (passive:
//! connect failures and 5xx answers of real traffic eject a backend for a while). Readers,
//! the balancer, the KV breaker and the speculative selector, only load atomics and one
//! `ArcSwap`: no lock is taken on the request path.
//!
//! The passive part is also the per-backend failure breaker: *closed* while it answers,
//! *open* (ejected) for a cool-down after `consecutive_failures` failures, the cool-down
//! doubling on each repeated ejection up to a bound, then *half-open*: it gets traffic
//! again, and its first failure ejects it at once, while a success closes it.

use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

/// What one scrape of a backend's `/metrics` said.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    /// KV-cache usage, 0..=1 (`vllm:kv_cache_usage_perc`, or V0's `gpu_cache_usage_perc`).
    pub kv_usage: Option<f64>,
    /// Requests in the backend's running batches (`vllm:num_requests_running`); 0 when absent.
    pub running: f64,
    /// Requests queued for admission (`vllm:num_requests_waiting`); 0 when absent.
    pub waiting: f64,
    /// The KV cache's size in tokens (block size × GPU blocks), when vLLM publishes it.
    pub kv_capacity_tokens: Option<u64>,
    /// The speculative-decoding acceptance rate since the previous scrape.
    pub spec_acceptance: Option<f64>,
    /// The LoRA adapters in use, when the backend serves them.
    pub lora: Option<LoraSlots>,
    /// Prompt tokens the backend computed since it started (`vllm:prefix_cache_queries`
    /// less `hits`), when it says.
    pub computed_prompt_tokens: Option<f64>,
    /// What the engine's own histograms say of the requests it finished since the previous
    /// scrape, when it has them (vLLM V1) and some finished.
    pub engine: Option<EnginePhases>,
    /// When the scrape was read; once older than the pool's `stale_after`, it is stale.
    pub scraped_at: Instant,
}

/// The requests an engine finished between two scrapes, as its own phase histograms
/// (`vllm:request_queue_time_seconds`, `request_prefill_time_seconds`,
/// `request_prefill_kv_computed_tokens`) account for them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EnginePhases {
    /// How many finished.
    pub requests: f64,
    /// Their mean time in the engine's queue, before a step first scheduled them.
    pub queue_seconds: f64,
    /// Their time prefilling, from that step to the first token, summed.
    pub prefill_seconds: f64,
    /// The prompt tokens they computed (not served by the prefix cache), summed.
    pub computed_tokens: f64,
}

impl EnginePhases {
    /// The prefill speed the engine measured (tokens per second), when its prompts were
    /// large enough to tell (a fully cached prompt's one step says nothing of the speed).
    pub fn prefill_speed(&self) -> Option<f64> {
        let mean_tokens = self.computed_tokens / self.requests.max(1.0);
        (mean_tokens >= MIN_LEARNING_TOKENS as f64 && self.prefill_seconds > 0.0)
            .then(|| self.computed_tokens / self.prefill_seconds)
    }
}

/// What a LoRA-serving backend's `vllm:lora_requests_info` last said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraSlots {
    /// `--max-loras`: the adapters one batch may use at once.
    pub max_loras: u32,
    /// The adapters with requests in the engine (running or waiting: vLLM 0.32 does not
    /// tell them apart), each holding one of the `max_loras` slots.
    pub active: Vec<String>,
}

impl LoraSlots {
    /// Whether `adapter` has requests there now: it is loaded, and a request for it joins
    /// the batch at once.
    pub fn runs(&self, adapter: &str) -> bool {
        self.active.iter().any(|a| a == adapter)
    }

    /// Whether another adapter can join the batch without waiting for a slot.
    pub fn has_free_slot(&self) -> bool {
        self.active.len() < self.max_loras as usize
    }
}

/// Active health, from the health service's probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Probe {
    /// No probe has finished yet, or health checks are off: the backend is used.
    Unchecked = 0,
    /// Passed `healthy_after` probes in a row (the first good probe counts at once).
    Healthy = 1,
    /// Failed `unhealthy_after` probes in a row: no traffic.
    Unhealthy = 2,
}

/// What `/status` and the metrics show for a backend, worst first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendState {
    /// Failing its health probes: no traffic.
    Unhealthy,
    /// Ejected by passive outlier detection (the failure breaker is open): no traffic.
    Ejected,
    /// It asked for a pause (429 or 503 with `Retry-After`): no traffic until it is over.
    CoolingDown,
    /// Healthy, but its metrics are older than the pool's `stale_after` (or have no KV usage):
    /// the balancer counts it as saturated or as unknown, as the pool's `stale_as` says; the
    /// KV breaker decides for itself ([`crate::Pressure`]).
    Stale,
    /// Back from an ejection; its next answer decides (half-open).
    Probation,
    /// Passing its probes, with fresh metrics.
    Healthy,
    /// Not checked (health checks off, or none finished yet).
    Unchecked,
}

impl BackendState {
    /// The state's name in `/status` and in the `state` label of the backend metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Unhealthy => "unhealthy",
            BackendState::Ejected => "ejected",
            BackendState::Stale => "stale",
            BackendState::CoolingDown => "cooling_down",
            BackendState::Probation => "probation",
            BackendState::Healthy => "healthy",
            BackendState::Unchecked => "unchecked",
        }
    }

    /// Every state, worst first, so that each state's series can be set on every check.
    pub const ALL: [BackendState; 7] = [
        BackendState::Unhealthy,
        BackendState::Ejected,
        BackendState::CoolingDown,
        BackendState::Stale,
        BackendState::Probation,
        BackendState::Healthy,
        BackendState::Unchecked,
    ];
}

/// How a backend with stale metrics counts, for whoever reads its load: the pool's balancer
/// (`HealthPolicy::stale_as`) and the KV breaker each choose. Written in config files in
/// lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaleAs {
    /// As a full KV cache: the balancer avoids it (what the Kubernetes inference gateway
    /// does); a breaker that counts it so sees pressure.
    #[default]
    Saturated,
    /// As no information: the backend is balanced by its in-flight requests alone, and left
    /// out of the pool's usage.
    Unknown,
}

/// Active health checking of a pool's backends.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthPolicy {
    /// `false` for upstreams that are not vLLM: no probes or scrapes, so backends stay
    /// [`Probe::Unchecked`] and are always used (passive ejection still applies).
    pub enabled: bool,
    /// Time between two checks of each backend.
    pub interval: Duration,
    /// Bound of each probe and each scrape, connect included.
    pub timeout: Duration,
    /// Failed probes in a row that make a backend unhealthy.
    pub unhealthy_after: u32,
    /// Good probes in a row that bring it back.
    pub healthy_after: u32,
    /// Metrics older than this are stale.
    pub stale_after: Duration,
    /// How the balancer counts a stale backend's load. Not the breaker's: a monitoring
    /// problem must not shed a healthy pool unless its operator says so.
    pub stale_as: StaleAs,
    /// The liveness path (`/health`); any status but 200 is a failed probe.
    pub health_path: String,
    /// The Prometheus metrics path (`/metrics`) scraped for the backend's [`Load`].
    pub metrics_path: String,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: Duration::from_millis(250),
            timeout: Duration::from_millis(500),
            unhealthy_after: 2,
            healthy_after: 2,
            stale_after: Duration::from_secs(2),
            stale_as: StaleAs::Saturated,
            health_path: "/health".into(),
            metrics_path: "/metrics".into(),
        }
    }
}

/// Passive outlier detection: ejection on failures of real traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct OutlierPolicy {
    /// Failures in a row (connect errors, 5xx) that eject a backend; 0 turns ejection off.
    pub consecutive_failures: u32,
    /// The first ejection's length; each repeated one doubles it, up to `max_ejection`.
    pub base_ejection: Duration,
    /// The longest ejection; also how long a backend must stay clean before the doubling starts
    /// over.
    pub max_ejection: Duration,
    /// The largest share of a pool's backends (0..=100 %) ejected at once; one backend may
    /// always be, as in Envoy. A fault that fails every backend (a bad request pattern, a
    /// network blip) must not empty the pool.
    pub max_ejection_percent: u32,
}

impl Default for OutlierPolicy {
    fn default() -> Self {
        Self {
            consecutive_failures: 3,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(120),
            max_ejection_percent: 50,
        }
    }
}

/// What an attempt's result says about the backend's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It answered (any status below 500, 429 included: that is load, not a fault).
    Success,
    /// It refused the connection, timed out, or answered 5xx.
    Failure,
}

/// Milliseconds on a process-wide monotonic clock, for atomics.
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

fn now_ms() -> u64 {
    millis(EPOCH.elapsed())
}

/// Microseconds on the process clock (the prefill clock's unit).
#[cfg(not(test))]
fn now_us() -> u64 {
    u64::try_from(EPOCH.elapsed().as_micros()).unwrap_or(u64::MAX)
}

// Unit tests move the prefill clock themselves, so that a prediction does not drift while
// they look at it.
#[cfg(test)]
thread_local! {
    static TEST_CLOCK_US: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
fn now_us() -> u64 {
    TEST_CLOCK_US.with(std::cell::Cell::get)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whether an ejection lasting `until` (0: none) lets traffic through at `now`.
fn lets_through(until: u64, now: u64) -> bool {
    until == 0 || now >= until
}

/// One backend's live state. Shared by the health service, the pool and `/status`.
#[derive(Debug, Default)]
pub struct BackendLive {
    probe: AtomicU8,
    probe_streak: AtomicU32,
    load: ArcSwapOption<Load>,
    /// Requests sent, and their estimated tokens, since the last scrape: what the scraped
    /// numbers cannot show yet.
    sent_since_scrape: AtomicU32,
    tokens_since_scrape: AtomicU64,
    /// Requests in flight through this proxy, and the KV tokens they may come to need
    /// (prompt + output budget).
    in_flight: AtomicU32,
    committed_tokens: AtomicU64,
    /// This proxy's own accounting, exact where a scrape is up to an interval old and blind
    /// to a prefill the engine has not admitted yet: requests sent without their first byte
    /// back (outstanding prefill) and their prompt tokens; those past it (decoding) and the
    /// KV tokens they may come to hold.
    prefilling: AtomicU32,
    prefill_tokens: AtomicU64,
    decoding: AtomicU32,
    decode_tokens: AtomicU64,
    /// Requests with a prompt past their first byte (the engine has had them), their KV
    /// tokens, and how many of them came after the current scrape began: those before it
    /// that the engine no longer runs are finished there, however slowly their client reads
    /// (see [`BackendLive::finished_tokens`]).
    answered: AtomicU32,
    answered_tokens: AtomicU64,
    answered_since_scrape: AtomicU32,
    /// Counts the scrapes begun, so that a request knows whether it came after the current one.
    scrape_epoch: AtomicU64,
    /// A scrape began and its numbers are not in yet: the last ones do not cover what was
    /// answered since, so nothing counts as finished meanwhile.
    scraping: AtomicBool,
    /// The learned prefill speed in tokens per second (`f64` bits); 0 until seeded.
    prefill_speed: AtomicU64,
    /// TTFTs the speed was learned from.
    speed_samples: AtomicU64,
    /// Scrape intervals the engine's own prefill histograms taught the speed from.
    engine_speed_samples: AtomicU64,
    /// The fixed part of a time to first token, whatever the prompt (seconds, `f64` bits;
    /// 0: none learned): the engine's overhead per request and at least one scheduler step.
    base_ttft: AtomicU64,
    /// When the prefill this proxy has sent there is predicted to be done (µs on the
    /// process clock): the engine works through it in order at the learned speed, so a
    /// request sent now waits for what is left of it, not for prompts already part computed.
    prefill_clear_at_us: AtomicU64,
    /// How far first tokens have moved the clock (µs, signed, summed): a request's own
    /// predicted end moves with the corrections made after it was sent.
    prefill_clock_shift_us: AtomicI64,
    /// How long the wait the model predicts really lasts, as a factor (`f64` bits; 0: 1):
    /// learned from the first tokens of requests that had work ahead of them (see
    /// [`BackendLive::wait_scale`]).
    wait_scale: AtomicU64,
    /// TTFTs the wait's scale was learned from.
    wait_samples: AtomicU64,
    // The failure breaker.
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
    half_open: AtomicBool,
    /// The backend asked for a pause (a 429 or 503 with `Retry-After`): no traffic until
    /// then (ms on the process clock; 0: none). Load, not a fault: no ejection is counted.
    cooling_until_ms: AtomicU64,
    /// The model names its `/v1/models` last listed, for a pool that learns its models
    /// (`models: auto`) or a backend that serves LoRA adapters.
    served_models: ArcSwapOption<Vec<String>>,
    /// Of those, the LoRA adapters (listed with a `parent`).
    adapters: ArcSwapOption<Vec<String>>,
}

impl BackendLive {
    /// Records the model names the backend's `/v1/models` lists, and which of them are
    /// LoRA adapters.
    pub fn publish_models(&self, models: Vec<String>, adapters: Vec<String>) {
        self.served_models.store(Some(Arc::new(models)));
        self.adapters.store(Some(Arc::new(adapters)));
    }

    /// The LoRA adapters the backend last listed, if it was asked.
    pub fn adapters(&self) -> Option<Arc<Vec<String>>> {
        self.adapters.load_full()
    }

    /// Whether the backend lists the LoRA adapter `name`; `None` until it was asked.
    pub fn lists_adapter(&self, name: &str) -> Option<bool> {
        self.adapters
            .load()
            .as_deref()
            .map(|listed| listed.iter().any(|a| a == name))
    }

    /// The model names the backend last listed, if it was asked.
    pub fn served_models(&self) -> Option<Arc<Vec<String>>> {
        self.served_models.load_full()
    }

    /// The backend's active health, as its probes last decided it.
    pub fn probe(&self) -> Probe {
        match self.probe.load(Relaxed) {
            1 => Probe::Healthy,
            2 => Probe::Unhealthy,
            _ => Probe::Unchecked,
        }
    }

    /// Records one active probe; returns the new probe state when it changed.
    pub fn record_probe(&self, ok: bool, policy: &HealthPolicy) -> Option<Probe> {
        let current = self.probe();
        let agrees = matches!(
            (current, ok),
            (Probe::Healthy, true) | (Probe::Unhealthy, false)
        );
        if agrees {
            self.probe_streak.store(0, Relaxed);
            return None;
        }
        let streak = self.probe_streak.fetch_add(1, Relaxed) + 1;
        let next = match (current, ok) {
            // The first verdict on an unchecked backend is taken at once.
            (Probe::Unchecked, true) => Probe::Healthy,
            (Probe::Unchecked, false) if streak >= policy.unhealthy_after => Probe::Unhealthy,
            (Probe::Healthy, false) if streak >= policy.unhealthy_after => Probe::Unhealthy,
            (Probe::Unhealthy, true) if streak >= policy.healthy_after => Probe::Healthy,
            _ => return None,
        };
        self.probe.store(next as u8, Relaxed);
        self.probe_streak.store(0, Relaxed);
        Some(next)
    }

    /// A scrape of the backend's `/metrics` is being sent: requests answered from now on
    /// may not be in its numbers. Until [`BackendLive::publish_load`], nothing counts as
    /// finished (a failed scrape keeps it so until the next one succeeds).
    pub fn scrape_started(&self) {
        self.scraping.store(true, Relaxed);
        self.scrape_epoch.fetch_add(1, Relaxed);
        self.answered_since_scrape.store(0, Relaxed);
    }

    /// Publishes a scrape; what was sent before it is now in its numbers. The engine's own
    /// measure of its prefill speed, when the scrape has one, is learned.
    pub fn publish_load(&self, load: Load) {
        if let Some(engine) = &load.engine {
            self.learn_engine_prefill(engine);
        }
        self.load.store(Some(Arc::new(load)));
        self.sent_since_scrape.store(0, Relaxed);
        self.tokens_since_scrape.store(0, Relaxed);
        self.scraping.store(false, Relaxed);
    }

    /// The KV tokens this proxy has committed to requests the engine has finished but whose
    /// answer is still being read: a stream to a slow client is in flight here until its
    /// last byte is read, while vLLM frees its blocks as soon as it has generated it (a
    /// reader of 1 KB every 5 s kept a stream's reservation for minutes, and the breaker shed
    /// others on load that no longer existed).
    ///
    /// Only requests answered before the scrape began are weighed against it, since the
    /// engine had each of them by then (its first token came): at most `running + waiting`
    /// of them can still be there, and the rest are finished. Requests sent but not answered
    /// are never counted finished, so a burst in transit, which no scrape shows yet, keeps
    /// its whole reservation. Another proxy's requests only make the engine's count larger.
    /// Which of them finished is unknown: each is taken at the average reservation.
    fn finished_tokens(&self, load: &Load) -> f64 {
        if self.scraping.load(Relaxed) {
            return 0.0;
        }
        let answered = self.answered.load(Relaxed);
        let before_scrape = answered.saturating_sub(self.answered_since_scrape.load(Relaxed));
        let finished = (f64::from(before_scrape) - (load.running + load.waiting).max(0.0)).max(0.0);
        if finished <= 0.0 || answered == 0 {
            return 0.0;
        }
        finished * self.answered_tokens.load(Relaxed) as f64 / f64::from(answered)
    }

    /// The last scrape, however old; [`BackendLive::fresh_load`] gives one that is still current.
    pub fn load(&self) -> Option<Arc<Load>> {
        self.load.load_full()
    }

    /// Whether a scrape was ever published: a backend that joined the pool warms up until then.
    pub fn scraped(&self) -> bool {
        self.load.load().is_some()
    }

    /// The last scrape, if it is fresh.
    pub fn fresh_load(&self, policy: &HealthPolicy) -> Option<Arc<Load>> {
        self.load
            .load_full()
            .filter(|l| l.scraped_at.elapsed() <= policy.stale_after)
    }

    /// Whether the failure breaker lets traffic through now.
    fn breaker_allows(&self) -> bool {
        lets_through(self.ejected_until_ms.load(Relaxed), now_ms())
    }

    /// Whether the failure breaker has the backend out now.
    pub fn is_ejected(&self) -> bool {
        !self.breaker_allows()
    }

    /// Whether the backend may get a new request.
    pub fn is_usable(&self) -> bool {
        self.probe() != Probe::Unhealthy && self.breaker_allows() && !self.is_cooling()
    }

    /// Honours the backend's own back-pressure (a 429 or 503 with `Retry-After`): no new
    /// request goes to it for `pause`. A later, longer pause extends it; a shorter one does
    /// not shorten it.
    pub fn cool_down(&self, pause: Duration) {
        let until = now_ms().saturating_add(millis(pause)).max(1);
        self.cooling_until_ms.fetch_max(until, Relaxed);
    }

    /// Whether the backend asked for a pause that is not over.
    pub fn is_cooling(&self) -> bool {
        !lets_through(self.cooling_until_ms.load(Relaxed), now_ms())
    }

    /// The state `/status` and the metrics show: the worst that applies, with `policy` the pool's
    /// health config (for staleness).
    pub fn state(&self, policy: &HealthPolicy) -> BackendState {
        if self.probe() == Probe::Unhealthy {
            BackendState::Unhealthy
        } else if !self.breaker_allows() {
            BackendState::Ejected
        } else if self.is_cooling() {
            BackendState::CoolingDown
        } else if self.half_open.load(Relaxed) {
            BackendState::Probation
        } else if policy.enabled && self.probe() == Probe::Healthy && self.is_stale(policy) {
            BackendState::Stale
        } else if self.probe() == Probe::Healthy {
            BackendState::Healthy
        } else {
            BackendState::Unchecked
        }
    }

    fn is_stale(&self, policy: &HealthPolicy) -> bool {
        self.fresh_load(policy).is_none_or(|l| l.kv_usage.is_none())
    }

    /// Counts a request sent to this backend; the returned guard ends it. A request without
    /// a prompt (plain HTTP): see [`BackendLive::begin_request`].
    pub fn begin(self: &Arc<Self>, estimated_tokens: u64) -> InFlight {
        self.begin_request(estimated_tokens, 0)
    }

    /// Counts a request sent to this backend that may come to hold `estimated_tokens` KV
    /// tokens, `prompt_tokens` of them its prompt: in flight, and prefilling until
    /// [`InFlight::first_byte`]. The returned guard ends it, whenever it is dropped.
    pub fn begin_request(self: &Arc<Self>, estimated_tokens: u64, prompt_tokens: u64) -> InFlight {
        self.sent_since_scrape.fetch_add(1, Relaxed);
        self.tokens_since_scrape
            .fetch_add(estimated_tokens, Relaxed);
        self.in_flight.fetch_add(1, Relaxed);
        self.committed_tokens.fetch_add(estimated_tokens, Relaxed);
        // A TTFT teaches the speed only when nothing was ahead of the request: no prefill of
        // ours, and no queue of anyone's at the last scrape. Otherwise it measures the queue.
        let ahead = self.prefilling.fetch_add(1, Relaxed);
        self.prefill_tokens.fetch_add(prompt_tokens, Relaxed);
        let queue_was_empty = self.queue_was_empty();
        let (sent_us, own_us, prefill_done_at_us, clock_shift_us) =
            self.queue_prefill(ahead, prompt_tokens);
        InFlight {
            backend: Arc::clone(self),
            tokens: estimated_tokens,
            prompt_tokens,
            sent: Instant::now(),
            answered: false,
            alone: ahead == 0 && queue_was_empty,
            teaches: true,
            credit_known: true,
            speed_sample: None,
            predicted_ttft: None,
            predicted_wait: None,
            pool: None,
            answered_in_scrape: None,
            sent_us,
            own_us,
            prefill_done_at_us,
            clock_shift_us,
        }
    }

    /// Whether a request sent here now would find nothing ahead of it: no prefill of ours,
    /// and no queue at the last scrape. Only then does its first token teach the backend's
    /// prefill speed.
    pub fn nothing_ahead(&self) -> bool {
        self.prefilling.load(Relaxed) == 0 && self.queue_was_empty()
    }

    /// Whether the engine's queue was empty at the last scrape (or nothing was scraped).
    fn queue_was_empty(&self) -> bool {
        self.load.load().as_ref().is_none_or(|l| l.waiting <= 0.0)
    }

    /// Puts `prompt_tokens` of prefill on the backend's clock, behind the prefill still ahead
    /// (none when `ahead`, the requests of ours prefilling there, is 0). Returns the clock
    /// now, its own length, when it is predicted to be done, and the clock's shift then (µs).
    fn queue_prefill(&self, ahead: u32, prompt_tokens: u64) -> (u64, u64, u64, i64) {
        let now = now_us();
        let own_us = seconds_to_us(prompt_tokens as f64 / self.prefill_speed());
        let start = |clear: u64| if ahead == 0 { now } else { clear.max(now) };
        let clear = self
            .prefill_clear_at_us
            .fetch_update(Relaxed, Relaxed, |clear| {
                Some(start(clear).saturating_add(own_us))
            })
            .unwrap_or_else(|clear| clear);
        let done_at = start(clear).saturating_add(own_us);
        let shift = self.prefill_clock_shift_us.load(Relaxed);
        (now, own_us, done_at, shift)
    }

    /// The prefill of ours predicted still ahead of a request sent now, in seconds: 0 when
    /// nothing of ours is prefilling there.
    fn prefill_ahead_seconds(&self, prefilling: u32) -> f64 {
        if prefilling == 0 {
            return 0.0;
        }
        let clear = self.prefill_clear_at_us.load(Relaxed);
        clear.saturating_sub(now_us()) as f64 / 1e6
    }

    /// The fixed part of a time to first token here, in seconds (see `base_ttft`).
    pub fn base_ttft(&self) -> f64 {
        f64::from_bits(self.base_ttft.load(Relaxed))
    }

    /// Sets the prefill speed the backend starts from (tokens per second), unless it has one.
    pub fn seed_prefill_speed(&self, tokens_per_second: f64) {
        if tokens_per_second.is_finite() && tokens_per_second > 0.0 {
            let _ = self.prefill_speed.compare_exchange(
                0,
                tokens_per_second.to_bits(),
                Relaxed,
                Relaxed,
            );
        }
    }

    /// The learned prefill speed, tokens per second; [`DEFAULT_PREFILL_SPEED`] until seeded.
    pub fn prefill_speed(&self) -> f64 {
        match self.prefill_speed.load(Relaxed) {
            0 => DEFAULT_PREFILL_SPEED,
            bits => f64::from_bits(bits),
        }
    }

    /// How many TTFTs the speed was learned from.
    pub fn speed_samples(&self) -> u64 {
        self.speed_samples.load(Relaxed)
    }

    /// Learns from one TTFT: `tokens` prefilled in `seconds` with nothing ahead. The time
    /// is the fixed part ([`BackendLive::base_ttft`]) plus the tokens at the speed: each
    /// sample teaches the part it is mostly made of (a small prompt the fixed part, a large
    /// one the speed).
    fn learn_prefill(&self, tokens: u64, seconds: f64) {
        if !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let prefill = tokens as f64 / self.prefill_speed();
        let fixed_share = (1.0 - prefill / seconds).clamp(0.0, 1.0);
        let _ = self.base_ttft.fetch_update(Relaxed, Relaxed, |bits| {
            let base = f64::from_bits(bits);
            let sample = (seconds - prefill).max(0.0);
            let next = base + BASE_EWMA * fixed_share * (sample - base);
            Some(next.clamp(0.0, MAX_BASE_TTFT).to_bits())
        });
        if tokens < MIN_LEARNING_TOKENS {
            return;
        }
        // The prompt's own time: what the fixed part leaves, never less than a quarter.
        let own = (seconds - self.base_ttft()).max(seconds / 4.0);
        let observed = tokens as f64 / own;
        // Larger prompts teach more (a fixed overhead weighs less in them).
        let weight = SPEED_EWMA * (tokens as f64 / 1024.0).min(1.0);
        if self.learn_speed(observed, weight) {
            self.speed_samples.fetch_add(1, Relaxed);
        }
    }

    /// Moves the prefill speed toward `observed` tokens per second by `weight`.
    fn learn_speed(&self, observed: f64, weight: f64) -> bool {
        self.prefill_speed
            .fetch_update(Relaxed, Relaxed, |bits| {
                Some(next_speed(f64::from_bits(bits), observed, weight).to_bits())
            })
            .is_ok()
    }

    /// Learns the prefill speed from what the engine measured of the requests it finished
    /// since the last scrape: every request's, other proxies' included, with the tokens it
    /// really computed, and none of the fixed part or the queue that a first token seen
    /// here carries. It weighs as one full-size first token, so a pool whose answers never
    /// say what they computed (`kv_aware`, `round_robin`) learns its speed too.
    fn learn_engine_prefill(&self, engine: &EnginePhases) {
        let Some(observed) = engine.prefill_speed() else {
            return;
        };
        let weight = SPEED_EWMA * (engine.computed_tokens / 1024.0).min(1.0);
        if self.learn_speed(observed, weight) {
            self.engine_speed_samples.fetch_add(1, Relaxed);
        }
    }

    /// Takes `tokens_per_second` as its prefill speed when it has learned none of its own
    /// (no first token, no scrape has taught it): a pool's engines are alike, and a backend
    /// left at the seed while another has measured itself would look slower than it is, so
    /// that every request went to the one that measured.
    pub fn adopt_prefill_speed(&self, tokens_per_second: f64) {
        let unmeasured = self.speed_samples() == 0 && self.engine_speed_samples() == 0;
        if unmeasured && tokens_per_second.is_finite() && tokens_per_second > 0.0 {
            self.prefill_speed
                .store(tokens_per_second.to_bits(), Relaxed);
        }
    }

    /// How many scrape intervals the engine's histograms taught the speed from.
    pub fn engine_speed_samples(&self) -> u64 {
        self.engine_speed_samples.load(Relaxed)
    }

    /// Whether a request sent here now would queue inside the engine: this proxy's prefill
    /// still ahead there (on the backend's clock) is `hold_above_tokens` or more, or the
    /// last fresh scrape shows the engine's own queue (`num_requests_waiting`: its batch,
    /// its `max_num_seqs` or its KV cache is full) with fewer first tokens since than it held.
    pub fn queues(&self, hold_above_tokens: u64, policy: &HealthPolicy) -> bool {
        let own = self.accounting();
        // A request let in now reaches the engine's queue only after the fixed part of a
        // time to first token (its upload, the engine's front end): what is ahead must outlast
        // that too, or the engine runs dry between the two. An engine that prefills in no
        // time (all of its TTFT fixed) would otherwise take one request at a time.
        let lead = self.base_ttft();
        let ahead_seconds = (self.prefill_ahead_seconds(own.prefilling) - lead).max(0.0);
        let ahead = ahead_seconds * self.prefill_speed();
        if ahead.min(own.prefill_tokens as f64) >= hold_above_tokens as f64 {
            return true;
        }
        let waiting = self.fresh_load(policy).map_or(0.0, |l| l.waiting);
        waiting - f64::from(self.answered_since_scrape.load(Relaxed)) >= 1.0
    }

    /// This proxy's own load on the backend now (see [`Accounting`]).
    pub fn accounting(&self) -> Accounting {
        Accounting {
            prefilling: self.prefilling.load(Relaxed),
            prefill_tokens: self.prefill_tokens.load(Relaxed),
            decoding: self.decoding.load(Relaxed),
            decode_tokens: self.decode_tokens.load(Relaxed),
        }
    }

    /// The time to first token a request of `prompt_tokens`, `cached_tokens` of them taken to
    /// be in the backend's prefix cache, may expect here, in seconds: the fixed part every
    /// request takes ([`BackendLive::base_ttft`]), the wait ahead of it
    /// ([`BackendLive::wait_ahead`], weighed as the backend's first tokens taught,
    /// [`BackendLive::wait_tokens`]) and its own uncached tokens, at the learned prefill
    /// speed. No KV-cache or health judgement.
    pub fn predicted_ttft(
        &self,
        prompt_tokens: u64,
        cached_tokens: u64,
        policy: &HealthPolicy,
    ) -> f64 {
        let wait = self.wait_tokens(self.wait_ahead(prompt_tokens, policy));
        let mine = prompt_tokens.saturating_sub(cached_tokens) as f64;
        self.base_ttft() + (wait + mine) / self.prefill_speed()
    }

    /// The work ahead of a new request here: what is left of the uncached prompt tokens of
    /// every request this proxy sent and that has not had its first token (each counted with
    /// the hits expected for it when it was sent, on the backend's prefill clock: see
    /// `prefill_clear_at_us`), requests queued by others as the last fresh scrape shows them
    /// (taken to be of the size of ours, or of this one's `prompt_tokens` when we have none
    /// there), and the sequences decoding (chunked prefill shares each step with them).
    pub fn wait_ahead(&self, prompt_tokens: u64, policy: &HealthPolicy) -> Wait {
        let own = self.accounting();
        let (waiting, running) = self
            .load
            .load()
            .as_ref()
            .filter(|l| l.scraped_at.elapsed() <= policy.stale_after)
            .map_or((0.0, 0.0), |l| (l.waiting, l.running));
        // A scrape's queue beyond our own outstanding requests is someone else's traffic.
        let foreign = (waiting - f64::from(own.prefilling)).max(0.0);
        let typical = if own.prefilling > 0 {
            own.prefill_tokens as f64 / f64::from(own.prefilling)
        } else {
            prompt_tokens as f64
        };
        let left = self.prefill_ahead_seconds(own.prefilling) * self.prefill_speed();
        Wait {
            prefill_tokens: left.min(own.prefill_tokens as f64) + foreign * typical,
            decoding: f64::from(own.decoding).max(running),
        }
    }

    /// `wait` in prompt tokens at the prefill speed: the prefill ahead and a share of a step
    /// for each sequence decoding ([`DECODE_STEP_TOKENS`]), times what the backend's first
    /// tokens taught ([`BackendLive::wait_scale`]).
    pub fn wait_tokens(&self, wait: Wait) -> f64 {
        (wait.prefill_tokens + wait.decoding * DECODE_STEP_TOKENS) * self.wait_scale()
    }

    /// How long the predicted wait really lasts, as a factor learned from the first tokens
    /// of requests that had work ahead of them: what each took beyond its own prefill and
    /// the fixed part, over the wait predicted for it. 1 until learned. It absorbs what the
    /// model does not count (an engine's batch limits, steps shared with decodes, others'
    /// traffic between scrapes, an engine that lets a short prompt pass a long one).
    pub fn wait_scale(&self) -> f64 {
        match self.wait_scale.load(Relaxed) {
            0 => 1.0,
            bits => f64::from_bits(bits),
        }
    }

    /// How many first tokens the wait's scale was learned from.
    pub fn wait_samples(&self) -> u64 {
        self.wait_samples.load(Relaxed)
    }

    /// Learns the wait's scale from one first token: `seconds` after it was sent, behind the
    /// predicted `wait`, with `own_tokens` of its own to prefill.
    fn learn_wait(&self, wait: Wait, own_tokens: u64, seconds: f64) {
        let predicted = wait.prefill_tokens + wait.decoding * DECODE_STEP_TOKENS;
        let big_enough = predicted.is_finite() && predicted >= MIN_LEARNING_TOKENS as f64;
        if !big_enough || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let waited =
            ((seconds - self.base_ttft()) * self.prefill_speed() - own_tokens as f64).max(0.0);
        let observed = (waited / predicted).clamp(MIN_WAIT_SCALE, MAX_WAIT_SCALE);
        let weight = WAIT_EWMA * (predicted / 1024.0).min(1.0);
        let learned = self
            .wait_scale
            .fetch_update(Relaxed, Relaxed, |bits| {
                let current = match bits {
                    0 => 1.0,
                    bits => f64::from_bits(bits),
                };
                let next = current + weight * (observed - current);
                Some(next.clamp(MIN_WAIT_SCALE, MAX_WAIT_SCALE).to_bits())
            })
            .is_ok();
        if learned {
            self.wait_samples.fetch_add(1, Relaxed);
        }
    }

    /// Requests this proxy has in flight on the backend now (not other proxies').
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Feeds the failure breaker with one attempt's result. Returns the ejection's length
    /// when this result ejected the backend.
    pub fn record(&self, verdict: Verdict, policy: &OutlierPolicy) -> Option<Duration> {
        self.record_in_pool(verdict, policy, true)
    }

    /// [`BackendLive::record`], where the pool allows another ejection only when
    /// `may_eject` (its [`OutlierPolicy::max_ejection_percent`]): otherwise the failure is
    /// counted, and the backend stays in.
    pub fn record_in_pool(
        &self,
        verdict: Verdict,
        policy: &OutlierPolicy,
        may_eject: bool,
    ) -> Option<Duration> {
        match verdict {
            Verdict::Success => {
                self.failures.store(0, Relaxed);
                // Closed again; `decay_ejections` forgets the ejections once it stays good.
                // Not by an attempt that began before the ejection and ends during it: the
                // backend must still prove itself when the cool-down is over.
                if self.breaker_allows() {
                    self.half_open.store(false, Relaxed);
                }
                None
            }
            Verdict::Failure => {
                if policy.consecutive_failures == 0 {
                    return None;
                }
                let failures = self.failures.fetch_add(1, Relaxed) + 1;
                let probation = self.half_open.load(Relaxed) && self.breaker_allows();
                if (failures < policy.consecutive_failures && !probation) || !may_eject {
                    return None;
                }
                let previous = self.ejected_until_ms.load(Relaxed);
                let now = now_ms();
                if !lets_through(previous, now) {
                    return None; // Already ejected.
                }
                let n = self.ejections.load(Relaxed).min(16);
                let cool_down = policy
                    .base_ejection
                    .saturating_mul(1 << n)
                    .min(policy.max_ejection);
                let until = now.saturating_add(millis(cool_down));
                // Of failures recorded at the same moment, one ejects; the others see it done.
                if self
                    .ejected_until_ms
                    .compare_exchange(previous, until, Relaxed, Relaxed)
                    .is_err()
                {
                    return None;
                }
                self.ejections.fetch_add(1, Relaxed);
                self.failures.store(0, Relaxed);
                self.half_open.store(true, Relaxed);
                Some(cool_down)
            }
        }
    }

    /// Forgets past ejections once a backend has served well for `max_ejection`, so that a
    /// backend's cool-down grows only while it keeps failing. Called by the health service.
    pub fn decay_ejections(&self, policy: &OutlierPolicy) {
        let until = self.ejected_until_ms.load(Relaxed);
        let quiet = millis(policy.max_ejection);
        if !self.half_open.load(Relaxed)
            && until != 0
            && now_ms() >= until.saturating_add(quiet)
            // Not if a failure ejected the backend since the load above.
            && self
                .ejected_until_ms
                .compare_exchange(until, 0, Relaxed, Relaxed)
                .is_ok()
        {
            self.ejections.store(0, Relaxed);
        }
    }

    /// What the balancer and the breaker read of this backend, from one look at its last
    /// scrape.
    ///
    /// The projected KV usage, 0..=1 (more when oversubscribed), is the scraped usage plus
    /// what was sent since, or what this proxy has committed to the backend, whichever is
    /// larger: vLLM reports the blocks a request holds *now*, and a request keeps growing
    /// until its output budget is spent. `None` when nothing fresh is known; a backend whose
    /// probe passes without a fresh scrape is marked `stale`, and each reader decides what
    /// that means ([`Outlook::projected_kv_counting_stale`]).
    pub fn outlook(&self, policy: &HealthPolicy) -> Outlook {
        let guard = self.load.load();
        let fresh = guard
            .as_ref()
            .filter(|l| l.scraped_at.elapsed() <= policy.stale_after);
        let Some(load) = fresh else {
            return Outlook {
                stale: policy.enabled && self.probe() == Probe::Healthy,
                ..Outlook::default()
            };
        };
        let capacity = load.kv_capacity_tokens.filter(|c| *c > 0).map(|c| c as f64);
        let projected_kv = load.kv_usage.map(|usage| {
            let sent = f64::from(self.sent_since_scrape.load(Relaxed));
            match capacity {
                Some(capacity) => {
                    let committed = (self.committed_tokens.load(Relaxed) as f64
                        - self.finished_tokens(load))
                    .max(0.0)
                        / capacity;
                    let since = self.tokens_since_scrape.load(Relaxed) as f64 / capacity;
                    (usage + since).max(committed)
                }
                // Without the cache's size, a request is taken to need the average share of
                // the requests running now, or 2% of the cache when none runs.
                None if load.running > 0.0 => usage + sent * usage / load.running,
                None => usage + sent * 0.02,
            }
        });
        Outlook {
            projected_kv,
            stale: false,
            waiting: load.waiting,
            kv_capacity_tokens: capacity,
        }
    }

    /// The projected KV usage alone, from a fresh scrape (see [`BackendLive::outlook`]).
    pub fn projected_kv(&self, policy: &HealthPolicy) -> Option<f64> {
        self.outlook(policy).projected_kv
    }
}

/// A backend's load as the request path sees it (see [`BackendLive::outlook`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Outlook {
    /// Projected KV usage, 0..=1 (more when oversubscribed), from a fresh scrape; `None` when
    /// nothing fresh is known, a stale backend included.
    pub projected_kv: Option<f64>,
    /// The backend passes its probes but has no fresh scrape (health checks on): alive, its
    /// load unknown. How that counts is the reader's call.
    pub stale: bool,
    /// Requests in the backend's queue at the last fresh scrape.
    pub waiting: f64,
    /// The KV cache's size in tokens, from a fresh scrape.
    pub kv_capacity_tokens: Option<f64>,
}

impl Outlook {
    /// The projected usage, with a stale backend counted as `stale_as` says: full (1) when
    /// [`StaleAs::Saturated`], unknown (`None`) when [`StaleAs::Unknown`].
    pub fn projected_kv_counting_stale(&self, stale_as: StaleAs) -> Option<f64> {
        match (self.stale, stale_as) {
            (true, StaleAs::Saturated) => Some(1.0),
            _ => self.projected_kv,
        }
    }

    /// KV tokens still free after the projected usage (0 when oversubscribed); `None` unless both
    /// the usage and the cache's size are known.
    pub fn free_kv_tokens(&self) -> Option<f64> {
        Some((1.0 - self.projected_kv?).max(0.0) * self.kv_capacity_tokens?)
    }
}

/// A request in flight on a backend; dropping it ends the request's accounting.
#[derive(Debug)]
pub struct InFlight {
    backend: Arc<BackendLive>,
    tokens: u64,
    prompt_tokens: u64,
    sent: Instant,
    /// Its first byte came: it counts as decoding, not prefilling.
    answered: bool,
    /// Nothing was ahead of it there when it was sent (no prefill of this proxy's, no queue
    /// at the last scrape): its TTFT measures its own prefill, not a queue.
    alone: bool,
    /// Its first token teaches the backend nothing (a disaggregated decode leg: its time is
    /// the transfer's, not a prefill's or a queue's).
    teaches: bool,
    /// The part of its prompt the backend's cache serves is known (the exact index's
    /// credit, or none credited): `prompt_tokens` is what the engine computes.
    credit_known: bool,
    /// Its first token's time, kept until the engine says what it computed.
    speed_sample: Option<SpeedSample>,
    predicted_ttft: Option<f64>,
    /// The wait predicted ahead of it when it was sent, to learn the wait's weights from
    /// its first token.
    predicted_wait: Option<Wait>,
    pool: Option<Arc<str>>,
    /// The scrape during which a request with a prompt was answered (see
    /// [`BackendLive::finished_tokens`]).
    answered_in_scrape: Option<u64>,
    /// Its prefill's length on the backend's clock, when the clock put its end, and the
    /// clock's shift then (µs); when it was sent, on that clock.
    sent_us: u64,
    own_us: u64,
    prefill_done_at_us: u64,
    clock_shift_us: i64,
}

/// One request's time to first byte, and what was predicted for it.
#[derive(Debug, Clone, PartialEq)]
pub struct FirstByte {
    /// Seconds from the request being sent to its first byte.
    pub observed: f64,
    /// The prediction made when its backend was chosen, in seconds.
    pub predicted: Option<f64>,
}

impl InFlight {
    /// The backend the request is on.
    pub fn backend(&self) -> &BackendLive {
        &self.backend
    }

    /// Records what was predicted of the request's TTFT (seconds) and of the wait ahead of
    /// it ([`BackendLive::wait_ahead`]), and the pool it
    /// is counted under, to be compared with what it takes.
    pub fn predict(
        &mut self,
        predicted_ttft: Option<f64>,
        predicted_wait: Option<Wait>,
        pool: Arc<str>,
    ) {
        self.predicted_ttft = predicted_ttft;
        self.predicted_wait = predicted_wait;
        self.pool = Some(pool);
    }

    /// What its prefix cache serves is not known (the approximate affinity guessed), so the
    /// prompt's computed part is not: its TTFT teaches the prefill speed only if the engine
    /// says what it computed (see [`SpeedSample::learn`]).
    pub fn without_learning(&mut self) {
        self.credit_known = false;
    }

    /// The first token's time, to be learned from once the answer's usage says what the
    /// engine computed; `None` when it teaches nothing. Left in place, it is learned from the
    /// estimate when the request ends.
    pub fn take_speed_sample(&mut self) -> Option<SpeedSample> {
        self.speed_sample.take()
    }

    /// The request's prompt came from another engine (a disaggregated decode leg): its first
    /// token teaches the backend neither its speed, nor its wait, nor its prefill clock.
    pub fn transferred(&mut self) {
        self.teaches = false;
    }

    /// The pool given to [`InFlight::predict`].
    pub fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    /// The request's first byte came back: its prefill is over, it decodes now. When
    /// `is_first_token` (a streamed answer's first chunk, not a whole answer or an error),
    /// its time teaches the backend's prefill speed. Only the first call counts; it says
    /// what the wait was.
    pub fn first_byte(&mut self, is_first_token: bool) -> Option<FirstByte> {
        if self.answered {
            return None;
        }
        self.answered = true;
        let b = &self.backend;
        b.prefilling.fetch_sub(1, Relaxed);
        b.prefill_tokens.fetch_sub(self.prompt_tokens, Relaxed);
        b.decoding.fetch_add(1, Relaxed);
        b.decode_tokens.fetch_add(self.tokens, Relaxed);
        if self.tokens > 0 {
            self.answered_in_scrape = Some(b.scrape_epoch.load(Relaxed));
            b.answered.fetch_add(1, Relaxed);
            b.answered_tokens.fetch_add(self.tokens, Relaxed);
            b.answered_since_scrape.fetch_add(1, Relaxed);
        }
        let observed = self.sent.elapsed().as_secs_f64();
        if is_first_token && self.teaches {
            self.correct_clock(observed);
        }
        // With work ahead, the first token says how long the predicted wait really was
        // (its own prefill at the learned speed taken off); alone, how fast the backend is.
        if let (true, true, false, true, Some(wait)) = (
            is_first_token,
            self.teaches,
            self.alone,
            self.credit_known,
            self.predicted_wait,
        ) {
            b.learn_wait(wait, self.prompt_tokens, observed);
        }
        if is_first_token && self.alone && self.teaches {
            self.speed_sample = Some(SpeedSample {
                backend: Arc::clone(b),
                seconds: observed,
                estimated_computed: self.credit_known.then_some(self.prompt_tokens),
            });
        }
        Some(FirstByte {
            observed,
            predicted: self.predicted_ttft,
        })
    }
}

/// This proxy's own requests on a backend, from its accounting (exact, unlike a scrape).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accounting {
    /// Requests sent that have not produced their first byte.
    pub prefilling: u32,
    /// Their prompt tokens: the outstanding prefill.
    pub prefill_tokens: u64,
    /// Requests past their first byte, still in flight.
    pub decoding: u32,
    /// The KV tokens they may come to hold.
    pub decode_tokens: u64,
}

/// The prefill speed a backend starts from when its pool sets none (tokens per second):
/// a mid-size model on one current GPU.
pub const DEFAULT_PREFILL_SPEED: f64 = 10_000.0;

/// The smallest prompt whose TTFT teaches the speed (and the smallest predicted wait that
/// teaches the wait's scale): below it, fixed overheads dominate.
const MIN_LEARNING_TOKENS: u64 = 128;

/// The wait's scale stays within these: a model off by more is not saved by a factor.
const MIN_WAIT_SCALE: f64 = 0.25;
const MAX_WAIT_SCALE: f64 = 4.0;

/// The share of the speed estimate one full-size sample replaces.
const SPEED_EWMA: f64 = 0.2;

/// How far one sample may pull the estimate: at most this factor either way, so that one
/// stalled or cached request does not wreck it.
const SPEED_CLAMP: f64 = 4.0;

/// How much one first token moves the fixed part of the TTFT toward what it showed.
const BASE_EWMA: f64 = 0.1;

/// The largest fixed part of a TTFT believed (seconds): beyond it a sample measured a stall.
const MAX_BASE_TTFT: f64 = 2.0;

/// Seconds as whole µs (0 for what is not a finite positive number).
fn seconds_to_us(seconds: f64) -> u64 {
    if seconds.is_finite() && seconds > 0.0 {
        (seconds * 1e6).min(u64::MAX as f64) as u64
    } else {
        0
    }
}

/// Prefill tokens one decoding sequence is taken to cost a newcomer: decodes share the
/// engine's steps. Scaled by what the first tokens teach ([`BackendLive::wait_scale`]); a
/// weight of its own, fitted beside the prefill's, made the tail worse (tests/bench/RESULTS.md,
/// issue #52's section).
pub const DECODE_STEP_TOKENS: f64 = 16.0;

/// The share of the wait's scale one sample of a full-size wait replaces.
const WAIT_EWMA: f64 = 0.1;

/// The work a new request finds ahead of it on a backend (see [`BackendLive::wait_ahead`]
/// and [`BackendLive::wait_tokens`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Wait {
    /// Prompt tokens of prefill ahead: ours still on the clock, others' queued.
    pub prefill_tokens: f64,
    /// Sequences decoding there, each taking part of every step.
    pub decoding: f64,
}

/// The estimate after one `observed` sample of weight `weight`, from `current` (0: none
/// yet, so the sample is taken as it is).
fn next_speed(current: f64, observed: f64, weight: f64) -> f64 {
    if !current.is_finite() || current <= 0.0 {
        return observed;
    }
    let sample = observed.clamp(current / SPEED_CLAMP, current * SPEED_CLAMP);
    current + weight * (sample - current)
}

/// A streamed answer's time to first token on a backend where nothing was ahead of it: it
/// teaches the backend's prefill speed with the prompt tokens the engine computed, which only
/// its usage says exactly (`prompt_tokens` less `prompt_tokens_details.cached_tokens`: a
/// prefix cache hit is not prefill).
#[derive(Debug)]
pub struct SpeedSample {
    backend: Arc<BackendLive>,
    seconds: f64,
    /// The computed part as estimated when the request was sent; `None` when the prefix
    /// credit was a guess.
    estimated_computed: Option<u64>,
}

impl SpeedSample {
    /// Learns from the sample: with `engine`, the engine's own (prompt tokens, cached
    /// tokens); else with the estimate, when there is one.
    pub fn learn(self, engine: Option<(u64, u64)>) {
        let computed = match engine {
            Some((prompt, cached)) => Some(prompt.saturating_sub(cached)),
            None => self.estimated_computed,
        };
        if let Some(tokens) = computed {
            self.backend.learn_prefill(tokens, self.seconds);
        }
    }
}

impl InFlight {
    /// Its first token says where its prefill really ended (less the fixed part): the
    /// prefill still queued behind it moves by as much as its end was off, counting the
    /// corrections made since it was sent.
    fn correct_clock(&self, observed: f64) {
        let b = &self.backend;
        let ended =
            (self.sent_us + seconds_to_us(observed)).saturating_sub(seconds_to_us(b.base_ttft()));
        let since = b.prefill_clock_shift_us.load(Relaxed) - self.clock_shift_us;
        let predicted = self.prefill_done_at_us.saturating_add_signed(since);
        let off =
            i64::try_from(ended).unwrap_or(i64::MAX) - i64::try_from(predicted).unwrap_or(i64::MAX);
        b.prefill_clock_shift_us.fetch_add(off, Relaxed);
        let _ = b
            .prefill_clear_at_us
            .fetch_update(Relaxed, Relaxed, |clear| {
                Some(clear.saturating_add_signed(off))
            });
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(sample) = self.speed_sample.take() {
            sample.learn(None);
        }
        let b = &self.backend;
        b.in_flight.fetch_sub(1, Relaxed);
        b.committed_tokens.fetch_sub(self.tokens, Relaxed);
        if self.answered {
            b.decoding.fetch_sub(1, Relaxed);
            b.decode_tokens.fetch_sub(self.tokens, Relaxed);
        } else {
            // Ended before its first byte (an error, a cancel): its prefill is no longer
            // ahead of anyone.
            b.prefilling.fetch_sub(1, Relaxed);
            b.prefill_tokens.fetch_sub(self.prompt_tokens, Relaxed);
            let own_us = self.own_us;
            let _ = b
                .prefill_clear_at_us
                .fetch_update(Relaxed, Relaxed, |clear| Some(clear.saturating_sub(own_us)));
        }
        if let Some(epoch) = self.answered_in_scrape {
            b.answered.fetch_sub(1, Relaxed);
            b.answered_tokens.fetch_sub(self.tokens, Relaxed);
            if epoch == b.scrape_epoch.load(Relaxed) {
                // Saturating: a scrape may have begun (and reset the count) since the load.
                let _ = b
                    .answered_since_scrape
                    .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(kv: f64, capacity: Option<u64>) -> Load {
        Load {
            kv_usage: Some(kv),
            running: 4.0,
            waiting: 0.0,
            kv_capacity_tokens: capacity,
            spec_acceptance: None,
            lora: None,
            computed_prompt_tokens: None,
            engine: None,
            scraped_at: Instant::now(),
        }
    }

    #[test]
    fn probes_need_streaks_to_change_state() {
        let policy = HealthPolicy {
            unhealthy_after: 2,
            healthy_after: 3,
            ..HealthPolicy::default()
        };
        let b = BackendLive::default();
        assert_eq!(b.record_probe(true, &policy), Some(Probe::Healthy));
        assert_eq!(b.record_probe(false, &policy), None);
        assert_eq!(b.record_probe(true, &policy), None, "streak broken");
        assert_eq!(b.record_probe(false, &policy), None);
        assert_eq!(b.record_probe(false, &policy), Some(Probe::Unhealthy));
        assert!(!b.is_usable());
        assert_eq!(b.record_probe(true, &policy), None);
        assert_eq!(b.record_probe(true, &policy), None);
        assert_eq!(b.record_probe(true, &policy), Some(Probe::Healthy));
        assert!(b.is_usable());
    }

    #[test]
    fn failures_eject_with_growing_cool_downs_and_half_open_retries() {
        let policy = OutlierPolicy {
            consecutive_failures: 2,
            base_ejection: Duration::from_millis(40),
            max_ejection: Duration::from_millis(100),
            ..OutlierPolicy::default()
        };
        let b = BackendLive::default();
        assert_eq!(b.record(Verdict::Failure, &policy), None);
        assert_eq!(b.record(Verdict::Success, &policy), None, "streak reset");
        assert_eq!(b.record(Verdict::Failure, &policy), None);
        assert_eq!(
            b.record(Verdict::Failure, &policy),
            Some(Duration::from_millis(40))
        );
        assert!(!b.is_usable());
        assert_eq!(b.state(&HealthPolicy::default()), BackendState::Ejected);
        std::thread::sleep(Duration::from_millis(50));
        assert!(b.is_usable());
        assert_eq!(b.state(&HealthPolicy::default()), BackendState::Probation);
        // Half-open: one failure is enough, and the cool-down doubled.
        assert_eq!(
            b.record(Verdict::Failure, &policy),
            Some(Duration::from_millis(80))
        );
        std::thread::sleep(Duration::from_millis(90));
        assert_eq!(
            b.record(Verdict::Failure, &policy),
            Some(Duration::from_millis(100)),
            "capped"
        );
        std::thread::sleep(Duration::from_millis(110));
        assert_eq!(b.record(Verdict::Success, &policy), None);
        assert_eq!(b.state(&HealthPolicy::default()), BackendState::Unchecked);
    }

    /// Requests the engine no longer runs keep no reservation once a scrape begun after
    /// their first token shows it; requests in transit keep theirs whatever a scrape says.
    #[test]
    fn only_answered_requests_the_engine_no_longer_runs_are_released() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        let idle = |running| Load {
            running,
            ..load(0.0, Some(10_000))
        };
        b.scrape_started();
        b.publish_load(idle(0.0));
        let mut slow_reader = b.begin_request(5_000, 100);
        slow_reader.first_byte(true);
        let in_transit = b.begin_request(2_000, 100);
        assert_eq!(
            b.projected_kv(&policy),
            Some(0.7),
            "the scrape predates both"
        );

        // A scrape begun after the first token: until its numbers come, nothing changes.
        b.scrape_started();
        assert_eq!(b.projected_kv(&policy), Some(0.7));
        b.publish_load(idle(1.0));
        assert_eq!(
            b.projected_kv(&policy),
            Some(0.7),
            "the engine may still run it"
        );
        b.scrape_started();
        b.publish_load(idle(0.0));
        assert_eq!(
            b.projected_kv(&policy),
            Some(0.2),
            "finished at the engine; the request in transit keeps its 2,000 tokens"
        );
        drop(slow_reader);
        assert_eq!(b.projected_kv(&policy), Some(0.2));
        drop(in_transit);
        assert_eq!(b.projected_kv(&policy), Some(0.0));
    }

    #[test]
    fn failures_at_the_same_moment_eject_once() {
        let policy = OutlierPolicy {
            consecutive_failures: 1,
            base_ejection: Duration::from_secs(10),
            max_ejection: Duration::from_secs(100),
            ..OutlierPolicy::default()
        };
        let b = Arc::new(BackendLive::default());
        let start = Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (b, start, policy) = (b.clone(), start.clone(), policy.clone());
                std::thread::spawn(move || {
                    start.wait();
                    b.record(Verdict::Failure, &policy)
                })
            })
            .collect();
        let ejections: Vec<_> = threads
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(ejections, vec![Duration::from_secs(10)]);
        assert_eq!(
            b.ejections.load(Relaxed),
            1,
            "the next cool-down is 20 s, not more"
        );
    }

    #[test]
    fn a_success_that_ends_during_the_ejection_leaves_the_backend_on_probation() {
        let policy = OutlierPolicy {
            consecutive_failures: 1,
            base_ejection: Duration::from_millis(300),
            max_ejection: Duration::from_secs(10),
            ..OutlierPolicy::default()
        };
        let b = BackendLive::default();
        assert!(b.record(Verdict::Failure, &policy).is_some());
        // An attempt sent before the ejection answers well during it.
        assert_eq!(b.record(Verdict::Success, &policy), None);
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(b.state(&HealthPolicy::default()), BackendState::Probation);
        assert_eq!(
            b.record(Verdict::Failure, &policy),
            Some(Duration::from_millis(600)),
            "one failure on probation ejects again"
        );
    }

    #[test]
    fn projection_counts_what_was_sent_since_the_scrape() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        assert_eq!(b.projected_kv(&policy), None, "nothing known");
        b.publish_load(load(0.5, Some(10_000)));
        let first = b.begin(1_000);
        assert!((b.projected_kv(&policy).unwrap() - 0.6).abs() < 1e-9);
        // Committed tokens win when the scrape under-reports what requests will grow to.
        b.publish_load(load(0.05, Some(10_000)));
        let second = b.begin(8_000);
        assert!((b.projected_kv(&policy).unwrap() - 0.9).abs() < 1e-9);
        assert!((b.outlook(&policy).free_kv_tokens().unwrap() - 1_000.0).abs() < 1e-6);
        drop(first);
        drop(second);
        assert_eq!(b.in_flight(), 0);
        assert!((b.projected_kv(&policy).unwrap() - 0.85).abs() < 1e-9);
    }

    #[test]
    fn without_capacity_a_request_counts_as_the_running_average() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        b.publish_load(load(0.4, None));
        let _a = b.begin(0);
        let _b = b.begin(0);
        // 4 running hold 0.4: each new one is taken to add 0.1.
        assert!((b.projected_kv(&policy).unwrap() - 0.6).abs() < 1e-9);
    }

    #[test]
    fn stale_metrics_are_marked_and_count_as_the_reader_says() {
        let mut policy = HealthPolicy {
            stale_after: Duration::from_millis(10),
            ..HealthPolicy::default()
        };
        let b = BackendLive::default();
        b.record_probe(true, &policy);
        b.publish_load(load(0.1, None));
        assert_eq!(b.state(&policy), BackendState::Healthy);
        let fresh = b.outlook(&policy);
        assert!(!fresh.stale);
        assert_eq!(
            fresh.projected_kv_counting_stale(StaleAs::Saturated),
            Some(0.1)
        );
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(b.state(&policy), BackendState::Stale);
        let stale = b.outlook(&policy);
        assert!(stale.stale);
        // Whatever the pool's `stale_as`, the outlook itself claims nothing it does not know.
        assert_eq!(stale.projected_kv, None);
        assert_eq!(
            stale.projected_kv_counting_stale(StaleAs::Saturated),
            Some(1.0)
        );
        assert_eq!(stale.projected_kv_counting_stale(StaleAs::Unknown), None);
        assert_eq!(stale.free_kv_tokens(), None);
        policy.stale_as = StaleAs::Unknown;
        assert_eq!(
            b.outlook(&policy),
            stale,
            "the pool's setting does not change it"
        );
        assert!(b.is_usable(), "stale is not dead");
    }

    #[test]
    fn accounting_moves_from_prefill_to_decode_and_back_to_zero() {
        let b = Arc::new(BackendLive::default());
        let mut answered = b.begin_request(1_500, 1_000);
        let cancelled = b.begin_request(700, 200);
        assert_eq!(
            b.accounting(),
            Accounting {
                prefilling: 2,
                prefill_tokens: 1_200,
                decoding: 0,
                decode_tokens: 0
            }
        );
        assert!(answered.first_byte(false).is_some());
        assert!(answered.first_byte(false).is_none(), "counted once");
        assert_eq!(
            b.accounting(),
            Accounting {
                prefilling: 1,
                prefill_tokens: 200,
                decoding: 1,
                decode_tokens: 1_500
            }
        );
        drop(cancelled); // Before its first byte: a cancel or an error.
        drop(answered);
        assert_eq!(b.accounting(), Accounting::default());
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn the_speed_estimate_is_robust_and_converges() {
        // A wild sample moves the estimate by a bounded step only.
        let once = next_speed(10_000.0, 1e9, SPEED_EWMA);
        assert!(
            (once - 10_000.0 * (1.0 + SPEED_EWMA * 3.0)).abs() < 1e-6,
            "{once}"
        );
        let once = next_speed(10_000.0, 1.0, SPEED_EWMA);
        assert!(
            (once - 10_000.0 * (1.0 - SPEED_EWMA * 0.75)).abs() < 1e-6,
            "{once}"
        );
        // Steady samples bring it to the true speed from a seed far off.
        let mut speed = 2_000.0;
        for _ in 0..60 {
            speed = next_speed(speed, 50_000.0, SPEED_EWMA);
        }
        assert!((speed - 50_000.0).abs() < 500.0, "{speed}");

        let b = Arc::new(BackendLive::default());
        b.seed_prefill_speed(8_000.0);
        b.seed_prefill_speed(1.0);
        assert_eq!(b.prefill_speed(), 8_000.0, "seeded once");
        b.learn_prefill(2_048, 0.1); // 20,480 tokens/s
        assert!(b.prefill_speed() > 8_000.0);
        assert_eq!(b.speed_samples(), 1);
        b.learn_prefill(10, 0.0001); // Too small to say anything.
        assert_eq!(b.speed_samples(), 1);
    }

    #[test]
    fn the_engines_own_prefill_histograms_teach_the_speed() {
        let b = BackendLive::default();
        b.seed_prefill_speed(10_000.0);
        let scrape = |engine| Load {
            engine: Some(engine),
            ..load(0.1, None)
        };
        // 20 requests of 2,000 computed tokens each, 1 s of prefill in all: 40,000 tokens/s.
        let interval = EnginePhases {
            requests: 20.0,
            queue_seconds: 0.01,
            prefill_seconds: 1.0,
            computed_tokens: 40_000.0,
        };
        for _ in 0..30 {
            b.publish_load(scrape(interval));
        }
        assert!(
            (b.prefill_speed() - 40_000.0).abs() < 1_000.0,
            "{}",
            b.prefill_speed()
        );
        assert_eq!((b.engine_speed_samples(), b.speed_samples()), (30, 0));
        // Fully cached prompts (a few tokens computed each, one step each) teach nothing.
        b.publish_load(scrape(EnginePhases {
            computed_tokens: 200.0,
            ..interval
        }));
        assert_eq!(b.engine_speed_samples(), 30);
    }

    #[test]
    fn a_backend_that_measured_nothing_takes_a_peers_speed() {
        let measured = BackendLive::default();
        measured.seed_prefill_speed(10_000.0);
        measured.publish_load(Load {
            engine: Some(EnginePhases {
                requests: 4.0,
                queue_seconds: 0.0,
                prefill_seconds: 0.1,
                computed_tokens: 4_000.0,
            }),
            ..load(0.1, None)
        });
        let peer = BackendLive::default();
        peer.seed_prefill_speed(10_000.0);
        peer.adopt_prefill_speed(measured.prefill_speed());
        assert_eq!(peer.prefill_speed(), measured.prefill_speed());
        // Its own measure is never replaced.
        measured.adopt_prefill_speed(1_000.0);
        assert!(measured.prefill_speed() > 10_000.0);
    }

    #[test]
    fn only_a_first_token_with_nothing_ahead_teaches_the_speed() {
        let b = Arc::new(BackendLive::default());
        b.seed_prefill_speed(1_000.0);
        let mut first = b.begin_request(5_000, 4_000);
        let mut queued = b.begin_request(5_000, 4_000); // Behind the first one.
        std::thread::sleep(Duration::from_millis(5));
        queued.first_byte(true);
        assert_eq!(b.speed_samples(), 0, "its TTFT measured a queue");
        first.first_byte(false);
        assert_eq!(
            b.speed_samples(),
            0,
            "a whole answer or an error is no first token"
        );
        let mut clean = b.begin_request(5_000, 4_000);
        drop((first, queued));
        std::thread::sleep(Duration::from_millis(5));
        let waited = clean.first_byte(true).unwrap();
        assert!(waited.observed > 0.0);
        // Learned once the engine says what it computed: here its cache served all but 10
        // tokens, too few to say anything of the speed.
        assert_eq!(b.speed_samples(), 0);
        let sample = clean.take_speed_sample().unwrap();
        sample.learn(Some((4_000, 3_990)));
        assert_eq!(b.speed_samples(), 0, "a cache hit is no prefill");
        drop(clean);
        assert_eq!(b.speed_samples(), 0, "taken: learned once");
        // Without the engine's word, the estimate teaches when it is known...
        let mut estimated = b.begin_request(5_000, 4_000);
        estimated.first_byte(true);
        drop(estimated);
        assert_eq!(b.speed_samples(), 1);
        // ...and not when the prefix credit was a guess, unless the engine says.
        let mut guessed = b.begin_request(5_000, 4_000);
        guessed.without_learning();
        guessed.first_byte(true);
        let sample = guessed.take_speed_sample().unwrap();
        drop(guessed);
        sample.learn(None);
        assert_eq!(b.speed_samples(), 1);
        let mut guessed = b.begin_request(5_000, 4_000);
        guessed.without_learning();
        std::thread::sleep(Duration::from_millis(5));
        guessed.first_byte(true);
        guessed
            .take_speed_sample()
            .unwrap()
            .learn(Some((3_000, 1_000)));
        assert_eq!(b.speed_samples(), 2);
    }

    #[test]
    fn the_prediction_counts_the_backlog_and_the_cache() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        b.seed_prefill_speed(1_000.0);
        assert!((b.predicted_ttft(1_000, 0, &policy) - 1.0).abs() < 1e-9);
        assert!((b.predicted_ttft(1_000, 400, &policy) - 0.6).abs() < 1e-9);
        let _long = b.begin_request(10_000, 9_000);
        assert!((b.predicted_ttft(1_000, 0, &policy) - 10.0).abs() < 1e-9);
        // Two requests queued by someone else (the scrape's queue beyond our one).
        b.publish_load(Load {
            waiting: 3.0,
            running: 0.0,
            ..load(0.1, None)
        });
        let t = b.predicted_ttft(1_000, 0, &policy);
        assert!(
            (t - (9_000.0 + 2.0 * 9_000.0 + 1_000.0) / 1_000.0).abs() < 1e-9,
            "{t}"
        );
    }

    fn set_clock(us: u64) {
        TEST_CLOCK_US.with(|c| c.set(us));
    }

    #[test]
    fn the_backlog_drains_on_the_prefill_clock_and_first_tokens_correct_it() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        b.seed_prefill_speed(1_000.0);
        set_clock(1_000_000);
        let mut first = b.begin_request(3_000, 2_000); // 2 s of prefill
        let _second = b.begin_request(1_500, 1_000); // then 1 s more
        assert_eq!(b.wait_tokens(b.wait_ahead(0, &policy)), 3_000.0);
        // 1.5 s later the engine is part way through: 1.5 s of prefill is left, not 3.
        set_clock(2_500_000);
        assert!((b.wait_tokens(b.wait_ahead(0, &policy)) - 1_500.0).abs() < 1e-6);
        // The first request's first token comes 0.5 s late (at 3.5 s): what is behind it
        // is late by as much.
        set_clock(3_500_000);
        first.sent -= Duration::from_millis(2_500);
        first.first_byte(true);
        // (Within a token: the first token's time is read on the real clock. The first
        // request decodes now: a share of each step.)
        let wait = b.wait_tokens(b.wait_ahead(0, &policy));
        assert!(
            (wait - (1_000.0 + DECODE_STEP_TOKENS)).abs() < 1.0,
            "{wait}"
        );
        // Nothing of ours left prefilling: nothing ahead, whatever the clock says.
        drop((first, _second));
        assert_eq!(b.wait_tokens(b.wait_ahead(0, &policy)), 0.0);
        set_clock(0);
    }

    #[test]
    fn the_next_request_is_let_in_while_the_last_one_is_still_on_its_way() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        // An engine that takes about 18 ms whatever the prompt (the upload, its front end),
        // then 10,000 tokens a second.
        b.seed_prefill_speed(10_000.0);
        for _ in 0..400 {
            b.learn_prefill(16, 0.020);
        }
        let lead = b.base_ttft();
        assert!((lead - 0.0184).abs() < 0.001, "{lead}");
        set_clock(1_000_000);
        // 30 ms of prefill. Just sent: 30 ms ahead, 12 ms of it beyond the lead, 116 tokens
        // at the speed.
        let _sent = b.begin_request(600, 300);
        assert!(b.queues(100, &policy));
        // 15 ms later, 15 ms are ahead (150 tokens): less than a request let in now takes
        // to get there, so it is let in, and the engine does not run dry between the two.
        set_clock(1_015_000);
        assert!(!b.queues(100, &policy));
        set_clock(0);
    }

    #[test]
    fn lone_first_tokens_teach_the_fixed_part_and_the_speed_apart() {
        let policy = HealthPolicy::default();
        let b = BackendLive::default();
        // Seeded at half the real speed. The engine: 20 ms whatever the prompt, then
        // 10,000 tokens a second.
        b.seed_prefill_speed(5_000.0);
        for round in 0..400_u64 {
            let tokens = [16, 64, 256, 1_024, 4_096][(round % 5) as usize];
            b.learn_prefill(tokens, 0.020 + tokens as f64 / 10_000.0);
        }
        let (base, speed) = (b.base_ttft(), b.prefill_speed());
        assert!((base - 0.020).abs() < 0.003, "{base}");
        assert!((speed - 10_000.0).abs() < 800.0, "{speed}");
        // A small prompt is predicted at the fixed part, not at its few tokens.
        let t = b.predicted_ttft(64, 0, &policy);
        assert!((t - 0.0264).abs() < 0.004, "{t}");
    }

    #[test]
    fn first_tokens_behind_a_wait_teach_how_long_the_wait_really_is() {
        let policy = HealthPolicy::default();
        let b = Arc::new(BackendLive::default());
        b.seed_prefill_speed(1_000_000.0);
        assert_eq!(b.wait_scale(), 1.0);
        // 2,000 tokens ahead, predicted at 2 ms; each newcomer's first token comes after
        // 4 ms (its own 100 tokens aside): the wait was twice as long as predicted.
        let _ahead = b.begin_request(3_000, 2_000);
        for _ in 0..60 {
            let wait = b.wait_ahead(100, &policy);
            assert_eq!(wait.prefill_tokens, 2_000.0);
            let mut next = b.begin_request(200, 100);
            next.predict(Some(0.0021), Some(wait), Arc::from("p"));
            // Its first token, as if 4.1 ms had passed: set `sent` back.
            next.sent -= std::time::Duration::from_micros(4_100);
            assert!(next.first_byte(true).is_some());
        }
        assert_eq!(b.wait_samples(), 60);
        let scale = b.wait_scale();
        assert!((scale - 2.0).abs() < 0.1, "{scale}");
        // The prediction uses it: the 2,000 tokens ahead take the time of 4,000.
        let t = b.predicted_ttft(100, 0, &policy);
        assert!(
            (t - (2_000.0 * scale + 100.0) / 1_000_000.0).abs() < 1e-9,
            "{t}"
        );
        // A request alone teaches the speed, not the wait.
        let lone = Arc::new(BackendLive::default());
        let mut first = lone.begin_request(200, 100);
        first.predict(Some(0.001), Some(Wait::default()), Arc::from("p"));
        first.first_byte(true);
        assert_eq!(lone.wait_samples(), 0);
    }

    #[test]
    fn only_a_live_checked_backend_is_stale() {
        let policy = HealthPolicy::default();
        let b = BackendLive::default();
        assert!(!b.outlook(&policy).stale, "unchecked: nothing claimed");
        b.record_probe(true, &policy);
        assert!(b.outlook(&policy).stale, "alive, never scraped");
        let off = HealthPolicy {
            enabled: false,
            ..HealthPolicy::default()
        };
        assert!(!b.outlook(&off).stale, "health checks off");
    }
}
