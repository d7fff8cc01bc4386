//! Sending an answer as an SSE stream: headers at once (like vLLM), then each event as its own
//! chunk when its token is due. Chat streams go role chunk, content chunks, finish chunk;
//! completion streams put the finish reason on the last token's chunk.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::admission;
use super::answer::Answer;
use super::generation::Generation;
use super::injected::{self, BodySender, MidStream};
use crate::engine::{Admission, Ticket};
use crate::faults::Faults;
use crate::openai::{self, ApiError, Kind};
use crate::server::{self, HttpResponse};
use crate::text;
use crate::Shared;

/// Start the stream; the events are produced by a task of their own.
pub fn respond(
    generation: Generation,
    admission: Admission,
    answer: Answer,
    faults: Arc<Faults>,
) -> HttpResponse {
    let (body, receiver) = mpsc::channel(16);
    let events = EventSender {
        shared: Arc::clone(generation.shared()),
        body,
        faults,
        sent: 0,
    };
    tokio::spawn(run(generation, admission, answer, events));
    server::stream_response(
        200,
        "text/event-stream; charset=utf-8",
        server::channel_body(receiver),
    )
}

/// Whether the stream goes on after a send or a wait.
enum Flow {
    Continue,
    Stop,
}

/// Sends SSE events, applying the mid-stream faults.
struct EventSender {
    shared: Arc<Shared>,
    body: BodySender,
    faults: Arc<Faults>,
    sent: u32,
}

impl EventSender {
    async fn send(&mut self, event: Bytes) -> Flow {
        match injected::due_mid_stream(&self.faults, self.sent) {
            Some(MidStream::Hang) => {
                self.shared.stats.count_fault();
                tokio::select! {
                    _ = self.body.closed() => {}
                    _ = self.shared.shutdown_signal() => {}
                }
                return Flow::Stop;
            }
            Some(MidStream::Drop) => {
                self.shared.stats.count_fault();
                self.shared.stats.count_error();
                injected::flush_then_abort(&self.body, "sim: connection dropped mid-stream").await;
                return Flow::Stop;
            }
            Some(MidStream::Error) => {
                self.shared.stats.count_fault();
                self.error(&ApiError::new(500, "Internal Server Error"))
                    .await;
                return Flow::Stop;
            }
            None => {}
        }
        if self.body.send(Ok(event)).await.is_err() {
            return Flow::Stop;
        }
        self.sent += 1;
        Flow::Continue
    }

    /// An error inside the stream: the error event, then `[DONE]`.
    async fn error(&mut self, error: &ApiError) {
        self.shared.stats.count_error();
        let event = openai::stream_error_event(self.shared.config.error_shape, error);
        if self.body.send(Ok(Bytes::from(event))).await.is_ok() {
            let _ = self.body.send(Ok(Bytes::from_static(openai::DONE))).await;
        }
    }

    /// `work`'s result, or `None` if the client went away first.
    async fn unless_client_gone<T>(&self, work: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            done = work => Some(done),
            _ = self.body.closed() => None,
        }
    }

    /// Sleep, but stop early if the client went away.
    async fn sleep(&self, duration: Duration) -> Flow {
        if duration.is_zero() {
            return Flow::Continue;
        }
        match self.unless_client_gone(tokio::time::sleep(duration)).await {
            Some(()) => Flow::Continue,
            None => Flow::Stop,
        }
    }
}

async fn run(
    mut generation: Generation,
    admission: Admission,
    answer: Answer,
    mut events: EventSender,
) {
    let Some(mut ticket) = admit(&mut events, admission).await else {
        return;
    };
    let prompt_tokens = u64::from(answer.prompt_tokens());
    if let Flow::Stop = hold(&mut events, &mut ticket, prompt_tokens, &generation).await {
        return;
    }
    generation.count_prompt(prompt_tokens);
    // A client that leaves stops the prefill, and gives up its turn when prefills are serial.
    if events
        .unless_client_gone(generation.prefill(answer.prompt_tokens()))
        .await
        .is_none()
    {
        return;
    }
    if let Flow::Stop = send_tokens(&mut generation, &mut ticket, &answer, &mut events).await {
        return;
    }
    generation.finish(answer.finish());
    drop(ticket);
    if answer.request.include_usage {
        if let Flow::Stop = events.send(answer.usage_chunk()).await {
            return;
        }
    }
    let _ = events.send(Bytes::from_static(openai::DONE)).await;
}

