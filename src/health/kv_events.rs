//! A backend's KV cache events, followed into its pool's exact prefix index: one subscriber
//! per backend of a pool with `kv_events`, started and stopped with the backend's checks.
//!
//! Where the events come from: `kv_events: auto` asks the backend's `GET /kv_event_sources`
//! (vLLM 0.32 answers its config keyed by data-parallel rank, newer vLLM a list of
//! `{data_parallel_rank, endpoint, replay_endpoint, topic}`; both are read, and a `*`, `0.0.0.0`
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

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use pingora_core::connectors::http::Connector;
use pingora_core::upstreams::peer::HttpPeer;
use sluice_sdk::prefix::{KvEventSource, PrefixRouting};
use sluice_sdk::prefix_index::KvEventBatch;
use sluice_sdk::Pool;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::probe;
use crate::metrics;

/// How long a subscriber waits before asking again where the events are, after the backend
/// said none or its publisher could not be reached.
const RETRY: Duration = Duration::from_secs(5);

/// How long connecting to a publisher or a replay socket may take.
const CONNECT: Duration = Duration::from_secs(5);

/// How long a replay may take, whole.
const REPLAY: Duration = Duration::from_secs(10);

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
            for source in sources {
                ranks.spawn(follow(
                    Arc::clone(&self.routing),
                    Arc::clone(&self.pool.name),
                    self.addr,
                    self.label.clone(),
                    source,
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
            self.pool.health.timeout,
            self.pool.upstream_auth.as_ref(),
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
    entries
        .into_iter()
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
/// backend's own. Only TCP endpoints can be reached from another host.
fn on_backend(endpoint: &str, backend: IpAddr) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    match host.trim_start_matches('[').trim_end_matches(']') {
        "*" | "0.0.0.0" | "::" | "" => Some(tcp(backend, port)),
        _ => Some(format!("tcp://{host}:{port}")),
    }
}

/// Follows one rank's events into the index, until its publisher cannot be reached.
async fn follow(
    routing: Arc<PrefixRouting>,
    pool: Arc<str>,
    addr: SocketAddr,
    label: String,
    source: Source,
) {
    let mut sub = zeromq::SubSocket::new();
    let connected = tokio::time::timeout(CONNECT, sub.connect(&source.endpoint)).await;
    if !matches!(connected, Ok(Ok(()))) {
        tracing::warn!(pool = &*pool, backend = &label, endpoint = &source.endpoint, "cannot reach the KV event publisher");
        return;
    }
    if sub.subscribe(&source.topic).await.is_err() {
        return;
    }
    tracing::info!(pool = &*pool, backend = &label, endpoint = &source.endpoint, "following the backend's KV cache events");
    let mut next: u64 = 0;
    while let Ok(message) = sub.recv().await {
        let frames = message.into_vec();
        // [topic, seq, payload]; a publisher without a topic frame sends [seq, payload].
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => continue,
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        if seq != next {
            catch_up(&routing, &pool, &label, addr, &source, next, seq).await;
        }
        apply(&routing, &pool, &label, addr, payload);
        next = seq.saturating_add(1);
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
    let replayed = match &source.replay {
        Some(replay) => replay_range(routing, addr, replay, from, seq).await,
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
                metrics::set(&metrics::KV_EVENT_LAG, &[pool, label], (now - batch.ts).max(0.0));
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
/// `until`, and applies them. Whether the range came whole.
async fn replay_range(
    routing: &PrefixRouting,
    addr: SocketAddr,
    replay: &str,
    from: u64,
    until: u64,
) -> bool {
    let work = async {
        let mut dealer = zeromq::DealerSocket::new();
        tokio::time::timeout(CONNECT, dealer.connect(replay)).await.ok()?.ok()?;
        // A DEALER's request: an empty delimiter, then the first sequence number wanted.
        let mut ask = ZmqMessage::from(Bytes::new());
        ask.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        dealer.send(ask).await.ok()?;
        let mut expected = from;
        loop {
            let frames = dealer.recv().await.ok()?.into_vec();
            // [empty, seq, payload]; the end marker's seq is -1.
            let (seq, payload) = match frames.as_slice() {
                [_, seq, payload] | [seq, payload] => (seq, payload),
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
                // The replay no longer keeps the start of the range.
                return Some(false);
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
                         {"data_parallel_rank": 1, "endpoint": "tcp://10.9.9.9:5558", "replay_endpoint": null, "topic": ""}]"#;
        assert_eq!(
            sources(newer, BACKEND),
            vec![
                Source {
                    endpoint: "tcp://10.1.2.3:5557".to_string(),
                    replay: Some("tcp://10.1.2.3:5560".to_string()),
                    topic: String::new(),
                },
                Source {
                    endpoint: "tcp://10.9.9.9:5558".to_string(),
                    replay: None,
                    topic: String::new(),
                },
            ]
        );
        let v6 = IpAddr::V6(std::net::Ipv6Addr::LOCALHOST);
        assert_eq!(
            sources(br#"[{"endpoint": "tcp://[::]:7"}]"#, v6)[0].endpoint,
            "tcp://[::1]:7"
        );
        // Not events, or not reachable from here: none.
        assert!(sources(b"not json", BACKEND).is_empty());
        assert!(sources(br#"{"0": {"enable_kv_cache_events": false}}"#, BACKEND).is_empty());
        assert!(sources(br#"[{"endpoint": "ipc:///tmp/kv"}]"#, BACKEND).is_empty());
    }
}
