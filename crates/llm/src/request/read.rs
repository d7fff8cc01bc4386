//! The one reader of OpenAI-shaped request members, shared by the shipped families, each in
//! its [`super::Dialect`]: one pass over the body with serde, no tree, every text kept as a
//! slice of it, and a type error named by its member's path (as OpenAI's `param`).

use super::text::*;
use super::{Dialect, Input, LlmRequest, PLACED_MEMBERS};
use super::{CHARS_PER_TOKEN, TOKENS_PER_MESSAGE};
use crate::raw_json::{self, KeyIndex};
use bytes::Bytes;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fmt;

/// How a value's JSON fails the type its field needs, in serde's words.
pub(super) enum Mismatch {
    /// `invalid type: <found>, expected <expected>`.
    Type {
        found: String,
        expected: &'static str,
    },
    /// The value is none of the forms of a field that has several.
    Untagged(&'static str),
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Type { found, expected } => {
                write!(f, "invalid type: {found}, expected {expected}")
            }
            Mismatch::Untagged(name) => {
                write!(f, "data did not match any variant of untagged enum {name}")
            }
        }
    }
}

/// What JSON value `json` is, as serde describes it in errors (a short scalar with its
/// value: ``integer `3` ``).
pub(super) fn kind_of(json: &str) -> String {
    let kind = match json.as_bytes().first() {
        Some(b'"') => return "string".into(),
        Some(b'[') => return "sequence".into(),
        Some(b'{') => return "map".into(),
        Some(b'n') => return "null".into(),
        Some(b't' | b'f') => "boolean",
        _ if json.contains(['.', 'e', 'E']) => "floating point",
        _ => "integer",
    };
    if json.len() <= 32 {
        format!("{kind} `{json}`")
    } else {
        kind.into()
    }
}

pub(super) fn type_mismatch(json: &str, expected: &'static str) -> Mismatch {
    Mismatch::Type {
        found: kind_of(json),
        expected,
    }
}

/// A field read as its JSON text, then checked by `check`. `null` is `None` for a nullable
/// field, and goes to `check` (which refuses it) for one that is required.
pub(super) struct Checked<F> {
    pub(super) nullable: bool,
    pub(super) check: F,
}

impl<'de, T, F> DeserializeSeed<'de> for Checked<F>
where
    F: FnOnce(&'de RawValue) -> Result<T, Mismatch>,
{
    type Value = Option<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<T>, D::Error> {
        let raw = if self.nullable {
            match Option::<&'de RawValue>::deserialize(deserializer)? {
                Some(raw) => raw,
                None => return Ok(None),
            }
        } else {
            <&'de RawValue>::deserialize(deserializer)?
        };
        (self.check)(raw).map(Some).map_err(de::Error::custom)
    }
}

