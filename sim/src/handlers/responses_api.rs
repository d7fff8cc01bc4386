//! OpenAI's Responses API as vLLM 0.32 serves it (`POST /v1/responses`,
//! `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`;
//! `vllm/entrypoints/openai/responses/`): the request is run as the chat it converts to
//! (`instructions` as a leading system message; a string `input` as a user message; input
//! items as messages: `message` items with text parts, `function_call` items as tool calls,
//! `function_call_output` items as tool messages; a `previous_response_id`'s conversation and
//! answer first), and answered as a `response` object. Shapes from vLLM 0.32's captures
//! (`responses.http`, `responses-stream.http`): the object's fields in vLLM's order, `status`
//! `completed`, or `incomplete` with `incomplete_details: {"reason": "max_output_tokens"}`
//! when cut; a stream of `event:`/`data:` events with `sequence_number`s:
//! `response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, a `response.output_text.delta` per token that shows text,
//! `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
//! `response.completed`.
//!
//! vLLM keeps responses only when started with `VLLM_ENABLE_RESPONSES_API_STORE=1`
//! (`SimConfig::responses_store`, `--responses-store`), in the memory of the instance that made
//! them: a `previous_response_id`, a `GET` or a `cancel` for a response it does not hold is
//! vLLM's 404 (`Response with id '...' not found.`); without the store, `store: true` is
//! quietly ignored and every `previous_response_id` is that 404. A stored response was made
//! synchronously: `cancel` answers vLLM's 400 (`Cannot cancel a synchronous response.`).
//!
//! Not simulated: background mode, tool calls in answers, built-in tools, reasoning items.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use serde_json::{json, Value};

use super::answer::Answer;
use crate::openai::ApiError;
use crate::text::Finish;

/// What a response echoes of its request, beside the chat it runs as.
#[derive(Clone, Debug)]
pub struct ResponseRequest {
    pub instructions: Value,
    pub temperature: f64,
    pub top_p: f64,
    pub max_output_tokens: Value,
    pub tools: Value,
    pub tool_choice: Value,
    pub previous_response_id: Value,
    pub metadata: Value,
    /// The body's `request_id`, which vLLM names the response after when there is one.
    pub request_id: Option<String>,
    /// Kept for `previous_response_id` and `GET` (with the instance's store on).
    pub store: bool,
    /// The chat messages the request ran with, its previous response's included.
    pub messages: Vec<Value>,
}

/// The responses an instance keeps: id → (the conversation with its answer, the response).
#[derive(Debug, Default)]
pub struct Store {
    responses: Mutex<HashMap<String, Stored>>,
}

#[derive(Clone, Debug)]
struct Stored {
    conversation: Vec<Value>,
    response: Bytes,
}

impl Store {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Stored>> {
        self.responses.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The stored response `id`, as `GET /v1/responses/{id}` answers it.
    pub fn get(&self, id: &str) -> Result<Bytes, ApiError> {
        self.lock()
            .get(id)
            .map(|stored| stored.response.clone())
            .ok_or_else(|| not_found(id))
    }

    /// `POST /v1/responses/{id}/cancel`: a stored response was made synchronously.
    pub fn cancel(&self, id: &str) -> ApiError {
        if self.lock().contains_key(id) {
            return invalid(
                "Cannot cancel a synchronous response.".into(),
                "response_id",
                400,
            );
        }
        not_found(id)
    }

    fn conversation(&self, id: &str) -> Option<Vec<Value>> {
        self.lock()
            .get(id)
            .map(|stored| stored.conversation.clone())
    }

