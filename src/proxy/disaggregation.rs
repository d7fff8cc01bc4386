//! Disaggregated prefill (`pools[].prefill`), the core's part: the prefill leg of a request
//! to a pool that decodes for a prefill pool, and the check of its transfer.
//!
//! The decode backend is chosen first, as for any request (it holds the session's prefix
//! and must admit the request). When the part of the prompt it would compute (its prefix
//! cache's hits, as the exact index predicts them, taken off) is at least
//! `min_prefill_tokens`, a prefill leg goes to the prefill pool: the request's body for one
//! output token, not streamed, with `kv_transfer_params` asking for a remote decode
//! (vLLM's `NixlConnector`). Its answer's `kv_transfer_params` go into the decode leg,
//! which is the request's one attempt that the client sees. Nothing is queued between the
//! legs: the decode leg is sent as soon as the prefill answer is read, well within the
//! engine's lease on the blocks.
//!
//! Whatever goes wrong before the decode leg (no prefill backend, a failed or refused
//! prefill leg, an answer without transfer parameters) leaves the decode backend doing the
//! whole request, as if the route were not there: no byte has reached the client. A client
//! that leaves during the prefill leg ends the request (the leg's connection is dropped, so
//! the engine stops). A decode leg refused before its engine took it (a failed connection,
//! a 429 or 503) hands the transfer to its retry while the prefill engine's lease holds, so
//! another decode backend reads the blocks (and frees them) rather than stranding them; any
//! other retry is served whole. The decode leg's usage then says whether its engine got the prompt
//! from the transfer (its `cached_tokens`); decodes that keep recomputing their prompts make
//! the route fall back to the decode pool alone (see `sluice_sdk::TransferCheck`).

mod mooncake;

use super::attempt::{self, Attempt, Deadlines, Outcome};
use super::llm_route::{pool_edits, pool_header};
use super::state::Sluice;
use bytes::Bytes;
use pingora_http::RequestHeader;
use pingora_proxy::Session;
use sluice_sdk::model_name;
use sluice_sdk::{
    raw_json, Connector, Demand, Endpoint, Pool, PrefillRoute, RequestCtx, Selected, TransferCheck,
    TransferOutcome, Verdict,
};
use std::sync::Arc;
use tokio::time::Instant;

/// A prefill leg's answer, for the decode leg.
pub struct Transfer {
    /// The prefill engine's `kv_transfer_params` (JSON text).
    pub params: Bytes,
    /// When the prefill engine answered: its lease on the blocks runs from then.
    received: Instant,
}

impl Transfer {
    /// Whether a retry of a decode leg that `outcome` ended may still carry the transfer: the
    /// decode engine never took the request (its connection failed, or it refused it with
    /// 429 or 503 before scheduling it), so the blocks wait on the prefill engine, and the
    /// lease still holds. Another decode backend then reads them, which frees them, instead
    /// of leaving them stranded until the lease ends and computing the prompt again. A 500
    /// (vLLM's answer to blocks it could not read) or a timed-out attempt is not retried
    /// with them: the blocks may be gone.
    pub fn may_carry(&self, pool: &Pool, outcome: &Outcome) -> bool {
        let untouched = match outcome {
            Outcome::NotStarted(e) => super::attempt::is_connect_failure(e),
            Outcome::Declined(header, _) => matches!(header.status.as_u16(), 429 | 503),
            _ => false,
        };
        untouched && self.lease_holds(pool)
    }

    /// Whether the prefill engine's lease on the blocks still leaves the decode engine time.
    pub fn lease_holds(&self, pool: &Pool) -> bool {
        pool.settings
            .prefill
            .as_ref()
            .is_some_and(|route| route.lease_holds(self.received.into_std()))
    }
}

/// Kept in the request's state while its decode leg runs: its usage is judged against the
/// transfer once read (see [`judge`]).
#[derive(Debug)]
pub struct TransferSent {
    pool: Arc<Pool>,
    /// The prompt tokens the transfer was to bring: those the decode backend's prefix cache
    /// was not predicted to hold.
    expected: u64,
    /// The prefill leg's backend.
    prefill_backend: std::net::SocketAddr,
}

