//! A pool's flow control: the one queue where its requests wait when the pool cannot take
//! them now, and the order they leave it in.
//!
//! A request waits here for one of two things: KV-cache headroom (the breaker's admission,
//! bounded by its class's `max_wait`, then refused), or an engine that would not queue it
//! (every backend has a prefill queue of its own, [`Pool::engines_queue`]): a request held
//! here can still be put behind a more deserving one, one queued inside vLLM cannot. The
//! second wait is bounded too ([`Fairness::max_hold`]), and ends with the request sent: the
//! engine's queue takes it, as it would without flow control.
//!
//! The order: the highest class first (bands are strict), then, with fairness on, the waiter
//! whose flow has had the least service, at two levels: first the least served tenant (the
//! client's address when there are no tenants), then inside it the least served session (a
//! request without one is its tenant's own flow). So a client that names a new session for
//! each request gains nothing over the other tenants. Service is the tokens a flow had
//! prefilled, plus its output tokens at [`Fairness::output_weight`] (as the Virtual Token
//! Counter of Sheng et al., OSDI 2024), decaying with [`Fairness::half_life`]. The order is
//! the flows' service when the next is let in, and a request's prefill is counted as its
//! attempt starts, before the next one is let in: so one flow's burst goes one at a time,
//! each behind the flows that have had less by then. Among flows of equal service, the
//! earliest TTFT deadline goes first, then the smaller prompt (new flows all have none:
//! a short chat's first turn does not wait behind a burst of new agents' 16k-token openings),
//! then the first come. Without fairness: class, then first come.
//!
//! Written here rather than with a semaphore or a priority channel: what frees up is KV
//! headroom or an engine's queue, which only the pool's live state can tell, and the order
//! changes as flows are served.

use super::{Pool, Priority};
use std::cmp::Reverse;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

/// How often the first waiter asks its pool again. Capacity frees up when a request gets
/// its first token or ends (the pool sees it at once) or when a scrape comes.
pub const POLL: Duration = Duration::from_millis(5);
/// How often a waiter behind the first asks (a smaller request may fit where the first
/// does not).
pub const POLL_BEHIND: Duration = Duration::from_millis(25);

/// The most flows a pool keeps the service of; beyond it, the least served are forgotten (a
/// forgotten flow comes back with none, which is where it nearly was).
const MAX_FLOWS: usize = 65_536;

/// Service is kept multiplied by 2^(t / half-life) so that decay needs no update of every
/// flow; after this many half-lives everything is scaled back down (f64 holds 2^1023).
const REBASE_AFTER_HALF_LIVES: f64 = 256.0;

/// Fair order inside a priority class (`pools[].fairness`, on by default).
#[derive(Debug, Clone, PartialEq)]
pub struct Fairness {
    /// A flow's service halves in this long.
    pub half_life: Duration,
    /// What one output token counts against a flow, in prompt tokens prefilled.
    pub output_weight: f64,
    /// A backend queues when this many prompt tokens of prefill wait there (about one
    /// engine step's `max_num_batched_tokens`): enough to keep it busy until the next is let
    /// in, while the rest wait here in fair order.
    pub hold_above_tokens: u64,
    /// The longest a request is held for an engine that queues; then it is sent.
    pub max_hold: Duration,
    /// The most requests held for engines at once; the rest are sent at once.
    pub max_held: usize,
    /// Where a request names its session: the pool's `session_keys`, else the agents' own.
    pub session_keys: Vec<super::SessionKey>,
}

impl Default for Fairness {
    fn default() -> Self {
        Self {
            half_life: Duration::from_secs(60),
            output_weight: 2.0,
            hold_above_tokens: 8192,
            max_hold: Duration::from_secs(60),
            max_held: 1024,
            session_keys: Vec::new(),
        }
    }
}

/// Who a request is served for: its tenant (or its client's address) and, inside it, its
/// session. Made once per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowId {
    outer: u64,
    leaf: u64,
    label: Arc<str>,
}

impl FlowId {
    /// The flow of a request of `tenant` (else from `client`), in session `session` (its id
    /// as the request names it) when it names one.
    pub fn new(
        tenant: Option<&str>,
        client: Option<std::net::IpAddr>,
        session: Option<&[u8]>,
    ) -> Self {
        static KEY: LazyLock<std::collections::hash_map::RandomState> =
            LazyLock::new(std::collections::hash_map::RandomState::new);
        let (outer, outer_label) = match (tenant, client) {
            (Some(tenant), _) => (KEY.hash_one(("tenant", tenant)), format!("tenant {tenant}")),
            (None, Some(ip)) => (KEY.hash_one(("client", ip)), format!("client {ip}")),
            (None, None) => (KEY.hash_one("anonymous"), "anonymous".to_string()),
        };
        let (leaf, label) = match session {
            // A session is named by a hash: its id is the client's text.
            Some(id) => {
                let leaf = KEY.hash_one(("session", outer, id));
                (leaf, format!("{outer_label} session {:08x}", leaf as u32))
            }
            None => (KEY.hash_one(("own", outer)), outer_label),
        };
        Self {
            outer,
            leaf,
            label: label.into(),
        }
    }

