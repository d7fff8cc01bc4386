//! The LLM pipeline of a client request: read and parse the body, choose the pool by model,
//! run the plugins' request hooks (which may answer, as a cache hit does, or refuse), then send
//! the request upstream, one [`attempt`] at a time, until one answers or none is left.
//!
//! Retries: an attempt that failed before anything reached the client is retried on another
//! backend of the pool when the failure is one where the upstream cannot have acted on the
//! request (a refused or timed-out connect, or an error Pingora marks as safe to retry).
//! Anything else is final: a model may already be generating.

use super::attempt::{self, Attempt, Deadlines, Outcome};
use super::{body, ProxyCtx, Sluice};
use crate::metrics;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::RequestHeader;
use pingora_proxy::Session;
use sluice_sdk::{Balancing, Demand, Endpoint, ErrorReply, LlmCall, Pool, Pools, Verdict};
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
    let body = call.body.clone();
    let max_tokens = call.request.max_output_tokens();
    let mut tried: Vec<SocketAddr> = Vec::new();
    let mut last_error: Option<Box<Error>> = None;

    loop {
        sluice.chain.upstream_select(&mut ctx.req)?;
        let Some(pool) = ctx.req.pool.clone() else {
            return Err(ErrorReply::new(500, "internal", "No pool chosen.").into_error());
        };
        let demand = match (&ctx.req.llm, &pool.balancing) {
            (Some(call), Balancing::KvAware { prefix_affinity }) => {
                call.request.demand(*prefix_affinity)
            }
            (Some(call), Balancing::RoundRobin) => call.request.demand(None),
            (None, _) => Demand::default(),
        };
        let Some(backend) = pool.select(&tried, &demand) else {
            return Err(last_error.unwrap_or_else(|| no_backend(&pool)));
        };
        tried.push(backend.addr);
        ctx.req.backend = Some(backend.addr);
        ctx.req.attempts += 1;
        // Counted against the backend until the attempt ends: the balancer and the breaker
        // see it before the next scrape does.
        let _in_flight = backend.live.begin(demand.tokens());

        let mut header = upstream_header(session.req_header(), body.len())?;
        sluice.chain.upstream_request(&mut header, &mut ctx.req)?;
        let attempt = Attempt {
            peer: pool.peer(backend.addr),
            header,
        };
        let now = Instant::now();
        let started = Instant::from_std(ctx.req.started);
        let deadlines = Deadlines {
            first_byte: now + pool.timeouts.first_byte,
            total: started + pool.timeouts.total_for(max_tokens),
        };

        let outcome = attempt::run(
            sluice,
            session,
            &mut ctx.req,
            attempt,
            body.clone(),
            deadlines,
        )
        .await;
        let verdict = match &outcome {
            Outcome::Complete if ctx.req.upstream_status.is_some_and(|s| s >= 500) => {
                Some(Verdict::Failure)
            }
            Outcome::Complete => Some(Verdict::Success),
            Outcome::NotStarted(_) | Outcome::Broken(_) => Some(Verdict::Failure),
            Outcome::ClientGone(_) => None,
        };
        if let Some(verdict) = verdict {
            if let Some(cool_down) = backend.live.record(verdict, &pool.outlier) {
                metrics::inc(&metrics::EJECTIONS, &[&pool.name]);
                tracing::warn!(
                    pool = &*pool.name,
                    backend = %backend.addr,
                    "backend ejected for {} after failing",
                    humantime::format_duration(cool_down)
                );
            }
        }
        match outcome {
            Outcome::Complete => {
                metrics::inc(&metrics::UPSTREAM_ATTEMPTS, &[&pool.name, "response"]);
                return Ok(());
            }
            Outcome::NotStarted(e) => {
                let outcome = if is_timeout(&e) {
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
                if !(is_connect_failure(&e) || e.retry()) {
                    return Err(e);
                }
                last_error = Some(e);
            }
            Outcome::Broken(e) | Outcome::ClientGone(e) => return Err(e),
        }
    }
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

/// The request header an upstream gets: the client's, with hop-by-hop headers removed and
/// the body framed by its exact length.
fn upstream_header(client: &RequestHeader, body_len: usize) -> Result<RequestHeader> {
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
        let up = upstream_header(&client, 1234).unwrap();
        assert!(up.headers.get("transfer-encoding").is_none());
        assert!(up.headers.get("expect").is_none());
        assert!(up.headers.get("connection").is_none());
        assert_eq!(up.headers.get("content-length").unwrap(), "1234");
        assert_eq!(up.headers.get("authorization").unwrap(), "Bearer k");
    }
}
