//! The official `openai` Python package against Sluice and a simulated vLLM backend.
//! Needs `python3` with `openai` installed (`scripts/bootstrap --test` installs it).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::{Faults, SimConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_sluice() {
    let upstream = vllm_sim::start(SimConfig::default().with_model("test-model"))
        .await
        .unwrap();
    let proxy =
        Proxy::start(json!({"pools": [pool("main", &["test-model"], &[upstream.addr()])]})).await;
    let base = format!("http://{}", proxy.addr);
    run_python("openai_client.py", &[base.as_str(), "test-model"]).await;
}

const MODEL: &str = "llama";

/// One request the script makes, and where it must be answered.
fn case(name: &str, prompt: &str, stream: bool, pool: &str, escalated: Option<&str>) -> Value {
    json!({"name": name, "endpoint": "chat", "prompt": prompt, "stream": stream,
           "pool": pool, "escalated": escalated})
}

/// A non-stream case whose prompt is 1 MiB.
fn huge_case(name: &str, reason: &str) -> Value {
    let mut huge = case(name, "", false, "target", Some(reason));
    huge["prompt_bytes"] = json!(1 << 20);
    huge
}

async fn llama_sim(config: SimConfig, low_confidence_share: f64) -> vllm_sim::Sim {
    vllm_sim::start(
        config
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_low_confidence_share(low_confidence_share),
    )
    .await
    .expect("sim")
}

/// The `plugins` section: the selector, with `model_settings` (an object) added to the model's
/// entry.
fn selector(model_settings: Value) -> Value {
    let mut model = json!({"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"});
    if let Value::Object(keys) = model_settings {
        model.as_object_mut().unwrap().extend(keys);
    }
    json!({"speculative": {"enabled": true, "models": [model]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_sees_normal_answers_in_every_escalation_case() {
    // Decided before sending, and on low confidence (answers and streams).
    let (draft, target) = (
        llama_sim(SimConfig::default(), 0.5).await,
        llama_sim(SimConfig::default(), 0.0).await,
    );
    let proxy = Proxy::start(json!({
        "pools": [
            pool("draft", &[MODEL], &[draft.addr()])
                .with("max_model_len", 2048)
                .with("supports", json!({"best_of": false})),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": selector(json!({"confidence": {
            "enabled": true,
            "window": 16,
            "min_logprob": -1.0,
            "stream_hold_back_tokens": 8,
        }})),
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    let (mut sure, mut unsure) = (Vec::new(), Vec::new());
    for i in 0..40 {
        let prompt = format!("what the client asks, number {i}");
        if answer_confidence(&draft, MODEL, &prompt).await < -1.0 {
            unsure.push(prompt);
        } else {
            sure.push(prompt);
        }
    }
    assert!(sure.len() >= 4 && unsure.len() >= 2, "{sure:?} {unsure:?}");
    let mut best_of = case(
        "unsupported",
        "count to three",
        false,
        "target",
        Some("unsupported"),
    );
    best_of["endpoint"] = json!("completions");
    best_of["extra_body"] = json!({"best_of": 2});
    let mut forced = case("forced", &sure[2], false, "target", Some("forced"));
    forced["headers"] = json!({"x-sluice-tier": "target"});
    let cases = json!([
        case("draft answers", &sure[0], false, "draft", None),
        case("draft streams", &sure[1], true, "draft", None),
        forced,
        best_of,
        case(
            "prompt-too-long",
            &"many words ".repeat(1000),
            false,
            "target",
            Some("prompt-too-long")
        ),
        case(
            "low-confidence",
            &unsure[0],
            false,
            "target",
            Some("low-confidence")
        ),
        case(
            "low-confidence stream",
            &unsure[1],
            true,
            "target",
            Some("low-confidence")
        ),
        case(
            "confident stream in the window",
            &sure[3],
            true,
            "draft",
            None
        ),
    ]);
    run_python("openai_escalation.py", &[&base, MODEL, &cases.to_string()]).await;

    draft.set_faults(Faults {
        engine_dead: true,
        ..Faults::default()
    });
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("draft", draft.addr()).await["health"] == "unhealthy"
    })
    .await
    .is_some());
    let cases = json!([
        case(
            "draft-unavailable",
            &sure[0],
            false,
            "target",
            Some("draft-unavailable")
        ),
        case(
            "draft-unavailable stream",
            &sure[1],
            true,
            "target",
            Some("draft-unavailable")
        ),
    ]);
    run_python("openai_escalation.py", &[&base, MODEL, &cases.to_string()]).await;

    // After trying the draft, with a 1 MiB prompt replayed to the target.
    let long_context = || SimConfig::default().with_max_model_len(1 << 20);
    let (draft, target) = (
        llama_sim(long_context(), 0.0).await,
        llama_sim(long_context(), 0.0).await,
    );
    let proxy = Proxy::start(json!({
        "limits": {"max_request_body_bytes": 4194304},
        "pools": [
            // Failing on purpose every time: not ejected, so each failure is met on the way;
            // 503s are retried in the pool (within its budget) before the target takes over.
            pool("draft", &[MODEL], &[draft.addr()])
                .without_health_checks()
                .with("outlier_detection", json!({"consecutive_failures": 0}))
                .with(
                    "retry",
                    json!({"max_retries": 2, "backoff_base": "1ms", "backoff_max": "5ms"}),
                ),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": selector(json!({"draft_first_byte_budget": "500ms"})),
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    let faults = [
        ("draft 503", Faults::error_rate(1.0, 503), "draft-error"),
        (
            "draft silent",
            Faults {
                hang_before_headers: true,
                ..Faults::default()
            },
            "draft-timeout",
        ),
        (
            "draft refuses",
            Faults {
                refuse_connections: true,
                ..Faults::default()
            },
            "draft-error",
        ),
    ];
    for (name, faults, reason) in faults {
        let tried_before = draft.stats().count("/v1/chat/completions");
        let retried = faults.error_rate > 0.0;
        draft.set_faults(faults);
        let cases = json!([
            huge_case(&format!("{name}, 1 MiB prompt"), reason),
            case(
                &format!("{name}, stream"),
                "a short one",
                true,
                "target",
                Some(reason)
            ),
        ]);
        run_python("openai_escalation.py", &[&base, MODEL, &cases.to_string()]).await;
        if retried {
            // Two requests, and the budget's starting three retries spent on them.
            let tried = draft.stats().count("/v1/chat/completions") - tried_before;
            assert_eq!(tried, 2 + 3, "{name}");
        }
    }
    assert_eq!(target.stats().count("/v1/chat/completions"), 6);
}

/// What a user's code sees of a tenant's limits: the SDK's `AuthenticationError` for an
/// unknown key, the OpenAI rate-limit headers on every answer, and `RateLimitError` (with
/// `retry-after`) on the request over the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_sees_a_tenants_rate_limit_as_rate_limit_error() {
    use sha2::{Digest, Sha256};
    let upstream = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let key = "sk-alpha-python";
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())));
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": {"enabled": true, "tenants": {
            "alpha": {"keys": [digest], "limits": {"requests_per_minute": 5}}}}},
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    run_python("openai_tenants.py", &[base.as_str(), MODEL, key, "5"]).await;
}
