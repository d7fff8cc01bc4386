//! Edge safety, end to end: what a hostile or unlucky client can do, each bound proven on the
//! real binary over real sockets. One test per attack; each names the bound it proves.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use vllm_sim::SimConfig;

const MODEL: &str = "test-model";

async fn sim() -> vllm_sim::Sim {
    sim_serving(MODEL).await
}

/// Reads from `s` until the head of an answer has come (or 5 s pass, or it closes), and
/// returns all that came.
async fn read_answer(s: &mut TcpStream, within: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let until = Instant::now() + within;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&got);
        // A whole answer: a head, and a body as long as it says.
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_string)
                })
                .and_then(|l| l.trim().parse::<usize>().ok());
            if length.is_some_and(|l| body.len() >= l) {
                break;
            }
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn header_of<'a>(answer: &'a str, name: &str) -> Option<&'a str> {
    let head = answer.split("\r\n\r\n").next()?;
    head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

fn body_of(answer: &str) -> Value {
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: not a JSON body in {answer:?}"))
}

/// H1: a client that asks for a long stream and never reads is cut within `send_timeout`,
/// and everything its request held is released: the attempt, its upstream connection and its
/// share of the backend's projected KV usage, which returns to what the backend reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_readers_are_cut_within_the_send_timeout_and_release_the_kv_they_held() {
    // A backend that streams a long answer as fast as it can, with room for all of it.
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_answer_tokens(60_000, 60_000)
            .with_max_model_len(200_000)
            .with_kv(50_000, 16),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({
        "limits": {"send_timeout": "1s"},
        "pools": [pool("main", &[MODEL], &[upstream.addr()]).with_fast_health_checks()],
    }))
    .await;
    let body = serde_json::to_vec(
        &json!({"model": MODEL, "stream": true, "max_tokens": 60_000,
        "messages": [{"role": "user", "content": "tell me everything"}]}),
    )
    .unwrap();
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut s = socket.connect(proxy.addr).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body).await.unwrap();
        stalled.push(s); // never read
    }
    let backend = |status: &Value| status["pools"][0]["backends"][0].clone();
    let started = wait_for(Duration::from_secs(10), || async {
        backend(&proxy.status().await)["in_flight"] == 4
    })
    .await;
    assert!(
        started.is_some(),
        "the 4 streams started: {}",
        proxy.status().await
    );
    let began = Instant::now();

    // Cut once their socket buffers are full and a write waits past the send timeout.
    let released = wait_for(Duration::from_secs(30), || async {
        let b = backend(&proxy.status().await);
        let (scraped, projected) = (
            b["kv_cache_usage"].as_f64(),
            b["projected_kv_cache_usage"].as_f64(),
        );
        b["in_flight"] == 0
            && scraped
                .zip(projected)
                .is_some_and(|(s, p)| (p - s).abs() < 1e-6)
    })
    .await;
    assert!(
        released.is_some(),
        "still held after 30 s: {}",
        backend(&proxy.status().await)
    );
    println!("released {:?} after the streams started", began.elapsed());
    // The stalled clients get what was already in their socket buffers, then the end: their
    // connections were closed.
    for mut s in stalled {
        let mut sink = vec![0u8; 1 << 20];
        let mut drained = 0usize;
        let closed = loop {
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut sink)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(n)) if drained < 256 << 20 => drained += n,
                Ok(Ok(_)) | Err(_) => break false,
            }
        };
        assert!(
            closed,
            "a stalled reader's connection stays open ({drained} bytes read)"
        );
    }
}

/// Sends `body` with `Expect: 100-continue`: waits for the `100`, sends the body, returns the
/// final answer.
async fn post_expecting_continue(proxy: SocketAddr, path: &str, body: &[u8]) -> String {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut interim = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut interim))
        .await
        .unwrap()
        .unwrap();
    let interim = String::from_utf8_lossy(&interim[..n]).into_owned();
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim:?}");
    s.write_all(body).await.unwrap();
    read_answer(&mut s, Duration::from_secs(5)).await
}

