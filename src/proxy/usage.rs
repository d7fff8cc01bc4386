//! An LLM answer's token usage, found once for every plugin ([`RequestCtx::usage`]): each
//! chunk the client gets passes one [`UsageScanner`] before the body hooks, and the usage
//! chunk of a stream whose client did not ask for it (the upstream was asked on a plugin's
//! behalf, see [`usage_kept_from_client`]) is removed before any hook sees it. The request's
//! preparation asks here whether to ask upstream; the answer's stages
//! (`super::downstream::Answer`) ask here what to do with each chunk.

use bytes::{Bytes, BytesMut};
use sluice_sdk::raw_json;
use sluice_sdk::sse::SseEvents;
use sluice_sdk::usage::UsageScanner;
use sluice_sdk::{ApiFamily, RequestCtx};

/// What the core reads of an LLM answer as it passes: its usage, and on a stream whose usage
/// is kept from the client, where its events are. A stage of the request's answer
/// (`super::downstream::Answer`).
#[derive(Debug, Default)]
pub struct AnswerUsage {
    scanner: UsageScanner,
    /// The stream's events, while its usage chunk is removed, and the family that says which
    /// event that is.
    strip: Option<(SseEvents, &'static dyn ApiFamily)>,
}

impl AnswerUsage {
    /// The scanner of the request's answers (an upstream's, a cache hit's): its family knows
    /// where they carry their usage.
    pub fn of(ctx: &RequestCtx) -> Self {
        let scanner = ctx
            .llm()
            .map(|call| {
                call.endpoint
                    .family()
                    .usage_scanner(call.request.is_stream())
            })
            .unwrap_or_default();
        AnswerUsage {
            scanner,
            strip: None,
        }
    }
}

/// A plugin wants the usage of a stream whose client did not ask for it: the upstream is
/// asked for it, and the usage chunk is kept from the client.
pub fn usage_kept_from_client(ctx: &RequestCtx) -> bool {
    ctx.usage_wanted()
        && ctx
            .llm()
            .is_some_and(|call| call.request.is_stream() && !call.request.include_usage())
}

/// Scans a chunk for the answer's usage, records it, and removes the usage chunk when it is
/// kept from the client.
pub fn read_usage(
    ctx: &mut RequestCtx,
    watch: &mut AnswerUsage,
    body: &mut Option<Bytes>,
    end: bool,
) {
    if let Some(chunk) = body.as_ref() {
        watch.scanner.feed(chunk);
    }
    if let Some((events, family)) = watch.strip.as_mut() {
        drop_usage_chunk(*family, events, body, end);
    }
    let (found, cached, created) = (
        watch.scanner.usage(),
        watch.scanner.cached_tokens(),
        watch.scanner.created_cache_tokens(),
    );
    // A stream's running totals (`continuous_usage_stats`): the last one found is the answer's.
    if let Some(found) = found.filter(|u| ctx.usage() != Some(*u)) {
        if ctx.usage().is_none() && !ctx.answered_locally() {
            learn_prompt_scale(ctx, found);
            report_cached_tokens(ctx, cached);
        }
        ctx.set_usage(found);
    }
    // A disaggregated request's transfer, judged by the usage that says what the decode
    // engine computed (a stream's running usage, `continuous_usage_stats`, does not), or by
    // the last one.
    let disaggregated = ctx.pool().is_some_and(|p| p.transfer_check().is_some());
    if let Some(usage) = ctx
        .usage()
        .filter(|_| disaggregated && !ctx.answered_locally())
    {
        if created.is_some() || cached.is_some() || end {
            super::disaggregation::judge(ctx, usage.prompt_tokens, created, cached);
        }
    }
}

/// The engine's own count of the prompt teaches its pool how far the estimate is off (see
/// `Pool::prompt_tokens`); only an upstream's answer does, not a replayed one.
fn learn_prompt_scale(ctx: &RequestCtx, usage: sluice_sdk::Usage) {
    // A follow-up's estimate holds its stored conversation's count, not an estimate of it.
    let follow_up = ctx
        .llm()
        .is_some_and(|call| call.request.previous_response_id.is_some());
    if follow_up {
        return;
    }
    if let (Some(pool), Some(call)) = (ctx.pool(), ctx.llm()) {
        pool.learn_prompt_tokens(call.demand.prompt_tokens, usage.prompt_tokens);
    }
}

/// The prompt tokens the engine counted and those its prefix cache served, when the answer's
/// usage says both (vLLM's `--enable-prompt-tokens-details`).
pub fn engine_computed(ctx: &RequestCtx, usage: Option<&AnswerUsage>) -> Option<(u64, u64)> {
    let cached = usage?.scanner.cached_tokens()?;
    Some((ctx.usage()?.prompt_tokens, cached))
}

/// What the engine's prefix cache served, beside what the pool's exact index predicted of
/// the same attempt (answers that do not say are left out of both).
fn report_cached_tokens(ctx: &RequestCtx, cached: Option<u64>) {
    use std::sync::atomic::Ordering::Relaxed;
    let routing = ctx.pool().and_then(|pool| pool.prefix());
    let predicted = ctx.state.get::<sluice_sdk::prefix::Predicted>();
    if let (Some(routing), Some(cached), Some(predicted)) = (routing, cached, predicted) {
        routing.reported_tokens.fetch_add(cached, Relaxed);
        routing
            .predicted_tokens
            .fetch_add(predicted.tokens, Relaxed);
    }
}

/// Removes the usage chunk from a stream's chunk; `end` marks its last. A chunk of whole
/// events without it passes as the same buffer, and whole events before an unfinished one as
/// a slice of it: nothing is copied until an event is dropped or an event spans chunks.
fn drop_usage_chunk(
    family: &dyn ApiFamily,
    events: &mut SseEvents,
    body: &mut Option<Bytes>,
    end: bool,
) {
    let Some(chunk) = body.take() else {
        let rest = if end { events.take_rest() } else { Vec::new() };
        *body = (!rest.is_empty()).then(|| Bytes::from(rest));
        return;
    };
    // `chunk[..passed]` is passed on as it is, until `out` takes over.
    let mut passed = 0;
    let mut out: Option<BytesMut> = None;
    events.split(&chunk, |event| {
        let keep = !family.is_usage_event(event);
        if out.is_none() {
            let next = raw_json::position(&chunk, event).filter(|at| at.start == passed);
            match next {
                Some(at) if keep => {
                    passed = at.end;
                    return;
                }
                _ => out = Some(BytesMut::from(chunk.get(..passed).unwrap_or_default())),
            }
        }
        if let (true, Some(out)) = (keep, out.as_mut()) {
            out.extend_from_slice(event);
        }
    });
    if end {
        // An unfinished last event goes out as it is: the client sees what the upstream sent.
        let rest = events.take_rest();
        if !rest.is_empty() {
            out.get_or_insert_with(|| BytesMut::from(chunk.get(..passed).unwrap_or_default()))
                .extend_from_slice(&rest);
        }
    }
    *body = match out {
        Some(out) => (!out.is_empty()).then(|| out.freeze()),
        None if passed == chunk.len() => Some(chunk),
        None => (passed > 0).then(|| chunk.slice(..passed)),
    };
}

/// Whether the stream now answered has its usage chunk removed before the client sees it.
pub fn strip_usage_chunk(ctx: &RequestCtx, watch: &mut AnswerUsage, strip: bool) {
    let family = ctx.llm().map(|call| call.endpoint.family());
    watch.strip = family.filter(|_| strip).map(|f| (SseEvents::default(), f));
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::family::openai::CHAT;

    const STREAM: &str = include_str!("../../tests/fixtures/vllm-chat-stream.sse");

    /// The stream as a client that did not ask for usage sees it, from these chunks.
    fn stripped(chunks: &[&[u8]]) -> String {
        let mut events = SseEvents::default();
        let mut out = String::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let mut body = Some(Bytes::copy_from_slice(chunk));
            drop_usage_chunk(
                &sluice_sdk::family::openai::CHAT,
                &mut events,
                &mut body,
                i + 1 == chunks.len(),
            );
            if let Some(b) = body {
                out.push_str(std::str::from_utf8(&b).unwrap());
            }
        }
        out
    }

