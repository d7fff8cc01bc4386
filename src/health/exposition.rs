//! A parser for the Prometheus text exposition format, version 0.0.4, which vLLM's `/metrics`
//! serves (through Python's `prometheus_client`).
//!
//! Written by hand because the leading crate, `prometheus-parse` 0.2.5, matches metric names
//! with `\w+` and so drops every name that contains a colon, that is every vLLM metric
//! (`vllm:kv_cache_usage_perc`).
//!
//! It reads each line as Prometheus' own parser does, and is strict where a lax parser would
//! hide a broken line: an HTML tag, a bad escape or a line cut short is an error with its line
//! number, never a silently different sample. A text is read in one of two ways:
//!
//! - [`parse`]: the first bad line is the error.
//! - [`read_page`], what a scrape uses: only the samples the scrape keeps are parsed (the
//!   others are counted by their name), and a bad line is skipped and counted, so that one line in
//!   a syntax this parser does not know (a new exporter version, a sidecar's line) does not
//!   hide the rest of the page. The page as a whole is still an error when it cannot be
//!   trusted: a body cut short (as the format requires, the last line must end with a line
//!   feed, which is what catches a cut where the rest would still parse: `…running{engine="0"}
//!   4`, cut from `… 48.0`), a page that is not the format at all (an HTML error page), or a
//!   page still being read when its deadline passes.
//!
//! A scraped page may be hostile, so the work per line is bounded: a line longer than
//! [`MAX_LINE_BYTES`] or with more than [`MAX_LABELS`] labels (Prometheus' `label_limit`) is a
//! bad line, duplicate labels are found by sorting beyond a few, and an unescaped label value's
//! buffer is the size of the value.
//!
//! It runs on every scrape of every backend, so it uses no regex and borrows from the text:
//! names always, label values unless they contain escapes. The only allocation per line is
//! the sample's label vector.

use std::borrow::Cow;
use std::fmt;
use std::time::Instant;

/// The most labels a sample may have, as Prometheus' `label_limit` would set it; vLLM's widest
/// series, `vllm:cache_config_info`, has about 20.
pub const MAX_LABELS: usize = 128;

/// The longest line read, in bytes; vLLM's longest is a few hundred.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// The deadline is looked at once per this many lines: with lines bounded, that bounds the
/// work done past it.
const DEADLINE_EVERY: usize = 64;

/// Label sets up to this size are checked for duplicates pair by pair, larger ones by sorting.
const PAIRWISE_LABELS: usize = 16;

/// One sample line: `name{label="value",…} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// In the order of the text, values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
    /// Milliseconds since the Unix epoch, when the exporter gave one.
    pub timestamp_ms: Option<i64>,
}

impl<'a> Sample<'a> {
    /// The value of the label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| *label == name)
            .map(|(_, value)| value.as_ref())
    }
}

/// Why a line is not valid, and which.
#[derive(Debug, Clone, PartialEq)]
pub struct ParseError {
    /// 1-based.
    pub line: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for ParseError {}

/// What reading one text may cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// More labels than this make a line bad.
    pub max_labels: usize,
    /// A longer line (in bytes, without its line feed) is bad, and not parsed.
    pub max_line_bytes: usize,
    /// [`read_page`] gives up once past it.
    pub deadline: Option<Instant>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_labels: MAX_LABELS,
            max_line_bytes: MAX_LINE_BYTES,
            deadline: None,
        }
    }
}

/// A page read by [`read_page`]: its good samples, and what was skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct Page<'a> {
    /// The valid samples whose name the caller keeps, in the order of the text.
    pub samples: Vec<Sample<'a>>,
    /// Valid sample lines, kept or not.
    pub sample_lines: usize,
    /// Bad lines, skipped.
    pub skipped: usize,
    /// The first of them, and why it is bad.
    pub first_skipped: Option<ParseError>,
}

/// Why a page as a whole is not read.
#[derive(Debug, Clone, PartialEq)]
pub enum PageError {
    /// The last line has no line feed: the body was cut short, and what would parse of that
    /// line may be part of a value (`4` of `48.0`).
    CutShort { line: usize },
    /// Not a metrics page: no valid sample, or more bad lines than samples (an HTML page).
    NotMetrics {
        samples: usize,
        bad: usize,
        first_bad: Option<ParseError>,
    },
    /// The deadline passed while reading; `line` is where reading stopped.
    OutOfTime { line: usize },
}

impl fmt::Display for PageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageError::CutShort { line } => write!(f, "line {line}: {CUT_SHORT}"),
            PageError::NotMetrics {
                samples,
                bad,
                first_bad,
            } => {
                write!(
                    f,
                    "not a metrics page: {samples} valid samples, {bad} bad lines"
                )?;
                match first_bad {
                    Some(first) => write!(f, ", the first: {first}"),
                    None => Ok(()),
                }
            }
            PageError::OutOfTime { line } => {
                write!(f, "still reading at line {line} when the time was up")
            }
        }
    }
}

impl std::error::Error for PageError {}

const CUT_SHORT: &str = "the last line does not end with a line feed: the body was cut short";

/// The metric types a `# TYPE` line may name, in lower case as Prometheus' scraper and
/// `prometheus_client` require (OpenMetrics' `info`, `stateset`… are not types of this format).
const METRIC_TYPES: [&str; 5] = ["counter", "gauge", "histogram", "summary", "untyped"];

/// Error excerpts are cut to this many characters: the offending line may be a whole HTML page.
const EXCERPT_CHARS: usize = 40;

/// Parses a whole exposition, strictly: the first bad line is the error. An empty text gives
/// no samples; whether that is a problem is the caller's call.
pub fn parse(text: &str) -> Result<Vec<Sample<'_>>, ParseError> {
    let limits = Limits::default();
    let mut samples = Vec::new();
    for (number, line, terminated) in lines(text.as_bytes()) {
        let sample = parse_line(line, &limits).map_err(|message| ParseError {
            line: number,
            message,
        })?;
        // Checked after the line itself so that garbage is reported as garbage; a line that
        // parses but lacks its line feed is most likely a body cut short.
        if !terminated {
            return Err(ParseError {
                line: number,
                message: CUT_SHORT.to_owned(),
            });
        }
        samples.extend(sample);
    }
    Ok(samples)
}

