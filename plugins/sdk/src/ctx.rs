//! The per-request context shared by the core and the plugins.

use std::any::{Any, TypeId};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::escalation::Escalation;
use crate::llm::{Endpoint, LlmCall};
use crate::pool::{Pool, Priority};

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
/// read them and keep their own state in [`RequestCtx::state`], keyed by a type private to
/// the plugin, so plugins cannot collide.
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
    /// The request's class for the KV breaker, once a plugin decided it.
    pub priority: Option<Priority>,
    /// The body every upstream attempt sends instead of the client's, when a request hook
    /// asked upstreams for more than the client did (a stream's usage, for token counts).
    /// The hook must then remove what the client did not ask for from the answer.
    pub upstream_body: Option<bytes::Bytes>,
    /// Set by a request hook that sent the request to a first pool (a draft): where to go
    /// if that pool fails or its answer is judged wanting. See [`crate::escalation`].
    pub escalation: Option<Escalation>,
    /// Why the request went to the escalation target, once it did (`x-sluice-escalated`).
    pub escalated: Option<&'static str>,
    /// Per-plugin state.
    pub state: PluginState,
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
            priority: None,
            upstream_body: None,
            escalation: None,
            escalated: None,
            state: PluginState::default(),
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

/// Per-request plugin state, one value per type. Each plugin keys its state by a type of its
/// own. A handful of entries at most, so a vector beats a hash map.
#[derive(Default)]
pub struct PluginState {
    items: Vec<(TypeId, Box<dyn Any + Send + Sync>)>,
}

impl PluginState {
    /// Stores `value`, replacing any earlier value of the same type.
    pub fn insert<T: Any + Send + Sync>(&mut self, value: T) {
        let id = TypeId::of::<T>();
        match self.items.iter_mut().find(|(t, _)| *t == id) {
            Some((_, slot)) => *slot = Box::new(value),
            None => self.items.push((id, Box::new(value))),
        }
    }

    pub fn get<T: Any>(&self) -> Option<&T> {
        let id = TypeId::of::<T>();
        self.items
            .iter()
            .find(|(t, _)| *t == id)
            .and_then(|(_, v)| v.downcast_ref())
    }

    pub fn get_mut<T: Any>(&mut self) -> Option<&mut T> {
        let id = TypeId::of::<T>();
        self.items
            .iter_mut()
            .find(|(t, _)| *t == id)
            .and_then(|(_, v)| v.downcast_mut())
    }

    pub fn remove<T: Any>(&mut self) -> Option<T> {
        let id = TypeId::of::<T>();
        let i = self.items.iter().position(|(t, _)| *t == id)?;
        self.items.swap_remove(i).1.downcast().ok().map(|b| *b)
    }
}

impl std::fmt::Debug for PluginState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PluginState({} entries)", self.items.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_state_is_keyed_by_type() {
        struct A(u32);
        struct B(&'static str);
        let mut s = PluginState::default();
        s.insert(A(1));
        s.insert(B("b"));
        s.insert(A(2));
        assert_eq!(s.get::<A>().map(|a| a.0), Some(2));
        s.get_mut::<B>().unwrap().0 = "c";
        assert_eq!(s.remove::<B>().map(|b| b.0), Some("c"));
        assert!(s.get::<B>().is_none());
    }
}
