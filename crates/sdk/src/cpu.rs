//! CPU-heavy work on a request body (parsing, hashing, tokenizing megabytes) off the async
//! workers, at a lower scheduling priority than theirs.
//!
//! Pingora serves every connection on a few worker threads: a worker parsing an 8 MiB body
//! for 20 ms holds up every other request queued on it, so a handful of clients sending large
//! bodies raise everyone's latency a hundredfold. Large bodies' work runs on a pool of its
//! own instead. Its threads are as many as the cores and run at nice [`BODY_NICE`]: Tokio's
//! blocking pool would start a thread per body at the workers' own priority, so eight
//! clients sending large bodies back to back made eight threads that the kernel shared the
//! cores with the two workers evenly, and small requests waited behind them (scenario 8 of
//! `sluice-bench`: hundreds of milliseconds). At nice 5 a body thread weighs a third of a
//! worker, so a worker that wakes runs soon, and the bodies take what the workers leave.
//! Nothing is lost when the machine is idle: a lower priority only matters when both want a
//! core. Measured in scenario 8 (normal traffic's p99 under large-body attack): 224 ms with
//! the pool at the workers' priority, 65 ms at nice 5, 22-68 ms at nice 10. Not more than 5:
//! the nice value also weighs against every other process on the machine, and at 10 a busy
//! machine's other work left large bodies a tenth of a core (the harness's smoke run, beside
//! two busy loops, finished no 1 MiB request in its window).
//!
//! The pool is rayon's (a fixed set of threads and a queue); the priority is set once per
//! thread as it starts (on Linux, `setpriority` on the calling thread is that thread's alone).
//!
//! Work a request can do without ([`optional_work`]: tokenizing a prompt for the exact prefix
//! index, which only improves placement) runs on a second pool of one thread, so that no body's
//! parse ever waits behind it, and is dropped, not run, when its caller has gone (the client
//! left) or when it waited in the queue longer than it was worth: an attacker's queue of 8 MiB
//! prompts costs its own requests their index, not everyone's parse its latency.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Bodies at least this large are worked on off the workers; smaller ones cost less than
/// the hand-over.
pub const OFF_WORKER_BYTES: usize = 256 * 1024;

/// How much nicer the body pool's threads are than the thread that starts the pool (the
/// workers run at the process's own nice value, 0 by default): a weight about a third.
pub const BODY_NICE: i32 = 5;

/// The body pool, made on first use; `None` if its threads could not be started (then the
/// work goes to Tokio's blocking pool, as before there was one).
fn body_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        nice_pool("sluice-body", threads)
    })
    .as_ref()
}

/// The optional work's pool: one thread, at the body pool's priority.
fn optional_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| nice_pool("sluice-optional", 1))
        .as_ref()
}

/// A pool of `threads` named `name-N`, [`BODY_NICE`] nicer than its maker; `None` if its
/// threads could not be started.
fn nice_pool(name: &'static str, threads: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{name}-{i}"))
        .start_handler(|_| be_nicer())
        // A panic in the work drops its sender: the caller gets `None`, the thread lives.
        .panic_handler(|_| {})
        .build()
        .map_err(|e| tracing::warn!("no {name} pool ({e}); its work uses Tokio's"))
        .ok()
}

/// Makes the calling thread [`BODY_NICE`] nicer than it is (on Linux, the thread's alone):
/// for the threads of work that may wait while requests are served.
pub fn be_nicer() {
    // Raising a nice value needs no privilege; if it fails, the work still runs.
    let nice = rustix::process::getpriority_process(None).unwrap_or(0);
    if let Err(e) = rustix::process::setpriority_process(None, (nice + BODY_NICE).min(19)) {
        tracing::debug!("a background thread keeps its priority: {e}");
    }
}

