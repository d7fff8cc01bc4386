//! KV-aware balancing: the better of two random candidates by projected KV-cache room and
//! queue depth (power of two choices, so that a burst does not herd onto the emptiest one),
//! unless the prefix's home (the exact index's, or the approximate affinity's) is nearly as
//! good.

use super::{Choice, Pick, Strategy, ADAPTER_LOAD_SCORE};
use crate::members::Members;
use crate::pool::Pool;
use crate::prefix::Credit;
use sluice_llm::Demand;

/// How close to the best-of-two score the prefix-affine backend must be to be taken.
const AFFINITY_SLACK: f64 = 0.15;

/// `balancing.strategy: kv_aware`.
pub(super) struct KvAware;

impl Strategy for KvAware {
    fn choose(
        &self,
        pool: &Pool,
        m: &Choice<'_>,
        demand: &Demand,
        credit: &Credit,
    ) -> Option<Pick> {
        let candidates = m.candidates();
        let count = candidates.clone().count();
        let scored = |i: usize| (i, adapter_score(pool, m, i, demand));
        let (best, best_score) = match count {
            0 => return None,
            1 => scored(candidates.clone().next()?),
            // Two random candidates (with two, both, in random order so ties alternate).
            n => {
                let first = fastrand::usize(..n);
                let second = (first + 1 + fastrand::usize(..n - 1)) % n;
                let a = scored(candidates.clone().nth(first)?);
                let b = scored(candidates.clone().nth(second)?);
                if b.1 > a.1 {
                    b
                } else {
                    a
                }
            }
        };
        // Prefix affinity: the prefix's home backend, unless clearly worse: with the exact
        // index, the backend holding most of the prompt; else the approximate affinity's
        // (`demand.affinity` is only set for pools that use it).
        let home = if credit.any_exact() {
            candidates.max_by_key(|&i| {
                m.members
                    .get(i)
                    .and_then(|e| credit.exact(e.spec.resolved))
                    .unwrap_or(0)
            })
        } else {
            demand
                .affinity
                .and_then(|key| candidates.max_by_key(|&i| m.rendezvous(key, i)))
        };
        let index = match home {
            Some(h)
                if h != best
                    && adapter_score(pool, m, h, demand) >= best_score - AFFINITY_SLACK =>
            {
                h
            }
            _ => best,
        };
        Some(Pick::only(index))
    }
}

/// [`score`], lower for a backend that must load the request's adapter first.
fn adapter_score(pool: &Pool, m: &Choice<'_>, index: usize, demand: &Demand) -> f64 {
    let score = score(pool, m.members, index, demand);
    if m.loads_adapter(index) {
        score - ADAPTER_LOAD_SCORE
    } else {
        score
    }
}

/// How good a home backend `index` is for `demand`; higher is better. Free KV cache
/// counts most, and more so for large prompts; queued requests and a cache that cannot
/// hold the request count against it.
fn score(pool: &Pool, members: &Members, index: usize, demand: &Demand) -> f64 {
    let Some(live) = members.get(index).map(|e| &e.live) else {
        return f64::MIN;
    };
    let outlook = live.outlook(&pool.settings.health);
    let Some(projected) = outlook.projected_kv_counting_stale(pool.settings.health.stale_as) else {
        // Nothing known: balance by what this proxy has in flight there.
        return 0.5 - 0.01 * f64::from(live.in_flight());
    };
    let free = (1.0 - projected).max(0.0);
    let kv_weight = 1.0 + (demand.prompt_tokens as f64 / 4096.0).min(3.0);
    // What was sent since the scrape is already in `projected`.
    let mut score = kv_weight * free - 0.05 * outlook.waiting;
    if outlook
        .free_kv_tokens()
        .is_some_and(|free_tokens| free_tokens < demand.tokens() as f64)
    {
        score -= 1.0;
    }
    score
}
