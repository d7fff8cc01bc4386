//! Sluice: an edge proxy for LLM traffic, built on Pingora.
//!
//! - [`config`]: the YAML file, validated into runtime types.
//! - [`router`]: which pipeline a request takes.
//! - [`proxy`]: the one `ProxyHttp` implementation that drives the plugin chain.
//! - [`chain`]: the plugins, in their defined order.
//! - [`edge`]: connection caps and the header deadline, below HTTP.
//! - [`health`]: the background service that probes backends and scrapes their vLLM metrics.
//! - [`discovery`]: the background service that keeps pools equal to the fleet (DNS,
//!   Kubernetes EndpointSlices).
//! - [`admin`], [`metrics`], [`access_log`]: what operators see.
//! - `demo` (the default feature `demo`): the proxy with simulated vLLM pools, in one process.

pub mod access_log;
pub mod admin;
pub mod caps;
pub mod chain;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod discovery;
pub mod drain;
pub mod edge;
pub mod health;
pub mod keeper;
pub mod logging;
pub mod metrics;
pub mod models;
pub mod observers;
pub mod proxy;
pub mod reload;
pub mod router;
pub mod run_dir;
pub mod server;
pub mod telemetry;
