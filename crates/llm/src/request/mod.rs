//! The LLM request model: the bodies of the LLM routes as vLLM accepts them (OpenAI's chat and
//! text completions and Responses, Anthropic's Messages, and the routes that only need their
//! `model` read: tokenize, embeddings, rerank, ...). One model serves them all: a Messages
//! request's `messages` are chat messages, its `system` a content; a Responses request's
//! `input` a prompt of items; each family's parse checks what is its own.
//!
//! Sluice parses a body once, into [`LlmRequest`], and keeps the raw bytes beside it in
//! [`LlmCall`]: upstreams always receive the client's bytes untouched (unknown fields included),
//! while plugins read typed fields. Only the fields that change how Sluice treats a request are
//! typed; everything else is validated by vLLM itself.
//!
//! A body can be megabytes, so the parse builds no tree and copies no text: a prompt, a
//! message's content, the tools are kept as slices of the body (a reference count, see
//! [`Text`], [`Messages`], [`Tokens`], [`RawJson`]), with what Sluice needs of them counted
//! as they are checked (lengths, token estimates). Their items are read again from those
//! bytes when a plugin asks, one at a time. A request costs its body and a few hundred bytes,
//! whatever its shape: an 8 MiB `"prompt": [1, 1, ...]` is counted, not collected.

//!
//! The parts: `text.rs` holds the building blocks any family reads its members into (slices
//! of the body: [`Text`], [`Messages`], [`JsonArray`], [`Tokens`], ...), `read.rs` the
//! reader of a request's members by its family's member table ([`Member`]; each shipped
//! family's is in its module),
//! `demand.rs` the size estimate the balancer, the breaker and the selector read.

mod demand;
mod read;
use read::RequestSeed;
pub use read::{member, Member, Slot, OPENAI_MEMBERS};
mod text;

pub use demand::{Demand, COMPLETIONS_DEFAULT_MAX_TOKENS, DEFAULT_OUTPUT_TOKENS};
pub use text::{
    Content, JsonArray, Logprobs, Message, Messages, Parts, Prompt, RawJson, Stop, Text, Texts,
    TokenBatches, Tokens,
};

use crate::family::RouteMatch;
use crate::raw_json;
use bytes::Bytes;
use serde::de::DeserializeSeed;
use serde::Deserialize;

pub use crate::family::Endpoint;

/// The top-level members whose place in the body the parse notes ([`LlmRequest::seen`]):
/// those an upstream body's edit may change ([`crate::model_name::EDITED_MEMBERS`]), those
/// a chat template reads besides `messages` and `tools`, for a pool that tokenizes prompts
/// as its engines do, and those a client may name its session in ([`SESSION_MEMBERS`]).
pub const PLACED_MEMBERS: [&str; 14] = concat(
    concat::<_, 7, 3, 10>(crate::model_name::EDITED_MEMBERS, TEMPLATE_MEMBERS),
    SESSION_MEMBERS,
);

/// The top-level members a session may be named in (a pool's `session_keys`): OpenAI's
/// `prompt_cache_key` (Codex; opencode's camel-case spelling through some SDKs), LiteLLM's
/// `litellm_session_id`, and `metadata`, whose members Anthropic's `user_id`, Qwen Code's
/// `sessionId` and LiteLLM's `session_id` are.
pub const SESSION_MEMBERS: [&str; 4] = [
    "prompt_cache_key",
    "promptCacheKey",
    "litellm_session_id",
    "metadata",
];

/// The members a chat template reads besides `messages` and `tools`.
pub const TEMPLATE_MEMBERS: [&str; 3] = [
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
];

/// `a` then `b` (a member table from shared rows and a family's own); a wrong length `C`
/// fails the build.
pub const fn concat<T: Copy, const A: usize, const B: usize, const C: usize>(
    a: [T; A],
    b: [T; B],
) -> [T; C] {
    assert!(A + B == C && C > 0, "C must be A + B");
    let mut out = [if A > 0 { a[0] } else { b[0] }; C];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < A + B {
        out[i] = b[i - A];
        i += 1;
    }
    out
}

