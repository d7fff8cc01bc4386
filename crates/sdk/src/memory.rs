//! The process-wide budget of bytes held in memory on behalf of requests: request bodies read
//! whole, answers held back for judgement, cache writes queued for Redis. Each is bounded on
//! its own; the budget bounds them together, so that many large requests at once cannot take
//! the memory every other request needs. Whoever holds bytes takes them from the budget first
//! and gets a [`Held`] that gives them back when dropped; when the budget is spent the request
//! is refused (`503 memory-budget`) or the optional work skipped.

use crate::metric;
use crate::metrics::set_gauge;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

metric!(
    /// The bytes held now.
    BUFFERED: IntGauge = register_int_gauge!(
    "sluice_memory_buffered_bytes",
    "Bytes held in memory for requests (bodies, held answers, queued cache writes), \
     against limits.max_buffered_bytes."
));

/// The budget, shared by the core and the plugins.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
    /// A share ([`MemoryBudget::share`]) takes from the budget it is a share of, too.
    parent: Option<Arc<MemoryBudget>>,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
            parent: None,
        })
    }

    /// A share of this budget of at most `limit` bytes, for optional work (queued cache
    /// writes): what it holds is taken from this budget too, but it can never hold more than
    /// its share, so it cannot starve the requests.
    pub fn share(self: &Arc<Self>, limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.min(self.limit),
            used: AtomicUsize::new(0),
            parent: Some(Arc::clone(self)),
        })
    }

    /// The bytes it may hold at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Relaxed)
    }

    /// Whether `bytes` more would fit now (nothing is taken: see [`Held::grow`]).
    pub fn has_room_for(&self, bytes: usize) -> bool {
        self.used().saturating_add(bytes) <= self.limit
    }

    /// Nothing held yet, for what grows chunk by chunk ([`Held::grow`]).
    pub fn none(self: &Arc<Self>) -> Held {
        Held {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }

    /// Takes `bytes` from the budget; `None` when that would spend more than it has.
    pub fn take(self: &Arc<Self>, bytes: usize) -> Option<Held> {
        let mut held = self.none();
        held.grow(bytes).then_some(held)
    }

    fn add(&self, bytes: usize) -> bool {
        let taken = self.used.fetch_update(Relaxed, Relaxed, |used| {
            used.checked_add(bytes).filter(|after| *after <= self.limit)
        });
        let Ok(before) = taken else {
            return false;
        };
        match &self.parent {
            Some(parent) if !parent.add(bytes) => {
                self.used.fetch_sub(bytes, Relaxed);
                false
            }
            Some(_) => true,
            None => {
                set_gauge(&BUFFERED, before.saturating_add(bytes) as i64);
                true
            }
        }
    }

    fn give_back(&self, bytes: usize) {
        let before = self.used.fetch_sub(bytes, Relaxed);
        match &self.parent {
            Some(parent) => parent.give_back(bytes),
            None => set_gauge(&BUFFERED, before.saturating_sub(bytes) as i64),
        }
    }
}

/// Bytes taken from a [`MemoryBudget`], given back when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Held {
    /// Takes `more` bytes; `false` (and nothing taken) when the budget has not got them.
    #[must_use]
    pub fn grow(&mut self, more: usize) -> bool {
        let ok = self.budget.add(more);
        if ok {
            self.bytes += more;
        }
        ok
    }

    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_never_overspent_and_held_bytes_come_back() {
        let budget = MemoryBudget::new(100);
        let a = budget.take(60).unwrap();
        assert!(budget.take(50).is_none(), "60 + 50 > 100");
        let mut b = budget.none();
        assert!(b.grow(40));
        assert!(!b.grow(1), "full");
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        assert!(b.grow(60));
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_share_holds_no_more_than_its_limit_and_counts_in_the_whole() {
        let budget = MemoryBudget::new(100);
        let share = budget.share(25);
        let a = share.take(20).unwrap();
        assert_eq!(budget.used(), 20, "taken from the whole too");
        assert!(share.take(10).is_none(), "over the share");
        assert!(
            budget.take(80).is_some_and(|b| b.bytes() == 80),
            "the rest is the requests'"
        );
        let whole = budget.take(80).unwrap();
        assert!(share.take(1).is_none(), "nor over the whole");
        assert_eq!(
            share.used(),
            20,
            "a refused take leaves the share as it was"
        );
        drop((a, whole));
        assert_eq!((budget.used(), share.used()), (0, 0));
    }
}
