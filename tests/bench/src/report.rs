//! Results: per-round series, medians and spreads, the Markdown tables and the targets.

use std::fmt::Write as _;

use crate::contenders::Contender;

/// One number per round.
#[derive(Clone, Debug, Default)]
pub struct Series(pub Vec<f64>);

impl Series {
    pub fn push(&mut self, v: f64) {
        self.0.push(v);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.0.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    pub fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// Whether there are rounds and every one of them is a number: a round that measured
    /// nothing (NaN, or a ratio over zero) leaves a check on every round without a verdict.
    pub fn all_finite(&self) -> bool {
        !self.0.is_empty() && self.0.iter().all(|x| x.is_finite())
    }

    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// "median (min–max)" with `decimals`.
    pub fn show(&self, decimals: usize) -> String {
        if self.0.is_empty() {
            return "–".into();
        }
        if self.0.len() == 1 {
            return format!("{:.*}", decimals, self.median());
        }
        format!(
            "{:.*} ({:.*}–{:.*})",
            decimals,
            self.median(),
            decimals,
            self.min(),
            decimals,
            self.max()
        )
    }
}

/// Per-round differences or ratios between two series of the same run.
pub fn pairwise(a: &Series, b: &Series, f: impl Fn(f64, f64) -> f64) -> Series {
    Series(a.0.iter().zip(&b.0).map(|(x, y)| f(*x, *y)).collect())
}

/// How a scenario ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Done,
    Pending(String),
    Failed(String),
}

/// How far a kind of figure moves between two full runs on this machine, as the full runs
/// in RESULTS.md measured it. A verdict needs the median clear of its bound by that much: a
/// figure closer to its bound than the runs' own spread is SPLIT, since another run on another
/// day could put it on the other side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Noise {
    /// Counted outcomes (errors, lost requests, gaps): no margin.
    Exact,
    /// Instructions under callgrind: within 2 % between rounds and runs.
    Count,
    /// CPU per request, throughput and memory: 3 to 10 % between full runs (bare Pingora's CPU
    /// per request 45.9 µs in one run, 48.9 µs in the next, on the same machine).
    Share,
    /// Latency tails and their ratios (p99s, a few ms added): a factor of 2 to 4 between full
    /// runs (scenario 3's added TTFT p99 3.2 ms in one run and 1.2 ms in the next, scenario
    /// 13's follower lag 10.0 and 2.7 ms, scenario 17's 2.3 and 0.8 ms). With 3×, no target of
    /// the three full runs of 2026-11-28 and -30 is PASS in one and MISS in the next.
    Tail,
}

impl Noise {
    /// The factor a median must clear its bound by.
    fn factor(self) -> f64 {
        match self {
            Noise::Exact => 1.0,
            Noise::Count => 1.02,
            Noise::Share => 1.10,
            Noise::Tail => 3.0,
        }
    }

    /// The margin as the "wanted" column shows it.
    fn margin(self) -> &'static str {
        match self {
            Noise::Exact => "",
            Noise::Count => ", clear by 2 %",
            Noise::Share => ", clear by 10 %",
            Noise::Tail => ", clear by 3×",
        }
    }
}

/// Which side of a bound a figure lies on, with its margin.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    /// Within the bound by the margin.
    Within,
    /// Past the bound by the margin.
    Past,
    /// Nearer the bound than the margin: the noise could put it on either side.
    Close,
}

/// A bound and its direction.
#[derive(Clone, Copy, Debug)]
enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Bound {
    fn holds(self, x: f64) -> bool {
        match self {
            Bound::AtMost(b) => x <= b,
            Bound::AtLeast(b) => x >= b,
        }
    }

    /// Where `x` lies. A bound at or below zero (a count that must be 0) takes no margin.
    fn side(self, x: f64, noise: Noise) -> Side {
        let f = noise.factor();
        let (within, past) = match self {
            Bound::AtMost(b) if b > 0.0 => (x <= b / f, x > b * f),
            Bound::AtLeast(b) if b > 0.0 => (x >= b * f, x < b / f),
            _ => (self.holds(x), !self.holds(x)),
        };
        match (within, past) {
            (true, _) => Side::Within,
            (_, true) => Side::Past,
            _ => Side::Close,
        }
    }

    fn show(self, unit: &str) -> String {
        match self {
            Bound::AtMost(b) => format!("≤ {b} {unit}"),
            Bound::AtLeast(b) => format!("≥ {b} {unit}"),
        }
    }
}

