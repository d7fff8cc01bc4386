//! The agents' APIs as first-class LLM routes, through the official Python SDKs and on the
//! wire: Anthropic's Messages (`anthropic`), OpenAI's Responses (`openai`) with its
//! `previous_response_id` conversations across backends that each keep their own responses,
//! and the routes that generate nothing (`/tokenize`, `/v1/messages/count_tokens`), routed by
//! model with the tenant's limits. Needs `python3` with `openai` and `anthropic`
//! (`scripts/bootstrap --test` installs them).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use vllm_sim::SimConfig;

const MODEL: &str = "agent-model";
const KEY: &str = "sk-agent";
const LIMITED_KEY: &str = "sk-limited";

/// A simulated engine that keeps its responses (vLLM with its responses store on).
async fn keeping_sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_responses_store(true),
    )
    .await
    .unwrap()
}

/// The tenants section: `sk-agent`'s tenant unlimited, `sk-limited`'s at 2 requests a minute.
fn tenants() -> Value {
    json!({"tenants": {
        "enabled": true,
        "tenants": {
            "agent": {"keys": [key_digest(KEY)]},
            "limited": {"keys": [key_digest(LIMITED_KEY)],
                        "limits": {"requests_per_minute": 2}},
        },
    }})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_client_works_through_sluice() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_record_requests(256),
    )
    .await
    .unwrap();
    let mut plugins = tenants();
    plugins["cache"] = json!({"enabled": true});
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()])],
        "plugins": plugins,
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    run_python("anthropic_client.py", &[&base, MODEL, KEY, LIMITED_KEY]).await;

    // The SDK's version headers reached the engine; the tenant's key did not.
    let stats = sim.stats();
    let sent: Vec<_> = stats
        .recent
        .iter()
        .filter(|r| r.path == "/v1/messages")
        .collect();
    assert!(!sent.is_empty());
    for request in sent {
        assert!(request.header("anthropic-version").is_some());
        assert_eq!(request.header("anthropic-beta"), Some("sluice-test-2026"));
        assert_eq!(
            request.header("x-api-key"),
            None,
            "the tenant's key upstream"
        );
    }
    // Counting tokens went to the engine, and charged no output.
    assert_eq!(stats.count("/v1/messages/count_tokens"), 1);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(r#"route="messages""#),
        "the Messages route is its own in the metrics"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_conversations_stay_with_the_backend_that_keeps_them() {
    let (a, b) = (keeping_sim().await, keeping_sim().await);
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[a.addr(), b.addr()])
            .with("balancing", json!({"strategy": "round_robin"}))],
        "plugins": {"cache": {"enabled": true}},
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    run_python("openai_responses.py", &[&base, MODEL, "8"]).await;
    // The conversations were spread over both backends, and each kept its own.
    for sim in [&a, &b] {
        assert!(
            sim.stats().count("/v1/responses") >= 10,
            "{:?}",
            sim.stats().requests_by_path
        );
    }
}

