//! A backend's KV cache events, followed into its pool's exact prefix index: one subscriber
//! per backend of a pool with `kv_events`, started and stopped with the backend's checks.
//!
//! Where the events come from: `kv_events: auto` asks the backend's `GET /kv_event_sources`
//! (vLLM 0.32 answers its config keyed by data-parallel rank, `{}` when events are off; a list of
//! `{data_parallel_rank, endpoint, replay_endpoint, topic}`, bare or under `sources`, is read
//! too), and a `*`, `0.0.0.0`
//! or `::` host means the backend's own address); `kv_events: {port: N}` is the backend's own
//! address on that port. Each publishing rank is subscribed to (ZMQ SUB, reconnecting by
//! itself when the backend restarts).
//!
//! Each message is `[topic, seq, batch]`. The sequence number tells what was missed:
//! - a gap (batches lost, or published before Sluice subscribed): they are asked of the
//!   replay socket when the backend has one, else the backend's blocks are forgotten (the
//!   index then under-predicts until the engine stores blocks again; it never predicts a
//!   block the engine dropped);
//! - a number lower than expected: the engine restarted and its cache is empty; its blocks
//!   are forgotten, and what the new engine published before is replayed.
//!
//! A publisher can also fall silent with its connection open (its process stopped, the path
//! blackholed): ZMQ's PUB sends no heartbeat, and zeromq's PUB (the simulator's) answers no
//! ZMTP PING. So silence is judged against the engine's own `/metrics`: once a scrape shows it
//! computed prompt tokens, blocks it must have stored and published, a publisher that sends
//! nothing for [`SILENT_AFTER`] after is dropped, its backend's blocks forgotten, and followed
//! again.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use pingora_core::connectors::http::v1::Connector;
use pingora_core::upstreams::peer::HttpPeer;
use sluice_sdk::prefix::{KvEventSource, PrefixRouting};
use sluice_sdk::prefix_index::KvEventBatch;
use sluice_sdk::Pool;

use super::probe;
use super::zmtp::{self, Connection, SocketType};
use crate::metrics;

/// How long a subscriber waits before asking again where the events are, after the backend
/// said none or its publisher could not be reached.
const RETRY: Duration = Duration::from_secs(5);

/// The first pause before connecting again to a publisher whose connection ended.
const RECONNECT: Duration = Duration::from_millis(100);

/// How long connecting to a publisher or a replay socket may take.
const CONNECT: Duration = Duration::from_secs(5);

/// How long a replay may take, whole.
const REPLAY: Duration = Duration::from_secs(10);

/// How long a publisher may stay silent once a scrape shows its engine computed prompt tokens:
/// vLLM publishes the blocks a step stored at the end of that step.
const SILENT_AFTER: Duration = Duration::from_secs(15);

/// How often the liveness check looks at the backend's scrape.
const LIVENESS_CHECK: Duration = Duration::from_secs(1);

/// The computed prompt tokens that must show before silence counts, and in blocks: enough
/// that tokens left in partial blocks (the recomputed last token of a cached prompt, short
/// uncached tails) cannot add up to it while the engine stores no block.
const SILENT_TOKENS_MIN: f64 = 1024.0;
const SILENT_BLOCKS_MIN: f64 = 16.0;

/// What one publisher may send: vLLM publishes a batch per engine step, a few hundred KB at
/// most (a step's blocks, 16 token ids each). A larger message ends the connection, counted.
const LIMITS: zmtp::Limits = zmtp::Limits {
    message_bytes: 4 * 1024 * 1024,
    frames: 4,
};

/// The most publishing ranks one backend may name: vLLM has one per data-parallel rank on
/// the host.
const MAX_RANKS: usize = 16;

/// One publishing rank of a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// `tcp://HOST:PORT` of its PUB socket.
    pub endpoint: String,
    /// `tcp://HOST:PORT` of its replay (ROUTER) socket, if it has one.
    pub replay: Option<String>,
    /// The topic its messages carry.
    pub topic: String,
}

/// What a subscriber needs of its backend.
pub struct Subscriber {
    pub pool: Arc<Pool>,
    pub routing: Arc<PrefixRouting>,
    pub addr: SocketAddr,
    /// The backend as configured (its metric label).
    pub label: String,
    pub connector: Arc<Connector>,
    pub peer: HttpPeer,
}

