//! An open-loop load whose rate changes in phases (steady, burst, steady again), with a record
//! of every request: when it was due, how long it took from then, and how it ended (status,
//! `x-sluice-rejected` reason, the request id it was sent with). Scenarios 10, 11 and 22
//! judge requests by when they were due (before or after a backend was killed; in which
//! phase; before or after the fleet changed).
//!
//! Unlike [`crate::loadgen::open_loop`], no request ever waits for a free connection: each is
//! sent when due, on an idle kept-alive connection if there is one, else on a new one. So the
//! proxy sees every request the schedule asks for, however long earlier ones take (a burst
//! whose requests wait seconds in an admission queue), and latency counts from the due time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use tokio::sync::Mutex;

use crate::loadgen::{connect, Target};

/// `rate` requests per second for `duration`.
#[derive(Clone, Copy, Debug)]
pub struct Phase {
    pub rate: f64,
    pub duration: Duration,
}

/// How one request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A 2xx answer, read whole.
    Ok,
    /// Another status, with the `x-sluice-rejected` reason when there was one.
    Status {
        status: u16,
        rejected: Option<String>,
    },
    /// No answer: connect or I/O error, or no answer within the per-request limit.
    Failed(String),
}

impl Answer {
    pub fn is_ok(&self) -> bool {
        *self == Answer::Ok
    }

    /// A short label for tables: `200`, `503 kv-pressure`, `failed`.
    pub fn label(&self) -> String {
        match self {
            Answer::Ok => "2xx".into(),
            Answer::Status {
                status,
                rejected: Some(r),
            } => format!("{status} {r}"),
            Answer::Status {
                status,
                rejected: None,
            } => format!("{status}"),
            Answer::Failed(_) => "no answer".into(),
        }
    }
}

/// One request of the run.
#[derive(Clone, Debug)]
pub struct Sent {
    /// When it was due, from the start of the run.
    pub due: Duration,
    /// From when it was due to its answer's end.
    pub latency: Duration,
    /// The `x-request-id` it was sent with (`bench-<run>-<n>`), to find it in the proxy's log.
    pub request_id: String,
    pub answer: Answer,
}

impl Sent {
    /// When its answer ended, from the start of the run.
    pub fn done(&self) -> Duration {
        self.due + self.latency
    }
}

/// What a run did.
#[derive(Debug)]
pub struct Run {
    /// When the first request was due.
    pub start: Instant,
    /// Every request, in the order they were due.
    pub sent: Vec<Sent>,
}

/// Latency percentiles (ms) over `sent`; NaN when empty.
pub fn percentile_ms<'a>(sent: impl IntoIterator<Item = &'a Sent>, p: f64) -> f64 {
    let mut v: Vec<Duration> = sent.into_iter().map(|s| s.latency).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    let i = rank.clamp(1, v.len()) - 1;
    v.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// Connections kept alive between requests.
/// Kept-alive connections not in use, shared by the request tasks.
pub type Idle = Arc<Mutex<Vec<SendRequest<Full<Bytes>>>>>;

/// A connection ready for a request: an idle one still open, else a new one to `addr`.
pub async fn checkout(idle: &Idle, addr: std::net::SocketAddr) -> Result<SendRequest<Full<Bytes>>> {
    let kept = {
        let mut idle = idle.lock().await;
        let mut found = None;
        while let Some(c) = idle.pop() {
            if !c.is_closed() {
                found = Some(c);
                break;
            }
        }
        found
    };
    let mut sender = match kept {
        Some(c) => c,
        None => connect(addr).await?,
    };
    sender.ready().await.context("connection closed")?;
    Ok(sender)
}

/// Reads an answer whole, noting when its first data came; gives the connection back to
/// `idle`; fails on a status other than success, with the start of the body.
pub async fn read_answer(
    idle: &Idle,
    sender: SendRequest<Full<Bytes>>,
    resp: hyper::Response<hyper::body::Incoming>,
) -> Result<(Vec<u8>, Option<Instant>)> {
    let status = resp.status();
    let mut body = resp.into_body();
    let (mut all, mut first) = (Vec::new(), None);
    while let Some(frame) = body.frame().await {
        let frame = frame.context("reading the answer")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        first.get_or_insert_with(Instant::now);
        all.extend_from_slice(&data);
    }
    idle.lock().await.push(sender);
    if !status.is_success() {
        anyhow::bail!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&all[..all.len().min(200)])
        );
    }
    Ok((all, first))
}

