//! Requests a plugin sends of its own to a pool (the semantic cache's embeddings), sent by
//! the core: a backend chosen as for any attempt (healthy, not ejected, by the pool's
//! balancing), counted in flight there, judged for passive health, counted in
//! `sluice_upstream_attempts_total`, with the pool's credential and headers. A plugin never
//! connects to a backend itself, so a pool it uses keeps its limits and metrics.
//!
//! The trait is the whole surface a plugin sees ([`crate::Host::calls`]): a plugin's tests
//! may implement it to answer as a pool would.

use async_trait::async_trait;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

use crate::pool::Pool;

/// What a pool's backend answered a call.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its status.
    pub status: u16,
    /// Its whole body.
    pub body: Bytes,
}

/// Why a call has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallFailed {
    /// The pool has no backend to try (all unhealthy, ejected, or none).
    NoBackend,
    /// No whole answer within the call's deadline.
    Timeout,
    /// The answer is larger than the call allows.
    TooLarge,
    /// The connection failed, or the answer was not HTTP: the reason, for logs.
    Failed(String),
}

impl std::fmt::Display for CallFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallFailed::NoBackend => f.write_str("the pool has no backend to try"),
            CallFailed::Timeout => f.write_str("no answer in time"),
            CallFailed::TooLarge => f.write_str("the answer is too large"),
            CallFailed::Failed(why) => f.write_str(why),
        }
    }
}

/// One call: `POST path` with a JSON body.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    /// The path, `/v1/embeddings`.
    pub path: &'a str,
    /// The JSON body, sent as it is.
    pub body: Bytes,
    /// The most the whole call (connect, request, the whole answer) may take.
    pub deadline: Duration,
    /// The largest answer read; a larger one fails the call ([`CallFailed::TooLarge`]).
    pub max_answer: usize,
}

/// How a plugin sends a request to a pool through the core (see the module's header).
#[async_trait]
pub trait PoolCalls: Send + Sync {
    /// Sends `call` to one backend of `pool`; a backend that could not be connected to is
    /// judged and another one tried, while the deadline lasts. Any status is an answer: the
    /// caller reads it.
    async fn post(&self, pool: &Arc<Pool>, call: Call<'_>) -> Result<Answer, CallFailed>;
}

impl std::fmt::Debug for dyn PoolCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolCalls")
    }
}

/// A host without pools to call: every call fails with [`CallFailed::NoBackend`]. For the
/// unit tests of plugins that call no pool.
#[derive(Debug, Default)]
pub struct NoPools;

#[async_trait]
impl PoolCalls for NoPools {
    async fn post(&self, _pool: &Arc<Pool>, _call: Call<'_>) -> Result<Answer, CallFailed> {
        Err(CallFailed::NoBackend)
    }
}
