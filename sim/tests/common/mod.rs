#![allow(dead_code)]
//! Helpers shared by the integration tests: starting an instance, the request bodies they
//! send, and HTTP calls that return what the tests check (status, JSON, SSE events).

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::{Faults, Latency, Sim, SimConfig};

/// vLLM's wire shapes, kept in the repository (tests/fixtures/README.md says where from).
pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

pub fn fixture(name: &str) -> String {
    let path = format!("{FIXTURES}/{name}");
    std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("fixture {path}: {error}"))
}

pub fn json_fixture(name: &str) -> Value {
    serde_json::from_str(&fixture(name)).unwrap()
}

pub async fn sim(config: SimConfig) -> Sim {
    vllm_sim::start(config).await.expect("start sim")
}

/// The default instance with `faults` switched on.
pub async fn sim_with_faults(faults: Faults) -> Sim {
    let sim = sim(SimConfig::default()).await;
    sim.set_faults(faults);
    sim
}

/// No prefill and no overhead, one token every `inter_token`: requests stay in flight long
/// enough to be seen, and the first token comes at once.
pub fn token_every(inter_token: Duration) -> Latency {
    Latency::new(Duration::ZERO, Duration::ZERO, inter_token)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

pub fn chat_body(prompt: &str) -> Value {
    json!({"model": MODEL,
           "messages": [{"role": "user", "content": prompt}],
           "temperature": 0})
}

/// `body` with `"stream": true`.
pub fn streaming(mut body: Value) -> Value {
    body["stream"] = json!(true);
    body
}

/// POST `body` as JSON and return the response, whatever its status.
pub async fn send(sim: &Sim, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", sim.url()))
        .json(body)
        .send()
        .await
        .expect("send")
}

/// POST `body` as JSON: the status and the answer (as JSON, or as a string if it is not).
pub async fn post(sim: &Sim, path: &str, body: &Value) -> (u16, Value) {
    let response = send(sim, path, body).await;
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// POST a raw text body (control endpoints take hand-written JSON): the status and the answer.
pub async fn post_text(url: &str, body: &str) -> (u16, Value) {
    let response = client()
        .post(url)
        .body(body.to_string())
        .send()
        .await
        .expect("send");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

pub async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("JSON body")
}

pub async fn get_status(url: &str) -> u16 {
    client()
        .get(url)
        .send()
        .await
        .expect("send")
        .status()
        .as_u16()
}

/// A field of an error body in either shape: `{"error": {field}}` (new) or `{field}` (old).
pub fn error_field<'a>(body: &'a Value, field: &str) -> &'a Value {
    match body.get("error") {
        Some(inner) => &inner[field],
        None => &body[field],
    }
}

/// Raw HTTP/1.1 POST, read until the server closes: shows the chunked framing bytes, and
/// the I/O error if the connection was aborted.
pub async fn raw_post(
    addr: SocketAddr,
    path: &str,
    body: &str,
) -> (Vec<u8>, Option<std::io::Error>) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let error = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut received))
        .await
        .expect("connection should be closed by the server")
        .err();
    (received, error)
}

/// Shape of a JSON value: keys in order, value kinds; arrays by the distinct shapes of their
/// elements (`[a|b]` when they differ, sorted). `null` is a kind of its own.
pub fn skeleton(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(_) => "b".into(),
        Value::Number(_) => "n".into(),
        Value::String(_) => "s".into(),
        Value::Array(items) => {
            let shapes: std::collections::BTreeSet<String> = items.iter().map(skeleton).collect();
            format!("[{}]", shapes.into_iter().collect::<Vec<_>>().join("|"))
        }
        Value::Object(fields) => {
            let parts: Vec<String> = fields
                .iter()
                .map(|(key, field)| format!("{key}:{}", skeleton(field)))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
    }
}

/// Split an SSE body into its `data:` payloads, checking the `data: ...\n\n` framing.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "SSE body must end with a blank line: {body:?}"
    );
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {event:?}"))
                .to_string()
        })
        .collect()
}

/// The JSON events of a stream, without the final `[DONE]` (which it checks is there).
pub fn json_events(events: &[String]) -> Vec<Value> {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event).unwrap())
        .collect()
}

/// The value of the first sample of `name` in a /metrics text (labels ignored).
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|line| line.starts_with(&format!("{name}{{")))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
}

pub async fn wait_until(mut condition: impl FnMut() -> bool, what: &str) {
    for _ in 0..500 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Wait until connecting to `addr` is refused (`true`) or accepted (`false`).
pub async fn wait_for_connect(addr: SocketAddr, refused: bool) {
    for _ in 0..100 {
        match tokio::net::TcpStream::connect(addr).await {
            Err(error) if refused && error.kind() == std::io::ErrorKind::ConnectionRefused => {
                return
            }
            Ok(_) if !refused => return,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    panic!(
        "connections to {addr} should be {}",
        if refused { "refused" } else { "accepted" }
    );
}

/// Field `name` of a msgpack map.
pub fn field<'v>(map: &'v rmpv::Value, name: &str) -> &'v rmpv::Value {
    map.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {name} in {map}"))
}

/// The frames of one published message: topic, sequence number, decoded batch.
pub async fn next_batch(sub: &mut zeromq::SubSocket) -> (u64, rmpv::Value) {
    let message = tokio::time::timeout(Duration::from_secs(10), zeromq::SocketRecv::recv(sub))
        .await
        .expect("an event batch within 10 s")
        .unwrap();
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "topic, seq, payload");
    let seq = u64::from_be_bytes(frames[1].as_ref().try_into().unwrap());
    let batch = rmpv::decode::read_value(&mut frames[2].as_ref()).unwrap();
    (seq, batch)
}

/// A subscriber to `sim`'s KV events, once it receives them. ZMQ's slow joiner: what is
/// published before the subscription reaches the publisher is lost. A reset publishes
/// `AllBlocksCleared`; once one arrives, the subscriber is live.
pub async fn live_subscriber(sim: &Sim) -> zeromq::SubSocket {
    use zeromq::Socket;
    let (publisher, _) = sim.kv_event_endpoints().unwrap();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&publisher).await.unwrap();
    sub.subscribe("").await.unwrap();
    loop {
        sim.reset_prefix_cache();
        let received = tokio::select! {
            batch = next_batch(&mut sub) => Some(batch),
            () = tokio::time::sleep(Duration::from_millis(200)) => None,
        };
        if let Some((_, batch)) = received {
            assert_eq!(
                field(&batch[1][0], "type").as_str(),
                Some("AllBlocksCleared")
            );
            return sub;
        }
    }
}
