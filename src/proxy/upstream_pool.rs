//! The LLM path's idle upstream connections, kept without a task each.
//!
//! Pingora's pool (pingora-core 0.9.1, `TransportConnector::release_stream`) spawns a task for
//! every connection it is given back, to watch it while idle (`ConnectionPool::idle_poll` in
//! pingora-pool), and its reuse (`TransportConnector::reused_stream`) wakes that task and waits
//! for it to let the connection go. That is a task made and two hand-offs between tasks per
//! request, often across the runtime's threads: a wake-up through the reactor's eventfd and a
//! context switch each. In front of a fast backend they were most of a request's wake-ups.
//!
//! Here an idle connection is only kept. It is checked when it is taken, as Pingora checks it
//! (one read that must find nothing to read: a connection the backend closed reads its end,
//! one it wrote to unasked is not trusted), and one idle past its timeout is closed instead.
//! A sweep every [`SWEEP_EVERY`] closes the connections that expired or that their backend
//! closed, so that no socket lingers half-closed for long. Written here rather than taken
//! from a crate: the pool Pingora offers is the one whose design costs the hand-offs, and what
//! is needed (a list per peer under a lock held for a push or a pop) is small.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pingora_core::protocols::Stream;
use pingora_core::upstreams::peer::Peer;
use tokio::io::AsyncReadExt;

/// How often the idle connections are looked over.
pub const SWEEP_EVERY: Duration = Duration::from_secs(2);

/// Idle connections to upstreams, by peer (Pingora's reuse hash: address, TLS, SNI and the
/// other settings a connection was made with).
pub struct UpstreamPool {
    idle: Mutex<Idle>,
    /// The most connections kept idle, all peers together.
    max_idle: usize,
    /// Set once the sweep runs (it is started by the first connection kept, inside the
    /// runtime).
    sweeping: std::sync::Once,
}

#[derive(Default)]
struct Idle {
    by_peer: HashMap<u64, Vec<Kept>>,
    count: usize,
}

/// One idle connection.
struct Kept {
    stream: Stream,
    since: Instant,
    timeout: Option<Duration>,
}

impl Kept {
    fn expired(&self, now: Instant) -> bool {
        self.timeout
            .is_some_and(|timeout| now.saturating_duration_since(self.since) >= timeout)
    }
}

impl UpstreamPool {
    /// A pool keeping at most `max_idle` idle connections.
    pub fn new(max_idle: usize) -> Arc<Self> {
        Arc::new(UpstreamPool {
            idle: Mutex::new(Idle::default()),
            max_idle,
            sweeping: std::sync::Once::new(),
        })
    }

    /// An idle connection to `peer` that is still open, the most recently kept first; `None`
    /// when there is none.
    pub fn take(&self, peer: &impl Peer) -> Option<Stream> {
        let key = peer.reuse_hash();
        loop {
            let kept = {
                let mut idle = self.lock();
                let list = idle.by_peer.get_mut(&key)?;
                let kept = list.pop();
                if list.is_empty() {
                    idle.by_peer.remove(&key);
                }
                let kept = kept?;
                idle.count -= 1;
                kept
            };
            // Checked and, when unusable, closed (dropped) outside the lock.
            let expired = kept.expired(Instant::now());
            let mut stream = kept.stream;
            if !expired && still_open(&mut stream) {
                return Some(stream);
            }
        }
    }

