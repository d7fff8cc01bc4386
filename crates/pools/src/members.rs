//! A pool's backends as they stand now, and the one door through which they change.
//!
//! The set is a snapshot ([`Members`]) behind an `ArcSwap`: choosing a backend loads it
//! without a lock, and an update (a discovery source's answer, a re-resolved host name)
//! builds the next snapshot and swaps it in. What is known about an address (its
//! [`BackendLive`]: health, ejection, learned prefill speed, requests in flight) moves to
//! the next snapshot with it, so an update that keeps an address keeps its state.
//!
//! An address the source no longer lists as ready is *draining*: it takes no new request,
//! and leaves the set once nothing runs on it ([`crate::Pool::sweep`]), so that a pod being
//! removed finishes its streams. One that joins after the pool was built starts slowly: until
//! its first `/metrics` scrape says what it holds, it takes a small share that grows with
//! time, neither flooded as "empty" nor starved.

use crate::health::BackendLive;
use pingora_load_balancing::selection::{BackendSelection, RoundRobin};
use pingora_load_balancing::Backend;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One backend as configured or discovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// As written in the config (`host:port`) or discovered (`ip:port`), for logs and
    /// `/status`.
    pub address: String,
    /// The address `address` resolves to now; attempts connect here.
    pub resolved: SocketAddr,
    /// Its share of the pool's requests under round robin (≥ 1); KV-aware balancing ignores it.
    pub weight: usize,
}

/// The most endpoints a session slot can name (12 bits, 0 meaning none).
pub(crate) const MAX_SLOTS: u16 = (1 << 12) - 1;

/// The most endpoints a pool takes from its source; the rest of a longer list are left out
/// (and counted in [`Change::over_limit`]), so that a runaway source cannot make every choice
/// of a backend slow.
pub const MAX_ENDPOINTS: usize = MAX_SLOTS as usize;

/// How long a joined endpoint without a first scrape is kept to a growing share.
const SLOW_START_WINDOW: Duration = Duration::from_secs(30);

/// Requests a warming endpoint may add per second of its life, beyond the first.
const SLOW_START_GROWTH: f64 = 4.0;

/// Whether an endpoint takes new requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Membership {
    /// Listed as ready by its source: it takes requests.
    Ready,
    /// No longer listed as ready (terminating, not ready, or gone): no new request; it leaves
    /// the set once nothing runs on it.
    Draining,
}

impl Membership {
    /// The state's name in `/status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Membership::Ready => "ready",
            Membership::Draining => "draining",
        }
    }
}

/// One backend of a pool as it stands now.
#[derive(Debug, Clone)]
pub struct Member {
    /// Its address, as configured or discovered.
    pub spec: BackendSpec,
    /// What is known about it live; the same `Arc` for as long as the address stays.
    pub live: Arc<BackendLive>,
    /// Whether it takes new requests.
    pub membership: Membership,
    /// When it joined, for its slow start; `None`: a member since the pool was built.
    pub joined: Option<Instant>,
    /// A stable hash of the address: rendezvous hashing names the endpoint by it, so that a
    /// change of the set moves only the prefixes of the endpoints that came or went, and
    /// every proxy of a fleet agrees on a prefix's home.
    pub(crate) key: u64,
    /// The endpoint's slot in the pool's session table (1..=[`MAX_SLOTS`]; 0: none).
    pub(crate) slot: u16,
}

impl Member {
    /// Whether it takes new requests.
    pub fn is_ready(&self) -> bool {
        self.membership == Membership::Ready
    }

    /// The most requests it may have in flight now while it warms up; `None` once it is
    /// warm (or was a member from the start).
    pub(crate) fn warming_cap(&self) -> Option<u32> {
        let joined = self.joined?;
        if self.live.scraped() {
            return None;
        }
        let age = joined.elapsed();
        (age < SLOW_START_WINDOW).then(|| 1 + (age.as_secs_f64() * SLOW_START_GROWTH) as u32)
    }

    /// Whether it is warming up and has as many requests as its share allows now.
    pub(crate) fn warming_full(&self) -> bool {
        self.warming_cap()
            .is_some_and(|cap| self.live.in_flight() >= cap)
    }

    /// Its state for `/status` and the discovery metrics: ready, draining, unknown (ready,
    /// not yet scraped) or ejected.
    pub fn discovery_state(&self) -> &'static str {
        if !self.is_ready() {
            "draining"
        } else if self.live.is_ejected() {
            "ejected"
        } else if self.warming_cap().is_some() {
            "unknown"
        } else {
            "ready"
        }
    }
}

