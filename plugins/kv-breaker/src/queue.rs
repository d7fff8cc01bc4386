//! A pool's admission queue: a request the pool cannot admit now waits, bounded in time and
//! in number, for capacity to come back, instead of being shed at once. A short burst is then
//! absorbed rather than answered 503 and retried at once by every client.
//!
//! Only a request the pool cannot admit now waits: one that fits is admitted at once, whatever
//! waits (a waiter too large to fit yet, kept at the head, made an almost idle pool refuse
//! every request behind it). Among waiters, order is highest class first, then oldest first:
//! the head asks the pool whether it admits it every [`POLL`] (and at once when it becomes
//! the head), the others every [`POLL_BEHIND`], so capacity that frees up goes to the head
//! when it fits, and to a smaller waiter behind it when only that one does.
//!
//! The head keeps its place until the core starts its attempt (its [`Place`] travels in the
//! request's context and is dropped in `upstream_select`), so the next waiter asks the pool
//! only once the first one's demand is on its way to being counted.
//!
//! Written here rather than with a semaphore: what frees up is KV headroom, which only the
//! pool's live pressure can tell, not permits someone hands back.

use crate::metrics;
use sluice_sdk::Priority;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

/// How often the head of a queue asks its pool again. Capacity frees up when a request ends
/// (the pool sees it at once) or when a scrape comes (every 250 ms by default).
pub const POLL: Duration = Duration::from_millis(5);
/// How often a waiter behind the head asks.
pub const POLL_BEHIND: Duration = Duration::from_millis(25);

/// Highest class first, then first come.
type Key = (Reverse<Priority>, u64);

/// One pool's waiting requests.
pub struct Queue {
    pool: Arc<str>,
    max_queued: usize,
    /// The number of waiters, read without the lock on every request.
    len: AtomicUsize,
    /// 1 while a waiter that was let in has not started its attempt (see [`Place::wait_for`]).
    letting_in: AtomicUsize,
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    next_seq: u64,
    /// Each waiter's wake-up call.
    turns: BTreeMap<Key, Arc<Notify>>,
}

