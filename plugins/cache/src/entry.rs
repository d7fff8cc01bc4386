//! A cached answer: the request's API family, the answer in the family's kept form (for the
//! OpenAI families, the non-stream object, whatever form filled it), its pool and age. The
//! family makes the kept form from a JSON answer or a whole stream, and replays it in the
//! form a client asks for, with a fresh `id` and `created` (see
//! [`sluice_sdk::family::ApiFamily`]).
//!
//! An entry keeps its answer's `usage` whatever form filled it: a stream whose client did not
//! ask for usage has no usage chunk by the time the cache sees it, so the usage the core found
//! ([`sluice_sdk::RequestCtx::usage`], which the cache asks for) is put in its place.

use serde::{Deserialize, Serialize};
use sluice_sdk::{AnswerError, AnswerText, Endpoint};

/// Why an answer is not stored (the family's verdict on it).
pub type NotStored = AnswerError;

/// The label of `sluice_cache_writes_total` for an answer not stored.
pub fn not_stored_label(why: NotStored) -> &'static str {
    match why {
        NotStored::Incomplete | NotStored::ErrorEvent => "incomplete",
        NotStored::NotAnAnswer => "not_ok",
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// SHA-256 of the cache key: checked on every hit, so a store keyed by less than the
    /// whole digest can never serve another prompt's answer.
    #[serde(with = "hex_digest")]
    pub digest: [u8; 32],
    /// When the answer was made (Unix seconds), for `age`.
    pub created_unix: u64,
    /// The answer's API family (stored as `chat` or `completion`).
    pub kind: Endpoint,
    /// The pool that produced the answer.
    pub pool: String,
    /// The answer in the family's kept form, as JSON text.
    pub answer: AnswerText,
    /// How many bytes the upstream's answer had; not stored, only weighed.
    #[serde(skip)]
    pub source_bytes: usize,
}

/// Equal when every field is, the answer compared as text.
impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest
            && self.created_unix == other.created_unix
            && self.kind == other.kind
            && self.pool == other.pool
            && self.answer.get() == other.answer.get()
            && self.source_bytes == other.source_bytes
    }
}

impl Entry {
    /// The stored form (JSON).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a cache entry: {e}"))
    }

    /// The memory the entry holds, for the memory store's budget: its answer's size as the
    /// upstream sent it (the assembled form is about as large), plus the fixed fields.
    pub fn weight(&self) -> usize {
        self.source_bytes + self.pool.len() + 96
    }

    /// The answer as a JSON body, with this response's `id` and `created`.
    pub fn render_json(&self, id: &str, created: u64) -> bytes::Bytes {
        self.kind.family().render_json(&self.answer, id, created)
    }

    /// The answer as its family's event stream, with this response's `id` and `created`.
    pub fn render_sse(&self, id: &str, created: u64, include_usage: bool) -> bytes::Bytes {
        self.kind
            .family()
            .render_stream(&self.answer, id, created, include_usage)
    }
}

/// A non-stream answer, kept as sent once its family knows it whole.
pub fn from_json(kind: Endpoint, body: bytes::Bytes) -> Result<AnswerText, NotStored> {
    kind.family().answer_from_json(body)
}

/// The kept form a complete event stream adds up to, with `usage` when it carried none. The
/// proxy adds a stream up as it passes (`live::Writer::answer`); the tests read whole ones.
#[cfg(test)]
pub fn from_sse(
    kind: Endpoint,
    chunks: &[bytes::Bytes],
    usage: Option<sluice_sdk::Usage>,
) -> Result<AnswerText, NotStored> {
    kind.family().answer_from_stream(chunks, usage)
}

