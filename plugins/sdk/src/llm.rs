//! The LLM request model: the bodies of OpenAI's `/v1/chat/completions` and `/v1/completions`
//! as vLLM accepts them.
//!
//! Sluice parses a body once, into [`LlmRequest`], and keeps the raw bytes beside it in
//! [`LlmCall`]: upstreams always receive the client's bytes untouched (unknown fields included),
//! while plugins read typed fields. Only the fields that change how Sluice treats a request are
//! typed; everything else is validated by vLLM itself.

use crate::pool::{Balancing, Demand};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;

/// The two OpenAI endpoints that go through the LLM pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
}

impl Endpoint {
    /// The endpoint served at `path`, if any. Matches exactly, as vLLM's router does.
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" => Some(Self::Completions),
            _ => None,
        }
    }

    /// The path of the endpoint.
    pub fn path(self) -> &'static str {
        match self {
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }

    /// A short label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat",
            Self::Completions => "completions",
        }
    }
}

/// A parsed LLM request together with the exact bytes the client sent.
#[derive(Debug, Clone)]
pub struct LlmCall {
    /// The endpoint the request came to.
    pub endpoint: Endpoint,
    /// The body as received: forwarded to upstreams unchanged. Cloning is a reference count.
    pub body: Bytes,
    /// The typed fields, parsed from `body`.
    pub request: LlmRequest,
    /// The request's size estimate, computed once at parse for the balancer, the breaker and
    /// the selector (without prefix affinity: see [`LlmCall::demand_for`]).
    pub demand: Demand,
}

/// Why a body is not a valid LLM request: the message, and the parameter it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidRequest {
    /// What is wrong, for the OpenAI error body's `message`.
    pub message: String,
    /// The offending parameter's path (`messages[2].role`), as OpenAI's `param` field.
    pub param: Option<String>,
}

impl LlmCall {
    /// Parses and validates `body` for `endpoint`.
    pub fn parse(endpoint: Endpoint, body: Bytes) -> Result<Self, InvalidRequest> {
        let request = LlmRequest::parse(endpoint, &body)?;
        Ok(Self {
            endpoint,
            body,
            demand: request.demand(None),
            request,
        })
    }

    /// The demand as a pool balancing this way needs it: with the prompt-prefix hash when
    /// the pool uses prefix affinity.
    pub fn demand_for(&self, balancing: &Balancing) -> Demand {
        match balancing {
            Balancing::KvAware {
                prefix_affinity: Some(bytes),
            } => Demand {
                affinity: Some(self.request.prompt_prefix_hash(*bytes)),
                ..self.demand
            },
            _ => self.demand,
        }
    }
}

/// The typed fields of a chat or text completion request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LlmRequest {
    /// `model`: picks the pool; `None` sends the request to the first pool.
    pub model: Option<String>,
    /// Chat completions only.
    pub messages: Option<Vec<Message>>,
    /// Text completions only.
    pub prompt: Option<Prompt>,
    /// `stream`: answer as Server-Sent Events; `None` is `false`.
    pub stream: Option<bool>,
    /// `stream_options` (streams only); `None` asks for no usage chunk.
    pub stream_options: Option<StreamOptions>,
    /// `max_tokens`: the output budget in tokens; `None`: up to the model's context (see
    /// [`LlmRequest::max_output_tokens`]).
    pub max_tokens: Option<u32>,
    /// `max_completion_tokens`, OpenAI's newer name for `max_tokens`, which it overrides when both
    /// are sent; `None`: not sent.
    pub max_completion_tokens: Option<u32>,
    /// `n`: choices to return; `None` is 1 (0 is refused).
    pub n: Option<u32>,
    /// `best_of` (completions, and vLLM's chat): candidates generated, of which the `n` best are
    /// returned; `None` is `n`.
    pub best_of: Option<u32>,
    /// `use_beam_search` (a vLLM extension): beam search instead of sampling; `None` is `false`.
    pub use_beam_search: Option<bool>,
    /// `temperature`, 0 to 2 (checked); `None`: the server's default.
    pub temperature: Option<f64>,
    /// `top_p`, in (0, 1] (checked); `None`: the server's default.
    pub top_p: Option<f64>,
    /// `seed`, for repeatable sampling; `None`: a random seed.
    pub seed: Option<i64>,
    /// `stop`: sequences that end the generation; `None`: none.
    pub stop: Option<Stop>,
    /// `tools` (chat): the tool definitions, kept as JSON; `None`: no tools.
    pub tools: Option<Vec<Value>>,
    /// `tool_choice` (chat), kept as JSON; `None`: the server's default.
    pub tool_choice: Option<Value>,
    /// `response_format` (JSON mode, a JSON schema), kept as JSON; `None`: free text.
    pub response_format: Option<Value>,
    /// Chat: `true`/`false`; completions: the number of top log-probabilities.
    pub logprobs: Option<Logprobs>,
    /// `top_logprobs` (chat): alternatives returned per token with `logprobs: true`; `None`: none.
    pub top_logprobs: Option<u32>,
}

