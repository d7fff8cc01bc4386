#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Wire shapes against the fixtures, errors, models, health, determinism, logprobs.

mod common;

use common::*;
use serde_json::{json, Value};
use vllm_sim::{ErrorShape, Sim, SimConfig};

const CHAT: &str = "/v1/chat/completions";

/// vLLM 0.11's shapes (`ErrorShape::New`, as in `tests/fixtures/*.json`); vLLM 0.32's, the
/// default, are compared with real captures in `golden_0_32.rs`.
fn vllm_0_11() -> SimConfig {
    SimConfig::default().with_error_shape(ErrorShape::New)
}

#[tokio::test]
async fn chat_completion_matches_fixture_shape() {
    let sim = sim(vllm_0_11()).await;
    let (status, answer) = post(&sim, CHAT, &chat_body("What is the capital of France?")).await;
    assert_eq!(status, 200, "{answer}");
    let fixture = json_fixture("vllm-chat-completion.json");
    assert_eq!(skeleton(&answer), skeleton(&fixture));
    assert!(answer["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(answer["model"], MODEL);
    let usage = &answer["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    sim.shutdown();
}

#[tokio::test]
async fn completion_matches_fixture_shape_and_content_length() {
    let sim = sim(vllm_0_11()).await;
    let response = send(
        &sim,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let length: usize = response.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = response.bytes().await.unwrap();
    assert_eq!(length, body.len());
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        skeleton(&answer),
        skeleton(&json_fixture("vllm-completion.json"))
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    // "The capital of France is" = 24 bytes -> 6 tokens.
    assert_eq!(answer["usage"]["prompt_tokens"], 6);
    sim.shutdown();
}

async fn stream(sim: &Sim, path: &str, body: Value) -> (reqwest::header::HeaderMap, Vec<String>) {
    let response = send(sim, path, &body).await;
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    (headers, sse_events(&text))
}

#[tokio::test]
async fn chat_stream_event_sequence_matches_fixture() {
    let sim = sim(vllm_0_11()).await;
    let mut body = streaming(chat_body("Tell me about Paris"));
    body["stream_options"] = json!({"include_usage": true});
    let (headers, events) = stream(&sim, CHAT, body.clone()).await;
    assert_eq!(headers["content-type"], "text/event-stream; charset=utf-8");
    assert_eq!(headers["transfer-encoding"], "chunked");
    assert!(headers.get("content-length").is_none());

    let fixture = json_events(&sse_events(&fixture("vllm-chat-stream.sse")));
    let ours = json_events(&events);
    // role chunk, content chunks, finish chunk, usage chunk
    assert_eq!(skeleton(&ours[0]), skeleton(&fixture[0]));
    assert_eq!(
        ours[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let count = ours.len();
    let (finish, usage) = (&ours[count - 2], &ours[count - 1]);
    for content in &ours[1..count - 2] {
        assert_eq!(skeleton(content), skeleton(&fixture[1]));
    }
    assert_eq!(skeleton(finish), skeleton(&fixture[fixture.len() - 2]));
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(skeleton(usage), skeleton(&fixture[fixture.len() - 1]));
    assert_eq!(usage["choices"], json!([]));
    let completion_tokens = usage["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(completion_tokens as usize, count - 3);

    // The streamed text equals the non-stream answer for the same request.
    let streamed: String = ours[1..count - 2]
        .iter()
        .map(|content| {
            content["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let (_, full) = post(&sim, CHAT, &chat_body("Tell me about Paris")).await;
    assert_eq!(
        full["choices"][0]["message"]["content"].as_str().unwrap(),
        streamed
    );

    // Without include_usage: no usage chunk.
    body["stream_options"] = json!({"include_usage": false});
    let (_, events) = stream(&sim, CHAT, body).await;
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert!(events.iter().all(|event| !event.contains("\"usage\"")));
    sim.shutdown();
}

#[tokio::test]
async fn completion_stream_and_n_choices() {
    let sim = sim(SimConfig::default()).await;
    let (_, events) = stream(
        &sim,
        "/v1/completions",
        json!({"prompt": "Once upon a time", "max_tokens": 5, "n": 2, "stream": true,
               "stream_options": {"include_usage": true}, "temperature": 0.7, "seed": 3}),
    )
    .await;
    let chunks = json_events(&events);
    let mut finishes = [0, 0];
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(chunk["object"], "text_completion");
        let choice = &chunk["choices"][0];
        if choice["finish_reason"] == "length" {
            finishes[choice["index"].as_u64().unwrap() as usize] += 1;
        }
    }
    assert_eq!(finishes, [1, 1]);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 10);

    let (_, answer) = post(
        &sim,
        CHAT,
        &json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "temperature": 0.5, "seed": 1}),
    )
    .await;
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index as u64);
    }
    assert_ne!(
        choices[0]["message"]["content"],
        choices[1]["message"]["content"]
    );
    sim.shutdown();
}

/// The fixtures are vLLM's answers to a request over max_model_len (8192 tokens).
async fn context_length_error_matches_fixture(sim: &Sim, shape: ErrorShape, fixture: &Value) {
    // 8198 input tokens: a completion prompt of 4 * 8198 bytes, as in the fixtures.
    let prompt = "a".repeat(4 * 8198);
    let (status, body) = post(
        sim,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 512}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(skeleton(&body), skeleton(fixture), "{shape:?}");
    // Same numbers as the fixtures: 8198 input tokens, 512 in the completion.
    assert_eq!(
        error_field(&body, "message"),
        error_field(fixture, "message")
    );
    if shape == ErrorShape::New {
        let fits = "a".repeat(4 * 8000);
        let (_, body) = post(
            sim,
            "/v1/completions",
            &json!({"prompt": fits, "max_tokens": 512}),
        )
        .await;
        assert_eq!(
            body["error"]["message"],
            "'max_tokens' or 'max_completion_tokens' is too large: 512. This model's maximum context length is 8192 tokens and your request has 8000 input tokens (512 > 8192 - 8000)."
        );
    }
}

#[tokio::test]
async fn error_shapes_match_fixtures() {
    for (shape, file) in [
        (ErrorShape::New, "vllm-error-new.json"),
        (ErrorShape::Old, "vllm-error-old.json"),
    ] {
        let sim = sim(SimConfig::default()
            .with_max_model_len(8192)
            .with_error_shape(shape))
        .await;
        let fixture = json_fixture(file);
        context_length_error_matches_fixture(&sim, shape, &fixture).await;
        let (status, body) = post(&sim, CHAT, &json!({"model": "nope", "messages": []})).await;
        assert_eq!(status, 404);
        assert_eq!(
            error_field(&body, "message"),
            "The model `nope` does not exist."
        );
        assert_eq!(error_field(&body, "code"), 404);

        for bad in [
            json!({"model": MODEL}),
            json!({"messages": "x"}),
            json!({"messages": [], "n": "2"}),
        ] {
            let (status, body) = post(&sim, CHAT, &bad).await;
            assert_eq!(status, 400, "{bad}");
            assert_eq!(skeleton(&body), skeleton(&fixture));
        }
        let response = client()
            .post(format!("{}{CHAT}", sim.url()))
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        sim.shutdown();
    }
}

#[tokio::test]
async fn models_health_version() {
    let sim = sim(SimConfig::default()
        .with_model("org/model")
        .with_served_model_names(vec!["alias-a".into(), "alias-b".into()])
        .with_max_model_len(4096))
    .await;
    let models = get_json(&format!("{}/v1/models", sim.url())).await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "alias-a");
    assert_eq!(models["data"][1]["id"], "alias-b");
    assert_eq!(models["data"][0]["root"], "org/model");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    let health = client()
        .get(format!("{}/health", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(health.headers()["vary"], "Origin");
    assert!(health.headers().get("content-type").is_none());
    assert_eq!(health.bytes().await.unwrap().len(), 0);
    // vLLM's /health takes GET alone.
    let head = client()
        .head(format!("{}/health", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(
        (head.status().as_u16(), &head.headers()["allow"]),
        (405, &"GET".parse().unwrap())
    );
    let get_chat = client()
        .get(format!("{}{CHAT}", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(get_chat.status(), 405);
    assert_eq!(get_chat.headers()["allow"], "POST");
    let version = client()
        .get(format!("{}/version", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(version.text().await.unwrap(), r#"{"version":"0.32.0"}"#);
    let old = common::sim(vllm_0_11()).await;
    assert_eq!(
        get_json(&format!("{}/version", old.url())).await,
        json!({"version": "0.11.0"})
    );
    old.shutdown();
    // Alias accepted; the answer names the first served name.
    let (status, answer) = post(
        &sim,
        CHAT,
        &json!({"model": "alias-b", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(answer["model"], "alias-a");
    sim.shutdown();
}

async fn text_of(sim: &Sim, body: Value) -> String {
    let (status, answer) = post(sim, CHAT, &body).await;
    assert_eq!(status, 200, "{answer}");
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn output_is_deterministic() {
    let sim = sim(SimConfig::default()).await;
    let greedy = chat_body("determinism please");
    assert_eq!(
        text_of(&sim, greedy.clone()).await,
        text_of(&sim, greedy.clone()).await
    );
    // Another prompt, another text.
    assert_ne!(
        text_of(&sim, greedy.clone()).await,
        text_of(&sim, chat_body("something else")).await
    );
    // Seeded sampling is reproducible; changing seed or temperature changes the text.
    let mut seeded = greedy.clone();
    seeded["temperature"] = json!(0.8);
    seeded["seed"] = json!(42);
    let seeded_text = text_of(&sim, seeded.clone()).await;
    assert_eq!(seeded_text, text_of(&sim, seeded.clone()).await);
    let mut other_seed = seeded.clone();
    other_seed["seed"] = json!(43);
    assert_ne!(seeded_text, text_of(&sim, other_seed).await);
    let mut other_temperature = seeded.clone();
    other_temperature["temperature"] = json!(0.9);
    assert_ne!(seeded_text, text_of(&sim, other_temperature).await);
    // max_tokens only cuts the same text.
    let mut cut = greedy.clone();
    cut["max_tokens"] = json!(3);
    let short = text_of(&sim, cut).await;
    assert!(text_of(&sim, greedy.clone()).await.starts_with(&short));
    // Unseeded sampling varies between calls.
    let mut unseeded = greedy.clone();
    unseeded["temperature"] = json!(1.0);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        seen.insert(text_of(&sim, unseeded.clone()).await);
    }
    assert!(seen.len() > 1);
    // The answer length is within the documented range.
    let words = text_of(&sim, greedy).await.split_whitespace().count();
    assert!((8..=64).contains(&words));
    sim.shutdown();
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

#[tokio::test]
async fn logprobs_and_low_confidence_share() {
    let sim = sim(SimConfig::default().with_low_confidence_share(0.3)).await;
    let mut low = 0;
    let total = 60;
    for question in 0..total {
        let mut body = chat_body(&format!("question number {question}"));
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(2);
        let (_, answer) = post(&sim, CHAT, &body).await;
        let content = answer["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap();
        let completion_tokens = answer["usage"]["completion_tokens"].as_u64().unwrap() as usize;
        assert_eq!(content.len(), completion_tokens);
        let first = &content[0];
        assert_eq!(
            skeleton(first),
            "{token:s,logprob:n,bytes:[n],top_logprobs:[{token:s,logprob:n,bytes:[n]}]}"
        );
        assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 2);
        let logprobs: Vec<f64> = content
            .iter()
            .map(|token| token["logprob"].as_f64().unwrap())
            .collect();
        if mean(&logprobs) < -2.5 {
            low += 1;
            assert!(
                logprobs
                    .iter()
                    .all(|logprob| (-4.41..=-2.59).contains(logprob)),
                "{logprobs:?}"
            );
        } else {
            assert!(
                logprobs
                    .iter()
                    .all(|logprob| (-0.181..=-0.019).contains(logprob)),
                "{logprobs:?}"
            );
        }
    }
    assert!(
        (8..=30).contains(&low),
        "low-confidence answers: {low} of {total}"
    );

    // Completions-API logprobs shape.
    let (_, answer) = post(
        &sim,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 3, "logprobs": 2}),
    )
    .await;
    let logprobs = &answer["choices"][0]["logprobs"];
    assert_eq!(logprobs["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(logprobs["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(logprobs["text_offset"][0], 0);
    assert_eq!(logprobs["top_logprobs"][0].as_object().unwrap().len(), 2);
    sim.shutdown();
}

#[tokio::test]
async fn stats_record_full_bodies() {
    let sim = sim(SimConfig::default().with_max_model_len(1 << 20)).await;
    let big = "x".repeat(1 << 20);
    let body = serde_json::to_vec(
        &json!({"messages": [{"role": "user", "content": big}], "max_tokens": 1}),
    )
    .unwrap();
    let response = client()
        .post(format!("{}{CHAT}", sim.url()))
        .header("content-type", "application/json")
        .header("x-test", "yes")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let stats = sim.stats();
    assert_eq!(stats.count(CHAT), 1);
    assert_eq!(stats.completed, 1);
    let recorded = stats.recent.last().unwrap();
    assert_eq!(recorded.method, "POST");
    assert_eq!(recorded.path, CHAT);
    assert_eq!(recorded.header("x-test"), Some("yes"));
    assert_eq!(&recorded.body[..], &body[..]);
    let summary = get_json(&format!("{}/sim/stats", sim.url())).await;
    assert_eq!(summary["requests_by_path"][CHAT], 1);
    assert_eq!(summary["recent"][0]["body_len"], body.len());
    assert_eq!(summary["recent"][0]["body_truncated"], true);
    sim.shutdown();
}

/// A completion prompt of exactly `tokens` tokens (4 bytes each).
fn prompt_of(tokens: usize) -> String {
    "abcd".repeat(tokens)
}

/// The body of one of the vLLM 0.32 captures (`tests/fixtures/vllm-0.32/NAME.http`).
fn captured_body(name: &str) -> Value {
    let http = fixture(&format!("vllm-0.32/{name}.http"));
    let body = http
        .split("\r\n\r\n")
        .nth(1)
        .or_else(|| http.split("\n\n").nth(1));
    serde_json::from_str(body.unwrap().trim()).unwrap()
}

/// vLLM 0.32 refuses only a prompt that leaves no room for output, naming `input_tokens`;
/// an answer whose `max_tokens` does not fit runs to the context's end.
#[tokio::test]
async fn vllm_0_32_answers_to_the_context_end_and_refuses_only_a_prompt_that_fills_it() {
    let sim = sim(SimConfig::default()
        .with_max_model_len(2048)
        .with_answer_tokens(300, 300))
    .await;
    let complete = |prompt_tokens: usize, max_tokens: u32| json!({"prompt": prompt_of(prompt_tokens), "max_tokens": max_tokens, "temperature": 0});
    let (status, body) = post(&sim, "/v1/completions", &complete(2049, 10)).await;
    assert_eq!(status, 400);
    let captured = captured_body("err-prompt-too-long-completions");
    assert_eq!(skeleton(&body), skeleton(&captured));
    assert_eq!(body, captured, "the same numbers as the capture");

    let (status, body) = post(&sim, "/v1/completions", &complete(2048, 10)).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "max_tokens");

    // 1,900 prompt tokens and 1,000 asked: 148 generated, stopped by the context.
    let (status, answer) = post(&sim, "/v1/completions", &complete(1900, 1000)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["usage"]["completion_tokens"], 148);
    assert_eq!(answer["usage"]["total_tokens"], 2048);
    sim.shutdown();
}

#[tokio::test]
async fn requests_over_max_model_len_get_vllms_400_before_0_32() {
    let sim = sim(SimConfig::default()
        .with_max_model_len(100)
        .with_error_shape(ErrorShape::New))
    .await;
    let complete = |prompt_tokens: usize, max_tokens: Option<u32>| {
        let mut body = json!({"prompt": prompt_of(prompt_tokens), "temperature": 0});
        if let Some(max_tokens) = max_tokens {
            body["max_tokens"] = json!(max_tokens);
        }
        body
    };
    // prompt + max_tokens == max_model_len still fits.
    let (status, answer) = post(&sim, "/v1/completions", &complete(60, Some(40))).await;
    assert_eq!(status, 200, "{answer}");
    let (status, body) = post(&sim, "/v1/completions", &complete(60, Some(41))).await;
    assert_eq!(status, 400);
    assert_eq!(
        skeleton(&body),
        skeleton(&json_fixture("vllm-error-new.json"))
    );
    assert_eq!(body["error"]["type"], "BadRequestError");
    assert_eq!(
        body["error"]["message"],
        "'max_tokens' or 'max_completion_tokens' is too large: 41. This model's maximum context length is 100 tokens and your request has 60 input tokens (41 > 100 - 60)."
    );
    // Without max_tokens only a prompt that fills the context is refused; a shorter one gets
    // the rest of the context as its budget.
    let (status, body) = post(&sim, "/v1/completions", &complete(100, None)).await;
    assert_eq!(status, 400);
    assert_eq!(
        body["error"]["message"],
        "This model's maximum context length is 100 tokens. However, your request has 100 input tokens. Please reduce the length of the input messages."
    );
    let (status, answer) = post(&sim, "/v1/completions", &complete(99, None)).await;
    assert_eq!(status, 200);
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    // Chat counts its template and takes max_completion_tokens; a stream is refused before it
    // starts, with a plain JSON error.
    let chat = json!({"messages": [{"role": "user", "content": "x".repeat(4 * 50 - 16)}],
                      "max_completion_tokens": 51, "stream": true});
    let response = send(&sim, CHAT, &chat).await;
    assert_eq!(response.status(), 400);
    assert_eq!(response.headers()["content-type"], "application/json");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["error"]["message"],
        "'max_tokens' or 'max_completion_tokens' is too large: 51. This model's maximum context length is 100 tokens and your request has 50 input tokens (51 > 100 - 50)."
    );
    assert_eq!(sim.stats().completed, 2);
    sim.shutdown();
}

#[tokio::test]
async fn max_model_len_errors_in_the_old_shape() {
    let sim = sim(SimConfig::default()
        .with_max_model_len(100)
        .with_error_shape(ErrorShape::Old))
    .await;
    let (status, body) = post(
        &sim,
        "/v1/completions",
        &json!({"prompt": prompt_of(60), "max_tokens": 41}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        skeleton(&body),
        skeleton(&json_fixture("vllm-error-old.json"))
    );
    assert_eq!(
        body["message"],
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens (60 in the messages, 41 in the completion). Please reduce the length of the messages or completion."
    );
    let (status, body) = post(&sim, "/v1/completions", &json!({"prompt": prompt_of(100)})).await;
    assert_eq!(status, 400);
    assert_eq!(
        body["message"],
        "This model's maximum context length is 100 tokens. However, you requested 100 tokens in the messages, Please reduce the length of the messages."
    );
    sim.shutdown();
}

#[test]
fn max_model_len_defaults_per_profile() {
    use vllm_sim::Profile;
    assert_eq!(SimConfig::default().max_model_len, 32768);
    assert_eq!(SimConfig::profile(Profile::Draft).max_model_len, 8192);
    assert_eq!(SimConfig::profile(Profile::Target).max_model_len, 32768);
}

/// vLLM makes the client's `X-Request-Id` the answer's id (without echoing the header); chat
/// takes the body's `request_id` when there is no header. Otherwise ids are 16 hex digits.
#[tokio::test]
async fn x_request_id_names_the_answer() {
    let sim = sim(SimConfig::default()).await;
    let ask = |path: &'static str, body: Value, id: Option<&'static str>| {
        let mut request = client().post(format!("{}{path}", sim.url())).json(&body);
        if let Some(id) = id {
            request = request.header("X-Request-Id", id);
        }
        async move {
            let response = request.send().await.unwrap();
            assert!(response.headers().get("x-request-id").is_none());
            response.text().await.unwrap()
        }
    };
    let chat = ask(CHAT, chat_body("hi"), Some("rid-1")).await;
    assert_eq!(
        serde_json::from_str::<Value>(&chat).unwrap()["id"],
        "chatcmpl-rid-1"
    );
    let completion = json!({"prompt": "hi", "max_tokens": 3});
    let text = ask("/v1/completions", completion.clone(), Some("rid-2")).await;
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["id"],
        "cmpl-rid-2"
    );
    let stream = ask(CHAT, streaming(chat_body("hi")), Some("rid-3")).await;
    for event in json_events(&sse_events(&stream)) {
        assert_eq!(event["id"], "chatcmpl-rid-3");
    }
    let mut named = chat_body("hi");
    named["request_id"] = json!("from-body");
    let chat = ask(CHAT, named, None).await;
    assert_eq!(
        serde_json::from_str::<Value>(&chat).unwrap()["id"],
        "chatcmpl-from-body"
    );
    let text = ask("/v1/completions", completion, None).await;
    let id = serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let digits = id.strip_prefix("cmpl-").unwrap();
    assert!(
        digits.len() == 16 && digits.chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    sim.shutdown();
}

/// A natural end is vLLM 0.32's EOS token: counted, no text, `stop_reason` its id, and in a
/// stream an empty last chunk; `max_tokens` cuts with `length` on the last token's chunk.
#[tokio::test]
async fn eos_and_length_as_vllm_0_32_ends_answers() {
    let sim = sim(SimConfig::default().with_answer_tokens(10, 10)).await;
    let (_, whole) = post(&sim, CHAT, &chat_body("the end")).await;
    let choice = &whole["choices"][0];
    assert_eq!(
        (&choice["finish_reason"], &choice["stop_reason"]),
        (&json!("stop"), &json!(128009))
    );
    assert_eq!(whole["usage"]["completion_tokens"], 10);
    // Nine words: the tenth token is the EOS.
    let content = choice["message"]["content"].as_str().unwrap();
    assert_eq!(content.split_whitespace().count(), 9);

    let (_, events) = stream(&sim, CHAT, streaming(chat_body("the end"))).await;
    let events = json_events(&events);
    let last = &events[events.len() - 1]["choices"][0];
    assert_eq!(last["delta"], json!({"content": ""}));
    assert_eq!(
        (&last["finish_reason"], &last["stop_reason"]),
        (&json!("stop"), &json!(128009))
    );
    assert!(events[events.len() - 1].get("system_fingerprint").is_some());
    let streamed: String = events
        .iter()
        .filter_map(|event| event["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);

    let mut cut = streaming(chat_body("the end"));
    cut["max_tokens"] = json!(4);
    let (_, events) = stream(&sim, CHAT, cut).await;
    let events = json_events(&events);
    assert_eq!(
        events.len(),
        1 + 4,
        "role, then a chunk per token: {events:?}"
    );
    let last = &events[4]["choices"][0];
    assert_eq!(
        (&last["finish_reason"], &last["stop_reason"]),
        (&json!("length"), &Value::Null)
    );
    assert_ne!(last["delta"]["content"], "");

    // Completions too: the last chunk carries it, after the EOS with no text.
    let (_, events) = stream(
        &sim,
        "/v1/completions",
        json!({"prompt": "the end", "stream": true, "temperature": 0}),
    )
    .await;
    let events = json_events(&events);
    let last = &events[events.len() - 1]["choices"][0];
    assert_eq!(
        (&last["text"], &last["stop_reason"]),
        (&json!(""), &json!(128009))
    );
    sim.shutdown();
}

/// A stop string ends the answer at the token that completes it; the text stops before it,
/// and `stop_reason` is the string. Streams hold back what could begin a stop string.
#[tokio::test]
async fn stop_strings_end_the_answer() {
    let sim = sim(SimConfig::default().with_answer_tokens(60, 60)).await;
    let (_, whole) = post(&sim, CHAT, &chat_body("stop here")).await;
    let text = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    // Stop at the fourth word's text, which a later token could not have started earlier.
    let stop = words[4].trim().to_string();
    let start = text.find(&stop).unwrap();
    for streamed in [false, true] {
        let mut body = chat_body("stop here");
        body["stop"] = json!(["never-there", stop]);
        body["stream"] = json!(streamed);
        let (content, choice) = if streamed {
            let (_, events) = stream(&sim, CHAT, body).await;
            let events = json_events(&events);
            let content: String = events
                .iter()
                .filter_map(|event| event["choices"][0]["delta"]["content"].as_str())
                .collect();
            (content, events[events.len() - 1]["choices"][0].clone())
        } else {
            let (_, answer) = post(&sim, CHAT, &body).await;
            let choice = answer["choices"][0].clone();
            (
                choice["message"]["content"].as_str().unwrap().to_string(),
                choice,
            )
        };
        assert_eq!(content, text[..start], "streamed: {streamed}");
        assert_eq!(
            (&choice["finish_reason"], &choice["stop_reason"]),
            (&json!("stop"), &json!(stop))
        );
    }
    sim.shutdown();
}
