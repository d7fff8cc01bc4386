//! The API families: each wire format of LLM requests and answers that Sluice serves as an LLM
//! route (OpenAI's chat completions, text completions and Responses, Anthropic's Messages, and
//! the routes that generate nothing: tokenize, embeddings, rerank, ...) owns, behind
//! [`ApiFamily`], all that is particular to it: its route (the path, and the model and stream
//! flag where a format puts them in it), its member table (each top-level key it reads and
//! the request model's field it fills) and checks, its demand estimate, where the served
//! model name goes upstream, its output default, where its answers carry token
//! log-probabilities and usage, how a whole answer is
//! assembled from its stream and replayed in either form, and the shape of its errors. The
//! core, the cache and the selector ask the request's family; none of them matches on a
//! format.
//!
//! Adding a family is one module implementing [`ApiFamily`] and one line in [`families!`]:
//! its id and its value (`test_gemini.rs`, a family shaped like Google's `generateContent`,
//! in the tests only, shows it).

pub mod anthropic;
pub mod logprobs;
pub mod openai;
pub mod question;
pub mod responses;
#[cfg(test)]
mod test_gemini;
pub mod utility;

use crate::request::{InvalidRequest, LlmCall, LlmRequest, Member, Prompt};
use crate::usage::Usage;
use bytes::Bytes;
use serde_json::Value;

/// What a family's route read in a request's path: the model and the stream flag, for a
/// format that puts them there (Gemini's `/v1beta/models/{model}:streamGenerateContent`).
/// Empty for a family served at one fixed path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteMatch {
    /// The model the path names.
    pub model: Option<String>,
    /// Whether the path asks for an event stream, when the path says.
    pub stream: Option<bool>,
}

/// What of a request its engine makes the prompt from, for a pool that tokenizes prompts as
/// its engines do ([`ApiFamily::prompt_source`]). Members are their JSON texts in the body.
#[derive(Debug, Clone, Copy)]
pub enum PromptSource<'a> {
    /// A chat, rendered by the model's chat template from these members.
    Chat {
        /// `messages`: the array's text (whatever follows its closing bracket is not read).
        messages: &'a [u8],
        /// `tools`, if sent.
        tools: Option<&'a [u8]>,
        /// `add_generation_prompt`, if sent.
        add_generation_prompt: Option<&'a [u8]>,
        /// `continue_final_message`, if sent.
        continue_final_message: Option<&'a [u8]>,
        /// `chat_template_kwargs`, if sent.
        chat_template_kwargs: Option<&'a [u8]>,
    },
    /// A text completion's prompt, encoded as it is (the first of a batch).
    Prompt(&'a Prompt),
}

/// Where a family's answers carry their token log-probabilities, for a confidence check
/// ([`ApiFamily::logprobs`]): asking an engine for them, reading them, taking them out.
pub trait Logprobs: Send + Sync + std::fmt::Debug {
    /// `body` asking the engine for each generated token's log-probability, when the client
    /// did not ask and asking changes nothing else in the answer; `None`: send it as it is.
    fn ask(&self, body: &[u8]) -> Option<Bytes>;
    /// Feeds `each` the log-probabilities of choice `choice`'s tokens in one answer (or one
    /// event's data of its stream), in order, while it returns true. Nothing for text that
    /// is not an answer of the family's shape.
    fn read(&self, answer: &[u8], choice: u64, each: &mut dyn FnMut(f64) -> bool);
    /// The answer (or event data) with its log-probabilities taken out, as the engine
    /// answers when none were asked for, every other byte kept; `None` when it had none.
    fn strip(&self, answer: &[u8]) -> Option<Vec<u8>>;
}

/// Why an answer is not a whole, well-formed answer of its family (the cache stores none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerError {
    /// It ended early: no end of stream, or a choice without a finish reason.
    Incomplete,
    /// The stream carried an error event.
    ErrorEvent,
    /// Not an answer of the family's shape.
    NotAnAnswer,
}

/// An answer's JSON text in its non-stream form, checked when it was made and kept as the
/// bytes it is (see [`ApiFamily::answer_from_json`]).
pub use openai::AnswerText;

