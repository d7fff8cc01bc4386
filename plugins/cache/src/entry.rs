//! A cached answer, and the two ways it is made and served.
//!
//! An entry holds the answer in its non-stream form (a `chat.completion` or `text_completion`
//! object), whatever form filled it: a JSON answer is kept as sent; a stream is assembled from
//! its deltas. A hit is served in the form the client asks for, with a fresh `id` and `created`:
//! the JSON object, or a Server-Sent Events stream (role chunk, content chunk, finish chunk,
//! usage chunk when asked, `[DONE]`) in vLLM's shapes.
//!
//! An entry keeps its answer's `usage` whatever form filled it: a stream whose client did not
//! ask for usage has no usage chunk by the time the cache sees it, so the usage the core found
//! ([`sluice_sdk::RequestCtx::usage`], which the cache asks for) is put in its place.
//!
//! The answer is kept as raw JSON text, not as a parsed tree: storing is on every miss, and
//! checking an answer's shape without building it costs a fraction of building it (and the
//! memory store then holds one allocation per entry, not one per JSON value). A JSON hit
//! splices its fresh `id` and `created` into the text; only a stream hit parses it.

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use sluice_sdk::Usage;
use std::borrow::Cow;

/// An answer's JSON text, checked when it was made and kept as the bytes it is: a JSON
/// answer is the upstream's own body, shared, not a copy checked a second time. The stored
/// form (Redis) writes it as raw JSON, and reading it back checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerText(bytes::Bytes);

impl AnswerText {
    /// The text (`null` if it were not UTF-8, which no constructor lets in).
    pub fn get(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or("null")
    }

    /// Whether the answer was cut by a model's context short of `budget`, the tokens the
    /// client allowed: not the whole answer to its request.
    pub fn cut_by_context(&self, budget: u64) -> bool {
        sluice_sdk::context::cut_by_context(&self.0, budget)
    }
}

impl From<Box<RawValue>> for AnswerText {
    fn from(raw: Box<RawValue>) -> Self {
        AnswerText(bytes::Bytes::from(Box::<str>::from(raw).into_boxed_bytes()))
    }
}

impl Serialize for AnswerText {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let raw: &RawValue = serde_json::from_str(self.get()).map_err(serde::ser::Error::custom)?;
        raw.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for AnswerText {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(deserializer).map(AnswerText::from)
    }
}

/// Which API shape an answer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerKind {
    Chat,
    Completion,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// SHA-256 of the cache key: checked on every hit, so a store keyed by less than the
    /// whole digest can never serve another prompt's answer.
    #[serde(with = "hex_digest")]
    pub digest: [u8; 32],
    /// When the answer was made (Unix seconds), for `age`.
    pub created_unix: u64,
    pub kind: AnswerKind,
    /// The pool that produced the answer.
    pub pool: String,
    /// The answer in non-stream form, as JSON text.
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

/// Why an answer is not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStored {
    /// It ended early: no `[DONE]`, or a choice without a finish reason.
    Incomplete,
    /// The stream carried an error event.
    ErrorEvent,
    /// Not an answer of the expected shape.
    NotAnAnswer,
}

impl NotStored {
    pub fn label(self) -> &'static str {
        match self {
            NotStored::Incomplete | NotStored::ErrorEvent => "incomplete",
            NotStored::NotAnAnswer => "not_ok",
        }
    }
}

impl AnswerKind {
    fn object(self) -> &'static str {
        match self {
            AnswerKind::Chat => "chat.completion",
            AnswerKind::Completion => "text_completion",
        }
    }

    pub(crate) fn chunk_object(self) -> &'static str {
        match self {
            AnswerKind::Chat => "chat.completion.chunk",
            AnswerKind::Completion => "text_completion",
        }
    }
}

/// What storing checks of a JSON answer; everything else is skipped unparsed.
#[derive(Deserialize)]
struct AnswerShape<'a> {
    #[serde(borrow)]
    object: Option<Cow<'a, str>>,
    #[serde(default)]
    choices: Vec<ChoiceShape>,
}

#[derive(Deserialize)]
struct ChoiceShape {
    /// `null` and absent alike are `None`.
    #[serde(default)]
    finish_reason: Option<IgnoredAny>,
}

