//! A fake [`Client`] for the plugins' unit tests: a request header, a peer address, and a
//! client that leaves when the test says so. A request hook runs against it without a
//! socket or a proxy.

use sluice_sdk::{async_trait, Client, Error, ErrorType, RequestHeader};
use std::net::SocketAddr;
use tokio::sync::watch;

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
