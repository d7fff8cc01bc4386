//! vLLM's OpenAI wire format: request parsing with vLLM-like 400s, and the response, chunk and
//! error shapes, with field order and null fields as vLLM sends them (see the repository's
//! `tests/fixtures/`).

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::Value;

use crate::config::ErrorShape;
use crate::text::{self, Hasher};

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
    /// The field at fault, as vLLM 0.32 names it (`input_tokens`, `max_tokens`).
    pub param: Option<&'static str>,
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
    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, message)
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
                param: error.param,
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
    pub max_tokens: Option<u32>,
    /// OpenAI's `n`.
    pub choice_count: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub sampling: Sampling,
}

/// What the answer's text and the KV model need of the prompt.
#[derive(Clone, Copy, Debug)]
pub struct Prompt {
    pub hash: u64,
    pub tokens: u32,
    /// What the tokens were counted from: the rendered prompt's bytes.
    pub bytes: usize,
}

impl Prompt {
    fn new(hasher: &Hasher, bytes: usize) -> Self {
        Prompt {
            hash: hasher.finish(),
            tokens: text::tokens_for_bytes(bytes).max(1),
            bytes,
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

type Fields = serde_json::Map<String, Value>;

/// Parse and validate a request body, in vLLM's order: the first problem found is the one
/// reported, with vLLM's message for it.
pub fn parse(
    kind: Kind,
    body: &[u8],
    default_temperature: f64,
) -> Result<CompletionRequest, ApiError> {
    let fields = parse_object(body)?;
    let model = parse_model(&fields)?;
    let prompt = match kind {
        Kind::Chat => parse_messages(&fields)?,
        Kind::Completion => parse_prompt(&fields)?,
    };
    let max_tokens = parse_max_tokens(kind, &fields)?;
    let choice_count = parse_choice_count(&fields)?;
    let (stream, include_usage) = parse_streaming(&fields)?;
    let (logprobs, top_logprobs) = parse_logprobs(kind, &fields)?;
    let sampling = parse_sampling(&fields, default_temperature)?;
    Ok(CompletionRequest {
        kind,
        model,
        prompt,
        max_tokens,
        choice_count,
        stream,
        include_usage,
        logprobs,
        top_logprobs,
        sampling,
    })
}

/// A 400 in the style of FastAPI's pydantic validation errors, as vLLM sends them.
fn validation_error(error_type: &str, field: &str, message: &str) -> ApiError {
    ApiError::bad_request(format!(
        "[{{'type': '{error_type}', 'loc': ('body', '{field}'), 'msg': '{message}'}}]"
    ))
}

fn parse_object(body: &[u8]) -> Result<Fields, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|error| {
        ApiError::bad_request(format!(
            "[{{'type': 'json_invalid', 'loc': ('body', {}), 'msg': 'JSON decode error', 'ctx': {{'error': '{}'}}}}]",
            error.column(),
            error.to_string().replace('\'', "")
        ))
    })?;
    match value {
        Value::Object(fields) => Ok(fields),
        _ => Err(ApiError::bad_request(
            "[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be a valid dictionary or object to extract fields from'}]",
        )),
    }
}

fn parse_model(fields: &Fields) -> Result<Option<String>, ApiError> {
    match fields.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(model)) => Ok(Some(model.clone())),
        Some(_) => Err(validation_error(
            "string_type",
            "model",
            "Input should be a valid string",
        )),
    }
}

/// Chat: the prompt is the whole message list, roles included.
fn parse_messages(fields: &Fields) -> Result<Prompt, ApiError> {
    let messages = match fields.get("messages") {
        None => return Err(validation_error("missing", "messages", "Field required")),
        Some(Value::Array(messages)) => messages,
        Some(_) => {
            return Err(validation_error(
                "list_type",
                "messages",
                "Input should be a valid list",
            ))
        }
    };
    let mut hasher = Hasher::default();
    let mut bytes = 0usize;
    for message in messages {
        bytes += message_bytes(&mut hasher, message)?;
    }
    // The chat template renders the tool definitions into the prompt.
    if let Some(tools) = fields.get("tools").filter(|t| !t.is_null()) {
        let json = tools.to_string();
        hasher.bytes(json.as_bytes());
        bytes += json.len();
    }
    Ok(Prompt::new(&hasher, bytes))
}

