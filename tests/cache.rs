//! End-to-end: the cache plugin in the real binary, with the simulator upstream.

mod common;

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vllm_sim::{Faults, Latency, SimConfig};

const MODEL: &str = "test-model";

async fn sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_max_model_len(1 << 20),
    )
    .await
    .unwrap()
}

/// A proxy with the cache on (memory store) in front of `upstream`, plus `cache_extra` keys.
async fn cached_proxy(upstream: &vllm_sim::Sim, cache_extra: &str) -> Proxy {
    Proxy::start(&format!(
        "pools:\n{}plugins:\n  cache:\n    enabled: true\n{cache_extra}",
        pool("main", &[MODEL], &[upstream.addr()], "")
    ))
    .await
}

async fn ask(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> Answer {
    common::ask(&proxy.url("/v1/chat/completions"), body, headers).await
}

/// Asks until the answer is a hit: write-backs are asynchronous.
async fn until_hit(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let a = ask(proxy, body, headers).await;
        if a.x_cache == "HIT" || Instant::now() > deadline {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Gives an (unwanted) write-back the time it would need to land.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

fn upstream_calls(sim: &vllm_sim::Sim) -> u64 {
    sim.stats().count("/v1/chat/completions")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_request_is_answered_from_the_cache() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "").await;
    let request = chat(MODEL, "What is the capital of France?", false);

    let first = ask(&proxy, &request, &[]).await;
    assert_eq!((first.status, first.x_cache.as_str()), (200, "MISS"));
    let hit = until_hit(&proxy, &request, &[]).await;
    assert_eq!((hit.status, hit.x_cache.as_str()), (200, "HIT"));
    assert_eq!(upstream_calls(&upstream), 1);
    assert_eq!(content(&hit), content(&first));
    assert!(hit.headers.contains_key("age"));
    assert_eq!(hit.headers["x-sluice-pool"], "main");
    assert!(
        hit.headers.contains_key("x-request-id"),
        "other plugins decorate hits too"
    );
    let (a, b): (Value, Value) = (
        serde_json::from_str(&first.body).unwrap(),
        serde_json::from_str(&hit.body).unwrap(),
    );
    assert_ne!(a["id"], b["id"], "a fresh id per answer");
    assert_eq!(a["usage"], b["usage"], "usage kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_take_the_form_the_client_asks_for() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "").await;

    // Filled by a stream, served as JSON.
    let streamed = chat(MODEL, "filled by a stream", true);
    let first = ask(&proxy, &streamed, &[]).await;
    assert_eq!(first.x_cache, "MISS");
    let as_json = until_hit(&proxy, &chat(MODEL, "filled by a stream", false), &[]).await;
    assert_eq!(as_json.x_cache, "HIT");
    assert_eq!(as_json.headers["content-type"], "application/json");
    assert_eq!(content(&as_json), content(&first));

    // Filled by JSON, served as a stream with the usage chunk asked for.
    let plain = chat(MODEL, "filled by json", false);
    let first = ask(&proxy, &plain, &[]).await;
    let mut streamed = chat(MODEL, "filled by json", true);
    streamed["stream_options"] = json!({"include_usage": true});
    let as_stream = until_hit(&proxy, &streamed, &[]).await;
    assert_eq!(as_stream.x_cache, "HIT");
    assert!(as_stream.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(content(&as_stream), content(&first));
    let events = sse_data(&as_stream.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let first_event: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first_event["choices"][0]["delta"]["role"], "assistant");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert_eq!(upstream_calls(&upstream), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_share_entries() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "    tenant: {header: x-tenant-id}\n").await;
    let request = chat(MODEL, "same prompt, two tenants", false);
    let alice = [("authorization", "Bearer key-alice")];
    let bob = [("authorization", "Bearer key-bob")];

    ask(&proxy, &request, &alice).await;
    assert_eq!(until_hit(&proxy, &request, &alice).await.x_cache, "HIT");
    assert_eq!(ask(&proxy, &request, &bob).await.x_cache, "MISS");
    // The trusted header names the tenant, whatever the key.
    let acme_1 = [("x-tenant-id", "acme"), ("authorization", "Bearer one")];
    let acme_2 = [("x-tenant-id", "acme"), ("authorization", "Bearer two")];
    ask(&proxy, &request, &acme_1).await;
    assert_eq!(until_hit(&proxy, &request, &acme_2).await.x_cache, "HIT");
    assert_eq!(
        ask(&proxy, &request, &[]).await.x_cache,
        "MISS",
        "anonymous is a tenant too"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_order_hits_and_any_parameter_change_misses() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "").await;
    let body = br#"{"model":"test-model","messages":[{"role":"user","content":"order"}],"temperature":0,"max_tokens":16}"#;
    let reordered = br#"{ "max_tokens" : 16, "temperature" : 0.0, "messages" : [ {"content":"order","role":"user"} ], "model" : "test-model" }"#;
    let send = |bytes: &'static [u8]| {
        client()
            .post(proxy.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(bytes)
            .send()
    };
    send(body).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = send(reordered).await.unwrap();
        if r.headers()["x-cache"] == "HIT" {
            break;
        }
        assert!(Instant::now() < deadline, "the reordered request never hit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for changed in [
        json!({"model": MODEL, "messages": [{"role": "user", "content": "order"}], "temperature": 0, "max_tokens": 17}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "order"}], "temperature": 0, "max_tokens": 16, "top_p": 0.5}),
        json!({"model": MODEL, "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "order"}], "temperature": 0, "max_tokens": 16}),
    ] {
        assert_eq!(
            ask(&proxy, &changed, &[]).await.x_cache,
            "MISS",
            "{changed}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_control_and_sampled_requests() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "").await;

    let no_store = chat(MODEL, "no-store", false);
    assert_eq!(
        ask(&proxy, &no_store, &[("cache-control", "no-store")])
            .await
            .x_cache,
        "BYPASS"
    );
    settle().await;
    assert_eq!(
        ask(&proxy, &no_store, &[]).await.x_cache,
        "MISS",
        "no-store stored nothing"
    );

    let no_cache = chat(MODEL, "no-cache", false);
    ask(&proxy, &no_cache, &[]).await;
    assert_eq!(until_hit(&proxy, &no_cache, &[]).await.x_cache, "HIT");
    let skipped = ask(&proxy, &no_cache, &[("cache-control", "no-cache")]).await;
    assert_eq!(skipped.x_cache, "MISS", "no-cache skips the lookup");

    let mut sampled = chat(MODEL, "sampled", false);
    sampled.as_object_mut().unwrap().remove("temperature");
    assert_eq!(ask(&proxy, &sampled, &[]).await.x_cache, "BYPASS");
    let mut seeded = sampled.clone();
    seeded["seed"] = json!(42);
    ask(&proxy, &seeded, &[]).await;
    assert_eq!(
        until_hit(&proxy, &seeded, &[]).await.x_cache,
        "HIT",
        "a seed makes it reproducible"
    );
}

/// Sends `request` once with `faults` on, then checks that nothing was stored.
async fn not_stored(proxy: &Proxy, upstream: &vllm_sim::Sim, request: &Value, faults: Faults) {
    upstream.set_faults(faults);
    let _ = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(request)
        .send()
        .await
        .unwrap()
        .text()
        .await;
    upstream.set_faults(Faults::default());
    settle().await;
    let after = ask(proxy, request, &[]).await;
    assert_eq!(
        (after.status, after.x_cache.as_str()),
        (200, "MISS"),
        "{}",
        after.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_broken_answers_are_never_stored() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "").await;
    let cases = [
        (
            "dropped mid-stream",
            true,
            Faults {
                drop_after_chunks: Some(3),
                ..Faults::default()
            },
        ),
        (
            "error event",
            true,
            Faults {
                error_after_chunks: Some(2),
                ..Faults::default()
            },
        ),
        (
            "500",
            false,
            Faults {
                error_rate: 1.0,
                error_status: 500,
                ..Faults::default()
            },
        ),
        (
            "429",
            true,
            Faults {
                error_rate: 1.0,
                error_status: 429,
                ..Faults::default()
            },
        ),
    ];
    for (name, stream, faults) in cases {
        let request = chat(MODEL, &format!("broken: {name}"), stream);
        not_stored(&proxy, &upstream, &request, faults).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_stores_nothing() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(20), 50).await;
    let proxy = cached_proxy(&upstream, "").await;
    let mut request = chat(MODEL, "left early", true);
    request["max_tokens"] = json!(50);
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&request)
        .send()
        .await
        .unwrap();
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ask(&proxy, &request, &[]).await.x_cache, "MISS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_over_the_size_limit_are_not_stored() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "    max_entry_bytes: 200\n").await;
    let request = chat(MODEL, "too big to keep", false);
    assert_eq!(ask(&proxy, &request, &[]).await.x_cache, "MISS");
    settle().await;
    assert_eq!(ask(&proxy, &request, &[]).await.x_cache, "MISS");
    let metrics = client()
        .get(proxy.admin_url("/metrics"))
        .send()
        .await
        .unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(
        metrics.contains(r#"sluice_cache_writes_total{outcome="too_big"} 2"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_prompt_misses_then_hits() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, "").await;
    let request = chat(MODEL, &"context ".repeat(140_000), false);
    assert_eq!(ask(&proxy, &request, &[]).await.x_cache, "MISS");
    assert_eq!(until_hit(&proxy, &request, &[]).await.x_cache, "HIT");
    assert_eq!(upstream_calls(&upstream), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_requests_in_flight_go_upstream_once() {
    let upstream = vllm_sim::start(SimConfig::default().with_model(MODEL).with_latency(
        Latency::new(
            Duration::from_millis(300),
            Duration::ZERO,
            Duration::from_millis(5),
        ),
    ))
    .await
    .unwrap();
    let proxy = cached_proxy(&upstream, "").await;
    let request = chat(MODEL, "everyone asks this at once", true);
    let answers = futures_util::future::join_all((0..8).map(|_| ask(&proxy, &request, &[]))).await;
    assert_eq!(
        upstream_calls(&upstream),
        1,
        "coalesced into one upstream request"
    );
    let texts: Vec<String> = answers.iter().map(content).collect();
    assert!(answers.iter().all(|a| a.status == 200));
    assert!(texts.iter().all(|t| t == &texts[0] && !t.is_empty()));
    let misses = answers.iter().filter(|a| a.x_cache == "MISS").count();
    assert_eq!(misses, 1, "one leader, the others answered from its answer");
    let metrics = client()
        .get(proxy.admin_url("/metrics"))
        .send()
        .await
        .unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(
        metrics.contains(r#"llm_cache_requests_total{result="coalesced"} 7"#),
        "{metrics}"
    );
    assert!(metrics.contains("llm_cache_hit_ratio 0.875"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_leader_lets_its_followers_go_upstream() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(100), 20).await;
    let proxy = cached_proxy(&upstream, "").await;
    let request = chat(MODEL, "the leader fails", true);
    // The leader's stream breaks after a few chunks...
    upstream.set_faults(Faults {
        drop_after_chunks: Some(3),
        ..Faults::default()
    });
    let leader = tokio::spawn({
        let (url, request) = (proxy.url("/v1/chat/completions"), request.clone());
        async move {
            client()
                .post(url)
                .json(&request)
                .send()
                .await
                .unwrap()
                .text()
                .await
        }
    });
    while upstream.stats().running == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...while two identical requests wait for it; they must go upstream themselves.
    let followers = futures_util::future::join_all((0..2).map(|_| ask(&proxy, &request, &[])));
    let clear = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        upstream.set_faults(Faults::default());
    };
    let (answers, ()) = tokio::join!(followers, clear);
    let _ = leader.await;
    for a in &answers {
        assert_eq!((a.status, a.x_cache.as_str()), (200, "MISS"));
        assert_eq!(sse_data(&a.body).last().map(String::as_str), Some("[DONE]"));
    }
    assert_eq!(upstream_calls(&upstream), 3);
}
