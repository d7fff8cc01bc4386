//! Disaggregated prefill through Sluice (`pools[].prefill`), between simulators that speak
//! vLLM's `NixlConnector` wire: a long prompt's prefill leg on the prefill pool, its decode
//! leg with the transfer, every transfer checked by the decode leg's usage, and each way it
//! can fail leaving the client a whole answer.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::{Faults, KvConnector, KvTransferConfig, Latency, LoadFailurePolicy, SimConfig};

const MODEL: &str = "llama";

/// A V1 engine serving both legs (chunked prefill, prefix caching, usage details).
async fn engine(policy: LoadFailurePolicy, per_token: Duration) -> vllm_sim::Sim {
    engine_leasing(policy, per_token, KvTransferConfig::default().lease).await
}

/// A decode and a prefill [`engine`], both failing a read they cannot make.
async fn engines() -> (vllm_sim::Sim, vllm_sim::Sim) {
    let decode = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    (decode, prefill)
}

/// [`engine`], keeping unread blocks for `lease`.
async fn engine_leasing(
    policy: LoadFailurePolicy,
    per_token: Duration,
    lease: Duration,
) -> vllm_sim::Sim {
    engine_with(
        KvTransferConfig {
            load_failure_policy: policy,
            lease,
            ..KvTransferConfig::default()
        },
        per_token,
    )
    .await
}

/// [`engine`], speaking vLLM's `MooncakeConnector` (its bootstrap server on a free port).
async fn mooncake_engine() -> vllm_sim::Sim {
    engine_with(
        KvTransferConfig {
            connector: KvConnector::Mooncake,
            ..KvTransferConfig::default()
        },
        Duration::from_micros(50),
    )
    .await
}

/// An engine with its transfers as `transfer` says (1 µs a token moved).
async fn engine_with(transfer: KvTransferConfig, per_token: Duration) -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .v1_engine(8192)
            .with_latency(Latency::new(
                Duration::ZERO,
                per_token,
                Duration::from_millis(1),
            ))
            .with_answer_tokens(4, 4)
            .with_record_requests(4096)
            .with_kv_transfer(KvTransferConfig {
                transfer_per_token: Duration::from_micros(1),
                ..transfer
            }),
    )
    .await
    .expect("sim")
}

/// A proxy whose pool `decode` (first: the client's requests go there) decodes for the pool
/// `prefill`, prompts of 500 tokens or more going through both.
async fn proxy(decode: &vllm_sim::Sim, prefill: &vllm_sim::Sim, route: Value) -> Proxy {
    let mut settings = json!({"pool": "prefill", "min_prefill_tokens": 500});
    if let (Value::Object(s), Value::Object(more)) = (&mut settings, route) {
        s.extend(more);
    }
    Proxy::start(json!({
        "pools": [
            pool("decode", &[MODEL], &[decode.addr()])
                .with_fast_health_checks()
                .with("prefill", settings),
            pool("prefill", &[MODEL], &[prefill.addr()]).with_fast_health_checks(),
        ],
    }))
    .await
}

/// A route whose transfers all do nothing: the prefill engine answers transfer parameters
/// for blocks it did not keep, and the decode engine recomputes, silently (a 200 all the
/// same). The decode engine, the prefill engine and the proxy.
async fn lossy_route(route: Value) -> (vllm_sim::Sim, vllm_sim::Sim, Proxy) {
    let decode = engine(LoadFailurePolicy::Recompute, Duration::from_micros(50)).await;
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    prefill.set_faults(Faults {
        kv_transfer_lost: 1.0,
        ..Faults::default()
    });
    let proxy = proxy(&decode, &prefill, route).await;
    (decode, prefill, proxy)
}

/// A prompt of about `tokens` tokens (the simulator counts four bytes a token), its own.
fn chat(tag: &str, tokens: usize, stream: bool) -> Value {
    let text = format!("{tag}: {}", "word ".repeat(tokens * 4 / 5));
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}],
           "max_tokens": 4, "stream": stream})
}