/// Wait for the request's turn; a refusal becomes an error event.
async fn admit(events: &mut EventSender, admission: Admission) -> Option<Ticket> {
    match events
        .unless_client_gone(admission::wait_for_turn(admission))
        .await
    {
        Some(Ok(ticket)) => Some(ticket),
        Some(Err(refusal)) => {
            let error = admission::refused(&events.shared, refusal);
            events.error(&error).await;
            None
        }
        None => None,
    }
}

/// Hold `tokens` in the KV cache (waiting out a preemption); a refusal becomes an error event.
async fn hold(
    events: &mut EventSender,
    ticket: &mut Ticket,
    tokens: u64,
    generation: &Generation,
) -> Flow {
    match events
        .unless_client_gone(admission::hold(ticket, tokens, generation))
        .await
    {
        Some(Ok(())) => Flow::Continue,
        Some(Err(refusal)) => {
            let error = admission::refused(&events.shared, refusal);
            events.error(&error).await;
            Flow::Stop
        }
        None => Flow::Stop,
    }
}

/// Every engine step: wait for the step, take its blocks, send its tokens.
async fn send_tokens(
    generation: &mut Generation,
    ticket: &mut Ticket,
    answer: &Answer,
    events: &mut EventSender,
) -> Flow {
    let mut offsets = vec![0u32; answer.choices.len()];
    let mut held = u64::from(answer.prompt_tokens());
    for step in 0..answer.steps() {
        if step > 0 {
            if let Flow::Stop = events.sleep(generation.inter_token_delay()).await {
                return Flow::Stop;
            }
        }
        let tokens = answer.tokens_at(step);
        held += tokens;
        if let Flow::Stop = hold(events, ticket, held, generation).await {
            return Flow::Stop;
        }
        generation.step(tokens);
        let sent = match answer.request.kind {
            Kind::Chat => send_chat_step(answer, step, events).await,
            Kind::Completion => send_text_step(answer, step, &mut offsets, events).await,
        };
        if let Flow::Stop = sent {
            return Flow::Stop;
        }
    }
    Flow::Continue
}

/// Chat: the role chunks come with the first token; a finish chunk follows each choice's
/// last token.
async fn send_chat_step(answer: &Answer, step: usize, events: &mut EventSender) -> Flow {
    if step == 0 {
        for (index, _) in (0u32..).zip(&answer.choices) {
            if let Flow::Stop = events.send(answer.role_chunk(index)).await {
                return Flow::Stop;
            }
        }
    }
    for (index, plan) in (0u32..).zip(&answer.choices) {
        let (Some(&token), Some(&logprob)) = (plan.tokens.get(step), plan.logprobs.get(step))
        else {
            continue;
        };
        if let Flow::Stop = events
            .send(answer.content_chunk(index, token, logprob))
            .await
        {
            return Flow::Stop;
        }
        if step + 1 == plan.tokens.len() {
            if let Flow::Stop = events.send(answer.finish_chunk(index, plan.finish)).await {
                return Flow::Stop;
            }
        }
    }
    Flow::Continue
}

/// Completions: one chunk per choice's token, the last one with the finish reason.
async fn send_text_step(
    answer: &Answer,
    step: usize,
    offsets: &mut [u32],
    events: &mut EventSender,
) -> Flow {
    for ((index, plan), offset) in (0u32..).zip(&answer.choices).zip(offsets.iter_mut()) {
        let (Some(&token), Some(&logprob)) = (plan.tokens.get(step), plan.logprobs.get(step))
        else {
            continue;
        };
        let last = step + 1 == plan.tokens.len();
        let chunk = answer.text_chunk(index, *offset, token, logprob, last.then_some(plan.finish));
        *offset += text::token_str(token).len() as u32;
        if let Flow::Stop = events.send(chunk).await {
            return Flow::Stop;
        }
    }
    Flow::Continue
}
