//! Live fan-out: the coalesced followers of a streaming leader get its answer as it is made,
//! not once it is whole (what a CDN does with request collapsing on a streaming miss).
//!
//! The leader's stream already passes the cache's `response_body` hook chunk by chunk (the
//! tee). From its first `200` event-stream header on, a [`Writer`] also splits it into events
//! and appends them to a shared, append-only [`Live`] log: each event's JSON text as the
//! upstream sent it, with where its `id` and `created` values are. Every follower has its own
//! [`Reader`]: a cursor in the log, and its own `id` and `created`. It renders each event as
//! the upstream's text with its own two values spliced in (as a JSON hit is, see
//! [`crate::entry`]), so a follower sees exactly the leader's chunks (deltas, log-probs, tool
//! calls, finish reasons) under its own identity: what was produced so far at once, in one
//! write, then every event as it arrives.
//!
//! - **The leader never waits.** Appending takes the log's lock for a push, then wakes the
//!   readers (a `watch` channel: a reader that was busy writing finds the news when it next
//!   looks). A reader whose client reads slowly just lags in the log; its own client's send
//!   timeout cuts it if it stops reading. Nobody else is slowed by it.
//! - **Bounded**: the log holds at most `max_entry_bytes` of the upstream's stream, the most
//!   an entry may have; past that it is dropped (an answer that large is not cached either)
//!   and the log fails.
//! - **Usage**: the usage chunk is passed only to readers that asked for it
//!   (`stream_options.include_usage`); when the leader's stream had none (its client did not
//!   ask, so the core kept it from the hooks), a reader that asked gets one made from the
//!   usage the core found.
//! - **Failure**: a log that ends without `[DONE]` after a complete stream (an error event,
//!   a cut, the leader's client gone, too big) *fails*. A reader that has written something
//!   ends its stream with an SSE error event and `[DONE]`, never a silent cut: the upstream's
//!   own error event when there was one, else Sluice's. A reader that has written nothing yet
//!   goes back to coalescing ([`Reader::readiness`]): the failed leader's lead is handed on as
//!   before.

use crate::entry::{self, AnswerKind, IdentitySpans};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use sluice_sdk::error::ErrorReply;
use sluice_sdk::plugin::LocalStream;
use sluice_sdk::sse::{self, SseEvents};
use sluice_sdk::{async_trait, Usage};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;

/// One leader's stream, as far as it has come.
pub struct Live {
    kind: AnswerKind,
    /// The pool that makes the answer, for the followers' `x-sluice-pool`.
    pool: String,
    log: Mutex<Log>,
    /// Bumped after every change to the log.
    more: watch::Sender<()>,
    /// Readers holding a [`Ticket`]: they count against `max_followers`.
    readers: AtomicUsize,
}

#[derive(Default)]
struct Log {
    events: Vec<Event>,
    /// The upstream's `model` value, as text, for a usage chunk made here.
    model: Option<String>,
    end: Option<End>,
}

/// An upstream event's JSON text.
struct Event {
    data: Bytes,
    /// Where its `id` and `created` are; `None`: passed on as sent.
    identity: Option<IdentitySpans>,
    /// The usage chunk (no choices, a usage object).
    usage_only: bool,
}

enum End {
    /// `[DONE]` after a complete stream; the usage the core found, and whether the stream
    /// had its own usage chunk.
    Done {
        usage: Option<Usage>,
        had_usage_chunk: bool,
    },
    /// The SSE events a reader that has written something ends with (`[DONE]` included).
    Failed(Bytes),
}

impl Live {
    pub fn new(kind: AnswerKind, pool: &str) -> Arc<Self> {
        Arc::new(Self {
            kind,
            pool: pool.to_string(),
            log: Mutex::default(),
            more: watch::Sender::new(()),
            readers: AtomicUsize::new(0),
        })
    }

    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// The log, even after a panic elsewhere: each change to it is one step.
    fn log(&self) -> MutexGuard<'_, Log> {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place among this stream's readers.
    pub fn enter(self: &Arc<Self>) -> Ticket {
        self.readers.fetch_add(1, Ordering::Relaxed);
        Ticket(self.clone())
    }

    /// How many readers it has.
    pub fn readers(&self) -> usize {
        self.readers.load(Ordering::Relaxed)
    }

