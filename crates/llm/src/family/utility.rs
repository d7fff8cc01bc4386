//! The routes of vLLM that generate nothing: `/tokenize`, `/detokenize`, and a pooling model's
//! `/v1/embeddings`, `/v1/rerank` and `/v1/score`. They are LLM routes for what goes with a
//! model: the pool that serves it, the tenant's key and limits (a request, no output
//! tokens), health-aware choice and retries. Only their `model` (and a prompt's size, for the
//! tenant's input tokens) is read; the engine checks the rest. Embeddings do not depend on
//! sampling, so the cache keeps them whatever the request; the others are never kept.

use super::openai::{error_body, splice_identity, AnswerText};
use super::RouteMatch;
use super::{AnswerError, ApiFamily, CacheUse, WireError};
use crate::request::{concat, member, Endpoint, InvalidRequest, LlmCall, LlmRequest, Member};
use crate::request::{Slot, OPENAI_MEMBERS};
use crate::usage::Usage;
use bytes::Bytes;

/// One route that generates nothing.
#[derive(Debug)]
pub struct Utility {
    name: &'static str,
    path: &'static str,
    /// Its answers may be kept (embeddings).
    kept: bool,
    /// The members it reads (embeddings: `input` too); the engine checks the rest.
    members: &'static [Member],
}

/// What a utility route is read for: its model, and the prompt's size (OpenAI's shared
/// members, with `max_tokens`, as any OpenAI-shaped request).
static MEMBERS: [Member; 18] = concat(OPENAI_MEMBERS, [member("max_tokens", Slot::MaxTokens)]);

/// An embeddings request's: those and `input`, what to embed.
static EMBEDDINGS_MEMBERS: [Member; 19] = concat(MEMBERS, [member("input", Slot::Input)]);

/// `POST /tokenize`.
pub static TOKENIZE: Utility = Utility {
    name: "tokenize",
    path: "/tokenize",
    kept: false,
    members: &MEMBERS,
};
/// `POST /detokenize`.
pub static DETOKENIZE: Utility = Utility {
    name: "detokenize",
    path: "/detokenize",
    kept: false,
    members: &MEMBERS,
};
/// `POST /v1/embeddings`.
pub static EMBEDDINGS: Utility = Utility {
    name: "embeddings",
    path: "/v1/embeddings",
    kept: true,
    members: &EMBEDDINGS_MEMBERS,
};
/// `POST /v1/rerank`.
pub static RERANK: Utility = Utility {
    name: "rerank",
    path: "/v1/rerank",
    kept: false,
    members: &MEMBERS,
};
/// `POST /v1/score`.
pub static SCORE: Utility = Utility {
    name: "score",
    path: "/v1/score",
    kept: false,
    members: &MEMBERS,
};

/// About four characters a token, as the other estimates.
const CHARS_PER_TOKEN: usize = 4;

impl ApiFamily for Utility {
    fn name(&self) -> &'static str {
        self.name
    }

    fn path(&self) -> &'static str {
        self.path
    }

    fn members(&self) -> &'static [Member] {
        self.members
    }

    fn parse(
        &self,
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<LlmCall, InvalidRequest> {
        // Read for the model (and the demand) only: the engine checks the rest.
        let mut call = LlmCall::read_request(endpoint, route, body, self.members(), None)?;
        call.demand.output_tokens = 0;
        call.demand.sequences = 1;
        if call.demand.prompt_tokens == 0 {
            // Rerank's documents, score's texts, detokenize's ids: the body's size.
            call.demand.prompt_tokens = call.body.len().div_ceil(CHARS_PER_TOKEN) as u64;
        }
        Ok(call)
    }

    fn is_error_event(&self, data: &[u8]) -> bool {
        super::openai::is_error_event(data)
    }

    /// Embeddings: `{"object": "list", "data": [...]}` with at least one item.
    fn answer_from_json(&self, body: Bytes) -> Result<AnswerText, AnswerError> {
        #[derive(serde::Deserialize)]
        struct Shape<'a> {
            #[serde(borrow)]
            object: Option<std::borrow::Cow<'a, str>>,
            #[serde(default)]
            data: Vec<serde::de::IgnoredAny>,
        }
        if !self.kept {
            return Err(AnswerError::NotAnAnswer);
        }
        let shape: Shape = serde_json::from_slice(&body).map_err(|_| AnswerError::NotAnAnswer)?;
        if shape.object.as_deref() != Some("list") || shape.data.is_empty() {
            return Err(AnswerError::NotAnAnswer);
        }
        AnswerText::checked(body).ok_or(AnswerError::NotAnAnswer)
    }

    fn answer_from_stream(
        &self,
        _chunks: &[Bytes],
        _usage: Option<Usage>,
    ) -> Result<AnswerText, AnswerError> {
        Err(AnswerError::NotAnAnswer)
    }

    fn stream_answer(&'static self) -> Box<dyn super::StreamAnswer> {
        super::WholeStream::boxed(self)
    }

    fn render_json(&self, answer: &AnswerText, id: &str, created: u64) -> Bytes {
        match splice_identity(answer.get(), id, created) {
            Some(spliced) => Bytes::from(spliced),
            None => Bytes::copy_from_slice(answer.get().as_bytes()),
        }
    }

    /// They do not stream: the JSON answer.
    fn render_stream(
        &self,
        answer: &AnswerText,
        id: &str,
        created: u64,
        _include_usage: bool,
    ) -> Bytes {
        self.render_json(answer, id, created)
    }

    fn id_prefix(&self) -> &'static str {
        "embd"
    }

    fn error_body(&self, error: &WireError<'_>) -> Vec<u8> {
        error_body(error)
    }

    fn error_event(&self, error: &WireError<'_>) -> Vec<u8> {
        error_body(error)
    }

    fn generates(&self) -> bool {
        false
    }

    fn operation(&self) -> &'static str {
        self.name
    }

    fn cache_use(&self, _request: &LlmRequest) -> CacheUse {
        if self.kept {
            CacheUse::Always
        } else {
            CacheUse::Never
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_model_is_read_and_nothing_is_generated() {
        let call = LlmCall::parse(
            Endpoint::Rerank,
            Bytes::from_static(
                br#"{"model":"r","query":"q","documents":["a long document","b"],"n":0}"#,
            ),
        )
        .unwrap();
        assert_eq!(call.request.model.as_deref(), Some("r"));
        assert_eq!(call.demand.output_tokens, 0);
        assert!(call.demand.prompt_tokens > 0);
        assert!(LlmCall::parse(Endpoint::Tokenize, Bytes::from_static(b"[1]")).is_err());
        assert!(!EMBEDDINGS.generates());
    }

    #[test]
    fn embeddings_are_kept_and_replayed_under_a_new_id() {
        let body = br#"{"id":"embd-1","object":"list","created":1,"model":"e","data":[{"index":0,"object":"embedding","embedding":[0.5]}],"usage":{"prompt_tokens":2,"total_tokens":2}}"#;
        let kept = EMBEDDINGS
            .answer_from_json(Bytes::from_static(body))
            .unwrap();
        let replay: serde_json::Value =
            serde_json::from_slice(&EMBEDDINGS.render_json(&kept, "embd-2", 5)).unwrap();
        assert_eq!(
            (replay["id"].as_str(), replay["created"].as_u64()),
            (Some("embd-2"), Some(5))
        );
        assert_eq!(
            TOKENIZE.answer_from_json(Bytes::from_static(body)),
            Err(AnswerError::NotAnAnswer)
        );
    }
}
