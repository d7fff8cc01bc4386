//! End-to-end test harness: the real `sluice` binary on free ports, real upstreams.
//!
//! - [`Proxy`]: runs the binary with a generated config in a temporary directory and kills it
//!   on drop. Tests give the config's `pools`/`routes`/`plugins`/`limits` part.
//! - [`Scripted`]: a raw HTTP/1.1 upstream that answers with exact bytes (the fixtures), at
//!   chosen moments, and records what it received: for byte-for-byte and timing proofs.
//! - Simulated vLLM backends come from `vllm_sim` directly.
#![allow(dead_code)]

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

pub fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{FIXTURES}/{name}");
    std::fs::read(&path).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A port where nothing listens (bound, then released): connections are refused.
pub fn dead_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

pub struct Proxy {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    log: PathBuf,
}

impl Proxy {
    /// Starts the proxy with `body` (YAML for pools, routes, plugins, limits) and waits until
    /// both listeners accept.
    pub async fn start(body: &str) -> Proxy {
        Self::start_with_pingora("", body).await
    }

    /// As [`Proxy::start`], with more keys (each line indented by two spaces) in the
    /// `pingora` section.
    pub async fn start_with_pingora(pingora: &str, body: &str) -> Proxy {
        let dir = tempfile::tempdir().expect("temp dir");
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let config = dir.path().join("sluice.yaml");
        let text = format!(
            "pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  grace_period_seconds: 3\n  graceful_shutdown_timeout_seconds: 5\n{pingora}\
             listeners:\n  - address: {addr}\nadmin:\n  address: {admin}\nlog:\n  level: info\n{body}",
            pid = dir.path().join("sluice.pid").display(),
            sock = dir.path().join("upgrade.sock").display(),
        );
        std::fs::write(&config, text).expect("write config");
        let mut proxy = Proxy {
            child: None,
            addr,
            admin,
            log: dir.path().join("sluice.log"),
            config,
            dir,
        };
        proxy.child = Some(proxy.spawn(&[]));
        proxy.wait_ready().await;
        proxy
    }

    /// Starts the binary on this proxy's config with extra flags (`-u` for an upgrade).
    pub fn spawn(&self, extra: &[&str]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("-c")
            .arg(&self.config)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn sluice")
    }

    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("sluice exited early ({status}):\n{}", self.logs());
                }
            }
            let proxy_up = tokio::net::TcpStream::connect(self.addr).await.is_ok();
            let admin_up = tokio::net::TcpStream::connect(self.admin).await.is_ok();
            if proxy_up && admin_up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sluice did not start:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("running")
    }

    /// Takes the process out of the harness (for signal tests).
    pub fn take_child(&mut self) -> Child {
        self.child.take().expect("running")
    }

    pub fn set_child(&mut self, child: Child) {
        self.child = Some(child);
    }

    pub fn config_dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let _ = writeln!(std::io::stderr(), "--- sluice log ---\n{}", self.logs());
        }
    }
}

/// Sends a signal to a process.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{sig} {pid}");
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// A pool's `extra` that turns its health checks off: for upstreams that are not vLLM (their
/// probes would be scripted answers too), and for tests of the request path alone.
pub const NO_HEALTH_CHECKS: &str = "    health: {enabled: false}\n";