impl Subscriber {
    /// Follows the backend's events until aborted (when the backend leaves the pool).
    pub async fn run(self) {
        let mut said_none = false;
        let said_unreachable = Arc::new(std::sync::atomic::AtomicBool::new(false));
        loop {
            let sources = match self.routing.kv_events {
                KvEventSource::Port(port) => vec![Source {
                    endpoint: tcp(self.addr.ip(), port),
                    replay: None,
                    topic: String::new(),
                }],
                KvEventSource::Auto => self.ask_sources().await,
            };
            if sources.is_empty() {
                if !said_none {
                    tracing::warn!(
                        pool = &*self.pool.name,
                        backend = &self.label,
                        "the backend publishes no KV cache events (vLLM's --kv-events-config): \
                         routed without the exact prefix index"
                    );
                    said_none = true;
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
            said_none = false;
            let mut ranks = tokio::task::JoinSet::new();
            // The engine's counters are the backend's, summed over its ranks: a rank's
            // silence can be judged only when it is the one publishing.
            let judge_silence = sources.len() == 1;
            for source in sources {
                ranks.spawn(follow(
                    Arc::clone(&self.routing),
                    Arc::clone(&self.pool),
                    self.addr,
                    self.label.clone(),
                    source,
                    Arc::clone(&said_unreachable),
                    judge_silence,
                ));
            }
            // A rank's subscription ends only when its publisher cannot be reached: ask
            // again where they are, after a pause, with what the backend held forgotten.
            let _ = ranks.join_next().await;
            ranks.abort_all();
            self.routing.index.clear(self.addr);
            publish_blocks(&self.routing, &self.pool.name, &self.label, self.addr);
            tokio::time::sleep(RETRY).await;
        }
    }

    /// The backend's publishing ranks, from its `GET /kv_event_sources`; none when it
    /// cannot say.
    async fn ask_sources(&self) -> Vec<Source> {
        let answer = probe::get_with(
            &self.connector,
            &self.peer,
            &self.label,
            "/kv_event_sources",
            self.pool.settings.health.timeout,
            self.pool.settings.upstream_auth.as_ref(),
        )
        .await;
        match answer {
            Ok(a) if a.status == 200 => sources(&a.body, self.addr.ip()),
            other => {
                tracing::debug!(
                    pool = &*self.pool.name,
                    backend = &self.label,
                    "cannot read /kv_event_sources: {}",
                    probe::describe(&other)
                );
                Vec::new()
            }
        }
    }
}

/// `tcp://IP:PORT`, brackets around an IPv6 address.
fn tcp(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
        IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
    }
}

/// The publishing ranks a `/kv_event_sources` body lists: vLLM 0.32's map of configs keyed by
/// rank (those with events on, published over ZMQ), or newer vLLM's list of sources.
pub fn sources(body: &[u8], backend: IpAddr) -> Vec<Source> {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Vec::new();
    };
    let entries: Vec<&serde_json::Value> = match &value {
        serde_json::Value::Object(ranks) => ranks
            .values()
            .filter(|config| config["enable_kv_cache_events"] == serde_json::Value::Bool(true))
            .filter(|config| config["publisher"].as_str().is_none_or(|p| p == "zmq"))
            .collect(),
        serde_json::Value::Array(list) => list.iter().collect(),
        _ => Vec::new(),
    };
    // A later shape wraps the list: `{"sources": [...]}`.
    let entries = match value.get("sources").and_then(serde_json::Value::as_array) {
        Some(list) => list.iter().collect(),
        None => entries,
    };
    // One per data-parallel rank: a list longer than that is not an engine's.
    entries
        .into_iter()
        .take(MAX_RANKS)
        .filter_map(|entry| {
            Some(Source {
                endpoint: on_backend(entry["endpoint"].as_str()?, backend)?,
                replay: entry["replay_endpoint"]
                    .as_str()
                    .and_then(|e| on_backend(e, backend)),
                topic: entry["topic"].as_str().unwrap_or("").to_string(),
            })
        })
        .collect()
}

