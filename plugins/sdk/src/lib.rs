#![warn(missing_docs)]
//! The Sluice plugin SDK: what every plugin depends on.
//!
//! - [`Plugin`]: the trait, with one hook per proxy phase and the return conventions.
//! - [`RequestCtx`]: the per-request state the core fills and plugins read.
//! - [`LlmCall`] / [`LlmRequest`]: the parsed OpenAI request, with its raw bytes.
//! - [`Pool`] / [`Pools`]: the upstream pools as plugins see them, with each backend's live
//!   health and load ([`health`]).
//! - [`ErrorReply`]: how a hook refuses a request (status, OpenAI body, `retry-after`).
//!
//! - [`PluginBuilder`] / [`ConfigError`]: how a plugin is made from its config section.
//! - [`Admission`]: a pool's admission control, asked of the pool (`pool.admits(class)`).
//! - [`headers`], [`metrics`]: the header names and the one way to declare a series.
//! - [`redis`]: the way to Redis (single node or Cluster) with timeouts and a cool-down, for
//!   plugins that share state through it.
//! - [`usage`], [`sse`]: an answer's token usage (which the core finds for every plugin: see
//!   [`RequestCtx::want_usage`]) and the splitting of a stream into its events.
//! - [`model_name`]: the model name a pool serves, spliced into requests and rewritten back
//!   in answers.
//!
//! A plugin crate owns its config type (serde, `deny_unknown_fields`, with an `enabled` key),
//! its builder, its metrics and its tests; plugins know each other only through this crate.

pub mod config;
pub mod context;
pub mod cpu;
pub mod ctx;
pub mod duration;
pub mod error;
pub mod escalation;
pub mod header_rules;
pub mod headers;
pub mod health;
pub mod llm;
pub mod memory;
pub mod metrics;
pub mod model_name;
pub mod plugin;
pub mod pool;
pub mod ratio;
pub mod raw_json;
pub mod redis;
pub mod retry;
pub mod sse;
pub mod tenant;
pub mod usage;

pub use crate::redis::{redacted, RedisFailure, RedisLink, RedisSettings};
pub use config::ConfigError;
pub use ctx::{PluginState, Progress, RequestCtx, Route};
pub use error::{ErrorReply, Reason};
pub use escalation::{AnswerCheck, Escalation, Judgement, StreamCheck, StreamJudge};
pub use header_rules::{HeaderRules, UpstreamAuth};
pub use health::{
    BackendLive, BackendState, HealthPolicy, InFlight, Load, OutlierPolicy, Probe, StaleAs, Verdict,
};
pub use llm::{Endpoint, InvalidRequest, LlmCall, LlmRequest};
pub use memory::{Held, MemoryBudget};
pub use model_name::{AnswerModel, ModelRewriter, ServedModel};
pub use plugin::{AttemptReport, Flow, Host, LocalResponse, Plugin, PluginBuilder};
pub use pool::{
    Admission, BackendSpec, Balancing, Capabilities, Demand, Pool, PoolSettings, Pools, Pressure,
    Priority, Selected, Timeouts, TokensPerSecond, Unfit,
};
pub use retry::{RetryBudget, RetryOn, RetryPolicy};
pub use tenant::{api_key, Tenant};
pub use usage::Usage;

// Re-exported so that plugins use the exact Pingora types the core uses.
pub use async_trait::async_trait;
pub use bytes::Bytes;
pub use pingora_error::{Error, ErrorType, Result};
pub use pingora_http::{RequestHeader, ResponseHeader};
pub use pingora_proxy::Session;