/// A pool block for the config.
pub fn pool(name: &str, models: &[&str], backends: &[SocketAddr], extra: &str) -> String {
    let models = models
        .iter()
        .map(|m| format!("\"{m}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let backends: String = backends
        .iter()
        .map(|b| format!("      - address: {b}\n"))
        .collect();
    format!("  - name: {name}\n    models: [{models}]\n    backends:\n{backends}{extra}")
}

/// What a [`Scripted`] upstream received.
#[derive(Debug, Clone)]
pub struct Received {
    pub head: String,
    pub body: Vec<u8>,
}

/// How a [`Scripted`] upstream answers: a head, then body chunks, each after a pause.
#[derive(Clone)]
pub struct Script {
    pub head: Vec<u8>,
    pub chunks: Vec<(Duration, Vec<u8>)>,
}

impl Script {
    /// A complete response with `content-length`.
    pub fn fixed(content_type: &str, body: Vec<u8>) -> Self {
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        Self {
            head: head.into_bytes(),
            chunks: vec![(Duration::ZERO, body)],
        }
    }

    /// A chunked event stream: each event sent as one HTTP chunk after `pause`.
    pub fn event_stream(events: Vec<Vec<u8>>, pause: Duration) -> Self {
        let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        let mut chunks: Vec<(Duration, Vec<u8>)> = events
            .into_iter()
            .map(|e| {
                let mut c = format!("{:x}\r\n", e.len()).into_bytes();
                c.extend_from_slice(&e);
                c.extend_from_slice(b"\r\n");
                (pause, c)
            })
            .collect();
        chunks.push((Duration::ZERO, b"0\r\n\r\n".to_vec()));
        Self { head, chunks }
    }
}

/// A raw HTTP/1.1 upstream that answers every request with its [`Script`].
pub struct Scripted {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Received>>>,
    /// When the last chunk of the latest response was written.
    pub last_write: Arc<Mutex<Option<Instant>>>,
}

impl Scripted {
    pub async fn start(script: Script) -> Scripted {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let last_write = Arc::new(Mutex::new(None));
        let (rec, last) = (received.clone(), last_write.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (script, rec, last) = (script.clone(), rec.clone(), last.clone());
                tokio::spawn(async move {
                    while let Some(req) = read_request(&mut stream).await {
                        rec.lock().unwrap().push(req);
                        if stream.write_all(&script.head).await.is_err() {
                            return;
                        }
                        for (pause, chunk) in &script.chunks {
                            tokio::time::sleep(*pause).await;
                            if stream.write_all(chunk).await.is_err() {
                                return;
                            }
                            let _ = stream.flush().await;
                        }
                        *last.lock().unwrap() = Some(Instant::now());
                    }
                });
            }
        });
        Scripted {
            addr,
            received,
            last_write,
        }
    }
}

async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<Received> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 4096];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        let n = stream.read(&mut byte).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&byte[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())
                .flatten()
        })
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut byte).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&byte[..n]);
    }
    Some(Received { head, body })
}

/// A chat request body.
pub fn chat(model: &str, content: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
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

/// An LLM answer as a test sees it.
pub struct Answer {
    pub status: u16,
    /// The `x-cache` header, or empty.
    pub x_cache: String,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

/// POSTs `body` as JSON to `url` with extra `headers`.
pub async fn ask(url: &str, body: &serde_json::Value, headers: &[(&str, &str)]) -> Answer {
    let mut request = client().post(url).json(body);
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
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            })
            .collect()
    } else {
        let v: serde_json::Value = serde_json::from_str(&answer.body).expect("a JSON answer");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
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

/// The admin `/status` document.
pub async fn status(proxy: &Proxy) -> serde_json::Value {
    client()
        .get(proxy.admin_url("/status"))
        .send()
        .await
        .expect("admin answers")
        .json()
        .await
        .expect("status is JSON")
}

/// One backend's entry in `/status`, by pool name and address.
pub async fn backend_status(proxy: &Proxy, pool: &str, addr: SocketAddr) -> serde_json::Value {
    let status = status(proxy).await;
    status["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"] == pool)
        .flat_map(|p| p["backends"].as_array().cloned().unwrap_or_default())
        .find(|b| b["address"] == addr.to_string())
        .unwrap_or(serde_json::Value::Null)
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

/// The admin `/metrics` text.
pub async fn metrics_text(proxy: &Proxy) -> String {
    client()
        .get(proxy.admin_url("/metrics"))
        .send()
        .await
        .expect("admin answers")
        .text()
        .await
        .expect("metrics text")
}

/// The value of the series `name{labels}` (labels as Prometheus prints them, sorted), if any.
pub fn metric_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// The mean token log-probability of a simulator's own answer to `content` (16 tokens at
/// temperature 0), asked directly: whether it is one the simulator marks low-confidence.
pub async fn answer_confidence(sim: &vllm_sim::Sim, model: &str, content: &str) -> f64 {
    let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}],
                                  "temperature": 0, "logprobs": true, "max_tokens": 16});
    let v: serde_json::Value = client()
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
