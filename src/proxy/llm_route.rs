//! The LLM pipeline of a client request, in the order it runs: read and parse the body,
//! choose the pool by model, run the plugins' request hooks (which may answer, as a cache
//! hit does, or refuse), then the attempt loop: one [`attempt`] at a time until one answers
//! or none is left. Each turn of the loop is four named steps:
//!
//! 1. **select**: the plugins' `upstream_select` hooks, then a backend of the pool that was
//!    not tried yet (none left: escalate, or answer with what the last attempt left);
//! 2. **prepare**: the request header and body for that backend (the plugins'
//!    `upstream_request` hooks), its deadlines, and what the attempt holds back;
//! 3. **run**: [`attempt::run`], which pipes the answer to the client or holds it;
//! 4. **decide**: done, another backend, a retry after backoff, or the escalation target.
//!
//! Retries, only ever before anything reached the client: an attempt the upstream cannot
//! have acted on (a refused or timed-out connect, a reused connection found dead before any
//! answer byte) always goes to another backend of the pool; the failures the pool's
//! `retry.on` lists (error statuses, a first-byte timeout: nginx's `proxy_next_upstream`)
//! are retried up to `retry.max_retries`, within the pool's retry budget. Anything else is
//! final: a model may already be generating.

use super::attempt::{self, is_connect_failure, is_timeout, Attempt, Deadlines, Hold, Outcome};
use super::downstream::Answer;
use super::shared_sessions::SharedSessions;
use super::tries::{self, no_backend};
use super::{body, forwarding, reply, usage, Sluice};
use crate::metrics;
use crate::metrics::HoldEnd;
use bytes::Bytes;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use sluice_sdk::cpu::{body_work, optional_work};
use sluice_sdk::escalation::reason;
use sluice_sdk::model_name::{self, ServedModel, UpstreamEdits};
use sluice_sdk::prefix::{Predicted, PrefixKeys, PrefixRouting};
use sluice_sdk::Waited;
use sluice_sdk::{
    AttemptReport, AttemptStart, ClientFields, Demand, Endpoint, ErrorReply, InFlight, LlmCall,
    Placement, Pool, Pools, RequestCtx, RetryOn, RouteMatch, Selected,
};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::time::Instant;

/// Serves an LLM request from `request_filter`: on return, it has been answered (or the
/// error is for `fail_to_proxy` to answer).
pub async fn serve(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    endpoint: Endpoint,
    found: RouteMatch,
) -> Result<()> {
    // The body's memory is held until the request has been served.
    let (body, _held) = body::read_whole(session, &sluice.limits, &sluice.memory).await?;
    let received = std::time::Instant::now();
    let routed = route_call(sluice, session, ctx, endpoint, found, body).await?;
    // Before the request hooks: a cache hit's usage is read as well as an upstream's.
    let mut answer = Answer::for_llm(ctx, &sluice.response_homes);

    if let Some(local) = sluice.chain.request(session, ctx).await? {
        return reply::local(&sluice.chain, session, ctx, &mut answer, local).await;
    }
    let mut attempts = AttemptLoop::new(ctx, answer)?;
    attempts.pinned = routed.pinned;
    attempts.shared_session = routed.shared_session;
    attempts.received = Some(received);
    attempts.run(sluice, session, ctx).await
}

/// What routing a call leaves for its attempts, beside what it puts in the context.
struct Routed {
    /// The backend that made the stored response a follow-up continues.
    pinned: Option<SocketAddr>,
    /// The session's id, when the fleet shares sessions in Redis.
    shared_session: Option<Vec<u8>>,
}

/// Parses the call, finds its pool (a stored response's follow-up: the response's), its
/// session and flow, and puts them in the context. Its own function so that the parsed
/// call's locals are gone from `serve`'s future before the answer streams.
async fn route_call(
    sluice: &Sluice,
    session: &mut Session,
    ctx: &mut RequestCtx,
    endpoint: Endpoint,
    found: RouteMatch,
    body: Bytes,
) -> Result<Routed> {
    let mut call = body_work(body.len(), move || {
        LlmCall::parse_routed(endpoint, found, body)
    })
    .await
    .ok_or_else(|| ErrorReply::internal("The request could not be parsed.").into_error())?
    .map_err(|invalid| ErrorReply::bad_request(invalid).into_error())?;
    // A stored response's follow-up goes where the response was made, and nowhere else.
    // Looked up before the plugins' request hooks (the tenants' limits among them): the
    // follow-up is admitted with its conversation's size, which the note holds. The caller
    // is already identified, and the lookup bounded: an id of at most 256 bytes, this
    // process's notes, then one Redis GET within its timeout.
    let home = match &call.request.previous_response_id {
        Some(id) => Some(home_of(sluice, ctx, id).await?),
        None => None,
    };
    let pool = match &home {
        Some((pool, _, _)) => Arc::clone(pool),
        None => pool_for(&sluice.pools, call.request.model.as_deref())?,
    };
    // The engine prefills the stored conversation with the new input: the follow-up is
    // admitted, balanced and charged as that, not as its few new tokens.
    // The conversation's count is the engine's; the estimate is in the pool's estimated
    // tokens, which it scales by its learned prompt scale (`Pool::prompt_tokens`).
    if let Some((_, _, conversation)) = &home {
        let estimated = (*conversation as f64 / pool.prompt_scale()).round() as u64;
        call.demand.prompt_tokens = call.demand.prompt_tokens.saturating_add(estimated);
    }
    // A conversation's session id, when its pool keeps sessions on one backend.
    let tenant = ctx.tenant().map(|t| &*t.name);
    // The session's id is found once: its key here, and (when the fleet shares sessions
    // in Redis) the id itself, for its key there.
    let id = pool.session_id(session.req_header(), &call);
    let shared_session = id
        .filter(|_| sluice.shared_sessions.is_some())
        .map(<[u8]>::to_vec);
    call.demand.session = id.map(|id| Pool::session_key_of(id, tenant));
    let client = super::client::address(session, &sluice.limits.trusted_proxies);
    ctx.set_flow(pool.flow_of(session.req_header(), &call, tenant, client));
    if let Some(slo) = ttft_slo(session, ctx) {
        ctx.set_ttft_slo(slo);
    }
    ctx.set_llm(call);
    ctx.send_to(pool);
    Ok(Routed {
        pinned: home.map(|(_, backend, _)| backend),
        shared_session,
    })
}