/// A non-stream answer, kept as sent once it is known to be whole: the shape check is a full
/// JSON parse, so the body is kept as it is, without a second check or a copy.
pub fn from_json(kind: AnswerKind, body: bytes::Bytes) -> Result<AnswerText, NotStored> {
    let shape: AnswerShape = serde_json::from_slice(&body).map_err(|_| NotStored::NotAnAnswer)?;
    if shape.object.as_deref() != Some(kind.object()) || shape.choices.is_empty() {
        return Err(NotStored::NotAnAnswer);
    }
    if shape.choices.iter().any(|c| c.finish_reason.is_none()) {
        return Err(NotStored::Incomplete);
    }
    if std::str::from_utf8(&body).is_err() {
        return Err(NotStored::NotAnAnswer);
    }
    Ok(AnswerText(body.slice_ref(body.trim_ascii())))
}

/// The non-stream answer a complete event stream adds up to. Its `usage` is the stream's own
/// usage chunk, else `usage` (what the core found in the upstream's stream, whose usage chunk
/// was kept from the client), else `null`.
pub fn from_sse(
    kind: AnswerKind,
    chunks: &[bytes::Bytes],
    usage: Option<Usage>,
) -> Result<AnswerText, NotStored> {
    let mut answer = assemble(kind, chunks)?;
    if let (Some(usage), Some(fields)) = (usage, answer.as_object_mut()) {
        if fields.get("usage").is_none_or(Value::is_null) {
            fields.insert("usage".to_owned(), usage_object(usage));
        }
    }
    serde_json::value::to_raw_value(&answer)
        .map(AnswerText::from)
        .map_err(|_| NotStored::NotAnAnswer)
}

/// A `usage` object in vLLM's shape.
pub(crate) fn usage_object(usage: Usage) -> Value {
    serde_json::json!({
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens.saturating_add(usage.completion_tokens),
        "completion_tokens": usage.completion_tokens,
    })
}

fn assemble(kind: AnswerKind, chunks: &[bytes::Bytes]) -> Result<Value, NotStored> {
    let body: Vec<u8> = chunks.concat();
    let text = std::str::from_utf8(&body).map_err(|_| NotStored::NotAnAnswer)?;
    let mut head: Option<Value> = None;
    let mut choices: std::collections::BTreeMap<u64, ChoiceBuilder> = Default::default();
    let mut usage = Value::Null;
    let mut done = false;
    for event in text.split("\n\n") {
        let data = event
            .lines()
            .filter_map(|l| l.trim_end_matches('\r').strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect::<Vec<_>>()
            .join("\n");
        if data.is_empty() {
            continue;
        }
        if done {
            return Err(NotStored::NotAnAnswer);
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(&data).map_err(|_| NotStored::NotAnAnswer)?;
        if chunk.get("error").is_some() {
            return Err(NotStored::ErrorEvent);
        }
        head.get_or_insert_with(|| chunk.clone());
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = u.clone();
        }
        for c in chunk
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            choices.entry(index).or_default().absorb(kind, c);
        }
    }
    if !done || choices.is_empty() || choices.values().any(|c| c.finish_reason.is_null()) {
        return Err(NotStored::Incomplete);
    }
    let head = head.unwrap_or(Value::Null);
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, c)| c.build(kind, index))
        .collect();
    let mut answer = serde_json::json!({
        "id": head.get("id").cloned().unwrap_or(Value::Null),
        "object": kind.object(),
        "created": head.get("created").cloned().unwrap_or(Value::Null),
        "model": head.get("model").cloned().unwrap_or(Value::Null),
        "choices": choices,
        "usage": usage,
    });
    if let Some(fp) = head.get("system_fingerprint") {
        answer["system_fingerprint"] = fp.clone();
    }
    Ok(answer)
}

/// One choice, assembled from its deltas.
#[derive(Default)]
struct ChoiceBuilder {
    role: Option<String>,
    text: String,
    reasoning: Option<String>,
    tool_calls: std::collections::BTreeMap<u64, Value>,
    /// Chat: the `logprobs.content` entries; completions: the four parallel arrays.
    logprobs: Option<serde_json::Map<String, Value>>,
    finish_reason: Value,
    stop_reason: Value,
}

