#![warn(missing_docs)]
//! Sluice's upstream pools: the backends a model is served by, what is known of each live
//! (health, KV load, learned prefill speed, ejection), how a backend is chosen for an attempt,
//! and what a pool changes in requests and answers.
//!
//! - [`pool`]: [`Pool`] and [`Pools`], balancing ([`Balancing`]) and admission ([`Admission`]).
//! - [`members`]: a pool's backends as they stand now, and the one door through which they
//!   change (discovery, re-resolved names): joined, drained, warmed up.
//! - [`health`]: each backend's live state ([`BackendLive`]) and the requests in flight on it.
//! - [`retry`]: retries within a pool and their budget.
//! - [`prefix_index`]: which backends hold which prompt blocks, from vLLM's KV cache events
//!   (read in place by [`msgpack`]).
//! - [`ratio`]: a windowed ratio, for acceptance and hit rates.
//! - [`header_rules`]: the headers a pool sets, adds and hides, and its upstream credential.
//!
//! It depends on the LLM wire model (`sluice-llm`: a request's demand) and on Pingora's peer
//! type; it must not depend on the plugin contract (`sluice-sdk` depends
//! on it, never the other way).

pub mod header_rules;
pub mod health;
pub mod members;
pub mod msgpack;
pub mod pool;
pub mod prefix;
pub mod prefix_index;
pub mod ratio;
pub mod retry;

pub use health::{
    BackendLive, BackendState, HealthPolicy, InFlight, Load, LoraSlots, OutlierPolicy, Probe,
    SpeedSample, StaleAs, Verdict, Wait,
};
pub use members::{BackendSpec, Change, Member, Members, Membership, Wanted, MAX_ENDPOINTS};
pub use pool::{
    Admission, Balancing, Capabilities, ClientFields, Fairness, FlowControl, FlowId, Place, Pool,
    PoolSettings, Pools, Pressure, Priority, Room, Selected, Timeouts, TokensPerSecond, Unfit,
    WaitFor, Waited,
};
