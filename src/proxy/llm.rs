//! The LLM pipeline of a client request: read and parse the body, choose the pool by model,
//! run the plugins' request hooks (which may answer, as a cache hit does, or refuse), then send
//! the request upstream, one [`attempt`] at a time, until one answers or none is left.
//!
//! Retries: an attempt that failed before anything reached the client is retried on another
//! backend of the pool when the failure is one where the upstream cannot have acted on the
//! request (a refused or timed-out connect, or an error Pingora marks as safe to retry).
//! Anything else is final: a model may already be generating.

use super::attempt::{self, Attempt, Deadlines, Hold, Outcome};
use super::{body, ProxyCtx, Sluice};
use crate::metrics;
use bytes::Bytes;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::RequestHeader;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use sluice_sdk::escalation::reason;
use sluice_sdk::{Demand, Endpoint, ErrorReply, LlmCall, Pool, Pools, Verdict};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::time::Instant;

pub async fn serve(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut ProxyCtx,
    endpoint: Endpoint,
) -> Result<()> {
    let body = body::read_whole(session, &sluice.limits).await?;
    let call = LlmCall::parse(endpoint, body)
        .map_err(|invalid| ErrorReply::bad_request(invalid).into_error())?;
    let pool = pool_for(&sluice.pools, call.request.model.as_deref())?;
    ctx.req.llm = Some(call);
    ctx.req.pool = Some(pool);

    if sluice.request_hooks(session, &mut ctx.req).await? {
        return Ok(());
    }
    send_upstream(sluice, session, ctx).await
}

/// The pool serving `model`: the first that lists it, else one that lists no models (a
/// catch-all); a request without a model goes to the first pool.
fn pool_for(pools: &Pools, model: Option<&str>) -> Result<Arc<Pool>> {
    let found = match model {
        Some(model) => pools
            .for_model(model)
            .or_else(|| pools.iter().find(|p| p.models.is_empty()))
            .ok_or_else(|| ErrorReply::unknown_model(model).into_error())?,
        None => pools.default_pool().ok_or_else(|| {
            ErrorReply::new(500, "internal", "No pool is configured.").into_error()
        })?,
    };
    Ok(found.clone())
}

