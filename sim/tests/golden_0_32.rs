#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The simulator against real vLLM 0.32.0 answers, shape by shape
//! (`tests/fixtures/vllm-0.32/`, see its README.md).
//!
//! Each capture's request (`NAME.req.json`, or one built here when the capture has none) goes
//! to a simulator configured as the capture server was (served name `tiny-draft`, context
//! 2048), and the answer is compared with the capture: status, content type and header names;
//! for JSON the skeleton (every field name, in order, and its JSON type, recursively; `null`
//! differs from a number or a string); for streams the sequence of event kinds per choice,
//! where the usage chunk and the fingerprint go, and the skeleton of each kind; for errors
//! the type, param, code and message; for /metrics the families with their types and label
//! sets. A field added, removed or retyped on either side fails a test.
//!
//! What the simulator cannot answer is listed in `SKIPPED` with the reason, and
//! `every_capture_is_compared_or_skipped` makes sure a new capture is not silently ignored.
//!
//! The sim answers with 100 tokens unless cut, so every capture's `max_tokens` (at most 64)
//! cuts it, as it cut the tiny model: the same finish path, hence the same `null`s. The EOS
//! captures get `max_tokens` the sim's answer ends before.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use reqwest::header::HeaderMap;
use serde_json::{json, Value};
use vllm_sim::{Faults, Sim, SimConfig};

const DIR: &str = "vllm-0.32";

/// Captures compared here, by the test that compares them.
const JSON_ANSWERS: &[&str] = &[
    "chat-best-of",
    "chat-contentparts",
    "chat-json-schema",
    "chat-logprobs",
    "chat-maxcompletion",
    "chat-n2",
    "chat-nomodel",
    "chat-nonstream",
    "chat-seed",
    "chat-stop",
    "chat-tools-none",
    "completion-echo",
    "completion-logprobs",
    "completion-nonstream",
    "completion-tokenids",
    "err-wrong-content-type",
    "prompt-plus-max-tokens-1000-stream-false",
    "prompt-plus-max-tokens-2000-stream-false",
    "prompt-plus-max-tokens-2000-ignore-eos",
];

const STREAMS: &[&str] = &[
    "chat-logprobs-stream",
    "chat-n2-stream",
    "chat-stream-continuous-usage",
    "chat-stream-nousage",
    "chat-stream-stop-string",
    "chat-stream-usage",
    "completion-n2-stream",
    "completion-stream-usage",
    "prompt-plus-max-tokens-1000-stream-true",
    "prompt-plus-max-tokens-2000-stream-true",
];

const ERRORS: &[&str] = &[
    "err-bad-json",
    "err-bad-json-completions",
    "err-empty-messages",
    "err-max-tokens-string",
    "err-max-tokens-too-large",
    "err-max-tokens-too-large-stream",
    "err-max-tokens-zero",
    "err-missing-messages",
    "err-n-zero",
    "err-not-object",
    "err-prompt-equals-max-model-len",
    "err-prompt-too-long",
    "err-prompt-too-long-chars",
    "err-prompt-too-long-completions",
    "err-prompt-too-long-nomax",
    "err-prompt-too-long-stream",
    "err-stream-options-nostream",
    "err-temperature",
    "err-top-logprobs-nologprobs",
    "err-top-logprobs-too-many",
    "err-unknown-model",
    "err-unknown-model-completions",
    "err-unknown-model-stream",
];

/// Compared in `other_endpoints_match_the_captures`, `metrics_match_the_captures` and
/// `a_stream_error_event_is_written_as_captured`.
const OTHERS: &[&str] = &[
    // `embeddings_match_the_captures`:
    "embeddings",
    "embeddings-too-long",
    "err-embeddings",
    "err-embeddings-get",
    "err-get-chat",
    "err-not-found",
    "health",
    "health-head",
    "models",
    "models-target",
    "version",
    "metrics-idle",
    "metrics-after",
    "stream-error-inside-200-grammar",
    // `anthropic_messages_match_the_captures`:
    "messages",
    "messages-stream",
    "messages-count-tokens",
    // `responses_match_the_captures`:
    "responses",
    "responses-stream",
    // `tokenize_and_detokenize_match_the_captures`:
    "tokenize",
    "tokenize-chat",
    "detokenize",
];

