//! An answer's token usage, found by the core once for every plugin: a plugin that wants it
//! (here the speculative selector, for its token metrics) gets it for streams whose client did
//! not ask for it, without the client seeing the usage chunk; nobody wanting it leaves the
//! request as the client sent it.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::SimConfig;

const MODEL: &str = "llama";

async fn recording_sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_record_requests(100),
    )
    .await
    .expect("sim")
}

/// The draft and target pools, and the selector (which wants every answer's usage); no cache,
/// so that every answer comes from an upstream.
fn speculative(draft: &vllm_sim::Sim, target: &vllm_sim::Sim) -> Value {
    json!({
        "pools": [
            pool("draft", &[MODEL], &[draft.addr()]),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": {
            "speculative": {
                "enabled": true,
                "models": [{"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"}],
            },
        },
    })
}

/// The usage the simulator gives `body` asked as JSON, directly: what the proxy must find.
async fn direct_usage(sim: &vllm_sim::Sim, path: &str, body: &Value) -> (u64, u64) {
    let mut body = body.clone();
    body["stream"] = json!(false);
    body.as_object_mut().unwrap().remove("stream_options");
    let v: Value = client()
        .post(format!("{}{path}", sim.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let usage = &v["usage"];
    (
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens"),
    )
}

/// The stream's data events before `[DONE]`, checked for a usage chunk nobody asked for.
fn events_without_usage(a: &Answer) -> Vec<Value> {
    let events = sse_events(a);
    assert!(!events.is_empty());
    for e in &events {
        let choices = e["choices"].as_array().unwrap();
        assert!(!choices.is_empty(), "a usage chunk nobody asked for: {e}");
        assert!(e.get("usage").is_none_or(Value::is_null), "{e}");
    }
    events
}

/// `sluice_tokens_total` of the draft pool: (prompt, completion).
async fn draft_tokens(proxy: &Proxy) -> (u64, u64) {
    let metrics = proxy.metrics().await;
    let series = |kind: &str| format!(r#"sluice_tokens_total{{kind="{kind}",pool="draft"}}"#);
    (
        metric_value(&metrics, &series("prompt")).unwrap_or(0.0) as u64,
        metric_value(&metrics, &series("completion")).unwrap_or(0.0) as u64,
    )
}

/// Waits until the draft's token counters reach `expected` (they are counted once the
/// request is logged, just after the client has its answer), then checks they are exactly it.
async fn expect_draft_tokens(proxy: &Proxy, expected: (u64, u64)) {
    let reached = wait_for(Duration::from_secs(5), || async {
        let now = draft_tokens(proxy).await;
        now.0 >= expected.0 && now.1 >= expected.1
    })
    .await;
    let now = draft_tokens(proxy).await;
    assert!(reached.is_some(), "tokens {now:?}, expected {expected:?}");
    assert_eq!(now, expected);
}

/// The bodies of the POSTs `sim` received, in order.
fn bodies(sim: &vllm_sim::Sim) -> Vec<String> {
    sim.stats()
        .recent
        .iter()
        .filter(|r| r.method == "POST")
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_gets_a_streams_usage_that_its_client_never_sees() {
    let (draft, target) = (recording_sim().await, recording_sim().await);
    let proxy = Proxy::start(speculative(&draft, &target)).await;
    let mut expected = (0, 0);

    // A chat stream whose client did not ask for usage: the upstream is asked, the client
    // sees no usage chunk, and the selector counts the upstream's usage.
    let request = chat(MODEL, "a stream without usage", true);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.headers["x-sluice-pool"], "draft");
    let events = events_without_usage(&a);
    assert_eq!(
        events
            .iter()
            .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
            .count(),
        1,
        "the whole answer"
    );
    let sent = bodies(&draft);
    assert_eq!(sent.len(), 1);
    assert!(
        sent[0].contains(r#""stream_options":{"include_usage":true}"#),
        "{}",
        sent[0]
    );
    let usage = direct_usage(&draft, "/v1/chat/completions", &request).await;
    assert!(usage.0 > 0 && usage.1 > 0, "{usage:?}");
    expected = (expected.0 + usage.0, expected.1 + usage.1);
    expect_draft_tokens(&proxy, expected).await;

    // A completions stream: vLLM's has `"usage":null` in every chunk, which all reach the
    // client; only the usage chunk does not.
    let request = json!({"model": MODEL, "prompt": "Once upon a time", "stream": true,
                         "temperature": 0, "max_tokens": 12});
    let a = ask_url(&proxy.url("/v1/completions"), &request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let events = events_without_usage(&a);
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert!(!text.is_empty(), "{}", a.body);
    let usage = direct_usage(&draft, "/v1/completions", &request).await;
    expected = (expected.0 + usage.0, expected.1 + usage.1);
    expect_draft_tokens(&proxy, expected).await;

    // A client that asked for usage gets its usage chunk, the one counted, and its body is
    // sent as it is.
    let mut request = chat(MODEL, "a stream with usage", true);
    request["stream_options"] = json!({"include_usage": true});
    let a = proxy.ask(&request, &[]).await;
    let data = sse_data(&a.body);
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"], json!([]), "{}", a.body);
    let usage = direct_usage(&draft, "/v1/chat/completions", &request).await;
    assert_eq!(
        (
            last["usage"]["prompt_tokens"].as_u64().unwrap(),
            last["usage"]["completion_tokens"].as_u64().unwrap()
        ),
        usage
    );
    let sent = bodies(&draft);
    let own = sent.iter().rev().nth(1).unwrap();
    assert_eq!(own.matches("include_usage").count(), 1, "{own}");
    expected = (expected.0 + usage.0, expected.1 + usage.1);
    expect_draft_tokens(&proxy, expected).await;

    // A JSON answer has its usage anyway.
    let request = chat(MODEL, "no stream", false);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let usage = direct_usage(&draft, "/v1/chat/completions", &request).await;
    expected = (expected.0 + usage.0, expected.1 + usage.1);
    expect_draft_tokens(&proxy, expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_wanting_usage_leaves_the_stream_request_alone() {
    let upstream = recording_sim().await;
    let proxy = Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let request = chat(MODEL, "nobody counts", true);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    events_without_usage(&a);
    let sent = bodies(&upstream);
    assert_eq!(sent.len(), 1);
    assert!(!sent[0].contains("include_usage"), "{}", sent[0]);
    assert_eq!(
        serde_json::from_str::<Value>(&sent[0]).unwrap(),
        request,
        "the client's request"
    );
}

/// The tokens and cost of every engine's answer are counted by the core, once: with the
/// tenants plugin on and no selector, `sluice_tokens_total` and `sluice_cost_dollars_total`
/// (the dashboard's Tokens and Cost cards) read what the tenant was charged. They read 0
/// and $0 before, when only the selector counted them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_cost_are_counted_for_every_answer_and_agree_with_the_tenants() {
    let sim = recording_sim().await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()]).with("price_per_million_tokens", 2.0)],
        "plugins": {"tenants": {"enabled": true, "tenants": {
            "team": {"keys": [key_digest("sk-team")]}}}},
    }))
    .await;
    let auth = [("authorization", "Bearer sk-team")];
    assert_eq!(
        proxy.ask(&chat(MODEL, "hello", false), &auth).await.status,
        200
    );
    assert_eq!(
        proxy
            .ask(&chat(MODEL, "streamed", true), &auth)
            .await
            .status,
        200
    );
    let series = |kind: &str| format!(r#"sluice_tokens_total{{kind="{kind}",pool="main"}}"#);
    let tenant =
        |kind: &str| format!(r#"sluice_tenant_tokens_total{{kind="{kind}",tenant="team"}}"#);
    // Both are counted as each request is logged, just after its client has its answer.
    let agreed = wait_for(Duration::from_secs(5), || async {
        let m = proxy.metrics().await;
        [("prompt", "input"), ("completion", "output")]
            .iter()
            .all(|(kind, theirs)| {
                let ours = metric_value(&m, &series(kind));
                ours.is_some_and(|t| t > 0.0) && ours == metric_value(&m, &tenant(theirs))
            })
    })
    .await;
    let m = proxy.metrics().await;
    assert!(agreed.is_some(), "{m}");
    let tokens: f64 = ["prompt", "completion"]
        .iter()
        .map(|kind| metric_value(&m, &series(kind)).unwrap())
        .sum();
    let cost = metric_value(&m, r#"sluice_cost_dollars_total{pool="main"}"#).unwrap();
    assert!(
        (cost - tokens * 2.0 / 1e6).abs() < 1e-12,
        "{cost} for {tokens} tokens"
    );
    let charged = metric_value(&m, r#"sluice_tenant_cost_dollars_total{tenant="team"}"#).unwrap();
    assert!((cost - charged).abs() < 1e-12, "{cost} against {charged}");
}
