//! Server-sent events as a stream's chunks arrive: splitting them into events (an event may
//! span chunks, and a chunk hold several) and reading an event's data. The core splits a
//! stream with it to remove the usage chunk a client did not ask for; plugins that change
//! events of a stream use it the same way.

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
}
