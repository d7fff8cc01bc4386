//! Peers Sluice trusts more than its clients, lying to it over real sockets: a backend's KV
//! event publisher that declares a frame of a terabyte or streams one of 100 MB, and a backend
//! whose `/kv_event_sources` names 20,000 endpoints. The proxy goes on serving; the peer
//! hurts nothing but its own backend's index, and what it did is counted.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use vllm_sim::SimConfig;

const MODEL: &str = "m";

fn tokenizer_dir() -> String {
    format!(
        "{}/tests/fixtures/tokenizer-chatml",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// A proxy whose one pool, on `sim`, follows its KV events from `kv_events`.
async fn following(sim: &vllm_sim::Sim, kv_events: impl Into<Value>) -> Proxy {
    Proxy::start(json!({"pools": [
        pool("p", &[MODEL], &[sim.addr()])
            .with("tokenizer", tokenizer_dir())
            .with("kv_events", kv_events)
            .with("balancing", json!({"strategy": "kv_aware"}))
    ]}))
    .await
}

/// A ZMTP publisher that lies: greets and says READY as vLLM's PUB does, then sends the
/// `n`th connection's lie, and holds the connection. Raw bytes, no ZMQ library: the lie is
/// the point. Counts the connections it accepted.
fn lying_publisher(lies: Vec<Vec<u8>>) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let n = count.fetch_add(1, Ordering::SeqCst);
            let lie = lies[n.min(lies.len() - 1)].clone();
            std::thread::spawn(move || {
                let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
                greeting.extend_from_slice(&{
                    let mut m = [0u8; 20];
                    m[..4].copy_from_slice(b"NULL");
                    m
                });
                greeting.extend_from_slice(&[0u8; 32]);
                let mut theirs = [0u8; 64];
                if stream.write_all(&greeting).is_err() || stream.read_exact(&mut theirs).is_err() {
                    return;
                }
                let ready = b"\x05READY\x0bSocket-Type\0\0\0\x03PUB";
                let _ = stream.write_all(&[0x04, ready.len() as u8]);
                let _ = stream.write_all(ready);
                let _ = stream.write_all(&lie);
                // Holds the connection until Sluice drops it.
                let mut sink = [0u8; 4096];
                while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    (port, accepted)
}

/// A long message frame's header declaring `len` bytes.
fn long_frame(len: u64) -> Vec<u8> {
    let mut header = vec![0x02];
    header.extend_from_slice(&len.to_be_bytes());
    header
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn errors(metrics: &str, reason: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("sluice_kv_event_errors_total{"))
        .filter(|l| l.contains(&format!("reason=\"{reason}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One 9-byte frame header declaring 2^40 bytes aborted the whole proxy (zeromq 0.7 reserved
/// the declared size); a real 100 MB message cost gigabytes. Both are now refused at the
/// header, the connection dropped and counted, and the proxy serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_kv_event_publisher_cannot_kill_or_bloat_the_proxy() {
    let sim = sim_serving(MODEL).await;
    // Second connection: a real-looking 100 MB message, its bytes sent after the header.
    let mut big = long_frame(100 * 1024 * 1024);
    big.extend(std::iter::repeat_n(0u8, 8 * 1024 * 1024));
    let (port, accepted) = lying_publisher(vec![long_frame(1 << 40), big]);
    let proxy = following(&sim, json!({"port": port})).await;
    let baseline = rss_kib(proxy.pid());
    let refused = wait_for(Duration::from_secs(30), || async {
        errors(&proxy.metrics().await, "too_large") >= 2.0
    })
    .await;
    assert!(
        refused.is_some(),
        "both lies counted (connections: {}): {}",
        accepted.load(Ordering::SeqCst),
        proxy.logs()
    );
    let answer = proxy.ask(&chat(MODEL, "still there?", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let grown = rss_kib(proxy.pid()).saturating_sub(baseline);
    assert!(grown < 100 * 1024, "the proxy grew by {grown} KiB");
}

/// A backend whose `/kv_event_sources` lists 20,000 endpoints (other hosts among them) got a
/// ZMQ connection for each, renewed every few seconds: a connection storm from every proxy.
/// Now only its own address is followed, one connection per data-parallel rank at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backends_kv_event_sources_cannot_send_the_proxy_anywhere() {
    let (port, accepted) = lying_publisher(vec![Vec::new()]);
    let sources: Vec<Value> = (0..20_000)
        .map(|i| match i % 3 {
            0 => json!({"endpoint": format!("tcp://*:{port}"), "topic": ""}),
            1 => json!({"endpoint": format!("tcp://127.0.0.2:{}", 20_000 + i % 100)}),
            _ => json!({"endpoint": "tcp://evil.example:5557"}),
        })
        .collect();
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_served_model_names(vec![MODEL.to_string()])
            .with_kv_event_sources(json!(sources)),
    )
    .await
    .unwrap();
    let proxy = following(&sim, "auto").await;
    // The first 16 entries name the backend's own publisher 6 times: all six subscribed
    // (before, every one of the 6,667 entries naming it connected at once).
    wait_for(Duration::from_secs(30), || async {
        accepted.load(Ordering::SeqCst) >= 6
    })
    .await
    .expect("the backend's own publisher is followed");
    let fds = std::fs::read_dir(format!("/proc/{}/fd", proxy.pid()))
        .unwrap()
        .count();
    assert!(fds < 200, "{fds} descriptors open");
    assert!(accepted.load(Ordering::SeqCst) <= 16);
    let answer = proxy.ask(&chat(MODEL, "still there?", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
}

fn batch(seq: u64, event: rmpv::Value) -> zeromq::ZmqMessage {
    let mut payload = Vec::new();
    let batch = rmpv::Value::Array(vec![rmpv::Value::F64(0.0), rmpv::Value::Array(vec![event])]);
    rmpv::encode::write_value(&mut payload, &batch).unwrap();
    zeromq::ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
        bytes::Bytes::from(payload),
    ])
    .unwrap()
}

fn block_stored(hash: u64, block_size: u64, tokens: u32) -> rmpv::Value {
    use rmpv::Value;
    Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![Value::from(hash)]),
        Value::Nil,
        Value::Array((0..tokens).map(Value::from).collect()),
        Value::from(block_size),
        Value::Nil,
        "GPU".into(),
    ])
}

/// One event naming a block size of 2^40 set the pool's: every request was cut at it and no
/// backend was credited again. Now it is refused, and the pool's size stays its engines'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publishers_block_size_no_engine_has_is_refused() {
    use zeromq::{Socket, SocketSend};
    let sim = sim_serving(MODEL).await;
    let mut publisher = zeromq::PubSocket::new();
    let zeromq::Endpoint::Tcp(_, port) = publisher.bind("tcp://127.0.0.1:0").await.unwrap() else {
        panic!("tcp")
    };
    let proxy = following(&sim, json!({"port": port})).await;
    let prefix = |status: &Value| status["pools"][0]["prefix_index"].clone();
    // Published until heard: a subscription reaches a PUB socket some time after it connects.
    let mut seq = 0;
    loop {
        publisher
            .send(batch(seq, block_stored(seq + 1, 16, 16)))
            .await
            .unwrap();
        seq += 1;
        let heard = proxy
            .metrics()
            .await
            .lines()
            .any(|l| l.starts_with("sluice_prefix_index_blocks{") && !l.ends_with(" 0"));
        if heard {
            break;
        }
        assert!(seq < 2000, "the subscriber never heard the publisher");
    }
    let lie = rmpv::Value::Array(vec![
        "BlockStored".into(),
        rmpv::Value::Array(Vec::new()),
        rmpv::Value::Nil,
        rmpv::Value::Array(Vec::new()),
        rmpv::Value::from(1u64 << 40),
        rmpv::Value::Nil,
        "GPU".into(),
    ]);
    publisher.send(batch(seq, lie)).await.unwrap();
    let refused = wait_for(Duration::from_secs(10), || async {
        prefix(&proxy.status().await)["refused_events"].as_u64() == Some(1)
    })
    .await;
    let status = proxy.status().await;
    assert!(refused.is_some(), "{}", prefix(&status));
    assert_eq!(prefix(&status)["block_size"], 16);
}

/// A publisher that falls silent with its connection open (its process stopped, the path
/// blackholed) was followed for ever, its backend credited with blocks the engine may long
/// have evicted. Now, once the engine's `/metrics` shows it computed prompt tokens and no batch
/// came for 15 s, the connection is dropped (`reason="silent"`), the blocks forgotten, and
/// the publisher followed again when it can be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_publisher_is_dropped_and_its_blocks_forgotten() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_served_model_names(vec![MODEL.to_string()])
            .with_tokenizer(tokenizer_dir())
            .v1_engine(2048)
            .with_kv_events(vllm_sim::KvEventsConfig {
                replay_port: None,
                ..vllm_sim::KvEventsConfig::default()
            }),
    )
    .await
    .unwrap();
    let (publisher, _) = sim.kv_event_endpoints().unwrap();
    let publisher: std::net::SocketAddr = publisher.trim_start_matches("tcp://").parse().unwrap();
    // The path to the publisher, which can be blackholed: what it sends is held an hour.
    let path = SlowRelay::start(publisher, Duration::ZERO).await;
    let proxy = Proxy::start(json!({"pools": [
        pool("p", &[MODEL], &[sim.addr()])
            .with_fast_health_checks()
            .with("tokenizer", tokenizer_dir())
            .with("kv_events", json!({"port": path.addr().port()}))
            .with("balancing", json!({"strategy": "kv_aware"}))
    ]}))
    .await;
    let blocks = || async {
        proxy.status().await["pools"][0]["backends"][0]["prefix_index"]["blocks"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut asked = 0;
    let followed = asking_until(&proxy, &mut asked, Duration::from_secs(30), || async {
        blocks().await > 0
    })
    .await;
    assert!(followed, "the index follows the events: {}", proxy.logs());

    path.set_delay(Duration::from_secs(3600));
    // The engine computes prompts, and stores and publishes their blocks; nothing arrives.
    let dropped = asking_until(&proxy, &mut asked, Duration::from_secs(90), || async {
        errors(&proxy.metrics().await, "silent") >= 1.0
    })
    .await;
    assert!(dropped, "the silent publisher is dropped: {}", proxy.logs());
    assert_eq!(blocks().await, 0, "its blocks are forgotten");

    // The path comes back: followed again (new connections are relayed at once).
    path.set_delay(Duration::ZERO);
    let again = asking_until(&proxy, &mut asked, Duration::from_secs(60), || async {
        blocks().await > 0
    })
    .await;
    assert!(again, "followed again: {}", proxy.logs());
}

/// Asks `proxy` fresh prompts (numbered on from `asked`), each answered 200, until `done`
/// says so after one; whether it did within `within`.
async fn asking_until<F, Fut>(
    proxy: &Proxy,
    asked: &mut usize,
    within: Duration,
    mut done: F,
) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        *asked += 1;
        let words = "a fresh prompt of many words ".repeat(30);
        let request = chat(MODEL, &format!("{asked}: {words}"), false);
        assert_eq!(proxy.ask(&request, &[]).await.status, 200);
        if done().await {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
    }
}