impl Queue {
    pub fn new(pool: Arc<str>, max_queued: usize) -> Self {
        Self {
            pool,
            max_queued,
            len: AtomicUsize::new(0),
            letting_in: AtomicUsize::new(0),
            waiting: Mutex::new(Waiting::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waiting> {
        // Nothing panics while holding it; a poisoned map is still a consistent one.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place in the queue, or `None` when it is full.
    pub fn join(self: &Arc<Self>, priority: Priority) -> Option<Place> {
        let mut waiting = self.lock();
        if waiting.turns.len() >= self.max_queued {
            return None;
        }
        let key = (Reverse(priority), waiting.next_seq);
        waiting.next_seq += 1;
        let turn = Arc::new(Notify::new());
        waiting.turns.insert(key, Arc::clone(&turn));
        self.len.store(waiting.turns.len(), Relaxed);
        drop(waiting);
        metrics::queued(&self.pool, priority, 1);
        Some(Place {
            queue: Arc::clone(self),
            key,
            turn,
            admitted: false,
        })
    }
}

/// A request's place in its pool's queue; dropping it leaves the queue and tells the next
/// waiter that it may be the head now.
pub struct Place {
    queue: Arc<Queue>,
    key: Key,
    turn: Arc<Notify>,
    /// It was let in, and its demand is not counted by the pool yet: no other waiter is.
    admitted: bool,
}

impl Place {
    fn is_head(&self) -> bool {
        self.queue.lock().turns.keys().next() == Some(&self.key)
    }

    /// Waits until `admits()` says yes (true), or until `deadline` (false); the head asks
    /// every [`POLL`], the others every [`POLL_BEHIND`]. The place is kept either way: drop it
    /// to leave.
    pub async fn wait_for(&mut self, deadline: Instant, admits: impl Fn() -> bool) -> bool {
        loop {
            // One waiter at a time is let in, until its place is dropped (its attempt starts
            // and the pool counts its demand): several let in at once would all be judged
            // against the same load, and together take the pool past its line.
            let free = self.queue.letting_in.load(Relaxed) == 0;
            if free && admits() && self.claim() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            // Woken early when a waiter ahead leaves (this one may be the head now).
            let every = if self.is_head() { POLL } else { POLL_BEHIND };
            let until = (Instant::now() + every).min(deadline);
            tokio::select! {
                _ = self.turn.notified() => {}
                _ = sleep_until(until) => {}
            }
        }
    }
}

impl Place {
    /// Takes the one turn to be let in; `false` when another waiter took it first.
    fn claim(&mut self) -> bool {
        let taken = self
            .queue
            .letting_in
            .compare_exchange(0, 1, Relaxed, Relaxed)
            .is_ok();
        self.admitted = taken;
        taken
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.admitted {
            self.queue.letting_in.store(0, Relaxed);
        }
        let mut waiting = self.queue.lock();
        waiting.turns.remove(&self.key);
        self.queue.len.store(waiting.turns.len(), Relaxed);
        // Whoever is first now asks the pool (a permit is kept if it is not listening yet).
        if let Some(next) = waiting.turns.values().next() {
            next.notify_one();
        }
        drop(waiting);
        metrics::queued(&self.queue.pool, self.key.0 .0, -1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn queue(max: usize) -> Arc<Queue> {
        Arc::new(Queue::new("p".into(), max))
    }

    #[tokio::test(start_paused = true)]
    async fn the_highest_class_then_the_oldest_goes_first() {
        let q = queue(8);
        let standard = q.join(Priority::Standard).unwrap();
        let sheddable = q.join(Priority::Sheddable).unwrap();
        let critical = q.join(Priority::Critical).unwrap();
        let later_standard = q.join(Priority::Standard).unwrap();
        assert!(critical.is_head());
        drop(critical);
        assert!(standard.is_head());
        drop(standard);
        assert!(later_standard.is_head());
        drop(later_standard);
        assert!(sheddable.is_head());
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_and_a_place_left_is_free_again() {
        let q = queue(2);
        let a = q.join(Priority::Standard).unwrap();
        let _b = q.join(Priority::Standard).unwrap();
        assert!(q.join(Priority::Critical).is_none());
        drop(a);
        assert!(q.join(Priority::Critical).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_fits_goes_past_a_head_that_does_not() {
        let q = queue(8);
        let open = Arc::new(AtomicBool::new(false));
        let mut big = q.join(Priority::Critical).unwrap();
        let mut small = q.join(Priority::Standard).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        let fits = {
            let open = Arc::clone(&open);
            move || open.load(Relaxed)
        };
        // The head never fits; the one behind it does once room comes.
        let waiting_small = tokio::spawn({
            let fits = fits.clone();
            async move { small.wait_for(deadline, fits).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        open.store(true, Relaxed);
        let started = Instant::now();
        assert!(waiting_small.await.unwrap());
        assert!(
            started.elapsed() <= POLL_BEHIND,
            "asked again within its poll"
        );
        assert!(
            !big.wait_for(deadline, || false).await,
            "the head timed out"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_let_in_one_at_a_time_until_the_last_ones_attempt_starts() {
        let q = queue(8);
        let mut first = q.join(Priority::Standard).unwrap();
        let mut second = q.join(Priority::Standard).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        assert!(first.wait_for(deadline, || true).await);
        // The pool still admits, but the first one's demand is not counted yet.
        let waits = tokio::time::timeout(
            Duration::from_millis(200),
            second.wait_for(deadline, || true),
        );
        assert!(waits.await.is_err(), "two let in at once");
        drop(first);
        assert!(second.wait_for(deadline, || true).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gives_up_at_its_deadline() {
        let q = queue(8);
        let mut place = q.join(Priority::Critical).unwrap();
        let start = Instant::now();
        let deadline = start + Duration::from_secs(2);
        assert!(!place.wait_for(deadline, || false).await);
        assert_eq!(Instant::now().duration_since(start), Duration::from_secs(2));
    }
}
