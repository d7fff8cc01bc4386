//! The Redis store against real redis-server processes (from `sluice_testkit`).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use sluice_plugin_cache::entry::Entry;
use sluice_plugin_cache::store::redis::{RedisConfig, RedisStore};
use sluice_plugin_cache::store::{CacheKey, Store, StoreError, WriteOutcome};
use sluice_sdk::Endpoint;
use sluice_testkit::{redis_cli, reserve_port, RedisCluster, RedisServer, SilentServer};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// No single call may take longer than this, whatever Redis does.
const CALL_BOUND: Duration = Duration::from_secs(2);

/// A store with room for every write in the memory budget.
fn connect(config: RedisConfig) -> RedisStore {
    RedisStore::connect(config, sluice_sdk::MemoryBudget::new(1 << 30))
}

fn config(url: String) -> RedisConfig {
    RedisConfig {
        url: Some(url),
        // Generous for loaded CI machines; the SilentServer test sets its own.
        lookup_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_secs(1),
        failure_threshold: 3,
        cooldown: Duration::from_millis(300),
        ..RedisConfig::default()
    }
}

fn digest(n: u32) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[..4].copy_from_slice(&n.to_be_bytes());
    d[31] = 0xAB;
    d
}

fn key(n: u32) -> CacheKey {
    CacheKey::new("sluice:test:", digest(n))
}

fn entry(digest: [u8; 32], text: &str) -> Arc<Entry> {
    Arc::new(Entry {
        digest,
        created_unix: 1_700_000_000,
        kind: Endpoint::ChatCompletions,
        pool: "default".into(),
        answer: serde_json::value::to_raw_value(
            &json!({"object": "chat.completion", "choices": [{"message": {"content": text}}]}),
        )
        .unwrap()
        .into(),
        source_bytes: 0,
    })
}

async fn bounded_get(store: &RedisStore, key: &CacheKey) -> Result<Option<Arc<Entry>>, StoreError> {
    tokio::time::timeout(CALL_BOUND, store.get(key))
        .await
        .unwrap_or_else(|_| panic!("a lookup took more than {CALL_BOUND:?}"))
}