/// H2: an error Sluice answers after it sent `100 Continue` reaches the client whole, with
/// its status, its OpenAI body and, for 503, its `retry-after`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_after_100_continue_arrive_whole() {
    let upstream = sim().await;
    let dead = reserve_port();
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[upstream.addr()]),
        // Its only backend is dead: once probed, nothing is healthy there.
        pool("dead", &["dead-model"], &[dead.addr()]).with_fast_health_checks(),
    ]}))
    .await;

    let unknown = serde_json::to_vec(&chat("no-such-model", "hi", false)).unwrap();
    let answer = post_expecting_continue(proxy.addr, "/v1/chat/completions", &unknown).await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer:?}");
    assert_eq!(body_of(&answer)["error"]["code"], 404);
    assert_eq!(
        header_of(&answer, "x-sluice-rejected"),
        Some("unknown-model")
    );

    let malformed = b"{\"model\": \"test-model\", \"messages\": [".to_vec();
    let answer = post_expecting_continue(proxy.addr, "/v1/chat/completions", &malformed).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    assert_eq!(body_of(&answer)["error"]["code"], 400);

    let dead_addr = dead.addr();
    wait_for(Duration::from_secs(10), || async {
        proxy.backend_status("dead", dead_addr).await["health"] == "unhealthy"
    })
    .await
    .expect("the dead backend is probed");
    let shed = serde_json::to_vec(&chat("dead-model", "hi", false)).unwrap();
    let answer = post_expecting_continue(proxy.addr, "/v1/chat/completions", &shed).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert!(header_of(&answer, "retry-after").is_some(), "{answer:?}");
    assert_eq!(body_of(&answer)["error"]["code"], 503);
}

/// Sends `bytes` one at a time, `every` apart, until the connection answers or closes;
/// returns what came back and when.
async fn trickle(proxy: SocketAddr, bytes: &[u8], every: Duration) -> (String, Duration) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    for byte in bytes {
        if s.write_all(&[*byte]).await.is_err() {
            break;
        }
        match tokio::time::timeout(every, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                got.extend_from_slice(&buf[..n]);
                break;
            }
            Err(_) => {}
        }
    }
    if !got.is_empty() {
        got.extend(
            read_answer(&mut s, Duration::from_secs(2))
                .await
                .into_bytes(),
        );
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

/// M7: a header or a body trickled a byte at a time is cut at its deadline with 408, however
/// short each gap between two bytes is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_header_or_body_is_cut_at_its_deadline() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "limits": {"client_header_timeout": "1s", "client_body_deadline": "1s",
                   "client_body_timeout": "10s"},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "routes": [{"path_prefix": "/ping", "pool": "main"}],
    }))
    .await;
    let every = Duration::from_millis(100);

    let header =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            .repeat(4);
    let (answer, took) = trickle(proxy.addr, &header, every).await;
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "{answer:?} after {took:?}"
    );
    assert!(took < Duration::from_secs(3), "cut after {took:?}");

    for path in ["/v1/chat/completions", "/ping"] {
        let body = serde_json::to_vec(&chat(MODEL, &"slow ".repeat(20), false)).unwrap();
        let mut request = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        let head_len = request.len();
        request.extend_from_slice(&body);
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(&request[..head_len]).await.unwrap();
        let started = Instant::now();
        let mut answer = String::new();
        for byte in &request[head_len..] {
            if s.write_all(&[*byte]).await.is_err() {
                break;
            }
            let mut buf = [0u8; 4096];
            if let Ok(Ok(n)) = tokio::time::timeout(every, s.read(&mut buf)).await {
                answer = String::from_utf8_lossy(&buf[..n]).into_owned();
                break;
            }
        }
        let took = started.elapsed();
        assert!(
            answer.starts_with("HTTP/1.1 408"),
            "{path}: {answer:?} after {took:?}"
        );
        assert!(took < Duration::from_secs(3), "{path}: cut after {took:?}");
    }
    assert_eq!(upstream.stats().count("/v1/chat/completions"), 0);
}

