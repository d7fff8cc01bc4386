//! One upstream attempt of an LLM request: the request sent to one backend over a
//! connection from Pingora's connector (HTTP/1 framing, timeouts, TLS), kept idle between
//! requests in the path's own pool ([`super::upstream_pool`]), and the answer piped to the
//! client.
//!
//! Why not Pingora's own proxy loop: the client request has read its whole body (the cache
//! key needs it), and Pingora replays a body that was read only from its 64 KiB retry buffer.
//! Here every attempt, the first or a fallback, sends the full body, whatever its size, as
//! the one reference-counted buffer it already is. And the pipe must (a) decide before the
//! first byte reaches the client whether to try elsewhere, (b) run the plugins' response
//! hooks, (c) end a broken stream with an SSE error event, and (d) notice a client that
//! leaves while the upstream is still silent.
//!
//! An earlier version ran each attempt as a Pingora subrequest; that ran a second request
//! pipeline (and held a third session) per request, which cost a third of the throughput.

use super::downstream::{forward, frame_by_length, prepare_upstream_header, write_whole, Answer};
use super::upstream_pool::UpstreamPool;
use super::{tries, usage};
use crate::chain::Chain;
use bytes::Bytes;
use pingora_core::connectors::http::v1::Connector;
use pingora_core::protocols::http::v1::client::{http_req_header_to_wire, HttpSession};
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_error::{Error, ErrorType, OrErr, Result, RetryType};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use sluice_sdk::client::session::watch;
use sluice_sdk::client::Watched;
use sluice_sdk::context;
use sluice_sdk::escalation::reason;
use sluice_sdk::headers::is_event_stream;
use sluice_sdk::AttemptOutcome;
use sluice_sdk::{
    AnswerCheck, Endpoint, ErrorReply, Held, InFlight, Judgement, MemoryBudget, Reason, RequestCtx,
    StreamCheck, StreamJudge, Usage, Verdict,
};
use std::future::Future;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

/// What an attempt uses of the running generation: the upstream connections, the memory
/// budget held answers count against, the end of the grace period, and the chain's
/// response hooks. Nothing else of it: an attempt does not route, choose or judge.
pub struct Upstreams<'a> {
    pub connector: &'a Connector,
    pub pool: &'a Arc<UpstreamPool>,
    pub memory: &'a Arc<MemoryBudget>,
    pub streams_end: &'a tokio::sync::watch::Receiver<bool>,
    pub chain: &'a Chain,
}

impl<'a> Upstreams<'a> {
    /// An attempt's connection, once its request is sent: `reused` when it came from the
    /// connection pool; `in_flight` its load on the backend.
    fn connection<'p>(
        &self,
        peer: &'p HttpPeer,
        http: HttpSession,
        reused: bool,
        in_flight: InFlight,
        span: &'p tracing::Span,
    ) -> Upstream<'p>
    where
        'a: 'p,
    {
        Upstream {
            pool: self.pool,
            peer,
            http,
            reused,
            in_flight,
            streams_end: self.streams_end.clone(),
            span,
        }
    }
}

/// What an attempt sends: where to connect, and the exact request.
pub struct Attempt {
    pub peer: HttpPeer,
    pub header: RequestHeader,
    pub body: Bytes,
    /// The attempt's load on its backend: ends as soon as the backend has sent its whole
    /// answer, even while the client is still being written to.
    pub in_flight: InFlight,
    /// When the request's body was read whole, on a request's first attempt: once the
    /// request is written, Sluice's own time in between is recorded (`metrics::ADDED`).
    pub received: Option<std::time::Instant>,
}

/// How an attempt ended.
pub enum Outcome {
    /// The response went to the client, whole.
    Complete,
    /// Nothing reached the client: another attempt may be made.
    NotStarted(Box<Error>),
    /// The response had started and then failed; it was ended as cleanly as the format
    /// allows (an SSE error event), or cut. Nothing more can be sent.
    Broken(Box<Error>),
    /// The client went away.
    ClientGone(Box<Error>),
    /// The upstream answered with an error status (5xx, 429) that was held back because
    /// another attempt may follow; nothing was sent. The answer is kept, bounded, in case
    /// none does.
    Declined(Box<ResponseHeader>, Bytes),
    /// The answer was held for a check that rejected it, for this reason; nothing was sent.
    /// What it used, when known: the engine generated it all the same (N22).
    Judged(&'static str, Option<Usage>),
}

impl Outcome {
    /// What the attempt says about its backend (passive health), given the status it
    /// answered with: nothing when the client left.
    pub fn verdict(&self, upstream_status: Option<u16>) -> Option<Verdict> {
        match self {
            Outcome::Complete if upstream_status.is_some_and(|s| s >= 500) => {
                Some(Verdict::Failure)
            }
            // A backend asking for a pause (Retry-After) is load, not a fault.
            Outcome::Declined(header, _) if tries::back_pressure(header).is_some() => None,
            Outcome::Declined(header, _) if header.status.is_server_error() => {
                Some(Verdict::Failure)
            }
            Outcome::Complete | Outcome::Declined(..) | Outcome::Judged(..) => {
                Some(Verdict::Success)
            }
            // A refusal of Sluice's own (an answer too large to hold, the memory budget) says
            // nothing about the backend.
            Outcome::NotStarted(e) if ErrorReply::carried_by(e).is_some() => None,
            Outcome::NotStarted(_) | Outcome::Broken(_) => Some(Verdict::Failure),
            Outcome::ClientGone(_) => None,
        }
    }