impl ChoiceBuilder {
    fn absorb(&mut self, kind: AnswerKind, c: &Value) {
        match kind {
            AnswerKind::Chat => {
                let delta = c.get("delta").unwrap_or(&Value::Null);
                if let Some(role) = delta.get("role").and_then(Value::as_str) {
                    self.role = Some(role.to_string());
                }
                if let Some(t) = delta.get("content").and_then(Value::as_str) {
                    self.text.push_str(t);
                }
                if let Some(t) = delta.get("reasoning_content").and_then(Value::as_str) {
                    self.reasoning.get_or_insert_with(String::new).push_str(t);
                }
                for call in delta
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.absorb_tool_call(call);
                }
            }
            AnswerKind::Completion => {
                if let Some(t) = c.get("text").and_then(Value::as_str) {
                    self.text.push_str(t);
                }
            }
        }
        if let Some(lp) = c.get("logprobs").and_then(Value::as_object) {
            let acc = self.logprobs.get_or_insert_with(Default::default);
            for (field, value) in lp {
                if let Some(items) = value.as_array() {
                    let slot = acc
                        .entry(field.clone())
                        .or_insert_with(|| Value::Array(vec![]));
                    if let Some(all) = slot.as_array_mut() {
                        all.extend(items.iter().cloned());
                    }
                }
            }
        }
        if let Some(reason) = c.get("finish_reason").filter(|r| !r.is_null()) {
            self.finish_reason = reason.clone();
            self.stop_reason = c.get("stop_reason").cloned().unwrap_or(Value::Null);
        }
    }

    /// Tool calls stream as fragments keyed by `index`: the id, type and name once, the
    /// arguments in pieces to be joined.
    fn absorb_tool_call(&mut self, call: &Value) {
        let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        let slot = self.tool_calls.entry(index).or_insert_with(|| {
            serde_json::json!({"id": null, "type": "function", "function": {"name": "", "arguments": ""}})
        });
        for field in ["id", "type"] {
            if let Some(v) = call.get(field).filter(|v| !v.is_null()) {
                slot[field] = v.clone();
            }
        }
        if let Some(f) = call.get("function") {
            for field in ["name", "arguments"] {
                if let Some(piece) = f.get(field).and_then(Value::as_str) {
                    // Appended in place: arguments come in many small fragments.
                    match slot.get_mut("function").and_then(|f| f.get_mut(field)) {
                        Some(Value::String(joined)) => joined.push_str(piece),
                        _ => slot["function"][field] = Value::String(piece.to_owned()),
                    }
                }
            }
        }
    }

    fn build(self, kind: AnswerKind, index: u64) -> Value {
        let logprobs = self.logprobs.map_or(Value::Null, Value::Object);
        match kind {
            AnswerKind::Chat => {
                let tool_calls: Vec<Value> = self.tool_calls.into_values().collect();
                let content = if self.text.is_empty() && !tool_calls.is_empty() {
                    Value::Null
                } else {
                    Value::String(self.text)
                };
                serde_json::json!({
                    "index": index,
                    "message": {
                        "role": self.role.unwrap_or_else(|| "assistant".into()),
                        "content": content,
                        "tool_calls": tool_calls,
                        "reasoning_content": self.reasoning,
                    },
                    "logprobs": logprobs,
                    "finish_reason": self.finish_reason,
                    "stop_reason": self.stop_reason,
                })
            }
            AnswerKind::Completion => serde_json::json!({
                "index": index,
                "text": self.text,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }),
        }
    }
}

impl Entry {
    /// The answer as a JSON body, with this response's `id` and `created`.
    pub fn render_json(&self, id: &str, created: u64) -> bytes::Bytes {
        if let Some(spliced) = splice_identity(self.answer.get(), id, created) {
            return bytes::Bytes::from(spliced);
        }
        // An answer without both fields once each: through the parsed form.
        let mut answer = self.parsed();
        // Through `as_object_mut`, not indexing: indexing a non-object panics, and a stored
        // answer comes from an upstream (or a shared Redis).
        if let Some(fields) = answer.as_object_mut() {
            fields.insert("id".to_owned(), Value::from(id));
            fields.insert("created".to_owned(), Value::from(created));
        }
        bytes::Bytes::from(serde_json::to_vec(&answer).unwrap_or_default())
    }

