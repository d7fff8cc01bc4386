//! Anthropic's Messages API, as vLLM 0.32 serves it: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens` (which generates nothing).
//!
//! A request is a chat: `messages` (texts or typed blocks: `text`, `tool_use`, `tool_result`,
//! ...), a `system` prompt beside them, `max_tokens` required. An answer is a `message` object
//! with its `content` blocks and `stop_reason`; a stream is named events (`message_start`,
//! `content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`,
//! `message_stop`), and always carries its usage (`message_start` the input's,
//! `message_delta` the output's). Errors are `{"type": "error", "error": {"type",
//! "message"}}`, in a stream as an `error` event; Anthropic's SDKs pick their exception by
//! the status, and show the type and message.
//!
//! The answer codec keeps the non-stream `message`: a stream is assembled from its events
//! (text, tool input and thinking deltas joined per block), and replayed as the event
//! sequence vLLM sends, each block whole in one delta.

use super::openai::{is_error_event, AnswerText};
use super::{AnswerError, ApiFamily, RateLimitHeaders, RouteMatch, WireError};
use crate::request::{concat, member, Endpoint, InvalidRequest, LlmCall, Member, Slot};
use crate::request::{StreamOptions, OPENAI_MEMBERS};
use crate::usage::Usage;
use bytes::Bytes;
use serde_json::{json, Value};

/// One of the two routes of the Messages API.
#[derive(Debug)]
pub struct Anthropic {
    count_tokens: bool,
}

/// `POST /v1/messages`.
pub static MESSAGES: Anthropic = Anthropic {
    count_tokens: false,
};
/// `POST /v1/messages/count_tokens`.
pub static COUNT_TOKENS: Anthropic = Anthropic { count_tokens: true };

/// What a Messages request (and a token count's) is read for: the members it shares with
/// OpenAI's, `max_tokens`, the `system` prompt (a text or text blocks) and
/// `stop_sequences` for the stop.
static MESSAGES_MEMBERS: [Member; 20] = concat(
    OPENAI_MEMBERS,
    [
        member("max_tokens", Slot::MaxTokens),
        member("system", Slot::System),
        member("stop_sequences", Slot::Stop),
    ],
);

impl ApiFamily for Anthropic {
    /// `count_tokens` asks nothing of a model.
    fn question(&self, body: &[u8]) -> Option<super::question::Question> {
        if self.count_tokens {
            return None;
        }
        super::question::read(body, super::question::Turns::List("messages"))
    }

    /// A stream's usage is in `message_start`'s `message` (the input; output 0) and in
    /// `message_delta` (the output, and vLLM's input again); a whole answer's is its own.
    /// Never deeper: a tool call's `input` is an object the model writes.
    fn usage_names(&self) -> crate::usage::UsageNames {
        crate::usage::UsageNames::ANTHROPIC
    }

    fn usage_scanner(&self, stream: bool) -> crate::usage::UsageScanner {
        crate::usage::UsageScanner::at_most_nested(self.usage_names(), if stream { 2 } else { 1 })
    }

