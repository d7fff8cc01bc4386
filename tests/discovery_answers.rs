//! Property tests of what discovery does with the answers of its peers: a Kubernetes API
//! server's EndpointSlices (any addresses, conditions and ports, well formed or not), and any
//! sequence of answers a source gives a pool (duplicates, readiness flipping, requests still
//! running on backends that go).
//!
//! Bounded for CI by `PROPTEST_CASES` (default 256 cases a property; the cap's property runs a
//! few, each large); a failing case is kept in `tests/discovery_answers.proptest-regressions`
//! and tried first on every later run.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use proptest::prelude::*;
use sluice::discovery::apply;
use sluice::discovery::kubernetes::{wanted, KubernetesSource, PortRef};
use sluice_sdk::health::InFlight;
use sluice_sdk::members::MAX_ENDPOINTS;
use sluice_sdk::{BackendSpec, Membership, Pool, PoolSettings, Wanted};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

fn empty_pool() -> Pool {
    Pool::new(PoolSettings::new("fleet", vec![], vec![]))
}

// --- EndpointSlices -------------------------------------------------------------------------

/// The port names slices and sources use: few, so that a name is often found.
const PORT_NAMES: [&str; 4] = ["http", "metrics", "grpc", ""];

/// An address as an API server (or a broken one) may write it.
fn address() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<Ipv4Addr>().prop_map(|ip| ip.to_string()),
        2 => any::<Ipv6Addr>().prop_map(|ip| ip.to_string()),
        // Host names (an FQDN slice), an address with a port, a bracketed IPv6, a zone.
        1 => "[a-z][a-z0-9-]{0,12}(\\.[a-z0-9-]{1,8}){0,3}",
        1 => any::<(Ipv4Addr, u16)>().prop_map(|(ip, p)| format!("{ip}:{p}")),
        1 => any::<Ipv6Addr>().prop_map(|ip| format!("[{ip}]")),
        1 => any::<Ipv6Addr>().prop_map(|ip| format!("{ip}%eth0")),
        1 => "[0-9.:a-fA-F]{0,20}",
        1 => "\\PC{0,24}",
    ]
}

fn conditions() -> impl Strategy<Value = Option<EndpointConditions>> {
    proptest::option::weighted(
        0.8,
        (
            any::<Option<bool>>(),
            any::<Option<bool>>(),
            any::<Option<bool>>(),
        )
            .prop_map(|(ready, serving, terminating)| EndpointConditions {
                ready,
                serving,
                terminating,
            }),
    )
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    (proptest::collection::vec(address(), 0..4), conditions()).prop_map(
        |(addresses, conditions)| Endpoint {
            addresses,
            conditions,
            ..Endpoint::default()
        },
    )
}

/// A port number as a slice may carry it: in range, negative, past 65535.
fn port_number() -> impl Strategy<Value = Option<i32>> {
    proptest::option::weighted(
        0.9,
        prop_oneof![
            3 => 0..=65535i32,
            1 => i32::MIN..0,
            1 => 65536..=i32::MAX,
            1 => -3..3i32,
            1 => 65533..65539i32,
        ],
    )
}

fn port_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(&PORT_NAMES[..]).prop_map(String::from),
        1 => "[a-z]{1,6}",
    ]
}

fn endpoint_port() -> impl Strategy<Value = EndpointPort> {
    (proptest::option::weighted(0.9, port_name()), port_number()).prop_map(|(name, port)| {
        EndpointPort {
            name,
            port,
            ..EndpointPort::default()
        }
    })
}

fn slice() -> impl Strategy<Value = EndpointSlice> {
    (
        proptest::collection::vec(endpoint(), 0..8),
        proptest::option::weighted(0.9, proptest::collection::vec(endpoint_port(), 0..4)),
    )
        .prop_map(|(endpoints, ports)| EndpointSlice {
            address_type: "IPv4".into(),
            endpoints,
            ports,
            ..EndpointSlice::default()
        })
}

fn port_ref() -> impl Strategy<Value = PortRef> {
    prop_oneof![
        1 => any::<u16>().prop_map(PortRef::Number),
        3 => port_name().prop_map(PortRef::Name),
    ]
}

fn source(port: PortRef) -> KubernetesSource {
    KubernetesSource {
        service: "vllm".into(),
        namespace: None,
        port,
        kubeconfig: None,
        debounce: Duration::from_millis(10),
    }
}