/// The `stream_options` of a streamed request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// `include_usage`: end the stream with a usage chunk; `None` is `false`.
    pub include_usage: Option<bool>,
}

/// One chat message. `content` is text or a list of typed parts (text, images, ...).
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `role`: `system`, `user`, `assistant`, `tool`, ...; not checked here.
    pub role: String,
    /// `content`; `None` for an assistant message that only calls tools.
    pub content: Option<Content>,
    /// `name`: the participant's name, if given.
    pub name: Option<String>,
    /// `tool_calls` of an assistant message, kept as JSON.
    pub tool_calls: Option<Vec<Value>>,
    /// `tool_call_id` of a `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

/// A message's `content`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts (text, images, ...), kept as JSON; only text parts are read.
    Parts(Vec<Value>),
}

/// The `prompt` of a text completion: text, several texts, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One prompt.
    Text(String),
    /// A batch of prompts.
    Texts(Vec<String>),
    /// One prompt, as token ids.
    Tokens(Vec<u32>),
    /// A batch of prompts, as token ids.
    TokenBatches(Vec<Vec<u32>>),
}

/// The `stop` field: one sequence or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// A single stop sequence.
    One(String),
    /// Several stop sequences.
    Many(Vec<String>),
}

/// The `logprobs` field, whose type depends on the endpoint.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// Chat: whether to return the chosen tokens' log-probabilities.
    Flag(bool),
    /// Completions: how many top log-probabilities to return per token.
    Count(u32),
}

/// Characters per token in the prompt-size estimate; BPE tokenizers average about four
/// characters of English per token. An estimate, never used for billing.
const CHARS_PER_TOKEN: usize = 4;
/// Tokens a chat template adds around each message (role markers, separators).
const TOKENS_PER_MESSAGE: usize = 4;

