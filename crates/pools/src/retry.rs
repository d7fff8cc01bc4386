//! Retries inside a pool, as nginx's `proxy_next_upstream` configures them: on the failures
//! the operator lists ([`RetryOn`]: an error status, a first-byte timeout), with exponential
//! backoff and jitter, limited by a retry budget (as Envoy and Linkerd do), so that a sick
//! pool cannot set off a retry storm: each request earns the pool `budget_ratio` of a retry,
//! each retry spends one, and `min_retries` are always there to start with.
//!
//! Failures the upstream cannot have acted on (a refused or failed connect, a reused
//! connection found dead before any answer byte) are not in this policy: they always go to
//! another backend, free of the budget, since the fleet did no work for them.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::time::Duration;

/// Which failures a pool retries, nginx's `proxy_next_upstream` conditions: a set of
/// [`RetryOn::TIMEOUT`] and the `HTTP_*` statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryOn(u8);

impl RetryOn {
    /// No first byte within the pool's `timeouts.first_byte`. Not in the default: the backend
    /// may be generating the answer, which a retry then asks for twice.
    pub const TIMEOUT: RetryOn = RetryOn(1);
    /// An answer with status 500.
    pub const HTTP_500: RetryOn = RetryOn(1 << 1);
    /// An answer with status 502.
    pub const HTTP_502: RetryOn = RetryOn(1 << 2);
    /// An answer with status 503.
    pub const HTTP_503: RetryOn = RetryOn(1 << 3);
    /// An answer with status 504.
    pub const HTTP_504: RetryOn = RetryOn(1 << 4);
    /// An answer with status 429.
    pub const HTTP_429: RetryOn = RetryOn(1 << 5);
    /// No condition.
    pub const NONE: RetryOn = RetryOn(0);

    /// Every condition, by its name in config files.
    pub const NAMED: [(&'static str, RetryOn); 6] = [
        ("timeout", RetryOn::TIMEOUT),
        ("http_500", RetryOn::HTTP_500),
        ("http_502", RetryOn::HTTP_502),
        ("http_503", RetryOn::HTTP_503),
        ("http_504", RetryOn::HTTP_504),
        ("http_429", RetryOn::HTTP_429),
    ];

    /// The condition named `name` in a config file.
    pub fn named(name: &str) -> Option<RetryOn> {
        Self::NAMED
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, on)| *on)
    }

    /// Both sets.
    #[must_use]
    pub fn with(self, other: RetryOn) -> RetryOn {
        RetryOn(self.0 | other.0)
    }

    /// Whether every condition of `other` is in the set.
    pub fn contains(self, other: RetryOn) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether an answer with `status` is retried.
    pub fn status(self, status: u16) -> bool {
        let on = match status {
            500 => RetryOn::HTTP_500,
            502 => RetryOn::HTTP_502,
            503 => RetryOn::HTTP_503,
            504 => RetryOn::HTTP_504,
            429 => RetryOn::HTTP_429,
            _ => return false,
        };
        self.contains(on)
    }
}

impl Default for RetryOn {
    /// The error statuses an overloaded or failing server answers with; a retry goes to
    /// another backend (or the same one after the backoff).
    fn default() -> Self {
        RetryOn::HTTP_500
            .with(RetryOn::HTTP_502)
            .with(RetryOn::HTTP_503)
            .with(RetryOn::HTTP_504)
            .with(RetryOn::HTTP_429)
    }
}

/// How a pool retries a request that failed before the client got a byte: on which failures,
/// how often, within what budget, and with what backoff.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Further attempts in the same pool after a failure in `on`; 0: none (the default, as
    /// nginx does not retry non-idempotent requests unless told to).
    pub max_retries: u32,
    /// The failures that are retried.
    pub on: RetryOn,
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
            on: RetryOn::default(),
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
    fn conditions_are_named_as_nginx_names_them() {
        let on = RetryOn::named("http_503")
            .unwrap()
            .with(RetryOn::named("timeout").unwrap());
        assert!(on.status(503));
        assert!(!on.status(502));
        assert!(!on.status(501), "statuses outside the list never retry");
        assert!(on.contains(RetryOn::TIMEOUT));
        assert!(RetryOn::named("error").is_none());
        let default = RetryOn::default();
        assert!([500, 502, 503, 504, 429].iter().all(|s| default.status(*s)));
        assert!(!default.contains(RetryOn::TIMEOUT));
        assert!(!RetryOn::NONE.status(500));
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
