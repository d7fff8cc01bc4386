//! What a client sees: the `x-ratelimit-*` headers OpenAI sends, and the 429s.

use super::budget::{usd, Period};
use super::gcra::div_ceil;
use http::{HeaderName, HeaderValue};
use sluice_sdk::{ErrorReply, Reason};

/// One limit as it stands: for the headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    pub limit: u64,
    pub remaining: u64,
    /// Microseconds until the limit is back to its full allowance.
    pub reset_us: i64,
}

impl Reading {
    /// Whether `self` is nearer exhaustion than `other`, as a share of its limit.
    fn tighter_than(&self, other: &Reading) -> bool {
        u128::from(self.remaining) * u128::from(other.limit)
            < u128::from(other.remaining) * u128::from(self.limit)
    }
}

/// The limit that refused an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    Requests,
    InputTokens,
    OutputTokens,
}

/// What every limit of a tenant said about one admission, from either store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Readings {
    pub requests: Option<Reading>,
    pub input: Option<Reading>,
    pub output: Option<Reading>,
}

/// OpenAI's rate-limit headers, per group (requests, tokens): limit, remaining, reset. A
/// `static`, not a `const`: a `const` would be a new array at each use, dropped after it.
static NAMES: [[HeaderName; PER_GROUP]; GROUPS] = [
    [
        HeaderName::from_static("x-ratelimit-limit-requests"),
        HeaderName::from_static("x-ratelimit-remaining-requests"),
        HeaderName::from_static("x-ratelimit-reset-requests"),
    ],
    [
        HeaderName::from_static("x-ratelimit-limit-tokens"),
        HeaderName::from_static("x-ratelimit-remaining-tokens"),
        HeaderName::from_static("x-ratelimit-reset-tokens"),
    ],
];

/// Anthropic's names for the same headers, in the same places.
static ANTHROPIC_NAMES: [[HeaderName; PER_GROUP]; GROUPS] = [
    [
        HeaderName::from_static("anthropic-ratelimit-requests-limit"),
        HeaderName::from_static("anthropic-ratelimit-requests-remaining"),
        HeaderName::from_static("anthropic-ratelimit-requests-reset"),
    ],
    [
        HeaderName::from_static("anthropic-ratelimit-tokens-limit"),
        HeaderName::from_static("anthropic-ratelimit-tokens-remaining"),
        HeaderName::from_static("anthropic-ratelimit-tokens-reset"),
    ],
];

/// One of OpenAI's rate-limit headers as Anthropic's clients read it: Anthropic's name, and a
/// reset as the RFC 3339 time it comes (`now` and the duration). Any other header as it is.
pub(crate) fn anthropic_header(
    name: HeaderName,
    value: HeaderValue,
    now: std::time::SystemTime,
) -> (HeaderName, HeaderValue) {
    let place = NAMES.iter().enumerate().find_map(|(group, names)| {
        names
            .iter()
            .position(|n| *n == name)
            .map(|index| (group, index))
    });
    let Some((group, index)) = place else {
        return (name, value);
    };
    let anthropic = ANTHROPIC_NAMES[group][index].clone();
    if index + 1 < PER_GROUP {
        return (anthropic, value);
    }
    let at = value
        .to_str()
        .ok()
        .and_then(parse_openai_duration)
        .map(|d| humantime::format_rfc3339_seconds(now + d).to_string());
    match at.and_then(|at| HeaderValue::from_str(&at).ok()) {
        Some(at) => (anthropic, at),
        None => (anthropic, value),
    }
}

/// The inverse of [`write_openai_duration`]: `6m0s`, `1.5s`, `20ms`, `1h2m3.004s`.
fn parse_openai_duration(text: &str) -> Option<std::time::Duration> {
    let mut total = std::time::Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(digits);
        let number: f64 = number.parse().ok()?;
        let (unit, tail) = if let Some(tail) = tail.strip_prefix("ms") {
            (0.001, tail)
        } else if let Some(tail) = tail.strip_prefix('h') {
            (3600.0, tail)
        } else if let Some(tail) = tail.strip_prefix('m') {
            (60.0, tail)
        } else {
            (1.0, tail.strip_prefix('s')?)
        };
        total += std::time::Duration::try_from_secs_f64(number * unit).ok()?;
        rest = tail;
    }
    Some(total)
}

