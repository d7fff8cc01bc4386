//! Upstream pools as plugins see them: named sets of backends serving some models.
//!
//! The pool is its membership at the centre, and one module per concern around it:
//! [`settings`] (what it is built from), [`select`] (choosing a backend: one file per
//! strategy), [`sessions`], [`admission`] (headroom, classes, the installed control) and
//! [`catalogue`] (its models and adapters).
//!
//! A pool is built once from config and shared (`Arc<Pool>`); its backends may change at run
//! time through one door ([`Pool::update`], see `crate::members`). Choosing a backend is
//! lock-free: it loads the current set and each backend's live state (`crate::health`), then
//! balances by KV-cache room, predicted time to first token, or weighted round robin.

mod admission;
mod catalogue;
pub mod disaggregation;
mod flow_control;
pub mod select;
mod sessions;
mod settings;
mod waiting_room;

pub use admission::{Admission, Pressure, Priority};
pub use disaggregation::{
    Connector, PrefillRoute, Prefillers, RouteState, TransferCheck, TransferOutcome,
};
pub use flow_control::{jain_index, Fairness, FlowControl, FlowId, Place, Room, WaitFor, Waited};
pub use select::{Selected, REFERENCE_PROMPT_TOKENS};
pub use settings::{
    Balancing, Capabilities, ClientFields, PoolSettings, SessionAffinity, SessionKey, SessionMode,
    Timeouts, TokensPerSecond, TtftBalancing, DEFAULT_NO_BACKEND_WAIT,
};
pub use waiting_room::{Waiting, WaitingRoom, MAX_WAITING};

use crate::health::{BackendLive, DEFAULT_PREFILL_SPEED};
use crate::members::{self, BackendSpec, Change, Member, Members, Wanted};
use crate::prefix::PrefixRouting;
use crate::retry::RetryBudget;
use arc_swap::{ArcSwap, ArcSwapOption, Guard};
use pingora_core::upstreams::peer::HttpPeer;
use select::Strategy;
use sessions::SessionTable;
use sluice_llm::{Demand, LlmCall};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A prompt scale of 1 ([`Pool::prompt_tokens`]), in thousandths.
const PROMPT_SCALE_ONE: u64 = 1000;
/// The shortest estimated prompt a pool learns its prompt scale from.
const MIN_PROMPT_TO_LEARN: u64 = 64;

/// A backend that left the pool and is listed again within this long comes back with the
/// state it left with (its ejection, its learned speed): a DNS answer that briefly lacked
/// it, or a pod that restarted in place, does not make it a stranger.
const RETURN_WINDOW: Duration = Duration::from_secs(300);

/// The most departed backends whose state is kept for their return.
const MAX_DEPARTED: usize = 1024;

