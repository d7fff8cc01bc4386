//! What bounds each client below HTTP: how many connections one client address, and all
//! clients together, may hold, and how long a request header may take to arrive.
//!
//! Pingora bounds each read of a request header (60 s) but not the whole header, so a client
//! sending a byte every 59 s holds its connection, its task and its buffers for as long as it
//! likes (slowloris); and nothing caps connections. Both need the connection itself, before
//! Pingora's HTTP session exists, so they live in a [`ServerApp`] wrapped around the proxy:
//!
//! - [`Guarded`] counts connections at accept, per client address and in total, and answers
//!   one over a cap with a complete HTTP response (429 for one client, 503 for everyone, each
//!   with `retry-after`), never with a silent close or a hang;
//! - [`HeaderDeadline`] wraps the connection's stream and fails its reads once a request
//!   header has taken longer than `limits.client_header_timeout` (nginx's
//!   `client_header_timeout`), after answering 408. It finds the header's end by the blank
//!   line that ends every HTTP/1 header. HTTP/2 connections have no header deadline (their
//!   streams are bounded by the proxy's own timeouts, an idle connection by Pingora's
//!   `h2_idle_timeout`), but their frames are counted: [`ResetBudget`] closes a connection
//!   whose client resets too many of the streams it opens. The `h2` crate bounds only resets
//!   of streams not yet accepted; a client that waits for each batch to be accepted (a PING
//!   between) made Sluice send 5,000 upstream requests in 3.2 s and was never cut.
//!
//! Written here rather than taken from a library: what it bounds is Pingora's own header
//! parser, which offers no total deadline, and the wrapper must implement Pingora's `IO`.

use crate::caps::{Caps, Over};
use crate::metrics;
use async_trait::async_trait;
use pingora_core::apps::ServerApp;
use pingora_core::protocols::raw_connect::ProxyDigest;
use pingora_core::protocols::tls::{SslDigest, TlsRef};
use pingora_core::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use pingora_core::server::ShutdownWatch;
use sluice_sdk::{headers, ErrorReply, Reason};
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{sleep, Sleep};

/// The caps and deadlines of the proxy listeners' connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once, all clients together.
    pub max_connections: usize,
    /// Connections open at once from one client address.
    pub max_connections_per_client: usize,
    /// The longest a request header may take to arrive, from the connection's start (first
    /// request) or from its first byte (later requests on a kept-alive connection).
    pub header_timeout: Duration,
}

/// The proxy, behind the connection caps and the header deadline.
pub struct Guarded<A> {
    app: Arc<A>,
    header_timeout: Duration,
    open: Arc<Caps>,
    /// The plain listeners that take h2c (prior knowledge).
    h2c: Vec<SocketAddr>,
    /// Its connections are the proxy's, shown in `sluice_connections_open` (not the admin's).
    counted: bool,
}

impl<A> Guarded<A> {
    pub fn new(app: A, limits: ConnectionLimits) -> Self {
        Self {
            app: Arc::new(app),
            header_timeout: limits.header_timeout,
            open: Caps::new(limits.max_connections, limits.max_connections_per_client),
            h2c: Vec::new(),
            counted: true,
        }
    }

    /// Connections not shown in `sluice_connections_open` (the admin listener's).
    pub fn uncounted(mut self) -> Self {
        self.counted = false;
        self
    }

    /// Connections to these listeners that open with the HTTP/2 preface are served as h2c;
    /// the proxy's `h2c` server option must be on for them.
    pub fn with_h2c(mut self, listeners: Vec<SocketAddr>) -> Self {
        self.h2c = listeners;
        self
    }

