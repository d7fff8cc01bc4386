//! The model name each pool serves, as LiteLLM's aliases and Envoy AI Gateway's
//! `modelNameOverride` do it in the gateway: clients ask for one public name, each pool's
//! engine gets the name it serves (vLLM's `--served-model-name`), and the answer's `model`
//! says what the client asked for, or what served it.
//!
//! Both ways work on the bytes, never on a tree:
//! - [`upstream_body`] splices the `model` value (and, composed with it, the usage request of
//!   [`crate::usage::ask_for_usage`], the tenant's `cache_salt` and the reset of the engine's
//!   control fields, see [`UpstreamEdits`]) into a body, copied once, every other byte kept;
//! - [`ModelRewriter`] rewrites `"model":"<served>"` in an answer as its chunks pass (a JSON
//!   answer or every event of a stream), holding back only the few bytes of a match that a
//!   chunk boundary cuts. A chunk without a match passes as the same buffer.

use crate::raw_json::{self, Edit, ObjectSpans, SeenMembers};
use bytes::{Bytes, BytesMut};

/// What an answer's `model` field says when a pool serves another name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AnswerModel {
    /// The name the client asked for (the default): the pool's name stays the gateway's.
    #[default]
    Requested,
    /// The name the pool's engine served, as it wrote it.
    Served,
}

/// A pool's served model name: sent upstream in every request's `model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    name: String,
    /// `name` as a JSON string, quotes included: what is spliced and what answers carry.
    json: Vec<u8>,
    /// What the answers' `model` field says.
    pub answer: AnswerModel,
}

impl ServedModel {
    /// The served name `name`; `Err` says why it cannot be one. Control characters, `"` and
    /// `\` are refused: engines write names as they are, and the answers are matched byte for
    /// byte against that spelling.
    pub fn new(name: &str, answer: AnswerModel) -> Result<Self, String> {
        if name.trim().is_empty() {
            return Err("must not be empty".into());
        }
        if name
            .chars()
            .any(|c| c.is_control() || c == '"' || c == '\\')
        {
            return Err(format!(
                "`{}` has a control character, a quote or a backslash",
                name.escape_debug()
            ));
        }
        let mut json = Vec::with_capacity(name.len() + 2);
        raw_json::write_string(&mut json, name);
        Ok(Self {
            name: name.to_string(),
            json,
            answer,
        })
    }

    /// The name, as configured.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as a JSON string, quotes included.
    pub fn json(&self) -> &[u8] {
        &self.json
    }

    /// Whether a request for `requested` needs its `model` changed for this pool.
    pub fn changes(&self, requested: Option<&str>) -> bool {
        requested != Some(self.name.as_str())
    }

    /// The rewriter of the answers to a request for `requested`: `None` when they pass as
    /// they are (the operator wants the served name, or the client asked for it, or for no
    /// name at all).
    pub fn answer_rewriter(&self, requested: Option<&str>) -> Option<ModelRewriter> {
        let requested = requested.filter(|r| *r != self.name)?;
        (self.answer == AnswerModel::Requested).then(|| ModelRewriter::new(&self.name, requested))
    }
}

/// The top-level members [`upstream_body`] may change: the core's parse of a request notes
/// where they are ([`crate::LlmRequest::seen`]).
pub const EDITED_MEMBERS: [&str; 7] = [
    "model",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "vllm_xargs",
    "request_id",
];

/// The members of a vLLM request that act on the engine beyond the client's own request,
/// with the value that makes each do nothing (vLLM's default): `priority` reorders vLLM's
/// queue under `--scheduling-policy priority`, beneath Sluice's own classes;
/// `kv_transfer_params` steers a disaggregated prefill's KV transfer; `vllm_xargs` hands
/// arguments to engine plugins. `request_id` is vLLM's id for the request, which it aborts
/// by when its client leaves: a client choosing another's id could end that one. It gets
/// Sluice's own id instead.
pub const ENGINE_CONTROLS: [(&str, &[u8]); 3] = [
    ("priority", b"0"),
    ("kv_transfer_params", b"null"),
    ("vllm_xargs", b"null"),
];

