//! Server-sent events as a stream's chunks arrive: splitting them into events (an event may
//! span chunks, and a chunk hold several), reading an event's data, and the filter that
//! removes from a draft's stream what the selector asked for and the client did not.

use bytes::{Bytes, BytesMut};
use serde_json::Value;
use std::borrow::Cow;

/// The largest event kept while its end has not come: vLLM's events are a token's delta
/// (kilobytes with log-probabilities). A stream whose event grows past it is passed on as it
/// comes, unsplit, rather than kept without bound.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// Splits a stream's chunks into whole events, keeping an unfinished one for the next chunk.
#[derive(Debug, Default)]
pub struct SseEvents {
    unfinished: Vec<u8>,
    /// Bytes of `unfinished` already searched for an event's end, so that a long event is
    /// scanned once, not again with every chunk.
    scanned: usize,
    /// An event outgrew [`MAX_EVENT_BYTES`]: the rest of the stream passes unsplit.
    passthrough: bool,
}

impl SseEvents {
    /// Calls `each` with every event that `chunk` completes, with its terminating blank line.
    /// Returns whether those events were exactly `chunk`: nothing carried in from an earlier
    /// chunk and nothing left over for a later one. Past an oversized event, `each` gets the
    /// bytes as they come.
    pub fn split(&mut self, chunk: &[u8], mut each: impl FnMut(&[u8])) -> bool {
        if self.passthrough {
            each(chunk);
            return true;
        }
        if self.unfinished.is_empty() {
            let used = split_whole(chunk, 0, &mut each);
            match chunk.get(used..).filter(|r| !r.is_empty()) {
                Some(rest) => self.keep(rest.to_vec(), &mut each),
                None => return true,
            }
            return false;
        }
        let mut unfinished = std::mem::take(&mut self.unfinished);
        unfinished.extend_from_slice(chunk);
        // An end may straddle the old and the new bytes: look from just before the seam.
        let resume = self.scanned.saturating_sub(3);
        let used = split_whole(&unfinished, resume, &mut each);
        unfinished.drain(..used);
        self.keep(unfinished, &mut each);
        false
    }

    /// Keeps `rest`, which holds no event's end, for the next chunk, unless it is too large.
    fn keep(&mut self, rest: Vec<u8>, each: &mut impl FnMut(&[u8])) {
        if rest.len() > MAX_EVENT_BYTES {
            each(&rest);
            self.passthrough = true;
            self.scanned = 0;
            return;
        }
        self.scanned = rest.len();
        self.unfinished = rest;
    }

    /// The bytes of an unfinished event, at the end of the stream.
    pub fn take_rest(&mut self) -> Vec<u8> {
        self.scanned = 0;
        std::mem::take(&mut self.unfinished)
    }
}

/// Calls `each` with the whole events at the start of `buf`, the first searched from `from`
/// on; returns the bytes they span.
fn split_whole(buf: &[u8], from: usize, each: &mut impl FnMut(&[u8])) -> usize {
    let mut start = 0;
    let mut search_from = from;
    while let Some(end) = buf
        .get(start..)
        .and_then(|rest| event_end(rest, search_from))
    {
        if let Some(event) = buf.get(start..start + end) {
            each(event);
        }
        start += end;
        search_from = 0;
    }
    start
}

/// The length of the first event in `buf`, through the blank line that ends it (`\n\n` or
/// `\r\n\r\n`, as servers write them), if it is complete; the search starts at `from`.
fn event_end(buf: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let newline = from + buf.get(from..)?.iter().position(|&b| b == b'\n')?;
        match buf.get(newline + 1..) {
            Some([b'\n', ..]) => return Some(newline + 2),
            Some([b'\r', b'\n', ..]) => return Some(newline + 3),
            _ => from = newline + 1,
        }
    }
}

/// An event's data: its `data:` lines joined by `\n`, or None when it has none (a comment,
/// a keep-alive).
pub fn data(event: &[u8]) -> Option<Cow<'_, [u8]>> {
    let mut lines = event
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(|value| value.strip_prefix(b" ").unwrap_or(value));
    let first = lines.next()?;
    let Some(second) = lines.next() else {
        return Some(Cow::Borrowed(first));
    };
    let mut joined = first.to_vec();
    for line in std::iter::once(second).chain(lines) {
        joined.push(b'\n');
        joined.extend_from_slice(line);
    }
    Some(Cow::Owned(joined))
}