fn lent(sim: &vllm_sim::Sim) -> u64 {
    sim.kv_transfer().expect("kv_transfer").lent
}

async fn path_count(proxy: &Proxy, path: &str) -> f64 {
    proxy
        .metric(&format!(
            r#"sluice_pd_requests_total{{path="{path}",pool="decode"}}"#
        ))
        .await
        .unwrap_or(0.0)
}

/// The answer's prompt tokens, and those its engine computed into new cache blocks
/// (vLLM 0.32's `created_cache_tokens`).
fn usage_of(a: &Answer) -> (u64, u64) {
    let body: Value = serde_json::from_str(&a.body).expect("JSON answer");
    let usage = &body["usage"];
    (
        usage["prompt_tokens"].as_u64().unwrap_or(0),
        usage["prompt_tokens_details"]["created_cache_tokens"]
            .as_u64()
            .expect("created_cache_tokens"),
    )
}

#[tokio::test]
async fn a_long_prompt_is_prefilled_on_the_prefill_pool_and_decoded_with_its_transfer() {
    let (decode, prefill) = engines().await;
    let proxy = proxy(&decode, &prefill, json!({})).await;
    let a = proxy.ask(&chat("long", 2_000, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let (prompt, computed) = usage_of(&a);
    assert!(prompt > 1_000, "{}", a.body);
    assert_eq!(computed, 0, "the decode engine read the prompt: {}", a.body);
    assert_eq!(lent(&prefill), 1, "one prefill leg");
    assert_eq!(
        prefill.kv_transfer().unwrap().read,
        1,
        "read by the decode engine"
    );
    assert_eq!(path_count(&proxy, "disaggregated").await, 1.0);
    let transferred = proxy
        .metric_once(
            r#"sluice_pd_transfers_total{outcome="transferred",pool="decode"}"#,
            1.0,
        )
        .await;
    assert_eq!(transferred, Some(1.0), "{}", proxy.metrics().await);

    // A stream: its usage is asked for the check, and kept from a client that did not ask.
    let a = proxy.ask(&chat("streamed", 2_000, true), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    assert!(!a.body.contains("\"usage\":{"), "{}", a.body);
    assert_eq!(lent(&prefill), 2);
    let transferred = proxy
        .metric_once(
            r#"sluice_pd_transfers_total{outcome="transferred",pool="decode"}"#,
            2.0,
        )
        .await;
    assert_eq!(transferred, Some(2.0), "{}", proxy.metrics().await);
    let status = proxy.status().await;
    let route = &status["pools"][0]["prefill"];
    assert_eq!(route["state"], "disaggregated", "{status}");
    assert_eq!(route["connector"], "nixl");
}

#[tokio::test]
async fn a_prompt_the_decode_backend_would_compute_little_of_is_decoded_whole() {
    let (decode, prefill) = engines().await;
    let proxy = proxy(&decode, &prefill, json!({})).await;
    let a = proxy.ask(&chat("short", 100, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(lent(&prefill), 0, "no prefill leg");
    assert_eq!(path_count(&proxy, "short").await, 1.0);
}

#[tokio::test]
async fn transfers_that_do_nothing_are_found_and_the_route_falls_back() {
    let (_decode, prefill, proxy) =
        lossy_route(json!({"fail_after": 3, "recover_after": "1h"})).await;
    for i in 0..6 {
        let a = proxy
            .ask(&chat(&format!("lost {i}"), 2_000, false), &[])
            .await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
        let (prompt, computed) = usage_of(&a);
        assert!(computed > prompt / 2, "recomputed: {}", a.body);
        // Each verdict is in before the next request is placed.
        let judged = proxy
            .metric_once(
                r#"sluice_pd_transfers_total{outcome="recomputed",pool="decode"}"#,
                f64::from((i + 1).min(3)),
            )
            .await;
        assert_eq!(judged, Some(f64::from((i + 1).min(3))), "request {i}");
    }
    assert_eq!(lent(&prefill), 3, "no prefill leg once fallen back");
    assert_eq!(path_count(&proxy, "fallen_back").await, 3.0);
    let status = proxy.status().await;
    let route = &status["pools"][0]["prefill"];
    assert_eq!(route["state"], "fallen_back", "{status}");
    assert_eq!(route["recent_recomputed"], 3);
    assert_eq!(
        proxy
            .metric(r#"sluice_pd_route_disaggregated{pool="decode"}"#)
            .await,
        Some(0.0)
    );
    // A reload of the same route keeps what it found.
    proxy.reload().await;
    let status = proxy.status().await;
    assert_eq!(
        status["pools"][0]["prefill"]["state"], "fallen_back",
        "{status}"
    );
    let a = proxy.ask(&chat("after reload", 2_000, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(lent(&prefill), 3, "still no prefill leg");
}

#[tokio::test]
async fn a_failed_prefill_leg_leaves_the_decode_backend_doing_the_whole_request() {
    let (decode, prefill) = engines().await;
    prefill.set_faults(Faults {
        error_rate: 1.0,
        error_status: 500,
        ..Faults::default()
    });
    let proxy = proxy(&decode, &prefill, json!({})).await;
    let a = proxy.ask(&chat("refused", 2_000, true), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    assert!(!a.body.contains("\"error\""), "{}", a.body);
    assert_eq!(path_count(&proxy, "prefill_failed").await, 1.0);
    assert_eq!(lent(&prefill), 0);
}

#[tokio::test]
async fn a_client_that_leaves_during_the_prefill_leg_stops_it() {
    // A prefill of 2,000 tokens at 2 ms a token: 4 s, which the client does not wait for.
    let decode = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_millis(2)).await;
    let proxy = proxy(&decode, &prefill, json!({})).await;
    let url = proxy.url("/v1/chat/completions");
    let body = chat("leaving", 2_000, false);
    let client = tokio::spawn(async move { ask_url(&url, &body, &[]).await });
    let started = wait_for(Duration::from_secs(10), || async {
        prefill.stats().running == 1
    })
    .await;
    assert!(
        started.is_some(),
        "the prefill leg never came: {:?}",
        prefill.stats()
    );
    // The client leaves: its connection closes.
    client.abort();
    let _ = client.await;
    // The prefill engine sees its own client (the leg) leave, and drops the request long
    // before its prefill would have ended.
    let dropped = wait_for(Duration::from_secs(10), || async {
        prefill.stats().running == 0
    })
    .await;
    assert!(dropped.is_some(), "{:?}", prefill.stats());
    assert_eq!(prefill.stats().completed, 0, "aborted, not finished");
    assert_eq!(lent(&prefill), 0);
    assert_eq!(
        decode.stats().count("/v1/chat/completions"),
        0,
        "the decode leg was never sent"
    );
}

#[tokio::test]
async fn a_retried_decode_leg_has_no_second_prefill_leg() {
    // Every decode attempt answers 503: the pool retries twice.
    let (decode, prefill) = engines().await;
    decode.set_faults(Faults {
        error_rate: 1.0,
        error_status: 503,
        ..Faults::default()
    });
    let proxy = Proxy::start(json!({
        "pools": [
            pool("decode", &[MODEL], &[decode.addr()])
                .with_fast_health_checks()
                .with("retry", json!({"max_retries": 2, "backoff_base": "1ms", "backoff_max": "1ms"}))
                .with("prefill", json!({"pool": "prefill", "min_prefill_tokens": 500})),
            pool("prefill", &[MODEL], &[prefill.addr()]).with_fast_health_checks(),
        ],
    }))
    .await;
    let a = proxy.ask(&chat("retried", 2_000, false), &[]).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(
        decode.stats().count("/v1/chat/completions"),
        3,
        "the decode leg and two retries"
    );
    assert_eq!(lent(&prefill), 1, "one prefill leg for the request");
}

/// A proxy whose decode pool has a backend that refuses every request with 503 (`refusing`)
/// and one that serves (`serving`), one retry allowed after `backoff` or more.
async fn proxy_with_a_refusing_decode(
    refusing: &vllm_sim::Sim,
    serving: &vllm_sim::Sim,
    prefill: &vllm_sim::Sim,
    backoff: &str,
    route: Value,
) -> Proxy {
    refusing.set_faults(Faults {
        error_rate: 1.0,
        error_status: 503,
        ..Faults::default()
    });
    let mut settings = json!({"pool": "prefill", "min_prefill_tokens": 500});
    if let (Value::Object(s), Value::Object(more)) = (&mut settings, route) {
        s.extend(more);
    }
    Proxy::start(json!({
        "pools": [
            pool("decode", &[MODEL], &[refusing.addr(), serving.addr()])
                .with_fast_health_checks()
                .with("balancing", json!({"strategy": "round_robin"}))
                .with("retry", json!({"max_retries": 1, "backoff_base": backoff, "backoff_max": backoff}))
                .with("prefill", settings),
            pool("prefill", &[MODEL], &[prefill.addr()]).with_fast_health_checks(),
        ],
    }))
    .await
}

/// Asks long prompts until one is first sent to `refusing` (round robin: the first or the
/// second), and returns that request's answer.
async fn ask_until_refused(proxy: &Proxy, refusing: &vllm_sim::Sim) -> Answer {
    for i in 0..4 {
        let a = proxy
            .ask(&chat(&format!("refused {i}"), 2_000, false), &[])
            .await;
        if refusing.stats().count("/v1/chat/completions") > 0 {
            return a;
        }
        assert_eq!(a.status, 200, "{}", a.body);
    }
    panic!("the refusing backend was never chosen");
}

#[tokio::test]
async fn a_refused_decode_leg_hands_its_transfer_to_the_retry() {
    let refusing = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    let serving = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    let prefill = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    let proxy = proxy_with_a_refusing_decode(&refusing, &serving, &prefill, "1ms", json!({})).await;
    let a = ask_until_refused(&proxy, &refusing).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let (prompt, computed) = usage_of(&a);
    assert!(prompt > 1_000, "{}", a.body);
    assert_eq!(
        computed, 0,
        "the retry read the blocks the refused leg was to read: {}",
        a.body
    );
    let transfers = prefill.kv_transfer().unwrap();
    assert_eq!(
        (transfers.leases, transfers.read),
        (0, transfers.lent),
        "every prefill leg's blocks read, none stranded: {transfers:?}"
    );
    assert_eq!(transfers.refused, 0, "{transfers:?}");
}

#[tokio::test]
async fn a_refused_decode_leg_s_retry_past_the_lease_is_served_whole() {
    // The engines keep unread blocks for 1 s (room enough for a loaded machine's first
    // decode leg); the retry waits 1.5 s at least, past the half that Sluice allows.
    let lease = Duration::from_secs(1);
    let refusing = engine_leasing(LoadFailurePolicy::Fail, Duration::from_micros(50), lease).await;
    let serving = engine_leasing(LoadFailurePolicy::Fail, Duration::from_micros(50), lease).await;
    let prefill = engine_leasing(LoadFailurePolicy::Fail, Duration::from_micros(50), lease).await;
    let proxy = proxy_with_a_refusing_decode(
        &refusing,
        &serving,
        &prefill,
        "3s",
        json!({"kv_lease_duration": "1s"}),
    )
    .await;
    let a = ask_until_refused(&proxy, &refusing).await;
    // Sent with the expired transfer, the retry would fail (vLLM's `fail` policy: a 500).
    assert_eq!(a.status, 200, "{}", a.body);
    let (prompt, computed) = usage_of(&a);
    assert!(
        computed > prompt / 2,
        "the retry computed the prompt itself: {}",
        a.body
    );
    assert_eq!(
        prefill.kv_transfer().unwrap().refused,
        0,
        "no read of expired blocks was tried: {:?}",
        prefill.kv_transfer()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_are_attempts_in_the_request_s_trace() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let receiver = OtlpReceiver::http().await;
    let (decode, prefill) = engines().await;
    let proxy = Proxy::start(json!({
        "pools": [
            pool("decode", &[MODEL], &[decode.addr()])
                .with_fast_health_checks()
                .with("prefill", json!({"pool": "prefill", "min_prefill_tokens": 500})),
            pool("prefill", &[MODEL], &[prefill.addr()]).with_fast_health_checks(),
        ],
        "telemetry": {"otlp": receiver.config(), "sampling": 1.0},
        "plugins": {"request_id": {"enabled": true}},
    }))
    .await;
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let a = proxy
        .ask(
            &chat("traced", 2_000, false),
            &[("traceparent", traceparent.as_str())],
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let spans = receiver
        .spans_when(Duration::from_secs(10), |spans| {
            spans
                .iter()
                .filter(|s| s.trace_id() == TRACE && s.span.kind == 3)
                .count()
                == 2
        })
        .await;
    let of: Vec<_> = spans.iter().filter(|s| s.trace_id() == TRACE).collect();
    let server = of
        .iter()
        .find(|s| s.span.kind == 2)
        .unwrap_or_else(|| panic!("no server span: {of:#?}"));
    let leg = |name: &str| {
        of.iter()
            .find(|s| s.attribute("sluice.pd.leg").as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no {name} leg: {of:#?}"))
    };
    let (prefill_leg, decode_leg) = (leg("prefill"), leg("decode"));
    for (span, pool, outcome, sim) in [
        (prefill_leg, "prefill", "prefilled", &prefill),
        (decode_leg, "decode", "response", &decode),
    ] {
        assert_eq!(span.parent_id(), server.span_id(), "{span:#?}");
        assert_eq!(span.attribute("sluice.pool").as_deref(), Some(pool));
        assert_eq!(span.attribute("sluice.outcome").as_deref(), Some(outcome));
        assert_eq!(
            span.attribute("http.response.status_code").as_deref(),
            Some("200")
        );
        assert_eq!(span.attribute("sluice.attempt").as_deref(), Some("1"));
        // Each engine's own spans hang under its leg.
        let sent = last_chat(sim);
        assert_eq!(
            sent.header("traceparent"),
            Some(format!("00-{TRACE}-{}-01", span.span_id()).as_str()),
            "{pool}"
        );
        // The plugins' headers go with both legs: the client's request id to both engines.
        assert_eq!(
            sent.header("x-request-id"),
            a.headers.get("x-request-id").and_then(|v| v.to_str().ok()),
            "{pool}"
        );
    }
    assert_eq!(
        prefill_leg
            .attribute("gen_ai.request.max_tokens")
            .as_deref(),
        Some("1")
    );
}

/// The port of a Mooncake engine's bootstrap server.
fn bootstrap_port(sim: &vllm_sim::Sim) -> u16 {
    let addr = sim
        .kv_transfer()
        .unwrap()
        .bootstrap
        .expect("a bootstrap server");
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// The last chat request `sim` got.
fn last_chat(sim: &vllm_sim::Sim) -> vllm_sim::RecordedRequest {
    sim.stats()
        .recent
        .iter()
        .rev()
        .find(|r| r.path == "/v1/chat/completions")
        .cloned()
        .expect("a chat request")
}

#[tokio::test]
async fn mooncake_legs_share_a_minted_transfer_id_and_name_the_prefill_engine() {
    let decode = mooncake_engine().await;
    let prefill = mooncake_engine().await;
    let port = bootstrap_port(&prefill);
    let proxy = proxy(
        &decode,
        &prefill,
        json!({"connector": "mooncake", "bootstrap_port": port}),
    )
    .await;
    let a = proxy.ask(&chat("mooncake", 2_000, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let (prompt, computed) = usage_of(&a);
    assert!(prompt > 1_000, "{}", a.body);
    assert_eq!(
        computed, 0,
        "the decode engine pulled the prompt: {}",
        a.body
    );
    assert_eq!(prefill.kv_transfer().unwrap().read, 1);
    let leg: Value = serde_json::from_slice(&last_chat(&prefill).body).unwrap();
    let sent: Value = serde_json::from_slice(&last_chat(&decode).body).unwrap();
    let transfer_id = leg["kv_transfer_params"]["transfer_id"].as_str().unwrap();
    assert!(transfer_id.starts_with("xfer-"), "{leg}");
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(
        last_chat(&prefill).header("x-data-parallel-rank"),
        Some("0")
    );
    let params = &sent["kv_transfer_params"];
    assert_eq!(params["transfer_id"], transfer_id, "{sent}");
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(
        params["remote_engine_id"],
        prefill.kv_transfer().unwrap().engine_id.as_str()
    );
    assert_eq!(
        params["remote_bootstrap_addr"],
        format!("http://127.0.0.1:{port}")
    );
    // Each request its own transfer id.
    let a = proxy.ask(&chat("mooncake again", 2_000, true), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let again: Value = serde_json::from_slice(&last_chat(&prefill).body).unwrap();
    assert_ne!(again["kv_transfer_params"]["transfer_id"], transfer_id);
    assert_eq!(prefill.kv_transfer().unwrap().read, 2);
    let transferred = proxy
        .metric_once(
            r#"sluice_pd_transfers_total{outcome="transferred",pool="decode"}"#,
            2.0,
        )
        .await;
    assert_eq!(transferred, Some(2.0), "{}", proxy.metrics().await);
    assert_eq!(
        proxy.status().await["pools"][0]["prefill"]["connector"],
        "mooncake"
    );
}

#[tokio::test]
async fn a_mooncake_prefill_engine_whose_bootstrap_server_is_silent_is_not_used() {
    let decode = mooncake_engine().await;
    let prefill = mooncake_engine().await;
    // Nothing listens there.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    drop(silent);
    let proxy = proxy(
        &decode,
        &prefill,
        json!({"connector": "mooncake", "bootstrap_port": port}),
    )
    .await;
    let a = proxy.ask(&chat("no bootstrap", 2_000, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let (prompt, computed) = usage_of(&a);
    assert!(computed > prompt / 2, "computed whole: {}", a.body);
    assert_eq!(prefill.kv_transfer().unwrap().lent, 0, "no prefill leg");
    assert_eq!(path_count(&proxy, "prefill_failed").await, 1.0);
}

/// A LoRA-serving engine of both legs whose adapters are `adapters`.
async fn lora_engine(adapters: &[&str]) -> vllm_sim::Sim {
    let mut lora = vllm_sim::LoraConfig::new(2);
    for name in adapters {
        lora = lora.with_module(*name, format!("/adapters/{name}"));
    }
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .v1_engine(8192)
            .with_latency(Latency::new(
                Duration::ZERO,
                Duration::from_micros(50),
                Duration::from_millis(1),
            ))
            .with_answer_tokens(4, 4)
            .with_lora(lora)
            .with_kv_transfer(KvTransferConfig::default()),
    )
    .await
    .expect("sim")
}

#[tokio::test]
async fn an_adapter_s_prefill_leg_goes_to_a_prefill_backend_that_serves_it() {
    let decode = lora_engine(&["poet"]).await;
    let without = lora_engine(&["sql"]).await;
    let with = lora_engine(&["poet"]).await;
    let proxy = Proxy::start(json!({
        "pools": [
            pool("decode", &[], &[decode.addr()])
                .with("models", "auto")
                .with_fast_health_checks()
                .with("prefill", json!({"pool": "prefill", "min_prefill_tokens": 500})),
            pool("prefill", &[], &[without.addr(), with.addr()])
                .with("models", "auto")
                .with_fast_health_checks()
                .with("balancing", json!({"strategy": "round_robin"})),
        ],
    }))
    .await;
    for addr in [without.addr(), with.addr()] {
        wait_for(Duration::from_secs(10), || async {
            proxy.backend_status("prefill", addr).await["lora"]["adapters"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
        })
        .await
        .expect("the prefill pool learns its backends' adapters");
    }
    wait_for(Duration::from_secs(10), || async {
        proxy.backend_status("decode", decode.addr()).await["lora"]["adapters"] == json!(["poet"])
    })
    .await
    .expect("the decode pool learns its backend's adapter");
    wait_for(Duration::from_secs(10), || async {
        let models = reqwest::get(proxy.url("/v1/models")).await.unwrap();
        models.text().await.unwrap().contains("\"poet\"")
    })
    .await
    .expect("the proxy serves the adapter");
    // Round robin would send every other leg where `poet` is not.
    for i in 0..4 {
        let mut body = chat(&format!("poem {i}"), 2_000, false);
        body["model"] = json!("poet");
        let a = proxy.ask(&body, &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let (_, computed) = usage_of(&a);
        assert_eq!(
            computed, 0,
            "request {i} was prefilled elsewhere: {}",
            a.body
        );
    }
    assert_eq!(with.kv_transfer().unwrap().read, 4);
    assert_eq!(without.stats().count("/v1/chat/completions"), 0);
    assert_eq!(path_count(&proxy, "prefill_failed").await, 0.0);
}

#[tokio::test]
async fn a_fall_back_whose_time_is_over_reads_disaggregated_before_the_next_request() {
    let (_decode, _prefill, proxy) =
        lossy_route(json!({"fail_after": 1, "recover_after": "2s"})).await;
    let gauge = r#"sluice_pd_route_disaggregated{pool="decode"}"#;
    let a = proxy.ask(&chat("lost", 2_000, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let judged = proxy
        .metric_once(
            r#"sluice_pd_transfers_total{outcome="recomputed",pool="decode"}"#,
            1.0,
        )
        .await;
    assert_eq!(judged, Some(1.0), "the route fell back");
    // No request comes (the fall-back set the gauge to 0, as a request saw it); the gauge
    // reads the route's state when scraped.
    let back = wait_for(Duration::from_secs(10), || async {
        proxy.metric(gauge).await == Some(1.0)
    })
    .await;
    assert!(back.is_some(), "{}", proxy.metrics().await);
    assert_eq!(
        proxy.status().await["pools"][0]["prefill"]["state"],
        "disaggregated"
    );
}

#[tokio::test]
async fn a_prefill_answer_without_transfer_parameters_leaves_the_decode_backend_the_request() {
    // An engine started without `--kv-transfer-config` answers the leg's one token and no
    // parameters: nothing to hand over.
    let decode = engine(LoadFailurePolicy::Fail, Duration::from_micros(50)).await;
    let plain = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .v1_engine(8192),
    )
    .await
    .unwrap();
    let proxy = proxy(
        &decode,
        &plain,
        json!({"fail_after": 2, "recover_after": "1h"}),
    )
    .await;
    for i in 0..2 {
        let a = proxy
            .ask(&chat(&format!("plain {i}"), 2_000, true), &[])
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    }
    assert_eq!(
        plain.stats().count("/v1/chat/completions"),
        2,
        "two legs sent"
    );
    assert_eq!(path_count(&proxy, "prefill_failed").await, 2.0);
    // Two legs that brought nothing: the route falls back.
    let status = proxy.status().await;
    assert_eq!(
        status["pools"][0]["prefill"]["state"], "fallen_back",
        "{status}"
    );
    let a = proxy.ask(&chat("plain 2", 2_000, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        plain.stats().count("/v1/chat/completions"),
        2,
        "no third leg"
    );
}