    /// How the flow is shown in `/status`: its tenant or client, and its session's hash.
    pub fn label(&self) -> &str {
        &self.label
    }
}

/// Which wait a place is for: each has its own bound on how many wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitFor {
    /// KV-cache headroom (the breaker's admission).
    Headroom,
    /// An engine that does not queue.
    Engine,
}

/// A non-negative `f64` as a key that orders as the number does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Tag(u64);

impl Tag {
    fn of(value: f64) -> Self {
        Tag(value.max(0.0).to_bits())
    }
}

/// A waiter's place in the order now (see the module's header): computed when the first
/// is looked for, since a flow's service changes while its requests wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    band: Reverse<Priority>,
    outer: Tag,
    leaf: Tag,
    /// ms after the control was made; `u64::MAX` for none.
    deadline_ms: u64,
    /// The request's prompt, estimated tokens: among equals, the smaller goes first.
    size: u64,
    seq: u64,
}

/// What a flow has had.
#[derive(Debug)]
struct FlowEntry {
    /// Service × 2^(t / half-life) (see [`REBASE_AFTER_HALF_LIVES`]): every flow decays
    /// at the same rate, so the scaled amounts compare as the decayed ones do.
    served: f64,
    /// A session or a tenant's own requests (not a tenant's sum): counted in Jain's index.
    leaf: bool,
    label: Arc<str>,
}

struct Waiter {
    turn: Arc<Notify>,
    priority: Priority,
    /// Its flow's entries (tenant, leaf), with fairness on.
    flow: Option<(u64, u64)>,
    deadline_ms: u64,
    size: u64,
    kind: WaitFor,
    /// The backend it must go to (its session's), if any; else any with room.
    target: Option<std::net::SocketAddr>,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    waiters: HashMap<u64, Waiter>,
    /// The first waiter of each [`WaitFor`], while nothing changed the order (`None`: look
    /// again).
    firsts: Option<[Option<u64>; 2]>,
    flows: HashMap<u64, FlowEntry>,
    /// Seconds after `born` that the scale is 1 at.
    base_s: f64,
    counts: [usize; 2],
}

impl State {
    fn entry(&mut self, key: u64, leaf: bool, label: &Arc<str>) -> &mut FlowEntry {
        self.flows.entry(key).or_insert_with(|| FlowEntry {
            served: 0.0,
            leaf,
            label: Arc::clone(label),
        })
    }

    fn served(&self, key: u64) -> f64 {
        self.flows.get(&key).map_or(0.0, |e| e.served)
    }

    /// A waiter's place in the order now.
    fn key(&self, seq: u64, w: &Waiter) -> Key {
        let (outer, leaf) = w
            .flow
            .map_or((0.0, 0.0), |(o, l)| (self.served(o), self.served(l)));
        Key {
            band: Reverse(w.priority),
            outer: Tag::of(outer),
            leaf: Tag::of(leaf),
            deadline_ms: w.deadline_ms,
            size: w.size,
            seq,
        }
    }

    /// The first of the waiters for an engine that may go now: its backend is one with room,
    /// or it has none (or its backend is no longer usable) and some backend has room. A waiter
    /// whose session's backend queues does not hold back the others while another has room.
    fn first_with_room(&self, room: &Room) -> Option<u64> {
        self.waiters
            .iter()
            .filter(|(_, w)| w.kind == WaitFor::Engine)
            .filter(
                |(_, w)| match w.target.filter(|t| room.usable.contains(t)) {
                    Some(target) => room.open.contains(&target),
                    None => !room.open.is_empty(),
                },
            )
            .map(|(seq, w)| self.key(*seq, w))
            .min()
            .map(|k| k.seq)
    }

    /// The first waiter of each kind: looked for again only after a change (a waiter came
    /// or left, a flow was served).
    fn firsts(&mut self) -> [Option<u64>; 2] {
        if let Some(firsts) = self.firsts {
            return firsts;
        }
        let mut best: [Option<Key>; 2] = [None, None];
        for (seq, w) in &self.waiters {
            let key = self.key(*seq, w);
            let slot = &mut best[w.kind as usize];
            if slot.is_none_or(|b| key < b) {
                *slot = Some(key);
            }
        }
        let firsts = best.map(|k| k.map(|k| k.seq));
        self.firsts = Some(firsts);
        firsts
    }