    /// Whether it failed: nobody new should join it.
    pub fn failed(&self) -> bool {
        matches!(self.log().end, Some(End::Failed(_)))
    }

    /// Ends the log, once; `drop_events` frees what it held (readers then get only the end).
    fn finish(&self, end: End, drop_events: bool) {
        {
            let mut log = self.log();
            if log.end.is_some() {
                return;
            }
            if drop_events {
                log.events = Vec::new();
            }
            log.end = Some(end);
        }
        self.more.send_replace(());
    }
}

/// A follower's place among a [`Live`] stream's readers, taken when it joins: it becomes a
/// [`Reader`] once the follower knows its own identity.
pub struct Ticket(Arc<Live>);

impl Ticket {
    pub fn live(&self) -> &Arc<Live> {
        &self.0
    }

    pub fn reader(self, id: String, created: u64, include_usage: bool) -> Reader {
        let more = self.0.more.subscribe();
        Reader {
            ticket: self,
            more,
            next: 0,
            id,
            created,
            include_usage,
            wrote: false,
            finished: false,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.readers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the leader's `response_body` hook feeds: the stream's chunks, parsed into the log.
pub struct Writer {
    live: Arc<Live>,
    events: SseEvents,
    /// Bytes of the stream so far, and the most the log may hold.
    bytes: usize,
    max_bytes: usize,
    done: bool,
    /// The stream's own error event, if it had one.
    error: Option<Bytes>,
    had_usage_chunk: bool,
    any_event: bool,
}

impl Writer {
    pub fn new(live: Arc<Live>, max_bytes: usize) -> Self {
        Self {
            live,
            events: SseEvents::default(),
            bytes: 0,
            max_bytes,
            done: false,
            error: None,
            had_usage_chunk: false,
            any_event: false,
        }
    }

    /// Adds a chunk of the leader's stream. `true` when it brought the stream's first event.
    /// An event that lies whole in `chunk` is kept as a slice of it (the tee holds the chunk
    /// anyway), so the log copies only events split across chunks.
    pub fn feed(&mut self, chunk: &Bytes) -> bool {
        if self.bytes > self.max_bytes {
            return false;
        }
        self.bytes += chunk.len();
        if self.bytes > self.max_bytes {
            let too_big = failure(
                "The answer this request shared with an identical one was too large to share; \
                 try again.",
            );
            self.live.finish(End::Failed(too_big), true);
            return false;
        }
        let mut parsed = Vec::new();
        let (done, error) = (&mut self.done, &mut self.error);
        self.events.split(chunk, |event| {
            let Some(data) = sse::data(event) else {
                return;
            };
            if data.as_ref() == b"[DONE]" {
                *done = true;
            } else if let Some(event) = parse(share_or_copy(chunk, &data)) {
                parsed.push(event);
            }
        });
        let mut first = false;
        if !parsed.is_empty() {
            let mut log = self.live.log();
            for (event, model, is_error) in parsed {
                if is_error {
                    let mut text = b"data: ".to_vec();
                    text.extend_from_slice(&event.data);
                    text.extend_from_slice(b"\n\ndata: [DONE]\n\n");
                    *error = Some(Bytes::from(text));
                    continue;
                }
                if log.model.is_none() {
                    log.model = model;
                }
                self.had_usage_chunk |= event.usage_only;
                first |= !self.any_event;
                self.any_event = true;
                log.events.push(event);
            }
            drop(log);
            self.live.more.send_replace(());
        }
        first
    }

    /// The leader's stream ended; `usage` is what the core found in it.
    pub fn end(&mut self, usage: Option<Usage>) {
        let end = match (&self.error, self.done && self.any_event) {
            (None, true) => End::Done {
                usage,
                had_usage_chunk: self.had_usage_chunk,
            },
            (Some(error), _) => End::Failed(error.clone()),
            (None, false) => End::Failed(cut()),
        };
        self.live.finish(end, false);
    }
}

impl Drop for Writer {
    /// A leader that leaves before its stream ended (its client gone, its attempt broken)
    /// fails its log.
    fn drop(&mut self) {
        self.live.finish(End::Failed(cut()), false);
    }
}

fn cut() -> Bytes {
    failure("The answer this request shared with an identical one ended early; try again.")
}

fn failure(message: &str) -> Bytes {
    ErrorReply::bad_gateway(message).sse_event()
}

/// What the log needs of an event, read without building it.
#[derive(Deserialize)]
struct Shape<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    created: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    choices: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
}

/// An event's data as the log keeps it, the model it names, and whether it is an error.
/// `None`: not JSON text, which no client could read either.
/// `part` as a reference-counted slice of `chunk` when it lies inside it, else a copy.
fn share_or_copy(chunk: &Bytes, part: &[u8]) -> Bytes {
    let offset = (part.as_ptr() as usize).checked_sub(chunk.as_ptr() as usize);
    match offset {
        Some(start) if start + part.len() <= chunk.len() => chunk.slice(start..start + part.len()),
        _ => Bytes::copy_from_slice(part),
    }
}

fn parse(data: Bytes) -> Option<(Event, Option<String>, bool)> {
    let text = std::str::from_utf8(&data).ok()?;
    let (identity, model, usage_only, is_error) = match serde_json::from_str::<Shape>(text) {
        Ok(shape) => {
            let identity = match (shape.id, shape.created) {
                (Some(id), Some(created)) => entry::identity_spans(text, id, created),
                _ => None,
            };
            let no_choices = shape
                .choices
                .is_some_and(|c| c.get().trim_start_matches('[').trim_start() == "]");
            (
                identity,
                shape.model.map(|m| m.get().to_string()),
                no_choices && shape.usage.is_some(),
                shape.error.is_some(),
            )
        }
        // A repeated key, say: passed on as sent.
        Err(_) => {
            serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
            (None, None, false, false)
        }
    };
    let event = Event {
        data,
        identity,
        usage_only,
    };
    Some((event, model, is_error))
}

/// Whether a reader has something to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Events, or the end of a complete stream.
    Ready,
    /// Nothing yet.
    Waiting,
    /// The log failed before this reader wrote anything: it should coalesce again.
    Failed,
}

/// A follower's cursor in a [`Live`] log, rendering it with the follower's own identity.
pub struct Reader {
    ticket: Ticket,
    more: watch::Receiver<()>,
    next: usize,
    id: String,
    created: u64,
    include_usage: bool,
    wrote: bool,
    finished: bool,
}

impl Reader {
    pub fn live(&self) -> &Arc<Live> {
        self.ticket.live()
    }