pub(super) fn nullable<'de, T, F>(check: F) -> Checked<F>
where
    F: FnOnce(&'de RawValue) -> Result<T, Mismatch>,
{
    Checked {
        nullable: true,
        check,
    }
}

pub(super) fn text(shared: &Bytes, raw: &RawValue) -> Result<Text, Mismatch> {
    Text::from_json(shared, raw.get()).ok_or_else(|| type_mismatch(raw.get(), "a string"))
}

pub(super) fn array(shared: &Bytes, raw: &RawValue) -> Result<JsonArray, Mismatch> {
    let json = raw.get();
    if !json.starts_with('[') {
        return Err(type_mismatch(json, "a sequence"));
    }
    Ok(JsonArray {
        raw: share(shared, json.as_bytes()),
        len: raw_json::elements(json.as_bytes()).count(),
    })
}

pub(super) fn content(shared: &Bytes, raw: &RawValue) -> Result<Content, Mismatch> {
    let json = raw.get();
    match json.as_bytes().first() {
        Some(b'"') => text(shared, raw).map(Content::Text),
        Some(b'[') => {
            let (mut len, mut text_len) = (0usize, 0usize);
            for part in raw_json::elements(json.as_bytes()) {
                len += 1;
                if let Some(t) = part_text(shared, part) {
                    text_len = text_len.saturating_add(t.len());
                }
            }
            Ok(Content::Parts(Parts {
                raw: share(shared, json.as_bytes()),
                len,
                text_len,
            }))
        }
        _ => Err(Mismatch::Untagged("Content")),
    }
}

/// The `text` of a content part, when it is an object with a string `text` (the last one).
pub(super) fn part_text(shared: &Bytes, part: &[u8]) -> Option<Text> {
    if part.first() != Some(&b'{') {
        return None;
    }
    let range = raw_json::object_spans(part, &["text"])?.value("text")?;
    let json = std::str::from_utf8(part.get(range)?).ok()?;
    Text::from_json(shared, json)
}

pub(super) fn prompt(shared: &Bytes, raw: &RawValue) -> Result<Prompt, Mismatch> {
    let json = raw.get();
    let mismatch = || Mismatch::Untagged("Prompt");
    match json.as_bytes().first() {
        Some(b'"') => text(shared, raw).map(Prompt::Text),
        Some(b'[') => {
            let raw_bytes = share(shared, json.as_bytes());
            Ok(match items(json).ok_or_else(mismatch)? {
                Items::Texts(counts) => Prompt::Texts(counts.texts(raw_bytes)),
                Items::Tokens(len) => Prompt::Tokens(Tokens {
                    raw: raw_bytes,
                    len,
                }),
                Items::Batches { len, tokens } => Prompt::TokenBatches(TokenBatches {
                    raw: raw_bytes,
                    len,
                    tokens,
                }),
            })
        }
        _ => Err(mismatch()),
    }
}

pub(super) fn input(shared: &Bytes, raw: &RawValue) -> Result<Input, Mismatch> {
    let json = raw.get();
    match json.as_bytes().first() {
        Some(b'"') => text(shared, raw).map(Input::Text),
        Some(b'[') => {
            let items = array(shared, raw)?;
            let estimated_tokens = json
                .len()
                .div_ceil(CHARS_PER_TOKEN)
                .saturating_add(items.len().saturating_mul(TOKENS_PER_MESSAGE));
            Ok(Input::Items {
                items,
                estimated_tokens,
            })
        }
        _ => Err(Mismatch::Untagged("Input")),
    }
}

pub(super) fn stop(shared: &Bytes, raw: &RawValue) -> Result<Stop, Mismatch> {
    let json = raw.get();
    match json.as_bytes().first() {
        Some(b'"') => text(shared, raw).map(Stop::One),
        Some(b'[') => match items(json) {
            Some(Items::Texts(counts)) => {
                Ok(Stop::Many(counts.texts(share(shared, json.as_bytes()))))
            }
            _ => Err(Mismatch::Untagged("Stop")),
        },
        _ => Err(Mismatch::Untagged("Stop")),
    }
}

/// What an array of prompts holds: strings, token ids or arrays of token ids, all alike
/// (an empty array is a list of no strings).
pub(super) enum Items {
    Texts(TextCounts),
    Tokens(usize),
    Batches { len: usize, tokens: usize },
}

#[derive(Default)]
pub(super) struct TextCounts {
    pub(super) len: usize,
    pub(super) text_len: usize,
    pub(super) estimated_tokens: usize,
}

impl TextCounts {
    pub(super) fn texts(self, raw: Bytes) -> Texts {
        Texts {
            raw,
            len: self.len,
            text_len: self.text_len,
            estimated_tokens: self.estimated_tokens,
        }
    }
}

/// Checks and counts an array's items, each by its own type, keeping none.
pub(super) fn items(json: &str) -> Option<Items> {
    let mut de = serde_json::Deserializer::from_str(json);
    de.deserialize_seq(ItemsVisitor).ok()
}

pub(super) struct ItemsVisitor;

impl<'de> Visitor<'de> for ItemsVisitor {
    type Value = Items;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("strings, token ids or lists of token ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Items, A::Error> {
        let mut items = Items::Texts(TextCounts::default());
        let mut first = true;
        while let Some(item) = seq.next_element_seed(ItemSeed)? {
            if first {
                first = false;
                items = match item {
                    Item::Text(_) => Items::Texts(TextCounts::default()),
                    Item::Token => Items::Tokens(0),
                    Item::Batch(_) => Items::Batches { len: 0, tokens: 0 },
                };
            }
            match (&mut items, item) {
                (Items::Texts(counts), Item::Text(len)) => {
                    counts.len += 1;
                    counts.text_len = counts.text_len.saturating_add(len);
                    counts.estimated_tokens = counts
                        .estimated_tokens
                        .saturating_add(len.div_ceil(CHARS_PER_TOKEN));
                }
                (Items::Tokens(len), Item::Token) => *len += 1,
                (Items::Batches { len, tokens }, Item::Batch(ids)) => {
                    *len += 1;
                    *tokens = tokens.saturating_add(ids);
                }
                _ => return Err(de::Error::custom("items of different types")),
            }
        }
        Ok(items)
    }
}

/// One item of a prompt array: a string's length, a token id, or a list's number of ids.
pub(super) enum Item {
    Text(usize),
    Token,
    Batch(usize),
}

pub(super) struct ItemSeed;

impl<'de> DeserializeSeed<'de> for ItemSeed {
    type Value = Item;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Item, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemSeed {
    type Value = Item;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id or a list of token ids")
    }

    fn visit_u64<E: de::Error>(self, id: u64) -> Result<Item, E> {
        u32::try_from(id)
            .map(|_| Item::Token)
            .map_err(|_| E::custom("a token id is a u32"))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Item, E> {
        Ok(Item::Text(s.len()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        let mut ids = 0usize;
        while seq.next_element::<u32>()?.is_some() {
            ids += 1;
        }
        Ok(Item::Batch(ids))
    }
}

/// The fields of a request that Sluice reads, by name.
pub(super) const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "use_beam_search",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    // Messages.
    "system",
    "stop_sequences",
    // Responses (and embeddings' `input`).
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "store",
    "background",
    // Not read, only placed, for the edits of `model_name::upstream_body` (and, as every
    // field here, refused when repeated: the engine would take the last, an edit the first).
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "vllm_xargs",
    "request_id",
    // Only placed, for a chat template (`PLACED_MEMBERS`).
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    // Only placed, for a session's key (`SESSION_MEMBERS`).
    "prompt_cache_key",
    "promptCacheKey",
    "litellm_session_id",
    "metadata",
];

/// Marks field `index` as seen; a repeated field is refused, as serde's derive does.
pub(super) fn first_time<E: de::Error>(
    seen: &mut u64,
    index: usize,
    names: &'static [&'static str],
) -> Result<(), E> {
    let bit = 1u64.checked_shl(index as u32).unwrap_or(0);
    if *seen & bit != 0 {
        let name = names.get(index).copied().unwrap_or("?");
        return Err(E::duplicate_field(name));
    }
    *seen |= bit;
    Ok(())
}

/// The request's top level, `messages` included: where its array starts (when its key
/// said so), its count and its token estimate.
pub(super) struct RequestSeed<'b> {
    pub(super) shared: &'b Bytes,
    /// Whose fields are read: another family's are passed over as unknown ones are.
    pub(super) dialect: Dialect,
}

impl<'de> DeserializeSeed<'de> for RequestSeed<'_> {
    type Value = (LlmRequest, Option<CountedMessages>);

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RequestSeed<'_> {
    type Value = (LlmRequest, Option<CountedMessages>);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let shared = self.shared;
        let mut r = LlmRequest {
            seen: raw_json::SeenMembers::new(&PLACED_MEMBERS),
            ..LlmRequest::default()
        };
        let mut messages = None;
        let mut seen = 0u64;
        let (messages_api, responses_api) = (self.dialect.anthropic, self.dialect.responses);
        while let Some((field, key_end)) = map.next_key_seed(KeyIndex::located(FIELDS, shared))? {
            let name = field
                .and_then(|i| FIELDS.get(i))
                .copied()
                .unwrap_or_default();
            r.seen.saw(name, || {
                key_end.and_then(|end| raw_json::value_after_key(shared, end))
            });
            let Some(index) = field else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            first_time(&mut seen, index, FIELDS)?;
            match name {
                "model" => r.model = map.next_value()?,
                "messages" => {
                    let start = key_end.and_then(|end| raw_json::value_after_key(shared, end));
                    messages = map.next_value_seed(NullableMessages { shared, start })?
                }
                "prompt" => r.prompt = map.next_value_seed(nullable(|v| prompt(shared, v)))?,
                "stream" => r.stream = map.next_value()?,
                "stream_options" => r.stream_options = map.next_value()?,
                "max_tokens" if !responses_api => r.max_tokens = map.next_value()?,
                "max_completion_tokens" => r.max_completion_tokens = map.next_value()?,
                "n" => r.n = map.next_value()?,
                "best_of" => r.best_of = map.next_value()?,
                "use_beam_search" => r.use_beam_search = map.next_value()?,
                "temperature" => r.temperature = map.next_value()?,
                "top_p" => r.top_p = map.next_value()?,
                "seed" => r.seed = map.next_value()?,
                "stop" => r.stop = map.next_value_seed(nullable(|v| stop(shared, v)))?,
                "tools" => r.tools = map.next_value_seed(nullable(|v| array(shared, v)))?,
                "tool_choice" => {
                    r.tool_choice = map
                        .next_value::<Option<&RawValue>>()?
                        .map(|v| raw(shared, v))
                }
                "response_format" => {
                    r.response_format = map
                        .next_value::<Option<&RawValue>>()?
                        .map(|v| raw(shared, v))
                }
                "logprobs" => r.logprobs = map.next_value()?,
                "top_logprobs" => r.top_logprobs = map.next_value()?,
                "system" if messages_api => {
                    r.system = map.next_value_seed(nullable(|v| content(shared, v)))?
                }
                "stop_sequences" if messages_api => {
                    r.stop = map.next_value_seed(nullable(|v| stop(shared, v)))?
                }
                "input" if responses_api || self.dialect.embeddings_input => {
                    r.input = map.next_value_seed(nullable(|v| input(shared, v)))?
                }
                "instructions" if responses_api => {
                    r.instructions = map.next_value_seed(nullable(|v| text(shared, v)))?
                }
                "max_output_tokens" if responses_api => r.max_tokens = map.next_value()?,
                "previous_response_id" if responses_api => {
                    r.previous_response_id = map.next_value()?
                }
                "store" if responses_api => r.store = map.next_value()?,
                "background" if responses_api => r.background = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok((r, messages))
    }
}

pub(super) fn raw(shared: &Bytes, value: &RawValue) -> RawJson {
    RawJson(share(shared, value.get().as_bytes()))
}

/// `messages` as the parse found it: where its array starts in the body (`None` when its
/// key was escaped, and so not read in place), how many messages, and their token estimate.
pub(super) struct CountedMessages {
    pub(super) start: Option<usize>,
    pub(super) len: usize,
    pub(super) estimated_tokens: usize,
}

impl CountedMessages {
    /// The messages, as a slice of `body` from their array on.
    pub(super) fn into_messages(self, body: &Bytes) -> Messages {
        let start = self.start.or_else(|| {
            // An escaped key (`"messag\u0065s"`): found again, once, by name.
            let spans = raw_json::object_spans(body, &["messages"])?;
            spans.value("messages").map(|range| range.start)
        });
        Messages {
            raw: start.map_or_else(Bytes::new, |start| body.slice(start..)),
            len: self.len,
            estimated_tokens: self.estimated_tokens,
        }
    }
}

/// `messages`, or `null` (then the request has none); `start` is where its value starts in
/// the body, when its key said so.
pub(super) struct NullableMessages<'b> {
    pub(super) shared: &'b Bytes,
    pub(super) start: Option<usize>,
}