    /// Whether `stream` came in on an h2c listener (one bound to 0.0.0.0 or [::] takes
    /// connections on any local address of its port).
    fn takes_h2c(&self, stream: &Stream) -> bool {
        let Some(local) = stream
            .get_socket_digest()
            .and_then(|d| d.local_addr().and_then(|a| a.as_inet().copied()))
        else {
            return false;
        };
        self.h2c
            .iter()
            .any(|l| l.port() == local.port() && (l.ip().is_unspecified() || l.ip() == local.ip()))
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Guarded<A> {
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let client = client_ip(&stream);
        let slot = match self.open.admit(client) {
            Ok(slot) => slot,
            Err(over) => {
                // Boxed: a refusal's future holds its drain buffer, and inline it would
                // make every connection's future, refused or not, 4 KiB larger.
                Box::pin(refuse(over, &mut stream)).await;
                return None;
            }
        };
        if self.counted {
            metrics::set_gauge(&metrics::OPEN_CONNECTIONS, self.open.total() as i64);
        }
        let h2c = self.takes_h2c(&stream);
        let deadline = HeaderDeadline::new(stream, self.header_timeout).with_h2c(h2c);
        let next_request = deadline.next_request();
        let mut stream: Stream = Box::new(deadline);
        // Kept-alive requests are served here, so that the slot and the deadline stay with
        // the connection for its whole life (Pingora's own loop would hand the stream back
        // to a fresh call).
        while let Some(reused) = self.app.process_new(stream, shutdown).await {
            // The exchange is over (its answer written, its body read): what comes next is
            // the next request's header.
            next_request.store(true, Relaxed);
            stream = reused;
        }
        drop(slot);
        if self.counted {
            metrics::set_gauge(&metrics::OPEN_CONNECTIONS, self.open.total() as i64);
        }
        None
    }

    async fn cleanup(&self) {
        self.app.cleanup().await;
    }
}

fn client_ip(stream: &Stream) -> Option<IpAddr> {
    let digest = stream.get_socket_digest()?;
    digest.peer_addr()?.as_inet().map(|addr| addr.ip())
}

/// Refused connections being drained at once ([`linger`]); past this, one is closed at once.
static LINGERING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(256);

/// How long, and how many bytes, a refused connection is drained for at most.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1 << 20;

/// Answers a connection over a cap in full and closes it: the client reads why instead of a
/// reset, and knows when to come back.
async fn refuse(over: Over, stream: &mut Stream) {
    let reply = over.reply(Reason::TooManyConnections, "connections open");
    metrics::inc(&metrics::REJECTIONS, &[reply.reason.as_str(), "-"]);
    let response = raw_response(&reply);
    // Bounded: a client that does not read its refusal is not waited for.
    let write = async {
        stream.write_all(&response).await?;
        stream.flush().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
    Shutdown::shutdown(&mut **stream).await;
    linger(stream).await;
}

/// Reads what the client still sends (its request, its body) until it closes, as nginx's
/// lingering close: a socket closed with unread bytes is reset, and a client still writing its
/// body then gets a broken pipe instead of the answer already sent. Bounded in time, bytes and
/// in how many connections linger at once, so the refused cannot hold what the cap protects.
async fn linger(stream: &mut Stream) {
    use tokio::io::AsyncReadExt;
    let Ok(_draining) = LINGERING.try_acquire() else {
        return;
    };
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut read = 0;
        while read < LINGER_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => read += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}

/// A whole HTTP/1.1 answer for `reply`, for where no HTTP session exists to write it, that
/// closes the connection.
fn raw_response(reply: &ErrorReply) -> Vec<u8> {
    let body = reply.body();
    let reason = http::StatusCode::from_u16(reply.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let mut head = format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         {}: {}\r\nconnection: close\r\n",
        reply.status,
        body.len(),
        headers::REJECTED,
        reply.reason
    );
    if let Some(seconds) = reply.retry_after {
        head.push_str(&format!("retry-after: {seconds}\r\n"));
    }
    head.push_str("\r\n");
    let mut response = head.into_bytes();
    response.extend_from_slice(&body);
    response
}

/// The answer to a request whose header did not arrive in time (made once).
static HEADER_TIMEOUT_ANSWER: LazyLock<Vec<u8>> = LazyLock::new(|| {
    raw_response(&ErrorReply::new(
        408,
        Reason::HeaderTimeout,
        "The request header did not arrive in time.",
    ))
});

/// Where a connection is in its current exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading a request header, under the deadline once it is armed.
    Header,
    /// The header has arrived: its body and the answer are the proxy's to bound.
    Message,
    /// HTTP/2: not watched.
    Passthrough,
}

/// A connection whose request headers must arrive within a deadline (see the module docs).
pub struct HeaderDeadline {
    inner: Stream,
    timeout: Duration,
    phase: Phase,
    /// Armed for the current header: at the connection's start for the first request, at
    /// the first byte for later ones.
    deadline: Option<Pin<Box<Sleep>>>,
    /// How much of the blank line (`\r\n\r\n`) that ends a header was seen last.
    matched: usize,
    /// Set when Pingora hands the connection back for its next request: the next read
    /// starts a new header. (Not on the answer's first write: on a route that answers before
    /// the upload ends, the rest of the body would be taken for a header and cut at the
    /// deadline, a 408 written into the middle of the answer.)
    next_request: Arc<AtomicBool>,
    /// Nothing was read yet: the first bytes say whether this is HTTP/2.
    first_read: bool,
    /// Its listener takes h2c: Pingora may peek for the preface.
    h2c: bool,
    /// HTTP/2: the client's streams and resets, counted from its frames.
    resets: ResetBudget,
}

const HEADER_END: &[u8; 4] = b"\r\n\r\n";
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

impl HeaderDeadline {
    pub fn new(inner: Stream, timeout: Duration) -> Self {
        let h2 = matches!(inner.selected_alpn_proto(), Some(ALPN::H2));
        Self {
            inner,
            timeout,
            phase: if h2 {
                Phase::Passthrough
            } else {
                Phase::Header
            },
            deadline: Some(Box::pin(sleep(timeout))),
            matched: 0,
            next_request: Arc::new(AtomicBool::new(false)),
            first_read: true,
            h2c: false,
            resets: ResetBudget::default(),
        }
    }

