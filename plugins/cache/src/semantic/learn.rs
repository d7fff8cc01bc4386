//! When a semantic neighbour's answer may be served: a threshold per entry, learned from
//! verified outcomes, under the operator's error bound (`max_error_rate`, δ).
//!
//! Every request that goes upstream while a neighbour was found (too far to serve yet, or a
//! served hit sampled for verification) is a labelled example for free: its fresh answer is
//! compared with the neighbour's ([`super::same_answer`]), and `(similarity, right?)` is
//! recorded twice, in the cache-wide table and on the neighbour's entry. The decision, after
//! vCache (Schroeder et al., ICLR 2026), is per entry, not one threshold for all:
//!
//! - **Cache-wide**: the similarity range is cut into bins; for a similarity `s`, the
//!   examples at `s` or above say how often serving everything from `s` up would be wrong.
//!   Its one-sided upper confidence bound (Wilson, at `confidence`) is the prior `r`. It is
//!   not extrapolated: without [`MIN_NEARBY`] examples within [`NEARBY`] above `s`, nothing
//!   is known of `s` (`r` = 1), however good the examples further up.
//! - **Per entry**: assuming an entry's answer is at least as likely right for a closer
//!   question, an example right at a similarity at or below `s` is evidence for serving it at
//!   `s`, and one wrong at or above `s` is evidence against. With `c` of the first and `w` of
//!   the second, the entry's error at `s` is estimated as `(w + k·r) / (c + w + k)`, the
//!   cache-wide bound weighing as `k` examples ([`PRIOR_WEIGHT`]).
//! - The entry is served at `s` when both the cache-wide bound and the entry's estimate are
//!   at most δ. So an entry's own examples only ever make it stricter: one that was wrong
//!   above `s` needs many right examples below it before it serves there again, so entries
//!   in a crowded region (questions that look alike and are not) get thresholds of their
//!   own, above the cache-wide one. An entry's few examples are never taken as proof that it
//!   may serve below the cache-wide threshold: their mean is no upper bound, and the bound
//!   is what is promised.
//!
//! The counts are atomics: deciding takes no lock (one per entry's examples, when recorded).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Mutex;

/// How many examples the cache-wide bound weighs as against an entry's own.
pub const PRIOR_WEIGHT: f64 = 8.0;

/// The examples an entry keeps (the latest; older ones are forgotten).
const ENTRY_EXAMPLES: usize = 32;

/// Bins of the cache-wide table over `[floor, 1]`.
const BINS: usize = 200;

/// How far above a similarity the examples that speak for it may be.
pub const NEARBY: f32 = 0.02;

/// The examples within [`NEARBY`] that a similarity needs before the ones above it speak
/// for it.
pub const MIN_NEARBY: u64 = 8;

/// The cache-wide examples, by similarity.
#[derive(Debug)]
pub struct Table {
    floor: f32,
    /// The one-sided normal quantile of the confidence (1.645 for 95 %).
    z: f64,
    max_error_rate: f64,
    /// How many bins [`NEARBY`] spans.
    nearby_bins: usize,
    seen: [AtomicU32; BINS],
    wrong: [AtomicU32; BINS],
}

/// One entry's own examples.
#[derive(Debug, Default)]
pub struct EntryExamples(Mutex<VecDeque<(f32, bool)>>);

/// What the table says of serving an entry at a similarity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// The estimated probability that the neighbour's answer is wrong.
    pub error: f64,
    /// Whether it is within the bound.
    pub serve: bool,
}