/// Polls until `key` is a hit (the write is asynchronous).
async fn wait_for_hit(store: &RedisStore, key: &CacheKey, within: Duration) -> Arc<Entry> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(e)) = bounded_get(store, key).await {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "no hit for {} within {within:?}",
            key.storage_key
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes and reads again until Redis serves hits (after an outage, a cool-down may drop
/// the first writes).
async fn wait_for_recovery(store: &RedisStore, n: u32, within: Duration) {
    let deadline = Instant::now() + within;
    let k = key(n);
    loop {
        store.put(&k, entry(k.digest, "back"), Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok(Some(e)) = bounded_get(store, &k).await {
            assert_eq!(e.digest, k.digest);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Redis hits did not resume within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn dropped_total() -> u64 {
    sluice_sdk::metrics::prometheus::gather()
        .iter()
        .filter(|f| f.name() == "sluice_cache_write_queue_dropped_total")
        .flat_map(|f| f.get_metric().iter())
        .map(|m| m.get_counter().value() as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_then_get_round_trip() {
    let server = RedisServer::start();
    let store = connect(config(server.url()));
    let k = key(1);
    assert_eq!(store.name(), "redis");
    assert_eq!(bounded_get(&store, &k).await, Ok(None));
    let e = entry(k.digest, "hello");
    assert_eq!(
        store.put(&k, e.clone(), Duration::from_secs(60)),
        WriteOutcome::Accepted
    );
    let got = wait_for_hit(&store, &k, Duration::from_secs(5)).await;
    assert_eq!(*got, *e);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_is_honoured() {
    let server = RedisServer::start();
    let store = connect(config(server.url()));
    let k = key(2);
    store.put(&k, entry(k.digest, "short"), Duration::from_millis(700));
    wait_for_hit(&store, &k, Duration::from_secs(5)).await;
    let pttl = redis_cli(server.port(), &["PTTL", &k.storage_key]);
    let pttl: i64 = pttl.trim().parse().unwrap_or(-100);
    assert!((1..=700).contains(&pttl), "PTTL was {pttl}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(bounded_get(&store, &k).await, Ok(None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_mismatch_is_a_miss() {
    let server = RedisServer::start();
    let store = connect(config(server.url()));
    let k = key(3);
    // Another prompt's answer under this key's name.
    store.put(&k, entry(digest(999), "other"), Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(5);
    while redis_cli(server.port(), &["EXISTS", &k.storage_key]).trim() != "1" {
        assert!(Instant::now() < deadline, "the write never landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(bounded_get(&store, &k).await, Ok(None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_under_the_key_is_a_miss() {
    let server = RedisServer::start();
    let store = connect(config(server.url()));
    let k = key(4);
    redis_cli(server.port(), &["SET", &k.storage_key, "not json"]);
    assert_eq!(bounded_get(&store, &k).await, Ok(None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_then_restarted() {
    let mut server = RedisServer::start();
    let store = connect(config(server.url()));
    let k = key(5);
    store.put(&k, entry(k.digest, "before"), Duration::from_secs(60));
    wait_for_hit(&store, &k, Duration::from_secs(5)).await;

    server.stop();
    let mut cooled = false;
    for _ in 0..20 {
        match bounded_get(&store, &k).await {
            Ok(None) | Err(StoreError::Failed(_)) | Err(StoreError::Timeout) => {}
            Err(StoreError::CoolingDown) => cooled = true,
            Ok(Some(_)) => panic!("a hit from a dead Redis"),
        }
        // Writes never fail or block either.
        let _ = store.put(&k, entry(k.digest, "during"), Duration::from_secs(60));
    }
    assert!(cooled, "the store never went into cool-down");

    server.restart();
    wait_for_recovery(&store, 6, Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_server_times_out_then_cools_down() {
    let silent = SilentServer::start().await;
    let store = connect(RedisConfig {
        lookup_timeout: Duration::from_millis(50),
        cooldown: Duration::from_secs(30),
        ..config(silent.url())
    });
    let k = key(7);
    for _ in 0..3 {
        assert_eq!(bounded_get(&store, &k).await, Err(StoreError::Timeout));
    }
    // Skipped without touching the network: answers at once.
    let started = Instant::now();
    assert_eq!(bounded_get(&store, &k).await, Err(StoreError::CoolingDown));
    assert!(started.elapsed() < Duration::from_millis(50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_write_queue_drops() {
    let silent = SilentServer::start().await;
    let store = connect(RedisConfig {
        write_queue: 1,
        connect_timeout: Duration::from_secs(5),
        ..config(silent.url())
    });
    let before = dropped_total();
    let outcomes: Vec<WriteOutcome> = (0..20)
        .map(|n| {
            let k = key(100 + n);
            store.put(&k, entry(k.digest, "x"), Duration::from_secs(60))
        })
        .collect();
    assert_eq!(outcomes[0], WriteOutcome::Accepted);
    let dropped = outcomes
        .iter()
        .filter(|o| **o == WriteOutcome::Dropped)
        .count();
    assert!(
        dropped >= 18,
        "only {dropped} of 20 writes dropped with a queue of 1"
    );
    assert!(dropped_total() >= before + dropped as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writes_are_bounded_in_bytes_by_the_memory_budget() {
    let silent = SilentServer::start().await;
    let budget = sluice_sdk::MemoryBudget::new(64 * 1024);
    let store = RedisStore::connect(
        RedisConfig {
            write_queue: 1000,
            connect_timeout: Duration::from_secs(5),
            ..config(silent.url())
        },
        budget.clone(),
    );
    let big = "x".repeat(20 * 1024);
    let outcomes: Vec<WriteOutcome> = (0..10)
        .map(|n| {
            let k = key(200 + n);
            store.put(&k, entry(k.digest, &big), Duration::from_secs(60))
        })
        .collect();
    let accepted = outcomes
        .iter()
        .filter(|o| **o == WriteOutcome::Accepted)
        .count();
    // The queue has room for 1000; the budget for about three of these.
    assert!((1..=3).contains(&accepted), "{accepted} of 10 accepted");
    assert!(budget.used() <= 64 * 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_started_while_redis_is_down() {
    // Held until Redis starts on it: refused meanwhile, as a Redis that is not there yet.
    let port = reserve_port();
    let store = connect(config(format!("redis://{}", port.addr())));
    let k = key(8);
    assert!(bounded_get(&store, &k).await.is_err());
    let _server = RedisServer::start_on(port);
    wait_for_recovery(&store, 9, Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_spreads_keys_over_slots() {
    let cluster = RedisCluster::start(3);
    let store = connect(RedisConfig {
        url: None,
        cluster_nodes: cluster.urls(),
        ..config(String::new())
    });
    let keys: Vec<CacheKey> = (0..50).map(|n| key(1000 + n)).collect();
    for k in &keys {
        assert_eq!(
            store.put(k, entry(k.digest, "c"), Duration::from_secs(60)),
            WriteOutcome::Accepted
        );
    }
    for k in &keys {
        let got = wait_for_hit(&store, k, Duration::from_secs(10)).await;
        assert_eq!(got.digest, k.digest);
    }
    let sizes = cluster.dbsizes();
    assert_eq!(sizes.iter().sum::<u64>(), 50, "keys per node: {sizes:?}");
    assert!(sizes.iter().all(|&n| n > 0), "keys per node: {sizes:?}");
}

#[test]
fn config_defaults_and_validation() {
    let c: RedisConfig = serde_json::from_value(json!({"url": "redis://127.0.0.1:6379"}))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.lookup_timeout, Duration::from_millis(25));
    assert_eq!(c.connect_timeout, Duration::from_secs(1));
    assert_eq!(c.failure_threshold, 3);
    assert_eq!(c.cooldown, Duration::from_secs(5));
    assert_eq!(c.write_queue, 1024);
    assert!(c.cluster_nodes.is_empty());
    assert_eq!(c.validate(), Ok(()));

    let c: RedisConfig = serde_json::from_value(json!({
        "cluster_nodes": ["redis://a:1", "redis://b:2"], "lookup_timeout": "10ms", "cooldown": "1m"
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.lookup_timeout, Duration::from_millis(10));
    assert_eq!(c.cooldown, Duration::from_secs(60));
    assert_eq!(c.validate(), Ok(()));

    assert!(serde_json::from_value::<RedisConfig>(json!({"url": "redis://x", "nope": 1})).is_err());
    assert!(serde_json::from_value::<RedisConfig>(
        json!({"url": "redis://x", "lookup_timeout": "soon"})
    )
    .is_err());

    let both = RedisConfig {
        url: Some("redis://a".into()),
        cluster_nodes: vec!["redis://b".into()],
        ..RedisConfig::default()
    };
    assert_eq!(both.validate().map_err(|e| e.key), Err("url".to_string()));
    assert_eq!(
        RedisConfig::default().validate().map_err(|e| e.key),
        Err("url".to_string())
    );
    let bad_url = RedisConfig {
        url: Some("http://nope".into()),
        ..RedisConfig::default()
    };
    assert_eq!(
        bad_url.validate().map_err(|e| e.key),
        Err("url".to_string())
    );
    let zero_queue = RedisConfig {
        url: Some("redis://a".into()),
        write_queue: 0,
        ..RedisConfig::default()
    };
    assert_eq!(
        zero_queue.validate().map_err(|e| e.key),
        Err("write_queue".to_string())
    );
}

#[test]
fn connect_outside_a_runtime_does_not_panic() {
    // Config loading happens before any runtime exists; the store starts on first use.
    let nobody = reserve_port();
    let store = connect(config(format!("redis://{}", nobody.addr())));
    let k = key(10);
    assert_eq!(
        store.put(&k, entry(k.digest, "x"), Duration::from_secs(1)),
        WriteOutcome::Accepted
    );
}
