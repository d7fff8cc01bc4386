//! Choosing a backend for an attempt: the candidates ([`Choice`]: ready, usable, not tried,
//! not warming up at their share, ready for the request's LoRA adapter), the session's
//! backend while it may stay, else the pool's [`Strategy`], one file each as Pingora's
//! `selection/` has them:
//!
//! - [`round_robin`]: weighted round robin;
//! - [`kv_aware`]: the better of two random backends by KV-cache room, with prefix affinity;
//! - [`ttft`]: the least predicted time to first token.
//!
//! A new strategy is a file here implementing [`Strategy`], and its arm in [`strategy_for`]
//! (and its name in the config's `balancing.strategy`).

mod kv_aware;
mod round_robin;
mod ttft;

pub use ttft::REFERENCE_PROMPT_TOKENS;

use super::{Balancing, Pool};
use crate::health::{BackendLive, Wait};
use crate::members::Members;
use crate::prefix::{Credit, PrefixKeys};
use sluice_llm::Demand;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// One way of choosing among a choice's candidates (`pools[].balancing.strategy`).
pub(super) trait Strategy: Send + Sync {
    /// The candidate of `choice` for `demand`, the backends' prefix caches credited as
    /// `credit` says; `None` when there is no candidate.
    fn choose(
        &self,
        pool: &Pool,
        choice: &Choice<'_>,
        demand: &Demand,
        credit: &Credit,
    ) -> Option<Pick>;
    /// Whether it weighs a session's backend itself ([`Choice::session`]), by what the
    /// session's turn would find cached there: then a `soft` session goes wherever it
    /// chooses. Otherwise a session stays on its backend while
    /// [`Pool::session_stays`](super::Pool) allows.
    fn weighs_sessions(&self) -> bool {
        false
    }
}

/// What a strategy chose: the candidate, and when it predicts times to first token, the
/// time predicted there and at the best other candidate (the runner-up), for the
/// decision's explanation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Pick {
    pub(super) index: usize,
    pub(super) runner_up: Option<(usize, f64)>,
}

impl Pick {
    pub(super) fn only(index: usize) -> Self {
        Self {
            index,
            runner_up: None,
        }
    }
}

/// The strategy `balancing` names.
pub(super) fn strategy_for(balancing: &Balancing) -> Box<dyn Strategy> {
    match balancing {
        Balancing::RoundRobin => Box::new(round_robin::RoundRobin),
        Balancing::KvAware { .. } => Box::new(kv_aware::KvAware),
        Balancing::Ttft(settings) => Box::new(ttft::Ttft(settings.clone())),
    }
}

/// The backend chosen for an attempt.
#[derive(Debug, Clone)]
pub struct Selected {
    /// The backend's address: connect here, and add it to `tried` for the next attempt.
    pub addr: SocketAddr,
    /// The backend's live state; [`BackendLive::begin`] counts the attempt in flight.
    pub live: Arc<BackendLive>,
    /// The time to first token predicted for the request there, in seconds, when it has a
    /// prompt.
    pub predicted_ttft: Option<f64>,
    /// The prompt tokens (estimated) its prefix cache is taken to serve: the exact index's
    /// count, 0 when nothing is credited, `None` when the approximate affinity guessed (the
    /// backend's TTFT then cannot teach its prefill speed).
    pub cached_tokens: Option<u64>,
    /// With the exact index: the prompt tokens (the engine's) it predicts the backend's
    /// prefix cache serves.
    pub predicted_cached: Option<u64>,
    /// The wait predicted ahead of the request there (see `BackendLive::wait_ahead`), when
    /// it has a prompt.
    pub predicted_wait: Option<Wait>,
    /// The best other candidate and its predicted time to first token (seconds), when the
    /// strategy predicts them (`ttft`): why this one was chosen.
    pub runner_up: Option<(SocketAddr, f64)>,
    /// The request's session was bound to another backend, and left it.
    pub session_moved: bool,
    /// The request's session was bound anew: it had no backend, or it moved.
    pub session_rebound: bool,
}

/// An address no backend has, for a candidate that vanished between two reads.
const UNSPECIFIED: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// What a predicted TTFT adds for a backend that must load a request's LoRA adapter into a
/// free slot (from the engine's CPU cache: milliseconds to tens of them), so that a backend
/// already running it is preferred unless it is clearly busier.
pub(super) const ADAPTER_LOAD: f64 = 0.05;

/// How much lower the `kv_aware` score of a backend that must load the adapter is.
pub(super) const ADAPTER_LOAD_SCORE: f64 = 0.1;

