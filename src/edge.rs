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
//!   line that ends every HTTP/1 header; HTTP/2 connections are passed through untouched
//!   (their streams are bounded by the proxy's own timeouts).
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
}

impl<A> Guarded<A> {
    pub fn new(app: A, limits: ConnectionLimits) -> Self {
        Self {
            app: Arc::new(app),
            header_timeout: limits.header_timeout,
            open: Caps::new(limits.max_connections, limits.max_connections_per_client),
            h2c: Vec::new(),
        }
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
                refuse(over, &mut stream).await;
                return None;
            }
        };
        metrics::set_gauge(&metrics::OPEN_CONNECTIONS, self.open.total() as i64);
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
        metrics::set_gauge(&metrics::OPEN_CONNECTIONS, self.open.total() as i64);
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
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.deadline.as_mut() {
                Some(deadline) if this.phase == Phase::Header => {
                    ready!(deadline.as_mut().poll(cx));
                    this.expire(cx)
                }
                _ => Poll::Pending,
            },
        }
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