/// The port `port` means in `slice`: a number as is; a name, the number of the first port of
/// the slice with that name, when it is one (1..=65535: 0 is no port to connect to).
fn chosen_port(port: &PortRef, slice: &EndpointSlice) -> Option<u16> {
    match port {
        PortRef::Number(n) => Some(*n),
        PortRef::Name(name) => {
            let named = slice
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))?;
            u16::try_from(named.port?).ok().filter(|p| *p != 0)
        }
    }
}

proptest! {
    #[test]
    fn an_endpoint_slice_lists_its_ip_addresses_at_the_chosen_port_ready_unless_terminating(
        slice in slice(),
        port in port_ref(),
    ) {
        let pool = empty_pool();
        let listed = wanted(&pool, &source(port.clone()), &slice);

        let Some(chosen) = chosen_port(&port, &slice) else {
            // A named port the slice does not have, or has without a number that is a port.
            prop_assert!(listed.is_empty(), "no port {port}, yet listed {listed:?}");
            return Ok(());
        };

        // Every listed backend is one of the slice's IP literals, at the chosen port, with the
        // readiness the API gives it; in the slice's order, none left out.
        let mut expected = Vec::new();
        for endpoint in &slice.endpoints {
            let c = endpoint.conditions.as_ref();
            let terminating = c.and_then(|c| c.terminating);
            let ready = c.and_then(|c| c.ready);
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    expected.push((SocketAddr::new(ip, chosen), ready, terminating));
                }
            }
        }
        prop_assert_eq!(listed.len(), expected.len(), "listed {:?}", listed);
        for (w, (resolved, ready, terminating)) in listed.iter().zip(&expected) {
            prop_assert_eq!(w.spec.resolved, *resolved);
            prop_assert_eq!(w.spec.resolved.port(), chosen);
            prop_assert_eq!(w.spec.address.parse::<SocketAddr>().ok(), Some(*resolved));
            prop_assert_eq!(w.spec.weight, 1);
            if *terminating == Some(true) {
                prop_assert!(!w.ready, "a terminating endpoint is ready: {:?}", w);
            } else if *ready == Some(false) {
                prop_assert!(!w.ready, "an endpoint not ready is ready: {:?}", w);
            } else {
                // `ready` true or unset (unset means ready), not terminating.
                prop_assert!(w.ready, "a ready endpoint drains: {:?} ({:?})", w, ready);
            }
        }
    }
}

// --- Membership under a sequence of answers -------------------------------------------------

/// The addresses the answers draw from: few, so that answers overlap and repeat themselves.
const ADDRESSES: usize = 48;

fn address_at(i: usize) -> SocketAddr {
    if i % 6 == 5 {
        SocketAddr::new(
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i as u16)),
            8000,
        )
    } else {
        SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, (i / 2) as u8)),
            8000 + (i % 2) as u16,
        )
    }
}

fn listing(resolved: SocketAddr, weight: usize, ready: bool) -> Wanted {
    Wanted {
        spec: BackendSpec {
            address: resolved.to_string(),
            resolved,
            weight,
        },
        ready,
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// A source's answer: (address, weight, ready), duplicates and all.
    Answer(Vec<(usize, usize, bool)>),
    /// A request begins on the member at this address, if there is one.
    Begin(usize),
    /// The request held at this position (modulo how many are held) ends.
    End(usize),
    /// The tick that removes drained backends.
    Sweep,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => proptest::collection::vec((0..ADDRESSES, 1..=3usize, proptest::bool::weighted(0.7)), 0..300)
            .prop_map(Step::Answer),
        2 => (0..ADDRESSES).prop_map(Step::Begin),
        1 => any::<usize>().prop_map(Step::End),
        1 => Just(Step::Sweep),
    ]
}

/// What the pool should hold of an address.
#[derive(Debug, Clone, PartialEq)]
struct Expected {
    spec: BackendSpec,
    membership: Membership,
}

/// The pool's members by address; fails on an address listed twice.
fn members_of(pool: &Pool) -> Result<BTreeMap<SocketAddr, Expected>, TestCaseError> {
    let mut out = BTreeMap::new();
    for m in pool.members().iter() {
        let again = out.insert(
            m.spec.resolved,
            Expected {
                spec: m.spec.clone(),
                membership: m.membership,
            },
        );
        prop_assert!(again.is_none(), "{} is a member twice", m.spec.resolved);
    }
    Ok(out)
}