impl Table {
    /// A table for similarities from `floor` up, bounding errors at `max_error_rate` with
    /// `confidence`.
    pub fn new(floor: f32, max_error_rate: f64, confidence: f64) -> Self {
        Self {
            floor,
            z: normal_quantile(confidence),
            max_error_rate,
            nearby_bins: ((NEARBY / ((1.0 - floor) / BINS as f32)).ceil() as usize).max(1),
            seen: std::array::from_fn(|_| AtomicU32::new(0)),
            wrong: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }

    fn bin(&self, similarity: f32) -> usize {
        let span = (1.0 - self.floor).max(f32::EPSILON);
        let at = ((similarity - self.floor) / span * BINS as f32).floor();
        (at.max(0.0) as usize).min(BINS - 1)
    }

    /// Records one verified example, cache-wide and on its entry.
    pub fn record(&self, entry: &EntryExamples, similarity: f32, right: bool) {
        let bin = self.bin(similarity);
        self.seen[bin].fetch_add(1, Relaxed);
        if !right {
            self.wrong[bin].fetch_add(1, Relaxed);
        }
        if let Ok(mut examples) = entry.0.lock() {
            if examples.len() == ENTRY_EXAMPLES {
                examples.pop_front();
            }
            examples.push_back((similarity, right));
        }
    }

    /// The cache-wide upper bound on the error of serving everything from `similarity` up.
    pub fn prior(&self, similarity: f32) -> f64 {
        self.prior_from(self.bin(similarity))
    }

    /// [`Table::prior`] of the similarities of bin `from`.
    fn prior_from(&self, from: usize) -> f64 {
        let (mut seen, mut wrong, mut nearby) = (0u64, 0u64, 0u64);
        for bin in from..BINS {
            let n = u64::from(self.seen[bin].load(Relaxed));
            seen += n;
            wrong += u64::from(self.wrong[bin].load(Relaxed));
            if bin < from + self.nearby_bins {
                nearby += n;
            }
        }
        self.bound(seen, wrong, nearby)
    }

    /// The bound on `wrong` of `seen` examples, `nearby` of them near enough to speak for
    /// the similarity judged: 1 with too few near it.
    fn bound(&self, seen: u64, wrong: u64, nearby: u64) -> f64 {
        if nearby < MIN_NEARBY {
            return 1.0;
        }
        wilson_upper(wrong, seen, self.z)
    }

    /// Whether `entry`'s answer may be served to a question at `similarity`.
    pub fn estimate(&self, entry: &EntryExamples, similarity: f32) -> Estimate {
        let prior = self.prior(similarity);
        let (mut right, mut wrong) = (0u32, 0u32);
        if let Ok(examples) = entry.0.lock() {
            for &(at, was_right) in examples.iter() {
                match was_right {
                    true if at <= similarity => right += 1,
                    false if at >= similarity => wrong += 1,
                    _ => {}
                }
            }
        }
        let own =
            (f64::from(wrong) + PRIOR_WEIGHT * prior) / (f64::from(right + wrong) + PRIOR_WEIGHT);
        let error = own.max(prior);
        Estimate {
            error,
            serve: error <= self.max_error_rate,
        }
    }

    /// The lowest similarity at which an entry with no examples of its own is served, and
    /// the cache-wide error bound there; `None` while no similarity qualifies.
    pub fn threshold(&self) -> Option<(f32, f64)> {
        // The counts from each bin up, in one pass from the top.
        let (mut seen, mut wrong) = ([0u64; BINS + 1], [0u64; BINS + 1]);
        for bin in (0..BINS).rev() {
            seen[bin] = seen[bin + 1] + u64::from(self.seen[bin].load(Relaxed));
            wrong[bin] = wrong[bin + 1] + u64::from(self.wrong[bin].load(Relaxed));
        }
        (0..BINS).find_map(|bin| {
            let nearby = seen[bin] - seen[(bin + self.nearby_bins).min(BINS)];
            let prior = self.bound(seen[bin], wrong[bin], nearby);
            let at = self.floor + (1.0 - self.floor) * bin as f32 / BINS as f32;
            (prior <= self.max_error_rate).then_some((at, prior))
        })
    }

    /// The verified examples so far, and how many were wrong.
    pub fn totals(&self) -> (u64, u64) {
        let sum = |bins: &[AtomicU32; BINS]| bins.iter().map(|b| u64::from(b.load(Relaxed))).sum();
        (sum(&self.seen), sum(&self.wrong))
    }
}

/// The upper end of Wilson's score interval for `wrong` of `seen` at the normal quantile
/// `z`: 1 with no examples.
pub fn wilson_upper(wrong: u64, seen: u64, z: f64) -> f64 {
    if seen == 0 {
        return 1.0;
    }
    let n = seen as f64;
    let p = wrong as f64 / n;
    let z2 = z * z;
    let centre = p + z2 / (2.0 * n);
    let spread = z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre + spread) / (1.0 + z2 / n)).min(1.0)
}