impl LlmRequest {
    /// Parses a body for `endpoint`. Errors name the parameter, as OpenAI's `param` does.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, InvalidRequest> {
        let Ok(text) = std::str::from_utf8(body) else {
            return Err(invalid("The request body is not valid UTF-8.", None));
        };
        // serde would read a struct from an array too, positionally: refuse anything else.
        if body.trim_ascii_start().first().is_some_and(|b| *b != b'{') {
            return Err(invalid("The request body must be a JSON object.", None));
        }
        // From the checked text, so serde does not check each string's UTF-8 again.
        let mut de = serde_json::Deserializer::from_str(text);
        let request: LlmRequest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                invalid(format!("The request body is not valid JSON: {inner}"), None)
            } else if path == "." {
                invalid(
                    format!("The request body must be a JSON object: {inner}"),
                    None,
                )
            } else {
                invalid(format!("Invalid type for '{path}': {inner}"), Some(path))
            }
        })?;
        // Trailing bytes after the object are a malformed body, not something to ignore.
        de.end()
            .map_err(|e| invalid(format!("The request body is not valid JSON: {e}"), None))?;
        request.validate(endpoint)?;
        Ok(request)
    }

    fn validate(&self, endpoint: Endpoint) -> Result<(), InvalidRequest> {
        match endpoint {
            Endpoint::ChatCompletions => match &self.messages {
                None => return Err(missing("messages")),
                Some(m) if m.is_empty() => {
                    return Err(invalid(
                        "'messages' must contain at least one message.",
                        Some("messages".into()),
                    ))
                }
                Some(_) => {}
            },
            Endpoint::Completions => {
                if self.prompt.is_none() {
                    return Err(missing("prompt"));
                }
            }
        }
        if self.n == Some(0) {
            return Err(invalid("'n' must be at least 1.", Some("n".into())));
        }
        if self.max_output_tokens() == Some(0) {
            return Err(invalid(
                "'max_tokens' must be at least 1.",
                Some("max_tokens".into()),
            ));
        }
        if self.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
            return Err(invalid(
                "'temperature' must be between 0 and 2.",
                Some("temperature".into()),
            ));
        }
        if self.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
            return Err(invalid("'top_p' must be in (0, 1].", Some("top_p".into())));
        }
        Ok(())
    }

    /// Whether the client asked for a Server-Sent Events stream.
    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a stream must end with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// The output budget: `max_completion_tokens` wins over the older `max_tokens`.
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// A cheap estimate of the prompt's size in tokens (about four characters per token,
    /// plus the chat template's overhead per message).
    pub fn estimated_prompt_tokens(&self) -> usize {
        if let Some(messages) = &self.messages {
            return messages
                .iter()
                .map(|m| m.text_len().div_ceil(CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE)
                .sum();
        }
        match &self.prompt {
            Some(Prompt::Text(t)) => t.len().div_ceil(CHARS_PER_TOKEN),
            Some(Prompt::Texts(ts)) => ts.iter().map(|t| t.len().div_ceil(CHARS_PER_TOKEN)).sum(),
            Some(Prompt::Tokens(ids)) => ids.len(),
            Some(Prompt::TokenBatches(batches)) => batches.iter().map(Vec::len).sum(),
            None => 0,
        }
    }
}

/// The output budget assumed for a request that states none: vLLM would allow up to the
/// model's context, but most answers are far shorter.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 512;

impl LlmRequest {
    /// What the balancer and the breaker need to know of the request's size; with
    /// `affinity_bytes`, a hash of that many leading bytes of the prompt text.
    pub fn demand(&self, affinity_bytes: Option<usize>) -> Demand {
        Demand {
            prompt_tokens: self.estimated_prompt_tokens() as u64,
            output_tokens: self
                .max_output_tokens()
                .map_or(DEFAULT_OUTPUT_TOKENS, u64::from),
            affinity: affinity_bytes.map(|n| self.prompt_prefix_hash(n)),
        }
    }

