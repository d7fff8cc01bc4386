//! The exact prefix index: Sluice in front of simulated vLLM V1 engines (chunked prefill,
//! prefix caching, KV events over ZMQ, the same tokenizer folder as the pool's), following
//! their events and sending each conversation's next turn where its history is cached.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::{KvEventsConfig, Sim, SimConfig};

const MODEL: &str = "m";

fn tokenizer_dir() -> String {
    format!(
        "{}/tests/fixtures/tokenizer-chatml",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// A V1-like engine publishing its KV events, tokenizing with the pool's tokenizer.
async fn engine() -> Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_served_model_names(vec![MODEL.to_string()])
            .with_tokenizer(tokenizer_dir())
            .v1_engine(2048)
            .with_kv_events(KvEventsConfig::default()),
    )
    .await
    .unwrap()
}

fn config(sims: &[Sim], strategy: &str, exact: bool) -> Value {
    let addrs: Vec<_> = sims.iter().map(Sim::addr).collect();
    let mut pool = pool("fleet", &[MODEL], &addrs)
        .with_fast_health_checks()
        .with(
            "balancing",
            json!({"strategy": strategy, "exploration": 0.0}),
        );
    if exact {
        pool = pool
            .with("tokenizer", tokenizer_dir())
            .with("kv_events", "auto");
    }
    json!({"pools": [pool]})
}

/// A conversation's request at `turns` turns: a long system prompt of its own, its history.
fn turn(conversation: usize, turns: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": format!("Conversation {conversation}. {}", "Keep every answer short and exact. ".repeat(30))}),
    ];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Question {t} of conversation {conversation}: what holds block {t}?")}));
        messages.push(json!({"role": "assistant", "content": format!("Block {t} holds the tokens of turn {t}.")}));
    }
    messages.push(json!({"role": "user", "content": "And the next one?"}));
    json!({"model": MODEL, "messages": messages, "max_tokens": 4})
}

/// Each engine's chat requests so far.
fn chat_counts(sims: &[Sim]) -> Vec<u64> {
    sims.iter()
        .map(|s| s.stats().count("/v1/chat/completions"))
        .collect()
}

/// Which engine served the last request: the one whose count went up.
fn served_by(sims: &[Sim], before: &[u64]) -> usize {
    let now = chat_counts(sims);
    let moved: Vec<usize> = (0..sims.len()).filter(|&i| now[i] > before[i]).collect();
    assert_eq!(
        moved.len(),
        1,
        "one engine served it: {before:?} -> {now:?}"
    );
    moved[0]
}