/// The most a TTFT objective may be: beyond it, it says nothing a timeout does not.
const MAX_TTFT_SLO_MS: u64 = 600_000;

/// The request's TTFT objective: its `x-sluice-ttft-slo-ms` (whole milliseconds, 1 to
/// 600,000; another value is ignored), else its tenant's `ttft_slo`.
fn ttft_slo(session: &Session, ctx: &RequestCtx) -> Option<std::time::Duration> {
    let asked = session
        .req_header()
        .headers
        .get(&sluice_sdk::headers::TTFT_SLO_MS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| (1..=MAX_TTFT_SLO_MS).contains(ms))
        .map(std::time::Duration::from_millis);
    asked.or_else(|| ctx.tenant().and_then(|t| t.ttft_slo))
}

/// The pool and backend that made stored response `id`, and its conversation's tokens (0
/// when unknown), while it is one of the pool's and the request's tenant made it; else
/// OpenAI's 404, as the engine would answer (no other backend has it), the same for another
/// tenant's response as for one never made.
pub async fn home_of(
    sluice: &Sluice,
    ctx: &RequestCtx,
    id: &str,
) -> Result<(Arc<Pool>, SocketAddr, u64)> {
    let tenant = ctx.tenant().map(|t| &*t.name);
    let home = sluice.response_homes.find(id).await.and_then(|home| {
        if home.tenant.as_deref() != tenant {
            return None;
        }
        let pool = sluice.pools.get(&home.pool)?;
        pool.has_backend(home.backend)
            .then(|| (Arc::clone(pool), home.backend, home.tokens))
    });
    home.ok_or_else(|| {
        ErrorReply {
            param: Some("response_id".into()),
            ..ErrorReply::not_found(
                sluice_sdk::Reason::UnknownResponse,
                format!("Response with id '{id}' not found."),
            )
        }
        .into_error()
    })
}

/// The pool serving `model`: the first that lists it, else one that lists no models (a
/// catch-all); a request without a model goes to the first pool.
fn pool_for(pools: &Pools, model: Option<&str>) -> Result<Arc<Pool>> {
    let found = match model {
        Some(model) => pools
            .for_model(model)
            .or_else(|| pools.iter().find(|p| p.is_catch_all()))
            .ok_or_else(|| ErrorReply::unknown_model(model).into_error())?,
        None => pools
            .default_pool()
            .ok_or_else(|| ErrorReply::internal("No pool is configured.").into_error())?,
    };
    Ok(found.clone())
}

/// A deadline that cannot be represented is this far away instead (config caps timeouts far
/// below it).
const FAR_FUTURE: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// The attempt loop's state, for one request.
struct AttemptLoop {
    /// The client's body, sent to every attempt unless a plugin asked for another.
    client_body: Bytes,
    max_tokens: Option<u32>,
    /// The tokens the client allowed for all its choices (`u64::MAX`: no limit but the
    /// context's).
    output_budget: u64,
    is_stream: bool,
    /// Backends of the current pool already tried.
    tried: Vec<SocketAddr>,
    /// The last attempt's failure, answered if nothing follows it.
    last_error: Option<Box<Error>>,
    /// The last declined error answer (5xx, 429), sent as it is if nothing follows it.
    declined: Option<(Box<ResponseHeader>, Bytes)>,
    /// Retries of an error answer spent in the current pool.
    retries_in_pool: u32,
    /// The last body changed for upstream, and what it became: retries and backends of one
    /// pool send the same body, copied once.
    sent_body: Option<SentBody>,
    /// The request's prompt blocks, as the last pool with an exact prefix index keyed them.
    prefix: Option<(Arc<str>, Option<Arc<PrefixKeys>>)>,
    /// The one backend the request may go to: the one that holds the stored response it
    /// continues.
    pinned: Option<SocketAddr>,
    /// The request's session id, when the pools' sessions are shared in Redis.
    shared_session: Option<Vec<u8>>,
    /// The span of the attempt being decided on (none between attempts): an escalation is
    /// its event.
    attempt_span: tracing::Span,
    /// It waited for its pool to have a usable backend (once is all it waits).
    waited: bool,
    /// It was held in its pool's fair order, or passed it (once).
    held: bool,
    /// The transfer of a disaggregated request's prefill leg, for its decode leg (and for
    /// a retry of a decode leg its engine never took, while the lease holds).
    transfer: Option<super::disaggregation::Transfer>,
    /// Its prefill leg was tried (once per request).
    prefilled: bool,
    /// When the request's body was read whole; taken by the first attempt, which records
    /// Sluice's own time until the request is written (`metrics::ADDED`).
    received: Option<std::time::Instant>,
    /// The core's stages the answer passes on its way to the client, whichever attempt's
    /// answer it is.
    answer: Answer,
}

/// A body as an attempt sends it: `from` with the pool's `model` (when it changes) and the
/// usage request (when asked) spliced in.
struct SentBody {
    from: Bytes,
    model: Option<Vec<u8>>,
    ask_usage: bool,
    client_fields: ClientFields,
    sent: Bytes,
}

/// The `request_id` the engine gets in place of a client's: the request's id (which its logs
/// and `x-request-id` carry, and which a client may have chosen) with a suffix no client can
/// guess, or a fresh one when it has none. vLLM names a Responses request's response after
/// it: a client-chosen id could name another tenant's response.
fn engine_request_id(ctx: &RequestCtx) -> String {
    use std::hash::BuildHasher;
    static KEY: std::sync::LazyLock<std::collections::hash_map::RandomState> =
        std::sync::LazyLock::new(std::collections::hash_map::RandomState::new);
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let unguessable = KEY.hash_one(n);
    match ctx.request_id() {
        Some(own) => format!("{own}-{:08x}", unguessable as u32),
        None => format!("sluice-{unguessable:016x}"),
    }
}