mod hex_digest {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        let bytes = hex::decode(&text).map_err(serde::de::Error::custom)?;
        bytes
            .try_into()
            .map_err(|_| serde::de::Error::custom("a digest is 32 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use serde_json::value::RawValue;
    use serde_json::Value;
    use sluice_sdk::Usage;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    fn entry(kind: Endpoint, answer: Value) -> Entry {
        Entry {
            digest: [7; 32],
            created_unix: 1,
            kind,
            pool: "draft".into(),
            answer: serde_json::value::to_raw_value(&answer).unwrap().into(),
            source_bytes: 0,
        }
    }

    fn tree(answer: AnswerText) -> Value {
        serde_json::from_str(answer.get()).unwrap()
    }

    /// [`from_json`], parsed for the assertions.
    fn json_answer(kind: Endpoint, body: &[u8]) -> Result<Value, NotStored> {
        from_json(kind, Bytes::copy_from_slice(body)).map(tree)
    }

    /// [`from_sse`], parsed for the assertions.
    fn sse_answer(kind: Endpoint, chunks: &[Bytes]) -> Result<Value, NotStored> {
        from_sse(kind, chunks, None).map(tree)
    }

    /// The stream split into arbitrary pieces, as a network would.
    fn pieces(bytes: &[u8], size: usize) -> Vec<Bytes> {
        bytes.chunks(size).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn a_vllm_stream_assembles_to_its_answer() {
        let sse = fixture("vllm-chat-stream.sse");
        let answer = sse_answer(Endpoint::ChatCompletions, &pieces(&sse, 7)).unwrap();
        let choice = &answer["choices"][0];
        assert_eq!(
            choice["message"]["content"],
            "Paris is the capital of France."
        );
        assert_eq!(choice["message"]["role"], "assistant");
        assert_eq!(choice["finish_reason"], "stop");
        assert_eq!(answer["usage"]["completion_tokens"], 8);
        assert_eq!(answer["object"], "chat.completion");
    }

    #[test]
    fn a_stream_without_done_or_with_an_error_event_is_not_stored() {
        let sse = String::from_utf8(fixture("vllm-chat-stream.sse")).unwrap();
        let cut = sse.replace("data: [DONE]\n\n", "");
        assert_eq!(
            sse_answer(Endpoint::ChatCompletions, &[Bytes::from(cut)]),
            Err(NotStored::Incomplete)
        );
        let no_finish: String = sse
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"finish_reason\":\"stop\""))
            .collect();
        assert_eq!(
            sse_answer(Endpoint::ChatCompletions, &[Bytes::from(no_finish)]),
            Err(NotStored::Incomplete)
        );
        let errored = sse.replace(
            "data: [DONE]",
            "data: {\"error\": {\"message\": \"boom\", \"code\": 500}}\n\ndata: [DONE]",
        );
        assert_eq!(
            sse_answer(Endpoint::ChatCompletions, &[Bytes::from(errored)]),
            Err(NotStored::ErrorEvent)
        );
    }

    #[test]
    fn json_answers_are_kept_when_whole() {
        let body = fixture("vllm-chat-completion.json");
        let answer = json_answer(Endpoint::ChatCompletions, &body).unwrap();
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            "Paris is the capital of France."
        );
        assert_eq!(
            json_answer(Endpoint::Completions, &body),
            Err(NotStored::NotAnAnswer)
        );
        assert_eq!(
            json_answer(Endpoint::ChatCompletions, &fixture("vllm-error-new.json")),
            Err(NotStored::NotAnAnswer)
        );
        assert_eq!(
            json_answer(Endpoint::ChatCompletions, &body[..body.len() / 2]),
            Err(NotStored::NotAnAnswer)
        );
    }

