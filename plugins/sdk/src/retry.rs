//! Retries inside a pool on an upstream's 5xx or 429, with exponential backoff and jitter,
//! limited by a retry budget (as Envoy and Linkerd do), so that a sick pool cannot set off a
//! retry storm: each request earns the pool `budget_ratio` of a retry, each retry spends one,
//! and `min_retries` are always there to start with.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::time::Duration;

/// How a pool retries a request whose upstream answered 5xx or 429 before the client got a
/// byte: how often, within what budget, and with what backoff.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Further attempts in the same pool after a 5xx or 429; 0: none (the default, as nginx
    /// does not retry non-idempotent requests unless told to).
    pub max_retries: u32,
    /// Retries earned per request.
    pub budget_ratio: f64,
    /// Retries the budget starts with and never falls below in earning.
    pub min_retries: u32,
    /// The first backoff; each further retry doubles it (see [`RetryPolicy::backoff`]).
    pub backoff_base: Duration,
    /// The longest backoff.
    pub backoff_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 0,
            budget_ratio: 0.2,
            min_retries: 3,
            backoff_base: Duration::from_millis(25),
            backoff_max: Duration::from_millis(250),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `n` (1-based): `base × 2^(n-1)`, capped, with full
    /// jitter on its upper half so that clients retrying together spread out.
    pub fn backoff(&self, n: u32) -> Duration {
        let exp = self
            .backoff_base
            .saturating_mul(1 << n.saturating_sub(1).min(16))
            .min(self.backoff_max);
        exp / 2 + exp.mul_f64(fastrand::f64() / 2.0)
    }
}

/// Thousandths of a retry, so that fractional earnings add up in an integer atomic.
const UNIT: i64 = 1000;

/// A pool's retry budget: a token bucket fed by requests.
#[derive(Debug)]
pub struct RetryBudget {
    milli: AtomicI64,
    earn: i64,
    cap: i64,
}

impl RetryBudget {
    /// A budget holding `min_retries` to start with, and at most what 100 requests earn (never
    /// less than `min_retries`).
    pub fn new(policy: &RetryPolicy) -> Self {
        let floor = i64::from(policy.min_retries) * UNIT;
        Self {
            milli: AtomicI64::new(floor),
            earn: (policy.budget_ratio.clamp(0.0, 1.0) * UNIT as f64) as i64,
            // What a burst of 100 requests earns, and never less than the floor.
            cap: floor.max((policy.budget_ratio.clamp(0.0, 1.0) * 100.0) as i64 * UNIT),
        }
    }

    /// A request arrived: it earns its share of a retry.
    pub fn deposit(&self) {
        let _ = self
            .milli
            .fetch_update(Relaxed, Relaxed, |m| Some((m + self.earn).min(self.cap)));
    }

    /// Takes one retry from the budget, if there is one.
    pub fn try_spend(&self) -> bool {
        self.milli
            .fetch_update(Relaxed, Relaxed, |m| (m >= UNIT).then_some(m - UNIT))
            .is_ok()
    }

    /// Whether a retry is available now (without taking it).
    pub fn has_retry(&self) -> bool {
        self.milli.load(Relaxed) >= UNIT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_stay_within_the_ratio_plus_the_floor() {
        let budget = RetryBudget::new(&RetryPolicy::default());
        let mut retries = 0;
        for _ in 0..100 {
            budget.deposit();
            // A pool that fails everything: every request wants two retries.
            for _ in 0..2 {
                if budget.try_spend() {
                    retries += 1;
                }
            }
        }
        // 3 to start with + 20% of 100.
        assert!((20..=23).contains(&retries), "{retries}");
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let p = RetryPolicy::default();
        for _ in 0..50 {
            let first = p.backoff(1);
            assert!(first >= Duration::from_micros(12_500) && first <= Duration::from_millis(25));
            let late = p.backoff(10);
            assert!(late >= Duration::from_millis(125) && late <= Duration::from_millis(250));
        }
    }
}