    /// The first waiter of `kind`.
    fn first(&mut self, kind: WaitFor) -> Option<u64> {
        self.firsts()[kind as usize]
    }
}

/// One pool's waiting requests and its flows' service.
pub struct FlowControl {
    fairness: Option<Fairness>,
    born: Instant,
    /// 1 while a waiter that was let in has not started its attempt (see
    /// [`Place::wait_for`]).
    letting_in: AtomicUsize,
    depth: [AtomicUsize; 3],
    /// Requests held for an engine: read without the lock on every request.
    held: AtomicUsize,
    state: Mutex<State>,
}

impl std::fmt::Debug for FlowControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowControl")
            .field("fairness", &self.fairness)
            .finish_non_exhaustive()
    }
}

impl FlowControl {
    /// A pool's flow control; `fairness` `None` is first come, first served in each class.
    pub fn new(fairness: Option<Fairness>) -> Self {
        Self {
            fairness,
            born: Instant::now(),
            letting_in: AtomicUsize::new(0),
            depth: Default::default(),
            held: AtomicUsize::new(0),
            state: Mutex::new(State::default()),
        }
    }

    /// The fairness it orders by, if on.
    pub fn fairness(&self) -> Option<&Fairness> {
        self.fairness.as_ref()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding it; a poisoned state is still a consistent one.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The scale of service now (see [`FlowEntry::served`]); rebases first when due.
    fn scale(&self, state: &mut State) -> f64 {
        let Some(fairness) = &self.fairness else {
            return 1.0;
        };
        let now_s = self.born.elapsed().as_secs_f64();
        let half_life = fairness.half_life.as_secs_f64().max(1e-3);
        let exponent = (now_s - state.base_s) / half_life;
        if exponent <= REBASE_AFTER_HALF_LIVES {
            return exponent.exp2();
        }
        let factor = exponent.exp2();
        for entry in state.flows.values_mut() {
            entry.served /= factor;
        }
        state.base_s = now_s;
        1.0
    }

    /// A place for a request of `priority` and `flow`, due to have its first token by
    /// `deadline`, with a prompt of `size` (estimated tokens); `None` when `limit` places of
    /// its kind are taken.
    pub fn join(
        self: &Arc<Self>,
        kind: WaitFor,
        priority: Priority,
        flow: Option<&FlowId>,
        deadline: Option<std::time::Instant>,
        size: u64,
        limit: usize,
    ) -> Option<Place> {
        let mut state = self.lock();
        let count = &mut state.counts[kind as usize];
        if *count >= limit {
            return None;
        }
        *count += 1;
        if kind == WaitFor::Engine {
            self.held.fetch_add(1, Relaxed);
        }
        let seq = state.next_seq;
        state.next_seq += 1;
        let flow = flow.filter(|_| self.fairness.is_some()).map(|flow| {
            state.entry(flow.outer, false, &flow.label);
            state.entry(flow.leaf, true, &flow.label);
            (flow.outer, flow.leaf)
        });
        let deadline_ms = deadline.map_or(u64::MAX, |d| {
            let at = Instant::from_std(d);
            u64::try_from(at.saturating_duration_since(self.born).as_millis()).unwrap_or(u64::MAX)
        });
        let turn = Arc::new(Notify::new());
        state.waiters.insert(
            seq,
            Waiter {
                turn: Arc::clone(&turn),
                priority,
                flow,
                deadline_ms,
                size,
                kind,
                target: None,
            },
        );
        state.firsts = None;
        drop(state);
        self.depth[priority as usize].fetch_add(1, Relaxed);
        Some(Place {
            control: Arc::clone(self),
            seq,
            kind,
            priority,
            turn,
            admitted: false,
        })
    }

    /// Counts `tokens` of service (prompt tokens prefilled, or output at its weight: see
    /// [`FlowControl::charge_output`]) to `flow`. Charged when a request's attempt starts,
    /// before the next waiter is let in, so that a flow's burst queues behind its own.
    pub fn charge(&self, flow: &FlowId, tokens: u64) {
        if self.fairness.is_none() || tokens == 0 {
            return;
        }
        let mut state = self.lock();
        let scaled = tokens as f64 * self.scale(&mut state);
        state.entry(flow.outer, false, &flow.label).served += scaled;
        state.entry(flow.leaf, true, &flow.label).served += scaled;
        if state.flows.len() > MAX_FLOWS {
            forget_least_served(&mut state);
        }
        if !state.waiters.is_empty() {
            state.firsts = None;
        }
    }

    /// Counts `tokens` generated for `flow`, at the output weight.
    pub fn charge_output(&self, flow: &FlowId, tokens: u64) {
        if let Some(fairness) = &self.fairness {
            let weighted = (tokens as f64 * fairness.output_weight).round() as u64;
            self.charge(flow, weighted);
        }
    }

    /// Requests held for an engine now.
    pub fn held(&self) -> usize {
        self.held.load(Relaxed)
    }

    /// Requests of class `priority` waiting now.
    pub fn depth(&self, priority: Priority) -> usize {
        self.depth[priority as usize].load(Relaxed)
    }

    /// The flows' service now (tokens, decayed), the most served first: `(label, tokens)`
    /// of each session, or tenant's own requests, that has had at least one token.
    pub fn flows(&self) -> Vec<(Arc<str>, f64)> {
        let mut state = self.lock();
        let scale = self.scale(&mut state);
        // A flow that waits counts however little it has had: a starved one must show.
        let waiting: std::collections::HashSet<u64> = state
            .waiters
            .values()
            .filter_map(|w| w.flow.map(|(_, leaf)| leaf))
            .collect();
        let mut flows: Vec<(Arc<str>, f64)> = state
            .flows
            .iter()
            .filter(|(_, e)| e.leaf)
            .map(|(key, e)| (key, Arc::clone(&e.label), e.served / scale))
            .filter(|(key, _, served)| *served >= 1.0 || waiting.contains(key))
            .map(|(_, label, served)| (label, served))
            .collect();
        flows.sort_by(|a, b| b.1.total_cmp(&a.1));
        flows
    }

    /// Takes over the flows' service of `old` (the same pool before a reload).
    pub fn inherit(&self, old: &FlowControl) {
        if self.fairness.is_none() || std::ptr::eq(self, old) {
            return;
        }
        let theirs: Vec<(u64, bool, Arc<str>, f64)> = {
            let mut state = old.lock();
            let scale = old.scale(&mut state);
            state
                .flows
                .iter()
                .map(|(k, e)| (*k, e.leaf, Arc::clone(&e.label), e.served / scale))
                .collect()
        };
        let mut state = self.lock();
        let scale = self.scale(&mut state);
        for (key, leaf, label, served) in theirs {
            state.entry(key, leaf, &label).served += served * scale;
        }
    }
}

/// Jain's fairness index of `served` amounts: 1 when all are equal, 1/n when one flow had
/// everything; `None` for none.
pub fn jain_index(served: impl Iterator<Item = f64>) -> Option<f64> {
    let (mut n, mut sum, mut squares) = (0.0, 0.0, 0.0);
    for x in served {
        n += 1.0;
        sum += x;
        squares += x * x;
    }
    (n > 0.0 && squares > 0.0).then(|| sum * sum / (n * squares))
}

/// Forgets the least served flows that no waiter names, down to half of [`MAX_FLOWS`].
fn forget_least_served(state: &mut State) {
    let named: std::collections::HashSet<u64> = state
        .waiters
        .values()
        .filter_map(|w| w.flow)
        .flat_map(|(o, l)| [o, l])
        .collect();
    let mut idle: Vec<(u64, f64)> = state
        .flows
        .iter()
        .filter(|(k, _)| !named.contains(k))
        .map(|(k, e)| (*k, e.served))
        .collect();
    idle.sort_by(|a, b| a.1.total_cmp(&b.1));
    let excess = state.flows.len().saturating_sub(MAX_FLOWS / 2);
    for (key, _) in idle.into_iter().take(excess) {
        state.flows.remove(&key);
    }
}

/// The backends of a pool that may take a request now, and those of them that would not
/// queue it (see [`Pool::room`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Room {
    /// The backends that may take a request (ready, not ejected or cooling down).
    pub usable: Vec<std::net::SocketAddr>,
    /// Of those, the ones that would not queue it.
    pub open: Vec<std::net::SocketAddr>,
}

