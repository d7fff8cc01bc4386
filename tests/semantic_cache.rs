//! End-to-end: the cache's semantic part in the real binary, the simulator upstream (a chat
//! model answering by the prompt's words, so that one question asked in other case, spacing
//! or punctuation gets the same answer) and a simulated embedding model behind Sluice's own
//! embeddings pool.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::net::SocketAddr;
use std::time::Duration;
use vllm_sim::SimConfig;

const MODEL: &str = "test-model";
const EMBEDDER: &str = "all-MiniLM-L6-v2";

/// The bound the learning tests use: with 11 right examples (and none wrong) the cache-wide
/// 95 % upper bound, z²/(n+z²), is 2.71/13.71 = 0.197, under it; with 10 it is 0.213. At
/// 2 % it would take 133.
const BOUND: f64 = 0.2;
const EXAMPLES_TO_SERVE: usize = 11;

struct Fleet {
    chat: vllm_sim::Sim,
    _embedder: vllm_sim::Sim,
    proxy: Proxy,
}

async fn chat_model() -> vllm_sim::Sim {
    vllm_sim::start(SimConfig::default().with_model(MODEL).answering_by_words())
        .await
        .unwrap()
}

async fn embedder() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(EMBEDDER)
            .embedding_model(384),
    )
    .await
    .unwrap()
}

/// A proxy whose cache has a semantic part on the pool at `embeddings` (the embedder's,
/// unless a test gives another address); `semantic` adds keys to its section.
async fn proxy(chat: &vllm_sim::Sim, embeddings: SocketAddr, semantic: Value) -> Proxy {
    let mut section = json!({"pool": "embed", "max_error_rate": BOUND, "verify_rate": 0});
    if let Value::Object(keys) = semantic {
        section.as_object_mut().unwrap().extend(keys);
    }
    Proxy::start(json!({
        "pools": [
            pool("main", &[MODEL], &[chat.addr()]),
            pool("embed", &[EMBEDDER], &[embeddings]),
        ],
        "plugins": {"cache": {
            "enabled": true,
            "tenant": {"anonymous": "share"},
            "semantic": section,
        }},
    }))
    .await
}

async fn fleet(semantic: Value) -> Fleet {
    let (chat, embedder) = (chat_model().await, embedder().await);
    let proxy = proxy(&chat, embedder.addr(), semantic).await;
    Fleet {
        chat,
        _embedder: embedder,
        proxy,
    }
}

/// The same question, worded `i` ways apart: case, spacing and punctuation only, so that the
/// model's answer and the question's embedding are the same, and the exact key is not.
fn variant(question: &str, i: usize) -> String {
    let spaced = question.replacen(' ', &" ".repeat(1 + i % 7), 1);
    let cased = if i.is_multiple_of(2) {
        spaced.to_lowercase()
    } else {
        spaced.to_uppercase()
    };
    format!("{cased}{}", "?".repeat(i / 7))
}

async fn series(proxy: &Proxy, name: &str, labels: &str) -> f64 {
    proxy
        .metric(&format!("{name}{{{labels}}}"))
        .await
        .unwrap_or(0.0)
}