fn message_bytes(hasher: &mut Hasher, message: &Value) -> Result<usize, ApiError> {
    let Some(message) = message.as_object() else {
        return Err(validation_error(
            "model_type",
            "messages",
            "Input should be a valid dictionary",
        ));
    };
    let role = match message.get("role") {
        Some(Value::String(role)) => role.as_str(),
        None => {
            return Err(validation_error(
                "missing",
                "messages.role",
                "Field required",
            ))
        }
        Some(_) => {
            return Err(validation_error(
                "string_type",
                "messages.role",
                "Input should be a valid string",
            ))
        }
    };
    hasher.bytes(role.as_bytes());
    hasher.separator();
    let content = message.get("content").unwrap_or(&Value::Null);
    let mut bytes = content_bytes(hasher, content)? + CHAT_TEMPLATE_BYTES;
    // An assistant's tool calls and a tool result's call id are rendered too.
    for rendered in ["tool_calls", "tool_call_id"] {
        if let Some(value) = message.get(rendered).filter(|v| !v.is_null()) {
            let json = value.to_string();
            hasher.bytes(json.as_bytes());
            bytes += json.len();
        }
    }
    hasher.separator();
    Ok(bytes)
}

/// A chat message's content: a string or a list of parts (only text parts count as text).
fn content_bytes(hasher: &mut Hasher, content: &Value) -> Result<usize, ApiError> {
    match content {
        Value::Null => Ok(0),
        Value::String(text) => {
            hasher.bytes(text.as_bytes());
            Ok(text.len())
        }
        Value::Array(parts) => {
            let mut bytes = 0;
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(text) => {
                        hasher.bytes(text.as_bytes());
                        bytes += text.len();
                    }
                    None if part.is_object() => {
                        // Images and other parts: hash their JSON, count a fixed cost.
                        hasher.bytes(part.to_string().as_bytes());
                        bytes += NON_TEXT_PART_BYTES;
                    }
                    None => {
                        return Err(validation_error(
                            "model_type",
                            "messages",
                            "Input should be a valid dictionary",
                        ))
                    }
                }
            }
            Ok(bytes)
        }
        _ => Err(validation_error(
            "string_type",
            "messages",
            "Input should be a valid string",
        )),
    }
}

/// Completions: a string, a list of strings, token ids, or lists of token ids.
fn parse_prompt(fields: &Fields) -> Result<Prompt, ApiError> {
    let not_a_string =
        || validation_error("string_type", "prompt", "Input should be a valid string");
    let mut hasher = Hasher::default();
    let bytes = match fields.get("prompt") {
        None => return Err(validation_error("missing", "prompt", "Field required")),
        Some(Value::String(text)) => {
            hasher.bytes(text.as_bytes());
            text.len()
        }
        Some(Value::Array(items)) => {
            let mut bytes = 0usize;
            for item in items {
                bytes += match item {
                    Value::String(text) => {
                        hasher.bytes(text.as_bytes());
                        text.len()
                    }
                    Value::Number(token_id) => {
                        hasher.u64(token_id.as_u64().unwrap_or(0));
                        TOKEN_ID_BYTES
                    }
                    Value::Array(token_ids) => {
                        for token_id in token_ids {
                            hasher.u64(token_id.as_u64().unwrap_or(0));
                        }
                        TOKEN_ID_BYTES * token_ids.len()
                    }
                    _ => return Err(not_a_string()),
                };
                hasher.separator();
            }
            bytes
        }
        Some(_) => return Err(not_a_string()),
    };
    Ok(Prompt::new(&hasher, bytes))
}

fn optional_u32(fields: &Fields, field: &str) -> Result<Option<u32>, ApiError> {
    match fields.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => match value.as_u64() {
            Some(number) => Ok(Some(u32::try_from(number).unwrap_or(u32::MAX))),
            None if value.as_i64().is_some() => Err(validation_error(
                "greater_than_equal",
                field,
                "Input should be greater than or equal to 0",
            )),
            None => Err(validation_error(
                "int_type",
                field,
                "Input should be a valid integer",
            )),
        },
    }
}

fn optional_f64(fields: &Fields, field: &str) -> Result<Option<f64>, ApiError> {
    match fields.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_f64()
            .map(Some)
            .ok_or_else(|| validation_error("float_type", field, "Input should be a valid number")),
    }
}

fn optional_bool(fields: &Fields, field: &str) -> Result<Option<bool>, ApiError> {
    match fields.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(flag)) => Ok(Some(*flag)),
        Some(_) => Err(validation_error(
            "bool_type",
            field,
            "Input should be a valid boolean",
        )),
    }
}

/// Chat prefers the newer `max_completion_tokens` over `max_tokens`.
fn parse_max_tokens(kind: Kind, fields: &Fields) -> Result<Option<u32>, ApiError> {
    let max_tokens = match kind {
        Kind::Chat => match optional_u32(fields, "max_completion_tokens")? {
            Some(max_tokens) => Some(max_tokens),
            None => optional_u32(fields, "max_tokens")?,
        },
        Kind::Completion => optional_u32(fields, "max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1, got 0.",
        ));
    }
    Ok(max_tokens)
}

