//! Anthropic's Messages API as vLLM 0.32 serves it (`POST /v1/messages`,
//! `POST /v1/messages/count_tokens`; `vllm/entrypoints/anthropic/`): the request is turned
//! into a chat completion request (the top-level `system` as a leading system message, text
//! blocks as content, `tool_use` blocks as tool calls, `tool_result` blocks as tool messages,
//! `tools` as functions, `stop_sequences` as `stop`), which the engine runs as any chat; the
//! answer goes back in Anthropic's shape. Shapes from vLLM 0.32's captures
//! (`messages.http`, `messages-stream.http`, `messages-count-tokens.http`):
//!
//! - an answer: `{"id": "chatcmpl-...", "type": "message", "role": "assistant", "content":
//!   [{"type": "text", "text"}], "model", "stop_reason", "usage": {"input_tokens",
//!   "output_tokens"}}` (fields that are `null` left out, `stop_sequence` among them);
//! - a stream (`event:` and `data:` lines, no `[DONE]`): `message_start` (its usage's
//!   `output_tokens` 0), `content_block_start`, a `content_block_delta` per token,
//!   `content_block_stop`, `message_delta` (the stop reason and the whole usage),
//!   `message_stop`;
//! - the stop reason: `max_tokens` when cut by the budget, `stop_sequence` (with the string)
//!   when a stop string matched, else `end_turn`;
//! - an error: `{"type": "error", "error": {"type", "message"}}` with the chat error's type
//!   (`NotFoundError`, `BadRequestError`) and status.
//!
//! Not simulated: tool calls in answers (the chat path never calls tools), thinking blocks,
//! images, the shape of request validation errors (not captured: the Anthropic wrapper is
//! used for them too), and Anthropic's `error` event (an injected mid-stream fault ends the
//! stream with the chat path's error event).

use bytes::Bytes;
use serde::Serialize;
use serde_json::{json, Value};

use super::answer::Answer;
use crate::openai::ApiError;
use crate::server::{self, HttpResponse};
use crate::text::{Finish, StopReason};
use crate::Shared;

/// The chat completion request an Anthropic Messages request is run as, and whether it
/// streams. `for_generation`: `max_tokens` is required (`count_tokens` has none).
pub fn to_chat(body: &[u8], for_generation: bool) -> Result<Value, ApiError> {
    let request: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON: {e}")))?;
    let missing = |field: &str| ApiError::bad_request(format!("Field required: {field}"));
    let model = request
        .get("model")
        .filter(|m| m.is_string())
        .ok_or_else(|| missing("model"))?;
    let messages = request["messages"]
        .as_array()
        .ok_or_else(|| missing("messages"))?;
    let mut chat_messages = Vec::new();
    if let Some(system) = joined_text(&request["system"]) {
        chat_messages.push(json!({"role": "system", "content": system}));
    }
    for message in messages {
        convert_message(message, &mut chat_messages);
    }
    let mut chat = json!({"model": model, "messages": chat_messages});
    if for_generation {
        let max_tokens = request["max_tokens"]
            .as_u64()
            .ok_or_else(|| missing("max_tokens"))?;
        chat["max_tokens"] = json!(max_tokens);
    }
    if let Some(tools) = request["tools"].as_array() {
        let functions: Vec<Value> = tools
            .iter()
            .map(|tool| {
                json!({"type": "function", "function": {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": tool["input_schema"],
                }})
            })
            .collect();
        chat["tools"] = json!(functions);
    }
    if let Some(stop) = request.get("stop_sequences").filter(|s| s.is_array()) {
        chat["stop"] = stop.clone();
    }
    for field in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(value) = request.get(field).filter(|v| !v.is_null()) {
            chat[field] = value.clone();
        }
    }
    Ok(chat)
}

/// The text of a field that is a string or a list of text blocks (joined); `None` when it is
/// neither.
pub(super) fn joined_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Array(blocks) => Some(
            blocks
                .iter()
                .filter_map(|block| block["text"].as_str())
                .collect(),
        ),
        _ => None,
    }
}

/// One Anthropic message as chat messages: text blocks as its content, `tool_use` blocks as
/// its tool calls, each `tool_result` block as a tool message of its own.
fn convert_message(message: &Value, out: &mut Vec<Value>) {
    let role = message["role"].as_str().unwrap_or("user");
    let blocks = match &message["content"] {
        Value::String(text) => {
            out.push(json!({"role": role, "content": text}));
            return;
        }
        Value::Array(blocks) => blocks,
        _ => return,
    };
    let mut text = Vec::new();
    let mut tool_calls = Vec::new();
    for block in blocks {
        match block["type"].as_str() {
            Some("text") => {
                if let Some(t) = block["text"].as_str().filter(|t| !t.is_empty()) {
                    text.push(json!({"type": "text", "text": t}));
                }
            }
            Some("tool_use") => tool_calls.push(json!({
                "id": block["id"],
                "type": "function",
                "function": {
                    "name": block["name"],
                    "arguments": block["input"].to_string(),
                },
            })),
            Some("tool_result") => {
                let content = joined_text(&block["content"]).unwrap_or_default();
                out.push(json!({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}));
            }
            _ => {}
        }
    }
    let mut chat = json!({"role": role});
    match text.as_slice() {
        [] => {}
        [only] => chat["content"] = only["text"].clone(),
        _ => chat["content"] = json!(text),
    }
    if !tool_calls.is_empty() {
        chat["tool_calls"] = json!(tool_calls);
    }
    // A user turn of tool results only has nothing left to say.
    if !(role == "user" && chat.get("content").is_none()) {
        out.push(chat);
    }
}

