//! One health-check request: `GET path` to a backend, with a deadline over the whole
//! exchange, through Pingora's HTTP/1 connector (vLLM serves HTTP/1.1) so that connections
//! are reused between checks.

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use pingora_core::connectors::http::v1::Connector;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType};
use pingora_http::RequestHeader;
use sluice_sdk::{Pool, UpstreamAuth};
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

/// The largest `/metrics` page read; vLLM's is about 100 KiB with its histograms.
const MAX_BODY: usize = 8 << 20;

/// What a backend answered.
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// Why a check got no answer.
pub enum Failure {
    Timeout,
    Error(Box<Error>),
}

/// The peer for health checks: the pool's TLS settings, the check's timeout.
pub fn peer(pool: &Pool, backend: SocketAddr) -> HttpPeer {
    with_timeout(pool.peer(backend), pool.settings.health.timeout)
}

/// `peer` with `timeout` on its connect, reads and writes.
pub fn with_timeout(mut peer: HttpPeer, timeout: Duration) -> HttpPeer {
    let o = &mut peer.options;
    o.connection_timeout = Some(timeout);
    o.total_connection_timeout = Some(timeout);
    o.read_timeout = Some(timeout);
    o.write_timeout = Some(timeout);
    peer
}

// The functions below return their futures rather than being `async fn`s: each layer of
// `async fn` would keep the exchange's future inside its own and copy it in when first
// polled, and a checker makes two exchanges every check.

/// `GET path` with `deadline` over connect, request and the whole body.
pub fn get<'a>(
    connector: &'a Connector,
    peer: &'a HttpPeer,
    host: &'a str,
    path: &'a str,
    deadline: Duration,
) -> impl Future<Output = Result<Answer, Failure>> + 'a {
    get_with(connector, peer, host, path, deadline, None)
}

/// [`get`], its body read into `buffer` (emptied first): a checker that scrapes the same page
/// every 250 ms keeps one buffer, rather than having fresh pages of memory zeroed for each
/// page it reads (see [`Answer::into_buffer`]).
pub fn get_into<'a>(
    connector: &'a Connector,
    peer: &'a HttpPeer,
    host: &'a str,
    path: &'a str,
    deadline: Duration,
    buffer: BytesMut,
) -> impl Future<Output = Result<Answer, Failure>> + 'a {
    within(
        deadline,
        exchange(connector, peer, host, path, None, buffer),
    )
}

impl Answer {
    /// The body's buffer back, empty, when nothing else holds it.
    pub fn into_buffer(self) -> Option<BytesMut> {
        let mut buffer = self.body.try_into_mut().ok()?;
        buffer.clear();
        Some(buffer)
    }
}

/// [`get`] with the pool's upstream credential, for what vLLM's `--api-key` guards
/// (`/v1/models`; `/health` and `/metrics` are open).
pub fn get_with<'a>(
    connector: &'a Connector,
    peer: &'a HttpPeer,
    host: &'a str,
    path: &'a str,
    deadline: Duration,
    auth: Option<&'a UpstreamAuth>,
) -> impl Future<Output = Result<Answer, Failure>> + 'a {
    within(
        deadline,
        exchange(connector, peer, host, path, auth, BytesMut::new()),
    )
}

/// An exchange's answer, or why there is none, within `deadline`.
pub fn within<F>(deadline: Duration, exchange: F) -> impl Future<Output = Result<Answer, Failure>>
where
    F: Future<Output = Result<Answer, Box<Error>>>,
{
    tokio::time::timeout(deadline, exchange).map(|timed| match timed {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(Failure::Error(e)),
        Err(_) => Err(Failure::Timeout),
    })
}

async fn exchange(
    connector: &Connector,
    peer: &HttpPeer,
    host: &str,
    path: &str,
    auth: Option<&UpstreamAuth>,
    body: BytesMut,
) -> Result<Answer, Box<Error>> {
    let mut request = RequestHeader::build("GET", path.as_bytes(), None)?;
    request.insert_header(http::header::HOST, host)?;
    request.insert_header(http::header::USER_AGENT, "sluice-health")?;
    if let Some(auth) = auth {
        request.insert_header(auth.header.clone(), auth.value.clone())?;
    }
    send(connector, peer, request, None, body, MAX_BODY).await
}

/// Sends `request` (with `payload`, when it has one) and reads the whole answer into
/// `body` (emptied first), at most `max_body` bytes of it: a larger answer is an error, and
/// its connection is not reused. Without a deadline of its own: see [`within`].
pub async fn send(
    connector: &Connector,
    peer: &HttpPeer,
    request: RequestHeader,
    payload: Option<Bytes>,
    mut body: BytesMut,
    max_body: usize,
) -> Result<Answer, Box<Error>> {
    // An idle connection is taken first, by a small future. Only without one is the connect
    // future made: with its TLS handshake it is about 18 KB, built and copied into its box at
    // every check when it was asked first (boxed: inline, it would size every check's
    // future, which is moved as it is made, joined and timed).
    let mut session = match connector.reused_http_session(peer).await {
        Some(idle) => idle,
        None => Box::pin(connector.get_http_session(peer)).await?.0,
    };
    session.write_request_header(Box::new(request)).await?;
    if let Some(payload) = payload {
        session.write_body(&payload).await?;
    }
    session.finish_body().await?;
    session.read_response().await?;
    let status = session.get_status().map_or(0, |s| s.as_u16());
    // Sized once by the answer's length when it says (a metrics page is tens of KB: grown
    // from nothing, it would be copied a few times over).
    let length = session
        .get_header(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    body.clear();
    body.reserve(length.min(max_body));
    // The body is read from the session's own buffer into `body`: `read_body_bytes` would
    // copy each chunk into a `Bytes` first, a second copy of every page scraped.
    while let Some(chunk) = session.read_body_ref().await? {
        append(&mut body, chunk, max_body)?;
    }
    // Whole answers only: a connection cut mid-body fails above, and is not reused.
    connector
        .release_http_session(session, peer, peer.options.idle_timeout)
        .await;
    Ok(Answer {
        status,
        body: body.freeze(),
    })
}

/// Adds `chunk` to `body`, unless the body would pass `max_body`.
fn append(body: &mut BytesMut, chunk: &[u8], max_body: usize) -> Result<(), Box<Error>> {
    if body.len() + chunk.len() > max_body {
        return Err(Error::explain(
            ErrorType::Custom(TOO_LARGE),
            "the answer is too large",
        ));
    }
    body.extend_from_slice(chunk);
    Ok(())
}

/// The error type of an answer larger than its reader allows (see [`send`]).
pub const TOO_LARGE: &str = "AnswerTooLarge";

/// The `result` label of `sluice_health_checks_total`.
pub fn result_label(outcome: &Result<Answer, Failure>, good: bool) -> &'static str {
    match outcome {
        _ if good => "ok",
        Ok(_) => "bad_status",
        Err(Failure::Timeout) => "timeout",
        Err(Failure::Error(_)) => "error",
    }
}

/// A short description for logs.
pub fn describe(outcome: &Result<Answer, Failure>) -> String {
    match outcome {
        Ok(a) => format!("status {}", a.status),
        Err(Failure::Timeout) => "timed out".into(),
        Err(Failure::Error(e)) => e.to_string(),
    }
}
