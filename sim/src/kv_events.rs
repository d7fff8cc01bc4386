//! vLLM's KV cache events publisher (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`):
//! a ZMQ PUB socket sending, for each batch of events, the frames `[topic, seq, payload]`
//! (`seq` a big-endian 8-byte counter from 0, `payload` the msgpack of a `KVEventBatch`), and
//! a ZMQ ROUTER socket that replays the batches it still keeps (`buffer_steps` of them) to a
//! client that sends the first sequence number it wants: `[seq, payload]` for each, then
//! `[-1, ""]`.
//!
//! The encoding is msgspec's for vLLM's structs, which are `array_like` and tagged: a batch is
//! `[ts, [event, ...]]` (its `data_parallel_rank` is left out when it is none, as
//! `omit_defaults` does), and an event is an array of its tag (the class name) and its fields
//! in order: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//! medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Block hashes are
//! integers, as vLLM sends them by default.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmpv::Value;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::KvEventsConfig;
use crate::prefix_cache::{EventSink, KvEvent};

/// Where the events are published, as `GET /kv_event_sources` tells it.
#[derive(Clone, Debug)]
pub struct Endpoints {
    /// `tcp://HOST:PORT` of the PUB socket.
    pub publisher: String,
    /// `tcp://HOST:PORT` of the replay socket, if any.
    pub replay: Option<String>,
    /// As vLLM's config writes it: `tcp://*:PORT`.
    pub announced: String,
    pub announced_replay: Option<String>,
    pub topic: String,
    pub buffer_steps: usize,
}

/// The `medium` vLLM reports for blocks in GPU memory.
const MEDIUM_GPU: &str = "GPU";

/// Binds the publisher (and the replay socket) on `ip` and starts sending what the returned
/// sink receives: every event waiting when the publisher wakes goes in one batch, as vLLM
/// batches the events of one engine step.
pub async fn publish(
    ip: IpAddr,
    config: &KvEventsConfig,
) -> std::io::Result<(Endpoints, EventSink)> {
    let io = |e: zeromq::ZmqError| std::io::Error::other(e.to_string());
    let host = match ip {
        IpAddr::V6(v6) => format!("[{v6}]"),
        IpAddr::V4(v4) => v4.to_string(),
    };
    let mut publisher = zeromq::PubSocket::new();
    let bound = publisher
        .bind(&format!("tcp://{host}:{}", config.port))
        .await
        .map_err(io)?;
    let port = port_of(&bound);
    let (replay, replay_port) = match config.replay_port {
        Some(wanted) => {
            let mut router = zeromq::RouterSocket::new();
            let bound = router
                .bind(&format!("tcp://{host}:{wanted}"))
                .await
                .map_err(io)?;
            (Some(router), Some(port_of(&bound)))
        }
        None => (None, None),
    };
    let endpoints = Endpoints {
        publisher: format!("tcp://{host}:{port}"),
        replay: replay_port.map(|p| format!("tcp://{host}:{p}")),
        announced: format!("tcp://*:{port}"),
        announced_replay: replay_port.map(|p| format!("tcp://*:{p}")),
        topic: config.topic.clone(),
        buffer_steps: config.buffer_steps,
    };
    let (sink, events) = tokio::sync::mpsc::unbounded_channel();
    let kept = Arc::new(Mutex::new(VecDeque::<(u64, Bytes)>::new()));
    if let Some(router) = replay {
        tokio::spawn(serve_replay(router, Arc::clone(&kept)));
    }
    tokio::spawn(send_batches(
        publisher,
        events,
        kept,
        Bytes::from(config.topic.clone().into_bytes()),
        config.buffer_steps,
    ));
    Ok((endpoints, sink))
}

fn port_of(endpoint: &zeromq::Endpoint) -> u16 {
    match endpoint {
        zeromq::Endpoint::Tcp(_, port) => *port,
        _ => 0,
    }
}

async fn send_batches(
    mut publisher: zeromq::PubSocket,
    mut events: tokio::sync::mpsc::UnboundedReceiver<KvEvent>,
    kept: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    topic: Bytes,
    buffer_steps: usize,
) {
    let mut seq: u64 = 0;
    while let Some(first) = events.recv().await {
        let mut batch = vec![first];
        while let Ok(more) = events.try_recv() {
            batch.push(more);
        }
        let payload = Bytes::from(encode_batch(&batch));
        {
            let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
            kept.push_back((seq, payload.clone()));
            while kept.len() > buffer_steps {
                kept.pop_front();
            }
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            // No subscriber yet is not an error: PUB drops what nobody reads.
            let _ = publisher.send(message).await;
        }
        seq += 1;
    }
}

/// Answers replay requests: a client's 8-byte start sequence gets every kept batch from it
/// on, then the end marker (sequence -1, empty payload).
async fn serve_replay(mut router: zeromq::RouterSocket, kept: Arc<Mutex<VecDeque<(u64, Bytes)>>>) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let Some(identity) = frames.first().cloned() else {
            continue;
        };
        let Some(start) = frames
            .last()
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
        else {
            continue;
        };
        // A DEALER client sends an empty delimiter frame first; answer as it asked.
        let delimited = frames.len() > 2;
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let reply = |seq: Bytes, payload: Bytes| {
            let mut frames = vec![identity.clone()];
            if delimited {
                frames.push(Bytes::new());
            }
            frames.extend([seq, payload]);
            ZmqMessage::try_from(frames).ok()
        };
        for (seq, payload) in batches {
            if let Some(message) = reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload) {
                if router.send(message).await.is_err() {
                    break;
                }
            }
        }
        if let Some(end) = reply(Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new()) {
            let _ = router.send(end).await;
        }
    }
}

/// A `KVEventBatch` as msgspec encodes it (see the module's header).
pub fn encode_batch(events: &[KvEvent]) -> Vec<u8> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let events = events.iter().map(encode_event).collect();
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events)]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

fn hashes(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|h| Value::from(*h)).collect())
}

fn encode_event(event: &KvEvent) -> Value {
    match event {
        KvEvent::Stored {
            hashes: stored,
            parent,
            token_ids,
            block_size,
        } => Value::Array(vec![
            Value::from("BlockStored"),
            hashes(stored),
            parent.map_or(Value::Nil, Value::from),
            Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
            Value::from(*block_size),
            Value::Nil,
            Value::from(MEDIUM_GPU),
        ]),
        KvEvent::Removed { hashes: removed } => Value::Array(vec![
            Value::from("BlockRemoved"),
            hashes(removed),
            Value::from(MEDIUM_GPU),
        ]),
        KvEvent::AllCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
    }
}

/// `GET /kv_event_sources` as vLLM 0.32 answers it: the config of each data-parallel rank
/// (one here), keyed by rank.
pub fn sources_body(endpoints: Option<&Endpoints>) -> Vec<u8> {
    let body = match endpoints {
        Some(e) => serde_json::json!({"0": {
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": e.announced,
            "replay_endpoint": e.announced_replay,
            "buffer_steps": e.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": e.topic,
        }}),
        None => serde_json::json!({"0": {
            "enable_kv_cache_events": false,
            "publisher": "null",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": null,
            "buffer_steps": 10_000,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": "",
        }}),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}