/// The prefill leg of a request whose pool (`decode_pool`) decodes for a prefill pool, sent
/// before the decode leg to `decode`: `Ok(Some)` with the transfer's parameters, `Ok(None)`
/// when the decode backend is to do the whole request, `Err` when the client left.
#[allow(clippy::too_many_arguments)]
pub async fn prefill(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    decode_pool: &Arc<Pool>,
    decode: &Selected,
    demand: &Demand,
    body: &Bytes,
    request_id: &str,
) -> Result<Option<Transfer>, Outcome> {
    let (Some(route), Some(check)) = (
        decode_pool.settings.prefill.as_ref(),
        decode_pool.transfer_check(),
    ) else {
        return Ok(None);
    };
    let Some((prefill_pool, backend, expected)) =
        leg_target(sluice, ctx, decode_pool, decode, demand, route, check)
    else {
        return Ok(None);
    };
    let path = |path: &str| served_as(&decode_pool.name, path);
    // What the leg asks, and for Mooncake what the decode leg will say.
    let mooncake = match route.connector {
        Connector::Nixl => None,
        Connector::Mooncake { bootstrap_port } => {
            let legs = mooncake::legs(
                &sluice.probes,
                check,
                &prefill_pool,
                backend.addr,
                bootstrap_port,
                request_id,
            )
            .await;
            if legs.is_none() {
                return Ok(failed_leg(&decode_pool.name, check));
            }
            legs
        }
    };
    let leg = Leg {
        decode_pool,
        prefill_pool: &prefill_pool,
        backend: &backend,
        mooncake: mooncake.as_ref(),
    };
    let Some((header, leg_body, span)) = leg.request(sluice, session, ctx, body, request_id) else {
        path("prefill_failed");
        return Ok(None);
    };
    let params = leg
        .send(sluice, session, demand, header, leg_body, &span)
        .await?;
    let Some(params) = params else {
        return Ok(failed_leg(&decode_pool.name, check));
    };
    path("disaggregated");
    // The decode leg's usage says what the transfer did: a stream is asked for it.
    ctx.want_usage();
    ctx.state.insert(TransferSent {
        pool: Arc::clone(decode_pool),
        expected,
        prefill_backend: backend.addr,
    });
    Ok(Some(Transfer {
        params,
        received: Instant::now(),
    }))
}

/// Where a request's prefill leg goes: the prefill pool, its backend, and the prompt tokens
/// the leg is expected to compute; `None` (counted under its `sluice_pd_requests_total`
/// path when it was a choice) when the decode backend serves the request whole.
fn leg_target(
    sluice: &Sluice,
    ctx: &RequestCtx,
    decode_pool: &Pool,
    decode: &Selected,
    demand: &Demand,
    route: &PrefillRoute,
    check: &TransferCheck,
) -> Option<(Arc<Pool>, Selected, u64)> {
    let speaks_the_wire = ctx.llm().is_some_and(|call| {
        matches!(
            call.endpoint,
            Endpoint::ChatCompletions | Endpoint::Completions
        )
    });
    if !speaks_the_wire || ctx.escalation().is_some() {
        return None;
    }
    let cached = decode
        .predicted_cached
        .or(decode.cached_tokens)
        .unwrap_or(0);
    let path = |path: &str| served_as(&decode_pool.name, path);
    let expected = demand.prompt_tokens.saturating_sub(cached);
    if expected < route.min_prefill_tokens {
        path("short");
        return None;
    }
    let open = check.open();
    publish(&decode_pool.name, check);
    if !open {
        path("fallen_back");
        return None;
    }
    let Some(prefill_pool) = sluice.pools.get(&route.pool).cloned() else {
        path("no_prefill_backend");
        return None;
    };
    // A LoRA adapter's request goes to a prefill backend that serves the adapter.
    let adapter = prefill_pool.adapter(ctx.model());
    let Some(backend) = prefill_pool.select_prefixed(&[], demand, None, adapter) else {
        path("no_prefill_backend");
        return None;
    };
    Some((prefill_pool, backend, expected))
}

/// Counts a request of the decode pool `pool` under how it was served (one of
/// `metrics::PD_PATHS`).
fn served_as(pool: &str, path: &str) {
    crate::metrics::inc(&crate::metrics::PD_REQUESTS, &[pool, path]);
}

