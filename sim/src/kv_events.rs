//! vLLM's KV cache events publisher (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`):
//! a ZMQ PUB socket sending, for each batch of events, the frames `[topic, seq, payload]`
//! (`seq` a big-endian 8-byte counter from 0, `payload` the msgpack of a `KVEventBatch`), and
//! a ZMQ ROUTER socket that replays the batches it still keeps (`buffer_steps` of them) to a
//! DEALER that sends `["", seq]`, the first sequence number it wants: `["", topic, seq,
//! payload]` for each, then `["", "", -1, ""]`.
//!
//! The encoding is msgspec's for vLLM 0.32's structs (checked against what vLLM 0.32's own
//! publisher sends): a batch is `array_like`, `[ts, [event, ...], data_parallel_rank]`
//! (msgspec keeps trailing defaults in arrays); an event is a tagged map, `"type"` first, then
//! its fields in declaration order, those with defaults left out when at their default:
//! `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
//! "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}`,
//! `{"type": "BlockRemoved",
//! "block_hashes", "medium", "group_idx"}` (one per evicted block), `{"type":
//! "AllBlocksCleared"}`. Block hashes are unsigned 64-bit integers, as vLLM sends them by
//! default. `extra_keys` has one entry per block, `null` for a block with none; a salted
//! prompt's first block has `[salt]`, and a LoRA adapter's blocks carry `lora_id`, `lora_name`
//! and its name first in each block's keys: `[[name, salt], [name], ...]`.

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
        tokio::spawn(serve_replay(
            router,
            Arc::clone(&kept),
            Bytes::from(config.topic.clone().into_bytes()),
        ));
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
async fn serve_replay(
    mut router: zeromq::RouterSocket,
    kept: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    topic: Bytes,
) {
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
        // vLLM takes only a DEALER's `[identity, "", seq]`.
        if frames.len() != 3 {
            continue;
        }
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let reply = |topic: Bytes, seq: Bytes, payload: Bytes| {
            ZmqMessage::try_from(vec![identity.clone(), Bytes::new(), topic, seq, payload]).ok()
        };
        for (seq, payload) in batches {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            if let Some(message) = reply(topic.clone(), seq, payload) {
                if router.send(message).await.is_err() {
                    break;
                }
            }
        }
        let end = Bytes::copy_from_slice(&(-1i64).to_be_bytes());
        if let Some(end) = reply(Bytes::new(), end, Bytes::new()) {
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
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events), Value::from(0)]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

fn hashes(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|h| Value::from(*h)).collect())
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn encode_event(event: &KvEvent) -> Value {
    match event {
        KvEvent::Stored {
            hashes: stored,
            parent,
            token_ids,
            block_size,
            salt,
            lora,
        } => {
            let mut fields = vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", hashes(stored)),
                ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                (
                    "lora_id",
                    lora.as_ref().map_or(Value::Nil, |(id, _)| Value::from(*id)),
                ),
                ("medium", Value::from(MEDIUM_GPU)),
                (
                    "lora_name",
                    lora.as_ref()
                        .map_or(Value::Nil, |(_, name)| Value::from(name.as_str())),
                ),
            ];
            fields.push(("extra_keys", extra_keys(stored.len(), salt, lora)));
            fields.push(("group_idx", Value::from(0)));
            // Set from the cache group's spec; its sliding window (none) is left out.
            fields.push(("kv_cache_spec_kind", Value::from("full_attention")));
            map(fields)
        }
        KvEvent::Removed { hashes: removed } => map(vec![
            ("type", Value::from("BlockRemoved")),
            ("block_hashes", hashes(removed)),
            ("medium", Value::from(MEDIUM_GPU)),
            ("group_idx", Value::from(0)),
        ]),
        KvEvent::AllCleared => map(vec![("type", Value::from("AllBlocksCleared"))]),
    }
}

/// Per block its extra keys, untagged as vLLM publishes them: the adapter's name on every
/// block, then the salt on the first; `nil` for a block with none.
fn extra_keys(blocks: usize, salt: &Option<String>, lora: &Option<(u32, String)>) -> Value {
    let keys = (0..blocks)
        .map(|index| {
            let mut keys = Vec::new();
            if let Some((_, name)) = lora {
                keys.push(Value::from(name.as_str()));
            }
            if let Some(salt) = salt.as_ref().filter(|_| index == 0) {
                keys.push(Value::from(salt.as_str()));
            }
            if keys.is_empty() {
                Value::Nil
            } else {
                Value::Array(keys)
            }
        })
        .collect();
    Value::Array(keys)
}

/// `GET /kv_event_sources` as vLLM 0.32 answers it: the publisher's config for each
/// data-parallel rank (one here), keyed by rank; `{}` when events are off.
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
        None => serde_json::json!({}),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}
