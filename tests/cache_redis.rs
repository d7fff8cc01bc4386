//! End-to-end: the cache plugin with `store: redis` in the real binary, against real
//! redis-server processes (single node and Cluster) on free ports and the simulator upstream.
//! A failing, hanging or absent Redis must never fail a request.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MODEL: &str = "test-model";

/// Long enough for a cool-down (1 s) plus a reconnect, on a loaded machine.
const RECOVERY: Duration = Duration::from_secs(10);

/// No request may take longer than this, whatever Redis does (a bound against hangs, not a
/// latency target).
const REQUEST_BOUND: Duration = Duration::from_secs(3);

async fn sim() -> vllm_sim::Sim {
    sim_serving(MODEL).await
}

/// The `redis:` section's target: `url: ...` or `cluster_nodes: [...]`.
enum Target {
    Url(String),
    Cluster(Vec<String>),
}

/// Whether identical requests in flight are coalesced (the default), or every hit comes from
/// the store. Off where a test asserts `MISS` for a repeated prompt while Redis is unusable:
/// with coalescing on, a request sent right after an identical one completed can still join
/// it as a follower (the leader leaves the in-flight map only in the write-back task, after
/// the client has its answer) and get `x-cache: HIT` with no store at all.
#[derive(PartialEq)]
enum Coalescing {
    On,
    Off,
}

/// A proxy with the cache on, `store: redis`, in front of `upstream`.
async fn redis_proxy(upstream: &vllm_sim::Sim, target: Target, coalescing: Coalescing) -> Proxy {
    let mut redis = json!({"lookup_timeout": "50ms", "cooldown": "1s"});
    match target {
        Target::Url(url) => redis["url"] = json!(url),
        Target::Cluster(nodes) => redis["cluster_nodes"] = json!(nodes),
    }
    let mut cache = json!({"enabled": true, "store": "redis", "redis": redis,
        "tenant": {"anonymous": "share"}});
    if coalescing == Coalescing::Off {
        cache["coalesce"] = json!({"enabled": false});
    }
    Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"cache": cache},
    }))
    .await
}