const GROUPS: usize = 2;
const PER_GROUP: usize = 3;

/// How many rate-limit headers an answer carries at most.
pub(crate) const HEADER_COUNT: usize = GROUPS * PER_GROUP;

impl Readings {
    /// The token limit the `-tokens` headers report: OpenAI has one, Sluice may have two, so
    /// the one that refused, else the one nearest exhaustion.
    fn tokens(&self, refused: Option<Refusal>) -> Option<Reading> {
        match (refused, self.input, self.output) {
            (Some(Refusal::InputTokens), Some(r), _)
            | (Some(Refusal::OutputTokens), _, Some(r)) => Some(r),
            (_, Some(i), Some(o)) => Some(if o.tighter_than(&i) { o } else { i }),
            (_, i, o) => i.or(o),
        }
    }

    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the limits set.
    pub(crate) fn headers(&self, refused: Option<Refusal>) -> Vec<(HeaderName, HeaderValue)> {
        let mut out = Vec::with_capacity(6);
        let Ok(()) = self.each_header(refused, |name, value| {
            out.push((name, value));
            Ok::<(), std::convert::Infallible>(())
        });
        out
    }

    /// The same headers handed to `f` one by one, with static names, until `f` fails: a
    /// successful answer writes them straight into its response, with no list built per
    /// request.
    pub(crate) fn each_header<E>(
        &self,
        refused: Option<Refusal>,
        mut f: impl FnMut(HeaderName, HeaderValue) -> Result<(), E>,
    ) -> Result<(), E> {
        // A refusal by the request limit shows it spent, whatever rounding says.
        let spent = refused == Some(Refusal::Requests);
        let readings = [
            self.requests.map(|r| (r, spent)),
            self.tokens(refused).map(|r| (r, false)),
        ];
        for (reading, [limit, remaining, reset]) in readings.iter().zip(&NAMES) {
            let Some((r, spent)) = reading else { continue };
            let left = if *spent { 0 } else { r.remaining };
            f(limit.clone(), number(r.limit))?;
            f(remaining.clone(), number(left))?;
            let mut text = StackText::new();
            write_openai_duration(&mut text, r.reset_us);
            f(reset.clone(), value(text.as_bytes()))?;
        }
        Ok(())
    }
}

/// A header value in a buffer of its own. Measured, six such small copies cost less than
/// six slices of one buffer, whose shared count every slice and every drop changes.
fn value(text: &[u8]) -> HeaderValue {
    // Only ASCII digits, dots and unit letters: always a valid value.
    HeaderValue::from_bytes(text).unwrap_or(HeaderValue::from_static("0"))
}

fn number(n: u64) -> HeaderValue {
    value(itoa::Buffer::new().format(n).as_bytes())
}

/// A duration's text, written on the stack: at most 21 bytes (`2562047788h59m59.999s`), so
/// it always fits; were it not so, a piece that does not fit would be dropped, never a panic.
struct StackText {
    buf: [u8; 32],
    len: usize,
}

