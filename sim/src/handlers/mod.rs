//! The completion flow, one concern per module:
//!
//! - `injected`: the fault switches acting on a request (before it runs, mid-stream, mid-body);
//! - validation (here): the body, the model name and the context length, as vLLM checks them;
//! - `admission`: getting and keeping a place in the engine, and what a refusal answers;
//! - `generation`: the latency model and the per-request metrics;
//! - `answer`: the planned answer and its rendering as JSON or SSE chunks;
//! - `stream` and `non_stream`: the two ways of sending it;
//! - `messages`: Anthropic's Messages API, run as a chat and answered in its own shape;
//! - `embeddings`: an embedding model's `POST /v1/embeddings`.

mod admission;
mod answer;
mod embeddings;
mod errors;
mod generation;
mod injected;
mod messages;
mod non_stream;
pub(crate) mod responses_api;
mod stream;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::config::{ErrorShape, SimConfig};
use crate::openai::{self, ApiError, CompletionRequest, Kind, ModelCard, ModelList};
use crate::server::{self, HttpResponse};
use crate::Shared;

use answer::{Answer, Wire};
pub use embeddings::embeddings;
use generation::Generation;

/// `GET /v1/models`: the served names, then the LoRA adapters (their base model as `parent`,
/// no `max_model_len`), as vLLM lists them.
pub fn models(shared: &Shared) -> HttpResponse {
    let created = shared.started;
    let adapters = shared.lora.as_ref().map(|l| l.all()).unwrap_or_default();
    let card = |id, root, parent, max_model_len| ModelCard {
        id,
        object: "model",
        created,
        owned_by: "vllm",
        root,
        parent,
        max_model_len,
        permission: [openai::ModelPermission::vllm(
            shared.next_id("modelperm-"),
            created,
        )],
    };
    let base = shared.model_name();
    let list = ModelList {
        object: "list",
        data: shared
            .served_names
            .iter()
            .map(|name| {
                card(
                    name.as_str(),
                    shared.config.model.as_str(),
                    None,
                    Some(shared.config.max_model_len),
                )
            })
            .chain(adapters.iter().map(|adapter| {
                card(
                    adapter.name.as_str(),
                    adapter.path.as_str(),
                    Some(base),
                    None,
                )
            }))
            .collect(),
    };
    server::json(200, serde_json::to_vec(&list).unwrap_or_default())
}

/// A generation request arrives: when, the faults it meets, or the answer a fault gives it
/// before anything runs.
async fn arrive(
    shared: &Arc<Shared>,
) -> Result<(Instant, Arc<crate::faults::Faults>), HttpResponse> {
    let started = Instant::now();
    let faults = shared.faults();
    match injected::before_request(shared, &faults).await {
        Some(response) => Err(response),
        None => Ok((started, faults)),
    }
}

/// `POST /v1/chat/completions` and `POST /v1/completions`. `request_id` is the client's
/// `X-Request-Id` header.
pub async fn completion(
    shared: &Arc<Shared>,
    kind: Kind,
    body: Bytes,
    request_id: Option<&str>,
) -> HttpResponse {
    let plan = |shared: &Shared| {
        validate(shared, kind, &body).map(|(request, max)| (request, max, Wire::OpenAi))
    };
    serve(shared, request_id, plan, server::error).await
}

/// `POST /v1/messages`: Anthropic's Messages API, run as the chat completion it converts to
/// and answered in Anthropic's shape (see `messages.rs`).
pub async fn messages(shared: &Arc<Shared>, body: Bytes, request_id: Option<&str>) -> HttpResponse {
    let plan = |shared: &Shared| {
        let chat = messages::to_chat(&body, true)?;
        validate_chat(shared, &chat).map(|(request, max)| (request, max, Wire::Anthropic))
    };
    serve(shared, request_id, plan, messages::error).await
}

/// `POST /v1/responses`: OpenAI's Responses API, run as the chat it converts to and answered
/// as a `response` (see `responses_api.rs`).
pub async fn responses(
    shared: &Arc<Shared>,
    body: Bytes,
    request_id: Option<&str>,
) -> HttpResponse {
    let plan = |shared: &Shared| {
        let (chat, echo) = responses_api::to_chat(&body, shared.responses.as_ref())?;
        let wire = Wire::Responses(Box::new(echo));
        validate_chat(shared, &chat).map(|(request, max)| (request, max, wire))
    };
    // vLLM names the response after the body's `request_id` when it has one.
    serve(shared, request_id, plan, server::error).await
}

