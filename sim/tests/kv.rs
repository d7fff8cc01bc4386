#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The KV-cache and queue model, and OOM mode.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use vllm_sim::SimConfig;

const CHAT: &str = "/v1/chat/completions";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_and_queue_rise_and_fall() {
    let config = SimConfig::default()
        .with_latency(token_every(Duration::from_millis(20)))
        .with_answer_tokens(30, 30)
        .with_kv(200, 16)
        .with_max_num_seqs(3);
    let sim = sim(config).await;
    let mut handles = Vec::new();
    for request in 0..6 {
        let sim = sim.clone();
        let mut body = chat_body(&format!("{request} {}", "long prompt text ".repeat(20)));
        body["stream"] = json!(request % 2 == 0);
        handles.push(tokio::spawn(async move {
            let response = send(&sim, CHAT, &body).await;
            let status = response.status().as_u16();
            let _ = response.bytes().await.unwrap();
            status
        }));
    }
    let watched = sim.clone();
    wait_until(
        move || {
            let engine = watched.engine_state();
            engine.running == 3 && engine.waiting == 3
        },
        "3 running, 3 waiting",
    )
    .await;
    let first = sim.kv_usage();
    assert!(first > 0.0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Held blocks grow as tokens are generated.
    assert!(sim.kv_usage() > first, "{} > {first}", sim.kv_usage());
    let text = sim.metrics_text();
    assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 3.0"), "{text}");
    assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 3.0"));
    for handle in handles {
        assert_eq!(handle.await.unwrap(), 200);
    }
    let engine = sim.engine_state();
    assert_eq!(
        (
            engine.running,
            engine.waiting,
            engine.used_blocks,
            engine.reserved_blocks
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(sim.kv_usage(), 0.0);
    assert_eq!(sim.stats().completed, 6);
    sim.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_blocks() {
    let config = SimConfig::default()
        .with_latency(token_every(Duration::from_millis(50)))
        .with_answer_tokens(40, 40)
        .with_kv(100, 16);
    let sim = sim(config).await;
    let response = send(&sim, CHAT, &streaming(chat_body("disconnect me"))).await;
    let watched = sim.clone();
    wait_until(move || watched.engine_state().running == 1, "running").await;
    drop(response);
    let watched = sim.clone();
    wait_until(
        move || watched.engine_state().running == 0 && watched.kv_usage() == 0.0,
        "blocks freed",
    )
    .await;
    assert!(sim.metrics_text().contains(
        "finished_reason=\"abort\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.0"
    ));
    sim.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_mode_fails_like_cuda_oom() {
    let config = SimConfig::default()
        .with_latency(token_every(Duration::from_millis(20)))
        .with_answer_tokens(30, 30)
        .with_kv(20, 16)
        .with_oom(true);
    let sim = sim(config).await;
    let mut handles = Vec::new();
    for request in 0..6 {
        let sim = sim.clone();
        // ~128 prompt tokens + 30 answer tokens = 10 blocks each; the cache holds 20.
        let body = json!({"prompt": format!("{request}{}", "x".repeat(510))});
        handles.push(tokio::spawn(async move {
            post(&sim, "/v1/completions", &body).await
        }));
    }
    let mut ooms = 0;
    let mut oks = 0;
    for handle in handles {
        let (status, body) = handle.await.unwrap();
        match status {
            200 => oks += 1,
            500 => {
                ooms += 1;
                let message = body["error"]["message"].as_str().unwrap();
                assert!(
                    message.starts_with("CUDA out of memory. Tried to allocate"),
                    "{message}"
                );
                assert_eq!(body["error"]["code"], 500);
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert!(oks >= 1 && ooms >= 1, "oks {oks} ooms {ooms}");
    assert_eq!(sim.stats().oom, ooms);
    assert!(sim.metrics_text().contains(&format!(
        "sim_oom_total{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {ooms}.0"
    )));
    sim.shutdown();
}