    #[test]
    fn the_usage_chunk_is_dropped_and_nothing_else_however_the_stream_is_cut() {
        let expected: String = STREAM
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"usage\""))
            .collect();
        assert_eq!(expected.matches("\n\n").count(), 6);
        assert_eq!(stripped(&[STREAM.as_bytes()]), expected);
        for cut in 1..STREAM.len() {
            let (a, b) = STREAM.as_bytes().split_at(cut);
            assert_eq!(stripped(&[a, b]), expected, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = STREAM.as_bytes().chunks(7).collect();
        assert_eq!(stripped(&bytes), expected);
    }

    #[test]
    fn unchanged_events_pass_as_the_same_buffer_or_a_slice_of_it() {
        let first = STREAM.split_inclusive("\n\n").next().unwrap();
        let mut events = SseEvents::default();
        let chunk = Bytes::copy_from_slice(first.as_bytes());
        let mut body = Some(chunk.clone());
        drop_usage_chunk(
            &sluice_sdk::family::openai::CHAT,
            &mut events,
            &mut body,
            false,
        );
        let passed = body.unwrap();
        assert_eq!(
            (passed.as_ptr(), passed.len()),
            (chunk.as_ptr(), chunk.len())
        );
        // Whole events, then the start of the next: the whole ones go, uncopied.
        let chunk = Bytes::from(format!("{first}data: {{\"cho"));
        let mut body = Some(chunk.clone());
        drop_usage_chunk(
            &sluice_sdk::family::openai::CHAT,
            &mut events,
            &mut body,
            false,
        );
        let passed = body.unwrap();
        assert_eq!(
            (passed.as_ptr(), passed.len()),
            (chunk.as_ptr(), first.len())
        );
    }

    #[test]
    fn only_a_usage_chunk_is_one() {
        let usage =
            br#"data: {"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}

"#;
        assert!(CHAT.is_usage_event(usage));
        assert!(CHAT
            .is_usage_event(b"data: {\"choices\": [ ],\"usage\": {\"prompt_tokens\":1}}\r\n\r\n"));
        for other in [
            // Every chunk of vLLM's completions stream, and continuous usage stats.
            &br#"data: {"choices":[{"index":0,"text":" usage"}],"usage":null}

"#[..],
            br#"data: {"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":1}}

"#,
            br#"data: {"choices":[],"usage":null}

"#,
            b"data: [DONE]\n\n",
            b": usage\n\n",
            br#"data: {"text":"\"usage\"","choices":[]}

"#,
        ] {
            assert!(
                !CHAT.is_usage_event(other),
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }

    #[test]
    fn a_cut_last_event_is_kept_and_no_chunk_stays_none() {
        assert_eq!(
            stripped(&[b"data: 1\n\nda", b"ta: {\"usa"]),
            "data: 1\n\ndata: {\"usa"
        );
        let mut events = SseEvents::default();
        let mut body = None;
        drop_usage_chunk(
            &sluice_sdk::family::openai::CHAT,
            &mut events,
            &mut body,
            false,
        );
        assert!(body.is_none());
        let mut body = Some(Bytes::from_static(b"data: 1\n\nda"));
        drop_usage_chunk(
            &sluice_sdk::family::openai::CHAT,
            &mut events,
            &mut body,
            false,
        );
        let mut body = None;
        drop_usage_chunk(
            &sluice_sdk::family::openai::CHAT,
            &mut events,
            &mut body,
            true,
        );
        assert_eq!(body.as_deref(), Some(&b"da"[..]));
    }
}
