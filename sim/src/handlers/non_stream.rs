//! Sending an answer as one JSON body, after the whole answer has been generated.

use std::sync::Arc;

use super::admission;
use super::answer::{Answer, Wire};
use super::generation::Generation;
use super::injected;
use crate::engine::{Admission, Refusal, Ticket};
use crate::faults::Faults;
use crate::kv_transfer::{Connector, TransferAsk};
use crate::openai::ApiError;
use crate::server::{self, HttpResponse};

pub async fn respond(
    mut generation: Generation,
    admission: Admission,
    mut answer: Answer,
    faults: Arc<Faults>,
) -> HttpResponse {
    let shared = Arc::clone(generation.shared());
    let ticket = match generate(&mut generation, admission, &answer).await {
        Ok(ticket) => ticket,
        Err(Failed::Refused(refusal)) => {
            return server::error(&shared, &admission::refused(&shared, refusal))
        }
        Err(Failed::Error(error)) => return server::error(&shared, &error),
    };
    // A prefill leg keeps its blocks for the decode leg, and says where (NIXL), or keeps
    // them under the router's transfer id (Mooncake; without one, vLLM keeps nothing).
    if let (Some(transfer), Some(TransferAsk::RemoteDecode { transfer_id })) =
        (&shared.kv_transfer, &answer.request.kv_transfer)
    {
        let lost = faults.kv_transfer_lost > 0.0 && rand::random::<f64>() < faults.kv_transfer_lost;
        match (transfer.config().connector, transfer_id) {
            (Connector::Nixl, _) => {
                answer.kv_transfer_params = Some(transfer.lend(
                    &answer.id,
                    answer.prompt_tokens(),
                    answer.cached_tokens(),
                    shared.config.block_size,
                    lost,
                ));
            }
            (Connector::Mooncake, Some(transfer_id)) => transfer.keep_for_pull(
                transfer_id,
                answer.prompt_tokens(),
                shared.config.block_size,
                lost,
            ),
            (Connector::Mooncake, None) => {
                tracing::warn!("Missing transfer_id in kv_transfer_params from router!");
            }
        }
    }
    let body = match &answer.wire {
        Wire::OpenAi => answer.full_body(),
        Wire::Anthropic => super::messages::message_body(&answer),
        Wire::Responses(echo) => {
            super::responses_api::response_body(&answer, echo, shared.responses.as_ref())
        }
    };
    generation.finish(answer.finish());
    // The blocks are freed after the request is counted as finished, as the stream does.
    drop(ticket);
    if faults.affects_streams() {
        return injected::truncated_body(&shared, body, &faults);
    }
    server::json(200, body)
}

/// Why an answer was not generated.
enum Failed {
    Refused(Refusal),
    /// A decode leg could not read its prompt's blocks.
    Error(ApiError),
}

impl From<Refusal> for Failed {
    fn from(refusal: Refusal) -> Self {
        Failed::Refused(refusal)
    }
}

/// Wait for a turn, prefill, then every step (or, with zero latency, all tokens at once).
async fn generate(
    generation: &mut Generation,
    admission: Admission,
    answer: &Answer,
) -> Result<Ticket, Failed> {
    let mut ticket = admission::wait_for_turn(admission).await?;
    generation.admitted(&ticket);
    let prompt_tokens = u64::from(answer.prompt_tokens());
    admission::hold(&mut ticket, prompt_tokens, generation).await?;
    generation.count_prompt(prompt_tokens);
    generation
        .prefill_prompt(answer)
        .await
        .map_err(Failed::Error)?;
    if generation.is_zero_latency() {
        let all = u64::from(answer.completion_tokens());
        admission::hold(&mut ticket, prompt_tokens + all, generation).await?;
        generation.step(all);
        return Ok(ticket);
    }
    let mut held = prompt_tokens;
    for step in 0..answer.steps() {
        if step > 0 {
            generation.next_token().await;
        }
        let tokens = answer.tokens_at(step);
        held += tokens;
        admission::hold(&mut ticket, held, generation).await?;
        generation.step(tokens);
    }
    Ok(ticket)
}
