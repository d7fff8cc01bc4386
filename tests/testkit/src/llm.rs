//! The LLM side of a test: request bodies, answers as a test reads them, simulators.

use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// An HTTP client with a bound on every request, so that a hang fails the test.
pub fn client() -> reqwest::Client {
    client_within(Duration::from_secs(30))
}

/// [`client`] with another bound on every request.
pub fn client_within(bound: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(bound)
        .build()
        .expect("client")
}

/// A chat request body: deterministic (temperature 0), at most 16 tokens.
pub fn chat(model: &str, content: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "temperature": 0,
        "max_tokens": 16,
    })
}

/// Parses an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// The JSON events of an SSE answer before its `[DONE]`, which it must end with.
pub fn sse_events(answer: &Answer) -> Vec<serde_json::Value> {
    let data = sse_data(&answer.body);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        answer.body
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// Asserts that an SSE body cut by its upstream ends as Sluice ends it: at least
/// `events_before` events, then an OpenAI error event, then `[DONE]`.
pub fn assert_ends_with_error_event(body: &str, events_before: usize) {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let error: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(error["error"]["message"].is_string(), "{body}");
    assert!(
        data.len() >= events_before + 2,
        "the events before the failure arrived: {body}"
    );
}

/// An LLM answer as a test sees it.
pub struct Answer {
    pub status: u16,
    /// The `x-cache` header, or empty.
    pub x_cache: String,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

/// POSTs `body` as JSON to `url` with extra `headers`.
pub async fn ask_url(url: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    ask_url_with(&client(), url, body, headers).await
}

/// [`ask_url`] with a client of the caller's (a real engine's first requests on busy cores
/// take longer than [`client`]'s bound).
pub async fn ask_url_with(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = client.post(url).json(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let r = request.send().await.expect("the proxy answers");
    let headers = r.headers().clone();
    Answer {
        status: r.status().as_u16(),
        x_cache: headers
            .get("x-cache")
            .map(|v| v.to_str().unwrap_or_default().to_string())
            .unwrap_or_default(),
        body: r.text().await.unwrap_or_default(),
        headers,
    }
}

/// The answer's text, from a JSON body or an event stream.
pub fn content(answer: &Answer) -> String {
    if answer.body.starts_with("data: ") {
        sse_data(&answer.body)
            .iter()
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            })
            .collect()
    } else {
        let v: Value = serde_json::from_str(&answer.body).expect("a JSON answer");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// The chat completions a simulator was asked for: how many requests reached the upstream.
pub fn upstream_calls(sim: &vllm_sim::Sim) -> u64 {
    sim.stats().count("/v1/chat/completions")
}

/// A simulated backend serving `model`, with the simulator's defaults otherwise.
pub async fn sim_serving(model: &str) -> vllm_sim::Sim {
    vllm_sim::start(vllm_sim::SimConfig::default().with_model(model))
        .await
        .expect("start the simulator")
}

/// A simulated backend that answers `tokens` tokens, one every `every`, with no prefill
/// time: for tests that need a stream to still be running.
pub async fn streaming_sim(model: &str, every: Duration, tokens: u32) -> vllm_sim::Sim {
    vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_model(model)
            .with_latency(vllm_sim::Latency::new(
                Duration::ZERO,
                Duration::ZERO,
                every,
            ))
            .with_answer_tokens(tokens, tokens),
    )
    .await
    .expect("start the simulator")
}

/// The mean token log-probability of a simulator's own answer to `content` (16 tokens at
/// temperature 0), asked directly: whether it is one the simulator marks low-confidence.
pub async fn answer_confidence(sim: &vllm_sim::Sim, model: &str, content: &str) -> f64 {
    let body = json!({"model": model, "messages": [{"role": "user", "content": content}],
                      "temperature": 0, "logprobs": true, "max_tokens": 16});
    let v: Value = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&body)
        .send()
        .await
        .expect("the simulator answers")
        .json()
        .await
        .expect("a JSON answer");
    let lps: Vec<f64> = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .filter_map(|t| t["logprob"].as_f64())
        .collect();
    lps.iter().sum::<f64>() / lps.len() as f64
}

/// Polls `check` every 50 ms until it is true or `limit` has passed; returns how long it took.
pub async fn wait_for<F, Fut>(limit: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}