/// Reads a scraped page: each line as strictly as [`parse`] does, but a bad line is skipped
/// and counted instead of failing the page. Only samples whose name `keep` accepts are
/// returned, so that a page of a million foreign samples costs no memory.
///
/// `keep_family` says whether a family may hold a kept sample: it must accept a family `f`
/// when `keep` accepts `f` or any `f_…` (a histogram's `_sum`, a counter's `_total`). The
/// lines after the comments of a family it refuses are passed over by their first bytes,
/// without being named or checked, for as long as they start as that family's samples: most
/// of a vLLM page is the buckets of histograms nobody reads. (A broken line among them counts
/// as a sample, not as a skipped line: nothing of it is used.) `# HELP` and `# TYPE` lines
/// are not checked either, unlike [`parse`]'s: no comment is used.
pub fn read_page<'a>(
    text: &'a [u8],
    limits: &Limits,
    keep: impl Fn(&str) -> bool,
    keep_family: impl Fn(&str) -> bool,
) -> Result<Page<'a>, PageError> {
    let mut page = Page {
        samples: Vec::new(),
        sample_lines: 0,
        skipped: 0,
        first_skipped: None,
    };
    // The family whose samples are being passed over.
    let mut passing: Option<&[u8]> = None;
    for (number, line, terminated) in lines(text) {
        if number % DEADLINE_EVERY == 0 && limits.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(PageError::OutOfTime { line: number });
        }
        if !terminated {
            return Err(PageError::CutShort { line: number });
        }
        // A sample of the family being passed over: counted, not named; its other comment
        // (`# TYPE` after `# HELP`) is not named either.
        if let Some(family) = passing {
            if is_sample_of(line, family) {
                page.sample_lines += 1;
                continue;
            }
            if is_comment_of(line, family) {
                continue;
            }
            passing = None;
        }
        // A sample nobody reads is not parsed: most of a vLLM page is histogram buckets a
        // scrape does not use, and its name, read from the bytes, says so. It still counts as
        // one of the page's samples, so an error page is still told from a metrics page (its
        // lines do not start with a metric name).
        if sample_name(line).is_some_and(|name| !keep(name)) {
            page.sample_lines += 1;
            continue;
        }
        // A `# HELP` or `# TYPE` line is named and not checked: nothing in a comment is used.
        // The samples that follow a family none of whose samples is read are passed over.
        if let Some(family) = comment_family(line) {
            if !keep(family) && !keep_family(family) {
                passing = Some(family.as_bytes());
            }
            continue;
        }
        match parse_line(line, limits) {
            Ok(Some(sample)) => {
                page.sample_lines += 1;
                if keep(sample.name) {
                    page.samples.push(sample);
                }
            }
            Ok(None) => {}
            Err(message) => {
                page.skipped += 1;
                if page.first_skipped.is_none() {
                    page.first_skipped = Some(ParseError {
                        line: number,
                        message,
                    });
                }
            }
        }
    }
    // A real exporter's page is mostly good samples; an error page, a login form or another
    // format is mostly or only bad lines, and its few lines that happen to parse mean nothing.
    if page.sample_lines == 0 || page.skipped > page.sample_lines {
        return Err(PageError::NotMetrics {
            samples: page.sample_lines,
            bad: page.skipped,
            first_bad: page.first_skipped,
        });
    }
    Ok(page)
}

/// The lines of `text` without their line feeds: (1-based number, line, whether a line feed
/// ended it).
fn lines(text: &[u8]) -> impl Iterator<Item = (usize, &[u8], bool)> {
    let mut rest = text;
    let mut number = 0;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        number += 1;
        Some(match memchr::memchr(b'\n', rest) {
            Some(end) => {
                let (line, tail) = rest.split_at(end);
                rest = tail.get(1..).unwrap_or_default();
                (number, line, true)
            }
            None => {
                let line = rest;
                rest = &[];
                (number, line, false)
            }
        })
    })
}

/// The metric name a sample line starts with (after blanks), when it starts with one
/// followed by its labels or its value; `None` for anything else (a comment, a blank line,
/// a line that is no sample), which [`parse_line`] then reads.
fn sample_name(line: &[u8]) -> Option<&str> {
    let start = line.iter().position(|&b| b != b' ' && b != b'\t')?;
    let rest = line.get(start..)?;
    let first = *rest.first()?;
    if !(first.is_ascii_alphabetic() || first == b'_' || first == b':') {
        return None;
    }
    let end = rest.iter().position(|&b| !NAME_BYTES[usize::from(b)])?;
    if !matches!(rest.get(end), Some(b'{' | b' ' | b'\t')) {
        return None;
    }
    std::str::from_utf8(rest.get(..end)?).ok()
}

/// The bytes of a metric name (`[a-zA-Z0-9_:]`), as a table: every scrape reads a few
/// hundred names a byte at a time, and a look-up is half the work of the three tests.
const NAME_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = byte.is_ascii_alphanumeric() || byte == b'_' || byte == b':';
        b += 1;
    }
    table
};

/// Whether `line` is the `# HELP` or `# TYPE` comment of `family`.
fn is_comment_of(line: &[u8], family: &[u8]) -> bool {
    line.strip_prefix(b"# ")
        .and_then(|rest| {
            rest.strip_prefix(b"HELP ")
                .or_else(|| rest.strip_prefix(b"TYPE "))
        })
        .and_then(|rest| rest.strip_prefix(family))
        .is_some_and(|rest| matches!(rest.first(), None | Some(b' ' | b'\t')))
}

/// Whether `line` is a sample of `family`: its name is the family's or the family's and a
/// suffix (`_bucket`, `_sum`, …), followed by its labels or its value.
fn is_sample_of(line: &[u8], family: &[u8]) -> bool {
    line.strip_prefix(family)
        .and_then(|rest| rest.first())
        .is_some_and(|next| matches!(next, b'_' | b'{' | b' ' | b'\t'))
}

/// The family a `# HELP name …` or `# TYPE name …` line describes, read from its bytes;
/// `None` for any other line. (A histogram's family is named without the `_sum` or `_count`
/// of the samples a reader keeps, so its comments go unchecked too: nothing in a comment is
/// used.)
fn comment_family(line: &[u8]) -> Option<&str> {
    let rest = line.strip_prefix(b"# ")?;
    let rest = rest
        .strip_prefix(b"HELP ")
        .or_else(|| rest.strip_prefix(b"TYPE "))?;
    sample_name(rest)
}

/// One line, without its line feed: a sample, or `None` for a blank or comment line.
fn parse_line<'a>(line: &'a [u8], limits: &Limits) -> Result<Option<Sample<'a>>, String> {
    if line.len() > limits.max_line_bytes {
        return Err(format!(
            "a line of {} bytes, longer than the {} read",
            line.len(),
            limits.max_line_bytes
        ));
    }
    let line = std::str::from_utf8(line).map_err(|e| format!("not UTF-8: {e}"))?;
    // A CR of a CRLF and trailing blanks are tolerated, as are leading blanks.
    let line = line
        .trim_end_matches([' ', '\t', '\r'])
        .trim_start_matches([' ', '\t']);
    if line.is_empty() {
        return Ok(None);
    }
    if let Some(comment) = line.strip_prefix('#') {
        check_comment(comment)?;
        return Ok(None);
    }
    parse_sample(line, limits.max_labels).map(Some)
}

