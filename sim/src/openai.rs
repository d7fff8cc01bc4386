//! vLLM's OpenAI wire format, the request side: parsing with vLLM-like 400s, and the error
//! bodies, as each vLLM generation words them (see the repository's `tests/fixtures/`, and
//! `tests/fixtures/vllm-0.32/` for 0.32). The answers' shapes are in `responses`.

use serde::Serialize;
use serde_json::Value;

use crate::config::ErrorShape;
use crate::text::{self, Hasher};

pub use crate::responses::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    /// The `object` of a stream chunk (chat) or of every text-completion answer and chunk.
    pub fn chunk_object(self) -> &'static str {
        match self {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }
}

/// An error answer: HTTP status, message and vLLM error type.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub err_type: &'static str,
    /// The field at fault, as vLLM 0.32 names it (`input_tokens`, `max_tokens`, `body.n`).
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            err_type: error_type(status),
            param: None,
        }
    }

    /// The same error, naming the field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, message)
    }

    /// vLLM 0.32's wording of a bad value: the message, then `(parameter=P, value=V)`, with
    /// `param` set to P.
    fn invalid_value(message: &str, param: &str, value: Option<&str>) -> Self {
        let suffix = match value {
            Some(value) => format!("(parameter={param}, value={value})"),
            None => format!("(parameter={param})"),
        };
        ApiError::bad_request(format!("{message} {suffix}")).with_param(param)
    }
}

pub fn error_type(status: u16) -> &'static str {
    match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        429 => "TooManyRequestsError",
        503 => "ServiceUnavailableError",
        client_error if (400..500).contains(&client_error) => "BadRequestError",
        _ => "InternalServerError",
    }
}

#[derive(Serialize)]
struct NewError<'a> {
    error: ErrorInner<'a>,
}

#[derive(Serialize)]
struct ErrorInner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    err_type: &'a str,
    param: Option<&'a str>,
    code: u16,
}

#[derive(Serialize)]
struct OldError<'a> {
    object: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    err_type: &'a str,
    param: Option<&'a str>,
    code: u16,
}

/// The JSON error body in the configured shape.
pub fn error_body(shape: ErrorShape, error: &ApiError) -> Vec<u8> {
    let serialized = match shape {
        ErrorShape::V0_32 | ErrorShape::New => serde_json::to_vec(&NewError {
            error: ErrorInner {
                message: &error.message,
                err_type: error.err_type,
                param: error.param.as_deref(),
                code: error.status,
            },
        }),
        ErrorShape::Old => serde_json::to_vec(&OldError {
            object: "error",
            message: &error.message,
            err_type: error.err_type,
            param: None,
            code: error.status,
        }),
    };
    // These structs always serialize; an empty body is only a fallback that cannot happen.
    serialized.unwrap_or_default()
}

/// An error inside a stream: vLLM writes it with Python's `json.dumps`, hence the spaces.
pub fn stream_error_event(shape: ErrorShape, error: &ApiError) -> String {
    let message = serde_json::to_string(&error.message).unwrap_or_else(|_| "\"\"".into());
    let inner = match shape {
        ErrorShape::V0_32 | ErrorShape::New => format!(
            "{{\"message\": {message}, \"type\": \"{}\", \"param\": null, \"code\": {}}}",
            error.err_type, error.status
        ),
        ErrorShape::Old => format!(
            "{{\"object\": \"error\", \"message\": {message}, \"type\": \"{}\", \"param\": null, \"code\": {}}}",
            error.err_type, error.status
        ),
    };
    format!("data: {{\"error\": {inner}}}\n\n")
}

// ---------------------------------------------------------------------------------------
// Requests

