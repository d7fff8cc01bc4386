//! The model name each pool serves (`pools[].served_model`, `pools[].answer_model`): clients
//! ask for one public name, each pool's engine gets its own, and the answers say what the
//! client asked for (or what served it), streams chunk by chunk, escalations and cache hits
//! included; without a rewrite the bytes pass as they are.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::{Faults, SimConfig};

const PUBLIC: &str = "llama";
const DRAFT: &str = "meta-llama/Llama-3.2-1B-Instruct";
const TARGET: &str = "meta-llama/Llama-3.1-70B-Instruct";

/// A simulator serving `name` only: like vLLM, it answers 404 to any other.
async fn sim_named(name: &str) -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(name)
            .with_served_model_names(vec![name.into()])
            .zero_latency()
            .with_record_requests(50),
    )
    .await
    .unwrap()
}

/// The `model` of every LLM request `sim` received, in order.
fn models_received(sim: &vllm_sim::Sim) -> Vec<String> {
    sim.stats()
        .recent
        .into_iter()
        .filter(|r| r.method == "POST" && r.path.starts_with("/v1/"))
        .map(|r| {
            let body: Value = serde_json::from_slice(&r.body).unwrap();
            body["model"].as_str().unwrap_or("<none>").to_string()
        })
        .collect()
}

/// The `model` of a JSON answer, or of every chunk of a stream (`[DONE]` aside). A stream
/// from the engine has several chunks; a hit may have one (a follower that joins a stream
/// already made gets the answer so far as one event per choice).
fn models_answered(a: &Answer) -> Vec<String> {
    let model = |json: &str| {
        let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
        v["model"].as_str().unwrap_or("<none>").to_string()
    };
    if a.body.starts_with("data:") {
        let chunks: Vec<String> = sse_data(&a.body)
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| model(d))
            .collect();
        let least = if a.x_cache == "HIT" { 1 } else { 3 };
        assert!(
            chunks.len() >= least,
            "a stream of a few chunks: {}",
            a.body
        );
        chunks
    } else {
        vec![model(&a.body)]
    }
}

#[track_caller]
fn all_say(a: &Answer, name: &str) {
    assert_eq!(a.status, 200, "{}", a.body);
    let models = models_answered(a);
    assert!(models.iter().all(|m| m == name), "{models:?} in {}", a.body);
}

fn header(a: &Answer, name: &str) -> Option<String> {
    a.headers.get(name).map(|v| v.to_str().unwrap().to_string())
}