/// Comments are skipped, but `# HELP` and `# TYPE` lines are checked as Prometheus checks them.
fn check_comment(comment: &str) -> Result<(), String> {
    let mut cursor = Cursor::new(comment);
    cursor.skip_blanks();
    let keyword = cursor.take_token();
    if keyword != "HELP" && keyword != "TYPE" {
        return Ok(());
    }
    cursor.skip_blanks();
    if cursor.at_end() {
        // A bare `# HELP` is a plain comment to Prometheus too.
        return Ok(());
    }
    let name = cursor.take_token();
    if !is_metric_name(name) {
        return Err(format!(
            "invalid metric name {:?} in a {keyword} line",
            excerpt(name)
        ));
    }
    if keyword == "HELP" {
        // The docstring is not used, so its escapes are not interpreted.
        return Ok(());
    }
    cursor.skip_blanks();
    let metric_type = cursor.rest();
    if metric_type.is_empty() {
        return Err(format!("TYPE line of {name} without a type"));
    }
    if METRIC_TYPES.contains(&metric_type) {
        Ok(())
    } else {
        Err(format!(
            "unknown metric type {:?} for {name}",
            excerpt(metric_type)
        ))
    }
}

fn parse_sample(line: &str, max_labels: usize) -> Result<Sample<'_>, String> {
    let mut cursor = Cursor::new(line);
    if !cursor.peek().is_some_and(is_metric_name_start) {
        return Err(format!(
            "expected a metric name, found {:?}",
            excerpt(cursor.rest())
        ));
    }
    let name = cursor.take_while(is_metric_name_char);
    match cursor.peek() {
        Some(b' ' | b'\t' | b'{') => {}
        None => return Err(format!("missing value after {name}")),
        Some(_) => {
            return Err(format!(
                "invalid character {:?} after the metric name {name}",
                cursor.next_char()
            ))
        }
    }
    cursor.skip_blanks();
    let labels = if cursor.eat(b'{') {
        parse_labels(&mut cursor, max_labels)?
    } else {
        Vec::new()
    };

    cursor.skip_blanks();
    let value_token = cursor.take_token();
    if value_token.is_empty() {
        return Err(format!("missing value after {name}"));
    }
    let value = parse_value(value_token)
        .ok_or_else(|| format!("invalid value {:?} of {name}", excerpt(value_token)))?;

    cursor.skip_blanks();
    let timestamp_ms = if cursor.at_end() {
        None
    } else {
        let token = cursor.take_token();
        let timestamp = token.parse::<i64>().map_err(|_| {
            format!(
                "invalid timestamp {:?} of {name}: expected integer milliseconds",
                excerpt(token)
            )
        })?;
        cursor.skip_blanks();
        if !cursor.at_end() {
            return Err(format!(
                "unexpected text after the timestamp of {name}: {:?}",
                excerpt(cursor.rest())
            ));
        }
        Some(timestamp)
    };

    Ok(Sample {
        name,
        labels,
        value,
        timestamp_ms,
    })
}

/// The label set after its `{`, up to and including its `}`. A trailing comma and blanks
/// around `=` and `,` are allowed; more than `max_labels` labels are not.
fn parse_labels<'a>(
    cursor: &mut Cursor<'a>,
    max_labels: usize,
) -> Result<Vec<(&'a str, Cow<'a, str>)>, String> {
    let mut labels: Vec<(&'a str, Cow<'a, str>)> = Vec::new();
    loop {
        cursor.skip_blanks();
        match cursor.peek() {
            None => return Err(cut_in_labels()),
            Some(b'}') => {
                cursor.advance();
                return match duplicate(&labels) {
                    Some(name) => Err(format!("duplicate label {name}")),
                    None => Ok(labels),
                };
            }
            Some(_) => {}
        }
        if !cursor.peek().is_some_and(is_label_name_start) {
            return Err(format!(
                "expected a label name, found {:?}",
                excerpt(cursor.rest())
            ));
        }
        let name = cursor.take_while(is_label_name_char);
        if name == "__name__" {
            return Err("the label name __name__ is reserved".to_owned());
        }
        if labels.len() >= max_labels {
            return Err(format!("more than {max_labels} labels"));
        }
        cursor.skip_blanks();
        if !cursor.eat(b'=') {
            return Err(if cursor.at_end() {
                cut_in_labels()
            } else {
                format!(
                    "expected '=' after the label name {name}, found {:?}",
                    excerpt(cursor.rest())
                )
            });
        }
        cursor.skip_blanks();
        if !cursor.eat(b'"') {
            return Err(if cursor.at_end() {
                cut_in_labels()
            } else {
                format!(
                    "the value of the label {name} is not quoted: {:?}",
                    excerpt(cursor.rest())
                )
            });
        }
        let value = cursor
            .take_quoted()
            .map_err(|message| format!("in the value of the label {name}: {message}"))?;
        labels.push((name, value));
        cursor.skip_blanks();
        match cursor.peek() {
            Some(b',') => cursor.advance(),
            Some(b'}') => {}
            None => return Err(cut_in_labels()),
            Some(_) => {
                return Err(format!(
                    "expected ',' or '}}' after the label {name}, found {:?}",
                    excerpt(cursor.rest())
                ))
            }
        }
    }
}

/// A label name that appears twice in `labels`: pair by pair for a few labels, by sorting
/// for more, so that a wide label set is not quadratic.
fn duplicate<'a>(labels: &[(&'a str, Cow<'_, str>)]) -> Option<&'a str> {
    if labels.len() <= PAIRWISE_LABELS {
        return labels.iter().enumerate().find_map(|(i, (name, _))| {
            labels
                .iter()
                .skip(i + 1)
                .any(|(other, _)| other == name)
                .then_some(*name)
        });
    }
    let mut names: Vec<&'a str> = labels.iter().map(|(name, _)| *name).collect();
    names.sort_unstable();
    names.windows(2).find_map(|pair| match pair {
        [a, b] if a == b => Some(*a),
        _ => None,
    })
}

fn cut_in_labels() -> String {
    "the line ends inside the label set (a body cut short?)".to_owned()
}

/// A float as Go's `strconv.ParseFloat` and Python's `float` read it: decimal with an optional
/// exponent, or `NaN`, `Inf`, `+Inf`, `-Inf` (any case). Rust's parser accepts the same, and
/// rejects what Prometheus rejects too: hex floats and `_` separators.
fn parse_value(token: &str) -> Option<f64> {
    token.parse::<f64>().ok()
}

fn is_metric_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes.next().is_some_and(is_metric_name_start) && bytes.all(is_metric_name_char)
}

/// `[a-zA-Z_:]`
fn is_metric_name_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_' || byte == b':'
}

/// `[a-zA-Z0-9_:]`
fn is_metric_name_char(byte: u8) -> bool {
    is_metric_name_start(byte) || byte.is_ascii_digit()
}

/// `[a-zA-Z_]`
fn is_label_name_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_'
}

/// `[a-zA-Z0-9_]`
fn is_label_name_char(byte: u8) -> bool {
    is_label_name_start(byte) || byte.is_ascii_digit()
}