/// A generation request, from its arrival to its answer: `plan` reads it (the request, its
/// token budget, the API it is answered in), `error` writes a refusal in that API's shape.
async fn serve(
    shared: &Arc<Shared>,
    request_id: Option<&str>,
    plan: impl FnOnce(&Shared) -> Result<(CompletionRequest, u32, Wire), ApiError>,
    error: fn(&Shared, &ApiError) -> HttpResponse,
) -> HttpResponse {
    let (started, faults) = match arrive(shared).await {
        Ok(arrived) => arrived,
        Err(response) => return response,
    };
    let (request, max_tokens, wire) = match plan(shared) {
        Ok(planned) => planned,
        Err(e) => return error(shared, &e),
    };
    let mut answer = Answer::plan(shared, request, max_tokens, request_id);
    if let Wire::Responses(echo) = &wire {
        // A response's id, as vLLM makes it: the body's `request_id` when it has one.
        answer.id = echo
            .request_id
            .clone()
            .unwrap_or_else(|| shared.next_id("resp_"));
    }
    answer.wire = wire;
    generate(shared, started, faults, answer)
        .await
        .unwrap_or_else(|e| error(shared, &e))
}

/// [`validate`] for the chat an API's request converts to.
fn validate_chat(
    shared: &Shared,
    chat: &serde_json::Value,
) -> Result<(CompletionRequest, u32), ApiError> {
    let chat = serde_json::to_vec(chat).unwrap_or_default();
    validate(shared, Kind::Chat, &chat)
}

/// `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: a response this instance
/// keeps (with its store on), or vLLM's errors.
pub fn stored_response(shared: &Shared, id: &str, cancel: bool) -> HttpResponse {
    let store = shared.responses.as_ref();
    let answered = match (store, cancel) {
        (Some(store), false) => store.get(id),
        (Some(store), true) => Err(store.cancel(id)),
        (None, _) => Err(responses_api::not_found(id)),
    };
    match answered {
        Ok(body) => server::json(200, body),
        Err(error) => server::error(shared, &error),
    }
}

/// `POST /tokenize`: a completion's `prompt` or a chat's `messages`, as the engine tokenizes
/// them (vLLM 0.32's `{"count", "max_model_len", "tokens", "token_strs"}`). Without a
/// tokenizer folder the ids are the simulator's made-up ones (see [`synthetic_ids`]).
pub fn tokenize_route(shared: &Shared, body: &[u8]) -> HttpResponse {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let kind = if value.get("messages").is_some() {
        Kind::Chat
    } else {
        Kind::Completion
    };
    let tokenized = validate(shared, kind, body).map(|(request, _)| {
        if request.prompt_ids.is_empty() {
            synthetic_ids(
                kind,
                body,
                request.prompt.tokens,
                shared.config.bytes_per_token,
            )
        } else {
            request.prompt_ids
        }
    });
    match tokenized {
        Ok(ids) => server::json(
            200,
            serde_json::to_vec(&serde_json::json!({
                "count": ids.len(),
                "max_model_len": shared.config.max_model_len,
                "tokens": ids,
                "token_strs": null,
            }))
            .unwrap_or_default(),
        ),
        Err(error) => server::error(shared, &error),
    }
}

/// `POST /detokenize`: `tokens` back to text, with the tokenizer folder's vocabulary, or
/// else the simulator's own words (an id picks one).
pub fn detokenize_route(shared: &Shared, body: &[u8]) -> HttpResponse {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let Some(ids) = value["tokens"].as_array().and_then(|ids| {
        ids.iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
    }) else {
        return server::error(shared, &ApiError::bad_request("Field required: tokens"));
    };
    let text = match &shared.tokenizer {
        Some(tokenizer) => match tokenizer.decode(&ids) {
            Ok(text) => text,
            Err(e) => return server::error(shared, &ApiError::bad_request(e.to_string())),
        },
        None => ids
            .iter()
            .map(|id| crate::text::VOCAB[*id as usize % crate::text::VOCAB.len()])
            .collect(),
    };
    server::json(
        200,
        serde_json::to_vec(&serde_json::json!({"prompt": text})).unwrap_or_default(),
    )
}

