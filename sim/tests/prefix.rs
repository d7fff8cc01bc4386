#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! vLLM V1's engine: automatic prefix caching with its metrics and usage details, KV cache
//! events over ZMQ in vLLM's encoding (and their replay), and chunked prefill.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use sluice_tokenizer::PromptTokenizer;
use vllm_sim::{KvEventsConfig, Latency, SimConfig};
use zeromq::{Socket, SocketRecv, SocketSend};

const CHAT: &str = "/v1/chat/completions";

fn tokenizer_dir() -> String {
    format!("{FIXTURES}/tokenizer-chatml")
}

fn conversation(turns: usize) -> Value {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a careful assistant. ".repeat(12)})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Question {turn}: what does block {turn} hold?")}));
        messages
            .push(json!({"role": "assistant", "content": format!("Block {turn} holds tokens.")}));
    }
    messages.push(json!({"role": "user", "content": "And now?"}));
    json!({"model": MODEL, "messages": messages, "max_tokens": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_caching_serves_a_conversations_history_and_publishes_its_blocks() {
    let config = SimConfig::default()
        .with_tokenizer(tokenizer_dir())
        .v1_engine(2048)
        .with_kv_events(KvEventsConfig::default());
    let sim = sim(config).await;
    // Announced as vLLM 0.32 does: keyed by rank, the host a wildcard.
    let sources = get_json(&format!("{}/kv_event_sources", sim.url())).await;
    let rank = &sources["0"];
    assert_eq!(rank["enable_kv_cache_events"], json!(true));
    assert_eq!(rank["publisher"], json!("zmq"));
    let (publisher, replay) = sim.kv_event_endpoints().unwrap();
    let port = publisher.rsplit(':').next().unwrap();
    assert_eq!(rank["endpoint"], json!(format!("tcp://*:{port}")));
    let mut sub = live_subscriber(&sim).await;
    let tokenizer = PromptTokenizer::load(std::path::Path::new(&tokenizer_dir())).unwrap();
    let first = conversation(1);
    let ids = tokenizer
        .chat(&serde_json::to_vec(&first).unwrap())
        .unwrap();
    let (status, answer) = post(&sim, CHAT, &first).await;
    assert_eq!(status, 200, "{answer}");
    // The engine counts what the tokenizer makes of the chat template.
    assert_eq!(answer["usage"]["prompt_tokens"], json!(ids.len()));
    // As vLLM 0.32 writes it: the whole blocks computed are created in the cache.
    let blocks = ids.len() / 16 * 16;
    assert_eq!(
        answer["usage"]["prompt_tokens_details"],
        json!({"cached_tokens": 0, "created_cache_tokens": blocks, "multimodal_tokens": null})
    );
    let (_, batch) = next_batch(&mut sub).await;
    let stored = &batch[1][0];
    // As vLLM 0.32 sends it: a batch [ts, events, rank], each event a map, "type" first.
    assert_eq!(batch.as_array().unwrap().len(), 3);
    assert_eq!(batch[2].as_u64(), Some(0));
    let keys: Vec<&str> = stored
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind"
        ]
    );
    assert_eq!(field(stored, "type").as_str(), Some("BlockStored"));
    let blocks = ids.len() / 16;
    assert_eq!(
        field(stored, "block_hashes").as_array().unwrap().len(),
        blocks
    );
    assert!(
        field(stored, "parent_block_hash").is_nil(),
        "the prompt's first block has no parent"
    );
    let token_ids: Vec<u32> = field(stored, "token_ids")
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(token_ids, ids[..blocks * 16].to_vec());
    assert_eq!(field(stored, "block_size").as_u64(), Some(16));
    assert_eq!(field(stored, "medium").as_str(), Some("GPU"));
    // One entry per block, none with extra keys (no adapter, no salt).
    let extra = field(stored, "extra_keys").as_array().unwrap();
    assert_eq!(extra.len(), blocks);
    assert!(extra.iter().all(rmpv::Value::is_nil));
    assert_eq!(
        field(stored, "kv_cache_spec_kind").as_str(),
        Some("full_attention")
    );

    // The next turn shares the history: served from the cache, counted as vLLM counts it.
    let before = sim.metrics_text();
    let second = conversation(2);
    let (status, answer) = post(&sim, CHAT, &second).await;
    assert_eq!(status, 200);
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The blocks the two prompts share whole: the history, up to the first turn's last
    // question.
    let second_ids = tokenizer
        .chat(&serde_json::to_vec(&second).unwrap())
        .unwrap();
    let shared = ids
        .iter()
        .zip(&second_ids)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared > 100);
    assert_eq!(
        cached as usize,
        shared / 16 * 16,
        "every block the prompts share"
    );
    let after = sim.metrics_text();
    let hits = metric_value(&after, "vllm:prefix_cache_hits_total")
        - metric_value(&before, "vllm:prefix_cache_hits_total");
    assert_eq!(hits as u64, cached);
    let queries = metric_value(&after, "vllm:prefix_cache_queries_total")
        - metric_value(&before, "vllm:prefix_cache_queries_total");
    assert_eq!(
        queries as u64,
        answer["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    // Its new blocks chain on the last cached one.
    let (_, batch) = next_batch(&mut sub).await;
    let stored = &batch[1][0];
    assert_eq!(field(stored, "type").as_str(), Some("BlockStored"));
    assert!(
        field(stored, "parent_block_hash").as_u64().is_some(),
        "chained on a parent"
    );

    // The replay socket sends what it kept from a sequence number on, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay.unwrap()).await.unwrap();
    let mut ask = zeromq::ZmqMessage::from(bytes::Bytes::new());
    ask.push_back(bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()));
    dealer.send(ask).await.unwrap();
    let mut replayed = 0;
    loop {
        let frames = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        // ["", topic, seq, payload], as vLLM's ROUTER answers a DEALER.
        assert_eq!(frames.len(), 4);
        let seq = i64::from_be_bytes(frames[2].as_ref().try_into().unwrap());
        if seq == -1 {
            break;
        }
        assert_eq!(seq, replayed);
        replayed += 1;
    }
    assert!(replayed >= 2, "every batch kept is replayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_long_prefill_threshold_a_short_prompt_is_not_held_behind_a_long_prefill() {
    // 512 tokens a step at 0.5 ms a token: the long prompt takes several steps, at most 128
    // tokens of each while another prompt waits.
    let latency = Latency::new(
        Duration::ZERO,
        Duration::from_micros(500),
        Duration::from_millis(5),
    );
    let config = SimConfig::default()
        .with_latency(latency)
        .with_answer_tokens(2, 2)
        .v1_engine(512)
        .with_long_prefill_token_threshold(128);
    let sim = sim(config).await;
    let long = streaming(chat_body(&"many words of a long document ".repeat(400)));
    let short = streaming(chat_body("hi"));
    let long_sim = sim.clone();
    let long_first = tokio::spawn(async move {
        let mut response = send(&long_sim, CHAT, &long).await;
        response.chunk().await.unwrap();
        std::time::Instant::now()
    });
    // Once the long prompt is prefilling, the short one comes.
    wait_until(
        || sim.engine_state().running == 1,
        "the long prompt running",
    )
    .await;
    let mut response = send(&sim, CHAT, &short).await;
    response.chunk().await.unwrap();
    let short_first = std::time::Instant::now();
    let long_first = long_first.await.unwrap();
    assert!(
        short_first < long_first,
        "the short prompt's first token came before the long prompt's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_stretches_the_running_streams_inter_token_latency() {
    // Steps of 512 tokens at 0.5 ms a token: 256 ms each while a prompt prefills; a decode
    // step alone is 5 ms.
    let latency = Latency::new(
        Duration::ZERO,
        Duration::from_micros(500),
        Duration::from_millis(5),
    );
    let config = SimConfig::default()
        .with_latency(latency)
        .with_answer_tokens(400, 400)
        .v1_engine(512);
    let sim = sim(config).await;
    let mut decoding = send(&sim, CHAT, &streaming(chat_body("hi"))).await;
    // The stream is decoding: its first token came. It is read to its end from now on, so
    // that no token waits for its reader.
    decoding.chunk().await.unwrap();
    let drain = tokio::spawn(async move { while let Ok(Some(_)) = decoding.chunk().await {} });
    let body = chat_body(&"many words of a long document ".repeat(300));
    let (status, _) = post(&sim, CHAT, &body).await;
    assert_eq!(status, 200);
    // While the prompt prefilled (about 2,300 tokens: five steps), the stream's tokens came
    // with the prefill's steps: the engine's own inter-token histogram has the gaps.
    let long_gaps = itl_over_200ms(&sim.metrics_text());
    assert!(
        long_gaps >= 3.0,
        "decodes waited for prefill steps {long_gaps} times (5 ms apart alone)"
    );
    drain.abort();
}

/// The inter-token latencies over 200 ms in a `/metrics` page: the histogram's count less
/// its `le="0.2"` bucket.
fn itl_over_200ms(page: &str) -> f64 {
    let value = |prefix: &str, with: &str| {
        page.lines()
            .find(|l| l.starts_with(prefix) && l.contains(with))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    value("vllm:inter_token_latency_seconds_count", "")
        - value("vllm:inter_token_latency_seconds_bucket", "le=\"0.2\"")
}