fn is_blank(byte: u8) -> bool {
    byte == b' ' || byte == b'\t'
}

/// The start of `text`, cut for an error message.
fn excerpt(text: &str) -> &str {
    match text.char_indices().nth(EXCERPT_CHARS) {
        Some((end, _)) => text.get(..end).unwrap_or(text),
        None => text,
    }
}

/// A position in one line. It only ever stops next to an ASCII byte or at an end, so every
/// slice it takes falls on a char boundary; slices are still taken with `get` so that a bug
/// here is a wrong error, not a panic.
struct Cursor<'a> {
    line: &'a str,
    position: usize,
}

impl<'a> Cursor<'a> {
    fn new(line: &'a str) -> Self {
        Cursor { line, position: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.line.as_bytes().get(self.position).copied()
    }

    fn at_end(&self) -> bool {
        self.position >= self.line.len()
    }

    fn advance(&mut self) {
        self.position += 1;
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        if found {
            self.advance();
        }
        found
    }

    fn rest(&self) -> &'a str {
        self.line.get(self.position..).unwrap_or("")
    }

    /// The character at the cursor, for error messages (it may not be ASCII).
    fn next_char(&self) -> char {
        self.rest().chars().next().unwrap_or_default()
    }

    fn slice(&self, start: usize) -> &'a str {
        self.line.get(start..self.position).unwrap_or("")
    }

    fn skip_blanks(&mut self) {
        while self.peek().is_some_and(is_blank) {
            self.advance();
        }
    }

    fn take_while(&mut self, wanted: impl Fn(u8) -> bool) -> &'a str {
        let start = self.position;
        while self.peek().is_some_and(&wanted) {
            self.advance();
        }
        self.slice(start)
    }

    /// Up to the next blank or the end of the line.
    fn take_token(&mut self) -> &'a str {
        self.take_while(|byte| !is_blank(byte))
    }

    /// The raw length of the quoted value that starts at `start`, escapes included, up to its
    /// closing quote or the end of the line.
    fn quoted_len(&self, start: usize) -> usize {
        let bytes = self.line.as_bytes();
        let mut end = self.position;
        while let Some(&byte) = bytes.get(end) {
            match byte {
                b'"' => break,
                b'\\' => end += 2,
                _ => end += 1,
            }
        }
        end.min(bytes.len()).saturating_sub(start)
    }

    /// A label value, after its opening quote, up to and including its closing quote.
    /// Borrowed unless it contains an escape: `\\`, `\"` or `\n`.
    fn take_quoted(&mut self) -> Result<Cow<'a, str>, String> {
        let start = self.position;
        loop {
            match self.peek() {
                None => return Err(unterminated_quote()),
                Some(b'"') => {
                    let value = self.slice(start);
                    self.advance();
                    return Ok(Cow::Borrowed(value));
                }
                Some(b'\\') => break,
                Some(_) => self.advance(),
            }
        }
        // Sized to the value (escapes only shorten it), not to the rest of the line: a line of
        // many escaped values would otherwise hold the line's length once per value.
        let mut value = String::with_capacity(self.quoted_len(start));
        value.push_str(self.slice(start));
        let mut unescaped_from = self.position;
        loop {
            match self.peek() {
                None => return Err(unterminated_quote()),
                Some(b'"') => {
                    value.push_str(self.slice(unescaped_from));
                    self.advance();
                    return Ok(Cow::Owned(value));
                }
                Some(b'\\') => {
                    value.push_str(self.slice(unescaped_from));
                    self.advance();
                    match self.peek() {
                        Some(b'\\') => value.push('\\'),
                        Some(b'"') => value.push('"'),
                        Some(b'n') => value.push('\n'),
                        None => return Err(unterminated_quote()),
                        Some(_) => {
                            let escaped = self.next_char();
                            return Err(format!("invalid escape sequence \\{escaped}"));
                        }
                    }
                    self.advance();
                    unescaped_from = self.position;
                }
                Some(_) => self.advance(),
            }
        }
    }
}