    /// How the attempt ended, as its observers are told.
    pub fn outcome(&self) -> AttemptOutcome {
        match self {
            Outcome::Complete => AttemptOutcome::Response,
            Outcome::NotStarted(e) if is_timeout(e) => AttemptOutcome::Timeout,
            Outcome::NotStarted(e) if is_connect_failure(e) => AttemptOutcome::ConnectError,
            Outcome::NotStarted(_) => AttemptOutcome::Error,
            Outcome::Declined(..) => AttemptOutcome::Declined,
            Outcome::Judged(..) => AttemptOutcome::RejectedAnswer,
            Outcome::Broken(_) => AttemptOutcome::Broken,
            Outcome::ClientGone(_) => AttemptOutcome::ClientGone,
        }
    }
}

/// No connection could be made: nothing was sent, so another backend is safe to try.
pub fn is_connect_failure(e: &Error) -> bool {
    use ErrorType::*;
    matches!(
        e.etype(),
        ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError
    )
}

pub fn is_timeout(e: &Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::ReadTimedout | ErrorType::ConnectTimedout
    )
}

/// What an attempt holds back before the client sees it.
pub struct Hold {
    /// Error statuses (5xx, 429) are not sent: another attempt may follow.
    pub error_statuses: bool,
    /// A non-stream 200 answer is read whole and judged first.
    pub check: Option<Arc<dyn AnswerCheck>>,
    /// A 200 event stream is kept back until this judges its start (the hold-back window).
    pub stream_check: Option<Arc<dyn StreamCheck>>,
    /// Another pool may take the request if this one's context is too small for it: a 400
    /// refusing it for the context length is held, and so is a non-stream 200 answer, which
    /// is judged cut by the context when it stops for `length` short of this many tokens
    /// (the client's budget for all its choices; see `sluice_sdk::context`).
    pub context_budget: Option<u64>,
}

/// The most of a held answer kept in memory: a larger one fails the attempt (a hold-back
/// window is judged on what it kept instead).
const MAX_HELD_BYTES: usize = 4 << 20;

/// The deadlines of one attempt.
pub struct Deadlines {
    /// Never after `total`.
    pub first_byte: Instant,
    pub total: Instant,
}

/// The connection of one attempt.
struct Upstream<'a> {
    pool: &'a Arc<UpstreamPool>,
    peer: &'a HttpPeer,
    http: HttpSession,
    /// Taken from the connection pool: an error on it may be a connection the backend had
    /// already closed.
    reused: bool,
    /// The attempt's load on the backend, until its answer has come whole or it ends.
    in_flight: InFlight,
    /// Turns `true` when the server's grace period is ending.
    streams_end: tokio::sync::watch::Receiver<bool>,
    /// The attempt's trace span.
    span: &'a tracing::Span,
}