/// Cache keys in a single Redis.
fn cache_keys(port: u16) -> Vec<String> {
    redis_cli(port, &["--scan", "--pattern", "llm:cache:*"])
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

/// Waits until `count()` reaches `n`: the write-back to Redis is asynchronous.
async fn wait_for_keys(n: usize, mut count: impl FnMut() -> usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = tokio::task::block_in_place(&mut count);
        if found >= n {
            assert_eq!(found, n, "more keys than entries written");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{found} of {n} entries in Redis after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misses_then_hits_through_redis_and_two_proxies_share_it() {
    let redis = RedisServer::start();
    let upstream = sim().await;
    let first = redis_proxy(&upstream, Target::Url(redis.url()), Coalescing::On).await;
    let request = chat(MODEL, "What is the capital of France?", false);

    let miss = first.ask(&request, &[]).await;
    assert_eq!((miss.status, miss.x_cache.as_str()), (200, "MISS"));
    // The entry is really in Redis; once it is there, the repeat is a hit.
    wait_for_keys(1, || cache_keys(redis.port()).len()).await;
    let hit = first.ask(&request, &[]).await;
    assert_eq!((hit.status, hit.x_cache.as_str()), (200, "HIT"));
    assert_eq!(content(&hit), content(&miss));
    assert!(hit.headers.contains_key("age"));
    assert_eq!(hit.headers["x-sluice-pool"], "main");
    assert_eq!(upstream_calls(&upstream), 1);

    // A second process, nothing in its own memory. One unrelated request first, so that its
    // connection to Redis is up (made on first use); then its first ask of the prompt the
    // first proxy filled is a hit from Redis.
    let second = redis_proxy(&upstream, Target::Url(redis.url()), Coalescing::On).await;
    let warm = chat(MODEL, "warms the second proxy's connection", false);
    assert_eq!(second.ask(&warm, &[]).await.status, 200);
    let calls = upstream_calls(&upstream);
    let shared = second.ask(&request, &[]).await;
    assert_eq!((shared.status, shared.x_cache.as_str()), (200, "HIT"));
    assert_eq!(content(&shared), content(&miss));
    assert_eq!(
        upstream_calls(&upstream),
        calls,
        "the hit never went upstream"
    );

    // And the other way round: what the second fills, the first serves.
    let other = chat(MODEL, "filled by the second proxy", false);
    let filled = second.ask(&other, &[]).await;
    assert_eq!(filled.x_cache, "MISS");
    let served = first.until_hit(&other, &[]).await;
    assert_eq!(served.x_cache, "HIT");
    assert_eq!(content(&served), content(&filled));
    assert_eq!(cache_keys(redis.port()).len(), 3);
}

/// One request of the background run: its status, `x-cache`, and when it was sent.
struct Sent {
    at: Instant,
    status: u16,
    x_cache: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_killed_mid_run_costs_hits_not_requests_and_hits_come_back() {
    let mut redis = RedisServer::start();
    let upstream = sim().await;
    let proxy = redis_proxy(&upstream, Target::Url(redis.url()), Coalescing::Off).await;
    let request = chat(MODEL, "asked again and again", false);
    proxy.ask(&request, &[]).await;
    assert_eq!(proxy.until_hit(&request, &[]).await.x_cache, "HIT");

    // Requests one after another for the whole test, Redis killed and restarted under them.
    let log: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let run = tokio::spawn({
        let (url, request, log, stop) = (
            proxy.url("/v1/chat/completions"),
            request.clone(),
            log.clone(),
            stop.clone(),
        );
        async move {
            while !stop.load(Ordering::Acquire) {
                let at = Instant::now();
                let a = tokio::time::timeout(REQUEST_BOUND, ask_url(&url, &request, &[]))
                    .await
                    .expect("a request hung while Redis was down");
                log.lock().unwrap().push(Sent {
                    at,
                    status: a.status,
                    x_cache: a.x_cache,
                });
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    let sent = |log: &Mutex<Vec<Sent>>| log.lock().unwrap().len();

    // Some hits first.
    let deadline = Instant::now() + Duration::from_secs(5);
    while sent(&log) < 5 {
        assert!(Instant::now() < deadline, "the run did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::task::block_in_place(|| redis.stop());
    let killed = Instant::now();
    // Through the failures, the cool-down (1 s) and a probe into a dead port.
    let before = sent(&log);
    let store_errors = |kinds: &'static [&'static str]| {
        let proxy = &proxy;
        async move {
            let mut sum = 0.0;
            for op in ["get", "set"] {
                for kind in kinds {
                    let series = format!(
                        r#"sluice_cache_store_errors_total{{kind="{kind}",op="{op}",store="redis"}}"#
                    );
                    sum += proxy.metric(&series).await.unwrap_or(0.0);
                }
            }
            sum
        }
    };
    let failures = || store_errors(&["error", "timeout"]);
    let cooling = wait_for(RECOVERY, || async {
        store_errors(&["cooldown"]).await > 0.0
    })
    .await;
    assert!(cooling.is_some(), "no cool-down: {}", proxy.metrics().await);
    // Redis is skipped now; a failure from here on is the probe at the cool-down's end.
    let failed_before_probe = failures().await;
    let probed = wait_for(RECOVERY, || async {
        failures().await > failed_before_probe && sent(&log) >= before + 10
    })
    .await;
    assert!(
        probed.is_some(),
        "requests kept flowing while Redis was down, through a probe ({} sent): {}",
        sent(&log) - before,
        proxy.metrics().await
    );
    let restarting = Instant::now();
    tokio::task::block_in_place(|| redis.restart());

    // Hits resume by themselves: the restarted Redis is empty, so the run refills it first.
    let deadline = Instant::now() + RECOVERY;
    let resumed = loop {
        let hit_after_restart = log
            .lock()
            .unwrap()
            .iter()
            .any(|s| s.at > restarting && s.x_cache == "HIT");
        if hit_after_restart || Instant::now() > deadline {
            break hit_after_restart;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.store(true, Ordering::Release);
    run.await.unwrap();

    let log = log.lock().unwrap();
    let failed: Vec<u16> = log.iter().map(|s| s.status).filter(|s| *s != 200).collect();
    assert!(failed.is_empty(), "statuses other than 200: {failed:?}");
    let while_down: Vec<&str> = log
        .iter()
        .filter(|s| s.at > killed && s.at < restarting)
        .map(|s| s.x_cache.as_str())
        .collect();
    assert!(!while_down.is_empty());
    assert!(
        while_down.iter().all(|x| *x == "MISS"),
        "answered from upstream while Redis was down: {while_down:?}"
    );
    assert!(
        resumed,
        "no hit within {RECOVERY:?} of Redis coming back ({} requests sent)",
        log.len()
    );
    assert!(
        log.iter().any(|s| s.at < killed && s.x_cache == "HIT"),
        "hits before the kill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_never_answers_is_bounded_by_the_lookup_timeout() {
    let silent = SilentServer::start().await;
    let upstream = sim().await;
    let proxy = redis_proxy(&upstream, Target::Url(silent.url()), Coalescing::On).await;

    // Sequential, then concurrent: before, during and after the cool-down.
    for i in 0..6 {
        let request = chat(MODEL, &format!("silent redis {i}"), false);
        let a = tokio::time::timeout(REQUEST_BOUND, proxy.ask(&request, &[]))
            .await
            .unwrap_or_else(|_| panic!("request {i} hung on a silent Redis"));
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"), "{}", a.body);
        assert!(!content(&a).is_empty());
    }
    let concurrent = futures_util::future::join_all((0..8).map(|i| {
        let request = chat(MODEL, &format!("silent redis, together {i}"), false);
        let proxy = &proxy;
        async move { tokio::time::timeout(REQUEST_BOUND, proxy.ask(&request, &[])).await }
    }))
    .await;
    for (i, a) in concurrent.into_iter().enumerate() {
        let a = a.unwrap_or_else(|_| panic!("concurrent request {i} hung on a silent Redis"));
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"), "{}", a.body);
    }
    // Past one cool-down: the probe hangs too, and is bounded the same way.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for i in 0..3 {
        let request = chat(
            MODEL,
            &format!("silent redis, after the cool-down {i}"),
            false,
        );
        let a = tokio::time::timeout(REQUEST_BOUND, proxy.ask(&request, &[]))
            .await
            .unwrap_or_else(|_| panic!("request {i} after the cool-down hung"));
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"));
    }
    assert_eq!(upstream_calls(&upstream), 17);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_started_before_redis_serves_then_hits_once_redis_is_up() {
    // Held until Redis starts on it: refused meanwhile, as a Redis that is not there yet.
    let port = reserve_port();
    let upstream = sim().await;
    let proxy = redis_proxy(
        &upstream,
        Target::Url(format!("redis://{}", port.addr())),
        Coalescing::Off,
    )
    .await;
    let request = chat(MODEL, "asked before Redis existed", false);
    for _ in 0..5 {
        let a = tokio::time::timeout(REQUEST_BOUND, proxy.ask(&request, &[]))
            .await
            .expect("a request hung with Redis absent");
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"), "{}", a.body);
    }

    let redis = tokio::task::block_in_place(|| RedisServer::start_on(port));
    let hit = proxy.until_hit_within(&request, &[], RECOVERY).await;
    assert_eq!(
        (hit.status, hit.x_cache.as_str()),
        (200, "HIT"),
        "no hit within {RECOVERY:?} of Redis starting"
    );
    assert_eq!(cache_keys(redis.port()).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_misses_then_hits_across_slots() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let upstream = sim().await;
    let proxy = redis_proxy(&upstream, Target::Cluster(cluster.urls()), Coalescing::On).await;

    let request = chat(MODEL, "asked of a cluster", false);
    let miss = proxy.ask(&request, &[]).await;
    assert_eq!((miss.status, miss.x_cache.as_str()), (200, "MISS"));
    wait_for_keys(1, || cluster.dbsizes().iter().sum::<u64>() as usize).await;
    let hit = proxy.ask(&request, &[]).await;
    assert_eq!((hit.status, hit.x_cache.as_str()), (200, "HIT"));
    assert_eq!(content(&hit), content(&miss));

    const PROMPTS: usize = 20;
    let requests: Vec<Value> = (0..PROMPTS)
        .map(|i| chat(MODEL, &format!("prompt number {i} for the cluster"), false))
        .collect();
    let mut firsts = Vec::new();
    for r in &requests {
        let a = proxy.ask(r, &[]).await;
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"));
        firsts.push(content(&a));
    }
    wait_for_keys(1 + PROMPTS, || {
        cluster.dbsizes().iter().sum::<u64>() as usize
    })
    .await;
    for (r, first) in requests.iter().zip(&firsts) {
        let a = proxy.ask(r, &[]).await;
        assert_eq!(
            (a.status, a.x_cache.as_str()),
            (200, "HIT"),
            "{}",
            r["messages"][0]["content"]
        );
        assert_eq!(&content(&a), first);
    }
    assert_eq!(upstream_calls(&upstream), 1 + PROMPTS as u64);
    let sizes = tokio::task::block_in_place(|| cluster.dbsizes());
    assert!(
        sizes.iter().filter(|n| **n > 0).count() >= 2,
        "keys spread over the nodes: {sizes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filled_by_a_stream_served_as_json_through_redis() {
    let redis = RedisServer::start();
    let upstream = sim().await;
    let proxy = redis_proxy(&upstream, Target::Url(redis.url()), Coalescing::On).await;

    let streamed = proxy
        .ask(&chat(MODEL, "filled by a stream", true), &[])
        .await;
    assert_eq!((streamed.status, streamed.x_cache.as_str()), (200, "MISS"));
    assert_eq!(
        sse_data(&streamed.body).last().map(String::as_str),
        Some("[DONE]")
    );
    // Once the stream's entry is in Redis, the JSON request is answered from it.
    wait_for_keys(1, || cache_keys(redis.port()).len()).await;
    let as_json = proxy
        .ask(&chat(MODEL, "filled by a stream", false), &[])
        .await;
    assert_eq!((as_json.status, as_json.x_cache.as_str()), (200, "HIT"));
    assert_eq!(as_json.headers["content-type"], "application/json");
    let v: Value = serde_json::from_str(&as_json.body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert!(!content(&streamed).is_empty());
    assert_eq!(content(&as_json), content(&streamed));
    assert_eq!(upstream_calls(&upstream), 1);
}

/// A Redis URL (its password, in production) need not be written in the config: read from a
/// file (or an environment variable) when the config is loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_url_may_come_from_a_file() {
    let redis = RedisServer::start();
    let upstream = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-url");
    std::fs::write(&file, format!("{}\n", redis.url())).unwrap();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"cache": {"enabled": true, "store": "redis",
            "redis": {"url": {"from_file": file}, "lookup_timeout": "1s"},
            "tenant": {"anonymous": "share"}}},
    }))
    .await;
    let request = chat(MODEL, "stored where the file says", false);
    assert_eq!(proxy.ask(&request, &[]).await.x_cache, "MISS");
    wait_for_keys(1, || cache_keys(redis.port()).len()).await;
}