/// Removes from a stream what the selector asked the upstream for on the client's behalf:
/// the token logprobs a hold-back window needed, and the usage chunk the token metrics need.
/// Events it does not change pass as they came; a chunk of whole unchanged events is passed
/// on as the same buffer.
#[derive(Debug, Default)]
pub struct StreamFilter {
    events: SseEvents,
    /// Set every choice's `logprobs` to `null`, as vLLM streams them when not asked.
    pub strip_logprobs: bool,
    /// Drop the usage chunk (`"choices": []` with `usage`) vLLM sends before `[DONE]`.
    pub drop_usage: bool,
}

impl StreamFilter {
    pub fn new(strip_logprobs: bool, drop_usage: bool) -> Self {
        Self {
            events: SseEvents::default(),
            strip_logprobs,
            drop_usage,
        }
    }

    pub fn is_active(&self) -> bool {
        self.strip_logprobs || self.drop_usage
    }

    /// Filters one body chunk in place; `end` marks the stream's last.
    pub fn apply(&mut self, body: &mut Option<Bytes>, end: bool) {
        if !self.is_active() {
            return;
        }
        let chunk = body.take().unwrap_or_default();
        let mut out = BytesMut::new();
        let mut changed = false;
        let (strip, drop_usage) = (self.strip_logprobs, self.drop_usage);
        let whole = self
            .events
            .split(&chunk, |event| match rewrite(event, strip, drop_usage) {
                Rewrite::Same => out.extend_from_slice(event),
                Rewrite::Drop => changed = true,
                Rewrite::Into(new) => {
                    out.extend_from_slice(&new);
                    changed = true;
                }
            });
        if end {
            // An unfinished last event goes out as it is: the client sees what the upstream sent.
            out.extend_from_slice(&self.events.take_rest());
        }
        *body = if whole && !changed {
            Some(chunk)
        } else if out.is_empty() {
            None
        } else {
            Some(out.freeze())
        };
    }
}

enum Rewrite {
    Same,
    Drop,
    Into(Vec<u8>),
}