/// A validated completion request, reduced to what the simulator needs.
#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub kind: Kind,
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Chat: how many messages the conversation has (vLLM 0.32 refuses none).
    pub messages: usize,
    pub max_tokens: Option<u32>,
    /// OpenAI's `n`. For vLLM 0.32 not yet range-checked: see [`CompletionRequest::check_values`].
    pub choice_count: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats`: usage on every chunk.
    pub continuous_usage: bool,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub sampling: Sampling,
    /// Stop strings (`stop`, a string or a list).
    pub stop: Vec<String>,
    /// vLLM's `ignore_eos`: generate until `max_tokens`.
    pub ignore_eos: bool,
    /// Chat's `request_id` field: the answer's id when no `X-Request-Id` header names one.
    pub request_id: Option<String>,
    /// vLLM's `cache_salt`: salts the prompt's first block in the prefix cache.
    pub cache_salt: Option<String>,
    /// The prompt's token ids, when the instance needs them (a tokenizer, prefix caching);
    /// set after parsing (see `handlers::tokenize`).
    pub prompt_ids: Vec<u32>,
    /// The LoRA adapter the request's `model` names; set after parsing.
    pub lora: Option<crate::lora::Adapter>,
    /// What its `kv_transfer_params` ask (disaggregated prefill).
    pub kv_transfer: Option<crate::kv_transfer::TransferAsk>,
}

/// What the answer's text and the KV model need of the prompt.
#[derive(Clone, Copy, Debug)]
pub struct Prompt {
    pub hash: u64,
    pub tokens: u32,
    /// What the tokens were counted from: the rendered prompt's bytes.
    pub bytes: usize,
    /// The rendered prompt's characters (token-id prompts have none).
    pub chars: usize,
}

impl Prompt {
    fn new(hasher: &Hasher, bytes: usize, chars: usize) -> Self {
        Prompt {
            hash: hasher.finish(),
            tokens: text::tokens_for_bytes(bytes).max(1),
            bytes,
            chars,
        }
    }

    /// Counts the prompt again at `bytes_per_token` (real tokenizers make 2.5-3 bytes a
    /// token of code, numbers and most languages; 4 of English prose).
    pub fn count_at(&mut self, bytes_per_token: f64) {
        let tokens = (self.bytes as f64 / bytes_per_token.max(0.5)).ceil();
        self.tokens = (tokens as u32).max(1);
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub temperature: f64,
    pub seed: Option<i64>,
    /// Hash of the sampling parameters that change the text (not max_tokens, which only cuts).
    pub hash: u64,
}

/// A chat message costs its text plus about 4 tokens of chat template.
const CHAT_TEMPLATE_BYTES: usize = 16;
/// An image or other non-text content part counts as this many bytes.
const NON_TEXT_PART_BYTES: usize = 256;
/// A token id in a completion prompt counts as one token.
const TOKEN_ID_BYTES: usize = 4;
/// vLLM's cap on `n` in the simulator.
const MAX_CHOICES: u32 = 128;
/// vLLM's default `--max-logprobs`.
const MAX_LOGPROBS: u32 = 20;

type Fields = serde_json::Map<String, Value>;

/// Parse and validate a request body, in vLLM's order: the first problem found is the one
/// reported, with the configured vLLM generation's message for it. For vLLM 0.32 the value
/// checks that its sampling parameters make come later, in
/// [`CompletionRequest::check_values`].
pub fn parse(
    kind: Kind,
    body: &[u8],
    default_temperature: f64,
    shape: ErrorShape,
) -> Result<CompletionRequest, ApiError> {
    let check = Check { shape };
    let fields = check.object(body)?;
    let model = check.model(&fields)?;
    let (prompt, messages) = match kind {
        Kind::Chat => check.messages(&fields)?,
        Kind::Completion => (check.prompt(&fields)?, 0),
    };
    let max_tokens = check.max_tokens(kind, &fields)?;
    let choice_count = check.choice_count(&fields)?;
    let streaming = check.streaming(&fields)?;
    let (logprobs, top_logprobs) = check.logprobs(kind, &fields)?;
    let sampling = check.sampling(&fields, default_temperature)?;
    let stop = check.stop(&fields)?;
    let ignore_eos = check.bool_field(&fields, "ignore_eos")?.unwrap_or(false);
    let request_id = match kind {
        Kind::Chat => fields
            .get("request_id")
            .and_then(Value::as_str)
            .map(str::to_string),
        Kind::Completion => None,
    };
    Ok(CompletionRequest {
        kind,
        model,
        prompt,
        messages,
        max_tokens,
        choice_count,
        stream: streaming.stream,
        include_usage: streaming.include_usage,
        continuous_usage: streaming.continuous_usage,
        logprobs,
        top_logprobs,
        sampling,
        stop,
        ignore_eos,
        request_id,
        cache_salt: fields
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_string),
        prompt_ids: Vec::new(),
        lora: None,
        kv_transfer: crate::kv_transfer::TransferAsk::parse(fields.get("kv_transfer_params")),
    })
}

impl CompletionRequest {
    /// vLLM 0.32's checks of the sampling parameters, made once the prompt is known to fit:
    /// `n`, `temperature`, the token budget (`max_tokens`, or what is left of the context),
    /// then the logprobs asked for.
    pub fn check_values(&self, budget: u32) -> Result<(), ApiError> {
        let choices = self.choice_count;
        if choices == 0 {
            return Err(ApiError::bad_request(format!(
                "n must be at least 1, got {choices}."
            )));
        }
        if choices > MAX_CHOICES {
            return Err(ApiError::bad_request(format!(
                "n must be at most {MAX_CHOICES}, got {choices}."
            )));
        }
        let temperature = self.sampling.temperature;
        if !(0.0..=2.0).contains(&temperature) {
            let value = python_float(temperature);
            return Err(ApiError::invalid_value(
                &format!("temperature must be in [0, 2], got {value}."),
                "temperature",
                Some(&value),
            ));
        }
        if budget == 0 {
            return Err(ApiError::invalid_value(
                "max_tokens must be at least 1, got 0.",
                "max_tokens",
                Some("0"),
            ));
        }
        let asked = self.top_logprobs;
        if asked > MAX_LOGPROBS {
            return Err(ApiError::invalid_value(
                &format!(
                    "Requested sample logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS}"
                ),
                "logprobs",
                Some(&asked.to_string()),
            ));
        }
        Ok(())
    }
}

/// `stream`, `stream_options.include_usage` and `stream_options.continuous_usage_stats`.
struct Streaming {
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
}

/// A pydantic error type and message (the same in every vLLM generation; the wrapping differs).
#[derive(Clone, Copy)]
enum Invalid {
    Missing,
    StringType,
    ListType,
    DictType,
    ModelType,
    IntType,
    IntParsing,
    IntFromFloat,
    FloatType,
    FloatParsing,
    BoolType,
    BoolParsing,
}

impl Invalid {
    fn type_and_message(self) -> (&'static str, &'static str) {
        match self {
            Invalid::Missing => ("missing", "Field required"),
            Invalid::StringType => ("string_type", "Input should be a valid string"),
            Invalid::ListType => ("list_type", "Input should be a valid list"),
            Invalid::DictType => ("dict_type", "Input should be a valid dictionary"),
            Invalid::ModelType => ("model_type", "Input should be a valid dictionary"),
            Invalid::IntType => ("int_type", "Input should be a valid integer"),
            Invalid::IntParsing => (
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
            ),
            Invalid::IntFromFloat => (
                "int_from_float",
                "Input should be a valid integer, got a number with a fractional part",
            ),
            Invalid::FloatType => ("float_type", "Input should be a valid number"),
            Invalid::FloatParsing => (
                "float_parsing",
                "Input should be a valid number, unable to parse string as a number",
            ),
            Invalid::BoolType => ("bool_type", "Input should be a valid boolean"),
            Invalid::BoolParsing => (
                "bool_parsing",
                "Input should be a valid boolean, unable to interpret input",
            ),
        }
    }
}

/// The checks, worded for one vLLM generation.
struct Check {
    shape: ErrorShape,
}

impl Check {
    fn v0_32(&self) -> bool {
        self.shape == ErrorShape::V0_32
    }

    /// A 400 in the style of FastAPI's pydantic validation errors, as vLLM sends them: before
    /// 0.32 a Python list of dicts; in 0.32 a count, the error with its input, type
    /// `"Bad Request"` and `param` naming the location (`body.max_tokens`).
    fn invalid(&self, invalid: Invalid, field: &str, input: Option<&Value>) -> ApiError {
        let (error_type, message) = invalid.type_and_message();
        if !self.v0_32() {
            return ApiError::bad_request(format!(
                "[{{'type': '{error_type}', 'loc': ('body', '{field}'), 'msg': '{message}'}}]"
            ));
        }
        let loc = format!("body.{field}");
        pydantic_0_32(error_type, &loc, message, &python_input(input), None)
    }

    fn object(&self, body: &[u8]) -> Result<Fields, ApiError> {
        let value: Value = match serde_json::from_slice(body) {
            Ok(value) => value,
            Err(error) => return Err(self.json_error(body, &error)),
        };
        match value {
            Value::Object(fields) => Ok(fields),
            other if self.v0_32() => Err(pydantic_0_32(
                "model_attributes_type",
                "body",
                "Input should be a valid dictionary or object to extract fields from",
                &python_input(Some(&other)),
                None,
            )),
            _ => Err(ApiError::bad_request(
                "[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be a valid dictionary or object to extract fields from'}]",
            )),
        }
    }

    /// Malformed JSON. vLLM 0.32 reports Python's `json` error and where it is (a character
    /// offset, as `body.<offset>`); an empty body is a missing one.
    fn json_error(&self, body: &[u8], error: &serde_json::Error) -> ApiError {
        if !self.v0_32() {
            return ApiError::bad_request(format!(
                "[{{'type': 'json_invalid', 'loc': ('body', {}), 'msg': 'JSON decode error', 'ctx': {{'error': '{}'}}}}]",
                error.column(),
                error.to_string().replace('\'', "")
            ));
        }
        let text = String::from_utf8_lossy(body);
        if text.trim().is_empty() {
            let (error_type, message) = Invalid::Missing.type_and_message();
            return pydantic_0_32(error_type, "body", message, "None", None);
        }
        let (offset, python_message) = python_json_error(&text, error);
        let loc = format!("body.{offset}");
        pydantic_0_32(
            "json_invalid",
            &loc,
            "JSON decode error",
            "'<dict of 0 items>'",
            Some(&format!("{{'error': '{python_message}'}}")),
        )
    }

    fn model(&self, fields: &Fields) -> Result<Option<String>, ApiError> {
        match fields.get("model") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(model)) => Ok(Some(model.clone())),
            Some(other) => Err(self.invalid(Invalid::StringType, "model", Some(other))),
        }
    }

    /// Chat: the prompt is the whole message list, roles included.
    fn messages(&self, fields: &Fields) -> Result<(Prompt, usize), ApiError> {
        let messages = match fields.get("messages") {
            None => {
                let body = Value::Object(fields.clone());
                return Err(self.invalid(Invalid::Missing, "messages", Some(&body)));
            }
            Some(Value::Array(messages)) => messages,
            Some(other) => return Err(self.invalid(Invalid::ListType, "messages", Some(other))),
        };
        let mut hasher = Hasher::default();
        let mut size = Size::default();
        for (position, message) in messages.iter().enumerate() {
            size.add(self.message_size(&mut hasher, position, message)?);
        }
        // The chat template renders the tool definitions into the prompt.
        if let Some(tools) = fields.get("tools").filter(|t| !t.is_null()) {
            let json = tools.to_string();
            hasher.bytes(json.as_bytes());
            size.add_text(&json);
        }
        Ok((Prompt::new(&hasher, size.bytes, size.chars), messages.len()))
    }

    /// A message's location in errors: `messages.0.role` for 0.32, `messages.role` before.
    fn message_field(&self, position: usize, field: &str) -> String {
        match (self.v0_32(), field.is_empty()) {
            (true, true) => format!("messages.{position}"),
            (true, false) => format!("messages.{position}.{field}"),
            (false, true) => "messages".to_string(),
            (false, false) => format!("messages.{field}"),
        }
    }

    fn message_size(
        &self,
        hasher: &mut Hasher,
        position: usize,
        message: &Value,
    ) -> Result<Size, ApiError> {
        let Some(fields) = message.as_object() else {
            let field = self.message_field(position, "");
            return Err(self.invalid(Invalid::ModelType, &field, Some(message)));
        };
        let role = match fields.get("role") {
            Some(Value::String(role)) => role.as_str(),
            None => {
                let field = self.message_field(position, "role");
                return Err(self.invalid(Invalid::Missing, &field, Some(message)));
            }
            Some(other) => {
                let field = self.message_field(position, "role");
                return Err(self.invalid(Invalid::StringType, &field, Some(other)));
            }
        };
        hasher.bytes(role.as_bytes());
        hasher.separator();
        let content = fields.get("content").unwrap_or(&Value::Null);
        let mut size = self.content_size(hasher, position, content)?;
        size.bytes += CHAT_TEMPLATE_BYTES;
        size.chars += CHAT_TEMPLATE_BYTES;
        // An assistant's tool calls and a tool result's call id are rendered too.
        for rendered in ["tool_calls", "tool_call_id"] {
            if let Some(value) = fields.get(rendered).filter(|v| !v.is_null()) {
                let json = value.to_string();
                hasher.bytes(json.as_bytes());
                size.add_text(&json);
            }
        }
        hasher.separator();
        Ok(size)
    }

    /// A chat message's content: a string or a list of parts (only text parts count as text).
    fn content_size(
        &self,
        hasher: &mut Hasher,
        position: usize,
        content: &Value,
    ) -> Result<Size, ApiError> {
        let mut size = Size::default();
        match content {
            Value::Null => {}
            Value::String(text) => {
                hasher.bytes(text.as_bytes());
                size.add_text(text);
            }
            Value::Array(parts) => {
                for part in parts {
                    match part.get("text").and_then(Value::as_str) {
                        Some(text) => {
                            hasher.bytes(text.as_bytes());
                            size.add_text(text);
                        }
                        None if part.is_object() => {
                            // Images and other parts: hash their JSON, count a fixed cost.
                            hasher.bytes(part.to_string().as_bytes());
                            size.bytes += NON_TEXT_PART_BYTES;
                        }
                        None => {
                            let field = self.message_field(position, "content");
                            return Err(self.invalid(Invalid::ModelType, &field, Some(part)));
                        }
                    }
                }
            }
            other => {
                let field = self.message_field(position, "content");
                return Err(self.invalid(Invalid::StringType, &field, Some(other)));
            }
        }
        Ok(size)
    }

    /// Completions: a string, a list of strings, token ids, or lists of token ids.
    fn prompt(&self, fields: &Fields) -> Result<Prompt, ApiError> {
        let mut hasher = Hasher::default();
        let mut size = Size::default();
        match fields.get("prompt") {
            None => {
                let body = Value::Object(fields.clone());
                return Err(self.invalid(Invalid::Missing, "prompt", Some(&body)));
            }
            Some(Value::String(text)) => {
                hasher.bytes(text.as_bytes());
                size.add_text(text);
            }
            Some(Value::Array(items)) => {
                for item in items {
                    match item {
                        Value::String(text) => {
                            hasher.bytes(text.as_bytes());
                            size.add_text(text);
                        }
                        Value::Number(token_id) => {
                            hasher.u64(token_id.as_u64().unwrap_or(0));
                            size.bytes += TOKEN_ID_BYTES;
                        }
                        Value::Array(token_ids) => {
                            for token_id in token_ids {
                                hasher.u64(token_id.as_u64().unwrap_or(0));
                            }
                            size.bytes += TOKEN_ID_BYTES * token_ids.len();
                        }
                        other => {
                            return Err(self.invalid(Invalid::StringType, "prompt", Some(other)))
                        }
                    }
                    hasher.separator();
                }
            }
            Some(other) => return Err(self.invalid(Invalid::StringType, "prompt", Some(other))),
        }
        Ok(Prompt::new(&hasher, size.bytes, size.chars))
    }

    /// An integer field. vLLM 0.32 (pydantic's lax mode) takes integer strings, whole floats
    /// and booleans too; a negative value is left to the later checks, except where it
    /// cannot be kept (below 0 there is no budget nor choice count to keep).
    fn int_field(&self, fields: &Fields, field: &str) -> Result<Option<i64>, ApiError> {
        let Some(value) = fields.get(field).filter(|value| !value.is_null()) else {
            return Ok(None);
        };
        if !self.v0_32() {
            return match value.as_u64() {
                Some(number) => Ok(Some(i64::try_from(number).unwrap_or(i64::MAX))),
                None if value.as_i64().is_some() => Err(ApiError::bad_request(format!(
                    "[{{'type': 'greater_than_equal', 'loc': ('body', '{field}'), 'msg': 'Input should be greater than or equal to 0'}}]"
                ))),
                None => Err(self.invalid(Invalid::IntType, field, Some(value))),
            };
        }
        let lax = match value {
            Value::Number(number) => match number.as_i64() {
                Some(whole) => Ok(whole),
                None if number.is_u64() => Ok(i64::MAX),
                // `as` saturates: a huge whole float is as good as i64::MAX here.
                None => match number.as_f64() {
                    Some(float) if float.fract() == 0.0 => Ok(float as i64),
                    _ => Err(Invalid::IntFromFloat),
                },
            },
            Value::String(text) => text.trim().parse::<i64>().map_err(|_| Invalid::IntParsing),
            Value::Bool(flag) => Ok(i64::from(*flag)),
            _ => Err(Invalid::IntType),
        };
        lax.map(Some)
            .map_err(|invalid| self.invalid(invalid, field, Some(value)))
    }

    fn float_field(&self, fields: &Fields, field: &str) -> Result<Option<f64>, ApiError> {
        let Some(value) = fields.get(field).filter(|value| !value.is_null()) else {
            return Ok(None);
        };
        if let Some(number) = value.as_f64() {
            return Ok(Some(number));
        }
        match value {
            Value::String(text) if self.v0_32() => text
                .trim()
                .parse::<f64>()
                .map(Some)
                .map_err(|_| self.invalid(Invalid::FloatParsing, field, Some(value))),
            _ => Err(self.invalid(Invalid::FloatType, field, Some(value))),
        }
    }

    fn bool_field(&self, fields: &Fields, field: &str) -> Result<Option<bool>, ApiError> {
        match fields.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(flag)) => Ok(Some(*flag)),
            Some(other) if self.v0_32() => match other {
                Value::String(text) => match text.to_ascii_lowercase().as_str() {
                    "true" | "yes" | "on" | "1" | "t" | "y" => Ok(Some(true)),
                    "false" | "no" | "off" | "0" | "f" | "n" => Ok(Some(false)),
                    _ => Err(self.invalid(Invalid::BoolParsing, field, Some(other))),
                },
                Value::Number(number) if number.as_u64() == Some(0) => Ok(Some(false)),
                Value::Number(number) if number.as_u64() == Some(1) => Ok(Some(true)),
                _ => Err(self.invalid(Invalid::BoolType, field, Some(other))),
            },
            Some(other) => Err(self.invalid(Invalid::BoolType, field, Some(other))),
        }
    }

    /// A count that must not be negative: before 0.32 the type check says so; in 0.32 the
    /// sampling parameters do, as for `n` and `max_tokens` of 0.
    fn count_field(&self, fields: &Fields, field: &str) -> Result<Option<u32>, ApiError> {
        match self.int_field(fields, field)? {
            None => Ok(None),
            Some(negative) if negative < 0 => Err(match field {
                "n" => ApiError::bad_request(format!("n must be at least 1, got {negative}.")),
                "top_logprobs" | "logprobs" => ApiError::invalid_value(
                    &format!("`{field}` must be a positive value."),
                    field,
                    Some(&negative.to_string()),
                ),
                _ => ApiError::invalid_value(
                    &format!("max_tokens must be at least 1, got {negative}."),
                    "max_tokens",
                    Some(&negative.to_string()),
                ),
            }),
            Some(count) => Ok(Some(u32::try_from(count).unwrap_or(u32::MAX))),
        }
    }

    /// Chat prefers the newer `max_completion_tokens` over `max_tokens`.
    fn max_tokens(&self, kind: Kind, fields: &Fields) -> Result<Option<u32>, ApiError> {
        let max_tokens = match kind {
            Kind::Chat => match self.count_field(fields, "max_completion_tokens")? {
                Some(max_tokens) => Some(max_tokens),
                None => self.count_field(fields, "max_tokens")?,
            },
            Kind::Completion => self.count_field(fields, "max_tokens")?,
        };
        // vLLM 0.32 finds a 0 with the other sampling values, once the prompt is known.
        if max_tokens == Some(0) && !self.v0_32() {
            return Err(ApiError::bad_request(
                "max_tokens must be at least 1, got 0.",
            ));
        }
        Ok(max_tokens)
    }

    fn choice_count(&self, fields: &Fields) -> Result<u32, ApiError> {
        let choice_count = self.count_field(fields, "n")?.unwrap_or(1);
        if self.v0_32() {
            return Ok(choice_count);
        }
        if choice_count == 0 {
            return Err(ApiError::bad_request("n must be at least 1, got 0."));
        }
        if choice_count > MAX_CHOICES {
            return Err(ApiError::bad_request(format!(
                "n must be at most {MAX_CHOICES}, got {choice_count}."
            )));
        }
        Ok(choice_count)
    }

    fn streaming(&self, fields: &Fields) -> Result<Streaming, ApiError> {
        let stream = self.bool_field(fields, "stream")?.unwrap_or(false);
        let mut streaming = Streaming {
            stream,
            include_usage: false,
            continuous_usage: false,
        };
        match fields.get("stream_options") {
            None | Some(Value::Null) => {}
            Some(Value::Object(options)) => {
                if !stream {
                    let message = "Stream options can only be defined when `stream=True`.";
                    return Err(if self.v0_32() {
                        ApiError::invalid_value(message, "stream_options", None)
                    } else {
                        ApiError::bad_request(message)
                    });
                }
                streaming.include_usage =
                    self.bool_field(options, "include_usage")?.unwrap_or(false);
                streaming.continuous_usage = self
                    .bool_field(options, "continuous_usage_stats")?
                    .unwrap_or(false);
            }
            Some(other) => {
                return Err(self.invalid(Invalid::DictType, "stream_options", Some(other)))
            }
        }
        Ok(streaming)
    }

    /// `(logprobs, top_logprobs)`: chat has a flag plus a count, completions only a count.
    fn logprobs(&self, kind: Kind, fields: &Fields) -> Result<(bool, u32), ApiError> {
        let (logprobs, top_logprobs) = match kind {
            Kind::Chat => {
                let logprobs = self.bool_field(fields, "logprobs")?.unwrap_or(false);
                let top_logprobs = self.count_field(fields, "top_logprobs")?.unwrap_or(0);
                if top_logprobs > 0 && !logprobs {
                    let message = "when using `top_logprobs`, `logprobs` must be set to true.";
                    return Err(if self.v0_32() {
                        ApiError::invalid_value(message, "top_logprobs", None)
                    } else {
                        ApiError::bad_request(message)
                    });
                }
                (logprobs, top_logprobs)
            }
            Kind::Completion => match self.count_field(fields, "logprobs")? {
                Some(top_logprobs) => (true, top_logprobs),
                None => (false, 0),
            },
        };
        if top_logprobs > MAX_LOGPROBS && !self.v0_32() {
            return Err(ApiError::bad_request(format!(
                "Requested logprobs of {top_logprobs}, which is greater than max allowed: {MAX_LOGPROBS}"
            )));
        }
        Ok((logprobs, top_logprobs))
    }

    /// The parameters that change the text, and their hash.
    fn sampling(&self, fields: &Fields, default_temperature: f64) -> Result<Sampling, ApiError> {
        let temperature = self
            .float_field(fields, "temperature")?
            .unwrap_or(default_temperature);
        if !(0.0..=2.0).contains(&temperature) && !self.v0_32() {
            return Err(ApiError::bad_request(format!(
                "temperature must be in [0, 2], got {temperature}."
            )));
        }
        let seed = self.int_field(fields, "seed")?;
        let mut hasher = Hasher::default();
        // Greedy decoding ignores the other sampling knobs and the seed.
        if temperature > 0.0 {
            hasher.u64(temperature.to_bits());
            for field in [
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            ] {
                if let Some(value) = fields.get(field).and_then(Value::as_f64) {
                    hasher.bytes(field.as_bytes());
                    hasher.u64(value.to_bits());
                }
            }
            if let Some(seed) = seed {
                hasher.bytes(b"seed");
                hasher.u64(seed as u64);
            }
        }
        Ok(Sampling {
            temperature,
            seed,
            hash: hasher.finish(),
        })
    }

    /// `stop`: a string or a list of strings.
    fn stop(&self, fields: &Fields) -> Result<Vec<String>, ApiError> {
        match fields.get("stop") {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(stop)) => Ok(vec![stop.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Value::String(stop) => Ok(stop.clone()),
                    other => Err(self.invalid(Invalid::StringType, "stop", Some(other))),
                })
                .collect(),
            Some(other) => Err(self.invalid(Invalid::StringType, "stop", Some(other))),
        }
    }
}

/// A rendered prompt's size.
#[derive(Clone, Copy, Default)]
struct Size {
    bytes: usize,
    chars: usize,
}

impl Size {
    fn add(&mut self, other: Size) {
        self.bytes += other.bytes;
        self.chars += other.chars;
    }

    fn add_text(&mut self, text: &str) {
        self.bytes += text.len();
        self.chars += text.chars().count();
    }
}

/// vLLM 0.32's validation error: one pydantic error, its location joined with dots.
fn pydantic_0_32(
    error_type: &str,
    loc: &str,
    message: &str,
    input: &str,
    ctx: Option<&str>,
) -> ApiError {
    let ctx = ctx.map(|ctx| format!(", 'ctx': {ctx}")).unwrap_or_default();
    ApiError {
        status: 400,
        message: format!(
            "1 validation error:\n  {{'type': '{error_type}', 'loc': '{loc}', 'msg': '{message}', 'input': {input}{ctx}}}"
        ),
        err_type: "Bad Request",
        param: Some(loc.to_string()),
    }
}

/// How vLLM 0.32 shows the input of a validation error: Python's repr of scalars, and a
/// summary of containers (`'<dict of 2 items>'`).
fn python_input(value: Option<&Value>) -> String {
    match value {
        None | Some(Value::Null) => "None".into(),
        Some(Value::Bool(true)) => "True".into(),
        Some(Value::Bool(false)) => "False".into(),
        Some(Value::Number(number)) => match number.as_f64() {
            Some(float) if !number.is_i64() && !number.is_u64() => python_float(float),
            _ => number.to_string(),
        },
        Some(Value::String(text)) => python_str(text),
        Some(Value::Array(items)) => python_str(&format!("<list of {} items>", items.len())),
        Some(Value::Object(fields)) => python_str(&format!("<dict of {} items>", fields.len())),
    }
}

/// Python's `repr` of a string: single quotes unless it holds one and no double quote.
fn python_str(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for character in text.chars() {
        match character {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            quoted if quoted == quote => {
                out.push('\\');
                out.push(quoted);
            }
            control if control.is_control() => {
                out.push_str(&format!("\\x{:02x}", u32::from(control)));
            }
            other => out.push(other),
        }
    }
    out.push(quote);
    out
}

/// Python's `repr` of a float (`5.0`, `0.25`).
pub fn python_float(value: f64) -> String {
    if value.is_finite() && value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{value:.1}")
    } else {
        format!("{value:?}")
    }
}

/// Where Python's `json` module would put a syntax error (a character offset) and how it
/// words it, from serde_json's error for the same text.
fn python_json_error(text: &str, error: &serde_json::Error) -> (usize, &'static str) {
    let description = error.to_string();
    let python_message = if description.starts_with("key must be a string")
        || (description.starts_with("EOF while parsing an object")
            && text.trim_end().ends_with('{'))
    {
        "Expecting property name enclosed in double quotes"
    } else if description.starts_with("expected `:`") {
        "Expecting ':' delimiter"
    } else if description.starts_with("expected `,`")
        || description.starts_with("EOF while parsing an object")
        || description.starts_with("EOF while parsing a list")
    {
        "Expecting ',' delimiter"
    } else if description.starts_with("trailing comma") && text.contains('{') {
        "Expecting property name enclosed in double quotes"
    } else if description.starts_with("trailing characters") {
        "Extra data"
    } else if description.starts_with("EOF while parsing a string") {
        "Unterminated string starting at"
    } else if description.starts_with("control character") {
        "Invalid control character at"
    } else if description.starts_with("invalid escape") {
        "Invalid \\\\escape"
    } else {
        "Expecting value"
    };
    let offset = if description.starts_with("EOF while parsing a string") {
        // Python points at the string's opening quote.
        text.rfind('"')
            .map_or(0, |quote| text[..quote].chars().count())
    } else if description.starts_with("EOF while parsing") {
        text.chars().count()
    } else {
        // serde_json counts lines and columns from 1; Python counts characters from 0.
        text.split_inclusive('\n')
            .take(error.line().saturating_sub(1))
            .map(|line| line.chars().count())
            .sum::<usize>()
            + error.column().saturating_sub(1)
    };
    (offset, python_message)
}

/// The hash of a request's words (its messages' text and its prompt; letters and digits,
/// lowercased, one space between words): what a model that answers by meaning alone would
/// see (see `SimConfig::answers_by_words`).
pub fn words_hash(body: &[u8]) -> u64 {
    fn text_of(value: &Value, into: &mut String) {
        match value {
            Value::String(text) => {
                into.push(' ');
                into.push_str(text);
            }
            Value::Array(items) => items.iter().for_each(|item| text_of(item, into)),
            Value::Object(fields) => {
                for key in ["content", "text"] {
                    if let Some(inner) = fields.get(key) {
                        text_of(inner, into);
                    }
                }
            }
            _ => {}
        }
    }
    let mut text = String::new();
    if let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(body) {
        for key in ["messages", "prompt"] {
            if let Some(value) = fields.get(key) {
                text_of(value, &mut text);
            }
        }
    }
    let mut hasher = Hasher::default();
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        hasher.bytes(word.to_lowercase().as_bytes());
        hasher.separator();
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_hash_reads_the_words_alone() {
        let a = words_hash(
            br#"{"messages":[{"role":"user","content":"What is the capital of France?"}]}"#,
        );
        let b = words_hash(br#"{"messages":[{"role":"user","content":[{"type":"text","text":"WHAT  is the capital of france"}]}]}"#);
        let c = words_hash(
            br#"{"messages":[{"role":"user","content":"What is the capital of Spain?"}]}"#,
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(
            words_hash(br#"{"prompt":"Once, upon"}"#),
            words_hash(br#"{"prompt":"once upon"}"#)
        );
    }

    fn chat(body: &[u8], shape: ErrorShape) -> Result<CompletionRequest, ApiError> {
        parse(Kind::Chat, body, 1.0, shape)
    }

    #[test]
    fn parses_chat() {
        let parsed = chat(
            br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2,"temperature":0,"stop":"x"}"#,
            ErrorShape::V0_32,
        )
        .unwrap();
        assert_eq!(parsed.max_tokens, Some(5));
        assert!(parsed.stream && parsed.include_usage && parsed.logprobs);
        assert!(!parsed.continuous_usage);
        assert_eq!(parsed.top_logprobs, 2);
        assert_eq!(parsed.prompt.tokens, 7); // (11 + 16) / 4 rounded up
        assert_eq!(parsed.stop, ["x"]);
        assert_eq!(parsed.messages, 1);
    }

    #[test]
    fn rejects_bad_requests() {
        for shape in [ErrorShape::V0_32, ErrorShape::New, ErrorShape::Old] {
            for body in [
                &b"{not json"[..],
                br#"[1,2]"#,
                br#"{"model":"m"}"#,
                br#"{"messages":"hi"}"#,
                br#"{"messages":[],"n":"two"}"#,
                br#"{"messages":[],"stream_options":{"include_usage":true}}"#,
                br#"{"messages":[],"top_logprobs":3}"#,
                br#"{"messages":[],"stop":3}"#,
            ] {
                let error = chat(body, shape).unwrap_err();
                assert_eq!(error.status, 400, "{}", String::from_utf8_lossy(body));
            }
        }
        let error = chat(br#"{"messages":[],"max_tokens":0}"#, ErrorShape::New).unwrap_err();
        assert_eq!(error.status, 400);
    }

    #[test]
    fn validation_errors_as_vllm_0_32_words_them() {
        let error = chat(br#"{"model": "x", "messages": [}"#, ErrorShape::V0_32).unwrap_err();
        assert_eq!(
            error.message,
            "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.28', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}"
        );
        assert_eq!(
            (error.err_type, error.param.as_deref()),
            ("Bad Request", Some("body.28"))
        );
        let error = parse(
            Kind::Completion,
            br#"{"model": "x", "prompt": "#,
            1.0,
            ErrorShape::V0_32,
        )
        .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("body.25"));
        let error = chat(br#"{"model":"tiny-draft"}"#, ErrorShape::V0_32).unwrap_err();
        assert_eq!(
            error.message,
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 1 items>'}"
        );
        let error = chat(
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"many"}"#,
            ErrorShape::V0_32,
        )
        .unwrap_err();
        assert_eq!(
            error.message,
            "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'many'}"
        );
        let error = chat(b"[1,2]", ErrorShape::V0_32).unwrap_err();
        assert_eq!(
            error.message,
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '<list of 2 items>'}"
        );
        // Lax mode: an integer string is an integer.
        let parsed = chat(br#"{"messages":[],"n":"2"}"#, ErrorShape::V0_32).unwrap();
        assert_eq!(parsed.choice_count, 2);
    }

    #[test]
    fn malformed_json_is_located_as_python_does() {
        // What Python's json.loads says of each.
        for (body, message, offset) in [
            (r#"{"a": 1"#, "Expecting ',' delimiter", 7),
            (r#"{"a" 1}"#, "Expecting ':' delimiter", 5),
            (
                r#"{"a": 1,}"#,
                "Expecting property name enclosed in double quotes",
                8,
            ),
            ("{} x", "Extra data", 3),
            ("{", "Expecting property name enclosed in double quotes", 1),
            (r#"{"a": "x"#, "Unterminated string starting at", 6),
            (r#"{"model": "x", "messages": [}"#, "Expecting value", 28),
        ] {
            let error = serde_json::from_str::<Value>(body).unwrap_err();
            assert_eq!(python_json_error(body, &error), (offset, message), "{body}");
        }
    }

    #[test]
    fn value_checks_of_vllm_0_32() {
        let request = |body: &[u8]| {
            chat(body, ErrorShape::V0_32)
                .unwrap()
                .check_values(16)
                .unwrap_err()
        };
        let error = request(br#"{"messages":[],"temperature":5}"#);
        assert_eq!(
            error.message,
            "temperature must be in [0, 2], got 5.0. (parameter=temperature, value=5.0)"
        );
        assert_eq!(error.param.as_deref(), Some("temperature"));
        let error = request(br#"{"messages":[],"n":0}"#);
        assert_eq!(
            (error.message.as_str(), error.param),
            ("n must be at least 1, got 0.", None)
        );
        let error = request(br#"{"messages":[],"logprobs":true,"top_logprobs":50}"#);
        assert_eq!(
            error.message,
            "Requested sample logprobs of 50, which is greater than max allowed: 20 (parameter=logprobs, value=50)"
        );
        let ok = chat(br#"{"messages":[]}"#, ErrorShape::V0_32).unwrap();
        assert_eq!(
            ok.check_values(0).unwrap_err().message,
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
        );
    }

    #[test]
    fn error_shapes() {
        let error = ApiError::bad_request("x");
        assert_eq!(
            String::from_utf8(error_body(ErrorShape::New, &error)).unwrap(),
            r#"{"error":{"message":"x","type":"BadRequestError","param":null,"code":400}}"#
        );
        assert_eq!(
            String::from_utf8(error_body(ErrorShape::Old, &error)).unwrap(),
            r#"{"object":"error","message":"x","type":"BadRequestError","param":null,"code":400}"#
        );
    }
}
