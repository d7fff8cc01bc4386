//! JSON text worked on where it lies, without a tree: where a member's value is, how to
//! change one member of a body and keep every other byte, and how to read a string's text
//! or an array's elements from the bytes a parser already checked.
//!
//! A request body can be megabytes, and a tree of it costs tens of bytes per JSON node. So
//! Sluice parses a body once (see [`crate::request`]), keeps the bytes, and works on them:
//! - [`object_spans`] finds the values of a few top-level members of an object, by their
//!   byte ranges (the last of a repeated key, as parsers that keep the last read it);
//! - [`Edit`] and [`apply`] copy a body once with some ranges replaced; [`set_member`]
//!   replaces one member's value, or appends the member;
//! - [`elements`] splits an array's text into its elements, and [`Unescaped`] reads a
//!   string's text piece by piece, for text that a JSON parser has already accepted.
//!
//! Parsing stays serde_json's (borrowed `RawValue`s give the spans); what is written here is
//! only what no JSON crate offers: editing one member of a body while keeping every other
//! byte, and reading checked text without building a value.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::fmt;
use std::ops::Range;

/// Where `part` lies in `whole`, when it is a slice of it (compared by address).
pub fn position(whole: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some(start..end)
}

/// JSON's four whitespace bytes.
pub fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

/// A JSON object's text, as far as an edit needs it: where the values of the asked-for
/// members are, how many members it has and where its closing brace is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectSpans<'k> {
    values: Vec<(&'k str, Option<Range<usize>>)>,
    members: usize,
    close: usize,
}

/// What a parse of a body (one JSON object) saw of its top-level members, kept so that an
/// edit of those members later need not read the body again: how many there are, and where
/// the value of each member asked for starts (none: absent), and whether each present one
/// could be placed (not when its key was escaped: the body must then be read again).
/// Kept in every parsed request, so a fixed array, not a vector, of 4-byte offsets (a body
/// is far below 4 GiB).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenMembers<const N: usize = 14> {
    count: usize,
    keys: &'static [&'static str; N],
    /// Where each key's value starts; [`NOT_SEEN`]: absent.
    starts: [u32; N],
    placed: bool,
}

/// A member not seen, in [`SeenMembers::starts`].
const NOT_SEEN: u32 = u32::MAX;

/// Nothing seen: what it describes must be read whole.
impl<const N: usize> Default for SeenMembers<N> {
    fn default() -> Self {
        SeenMembers {
            count: 0,
            keys: &[""; N],
            starts: [NOT_SEEN; N],
            placed: false,
        }
    }
}

impl<const N: usize> SeenMembers<N> {
    /// Nothing seen yet, of an object whose members `keys` are to be placed.
    pub fn new(keys: &'static [&'static str; N]) -> Self {
        SeenMembers {
            count: 0,
            keys,
            starts: [NOT_SEEN; N],
            placed: true,
        }
    }

    /// A member was read: `key` (unescaped), and `value_at` finds where its value starts
    /// (asked only for the members to place; `None` when its key was not read in place).
    pub fn saw(&mut self, key: &str, value_at: impl FnOnce() -> Option<usize>) {
        self.count += 1;
        if let Some(i) = self.keys.iter().position(|k| *k == key) {
            let at = value_at().and_then(|at| u32::try_from(at).ok());
            if let Some(start) = self.starts.get_mut(i) {
                *start = at.unwrap_or(NOT_SEEN);
            }
            self.placed &= at.is_some_and(|at| at != NOT_SEEN);
        }
    }
}

impl<const N: usize> SeenMembers<N> {
    /// Where the value of member `key` is in `text` (the object the parse saw): `Some(None)`
    /// when it is absent; `None` when the parse cannot tell (it did not place every member,
    /// or `key` was not one to place), and the text must be read again.
    pub fn value_of(&self, text: &[u8], key: &str) -> Option<Option<std::ops::Range<usize>>> {
        if !self.placed {
            return None;
        }
        let i = self.keys.iter().position(|k| *k == key)?;
        match *self.starts.get(i)? {
            NOT_SEEN => Some(None),
            start => {
                let start = start as usize;
                let len = value_len(text.get(start..)?)?;
                Some(Some(start..start + len))
            }
        }
    }
}