    fn keep(&self, id: String, conversation: Vec<Value>, response: Bytes) {
        self.lock().insert(
            id,
            Stored {
                conversation,
                response,
            },
        );
    }
}

fn invalid(message: String, param: &str, status: u16) -> ApiError {
    let mut error = ApiError::new(status, message).with_param(param);
    error.err_type = "invalid_request_error";
    error
}

pub fn not_found(id: &str) -> ApiError {
    invalid(
        format!("Response with id '{id}' not found."),
        "response_id",
        404,
    )
}

/// The chat a Responses request runs as, and what its response echoes. `store` is the
/// instance's store, when it keeps responses.
pub fn to_chat(body: &[u8], store: Option<&Store>) -> Result<(Value, ResponseRequest), ApiError> {
    let request: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON: {e}")))?;
    let mut messages = Vec::new();
    if let Some(instructions) = request["instructions"].as_str() {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    if let Some(previous) = request["previous_response_id"].as_str() {
        let conversation = store
            .and_then(|s| s.conversation(previous))
            .ok_or_else(|| not_found(previous))?;
        // The previous turn's own instructions do not carry over.
        messages.extend(conversation.into_iter().filter(|m| m["role"] != "system"));
    }
    match &request["input"] {
        Value::String(text) => messages.push(json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for item in items {
                convert_item(item, &mut messages);
            }
        }
        _ => return Err(ApiError::bad_request("Field required: input")),
    }
    let mut chat = json!({"model": request["model"], "messages": messages});
    if let Some(max) = request["max_output_tokens"].as_u64() {
        chat["max_tokens"] = json!(max);
    }
    let tools: Vec<Value> = request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|tool| tool["type"] == "function")
        .map(|tool| {
            json!({"type": "function", "function": {
                "name": tool["name"], "description": tool["description"],
                "parameters": tool["parameters"],
            }})
        })
        .collect();
    if !tools.is_empty() {
        chat["tools"] = json!(tools);
    }
    for field in ["temperature", "top_p", "stream"] {
        if let Some(value) = request.get(field).filter(|v| !v.is_null()) {
            chat[field] = value.clone();
        }
    }
    if chat["model"].is_null() {
        if let Some(map) = chat.as_object_mut() {
            map.remove("model");
        }
    }
    let echo = ResponseRequest {
        instructions: request["instructions"].clone(),
        temperature: request["temperature"].as_f64().unwrap_or(1.0),
        top_p: request["top_p"].as_f64().unwrap_or(1.0),
        max_output_tokens: request["max_output_tokens"].clone(),
        tool_choice: match &request["tool_choice"] {
            Value::Null if tools.is_empty() => json!("none"),
            Value::Null => json!("auto"),
            choice => choice.clone(),
        },
        tools: request.get("tools").cloned().unwrap_or_else(|| json!([])),
        previous_response_id: request["previous_response_id"].clone(),
        metadata: request["metadata"].clone(),
        request_id: request["request_id"].as_str().map(str::to_string),
        // vLLM's default; quietly off without the instance's store.
        store: store.is_some() && request["store"].as_bool().unwrap_or(true),
        messages: chat["messages"].as_array().cloned().unwrap_or_default(),
    };
    Ok((chat, echo))
}

/// One input item as chat messages.
fn convert_item(item: &Value, out: &mut Vec<Value>) {
    match item["type"].as_str() {
        Some("function_call") => out.push(json!({"role": "assistant", "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }]})),
        Some("function_call_output") => out.push(json!({
            "role": "tool", "tool_call_id": item["call_id"], "content": item["output"],
        })),
        // A message (`type: "message"`, or an easy input message without a type).
        _ => {
            let Some(content) = super::messages::joined_text(&item["content"]) else {
                return;
            };
            let role = item["role"].as_str().unwrap_or("user");
            let role = if role == "developer" { "system" } else { role };
            out.push(json!({"role": role, "content": content}));
        }
    }
}

/// The message item's id: the response's with `msg_` for `resp_`.
fn item_id(answer: &Answer) -> String {
    answer.id.replacen("resp_", "msg_", 1)
}

fn text(answer: &Answer) -> &str {
    answer.choices.first().map_or("", |plan| plan.text_str())
}

fn cut(answer: &Answer) -> bool {
    answer
        .choices
        .first()
        .is_some_and(|plan| plan.finish == Finish::Length)
}

fn output_item(answer: &Answer, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(text) => {
            json!([{"annotations": [], "text": text, "type": "output_text", "logprobs": null}])
        }
        None => json!([]),
    };
    json!({"id": item_id(answer), "content": content, "role": "assistant", "status": status,
           "type": "message", "phase": null})
}

fn usage(answer: &Answer) -> Value {
    let (input, output) = (answer.prompt_tokens(), answer.completion_tokens());
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": answer.cached_tokens(), "cache_write_tokens": 0,
            "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
            "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": input + output,
    })
}

/// The `response` object: in progress (no output, no usage), or done.
fn response_object(answer: &Answer, echo: &ResponseRequest, done: bool) -> Value {
    let (status, incomplete, output, usage) = match (done, cut(answer)) {
        (false, _) => ("in_progress", Value::Null, json!([]), Value::Null),
        (true, cut) => (
            if cut { "incomplete" } else { "completed" },
            if cut {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            json!([output_item(answer, "completed", Some(text(answer)))]),
            usage(answer),
        ),
    };
    json!({
        "id": answer.id, "created_at": answer.created, "incomplete_details": incomplete,
        "instructions": echo.instructions, "metadata": echo.metadata, "model": answer.model,
        "object": "response", "output": output, "parallel_tool_calls": true,
        "temperature": echo.temperature, "tool_choice": echo.tool_choice, "tools": echo.tools,
        "top_p": echo.top_p, "background": false, "max_output_tokens": echo.max_output_tokens,
        "max_tool_calls": null, "previous_response_id": echo.previous_response_id,
        "prompt": null, "reasoning": null, "service_tier": "auto", "status": status,
        "text": null, "top_logprobs": null, "truncation": "disabled", "usage": usage,
        "user": null, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "kv_transfer_params": null, "ec_transfer_params": null, "input_messages": null,
        "output_messages": null,
    })
}

/// The finished response's body; kept in `store` when the request asked for it.
pub fn response_body(answer: &Answer, echo: &ResponseRequest, store: Option<&Store>) -> Vec<u8> {
    let body = serde_json::to_vec(&response_object(answer, echo, true)).unwrap_or_default();
    if let (true, Some(store)) = (echo.store, store) {
        let mut conversation = echo.messages.clone();
        conversation.push(json!({"role": "assistant", "content": text(answer)}));
        store.keep(answer.id.clone(), conversation, Bytes::from(body.clone()));
    }
    body
}

/// The events of a Responses stream, numbered as they go.
#[derive(Default)]
pub struct Events {
    sequence: u64,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> Bytes {
        data["sequence_number"] = json!(self.sequence);
        data["type"] = json!(kind);
        self.sequence += 1;
        Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
    }

    /// The events before the first token's text.
    pub fn start(&mut self, answer: &Answer, echo: &ResponseRequest) -> Vec<Bytes> {
        let response = response_object(answer, echo, false);
        vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
            self.event(
                "response.output_item.added",
                json!({"item": output_item(answer, "in_progress", None), "output_index": 0}),
            ),
            self.event(
                "response.content_part.added",
                json!({"content_index": 0, "item_id": item_id(answer), "output_index": 0,
                       "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}}),
            ),
        ]
    }

    /// A text delta.
    pub fn delta(&mut self, answer: &Answer, text: &str) -> Bytes {
        self.event(
            "response.output_text.delta",
            json!({"content_index": 0, "delta": text, "item_id": item_id(answer),
                   "logprobs": [], "output_index": 0}),
        )
    }

    /// The events after the last token; the response is kept as [`response_body`] keeps it.
    pub fn end(
        &mut self,
        answer: &Answer,
        echo: &ResponseRequest,
        store: Option<&Store>,
    ) -> Vec<Bytes> {
        let text = text(answer);
        let item = item_id(answer);
        let body = response_body(answer, echo, store);
        let response: Value = serde_json::from_slice(&body).unwrap_or_default();
        vec![
            self.event(
                "response.output_text.done",
                // vLLM's order: the sequence number before the text (set in place).
                json!({"content_index": 0, "item_id": item, "logprobs": [], "output_index": 0,
                       "sequence_number": 0, "text": text}),
            ),
            self.event(
                "response.content_part.done",
                json!({"content_index": 0, "item_id": item, "output_index": 0,
                       "part": {"annotations": [], "text": text, "type": "output_text", "logprobs": null}}),
            ),
            self.event(
                "response.output_item.done",
                json!({"item": output_item(answer, "completed", Some(text)), "output_index": 0}),
            ),
            self.event("response.completed", json!({"response": response})),
        ]
    }
}