/// A prefill leg about to be sent: the pools, the prefill backend chosen, and Mooncake's
/// parameters when the route speaks it.
struct Leg<'a> {
    decode_pool: &'a Pool,
    prefill_pool: &'a Arc<Pool>,
    backend: &'a Selected,
    mooncake: Option<&'a mooncake::Legs>,
}

impl Leg<'_> {
    /// The leg's request header, body and span: the request's body for one output token
    /// with the connector's ask, and the header an attempt to the prefill pool would get;
    /// `None` when either cannot be made.
    fn request(
        &self,
        sluice: &Sluice,
        session: &Session,
        ctx: &mut RequestCtx,
        body: &Bytes,
        request_id: &str,
    ) -> Option<(RequestHeader, Bytes, tracing::Span)> {
        let (pool, addr) = (self.prefill_pool, self.backend.addr);
        let ask = self
            .mooncake
            .map_or(model_name::NIXL_REMOTE_DECODE, |legs| &legs.ask[..]);
        let edits = pool_edits(ctx, pool, true, Some(request_id));
        let leg_body = model_name::prefill_leg_body(body, &edits, ask)?;
        let span = super::tries::prefill_span(ctx, pool, addr);
        let mut header = pool_header(sluice, session, ctx, pool, addr, leg_body.len()).ok()?;
        // The leg is an upstream request as an attempt is: the plugins' headers too (the
        // request id, for both engines' logs), and the trace context under the leg's span.
        let leg = sluice_sdk::AttemptStart {
            number: ctx.progress().attempts + 1,
            pool: &pool.name,
            backend: addr,
            span: &span,
            prefill_leg: true,
        };
        sluice.chain.upstream_request(&mut header, &leg, ctx).ok()?;
        if let Some(legs) = self.mooncake {
            header
                .insert_header("x-data-parallel-rank", legs.rank.to_string())
                .ok()?;
        }
        Some((header, leg_body, span))
    }

    /// Sends the leg and reads its answer whole, within the decode pool's first-byte budget
    /// (the client's first token comes after it): the decode leg's transfer parameters, or
    /// `None` (logged) when the leg was refused, failed or brought none; `Err` when the
    /// client left.
    async fn send(
        &self,
        sluice: &Sluice,
        session: &mut Session,
        demand: &Demand,
        header: RequestHeader,
        leg_body: Bytes,
        span: &tracing::Span,
    ) -> Result<Option<Bytes>, Outcome> {
        let (pool, backend) = (self.prefill_pool, self.backend);
        let computed = demand
            .prompt_tokens
            .saturating_sub(backend.cached_tokens.unwrap_or(0));
        let in_flight = backend
            .live
            .begin_request(demand.prompt_tokens + 1, computed);
        let now = Instant::now();
        let timeouts = &pool.settings.timeouts;
        let budget = timeouts
            .first_byte
            .min(self.decode_pool.settings.timeouts.first_byte);
        let total = now + timeouts.total_for(Some(1)).min(budget);
        let deadlines = Deadlines {
            first_byte: (now + budget).min(total),
            total,
        };
        let attempt = Attempt {
            peer: pool.peer(backend.addr),
            header,
            body: leg_body,
            in_flight,
            // The leg is Sluice's own request: its time is in the decode attempt's.
            received: None,
        };
        let answer = attempt::fetch(&sluice.upstreams(), session, attempt, deadlines, span).await;
        // The prefill backend's passive health counts the leg as any attempt there.
        let verdict = match &answer {
            Ok((status, _)) if *status >= 500 => Some(Verdict::Failure),
            Ok(_) => Some(Verdict::Success),
            Err(Outcome::NotStarted(_)) => Some(Verdict::Failure),
            Err(_) => None,
        };
        if let Some(verdict) = verdict {
            super::tries::judge(pool, backend.addr, &backend.live, verdict);
        }
        let status = answer.as_ref().ok().map(|(status, _)| *status);
        // NIXL's answer says where the blocks are; Mooncake's says nothing, the router named
        // them.
        let params = answer
            .as_ref()
            .ok()
            .filter(|(status, _)| *status == 200)
            .and_then(|(_, answer)| match self.mooncake {
                None => transfer_params(answer),
                Some(legs) => Some(legs.decode.clone()),
            });
        let label = match (&answer, &params) {
            (_, Some(_)) => "prefilled",
            (Ok((200, _)), None) => "no_transfer_params",
            (Ok(_), None) => "declined",
            (Err(Outcome::ClientGone(_)), None) => "client_gone",
            (Err(_), None) => "failed",
        };
        crate::telemetry::try_ended(span, status, label);
        let (decode_pool, prefill_pool) = (&*self.decode_pool.name, &*pool.name);
        match answer {
            Ok((200, _)) => Ok(params),
            Ok((status, _)) => {
                tracing::warn!(pool = decode_pool, prefill_pool, backend = %backend.addr, status, "the prefill leg was refused: the decode backend serves the request whole");
                Ok(None)
            }
            Err(Outcome::ClientGone(e)) => Err(Outcome::ClientGone(e)),
            Err(outcome) => {
                tracing::warn!(pool = decode_pool, prefill_pool, backend = %backend.addr, error = %outcome_error(&outcome), "the prefill leg failed: the decode backend serves the request whole");
                Ok(None)
            }
        }
    }
}

