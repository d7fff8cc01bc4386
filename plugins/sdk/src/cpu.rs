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

use std::num::NonZeroUsize;
use std::sync::OnceLock;

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
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("sluice-body-{i}"))
            .start_handler(|_| {
                // Raising a nice value needs no privilege; if it fails, the work still runs.
                let nice = rustix::process::getpriority_process(None).unwrap_or(0);
                if let Err(e) =
                    rustix::process::setpriority_process(None, (nice + BODY_NICE).min(19))
                {
                    tracing::debug!("the body pool's thread keeps its priority: {e}");
                }
            })
            // A panic in the work drops its sender: the caller gets `None`, the thread lives.
            .panic_handler(|_| {})
            .build()
            .map_err(|e| tracing::warn!("no body pool ({e}); large bodies use Tokio's"))
            .ok()
    })
    .as_ref()
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
