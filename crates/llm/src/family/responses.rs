//! OpenAI's Responses API, as vLLM 0.32 serves it: `POST /v1/responses`.
//!
//! A request's prompt is its `input` (a text, or items: messages, tool calls and their
//! outputs) after its `instructions`; its budget is `max_output_tokens`. An answer is a
//! `response` object (`output` items, `status`, `usage` with `input_tokens` and
//! `output_tokens`); a stream is numbered named events (`response.created`, ...,
//! `response.completed`, whose `response` is the whole answer), and always carries its usage.
//! Errors are OpenAI's shape; in a stream an `error` event.
//!
//! vLLM keeps a response (with `store`, the default, and `VLLM_ENABLE_RESPONSES_API_STORE=1`)
//! in the memory of the engine that made it, for `previous_response_id` follow-ups and
//! `GET /v1/responses/{id}`: the core sends those where the response was made. For the same
//! reason only `store: false` answers may be cached: a replayed id is one no engine has.
//!
//! The answer codec keeps the `response` object: a stream's is its `response.completed`
//! event's; a replay as a stream is vLLM's event sequence, each text whole in one delta.

use super::openai::{error_body, AnswerText};
use super::{AnswerError, ApiFamily, CacheUse, RouteMatch, WireError};
use crate::request::{concat, member, Endpoint, InvalidRequest, LlmCall, LlmRequest, Member};
use crate::request::{Slot, StreamOptions, OPENAI_MEMBERS};
use crate::usage::Usage;
use bytes::Bytes;
use serde_json::{json, Value};

/// The Responses API.
#[derive(Debug)]
pub struct Responses;

/// `POST /v1/responses`.
pub static RESPONSES: Responses = Responses;

/// What a Responses request is read for: the members it shares with OpenAI's others, its
/// `input` items and `instructions`, `max_output_tokens` for the budget (its `max_tokens`
/// is not one), and the stored responses' `previous_response_id`, `store`, `background`.
static RESPONSES_MEMBERS: [Member; 23] = concat(
    OPENAI_MEMBERS,
    [
        member("input", Slot::Input),
        member("instructions", Slot::Instructions),
        member("max_output_tokens", Slot::MaxTokens),
        member("previous_response_id", Slot::PreviousResponseId),
        member("store", Slot::Store),
        member("background", Slot::Background),
    ],
);

/// The statuses of a response that is a whole answer: done, or cut by its budget.
const WHOLE: [&str; 2] = ["completed", "incomplete"];

impl ApiFamily for Responses {
    fn question(&self, body: &[u8]) -> Option<super::question::Question> {
        super::question::read(body, super::question::Turns::ListOrString("input"))
    }

