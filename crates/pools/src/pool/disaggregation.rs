//! Disaggregated prefill (`pools[].prefill`): the pool clients' requests are routed to
//! decodes, and a long prompt is first prefilled on another pool whose engine hands its KV
//! blocks over (vLLM's `NixlConnector`). This module holds the route's settings and its
//! check: every decode leg's usage says how much of its prompt the engine got from the
//! transfer, and a route whose decodes keep recomputing their prompts (P/D that silently
//! does nothing: a 200 all the same) falls back to the decode pool alone until a probe shows
//! the transfers work again.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How the KV blocks move between the legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connector {
    /// vLLM's `NixlConnector`: the prefill answer's `kv_transfer_params` go into the decode leg.
    Nixl,
    /// vLLM's `MooncakeConnector`: the router mints a `transfer_id` for both legs and names
    /// the prefill engine to the decode leg (its bootstrap server, on `bootstrap_port` of
    /// the prefill backend's host, and its engine id, learned there).
    Mooncake {
        /// The port of the prefill engines' bootstrap servers.
        bootstrap_port: u16,
    },
}

impl Connector {
    /// `bootstrap_port` unless set: vLLM's `VLLM_MOONCAKE_BOOTSTRAP_PORT` default.
    pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

    /// The name in config.
    pub fn as_str(self) -> &'static str {
        match self {
            Connector::Nixl => "nixl",
            Connector::Mooncake { .. } => "mooncake",
        }
    }
}

/// What the Mooncake prefill backends' bootstrap servers said: each backend's engine id per
/// data-parallel rank, kept for [`Prefillers::FRESH_FOR`] (an engine that restarts takes a
/// new id), and the rank the next leg goes to.
#[derive(Debug, Default)]
pub struct Prefillers {
    known: Mutex<HashMap<SocketAddr, Learned>>,
    next_rank: AtomicU64,
}

#[derive(Debug)]
struct Learned {
    /// `(rank, engine id)`, by rank.
    ranks: Arc<[(u32, String)]>,
    at: Instant,
}

impl Prefillers {
    /// How long what a bootstrap server said is used.
    pub const FRESH_FOR: Duration = Duration::from_secs(60);

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Learned>> {
        self.known
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The rank and engine id the next leg to `backend` goes to, the ranks taken in turn;
    /// `None` when nothing fresh is known of it.
    pub fn next(&self, backend: SocketAddr) -> Option<(u32, String)> {
        let ranks = {
            let known = self.known();
            let learned = known.get(&backend)?;
            if learned.at.elapsed() >= Self::FRESH_FOR {
                return None;
            }
            Arc::clone(&learned.ranks)
        };
        let turn = self.next_rank.fetch_add(1, Relaxed);
        let len = u64::try_from(ranks.len()).ok().filter(|&n| n > 0)?;
        let index = usize::try_from(turn % len).ok()?;
        ranks.get(index).cloned()
    }

    /// Keeps what `backend`'s bootstrap server said (ranks, by rank), and forgets what went
    /// stale of the others (backends that left the pool).
    pub fn learn(&self, backend: SocketAddr, mut ranks: Vec<(u32, String)>) {
        ranks.sort();
        let mut known = self.known();
        known.retain(|_, learned| learned.at.elapsed() < Self::FRESH_FOR);
        known.insert(
            backend,
            Learned {
                ranks: ranks.into(),
                at: Instant::now(),
            },
        );
    }

    /// Takes `old`'s fresh knowledge (a reload).
    fn copy_from(&self, old: &Prefillers) {
        let theirs = old.known();
        let mut mine = self.known();
        for (backend, learned) in theirs.iter() {
            if learned.at.elapsed() < Self::FRESH_FOR {
                mine.insert(
                    *backend,
                    Learned {
                        ranks: Arc::clone(&learned.ranks),
                        at: learned.at,
                    },
                );
            }
        }
    }

    /// Forgets `backend`'s engine ids: a transfer from it failed (it may have restarted).
    pub fn forget(&self, backend: SocketAddr) {
        self.known().remove(&backend);
    }
}

/// `pools[].prefill`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillRoute {
    /// The pool that prefills.
    pub pool: String,
    /// How the blocks move.
    pub connector: Connector,
    /// The fewest prompt tokens the decode backend would compute (its prefix cache's hits
    /// taken off) for which a prefill leg is sent; below, the decode backend does the
    /// whole request.
    pub min_prefill_tokens: u64,
    /// Of the last [`WINDOW`] checked transfers, this many recomputed makes the route fall
    /// back to the decode pool alone.
    pub fail_after: u32,
    /// How long the route stays fallen back before a request probes it again.
    pub recover_after: Duration,
    /// How long the prefill engine keeps blocks no decode has read (vLLM's
    /// `kv_connector_extra_config.kv_lease_duration`): a refused decode leg's transfer is
    /// handed to its retry only within half of it.
    pub kv_lease_duration: Duration,
}

