//! The plugin contract: how a plugin is built ([`PluginBuilder`]) and the hooks it is called
//! at ([`Plugin`]).
//!
//! A plugin is built in two steps. [`PluginBuilder::resolve`] turns its config section into
//! typed, checked values, or a [`ConfigError`] naming the key at fault; it is pure, so
//! `sluice -t` runs it too. [`PluginBuilder::start`] then registers its metrics and opens its
//! connections, once, and gives the chain a shared, immutable `Arc<dyn Plugin>`, called for
//! every request at the phases it implements. Every hook has a no-op default, so a plugin
//! implements only what it needs. The core calls the hooks of the enabled plugins in the
//! chain's order (see `conf/README.md`); a disabled plugin is not in the chain at all.
//!
//! Phases, in the order a request meets them (and the Pingora phase each mirrors):
//!
//! | hook               | Pingora phase                 | sync? |
//! |--------------------|-------------------------------|-------|
//! | `early_request`    | `early_request_filter`        | async |
//! | `request`          | `request_filter`              | async |
//! | `upstream_select`  | `upstream_peer`               | sync  |
//! | `upstream_request` | `upstream_request_filter`     | sync  |
//! | `attempt_end`      | (after each upstream attempt) | sync  |
//! | `response_header`  | `response_filter`             | sync  |
//! | `response_body`    | `response_body_filter`        | sync  |
//! | `error`            | `fail_to_proxy`               | sync  |
//! | `logging`          | `logging`                     | sync  |
//!
//! On LLM routes the client's request runs `request`, then the core sends each upstream
//! attempt itself and runs the response hooks as the attempt's response passes to the
//! client; the hooks see the same things in the same order as on plain routes. Request hooks
//! run in chain order, response hooks in reverse (the plugin nearest the upstream first).
//! Body hooks run per chunk and must be incremental: anything slow or async (a Redis write)
//! is spawned, or done from `logging`.
//!
//! The request hooks see the client as a narrow [`Client`]: its request header, its peer's
//! address, and a future that ends when it leaves (waits go through
//! [`crate::client::while_connected`]). They never touch Pingora's session, so each has
//! unit tests against the testkit's fake client.
//!
//! Facts about a request (who is calling, its priority class) are decided in
//! `early_request`, by the plugin that owns them, so that every `request` hook can read them;
//! intents (where the request goes, a local answer) are made in `request`. A `request` hook
//! never reads a fact that a later plugin's `request` hook decides.
//!
//! The core observes requests through the same hooks: its attempt metrics, traces and access
//! log are observers of `upstream_request`, `attempt_end` and `logging`, beside the plugins.
//!
//! Sluice's own answers (an error it makes, a plugin's local answer such as a cache hit,
//! `/v1/models`) run `response_header`, `response_body` and `logging` too, so every answer
//! carries the request id and the cache status; `error` runs for every error answer.
//! `upstream_select` and `upstream_request` run only for requests that go upstream.

use async_trait::async_trait;
use bytes::Bytes;
use pingora_error::{Error, Result};
use pingora_http::{RequestHeader, ResponseHeader};

use serde::de::DeserializeOwned;
use std::sync::Arc;

use crate::calls::PoolCalls;
use crate::client::Client;
use crate::config::ConfigError;
use crate::ctx::RequestCtx;
use crate::error::ErrorReply;
use crate::memory::MemoryBudget;
use crate::pool::Pools;

/// How an upstream attempt ended: derived once, where the attempt ends, and read by every
/// observer (the `sluice_upstream_attempts_total` label, the attempt span's `outcome`, the
/// plugins' [`Plugin::attempt_end`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The upstream's answer went to the client.
    Response,
    /// No connection could be made.
    ConnectError,
    /// No answer in time, before anything reached the client.
    Timeout,
    /// Another failure before anything reached the client.
    Error,
    /// An error status (5xx, 429) held back for another attempt.
    Declined,
    /// A held answer the escalation check rejected.
    RejectedAnswer,
    /// The answer started, then failed.
    Broken,
    /// The client went away first: not the backend's doing, and not counted as an attempt's
    /// outcome in the metrics.
    ClientGone,
}

impl AttemptOutcome {
    /// The outcomes `sluice_upstream_attempts_total` counts (all but [`Self::ClientGone`]).
    pub const COUNTED: [AttemptOutcome; 7] = [
        AttemptOutcome::Response,
        AttemptOutcome::ConnectError,
        AttemptOutcome::Timeout,
        AttemptOutcome::Error,
        AttemptOutcome::Declined,
        AttemptOutcome::RejectedAnswer,
        AttemptOutcome::Broken,
    ];

    /// Its name in metrics, spans and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Response => "response",
            AttemptOutcome::ConnectError => "connect_error",
            AttemptOutcome::Timeout => "timeout",
            AttemptOutcome::Error => "error",
            AttemptOutcome::Declined => "declined",
            AttemptOutcome::RejectedAnswer => "rejected_answer",
            AttemptOutcome::Broken => "broken",
            AttemptOutcome::ClientGone => "client_gone",
        }
    }
}