/// What [`upstream_body`] changes in a request body for one pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpstreamEdits<'a> {
    /// The `model` value to set (JSON text); `None`: the client's stays.
    pub model: Option<&'a [u8]>,
    /// Ask a stream for its usage (as [`crate::usage::ask_for_usage`]).
    pub ask_usage: bool,
    /// The tenant whose requests alone may share the engine's prefix cache: `cache_salt` is
    /// set to a salt of its name (and of the client's own salt, if any). vLLM's prefix cache
    /// is shared by every request otherwise, and how fast a prompt's prefix comes back tells
    /// whether another tenant sent it.
    pub salt_for_tenant: Option<&'a str>,
    /// Reset [`ENGINE_CONTROLS`] to their defaults where the client set them, and a
    /// client's `request_id` to this.
    pub reset_engine_controls: Option<&'a str>,
    /// A disaggregated request's `kv_transfer_params` (JSON text), in place of the client's:
    /// the prefill answer's, for the decode leg.
    pub kv_transfer_params: Option<&'a [u8]>,
}

impl UpstreamEdits<'_> {
    /// Whether any edit may apply.
    pub fn any(&self) -> bool {
        self.model.is_some()
            || self.ask_usage
            || self.salt_for_tenant.is_some()
            || self.reset_engine_controls.is_some()
            || self.kv_transfer_params.is_some()
    }
}

/// The `cache_salt` of `tenant`'s requests (JSON text): a digest of its name and of the
/// client's own salt (`client`, JSON text), so that no client can name another tenant's.
pub fn tenant_cache_salt(tenant: &str, client: Option<&[u8]>) -> Vec<u8> {
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    hash.update(b"sluice cache_salt\0");
    hash.update(tenant.as_bytes());
    if let Some(client) = client {
        hash.update(b"\0");
        hash.update(client);
    }
    let digest = hash.finish();
    let mut salt = Vec::with_capacity(34);
    salt.push(b'"');
    for byte in digest.as_ref().iter().take(16) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        salt.push(HEX[usize::from(byte >> 4)]);
        salt.push(HEX[usize::from(byte & 0xf)]);
    }
    salt.push(b'"');
    salt
}

/// `body` (a JSON object) as sent upstream, with `edits` made (see [`UpstreamEdits`]), all
/// spliced in one copy. `None` when nothing changes or `body` is not one JSON object. `seen`
/// is what the core's parse of this very body saw of it: with it, only the edited members
/// are read, not the whole body again (a long prompt is hundreds of kilobytes).
pub fn upstream_body(
    body: &[u8],
    seen: Option<&SeenMembers>,
    edits: &UpstreamEdits<'_>,
) -> Option<Bytes> {
    if !edits.any() {
        return None;
    }
    let spans = match seen.and_then(|seen| ObjectSpans::from_seen(body, seen)) {
        Some(spans) => spans,
        None => raw_json::object_spans(body, &EDITED_MEMBERS)?,
    };
    let made = edits_of(body, &spans, edits);
    finish(body, &spans, made)
}

/// A prefill leg's `kv_transfer_params` for vLLM's `NixlConnector`, as its own proxy sends
/// them.
pub const NIXL_REMOTE_DECODE: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The body of a disaggregated request's prefill leg, from the body its pool would get
/// (`edits` as for that pool, but for a stream's usage): one output token for one choice,
/// not streamed, with `kv_transfer_params` set to `ask`, which asks the engine to keep the
/// prompt's blocks for a remote decode (vLLM's `NixlConnector`: [`NIXL_REMOTE_DECODE`]; its
/// `MooncakeConnector` adds the router's `transfer_id`). `min_tokens`
/// goes back to 0, as vLLM's prefill engine takes no more than one token. The body is read
/// again here for the members the leg changes: only a disaggregated request, whose prompt
/// is long enough to be worth a second engine, pays for it. `None` when `body` is not one
/// JSON object.
pub fn prefill_leg_body(body: &[u8], edits: &UpstreamEdits<'_>, ask: &[u8]) -> Option<Bytes> {
    const LEG_MEMBERS: [&str; 12] = crate::request::concat::<_, 7, 5, 12>(
        EDITED_MEMBERS,
        [
            "max_tokens",
            "max_completion_tokens",
            "stream",
            "n",
            "min_tokens",
        ],
    );
    let spans = raw_json::object_spans(body, &LEG_MEMBERS)?;
    let leg = UpstreamEdits {
        ask_usage: false,
        kv_transfer_params: Some(ask),
        ..*edits
    };
    let mut made = edits_of(body, &spans, &leg);
    made.push(spans.set("max_tokens", b"1"));
    made.push(spans.set("stream", b"false"));
    // vLLM refuses `stream_options` without a stream.
    if spans.value("stream_options").is_some() {
        made.push(spans.set("stream_options", b"null"));
    }
    for (key, value) in [
        ("max_completion_tokens", &b"1"[..]),
        ("n", b"1"),
        ("min_tokens", b"0"),
    ] {
        if spans.value(key).is_some() {
            made.push(spans.set(key, value));
        }
    }
    finish(body, &spans, made)
}

