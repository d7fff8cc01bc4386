//! Our own accept loop (so "refuse connections" can close and later rebind the same port), the
//! request router, and the response helpers every handler uses.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE, DATE, SERVER, VARY};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;

use crate::config::MetricsFlavor;
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
                    if !admin {
                        shared.stats.count_connection();
                    }
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

/// Answer headers in uvicorn's order: `date`, `server`, then the caller's, then `vary:
/// Origin` (vLLM's CORS middleware adds it to every answer).
fn uvicorn_headers(
    response: &mut HttpResponse,
    status: u16,
    extra: &[(hyper::header::HeaderName, HeaderValue)],
) {
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    if let Ok(date) = HeaderValue::from_str(&http_date(SystemTime::now())) {
        headers.insert(DATE, date);
    }
    headers.insert(SERVER, HeaderValue::from_static("uvicorn"));
    for (name, value) in extra {
        headers.insert(name, value.clone());
    }
    headers.insert(VARY, HeaderValue::from_static("Origin"));
}

pub fn full(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> HttpResponse {
    full_with(status, content_type, body, None)
}

/// As [`full`], with an `allow` header (a 405 names the methods the path takes).
fn full_with(
    status: u16,
    content_type: &'static str,
    body: impl Into<Bytes>,
    allow: Option<&'static str>,
) -> HttpResponse {
    let body: Bytes = body.into();
    let length = body.len();
    let mut response = Response::new(
        Full::new(body)
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    let mut extra = Vec::with_capacity(3);
    if let Some(allow) = allow {
        extra.push((ALLOW, HeaderValue::from_static(allow)));
    }
    extra.push((CONTENT_LENGTH, HeaderValue::from(length)));
    if !content_type.is_empty() {
        extra.push((CONTENT_TYPE, HeaderValue::from_static(content_type)));
    }
    uvicorn_headers(&mut response, status, &extra);
    response
}

pub fn json(status: u16, body: impl Into<Bytes>) -> HttpResponse {
    full(status, "application/json", body)
}

/// `date` as HTTP writes it (RFC 9110 IMF-fixdate): `Thu, 26 Nov 2026 13:47:34 GMT`.
fn http_date(now: SystemTime) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let seconds = now
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_secs())
        .unwrap_or(0);
    let days = seconds / 86_400;
    let of_day = seconds % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let shifted = days + 719_468;
    let era = shifted / 146_097;
    let day_of_era = shifted % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    let weekday = DAYS.get((days % 7) as usize).copied().unwrap_or("Thu");
    let month_name = MONTHS
        .get((month as usize).saturating_sub(1))
        .copied()
        .unwrap_or("Jan");
    format!(
        "{weekday}, {day:02} {month_name} {year} {:02}:{:02}:{:02} GMT",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    )
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
    uvicorn_headers(
        &mut response,
        status,
        &[(CONTENT_TYPE, HeaderValue::from_static(content_type))],
    );
    response
}

/// A streamed body that promises `length` bytes: the headers of a JSON answer.
pub fn with_content_length(
    status: u16,
    content_type: &'static str,
    body: Body,
    length: usize,
) -> HttpResponse {
    let mut response = Response::new(body);
    uvicorn_headers(
        &mut response,
        status,
        &[
            (CONTENT_LENGTH, HeaderValue::from(length)),
            (CONTENT_TYPE, HeaderValue::from_static(content_type)),
        ],
    );
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
    dispatch(&shared, &parts, body).await
}