/// A target and what was measured against it.
#[derive(Clone, Debug)]
pub struct Check {
    pub what: String,
    pub target: String,
    pub actual: String,
    /// `None` when it could not be judged (a contender was unavailable, or the noise could
    /// put it on either side: see [`Check::at_most_rounds`]).
    pub pass: Option<bool>,
    /// Its rounds fell on both sides of the bound, or its median lies nearer the bound than
    /// its [`Noise`]: the machine's noise decides, not Sluice.
    pub split: bool,
}

impl Check {
    pub fn new(what: &str, target: &str, actual: String, pass: Option<bool>) -> Check {
        Check {
            what: what.into(),
            target: target.into(),
            actual,
            pass,
            split: false,
        }
    }

    /// Every round of `rounds` against an upper bound: PASS when every round is within it
    /// and the median clears it by the `noise` margin, MISS when every round is over it and
    /// the median past it by the margin, SPLIT (no verdict) otherwise. A verdict on the median
    /// alone flips with the machine's noise.
    pub fn at_most_rounds(
        what: &str,
        rounds: &Series,
        bound: f64,
        unit: &str,
        noise: Noise,
    ) -> Check {
        Check::every_round(what, rounds, Bound::AtMost(bound), unit, noise)
    }

    /// Every round of `rounds` against a lower bound, as [`Check::at_most_rounds`] judges an
    /// upper one.
    pub fn at_least_rounds(
        what: &str,
        rounds: &Series,
        bound: f64,
        unit: &str,
        noise: Noise,
    ) -> Check {
        Check::every_round(what, rounds, Bound::AtLeast(bound), unit, noise)
    }

    fn every_round(what: &str, rounds: &Series, bound: Bound, unit: &str, noise: Noise) -> Check {
        let wanted = format!("{}, every round{}", bound.show(unit), noise.margin());
        let held = rounds.0.iter().filter(|x| bound.holds(**x)).count();
        let (all, none) = (held == rounds.0.len(), held == 0);
        let median = bound.side(rounds.median(), noise);
        let verdict = match (all, none, median) {
            (true, _, Side::Within) => Some(true),
            (_, true, Side::Past) => Some(false),
            _ => None,
        };
        Check::judged(
            what,
            wanted,
            format!("{} {unit}", rounds.show(3)),
            rounds.all_finite(),
            verdict,
        )
    }

    /// One figure against an upper bound: PASS when it clears the bound by the `noise`
    /// margin, MISS when past it by the margin, SPLIT between.
    pub fn at_most(what: &str, value: f64, bound: f64, unit: &str, noise: Noise) -> Check {
        Check::one(what, value, Bound::AtMost(bound), unit, noise)
    }

    /// One figure against a lower bound, as [`Check::at_most`] judges an upper one.
    pub fn at_least(what: &str, value: f64, bound: f64, unit: &str, noise: Noise) -> Check {
        Check::one(what, value, Bound::AtLeast(bound), unit, noise)
    }

    fn one(what: &str, value: f64, bound: Bound, unit: &str, noise: Noise) -> Check {
        let verdict = match bound.side(value, noise) {
            Side::Within => Some(true),
            Side::Past => Some(false),
            Side::Close => None,
        };
        Check::judged(
            what,
            format!("{}{}", bound.show(unit), noise.margin()),
            format!("{value:.3} {unit}"),
            value.is_finite(),
            verdict,
        )
    }