/// The index's blocks for each backend, from the admin's metrics.
async fn indexed_blocks(proxy: &Proxy) -> f64 {
    proxy
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with("sluice_prefix_index_blocks{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_turn_goes_where_its_history_is_cached() {
    let sims = vec![
        engine().await,
        engine().await,
        engine().await,
        engine().await,
    ];
    // Every request with nothing cached anywhere explores: each conversation's first turn
    // lands on a random engine (how fast each engine looks depends on what the warm-up
    // measured on a busy machine, so by prediction alone they could all pick one), and the
    // later turns, held somewhere, must never explore away from their cache.
    let mut config = config(&sims, "ttft", true);
    config["pools"][0]["balancing"]["exploration"] = json!(1.0);
    let proxy = Proxy::start(config).await;
    // The subscribers are up once a request's blocks reach the index. ZMQ drops what is
    // published before a subscription arrives: a warm-up conversation is sent until its
    // blocks are seen.
    let warm = turn(999, 1);
    wait_for(Duration::from_secs(30), || async {
        proxy.ask(&warm, &[]).await;
        indexed_blocks(&proxy).await > 0.0
    })
    .await
    .expect("the index follows the engines' events");
    // Every backend's subscriber must be live before the test's turns: reset each engine's
    // cache until every one's clear has been seen (a reset publishes AllBlocksCleared).
    for sim in &sims {
        sim.reset_prefix_cache();
    }
    wait_for(Duration::from_secs(10), || async {
        indexed_blocks(&proxy).await == 0.0
    })
    .await
    .expect("the clears reach the index");

    let mut home = Vec::new();
    for conversation in 0..8 {
        let before = chat_counts(&sims);
        let answer = proxy.ask(&turn(conversation, 1), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        home.push(served_by(&sims, &before));
    }
    // Turn 1 of each conversation teaches the index where its blocks are: each backend
    // stores them after the prefill, and Sluice hears of it.
    wait_for(Duration::from_secs(10), || async {
        let held: usize = sims.iter().map(Sim::cached_blocks).sum();
        indexed_blocks(&proxy).await as usize == held
    })
    .await
    .expect("the index holds what the engines hold");
    for turns in 2..5 {
        for (conversation, &home) in home.iter().enumerate() {
            let before = chat_counts(&sims);
            let answer = proxy.ask(&turn(conversation, turns), &[]).await;
            assert_eq!(answer.status, 200);
            assert_eq!(
                served_by(&sims, &before),
                home,
                "conversation {conversation}, turn {turns}: where its history is"
            );
            let body: Value = serde_json::from_str(&answer.body).unwrap();
            let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(cached > 100, "served from the prefix cache: {cached}");
            // The next turn's blocks are indexed before it is asked.
            wait_for(Duration::from_secs(10), || async {
                let held: usize = sims.iter().map(Sim::cached_blocks).sum();
                indexed_blocks(&proxy).await as usize == held
            })
            .await
            .expect("the index holds what the engines hold");
        }
    }
    // The conversations were spread, so the test is not passed by one engine holding all
    // (all eight on one of four by chance: 1 in 16,384).
    let mut used = home.clone();
    used.sort_unstable();
    used.dedup();
    assert!(used.len() > 1, "turns 1 were spread: {home:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_tokenizer_the_pool_routes_as_before() {
    let sims = vec![engine().await, engine().await];
    let proxy = Proxy::start(config(&sims, "ttft", false)).await;
    for conversation in 0..4 {
        let answer = proxy.ask(&turn(conversation, 2), &[]).await;
        assert_eq!(answer.status, 200);
    }
    assert_eq!(
        indexed_blocks(&proxy).await,
        0.0,
        "no index without its keys"
    );
    let served: u64 = sims
        .iter()
        .map(|s| s.stats().count("/v1/chat/completions"))
        .sum();
    assert_eq!(served, 4);
}

/// The pool's prefix index counters, from `/status`.
async fn prefix_status(proxy: &Proxy) -> Value {
    proxy.status().await["pools"][0]["prefix_index"].clone()
}

/// Each tenant's requests carry a salt of their own (`client_fields.cache_salt: per_tenant`):
/// the engine shares no block across tenants, and the index credits none either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_never_credited_with_another_tenants_blocks() {
    let sims = vec![engine().await, engine().await];
    let mut config = config(&sims, "ttft", true);
    config["plugins"] = json!({"tenants": {"enabled": true, "tenants": {
        "a": {"keys": [key_digest("sk-a")]},
        "b": {"keys": [key_digest("sk-b")]},
    }}});
    let proxy = Proxy::start(config).await;
    let a = [("authorization", "Bearer sk-a")];
    let b = [("authorization", "Bearer sk-b")];
    // Until the subscribers are live, as above.
    let warm = turn(999, 1);
    wait_for(Duration::from_secs(30), || async {
        proxy.ask(&warm, &a).await;
        indexed_blocks(&proxy).await > 0.0
    })
    .await
    .expect("the index follows the engines' events");
    let before = chat_counts(&sims);
    assert_eq!(proxy.ask(&turn(1, 1), &a).await.status, 200);
    let home = served_by(&sims, &before);
    wait_for(Duration::from_secs(10), || async {
        let held: usize = sims.iter().map(Sim::cached_blocks).sum();
        indexed_blocks(&proxy).await as usize == held
    })
    .await
    .expect("the index holds what the engines hold");
    // Tenant b's same conversation: nothing of it is cached for b, and nothing is predicted.
    let predicted = prefix_status(&proxy).await["predicted_cached_tokens"]
        .as_u64()
        .unwrap();
    let answer = proxy.ask(&turn(1, 2), &b).await;
    assert_eq!(answer.status, 200);
    let body: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(0)
    );
    assert_eq!(
        prefix_status(&proxy).await["predicted_cached_tokens"]
            .as_u64()
            .unwrap(),
        predicted,
        "no block of tenant a's is credited to tenant b"
    );
    // Tenant a's next turn is credited, goes home, and is served from the cache.
    let before = chat_counts(&sims);
    let answer = proxy.ask(&turn(1, 2), &a).await;
    assert_eq!(served_by(&sims, &before), home);
    let body: Value = serde_json::from_str(&answer.body).unwrap();
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 100);
    let status = prefix_status(&proxy).await;
    assert_eq!(
        status["predicted_cached_tokens"].as_u64().unwrap() - predicted,
        cached,
        "the index predicted exactly what the engine served"
    );
    for sim in &sims {
        let backend = proxy.backend_status("fleet", sim.addr()).await;
        assert_eq!(
            backend["prefix_index"]["blocks"],
            json!(sim.cached_blocks())
        );
        // A backend whose batches came says how old the last one was when it came.
        if sim.cached_blocks() > 0 {
            let lag = backend["prefix_index"]["event_lag_seconds"].as_f64();
            assert!(lag.is_some_and(|l| l >= 0.0), "{backend}");
        }
    }
}

