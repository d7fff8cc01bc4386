#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The KV-cache and queue model, and OOM mode.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use vllm_sim::{MetricsFlavor, Sim, SimConfig};

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

fn kv_url(sim: &Sim) -> String {
    format!("{}/sim/kv", sim.url())
}

#[tokio::test]
async fn phantom_kv_shows_on_both_metric_flavours_and_clearing_restores_the_real_value() {
    for (flavor, name) in [
        (MetricsFlavor::V1, "vllm:kv_cache_usage_perc"),
        (MetricsFlavor::V0, "vllm:gpu_cache_usage_perc"),
    ] {
        let config = SimConfig::default()
            .with_metrics(flavor)
            .with_latency(token_every(Duration::from_secs(10)))
            .with_answer_tokens(40, 40)
            // 1,000 blocks to share, the usage's denominator (one more is the null block).
            .with_kv(1001, 16);
        let sim = sim(config).await;
        // A request in flight holds real blocks: (ceil(7 prompt + 1 token) / 16) = 1 block.
        let in_flight = send(&sim, CHAT, &streaming(chat_body("hold a block"))).await;
        let watched = sim.clone();
        wait_until(
            move || watched.engine_state().used_blocks == 1,
            "one block held",
        )
        .await;
        let real = metric_value(&sim.metrics_text(), name);
        assert_eq!(real, 0.001);

        sim.set_phantom_kv(0.9);
        assert_eq!(sim.phantom_kv(), 0.9);
        let pressed = metric_value(&sim.metrics_text(), name);
        assert!(pressed >= 0.9, "{pressed}");
        assert_eq!(pressed, 0.901);
        assert_eq!(sim.kv_usage(), pressed);
        assert_eq!(sim.stats().kv_usage, pressed);

        sim.clear_phantom_kv();
        assert_eq!(metric_value(&sim.metrics_text(), name), real);
        assert_eq!(sim.phantom_kv(), 0.0);
        drop(in_flight);
        sim.shutdown();
    }
}

#[tokio::test]
async fn phantom_kv_over_http() {
    // 1,000 blocks to share: vLLM keeps one of the 1,001 as its null block.
    let sim = sim(SimConfig::default().with_kv(1001, 16)).await;
    let (status, kv) = post_text(&kv_url(&sim), r#"{"phantom_usage": 0.9}"#).await;
    assert_eq!(status, 200, "{kv}");
    assert_eq!(kv["phantom_usage"], 0.9);
    assert_eq!(kv["phantom_blocks"], 900);
    assert_eq!(kv["kv_usage"], 0.9);
    assert_eq!(get_json(&kv_url(&sim)).await["kv_usage"], 0.9);
    let text = reqwest::get(format!("{}/metrics", sim.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(metric_value(&text, "vllm:kv_cache_usage_perc"), 0.9);
    // Out of range or unknown fields: refused, the setting stays.
    for bad in [
        r#"{"phantom_usage": 90}"#,
        r#"{"phantom_usage": -0.1}"#,
        r#"{"usage": 0.5}"#,
    ] {
        let (status, body) = post_text(&kv_url(&sim), bad).await;
        assert_eq!(status, 400, "{bad}");
        assert!(error_field(&body, "message")
            .as_str()
            .unwrap()
            .starts_with("invalid kv"));
    }
    assert_eq!(sim.phantom_kv(), 0.9);
    // `{}`, `{"phantom_usage": 0}` and DELETE all clear.
    for (method, body) in [
        ("POST", "{}"),
        ("POST", r#"{"phantom_usage": 0}"#),
        ("DELETE", ""),
    ] {
        sim.set_phantom_kv(0.5);
        let response = client()
            .request(method.parse().unwrap(), kv_url(&sim))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let kv: serde_json::Value = response.json().await.unwrap();
        assert_eq!(
            (kv["phantom_usage"].as_f64(), kv["kv_usage"].as_f64()),
            (Some(0.0), Some(0.0))
        );
    }
    // Control calls are not requests to the model.
    assert_eq!(sim.stats().requests_total, 1);
    sim.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phantom_kv_makes_new_requests_wait_or_oom() {
    let sim = sim(SimConfig::default().with_kv(100, 16)).await;
    sim.set_phantom_kv(1.0);
    let waiting = sim.clone();
    let request = tokio::spawn(async move { post(&waiting, CHAT, &chat_body("wait")).await.0 });
    let watched = sim.clone();
    wait_until(
        move || watched.engine_state().waiting == 1,
        "the request queued",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        (sim.engine_state().running, sim.engine_state().waiting),
        (0, 1)
    );
    assert!(!request.is_finished());
    sim.clear_phantom_kv();
    assert_eq!(request.await.unwrap(), 200);
    sim.shutdown();

    // In OOM mode the same request fails at once, as on a full GPU.
    let sim = common::sim(SimConfig::default().with_kv(100, 16).with_oom(true)).await;
    sim.set_phantom_kv(1.0);
    let (status, body) = post(&sim, CHAT, &chat_body("oom")).await;
    assert_eq!(status, 500);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("CUDA out of memory"));
    sim.clear_phantom_kv();
    assert_eq!(post(&sim, CHAT, &chat_body("fits")).await.0, 200);
    sim.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phantom_kv_preempts_a_running_stream_until_cleared() {
    let config = SimConfig::default()
        .with_latency(token_every(Duration::from_millis(10)))
        .with_answer_tokens(40, 40)
        .with_kv(100, 16);
    let sim = sim(config).await;
    let mut body = streaming(chat_body("preempt me"));
    body["stream_options"] = json!({"include_usage": true});
    let stream = {
        let sim = sim.clone();
        tokio::spawn(async move { send(&sim, CHAT, &body).await.text().await.unwrap() })
    };
    let watched = sim.clone();
    wait_until(move || watched.engine_state().running == 1, "running").await;
    sim.set_phantom_kv(1.0);
    // It goes on within its blocks, and is preempted when it needs the next one.
    let watched = sim.clone();
    wait_until(
        move || {
            let engine = watched.engine_state();
            (engine.running, engine.waiting, engine.used_blocks) == (0, 1, 0)
        },
        "the stream preempted",
    )
    .await;
    let text = sim.metrics_text();
    assert_eq!(metric_value(&text, "vllm:num_preemptions_total"), 1.0);
    assert_eq!(metric_value(&text, "vllm:kv_cache_usage_perc"), 1.0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        sim.engine_state().running,
        0,
        "stays preempted under pressure"
    );
    sim.clear_phantom_kv();
    // It resumes where it stopped: every token once (the text is the non-stream answer's),
    // the last with the finish reason, then the usage chunk.
    let events = json_events(&sse_events(&stream.await.unwrap()));
    let usage = &events[events.len() - 1]["usage"];
    assert_eq!(usage["completion_tokens"], 40);
    assert_eq!(
        events[events.len() - 2]["choices"][0]["finish_reason"],
        "stop"
    );
    let streamed: String = events
        .iter()
        .filter_map(|event| event["choices"][0]["delta"]["content"].as_str())
        .collect();
    let (_, whole) = post(&sim, CHAT, &chat_body("preempt me")).await;
    assert_eq!(whole["choices"][0]["message"]["content"], streamed);
    assert_eq!(sim.stats().completed, 2);
    assert_eq!(sim.engine_state().used_blocks, 0);
    sim.shutdown();
}