/// Without Sluice's notes, the same conversations across the same pool fail: the check that
/// the test above would see the failure it guards against.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_on_the_other_backend_is_the_engines_404() {
    let (a, b) = (keeping_sim().await, keeping_sim().await);
    let made = client()
        .post(format!("{}/v1/responses", a.url()))
        .json(&json!({"model": MODEL, "input": "hello", "max_output_tokens": 4}))
        .send()
        .await
        .unwrap();
    let made: Value = made.json().await.unwrap();
    let follow_up =
        json!({"model": MODEL, "input": "and then?", "previous_response_id": made["id"]});
    let elsewhere = client()
        .post(format!("{}/v1/responses", b.url()))
        .json(&follow_up)
        .send()
        .await
        .unwrap();
    assert_eq!(elsewhere.status(), 404);

    // Through Sluice, made by `a` on its first turn: every follow-up goes to `a`.
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[a.addr(), b.addr()])
            .with("balancing", json!({"strategy": "round_robin"}))],
    }))
    .await;
    let url = proxy.url("/v1/responses");
    let mut previous = Value::Null;
    for turn in 0..6 {
        let asked = ask_url(
            &url,
            &json!({"model": MODEL, "input": format!("turn {turn}"), "max_output_tokens": 4,
                    "previous_response_id": previous}),
            &[],
        )
        .await;
        assert_eq!(asked.status, 200, "turn {turn}: {}", asked.body);
        let answer: Value = serde_json::from_str(&asked.body).unwrap();
        previous = answer["id"].clone();
    }
    // The first turn went to one backend; the five follow-ups with it.
    let (on_a, on_b) = (
        a.stats().count("/v1/responses") - 1,
        b.stats().count("/v1/responses") - 1,
    );
    assert!(
        (on_a, on_b) == (6, 0) || (on_a, on_b) == (0, 6),
        "a {on_a}, b {on_b}"
    );
    // A kept response is read where it is kept; one no backend keeps is OpenAI's 404, at
    // once, from Sluice.
    let read = client()
        .get(proxy.url(&format!("/v1/responses/{}", previous.as_str().unwrap())))
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    let unknown = client()
        .get(proxy.url("/v1/responses/resp_never_made"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let body: Value = unknown.json().await.unwrap();
    assert_eq!(body["error"]["param"], "response_id");
    assert_eq!(body["error"]["reason"], "unknown-response");
}

/// A stored response is its tenant's: another tenant's follow-up, read or cancel is the 404
/// of an id never made, while its own tenant's go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_is_found_only_by_the_tenant_that_made_it() {
    let sim = keeping_sim().await;
    let other_key = "sk-other-team";
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()])],
        "plugins": {"tenants": {"enabled": true, "tenants": {
            "agent": {"keys": [key_digest(KEY)]},
            "other": {"keys": [key_digest(other_key)]}}}},
    }))
    .await;
    let bearer = |key: &str| format!("Bearer {key}");
    let (mine, theirs) = (bearer(KEY), bearer(other_key));
    let url = proxy.url("/v1/responses");
    let made = ask_url(
        &url,
        &json!({"model": MODEL, "input": "mine", "max_output_tokens": 4}),
        &[("authorization", &mine)],
    )
    .await;
    assert_eq!(made.status, 200, "{}", made.body);
    let id = serde_json::from_str::<Value>(&made.body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let follow_up = json!({"model": MODEL, "input": "and?", "previous_response_id": id});
    let read = |key: String| {
        let url = proxy.url(&format!("/v1/responses/{id}"));
        async move {
            client()
                .get(url)
                .header("authorization", key)
                .send()
                .await
                .unwrap()
        }
    };
    // Another tenant: the 404 of an unknown id, for a follow-up, a read and a cancel.
    let stolen = ask_url(&url, &follow_up, &[("authorization", &theirs)]).await;
    assert_eq!(stolen.status, 404, "{}", stolen.body);
    assert!(stolen.body.contains("unknown-response"), "{}", stolen.body);
    assert_eq!(read(theirs.clone()).await.status(), 404);
    let cancel = client()
        .post(proxy.url(&format!("/v1/responses/{id}/cancel")))
        .header("authorization", &theirs)
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 404);
    // Its own tenant: all there.
    assert_eq!(read(mine.clone()).await.status(), 200);
    let continued = ask_url(&url, &follow_up, &[("authorization", &mine)]).await;
    assert_eq!(continued.status, 200, "{}", continued.body);
}