/// Answers a read, authorized request by its method and path, as vLLM's router does.
async fn dispatch(shared: &Arc<Shared>, parts: &Parts, body: Bytes) -> HttpResponse {
    let path = parts.uri.path();
    // vLLM makes the client's X-Request-Id the answer's id (and does not echo the header).
    let request_id = parts
        .headers
        .get("x-request-id")
        .and_then(|value| value.to_str().ok());
    // An embedding model serves embeddings and none of the routes that generate; a
    // generative one answers `/v1/embeddings` with a 404, as vLLM 0.32 does.
    let pooling = shared.config.runner == crate::config::Runner::Pooling;
    let generates = matches!(
        path,
        "/v1/chat/completions" | "/v1/completions" | "/v1/messages" | "/v1/responses"
    ) || path.starts_with("/v1/responses/");
    if pooling && generates {
        return not_found();
    }
    match (&parts.method, path) {
        (&Method::POST, "/v1/embeddings") if pooling => handlers::embeddings(shared, &body).await,
        (&Method::POST, "/v1/chat/completions") => {
            handlers::completion(shared, Kind::Chat, body, request_id).await
        }
        (&Method::POST, "/v1/completions") => {
            handlers::completion(shared, Kind::Completion, body, request_id).await
        }
        (&Method::GET, "/v1/models") => handlers::models(shared),
        (&Method::POST, "/v1/messages") => handlers::messages(shared, body, request_id).await,
        (&Method::POST, "/v1/responses") => handlers::responses(shared, body, request_id).await,
        (&Method::GET, _) if path.starts_with("/v1/responses/") => {
            let id = path.trim_start_matches("/v1/responses/");
            handlers::stored_response(shared, id, false)
        }
        (&Method::POST, _) if path.starts_with("/v1/responses/") && path.ends_with("/cancel") => {
            let id = path
                .trim_start_matches("/v1/responses/")
                .trim_end_matches("/cancel");
            handlers::stored_response(shared, id, true)
        }
        (&Method::POST, "/v1/messages/count_tokens") => handlers::count_tokens(shared, &body),
        (&Method::POST, "/tokenize") => handlers::tokenize_route(shared, &body),
        (&Method::POST, "/detokenize") => handlers::detokenize_route(shared, &body),
        (&Method::POST, "/v1/load_lora_adapter" | "/v1/unload_lora_adapter") => {
            lora_adapter(shared, path, &body)
        }
        (&Method::POST, "/reset_prefix_cache") => reset_prefix_cache(shared),
        (&Method::GET, "/kv_event_sources") => json(
            200,
            match &shared.config.kv_event_sources {
                Some(sources) => sources.to_string().into_bytes(),
                None => crate::kv_events::sources_body(shared.kv_events.as_ref()),
            },
        ),
        (&Method::GET, "/health") => health(shared),
        (&Method::GET, "/metrics") => full(
            200,
            metrics_content_type(shared.config.metrics),
            shared.metrics_text(),
        ),
        (&Method::GET, "/version") => version(shared),
        (
            _,
            "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/messages"
            | "/v1/messages/count_tokens"
            | "/tokenize"
            | "/detokenize",
        ) => method_not_allowed("POST"),
        (_, "/v1/models" | "/health" | "/metrics" | "/version" | "/kv_event_sources") => {
            method_not_allowed("GET")
        }
        _ => not_found(),
    }
}

/// Loads or unloads a LoRA adapter: vLLM serves these with
/// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and answers 404 without it.
fn lora_adapter(shared: &Shared, path: &str, body: &Bytes) -> HttpResponse {
    let Some(adapters) = &shared.lora else {
        return not_found();
    };
    let answer = if path == "/v1/load_lora_adapter" {
        adapters.load(body, &shared.served_names)
    } else {
        adapters.unload(body)
    };
    match answer {
        Ok(text) => full(200, "text/plain; charset=utf-8", Bytes::from(text)),
        Err(failure) => error(shared, &failure),
    }
}

/// Empties the prefix cache: vLLM serves this with VLLM_SERVER_DEV_MODE=1.
fn reset_prefix_cache(shared: &Shared) -> HttpResponse {
    if let Some(cache) = &shared.prefix_cache {
        cache.clear();
    }
    full(200, "application/json", Bytes::new())
}

/// `GET /version`: the vLLM version the simulator answers as.
fn version(shared: &Shared) -> HttpResponse {
    let version = if shared.config.error_shape.is_v0_32() {
        crate::VLLM_0_32
    } else {
        "0.11.0"
    };
    json(200, format!("{{\"version\":\"{version}\"}}"))
}

/// vLLM 0.32's prometheus_client writes exposition format 1.0.0; the V0 generation 0.0.4.
fn metrics_content_type(flavor: MetricsFlavor) -> &'static str {
    match flavor {
        MetricsFlavor::V1 => "text/plain; version=1.0.0; charset=utf-8",
        MetricsFlavor::V0 => "text/plain; version=0.0.4; charset=utf-8",
    }
}

/// Starlette's 405, naming the method the path takes (even `HEAD /health`: vLLM's route
/// takes GET alone).
fn method_not_allowed(allow: &'static str) -> HttpResponse {
    full_with(
        405,
        "application/json",
        &br#"{"detail":"Method Not Allowed"}"#[..],
        Some(allow),
    )
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
