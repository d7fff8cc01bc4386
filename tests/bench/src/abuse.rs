//! The abusive clients of scenario 8, all on this machine, each in a loop of its own until
//! the attack is stopped:
//!
//! - *stalled readers*: a raw socket with a small receive buffer sends a streamed chat request
//!   with a large `max_tokens`, then never reads. The answer fills the socket buffers on both
//!   sides, the proxy's writes stall, and only its send timeout frees what it holds for that
//!   client (the stream task, the upstream connection, the simulator's sequence). A reader
//!   cannot see the proxy give up (the proxy's FIN waits behind the answer the reader never
//!   takes), so each one lets go after a fixed hold, longer than the proxies' send timeout,
//!   closing its socket with the answer unread (a reset, which frees whatever the proxy still
//!   holds), and starts again: the pressure holds whether the proxy cut it or not.
//! - *slowloris*: a raw socket trickles a request header, one byte at a time, never ending it;
//!   when the proxy closes it, a new one starts at once.
//! - *big bodies*: keep-alive connections sending the same large chat request back to back.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::loadgen::{send_one, Target};

/// What to attack with.
#[derive(Clone, Debug)]
pub struct AttackSpec {
    pub addr: SocketAddr,
    /// Stalled readers at once.
    pub stalled: usize,
    /// A stalled reader's whole request, raw HTTP/1.1.
    pub stall_request: Bytes,
    /// Its socket's `SO_RCVBUF` (the kernel doubles it).
    pub stall_rcvbuf: u32,
    /// How long the first reader holds its socket before starting over; the last one holds
    /// half as long again, so that they do not all let go together.
    pub stall_hold: Duration,
    /// Slowloris connections at once.
    pub slowloris: usize,
    /// One byte of header per this long.
    pub slowloris_every: Duration,
    /// Big-body connections at once.
    pub bodies: usize,
    /// The big-body request.
    pub body: Arc<Target>,
    /// Every attacker's first connection starts within this long, spread evenly.
    pub ramp: Duration,
}

/// What the attackers did.
#[derive(Clone, Debug, Default)]
pub struct AttackStats {
    /// Requests the stalled readers sent.
    pub stalled_sent: u64,
    /// Of those, how many had an answer beginning `HTTP/1.1 200` waiting in the socket when
    /// the reader let go (peeked, never read): the stall the attack meant.
    pub stalled_streaming: u64,
    /// The first other status line a stalled reader found (a refusal: no stall).
    pub stalled_other: Option<String>,
    pub slowloris_opened: u64,
    /// Slowloris connections the proxy closed (the rest were open when the attack stopped).
    pub slowloris_cut: u64,
    /// How long each cut slowloris connection had lived, seconds.
    pub slowloris_lived: Vec<f64>,
    pub bodies_ok: u64,
    pub bodies_failed: u64,
    pub first_body_error: Option<String>,
    /// Connections the attackers could not open or write to (a refusal at accept).
    pub connect_errors: u64,
    pub first_connect_error: Option<String>,
}

impl AttackStats {
    /// Adds another attack's counts to these (scenario 23 sums its abuse windows).
    pub(crate) fn merge(&mut self, o: AttackStats) {
        self.stalled_sent += o.stalled_sent;
        self.stalled_streaming += o.stalled_streaming;
        self.stalled_other = self.stalled_other.take().or(o.stalled_other);
        self.slowloris_opened += o.slowloris_opened;
        self.slowloris_cut += o.slowloris_cut;
        self.slowloris_lived.extend(o.slowloris_lived);
        self.bodies_ok += o.bodies_ok;
        self.bodies_failed += o.bodies_failed;
        self.first_body_error = self.first_body_error.take().or(o.first_body_error);
        self.connect_errors += o.connect_errors;
        self.first_connect_error = self.first_connect_error.take().or(o.first_connect_error);
    }

    fn connect_error(&mut self, e: &anyhow::Error) {
        self.connect_errors += 1;
        if self.first_connect_error.is_none() {
            self.first_connect_error = Some(format!("{e:#}"));
        }
    }

    /// The median lifetime of the slowloris connections the proxy cut, seconds.
    pub fn slowloris_median_lived(&self) -> f64 {
        crate::report::Series(self.slowloris_lived.clone()).median()
    }
}

/// A running attack; dropping it stops every attacker.
pub struct Attack {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Result<AttackStats>>>,
}

impl Attack {
    pub fn start(spec: &AttackSpec) -> Attack {
        let (stop, rx) = watch::channel(false);
        let spec = Arc::new(spec.clone());
        let mut tasks = Vec::new();
        let start = |i: usize, n: usize| spec.ramp.mul_f64(i as f64 / n.max(1) as f64);
        for i in 0..spec.stalled {
            let hold = spec
                .stall_hold
                .mul_f64(1.0 + 0.5 * i as f64 / spec.stalled as f64);
            tasks.push(tokio::spawn(stalled_reader(
                spec.clone(),
                start(i, spec.stalled),
                hold,
                rx.clone(),
            )));
        }
        for i in 0..spec.slowloris {
            tasks.push(tokio::spawn(slowloris(
                spec.clone(),
                start(i, spec.slowloris),
                rx.clone(),
            )));
        }
        for i in 0..spec.bodies {
            tasks.push(tokio::spawn(big_bodies(
                spec.clone(),
                start(i, spec.bodies),
                rx.clone(),
            )));
        }
        Attack { stop, tasks }
    }