/// Every family passes unknown fields and vLLM's extensions through as sent; the engine's
/// controls (`priority`, `kv_transfer_params`) only where the pool's policy allows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_fields_and_vllms_extensions_pass_through_every_family() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_record_requests(64),
    )
    .await
    .unwrap();
    let pools = |engine_controls: &str| {
        json!([pool("main", &[MODEL], &[sim.addr()])
            .with("client_fields", json!({"engine_controls": engine_controls}))])
    };
    let extras = r#""chat_template_kwargs":{"enable_thinking":false},"structured_outputs":{"regex":"[a-z]+"},"vendor_field":{"x":[1,2]},"priority":5,"kv_transfer_params":{"do_remote_prefill":true}"#;
    let bodies = [
        (
            "/v1/messages",
            format!(
                r#"{{"model":"{MODEL}","max_tokens":4,"messages":[{{"role":"user","content":"hi"}}],{extras}}}"#
            ),
        ),
        (
            "/v1/responses",
            format!(r#"{{"model":"{MODEL}","input":"hi","max_output_tokens":4,{extras}}}"#),
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"{MODEL}","max_tokens":4,"messages":[{{"role":"user","content":"hi"}}],{extras}}}"#
            ),
        ),
    ];
    for (controls, passed) in [("pass", true), ("reset", false)] {
        let proxy = Proxy::start(json!({"pools": pools(controls)})).await;
        for (path, body) in &bodies {
            let answer = client()
                .post(proxy.url(path))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(
                answer.status(),
                200,
                "{path}: {}",
                answer.text().await.unwrap()
            );
            let stats = sim.stats();
            let sent = stats.recent.iter().rev().find(|r| r.path == *path).unwrap();
            let sent = std::str::from_utf8(&sent.body).unwrap();
            if passed {
                assert_eq!(sent, body, "{path}: the engine got other bytes");
            } else {
                let sent: Value = serde_json::from_str(sent).unwrap();
                let asked: Value = serde_json::from_str(body).unwrap();
                for kept in ["chat_template_kwargs", "structured_outputs", "vendor_field"] {
                    assert_eq!(sent[kept], asked[kept], "{path}: {kept}");
                }
                assert_eq!(sent["priority"], 0, "{path}");
                assert_eq!(sent["kv_transfer_params"], Value::Null, "{path}");
            }
        }
    }
}

/// A stream that breaks after it started ends with its API's own error event, never a silent
/// cut, and is not kept: the same request again goes to the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_ends_with_its_apis_error_event() {
    let sim = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    sim.set_faults(vllm_sim::Faults {
        drop_after_chunks: Some(3),
        ..vllm_sim::Faults::default()
    });
    // Broken on purpose every time: never ejected for it.
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()])
            .with("outlier_detection", json!({"consecutive_failures": 0}))],
        "plugins": {"cache": {"enabled": true}},
    }))
    .await;
    let requests = [
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 32, "stream": true, "temperature": 0,
                   "messages": [{"role": "user", "content": "tell me more"}]}),
            r#""type":"error""#,
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 32, "stream": true, "temperature": 0,
                   "store": false, "input": "tell me more"}),
            r#""type":"error""#,
        ),
    ];
    for (path, request, error) in requests {
        for round in 0..2 {
            let answer = ask_url(&proxy.url(path), &request, &[]).await;
            assert_eq!(answer.status, 200, "{path}");
            assert_ne!(answer.x_cache, "HIT", "{path}: a broken stream was kept");
            let last = answer.body.trim_end().rsplit("\n\n").next().unwrap();
            assert!(
                last.starts_with("event: error\ndata: {") && last.contains(error),
                "{path}, round {round}: {last:?}"
            );
        }
    }
}

