//! The speculative-first selector end to end: a draft simulator and a target simulator that
//! serve the same model name, every escalation reason, fallback with a 1 MiB body, a broken
//! draft stream, low-confidence escalation and the retry budget.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::sync::Arc;
use std::time::Duration;
use vllm_sim::{Faults, SimConfig};

const MODEL: &str = "llama";

async fn sim(low_confidence_share: f64) -> vllm_sim::Sim {
    sim_with(SimConfig::default(), low_confidence_share).await
}

async fn sim_with(config: SimConfig, low_confidence_share: f64) -> vllm_sim::Sim {
    vllm_sim::start(
        config
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_low_confidence_share(low_confidence_share)
            .with_record_requests(100),
    )
    .await
    .expect("sim")
}

/// The draft pool: a 2,048-token context, no `best_of`.
fn draft_pool(draft: &vllm_sim::Sim) -> Pool {
    pool("draft", &[MODEL], &[draft.addr()])
        .with("max_model_len", 2048)
        .with("supports", json!({"best_of": false}))
}

/// `draft` and a target pool, the cache, and the selector, with the pools' prices;
/// `confidence` is the model's `confidence` section (none: off).
fn config(draft: Pool, target: &vllm_sim::Sim, confidence: Option<Value>) -> Value {
    let mut model = json!({"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"});
    if let Some(confidence) = confidence {
        model["confidence"] = confidence;
    }
    let target = pool("target", &[MODEL], &[target.addr()]).with("price_per_million_tokens", 1.0);
    json!({
        "pools": [draft.with("price_per_million_tokens", 0.1), target],
        "plugins": {
            "cache": {"enabled": true, "tenant": {"anonymous": "share"}},
            "speculative": {"enabled": true, "models": [model]},
        },
    })
}

fn escalated(a: &Answer) -> Option<String> {
    a.headers
        .get("x-sluice-escalated")
        .map(|v| v.to_str().unwrap().to_string())
}

fn pool_of(a: &Answer) -> String {
    a.headers["x-sluice-pool"].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_draft_answers_and_each_pre_send_reason_goes_to_the_target() {
    let (draft, target) = (sim(0.0).await, sim(0.0).await);
    let proxy = Proxy::start(config(draft_pool(&draft), &target, None)).await;

    let a = proxy.ask(&chat(MODEL, "hello", false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!((pool_of(&a), escalated(&a)), ("draft".into(), None));

    let a = proxy
        .ask(
            &chat(MODEL, "hello again", false),
            &[("x-sluice-tier", "target")],
        )
        .await;
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("forced".into()))
    );

    let completions = proxy.url("/v1/completions");
    let body = json!({"model": MODEL, "prompt": "count", "best_of": 2, "max_tokens": 5});
    let a = ask_url(&completions, &body, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("unsupported".into()))
    );

    // About 2,500 prompt tokens: more than the draft's 2,048-token context.
    let long = chat(MODEL, &"many words ".repeat(1000), false);
    let a = proxy.ask(&long, &[]).await;
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("prompt-too-long".into()))
    );

    draft.set_faults(Faults {
        engine_dead: true,
        ..Faults::default()
    });
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("draft", draft.addr()).await["health"] == "unhealthy"
    })
    .await
    .is_some());
    let a = proxy
        .ask(&chat(MODEL, "while the draft is down", false), &[])
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("draft-unavailable".into()))
    );

    // Each request is counted as it ends (after its answer reached the client): wait for the
    // last one's count.
    let counted = wait_for(Duration::from_secs(5), || async {
        proxy
            .metric(r#"sluice_speculative_escalations_total{reason="draft-unavailable"}"#)
            .await
            == Some(1.0)
    })
    .await;
    assert!(counted.is_some(), "the last request was never counted");
    let metrics = proxy.metrics().await;
    for reason in [
        "forced",
        "unsupported",
        "prompt-too-long",
        "draft-unavailable",
    ] {
        let series = format!(r#"sluice_speculative_escalations_total{{reason="{reason}"}}"#);
        assert_eq!(
            metric_value(&metrics, &series),
            Some(1.0),
            "{series}\n{metrics}"
        );
    }
    assert_eq!(
        metric_value(
            &metrics,
            r#"sluice_speculative_requests_total{escalated="no",pool="draft"}"#
        ),
        Some(1.0)
    );
    // One of five requests stayed on the draft.
    assert_eq!(
        metric_value(&metrics, "speculative_acceptance_ratio"),
        Some(0.2)
    );
    let completion_tokens = metric_value(
        &metrics,
        r#"sluice_tokens_total{kind="completion",pool="target"}"#,
    )
    .unwrap_or(0.0);
    assert!(completion_tokens > 0.0, "{metrics}");
    let cost = metric_value(&metrics, r#"sluice_cost_dollars_total{pool="draft"}"#).unwrap();
    let on_target = metric_value(
        &metrics,
        r#"sluice_cost_target_equivalent_dollars_total{pool="draft"}"#,
    )
    .unwrap();
    assert!(
        cost > 0.0 && (on_target / cost - 10.0).abs() < 1e-6,
        "{cost} {on_target}"
    );
}

/// A 1 MiB prompt (about 256k tokens would be too long for a real draft; this pool declares
/// no context limit).
fn huge_request() -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "x".repeat(1 << 20)}],
        "max_tokens": 5,
        "temperature": 0,
    })
}

