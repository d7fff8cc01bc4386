//! What Sluice's end-to-end tests share: the real `sluice` binary on free ports, real
//! upstreams, real Redis; and the plugins' unit tests, a fake client. Dev-only; never part
//! of the product.
//!
//! - [`Proxy`]: runs the binary with a config built from JSON values (see [`Proxy::start`]),
//!   and kills it on drop; its admin endpoints ([`Proxy::status`], [`Proxy::metric`]) and the
//!   LLM endpoint ([`Proxy::ask`]) as methods.
//! - [`pool`]: a `pools[]` entry of that config.
//! - [`Scripted`]: a raw HTTP/1.1 upstream that answers with exact bytes, at chosen moments,
//!   and records what it received: for byte-for-byte and timing proofs.
//! - [`RedisServer`], [`RedisCluster`], [`SilentServer`]: real `redis-server` processes, and
//!   a Redis that never answers.
//! - [`free_port`] and [`reserve_port`]: ports for what a test starts (the module docs of
//!   [`ports`] say how collisions between parallel tests are avoided).
//! - [`Demo`]: `sluice demo` on free ports, killed on drop; [`explain`]: a failed command's
//!   output as an assertion message.
//! - [`TestCa`] and [`tls_front`]: a private CA per test, the certificates it issues, and a
//!   TLS front before a plain backend.
//! - [`RealVllm`], [`real_fleet`]: real vLLM servers (its CPU build) serving tiny models,
//!   for the real-vLLM tier.
//! - [`dns`]: a real DNS server ([`DnsServer`], `dnsmasq`) whose records a test sets,
//!   resolvers that misbehave ([`BadDns`]), and simulators sharing one port on several
//!   loopback addresses ([`sims_on_loopbacks`]), for pools discovered through DNS.
//! - [`kube_api::FakeKubeApi`]: a fake Kubernetes API server speaking the list and watch
//!   protocol for EndpointSlices, scripted by the test ([`kube_api::endpoint_slice`] builds one).
//! - [`FakeClient`]: a plugin's client without a socket, for unit tests of request hooks.
//! - Simulated vLLM backends come from `vllm_sim` directly; [`streaming_sim`] is a common one.
// Test code: a panic here is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod config;
pub mod dns;
mod fake_client;
pub mod kube_api;
mod llm;
pub mod otlp;
pub mod ports;
mod proc;
mod proxy;
mod redis;
mod scripted;
mod tls;
mod vllm;

pub use config::{key_digest, pool, Pool};
pub use dns::{sims_on_loopbacks, BadDns, DnsServer, Misbehaviour};
pub use fake_client::{plugin_host, routed_chat, run_until_waiting, FakeClient, Leave};
pub use llm::{
    answer_confidence, ask_url, ask_url_with, assert_ends_with_error_event, chat, client,
    client_within, content, sim_serving, sse_data, sse_events, streaming_sim, upstream_calls,
    wait_for, Answer,
};
pub use otlp::{OtlpReceiver, ReceivedSpan};
pub use ports::{free_port, reserve_port, ReservedPort};
pub use proc::{explain, run_python, Demo};
pub use proxy::{exits_within, metric_value, signal, Proxy};
pub use redis::{redis_cli, RedisCluster, RedisServer, SilentServer, SlowRelay};
pub use scripted::{Received, Script, Scripted};
pub use tls::{tls_front, Leaf, TestCa};
pub use vllm::{real_fleet, tiny_models, vllm_python, RealFleet, RealVllm, TinyModel};

/// `tests/fixtures`: recorded vLLM answers and metric pages; its README says where each
/// comes from.
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures");

/// The bytes of the fixture `name` in `tests/fixtures`.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{FIXTURES}/{name}");
    std::fs::read(&path).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}