/// Two proxies of one fleet share their notes in Redis: a conversation whose turns alternate
/// between them still goes, each turn, to the backend that keeps its last response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_sharing_redis_send_each_follow_up_where_its_response_is() {
    let (a, b) = (keeping_sim().await, keeping_sim().await);
    let redis = RedisServer::start();
    let fleet_proxy = || {
        Proxy::start(json!({
            "pools": [pool("main", &[MODEL], &[a.addr(), b.addr()])
                .with("balancing", json!({"strategy": "round_robin"}))],
            "responses": {"store": "redis", "ttl": "10m",
                          "redis": {"url": redis.url(), "timeout": "2s"}},
        }))
    };
    let (one, two) = (fleet_proxy().await, fleet_proxy().await);
    for conversation in 0..3 {
        let mut previous = Value::Null;
        for turn in 0..6 {
            let proxy = if turn % 2 == 0 { &one } else { &two };
            let url = proxy.url("/v1/responses");
            let body = json!({"model": MODEL, "input": format!("{conversation}: turn {turn}"),
                              "max_output_tokens": 4, "previous_response_id": previous});
            // The answer ends once its note is in Redis: the other proxy finds it at once.
            let asked = ask_url(&url, &body, &[]).await;
            assert_eq!(
                asked.status, 200,
                "conversation {conversation}, turn {turn}: {}",
                asked.body
            );
            let answer: Value = serde_json::from_str(&asked.body).unwrap();
            previous = answer["id"].clone();
        }
    }
    let kept = redis_cli(redis.port(), &["--scan", "--pattern", "sluice:response:*"]);
    assert_eq!(kept.lines().count(), 18, "{kept}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routes_that_generate_nothing_go_by_model_with_the_tenants_limits() {
    let (small, large) = (
        vllm_sim::start(SimConfig::default().with_model("small"))
            .await
            .unwrap(),
        vllm_sim::start(SimConfig::default().with_model("large"))
            .await
            .unwrap(),
    );
    // A backend that refuses connections first in the large pool: the request moves on.
    let dead = reserve_port();
    let mut plugins = tenants();
    plugins["tenants"]["tenants"]["agent"]["limits"] =
        json!({"output_tokens_per_minute": 100, "requests_per_minute": 100});
    let proxy = Proxy::start(json!({
        "pools": [
            pool("small", &["small"], &[small.addr()]),
            pool("large", &["large"], &[dead.addr(), large.addr()])
                .without_health_checks()
                .with("balancing", json!({"strategy": "round_robin"})),
        ],
        "plugins": plugins,
    }))
    .await;
    let key = format!("Bearer {KEY}");
    let auth = [("authorization", key.as_str())];
    for _ in 0..4 {
        let tokenized = ask_url(
            &proxy.url("/tokenize"),
            &json!({"model": "large", "prompt": "The capital of France is"}),
            &auth,
        )
        .await;
        assert_eq!(tokenized.status, 200, "{}", tokenized.body);
        assert_eq!(tokenized.headers["x-sluice-pool"], "large");
        let body: Value = serde_json::from_str(&tokenized.body).unwrap();
        assert!(body["count"].as_u64().unwrap() > 0, "{body}");
    }
    assert_eq!(large.stats().count("/tokenize"), 4);
    assert_eq!(small.stats().count("/tokenize"), 0);
    let back = ask_url(
        &proxy.url("/detokenize"),
        &json!({"model": "small", "tokens": [1, 2, 3]}),
        &auth,
    )
    .await;
    assert_eq!(back.status, 200, "{}", back.body);
    assert_eq!(small.stats().count("/detokenize"), 1);
    // count_tokens charges no output: far more than 100 output tokens' worth of them pass.
    for _ in 0..12 {
        let counted = ask_url(
            &proxy.url("/v1/messages/count_tokens"),
            &json!({"model": "small", "messages": [{"role": "user", "content": "hi"}]}),
            &auth,
        )
        .await;
        assert_eq!(counted.status, 200, "{}", counted.body);
    }
    // Without a key: 401, and on Anthropic's route in Anthropic's shape.
    let refused = ask_url(
        &proxy.url("/v1/messages/count_tokens"),
        &json!({"model": "small", "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(refused.status, 401);
    let body: Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "authentication_error");
    // An unknown model is refused by Sluice, not guessed at.
    let unknown = ask_url(
        &proxy.url("/tokenize"),
        &json!({"model": "nope", "prompt": "x"}),
        &auth,
    )
    .await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
}

/// The engine answers a `background: true` Responses request at once and generates detached
/// from it: a tenant with `max_concurrent: 1` had 20 generations running in the engine,
/// charged an estimate each, past the breaker and the drain. Refused at the edge now, as a
/// clear 400 the client can act on, before any engine sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_is_refused_before_it_reaches_an_engine() {
    let sim = keeping_sim().await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()])],
        "plugins": tenants(),
    }))
    .await;
    let auth = format!("Bearer {KEY}");
    for background in [json!(true), json!(false)] {
        let body = json!({"model": MODEL, "input": "Write a novel", "background": background,
                          "max_output_tokens": 8});
        let answer = ask_url(
            &proxy.url("/v1/responses"),
            &body,
            &[("authorization", auth.as_str())],
        )
        .await;
        if background == json!(true) {
            assert_eq!(answer.status, 400, "{}", answer.body);
            let error: Value = serde_json::from_str(&answer.body).unwrap();
            assert_eq!(error["error"]["param"], "background", "{error}");
        } else {
            assert_eq!(answer.status, 200, "{}", answer.body);
        }
    }
    assert_eq!(
        sim.stats().count("/v1/responses"),
        1,
        "only the foreground one"
    );
}

