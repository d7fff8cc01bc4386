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
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
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
    pub completed: AtomicU64,
    pub errors: AtomicU64,
    pub faults: AtomicU64,
    recent: Mutex<VecDeque<RecordedRequest>>,
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
            recent: Mutex::new(VecDeque::new()),
        }
    }

    pub fn wants_requests(&self) -> bool {
        self.keep > 0
    }

    pub fn count(&self, path: &str) {
        self.total.fetch_add(1, Ordering::Relaxed);
        match PATHS.iter().position(|p| *p == path) {
            Some(i) => {
                if let Some(c) = self.known.get(i) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                let mut m = self.other.lock().unwrap_or_else(|e| e.into_inner());
                *m.entry(path.to_string()).or_insert(0) += 1;
            }
        }
    }

    pub fn record(&self, req: RecordedRequest) {
        if self.keep == 0 {
            return;
        }
        let mut r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        while r.len() >= self.keep {
            r.pop_front();
        }
        r.push_back(req);
    }

    pub fn snapshot(&self) -> Stats {
        let mut by_path = self.other.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (p, c) in PATHS.iter().zip(&self.known) {
            let v = c.load(Ordering::Relaxed);
            if v > 0 {
                by_path.insert((*p).to_string(), v);
            }
        }
        Stats {
            requests_total: self.total.load(Ordering::Relaxed),
            requests_by_path: by_path,
            completed: self.completed.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            faults_injected: self.faults.load(Ordering::Relaxed),
            recent: self
                .recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned()
                .collect(),
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
    pub fn new(s: &'a Stats) -> Self {
        StatsJson {
            requests_total: s.requests_total,
            requests_by_path: &s.requests_by_path,
            completed: s.completed,
            errors: s.errors,
            oom: s.oom,
            faults_injected: s.faults_injected,
            running: s.running,
            waiting: s.waiting,
            kv_usage: s.kv_usage,
            recent: s
                .recent
                .iter()
                .map(|r| {
                    let shown = &r.body[..r.body.len().min(SHOWN_BODY)];
                    RequestJson {
                        method: &r.method,
                        path: &r.path,
                        headers: &r.headers,
                        body_len: r.body.len(),
                        body_sha256: hex(&Sha256::digest(&r.body)),
                        body: String::from_utf8_lossy(shown).into_owned(),
                        body_truncated: r.body.len() > SHOWN_BODY,
                    }
                })
                .collect(),
        }
    }
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}
