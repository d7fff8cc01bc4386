//! The filter that removes from a draft's stream the token logprobs the selector asked for
//! (to judge the stream's start) and the client did not. The usage chunk is the core's to
//! remove (see [`sluice_sdk::usage`]).

use bytes::{Bytes, BytesMut};
use sluice_sdk::family::Logprobs;
use sluice_sdk::sse::{data, SseEvents};

/// Removes from a stream the token logprobs a hold-back window needed and the client did not
/// ask for. Events it does not change pass as they came; a chunk of whole unchanged events is
/// passed on as the same buffer.
#[derive(Debug, Default)]
pub struct StreamFilter {
    events: SseEvents,
    /// Where the stream's family carries log-probabilities; `None`: it carries none.
    logprobs: Option<&'static dyn Logprobs>,
    /// Take the log-probabilities out, as vLLM streams them when not asked.
    pub strip_logprobs: bool,
}

impl StreamFilter {
    /// A filter of a stream of the family whose log-probabilities are `logprobs`; it
    /// changes nothing until told to strip them.
    pub fn new(logprobs: Option<&'static dyn Logprobs>) -> Self {
        Self {
            events: SseEvents::default(),
            logprobs,
            strip_logprobs: false,
        }
    }

    pub fn is_active(&self) -> bool {
        self.strip_logprobs && self.logprobs.is_some()
    }

    /// Filters one body chunk in place; `end` marks the stream's last.
    pub fn apply(&mut self, body: &mut Option<Bytes>, end: bool) {
        if !self.is_active() {
            return;
        }
        let chunk = body.take().unwrap_or_default();
        let mut out = BytesMut::new();
        let mut changed = false;
        let logprobs = self.logprobs;
        let whole = self
            .events
            .split(&chunk, |event| match rewrite(logprobs, event) {
                Some(new) => {
                    out.extend_from_slice(&new);
                    changed = true;
                }
                None => out.extend_from_slice(event),
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

/// The event with its log-probabilities taken out, or None to pass it as it came.
fn rewrite(logprobs: Option<&dyn Logprobs>, event: &[u8]) -> Option<Vec<u8>> {
    let data = data(event)?;
    let json = logprobs?.strip(&data)?;
    let mut event = Vec::with_capacity(json.len() + 8);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(&json);
    event.extend_from_slice(b"\n\n");
    Some(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = include_str!("../../../tests/fixtures/vllm-chat-stream.sse");

    fn chat_filter() -> StreamFilter {
        let mut filter =
            StreamFilter::new(sluice_sdk::Endpoint::ChatCompletions.family().logprobs());
        filter.strip_logprobs = true;
        filter
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
    fn a_stream_without_logprobs_passes_whole_usage_chunk_included() {
        // The usage chunk is the core's to remove, before this filter runs: kept here.
        for cut in [1, 100, 700, STREAM.len() - 20] {
            let (a, b) = STREAM.as_bytes().split_at(cut);
            let mut filter = chat_filter();
            assert_eq!(filtered(&mut filter, &[a, b]), STREAM, "cut at {cut}");
        }
    }

    #[test]
    fn logprobs_are_set_to_null_as_vllm_streams_them() {
        let with = r#"data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.1,"bytes":[72,105],"top_logprobs":[]}]},"finish_reason":null}]}

"#;
        let mut filter = chat_filter();
        assert_eq!(
            filtered(&mut filter, &[with.as_bytes()]),
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
        );
    }

    #[test]
    fn an_unchanged_chunk_is_passed_on_as_the_same_buffer() {
        let mut filter = chat_filter();
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
        let mut filter = chat_filter();
        assert_eq!(
            filtered(&mut filter, &[b"data: 1\n\nda", b"ta: {\"logp"]),
            "data: 1\n\ndata: {\"logp"
        );
    }
}
