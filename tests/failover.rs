//! Failures upstream that a careful proxy saves the request from.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::SimConfig;

const MODEL: &str = "test-model";

/// What [`answers_once_per_connection`] does with the second request on a connection.
#[derive(Clone, Copy, PartialEq)]
enum Second {
    /// Closes the connection without a byte of answer: what a backend that died, or closed an
    /// idle connection, looks like to the next request sent on it.
    Dropped,
    /// Keeps the connection open and never answers: a backend busy with it.
    Held,
}

/// An upstream that answers the first request of each connection (keeping it alive), and
/// reads a second one on it without a byte of answer, as `second` says. Counts the requests it
/// got, and of those the second ones, all connections together.
async fn answers_once_per_connection(
    second: Second,
) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (got, seconds) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let counts = (got.clone(), seconds.clone());
    let answer = fixture("vllm-chat-completion.json");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let ((got, seconds), answer) = (counts.clone(), answer.clone());
            tokio::spawn(async move {
                // The first request, whole (head and body), is answered.
                if read_request(&mut s).await.is_none() {
                    return;
                }
                got.fetch_add(1, Ordering::Relaxed);
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    answer.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(&answer).await;
                // The second one on the same connection is never answered.
                if read_request(&mut s).await.is_some() {
                    got.fetch_add(1, Ordering::Relaxed);
                    seconds.fetch_add(1, Ordering::Relaxed);
                    if second == Second::Held {
                        // Held open until the proxy lets go.
                        let mut rest = [0u8; 1];
                        let _ = s.read(&mut rest).await;
                    }
                }
            });
        }
    });
    (addr, got, seconds)
}

/// Reads one request, head and `content-length` body; its head, lower-cased, or `None` when
/// the connection ends first.
async fn read_request(s: &mut tokio::net::TcpStream) -> Option<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        let n = s.read(&mut buf).await.ok().filter(|n| *n > 0)?;
        got.extend_from_slice(&buf[..n]);
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while got.len() < head_end + length {
        let n = s.read(&mut buf).await.ok().filter(|n| *n > 0)?;
        got.extend_from_slice(&buf[..n]);
    }
    Some(head)
}

/// An upstream that rate-limits one API key (as a provider, or another Sluice, does): a
/// request with `Bearer throttled` gets 429 with OpenAI's reset header, any other the chat
/// answer. Counts the 429s.
async fn throttles_one_key() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let throttled = Arc::new(AtomicUsize::new(0));
    let count = throttled.clone();
    let answer = fixture("vllm-chat-completion.json");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (count, answer) = (count.clone(), answer.clone());
            tokio::spawn(async move {
                while let Some(head) = read_request(&mut s).await {
                    let (status, extra, body) = if head.contains("authorization: bearer throttled")
                    {
                        count.fetch_add(1, Ordering::Relaxed);
                        let body = br#"{"error":{"message":"Rate limit reached for your key","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
                        (
                            "429 Too Many Requests",
                            "x-ratelimit-reset-requests: 60s\r\n",
                            body.to_vec(),
                        )
                    } else {
                        ("200 OK", "", answer.clone())
                    };
                    let head = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n",
                        body.len()
                    );
                    if s.write_all(head.as_bytes()).await.is_err()
                        || s.write_all(&body).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, throttled)
}

/// One client's upstream 429, about its own key (the pool forwards clients' keys), paused
/// the backends for everyone: two requests with that key took the whole pool out, and every
/// other client got `503 no-healthy-backend` for a minute. The pause is now the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_own_429_does_not_pause_the_pool_for_everyone() {
    let (a, throttled_a) = throttles_one_key().await;
    let (b, throttled_b) = throttles_one_key().await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[a, b])
            .without_health_checks()
            .with("forward_client_key", true)
            .with("balancing", json!({"strategy": "round_robin"})),
    ]}))
    .await;
    for i in 0..2 {
        let r = proxy
            .ask(
                &chat(MODEL, &format!("over {i}"), false),
                &[("authorization", "Bearer throttled")],
            )
            .await;
        assert_eq!(r.status, 429, "{}", r.body);
    }
    let throttled = throttled_a.load(Ordering::Relaxed) + throttled_b.load(Ordering::Relaxed);
    assert!(throttled >= 2, "both backends said 429: {throttled}");
    for i in 0..4 {
        let r = proxy
            .ask(
                &chat(MODEL, &format!("fine {i}"), false),
                &[("authorization", "Bearer fine")],
            )
            .await;
        assert_eq!(r.status, 200, "another client: {}", r.body);
    }
    for backend in [a, b] {
        let state = proxy.backend_status("main", backend).await;
        assert_ne!(state["health"], "cooling_down", "{state}");
    }
}

