//! Our own accept loop (so "refuse connections" can close and later rebind the same port) and
//! the request router.

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
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::mpsc;

use crate::faults::Faults;
use crate::handlers;
use crate::openai::{self, ApiError, Kind};
use crate::stats::{RecordedRequest, StatsJson};
use crate::Shared;

pub type Body = BoxBody<Bytes, io::Error>;
pub type Resp = Response<Body>;

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
    let mut refuse_rx = shared.refuse_tx.subscribe();
    let mut shut_rx = shared.shutdown_tx.subscribe();
    let addr = match &listener {
        Some(l) => l.local_addr().unwrap_or(shared.addr),
        None => shared.addr,
    };
    loop {
        if *shut_rx.borrow_and_update() {
            break;
        }
        let refusing = !admin && *refuse_rx.borrow_and_update();
        if refusing {
            if listener.take().is_some() {
                tracing::info!(%addr, "refusing connections: listener closed");
            }
            tokio::select! {
                _ = refuse_rx.changed() => {}
                _ = shut_rx.changed() => {}
            }
            continue;
        }
        let l = match &listener {
            Some(l) => l,
            None => match bind(addr) {
                Ok(l) => {
                    tracing::info!(%addr, "accepting connections again");
                    listener.insert(l)
                }
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "rebind failed, retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        tokio::select! {
            r = l.accept() => match r {
                Ok((stream, _peer)) => {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve_conn(Arc::clone(&shared), stream, admin));
                }
                Err(e) => {
                    // Usually EMFILE: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = refuse_rx.changed() => {}
            _ = shut_rx.changed() => {}
        }
    }
}

async fn serve_conn(shared: Arc<Shared>, stream: tokio::net::TcpStream, admin: bool) {
    let mut kill = shared.kill_tx.subscribe();
    kill.borrow_and_update();
    let svc_shared = Arc::clone(&shared);
    let svc = hyper::service::service_fn(move |req| {
        let s = Arc::clone(&svc_shared);
        async move { Ok::<_, Infallible>(route(s, req, admin).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended with error");
            }
        }
        // The admin port survives "refuse connections" but not shutdown.
        _ = async {
            loop {
                if kill.changed().await.is_err() { break; }
                if !admin || *shared.shutdown_tx.borrow() { break; }
            }
        } => {}
    }
}

pub fn full(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if !content_type.is_empty() {
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    r.headers_mut()
        .insert("server", HeaderValue::from_static("uvicorn"));
    r
}

pub fn json(status: u16, body: impl Into<Bytes>) -> Resp {
    full(status, "application/json", body)
}

/// A body fed from a channel: every item is written as its own chunk when it arrives; an
/// `Err` item aborts the connection (no chunked terminator).
pub fn channel_body(rx: mpsc::Receiver<Result<Bytes, io::Error>>) -> Body {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item.map(Frame::data), rx))
    });
    BodyExt::boxed(StreamBody::new(stream))
}

pub fn stream_response(status: u16, content_type: &'static str, body: Body) -> Resp {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut()
        .insert("server", HeaderValue::from_static("uvicorn"));
    r
}

pub fn with_content_length(mut r: Resp, len: usize) -> Resp {
    r.headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(len));
    r
}

pub fn error(shared: &Shared, e: &ApiError) -> Resp {
    shared.stats.count_error();
    json(e.status, openai::error_body(shared.cfg.error_shape, e))
}

async fn read_body(shared: &Shared, body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, shared.cfg.max_body_bytes)
        .collect()
        .await
    {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(ApiError::new(
            413,
            format!("Request body could not be read: {e}"),
        )),
    }
}

async fn route(shared: Arc<Shared>, req: Request<Incoming>, admin: bool) -> Resp {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path();
    if let Some(rest) = path.strip_prefix("/sim/") {
        return control(&shared, &parts.method, rest, body).await;
    }
    if admin && path != "/metrics" {
        return error(&shared, &ApiError::new(404, "Not Found"));
    }
    shared.stats.count(path);
    let body = match read_body(&shared, body).await {
        Ok(b) => b,
        Err(e) => return error(&shared, &e),
    };
    if shared.stats.wants_requests() {
        shared.stats.record(RecordedRequest {
            method: parts.method.to_string(),
            path: parts
                .uri
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(|| path.to_string()),
            headers: parts
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_string(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: body.clone(),
        });
    }
    match (&parts.method, path) {
        (&Method::POST, "/v1/chat/completions") => {
            handlers::completion(&shared, Kind::Chat, body).await
        }
        (&Method::POST, "/v1/completions") => {
            handlers::completion(&shared, Kind::Completion, body).await
        }
        (&Method::GET, "/v1/models") => handlers::models(&shared),
        (&Method::GET, "/health") => {
            if shared.faults().engine_dead {
                shared.stats.count_error();
                full(503, "", Bytes::new())
            } else {
                full(200, "", Bytes::new())
            }
        }
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
        _ => json(404, &br#"{"detail":"Not Found"}"#[..]),
    }
}

/// `/sim/faults` (GET, POST) and `/sim/stats` (GET).
async fn control(shared: &Arc<Shared>, method: &Method, rest: &str, body: Incoming) -> Resp {
    match (method, rest) {
        (&Method::GET, "faults") => json(
            200,
            serde_json::to_vec(&*shared.faults()).unwrap_or_default(),
        ),
        (&Method::POST | &Method::PUT, "faults") => {
            let bytes = match read_body(shared, body).await {
                Ok(b) => b,
                Err(e) => return json(400, openai::error_body(shared.cfg.error_shape, &e)),
            };
            let parsed: Result<Faults, _> = if bytes.iter().all(u8::is_ascii_whitespace) {
                Ok(Faults::default())
            } else {
                serde_json::from_slice(&bytes)
            };
            match parsed {
                Ok(f) => {
                    tracing::info!(faults = ?f, "faults set");
                    shared.set_faults(f);
                    json(
                        200,
                        serde_json::to_vec(&*shared.faults()).unwrap_or_default(),
                    )
                }
                Err(e) => json(
                    400,
                    openai::error_body(
                        shared.cfg.error_shape,
                        &ApiError::bad_request(format!("invalid faults: {e}")),
                    ),
                ),
            }
        }
        (&Method::DELETE, "faults") => {
            shared.set_faults(Faults::default());
            json(
                200,
                serde_json::to_vec(&Faults::default()).unwrap_or_default(),
            )
        }
        (&Method::GET, "stats") => {
            let s = shared.stats();
            json(
                200,
                serde_json::to_vec(&StatsJson::new(&s)).unwrap_or_default(),
            )
        }
        _ => json(404, &br#"{"detail":"Not Found"}"#[..]),
    }
}