/// What a family reads of one event of its stream in a single pass, for relaying it to
/// another client under that client's own response id ([`ApiFamily::read_event`]).
#[derive(Debug, Clone)]
pub struct EventFacts<'a> {
    /// The `model` it names, as JSON text.
    pub model: Option<&'a str>,
    /// It carries the usage alone.
    pub usage_only: bool,
    /// Where its response id and creation time are in its text, when it has both once.
    stamp: Option<Stamp>,
}

/// Where an event's (or answer's) response id and creation time are in its JSON text.
#[derive(Debug, Clone)]
struct Stamp {
    id: std::ops::Range<usize>,
    created: std::ops::Range<usize>,
}

/// What Sluice says when it refuses or ends a request itself, for the family to shape.
#[derive(Debug, Clone, Copy)]
pub struct WireError<'a> {
    /// The HTTP status.
    pub status: u16,
    /// What went wrong, for people.
    pub message: &'a str,
    /// The offending parameter, if one.
    pub param: Option<&'a str>,
    /// Sluice's reason token (`kv-pressure`, ...), for scripts.
    pub reason: &'a str,
}

/// A stream's answer, added up as its events pass ([`ApiFamily::stream_answer`]). The cache
/// keeps this while a stream is answered rather than its chunks: a vLLM chat delta event is
/// some 200 bytes around a token of 4, and a thousand open streams each held their whole
/// event log.
pub trait StreamAnswer: Send {
    /// One whole event, as the upstream sent it (its blank line included).
    fn feed(&mut self, event: &[u8]);
    /// Events in the upstream's own shape that bring a client joining now to where the
    /// stream is (a live follower's start): nothing before the first event.
    fn so_far(&self) -> Vec<u8>;
    /// The non-stream answer the whole stream adds up to, with `usage` when it carried none.
    fn finish(&self, usage: Option<Usage>) -> Result<AnswerText, AnswerError>;
}

/// The default [`StreamAnswer`]: the events as they came, assembled by
/// [`ApiFamily::answer_from_stream`] once the stream is whole. For the families whose streams
/// are not relayed live and whose answers are small beside their events' count.
pub struct WholeStream {
    family: &'static dyn ApiFamily,
    events: Vec<u8>,
}

impl WholeStream {
    /// A new one, for `family`'s [`ApiFamily::stream_answer`].
    pub fn boxed(family: &'static dyn ApiFamily) -> Box<dyn StreamAnswer> {
        Box::new(Self {
            family,
            events: Vec::new(),
        })
    }
}

impl StreamAnswer for WholeStream {
    fn feed(&mut self, event: &[u8]) {
        self.events.extend_from_slice(event);
    }

    fn so_far(&self) -> Vec<u8> {
        self.events.clone()
    }

    fn finish(&self, usage: Option<Usage>) -> Result<AnswerText, AnswerError> {
        self.family
            .answer_from_stream(&[Bytes::copy_from_slice(&self.events)], usage)
    }
}

/// Whether the response cache may keep a family's answers to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUse {
    /// Never (a stored response that follow-ups name, a tokenizer's answer).
    Never,
    /// When the request is deterministic, or the cache is told to keep sampled answers.
    IfDeterministic,
    /// Always: the answer does not depend on sampling (embeddings).
    Always,
}

/// Whose rate-limit headers a family's clients read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimitHeaders {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets as durations (`6m0s`).
    OpenAi,
    /// `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`, resets as RFC 3339
    /// times.
    Anthropic,
}