fn rewrite(event: &[u8], strip_logprobs: bool, drop_usage: bool) -> Rewrite {
    let Some(data) = data(event) else {
        return Rewrite::Same;
    };
    // Most events need neither: look before parsing.
    let has_usage = drop_usage && contains(&data, b"\"usage\"");
    let has_logprobs = strip_logprobs && contains(&data, b"\"logprobs\"");
    if !has_usage && !has_logprobs {
        return Rewrite::Same;
    }
    let Ok(mut chunk) = serde_json::from_slice::<Value>(&data) else {
        return Rewrite::Same;
    };
    let no_choices = chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty);
    if has_usage && no_choices && chunk.get("usage").is_some_and(Value::is_object) {
        return Rewrite::Drop;
    }
    if has_logprobs && crate::confidence::clear_logprobs(&mut chunk) {
        if let Ok(json) = serde_json::to_vec(&chunk) {
            let mut event = Vec::with_capacity(json.len() + 8);
            event.extend_from_slice(b"data: ");
            event.extend_from_slice(&json);
            event.extend_from_slice(b"\n\n");
            return Rewrite::Into(event);
        }
    }
    Rewrite::Same
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_that_never_ends_is_not_kept_without_bound() {
        let mut events = SseEvents::default();
        let mut passed = 0usize;
        let piece = vec![b'a'; 64 * 1024];
        for _ in 0..64 {
            events.split(&piece, |bytes| passed += bytes.len());
        }
        assert!(events.unfinished.len() <= MAX_EVENT_BYTES);
        assert_eq!(
            passed + events.unfinished.len(),
            64 * piece.len(),
            "nothing lost"
        );
        // Past it, chunks pass as they come.
        let mut seen = Vec::new();
        events.split(b"data: {}\n\n", |bytes| seen.push(bytes.to_vec()));
        assert_eq!(seen, vec![b"data: {}\n\n".to_vec()]);
    }

    #[test]
    fn an_end_split_across_chunks_is_found() {
        for cut in 1..12 {
            let stream = b"data: 1\r\n\r\ndata: 2\n\n";
            let (a, b) = stream.split_at(cut.min(stream.len()));
            assert_eq!(
                events_of(&[a, b]),
                vec!["data: 1\r\n\r\n", "data: 2\n\n"],
                "cut at {cut}"
            );
        }
    }

    const STREAM: &str = include_str!("../../../tests/fixtures/vllm-chat-stream.sse");

    fn events_of(chunks: &[&[u8]]) -> Vec<String> {
        let mut events = SseEvents::default();
        let mut out = Vec::new();
        for chunk in chunks {
            events.split(chunk, |e| out.push(String::from_utf8_lossy(e).into_owned()));
        }
        out
    }

    #[test]
    fn events_are_whole_however_the_stream_is_cut() {
        let whole = events_of(&[STREAM.as_bytes()]);
        assert_eq!(whole.len(), STREAM.matches("\n\n").count());
        assert_eq!(whole.concat(), STREAM);
        for cut in 1..STREAM.len() {
            let (a, b) = STREAM.as_bytes().split_at(cut);
            assert_eq!(events_of(&[a, b]), whole, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = STREAM.as_bytes().chunks(1).collect();
        assert_eq!(events_of(&bytes), whole);
    }

    #[test]
    fn a_chunk_of_whole_events_says_so() {
        let mut events = SseEvents::default();
        assert!(events.split(b"data: 1\n\ndata: 2\n\n", |_| {}));
        assert!(!events.split(b"data: 3\n\nda", |_| {}));
        assert!(!events.split(b"ta: 4\n\n", |_| {}));
        assert!(events.split(b"data: 5\r\n\r\n", |_| {}));
    }

    #[test]
    fn data_lines_are_read_and_joined() {
        assert_eq!(data(b"data: [DONE]\n\n").as_deref(), Some(&b"[DONE]"[..]));
        assert_eq!(data(b"data:x\r\n\r\n").as_deref(), Some(&b"x"[..]));
        assert_eq!(
            data(b"event: a\ndata: 1\ndata: 2\n\n").as_deref(),
            Some(&b"1\n2"[..])
        );
        assert_eq!(data(b": keep-alive\n\n"), None);
    }

    fn filtered(filter: &mut StreamFilter, chunks: &[&[u8]]) -> String {
        let mut out = String::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let mut body = Some(Bytes::copy_from_slice(chunk));
            filter.apply(&mut body, i + 1 == chunks.len());
            if let Some(b) = body {
                out.push_str(std::str::from_utf8(&b).unwrap());
            }
        }
        out
    }

    #[test]
    fn the_usage_chunk_is_dropped_and_nothing_else() {
        let expected: String = STREAM
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"usage\""))
            .collect();
        assert_eq!(expected.matches("\n\n").count(), 6);
        for cut in [1, 100, 700, STREAM.len() - 20] {
            let (a, b) = STREAM.as_bytes().split_at(cut);
            let mut filter = StreamFilter::new(false, true);
            assert_eq!(filtered(&mut filter, &[a, b]), expected, "cut at {cut}");
        }
    }

    #[test]
    fn logprobs_are_set_to_null_as_vllm_streams_them() {
        let with = r#"data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.1,"bytes":[72,105],"top_logprobs":[]}]},"finish_reason":null}]}

"#;
        let mut filter = StreamFilter::new(true, false);
        assert_eq!(
            filtered(&mut filter, &[with.as_bytes()]),
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
        );
    }

    #[test]
    fn an_unchanged_chunk_is_passed_on_as_the_same_buffer() {
        let mut filter = StreamFilter::new(true, true);
        let first = STREAM.split_inclusive("\n\n").next().unwrap();
        let chunk = Bytes::copy_from_slice(first.as_bytes());
        let mut body = Some(chunk.clone());
        filter.apply(&mut body, false);
        assert_eq!(body.unwrap().as_ptr(), chunk.as_ptr());
    }

    #[test]
    fn an_inactive_filter_touches_nothing_and_a_cut_last_event_is_kept() {
        let mut idle = StreamFilter::default();
        assert_eq!(
            filtered(&mut idle, &[b"data: {\"usage\""]),
            "data: {\"usage\""
        );
        let mut filter = StreamFilter::new(false, true);
        assert_eq!(
            filtered(&mut filter, &[b"data: 1\n\nda", b"ta: {\"usa"]),
            "data: 1\n\ndata: {\"usa"
        );
    }
}