/// A draft pool and a target pool serving `llama` under their own names, the speculative
/// selector (draft first) and the cache.
fn speculative(draft: &vllm_sim::Sim, target: &vllm_sim::Sim, answer_model: &str) -> Value {
    json!({
        "pools": [
            pool("draft", &[PUBLIC], &[draft.addr()])
                .with("served_model", DRAFT)
                .with("answer_model", answer_model),
            pool("target", &[PUBLIC], &[target.addr()])
                .with("served_model", TARGET)
                .with("answer_model", answer_model),
        ],
        "plugins": {
            "cache": {"enabled": true, "tenant": {"anonymous": "share"}},
            "speculative": {"enabled": true, "models": [
                {"model": PUBLIC, "drafts": [{"pool": "draft"}], "target": "target"}
            ]},
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_public_name_each_pool_its_own_and_answers_say_the_public_name() {
    let (draft, target) = (sim_named(DRAFT).await, sim_named(TARGET).await);
    let proxy = Proxy::start(speculative(&draft, &target, "requested")).await;

    // The draft answers, JSON and a stream; each chunk says the name asked for.
    let json_ask = chat(PUBLIC, "hello", false);
    let a = proxy.ask(&json_ask, &[]).await;
    all_say(&a, PUBLIC);
    assert_eq!(header(&a, "x-sluice-pool").as_deref(), Some("draft"));
    assert_eq!(a.x_cache, "MISS");
    let stream_ask = chat(PUBLIC, "a story", true);
    let s = proxy.ask(&stream_ask, &[]).await;
    all_say(&s, PUBLIC);
    assert_eq!(header(&s, "x-sluice-pool").as_deref(), Some("draft"));
    assert_eq!(models_received(&draft), [DRAFT, DRAFT]);
    assert!(models_received(&target).is_empty());
    // The cache's usage request rode along with the name on the stream's body.
    // The last chat request: a health probe, a scrape or the models listing may come after.
    let stats = draft.stats();
    let chat_sent = stats
        .recent
        .iter()
        .rev()
        .find(|r| r.path == "/v1/chat/completions")
        .unwrap();
    let sent: Value = serde_json::from_slice(&chat_sent.body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
    assert!(
        !s.body.contains("\"usage\""),
        "the client did not ask for it"
    );

    // Cache hits, in either form, say the public name too (they store what the client got).
    let hit = proxy.until_hit(&json_ask, &[]).await;
    assert_eq!(hit.x_cache, "HIT");
    all_say(&hit, PUBLIC);
    let hit = proxy.until_hit(&chat(PUBLIC, "hello", true), &[]).await;
    assert_eq!(hit.x_cache, "HIT");
    all_say(&hit, PUBLIC);
    let hit = proxy.until_hit(&stream_ask, &[]).await;
    assert_eq!(hit.x_cache, "HIT");
    all_say(&hit, PUBLIC);
    assert_eq!(models_received(&draft).len(), 2, "hits went nowhere");

    // Forced to the target: the target's name goes up, the public name comes back.
    let forced = [("x-sluice-tier", "target")];
    let a = proxy.ask(&chat(PUBLIC, "forced", false), &forced).await;
    all_say(&a, PUBLIC);
    assert_eq!(header(&a, "x-sluice-escalated").as_deref(), Some("forced"));
    let s = proxy
        .ask(&chat(PUBLIC, "forced, streamed", true), &forced)
        .await;
    all_say(&s, PUBLIC);
    assert_eq!(models_received(&target), [TARGET, TARGET]);

    // A failing draft: tried with its name, escalated to the target with the target's.
    draft.set_faults(Faults {
        error_rate: 1.0,
        error_status: 503,
        ..Faults::default()
    });
    let a = proxy.ask(&chat(PUBLIC, "escalate me", false), &[]).await;
    all_say(&a, PUBLIC);
    assert_eq!(
        header(&a, "x-sluice-escalated").as_deref(),
        Some("draft-error")
    );
    let s = proxy.ask(&chat(PUBLIC, "escalate me too", true), &[]).await;
    all_say(&s, PUBLIC);
    assert_eq!(
        header(&s, "x-sluice-escalated").as_deref(),
        Some("draft-error")
    );
    assert_eq!(models_received(&draft), [DRAFT, DRAFT, DRAFT, DRAFT]);
    assert_eq!(models_received(&target), [TARGET, TARGET, TARGET, TARGET]);
    // The escalated answers were stored as the client got them.
    let hit = proxy
        .until_hit(&chat(PUBLIC, "escalate me", false), &[])
        .await;
    assert_eq!(hit.x_cache, "HIT");
    all_say(&hit, PUBLIC);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_model_served_says_the_name_that_served() {
    let (draft, target) = (sim_named(DRAFT).await, sim_named(TARGET).await);
    let proxy = Proxy::start(speculative(&draft, &target, "served")).await;
    let json_ask = chat(PUBLIC, "hello", false);
    all_say(&proxy.ask(&json_ask, &[]).await, DRAFT);
    all_say(&proxy.ask(&chat(PUBLIC, "a story", true), &[]).await, DRAFT);
    let hit = proxy.until_hit(&json_ask, &[]).await;
    assert_eq!(hit.x_cache, "HIT");
    all_say(&hit, DRAFT);
    let forced = [("x-sluice-tier", "target")];
    all_say(
        &proxy.ask(&chat(PUBLIC, "big", true), &forced).await,
        TARGET,
    );
    assert_eq!(models_received(&draft), [DRAFT, DRAFT]);
    assert_eq!(models_received(&target), [TARGET]);
}

/// Without a served name the simulator, asked for a name it does not serve, refuses, as vLLM
/// does: the name is what makes the pools above answer at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_served_name_an_engine_refuses_the_public_one() {
    let draft = sim_named(DRAFT).await;
    let proxy = Proxy::start(json!({"pools": [pool("draft", &[PUBLIC], &[draft.addr()])]})).await;
    let a = proxy.ask(&chat(PUBLIC, "hello", false), &[]).await;
    assert_eq!(a.status, 404, "{}", a.body);
    assert_eq!(models_received(&draft), [PUBLIC]);
}

const CHAT_JSON: &str = "vllm-chat-completion.json";
const CHAT_SSE: &str = "vllm-chat-stream.sse";
/// The model the fixtures were recorded from.
const RECORDED: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A client body with its own spacing, to see which bytes reach the upstream.
fn raw_body(model: &str, stream: bool) -> String {
    format!(
        "{{ \"messages\" : [ {{\"role\":\"user\", \"content\":\"Capital of France?\"}} ],\n  \"model\" :  \"{model}\" , \"stream\": {stream} }}"
    )
}

async fn post_raw(proxy: &Proxy, body: &str) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, headers, r.bytes().await.unwrap().to_vec())
}

fn sse_events(bytes: &[u8]) -> Vec<Vec<u8>> {
    String::from_utf8(bytes.to_vec())
        .unwrap()
        .split_inclusive("\n\n")
        .map(|e| e.as_bytes().to_vec())
        .collect()
}

/// Upstreams answering with recorded vLLM bytes: without a rewrite (no `served_model`, or the
/// client asking for the served name itself) the client gets them byte for byte; with one,
/// the same bytes but the `model` values, and the upstream gets the client's body but the
/// `model` value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_pass_unchanged_but_for_the_model_value() {
    let json_answer = fixture(CHAT_JSON);
    let stream = fixture(CHAT_SSE);
    let json_up = Scripted::start(Script::fixed("application/json", json_answer.clone())).await;
    let sse_up = Scripted::start(Script::event_stream(sse_events(&stream), Duration::ZERO)).await;
    let pools = |served: Option<&str>| {
        let with = |p: Pool| match served {
            Some(name) => p.with("served_model", name),
            None => p,
        };
        json!({"pools": [
            with(pool("json", &[PUBLIC, RECORDED], &[json_up.addr]).without_health_checks()),
            with(pool("sse", &["stream"], &[sse_up.addr]).without_health_checks()),
        ]})
    };
    let received = |up: &Scripted| up.received.lock().unwrap().last().unwrap().body.clone();

    // No served name: the answer and the request pass as they are.
    let plain = Proxy::start(pools(None)).await;
    let (status, headers, body) = post_raw(&plain, &raw_body(PUBLIC, false)).await;
    assert_eq!(status, 200);
    assert_eq!(body, json_answer, "the JSON answer changed");
    assert_eq!(
        headers["content-length"].to_str().unwrap(),
        json_answer.len().to_string()
    );
    assert_eq!(received(&json_up), raw_body(PUBLIC, false).as_bytes());
    let (_, _, body) = post_raw(&plain, &raw_body("stream", true)).await;
    assert_eq!(body, stream, "the stream changed");

    // A served name the client asks for itself: nothing to change either way.
    let same = Proxy::start(pools(Some(RECORDED))).await;
    let (_, _, body) = post_raw(&same, &raw_body(RECORDED, false)).await;
    assert_eq!(body, json_answer);
    assert_eq!(received(&json_up), raw_body(RECORDED, false).as_bytes());

    // The public name: spliced up, rewritten back, every other byte kept.
    let (_, headers, body) = post_raw(&same, &raw_body(PUBLIC, false)).await;
    let recorded = format!("\"model\":\"{RECORDED}\"");
    let public = format!("\"model\":\"{PUBLIC}\"");
    let expected = String::from_utf8(json_answer.clone())
        .unwrap()
        .replace(&recorded, &public);
    assert_eq!(String::from_utf8(body).unwrap(), expected);
    assert!(headers.get("content-length").is_none(), "{headers:?}");
    assert_eq!(received(&json_up), raw_body(RECORDED, false).as_bytes());
    let (_, _, body) = post_raw(&same, &raw_body("stream", true)).await;
    let expected = String::from_utf8(stream.clone())
        .unwrap()
        .replace(&recorded, "\"model\":\"stream\"");
    assert_eq!(String::from_utf8(body).unwrap(), expected);
    assert_eq!(received(&sse_up), raw_body(RECORDED, true).as_bytes());
}
