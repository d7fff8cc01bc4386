//! Every fault mode, switched in-process and over HTTP.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::{ErrorShape, Faults, Latency, SimConfig};

fn stream_body() -> Value {
    let mut b = chat_body("stream with faults");
    b["stream"] = json!(true);
    b["max_tokens"] = json!(10);
    b
}

#[tokio::test]
async fn error_rate_with_statuses() {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(Faults::error_rate(0.5, 503));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(post(&sim, "/v1/chat/completions", &chat_body("x")).await.0);
    }
    assert_eq!(statuses, vec![200, 503, 200, 503]);
    for status in [429u16, 500, 503] {
        sim.set_faults(Faults::error_rate(1.0, status));
        let (s, v) = post(&sim, "/v1/chat/completions", &chat_body("x")).await;
        assert_eq!(s, status);
        assert_eq!(v["error"]["code"], status);
    }
    // Random mode: rate 1.0 still always fails.
    sim.set_faults(Faults {
        error_random: true,
        ..Faults::error_rate(1.0, 500)
    });
    assert_eq!(
        post(&sim, "/v1/completions", &json!({"prompt": "x"}))
            .await
            .0,
        500
    );
    sim.set_faults(Faults::none());
    assert_eq!(
        post(&sim, "/v1/chat/completions", &chat_body("x")).await.0,
        200
    );
    assert!(sim.stats().faults_injected >= 6);
    sim.shutdown();
}