    /// FNV-1a over the first `limit` bytes of the prompt's text (messages in order, roles
    /// included): requests that share a system prompt or a conversation's start hash alike.
    pub fn prompt_prefix_hash(&self, limit: usize) -> u64 {
        let mut hash = Fnv1a::default();
        let mut left = limit;
        let mut feed = |bytes: &[u8]| {
            let take = bytes.len().min(left);
            hash.write(bytes.get(..take).unwrap_or_default());
            left -= take;
            left > 0
        };
        if let Some(messages) = &self.messages {
            for m in messages {
                if !feed(m.role.as_bytes()) {
                    break;
                }
                let more = match &m.content {
                    Some(Content::Text(t)) => feed(t.as_bytes()),
                    Some(Content::Parts(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .all(|t| feed(t.as_bytes())),
                    None => true,
                };
                if !more {
                    break;
                }
            }
        } else {
            match &self.prompt {
                Some(Prompt::Text(t)) => {
                    feed(t.as_bytes());
                }
                Some(Prompt::Texts(ts)) => {
                    if let Some(t) = ts.first() {
                        feed(t.as_bytes());
                    }
                }
                Some(Prompt::Tokens(ids)) => {
                    for id in ids {
                        if !feed(&id.to_le_bytes()) {
                            break;
                        }
                    }
                }
                Some(Prompt::TokenBatches(_)) | None => {}
            }
        }
        hash.0
    }
}

/// The 64-bit FNV-1a hash: tiny, and stable across processes and releases (unlike std's
/// `DefaultHasher`), so every proxy of a fleet maps a prefix to the same backend.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

impl Message {
    /// The number of bytes of text in the message (text parts only).
    pub fn text_len(&self) -> usize {
        match &self.content {
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(str::len)
                .sum(),
            None => 0,
        }
    }
}

fn invalid(message: impl Into<String>, param: Option<String>) -> InvalidRequest {
    InvalidRequest {
        message: message.into(),
        param,
    }
}

fn missing(field: &str) -> InvalidRequest {
    invalid(
        format!("Missing required parameter: '{field}'."),
        Some(field.to_string()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<LlmRequest, InvalidRequest> {
        LlmRequest::parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn demand_estimates_size_and_hashes_the_prompt_prefix() {
        let system = "You are a careful assistant. ".repeat(10);
        let a = chat(&format!(
            r#"{{"model":"m","max_tokens":100,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"first question"}}]}}"#
        ))
        .unwrap();
        let b = chat(&format!(
            r#"{{"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"another one"}}],"model":"m"}}"#
        ))
        .unwrap();
        let d = a.demand(Some(64));
        assert_eq!(d.output_tokens, 100);
        assert_eq!(d.prompt_tokens, a.estimated_prompt_tokens() as u64);
        assert_eq!(b.demand(None).output_tokens, DEFAULT_OUTPUT_TOKENS);
        assert_eq!(b.demand(None).affinity, None);
        // Same leading 64 bytes, whatever the key order: same affinity; a longer window sees
        // the different questions.
        assert_eq!(d.affinity, b.demand(Some(64)).affinity);
        assert_ne!(a.prompt_prefix_hash(4096), b.prompt_prefix_hash(4096));
    }

    #[test]
    fn parses_a_chat_request_and_ignores_unknown_fields() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],
               "stream":true,"stream_options":{"include_usage":true},"max_tokens":16,
               "temperature":0,"seed":7,"n":1,"vendor_extension":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.is_stream());
        assert!(r.include_usage());
        assert_eq!(r.max_output_tokens(), Some(16));
        assert_eq!(r.seed, Some(7));
        // "hello there" is 11 bytes: 3 tokens + 4 of template overhead.
        assert_eq!(r.estimated_prompt_tokens(), 7);
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let r = chat(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":9}"#)
            .unwrap();
        assert_eq!(r.max_output_tokens(), Some(9));
    }

    #[test]
    fn content_parts_count_text_only() {
        let r = chat(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"abcd"},{"type":"image_url","image_url":{"url":"data:..."}}]}]}"#)
            .unwrap();
        assert_eq!(r.messages.unwrap()[0].text_len(), 4);
    }

    #[test]
    fn wrong_type_names_the_parameter() {
        let e = chat(r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
        assert!(e.message.contains("stream"), "{}", e.message);
        let e = chat(r#"{"messages":[{"role":3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn rejects_malformed_and_non_object_bodies() {
        assert!(chat("{").unwrap_err().message.contains("not valid JSON"));
        assert!(chat("[1,2]").unwrap_err().message.contains("JSON object"));
        assert!(
            chat(r#"{"messages":[{"role":"user","content":"x"}]} trailing"#)
                .unwrap_err()
                .message
                .contains("not valid JSON")
        );
        let e =
            LlmRequest::parse(Endpoint::ChatCompletions, b"{\"messages\":\"\xff\"}").unwrap_err();
        assert!(e.message.contains("UTF-8"));
    }

    #[test]
    fn requires_messages_or_prompt() {
        assert_eq!(
            chat(r#"{"model":"m"}"#).unwrap_err().param.as_deref(),
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"messages":[]}"#).unwrap_err().param.as_deref(),
            Some("messages")
        );
        let e = LlmRequest::parse(Endpoint::Completions, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let ok = LlmRequest::parse(Endpoint::Completions, br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(ok.estimated_prompt_tokens(), 3);
    }

    #[test]
    fn rejects_out_of_range_parameters() {
        let base = r#"{"messages":[{"role":"user","content":"x"}],"#;
        for (extra, param) in [
            (r#""n":0}"#, "n"),
            (r#""max_tokens":0}"#, "max_tokens"),
            (r#""temperature":3}"#, "temperature"),
            (r#""top_p":0}"#, "top_p"),
        ] {
            let e = chat(&format!("{base}{extra}")).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{extra}");
        }
    }
}
