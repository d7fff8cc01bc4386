//! The load generator: HTTP/1.1 keep-alive connections driven in-process on tokio.
//!
//! - [`closed_loop`]: N connections, each sending its next request as soon as the previous
//!   answer is read, for a fixed time: the maximum throughput at that concurrency.
//! - [`open_loop`]: requests scheduled at a fixed rate by a pacer thread, whatever the answers
//!   do; latency counts from each request's *intended* send time (wrk2's correction for
//!   coordinated omission), so a stall shows up in the percentiles instead of slowing the
//!   generator down.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, Mutex};

/// One kind of request, sent again and again.
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: SocketAddr,
    pub method: Method,
    pub path: String,
    pub body: Bytes,
    /// Makes every request's body unique (see [`Target::varied`]).
    pub vary: Option<Arc<Vary>>,
    /// A response header every answer must carry (e.g. `x-cache: HIT`); an answer without it
    /// counts as an error. The name is parsed once, not at each answer: the check runs in the
    /// load generator, on the cores the contenders share.
    pub expect_header: Option<(header::HeaderName, &'static str)>,
    /// Headers every request carries besides `host` and `content-type` (an API key).
    pub headers: Vec<(header::HeaderName, header::HeaderValue)>,
}

/// A body split where a per-request counter goes: `prefix`, the number, `sep`, `suffix`.
#[derive(Debug)]
pub struct Vary {
    prefix: Bytes,
    sep: &'static [u8],
    suffix: Bytes,
}

/// One counter for the whole run: every round's targets must differ from all earlier ones,
/// or a proxy that lives across rounds would answer round 2 from round 1's cache entries.
static NEXT_VARIANT: AtomicU64 = AtomicU64::new(0);

impl Target {
    /// `POST path` with a JSON body.
    pub fn post_json(addr: SocketAddr, path: &str, body: Bytes) -> Target {
        Target {
            addr,
            method: Method::POST,
            path: path.to_string(),
            body,
            vary: None,
            expect_header: None,
            headers: Vec::new(),
        }
    }

    /// `GET path`.
    pub fn get(addr: SocketAddr, path: &str) -> Target {
        Target {
            method: Method::GET,
            ..Target::post_json(addr, path, Bytes::new())
        }
    }

    /// Every request different: a counter is written at the start of the first `"content"`
    /// string of the JSON body (the prompt), so that a cache never sees the same request twice
    /// (a real lookup miss and a store each time). Unchanged when the body has no such string.
    pub fn varied(self) -> Target {
        self.varied_after(b"\"content\":\"", b" ")
    }

    /// Every request different: a counter and `sep` written right after the first `mark` of
    /// the body (a completion's token ids: `"prompt":[` and `,`). Unchanged without `mark`.
    pub fn varied_after(mut self, mark: &[u8], sep: &'static [u8]) -> Target {
        if let Some(at) = self.body.windows(mark.len()).position(|w| w == mark) {
            let split = at + mark.len();
            self.vary = Some(Arc::new(Vary {
                prefix: self.body.slice(..split),
                sep,
                suffix: self.body.slice(split..),
            }));
        }
        self
    }

    /// Only answers carrying `name: value` count as successes.
    pub fn expecting(mut self, name: header::HeaderName, value: &'static str) -> Target {
        self.expect_header = Some((name, value));
        self
    }

    /// Every request carries `name: value` too.
    pub fn with_header(mut self, name: header::HeaderName, value: header::HeaderValue) -> Target {
        self.headers.push((name, value));
        self
    }

    fn body(&self) -> Bytes {
        let Some(v) = &self.vary else {
            return self.body.clone();
        };
        let n = NEXT_VARIANT.fetch_add(1, Ordering::Relaxed).to_string();
        let mut b = Vec::with_capacity(v.prefix.len() + n.len() + v.sep.len() + v.suffix.len());
        b.extend_from_slice(&v.prefix);
        b.extend_from_slice(n.as_bytes());
        b.extend_from_slice(v.sep);
        b.extend_from_slice(&v.suffix);
        Bytes::from(b)
    }