async fn send_upstream(sluice: &Sluice, session: &mut Session, ctx: &mut ProxyCtx) -> Result<()> {
    let Some(call) = ctx.req.llm.as_ref() else {
        return Err(ErrorReply::new(500, "internal", "No parsed request.").into_error());
    };
    let client_body = call.body.clone();
    let max_tokens = call.request.max_output_tokens();
    let is_stream = call.request.is_stream();
    let mut tried: Vec<SocketAddr> = Vec::new();
    let mut last_error: Option<Box<Error>> = None;
    // A declined error answer, sent as it is if no other attempt follows.
    let mut declined: Option<(Box<ResponseHeader>, Bytes)> = None;
    let mut retries_in_pool = 0;
    if let Some(pool) = &ctx.req.pool {
        pool.retry_budget.deposit();
    }

    loop {
        sluice.chain.upstream_select(&mut ctx.req)?;
        let Some(pool) = ctx.req.pool.clone() else {
            return Err(ErrorReply::new(500, "internal", "No pool chosen.").into_error());
        };
        let demand = ctx
            .req
            .llm
            .as_ref()
            .map_or_else(Demand::default, |call| call.demand_for(&pool.balancing));
        let Some(backend) = pool.select(&tried, &demand) else {
            let reason = if last_error.is_some() || declined.is_some() {
                reason::DRAFT_ERROR
            } else {
                reason::DRAFT_UNAVAILABLE
            };
            if escalate(ctx, reason, &mut tried, &mut retries_in_pool) {
                continue;
            }
            if let Some((header, body)) = declined {
                return attempt::send_held(sluice, session, &mut ctx.req, header, body).await;
            }
            return Err(last_error.unwrap_or_else(|| no_backend(&pool)));
        };
        tried.push(backend.addr);
        ctx.req.backend = Some(backend.addr);
        ctx.req.attempts += 1;
        // Counted against the backend until the attempt ends: the balancer and the breaker
        // see it before the next scrape does.
        let in_flight = backend.live.begin(demand.tokens());

        // A first pool may get its own body (a draft asked for logprobs), and every pool
        // the plugins' (a stream's usage asked for).
        let body = ctx
            .req
            .escalation
            .as_ref()
            .and_then(|e| e.upstream_body.clone())
            .or_else(|| ctx.req.upstream_body.clone())
            .unwrap_or_else(|| client_body.clone());
        let mut header = upstream_header(session.req_header(), body.len(), backend.addr)?;
        sluice.chain.upstream_request(&mut header, &mut ctx.req)?;
        let escalation = ctx.req.escalation.as_ref();
        let attempt = Attempt {
            peer: pool.peer(backend.addr),
            header,
            body,
        };
        let now = Instant::now();
        let started = Instant::from_std(ctx.req.started);
        let first_byte = match escalation.and_then(|e| e.first_byte_budget) {
            Some(budget) => budget.min(pool.timeouts.first_byte),
            None => pool.timeouts.first_byte,
        };
        let total = started + pool.timeouts.total_for(max_tokens);
        let deadlines = Deadlines {
            first_byte: (now + first_byte).min(total),
            total,
        };
        let may_retry_here =
            retries_in_pool < pool.retry.max_retries && pool.retry_budget.has_retry();
        let hold = Hold {
            error_statuses: escalation.is_some() || may_retry_here,
            check: escalation
                .filter(|_| !is_stream)
                .and_then(|e| e.check.clone()),
            stream_check: escalation
                .filter(|_| is_stream)
                .and_then(|e| e.stream_check.clone()),
        };

        let outcome = attempt::run(sluice, session, &mut ctx.req, attempt, deadlines, &hold).await;
        // Ended: a retry's backoff, or a held answer sent later, is no load on this backend.
        drop(in_flight);
        let verdict = match &outcome {
            Outcome::Complete if ctx.req.upstream_status.is_some_and(|s| s >= 500) => {
                Some(Verdict::Failure)
            }
            Outcome::Declined(header, _) if header.status.as_u16() >= 500 => Some(Verdict::Failure),
            Outcome::Complete | Outcome::Declined(..) | Outcome::Judged(_) => {
                Some(Verdict::Success)
            }
            Outcome::NotStarted(_) | Outcome::Broken(_) => Some(Verdict::Failure),
            Outcome::ClientGone(_) => None,
        };
        if let Some(verdict) = verdict {
            super::record_verdict(&pool, backend.addr, &backend.live, verdict);
        }
        match outcome {
            Outcome::Complete => {
                metrics::inc(&metrics::UPSTREAM_ATTEMPTS, &[&pool.name, "response"]);
                return Ok(());
            }
            Outcome::NotStarted(e) => {
                let timed_out = is_timeout(&e);
                let outcome = if timed_out {
                    "timeout"
                } else if is_connect_failure(&e) {
                    "connect_error"
                } else {
                    "error"
                };
                metrics::inc(&metrics::UPSTREAM_ATTEMPTS, &[&pool.name, outcome]);
                tracing::warn!(
                    request_id = ctx.req.request_id.as_deref().unwrap_or("-"),
                    pool = &*pool.name,
                    backend = %backend.addr,
                    "upstream attempt failed: {e}"
                );
                if is_connect_failure(&e) || e.retry() {
                    // Another backend of the pool; when none is left, the escalation target.
                    last_error = Some(e);
                    continue;
                }
                let reason = if timed_out {
                    reason::DRAFT_TIMEOUT
                } else {
                    reason::DRAFT_ERROR
                };
                if escalate(ctx, reason, &mut tried, &mut retries_in_pool) {
                    last_error = Some(e);
                    continue;
                }
                return Err(e);
            }
            Outcome::Declined(header, body) => {
                let status = header.status.as_u16();
                metrics::inc(&metrics::UPSTREAM_ATTEMPTS, &[&pool.name, "declined"]);
                tracing::info!(
                    request_id = ctx.req.request_id.as_deref().unwrap_or("-"),
                    pool = &*pool.name,
                    backend = %backend.addr,
                    "upstream answered {status}; trying again"
                );
                if retries_in_pool < pool.retry.max_retries && pool.retry_budget.try_spend() {
                    declined = Some((header, body));
                    retries_in_pool += 1;
                    metrics::inc(&metrics::POOL_RETRIES, &[&pool.name]);
                    tokio::time::sleep(pool.retry.backoff(retries_in_pool)).await;
                    // Any backend may take the retry, the same one included.
                    tried.clear();
                    continue;
                }
                if escalate(ctx, reason::DRAFT_ERROR, &mut tried, &mut retries_in_pool) {
                    declined = Some((header, body));
                    continue;
                }
                return attempt::send_held(sluice, session, &mut ctx.req, header, body).await;
            }
            Outcome::Judged(reason) => {
                metrics::inc(
                    &metrics::UPSTREAM_ATTEMPTS,
                    &[&pool.name, "rejected_answer"],
                );
                if escalate(ctx, reason, &mut tried, &mut retries_in_pool) {
                    continue;
                }
                return Err(ErrorReply::bad_gateway("The answer was rejected.").into_error());
            }
            Outcome::Broken(e) | Outcome::ClientGone(e) => return Err(e),
        }
    }
}