    fn name(&self) -> &'static str {
        "responses"
    }

    fn path(&self) -> &'static str {
        "/v1/responses"
    }

    fn members(&self) -> &'static [Member] {
        &RESPONSES_MEMBERS
    }

    fn parse(
        &self,
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<LlmCall, InvalidRequest> {
        let mut call = LlmCall::read_request(endpoint, route, body, self.members(), None)?;
        call.request.require("input")?;
        call.request.check_sampling()?;
        // The engine answers a background request at once and generates detached from it:
        // past the tenant's concurrency, the breaker's projection, the total timeout and the
        // drain, charged an estimate whatever it generates. Not served, as a clear 400.
        if call.request.background == Some(true) {
            return Err(InvalidRequest {
                message: "`background: true` is not served through this proxy: a generation \
                          detached from its request escapes its limits. Send the request \
                          without it (stream it for a long answer)."
                    .to_string(),
                param: Some("background".to_string()),
            });
        }
        // Its streams always end with their usage (`response.completed`): as if asked.
        call.request.stream_options = Some(StreamOptions {
            include_usage: Some(true),
        });
        Ok(call)
    }

    /// A stream's usage is its `response`'s (`response.completed` or `.incomplete`: the
    /// `usage` of `response.created` is null); a whole answer's is its own. Never deeper: the
    /// response echoes the request's `tools` and `text.format`, whose JSON schemas may hold
    /// a `usage` object of the client's making.
    /// `store` is `true` by default.
    fn stores_answer(&self, request: &LlmRequest) -> bool {
        request.store != Some(false)
    }

    fn usage_names(&self) -> crate::usage::UsageNames {
        crate::usage::UsageNames::RESPONSES
    }

    fn usage_scanner(&self, stream: bool) -> crate::usage::UsageScanner {
        crate::usage::UsageScanner::at_most_nested(self.usage_names(), if stream { 2 } else { 1 })
    }

    fn is_error_event(&self, data: &[u8]) -> bool {
        #[derive(serde::Deserialize)]
        struct Shape<'a> {
            #[serde(rename = "type", borrow)]
            kind: Option<std::borrow::Cow<'a, str>>,
        }
        serde_json::from_slice::<Shape>(data)
            .is_ok_and(|shape| matches!(shape.kind.as_deref(), Some("error" | "response.failed")))
    }

    fn answer_from_json(&self, body: Bytes) -> Result<AnswerText, AnswerError> {
        #[derive(serde::Deserialize)]
        struct Shape<'a> {
            #[serde(borrow)]
            object: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            status: Option<std::borrow::Cow<'a, str>>,
        }
        let shape: Shape = serde_json::from_slice(&body).map_err(|_| AnswerError::NotAnAnswer)?;
        if shape.object.as_deref() != Some("response") {
            return Err(AnswerError::NotAnAnswer);
        }
        if !shape.status.is_some_and(|s| WHOLE.contains(&&*s)) {
            return Err(AnswerError::Incomplete);
        }
        AnswerText::checked(body).ok_or(AnswerError::NotAnAnswer)
    }

    fn answer_from_stream(
        &self,
        chunks: &[Bytes],
        _usage: Option<Usage>,
    ) -> Result<AnswerText, AnswerError> {
        let mut done = None;
        for event in super::stream_events(chunks)? {
            match event.get("type").and_then(Value::as_str) {
                Some("error" | "response.failed") => return Err(AnswerError::ErrorEvent),
                Some("response.completed" | "response.incomplete") => {
                    done = event.get("response").cloned()
                }
                _ => {}
            }
        }
        let response = done.ok_or(AnswerError::Incomplete)?;
        let status = response.get("status").and_then(Value::as_str);
        if !status.is_some_and(|s| WHOLE.contains(&s)) {
            return Err(AnswerError::Incomplete);
        }
        AnswerText::from_value(&response)
    }

    fn stream_answer(&'static self) -> Box<dyn super::StreamAnswer> {
        super::WholeStream::boxed(self)
    }

    fn render_json(&self, answer: &AnswerText, id: &str, created: u64) -> Bytes {
        Bytes::from(serde_json::to_vec(&stamped(answer, id, created)).unwrap_or_default())
    }

    fn render_stream(
        &self,
        answer: &AnswerText,
        id: &str,
        created: u64,
        _include_usage: bool,
    ) -> Bytes {
        Bytes::from(render_events(&stamped(answer, id, created)))
    }

    fn id_prefix(&self) -> &'static str {
        "resp"
    }

    fn error_body(&self, error: &WireError<'_>) -> Vec<u8> {
        error_body(error)
    }

    /// As OpenAI ends a failed stream: an `error` event with the code and message.
    fn error_event(&self, error: &WireError<'_>) -> Vec<u8> {
        let data = json!({
            "type": "error",
            "code": error.reason,
            "message": error.message,
            "param": error.param,
            "sequence_number": 0,
        });
        let mut event = b"event: error\ndata: ".to_vec();
        let _ = serde_json::to_writer(&mut event, &data);
        event.extend_from_slice(b"\n\n");
        event
    }

    fn budget_key(&self, _request: &LlmRequest) -> &'static str {
        "max_output_tokens"
    }

    /// Only what the engine does not keep: a kept response's id is for follow-ups, which a
    /// replay's fresh id would send to no engine that has it.
    fn cache_use(&self, request: &LlmRequest) -> CacheUse {
        if request.store == Some(false) {
            CacheUse::IfDeterministic
        } else {
            CacheUse::Never
        }
    }
}