/// Captures the simulator cannot answer, and why.
const SKIPPED: &[(&str, &str)] = &[
    ("chat-render", "/v1/chat/completions/render (scale-out endpoints) is not simulated"),
    ("chat-tools-auto", "refusal of a server without a tool parser; the sim takes tools (as if --enable-auto-tool-choice) and never calls one"),
    ("chat-tools-choice-auto", "as chat-tools-auto"),
    ("chat-tools-named", "as chat-tools-auto"),
    ("chat-tools-named-stream", "as chat-tools-auto"),
    ("chat-tools-required", "as chat-tools-auto"),
    ("target-chat-tool-call-forced-stream-false", "tool calls are not simulated"),
    ("target-chat-tool-call-forced-stream-true", "tool calls are not simulated"),
    ("target-chat-tools-auto", "tool calls are not simulated"),
    ("target-chat-tools-named", "tool calls are not simulated"),
    ("target-chat-tools-named-stream", "tool calls are not simulated (their streams end with \"delta\":{})"),
    ("target-chat-tools-required", "tool calls are not simulated"),
    ("err-grammar-nonstream", "structured outputs (grammars) are not simulated"),
    ("invocations", "/invocations is not simulated"),
    ("load", "/load is not simulated"),
    ("ping", "/ping is not simulated"),
    ("ping-post", "/ping is not simulated"),
    ("openapi", "/openapi.json is not simulated"),
    ("metrics-target-lora-enabled", "LoRA and tool-parser metrics are not simulated"),
];

/// Metric families of the captures the simulator does not serve: the process's, Python's and
/// the HTTP middleware's, and the FLOPs estimates (0 on the capture's CPU as on any server
/// without MFU metrics). Every other family must be there, with the same type.
const METRICS_NOT_SIMULATED: &[&str] = &[
    "http_request_duration_highr_seconds",
    "http_request_duration_highr_seconds_created",
    "http_request_duration_seconds",
    "http_request_duration_seconds_created",
    "http_request_size_bytes",
    "http_request_size_bytes_created",
    "http_requests_created",
    "http_requests_total",
    "http_response_size_bytes",
    "http_response_size_bytes_created",
    "process_cpu_seconds_total",
    "process_max_fds",
    "process_open_fds",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_virtual_memory_bytes",
    "python_gc_collections_total",
    "python_gc_objects_collected_total",
    "python_gc_objects_uncollectable_total",
    "python_info",
    "vllm:estimated_flops_per_gpu_created",
    "vllm:estimated_flops_per_gpu_total",
    "vllm:estimated_read_bytes_per_gpu_created",
    "vllm:estimated_read_bytes_per_gpu_total",
    "vllm:estimated_write_bytes_per_gpu_created",
    "vllm:estimated_write_bytes_per_gpu_total",
];

/// A simulator set up as the capture's draft server: `tiny-draft`, context 2048.
async fn draft_sim() -> Sim {
    sim(SimConfig::default()
        .with_model("/models/tiny-llama-draft")
        .with_served_model_names(vec!["tiny-draft".into()])
        .with_max_model_len(2048)
        .with_answer_tokens(100, 100))
    .await
}

// ---------------------------------------------------------------------------------------
// Captures

/// One capture: the raw answer and the request sent, if any.
struct Capture {
    name: String,
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Capture {
    fn load(name: &str) -> Capture {
        let raw = std::fs::read(format!("{FIXTURES}/{DIR}/{name}.http"))
            .unwrap_or_else(|error| panic!("capture {name}: {error}"));
        let split = find(&raw, b"\r\n\r\n").expect("a header block");
        let head = String::from_utf8(raw[..split].to_vec()).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .map(|line| {
                let (name, value) = line.split_once(": ").unwrap();
                (name.to_ascii_lowercase(), value.to_string())
            })
            .collect();
        let mut body = raw[split + 4..].to_vec();
        let chunked = headers
            .iter()
            .any(|(name, value)| name == "transfer-encoding" && value == "chunked");
        // Most streams were recorded with their chunk framing; take it off.
        if chunked && !body.starts_with(b"data:") {
            body = dechunk(&body);
        }
        Capture {
            name: name.to_string(),
            status,
            headers,
            body,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| value.as_str())
    }

    fn header_names(&self) -> BTreeSet<String> {
        self.headers.iter().map(|(name, _)| name.clone()).collect()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|error| panic!("{}: body is not JSON: {error}", self.name))
    }

    fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap()
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = find(body, b"\r\n").expect("chunk size line");
        let size = usize::from_str_radix(std::str::from_utf8(&body[..line_end]).unwrap(), 16)
            .expect("hex chunk size");
        body = &body[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

/// The request a capture was made with: `NAME.req.json` as sent (its trailing newline is
/// the file's, not the request's), or one built here for captures without it.
fn request_of(name: &str) -> Vec<u8> {
    match name {
        // About 1,207 prompt tokens, as in the captures: the sim counts (4,812 + 16) / 4.
        "prompt-plus-max-tokens-1000-stream-false" => long_chat(1000, false, false),
        "prompt-plus-max-tokens-1000-stream-true" => long_chat(1000, true, false),
        "prompt-plus-max-tokens-2000-stream-false" => long_chat(2000, false, false),
        "prompt-plus-max-tokens-2000-stream-true" => long_chat(2000, true, false),
        "prompt-plus-max-tokens-2000-ignore-eos" => long_chat(2000, false, true),
        // 257 tokens at the sim's four bytes a token: the capture's count.
        "embeddings-too-long" => {
            serde_json::to_vec(&json!({"model": "all-MiniLM-L6-v2", "input": "abcd".repeat(257)}))
                .unwrap()
        }
        // A prompt of 220,048 characters, the capture's count.
        "err-prompt-too-long-chars" => serde_json::to_vec(
            &json!({"model": "tiny-draft", "prompt": "a".repeat(220_048), "max_tokens": 4}),
        )
        .unwrap(),
        _ => {
            let raw = std::fs::read(format!("{FIXTURES}/{DIR}/{name}.req.json"))
                .unwrap_or_else(|error| panic!("request of {name}: {error}"));
            let sent = raw.strip_suffix(b"\n").unwrap_or(&raw);
            sent.strip_suffix(b"\r").unwrap_or(sent).to_vec()
        }
    }
}

fn long_chat(max_tokens: u32, stream: bool, ignore_eos: bool) -> Vec<u8> {
    let mut body = json!({"model": "tiny-draft", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "word ".repeat(962) + "ab"}]});
    if stream {
        body["stream"] = json!(true);
    }
    if ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    serde_json::to_vec(&body).unwrap()
}

