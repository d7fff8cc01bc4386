//! The per-request context shared by the core and the plugins.

use std::any::{Any, TypeId};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::escalation::Escalation;
use crate::pool::{FlowId, Pool, Priority};
use crate::request::{Endpoint, LlmCall};
use crate::tenant::Tenant;
use crate::usage::Usage;

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
    /// `GET /v1/responses/{id}` or `POST /v1/responses/{id}/cancel`: proxied as plain HTTP
    /// to the backend that made the response.
    StoredResponse,
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
            Route::StoredResponse => "stored-response",
            Route::NotFound => "not-found",
        }
    }
}

/// Per-request state, as plugins see it.
///
/// - **Facts** the core records as the request advances (route, parsed request, attempts,
///   statuses, bytes): read-only here, through getters and [`RequestCtx::progress`].
/// - **Routing intents** a request hook may express: [`RequestCtx::send_to`],
///   [`RequestCtx::try_first`], [`RequestCtx::escalate_to`], [`RequestCtx::ask_upstream_for`].
/// - **What one plugin tells the others**, under neutral names: the request's id, its
///   priority class, its tenant, whether it was answered locally (a cache hit).
/// - **The answer's token usage**: a plugin that needs it says so in a request hook with
///   [`RequestCtx::want_usage`]; the core scans every LLM answer once as it passes (upstream
///   answers and cache hits, JSON and streams) and records [`RequestCtx::usage`] when found.
///   It is there for `logging`, and for `response_body` from the chunk that carried it on,
///   so surely at the last chunk (`end_of_stream`) of an answer that has it. When a plugin
///   wants it and a stream's client did not ask for it (`stream_options.include_usage`), the
///   core asks the upstream for it and removes the usage chunk before any `response_body`
///   hook sees the stream; plugins never splice it in or strip it out themselves.
/// - **Each plugin's own state**, in [`RequestCtx::state`], keyed by a type private to the
///   plugin, so plugins cannot collide.
#[derive(Debug)]
pub struct RequestCtx {
    started: Instant,
    route: Route,
    llm: Option<LlmCall>,
    /// As the header value it is sent as: the upstream request and the answer take clones of
    /// one buffer.
    request_id: Option<http::HeaderValue>,
    priority: Option<Priority>,
    tenant: Option<Arc<Tenant>>,
    /// Who the request is served for, in its pool's fair order (the core sets it).
    flow: Option<FlowId>,
    /// When its first token is due, by its TTFT objective, if it has one.
    ttft_deadline: Option<Instant>,
    answered_locally: bool,
    pool: Option<Arc<Pool>>,
    escalation: Option<Escalation>,
    escalated: Option<&'static str>,
    upstream_body: Option<Bytes>,
    usage_wanted: bool,
    usage: Option<Usage>,
    progress: Progress,
    /// The request's span: opened by the core once the request's identity is known (after
    /// the `early_request` hooks), closed when the request ends. Attempt spans are its
    /// children. A disabled span when tracing is off at that level.
    span: tracing::Span,
    /// Whether the request's trace is sampled (its spans exported): see [`RequestCtx::traced`].
    traced: bool,
    /// Per-plugin state.
    pub state: PluginState,
}

/// What the core records about a request's way upstream and back.
#[derive(Debug, Clone, Default)]
pub struct Progress {
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
    /// The response body ended early (upstream failure or client gone): such a response is
    /// incomplete and must never be stored.
    pub response_incomplete: bool,
    /// What answers that were generated but not sent used (a draft rejected by the
    /// speculative selector's check, or cut by its context): the engine spent it all the same.
    pub discarded: Discarded,
    /// Why the latest attempt's backend was chosen, when its pool predicts times to first
    /// token.
    pub placement: Option<Placement>,
}

/// A backend's choice explained: the time to first token predicted there and at the best
/// other candidate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    /// Predicted at the chosen backend, seconds.
    pub predicted_ttft: f64,
    /// The best other candidate and the time predicted there, seconds.
    pub runner_up: Option<(std::net::SocketAddr, f64)>,
    /// The request's session left the backend its last turn went to.
    pub session_moved: bool,
}

/// Tokens generated for a request and thrown away, and their price.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Discarded {
    /// Prompt tokens the engine read for answers not sent.
    pub prompt_tokens: u64,
    /// Tokens it generated for them.
    pub completion_tokens: u64,
    /// At the price of the pool that generated them.
    pub usd: f64,
}

impl Progress {
    /// Counts an answer not sent, generated on a pool at `price_per_million_tokens`.
    pub fn discard(&mut self, used: crate::Usage, price_per_million_tokens: f64) {
        let d = &mut self.discarded;
        d.prompt_tokens = d.prompt_tokens.saturating_add(used.prompt_tokens);
        d.completion_tokens = d.completion_tokens.saturating_add(used.completion_tokens);
        d.usd += used.prompt_tokens.saturating_add(used.completion_tokens) as f64
            * price_per_million_tokens
            / 1e6;
    }
}

