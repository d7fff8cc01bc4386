//! The client a request came from, as a plugin sees it, and waiting while watching it.
//!
//! Plugins get a narrow [`Client`] in their request hooks, not Pingora's `Session`: the
//! request header, the peer's address and a future that ends when the client leaves are all
//! any of them reads, and a hook written against the trait has unit tests without sockets
//! (the testkit's `FakeClient`).
//!
//! A hook or the core that waits (for an upstream, a coalesced answer, room in a pool) must
//! notice a client that leaves meanwhile, and stop waiting for it: [`watch`] and
//! [`while_connected`] for plugins, [`session`] for the core, which waits on every attempt
//! and so reads Pingora's session directly, without the box a trait object's future needs.

use async_trait::async_trait;
use bytes::Bytes;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::RequestHeader;
use pingora_proxy::Session;
use std::future::Future;
use std::net::SocketAddr;
use tokio::time::{sleep_until, Instant};

/// The client of a request: what a plugin's request hooks read of it.
#[async_trait]
pub trait Client: Send + Sync {
    /// The request header as the client sent it (with the core's edits, such as a request
    /// id it set).
    fn request_header(&self) -> &RequestHeader;

    /// The address of the peer that connected (a TCP peer; `None` on a Unix socket): the
    /// client, or the proxy in front of it.
    fn peer(&self) -> Option<SocketAddr>;

    /// Ends when the client leaves: it closed its connection, or sent data after its
    /// request (which a request whose body was read whole never does). The error is a
    /// downstream one. Never ends while the client waits quietly.
    async fn gone(&mut self) -> Box<Error>;
}

#[async_trait]
impl Client for Session {
    fn request_header(&self) -> &RequestHeader {
        self.req_header()
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.client_addr().and_then(|a| a.as_inet()).copied()
    }

    async fn gone(&mut self) -> Box<Error> {
        session::gone(self).await
    }
}

/// What a watched wait gave, or why it gave nothing.
#[derive(Debug)]
pub enum Watched<T> {
    /// The work finished.
    Done(T),
    /// The deadline came first.
    Deadline,
    /// The client closed its connection (or sent more than its request) meanwhile: a
    /// downstream error.
    ClientGone(Box<Error>),
}

/// Waits for `work` until `deadline`, while watching the client.
pub async fn watch<T>(
    client: &mut dyn Client,
    work: impl Future<Output = T>,
    deadline: Instant,
) -> Watched<T> {
    watched(client.gone(), work, deadline).await
}

/// Waits for `work`, without a deadline of its own, while watching the client: `Err` (a
/// downstream error) when the client left first.
pub async fn while_connected<T>(
    client: &mut dyn Client,
    work: impl Future<Output = T>,
) -> Result<T, Box<Error>> {
    unless_gone(client.gone(), work).await
}

/// The same waits on Pingora's session itself, for the core.
pub mod session {
    use super::*;

    /// [`super::watch`] on the session.
    pub async fn watch<T>(
        session: &mut Session,
        work: impl Future<Output = T>,
        deadline: Instant,
    ) -> Watched<T> {
        watched(gone(session), work, deadline).await
    }

    /// [`super::while_connected`] on the session.
    pub async fn while_connected<T>(
        session: &mut Session,
        work: impl Future<Output = T>,
    ) -> Result<T, Box<Error>> {
        unless_gone(gone(session), work).await
    }

    /// Ends when the session's client leaves (see [`Client::gone`]).
    pub(super) async fn gone(session: &mut Session) -> Box<Error> {
        client_gone(session.downstream_session.read_body_or_idle(true).await)
    }
}

async fn watched<T>(
    gone: impl Future<Output = Box<Error>>,
    work: impl Future<Output = T>,
    deadline: Instant,
) -> Watched<T> {
    tokio::select! {
        done = work => Watched::Done(done),
        () = sleep_until(deadline) => Watched::Deadline,
        gone = gone => Watched::ClientGone(gone),
    }
}

async fn unless_gone<T>(
    gone: impl Future<Output = Box<Error>>,
    work: impl Future<Output = T>,
) -> Result<T, Box<Error>> {
    tokio::select! {
        done = work => Ok(done),
        gone = gone => Err(gone),
    }
}

/// The error of a client that left while a request waited: its read's error, or (data came
/// after a request whose body was read whole) a closed connection.
fn client_gone(read: Result<Option<Bytes>>) -> Box<Error> {
    match read {
        Err(e) => e,
        Ok(_) => Error::explain(
            ErrorType::ConnectionClosed,
            "the client sent data after its request",
        ),
    }
    .into_down()
}