fn unterminated_quote() -> String {
    "the line ends inside quotes (a body cut short?)".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    const V0: &str = include_str!("../../tests/fixtures/vllm-v0-metrics.txt");
    const V1: &str = include_str!("../../tests/fixtures/vllm-v1-metrics.txt");

    /// Accepted by both this parser and `prometheus_client.parser`, with every oddity the
    /// format allows. The cross-check compares the two on it.
    const TRICKY: &str = concat!(
        "# A plain comment, with \"quotes\", a \\ and a {brace\n",
        "#\n",
        "#no space after the hash\n",
        "# HELP tricky:requests_total Help with \\\\ and \\n escapes and \"quotes\".\n",
        "# TYPE tricky:requests_total counter\n",
        "tricky:requests_total{path=\"/a\\\"b\\\\c\\nd\",method=\"GET\",} 1027 1395066363000\n",
        "tricky:requests_total { code = \"200\" , method=\"POST\" } 3.5e+02\n",
        "tricky:requests_total{path=\"ends with a backslash\\\\\"} 1\n",
        "\n",
        "   \t \n",
        "# TYPE tricky_gauge gauge\n",
        "tricky_gauge NaN\n",
        "tricky_gauge{kind=\"plus_inf\"} +Inf\n",
        "tricky_gauge{kind=\"minus_inf\"} -Inf\n",
        "tricky_gauge{kind=\"inf\"} Inf\n",
        "tricky_gauge{kind=\"exponent\"} 1.7525664123389e+09\n",
        "tricky_gauge{kind=\"negative_exponent\"} -2.5E-3\n",
        "tricky_gauge{kind=\"big_integer\"} 12345678901234567890\n",
        "tricky_gauge{kind=\"tabs\"}\t42\t-1000\n",
        "tricky_gauge{kind=\"crlf\"} 3.25\r\n",
        "tricky_gauge{kind=\"no_blank_before_value\"}5\n",
        "tricky_gauge{kind=\"delimiters inside\",text=\"a}b,c=d # e\"} 6\n",
        "tricky_gauge{kind=\"utf-8\",text=\"naïve ☃\"} 7\n",
        "tricky_gauge{kind=\"empty\",text=\"\"} 8\n",
        "tricky_gauge{} 0.5\n",
        "  tricky_gauge{kind=\"leading and trailing blanks\"} 9  \t\n",
        "_under:colons:: 10\n",
        "# TYPE tricky_seconds histogram\n",
        "tricky_seconds_bucket{le=\"0.5\"} 1\n",
        "tricky_seconds_bucket{le=\"+Inf\"} 2\n",
        "tricky_seconds_count 2\n",
        "tricky_seconds_sum 0.75\n",
        "untyped_metric 0.1 -5\n",
    );

    fn parse_ok(text: &str) -> Vec<Sample<'_>> {
        match parse(text) {
            Ok(samples) => samples,
            Err(error) => panic!("{text:?} should parse: {error}"),
        }
    }

    fn parse_err(text: &str) -> ParseError {
        match parse(text) {
            Ok(samples) => panic!("{text:?} should not parse, got {samples:?}"),
            Err(error) => error,
        }
    }

    fn only(text: &str) -> Sample<'_> {
        let mut samples = parse_ok(text);
        assert_eq!(samples.len(), 1, "{text:?}");
        samples.remove(0)
    }

    fn find<'a>(samples: &'a [Sample<'a>], name: &str) -> &'a Sample<'a> {
        samples
            .iter()
            .find(|sample| sample.name == name)
            .unwrap_or_else(|| panic!("no sample {name}"))
    }

    #[test]
    fn v1_fixture() {
        let samples = parse_ok(V1);
        assert_eq!(samples.len(), 139);
        let usage = find(&samples, "vllm:kv_cache_usage_perc");
        assert_eq!(usage.value, 0.2346);
        assert_eq!(usage.label("engine"), Some("0"));
        assert_eq!(
            usage.label("model_name"),
            Some("meta-llama/Llama-3.1-8B-Instruct")
        );
        assert_eq!(usage.timestamp_ms, None);
        let created = find(&samples, "vllm:spec_decode_num_drafts_created");
        assert_eq!(created.value, 1.7525664123389e9);
        let config = find(&samples, "vllm:cache_config_info");
        assert_eq!(config.labels.len(), 21);
        assert_eq!(config.label("block_size"), Some("16"));
        assert_eq!(config.label("num_gpu_blocks"), Some("27526"));
        assert_eq!(config.label("num_cpu_blocks"), Some("None"));
        assert_eq!(config.label("swap_space_bytes"), Some("4294967296.0"));
        assert_eq!(config.value, 1.0);
        let lora = find(&samples, "vllm:lora_requests_info");
        assert_eq!(lora.label("running_lora_adapters"), Some(""));
        let last_bucket = samples
            .iter()
            .rfind(|sample| sample.name == "vllm:e2e_request_latency_seconds_bucket")
            .map(|sample| (sample.label("le"), sample.value));
        assert_eq!(last_bucket, Some((Some("+Inf"), 1247.0)));
        assert!(samples
            .iter()
            .flat_map(|sample| &sample.labels)
            .all(|(_, value)| matches!(value, Cow::Borrowed(_))));
    }

    #[test]
    fn v0_fixture() {
        let samples = parse_ok(V0);
        assert_eq!(samples.len(), 33);
        let usage = find(&samples, "vllm:gpu_cache_usage_perc");
        assert_eq!(usage.value, 0.8712);
        assert_eq!(usage.labels.len(), 1);
        assert_eq!(usage.label("engine"), None);
        assert_eq!(
            find(&samples, "vllm:spec_decode_num_draft_tokens_total").value,
            1.9098e6
        );
        assert_eq!(
            find(&samples, "vllm:time_to_first_token_seconds_sum").value,
            14.699999999999994
        );
        assert_eq!(
            find(&samples, "vllm:cache_config_info").label("num_gpu_blocks"),
            Some("9271")
        );
    }

    #[test]
    fn empty_and_comment_only_texts_have_no_samples() {
        assert!(parse_ok("").is_empty());
        assert!(parse_ok("\n\n  \t\n").is_empty());
        assert!(parse_ok("# HELP a_metric Some help.\n# TYPE a_metric gauge\n").is_empty());
    }

    #[test]
    fn escaped_label_values() {
        let sample = only("m{a=\"quote \\\" backslash \\\\ newline \\n end\",b=\"plain\"} 1\n");
        assert_eq!(
            sample.label("a"),
            Some("quote \" backslash \\ newline \n end")
        );
        assert!(matches!(sample.labels[0].1, Cow::Owned(_)));
        assert!(matches!(sample.labels[1].1, Cow::Borrowed("plain")));
        // An escaped backslash right before the closing quote does not escape the quote.
        let sample = only("m{a=\"\\\\\"} 1\n");
        assert_eq!(sample.label("a"), Some("\\"));
        let sample = only("m{a=\"\\\"\"} 1\n");
        assert_eq!(sample.label("a"), Some("\""));
    }

    #[test]
    fn special_values() {
        assert!(only("m NaN\n").value.is_nan());
        assert_eq!(only("m +Inf\n").value, f64::INFINITY);
        assert_eq!(only("m Inf\n").value, f64::INFINITY);
        assert_eq!(only("m -Inf\n").value, f64::NEG_INFINITY);
        assert_eq!(only("m 1.7525664123389e+09\n").value, 1_752_566_412.338_9);
        assert_eq!(only("m -2.5E-3\n").value, -0.0025);
        assert_eq!(only("m 42\n").value, 42.0);
        assert_eq!(only("m .5\n").value, 0.5);
    }

    #[test]
    fn timestamps() {
        let sample = only("m{a=\"b\"} 3 1395066363000\n");
        assert_eq!(sample.timestamp_ms, Some(1_395_066_363_000));
        assert_eq!(only("m 3 -1000\n").timestamp_ms, Some(-1000));
        assert_eq!(only("m 3\t\t7  \n").timestamp_ms, Some(7));
        assert_eq!(only("m 3\n").timestamp_ms, None);
    }

    #[test]
    fn comments_and_help_are_skipped() {
        let text = "# just a comment\n\
                    #\n\
                    # HELP m Help with \\\\ and \\n and a \\q the format does not define.\n\
                    # HELP\n\
                    # TYPE m gauge\n\
                    #TYPE n counter\n\
                    m 1\n";
        assert_eq!(only(text).name, "m");
    }

    #[test]
    fn type_lines_are_checked() {
        for metric_type in ["counter", "gauge", "histogram", "summary", "untyped"] {
            parse_ok(&format!("# TYPE m {metric_type}\n"));
        }
        for metric_type in ["GAUGE", "gaugehistogram", "info"] {
            let error = parse_err(&format!("m 1\n# TYPE m {metric_type}\n"));
            assert_eq!(error.line, 2);
            assert!(error.message.contains("unknown metric type"), "{error}");
        }
        assert_eq!(parse_err("# TYPE m\n").line, 1);
        assert_eq!(parse_err("# TYPE m gauge extra\n").line, 1);
        assert_eq!(parse_err("# TYPE 1m gauge\n").line, 1);
        assert_eq!(parse_err("# HELP m-x help\n").line, 1);
    }

    #[test]
    fn label_syntax_variants() {
        let sample = only("m { a = \"1\" , b=\"2\", } 3\n");
        assert_eq!(sample.labels.len(), 2);
        assert_eq!(
            (sample.label("a"), sample.label("b")),
            (Some("1"), Some("2"))
        );
        assert!(only("m{} 3\n").labels.is_empty());
        assert!(only("m{ } 3\n").labels.is_empty());
        assert_eq!(only("m{a=\"1\"}3\n").value, 3.0);
        assert_eq!(only("m{a=\"\"} 3\n").label("a"), Some(""));
        assert_eq!(only("m{a=\"}, # x\"} 3\n").label("a"), Some("}, # x"));
        assert_eq!(only("m{a=\"naïve ☃\"} 3\n").label("a"), Some("naïve ☃"));
    }

    #[test]
    fn crlf_tabs_and_blank_lines() {
        let samples = parse_ok("# TYPE m gauge\r\nm{a=\"1\"}\t2\t3\r\n\r\n\t m 4 \r\n");
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].label("a"), Some("1"));
        assert_eq!(samples[0].value, 2.0);
        assert_eq!(samples[0].timestamp_ms, Some(3));
        assert_eq!(samples[1].value, 4.0);
    }

    #[test]
    fn html_page_is_an_error() {
        let error = parse_err("<!DOCTYPE html>\n<html><body>Bad Gateway</body></html>\n");
        assert_eq!(error.line, 1);
        assert!(error.message.contains("expected a metric name"), "{error}");
        assert!(error.to_string().starts_with("line 1: "));
    }

    #[test]
    fn truncated_body_is_an_error() {
        let text = "# TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{engine=\"0\",mod";
        let error = parse_err(text);
        assert_eq!(error.line, 2);
        assert!(error.message.contains("label set"), "{error}");

        // Cut between two tokens, or inside the value: only the missing line feed tells.
        let error = parse_err("m 1\nvllm:num_requests_running{engine=\"0\"} 4");
        assert_eq!(error.line, 2);
        assert!(error.message.contains("line feed"), "{error}");
        assert_eq!(parse_err("m 1\n# HELP m").line, 2);
        assert_eq!(parse_err("m{a=\"b\"} ").line, 1);
        assert_eq!(parse_err("m{a=\"b\"}").line, 1);
    }

    #[test]
    fn unterminated_quote_and_bad_escape() {
        let error = parse_err("m 1\nm{a=\"b} 2\n");
        assert_eq!(error.line, 2);
        assert!(error.message.contains("inside quotes"), "{error}");
        assert_eq!(parse_err("m{a=\"b\\\"} 2\n").line, 1);
        let error = parse_err("m{a=\"tab\\there\"} 2\n");
        assert!(
            error.message.contains("invalid escape sequence \\t"),
            "{error}"
        );
        let error = parse_err("m{a=\"x\\é\"} 2\n");
        assert!(
            error.message.contains("invalid escape sequence \\é"),
            "{error}"
        );
    }

    #[test]
    fn missing_or_bad_values_are_errors() {
        assert!(parse_err("m\n").message.contains("missing value"));
        assert!(parse_err("m{a=\"b\"}\n").message.contains("missing value"));
        assert!(parse_err("m{a=\"b\"}   \n")
            .message
            .contains("missing value"));
        assert!(parse_err("m one\n").message.contains("invalid value"));
        assert!(parse_err("m 1_000\n").message.contains("invalid value"));
        assert!(parse_err("m 0x1p3\n").message.contains("invalid value"));
        assert!(parse_err("m 1 1.5\n").message.contains("invalid timestamp"));
        let error = parse_err("m 1 2 3\n");
        assert!(error.message.contains("after the timestamp"), "{error}");
        let error = parse_err("# ok\nm 1 2 garbage\n");
        assert_eq!(error.line, 2);
    }

    #[test]
    fn invalid_names_and_labels_are_errors() {
        for text in [
            "1m 1\n",
            "m-x 1\n",
            "m.x 1\n",
            "é 1\n",
            "{a=\"b\"} 1\n",
            "m{1a=\"b\"} 1\n",
            "m{a:b=\"c\"} 1\n",
            "m{,a=\"b\"} 1\n",
            "m{a=\"b\",,} 1\n",
            "m{a=b} 1\n",
            "m{a \"b\"} 1\n",
            "m{a=\"b\" c=\"d\"} 1\n",
            "m{a=\"b\",a=\"c\"} 1\n",
            "m{__name__=\"x\"} 1\n",
        ] {
            assert_eq!(parse_err(text).line, 1, "{text:?}");
        }
        let error = parse_err("good 1\nbad-name 2\n");
        assert_eq!(error.line, 2);
        assert!(error.message.contains("invalid character"), "{error}");
    }

    #[test]
    fn long_garbage_is_cut_in_the_message() {
        let line = "<".repeat(10_000) + "\n";
        assert!(parse_err(&line).message.len() < 200);
    }

    fn read_ok(text: &[u8]) -> Page<'_> {
        match read_page(text, &Limits::default(), |_| true, |_| true) {
            Ok(page) => page,
            Err(error) => panic!("{:?} should read: {error}", String::from_utf8_lossy(text)),
        }
    }

    fn read_err(text: &[u8]) -> PageError {
        match read_page(text, &Limits::default(), |_| true, |_| true) {
            Ok(page) => panic!(
                "{:?} should not read: {page:?}",
                String::from_utf8_lossy(text)
            ),
            Err(error) => error,
        }
    }

    /// `m{l0="\\",l1="\\",…} 1`: a line of `labels` labels, each value one escaped backslash.
    fn escaped_labels_line(labels: usize) -> String {
        let labels: Vec<String> = (0..labels).map(|i| format!("l{i}=\"\\\\\"")).collect();
        format!("m{{{}}} 1\n", labels.join(","))
    }

    #[test]
    fn a_page_is_read_without_its_bad_lines() {
        let mut text = V1.to_owned();
        text.insert_str(0, "sidecar_info{version=\"1\"} 1 # {trace_id=\"abc\"} 2\n");
        text.push_str("broken{path=\"C:\\temp\"} 1\n");
        text.push_str(&format!("{}\n", "x".repeat(MAX_LINE_BYTES + 1)));
        text.push_str("latin1{a=\"");
        let mut bytes = text.into_bytes();
        bytes.extend_from_slice(b"caf\xe9\"} 1\n");
        let page = read_ok(&bytes);
        assert_eq!(page.samples.len(), 139, "every good sample is kept");
        assert_eq!(page.sample_lines, 139);
        assert_eq!(page.skipped, 4);
        let first = page.first_skipped.expect("the first bad line");
        assert_eq!(first.line, 1);
        assert!(first.message.contains("invalid timestamp"), "{first}");
        assert_eq!(
            find(&page.samples, "vllm:kv_cache_usage_perc").value,
            0.2346
        );
        // The same lines are errors to the strict parser.
        let strict = parse_err(std::str::from_utf8(&bytes[..bytes.len() - 20]).unwrap());
        assert_eq!(strict.line, 1);
    }

    #[test]
    fn a_page_keeps_only_the_samples_asked_for() {
        let running = |name: &str| name == "vllm:num_requests_running";
        let page = read_page(V1.as_bytes(), &Limits::default(), running, running).unwrap();
        assert_eq!(page.samples.len(), 1);
        assert_eq!(page.sample_lines, 139, "the others are still counted");
        // A sample nobody reads is not parsed, so a bad one costs nothing; a bad one that is
        // read is a bad line.
        let text = format!("{V1}unread{{a=\"b\"}} not-a-number\nread{{a=\"b\"}} not-a-number\n");
        let read = |name: &str| name == "read";
        let page = read_page(text.as_bytes(), &Limits::default(), read, read).unwrap();
        assert_eq!((page.sample_lines, page.skipped), (140, 1));
        assert_eq!(
            page.first_skipped.map(|e| e.line),
            Some(text.lines().count())
        );
    }

    #[test]
    fn a_read_sample_after_a_passed_over_family_is_read() {
        // `read` has no comments of its own: it follows `unread`'s samples directly.
        let text = "# HELP unread x\n# TYPE unread histogram\nunread_bucket{le=\"1\"} 1\n\
                    unread_sum 2\nunread_count 1\nread{a=\"b\"} 7\nunread_other 1\n";
        let read = |name: &str| name == "read";
        let page = read_page(text.as_bytes(), &Limits::default(), read, read).unwrap();
        assert_eq!(page.samples.len(), 1);
        assert_eq!(page.samples[0].value, 7.0);
        assert_eq!(page.sample_lines, 5);
        // A page cut inside a family passed over is still a page cut short.
        let cut = &text.as_bytes()[..text.find("unread_sum 2").unwrap() + 8];
        assert!(matches!(
            read_page(cut, &Limits::default(), read, read),
            Err(PageError::CutShort { .. })
        ));
    }

    #[test]
    fn comments_are_not_checked_when_they_name_a_family() {
        let text = "# TYPE unread histogram extra words\n# HELP read x\n# TYPE read gauge gauge\n\
                    read 1\n# TYPE 9bad gauge\n";
        let read = |name: &str| name == "read";
        let page = read_page(text.as_bytes(), &Limits::default(), read, read).unwrap();
        assert_eq!(
            (page.sample_lines, page.skipped),
            (1, 1),
            "only the comment that names no family"
        );
        assert_eq!(comment_family(b"# HELP vllm:x Help."), Some("vllm:x"));
        assert_eq!(comment_family(b"# TYPE m gauge"), Some("m"));
        assert_eq!(comment_family(b"# other m"), None);
    }

    #[test]
    fn a_sample_s_name_is_read_from_its_bytes() {
        assert_eq!(sample_name(b"vllm:x{a=\"1\"} 2"), Some("vllm:x"));
        assert_eq!(sample_name(b"  m 1"), Some("m"));
        assert_eq!(sample_name(b"m\t1"), Some("m"));
        for not_a_sample in [
            &b"# HELP m x"[..],
            b"",
            b"   ",
            b"<html>",
            b"9m 1",
            b"m",
            b"m-x 1",
        ] {
            assert_eq!(sample_name(not_a_sample), None, "{not_a_sample:?}");
        }
    }

    #[test]
    fn a_page_cut_short_is_not_read_even_if_its_lines_parse() {
        let line = V1.find("vllm:num_requests_running{").unwrap();
        let value = line + V1[line..].find("} 48.0\n").unwrap();
        let cut = &V1[..value + 3]; // `… 4`, cut from `… 48.0`
        assert!(cut.ends_with("} 4"));
        assert!(
            parse(&format!("{}\n", &cut[line..])).is_ok(),
            "the cut line parses"
        );
        assert!(matches!(
            read_err(cut.as_bytes()),
            PageError::CutShort { .. }
        ));
        // A bad last line without its line feed: cut short too.
        assert!(matches!(
            read_err(b"m 1\nm{a=\"b"),
            PageError::CutShort { line: 2 }
        ));
    }

    #[test]
    fn a_page_that_is_not_metrics_is_not_read() {
        let html = "<!DOCTYPE html>\n<html><body>502 Bad Gateway</body></html>\n";
        match read_err(html.as_bytes()) {
            PageError::NotMetrics {
                samples: 0,
                bad: 2,
                first_bad: Some(first),
            } => assert_eq!(first.line, 1),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_err(b""),
            PageError::NotMetrics {
                samples: 0,
                bad: 0,
                ..
            }
        ));
        assert!(matches!(
            read_err(b"# HELP m Help.\n# TYPE m gauge\n"),
            PageError::NotMetrics { samples: 0, .. }
        ));
        // A few lines that happen to parse do not make an error page a metrics page.
        let mostly_bad = "<html>\nStatus 502\n<p>\nretry 1\n</html>\n";
        assert!(matches!(
            read_err(mostly_bad.as_bytes()),
            PageError::NotMetrics {
                samples: 2,
                bad: 3,
                ..
            }
        ));
        let error = read_err(html.as_bytes()).to_string();
        assert!(error.contains("not a metrics page"), "{error}");
        assert!(error.contains("line 1: expected a metric name"), "{error}");
    }

    #[test]
    fn labels_are_capped() {
        let at_the_cap = escaped_labels_line(MAX_LABELS);
        assert_eq!(only(&at_the_cap).labels.len(), MAX_LABELS);
        let error = parse_err(&escaped_labels_line(MAX_LABELS + 1));
        assert!(error.message.contains("more than 128 labels"), "{error}");
        let text = format!("{}good 1\n", escaped_labels_line(1000));
        let page = read_ok(text.as_bytes());
        assert_eq!((page.samples.len(), page.skipped), (1, 1));
    }

    #[test]
    fn lines_are_capped() {
        let value = "v".repeat(MAX_LINE_BYTES - 9);
        let at_the_cap = format!("m{{a=\"{value}\"}} 1\n");
        assert_eq!(at_the_cap.len(), MAX_LINE_BYTES + 1, "with its line feed");
        assert_eq!(only(&at_the_cap).label("a"), Some(value.as_str()));
        let over = format!("m{{a=\"{value}v\"}} 1\n");
        let error = parse_err(&over);
        assert!(error.message.contains("longer than"), "{error}");
        assert!(error.message.len() < 200);
    }

    #[test]
    fn duplicate_labels_are_found_in_wide_label_sets() {
        // Past `PAIRWISE_LABELS`, duplicates are found by sorting.
        let names: Vec<String> = (0..100).map(|i| format!("l{i}")).collect();
        let line = |names: &[String]| {
            let labels: Vec<String> = names.iter().map(|n| format!("{n}=\"x\"")).collect();
            format!("m{{{}}} 1\n", labels.join(","))
        };
        assert_eq!(only(&line(&names)).labels.len(), 100);
        let mut twice = names.clone();
        twice[97] = "l3".into();
        let error = parse_err(&line(&twice));
        assert_eq!(error.message, "duplicate label l3");
        let error = parse_err("m{b=\"1\",a=\"2\",b=\"3\"} 1\n");
        assert_eq!(error.message, "duplicate label b");
    }

    #[test]
    fn an_escaped_value_gets_a_buffer_of_its_own_size() {
        let line = format!("m{{a=\"x\\\\y\",b=\"{}\"}} 1\n", "z".repeat(10_000));
        let sample = only(&line);
        match &sample.labels[0].1 {
            Cow::Owned(value) => {
                assert_eq!(value, "x\\y");
                assert!(value.capacity() <= 4, "{}", value.capacity());
            }
            Cow::Borrowed(_) => panic!("an escaped value is unescaped"),
        }
    }

    /// The hostile page of the audit: 8 MiB of one label line. It is one bad line now, not
    /// minutes of work; and a page of many such lines under the line cap is bad line by line.
    #[test]
    fn a_hostile_label_line_is_a_bad_line() {
        let huge = escaped_labels_line(400_000);
        assert!(huge.len() > 1 << 20);
        match read_err(huge.as_bytes()) {
            PageError::NotMetrics {
                samples: 0,
                bad: 1,
                first_bad: Some(first),
            } => assert!(first.message.contains("longer than"), "{first}"),
            other => panic!("{other:?}"),
        }
        let wide = escaped_labels_line(4000);
        assert!(wide.len() < MAX_LINE_BYTES);
        let page = wide.repeat(100) + &"good 1\n".repeat(101);
        let page = read_ok(page.as_bytes());
        assert_eq!((page.sample_lines, page.skipped), (101, 100));
    }

    #[test]
    fn reading_stops_at_the_deadline() {
        let limits = Limits {
            deadline: Some(Instant::now()),
            ..Limits::default()
        };
        let text = "m 1\n".repeat(1000);
        assert_eq!(
            read_page(text.as_bytes(), &limits, |_| true, |_| true),
            Err(PageError::OutOfTime {
                line: DEADLINE_EVERY
            })
        );
        let later = Limits {
            deadline: Instant::now().checked_add(Duration::from_secs(60)),
            ..Limits::default()
        };
        assert_eq!(
            read_page(text.as_bytes(), &later, |_| true, |_| true).map(|p| p.sample_lines),
            Ok(1000)
        );
    }

    /// A body cut at any point either parses (cut right after a line feed) into the samples of
    /// the whole lines it has, or is an error, and never panics.
    #[test]
    fn every_prefix_of_the_v1_fixture() {
        // Whole lines before the cut, and how many of them are samples.
        let mut lines = 0;
        let mut sample_lines = 0;
        for (end, char) in V1.char_indices().skip(1) {
            let prefix = &V1[..end];
            match parse(prefix) {
                Ok(samples) => {
                    assert!(prefix.ends_with('\n'), "{prefix:?} should not parse");
                    assert_eq!(samples.len(), sample_lines);
                }
                Err(error) => {
                    assert!(!prefix.ends_with('\n'), "{error}");
                    assert_eq!(error.line, lines + 1, "{error}");
                }
            }
            if char == '\n' {
                lines += 1;
                let line_start = V1[..end].rfind('\n').map_or(0, |newline| newline + 1);
                if !V1[line_start..].starts_with('#') {
                    sample_lines += 1;
                }
            }
        }
        assert_eq!(parse_ok(V1).len(), sample_lines);
    }

    /// What the reference parser, `prometheus_client.parser`, reads: one line per sample, with
    /// labels sorted, values and timestamps (in seconds) as Python's `repr`.
    const REFERENCE_PARSER: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families