impl Default for RequestCtx {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestCtx {
    /// A context for a request arriving now: unrouted, nothing recorded. The core makes one per
    /// request; plugins need this only in tests.
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            route: Route::Unrouted,
            llm: None,
            request_id: None,
            priority: None,
            tenant: None,
            flow: None,
            ttft_deadline: None,
            answered_locally: false,
            pool: None,
            escalation: None,
            escalated: None,
            upstream_body: None,
            usage_wanted: false,
            usage: None,
            progress: Progress::default(),
            span: tracing::Span::none(),
            traced: false,
            state: PluginState::default(),
        }
    }

    // ---- facts ----

    /// When the request arrived: the pool's total timeout and the logged duration count from here.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// What the router decided; [`Route::Unrouted`] during `early_request`, which runs before it.
    pub fn route(&self) -> &Route {
        &self.route
    }

    /// The parsed LLM request, on LLM routes once the body has been read.
    pub fn llm(&self) -> Option<&LlmCall> {
        self.llm.as_ref()
    }

    /// The model the request asked for, on LLM routes.
    pub fn model(&self) -> Option<&str> {
        self.llm.as_ref().and_then(|c| c.request.model.as_deref())
    }

    /// What the core has recorded so far of the request's attempts and of the response.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    // ---- what plugins tell each other ----

    /// The request's span (see the field): plugins may add events to it, and its fields
    /// (`route`, `model`, `pool`, `tenant`, `status`, `cache`) are recorded by the core.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Sets the request's span, and whether its trace is sampled. The core's; plugins read
    /// [`RequestCtx::span`] and [`RequestCtx::traced`].
    pub fn set_span(&mut self, span: tracing::Span, traced: bool) {
        self.span = span;
        self.traced = traced;
    }

    /// Whether the request's trace is sampled: its spans are exported, and what is worked out
    /// only for their attributes is worth working out.
    pub fn traced(&self) -> bool {
        self.traced
    }

    /// The request's id, for logs and errors, once a plugin gave it one (`None` as well for an
    /// id that is not visible ASCII, which the request-id plugin never gives).
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_ref().and_then(|v| v.to_str().ok())
    }

    /// The request's id as the header value it is sent as (clone it: that copies nothing).
    pub fn request_id_value(&self) -> Option<&http::HeaderValue> {
        self.request_id.as_ref()
    }

    /// Gives the request its id (the request-id plugin does, in `early_request`); a later call
    /// replaces it.
    pub fn set_request_id(&mut self, id: http::HeaderValue) {
        self.request_id = Some(id);
    }

    /// The request's class (who is shed first under pressure), once a plugin decided it.
    pub fn priority(&self) -> Option<Priority> {
        self.priority
    }

    /// Sets the request's class, which the pools' admission control reads (the KV breaker sets it
    /// from the priority header); a later call replaces it.
    pub fn set_priority(&mut self, priority: Priority) {
        self.priority = Some(priority);
    }

    /// The tenant the request was identified as, once the tenants plugin did.
    pub fn tenant(&self) -> Option<&Arc<Tenant>> {
        self.tenant.as_ref()
    }

    /// Records who is calling (the tenants plugin does, in `early_request`); the breaker, the
    /// selector and the cache read it instead of client headers.
    pub fn set_tenant(&mut self, tenant: Arc<Tenant>) {
        self.tenant = Some(tenant);
    }

    /// Who the request is served for: its session, in its tenant (or its client); the order
    /// of its pool's queue. Set by the core once the request's body is read.
    pub fn flow(&self) -> Option<&FlowId> {
        self.flow.as_ref()
    }

    /// Sets the request's flow.
    pub fn set_flow(&mut self, flow: FlowId) {
        self.flow = Some(flow);
    }

    /// When the request's first token is due, by its TTFT objective (`x-sluice-ttft-slo-ms`,
    /// else its tenant's `ttft_slo`).
    pub fn ttft_deadline(&self) -> Option<Instant> {
        self.ttft_deadline
    }

    /// Gives the request a TTFT objective, counted from its arrival.
    pub fn set_ttft_slo(&mut self, slo: Duration) {
        self.ttft_deadline = self.started.checked_add(slo);
    }

    /// The answer was made here, without an upstream (a cache hit).
    pub fn answered_locally(&self) -> bool {
        self.answered_locally
    }

    /// Records that a plugin answered the request itself (a cache hit, with `Flow::Respond`), so
    /// later hooks know that no upstream made the answer.
    pub fn mark_answered_locally(&mut self) {
        self.answered_locally = true;
    }

    // ---- the answer's usage ----

    /// Says that this plugin needs the answer's token usage ([`RequestCtx::usage`]). Call it
    /// in a request hook, before any attempt: a stream whose client did not ask for usage is
    /// then asked for it upstream (and the usage chunk kept from the client).
    pub fn want_usage(&mut self) {
        self.usage_wanted = true;
    }

    /// Whether some plugin asked for the answer's usage.
    pub fn usage_wanted(&self) -> bool {
        self.usage_wanted
    }

    /// The token usage of the answer, once the core found it in the body (see the type's
    /// header for when). None when the answer has none: not an LLM route, an error, a stream
    /// cut before its usage chunk, or a stream whose usage nobody asked for.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    // ---- the request itself ----

    /// Replaces the parsed request with `call`, as if the client had sent it: what a request
    /// hook may do to enforce a policy (the tenants plugin lowers `max_tokens` to a ceiling
    /// with [`LlmCall::capped`]). Every later hook, the cache key and the attempts see the new
    /// request. Only in `request`, before any plugin chose where the request goes from it.
    pub fn rewrite_request(&mut self, call: LlmCall) {
        self.llm = Some(call);
    }

    // ---- routing ----

    /// The pool the request goes to: set by the core from the route or the model, and
    /// changed by request hooks through the intents below.
    pub fn pool(&self) -> Option<&Arc<Pool>> {
        self.pool.as_ref()
    }

    /// The pool's name, or `-`.
    pub fn pool_name(&self) -> &str {
        self.pool.as_ref().map_or("-", |p| &p.name)
    }

    /// Send the request's attempts to `pool`. When that is the pending escalation's target
    /// (the breaker moved a request off a draft that could not take it), the request has
    /// escalated there: the draft's body, deadline and checks are dropped, and the target's
    /// answer is never judged against itself.
    pub fn send_to(&mut self, pool: Arc<Pool>) {
        let onto_target = self
            .escalation
            .as_ref()
            .is_some_and(|e| Arc::ptr_eq(&e.target, &pool));
        if onto_target {
            self.escalate_to(pool, crate::escalation::reason::DRAFT_UNAVAILABLE);
        } else {
            self.pool = Some(pool);
        }
    }

    /// Try `pool` first (a draft), and move to `escalation.target` if it fails or its
    /// answer is judged wanting (see [`crate::escalation`]).
    pub fn try_first(&mut self, pool: Arc<Pool>, escalation: Escalation) {
        self.pool = Some(pool);
        self.escalation = Some(escalation);
    }

    /// Send the request to an escalation target, for `reason` (`x-sluice-escalated`).
    pub fn escalate_to(&mut self, target: Arc<Pool>, reason: &'static str) {
        self.pool = Some(target);
        self.escalation = None;
        self.escalated = Some(reason);
    }

    /// Where the request goes if its first pool fails, while it has not gone there.
    pub fn escalation(&self) -> Option<&Escalation> {
        self.escalation.as_ref()
    }

    /// Why the request went to its escalation target, once it did.
    pub fn escalated(&self) -> Option<&'static str> {
        self.escalated
    }

    /// Every upstream attempt sends `body` instead of the client's: the hook asked upstreams
    /// for more than the client did and must remove what the client did not ask for from the
    /// answer. (Not for a stream's usage: [`RequestCtx::want_usage`] has the core do that.)
    pub fn ask_upstream_for(&mut self, body: Bytes) {
        self.upstream_body = Some(body);
    }

    /// The body set by [`RequestCtx::ask_upstream_for`], if any. While the request is on its first
    /// pool, the escalation's own [`Escalation::upstream_body`] is sent instead, when it has one.
    pub fn upstream_body(&self) -> Option<&Bytes> {
        self.upstream_body.as_ref()
    }

    // ---- for the core only: plugins have no reason to call these ----

    #[doc(hidden)]
    pub fn set_route(&mut self, route: Route) {
        self.route = route;
    }

    #[doc(hidden)]
    pub fn set_llm(&mut self, call: LlmCall) {
        self.llm = Some(call);
    }

    #[doc(hidden)]
    pub fn progress_mut(&mut self) -> &mut Progress {
        &mut self.progress
    }

    /// Records the usage the core found in the answer (a later one, as a stream's running
    /// totals, replaces it).
    #[doc(hidden)]
    pub fn set_usage(&mut self, usage: Usage) {
        self.usage = Some(usage);
    }

    /// Takes the escalation, to act on it.
    #[doc(hidden)]
    pub fn take_escalation(&mut self) -> Option<Escalation> {
        self.escalation.take()
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

    /// The stored value of type `T`, if any.
    pub fn get<T: Any>(&self) -> Option<&T> {
        let id = TypeId::of::<T>();
        self.items
            .iter()
            .find(|(t, _)| *t == id)
            .and_then(|(_, v)| v.downcast_ref())
    }

    /// The stored value of type `T`, to change in place, if any.
    pub fn get_mut<T: Any>(&mut self) -> Option<&mut T> {
        let id = TypeId::of::<T>();
        self.items
            .iter_mut()
            .find(|(t, _)| *t == id)
            .and_then(|(_, v)| v.downcast_mut())
    }

    /// Takes the stored value of type `T` out, if any.
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