    #[test]
    fn a_json_answer_is_the_upstreams_bytes_shared_and_survives_the_stored_form() {
        let mut padded = b" \n".to_vec();
        padded.extend_from_slice(&fixture("vllm-chat-completion.json"));
        padded.extend_from_slice(b"\r\n");
        let body = Bytes::from(padded);
        let answer = from_json(Endpoint::ChatCompletions, body.clone()).unwrap();
        let inside = body.as_ptr_range().contains(&answer.get().as_ptr());
        assert!(inside, "a slice of the upstream's body, not a copy");
        assert!(answer.get().starts_with('{') && answer.get().ends_with('}'));
        let mut stored = entry(Endpoint::ChatCompletions, Value::Null);
        stored.answer = answer;
        let back = Entry::decode(&stored.encode()).unwrap();
        assert_eq!(back, stored, "the stored form keeps the text exactly");
        assert_eq!(
            tree(back.answer)["choices"][0]["message"]["content"],
            "Paris is the capital of France."
        );
    }

    #[test]
    fn json_to_stream_and_back_keeps_the_answer() {
        for (kind, file) in [
            (Endpoint::ChatCompletions, "vllm-chat-completion.json"),
            (Endpoint::Completions, "vllm-completion.json"),
        ] {
            let original = json_answer(kind, &fixture(file)).unwrap();
            let e = entry(kind, original.clone());
            let sse = e.render_sse("fresh-id", 42, true);
            let text = std::str::from_utf8(&sse).unwrap();
            assert!(text.starts_with("data: {"), "{text}");
            assert!(text.ends_with("data: [DONE]\n\n"));
            assert!(text.contains("\"choices\":[]"), "usage chunk: {text}");
            let back = sse_answer(kind, &pieces(&sse, 13)).unwrap();
            assert_eq!(back["id"], "fresh-id");
            assert_eq!(back["created"], 42);
            assert_eq!(
                back["choices"][0]["finish_reason"],
                original["choices"][0]["finish_reason"]
            );
            assert_eq!(back["usage"], original["usage"]);
            match kind {
                Endpoint::ChatCompletions => assert_eq!(
                    back["choices"][0]["message"]["content"],
                    original["choices"][0]["message"]["content"]
                ),
                _ => assert_eq!(back["choices"][0]["text"], original["choices"][0]["text"]),
            }
        }
    }

    #[test]
    fn the_usage_chunk_comes_only_when_asked() {
        let original = json_answer(
            Endpoint::ChatCompletions,
            &fixture("vllm-chat-completion.json"),
        )
        .unwrap();
        let sse = entry(Endpoint::ChatCompletions, original).render_sse("x", 1, false);
        assert!(!std::str::from_utf8(&sse).unwrap().contains("\"usage\""));
    }

