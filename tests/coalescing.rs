//! End-to-end: request coalescing in the real binary, against an upstream that counts how many
//! requests it is serving at once. The issue's acceptance test: the coalesced followers of a
//! failed leader cause at most one new upstream request at a time.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MODEL: &str = "test-model";

/// An upstream that answers every request after `delay`: with a 500 if it arrived while
/// `failing`, else with a recorded vLLM chat completion. It counts requests, and the most it
/// served at once.
struct Counting {
    addr: SocketAddr,
    failing: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
}

impl Counting {
    async fn start(delay: Duration, failing: bool) -> Counting {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = Counting {
            addr: listener.local_addr().unwrap(),
            failing: Arc::new(AtomicBool::new(failing)),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
            total: Arc::default(),
        };
        let (failing, in_flight, max, total) = (
            up.failing.clone(),
            up.in_flight.clone(),
            up.max_in_flight.clone(),
            up.total.clone(),
        );
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (failing, in_flight, max, total) = (
                    failing.clone(),
                    in_flight.clone(),
                    max.clone(),
                    total.clone(),
                );
                tokio::spawn(async move {
                    while read_request(&mut stream).await {
                        total.fetch_add(1, Ordering::SeqCst);
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        max.fetch_max(now, Ordering::SeqCst);
                        let fail = failing.load(Ordering::SeqCst);
                        tokio::time::sleep(delay).await;
                        // Done before the answer leaves: the proxy cannot send the next
                        // request of a hand-over before it has this answer.
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        if stream.write_all(&answer(fail)).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        up
    }

    fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until a request is being served.
    async fn until_busy(&self) {
        let busy = wait_for(Duration::from_secs(5), || async { self.in_flight() > 0 }).await;
        assert!(busy.is_some(), "the leader never reached the upstream");
    }
}

fn answer(fail: bool) -> Vec<u8> {
    let (status, body) = if fail {
        (
            "500 Internal Server Error",
            br#"{"error":{"message":"the engine failed","type":"InternalServerError","param":null,"code":500}}"#.to_vec(),
        )
    } else {
        ("200 OK", fixture("vllm-chat-completion.json"))
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Reads one request (head and `content-length` body); `false` once the connection ends.
async fn read_request(stream: &mut tokio::net::TcpStream) -> bool {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// A proxy with the cache on in front of `upstream`; `coalesce` is the cache's `coalesce`
/// section. The backend is never ejected, so that every request led goes to the upstream
/// (ejected, the hand-over would go on as quick 503s that the upstream never sees).
async fn proxy(upstream: &Counting, coalesce: Value) -> Proxy {
    let main = pool("main", &[MODEL], &[upstream.addr])
        .without_health_checks()
        .with("outlier_detection", json!({"consecutive_failures": 0}));
    Proxy::start(json!({
        "pools": [main],
        "plugins": {"cache": {
            "enabled": true, "coalesce": coalesce, "tenant": {"anonymous": "share"}}},
    }))
    .await
}

/// One client for many requests at once: a connection each.
fn many_client(n: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(n)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Sends `n` copies of `request` at once; returns `(status, x-cache)` of each.
async fn ask_many(proxy: &Proxy, request: &Value, n: usize) -> Vec<(u16, String)> {
    let client = many_client(n);
    let url = proxy.url("/v1/chat/completions");
    let asks = (0..n).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        let request = request.clone();
        tokio::spawn(async move {
            let r = client.post(url).json(&request).send().await.unwrap();
            let cache = r
                .headers()
                .get("x-cache")
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default();
            let status = r.status().as_u16();
            let _ = r.bytes().await.unwrap();
            (status, cache)
        })
    });
    let mut out = Vec::new();
    for a in futures_util::future::join_all(asks).await {
        out.push(a.unwrap());
    }
    out
}

async fn requests(proxy: &Proxy, result: &str) -> f64 {
    let series = format!(r#"llm_cache_requests_total{{result="{result}"}}"#);
    proxy.metric(&series).await.unwrap_or(0.0)
}

/// How many followers the acceptance test sends: the issue asks for 500, which a 2-core
/// machine serves in well under a second.
const FOLLOWERS: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_of_a_failed_leader_go_upstream_one_at_a_time() {
    // Every answer fails, slowly: 500 after 400 ms.
    let upstream = Counting::start(Duration::from_millis(400), true).await;
    let proxy = proxy(
        &upstream,
        json!({"max_followers": FOLLOWERS, "max_wait": "3s"}),
    )
    .await;
    let request = chat(MODEL, "everyone asks, the engine fails", false);

    let leader = tokio::spawn({
        let url = proxy.url("/v1/chat/completions");
        let request = request.clone();
        async move { ask_url(&url, &request, &[]).await.status }
    });
    upstream.until_busy().await;
    let followers = ask_many(&proxy, &request, FOLLOWERS).await;
    assert_eq!(
        leader.await.unwrap(),
        500,
        "the leader gets the upstream's error"
    );

    assert_eq!(
        upstream.max_in_flight(),
        1,
        "the upstream served {} requests of one key at once",
        upstream.max_in_flight()
    );
    // The lead passed on, one follower at a time, until the others' wait ended.
    let sent = upstream.total();
    assert!(
        sent >= 3,
        "{sent} upstream requests: the lead was not passed on"
    );
    let errors = followers.iter().filter(|(s, _)| *s == 500).count();
    let timed_out = followers.iter().filter(|(s, _)| *s == 504).count();
    assert_eq!(
        errors,
        sent - 1,
        "each follower sent upstream got its answer"
    );
    assert_eq!(errors + timed_out, FOLLOWERS, "{followers:?}");
    assert_eq!(requests(&proxy, "miss").await, (FOLLOWERS + 1) as f64);
    assert_eq!(requests(&proxy, "coalesced").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_stored_after_a_hand_over_reaches_every_follower() {
    let upstream = Counting::start(Duration::from_millis(300), true).await;
    let proxy = proxy(&upstream, json!({})).await;
    let request = chat(MODEL, "the first try fails", false);

    let leader = tokio::spawn({
        let url = proxy.url("/v1/chat/completions");
        let request = request.clone();
        async move { ask_url(&url, &request, &[]).await.status }
    });
    upstream.until_busy().await;
    // The leader's request fails; the next one (the promoted follower's) succeeds.
    let recover = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        upstream.failing.store(false, Ordering::SeqCst);
    };
    let (followers, ()) = tokio::join!(ask_many(&proxy, &request, 20), recover);
    assert_eq!(leader.await.unwrap(), 500);

    assert_eq!(
        upstream.total(),
        2,
        "the leader, then one promoted follower"
    );
    assert_eq!(upstream.max_in_flight(), 1);
    let misses = followers.iter().filter(|(s, c)| *s == 200 && c == "MISS");
    let hits = followers.iter().filter(|(s, c)| *s == 200 && c == "HIT");
    assert_eq!((misses.count(), hits.count()), (1, 19), "{followers:?}");
    assert_eq!(requests(&proxy, "coalesced").await, 19.0);
    assert_eq!(requests(&proxy, "miss").await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_max_followers_go_upstream_themselves() {
    let upstream = Counting::start(Duration::from_millis(500), false).await;
    let proxy = proxy(&upstream, json!({"max_followers": 2})).await;
    let request = chat(MODEL, "a small crowd", false);

    let leader = tokio::spawn({
        let url = proxy.url("/v1/chat/completions");
        let request = request.clone();
        async move { ask_url(&url, &request, &[]).await.x_cache }
    });
    upstream.until_busy().await;
    let others = ask_many(&proxy, &request, 5).await;
    assert_eq!(leader.await.unwrap(), "MISS");

    assert_eq!(upstream.total(), 4, "the leader and 3 beyond the cap");
    assert!(
        others.iter().all(|(status, _)| *status == 200),
        "never refused"
    );
    let hits = others.iter().filter(|(_, c)| c == "HIT").count();
    assert_eq!(hits, 2, "two followers: {others:?}");
    assert_eq!(requests(&proxy, "coalesced").await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_client_leaves_stops_waiting() {
    let upstream = Counting::start(Duration::from_secs(2), true).await;
    let proxy = proxy(&upstream, json!({})).await;
    let request = chat(MODEL, "one of us leaves", false);

    let leader = tokio::spawn({
        let url = proxy.url("/v1/chat/completions");
        let request = request.clone();
        async move { ask_url(&url, &request, &[]).await.status }
    });
    upstream.until_busy().await;
    assert_eq!(requests(&proxy, "miss").await, 1.0, "the leader");

    // A follower sends its request, then its client goes away while the leader runs.
    let body = serde_json::to_vec(&request).unwrap();
    let mut gone = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    gone.write_all(head.as_bytes()).await.unwrap();
    gone.write_all(&body).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(gone);

    // It is done with at once (a miss), not when the leader fails.
    let left = wait_for(Duration::from_millis(800), || async {
        requests(&proxy, "miss").await == 2.0
    })
    .await;
    assert!(
        left.is_some(),
        "the follower still waits for a client that left"
    );
    assert_eq!(
        upstream.in_flight(),
        1,
        "while the leader is still upstream"
    );
    assert_eq!(leader.await.unwrap(), 500);
    // Nobody was waiting any more: the failure hands the lead to no one.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(upstream.total(), 1);
}
