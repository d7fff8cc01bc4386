//! End-to-end: the real binary between real clients and real upstreams, on free ports.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sluice_testkit::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::{Faults, SimConfig};

const MODEL: &str = "test-model";

async fn sim() -> vllm_sim::Sim {
    sim_serving(MODEL).await
}

/// The last chat request `upstream` received. Its health checks are recorded too, so the
/// last request of all may be a scrape that came after it.
fn last_chat(upstream: &vllm_sim::Sim) -> vllm_sim::RecordedRequest {
    upstream
        .stats()
        .recent
        .iter()
        .rev()
        .find(|r| r.path == "/v1/chat/completions")
        .cloned()
        .expect("a chat request was recorded")
}

/// The pool `main`, serving [`MODEL`] on `backends`.
fn main_pool(backends: &[SocketAddr]) -> Pool {
    pool("main", &[MODEL], backends)
}

/// The worker is still up and answering after whatever a test did to it.
async fn still_serves(proxy: &Proxy) {
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat(MODEL, "still there?", false))
        .send()
        .await
        .expect("proxy reachable");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

async fn error_of(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let response_reason = response
        .headers()
        .get("x-sluice-rejected")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body: Value = response.json().await.expect("an OpenAI error body");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert_eq!(body["error"]["code"], status, "{body}");
    // The same reason as the header, machine-readable in the body.
    let header = response_reason.unwrap_or_default();
    assert_eq!(body["error"]["reason"], header.as_str(), "{body}");
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_answers_pass_byte_for_byte_both_ways() {
    let answer = fixture("vllm-chat-completion.json");
    let upstream = Scripted::start(Script::fixed("application/json", answer.clone())).await;
    let proxy =
        Proxy::start(json!({"pools": [main_pool(&[upstream.addr]).without_health_checks()]})).await;

    // Odd spacing, key order and an unknown field: the upstream must get these exact bytes.
    let sent = br#"{ "messages" : [{"content":"What is the capital of France?","role":"user"}],
        "model":"test-model", "x_vendor_field": {"keep": [1, 2]} }"#;
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "rid-from-client")
        .body(sent.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sluice-pool"], "main");
    assert_eq!(r.headers()["x-request-id"], "rid-from-client");
    assert_eq!(r.bytes().await.unwrap().as_ref(), answer.as_slice());

    let received = upstream.received.lock().unwrap().clone();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].body, sent.to_vec());
    let head = received[0].head.to_ascii_lowercase();
    assert!(head.contains("x-request-id: rid-from-client"), "{head}");
    assert!(
        head.contains(&format!("content-length: {}", sent.len())),
        "{head}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_byte_for_byte_and_chunk_by_chunk() {
    let fixture_bytes = fixture("vllm-chat-stream.sse");
    let text = String::from_utf8(fixture_bytes.clone()).unwrap();
    let events: Vec<Vec<u8>> = text
        .split_inclusive("\n\n")
        .map(|e| e.as_bytes().to_vec())
        .collect();
    let n_events = events.len();
    let upstream = Scripted::start(Script::event_stream(events, Duration::from_millis(150))).await;
    let proxy =
        Proxy::start(json!({"pools": [main_pool(&[upstream.addr]).without_health_checks()]})).await;

    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat(MODEL, "What is the capital of France?", true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut stream = r.bytes_stream();
    let mut got = Vec::new();
    let mut first_chunk_at = None;
    let mut chunks = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        first_chunk_at.get_or_insert_with(Instant::now);
        chunks += 1;
        got.extend_from_slice(&chunk);
    }
    assert_eq!(got, fixture_bytes, "the stream must arrive unchanged");
    // Unbuffered: the first event reached the client before the upstream wrote its last one,
    // and events were not merged into one write.
    // The upstream notes its last write just after making it: the client may have read it
    // first.
    let mut upstream_done = None;
    for _ in 0..100 {
        upstream_done = *upstream.last_write.lock().unwrap();
        if upstream_done.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let upstream_done = upstream_done.expect("upstream finished");
    assert!(first_chunk_at.unwrap() < upstream_done);
    assert!(chunks >= n_events, "{chunks} chunks for {n_events} events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_prompt_reaches_the_upstream_intact() {
    // A model with a context long enough for ~300k prompt tokens.
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_max_model_len(1 << 20),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let prompt = "lorem ipsum ".repeat(1024 * 1024 / 12 + 1);
    let body = serde_json::to_vec(&chat(MODEL, &prompt, false)).unwrap();
    assert!(body.len() > 1024 * 1024);
    for stream in [false, true] {
        let mut request: Value = serde_json::from_slice(&body).unwrap();
        request["stream"] = json!(stream);
        let bytes = serde_json::to_vec(&request).unwrap();
        let r = client()
            .post(proxy.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(bytes.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        assert!(!text.contains("\"error\""), "{text}");
        if stream {
            assert_eq!(sse_data(&text).last().map(String::as_str), Some("[DONE]"));
        }
        let recorded = last_chat(&upstream);
        assert_eq!(
            Sha256::digest(&recorded.body),
            Sha256::digest(&bytes),
            "body changed on the way"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_another_backend() {
    let upstream = sim().await;
    let dead = reserve_port();
    // Without health checks, so that the request path alone finds the dead backend.
    let proxy = Proxy::start(json!({
        "pools": [main_pool(&[dead.addr(), upstream.addr()]).without_health_checks()]
    }))
    .await;
    for _ in 0..6 {
        still_serves(&proxy).await;
    }
    assert_eq!(upstream.stats().count("/v1/chat/completions"), 6);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(r#"sluice_upstream_attempts_total{outcome="connect_error",pool="main"}"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_pool_gets_502_and_a_hanging_one_504() {
    let hanging = sim().await;
    hanging.set_faults(Faults {
        hang_before_headers: true,
        ..Faults::default()
    });
    let dead = reserve_port();
    let proxy = Proxy::start(json!({"pools": [
        pool("dead", &["dead-model"], &[dead.addr()]).without_health_checks(),
        pool("slow", &["slow-model"], &[hanging.addr()])
            .with("timeouts", json!({"first_byte": "500ms", "total": "5s"}))
            .without_health_checks(),
    ]}))
    .await;

    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat("dead-model", "hi", false))
        .send()
        .await
        .unwrap();
    let (status, body) = error_of(r).await;
    assert_eq!(status, 502, "{body}");

    let started = Instant::now();
    let r = client()
        .post(proxy.url("/v1/completions"))
        .json(&json!({"model": "slow-model", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    let (status, body) = error_of(r).await;
    assert_eq!(status, 504, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by first_byte"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_bodies_get_400_with_the_parameter_named() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let cases: &[(&[u8], Option<&str>, &str)] = &[
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2, 3]", None, "JSON object"),
        (br#"{"model":"test-model","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#, Some("stream"), "stream"),
        (br#"{"model":"test-model"}"#, Some("messages"), "messages"),
        (br#"{"model":"test-model","messages":[{"role":7}]}"#, Some("messages[0].role"), "role"),
        (b"{\"model\":\"test-model\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", None, "UTF-8"),
        (b"", None, "not valid JSON"),
    ];
    for (body, param, needle) in cases {
        let r = client()
            .post(proxy.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await
            .unwrap();
        let (status, err) = error_of(r).await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"].as_str(), *param, "{err}");
        assert_eq!(err["error"]["type"], "BadRequestError");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }
    assert_eq!(
        upstream.stats().count("/v1/chat/completions"),
        0,
        "bad requests never go upstream"
    );
    still_serves(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_routes_and_methods() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat("no-such-model", "hi", false))
        .send()
        .await
        .unwrap();
    let (status, err) = error_of(r).await;
    assert_eq!(
        (status, err["error"]["param"].as_str()),
        (404, Some("model"))
    );
    let (status, _) = error_of(client().get(proxy.url("/nowhere")).send().await.unwrap()).await;
    assert_eq!(status, 404);
    let (status, _) = error_of(
        client()
            .get(proxy.url("/v1/chat/completions"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_get_413() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "limits": {"max_request_body_bytes": BODY_LIMIT},
        "pools": [main_pool(&[upstream.addr()])],
    }))
    .await;
    // Declared over the limit: refused after the body is drained, so the client reads it.
    let body = serde_json::to_vec(&chat(MODEL, &"x".repeat(100_000), false)).unwrap();
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(body)
        .send()
        .await
        .unwrap();
    let (status, _) = error_of(r).await;
    assert_eq!(status, 413);
    // Chunked, so only counting can tell: refused when the count passes the limit, with a
    // 413 the client gets to read (not a reset connection).
    let answer = chunked_post_over_the_limit(proxy.addr).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert_eq!(upstream.stats().count("/v1/chat/completions"), 0);
    still_serves(&proxy).await;
}

const BODY_LIMIT: usize = 65536;

/// POSTs a chunked body on a raw socket: chunks up to [`BODY_LIMIT`] bytes, then one byte
/// more, and no end. Returns what came back (the answer's head), or how the connection ended
/// without one. The last chunk crosses the limit with its last byte, so the proxy has read
/// all that was sent when it answers: a close then cannot reset the connection and lose it.
async fn chunked_post_over_the_limit(proxy: SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunk = |size: usize| {
        [
            format!("{size:x}\r\n").into_bytes(),
            vec![b' '; size],
            b"\r\n".to_vec(),
        ]
        .concat()
    };
    let mut sent = head.as_bytes().to_vec();
    for _ in 0..BODY_LIMIT / 8192 {
        sent.extend(chunk(8192));
    }
    sent.extend(chunk(1));
    if let Err(e) = s.write_all(&sent).await {
        return format!("the request could not be sent: {e}");
    }
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
        let lossy = String::from_utf8_lossy(&answer);
        match read {
            Err(_) => return format!("no answer within 5 s (got {lossy:?})"),
            Ok(Ok(0)) => return format!("closed without an answer (got {lossy:?})"),
            Ok(Err(e)) => return format!("{e} instead of an answer (got {lossy:?})"),
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_content_length_or_a_stalled_body_gets_408() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "limits": {"client_body_timeout": "500ms"},
        "pools": [main_pool(&[upstream.addr()])],
    }))
    .await;

    // Promises 1000 bytes, sends 20, waits.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":\"test-model")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut answer))
        .await
        .expect("answered within the body timeout")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":408"), "{answer}");

    // Stops mid-body and goes away: nobody to answer, and the worker carries on.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{\"mod",
    )
    .await
    .unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(upstream.stats().count("/v1/chat/completions"), 0);
    still_serves(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_and_not_forwarded() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let body = serde_json::to_vec(&chat(MODEL, "hi", false)).unwrap();
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 100"));
    s.write_all(&body).await.unwrap();
    let mut rest = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&rest[..n]).contains("200 OK"));
    let recorded = last_chat(&upstream);
    assert!(recorded.header("expect").is_none());
}

/// What a client only declares costs nothing: sockets that declared bodies, were invited to
/// send them (`100 Continue`) and sent nothing held the whole memory budget, and every other
/// request got `503 memory-budget`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_declared_and_never_sent_do_not_spend_the_memory_budget() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "limits": {"max_request_body_bytes": 1_048_576, "max_buffered_bytes": 8_388_608},
        "pools": [main_pool(&[upstream.addr()])],
    }))
    .await;
    let mut idle = Vec::new();
    for _ in 0..8 {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: 1048576\r\n\r\n",
        )
        .await
        .unwrap();
        // Invited: its request is being read, its body awaited.
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 100"));
        idle.push(s);
    }
    let a = proxy
        .ask(&chat(MODEL, "a normal request", false), &[])
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Once the normal request's own body is given back, nothing is held for the others.
    let none_held = wait_for(Duration::from_secs(5), || async {
        proxy.metric("sluice_memory_buffered_bytes").await == Some(0.0)
    })
    .await;
    assert!(none_held.is_some(), "bytes held for bodies never sent");
    drop(idle);
}

/// A client's `Connection` header cannot name the framing or the target away: named there,
/// `Content-Length` was removed after Sluice set it, and the upstream got an empty body;
/// `Host`, and uvicorn answered 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_header_cannot_remove_the_body_length_or_the_host() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let body = serde_json::to_vec(&chat(MODEL, "framed", false)).unwrap();
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: keep-alive, content-length, host\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    let mut answer = vec![0u8; 8192];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let recorded = last_chat(&upstream);
    assert_eq!(recorded.body, body, "the body arrived whole");
    assert!(recorded.header("host").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_drops_mid_stream_ends_with_an_error_event() {
    let upstream = sim().await;
    upstream.set_faults(Faults {
        drop_after_chunks: Some(3),
        ..Faults::default()
    });
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat(MODEL, "tell me more", true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the status was sent before the failure");
    let text = r
        .text()
        .await
        .expect("a complete chunked body, not a cut one");
    assert_ends_with_error_event(&text, 3);
    upstream.set_faults(Faults::default());
    still_serves(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_frees_the_upstream() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(50), 200).await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let mut request = chat(MODEL, "a long story", true);
    request["max_tokens"] = json!(200);
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&request)
        .send()
        .await
        .unwrap();
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();
    assert_eq!(upstream.stats().running, 1);
    drop(stream);
    // The proxy notices, aborts the attempt, and the simulator sees its client go.
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.stats().running > 0 {
        assert!(
            Instant::now() < deadline,
            "the upstream request was not cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    still_serves(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_routes_proxy_like_proxy_pass() {
    let llm = sim().await;
    let other = Scripted::start(Script::fixed("text/plain", b"from the web pool".to_vec())).await;
    let proxy = Proxy::start(json!({
        "pools": [
            main_pool(&[llm.addr()]),
            pool("web", &[], &[other.addr]).without_health_checks(),
        ],
        "routes": [
            {"path_prefix": "/version", "pool": "main"},
            {"name": "web", "path_prefix": "/web", "host": "web.example", "pool": "web"},
        ],
    }))
    .await;

    let r = client().get(proxy.url("/version")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["version"].is_string(), "{v}");

    let r = client()
        .get(proxy.url("/web/page?x=1"))
        .header("host", "web.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "from the web pool");
    let head = other.received.lock().unwrap()[0].head.clone();
    assert!(head.starts_with("GET /web/page?x=1 HTTP/1.1"), "{head}");

    // The host-specific route does not match another host.
    let r = client().get(proxy.url("/web/page")).send().await.unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_the_union_of_the_pools() {
    let (a, b) = (sim().await, sim().await);
    let proxy = Proxy::start(json!({"pools": [
        pool("a", &["m1", "m2"], &[a.addr()]),
        pool("b", &["m2", "m3"], &[b.addr()]),
    ]}))
    .await;
    let v: Value = client()
        .get(proxy.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m1", "m2", "m3"]);
    assert_eq!(v["object"], "list");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    still_serves(&proxy).await;

    let get = |path: &str| client().get(proxy.admin_url(path)).send();
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    // Only an address, `localhost` or a configured name, as the Host: a page in a browser
    // cannot read the admin through DNS rebinding.
    let as_host = |host: &'static str| {
        client()
            .get(proxy.admin_url("/status"))
            .header("host", host)
            .send()
    };
    assert_eq!(as_host("attacker.example").await.unwrap().status(), 421);
    assert_eq!(as_host("localhost:9090").await.unwrap().status(), 200);
    assert_eq!(as_host("[::1]:9090").await.unwrap().status(), 200);
    assert_eq!(get("/readyz").await.unwrap().status(), 200);
    assert_eq!(get("/nope").await.unwrap().status(), 404);

    let status: Value = get("/status").await.unwrap().json().await.unwrap();
    assert_eq!(status["plugins"], json!(["request_id"]));
    assert_eq!(status["pools"][0]["name"], "main");
    assert_eq!(
        status["pools"][0]["backends"][0]["resolved"],
        upstream.addr().to_string()
    );

    let metrics = get("/metrics").await.unwrap();
    assert!(metrics.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let mut metrics = metrics.text().await.unwrap();
    // The request is logged (and counted) just after its answer reached the client.
    let counted = r#"sluice_requests_total{route="chat",status="2xx"} 1"#;
    for _ in 0..50 {
        if metrics.contains(counted) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        metrics = get("/metrics").await.unwrap().text().await.unwrap();
    }
    for series in [
        r#"llm_request_duration_seconds_count{cache_hit="false",model="test-model"} 1"#,
        r#"router_request_duration_seconds_count{pool="main"} 1"#,
        r#"sluice_requests_total{route="chat",status="2xx"} 1"#,
        "# TYPE sluice_stream_first_byte_seconds histogram",
        "# TYPE router_rejections_total counter",
    ] {
        assert!(metrics.contains(series), "missing {series} in\n{metrics}");
    }
    // Sluice's own time: the request's, once; its answer's chunks, at least one.
    let count = |phase: &str| {
        let line = format!("sluice_added_seconds_count{{phase=\"{phase}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(count("request"), 1, "{metrics}");
    assert!(count("chunk") >= 1, "{metrics}");
    check_prometheus_format(&metrics);
}

/// Runs the reference parser (Python's prometheus_client) on the exposition, when present.
fn check_prometheus_format(text: &str) {
    let script = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
families = list(text_string_to_metric_families(sys.stdin.read()))
assert families, "no metric families"
"#;
    let child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("python3 not found: skipping the reference-parser check");
        return;
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the reference parser rejected /metrics (pip install prometheus_client?): {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_requests_sent_back_to_back_all_arrive_whole() {
    // A client sends its next request the moment it has the previous answer; none of its
    // bytes may be taken by the proxy while it finishes the previous exchange.
    let upstream = sim().await;
    let proxy = Proxy::start(json!({"pools": [main_pool(&[upstream.addr()])]})).await;
    let body = serde_json::to_vec(&chat(MODEL, "again", false)).unwrap();
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let request = [
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes(),
        body,
    ]
    .concat();
    let mut buf = Vec::new();
    for i in 0..300 {
        s.write_all(&request).await.unwrap();
        // Read exactly one response: head, then content-length bytes.
        let (head_end, len) = loop {
            let mut chunk = [0u8; 8192];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed after {i} requests");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..pos]).to_ascii_lowercase();
                assert!(head.starts_with("http/1.1 200"), "request {i}: {head}");
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
                break (pos + 4, len);
            }
        };
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 8192];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0);
            buf.extend_from_slice(&chunk[..n]);
        }
        buf.drain(..head_end + len);
    }
}

/// A backend that answers every chat request with a fixed completion over keep-alive, and
/// notes each connection it accepted and, per request, whether its first read held the whole
/// request (header and body).
async fn counting_backend() -> (
    SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    std::sync::Arc<std::sync::Mutex<Vec<bool>>>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let whole_at_once = Arc::new(Mutex::new(Vec::new()));
    let (counted, noted) = (Arc::clone(&connections), Arc::clone(&whole_at_once));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let noted = Arc::clone(&noted);
            tokio::spawn(async move {
                let answer = json!({"id": "chatcmpl-1", "object": "chat.completion",
                    "created": 1, "model": MODEL, "choices": [{"index": 0,
                    "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
                .to_string();
                loop {
                    let mut buf = Vec::new();
                    let mut first = None;
                    let total = loop {
                        let mut chunk = [0u8; 65536];
                        let Ok(n) = s.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        first.get_or_insert(n);
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        if buf.len() >= end + 4 + length {
                            break end + 4 + length;
                        }
                    };
                    noted.lock().unwrap().push(first == Some(total));
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    if s.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, connections, whole_at_once)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_requests_reuse_one_upstream_connection_each_sent_in_one_write() {
    let (backend, connections, whole_at_once) = counting_backend().await;
    let proxy =
        Proxy::start(json!({"pools": [main_pool(&[backend]).without_health_checks()]})).await;
    for i in 0..5 {
        let answer = proxy
            .ask(&chat(MODEL, &format!("one by one {i}"), false), &[])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    // One connection, taken back from the pool for each request after the first.
    assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Each request came whole in one read: header and body were one write.
    assert_eq!(*whole_at_once.lock().unwrap(), vec![true; 5]);
}

/// The LLM routes' idle pool kept `upstream_keepalive_pool_size` connections, and a backend
/// without one of them had its connection closed after each answer: with more backends than
/// places, the first busy ones kept every place and the others connected anew for every
/// request. Every backend now keeps one idle connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_backend_keeps_an_idle_connection_however_small_the_pool() {
    let mut sims = Vec::new();
    for _ in 0..6 {
        sims.push(sim().await);
    }
    let addrs: Vec<SocketAddr> = sims.iter().map(vllm_sim::Sim::addr).collect();
    let proxy = Proxy::start(json!({
        "pingora": {"upstream_keepalive_pool_size": 2},
        "pools": [main_pool(&addrs)
            .without_health_checks()
            .with("balancing", json!({"strategy": "round_robin"}))],
    }))
    .await;
    for i in 0..60 {
        let answer = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    // One each; a second only if one was lost in between (say, on a busy machine).
    let per_backend: Vec<u64> = sims.iter().map(|s| s.stats().connections).collect();
    assert!(
        per_backend.iter().all(|&c| (1..=2).contains(&c)),
        "connections each backend accepted: {per_backend:?}"
    );
}