    /// Keeps `stream`, a connection to the peer of `key` whose last answer was read whole,
    /// for `timeout` (none: until it is taken, swept as closed, or pushed out). When the pool
    /// is full, room is made with the oldest idle connection of the same peer; a peer with
    /// none takes the oldest of the peer that holds the most, or, when each holds one, is
    /// kept beyond the bound: every backend keeps one idle connection, so the first busy
    /// backends cannot take every place and leave the rest to connect anew for each request.
    pub fn keep(self: &Arc<Self>, key: u64, stream: Stream, timeout: Option<Duration>) {
        self.sweeping.call_once(|| {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(sweep_while_alive(Arc::downgrade(self)));
            }
        });
        let kept = Kept {
            stream,
            since: Instant::now(),
            timeout,
        };
        // A pool of no places keeps nothing (`upstream_keepalive_pool_size: 0`).
        if self.max_idle == 0 {
            return;
        }
        // What leaves the pool is closed (dropped) once the lock is let go.
        let _closed = {
            let mut idle = self.lock();
            let full = idle.count >= self.max_idle;
            let has_own = idle.by_peer.get(&key).is_some_and(|list| !list.is_empty());
            let pushed_out = match (full, has_own) {
                (false, _) => None,
                (true, true) => idle.by_peer.get_mut(&key).map(|list| list.remove(0)),
                // Only when full (rare): the peers are few enough to look over.
                (true, false) => idle
                    .by_peer
                    .values_mut()
                    .filter(|list| list.len() > 1)
                    .max_by_key(|list| list.len())
                    .map(|list| list.remove(0)),
            };
            if pushed_out.is_none() {
                idle.count += 1;
            }
            idle.by_peer.entry(key).or_default().push(kept);
            pushed_out
        };
    }

    /// Closes the idle connections that expired or that their backend closed.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut closed = Vec::new();
        {
            let mut idle = self.lock();
            let mut count = 0;
            idle.by_peer.retain(|_, list| {
                closed.extend(list.extract_if(.., |kept| {
                    kept.expired(now) || !still_open(&mut kept.stream)
                }));
                count += list.len();
                !list.is_empty()
            });
            idle.count = count;
        }
        drop(closed);
    }

    /// How many connections are idle.
    pub fn idle(&self) -> usize {
        self.lock().count
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        // A push or a pop cannot leave the lists half made: a poisoned lock's data is whole.
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether an idle connection can carry a request: nothing to read on it (the read would
/// wait). A read that ends means the backend closed it; data it sent unasked (or an error)
/// makes it untrustworthy. The same check as Pingora's `test_reusable_stream`.
fn still_open(stream: &mut Stream) -> bool {
    let mut byte = [0u8; 1];
    // `unconstrained`: a ready read must not be turned into a wait by Tokio's budget.
    tokio::task::unconstrained(stream.read(&mut byte))
        .now_or_never()
        .is_none()
}

/// Sweeps the pool every [`SWEEP_EVERY`] for as long as it exists.
async fn sweep_while_alive(pool: Weak<UpstreamPool>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        every.tick().await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        pool.sweep();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora_core::upstreams::peer::HttpPeer;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connected pair: the client's end as the pool keeps it, a second descriptor of its
    /// socket to wait on, and the server's end.
    async fn connection(listener: &TcpListener) -> (Stream, TcpStream, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let client = client.into_std().unwrap();
        let watcher = TcpStream::from_std(client.try_clone().unwrap()).unwrap();
        let client = TcpStream::from_std(client).unwrap();
        let stream: Stream = Box::new(pingora_core::protocols::l4::stream::Stream::from(client));
        (stream, watcher, server)
    }

    /// Waits until what the server did (a close, a write) reached the client's socket.
    async fn wait_for_server(watcher: &TcpStream) {
        watcher.readable().await.unwrap();
    }

    /// Asserts that the client's end was closed: the server reads its end. Bounded, so that
    /// a connection left open fails the test instead of hanging it.
    async fn assert_closed(server: &mut TcpStream) {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), server.read_to_end(&mut rest));
        assert_eq!(
            read.await.expect("the connection is still open").unwrap(),
            0
        );
    }

    /// A backend's listener, its address, and a pool of room `max_idle`.
    async fn backend(max_idle: usize) -> (TcpListener, std::net::SocketAddr, Arc<UpstreamPool>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr, UpstreamPool::new(max_idle))
    }

    fn peer(addr: std::net::SocketAddr) -> HttpPeer {
        HttpPeer::new(addr, false, String::new())
    }

    #[tokio::test]
    async fn a_kept_connection_is_given_back_to_its_peer_only() {
        let (listener, addr, pool) = backend(8).await;
        let (stream, _watcher, mut server) = connection(&listener).await;
        pool.keep(
            peer(addr).reuse_hash(),
            stream,
            Some(Duration::from_secs(60)),
        );
        assert_eq!(pool.idle(), 1);

        let elsewhere = peer("127.0.0.1:1".parse().unwrap());
        assert!(pool.take(&elsewhere).is_none());
        let mut taken = pool.take(&peer(addr)).expect("the kept connection");
        assert_eq!(pool.idle(), 0);
        // It is the very connection: what is written on it reaches the server.
        taken.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        assert!(pool.take(&peer(addr)).is_none());
    }

    #[tokio::test]
    async fn a_connection_its_backend_closed_or_wrote_to_is_never_given() {
        let (listener, addr, pool) = backend(8).await;
        let key = peer(addr).reuse_hash();

        let (closed, watcher, server) = connection(&listener).await;
        pool.keep(key, closed, None);
        drop(server);
        wait_for_server(&watcher).await;
        assert!(pool.take(&peer(addr)).is_none());
        assert_eq!(pool.idle(), 0);

        let (chatty, watcher, mut server) = connection(&listener).await;
        pool.keep(key, chatty, None);
        server.write_all(b"unasked").await.unwrap();
        wait_for_server(&watcher).await;
        assert!(pool.take(&peer(addr)).is_none());

        // The open one is found behind a closed one kept after it.
        let (open, _open_watcher, _open_server) = connection(&listener).await;
        pool.keep(key, open, None);
        let (closed, watcher, server) = connection(&listener).await;
        pool.keep(key, closed, None);
        drop(server);
        wait_for_server(&watcher).await;
        assert!(pool.take(&peer(addr)).is_some());
    }

    #[tokio::test]
    async fn an_expired_connection_is_closed_not_given() {
        let (listener, addr, pool) = backend(8).await;
        let (stream, watcher, mut server) = connection(&listener).await;
        drop(watcher);
        pool.keep(peer(addr).reuse_hash(), stream, Some(Duration::ZERO));
        assert!(pool.take(&peer(addr)).is_none());
        assert_closed(&mut server).await;
    }

    #[tokio::test]
    async fn the_sweep_closes_what_expired_or_was_closed_and_keeps_the_rest() {
        let (listener, addr, pool) = backend(8).await;
        let key = peer(addr).reuse_hash();
        let (expired, expired_watcher, mut expired_server) = connection(&listener).await;
        drop(expired_watcher);
        pool.keep(key, expired, Some(Duration::ZERO));
        let (closed, watcher, closed_server) = connection(&listener).await;
        pool.keep(key, closed, None);
        let (open, _w3, _open_server) = connection(&listener).await;
        pool.keep(key, open, Some(Duration::from_secs(60)));
        drop(closed_server);
        wait_for_server(&watcher).await;

        pool.sweep();
        assert_eq!(pool.idle(), 1);
        assert_closed(&mut expired_server).await;
        assert!(pool.take(&peer(addr)).is_some());
    }

    #[tokio::test]
    async fn a_full_pool_makes_room_with_the_oldest_of_the_peer_that_holds_most() {
        let (listener, addr, pool) = backend(2).await;
        let key = peer(addr).reuse_hash();
        let (oldest, oldest_watcher, mut oldest_server) = connection(&listener).await;
        drop(oldest_watcher);
        pool.keep(key, oldest, None);
        let (second, _w2, _s2) = connection(&listener).await;
        pool.keep(key, second, None);
        let (third, _w3, _s3) = connection(&listener).await;
        pool.keep(key, third, None);
        assert_eq!(pool.idle(), 2);
        assert_closed(&mut oldest_server).await;

        // Another peer's connection takes the place of the busiest peer's oldest.
        let other = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let other_peer = peer(other.local_addr().unwrap());
        let (newcomer, _newcomer_watcher, _newcomer_server) = connection(&other).await;
        pool.keep(other_peer.reuse_hash(), newcomer, None);
        assert_eq!(pool.idle(), 2);
        assert!(pool.take(&other_peer).is_some());
        let (newcomer, _w4, _s4) = connection(&other).await;
        pool.keep(other_peer.reuse_hash(), newcomer, None);

        // Each of the two peers holds one: a third peer's connection is kept beyond the
        // bound, one per backend, rather than closed.
        let third_backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let third_peer = peer(third_backend.local_addr().unwrap());
        let (newcomer, _w5, _s5) = connection(&third_backend).await;
        pool.keep(third_peer.reuse_hash(), newcomer, None);
        assert_eq!(pool.idle(), 3);
        for p in [&peer(addr), &other_peer, &third_peer] {
            assert!(pool.take(p).is_some());
        }
    }
}