    pub fn readiness(&mut self) -> Readiness {
        self.more.borrow_and_update();
        let log = self.ticket.0.log();
        match &log.end {
            Some(End::Failed(_)) if !self.wrote => Readiness::Failed,
            Some(_) => Readiness::Ready,
            None if log.events.len() > self.next => Readiness::Ready,
            None => Readiness::Waiting,
        }
    }

    /// Waits until the log changes.
    pub async fn changed(&mut self) {
        // The sender lives as long as the log: an error cannot come while a reader has it.
        let _ = self.more.changed().await;
    }

    /// Everything there is to write now: the events past the cursor, and the end when the
    /// log has ended. Empty when there is nothing yet.
    fn take(&mut self) -> Vec<u8> {
        self.more.borrow_and_update();
        let live = &self.ticket.0;
        let log = live.log();
        let mut out = Vec::new();
        for event in log.events.get(self.next..).unwrap_or_default() {
            if event.usage_only && !self.include_usage {
                continue;
            }
            out.extend_from_slice(b"data: ");
            let spliced = event.identity.as_ref().and_then(|spans| {
                let text = std::str::from_utf8(&event.data).ok()?;
                entry::splice_at(&mut out, text, spans, &self.id, self.created)
            });
            if spliced.is_none() {
                out.extend_from_slice(&event.data);
            }
            out.extend_from_slice(b"\n\n");
        }
        self.next = self.next.max(log.events.len());
        match &log.end {
            None => {}
            Some(End::Failed(events)) => {
                out.extend_from_slice(events);
                self.finished = true;
            }
            Some(End::Done {
                usage,
                had_usage_chunk,
            }) => {
                if let (true, false, Some(usage)) = (self.include_usage, had_usage_chunk, usage) {
                    let chunk = serde_json::json!({
                        "id": self.id,
                        "object": live.kind.chunk_object(),
                        "created": self.created,
                        "model": log.model.as_deref().and_then(|m| serde_json::from_str::<serde_json::Value>(m).ok()),
                        "choices": [],
                        "usage": entry::usage_object(*usage),
                    });
                    out.extend_from_slice(b"data: ");
                    let _ = serde_json::to_writer(&mut out, &chunk);
                    out.extend_from_slice(b"\n\n");
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.finished = true;
            }
        }
        self.wrote |= !out.is_empty();
        out
    }
}

#[async_trait]
impl LocalStream for Reader {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if self.finished {
                return None;
            }
            let out = self.take();
            if !out.is_empty() {
                return Some(Bytes::from(out));
            }
            if self.finished {
                return None;
            }
            self.changed().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn event(i: usize, content: &str, finish: Option<&str>) -> String {
        let v = serde_json::json!({
            "id": "chatcmpl-leader", "object": "chat.completion.chunk", "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "logprobs": null,
                         "finish_reason": finish}],
        });
        let _ = i;
        format!("data: {v}\n\n")
    }