    #[test]
    fn a_stream_without_its_usage_chunk_keeps_the_usage_the_core_found() {
        let sse = String::from_utf8(fixture("vllm-chat-stream.sse")).unwrap();
        let without: String = sse
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"usage\""))
            .collect();
        let found = Some(Usage {
            prompt_tokens: 24,
            completion_tokens: 8,
        });
        assert_eq!(
            sse_answer(Endpoint::ChatCompletions, &[Bytes::from(without.clone())]).unwrap()
                ["usage"],
            Value::Null
        );
        let answer =
            tree(from_sse(Endpoint::ChatCompletions, &[Bytes::from(without)], found).unwrap());
        assert_eq!(
            answer["usage"],
            serde_json::json!({"prompt_tokens": 24, "total_tokens": 32, "completion_tokens": 8})
        );
        // Served as a stream with the usage chunk asked for, it has one.
        let e = entry(Endpoint::ChatCompletions, answer.clone());
        let back = sse_answer(Endpoint::ChatCompletions, &[e.render_sse("x", 1, true)]).unwrap();
        assert_eq!(back["usage"], answer["usage"]);
        // The stream's own usage chunk, when it had one, is kept as sent.
        let other = Some(Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
        });
        let own = tree(from_sse(Endpoint::ChatCompletions, &[Bytes::from(sse)], other).unwrap());
        assert_eq!(own["usage"]["completion_tokens"], 8);
    }

    #[test]
    fn json_hits_get_a_fresh_id_and_created() {
        let original = json_answer(
            Endpoint::ChatCompletions,
            &fixture("vllm-chat-completion.json"),
        )
        .unwrap();
        let body =
            entry(Endpoint::ChatCompletions, original.clone()).render_json("chatcmpl-new", 99);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["id"], "chatcmpl-new");
        assert_eq!(v["created"], 99);
        assert_eq!(v["choices"], original["choices"]);
        assert_eq!(v["usage"], original["usage"]);
    }

    #[test]
    fn the_identity_splice_touches_only_the_top_level_fields() {
        let raw = |json: &str| Entry {
            answer: RawValue::from_string(json.to_string()).unwrap().into(),
            ..entry(Endpoint::ChatCompletions, Value::Null)
        };
        let json = r#"{"created": 5, "choices":[{"id":"inner","created":1}], "id" : "old"}"#;
        let out = raw(json).render_json("new\"id", 77);
        // Spliced into the text: its spacing kept.
        assert!(std::str::from_utf8(&out)
            .unwrap()
            .contains(r#""id" : "new\"id""#));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["id"], "new\"id");
        assert_eq!(v["created"], 77);
        assert_eq!(
            v["choices"][0],
            serde_json::json!({"id": "inner", "created": 1})
        );
        // Missing or repeated fields go through the parsed form, with the same result.
        let v: Value = serde_json::from_slice(&raw(r#"{"id":"a"}"#).render_json("b", 1)).unwrap();
        assert_eq!(v, serde_json::json!({"id": "b", "created": 1}));
        let e = entry(
            Endpoint::ChatCompletions,
            serde_json::json!({"object": "chat.completion"}),
        );
        let v: Value = serde_json::from_slice(&e.render_json("b", 2)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"object": "chat.completion", "id": "b", "created": 2})
        );
    }

    #[test]
    fn tool_call_fragments_and_logprobs_are_joined() {
        let events = [
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"ci"}}]},"logprobs":{"content":[{"token":"a","logprob":-0.1}]},"finish_reason":null}]}"#,
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ty\":\"Paris\"}"}}]},"logprobs":{"content":[{"token":"b","logprob":-0.2}]},"finish_reason":null}]}"#,
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}]}"#,
        ];
        let mut sse = String::new();
        for e in events {
            sse.push_str(&format!("data: {e}\n\n"));
        }
        sse.push_str("data: [DONE]\n\n");
        let answer = sse_answer(Endpoint::ChatCompletions, &[Bytes::from(sse)]).unwrap();
        let call = &answer["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["id"], "call_1");
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(answer["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(
            answer["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        // And back to a stream that a client can read the call from.
        let again = sse_answer(
            Endpoint::ChatCompletions,
            &[entry(Endpoint::ChatCompletions, answer.clone()).render_sse("x", 1, false)],
        )
        .unwrap();
        assert_eq!(
            again["choices"][0]["message"]["tool_calls"],
            answer["choices"][0]["message"]["tool_calls"]
        );
    }

    #[test]
    fn several_choices_keep_their_indexes() {
        let events = [
            r#"{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":1,"text":"B","logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"A","logprobs":null,"finish_reason":"stop"}]}"#,
            r#"{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":1,"text":"b","logprobs":null,"finish_reason":"length"}]}"#,
        ];
        let mut sse: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        sse.push_str("data: [DONE]\n\n");
        let answer = sse_answer(Endpoint::Completions, &[Bytes::from(sse)]).unwrap();
        assert_eq!(answer["choices"][0]["text"], "A");
        assert_eq!(answer["choices"][1]["text"], "Bb");
        assert_eq!(answer["choices"][1]["finish_reason"], "length");
    }

    #[test]
    fn entries_survive_encoding() {
        let e = entry(Endpoint::ChatCompletions, serde_json::json!({"a": 1}));
        assert_eq!(Entry::decode(&e.encode()).unwrap(), e);
        assert!(Entry::decode(b"garbage").is_err());
    }
}