/// The standard normal quantile of `p` (Acklam's rational approximation, |error| < 1.2e-9
/// over (0, 1)): the `z` of a one-sided confidence `p`.
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_and_the_bound_are_the_textbook_ones() {
        assert!((normal_quantile(0.95) - 1.644_853_6).abs() < 1e-6);
        assert!((normal_quantile(0.5)).abs() < 1e-9);
        assert!((normal_quantile(0.999) - 3.090_232_3).abs() < 1e-6);
        // 0 wrong of 100 at 95 %: z²/(n+z²) = 2.7055/102.7055.
        assert!((wilson_upper(0, 100, 1.644_853_6) - 0.026_342).abs() < 1e-5);
        assert_eq!(wilson_upper(0, 0, 1.64), 1.0);
    }

    #[test]
    fn nothing_is_served_before_enough_right_examples() {
        let table = Table::new(0.5, 0.02, 0.95);
        let entry = EntryExamples::default();
        assert!(!table.estimate(&entry, 0.99).serve);
        assert_eq!(table.threshold(), None);
        // 0 wrong of n: the bound reaches 2 % at n ≈ 133.
        let other = EntryExamples::default();
        for _ in 0..140 {
            table.record(&other, 0.95, true);
        }
        assert!(table.estimate(&entry, 0.95).serve);
        assert!(
            !table.estimate(&entry, 0.96).serve,
            "no example at 0.96 or above"
        );
        // Nor below, where there is none nearby.
        assert!(!table.estimate(&entry, 0.9).serve);
        let (at, bound) = table.threshold().unwrap();
        assert!((0.929..=0.95).contains(&at), "{at}");
        assert!(bound <= 0.02);
    }

    #[test]
    fn an_entry_once_wrong_above_a_similarity_is_not_served_there() {
        let table = Table::new(0.5, 0.02, 0.95);
        let (noisy, quiet) = (EntryExamples::default(), EntryExamples::default());
        for i in 0..1000 {
            let similarity = 0.9 + 0.1 * (i as f32 / 1000.0);
            table.record(&EntryExamples::default(), similarity, true);
        }
        table.record(&noisy, 0.97, false);
        assert!(table.estimate(&quiet, 0.93).serve);
        assert!(!table.estimate(&noisy, 0.93).serve);
        // Above its wrong example the entry is judged by the rest again.
        assert!(table.estimate(&noisy, 0.98).serve);
    }

    #[test]
    fn an_entrys_right_examples_wash_out_its_wrong_one_but_never_lower_the_bound() {
        let table = Table::new(0.5, 0.02, 0.95);
        for i in 0..1000 {
            let similarity = 0.9 + 0.1 * (i as f32 / 1000.0);
            table.record(&EntryExamples::default(), similarity, true);
        }
        let noisy = EntryExamples::default();
        table.record(&noisy, 0.97, false);
        assert!(!table.estimate(&noisy, 0.93).serve);
        for _ in 0..60 {
            table.record(&noisy, 0.92, true);
        }
        assert!(table.estimate(&noisy, 0.93).serve);
        // Right examples below the cache-wide threshold do not make it serve there.
        let proven = EntryExamples::default();
        for _ in 0..30 {
            table.record(&proven, 0.7, true);
        }
        assert!(table.prior(0.75) > 0.02);
        assert!(!table.estimate(&proven, 0.75).serve);
    }
}