/// The next members after `answer`, from the documented rules (`sluice_sdk::members`): the
/// first `MAX_ENDPOINTS` listings count, the first listing of an address wins; a listed
/// address is ready or draining as listed, but one never a member that is listed draining
/// is not added; a member no longer listed drains while requests run on it and leaves at once
/// otherwise. Also: the addresses that join and leave.
fn expected_after(
    before: &BTreeMap<SocketAddr, Expected>,
    answer: &[Wanted],
    busy: &dyn Fn(SocketAddr) -> bool,
) -> (
    BTreeMap<SocketAddr, Expected>,
    BTreeSet<SocketAddr>,
    BTreeSet<SocketAddr>,
) {
    let counted = &answer[..answer.len().min(MAX_ENDPOINTS)];
    let mut next = BTreeMap::new();
    for w in counted {
        if next.contains_key(&w.spec.resolved) {
            continue;
        }
        if !w.ready && !before.contains_key(&w.spec.resolved) {
            // Listed twice, draining first then ready: the first listing counts, still.
            next.insert(w.spec.resolved, None);
            continue;
        }
        let membership = if w.ready {
            Membership::Ready
        } else {
            Membership::Draining
        };
        next.insert(
            w.spec.resolved,
            Some(Expected {
                spec: w.spec.clone(),
                membership,
            }),
        );
    }
    let mut next: BTreeMap<SocketAddr, Expected> = next
        .into_iter()
        .filter_map(|(a, e)| e.map(|e| (a, e)))
        .collect();
    let listed: HashSet<SocketAddr> = counted.iter().map(|w| w.spec.resolved).collect();
    let mut left = BTreeSet::new();
    for (addr, old) in before {
        if listed.contains(addr) {
            continue;
        }
        if busy(*addr) {
            next.insert(
                *addr,
                Expected {
                    spec: old.spec.clone(),
                    membership: Membership::Draining,
                },
            );
        } else {
            left.insert(*addr);
        }
    }
    let joined = next
        .keys()
        .filter(|a| !before.contains_key(a))
        .copied()
        .collect();
    (next, joined, left)
}