    fn name(&self) -> &'static str {
        if self.count_tokens {
            "count_tokens"
        } else {
            "messages"
        }
    }

    fn path(&self) -> &'static str {
        if self.count_tokens {
            "/v1/messages/count_tokens"
        } else {
            "/v1/messages"
        }
    }

    fn members(&self) -> &'static [Member] {
        &MESSAGES_MEMBERS
    }

    fn parse(
        &self,
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<LlmCall, InvalidRequest> {
        let mut call = LlmCall::read_request(endpoint, route, body, self.members(), None)?;
        call.request.require("messages")?;
        if !self.count_tokens {
            // Anthropic's API has no default budget: vLLM refuses a request without one.
            call.request.require("max_tokens")?;
        }
        call.request.check_sampling()?;
        // Its streams always end with their usage: as if the client had asked, so that
        // nothing asks the engine for it with OpenAI's `stream_options`.
        call.request.stream_options = Some(StreamOptions {
            include_usage: Some(true),
        });
        if self.count_tokens {
            call.demand.output_tokens = 0;
        }
        Ok(call)
    }

    fn is_error_event(&self, data: &[u8]) -> bool {
        is_error_event(data)
    }

    fn answer_from_json(&self, body: Bytes) -> Result<AnswerText, AnswerError> {
        if self.count_tokens {
            return Err(AnswerError::NotAnAnswer);
        }
        #[derive(serde::Deserialize)]
        struct Shape<'a> {
            #[serde(rename = "type", borrow)]
            kind: Option<std::borrow::Cow<'a, str>>,
            content: Option<serde::de::IgnoredAny>,
            stop_reason: Option<serde::de::IgnoredAny>,
        }
        let shape: Shape = serde_json::from_slice(&body).map_err(|_| AnswerError::NotAnAnswer)?;
        if shape.kind.as_deref() != Some("message") || shape.content.is_none() {
            return Err(AnswerError::NotAnAnswer);
        }
        if shape.stop_reason.is_none() {
            return Err(AnswerError::Incomplete);
        }
        AnswerText::checked(body).ok_or(AnswerError::NotAnAnswer)
    }

    fn answer_from_stream(
        &self,
        chunks: &[Bytes],
        usage: Option<Usage>,
    ) -> Result<AnswerText, AnswerError> {
        let mut message = assemble(chunks)?;
        if let (Some(usage), Some(fields)) = (usage, message.as_object_mut()) {
            fields.insert("usage".into(), usage_object(usage));
        }
        AnswerText::from_value(&message)
    }

    fn stream_answer(&'static self) -> Box<dyn super::StreamAnswer> {
        super::WholeStream::boxed(self)
    }

    fn render_json(&self, answer: &AnswerText, id: &str, _created: u64) -> Bytes {
        let mut message = answer.tree();
        if let Some(fields) = message.as_object_mut() {
            fields.insert("id".into(), Value::from(id));
        }
        Bytes::from(serde_json::to_vec(&message).unwrap_or_default())
    }

    fn render_stream(
        &self,
        answer: &AnswerText,
        id: &str,
        _created: u64,
        _include_usage: bool,
    ) -> Bytes {
        Bytes::from(render_events(&answer.tree(), id))
    }

    fn id_prefix(&self) -> &'static str {
        "msg"
    }

    fn error_body(&self, error: &WireError<'_>) -> Vec<u8> {
        error_body(error)
    }

    fn error_event(&self, error: &WireError<'_>) -> Vec<u8> {
        let mut event = b"event: error\ndata: ".to_vec();
        event.extend_from_slice(&error_body(error));
        event.extend_from_slice(b"\n\n");
        event
    }

    fn generates(&self) -> bool {
        !self.count_tokens
    }

    fn cache_use(&self, _request: &crate::request::LlmRequest) -> super::CacheUse {
        if self.count_tokens {
            super::CacheUse::Never
        } else {
            super::CacheUse::IfDeterministic
        }
    }

    fn rate_limit_headers(&self) -> RateLimitHeaders {
        RateLimitHeaders::Anthropic
    }
}