impl<'a> Upstream<'a> {
    /// Gives a connection whose response was read whole back to the pool, and ends the
    /// attempt's load on the backend. Every other end of an attempt drops it instead, which
    /// closes it: a backend that is still generating sees its client leave and stops.
    /// The load ends at the call; the future holds only the connection's reuse (see
    /// [`run`] for why these are not `async fn`s).
    fn release(self) -> impl Future<Output = ()> + 'a {
        let Upstream {
            pool,
            peer,
            mut http,
            in_flight,
            ..
        } = self;
        drop(in_flight);
        http.respect_keepalive();
        let reusing = http.reuse();
        async move {
            if let Some(stream) = reusing.await {
                pool.keep(peer.reuse_hash(), stream, peer.options.idle_timeout);
            }
        }
    }

    /// An error of this connection once the answer has started, made final: the model is
    /// generating, so the request is not sent again on another connection.
    fn failed(&self, e: Box<Error>) -> Box<Error> {
        final_error(e, self.reused)
    }

    /// An error of this connection before any byte of the answer came: the backend closed
    /// it (on a connection taken from the pool, the keep-alive race) or died with it. No
    /// answer was made, and a backend that dropped the connection is no longer working on
    /// the request (vLLM aborts a request whose client is gone), so it is sent again
    /// elsewhere, as nginx's `proxy_next_upstream error` does: a backend killed under load
    /// cost clients 502s. A timeout is final: the backend may still be generating.
    fn failed_before_answer(mut e: Box<Error>) -> Box<Error> {
        let timed_out = matches!(
            e.etype(),
            ErrorType::ReadTimedout | ErrorType::WriteTimedout
        );
        e.set_retry(!timed_out);
        e.into_up()
    }
}

/// An upstream error made final: not sent again (see [`Upstream::failed`]).
fn final_error(mut e: Box<Error>, reused: bool) -> Box<Error> {
    e.retry.decide_reuse(reused);
    e.set_retry(false);
    e.into_up()
}

/// Sends `attempt` and pipes the answer to the client.
///
/// `span` is the attempt's: its events (`first_token`) name it as their parent. The
/// attempt's future is not instrumented with it: entering and leaving a span at each poll of
/// a stream cost more than the rest of its tracing.
///
/// This and the steps a stream stays in to its end (`pipe`, `stream`, `complete`,
/// `Upstream::release`) are plain functions returning an `async move` block, not `async
/// fn`s: an `async fn` keeps each argument it takes by value twice in its future
/// (rust-lang/rust#62958), and these futures, nested, live inside every open stream's task
/// for as long as it streams (bench scenario 4, memory per open stream).
#[allow(clippy::too_many_arguments)]
pub fn run<'a>(
    upstreams: &'a Upstreams<'a>,
    session: &'a mut Session,
    ctx: &'a mut RequestCtx,
    answer: &'a mut Answer,
    attempt: Attempt,
    deadlines: Deadlines,
    hold: &'a Hold,
    span: &'a tracing::Span,
) -> impl Future<Output = Outcome> + 'a {
    let Attempt {
        peer,
        header,
        body,
        in_flight,
        received,
    } = attempt;
    async move {
        let (http, reused, header) = match exchange(
            upstreams, session, &peer, &header, body, &deadlines, received,
        )
        .await
        {
            Ok(exchanged) => exchanged,
            Err(outcome) => return outcome,
        };
        let upstream = upstreams.connection(&peer, http, reused, in_flight, span);
        pipe(
            upstreams, session, ctx, answer, upstream, header, deadlines, hold,
        )
        .await
    }
}

/// Sends a request no client sees (a disaggregated request's prefill leg) and reads its
/// answer whole: its status and body, or the outcome that ended it (`NotStarted` for a
/// connect, send or read failure, a timeout or an answer too large; `ClientGone` when the
/// client left meanwhile, which drops the connection so that the engine stops). Its load
/// on the backend ends when the answer has come.
pub async fn fetch(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    attempt: Attempt,
    deadlines: Deadlines,
    span: &tracing::Span,
) -> Result<(u16, Bytes), Outcome> {
    let Attempt {
        peer,
        header,
        body,
        in_flight,
        received: _,
    } = attempt;
    let (http, reused, header) =
        exchange(upstreams, session, &peer, &header, body, &deadlines, None).await?;
    let mut up = upstreams.connection(&peer, http, reused, in_flight, span);
    let body = read_held(session, &mut up, &deadlines, upstreams.memory).await?;
    up.release().await;
    Ok((header.status.as_u16(), body))
}