/// A parsed LLM request together with the exact bytes the client sent.
#[derive(Debug, Clone)]
pub struct LlmCall {
    /// The endpoint the request came to.
    pub endpoint: Endpoint,
    /// What its path said (the model and stream flag, for a family that puts them there).
    pub route: RouteMatch,
    /// The body as received: forwarded to upstreams unchanged. Cloning is a reference count.
    pub body: Bytes,
    /// The typed fields, parsed from `body`.
    pub request: LlmRequest,
    /// The request's size estimate, computed once at parse for the balancer, the breaker and
    /// the selector (without prefix affinity: see [`LlmCall::demand_with_prefix`]).
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
    /// Parses and validates `body` for `endpoint`, as its family reads it, for a family
    /// served at one fixed path (whose path says nothing more).
    pub fn parse(endpoint: Endpoint, body: Bytes) -> Result<Self, InvalidRequest> {
        Self::parse_routed(endpoint, RouteMatch::default(), body)
    }

    /// Parses and validates `body` for `endpoint`, as its family reads it with what the
    /// path said (`route`).
    pub fn parse_routed(
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<Self, InvalidRequest> {
        endpoint.family().parse(endpoint, route, body)
    }

    /// A family's parse by its member table (`members`, see [`LlmRequest::read`]; the
    /// checks are the family's): the request model, and the demand with the family's output
    /// default (`default_max_tokens`) for a request that sets no limit.
    pub fn read_request(
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
        members: &'static [Member],
        default_max_tokens: Option<u32>,
    ) -> Result<Self, InvalidRequest> {
        let request = LlmRequest::read(&body, members)?;
        Ok(Self::from_parts(
            endpoint,
            route,
            body,
            request,
            default_max_tokens,
        ))
    }

    /// A call from a request a family read itself: the demand estimated, with the family's
    /// output default (`default_max_tokens`) for a request that sets no limit.
    pub fn from_parts(
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
        request: LlmRequest,
        default_max_tokens: Option<u32>,
    ) -> Self {
        let mut demand = request.demand(None);
        if let (Some(default), None) = (default_max_tokens, request.max_tokens) {
            // The engine's own default: an answer of at most that many tokens, not the
            // context.
            demand.output_tokens = u64::from(default);
        }
        Self {
            endpoint,
            route,
            body,
            demand,
            request,
        }
    }

    /// The same request with an output budget of at most `ceiling` tokens per sequence, as if
    /// the client had asked so: `max_completion_tokens` (when the client used it, since it
    /// wins) or `max_tokens` set to `ceiling` in the body, every other byte kept, and the
    /// request parsed again. `None` when the budget is within `ceiling` already. A chat
    /// request without a budget gets `ceiling`: vLLM would otherwise generate to the
    /// context's end; a text completion without one keeps vLLM's default of 16 when that is
    /// within `ceiling` (setting the ceiling raised it, and the tenant's bill with it).
    pub fn capped(&self, ceiling: u32) -> Option<Result<LlmCall, InvalidRequest>> {
        let budget = self
            .request
            .max_output_tokens()
            .or_else(|| self.endpoint.family().default_max_tokens());
        if budget.is_some_and(|asked| asked <= ceiling) {
            return None;
        }
        let spliced = (self.endpoint.family()).with_budget(&self.request, &self.body, ceiling);
        Some(match spliced {
            Some(body) => {
                LlmCall::parse_routed(self.endpoint, self.route.clone(), Bytes::from(body))
            }
            None => Err(InvalidRequest {
                message: "The request body is not a JSON object.".into(),
                param: None,
            }),
        })
    }

    /// Where the members of [`PLACED_MEMBERS`] are in the body: from what the parse saw, or
    /// (when a key was escaped, so not placed) from reading the body again. `None` for a
    /// request not made by [`LlmCall::parse`] whose body is not one JSON object.
    pub fn placed_members(&self) -> Option<raw_json::ObjectSpans<'static>> {
        raw_json::ObjectSpans::from_seen(&self.body, &self.request.seen)
            .or_else(|| raw_json::object_spans(&self.body, &PLACED_MEMBERS))
    }

    /// The JSON text of top-level member `key` of the body, when present: where the parse
    /// placed it (one value read, not every placed member), else from reading the body again.
    pub fn member(&self, key: &str) -> Option<&[u8]> {
        let range = match self.request.seen.value_of(&self.body, key) {
            Some(range) => range?,
            None => raw_json::object_spans(&self.body, &[key])?.value(key)?,
        };
        self.body.get(range)
    }

