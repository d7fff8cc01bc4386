//! `POST /v1/embeddings` of an embedding model (`--runner pooling`), answered as vLLM 0.32
//! answers it (`tests/fixtures/vllm-0.32/embeddings-*.http`): `{"id": "embd-…", "object":
//! "list", "created", "model", "data": [{"index", "object": "embedding", "embedding"}],
//! "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0, …}}`, one vector per
//! input, of unit length (sentence-transformers' models normalise theirs).
//!
//! The vector is the simulator's own, deterministic and cheap: the input's words and word
//! pairs, lower-cased, hashed into signed buckets (feature hashing). Two inputs that share
//! most of their words are close; two that share none are near orthogonal. That is enough
//! for a router's tests (a paraphrase that keeps its words is similar, another question is
//! not); measuring a semantic cache's errors takes the real model, which the real-vLLM tier
//! serves.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use serde_json::{json, Value};

use super::errors;
use crate::openai::ApiError;
use crate::server::{self, HttpResponse};
use crate::text::{mix, Hasher};
use crate::Shared;

/// Parses, counts and embeds; the answer, or vLLM's error for it.
pub async fn embeddings(shared: &Arc<Shared>, body: &Bytes) -> HttpResponse {
    match embed(shared, body).await {
        Ok(answer) => server::json(200, answer),
        Err(error) => server::error(shared, &error),
    }
}

async fn embed(shared: &Shared, body: &[u8]) -> Result<Vec<u8>, ApiError> {
    let request: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("JSON decode error: {e}")))?;
    let config = &shared.config;
    if let Some(model) = request.get("model").and_then(Value::as_str) {
        if !shared.served_names.iter().any(|served| served == model) {
            return Err(errors::unknown_model(
                config.error_shape,
                model,
                &shared.served_names,
            ));
        }
    }
    let inputs = inputs(request.get("input"))?;
    let options = Options::of(&request, config.max_model_len)?;
    let mut data = Vec::with_capacity(inputs.len());
    let mut prompt_tokens = 0u32;
    for (index, input) in inputs.iter().enumerate() {
        let (tokens, item) = embedding(shared, index, input, &options)?;
        prompt_tokens = prompt_tokens.saturating_add(tokens);
        data.push(item);
    }
    // A pooling model's request is one prefill of its tokens.
    let latency = &config.latency;
    let took = latency.overhead + latency.prefill_per_token * prompt_tokens;
    if !took.is_zero() {
        tokio::time::sleep(took).await;
    }
    let answer = json!({
        "id": format!("embd-{:016x}", rand::random::<u64>()),
        "object": "list",
        "created": shared.started,
        "model": shared.served_names.first(),
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": null,
            "completion_tokens_details": null,
        },
    });
    serde_json::to_vec(&answer).map_err(|e| ApiError::new(500, e.to_string()))
}

/// What a request asks of each vector besides its input.
struct Options {
    /// `truncate_prompt_tokens`: the tokens kept of each input.
    truncate: Option<u32>,
    /// `encoding_format: "base64"`.
    base64: bool,
}

impl Options {
    fn of(request: &Value, max_model_len: u32) -> Result<Self, ApiError> {
        // vLLM's -1: keep as much as the model's context holds.
        let truncate = match request
            .get("truncate_prompt_tokens")
            .and_then(Value::as_i64)
        {
            Some(-1) => Some(max_model_len),
            other => other.and_then(|n| u32::try_from(n).ok()),
        };
        let base64 = match request.get("encoding_format").and_then(Value::as_str) {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "encoding_format {other:?} is not one of 'float', 'base64', 'bytes'"
                )))
            }
        };
        Ok(Self { truncate, base64 })
    }
}