/// Back-pressure pauses are bounded as ejections are: when every backend asks for one, at
/// most `max_ejection_percent` of them (one always) pause, and the rest keep answering with
/// their own 429, which the client gets, never a 503 of Sluice's for a pool emptied by pauses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_pressure_pauses_at_most_the_share_ejections_may_take() {
    let (a, _) = failing_upstream(Some(429), "retry-after: 30\r\n").await;
    let (b, _) = failing_upstream(Some(429), "retry-after: 30\r\n").await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[a, b])
            .without_health_checks()
            .with("balancing", json!({"strategy": "round_robin"})),
    ]}))
    .await;
    for i in 0..6 {
        let r = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(r.status, 429, "request {i}: {}", r.body);
    }
    let mut cooling = 0;
    for backend in [a, b] {
        if proxy.backend_status("main", backend).await["health"] == "cooling_down" {
            cooling += 1;
        }
    }
    assert_eq!(cooling, 1, "one of two may pause (max_ejection_percent 50)");
}

/// A request sent on a pooled connection that turns out dead (no byte of answer came) is sent
/// again on a new connection to the same backend: the client never sees the keep-alive race,
/// even where the pool has no other backend (a disaggregated pool's one decode engine got
/// 502s when its uvicorn closed an idle connection as the decode leg went out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_dead_reused_connection_is_sent_again_on_a_new_one() {
    let (dying, _, dropped) = answers_once_per_connection(Second::Dropped).await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[dying])
            .without_health_checks()
            // A dead pooled connection must not count against its backend.
            .with("outlier_detection", json!({"consecutive_failures": 1})),
    ]}))
    .await;
    for i in 0..8 {
        let a = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
    }
    let dropped = dropped.load(Ordering::Relaxed);
    assert!(
        dropped >= 1,
        "no request met a dead reused connection: the test proves nothing"
    );
    let resent = proxy
        .metric_once("sluice_upstream_stale_connections_total", dropped as f64)
        .await;
    assert_eq!(resent, Some(dropped as f64), "each counted");
    let elsewhere = proxy
        .metric_once(
            r#"sluice_upstream_unanswered_retries_total{pool="main"}"#,
            0.0,
        )
        .await;
    assert_eq!(elsewhere, Some(0.0), "the same backend took each again");
}

/// A request on a pooled connection whose backend takes it and stays silent is not sent
/// again when the first-byte timeout ends it: only a connection found closed is (the backend
/// may still be generating the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_on_a_pooled_connection_is_not_sent_again() {
    let (silent, got, _) = answers_once_per_connection(Second::Held).await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[silent])
            .without_health_checks()
            .with("timeouts", json!({"first_byte": "1s"})),
    ]}))
    .await;
    let first = proxy.ask(&chat(MODEL, "first", false), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    // The connection is kept; the next request goes out on it and meets silence.
    let second = proxy.ask(&chat(MODEL, "second", false), &[]).await;
    assert_eq!(second.status, 504, "{}", second.body);
    assert_eq!(got.load(Ordering::Relaxed), 2, "the second was sent once");
    let resent = proxy
        .metric_once("sluice_upstream_stale_connections_total", 0.0)
        .await;
    assert_eq!(resent, Some(0.0));
}

/// An upstream that reads each request whole and closes the connection without a byte of
/// answer, as a backend killed mid-request does; counts them.
async fn closes_unanswered() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let closed = Arc::new(AtomicUsize::new(0));
    let count = closed.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            if read_request(&mut s).await.is_some() {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    (addr, closed)
}

