//! The waiting room: a request that finds its pool with no ready backend (scaled to zero,
//! every pod still starting) waits up to the pool's `no_backend_wait` for one to join and be
//! usable, rather than failing at once; an autoscaler reads how many wait
//! (`sluice_pool_waiting_requests`) to wake the pool. A pool whose listed backends all fail
//! is answered at once, as before. Bounded: at most [`MAX_WAITING`] requests of a pool wait,
//! the rest get their 503 at once.

use super::Pool;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most requests of one pool that wait for a backend at once.
pub const MAX_WAITING: usize = 4096;

/// How often a waiting request looks again when nothing changed the pool's members: a
/// backend's health changes at its checks, which no member change announces.
const LOOK_AGAIN: Duration = Duration::from_millis(250);

/// The requests of a pool waiting for a backend, by when each came in; one room for all the
/// pool's generations (a reload hands it on), so the count does not drop at a reload.
#[derive(Debug, Default)]
pub struct WaitingRoom {
    since: Mutex<BTreeMap<u64, Instant>>,
    next_id: AtomicU64,
}

/// A request's place in the waiting room: it leaves when this is dropped.
#[derive(Debug)]
pub struct Waiting {
    room: Arc<WaitingRoom>,
    id: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.room.lock().remove(&self.id);
    }
}

impl WaitingRoom {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Instant>> {
        self.since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place in the room, or `None` when [`MAX_WAITING`] requests wait already.
    pub fn enter(self: &Arc<Self>) -> Option<Waiting> {
        let mut since = self.lock();
        if since.len() >= MAX_WAITING {
            return None;
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        since.insert(id, Instant::now());
        Some(Waiting {
            room: Arc::clone(self),
            id,
        })
    }

    /// How many requests wait now, and how long the oldest of them has (the first in: ids
    /// are handed out in order under the lock).
    pub fn waiting(&self) -> (usize, Duration) {
        let since = self.lock();
        let oldest = since
            .first_key_value()
            .map_or(Duration::ZERO, |(_, at)| at.elapsed());
        (since.len(), oldest)
    }
}

impl Pool {
    /// Whether any backend is listed as ready by the pool's source (a pool scaled to zero,
    /// or whose pods are all starting or going, has none). Its health aside: a listed
    /// backend that fails is answered at once, not waited for.
    pub fn has_ready_member(&self) -> bool {
        self.members().iter().any(crate::members::Member::is_ready)
    }

    /// The pool's waiting room.
    pub fn waiting_room(&self) -> Arc<WaitingRoom> {
        self.waiting_room.load_full()
    }

    /// Resolves once the pool, in its newest generation, has a usable backend, with that
    /// generation: a reload stops the old one's discovery, so a request that waits across it
    /// is sent by the new one. Looked at again whenever the members change, and every
    /// [`LOOK_AGAIN`] for a member's health.
    pub async fn usable_backend(self: &Arc<Self>) -> Arc<Pool> {
        loop {
            let newest = self.newest();
            let mut changes = newest.changes.subscribe();
            if newest.has_usable_backend() {
                return newest;
            }
            tokio::select! {
                _ = changes.changed() => {}
                () = tokio::time::sleep(LOOK_AGAIN) => {}
            }
        }
    }

    /// This pool as the last reload made it (itself when no reload replaced it).
    pub fn newest(self: &Arc<Self>) -> Arc<Pool> {
        let mut pool = Arc::clone(self);
        // A chain of generations, each replaced by the next; bounded against a cycle.
        for _ in 0..1024 {
            let next = pool
                .successor
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .upgrade();
            match next {
                Some(next) => pool = next,
                None => break,
            }
        }
        pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_counts_who_waits_and_since_when_and_is_bounded() {
        let room = Arc::new(WaitingRoom::default());
        assert_eq!(room.waiting(), (0, Duration::ZERO));
        let first = room.enter();
        let second = room.enter();
        assert!(first.is_some() && second.is_some());
        assert_eq!(room.waiting().0, 2);
        drop(first);
        assert_eq!(room.waiting().0, 1);
        let many: Vec<_> = (1..MAX_WAITING).map(|_| room.enter()).collect();
        assert!(many.iter().all(Option::is_some));
        assert!(room.enter().is_none(), "full");
        drop(many);
        drop(second);
        assert_eq!(room.waiting(), (0, Duration::ZERO));
    }
}