/// Sends the request to `peer` and reads the answer's header, both within the first-byte
/// deadline and while watching the client: the connection, whether it was reused, and the
/// header. Nothing reached the client when it fails, so another attempt may be made (`llm`).
///
/// A pooled connection is tried first. When it is found closed before any byte of the answer
/// (the backend closed it as the request went out: uvicorn closes a connection idle for 5 s,
/// and a loaded server does it late), the request is sent once more on a new connection to
/// the same backend, which never read it: as Pingora (`RetryType::ReusedOnly`) and nginx (a
/// cached connection's failure is not counted as a try) do. Without it, a pool of one
/// backend answered 502. A timeout, a malformed answer or a TLS error is not sent again here.
async fn exchange(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    peer: &HttpPeer,
    header: &RequestHeader,
    body: Bytes,
    deadlines: &Deadlines,
    mut received: Option<std::time::Instant>,
) -> Result<(HttpSession, bool, Box<ResponseHeader>), Outcome> {
    let Some(request) = Wire::new(header, body) else {
        let e = Error::explain(
            ErrorType::InvalidHTTPHeader,
            "the request line holds a forbidden byte",
        );
        return Err(Outcome::NotStarted(e.into_up()));
    };
    let mut pooled = upstreams.pool.take(peer);
    loop {
        let reused = pooled.is_some();
        let http = match pooled.take() {
            Some(stream) => HttpSession::new_with_options(stream, peer),
            None => connect(upstreams, session, peer, deadlines).await?,
        };
        let sent = watch(session, send(http, peer, &request), deadlines.first_byte).await;
        let closed = matches!(&sent, Watched::Done(Err(e)) if closed_under_request(e));
        let sent = not_started(
            sent,
            "the request was not sent in time",
            Upstream::failed_before_answer,
        );
        let read = match sent {
            Ok(mut http) => {
                if let Some(received) = received.take() {
                    crate::metrics::added_request(received);
                }
                read_header(session, &mut http, reused, deadlines.first_byte)
                    .await
                    .map(|header| (http, reused, header))
            }
            Err(outcome) => Err((outcome, closed)),
        };
        match read {
            Err((Outcome::NotStarted(e), true)) if reused => {
                tracing::debug!("a pooled connection was closed under the request: {e}");
                crate::metrics::stale_connection();
            }
            read => return read.map_err(|(outcome, _)| outcome),
        }
    }
}

/// Whether an error before any byte of the answer is a connection found closed under the
/// request: closed or reset by the backend as it was read (Pingora marks those
/// `ReusedOnly`), or as it was written. Not an answer that came malformed, nor a timeout.
fn closed_under_request(e: &Error) -> bool {
    matches!(e.retry, RetryType::ReusedOnly) || e.etype() == &ErrorType::WriteError
}

/// A new connection to `peer`, within the first-byte deadline and while watching the client.
async fn connect(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    peer: &HttpPeer,
    deadlines: &Deadlines,
) -> Result<HttpSession, Outcome> {
    // Boxed: with its TLS handshake the connect future is 18 KB. Inline, it would size the
    // request's whole future, which every open stream holds to its end and which is moved
    // (copied) as it is boxed.
    let connecting = Box::pin(upstreams.connector.get_http_session(peer));
    let connected = watch(session, connecting, deadlines.first_byte).await;
    let (http, _) = not_started(connected, "no connection in time", |mut e| {
        e.retry.decide_reuse(false);
        e.into_up()
    })?;
    Ok(http)
}

/// The largest body sent in one write with its header: a copy this size costs less than the
/// second system call it saves; a larger body is written on its own.
const ONE_WRITE_BODY: usize = 64 * 1024;

/// A request as it goes on the wire, made once and written as often as it is sent: its
/// header's bytes (with the body after them when the body is small), and the body when it
/// is written on its own.
struct Wire {
    head: Bytes,
    body: Bytes,
}

impl Wire {
    /// `None` when the request line holds a byte HTTP/1 forbids.
    fn new(header: &RequestHeader, body: Bytes) -> Option<Wire> {
        let mut head = http_req_header_to_wire(header)?;
        if body.len() > ONE_WRITE_BODY {
            return Some(Wire {
                head: head.freeze(),
                body,
            });
        }
        head.extend_from_slice(&body);
        Some(Wire {
            head: head.freeze(),
            body: Bytes::new(),
        })
    }
}

/// Writes the whole request (its header frames the body by its length). Pingora's session
/// writes and flushes the header, then writes the body: two system calls and two packets for
/// one small request, where nginx makes one. Here a request with a body of at most
/// [`ONE_WRITE_BODY`] bytes goes in one write, and the session is made anew over the
/// connection, as the connector makes one at each reuse. The new session keeps no copy of the
/// request, which Pingora reads only for `HEAD`, upgrades and `Connection: close`: an LLM
/// request is none of them (a `POST`, its hop-by-hop headers removed).
async fn send(http: HttpSession, peer: &HttpPeer, request: &Wire) -> Result<HttpSession> {
    let mut stream = http.into_inner();
    for part in [&request.head, &request.body] {
        if !part.is_empty() {
            stream
                .write_all(part)
                .await
                .or_err(ErrorType::WriteError, "while writing the request")?;
        }
    }
    stream
        .flush()
        .await
        .or_err(ErrorType::WriteError, "while flushing the request")?;
    Ok(HttpSession::new_with_options(stream, peer))
}

