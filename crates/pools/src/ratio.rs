//! A ratio over a sliding window (the last 5 minutes), for gauges such as
//! `llm_cache_hit_ratio` and `speculative_acceptance_ratio`. Counters by result stay the
//! source of truth for PromQL; the gauge is what dashboards from the seeds read.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

const SLOTS: usize = 30;
const SLOT_SECONDS: u64 = 10;

/// 30 slots of 10 seconds, each a pair of counters tagged with the slot's epoch. Lock-free;
/// a slot is reset by whoever first writes in a new epoch (a racing increment may be lost
/// then, which a ratio can afford).
pub struct RatioWindow {
    slots: [Slot; SLOTS],
}

struct Slot {
    epoch: AtomicU64,
    yes: AtomicU64,
    all: AtomicU64,
}

impl Default for RatioWindow {
    fn default() -> Self {
        Self {
            slots: std::array::from_fn(|_| Slot {
                epoch: AtomicU64::new(0),
                yes: AtomicU64::new(0),
                all: AtomicU64::new(0),
            }),
        }
    }
}

impl RatioWindow {
    /// Counts one event and returns the ratio of `yes` events over the window.
    pub fn record(&self, yes: bool) -> f64 {
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / SLOT_SECONDS);
        if let Some(slot) = self.slots.get((epoch % SLOTS as u64) as usize) {
            if slot.epoch.swap(epoch, Relaxed) != epoch {
                slot.yes.store(0, Relaxed);
                slot.all.store(0, Relaxed);
            }
            slot.all.fetch_add(1, Relaxed);
            if yes {
                slot.yes.fetch_add(1, Relaxed);
            }
        }
        let (mut yes, mut all) = (0, 0);
        for s in &self.slots {
            if epoch.saturating_sub(s.epoch.load(Relaxed)) < SLOTS as u64 {
                yes += s.yes.load(Relaxed);
                all += s.all.load(Relaxed);
            }
        }
        if all == 0 {
            0.0
        } else {
            yes as f64 / all as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_counts_every_event_in_the_window() {
        let w = RatioWindow::default();
        assert_eq!(w.record(true), 1.0);
        w.record(false);
        w.record(false);
        assert_eq!(w.record(true), 0.5);
    }
}
