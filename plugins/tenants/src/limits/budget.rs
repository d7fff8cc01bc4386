//! Budget windows and amounts: UTC calendar days and months, spend in whole micro-dollars
//! (integers add up exactly, in Rust and in Redis' INCRBY alike).

use std::time::{SystemTime, UNIX_EPOCH};

const DAY_SECS: i64 = 86_400;

/// Seconds since the Unix epoch, by this host's clock.
pub(crate) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Dollars as micro-dollars; negative, NaN or infinite amounts are no spend.
pub(crate) fn micros(usd: f64) -> u64 {
    if usd.is_finite() && usd > 0.0 {
        // Saturating float-to-int cast; budgets are validated far below it.
        (usd * 1e6).round() as u64
    } else {
        0
    }
}

pub(crate) fn usd(micros: u64) -> f64 {
    micros as f64 / 1e6
}

/// Which budget window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Period {
    Day,
    Month,
}

impl Period {
    pub(crate) fn per(self) -> &'static str {
        match self {
            Period::Day => "per day",
            Period::Month => "per month",
        }
    }
}

/// The UTC calendar windows at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Windows {
    /// Days since the epoch.
    pub day: i64,
    /// Months since the epoch (`year * 12 + month - 1`).
    pub month: i64,
    /// Seconds until the day ends.
    pub day_left: i64,
    /// Seconds until the month ends.
    pub month_left: i64,
}

impl Windows {
    pub(crate) fn at(unix: i64) -> Windows {
        let day = unix.div_euclid(DAY_SECS);
        let (year, month) = civil_from_days(day);
        let (next_year, next_month) = if month == 12 {
            (year + 1, 1)
        } else {
            (year, month + 1)
        };
        let month_end = days_from_civil(next_year, next_month) * DAY_SECS;
        Windows {
            day,
            month: year * 12 + month - 1,
            day_left: (day + 1) * DAY_SECS - unix,
            month_left: month_end - unix,
        }
    }

    pub(crate) fn left(&self, period: Period) -> i64 {
        match period {
            Period::Day => self.day_left,
            Period::Month => self.month_left,
        }
    }
}

/// (year, month 1..=12) of a day since the epoch (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month)
}

/// Days since the epoch of the first of `month` in `year` (Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A tenant's spend in the current windows (local store).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Spend {
    day: i64,
    month: i64,
    pub day_micros: u64,
    pub month_micros: u64,
}

impl Spend {
    /// Starts a new day or month at zero when the windows moved on.
    pub(crate) fn roll(&mut self, w: &Windows) {
        if self.day != w.day {
            self.day = w.day;
            self.day_micros = 0;
        }
        if self.month != w.month {
            self.month = w.month;
            self.month_micros = 0;
        }
    }

    pub(crate) fn add(&mut self, w: &Windows, micros: u64) {
        self.roll(w);
        self.day_micros = self.day_micros.saturating_add(micros);
        self.month_micros = self.month_micros.saturating_add(micros);
    }
}

/// The first spent window of a budget, day before month: `(period, spent, limit)` in micros.
pub(crate) fn spent(
    usd_per_day: Option<f64>,
    usd_per_month: Option<f64>,
    day_micros: u64,
    month_micros: u64,
) -> Option<(Period, u64, u64)> {
    let over = |limit: Option<f64>, spent: u64| {
        limit
            .map(micros)
            .filter(|&limit| spent >= limit)
            .map(|l| (spent, l))
    };
    over(usd_per_day, day_micros)
        .map(|(s, l)| (Period::Day, s, l))
        .or_else(|| over(usd_per_month, month_micros).map(|(s, l)| (Period::Month, s, l)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_windows_are_utc_days_and_months() {
        // 2024-02-29T23:59:30Z, a leap day.
        let w = Windows::at(1_709_251_170);
        assert_eq!(w.day_left, 30);
        assert_eq!(w.month_left, 30);
        assert_eq!(w.month, 2024 * 12 + 1);
        let next = Windows::at(1_709_251_200);
        assert_eq!(next.month, 2024 * 12 + 2);
        assert_eq!(next.day, w.day + 1);
        // 2024-03-01 to 2024-04-01: 31 days.
        assert_eq!(next.month_left, 31 * 86_400);
        // December rolls into the next year.
        let dec = Windows::at(1_735_603_200); // 2024-12-31T00:00:00Z
        assert_eq!(dec.month, 2024 * 12 + 11);
        assert_eq!(dec.month_left, 86_400);
    }

    #[test]
    fn spend_restarts_with_each_window() {
        let mut s = Spend::default();
        let d1 = Windows::at(1_709_251_170);
        s.add(&d1, 5);
        s.add(&d1, 7);
        assert_eq!((s.day_micros, s.month_micros), (12, 12));
        let d2 = Windows::at(1_709_251_200);
        s.add(&d2, 1);
        assert_eq!((s.day_micros, s.month_micros), (1, 1));
        assert_eq!(micros(-3.0), 0);
        assert_eq!(micros(f64::NAN), 0);
        assert_eq!(micros(0.25), 250_000);
        assert_eq!(
            spent(Some(1.0), Some(0.5), 400_000, 500_000),
            Some((Period::Month, 500_000, 500_000))
        );
        assert_eq!(spent(Some(1.0), None, 999_999, 0), None);
    }
}