    fn datas(bytes: &[u8]) -> Vec<String> {
        std::str::from_utf8(bytes)
            .unwrap()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    fn content(datas: &[String]) -> String {
        datas
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect()
    }

    async fn next(reader: &mut Reader) -> Vec<String> {
        datas(&reader.next_chunk().await.unwrap())
    }

    #[test]
    fn an_event_whole_in_its_chunk_is_kept_without_a_copy_and_a_split_one_is_copied() {
        let live = Live::new(AnswerKind::Chat, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        let whole = Bytes::from(event(0, "Hel", None));
        writer.feed(&whole);
        let split = event(1, "lo", None);
        let (a, b) = split.split_at(10);
        writer.feed(&Bytes::copy_from_slice(a.as_bytes()));
        writer.feed(&Bytes::copy_from_slice(b.as_bytes()));
        let log = live.log();
        let inside = |data: &Bytes| {
            let (start, end) = (
                whole.as_ptr() as usize,
                whole.as_ptr() as usize + whole.len(),
            );
            (start..end).contains(&(data.as_ptr() as usize))
        };
        assert!(inside(&log.events[0].data), "shared with the chunk");
        assert_eq!(log.events[0].data, whole.slice(6..whole.len() - 2));
        assert!(!inside(&log.events[1].data));
        assert_eq!(log.events[1].data, split.as_bytes()[6..split.len() - 2]);
    }

    #[tokio::test]
    async fn a_late_reader_gets_the_prefix_at_once_then_each_event_under_its_own_id() {
        let live = Live::new(AnswerKind::Chat, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        // The first event arrives split across chunks.
        let first = event(0, "Hel", None);
        let (a, b) = first.split_at(10);
        assert!(!writer.feed(&Bytes::copy_from_slice(a.as_bytes())));
        assert!(
            writer.feed(&Bytes::copy_from_slice(b.as_bytes())),
            "the first event"
        );
        assert!(!writer.feed(&Bytes::copy_from_slice(event(1, "lo", None).as_bytes())));
        let mut reader = live.enter().reader("chatcmpl-mine".into(), 7, false);
        assert_eq!(live.readers(), 1);
        assert_eq!(reader.readiness(), Readiness::Ready);
        let prefix = next(&mut reader).await;
        assert_eq!(prefix.len(), 2, "the prefix in one write");
        assert_eq!(content(&prefix), "Hello");
        for d in &prefix {
            let v: Value = serde_json::from_str(d).unwrap();
            assert_eq!(
                (v["id"].as_str(), v["created"].as_u64()),
                (Some("chatcmpl-mine"), Some(7))
            );
        }
        assert_eq!(reader.readiness(), Readiness::Waiting);
        let waiting = tokio::spawn(async move {
            let live_event = next(&mut reader).await;
            (reader, live_event)
        });
        tokio::task::yield_now().await;
        writer.feed(&Bytes::copy_from_slice(
            event(2, "!", Some("stop")).as_bytes(),
        ));
        let (mut reader, live_event) = waiting.await.unwrap();
        assert_eq!(content(&live_event), "!");
        writer.feed(&Bytes::from_static(b"data: [DONE]\n\n"));
        writer.end(None);
        assert_eq!(next(&mut reader).await, vec!["[DONE]".to_string()]);
        assert!(reader.next_chunk().await.is_none());
        drop(reader);
        assert_eq!(live.readers(), 0);
    }

    #[tokio::test]
    async fn a_failed_stream_ends_a_reader_that_wrote_with_an_error_event() {
        let live = Live::new(AnswerKind::Chat, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        let mut early = live.enter().reader("a".into(), 1, false);
        let mut wrote = live.enter().reader("b".into(), 1, false);
        writer.feed(&Bytes::copy_from_slice(event(0, "x", None).as_bytes()));
        assert_eq!(content(&next(&mut wrote).await), "x");
        writer.feed(&Bytes::from_static(
            b"data: {\"error\": {\"message\": \"boom\", \"code\": 500}}\n\ndata: [DONE]\n\n",
        ));
        writer.end(None);
        let rest = next(&mut wrote).await;
        assert!(rest[0].contains("boom"), "{rest:?}");
        assert_eq!(rest.last().map(String::as_str), Some("[DONE]"));
        assert!(wrote.next_chunk().await.is_none());
        // One that had written nothing goes back to coalescing.
        assert_eq!(early.readiness(), Readiness::Failed);
        assert!(live.failed());
    }

    #[tokio::test]
    async fn a_leader_that_leaves_or_outgrows_the_bound_fails_its_readers() {
        let live = Live::new(AnswerKind::Chat, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        let mut reader = live.enter().reader("a".into(), 1, false);
        writer.feed(&Bytes::copy_from_slice(event(0, "x", None).as_bytes()));
        next(&mut reader).await;
        drop(writer);
        let rest = next(&mut reader).await;
        let error: Value = serde_json::from_str(&rest[0]).unwrap();
        assert!(error["error"]["message"].is_string(), "{rest:?}");
        assert_eq!(rest[1], "[DONE]");

        let live = Live::new(AnswerKind::Chat, "p");
        let one = event(0, "x", None);
        let mut writer = Writer::new(live.clone(), one.len() + 10);
        let mut reader = live.enter().reader("a".into(), 1, false);
        writer.feed(&Bytes::copy_from_slice(one.as_bytes()));
        next(&mut reader).await;
        writer.feed(&Bytes::copy_from_slice(one.as_bytes()));
        let rest = next(&mut reader).await;
        assert!(rest[0].contains("too large"), "{rest:?}");
        assert_eq!(rest[1], "[DONE]");
    }

    #[tokio::test]
    async fn usage_goes_only_to_readers_that_asked_and_is_made_when_missing() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
        };
        let live = Live::new(AnswerKind::Chat, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        writer.feed(&Bytes::copy_from_slice(
            event(0, "x", Some("stop")).as_bytes(),
        ));
        writer.feed(&Bytes::from_static(b"data: [DONE]\n\n"));
        writer.end(Some(usage));
        let mut asked = live.enter().reader("a".into(), 1, true);
        let got = next(&mut asked).await;
        let made: Value = serde_json::from_str(&got[1]).unwrap();
        assert_eq!(made["usage"]["completion_tokens"], 2);
        assert_eq!(made["model"], "m");
        assert_eq!(made["id"], "a");
        let mut not = live.enter().reader("b".into(), 1, false);
        assert_eq!(next(&mut not).await.len(), 2, "the event and [DONE]");

        // The stream's own usage chunk passes to those that asked, under their id.
        let live = Live::new(AnswerKind::Chat, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        writer.feed(&Bytes::copy_from_slice(
            event(0, "x", Some("stop")).as_bytes(),
        ));
        writer.feed(&Bytes::from_static(b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[ ],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n"));
        writer.end(Some(usage));
        let got = next(&mut live.enter().reader("a".into(), 1, true)).await;
        assert_eq!(got.len(), 3);
        let own: Value = serde_json::from_str(&got[1]).unwrap();
        assert_eq!(
            (own["id"].as_str(), own["usage"]["prompt_tokens"].as_u64()),
            (Some("a"), Some(9))
        );
        assert_eq!(
            next(&mut live.enter().reader("b".into(), 1, false))
                .await
                .len(),
            2
        );
    }
}