/// Applies `answer` to `pool` and checks the members and the change against the rules.
fn check_answer(
    pool: &Pool,
    answer: &[Wanted],
    held: &[(SocketAddr, InFlight)],
) -> Result<(), TestCaseError> {
    let before = members_of(pool)?;
    let lives: BTreeMap<SocketAddr, _> = pool
        .members()
        .iter()
        .map(|m| (m.spec.resolved, Arc::clone(&m.live)))
        .collect();
    let busy = |addr: SocketAddr| held.iter().any(|(a, _)| *a == addr);
    let (expected, joined, left) = expected_after(&before, answer, &busy);

    let change = apply(pool, "test", answer);
    let after = members_of(pool)?;
    prop_assert_eq!(&after, &expected);
    prop_assert_eq!(
        change.joined.iter().cloned().collect::<BTreeSet<_>>(),
        joined
            .iter()
            .map(|a| a.to_string())
            .collect::<BTreeSet<_>>()
    );
    prop_assert_eq!(
        change.left.iter().cloned().collect::<BTreeSet<_>>(),
        left.iter().map(|a| a.to_string()).collect::<BTreeSet<_>>()
    );
    prop_assert_eq!(
        change.over_limit,
        answer.len().saturating_sub(MAX_ENDPOINTS)
    );

    // With nothing running, the members are exactly the answer's distinct addresses (those
    // never members and listed draining aside); the ready ones, always, those listed ready.
    let counted = &answer[..answer.len().min(MAX_ENDPOINTS)];
    let mut first = BTreeMap::new();
    for w in counted {
        first.entry(w.spec.resolved).or_insert(w.ready);
    }
    let ready: BTreeSet<SocketAddr> = after
        .iter()
        .filter(|(_, e)| e.membership == Membership::Ready)
        .map(|(a, _)| *a)
        .collect();
    let listed_ready: BTreeSet<SocketAddr> =
        first.iter().filter(|(_, r)| **r).map(|(a, _)| *a).collect();
    prop_assert_eq!(&ready, &listed_ready);
    prop_assert_eq!(pool.members().ready(), listed_ready.len());
    if held.is_empty() {
        let members: BTreeSet<SocketAddr> = after.keys().copied().collect();
        let distinct: BTreeSet<SocketAddr> = first
            .iter()
            .filter(|(a, r)| **r || before.contains_key(a))
            .map(|(a, _)| *a)
            .collect();
        prop_assert_eq!(members, distinct);
    }

    // An address that stays keeps what is known about it.
    for m in pool.members().iter() {
        if let Some(old) = lives.get(&m.spec.resolved) {
            prop_assert!(
                Arc::ptr_eq(old, &m.live),
                "{} lost its state",
                m.spec.resolved
            );
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn after_any_sequence_of_answers_the_members_are_the_last_answers_addresses(
        steps in proptest::collection::vec(step(), 1..10),
    ) {
        let pool = empty_pool();
        let mut held: Vec<(SocketAddr, InFlight)> = Vec::new();
        for step in steps {
            match step {
                Step::Answer(entries) => {
                    let answer: Vec<Wanted> = entries
                        .iter()
                        .map(|(i, weight, ready)| listing(address_at(*i), *weight, *ready))
                        .collect();
                    check_answer(&pool, &answer, &held)?;
                }
                Step::Begin(i) => {
                    let addr = address_at(i);
                    let live = pool.members().find(addr).map(|m| Arc::clone(&m.live));
                    if let Some(live) = live {
                        held.push((addr, live.begin(1)));
                    }
                }
                Step::End(k) => {
                    if !held.is_empty() {
                        let k = k % held.len();
                        drop(held.swap_remove(k));
                    }
                }
                Step::Sweep => {
                    let before = members_of(&pool)?;
                    let left: BTreeSet<String> = pool.sweep().into_iter().collect();
                    let after = members_of(&pool)?;
                    // Draining members with nothing running leave; every other stays as it was.
                    let mut expected = before.clone();
                    expected.retain(|a, e| {
                        e.membership == Membership::Ready || held.iter().any(|(h, _)| h == a)
                    });
                    let gone: BTreeSet<String> = before
                        .keys()
                        .filter(|a| !expected.contains_key(a))
                        .map(|a| a.to_string())
                        .collect();
                    prop_assert_eq!(&after, &expected);
                    prop_assert_eq!(left, gone);
                }
            }
        }
    }
}

proptest! {
    // Each case builds pools of thousands of endpoints: a few cases cover the cap.
    #![proptest_config(ProptestConfig::with_cases(4))]

    #[test]
    fn an_answer_past_the_cap_is_cut_to_its_first_listings(
        over in 0..64usize,
        not_ready in proptest::collection::btree_set(0..MAX_ENDPOINTS + 64, 0..32),
        duplicates in proptest::collection::vec(0..MAX_ENDPOINTS + 64, 0..32),
        shift in 0..128usize,
    ) {
        let at = |i: usize| {
            SocketAddr::new(
                IpAddr::V4(Ipv4Addr::new(10, (i >> 8) as u8, (i & 0xff) as u8, 1)),
                8000,
            )
        };
        let pool = empty_pool();
        let mut held = Vec::new();
        let mut first: Vec<Wanted> = (0..MAX_ENDPOINTS + over)
            .map(|i| listing(at(i), 1, !not_ready.contains(&i)))
            .collect();
        // Repeats, some of them within the cap (they take a place in it).
        for (k, i) in duplicates.iter().enumerate() {
            let at_pos = (k * 131) % first.len();
            first.insert(at_pos, listing(at(*i), 2, true));
        }
        check_answer(&pool, &first, &held)?;
        prop_assert!(pool.members().len() <= MAX_ENDPOINTS);

        // A request runs on one member; the next answer moves the window.
        if let Some(m) = pool.members().get(0) {
            held.push((m.spec.resolved, m.live.begin(1)));
        }
        let second: Vec<Wanted> = (shift..shift + MAX_ENDPOINTS + over)
            .map(|i| listing(at(i), 1, true))
            .collect();
        check_answer(&pool, &second, &held)?;
        held.clear();
        check_answer(&pool, &[], &held)?;
        prop_assert!(pool.members().is_empty());
    }
}
