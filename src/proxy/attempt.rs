//! One upstream attempt of an LLM request: a Pingora subrequest of the client's request,
//! sent to one backend, whose response this module pipes to the client.
//!
//! Why subrequests: the client request has read its whole body (the cache key needs it),
//! and Pingora replays a body that was read only from its 64 KiB retry buffer. A subrequest
//! gets the body handed over as one reference-counted chunk, so every attempt, the first or
//! a fallback, sends the full body whatever its size, while Pingora still does the upstream
//! side: connection pool, HTTP/1 framing, timeouts, TLS.
//!
//! The pipe here, rather than Pingora's `pipe_subrequest`, because it must (a) decide before
//! the first byte reaches the client whether to try elsewhere, (b) run the plugins' response
//! hooks on the client request's context, (c) end a broken stream with an SSE error event,
//! and (d) notice a client that leaves while the upstream is still silent.

use super::{count_sent, prepare_client_response, Sluice};
use crate::metrics;
use bytes::Bytes;
use pingora_core::protocols::http::HttpTask;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::subrequest::{BodyMode, Ctx as SubrequestCtx};
use pingora_proxy::Session;
use sluice_sdk::{AnswerCheck, ErrorReply, Judgement, RequestCtx, StreamCheck, StreamJudge};
use std::sync::Arc;
use tokio::time::{sleep_until, Instant};

/// What an attempt subrequest needs: where to connect, and the exact request header.
pub struct Attempt {
    pub peer: HttpPeer,
    pub header: RequestHeader,
}

