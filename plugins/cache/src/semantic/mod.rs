//! The semantic cache: near-duplicate questions answered from the cache, never a wrong
//! answer more often than the operator allows (`max_error_rate`).
//!
//! On an exact miss, a request that asks a question in words ([`sluice_sdk::ApiFamily::
//! question`]: its last user turn) is looked up by meaning:
//!
//! 1. **Group**: everything else that shapes the answer (system prompt, earlier turns,
//!    tools, response format, sampling, model, endpoint, the key's headers) and the tenant
//!    are hashed as the exact key hashes a request ([`crate::key::digest`] over the request
//!    with the question taken out). Questions are compared only within a group: two tenants
//!    never share a neighbour, nor do two system prompts.
//! 2. **Embedding**: the question is embedded by the embeddings pool, through the core
//!    ([`embed`]); no answer in time, and the request goes on as an exact miss.
//! 3. **Neighbour**: the group's most similar stored question ([`index`]), if at least
//!    `min_similarity`; its answer is the exact cache's entry it points at.
//! 4. **Decision** ([`learn`]): the neighbour's answer is served when its estimated error
//!    at this similarity is within `max_error_rate` (`x-cache: HIT`, `x-cache-similarity`),
//!    except for a `verify_rate` sample; otherwise, and for the sample, the request goes
//!    upstream, and its answer, once whole, is compared with the neighbour's: one more
//!    verified example.
//! 5. **Store**: an answer stored by the exact cache gets its question indexed, for the
//!    entry's lifetime.
//!
//! Two answers are the same when their words are ([`same_answer`]: the text the model
//! generated, case and spacing aside). That is strict on purpose: a false "different" only
//! makes the cache more careful, while a false "same" would break the bound, so the
//! comparison never calls two answers the same when they are not.
//!
//! Tool-calling and agent requests stay exact-only unless `agent_requests` names their route
//! (or is `true`).
//!
//! The index is the process's own ([`index`]) or, with `index: redis`, shared in Redis with
//! the exact entries ([`shared`]). The learned examples are the process's own: replicas learn
//! apart.

pub mod embed;
pub mod index;
pub mod learn;
pub mod shared;

use crate::config::SemanticConfig;
use crate::entry::Entry;
use crate::metrics;
use embed::EmbedFailed;
use index::{GroupId, Index, Slot};
use learn::Table;
use shared::{IndexFailed, RedisIndex};
use sluice_sdk::calls::PoolCalls;
use sluice_sdk::family::question::answer_words;
use sluice_sdk::{AnswerText, Pool};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest question embedded: a longer one goes on as an exact miss. Embedding models'
/// contexts are 256 to 8,192 tokens; a question past its model's is refused by the pool
/// (vLLM's 400) and goes on the same way. It is never cut to fit: two long questions that
/// differ only in the part cut off would look the same.
pub const MAX_QUESTION_BYTES: usize = 32 * 1024;

/// The header a semantic hit carries: how similar its question was to the one answered.
pub const SIMILARITY_HEADER: &str = "x-cache-similarity";

/// The semantic part of the cache, running.
pub struct Semantic {
    pool: Arc<Pool>,
    calls: Arc<dyn PoolCalls>,
    config: SemanticConfig,
    index: Vectors,
    table: Table,
    /// Counts the hits within the bound, to send every `verify_every`th upstream.
    within_bound: AtomicU64,
    /// `1 / verify_rate`, rounded; 0: none is verified.
    verify_every: u64,
}

/// Where the questions are indexed.
enum Vectors {
    Memory(Index),
    Redis(RedisIndex),
}

/// What a lookup found for a request that goes upstream: kept until its answer is whole.
#[derive(Debug)]
pub struct Asked {
    pub group: GroupId,
    pub vector: Vec<f32>,
    /// The neighbour whose answer the upstream's is compared with, when there is one.
    pub neighbour: Option<Neighbour>,
}

/// A neighbour with its answer.
#[derive(Debug)]
pub struct Neighbour {
    pub slot: Slot,
    pub similarity: f32,
    pub entry: Arc<Entry>,
}