/// The edits `edits` make of `body`, whose members are at `spans`.
fn edits_of(body: &[u8], spans: &ObjectSpans<'_>, edits: &UpstreamEdits<'_>) -> Vec<Edit> {
    let mut made = Vec::with_capacity(4);
    if let Some(model) = edits.model {
        made.push(spans.set("model", model));
    }
    if edits.ask_usage {
        made.extend(usage_edit(body, spans));
    }
    if let Some(params) = edits.kv_transfer_params {
        made.push(spans.set("kv_transfer_params", params));
    }
    if let Some(request_id) = edits.reset_engine_controls {
        for (key, neutral) in ENGINE_CONTROLS {
            // A disaggregated request's own parameters replace the client's (above).
            if key == "kv_transfer_params" && edits.kv_transfer_params.is_some() {
                continue;
            }
            if spans
                .value(key)
                .is_some_and(|at| body.get(at) != Some(neutral))
            {
                made.push(spans.set(key, neutral));
            }
        }
        if spans.value("request_id").is_some() {
            let mut id = Vec::with_capacity(request_id.len() + 2);
            raw_json::write_string(&mut id, request_id);
            made.push(spans.set("request_id", &id));
        }
    }
    if let Some(tenant) = edits.salt_for_tenant {
        let client = spans.value("cache_salt").and_then(|at| body.get(at));
        made.push(spans.set("cache_salt", &tenant_cache_salt(tenant, client)));
    }
    made
}

/// `body` with the edits `made` at `spans`; `None` when there are none.
fn finish(body: &[u8], spans: &ObjectSpans<'_>, mut made: Vec<Edit>) -> Option<Bytes> {
    if made.is_empty() {
        return None;
    }
    // Members appended to an empty object: each after the first needs its comma.
    if spans.members() == 0 {
        let appended = |e: &Edit| e.range.is_empty() && e.range.start == spans.close();
        for edit in made.iter_mut().filter(|e| appended(e)).skip(1) {
            edit.text.insert(0, b',');
        }
    }
    raw_json::apply(body, made).map(Bytes::from)
}

/// The edit that asks a stream for its usage (see [`crate::usage::ask_for_usage`], which this
/// must match: a test compares them); `None` when it already asks, or its `stream_options`
/// is neither an object nor `null`.
fn usage_edit(body: &[u8], spans: &ObjectSpans) -> Option<Edit> {
    const OPTIONS: &[u8] = br#"{"include_usage":true}"#;
    let Some(range) = spans.value("stream_options") else {
        return Some(spans.append("stream_options", OPTIONS));
    };
    let options = body.get(range.clone())?;
    if options == b"null" {
        return Some(Edit {
            range,
            text: OPTIONS.to_vec(),
        });
    }
    let inner = raw_json::object_spans(options, &["include_usage"])?;
    if inner
        .value("include_usage")
        .is_some_and(|at| options.get(at) == Some(b"true"))
    {
        return None;
    }
    let edit = inner.set("include_usage", b"true");
    Some(Edit {
        range: range.start + edit.range.start..range.start + edit.range.end,
        text: edit.text,
    })
}

/// The key matched. In valid JSON these bytes followed by `:` can only be an object key:
/// inside a string the closing quote would be escaped.
const KEY: &[u8] = b"\"model\"";