/// How a hold ended: `waited` is the wait's end (`Err`: the client left), and a sheddable
/// request's objective falls due at `sheds_at_deadline`.
fn hold_end(
    waited: &Result<Waited, Box<pingora_error::Error>>,
    sheds_at_deadline: Option<std::time::Instant>,
) -> HoldEnd {
    match waited {
        Ok(Waited::LetIn) => HoldEnd::Sent,
        Ok(Waited::NoBackend) => HoldEnd::NoBackend,
        Ok(Waited::Deadline)
            if sheds_at_deadline.is_some_and(|due| std::time::Instant::now() >= due) =>
        {
            HoldEnd::Deadline
        }
        Ok(Waited::Deadline) => HoldEnd::MaxHold,
        Err(_) => HoldEnd::ClientGone,
    }
}

/// Holds the request in `pool`'s fair order while every engine of the pool would queue it
/// (see `sluice_pools::pool::flow_control`), up to the pool's `fairness.max_hold` and within
/// its total timeout; a sheddable request with a TTFT objective only until that is due, then
/// it is refused. A request that must go to one backend (`pinned`, the stored response's; else
/// its session's) waits for that one's room. Not held: a request with somewhere else to go (a
/// draft's escalation), or when no backend is usable (the waiting room's business). Its place,
/// when it was let in, is kept until its attempt starts.
async fn hold(
    session: &mut Session,
    ctx: &RequestCtx,
    pool: &Arc<Pool>,
    pinned: Option<SocketAddr>,
) -> Result<Option<Held>> {
    let control = pool.flow_control();
    let Some(fairness) = control.fairness() else {
        return Ok(None);
    };
    if ctx.escalation().is_some() {
        return Ok(None);
    }
    // Its backend, while usable: its cache (or its stored response) is there.
    let bound = pinned
        .or_else(|| {
            let key = ctx.llm()?.demand.session?;
            pool.session_binding(key).map(|(addr, _)| addr)
        })
        .and_then(|addr| Some((addr, pool.has_room(addr)?)));
    // The common case, without a look at every backend: nothing held, and room where it goes.
    if control.held() == 0 {
        let fits = match bound {
            Some((_, room)) => room,
            None => !pool.engines_queue(),
        };
        if fits {
            return Ok(None);
        }
    }
    if pool.room().usable.is_empty() {
        return Ok(None);
    }
    let bound = bound.map(|(addr, _)| addr);
    let priority = ctx.priority().unwrap_or(sluice_sdk::Priority::Standard);
    let deadline = ctx.ttft_deadline();
    let sheds_at_deadline = deadline.filter(|_| priority == sluice_sdk::Priority::Sheddable);
    if sheds_at_deadline.is_some_and(|due| std::time::Instant::now() >= due) {
        return Err(slo_unmeetable(pool, "had passed before an engine had room"));
    }
    let Some(mut place) = control.join(
        sluice_sdk::WaitFor::Engine,
        priority,
        ctx.flow(),
        deadline,
        ctx.llm().map_or(0, |call| call.demand.prompt_tokens),
        fairness.max_held,
    ) else {
        // As many are held as may be: this one queues in the engine, as without fairness.
        return Ok(None);
    };
    let started = Instant::now();
    let total_ends = Instant::from_std(ctx.started()) + pool.settings.timeouts.total;
    let mut until = (started + fairness.max_hold).min(total_ends);
    if let Some(due) = sheds_at_deadline {
        until = until.min(Instant::from_std(due));
    }
    if let Some(addr) = bound {
        place.aim_at(addr);
    }
    let engines = Arc::clone(pool);
    let waited = sluice_sdk::client::session::while_connected(
        session,
        place.wait_for_room(until, move || engines.room()),
    )
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let end = hold_end(&waited, sheds_at_deadline);
    crate::metrics::held(&pool.name, end, seconds);
    match end {
        HoldEnd::Sent => Ok(Some(Held {
            _place: place,
            bound: bound.is_some(),
        })),
        HoldEnd::MaxHold | HoldEnd::NoBackend => Ok(None),
        HoldEnd::Deadline => Err(slo_unmeetable(pool, "passed while it waited for an engine")),
        HoldEnd::ClientGone => waited.map(|_| None),
    }
}

/// A request let in from its pool's fair order: its place, kept until its attempt starts.
struct Held {
    _place: sluice_sdk::Place,
    /// It waited for its session's backend.
    bound: bool,
}

/// Refuses a sheddable request whose TTFT objective its backend is not predicted to meet
/// (the `ttft` strategy's prediction, which chose the backend predicted soonest): it would be
/// served late, taking the engine from requests that can still be served in time.
fn meets_deadline(ctx: &RequestCtx, pool: &Pool, backend: &Selected) -> Result<()> {
    let (Some(due), Some(predicted), Some(sluice_sdk::Priority::Sheddable)) =
        (ctx.ttft_deadline(), backend.predicted_ttft, ctx.priority())
    else {
        return Ok(());
    };
    let left = due.saturating_duration_since(std::time::Instant::now());
    if predicted <= left.as_secs_f64() {
        return Ok(());
    }
    Err(slo_unmeetable(
        pool,
        &format!(
            "cannot be met: the soonest first token is predicted in {:.0} ms, {:.0} ms are left",
            predicted * 1000.0,
            left.as_secs_f64() * 1000.0
        ),
    ))
}

fn slo_unmeetable(pool: &Pool, why: &str) -> Box<sluice_sdk::Error> {
    ErrorReply::unavailable(
        sluice_sdk::Reason::TtftSloUnmeetable,
        format!(
            "The request's time-to-first-token objective on pool `{}` {why}; it is sheddable, \
             so it was refused rather than served late.",
            pool.name
        ),
        1,
    )
    .into_error()
}

/// What the decide step chose.
enum Then {
    /// Another attempt (another backend, or the escalation target).
    TryAgain,
    /// The request is over: answered, or this error is to be answered.
    Finished(Result<()>),
    /// Send an upstream's error answer that was held back.
    SendDeclined(Box<ResponseHeader>, Bytes),
}

/// The LoRA adapter the request asks `pool` for: its model, when one of the pool's backends
/// lists it as an adapter (it is then sent under its own name, whatever the pool's
/// `served_model`).
fn upstream_adapter<'c>(ctx: &'c RequestCtx, pool: &Pool) -> Option<&'c str> {
    pool.adapter(ctx.model())
}

/// One attempt, ready to run.
struct Prepared {
    attempt: Attempt,
    deadlines: Deadlines,
    hold: Hold,
    /// The attempt's span (see `tries::span`).
    span: tracing::Span,
}