/// A named pool of backends.
pub struct Pool {
    /// The pool's name (as [`PoolSettings::name`], shared): in `x-sluice-pool`, metric labels
    /// and `/status`.
    pub name: Arc<str>,
    /// What the pool was built from, as given (its backends and models there are the ones it
    /// started with; [`Pool::members`] and [`Pool::models`] are the ones it has now).
    pub settings: PoolSettings,
    /// The model names this pool serves (the `model` field of requests): as configured, or
    /// as its backends list them (`models: auto`, see [`Pool::learn_models`]).
    models: ArcSwap<Vec<String>>,
    /// The LoRA adapters its backends list (see [`Pool::learn_adapters`]).
    adapters: ArcSwap<Vec<String>>,
    /// How a backend is chosen for each attempt ([`PoolSettings::balancing`]).
    strategy: Box<dyn Strategy>,
    /// The pool's retry budget, shared by its requests: the core deposits for each request
    /// sent to the pool and spends one for each retry.
    pub retry_budget: RetryBudget,
    /// The pool's tokenizer and exact prefix index (`tokenizer` and `kv_events`), if set;
    /// swapped only by [`Pool::inherit`], for the running pool's index.
    prefix: ArcSwapOption<PrefixRouting>,
    /// Who decides whether the pool takes a request now, if anyone (see [`Admission`]).
    admission: OnceLock<Arc<dyn Admission>>,
    /// The pool's tokens per estimated prompt token, in thousandths: learned from its
    /// answers' `usage.prompt_tokens` (see [`Pool::prompt_tokens`]).
    prompt_scale: AtomicU64,
    /// `name` as an `x-sluice-pool` value, made once: each answer takes a reference to it.
    name_value: http::HeaderValue,
    /// The backends now: read without a lock, replaced whole by [`Pool::update`].
    members: ArcSwap<Members>,
    /// Serialises updates (rare); readers never take it.
    updating: Mutex<()>,
    /// Counts changes of `members`, for whoever follows them (the health service).
    changes: tokio::sync::watch::Sender<u64>,
    /// The prefill speed a backend that joins starts from.
    prefill_seed: f64,
    session_table: Option<SessionTable>,
    /// The backends that left within [`RETURN_WINDOW`], their state kept for their return;
    /// oldest first. Taken only under `updating`.
    departed: Mutex<std::collections::VecDeque<(SocketAddr, Arc<BackendLive>, Instant)>>,
    /// Requests waiting for a usable backend (see [`Pool::usable_backend`]); handed on by a
    /// reload.
    waiting_room: ArcSwap<WaitingRoom>,
    /// The pool that replaced this one at a reload (see [`Pool::newest`]).
    successor: Mutex<std::sync::Weak<Pool>>,
    /// Where requests wait when the pool cannot take them now, and its flows' service.
    flow_control: Arc<FlowControl>,
    /// The check of the transfers of a disaggregated route (`settings.prefill`).
    transfers: Option<TransferCheck>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("models", &self.models.load())
            .field("source", &self.settings.source)
            .field("members", &self.members.load().len())
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Builds the pool: a live state per backend, a retry budget holding `min_retries`, and no
    /// admission control until one is installed.
    pub fn new(mut settings: PoolSettings) -> Self {
        let seed = match &settings.balancing {
            Balancing::Ttft(ttft) => ttft.prefill_tokens_per_second,
            _ => DEFAULT_PREFILL_SPEED,
        };
        let session_table = settings
            .sessions
            .as_ref()
            .map(|s| SessionTable::new(s.capacity, s.idle_ttl));
        // A pool's name is letters, digits, `-` and `_` (checked with the config).
        let name_value = http::HeaderValue::from_str(&settings.name)
            .unwrap_or_else(|_| http::HeaderValue::from_static("-"));
        Self {
            name: Arc::from(settings.name.as_str()),
            name_value,
            models: ArcSwap::from_pointee(settings.models.clone()),
            adapters: ArcSwap::from_pointee(Vec::new()),
            strategy: select::strategy_for(&settings.balancing),
            members: ArcSwap::from_pointee(first_members(settings.backends.clone(), seed)),
            updating: Mutex::new(()),
            changes: tokio::sync::watch::channel(0).0,
            prefill_seed: seed,
            retry_budget: RetryBudget::new(&settings.retry),
            prefix: ArcSwapOption::new(settings.prefix.take()),
            admission: OnceLock::new(),
            prompt_scale: AtomicU64::new(PROMPT_SCALE_ONE),
            session_table,
            departed: Mutex::new(std::collections::VecDeque::new()),
            waiting_room: ArcSwap::from_pointee(WaitingRoom::default()),
            successor: Mutex::new(std::sync::Weak::new()),
            flow_control: Arc::new(FlowControl::new(settings.fairness.clone())),
            transfers: settings.prefill.clone().map(TransferCheck::new),
            settings,
        }
    }

    /// A member measured its prefill speed: the members that have measured none take it
    /// (see [`BackendLive::adopt_prefill_speed`]).
    pub fn share_prefill_speed(&self, tokens_per_second: f64) {
        for member in self.members().iter() {
            member.live.adopt_prefill_speed(tokens_per_second);
        }
    }