    /// Stops every attacker (each lets go of its connection at once) and adds up what they
    /// did.
    pub async fn stop(mut self) -> Result<AttackStats> {
        let _ = self.stop.send(true);
        let mut total = AttackStats::default();
        for t in std::mem::take(&mut self.tasks) {
            total.merge(t.await.context("an attacker panicked")??);
        }
        Ok(total)
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Returns once the attack is stopped (or its handle is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Sleeps `d`; false when the attack stopped first.
async fn pause(rx: &mut watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = stopped(rx) => false,
        _ = tokio::time::sleep(d) => true,
    }
}

async fn stalled_reader(
    spec: Arc<AttackSpec>,
    delay: Duration,
    hold: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<AttackStats> {
    let mut out = AttackStats::default();
    if !pause(&mut stop, delay).await {
        return Ok(out);
    }
    while !*stop.borrow() {
        let mut s = match stalled_socket(spec.addr, spec.stall_rcvbuf).await {
            Ok(s) => s,
            Err(e) => {
                out.connect_error(&e);
                pause(&mut stop, Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(e) = s.write_all(&spec.stall_request).await {
            out.connect_error(&anyhow::Error::new(e).context("sending the stalled request"));
            pause(&mut stop, Duration::from_millis(50)).await;
            continue;
        }
        out.stalled_sent += 1;
        pause(&mut stop, hold).await;
        // What the proxy answered, peeked so that it stays unread: the status line is at the
        // head of the receive buffer whether or not the proxy has given up since.
        let mut head = [0u8; 32];
        match tokio::time::timeout(Duration::from_millis(10), s.peek(&mut head)).await {
            Ok(Ok(n)) if head[..n].starts_with(b"HTTP/1.1 200") => out.stalled_streaming += 1,
            Ok(Ok(n)) if n > 0 && out.stalled_other.is_none() => {
                let line = String::from_utf8_lossy(&head[..n]);
                out.stalled_other = line.lines().next().map(str::to_string);
            }
            _ => {}
        }
        // Dropped with the answer unread: the kernel resets the connection.
        drop(s);
    }
    Ok(out)
}

/// A connection whose receive buffer is set small before connecting, so that the window it
/// offers stays small.
async fn stalled_socket(addr: SocketAddr, rcvbuf: u32) -> Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .context("creating a socket")?;
    socket
        .set_recv_buffer_size(rcvbuf)
        .context("setting SO_RCVBUF")?;
    socket
        .connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))
}

/// The header a slowloris connection trickles; after it, `a` for ever (one endless header).
const SLOW_HEADER: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\n\
    Content-Type: application/json\r\nX-Slow: ";

async fn slowloris(
    spec: Arc<AttackSpec>,
    delay: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<AttackStats> {
    let mut out = AttackStats::default();
    if !pause(&mut stop, delay).await {
        return Ok(out);
    }
    let mut buf = [0u8; 1024];
    while !*stop.borrow() {
        let mut s = match TcpStream::connect(spec.addr).await {
            Ok(s) => s,
            Err(e) => {
                out.connect_error(&anyhow::Error::new(e).context("slowloris connect"));
                pause(&mut stop, Duration::from_millis(50)).await;
                continue;
            }
        };
        out.slowloris_opened += 1;
        let opened = Instant::now();
        // The first tick is immediate: the first byte goes at once.
        let mut tick = tokio::time::interval(spec.slowloris_every);
        let mut sent = 0usize;
        let cut = loop {
            tokio::select! {
                _ = stopped(&mut stop) => break false,
                r = s.read(&mut buf) => match r {
                    // The proxy's answer (a 408) comes before its close: read on to the close.
                    Ok(n) if n > 0 => {}
                    _ => break true,
                },
                _ = tick.tick() => {
                    let byte = SLOW_HEADER.get(sent).copied().unwrap_or(b'a');
                    sent += 1;
                    if s.write_all(&[byte]).await.is_err() {
                        break true;
                    }
                }
            }
        };
        if cut {
            out.slowloris_cut += 1;
            out.slowloris_lived.push(opened.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

async fn big_bodies(
    spec: Arc<AttackSpec>,
    delay: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<AttackStats> {
    let mut out = AttackStats::default();
    if !pause(&mut stop, delay).await {
        return Ok(out);
    }
    let mut conn = None;
    while !*stop.borrow() {
        tokio::select! {
            _ = stopped(&mut stop) => break,
            r = send_one(&mut conn, &spec.body) => match r {
                Ok(_) => out.bodies_ok += 1,
                Err(e) => {
                    out.bodies_failed += 1;
                    if out.first_body_error.is_none() {
                        out.first_body_error = Some(format!("{e:#}"));
                    }
                    pause(&mut stop, Duration::from_millis(5)).await;
                }
            },
        }
    }
    Ok(out)
}

/// A raw HTTP/1.1 `POST path` of `body` as JSON, for the attackers that write their own bytes.
pub fn raw_post(addr: SocketAddr, path: &str, body: &[u8]) -> Bytes {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    Bytes::from(req)
}
