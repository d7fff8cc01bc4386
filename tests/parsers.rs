//! Property tests of the parsers that face the network: a client's request body, an
//! upstream's event stream and answer (usage, model name, context refusals), a backend's
//! Prometheus page. Arbitrary bytes never panic them, and what they find does not depend on
//! how the bytes were cut into chunks, which the network decides.
//!
//! Bounded for CI by `PROPTEST_CASES` (default 256 cases a property); a failing case is kept
//! in `tests/parsers.proptest-regressions` and tried first on every later run.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use proptest::prelude::*;
use sluice::health::exposition;
use sluice_sdk::sse::SseEvents;
use sluice_sdk::usage::UsageScanner;
use sluice_sdk::{context, Endpoint, LlmCall, ModelRewriter};

/// `bytes` cut at `cuts` (positions, taken modulo its length, in any order).
fn chunks(bytes: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| if bytes.is_empty() { 0 } else { c % bytes.len() })
        .collect();
    at.push(0);
    at.push(bytes.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2)
        .map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]]))
        .collect()
}

/// The events `SseEvents` finds in `pieces`, in order, the unfinished rest last.
fn events_of(pieces: &[Bytes]) -> Vec<Vec<u8>> {
    let mut split = SseEvents::default();
    let mut events = Vec::new();
    for piece in pieces {
        split.split(piece, |event| events.push(event.to_vec()));
    }
    let rest = split.take_rest();
    if !rest.is_empty() {
        events.push(rest);
    }
    events
}

/// A stream of `data:` events with these payloads (no line breaks in them), and its usage.
fn sse_stream(payloads: &[String], usage: (u32, u32)) -> Vec<u8> {
    let mut text = String::new();
    for p in payloads {
        text.push_str(&format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":{p:?}}}}}]}}\n\n"
        ));
    }
    text.push_str(&format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"total_tokens\":{},\"completion_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
        usage.0,
        u64::from(usage.0) + u64::from(usage.1),
        usage.1
    ));
    text.into_bytes()
}

/// A chat request body with these messages, model and budget.
fn chat_body(model: &str, messages: &[String], max_tokens: u32) -> Vec<u8> {
    let messages: Vec<_> = messages
        .iter()
        .map(|m| serde_json::json!({"role": "user", "content": m}))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "model": model, "messages": messages, "max_tokens": max_tokens}))
    .unwrap()
}