/// How a wait for an engine's room ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// It is let in: go.
    LetIn,
    /// Its deadline came.
    Deadline,
    /// No backend of the pool is usable any more.
    NoBackend,
}

/// A request's place in its pool's queue; dropping it leaves the queue and tells the next
/// waiter that it may be first now.
pub struct Place {
    control: Arc<FlowControl>,
    seq: u64,
    kind: WaitFor,
    priority: Priority,
    turn: Arc<Notify>,
    /// It was let in, and its demand is not counted by the pool yet: no other waiter is.
    admitted: bool,
}

impl Place {
    fn is_first(&self) -> bool {
        self.control.lock().first(self.kind) == Some(self.seq)
    }

    /// Waits until `admits()` says yes (true), or until `deadline` (false); the first
    /// waiter asks every [`POLL`], the others every [`POLL_BEHIND`]. A waiter for headroom
    /// that fits goes past a first that does not (headroom depends on the request's size);
    /// a waiter for an engine goes only when it is the first of those (an engine's room is
    /// the same for all). The place is kept either way: drop it to leave (after the
    /// request's attempt has started, so that the next waiter is judged against a load that
    /// counts this one).
    pub async fn wait_for(&mut self, deadline: Instant, admits: impl Fn() -> bool) -> bool {
        loop {
            // One waiter at a time is let in, until its place is dropped: several let in at
            // once would all be judged against the same load.
            let first = self.is_first();
            let free = self.control.letting_in.load(Relaxed) == 0;
            let may = first || self.kind == WaitFor::Headroom;
            if free && may && admits() && self.claim() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            // Woken early when a waiter ahead leaves (this one may be first now).
            let every = if first { POLL } else { POLL_BEHIND };
            let until = (Instant::now() + every).min(deadline);
            tokio::select! {
                _ = self.turn.notified() => {}
                _ = sleep_until(until) => {}
            }
        }
    }

