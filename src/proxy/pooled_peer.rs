//! The upstream peer of an LLM attempt, as its connection pool sees it: Pingora's `HttpPeer`
//! in all but one thing. Pingora checks every connection it takes from the pool against the
//! peer with a `getpeername` call (`Peer::matches_fd`, pingora-core 0.9.1
//! `upstreams/peer.rs`, from `TransportConnector::reused_stream`): one system call per request,
//! which nginx does not make. The pool is keyed by the peer's reuse hash, which already holds
//! its address, TLS settings and SNI, so the check only catches a 64-bit hash collision; it is
//! skipped here. Every other method is `HttpPeer`'s own (the trait's defaults read its options).

use pingora_core::protocols::l4::socket::SocketAddr;
use pingora_core::upstreams::peer::{HttpPeer, Peer, PeerOptions, Proxy, Tracer};
use pingora_core::utils::tls::CertKey;
use std::fmt;
use std::os::unix::prelude::AsRawFd;
use std::sync::Arc;

#[derive(Clone)]
pub struct PooledPeer(pub HttpPeer);

impl fmt::Display for PooledPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Peer for PooledPeer {
    fn address(&self) -> &SocketAddr {
        self.0.address()
    }

    fn tls(&self) -> bool {
        self.0.tls()
    }

    fn sni(&self) -> &str {
        self.0.sni()
    }

    fn reuse_hash(&self) -> u64 {
        self.0.reuse_hash()
    }

    fn get_peer_options(&self) -> Option<&PeerOptions> {
        self.0.get_peer_options()
    }

    fn get_mut_peer_options(&mut self) -> Option<&mut PeerOptions> {
        self.0.get_mut_peer_options()
    }

    fn get_proxy(&self) -> Option<&Proxy> {
        self.0.get_proxy()
    }

    fn matches_fd<V: AsRawFd>(&self, _fd: V) -> bool {
        true
    }

    fn get_client_cert_key(&self) -> Option<&Arc<CertKey>> {
        self.0.get_client_cert_key()
    }

    fn get_tracer(&self) -> Option<Tracer> {
        self.0.get_tracer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wrapper is the peer it wraps for everything the connector reads (the pool's key,
    /// the address, TLS, SNI, options), so connections are pooled and reused as before.
    #[test]
    fn it_is_the_peer_it_wraps_but_for_the_fd_check() {
        let mut inner = HttpPeer::new("127.0.0.1:8000", true, "vllm.internal".to_string());
        inner.options.idle_timeout = Some(std::time::Duration::from_secs(7));
        let pooled = PooledPeer(inner.clone());
        assert_eq!(pooled.reuse_hash(), inner.reuse_hash());
        assert_eq!(pooled.address(), inner.address());
        assert_eq!(pooled.tls(), inner.tls());
        assert_eq!(pooled.sni(), inner.sni());
        assert_eq!(pooled.idle_timeout(), inner.idle_timeout());
        assert_eq!(pooled.to_string(), inner.to_string());
        let other = PooledPeer(HttpPeer::new(
            "127.0.0.1:8001",
            true,
            "vllm.internal".into(),
        ));
        assert_ne!(pooled.reuse_hash(), other.reuse_hash());
    }
}
