//! Waiting while watching the client: a hook or the core that waits (for an upstream, a
//! coalesced answer, room in a pool) must notice a client that leaves meanwhile, and stop
//! waiting for it. The one place that reads Pingora's downstream session for that.

use bytes::Bytes;
use pingora_error::{Error, ErrorType, Result};
use pingora_proxy::Session;
use std::future::Future;
use tokio::time::{sleep_until, Instant};

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
    session: &mut Session,
    work: impl Future<Output = T>,
    deadline: Instant,
) -> Watched<T> {
    tokio::select! {
        done = work => Watched::Done(done),
        () = sleep_until(deadline) => Watched::Deadline,
        gone = session.downstream_session.read_body_or_idle(true) => {
            Watched::ClientGone(client_gone(gone))
        }
    }
}

/// Waits for `work`, without a deadline of its own, while watching the client: `Err` (a
/// downstream error) when the client left first.
pub async fn while_connected<T>(
    session: &mut Session,
    work: impl Future<Output = T>,
) -> Result<T, Box<Error>> {
    tokio::select! {
        done = work => Ok(done),
        gone = session.downstream_session.read_body_or_idle(true) => Err(client_gone(gone)),
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
