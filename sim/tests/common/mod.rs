#![allow(dead_code)]
//! Helpers shared by the integration tests.

use std::time::Duration;

use serde_json::{json, Value};
use vllm_sim::{Sim, SimConfig};

/// vLLM's wire shapes, kept in the repository (tests/fixtures/README.md says where from).
pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

pub fn fixture(name: &str) -> String {
    let path = format!("{FIXTURES}/{name}");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

pub async fn sim(cfg: SimConfig) -> Sim {
    vllm_sim::start(cfg).await.expect("start sim")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

pub fn chat_body(prompt: &str) -> Value {
    json!({"model": "meta-llama/Llama-3.1-8B-Instruct",
           "messages": [{"role": "user", "content": prompt}],
           "temperature": 0})
}

pub async fn post(sim: &Sim, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{}{path}", sim.url()))
        .json(body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Shape of a JSON value: keys in order, value kinds; arrays by their first element.
pub fn skeleton(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "b".into(),
        Value::Number(_) => "n".into(),
        Value::String(_) => "s".into(),
        Value::Array(a) => match a.first() {
            None => "[]".into(),
            Some(x) => format!("[{}]", skeleton(x)),
        },
        Value::Object(o) => {
            let parts: Vec<String> = o
                .iter()
                .map(|(k, v)| format!("{k}:{}", skeleton(v)))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
    }
}

/// Split an SSE body into its `data:` payloads, checking the `data: ...\n\n` framing.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "SSE body must end with a blank line: {body:?}"
    );
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {e:?}"))
                .to_string()
        })
        .collect()
}

pub async fn wait_until(mut f: impl FnMut() -> bool, what: &str) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}