    /// The backend this waiter must go to (its session's): it waits for that one's room.
    pub fn aim_at(&mut self, target: std::net::SocketAddr) {
        let mut state = self.control.lock();
        if let Some(waiter) = state.waiters.get_mut(&self.seq) {
            waiter.target = Some(target);
        }
    }

    /// For a waiter for an engine: waits until it is the first of those that may go to a
    /// backend with room now (`room()`); until `deadline`; or until no backend is usable at
    /// all (that is the waiting room's business, not an engine's queue). Kept either way, as
    /// [`Place::wait_for`].
    pub async fn wait_for_room(&mut self, deadline: Instant, room: impl Fn() -> Room) -> Waited {
        loop {
            let room = room();
            if room.usable.is_empty() {
                return Waited::NoBackend;
            }
            // The queue is looked through only when some engine has room.
            let free = self.control.letting_in.load(Relaxed) == 0;
            if free && !room.open.is_empty() {
                let mine = self.control.lock().first_with_room(&room) == Some(self.seq);
                if mine && self.claim() {
                    return Waited::LetIn;
                }
            }
            if Instant::now() >= deadline {
                return Waited::Deadline;
            }
            let every = if self.is_first() { POLL } else { POLL_BEHIND };
            let until = (Instant::now() + every).min(deadline);
            tokio::select! {
                _ = self.turn.notified() => {}
                _ = sleep_until(until) => {}
            }
        }
    }

    /// Takes the one turn to be let in; `false` when another waiter took it first.
    fn claim(&mut self) -> bool {
        let taken = self
            .control
            .letting_in
            .compare_exchange(0, 1, Relaxed, Relaxed)
            .is_ok();
        self.admitted = taken;
        taken
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.admitted {
            self.control.letting_in.store(0, Relaxed);
        }
        let mut state = self.control.lock();
        if let Some(waiter) = state.waiters.remove(&self.seq) {
            state.counts[waiter.kind as usize] -= 1;
            if waiter.kind == WaitFor::Engine {
                self.control.held.fetch_sub(1, Relaxed);
            }
        }
        state.firsts = None;
        // Whoever is first now asks the pool (a permit is kept if it is not listening yet).
        for next in state.firsts().into_iter().flatten() {
            if let Some(waiter) = state.waiters.get(&next) {
                waiter.turn.notify_one();
            }
        }
        drop(state);
        self.control.depth[self.priority as usize].fetch_sub(1, Relaxed);
    }
}

impl Pool {
    /// The pool's flow control: its queue and its flows' service.
    pub fn flow_control(&self) -> &Arc<FlowControl> {
        &self.flow_control
    }

    /// Whether every backend that may take a request now would queue it inside the engine
    /// (see [`BackendLive::queues`]), with fairness on. `false` with it off, or when no
    /// backend is usable (that is the waiting room's business).
    pub fn engines_queue(&self) -> bool {
        let Some(fairness) = self.flow_control.fairness() else {
            return false;
        };
        let members = self.members();
        let mut usable = members
            .iter()
            .filter(|m| m.is_ready() && m.live.is_usable())
            .peekable();
        usable.peek().is_some()
            && usable.all(|m| {
                m.live
                    .queues(fairness.hold_above_tokens, &self.settings.health)
            })
    }

    /// Whether the backend at `addr` would take a request without queueing it (fairness on);
    /// `None` when it is not a usable backend of the pool.
    pub fn has_room(&self, addr: std::net::SocketAddr) -> Option<bool> {
        let fairness = self.flow_control.fairness()?;
        let members = self.members();
        let member = members
            .iter()
            .find(|m| m.spec.resolved == addr && m.is_ready() && m.live.is_usable())?;
        Some(
            !member
                .live
                .queues(fairness.hold_above_tokens, &self.settings.health),
        )
    }