/// What a semantic lookup decided.
#[derive(Debug)]
pub enum Decision {
    /// The neighbour's answer is served.
    Serve(Neighbour),
    /// The request goes upstream; its answer will be compared and indexed.
    Upstream(Asked),
    /// The request takes no semantic part (no question, an agent's turn, no embedding).
    Skip,
}

impl Semantic {
    /// With `shared`, the questions are indexed there instead of in this process.
    pub fn new(
        pool: Arc<Pool>,
        calls: Arc<dyn PoolCalls>,
        config: SemanticConfig,
        shared: Option<RedisIndex>,
    ) -> Self {
        metrics::init_semantic(&pool.name);
        Self {
            index: match shared {
                Some(shared) => Vectors::Redis(shared),
                None => Vectors::Memory(Index::new(config.max_bytes)),
            },
            table: Table::new(
                config.min_similarity,
                config.max_error_rate,
                config.confidence,
            ),
            within_bound: AtomicU64::new(0),
            verify_every: if config.verify_rate > 0.0 {
                (1.0 / config.verify_rate).round().max(1.0) as u64
            } else {
                0
            },
            pool,
            calls,
            config,
        }
    }

    /// Whether a request on `endpoint` whose question is an agent's turn takes part.
    pub fn takes_agents(&self, endpoint: sluice_sdk::Endpoint) -> bool {
        self.config.agent_requests.takes(endpoint)
    }

    /// The embedding of `question`, and how long it took; `None` (counted) when there is
    /// none.
    pub async fn embed(&self, question: &str) -> Option<(Vec<f32>, Duration)> {
        let started = Instant::now();
        let models = self.pool.models();
        // No model to name yet (a pool that learns its models has not): no embedding.
        let Some(model) = self
            .config
            .model
            .as_deref()
            .or(models.first().map(String::as_str))
        else {
            metrics::semantic_lookup("unavailable");
            return None;
        };
        let vector = embed::embed(
            self.calls.as_ref(),
            &self.pool,
            model,
            question,
            self.config.timeout,
        )
        .await;
        let took = started.elapsed();
        metrics::semantic_embed(&self.pool.name, took.as_secs_f64());
        match vector {
            Ok(vector) => Some((vector, took)),
            Err(failed) => {
                metrics::semantic_lookup(match failed {
                    EmbedFailed::Unavailable => "unavailable",
                    EmbedFailed::BadAnswer => "bad_answer",
                });
                None
            }
        }
    }

    /// What `/status` shows of it: the index's size, the verified examples, the learned
    /// threshold and the bound there.
    pub fn status(&self) -> serde_json::Value {
        let (examples, wrong) = self.table.totals();
        let bound = self.table.threshold();
        let index = match &self.index {
            Vectors::Memory(index) => serde_json::json!({
                "store": "memory",
                "questions": index.questions(),
                "graphed": index.graphed(),
                "graph_builds_running": index.building(),
                "bytes": index.bytes(),
            }),
            Vectors::Redis(_) => serde_json::json!({"store": "redis"}),
        };
        serde_json::json!({
            "pool": &*self.pool.name,
            "max_error_rate": self.config.max_error_rate,
            "index": index,
            "verified": examples,
            "verified_wrong": wrong,
            "threshold": bound.map(|(t, _)| t),
            "error_bound": bound.map(|(_, e)| e),
        })
    }

    /// Counts what a lookup added to its request besides the embedding call.
    pub fn took(&self, beyond_embedding: Duration) {
        metrics::semantic_overhead(&self.pool.name, beyond_embedding.as_secs_f64());
    }

    /// The group's nearest question to `vector`, if it is a neighbour; `Err` (counted)
    /// when the shared index did not answer.
    pub async fn nearest(
        &self,
        group: &GroupId,
        vector: &[f32],
    ) -> Result<Option<index::Nearest>, IndexFailed> {
        let floor = self.config.min_similarity;
        match &self.index {
            Vectors::Memory(index) => Ok(index.nearest(group, vector, floor)),
            Vectors::Redis(index) => index
                .nearest(group, vector, floor)
                .await
                .inspect_err(|_| metrics::semantic_lookup("index_failed")),
        }
    }