/// One wire format of LLM requests and answers. Implementations are stateless values (one
/// `static` each), found through [`Endpoint::family`].
pub trait ApiFamily: Send + Sync + std::fmt::Debug {
    /// Its short name: the `route` label of metrics and logs, and the cache's key and TTL
    /// name (`chat`, `completions`).
    fn name(&self) -> &'static str;
    /// The path it is served at (`POST`), or its pattern for a family whose path names more
    /// (`/v1beta/models/{model}:generateContent`): the cache's key and the docs name it.
    fn path(&self) -> &'static str;
    /// Whether it serves `path` (decoded as the engine reads it), and what the path says of
    /// the request. By default the path is matched exactly, as vLLM's router does.
    fn route(&self, path: &str) -> Option<RouteMatch> {
        (path == self.path()).then(RouteMatch::default)
    }
    /// Its member table: the top-level members of its requests that it reads, each with the
    /// field of the request model it fills, for the shared reader
    /// ([`LlmCall::read_request`]). Empty (the default) for a family that reads its body
    /// itself.
    fn members(&self) -> &'static [Member] {
        &[]
    }
    /// Reads and checks a request body, with its demand estimate; `route` is what the path
    /// said.
    fn parse(
        &self,
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<LlmCall, InvalidRequest>;
    /// The path a request routed as `route` goes upstream with, when the family names the
    /// model in the path: there the pool's served name `model` replaces the client's, and
    /// the body is left as it is. `None` (the default): the client's path goes up, and the
    /// served name in the body's `model` member.
    fn path_with_model(&self, _route: &RouteMatch, _model: &str) -> Option<String> {
        None
    }
    /// The output tokens an engine generates for a request that sets no limit, when the
    /// format has a default (text completions: 16); `None`: up to the context's end.
    fn default_max_tokens(&self) -> Option<u32> {
        None
    }
    /// What its engine makes the prompt from, as the tokenizer reads it; `None` (the
    /// default) when it is not rendered as the engine renders it (Messages and Responses
    /// convert to a chat first), or fills no prefix cache.
    fn prompt_source<'a>(&self, _call: &'a LlmCall) -> Option<PromptSource<'a>> {
        None
    }
    /// Where its answers carry token log-probabilities; `None` (the default): they carry
    /// none, and no confidence check can judge them.
    fn logprobs(&self) -> Option<&'static dyn Logprobs> {
        None
    }
    /// Where its answers put their token counts: the usage object's key and the counts'
    /// names (OpenAI's by default).
    fn usage_names(&self) -> crate::usage::UsageNames {
        crate::usage::UsageNames::OPENAI
    }
    /// A new reader of an answer's token usage (a stream's when `stream`), fed the answer's
    /// chunks as they pass, by [`ApiFamily::usage_names`]. A family whose answers echo the
    /// client's JSON takes the usage only where it puts it.
    fn usage_scanner(&self, _stream: bool) -> crate::usage::UsageScanner {
        crate::usage::UsageScanner::new(self.usage_names())
    }
    /// Whether one event's data (a stream's) is an error the upstream ended it with.
    fn is_error_event(&self, data: &[u8]) -> bool;
    /// Whether one event of its stream carries the usage alone (the event an upstream sends
    /// when asked for usage, kept from a client that did not ask); the families whose streams
    /// always carry their usage have none.
    fn is_usage_event(&self, _event: &[u8]) -> bool {
        false
    }
    /// A whole non-stream answer, checked, as it will be kept.
    fn answer_from_json(&self, body: Bytes) -> Result<AnswerText, AnswerError>;
    /// The non-stream answer a whole stream (its chunks, as the client got them) adds up to,
    /// with `usage` when the stream carried none.
    fn answer_from_stream(
        &self,
        chunks: &[Bytes],
        usage: Option<Usage>,
    ) -> Result<AnswerText, AnswerError>;
    /// A new adder of a stream's answer, fed its events as they pass: what the cache keeps of
    /// a stream being answered, in place of its chunks.
    /// ([`WholeStream`] keeps the events as they came.)
    fn stream_answer(&'static self) -> Box<dyn StreamAnswer>;
    /// A kept answer as a JSON body, with a response's own `id` and `created`.
    fn render_json(&self, answer: &AnswerText, id: &str, created: u64) -> Bytes;
    /// A kept answer as the family's event stream, ended as the format ends a stream.
    fn render_stream(
        &self,
        answer: &AnswerText,
        id: &str,
        created: u64,
        include_usage: bool,
    ) -> Bytes;
    /// Reads one event's JSON text (its `data`) for relaying: `None` for an event not to pass
    /// on (an error event, whose news the stream's end carries; text no client could read).
    fn read_event<'a>(&self, _json: &'a str) -> Option<EventFacts<'a>> {
        Some(EventFacts {
            model: None,
            usage_only: false,
            stamp: None,
        })
    }
    /// Writes an event read by [`ApiFamily::read_event`] to `out` under response `id` and
    /// `created` (as it is when it has no stamp to replace).
    fn write_event(
        &self,
        json: &str,
        _facts: &EventFacts<'_>,
        _id: &str,
        _created: u64,
        out: &mut Vec<u8>,
    ) {
        out.extend_from_slice(json.as_bytes());
    }
    /// The usage-only event of a stream, made here (for a client that asked for usage when
    /// the stream it shares did not carry one); `model` as JSON text.
    fn usage_event(
        &self,
        _id: &str,
        _created: u64,
        _model: Option<&str>,
        _usage: Usage,
    ) -> Vec<u8> {
        Vec::new()
    }
    /// The prefix of a response id it makes (`chatcmpl`, `cmpl`).
    fn id_prefix(&self) -> &'static str;
    /// An error body in the family's shape.
    fn error_body(&self, error: &WireError<'_>) -> Vec<u8>;
    /// The same error as the last event of a stream that had started.
    fn error_event(&self, error: &WireError<'_>) -> Vec<u8>;
    /// The body member that holds the request's output budget, for a ceiling to set it.
    fn budget_key(&self, request: &LlmRequest) -> &'static str {
        if request.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }
    /// `body` with its output budget set to `ceiling` tokens, every other byte kept; `None`
    /// when the body is not a JSON object. By default the top-level [`ApiFamily::budget_key`].
    fn with_budget(&self, request: &LlmRequest, body: &[u8], ceiling: u32) -> Option<Vec<u8>> {
        let key = self.budget_key(request);
        crate::raw_json::set_member(body, key, ceiling.to_string().as_bytes())
    }
    /// Whether the engine generates tokens for it (a tokenizer or a pooling model does not:
    /// no draft, no output budget).
    fn generates(&self) -> bool {
        true
    }
    /// Whether the cache may keep the answer to `request`.
    fn cache_use(&self, _request: &LlmRequest) -> CacheUse {
        CacheUse::IfDeterministic
    }
    /// Whether the engine keeps its answer to `request` for follow-ups that name it (the
    /// Responses API's stored responses): the proxy then notes which backend made it.
    fn stores_answer(&self, _request: &LlmRequest) -> bool {
        false
    }
    /// Whether a stream being answered can be relayed live to identical requests
    /// ([`ApiFamily::read_event`] and its kin); when not, they wait for the whole answer.
    fn relays_live(&self) -> bool {
        false
    }
    /// Whose rate-limit headers its answers carry.
    fn rate_limit_headers(&self) -> RateLimitHeaders {
        RateLimitHeaders::OpenAi
    }
    /// What a semantic cache compares of `body` (see [`question`]); `None` (the default)
    /// when the family's requests ask no question in words (a tokenizer, a pooling model).
    fn question(&self, _body: &[u8]) -> Option<question::Question> {
        None
    }
    /// The operation its requests are in the GenAI semantic conventions
    /// (`gen_ai.operation.name`): `chat`, `text_completion`, `embeddings`, ...
    fn operation(&self) -> &'static str {
        "chat"
    }
}