impl StackText {
    fn new() -> Self {
        StackText {
            buf: [0; 32],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    fn push(&mut self, s: &[u8]) {
        let end = self.len + s.len();
        if let Some(dst) = self.buf.get_mut(self.len..end) {
            dst.copy_from_slice(s);
            self.len = end;
        }
    }
}

/// Where a duration is written: into a `String` for a message, on the stack for a header.
trait DurationOut {
    fn push_str(&mut self, s: &str);
    fn push_number(&mut self, n: i64) {
        self.push_str(itoa::Buffer::new().format(n));
    }
}

impl DurationOut for String {
    fn push_str(&mut self, s: &str) {
        String::push_str(self, s);
    }
}

impl DurationOut for StackText {
    fn push_str(&mut self, s: &str) {
        self.push(s.as_bytes());
    }
}

/// A duration the way OpenAI writes its reset headers (Go's format): `20ms`, `1s`, `1.5s`,
/// `6m0s`, `1h2m3s`; rounded up to the millisecond.
pub(crate) fn openai_duration(us: i64) -> String {
    let mut out = String::new();
    write_openai_duration(&mut out, us);
    out
}

/// Written by hand rather than with `write!`: it runs twice on every limited answer, and the
/// formatting machinery was most of its cost.
fn write_openai_duration(out: &mut impl DurationOut, us: i64) {
    if us <= 0 {
        return out.push_str("0s");
    }
    let ms = div_ceil(us, 1000);
    if ms < 1000 {
        out.push_number(ms);
        return out.push_str("ms");
    }
    let (h, m) = (ms / 3_600_000, ms / 60_000 % 60);
    let (s, frac) = (ms / 1000 % 60, ms % 1000);
    if h > 0 {
        out.push_number(h);
        out.push_str("h");
    }
    if h > 0 || m > 0 {
        out.push_number(m);
        out.push_str("m");
    }
    out.push_number(s);
    if frac != 0 {
        // Milliseconds as a decimal fraction, trailing zeros dropped: 1.5s, 1.05s, 1.005s.
        let digits = [frac / 100, frac / 10 % 10, frac % 10].map(|d| b'0' + d as u8);
        let width = if frac % 100 == 0 {
            1
        } else if frac % 10 == 0 {
            2
        } else {
            3
        };
        out.push_str(".");
        out.push_str(std::str::from_utf8(&digits[..width]).unwrap_or("0"));
    }
    out.push_str("s");
}

/// `retry-after`: whole seconds, rounded up, at least 1.
pub(crate) fn retry_after(us: i64) -> u32 {
    u32::try_from(div_ceil(us.max(1), 1_000_000))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// 429 `rate-limited` for a per-minute limit.
pub(crate) fn rate_limited(
    readings: &Readings,
    refused: Refusal,
    wanted: u64,
    retry_us: i64,
) -> ErrorReply {
    let wait = openai_duration(retry_us.max(1));
    let message = match refused {
        Refusal::Requests => {
            let limit = readings.requests.map_or(0, |r| r.limit);
            format!("Rate limit reached for requests per minute: limit {limit}, remaining 0. Try again in {wait}.")
        }
        Refusal::InputTokens | Refusal::OutputTokens => {
            let (what, reading) = match refused {
                Refusal::InputTokens => ("input tokens", readings.input),
                _ => ("output tokens", readings.output),
            };
            let (limit, left) = reading.map_or((0, 0), |r| (r.limit, r.remaining));
            format!("Rate limit reached for {what} per minute: limit {limit}, requested {wanted}, remaining {left}. Try again in {wait}.")
        }
    };
    ErrorReply {
        headers: readings.headers(Some(refused)),
        retry_after: Some(retry_after(retry_us)),
        ..ErrorReply::new(429, Reason::RateLimited, message)
    }
}

/// 429 `rate-limited` for too many requests in flight: no per-minute headers, and a second
/// is as good a guess as any for when one finishes.
pub(crate) fn too_many_in_flight(limit: u32) -> ErrorReply {
    ErrorReply {
        retry_after: Some(1),
        ..ErrorReply::new(
            429,
            Reason::RateLimited,
            format!("Rate limit reached for concurrent requests: limit {limit}. Try again when one of them finishes."),
        )
    }
}

/// 429 `budget-exceeded` until the window renews.
pub(crate) fn budget_exceeded(
    period: Period,
    spent_micros: u64,
    limit_micros: u64,
    renews_in_secs: i64,
    readings: &Readings,
) -> ErrorReply {
    let renews_us = renews_in_secs.max(1).saturating_mul(1_000_000);
    let message = format!(
        "Budget exceeded: ${:.2} spent of ${:.2} {} (UTC). It renews in {}.",
        usd(spent_micros),
        usd(limit_micros),
        period.per(),
        openai_duration(renews_us)
    );
    ErrorReply {
        headers: readings.headers(None),
        retry_after: Some(retry_after(renews_us)),
        ..ErrorReply::new(429, Reason::BudgetExceeded, message)
    }
}

/// 503 when Redis cannot answer and the operator chose to fail closed.
pub(crate) fn store_unavailable() -> ErrorReply {
    ErrorReply::unavailable(
        Reason::RateLimited,
        "Rate limits cannot be checked right now; try again shortly.",
        1,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_clients_get_their_own_names_and_reset_times() {
        let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        for (us, text) in [(1_500_000, "1.5s"), (360_000_000, "6m0s"), (20_000, "20ms")] {
            let mut out = StackText::new();
            write_openai_duration(&mut out, us);
            assert_eq!(out.as_bytes(), text.as_bytes());
            assert_eq!(
                parse_openai_duration(text),
                Some(std::time::Duration::from_micros(us as u64))
            );
        }
        let (name, value) = anthropic_header(
            HeaderName::from_static("x-ratelimit-reset-tokens"),
            HeaderValue::from_static("6m0s"),
            now,
        );
        assert_eq!(name, "anthropic-ratelimit-tokens-reset");
        assert_eq!(value, "2027-01-15T08:06:00Z");
        let (name, value) = anthropic_header(
            HeaderName::from_static("x-ratelimit-remaining-requests"),
            HeaderValue::from_static("4"),
            now,
        );
        assert_eq!(
            (name.as_str(), value.to_str().unwrap()),
            ("anthropic-ratelimit-requests-remaining", "4")
        );
        let other = HeaderName::from_static("retry-after");
        assert_eq!(
            anthropic_header(other.clone(), HeaderValue::from_static("1"), now).0,
            other
        );
    }

    #[test]
    fn durations_are_written_as_openai_does() {
        assert_eq!(openai_duration(0), "0s");
        assert_eq!(openai_duration(20_000), "20ms");
        assert_eq!(openai_duration(1), "1ms");
        assert_eq!(openai_duration(1_000_000), "1s");
        assert_eq!(openai_duration(1_500_000), "1.5s");
        assert_eq!(openai_duration(360_000_000), "6m0s");
        assert_eq!(openai_duration(3_723_250_000), "1h2m3.25s");
        assert_eq!(openai_duration(1_050_000), "1.05s");
        assert_eq!(openai_duration(1_005_000), "1.005s");
        assert_eq!(openai_duration(3_600_000_000), "1h0m0s");
        assert_eq!(openai_duration(-5), "0s");
        assert_eq!(retry_after(1), 1);
        assert_eq!(retry_after(1_000_001), 2);
    }

    #[test]
    fn every_group_limited_gives_as_many_headers_as_room_is_made_for() {
        let one = Reading {
            limit: 5,
            remaining: 4,
            reset_us: 12_000_000,
        };
        let r = Readings {
            requests: Some(one),
            input: Some(one),
            output: Some(one),
        };
        assert_eq!(r.headers(None).len(), HEADER_COUNT);
    }

    #[test]
    fn the_largest_values_all_fit_whole() {
        let most = Reading {
            limit: u64::MAX,
            remaining: u64::MAX - 1,
            reset_us: i64::MAX,
        };
        let r = Readings {
            requests: Some(most),
            input: Some(most),
            output: None,
        };
        let h = r.headers(None);
        let values: Vec<_> = h.iter().map(|(_, v)| v.to_str().unwrap()).collect();
        let max = u64::MAX.to_string();
        let below = (u64::MAX - 1).to_string();
        let reset = openai_duration(i64::MAX);
        assert_eq!(
            values,
            [&*max, &*below, &*reset, &*max, &*below, &*reset],
            "every header in order, none cut short"
        );
        assert_eq!(reset, "2562047788h0m54.776s");
    }

    #[test]
    fn the_token_headers_report_the_limit_nearest_exhaustion() {
        let r = Readings {
            requests: None,
            input: Some(Reading {
                limit: 1000,
                remaining: 500,
                reset_us: 30_000_000,
            }),
            output: Some(Reading {
                limit: 100,
                remaining: 10,
                reset_us: 54_000_000,
            }),
        };
        let h = r.headers(None);
        let get = |n: &str| {
            h.iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.to_str().unwrap().to_string())
        };
        assert_eq!(get("x-ratelimit-limit-tokens").as_deref(), Some("100"));
        assert_eq!(get("x-ratelimit-remaining-tokens").as_deref(), Some("10"));
        assert_eq!(get("x-ratelimit-reset-tokens").as_deref(), Some("54s"));
        assert_eq!(get("x-ratelimit-limit-requests"), None);
        // A refusal by the input limit reports it instead.
        let h = r.headers(Some(Refusal::InputTokens));
        assert!(h
            .iter()
            .any(|(k, v)| k == "x-ratelimit-limit-tokens" && v == "1000"));
    }
}