/// A ZMQ endpoint as this proxy reaches it: a wildcard host (a bound address) is the
/// backend's own. Only TCP endpoints on the backend's own address are followed: a backend
/// names where its engine publishes, never another host (that would let any backend point
/// every proxy at an address of its choosing), and names are not resolved.
fn on_backend(endpoint: &str, backend: IpAddr) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    match host.trim_start_matches('[').trim_end_matches(']') {
        "*" | "0.0.0.0" | "::" | "" => Some(tcp(backend, port)),
        ip if ip.parse::<IpAddr>().ok() == Some(backend) => Some(tcp(backend, port)),
        _ => None,
    }
}

/// Follows one rank's events into the index, connecting again (after a pause that doubles,
/// from [`RECONNECT`] to [`RETRY`]) when the connection ends: the sequence number says what
/// happened meanwhile (see [`catch_up`]). Returns when the publisher cannot be reached after
/// the longest pause, for the subscriber to ask again where it is. Said once per backend,
/// not at every retry.
async fn follow(
    routing: Arc<PrefixRouting>,
    backends: Arc<Pool>,
    addr: SocketAddr,
    label: String,
    source: Source,
    said_unreachable: Arc<std::sync::atomic::AtomicBool>,
    judge_silence: bool,
) {
    let pool = &*backends.name;
    // The batch expected next, across connections; it moves with every batch, which is
    // what the silence check watches.
    let next = AtomicU64::new(0);
    let mut pause = RECONNECT;
    let mut said_following = false;
    loop {
        match Connection::connect(&source.endpoint, SocketType::Sub, LIMITS, CONNECT).await {
            Ok(mut sub) => {
                said_unreachable.store(false, Relaxed);
                if !said_following {
                    tracing::info!(
                        pool,
                        backend = &label,
                        endpoint = &source.endpoint,
                        "following the backend's KV cache events"
                    );
                    said_following = true;
                }
                let before = next.load(Relaxed);
                let error = match sub.subscribe(source.topic.as_bytes()).await {
                    Ok(()) => tokio::select! {
                        error = subscribed(
                            &mut sub, &routing, pool, &label, addr, &source, &next,
                        ) => Some(error),
                        () = silent(&backends, &routing, addr, &next), if judge_silence => None,
                    },
                    Err(error) => Some(error),
                };
                connection_ended(&routing, pool, &label, addr, &source, error);
                if next.load(Relaxed) != before {
                    pause = RECONNECT;
                }
            }
            Err(error) => {
                metrics::inc(&metrics::KV_EVENT_ERRORS, &[pool, &label, "connect"]);
                if pause >= RETRY {
                    if !said_unreachable.swap(true, Relaxed) {
                        tracing::warn!(
                            pool,
                            backend = &label,
                            endpoint = &source.endpoint,
                            %error,
                            "cannot reach the KV event publisher (tried again every few seconds)"
                        );
                    }
                    return;
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RETRY);
    }
}

/// A followed connection ended: `error`, or `None` when its publisher fell silent (then
/// the blocks it published are forgotten); counted and, unless it merely closed, logged.
fn connection_ended(
    routing: &PrefixRouting,
    pool: &str,
    label: &str,
    addr: SocketAddr,
    source: &Source,
    error: Option<zmtp::Error>,
) {
    let reason = match &error {
        None => "silent",
        Some(zmtp::Error::TooLarge(_)) => "too_large",
        Some(zmtp::Error::Protocol(_)) => "protocol",
        Some(_) => "closed",
    };
    if error.is_none() {
        // What it published may have been evicted since: forgotten, not trusted
        // (before the drop is counted, so that whoever sees the count sees it).
        routing.index.clear(addr);
        publish_blocks(routing, pool, label, addr);
    }
    metrics::inc(&metrics::KV_EVENT_ERRORS, &[pool, label, reason]);
    if error.is_none() {
        tracing::warn!(
            pool,
            backend = label,
            endpoint = &source.endpoint,
            "the KV event publisher sent nothing for {SILENT_AFTER:?} while its \
             engine computed prompt tokens: its blocks are forgotten and it is \
             followed again"
        );
    } else if reason != "closed" {
        let error = error.map(|e| e.to_string()).unwrap_or_default();
        tracing::warn!(
            pool,
            backend = label,
            endpoint = &source.endpoint,
            %error,
            "dropped the KV event publisher's connection"
        );
    }
}

/// Applies one connection's batches until it ends, moving `next` on with each; why it ended.
async fn subscribed(
    sub: &mut Connection,
    routing: &PrefixRouting,
    pool: &str,
    label: &str,
    addr: SocketAddr,
    source: &Source,
    next: &AtomicU64,
) -> zmtp::Error {
    loop {
        let frames = match sub.recv().await {
            Ok(frames) => frames,
            Err(error) => return error,
        };
        // [topic, seq, payload]; a publisher without a topic frame sends [seq, payload].
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => continue,
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        let expected = next.load(Relaxed);
        if seq != expected {
            catch_up(routing, pool, label, addr, source, expected, seq).await;
        }
        apply(routing, pool, label, addr, payload);
        next.store(seq.saturating_add(1), Relaxed);
    }
}

/// Returns once the publisher has gone silent: a scrape taken after its last batch (`next`
/// last moved), then one showing the engine computed enough prompt tokens since, and still
/// no batch [`SILENT_AFTER`] later. Never returns for a backend whose `/metrics` does not say.
async fn silent(pool: &Pool, routing: &PrefixRouting, addr: SocketAddr, next: &AtomicU64) {
    let mut seen = next.load(Relaxed);
    let mut last_batch = Instant::now();
    // What the engine had computed by the first scrape after the last batch.
    let mut baseline: Option<f64> = None;
    let mut owed_since: Option<Instant> = None;
    loop {
        tokio::time::sleep(LIVENESS_CHECK).await;
        let now_seen = next.load(Relaxed);
        if now_seen != seen {
            (seen, last_batch, baseline, owed_since) = (now_seen, Instant::now(), None, None);
            continue;
        }
        let load = pool.members().find(addr).and_then(|m| m.live.load());
        let Some((computed, scraped_at)) = load
            .as_deref()
            .and_then(|l| Some((l.computed_prompt_tokens?, l.scraped_at)))
        else {
            continue;
        };
        if scraped_at <= last_batch {
            continue;
        }
        let base = *baseline.get_or_insert(computed);
        if computed < base {
            // The engine restarted: its counters began again.
            (baseline, owed_since) = (Some(computed), None);
            continue;
        }
        let owed = SILENT_TOKENS_MIN.max(SILENT_BLOCKS_MIN * routing.index.block_size() as f64);
        if computed - base >= owed {
            let since = *owed_since.get_or_insert(scraped_at);
            if since.elapsed() >= SILENT_AFTER {
                return;
            }
        }
    }
}

/// The next batch is `seq` where `next` was expected: catches up on what was missed.
/// - `seq < next`: the engine restarted (its cache is empty, its count began again): its
///   blocks are forgotten, and what the new engine published before `seq` is replayed;
/// - `next == 0`: this subscriber joined after the engine began: what it published is
///   replayed, if it keeps it;
/// - else batches were lost: replayed, or the backend's blocks forgotten.
async fn catch_up(
    routing: &PrefixRouting,
    pool: &str,
    label: &str,
    addr: SocketAddr,
    source: &Source,
    next: u64,
    seq: u64,
) {
    let restarted = seq < next;
    if restarted {
        routing.index.clear(addr);
        metrics::inc(&metrics::KV_EVENT_GAPS, &[pool, label, "restarted"]);
    }
    let from = if restarted { 0 } else { next };
    if seq <= from {
        return;
    }
    // From the start (joined late, or the engine restarted), whatever the replay still
    // keeps is the best there is; a gap must be filled whole, or the blocks forgotten.
    let whole = from > 0;
    let replayed = match &source.replay {
        Some(replay) => replay_range(routing, addr, replay, from, seq, whole).await,
        None => false,
    };
    let outcome = if replayed {
        "replayed"
    } else if restarted {
        return;
    } else if from == 0 {
        "joined"
    } else {
        routing.index.clear(addr);
        "cleared"
    };
    metrics::inc(&metrics::KV_EVENT_GAPS, &[pool, label, outcome]);
}

/// Decodes one batch into the index, and publishes what it changed.
fn apply(routing: &PrefixRouting, pool: &str, label: &str, addr: SocketAddr, payload: &Bytes) {
    match KvEventBatch::decode(payload) {
        Ok(batch) => {
            routing.index.apply(addr, &batch.events);
            metrics::inc(&metrics::KV_EVENT_BATCHES, &[pool, label]);
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            if batch.ts > 0.0 {
                let lag = (now - batch.ts).max(0.0);
                metrics::set(&metrics::KV_EVENT_LAG, &[pool, label], lag);
                routing.index.record_lag(addr, lag);
            }
            publish_blocks(routing, pool, label, addr);
        }
        Err(error) => {
            tracing::debug!(pool, backend = label, %error, "an unreadable KV event batch");
        }
    }
}

fn publish_blocks(routing: &PrefixRouting, pool: &str, label: &str, addr: SocketAddr) {
    let blocks = i64::try_from(routing.index.blocks_of(addr)).unwrap_or(i64::MAX);
    metrics::set(&metrics::PREFIX_INDEX_BLOCKS, &[pool, label], blocks);
}

/// Asks `replay` (vLLM's ROUTER socket) for the batches from `from` up to (not including)
/// `until`, and applies them. Whether the range came whole; unless `whole` is asked, a
/// replay that keeps only the end of the range is applied and counts.
async fn replay_range(
    routing: &PrefixRouting,
    addr: SocketAddr,
    replay: &str,
    from: u64,
    until: u64,
    whole: bool,
) -> bool {
    let work = async {
        let mut dealer = Connection::connect(replay, SocketType::Dealer, LIMITS, CONNECT)
            .await
            .ok()?;
        // A DEALER's request: an empty delimiter, then the first sequence number wanted.
        dealer.send(&[b"", &from.to_be_bytes()]).await.ok()?;
        let mut expected = from;
        loop {
            let frames = dealer.recv().await.ok()?;
            // vLLM's ROUTER answers `["", topic, seq, payload]`; the end marker's seq is -1.
            let (seq, payload) = match frames.as_slice() {
                [_, _, seq, payload] | [_, seq, payload] => (seq, payload),
                _ => return None,
            };
            let seq = i64::from_be_bytes(<[u8; 8]>::try_from(seq.as_ref()).ok()?);
            if seq < 0 {
                return Some(expected >= until);
            }
            let seq = seq as u64;
            if seq >= until {
                return Some(expected >= until);
            }
            if seq != expected {
                if whole || seq < expected {
                    // The replay no longer keeps the start of the range.
                    return Some(false);
                }
                expected = seq;
            }
            if let Ok(batch) = KvEventBatch::decode(payload) {
                routing.index.apply(addr, &batch.events);
            }
            expected += 1;
        }
    };
    matches!(tokio::time::timeout(REPLAY, work).await, Ok(Some(true)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;
    use std::sync::Mutex;
    use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

    const BACKEND: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 2, 3));

    #[test]
    fn sources_of_vllm_0_32_and_of_newer_vllm() {
        let v0_32 = br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv"},
                         "1": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5558", "replay_endpoint": null, "topic": ""}}"#;
        assert_eq!(
            sources(v0_32, BACKEND),
            vec![Source {
                endpoint: "tcp://10.1.2.3:5557".to_string(),
                replay: None,
                topic: "kv".to_string(),
            }]
        );
        let newer = br#"[{"data_parallel_rank": 0, "endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://*:5560", "topic": ""},
                         {"data_parallel_rank": 1, "endpoint": "tcp://10.1.2.3:5558", "replay_endpoint": null, "topic": ""},
                         {"data_parallel_rank": 2, "endpoint": "tcp://10.9.9.9:5559", "replay_endpoint": null, "topic": ""},
                         {"data_parallel_rank": 3, "endpoint": "tcp://evil.example:5559", "replay_endpoint": null, "topic": ""}]"#;
        assert_eq!(
            sources(newer, BACKEND),
            vec![
                Source {
                    endpoint: "tcp://10.1.2.3:5557".to_string(),
                    replay: Some("tcp://10.1.2.3:5560".to_string()),
                    topic: String::new(),
                },
                Source {
                    endpoint: "tcp://10.1.2.3:5558".to_string(),
                    replay: None,
                    topic: String::new(),
                },
            ],
            "another host's endpoint, or a name, is not followed"
        );
        // A list longer than an engine's ranks: the first few only.
        let storm: Vec<_> = (0..20_000)
            .map(|i| serde_json::json!({"endpoint": format!("tcp://*:{}", 20_000 + i % 100)}))
            .collect();
        let storm = serde_json::to_vec(&storm).unwrap();
        assert_eq!(sources(&storm, BACKEND).len(), MAX_RANKS);
        let v6 = IpAddr::V6(std::net::Ipv6Addr::LOCALHOST);
        assert_eq!(
            sources(br#"[{"endpoint": "tcp://[::]:7"}]"#, v6)[0].endpoint,
            "tcp://[::1]:7"
        );
        // Not events, or not reachable from here: none.
        assert!(sources(b"not json", BACKEND).is_empty());
        assert!(sources(br#"{"0": {"enable_kv_cache_events": false}}"#, BACKEND).is_empty());
        assert!(sources(b"{}", BACKEND).is_empty());
        assert_eq!(
            sources(
                br#"{"sources": [{"data_parallel_rank": 0, "endpoint": "tcp://*:9"}]}"#,
                BACKEND
            )[0]
            .endpoint,
            "tcp://10.1.2.3:9"
        );
        assert!(sources(br#"[{"endpoint": "ipc:///tmp/kv"}]"#, BACKEND).is_empty());
    }

    /// The batches an engine keeps for its replay socket: (sequence number, payload).
    type Kept = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

    fn stored(hash: u64, tokens: u32) -> Vec<u8> {
        let event = Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![Value::from(hash)]),
            Value::Nil,
            Value::Array((0..16).map(|i| Value::from(tokens + i)).collect()),
            Value::from(16),
            Value::Nil,
            "GPU".into(),
        ]);
        let mut out = Vec::new();
        rmpv::encode::write_value(
            &mut out,
            &Value::Array(vec![Value::F64(1.0), Value::Array(vec![event])]),
        )
        .unwrap();
        out
    }

    fn message(seq: u64, payload: &[u8]) -> ZmqMessage {
        ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ])
        .unwrap()
    }

    /// A publisher as vLLM's: PUB (keeping what it sends for the replay), in a runtime of its
    /// own on its own thread, so that stopping it closes its sockets as a dying engine's are.
    struct Engine {
        commands: Option<tokio::sync::mpsc::UnboundedSender<(u64, Vec<u8>)>>,
        thread: Option<std::thread::JoinHandle<()>>,
        port: u16,
    }

    impl Engine {
        fn start(port: u16, kept: Kept) -> Engine {
            let (commands, mut orders) = tokio::sync::mpsc::unbounded_channel::<(u64, Vec<u8>)>();
            let (bound_tx, bound) = std::sync::mpsc::channel();
            let thread = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async move {
                    let mut publisher = zeromq::PubSocket::new();
                    // The port of a publisher just stopped may take a moment to be free.
                    let endpoint = loop {
                        match publisher.bind(&format!("tcp://127.0.0.1:{port}")).await {
                            Ok(endpoint) => break endpoint,
                            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                        }
                    };
                    let zeromq::Endpoint::Tcp(_, port) = endpoint else {
                        panic!("tcp")
                    };
                    bound_tx.send(port).unwrap();
                    while let Some((seq, payload)) = orders.recv().await {
                        kept.lock().unwrap().push((seq, payload.clone()));
                        publisher.send(message(seq, &payload)).await.unwrap();
                    }
                });
                // The runtime goes with every task and socket it ran.
            });
            let port = bound.recv().unwrap();
            Engine {
                commands: Some(commands),
                thread: Some(thread),
                port,
            }
        }

        fn publish(&self, seq: u64, payload: Vec<u8>) {
            self.commands
                .as_ref()
                .unwrap()
                .send((seq, payload))
                .unwrap();
        }

        fn stop(mut self) {
            drop(self.commands.take());
            self.thread.take().unwrap().join().unwrap();
        }
    }

    async fn serve_replay(kept: Kept) -> u16 {
        let mut router = zeromq::RouterSocket::new();
        let zeromq::Endpoint::Tcp(_, port) = router.bind("tcp://127.0.0.1:0").await.unwrap() else {
            panic!("tcp")
        };
        tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let start = u64::from_be_bytes(frames[2].as_ref().try_into().unwrap());
                let batches: Vec<_> = kept
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, payload) in batches {
                    let reply = vec![
                        frames[0].clone(),
                        Bytes::new(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        Bytes::from(payload),
                    ];
                    router
                        .send(ZmqMessage::try_from(reply).unwrap())
                        .await
                        .unwrap();
                }
                let end = vec![
                    frames[0].clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                    Bytes::new(),
                ];
                router
                    .send(ZmqMessage::try_from(end).unwrap())
                    .await
                    .unwrap();
            }
        });
        port
    }

    fn keys(tokens: u32) -> Vec<u64> {
        let ids: Vec<u32> = (0..16).map(|i| tokens + i).collect();
        sluice_sdk::prefix_index::block_keys(&ids, 16, None, None)
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..400 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{what}: not within 10 s");
    }

    /// Real ZMQ sockets over TCP: a subscriber that joins late, misses a batch (replayed),
    /// and sees its publisher restart (the engine's blocks forgotten, the new ones indexed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_replays_gaps_and_follows_a_restarted_engine() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizer-chatml");
        let tokenizer = Arc::new(sluice_tokenizer::PromptTokenizer::load(&dir).unwrap());
        let routing = Arc::new(PrefixRouting::new(tokenizer, KvEventSource::Port(0)));
        let backend = SocketAddr::from(([127, 0, 0, 1], 1));
        let kept = Arc::new(Mutex::new(Vec::new()));
        let engine = Engine::start(0, Arc::clone(&kept));
        let port = engine.port;
        let replay = serve_replay(Arc::clone(&kept)).await;
        let source = Source {
            endpoint: format!("tcp://127.0.0.1:{port}"),
            replay: Some(format!("tcp://127.0.0.1:{replay}")),
            topic: String::new(),
        };
        let follower = tokio::spawn(follow(
            Arc::clone(&routing),
            Arc::new(Pool::new(sluice_sdk::PoolSettings::new(
                "kv-events-test",
                vec![],
                vec![],
            ))),
            backend,
            "b".to_string(),
            source,
            Arc::new(std::sync::atomic::AtomicBool::new(false)),
            true,
        ));
        let held = |tokens: u32| routing.index.lookup(&keys(tokens)).cached_tokens(backend) == 16;
        // The subscriber joins while the engine is at batch 1000: batches 1000.. are kept.
        // The engine published long before: what came before the subscription reached the
        // publisher is replayed, as far as the replay keeps it.
        let mut seq = 1000;
        while !held(0) {
            assert!(seq < 1500, "the subscriber never received a batch");
            engine.publish(seq, stored(seq, (seq as u32 - 1000) * 100));
            seq += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        until("every batch, replayed or received", || {
            (1000..seq).all(|s| held((s as u32 - 1000) * 100))
        })
        .await;
        // A batch lost on the way: the next one's number shows the gap, the replay fills it.
        kept.lock().unwrap().push((seq, stored(5000, 5000)));
        engine.publish(seq + 1, stored(6000, 6000));
        until("the missed batch, replayed", || held(5000) && held(6000)).await;
        // The engine restarts: a new publisher on the same port, its count from 0, its cache
        // empty, its replay kept anew.
        engine.stop();
        kept.lock().unwrap().clear();
        let restarted = Engine::start(port, Arc::clone(&kept));
        let mut seq = 0;
        loop {
            assert!(
                seq < 500,
                "the restarted publisher never reached the subscriber"
            );
            restarted.publish(seq, stored(90_000 + seq, 9000 + seq as u32 * 100));
            tokio::time::sleep(Duration::from_millis(20)).await;
            if held(9000 + seq as u32 * 100) {
                break;
            }
            seq += 1;
        }
        until("the old engine's blocks forgotten", || {
            !held(0) && !held(5000) && !held(6000)
        })
        .await;
        // What the new engine published before the subscriber heard it was replayed.
        until("the new engine's blocks, all of them", || {
            (0..=seq).all(|s| held(9000 + s as u32 * 100))
        })
        .await;
        assert_eq!(routing.index.blocks_of(backend), seq as usize + 1);
        follower.abort();
        restarted.stop();
    }
}
