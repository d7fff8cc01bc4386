//! Reading a request body whole, within `limits`.
//!
//! - Over `max_request_body_bytes`: 413. When the client declared a size that is over the
//!   limit but not absurd, the body is read and thrown away first, so the client, still busy
//!   sending, gets to read the 413 instead of a reset connection (nginx's lingering close).
//! - `client_body_timeout` bounds each read, as nginx's does, and `client_body_deadline` the
//!   whole body: a client that stops sending, trickles, or whose `Content-Length` promises
//!   more than it sends, gets 408.
//! - Every byte kept is taken from the process's memory budget as it arrives: when it is
//!   spent, 503 `memory-budget` with `retry-after`, before the body is read any further. What
//!   a client only declares costs nothing: 128 idle sockets that declared 8 MiB each and
//!   sent nothing took the whole budget, and every other request got 503.
//! - `Expect: 100-continue` is answered before reading.

use crate::config::Limits;
use bytes::{Bytes, BytesMut};
use pingora_error::{Error, ErrorType, Result};
use pingora_proxy::Session;
use sluice_sdk::{ErrorReply, Held, MemoryBudget, Reason};
use std::sync::Arc;
use tokio::time::Instant;

/// A body's buffer is made this large at once when its declared size is no larger.
const EAGER_ROOM: usize = 256 << 10;

/// Bodies declared up to this many times the limit are drained before the 413 is sent;
/// larger ones are refused at once and the connection closed.
const DRAIN_FACTOR: usize = 8;

/// Reads the whole body; the memory it takes stays held until the [`Held`] is dropped.
pub async fn read_whole(
    session: &mut Session,
    limits: &Limits,
    memory: &Arc<MemoryBudget>,
) -> Result<(Bytes, Held)> {
    let limit = limits.max_request_body_bytes;
    let declared = declared_length(session)?;
    let deadline = Instant::now() + limits.client_body_deadline;
    if let Some(len) = declared.filter(|len| *len > limit) {
        // Drained first, so that the client, still busy sending, reads the 413.
        if len <= limit.saturating_mul(DRAIN_FACTOR) {
            discard(session, limits, deadline).await?;
        }
        return Err(ErrorReply::payload_too_large(limit).into_error());
    }
    // A body the budget could not hold now is refused before it is sent (and before
    // `100 Continue` invites it); nothing is taken until bytes arrive.
    if !memory.has_room_for(declared.unwrap_or(0)) {
        return Err(budget_spent());
    }
    let mut held = memory.none();
    if expects_continue(session) {
        session.downstream_session.write_continue_response().await?;
    }

    // Most bodies arrive in one read: keep that chunk as is, copy only when there are more.
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut total = 0usize;
    while let Some(chunk) = read_chunk(session, limits, deadline).await? {
        total += chunk.len();
        if total > limit {
            return Err(ErrorReply::payload_too_large(limit).into_error());
        }
        if total > held.bytes() && !held.grow(total - held.bytes()) {
            return Err(budget_spent());
        }
        match (&mut first, &mut joined) {
            (None, None) => first = Some(chunk),
            (Some(f), None) => {
                // Room for what was declared, up to twice what came (at least 256 KiB): no
                // copy as most bodies grow, and a client that declares 8 MiB and sends two
                // chunks gets no 8 MiB buffer.
                let room = declared
                    .unwrap_or(limit)
                    .min(total.saturating_mul(2).max(EAGER_ROOM))
                    .clamp(total, limit);
                let mut buf = BytesMut::with_capacity(room);
                buf.extend_from_slice(f);
                buf.extend_from_slice(&chunk);
                joined = Some(buf);
            }
            (_, Some(buf)) => buf.extend_from_slice(&chunk),
        }
    }
    let body = match (first, joined) {
        (_, Some(buf)) => buf.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    };
    Ok((body, held))
}

/// 413 at once for a body declared over the limit, before anything is sent upstream: for
/// plain routes, which stream their bodies through.
pub fn refuse_declared_over_limit(session: &Session, limits: &Limits) -> Result<()> {
    let limit = limits.max_request_body_bytes;
    match declared_length(session)? {
        Some(len) if len > limit => Err(ErrorReply::payload_too_large(limit).into_error()),
        _ => Ok(()),
    }
}

/// 408: the whole body did not arrive within `client_body_deadline`.
pub fn too_slow(limits: &Limits) -> Box<Error> {
    ErrorReply::new(
        408,
        Reason::BodyTimeout,
        format!(
            "The request body did not arrive within {}.",
            humantime::format_duration(limits.client_body_deadline)
        ),
    )
    .into_error()
}

fn budget_spent() -> Box<Error> {
    ErrorReply::unavailable(
        Reason::MemoryBudget,
        "The proxy holds as many request bodies as it may; retry after 1 s.",
        1,
    )
    .into_error()
}

/// The next chunk, within the read timeout and the body's deadline.
async fn read_chunk(
    session: &mut Session,
    limits: &Limits,
    deadline: Instant,
) -> Result<Option<Bytes>> {
    let wait = limits
        .client_body_timeout
        .min(deadline.saturating_duration_since(Instant::now()));
    match tokio::time::timeout(wait, session.read_request_body()).await {
        // Pingora's own read timeout (set to the same value in early_request_filter) can fire
        // first on a loaded machine; its error names no side, so it is answered here as ours.
        Ok(Err(e)) if e.etype != ErrorType::ReadTimedout => Err(e),
        Ok(read @ Ok(_)) => read,
        _ if Instant::now() >= deadline => Err(too_slow(limits)),
        _ => Err(body_timeout(limits)),
    }
}

/// 408: a read of the body waited `client_body_timeout` for nothing.
fn body_timeout(limits: &Limits) -> Box<Error> {
    ErrorReply::new(
        408,
        Reason::BodyTimeout,
        format!(
            "The client sent no body data for {}.",
            humantime::format_duration(limits.client_body_timeout)
        ),
    )
    .into_error()
}

/// Reads and drops the rest of the body, within the same bounds.
async fn discard(session: &mut Session, limits: &Limits, deadline: Instant) -> Result<()> {
    while read_chunk(session, limits, deadline).await?.is_some() {}
    Ok(())
}

fn declared_length(session: &Session) -> Result<Option<usize>> {
    let Some(value) = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
    else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map(Some)
        .ok_or_else(|| bad_framing("The Content-Length header is not a number."))
}

fn expects_continue(session: &Session) -> bool {
    session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

fn bad_framing(message: &str) -> Box<Error> {
    ErrorReply::new(400, Reason::BadRequest, message).into_error()
}