/// A LoRA adapter's blocks are keyed with its name by the engine (its events say so): the
/// index credits them to that adapter's requests only, and predicts exactly what the engine
/// serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_prompt_is_credited_with_its_own_blocks_only() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_served_model_names(vec![MODEL.to_string()])
            .with_tokenizer(tokenizer_dir())
            .v1_engine(2048)
            .with_kv_events(KvEventsConfig::default())
            .with_lora(vllm_sim::LoraConfig::new(1).with_module("sql", "/adapters/sql")),
    )
    .await
    .unwrap();
    let addr = sim.addr();
    let mut config = config(std::slice::from_ref(&sim), "ttft", true);
    config["pools"][0]["models"] = json!([MODEL, "sql"]);
    let proxy = Proxy::start(config).await;
    let warm = turn(999, 1);
    wait_for(Duration::from_secs(30), || async {
        proxy.ask(&warm, &[]).await;
        indexed_blocks(&proxy).await > 0.0
    })
    .await
    .expect("the index follows the engine's events");
    // The pool asks the engine's /v1/models which adapters it serves.
    wait_for(Duration::from_secs(10), || async {
        proxy.backend_status("fleet", addr).await["lora"]["adapters"] == json!(["sql"])
    })
    .await
    .expect("the pool learns the backend's adapters");

    let as_model = |model: &str, turns: usize| {
        let mut request = turn(7, turns);
        request["model"] = json!(model);
        request
    };
    let cached = |answer: &Answer| -> u64 {
        let body: Value = serde_json::from_str(&answer.body).unwrap();
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let predicted = || async {
        prefix_status(&proxy).await["predicted_cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(proxy.ask(&as_model("sql", 1), &[]).await.status, 200);
    wait_for(Duration::from_secs(10), || async {
        indexed_blocks(&proxy).await as usize == sim.cached_blocks()
    })
    .await
    .expect("the index holds what the engine holds");
    // The adapter's next turn: credited with exactly what the engine serves it.
    let before = predicted().await;
    let answer = proxy.ask(&as_model("sql", 2), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let served = cached(&answer);
    assert!(
        served > 100,
        "the history is cached for the adapter: {served}"
    );
    assert_eq!(predicted().await - before, served);
    // The base model's same turn: nothing cached for it, nothing credited.
    let before = predicted().await;
    let answer = proxy.ask(&as_model(MODEL, 2), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(cached(&answer), 0);
    assert_eq!(
        predicted().await,
        before,
        "the adapter's blocks are not the base model's"
    );
}

/// A chat of `bytes` bytes of varied words (a tokenizer's cache has seen none of them).
fn huge_chat(bytes: usize, seed: usize) -> Vec<u8> {
    let mut text = String::with_capacity(bytes + 64);
    let mut n = seed.wrapping_mul(2_654_435_761);
    while text.len() < bytes {
        n = n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        text.push_str(&format!("w{:x} ", n >> 40));
    }
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": text}]}))
    .unwrap()
}

/// Tokenizing for the index was unbounded and never cancelled: 16 clients that sent a
/// 1.5 MB chat and closed at once kept their bodies' memory (and a queue of seconds of
/// tokenizing ahead of every large body's parse) until each was tokenized. Work for a client
/// that left is now dropped with its request, a prompt waits at most a second for it, and one
/// past 2 MiB is not tokenized at all: each goes without the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizing_is_bounded_and_dropped_with_a_client_that_left() {
    use tokio::io::AsyncWriteExt;
    let sims = vec![engine().await];
    let proxy = Proxy::start(config(&sims, "ttft", true)).await;
    let buffered =
        |metrics: &str| metric_value(metrics, "sluice_memory_buffered_bytes").unwrap_or(0.0);
    let mut sent = Vec::new();
    for i in 0..16 {
        let body = huge_chat(1_500_000, i);
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body).await.unwrap();
        sent.push(s);
    }
    // Every body arrived (their memory is counted) before the clients leave.
    let prefix = |status: &Value| status["pools"][0]["prefix_index"].clone();
    drop(sent);
    let released = wait_for(Duration::from_secs(20), || async {
        buffered(&proxy.metrics().await) == 0.0
    })
    .await;
    let status = proxy.status().await;
    assert!(released.is_some(), "bodies still held: {}", prefix(&status));
    assert!(
        prefix(&status)["passed_over_prompts"].as_u64().unwrap() > 0,
        "{}",
        prefix(&status)
    );
    // Past 2 MiB: sent on without the index (the engine says it is too long for its
    // context: its answer is the client's).
    let asked = sims[0].stats().count("/v1/chat/completions");
    let answer = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(huge_chat(2_200_000, 99))
        .send()
        .await
        .unwrap();
    assert!(answer.status() == 200 || answer.status() == 400);
    assert_eq!(sims[0].stats().count("/v1/chat/completions"), asked + 1);
    let status = proxy.status().await;
    assert_eq!(prefix(&status)["too_long_prompts"], 1);
}

/// A reload (`SIGHUP`, the same file) kept the backends but started their pool's learning
/// over: an empty prefix index until the engines stored blocks again, no sessions, a prompt
/// scale of 1. A pool that stays now keeps what it learned, and a conversation's next turn
/// still goes where its history is cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_what_the_pool_learned() {
    let sims = vec![engine().await, engine().await];
    let mut config = config(&sims, "ttft", true);
    config["pools"][0]["balancing"]["session_affinity"] = json!("soft");
    let proxy = Proxy::start(config).await;
    let warm = turn(999, 1);
    wait_for(Duration::from_secs(30), || async {
        proxy.ask(&warm, &[]).await;
        indexed_blocks(&proxy).await > 0.0
    })
    .await
    .expect("the index follows the engines' events");
    let mut home = Vec::new();
    for conversation in 0..4 {
        let before = chat_counts(&sims);
        let session = format!("session-{conversation}");
        let answer = proxy
            .ask(&turn(conversation, 1), &[("x-session-id", &session)])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        home.push(served_by(&sims, &before));
    }
    wait_for(Duration::from_secs(10), || async {
        let held: usize = sims.iter().map(Sim::cached_blocks).sum();
        indexed_blocks(&proxy).await as usize == held
    })
    .await
    .expect("the index holds what the engines hold");
    // What the pool knows, as `/status` says it (the backends in a stable order).
    let learned = || async {
        let pool = proxy.status().await["pools"][0].clone();
        let mut blocks: Vec<(String, Value)> = pool["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                (
                    b["address"].to_string(),
                    b["prefix_index"]["blocks"].clone(),
                )
            })
            .collect();
        blocks.sort_by(|a, b| a.0.cmp(&b.0));
        (
            blocks,
            pool["sessions"].clone(),
            pool["prompt_scale"].clone(),
        )
    };
    let before = learned().await;
    assert!(
        before.0.iter().any(|(_, b)| b.as_u64() > Some(0)),
        "{before:?}"
    );
    assert_eq!(before.1, json!(4), "{before:?}");

    proxy.reload().await;
    assert_eq!(
        learned().await,
        before,
        "what the pool learned, after the reload"
    );
    // Each conversation's next turn goes home, its history credited there.
    for (conversation, &home) in home.iter().enumerate() {
        let before = chat_counts(&sims);
        let answer = proxy.ask(&turn(conversation, 2), &[]).await;
        assert_eq!(answer.status, 200);
        assert_eq!(
            served_by(&sims, &before),
            home,
            "conversation {conversation}"
        );
    }
}