    /// The route's check of its transfers, when the pool decodes for a prefill pool
    /// (`prefill`).
    pub fn transfer_check(&self) -> Option<&TransferCheck> {
        self.transfers.as_ref()
    }

    /// The pool's tokenizer and exact prefix index (`tokenizer` and `kv_events`), if set.
    pub fn prefix(&self) -> Option<Arc<PrefixRouting>> {
        self.prefix.load_full()
    }

    /// The pool's backends now: a snapshot, cheap to take, that an update does not change.
    pub fn members(&self) -> Guard<Arc<Members>> {
        self.members.load()
    }

    /// The live state of the backend at `index` of [`Pool::members`] now.
    pub fn live_at(&self, index: usize) -> Option<Arc<BackendLive>> {
        self.members().get(index).map(|e| Arc::clone(&e.live))
    }

    /// The one door through which the backends change: a source now lists `wanted`.
    /// Addresses kept keep what is known about them; new ones join and warm up; ones no
    /// longer listed as ready drain (see `crate::members`). Returns what changed.
    pub fn update(&self, wanted: &[Wanted]) -> Change {
        let _one_at_a_time = self.updating.lock().unwrap_or_else(|e| e.into_inner());
        let seed = self.prefill_seed;
        let mut departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        departed.retain(|(_, _, left)| left.elapsed() < RETURN_WINDOW);
        let now = self.members.load();
        let (next, change) = now.updated(wanted, |addr| {
            match departed.iter().position(|(a, _, _)| *a == addr) {
                Some(i) => departed
                    .remove(i)
                    .map_or_else(|| fresh_live(seed), |(_, live, _)| live),
                None => fresh_live(seed),
            }
        });
        if !change.is_empty() {
            remember_departed(&mut departed, &now, &next);
            self.members.store(Arc::new(next));
            self.changes.send_modify(|n| *n += 1);
        }
        change
    }

    /// Removes the draining backends that have nothing running any more; returns their
    /// addresses. Called on a tick by whoever runs the pool's discovery.
    pub fn sweep(&self) -> Vec<String> {
        let _one_at_a_time = self.updating.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.members.load();
        let Some((next, left)) = now.swept() else {
            return Vec::new();
        };
        let mut departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        remember_departed(&mut departed, &now, &next);
        self.members.store(Arc::new(next));
        self.changes.send_modify(|n| *n += 1);
        left
    }

    /// Takes over what `old` (this pool in the generation a reload replaces) knows: the live
    /// state of every backend both have, and, for a pool that starts without backends (a
    /// discovered one), `old`'s backends themselves until its source answers; and its
    /// waiting room, whose requests are sent by this generation (see [`Pool::usable_backend`]).
    pub fn inherit(self: &Arc<Self>, old: &Pool) {
        let _one_at_a_time = self.updating.lock().unwrap_or_else(|e| e.into_inner());
        let theirs = old.members();
        let mine = self.members.load();
        let list: Vec<Member> = if mine.is_empty() {
            theirs.iter().cloned().collect()
        } else {
            mine.iter()
                .map(|m| match theirs.find(m.spec.resolved) {
                    // With its session slot, which the inherited sessions name it by.
                    Some(old) => Member {
                        live: Arc::clone(&old.live),
                        slot: old.slot,
                        ..m.clone()
                    },
                    None => Member {
                        slot: 0,
                        ..m.clone()
                    },
                })
                .collect()
        };
        let mut list = list;
        members::give_slots(&mut list);
        self.members.store(Arc::new(Members::new(list)));
        // What the pool learned: the engines' cached blocks (while the tokenizer and the
        // events' source are the same), its sessions, its prompt scale.
        if let (Some(mine), Some(theirs)) = (self.prefix(), old.prefix()) {
            if mine.same_index_as(&theirs) {
                // Less the backends this generation no longer has (no subscriber follows
                // them any more, nor removes them).
                let now = self.members.load();
                for gone in members_gone(&old.members(), &now) {
                    theirs.index.remove(gone);
                }
                self.prefix.store(Some(theirs));
            }
        }
        if let (Some(mine), Some(theirs)) = (&self.session_table, &old.session_table) {
            mine.copy_from(theirs);
        }
        self.prompt_scale
            .store(old.prompt_scale.load(Relaxed), Relaxed);
        self.waiting_room.store(old.waiting_room.load_full());
        self.flow_control.inherit(&old.flow_control);
        if let (Some(mine), Some(theirs)) = (&self.transfers, &old.transfers) {
            mine.inherit(theirs);
        }
        *old.successor.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(self);
        self.changes.send_modify(|n| *n += 1);
    }

