//! An answer's token counts, found as its body passes, and the request change that makes a
//! stream report them.
//!
//! vLLM reports `usage` at the end: the last field but two of a JSON answer, or the last
//! chunk before `[DONE]` of a stream that asked for it (`stream_options.include_usage`). The
//! body itself goes to the client chunk by chunk and is never held here: the scanner looks for
//! the `"usage"` key byte by byte and copies only the object that follows it.
//!
//! The core runs one [`UsageScanner`] over every LLM answer and records what it finds in the
//! request's context (`sluice_sdk::RequestCtx::usage`); a plugin that needs the counts asks for
//! them with `sluice_sdk::RequestCtx::want_usage` instead of scanning the body itself.

use crate::raw_json::{self, Edit};
use memchr::memmem;
use std::sync::LazyLock;

/// The token counts of one answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// The prompt's tokens, as the model counted them.
    pub prompt_tokens: u64,
    /// The tokens generated.
    pub completion_tokens: u64,
}

/// Where a family's answers put their token counts: the key of the usage object, and the
/// names of its counts (see [`crate::family::ApiFamily::usage_names`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageNames {
    /// The usage object's key, with its quotes. In valid JSON these bytes can only be an
    /// object key: inside a string both quotes would be escaped, and the closing one would
    /// not follow the name.
    pub key: &'static str,
    /// The counts whose sum is the prompt's tokens (at most 4), each as the last usage object
    /// that has it says.
    pub prompt: &'static [&'static str],
    /// The count of generated tokens.
    pub completion: &'static str,
    /// The path, from the usage object, of the prompt tokens the engine's prefix cache served.
    pub cached: &'static [&'static str],
    /// The path of the prompt tokens the engine computed and wrote to its prefix cache
    /// (vLLM 0.32's `created_cache_tokens`, in whole blocks).
    pub created: &'static [&'static str],
}

impl UsageNames {
    /// OpenAI's chat and text completions (and vLLM's utility routes).
    pub const OPENAI: UsageNames = UsageNames {
        key: "\"usage\"",
        prompt: &["prompt_tokens"],
        completion: "completion_tokens",
        cached: &["prompt_tokens_details", "cached_tokens"],
        created: &["prompt_tokens_details", "created_cache_tokens"],
    };
    /// OpenAI's Responses.
    pub const RESPONSES: UsageNames = UsageNames {
        key: "\"usage\"",
        prompt: &["input_tokens"],
        completion: "output_tokens",
        cached: &["input_tokens_details", "cached_tokens"],
        created: &["input_tokens_details", "created_cache_tokens"],
    };
    /// Anthropic's Messages: `input_tokens` leaves out what the cache served
    /// (`cache_read_input_tokens`) and what was written to it (`cache_creation_input_tokens`),
    /// which the prompt's tokens include.
    pub const ANTHROPIC: UsageNames = UsageNames {
        key: "\"usage\"",
        prompt: &[
            "input_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
        ],
        completion: "output_tokens",
        cached: &["cache_read_input_tokens"],
        created: &["cache_creation_input_tokens"],
    };

    fn key(&self) -> &'static [u8] {
        self.key.as_bytes()
    }

    /// The key's name, without its quotes.
    fn name(&self) -> &'static [u8] {
        let key = self.key();
        key.get(1..key.len().saturating_sub(1)).unwrap_or_default()
    }
}

impl Default for UsageNames {
    fn default() -> Self {
        UsageNames::OPENAI
    }
}

/// The most bytes of a `usage` object kept. vLLM's is under 200 bytes (with
/// `prompt_tokens_details` under 300); anything longer is not the usage being looked for.
const MAX_OBJECT: usize = 4096;