/// One input's tokens and its item of `data`, or the context-length error vLLM gives it.
fn embedding(
    shared: &Shared,
    index: usize,
    input: &Input,
    options: &Options,
) -> Result<(u32, Value), ApiError> {
    let config = &shared.config;
    let mut tokens = match input {
        Input::Text(text) => count_tokens(shared, text),
        Input::Ids(ids) => u32::try_from(ids.len()).unwrap_or(u32::MAX),
    };
    if let Some(keep) = options.truncate {
        tokens = tokens.min(keep);
    }
    if tokens > config.max_model_len {
        return Err(errors::context_length(
            config.error_shape,
            config.max_model_len,
            tokens,
            None,
        ));
    }
    let vector = vector(input, config.embedding_dimensions);
    let embedding = if options.base64 {
        let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
        Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))
    } else {
        Value::from(vector)
    };
    let item = json!({"index": index, "object": "embedding", "embedding": embedding});
    Ok((tokens, item))
}

/// One input: a text, or token ids.
enum Input {
    Text(String),
    Ids(Vec<u64>),
}

/// `input`: a string, a list of strings, a list of token ids, or a list of such lists.
fn inputs(input: Option<&Value>) -> Result<Vec<Input>, ApiError> {
    let invalid =
        || ApiError::bad_request("input must be a string, a list of strings, or token ids");
    let ids = |items: &[Value]| -> Option<Vec<u64>> { items.iter().map(Value::as_u64).collect() };
    match input.ok_or_else(invalid)? {
        Value::String(text) => Ok(vec![Input::Text(text.clone())]),
        Value::Array(items) if items.is_empty() => Err(invalid()),
        Value::Array(items) if items.iter().all(Value::is_u64) => {
            Ok(vec![Input::Ids(ids(items).ok_or_else(invalid)?)])
        }
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(Input::Text(text.clone())),
                Value::Array(inner) => ids(inner).map(Input::Ids).ok_or_else(invalid),
                _ => Err(invalid()),
            })
            .collect(),
        _ => Err(invalid()),
    }
}

/// A text's tokens: by the tokenizer folder when there is one (with its special tokens, as
/// a BERT model counts `[CLS]` and `[SEP]`), else one per `bytes_per_token` bytes.
fn count_tokens(shared: &Shared, text: &str) -> u32 {
    if let Some(tokenizer) = &shared.tokenizer {
        if let Ok(ids) = tokenizer.encode(text, true) {
            return u32::try_from(ids.len()).unwrap_or(u32::MAX);
        }
    }
    let bytes = text.len() as f64 / shared.config.bytes_per_token.max(0.5);
    (bytes.ceil() as u32).max(1)
}

/// The input's unit vector of `dimensions` (see the module's header).
fn vector(input: &Input, dimensions: u32) -> Vec<f32> {
    let dimensions = dimensions.max(1) as usize;
    let mut vector = vec![0f32; dimensions];
    let mut add = |feature: u64, weight: f32| {
        let hash = mix(feature);
        let bucket = (hash % dimensions as u64) as usize;
        let sign = if hash >> 63 == 0 { 1.0 } else { -1.0 };
        vector[bucket] += sign * weight;
    };
    let words: Vec<u64> = match input {
        Input::Text(text) => text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|word| !word.is_empty())
            .map(|word| {
                let mut hasher = Hasher::default();
                hasher.bytes(word.to_lowercase().as_bytes());
                hasher.finish()
            })
            .collect(),
        Input::Ids(ids) => ids.iter().map(|id| mix(*id ^ 0x1d5)).collect(),
    };
    for word in &words {
        add(*word, 1.0);
    }
    for pair in words.windows(2) {
        add(mix(pair[0] ^ pair[1].rotate_left(17)), 0.5);
    }
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        vector.iter_mut().for_each(|x| *x /= norm);
    } else {
        vector[0] = 1.0;
    }
    vector
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn of(text: &str) -> Vec<f32> {
        vector(&Input::Text(text.into()), 384)
    }

    #[test]
    fn inputs_that_share_their_words_are_close_and_others_are_not() {
        let a = of("What is the capital of France?");
        let same = of("what is the capital of france");
        let reworded = of("What is the capital city of France?");
        let other = of("How do I bake sourdough bread at home?");
        assert!((cosine(&a, &a) - 1.0).abs() < 1e-5, "unit length");
        assert!(cosine(&a, &same) > 0.999, "case and punctuation aside");
        assert!(cosine(&a, &reworded) > 0.75, "{}", cosine(&a, &reworded));
        assert!(cosine(&a, &other) < 0.3, "{}", cosine(&a, &other));
    }
}
