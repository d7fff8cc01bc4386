//! Wire shapes against shared/fixtures, errors, models, health, determinism, logprobs.

mod common;

use common::*;
use serde_json::{json, Value};
use vllm_sim::{ErrorShape, SimConfig};

#[tokio::test]
async fn chat_completion_matches_fixture_shape() {
    let sim = sim(SimConfig::default()).await;
    let (status, v) = post(
        &sim,
        "/v1/chat/completions",
        &chat_body("What is the capital of France?"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let fixture: Value = serde_json::from_str(&fixture("vllm-chat-completion.json")).unwrap();
    assert_eq!(skeleton(&v), skeleton(&fixture));
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "meta-llama/Llama-3.1-8B-Instruct");
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    sim.shutdown();
}

#[tokio::test]
async fn completion_matches_fixture_shape_and_content_length() {
    let sim = sim(SimConfig::default()).await;
    let r = client()
        .post(format!("{}/v1/completions", sim.url()))
        .json(&json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let len: usize = r.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = r.bytes().await.unwrap();
    assert_eq!(len, body.len());
    let v: Value = serde_json::from_slice(&body).unwrap();
    let fixture: Value = serde_json::from_str(&fixture("vllm-completion.json")).unwrap();
    assert_eq!(skeleton(&v), skeleton(&fixture));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    // "The capital of France is" = 24 bytes -> 6 tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    sim.shutdown();
}

async fn stream(
    sim: &vllm_sim::Sim,
    path: &str,
    body: Value,
) -> (reqwest::header::HeaderMap, Vec<String>) {
    let r = client()
        .post(format!("{}{path}", sim.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let headers = r.headers().clone();
    let text = r.text().await.unwrap();
    (headers, sse_events(&text))
}

#[tokio::test]
async fn chat_stream_event_sequence_matches_fixture() {
    let sim = sim(SimConfig::default()).await;
    let mut body = chat_body("Tell me about Paris");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (headers, events) = stream(&sim, "/v1/chat/completions", body.clone()).await;
    assert_eq!(headers["content-type"], "text/event-stream; charset=utf-8");
    assert_eq!(headers["transfer-encoding"], "chunked");
    assert!(headers.get("content-length").is_none());

    let fx: Vec<String> = sse_events(&fixture("vllm-chat-stream.sse"));
    let fxv: Vec<Value> = fx[..fx.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let ours: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(events.last().unwrap(), "[DONE]");
    // role chunk, content chunks, finish chunk, usage chunk
    assert_eq!(skeleton(&ours[0]), skeleton(&fxv[0]));
    assert_eq!(
        ours[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let n = ours.len();
    for c in &ours[1..n - 2] {
        assert_eq!(skeleton(c), skeleton(&fxv[1]));
    }
    assert_eq!(skeleton(&ours[n - 2]), skeleton(&fxv[fxv.len() - 2]));
    assert_eq!(ours[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(skeleton(&ours[n - 1]), skeleton(&fxv[fxv.len() - 1]));
    assert_eq!(ours[n - 1]["choices"], json!([]));
    let completion_tokens = ours[n - 1]["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(completion_tokens as usize, n - 3);

    // The streamed text equals the non-stream answer for the same request.
    let streamed: String = ours[1..n - 2]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let (_, full) = post(
        &sim,
        "/v1/chat/completions",
        &chat_body("Tell me about Paris"),
    )
    .await;
    assert_eq!(
        full["choices"][0]["message"]["content"].as_str().unwrap(),
        streamed
    );

    // Without include_usage: no usage chunk.
    body["stream_options"] = json!({"include_usage": false});
    let (_, events) = stream(&sim, "/v1/chat/completions", body).await;
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));
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
    let vs: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut finishes = [0, 0];
    for v in &vs[..vs.len() - 1] {
        assert_eq!(v["object"], "text_completion");
        let c = &v["choices"][0];
        if c["finish_reason"] == "length" {
            finishes[c["index"].as_u64().unwrap() as usize] += 1;
        }
    }
    assert_eq!(finishes, [1, 1]);
    assert_eq!(vs.last().unwrap()["usage"]["completion_tokens"], 10);

    let (_, v) = post(&sim, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "temperature": 0.5, "seed": 1})).await;
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i as u64);
    }
    assert_ne!(
        choices[0]["message"]["content"],
        choices[1]["message"]["content"]
    );
    sim.shutdown();
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
        let fx: Value = serde_json::from_str(&fixture(file)).unwrap();
        // 8198 input tokens: 32768 bytes + 16 template bytes... use a completion prompt of 4*8198 bytes.
        let prompt = "a".repeat(4 * 8198);
        let (status, v) = post(
            &sim,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 512}),
        )
        .await;
        assert_eq!(status, 400);
        assert_eq!(skeleton(&v), skeleton(&fx), "{shape:?}");
        let msg = if shape == ErrorShape::New {
            v["error"]["message"].clone()
        } else {
            v["message"].clone()
        };
        let fx_msg = if shape == ErrorShape::New {
            fx["error"]["message"].clone()
        } else {
            fx["message"].clone()
        };
        // Same numbers as the fixtures: 8198 input tokens, 512 in the completion.
        assert_eq!(msg, fx_msg);
        if shape == ErrorShape::New {
            let fits = "a".repeat(4 * 8000);
            let (_, v2) = post(
                &sim,
                "/v1/completions",
                &json!({"prompt": fits, "max_tokens": 512}),
            )
            .await;
            assert_eq!(
                v2["error"]["message"],
                "'max_tokens' or 'max_completion_tokens' is too large: 512. This model's maximum context length is 8192 tokens and your request has 8000 input tokens (512 > 8192 - 8000)."
            );
        }

        let (status, v) = post(
            &sim,
            "/v1/chat/completions",
            &json!({"model": "nope", "messages": []}),
        )
        .await;
        assert_eq!(status, 404);
        let m = if shape == ErrorShape::New {
            &v["error"]["message"]
        } else {
            &v["message"]
        };
        assert_eq!(m, "The model `nope` does not exist.");
        let code = if shape == ErrorShape::New {
            &v["error"]["code"]
        } else {
            &v["code"]
        };
        assert_eq!(code, 404);

        for bad in [
            json!({"model": "meta-llama/Llama-3.1-8B-Instruct"}),
            json!({"messages": "x"}),
            json!({"messages": [], "n": "2"}),
        ] {
            let (status, v) = post(&sim, "/v1/chat/completions", &bad).await;
            assert_eq!(status, 400, "{bad}");
            assert_eq!(skeleton(&v), skeleton(&fx));
        }
        let r = client()
            .post(format!("{}/v1/chat/completions", sim.url()))
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
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
    let c = client();
    let v: Value = c
        .get(format!("{}/v1/models", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "alias-a");
    assert_eq!(v["data"][1]["id"], "alias-b");
    assert_eq!(v["data"][0]["root"], "org/model");
    assert_eq!(v["data"][0]["max_model_len"], 4096);
    assert_eq!(v["data"][0]["owned_by"], "vllm");
    let r = c.get(format!("{}/health", sim.url())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().len(), 0);
    let r = c
        .get(format!("{}/version", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), r#"{"version":"0.11.0"}"#);
    // Alias accepted; the answer names the first served name.
    let (s, v) = post(
        &sim,
        "/v1/chat/completions",
        &json!({"model": "alias-b", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["model"], "alias-a");
    sim.shutdown();
}

async fn text_of(sim: &vllm_sim::Sim, body: Value) -> String {
    let (s, v) = post(sim, "/v1/chat/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn output_is_deterministic() {
    let sim = sim(SimConfig::default()).await;
    let b = chat_body("determinism please");
    assert_eq!(
        text_of(&sim, b.clone()).await,
        text_of(&sim, b.clone()).await
    );
    // Another prompt, another text.
    assert_ne!(
        text_of(&sim, b.clone()).await,
        text_of(&sim, chat_body("something else")).await
    );
    // Seeded sampling is reproducible; changing seed or temperature changes the text.
    let mut s1 = b.clone();
    s1["temperature"] = json!(0.8);
    s1["seed"] = json!(42);
    let t1 = text_of(&sim, s1.clone()).await;
    assert_eq!(t1, text_of(&sim, s1.clone()).await);
    let mut s2 = s1.clone();
    s2["seed"] = json!(43);
    assert_ne!(t1, text_of(&sim, s2).await);
    let mut s3 = s1.clone();
    s3["temperature"] = json!(0.9);
    assert_ne!(t1, text_of(&sim, s3).await);
    // max_tokens only cuts the same text.
    let mut cut = b.clone();
    cut["max_tokens"] = json!(3);
    let short = text_of(&sim, cut).await;
    assert!(text_of(&sim, b.clone()).await.starts_with(&short));
    // Unseeded sampling varies between calls.
    let mut r = b.clone();
    r["temperature"] = json!(1.0);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        seen.insert(text_of(&sim, r.clone()).await);
    }
    assert!(seen.len() > 1);
    // The answer length is within the documented range.
    let words = text_of(&sim, b).await.split_whitespace().count();
    assert!((8..=64).contains(&words));
    sim.shutdown();
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[tokio::test]
async fn logprobs_and_low_confidence_share() {
    let sim = sim(SimConfig::default().with_low_confidence_share(0.3)).await;
    let mut low = 0;
    let total = 60;
    for i in 0..total {
        let mut b = chat_body(&format!("question number {i}"));
        b["logprobs"] = json!(true);
        b["top_logprobs"] = json!(2);
        let (_, v) = post(&sim, "/v1/chat/completions", &b).await;
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        let n_tokens = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
        assert_eq!(content.len(), n_tokens);
        let first = &content[0];
        assert_eq!(
            skeleton(first),
            "{token:s,logprob:n,bytes:[n],top_logprobs:[{token:s,logprob:n,bytes:[n]}]}"
        );
        assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 2);
        let lps: Vec<f64> = content
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        let m = mean(&lps);
        if m < -2.5 {
            low += 1;
            assert!(lps.iter().all(|x| (-4.41..=-2.59).contains(x)), "{lps:?}");
        } else {
            assert!(lps.iter().all(|x| (-0.181..=-0.019).contains(x)), "{lps:?}");
        }
    }
    assert!(
        (8..=30).contains(&low),
        "low-confidence answers: {low} of {total}"
    );

    // Completions-API logprobs shape.
    let (_, v) = post(
        &sim,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 3, "logprobs": 2}),
    )
    .await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
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
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .header("content-type", "application/json")
        .header("x-test", "yes")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let s = sim.stats();
    assert_eq!(s.count("/v1/chat/completions"), 1);
    assert_eq!(s.completed, 1);
    let rec = s.recent.last().unwrap();
    assert_eq!(rec.method, "POST");
    assert_eq!(rec.path, "/v1/chat/completions");
    assert_eq!(rec.header("x-test"), Some("yes"));
    assert_eq!(&rec.body[..], &body[..]);
    let v: Value = client()
        .get(format!("{}/sim/stats", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["requests_by_path"]["/v1/chat/completions"], 1);
    assert_eq!(v["recent"][0]["body_len"], body.len());
    assert_eq!(v["recent"][0]["body_truncated"], true);
    sim.shutdown();
}