/// A prefill leg that did not happen or brought no transfer: counted in the route's window,
/// and the decode backend serves the request whole.
fn failed_leg(pool: &str, check: &TransferCheck) -> Option<Transfer> {
    served_as(pool, "prefill_failed");
    if check.record_failed_leg() {
        fell_back(pool, check);
    }
    publish(pool, check);
    None
}

/// The `kv_transfer_params` of a prefill answer, when it has an object there.
fn transfer_params(answer: &[u8]) -> Option<Bytes> {
    let spans = raw_json::object_spans(answer, &["kv_transfer_params"])?;
    let params = answer.get(spans.value("kv_transfer_params")?)?;
    params
        .starts_with(b"{")
        .then(|| Bytes::copy_from_slice(params))
}

/// What ended a prefill leg, for its log line.
fn outcome_error(outcome: &Outcome) -> String {
    match outcome {
        Outcome::NotStarted(e) | Outcome::Broken(e) | Outcome::ClientGone(e) => e.to_string(),
        Outcome::Declined(header, _) => header.status.to_string(),
        Outcome::Judged(why, _) => (*why).to_string(),
        Outcome::Complete => "complete".to_string(),
    }
}

/// Judges a disaggregated request's decode leg by its usage, once read: the engine's
/// `prompt_tokens`, the `created` of them it computed into new cache blocks, and the
/// `cached` it says it did not compute.
pub fn judge(ctx: &mut RequestCtx, prompt_tokens: u64, created: Option<u64>, cached: Option<u64>) {
    let Some(sent) = ctx.state.remove::<TransferSent>() else {
        return;
    };
    let Some(check) = sent.pool.transfer_check() else {
        return;
    };
    let outcome = TransferOutcome::judge(prompt_tokens, sent.expected, created, cached);
    let pool = &*sent.pool.name;
    crate::metrics::inc(&crate::metrics::PD_TRANSFERS, &[pool, outcome.as_str()]);
    if outcome == TransferOutcome::Recomputed {
        // What its bootstrap server said may be stale (a restarted engine has a new id).
        check.prefillers().forget(sent.prefill_backend);
        tracing::warn!(
            pool,
            prefill_backend = %sent.prefill_backend,
            prompt_tokens,
            computed = ?created,
            cached = ?cached,
            "a decode leg recomputed its prompt: the KV transfer did nothing"
        );
    }
    if check.record(outcome) {
        fell_back(pool, check);
    }
    publish(pool, check);
}

/// Says that the route fell back.
fn fell_back(pool: &str, check: &TransferCheck) {
    tracing::warn!(
        pool,
        failed = check.recent_recomputed(),
        "the disaggregated route falls back to the decode pool alone for {:?}",
        check.route().recover_after
    );
}

/// The route's state in its gauge.
fn publish(pool: &str, check: &TransferCheck) {
    let disaggregated = check.state() == sluice_sdk::RouteState::Disaggregated;
    crate::metrics::set(
        &crate::metrics::PD_ROUTE_DISAGGREGATED,
        &[pool],
        i64::from(disaggregated),
    );
}
