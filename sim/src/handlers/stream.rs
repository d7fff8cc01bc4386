//! Sending an answer as an SSE stream: headers at once (like vLLM), then each event as its own
//! chunk when its token is due. Chat streams start with a role chunk per choice; the finish
//! reason rides on a choice's last token chunk (before vLLM 0.32, chat sent a finish chunk of
//! its own after it).

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::admission;
use super::answer::{Answer, Sent, Wire};
use super::generation::Generation;
use super::injected::{self, BodySender, MidStream};
use super::{messages, responses_api};
use crate::engine::{Admission, Ticket};
use crate::faults::Faults;
use crate::openai::{self, ApiError, Kind};
use crate::server::{self, HttpResponse};
use crate::Shared;

/// Events a stream may have generated ahead of its reader: more than any answer here has.
const STREAM_QUEUE: usize = 1 << 16;

/// Start the stream; the events are produced by a task of their own.
pub fn respond(
    generation: Generation,
    admission: Admission,
    answer: Answer,
    faults: Arc<Faults>,
) -> HttpResponse {
    // vLLM's engine generates whatever the client reads (its output queue has no bound), and
    // frees the request's KV when it is done: so does this one. The answer's own length
    // bounds what waits here for a slow reader.
    let (body, receiver) = mpsc::channel(STREAM_QUEUE);
    let events = EventSender {
        shared: Arc::clone(generation.shared()),
        body,
        faults,
        sent: 0,
        failed: false,
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
    /// An injected error event ended the stream (vLLM counts the request as an error).
    failed: bool,
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
                self.failed = true;
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
    generation.admitted(&ticket);
    let prompt_tokens = u64::from(answer.prompt_tokens());
    if let Flow::Stop = hold(&mut events, &mut ticket, prompt_tokens, &generation).await {
        return;
    }
    generation.count_prompt(prompt_tokens);
    // A client that leaves stops the prefill, and gives up its turn when prefills are serial.
    match events
        .unless_client_gone(generation.prefill_prompt(&answer))
        .await
    {
        None => return,
        Some(Err(error)) => {
            generation.fail();
            events.error(&error).await;
            return;
        }
        Some(Ok(())) => {}
    }
    let mut numbered = responses_api::Events::default();
    let sent = match &answer.wire {
        Wire::OpenAi => send_tokens(&mut generation, &mut ticket, &answer, &mut events).await,
        Wire::Anthropic | Wire::Responses(_) => {
            send_text_events(
                &mut generation,
                &mut ticket,
                &answer,
                &mut events,
                &mut numbered,
            )
            .await
        }
    };
    if let Flow::Stop = sent {
        if events.failed {
            generation.fail();
        }
        return;
    }
    generation.finish(answer.finish());
    drop(ticket);
    let end: Vec<Bytes> = match &answer.wire {
        Wire::OpenAi => Vec::new(),
        Wire::Anthropic => messages::end_events(&answer).to_vec(),
        Wire::Responses(echo) => {
            let store = events.shared.responses.as_ref();
            numbered.end(&answer, echo, store)
        }
    };
    if !end.is_empty() {
        for event in end {
            if let Flow::Stop = events.send(event).await {
                return;
            }
        }
        return;
    }
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

/// Engine step `step`: waits for it (after the first), takes the blocks its tokens need
/// (`held` grows by them) and counts them.
async fn engine_step(
    generation: &mut Generation,
    ticket: &mut Ticket,
    answer: &Answer,
    events: &mut EventSender,
    step: usize,
    held: &mut u64,
) -> Flow {
    if step > 0
        && events
            .unless_client_gone(generation.next_token())
            .await
            .is_none()
    {
        return Flow::Stop;
    }
    let tokens = answer.tokens_at(step);
    *held += tokens;
    if let Flow::Stop = hold(events, ticket, *held, generation).await {
        return Flow::Stop;
    }
    generation.step(tokens);
    Flow::Continue
}

/// The stream of an API run as a chat (Anthropic's Messages, OpenAI's Responses): every
/// engine step as in [`send_tokens`], the API's start events with the first token, then a
/// text delta for each token that shows text.
async fn send_text_events(
    generation: &mut Generation,
    ticket: &mut Ticket,
    answer: &Answer,
    events: &mut EventSender,
    numbered: &mut responses_api::Events,
) -> Flow {
    let mut sent = 0;
    let mut held = u64::from(answer.prompt_tokens());
    for step in 0..answer.steps() {
        if let Flow::Stop = engine_step(generation, ticket, answer, events, step, &mut held).await {
            return Flow::Stop;
        }
        if step == 0 {
            let start = match &answer.wire {
                Wire::Responses(echo) => numbered.start(answer, echo),
                _ => messages::start_events(answer).to_vec(),
            };
            for event in start {
                if let Flow::Stop = events.send(event).await {
                    return Flow::Stop;
                }
            }
        }
        if let Some(text) = messages::text_at(answer, step, &mut sent).filter(|t| !t.is_empty()) {
            let delta = match &answer.wire {
                Wire::Responses(_) => numbered.delta(answer, text),
                _ => messages::delta_event(text),
            };
            if let Flow::Stop = events.send(delta).await {
                return Flow::Stop;
            }
        }
    }
    Flow::Continue
}

/// Every engine step: wait for the step, take its blocks, send its tokens.
async fn send_tokens(
    generation: &mut Generation,
    ticket: &mut Ticket,
    answer: &Answer,
    events: &mut EventSender,
) -> Flow {
    let mut sent = vec![Sent::default(); answer.choices.len()];
    // vLLM 0.32 puts the fingerprint on the last event; with usage, that is the usage chunk.
    let fingerprint_on = (answer.is_v0_32() && !answer.request.include_usage)
        .then(|| answer.last_token_event())
        .flatten();
    let mut held = u64::from(answer.prompt_tokens());
    for step in 0..answer.steps() {
        if let Flow::Stop = engine_step(generation, ticket, answer, events, step, &mut held).await {
            return Flow::Stop;
        }
        if step == 0 && answer.request.kind == Kind::Chat {
            // The role chunks come with the first token.
            for (index, _) in (0u32..).zip(&answer.choices) {
                if let Flow::Stop = events.send(answer.role_chunk(index)).await {
                    return Flow::Stop;
                }
            }
        }
        for ((index, plan), sent) in (0u32..).zip(&answer.choices).zip(sent.iter_mut()) {
            let fingerprint = fingerprint_on == Some((index, step));
            if let Some(event) = answer.token_event(index, step, sent, fingerprint) {
                if let Flow::Stop = events.send(event).await {
                    return Flow::Stop;
                }
            }
            // Before vLLM 0.32 a chat choice ended with a finish chunk of its own.
            let separate_finish = !answer.is_v0_32() && answer.request.kind == Kind::Chat;
            if separate_finish && step + 1 == plan.tokens.len() {
                if let Some(event) = answer.finish_chunk(index) {
                    if let Flow::Stop = events.send(event).await {
                        return Flow::Stop;
                    }
                }
            }
        }
    }
    Flow::Continue
}
