//! Weighted round robin: the next candidate of Pingora's weighted cycle.

use super::{Choice, Pick, Strategy};
use crate::pool::Pool;
use crate::prefix::Credit;
use sluice_llm::Demand;

/// Weighted round robin (`balancing.strategy: round_robin`).
pub(super) struct RoundRobin;

impl Strategy for RoundRobin {
    /// The next candidate of the weighted cycle: one turn of it at most.
    fn choose(&self, _: &Pool, m: &Choice<'_>, _: &Demand, _: &Credit) -> Option<Pick> {
        m.members
            .round_robin()
            .find(|&i| m.candidate(i))
            .map(Pick::only)
    }
}