/// In an attempt subrequest: takes the attempt its client request put there.
///
/// The subrequest was built from the client's request header as received, and reads as many
/// body bytes as that declares; an attempt whose body differs (a draft asked for logprobs)
/// declares its own length here, before the body is first read.
pub fn take(session: &mut Session) -> Option<Attempt> {
    let attempt = session
        .subrequest_ctx
        .as_mut()?
        .user_ctx_mut()?
        .downcast_mut::<Option<Attempt>>()?
        .take()?;
    if let Some(length) = attempt.header.headers.get(http::header::CONTENT_LENGTH) {
        let _ = session
            .req_header_mut()
            .insert_header(http::header::CONTENT_LENGTH, length.clone());
    }
    Some(attempt)
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
    Judged(&'static str),
}

/// What an attempt holds back before the client sees it.
pub struct Hold {
    /// Error statuses (5xx, 429) are not sent: another attempt may follow.
    pub error_statuses: bool,
    /// A non-stream 200 answer is read whole and judged first.
    pub check: Option<Arc<dyn AnswerCheck>>,
    /// A 200 event stream is kept back until this judges its start (the hold-back window).
    pub stream_check: Option<Arc<dyn StreamCheck>>,
}

/// The most of a held answer kept in memory: a larger one fails the attempt (a hold-back
/// window is judged on what it kept instead).
const MAX_HELD_BYTES: usize = 4 << 20;

/// The deadlines of one attempt.
pub struct Deadlines {
    pub first_byte: Instant,
    pub total: Instant,
}

/// Sends `body` with `attempt` and pipes the answer to the client.
pub async fn run(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    attempt: Attempt,
    body: Bytes,
    deadlines: Deadlines,
    hold: &Hold,
) -> Outcome {
    let Some(spawner) = session.subrequest_spawner.as_ref() else {
        return Outcome::NotStarted(Error::explain(
            ErrorType::InternalError,
            "this session cannot spawn subrequests",
        ));
    };
    let sub_ctx = SubrequestCtx::builder()
        .body_mode(BodyMode::ExpectBody)
        .user_ctx(Box::new(Some(attempt)))
        .build();
    let (subrequest, handle) = spawner.create_subrequest(session.as_downstream(), sub_ctx);
    let mut rx = handle.rx;
    let mut proxy_error = handle.subreq_proxy_error;
    // The whole body as one task: the channel has room for it, so this never waits.
    if handle
        .tx
        .try_send(HttpTask::Body(Some(body), true))
        .is_err()
    {
        return Outcome::NotStarted(Error::explain(
            ErrorType::InternalError,
            "cannot hand the body to the attempt",
        ));
    }
    let _tx = handle.tx;
    // The subrequest runs in this task, polled beside the pipe, rather than spawned: no task
    // to create and no other worker thread to wake for each attempt.
    let mut attempt = Box::pin(subrequest.run());
    let mut attempt_done = false;
    let piped = pipe(
        sluice,
        session,
        ctx,
        &mut rx,
        &mut proxy_error,
        deadlines,
        hold,
    );
    tokio::pin!(piped);
    let outcome = loop {
        tokio::select! {
            outcome = &mut piped => break outcome,
            () = &mut attempt, if !attempt_done => attempt_done = true,
        }
    };
    if !attempt_done && matches!(outcome, Outcome::Complete) {
        // Let it finish on its own: it still has to return the connection to the pool.
        // Any other outcome drops it here, which cancels it and frees its connection.
        tokio::spawn(attempt);
    }
    outcome
}

type ProxyErrorRx = tokio::sync::oneshot::Receiver<Box<Error>>;

async fn pipe(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    rx: &mut tokio::sync::mpsc::Receiver<HttpTask>,
    proxy_error: &mut ProxyErrorRx,
    deadlines: Deadlines,
    hold: &Hold,
) -> Outcome {
    // Until the response header: nothing has reached the client, so failures are retryable.
    let first_byte = deadlines.first_byte.min(deadlines.total);
    let mut header = loop {
        match next(session, rx, proxy_error, first_byte).await {
            Next::Task(HttpTask::Header(h, _)) => break h,
            Next::Task(_) => continue,
            Next::Failed(e) => return Outcome::NotStarted(e),
            Next::Deadline => {
                return Outcome::NotStarted(timed_out(
                    "no response header before the first-byte timeout",
                ))
            }
            Next::ClientGone(e) => return Outcome::ClientGone(e),
        }
    };

    let is_sse = is_event_stream(&header);
    let status = header.status.as_u16();
    let declined = hold.error_statuses && (status >= 500 || status == 429);
    let judged = status == 200 && !is_sse && hold.check.is_some();
    // Held answers are read whole first: an error to decline, or an answer to judge.
    let mut held: Option<Bytes> = None;
    if declined || judged {
        let expected = content_length(&header);
        let body = match read_held(session, rx, proxy_error, &deadlines, expected).await {
            Ok(body) => body,
            Err(outcome) => return outcome,
        };
        if declined {
            return Outcome::Declined(header, body);
        }
        match hold.check.as_ref().map(|c| c.judge(&body)) {
            Some(Judgement::Escalate(reason)) => return Outcome::Judged(reason),
            Some(Judgement::Keep(Some(replaced))) => {
                if let Err(e) = frame_by_length(&mut header, replaced.len()) {
                    return Outcome::NotStarted(e);
                }
                held = Some(replaced);
            }
            Some(Judgement::Keep(None)) | None => held = Some(body),
        }
    }
    // The hold-back window: the stream's start is kept until it is judged, so that a
    // rejected draft can still give way to the target.
    let mut window = Window::default();
    if let (true, 200, Some(check)) = (is_sse, status, hold.stream_check.as_ref()) {
        window = match hold_back(session, rx, proxy_error, &deadlines, check.start()).await {
            Ok(window) => window,
            Err(outcome) => return outcome,
        };
    }
    let declared_len = content_length(&header);
    let sent_before = ctx.response_bytes;
    if let Err(e) = prepare_client_response(sluice, &mut header, ctx) {
        return Outcome::NotStarted(e);
    }
    if let Err(e) = session.write_response_header(header, false).await {
        return Outcome::ClientGone(e);
    }
    if let Some(body) = held {
        return match forward(sluice, session, ctx, Some(body), true).await {
            Ok(()) => Outcome::Complete,
            Err(e) => Outcome::ClientGone(e),
        };
    }
    // A kept window goes first; a stream that ended within it ends here.
    for chunk in window.chunks {
        if let Err(e) = forward(sluice, session, ctx, Some(chunk), false).await {
            return Outcome::ClientGone(e);
        }
    }
    if window.ended {
        return match forward(sluice, session, ctx, None, true).await {
            Ok(()) => Outcome::Complete,
            Err(e) => Outcome::ClientGone(e),
        };
    }

    loop {
        match next(session, rx, proxy_error, deadlines.total).await {
            Next::Task(HttpTask::Body(data, end)) => {
                // The chunk that completes the declared length ends the response: the client
                // may send its next request at once, and the client watch in `next` would
                // read that request's first byte.
                let after = ctx.response_bytes - sent_before + data.as_ref().map_or(0, Bytes::len);
                let last = end || declared_len.is_some_and(|len| after >= len);
                if let Err(e) = forward(sluice, session, ctx, data, last).await {
                    return Outcome::ClientGone(e);
                }
                if last {
                    return Outcome::Complete;
                }
            }
            Next::Task(HttpTask::Done) => {
                return match forward(sluice, session, ctx, None, true).await {
                    Ok(()) => Outcome::Complete,
                    Err(e) => Outcome::ClientGone(e),
                };
            }
            Next::Task(_) => continue,
            Next::Failed(e) => return broken(sluice, session, ctx, is_sse, e).await,
            Next::Deadline => {
                let e = timed_out("the total timeout ran out mid-response");
                return broken(sluice, session, ctx, is_sse, e).await;
            }
            Next::ClientGone(e) => {
                ctx.response_incomplete = true;
                return Outcome::ClientGone(e);
            }
        }
    }
}

/// What an attempt's channel gave next, or why it gave nothing.
enum Next {
    Task(HttpTask),
    /// The attempt failed: a `Failed` task, or the channel closed early.
    Failed(Box<Error>),
    Deadline,
    /// The client closed its connection (or sent more than its request) meanwhile.
    ClientGone(Box<Error>),
}

/// Waits for the attempt's next task, until `deadline`, while watching the client.
async fn next(
    session: &mut Session,
    rx: &mut tokio::sync::mpsc::Receiver<HttpTask>,
    proxy_error: &mut ProxyErrorRx,
    deadline: Instant,
) -> Next {
    tokio::select! {
        task = rx.recv() => match task {
            Some(HttpTask::Failed(e)) => Next::Failed(e),
            Some(task) => Next::Task(task),
            None => Next::Failed(ended_early(proxy_error)),
        },
        _ = sleep_until(deadline) => Next::Deadline,
        gone = session.downstream_session.read_body_or_idle(true) => {
            Next::ClientGone(client_gone(gone))
        }
    }
}

fn timed_out(what: &'static str) -> Box<Error> {
    Error::explain(ErrorType::ReadTimedout, what).into_up()
}

/// Reads a held answer's whole body (bounded): `Err` is the outcome when that fails.
async fn read_held(
    session: &mut Session,
    rx: &mut tokio::sync::mpsc::Receiver<HttpTask>,
    proxy_error: &mut ProxyErrorRx,
    deadlines: &Deadlines,
    expected: Option<usize>,
) -> Result<Bytes, Outcome> {
    let mut body = bytes::BytesMut::new();
    loop {
        match next(session, rx, proxy_error, deadlines.total).await {
            Next::Task(HttpTask::Body(data, end)) => {
                if let Some(data) = data {
                    if body.len() + data.len() > MAX_HELD_BYTES {
                        return Err(Outcome::NotStarted(Error::explain(
                            ErrorType::InvalidHTTPHeader,
                            "a held answer is too large",
                        )));
                    }
                    body.extend_from_slice(&data);
                }
                // A declared length ends the body as soon as it is there (see `pipe`).
                if end || expected.is_some_and(|len| body.len() >= len) {
                    return Ok(body.freeze());
                }
            }
            Next::Task(HttpTask::Done) => return Ok(body.freeze()),
            Next::Task(_) => continue,
            Next::Failed(e) => return Err(Outcome::NotStarted(e)),
            Next::Deadline => {
                let e = timed_out("the total timeout ran out reading the answer");
                return Err(Outcome::NotStarted(e));
            }
            Next::ClientGone(e) => return Err(Outcome::ClientGone(e)),
        }
    }
}

/// The start of a stream kept back for judgement, once it was kept.
#[derive(Default)]
struct Window {
    chunks: Vec<Bytes>,
    /// The stream ended within the window.
    ended: bool,
}

/// Keeps a stream's chunks from the client until `judge` decides on them: `Ok` with them
/// when they may be sent, `Err` with the outcome otherwise. The window is bounded: when the
/// first-byte deadline passes or [`MAX_HELD_BYTES`] are kept before the judge decided, it
/// decides on what it saw, so the window adds at most that to the client's first byte.
async fn hold_back(
    session: &mut Session,
    rx: &mut tokio::sync::mpsc::Receiver<HttpTask>,
    proxy_error: &mut ProxyErrorRx,
    deadlines: &Deadlines,
    mut judge: Box<dyn StreamJudge>,
) -> Result<Window, Outcome> {
    let mut window = Window::default();
    let mut kept_bytes = 0usize;
    let until = deadlines.first_byte.min(deadlines.total);
    let judgement = loop {
        match next(session, rx, proxy_error, until).await {
            Next::Task(HttpTask::Body(data, end)) => {
                let mut decided = None;
                if let Some(data) = data.filter(|d| !d.is_empty()) {
                    kept_bytes += data.len();
                    decided = judge.feed(&data);
                    window.chunks.push(data);
                }
                if end {
                    window.ended = true;
                    break decided.unwrap_or_else(|| judge.decide());
                }
                if let Some(decided) = decided {
                    break decided;
                }
                if kept_bytes > MAX_HELD_BYTES {
                    break judge.decide();
                }
            }
            Next::Task(HttpTask::Done) => {
                window.ended = true;
                break judge.decide();
            }
            Next::Task(_) => continue,
            Next::Failed(e) => return Err(Outcome::NotStarted(e)),
            Next::Deadline => break judge.decide(),
            Next::ClientGone(e) => return Err(Outcome::ClientGone(e)),
        }
    };
    match judgement {
        Judgement::Escalate(reason) => Err(Outcome::Judged(reason)),
        Judgement::Keep(_) => Ok(window),
    }
}

/// Sends an upstream's answer that an attempt had held back (a declined error) as it is.
pub async fn send_held(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    mut header: Box<ResponseHeader>,
    body: Bytes,
) -> Result<()> {
    frame_by_length(&mut header, body.len())?;
    prepare_client_response(sluice, &mut header, ctx)?;
    session.write_response_header(header, false).await?;
    forward(sluice, session, ctx, Some(body), true).await
}

/// Frames a response whose whole body is in hand by its length.
fn frame_by_length(header: &mut ResponseHeader, len: usize) -> Result<()> {
    header.remove_header(&http::header::TRANSFER_ENCODING);
    header.insert_header(http::header::CONTENT_LENGTH, len)
}

/// Runs the body hooks on a chunk and writes it to the client.
async fn forward(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    mut data: Option<Bytes>,
    end: bool,
) -> Result<()> {
    sluice.chain.response_body(&mut data, end, ctx)?;
    count_sent(ctx, data.as_ref());
    session.write_response_body(data, end).await
}

/// The response started and then failed. An event stream ends with an error event and
/// `[DONE]`, as vLLM ends its own failed streams; any other body can only be cut, which the
/// client sees as a short body.
async fn broken(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    is_sse: bool,
    error: Box<Error>,
) -> Outcome {
    ctx.response_incomplete = true;
    metrics::inc(&metrics::UPSTREAM_ATTEMPTS, &[ctx.pool_name(), "broken"]);
    let reply = ErrorReply::from_error(&error);
    sluice.chain.error(&reply, ctx);
    if is_sse {
        let event = Some(reply.sse_event());
        if let Err(e) = forward(sluice, session, ctx, event, true).await {
            return Outcome::ClientGone(e);
        }
    }
    Outcome::Broken(error)
}

/// The attempt's channel closed without a complete response: the error it reported.
fn ended_early(proxy_error: &mut ProxyErrorRx) -> Box<Error> {
    proxy_error.try_recv().unwrap_or_else(|_| {
        Error::explain(
            ErrorType::ConnectionClosed,
            "the upstream attempt ended early",
        )
        .into_up()
    })
}

fn client_gone(read: Result<Option<Bytes>>) -> Box<Error> {
    match read {
        Err(e) => e,
        Ok(_) => Error::explain(
            ErrorType::ConnectionClosed,
            "the client sent data after its request",
        ),
    }
    .into_down()
}

fn content_length(header: &ResponseHeader) -> Option<usize> {
    header
        .headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn is_event_stream(header: &ResponseHeader) -> bool {
    header
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}