async fn lookups(proxy: &Proxy, result: &str) -> f64 {
    series(
        proxy,
        "sluice_cache_semantic_lookups_total",
        &format!(r#"result="{result}""#),
    )
    .await
}

/// Waits until `sluice_cache_semantic_verifications_total{result}` is `count`: the answer
/// is compared once the client has it.
async fn wait_for_verified(proxy: &Proxy, result: &str, count: usize) {
    let name =
        format!(r#"sluice_cache_semantic_verifications_total{{pool="embed",result="{result}"}}"#);
    let now = proxy.metric_once(&name, count as f64).await;
    assert_eq!(
        now,
        Some(count as f64),
        "verifications {result}: {}",
        proxy.logs()
    );
}

/// Waits until `sluice_cache_semantic_entries` is `count`.
async fn wait_for_entries(proxy: &Proxy, count: usize) {
    let now = proxy
        .metric_once("sluice_cache_semantic_entries", count as f64)
        .await;
    assert_eq!(now, Some(count as f64), "entries: {}", proxy.logs());
}

/// Asks `question` and then `EXAMPLES_TO_SERVE` of its variants, each a miss whose answer
/// is verified right against the first: by the end its answer may be served.
async fn teach(proxy: &Proxy, question: &str, headers: &[(&str, &str)]) {
    let first = proxy.ask(&chat(MODEL, question, false), headers).await;
    assert_eq!((first.status, first.x_cache.as_str()), (200, "MISS"));
    wait_for_entries(proxy, 1).await;
    for i in 1..=EXAMPLES_TO_SERVE {
        let answer = proxy
            .ask(&chat(MODEL, &variant(question, i), false), headers)
            .await;
        assert_eq!(
            (answer.status, answer.x_cache.as_str()),
            (200, "MISS"),
            "variant {i}"
        );
        assert!(!answer.headers.contains_key("x-cache-similarity"));
        wait_for_verified(proxy, "right", i).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reworded_question_is_served_once_enough_answers_agreed() {
    let f = fleet(json!({})).await;
    let question = "What is the capital of France";
    teach(&f.proxy, question, &[]).await;
    let calls = upstream_calls(&f.chat);
    assert_eq!(calls, 1 + EXAMPLES_TO_SERVE as u64);

    let asked = variant(question, 40);
    let hit = f.proxy.ask(&chat(MODEL, &asked, false), &[]).await;
    assert_eq!(
        (hit.status, hit.x_cache.as_str()),
        (200, "HIT"),
        "{}",
        hit.body
    );
    assert_eq!(hit.headers["x-cache-similarity"], "1.0000");
    assert_eq!(upstream_calls(&f.chat), calls, "answered without the model");
    // The model's own answer to it is the one served.
    let direct = ask_url(
        &format!("http://{}/v1/chat/completions", f.chat.addr()),
        &chat(MODEL, &asked, false),
        &[],
    )
    .await;
    assert_eq!(content(&hit), content(&direct));

    // A stream is replayed as a stream.
    let streamed = f
        .proxy
        .ask(&chat(MODEL, &variant(question, 41), true), &[])
        .await;
    assert_eq!(streamed.x_cache, "HIT");
    assert!(streamed.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(
        streamed.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        streamed.body
    );
    assert_eq!(lookups(&f.proxy, "hit").await, 2.0);
    assert_eq!(
        series(&f.proxy, "llm_cache_requests_total", r#"result="hit""#).await,
        2.0
    );
    let bound = series(
        &f.proxy,
        "sluice_cache_semantic_error_rate",
        r#"pool="embed""#,
    )
    .await;
    assert!(bound > 0.0 && bound <= BOUND, "{bound}");
    // What it learned, in /status.
    let status = f.proxy.status().await;
    let semantic = &status["plugin_status"]["cache"]["semantic"];
    assert_eq!(semantic["pool"], "embed");
    assert_eq!(semantic["verified"], EXAMPLES_TO_SERVE as u64);
    assert_eq!(semantic["verified_wrong"], 0);
    assert_eq!(semantic["index"]["store"], "memory");
    assert_eq!(semantic["index"]["questions"], 1 + EXAMPLES_TO_SERVE as u64);
    // Every example was at 1.0: the examples within 0.02 above a similarity speak for it.
    let threshold = semantic["threshold"].as_f64().unwrap();
    assert!((0.975..=1.0).contains(&threshold), "{threshold}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_question_is_not_served_and_its_different_answer_is_counted_wrong() {
    let f = fleet(json!({})).await;
    teach(&f.proxy, "What is the capital of France", &[]).await;
    let other = f
        .proxy
        .ask(&chat(MODEL, "What is the capital of Spain", false), &[])
        .await;
    assert_eq!(other.x_cache, "MISS");
    wait_for_verified(&f.proxy, "wrong", 1).await;
    assert_eq!(
        lookups(&f.proxy, "explore").await,
        1.0 + EXAMPLES_TO_SERVE as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_never_share_an_entry() {
    let (model, embedder) = (chat_model().await, embedder().await);
    // Without `anonymous: share`, each API key is a partition of its own.
    let proxy = Proxy::start(json!({
        "pools": [
            pool("main", &[MODEL], &[model.addr()]),
            pool("embed", &[EMBEDDER], &[embedder.addr()]),
        ],
        "plugins": {"cache": {
            "enabled": true,
            "semantic": {"pool": "embed", "max_error_rate": BOUND, "verify_rate": 0},
        }},
    }))
    .await;
    let question = "How tall is the Eiffel tower";
    let alice = [("authorization", "Bearer key-of-alice")];
    teach(&proxy, question, &alice).await;
    let hit = proxy
        .ask(&chat(MODEL, &variant(question, 30), false), &alice)
        .await;
    assert_eq!(hit.x_cache, "HIT");

    let bob = [("authorization", "Bearer key-of-bob")];
    let before = upstream_calls(&model);
    let theirs = proxy
        .ask(&chat(MODEL, &variant(question, 30), false), &bob)
        .await;
    assert_eq!((theirs.status, theirs.x_cache.as_str()), (200, "MISS"));
    assert_eq!(upstream_calls(&model), before + 1);
    // Not even a neighbour: no example was taken from it.
    assert_eq!(
        lookups(&proxy, "miss").await,
        2.0,
        "alice's first and bob's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calling_requests_stay_exact_unless_configured() {
    let tools = json!([{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {}}}}]);
    let with_tools = |text: &str| {
        let mut request = chat(MODEL, text, false);
        request["tools"] = tools.clone();
        request
    };
    let f = fleet(json!({})).await;
    let answer = f.proxy.ask(&with_tools("Weather in Paris"), &[]).await;
    assert_eq!((answer.status, answer.x_cache.as_str()), (200, "MISS"));
    assert_eq!(lookups(&f.proxy, "agent").await, 1.0);
    assert_eq!(lookups(&f.proxy, "miss").await, 0.0, "no embedding asked");

    // A route that asks: the chat route's agents take part, the Messages route's do not.
    let g = fleet(json!({"agent_requests": ["chat"]})).await;
    g.proxy.ask(&with_tools("Weather in Paris"), &[]).await;
    assert_eq!(lookups(&g.proxy, "agent").await, 0.0);
    assert_eq!(lookups(&g.proxy, "miss").await, 1.0);
    wait_for_entries(&g.proxy, 1).await;
    let message = json!({"model": MODEL, "max_tokens": 16, "temperature": 0,
        "tools": [{"name": "weather", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [{"role": "user", "content": "Weather in Paris"}]});
    let answer = ask_url(
        &g.proxy.url("/v1/messages"),
        &message,
        &[("anthropic-version", "2023-06-01")],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(lookups(&g.proxy, "agent").await, 1.0);

    let h = fleet(json!({"agent_requests": true})).await;
    h.proxy.ask(&with_tools("Weather in Paris"), &[]).await;
    assert_eq!(lookups(&h.proxy, "agent").await, 0.0);
    assert_eq!(lookups(&h.proxy, "miss").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_embeddings_pool_down_requests_go_upstream_as_if_it_were_off() {
    let chat_sim = chat_model().await;
    // Nothing listens there.
    let dead: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let proxy = proxy(&chat_sim, dead, json!({})).await;
    for i in 0..3 {
        let answer = proxy
            .ask(&chat(MODEL, &variant("Who wrote Hamlet", i), false), &[])
            .await;
        assert_eq!((answer.status, answer.x_cache.as_str()), (200, "MISS"));
    }
    assert_eq!(upstream_calls(&chat_sim), 3);
    assert_eq!(lookups(&proxy, "unavailable").await, 3.0);
    // The exact cache still serves an exact repeat.
    let again = proxy
        .until_hit(&chat(MODEL, &variant("Who wrote Hamlet", 0), false), &[])
        .await;
    assert_eq!(again.x_cache, "HIT");
    assert!(!again.headers.contains_key("x-cache-similarity"));
}

/// Two replicas sharing a Redis with vector search (`index: redis`): a question one of them
/// stored is the other's neighbour at once, within its group only; each learns apart, and
/// the second serves a hit once its own examples agree. Redis gone, requests go upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_their_questions_through_redis() {
    let mut redis = RedisServer::start_with_search();
    let (model, embedder) = (chat_model().await, embedder().await);
    let replica = || async {
        Proxy::start(json!({
            "pools": [
                pool("main", &[MODEL], &[model.addr()]),
                pool("embed", &[EMBEDDER], &[embedder.addr()]),
            ],
            "plugins": {"cache": {
                "enabled": true,
                "tenant": {"anonymous": "share"},
                "store": "redis",
                // A loaded test machine can stall a lookup past the 25 ms default.
                "redis": {"url": redis.url(), "lookup_timeout": "2s"},
                "semantic": {"pool": "embed", "max_error_rate": BOUND, "verify_rate": 0,
                             "index": "redis"},
            }},
        }))
        .await
    };
    let (a, b) = (replica().await, replica().await);
    let questions_in_redis = |n: usize| {
        let port = redis.port();
        move || async move {
            redis_cli(port, &["KEYS", "llm:cache:sem:384:*"])
                .lines()
                .count()
                == n
        }
    };
    let question = "What is the capital of France";
    let first = a.ask(&chat(MODEL, question, false), &[]).await;
    assert_eq!((first.status, first.x_cache.as_str()), (200, "MISS"));
    assert!(
        wait_for(Duration::from_secs(30), questions_in_redis(1))
            .await
            .is_some(),
        "the question was indexed in Redis: {}",
        a.logs()
    );
    // B never saw it, and compares its reworded question with A's answer.
    let reworded = b.ask(&chat(MODEL, &variant(question, 1), false), &[]).await;
    assert_eq!(reworded.x_cache, "MISS");
    assert_eq!(lookups(&b, "explore").await, 1.0, "{}", b.logs());
    assert_eq!(lookups(&b, "miss").await, 0.0);
    wait_for_verified(&b, "right", 1).await;
    // Another system prompt is another group: no neighbour, though the question is the same.
    let other_group = json!({"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": variant(question, 2)}]});
    let alone = b.ask(&other_group, &[]).await;
    assert_eq!(alone.x_cache, "MISS");
    assert_eq!(lookups(&b, "miss").await, 1.0);
    // B learns from its own examples (replicas learn apart), then serves.
    for i in 3..=EXAMPLES_TO_SERVE + 1 {
        let answer = b.ask(&chat(MODEL, &variant(question, i), false), &[]).await;
        assert_eq!(answer.x_cache, "MISS", "variant {i}");
    }
    wait_for_verified(&b, "right", EXAMPLES_TO_SERVE).await;
    let hit = b
        .ask(&chat(MODEL, &variant(question, 40), false), &[])
        .await;
    assert_eq!(
        (hit.status, hit.x_cache.as_str()),
        (200, "HIT"),
        "{}",
        b.logs()
    );
    assert_eq!(hit.headers["x-cache-similarity"], "1.0000");
    assert_eq!(
        b.status().await["plugin_status"]["cache"]["semantic"]["index"]["store"],
        "redis"
    );

    // Redis gone: the lookup fails fast and the request is answered upstream.
    redis.stop();
    let without = b
        .ask(&chat(MODEL, &variant(question, 41), false), &[])
        .await;
    assert_eq!(without.status, 200);
    assert_eq!(without.x_cache, "MISS");
    assert!(lookups(&b, "index_failed").await >= 1.0);
}