/// vLLM names a Responses request's response after its body's `request_id`, which Sluice set
/// to the request's id, which a client may choose (`x-request-id`): another tenant could make
/// its response `resp_<yours>`, take your note over, and your follow-ups got 404. The engine
/// now gets the id with a suffix no client can guess, and the first note of an id stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tenant_can_name_its_response_after_anothers() {
    let sim = keeping_sim().await;
    let other_key = "sk-other-team";
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()])],
        "plugins": {
            "request_id": {"enabled": true},
            "tenants": {"enabled": true, "tenants": {
                "agent": {"keys": [key_digest(KEY)]},
                "other": {"keys": [key_digest(other_key)]}}}},
    }))
    .await;
    let (mine, theirs) = (format!("Bearer {KEY}"), format!("Bearer {other_key}"));
    let url = proxy.url("/v1/responses");
    let made = ask_url(
        &url,
        &json!({"model": MODEL, "input": "mine", "max_output_tokens": 4}),
        &[("authorization", &mine)],
    )
    .await;
    assert_eq!(made.status, 200, "{}", made.body);
    let id = serde_json::from_str::<Value>(&made.body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let taken = ask_url(
        &url,
        &json!({"model": MODEL, "input": "theirs", "max_output_tokens": 4,
                "request_id": "anything"}),
        &[("authorization", &theirs), ("x-request-id", &id)],
    )
    .await;
    assert_eq!(taken.status, 200, "{}", taken.body);
    let their_id = serde_json::from_str::<Value>(&taken.body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(their_id, id, "a client named its response after another's");
    let follow_up = json!({"model": MODEL, "input": "and?", "previous_response_id": id});
    let continued = ask_url(&url, &follow_up, &[("authorization", &mine)]).await;
    assert_eq!(continued.status, 200, "{}", continued.body);
}

/// A Messages answer's `input_tokens` leaves out what the engine's prefix cache served
/// (`cache_read_input_tokens`, as vLLM 0.32 reports it with prompt details on). The tenant
/// was charged only `input_tokens`: a cached prompt came almost free. It is now charged the
/// whole prompt, as on the OpenAI routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_prompt_is_charged_whole_however_much_was_cached() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .v1_engine(2048),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()])],
        "plugins": tenants(),
    }))
    .await;
    let request = json!({"model": MODEL, "max_tokens": 4,
        "system": "You review a patch line by line and name every risk you see. ".repeat(40),
        "messages": [{"role": "user", "content": "Is this patch safe to merge?"}]});
    let mut whole_prompts = 0;
    let mut cached = 0;
    for _ in 0..2 {
        let a = ask_url(&proxy.url("/v1/messages"), &request, &[("x-api-key", KEY)]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let usage = serde_json::from_str::<Value>(&a.body).unwrap()["usage"].clone();
        let read = usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
        cached += read;
        whole_prompts += usage["input_tokens"].as_u64().unwrap() + read;
    }
    assert!(cached > 100, "the second prompt was served from the cache");
    let series = r#"sluice_tenant_tokens_total{kind="input",tenant="agent"}"#;
    let charged = proxy.metric_once(series, whole_prompts as f64).await;
    assert_eq!(charged, Some(whole_prompts as f64));
}