/// The endpoint a capture's request went to.
fn path_of(request: &[u8]) -> &'static str {
    let text = String::from_utf8_lossy(request);
    if text.contains("\"prompt\"") {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    }
}

/// The simulator's answer to a capture's request.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn content_type(&self) -> Option<&str> {
        self.headers
            .get("content-type")
            .map(|value| value.to_str().unwrap())
    }

    fn header_names(&self) -> BTreeSet<String> {
        self.headers.keys().map(|name| name.to_string()).collect()
    }

    fn json(&self, name: &str) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|error| {
            panic!(
                "{name}: the sim's body is not JSON ({error}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap()
    }
}

async fn ask(sim: &Sim, name: &str) -> Answer {
    ask_at(sim, path_of(&request_of(name)), name).await
}

/// The simulator's answer to a capture's request sent to `path`.
async fn ask_at(sim: &Sim, path: &str, name: &str) -> Answer {
    // The capture sent this one as text/plain, which vLLM ignores.
    let content_type = if name == "err-wrong-content-type" {
        "text/plain"
    } else {
        "application/json"
    };
    let response = client()
        .post(format!("{}{path}", sim.url()))
        .header("content-type", content_type)
        .body(request_of(name))
        .send()
        .await
        .unwrap();
    answer_of(response).await
}

async fn answer_of(response: reqwest::Response) -> Answer {
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.bytes().await.unwrap().to_vec(),
    }
}

/// Status, content type, header names and the fixed header values.
fn same_head(capture: &Capture, answer: &Answer, differences: &mut Vec<String>) {
    let name = &capture.name;
    if capture.status != answer.status {
        differences.push(format!(
            "{name}: status {} (vLLM {}): {}",
            answer.status,
            capture.status,
            String::from_utf8_lossy(&answer.body)
        ));
    }
    if capture.header("content-type") != answer.content_type() {
        differences.push(format!(
            "{name}: content-type {:?} (vLLM {:?})",
            answer.content_type(),
            capture.header("content-type")
        ));
    }
    if capture.header_names() != answer.header_names() {
        differences.push(format!(
            "{name}: headers {:?} (vLLM {:?})",
            answer.header_names(),
            capture.header_names()
        ));
    }
    for fixed in ["server", "vary", "allow"] {
        let ours = answer.headers.get(fixed).map(|v| v.to_str().unwrap());
        if capture.header(fixed) != ours {
            differences.push(format!(
                "{name}: {fixed}: {ours:?} (vLLM {:?})",
                capture.header(fixed)
            ));
        }
    }
}

/// Notes a difference when the simulator's JSON `ours` is not shaped as vLLM's.
fn compare_shapes(name: &str, vllm: &Value, ours: &Value, differences: &mut Vec<String>) {
    if shape(vllm) != shape(ours) {
        differences.push(format!(
            "{name}: shape\n  sim:  {}\n  vLLM: {}",
            shape(ours),
            shape(vllm)
        ));
    }
}

/// Notes a difference when the simulator's `ours` is not vLLM's (a stream's events).
fn compare<T: PartialEq + std::fmt::Debug>(
    what: &str,
    vllm: &T,
    ours: &T,
    differences: &mut Vec<String>,
) {
    if vllm != ours {
        differences.push(format!("{what}\n  sim:  {ours:?}\n  vLLM: {vllm:?}"));
    }
}

