//! The Sluice plugin SDK: what every plugin depends on.
//!
//! - [`Plugin`]: the trait, with one hook per proxy phase and the return conventions.
//! - [`RequestCtx`]: the per-request state the core fills and plugins read.
//! - [`LlmCall`] / [`LlmRequest`]: the parsed OpenAI request, with its raw bytes.
//! - [`Pool`] / [`Pools`]: the upstream pools as plugins see them, with each backend's live
//!   health and load ([`health`]).
//! - [`ErrorReply`]: how a hook refuses a request (status, OpenAI body, `retry-after`).
//!
//! A plugin crate also owns its config type (serde, `deny_unknown_fields`, with an `enabled`
//! key) and a constructor that the core calls once at start-up.

pub mod ctx;
pub mod duration;
pub mod error;
pub mod escalation;
pub mod health;
pub mod llm;
pub mod plugin;
pub mod pool;
pub mod retry;
pub mod window;

pub use ctx::{PluginState, RequestCtx, Route};
pub use error::ErrorReply;
pub use escalation::{AnswerCheck, Escalation, Judgement, StreamCheck, StreamJudge};
pub use health::{
    BackendLive, BackendState, HealthPolicy, InFlight, Load, OutlierPolicy, Probe, StaleAs, Verdict,
};
pub use llm::{Endpoint, InvalidRequest, LlmCall, LlmRequest};
pub use plugin::{Flow, LocalResponse, Plugin};
pub use pool::{
    BackendSpec, Balancing, Capabilities, Demand, Pool, PoolSettings, Pools, Pressure, Priority,
    Selected, Timeouts, TokensPerSecond,
};
pub use retry::{RetryBudget, RetryPolicy};

// Re-exported so that plugins use the exact Pingora types the core uses.
pub use async_trait::async_trait;
pub use bytes::Bytes;
pub use pingora_error::{Error, ErrorType, Result};
pub use pingora_http::{RequestHeader, ResponseHeader};
pub use pingora_proxy::Session;