/// The answer of a sent request, its header read: held whole (an error that may be
/// declined, an answer to judge), or streamed to the client (after a hold-back window when
/// one is asked for).
// Not an `async fn`: see `run`.
#[allow(clippy::too_many_arguments, clippy::manual_async_fn)]
fn pipe<'a>(
    upstreams: &'a Upstreams<'a>,
    session: &'a mut Session,
    ctx: &'a mut RequestCtx,
    answer: &'a mut Answer,
    mut up: Upstream<'a>,
    header: Box<ResponseHeader>,
    deadlines: Deadlines,
    hold: &'a Hold,
) -> impl Future<Output = Outcome> + 'a {
    async move {
        tries::honour_back_pressure(ctx, up.in_flight.backend(), &header);
        let is_sse = is_event_stream(&header);
        let status = header.status.as_u16();
        let held = HeldFor {
            declined: hold.error_statuses && (status >= 500 || status == 429),
            refused_for_context: status == 400 && hold.context_budget.is_some(),
            judged: status == 200
                && !is_sse
                && (hold.check.is_some() || hold.context_budget.is_some()),
        };
        if held.declined || held.judged || held.refused_for_context {
            // Boxed: rare (an error status, an answer judged whole), and inline its future
            // would make every stream's larger.
            return Box::pin(answer_held(
                upstreams, session, ctx, answer, up, header, &deadlines, hold, held,
            ))
            .await;
        }
        // The hold-back window: the stream's start is kept until it is judged, so that a
        // rejected draft can still give way to the target.
        let mut window = Window {
            chunks: Vec::new(),
            ended: false,
            held: upstreams.memory.none(),
        };
        if let (true, 200, Some(check)) = (is_sse, status, hold.stream_check.as_ref()) {
            window = match hold_back(
                session,
                &mut up,
                &deadlines,
                check.start(),
                upstreams.memory,
            )
            .await
            {
                Ok(window) => window,
                // The window's events were generated: one token each, after the whole prompt.
                Err(Outcome::Judged(why, Some(seen))) => {
                    let prompt_tokens = ctx.llm().map_or(0, |call| call.demand.prompt_tokens);
                    let used = Usage {
                        prompt_tokens,
                        ..seen
                    };
                    return Outcome::Judged(why, Some(used));
                }
                Err(outcome) => return outcome,
            };
        }
        if let Err(outcome) = start_answer(upstreams, session, ctx, answer, header).await {
            return outcome;
        }
        stream(
            upstreams, session, ctx, answer, up, window, &deadlines, is_sse,
        )
        .await
    }
}

/// Why an answer is read whole before the client sees any of it.
#[derive(Clone, Copy)]
struct HeldFor {
    /// An error status another attempt may replace.
    declined: bool,
    /// A 400 that may be the context-length refusal another pool would not give.
    refused_for_context: bool,
    /// A 200 answer to judge (a check, or the context's cut).
    judged: bool,
}

/// An answer read whole first: declined, judged, or sent as it is (or as the check
/// replaced it).
#[allow(clippy::too_many_arguments)]
async fn answer_held(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    mut up: Upstream<'_>,
    mut header: Box<ResponseHeader>,
    deadlines: &Deadlines,
    hold: &Hold,
    held: HeldFor,
) -> Outcome {
    let body = match read_held(session, &mut up, deadlines, upstreams.memory).await {
        Ok(body) => body,
        Err(outcome) => return outcome,
    };
    // Sluice's own time for the answer counts from here (`metrics::ADDED`): the judging
    // and the write.
    let read = std::time::Instant::now();
    up.release().await;
    if held.declined {
        return Outcome::Declined(header, body);
    }
    if held.refused_for_context {
        if context::is_context_length_error(&body) {
            // A refusal: nothing was generated.
            return Outcome::Judged(reason::PROMPT_TOO_LONG, None);
        }
        let outcome = send_answer(upstreams, session, ctx, answer, header, Some(body)).await;
        crate::metrics::added_chunk(read);
        return outcome;
    }
    let cut = hold
        .context_budget
        .is_some_and(|budget| context::cut_by_context(&body, budget));
    if cut {
        return Outcome::Judged(reason::PROMPT_TOO_LONG, answer_usage(ctx, &body));
    }
    let body = match hold.check.as_ref().map(|c| c.judge(&body)) {
        Some(Judgement::Escalate(reason)) => {
            return Outcome::Judged(reason, answer_usage(ctx, &body))
        }
        Some(Judgement::Keep(Some(replaced))) => {
            if let Err(e) = frame_by_length(&mut header, replaced.len()) {
                return Outcome::NotStarted(e);
            }
            replaced
        }
        Some(Judgement::Keep(None)) | None => body,
    };
    let outcome = send_answer(upstreams, session, ctx, answer, header, Some(body)).await;
    crate::metrics::added_chunk(read);
    outcome
}