    /// A figure known only to lie in `(low, high]` (a histogram's bucket) against an upper
    /// bound: PASS when `high` clears it by the margin, MISS when `low` is past it by the
    /// margin, SPLIT between.
    pub fn at_most_in(
        what: &str,
        (low, high): (f64, f64),
        bound: f64,
        unit: &str,
        noise: Noise,
    ) -> Check {
        let bound = Bound::AtMost(bound);
        let verdict = match (bound.side(high, noise), bound.side(low, noise)) {
            (Side::Within, _) => Some(true),
            (_, Side::Past) => Some(false),
            _ => None,
        };
        Check::judged(
            what,
            format!("{}{}", bound.show(unit), noise.margin()),
            format!("{low:.3}–{high:.3} {unit}"),
            low.is_finite() && !high.is_nan(),
            verdict,
        )
    }

    /// No verdict when nothing was measured; SPLIT when measured but not decided.
    fn judged(
        what: &str,
        wanted: String,
        actual: String,
        measured: bool,
        verdict: Option<bool>,
    ) -> Check {
        let mut check = Check::new(what, &wanted, actual, verdict.filter(|_| measured));
        check.split = measured && verdict.is_none();
        check
    }

    /// The same check with `actual` shown instead of the bare figure (a ratio with what it
    /// was taken of).
    pub fn showing(mut self, actual: String) -> Check {
        self.actual = actual;
        self
    }

    pub fn verdict(&self) -> &'static str {
        match self.pass {
            Some(true) => "PASS",
            Some(false) => "MISS",
            None if self.split => "SPLIT",
            None => "n/a",
        }
    }
}

/// What one contender did in a scenario, over all rounds (for the smoke test).
#[derive(Clone, Debug)]
pub struct Measured {
    pub contender: Contender,
    pub requests: u64,
    pub errors: u64,
    pub first_error: Option<String>,
}

/// A table of a scenario after its main one, under a caption of its own (scenario 22 shows
/// its fleet's rounds and its idle CPU, which share no columns).
#[derive(Clone, Debug)]
pub struct Table {
    pub caption: String,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// A scenario's results.
#[derive(Clone, Debug)]
pub struct ScenarioReport {
    pub id: u8,
    pub title: String,
    pub outcome: Outcome,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// More tables, shown after the main one.
    pub tables: Vec<Table>,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    pub measured: Vec<Measured>,
}

impl ScenarioReport {
    pub fn new(id: u8, title: &str) -> ScenarioReport {
        ScenarioReport {
            id,
            title: title.into(),
            outcome: Outcome::Done,
            header: Vec::new(),
            rows: Vec::new(),
            tables: Vec::new(),
            checks: Vec::new(),
            notes: Vec::new(),
            measured: Vec::new(),
        }
    }

    pub fn pending(id: u8, title: &str, why: &str) -> ScenarioReport {
        let mut r = ScenarioReport::new(id, title);
        r.outcome = Outcome::Pending(why.into());
        r
    }

    pub fn measured(
        &mut self,
        contender: Contender,
        requests: u64,
        errors: u64,
        first_error: Option<String>,
    ) {
        match self.measured.iter_mut().find(|m| m.contender == contender) {
            Some(m) => {
                m.requests += requests;
                m.errors += errors;
                if m.first_error.is_none() {
                    m.first_error = first_error;
                }
            }
            None => self.measured.push(Measured {
                contender,
                requests,
                errors,
                first_error,
            }),
        }
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "### {}. {}\n", self.id, self.title);
        match &self.outcome {
            Outcome::Pending(why) => {
                let _ = writeln!(s, "pending: {why}\n");
                return s;
            }
            Outcome::Failed(why) => {
                let _ = writeln!(s, "**failed**: {why}\n");
            }
            Outcome::Done => {}
        }
        if !self.header.is_empty() {
            s.push_str(&table(&self.header, &self.rows));
            s.push('\n');
        }
        for t in &self.tables {
            let _ = writeln!(s, "{}\n", t.caption);
            s.push_str(&table(&t.header, &t.rows));
            s.push('\n');
        }
        for n in &self.notes {
            let _ = writeln!(s, "- {n}");
        }
        if !self.notes.is_empty() {
            s.push('\n');
        }
        if !self.checks.is_empty() {
            let header = ["target", "wanted", "measured", ""]
                .map(String::from)
                .to_vec();
            let rows: Vec<Vec<String>> = self
                .checks
                .iter()
                .map(|c| {
                    vec![
                        c.what.clone(),
                        c.target.clone(),
                        c.actual.clone(),
                        c.verdict().into(),
                    ]
                })
                .collect();
            s.push_str(&table(&header, &rows));
            s.push('\n');
        }
        s
    }
}