/// Waits until `proxy` counts `count` client connections open.
async fn open_connections(proxy: &Proxy, count: f64) {
    wait_for(Duration::from_secs(10), || async {
        metric_value(&proxy.metrics().await, "sluice_connections_open") == Some(count)
    })
    .await
    .unwrap_or_else(|| panic!("{count} connections are counted open"));
}

/// M7: connections over the caps, per client address and in total, are answered at once (429
/// and 503 with `retry-after`), never left hanging; a closed connection frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_caps_are_answered_not_left_hanging() {
    let upstream = sim().await;
    let per_client = Proxy::start(json!({
        "limits": {"max_connections_per_client": 2},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
    }))
    .await;
    let held: Vec<TcpStream> = vec![
        TcpStream::connect(per_client.addr).await.unwrap(),
        TcpStream::connect(per_client.addr).await.unwrap(),
    ];
    open_connections(&per_client, 2.0).await;
    let mut third = TcpStream::connect(per_client.addr).await.unwrap();
    let answer = read_answer(&mut third, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer:?}");
    assert_eq!(header_of(&answer, "retry-after"), Some("1"));
    assert_eq!(
        header_of(&answer, "x-sluice-rejected"),
        Some("too-many-connections")
    );
    assert_eq!(body_of(&answer)["error"]["code"], 429);
    drop(held);
    open_connections(&per_client, 0.0).await;
    let r = client()
        .post(per_client.url("/v1/chat/completions"))
        .json(&chat(MODEL, "hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the closed connections freed their places");

    let total = Proxy::start(json!({
        "limits": {"max_connections": 1},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
    }))
    .await;
    let _held = TcpStream::connect(total.addr).await.unwrap();
    open_connections(&total, 1.0).await;
    let mut second = TcpStream::connect(total.addr).await.unwrap();
    let answer = read_answer(&mut second, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert_eq!(header_of(&answer, "retry-after"), Some("1"));
}

/// Requests in flight over the per-client cap are answered 429 with `retry-after` at once,
/// while the client's earlier request goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_in_flight_cap_get_429() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(50), 40).await;
    let proxy = Proxy::start(json!({
        "limits": {"max_requests_in_flight_per_client": 1},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
    }))
    .await;
    let url = proxy.url("/v1/chat/completions");
    let long = tokio::spawn(async move {
        client()
            .post(url)
            .json(&chat(MODEL, "a long one", true))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    // The first request is in flight once the engine runs it.
    wait_for(Duration::from_secs(10), || async {
        upstream.stats().count("/v1/chat/completions") == 1
    })
    .await
    .expect("the first request reached the engine");
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat(MODEL, "one more", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(r.headers()["x-sluice-rejected"], "too-many-requests");
    assert!(
        long.await.unwrap().contains("[DONE]"),
        "the first request went on"
    );
}

/// An upstream that reads whatever body comes (any framing) before it answers 200, and
/// records the most body bytes one request delivered.
async fn body_counting_upstream() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let most = std::sync::Arc::new(AtomicUsize::new(0));
    let record = most.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                let head_end = loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                    if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let mut body = got.len() - head_end;
                // Until the client's side ends (the proxy gave up) or a body's end shows.
                while let Ok(Ok(n)) =
                    tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await
                {
                    if n == 0 {
                        break;
                    }
                    body += n;
                    record.fetch_max(body, Ordering::Relaxed);
                    if buf[..n].ends_with(b"0\r\n\r\n") {
                        break;
                    }
                }
                record.fetch_max(body, Ordering::Relaxed);
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    (addr, most)
}

/// M6: plain routes honour the body limit: a 12 MB body gets 413, declared or chunked, and
/// the upstream never gets the whole of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_routes_refuse_bodies_over_the_limit() {
    let (upstream, most_received) = body_counting_upstream().await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream]).without_health_checks()],
        "routes": [{"path_prefix": "/ping", "pool": "main"}],
    }))
    .await;
    let big = vec![b'x'; 12 * 1024 * 1024];
    let r = client()
        .post(proxy.url("/ping"))
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(most_received.load(std::sync::atomic::Ordering::Relaxed), 0);

    let chunks = futures_util::stream::iter(
        big.chunks(256 * 1024)
            .map(|c| Ok::<_, std::io::Error>(c.to_vec()))
            .collect::<Vec<_>>(),
    );
    let r = client()
        .post(proxy.url("/ping"))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await;
    match r {
        Ok(r) => assert_eq!(r.status(), 413),
        // The proxy may close while the client is still sending: then no status is read,
        // but the upstream must not have got the body either (below).
        Err(e) => println!("chunked: {e}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let received = most_received.load(std::sync::atomic::Ordering::Relaxed);
    assert!(received < big.len(), "the upstream got {received} bytes");
    assert!(
        received <= 8 * 1024 * 1024 + 512 * 1024,
        "the upstream got {received} bytes"
    );
}

/// L6: headers that describe one connection stay on it, both ways; the upstream learns who the
/// client is from `X-Forwarded-For`, which a client cannot forge past an untrusted hop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_stripped_and_forwarded_for_is_set() {
    let upstream = Scripted::start(Script::fixed(
        "application/json",
        fixture("vllm-chat-completion.json"),
    ))
    .await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr]).without_health_checks()],
        "routes": [{"path_prefix": "/plain", "pool": "main"}],
    }))
    .await;
    for path in ["/v1/chat/completions", "/plain"] {
        let r = client()
            .post(proxy.url(path))
            .header("connection", "keep-alive, x-secret")
            .header("x-secret", "1")
            .header("x-forwarded-for", "6.6.6.6")
            .json(&chat(MODEL, "hi", false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let head = upstream
            .received
            .lock()
            .unwrap()
            .last()
            .unwrap()
            .head
            .to_ascii_lowercase();
        assert!(!head.contains("x-secret"), "{path}: {head}");
        assert!(
            head.contains("x-forwarded-for: 127.0.0.1\r\n"),
            "{path}: {head}"
        );
        assert!(!head.contains("6.6.6.6"), "{path}: {head}");
        assert!(head.contains("forwarded: for=127.0.0.1"), "{path}: {head}");
    }
}

/// An upstream that answers 200 as soon as a request's header is in, then reads whatever body
/// still comes.
async fn early_answering_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// N17: on a route whose upstream answers before the upload ends, the rest of the body is
/// body, not the next request's header: an upload slower than `client_header_timeout` (and
/// within the body's own deadlines) gets one answer, not a 408 written into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_of_an_upload_after_an_early_answer_is_not_a_header() {
    let upstream = early_answering_upstream().await;
    let proxy = Proxy::start(json!({
        "limits": {"client_header_timeout": "1s", "client_body_deadline": "20s",
                   "client_body_timeout": "10s"},
        "pools": [pool("main", &[MODEL], &[upstream])],
        "routes": [{"path_prefix": "/upload", "pool": "main"}],
    }))
    .await;
    let chunk = [b'x'; 100];
    let chunks = 30;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        chunk.len() * chunks
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut reader, mut writer) = s.into_split();
    let collect = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_secs(5), reader.read(&mut buf)).await
        {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    // 3 s of upload, 100 ms between writes: three times the header deadline.
    let mut sent = 0;
    for _ in 0..chunks {
        if writer.write_all(&chunk).await.is_err() {
            break;
        }
        sent += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(writer);
    let answer = collect.await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert_eq!(
        answer.matches("HTTP/1.1 ").count(),
        1,
        "one answer, nothing written into it: {answer:?} ({sent} chunks sent)"
    );
}

/// N14: the admin listener is bounded as the proxy's are: one client holding idle connections
/// to it gets 429 past 16, an idle connection is answered 408 once its header is 10 s late,
/// and then the admin answers again (Prometheus is not blinded by one client's flood).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_caps_connections_and_bounds_headers() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let mut idle = Vec::new();
    for _ in 0..20 {
        idle.push(TcpStream::connect(proxy.admin).await.unwrap());
    }
    // Every connection is answered: the 4 over the cap at once, the others at the deadline.
    let answers = futures_util::future::join_all(
        idle.iter_mut()
            .map(|s| read_answer(s, Duration::from_secs(60))),
    )
    .await;
    let status = |code: &str| answers.iter().filter(|a| a.starts_with(code)).count();
    assert_eq!(status("HTTP/1.1 429"), 4, "{answers:?}");
    assert_eq!(status("HTTP/1.1 408"), 16, "{answers:?}");
    drop(idle);
    let back = wait_for(Duration::from_secs(10), || async {
        reqwest::get(format!("http://{}/healthz", proxy.admin))
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(back.is_some(), "the admin never answered again");
}

/// A client that stops reading a streamed answer, then resets its connection, has gone: the
/// proxy's blocked write fails, and the request ends as the client's going (a 499, which
/// counts as no rejection), never as an internal error of the proxy (a slow-client attack
/// showed up as `internal` on dashboards, and as ERROR lines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_resets_a_stalled_stream_counts_as_gone_not_as_an_internal_error() {
    // About 6 MB of events, generated at once: more than the sockets between hold.
    let upstream = vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_model(MODEL)
            .with_max_model_len(65_536)
            .with_kv(8_192, 16)
            .with_latency(vllm_sim::Latency::new(
                Duration::ZERO,
                Duration::ZERO,
                Duration::ZERO,
            ))
            .with_answer_tokens(40_000, 40_000),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let mut request = chat(MODEL, "a long story", true);
    request["max_tokens"] = json!(40_000);
    let body = serde_json::to_vec(&request).unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    let mut start = [0u8; 512];
    let n = s.read(&mut start).await.unwrap();
    assert!(String::from_utf8_lossy(&start[..n]).starts_with("HTTP/1.1 200"));
    // The engine is done; its answer waits in the proxy, whose write to us is blocked.
    let generated = wait_for(Duration::from_secs(30), || async {
        upstream.engine_state().running == 0
    })
    .await;
    assert!(generated.is_some(), "the engine never finished");
    s.set_zero_linger().unwrap();
    drop(s);
    // The request ends (its access-log line), as the client's going, not the proxy's fault.
    let ended = wait_for(Duration::from_secs(30), || async {
        proxy.logs().contains("Downstream WriteError")
    })
    .await;
    assert!(ended.is_some(), "{}", proxy.logs());
    assert_eq!(
        proxy
            .metric(r#"router_rejections_total{priority="-",reason="internal"}"#)
            .await,
        Some(0.0),
        "{}",
        proxy.logs()
    );
    assert!(!proxy.logs().contains("ERROR"), "{}", proxy.logs());
}

/// While the connection cap was spent, 6 of 10 POSTs with a 400-byte body got a broken pipe
/// instead of the 503: the refused socket was closed under the unread body, and the kernel
/// reset it. The refused connection is now drained (a lingering close, as nginx's), so a
/// client still writing its request gets to read the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_still_sending_its_body_reads_the_503() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "limits": {"max_connections": 1},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
    }))
    .await;
    let held = TcpStream::connect(proxy.addr).await.unwrap();
    // The cap is spent once the held connection is counted open.
    wait_for(Duration::from_secs(10), || async {
        metric_value(&proxy.metrics().await, "sluice_connections_open") == Some(1.0)
    })
    .await
    .expect("the held connection is counted");
    let body = "x".repeat(400);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    for attempt in 0..10 {
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let answer = read_answer(&mut s, Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{attempt}: {answer:?}");
    }
    // A client that writes its body after the refusal came, in pieces, is read, not reset.
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let answer = read_answer(&mut s, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    for (i, piece) in request.as_bytes().chunks(8).enumerate() {
        if let Err(e) = s.write_all(piece).await {
            panic!("piece {i} of the request: {e}");
        }
        s.flush().await.unwrap();
    }
    drop(held);
}