    fn parsed(&self) -> Value {
        serde_json::from_str(self.answer.get()).unwrap_or(Value::Null)
    }

    /// The answer as a Server-Sent Events stream, in vLLM's event sequence: per choice a role
    /// chunk, one content chunk and a finish chunk; a usage chunk when asked; `[DONE]`.
    pub fn render_sse(&self, id: &str, created: u64, include_usage: bool) -> bytes::Bytes {
        let kind = self.kind;
        let answer = self.parsed();
        let model = answer.get("model").cloned().unwrap_or(Value::Null);
        let chunk = |choices: Value| {
            serde_json::json!({
                "id": id,
                "object": kind.chunk_object(),
                "created": created,
                "model": model,
                "choices": choices,
            })
        };
        let mut out = Vec::with_capacity(512);
        let mut event = |v: &Value| {
            out.extend_from_slice(b"data: ");
            let _ = serde_json::to_writer(&mut out, v);
            out.extend_from_slice(b"\n\n");
        };
        let choices = answer.get("choices").and_then(Value::as_array);
        for c in choices.into_iter().flatten() {
            let index = c.get("index").cloned().unwrap_or(Value::from(0));
            let logprobs = c.get("logprobs").cloned().unwrap_or(Value::Null);
            let finish_reason = c.get("finish_reason").cloned().unwrap_or(Value::Null);
            let stop_reason = c.get("stop_reason").cloned().unwrap_or(Value::Null);
            match kind {
                AnswerKind::Chat => {
                    let message = c.get("message").unwrap_or(&Value::Null);
                    event(&chunk(
                        serde_json::json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                    ));
                    let mut delta = serde_json::json!({
                        "content": message.get("content").and_then(Value::as_str).unwrap_or(""),
                    });
                    if let Some(calls) = message
                        .get("tool_calls")
                        .and_then(Value::as_array)
                        .filter(|c| !c.is_empty())
                    {
                        let indexed: Vec<Value> = calls
                            .iter()
                            .enumerate()
                            .map(|(i, call)| {
                                let mut call = call.clone();
                                if let Some(fields) = call.as_object_mut() {
                                    fields.insert("index".to_owned(), Value::from(i));
                                }
                                call
                            })
                            .collect();
                        delta["tool_calls"] = Value::Array(indexed);
                    }
                    if let Some(r) = message.get("reasoning_content").filter(|r| !r.is_null()) {
                        delta["reasoning_content"] = r.clone();
                    }
                    event(&chunk(
                        serde_json::json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null}]),
                    ));
                    event(&chunk(
                        serde_json::json!([{"index": index, "delta": {"content": ""}, "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason}]),
                    ));
                }
                AnswerKind::Completion => {
                    let text = c.get("text").cloned().unwrap_or(Value::from(""));
                    event(&chunk(
                        serde_json::json!([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": null, "stop_reason": null}]),
                    ));
                    event(&chunk(
                        serde_json::json!([{"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason}]),
                    ));
                }
            }
        }
        let usage = answer.get("usage").filter(|u| !u.is_null());
        if let (true, Some(usage)) = (include_usage, usage) {
            let mut last = chunk(Value::Array(vec![]));
            last["usage"] = usage.clone();
            event(&last);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        bytes::Bytes::from(out)
    }
}

/// Where the top-level `id` and `created` of an answer are, borrowed from its text.
#[derive(Deserialize)]
struct Identity<'a> {
    #[serde(borrow)]
    id: &'a RawValue,
    #[serde(borrow)]
    created: &'a RawValue,
}

/// `json` with its top-level `id` and `created` values replaced, without parsing the rest
/// into a tree; `None` when it does not have both, once each.
fn splice_identity(json: &str, id: &str, created: u64) -> Option<Vec<u8>> {
    let found: Identity = serde_json::from_str(json).ok()?;
    let spans = identity_spans(json, found.id, found.created)?;
    let mut out = Vec::with_capacity(json.len() + id.len() + 16);
    splice_at(&mut out, json, &spans, id, created)?;
    Some(out)
}

/// Where an object's top-level `id` and `created` values are in its text.
#[derive(Debug, Clone)]
pub(crate) struct IdentitySpans {
    id: std::ops::Range<usize>,
    created: std::ops::Range<usize>,
}

/// Where `id` and `created`, two values borrowed from `json`, are in it.
pub(crate) fn identity_spans(
    json: &str,
    id: &RawValue,
    created: &RawValue,
) -> Option<IdentitySpans> {
    // Both values are slices of `json`: their offsets locate them in it.
    let span = |raw: &RawValue| {
        let start = (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
        let range = start..start + raw.get().len();
        json.get(range.clone()).map(|_| range)
    };
    Some(IdentitySpans {
        id: span(id)?,
        created: span(created)?,
    })
}

/// Appends `json` to `out` with the values at `spans` (from [`identity_spans`]) replaced by
/// this response's `id` and `created`; `None`, with `out` unchanged, when the spans do not fit.
pub(crate) fn splice_at(
    out: &mut Vec<u8>,
    json: &str,
    spans: &IdentitySpans,
    id: &str,
    created: u64,
) -> Option<()> {
    let id_value = serde_json::to_string(id).ok()?;
    let created_value = created.to_string();
    let mut parts = [
        (spans.id.clone(), id_value.as_str()),
        (spans.created.clone(), created_value.as_str()),
    ];
    parts.sort_by_key(|(range, _)| range.start);
    let before = out.len();
    let mut at = 0;
    for (range, value) in parts {
        let Some(text) = json.get(at..range.start) else {
            out.truncate(before);
            return None;
        };
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(value.as_bytes());
        at = range.end;
    }
    let Some(rest) = json.get(at..) else {
        out.truncate(before);
        return None;
    };
    out.extend_from_slice(rest.as_bytes());
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    fn entry(kind: AnswerKind, answer: Value) -> Entry {
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
    fn json_answer(kind: AnswerKind, body: &[u8]) -> Result<Value, NotStored> {
        from_json(kind, Bytes::copy_from_slice(body)).map(tree)
    }

    /// [`from_sse`], parsed for the assertions.
    fn sse_answer(kind: AnswerKind, chunks: &[Bytes]) -> Result<Value, NotStored> {
        from_sse(kind, chunks, None).map(tree)
    }

    /// The stream split into arbitrary pieces, as a network would.
    fn pieces(bytes: &[u8], size: usize) -> Vec<Bytes> {
        bytes.chunks(size).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn a_vllm_stream_assembles_to_its_answer() {
        let sse = fixture("vllm-chat-stream.sse");
        let answer = sse_answer(AnswerKind::Chat, &pieces(&sse, 7)).unwrap();
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
            sse_answer(AnswerKind::Chat, &[Bytes::from(cut)]),
            Err(NotStored::Incomplete)
        );
        let no_finish: String = sse
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"finish_reason\":\"stop\""))
            .collect();
        assert_eq!(
            sse_answer(AnswerKind::Chat, &[Bytes::from(no_finish)]),
            Err(NotStored::Incomplete)
        );
        let errored = sse.replace(
            "data: [DONE]",
            "data: {\"error\": {\"message\": \"boom\", \"code\": 500}}\n\ndata: [DONE]",
        );
        assert_eq!(
            sse_answer(AnswerKind::Chat, &[Bytes::from(errored)]),
            Err(NotStored::ErrorEvent)
        );
    }

    #[test]
    fn json_answers_are_kept_when_whole() {
        let body = fixture("vllm-chat-completion.json");
        let answer = json_answer(AnswerKind::Chat, &body).unwrap();
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            "Paris is the capital of France."
        );
        assert_eq!(
            json_answer(AnswerKind::Completion, &body),
            Err(NotStored::NotAnAnswer)
        );
        assert_eq!(
            json_answer(AnswerKind::Chat, &fixture("vllm-error-new.json")),
            Err(NotStored::NotAnAnswer)
        );
        assert_eq!(
            json_answer(AnswerKind::Chat, &body[..body.len() / 2]),
            Err(NotStored::NotAnAnswer)
        );
    }

    #[test]
    fn a_json_answer_is_the_upstreams_bytes_shared_and_survives_the_stored_form() {
        let mut padded = b" \n".to_vec();
        padded.extend_from_slice(&fixture("vllm-chat-completion.json"));
        padded.extend_from_slice(b"\r\n");
        let body = Bytes::from(padded);
        let answer = from_json(AnswerKind::Chat, body.clone()).unwrap();
        let inside = body.as_ptr_range().contains(&answer.get().as_ptr());
        assert!(inside, "a slice of the upstream's body, not a copy");
        assert!(answer.get().starts_with('{') && answer.get().ends_with('}'));
        let mut stored = entry(AnswerKind::Chat, Value::Null);
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
            (AnswerKind::Chat, "vllm-chat-completion.json"),
            (AnswerKind::Completion, "vllm-completion.json"),
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
                AnswerKind::Chat => assert_eq!(
                    back["choices"][0]["message"]["content"],
                    original["choices"][0]["message"]["content"]
                ),
                AnswerKind::Completion => {
                    assert_eq!(back["choices"][0]["text"], original["choices"][0]["text"])
                }
            }
        }
    }

    #[test]
    fn the_usage_chunk_comes_only_when_asked() {
        let original =
            json_answer(AnswerKind::Chat, &fixture("vllm-chat-completion.json")).unwrap();
        let sse = entry(AnswerKind::Chat, original).render_sse("x", 1, false);
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
            sse_answer(AnswerKind::Chat, &[Bytes::from(without.clone())]).unwrap()["usage"],
            Value::Null
        );
        let answer = tree(from_sse(AnswerKind::Chat, &[Bytes::from(without)], found).unwrap());
        assert_eq!(
            answer["usage"],
            serde_json::json!({"prompt_tokens": 24, "total_tokens": 32, "completion_tokens": 8})
        );
        // Served as a stream with the usage chunk asked for, it has one.
        let e = entry(AnswerKind::Chat, answer.clone());
        let back = sse_answer(AnswerKind::Chat, &[e.render_sse("x", 1, true)]).unwrap();
        assert_eq!(back["usage"], answer["usage"]);
        // The stream's own usage chunk, when it had one, is kept as sent.
        let other = Some(Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
        });
        let own = tree(from_sse(AnswerKind::Chat, &[Bytes::from(sse)], other).unwrap());
        assert_eq!(own["usage"]["completion_tokens"], 8);
    }

