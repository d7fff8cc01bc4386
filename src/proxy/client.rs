//! Who the client is, and what it may hold at once.
//!
//! - The client's address: the connection's peer, or, when the peer is one of
//!   `trusted_proxies`, the address that proxy reports in `X-Forwarded-For` (the right-most one
//!   not itself a trusted proxy, so a client cannot plant an address by sending the header).
//! - Requests in flight, per client address and in total (`limits.max_requests_in_flight*`):
//!   over a cap a request is answered at once, 429 for one client and 503 for all, with
//!   `retry-after`. With HTTP/1.1 a connection carries one request at a time, so the
//!   connection caps below HTTP ([`crate::edge`]) bound this too; the request caps matter for
//!   clients behind a trusted proxy, which share its connections.

use crate::caps::{Caps, Slot};
use ipnet::IpNet;
use pingora_error::Error;
use pingora_proxy::Session;
use sluice_sdk::Reason;
use std::net::IpAddr;
use std::sync::Arc;

/// The client's address: the peer's, or the one a trusted proxy forwarded.
pub fn address(session: &Session, trusted: &[IpNet]) -> Option<IpAddr> {
    let peer = session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip())?;
    if !is_trusted(peer, trusted) {
        return Some(peer);
    }
    // Right to left: each trusted proxy appended the address it got the request from.
    let forwarded = session
        .req_header()
        .headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    let mut client = peer;
    for hop in forwarded.iter().rev() {
        let Ok(hop) = hop.parse::<IpAddr>() else {
            break;
        };
        client = hop;
        if !is_trusted(hop, trusted) {
            break;
        }
    }
    Some(client)
}

/// Whether `address` is one of the trusted proxies. An IPv4 peer on a dual-stack listener
/// comes as `::ffff:a.b.c.d`: compared as the IPv4 address it is.
pub fn is_trusted(address: IpAddr, trusted: &[IpNet]) -> bool {
    let address = address.to_canonical();
    trusted.iter().any(|net| net.contains(&address))
}

/// Takes a slot for one more request of `client`; over a cap, the answer.
pub fn admit(requests: &Arc<Caps>, client: Option<IpAddr>) -> Result<Slot, Box<Error>> {
    requests.admit(client).map_err(|over| {
        over.reply(Reason::TooManyRequests, "requests in flight")
            .into_error()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv4_peer_on_a_dual_stack_listener_is_compared_as_ipv4() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert!(is_trusted(mapped, &trusted));
        assert!(!is_trusted("::ffff:192.0.2.1".parse().unwrap(), &trusted));
    }
}
