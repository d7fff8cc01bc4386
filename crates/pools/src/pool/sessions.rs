//! Session affinity: requests naming the same session (a header or a body member the agents
//! send, scoped to the tenant) go to one backend while the pool's
//! [`SessionAffinity`](super::SessionAffinity) allows; under `ttft`, while the predicted time
//! to first token elsewhere, the recompute of what the session left cached included, is not
//! lower. The table is fixed in size and lock-free (see [`SessionTable`]).

use super::select::Choice;
use super::{Pool, SessionKey, SessionMode};
use sluice_llm::raw_json;
use sluice_llm::{Demand, LlmCall};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// A soft session leaves a backend whose projected KV usage reaches this...
const SESSION_KV_LIMIT: f64 = 0.95;

/// ...or where it would wait this long (seconds) behind other prefills.
const SESSION_MAX_WAIT: f64 = 1.0;

/// Sessions and their backends: a fixed table of atomic slots, two per session (2-way set
/// associative), so it never grows whatever ids clients send, and neither lookup nor
/// binding takes a lock. A new session takes an empty or expired slot of its two, else the
/// one seen longest ago; a session whose slots were taken is just balanced afresh.
///
/// A slot packs, in one `u64`: 24 bits of the session's hash (a tag), the backend's session
/// slot (12 bits; 0: empty; see `crate::members`) and when it was last seen (28 bits of
/// seconds, wrapping). A backend keeps its slot while it stays in the pool.
pub(super) struct SessionTable {
    slots: Box<[AtomicU64]>,
    /// Beside each slot, the prompt (estimated tokens) of the session's last turn: what it
    /// left in its backend's prefix cache, for a strategy that weighs it.
    last_prompt: Box<[AtomicU32]>,
    idle_ttl_secs: u64,
}

const SESSION_INDEX_BITS: u32 = 12;
const SESSION_TIME_BITS: u32 = 28;
const SESSION_TIME_MASK: u64 = (1 << SESSION_TIME_BITS) - 1;

impl SessionTable {
    pub(super) fn new(capacity: usize, idle_ttl: Duration) -> Self {
        let len = capacity.clamp(2, 1 << 24).next_multiple_of(2);
        Self {
            slots: (0..len).map(|_| AtomicU64::new(0)).collect(),
            last_prompt: (0..len).map(|_| AtomicU32::new(0)).collect(),
            idle_ttl_secs: idle_ttl.as_secs().max(1),
        }
    }

    fn now() -> u64 {
        static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
        EPOCH.elapsed().as_secs() & SESSION_TIME_MASK
    }

    fn tag(key: u64) -> u64 {
        key >> 40
    }

    /// The two slots of `key`.
    fn pair(&self, key: u64) -> [usize; 2] {
        let first = (key as usize % self.slots.len()) & !1;
        [first, first + 1]
    }

    /// The slot's backend (its session slot), when it holds `tag` and has not expired at
    /// `now`.
    fn live_index(&self, entry: u64, tag: Option<u64>, now: u64) -> Option<u16> {
        let slot = (entry >> SESSION_TIME_BITS) & ((1 << SESSION_INDEX_BITS) - 1);
        let seen = entry & SESSION_TIME_MASK;
        let idle = now.wrapping_sub(seen) & SESSION_TIME_MASK;
        let matches = tag.is_none_or(|t| entry >> (SESSION_TIME_BITS + SESSION_INDEX_BITS) == t);
        (slot > 0 && matches && idle <= self.idle_ttl_secs)
            .then(|| u16::try_from(slot).ok())
            .flatten()
    }

    /// Takes `old`'s sessions, when the two are the same size (a changed `capacity` starts
    /// afresh: a session's slots depend on it).
    pub(super) fn copy_from(&self, old: &SessionTable) {
        if self.slots.len() == old.slots.len() {
            for (mine, theirs) in self.slots.iter().zip(old.slots.iter()) {
                mine.store(theirs.load(Relaxed), Relaxed);
            }
            for (mine, theirs) in self.last_prompt.iter().zip(old.last_prompt.iter()) {
                mine.store(theirs.load(Relaxed), Relaxed);
            }
        }
    }