/// The most whitespace around the colon a match allows, so that what is held back across
/// chunks stays bounded (engines write none).
const MAX_SPACE: usize = 16;

/// Where a match of `"model" : "<from>"` stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Match {
    /// No match under way.
    Seeking,
    /// This many bytes of [`KEY`] matched.
    Key(usize),
    /// After the key: whitespace (this much so far), then `:`.
    Colon(usize),
    /// After the colon: whitespace (this much so far), then the value.
    Space(usize),
    /// This many bytes of the value matched.
    Value(usize),
}

/// Rewrites the `model` member whose value is one name into another in an answer's bytes as
/// they pass, chunk by chunk (a JSON answer, or a stream's events), without holding the body:
/// only a match that a chunk boundary cuts is held back, until the next chunk decides it.
#[derive(Debug)]
pub struct ModelRewriter {
    /// The value replaced and its replacement, as JSON strings, quotes included.
    from: Vec<u8>,
    to: Vec<u8>,
    state: Match,
    /// Bytes of a match under way from earlier chunks, not passed on yet.
    held: BytesMut,
}

impl ModelRewriter {
    /// Rewrites the value `from` into `to` (names, written as JSON strings).
    pub fn new(from: &str, to: &str) -> Self {
        let (mut f, mut t) = (Vec::new(), Vec::new());
        raw_json::write_string(&mut f, from);
        raw_json::write_string(&mut t, to);
        Self {
            from: f,
            to: t,
            state: Match::Seeking,
            held: BytesMut::new(),
        }
    }

    /// The next chunk of the answer as it goes on; `end` marks the last. A chunk without a
    /// match, and with nothing held before it, passes as the same buffer; one whose end may
    /// begin a match passes as a slice of it, the rest held.
    pub fn rewrite(&mut self, chunk: Option<Bytes>, end: bool) -> Option<Bytes> {
        // No chunk passes as none, unless the end lets out what is held.
        let chunk = chunk.or_else(|| (end && !self.held.is_empty()).then(Bytes::new))?;
        let held = std::mem::take(&mut self.held);
        // Positions count in `held` followed by `chunk`; the held bytes were stepped through
        // already, so the state stands after them.
        let total = held.len() + chunk.len();
        // Where the match under way started (a held one at 0).
        let mut start = (!held.is_empty()).then_some(0);
        // Bytes decided and passed on: into `out` once anything was changed.
        let mut passed = 0;
        let mut out: Option<BytesMut> = None;
        let mut j = 0;
        while j < chunk.len() {
            if self.state == Match::Seeking {
                // Nothing can start before the next quote.
                match chunk
                    .get(j..)
                    .and_then(|c| c.iter().position(|&b| b == b'"'))
                {
                    Some(quote) => j += quote,
                    None => break,
                }
            }
            let Some(&byte) = chunk.get(j) else {
                break;
            };
            let i = held.len() + j;
            let (state, began) = self.step(byte);
            self.state = state;
            if began {
                start = Some(i);
            } else if state == Match::Seeking {
                start = None;
            }
            if state == Match::Value(self.from.len()) {
                // The value is the last `from.len()` bytes: what comes before it goes as it
                // was, the value as its replacement.
                let value = i + 1 - self.from.len();
                let out = out.get_or_insert_with(|| BytesMut::with_capacity(total));
                copy(out, &held, &chunk, passed..value);
                out.extend_from_slice(&self.to);
                passed = i + 1;
                self.state = Match::Seeking;
                start = None;
            }
            j += 1;
        }
        // A match under way is held for the next chunk, unless the answer ends here.
        let keep = if end { total } else { start.unwrap_or(total) };
        if end {
            self.state = Match::Seeking;
        } else if let Some(start) = start {
            let mut rest = BytesMut::with_capacity(total - start);
            copy(&mut rest, &held, &chunk, start..total);
            self.held = rest;
        }
        match out {
            None if held.is_empty() && passed == 0 => {
                if keep == chunk.len() {
                    Some(chunk)
                } else {
                    Some(chunk.slice(..keep))
                }
            }
            mut out => {
                let out = out.get_or_insert_with(|| BytesMut::with_capacity(keep));
                copy(out, &held, &chunk, passed..keep);
                Some(std::mem::take(out).freeze())
            }
        }
    }

