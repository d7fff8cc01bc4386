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

/// A target and what was measured against it.
#[derive(Clone, Debug)]
pub struct Check {
    pub what: String,
    pub target: String,
    pub actual: String,
    /// `None` when it could not be judged (a contender was unavailable, or its rounds fell
    /// on both sides of the bound: see [`Check::at_most_rounds`]).
    pub pass: Option<bool>,
    /// The rounds fell on both sides of the bound: the machine's noise decides, not Sluice.
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

    /// Every round of `rounds` against an upper bound: PASS when every round is within it,
    /// MISS when every round is over it, SPLIT (no verdict) when the rounds fall on both
    /// sides. A verdict on the median alone flips with the machine's noise.
    pub fn at_most_rounds(what: &str, rounds: &Series, bound: f64, unit: &str) -> Check {
        let wanted = format!("≤ {bound} {unit}, every round");
        Check::every_round(what, rounds, wanted, unit, |x| x <= bound)
    }

    /// Every round of `rounds` against a lower bound, as [`Check::at_most_rounds`] judges an
    /// upper one.
    pub fn at_least_rounds(what: &str, rounds: &Series, bound: f64, unit: &str) -> Check {
        let wanted = format!("≥ {bound} {unit}, every round");
        Check::every_round(what, rounds, wanted, unit, |x| x >= bound)
    }

    /// PASS when `within` holds for every round, MISS when for none, SPLIT otherwise; no
    /// verdict when a round measured nothing.
    fn every_round(
        what: &str,
        rounds: &Series,
        wanted: String,
        unit: &str,
        within: impl Fn(f64) -> bool,
    ) -> Check {
        let judged = rounds.all_finite();
        let passed = rounds.0.iter().filter(|x| within(**x)).count();
        let (all, none) = (passed == rounds.0.len(), passed == 0);
        let mut check = Check::new(
            what,
            &wanted,
            format!("{} {unit}", rounds.show(3)),
            (judged && (all || none)).then_some(all),
        );
        check.split = judged && !all && !none;
        check
    }

    /// `value` against an upper bound.
    pub fn at_most(what: &str, value: f64, bound: f64, unit: &str) -> Check {
        Check::new(
            what,
            &format!("≤ {bound} {unit}"),
            format!("{value:.3} {unit}"),
            value.is_finite().then_some(value <= bound),
        )
    }

    /// `value` against a lower bound.
    pub fn at_least(what: &str, value: f64, bound: f64, unit: &str) -> Check {
        Check::new(
            what,
            &format!("≥ {bound}{unit}"),
            format!("{value:.2}{unit}"),
            value.is_finite().then_some(value >= bound),
        )
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
             are for context: the load generator, the simulator and the proxy share the machine.\n\n",
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
        assert_eq!(Check::at_most("x", 0.1, 0.15, "ms").verdict(), "PASS");
        let rounds = |v: &[f64]| Series(v.to_vec());
        let judged = |v: &[f64]| Check::at_most_rounds("x", &rounds(v), 0.15, "ms").verdict();
        assert_eq!(judged(&[0.1, 0.12, 0.15]), "PASS");
        assert_eq!(judged(&[0.16, 0.2, 0.3]), "MISS");
        assert_eq!(judged(&[0.1, 0.2, 0.3]), "SPLIT");
        assert_eq!(judged(&[]), "n/a");
        assert_eq!(Check::at_least("x", 0.8, 1.0, "×").verdict(), "MISS");
        let at_least = |v: &[f64]| Check::at_least_rounds("x", &rounds(v), 1.0, "×").verdict();
        assert_eq!(at_least(&[1.0, 1.2]), "PASS");
        assert_eq!(at_least(&[0.8, 0.9]), "MISS");
        assert_eq!(at_least(&[0.9, 1.1]), at_least(&[1.1, 0.9]));
        assert!(Check::at_least_rounds("x", &rounds(&[0.9, 1.1]), 1.0, "×").split);
        assert_eq!(
            judged(&[0.1, f64::NAN]),
            "n/a",
            "a round that measured nothing"
        );
        assert_eq!(Check::at_least("x", f64::NAN, 1.0, "×").verdict(), "n/a");
    }
}