    pub(crate) fn request(&self) -> Result<Request<Full<Bytes>>> {
        let mut req = Request::builder()
            .method(self.method.clone())
            .uri(self.path.as_str())
            .header(header::HOST, self.addr.to_string());
        if !self.body.is_empty() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        for (name, value) in &self.headers {
            req = req.header(name, value);
        }
        req.body(Full::new(self.body()))
            .context("building the request")
    }

    /// Fails when the answer lacks the expected header.
    pub(crate) fn check_headers(&self, headers: &http::HeaderMap) -> Result<()> {
        if let Some((name, want)) = &self.expect_header {
            let got = headers.get(name).map(|v| v.as_bytes());
            if got != Some(want.as_bytes()) {
                let got = got.map(String::from_utf8_lossy);
                bail!("expected `{name}: {want}`, got {got:?}");
            }
        }
        Ok(())
    }
}

/// One request with its whole answer: status, headers, body (for priming and checks).
pub async fn fetch(target: &Target) -> Result<(http::StatusCode, http::HeaderMap, Bytes)> {
    let mut sender = connect(target.addr).await?;
    sender.ready().await.context("connection closed")?;
    let resp = sender
        .send_request(target.request()?)
        .await
        .context("sending")?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .context("reading the answer")?
        .to_bytes();
    Ok((parts.status, parts.headers, body))
}

/// A latency histogram in nanoseconds, 1 ns to 10 minutes, 3 significant digits.
pub fn histogram() -> Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).context("creating a histogram")
}

pub(crate) fn record(hist: &mut Histogram<u64>, d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
    hist.saturating_record(ns);
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct LoadResult {
    /// Successful requests inside the measured window.
    pub ok: u64,
    /// Failed requests (connect errors, I/O errors, non-2xx answers).
    pub errors: u64,
    /// Open loop only: requests that were still waiting to be sent when the run ended.
    pub missed: u64,
    pub first_error: Option<String>,
    /// The measured window (the warm-up excluded).
    pub window: Duration,
    /// Latency in nanoseconds (from the intended send time in open loop).
    pub latency: Histogram<u64>,
    pub response_bytes: u64,
}

impl LoadResult {
    fn empty(window: Duration) -> Result<LoadResult> {
        Ok(LoadResult {
            ok: 0,
            errors: 0,
            missed: 0,
            first_error: None,
            window,
            latency: histogram()?,
            response_bytes: 0,
        })
    }

    fn merge(&mut self, other: LoadResult) {
        self.ok += other.ok;
        self.errors += other.errors;
        self.missed += other.missed;
        self.response_bytes += other.response_bytes;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        // Both histograms have the same bounds; a value out of range is clamped by
        // saturating_record, so `add` cannot fail on range.
        let _ = self.latency.add(&other.latency);
    }

    fn error(&mut self, e: &anyhow::Error) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(format!("{e:#}"));
        }
    }

    /// Successful requests per second.
    pub fn rps(&self) -> f64 {
        self.ok as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// A latency percentile (0..100), in milliseconds.
    pub fn ms(&self, percentile: f64) -> f64 {
        self.latency.value_at_percentile(percentile) as f64 / 1e6
    }
}

/// Opens one HTTP/1.1 connection (TCP_NODELAY), its driver spawned on the runtime.
pub(crate) async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .context("HTTP/1.1 handshake")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Sends one request and reads the whole answer; returns the body's length.
async fn exchange(sender: &mut SendRequest<Full<Bytes>>, target: &Target) -> Result<u64> {
    sender.ready().await.context("connection closed")?;
    let resp = sender
        .send_request(target.request()?)
        .await
        .context("sending")?;
    let status = resp.status();
    let headers_ok = target.check_headers(resp.headers());
    let body = resp
        .into_body()
        .collect()
        .await
        .context("reading the answer")?
        .to_bytes();
    if !status.is_success() {
        let shown = &body[..body.len().min(200)];
        bail!("HTTP {status}: {}", String::from_utf8_lossy(shown));
    }
    headers_ok?;
    Ok(body.len() as u64)
}