/// A request sent on a fresh connection that the backend closes before any byte of answer
/// (a backend killed under load) goes to another backend: nothing answered it, and a backend
/// that dropped the connection is not working on it. Two of 19,239 requests got a 502 when a
/// backend was killed under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_backend_dropped_unanswered_goes_to_another_backend() {
    let (closing, closed) = closes_unanswered().await;
    let healthy = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[closing, healthy.addr()])
            .without_health_checks()
            .with("balancing", json!({"strategy": "round_robin"}))
            .with("outlier_detection", json!({"consecutive_failures": 0})),
    ]}))
    .await;
    for i in 0..6 {
        let a = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
    }
    let closed = closed.load(Ordering::Relaxed);
    assert!(closed >= 1, "no request met the closing backend");
    let retried = proxy
        .metric_once(
            r#"sluice_upstream_unanswered_retries_total{pool="main"}"#,
            closed as f64,
        )
        .await;
    assert_eq!(retried, Some(closed as f64));
}

/// An upstream that answers every request with `status`, an OpenAI error body and the
/// `extra` header lines, or never answers when `status` is `None`; counts the requests.
async fn failing_upstream(
    status: Option<u16>,
    extra: &'static str,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let count = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                while read_request(&mut s).await.is_some() {
                    count.fetch_add(1, Ordering::Relaxed);
                    let Some(status) = status else {
                        // Silent: holds the connection until the proxy gives up on it.
                        let _ = s.read(&mut [0u8; 1]).await;
                        return;
                    };
                    let body = format!(
                        r#"{{"error":{{"message":"failing","type":"Error","param":null,"code":{status}}}}}"#
                    );
                    let head = format!(
                        "HTTP/1.1 {status} Failing\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n",
                        body.len()
                    );
                    if s.write_all(head.as_bytes()).await.is_err()
                        || s.write_all(body.as_bytes()).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, requests)
}

/// A pool of a failing backend and a healthy one, taken in turn, retrying on `on`.
async fn retrying_on(failing: SocketAddr, healthy: SocketAddr, on: &[&str], extra: Value) -> Proxy {
    let mut p = pool("main", &[MODEL], &[failing, healthy])
        .without_health_checks()
        .with("balancing", json!({"strategy": "round_robin"}))
        // Failures must not eject the backend here: each request is to meet it in turn.
        .with("outlier_detection", json!({"consecutive_failures": 0}))
        .with(
            "retry",
            json!({"max_retries": 1, "min_retries": 100, "backoff_base": "1ms", "on": on}),
        );
    if let Value::Object(keys) = extra {
        for (key, value) in keys {
            p = p.with(&key, value);
        }
    }
    Proxy::start(json!({ "pools": [p] })).await
}

/// The statuses of `n` requests.
async fn statuses(proxy: &Proxy, n: usize) -> Vec<u16> {
    let mut got = Vec::new();
    for i in 0..n {
        got.push(
            proxy
                .ask(&chat(MODEL, &format!("q{i}"), false), &[])
                .await
                .status,
        );
    }
    got
}

/// As nginx's `proxy_next_upstream`: a pool retries the error statuses its `retry.on` lists,
/// and hands the others to the client as the upstream sent them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_retries_the_statuses_it_lists_and_no_others() {
    let (failing, hits) = failing_upstream(Some(500), "").await;
    let healthy = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();

    let proxy = retrying_on(failing, healthy.addr(), &["http_503"], json!({})).await;
    let got = statuses(&proxy, 6).await;
    let passed_on = got.iter().filter(|s| **s == 500).count();
    assert!(passed_on >= 1, "{got:?}");
    assert_eq!(
        passed_on,
        hits.load(Ordering::Relaxed),
        "a 500 was retried: {got:?}"
    );
    drop(proxy);

    let before = hits.load(Ordering::Relaxed);
    let proxy = retrying_on(failing, healthy.addr(), &["error", "http_500"], json!({})).await;
    let got = statuses(&proxy, 6).await;
    assert!(got.iter().all(|s| *s == 200), "{got:?}");
    assert!(
        hits.load(Ordering::Relaxed) > before,
        "the failing backend was never met"
    );
}