    pub fn with_h2c(mut self, h2c: bool) -> Self {
        self.h2c = h2c;
        self
    }

    /// The flag that says the exchange is over and the next read starts a new request.
    fn next_request(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.next_request)
    }

    /// Follows the header through the bytes just read.
    fn scan(&mut self, bytes: &[u8]) {
        if std::mem::take(&mut self.first_read) && bytes.starts_with(H2_PREFACE) {
            self.phase = Phase::Passthrough;
            self.deadline = None;
            return;
        }
        if self.phase != Phase::Header || bytes.is_empty() {
            return;
        }
        if self.deadline.is_none() {
            self.deadline = Some(Box::pin(sleep(self.timeout)));
        }
        for &byte in bytes {
            self.matched = match (HEADER_END.get(self.matched), byte) {
                (Some(&expected), b) if b == expected => self.matched + 1,
                (_, b'\r') => 1,
                _ => 0,
            };
            if self.matched == HEADER_END.len() {
                self.phase = Phase::Message;
                self.deadline = None;
                self.matched = 0;
                return;
            }
        }
    }

    /// Past the deadline: answers 408 if the socket takes it at once, and fails the read.
    fn expire(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.deadline = None;
        let _ = Pin::new(&mut self.inner).poll_write(cx, &HEADER_TIMEOUT_ANSWER);
        let _ = Pin::new(&mut self.inner).poll_flush(cx);
        metrics::inc(&metrics::REJECTIONS, &[Reason::HeaderTimeout.as_str(), "-"]);
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the request header did not arrive in time",
        )))
    }
}

