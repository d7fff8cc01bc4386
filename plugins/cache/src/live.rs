//! Live fan-out: the coalesced followers of a streaming leader get its answer as it is made,
//! not once it is whole (what a CDN does with request collapsing on a streaming miss).
//!
//! The leader's stream already passes the cache's `response_body` hook chunk by chunk (the
//! tee). From its first `200` event-stream header on, a [`Writer`] splits each chunk into
//! events and adds them up in a shared [`Live`] log: the family's [`StreamAnswer`], the
//! answer so far (text, tool calls, log-probabilities), which is also what the cache stores
//! when the stream ends. The events themselves are kept only once a follower has joined, from
//! then on: a vLLM delta event is some 200 bytes around a token of 4, and most streams never
//! get a follower (a thousand open streams each held their whole event log before).
//!
//! Every follower has its own [`Reader`]: the answer so far as events (in the upstream's
//! shape, one per choice), then a cursor in the kept events, its own SSE splitter, and its
//! own `id` and `created`. It renders each event as the upstream's text with its own two
//! values spliced in (as a JSON hit is, see [`crate::entry`]), so a follower sees the
//! leader's answer (deltas, log-probs, tool calls, finish reasons) under its own identity:
//! what was produced so far at once, in one write, then every event as it arrives.
//!
//! - **The leader never waits long.** Feeding takes the log's lock for the events' adding up
//!   (the parse the stored answer needs anyway) and, once followed, their copies; then it
//!   wakes the readers (a `watch` channel: a reader that was busy writing finds the news when
//!   it next looks). A reader takes reference counts under the lock and renders outside it;
//!   one that joins renders the answer so far under it, once. A reader whose client reads
//!   slowly just lags in the log; its own client's send timeout cuts it if it stops reading.
//!   Nobody else is slowed by it.
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

use bytes::Bytes;
use sluice_sdk::error::ErrorReply;
use sluice_sdk::family::{AnswerError, AnswerText, StreamAnswer};
use sluice_sdk::plugin::LocalStream;
use sluice_sdk::sse::{self, SseEvents};
use sluice_sdk::{async_trait, ApiFamily, Endpoint, Usage};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;

/// One leader's stream, as far as it has come.
pub struct Live {
    kind: Endpoint,
    /// The pool that makes the answer, for the followers' `x-sluice-pool`.
    pool: String,
    log: Mutex<Log>,
    /// Bumped after every change to the log.
    more: watch::Sender<()>,
    /// Readers holding a [`Ticket`]: they count against `max_followers`.
    readers: AtomicUsize,
}

struct Log {
    /// The answer so far; `None` once the stream outgrew the bound.
    answer: Option<Box<dyn StreamAnswer>>,
    /// The upstream's events since the first reader joined, whole.
    events: Vec<Bytes>,
    /// A reader has joined: the events are kept from then on.
    followed: bool,
    end: Option<End>,
}

#[derive(Clone)]
enum End {
    /// `[DONE]` after a complete stream; the usage the core found.
    Done { usage: Option<Usage> },
    /// The SSE events a reader that has written something ends with (`[DONE]` included).
    Failed(Bytes),
}

