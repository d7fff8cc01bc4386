//! Fault switches acting on a completion request: before it runs, and part-way through the
//! answer (stream events or a non-stream body).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::errors;
use crate::faults::Faults;
use crate::openai::ApiError;
use crate::server::{self, HttpResponse};
use crate::Shared;

/// The channel feeding a response body; an `Err` item aborts the connection.
pub type BodySender = mpsc::Sender<Result<Bytes, io::Error>>;

/// The faults that answer before the request is even parsed: a dead engine, a hang, an
/// injected error status. `None` lets the request through.
pub async fn before_request(shared: &Shared, faults: &Faults) -> Option<HttpResponse> {
    if faults.engine_dead {
        shared.stats.count_fault();
        return Some(server::error(
            shared,
            &ApiError::new(500, errors::ENGINE_DEAD),
        ));
    }
    if faults.hang_before_headers {
        shared.stats.count_fault();
        shared.shutdown_signal().await;
        return Some(server::error(
            shared,
            &ApiError::new(503, "Service Unavailable"),
        ));
    }
    if faults.error_rate > 0.0 {
        let request_number = shared
            .fault_counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if faults.should_error(request_number) {
            shared.stats.count_fault();
            return Some(server::error(
                shared,
                &errors::injected(faults.error_status),
            ));
        }
    }
    None
}

/// What a mid-stream fault does to the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MidStream {
    /// Stop sending and keep the connection open.
    Hang,
    /// Abort the connection without the chunked terminator.
    Drop,
    /// Send a 500 error event, then `[DONE]`.
    Error,
}

/// The mid-stream fault due before sending event number `sent` (0-based), if any.
pub fn due_mid_stream(faults: &Faults, sent: u32) -> Option<MidStream> {
    let reached = |after: Option<u32>| after.is_some_and(|limit| sent >= limit);
    if reached(faults.hang_after_chunks) {
        Some(MidStream::Hang)
    } else if reached(faults.drop_after_chunks) {
        Some(MidStream::Drop)
    } else if reached(faults.error_after_chunks) {
        Some(MidStream::Error)
    } else {
        None
    }
}

/// A non-stream answer hit by a mid-body fault: headers promise the full length, half arrives,
/// then the connection hangs or is dropped.
pub fn truncated_body(shared: &Arc<Shared>, body: Vec<u8>, faults: &Faults) -> HttpResponse {
    shared.stats.count_fault();
    let length = body.len();
    let half = Bytes::from(body).slice(..length / 2);
    let (sender, receiver) = mpsc::channel(2);
    let hang = faults.hang_after_chunks.is_some();
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let _ = sender.send(Ok(half)).await;
        if hang {
            tokio::select! {
                _ = sender.closed() => {}
                _ = shared.shutdown_signal() => {}
            }
        } else {
            shared.stats.count_error();
            flush_then_abort(&sender, "sim: connection dropped mid-body").await;
        }
    });
    server::with_content_length(
        200,
        "application/json",
        server::channel_body(receiver),
        length,
    )
}

/// Abort the connection after what was sent so far reached the socket: hyper discards its
/// write buffer on a body error, so wait until the channel is drained and the chunks flushed.
pub async fn flush_then_abort(sender: &BodySender, why: &'static str) {
    for _ in 0..200 {
        if sender.capacity() == sender.max_capacity() || sender.is_closed() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _ = sender
        .send(Err(io::Error::new(io::ErrorKind::ConnectionAborted, why)))
        .await;
}