impl AsyncRead for HeaderDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.phase == Phase::Message && this.next_request.swap(false, Relaxed) {
            // The next request on a kept-alive connection: its deadline starts with its
            // first byte (waiting for it is Pingora's keep-alive timeout).
            this.phase = Phase::Header;
        }
        let filled = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                // Only a header, or the first bytes, need looking at: a body passes untouched.
                if this.phase == Phase::Header || this.first_read {
                    let new = buf.filled().get(filled..).unwrap_or_default();
                    this.scan(new.get(..HEADER_SCAN_LIMIT).unwrap_or(new));
                }
                if this.phase == Phase::Passthrough {
                    let new = buf.filled().get(filled..).unwrap_or_default();
                    if !this.resets.read(new) {
                        metrics::inc(&metrics::REJECTIONS, &[Reason::TooManyResets.as_str(), "-"]);
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "the client reset too many of its HTTP/2 streams",
                        )));
                    }
                    if !this.resets.awaits_preface() {
                        // The connection preface came: an idle h2 connection is Pingora's
                        // `h2_idle_timeout`'s from here.
                        this.deadline = None;
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.deadline.as_mut() {
                Some(deadline) if this.phase == Phase::Header => {
                    ready!(deadline.as_mut().poll(cx));
                    this.expire(cx)
                }
                // HTTP/2 over TLS: the client's connection preface is its first header. The
                // h2 handshake waits for it without a deadline of its own, so a client that
                // finished TLS and sends nothing held its connection for ever.
                Some(deadline)
                    if this.phase == Phase::Passthrough && this.resets.awaits_preface() =>
                {
                    ready!(deadline.as_mut().poll(cx));
                    this.deadline = None;
                    metrics::inc(&metrics::REJECTIONS, &[Reason::HeaderTimeout.as_str(), "-"]);
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the HTTP/2 connection preface did not arrive in time",
                    )))
                }
                _ => Poll::Pending,
            },
        }
    }
}

/// An HTTP/2 client's stream openings and resets, read from its frames as they pass (only
/// the 9-byte frame headers are looked at; payloads are skipped). As Envoy's premature-reset
/// check does, a connection is over its budget once its client has reset more than
/// [`ResetBudget::FREE_RESETS`] streams and more than half of those it opened: a client that
/// cancels now and then never comes near it, one that opens streams to reset them does
/// within a few hundred.
#[derive(Debug)]
struct ResetBudget {
    /// Bytes of the connection preface still to pass.
    preface: usize,
    /// The frame header being read, and how much of it has come.
    head: [u8; 9],
    head_len: usize,
    /// Payload bytes of the current frame still to skip.
    skip: usize,
    /// The highest stream id the client opened: a HEADERS frame above it opens one.
    last_stream: u32,
    opened: u32,
    resets: u32,
}

impl Default for ResetBudget {
    fn default() -> Self {
        Self {
            preface: H2_CONNECTION_PREFACE_LEN,
            head: [0; 9],
            head_len: 0,
            skip: 0,
            last_stream: 0,
            opened: 0,
            resets: 0,
        }
    }
}

/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
const H2_CONNECTION_PREFACE_LEN: usize = 24;

impl ResetBudget {
    const FREE_RESETS: u32 = 100;
    const HEADERS: u8 = 0x1;
    const RST_STREAM: u8 = 0x3;

    /// Whether the client's connection preface has not all come yet.
    fn awaits_preface(&self) -> bool {
        self.preface > 0
    }

    /// Counts what `bytes`, the next ones the client sent, hold; `false` once the client is
    /// over its budget.
    fn read(&mut self, mut bytes: &[u8]) -> bool {
        while !bytes.is_empty() {
            if self.preface > 0 || self.skip > 0 {
                let pass = if self.preface > 0 {
                    &mut self.preface
                } else {
                    &mut self.skip
                };
                let n = (*pass).min(bytes.len());
                *pass -= n;
                bytes = bytes.get(n..).unwrap_or_default();
                continue;
            }
            let n = (self.head.len() - self.head_len).min(bytes.len());
            if let (Some(to), Some(from)) = (
                self.head.get_mut(self.head_len..self.head_len + n),
                bytes.get(..n),
            ) {
                to.copy_from_slice(from);
            }
            self.head_len += n;
            bytes = bytes.get(n..).unwrap_or_default();
            if self.head_len == self.head.len() {
                self.head_len = 0;
                if !self.frame() {
                    return false;
                }
            }
        }
        true
    }

