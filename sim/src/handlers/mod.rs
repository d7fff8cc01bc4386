//! The completion flow, one concern per module:
//!
//! - `injected`: the fault switches acting on a request (before it runs, mid-stream, mid-body);
//! - validation (here): the body, the model name and the context length, as vLLM checks them;
//! - `admission`: getting and keeping a place in the engine, and what a refusal answers;
//! - `generation`: the latency model and the per-request metrics;
//! - `answer`: the planned answer and its rendering as JSON or SSE chunks;
//! - `stream` and `non_stream`: the two ways of sending it.

mod admission;
mod answer;
mod errors;
mod generation;
mod injected;
mod non_stream;
mod stream;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::config::{ErrorShape, SimConfig};
use crate::openai::{self, ApiError, CompletionRequest, Kind, ModelCard, ModelList};
use crate::server::{self, HttpResponse};
use crate::Shared;

use answer::Answer;
use generation::Generation;

pub fn models(shared: &Shared) -> HttpResponse {
    let created = shared.started;
    let list = ModelList {
        object: "list",
        data: shared
            .served_names
            .iter()
            .map(|name| ModelCard {
                id: name,
                object: "model",
                created,
                owned_by: "vllm",
                root: &shared.config.model,
                parent: None,
                max_model_len: shared.config.max_model_len,
                permission: [openai::ModelPermission::vllm(
                    shared.next_id("modelperm-"),
                    created,
                )],
            })
            .collect(),
    };
    server::json(200, serde_json::to_vec(&list).unwrap_or_default())
}

/// `POST /v1/chat/completions` and `POST /v1/completions`. `request_id` is the client's
/// `X-Request-Id` header.
pub async fn completion(
    shared: &Arc<Shared>,
    kind: Kind,
    body: Bytes,
    request_id: Option<&str>,
) -> HttpResponse {
    let started = Instant::now();
    let faults = shared.faults();
    if let Some(response) = injected::before_request(shared, &faults).await {
        return response;
    }
    let (request, max_tokens) = match validate(shared, kind, &body) {
        Ok(valid) => valid,
        Err(error) => return server::error(shared, &error),
    };
    let answer = Answer::plan(shared, request, max_tokens, request_id);
    let admission = match shared.engine.admit(answer.kv_tokens()) {
        Ok(admission) => admission,
        Err(refusal) => return server::error(shared, &admission::refused(shared, refusal)),
    };
    let generation = Generation::new(Arc::clone(shared), started, &faults, &answer);
    if answer.request.stream {
        stream::respond(generation, admission, answer, faults)
    } else {
        non_stream::respond(generation, admission, answer, faults).await
    }
}

/// Parse the body, then check the model name and the context length as vLLM does. Returns the
/// request and its token budget (`max_tokens`, or what is left of the context).
fn validate(
    shared: &Shared,
    kind: Kind,
    body: &[u8],
) -> Result<(CompletionRequest, u32), ApiError> {
    let shape = shared.config.error_shape;
    let mut request = openai::parse(kind, body, shared.config.default_temperature, shape)?;
    if shared.config.bytes_per_token != 4.0 {
        request.prompt.count_at(shared.config.bytes_per_token);
    }
    if let Some(model) = &request.model {
        if !shared.served_names.iter().any(|served| served == model) {
            return Err(errors::unknown_model(shape, model, &shared.served_names));
        }
    }
    if shape.is_v0_32() && kind == Kind::Chat && request.messages == 0 {
        return Err(ApiError::bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        ));
    }
    let max_tokens = token_budget(&shared.config, &request)?;
    if shape.is_v0_32() {
        request.check_values(max_tokens)?;
    }
    Ok((request, max_tokens))
}

/// vLLM before 0.32 refuses a request whose prompt plus `max_tokens` exceeds `max_model_len`
/// (or, without `max_tokens`, whose prompt alone fills it); otherwise the answer may use the
/// rest. vLLM 0.32 refuses a prompt longer than the context (first by its characters, before
/// tokenizing it) and a `max_tokens` over the whole context; an answer whose `max_tokens`
/// does not fit after the prompt stops at the context's end (`finish_reason: "length"`). A
/// budget of 0 is refused by [`CompletionRequest::check_values`].
fn token_budget(config: &SimConfig, request: &CompletionRequest) -> Result<u32, ApiError> {
    let max_model_len = config.max_model_len;
    let prompt_tokens = request.prompt.tokens;
    if config.error_shape == ErrorShape::V0_32 {
        let max_chars = u64::from(max_model_len) * errors::CHARS_PER_TOKEN_BOUND;
        if request.prompt.chars as u64 > max_chars {
            return Err(errors::prompt_too_many_chars(
                max_model_len,
                request.prompt.chars,
            ));
        }
        if prompt_tokens > max_model_len {
            return Err(errors::context_length(
                config.error_shape,
                max_model_len,
                prompt_tokens,
                request.max_tokens,
            ));
        }
        if let Some(max_tokens) = request.max_tokens.filter(|max| *max > max_model_len) {
            return Err(errors::max_tokens_over_context(max_tokens, max_model_len));
        }
        let room = max_model_len - prompt_tokens;
        return Ok(request.max_tokens.map_or(room, |max| max.min(room)));
    }
    let too_long = match request.max_tokens {
        Some(max_tokens) => {
            u64::from(prompt_tokens) + u64::from(max_tokens) > u64::from(max_model_len)
        }
        None => prompt_tokens >= max_model_len,
    };
    if too_long {
        return Err(errors::context_length(
            config.error_shape,
            max_model_len,
            prompt_tokens,
            request.max_tokens,
        ));
    }
    Ok(request
        .max_tokens
        .unwrap_or(max_model_len.saturating_sub(prompt_tokens)))
}