impl AttemptLoop {
    /// The request's prompt blocks as `pool` keys them, when the pool has an exact prefix
    /// index: tokenized once per pool (a retry or an escalation back to a pool reuses them).
    async fn prefix_keys(
        &mut self,
        session: &mut Session,
        ctx: &RequestCtx,
        pool: &Pool,
    ) -> Result<Option<Arc<PrefixKeys>>> {
        let Some(routing) = pool.prefix() else {
            return Ok(None);
        };
        if let Some((name, keys)) = &self.prefix {
            if Arc::ptr_eq(name, &pool.name) {
                return Ok(keys.clone());
            }
        }
        let Some(call) = ctx.llm() else {
            return Ok(None);
        };
        let salt_for_tenant = ctx
            .tenant()
            .filter(|_| pool.settings.client_fields.tenant_cache_salt)
            .map(|t| Arc::clone(&t.name));
        let adapter = upstream_adapter(ctx, pool).map(Arc::from);
        let keys = if call.body.len() <= PrefixRouting::INLINE_BYTES {
            routing.keys(call, adapter.as_deref(), salt_for_tenant.as_deref())
        } else if call.body.len() > PrefixRouting::MAX_BYTES {
            routing
                .too_long
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            None
        } else {
            // Optional work: dropped when it waited too long, or when the client leaves
            // meanwhile (then the request ends, and its body's memory with it).
            let work = {
                let (routing, call) = (Arc::clone(&routing), call.clone());
                optional_work(PrefixRouting::MAX_WAIT, move || {
                    routing.keys(&call, adapter.as_deref(), salt_for_tenant.as_deref())
                })
            };
            let tokenized = sluice_sdk::client::session::while_connected(session, work).await;
            if !matches!(tokenized, Ok(Some(_))) {
                routing
                    .passed_over
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            tokenized?.flatten()
        }
        .map(Arc::new);
        self.prefix = Some((Arc::clone(&pool.name), keys.clone()));
        Ok(keys)
    }

    fn new(ctx: &RequestCtx, answer: Answer) -> Result<Self> {
        let call = ctx
            .llm()
            .ok_or_else(|| ErrorReply::internal("No parsed request.").into_error())?;
        if let Some(pool) = ctx.pool() {
            pool.retry_budget.deposit();
        }
        Ok(Self {
            client_body: call.body.clone(),
            max_tokens: call.request.max_output_tokens(),
            output_budget: sluice_sdk::context::output_budget(call),
            is_stream: call.request.is_stream(),
            tried: Vec::new(),
            last_error: None,
            declined: None,
            retries_in_pool: 0,
            sent_body: None,
            prefix: None,
            pinned: None,
            shared_session: None,
            attempt_span: tracing::Span::none(),
            waited: false,
            held: false,
            transfer: None,
            prefilled: false,
            received: None,
            answer,
        })
    }

    /// The request's session key in the fleet's Redis for `pool`, when sessions are shared:
    /// a session this process has no binding for is first bound where Redis says.
    async fn shared_session_key(
        &self,
        sluice: &Sluice,
        ctx: &RequestCtx,
        pool: &Pool,
        demand: &Demand,
    ) -> Option<String> {
        let (shared, id, session) = (
            sluice.shared_sessions.as_ref()?,
            self.shared_session.as_deref()?,
            demand.session?,
        );
        let key = SharedSessions::key(&pool.name, ctx.tenant().map(|t| &*t.name), id);
        shared.adopt(pool, session, &key).await;
        Some(key)
    }

    /// The attempt loop: a backend chosen, an attempt on it, and what follows, until the
    /// request is answered or fails.
    async fn run(
        &mut self,
        sluice: &Sluice,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        loop {
            let then = match self.choose(sluice, session, ctx).await? {
                Step::Again => continue,
                Step::Done(then) => then,
                Step::Chosen(chosen) => self.attempt_on(sluice, session, ctx, chosen).await?,
            };
            match then {
                Then::TryAgain => continue,
                Then::Finished(result) => return result,
                Then::SendDeclined(header, body) => {
                    let upstreams = sluice.upstreams();
                    let answer = &mut self.answer;
                    return attempt::send_held(&upstreams, session, ctx, answer, header, body)
                        .await;
                }
            }
        }
    }

    /// Step 1, select: the plugins' `upstream_select`, then a backend of the request's pool,
    /// the request held in the pool's fair order first (once) and, when the pool has no ready
    /// backend at all, waited for (once).
    async fn choose(
        &mut self,
        sluice: &Sluice,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Step> {
        sluice.chain.upstream_select(ctx)?;
        let pool = ctx
            .pool()
            .cloned()
            .ok_or_else(|| ErrorReply::internal("No pool chosen.").into_error())?;
        // `ttft` learns each backend's prefill speed from what the engine says it
        // computed: the answer's usage, asked of a stream whose client did not.
        // A traced attempt's span carries the tokens used (`gen_ai.usage.*`), a stream's too.
        if matches!(pool.settings.balancing, sluice_sdk::Balancing::Ttft(_)) || ctx.traced() {
            ctx.want_usage();
        }
        let demand = ctx
            .llm()
            .map_or_else(Demand::default, |call| pool.demand_for(call));
        let prefix = self.prefix_keys(session, ctx, &pool).await?;
        let adapter = upstream_adapter(ctx, &pool);
        let shared_key = self.shared_session_key(sluice, ctx, &pool, &demand).await;
        let pinned = self.pinned;
        let select = |tried: &[SocketAddr]| match pinned {
            Some(addr) => pool.select_backend(addr, tried),
            None => pool.select_prefixed(tried, &demand, prefix.as_deref(), adapter),
        };
        // Held in the pool's fair order while every engine would queue it: once, before
        // the first attempt. The place is kept until the attempt starts.
        let mut held = if self.tried.is_empty() && !self.held {
            self.held = true;
            hold(session, ctx, &pool, self.pinned).await?
        } else {
            None
        };
        // Let in with no backend of its own, it goes where an engine has room.
        let queueing = match &held {
            Some(Held { bound: false, .. }) => pool.queueing_backends(),
            _ => Vec::new(),
        };
        let mut selected = if queueing.is_empty() {
            select(&self.tried)
        } else {
            let avoid = [self.tried.as_slice(), &queueing].concat();
            select(&avoid).or_else(|| select(&self.tried))
        };
        // A pool with no ready backend at all (scaled to zero, starting) is waited for,
        // once, unless the request has somewhere else to go.
        if selected.is_none()
            && self.tried.is_empty()
            && !self.waited
            && ctx.escalation().is_none()
            && !pool.has_ready_member()
        {
            self.waited = true;
            drop(held.take());
            let newest = tries::wait_for_backend(Some(session), &pool).await?;
            if let Some(newest) = newest.filter(|newest| !Arc::ptr_eq(newest, &pool)) {
                // A reload came while it waited: the new generation sends it.
                ctx.send_to(newest);
                return Ok(Step::Again);
            }
            selected = select(&self.tried);
        }
        let Some(backend) = selected else {
            drop(held.take());
            return Ok(Step::Done(self.pool_exhausted(ctx, &pool)));
        };
        placed(sluice, ctx, &pool, &backend, &demand, shared_key)?;
        Ok(Step::Chosen(Box::new(Chosen {
            pool,
            backend,
            demand,
            held,
        })))
    }

    /// Steps 2 to 4: prepare, run and decide an attempt on the backend chosen.
    async fn attempt_on(
        &mut self,
        sluice: &Sluice,
        session: &mut Session,
        ctx: &mut RequestCtx,
        chosen: Box<Chosen>,
    ) -> Result<Then> {
        let Chosen {
            pool,
            mut backend,
            demand,
            mut held,
        } = *chosen;
        // The leg runs on another pool: the next waiter here need not wait.
        if !self.prefilled && pool.transfer_check().is_some() {
            drop(held.take());
        }
        if self.prefill_due(ctx, &pool) {
            // Boxed: the leg's future is large and only a disaggregated pool's requests
            // take it; inline, every stream's future would carry its size to the end.
            Box::pin(self.prefill_elsewhere(sluice, session, ctx, &pool, &backend, &demand))
                .await?;
        }
        if self.transfer.is_some() {
            // The prompt's blocks come by the transfer: the decode backend computes
            // next to nothing of it.
            backend.cached_tokens = Some(demand.prompt_tokens.saturating_sub(1));
        }
        let mut in_flight = tries::begin(ctx, &mut self.tried, &backend, demand.tokens());
        if self.transfer.is_some() {
            in_flight.transferred();
        }
        // Counted before the next waiter is let in.
        drop(held.take());
        // 3. run: the attempt's load on the backend ends with it (or as soon as the
        // backend's answer has come whole), never with a retry's backoff or a held answer
        // sent later. (Taken apart where it is made: a `Prepared` kept whole would stay in
        // this future beside its parts, for as long as the answer streams.)
        let Prepared {
            attempt,
            deadlines,
            hold,
            span,
        } = self.prepare(sluice, session, ctx, &pool, &backend, in_flight)?;
        let started = std::time::Instant::now();
        let upstreams = sluice.upstreams();
        let answer = &mut self.answer;
        let outcome = attempt::run(
            &upstreams, session, ctx, answer, attempt, deadlines, &hold, &span,
        )
        .await;
        report_attempt(sluice, ctx, &pool, &backend, started, &outcome, &span);
        // 4. decide; the attempt's span ends with the decision.
        self.attempt_span = span;
        if self
            .transfer
            .as_ref()
            .is_some_and(|transfer| !transfer.may_carry(&pool, &outcome))
        {
            self.transfer = None;
        }
        let then = self.decide(ctx, &pool, &backend, outcome).await;
        self.attempt_span = tracing::Span::none();
        Ok(then)
    }

    /// Part of step 2: whether a disaggregated pool's long prompt is to be prefilled
    /// elsewhere first ([`Self::prefill_elsewhere`]): once, on the first attempt. A retry of
    /// a decode leg its engine never took keeps the transfer while the lease holds (see
    /// `Transfer::may_carry`); any other retry is served whole.
    fn prefill_due(&mut self, ctx: &mut RequestCtx, pool: &Pool) -> bool {
        let disaggregated = pool.transfer_check().is_some();
        self.transfer = self
            .transfer
            .take()
            .filter(|transfer| disaggregated && transfer.lease_holds(pool));
        if self.transfer.is_none() && disaggregated {
            ctx.state.remove::<super::disaggregation::TransferSent>();
        }
        disaggregated && !self.prefilled
    }

    /// Part of step 2: the prefill leg, once the decode backend was chosen and admitted.
    /// `Err`: the client left during the leg.
    async fn prefill_elsewhere(
        &mut self,
        sluice: &Sluice,
        session: &mut Session,
        ctx: &mut RequestCtx,
        pool: &Arc<Pool>,
        backend: &Selected,
        demand: &Demand,
    ) -> Result<()> {
        self.prefilled = true;
        let body = self.upstream_source(ctx);
        let request_id = engine_request_id(ctx);
        let prefilled = super::disaggregation::prefill(
            sluice,
            session,
            ctx,
            pool,
            backend,
            demand,
            &body,
            &request_id,
        )
        .await;
        match prefilled {
            Ok(Some(transfer)) => self.transfer = Some(transfer),
            Ok(None) => {}
            Err(attempt::Outcome::ClientGone(e)) => return Err(e),
            Err(_) => {}
        }
        Ok(())
    }

    /// The request header, body, deadlines, hold and span of an attempt on `backend`.
    fn prepare(
        &mut self,
        sluice: &Sluice,
        session: &Session,
        ctx: &mut RequestCtx,
        pool: &Pool,
        backend: &Selected,
        in_flight: InFlight,
    ) -> Result<Prepared> {
        let span = tries::span(ctx, pool, backend.addr);
        if self.transfer.is_some() {
            crate::telemetry::pd_leg(&span, "decode");
        }
        let body = self.upstream_source(ctx);
        // A family that names the model in the path gets the pool's name there, and its
        // body is left as it is.
        let path = pool
            .served_model_for(ctx.model())
            .filter(|served| served.changes(ctx.model()))
            .zip(ctx.llm())
            .and_then(|(served, call)| {
                (call.endpoint.family()).path_with_model(&call.route, served.name())
            });
        let body = self.for_upstream(ctx, pool, body, path.is_none());
        let mut header = pool_header(sluice, session, ctx, pool, backend.addr, body.len())?;
        if let Some(path) = path {
            with_path(&mut header, &path)?;
        }
        let attempt = AttemptStart {
            number: ctx.progress().attempts,
            pool: &pool.name,
            backend: backend.addr,
            span: &span,
            prefill_leg: false,
        };
        sluice.chain.upstream_request(&mut header, &attempt, ctx)?;

        let escalation = ctx.escalation();
        let now = Instant::now();
        let started = Instant::from_std(ctx.started());
        let first_byte = match escalation.and_then(|e| e.first_byte_budget) {
            Some(budget) => budget.min(pool.settings.timeouts.first_byte),
            None => pool.settings.timeouts.first_byte,
        };
        let total = started
            .checked_add(pool.settings.timeouts.total_for(self.max_tokens))
            .unwrap_or_else(|| now + FAR_FUTURE);
        let deadlines = Deadlines {
            first_byte: now.checked_add(first_byte).unwrap_or(total).min(total),
            total,
        };
        let may_retry_here = self.retries_in_pool < pool.settings.retry.max_retries
            && pool.settings.retry.on != RetryOn::NONE
            && pool.retry_budget.has_retry();
        let hold = Hold {
            error_statuses: escalation.is_some() || may_retry_here,
            check: escalation
                .filter(|_| !self.is_stream)
                .and_then(|e| e.check.clone()),
            stream_check: escalation
                .filter(|_| self.is_stream)
                .and_then(|e| e.stream_check.clone()),
            context_budget: escalation.map(|_| self.output_budget),
        };
        Ok(Prepared {
            attempt: Attempt {
                peer: pool.peer(backend.addr),
                header,
                body,
                in_flight,
                // Only the first attempt's: a retry's time is the failed attempt's.
                received: self.received.take(),
            },
            deadlines,
            hold,
            span,
        })
    }

    /// The body an attempt starts from. A first pool may get its own body (a draft asked for
    /// logprobs), and every pool the plugins'; whichever it is gets the pool's model name,
    /// and asks for a stream's usage when a plugin wants it (see [`AttemptLoop::for_upstream`]).
    /// The client's body, which the cache keyed, stays.
    fn upstream_source(&self, ctx: &RequestCtx) -> Bytes {
        ctx.escalation()
            .and_then(|e| e.upstream_body.clone())
            .or_else(|| ctx.upstream_body().cloned())
            .unwrap_or_else(|| self.client_body.clone())
    }

    /// `body` as `pool` gets it: with the pool's served model name when it is not the
    /// client's (and `model_in_body`), a stream's usage asked for when a plugin wants it, the
    /// tenant's `cache_salt` and the engine's controls reset as the pool's `client_fields`
    /// say (as it is when nothing applies or it cannot be changed).
    fn for_upstream(
        &mut self,
        ctx: &RequestCtx,
        pool: &Pool,
        body: Bytes,
        model_in_body: bool,
    ) -> Bytes {
        let ask_usage = usage::usage_kept_from_client(ctx);
        let fields = pool.settings.client_fields;
        let request_id = fields.reset_engine_controls.then(|| engine_request_id(ctx));
        let transfer = self.transfer.as_ref().map(|t| t.params.clone());
        let edits = UpstreamEdits {
            ask_usage,
            kv_transfer_params: transfer.as_deref(),
            ..pool_edits(ctx, pool, model_in_body, request_id.as_deref())
        };
        let model = edits.model;
        if !edits.any() {
            return body;
        }
        // A decode leg's body is its own: it is neither taken from nor kept for the others.
        if transfer.is_some() {
            let seen = ctx
                .llm()
                .filter(|call| same_buffer(&call.body, &body))
                .map(|call| &call.request.seen);
            return model_name::upstream_body(&body, seen, &edits).unwrap_or(body);
        }
        if let Some(last) = &self.sent_body {
            if same_buffer(&last.from, &body)
                && last.model.as_deref() == model
                && last.ask_usage == ask_usage
                && last.client_fields == fields
            {
                return last.sent.clone();
            }
        }
        // What the core's parse saw of the body, when the body is the one it parsed.
        let seen = ctx
            .llm()
            .filter(|call| same_buffer(&call.body, &body))
            .map(|call| &call.request.seen);
        let sent = model_name::upstream_body(&body, seen, &edits).unwrap_or_else(|| body.clone());
        self.sent_body = Some(SentBody {
            from: body,
            model: model.map(<[u8]>::to_vec),
            ask_usage,
            client_fields: fields,
            sent: sent.clone(),
        });
        sent
    }

    /// Judges the backend by the attempt, counts it, and chooses what follows.
    async fn decide(
        &mut self,
        ctx: &mut RequestCtx,
        pool: &Pool,
        backend: &Selected,
        outcome: Outcome,
    ) -> Then {
        // A draft cut by the selector's first-byte budget, shorter than the pool's own bound,
        // was slower than the budget, not broken: it escalates without blame. (Three long
        // non-stream requests, which vLLM answers only once generated, ejected the draft.)
        let cut_by_budget = matches!(&outcome, Outcome::NotStarted(e) if e.etype() == &ErrorType::ReadTimedout)
            && ctx
                .escalation()
                .and_then(|e| e.first_byte_budget)
                .is_some_and(|budget| budget < pool.settings.timeouts.first_byte);
        let verdict = outcome
            .verdict(ctx.progress().upstream_status)
            .filter(|_| !cut_by_budget);
        if let Some(verdict) = verdict {
            tries::judge(pool, backend.addr, &backend.live, verdict);
        }
        match outcome {
            Outcome::Complete => Then::Finished(Ok(())),
            Outcome::NotStarted(e) => self.not_started(ctx, pool, backend.addr, e),
            Outcome::Declined(header, body) => {
                self.declined_answer(ctx, pool, backend.addr, header, body)
                    .await
            }
            Outcome::Judged(why, used) => {
                if let Some(used) = used {
                    // Not sent, but generated: the tenant is charged for it (N22).
                    ctx.progress_mut()
                        .discard(used, pool.settings.price_per_million_tokens);
                }
                if self.escalate(ctx, why) {
                    Then::TryAgain
                } else {
                    let rejected = ErrorReply::bad_gateway("The answer was rejected.");
                    Then::Finished(Err(rejected.into_error()))
                }
            }
            Outcome::Broken(e) => Then::Finished(Err(e)),
            Outcome::ClientGone(mut e) => {
                // Pingora's own write errors to the client carry no source: without it, a
                // client that reset its connection mid-answer counted as an internal error.
                e.as_down();
                Then::Finished(Err(e))
            }
        }
    }

    /// Every backend of the pool was tried (or none is usable).
    fn pool_exhausted(&mut self, ctx: &mut RequestCtx, pool: &Pool) -> Then {
        let why = if self.last_error.is_some() || self.declined.is_some() {
            reason::DRAFT_ERROR
        } else {
            reason::DRAFT_UNAVAILABLE
        };
        if self.escalate(ctx, why) {
            return Then::TryAgain;
        }
        if let Some((header, body)) = self.declined.take() {
            return Then::SendDeclined(header, body);
        }
        Then::Finished(Err(self
            .last_error
            .take()
            .unwrap_or_else(|| no_backend(pool))))
    }

    /// Nothing reached the client: another backend when the upstream cannot have acted on
    /// the request, else the escalation target, else the error.
    fn not_started(
        &mut self,
        ctx: &mut RequestCtx,
        pool: &Pool,
        backend: SocketAddr,
        e: Box<Error>,
    ) -> Then {
        tracing::warn!(
            pool = &*pool.name,
            backend = %backend,
            attempt = ctx.progress().attempts,
            "upstream attempt failed: {e}"
        );
        if is_connect_failure(&e) || e.retry() {
            if !is_connect_failure(&e) {
                // Sent, and never answered (see `attempt::Upstream::failed_before_answer`).
                metrics::inc(&metrics::UNANSWERED_RETRIES, &[&pool.name]);
            }
            // Another backend of the pool; when none is left, the escalation target.
            self.last_error = Some(e);
            return Then::TryAgain;
        }
        if is_timeout(&e)
            && pool.settings.retry.on.contains(RetryOn::TIMEOUT)
            && self.spend_retry(pool)
        {
            // Another backend of the pool (this one stays tried: it may still be generating).
            self.last_error = Some(e);
            return Then::TryAgain;
        }
        let why = if is_timeout(&e) {
            reason::DRAFT_TIMEOUT
        } else {
            reason::DRAFT_ERROR
        };
        if self.escalate(ctx, why) {
            self.last_error = Some(e);
            return Then::TryAgain;
        }
        Then::Finished(Err(e))
    }

    /// An error status was held back: a retry in the pool after backoff, within its budget;
    /// else the escalation target; else the answer as it is.
    async fn declined_answer(
        &mut self,
        ctx: &mut RequestCtx,
        pool: &Pool,
        backend: SocketAddr,
        header: Box<ResponseHeader>,
        body: Bytes,
    ) -> Then {
        tracing::info!(
            pool = &*pool.name,
            backend = %backend,
            "upstream answered {}",
            header.status.as_u16()
        );
        if pool.settings.retry.on.status(header.status.as_u16()) && self.spend_retry(pool) {
            self.declined = Some((header, body));
            tokio::time::sleep(pool.settings.retry.backoff(self.retries_in_pool)).await;
            // Any backend may take the retry, the same one included.
            self.tried.clear();
            return Then::TryAgain;
        }
        if self.escalate(ctx, reason::DRAFT_ERROR) {
            self.declined = Some((header, body));
            return Then::TryAgain;
        }
        Then::SendDeclined(header, body)
    }

    /// Takes one of the pool's retries for this request, if it has one left and the pool's
    /// budget allows.
    fn spend_retry(&mut self, pool: &Pool) -> bool {
        if self.retries_in_pool >= pool.settings.retry.max_retries || !pool.retry_budget.try_spend()
        {
            return false;
        }
        self.retries_in_pool += 1;
        metrics::inc(&metrics::POOL_RETRIES, &[&pool.name]);
        true
    }

    /// Moves the request to its escalation target, if it has one: the next attempts go there,
    /// with the client's own body. Returns whether it did.
    fn escalate(&mut self, ctx: &mut RequestCtx, why: &'static str) -> bool {
        let Some(escalation) = ctx.take_escalation() else {
            return false;
        };
        tracing::info!(
            from = ctx.pool_name(),
            to = &*escalation.target.name,
            "escalated: {why}"
        );
        // The attempt's event; the request's when no attempt was made (no backend left).
        let on = if self.attempt_span.is_none() {
            ctx.span()
        } else {
            &self.attempt_span
        };
        tracing::event!(
            target: sluice_sdk::SPAN_EVENTS,
            parent: on,
            tracing::Level::INFO,
            sluice.escalation.reason = why,
            sluice.escalation.to = &*escalation.target.name,
            "escalated"
        );
        escalation.target.retry_budget.deposit();
        ctx.escalate_to(escalation.target, why);
        self.tried.clear();
        self.retries_in_pool = 0;
        true
    }
}

/// Hands the attempt that just ended to the observers' `attempt_end` hooks: the core's
/// (attempt metrics, traces), then the plugins'.
fn report_attempt(
    sluice: &Sluice,
    ctx: &mut RequestCtx,
    pool: &Pool,
    backend: &Selected,
    started: std::time::Instant,
    outcome: &Outcome,
    span: &tracing::Span,
) {
    let report = AttemptReport {
        number: ctx.progress().attempts,
        pool: Arc::clone(&pool.name),
        backend: backend.addr,
        started,
        elapsed: started.elapsed(),
        status: ctx.progress().upstream_status,
        outcome: outcome.outcome(),
        span: span.clone(),
    };
    sluice.chain.attempt_end(&report, ctx);
}

/// What choosing `backend` leaves behind: the index's prediction kept for the answer's
/// check, the placement explained, a shared session's new home published (`shared_key`), and
/// the request's TTFT objective checked against the prediction.
fn placed(
    sluice: &Sluice,
    ctx: &mut RequestCtx,
    pool: &Pool,
    backend: &Selected,
    demand: &Demand,
    shared_key: Option<String>,
) -> Result<()> {
    if let Some(tokens) = backend.predicted_cached {
        ctx.state.insert(Predicted { tokens });
    }
    explain_placement(ctx, pool, backend);
    if let (Some(shared), Some(key), true) = (
        sluice.shared_sessions.as_ref(),
        shared_key,
        backend.session_rebound,
    ) {
        shared.publish(pool, key, backend.addr, demand.prompt_tokens);
    }
    meets_deadline(ctx, pool, backend)
}

/// What choosing a backend for the next attempt came to.
enum Step {
    /// A backend: the attempt goes there.
    Chosen(Box<Chosen>),
    /// No attempt: what follows instead (the pool had no backend left).
    Done(Then),
    /// Choose again (a reload came while the request waited for a backend).
    Again,
}

/// A backend chosen for an attempt, with what choosing it found.
struct Chosen {
    pool: Arc<Pool>,
    backend: Selected,
    demand: Demand,
    /// The request's place in the pool's fair order, kept until the attempt starts.
    held: Option<Held>,
}

/// What a client may not tell an engine: its trace context (whether vLLM traces a request is
/// the proxy's to say, see `telemetry::trace_upstream`), its baggage, and vLLM's pin of a
/// request to a data-parallel rank.
const ENGINE_FACING: [&str; 4] = [
    "traceparent",
    "tracestate",
    "baggage",
    "x-data-parallel-rank",
];

/// The edits every body sent to `pool` gets: the pool's served model name when it is not the
/// client's (and the body names the model, `model_in_body`), the tenant's `cache_salt`, and
/// the engine's controls reset (with `request_id`, given when the pool resets them).
pub(super) fn pool_edits<'a>(
    ctx: &'a RequestCtx,
    pool: &'a Pool,
    model_in_body: bool,
    request_id: Option<&'a str>,
) -> UpstreamEdits<'a> {
    let fields = pool.settings.client_fields;
    UpstreamEdits {
        model: pool
            .served_model_for(ctx.model())
            .filter(|served| model_in_body && served.changes(ctx.model()))
            .map(ServedModel::json),
        ask_usage: false,
        salt_for_tenant: ctx
            .tenant()
            .filter(|_| fields.tenant_cache_salt)
            .map(|t| &*t.name),
        reset_engine_controls: request_id.filter(|_| fields.reset_engine_controls),
        kv_transfer_params: None,
    }
}