proptest! {
    #[test]
    fn the_request_parse_never_panics_on_any_body(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
            let _ = LlmCall::parse(endpoint, Bytes::from(body.clone()));
        }
    }

    #[test]
    fn a_valid_request_parses_to_what_it_says_and_a_cut_one_is_refused(
        model in "[a-zA-Z0-9./_-]{1,40}",
        messages in proptest::collection::vec("\\PC{0,60}", 1..6),
        max_tokens in 1u32..100_000,
        cut in any::<usize>(),
    ) {
        let body = chat_body(&model, &messages, max_tokens);
        let call = LlmCall::parse(Endpoint::ChatCompletions, Bytes::from(body.clone())).unwrap();
        prop_assert_eq!(call.request.model.as_deref(), Some(model.as_str()));
        prop_assert_eq!(call.request.messages.as_ref().map(|m| m.len()), Some(messages.len()));
        prop_assert_eq!(call.request.max_output_tokens(), Some(max_tokens));
        let texts: Vec<String> = call.request.messages.as_ref().unwrap().iter()
            .map(|m| match m.content {
                Some(sluice_sdk::request::Content::Text(t)) => t.to_str().into_owned(),
                _ => String::new(),
            })
            .collect();
        prop_assert_eq!(&texts, &messages);
        // Any strict prefix of a JSON object is not one.
        let cut = cut % body.len();
        let short = LlmCall::parse(Endpoint::ChatCompletions, Bytes::copy_from_slice(&body[..cut]));
        prop_assert!(short.is_err());
    }

    #[test]
    fn events_are_the_same_however_the_stream_is_cut(
        payloads in proptest::collection::vec("[^\r\n]{0,40}", 0..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let stream = sse_stream(&payloads, (7, 3));
        let whole = events_of(&[Bytes::from(stream.clone())]);
        prop_assert_eq!(whole.len(), payloads.len() + 2);
        prop_assert_eq!(events_of(&chunks(&stream, &cuts)), whole);
    }

    #[test]
    fn the_event_splitter_never_panics_and_loses_no_byte(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let events = events_of(&chunks(&bytes, &cuts));
        prop_assert_eq!(events.concat(), bytes);
    }

    #[test]
    fn the_usage_is_found_however_the_answer_is_cut(
        payloads in proptest::collection::vec("[^\r\n]{0,40}", 0..6),
        prompt in 0u32..1_000_000,
        completion in 0u32..1_000_000,
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let stream = sse_stream(&payloads, (prompt, completion));
        let mut scanner = UsageScanner::default();
        for piece in chunks(&stream, &cuts) {
            scanner.feed(&piece);
        }
        let usage = scanner.usage().unwrap();
        prop_assert_eq!((usage.prompt_tokens, usage.completion_tokens), (u64::from(prompt), u64::from(completion)));
    }

    #[test]
    fn the_usage_scanner_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut scanner = UsageScanner::default();
        for piece in chunks(&bytes, &cuts) {
            scanner.feed(&piece);
        }
        let _ = scanner.usage();
    }

    #[test]
    fn the_model_name_is_rewritten_however_the_answer_is_cut(
        served in "[a-z0-9/_.-]{1,30}",
        asked in "[a-z0-9/_.-]{1,30}",
        payloads in proptest::collection::vec("[^\r\n]{0,40}", 0..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut answer = Vec::new();
        for p in &payloads {
            answer.extend_from_slice(format!("data: {{\"model\":{served:?},\"content\":{p:?}}}\n\n").as_bytes());
        }
        let rewrite = |pieces: Vec<Bytes>| {
            let mut rewriter = ModelRewriter::new(&served, &asked);
            let last = pieces.len().saturating_sub(1);
            let mut out = Vec::new();
            for (i, piece) in pieces.into_iter().enumerate() {
                if let Some(b) = rewriter.rewrite(Some(piece), i == last) {
                    out.extend_from_slice(&b);
                }
            }
            out
        };
        let whole = rewrite(vec![Bytes::from(answer.clone())]);
        prop_assert_eq!(rewrite(chunks(&answer, &cuts)), whole.clone());
        let expected = String::from_utf8(answer).unwrap()
            .replace(&format!("\"model\":{served:?}"), &format!("\"model\":{asked:?}"));
        prop_assert_eq!(String::from_utf8(whole).unwrap(), expected);
    }

    #[test]
    fn the_context_readers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), budget in any::<u64>()) {
        let _ = context::is_context_length_error(&bytes);
        let _ = context::cut_by_context(&bytes, budget);
    }

    #[test]
    fn a_metrics_page_never_panics_the_parsers(text in "\\PC{0,400}") {
        let _ = exposition::parse(&text);
        let _ = exposition::read_page(
            text.as_bytes(),
            &exposition::Limits::default(),
            |_| true,
            |_| true,
        );
    }

    #[test]
    fn every_well_formed_sample_is_read(
        values in proptest::collection::vec((0u8..8, -1.0e9f64..1.0e9), 1..20),
    ) {
        let mut text = String::new();
        for (i, (label, value)) in values.iter().enumerate() {
            text.push_str(&format!("vllm:m{i}{{engine=\"{label}\"}} {value}\n"));
        }
        let samples = exposition::parse(&text).unwrap();
        prop_assert_eq!(samples.len(), values.len());
    }
}

/// A cache entry as a store could hold it: well-formed around an `answer` of any JSON.
fn stored_entry(answer: &str, kind: &str) -> Vec<u8> {
    format!(
        r#"{{"digest":"{}","created_unix":1,"kind":"{kind}","pool":"p","answer":{answer}}}"#,
        "ab".repeat(32)
    )
    .into_bytes()
}

/// Arbitrary JSON text, nested a few levels, with the names an answer has.
fn json_text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        "\\PC{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        let key = prop_oneof![
            Just("choices".to_string()),
            Just("message".to_string()),
            Just("content".to_string()),
            Just("text".to_string()),
            Just("usage".to_string()),
            Just("index".to_string()),
            Just("finish_reason".to_string()),
            "[a-z_]{1,8}",
        ];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|items| format!("[{}]", items.join(","))),
            proptest::collection::vec((key, inner), 0..4).prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(k, v)| format!("{}:{v}", serde_json::to_string(&k).unwrap()))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

