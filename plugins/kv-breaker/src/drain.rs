//! How fast a pool's KV usage is falling, for `retry-after`: an exponentially weighted rate
//! over samples at least a quarter second apart, kept in atomics (read on the request path).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::LazyLock;
use std::time::Instant;

/// Samples closer than this are not compared: scrapes come every 250 ms by default.
const MIN_SPACING_MS: u64 = 250;
/// Weight of the newest rate in the moving average.
const NEW_WEIGHT: f64 = 0.5;

#[derive(Debug, Default)]
pub struct Drain {
    /// The last sample, as `f64` bits, and when it was taken (ms on the process clock, 0:
    /// none yet).
    usage: AtomicU64,
    at_ms: AtomicU64,
    /// Usage falling per second (negative: rising), as `f64` bits; NaN: not known yet.
    rate: AtomicU64,
}

fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    // +1 so that 0 keeps meaning "no sample".
    u64::try_from(EPOCH.elapsed().as_millis()).unwrap_or(u64::MAX) + 1
}

impl Drain {
    pub fn observe(&self, usage: f64) {
        self.observe_at(usage, now_ms());
    }

    fn observe_at(&self, usage: f64, now: u64) {
        let last = self.at_ms.load(Relaxed);
        if last != 0 && now < last + MIN_SPACING_MS {
            return;
        }
        // One caller per interval updates; the others keep their hands off.
        if self
            .at_ms
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_err()
        {
            return;
        }
        let previous = f64::from_bits(self.usage.swap(usage.to_bits(), Relaxed));
        if last == 0 {
            self.rate.store(f64::NAN.to_bits(), Relaxed);
            return;
        }
        let seconds = (now - last) as f64 / 1000.0;
        let newest = (previous - usage) / seconds;
        let old = f64::from_bits(self.rate.load(Relaxed));
        let rate = if old.is_nan() {
            newest
        } else {
            old * (1.0 - NEW_WEIGHT) + newest * NEW_WEIGHT
        };
        self.rate.store(rate.to_bits(), Relaxed);
    }

    /// Seconds until `usage` falls to `target` at the recent rate; `None` when the pool is
    /// not draining (or nothing is known yet).
    pub fn seconds_to_reach(&self, usage: f64, target: f64) -> Option<f64> {
        if usage <= target {
            return Some(0.0);
        }
        if self.at_ms.load(Relaxed) == 0 {
            return None;
        }
        let rate = f64::from_bits(self.rate.load(Relaxed));
        (rate > 0.0).then(|| (usage - target) / rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draining_pool_gives_a_finite_wait_and_a_filling_one_none() {
        let d = Drain::default();
        assert_eq!(d.seconds_to_reach(0.9, 0.8), None, "nothing known");
        d.observe_at(0.95, 1);
        d.observe_at(0.94, 100); // too close: ignored
        d.observe_at(0.90, 1001); // 0.05 in 1 s
        let wait = d.seconds_to_reach(0.90, 0.80).unwrap();
        assert!((wait - 2.0).abs() < 1e-9, "{wait}");
        assert_eq!(d.seconds_to_reach(0.7, 0.8), Some(0.0));
        d.observe_at(0.99, 2001); // filling again
        d.observe_at(1.05, 3001);
        assert_eq!(d.seconds_to_reach(1.05, 0.8), None);
    }
}
