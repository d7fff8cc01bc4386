//! vLLM's OpenAI wire format: request parsing with vLLM-like 400s, and the response, chunk and
//! error shapes, with field order and null fields as vLLM sends them (see shared/fixtures).

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

/// An error answer: HTTP status, message and vLLM error type.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub err_type: &'static str,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            err_type: error_type(status),
        }
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
        s if (400..500).contains(&s) => "BadRequestError",
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
    param: Option<()>,
    code: u16,
}

#[derive(Serialize)]
struct OldError<'a> {
    object: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    err_type: &'a str,
    param: Option<()>,
    code: u16,
}

/// The JSON error body in the configured shape.
pub fn error_body(shape: ErrorShape, e: &ApiError) -> Vec<u8> {
    let res = match shape {
        ErrorShape::New => serde_json::to_vec(&NewError {
            error: ErrorInner {
                message: &e.message,
                err_type: e.err_type,
                param: None,
                code: e.status,
            },
        }),
        ErrorShape::Old => serde_json::to_vec(&OldError {
            object: "error",
            message: &e.message,
            err_type: e.err_type,
            param: None,
            code: e.status,
        }),
    };
    res.unwrap_or_default()
}

/// An error inside a stream: vLLM writes it with Python's `json.dumps`, hence the spaces.
pub fn stream_error_event(shape: ErrorShape, e: &ApiError) -> String {
    let msg = serde_json::to_string(&e.message).unwrap_or_else(|_| "\"\"".into());
    let inner = match shape {
        ErrorShape::New => format!(
            "{{\"message\": {msg}, \"type\": \"{}\", \"param\": null, \"code\": {}}}",
            e.err_type, e.status
        ),
        ErrorShape::Old => format!(
            "{{\"object\": \"error\", \"message\": {msg}, \"type\": \"{}\", \"param\": null, \"code\": {}}}",
            e.err_type, e.status
        ),
    };
    format!("data: {{\"error\": {inner}}}\n\n")
}

// ---------------------------------------------------------------------------------------
// Requests

#[derive(Clone, Debug)]
pub struct Parsed {
    pub kind: Kind,
    pub model: Option<String>,
    pub prompt_hash: u64,
    pub prompt_tokens: u32,
    pub max_tokens: Option<u32>,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub temperature: f64,
    pub seed: Option<i64>,
    /// Hash of the sampling parameters that change the text (not max_tokens, which only cuts).
    pub sampling_hash: u64,
}

fn pyd(kind: &str, field: &str, msg: &str) -> ApiError {
    ApiError::bad_request(format!(
        "[{{'type': '{kind}', 'loc': ('body', '{field}'), 'msg': '{msg}'}}]"
    ))
}

fn opt_u32(o: &serde_json::Map<String, Value>, field: &str) -> Result<Option<u32>, ApiError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) => Ok(Some(u32::try_from(x).unwrap_or(u32::MAX))),
            None if v.as_i64().is_some() => Err(pyd(
                "greater_than_equal",
                field,
                "Input should be greater than or equal to 0",
            )),
            None => Err(pyd("int_type", field, "Input should be a valid integer")),
        },
    }
}

fn opt_f64(o: &serde_json::Map<String, Value>, field: &str) -> Result<Option<f64>, ApiError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| pyd("float_type", field, "Input should be a valid number")),
    }
}

fn opt_bool(o: &serde_json::Map<String, Value>, field: &str) -> Result<Option<bool>, ApiError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(pyd("bool_type", field, "Input should be a valid boolean")),
    }
}

/// Text of a chat message's content: a string or a list of parts (only text parts count).
fn content_text(h: &mut Hasher, v: &Value) -> Result<usize, ApiError> {
    match v {
        Value::Null => Ok(0),
        Value::String(s) => {
            h.bytes(s.as_bytes());
            Ok(s.len())
        }
        Value::Array(parts) => {
            let mut n = 0;
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => {
                        h.bytes(t.as_bytes());
                        n += t.len();
                    }
                    None if p.is_object() => {
                        // Images and other parts: hash their JSON, count a fixed cost.
                        h.bytes(p.to_string().as_bytes());
                        n += 256;
                    }
                    None => {
                        return Err(pyd(
                            "model_type",
                            "messages",
                            "Input should be a valid dictionary",
                        ))
                    }
                }
            }
            Ok(n)
        }
        _ => Err(pyd(
            "string_type",
            "messages",
            "Input should be a valid string",
        )),
    }
}

