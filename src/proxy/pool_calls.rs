//! The core's side of [`sluice_sdk::calls`]: a plugin's own request to a pool (the semantic
//! cache's embeddings) goes where an attempt of that pool would go, and counts where one
//! would count: the backend is chosen by the pool's balancing among its usable backends,
//! the call is in flight there while it runs, its end is judged for passive health (a
//! connection that fails, a timeout or a 5xx count against the backend), and it is counted
//! in `sluice_upstream_attempts_total` under the pool's name. It carries the pool's
//! credential and header rules, as every request to the pool does. It is not queued by the
//! pool's admission control (a call waits for nothing but its deadline).
//!
//! Calls are small exchanges read whole, so they go through the connector the health
//! checks use (kept idle between calls), not the LLM attempts' streaming pipe.

use crate::health::probe;
use crate::metrics;
use async_trait::async_trait;
use bytes::BytesMut;
use pingora_core::connectors::http::v1::Connector;
use pingora_error::ErrorType;
use pingora_http::RequestHeader;
use sluice_sdk::calls::{Answer, Call, CallFailed, PoolCalls};
use sluice_sdk::{AttemptOutcome, Demand, Pool, Verdict};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

/// The connector every generation's calls share: the server's (its upstream TLS settings),
/// set once it is built; a process that never builds one (`sluice -t`, a test of the config)
/// makes one of its own on the first call.
static CONNECTOR: OnceLock<Arc<Connector>> = OnceLock::new();

/// Calls go through `connector` (the health checks'), when the server has one.
pub fn use_connector(connector: Arc<Connector>) {
    let _ = CONNECTOR.set(connector);
}

fn connector() -> &'static Connector {
    CONNECTOR.get_or_init(|| Arc::new(Connector::new(None)))
}

/// How many backends one call tries at most: a second when the first could not be
/// connected to (or failed before answering), while the deadline lasts.
const MAX_TRIES: usize = 2;

/// The core's [`PoolCalls`].
#[derive(Debug, Default)]
pub struct CoreCalls;

#[async_trait]
impl PoolCalls for CoreCalls {
    async fn post(&self, pool: &Arc<Pool>, call: Call<'_>) -> Result<Answer, CallFailed> {
        let deadline = tokio::time::Instant::now() + call.deadline;
        let mut tried: Vec<SocketAddr> = Vec::with_capacity(MAX_TRIES);
        let mut failed = CallFailed::NoBackend;
        while tried.len() < MAX_TRIES {
            let Some(backend) = pool.select(&tried, &Demand::default()) else {
                break;
            };
            tried.push(backend.addr);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(CallFailed::Timeout);
            }
            let in_flight = backend.live.begin(0);
            let sent = probe::within(left, exchange(pool, backend.addr, &call)).await;
            drop(in_flight);
            let (verdict, outcome, step) = judged(sent);
            metrics::attempt(&pool.name, outcome);
            super::tries::judge(pool, backend.addr, &backend.live, verdict);
            match step {
                Step::Done(answer) => return answer,
                Step::Next(why) => failed = why,
            }
        }
        Err(failed)
    }
}

/// What follows a try: its result, or another backend (the call never reached this one).
enum Step {
    Done(Result<Answer, CallFailed>),
    Next(CallFailed),
}

/// A try's verdict for passive health, its `sluice_upstream_attempts_total` outcome, and
/// what follows it. Only a call that never reached its backend is sent again: an answer that
/// broke may have been worked on. An answer too large is the caller's limit, not the
/// backend's fault.
fn judged(sent: Result<probe::Answer, probe::Failure>) -> (Verdict, AttemptOutcome, Step) {
    match sent {
        Ok(answer) => {
            let verdict = if answer.status >= 500 {
                Verdict::Failure
            } else {
                Verdict::Success
            };
            let answer = Answer {
                status: answer.status,
                body: answer.body,
            };
            (verdict, AttemptOutcome::Response, Step::Done(Ok(answer)))
        }
        Err(probe::Failure::Timeout) => (
            Verdict::Failure,
            AttemptOutcome::Timeout,
            Step::Done(Err(CallFailed::Timeout)),
        ),
        Err(probe::Failure::Error(e)) if e.etype() == &ErrorType::Custom(probe::TOO_LARGE) => (
            Verdict::Success,
            AttemptOutcome::Error,
            Step::Done(Err(CallFailed::TooLarge)),
        ),
        Err(probe::Failure::Error(e)) if connect_failed(&e) => (
            Verdict::Failure,
            AttemptOutcome::ConnectError,
            Step::Next(CallFailed::Failed(e.to_string())),
        ),
        Err(probe::Failure::Error(e)) => (
            Verdict::Failure,
            AttemptOutcome::Error,
            Step::Done(Err(CallFailed::Failed(e.to_string()))),
        ),
    }
}

/// `POST call.path` to `backend` of `pool`, the answer read whole.
async fn exchange(
    pool: &Pool,
    backend: SocketAddr,
    call: &Call<'_>,
) -> Result<probe::Answer, Box<pingora_error::Error>> {
    let mut request = RequestHeader::build("POST", call.path.as_bytes(), None)?;
    request.insert_header(http::header::HOST, backend.to_string())?;
    request.insert_header(http::header::CONTENT_TYPE, "application/json")?;
    request.insert_header(http::header::CONTENT_LENGTH, call.body.len())?;
    request.insert_header(http::header::USER_AGENT, "sluice")?;
    super::forwarding::to_pool(&mut request, pool, None, false)?;
    let peer = probe::with_timeout(pool.peer(backend), call.deadline);
    probe::send(
        connector(),
        &peer,
        request,
        Some(call.body.clone()),
        BytesMut::new(),
        call.max_answer,
    )
    .await
}

/// Nothing reached the backend: [`super::attempt::is_connect_failure`], or a TLS handshake
/// or a local bind that failed.
fn connect_failed(e: &pingora_error::Error) -> bool {
    super::attempt::is_connect_failure(e)
        || matches!(
            e.etype(),
            ErrorType::TLSHandshakeFailure | ErrorType::BindError
        )
}
