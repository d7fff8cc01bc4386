//! vLLM's `MooncakeConnector`, as far as a router sees it.
//!
//! The router mints a `transfer_id` and sends it with both legs. The prefill leg
//! (`{"do_remote_decode": true, "transfer_id": ...}`) keeps its blocks under it, and its
//! answer says nothing of them. The decode leg names the prefill engine
//! (`{"do_remote_prefill": true, "remote_bootstrap_addr": "http://host:port",
//! "remote_engine_id": ..., "transfer_id": ...}`): the decode engine asks that bootstrap
//! server (`GET /query`) where the engine's workers are, then pulls the blocks. A router
//! reads the same `/query` to learn the engine id of each data-parallel rank: vLLM answers
//! `{"<dp_rank>": {"engine_id": ..., "worker_addr": {"<tp_rank>": {"<pp_rank>": "host:port"}}}}`.
//! Here one engine is one rank, and its worker's address is the side channel.

use super::{read_remote, ReadFailure, RemoteBlocks};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpStream};

/// The largest `/query` answer a decode engine reads.
const MAX_QUERY: usize = 64 * 1024;

/// A decode leg's pull: the blocks kept under `transfer_id` by the engine `engine_id`,
/// whose bootstrap server is `bootstrap` (`http://host:port`).
#[derive(Clone, Debug, PartialEq)]
pub struct MooncakePull {
    pub transfer_id: String,
    pub bootstrap: String,
    pub engine_id: String,
}

/// Serves the bootstrap server's `GET /query` on `addr` (port 0: a free one) until the
/// process ends; returns where it listens.
pub async fn serve_bootstrap(
    addr: SocketAddr,
    engine_id: String,
    side_channel: SocketAddr,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let answer = Bytes::from(
        json!({"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": side_channel.to_string()}}}})
            .to_string(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: Request<_>| {
                    let answer = answer.clone();
                    async move {
                        let found =
                            request.method() == Method::GET && request.uri().path() == "/query";
                        let (status, body) = if found {
                            (StatusCode::OK, answer)
                        } else {
                            (
                                StatusCode::NOT_FOUND,
                                Bytes::from_static(br#"{"detail":"Not Found"}"#),
                            )
                        };
                        let mut response = Response::new(Full::new(body));
                        *response.status_mut() = status;
                        response.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(bound)
}

/// Pulls `pull`'s blocks: the prefill engine's worker found through its bootstrap server.
pub async fn pull(pull: &MooncakePull) -> Result<u32, ReadFailure> {
    let workers = query(&pull.bootstrap).await?;
    let worker = workers
        .as_object()
        .into_iter()
        .flat_map(|ranks| ranks.values())
        .find(|rank| rank.get("engine_id").and_then(Value::as_str) == Some(&pull.engine_id))
        .and_then(|rank| rank.pointer("/worker_addr/0/0"))
        .and_then(Value::as_str)
        .and_then(|addr| addr.parse::<SocketAddr>().ok())
        .ok_or_else(|| {
            ReadFailure::Refused(format!(
                "the bootstrap server knows no engine {:?}",
                pull.engine_id
            ))
        })?;
    read_remote(&RemoteBlocks {
        engine_id: pull.engine_id.clone(),
        request_id: pull.transfer_id.clone(),
        block_ids: Vec::new(),
        host: worker.ip().to_string(),
        port: worker.port(),
        prefill_cached: None,
    })
    .await
}

/// `GET {bootstrap}/query`.
async fn query(bootstrap: &str) -> Result<Value, ReadFailure> {
    let unreachable = |e: &dyn std::fmt::Display| ReadFailure::Unreachable(e.to_string());
    let authority = bootstrap
        .strip_prefix("http://")
        .ok_or_else(|| unreachable(&format!("{bootstrap:?} is not an http:// address")))?
        .trim_end_matches('/');
    let stream = TcpStream::connect(authority)
        .await
        .map_err(|e| unreachable(&e))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(&e))?;
    tokio::spawn(connection);
    let request = Request::get("/query")
        .header(hyper::header::HOST, authority)
        .body(Full::new(Bytes::new()))
        .map_err(|e| unreachable(&e))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| unreachable(&e))?;
    if response.status() != StatusCode::OK {
        return Err(ReadFailure::Refused(format!(
            "the bootstrap server answered {}",
            response.status()
        )));
    }
    let body = Limited::new(response.into_body(), MAX_QUERY)
        .collect()
        .await
        .map_err(|e| unreachable(&e))?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| unreachable(&e))
}