#[tokio::test]
async fn faults_over_http() {
    let sim = sim(SimConfig::default().with_error_shape(ErrorShape::Old)).await;
    let c = client();
    let r = c
        .post(format!("{}/sim/faults", sim.url()))
        .body(r#"{"error_rate": 1.0, "error_status": 429}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let f: Value = c
        .get(format!("{}/sim/faults", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(f["error_status"], 429);
    assert_eq!(sim.faults().error_rate, 1.0);
    let (s, v) = post(&sim, "/v1/chat/completions", &chat_body("x")).await;
    assert_eq!(s, 429);
    assert_eq!(v["object"], "error");
    assert_eq!(v["code"], 429);
    let r = c
        .post(format!("{}/sim/faults", sim.url()))
        .body(r#"{"nonsense": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    c.post(format!("{}/sim/faults", sim.url()))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(sim.faults(), Faults::default());
    let st: Value = c
        .get(format!("{}/sim/stats", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(st["errors"], 1);
    // /sim/* requests are not counted.
    assert_eq!(st["requests_total"], 1);
    sim.shutdown();
}

#[tokio::test]
async fn hang_before_headers() {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(Faults {
        hang_before_headers: true,
        ..Faults::default()
    });
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let t = Instant::now();
    let err = c
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&chat_body("x"))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(t.elapsed() >= Duration::from_millis(250));
    // Health still answers.
    assert_eq!(
        c.get(format!("{}/health", sim.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    sim.shutdown();
}

#[tokio::test]
async fn hang_mid_stream_keeps_connection_open() {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(Faults {
        hang_after_chunks: Some(2),
        ..Faults::default()
    });
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&stream_body())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut s = r.bytes_stream();
    let mut got = String::new();
    loop {
        match tokio::time::timeout(Duration::from_millis(400), s.next()).await {
            Ok(Some(Ok(b))) => got.push_str(&String::from_utf8_lossy(&b)),
            Ok(other) => panic!(
                "stream ended instead of hanging: {:?}",
                other.map(|r| r.map(|_| ()))
            ),
            Err(_) => break, // hung, connection still open
        }
    }
    assert_eq!(got.matches("data: ").count(), 2, "{got}");
    sim.shutdown();
}

/// Raw HTTP/1.1 so we can see the chunked framing bytes.
async fn raw_post(
    addr: std::net::SocketAddr,
    path: &str,
    body: &str,
) -> (Vec<u8>, Option<std::io::Error>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let err = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .expect("connection should be closed by the server")
        .err();
    (out, err)
}

#[tokio::test]
async fn drop_mid_stream_truncates_chunked_body() {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(Faults {
        drop_after_chunks: Some(3),
        ..Faults::default()
    });
    let (raw, _) = raw_post(
        sim.addr(),
        "/v1/chat/completions",
        &stream_body().to_string(),
    )
    .await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("transfer-encoding: chunked"));
    assert_eq!(text.matches("data: ").count(), 3, "{text}");
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "must not send the chunked terminator: {text}"
    );
    // A real client sees a body error.
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&stream_body())
        .send()
        .await
        .unwrap();
    assert!(r.text().await.is_err());
    // Non-stream answers are cut short of their content-length.
    let (raw, _) = raw_post(
        sim.addr(),
        "/v1/chat/completions",
        &chat_body("x").to_string(),
    )
    .await;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(body.len() < len);
    sim.shutdown();
}

#[tokio::test]
async fn error_inside_stream() {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(Faults {
        error_after_chunks: Some(1),
        ..Faults::default()
    });
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&stream_body())
        .send()
        .await
        .unwrap();
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.len(), 3);
    assert!(events[0].contains("\"role\":\"assistant\""));
    let e: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(e["error"]["code"], 500);
    assert_eq!(events[2], "[DONE]");
    sim.shutdown();
}

#[tokio::test]
async fn refuse_connections_then_resume_on_same_port() {
    let sim = sim(SimConfig::default()).await;
    let addr = sim.addr();
    let admin = sim
        .serve_admin("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let c = client();
    assert_eq!(
        post(&sim, "/v1/chat/completions", &chat_body("x")).await.0,
        200
    );
    // Switch over the admin port, which keeps answering.
    c.post(format!("http://{admin}/sim/faults"))
        .body(r#"{"refuse_connections": true}"#)
        .send()
        .await
        .unwrap();
    let mut refused = false;
    for _ in 0..100 {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                refused = true;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    assert!(refused, "connections should be refused");
    let f: Value = c
        .get(format!("http://{admin}/sim/faults"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(f["refuse_connections"], true);
    sim.set_faults(Faults::none());
    let mut ok = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ok, "listener should be back on {addr}");
    assert_eq!(
        post(&sim, "/v1/chat/completions", &chat_body("x")).await.0,
        200
    );
    sim.shutdown();
}

#[tokio::test]
async fn engine_dead() {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(Faults {
        engine_dead: true,
        ..Faults::default()
    });
    let r = client()
        .get(format!("{}/health", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let (s, v) = post(&sim, "/v1/chat/completions", &chat_body("x")).await;
    assert_eq!(s, 500);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("EngineCore"));
    sim.set_faults(Faults::none());
    assert_eq!(
        client()
            .get(format!("{}/health", sim.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    sim.shutdown();
}

#[tokio::test]
async fn slowdown_multiplies_latency() {
    let cfg = SimConfig::default()
        .with_latency(Latency::new(
            Duration::from_millis(40),
            Duration::ZERO,
            Duration::from_millis(5),
        ))
        .with_answer_tokens(4, 4);
    let sim = sim(cfg).await;
    let t = Instant::now();
    assert_eq!(
        post(&sim, "/v1/chat/completions", &chat_body("x")).await.0,
        200
    );
    let normal = t.elapsed();
    assert!(normal >= Duration::from_millis(55), "{normal:?}");
    sim.set_faults(Faults {
        slowdown: 5.0,
        ..Faults::default()
    });
    let t = Instant::now();
    assert_eq!(
        post(&sim, "/v1/chat/completions", &chat_body("x")).await.0,
        200
    );
    let slow = t.elapsed();
    assert!(slow >= Duration::from_millis(275), "{slow:?}");
    sim.shutdown();
}

#[tokio::test]
async fn streaming_latency_ttft_and_itl() {
    let cfg = SimConfig::default()
        .with_latency(Latency::new(
            Duration::from_millis(100),
            Duration::ZERO,
            Duration::from_millis(30),
        ))
        .with_answer_tokens(5, 5);
    let sim = sim(cfg).await;
    let t = Instant::now();
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&stream_body())
        .send()
        .await
        .unwrap();
    // Headers come before prefill finishes.
    assert!(t.elapsed() < Duration::from_millis(90), "{:?}", t.elapsed());
    let mut s = r.bytes_stream();
    let mut arrivals = Vec::new();
    while let Some(b) = s.next().await {
        let b = b.unwrap();
        arrivals.push((t.elapsed(), String::from_utf8_lossy(&b).into_owned()));
    }
    assert!(
        arrivals[0].0 >= Duration::from_millis(95),
        "TTFT {:?}",
        arrivals[0].0
    );
    let total = arrivals.last().unwrap().0;
    assert!(
        total >= Duration::from_millis(100 + 4 * 30 - 10),
        "{total:?}"
    );
    // Each token arrives in its own chunk, not all at the end.
    assert!(arrivals.len() >= 5, "{arrivals:?}");
    sim.shutdown();
}