/// One request on a kept connection, reconnecting when there is none.
pub(crate) async fn send_one(
    conn: &mut Option<SendRequest<Full<Bytes>>>,
    target: &Target,
) -> Result<u64> {
    let sender = match conn {
        Some(s) if !s.is_closed() => s,
        _ => conn.insert(connect(target.addr).await?),
    };
    let result = exchange(sender, target).await;
    if result.is_err() {
        *conn = None;
    }
    result
}

/// `conns` connections, back to back, for `warmup + duration`; only `duration` is measured.
pub async fn closed_loop(
    target: Arc<Target>,
    conns: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<LoadResult> {
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let mut tasks = Vec::with_capacity(conns);
    for _ in 0..conns.max(1) {
        let target = target.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = LoadResult::empty(duration)?;
            let mut conn = None;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let result = send_one(&mut conn, &target).await;
                let t1 = Instant::now();
                let counted = t0 >= measure_from && t1 <= end;
                match result {
                    Ok(bytes) if counted => {
                        out.ok += 1;
                        out.response_bytes += bytes;
                        record(&mut out.latency, t1 - t0);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        out.error(&e);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            Ok::<_, anyhow::Error>(out)
        }));
    }
    let mut total = LoadResult::empty(duration)?;
    for t in tasks {
        total.merge(t.await.context("a load task panicked")??);
    }
    Ok(total)
}

/// Requests at `rate` per second for `warmup + duration`, served by up to `conns` connections;
/// latency from each request's intended send time. Requests not sent by `end + 2 s` count as
/// `missed` (the contender could not keep up).
pub async fn open_loop(
    target: Arc<Target>,
    conns: usize,
    rate: f64,
    warmup: Duration,
    duration: Duration,
) -> Result<LoadResult> {
    if !(rate.is_finite() && rate > 0.0) {
        bail!("open loop needs a positive rate, not {rate}");
    }
    let start = Instant::now() + Duration::from_millis(20);
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let give_up = end + Duration::from_secs(2);
    let (tx, rx) = mpsc::unbounded_channel::<Instant>();
    let rx = Arc::new(Mutex::new(rx));
    // The pacer is a thread of its own: std's sleep is precise to tens of microseconds,
    // tokio's timer to a millisecond.
    let interval = Duration::from_secs_f64(1.0 / rate);
    let pacer = std::thread::spawn(move || {
        let mut i: u32 = 0;
        loop {
            let due = start + interval * i;
            if due >= end {
                break;
            }
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if tx.send(due).is_err() {
                break;
            }
            i = i.saturating_add(1);
        }
    });
    let mut tasks = Vec::with_capacity(conns);
    for _ in 0..conns.max(1) {
        let (target, rx) = (target.clone(), rx.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = LoadResult::empty(duration)?;
            let mut conn = None;
            loop {
                let next = rx.lock().await.recv().await;
                let Some(intended) = next else { break };
                let counted = intended >= measure_from;
                if Instant::now() > give_up {
                    if counted {
                        out.missed += 1;
                    }
                    continue;
                }
                let result = send_one(&mut conn, &target).await;
                let done = Instant::now();
                match result {
                    Ok(bytes) if counted => {
                        out.ok += 1;
                        out.response_bytes += bytes;
                        record(&mut out.latency, done.saturating_duration_since(intended));
                    }
                    Ok(_) => {}
                    Err(e) => out.error(&e),
                }
            }
            Ok::<_, anyhow::Error>(out)
        }));
    }
    let mut total = LoadResult::empty(duration)?;
    for t in tasks {
        total.merge(t.await.context("a load task panicked")??);
    }
    pacer
        .join()
        .map_err(|_| anyhow::anyhow!("the pacer thread panicked"))?;
    Ok(total)
}