impl Live {
    pub fn new(kind: Endpoint, pool: &str) -> Arc<Self> {
        Arc::new(Self {
            kind,
            pool: pool.to_string(),
            log: Mutex::new(Log {
                answer: Some(kind.family().stream_answer()),
                events: Vec::new(),
                followed: false,
                end: None,
            }),
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

    /// Ends the log, once; `drop_all` frees what it held (readers then get only the end).
    fn finish(&self, end: End, drop_all: bool) {
        {
            let mut log = self.log();
            if log.end.is_some() {
                return;
            }
            if drop_all {
                log.answer = None;
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
        let family = self.0.kind.family();
        // The answer so far and the place of the next event, at one moment: the events are
        // kept from here on.
        let (so_far, next) = {
            let mut log = self.0.log();
            log.followed = true;
            let so_far = log.answer.as_ref().map(|a| a.so_far()).unwrap_or_default();
            (so_far, log.events.len())
        };
        let news = if so_far.is_empty() {
            Vec::new()
        } else {
            vec![Bytes::from(so_far)]
        };
        Reader {
            ticket: self,
            more,
            next,
            events: SseEvents::default(),
            news,
            render: Render {
                family,
                id,
                created,
                include_usage,
                model: None,
                had_usage_chunk: false,
            },
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

/// What the leader's `response_body` hook feeds: the stream's chunks, into the log.
pub struct Writer {
    live: Arc<Live>,
    events: SseEvents,
    /// Bytes of the stream so far, and the most the log may hold.
    bytes: usize,
    max_bytes: usize,
    done: bool,
    /// The stream's own error event, if it had one.
    error: Option<Bytes>,
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
            any_event: false,
        }
    }

    /// Adds a chunk of the leader's stream. `true` when it brought the stream's first event.
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        if self.bytes > self.max_bytes {
            return false;
        }
        self.bytes += chunk.len();
        if self.bytes > self.max_bytes {
            let too_big = failure(
                self.live.kind,
                "The answer this request shared with an identical one was too large to share; \
                 try again.",
            );
            self.live.finish(End::Failed(too_big), true);
            return false;
        }
        let was_any = self.any_event;
        let (done, error, any_event) = (&mut self.done, &mut self.error, &mut self.any_event);
        let family = self.live.kind.family();
        let mut guard = self.live.log();
        let log = &mut *guard;
        self.events.split(chunk, |event| {
            if let Some(answer) = log.answer.as_mut() {
                answer.feed(event);
            }
            if log.followed {
                log.events.push(Bytes::copy_from_slice(event));
            }
            let Some(data) = sse::data(event) else {
                return;
            };
            if data.as_ref() == b"[DONE]" {
                *done = true;
            } else if family.is_error_event(&data) {
                let mut text = b"data: ".to_vec();
                text.extend_from_slice(&data);
                text.extend_from_slice(b"\n\ndata: [DONE]\n\n");
                *error = Some(Bytes::from(text));
            } else {
                *any_event = true;
            }
        });
        drop(guard);
        self.live.more.send_replace(());
        !was_any && self.any_event
    }

    /// The non-stream answer the whole stream adds up to, for the cache to store, with
    /// `usage` when the stream carried none; `None` once it outgrew the bound. It stays in
    /// the log for the readers that join until the lead is handed on.
    pub fn answer(&self, usage: Option<Usage>) -> Option<Result<AnswerText, AnswerError>> {
        self.live.log().answer.as_ref().map(|a| a.finish(usage))
    }

    /// The leader's stream ended; `usage` is what the core found in it.
    pub fn end(&mut self, usage: Option<Usage>) {
        let end = match (&self.error, self.done && self.any_event) {
            (None, true) => End::Done { usage },
            (Some(error), _) => End::Failed(error.clone()),
            (None, false) => End::Failed(cut(self.live.kind)),
        };
        self.live.finish(end, false);
    }
}

impl Drop for Writer {
    /// A leader that leaves before its stream ended (its client gone, its attempt broken)
    /// fails its log.
    fn drop(&mut self) {
        self.live.finish(End::Failed(cut(self.live.kind)), false);
    }
}

fn cut(kind: Endpoint) -> Bytes {
    failure(
        kind,
        "The answer this request shared with an identical one ended early; try again.",
    )
}

/// Sluice's error event, in the family's shape, for the readers of a failed log.
fn failure(kind: Endpoint, message: &str) -> Bytes {
    ErrorReply::bad_gateway(message).sse_event_for(kind)
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
    /// The next chunk of the log to read.
    next: usize,
    events: SseEvents,
    /// The answer so far (at first) and the events taken from the log, rendered outside its
    /// lock.
    news: Vec<Bytes>,
    render: Render,
    wrote: bool,
    finished: bool,
}

/// How a reader writes the leader's events: under its own identity, with the usage chunk
/// only if it asked for one.
struct Render {
    /// The stream's family: it reads and restamps each event.
    family: &'static dyn ApiFamily,
    id: String,
    created: u64,
    include_usage: bool,
    /// The upstream's `model` value, as text, for a usage chunk made here.
    model: Option<String>,
    had_usage_chunk: bool,
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
            None if log.events.len() > self.next || !self.news.is_empty() => Readiness::Ready,
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
        // Under the lock only reference counts are taken: the leader never waits for a parse.
        let end = {
            let log = self.ticket.0.log();
            if let Some(news) = log.events.get(self.next..) {
                self.news.extend_from_slice(news);
            }
            self.next = self.next.max(log.events.len());
            log.end.clone()
        };
        let mut out = Vec::new();
        for chunk in self.news.drain(..) {
            self.events
                .split(&chunk, |event| self.render.event(event, &mut out));
        }
        match end {
            None => {}
            Some(End::Failed(events)) => {
                out.extend_from_slice(&events);
                self.finished = true;
            }
            Some(End::Done { usage }) => {
                self.render.usage_chunk(usage, &mut out);
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.finished = true;
            }
        }
        self.wrote |= !out.is_empty();
        out
    }
}

impl Render {
    /// Writes one upstream event under this reader's identity (the end of the stream,
    /// `[DONE]` or an error, comes from the log's end).
    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let Some(data) = sse::data(event) else {
            return;
        };
        let Ok(text) = std::str::from_utf8(&data) else {
            return;
        };
        if text == "[DONE]" {
            return;
        }
        // Not passed on: an error event (the log's end carries it), or text no client could
        // read either.
        let Some(facts) = self.family.read_event(text) else {
            return;
        };
        if self.model.is_none() {
            self.model = facts.model.map(str::to_string);
        }
        self.had_usage_chunk |= facts.usage_only;
        if facts.usage_only && !self.include_usage {
            return;
        }
        out.extend_from_slice(b"data: ");
        self.family
            .write_event(text, &facts, &self.id, self.created, out);
        out.extend_from_slice(b"\n\n");
    }

    /// The usage chunk the leader's client did not ask for, made from the usage the core
    /// found, for a reader that did (and only when the stream had none of its own).
    fn usage_chunk(&self, usage: Option<Usage>, out: &mut Vec<u8>) {
        let (true, false, Some(usage)) = (self.include_usage, self.had_usage_chunk, usage) else {
            return;
        };
        let event = self
            .family
            .usage_event(&self.id, self.created, self.model.as_deref(), usage);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&event);
        out.extend_from_slice(b"\n\n");
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
    fn the_log_keeps_the_answer_so_far_and_events_only_once_a_reader_joined() {
        let live = Live::new(Endpoint::ChatCompletions, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        assert!(
            writer.feed(event(0, "Hel", None).as_bytes()),
            "the first event"
        );
        assert!(live.log().events.is_empty(), "no reader: no events kept");
        let reader = live.enter().reader("mine".into(), 1, false);
        // One event split across two chunks is kept once, whole.
        let split = event(1, "lo", Some("stop"));
        let (a, b) = split.split_at(10);
        assert!(!writer.feed(a.as_bytes()));
        assert!(
            live.log().events.is_empty(),
            "half an event is not an event"
        );
        assert!(!writer.feed(b.as_bytes()));
        assert_eq!(live.log().events, vec![Bytes::from(split)]);
        writer.feed(b"data: [DONE]\n\n");
        writer.end(None);
        let answer = writer.answer(None).unwrap().unwrap();
        let answer: Value = serde_json::from_str(answer.get()).unwrap();
        assert_eq!(answer["choices"][0]["message"]["content"], "Hello");
        assert_eq!(answer["choices"][0]["finish_reason"], "stop");
        drop(reader);
    }

    #[test]
    fn an_answer_that_outgrows_the_bound_is_dropped_with_its_events() {
        let live = Live::new(Endpoint::ChatCompletions, "p");
        let one = event(0, "x", None);
        let mut writer = Writer::new(live.clone(), one.len() + 10);
        let _reader = live.enter().reader("a".into(), 1, false);
        writer.feed(one.as_bytes());
        writer.feed(one.as_bytes());
        assert!(writer.answer(None).is_none());
        assert!(live.log().events.is_empty());
        assert!(live.failed());
    }

    #[test]
    fn only_an_error_object_is_an_error_event() {
        let family = Endpoint::ChatCompletions.family();
        assert!(family.is_error_event(br#"{"error": {"message": "boom", "code": 500}}"#));
        assert!(!family.is_error_event(br#"{"id":"c","choices":[{"delta":{"content":"error"}}]}"#));
        assert!(!family.is_error_event(br#"{"id":"c","choices":[]}"#));
    }

    #[tokio::test]
    async fn a_late_reader_gets_the_prefix_at_once_then_each_event_under_its_own_id() {
        let live = Live::new(Endpoint::ChatCompletions, "p");
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
        assert_eq!(
            prefix.len(),
            1,
            "the answer so far, one event for its one choice"
        );
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
        let live = Live::new(Endpoint::ChatCompletions, "p");
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
        let live = Live::new(Endpoint::ChatCompletions, "p");
        let mut writer = Writer::new(live.clone(), 1 << 20);
        let mut reader = live.enter().reader("a".into(), 1, false);
        writer.feed(&Bytes::copy_from_slice(event(0, "x", None).as_bytes()));
        next(&mut reader).await;
        drop(writer);
        let rest = next(&mut reader).await;
        let error: Value = serde_json::from_str(&rest[0]).unwrap();
        assert!(error["error"]["message"].is_string(), "{rest:?}");
        assert_eq!(rest[1], "[DONE]");

        let live = Live::new(Endpoint::ChatCompletions, "p");
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
        let live = Live::new(Endpoint::ChatCompletions, "p");
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
        let live = Live::new(Endpoint::ChatCompletions, "p");
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