    /// Counts the frame whose header is complete; `false` once over the budget.
    fn frame(&mut self) -> bool {
        let [l0, l1, l2, kind, _flags, s0, s1, s2, s3] = self.head;
        self.skip = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
        let stream = u32::from_be_bytes([s0 & 0x7f, s1, s2, s3]);
        match kind {
            Self::HEADERS if stream > self.last_stream => {
                self.last_stream = stream;
                self.opened = self.opened.saturating_add(1);
            }
            Self::RST_STREAM if stream != 0 => {
                self.resets = self.resets.saturating_add(1);
                if self.resets > Self::FREE_RESETS && self.resets.saturating_mul(2) > self.opened {
                    return false;
                }
            }
            _ => {}
        }
        true
    }
}

/// More than this of one read is never part of a header Pingora accepts (it refuses headers
/// over 1 MiB), so a larger read is a body or garbage and only its start is scanned.
const HEADER_SCAN_LIMIT: usize = 1 << 20;

impl AsyncWrite for HeaderDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl fmt::Debug for HeaderDeadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeaderDeadline")
            .field("inner", &self.inner)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

// What Pingora asks of a connection, answered by the connection inside.

#[async_trait]
impl Shutdown for HeaderDeadline {
    async fn shutdown(&mut self) {
        Shutdown::shutdown(&mut *self.inner).await;
    }
}

impl UniqueID for HeaderDeadline {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeaderDeadline {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeaderDeadline {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeaderDeadline {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest);
    }
}

impl GetSocketDigest for HeaderDeadline {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest);
    }
}

#[async_trait]
impl Peek for HeaderDeadline {
    /// Pingora peeks for the h2c preface on every plain connection once h2c is on for the
    /// service. On a listener without h2c the answer is "no preface" without reading, so h1
    /// is served; on one with it, the peek waits no longer than a request header may.
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        if !self.h2c {
            buf.fill(0);
            return Ok(true);
        }
        match tokio::time::timeout(self.timeout, self.inner.try_peek(buf)).await {
            Ok(peeked) => peeked,
            Err(_) => {
                metrics::inc(&metrics::REJECTIONS, &[Reason::HeaderTimeout.as_str(), "-"]);
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the connection's first bytes did not arrive in time",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn frame(kind: u8, stream: u32, payload_len: usize) -> Vec<u8> {
        let mut f = vec![
            (payload_len >> 16) as u8,
            (payload_len >> 8) as u8,
            payload_len as u8,
            kind,
            0,
        ];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend(std::iter::repeat_n(0x5a, payload_len));
        f
    }

    /// The bytes of a client that opens `streams` streams and resets the first `resets` of
    /// them (payloads that look like frame headers included, to be skipped as payload).
    fn client(streams: u32, resets: u32) -> Vec<u8> {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(0x4, 0, 12));
        for i in 0..streams {
            bytes.extend(frame(ResetBudget::HEADERS, 2 * i + 1, 20));
            bytes.extend(frame(0x0, 2 * i + 1, 9));
        }
        for i in 0..resets {
            bytes.extend(frame(ResetBudget::RST_STREAM, 2 * i + 1, 4));
        }
        bytes
    }

    fn within_budget(bytes: &[u8], cut: usize) -> bool {
        let mut budget = ResetBudget::default();
        bytes.chunks(cut).all(|chunk| budget.read(chunk))
    }

    #[test]
    fn resets_are_counted_however_the_frames_are_cut() {
        for cut in [1, 5, 9, 24, 4096] {
            assert!(within_budget(&client(300, 100), cut), "the free resets");
            assert!(
                within_budget(&client(300, 150), cut),
                "half of those opened"
            );
            assert!(!within_budget(&client(300, 151), cut), "over both");
            assert!(!within_budget(&client(120, 101), cut), "over both");
        }
    }
}
