//! Getting a place in the engine, keeping it while the answer grows, and what a refusal
//! answers.

use std::sync::atomic::Ordering;

use super::errors;
use super::generation::Generation;
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
///
/// When those blocks are not free (phantom pressure) the engine preempts the request: it waits
/// for its turn again, then recomputes its cache, a prefill of all `tokens`, as vLLM does.
pub async fn hold(
    ticket: &mut Ticket,
    tokens: u64,
    generation: &Generation,
) -> Result<(), Refusal> {
    let mut preempted = false;
    while let Some(pending) = ticket.set_tokens(tokens) {
        tracing::debug!(tokens, "request preempted: KV blocks not free");
        *ticket = pending.wait().await?;
        generation.preempted();
        preempted = true;
    }
    if preempted {
        let recomputed = u32::try_from(tokens).unwrap_or(u32::MAX);
        generation.prefill(recomputed).await;
    }
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
        Refusal::QueueFull => {
            shared.metrics.admission_rejected();
            ApiError::new(503, "Service Unavailable: the waiting queue is full.")
        }
    }
}
