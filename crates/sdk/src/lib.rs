#![warn(missing_docs)]
//! The Sluice plugin SDK: the contract between the core and its plugins, and what every
//! plugin depends on.
//!
//! It is the contract (hooks, the per-request context, config errors, error replies, the
//! metric macro, escalation, the tenant) plus the infrastructure plugins share (Redis, the
//! memory budget, CPU work off the async workers). The LLM wire model lives in `sluice-llm`
//! and the pools in `sluice-pools`; both are re-exported here under their old paths
//! (`sluice_sdk::request`, `sluice_sdk::pool`, ...), so a plugin depends on this crate alone. It
//! must not depend on the core (`sluice`) nor on any plugin.
//!
//! - [`Plugin`]: the trait, with one hook per proxy phase and the return conventions.
//! - [`RequestCtx`]: the per-request state the core fills and plugins read.
//! - [`LlmCall`] / [`LlmRequest`]: the parsed request of an LLM route (any API family), with
//!   its raw bytes.
//! - [`Pool`] / [`Pools`]: the upstream pools as plugins see them, with each backend's live
//!   health and load ([`health`]).
//! - [`ErrorReply`]: how a hook refuses a request (status, OpenAI body, `retry-after`).
//!
//! - [`PluginBuilder`] / [`ConfigError`]: how a plugin is made from its config section.
//! - [`Admission`]: a pool's admission control, asked of the pool (`pool.admits(class)`).
//! - [`headers`], [`metrics`]: the header names and the one way to declare a series.
//! - [`calls`]: requests of a plugin's own to a pool (embeddings), sent by the core.
//! - [`client`]: the [`Client`] a request hook sees (not Pingora's session), and waiting on
//!   something while watching it, since it may leave.
//! - [`redis`]: the way to Redis (single node or Cluster) with timeouts and a cool-down, for
//!   plugins that share state through it.
//! - [`usage`], [`sse`]: an answer's token usage (which the core finds for every plugin: see
//!   [`RequestCtx::want_usage`]) and the splitting of a stream into its events.
//! - [`model_name`]: the model name a pool serves, spliced into requests and rewritten back
//!   in answers.
//!
//! A plugin crate owns its config type (serde, `deny_unknown_fields`, with an `enabled` key),
//! its builder, its metrics and its tests; plugins know each other only through this crate.

pub mod calls;
pub mod client;
pub mod config;
pub mod cpu;
pub mod ctx;
pub mod duration;
pub mod error;
pub mod escalation;
pub mod headers;
pub mod memory;
pub mod metrics;
pub mod plugin;
pub mod redis;
pub mod tenant;

// The LLM wire model and the pools, re-exported where plugins have always found them.
pub use sluice_llm::{context, family, model_name, raw_json, request, sse, usage};
pub use sluice_pools::{header_rules, health, members, pool, prefix, prefix_index, ratio, retry};

pub use crate::redis::{redacted, RedisFailure, RedisLink, RedisSettings};
pub use calls::{Call, CallFailed, PoolCalls};
pub use client::Client;
pub use config::ConfigError;

/// The `tracing` target under which a plugin's event becomes an event of the trace span it
/// is in, when traces are on (`telemetry`): its message names it, its fields are its
/// attributes, at `info` level (the log never shows this target):
/// `tracing::info!(target: sluice_sdk::SPAN_EVENTS, reason = "kv-pressure", "shed")`.
/// Without traces it is an event nobody listens to, which costs a cached callsite check.
/// [`RequestCtx::traced`] says whether the request's trace is kept, before working out what
/// only its spans would show.
pub const SPAN_EVENTS: &str = "sluice::span_event";
pub use ctx::{Discarded, Placement, PluginState, Progress, RequestCtx, Route};
pub use error::{ErrorReply, Reason};
pub use escalation::{AnswerCheck, Escalation, Judgement, StreamCheck, StreamJudge};
pub use family::{AnswerError, AnswerText, ApiFamily, Logprobs, RouteMatch};
pub use header_rules::{HeaderRules, UpstreamAuth};
pub use health::{
    BackendLive, BackendState, HealthPolicy, InFlight, Load, OutlierPolicy, Probe, StaleAs, Verdict,
};
pub use members::{BackendSpec, Change, Member, Members, Membership, Wanted};
pub use memory::{Held, MemoryBudget};
pub use model_name::{AnswerModel, ModelRewriter, ServedModel};
pub use plugin::{
    AttemptOutcome, AttemptReport, AttemptStart, Flow, Host, LocalResponse, Plugin, PluginBuilder,
};
pub use pool::{
    Admission, Balancing, Capabilities, ClientFields, Connector, Fairness, FlowControl, FlowId,
    Place, Pool, PoolSettings, Pools, PrefillRoute, Prefillers, Pressure, Priority, Room,
    RouteState, Selected, Timeouts, TokensPerSecond, TransferCheck, TransferOutcome, Unfit,
    WaitFor, Waited,
};
pub use request::{Demand, Endpoint, InvalidRequest, LlmCall, LlmRequest};
pub use retry::{RetryBudget, RetryOn, RetryPolicy};
pub use tenant::{api_key, Tenant};
pub use usage::Usage;

// Re-exported so that plugins use the exact Pingora types the core uses.
pub use async_trait::async_trait;
pub use bytes::Bytes;
pub use pingora_error::{Error, ErrorType, Result};
pub use pingora_http::{RequestHeader, ResponseHeader};