/// Watches a response's body chunks (a JSON answer or an SSE stream) and finds its `usage`,
/// without buffering the body: the only bytes kept are those of a candidate `usage` object
/// (at most 4 KiB), so the object may be split across any number of chunks.
#[derive(Debug, Default)]
pub struct UsageScanner {
    names: UsageNames,
    state: State,
    /// Where a family's answers may echo the client's own JSON (Responses echoes `tools` and
    /// `text`, whose schemas can hold any key), the deepest object whose `usage` counts, and
    /// the reader of the answer's nesting that says how deep each key is.
    nesting: Option<Nesting>,
    /// The candidate object's bytes, from its `{`.
    object: Vec<u8>,
    found: Option<Usage>,
    /// The last value each of the prompt's summands ([`UsageNames::prompt`]) had, merged
    /// name by name over the usage objects: one that leaves a summand out keeps what an
    /// earlier one said of it.
    prompt_parts: [Option<u64>; 4],
    /// The prompt tokens the engine's prefix cache served, when the found usage says.
    cached_tokens: Option<u64>,
    /// The prompt tokens the engine computed into new cache blocks, when it says.
    created_tokens: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Looking for the usage key; this many of its bytes matched so far.
    #[default]
    Seeking,
    Matching(usize),
    /// After the key: whitespace, then `:`.
    AfterKey,
    /// After the colon: whitespace, then `{` (anything else, e.g. `null`, is no usage).
    AfterColon,
    /// Copying the object, tracking nesting and strings to find its end.
    InObject {
        depth: u32,
        in_string: bool,
        escaped: bool,
    },
}

/// A usage object's members, read by the family's [`UsageNames`]; the others (`total_tokens`,
/// the completion's details) are ignored. A count an object leaves out keeps what an earlier
/// one said: Anthropic's `message_start` says the input, `message_delta` the output.
type Counts = serde_json::Map<String, serde_json::Value>;

/// The answer's nesting, read byte by byte: how many objects and arrays are open, whether a
/// string is, and whether the string just closed was `usage`. Each SSE event's data is one
/// line of JSON: a blank line (an event's end) starts again at the top, whatever came before.
#[derive(Debug, Default)]
struct Nesting {
    /// `usage` counts only as a member of an object this deep or less (the answer itself is 1).
    max_depth: u32,
    /// The usage key's name, without its quotes.
    key: &'static [u8],
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The open string's first bytes, and how many it has so far.
    text: [u8; 32],
    len: usize,
    /// The last byte outside a string was a newline (`\r` aside).
    newline: bool,
}

impl Nesting {
    /// Reads one byte; whether it closed a `"usage"` string no deeper than the bound.
    fn read(&mut self, byte: u8) -> bool {
        if self.in_string {
            if byte == b'\n' {
                // No JSON string holds a raw newline: the event was not JSON; start again.
                *self = Nesting {
                    max_depth: self.max_depth,
                    key: self.key,
                    newline: true,
                    ..Nesting::default()
                };
            } else if self.escaped {
                self.escaped = false;
                self.len = usize::MAX;
            } else if byte == b'\\' {
                self.escaped = true;
            } else if byte == b'"' {
                self.in_string = false;
                return self.len == self.key.len()
                    && self.text.get(..self.len) == Some(self.key)
                    && self.depth <= self.max_depth;
            } else {
                if let Some(slot) = self.text.get_mut(self.len) {
                    *slot = byte;
                }
                self.len = self.len.saturating_add(1);
            }
            return false;
        }
        match byte {
            b'"' => {
                self.in_string = true;
                self.len = 0;
            }
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' => self.depth = self.depth.saturating_sub(1),
            b'\n' if self.newline => self.depth = 0,
            _ => {}
        }
        if byte != b'\r' {
            self.newline = byte == b'\n';
        }
        false
    }
}

impl UsageScanner {
    /// A scanner that takes `usage` only as a member of an object `max_depth` deep or less
    /// (1: the answer's own; 2: an object it holds, as a Responses event's `response`), for
    /// answers that echo the client's JSON deeper down. Reads every byte, where the default
    /// scanner searches for the key.
    pub fn at_most_nested(names: UsageNames, max_depth: u32) -> UsageScanner {
        UsageScanner {
            names,
            nesting: Some(Nesting {
                max_depth,
                key: names.name(),
                ..Nesting::default()
            }),
            ..UsageScanner::default()
        }
    }

    /// A scanner of answers that put their counts where `names` says.
    pub fn new(names: UsageNames) -> UsageScanner {
        UsageScanner {
            names,
            ..UsageScanner::default()
        }
    }

