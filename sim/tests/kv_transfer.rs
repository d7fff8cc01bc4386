#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Disaggregated prefill on vLLM's `NixlConnector` wire, between two simulators: a prefill
//! leg that keeps its blocks and says where, a decode leg that reads them, and what happens
//! when the read fails (the engine's `kv_load_failure_policy`); and on its
//! `MooncakeConnector` wire, where the router names the blocks.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use vllm_sim::{Faults, KvConnector, KvTransferConfig, Latency, LoadFailurePolicy, SimConfig};

const CHAT: &str = "/v1/chat/completions";

/// A V1 engine (chunked prefill, prefix caching, usage details) serving both legs.
async fn engine(policy: LoadFailurePolicy, lease: Duration) -> vllm_sim::Sim {
    sim(SimConfig::default()
        .with_latency(Latency::new(
            Duration::ZERO,
            Duration::from_micros(100),
            Duration::from_millis(1),
        ))
        .with_answer_tokens(4, 4)
        .v1_engine(8192)
        .with_kv_transfer(KvTransferConfig {
            lease,
            transfer_per_token: Duration::from_micros(1),
            load_failure_policy: policy,
            ..KvTransferConfig::default()
        }))
    .await
}

fn long_prompt() -> Value {
    chat_body(&"every word of a long document to prefill ".repeat(150))
}

/// The prefill leg as a router sends it: one token, no stream, `do_remote_decode`.
fn prefill_leg(body: &Value) -> Value {
    let mut leg = body.clone();
    leg["max_tokens"] = json!(1);
    leg["stream"] = json!(false);
    leg["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
        "remote_port": null});
    leg
}