/// The kept response with this one's `id` and `created_at`.
fn stamped(answer: &AnswerText, id: &str, created: u64) -> Value {
    let mut response = answer.tree();
    if let Some(fields) = response.as_object_mut() {
        fields.insert("id".into(), Value::from(id));
        fields.insert("created_at".into(), Value::from(created));
    }
    response
}

/// Writes numbered events, each named by its `type`.
struct Events {
    out: Vec<u8>,
    sequence: u64,
}

impl Events {
    fn push(&mut self, mut data: Value) {
        if let Some(fields) = data.as_object_mut() {
            fields.insert("sequence_number".into(), Value::from(self.sequence));
        }
        self.sequence += 1;
        let name = data.get("type").and_then(Value::as_str).unwrap_or("error");
        self.out.extend_from_slice(b"event: ");
        self.out.extend_from_slice(name.as_bytes());
        self.out.extend_from_slice(b"\ndata: ");
        let _ = serde_json::to_writer(&mut self.out, &data);
        self.out.extend_from_slice(b"\n\n");
    }
}

/// A kept response as vLLM streams one: created and in progress (no output, no usage), each
/// output item added, its content (a message's text parts, a call's arguments) given whole
/// and done, the item done, and `response.completed` with the whole response.
fn render_events(response: &Value) -> Vec<u8> {
    let mut events = Events {
        out: Vec::with_capacity(2048),
        sequence: 0,
    };
    let mut start = response.clone();
    if let Some(fields) = start.as_object_mut() {
        fields.insert("output".into(), json!([]));
        fields.insert("status".into(), Value::from("in_progress"));
        fields.insert("usage".into(), Value::Null);
        fields.insert("incomplete_details".into(), Value::Null);
    }
    events.push(json!({"response": start.clone(), "type": "response.created"}));
    events.push(json!({"response": start, "type": "response.in_progress"}));
    let items = response.get("output").and_then(Value::as_array);
    for (output_index, item) in items.into_iter().flatten().enumerate() {
        let item_id = item.get("id").cloned().unwrap_or(Value::Null);
        let mut added = item.clone();
        added["status"] = Value::from("in_progress");
        match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                added["content"] = json!([]);
                events.push(json!({"item": added, "output_index": output_index, "type": "response.output_item.added"}));
                let parts = item.get("content").and_then(Value::as_array);
                for (content_index, part) in parts.into_iter().flatten().enumerate() {
                    let text = part.get("text").cloned().unwrap_or(Value::from(""));
                    let mut empty = part.clone();
                    empty["text"] = Value::from("");
                    events.push(json!({"content_index": content_index, "item_id": item_id, "output_index": output_index, "part": empty, "type": "response.content_part.added"}));
                    events.push(json!({"content_index": content_index, "delta": text, "item_id": item_id, "logprobs": [], "output_index": output_index, "type": "response.output_text.delta"}));
                    events.push(json!({"content_index": content_index, "item_id": item_id, "logprobs": [], "output_index": output_index, "text": text, "type": "response.output_text.done"}));
                    events.push(json!({"content_index": content_index, "item_id": item_id, "output_index": output_index, "part": part, "type": "response.content_part.done"}));
                }
            }
            Some("function_call") => {
                let arguments = item.get("arguments").cloned().unwrap_or(Value::from(""));
                added["arguments"] = Value::from("");
                events.push(json!({"item": added, "output_index": output_index, "type": "response.output_item.added"}));
                events.push(json!({"delta": arguments, "item_id": item_id, "output_index": output_index, "type": "response.function_call_arguments.delta"}));
                events.push(json!({"arguments": arguments, "item_id": item_id, "output_index": output_index, "type": "response.function_call_arguments.done"}));
            }
            _ => events.push(json!({"item": added, "output_index": output_index, "type": "response.output_item.added"})),
        }
        events.push(json!({"item": item, "output_index": output_index, "type": "response.output_item.done"}));
    }
    events.push(json!({"response": response, "type": "response.completed"}));
    events.out
}