proptest! {
    /// What a Redis holds is read back as a cache entry, or refused: arbitrary bytes never
    /// panic the decode, and an entry that decodes, whatever its answer, renders as JSON and
    /// as a stream without panicking (a store is a network peer: it may be wrong or hostile).
    #[test]
    fn a_stored_cache_entry_is_read_or_refused_never_a_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        answer in json_text(),
        stream in any::<bool>(),
        chat in any::<bool>(),
    ) {
        use sluice_plugin_cache::entry::Entry;
        let _ = Entry::decode(&bytes);
        let kind = if chat { "chat" } else { "completion" };
        if let Ok(entry) = Entry::decode(&stored_entry(&answer, kind)) {
            if stream {
                let _ = entry.render_sse("id", 1, true);
            } else {
                let _ = entry.render_json("id", 1);
            }
        }
    }
}

// ---- The peers' decoders: KV-event batches, `/kv_event_sources`, Messages and Responses
// streams' usage.

use rmpv::Value as Msgpack;
use sluice_sdk::prefix_index::{KvEventBatch, PrefixIndex, MAX_BLOCKS_PER_BACKEND, MAX_BLOCK_SIZE};

/// One KV event as vLLM writes it, or as a lying publisher might: any tag, any block size, any
/// hash and token lists, in msgspec's array form or as a map.
fn kv_event() -> impl Strategy<Value = Msgpack> {
    let hashes = proptest::collection::vec(any::<u64>().prop_map(Msgpack::from), 0..8);
    let tokens = proptest::collection::vec(any::<u32>().prop_map(Msgpack::from), 0..64);
    let size = prop_oneof![
        Just(16u64),
        Just(0u64),
        Just(1u64 << 40),
        any::<u64>(),
        1u64..64
    ];
    let tag = prop_oneof![
        Just("BlockStored"),
        Just("BlockRemoved"),
        Just("AllBlocksCleared"),
        Just("SomethingNew"),
    ];
    (
        tag,
        hashes,
        tokens,
        size,
        any::<Option<u64>>(),
        any::<bool>(),
    )
        .prop_map(|(tag, hashes, tokens, size, parent, as_map)| {
            let parent = parent.map_or(Msgpack::Nil, Msgpack::from);
            let fields = match tag {
                "BlockStored" => vec![
                    Msgpack::Array(hashes),
                    parent,
                    Msgpack::Array(tokens),
                    Msgpack::from(size),
                    Msgpack::Nil,
                    "GPU".into(),
                ],
                "BlockRemoved" => vec![Msgpack::Array(hashes), "GPU".into()],
                _ => Vec::new(),
            };
            if as_map {
                let names = [
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                ];
                let mut map = vec![(Msgpack::from("type"), Msgpack::from(tag))];
                let names: &[&str] = if tag == "BlockRemoved" {
                    &["block_hashes", "medium"]
                } else {
                    &names
                };
                map.extend(
                    names
                        .iter()
                        .zip(fields)
                        .map(|(n, v)| (Msgpack::from(*n), v)),
                );
                Msgpack::Map(map)
            } else {
                let mut items = vec![Msgpack::from(tag)];
                items.extend(fields);
                Msgpack::Array(items)
            }
        })
}

fn msgpack(value: &Msgpack) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