/// An upstream attempt about to be sent: what [`Plugin::upstream_request`] is told of it.
#[derive(Debug, Clone, Copy)]
pub struct AttemptStart<'a> {
    /// Its number among the request's attempts, from 1 (a prefill leg: the number of the
    /// attempt it prefills for).
    pub number: u32,
    /// The pool it goes to.
    pub pool: &'a str,
    /// The backend it goes to.
    pub backend: std::net::SocketAddr,
    /// Its span, a child of the request's: the one an upstream's own trace nests under.
    pub span: &'a tracing::Span,
    /// It is a disaggregated request's prefill leg, not an attempt of its own.
    pub prefill_leg: bool,
}

/// One upstream attempt as it ended: the fact [`Plugin::attempt_end`] hands each observer
/// (the core's own first: its attempt metrics and traces), so that tracing, accounting and
/// metrics per attempt hang off one place.
#[derive(Debug, Clone)]
pub struct AttemptReport {
    /// Its number among the request's attempts, from 1.
    pub number: u32,
    /// The pool it went to.
    pub pool: Arc<str>,
    /// The backend it went to.
    pub backend: std::net::SocketAddr,
    /// When it started (the backend was chosen).
    pub started: std::time::Instant,
    /// How long it lasted, until it ended.
    pub elapsed: std::time::Duration,
    /// The status the backend answered with, if it answered.
    pub status: Option<u16>,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// The attempt's span, a child of the request's (see [`crate::RequestCtx::span`]); the
    /// core's trace observer records `status` and `outcome` on it before any plugin hears of
    /// the attempt. It closes once the core and every plugin drop it.
    pub span: tracing::Span,
}

/// What the core lends every plugin to build it with: what is shared by the whole process.
#[derive(Debug, Clone)]
pub struct Host {
    /// The upstream pools, with each backend's live state.
    pub pools: Arc<Pools>,
    /// The budget of bytes held in memory for requests (see [`crate::memory`]).
    pub memory: Arc<MemoryBudget>,
    /// Requests of the plugin's own to a pool, sent by the core (see [`crate::calls`]).
    pub calls: Arc<dyn PoolCalls>,
}

/// How a plugin is made from its config section. The core's chain is a table of these, one
/// entry per plugin crate, in chain order.
///
/// ```ignore
/// impl PluginBuilder for RequestIdBuilder {
///     const NAME: &'static str = "request_id";
///     type Config = RequestIdConfig;
///     fn resolve(config: RequestIdConfig, _host: &Host) -> Result<Option<Self>, ConfigError> {
///         let header = sluice_sdk::config::header_name("header", &config.header)?;
///         Ok(config.enabled.then_some(Self { header }))
///     }
///     fn start(self) -> Arc<dyn Plugin> { Arc::new(RequestId::new(self.header)) }
/// }
/// ```
pub trait PluginBuilder: Sized + Send + 'static {
    /// The plugin's name: its section under `plugins` and its name in the chain.
    const NAME: &'static str;

    /// The section as written: serde with `deny_unknown_fields`; an absent section is the
    /// default.
    type Config: DeserializeOwned + Default;

    /// Checks the section (against the pools too) and parses every setting into the typed
    /// value the plugin will use: header names, durations, pool handles. `Ok(None)`: the
    /// section leaves the plugin disabled, and it costs nothing at run time.
    ///
    /// Runs for every section, enabled or not, so that a mistake is found before the plugin
    /// is turned on; a plugin may skip checks that only matter when enabled. Must be pure:
    /// no metrics, no sockets, no tasks (`sluice -t` runs it and exits).
    ///
    /// `Err` names the key relative to the section; the core adds `plugins.<NAME>`.
    fn resolve(config: Self::Config, host: &Host) -> Result<Option<Self>, ConfigError>;

    /// Starts the resolved plugin: registers its metrics, starts its background work (this
    /// runs before the server's runtime starts: spawn on a runtime of your own, as the Redis
    /// store does). Runs once per process.
    fn start(self) -> Arc<dyn Plugin>;
}

/// What a `request` hook decided.
#[derive(Debug)]
pub enum Flow {
    /// Go on: the next plugin's `request` hook, then the upstream.
    Continue,
    /// Answer with this response now: the chain stops and no upstream is contacted.
    Respond(Box<LocalResponse>),
}

/// An answer made by a plugin, without an upstream.
#[derive(Debug)]
pub struct LocalResponse {
    /// The status and headers, passed through every plugin's `response_header` hook.
    pub header: ResponseHeader,
    /// The whole body, passed through the `response_body` hooks in one chunk; with `stream`,
    /// the body's first bytes (may be empty).
    pub body: Bytes,
    /// A body still being made (a coalesced follower joining a stream in flight): `None` for
    /// a complete answer. The core writes `body`, then each chunk [`LocalStream::next_chunk`]
    /// gives, each through the `response_body` hooks as it comes, and ends the response when
    /// it gives `None`. The header should then frame the body as chunked, not by length.
    pub stream: Option<Box<dyn LocalStream>>,
}