#[cfg(test)]
mod tests {
    use super::super::captures::{capture, unchunked};
    use super::*;

    #[test]
    fn a_captured_stream_and_answer_are_kept_and_replayed_both_ways() {
        let stream = unchunked(&capture("responses-stream.http"));
        let kept = RESPONSES
            .answer_from_stream(&[Bytes::from(stream.clone())], None)
            .unwrap();
        let response = kept.tree();
        assert_eq!(
            response["output"][0]["content"][0]["text"],
            "--------ie AR CAUSED"
        );
        assert_eq!(response["usage"]["output_tokens"], 4);
        // Cut before `response.completed`: not kept.
        let at = stream
            .windows(28)
            .position(|w| w == b"event: response.output_item.")
            .unwrap();
        assert_eq!(
            RESPONSES.answer_from_stream(&[Bytes::copy_from_slice(&stream[..at])], None),
            Err(AnswerError::Incomplete)
        );
        // Replayed as a stream, numbered, it adds up to the same response under its new id.
        let replay = RESPONSES.render_stream(&kept, "resp-2", 7, false);
        let events = super::super::stream_events(std::slice::from_ref(&replay)).unwrap();
        let numbers: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
        let again = RESPONSES
            .answer_from_stream(&[replay], None)
            .unwrap()
            .tree();
        assert_eq!(
            (again["id"].as_str(), again["created_at"].as_u64()),
            (Some("resp-2"), Some(7))
        );
        assert_eq!(again["output"], response["output"]);

        let json = RESPONSES
            .answer_from_json(Bytes::from(capture("responses.http")))
            .unwrap();
        let body: Value =
            serde_json::from_slice(&RESPONSES.render_json(&json, "resp-3", 9)).unwrap();
        assert_eq!(body["id"], "resp-3");
        assert_eq!(body["usage"]["input_tokens"], 20);
        // A response still in progress is no answer to keep.
        let queued = br#"{"object":"response","status":"queued","output":[]}"#;
        assert_eq!(
            RESPONSES.answer_from_json(Bytes::from_static(queued)),
            Err(AnswerError::Incomplete)
        );
    }

    #[test]
    fn a_request_reads_its_input_instructions_and_follow_up() {
        let parse = |body: &str| LlmCall::parse(Endpoint::Responses, Bytes::from(body.to_owned()));
        let e = parse(r#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        let call = parse(
            r#"{"model":"m","input":[{"role":"user","content":"hello there"},{"type":"function_call_output","call_id":"c","output":"42"}],
                "instructions":"Be brief.","max_output_tokens":12,"max_tokens":99,"previous_response_id":"resp_1","store":false}"#,
        )
        .unwrap();
        assert_eq!(call.request.max_output_tokens(), Some(12));
        assert_eq!(call.demand.output_tokens, 12);
        assert_eq!(call.request.previous_response_id.as_deref(), Some("resp_1"));
        assert!(call.demand.prompt_tokens > 10);
        assert_eq!(
            RESPONSES.cache_use(&call.request),
            CacheUse::IfDeterministic
        );
        let stored = parse(r#"{"input":"hi"}"#).unwrap();
        assert_eq!(RESPONSES.cache_use(&stored.request), CacheUse::Never);
        // A ceiling sets the Responses budget, not chat's.
        let capped = call.capped(5).unwrap().unwrap();
        assert_eq!(capped.request.max_output_tokens(), Some(5));
        assert!(std::str::from_utf8(&capped.body)
            .unwrap()
            .contains(r#""max_output_tokens":5"#));
    }

    #[test]
    fn a_failed_stream_is_an_error_event() {
        let error = WireError {
            status: 502,
            message: "broke",
            param: None,
            reason: "upstream-error",
        };
        let event = RESPONSES.error_event(&error);
        let data = &event[event.iter().position(|b| *b == b'{').unwrap()..];
        assert!(RESPONSES.is_error_event(data.trim_ascii()));
        assert_eq!(
            RESPONSES.answer_from_stream(&[Bytes::from(event)], None),
            Err(AnswerError::ErrorEvent)
        );
    }
}