impl PrefillRoute {
    /// `min_prefill_tokens` unless set.
    pub const DEFAULT_MIN_PREFILL_TOKENS: u64 = 1024;
    /// `fail_after` unless set.
    pub const DEFAULT_FAIL_AFTER: u32 = 3;
    /// `recover_after` unless set.
    pub const DEFAULT_RECOVER_AFTER: Duration = Duration::from_secs(30);
    /// `kv_lease_duration` unless set: vLLM's own default.
    pub const DEFAULT_KV_LEASE_DURATION: Duration = Duration::from_secs(30);

    /// Whether a transfer answered `since` ago may still be read: within half the lease,
    /// which leaves the decode engine the other half to take the request.
    pub fn lease_holds(&self, since: Instant) -> bool {
        since.elapsed() < self.kv_lease_duration / 2
    }
}

/// The transfers a route's health is judged on: the last this many.
pub const WINDOW: u32 = 10;

/// What a decode leg's usage said of its transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferOutcome {
    /// The engine counted most of the prompt as cached: the blocks came.
    Transferred,
    /// The engine computed most of the prompt again: the transfer did nothing.
    Recomputed,
    /// The answer did not say (no usage, or no `prompt_tokens_details`).
    Unverified,
}

impl TransferOutcome {
    /// Every outcome, for the metrics.
    pub const ALL: [TransferOutcome; 3] = [
        TransferOutcome::Transferred,
        TransferOutcome::Recomputed,
        TransferOutcome::Unverified,
    ];

    /// Its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferOutcome::Transferred => "transferred",
            TransferOutcome::Recomputed => "recomputed",
            TransferOutcome::Unverified => "unverified",
        }
    }

    /// Judges a decode leg by its usage: `prompt_tokens` counted, `expected` of them to come
    /// by the transfer (those the decode backend's prefix cache was not predicted to hold),
    /// `created` of them computed into new prefix-cache blocks (vLLM 0.32's
    /// `created_cache_tokens`), or else `cached` of them served without computing. Computing
    /// half or more of what the transfer was to bring is a transfer that did nothing (the
    /// engine recomputes one token at least, and a partial read leaves a tail). vLLM 0.32
    /// reports in `cached_tokens` what the *prefill* engine's cache served
    /// (`remote_prefill_cached_tokens`), as if one engine had served the request, so the
    /// decode engine's own work is read from `created_cache_tokens` where the answer has it;
    /// an engine that counts the transferred tokens as cached says it there.
    pub fn judge(
        prompt_tokens: u64,
        expected: u64,
        created: Option<u64>,
        cached: Option<u64>,
    ) -> TransferOutcome {
        let half = expected.min(prompt_tokens).div_ceil(2).max(1);
        let computed = match (created, cached) {
            (Some(created), _) => created,
            (None, Some(cached)) => prompt_tokens.saturating_sub(cached),
            (None, None) => return TransferOutcome::Unverified,
        };
        if computed >= half {
            TransferOutcome::Recomputed
        } else {
            TransferOutcome::Transferred
        }
    }
}

/// A route's state, as `/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteState {
    /// Long prompts are prefilled on the prefill pool.
    Disaggregated,
    /// Too many transfers did nothing: the decode pool does every request alone.
    FallenBack,
}

impl RouteState {
    /// Its name on `/status`.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteState::Disaggregated => "disaggregated",
            RouteState::FallenBack => "fallen_back",
        }
    }
}

/// The route's recent transfers and whether it is fallen back. Lock-free on the request
/// path but for a fall-back's start and end.
#[derive(Debug)]
pub struct TransferCheck {
    route: PrefillRoute,
    /// The last [`WINDOW`] checked transfers, newest in the lowest bit: 1 recomputed.
    recent: AtomicU16,
    /// Until when the route is fallen back; `None`: it is not.
    fallen_back_until: Mutex<Option<Instant>>,
    transferred: AtomicU64,
    recomputed: AtomicU64,
    unverified: AtomicU64,
    /// The Mooncake prefill engines' ids (empty for NIXL).
    prefillers: Prefillers,
}

