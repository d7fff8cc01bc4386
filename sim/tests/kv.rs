//! The KV-cache and queue model, and OOM mode.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use vllm_sim::{Latency, SimConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_and_queue_rise_and_fall() {
    let cfg = SimConfig::default()
        .with_latency(Latency::new(
            Duration::ZERO,
            Duration::ZERO,
            Duration::from_millis(20),
        ))
        .with_answer_tokens(30, 30)
        .with_kv(200, 16)
        .with_max_num_seqs(3);
    let sim = sim(cfg).await;
    let mut handles = Vec::new();
    for i in 0..6 {
        let s = sim.clone();
        let stream = i % 2 == 0;
        handles.push(tokio::spawn(async move {
            let mut b = chat_body(&format!("{i} {}", "long prompt text ".repeat(20)));
            b["stream"] = json!(stream);
            let r = client()
                .post(format!("{}/v1/chat/completions", s.url()))
                .json(&b)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let _ = r.bytes().await.unwrap();
            status
        }));
    }
    let s = sim.clone();
    wait_until(
        move || {
            let e = s.engine_state();
            e.running == 3 && e.waiting == 3
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
    for h in handles {
        assert_eq!(h.await.unwrap(), 200);
    }
    let e = sim.engine_state();
    assert_eq!(
        (e.running, e.waiting, e.used_blocks, e.reserved_blocks),
        (0, 0, 0, 0)
    );
    assert_eq!(sim.kv_usage(), 0.0);
    assert_eq!(sim.stats().completed, 6);
    sim.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_blocks() {
    let cfg = SimConfig::default()
        .with_latency(Latency::new(
            Duration::ZERO,
            Duration::ZERO,
            Duration::from_millis(50),
        ))
        .with_answer_tokens(40, 40)
        .with_kv(100, 16);
    let sim = sim(cfg).await;
    let mut b = chat_body("disconnect me");
    b["stream"] = json!(true);
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&b)
        .send()
        .await
        .unwrap();
    let s = sim.clone();
    wait_until(move || s.engine_state().running == 1, "running").await;
    drop(r);
    let s = sim.clone();
    wait_until(
        move || s.engine_state().running == 0 && s.kv_usage() == 0.0,
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
    let cfg = SimConfig::default()
        .with_latency(Latency::new(
            Duration::ZERO,
            Duration::ZERO,
            Duration::from_millis(20),
        ))
        .with_answer_tokens(30, 30)
        .with_kv(20, 16)
        .with_oom(true);
    let sim = sim(cfg).await;
    let mut handles = Vec::new();
    for i in 0..6 {
        let s = sim.clone();
        handles.push(tokio::spawn(async move {
            // ~128 prompt tokens + 30 answer tokens = 10 blocks each; the cache holds 20.
            post(
                &s,
                "/v1/completions",
                &json!({"prompt": format!("{i}{}", "x".repeat(510))}),
            )
            .await
        }));
    }
    let mut ooms = 0;
    let mut oks = 0;
    for h in handles {
        let (status, v) = h.await.unwrap();
        match status {
            200 => oks += 1,
            500 => {
                ooms += 1;
                let m = v["error"]["message"].as_str().unwrap();
                assert!(
                    m.starts_with("CUDA out of memory. Tried to allocate"),
                    "{m}"
                );
                assert_eq!(v["error"]["code"], 500);
            }
            s => panic!("unexpected {s}: {v}"),
        }
    }
    assert!(oks >= 1 && ooms >= 1, "oks {oks} ooms {ooms}");
    assert_eq!(sim.stats().oom, ooms);
    assert!(sim.metrics_text().contains(&format!(
        "sim_oom_total{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {ooms}.0"
    )));
    sim.shutdown();
}