fn parse_choice_count(fields: &Fields) -> Result<u32, ApiError> {
    let choice_count = optional_u32(fields, "n")?.unwrap_or(1);
    if choice_count == 0 {
        return Err(ApiError::bad_request("n must be at least 1, got 0."));
    }
    if choice_count > 128 {
        return Err(ApiError::bad_request(format!(
            "n must be at most 128, got {choice_count}."
        )));
    }
    Ok(choice_count)
}

/// `(stream, stream_options.include_usage)`.
fn parse_streaming(fields: &Fields) -> Result<(bool, bool), ApiError> {
    let stream = optional_bool(fields, "stream")?.unwrap_or(false);
    let include_usage = match fields.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(options)) => {
            if !stream {
                return Err(ApiError::bad_request(
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            optional_bool(options, "include_usage")?.unwrap_or(false)
        }
        Some(_) => {
            return Err(validation_error(
                "model_type",
                "stream_options",
                "Input should be a valid dictionary",
            ))
        }
    };
    Ok((stream, include_usage))
}

/// `(logprobs, top_logprobs)`: chat has a flag plus a count, completions only a count.
fn parse_logprobs(kind: Kind, fields: &Fields) -> Result<(bool, u32), ApiError> {
    let (logprobs, top_logprobs) = match kind {
        Kind::Chat => {
            let logprobs = optional_bool(fields, "logprobs")?.unwrap_or(false);
            let top_logprobs = optional_u32(fields, "top_logprobs")?.unwrap_or(0);
            if top_logprobs > 0 && !logprobs {
                return Err(ApiError::bad_request(
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                ));
            }
            (logprobs, top_logprobs)
        }
        Kind::Completion => match optional_u32(fields, "logprobs")? {
            Some(top_logprobs) => (true, top_logprobs),
            None => (false, 0),
        },
    };
    if top_logprobs > 20 {
        return Err(ApiError::bad_request(format!(
            "Requested logprobs of {top_logprobs}, which is greater than max allowed: 20"
        )));
    }
    Ok((logprobs, top_logprobs))
}

/// The parameters that change the text, and their hash.
fn parse_sampling(fields: &Fields, default_temperature: f64) -> Result<Sampling, ApiError> {
    let temperature = optional_f64(fields, "temperature")?.unwrap_or(default_temperature);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(format!(
            "temperature must be in [0, 2], got {temperature}."
        )));
    }
    let seed = match fields.get("seed") {
        None | Some(Value::Null) => None,
        Some(value) => Some(value.as_i64().ok_or_else(|| {
            validation_error("int_type", "seed", "Input should be a valid integer")
        })?),
    };
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

// ---------------------------------------------------------------------------------------
// Responses

#[derive(Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
    pub completion_tokens: u32,
    pub prompt_tokens_details: Option<()>,
}

#[derive(Serialize)]
pub struct StreamUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
    pub completion_tokens: u32,
}

/// A non-stream answer; `Choice` is [`ChatChoice`] or [`TextChoice`].
#[derive(Serialize)]
pub struct Completion<'a, Choice> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<Choice>,
    pub service_tier: Option<()>,
    pub system_fingerprint: Option<()>,
    pub usage: Usage,
    /// Chat answers carry `"prompt_logprobs":null` here; text answers carry it per choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Option<()>>,
    pub kv_transfer_params: Option<()>,
}

#[derive(Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: Option<()>,
}

#[derive(Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    pub content: String,
    pub refusal: Option<()>,
    pub annotations: Option<()>,
    pub audio: Option<()>,
    pub function_call: Option<()>,
    pub tool_calls: [(); 0],
    pub reasoning_content: Option<()>,
}

impl ChatMessage {
    pub fn assistant(content: String) -> Self {
        ChatMessage {
            role: "assistant",
            content,
            refusal: None,
            annotations: None,
            audio: None,
            function_call: None,
            tool_calls: [],
            reasoning_content: None,
        }
    }
}

#[derive(Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprob>,
}

#[derive(Serialize)]
pub struct ChatLogprob {
    pub token: &'static str,
    pub logprob: f32,
    pub bytes: &'static [u8],
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Serialize)]
pub struct TopLogprob {
    pub token: &'static str,
    pub logprob: f32,
    pub bytes: &'static [u8],
}