impl TransferCheck {
    /// A route with nothing checked yet.
    pub fn new(route: PrefillRoute) -> Self {
        TransferCheck {
            route,
            recent: AtomicU16::new(0),
            fallen_back_until: Mutex::new(None),
            transferred: AtomicU64::new(0),
            recomputed: AtomicU64::new(0),
            unverified: AtomicU64::new(0),
            prefillers: Prefillers::default(),
        }
    }

    /// Takes over what `old` (this route in the generation a reload replaces) found, when
    /// the route is the same: its window, its fall-back, its counts and its prefill engines'
    /// ids. A route that changed starts afresh.
    pub fn inherit(&self, old: &TransferCheck) {
        if self.route != old.route {
            return;
        }
        self.recent.store(old.recent.load(Relaxed), Relaxed);
        *self.fallen_back() = *old.fallen_back();
        for (mine, theirs) in [
            (&self.transferred, &old.transferred),
            (&self.recomputed, &old.recomputed),
            (&self.unverified, &old.unverified),
        ] {
            mine.store(theirs.load(Relaxed), Relaxed);
        }
        self.prefillers.copy_from(&old.prefillers);
    }

    /// What the route knows of its Mooncake prefill engines.
    pub fn prefillers(&self) -> &Prefillers {
        &self.prefillers
    }

    /// The route's settings.
    pub fn route(&self) -> &PrefillRoute {
        &self.route
    }

