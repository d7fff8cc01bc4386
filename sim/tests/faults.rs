#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Every fault mode, switched in-process and over HTTP.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use vllm_sim::{ErrorShape, Faults, SimConfig};

const CHAT: &str = "/v1/chat/completions";

fn stream_body() -> Value {
    let mut body = streaming(chat_body("stream with faults"));
    body["max_tokens"] = json!(10);
    body
}

async fn chat_status(sim: &vllm_sim::Sim) -> u16 {
    post(sim, CHAT, &chat_body("x")).await.0
}

#[tokio::test]
async fn error_rate_with_statuses() {
    let sim = sim_with_faults(Faults::error_rate(0.5, 503)).await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(chat_status(&sim).await);
    }
    assert_eq!(statuses, vec![200, 503, 200, 503]);
    for status in [429u16, 500, 503] {
        sim.set_faults(Faults::error_rate(1.0, status));
        let (answered, body) = post(&sim, CHAT, &chat_body("x")).await;
        assert_eq!(answered, status);
        assert_eq!(body["error"]["code"], status);
    }
    // Random mode: rate 1.0 still always fails.
    sim.set_faults(Faults {
        error_random: true,
        ..Faults::error_rate(1.0, 500)
    });
    let (status, _) = post(&sim, "/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(status, 500);
    sim.set_faults(Faults::none());
    assert_eq!(chat_status(&sim).await, 200);
    assert!(sim.stats().faults_injected >= 6);
    sim.shutdown();
}