    /// Looks at the next bytes of the body; no allocation unless they hold a `"usage"` key.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.nesting.is_some() {
            for &byte in chunk {
                self.feed_nested(byte);
            }
            return;
        }
        static FINDER: LazyLock<memmem::Finder<'static>> =
            LazyLock::new(|| memmem::Finder::new(UsageNames::OPENAI.key()));
        let key = self.names.key();
        let mut rest = chunk;
        while !rest.is_empty() {
            if self.state == State::Seeking {
                // Fast path: a SIMD search for the whole key; only a key cut at the chunk's
                // end is matched byte by byte, from its start in the next chunk.
                let found = if key == FINDER.needle() {
                    FINDER.find(rest)
                } else {
                    memmem::find(rest, key)
                };
                match found {
                    Some(at) => {
                        self.state = State::AfterKey;
                        rest = rest.get(at + key.len()..).unwrap_or_default();
                    }
                    None => {
                        self.state = key_start_at_end(key, rest);
                        return;
                    }
                }
                continue;
            }
            // Inside the usage object, the bytes up to the next one that can change the
            // state (a quote or a backslash in a string; a quote or a brace outside one) are
            // copied at once, as the byte-by-byte copy would have copied them.
            if let State::InObject {
                in_string,
                escaped: false,
                ..
            } = self.state
            {
                let plain = if in_string {
                    memchr::memchr2(b'"', b'\\', rest)
                } else {
                    memchr::memchr3(b'"', b'{', b'}', rest)
                }
                .unwrap_or(rest.len());
                if plain > 0 && self.object.len() + plain < MAX_OBJECT {
                    let (copied, tail) = rest.split_at(plain);
                    self.object.extend_from_slice(copied);
                    rest = tail;
                    continue;
                }
            }
            let Some((&byte, tail)) = rest.split_first() else {
                return;
            };
            self.step(byte);
            rest = tail;
        }
    }

    /// The usage found in what was fed (the last `"usage": {...}` objects' counts, the
    /// prompt's required, an output left out counting 0), if any. `"usage": null` (stream
    /// chunks before the last) does not count.
    pub fn usage(&self) -> Option<Usage> {
        self.found
    }

    /// Of the found usage's prompt, the tokens the engine's prefix cache served
    /// (`prompt_tokens_details.cached_tokens`), when it says.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.cached_tokens
    }

    /// The prompt tokens the engine computed and wrote to new prefix-cache blocks
    /// (`prompt_tokens_details.created_cache_tokens`, vLLM 0.32), when it says.
    pub fn created_cache_tokens(&self) -> Option<u64> {
        self.created_tokens
    }

    /// One byte, where only a key at the bounded depth counts: the nesting reader finds the
    /// key, the usual states read what follows it.
    fn feed_nested(&mut self, byte: u8) {
        let key = self.nesting.as_mut().is_some_and(|n| n.read(byte));
        match self.state {
            State::Seeking | State::Matching(_) => {
                if key {
                    self.state = State::AfterKey;
                }
            }
            _ => {
                self.step(byte);
                if matches!(self.state, State::Matching(_)) {
                    self.state = State::Seeking;
                }
            }
        }
    }

    fn step(&mut self, byte: u8) {
        let key = self.names.key();
        self.state = match self.state {
            State::Seeking => seek_key(key, byte, 0),
            State::Matching(matched) => seek_key(key, byte, matched),
            State::AfterKey => match byte {
                b':' => State::AfterColon,
                b if is_json_space(b) => State::AfterKey,
                b => seek_key(key, b, 0),
            },
            State::AfterColon => match byte {
                b'{' => {
                    self.object.clear();
                    self.object.push(byte);
                    State::InObject {
                        depth: 1,
                        in_string: false,
                        escaped: false,
                    }
                }
                b if is_json_space(b) => State::AfterColon,
                b => seek_key(key, b, 0),
            },
            State::InObject {
                depth,
                in_string,
                escaped,
            } => self.copy(byte, depth, in_string, escaped),
        };
    }

    fn copy(&mut self, byte: u8, depth: u32, in_string: bool, escaped: bool) -> State {
        if self.object.len() >= MAX_OBJECT {
            self.object.clear();
            return seek_key(self.names.key(), byte, 0);
        }
        self.object.push(byte);
        let (depth, in_string, escaped) = match (in_string, escaped, byte) {
            (true, true, _) => (depth, true, false),
            (true, false, b'\\') => (depth, true, true),
            (true, false, b'"') => (depth, false, false),
            (true, false, _) => (depth, true, false),
            (false, _, b'"') => (depth, true, false),
            (false, _, b'{') => (depth.saturating_add(1), false, false),
            (false, _, b'}') => (depth.saturating_sub(1), false, false),
            (false, _, _) => (depth, false, false),
        };
        if depth > 0 {
            return State::InObject {
                depth,
                in_string,
                escaped,
            };
        }
        if let Ok(counts) = serde_json::from_slice::<Counts>(&self.object) {
            let names = self.names;
            let count = |name: &str| counts.get(name).and_then(serde_json::Value::as_u64);
            let before = self.found;
            for (part, name) in self.prompt_parts.iter_mut().zip(names.prompt) {
                if let Some(value) = count(name) {
                    *part = Some(value);
                }
            }
            let prompt = self
                .prompt_parts
                .iter()
                .flatten()
                .copied()
                .reduce(u64::saturating_add);
            // An answer that generates nothing (embeddings) may leave the output out.
            let completion = count(names.completion).or(before.map(|u| u.completion_tokens));
            if let Some(prompt_tokens) = prompt {
                self.found = Some(Usage {
                    prompt_tokens,
                    completion_tokens: completion.unwrap_or(0),
                });
            }
            let at = |path: &[&str]| {
                path.split_first().and_then(|(first, rest)| {
                    rest.iter()
                        .try_fold(counts.get(*first)?, |at, name| at.get(name))?
                        .as_u64()
                })
            };
            if let Some(cached) = at(names.cached) {
                self.cached_tokens = Some(cached);
            }
            if let Some(created) = at(names.created) {
                self.created_tokens = Some(created);
            }
        }
        self.object.clear();
        State::Seeking
    }
}