impl ObjectSpans<'static> {
    /// The spans of the object `text` whose members a parse has `seen`: only the values
    /// asked for are read (each to its end), not the rest of the text. `None` when a member
    /// could not be placed, or the text does not end its object where it should.
    pub fn from_seen<const N: usize>(
        text: &[u8],
        seen: &SeenMembers<N>,
    ) -> Option<ObjectSpans<'static>> {
        if !seen.placed {
            return None;
        }
        let close = text.iter().rposition(|b| !is_space(*b))?;
        if text.get(close) != Some(&b'}') {
            return None;
        }
        let mut values = Vec::with_capacity(N);
        for (key, start) in seen.keys.iter().zip(seen.starts) {
            let range = match start {
                NOT_SEEN => None,
                start => {
                    let start = start as usize;
                    Some(start..start + value_len(text.get(start..close)?)?)
                }
            };
            values.push((*key, range));
        }
        Some(ObjectSpans {
            values,
            members: seen.count,
            close,
        })
    }
}

/// The length of the one JSON value `text` starts with.
fn value_len(text: &[u8]) -> Option<usize> {
    let mut values = serde_json::Deserializer::from_slice(text).into_iter::<IgnoredAny>();
    values.next()?.ok()?;
    Some(values.byte_offset())
}

/// Reads `text` as one JSON object (whitespace around it allowed) and finds the values of
/// `keys` among its top-level members: each value's byte range in `text`, for a repeated
/// key the last one. Keys are compared once unescaped (`"logprob\u0073"` is `logprobs`).
/// `None` when `text` is not exactly one valid JSON object (in valid UTF-8).
pub fn object_spans<'k>(text: &[u8], keys: &[&'k str]) -> Option<ObjectSpans<'k>> {
    // UTF-8 is checked whole: serde_json checks only the strings it reads, not those skipped.
    let mut de = serde_json::Deserializer::from_str(std::str::from_utf8(text).ok()?);
    let (found, members) = de
        .deserialize_map(SpansVisitor { keys, whole: text })
        .ok()?;
    de.end().ok()?;
    let close = text.iter().rposition(|b| !is_space(*b))?;
    if text.get(close) != Some(&b'}') {
        return None;
    }
    Some(ObjectSpans {
        values: keys.iter().copied().zip(found).collect(),
        members,
        close,
    })
}

impl ObjectSpans<'_> {
    /// The byte range of `key`'s value (its last occurrence), if the object has that member
    /// and `key` was asked for.
    pub fn value(&self, key: &str) -> Option<Range<usize>> {
        self.values
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, range)| range.clone())
    }

    /// The number of members, repeated keys counted each time.
    pub fn members(&self) -> usize {
        self.members
    }

    /// Where the object's closing brace is: the place of an appended member.
    pub fn close(&self) -> usize {
        self.close
    }

    /// The edit that sets the member `key` to `value` (JSON text): its last occurrence's
    /// value replaced in place, or the member appended. `key` must be one asked for.
    pub fn set(&self, key: &str, value: &[u8]) -> Edit {
        match self.value(key) {
            Some(range) => Edit {
                range,
                text: value.to_vec(),
            },
            None => self.append(key, value),
        }
    }

    /// The edit that appends the member `key: value` (`value` is JSON text) at the end of
    /// the object, after a comma when it has members.
    pub fn append(&self, key: &str, value: &[u8]) -> Edit {
        let mut text = Vec::with_capacity(key.len() + value.len() + 4);
        if self.members > 0 {
            text.push(b',');
        }
        write_string(&mut text, key);
        text.push(b':');
        text.extend_from_slice(value);
        Edit {
            range: self.close..self.close,
            text,
        }
    }
}

/// One change to a text: the bytes of `range` replaced by `text` (an empty range inserts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    /// The bytes replaced, by position in the original text.
    pub range: Range<usize>,
    /// What replaces them.
    pub text: Vec<u8>,
}