/// One backend a source lists, and whether it is ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// Its address.
    pub spec: BackendSpec,
    /// Ready for requests; `false`: draining (listed, but terminating or not serving).
    pub ready: bool,
}

impl Wanted {
    /// A discovered backend at `resolved` (named by its address, of weight 1).
    pub fn discovered(resolved: SocketAddr, ready: bool) -> Self {
        Self {
            spec: BackendSpec {
                address: resolved.to_string(),
                resolved,
                weight: 1,
            },
            ready,
        }
    }
}

/// What an update changed, for its log line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Change {
    /// Addresses that joined.
    pub joined: Vec<String>,
    /// Addresses that were ready and now drain.
    pub draining: Vec<String>,
    /// Draining addresses that are ready again.
    pub ready_again: Vec<String>,
    /// Addresses removed at once: draining with nothing running on them.
    pub left: Vec<String>,
    /// Addresses kept whose weight or written address changed.
    pub respecified: Vec<String>,
    /// Listed endpoints left out beyond [`MAX_ENDPOINTS`].
    pub over_limit: usize,
}

impl Change {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.joined.is_empty()
            && self.draining.is_empty()
            && self.ready_again.is_empty()
            && self.left.is_empty()
            && self.respecified.is_empty()
    }
}

/// A pool's backends at one moment.
pub struct Members {
    list: Vec<Member>,
    /// Pingora's weighted round robin over the ready endpoints, and the sum of their
    /// weights (one turn of its cycle).
    round_robin: Arc<RoundRobin>,
    cycle: usize,
    /// Whether some endpoint joined after the pool was built (and may be warming up).
    has_late_joiners: bool,
}

impl Default for Members {
    fn default() -> Self {
        Members::new(Vec::new())
    }
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field("list", &self.list)
            .finish_non_exhaustive()
    }
}

impl Members {
    pub(crate) fn new(list: Vec<Member>) -> Self {
        let ready = list
            .iter()
            .filter(|e| e.is_ready())
            .map(|e| Backend {
                addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(e.spec.resolved),
                weight: e.spec.weight,
                ext: Default::default(),
            })
            .collect();
        let has_late_joiners = list.iter().any(|e| e.joined.is_some());
        let cycle = list
            .iter()
            .filter(|e| e.is_ready())
            .map(|e| e.spec.weight)
            .sum();
        Self {
            list,
            round_robin: Arc::new(RoundRobin::build(&ready)),
            cycle,
            has_late_joiners,
        }
    }

