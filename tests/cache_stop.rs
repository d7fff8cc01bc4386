//! End-to-end: a graceful stop (SIGTERM) gives the Redis store's queued writes their bounded
//! chance to land (`plugins/cache` `Plugin::stop` → `RedisStore::flush`, run by src/drain.rs
//! once nothing is in flight): answers stored just before the signal are in Redis once the
//! process has exited, and a Redis that never answers does not hold the exit.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use sluice_testkit::*;
use std::net::SocketAddr;
use std::time::Duration;

const MODEL: &str = "test-model";

/// The cache section on a Redis behind `slow`. A slow Redis is not a failing one here:
/// lookups wait for it, and no cool-down drops the writes.
fn slow_redis_cache(slow: &SlowRelay) -> serde_json::Value {
    json!({
        "enabled": true,
        "store": "redis",
        "redis": {"url": slow.url(), "lookup_timeout": "5s", "failure_threshold": 1000},
    })
}

/// Cache keys in a single Redis.
fn cache_keys(port: u16) -> usize {
    redis_cli(port, &["--scan", "--pattern", "llm:cache:*"])
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count()
}

/// `n` different deterministic prompts at once; every answer must be a 200 cache miss (so
/// each one is written back to the store).
async fn misses(proxy: &Proxy, n: usize) {
    let asks = (0..n).map(|i| {
        let body = chat(MODEL, &format!("prompt number {i}"), false);
        // An API key: the cache's partition is per key (a request without identity may
        // bypass it, depending on `tenant.anonymous`).
        async move {
            proxy
                .ask(&body, &[("authorization", "Bearer test-key")])
                .await
        }
    });
    for a in futures_util::future::join_all(asks).await {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.x_cache, "MISS");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_stored_just_before_sigterm_are_in_redis_once_the_process_has_exited() {
    const ANSWERS: usize = 6;
    let upstream = sim_serving(MODEL).await;
    let redis = RedisServer::start();
    // Every Redis answer 100 ms late: the writer task, one SET at a time, needs about 0.6 s
    // for the six write-backs, so most are still queued when the signal comes, and all fit
    // in the 2 s the stop gives them.
    let redis_addr = SocketAddr::from(([127, 0, 0, 1], redis.port()));
    let slow = SlowRelay::start(redis_addr, Duration::from_millis(100)).await;
    let mut proxy = Proxy::start(json!({
        // Long enough that only the drain (nothing in flight, then the flush) ends the process.
        "pingora": {"grace_period_seconds": 30},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"cache": slow_redis_cache(&slow)},
    }))
    .await;

    misses(&proxy, ANSWERS).await;
    let stored_before = tokio::task::block_in_place(|| cache_keys(redis.port()));
    let mut child = proxy.take_child();
    signal(child.id(), "TERM");
    assert!(
        stored_before < ANSWERS,
        "every write had landed before the signal ({stored_before}): nothing left to flush"
    );
    let took = exits_within(&mut child, Duration::from_secs(25)).await;
    eprintln!("{stored_before} of {ANSWERS} entries in Redis at SIGTERM; exited {took:?} after it");
    let logs = proxy.logs();
    assert!(
        logs.contains("nothing in flight"),
        "the drain, not the grace period, ended the process:\n{logs}"
    );
    let stored_after = tokio::task::block_in_place(|| cache_keys(redis.port()));
    assert_eq!(
        stored_after, ANSWERS,
        "{stored_before} entries in Redis at SIGTERM, {stored_after} after the exit:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_never_answers_does_not_hold_the_exit_beyond_the_flush_bound() {
    let upstream = sim_serving(MODEL).await;
    let silent = SilentServer::start().await;
    let mut proxy = Proxy::start(json!({
        "pingora": {"grace_period_seconds": 120},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"cache": {
            "enabled": true,
            "store": "redis",
            // Each write waits up to 5 minutes on the silent Redis, and no cool-down drops
            // the queued ones: only the flush's own bound can let the process go.
            "redis": {"url": silent.url(), "connect_timeout": "300s", "failure_threshold": 1000},
        }},
    }))
    .await;

    misses(&proxy, 3).await;
    // An answer is handed to the store when its last byte has passed, just after the client
    // has it: wait for the third.
    let stored = "sluice_cache_writes_total{outcome=\"stored\"}";
    wait_for(Duration::from_secs(10), || async {
        proxy.metric(stored).await == Some(3.0)
    })
    .await
    .unwrap_or_else(|| panic!("the three answers were handed to the store"));
    let dropped = proxy
        .metric("sluice_cache_write_queue_dropped_total{store=\"redis\"}")
        .await
        .unwrap_or(0.0);
    assert_eq!(
        dropped, 0.0,
        "no write was dropped: they wait on the silent Redis"
    );
    let mut child = proxy.take_child();
    signal(child.id(), "TERM");
    // The flush gives up after 2 s; without that bound the process would wait for the
    // writes (5 minutes) or the grace period (2 minutes). The limit is generous on purpose.
    let took = exits_within(&mut child, Duration::from_secs(30)).await;
    eprintln!("exited {took:?} after SIGTERM with writes stuck on a silent Redis");
    let logs = proxy.logs();
    assert!(
        logs.contains("nothing in flight"),
        "the drain, not the grace period, ended the process:\n{logs}"
    );
}

/// Writes queued for a slow Redis hold at most a quarter of the memory budget: a Redis that
/// answers each SET 0.9 s late, while large answers missed the cache, filled the whole budget
/// with queued writes, and every LLM request got `503 memory-budget` until they drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_queued_for_a_slow_redis_leave_the_requests_their_memory() {
    // About 150 KB an answer.
    let upstream = vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_model(MODEL)
            .with_answer_tokens(30_000, 30_000),
    )
    .await
    .unwrap();
    let redis = RedisServer::start();
    let redis_addr = SocketAddr::from(([127, 0, 0, 1], redis.port()));
    let slow = SlowRelay::start(redis_addr, Duration::from_millis(900)).await;
    let proxy = Proxy::start(json!({
        "limits": {"max_request_body_bytes": 1_048_576, "max_buffered_bytes": 4_194_304},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"cache": slow_redis_cache(&slow)},
    }))
    .await;
    let asks = (0..30).map(|i| {
        let mut body = chat(MODEL, &format!("a long answer {i}"), false);
        body["max_tokens"] = json!(30_000);
        let proxy = &proxy;
        async move {
            proxy
                .ask(&body, &[("authorization", "Bearer test-key")])
                .await
        }
    });
    for a in futures_util::future::join_all(asks).await {
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"), "{}", a.body);
        assert!(
            a.body.len() > 100_000,
            "a short answer: {} bytes",
            a.body.len()
        );
    }
    // Every write-back handed to the store, or dropped by it.
    let handed = wait_for(Duration::from_secs(10), || async {
        let stored = proxy
            .metric(r#"sluice_cache_writes_total{outcome="stored"}"#)
            .await
            .unwrap_or(0.0);
        let dropped = proxy
            .metric(r#"sluice_cache_writes_total{outcome="dropped"}"#)
            .await
            .unwrap_or(0.0);
        stored + dropped >= 30.0
    })
    .await;
    assert!(handed.is_some(), "the write-backs were not all handed over");
    let held = proxy.metric("sluice_memory_buffered_bytes").await.unwrap();
    assert!(
        held <= 1_048_576.0,
        "queued writes hold {held} bytes of a 4 MiB budget"
    );
    let a = proxy
        .ask(&chat(MODEL, "a normal request", false), &[])
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
}
