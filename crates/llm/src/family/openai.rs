//! The OpenAI families, as vLLM serves them: chat completions (`/v1/chat/completions`) and
//! text completions (`/v1/completions`). Their request model is [`crate::request::LlmRequest`];
//! here is the rest of what is theirs: their member tables, the output default, the
//! log-probabilities' place, the usage-only stream event, the error shape, and the answer
//! codec.
//!
//! The answer codec: a kept answer is the non-stream form (a `chat.completion` or
//! `text_completion` object), whatever form filled it: a JSON answer is kept as sent; a
//! stream is assembled from its deltas. It is replayed in the form a client asks for, with a
//! fresh `id` and `created`: the JSON object, or an event stream (role chunk, content chunk,
//! finish chunk, usage chunk when asked, `[DONE]`) in vLLM's shapes. The answer is kept as
//! raw JSON text, not as a parsed tree: storing is on every miss, and checking an answer's
//! shape without building it costs a fraction of building it. A JSON replay splices its fresh
//! `id` and `created` into the text; only a stream replay parses it.

use super::{
    AnswerError, ApiFamily, EventFacts, Logprobs, PromptSource, RouteMatch, Stamp, StreamAnswer,
    WireError,
};
use crate::raw_json::is_space;
use crate::request::OPENAI_MEMBERS;
use crate::request::{concat, member, Endpoint, InvalidRequest, LlmCall, Member, Slot};
use crate::sse;
use crate::usage::Usage;
use bytes::Bytes;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use std::borrow::Cow;

/// Which of the two an answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn object(self) -> &'static str {
        match self {
            Kind::Chat => "chat.completion",
            Kind::Completion => "text_completion",
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }
}

/// One OpenAI family.
#[derive(Debug)]
pub struct OpenAi {
    kind: Kind,
}

/// `POST /v1/chat/completions`.
pub static CHAT: OpenAi = OpenAi { kind: Kind::Chat };
/// `POST /v1/completions`.
pub static COMPLETIONS: OpenAi = OpenAi {
    kind: Kind::Completion,
};

/// What a chat request is read for: OpenAI's shared members, and its budget in either name
/// (`max_completion_tokens` wins; vLLM reads it for chat only).
static CHAT_MEMBERS: [Member; 19] = concat(
    OPENAI_MEMBERS,
    [
        member("max_tokens", Slot::MaxTokens),
        member("max_completion_tokens", Slot::MaxCompletionTokens),
    ],
);

/// What a text completion is read for: OpenAI's shared members and `max_tokens`.
static COMPLETIONS_MEMBERS: [Member; 18] =
    concat(OPENAI_MEMBERS, [member("max_tokens", Slot::MaxTokens)]);

/// vLLM's `max_tokens` for a text completion that sets none.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