/// How ready a backend is for a request's LoRA adapter (see [`adapter_readiness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum AdapterReadiness {
    /// It lists the adapter, and runs it now or has a slot free for it.
    Now,
    /// It lists the adapter but every slot holds another one (the request waits for one),
    /// or which adapters it has is not known yet.
    Waits,
    /// It does not list the adapter: it would answer 404.
    Lacks,
}

/// How ready `live` is for `adapter` (see [`AdapterReadiness`]).
pub(super) fn adapter_readiness(live: &BackendLive, adapter: &str) -> AdapterReadiness {
    match live.lists_adapter(adapter) {
        None => return AdapterReadiness::Waits,
        Some(false) => return AdapterReadiness::Lacks,
        Some(true) => {}
    }
    let load = live.load();
    match load.as_deref().and_then(|l| l.lora.as_ref()) {
        Some(slots) if !slots.runs(adapter) && !slots.has_free_slot() => AdapterReadiness::Waits,
        _ => AdapterReadiness::Now,
    }
}

/// Whether `live` must load `adapter` before running the request (it lists it, and has no
/// request of it now).
fn loads_adapter(live: &BackendLive, adapter: Option<&str>) -> bool {
    let Some(adapter) = adapter else {
        return false;
    };
    let load = live.load();
    !load
        .as_deref()
        .and_then(|l| l.lora.as_ref())
        .is_some_and(|slots| slots.runs(adapter))
}

impl Pool {
    /// The backend for the next attempt: a usable one (not unhealthy, not ejected) that is
    /// not in `tried`, chosen by the pool's balancing.
    /// A request of a session ([`Demand::session`]) goes to the session's backend while the
    /// pool's [`SessionAffinity`] allows, and binds the session to wherever it goes.
    pub fn select(&self, tried: &[SocketAddr], demand: &Demand) -> Option<Selected> {
        self.select_prefixed(tried, demand, None, None)
    }

    /// The backend at `addr`, when it is still one of the pool's and not in `tried`,
    /// whatever its health: for a request whose state lives there only (a stored response's
    /// follow-up), which no other backend could answer.
    pub fn select_backend(&self, addr: SocketAddr, tried: &[SocketAddr]) -> Option<Selected> {
        if tried.contains(&addr) {
            return None;
        }
        let members = self.members();
        let member = members.iter().find(|m| m.spec.resolved == addr)?;
        Some(Selected {
            addr,
            live: Arc::clone(&member.live),
            predicted_ttft: None,
            cached_tokens: None,
            predicted_cached: None,
            predicted_wait: None,
            runner_up: None,
            session_moved: false,
            session_rebound: false,
        })
    }

    /// [`Pool::select`] for a request whose prompt blocks are `prefix` (see
    /// [`PrefixRouting::keys`]) and which asks for the LoRA adapter `adapter` (see
    /// [`Pool::adapter`]): with the pool's exact index, each backend is credited with the
    /// prompt tokens its prefix cache holds; an adapter's request goes only where the adapter
    /// is listed, to a backend that can run it now when one can (one running it preferred,
    /// then one with a free slot).
    pub fn select_prefixed(
        &self,
        tried: &[SocketAddr],
        demand: &Demand,
        prefix: Option<&PrefixKeys>,
        adapter: Option<&str>,
    ) -> Option<Selected> {
        let members = self.members();
        let mut m = Choice {
            members: &members,
            tried,
            warm_only: members.has_late_joiners(),
            adapter: None,
            session: None,
        };
        if let Some(adapter) = adapter {
            m.adapter = Some((adapter, adapter_aim(&m, adapter)));
        }
        let credit = self.credit(demand, prefix);
        let session = demand.session.zip(self.session_table.as_ref());
        let bound = session.and_then(|(key, table)| {
            let (slot, tokens) = table.get(key)?;
            Some((members.by_slot(slot)?, tokens))
        });
        // A strategy that weighs sessions sees the session's backend and what its last
        // turn left cached there; else the session stays while the pool's rule allows.
        let kept = match bound {
            Some((index, tokens)) if self.weighs_sessions() => {
                m.session = Some(SessionHome {
                    index,
                    last_prompt_tokens: u64::from(tokens),
                });
                None
            }
            Some((index, _)) => self.session_stays(&m, index, demand).then_some(index),
            None => None,
        };
        let pick = match kept {
            Some(index) => Pick::only(index),
            None => self.pick(&m, demand, &credit)?,
        };
        let index = pick.index;
        let endpoint = members.get(index)?;
        if let Some((key, table)) = session {
            table.bind(key, endpoint.slot, demand.prompt_tokens);
        }
        let cached_tokens = self.cached_at(&m, index, demand, &credit);
        let predicted_ttft = (demand.prompt_tokens > 0).then(|| {
            let hits = cached_tokens.unwrap_or_else(|| {
                self.expected_hits(&m, index, demand, &credit, self.prefix_home(&m, demand))
            });
            endpoint
                .live
                .predicted_ttft(demand.prompt_tokens, hits, &self.settings.health)
        });
        let predicted_wait = (demand.prompt_tokens > 0)
            .then(|| (endpoint.live).wait_ahead(demand.prompt_tokens, &self.settings.health));
        let runner_up = pick
            .runner_up
            .and_then(|(i, cost)| Some((members.get(i)?.spec.resolved, cost)));
        let session_moved = bound.is_some_and(|(home, _)| home != index);
        let session_rebound = session.is_some() && (bound.is_none() || session_moved);
        let predicted_cached = self.predicted_cached(prefix, &credit, endpoint.spec.resolved);
        Some(Selected {
            addr: endpoint.spec.resolved,
            live: Arc::clone(&endpoint.live),
            predicted_ttft,
            cached_tokens,
            predicted_cached,
            predicted_wait,
            runner_up,
            session_moved,
            session_rebound,
        })
    }

