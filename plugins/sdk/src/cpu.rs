//! CPU-heavy work on a request body (parsing, hashing megabytes) off the async workers.
//!
//! Pingora serves every connection on a few worker threads: a worker parsing an 8 MiB body
//! for 20 ms holds up every other request queued on it, so a handful of clients sending large
//! bodies raise everyone's latency a hundredfold. Large bodies' work runs on Tokio's blocking
//! pool instead, where the operating system shares the cores between it and the workers.

/// Bodies at least this large are worked on off the workers; smaller ones cost less than
/// the hand-over.
pub const OFF_WORKER_BYTES: usize = 256 * 1024;

/// Runs `work` on a body of `bytes` bytes: inline when small, on the blocking pool when
/// large. `None` only if the work could not complete (its thread was lost).
pub async fn body_work<T: Send + 'static>(
    bytes: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if bytes < OFF_WORKER_BYTES {
        return Some(work());
    }
    tokio::task::spawn_blocking(work).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn small_work_runs_inline_and_large_work_on_the_blocking_pool() {
        let here = std::thread::current().id();
        let small = body_work(10, move || std::thread::current().id() == here).await;
        assert_eq!(small, Some(true));
        let large = body_work(OFF_WORKER_BYTES, move || {
            std::thread::current().id() == here
        })
        .await;
        assert_eq!(large, Some(false));
    }
}