    /// Forgets a neighbour (of `dim` floats) whose answer the exact store no longer has.
    pub fn forget(&self, group: &GroupId, entry: &[u8; 32], dim: usize) {
        match &self.index {
            Vectors::Memory(index) => {
                index.remove(group, entry);
                metrics::semantic_entries(index.questions());
            }
            Vectors::Redis(index) => index.remove(dim, entry),
        }
    }

    /// Serve `neighbour`'s answer, or send the request upstream to learn from it.
    pub fn decide(
        &self,
        group: GroupId,
        vector: Vec<f32>,
        neighbour: Option<Neighbour>,
    ) -> Decision {
        let Some(neighbour) = neighbour else {
            metrics::semantic_lookup("miss");
            return Decision::Upstream(Asked {
                group,
                vector,
                neighbour: None,
            });
        };
        let estimate = self
            .table
            .estimate(&neighbour.slot.examples, neighbour.similarity);
        let result = if !estimate.serve {
            "explore"
        } else if self.sampled() {
            "verify"
        } else {
            metrics::semantic_lookup("hit");
            return Decision::Serve(neighbour);
        };
        metrics::semantic_lookup(result);
        Decision::Upstream(Asked {
            group,
            vector,
            neighbour: Some(neighbour),
        })
    }

    /// Whether this hit within the bound is one of the `verify_rate` sent upstream.
    fn sampled(&self) -> bool {
        self.verify_every > 0
            && self
                .within_bound
                .fetch_add(1, Relaxed)
                .is_multiple_of(self.verify_every)
    }

    /// The upstream's whole answer to an asked request: compared with its neighbour's (one
    /// more verified example), and its question indexed when the exact store took it
    /// (`stored`) until `expires`.
    pub fn answered(
        &self,
        asked: Asked,
        answer: &AnswerText,
        entry: [u8; 32],
        stored: bool,
        expires: Instant,
    ) {
        if let Some(neighbour) = &asked.neighbour {
            let right = same_answer(neighbour.entry.answer.get(), answer.get());
            self.table
                .record(&neighbour.slot.examples, neighbour.similarity, right);
            metrics::semantic_verified(&self.pool.name, right);
            metrics::semantic_bound(&self.pool.name, self.table.threshold());
            if !right {
                tracing::debug!(
                    pool = &*self.pool.name,
                    similarity = neighbour.similarity,
                    "a semantic neighbour's answer differed from the upstream's"
                );
            }
        }
        if stored {
            match &self.index {
                Vectors::Memory(index) => {
                    index.insert(asked.group, asked.vector, entry, expires);
                    metrics::semantic_entries(index.questions());
                }
                Vectors::Redis(index) => index.insert(asked.group, asked.vector, entry, expires),
            }
        }
    }
}

/// Counts a request that took no semantic part, and why (`no_question`, `agent`).
pub fn note_skip(why: &str) {
    metrics::semantic_lookup(why);
}

/// Whether two answers (in their family's kept form) say the same: their generated words,
/// case and runs of whitespace aside.
pub fn same_answer(a: &str, b: &str) -> bool {
    let (a, b) = (answer_words(a), answer_words(b));
    let words = |s: &str| -> Vec<String> { s.split_whitespace().map(str::to_lowercase).collect() };
    !a.trim().is_empty() && words(&a) == words(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_the_same_when_their_words_are() {
        let a = r#"{"id":"a","created":1,"choices":[{"message":{"role":"assistant","content":"Paris  is the capital."}}],"usage":{"completion_tokens":5}}"#;
        let b = r#"{"id":"b","created":2,"choices":[{"message":{"role":"assistant","content":"paris is the capital."}}],"usage":{"completion_tokens":6}}"#;
        let c = r#"{"id":"c","created":2,"choices":[{"message":{"role":"assistant","content":"Madrid is the capital."}}]}"#;
        assert!(same_answer(a, b));
        assert!(!same_answer(a, c));
        // Two empty answers say nothing the same.
        let empty = r#"{"choices":[{"message":{"content":""}}]}"#;
        assert!(!same_answer(empty, empty));
    }
}