    /// The demand with a hash of the prompt's first `affinity_bytes` bytes, for a pool that
    /// balances by prefix affinity (`None`: the demand as parsed).
    pub fn demand_with_prefix(&self, affinity_bytes: Option<usize>) -> Demand {
        match affinity_bytes {
            Some(bytes) => Demand {
                affinity: Some(self.request.prompt_prefix_hash(bytes)),
                ..self.demand
            },
            None => self.demand,
        }
    }
}

/// The typed fields of a chat or text completion request.
#[derive(Debug, Clone, Default)]
pub struct LlmRequest {
    /// `model`: picks the pool; `None` sends the request to the first pool.
    pub model: Option<String>,
    /// Chat completions only.
    pub messages: Option<Messages>,
    /// Text completions only.
    pub prompt: Option<Prompt>,
    /// `stream`: answer as Server-Sent Events; `None` is `false`.
    pub stream: Option<bool>,
    /// `stream_options` (streams only); `None` asks for no usage chunk.
    pub stream_options: Option<StreamOptions>,
    /// `max_tokens` (Responses: `max_output_tokens`): the output budget in tokens; `None`: up
    /// to the model's context (see [`LlmRequest::max_output_tokens`]).
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
    pub tools: Option<JsonArray>,
    /// `tool_choice` (chat), kept as JSON; `None`: the server's default.
    pub tool_choice: Option<RawJson>,
    /// `response_format` (JSON mode, a JSON schema), kept as JSON; `None`: free text.
    pub response_format: Option<RawJson>,
    /// Chat: `true`/`false`; completions: the number of top log-probabilities.
    pub logprobs: Option<Logprobs>,
    /// `top_logprobs` (chat): alternatives returned per token with `logprobs: true`; `None`: none.
    pub top_logprobs: Option<u32>,
    /// Messages: `system`, the system prompt (a text or text blocks); `None`: none.
    pub system: Option<Content>,
    /// Responses: `input`, a text or a list of input items; embeddings: `input`, what to embed.
    pub input: Option<Input>,
    /// Responses: `instructions`, the system prompt; `None`: none.
    pub instructions: Option<Text>,
    /// Responses: `previous_response_id`, the stored response this one continues.
    pub previous_response_id: Option<String>,
    /// Responses: `store`; `None` is `true` (the engine keeps the response for follow-ups).
    pub store: Option<bool>,
    /// Responses: `background`, a generation the engine runs detached from the request.
    pub background: Option<bool>,
    /// Where the members read again later are ([`PLACED_MEMBERS`]), as the parse saw them:
    /// an upstream body's edit, or a chat template, then reads only those, not the body
    /// again. Valid only for the body this request was parsed
    /// from: an `LlmCall` made other than by [`LlmCall::parse`] must leave it default.
    pub seen: raw_json::SeenMembers,
}

/// A Responses request's (or an embeddings request's) `input`: a text, or a list of items
/// (messages, tool calls and their outputs; texts or token ids to embed), kept as JSON.
#[derive(Debug, Clone)]
pub enum Input {
    /// A text: one user message.
    Text(Text),
    /// A list of items, with the estimate of their tokens (their JSON's length).
    Items {
        /// The list, as JSON.
        items: JsonArray,
        /// About four characters a token, and a message's overhead per item.
        estimated_tokens: usize,
    },
}

/// The `stream_options` of a streamed request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// `include_usage`: end the stream with a usage chunk; `None` is `false`.
    pub include_usage: Option<bool>,
}

/// Characters per token in the prompt-size estimate; BPE tokenizers average about four
/// characters of English per token. An estimate, never used for billing.
const CHARS_PER_TOKEN: usize = 4;
/// Tokens a chat template adds around each message (role markers, separators).
const TOKENS_PER_MESSAGE: usize = 4;
/// The most choices (`n`, `best_of`) one request may ask for, as OpenAI's API allows.
pub const MAX_CHOICES: u32 = 128;

impl LlmRequest {
    /// Parses a body for `endpoint` as its family does (with an empty route). Errors name
    /// the parameter, as OpenAI's `param` does.
    #[cfg(test)]
    pub(crate) fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, InvalidRequest> {
        LlmCall::parse(endpoint, Bytes::copy_from_slice(body)).map(|call| call.request)
    }