/// The rest of a started answer, chunk by chunk as it comes: a kept window first; the end,
/// a failure (an SSE error event ends a stream) or the total deadline.
// Not an `async fn`: see `run`.
#[allow(clippy::too_many_arguments, clippy::manual_async_fn)]
fn stream<'a>(
    upstreams: &'a Upstreams<'a>,
    session: &'a mut Session,
    ctx: &'a mut RequestCtx,
    answer: &'a mut Answer,
    mut up: Upstream<'a>,
    window: Window,
    deadlines: &'a Deadlines,
    is_sse: bool,
) -> impl Future<Output = Outcome> + 'a {
    async move {
        // A kept window goes first; a stream that ended within it ends here.
        let Window {
            chunks,
            ended,
            held,
            ..
        } = window;
        for chunk in chunks {
            if let Err(e) = forward(upstreams.chain, session, ctx, answer, Some(chunk), false).await
            {
                return Outcome::ClientGone(e);
            }
        }
        drop(held);
        if ended {
            return complete(upstreams, session, ctx, answer, up, None).await;
        }
        loop {
            match next(session, &mut up, deadlines.total).await {
                Next::Chunk(data) => {
                    let read = std::time::Instant::now();
                    // The chunk that completes the body ends the response at once: the client may
                    // send its next request meanwhile, which the client watch in `next` would read.
                    if up.http.is_body_done() {
                        let outcome =
                            complete(upstreams, session, ctx, answer, up, Some(data)).await;
                        crate::metrics::added_chunk(read);
                        return outcome;
                    }
                    if let Err(e) =
                        forward(upstreams.chain, session, ctx, answer, Some(data), false).await
                    {
                        ctx.progress_mut().response_incomplete = true;
                        return Outcome::ClientGone(e);
                    }
                    crate::metrics::added_chunk(read);
                }
                Next::End => return complete(upstreams, session, ctx, answer, up, None).await,
                Next::Failed(e) => return broken(upstreams, session, ctx, answer, is_sse, e).await,
                Next::Deadline => {
                    let e = timed_out("the total timeout ran out mid-response");
                    return broken(upstreams, session, ctx, answer, is_sse, e).await;
                }
                Next::ClientGone(e) => {
                    ctx.progress_mut().response_incomplete = true;
                    return Outcome::ClientGone(e);
                }
            }
        }
    }
}

/// Reads the response header, past any informational (1xx) ones, before `deadline`. When it
/// fails: its outcome, and whether the connection was found closed before any byte of it
/// (see [`closed_under_request`]).
async fn read_header(
    session: &mut Session,
    http: &mut HttpSession,
    reused: bool,
    deadline: Instant,
) -> Result<Box<ResponseHeader>, (Outcome, bool)> {
    let mut first = true;
    loop {
        let read = watch(session, http.read_response(), deadline).await;
        let closed = first && matches!(&read, Watched::Done(Err(e)) if closed_under_request(e));
        first = false;
        not_started(
            read,
            "no response header before the first-byte timeout",
            Upstream::failed_before_answer,
        )
        .map_err(|outcome| (outcome, closed))?;
        match http.resp_header() {
            Some(header) if header.status.is_informational() => continue,
            Some(header) => return Ok(Box::new(header.clone())),
            None => {
                let e = Error::explain(ErrorType::InvalidHTTPHeader, "no response header");
                return Err((Outcome::NotStarted(final_error(e, reused)), false));
            }
        }
    }
}

/// Writes the client's response header, after the plugins' hooks.
async fn start_answer(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    mut header: Box<ResponseHeader>,
) -> Result<(), Outcome> {
    if let Err(e) = prepare_upstream_header(upstreams.chain, &mut header, ctx, None, Some(answer)) {
        return Err(Outcome::NotStarted(e));
    }
    session
        .write_response_header(header, false)
        .await
        .map_err(Outcome::ClientGone)
}

/// Sends a whole answer that was held.
async fn send_answer(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    header: Box<ResponseHeader>,
    body: Option<Bytes>,
) -> Outcome {
    if let Err(outcome) = start_answer(upstreams, session, ctx, answer, header).await {
        return outcome;
    }
    finish(upstreams, session, ctx, answer, body).await
}