pub fn chat_logprob(token: u16, logprob: f32, top: u32) -> ChatLogprob {
    let text = text::token_str(token);
    ChatLogprob {
        token: text,
        logprob,
        bytes: text.as_bytes(),
        top_logprobs: text::top_alternatives(token, logprob, top)
            .into_iter()
            .map(|(alternative, logprob)| {
                let text = text::token_str(alternative);
                TopLogprob {
                    token: text,
                    logprob,
                    bytes: text.as_bytes(),
                }
            })
            .collect(),
    }
}

#[derive(Serialize)]
pub struct TextChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: Option<()>,
    pub prompt_logprobs: Option<()>,
}

/// Completions-API logprobs: parallel arrays.
#[derive(Serialize, Default)]
pub struct TextLogprobs {
    pub text_offset: Vec<u32>,
    pub token_logprobs: Vec<f32>,
    pub tokens: Vec<&'static str>,
    pub top_logprobs: Vec<OrderedMap>,
}

/// A JSON object whose keys keep the given order (the sampled token first, like vLLM's dict).
pub struct OrderedMap(pub Vec<(&'static str, f32)>);

impl Serialize for OrderedMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

impl TextLogprobs {
    /// Append a token starting at character `offset` of the generated text.
    pub fn push(&mut self, offset: u32, token: u16, logprob: f32, top: u32) {
        let text = text::token_str(token);
        self.text_offset.push(offset);
        self.token_logprobs.push(logprob);
        self.tokens.push(text);
        // vLLM always returns the sampled token's entry, plus `top` alternatives.
        let alternatives = text::top_alternatives(token, logprob, top.max(1));
        self.top_logprobs.push(OrderedMap(
            alternatives
                .into_iter()
                .map(|(alternative, logprob)| (text::token_str(alternative), logprob))
                .collect(),
        ));
    }
}

/// One SSE event of a stream; `Choices` is one [`ChunkChoice`] (chat), one
/// [`TextChunkChoice`] (completions), or none (the usage chunk).
#[derive(Serialize)]
pub struct Chunk<'a, Choices> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Choices,
    /// Absent from chat chunks, `null` on text chunks, the counts on the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<StreamUsage>>,
}

#[derive(Serialize)]
pub struct ChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// Only the finish chunk carries `"stop_reason":null` (vLLM dumps with exclude_unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<()>>,
}

#[derive(Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    pub content: &'a str,
}

#[derive(Serialize)]
pub struct TextChunkChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<()>,
}

/// `data: <json>\n\n`
pub fn sse<T: Serialize>(value: &T) -> bytes::Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut out, value).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    bytes::Bytes::from(out)
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// `GET /v1/models`: one card per served name.
#[derive(Serialize)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<ModelCard<'a>>,
}

#[derive(Serialize)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    pub parent: Option<()>,
    pub max_model_len: u32,
    pub permission: [ModelPermission; 1],
}

#[derive(Serialize)]
pub struct ModelPermission {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub allow_create_engine: bool,
    pub allow_sampling: bool,
    pub allow_logprobs: bool,
    pub allow_search_indices: bool,
    pub allow_view: bool,
    pub allow_fine_tuning: bool,
    pub organization: &'static str,
    pub group: Option<()>,
    pub is_blocking: bool,
}

impl ModelPermission {
    /// vLLM's fixed permission card.
    pub fn vllm(id: String, created: u64) -> Self {
        ModelPermission {
            id,
            object: "model_permission",
            created,
            allow_create_engine: false,
            allow_sampling: true,
            allow_logprobs: true,
            allow_search_indices: false,
            allow_view: true,
            allow_fine_tuning: false,
            organization: "*",
            group: None,
            is_blocking: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat() {
        let parsed = parse(
            Kind::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2,"temperature":0}"#,
            1.0,
        )
        .unwrap();
        assert_eq!(parsed.max_tokens, Some(5));
        assert!(parsed.stream && parsed.include_usage && parsed.logprobs);
        assert_eq!(parsed.top_logprobs, 2);
        assert_eq!(parsed.prompt.tokens, 7); // (11 + 16) / 4 rounded up
    }

    #[test]
    fn rejects_bad_requests() {
        for body in [
            &b"{not json"[..],
            br#"[1,2]"#,
            br#"{"model":"m"}"#,
            br#"{"messages":"hi"}"#,
            br#"{"messages":[],"n":"two"}"#,
            br#"{"messages":[],"max_tokens":0}"#,
            br#"{"messages":[],"stream_options":{"include_usage":true}}"#,
            br#"{"messages":[],"top_logprobs":3}"#,
        ] {
            let error = parse(Kind::Chat, body, 1.0).unwrap_err();
            assert_eq!(error.status, 400, "{}", String::from_utf8_lossy(body));
        }
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