impl ApiFamily for OpenAi {
    fn question(&self, body: &[u8]) -> Option<super::question::Question> {
        use super::question::{read, Turns};
        read(
            body,
            match self.kind {
                Kind::Chat => Turns::List("messages"),
                Kind::Completion => Turns::Prompt,
            },
        )
    }

    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
        }
    }

    fn path(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }

    fn members(&self) -> &'static [Member] {
        match self.kind {
            Kind::Chat => &CHAT_MEMBERS,
            Kind::Completion => &COMPLETIONS_MEMBERS,
        }
    }

    fn parse(
        &self,
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<LlmCall, InvalidRequest> {
        let (members, default) = (self.members(), self.default_max_tokens());
        let call = LlmCall::read_request(endpoint, route, body, members, default)?;
        call.request.require(match self.kind {
            Kind::Chat => "messages",
            Kind::Completion => "prompt",
        })?;
        call.request.check_sampling()?;
        Ok(call)
    }

    fn prompt_source<'a>(&self, call: &'a LlmCall) -> Option<PromptSource<'a>> {
        Some(match self.kind {
            Kind::Chat => {
                // The body is not parsed again: the core's parse noted where the members the
                // chat template reads are.
                let members = call.placed_members();
                let member = |key: &str| {
                    let range = members.as_ref()?.value(key)?;
                    call.body.get(range)
                };
                PromptSource::Chat {
                    messages: call
                        .request
                        .messages
                        .as_ref()
                        .map_or(&[], |m| m.json_onward()),
                    tools: call.request.tools.as_ref().map(|tools| tools.as_bytes()),
                    add_generation_prompt: member("add_generation_prompt"),
                    continue_final_message: member("continue_final_message"),
                    chat_template_kwargs: member("chat_template_kwargs"),
                }
            }
            Kind::Completion => PromptSource::Prompt(call.request.prompt.as_ref()?),
        })
    }

    fn default_max_tokens(&self) -> Option<u32> {
        match self.kind {
            Kind::Chat => None,
            Kind::Completion => Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        }
    }

    fn logprobs(&self) -> Option<&'static dyn Logprobs> {
        Some(match self.kind {
            Kind::Chat => &super::logprobs::CHAT,
            Kind::Completion => &super::logprobs::COMPLETIONS,
        })
    }

    fn is_error_event(&self, data: &[u8]) -> bool {
        is_error_event(data)
    }

    fn is_usage_event(&self, event: &[u8]) -> bool {
        is_usage_chunk(event)
    }

    fn answer_from_json(&self, body: Bytes) -> Result<AnswerText, AnswerError> {
        from_json(self.kind, body)
    }

    fn answer_from_stream(
        &self,
        chunks: &[Bytes],
        usage: Option<Usage>,
    ) -> Result<AnswerText, AnswerError> {
        from_sse(self.kind, chunks, usage)
    }

    fn stream_answer(&'static self) -> Box<dyn StreamAnswer> {
        Box::new(Assembly::new(self.kind))
    }

    fn render_json(&self, answer: &AnswerText, id: &str, created: u64) -> Bytes {
        render_json(answer, id, created)
    }

    fn render_stream(
        &self,
        answer: &AnswerText,
        id: &str,
        created: u64,
        include_usage: bool,
    ) -> Bytes {
        render_sse(self.kind, answer, id, created, include_usage)
    }

    fn read_event<'a>(&self, json: &'a str) -> Option<EventFacts<'a>> {
        read_event(json)
    }

    fn write_event(
        &self,
        json: &str,
        facts: &EventFacts<'_>,
        id: &str,
        created: u64,
        out: &mut Vec<u8>,
    ) {
        let spliced = facts
            .stamp
            .as_ref()
            .and_then(|stamp| splice_at(out, json, stamp, id, created));
        if spliced.is_none() {
            out.extend_from_slice(json.as_bytes());
        }
    }

    fn usage_event(&self, id: &str, created: u64, model: Option<&str>, usage: Usage) -> Vec<u8> {
        let model = model.and_then(|m| serde_json::from_str::<Value>(m).ok());
        let chunk = serde_json::json!({
            "id": id,
            "object": self.kind.chunk_object(),
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage_object(usage),
        });
        serde_json::to_vec(&chunk).unwrap_or_default()
    }

    fn id_prefix(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
    }

    fn error_body(&self, error: &WireError<'_>) -> Vec<u8> {
        error_body(error)
    }

    fn relays_live(&self) -> bool {
        true
    }

    fn operation(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat",
            Kind::Completion => "text_completion",
        }
    }

    fn error_event(&self, error: &WireError<'_>) -> Vec<u8> {
        let body = error_body(error);
        let mut event = Vec::with_capacity(body.len() + 24);
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&body);
        event.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        event
    }
}

/// The OpenAI error type for a status, as vLLM names them.
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 | 413 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        408 => "RequestTimeoutError",
        429 => "RateLimitError",
        503 | 529 => "ServiceUnavailableError",
        502 | 504 => "APIConnectionError",
        _ => "InternalServerError",
    }
}

