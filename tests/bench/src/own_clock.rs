//! Sluice's own clocks: `sluice_added_seconds{phase}` read from its admin `/metrics` before
//! and after a round. What Sluice adds measured from the outside (its latency less going
//! direct) carries the load generator's and the kernel's noise, which on two shared cores is
//! larger than the targets; Sluice's own time from its body read to its request written, and
//! from a chunk read to its write returning, does not.

use std::net::SocketAddr;

use anyhow::Result;

/// The cumulative buckets of each phase: (upper bound in seconds, count), `+Inf` last.
#[derive(Clone, Debug, Default)]
pub struct OwnClock {
    pub request: Vec<(f64, u64)>,
    pub chunk: Vec<(f64, u64)>,
}

/// A phase of `sluice_added_seconds`.
#[derive(Clone, Copy, Debug)]
pub enum Phase {
    Request,
    Chunk,
}

impl OwnClock {
    /// Sluice's clocks now, from its admin listener.
    pub async fn read(admin: SocketAddr) -> Result<OwnClock> {
        Ok(OwnClock::parse(&crate::fleet::page_of(admin).await?))
    }

    fn parse(page: &str) -> OwnClock {
        OwnClock {
            request: buckets(page, "sluice_added_seconds", Some("phase=\"request\"")),
            chunk: buckets(page, "sluice_added_seconds", Some("phase=\"chunk\"")),
        }
    }

    /// What was counted since `before`, bucket by bucket.
    pub fn since(&self, before: &OwnClock) -> OwnClock {
        let minus = |now: &[(f64, u64)], then: &[(f64, u64)]| {
            now.iter()
                .map(|&(le, n)| {
                    let was = then.iter().find(|(l, _)| *l == le).map_or(0, |(_, n)| *n);
                    (le, n.saturating_sub(was))
                })
                .collect()
        };
        OwnClock {
            request: minus(&self.request, &before.request),
            chunk: minus(&self.chunk, &before.chunk),
        }
    }

    /// Quantile `q` of `phase` in µs, interpolated within its bucket as Prometheus'
    /// `histogram_quantile` does; NaN when nothing was counted or it falls in `+Inf`.
    pub fn quantile_us(&self, phase: Phase, q: f64) -> f64 {
        let buckets = match phase {
            Phase::Request => &self.request,
            Phase::Chunk => &self.chunk,
        };
        let Some(&(_, total)) = buckets.last() else {
            return f64::NAN;
        };
        if total == 0 {
            return f64::NAN;
        }
        let rank = q * total as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(le, count) in buckets {
            if count as f64 >= rank {
                if !le.is_finite() {
                    return f64::NAN;
                }
                let within = (count - below).max(1) as f64;
                let share = ((rank - below as f64) / within).clamp(0.0, 1.0);
                return (lower + (le - lower) * share) * 1e6;
            }
            (lower, below) = (le, count);
        }
        f64::NAN
    }

    /// How many were counted in `phase`.
    pub fn count(&self, phase: Phase) -> u64 {
        let buckets = match phase {
            Phase::Request => &self.request,
            Phase::Chunk => &self.chunk,
        };
        buckets.last().map_or(0, |(_, n)| *n)
    }
}

/// The cumulative buckets of histogram `name` on a metrics page, of its series whose labels
/// hold `label` (every series of it without): (upper bound in seconds, count), `+Inf` last.
pub(crate) fn buckets(page: &str, name: &str, label: Option<&str>) -> Vec<(f64, u64)> {
    let prefix = format!("{name}_bucket{{");
    let mut out = Vec::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix(prefix.as_str()) else {
            continue;
        };
        if label.is_some_and(|label| !rest.contains(label)) {
            continue;
        }
        // The labels come sorted, `le` last: `{phase="chunk",le="0.001"} 12`.
        let Some((_, after)) = rest.split_once("le=\"") else {
            continue;
        };
        let Some((le, count)) = after.split_once('"') else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::INFINITY)
        };
        if let Some(count) = count.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok()) {
            out.push((le, count as u64));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
sluice_added_seconds_bucket{phase=\"request\",le=\"0.00001\"} 0
sluice_added_seconds_bucket{phase=\"request\",le=\"0.00002\"} 50
sluice_added_seconds_bucket{phase=\"request\",le=\"0.00003\"} 100
sluice_added_seconds_bucket{phase=\"request\",le=\"+Inf\"} 100
sluice_added_seconds_bucket{phase=\"chunk\",le=\"0.00001\"} 10
sluice_added_seconds_bucket{phase=\"chunk\",le=\"+Inf\"} 10
";

    #[test]
    fn quantiles_are_interpolated_within_their_bucket() {
        let clock = OwnClock::parse(PAGE);
        assert_eq!(clock.count(Phase::Request), 100);
        // The 50th of 100 is the last of the 10-20 µs bucket; the 75th halfway in 20-30 µs.
        assert!((clock.quantile_us(Phase::Request, 0.5) - 20.0).abs() < 1e-6);
        assert!((clock.quantile_us(Phase::Request, 0.75) - 25.0).abs() < 1e-6);
        let nothing = clock.since(&clock);
        assert_eq!(nothing.count(Phase::Chunk), 0);
        assert!(nothing.quantile_us(Phase::Chunk, 0.99).is_nan());
    }
}
