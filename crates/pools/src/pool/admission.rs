//! Whether a pool takes a request now: its headroom ([`Pressure`]), request classes
//! ([`Priority`]), and the [`Admission`] control a plugin (the KV breaker) installs per pool;
//! and how many of its backends may be out at once (ejected or paused).

use super::Pool;
use crate::health::StaleAs;
use std::sync::Arc;

/// A request's class: who is shed first when a pool is under pressure. Written in config
/// files in lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Shed first when a pool comes under pressure.
    Sheddable = 0,
    /// The usual class: shed after sheddable requests.
    Standard = 1,
    /// Shed last.
    Critical = 2,
}

impl Priority {
    /// Every class, lowest first.
    pub const ALL: [Priority; 3] = [Priority::Sheddable, Priority::Standard, Priority::Critical];

    /// The class as written in config, headers and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Sheddable => "sheddable",
            Priority::Standard => "standard",
            Priority::Critical => "critical",
        }
    }

    /// The class named by `s` (a header's value), ignoring case and surrounding spaces; `None`
    /// for an unknown name.
    pub fn parse(s: &str) -> Option<Self> {
        Priority::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
    }
}

/// How much headroom a pool has, from its usable backends' projected KV usage.
///
/// Stale backends (alive, without fresh metrics) are left out of `kv_usage` and counted in
/// `stale`: whether they count as full is the reader's call
/// ([`Pressure::kv_usage_counting_stale`]), so that a monitoring problem (a metrics format the
/// parser does not read) does not by itself make a healthy pool look full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    /// Projected KV usage over the usable backends with fresh metrics (weighted by cache size),
    /// `None` when no backend's usage is known.
    pub kv_usage: Option<f64>,
    /// The backends `kv_usage` is over.
    pub measured: usize,
    /// Backends that may take a request now, stale ones included.
    pub usable: usize,
    /// Usable backends whose metrics are stale: alive, their load unknown.
    pub stale: usize,
    /// The KV cache in tokens of the usable backends that are not stale, when every one of
    /// them publishes its size.
    pub kv_capacity_tokens: Option<f64>,
}

impl Pressure {
    /// The usage with stale backends counted as `stale_as` says: each as a full backend of the
    /// measured ones' average size when [`StaleAs::Saturated`] (1 when all are stale), left out
    /// when [`StaleAs::Unknown`] (that is `kv_usage`).
    pub fn kv_usage_counting_stale(&self, stale_as: StaleAs) -> Option<f64> {
        if stale_as == StaleAs::Unknown || self.stale == 0 {
            return self.kv_usage;
        }
        let stale = self.stale as f64;
        Some(match self.kv_usage {
            Some(usage) => {
                let measured = self.measured as f64;
                (usage * measured + stale) / (measured + stale)
            }
            None => 1.0,
        })
    }

    /// The usage after adding a request that may hold `tokens`: its share of the pool's
    /// cache when the size is known, else the usage as it is.
    #[cfg(test)]
    pub fn with_demand(&self, tokens: u64) -> Option<f64> {
        let usage = self.kv_usage?;
        Some(match self.kv_capacity_tokens {
            Some(capacity) if capacity > 0.0 => usage + tokens as f64 / capacity,
            _ => usage,
        })
    }
}

/// A pool's admission control: the KV breaker installs one per pool at start-up, and anyone
/// who chooses a pool (the speculative selector, a reroute) asks the pool, not the breaker.
///
/// Both answers must come from the pool's live state ([`Pool::pressure`]) on every call:
/// state kept between calls (hysteresis) may only refine that, never stand in for it, or a
/// pool that nobody sends to would keep the answer it had when traffic left it.
pub trait Admission: Send + Sync {
    /// Whether `pool` sheds every request of class `priority` now.
    fn sheds(&self, pool: &Pool, priority: Priority) -> bool;
    /// Whether `pool` takes a request of `priority` that may hold `tokens` KV tokens now.
    fn admits(&self, pool: &Pool, priority: Priority, tokens: u64) -> bool;
}

impl Pool {
    /// Whether one more backend may be ejected: fewer than the pool's
    /// `max_ejection_percent` are out (one always may be).
    pub fn may_eject_another(&self) -> bool {
        let members = self.members();
        let ready = members.iter().filter(|e| e.is_ready());
        let ejected = ready.clone().filter(|e| e.live.is_ejected()).count();
        let share = ready.count() * self.settings.outlier.max_ejection_percent as usize / 100;
        ejected < share.max(1)
    }

    /// Whether one more backend may be paused for its back-pressure (a 429 or 503 with
    /// `Retry-After`): fewer than the pool's `max_ejection_percent` are out, paused or ejected
    /// (one always may be). A backend that asks for a pause while the rest are out keeps
    /// taking requests, and answering its own 429s: the client then hears the upstream's
    /// own `retry-after`, not a 503 of Sluice's.
    pub fn may_pause_another(&self) -> bool {
        let members = self.members();
        let ready = members.iter().filter(|e| e.is_ready());
        let out = ready
            .clone()
            .filter(|e| e.live.is_ejected() || e.live.is_cooling())
            .count();
        let share = ready.count() * self.settings.outlier.max_ejection_percent as usize / 100;
        out < share.max(1)
    }

    /// Whether some backend may take a request now (not unhealthy, ejected or cooling down):
    /// cheaper than [`Pool::pressure`] when that is all one needs to know.
    pub fn has_usable_backend(&self) -> bool {
        self.members()
            .iter()
            .any(|e| e.is_ready() && e.live.is_usable())
    }

    /// The pool's headroom now.
    pub fn pressure(&self) -> Pressure {
        let (mut usable, mut stale, mut measured) = (0, 0, 0);
        let (mut weighted, mut weights) = (0.0, 0.0);
        let mut capacity = Some(0.0);
        let members = self.members();
        for live in members
            .iter()
            .filter(|e| e.is_ready() && e.live.is_usable())
            .map(|e| &e.live)
        {
            usable += 1;
            let outlook = live.outlook(&self.settings.health);
            if outlook.stale {
                stale += 1;
                continue;
            }
            let size = outlook.kv_capacity_tokens;
            capacity = capacity.zip(size).map(|(sum, c)| sum + c);
            if let Some(kv) = outlook.projected_kv {
                let weight = size.unwrap_or(1.0);
                weighted += kv * weight;
                weights += weight;
                measured += 1;
            }
        }
        Pressure {
            kv_usage: (weights > 0.0).then(|| weighted / weights),
            measured,
            usable,
            stale,
            kv_capacity_tokens: capacity.filter(|c| *c > 0.0),
        }
    }

    /// Whether the pool takes a request of class `priority` that may come to hold `tokens`
    /// KV tokens, now. Asked live every time, so an answer reflects the pool's load as
    /// it is, never as it was when someone last looked. Always `true` without admission
    /// control.
    pub fn admits(&self, priority: Priority, tokens: u64) -> bool {
        self.admission
            .get()
            .is_none_or(|gate| gate.admits(self, priority, tokens))
    }

    /// Whether the pool turns away every request of class `priority` now (it is shedding the
    /// class), from its live load.
    pub fn sheds(&self, priority: Priority) -> bool {
        self.admission
            .get()
            .is_some_and(|gate| gate.sheds(self, priority))
    }

    /// Installs the pool's admission control, once, at start-up. `false` when one is
    /// installed already (two plugins cannot both decide).
    pub fn install_admission(&self, gate: Arc<dyn Admission>) -> bool {
        self.admission.set(gate).is_ok()
    }
}