    /// Tells of each change of the backends (a counter), for whoever follows them.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// `call`'s demand as this pool balances: with the prompt-prefix hash when the pool uses
    /// prefix affinity.
    pub fn demand_for(&self, call: &LlmCall) -> Demand {
        call.demand_with_prefix(self.settings.balancing.prefix_affinity())
    }

    /// The pool's name as an `x-sluice-pool` header value.
    pub fn header_value(&self) -> http::HeaderValue {
        self.name_value.clone()
    }

    /// Whether the pool's model can serve `call` at all: it supports what the request asks
    /// for, and its context holds the request. Asked wherever a pool is chosen (the first
    /// draft, a fallback draft, a reroute), so that no choice sends a request where it can
    /// only be refused.
    pub fn fit(&self, call: &LlmCall) -> Result<(), Unfit> {
        let (request, supports) = (&call.request, self.settings.supports);
        let wants_tools = request.tools.as_ref().is_some_and(|t| !t.is_empty());
        let wants_best_of =
            request.best_of.is_some_and(|n| n > 1) || request.use_beam_search == Some(true);
        let supported = (supports.tools || !wants_tools)
            && (supports.logprobs || !request.asks_for_logprobs())
            && (supports.multiple_choices || request.n.unwrap_or(1) <= 1)
            && (supports.best_of || !wants_best_of);
        if !supported {
            return Err(Unfit::Unsupported);
        }
        let context = self
            .prompt_tokens(call.demand.prompt_tokens)
            .saturating_add(call.demand.output_tokens);
        let too_long = self
            .settings
            .max_model_len
            .is_some_and(|max| context > u64::from(max));
        if too_long {
            return Err(Unfit::TooLong);
        }
        Ok(())
    }

    /// The prompt tokens this pool's tokenizer makes of `estimate` (a request's
    /// [`Demand::prompt_tokens`]): the estimate counts about four bytes a token, and real
    /// tokenizers make 2.5-3 bytes a token of code, numbers and most languages; the scale is
    /// learned from what the pool's answers report ([`Pool::learn_prompt_tokens`]).
    pub fn prompt_tokens(&self, estimate: u64) -> u64 {
        let scale = self.prompt_scale.load(Relaxed);
        u64::try_from(u128::from(estimate) * u128::from(scale) / u128::from(PROMPT_SCALE_ONE))
            .unwrap_or(u64::MAX)
    }

    /// Learns the pool's prompt scale from one answer: `estimated` prompt tokens were
    /// `reported` by the engine (`usage.prompt_tokens`). A moving average, bounded, so that
    /// one odd prompt (mostly token ids, say) moves it little; prompts too short to say
    /// anything (the template's own tokens dominate) are skipped.
    pub fn learn_prompt_tokens(&self, estimated: u64, reported: u64) {
        if estimated < MIN_PROMPT_TO_LEARN {
            return;
        }
        let ratio = (reported.saturating_mul(PROMPT_SCALE_ONE) / estimated)
            .clamp(PROMPT_SCALE_ONE / 2, PROMPT_SCALE_ONE * 4);
        // Two answers learning at once may lose one sample: harmless for an average.
        let old = self.prompt_scale.load(Relaxed);
        let new = (old * 3 + ratio) / 4;
        self.prompt_scale.store(new, Relaxed);
    }

