//! Answers that Sluice writes itself: its JSON documents, plugins' local answers, and its
//! errors. Error statuses, bodies and `retry-after` are decided here and only here.

use super::downstream::{forward, write_whole, Answer};
use crate::chain::Chain;
use crate::metrics;
use bytes::Bytes;
use pingora_error::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::{FailToProxy, Session};
use sluice_sdk::{headers, ErrorReply, LocalResponse, Priority, RequestCtx, Route};

/// Sends a complete document, after the plugins' `response_header` hooks.
pub async fn send(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    content_type: &str,
    body: Bytes,
) -> Result<()> {
    let header = header(200, content_type, body.len())?;
    write(chain, session, ctx, &mut Answer::default(), header, body).await
}

/// Sends an answer a plugin made (a cache hit), whole or, when its body is still being
/// made (a coalesced follower of a stream in flight), chunk by chunk as it comes, through
/// the request's `answer` stages.
pub async fn local(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    response: Box<LocalResponse>,
) -> Result<()> {
    let LocalResponse {
        mut header,
        body,
        stream,
    } = *response;
    // A cache hit stands for its pool's answer: the pool's response rules apply to it too.
    super::forwarding::from_pool(&mut header, ctx.pool().map(|p| &**p), None)?;
    let Some(mut stream) = stream else {
        return write(chain, session, ctx, answer, Box::new(header), body).await;
    };
    let mut header = Box::new(header);
    chain.response_header(&mut header, ctx)?;
    ctx.progress_mut().status = Some(header.status.as_u16());
    session.write_response_header(header, false).await?;
    if !body.is_empty() {
        forward(chain, session, ctx, answer, Some(body), false).await?;
    }
    // Each write is bounded by the client's send timeout: a client that stops reading is
    // cut, and only its own answer waits for it.
    while let Some(chunk) = stream.next_chunk().await {
        forward(chain, session, ctx, answer, Some(chunk), false).await?;
    }
    forward(chain, session, ctx, answer, None, true).await
}

/// How long an answer given before the request's body was read (a 413 for a declared size,
/// say) waits, reading and dropping what the client still sends, before the connection
/// closes: closed at once, the socket resets and the client often loses the answer in its
/// upload's error, as nginx's `lingering_close` knows. Bounded: the client's own time.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads and drops the rest of the request's body for at most [`LINGER`].
async fn linger(session: &mut Session) {
    let draining = async { while let Ok(Some(_)) = session.read_request_body().await {} };
    let _ = tokio::time::timeout(LINGER, draining).await;
}

/// Answers with `reply` if nothing was sent yet. Returns what Pingora needs to know.
pub async fn error(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    reply: ErrorReply,
) -> FailToProxy {
    if reply.status != 499 {
        let priority = ctx.priority().map_or("-", Priority::as_str);
        metrics::inc(&metrics::REJECTIONS, &[reply.reason.as_str(), priority]);
    }
    chain.error(&reply, ctx);
    // A connection is reusable only if the request was read to its end.
    let can_reuse_downstream = session.as_downstream_mut().is_body_done();
    // A `100 Continue` is written too, but it answers nothing: the error still can be.
    let already_answered = session
        .response_written()
        .is_some_and(|header| !header.status.is_informational());
    if reply.status == 499 || already_answered {
        if !already_answered {
            ctx.progress_mut().status = Some(499);
        }
        return FailToProxy {
            error_code: reply.status,
            can_reuse_downstream: false,
        };
    }
    // An LLM route's error in its family's shape; any other in OpenAI's.
    let endpoint = match ctx.route() {
        Route::Llm(endpoint) => Some(*endpoint),
        // Refused before routing (an unknown key, a connection cap): the path says whose
        // API the client speaks.
        Route::Unrouted => sluice_sdk::Endpoint::from_path(&crate::router::unreserved_decoded(
            session.req_header().uri.path(),
        )),
        _ => None,
    };
    let body = reply.body_for(endpoint);
    let written = match error_header(&reply, body.len()) {
        // Sluice's own error: no stage of an answer applies to it.
        Ok(h) => write(chain, session, ctx, &mut Answer::default(), h, body).await,
        Err(e) => Err(e),
    };
    if let Err(e) = written {
        tracing::debug!("could not send the error response: {e}");
    } else if !can_reuse_downstream {
        linger(session).await;
    }
    ctx.progress_mut().status = Some(reply.status);
    FailToProxy {
        error_code: reply.status,
        can_reuse_downstream,
    }
}

fn header(status: u16, content_type: &str, len: usize) -> Result<Box<ResponseHeader>> {
    let mut h = ResponseHeader::build(status, Some(5))?;
    h.insert_header(http::header::CONTENT_TYPE, content_type)?;
    h.insert_header(http::header::CONTENT_LENGTH, len)?;
    Ok(Box::new(h))
}

/// An error answer's header: its reason machine-readable, and when to retry on 429 and 503.
fn error_header(reply: &ErrorReply, len: usize) -> Result<Box<ResponseHeader>> {
    let mut h = header(reply.status, "application/json", len)?;
    h.insert_header(headers::REJECTED, reply.reason.as_str())?;
    if let Some(seconds) = reply.retry_after {
        h.insert_header(http::header::RETRY_AFTER, seconds)?;
    }
    for (name, value) in &reply.headers {
        h.append_header(name.clone(), value.clone())?;
    }
    Ok(h)
}

async fn write(
    chain: &Chain,
    session: &mut Session,
    ctx: &mut RequestCtx,
    answer: &mut Answer,
    mut header: Box<ResponseHeader>,
    body: Bytes,
) -> Result<()> {
    // Plugins decorate Sluice's own answers too (request id, cache status).
    chain.response_header(&mut header, ctx)?;
    write_whole(chain, session, ctx, answer, header, body).await
}