/// The rest of a local answer's body, produced while the client is being written to (see
/// [`LocalResponse::stream`]). It must end by itself (`None`), the way an upstream's answer
/// does: the core waits for it without a deadline of its own, bounding only each write to
/// the client.
#[async_trait]
pub trait LocalStream: Send {
    /// The next chunk, once there is one; `None` at the end.
    async fn next_chunk(&mut self) -> Option<Bytes>;
}

impl std::fmt::Debug for dyn LocalStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalStream")
    }
}

/// A running plugin: hooks for the proxy phases, each with a no-op default (see
/// [`crate::plugin`] for their order). One instance serves every request at once, so state
/// that belongs to a request goes in [`RequestCtx::state`].
#[async_trait]
pub trait Plugin: Send + Sync + 'static {
    /// The plugin's name, as its config section is named (`request_id`, `cache`, ...).
    fn name(&self) -> &'static str;

    /// Runs first, for every request on the proxy listener, before routing and before any
    /// body is read: for what every answer needs, errors included (a request id).
    /// `Err(e)` fails the request.
    async fn early_request(&self, _client: &mut dyn Client, _ctx: &mut RequestCtx) -> Result<()> {
        Ok(())
    }

    /// Runs once the request is routed; on LLM routes the body has been read and parsed
    /// (`ctx.llm` is set).
    ///
    /// - `Ok(Flow::Continue)`: go on to the next plugin, then to the upstream.
    /// - `Ok(Flow::Respond(r))`: answer with `r` (a cache hit); the chain stops, no upstream
    ///   is contacted, and the core sends `r` through every plugin's response hooks.
    /// - `Err(e)`: the request fails; `ErrorReply::...into_error()` chooses the answer.
    async fn request(&self, _client: &mut dyn Client, _ctx: &mut RequestCtx) -> Result<Flow> {
        Ok(Flow::Continue)
    }

    /// Runs before each upstream attempt, before a backend is chosen. It may change the pool
    /// ([`RequestCtx::send_to`]). `Err` fails the request with that error's answer.
    fn upstream_select(&self, _ctx: &mut RequestCtx) -> Result<()> {
        Ok(())
    }

    /// Runs on the request header about to be sent upstream, for each attempt (and for a
    /// disaggregated request's prefill leg), with the attempt it starts: to add or remove
    /// headers. `Err` fails the request with that error's answer; nothing was sent.
    fn upstream_request(
        &self,
        _request: &mut RequestHeader,
        _attempt: &AttemptStart<'_>,
        _ctx: &mut RequestCtx,
    ) -> Result<()> {
        Ok(())
    }

    /// Runs when an upstream attempt has ended, however it ended (see [`AttemptReport`]):
    /// on LLM routes after each attempt of the request (a retry, an escalation), before the
    /// core decides what follows; on plain routes after each try, a refused connection's as
    /// it is refused, the last when the request ends. Observe only (count, trace, account per
    /// attempt); the request goes on as the core decides.
    fn attempt_end(&self, _attempt: &AttemptReport, _ctx: &mut RequestCtx) {}

    /// Runs on the response header before it is sent to the client. `Err` fails the request
    /// (only sensible before any byte was sent, which is always the case here).
    fn response_header(&self, _response: &mut ResponseHeader, _ctx: &mut RequestCtx) -> Result<()> {
        Ok(())
    }

    /// The most headers [`Plugin::response_header`] adds to one answer. The core makes room
    /// for every plugin's at once, so an answer's header map grows once, and by no more than
    /// the chain needs (each open stream holds its map to the end).
    fn response_headers_added(&self) -> usize {
        0
    }

    /// Runs on each response body chunk before it is sent to the client. `end_of_stream`
    /// is true on the last call. The plugin may read the chunk (cloning `Bytes` is a
    /// reference count) or replace it. Must not block.
    fn response_body(
        &self,
        _body: &mut Option<Bytes>,
        _end_of_stream: bool,
        _ctx: &mut RequestCtx,
    ) -> Result<()> {
        Ok(())
    }

    /// Runs when Sluice answers the request with an error of its own (or ends a started
    /// stream with an error event), before the answer is written: to observe it (count,
    /// log). It cannot change the answer.
    fn error(&self, _reply: &ErrorReply, _ctx: &mut RequestCtx) {}

    /// Runs once at the end of every request, whatever happened. `error` is the failure, if
    /// any. Spawn async work from here; do not block.
    fn logging(&self, _error: Option<&Error>, _ctx: &mut RequestCtx) {}

    /// What the plugin shows in the admin `/status`, under `plugin_status.<name>` (a tenant's
    /// limits and use, say); `None`: nothing. Called per `/status` request, off the request
    /// path.
    fn status(&self) -> Option<serde_json::Value> {
        None
    }

    /// Runs once when the server stops, after the last request has ended: finish what is
    /// queued (a cache's pending writes), within `within`; the process exits after it. Not
    /// a request hook: it runs on a runtime of its own, outside Pingora's.
    async fn stop(&self, _within: std::time::Duration) {}
}