#[tokio::test]
async fn faults_over_http() {
    let sim = sim(SimConfig::default().with_error_shape(ErrorShape::Old)).await;
    let faults_url = format!("{}/sim/faults", sim.url());
    let (status, _) = post_text(&faults_url, r#"{"error_rate": 1.0, "error_status": 429}"#).await;
    assert_eq!(status, 200);
    assert_eq!(get_json(&faults_url).await["error_status"], 429);
    assert_eq!(sim.faults().error_rate, 1.0);
    let (status, body) = post(&sim, CHAT, &chat_body("x")).await;
    assert_eq!(status, 429);
    assert_eq!(body["object"], "error");
    assert_eq!(body["code"], 429);
    assert_eq!(post_text(&faults_url, r#"{"nonsense": 1}"#).await.0, 400);
    post_text(&faults_url, "{}").await;
    assert_eq!(sim.faults(), Faults::default());
    let stats = get_json(&format!("{}/sim/stats", sim.url())).await;
    assert_eq!(stats["errors"], 1);
    // /sim/* requests are not counted.
    assert_eq!(stats["requests_total"], 1);
    sim.shutdown();
}

#[tokio::test]
async fn hang_before_headers() {
    let sim = sim_with_faults(Faults {
        hang_before_headers: true,
        ..Faults::default()
    })
    .await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let started = Instant::now();
    let error = impatient
        .post(format!("{}{CHAT}", sim.url()))
        .json(&chat_body("x"))
        .send()
        .await
        .unwrap_err();
    assert!(error.is_timeout(), "{error}");
    assert!(started.elapsed() >= Duration::from_millis(250));
    // Health still answers.
    assert_eq!(get_status(&format!("{}/health", sim.url())).await, 200);
    sim.shutdown();
}

#[tokio::test]
async fn hang_mid_stream_keeps_connection_open() {
    let sim = sim_with_faults(Faults {
        hang_after_chunks: Some(2),
        ..Faults::default()
    })
    .await;
    let response = send(&sim, CHAT, &stream_body()).await;
    assert_eq!(response.status(), 200);
    let mut chunks = response.bytes_stream();
    let mut received = String::new();
    loop {
        match tokio::time::timeout(Duration::from_millis(400), chunks.next()).await {
            Ok(Some(Ok(chunk))) => received.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(other) => panic!(
                "stream ended instead of hanging: {:?}",
                other.map(|chunk| chunk.map(|_| ()))
            ),
            Err(_) => break, // hung, connection still open
        }
    }
    assert_eq!(received.matches("data: ").count(), 2, "{received}");
    sim.shutdown();
}

#[tokio::test]
async fn drop_mid_stream_truncates_chunked_body() {
    let sim = sim_with_faults(Faults {
        drop_after_chunks: Some(3),
        ..Faults::default()
    })
    .await;
    let (raw, _) = raw_post(sim.addr(), CHAT, &stream_body().to_string()).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("transfer-encoding: chunked"));
    assert_eq!(text.matches("data: ").count(), 3, "{text}");
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "must not send the chunked terminator: {text}"
    );
    // A real client sees a body error.
    assert!(send(&sim, CHAT, &stream_body()).await.text().await.is_err());
    // Non-stream answers are cut short of their content-length.
    let (raw, _) = raw_post(sim.addr(), CHAT, &chat_body("x").to_string()).await;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(body.len() < length);
    sim.shutdown();
}

#[tokio::test]
async fn error_inside_stream() {
    let sim = sim_with_faults(Faults {
        error_after_chunks: Some(1),
        ..Faults::default()
    })
    .await;
    let response = send(&sim, CHAT, &stream_body()).await;
    let events = sse_events(&response.text().await.unwrap());
    assert_eq!(events.len(), 3);
    assert!(events[0].contains("\"role\":\"assistant\""));
    let error: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error"]["code"], 500);
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
    assert_eq!(chat_status(&sim).await, 200);
    // Switch over the admin port, which keeps answering.
    let admin_faults = format!("http://{admin}/sim/faults");
    post_text(&admin_faults, r#"{"refuse_connections": true}"#).await;
    wait_for_connect(addr, true).await;
    assert_eq!(get_json(&admin_faults).await["refuse_connections"], true);
    sim.set_faults(Faults::none());
    wait_for_connect(addr, false).await;
    assert_eq!(chat_status(&sim).await, 200);
    sim.shutdown();
}

#[tokio::test]
async fn engine_dead() {
    let sim = sim_with_faults(Faults {
        engine_dead: true,
        ..Faults::default()
    })
    .await;
    let health = format!("{}/health", sim.url());
    assert_eq!(get_status(&health).await, 503);
    let (status, body) = post(&sim, CHAT, &chat_body("x")).await;
    assert_eq!(status, 500);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("EngineCore"));
    sim.set_faults(Faults::none());
    assert_eq!(get_status(&health).await, 200);
    sim.shutdown();
}

#[tokio::test]
async fn slowdown_multiplies_latency() {
    let config = SimConfig::default()
        .with_latency(vllm_sim::Latency::new(
            Duration::from_millis(40),
            Duration::ZERO,
            Duration::from_millis(5),
        ))
        .with_answer_tokens(4, 4);
    let sim = sim(config).await;
    let started = Instant::now();
    assert_eq!(chat_status(&sim).await, 200);
    let normal = started.elapsed();
    assert!(normal >= Duration::from_millis(55), "{normal:?}");
    sim.set_faults(Faults {
        slowdown: 5.0,
        ..Faults::default()
    });
    let started = Instant::now();
    assert_eq!(chat_status(&sim).await, 200);
    let slow = started.elapsed();
    assert!(slow >= Duration::from_millis(275), "{slow:?}");
    sim.shutdown();
}

#[tokio::test]
async fn streaming_latency_ttft_and_itl() {
    let config = SimConfig::default()
        .with_latency(vllm_sim::Latency::new(
            Duration::from_millis(100),
            Duration::ZERO,
            Duration::from_millis(30),
        ))
        .with_answer_tokens(5, 5);
    let sim = sim(config).await;
    let started = Instant::now();
    let response = send(&sim, CHAT, &stream_body()).await;
    // Headers come before prefill finishes.
    assert!(
        started.elapsed() < Duration::from_millis(90),
        "{:?}",
        started.elapsed()
    );
    let mut chunks = response.bytes_stream();
    let mut arrivals = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.unwrap();
        arrivals.push((
            started.elapsed(),
            String::from_utf8_lossy(&chunk).into_owned(),
        ));
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

#[tokio::test]
async fn a_replaced_metrics_page_while_the_engine_serves() {
    let sim = sim(SimConfig::default()).await;
    let page = "<html>metrics moved</html>\n";
    sim.set_faults(Faults {
        metrics_page: Some(page.into()),
        ..Faults::default()
    });
    let answer = client()
        .get(format!("{}/metrics", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.unwrap(), page);
    assert_eq!(chat_status(&sim).await, 200, "completions still work");
    assert_eq!(get_status(&format!("{}/health", sim.url())).await, 200);
    sim.set_faults(Faults::none());
    assert!(sim.metrics_text().contains("vllm:kv_cache_usage_perc"));
    sim.shutdown();
}