/// The decode leg: the client's body with the prefill answer's parameters.
fn decode_leg(body: &Value, params: &Value) -> Value {
    let mut leg = body.clone();
    leg["kv_transfer_params"] = params.clone();
    leg
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// What the engine computed into new cache blocks (vLLM 0.32's `created_cache_tokens`).
fn created_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["created_cache_tokens"]
        .as_u64()
        .expect("created_cache_tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_leg_reads_the_prefill_legs_blocks_once() {
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_secs(30)).await;
    let decode = engine(LoadFailurePolicy::Fail, Duration::from_secs(30)).await;
    let body = long_prompt();
    let (status, first) = post(&prefill, CHAT, &prefill_leg(&body)).await;
    assert_eq!(status, 200, "{first}");
    let params = &first["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true, "{first}");
    assert_eq!(params["do_remote_decode"], false);
    for key in ["remote_engine_id", "remote_request_id", "remote_host"] {
        assert!(params[key].is_string(), "{key}: {params}");
    }
    assert!(params["remote_port"].is_u64());
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // Blocks of 16 tokens, the last one part full, in one KV-cache group.
    let blocks = params["remote_block_ids"][0].as_array().unwrap().len() as u64;
    assert_eq!(blocks, prompt.div_ceil(16), "{params}");
    assert_eq!(params["remote_num_tokens"].as_u64(), Some(prompt));
    assert_eq!(params["transfer_mode"], "pull");
    assert_eq!(
        created_tokens(&first),
        prompt / 16 * 16,
        "the prefill computed it"
    );

    let (status, answer) = post(&decode, CHAT, &decode_leg(&body, params)).await;
    assert_eq!(status, 200, "{answer}");
    // As vLLM 0.32 says it: nothing computed into new blocks here, and as cached what the
    // prefill engine's cache served (nothing).
    assert_eq!(created_tokens(&answer), 0, "read, not computed: {answer}");
    assert_eq!(cached_tokens(&answer), 0, "{answer}");
    assert!(answer["kv_transfer_params"].is_null());
    let counts = get_json(&format!("{}/sim/kv_transfer", prefill.url())).await;
    assert_eq!(
        (counts["lent"].as_u64(), counts["read"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(counts["leases"], 0, "read, the lease ends");

    // The same parameters again: the blocks are gone, and the engine fails the request.
    let (status, again) = post(&decode, CHAT, &decode_leg(&body, params)).await;
    assert_eq!(status, 500, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_transfer_is_recomputed_silently_under_the_recompute_policy() {
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_secs(30)).await;
    let decode = engine(LoadFailurePolicy::Recompute, Duration::from_secs(30)).await;
    prefill.set_faults(Faults {
        kv_transfer_lost: 1.0,
        ..Faults::default()
    });
    let body = long_prompt();
    let (_, first) = post(&prefill, CHAT, &prefill_leg(&body)).await;
    let params = &first["kv_transfer_params"];
    assert_eq!(
        params["do_remote_prefill"], true,
        "answered as if kept: {first}"
    );
    // A 200 all the same, with nothing from the transfer: only the usage tells.
    let (status, answer) = post(&decode, CHAT, &decode_leg(&body, params)).await;
    assert_eq!(status, 200, "{answer}");
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        created_tokens(&answer),
        prompt / 16 * 16,
        "computed again: {answer}"
    );
    let counts = get_json(&format!("{}/sim/kv_transfer", prefill.url())).await;
    assert_eq!(counts["refused"], 1, "{counts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_not_read_within_their_lease_are_freed_and_a_stream_gets_an_error_event() {
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_millis(200)).await;
    let decode = engine(LoadFailurePolicy::Fail, Duration::from_secs(30)).await;
    let body = long_prompt();
    let (_, first) = post(&prefill, CHAT, &prefill_leg(&body)).await;
    let params = first["kv_transfer_params"].clone();
    // The lease's end is the event waited for.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let response = send(&decode, CHAT, &streaming(decode_leg(&body, &params))).await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let events = sse_events(&text);
    assert!(
        events.iter().any(|e| e.contains("\"error\"")),
        "an error event: {text}"
    );
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let counts = get_json(&format!("{}/sim/kv_transfer", prefill.url())).await;
    assert_eq!(counts["expired"], 1, "{counts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_without_what_a_read_needs_are_ignored() {
    let decode = engine(LoadFailurePolicy::Fail, Duration::from_secs(30)).await;
    let body = decode_leg(
        &long_prompt(),
        &json!({"do_remote_prefill": true, "remote_engine_id": "somewhere"}),
    );
    let (status, answer) = post(&decode, CHAT, &body).await;
    assert_eq!(status, 200, "prefilled here: {answer}");
    assert!(created_tokens(&answer) > 0, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answer_carries_what_a_real_vllm_0_32_answers() {
    let captured = json_fixture("vllm-0.32/pd-prefill-leg.json");
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_secs(30)).await;
    let (_, answer) = post(&prefill, CHAT, &prefill_leg(&long_prompt())).await;
    let keys = |v: &Value| {
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    let (ours, real) = (
        &answer["kv_transfer_params"],
        &captured["kv_transfer_params"],
    );
    assert_eq!(keys(ours), keys(real));
    assert!(real["remote_block_ids"][0].is_array() && ours["remote_block_ids"][0].is_array());
    assert_eq!(ours["transfer_mode"], real["transfer_mode"]);
    assert_eq!(
        keys(&answer["usage"]["prompt_tokens_details"]),
        keys(&captured["usage"]["prompt_tokens_details"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_legs_hand_over_by_the_router_s_transfer_id() {
    let mooncake = || {
        sim(SimConfig::default()
            .with_answer_tokens(4, 4)
            .v1_engine(8192)
            .with_kv_transfer(KvTransferConfig {
                connector: KvConnector::Mooncake,
                transfer_per_token: Duration::ZERO,
                ..KvTransferConfig::default()
            }))
    };
    let (prefill, decode) = (mooncake().await, mooncake().await);
    let transfer = prefill.kv_transfer().unwrap();
    let body = long_prompt();
    let mut leg = body.clone();
    leg["max_tokens"] = json!(1);
    leg["kv_transfer_params"] =
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-1"});
    let (status, answer) = post(&prefill, CHAT, &leg).await;
    assert_eq!(status, 200, "{answer}");
    // As a real vLLM 0.32 answers a Mooncake prefill leg: no parameters.
    let captured = json_fixture("vllm-0.32/pd-mooncake-prefill-leg.json");
    assert!(captured["kv_transfer_params"].is_null());
    assert_eq!(answer["kv_transfer_params"], captured["kv_transfer_params"]);
    let params = json!({"do_remote_decode": false, "do_remote_prefill": true,
        "remote_engine_id": transfer.engine_id,
        "remote_bootstrap_addr": format!("http://{}", transfer.bootstrap.unwrap()),
        "transfer_id": "xfer-1"});
    let (status, answer) = post(&decode, CHAT, &decode_leg(&body, &params)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(created_tokens(&answer), 0, "pulled, not computed: {answer}");
    assert_eq!(prefill.kv_transfer().unwrap().read, 1);
}