    /// The session slot of `key`'s backend, and its last turn's prompt (estimated tokens).
    pub(super) fn get(&self, key: u64) -> Option<(u16, u32)> {
        let (tag, now) = (Self::tag(key), Self::now());
        self.pair(key).into_iter().find_map(|slot| {
            let entry = self.slots.get(slot)?.load(Relaxed);
            let backend = self.live_index(entry, Some(tag), now)?;
            let last = self.last_prompt.get(slot).map_or(0, |t| t.load(Relaxed));
            Some((backend, last))
        })
    }

    /// Binds the session `key` to the backend with session slot `slot`, its turn's prompt
    /// of `prompt_tokens` (estimated) sent there.
    pub(super) fn bind(&self, key: u64, slot: u16, prompt_tokens: u64) {
        if slot == 0 {
            return; // A backend beyond what slots can name: balanced without sessions.
        }
        let (tag, now) = (Self::tag(key), Self::now());
        let entry = tag << (SESSION_TIME_BITS + SESSION_INDEX_BITS)
            | (u64::from(slot) << SESSION_TIME_BITS)
            | now;
        let [a, b] = self.pair(key);
        let (Some(sa), Some(sb)) = (self.slots.get(a), self.slots.get(b)) else {
            return;
        };
        let (ea, eb) = (sa.load(Relaxed), sb.load(Relaxed));
        let mine = |e: u64| e >> (SESSION_TIME_BITS + SESSION_INDEX_BITS) == tag && e != 0;
        let free = |e: u64| self.live_index(e, None, now).is_none();
        let age = |e: u64| now.wrapping_sub(e & SESSION_TIME_MASK) & SESSION_TIME_MASK;
        let at = if mine(ea) {
            a
        } else if mine(eb) {
            b
        } else if free(ea) {
            a
        } else if free(eb) || age(eb) > age(ea) {
            b
        } else {
            a
        };
        let (Some(slot), Some(last)) = (self.slots.get(at), self.last_prompt.get(at)) else {
            return;
        };
        // Skipped when nothing changed, so a busy session does not keep writing one line.
        if slot.load(Relaxed) != entry {
            slot.store(entry, Relaxed);
        }
        let tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        if last.load(Relaxed) != tokens {
            last.store(tokens, Relaxed);
        }
    }

    pub(super) fn len(&self) -> usize {
        let now = Self::now();
        self.slots
            .iter()
            .filter(|s| self.live_index(s.load(Relaxed), None, now).is_some())
            .count()
    }
}

impl Pool {
    /// The session key of a request that names its session where the pool's `session_keys`
    /// look (the first that has a value); `None` when the pool has no session affinity or
    /// the request names none. Hashed with a per-process key: client-chosen ids cannot aim
    /// at one another's slots. Scoped to `tenant`: one tenant's session id never joins
    /// another's session (and its backend). Body members are found where the request's
    /// parse noted them: the body is not read again.
    pub fn session_key(
        &self,
        header: &pingora_http::RequestHeader,
        call: &LlmCall,
        tenant: Option<&str>,
    ) -> Option<u64> {
        let id = self.session_id(header, call)?;
        Some(Self::session_key_of(id, tenant))
    }

    /// The session key of session `id` of `tenant` (see [`Pool::session_key`]), for a caller
    /// that has the id already.
    pub fn session_key_of(id: &[u8], tenant: Option<&str>) -> u64 {
        static KEY: LazyLock<RandomState> = LazyLock::new(RandomState::new);
        KEY.hash_one((tenant, id))
    }

    /// The id a request names its session by, where the pool's `session_keys` look (the
    /// first that has a value): a header's value, or a body member's JSON text. `None` when
    /// the pool has no session affinity or the request names none.
    pub fn session_id<'r>(
        &self,
        header: &'r pingora_http::RequestHeader,
        call: &'r LlmCall,
    ) -> Option<&'r [u8]> {
        let sessions = self.settings.sessions.as_ref()?;
        session_id_in(&sessions.keys, header, call)
    }

    /// Who `call` is served for, in the pool's fair order: its session (where the fairness
    /// settings look for one), in its tenant, else its client's address.
    pub fn flow_of(
        &self,
        header: &pingora_http::RequestHeader,
        call: &LlmCall,
        tenant: Option<&str>,
        client: Option<std::net::IpAddr>,
    ) -> super::FlowId {
        let session = self
            .settings
            .fairness
            .as_ref()
            .and_then(|f| session_id_in(&f.session_keys, header, call));
        super::FlowId::new(tenant, client, session)
    }
}