/// An error in Anthropic's shape, as vLLM translates its own.
pub fn error(shared: &Shared, error: &ApiError) -> HttpResponse {
    shared.stats.count_error();
    server::json(error.status, error_body(error))
}

fn error_body(error: &ApiError) -> Vec<u8> {
    serde_json::to_vec(&json!({"type": "error", "error": {
        "type": error.err_type, "message": error.message,
    }}))
    .unwrap_or_default()
}

/// vLLM 0.32's `AnthropicUsage`: `input_tokens` leaves out what the prefix cache served,
/// which `cache_read_input_tokens` says when prompt details are on (and, as vLLM's
/// `exclude_unset` dump, is absent otherwise). vLLM reports no cache writes.
#[derive(Serialize)]
struct AnthropicUsage {
    input_tokens: u32,
    output_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_read_input_tokens: Option<u32>,
}

#[derive(Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

/// A whole answer (JSON), as vLLM dumps it: `null` fields left out.
#[derive(Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    content: Vec<TextBlock<'a>>,
    model: &'a str,
    stop_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_sequence: Option<&'a str>,
    usage: AnthropicUsage,
}

/// The answer's stop reason and stop sequence, as vLLM maps the chat finish reason.
fn stop_of(answer: &Answer) -> (&'static str, Option<&str>) {
    let Some(plan) = answer.choices.first() else {
        return ("end_turn", None);
    };
    match (&plan.finish, &plan.stop_reason) {
        (Finish::Length, _) => ("max_tokens", None),
        (Finish::Stop, StopReason::Text(stop)) => ("stop_sequence", Some(stop.as_str())),
        (Finish::Stop, _) => ("end_turn", None),
    }
}

fn usage(answer: &Answer, output_tokens: u32) -> AnthropicUsage {
    let cached = answer.reported_cached_tokens();
    AnthropicUsage {
        input_tokens: answer.prompt_tokens().saturating_sub(cached.unwrap_or(0)),
        output_tokens,
        cache_read_input_tokens: cached,
    }
}

/// The whole answer's body.
pub fn message_body(answer: &Answer) -> Vec<u8> {
    let (stop_reason, stop_sequence) = stop_of(answer);
    let text = answer.choices.first().map_or("", |plan| plan.text_str());
    let message = Message {
        id: &answer.id,
        kind: "message",
        role: "assistant",
        content: vec![TextBlock { kind: "text", text }],
        model: &answer.model,
        stop_reason,
        stop_sequence,
        usage: usage(answer, answer.completion_tokens()),
    };
    serde_json::to_vec(&message).unwrap_or_default()
}

/// One event of the stream: `event: NAME` and its data.
fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// `message_start` and `content_block_start`, sent with the first token.
pub fn start_events(answer: &Answer) -> [Bytes; 2] {
    let message = json!({"type": "message_start", "message": {
        "id": answer.id, "type": "message", "role": "assistant", "content": [],
        "model": answer.model, "stop_reason": null, "stop_sequence": null,
        "usage": usage(answer, 0),
    }});
    let block = json!({"type": "content_block_start",
        "content_block": {"type": "text", "text": ""}, "index": 0});
    [
        event("message_start", &message),
        event("content_block_start", &block),
    ]
}

/// The `content_block_delta` of `text`.
pub fn delta_event(text: &str) -> Bytes {
    let delta = json!({"type": "content_block_delta",
        "delta": {"type": "text_delta", "text": text}, "index": 0});
    event("content_block_delta", &delta)
}

/// `content_block_stop`, `message_delta` and `message_stop`, once the last token is out.
pub fn end_events(answer: &Answer) -> [Bytes; 3] {
    let (stop_reason, stop_sequence) = stop_of(answer);
    let stop = json!({"type": "content_block_stop", "index": 0});
    let delta = json!({"type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": usage(answer, answer.completion_tokens())});
    [
        event("content_block_stop", &stop),
        event("message_delta", &delta),
        event("message_stop", &json!({"type": "message_stop"})),
    ]
}

/// The text choice 0 shows once token `step` is out, past what was sent (`sent` bytes).
pub fn text_at<'a>(answer: &'a Answer, step: usize, sent: &mut usize) -> Option<&'a str> {
    let plan = answer.choices.first()?;
    let shown = (*plan.visible.get(step)?)?;
    let text = plan.text_str().get(*sent..shown)?;
    *sent = shown.max(*sent);
    Some(text)
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the chat template makes them.
pub fn count_tokens(shared: &Shared, body: &[u8]) -> HttpResponse {
    let counted = to_chat(body, false).and_then(|chat| {
        super::validate_chat(shared, &chat).map(|(request, _)| request.prompt.tokens)
    });
    match counted {
        Ok(tokens) => server::json(
            200,
            serde_json::to_vec(&json!({"input_tokens": tokens,
                "context_management": {"original_input_tokens": tokens}}))
            .unwrap_or_default(),
        ),
        Err(e) => error(shared, &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_with_tools_becomes_a_chat_request() {
        let body = json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"], "temperature": 0,
            "tools": [{"name": "read", "description": "Reads a file",
                       "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"}]},
            ],
        });
        let chat = to_chat(&serde_json::to_vec(&body).unwrap(), true).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": "Reading.", "tool_calls": [{"id": "toolu_1",
                    "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"a.txt\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "hello"},
            ])
        );
        assert_eq!(
            chat["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(chat["stop"], json!(["\n\n"]));
        assert_eq!(chat["max_tokens"], 64);
        let without = json!({"model": "m", "messages": []});
        assert!(to_chat(&serde_json::to_vec(&without).unwrap(), true).is_err());
        assert!(to_chat(&serde_json::to_vec(&without).unwrap(), false).is_ok());
    }
}