/// `text` with `edits` made, copied once into a buffer of exactly the result's size. `None`
/// when an edit lies outside `text` or two overlap (two insertions at one place are made in
/// the order given).
pub fn apply(text: &[u8], mut edits: Vec<Edit>) -> Option<Vec<u8>> {
    edits.sort_by_key(|e| (e.range.start, e.range.end));
    let mut size = text.len();
    let mut end = 0;
    for edit in &edits {
        if edit.range.start < end || edit.range.end < edit.range.start {
            return None;
        }
        end = edit.range.end;
        size = size
            .checked_sub(edit.range.len())?
            .checked_add(edit.text.len())?;
    }
    if end > text.len() {
        return None;
    }
    let mut out = Vec::with_capacity(size);
    let mut from = 0;
    for edit in &edits {
        out.extend_from_slice(text.get(from..edit.range.start)?);
        out.extend_from_slice(&edit.text);
        from = edit.range.end;
    }
    out.extend_from_slice(text.get(from..)?);
    Some(out)
}

/// `object` (a JSON object's text) with the top-level member `key` set to `value` (JSON
/// text): its last occurrence's value replaced in place, or the member appended at the end.
/// Every other byte is kept. `None` when `object` is not one valid JSON object.
pub fn set_member(object: &[u8], key: &str, value: &[u8]) -> Option<Vec<u8>> {
    let spans = object_spans(object, &[key])?;
    apply(object, vec![spans.set(key, value)])
}

/// Writes `s` as a JSON string, quotes included.
pub fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if u32::from(c) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", u32::from(c)).as_bytes());
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// Finds the asked-for members while serde_json checks the whole object.
struct SpansVisitor<'a, 'k> {
    keys: &'a [&'k str],
    whole: &'a [u8],
}

impl<'de> Visitor<'de> for SpansVisitor<'_, '_> {
    type Value = (Vec<Option<Range<usize>>>, usize);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = vec![None; self.keys.len()];
        let mut members = 0usize;
        while let Some((index, _)) = map.next_key_seed(KeyIndex::new(self.keys))? {
            members += 1;
            match index.and_then(|i| found.get_mut(i)) {
                Some(slot) => {
                    let raw: &'de RawValue = map.next_value()?;
                    let range = position(self.whole, raw.get().as_bytes())
                        .ok_or_else(|| de::Error::custom("a value outside the text"))?;
                    *slot = Some(range);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok((found, members))
    }
}

/// The keys a [`KeyIndex`] looks for: a key's index among them, if one.
pub(crate) trait Keys {
    fn index_of(&self, key: &str) -> Option<usize>;
}

impl Keys for [&str] {
    fn index_of(&self, key: &str) -> Option<usize> {
        self.iter().position(|k| *k == key)
    }
}

/// A member's key, read by serde: its index among the keys looked for (`None`: another
/// key) and, when `whole` is given and the key was read in place (it has no escapes), where
/// its text ends in `whole` (for [`value_after_key`]).
pub(crate) struct KeyIndex<'a, K: ?Sized> {
    keys: &'a K,
    whole: Option<&'a [u8]>,
}

impl<'a, 'k> KeyIndex<'a, [&'k str]> {
    pub(crate) fn new(keys: &'a [&'k str]) -> Self {
        KeyIndex { keys, whole: None }
    }
}

impl<'a, K: Keys + ?Sized> KeyIndex<'a, K> {
    /// Also says where the key ends in `whole`, the text being parsed.
    pub(crate) fn located(keys: &'a K, whole: &'a [u8]) -> Self {
        KeyIndex {
            keys,
            whole: Some(whole),
        }
    }
}

impl<'de, K: Keys + ?Sized> DeserializeSeed<'de> for KeyIndex<'_, K> {
    type Value = (Option<usize>, Option<usize>);

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_identifier(self)
    }
}