/// The first of `keys` that `header` or `call` has a value for.
fn session_id_in<'r>(
    keys: &[SessionKey],
    header: &'r pingora_http::RequestHeader,
    call: &'r LlmCall,
) -> Option<&'r [u8]> {
    for key in keys {
        let value = match key {
            SessionKey::Header(name) => header.headers.get(name.as_str()).map(|v| v.as_bytes()),
            SessionKey::Body { member, inner } => body_value(call, member, inner.as_deref()),
        };
        if let Some(value) = value.filter(|v| !matches!(*v, b"" | b"null" | b"\"\"")) {
            return Some(value);
        }
    }
    None
}

impl Pool {
    /// The backend session `key` is bound to here, and its last turn's prompt (estimated
    /// tokens), for sharing it with other proxies.
    pub fn session_binding(&self, key: u64) -> Option<(std::net::SocketAddr, u32)> {
        let (slot, tokens) = self.session_table.as_ref()?.get(key)?;
        let members = self.members();
        let index = members.by_slot(slot)?;
        Some((members.get(index)?.spec.resolved, tokens))
    }

    /// Binds session `key` to the backend at `addr`, its last turn's prompt `tokens`, as
    /// another proxy bound it: when `addr` is one of the pool's and the session is not bound
    /// here already. Whether it was bound.
    pub fn adopt_session(&self, key: u64, addr: std::net::SocketAddr, tokens: u32) -> bool {
        let Some(table) = self.session_table.as_ref() else {
            return false;
        };
        if table.get(key).is_some() {
            return false;
        }
        let members = self.members();
        let Some(member) = members.iter().find(|m| m.spec.resolved == addr) else {
            return false;
        };
        table.bind(key, member.slot, u64::from(tokens));
        true
    }

    /// Whether a session bound to backend `index` stays there for this request.
    pub(super) fn session_stays(&self, m: &Choice<'_>, index: usize, demand: &Demand) -> bool {
        let (Some(sessions), Some(endpoint)) = (&self.settings.sessions, m.members.get(index))
        else {
            return false;
        };
        if !m.candidate(index) {
            return false;
        }
        let live = &endpoint.live;
        if sessions.mode == SessionMode::Hard {
            return true;
        }
        let outlook = live.outlook(&self.settings.health);
        let full = outlook
            .projected_kv_counting_stale(self.settings.health.stale_as)
            .is_some_and(|kv| kv >= SESSION_KV_LIMIT)
            || outlook
                .free_kv_tokens()
                .is_some_and(|free| free < demand.tokens() as f64);
        // Others' requests queued there, beyond what this proxy is still waiting on.
        let queued = outlook.waiting > f64::from(live.accounting().prefilling);
        let behind = live.predicted_ttft(0, 0, &self.settings.health) > SESSION_MAX_WAIT;
        !(full || queued || behind)
    }

    /// Sessions remembered now (bounded by [`SessionAffinity::capacity`]).
    pub fn sessions_remembered(&self) -> usize {
        self.session_table.as_ref().map_or(0, SessionTable::len)
    }
}

/// The JSON text of `call`'s body member `member` (a top-level one), or of its member
/// `inner`: `None` when absent or not an object where `inner` is wanted.
fn body_value<'b>(call: &'b LlmCall, member: &str, inner: Option<&str>) -> Option<&'b [u8]> {
    let value = call.member(member)?;
    let Some(inner) = inner else {
        return Some(value);
    };
    if value.first() != Some(&b'{') {
        return None;
    }
    let range = raw_json::object_spans(value, &[inner])?.value(inner)?;
    value.get(range)
}