/// Moves the request to its escalation target, if it has one: the next attempts go there,
/// with the client's own body. Returns whether it did.
fn escalate(
    ctx: &mut ProxyCtx,
    reason: &'static str,
    tried: &mut Vec<SocketAddr>,
    retries_in_pool: &mut u32,
) -> bool {
    let Some(escalation) = ctx.req.escalation.take() else {
        return false;
    };
    tracing::info!(
        request_id = ctx.req.request_id.as_deref().unwrap_or("-"),
        from = ctx.req.pool_name(),
        to = &*escalation.target.name,
        "escalated: {reason}"
    );
    escalation.target.retry_budget.deposit();
    ctx.req.pool = Some(escalation.target);
    ctx.req.escalated = Some(reason);
    tried.clear();
    *retries_in_pool = 0;
    true
}

/// 503 when a pool has no backend left to try: all unhealthy, ejected or already tried.
pub(super) fn no_backend(pool: &Pool) -> Box<Error> {
    ErrorReply::unavailable(
        "no-healthy-backend",
        format!("No healthy backend of pool `{}` is available.", pool.name),
        1,
    )
    .into_error()
}

/// The request header an upstream gets: the client's, with hop-by-hop headers removed, the
/// body framed by its exact length, and sent as HTTP/1.1, which needs a `Host` (an HTTP/1.0
/// client may have sent none).
fn upstream_header(
    client: &RequestHeader,
    body_len: usize,
    backend: SocketAddr,
) -> Result<RequestHeader> {
    let mut header = client.clone();
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    ] {
        header.remove_header(name);
    }
    header.insert_header(http::header::CONTENT_LENGTH, body_len)?;
    if !header.headers.contains_key(http::header::HOST) {
        header.insert_header(http::header::HOST, backend.to_string())?;
    }
    header.set_version(http::Version::HTTP_11);
    Ok(header)
}

fn is_connect_failure(e: &Error) -> bool {
    use ErrorType::*;
    matches!(
        e.etype(),
        ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError
    )
}

fn is_timeout(e: &Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::ReadTimedout | ErrorType::ConnectTimedout
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_header_drops_hop_by_hop_and_sets_the_length() {
        let mut client = RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
        client
            .insert_header("transfer-encoding", "chunked")
            .unwrap();
        client.insert_header("expect", "100-continue").unwrap();
        client.insert_header("connection", "keep-alive").unwrap();
        client.insert_header("authorization", "Bearer k").unwrap();
        let backend: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let up = upstream_header(&client, 1234, backend).unwrap();
        assert!(up.headers.get("transfer-encoding").is_none());
        assert!(up.headers.get("expect").is_none());
        assert!(up.headers.get("connection").is_none());
        assert_eq!(up.headers.get("content-length").unwrap(), "1234");
        assert_eq!(up.headers.get("authorization").unwrap(), "Bearer k");
        assert_eq!(up.headers.get("host").unwrap(), "127.0.0.1:8000");
        assert_eq!(up.version, http::Version::HTTP_11);

        client.insert_header("host", "api.example").unwrap();
        let up = upstream_header(&client, 1234, backend).unwrap();
        assert_eq!(up.headers.get("host").unwrap(), "api.example");
    }
}