/// Ends a streamed attempt whose answer came whole, `last` its last chunk: the connection
/// goes back to the pool at once, then the rest reaches the client. The first token's time
/// then teaches the backend's prefill speed with what the engine says it computed (its
/// usage, read as the answer passed).
fn complete<'a>(
    upstreams: &'a Upstreams<'a>,
    session: &'a mut Session,
    ctx: &'a mut RequestCtx,
    answer: &'a mut Answer,
    mut up: Upstream<'a>,
    last: Option<Bytes>,
) -> impl Future<Output = Outcome> + 'a {
    let sample = up.in_flight.take_speed_sample();
    let release = up.release();
    async move {
        release.await;
        let outcome = finish(upstreams, session, ctx, answer, last).await;
        if let Some(sample) = sample {
            sample.learn(usage::engine_computed(ctx, answer.usage()));
        }
        outcome
    }
}

/// Writes the last chunk of an answer, if any, and ends it.
async fn finish(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    last: Option<Bytes>,
) -> Outcome {
    match forward(upstreams.chain, session, ctx, answer, last, true).await {
        Ok(()) => Outcome::Complete,
        Err(e) => Outcome::ClientGone(e),
    }
}

/// The outcome of a step taken before anything reached the client, when it did not
/// succeed: another attempt may follow. `failed` makes the step's error final.
fn not_started<T>(
    watched: Watched<Result<T>>,
    late: &'static str,
    failed: impl FnOnce(Box<Error>) -> Box<Error>,
) -> Result<T, Outcome> {
    match watched {
        Watched::Done(Ok(done)) => Ok(done),
        Watched::Done(Err(e)) => Err(Outcome::NotStarted(failed(e))),
        Watched::Deadline => Err(Outcome::NotStarted(timed_out(late))),
        Watched::ClientGone(e) => Err(Outcome::ClientGone(e)),
    }
}

/// What the upstream's body gave next.
enum Next {
    Chunk(Bytes),
    /// The body is complete.
    End,
    /// The connection failed (the error is final: see [`Upstream::failed`]).
    Failed(Box<Error>),
    Deadline,
    ClientGone(Box<Error>),
}

/// Reads the next chunk of the response body, until `deadline`, while watching the client
/// and the server's stop.
async fn next(session: &mut Session, up: &mut Upstream<'_>, deadline: Instant) -> Next {
    if up.http.is_body_done() {
        return Next::End;
    }
    if *up.streams_end.borrow() {
        return Next::Failed(stopping());
    }
    let mut streams_end = up.streams_end.clone();
    let reading = async {
        tokio::select! {
            read = up.http.read_body_bytes() => read,
            _ = streams_end.wait_for(|end| *end) => Err(stopping()),
        }
    };
    let read = watch(session, reading, deadline).await;
    if let Watched::Done(Ok(_)) = read {
        // The answer's first byte: the request's prefill is over (every body is read here).
        tries::first_byte(&mut up.in_flight, up.http.resp_header(), up.span);
    }
    match read {
        Watched::Done(Ok(Some(chunk))) => Next::Chunk(chunk),
        Watched::Done(Ok(None)) => Next::End,
        Watched::Done(Err(e)) if ErrorReply::carried_by(&e).is_some() => Next::Failed(e),
        Watched::Done(Err(e)) => Next::Failed(up.failed(e)),
        Watched::Deadline => Next::Deadline,
        Watched::ClientGone(e) => Next::ClientGone(e),
    }
}

/// The server's grace period is ending: the answer is ended here, cleanly.
fn stopping() -> Box<Error> {
    ErrorReply::unavailable(
        Reason::Stopping,
        "The server is stopping; the answer was cut short. Retry.",
        1,
    )
    .into_error()
}

fn memory_spent() -> Box<Error> {
    ErrorReply::unavailable(
        Reason::MemoryBudget,
        "The proxy holds as many answers as it may; retry after 1 s.",
        1,
    )
    .into_error()
}

fn timed_out(what: &'static str) -> Box<Error> {
    Error::explain(ErrorType::ReadTimedout, what).into_up()
}