    /// With fairness on, the usable backends, and those of them that would not queue a
    /// request now (see [`BackendLive::queues`](crate::BackendLive::queues)); none with it
    /// off.
    pub fn room(&self) -> Room {
        let Some(fairness) = self.flow_control.fairness() else {
            return Room::default();
        };
        let mut room = Room::default();
        for m in self.members().iter() {
            if !(m.is_ready() && m.live.is_usable()) {
                continue;
            }
            room.usable.push(m.spec.resolved);
            if !m
                .live
                .queues(fairness.hold_above_tokens, &self.settings.health)
            {
                room.open.push(m.spec.resolved);
            }
        }
        room
    }

    /// With fairness on, the usable backends that would queue a request while another has
    /// room: a request let in from the queue with no backend of its own (no session bound)
    /// passes them over under a strategy that does not weigh a backend's queue (`kv_aware`,
    /// `round_robin`), so it goes where the room is. Empty when none or all queue, and for
    /// `ttft`, whose predicted wait counts the queue already.
    pub fn queueing_backends(&self) -> Vec<std::net::SocketAddr> {
        if matches!(self.settings.balancing, super::Balancing::Ttft(_)) {
            return Vec::new();
        }
        let Room { usable, open } = self.room();
        if open.is_empty() {
            return Vec::new();
        }
        usable.into_iter().filter(|a| !open.contains(a)).collect()
    }

