#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! OpenAI's Responses API as vLLM 0.32 serves it: a response kept in the memory of the
//! instance that made it (with `VLLM_ENABLE_RESPONSES_API_STORE=1`), a `previous_response_id`
//! chain that carries the conversation, and vLLM's 404 for a response an instance does not
//! hold (another instance's, or any without the store).

mod common;

use common::*;
use serde_json::{json, Value};
use vllm_sim::SimConfig;

const RESPONSES: &str = "/v1/responses";

fn ask(input: &str, previous: Option<&str>) -> Value {
    let mut request = json!({"model": MODEL, "input": input, "max_output_tokens": 4,
                             "instructions": "Answer briefly."});
    if let Some(previous) = previous {
        request["previous_response_id"] = json!(previous);
    }
    request
}

#[tokio::test]
async fn a_chain_of_responses_lives_on_the_instance_that_made_it() {
    let other = sim(SimConfig::default().with_responses_store(true)).await;
    let sim = common::sim(SimConfig::default().with_responses_store(true)).await;
    let (status, first) = post(&sim, RESPONSES, &ask("Name a colour.", None)).await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"));
    assert_eq!(first["output"][0]["type"], "message");
    // Kept as it was answered.
    assert_eq!(
        get_json(&format!("{}{RESPONSES}/{id}", sim.url())).await,
        first
    );
    // Each follow-up carries the conversation: its prompt grows by the previous turn.
    let mut previous = id.clone();
    let mut prompt = first["usage"]["input_tokens"].as_u64().unwrap();
    for turn in 0..4 {
        let (status, next) = post(&sim, RESPONSES, &ask("And another?", Some(&previous))).await;
        assert_eq!(status, 200, "turn {turn}: {next}");
        assert_eq!(next["previous_response_id"], json!(previous));
        let grown = next["usage"]["input_tokens"].as_u64().unwrap();
        assert!(grown > prompt, "turn {turn}: {grown} after {prompt}");
        prompt = grown;
        previous = next["id"].as_str().unwrap().to_string();
    }
    // Another instance never had it: vLLM's 404.
    let (status, error) = post(&other, RESPONSES, &ask("And another?", Some(&id))).await;
    assert_eq!(status, 404);
    assert_eq!(
        error["error"]["message"],
        json!(format!("Response with id '{id}' not found."))
    );
    assert_eq!(error["error"]["param"], "response_id");
    assert_eq!(
        get_status(&format!("{}{RESPONSES}/{id}", other.url())).await,
        404
    );
    // A finished response cannot be cancelled.
    let (status, error) = post(&sim, &format!("{RESPONSES}/{id}/cancel"), &json!({})).await;
    assert_eq!(status, 400);
    assert_eq!(
        error["error"]["message"],
        "Cannot cancel a synchronous response."
    );
}

#[tokio::test]
async fn without_the_store_no_response_is_kept() {
    let sim = sim(SimConfig::default()).await;
    let (status, first) = post(&sim, RESPONSES, &ask("Name a colour.", None)).await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap();
    let (status, _) = post(&sim, RESPONSES, &ask("And another?", Some(id))).await;
    assert_eq!(status, 404);
    assert_eq!(
        get_status(&format!("{}{RESPONSES}/{id}", sim.url())).await,
        404
    );
}