/// `POST /v1/messages/count_tokens`.
pub fn count_tokens(shared: &Shared, body: &[u8]) -> HttpResponse {
    messages::count_tokens(shared, body)
}

/// Runs a planned answer in the engine and sends it; an admission refusal is the error.
async fn generate(
    shared: &Arc<Shared>,
    started: Instant,
    faults: Arc<crate::faults::Faults>,
    answer: Answer,
) -> Result<HttpResponse, ApiError> {
    let lora = answer.request.lora.as_ref().map(|adapter| adapter.id);
    let admission = shared
        .engine
        .admit(answer.kv_tokens(), lora)
        .map_err(|refusal| admission::refused(shared, refusal))?;
    let generation = Generation::new(Arc::clone(shared), started, &faults, &answer);
    Ok(if answer.request.stream {
        stream::respond(generation, admission, answer, faults)
    } else {
        non_stream::respond(generation, admission, answer, faults).await
    })
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
    if shared.config.answers_by_words {
        request.prompt.hash = openai::words_hash(body);
    }
    tokenize(shared, kind, body, &mut request)?;
    if let Some(model) = &request.model {
        if !shared.served_names.iter().any(|served| served == model) {
            request.lora = shared.lora.as_ref().and_then(|l| l.find(model));
            if request.lora.is_none() {
                return Err(errors::unknown_model(shape, model, &shared.served_names));
            }
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

/// The prompt's token ids, when the instance needs them: with a tokenizer folder, as the
/// engine makes them (the prompt's token count becomes theirs); with prefix caching alone,
/// made up from the rendered prompt's bytes (one id for each `bytes_per_token` of them, as
/// many as the prompt was counted), so that prompts sharing their beginning share their first
/// blocks.
fn tokenize(
    shared: &Shared,
    kind: Kind,
    body: &[u8],
    request: &mut CompletionRequest,
) -> Result<(), ApiError> {
    if let Some(tokenizer) = &shared.tokenizer {
        let ids = match kind {
            Kind::Chat => tokenizer.chat(body),
            Kind::Completion => tokenizer.completion(body),
        }
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
        request.prompt.tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX).max(1);
        request.prompt_ids = ids;
    } else if shared.prefix_cache.is_some() {
        request.prompt_ids = synthetic_ids(
            kind,
            body,
            request.prompt.tokens,
            shared.config.bytes_per_token,
        );
    }
    Ok(())
}

/// Made-up token ids (see [`tokenize`]): each `bytes_per_token` bytes of the rendered prompt
/// hashed into Llama 3's vocabulary, padded or cut to `tokens`.
fn synthetic_ids(kind: Kind, body: &[u8], tokens: u32, bytes_per_token: f64) -> Vec<u32> {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let mut rendered = Vec::new();
    match kind {
        Kind::Chat => {
            for message in value["messages"].as_array().into_iter().flatten() {
                rendered.extend_from_slice(message["role"].as_str().unwrap_or("").as_bytes());
                rendered.push(b'\n');
                match &message["content"] {
                    serde_json::Value::String(text) => rendered.extend_from_slice(text.as_bytes()),
                    serde_json::Value::Array(parts) => {
                        for part in parts {
                            let text = part["text"].as_str().unwrap_or("");
                            rendered.extend_from_slice(text.as_bytes());
                        }
                    }
                    _ => {}
                }
                rendered.push(b'\n');
            }
        }
        Kind::Completion => match &value["prompt"] {
            serde_json::Value::String(text) => rendered.extend_from_slice(text.as_bytes()),
            other => rendered.extend_from_slice(other.to_string().as_bytes()),
        },
    }
    let step = bytes_per_token.max(0.5);
    (0..tokens)
        .map(|i| {
            let start = (f64::from(i) * step) as usize;
            let end = ((f64::from(i + 1) * step) as usize).min(rendered.len());
            let mut hasher = crate::text::Hasher::default();
            match rendered.get(start..end) {
                Some(piece) if !piece.is_empty() => hasher.bytes(piece),
                _ => hasher.u64(u64::from(i)),
            }
            (hasher.finish() % 128_000) as u32
        })
        .collect()
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