/// Room for a 1 MiB body, and a target that takes over after 500 ms without the draft's
/// response header.
fn big_config(draft: &vllm_sim::Sim, target: &vllm_sim::Sim) -> Value {
    json!({
        "limits": {"max_request_body_bytes": 4194304},
        "pools": [
            // No health checks on the draft: the request path alone meets its failures.
            pool("draft", &[MODEL], &[draft.addr()]).without_health_checks(),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": {"speculative": {"enabled": true, "models": [{
            "model": MODEL,
            "drafts": [{"pool": "draft"}],
            "target": "target",
            "draft_first_byte_budget": "500ms",
        }]}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_draft_falls_back_with_the_whole_1_mib_body() {
    let long_context = || SimConfig::default().with_max_model_len(1 << 20);
    let (draft, target) = (
        sim_with(long_context(), 0.0).await,
        sim_with(long_context(), 0.0).await,
    );
    let proxy = Proxy::start(big_config(&draft, &target)).await;
    let cases = [
        (Faults::error_rate(1.0, 503), "draft-error"),
        (
            Faults {
                hang_before_headers: true,
                ..Faults::default()
            },
            "draft-timeout",
        ),
        (
            Faults {
                refuse_connections: true,
                ..Faults::default()
            },
            "draft-error",
        ),
    ];
    for (i, (faults, reason)) in cases.into_iter().enumerate() {
        draft.set_faults(faults);
        let a = proxy.ask(&huge_request(), &[]).await;
        assert_eq!(a.status, 200, "{reason}: {}", a.body);
        assert_eq!(pool_of(&a), "target");
        assert_eq!(escalated(&a).as_deref(), Some(reason));
        let got = target.stats().recent;
        // Health checks are recorded too: the last chat request is the one.
        let last = got
            .iter()
            .rev()
            .find(|r| r.path == "/v1/chat/completions")
            .expect("the target got the request");
        assert_eq!(
            last.body.len(),
            serde_json::to_vec(&huge_request()).unwrap().len()
        );
        assert_eq!(target.stats().count("/v1/chat/completions"), i as u64 + 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_stream_that_drops_midway_ends_with_an_error_event_and_is_not_cached() {
    let (draft, target) = (sim(0.0).await, sim(0.0).await);
    draft.set_faults(Faults {
        drop_after_chunks: Some(4),
        ..Faults::default()
    });
    let proxy = Proxy::start(config(
        draft_pool(&draft).without_health_checks(),
        &target,
        None,
    ))
    .await;
    let request = chat(MODEL, "a story, please", true);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200);
    let events = sse_data(&a.body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        a.body
    );
    let error = &events[events.len() - 2];
    assert!(error.contains("\"error\""), "{error}");
    assert_eq!(
        target.stats().count("/v1/chat/completions"),
        0,
        "no fallback once streaming"
    );
    // Not cached: the same request goes upstream again.
    draft.set_faults(Faults::none());
    let again = proxy.ask(&request, &[]).await;
    assert_eq!(again.x_cache, "MISS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn low_confidence_answers_go_to_the_target_the_others_stay() {
    let (draft, target) = (sim(0.5).await, sim(0.0).await);
    let confidence = json!({"enabled": true, "measure": "mean", "window": 16, "min_logprob": -1.0});
    let proxy = Proxy::start(config(draft_pool(&draft), &target, Some(confidence))).await;
    let (mut kept, mut escalations) = (0, 0);
    for i in 0..16 {
        let content = format!("question number {i}");
        let expected_low = answer_confidence(&draft, MODEL, &content).await < -1.0;
        let mut request = chat(MODEL, &content, false);
        request["max_tokens"] = json!(16);
        let a = proxy.ask(&request, &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let v: Value = serde_json::from_str(&a.body).unwrap();
        assert!(
            v["choices"][0]["logprobs"].is_null(),
            "not asked, not sent: {v}"
        );
        if expected_low {
            escalations += 1;
            assert_eq!(
                escalated(&a).as_deref(),
                Some("low-confidence"),
                "{content}"
            );
            assert_eq!(pool_of(&a), "target");
        } else {
            kept += 1;
            assert_eq!(escalated(&a), None, "{content}");
            assert_eq!(pool_of(&a), "draft");
        }
    }
    assert!(
        kept > 0 && escalations > 0,
        "{kept} kept, {escalations} escalated"
    );
    // The draft was asked for logprobs the client did not ask for: the test's own 16 direct
    // asks, plus one per request through the proxy.
    let asked = draft
        .stats()
        .recent
        .iter()
        .filter(|r| String::from_utf8_lossy(&r.body).contains("\"logprobs\":true"))
        .count();
    assert_eq!(asked, 32, "16 direct + 16 through the proxy");
    // A client that asks for logprobs gets them.
    let mut request = chat(MODEL, "question number 0 again", false);
    request["logprobs"] = json!(true);
    let a = proxy.ask(&request, &[]).await;
    let v: Value = serde_json::from_str(&a.body).unwrap();
    assert!(v["choices"][0]["logprobs"]["content"].is_array(), "{v}");
    println!("low confidence: {kept} kept on the draft, {escalations} escalated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_holds_under_a_pool_that_fails_every_request() {
    let failing = sim(0.0).await;
    failing.set_faults(Faults::error_rate(1.0, 503));
    let retry = json!({
        "max_retries": 2,
        "budget_ratio": 0.2,
        "min_retries": 3,
        "backoff_base": "1ms",
        "backoff_max": "5ms",
    });
    let proxy = Arc::new(
        Proxy::start(json!({"pools": [pool("main", &[MODEL], &[failing.addr()])
            .with("retry", retry)
            .with("outlier_detection", json!({"consecutive_failures": 0}))]}))
        .await,
    );
    for i in 0..50 {
        let a = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(
            a.status, 503,
            "the upstream's own answer passes through: {}",
            a.body
        );
    }
    let sent = failing.stats().count("/v1/chat/completions");
    // 50 requests, at most 3 + 20% of 50 retries; without a budget it would be 150.
    assert!((50..=63).contains(&sent), "{sent}");
    // And retries did happen: at least the budget's starting 3.
    assert!(sent >= 53, "{sent}");
    let metrics = proxy.metrics().await;
    let retries = metric_value(&metrics, r#"sluice_pool_retries_total{pool="main"}"#).unwrap();
    assert_eq!(retries as u64, sent - 50);
    println!("retry budget: 50 requests to a pool failing all: {sent} upstream attempts");
}

/// A draft that streams at 10 ms a token, as a small model on a busy GPU might.
async fn streaming_draft(low_confidence_share: f64) -> vllm_sim::Sim {
    let latency = vllm_sim::Latency::new(
        Duration::from_millis(5),
        Duration::ZERO,
        Duration::from_millis(10),
    );
    sim_with(
        SimConfig::default().with_latency(latency),
        low_confidence_share,
    )
    .await
}

/// Low-confidence escalation, streams judged in a hold-back window of 8 tokens.
fn hold_back() -> Value {
    json!({
        "enabled": true,
        "measure": "mean",
        "window": 16,
        "min_logprob": -1.0,
        "stream_hold_back_tokens": 8,
    })
}

/// The stream's data events, checked for what a client that asked for neither logprobs nor
/// usage must not see.
fn plain_stream_events(a: &Answer) -> Vec<Value> {
    let events = sse_events(a);
    for e in &events {
        let choices = e["choices"].as_array().unwrap();
        assert!(!choices.is_empty(), "a usage chunk nobody asked for: {e}");
        assert!(
            choices[0]["logprobs"].is_null(),
            "logprobs nobody asked for: {e}"
        );
        assert!(e.get("usage").is_none_or(Value::is_null), "{e}");
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_judged_in_the_hold_back_window() {
    let (draft, target) = (streaming_draft(0.5).await, sim(0.0).await);
    let proxy = Proxy::start(config(draft_pool(&draft), &target, Some(hold_back()))).await;
    let (mut kept, mut escalations) = (0, 0);
    let mut answered_tokens = std::collections::HashMap::<String, usize>::new();
    for i in 0..12 {
        let content = format!("streamed question {i}");
        let expected_low = answer_confidence(&draft, MODEL, &content).await < -1.0;
        let a = proxy.ask(&chat(MODEL, &content, true), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let events = plain_stream_events(&a);
        let finish = events
            .iter()
            .filter_map(|e| e["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish.count(), 1, "the whole answer");
        // The simulator's tokens are words, and an answer that ends by itself (`stop`) spends
        // one more on its end-of-sequence token, as vLLM's do.
        let words = sluice_testkit::content(&a).split_whitespace().count();
        assert!(words > 0);
        let eos = usize::from(a.body.contains(r#""finish_reason":"stop""#));
        *answered_tokens.entry(pool_of(&a)).or_default() += words + eos;
        if expected_low {
            escalations += 1;
            assert_eq!(
                escalated(&a).as_deref(),
                Some("low-confidence"),
                "{content}"
            );
            assert_eq!(pool_of(&a), "target");
        } else {
            kept += 1;
            assert_eq!(escalated(&a), None, "{content}");
            assert_eq!(pool_of(&a), "draft");
        }
        // The same stream again comes from the cache, as the client first got it: the
        // cache stored the stream after the selector cleaned it.
        let again = proxy.ask(&chat(MODEL, &content, true), &[]).await;
        assert_eq!(again.x_cache, "HIT");
        plain_stream_events(&again);
        assert_eq!(sluice_testkit::content(&again), sluice_testkit::content(&a));
    }
    assert!(
        kept > 0 && escalations > 0,
        "{kept} kept, {escalations} escalated"
    );

    // The draft streams were asked for logprobs (to judge) and usage (to count tokens); the
    // target's only for usage.
    let draft_asks = draft.stats().recent;
    let streamed = draft_asks
        .iter()
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .filter(|b| b.contains("\"stream\":true"))
        .collect::<Vec<_>>();
    assert_eq!(streamed.len(), 12);
    for body in &streamed {
        assert!(
            body.contains("\"logprobs\":true") && body.contains("\"include_usage\":true"),
            "{body}"
        );
    }
    for r in target.stats().recent.iter().filter(|r| r.method == "POST") {
        let body = String::from_utf8_lossy(&r.body);
        assert!(
            !body.contains("logprobs") && body.contains("\"include_usage\":true"),
            "{body}"
        );
    }
    // Counted as each request ends, after its answer reached the client: the last one's
    // count may come a moment after it.
    let series = |pool: &str| format!(r#"sluice_tokens_total{{kind="completion",pool="{pool}"}}"#);
    let counted = |metrics: &str| {
        ["draft", "target"].map(|pool| {
            metric_value(metrics, &series(pool)).unwrap_or(0.0) as usize == answered_tokens[pool]
        })
    };
    let all_counted = wait_for(Duration::from_secs(5), || async {
        counted(&proxy.metrics().await) == [true, true]
    })
    .await;
    let metrics = proxy.metrics().await;
    assert!(
        all_counted.is_some(),
        "{answered_tokens:?} answered, counted: {:?} {:?}",
        metric_value(&metrics, &series("draft")),
        metric_value(&metrics, &series("target"))
    );

    // A client that asks for logprobs and usage gets both.
    let mut request = chat(MODEL, "streamed question with everything", true);
    request["logprobs"] = json!(true);
    request["stream_options"] = json!({"include_usage": true});
    let a = proxy.ask(&request, &[]).await;
    let data = sse_data(&a.body);
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(usage["usage"]["completion_tokens"].is_u64(), "{usage}");
    let first_token: Value = serde_json::from_str(&data[1]).unwrap();
    assert!(
        first_token["choices"][0]["logprobs"]["content"].is_array(),
        "{first_token}"
    );
    println!("hold-back window: {kept} streams kept on the draft, {escalations} escalated");
}

/// The time to the first byte of a stream's body, as the client sees it.
async fn stream_ttft(url: &str, content: &str) -> Duration {
    let started = std::time::Instant::now();
    let mut response = client()
        .post(url)
        .json(&chat(MODEL, content, true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.unwrap();
    let ttft = started.elapsed();
    assert!(first.is_some_and(|c| !c.is_empty()));
    while response.chunk().await.unwrap().is_some() {}
    ttft
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_back_window_costs_the_time_of_its_tokens() {
    let (draft, target) = (streaming_draft(0.0).await, sim(0.0).await);
    let off = Proxy::start(config(draft_pool(&draft), &target, None)).await;
    let on = Proxy::start(config(draft_pool(&draft), &target, Some(hold_back()))).await;
    let (mut without, mut with) = (Vec::new(), Vec::new());
    // Interleaved, so both see the same machine; distinct prompts, so none is a cache hit.
    for i in 0..10 {
        without.push(stream_ttft(&off.url("/v1/chat/completions"), &format!("ttft off {i}")).await);
        with.push(stream_ttft(&on.url("/v1/chat/completions"), &format!("ttft on {i}")).await);
    }
    without.sort();
    with.sort();
    let (median_off, median_on) = (without[5], with[5]);
    // The window holds 8 tokens at 10 ms each: the first byte comes after the 8th token
    // instead of the 1st (the role chunk, which vLLM sends at once, is held too).
    println!(
        "hold-back window of 8 tokens at 10 ms/token: TTFT median {:.1} ms off, {:.1} ms on (+{:.1} ms)",
        median_off.as_secs_f64() * 1e3,
        median_on.as_secs_f64() * 1e3,
        (median_on.as_secs_f64() - median_off.as_secs_f64()) * 1e3
    );
    // The first byte waits for the 8th token: at least 7 more intervals of 10 ms. (A lower
    // bound only: sleeping cannot be faster, while a busy machine can be slower.)
    assert!(
        median_on >= median_off + Duration::from_millis(50),
        "the window holds the stream back"
    );
}

/// A draft whose context is 2,048 tokens, unknown to Sluice (its pool declares none), whose
/// answers run 300 tokens: only the engine knows the request will not fit.
async fn small_context_draft() -> vllm_sim::Sim {
    sim_with(
        SimConfig::default()
            .with_max_model_len(2048)
            .with_answer_tokens(300, 300),
        0.0,
    )
    .await
}

/// The completions a simulator finished generating.
fn completed(sim: &vllm_sim::Sim) -> u64 {
    sim.stats().completed
}

/// vLLM 0.32 refuses a prompt longer than the draft's context with a 400 naming
/// `input_tokens`: nothing has reached the client, so the request escalates to the target
/// (whose context holds it) as `prompt-too-long`, where it used to get the draft's 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_refusing_the_context_length_escalates_as_prompt_too_long() {
    let (draft, target) = (small_context_draft().await, sim(0.0).await);
    let undeclared = pool("draft", &[MODEL], &[draft.addr()]);
    let proxy = Proxy::start(config(undeclared, &target, None)).await;
    // About 2,750 prompt tokens as the engine counts them.
    for stream in [false, true] {
        // A prompt of its own each time: the first answer is cached, for streams too.
        let long = chat(
            MODEL,
            &format!("{stream} {}", "many words ".repeat(1000)),
            stream,
        );
        let a = proxy.ask(&long, &[]).await;
        assert_eq!(a.status, 200, "stream {stream}: {}", a.body);
        assert_eq!(
            (pool_of(&a), escalated(&a)),
            ("target".into(), Some("prompt-too-long".into())),
            "stream {stream}"
        );
    }
    assert_eq!(draft.stats().errors, 2, "the draft refused both");
    assert_eq!(completed(&target), 2);
    // Any other 400 of the draft is the client's own mistake: passed on as it is.
    let mut bad = chat(MODEL, "hello", false);
    bad["max_tokens"] = json!("many");
    let a = proxy.ask(&bad, &[]).await;
    assert_eq!(a.status, 400, "{}", a.body);
}

/// vLLM 0.32 no longer refuses a prompt whose `max_tokens` does not fit: it answers up to the
/// context's end. A held draft answer cut that way escalates (nothing reached the client);
/// a streamed one reached the client, and is never cached as a complete answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_answer_cut_by_its_context_escalates_and_is_never_cached() {
    let draft = small_context_draft().await;
    let target = sim_with(SimConfig::default().with_answer_tokens(300, 300), 0.0).await;
    let undeclared = pool("draft", &[MODEL], &[draft.addr()]);
    let proxy = Proxy::start(config(undeclared, &target, None)).await;
    // About 1,900 prompt tokens and 1,000 asked: the draft stops after 148.
    let mut request = chat(MODEL, &"abcd".repeat(1890), false);
    request["max_tokens"] = json!(1000);
    request["temperature"] = json!(0);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("prompt-too-long".into()))
    );
    let v: Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(
        v["usage"]["completion_tokens"], 300,
        "the whole answer: {v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    let incomplete = r#"sluice_cache_writes_total{outcome="incomplete"}"#;
    let before = proxy.metric(incomplete).await.unwrap_or(0.0);
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["messages"][0]["content"] = json!("efgh".repeat(1890));
    let a = proxy.ask(&streamed, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!((pool_of(&a), escalated(&a)), ("draft".into(), None));
    assert!(a.body.contains(r#""finish_reason":"length""#), "{}", a.body);
    let judged = wait_for(Duration::from_secs(5), || async {
        proxy.metric(incomplete).await.unwrap_or(0.0) > before
    })
    .await;
    assert!(judged.is_some(), "the cut stream was not judged incomplete");
    let again = proxy.ask(&streamed, &[]).await;
    assert_ne!(again.headers["x-cache"], "HIT", "a cut answer was cached");
}

/// The breaker moves a request off a draft that cannot take it onto the target: the
/// request has escalated there, and the target's answer is never judged against the target
/// again (it was generated twice, and "escalated" from the target to itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_rerouted_onto_the_target_is_generated_there_once() {
    // 16,000 tokens of KV cache, 80 % held: the draft admits only small requests.
    let draft = sim_with(SimConfig::default().with_kv(1000, 16), 0.0).await;
    let target = sim(1.0).await;
    let mut cfg = config(
        pool("draft", &[MODEL], &[draft.addr()]).with(
            "health",
            json!({"interval": "100ms", "timeout": "300ms", "stale_after": "1s"}),
        ),
        &target,
        Some(json!({"enabled": true, "measure": "mean", "window": 16, "min_logprob": -1.0})),
    );
    cfg["plugins"]["kv_breaker"] = json!({"enabled": true});
    let proxy = Proxy::start(cfg).await;
    draft.set_phantom_kv(0.8);
    let seen = wait_for(Duration::from_secs(5), || async {
        let status = proxy.backend_status("draft", draft.addr()).await;
        status["kv_cache_usage"]
            .as_f64()
            .is_some_and(|kv| kv >= 0.79)
    })
    .await;
    assert!(seen.is_some(), "the draft's KV was scraped");
    // About 1,000 prompt tokens and 1,500 output: 16 % of the draft's cache more.
    let mut request = chat(MODEL, &"word ".repeat(800), false);
    request["max_tokens"] = json!(1500);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("draft-unavailable".into()))
    );
    assert_eq!(draft.stats().requests_total, draft_probes(&draft));
    assert_eq!(completed(&target), 1, "the target generated it once");
}

/// The draft's requests that were health checks and scrapes, not completions.
fn draft_probes(sim: &vllm_sim::Sim) -> u64 {
    let stats = sim.stats();
    stats
        .requests_by_path
        .iter()
        .filter(|(path, _)| !path.starts_with("/v1/") || *path == "/v1/models")
        .map(|(_, n)| n)
        .sum()
}

/// The prompt-size estimate counts four bytes a token; this draft's tokenizer makes 2.5. The
/// pool learns that from its answers' `usage.prompt_tokens`, and then decides a prompt too
/// long for the draft before sending it, where it first had to be refused by the draft.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_learns_its_tokenizer_from_usage_and_decides_prompt_too_long_before_sending() {
    let draft = sim_with(
        SimConfig::default()
            .with_max_model_len(2048)
            .with_bytes_per_token(2.5),
        0.0,
    )
    .await;
    let target = sim(0.0).await;
    let proxy = Proxy::start(config(draft_pool(&draft), &target, None)).await;
    // 5,600 bytes: 1,404 tokens by the estimate, 2,240 by this tokenizer.
    let long = |tag: &str| {
        let mut request = chat(
            MODEL,
            &format!("{tag:>8}{}", "0123456789".repeat(559)),
            false,
        );
        request["max_tokens"] = json!(16);
        request
    };
    let a = proxy.ask(&long("first"), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(escalated(&a).as_deref(), Some("prompt-too-long"));
    assert_eq!(draft.stats().errors, 1, "sent, and refused by the draft");

    for i in 0..8 {
        let mut request = chat(MODEL, &format!("{i:>8}{}", "0123456789".repeat(200)), false);
        request["max_tokens"] = json!(16);
        let a = proxy.ask(&request, &[]).await;
        assert_eq!((a.status, pool_of(&a)), (200, "draft".into()), "{}", a.body);
    }
    let status = proxy.status().await;
    let scale = status["pools"][0]["prompt_scale"].as_f64().unwrap();
    assert!(scale > 1.4, "learned {scale}");

    let a = proxy.ask(&long("second"), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(escalated(&a).as_deref(), Some("prompt-too-long"));
    assert_eq!(draft.stats().errors, 1, "decided before sending");
}

/// What a chat template renders besides the messages' text counts in the estimate: an agent's
/// tool list, its calls' arguments. A first agent turn with a long tool list is too long for
/// the draft, and is known so before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tools_a_template_renders_count_toward_the_draft_context() {
    let (draft, target) = (
        sim_with(SimConfig::default().with_max_model_len(2048), 0.0).await,
        sim(0.0).await,
    );
    let proxy = Proxy::start(config(draft_pool(&draft), &target, None)).await;
    let tools: Vec<Value> = (0..40)
        .map(|i| {
            json!({"type": "function", "function": {
                "name": format!("tool_{i}"),
                "description": "Reads a file of the repository and returns its lines, numbered.",
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string"}, "start": {"type": "integer"}}}}})
        })
        .collect();
    let mut request = chat(MODEL, "Fix the failing test.", false);
    request["tools"] = json!(tools);
    request["max_tokens"] = json!(256);
    let a = proxy.ask(&request, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (pool_of(&a), escalated(&a)),
        ("target".into(), Some("prompt-too-long".into()))
    );
    assert_eq!(draft.stats().errors, 0, "decided before sending");
}

/// A non-stream draft answer comes only once generated: one slower than the selector's
/// first-byte budget escalates as `draft-timeout`, and is no failure of the draft's (three
/// such requests ejected it, and every request then went to the 9× target). And a runtime
/// escalation is admitted by the target's KV breaker as any request sent there first: with
/// the target shedding its class, it is refused, not sent past the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_slower_than_its_budget_escalates_without_blame_and_through_the_breaker() {
    let slow = SimConfig::default()
        .with_answer_tokens(100, 100)
        .with_latency(vllm_sim::Latency::new(
            Duration::ZERO,
            Duration::ZERO,
            Duration::from_millis(10),
        ));
    let (draft, target) = (sim_with(slow, 0.0).await, sim(0.0).await);
    let scraped_often = json!({"interval": "100ms", "timeout": "300ms", "stale_after": "1s"});
    let mut cfg = config(
        draft_pool(&draft)
            .with("health", scraped_often.clone())
            .with("outlier_detection", json!({"consecutive_failures": 3})),
        &target,
        None,
    );
    cfg["pools"][1]["health"] = scraped_often;
    cfg["plugins"]["speculative"]["models"][0]["draft_first_byte_budget"] = json!("300ms");
    cfg["plugins"]["kv_breaker"] = json!({"enabled": true});
    let proxy = Proxy::start(cfg).await;
    let slow_request = |i: u32| {
        let mut request = chat(MODEL, &format!("a long answer {i}"), false);
        request["max_tokens"] = json!(100);
        request
    };
    for i in 0..4 {
        let a = proxy.ask(&slow_request(i), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(
            (pool_of(&a), escalated(&a)),
            ("target".into(), Some("draft-timeout".into()))
        );
    }
    let state = proxy.backend_status("draft", draft.addr()).await;
    assert_ne!(state["health"], "ejected", "{state}");
    let ejections = proxy
        .metric(r#"sluice_backend_ejections_total{pool="draft"}"#)
        .await
        .unwrap_or(0.0);
    assert_eq!(ejections, 0.0);

    target.set_phantom_kv(0.9);
    let seen = wait_for(Duration::from_secs(5), || async {
        let state = proxy.backend_status("target", target.addr()).await;
        state["kv_cache_usage"]
            .as_f64()
            .is_some_and(|kv| kv >= 0.89)
    })
    .await;
    assert!(seen.is_some(), "the target's pressure was scraped");
    let before = completed(&target);
    let a = proxy.ask(&slow_request(99), &[]).await;
    assert_eq!(
        a.headers
            .get("x-sluice-rejected")
            .map(|v| v.to_str().unwrap()),
        Some("kv-pressure"),
        "{} {}",
        a.status,
        a.body
    );
    assert_eq!(
        completed(&target),
        before,
        "nothing sent past the target's line"
    );
}

/// N22: a draft answer the selector rejected was generated all the same: its tenant is
/// charged for it (tokens at their count, dollars at the draft pool's price), besides the
/// target's answer it got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_draft_is_charged_to_the_tenant() {
    use sha2::{Digest, Sha256};
    let (draft, target) = (sim(1.0).await, sim(0.0).await);
    let confidence = json!({"enabled": true, "measure": "mean", "window": 16, "min_logprob": -1.0});
    let mut config = config(draft_pool(&draft), &target, Some(confidence));
    let key = "sk-team";
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())));
    config["plugins"]["tenants"] =
        json!({"enabled": true, "tenants": {"team": {"keys": [digest]}}});
    let proxy = Proxy::start(config).await;

    let mut request = chat(MODEL, "a question the draft is unsure of", false);
    request["max_tokens"] = json!(16);
    // What the draft answers it (the simulator answers the same content alike).
    let direct: Value = client()
        .post(format!("http://{}/v1/chat/completions", draft.addr()))
        .json(&request)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let auth = format!("Bearer {key}");
    let a = proxy.ask(&request, &[("authorization", &auth)]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(escalated(&a).as_deref(), Some("low-confidence"));
    let answer: Value = serde_json::from_str(&a.body).unwrap();
    let tokens = |v: &Value, k: &str| v["usage"][k].as_f64().unwrap();
    let want_output = tokens(&answer, "completion_tokens") + tokens(&direct, "completion_tokens");
    let want_input = tokens(&answer, "prompt_tokens") + tokens(&direct, "prompt_tokens");
    let output = proxy
        .metric_once(
            r#"sluice_tenant_tokens_total{kind="output",tenant="team"}"#,
            want_output,
        )
        .await;
    assert_eq!(output, Some(want_output), "draft and target outputs");
    let input = proxy
        .metric(r#"sluice_tenant_tokens_total{kind="input",tenant="team"}"#)
        .await;
    assert_eq!(input, Some(want_input));
}