/// The client's request header as `pool`'s backend `addr` gets it, for a body of `body_len`
/// bytes: forwarding headers set, the pool's header rules and credential applied.
pub(super) fn pool_header(
    sluice: &Sluice,
    session: &Session,
    ctx: &RequestCtx,
    pool: &Pool,
    addr: SocketAddr,
    body_len: usize,
) -> Result<RequestHeader> {
    let mut header = upstream_header(session.req_header(), body_len, addr)?;
    let peer = session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip());
    forwarding::prepare_request(&mut header, peer, &sluice.limits.trusted_proxies)?;
    forwarding::to_pool(&mut header, pool, None, ctx.tenant().is_some())?;
    Ok(header)
}

/// The request header an upstream gets: the client's, framed anew (the body by its exact
/// length, the `Expect` handshake done here), and sent as HTTP/1.1, which needs a `Host` (an
/// HTTP/1.0 client may have sent none), without the [`ENGINE_FACING`] headers. Hop-by-hop
/// headers go in [`forwarding`].
fn upstream_header(
    client: &RequestHeader,
    body_len: usize,
    backend: SocketAddr,
) -> Result<RequestHeader> {
    let mut header = client.clone();
    for name in ["transfer-encoding", "expect"]
        .into_iter()
        .chain(ENGINE_FACING)
    {
        header.remove_header(name);
    }
    header.insert_header(http::header::CONTENT_LENGTH, body_len)?;
    if !header.headers.contains_key(http::header::HOST) {
        header.insert_header(http::header::HOST, backend.to_string())?;
    }
    header.set_version(http::Version::HTTP_11);
    Ok(header)
}