/// Runs `work`, which the caller can do without, off the workers on a pool of its own (see
/// the module's header): `None` when it was dropped unrun, because it waited in the queue
/// longer than `max_wait` or the returned future was dropped first (its request ended), or
/// when it panicked.
pub async fn optional_work<T: Send + 'static>(
    max_wait: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    /// Marks the work unwanted when the caller's future is dropped.
    struct Wanted(Arc<AtomicBool>);
    impl Drop for Wanted {
        fn drop(&mut self) {
            self.0.store(false, Relaxed);
        }
    }
    let Some(pool) = optional_pool() else {
        return tokio::task::spawn_blocking(work).await.ok();
    };
    let wanted = Wanted(Arc::new(AtomicBool::new(true)));
    let still_wanted = Arc::clone(&wanted.0);
    let queued = Instant::now();
    let (done, result) = tokio::sync::oneshot::channel();
    pool.spawn(move || {
        if still_wanted.load(Relaxed) && queued.elapsed() <= max_wait {
            let _ = done.send(work());
        }
    });
    result.await.ok()
}

/// Runs `work` on the body pool and waits for it. `None` only if the work could not
/// complete (it panicked).
pub async fn off_worker<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let Some(pool) = body_pool() else {
        return tokio::task::spawn_blocking(work).await.ok();
    };
    let (done, result) = tokio::sync::oneshot::channel();
    pool.spawn(move || {
        // The caller may have gone (its client left): the result is then dropped.
        let _ = done.send(work());
    });
    result.await.ok()
}

/// Runs `work` on a body of `bytes` bytes: inline when small, on the body pool when large.
/// `None` only if the work could not complete.
pub async fn body_work<T: Send + 'static>(
    bytes: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if bytes < OFF_WORKER_BYTES {
        return Some(work());
    }
    off_worker(work).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Optional work whose caller left, or that waited too long, is never run; and it never
    /// holds the body pool.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn optional_work_is_dropped_unrun_when_unwanted_or_late() {
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // The one optional thread is held until released.
        let held = tokio::spawn(optional_work(Duration::from_secs(60), move || {
            let _ = hold.recv();
        }));
        // Queued behind it: one whose caller leaves, one that will have waited too long.
        let counted = Arc::clone(&ran);
        let left = tokio::spawn(optional_work(Duration::from_secs(60), move || {
            counted.fetch_add(1, Relaxed);
        }));
        let counted = Arc::clone(&ran);
        let late = tokio::spawn(optional_work(Duration::ZERO, move || {
            counted.fetch_add(1, Relaxed);
        }));
        // Meanwhile the body pool is free.
        assert_eq!(off_worker(|| 7).await, Some(7));
        left.abort();
        let _ = left.await;
        release.send(()).unwrap();
        assert_eq!(held.await.unwrap(), Some(()));
        assert_eq!(late.await.unwrap(), None);
        // Work queued after them runs, so both were passed over by now.
        let counted = Arc::clone(&ran);
        let after = optional_work(Duration::from_secs(60), move || counted.load(Relaxed)).await;
        assert_eq!(after, Some(0));
    }

    #[tokio::test]
    async fn small_work_runs_inline_and_large_work_on_the_body_pool() {
        let here = std::thread::current().id();
        let small = body_work(10, move || std::thread::current().id() == here).await;
        assert_eq!(small, Some(true));
        let large = body_work(OFF_WORKER_BYTES, move || {
            std::thread::current().name().map(str::to_string)
        })
        .await;
        let name = large.flatten().unwrap_or_default();
        assert!(name.starts_with("sluice-body-"), "ran on {name:?}");
    }

    #[tokio::test]
    async fn the_body_pool_runs_below_the_callers_priority() {
        let mine = rustix::process::getpriority_process(None).unwrap();
        let theirs = off_worker(|| rustix::process::getpriority_process(None).unwrap())
            .await
            .unwrap();
        assert_eq!(theirs, (mine + BODY_NICE).min(19), "nice {mine} here");
    }

    #[tokio::test]
    async fn a_panic_in_the_work_is_none_and_the_pool_lives_on() {
        let lost: Option<u32> = off_worker(|| panic!("a bug in the work")).await;
        assert_eq!(lost, None);
        assert_eq!(off_worker(|| 7).await, Some(7));
    }
}