/// How much of `key`'s start `bytes` ends with (none of all of it: the search found none).
fn key_start_at_end(key: &[u8], bytes: &[u8]) -> State {
    (1..key.len())
        .rev()
        .find(|n| key.get(..*n).is_some_and(|start| bytes.ends_with(start)))
        .map_or(State::Seeking, State::Matching)
}

/// Advances the match of `key`, `matched` bytes of which are already matched.
fn seek_key(key: &[u8], byte: u8, matched: usize) -> State {
    if key.get(matched) == Some(&byte) {
        let matched = matched + 1;
        return if matched == key.len() {
            State::AfterKey
        } else {
            State::Matching(matched)
        };
    }
    // A mismatch can only restart on a quote: the key has no other quote but its last.
    if byte == b'"' {
        State::Matching(1)
    } else {
        State::Seeking
    }
}

fn is_json_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

/// A stream request's body with `stream_options.include_usage` set, for a client that did not
/// ask: vLLM then ends the stream with a usage chunk, which the core reads and removes before
/// the client (or any plugin's `response_body`) sees it. None when the body is not a JSON object, already asks
/// for usage, or has a `stream_options` that is neither an object nor `null`.
///
/// The body is copied once with the change spliced in, every other byte kept: the member
/// `"stream_options":{"include_usage":true}` appended, or the client's `stream_options`
/// (the last, if repeated) given `"include_usage":true`, in place of its own value or
/// appended to its members.
pub fn ask_for_usage(body: &[u8]) -> Option<bytes::Bytes> {
    const OPTIONS: &[u8] = br#"{"include_usage":true}"#;
    let spans = raw_json::object_spans(body, &["stream_options"])?;
    let edit = match spans.value("stream_options") {
        None => spans.append("stream_options", OPTIONS),
        Some(range) => {
            let options = body.get(range.clone())?;
            if options == b"null" {
                Edit {
                    range,
                    text: OPTIONS.to_vec(),
                }
            } else {
                // An object (anything else is no options vLLM takes: left alone).
                let inner = raw_json::object_spans(options, &["include_usage"])?;
                let edit = match inner.value("include_usage") {
                    Some(at) if options.get(at.clone()) == Some(b"true") => return None,
                    Some(at) => Edit {
                        range: at,
                        text: b"true".to_vec(),
                    },
                    None => inner.append("include_usage", b"true"),
                };
                Edit {
                    range: range.start + edit.range.start..range.start + edit.range.end,
                    text: edit.text,
                }
            }
        }
    };
    raw_json::apply(body, vec![edit]).map(bytes::Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: &str = include_str!("../../../tests/fixtures/vllm-chat-completion.json");
    const COMPLETION: &str = include_str!("../../../tests/fixtures/vllm-completion.json");
    const CHAT_STREAM: &str = include_str!("../../../tests/fixtures/vllm-chat-stream.sse");

    fn scan_whole(body: &[u8]) -> Option<Usage> {
        let mut scanner = UsageScanner::default();
        scanner.feed(body);
        scanner.usage()
    }

    fn scan_in_pieces(body: &[u8], sizes: impl Iterator<Item = usize>) -> Option<Usage> {
        let mut scanner = UsageScanner::default();
        let mut rest = body;
        for size in sizes {
            if rest.is_empty() {
                break;
            }
            let (piece, tail) = rest.split_at(size.clamp(1, rest.len()));
            scanner.feed(piece);
            scanner.feed(b"");
            rest = tail;
        }
        scanner.feed(rest);
        scanner.usage()
    }

    /// Same answer whole, byte by byte, and in pseudo-random pieces of 1 to 64 bytes.
    fn scan_every_way(body: &str) -> Option<Usage> {
        let body = body.as_bytes();
        let whole = scan_whole(body);
        assert_eq!(scan_in_pieces(body, std::iter::repeat(1)), whole);
        for seed in 1..50u64 {
            let mut state = seed;
            let sizes = std::iter::repeat_with(move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 64) as usize + 1
            });
            assert_eq!(scan_in_pieces(body, sizes), whole, "seed {seed}");
        }
        // Every single split point.
        for split in 0..=body.len() {
            let (a, b) = body.split_at(split);
            let mut scanner = UsageScanner::default();
            scanner.feed(a);
            scanner.feed(b);
            assert_eq!(scanner.usage(), whole, "split at {split}");
        }
        whole
    }

    fn usage(prompt_tokens: u64, completion_tokens: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens,
            completion_tokens,
        })
    }

    #[test]
    fn vllm_fixtures() {
        assert_eq!(scan_every_way(CHAT), usage(24, 8));
        assert_eq!(scan_every_way(COMPLETION), usage(7, 16));
        assert_eq!(scan_every_way(CHAT_STREAM), usage(24, 8));
    }

    #[test]
    fn stream_without_a_usage_chunk() {
        let without: String = CHAT_STREAM
            .split("\n\n")
            .filter(|event| !event.contains("\"usage\""))
            .map(|event| format!("{event}\n\n"))
            .collect();
        assert!(without.contains("[DONE]") && without.contains("Paris"));
        assert_eq!(scan_every_way(&without), None);
        assert_eq!(scan_every_way(""), None);
    }

    #[test]
    fn usage_null_does_not_count_and_the_last_object_wins() {
        // The simulator's completion stream: `"usage":null` in every chunk, then the usage chunk.
        let chunk = |text: &str| {
            format!(
                "data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}}],\"usage\":null}}\n\n"
            )
        };
        let only_nulls = format!("{}{}data: [DONE]\n\n", chunk(" Paris"), chunk(","));
        assert_eq!(scan_every_way(&only_nulls), None);
        let with_usage = format!(
            "{}{}data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{{\"prompt_tokens\":7,\"total_tokens\":9,\"completion_tokens\":2}}}}\n\ndata: [DONE]\n\n",
            chunk(" Paris"),
            chunk(",")
        );
        assert_eq!(scan_every_way(&with_usage), usage(7, 2));
        // continuous_usage_stats: a usage in every chunk; the last is the total.
        let continuous = "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n\
                          data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                          data: {\"usage\":null}\n\ndata: [DONE]\n\n";
        assert_eq!(scan_every_way(continuous), usage(5, 2));
    }

    #[test]
    fn simulator_shapes() {
        // Non-stream: field order of the simulator's ChatCompletion, with logprobs.
        let chat = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":" the usage","refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":[],"reasoning_content":null},"logprobs":{"content":[{"token":" usage","logprob":-0.1,"bytes":[32,117],"top_logprobs":[]}]},"finish_reason":"length","stop_reason":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":11,"total_tokens":12,"completion_tokens":1,"prompt_tokens_details":null},"prompt_logprobs":null,"kv_transfer_params":null}"#;
        assert_eq!(scan_every_way(chat), usage(11, 1));
        // Stream with include_usage: the UsageChunk, `choices` empty.
        let stream = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" usage\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n\
                      data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"total_tokens\":13,\"completion_tokens\":2}}\n\n\
                      data: [DONE]\n\n";
        assert_eq!(scan_every_way(stream), usage(11, 2));
    }

    #[test]
    fn usage_in_text_and_odd_objects_is_ignored() {
        // The word inside generated text, escaped quotes, a usage without the counts or with
        // non-integer counts: none is a usage.
        for body in [
            r#"{"choices":[{"text":"\"usage\": {\"prompt_tokens\":1,\"completion_tokens\":2}"}]}"#,
            r#"{"choices":[{"text":"usage\\"}],"x":"usage"}"#,
            r#"{"usage":{"total_tokens":3}}"#,
            r#"{"usage":{"prompt_tokens":1.5,"completion_tokens":2}}"#,
            r#"{"usage":{"prompt_tokens":-1,"completion_tokens":2}}"#,
            r#"{"usage":{"prompt_tokens":"1","completion_tokens":2}}"#,
            r#"{"usage":[{"prompt_tokens":1,"completion_tokens":2}]}"#,
            r#"{"usage":"{\"prompt_tokens\":1,\"completion_tokens\":2}"}"#,
            r#"{"usage" : null}"#,
        ] {
            assert_eq!(scan_every_way(body), None, "{body}");
        }
    }

    #[test]
    fn nested_details_strings_and_whitespace() {
        let body = "{\"usage\" :\n {\"prompt_tokens\": 3, \"note\": \"} {\\\"}\", \
                    \"prompt_tokens_details\": {\"cached_tokens\": 2}, \"completion_tokens\": 4}}";
        assert_eq!(scan_every_way(body), usage(3, 4));
        // A key that almost matches, then the real one.
        let body = r#"{"usag":1,""usage"x":2,"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
        assert_eq!(scan_every_way(body), usage(1, 1));
    }

    const RESPONSES_STREAM: &str =
        include_str!("../../../tests/fixtures/vllm-0.32/responses-stream.http");
    const MESSAGES_STREAM: &str =
        include_str!("../../../tests/fixtures/vllm-0.32/messages-stream.http");

    /// Feeds `body` to a fresh scanner of `names` (at most `max_depth` deep) whole, and in
    /// pieces of every size up to 64.
    fn nested_names_every_way(names: UsageNames, max_depth: u32, body: &str) -> Option<Usage> {
        let whole = {
            let mut scanner = UsageScanner::at_most_nested(names, max_depth);
            scanner.feed(body.as_bytes());
            scanner.usage()
        };
        for size in 1..64 {
            let mut scanner = UsageScanner::at_most_nested(names, max_depth);
            body.as_bytes()
                .chunks(size)
                .for_each(|piece| scanner.feed(piece));
            assert_eq!(scanner.usage(), whole, "in pieces of {size}");
        }
        whole
    }

    /// [`nested_names_every_way`] with the Responses names (as Messages' without a cache).
    fn nested_every_way(max_depth: u32, body: &str) -> Option<Usage> {
        nested_names_every_way(UsageNames::RESPONSES, max_depth, body)
    }

    /// A Responses stream echoes the request's `tools`, whose schema may hold a `usage` of
    /// the client's making: never read, before the end or at it. Only `response.usage` is.
    #[test]
    fn a_usage_the_client_planted_in_an_echo_is_never_read() {
        let planted = RESPONSES_STREAM.replace(
            r#""tools":[]"#,
            r#""tools":[{"type":"function","name":"f","parameters":{"type":"object","usage":{"input_tokens":1000000000,"output_tokens":0}}}]"#,
        );
        assert!(planted.contains("1000000000"));
        let body = &planted[planted.find("\r\n\r\n").unwrap()..];
        let real = nested_every_way(2, body).unwrap();
        assert!(
            real.prompt_tokens > 0 && real.prompt_tokens < 1000,
            "{real:?}"
        );
        assert!(real.completion_tokens > 0, "{real:?}");
        // Cut before `response.completed`: no usage at all. A scanner blind to the nesting
        // takes the planted one, which is the finding.
        let cut = body.split("event: response.completed").next().unwrap();
        let mut blind = UsageScanner::new(UsageNames::RESPONSES);
        blind.feed(cut.as_bytes());
        assert_eq!(blind.usage(), usage(1_000_000_000, 0));
        assert_eq!(nested_every_way(2, cut), None);
        // A whole JSON answer: its own usage, wherever the planted one stands.
        let json = r#"{"usage":{"input_tokens":12,"output_tokens":3},"tools":[{"parameters":{"usage":{"input_tokens":0,"output_tokens":0}}}]}"#;
        assert_eq!(nested_every_way(1, json), usage(12, 3));
        let model_made = r#"{"content":[{"type":"tool_use","input":{"usage":{"input_tokens":1,"output_tokens":1}}}],"usage":{"input_tokens":20,"output_tokens":3}}"#;
        assert_eq!(nested_every_way(1, model_made), usage(20, 3));
        assert_eq!(nested_every_way(1, r#"{"usage": null}"#), None);
    }

    /// Anthropic's stream says the input in `message_start` and the output in
    /// `message_delta`; both are read, at their depths.
    #[test]
    fn a_messages_stream_is_read_at_its_depths() {
        let body = &MESSAGES_STREAM[MESSAGES_STREAM.find("\r\n\r\n").unwrap()..];
        assert_eq!(nested_every_way(2, body), usage(20, 3));
        let cut = body.split("event: message_delta").next().unwrap();
        assert_eq!(nested_every_way(2, cut), usage(20, 0));
    }

    /// Anthropic's `input_tokens` leaves out what the prefix cache served and what was
    /// written to it: the prompt is their sum, and the cache's part is read as cached.
    #[test]
    fn a_messages_prompt_counts_its_cached_tokens() {
        let body = r#"{"usage":{"input_tokens":50,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":896}}"#;
        let mut scanner = UsageScanner::at_most_nested(UsageNames::ANTHROPIC, 1);
        scanner.feed(body.as_bytes());
        assert_eq!(scanner.usage(), usage(946, 2));
        assert_eq!(scanner.cached_tokens(), Some(896));
    }

    /// A family with a key and names of its own (Gemini's `usageMetadata`) is read by them,
    /// and another's `usage` is not.
    /// The summands are merged name by name: `message_start` may say the whole prompt as
    /// `input_tokens` before the cache's part is known, `message_delta` both.
    #[test]
    fn a_messages_prompt_is_merged_name_by_name() {
        let body = concat!(
            r#"{"type":"message_start","message":{"usage":{"input_tokens":946,"output_tokens":0}}}"#,
            "\n\n",
            r#"{"type":"message_delta","usage":{"input_tokens":50,"cache_read_input_tokens":896,"output_tokens":2}}"#,
            "\n\n",
        );
        let mut scanner = UsageScanner::at_most_nested(UsageNames::ANTHROPIC, 2);
        scanner.feed(body.as_bytes());
        assert_eq!(scanner.usage(), usage(946, 2));
        let later = r#"{"type":"message_delta","usage":{"input_tokens":50,"output_tokens":3}}"#;
        scanner.feed(later.as_bytes());
        assert_eq!(scanner.usage(), usage(946, 3), "the cache's part is kept");
    }

    #[test]
    fn vllm_0_32s_created_cache_tokens_are_read() {
        // A decode leg's answer from a real vLLM 0.32 (CPU) after a NIXL transfer.
        let body = br#"{"usage":{"prompt_tokens":669,"total_tokens":677,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":0,"multimodal_tokens":null},"completion_tokens_details":null}}"#;
        let mut scanner = UsageScanner::new(UsageNames::OPENAI);
        scanner.feed(body);
        assert_eq!(scanner.cached_tokens(), Some(0));
        assert_eq!(scanner.created_cache_tokens(), Some(0));
        let mut scanner = UsageScanner::new(UsageNames::OPENAI);
        scanner.feed(br#"{"usage":{"prompt_tokens":9,"completion_tokens":1}}"#);
        assert_eq!(scanner.created_cache_tokens(), None);
    }

    #[test]
    fn a_familys_own_names_are_read() {
        const GEMINI: UsageNames = UsageNames {
            key: "\"usageMetadata\"",
            prompt: &["promptTokenCount"],
            completion: "candidatesTokenCount",
            cached: &["cachedContentTokenCount"],
            created: &[],
        };
        let body = r#"{"candidates":[{"content":{"parts":[{"text":"usage"}]}}],"usageMetadata":{"promptTokenCount":7,"candidatesTokenCount":5,"cachedContentTokenCount":4}}"#;
        for names in [GEMINI] {
            let mut scanner = UsageScanner::new(names);
            for piece in body.as_bytes().chunks(3) {
                scanner.feed(piece);
            }
            assert_eq!(scanner.usage(), usage(7, 5));
            assert_eq!(scanner.cached_tokens(), Some(4));
            assert_eq!(nested_names_every_way(names, 1, body), usage(7, 5));
        }
        let openai = r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
        let mut scanner = UsageScanner::new(GEMINI);
        scanner.feed(openai.as_bytes());
        assert_eq!(scanner.usage(), None);
    }

    #[test]
    fn memory_stays_bounded() {
        // A huge `usage` object is abandoned, not buffered; a later real one is still found.
        let mut scanner = UsageScanner::default();
        scanner.feed(b"{\"usage\":{\"prompt_tokens\":1,\"pad\":\"");
        for _ in 0..1000 {
            scanner.feed(&[b'x'; 1024]);
            assert!(scanner.object.capacity() <= 2 * MAX_OBJECT);
        }
        scanner.feed(b"\",\"completion_tokens\":1}}");
        assert_eq!(scanner.usage(), None);
        scanner.feed(br#"data: {"usage":{"prompt_tokens":2,"completion_tokens":3}}"#);
        assert_eq!(scanner.usage(), usage(2, 3));
        // A long body without usage keeps nothing.
        let mut scanner = UsageScanner::default();
        for _ in 0..1000 {
            scanner.feed(CHAT_STREAM.replace("usage", "other").as_bytes());
        }
        assert_eq!(scanner.object.capacity(), 0);
    }

    #[test]
    fn streams_are_asked_for_usage_once() {
        let asked = |body: &str| {
            ask_for_usage(body.as_bytes()).map(|b| String::from_utf8(b.to_vec()).unwrap())
        };
        assert_eq!(
            asked(r#"{"model":"m","stream":true}"#).as_deref(),
            Some(r#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false}}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":null}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"include_usage":true}}"#),
            None
        );
        assert_eq!(asked(r#"{"stream":true,"stream_options":3}"#), None);
        assert_eq!(asked("[1]"), None);
    }

    #[test]
    fn usage_is_spliced_into_the_clients_bytes() {
        let asked = |body: &str| {
            ask_for_usage(body.as_bytes()).map(|b| String::from_utf8(b.to_vec()).unwrap())
        };
        // Whitespace, escapes and member order elsewhere are kept byte for byte.
        assert_eq!(
            asked("{ \"model\" : \"m\\u0021\",\n  \"stream\": true }\n").as_deref(),
            Some("{ \"model\" : \"m\\u0021\",\n  \"stream\": true ,\"stream_options\":{\"include_usage\":true}}\n")
        );
        // Nested options: merged into the client's object, its other members kept.
        assert_eq!(
            asked(r#"{"stream_options":{"continuous_usage_stats":true, "x":{"include_usage":false}},"stream":true}"#).as_deref(),
            Some(r#"{"stream_options":{"continuous_usage_stats":true, "x":{"include_usage":false},"include_usage":true},"stream":true}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{}}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"include_usage":null}}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
        );
        // Escaped keys are the same keys.
        assert_eq!(
            asked(r#"{"stream":true,"stream_\u006fptions":{"include_\u0075sage":true}}"#),
            None
        );
        // Repeated keys: the last is the one vLLM reads, and the one changed.
        assert_eq!(
            asked(r#"{"stream_options":{"include_usage":true},"stream_options":null}"#).as_deref(),
            Some(
                r#"{"stream_options":{"include_usage":true},"stream_options":{"include_usage":true}}"#
            )
        );
        assert_eq!(
            asked(r#"{"stream_options":null,"stream_options":{"include_usage":true}}"#),
            None
        );
        assert_eq!(
            asked(r#"{"stream_options":{"include_usage":false,"include_usage":true}}"#),
            None
        );
        // Not one JSON object.
        for body in [
            "",
            "null",
            "\"x\"",
            "{",
            r#"{"stream":true} {}"#,
            r#"{"stream_options":[]}"#,
        ] {
            assert_eq!(asked(body), None, "{body:?}");
        }
    }
}