/// Reads a held answer's whole body (bounded, and taken from the memory budget while it is
/// read): `Err` is the outcome when that fails. An answer too large to hold, or a budget
/// spent, is Sluice's refusal, not the backend's failure.
async fn read_held(
    session: &mut Session,
    up: &mut Upstream<'_>,
    deadlines: &Deadlines,
    memory: &Arc<MemoryBudget>,
) -> Result<Bytes, Outcome> {
    let mut body = bytes::BytesMut::new();
    let mut held = memory.none();
    loop {
        match next(session, up, deadlines.total).await {
            Next::Chunk(data) => {
                if body.len() + data.len() > MAX_HELD_BYTES {
                    let refusal = ErrorReply::bad_gateway(
                        "The upstream's answer was too large to hold for its check.",
                    );
                    return Err(Outcome::NotStarted(refusal.into_error()));
                }
                if !held.grow(data.len()) {
                    return Err(Outcome::NotStarted(memory_spent()));
                }
                body.extend_from_slice(&data);
            }
            Next::End => return Ok(body.freeze()),
            Next::Failed(e) => return Err(Outcome::NotStarted(e)),
            Next::Deadline => {
                let e = timed_out("the total timeout ran out reading the answer");
                return Err(Outcome::NotStarted(e));
            }
            Next::ClientGone(e) => return Err(Outcome::ClientGone(e)),
        }
    }
}

/// The usage a whole answer reports, read as its API family writes it.
fn answer_usage(ctx: &RequestCtx, body: &[u8]) -> Option<Usage> {
    let call = ctx.llm()?;
    let mut scanner = call
        .endpoint
        .family()
        .usage_scanner(call.request.is_stream());
    scanner.feed(body);
    scanner.usage()
}

/// The start of a stream kept back for judgement, once it was kept.
struct Window {
    chunks: Vec<Bytes>,
    /// The stream ended within the window.
    ended: bool,
    /// The memory the kept chunks take, until they are sent.
    held: Held,
}

/// Keeps a stream's chunks from the client until `judge` decides on them: `Ok` with them
/// when they may be sent, `Err` with the outcome otherwise. The window is bounded: when the
/// first-byte deadline passes or [`MAX_HELD_BYTES`] are kept before the judge decided, it
/// decides on what it saw, so the window adds at most that to the client's first byte.
async fn hold_back(
    session: &mut Session,
    up: &mut Upstream<'_>,
    deadlines: &Deadlines,
    mut judge: Box<dyn StreamJudge>,
    memory: &Arc<MemoryBudget>,
) -> Result<Window, Outcome> {
    let mut window = Window {
        chunks: Vec::new(),
        ended: false,
        held: memory.none(),
    };
    let judgement = loop {
        match next(session, up, deadlines.first_byte).await {
            Next::Chunk(data) => {
                if data.is_empty() {
                    continue;
                }
                let room = window.held.grow(data.len());
                let decided = judge.feed(&data);
                window.chunks.push(data);
                if let Some(decided) = decided {
                    break decided;
                }
                // Out of room (its own bound, or the memory budget): judged on what it saw.
                if !room || window.held.bytes() > MAX_HELD_BYTES {
                    break judge.decide();
                }
            }
            Next::End => {
                window.ended = true;
                break judge.decide();
            }
            Next::Failed(e) => return Err(Outcome::NotStarted(e)),
            Next::Deadline => break judge.decide(),
            Next::ClientGone(e) => return Err(Outcome::ClientGone(e)),
        }
    };
    match judgement {
        Judgement::Escalate(reason) => {
            let events = window
                .chunks
                .iter()
                .map(|c| c.windows(5).filter(|w| w == b"data:").count() as u64)
                .sum();
            let seen = Usage {
                prompt_tokens: 0,
                completion_tokens: events,
            };
            Err(Outcome::Judged(reason, Some(seen)))
        }
        Judgement::Keep(_) => Ok(window),
    }
}

/// Sends an upstream's answer that an attempt had held back (a declined error) as it is.
pub async fn send_held(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    mut header: Box<ResponseHeader>,
    body: Bytes,
) -> Result<()> {
    frame_by_length(&mut header, body.len())?;
    prepare_upstream_header(upstreams.chain, &mut header, ctx, None, Some(&mut *answer))?;
    write_whole(upstreams.chain, session, ctx, answer, header, body).await
}

/// The response started and then failed. An event stream ends with an error event and
/// `[DONE]`, as vLLM ends its own failed streams; any other body can only be cut, which the
/// client sees as a short body.
async fn broken(
    upstreams: &Upstreams<'_>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    is_sse: bool,
    error: Box<Error>,
) -> Outcome {
    ctx.progress_mut().response_incomplete = true;
    let reply = ErrorReply::from_error(&error);
    upstreams.chain.error(&reply, ctx);
    if is_sse {
        let endpoint = ctx
            .llm()
            .map_or(Endpoint::ChatCompletions, |call| call.endpoint);
        let event = Some(reply.sse_event_for(endpoint));
        if let Err(e) = forward(upstreams.chain, session, ctx, answer, event, true).await {
            return Outcome::ClientGone(e);
        }
    }
    Outcome::Broken(error)
}
