//! The per-request context shared by the core and the plugins.

use http::Extensions;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::llm::{Endpoint, LlmCall};
use crate::pool::Pool;

/// What the router decided for a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Route {
    /// Not routed yet.
    #[default]
    Unrouted,
    /// An LLM endpoint: the body is read, parsed and sent through the LLM pipeline.
    Llm(Endpoint),
    /// `GET /v1/models`, answered by Sluice.
    Models,
    /// Proxied as plain HTTP, as nginx's `proxy_pass` would, by the named route.
    Plain(Arc<str>),
    /// No route matched: 404.
    NotFound,
}

impl Route {
    /// A short label for metrics and the access log.
    pub fn label(&self) -> &str {
        match self {
            Route::Unrouted => "-",
            Route::Llm(e) => e.label(),
            Route::Models => "models",
            Route::Plain(name) => name,
            Route::NotFound => "not-found",
        }
    }
}

/// Per-request state. The core fills the documented fields as the request advances; plugins
/// read them and keep their own state in [`RequestCtx::extensions`], keyed by a type private
/// to the plugin, so plugins cannot collide.
#[derive(Debug)]
pub struct RequestCtx {
    pub started: Instant,
    /// Set by the request-id plugin (kept from the request or generated); logged by the core.
    pub request_id: Option<String>,
    pub route: Route,
    /// The parsed LLM request, on LLM routes once the body has been read.
    pub llm: Option<LlmCall>,
    /// The pool the request goes to. The core sets it from the route or the model;
    /// `upstream_select` hooks may change it.
    pub pool: Option<Arc<Pool>>,
    /// The backend of the latest attempt.
    pub backend: Option<SocketAddr>,
    /// Upstream attempts made so far.
    pub attempts: u32,
    /// The status the upstream answered with, if it answered.
    pub upstream_status: Option<u16>,
    /// The status sent to the client.
    pub status: Option<u16>,
    /// Response body bytes sent to the client.
    pub response_bytes: usize,
    /// Time from the start of the request to the first response byte sent to the client.
    pub first_byte: Option<Duration>,
    /// True when the response body ended early (upstream failure or client gone): such a
    /// response is incomplete and must never be stored.
    pub response_incomplete: bool,
    /// Set by the cache plugin when the answer came from the cache.
    pub cache_hit: bool,
    /// Per-plugin state.
    pub extensions: Extensions,
}

impl Default for RequestCtx {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestCtx {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            request_id: None,
            route: Route::Unrouted,
            llm: None,
            pool: None,
            backend: None,
            attempts: 0,
            upstream_status: None,
            status: None,
            response_bytes: 0,
            first_byte: None,
            response_incomplete: false,
            cache_hit: false,
            extensions: Extensions::new(),
        }
    }

    /// The model the request asked for, on LLM routes.
    pub fn model(&self) -> Option<&str> {
        self.llm.as_ref().and_then(|c| c.request.model.as_deref())
    }

    /// The pool's name, or `-`.
    pub fn pool_name(&self) -> &str {
        self.pool.as_ref().map_or("-", |p| &p.name)
    }
}