impl<'de> DeserializeSeed<'de> for NullableMessages<'_> {
    type Value = Option<CountedMessages>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for NullableMessages<'_> {
    type Value = Option<CountedMessages>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        let (len, estimated_tokens) = MessagesSeed {
            shared: self.shared,
        }
        .deserialize(deserializer)?;
        Ok(Some(CountedMessages {
            start: self.start,
            len,
            estimated_tokens,
        }))
    }
}

/// `messages`: a list of messages, counted, with the estimate of their tokens.
pub(super) struct MessagesSeed<'b> {
    pub(super) shared: &'b Bytes,
}

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = (usize, usize);

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_> {
    type Value = (usize, usize);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let (mut len, mut tokens) = (0usize, 0usize);
        while let Some(m) = seq.next_element_seed(MessageSeed {
            shared: self.shared,
        })? {
            len += 1;
            let estimate = m.rendered_len().div_ceil(CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE;
            tokens = tokens.saturating_add(estimate);
        }
        Ok((len, tokens))
    }
}

pub(super) const MESSAGE_FIELDS: &[&str] =
    &["role", "content", "name", "tool_calls", "tool_call_id"];

/// One message, its texts as slices of the body.
pub(super) struct MessageSeed<'b> {
    pub(super) shared: &'b Bytes,
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = Message;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Message, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = Message;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message, A::Error> {
        let shared = self.shared;
        let mut role = None;
        let mut m = Message {
            role: Text::default(),
            content: None,
            name: None,
            tool_calls: None,
            tool_call_id: None,
        };
        let mut seen = 0u64;
        while let Some((field, _)) = map.next_key_seed(KeyIndex::new(MESSAGE_FIELDS))? {
            let Some(index) = field else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            first_time(&mut seen, index, MESSAGE_FIELDS)?;
            match MESSAGE_FIELDS.get(index).copied().unwrap_or_default() {
                "role" => {
                    role = map.next_value_seed(Checked {
                        nullable: false,
                        check: |v| text(shared, v),
                    })?
                }
                "content" => m.content = map.next_value_seed(nullable(|v| content(shared, v)))?,
                "name" => m.name = map.next_value_seed(nullable(|v| text(shared, v)))?,
                "tool_calls" => {
                    m.tool_calls = map.next_value_seed(nullable(|v| array(shared, v)))?
                }
                "tool_call_id" => {
                    m.tool_call_id = map.next_value_seed(nullable(|v| text(shared, v)))?
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        m.role = role.ok_or_else(|| de::Error::missing_field("role"))?;
        Ok(m)
    }
}