    /// The state after `byte`, and whether a match began at it.
    fn step(&self, byte: u8) -> (Match, bool) {
        let restart = || {
            if byte == b'"' {
                (Match::Key(1), true)
            } else {
                (Match::Seeking, false)
            }
        };
        match self.state {
            Match::Seeking => restart(),
            Match::Key(n) if KEY.get(n) == Some(&byte) => {
                if n + 1 == KEY.len() {
                    (Match::Colon(0), false)
                } else {
                    (Match::Key(n + 1), false)
                }
            }
            Match::Colon(s) if raw_json::is_space(byte) && s < MAX_SPACE => {
                (Match::Colon(s + 1), false)
            }
            Match::Colon(_) if byte == b':' => (Match::Space(0), false),
            Match::Space(s) if raw_json::is_space(byte) && s < MAX_SPACE => {
                (Match::Space(s + 1), false)
            }
            Match::Space(_) if self.from.first() == Some(&byte) => (Match::Value(1), false),
            Match::Value(n) if self.from.get(n) == Some(&byte) => (Match::Value(n + 1), false),
            // The closing quote of a value that is not the one looked for starts nothing.
            Match::Value(_) => (Match::Seeking, false),
            Match::Key(_) | Match::Colon(_) | Match::Space(_) => restart(),
        }
    }
}