    /// Whether the pool's strategy weighs a session's backend against the others (soft
    /// sessions, a strategy that prices them).
    fn weighs_sessions(&self) -> bool {
        self.strategy.weighs_sessions()
            && self
                .settings
                .sessions
                .as_ref()
                .is_some_and(|s| s.mode == super::SessionMode::Soft)
    }

    /// The strategy's pick. Endpoints warming up at their share are left out, unless nothing
    /// else is left.
    fn pick(&self, m: &Choice<'_>, demand: &Demand, credit: &Credit) -> Option<Pick> {
        self.strategy.choose(self, m, demand, credit).or_else(|| {
            let all = Choice {
                warm_only: false,
                ..*m
            };
            m.warm_only
                .then(|| self.strategy.choose(self, &all, demand, credit))
                .flatten()
        })
    }

    /// The exact index's prediction of the prompt tokens `addr` has cached, in the prompt's
    /// own tokens, to be set beside what the engine reports it served; the prompt's tokens
    /// are counted as looked up (`looked_up_tokens`).
    fn predicted_cached(
        &self,
        prefix: Option<&PrefixKeys>,
        credit: &Credit,
        addr: SocketAddr,
    ) -> Option<u64> {
        match (self.prefix.load().as_ref(), prefix, credit) {
            (Some(routing), Some(keys), Credit::Exact { matches, .. }) => {
                routing
                    .looked_up_tokens
                    .fetch_add(keys.tokens as u64, Relaxed);
                Some(matches.served_tokens(addr, keys.tokens as u64))
            }
            _ => None,
        }
    }

    /// What this selection credits the backends' prefix caches with: the exact index when
    /// the pool has one and the request's blocks are known, else the approximate affinity's
    /// guess when the pool uses it, else nothing.
    fn credit(&self, demand: &Demand, prefix: Option<&PrefixKeys>) -> Credit {
        match (self.prefix.load().as_ref(), prefix) {
            (Some(routing), Some(keys)) => Credit::Exact {
                matches: routing.index.lookup(&keys.keys),
                tokens: keys.tokens as u64,
                estimate: demand.prompt_tokens,
            },
            _ if self.settings.balancing.prefix_affinity().is_some()
                && demand.affinity.is_some() =>
            {
                Credit::Guess
            }
            _ => Credit::Nothing,
        }
    }

    /// The prompt tokens backend `index`'s cache is credited with (see
    /// [`Selected::cached_tokens`]): `None` for the approximate affinity's home, or a
    /// session's backend credited with its last turn (guesses both).
    fn cached_at(
        &self,
        m: &Choice<'_>,
        index: usize,
        demand: &Demand,
        credit: &Credit,
    ) -> Option<u64> {
        let addr = m.members.get(index)?.spec.resolved;
        match credit {
            Credit::Exact { .. } => credit.exact(addr),
            _ if m.session_hits(index, demand).is_some() => None,
            Credit::Guess if self.prefix_home(m, demand) == Some(index) => None,
            _ => Some(0),
        }
    }

    /// The prompt tokens backend `index`'s prefix cache is expected to serve `demand`, as a
    /// selection credits them: the exact index's count when the pool has it; else the most
    /// of the approximate affinity's guess (for its home) and the session's last turn (for
    /// its backend).
    pub(super) fn expected_hits(
        &self,
        m: &Choice<'_>,
        index: usize,
        demand: &Demand,
        credit: &Credit,
        home: Option<usize>,
    ) -> u64 {
        let addr = m
            .members
            .get(index)
            .map_or(UNSPECIFIED, |e| e.spec.resolved);
        if let Some(exact) = credit.exact(addr) {
            return exact;
        }
        let guess = if home == Some(index) {
            self.cached_tokens(demand)
        } else {
            0
        };
        guess.max(m.session_hits(index, demand).unwrap_or(0))
    }

