//! The token buckets: GCRA with debt, on a theoretical arrival time (TAT) in microseconds.
//!
//! A bucket of `limit` tokens per minute costs `60 s / limit` of TAT per token. It is full when
//! its TAT is at or before now, and a take of `n` fits while the TAT it leaves is at most one
//! minute ahead. Unlike governor's GCRA, the TAT may go further than a minute ahead (debt, from
//! a correction after the answer) and come back (a refund). The Lua scripts in
//! [`super::remote`] are this same arithmetic, line for line.

/// The window every limit is per: one minute, in microseconds.
pub(crate) const WINDOW_US: i64 = 60_000_000;

/// `a / b` rounded up, for `a >= 0` and `b > 0` (`i64::div_ceil` is not stable).
pub(crate) fn div_ceil(a: i64, b: i64) -> i64 {
    let b = b.max(1);
    a / b + i64::from(a % b > 0)
}

/// TAT charged for `n` tokens of a `limit`-per-minute bucket, rounded up to whole
/// microseconds (exact; saturates far beyond any real TAT). In u64 whenever the product
/// fits, which is any real count: a u128 division is a call into a software routine, and
/// an admission makes several.
pub(crate) fn cost(n: u64, limit: u64) -> i64 {
    let limit = limit.max(1);
    let us = match n.checked_mul(WINDOW_US as u64) {
        Some(product) => u128::from(product.div_ceil(limit)),
        None => (u128::from(n) * WINDOW_US as u128).div_ceil(u128::from(limit)),
    };
    i64::try_from(us).unwrap_or(i64::MAX / 4).min(i64::MAX / 4)
}

/// Whole tokens left in a bucket whose TAT is `tat` at `now`: 0 in debt.
pub(crate) fn remaining(tat: i64, now: i64, limit: u64) -> u64 {
    let used = tat.saturating_sub(now).max(0);
    if used >= WINDOW_US {
        return 0;
    }
    let free = u64::try_from(WINDOW_US - used).unwrap_or(0);
    match free.checked_mul(limit) {
        Some(product) => product / WINDOW_US as u64,
        None => u64::try_from(u128::from(free) * u128::from(limit) / WINDOW_US as u128)
            .unwrap_or(u64::MAX),
    }
}

/// A bucket's answer to a take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Take {
    pub ok: bool,
    /// The TAT to store if the admission goes ahead (unchanged when refused).
    pub tat: i64,
    /// Tokens left after the take (or, refused, now).
    pub remaining: u64,
    /// Microseconds until the bucket is full again.
    pub reset_us: i64,
    /// Refused: microseconds until the same take would fit (at least 1).
    pub retry_us: i64,
}

/// Takes `n` tokens at `now`. A take larger than the whole limit fits only a full bucket
/// (then leaves it in debt): refusing it for ever would leave a client that sends no
/// `max_tokens` nothing to back off to.
pub(crate) fn take(tat: i64, now: i64, n: u64, limit: u64) -> Take {
    let base = tat.max(now);
    let next = base.saturating_add(cost(n, limit));
    if next - now <= WINDOW_US || tat <= now {
        return Take {
            ok: true,
            tat: next,
            remaining: remaining(next, now, limit),
            reset_us: next - now,
            retry_us: 0,
        };
    }
    let retry = if n <= limit {
        next - WINDOW_US - now
    } else {
        tat - now
    };
    Take {
        ok: false,
        tat,
        remaining: remaining(tat, now, limit),
        reset_us: (tat - now).max(0),
        retry_us: retry.max(1),
    }
}

/// The TAT after correcting a take by `delta` tokens at `now`: more used than taken charges
/// it, into debt if need be; less refunds it, never past a full bucket.
pub(crate) fn adjust(tat: i64, now: i64, delta: i64, limit: u64) -> i64 {
    if delta > 0 {
        tat.max(now)
            .saturating_add(cost(delta.unsigned_abs(), limit))
    } else if delta < 0 && tat > now {
        (tat - cost(delta.unsigned_abs(), limit)).max(now)
    } else {
        tat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;

    #[test]
    fn a_full_bucket_gives_its_limit_then_refuses_until_it_refills() {
        let (mut tat, now) = (0, 10 * S);
        for left in (0..5).rev() {
            let t = take(tat, now, 200, 1000);
            assert!(t.ok);
            assert_eq!(t.remaining, left * 200);
            tat = t.tat;
        }
        let t = take(tat, now, 1, 1000);
        assert!(!t.ok);
        assert_eq!(t.remaining, 0);
        assert_eq!(t.reset_us, 60 * S);
        // One token refills in 60 ms.
        assert_eq!(t.retry_us, 60_000);
        assert!(take(tat, now + 60_000, 1, 1000).ok);
    }

    #[test]
    fn debt_waits_off_and_a_refund_restores() {
        let now = 0;
        let tat = take(0, now, 100, 1000).tat;
        // Used 3000 where 100 was estimated: two minutes of debt past the window.
        let owed = adjust(tat, now, 2900, 1000);
        assert_eq!(owed, 180 * S);
        let t = take(owed, now, 1, 1000);
        assert!(!t.ok);
        assert_eq!(t.retry_us, 120 * S + 60_000);
        // A refund of what was over-estimated: back to the single take of 100.
        let tat = take(0, now, 900, 1000).tat;
        assert_eq!(adjust(tat, now, -800, 1000), 6 * S);
        // Never past full.
        assert_eq!(adjust(tat, now, -5000, 1000), now);
    }

    #[test]
    fn the_u64_arithmetic_agrees_with_u128_on_both_sides_of_its_overflow() {
        let exact_cost = |n: u64, limit: u64| {
            let us = (u128::from(n) * WINDOW_US as u128).div_ceil(u128::from(limit.max(1)));
            i64::try_from(us).unwrap_or(i64::MAX / 4).min(i64::MAX / 4)
        };
        let exact_remaining = |free: i64, limit: u64| {
            let r = u128::from(free.unsigned_abs()) * u128::from(limit) / WINDOW_US as u128;
            u64::try_from(r).unwrap_or(u64::MAX)
        };
        let edge = u64::MAX / WINDOW_US as u64;
        let counts = [0, 1, 7, 999, 1_000_000, edge - 1, edge, edge + 1, u64::MAX];
        let limits = [0, 1, 3, 1000, 100_000_000, edge, edge + 1, u64::MAX];
        for n in counts {
            for limit in limits {
                assert_eq!(cost(n, limit), exact_cost(n, limit), "cost({n}, {limit})");
            }
        }
        for limit in limits {
            for free in [0, 1, 59_999_999, WINDOW_US] {
                let tat = WINDOW_US - free;
                assert_eq!(
                    remaining(tat, 0, limit),
                    exact_remaining(free, limit),
                    "remaining with {free} µs free of {limit}"
                );
            }
        }
    }

    #[test]
    fn a_take_larger_than_the_limit_fits_only_a_full_bucket() {
        let t = take(0, 0, 5000, 1000);
        assert!(t.ok);
        assert_eq!(t.remaining, 0);
        let again = take(t.tat, 0, 5000, 1000);
        assert!(!again.ok);
        // Retry when full again, not when 5000 would fit (never).
        assert_eq!(again.retry_us, 300 * S);
    }
}
