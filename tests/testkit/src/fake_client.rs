//! What the plugins' unit tests share: a fake [`Client`] (a request header, a peer address,
//! and a client that leaves when the test says so), the [`Host`] a plugin is built with, the
//! context the core leaves before `request`, and a way to run a hook until it waits. A
//! request hook runs against them without a socket or a proxy.

use sluice_sdk::calls::NoPools;
use sluice_sdk::{
    async_trait, Client, Endpoint, Error, ErrorType, Host, LlmCall, MemoryBudget, Pool, Pools,
    RequestCtx, RequestHeader, Route,
};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;

/// What a plugin is built with in a unit test: `pools`, a 1 MiB memory budget, no pool calls.
pub fn plugin_host(pools: Vec<Arc<Pool>>) -> Host {
    Host {
        pools: Arc::new(Pools::new(pools)),
        memory: MemoryBudget::new(1 << 20),
        calls: Arc::new(NoPools),
    }
}

/// A chat request's context as the core leaves it before the `request` hooks: routed to chat
/// completions, `body` parsed.
pub fn routed_chat(body: &str) -> RequestCtx {
    let mut ctx = RequestCtx::new();
    ctx.set_route(Route::Llm(Endpoint::ChatCompletions));
    let call = LlmCall::parse(Endpoint::ChatCompletions, body.to_owned().into())
        .unwrap_or_else(|e| panic!("chat body {body}: {e:?}"));
    ctx.set_llm(call);
    ctx
}

/// Runs `hook` until `waiting()` holds (it is queued, it follows a leader), checking after
/// each of its polls; panics if it finishes first. The test then changes what it waits on.
pub async fn run_until_waiting<F: Future + Unpin>(hook: &mut F, waiting: impl Fn() -> bool) {
    loop {
        tokio::select! {
            biased;
            _ = &mut *hook => panic!("the hook finished instead of waiting"),
            () = tokio::task::yield_now() => {}
        }
        if waiting() {
            return;
        }
    }
}

/// A client whose request is `header`, connected from `peer`, that stays until the test
/// makes it leave ([`FakeClient::leaving`]).
pub struct FakeClient {
    header: RequestHeader,
    peer: Option<SocketAddr>,
    left: watch::Receiver<bool>,
    leave: watch::Sender<bool>,
}

/// Makes a [`FakeClient`] leave, from another task.
pub struct Leave(watch::Sender<bool>);

impl Leave {
    /// The client closes its connection now: its `gone` future ends.
    pub fn now(&self) {
        self.0.send_replace(true);
    }
}

impl FakeClient {
    /// A `POST path` from 127.0.0.1 with no headers yet.
    pub fn post(path: &str) -> Self {
        let header = RequestHeader::build("POST", path.as_bytes(), None)
            .unwrap_or_else(|e| panic!("request line for {path}: {e}"));
        let (leave, left) = watch::channel(false);
        FakeClient {
            header,
            peer: Some(SocketAddr::from(([127, 0, 0, 1], 40_000))),
            left,
            leave,
        }
    }

    /// The same client with the header `name: value` added.
    pub fn with_header(mut self, name: &'static str, value: &str) -> Self {
        self.header
            .append_header(name, value)
            .unwrap_or_else(|e| panic!("header {name}: {e}"));
        self
    }

    /// The same client connected from `peer`.
    pub fn from_peer(mut self, peer: SocketAddr) -> Self {
        self.peer = Some(peer);
        self
    }

    /// What makes this client leave.
    pub fn leaving(&self) -> Leave {
        Leave(self.leave.clone())
    }
}

#[async_trait]
impl Client for FakeClient {
    fn request_header(&self) -> &RequestHeader {
        &self.header
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    async fn gone(&mut self) -> Box<Error> {
        // The sender lives in `self`, so the channel cannot close under the wait.
        let _ = self.left.wait_for(|left| *left).await;
        Error::explain(
            ErrorType::ConnectionClosed,
            "the fake client closed its connection",
        )
        .into_down()
    }
}