    /// Reads a body's members by a family's member table (`members`), keeping slices of
    /// `body` (reference counts) for its texts, messages, prompts and other JSON. Checks only the
    /// members' types: each family checks what it requires ([`LlmRequest::require`],
    /// [`LlmRequest::check_sampling`]). Errors name the parameter, as OpenAI's `param` does.
    pub fn read(body: &Bytes, members: &'static [Member]) -> Result<Self, InvalidRequest> {
        let Ok(text) = std::str::from_utf8(body) else {
            return Err(invalid("The request body is not valid UTF-8.", None));
        };
        // serde would read a struct from an array too, positionally: refuse anything else.
        if body.trim_ascii_start().first().is_some_and(|b| *b != b'{') {
            return Err(invalid("The request body must be a JSON object.", None));
        }
        // From the checked text, so serde does not check each string's UTF-8 again.
        let mut de = serde_json::Deserializer::from_str(text);
        let mut track = serde_path_to_error::Track::new();
        let parsed = RequestSeed {
            shared: body,
            members,
        }
        .deserialize(serde_path_to_error::Deserializer::new(&mut de, &mut track));
        let (mut request, messages) = parsed.map_err(|inner| {
            let path = track.path().to_string();
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
        request.messages = messages.map(|counted| counted.into_messages(body));
        Ok(request)
    }

    /// Refuses a request without `member` (a present but empty `messages` too), as OpenAI
    /// words it.
    pub fn require(&self, member: &str) -> Result<(), InvalidRequest> {
        let present = match member {
            "messages" => match &self.messages {
                Some(m) if m.is_empty() => {
                    return Err(invalid(
                        "'messages' must contain at least one message.",
                        Some("messages".into()),
                    ))
                }
                m => m.is_some(),
            },
            "prompt" => self.prompt.is_some(),
            "input" => self.input.is_some(),
            "max_tokens" => self.max_tokens.is_some(),
            _ => true,
        };
        if present {
            Ok(())
        } else {
            Err(missing(member))
        }
    }

    /// The checks of the sampling members every generating family shares: `n` and `best_of`
    /// within bounds, a budget of at least one token, `temperature` and `top_p` in range.
    pub fn check_sampling(&self) -> Result<(), InvalidRequest> {
        if self.n == Some(0) {
            return Err(invalid("'n' must be at least 1.", Some("n".into())));
        }
        // OpenAI's bound. Unbounded, one request's estimate (`max_tokens` × `n`) put a
        // tenant's token limits in debt for years.
        for (name, value) in [("n", self.n), ("best_of", self.best_of)] {
            if value.is_some_and(|v| v > MAX_CHOICES) {
                return Err(invalid(
                    format!("'{name}' must be at most {MAX_CHOICES}."),
                    Some(name.into()),
                ));
            }
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

    /// Whether the client asked for the tokens' log-probabilities (chat's `logprobs: true`,
    /// or a count for completions).
    pub fn asks_for_logprobs(&self) -> bool {
        matches!(
            self.logprobs,
            Some(Logprobs::Flag(true)) | Some(Logprobs::Count(_))
        )
    }

    /// The output budget: `max_completion_tokens` wins over the older `max_tokens`.
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// A cheap estimate of the prompt's size in tokens (about four characters per token,
    /// plus the chat template's overhead per message; a token id is a token). Counted at
    /// parse: no text is read again.
    pub fn estimated_prompt_tokens(&self) -> usize {
        // The chat template renders the tool definitions into the prompt too: for an agent's
        // long tool list, most of it.
        let tools = self
            .tools
            .as_ref()
            .map_or(0, |t| t.as_bytes().len().div_ceil(CHARS_PER_TOKEN));
        // A Messages `system` or a Responses `instructions` is one more message.
        let system = match (&self.system, &self.instructions) {
            (Some(Content::Text(t)), _) | (None, Some(t)) => t.len(),
            (Some(Content::Parts(parts)), _) => parts.text_len,
            (None, None) => 0,
        };
        let system = if self.system.is_some() || self.instructions.is_some() {
            system.div_ceil(CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE
        } else {
            0
        };
        if let Some(messages) = &self.messages {
            return messages
                .estimated_tokens
                .saturating_add(tools)
                .saturating_add(system);
        }
        if let Some(input) = &self.input {
            let input = match input {
                Input::Text(t) => t.len().div_ceil(CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE,
                Input::Items {
                    estimated_tokens, ..
                } => *estimated_tokens,
            };
            return input.saturating_add(tools).saturating_add(system);
        }
        match &self.prompt {
            Some(Prompt::Text(t)) => t.len().div_ceil(CHARS_PER_TOKEN),
            Some(Prompt::Texts(ts)) => ts.estimated_tokens,
            Some(Prompt::Tokens(ids)) => ids.len(),
            Some(Prompt::TokenBatches(batches)) => batches.tokens,
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
    use super::demand::Fnv1a;
    use super::*;
    use std::borrow::Cow;

    fn chat(body: &str) -> Result<LlmRequest, InvalidRequest> {
        LlmRequest::parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn every_sequence_the_engine_generates_counts_in_the_demand() {
        let one = chat(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":100}"#)
            .unwrap()
            .demand(None);
        let many =
            chat(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":100,"n":128}"#)
                .unwrap()
                .demand(None);
        assert_eq!(many.tokens() - many.prompt_tokens, 12_800);
        assert_eq!(many.context_tokens(), one.context_tokens(), "per sequence");
        let beams = chat(
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":10,"n":2,"best_of":8}"#,
        )
        .unwrap()
        .demand(None);
        assert_eq!(beams.sequences, 8);
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
    fn a_capped_request_asks_for_the_ceiling_and_keeps_every_other_byte() {
        let call = |body: &str| {
            LlmCall::parse(Endpoint::ChatCompletions, Bytes::from(body.to_owned())).unwrap()
        };
        let asked =
            call(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":900}"#);
        let capped = asked.capped(100).unwrap().unwrap();
        assert_eq!(
            &capped.body[..],
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":100}"#
        );
        assert_eq!(capped.request.max_output_tokens(), Some(100));
        assert!(capped.demand.tokens() < asked.demand.tokens());
        assert!(asked.capped(900).is_none(), "within the ceiling already");

        let newer = call(
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":900}"#,
        );
        let capped = newer.capped(100).unwrap().unwrap();
        assert_eq!(capped.request.max_completion_tokens, Some(100));
        assert_eq!(capped.request.max_tokens, Some(5));

        let unbounded = call(r#"{"messages":[{"role":"user","content":"x"}]}"#);
        let capped = unbounded.capped(64).unwrap().unwrap();
        assert_eq!(capped.request.max_tokens, Some(64));
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
        let messages = r.messages.unwrap();
        let first = messages.iter().next().unwrap();
        assert_eq!(first.text_len(), 4);
        let Some(Content::Parts(parts)) = first.content else {
            panic!("parts expected");
        };
        assert_eq!((parts.len(), parts.text_len()), (2, 4));
        assert_eq!(
            parts
                .texts()
                .map(|t| t.to_str().into_owned())
                .collect::<Vec<_>>(),
            ["abcd"]
        );
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

    fn shared(body: &str) -> (Bytes, LlmRequest) {
        let body = Bytes::copy_from_slice(body.as_bytes());
        let endpoint = if body.windows(8).any(|w| w == b"\"prompt\"") {
            Endpoint::Completions
        } else {
            Endpoint::ChatCompletions
        };
        let r = LlmCall::parse(endpoint, body.clone()).unwrap().request;
        (body, r)
    }

    fn inside(body: &Bytes, text: &Text) -> bool {
        raw_json::position(body, &text.raw).is_some()
    }

    fn fnv(bytes: &[u8]) -> u64 {
        let mut h = Fnv1a::default();
        h.write(bytes);
        h.0
    }

    #[test]
    fn texts_are_slices_of_the_body_and_unescape_when_read() {
        let (body, r) = shared(
            r#"{"messages":[{"role":"system","content":"be \"brief\"\n"},{"role":"us\u0065r","content":"plain"}]}"#,
        );
        let messages: Vec<Message> = r.messages.as_ref().unwrap().iter().collect();
        assert_eq!(messages.len(), 2);
        let Some(Content::Text(first)) = &messages[0].content else {
            panic!("text expected");
        };
        assert!(inside(&body, first) && first.has_escapes());
        assert_eq!(first.to_str(), "be \"brief\"\n");
        assert_eq!(first.len(), 11);
        assert_eq!(messages[1].role, "user");
        let Some(Content::Text(second)) = &messages[1].content else {
            panic!("text expected");
        };
        assert!(matches!(second.to_str(), Cow::Borrowed("plain")));
        assert!(inside(&body, second));
        // 11 and 5 bytes: 3 + 2 tokens, and 4 per message.
        assert_eq!(r.estimated_prompt_tokens(), 13);
    }

    #[test]
    fn escapes_never_change_the_estimate_or_the_prefix_hash() {
        let (_, plain) = shared(r#"{"messages":[{"role":"user","content":"A/é\nB"}]}"#);
        let (_, escaped) =
            shared(r#"{"messages":[{"role":"\u0075ser","content":"\u0041\/\u00e9\nB"}]}"#);
        assert_eq!(
            plain.estimated_prompt_tokens(),
            escaped.estimated_prompt_tokens()
        );
        for limit in [0, 1, 3, 4, 5, 6, 7, 100] {
            assert_eq!(
                plain.prompt_prefix_hash(limit),
                escaped.prompt_prefix_hash(limit),
                "{limit}"
            );
        }
        // The hash is FNV-1a of roles and texts in order, cut at the limit.
        assert_eq!(plain.prompt_prefix_hash(100), fnv("userA/é\nB".as_bytes()));
        assert_eq!(plain.prompt_prefix_hash(6), fnv(b"userA/"));
    }

    #[test]
    fn prefix_hash_reads_prompts_as_before() {
        let (_, tokens) = shared(r#"{"prompt":[1,2,3]}"#);
        let le: Vec<u8> = [1u32, 2, 3].iter().flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(tokens.prompt_prefix_hash(100), fnv(&le));
        assert_eq!(tokens.prompt_prefix_hash(6), fnv(&le[..6]));
        let (_, texts) = shared(r#"{"prompt":["ab","cd"]}"#);
        assert_eq!(texts.prompt_prefix_hash(100), fnv(b"ab"));
        let (_, parts) = shared(
            r#"{"messages":[{"role":"u","content":[{"type":"text","text":"x"},{"type":"image_url"},{"text":"y","text":"z"}]},{"role":"a","content":null}]}"#,
        );
        assert_eq!(parts.prompt_prefix_hash(100), fnv(b"uxza"));
        let (_, batches) = shared(r#"{"prompt":[[1],[2]]}"#);
        assert_eq!(batches.prompt_prefix_hash(100), Fnv1a::default().0);
    }

    #[test]
    fn prompt_forms_are_told_apart_by_their_items() {
        let (_, r) = shared(r#"{"prompt":"abcdefgh"}"#);
        assert!(matches!(&r.prompt, Some(Prompt::Text(t)) if *t == "abcdefgh"));
        assert_eq!(r.estimated_prompt_tokens(), 2);
        let (_, r) = shared(r#"{"prompt":["abcde","x\"y"]}"#);
        let Some(Prompt::Texts(ts)) = &r.prompt else {
            panic!("texts expected")
        };
        assert_eq!((ts.len(), ts.text_len()), (2, 8));
        assert_eq!(
            ts.iter()
                .map(|t| t.to_str().into_owned())
                .collect::<Vec<_>>(),
            ["abcde", "x\"y"]
        );
        assert_eq!(r.estimated_prompt_tokens(), 3);
        let (_, r) = shared(r#"{"prompt":[[1,2],[],[3]]}"#);
        let Some(Prompt::TokenBatches(b)) = &r.prompt else {
            panic!("batches expected")
        };
        assert_eq!((b.len(), b.tokens()), (3, 3));
        let ids: Vec<Vec<u32>> = b.iter().map(|t| t.ids().collect()).collect();
        assert_eq!(ids, [vec![1, 2], vec![], vec![3]]);
        let (_, r) = shared(r#"{"prompt":[]}"#);
        assert!(matches!(&r.prompt, Some(Prompt::Texts(t)) if t.is_empty()));
        for bad in [
            r#"{"prompt":["a",1]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[1,-1]}"#,
            r#"{"prompt":[1,1.5]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[[1],[2,"x"]]}"#,
            r#"{"prompt":[[1],2]}"#,
            r#"{"prompt":[null]}"#,
            r#"{"prompt":{"a":1}}"#,
            r#"{"prompt":7}"#,
        ] {
            let e = LlmRequest::parse(Endpoint::Completions, bad.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
            assert!(e.message.contains("untagged enum Prompt"), "{}", e.message);
        }
    }

    #[test]
    fn a_four_million_token_prompt_is_counted_not_collected() {
        let mut body = String::with_capacity(8 << 20);
        body.push_str(r#"{"model":"m","prompt":[7"#);
        for _ in 1..4_000_000 {
            body.push_str(",1");
        }
        body.push_str("]}");
        let (body, r) = shared(&body);
        let Some(Prompt::Tokens(tokens)) = &r.prompt else {
            panic!("tokens expected")
        };
        assert_eq!(tokens.len(), 4_000_000);
        assert_eq!(r.estimated_prompt_tokens(), 4_000_000);
        // The ids are the body's own bytes, read again only as far as they are asked for.
        assert!(raw_json::position(&body, &tokens.raw).is_some());
        assert_eq!(tokens.ids().take(3).collect::<Vec<_>>(), [7, 1, 1]);
        assert_eq!(r.prompt_prefix_hash(4), fnv(&7u32.to_le_bytes()));
        // The request holds a handful of slices of the body, whatever its size.
        assert!(std::mem::size_of::<LlmRequest>() < 1024);
    }

    #[test]
    fn stop_tools_and_kept_json() {
        let (body, r) = shared(
            r#"{"messages":[{"role":"user","content":"x","tool_calls":[{"id":"c"}],"name":"bob","tool_call_id":"t"}],
               "stop":["a","b\n"],"tools":[{"type":"function"},{"type":"function"}],
               "tool_choice":"auto","response_format":{"type":"json_object"}}"#,
        );
        let Some(Stop::Many(stops)) = &r.stop else {
            panic!("stops expected")
        };
        assert_eq!(stops.len(), 2);
        assert_eq!(stops.iter().nth(1).unwrap(), "b\n");
        let tools = r.tools.as_ref().unwrap();
        assert_eq!(tools.len(), 2);
        assert_eq!(
            tools.iter().next().unwrap().as_str(),
            r#"{"type":"function"}"#
        );
        assert_eq!(r.tool_choice.as_ref().unwrap().as_str(), r#""auto""#);
        let format: serde_json::Value = r.response_format.as_ref().unwrap().parse().unwrap();
        assert_eq!(format["type"], "json_object");
        assert!(raw_json::position(&body, tools.as_bytes()).is_some());
        let m = r.messages.as_ref().unwrap().iter().next().unwrap();
        assert_eq!(m.tool_calls.as_ref().map(JsonArray::len), Some(1));
        assert_eq!(m.name.unwrap(), "bob");
        assert_eq!(m.tool_call_id.unwrap(), "t");
        let (_, r) = shared(
            r#"{"messages":[{"role":"user"}],"stop":"end","tools":null,"tool_choice":null}"#,
        );
        assert!(matches!(&r.stop, Some(Stop::One(t)) if *t == "end"));
        assert!(r.tools.is_none() && r.tool_choice.is_none());
        for (bad, param) in [
            (r#"{"messages":[{"role":"u"}],"stop":[1]}"#, "stop"),
            (r#"{"messages":[{"role":"u"}],"stop":3}"#, "stop"),
            (r#"{"messages":[{"role":"u"}],"tools":{}}"#, "tools"),
            (r#"{"messages":[{"role":"u"}],"logprobs":"x"}"#, "logprobs"),
            (
                r#"{"messages":[{"role":"u"}],"logprobs":[1,2]}"#,
                "logprobs",
            ),
            (
                r#"{"messages":[{"role":"u","content":5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"u","name":5}]}"#,
                "messages[0].name",
            ),
            (
                r#"{"messages":[{"role":"u","tool_calls":"x"}]}"#,
                "messages[0].tool_calls",
            ),
            (
                r#"{"messages":[{"role":"u"},{"content":"x"}]}"#,
                "messages[1]",
            ),
            (r#"{"messages":[{"role":null}]}"#, "messages[0].role"),
            (r#"{"messages":[{"role":"u"},"x"]}"#, "messages[1]"),
            (r#"{"messages":{"role":"u"}}"#, "messages"),
        ] {
            let e = chat(bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
        }
        let (_, r) = shared(r#"{"messages":[{"role":"u"}],"logprobs":true,"top_logprobs":2}"#);
        assert_eq!(r.logprobs, Some(Logprobs::Flag(true)));
        let r =
            LlmRequest::parse(Endpoint::Completions, br#"{"prompt":"x","logprobs":3}"#).unwrap();
        assert_eq!(r.logprobs, Some(Logprobs::Count(3)));
    }

    #[test]
    fn repeated_fields_are_refused_and_unknown_ones_ignored() {
        for (bad, field) in [
            (
                r#"{"messages":[{"role":"u"}],"model":"a","model":"b"}"#,
                "model",
            ),
            (
                r#"{"messages":[{"role":"u"}],"messages":[{"role":"u"}]}"#,
                "messages",
            ),
            (r#"{"messages":[{"role":"u","role":"v"}]}"#, "role"),
            (
                r#"{"messages":[{"role":"u"}],"stream":true,"str\u0065am":false}"#,
                "stream",
            ),
        ] {
            let e = chat(bad).unwrap_err();
            assert!(
                e.message.contains(&format!("duplicate field `{field}`")),
                "{bad}: {}",
                e.message
            );
        }
        let r =
            chat(r#"{"messages":[{"role":"u","x":[1,{"y":2}],"x":3}],"x":1,"x":[{}]}"#).unwrap();
        assert_eq!(r.messages.unwrap().len(), 1);
    }

    #[test]
    fn whitespace_and_positions() {
        let body = "{\n  \"model\" : \"m\" ,\n  \"messages\" : [\n    { \"role\" : \"user\" ,\n      \"content\" : \"hi\" }\n  ]\n}\n";
        let (_, r) = shared(body);
        let m = r.messages.unwrap().iter().next().unwrap();
        assert_eq!(m.role, "user");
        assert!(matches!(m.content, Some(Content::Text(t)) if t == "hi"));
        // An error inside `messages` is placed in the whole body.
        let e = chat("{\n\"messages\":\n[{\"role\":3}]}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        assert!(
            e.message
                .ends_with("integer `3`, expected a string at line 3 column 11"),
            "{}",
            e.message
        );
        let e =
            chat("{\"messages\":[\n{\"role\":\"u\"},\n{\"role\":\"u\",\"name\":[]}]}").unwrap_err();
        assert!(e.message.ends_with("at line 3 column 22"), "{}", e.message);
    }

    #[test]
    fn messages_are_read_where_the_one_pass_found_them() {
        let roles = |body: &str| -> Vec<String> {
            let (_, r) = shared(body);
            let m = r.messages.unwrap();
            m.iter().map(|m| m.role.to_str().into_owned()).collect()
        };
        // Members after the array are not messages.
        assert_eq!(
            roles(r#"{"messages" :	[{"role":"a"},{"role":"b"}], "tools":[{"role":"x"}]}"#),
            ["a", "b"]
        );
        // An escaped key is not read in place: the array is found by name.
        assert_eq!(
            roles(r#"{"model":"m","messag\u0065s":[{"role":"a"}],"n":1}"#),
            ["a"]
        );
        // A repeated key is refused, so the place found is the only one.
        assert!(chat(r#"{"messages":[{"role":"a"}],"messages":[{"role":"b"}]}"#).is_err());
        // `null` is no messages.
        assert_eq!(
            chat(r#"{"messages":null}"#).unwrap_err().param.as_deref(),
            Some("messages")
        );
    }

    #[test]
    fn a_value_starts_past_its_keys_quote_colon_and_spaces() {
        let text = br#"{"a" :  [1], "b":2}"#;
        assert_eq!(raw_json::value_after_key(text, 3), Some(8));
        assert_eq!(raw_json::value_after_key(text, 15), Some(17));
        assert_eq!(
            raw_json::value_after_key(text, 2),
            None,
            "not at a key's end"
        );
    }

    #[test]
    fn text_of_its_own() {
        let t = Text::from("a \"b\"\n");
        assert_eq!(t, "a \"b\"\n");
        assert_eq!(t.len(), 6);
        assert_eq!(Text::from(""), "");
        assert!(Text::default().is_empty());
    }
}