    /// Every endpoint, ready and draining.
    pub fn iter(&self) -> std::slice::Iter<'_, Member> {
        self.list.iter()
    }

    /// The endpoint at `index` of [`Members::iter`].
    pub fn get(&self, index: usize) -> Option<&Member> {
        self.list.get(index)
    }

    /// How many endpoints there are, draining ones included.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// How many endpoints take requests.
    pub fn ready(&self) -> usize {
        self.list.iter().filter(|e| e.is_ready()).count()
    }

    /// The endpoint at `addr`.
    pub fn find(&self, addr: SocketAddr) -> Option<&Member> {
        self.list.iter().find(|e| e.spec.resolved == addr)
    }

    /// The ready endpoints in weighted round-robin order, starting at the cycle's next
    /// position: one turn of the cycle at most.
    pub(crate) fn round_robin(&self) -> impl Iterator<Item = usize> + '_ {
        use pingora_load_balancing::selection::BackendIter;
        let mut turn = self.round_robin.iter(b"");
        std::iter::from_fn(move || turn.next().and_then(|b| b.addr.as_inet().copied()))
            .take(self.cycle)
            .filter_map(|addr| self.list.iter().position(|e| e.spec.resolved == addr))
    }

    pub(crate) fn has_late_joiners(&self) -> bool {
        self.has_late_joiners
    }

    /// The index of the endpoint holding session slot `slot`.
    pub(crate) fn by_slot(&self, slot: u16) -> Option<usize> {
        (slot != 0)
            .then(|| self.list.iter().position(|e| e.slot == slot))
            .flatten()
    }

    /// The next set after a source listed `wanted`: addresses kept keep their state; new
    /// ready ones join (slow start), with the state `fresh` gives for their address; ones no longer listed as ready drain,
    /// and those with nothing running leave at once. A draining address the source lists
    /// again as ready is ready again, with its state.
    pub(crate) fn updated(
        &self,
        wanted: &[Wanted],
        mut fresh: impl FnMut(SocketAddr) -> Arc<BackendLive>,
    ) -> (Members, Change) {
        let mut change = Change {
            over_limit: wanted.len().saturating_sub(MAX_ENDPOINTS),
            ..Change::default()
        };
        let wanted = wanted.get(..MAX_ENDPOINTS).unwrap_or(wanted);
        let mut list: Vec<Member> = Vec::with_capacity(wanted.len().max(self.list.len()));
        let mut taken = std::collections::HashSet::new();
        for w in wanted {
            if !taken.insert(w.spec.resolved) {
                continue; // Listed twice (two slices, say): the first listing counts.
            }
            let membership = if w.ready {
                Membership::Ready
            } else {
                Membership::Draining
            };
            match self.find(w.spec.resolved) {
                Some(old) => {
                    match (old.membership, membership) {
                        (Membership::Ready, Membership::Draining) => {
                            change.draining.push(old.spec.address.clone());
                        }
                        (Membership::Draining, Membership::Ready) => {
                            change.ready_again.push(old.spec.address.clone());
                        }
                        _ => {}
                    }
                    if old.spec != w.spec {
                        change.respecified.push(w.spec.address.clone());
                    }
                    list.push(Member {
                        spec: w.spec.clone(),
                        membership,
                        ..old.clone()
                    });
                }
                // Nothing to drain on an address never used.
                None if !w.ready => {}
                None => {
                    change.joined.push(w.spec.address.clone());
                    list.push(Member {
                        spec: w.spec.clone(),
                        live: fresh(w.spec.resolved),
                        membership,
                        joined: Some(Instant::now()),
                        key: address_key(w.spec.resolved),
                        slot: 0,
                    });
                }
            }
        }
        for old in self
            .list
            .iter()
            .filter(|e| !taken.contains(&e.spec.resolved))
        {
            if old.live.in_flight() == 0 {
                change.left.push(old.spec.address.clone());
                continue;
            }
            if old.is_ready() {
                change.draining.push(old.spec.address.clone());
            }
            list.push(Member {
                membership: Membership::Draining,
                ..old.clone()
            });
        }
        give_slots(&mut list);
        (Members::new(list), change)
    }

    /// The set without its draining endpoints that have nothing running, and their addresses;
    /// `None` when none may leave.
    pub(crate) fn swept(&self) -> Option<(Members, Vec<String>)> {
        let idle = |e: &Member| !e.is_ready() && e.live.in_flight() == 0;
        if !self.list.iter().any(idle) {
            return None;
        }
        let left = self
            .list
            .iter()
            .filter(|e| idle(e))
            .map(|e| e.spec.address.clone())
            .collect();
        let list = self.list.iter().filter(|e| !idle(e)).cloned().collect();
        Some((Members::new(list), left))
    }
}

/// Gives every endpoint without a session slot the lowest free one, while any is free.
pub(crate) fn give_slots(list: &mut [Member]) {
    let mut used: Vec<bool> = vec![false; usize::from(MAX_SLOTS) + 1];
    for e in list.iter() {
        if let Some(u) = used.get_mut(usize::from(e.slot)) {
            *u = true;
        }
    }
    let mut next = 1u16;
    for e in list.iter_mut().filter(|e| e.slot == 0) {
        while next <= MAX_SLOTS && used.get(usize::from(next)).copied().unwrap_or(true) {
            next += 1;
        }
        if next > MAX_SLOTS {
            return; // More endpoints than slots: the rest are balanced without sessions.
        }
        e.slot = next;
        next += 1;
    }
}