/// Registers the families: each line a variant of [`Endpoint`] (the family's stable id, kept
/// in cache entries and labels under its name) and the family that serves it. Makes the
/// enum, [`Endpoint::ALL`] and [`Endpoint::family`], so that a family is registered in one
/// place.
macro_rules! families {
    ($(
        $(#[doc = $doc:literal])*
        $(#[cfg($cfg:meta)])?
        $variant:ident = $id:literal => $family:expr,
    )*) => {
        /// The LLM routes: each is an API family's id (see [`Endpoint::family`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        pub enum Endpoint {
            $(
                $(#[doc = $doc])*
                $(#[cfg($cfg)])?
                #[serde(rename = $id)]
                $variant,
            )*
        }

        impl Endpoint {
            /// Every family served, for the router.
            pub const ALL: &'static [Endpoint] = &[$($(#[cfg($cfg)])? Endpoint::$variant,)*];

            /// The family of requests to this endpoint.
            pub fn family(self) -> &'static dyn ApiFamily {
                match self {
                    $($(#[cfg($cfg)])? Endpoint::$variant => &$family,)*
                }
            }
        }
    };
}

families! {
    /// `POST /v1/chat/completions`
    ChatCompletions = "chat" => openai::CHAT,
    /// `POST /v1/completions`
    Completions = "completion" => openai::COMPLETIONS,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Messages = "messages" => anthropic::MESSAGES,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses = "responses" => responses::RESPONSES,
    /// `POST /v1/messages/count_tokens`: no generation.
    CountTokens = "count_tokens" => anthropic::COUNT_TOKENS,
    /// `POST /tokenize`: no generation.
    Tokenize = "tokenize" => utility::TOKENIZE,
    /// `POST /detokenize`: no generation.
    Detokenize = "detokenize" => utility::DETOKENIZE,
    /// `POST /v1/embeddings`: a pooling model's answer, no generation.
    Embeddings = "embeddings" => utility::EMBEDDINGS,
    /// `POST /v1/rerank`: a pooling model's answer, no generation.
    Rerank = "rerank" => utility::RERANK,
    /// `POST /v1/score`: a pooling model's answer, no generation.
    Score = "score" => utility::SCORE,
    /// A family shaped like Google's `generateContent` (model and stream in the path, its own
    /// members and usage names), in the tests only: the proof that a family is one module
    /// and this one line.
    #[cfg(test)]
    TestGemini = "test_gemini" => test_gemini::GEMINI,
}

impl Endpoint {
    /// The endpoint served at `path`, if any, and what its family read in the path.
    pub fn route(path: &str) -> Option<(Self, RouteMatch)> {
        Self::ALL
            .iter()
            .find_map(|e| e.family().route(path).map(|found| (*e, found)))
    }

    /// The endpoint served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Self> {
        Self::route(path).map(|(endpoint, _)| endpoint)
    }

    /// The path of the endpoint.
    pub fn path(self) -> &'static str {
        self.family().path()
    }

    /// A short label for metrics and logs.
    pub fn label(self) -> &'static str {
        self.family().name()
    }
}

/// The events of a named-event stream (Messages, Responses), whole, in order: each one's
/// data, parsed (its `type` names it).
/// One whole event's data: its `data:` lines joined by `\n` (empty for a comment).
pub(crate) fn event_data(event: &str) -> String {
    event
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn stream_events(chunks: &[Bytes]) -> Result<Vec<Value>, AnswerError> {
    let body: Vec<u8> = chunks.concat();
    let text = std::str::from_utf8(&body).map_err(|_| AnswerError::NotAnAnswer)?;
    let mut events = Vec::new();
    for event in text.split("\n\n") {
        let data = event_data(event);
        if data.is_empty() {
            continue;
        }
        events.push(serde_json::from_str(&data).map_err(|_| AnswerError::NotAnAnswer)?);
    }
    Ok(events)
}

/// The real vLLM 0.32 captures (`tests/fixtures/vllm-0.32/`), for the families' tests.
#[cfg(test)]
pub(crate) mod captures {
    /// The body of one of the real vLLM 0.32 captures.
    pub fn capture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../../tests/fixtures/vllm-0.32/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let at = text
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|i| i + 4);
        let at = at.or_else(|| text.windows(2).position(|w| w == b"\n\n").map(|i| i + 2));
        text[at.unwrap()..].to_vec()
    }

    /// A chunked body's data, its chunk sizes removed.
    pub fn unchunked(body: &[u8]) -> Vec<u8> {
        let text = String::from_utf8_lossy(body);
        let mut out = String::new();
        let mut lines = text.split('\n').peekable();
        while let Some(size) = lines.next() {
            let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
                continue;
            };
            let mut chunk = String::new();
            while chunk.len() < size {
                let Some(line) = lines.next() else { break };
                chunk.push_str(line);
                chunk.push('\n');
            }
            out.push_str(&chunk[..size.min(chunk.len())]);
        }
        out.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_found_by_its_path_and_named_once() {
        let mut names = std::collections::HashSet::new();
        for &endpoint in Endpoint::ALL {
            let family = endpoint.family();
            assert_eq!(Endpoint::from_path(family.path()), Some(endpoint));
            assert!(names.insert(family.name()), "{} twice", family.name());
            assert_eq!(endpoint.label(), family.name());
        }
        assert_eq!(Endpoint::from_path("/v1/chat/completions/"), None);
    }

    #[test]
    fn every_member_table_names_each_key_once_and_fits_the_repeat_check() {
        let mut read_by_table = 0;
        for &endpoint in Endpoint::ALL {
            let members = endpoint.family().members();
            let mut keys = std::collections::HashSet::new();
            for member in members {
                assert!(
                    keys.insert(member.key),
                    "{endpoint:?}: {} twice",
                    member.key
                );
            }
            // One bit per key for the repeat check, the placed members' included.
            assert!(
                members.len() + crate::request::PLACED_MEMBERS.len() <= 64,
                "{endpoint:?}"
            );
            read_by_table += usize::from(!members.is_empty());
        }
        // Every shipped family is read by its table; the test family reads its own body.
        assert_eq!(read_by_table, Endpoint::ALL.len() - 1);
    }

    #[test]
    fn a_family_reads_only_its_own_members() {
        // `system` is Messages' own: a chat request's is passed over as unknown, and a
        // Messages request reads it.
        let body =
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":3,"system":"be brief"}"#;
        let chat = LlmCall::parse(Endpoint::ChatCompletions, Bytes::from(body)).unwrap();
        assert!(chat.request.system.is_none());
        let messages = LlmCall::parse(Endpoint::Messages, Bytes::from(body)).unwrap();
        assert!(messages.request.system.is_some());
        // A member of another family's, of a type its own would refuse, is the engine's to
        // judge: Responses reads `max_output_tokens`, not `max_tokens`.
        let body = r#"{"input":"x","max_tokens":"many","max_output_tokens":7}"#;
        let responses = LlmCall::parse(Endpoint::Responses, Bytes::from(body)).unwrap();
        assert_eq!(responses.request.max_tokens, Some(7));
        // Only chat reads `max_completion_tokens` (vLLM's completions ignore it).
        let body = r#"{"prompt":"x","max_completion_tokens":900}"#;
        let completion = LlmCall::parse(Endpoint::Completions, Bytes::from(body)).unwrap();
        assert_eq!(completion.request.max_output_tokens(), None);
        // A member the core places is refused when repeated in any family (the engine would
        // take the last, an edit the first), though no family reads it.
        let body = r#"{"messages":[{"role":"user","content":"x"}],"priority":1,"priority":2}"#;
        let e = LlmCall::parse(Endpoint::ChatCompletions, Bytes::from(body)).unwrap_err();
        assert!(
            e.message.contains("duplicate field `priority`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_kept_answer_replays_in_both_forms_through_its_family() {
        let family = Endpoint::Completions.family();
        let body = Bytes::from_static(
            br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"hi","logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
        );
        let kept = family.answer_from_json(body).unwrap();
        let stream = family.render_stream(&kept, "cmpl-x", 9, true);
        let back = family.answer_from_stream(&[stream], None).unwrap();
        let back: serde_json::Value = serde_json::from_str(back.get()).unwrap();
        assert_eq!(back["choices"][0]["text"], "hi");
        assert_eq!(back["usage"]["total_tokens"], 2);
        let json: serde_json::Value =
            serde_json::from_slice(&family.render_json(&kept, "cmpl-y", 7)).unwrap();
        assert_eq!(
            (json["id"].as_str(), json["created"].as_u64()),
            (Some("cmpl-y"), Some(7))
        );
        // A chat answer is not a completion.
        let chat = Endpoint::ChatCompletions.family();
        assert_eq!(
            chat.answer_from_json(Bytes::from(serde_json::to_vec(&json).unwrap())),
            Err(AnswerError::NotAnAnswer)
        );
    }

    #[test]
    fn errors_take_the_familys_shape() {
        let error = WireError {
            status: 503,
            message: "busy",
            param: None,
            reason: "kv-pressure",
        };
        let body: serde_json::Value =
            serde_json::from_slice(&Endpoint::ChatCompletions.family().error_body(&error)).unwrap();
        assert_eq!(body["error"]["type"], "ServiceUnavailableError");
        assert_eq!(body["error"]["code"], 503);
        let event = Endpoint::Completions.family().error_event(&error);
        assert!(event.ends_with(b"data: [DONE]\n\n"));
    }
}
