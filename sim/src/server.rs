//! Our own accept loop (so "refuse connections" can close and later rebind the same port), the
//! request router, and the response helpers every handler uses.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;

use crate::control;
use crate::handlers;
use crate::openai::{self, ApiError, Kind};
use crate::stats::RecordedRequest;
use crate::Shared;

pub type Body = BoxBody<Bytes, io::Error>;
pub type HttpResponse = Response<Body>;

pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // Rebinding the same port right after "refuse connections" needs SO_REUSEADDR.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

pub async fn accept_loop(shared: Arc<Shared>, mut listener: Option<TcpListener>, admin: bool) {
    let mut refuse_changes = shared.refuse_tx.subscribe();
    let mut shutdown_changes = shared.shutdown_tx.subscribe();
    let addr = match &listener {
        Some(bound) => bound.local_addr().unwrap_or(shared.addr),
        None => shared.addr,
    };
    loop {
        if *shutdown_changes.borrow_and_update() {
            break;
        }
        let refusing = !admin && *refuse_changes.borrow_and_update();
        if refusing {
            if listener.take().is_some() {
                tracing::info!(%addr, "refusing connections: listener closed");
            }
            tokio::select! {
                _ = refuse_changes.changed() => {}
                _ = shutdown_changes.changed() => {}
            }
            continue;
        }
        let accepting = match &listener {
            Some(bound) => bound,
            None => match bind(addr) {
                Ok(bound) => {
                    tracing::info!(%addr, "accepting connections again");
                    listener.insert(bound)
                }
                Err(error) => {
                    tracing::warn!(%addr, %error, "rebind failed, retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        tokio::select! {
            accepted = accepting.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve_connection(Arc::clone(&shared), stream, admin));
                }
                Err(error) => {
                    // Usually EMFILE: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = refuse_changes.changed() => {}
            _ = shutdown_changes.changed() => {}
        }
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream, admin: bool) {
    let mut kills = shared.kill_tx.subscribe();
    kills.borrow_and_update();
    let service_shared = Arc::clone(&shared);
    let service = hyper::service::service_fn(move |request| {
        let shared = Arc::clone(&service_shared);
        async move { Ok::<_, Infallible>(route(shared, request, admin).await) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        ended = connection => {
            if let Err(error) = ended {
                tracing::debug!(%error, "connection ended with error");
            }
        }
        // The admin port survives "refuse connections" but not shutdown.
        _ = async {
            loop {
                if kills.changed().await.is_err() { break; }
                if !admin || *shared.shutdown_tx.borrow() { break; }
            }
        } => {}
    }
}

pub fn full(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> HttpResponse {
    let mut response = Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if !content_type.is_empty() {
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    response
        .headers_mut()
        .insert("server", HeaderValue::from_static("uvicorn"));
    response
}

pub fn json(status: u16, body: impl Into<Bytes>) -> HttpResponse {
    full(status, "application/json", body)
}

/// A body fed from a channel: every item is written as its own chunk when it arrives; an
/// `Err` item aborts the connection (no chunked terminator).
pub fn channel_body(receiver: mpsc::Receiver<Result<Bytes, io::Error>>) -> Body {
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver
            .recv()
            .await
            .map(|item| (item.map(Frame::data), receiver))
    });
    BodyExt::boxed(StreamBody::new(stream))
}

pub fn stream_response(status: u16, content_type: &'static str, body: Body) -> HttpResponse {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
        .headers_mut()
        .insert("server", HeaderValue::from_static("uvicorn"));
    response
}

pub fn with_content_length(mut response: HttpResponse, length: usize) -> HttpResponse {
    response
        .headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(length));
    response
}

/// An error answer in the configured shape, counted in the stats.
pub fn error(shared: &Shared, error: &ApiError) -> HttpResponse {
    shared.stats.count_error();
    json(
        error.status,
        openai::error_body(shared.config.error_shape, error),
    )
}

pub async fn read_body(shared: &Shared, body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, shared.config.max_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) => Err(ApiError::new(
            413,
            format!("Request body could not be read: {error}"),
        )),
    }
}

async fn route(shared: Arc<Shared>, request: Request<Incoming>, admin: bool) -> HttpResponse {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path();
    if let Some(control_path) = path.strip_prefix("/sim/") {
        return control::serve(&shared, &parts.method, control_path, body).await;
    }
    if admin && path != "/metrics" {
        return error(&shared, &ApiError::new(404, "Not Found"));
    }
    shared.stats.count(path);
    let body = match read_body(&shared, body).await {
        Ok(body) => body,
        Err(read_error) => return error(&shared, &read_error),
    };
    if shared.stats.wants_requests() {
        shared.stats.record(recorded(&parts, &body));
    }
    if path.starts_with("/v1") && !authorized(&shared, &parts) {
        return json(401, &br#"{"error":"Unauthorized"}"#[..]);
    }
    match (&parts.method, path) {
        (&Method::POST, "/v1/chat/completions") => {
            handlers::completion(&shared, Kind::Chat, body).await
        }
        (&Method::POST, "/v1/completions") => {
            handlers::completion(&shared, Kind::Completion, body).await
        }
        (&Method::GET, "/v1/models") => handlers::models(&shared),
        (&Method::GET, "/health") => health(&shared),
        (&Method::GET, "/metrics") => full(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            shared.metrics_text(),
        ),
        (&Method::GET, "/version") => json(200, &br#"{"version":"0.11.0"}"#[..]),
        (
            _,
            "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/models"
            | "/health"
            | "/metrics"
            | "/version",
        ) => json(405, &br#"{"detail":"Method Not Allowed"}"#[..]),
        _ => not_found(),
    }
}

/// Whether the request carries the instance's API key, when it has one (vLLM's `--api-key`).
fn authorized(shared: &Shared, parts: &Parts) -> bool {
    let Some(key) = &shared.config.api_key else {
        return true;
    };
    parts
        .headers
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        == Some(key.as_str())
}

pub fn not_found() -> HttpResponse {
    json(404, &br#"{"detail":"Not Found"}"#[..])
}

/// The request as received, for `Sim::stats().recent`.
fn recorded(parts: &Parts, body: &Bytes) -> RecordedRequest {
    RecordedRequest {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|path_and_query| path_and_query.as_str().to_string())
            .unwrap_or_else(|| parts.uri.path().to_string()),
        headers: parts
            .headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: body.clone(),
    }
}

/// vLLM's `/health`: 200 with an empty body, 503 once the engine is dead.
fn health(shared: &Shared) -> HttpResponse {
    if shared.faults().engine_dead {
        shared.stats.count_error();
        full(503, "", Bytes::new())
    } else {
        full(200, "", Bytes::new())
    }
}