    /// Jain's fairness index over the pool's flows' service now; `None` without fairness or
    /// before any service.
    pub fn fairness_index(&self) -> Option<f64> {
        self.flow_control.fairness()?;
        jain_index(self.flow_control.flows().into_iter().map(|(_, s)| s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn control(fairness: Option<Fairness>) -> Arc<FlowControl> {
        Arc::new(FlowControl::new(fairness))
    }

    fn fair() -> Arc<FlowControl> {
        control(Some(Fairness::default()))
    }

    fn join(c: &Arc<FlowControl>, priority: Priority, flow: Option<&FlowId>) -> Place {
        c.join(WaitFor::Headroom, priority, flow, None, 0, 64)
            .unwrap()
    }

    fn session(tenant: &str, id: &str) -> FlowId {
        FlowId::new(Some(tenant), None, Some(id.as_bytes()))
    }

    /// The waiters' `seq`s in the order they are let in, each charged `cost` to its flow as
    /// it goes (as its attempt would be).
    fn let_in_order(
        q: &Arc<FlowControl>,
        places: Vec<(Place, Option<FlowId>)>,
        cost: u64,
    ) -> Vec<u64> {
        let mut places = places;
        let mut order = Vec::new();
        while !places.is_empty() {
            let first = q.lock().first(WaitFor::Headroom).unwrap();
            let at = places.iter().position(|(p, _)| p.seq == first).unwrap();
            let (place, flow) = places.remove(at);
            if let Some(flow) = flow {
                q.charge(&flow, cost);
            }
            order.push(place.seq);
        }
        order
    }

    #[tokio::test(start_paused = true)]
    async fn without_fairness_the_highest_class_then_the_oldest_goes_first() {
        let q = control(None);
        let standard = join(&q, Priority::Standard, None);
        let sheddable = join(&q, Priority::Sheddable, None);
        let critical = join(&q, Priority::Critical, None);
        let later_standard = join(&q, Priority::Standard, None);
        assert!(critical.is_first());
        drop(critical);
        assert!(standard.is_first());
        drop(standard);
        assert!(later_standard.is_first());
        drop(later_standard);
        assert!(sheddable.is_first());
    }

    #[tokio::test(start_paused = true)]
    async fn the_least_served_session_goes_first_inside_a_class() {
        let q = fair();
        let (long, short) = (session("t", "long"), session("t", "short"));
        q.charge(&long, 50_000);
        q.charge(&short, 1_000);
        let long_turn = join(&q, Priority::Standard, Some(&long));
        let short_turn = join(&q, Priority::Standard, Some(&short));
        assert!(short_turn.is_first(), "the short session had less");
        // Bands stay strict: a sheddable new session waits behind a standard long one.
        let shed = join(&q, Priority::Sheddable, Some(&session("t", "new")));
        drop(short_turn);
        assert!(long_turn.is_first());
        drop(long_turn);
        assert!(shed.is_first());
    }

    #[tokio::test(start_paused = true)]
    async fn without_fairness_service_changes_nothing() {
        let q = control(None);
        let (long, short) = (session("t", "long"), session("t", "short"));
        q.charge(&long, 50_000);
        let long_turn = join(&q, Priority::Standard, Some(&long));
        let _short_turn = join(&q, Priority::Standard, Some(&short));
        assert!(long_turn.is_first());
    }

    #[tokio::test(start_paused = true)]
    async fn a_flows_burst_goes_one_at_a_time_behind_those_with_less() {
        let q = fair();
        let (busy, other) = (session("t", "busy"), session("t", "other"));
        q.charge(&other, 250);
        // Four of the busy session's at once, each costing 100, then one of the other's:
        // the busy session's third brings it to 300, past the other's 250.
        let mut places: Vec<(Place, Option<FlowId>)> = (0..4)
            .map(|_| {
                (
                    join(&q, Priority::Standard, Some(&busy)),
                    Some(busy.clone()),
                )
            })
            .collect();
        let b: Vec<u64> = places.iter().map(|(p, _)| p.seq).collect();
        let o = join(&q, Priority::Standard, Some(&other));
        let o_seq = o.seq;
        places.push((o, Some(other.clone())));
        let order = let_in_order(&q, places, 100);
        assert_eq!(order, vec![b[0], b[1], b[2], o_seq, b[3]]);
    }

    #[tokio::test(start_paused = true)]
    async fn tenants_come_before_their_sessions() {
        let q = fair();
        // Tenant a's many sessions had little each, much together; tenant b's one had more
        // than any of them alone.
        for i in 0..10 {
            q.charge(&session("a", &i.to_string()), 1_000);
        }
        q.charge(&session("b", "0"), 5_000);
        let a_new = join(&q, Priority::Standard, Some(&session("a", "fresh")));
        let b_turn = join(&q, Priority::Standard, Some(&session("b", "0")));
        assert!(b_turn.is_first(), "the tenant with less goes first");
        drop(b_turn);
        assert!(a_new.is_first());
    }

    #[tokio::test(start_paused = true)]
    async fn among_equals_the_earliest_deadline_goes_first() {
        let q = fair();
        let now = std::time::Instant::now();
        let at = |s| Some(now + Duration::from_secs(s));
        let (x, y) = (session("t", "x"), session("t", "y"));
        let late = q.join(WaitFor::Headroom, Priority::Standard, Some(&x), at(9), 0, 8);
        let early = q.join(WaitFor::Headroom, Priority::Standard, Some(&y), at(1), 0, 8);
        assert!(early.unwrap().is_first());
        drop(late);
    }

    #[tokio::test(start_paused = true)]
    async fn among_equals_the_smaller_prompt_goes_first() {
        let q = fair();
        let (agent, chat) = (session("t", "agent"), session("t", "chat"));
        let opening = q.join(
            WaitFor::Engine,
            Priority::Standard,
            Some(&agent),
            None,
            16_000,
            8,
        );
        let question = q.join(
            WaitFor::Engine,
            Priority::Standard,
            Some(&chat),
            None,
            300,
            8,
        );
        assert!(question.unwrap().is_first());
        drop(opening);
    }

    #[tokio::test(start_paused = true)]
    async fn service_decays_with_its_half_life() {
        let q = fair();
        let (old, new) = (session("t", "old"), session("t", "new"));
        q.charge(&old, 8_000);
        tokio::time::advance(Duration::from_secs(180)).await;
        q.charge(&new, 1_500);
        // 8,000 three half-lives ago is 1,000 now.
        let flows = q.flows();
        let served = |label: &str| flows.iter().find(|(l, _)| &**l == label).map(|f| f.1);
        let old_now = served(old.label()).unwrap();
        assert!((old_now - 1_000.0).abs() < 1.0, "{old_now}");
        assert!((served(new.label()).unwrap() - 1_500.0).abs() < 1e-6);
        let new_turn = join(&q, Priority::Standard, Some(&new));
        let old_turn = join(&q, Priority::Standard, Some(&old));
        assert!(old_turn.is_first());
        drop(new_turn);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rebase_keeps_the_order_and_the_amounts() {
        let q = control(Some(Fairness {
            half_life: Duration::from_millis(10),
            ..Fairness::default()
        }));
        let (a, b) = (session("t", "a"), session("t", "b"));
        q.charge(&a, 10);
        let a_turn = join(&q, Priority::Standard, Some(&a));
        let b_turn = join(&q, Priority::Standard, Some(&b));
        assert!(b_turn.is_first());
        // Past a rebase (256 half-lives): the amounts are today's, the order theirs.
        tokio::time::advance(Duration::from_secs(3)).await;
        q.charge(&b, 1_000);
        q.charge(&a, 2_000);
        assert!(b_turn.is_first());
        let flows = q.flows();
        assert_eq!(flows.len(), 2);
        assert!((flows[0].1 - 2_000.0).abs() < 1e-6, "{flows:?}");
        drop(b_turn);
        assert!(a_turn.is_first());
    }

    #[tokio::test(start_paused = true)]
    async fn each_kind_of_wait_has_its_own_bound() {
        let q = control(None);
        let headroom =
            |q: &Arc<FlowControl>| q.join(WaitFor::Headroom, Priority::Standard, None, None, 0, 2);
        let a = headroom(&q).unwrap();
        let _b = headroom(&q).unwrap();
        assert!(headroom(&q).is_none());
        assert!(q
            .join(WaitFor::Engine, Priority::Critical, None, None, 0, 2)
            .is_some());
        drop(a);
        assert!(headroom(&q).is_some());
        assert_eq!(q.depth(Priority::Standard), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_fits_goes_past_a_first_that_does_not() {
        let q = control(None);
        let open = Arc::new(AtomicBool::new(false));
        let mut big = join(&q, Priority::Critical, None);
        let mut small = join(&q, Priority::Standard, None);
        let deadline = Instant::now() + Duration::from_secs(2);
        let fits = {
            let open = Arc::clone(&open);
            move || open.load(Relaxed)
        };
        let waiting_small = tokio::spawn(async move { small.wait_for(deadline, fits).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        open.store(true, Relaxed);
        let started = Instant::now();
        assert!(waiting_small.await.unwrap());
        assert!(
            started.elapsed() <= POLL_BEHIND,
            "asked again within its poll"
        );
        assert!(
            !big.wait_for(deadline, || false).await,
            "the first timed out"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_let_in_one_at_a_time_until_the_last_ones_attempt_starts() {
        let q = control(None);
        let mut first = join(&q, Priority::Standard, None);
        let mut second = join(&q, Priority::Standard, None);
        let deadline = Instant::now() + Duration::from_secs(2);
        assert!(first.wait_for(deadline, || true).await);
        let waits = tokio::time::timeout(
            Duration::from_millis(200),
            second.wait_for(deadline, || true),
        );
        assert!(waits.await.is_err(), "two let in at once");
        drop(first);
        assert!(second.wait_for(deadline, || true).await);
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_first_waiter_for_an_engine_goes_when_one_has_room() {
        let q = fair();
        let (long, short) = (session("t", "long"), session("t", "short"));
        q.charge(&long, 10_000);
        let engine = |flow: &FlowId| {
            q.join(WaitFor::Engine, Priority::Standard, Some(flow), None, 0, 8)
                .unwrap()
        };
        let mut long_turn = engine(&long);
        let mut short_turn = engine(&short);
        let deadline = Instant::now() + Duration::from_secs(1);
        // The engine has room, but the long session's turn is not first: it waits.
        let waits = tokio::time::timeout(
            Duration::from_millis(100),
            long_turn.wait_for(deadline, || true),
        );
        assert!(waits.await.is_err(), "a waiter behind the first went in");
        assert!(short_turn.wait_for(deadline, || true).await);
        drop(short_turn);
        assert!(long_turn.wait_for(deadline, || true).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_backend_queues_lets_the_next_go_where_there_is_room() {
        let q = fair();
        let a: std::net::SocketAddr = "10.0.0.1:8000".parse().unwrap();
        let b: std::net::SocketAddr = "10.0.0.2:8000".parse().unwrap();
        let (bound, other) = (session("t", "bound"), session("t", "other"));
        q.charge(&other, 1_000);
        let engine = |flow: &FlowId| {
            q.join(WaitFor::Engine, Priority::Standard, Some(flow), None, 0, 8)
                .unwrap()
        };
        let mut bound_turn = engine(&bound);
        bound_turn.aim_at(a);
        let mut other_turn = engine(&other);
        let deadline = Instant::now() + Duration::from_secs(1);
        // Only b has room: the first (bound to a) waits, the next goes.
        let only_b = || Room {
            usable: vec![a, b],
            open: vec![b],
        };
        assert_eq!(
            other_turn.wait_for_room(deadline, only_b).await,
            Waited::LetIn
        );
        drop(other_turn);
        let waits = tokio::time::timeout(
            Duration::from_millis(100),
            bound_turn.wait_for_room(deadline, only_b),
        );
        assert!(waits.await.is_err(), "its own backend has no room");
        // Its backend gone from the pool: any with room will do.
        let without_a = || Room {
            usable: vec![b],
            open: vec![b],
        };
        assert_eq!(
            bound_turn.wait_for_room(deadline, without_a).await,
            Waited::LetIn
        );
        drop(bound_turn);
        let mut late = engine(&bound);
        let none = || Room::default();
        assert_eq!(late.wait_for_room(deadline, none).await, Waited::NoBackend);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gives_up_at_its_deadline() {
        let q = control(None);
        let mut place = join(&q, Priority::Critical, None);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(2);
        assert!(!place.wait_for(deadline, || false).await);
        assert_eq!(Instant::now().duration_since(start), Duration::from_secs(2));
    }

    #[test]
    fn jains_index_is_one_for_equals_and_one_over_n_for_one_taking_all() {
        assert_eq!(jain_index([5.0, 5.0, 5.0, 5.0].into_iter()), Some(1.0));
        assert_eq!(jain_index([8.0, 0.0, 0.0, 0.0].into_iter()), Some(0.25));
        assert_eq!(jain_index(std::iter::empty()), None);
    }
}
