//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/status`. On its own address
//! (default 127.0.0.1:9090), so it can be firewalled apart from the proxy.

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use serde_json::json;
use sluice_sdk::Pools;
use std::sync::Arc;
use std::time::Instant;

pub struct Admin {
    pub pools: Arc<Pools>,
    pub chain: Vec<&'static str>,
    pub started: Instant,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        if session.req_header().method != http::Method::GET {
            return respond(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                b"GET only\n".to_vec(),
            );
        }
        match session.req_header().uri.path() {
            "/metrics" => respond(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                crate::metrics::render(),
            ),
            "/healthz" => respond(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/readyz" => {
                if self.ready() {
                    respond(StatusCode::OK, "text/plain", b"ready\n".to_vec())
                } else {
                    respond(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        b"no backend\n".to_vec(),
                    )
                }
            }
            "/status" => respond(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec_pretty(&self.status()).unwrap_or_default(),
            ),
            _ => respond(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
        }
    }
}

impl Admin {
    /// Ready when some pool has a backend that may take requests. Until health checks run,
    /// every configured backend counts.
    fn ready(&self) -> bool {
        self.pools.iter().any(|p| !p.backends.is_empty())
    }

    fn status(&self) -> serde_json::Value {
        let pools: Vec<_> = self
            .pools
            .iter()
            .map(|p| {
                json!({
                    "name": &*p.name,
                    "models": p.models,
                    "max_model_len": p.max_model_len,
                    "backends": p.backends.iter().map(|b| json!({
                        "address": b.address,
                        "resolved": b.resolved.to_string(),
                        "weight": b.weight,
                        // No health service yet: backends are taken as they are configured.
                        "health": "unchecked",
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_seconds": self.started.elapsed().as_secs(),
            "plugins": self.chain,
            "pools": pools,
        })
    }
}

fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    response
}
