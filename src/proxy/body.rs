//! Reading a request body whole, within `limits`.
//!
//! - Over `max_request_body_bytes`: 413. When the client declared a size that is over the
//!   limit but not absurd, the body is read and thrown away first, so the client, still busy
//!   sending, gets to read the 413 instead of a reset connection (nginx's lingering close).
//! - `client_body_timeout` bounds each read, as nginx's does: a client that stops sending,
//!   or whose `Content-Length` promises more than it sends, gets 408.
//! - `Expect: 100-continue` is answered before reading.

use crate::config::Limits;
use bytes::{Bytes, BytesMut};
use pingora_error::{Error, Result};
use pingora_proxy::Session;
use sluice_sdk::{ErrorReply, Reason};

/// Bodies declared up to this many times the limit are drained before the 413 is sent;
/// larger ones are refused at once and the connection closed.
const DRAIN_FACTOR: usize = 8;

pub async fn read_whole(session: &mut Session, limits: &Limits) -> Result<Bytes> {
    let limit = limits.max_request_body_bytes;
    let declared = declared_length(session)?;
    if let Some(len) = declared.filter(|len| *len > limit) {
        if len <= limit.saturating_mul(DRAIN_FACTOR) {
            discard(session, limits).await?;
        }
        return Err(ErrorReply::payload_too_large(limit).into_error());
    }
    if expects_continue(session) {
        session.downstream_session.write_continue_response().await?;
    }

    // Most bodies arrive in one read: keep that chunk as is, copy only when there are more.
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut total = 0usize;
    while let Some(chunk) = read_chunk(session, limits).await? {
        total += chunk.len();
        if total > limit {
            return Err(ErrorReply::payload_too_large(limit).into_error());
        }
        match (&mut first, &mut joined) {
            (None, None) => first = Some(chunk),
            (Some(f), None) => {
                let mut buf = BytesMut::with_capacity(declared.unwrap_or(total * 2).max(total));
                buf.extend_from_slice(f);
                buf.extend_from_slice(&chunk);
                joined = Some(buf);
            }
            (_, Some(buf)) => buf.extend_from_slice(&chunk),
        }
    }
    Ok(match (first, joined) {
        (_, Some(buf)) => buf.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    })
}

async fn read_chunk(session: &mut Session, limits: &Limits) -> Result<Option<Bytes>> {
    match tokio::time::timeout(limits.client_body_timeout, session.read_request_body()).await {
        Ok(read) => read,
        Err(_) => Err(ErrorReply::new(
            408,
            Reason::BodyTimeout,
            format!(
                "The client sent no body data for {}.",
                humantime::format_duration(limits.client_body_timeout)
            ),
        )
        .into_error()),
    }
}

/// Reads and drops the rest of the body (bounded by the body timeout per read).
async fn discard(session: &mut Session, limits: &Limits) -> Result<()> {
    while read_chunk(session, limits).await?.is_some() {}
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