def escape(value):
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace('"', '\\"')

text = sys.stdin.buffer.read().decode("utf-8")
for family in text_string_to_metric_families(text):
    for sample in family.samples:
        labels = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(sample.labels.items()))
        print(f"{sample.name}\t{labels}\t{float(sample.value)!r}\t{sample.timestamp!r}")
"#;

    fn reference_parse(text: &str) -> Vec<String> {
        const NEEDS: &str = "this test needs python3 with prometheus_client, the reference \
                             parser (scripts/bootstrap --test installs both)";
        let mut child = Command::new("python3")
            .args(["-c", REFERENCE_PARSER])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("{NEEDS}: cannot run python3: {error}"));
        child
            .stdin
            .take()
            .expect("stdin is piped")
            .write_all(text.as_bytes())
            .expect("write to python3");
        let output = child.wait_with_output().expect("wait for python3");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("No module named 'prometheus_client'"),
            "{NEEDS}: {stderr}"
        );
        assert!(
            output.status.success(),
            "the reference parser failed: {stderr}"
        );
        let stdout = String::from_utf8(output.stdout).expect("python3 prints UTF-8");
        stdout.lines().map(canonical_reference_line).collect()
    }

    /// Reads Python's value and timestamp back as f64 so that both sides print them alike.
    fn canonical_reference_line(line: &str) -> String {
        let fields: Vec<&str> = line.split('\t').collect();
        let [name, labels, value, timestamp] = fields[..] else {
            panic!("unexpected reference line {line:?}");
        };
        let value: f64 = value.parse().expect("a Python float repr");
        let timestamp: Option<f64> =
            (timestamp != "None").then(|| timestamp.parse().expect("a Python float repr"));
        format!("{name}\t{labels}\t{value:?}\t{timestamp:?}")
    }

    fn canonical_line(sample: &Sample<'_>) -> String {
        let mut labels: Vec<_> = sample.labels.iter().collect();
        labels.sort_by_key(|(name, _)| *name);
        let labels: Vec<String> = labels
            .iter()
            .map(|(name, value)| {
                let value = value
                    .replace('\\', "\\\\")
                    .replace('\n', "\\n")
                    .replace('\t', "\\t")
                    .replace('"', "\\\"");
                format!("{name}=\"{value}\"")
            })
            .collect();
        let timestamp = sample.timestamp_ms.map(|ms| ms as f64 / 1000.0);
        format!(
            "{}\t{}\t{:?}\t{timestamp:?}",
            sample.name,
            labels.join(","),
            sample.value
        )
    }

    #[test]
    fn same_samples_as_the_reference_parser() {
        for (what, text) in [
            ("V0 fixture", V0),
            ("V1 fixture", V1),
            ("tricky text", TRICKY),
        ] {
            let ours: Vec<String> = parse_ok(text).iter().map(canonical_line).collect();
            let reference = reference_parse(text);
            assert!(!reference.is_empty(), "{what}");
            if ours != reference {
                let first_difference = ours
                    .iter()
                    .zip(&reference)
                    .position(|(a, b)| a != b)
                    .unwrap_or(ours.len().min(reference.len()));
                panic!(
                    "{what}: {} samples here, {} in prometheus_client; first difference at \
                     sample {first_difference}:\n  ours:      {:?}\n  reference: {:?}",
                    ours.len(),
                    reference.len(),
                    ours.get(first_difference),
                    reference.get(first_difference),
                );
            }
        }
    }
}
