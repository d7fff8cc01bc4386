//! Counting what clients hold at once (connections, requests in flight) against a cap per
//! client address and one for everyone, as nginx's `limit_conn` does.
//!
//! One small lock guards both counts, taken once when something starts and once when it ends
//! (never across an await): a hash-map update, far cheaper than what it admits.

use sluice_sdk::{ErrorReply, Reason};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// The counts and their caps.
#[derive(Debug)]
pub struct Caps {
    max_total: usize,
    max_per_client: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// Which cap a refused one is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// The client holds its share: answered 429.
    Client,
    /// Everyone together holds all there are: answered 503.
    Everyone,
}

impl Over {
    /// The answer to one over this cap: 429 for one client, 503 for everyone, both with
    /// `retry-after`. `what` names what is counted ("connections open").
    pub fn reply(self, reason: Reason, what: &str) -> ErrorReply {
        match self {
            Over::Client => ErrorReply::new(
                429,
                reason,
                format!("This client has too many {what}; retry after 1 s."),
            ),
            Over::Everyone => ErrorReply::unavailable(
                reason,
                format!("The proxy has too many {what}; retry after 1 s."),
                1,
            ),
        }
    }
}

impl Caps {
    pub fn new(max_total: usize, max_per_client: usize) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_client,
            held: Mutex::new(Held::default()),
        })
    }

    /// A slot for one more of `client`'s (`None`: a client without an address, counted in
    /// the total only), held until dropped.
    pub fn admit(self: &Arc<Self>, client: Option<IpAddr>) -> Result<Slot, Over> {
        let client = client.map(client_of);
        let mut held = self.held.lock().map_err(|_| Over::Everyone)?;
        if held.total >= self.max_total {
            return Err(Over::Everyone);
        }
        if let Some(ip) = client {
            let count = held.per_client.entry(ip).or_insert(0);
            if *count >= self.max_per_client {
                return Err(Over::Client);
            }
            *count += 1;
        }
        held.total += 1;
        Ok(Slot {
            caps: Arc::clone(self),
            client,
        })
    }

    /// How many are held now.
    pub fn total(&self) -> usize {
        self.held.lock().map_or(0, |held| held.total)
    }

    fn release(&self, client: Option<IpAddr>) {
        let Ok(mut held) = self.held.lock() else {
            return;
        };
        held.total = held.total.saturating_sub(1);
        if let Some(ip) = client {
            if let Some(count) = held.per_client.get_mut(&ip) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    held.per_client.remove(&ip);
                }
            }
        }
    }
}

/// Who a client address counts as: an IPv6 address as its /64 (one host is given a whole
/// /64 and may use any address in it, so per address it would have 2^64 caps), an
/// IPv4-mapped one as its IPv4 address.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(prefix.into())
        }
        v4 => v4,
    }
}

/// One connection's or request's place under the caps.
#[derive(Debug)]
pub struct Slot {
    caps: Arc<Caps>,
    client: Option<IpAddr>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.caps.release(self.client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_per_client_and_in_total_and_come_back() {
        let caps = Caps::new(3, 2);
        let a = Some(IpAddr::from([10, 0, 0, 1]));
        let b = Some(IpAddr::from([10, 0, 0, 2]));
        let first = caps.admit(a).unwrap();
        let _second = caps.admit(a).unwrap();
        assert_eq!(caps.admit(a).err(), Some(Over::Client));
        let _third = caps.admit(b).unwrap();
        assert_eq!(caps.admit(b).err(), Some(Over::Everyone));
        assert_eq!(caps.total(), 3);
        drop(first);
        assert!(caps.admit(a).is_ok(), "an ended one frees its slot");
        assert_eq!(caps.total(), 2, "the one just admitted was dropped at once");
    }

    /// N9: one IPv6 host has a /64 to pick addresses from; it is one client.
    #[test]
    fn an_ipv6_slash_64_is_one_client() {
        let caps = Caps::new(100, 2);
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let _a = caps.admit(ip("2001:db8:1:2::1")).unwrap();
        let _b = caps.admit(ip("2001:db8:1:2:ffff::9")).unwrap();
        assert_eq!(
            caps.admit(ip("2001:db8:1:2:dead:beef:0:1")).err(),
            Some(Over::Client)
        );
        assert!(caps.admit(ip("2001:db8:1:3::1")).is_ok(), "another /64");
        let _c = caps.admit(ip("::ffff:10.0.0.1")).unwrap();
        let _d = caps.admit(ip("10.0.0.1")).unwrap();
        assert_eq!(
            caps.admit(ip("10.0.0.1")).err(),
            Some(Over::Client),
            "v4-mapped is v4"
        );
    }
}
