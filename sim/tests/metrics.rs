#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Live /metrics in V1 and V0 modes parsed by prometheus_client (tests/parse_metrics.py).

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use vllm_sim::{MetricsFlavor, Sim, SimConfig, SpecDecode};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/parse_metrics.py");

fn python() -> Option<&'static str> {
    ["python3", "python"].into_iter().find(|interpreter| {
        Command::new(interpreter)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Run the parser script, requiring the spec-decode families; returns the samples, or None
/// if python3 is missing.
fn parse(mode: &str, text: &str) -> Option<Vec<(String, Value, f64)>> {
    parse_with(mode, &["--spec"], text)
}

fn parse_with(mode: &str, flags: &[&str], text: &str) -> Option<Vec<(String, Value, f64)>> {
    let Some(interpreter) = python() else {
        eprintln!("SKIPPED: python3 not found; cannot run prometheus_client parser");
        return None;
    };
    let mut child = Command::new(interpreter)
        .args([SCRIPT, mode])
        .args(flags)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("No module named 'prometheus_client'"),
        "prometheus_client missing: run `pip install prometheus_client`"
    );
    assert!(
        output.status.success(),
        "parse_metrics.py {mode} failed:\n{stderr}\n---\n{text}"
    );
    let samples: Vec<(String, Value, f64)> = serde_json::from_slice(&output.stdout).unwrap();
    Some(samples)
}

fn value(samples: &Samples, name: &str) -> f64 {
    samples
        .iter()
        .find(|(sample, _, _)| sample == name)
        .unwrap_or_else(|| panic!("no sample {name}"))
        .2
}

#[test]
fn fixtures_pass_the_checker() {
    for (mode, file) in [("v1", "vllm-v1-metrics.txt"), ("v0", "vllm-v0-metrics.txt")] {
        if parse(mode, &fixture(file)).is_none() {
            return;
        }
    }
    // vLLM 0.32's page as captured, without its HTTP head.
    let captured = fixture("vllm-0.32/metrics-after.http");
    let (_, page) = captured.split_once("\r\n\r\n").unwrap();
    parse_with("v1", &[], page);
}

type Samples = [(String, Value, f64)];

/// One finished request, then three slow ones in flight (2 running, 1 waiting).
async fn busy_sim(flavor: MetricsFlavor) -> (Sim, Vec<JoinHandle<(u16, Value)>>) {
    let config = SimConfig::default()
        .with_metrics(flavor)
        .with_latency(token_every(Duration::from_millis(40)))
        .with_answer_tokens(20, 20)
        .with_kv(100, 16)
        .with_max_num_seqs(2)
        .with_speculative(Some(SpecDecode {
            num_speculative_tokens: 3,
            acceptance_rate: 0.6,
        }));
    let sim = sim(config).await;
    let (status, _) = post(
        &sim,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    let mut handles = Vec::new();
    for request in 0..3 {
        let sim = sim.clone();
        let body = chat_body(&format!("slow {request}"));
        handles.push(tokio::spawn(async move {
            post(&sim, "/v1/chat/completions", &body).await
        }));
    }
    let watched = sim.clone();
    wait_until(
        move || watched.engine_state().running == 2 && watched.engine_state().waiting == 1,
        "2 running, 1 waiting",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    (sim, handles)
}

fn check_busy(samples: &Samples, kv_name: &str) {
    assert_eq!(value(samples, "vllm:num_requests_running"), 2.0);
    assert_eq!(value(samples, "vllm:num_requests_waiting"), 1.0);
    let kv = value(samples, kv_name);
    assert!(kv > 0.0 && kv < 1.0, "{kv}");
    assert!(value(samples, "vllm:prompt_tokens_total") > 0.0);
    assert!(value(samples, "vllm:generation_tokens_total") >= 2.0);
    assert_eq!(
        value(samples, "vllm:time_to_first_token_seconds_count"),
        3.0
    );
    assert!(value(samples, "vllm:spec_decode_num_draft_tokens_total") > 0.0);
    assert!(samples
        .iter()
        .any(|(name, labels, _)| name == "vllm:cache_config_info"
            && labels["num_gpu_blocks"] == "100"
            && labels["block_size"] == "16"));
    assert!(samples.iter().any(|(name, _, _)| name == "sim_oom_total"));
}

fn check_idle(samples: &Samples, kv_name: &str) {
    assert_eq!(value(samples, "vllm:num_requests_running"), 0.0);
    assert_eq!(value(samples, kv_name), 0.0);
    let finished: f64 = samples
        .iter()
        .filter(|(name, labels, _)| {
            name == "vllm:request_success_total" && labels["finished_reason"] != "abort"
        })
        .map(|(_, _, value)| value)
        .sum();
    assert_eq!(finished, 4.0);
    assert_eq!(
        value(samples, "vllm:e2e_request_latency_seconds_count"),
        4.0
    );
}

async fn live(flavor: MetricsFlavor, mode: &str, kv_name: &str) {
    let (sim, handles) = busy_sim(flavor).await;
    let response = client()
        .get(format!("{}/metrics", sim.url()))
        .send()
        .await
        .unwrap();
    // vLLM 0.32's prometheus_client writes format 1.0.0; V0's wrote 0.0.4.
    let format = match flavor {
        MetricsFlavor::V1 => "1.0.0",
        MetricsFlavor::V0 => "0.0.4",
    };
    assert_eq!(
        response.headers()["content-type"],
        format!("text/plain; version={format}; charset=utf-8")
    );
    if let Some(samples) = parse(mode, &response.text().await.unwrap()) {
        check_busy(&samples, kv_name);
    }
    for handle in handles {
        assert_eq!(handle.await.unwrap().0, 200);
    }
    if let Some(samples) = parse(mode, &sim.metrics_text()) {
        check_idle(&samples, kv_name);
    }
    sim.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_metrics_v1_parse() {
    live(MetricsFlavor::V1, "v1", "vllm:kv_cache_usage_perc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_metrics_v0_parse() {
    live(MetricsFlavor::V0, "v0", "vllm:gpu_cache_usage_perc").await;
}