proptest! {
    #[test]
    fn a_kv_event_batch_decoder_never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = KvEventBatch::decode(&bytes);
    }

    /// Whatever a publisher sends, in either encoding, the index stays within its bounds:
    /// its block size one an engine could have, its blocks per backend capped.
    #[test]
    fn any_batch_in_either_encoding_leaves_the_index_in_bounds(
        events in proptest::collection::vec(kv_event(), 0..16),
        as_map in any::<bool>(),
        cut in any::<usize>(),
    ) {
        let batch = if as_map {
            Msgpack::Map(vec![
                (Msgpack::from("ts"), Msgpack::F64(1.0)),
                (Msgpack::from("events"), Msgpack::Array(events)),
            ])
        } else {
            Msgpack::Array(vec![Msgpack::F64(1.0), Msgpack::Array(events)])
        };
        let bytes = msgpack(&batch);
        // A cut batch is refused or read; never a panic.
        let _ = KvEventBatch::decode(&bytes[..cut % (bytes.len() + 1)]);
        // A batch with an event that is not one (fewer token ids than its blocks) is
        // refused whole; any other is applied.
        let Ok(decoded) = KvEventBatch::decode(&bytes) else {
            return Ok(());
        };
        let index = PrefixIndex::default();
        let backend = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
        index.apply(backend, &decoded.events);
        prop_assert!((1..=MAX_BLOCK_SIZE).contains(&index.block_size()));
        prop_assert!(index.blocks_of(backend) <= MAX_BLOCKS_PER_BACKEND);
        let _ = index.lookup(&[1, 2, 3]);
    }

    /// Whatever a backend's `/kv_event_sources` says, at most 16 ranks are followed, all on
    /// the backend's own address.
    #[test]
    fn a_backends_kv_event_sources_never_name_another_host(
        entries in proptest::collection::vec(
            (prop_oneof![Just("*".to_string()), Just("10.1.2.3".to_string()), Just("10.9.9.9".to_string()),
                          Just("evil.example".to_string()), Just("[::]".to_string()), "\\PC{0,12}"],
             any::<u16>(), "\\PC{0,8}"),
            0..40),
        wrapped in any::<bool>(),
    ) {
        let list: Vec<serde_json::Value> = entries
            .iter()
            .map(|(host, port, topic)| serde_json::json!({"endpoint": format!("tcp://{host}:{port}"), "topic": topic}))
            .collect();
        let body = if wrapped { serde_json::json!({"sources": list}) } else { serde_json::json!(list) };
        let backend: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        let sources = sluice::health::kv_events::sources(body.to_string().as_bytes(), backend);
        prop_assert!(sources.len() <= 16);
        for source in sources {
            prop_assert!(source.endpoint.starts_with("tcp://10.1.2.3:"), "{}", source.endpoint);
        }
    }

    /// A Responses stream whose echoed `tools` hold a `usage` of the client's making: only
    /// the response's own usage is read, however the stream is cut.
    #[test]
    fn a_responses_streams_usage_is_its_own_however_cut(
        planted in (any::<u32>(), any::<u32>()),
        real in (1u32..100_000, 1u32..100_000),
        deltas in proptest::collection::vec("\\PC{0,16}", 0..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let tools = serde_json::json!([{"type": "function", "name": "f", "parameters":
            {"usage": {"input_tokens": planted.0, "output_tokens": planted.1}}}]);
        let mut text = format!(
            "event: response.created\ndata: {}\n\n",
            serde_json::json!({"type": "response.created", "response": {"id": "resp_1", "tools": tools, "usage": null}})
        );
        for delta in &deltas {
            text.push_str(&format!(
                "event: response.output_text.delta\ndata: {}\n\n",
                serde_json::json!({"type": "response.output_text.delta", "delta": delta})
            ));
        }
        let cut_at = text.len();
        text.push_str(&format!(
            "event: response.completed\ndata: {}\n\n",
            serde_json::json!({"type": "response.completed", "response": {"id": "resp_1", "tools": tools,
                "usage": {"input_tokens": real.0, "output_tokens": real.1, "total_tokens": real.0 + real.1}}})
        ));
        let family = Endpoint::Responses.family();
        let read = |bytes: &[u8]| {
            let mut scanner = family.usage_scanner(true);
            for piece in chunks(bytes, &cuts) {
                scanner.feed(&piece);
            }
            scanner.usage().map(|u| (u.prompt_tokens, u.completion_tokens))
        };
        prop_assert_eq!(read(&text.as_bytes()[..cut_at]), None);
        prop_assert_eq!(read(text.as_bytes()), Some((u64::from(real.0), u64::from(real.1))));
    }

    /// A Messages stream: the input from `message_start`, the output from `message_delta`,
    /// however it is cut; a tool call's input (an object the model writes) never counts.
    #[test]
    fn a_messages_streams_usage_is_read_where_the_api_puts_it(
        input in 1u32..100_000,
        output in 1u32..100_000,
        planted in any::<u32>(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let events = [
            serde_json::json!({"type": "message_start", "message": {"id": "m", "content": [],
                "usage": {"input_tokens": input, "output_tokens": 0}}}),
            serde_json::json!({"type": "content_block_start", "index": 0, "content_block":
                {"type": "tool_use", "id": "t", "name": "f", "input": {"usage": {"input_tokens": planted, "output_tokens": planted}}}}),
            serde_json::json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"input_tokens": input, "output_tokens": output}}),
            serde_json::json!({"type": "message_stop"}),
        ];
        let text: String = events
            .iter()
            .map(|e| format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap()))
            .collect();
        let mut scanner = Endpoint::Messages.family().usage_scanner(true);
        for piece in chunks(text.as_bytes(), &cuts) {
            scanner.feed(&piece);
        }
        let usage = scanner.usage().unwrap();
        prop_assert_eq!((usage.prompt_tokens, usage.completion_tokens), (u64::from(input), u64::from(output)));
    }
}
