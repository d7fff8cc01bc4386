//! Balancing by predicted time to first token: the candidate whose prefill backlog, plus this
//! prompt less what its prefix cache holds, takes the least time at its learned prefill
//! speed; for an `exploration` share of requests, a random candidate with nothing ahead of
//! the request, so that every backend's speed keeps being learned.

use super::{Choice, Pick, Strategy, ADAPTER_LOAD};
use crate::health::BackendLive;
use crate::members::Members;
use crate::pool::{Pool, TtftBalancing};
use crate::prefix::Credit;
use sluice_llm::Demand;

/// The prompt size the per-backend predicted TTFT (`/status`, metrics) is given for.
pub const REFERENCE_PROMPT_TOKENS: u64 = 1_000;

/// What a predicted TTFT adds for a backend whose KV cache cannot take the request now: it
/// would wait in the engine's queue for running requests to finish, for an unknown time.
const KV_FULL_WAIT: f64 = 5.0;

/// `balancing.strategy: ttft`, with its settings.
pub(super) struct Ttft(pub(super) TtftBalancing);

impl Strategy for Ttft {
    /// The usable backend, not in `tried`, with the least predicted time to first token;
    /// a random one for an `exploration` share of requests. A session's backend is credited
    /// with what its last turn left cached there, so a turn moves only when the predicted
    /// time elsewhere, recompute included, is lower.
    fn choose(
        &self,
        pool: &Pool,
        m: &Choice<'_>,
        demand: &Demand,
        credit: &Credit,
    ) -> Option<Pick> {
        let ttft = &self.0;
        let n = m.members.len();
        let count = m.candidates().count();
        if count == 0 {
            return None;
        }
        // Exploring costs little when no backend holds the prompt (it is prefilled whole
        // wherever it goes); when one does, it would throw the cache away. It goes only
        // where nothing is ahead of the request: only there does a first token teach the
        // speed, and a short request explored onto a backend that has just taken a long
        // prompt would wait for that whole prefill (the tail it is the selector's job to
        // avoid).
        let explores =
            count > 1 && ttft.exploration > 0.0 && !credit.any_exact() && m.session.is_none();
        if explores && fastrand::f64() < ttft.exploration {
            let mut idle = m
                .candidates()
                .filter(|&i| m.members.get(i).is_some_and(|e| e.live.nothing_ahead()));
            let idle_count = idle.clone().count();
            if idle_count > 0 {
                return idle.nth(fastrand::usize(..idle_count)).map(Pick::only);
            }
        }
        let home = pool.prefix_home(m, demand);
        // From a random start, so that ties rotate rather than pile onto the first backend.
        let start = fastrand::usize(..n);
        let mut best: Option<(usize, f64)> = None;
        let mut runner_up: Option<(usize, f64)> = None;
        for i in (0..n).map(|k| (start + k) % n) {
            if !m.candidate(i) {
                continue;
            }
            let cached = pool.expected_hits(m, i, demand, credit, home);
            let mut cost = ttft_cost(pool, m.members, i, demand, cached);
            if m.loads_adapter(i) {
                cost += ADAPTER_LOAD;
            }
            match best {
                Some((_, b)) if cost >= b => {
                    if runner_up.is_none_or(|(_, r)| cost < r) {
                        runner_up = Some((i, cost));
                    }
                }
                _ => {
                    runner_up = best;
                    best = Some((i, cost));
                }
            }
        }
        best.map(|(index, _)| Pick { index, runner_up })
    }

    fn weighs_sessions(&self) -> bool {
        true
    }
}

/// The predicted time to first token of `demand` on backend `index` (seconds), its
/// prefix cache credited with `cached` prompt tokens (the exact index's count, or the
/// approximate affinity's guess for the prefix's home): so a backend that holds the
/// prefix keeps the request only while the wait it adds is less than the prefill its
/// cache saves. A backend whose KV cache cannot take the request also waits for room.
fn ttft_cost(pool: &Pool, members: &Members, index: usize, demand: &Demand, cached: u64) -> f64 {
    let Some(live) = members.get(index).map(|e| &e.live) else {
        return f64::MAX;
    };
    let mut cost = live.predicted_ttft(demand.prompt_tokens, cached, &pool.settings.health);
    let outlook = live.outlook(&pool.settings.health);
    let full = outlook
        .projected_kv_counting_stale(pool.settings.health.stale_as)
        .is_some_and(|kv| kv >= 1.0)
        || outlook
            .free_kv_tokens()
            .is_some_and(|free| free < demand.tokens() as f64);
    if full {
        cost += KV_FULL_WAIT;
    }
    cost
}

impl Pool {
    /// The time to first token a [`REFERENCE_PROMPT_TOKENS`] prompt may expect on backend
    /// `live` now, in seconds (`/status` and the metrics).
    pub fn reference_ttft(&self, live: &BackendLive) -> f64 {
        live.predicted_ttft(REFERENCE_PROMPT_TOKENS, 0, &self.settings.health)
    }

    /// The wait a new request is predicted to find ahead of it on backend `live` now,
    /// before its own prefill, in seconds (`/status` and the dashboard).
    pub fn predicted_queue(&self, live: &BackendLive) -> f64 {
        let wait = live.wait_ahead(REFERENCE_PROMPT_TOKENS, &self.settings.health);
        live.wait_tokens(wait) / live.prefill_speed()
    }
}