    fn fallen_back(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.fallen_back_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a request may be disaggregated now: the route is not fallen back, or its
    /// fall-back is over (the route is in use again, judged on a fresh window).
    pub fn open(&self) -> bool {
        let mut until = self.fallen_back();
        self.end_fall_back_if_over(&mut until);
        until.is_none()
    }

    /// Ends a fall-back whose time is over: the window starts afresh, so that no verdict
    /// from before it counts again.
    fn end_fall_back_if_over(&self, until: &mut Option<Instant>) {
        if until.is_some_and(|end| Instant::now() >= end) {
            *until = None;
            self.recent.store(0, Relaxed);
        }
    }

    /// Whether the route is in use or fallen back, now.
    pub fn state(&self) -> RouteState {
        match *self.fallen_back() {
            Some(end) if Instant::now() < end => RouteState::FallenBack,
            _ => RouteState::Disaggregated,
        }
    }

    /// Counts a decode leg's verdict; returns whether it made the route fall back.
    pub fn record(&self, outcome: TransferOutcome) -> bool {
        let counter = match outcome {
            TransferOutcome::Transferred => &self.transferred,
            TransferOutcome::Recomputed => &self.recomputed,
            TransferOutcome::Unverified => &self.unverified,
        };
        counter.fetch_add(1, Relaxed);
        if outcome == TransferOutcome::Unverified {
            return false;
        }
        self.push(outcome == TransferOutcome::Recomputed)
    }

    /// Counts a prefill leg that failed, was refused or answered no transfer parameters: a
    /// transfer that did not happen, in the window (it has no outcome of its own to count).
    pub fn record_failed_leg(&self) -> bool {
        self.push(true)
    }

    /// Pushes one verdict into the window (`failed`: no transfer); returns whether it made
    /// the route fall back.
    fn push(&self, failed: bool) -> bool {
        {
            let mut until = self.fallen_back();
            self.end_fall_back_if_over(&mut until);
            // A verdict of a request sent before the fall-back counts for nothing now.
            if until.is_some() {
                return false;
            }
        }
        let mask = (1u16 << WINDOW) - 1;
        let bit = u16::from(failed);
        let recent = self
            .recent
            .fetch_update(Relaxed, Relaxed, |r| Some(((r << 1) | bit) & mask))
            .map_or(0, |previous| ((previous << 1) | bit) & mask);
        if recent.count_ones() < self.route.fail_after {
            return false;
        }
        let mut until = self.fallen_back();
        if until.is_some() {
            return false;
        }
        *until = Some(Instant::now() + self.route.recover_after);
        true
    }

    /// Recomputed transfers among the last [`WINDOW`] checked.
    pub fn recent_recomputed(&self) -> u32 {
        self.recent.load(Relaxed).count_ones()
    }

    /// Transfers checked since the start: transferred, recomputed, unverified.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.transferred.load(Relaxed),
            self.recomputed.load(Relaxed),
            self.unverified.load(Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(fail_after: u32, recover_after: Duration) -> TransferCheck {
        TransferCheck::new(PrefillRoute {
            pool: "prefill".into(),
            connector: Connector::Nixl,
            min_prefill_tokens: 1024,
            fail_after,
            recover_after,
            kv_lease_duration: PrefillRoute::DEFAULT_KV_LEASE_DURATION,
        })
    }

    #[test]
    fn a_decode_leg_is_judged_by_what_its_engine_computed() {
        // vLLM 0.32, as captured: the transfer came, nothing computed into new blocks; the
        // cached count is the prefill engine's.
        assert_eq!(
            TransferOutcome::judge(669, 669, Some(0), Some(0)),
            TransferOutcome::Transferred
        );
        // The decode engine computed the prompt again (5 blocks of 128).
        assert_eq!(
            TransferOutcome::judge(669, 669, Some(640), Some(0)),
            TransferOutcome::Recomputed
        );
        // A session's turn: 8,000 of 10,000 tokens cached on the decode backend, the 2,000
        // the transfer was to bring computed again.
        assert_eq!(
            TransferOutcome::judge(10_000, 2_000, Some(1_984), Some(0)),
            TransferOutcome::Recomputed
        );
        // An engine that counts what it read as cached, and says nothing of what it made.
        assert_eq!(
            TransferOutcome::judge(4000, 4000, None, Some(3999)),
            TransferOutcome::Transferred
        );
        // A prefix-cache hit of a third, the rest recomputed.
        assert_eq!(
            TransferOutcome::judge(4000, 4000, None, Some(1300)),
            TransferOutcome::Recomputed
        );
        assert_eq!(
            TransferOutcome::judge(4000, 4000, None, None),
            TransferOutcome::Unverified
        );
    }

    #[test]
    fn recomputed_transfers_make_the_route_fall_back_until_a_probe() {
        let c = check(3, Duration::ZERO);
        // Half of them fail: the third failure among the last ten trips it.
        let mut tripped_at = None;
        for i in 1..=10 {
            let outcome = if i % 2 == 0 {
                TransferOutcome::Recomputed
            } else {
                TransferOutcome::Transferred
            };
            if c.record(outcome) {
                tripped_at = Some(i);
                break;
            }
        }
        assert_eq!(tripped_at, Some(6));
        assert_eq!(c.counts(), (3, 3, 0));
        // Its fall-back is over at once here: the next request probes, on a fresh window.
        assert!(c.open());
        assert_eq!(c.recent_recomputed(), 0);
        assert_eq!(c.state(), RouteState::Disaggregated);
    }

    #[test]
    fn a_fallen_back_route_stays_so_for_its_time() {
        let c = check(2, Duration::from_secs(3600));
        assert!(!c.record(TransferOutcome::Recomputed));
        assert!(!c.record(TransferOutcome::Unverified), "not counted");
        assert!(c.record(TransferOutcome::Recomputed));
        assert_eq!(c.state(), RouteState::FallenBack);
        assert!(!c.open());
        assert!(
            !c.record(TransferOutcome::Recomputed),
            "already fallen back"
        );
    }

    #[test]
    fn a_prefill_backend_s_ranks_are_taken_in_turn_while_fresh() {
        let p = Prefillers::default();
        let backend: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert_eq!(p.next(backend), None);
        p.learn(backend, vec![(1, "e1".into()), (0, "e0".into())]);
        let turns: Vec<_> = (0..4).filter_map(|_| p.next(backend)).collect();
        assert_eq!(
            turns,
            [(0, "e0"), (1, "e1"), (0, "e0"), (1, "e1")].map(|(r, e)| (r, e.to_string()))
        );
        p.forget(backend);
        assert_eq!(p.next(backend), None);
    }

    #[test]
    fn a_reload_keeps_a_fallen_back_route_fallen_back_unless_it_changed() {
        let old = check(1, Duration::from_secs(3600));
        assert!(old.record(TransferOutcome::Recomputed));
        let backend: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        old.prefillers().learn(backend, vec![(0, "e0".into())]);
        let same = check(1, Duration::from_secs(3600));
        same.inherit(&old);
        assert_eq!(same.state(), RouteState::FallenBack);
        assert_eq!(same.counts(), (0, 1, 0));
        assert_eq!(same.prefillers().next(backend), Some((0, "e0".into())));
        let changed = check(2, Duration::from_secs(3600));
        changed.inherit(&old);
        assert_eq!(changed.state(), RouteState::Disaggregated);
        assert_eq!(changed.counts(), (0, 0, 0));
    }
}