/// A backend that sends nothing within `timeouts.first_byte`: the client gets 504, unless the
/// pool lists `timeout`, in which case another backend answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_byte_timeout_is_retried_only_when_the_pool_lists_it() {
    let (silent, hits) = failing_upstream(None, "").await;
    let healthy = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    // The silent backend never answers; the healthy one must always beat the bound, even on a
    // busy machine.
    let timeouts = json!({"timeouts": {"first_byte": "2s"}});

    let proxy = retrying_on(silent, healthy.addr(), &["http_503"], timeouts.clone()).await;
    let got = statuses(&proxy, 4).await;
    assert!(got.contains(&504), "{got:?}");
    assert_eq!(
        got.iter().filter(|s| **s == 504).count(),
        hits.load(Ordering::Relaxed)
    );
    drop(proxy);

    let before = hits.load(Ordering::Relaxed);
    let proxy = retrying_on(silent, healthy.addr(), &["timeout"], timeouts).await;
    let got = statuses(&proxy, 4).await;
    assert!(got.iter().all(|s| *s == 200), "{got:?}");
    assert!(
        hits.load(Ordering::Relaxed) > before,
        "the silent backend was never met"
    );
}

/// A backend that asks for a pause (429 with `Retry-After`) gets no new request until the
/// pause is over; its neighbours take the traffic meanwhile, and it is not ejected for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_asks_for_a_pause_gets_one() {
    let (busy, asked) = failing_upstream(Some(429), "retry-after: 2\r\n").await;
    let healthy = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[busy, healthy.addr()])
            .without_health_checks()
            .with("balancing", json!({"strategy": "round_robin"}))
            // Its 429 is tried again on the other backend at once.
            .with("retry", json!({"max_retries": 1, "min_retries": 100, "backoff_base": "1ms"})),
    ]}))
    .await;
    for i in 0..10 {
        let a = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
    }
    assert_eq!(
        asked.load(Ordering::Relaxed),
        1,
        "asked again during its pause"
    );
    let state = proxy.backend_status("main", busy).await;
    assert_eq!(state["health"], "cooling_down", "{state}");

    // Its pause (2 s) is over once the proxy no longer counts it as cooling down.
    let over = wait_for(std::time::Duration::from_secs(10), || async {
        proxy.backend_status("main", busy).await["health"] != "cooling_down"
    })
    .await;
    assert!(
        over.is_some(),
        "still cooling down: {}",
        proxy.backend_status("main", busy).await
    );
    for i in 0..4 {
        proxy
            .ask(&chat(MODEL, &format!("later {i}"), false), &[])
            .await;
    }
    assert!(
        asked.load(Ordering::Relaxed) >= 2,
        "never asked again after its pause"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_is_logged_in_its_requests_span_with_its_number_and_backend() {
    let dead = reserve_port();
    let sim = sim_serving(MODEL).await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[dead.addr(), sim.addr()])
            .without_health_checks()
            .with("balancing", json!({"strategy": "round_robin"}))
    ]}))
    .await;
    // Round robin: one of two requests starts on the dead backend, then moves on.
    for n in 0..2 {
        let id = format!("span-test-{n}");
        let answer = proxy
            .ask(&chat(MODEL, "hello", false), &[("x-request-id", &id)])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let dead = dead.addr().to_string();
    let logs = proxy.logs();
    let failed = logs
        .lines()
        .find(|l| l.contains("upstream attempt failed"))
        .unwrap_or_else(|| panic!("no failed attempt in\n{logs}"));
    // The failure is logged inside the request's span, naming the attempt and its backend
    // (attempts have a span of their own only in traces).
    assert!(
        failed.contains("request{request_id=\"span-test-"),
        "{failed}"
    );
    assert!(failed.contains("attempt=1"), "{failed}");
    assert!(failed.contains(&dead), "{failed}");
}
