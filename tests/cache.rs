//! End-to-end: the cache plugin in the real binary, with the simulator upstream.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use serde_json::{json, Value};
use sluice_testkit::*;
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

/// A proxy with the cache on (memory store) in front of `upstream`; `settings` (an object)
/// adds keys to the cache section.
async fn cached_proxy(upstream: &vllm_sim::Sim, settings: Value) -> Proxy {
    // These clients send no key: they share the anonymous partition (tested in its own test).
    let mut cache = json!({"enabled": true, "tenant": {"anonymous": "share"}});
    if let Value::Object(keys) = settings {
        cache.as_object_mut().unwrap().extend(keys);
    }
    Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"cache": cache},
    }))
    .await
}

/// `sluice_cache_writes_total{outcome}`: how many answers the cache decided to store
/// (`stored`) or not, and why.
async fn writes(proxy: &Proxy, outcome: &str) -> f64 {
    let series = format!(r#"sluice_cache_writes_total{{outcome="{outcome}"}}"#);
    proxy.metric(&series).await.unwrap_or(0.0)
}

/// Waits until `writes(outcome)` reaches `count`: the cache decides once the answer has been
/// sent, so after the client has it.
async fn wait_for_writes(proxy: &Proxy, outcome: &str, count: f64) {
    let reached = wait_for(Duration::from_secs(5), || async {
        writes(proxy, outcome).await >= count
    })
    .await;
    let now = writes(proxy, outcome).await;
    assert!(
        reached.is_some(),
        "writes {{outcome={outcome}}}: {now}, expected {count}"
    );
    assert_eq!(now, count, "writes {{outcome={outcome}}}");
}

/// Waits until the proxy has finished (and logged) `count` chat requests with a 2xx: by then
/// the cache has stored whatever it was going to store from them.
async fn wait_until_logged(proxy: &Proxy, count: f64) {
    let series = r#"sluice_requests_total{route="chat",status="2xx"}"#;
    let logged = wait_for(Duration::from_secs(5), || async {
        proxy.metric(series).await.unwrap_or(0.0) >= count
    })
    .await;
    assert!(logged.is_some(), "{count} requests not logged within 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_request_is_answered_from_the_cache() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({})).await;
    let request = chat(MODEL, "What is the capital of France?", false);

    let first = proxy.ask(&request, &[]).await;
    assert_eq!((first.status, first.x_cache.as_str()), (200, "MISS"));
    wait_for_writes(&proxy, "stored", 1.0).await;
    let hit = proxy.until_hit(&request, &[]).await;
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
    let proxy = cached_proxy(&upstream, json!({})).await;

    // Filled by a stream, served as JSON.
    let streamed = chat(MODEL, "filled by a stream", true);
    let first = proxy.ask(&streamed, &[]).await;
    assert_eq!(first.x_cache, "MISS");
    // Stored before the next request, so that it cannot miss and go upstream again.
    wait_for_writes(&proxy, "stored", 1.0).await;
    let as_json = proxy
        .until_hit(&chat(MODEL, "filled by a stream", false), &[])
        .await;
    assert_eq!(as_json.x_cache, "HIT");
    assert_eq!(as_json.headers["content-type"], "application/json");
    assert_eq!(content(&as_json), content(&first));

    // Filled by JSON, served as a stream with the usage chunk asked for.
    let plain = chat(MODEL, "filled by json", false);
    let first = proxy.ask(&plain, &[]).await;
    wait_for_writes(&proxy, "stored", 2.0).await;
    let mut streamed = chat(MODEL, "filled by json", true);
    streamed["stream_options"] = json!({"include_usage": true});
    let as_stream = proxy.until_hit(&streamed, &[]).await;
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

/// Audit M10: an entry filled from a stream whose client did not ask for usage keeps the
/// answer's usage (the cache asks the core for it, which asks the upstream and keeps the
/// usage chunk from that client), so later hits have it in either form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_filled_by_a_stream_without_usage_keeps_the_usage() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({})).await;
    let content_ = "filled by a stream that did not ask for usage";

    let first = proxy.ask(&chat(MODEL, content_, true), &[]).await;
    assert_eq!((first.status, first.x_cache.as_str()), (200, "MISS"));
    let data = sse_data(&first.body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    for d in &data[..data.len() - 1] {
        let e: Value = serde_json::from_str(d).unwrap();
        assert_ne!(
            e["choices"],
            json!([]),
            "a usage chunk nobody asked for: {e}"
        );
        assert!(e.get("usage").is_none_or(Value::is_null), "{e}");
    }
    // Stored before the JSON request, which must not fill the entry itself.
    wait_for_writes(&proxy, "stored", 1.0).await;

    // What the upstream says this answer used.
    let direct: Value = client()
        .post(format!("{}/v1/chat/completions", upstream.url()))
        .json(&chat(MODEL, content_, false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let usage = &direct["usage"];
    assert!(usage["completion_tokens"].as_u64().unwrap() > 0, "{direct}");
    let counts =
        |u: &Value| ["prompt_tokens", "completion_tokens", "total_tokens"].map(|k| u[k].as_u64());

    let as_json = proxy.ask(&chat(MODEL, content_, false), &[]).await;
    assert_eq!(as_json.x_cache, "HIT");
    let hit: Value = serde_json::from_str(&as_json.body).unwrap();
    assert!(!hit["usage"].is_null(), "{hit}");
    assert_eq!(counts(&hit["usage"]), counts(usage), "{hit}");

    let mut streamed = chat(MODEL, content_, true);
    streamed["stream_options"] = json!({"include_usage": true});
    let as_stream = proxy.ask(&streamed, &[]).await;
    assert_eq!(as_stream.x_cache, "HIT");
    let events = sse_data(&as_stream.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        last["choices"],
        json!([]),
        "a usage chunk: {}",
        as_stream.body
    );
    assert_eq!(counts(&last["usage"]), counts(usage));
    assert_eq!(upstream_calls(&upstream), 2, "one fill, one direct ask");
}

/// Without the tenants plugin, each API key is a partition of its own, whatever header a
/// client adds; requests without any key bypass the cache unless the operator shares them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_never_share_entries_and_a_tenant_header_claims_nothing() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({"tenant": {"anonymous": "bypass"}})).await;
    let request = chat(MODEL, "same prompt, two keys", false);
    let alice = [("authorization", "Bearer key-alice")];
    let bob = [("authorization", "Bearer key-bob")];

    proxy.ask(&request, &alice).await;
    assert_eq!(proxy.until_hit(&request, &alice).await.x_cache, "HIT");
    assert_eq!(proxy.ask(&request, &bob).await.x_cache, "MISS");
    // The same key in Azure's and Anthropic's headers is the same partition.
    assert_eq!(
        proxy
            .ask(&request, &[("api-key", "key-alice")])
            .await
            .x_cache,
        "HIT"
    );
    // A header naming a tenant is no identity: bob stays bob.
    let claims = [
        ("x-tenant-id", "alice"),
        ("authorization", "Bearer key-bob-2"),
    ];
    assert_eq!(proxy.ask(&request, &claims).await.x_cache, "MISS");
    // No key: neither read nor filled.
    for _ in 0..2 {
        assert_eq!(proxy.ask(&request, &[]).await.x_cache, "BYPASS");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_order_hits_and_any_parameter_change_misses() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({})).await;
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
        assert_eq!(proxy.ask(&changed, &[]).await.x_cache, "MISS", "{changed}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_control_and_sampled_requests() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({})).await;

    let no_store = chat(MODEL, "no-store", false);
    assert_eq!(
        proxy
            .ask(&no_store, &[("cache-control", "no-store")])
            .await
            .x_cache,
        "BYPASS"
    );
    // Once the request is logged, anything it would have stored is in the store.
    wait_until_logged(&proxy, 1.0).await;
    assert_eq!(
        writes(&proxy, "stored").await,
        0.0,
        "no-store stored nothing"
    );
    assert_eq!(
        proxy.ask(&no_store, &[]).await.x_cache,
        "MISS",
        "no-store stored nothing"
    );

    let no_cache = chat(MODEL, "no-cache", false);
    proxy.ask(&no_cache, &[]).await;
    assert_eq!(proxy.until_hit(&no_cache, &[]).await.x_cache, "HIT");
    let skipped = proxy.ask(&no_cache, &[("cache-control", "no-cache")]).await;
    assert_eq!(skipped.x_cache, "MISS", "no-cache skips the lookup");

    let mut sampled = chat(MODEL, "sampled", false);
    sampled.as_object_mut().unwrap().remove("temperature");
    assert_eq!(proxy.ask(&sampled, &[]).await.x_cache, "BYPASS");
    let mut seeded = sampled.clone();
    seeded["seed"] = json!(42);
    proxy.ask(&seeded, &[]).await;
    assert_eq!(
        proxy.until_hit(&seeded, &[]).await.x_cache,
        "HIT",
        "a seed makes it reproducible"
    );
}

/// Sends `request` once with `faults` on: the cache must count its answer as not stored,
/// for `outcome`; the request must then miss, and be stored once answered whole.
async fn not_stored(
    proxy: &Proxy,
    upstream: &vllm_sim::Sim,
    request: &Value,
    faults: Faults,
    outcome: &str,
) {
    let (refused_before, stored_before) =
        (writes(proxy, outcome).await, writes(proxy, "stored").await);
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
    wait_for_writes(proxy, outcome, refused_before + 1.0).await;
    assert_eq!(writes(proxy, "stored").await, stored_before, "{request}");

    let after = proxy.ask(request, &[]).await;
    assert_eq!(
        (after.status, after.x_cache.as_str()),
        (200, "MISS"),
        "{}",
        after.body
    );
    // The cache does store this request's whole answer.
    assert_eq!(proxy.until_hit(request, &[]).await.x_cache, "HIT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_broken_answers_are_never_stored() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({})).await;
    // A cut or failed stream is `incomplete`; an error status is `not_ok`.
    let cases = [
        (
            "dropped mid-stream",
            true,
            Faults {
                drop_after_chunks: Some(3),
                ..Faults::default()
            },
            "incomplete",
        ),
        (
            "error event",
            true,
            Faults {
                error_after_chunks: Some(2),
                ..Faults::default()
            },
            "incomplete",
        ),
        (
            "500",
            false,
            Faults {
                error_rate: 1.0,
                error_status: 500,
                ..Faults::default()
            },
            "not_ok",
        ),
        (
            "429",
            true,
            Faults {
                error_rate: 1.0,
                error_status: 429,
                ..Faults::default()
            },
            "not_ok",
        ),
    ];
    for (name, stream, faults, outcome) in cases {
        let request = chat(MODEL, &format!("broken: {name}"), stream);
        not_stored(&proxy, &upstream, &request, faults, outcome).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_stores_nothing() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(20), 50).await;
    let proxy = cached_proxy(&upstream, json!({})).await;
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
    wait_for_writes(&proxy, "incomplete", 1.0).await;
    assert_eq!(writes(&proxy, "stored").await, 0.0);
    assert_eq!(proxy.ask(&request, &[]).await.x_cache, "MISS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_over_the_size_limit_are_not_stored() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({"max_entry_bytes": 200})).await;
    let request = chat(MODEL, "too big to keep", false);
    assert_eq!(proxy.ask(&request, &[]).await.x_cache, "MISS");
    wait_for_writes(&proxy, "too_big", 1.0).await;
    assert_eq!(proxy.ask(&request, &[]).await.x_cache, "MISS");
    wait_for_writes(&proxy, "too_big", 2.0).await;
    assert_eq!(writes(&proxy, "stored").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_prompt_misses_then_hits() {
    let upstream = sim().await;
    let proxy = cached_proxy(&upstream, json!({})).await;
    let request = chat(MODEL, &"context ".repeat(140_000), false);
    assert_eq!(proxy.ask(&request, &[]).await.x_cache, "MISS");
    wait_for_writes(&proxy, "stored", 1.0).await;
    assert_eq!(proxy.until_hit(&request, &[]).await.x_cache, "HIT");
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
    let proxy = cached_proxy(&upstream, json!({})).await;
    let request = chat(MODEL, "everyone asks this at once", true);
    let answers = futures_util::future::join_all((0..8).map(|_| proxy.ask(&request, &[]))).await;
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
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(r#"llm_cache_requests_total{result="coalesced"} 7"#),
        "{metrics}"
    );
    assert!(metrics.contains("llm_cache_hit_ratio 0.875"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_leader_hands_the_lead_to_one_follower() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(100), 20).await;
    let proxy = cached_proxy(&upstream, json!({})).await;
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
    // The simulator takes a request's faults as it arrives, before it runs: the leader's
    // are set, and the requests after it meet none.
    upstream.set_faults(Faults::default());
    // ...while two identical requests wait for it, as JSON: one leads next, the other gets
    // its answer. (Stream followers would be fed the leader's stream live, and end with its
    // error: tests/coalescing.rs.)
    let as_json = chat(MODEL, "the leader fails", false);
    let answers = futures_util::future::join_all((0..2).map(|_| proxy.ask(&as_json, &[]))).await;
    let _ = leader.await;
    let mut labels: Vec<&str> = answers.iter().map(|a| a.x_cache.as_str()).collect();
    labels.sort_unstable();
    assert_eq!(labels, ["HIT", "MISS"]);
    for a in &answers {
        assert_eq!(a.status, 200);
        assert!(!content(a).is_empty(), "{}", a.body);
    }
    assert_eq!(upstream_calls(&upstream), 2);
}