fn check(differences: Vec<String>) {
    assert!(
        differences.is_empty(),
        "{} difference(s) from vLLM 0.32:\n{}",
        differences.len(),
        differences.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Shapes

/// Every field name (in order) and JSON type, recursively; an array by the distinct
/// skeletons of its elements. `null` is its own type: a field that is `null` in one answer
/// and a number in the other is a difference (the requests are chosen so that the sim
/// takes the path vLLM took, where vLLM's own nulls do not vary).
fn shape(value: &Value) -> String {
    skeleton(&tokens_as_keys(value, ""))
}

/// Completions' `top_logprobs` are objects keyed by token: their shape is one key, `<token>`,
/// per kind of value.
fn tokens_as_keys(value: &Value, key: &str) -> Value {
    match value {
        Value::Object(fields) if key == "top_logprobs[]" && !fields.contains_key("token") => {
            let mut keyed = serde_json::Map::new();
            for field in fields.values() {
                keyed.insert("<token>".into(), field.clone());
            }
            Value::Object(keyed)
        }
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(name, field)| (name.clone(), tokens_as_keys(field, name)))
                .collect(),
        ),
        Value::Array(items) => {
            let item_key = format!("{key}[]");
            Value::Array(
                items
                    .iter()
                    .map(|item| tokens_as_keys(item, &item_key))
                    .collect(),
            )
        }
        other => other.clone(),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Role,
    Content,
    /// The choice's last chunk, with text (`length`, a stop string).
    FinishWithText,
    /// The choice's last chunk, empty: after the EOS token.
    FinishEmpty,
    Usage,
    Error,
    Done,
}

/// One event of a stream: its kind and choice index.
fn classify(event: &str) -> (Event, Option<u64>, Option<Value>) {
    if event == "[DONE]" {
        return (Event::Done, None, None);
    }
    let value: Value = serde_json::from_str(event).unwrap();
    if value.get("error").is_some() {
        return (Event::Error, None, Some(value));
    }
    let Some(choice) = value["choices"].as_array().and_then(|c| c.first()) else {
        return (Event::Usage, None, Some(value));
    };
    let index = choice["index"].as_u64();
    let text = choice["delta"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap_or("");
    let kind = if choice["delta"].get("role").is_some() {
        Event::Role
    } else if !choice["finish_reason"].is_null() {
        if text.is_empty() {
            Event::FinishEmpty
        } else {
            Event::FinishWithText
        }
    } else {
        Event::Content
    };
    (kind, index, Some(value))
}

/// What is compared of a stream.
#[derive(Debug, PartialEq)]
struct StreamShape {
    /// Per choice, its events with runs of content chunks as one.
    per_choice: BTreeMap<u64, Vec<Event>>,
    /// The events that concern no choice, in order (usage, error, `[DONE]`).
    tail: Vec<Event>,
    /// Whether the role chunks all come before any other event.
    roles_first: bool,
    /// Which events carry `system_fingerprint`, counted from the end.
    fingerprint_from_end: Vec<usize>,
    /// The distinct skeletons of each kind of event.
    skeletons: BTreeMap<Event, BTreeSet<String>>,
}

fn stream_shape(body: &str) -> StreamShape {
    let events = sse_events(body);
    let mut per_choice: BTreeMap<u64, Vec<Event>> = BTreeMap::new();
    let mut tail = Vec::new();
    let mut skeletons: BTreeMap<Event, BTreeSet<String>> = BTreeMap::new();
    let mut fingerprint_from_end = Vec::new();
    let mut last_role = None;
    let mut first_other = None;
    for (position, event) in events.iter().enumerate() {
        let (kind, index, value) = classify(event);
        if let Some(value) = &value {
            skeletons.entry(kind).or_default().insert(shape(value));
            if value.get("system_fingerprint").is_some() {
                fingerprint_from_end.push(events.len() - position);
            }
        }
        if kind == Event::Role {
            last_role = Some(position);
        } else if first_other.is_none() {
            first_other = Some(position);
        }
        match index {
            Some(index) => {
                let sequence = per_choice.entry(index).or_default();
                if !(kind == Event::Content && sequence.last() == Some(&Event::Content)) {
                    sequence.push(kind);
                }
            }
            None => tail.push(kind),
        }
    }
    StreamShape {
        per_choice,
        tail,
        roles_first: match (last_role, first_other) {
            (Some(role), Some(other)) => role < other,
            _ => true,
        },
        fingerprint_from_end,
        skeletons,
    }
}

// ---------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn json_answers_match_the_captures() {
    let sim = draft_sim().await;
    let mut differences = Vec::new();
    for name in JSON_ANSWERS {
        let capture = Capture::load(name);
        let answer = ask(&sim, name).await;
        same_head(&capture, &answer, &mut differences);
        let (vllm, ours) = (capture.json(), answer.json(name));
        compare_shapes(name, &vllm, &ours, &mut differences);
        for field in ["finish_reason", "stop_reason"] {
            let (theirs, mine) = (&vllm["choices"][0][field], &ours["choices"][0][field]);
            // The stop string is the request's; the EOS token's id is the tokenizer's.
            if theirs.is_string() && theirs != mine
                || !theirs.is_string() && skeleton(theirs) != skeleton(mine)
            {
                differences.push(format!("{name}: {field} {mine} (vLLM {theirs})"));
            }
        }
        if ours["model"] != "tiny-draft" {
            differences.push(format!("{name}: model {}", ours["model"]));
        }
    }
    check(differences);
    // The context-end captures in numbers: 1,207 prompt tokens, cut at 2,048.
    let answer = ask(&sim, "prompt-plus-max-tokens-2000-ignore-eos")
        .await
        .json("ignore-eos");
    let captured = Capture::load("prompt-plus-max-tokens-2000-ignore-eos").json();
    assert_eq!(answer["usage"], captured["usage"]);
    sim.shutdown();
}

#[tokio::test]
async fn streams_match_the_captures() {
    let sim = draft_sim().await;
    let mut differences = Vec::new();
    for name in STREAMS {
        let capture = Capture::load(name);
        let answer = ask(&sim, name).await;
        same_head(&capture, &answer, &mut differences);
        let (vllm, ours) = (stream_shape(&capture.text()), stream_shape(&answer.text()));
        compare(&format!("{name}: stream"), &vllm, &ours, &mut differences);
    }
    check(differences);
    sim.shutdown();
}

/// A stream of named events (Anthropic's, the Responses API's): each `event:` name with the
/// skeleton of its data.
fn named_events(body: &str) -> Vec<(String, String)> {
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            let (name, data) = event
                .strip_prefix("event: ")
                .and_then(|rest| rest.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("bad Anthropic event {event:?}"));
            let data: Value = serde_json::from_str(data).unwrap();
            (name.to_string(), skeleton(&data))
        })
        .collect()
}