/// Appends the bytes at `range` of `held` followed by `chunk` to `out`.
fn copy(out: &mut BytesMut, held: &[u8], chunk: &[u8], range: std::ops::Range<usize>) {
    let split = held.len();
    if range.start < split {
        out.extend_from_slice(
            held.get(range.start..range.end.min(split))
                .unwrap_or_default(),
        );
    }
    if range.end > split {
        let from = range.start.max(split) - split;
        out.extend_from_slice(chunk.get(from..range.end - split).unwrap_or_default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::ask_for_usage;

    const SERVED: &str = "meta-llama/Llama-3.2-1B-Instruct";
    const STREAM: &str = include_str!("../../../tests/fixtures/vllm-chat-stream.sse");
    const CHAT: &str = include_str!("../../../tests/fixtures/vllm-chat-completion.json");

    /// `text` rewritten from `chunks` cut at the given points.
    fn rewritten(from: &str, to: &str, chunks: &[&[u8]]) -> String {
        let mut rewriter = ModelRewriter::new(from, to);
        let mut out = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            if let Some(b) = rewriter.rewrite(Some(Bytes::copy_from_slice(chunk)), last) {
                out.extend_from_slice(&b);
            }
        }
        String::from_utf8(out).unwrap()
    }

    fn fixture_model(text: &str) -> String {
        let at = text.find("\"model\":\"").unwrap() + 9;
        let len = text[at..].find('"').unwrap();
        text[at..at + len].to_string()
    }

    #[test]
    fn every_model_field_is_rewritten_however_the_answer_is_cut() {
        for text in [STREAM, CHAT] {
            let served = fixture_model(text);
            let expected = text.replace(&format!("\"model\":\"{served}\""), "\"model\":\"llama\"");
            assert_ne!(expected, text);
            assert_eq!(rewritten(&served, "llama", &[text.as_bytes()]), expected);
            for cut in 1..text.len() {
                let (a, b) = text.as_bytes().split_at(cut);
                assert_eq!(
                    rewritten(&served, "llama", &[a, b]),
                    expected,
                    "cut at {cut}"
                );
            }
            let bytes: Vec<&[u8]> = text.as_bytes().chunks(1).collect();
            assert_eq!(rewritten(&served, "llama", &bytes), expected);
            let bytes: Vec<&[u8]> = text.as_bytes().chunks(5).collect();
            assert_eq!(rewritten(&served, "llama", &bytes), expected);
        }
    }

    #[test]
    fn only_the_member_with_that_value_is_rewritten() {
        let cases = [
            (r#"{"model" : "m","x":1}"#, r#"{"model" : "llama","x":1}"#),
            (r#"{"model":"m2"}"#, r#"{"model":"m2"}"#),
            (r#"{"model":"m"}"#, r#"{"model":"llama"}"#),
            (
                r#"{"text":"\"model\":\"m\""}"#,
                r#"{"text":"\"model\":\"m\""}"#,
            ),
            (
                r#"{"models":"m","x":"model"}"#,
                r#"{"models":"m","x":"model"}"#,
            ),
            (r#"{"a":"x","model":"m"}"#, r#"{"a":"x","model":"llama"}"#),
            (
                r#"{"model":"mm","model":"m"}"#,
                r#"{"model":"mm","model":"llama"}"#,
            ),
            ("", ""),
            (r#"{"model"#, r#"{"model"#),
            (r#"{"model":"m"#, r#"{"model":"m"#),
        ];
        for (text, expected) in cases {
            for cut in 0..=text.len() {
                let (a, b) = text.as_bytes().split_at(cut);
                assert_eq!(
                    rewritten("m", "llama", &[a, b]),
                    expected,
                    "{text} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn a_chunk_without_a_match_passes_as_the_same_buffer() {
        let mut rewriter = ModelRewriter::new(SERVED, "llama");
        let chunk = Bytes::from_static(b"data: {\"id\":\"x\",\"choices\":[]}\n\n");
        let out = rewriter.rewrite(Some(chunk.clone()), false).unwrap();
        assert_eq!((out.as_ptr(), out.len()), (chunk.as_ptr(), chunk.len()));
        // A chunk that may end in a match passes its start as a slice, the rest held.
        let chunk = Bytes::from_static(b"data: {\"id\":\"x\",\"mod");
        let out = rewriter.rewrite(Some(chunk.clone()), false).unwrap();
        assert_eq!((out.as_ptr(), out.len()), (chunk.as_ptr(), chunk.len() - 4));
        let out = rewriter.rewrite(Some(Bytes::from_static(b"el\":1}")), true);
        assert_eq!(out.as_deref(), Some(&b"\"model\":1}"[..]));
        // Nothing held at the end: the last call may bring no chunk.
        let mut rewriter = ModelRewriter::new(SERVED, "llama");
        let _ = rewriter.rewrite(Some(Bytes::from_static(b"{\"model\":\"meta")), false);
        let out = rewriter.rewrite(None, true);
        assert_eq!(out.as_deref(), Some(&b"\"model\":\"meta"[..]));
    }

    #[test]
    fn names_are_checked_and_answers_rewritten_only_when_asked() {
        assert!(ServedModel::new("", AnswerModel::Requested).is_err());
        assert!(ServedModel::new("a\"b", AnswerModel::Requested).is_err());
        assert!(ServedModel::new("a\nb", AnswerModel::Requested).is_err());
        let requested = ServedModel::new(SERVED, AnswerModel::Requested).unwrap();
        assert_eq!(requested.json(), format!("\"{SERVED}\"").as_bytes());
        assert!(requested.answer_rewriter(Some("llama")).is_some());
        assert!(requested.answer_rewriter(Some(SERVED)).is_none());
        assert!(requested.answer_rewriter(None).is_none());
        assert!(!requested.changes(Some(SERVED)));
        assert!(requested.changes(Some("llama")) && requested.changes(None));
        let served = ServedModel::new(SERVED, AnswerModel::Served).unwrap();
        assert!(served.answer_rewriter(Some("llama")).is_none());
    }

    fn edits(model: Option<&[u8]>, ask_usage: bool) -> UpstreamEdits<'_> {
        UpstreamEdits {
            model,
            ask_usage,
            ..UpstreamEdits::default()
        }
    }

    #[test]
    fn a_prefill_leg_asks_one_token_unstreamed_and_a_remote_decode() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":500,"n":3,"min_tokens":20,"kv_transfer_params":{"do_remote_prefill":true},"temperature":0.5}"#;
        let edits = UpstreamEdits {
            model: Some(br#""served""#),
            ask_usage: true,
            reset_engine_controls: Some("sluice-1"),
            ..UpstreamEdits::default()
        };
        let leg = prefill_leg_body(body, &edits, NIXL_REMOTE_DECODE).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&leg).unwrap();
        assert_eq!(v["model"], "served");
        assert_eq!(v["stream"], false);
        assert!(v["stream_options"].is_null(), "{v}");
        assert_eq!(
            (
                v["max_tokens"].as_u64(),
                v["max_completion_tokens"].as_u64()
            ),
            (Some(1), Some(1))
        );
        assert_eq!(
            (v["n"].as_u64(), v["min_tokens"].as_u64()),
            (Some(1), Some(0))
        );
        assert_eq!(
            v["kv_transfer_params"]["do_remote_decode"], true,
            "the client's replaced: {v}"
        );
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(v["temperature"], 0.5, "the rest as sent");
        // A body without the members gets them.
        let leg = prefill_leg_body(
            br#"{"model":"m","prompt":"x"}"#,
            &UpstreamEdits::default(),
            NIXL_REMOTE_DECODE,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&leg).unwrap();
        assert_eq!(
            (v["max_tokens"].as_u64(), v["stream"].as_bool()),
            (Some(1), Some(false))
        );
        assert!(
            v.get("n").is_none() && v.get("stream_options").is_none(),
            "{v}"
        );
        assert!(prefill_leg_body(b"[1]", &UpstreamEdits::default(), NIXL_REMOTE_DECODE).is_none());
    }

    #[test]
    fn a_decode_leg_gets_the_prefill_answer_s_parameters_in_place_of_the_client_s() {
        let params = br#"{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1]}"#;
        let body = br#"{"model":"m","prompt":"x","stream":true,"kv_transfer_params":{"do_remote_decode":true}}"#;
        let edits = UpstreamEdits {
            reset_engine_controls: Some("id"),
            kv_transfer_params: Some(params),
            ..UpstreamEdits::default()
        };
        let sent = upstream_body(body, None, &edits).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(v["kv_transfer_params"]["remote_engine_id"], "e");
        assert_eq!(v["stream"], true);
        // Without a transfer, the client's are reset as before.
        let reset = UpstreamEdits {
            reset_engine_controls: Some("id"),
            ..UpstreamEdits::default()
        };
        let sent = upstream_body(body, None, &reset).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert!(v["kv_transfer_params"].is_null());
    }

    #[test]
    fn the_model_is_spliced_and_every_other_byte_kept() {
        let model = br#""big""#;
        let set = |body: &str, usage: bool| {
            upstream_body(body.as_bytes(), None, &edits(Some(model), usage))
                .map(|b| String::from_utf8(b.to_vec()).unwrap())
        };
        assert_eq!(
            set("{ \"model\" : \"llama\" ,\"messages\":[] }", false).as_deref(),
            Some("{ \"model\" : \"big\" ,\"messages\":[] }")
        );
        assert_eq!(
            set(r#"{"messages":[]}"#, false).as_deref(),
            Some(r#"{"messages":[],"model":"big"}"#)
        );
        assert_eq!(
            set(r#"{"model":"llama","stream":true}"#, true).as_deref(),
            Some(r#"{"model":"big","stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            set("{}", true).as_deref(),
            Some(r#"{"model":"big","stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(set("[1]", true), None);
        assert_eq!(upstream_body(b"{\"a\":1}", None, &edits(None, false)), None);
    }

    #[test]
    fn a_tenant_gets_its_own_cache_salt_and_the_engine_controls_are_reset() {
        let id = "sluice-1";
        let salted = |body: &str, tenant: &str| {
            let e = UpstreamEdits {
                salt_for_tenant: Some(tenant),
                reset_engine_controls: Some(id),
                ..UpstreamEdits::default()
            };
            let sent = upstream_body(body.as_bytes(), None, &e).unwrap();
            serde_json::from_slice::<serde_json::Value>(&sent).unwrap()
        };
        let a = salted(r#"{"model":"m"}"#, "a");
        let b = salted(r#"{"model":"m"}"#, "b");
        assert_ne!(a["cache_salt"], b["cache_salt"]);
        assert_eq!(a["cache_salt"].as_str().unwrap().len(), 32);
        // A client's own salt separates its requests within its tenant, never across.
        let own = salted(r#"{"model":"m","cache_salt":"x"}"#, "a");
        assert_ne!(own["cache_salt"], a["cache_salt"]);
        assert_ne!(own["cache_salt"], "x");
        assert_eq!(salted(r#"{}"#, "a")["cache_salt"], a["cache_salt"]);

        let controls = salted(
            r#"{"model":"m","priority":-100,"kv_transfer_params":{"do_remote_prefill":true},"vllm_xargs":{"k":1},"request_id":"victim","priority":-5}"#,
            "a",
        );
        assert_eq!(controls["priority"], 0);
        assert!(controls["kv_transfer_params"].is_null());
        assert!(controls["vllm_xargs"].is_null());
        assert_eq!(controls["request_id"], "sluice-1");
        // Absent ones stay absent; the request's own fields are kept.
        let plain = salted(r#"{"model":"m","max_tokens":5}"#, "a");
        assert!(plain.get("priority").is_none() && plain.get("request_id").is_none());
        assert_eq!(plain["max_tokens"], 5);
        // Appended to an empty object, each member after the first gets its comma.
        let e = UpstreamEdits {
            model: Some(br#""big""#),
            ask_usage: true,
            salt_for_tenant: Some("a"),
            reset_engine_controls: None,
            kv_transfer_params: None,
        };
        let sent = upstream_body(b"{}", None, &e).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(v["model"], "big");
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["cache_salt"], a["cache_salt"]);
    }

    #[test]
    fn the_usage_request_is_the_same_as_ask_for_usage() {
        for body in [
            r#"{"model":"m","stream":true}"#,
            r#"{"stream":true,"stream_options":null}"#,
            r#"{"stream":true,"stream_options":{}}"#,
            r#"{"stream":true,"stream_options":{"continuous_usage_stats":true}}"#,
            r#"{"stream":true,"stream_options":{"include_usage":false}}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"{"stream":true,"stream_options":7}"#,
            "{\n \"stream\" : true ,\n \"stream_options\" : { \"include_usage\" : null }\n}",
            "{}",
            "nope",
        ] {
            assert_eq!(
                upstream_body(body.as_bytes(), None, &edits(None, true)),
                ask_for_usage(body.as_bytes()),
                "{body}"
            );
        }
    }

    #[test]
    fn what_the_parse_saw_gives_the_edits_that_reading_the_body_again_gives() {
        use crate::{Endpoint, LlmCall};
        let bodies = [
            r#"{"model":"llama","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            "{ \"messages\" : [{\"role\":\"user\",\"content\":\"hi\"}] , \"model\" : \"llama\" }\n",
            r#"{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":null}"#,
            r#"{"messages":[{"role":"user","content":"a \"quoted\" }"}],"stream":true,"stream_options":{"include_usage":false},"x":[1,{"y":"}"}]}"#,
            r#"{"messages":[{"role":"user","content":"hi"}],"model":null,"stream":true,"stream_options":{ }}"#,
            r#"{"messages":[{"role":"user","content":"hi"}],"priority":-9,"request_id":"x","cache_salt":"s","vllm_xargs":{"a":1}}"#,
            // An escaped key is not placed by the parse: the body is read again.
            r#"{"messages":[{"role":"user","content":"hi"}],"mod\u0065l":"llama","stream":true}"#,
        ];
        let big: &[u8] = br#""big""#;
        for body in bodies {
            let call = LlmCall::parse(Endpoint::ChatCompletions, Bytes::from(body)).unwrap();
            // The parse placed the members, unless a key was escaped.
            assert_eq!(
                ObjectSpans::from_seen(body.as_bytes(), &call.request.seen).is_some(),
                !body.contains("\\u0065"),
                "{body}"
            );
            for (model, usage) in [(Some(big), false), (None, true), (Some(big), true)] {
                let seen = upstream_body(
                    body.as_bytes(),
                    Some(&call.request.seen),
                    &edits(model, usage),
                );
                assert!(seen.is_some(), "{body}");
                assert_eq!(
                    seen,
                    upstream_body(body.as_bytes(), None, &edits(model, usage)),
                    "{body}"
                );
            }
            let all = UpstreamEdits {
                model: Some(big),
                ask_usage: true,
                salt_for_tenant: Some("t"),
                reset_engine_controls: Some("id"),
                kv_transfer_params: None,
            };
            assert_eq!(
                upstream_body(body.as_bytes(), Some(&call.request.seen), &all),
                upstream_body(body.as_bytes(), None, &all),
                "{body}"
            );
        }
    }
}
