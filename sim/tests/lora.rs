#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! LoRA adapters as vLLM 0.32 serves them (`--enable-lora`): listed by `/v1/models` under
//! their base model, at most `--max-loras` in one batch, their prefix-cache blocks their own
//! and published with their name, `vllm:lora_requests_info`, and loading and unloading at run
//! time. The shapes are those of a real vLLM 0.32 with a LoRA adapter.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use vllm_sim::{KvEventsConfig, LoraConfig, SimConfig};

const CHAT: &str = "/v1/chat/completions";

fn lora_config() -> LoraConfig {
    LoraConfig::new(1)
        .with_module("sql", "/adapters/sql")
        .with_module("poet", "/adapters/poet")
}

fn ask(model: &str, prompt: &str, max_tokens: u32) -> Value {
    json!({"model": model, "max_tokens": max_tokens, "ignore_eos": true,
           "messages": [{"role": "user", "content": prompt}]})
}

/// `vllm:lora_requests_info`'s samples: (running adapters, value).
fn lora_samples(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .map(|line| {
            assert!(
                line.starts_with("vllm:lora_requests_info{max_lora=\"1\","),
                "{line}"
            );
            let running = line
                .split("running_lora_adapters=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            let waiting = line
                .split("waiting_lora_adapters=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            // vLLM lists every adapter with a request under both labels.
            assert_eq!(running, waiting, "{line}");
            let value = line.rsplit(' ').next().unwrap().parse().unwrap();
            (running.to_string(), value)
        })
        .collect()
}

/// The adapters `vllm:lora_requests_info` reports now: its newest sample's.
fn active_adapters(sim: &vllm_sim::Sim) -> Option<String> {
    lora_samples(&sim.metrics_text())
        .into_iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(names, _)| names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_listed_and_served_at_most_max_loras_at_once() {
    let config = SimConfig::default()
        .with_latency(token_every(Duration::from_millis(20)))
        .with_lora(lora_config());
    let sim = sim(config).await;
    // The base model, then each adapter under it, as vLLM lists them.
    let models = get_json(&format!("{}/v1/models", sim.url())).await;
    let cards: Vec<(&str, &Value, &Value, &Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap(),
                &m["parent"],
                &m["root"],
                &m["max_model_len"],
            )
        })
        .collect();
    assert_eq!(
        cards,
        [
            (MODEL, &Value::Null, &json!(MODEL), &json!(32768)),
            ("sql", &json!(MODEL), &json!("/adapters/sql"), &Value::Null),
            (
                "poet",
                &json!(MODEL),
                &json!("/adapters/poet"),
                &Value::Null
            ),
        ]
    );
    // An engine that never ran reports no sample yet.
    assert_eq!(lora_samples(&sim.metrics_text()), []);

    // An adapter's answer names it.
    let (status, answer) = post(&sim, CHAT, &ask("sql", "a table", 2)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], json!("sql"));
    let (status, answer) = post(&sim, CHAT, &ask("nope", "a table", 2)).await;
    assert_eq!(status, 404);
    assert_eq!(
        error_field(&answer, "message"),
        &json!(format!(
            "The model `nope` does not exist. Valid aliases: {MODEL}."
        ))
    );
    assert_eq!(active_adapters(&sim).as_deref(), Some(""), "idle again");

    // With one slot, `poet` waits while `sql` runs; a base-model request behind it does not.
    // `sql` streams until its client leaves.
    let long_sql = tokio::spawn({
        let url = sim.url();
        async move {
            let mut answer = client()
                .post(format!("{url}{CHAT}"))
                .json(&streaming(ask("sql", "a long query", 20_000)))
                .send()
                .await
                .unwrap();
            while answer.chunk().await.unwrap().is_some() {}
        }
    });
    wait_until(|| sim.engine_state().running == 1, "sql runs").await;
    let poet = tokio::spawn({
        let url = sim.url();
        async move {
            client()
                .post(format!("{url}{CHAT}"))
                .json(&ask("poet", "a verse", 2))
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    });
    wait_until(|| sim.engine_state().waiting == 1, "poet waits for a slot").await;
    assert_eq!(active_adapters(&sim).as_deref(), Some("sql,poet"));
    let (status, _) = post(&sim, CHAT, &ask(MODEL, "no adapter", 2)).await;
    assert_eq!(
        status, 200,
        "a request without an adapter passes the waiting one"
    );
    assert_eq!(
        sim.engine_state().waiting,
        1,
        "poet still waits while sql runs"
    );
    long_sql.abort();
    let poet = poet.await.unwrap();
    assert_eq!(poet["model"], json!("poet"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_blocks_are_its_own_and_published_with_its_name() {
    let config = SimConfig::default()
        .v1_engine(2048)
        .with_kv_events(KvEventsConfig::default())
        .with_lora(lora_config());
    let sim = sim(config).await;
    let mut sub = live_subscriber(&sim).await;
    let prompt = "Tables, rows and the joins between them. ".repeat(20);
    let cached = |answer: &Value| answer["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let (status, first) = post(&sim, CHAT, &ask("sql", &prompt, 2)).await;
    assert_eq!(status, 200, "{first}");
    let (_, batch) = next_batch(&mut sub).await;
    let stored = &batch[1][0];
    assert_eq!(field(stored, "type").as_str(), Some("BlockStored"));
    assert_eq!(field(stored, "lora_id").as_u64(), Some(1));
    assert_eq!(field(stored, "lora_name").as_str(), Some("sql"));
    let blocks = field(stored, "block_hashes").as_array().unwrap().len();
    assert!(blocks >= 2);
    // Each block's extra keys: the adapter's name, untagged, as vLLM publishes them.
    let extra = field(stored, "extra_keys").as_array().unwrap();
    assert_eq!(extra.len(), blocks);
    for keys in extra {
        assert_eq!(keys, &rmpv::Value::Array(vec!["sql".into()]));
    }
    // The adapter's blocks serve the adapter's next request, not the base model's.
    let (_, again) = post(&sim, CHAT, &ask("sql", &prompt, 2)).await;
    assert_eq!(cached(&again), json!(blocks * 16));
    let (_, base) = post(&sim, CHAT, &ask(MODEL, &prompt, 2)).await;
    assert_eq!(cached(&base), json!(0));
    let (_, batch) = next_batch(&mut sub).await;
    let stored = &batch[1][0];
    assert!(field(stored, "lora_name").is_nil());
    assert!(field(stored, "lora_id").is_nil());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_load_and_unload_at_run_time() {
    let sim = sim(SimConfig::default().with_lora(lora_config())).await;
    let url = |path: &str| format!("{}{path}", sim.url());
    let send = |path: &'static str, body: Value| {
        let url = url(path);
        async move {
            let answer = client().post(url).json(&body).send().await.unwrap();
            let status = answer.status().as_u16();
            (status, answer.text().await.unwrap())
        }
    };
    let load = json!({"lora_name": "chef", "lora_path": "/adapters/chef"});
    assert_eq!(
        send("/v1/load_lora_adapter", load.clone()).await,
        (
            200,
            "Success: LoRA adapter 'chef' added successfully.".to_string()
        )
    );
    let ids: Vec<String> = get_json(&url("/v1/models")).await["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, [MODEL, "sql", "poet", "chef"]);
    let (status, answer) = post(&sim, CHAT, &ask("chef", "a recipe", 2)).await;
    assert_eq!((status, &answer["model"]), (200, &json!("chef")));
    // Again: vLLM's 400; unloading twice: its 404.
    let (status, body) = send("/v1/load_lora_adapter", load).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 400);
    assert_eq!(error_field(&body, "type"), &json!("InvalidUserInput"));
    let unload = json!({"lora_name": "chef"});
    assert_eq!(
        send("/v1/unload_lora_adapter", unload.clone()).await,
        (
            200,
            "Success: LoRA adapter 'chef' removed successfully.".to_string()
        )
    );
    let (status, body) = send("/v1/unload_lora_adapter", unload).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 404);
    assert_eq!(
        error_field(&body, "message"),
        &json!("The lora adapter 'chef' cannot be found.")
    );
    let (status, _) = post(&sim, CHAT, &ask("chef", "a recipe", 2)).await;
    assert_eq!(status, 404);
}