/// Anthropic's error type for a status (its SDKs choose the exception by the status).
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type", "message", "reason"}}`: Sluice's reason token beside
/// Anthropic's fields, as in OpenAI's shape.
fn error_body(error: &WireError<'_>) -> Vec<u8> {
    let body = json!({
        "type": "error",
        "error": {
            "type": error_type(error.status),
            "message": error.message,
            "reason": error.reason,
        },
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// A `usage` object in the API's shape.
fn usage_object(usage: Usage) -> Value {
    json!({"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens})
}

/// The most content blocks an answer is taken to have.
const MAX_BLOCKS: usize = 4096;

/// The `message` a whole stream adds up to; `Incomplete` without its `message_stop`.
fn assemble(chunks: &[Bytes]) -> Result<Value, AnswerError> {
    let mut message: Option<Value> = None;
    let mut blocks: Vec<Value> = Vec::new();
    // A tool's input comes as pieces of JSON text, parsed once its block ends.
    let mut inputs: Vec<Option<String>> = Vec::new();
    let mut stopped = false;
    for event in super::stream_events(chunks)? {
        if stopped {
            return Err(AnswerError::NotAnAnswer);
        }
        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
        // An upstream's index sizes the blocks: a lying one must not make them huge.
        let Some(index) = usize::try_from(index).ok().filter(|i| *i < MAX_BLOCKS) else {
            return Err(AnswerError::NotAnAnswer);
        };
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => message = event.get("message").cloned(),
            Some("content_block_start") => {
                if blocks.len() <= index {
                    blocks.resize(index + 1, Value::Null);
                    inputs.resize(index + 1, None);
                }
                let block = event.get("content_block").cloned().unwrap_or(Value::Null);
                if block.get("type").and_then(Value::as_str) == Some("tool_use") {
                    inputs[index] = Some(String::new());
                }
                blocks[index] = block;
            }
            Some("content_block_delta") => {
                let (Some(block), Some(delta)) = (blocks.get_mut(index), event.get("delta")) else {
                    return Err(AnswerError::NotAnAnswer);
                };
                absorb(block, inputs.get_mut(index).and_then(Option::as_mut), delta);
            }
            Some("content_block_stop") => {
                let input = inputs.get_mut(index).and_then(Option::take);
                if let (Some(block), Some(input)) = (blocks.get_mut(index), input) {
                    let parsed = if input.trim().is_empty() {
                        json!({})
                    } else {
                        serde_json::from_str(&input).map_err(|_| AnswerError::NotAnAnswer)?
                    };
                    block["input"] = parsed;
                }
            }
            Some("message_delta") => {
                let message = message.as_mut().ok_or(AnswerError::NotAnAnswer)?;
                if let Some(delta) = event.get("delta").and_then(Value::as_object) {
                    for (key, value) in delta {
                        message[key.as_str()] = value.clone();
                    }
                }
                if let Some(usage) = event.get("usage").and_then(Value::as_object) {
                    for (key, value) in usage {
                        message["usage"][key.as_str()] = value.clone();
                    }
                }
            }
            Some("message_stop") => stopped = true,
            Some("error") => return Err(AnswerError::ErrorEvent),
            // `ping` and what a later version adds.
            _ => {}
        }
    }
    let mut message = message.ok_or(AnswerError::Incomplete)?;
    if !stopped || message.get("stop_reason").is_none_or(Value::is_null) {
        return Err(AnswerError::Incomplete);
    }
    message["content"] = Value::Array(blocks.into_iter().filter(|b| !b.is_null()).collect());
    Ok(message)
}

/// One block's delta, joined into it.
fn absorb(block: &mut Value, input: Option<&mut String>, delta: &Value) {
    let text = |field: &str| delta.get(field).and_then(Value::as_str);
    match delta.get("type").and_then(Value::as_str) {
        Some("text_delta") => append(block, "text", text("text")),
        Some("thinking_delta") => append(block, "thinking", text("thinking")),
        Some("signature_delta") => append(block, "signature", text("signature")),
        Some("input_json_delta") => {
            if let (Some(input), Some(piece)) = (input, text("partial_json")) {
                input.push_str(piece);
            }
        }
        _ => {}
    }
}

fn append(block: &mut Value, field: &str, piece: Option<&str>) {
    let Some(piece) = piece else { return };
    match block.get_mut(field) {
        Some(Value::String(joined)) => joined.push_str(piece),
        _ => block[field] = Value::from(piece),
    }
}

fn event(out: &mut Vec<u8>, data: &Value) {
    let name = data.get("type").and_then(Value::as_str).unwrap_or("ping");
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"\n\n");
}

/// A kept `message` as vLLM streams one: `message_start` (no content, the input's usage),
/// each block started empty, given whole in one delta and stopped, `message_delta` with the
/// stop reason and usage, `message_stop`.
fn render_events(message: &Value, id: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(1024);
    let usage = message.get("usage").cloned().unwrap_or(Value::Null);
    let input_tokens = usage.get("input_tokens").cloned().unwrap_or(Value::from(0));
    let mut start = message.clone();
    if let Some(fields) = start.as_object_mut() {
        fields.insert("id".into(), Value::from(id));
        fields.insert("content".into(), json!([]));
        fields.insert("stop_reason".into(), Value::Null);
        fields.insert("stop_sequence".into(), Value::Null);
        fields.insert(
            "usage".into(),
            json!({"input_tokens": input_tokens, "output_tokens": 0}),
        );
    }
    event(
        &mut out,
        &json!({"type": "message_start", "message": start}),
    );
    let blocks = message.get("content").and_then(Value::as_array);
    for (index, block) in blocks.into_iter().flatten().enumerate() {
        let kind = block.get("type").and_then(Value::as_str).unwrap_or("text");
        let (empty, delta) = match kind {
            "tool_use" => {
                let input = block.get("input").cloned().unwrap_or(json!({}));
                let mut empty = block.clone();
                empty["input"] = json!({});
                let partial = serde_json::to_string(&input).unwrap_or_default();
                (
                    empty,
                    json!({"type": "input_json_delta", "partial_json": partial}),
                )
            }
            "thinking" => {
                let mut empty = block.clone();
                empty["thinking"] = Value::from("");
                let thinking = block.get("thinking").cloned().unwrap_or(Value::from(""));
                (
                    empty,
                    json!({"type": "thinking_delta", "thinking": thinking}),
                )
            }
            _ => {
                let mut empty = block.clone();
                empty["text"] = Value::from("");
                let text = block.get("text").cloned().unwrap_or(Value::from(""));
                (empty, json!({"type": "text_delta", "text": text}))
            }
        };
        event(
            &mut out,
            &json!({"type": "content_block_start", "content_block": empty, "index": index}),
        );
        event(
            &mut out,
            &json!({"type": "content_block_delta", "delta": delta, "index": index}),
        );
        event(
            &mut out,
            &json!({"type": "content_block_stop", "index": index}),
        );
    }
    let stop = json!({
        "stop_reason": message.get("stop_reason").cloned().unwrap_or(Value::Null),
        "stop_sequence": message.get("stop_sequence").cloned().unwrap_or(Value::Null),
    });
    event(
        &mut out,
        &json!({"type": "message_delta", "delta": stop, "usage": usage}),
    );
    event(&mut out, &json!({"type": "message_stop"}));
    out
}

#[cfg(test)]
mod tests {
    use super::super::captures::{capture, unchunked};
    use super::*;

    #[test]
    fn a_captured_stream_and_answer_are_kept_and_replayed_both_ways() {
        let stream = unchunked(&capture("messages-stream.http"));
        let kept = MESSAGES
            .answer_from_stream(&[Bytes::from(stream.clone())], None)
            .unwrap();
        let message = kept.tree();
        assert_eq!(message["content"][0]["text"], "attributeouldto");
        assert_eq!(message["stop_reason"], "max_tokens");
        assert_eq!(message["usage"]["output_tokens"], 3);
        // Cut before `message_stop`: not kept.
        let cut = &stream[..stream.len() - 40];
        assert_eq!(
            MESSAGES.answer_from_stream(&[Bytes::copy_from_slice(cut)], None),
            Err(AnswerError::Incomplete)
        );
        // Replayed as a stream, it adds up to the same message under its new id.
        let replay = MESSAGES.render_stream(&kept, "msg-2", 0, false);
        let again = MESSAGES.answer_from_stream(&[replay], None).unwrap().tree();
        assert_eq!(again["id"], "msg-2");
        assert_eq!(again["content"], message["content"]);
        assert_eq!(again["usage"], message["usage"]);

        let json = MESSAGES
            .answer_from_json(Bytes::from(capture("messages.http")))
            .unwrap();
        let body: Value = serde_json::from_slice(&MESSAGES.render_json(&json, "msg-3", 0)).unwrap();
        assert_eq!(body["id"], "msg-3");
        assert_eq!(body["usage"]["input_tokens"], 20);
    }

    #[test]
    fn tool_input_and_thinking_are_joined_per_block() {
        let events = [
            r#"{"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"model":"x","stop_reason":null,"usage":{"input_tokens":5,"output_tokens":0}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t1","name":"read","input":{}}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"pa"}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"th\":\"a\"}"}}"#,
            r#"{"type":"content_block_stop","index":1}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":9}}"#,
            r#"{"type":"message_stop"}"#,
        ];
        let stream: String = events
            .iter()
            .map(|e| format!("event: x\ndata: {e}\n\n"))
            .collect();
        let kept = MESSAGES
            .answer_from_stream(&[Bytes::from(stream)], None)
            .unwrap();
        let message = kept.tree();
        assert_eq!(message["content"][0]["thinking"], "hm");
        assert_eq!(message["content"][1]["input"], json!({"path": "a"}));
        assert_eq!(
            message["usage"],
            json!({"input_tokens": 5, "output_tokens": 9})
        );
        let replay = MESSAGES.render_stream(&kept, "msg-1", 0, true);
        let again = MESSAGES.answer_from_stream(&[replay], None).unwrap().tree();
        assert_eq!(again["content"], message["content"]);
        assert_eq!(again["stop_reason"], "tool_use");
    }

    #[test]
    fn a_block_index_no_answer_has_is_not_an_answer() {
        let stream = "event: x\ndata: {\"type\":\"content_block_start\",\"index\":1000000000000,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n";
        assert_eq!(
            MESSAGES.answer_from_stream(&[Bytes::from(stream)], None),
            Err(AnswerError::NotAnAnswer)
        );
    }

    #[test]
    fn errors_are_anthropics_shape() {
        let error = WireError {
            status: 429,
            message: "slow down",
            param: None,
            reason: "rate-limited",
        };
        let body: Value = serde_json::from_slice(&MESSAGES.error_body(&error)).unwrap();
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down", "reason": "rate-limited"}})
        );
        let event = MESSAGES.error_event(&error);
        assert!(event.starts_with(b"event: error\ndata: {"));
        let stream = [
            Bytes::from_static(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[]}}\n\n"),
            Bytes::from(event),
        ];
        assert_eq!(
            MESSAGES.answer_from_stream(&stream, None),
            Err(AnswerError::ErrorEvent)
        );
    }

    #[test]
    fn a_request_needs_messages_and_a_budget_and_its_system_prompt_counts() {
        let parse = |body: &str| LlmCall::parse(Endpoint::Messages, Bytes::from(body.to_owned()));
        let e = parse(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let short =
            parse(r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#)
                .unwrap();
        let system = "You are a careful agent. ".repeat(40);
        let long = parse(&format!(
            r#"{{"model":"m","max_tokens":8,"system":[{{"type":"text","text":"{system}"}}],"messages":[{{"role":"user","content":"hi"}}],"stop_sequences":["x"]}}"#
        ))
        .unwrap();
        assert!(long.demand.prompt_tokens >= short.demand.prompt_tokens + 200);
        assert_eq!(long.demand.output_tokens, 8);
        assert!(long.request.stop.is_some());
        // Its streams carry their usage: nothing asks for it.
        assert!(long.request.include_usage());
        let count = LlmCall::parse(
            Endpoint::CountTokens,
            Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#),
        )
        .unwrap();
        assert_eq!(count.demand.output_tokens, 0);
    }
}