/// A stable hash of an address (FNV-1a over its bytes): the same in every proxy.
pub(crate) fn address_key(addr: SocketAddr) -> u64 {
    let mut bytes = Vec::with_capacity(18);
    match addr.ip() {
        std::net::IpAddr::V4(ip) => bytes.extend_from_slice(&ip.octets()),
        std::net::IpAddr::V6(ip) => bytes.extend_from_slice(&ip.octets()),
    }
    bytes.extend_from_slice(&addr.port().to_be_bytes());
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(port: u16, ready: bool) -> Wanted {
        let resolved: SocketAddr = ([127, 0, 0, 1], port).into();
        Wanted {
            spec: BackendSpec {
                address: resolved.to_string(),
                resolved,
                weight: 1,
            },
            ready,
        }
    }

    fn fresh(_: SocketAddr) -> Arc<BackendLive> {
        Arc::new(BackendLive::default())
    }

    #[test]
    fn an_update_keeps_the_state_of_addresses_that_stay() {
        let (one, change) = Members::default().updated(&[wanted(1, true), wanted(2, true)], fresh);
        assert_eq!(change.joined.len(), 2);
        let kept = Arc::clone(&one.list[1].live);
        let (two, change) = one.updated(&[wanted(2, true), wanted(3, true)], fresh);
        assert_eq!(change.joined, vec!["127.0.0.1:3".to_string()]);
        assert_eq!(change.left, vec!["127.0.0.1:1".to_string()]);
        let two_live = &two.find(wanted(2, true).spec.resolved).unwrap().live;
        assert!(Arc::ptr_eq(two_live, &kept));
        assert_eq!(two.len(), 2);
        // Slots stay with their endpoints, and the newcomer takes the freed one.
        let slot_of = |m: &Members, port| m.find(wanted(port, true).spec.resolved).unwrap().slot;
        assert_eq!(slot_of(&two, 2), slot_of(&one, 2));
        assert_ne!(slot_of(&two, 3), slot_of(&two, 2));
    }

    #[test]
    fn a_busy_endpoint_drains_and_leaves_when_its_last_request_ends() {
        let (one, _) = Members::default().updated(&[wanted(1, true), wanted(2, true)], fresh);
        let request = one.list[0].live.begin(10);
        let (two, change) = one.updated(&[wanted(2, true)], fresh);
        assert_eq!(change.draining, vec!["127.0.0.1:1".to_string()]);
        assert!(change.left.is_empty());
        assert_eq!(two.len(), 2);
        assert_eq!(two.ready(), 1);
        assert_eq!(two.round_robin().count(), 1);
        assert!(two.swept().is_none(), "a request still runs there");
        drop(request);
        let (three, left) = two.swept().unwrap();
        assert_eq!(left, vec!["127.0.0.1:1".to_string()]);
        assert_eq!(three.len(), 1);
    }

    #[test]
    fn terminating_endpoints_drain_and_unknown_draining_ones_are_not_added() {
        let (one, _) = Members::default().updated(&[wanted(1, true)], fresh);
        let (two, change) = one.updated(&[wanted(1, false), wanted(2, false)], fresh);
        assert_eq!(change.draining, vec!["127.0.0.1:1".to_string()]);
        assert!(change.joined.is_empty());
        assert_eq!(two.len(), 1);
        assert_eq!(two.ready(), 0);
        let (three, change) = two.updated(&[wanted(1, true)], fresh);
        assert_eq!(change.ready_again, vec!["127.0.0.1:1".to_string()]);
        assert_eq!(three.ready(), 1);
    }

    #[test]
    fn a_joiner_warms_up_until_its_first_scrape() {
        let (members, _) = Members::default().updated(&[wanted(1, true)], fresh);
        let endpoint = &members.list[0];
        assert_eq!(endpoint.warming_cap(), Some(1));
        assert_eq!(endpoint.discovery_state(), "unknown");
        let first = endpoint.live.begin(1);
        assert!(endpoint.warming_full());
        endpoint.live.publish_load(crate::Load {
            kv_usage: Some(0.1),
            running: 0.0,
            waiting: 0.0,
            kv_capacity_tokens: None,
            spec_acceptance: None,
            lora: None,
            computed_prompt_tokens: None,
            engine: None,
            scraped_at: Instant::now(),
        });
        assert_eq!(endpoint.warming_cap(), None);
        assert!(!endpoint.warming_full());
        assert_eq!(endpoint.discovery_state(), "ready");
        drop(first);
    }

    #[test]
    fn a_new_weight_is_a_change() {
        let (one, _) = Members::default().updated(&[wanted(1, true)], fresh);
        let mut heavier = wanted(1, true);
        heavier.spec.weight = 3;
        let (two, change) = one.updated(&[heavier], fresh);
        assert_eq!(change.respecified, vec!["127.0.0.1:1".to_string()]);
        assert!(Arc::ptr_eq(&one.list[0].live, &two.list[0].live));
        assert_eq!(two.round_robin().count(), 3);
    }

    #[test]
    fn address_keys_are_stable_and_distinct() {
        let a: SocketAddr = ([10, 0, 0, 1], 8000).into();
        let b: SocketAddr = ([10, 0, 0, 2], 8000).into();
        assert_eq!(address_key(a), address_key(a));
        assert_ne!(address_key(a), address_key(b));
    }
}