    #[test]
    fn json_hits_get_a_fresh_id_and_created() {
        let original =
            json_answer(AnswerKind::Chat, &fixture("vllm-chat-completion.json")).unwrap();
        let body = entry(AnswerKind::Chat, original.clone()).render_json("chatcmpl-new", 99);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["id"], "chatcmpl-new");
        assert_eq!(v["created"], 99);
        assert_eq!(v["choices"], original["choices"]);
        assert_eq!(v["usage"], original["usage"]);
    }

    #[test]
    fn the_identity_splice_touches_only_the_top_level_fields() {
        let json = r#"{"created": 5, "choices":[{"id":"inner","created":1}], "id" : "old"}"#;
        let out = splice_identity(json, "new\"id", 77).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["id"], "new\"id");
        assert_eq!(v["created"], 77);
        assert_eq!(
            v["choices"][0],
            serde_json::json!({"id": "inner", "created": 1})
        );
        // Missing or repeated fields fall back to the parsed form, with the same result.
        assert_eq!(splice_identity(r#"{"id":"a"}"#, "b", 1), None);
        assert_eq!(
            splice_identity(r#"{"id":"a","created":1,"id":"c"}"#, "b", 1),
            None
        );
        let e = entry(
            AnswerKind::Chat,
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
        let answer = sse_answer(AnswerKind::Chat, &[Bytes::from(sse)]).unwrap();
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
            AnswerKind::Chat,
            &[entry(AnswerKind::Chat, answer.clone()).render_sse("x", 1, false)],
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
        let answer = sse_answer(AnswerKind::Completion, &[Bytes::from(sse)]).unwrap();
        assert_eq!(answer["choices"][0]["text"], "A");
        assert_eq!(answer["choices"][1]["text"], "Bb");
        assert_eq!(answer["choices"][1]["finish_reason"], "length");
    }

    #[test]
    fn entries_survive_encoding() {
        let e = entry(AnswerKind::Chat, serde_json::json!({"a": 1}));
        assert_eq!(Entry::decode(&e.encode()).unwrap(), e);
        assert!(Entry::decode(b"garbage").is_err());
    }
}