impl<'de, K: Keys + ?Sized> Visitor<'de> for KeyIndex<'_, K> {
    type Value = (Option<usize>, Option<usize>);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Self::Value, E> {
        let end = self
            .whole
            .and_then(|whole| position(whole, key.as_bytes()))
            .map(|range| range.end);
        Ok((self.keys.index_of(key), end))
    }

    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok((self.keys.index_of(key), None))
    }
}

/// The elements of a JSON array's text (whitespace before it allowed, anything after its
/// closing bracket ignored), each as its own text, without parsing them. For text a JSON
/// parser has accepted: on anything else the elements are meaningless (but reading them is
/// safe).
pub fn elements(array: &[u8]) -> Elements<'_> {
    let at = array
        .iter()
        .position(|b| !is_space(*b))
        .filter(|i| array.get(*i) == Some(&b'['))
        .map_or(array.len(), |i| i + 1);
    Elements { text: array, at }
}

/// Where the value of an object's member starts, given where the text of its key ends
/// (inside the quotes): past the closing quote, the colon and any whitespace. For text a
/// JSON parser has accepted.
pub fn value_after_key(text: &[u8], key_end: usize) -> Option<usize> {
    let mut at = key_end;
    if text.get(at) != Some(&b'"') {
        return None;
    }
    at += 1;
    let mut colon = false;
    while let Some(byte) = text.get(at) {
        match byte {
            b':' if !colon => colon = true,
            b if is_space(*b) => {}
            _ if colon => return Some(at),
            _ => return None,
        }
        at += 1;
    }
    None
}

/// The iterator of [`elements`].
#[derive(Debug, Clone)]
pub struct Elements<'a> {
    text: &'a [u8],
    at: usize,
}

impl<'a> Iterator for Elements<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        self.skip_space();
        if self.text.get(self.at) == Some(&b',') {
            self.at += 1;
            self.skip_space();
        }
        let start = self.at;
        let end = match self.text.get(start) {
            None | Some(b']') => None,
            Some(_) => value_end(self.text, start),
        };
        let Some(end) = end.filter(|end| *end > start) else {
            self.at = self.text.len();
            return None;
        };
        self.at = end;
        self.text.get(start..end)
    }
}

impl Elements<'_> {
    fn skip_space(&mut self) {
        while self.text.get(self.at).is_some_and(|b| is_space(*b)) {
            self.at += 1;
        }
    }
}