/// `{"error": {"message", "type", "param", "code", "reason"}}`: the status as `code`, as
/// vLLM does, and Sluice's reason token, which OpenAI clients ignore and scripts can read.
pub fn error_body(error: &WireError<'_>) -> Vec<u8> {
    #[derive(Serialize)]
    struct Body<'a> {
        error: Inner<'a>,
    }
    #[derive(Serialize)]
    struct Inner<'a> {
        message: &'a str,
        #[serde(rename = "type")]
        kind: &'a str,
        param: Option<&'a str>,
        code: u16,
        reason: &'a str,
    }
    let body = Body {
        error: Inner {
            message: error.message,
            kind: error_type(error.status),
            param: error.param,
            code: error.status,
            reason: error.reason,
        },
    };
    // Serializing plain strings and integers cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Whether an event's data is an error object (`{"error": {...}}`, as vLLM ends a stream
/// that failed). A byte search first: almost no event says `"error"` at all, and those
/// that do only in their text are told apart by a parse.
pub(super) fn is_error_event(data: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct ErrorShape<'a> {
        #[serde(borrow)]
        error: Option<&'a RawValue>,
    }
    data.windows(7).any(|w| w == b"\"error\"")
        && serde_json::from_slice::<ErrorShape>(data).is_ok_and(|shape| shape.error.is_some())
}

/// What relaying reads of an event, in one parse.
#[derive(Deserialize)]
struct EventShape<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    created: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    choices: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
}

/// An event as relaying reads it: an error event is not passed on (the stream's end
/// carries the news), nor text that no client could read either.
fn read_event(json: &str) -> Option<EventFacts<'_>> {
    match serde_json::from_str::<EventShape>(json) {
        Ok(shape) if shape.error.is_some() => None,
        Ok(shape) => Some(EventFacts {
            stamp: match (shape.id, shape.created) {
                (Some(id), Some(created)) => identity_spans(json, id, created),
                _ => None,
            },
            model: shape.model.map(RawValue::get),
            usage_only: shape.usage.is_some()
                && shape
                    .choices
                    .is_some_and(|c| c.get().trim_start_matches('[').trim_start() == "]"),
        }),
        // A repeated key, say: passed on as sent.
        Err(_) if serde_json::from_str::<IgnoredAny>(json).is_ok() => Some(EventFacts {
            stamp: None,
            model: None,
            usage_only: false,
        }),
        Err(_) => None,
    }
}

/// The usage chunk vLLM ends a stream with when asked: no choices, and a `usage` object.
/// Looked for as text first: most events have no `"usage"` key (vLLM's completions stream
/// has `"usage":null` in each, which is then read without copying).
fn is_usage_chunk(event: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Shape<'a> {
        #[serde(borrow)]
        choices: Option<&'a RawValue>,
        #[serde(borrow)]
        usage: Option<&'a RawValue>,
    }
    let Some(data) = sse::data(event) else {
        return false;
    };
    if !data.windows(7).any(|w| w == b"\"usage\"") {
        return false;
    }
    let Ok(shape) = serde_json::from_slice::<Shape>(&data) else {
        return false;
    };
    let no_choices = shape.choices.is_some_and(|c| {
        let inner = c.get().as_bytes();
        let inner = inner.strip_prefix(b"[").and_then(|i| i.strip_suffix(b"]"));
        inner.is_some_and(|i| i.iter().all(|&b| is_space(b)))
    });
    no_choices && shape.usage.is_some_and(|u| u.get().starts_with('{'))
}

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
        crate::context::cut_by_context(&self.0, budget)
    }
}

impl AnswerText {
    /// A JSON answer whose shape its family checked, kept as sent (trimmed); `None` when it
    /// is not UTF-8.
    pub(super) fn checked(body: bytes::Bytes) -> Option<AnswerText> {
        std::str::from_utf8(&body).ok()?;
        Some(AnswerText(body.slice_ref(body.trim_ascii())))
    }

