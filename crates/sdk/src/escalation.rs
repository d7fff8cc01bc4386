//! Escalation: how a request hook asks the core to try a cheaper pool first and to move the
//! request to another pool when that one cannot or should not answer.
//!
//! A hook that picks a first pool (the speculative selector's draft) also leaves an
//! [`Escalation`] in `RequestCtx::escalation`. The core then:
//! - sends the attempts to `ctx.pool`, with `upstream_body` instead of the client's body
//!   when set (e.g. with `logprobs` added);
//! - bounds their time to the response header by `first_byte_budget`;
//! - holds a non-stream answer for `check` before any byte of it reaches the client, and
//!   the start of a stream for `stream_check` (the hold-back window);
//! - and when an attempt fails before anything reached the client (connect failure, 5xx,
//!   429, no header within the budget, or `check` says so), moves the request to
//!   `target` with the client's own body, records the reason in `RequestCtx::escalated` and
//!   carries on there. Once bytes reached the client there is no way back: a broken stream
//!   ends with an SSE error event.

use crate::pool::Pool;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Where to go if the first pool fails, and how to judge its answers.
#[derive(Clone)]
pub struct Escalation {
    /// The pool the request moves to when the first pool fails or its answer is judged wanting.
    pub target: Arc<Pool>,
    /// The longest wait for the first pool's response header before escalating.
    pub first_byte_budget: Option<Duration>,
    /// The body to send to the first pool, when it differs from the client's.
    pub upstream_body: Option<Bytes>,
    /// Judges the first pool's whole non-stream 200 answer before it is sent.
    pub check: Option<Arc<dyn AnswerCheck>>,
    /// Judges the start of the first pool's 200 event stream before any of it is sent.
    pub stream_check: Option<Arc<dyn StreamCheck>>,
}

impl std::fmt::Debug for Escalation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Escalation")
            .field("target", &self.target.name)
            .field("first_byte_budget", &self.first_byte_budget)
            .field("check", &self.check.is_some())
            .field("stream_check", &self.stream_check.is_some())
            .finish_non_exhaustive()
    }
}

/// What a check decided about an answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Judgement {
    /// Send it; with `Some`, this body instead (e.g. with logprobs the client did not ask
    /// for removed).
    Keep(Option<Bytes>),
    /// Do not send it: escalate, for this reason (e.g. `low-confidence`).
    Escalate(&'static str),
}

/// Judges a whole non-stream answer (status 200) of the first pool.
pub trait AnswerCheck: Send + Sync {
    /// Decides on the first pool's whole body; the client gets nothing of it before this returns.
    fn judge(&self, body: &Bytes) -> Judgement;
}

/// Judges the start of an event stream: the hold-back window. The core keeps the first pool's
/// stream from the client and feeds its chunks to a fresh [`StreamJudge`] until it decides;
/// then either sends what it kept and streams on, or drops the stream and escalates.
pub trait StreamCheck: Send + Sync {
    /// A fresh judge for one stream; called once for each stream the core holds back.
    fn start(&self) -> Box<dyn StreamJudge>;
}

/// The judge of one stream's start (see [`StreamCheck`]).
pub trait StreamJudge: Send {
    /// Reads the next chunk; `Some` once enough was seen to decide.
    fn feed(&mut self, chunk: &[u8]) -> Option<Judgement>;
    /// Decides on what was seen so far: the stream ended, or its time or room ran out,
    /// before [`StreamJudge::feed`] decided.
    fn decide(&mut self) -> Judgement;
}

/// Why a request left its first pool, for `x-sluice-escalated` and metrics.
pub mod reason {
    /// No draft pool could take the request: none has a usable backend, or all shed its class.
    pub const DRAFT_UNAVAILABLE: &str = "draft-unavailable";
    /// The prompt plus output budget exceeds the draft pool's `max_model_len`.
    pub const PROMPT_TOO_LONG: &str = "prompt-too-long";
    /// The request needs what the draft pool's model lacks (see [`crate::pool::Capabilities`]).
    pub const UNSUPPORTED: &str = "unsupported";
    /// The client asked for the target tier (`x-sluice-tier: target`) and the config allows it.
    pub const FORCED: &str = "forced";
    /// The draft pool failed (an error status, a broken connection) before the client got a byte.
    pub const DRAFT_ERROR: &str = "draft-error";
    /// The draft pool's attempt timed out (see [`crate::Escalation::first_byte_budget`]).
    pub const DRAFT_TIMEOUT: &str = "draft-timeout";
    /// A check judged the draft's answer not good enough (its logprobs, say).
    pub const LOW_CONFIDENCE: &str = "low-confidence";
}