    /// The backend prefix affinity prefers for `demand` among the usable ones not tried.
    pub(super) fn prefix_home(&self, m: &Choice<'_>, demand: &Demand) -> Option<usize> {
        self.settings.balancing.prefix_affinity()?;
        let key = demand.affinity?;
        m.candidates().max_by_key(|&i| m.rendezvous(key, i))
    }

    /// The prompt tokens prefix affinity says the prefix's home probably has cached:
    /// requests that share their first bytes mostly share a system prompt or a
    /// conversation's history, taken as half the prompt, and at least the bytes hashed.
    pub(super) fn cached_tokens(&self, demand: &Demand) -> u64 {
        let hashed = self.settings.balancing.prefix_affinity().unwrap_or(0) as u64 / 4;
        hashed
            .max(demand.prompt_tokens / 2)
            .min(demand.prompt_tokens)
    }
}

/// The readiness for `adapter` a backend needs: the best any candidate of `m` has, at worst
/// [`AdapterReadiness::Waits`].
fn adapter_aim(m: &Choice<'_>, adapter: &str) -> AdapterReadiness {
    m.candidates()
        .filter_map(|i| m.members.get(i))
        .map(|e| adapter_readiness(&e.live, adapter))
        .min()
        .unwrap_or(AdapterReadiness::Lacks)
        .min(AdapterReadiness::Waits)
}

/// One choice of a backend: the set it is made from, the backends already tried, and whether
/// backends warming up at their share are left out.
#[derive(Clone, Copy)]
pub(super) struct Choice<'a> {
    pub(super) members: &'a Members,
    pub(super) tried: &'a [SocketAddr],
    pub(super) warm_only: bool,
    /// The request's LoRA adapter, and the readiness a backend needs for it: the best any
    /// candidate has (never [`AdapterReadiness::Lacks`]).
    pub(super) adapter: Option<(&'a str, AdapterReadiness)>,
    /// The backend the request's session is bound to, for a strategy that weighs it.
    pub(super) session: Option<SessionHome>,
}

/// A session's backend and what its last turn left in the backend's prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SessionHome {
    pub(super) index: usize,
    /// The last turn's prompt (estimated tokens): the head of this turn's, which the engine
    /// kept unless it evicted it.
    pub(super) last_prompt_tokens: u64,
}

impl Choice<'_> {
    /// Whether the backend at `index` may take this attempt: ready, usable (not unhealthy,
    /// ejected or cooling down), not tried, not warming up at its share, and as ready for
    /// the request's adapter as the best one.
    pub(super) fn candidate(&self, index: usize) -> bool {
        self.members.get(index).is_some_and(|e| {
            e.is_ready()
                && e.live.is_usable()
                && !self.tried.contains(&e.spec.resolved)
                && !(self.warm_only && e.warming_full())
                && self
                    .adapter
                    .is_none_or(|(name, needed)| adapter_readiness(&e.live, name) <= needed)
        })
    }

    /// The prompt tokens the session's last turn left at backend `index`, when it is the
    /// session's backend: at most this turn's prompt.
    pub(super) fn session_hits(&self, index: usize, demand: &Demand) -> Option<u64> {
        self.session
            .filter(|home| home.index == index)
            .map(|home| home.last_prompt_tokens.min(demand.prompt_tokens))
    }

    /// Whether the backend at `index` must load the request's adapter first.
    pub(super) fn loads_adapter(&self, index: usize) -> bool {
        self.members
            .get(index)
            .is_some_and(|e| loads_adapter(&e.live, self.adapter.map(|(name, _)| name)))
    }

    pub(super) fn candidates(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        (0..self.members.len()).filter(|&i| self.candidate(i))
    }

    /// The rendezvous weight of `key` on the backend at `index`.
    pub(super) fn rendezvous(&self, key: u64, index: usize) -> u64 {
        self.members
            .get(index)
            .map_or(0, |e| rendezvous(key, e.key))
    }
}

/// Rendezvous (highest random weight) hashing: each key prefers one backend, and removing
/// a backend moves only the keys that preferred it. Backends are named by a hash of their
/// address, so every proxy agrees.
fn rendezvous(key: u64, backend: u64) -> u64 {
    // SplitMix64's finaliser: a good mix of key and backend in a few instructions.
    let mut z = key ^ backend.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