    /// The learned prompt scale: the pool's tokens per estimated token.
    pub fn prompt_scale(&self) -> f64 {
        self.prompt_scale.load(Relaxed) as f64 / PROMPT_SCALE_ONE as f64
    }

    /// Whether `addr` is one of the pool's backends now.
    pub fn has_backend(&self, addr: SocketAddr) -> bool {
        self.members().iter().any(|m| m.spec.resolved == addr)
    }

    /// The Pingora peer for `backend`, with this pool's timeouts.
    pub fn peer(&self, backend: SocketAddr) -> HttpPeer {
        let mut peer = HttpPeer::new(
            backend,
            self.settings.tls_sni.is_some(),
            self.settings.tls_sni.clone().unwrap_or_default(),
        );
        let options = &mut peer.options;
        options.connection_timeout = Some(self.settings.timeouts.connect);
        options.total_connection_timeout = Some(self.settings.timeouts.connect);
        options.read_timeout = Some(self.settings.timeouts.first_byte);
        options.write_timeout = Some(self.settings.timeouts.first_byte);
        options.idle_timeout = Some(self.settings.timeouts.keepalive_idle);
        peer
    }
}

/// Why a pool cannot serve a request at all, whatever its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfit {
    /// The request asks for what the pool's model does not support (its `supports`).
    Unsupported,
    /// The prompt and the output budget exceed the model's `max_model_len`.
    TooLong,
}

/// The first members of a pool: its configured backends, there from the start.
fn first_members(backends: Vec<BackendSpec>, seed: f64) -> Members {
    let mut list: Vec<Member> = backends
        .into_iter()
        .map(|spec| Member {
            key: members::address_key(spec.resolved),
            spec,
            live: fresh_live(seed),
            membership: members::Membership::Ready,
            joined: None,
            slot: 0,
        })
        .collect();
    members::give_slots(&mut list);
    Members::new(list)
}

/// The addresses `before` has that `after` does not.
fn members_gone(before: &Members, after: &Members) -> Vec<SocketAddr> {
    before
        .iter()
        .map(|m| m.spec.resolved)
        .filter(|addr| after.find(*addr).is_none())
        .collect()
}

/// Keeps the state of the backends of `before` that `after` no longer has, for their return.
fn remember_departed(
    departed: &mut std::collections::VecDeque<(SocketAddr, Arc<BackendLive>, Instant)>,
    before: &Members,
    after: &Members,
) {
    for gone in before
        .iter()
        .filter(|m| after.find(m.spec.resolved).is_none())
    {
        departed.push_back((gone.spec.resolved, Arc::clone(&gone.live), Instant::now()));
    }
    while departed.len() > MAX_DEPARTED {
        departed.pop_front();
    }
}

/// A backend's live state as it joins: nothing known, its prefill speed seeded.
fn fresh_live(seed: f64) -> Arc<BackendLive> {
    let live = BackendLive::default();
    live.seed_prefill_speed(seed);
    Arc::new(live)
}

/// All pools, in config order, with the model → pool map the router uses.
#[derive(Debug, Default)]
pub struct Pools {
    pools: Vec<Arc<Pool>>,
}

impl Pools {
    /// The pools in config order, which [`Pools::for_model`] and [`Pools::default_pool`] rely on.
    pub fn new(pools: Vec<Arc<Pool>>) -> Self {
        Self { pools }
    }

    /// Every pool, in config order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.pools.iter()
    }

    /// The pool named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| &*p.name == name)
    }

    /// Whether some pool learns its models from its backends: the model list then changes.
    pub fn any_auto_models(&self) -> bool {
        self.pools.iter().any(|p| p.settings.auto_models)
    }

    /// The first pool (in config order) that serves `model`.
    pub fn for_model(&self, model: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| p.serves(model))
    }

    /// The pool for requests that name no model: the first one.
    pub fn default_pool(&self) -> Option<&Arc<Pool>> {
        self.pools.first()
    }
}

#[cfg(test)]
mod tests;
