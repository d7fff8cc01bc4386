//! What reached this instance: counters per endpoint and the last N requests with full bodies.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// One received request, kept byte-for-byte.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    /// Path and query as received.
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl RecordedRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// A snapshot of the instance's counters. `/sim/*` requests are not counted.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub requests_total: u64,
    pub requests_by_path: BTreeMap<String, u64>,
    /// Completion requests that finished generating (stop or length).
    pub completed: u64,
    /// Error answers sent (HTTP status >= 400, errors inside streams, dropped streams).
    pub errors: u64,
    pub oom: u64,
    /// Requests that hit an injected fault.
    pub faults_injected: u64,
    /// Connections accepted on the main port.
    pub connections: u64,
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
    /// The last `record_requests` requests, oldest first.
    pub recent: Vec<RecordedRequest>,
}

impl Stats {
    pub fn count(&self, path: &str) -> u64 {
        self.requests_by_path.get(path).copied().unwrap_or(0)
    }
}

const PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/version",
];

#[derive(Debug)]
pub struct Recorder {
    keep: usize,
    total: AtomicU64,
    // Known endpoints get lock-free counters; anything else goes to the map.
    known: [AtomicU64; 6],
    other: Mutex<BTreeMap<String, u64>>,
    completed: AtomicU64,
    errors: AtomicU64,
    faults: AtomicU64,
    connections: AtomicU64,
    recent: Mutex<VecDeque<RecordedRequest>>,
}

/// A poisoned lock only means a panic elsewhere; the counters and the log are still usable.
fn unpoisoned<T>(lock: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Recorder {
    pub fn new(keep: usize) -> Self {
        Recorder {
            keep,
            total: AtomicU64::new(0),
            known: Default::default(),
            other: Mutex::new(BTreeMap::new()),
            completed: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::new()),
        }
    }

    pub fn wants_requests(&self) -> bool {
        self.keep > 0
    }

    /// A completion request finished generating.
    pub fn count_completed(&self) {
        self.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// An error answer was sent (or a stream was broken off).
    pub fn count_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection was accepted on the main port.
    pub fn count_connection(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// A request hit an injected fault.
    pub fn count_fault(&self) {
        self.faults.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self, path: &str) {
        self.total.fetch_add(1, Ordering::Relaxed);
        match PATHS.iter().position(|known| *known == path) {
            Some(index) => {
                if let Some(counter) = self.known.get(index) {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                *unpoisoned(&self.other).entry(path.to_string()).or_insert(0) += 1;
            }
        }
    }

    pub fn record(&self, request: RecordedRequest) {
        if self.keep == 0 {
            return;
        }
        let mut recent = unpoisoned(&self.recent);
        while recent.len() >= self.keep {
            recent.pop_front();
        }
        recent.push_back(request);
    }

    pub fn snapshot(&self) -> Stats {
        let mut by_path = unpoisoned(&self.other).clone();
        for (path, counter) in PATHS.iter().zip(&self.known) {
            let count = counter.load(Ordering::Relaxed);
            if count > 0 {
                by_path.insert((*path).to_string(), count);
            }
        }
        Stats {
            requests_total: self.total.load(Ordering::Relaxed),
            requests_by_path: by_path,
            completed: self.completed.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            faults_injected: self.faults.load(Ordering::Relaxed),
            connections: self.connections.load(Ordering::Relaxed),
            recent: unpoisoned(&self.recent).iter().cloned().collect(),
            ..Stats::default()
        }
    }
}

/// JSON view of `Stats` for `GET /sim/stats`; bodies are summarised (length, sha256, and the
/// first 64 KiB as lossy UTF-8).
#[derive(Serialize)]
pub struct StatsJson<'a> {
    requests_total: u64,
    requests_by_path: &'a BTreeMap<String, u64>,
    completed: u64,
    errors: u64,
    oom: u64,
    faults_injected: u64,
    connections: u64,
    running: u32,
    waiting: u32,
    kv_usage: f64,
    recent: Vec<RequestJson<'a>>,
}

#[derive(Serialize)]
struct RequestJson<'a> {
    method: &'a str,
    path: &'a str,
    headers: &'a [(String, String)],
    body_len: usize,
    body_sha256: String,
    body: String,
    body_truncated: bool,
}

const SHOWN_BODY: usize = 64 * 1024;

impl<'a> StatsJson<'a> {
    pub fn new(stats: &'a Stats) -> Self {
        StatsJson {
            requests_total: stats.requests_total,
            requests_by_path: &stats.requests_by_path,
            completed: stats.completed,
            errors: stats.errors,
            oom: stats.oom,
            faults_injected: stats.faults_injected,
            connections: stats.connections,
            running: stats.running,
            waiting: stats.waiting,
            kv_usage: stats.kv_usage,
            recent: stats.recent.iter().map(RequestJson::new).collect(),
        }
    }
}

impl<'a> RequestJson<'a> {
    fn new(request: &'a RecordedRequest) -> Self {
        let body = &request.body;
        let shown = body.get(..body.len().min(SHOWN_BODY)).unwrap_or_default();
        RequestJson {
            method: &request.method,
            path: &request.path,
            headers: &request.headers,
            body_len: body.len(),
            body_sha256: hex(&Sha256::digest(body)),
            body: String::from_utf8_lossy(shown).into_owned(),
            body_truncated: body.len() > SHOWN_BODY,
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        let _ = write!(out, "{byte:02x}");
    }
    out
}