    /// An answer a family assembled.
    pub(super) fn from_value(answer: &Value) -> Result<AnswerText, AnswerError> {
        serde_json::value::to_raw_value(answer)
            .map(AnswerText::from)
            .map_err(|_| AnswerError::NotAnAnswer)
    }

    /// The answer as a tree, for a family to render it (`null` if it were not JSON, which no
    /// constructor lets in).
    pub(super) fn tree(&self) -> Value {
        serde_json::from_str(self.get()).unwrap_or(Value::Null)
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
fn from_json(kind: Kind, body: bytes::Bytes) -> Result<AnswerText, AnswerError> {
    let shape: AnswerShape = serde_json::from_slice(&body).map_err(|_| AnswerError::NotAnAnswer)?;
    if shape.object.as_deref() != Some(kind.object()) || shape.choices.is_empty() {
        return Err(AnswerError::NotAnAnswer);
    }
    if shape.choices.iter().any(|c| c.finish_reason.is_none()) {
        return Err(AnswerError::Incomplete);
    }
    if std::str::from_utf8(&body).is_err() {
        return Err(AnswerError::NotAnAnswer);
    }
    Ok(AnswerText(body.slice_ref(body.trim_ascii())))
}

/// The non-stream answer a complete event stream adds up to (see [`Assembly::finish`]).
fn from_sse(
    kind: Kind,
    chunks: &[bytes::Bytes],
    usage: Option<Usage>,
) -> Result<AnswerText, AnswerError> {
    let mut assembly = Assembly::new(kind);
    let mut events = sse::SseEvents::default();
    for chunk in chunks {
        events.split(chunk, |event| assembly.feed(event));
    }
    // A last event without its blank line still counts, as it would for a client.
    let rest = events.take_rest();
    if !rest.trim_ascii().is_empty() {
        assembly.feed(&rest);
    }
    assembly.finish(usage)
}

/// A `usage` object in vLLM's shape.
fn usage_object(usage: Usage) -> Value {
    serde_json::json!({
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens.saturating_add(usage.completion_tokens),
        "completion_tokens": usage.completion_tokens,
    })
}

/// A chat or text completion stream, added up event by event: the first event's identity,
/// each choice's text, tool calls and log-probabilities so far, and the usage; never the
/// events themselves.
struct Assembly {
    kind: Kind,
    /// The first event: the answer's `id`, `created`, `model` and `system_fingerprint`.
    head: Option<Value>,
    choices: std::collections::BTreeMap<u64, ChoiceBuilder>,
    usage: Value,
    done: bool,
    /// Why the stream cannot be kept, once known (the rest is not read).
    broken: Option<AnswerError>,
}

impl Assembly {
    fn new(kind: Kind) -> Self {
        Self {
            kind,
            head: None,
            choices: Default::default(),
            usage: Value::Null,
            done: false,
            broken: None,
        }
    }

    fn read(&mut self, data: &[u8]) -> Result<(), AnswerError> {
        if self.done {
            return Err(AnswerError::NotAnAnswer);
        }
        if data == b"[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_slice(data).map_err(|_| AnswerError::NotAnAnswer)?;
        if chunk.get("error").is_some() {
            return Err(AnswerError::ErrorEvent);
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = u.clone();
        }
        for c in chunk
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            self.choices.entry(index).or_default().absorb(self.kind, c);
        }
        if self.head.is_none() {
            self.head = Some(chunk);
        }
        Ok(())
    }

    /// The head's value of `field` (`null` before the first event).
    fn head(&self, field: &str) -> Value {
        self.head
            .as_ref()
            .and_then(|h| h.get(field))
            .cloned()
            .unwrap_or(Value::Null)
    }
}

impl StreamAnswer for Assembly {
    fn feed(&mut self, event: &[u8]) {
        if self.broken.is_some() {
            return;
        }
        let Some(data) = sse::data(event).filter(|d| !d.is_empty()) else {
            return;
        };
        if let Err(broken) = self.read(&data) {
            self.broken = Some(broken);
        }
    }