/// Notes why `backend` was chosen, for the access log (`ttft_predicted_ms`,
/// `ttft_runner_up_ms`), and says it in a debug line.
fn explain_placement(ctx: &mut RequestCtx, pool: &Pool, backend: &Selected) {
    let Some(predicted_ttft) = backend.predicted_ttft else {
        ctx.progress_mut().placement = None;
        return;
    };
    let placement = Placement {
        predicted_ttft,
        runner_up: backend.runner_up,
        session_moved: backend.session_moved,
    };
    tracing::debug!(
        target: "sluice::placement",
        pool = &*pool.name,
        backend = %backend.addr,
        predicted_ttft_ms = predicted_ttft * 1000.0,
        runner_up = %placement.runner_up.map_or_else(|| "-".to_string(), |(addr, _)| addr.to_string()),
        runner_up_ttft_ms = placement.runner_up.map_or(f64::NAN, |(_, t)| t * 1000.0),
        cached_tokens = backend.cached_tokens,
        session_moved = backend.session_moved,
        "placed"
    );
    ctx.progress_mut().placement = Some(placement);
}

/// `header` with its path replaced by `path`, the client's query kept (a stream flag may be
/// there: Gemini's `?alt=sse`).
fn with_path(header: &mut RequestHeader, path: &str) -> Result<()> {
    let uri = match header.uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_string(),
    };
    let uri = http::Uri::try_from(uri).map_err(|e| {
        ErrorReply::internal(format!("The pool's served model name makes no path: {e}"))
            .into_error()
    })?;
    header.set_uri(uri);
    Ok(())
}

/// Whether `a` and `b` are the same buffer (a clone shares it): compared by address, not
/// byte by byte.
fn same_buffer(a: &Bytes, b: &Bytes) -> bool {
    a.as_ptr() == b.as_ptr() && a.len() == b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_with_the_model_keeps_the_clients_query() {
        let mut header = RequestHeader::build(
            "POST",
            b"/v1beta/models/public:streamGenerateContent?alt=sse",
            None,
        )
        .unwrap();
        with_path(&mut header, "/v1beta/models/served:streamGenerateContent").unwrap();
        assert_eq!(
            header.uri.to_string(),
            "/v1beta/models/served:streamGenerateContent?alt=sse"
        );
        assert!(with_path(&mut header, "/a b").is_err());
    }

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
        let mut up = upstream_header(&client, 1234, backend).unwrap();
        forwarding::prepare_request(&mut up, None, &[]).unwrap();
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