fn table(header: &[String], rows: &[Vec<String>]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "| {} |", header.join(" | "));
    let _ = writeln!(s, "|{}|", vec!["---"; header.len()].join("|"));
    for r in rows {
        let _ = writeln!(s, "| {} |", r.join(" | "));
    }
    s
}

/// The whole run.
#[derive(Clone, Debug)]
pub struct Report {
    pub smoke: bool,
    pub context: Vec<(String, String)>,
    pub scenarios: Vec<ScenarioReport>,
    pub elapsed_secs: f64,
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# Sluice benchmarks{}\n",
            if self.smoke {
                " (smoke run: tiny loads, numbers meaningless)"
            } else {
                ""
            }
        );
        s.push_str(
            "Written by `cargo run --release -p sluice-bench` (see README.md). Each scenario runs \
             its contenders in interleaved rounds; a cell is the median over rounds with the \
             range (min–max) in brackets. Ratios and \"added\" latencies are computed per round \
             against the baseline of the same round, then the median is taken. Absolute numbers \
             are for context: the load generator, the simulator and the proxy share the machine. \
             A target is PASS when every round meets it and the median clears it by the margin its \
             kind of figure moves between full runs (\"clear by\": 2 % for instructions, 10 % for \
             CPU, throughput and memory, 3× for latency tails), MISS when every round misses it \
             and the median is past it by that margin, and SPLIT (no verdict) between: the \
             machine's noise, not Sluice, would decide it.\n\n",
        );
        for (k, v) in &self.context {
            let _ = writeln!(s, "- **{k}**: {v}");
        }
        let _ = writeln!(s, "- **run time**: {:.0} s\n", self.elapsed_secs);
        let _ = writeln!(s, "## Targets\n");
        let header = ["scenario", "target", "wanted", "measured", ""]
            .map(String::from)
            .to_vec();
        let mut rows = Vec::new();
        for sc in &self.scenarios {
            match &sc.outcome {
                Outcome::Pending(why) => rows.push(vec![
                    format!("{}", sc.id),
                    sc.title.clone(),
                    String::new(),
                    format!("pending: {why}"),
                    String::new(),
                ]),
                _ => {
                    for c in &sc.checks {
                        rows.push(vec![
                            format!("{}", sc.id),
                            c.what.clone(),
                            c.target.clone(),
                            c.actual.clone(),
                            c.verdict().into(),
                        ])
                    }
                }
            }
        }
        s.push_str(&table(&header, &rows));
        let _ = writeln!(s, "\n## Scenarios\n");
        for sc in &self.scenarios {
            s.push_str(&sc.markdown());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spread() {
        let s = Series(vec![3.0, 1.0, 2.0]);
        assert_eq!(s.median(), 2.0);
        assert_eq!(s.show(1), "2.0 (1.0–3.0)");
        assert_eq!(Series(vec![1.0, 2.0, 3.0, 10.0]).median(), 2.5);
        let d = pairwise(&Series(vec![2.0, 4.0]), &Series(vec![1.0, 1.0]), |a, b| {
            a - b
        });
        assert_eq!(d.0, vec![1.0, 3.0]);
    }

    #[test]
    fn checks() {
        assert_eq!(
            Check::at_most("x", 0.1, 0.15, "ms", Noise::Exact).verdict(),
            "PASS"
        );
        let rounds = |v: &[f64]| Series(v.to_vec());
        let judged =
            |v: &[f64]| Check::at_most_rounds("x", &rounds(v), 0.15, "ms", Noise::Exact).verdict();
        assert_eq!(judged(&[0.1, 0.12, 0.15]), "PASS");
        assert_eq!(judged(&[0.16, 0.2, 0.3]), "MISS");
        assert_eq!(judged(&[0.1, 0.2, 0.3]), "SPLIT");
        assert_eq!(judged(&[]), "n/a");
        assert_eq!(
            Check::at_least("x", 0.8, 1.0, "×", Noise::Exact).verdict(),
            "MISS"
        );
        let at_least =
            |v: &[f64]| Check::at_least_rounds("x", &rounds(v), 1.0, "×", Noise::Exact).verdict();
        assert_eq!(at_least(&[1.0, 1.2]), "PASS");
        assert_eq!(at_least(&[0.8, 0.9]), "MISS");
        assert_eq!(at_least(&[0.9, 1.1]), at_least(&[1.1, 0.9]));
        assert!(Check::at_least_rounds("x", &rounds(&[0.9, 1.1]), 1.0, "×", Noise::Exact).split);
        assert_eq!(
            judged(&[0.1, f64::NAN]),
            "n/a",
            "a round that measured nothing"
        );
        assert_eq!(
            Check::at_least("x", f64::NAN, 1.0, "×", Noise::Exact).verdict(),
            "n/a"
        );
    }

    #[test]
    fn a_figure_within_its_noise_of_the_bound_is_split() {
        let rounds = |v: &[f64]| Series(v.to_vec());
        // Every round over 1 ms, but the median within 3× of it: another run could pass.
        let tail = |v: &[f64]| Check::at_most_rounds("x", &rounds(v), 1.0, "ms", Noise::Tail);
        assert_eq!(tail(&[1.2, 2.5, 2.9]).verdict(), "SPLIT");
        assert!(tail(&[1.2, 2.5, 2.9]).split);
        assert_eq!(tail(&[3.5, 4.0, 1.1]).verdict(), "MISS");
        assert_eq!(tail(&[0.2, 0.3, 0.9]).verdict(), "PASS");
        assert_eq!(tail(&[0.4, 0.5, 0.9]).verdict(), "SPLIT");
        // CPU ratios: a margin of 10 %, on either side and in either direction.
        let share = |v: f64| Check::at_most("x", v, 1.15, "×", Noise::Share).verdict();
        assert_eq!(
            (share(1.04), share(1.10), share(1.20), share(1.27)),
            ("PASS", "SPLIT", "SPLIT", "MISS")
        );
        let floor = |v: f64| Check::at_least("x", v, 0.8, "×", Noise::Share).verdict();
        assert_eq!(
            (floor(0.89), floor(0.76), floor(0.72)),
            ("PASS", "SPLIT", "MISS")
        );
        // A bound of zero takes no margin: one error is a miss.
        assert_eq!(
            Check::at_most("x", 1.0, 0.0, "", Noise::Tail).verdict(),
            "MISS"
        );
        assert_eq!(
            Check::at_most("x", 0.0, 0.0, "", Noise::Tail).verdict(),
            "PASS"
        );
    }

    #[test]
    fn a_bucket_is_judged_by_both_its_edges() {
        let bucket = |lo, hi| Check::at_most_in("x", (lo, hi), 1.0, "ms", Noise::Tail).verdict();
        assert_eq!(bucket(0.1, 0.25), "PASS");
        assert_eq!(bucket(0.25, 0.5), "SPLIT");
        assert_eq!(
            bucket(2.5, 5.0),
            "SPLIT",
            "the p99 may be 2.6 ms, within 3× of 1 ms"
        );
        assert_eq!(bucket(5.0, 10.0), "MISS");
        assert_eq!(
            bucket(5.0, f64::INFINITY),
            "MISS",
            "the last bucket has no upper edge"
        );
        assert_eq!(bucket(f64::NAN, 0.5), "n/a");
    }
}