    /// One event per choice, in vLLM's chunk shape under the upstream's identity: the role,
    /// the text (tool calls and reasoning with it) and the log-probabilities so far, and the
    /// finish reason if it came; then the usage chunk if it came.
    fn so_far(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.head.is_none() {
            return out;
        }
        let (id, created, model) = (self.head("id"), self.head("created"), self.head("model"));
        let mut event = |choices: Vec<Value>, usage: Option<&Value>| {
            let mut chunk = serde_json::json!({
                "id": id,
                "object": self.kind.chunk_object(),
                "created": created,
                "model": model,
                "choices": choices,
            });
            if let Some(usage) = usage {
                chunk["usage"] = usage.clone();
            }
            out.extend_from_slice(b"data: ");
            let _ = serde_json::to_writer(&mut out, &chunk);
            out.extend_from_slice(b"\n\n");
        };
        for (index, choice) in &self.choices {
            event(vec![choice.so_far(self.kind, *index)], None);
        }
        if !self.usage.is_null() {
            event(Vec::new(), Some(&self.usage));
        }
        out
    }

    /// Its `usage` is the stream's own usage chunk, else `usage` (what the core found in the
    /// upstream's stream, whose usage chunk was kept from the client), else `null`.
    fn finish(&self, usage: Option<Usage>) -> Result<AnswerText, AnswerError> {
        if let Some(broken) = self.broken {
            return Err(broken);
        }
        let complete = self.done
            && !self.choices.is_empty()
            && self.choices.values().all(|c| !c.finish_reason.is_null());
        if !complete {
            return Err(AnswerError::Incomplete);
        }
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|(index, c)| c.build(self.kind, *index))
            .collect();
        let usage = match (&self.usage, usage) {
            (Value::Null, Some(usage)) => usage_object(usage),
            (own, _) => own.clone(),
        };
        let mut answer = serde_json::json!({
            "id": self.head("id"),
            "object": self.kind.object(),
            "created": self.head("created"),
            "model": self.head("model"),
            "choices": choices,
            "usage": usage,
        });
        if let Some(fp) = self.head.as_ref().and_then(|h| h.get("system_fingerprint")) {
            answer["system_fingerprint"] = fp.clone();
        }
        AnswerText::from_value(&answer)
    }
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
    fn absorb(&mut self, kind: Kind, c: &Value) {
        match kind {
            Kind::Chat => {
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
            Kind::Completion => {
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

    /// The choice so far as one delta of its stream, with the upstream's tool call indexes.
    fn so_far(&self, kind: Kind, index: u64) -> Value {
        let logprobs = self.logprobs.clone().map_or(Value::Null, Value::Object);
        let mut choice = match kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if let Some(role) = &self.role {
                    delta.insert("role".to_owned(), Value::from(role.as_str()));
                }
                delta.insert("content".to_owned(), Value::from(self.text.as_str()));
                if let Some(reasoning) = &self.reasoning {
                    delta.insert(
                        "reasoning_content".to_owned(),
                        Value::from(reasoning.as_str()),
                    );
                }
                if !self.tool_calls.is_empty() {
                    let calls = self.tool_calls.iter().map(|(i, call)| {
                        let mut call = call.clone();
                        if let Some(fields) = call.as_object_mut() {
                            fields.insert("index".to_owned(), Value::from(*i));
                        }
                        call
                    });
                    delta.insert("tool_calls".to_owned(), calls.collect());
                }
                serde_json::json!({"index": index, "delta": delta})
            }
            Kind::Completion => serde_json::json!({"index": index, "text": self.text}),
        };
        choice["logprobs"] = logprobs;
        choice["finish_reason"] = self.finish_reason.clone();
        if !self.finish_reason.is_null() {
            choice["stop_reason"] = self.stop_reason.clone();
        }
        choice
    }

    /// The choice as it will be kept, in the non-stream form.
    fn build(&self, kind: Kind, index: u64) -> Value {
        let logprobs = self.logprobs.clone().map_or(Value::Null, Value::Object);
        match kind {
            Kind::Chat => {
                let tool_calls: Vec<Value> = self.tool_calls.values().cloned().collect();
                let content = if self.text.is_empty() && !tool_calls.is_empty() {
                    Value::Null
                } else {
                    Value::String(self.text.clone())
                };
                serde_json::json!({
                    "index": index,
                    "message": {
                        "role": self.role.as_deref().unwrap_or("assistant"),
                        "content": content,
                        "tool_calls": tool_calls,
                        "reasoning_content": self.reasoning,
                    },
                    "logprobs": logprobs,
                    "finish_reason": self.finish_reason,
                    "stop_reason": self.stop_reason,
                })
            }
            Kind::Completion => serde_json::json!({
                "index": index,
                "text": self.text,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }),
        }
    }
}

/// The answer as a JSON body, with this response's `id` and `created`.
fn render_json(answer_text: &AnswerText, id: &str, created: u64) -> bytes::Bytes {
    if let Some(spliced) = splice_identity(answer_text.get(), id, created) {
        return bytes::Bytes::from(spliced);
    }
    // An answer without both fields once each: through the parsed form.
    let mut answer = parsed(answer_text);
    // Through `as_object_mut`, not indexing: indexing a non-object panics, and a stored
    // answer comes from an upstream (or a shared Redis).
    if let Some(fields) = answer.as_object_mut() {
        fields.insert("id".to_owned(), Value::from(id));
        fields.insert("created".to_owned(), Value::from(created));
    }
    bytes::Bytes::from(serde_json::to_vec(&answer).unwrap_or_default())
}

fn parsed(answer: &AnswerText) -> Value {
    serde_json::from_str(answer.get()).unwrap_or(Value::Null)
}

/// The answer as a Server-Sent Events stream, in vLLM's event sequence: per choice a role
/// chunk, one content chunk and a finish chunk; a usage chunk when asked; `[DONE]`.
fn render_sse(
    kind: Kind,
    answer_text: &AnswerText,
    id: &str,
    created: u64,
    include_usage: bool,
) -> bytes::Bytes {
    let answer = parsed(answer_text);
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
        for choices in choice_deltas(kind, c) {
            event(&chunk(choices));
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

/// One kept choice as the `choices` of its stream's events, in vLLM's sequence: chat a role
/// delta, the content delta and a finish delta; completions the text and a finish event.
fn choice_deltas(kind: Kind, c: &Value) -> Vec<Value> {
    let index = c.get("index").cloned().unwrap_or(Value::from(0));
    let logprobs = c.get("logprobs").cloned().unwrap_or(Value::Null);
    let finish_reason = c.get("finish_reason").cloned().unwrap_or(Value::Null);
    let stop_reason = c.get("stop_reason").cloned().unwrap_or(Value::Null);
    match kind {
        Kind::Chat => {
            let message = c.get("message").unwrap_or(&Value::Null);
            vec![
                serde_json::json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                serde_json::json!([{"index": index, "delta": chat_delta(message), "logprobs": logprobs, "finish_reason": null}]),
                serde_json::json!([{"index": index, "delta": {"content": ""}, "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason}]),
            ]
        }
        Kind::Completion => {
            let text = c.get("text").cloned().unwrap_or(Value::from(""));
            vec![
                serde_json::json!([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": null, "stop_reason": null}]),
                serde_json::json!([{"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason}]),
            ]
        }
    }
}

/// A kept chat message as one delta: its content, its tool calls (indexed, as a stream
/// numbers them) and its reasoning.
fn chat_delta(message: &Value) -> Value {
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
    delta
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
pub(super) fn splice_identity(json: &str, id: &str, created: u64) -> Option<Vec<u8>> {
    let found: Identity = serde_json::from_str(json).ok()?;
    let spans = identity_spans(json, found.id, found.created)?;
    let mut out = Vec::with_capacity(json.len() + id.len() + 16);
    splice_at(&mut out, json, &spans, id, created)?;
    Some(out)
}

/// Where `id` and `created`, two values borrowed from `json`, are in it.
fn identity_spans(json: &str, id: &RawValue, created: &RawValue) -> Option<Stamp> {
    // Both values are slices of `json`: their offsets locate them in it.
    let span = |raw: &RawValue| {
        let start = (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
        let range = start..start + raw.get().len();
        json.get(range.clone()).map(|_| range)
    };
    Some(Stamp {
        id: span(id)?,
        created: span(created)?,
    })
}

/// Appends `json` to `out` with the values at `spans` (from [`identity_spans`]) replaced by
/// this response's `id` and `created`; `None`, with `out` unchanged, when the spans do not fit.
fn splice_at(out: &mut Vec<u8>, json: &str, spans: &Stamp, id: &str, created: u64) -> Option<()> {
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
    use super::super::captures::{capture, unchunked};
    use super::*;

    /// The whole events of a captured stream.
    fn events(name: &str) -> Vec<Vec<u8>> {
        let body = unchunked(&capture(name));
        let mut events = Vec::new();
        sse::SseEvents::default().split(&body, |e| events.push(e.to_vec()));
        events
    }

    /// What a follower joining after `k` events gets, followed by the rest, adds up to the
    /// whole stream's answer: for every `k`, on real vLLM streams with log-probabilities,
    /// several choices, tool calls and a usage chunk.
    #[test]
    fn the_answer_so_far_and_the_rest_add_up_to_the_whole() {
        for (name, kind) in [
            ("chat-logprobs-stream.http", Kind::Chat),
            ("chat-n2-stream.http", Kind::Chat),
            ("chat-stream-usage.http", Kind::Chat),
            ("target-chat-tools-named-stream.http", Kind::Chat),
            ("completion-n2-stream.http", Kind::Completion),
            ("completion-stream-usage.http", Kind::Completion),
        ] {
            let events = events(name);
            let whole = from_sse(kind, &[Bytes::from(events.concat())], None).unwrap();
            let whole: Value = serde_json::from_str(whole.get()).unwrap();
            for k in 0..=events.len() {
                let mut first = Assembly::new(kind);
                for e in &events[..k] {
                    first.feed(e);
                }
                let mut joined = first.so_far();
                joined.extend(events[k..].concat());
                if k == events.len() {
                    // Joined after `[DONE]`: a reader ends with the log's end.
                    joined.extend_from_slice(b"data: [DONE]\n\n");
                }
                let got = from_sse(kind, &[Bytes::from(joined)], None)
                    .unwrap_or_else(|e| panic!("{name} joined after {k}: {e:?}"));
                let got: Value = serde_json::from_str(got.get()).unwrap();
                assert_eq!(got, whole, "{name} joined after {k} events");
            }
        }
    }

    #[test]
    fn a_stream_with_an_error_event_or_cut_short_is_not_an_answer() {
        let events = events("chat-stream-usage.http");
        let cut = events[..events.len() - 1].concat();
        assert_eq!(
            from_sse(Kind::Chat, &[Bytes::from(cut)], None),
            Err(AnswerError::Incomplete)
        );
        let mut errored = events[..2].concat();
        errored.extend_from_slice(b"data: {\"error\": {\"message\": \"boom\", \"code\": 500}}\n\n");
        errored.extend(events[2..].concat());
        assert_eq!(
            from_sse(Kind::Chat, &[Bytes::from(errored)], None),
            Err(AnswerError::ErrorEvent)
        );
    }
}