#[tokio::test]
async fn anthropic_messages_match_the_captures() {
    let sim = draft_sim().await;
    let mut differences = Vec::new();
    for (path, name) in [
        ("/v1/messages", "messages"),
        ("/v1/messages/count_tokens", "messages-count-tokens"),
    ] {
        let capture = Capture::load(name);
        let answer = ask_at(&sim, path, name).await;
        same_head(&capture, &answer, &mut differences);
        let (vllm, ours) = (capture.json(), answer.json(name));
        compare_shapes(name, &vllm, &ours, &mut differences);
        if name == "messages" {
            // Cut by `max_tokens` (8), as the tiny model was.
            assert_eq!(ours["stop_reason"], vllm["stop_reason"]);
            assert_eq!(
                ours["usage"]["output_tokens"],
                vllm["usage"]["output_tokens"]
            );
            assert_eq!(ours["model"], "tiny-draft");
        }
    }
    // The stream: the same events in the same order (a delta per token: the capture's 3), each
    // of the same shape.
    let capture = Capture::load("messages-stream");
    let answer = ask_at(&sim, "/v1/messages", "messages-stream").await;
    same_head(&capture, &answer, &mut differences);
    let (vllm, ours) = (named_events(&capture.text()), named_events(&answer.text()));
    compare("messages-stream: events", &vllm, &ours, &mut differences);
    check(differences);
    // An unknown model: vLLM's 404, in Anthropic's error shape.
    let response = client()
        .post(format!("{}/v1/messages", sim.url()))
        .json(&json!({"model": "nope", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "NotFoundError");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("The model `nope` does not exist."));
    sim.shutdown();
}

#[tokio::test]
async fn responses_match_the_captures() {
    let sim = draft_sim().await;
    let mut differences = Vec::new();
    let capture = Capture::load("responses");
    let answer = ask_at(&sim, "/v1/responses", "responses").await;
    same_head(&capture, &answer, &mut differences);
    let (vllm, ours) = (capture.json(), answer.json("responses"));
    compare_shapes("responses", &vllm, &ours, &mut differences);
    // Cut by `max_output_tokens` (8), as the tiny model was.
    for field in [
        "status",
        "incomplete_details",
        "max_output_tokens",
        "temperature",
    ] {
        assert_eq!(ours[field], vllm[field], "{field}");
    }
    assert_eq!(
        ours["usage"]["output_tokens"],
        vllm["usage"]["output_tokens"]
    );
    assert!(ours["id"].as_str().unwrap().starts_with("resp_"));
    // The stream: the same events in the same order, each of the same shape; vLLM's
    // detokenizer grouped its 4 tokens in 2 deltas, the simulator sends one a token.
    let capture = Capture::load("responses-stream");
    let answer = ask_at(&sim, "/v1/responses", "responses-stream").await;
    same_head(&capture, &answer, &mut differences);
    let collapsed = |events: Vec<(String, String)>| {
        let mut events = events;
        events.dedup();
        events
    };
    let (vllm, ours) = (
        collapsed(named_events(&capture.text())),
        collapsed(named_events(&answer.text())),
    );
    compare("responses-stream: events", &vllm, &ours, &mut differences);
    check(differences);
    sim.shutdown();
}

#[tokio::test]
async fn tokenize_and_detokenize_match_the_captures() {
    let sim = draft_sim().await;
    let mut differences = Vec::new();
    for name in ["tokenize", "tokenize-chat", "detokenize"] {
        let capture = Capture::load(name);
        let answer = ask_at(&sim, &format!("/{}", name.trim_end_matches("-chat")), name).await;
        same_head(&capture, &answer, &mut differences);
        compare_shapes(name, &capture.json(), &answer.json(name), &mut differences);
    }
    // The prompt's count is the one its completion is counted with.
    let tokenized = ask_at(&sim, "/tokenize", "tokenize").await.json("tokenize");
    let tokens = tokenized["tokens"].as_array().unwrap();
    assert_eq!(tokenized["count"].as_u64(), Some(tokens.len() as u64));
    assert_eq!(tokenized["max_model_len"], 2048);
    check(differences);
    sim.shutdown();
}

#[tokio::test]
async fn stream_quirks_are_occasional_and_repeatable() {
    let sim = draft_sim().await;
    let events = |answer: Answer| -> Vec<Value> { json_events(&sse_events(&answer.text())) };
    let first = events(ask(&sim, "prompt-plus-max-tokens-1000-stream-true").await);
    let again = events(ask(&sim, "prompt-plus-max-tokens-1000-stream-true").await);
    let contents = |events: &[Value]| -> Vec<String> {
        events
            .iter()
            .filter_map(|e| {
                e["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect()
    };
    assert_eq!(
        contents(&first),
        contents(&again),
        "the same chunks each time"
    );
    // 99 words and the EOS token: one chunk each, but for the held back and the merged.
    let chunks = contents(&first);
    let empty_mid_stream = chunks[1..chunks.len() - 1]
        .iter()
        .filter(|content| content.is_empty())
        .count();
    let two_words = chunks
        .iter()
        .filter(|content| content.matches(' ').count() == 2)
        .count();
    assert!(
        empty_mid_stream >= 1,
        "a `\"content\":\"\"` chunk: {chunks:?}"
    );
    assert!(two_words >= 1, "two tokens in one chunk: {chunks:?}");
    assert!(empty_mid_stream + two_words <= 20, "occasional: {chunks:?}");
    sim.shutdown();
}

#[tokio::test]
async fn errors_match_the_captures() {
    let sim = draft_sim().await;
    let mut differences = Vec::new();
    for name in ERRORS {
        let capture = Capture::load(name);
        let answer = ask(&sim, name).await;
        same_head(&capture, &answer, &mut differences);
        let (vllm, ours) = (capture.json(), answer.json(name));
        compare_shapes(name, &vllm, &ours, &mut differences);
        for field in ["type", "param", "code", "message"] {
            if vllm["error"][field] != ours["error"][field] {
                differences.push(format!(
                    "{name}: {field}\n  sim:  {}\n  vLLM: {}",
                    ours["error"][field], vllm["error"][field]
                ));
            }
        }
    }
    check(differences);
    sim.shutdown();
}

#[tokio::test]
async fn other_endpoints_match_the_captures() {
    let sim = draft_sim().await;
    let request = |method: reqwest::Method, path: &str| {
        client().request(method, format!("{}{path}", sim.url()))
    };
    let mut differences = Vec::new();
    for (name, method, path, body) in [
        ("health", reqwest::Method::GET, "/health", None),
        ("health-head", reqwest::Method::HEAD, "/health", None),
        ("version", reqwest::Method::GET, "/version", None),
        ("models", reqwest::Method::GET, "/v1/models", None),
        (
            "err-get-chat",
            reqwest::Method::GET,
            "/v1/chat/completions",
            None,
        ),
        ("err-not-found", reqwest::Method::GET, "/no/such/path", None),
        (
            "err-embeddings-get",
            reqwest::Method::GET,
            "/v1/embeddings",
            None,
        ),
        (
            "err-embeddings",
            reqwest::Method::POST,
            "/v1/embeddings",
            Some(request_of("err-embeddings")),
        ),
    ] {
        let capture = Capture::load(name);
        let mut builder = request(method, path);
        if let Some(body) = body {
            builder = builder
                .header("content-type", "application/json")
                .body(body);
        }
        let answer = answer_of(builder.send().await.unwrap()).await;
        same_head(&capture, &answer, &mut differences);
        if capture.header("content-length")
            != answer
                .headers
                .get("content-length")
                .map(|v| v.to_str().unwrap())
            && name != "models"
        {
            differences.push(format!(
                "{name}: content-length {:?} (vLLM {:?})",
                answer.headers.get("content-length"),
                capture.header("content-length")
            ));
        }
        if capture.header("content-type") == Some("application/json") && !capture.body.is_empty() {
            let (vllm, ours) = (capture.json(), answer.json(name));
            compare_shapes(name, &vllm, &ours, &mut differences);
            if name != "models" && vllm != ours {
                differences.push(format!("{name}: {ours} (vLLM {vllm})"));
            }
        } else if capture.body != answer.body {
            differences.push(format!("{name}: body {:?}", answer.text()));
        }
    }
    // The card of the served name, with the capture's root and context.
    let models = get_json(&format!("{}/v1/models", sim.url())).await;
    let captured = Capture::load("models").json();
    for field in ["id", "object", "owned_by", "root", "max_model_len"] {
        if models["data"][0][field] != captured["data"][0][field] {
            differences.push(format!("models: {field} {}", models["data"][0][field]));
        }
    }
    sim.shutdown();

    // The target server's card: another name and context, the same shape.
    let target = vllm_sim::start(
        SimConfig::default()
            .with_model("/models/tiny-llama")
            .with_served_model_names(vec!["tiny-target".into()])
            .with_max_model_len(4096),
    )
    .await
    .unwrap();
    let models = get_json(&format!("{}/v1/models", target.url())).await;
    let captured = Capture::load("models-target").json();
    if shape(&models) != shape(&captured) {
        differences.push(format!("models-target: shape {}", shape(&models)));
    }
    for field in ["id", "root", "max_model_len"] {
        if models["data"][0][field] != captured["data"][0][field] {
            differences.push(format!(
                "models-target: {field} {}",
                models["data"][0][field]
            ));
        }
    }
    target.shutdown();
    check(differences);
}

/// Each family's type, from the `# TYPE` lines.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|line| {
            let (name, kind) = line.split_once(' ').unwrap();
            (name.to_string(), kind.to_string())
        })
        .collect()
}

/// Per sample name, its label names and the values of the labels that enumerate something
/// (`finished_reason`, `reason`, `le`...): not the instance's (`model_name`, `engine`) nor
/// the cache configuration's, whose values are the instance's sizes.
fn label_sets(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut sets: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
    {
        let (name, labels) = match line.split_once('{') {
            Some((name, rest)) => (name, rest.split_once('}').unwrap().0),
            None => (line.split_once(' ').unwrap().0, ""),
        };
        if METRICS_NOT_SIMULATED
            .iter()
            .any(|skipped| name.starts_with(skipped))
            || name.starts_with("sim_")
            || name.starts_with("http_")
        {
            continue;
        }
        let mut described: Vec<String> = Vec::new();
        for pair in labels.split("\",").filter(|pair| !pair.is_empty()) {
            let (label, value) = pair.split_once("=\"").unwrap();
            let value = value.trim_end_matches('"');
            let instance =
                ["model_name", "engine"].contains(&label) || name == "vllm:cache_config_info";
            described.push(if instance {
                label.to_string()
            } else {
                format!("{label}={value}")
            });
        }
        sets.entry(name.to_string())
            .or_default()
            .insert(described.join(","));
    }
    sets
}

fn compare_metrics(name: &str, capture: &Capture, answer: &Answer, differences: &mut Vec<String>) {
    same_head(capture, answer, differences);
    let (vllm_text, ours_text) = (capture.text(), answer.text());
    let mut vllm = families(&vllm_text);
    for skipped in METRICS_NOT_SIMULATED {
        if vllm.remove(*skipped).is_none() {
            differences.push(format!(
                "{name}: vLLM no longer has {skipped}: update the list"
            ));
        }
    }
    let mut ours = families(&ours_text);
    ours.retain(|family, _| !family.starts_with("sim_"));
    for (family, kind) in &vllm {
        match ours.get(family) {
            None => differences.push(format!("{name}: the sim lacks {family} ({kind})")),
            Some(mine) if mine != kind => {
                differences.push(format!("{name}: {family} is a {mine} (vLLM: {kind})"))
            }
            Some(_) => {}
        }
    }
    for family in ours.keys().filter(|family| !vllm.contains_key(*family)) {
        differences.push(format!("{name}: vLLM 0.32 has no {family}"));
    }
    let (vllm_labels, our_labels) = (label_sets(&vllm_text), label_sets(&ours_text));
    for (sample, sets) in &vllm_labels {
        if our_labels.get(sample) != Some(sets) {
            differences.push(format!(
                "{name}: labels of {sample}\n  sim:  {:?}\n  vLLM: {sets:?}",
                our_labels.get(sample)
            ));
        }
    }
    for sample in our_labels
        .keys()
        .filter(|sample| !vllm_labels.contains_key(*sample))
    {
        differences.push(format!("{name}: vLLM 0.32 has no sample {sample}"));
    }
}

#[tokio::test]
async fn metrics_match_the_captures() {
    let sim = draft_sim().await;
    let metrics = || async {
        answer_of(
            client()
                .get(format!("{}/metrics", sim.url()))
                .send()
                .await
                .unwrap(),
        )
        .await
    };
    let mut differences = Vec::new();
    compare_metrics(
        "metrics-idle",
        &Capture::load("metrics-idle"),
        &metrics().await,
        &mut differences,
    );
    for name in [
        "chat-nonstream",
        "chat-stream-usage",
        "completion-n2-stream",
        "err-temperature",
    ] {
        ask(&sim, name).await;
    }
    let after = metrics().await;
    compare_metrics(
        "metrics-after",
        &Capture::load("metrics-after"),
        &after,
        &mut differences,
    );
    check(differences);
    // Traffic shows: 3 requests finished for length, their tokens counted.
    let text = after.text();
    assert_eq!(metric_value(&text, "vllm:request_prompt_tokens_count"), 3.0);
    assert!(
        text.contains("finished_reason=\"length\",model_name=\"tiny-draft\"} 3.0"),
        "{text}"
    );
    assert!(metric_value(&text, "vllm:prefix_cache_queries_total") > 0.0);
    sim.shutdown();
}

#[tokio::test]
async fn a_stream_error_event_is_written_as_captured() {
    // vLLM's only error inside a 200 stream in the captures is a grammar error; the sim's is
    // an injected 500. The event is written the same way: Python's json.dumps, then [DONE].
    let sim = draft_sim().await;
    sim.set_faults(Faults {
        error_after_chunks: Some(0),
        ..Faults::default()
    });
    let capture = Capture::load("stream-error-inside-200-grammar");
    let answer = ask(&sim, "chat-stream-usage").await;
    let mut differences = Vec::new();
    same_head(&capture, &answer, &mut differences);
    let (vllm, ours) = (stream_shape(&capture.text()), stream_shape(&answer.text()));
    compare("stream error", &vllm, &ours, &mut differences);
    let (vllm, ours) = (capture.text(), answer.text());
    for written in [
        "data: {\"error\": {\"message\": \"",
        "\", \"type\": \"",
        "\", \"param\": null, \"code\": ",
        "}}\n\ndata: [DONE]\n\n",
    ] {
        if !vllm.contains(written) || !ours.contains(written) {
            differences.push(format!(
                "stream error: {written:?} in vLLM's and the sim's: {ours}"
            ));
        }
    }
    check(differences);
    sim.shutdown();
}

/// A simulator set up as the embedding capture's server: `all-MiniLM-L6-v2`, context 256.
async fn embedding_sim() -> Sim {
    sim(SimConfig::default()
        .with_model("/models/all-MiniLM-L6-v2")
        .with_served_model_names(vec!["all-MiniLM-L6-v2".into()])
        .with_max_model_len(256)
        .with_error_shape(vllm_sim::ErrorShape::V0_32)
        .zero_latency()
        .embedding_model(384))
    .await
}

#[tokio::test]
async fn embeddings_match_the_captures() {
    let sim = embedding_sim().await;
    let mut differences = Vec::new();
    let capture = Capture::load("embeddings");
    let answer = ask_at(&sim, "/v1/embeddings", "embeddings").await;
    same_head(&capture, &answer, &mut differences);
    let (vllm, ours) = (capture.json(), answer.json("embeddings"));
    compare_shapes("embeddings", &vllm, &ours, &mut differences);
    let name = "embeddings-too-long";
    let capture = Capture::load(name);
    let answer = ask_at(&sim, "/v1/embeddings", name).await;
    same_head(&capture, &answer, &mut differences);
    let (vllm_error, our_error) = (capture.json(), answer.json(name));
    compare(
        name,
        &vllm_error["error"],
        &our_error["error"],
        &mut differences,
    );
    check(differences);
    // 384 floats of unit length, and the ids as vLLM makes them.
    let vector: Vec<f64> = ours["data"][0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(vector.len(), 384);
    let norm = vector.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    let id = ours["id"].as_str().unwrap();
    assert!(id.starts_with("embd-") && id.len() == 21, "{id}");
    // A generative route is not served by an embedding model.
    let chat = ask_at(&sim, "/v1/chat/completions", "chat-nonstream").await;
    assert_eq!(chat.status, 404);
    sim.shutdown();
}

#[test]
fn every_capture_is_compared_or_skipped() {
    let compared: BTreeSet<&str> = JSON_ANSWERS
        .iter()
        .chain(STREAMS)
        .chain(ERRORS)
        .chain(OTHERS)
        .copied()
        .collect();
    let skipped: BTreeSet<&str> = SKIPPED.iter().map(|(name, _)| *name).collect();
    assert!(compared.is_disjoint(&skipped));
    let captures: BTreeSet<String> = std::fs::read_dir(format!("{FIXTURES}/{DIR}"))
        .unwrap()
        .filter_map(|entry| {
            let name = entry.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".http").map(str::to_string)
        })
        .collect();
    let unaccounted: Vec<&String> = captures
        .iter()
        .filter(|name| !compared.contains(name.as_str()) && !skipped.contains(name.as_str()))
        .collect();
    assert!(
        unaccounted.is_empty(),
        "captures neither compared nor skipped: {unaccounted:?}"
    );
    let gone: Vec<&&str> = compared
        .iter()
        .chain(&skipped)
        .filter(|name| !captures.contains(**name))
        .collect();
    assert!(gone.is_empty(), "listed but not captured: {gone:?}");
}
