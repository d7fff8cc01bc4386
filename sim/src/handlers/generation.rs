//! One admitted request's generation: when its tokens are due (the latency model) and what it
//! reports (metrics and stats).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::faults::Faults;
use crate::metrics::Ended;
use crate::text::Finish;
use crate::Shared;

/// Stands in for "forever" where a delay would overflow `Duration`.
const A_DAY: Duration = Duration::from_secs(86_400);

/// Per-request timing and accounting; counts an abort if dropped before finishing.
pub struct Generation {
    shared: Arc<Shared>,
    started: Instant,
    last_token: Option<Instant>,
    generated: u64,
    finished: bool,
    slowdown: f64,
    jitter: f64,
    zero_latency: bool,
}

impl Generation {
    pub fn new(shared: Arc<Shared>, started: Instant, faults: &Faults) -> Self {
        let latency = &shared.config.latency;
        Generation {
            slowdown: faults.slowdown_factor(),
            jitter: latency.jitter.clamp(0.0, 1.0),
            zero_latency: latency.is_zero(),
            shared,
            started,
            last_token: None,
            generated: 0,
            finished: false,
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Zero-latency mode never sleeps (and the non-stream path skips the per-token loop).
    pub fn is_zero_latency(&self) -> bool {
        self.zero_latency
    }

    /// `base` scaled by the jitter draw and the fault slowdown.
    fn delay(&self, base: Duration) -> Duration {
        if self.zero_latency || base.is_zero() {
            return Duration::ZERO;
        }
        let jitter_factor = if self.jitter > 0.0 {
            1.0 + self.jitter * (2.0 * rand::random::<f64>() - 1.0)
        } else {
            1.0
        };
        // Capped so an absurd slowdown cannot overflow Duration (mul_f64 would panic).
        let factor = (self.slowdown * jitter_factor).clamp(0.0, 1e6);
        Duration::try_from_secs_f64(base.as_secs_f64() * factor).unwrap_or(A_DAY)
    }

    /// Time to prefill `tokens` (the TTFT of a prompt, or the recompute after a preemption).
    pub fn prefill_delay(&self, tokens: u32) -> Duration {
        let latency = &self.shared.config.latency;
        let prefill = latency
            .prefill_per_token
            .checked_mul(tokens)
            .unwrap_or(A_DAY);
        self.delay(latency.overhead.saturating_add(prefill))
    }

    /// Prefills `tokens`: waits out [`Generation::prefill_delay`], after the prefills ahead
    /// of it when the instance prefills one request at a time.
    pub async fn prefill(&self, tokens: u32) {
        let delay = self.prefill_delay(tokens);
        if delay.is_zero() {
            return;
        }
        let _turn = if self.shared.config.serial_prefill {
            Some(self.shared.prefill_turn.lock().await)
        } else {
            None
        };
        tokio::time::sleep(delay).await;
    }

    pub fn inter_token_delay(&self) -> Duration {
        self.delay(self.shared.config.latency.inter_token)
    }

    pub fn count_prompt(&self, tokens: u64) {
        self.shared
            .metrics
            .prompt_tokens
            .fetch_add(tokens, Ordering::Relaxed);
    }

    /// `tokens` tokens were produced in one engine step (one per running choice).
    pub fn step(&mut self, tokens: u64) {
        let now = Instant::now();
        let metrics = &self.shared.metrics;
        match self.last_token {
            None => metrics
                .ttft
                .observe(now.saturating_duration_since(self.started).as_secs_f64()),
            Some(previous) => metrics
                .itl
                .observe(now.saturating_duration_since(previous).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.generated += tokens;
        metrics
            .generation_tokens
            .fetch_add(tokens, Ordering::Relaxed);
    }

    pub fn finish(&mut self, how: Finish) {
        let metrics = &self.shared.metrics;
        metrics.e2e.observe(self.started.elapsed().as_secs_f64());
        metrics.ended(Ended::Finished(how), self.generated);
        self.shared.stats.count_completed();
        self.finished = true;
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.metrics.ended(Ended::Abort, self.generated);
        }
    }
}

pub async fn sleep(duration: Duration) {
    if !duration.is_zero() {
        tokio::time::sleep(duration).await;
    }
}
