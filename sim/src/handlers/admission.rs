//! Getting a place in the engine, keeping it while the answer grows, and what a refusal
//! answers.

use std::sync::atomic::Ordering;

use super::errors;
use crate::engine::{Admission, Refusal, Ticket};
use crate::openai::ApiError;
use crate::Shared;

/// The request's ticket, once it is its turn to run.
pub async fn wait_for_turn(admission: Admission) -> Result<Ticket, Refusal> {
    match admission {
        Admission::Running(ticket) => Ok(ticket),
        Admission::Queued(pending) => pending.wait().await,
    }
}

/// Record that the request now holds `tokens` (prompt + generated) in the KV cache.
pub async fn hold(ticket: &mut Ticket, tokens: u64) -> Result<(), Refusal> {
    ticket.set_tokens(tokens);
    Ok(())
}

/// The error a refused request gets: a CUDA OOM 500 (counted on /metrics) or a 503 when the
/// waiting queue is full.
pub fn refused(shared: &Shared, refusal: Refusal) -> ApiError {
    match refusal {
        Refusal::Oom {
            need_blocks,
            free_blocks,
        } => {
            shared.metrics.oom.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(need_blocks, free_blocks, "simulated CUDA OOM");
            errors::out_of_memory(need_blocks, free_blocks, shared.config.block_size)
        }
        Refusal::QueueFull => ApiError::new(503, "Service Unavailable: the waiting queue is full."),
    }
}
