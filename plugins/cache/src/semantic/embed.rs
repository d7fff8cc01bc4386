//! A question's embedding, asked of the embeddings pool through the core
//! ([`sluice_sdk::calls`]): `POST /v1/embeddings` as vLLM serves it for a pooling model.
//! Never with `truncate_prompt_tokens`: vLLM keeps a cut input's last tokens, so two long
//! questions that differ only in their beginning would embed the same; one too long for the
//! model is refused (400), and goes on as an exact miss.

use bytes::Bytes;
use serde::Deserialize;
use sluice_sdk::calls::{Call, PoolCalls};
use sluice_sdk::Pool;
use std::sync::Arc;
use std::time::Duration;

/// The largest embeddings answer read: 8192 floats as JSON text, with room.
const MAX_ANSWER: usize = 256 * 1024;

/// The longest vector taken.
const MAX_DIMENSIONS: usize = 8192;

/// Why a question has no embedding (the request then goes on as if the cache had no
/// semantic part): a label of `sluice_cache_semantic_lookups_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedFailed {
    /// No answer in time, or none at all (no backend, a failed connection).
    Unavailable,
    /// An answer that is not an embedding (an error status, another shape).
    BadAnswer,
}

/// Asks `pool` for the embedding of `text`, as `model`, within `deadline`: a unit vector.
pub async fn embed(
    calls: &dyn PoolCalls,
    pool: &Arc<Pool>,
    model: &str,
    text: &str,
    deadline: Duration,
) -> Result<Vec<f32>, EmbedFailed> {
    let body = serde_json::json!({
        "model": model,
        "input": [text],
        "encoding_format": "float",
    });
    let body = serde_json::to_vec(&body).map_err(|_| EmbedFailed::BadAnswer)?;
    let call = Call {
        path: "/v1/embeddings",
        body: Bytes::from(body),
        deadline,
        max_answer: MAX_ANSWER,
    };
    let answer = calls.post(pool, call).await.map_err(|e| {
        tracing::debug!(pool = &*pool.name, "no embedding: {e}");
        EmbedFailed::Unavailable
    })?;
    if answer.status != 200 {
        tracing::debug!(pool = &*pool.name, status = answer.status, "no embedding");
        return Err(EmbedFailed::BadAnswer);
    }
    read(&answer.body).ok_or(EmbedFailed::BadAnswer)
}

#[derive(Deserialize)]
struct Embeddings {
    data: Vec<Datum>,
}

#[derive(Deserialize)]
struct Datum {
    embedding: Vec<f32>,
}

/// The first embedding of an OpenAI embeddings answer, scaled to unit length.
fn read(body: &[u8]) -> Option<Vec<f32>> {
    let answer: Embeddings = serde_json::from_slice(body).ok()?;
    let vector = answer.data.into_iter().next()?.embedding;
    if vector.is_empty() || vector.len() > MAX_DIMENSIONS {
        return None;
    }
    super::index::normalized(vector)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vllm_answer_gives_a_unit_vector_and_anything_else_none() {
        let v = read(br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[3.0,4.0]}],"model":"m","usage":{"prompt_tokens":2,"total_tokens":2}}"#).unwrap();
        assert_eq!(v, vec![0.6, 0.8]);
        assert_eq!(read(br#"{"data":[]}"#), None);
        assert_eq!(read(br#"{"data":[{"embedding":[0.0,0.0]}]}"#), None);
        assert_eq!(read(br#"{"error":{"message":"x"}}"#), None);
        assert_eq!(read(b"not json"), None);
    }
}