/// The end of the JSON value that starts at `start` (exclusive), for checked JSON.
fn value_end(text: &[u8], start: usize) -> Option<usize> {
    match text.get(start)? {
        b'"' => string_end(text, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = start;
            loop {
                match text.get(at)? {
                    b'"' => {
                        at = string_end(text, at)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        _ => {
            let rest = text.get(start..)?;
            let len = rest
                .iter()
                .position(|b| matches!(b, b',' | b']' | b'}') || is_space(*b))
                .unwrap_or(rest.len());
            Some(start + len)
        }
    }
}

/// The end (after the closing quote) of the string whose opening quote is at `start`.
fn string_end(text: &[u8], start: usize) -> Option<usize> {
    let mut at = start + 1;
    loop {
        let rest = text.get(at..)?;
        let stop = at + rest.iter().position(|b| matches!(b, b'"' | b'\\'))?;
        match text.get(stop)? {
            b'\\' => at = stop + 2,
            _ => return Some(stop + 1),
        }
    }
}

/// The text of a JSON string whose escapes are as sent (the bytes between its quotes),
/// piece by piece: runs of plain text as they are, each escape as its character. Nothing is
/// allocated. For string text a JSON parser has accepted; a malformed escape reads as
/// U+FFFD.
#[derive(Debug, Clone)]
pub struct Unescaped<'a> {
    rest: &'a str,
}

impl<'a> Unescaped<'a> {
    /// The pieces of `raw`, the text between a JSON string's quotes.
    pub fn new(raw: &'a str) -> Self {
        Self { rest: raw }
    }
}

/// A piece of an unescaped string: see [`Unescaped`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text without escapes, as it is in the JSON.
    Str(&'a str),
    /// The character an escape stands for.
    Char(char),
}

impl Piece<'_> {
    /// The piece's UTF-8 bytes; `buf` holds an escaped character's.
    pub fn bytes<'b>(&'b self, buf: &'b mut [u8; 4]) -> &'b [u8] {
        match self {
            Piece::Str(s) => s.as_bytes(),
            Piece::Char(c) => c.encode_utf8(buf).as_bytes(),
        }
    }

    /// The piece's length in UTF-8 bytes.
    pub fn len(&self) -> usize {
        match self {
            Piece::Str(s) => s.len(),
            Piece::Char(c) => c.len_utf8(),
        }
    }

    /// Whether the piece is empty (never, as [`Unescaped`] yields them).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> Iterator for Unescaped<'a> {
    type Item = Piece<'a>;

    fn next(&mut self) -> Option<Piece<'a>> {
        if self.rest.is_empty() {
            return None;
        }
        let Some(escaped) = self.rest.strip_prefix('\\') else {
            let run = self.rest.find('\\').unwrap_or(self.rest.len());
            let (text, rest) = self.rest.split_at_checked(run)?;
            self.rest = rest;
            return Some(Piece::Str(text));
        };
        let mut chars = escaped.chars();
        let c = match chars.next() {
            Some('"') => '"',
            Some('\\') => '\\',
            Some('/') => '/',
            Some('b') => '\u{8}',
            Some('f') => '\u{c}',
            Some('n') => '\n',
            Some('r') => '\r',
            Some('t') => '\t',
            Some('u') => {
                let (c, used) = unicode_escape(escaped.get(1..).unwrap_or_default());
                self.rest = escaped.get(1 + used..).unwrap_or_default();
                return Some(Piece::Char(c));
            }
            _ => '\u{fffd}',
        };
        self.rest = chars.as_str();
        Some(Piece::Char(c))
    }
}

/// The character of a `\u` escape whose hex digits start `text`, with a surrogate pair's
/// second half; and the bytes used after the `u`.
fn unicode_escape(text: &str) -> (char, usize) {
    let hex = |s: Option<&str>| s.and_then(|h| u32::from_str_radix(h, 16).ok());
    let Some(unit) = hex(text.get(..4)) else {
        return ('\u{fffd}', text.len().min(4));
    };
    if (0xD800..0xDC00).contains(&unit) && text.get(4..6) == Some("\\u") {
        if let Some(low) = hex(text.get(6..10)).filter(|l| (0xDC00..0xE000).contains(l)) {
            let c = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
            return (char::from_u32(c).unwrap_or('\u{fffd}'), 10);
        }
    }
    (char::from_u32(unit).unwrap_or('\u{fffd}'), 4)
}

/// The length in UTF-8 bytes of the text of a JSON string, from the bytes between its
/// quotes (escapes as sent).
pub fn unescaped_len(raw: &str) -> usize {
    if !raw.contains('\\') {
        return raw.len();
    }
    Unescaped::new(raw).map(|p| p.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_from_what_a_parse_saw_read_only_the_values_asked_for() {
        let mut seen = SeenMembers::new(&["model", "stream_options"]);
        // What lies between is never read: here it is not even JSON.
        let text = br#"{"model": "a\"b" , not json at all, "stream_options":{"x":[1]} }"#;
        seen.saw("model", || Some(10));
        seen.saw("", || unreachable!("only the members asked for are placed"));
        seen.saw("stream_options", || Some(53));
        let spans = ObjectSpans::from_seen(text, &seen).unwrap();
        assert_eq!(
            spans.value("model").map(|r| &text[r]),
            Some(&br#""a\"b""#[..])
        );
        assert_eq!(
            spans.value("stream_options").map(|r| &text[r]),
            Some(&br#"{"x":[1]}"#[..])
        );
        assert_eq!((spans.members(), spans.close()), (3, text.len() - 1));
        // One member alone, without the others' values.
        assert_eq!(
            seen.value_of(text, "stream_options")
                .map(|r| r.map(|r| &text[r])),
            Some(Some(&br#"{"x":[1]}"#[..]))
        );
        assert_eq!(seen.value_of(text, "other"), None, "not one to place");
        let unseen = SeenMembers::new(&["model", "stream_options"]);
        assert_eq!(unseen.value_of(b"{}", "model"), Some(None), "absent");
        // A member whose key was not read in place cannot be placed.
        let mut escaped = SeenMembers::new(&["model"]);
        escaped.saw("model", || None);
        assert_eq!(ObjectSpans::from_seen(b"{}", &escaped), None);
        assert_eq!(escaped.value_of(b"{}", "model"), None);
        // Absent members are appended where the object closes.
        let absent = SeenMembers::new(&["model"]);
        let spans = ObjectSpans::from_seen(b"{ } ", &absent).unwrap();
        assert_eq!((spans.value("model"), spans.close()), (None, 2));
        // Nothing seen (a request not made by a parse): read whole.
        assert_eq!(
            ObjectSpans::from_seen(b"{}", &SeenMembers::<1>::default()),
            None
        );
    }

    #[test]
    fn a_key_read_in_place_says_where_it_ends_and_an_escaped_one_does_not() {
        let key = |text: &str| {
            let mut de = serde_json::Deserializer::from_str(text);
            KeyIndex::located(&["model", "messages"][..], text.as_bytes())
                .deserialize(&mut de)
                .unwrap()
        };
        assert_eq!(key(r#""messages""#), (Some(1), Some(9)));
        assert_eq!(key(r#""messag\u0065s""#), (Some(1), None));
        assert_eq!(key(r#""other""#), (None, Some(6)));
        let mut de = serde_json::Deserializer::from_str(r#""model""#);
        assert_eq!(
            KeyIndex::new(&["model"]).deserialize(&mut de).unwrap(),
            (Some(0), None)
        );
    }

    fn set(body: &str, key: &str, value: &str) -> Option<String> {
        set_member(body.as_bytes(), key, value.as_bytes()).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn set_member_appends_or_replaces_in_place() {
        assert_eq!(
            set(r#"{"a":1}"#, "b", "true").as_deref(),
            Some(r#"{"a":1,"b":true}"#)
        );
        assert_eq!(set("{}", "b", "0").as_deref(), Some(r#"{"b":0}"#));
        assert_eq!(set(" { } ", "b", "0").as_deref(), Some(r#" { "b":0} "#));
        assert_eq!(
            set(r#"{"b":false,"a":[1,2]}"#, "b", "true").as_deref(),
            Some(r#"{"b":true,"a":[1,2]}"#)
        );
        // Whitespace anywhere is kept as it was; the new member goes before the brace.
        assert_eq!(
            set("{\n  \"a\" : 1 ,\n  \"b\" :\tnull\n}\n", "b", "true").as_deref(),
            Some("{\n  \"a\" : 1 ,\n  \"b\" :\ttrue\n}\n")
        );
        assert_eq!(
            set("{\"a\":1\n}", "c", "2").as_deref(),
            Some("{\"a\":1\n,\"c\":2}")
        );
    }

    #[test]
    fn the_last_of_a_repeated_key_is_the_one_set() {
        assert_eq!(
            set(r#"{"b":1,"a":0,"b":2}"#, "b", "3").as_deref(),
            Some(r#"{"b":1,"a":0,"b":3}"#)
        );
    }

    #[test]
    fn keys_match_once_unescaped_and_strings_cannot_pass_for_members() {
        assert_eq!(
            set(r#"{"\u0062":1}"#, "b", "2").as_deref(),
            Some(r#"{"\u0062":2}"#)
        );
        // `"b":1` inside a string, and `b` as a nested key, are not the member.
        assert_eq!(
            set(r#"{"x":"\"b\":1","y":{"b":1}}"#, "b", "2").as_deref(),
            Some(r#"{"x":"\"b\":1","y":{"b":1},"b":2}"#)
        );
        // A key that needs escaping is written escaped.
        assert_eq!(set("{}", "a\"b", "1").as_deref(), Some(r#"{"a\"b":1}"#));
    }

    #[test]
    fn only_one_valid_object_is_edited() {
        for body in [
            "",
            "[1]",
            "\"x\"",
            "null",
            "{",
            r#"{"a":1} {"b":2}"#,
            r#"{"a":1,}"#,
            r#"{"a":1} x"#,
            "{\"a\":\"\u{1}\"}",
        ] {
            assert_eq!(set(body, "b", "1"), None, "{body:?}");
        }
        assert_eq!(set_member(b"{\"a\":\"\xff\"}", "b", b"1"), None);
    }

    #[test]
    fn spans_point_at_the_values() {
        let body = br#"{"a" : [1, {"x":"]"}] ,"b":"s\"t","c":null}"#;
        let spans = object_spans(body, &["a", "b", "d"]).unwrap();
        let text = |k| std::str::from_utf8(&body[spans.value(k).unwrap()]).unwrap();
        assert_eq!(text("a"), r#"[1, {"x":"]"}]"#);
        assert_eq!(text("b"), r#""s\"t""#);
        assert_eq!(spans.value("d"), None);
        assert_eq!(spans.value("c"), None, "not asked for");
        assert_eq!(spans.members(), 3);
    }

    #[test]
    fn edits_apply_in_order_and_never_overlap() {
        let text = b"0123456789";
        let edit = |r: Range<usize>, t: &str| Edit {
            range: r,
            text: t.as_bytes().to_vec(),
        };
        assert_eq!(
            apply(
                text,
                vec![edit(8..9, "x"), edit(0..2, ""), edit(5..5, "ab")]
            )
            .unwrap(),
            b"234ab567x9"
        );
        assert_eq!(apply(text, vec![edit(1..4, ""), edit(3..5, "")]), None);
        assert_eq!(apply(text, vec![edit(9..11, "")]), None);
        assert_eq!(apply(text, vec![]).unwrap(), text);
    }

    #[test]
    fn elements_of_checked_arrays() {
        let all = |t: &str| -> Vec<String> {
            elements(t.as_bytes())
                .map(|e| String::from_utf8(e.to_vec()).unwrap())
                .collect()
        };
        assert_eq!(all("[]"), Vec::<String>::new());
        assert_eq!(all(" [ ] "), Vec::<String>::new());
        assert_eq!(
            all("[1,-2.5e3 , true,null]"),
            ["1", "-2.5e3", "true", "null"]
        );
        assert_eq!(
            all(r#"[ "a,]\"\\" , {"k":[1,"]}"]} ,[[]],{}]"#),
            [r#""a,]\"\\""#, r#"{"k":[1,"]}"]}"#, "[[]]", "{}"]
        );
        assert_eq!(all("{\"a\":1}"), Vec::<String>::new());
        // Malformed text is read safely, whatever comes out.
        for t in ["[", "[\"", "[{", "[1,", "[\"\\", "[}]", "[]]]"] {
            let _ = all(t);
        }
    }

    #[test]
    fn unescaping_matches_serde_json() {
        for raw in [
            "plain",
            "",
            r#"a\"b\\c\/d\b\f\n\r\t"#,
            r"\u0041\u00e9\u4e2d\ud83d\ude00 end",
            r"\u00e9\u00e9",
            "caf\u{e9} \u{1f600}",
        ] {
            let quoted = format!("\"{raw}\"");
            let expected: String = serde_json::from_str(&quoted).unwrap();
            let mut text = String::new();
            let mut buf = [0u8; 4];
            for piece in Unescaped::new(raw) {
                text.push_str(std::str::from_utf8(piece.bytes(&mut buf)).unwrap());
            }
            assert_eq!(text, expected, "{raw}");
            assert_eq!(unescaped_len(raw), expected.len(), "{raw}");
        }
        // Malformed escapes never panic.
        for raw in [r"\", r"\u12", r"\ud800", r"\ud800\u0041", r"\x", r"\udc00"] {
            let _ = Unescaped::new(raw).count();
            let _ = unescaped_len(raw);
        }
    }
}