static NEXT_RUN: AtomicU64 = AtomicU64::new(0);

/// Runs `phases` back to back against `target`; `start` is when the first request is due
/// (pass `Instant::now()` or a moment a little ahead). A request has `limit` to be answered.
pub async fn run(
    target: Arc<Target>,
    phases: &[Phase],
    start: Instant,
    limit: Duration,
) -> Result<Run> {
    run_until(
        target,
        phases,
        start,
        limit,
        Arc::new(AtomicBool::new(false)),
    )
    .await
}

/// As [`run`], but no request is due after `stop` is set (the requests sent still finish):
/// for a run whose end depends on what happens during it (scenario 22 stops its load a few
/// seconds after its last event); `phases` is then the longest it may run.
pub async fn run_until(
    target: Arc<Target>,
    phases: &[Phase],
    start: Instant,
    limit: Duration,
    stop: Arc<AtomicBool>,
) -> Result<Run> {
    let run_id = NEXT_RUN.fetch_add(1, Ordering::Relaxed);
    let mut due: Vec<Duration> = Vec::new();
    let mut phase_start = Duration::ZERO;
    for ph in phases {
        if ph.rate > 0.0 && ph.rate.is_finite() {
            let every = Duration::from_secs_f64(1.0 / ph.rate);
            let mut t = phase_start;
            while t < phase_start + ph.duration {
                due.push(t);
                t += every;
            }
        }
        phase_start += ph.duration;
    }
    // The pacer is a thread of its own: std's sleep is precise to tens of microseconds.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Duration)>();
    let schedule = due.clone();
    let pacer = std::thread::spawn(move || {
        for (i, d) in schedule.into_iter().enumerate() {
            let at = start + d;
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if stop.load(Ordering::Relaxed) || tx.send((i, d)).is_err() {
                break;
            }
        }
    });
    let idle: Idle = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    while let Some((i, d)) = rx.recv().await {
        let (target, idle) = (target.clone(), idle.clone());
        let request_id = format!("bench-{run_id}-{i}");
        tasks.spawn(async move {
            let answer = match tokio::time::timeout(limit, one(&target, &idle, &request_id)).await {
                Ok(Ok(a)) => a,
                Ok(Err(e)) => Answer::Failed(format!("{e:#}")),
                Err(_) => Answer::Failed(format!("no answer within {limit:?}")),
            };
            let latency = Instant::now().saturating_duration_since(start + d);
            Sent {
                due: d,
                latency,
                request_id,
                answer,
            }
        });
    }
    pacer
        .join()
        .map_err(|_| anyhow::anyhow!("the pacer thread panicked"))?;
    let mut sent = Vec::with_capacity(due.len());
    while let Some(s) = tasks.join_next().await {
        sent.push(s.context("a request task panicked")?);
    }
    sent.sort_by_key(|s| s.due);
    Ok(Run { start, sent })
}

/// Sends one request on an idle connection or a new one; the connection goes back to the
/// idle ones when the answer was read whole.
async fn one(target: &Target, idle: &Idle, request_id: &str) -> Result<Answer> {
    let mut sender = checkout(idle, target.addr).await?;
    let mut req = target.request()?;
    req.headers_mut().insert(
        "x-request-id",
        http::HeaderValue::from_str(request_id).context("request id")?,
    );
    let resp = sender.send_request(req).await.context("sending")?;
    let status = resp.status();
    let rejected = resp
        .headers()
        .get("x-sluice-rejected")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    resp.into_body()
        .collect()
        .await
        .context("reading the answer")?;
    idle.lock().await.push(sender);
    Ok(if status.is_success() {
        Answer::Ok
    } else {
        Answer::Status {
            status: status.as_u16(),
            rejected,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(ms: u64) -> Sent {
        Sent {
            due: Duration::ZERO,
            latency: Duration::from_millis(ms),
            request_id: String::new(),
            answer: Answer::Ok,
        }
    }

    #[test]
    fn percentiles_by_rank() {
        let v: Vec<Sent> = (1..=100).map(sent).collect();
        assert_eq!(percentile_ms(&v, 50.0), 50.0);
        assert_eq!(percentile_ms(&v, 99.0), 99.0);
        assert_eq!(percentile_ms(&v, 100.0), 100.0);
        assert!(percentile_ms(&[], 99.0).is_nan());
    }
}