pub fn parse(kind: Kind, body: &[u8], default_temperature: f64) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "[{{'type': 'json_invalid', 'loc': ('body', {}), 'msg': 'JSON decode error', 'ctx': {{'error': '{}'}}}}]",
            e.column(),
            e.to_string().replace('\'', "")
        ))
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::bad_request(
            "[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be a valid dictionary or object to extract fields from'}]",
        ));
    };
    let model = match o.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(pyd(
                "string_type",
                "model",
                "Input should be a valid string",
            ))
        }
    };

    let mut h = Hasher::default();
    let bytes = match kind {
        Kind::Chat => {
            let msgs = match o.get("messages") {
                None => return Err(pyd("missing", "messages", "Field required")),
                Some(Value::Array(m)) => m,
                Some(_) => {
                    return Err(pyd("list_type", "messages", "Input should be a valid list"))
                }
            };
            let mut n = 0usize;
            for m in msgs {
                let Some(mo) = m.as_object() else {
                    return Err(pyd(
                        "model_type",
                        "messages",
                        "Input should be a valid dictionary",
                    ));
                };
                let role = match mo.get("role") {
                    Some(Value::String(r)) => r.as_str(),
                    None => return Err(pyd("missing", "messages.role", "Field required")),
                    Some(_) => {
                        return Err(pyd(
                            "string_type",
                            "messages.role",
                            "Input should be a valid string",
                        ))
                    }
                };
                h.bytes(role.as_bytes());
                h.sep();
                n += content_text(&mut h, mo.get("content").unwrap_or(&Value::Null))? + 16;
                h.sep();
            }
            n
        }
        Kind::Completion => match o.get("prompt") {
            None => return Err(pyd("missing", "prompt", "Field required")),
            Some(Value::String(s)) => {
                h.bytes(s.as_bytes());
                s.len()
            }
            Some(Value::Array(items)) => {
                let mut n = 0usize;
                for it in items {
                    match it {
                        Value::String(s) => {
                            h.bytes(s.as_bytes());
                            n += s.len();
                        }
                        // Token ids: one token each.
                        Value::Number(x) => {
                            h.u64(x.as_u64().unwrap_or(0));
                            n += 4;
                        }
                        Value::Array(ids) => {
                            for id in ids {
                                h.u64(id.as_u64().unwrap_or(0));
                            }
                            n += 4 * ids.len();
                        }
                        _ => {
                            return Err(pyd(
                                "string_type",
                                "prompt",
                                "Input should be a valid string",
                            ))
                        }
                    }
                    h.sep();
                }
                n
            }
            Some(_) => {
                return Err(pyd(
                    "string_type",
                    "prompt",
                    "Input should be a valid string",
                ))
            }
        },
    };
    let prompt_tokens = text::tokens_for_bytes(bytes).max(1);

    let max_tokens = match kind {
        Kind::Chat => match opt_u32(&o, "max_completion_tokens")? {
            Some(x) => Some(x),
            None => opt_u32(&o, "max_tokens")?,
        },
        Kind::Completion => opt_u32(&o, "max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1, got 0.",
        ));
    }
    let n = opt_u32(&o, "n")?.unwrap_or(1);
    if n == 0 {
        return Err(ApiError::bad_request("n must be at least 1, got 0."));
    }
    if n > 128 {
        return Err(ApiError::bad_request(format!(
            "n must be at most 128, got {n}."
        )));
    }
    let stream = opt_bool(&o, "stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => {
            if !stream {
                return Err(ApiError::bad_request(
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            opt_bool(so, "include_usage")?.unwrap_or(false)
        }
        Some(_) => {
            return Err(pyd(
                "model_type",
                "stream_options",
                "Input should be a valid dictionary",
            ))
        }
    };
    let (logprobs, top_logprobs) = match kind {
        Kind::Chat => {
            let lp = opt_bool(&o, "logprobs")?.unwrap_or(false);
            let top = opt_u32(&o, "top_logprobs")?;
            if top.unwrap_or(0) > 0 && !lp {
                return Err(ApiError::bad_request(
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                ));
            }
            (lp, top.unwrap_or(0))
        }
        Kind::Completion => match opt_u32(&o, "logprobs")? {
            Some(k) => (true, k),
            None => (false, 0),
        },
    };
    if top_logprobs > 20 {
        return Err(ApiError::bad_request(format!(
            "Requested logprobs of {top_logprobs}, which is greater than max allowed: 20"
        )));
    }
    let temperature = opt_f64(&o, "temperature")?.unwrap_or(default_temperature);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(format!(
            "temperature must be in [0, 2], got {temperature}."
        )));
    }
    let seed = match o.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| pyd("int_type", "seed", "Input should be a valid integer"))?,
        ),
    };

    let mut s = Hasher::default();
    // Greedy decoding ignores the other sampling knobs and the seed.
    if temperature > 0.0 {
        s.u64(temperature.to_bits());
        for f in [
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ] {
            if let Some(x) = o.get(f).and_then(Value::as_f64) {
                s.bytes(f.as_bytes());
                s.u64(x.to_bits());
            }
        }
        if let Some(seed) = seed {
            s.bytes(b"seed");
            s.u64(seed as u64);
        }
    }

    Ok(Parsed {
        kind,
        model,
        prompt_hash: h.finish(),
        prompt_tokens,
        max_tokens,
        n,
        stream,
        include_usage,
        logprobs,
        top_logprobs,
        temperature,
        seed,
        sampling_hash: s.finish(),
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

#[derive(Serialize)]
pub struct ChatCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChatChoice>,
    pub service_tier: Option<()>,
    pub system_fingerprint: Option<()>,
    pub usage: Usage,
    pub prompt_logprobs: Option<()>,
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
    let t = text::token_str(token);
    ChatLogprob {
        token: t,
        logprob,
        bytes: t.as_bytes(),
        top_logprobs: text::top_alternatives(token, logprob, top)
            .into_iter()
            .map(|(a, lp)| {
                let s = text::token_str(a);
                TopLogprob {
                    token: s,
                    logprob: lp,
                    bytes: s.as_bytes(),
                }
            })
            .collect(),
    }
}

#[derive(Serialize)]
pub struct TextCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<TextChoice>,
    pub service_tier: Option<()>,
    pub system_fingerprint: Option<()>,
    pub usage: Usage,
    pub kv_transfer_params: Option<()>,
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
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl TextLogprobs {
    /// Append tokens starting at character `offset` of the generated text.
    pub fn push(&mut self, offset: u32, token: u16, logprob: f32, top: u32) {
        let t = text::token_str(token);
        self.text_offset.push(offset);
        self.token_logprobs.push(logprob);
        self.tokens.push(t);
        // vLLM always returns the sampled token's entry, plus `top` alternatives.
        let alts = text::top_alternatives(token, logprob, top.max(1));
        self.top_logprobs.push(OrderedMap(
            alts.into_iter()
                .map(|(a, lp)| (text::token_str(a), lp))
                .collect(),
        ));
    }
}

#[derive(Serialize)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [ChunkChoice<'a>; 1],
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
pub struct TextChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [TextChunkChoice<'a>; 1],
    pub usage: Option<()>,
}

#[derive(Serialize)]
pub struct TextChunkChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<()>,
}

#[derive(Serialize)]
pub struct UsageChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [(); 0],
    pub usage: StreamUsage,
}

/// `data: <json>\n\n`
pub fn sse<T: Serialize>(v: &T) -> bytes::Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut out, v).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    bytes::Bytes::from(out)
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat() {
        let p = parse(
            Kind::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2,"temperature":0}"#,
            1.0,
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(5));
        assert!(p.stream && p.include_usage && p.logprobs);
        assert_eq!(p.top_logprobs, 2);
        assert_eq!(p.prompt_tokens, 7); // (11 + 16) / 4 rounded up
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
            let e = parse(Kind::Chat, body, 1.0).unwrap_err();
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn error_shapes() {
        let e = ApiError::bad_request("x");
        assert_eq!(
            String::from_utf8(error_body(ErrorShape::New, &e)).unwrap(),
            r#"{"error":{"message":"x","type":"BadRequestError","param":null,"code":400}}"#
        );
        assert_eq!(
            String::from_utf8(error_body(ErrorShape::Old, &e)).unwrap(),
            r#"{"object":"error","message":"x","type":"BadRequestError","param":null,"code":400}"#
        );
    }
}
