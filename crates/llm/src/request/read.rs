//! The reader of request members by a family's member table ([`Member`]: each key and the
//! field of [`LlmRequest`] it fills): one pass over the body with serde, no tree, every text
//! kept as a slice of it, and a type error named by its member's path (as OpenAI's `param`).
//! The shipped families' tables are in their modules; the readers of each kind of value
//! (a content, a prompt, a stop, ...) are here for any family's own parse as well.

use super::text::*;
use super::{Input, LlmRequest, PLACED_MEMBERS};
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

/// What a top-level member of a request is read into: a field of [`LlmRequest`], read and
/// type-checked as that field needs. A family's member table ([`Member`]) says which of its
/// keys fill which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// [`LlmRequest::model`].
    Model,
    /// [`LlmRequest::messages`]: chat messages, counted and placed.
    Messages,
    /// [`LlmRequest::prompt`].
    Prompt,
    /// [`LlmRequest::stream`].
    Stream,
    /// [`LlmRequest::stream_options`].
    StreamOptions,
    /// [`LlmRequest::max_tokens`]: the output budget, whatever the family calls it.
    MaxTokens,
    /// [`LlmRequest::max_completion_tokens`].
    MaxCompletionTokens,
    /// [`LlmRequest::n`].
    N,
    /// [`LlmRequest::best_of`].
    BestOf,
    /// [`LlmRequest::use_beam_search`].
    UseBeamSearch,
    /// [`LlmRequest::temperature`].
    Temperature,
    /// [`LlmRequest::top_p`].
    TopP,
    /// [`LlmRequest::seed`].
    Seed,
    /// [`LlmRequest::stop`]: a sequence or a list of them.
    Stop,
    /// [`LlmRequest::tools`].
    Tools,
    /// [`LlmRequest::tool_choice`], as JSON.
    ToolChoice,
    /// [`LlmRequest::response_format`], as JSON.
    ResponseFormat,
    /// [`LlmRequest::logprobs`].
    Logprobs,
    /// [`LlmRequest::top_logprobs`].
    TopLogprobs,
    /// [`LlmRequest::system`]: a text or a list of text blocks.
    System,
    /// [`LlmRequest::input`]: a text or a list of items.
    Input,
    /// [`LlmRequest::instructions`].
    Instructions,
    /// [`LlmRequest::previous_response_id`].
    PreviousResponseId,
    /// [`LlmRequest::store`].
    Store,
    /// [`LlmRequest::background`].
    Background,
}

/// One row of a family's member table: a top-level key of its requests and the field it is
/// read into. A family's table is every member it reads; any other key is passed over as
/// unknown (the engine checks it), unless it is one the core places ([`PLACED_MEMBERS`]).
#[derive(Debug, Clone, Copy)]
pub struct Member {
    /// The key, as the client sends it.
    pub key: &'static str,
    /// What it is read into.
    pub slot: Slot,
}

/// A member table's row.
pub const fn member(key: &'static str, slot: Slot) -> Member {
    Member { key, slot }
}

/// The members OpenAI's formats share, and the shipped families read alike (each adds its
/// own budget member and what else is its own).
pub const OPENAI_MEMBERS: [Member; 17] = [
    member("model", Slot::Model),
    member("messages", Slot::Messages),
    member("prompt", Slot::Prompt),
    member("stream", Slot::Stream),
    member("stream_options", Slot::StreamOptions),
    member("n", Slot::N),
    member("best_of", Slot::BestOf),
    member("use_beam_search", Slot::UseBeamSearch),
    member("temperature", Slot::Temperature),
    member("top_p", Slot::TopP),
    member("seed", Slot::Seed),
    member("stop", Slot::Stop),
    member("tools", Slot::Tools),
    member("tool_choice", Slot::ToolChoice),
    member("response_format", Slot::ResponseFormat),
    member("logprobs", Slot::Logprobs),
    member("top_logprobs", Slot::TopLogprobs),
];

/// The top-level keys the reader looks for: a family's members, then the members the core
/// places ([`PLACED_MEMBERS`]: an upstream body's edit, a chat template, a session's key
/// read them again later) that the family does not read. Each is refused when repeated: the
/// engine would take the last, an edit the first.
struct TopLevel(&'static [Member]);

impl TopLevel {
    fn key(&self, index: usize) -> &'static str {
        match self.0.get(index) {
            Some(member) => member.key,
            None => index
                .checked_sub(self.0.len())
                .and_then(|i| PLACED_MEMBERS.get(i))
                .copied()
                .unwrap_or_default(),
        }
    }
}

impl raw_json::Keys for TopLevel {
    fn index_of(&self, key: &str) -> Option<usize> {
        let members = self.0;
        members.iter().position(|m| m.key == key).or_else(|| {
            let placed = PLACED_MEMBERS.iter().position(|k| *k == key)?;
            Some(members.len() + placed)
        })
    }
}

/// Marks the member at `index` as seen; a repeated member is refused, as serde's derive
/// does. Tables are short enough for one bit each (`family`'s tests check the shipped ones).
pub(super) fn first_time<E: de::Error>(
    seen: &mut u64,
    index: usize,
    key: &'static str,
) -> Result<(), E> {
    let bit = 1u64.checked_shl(index as u32).unwrap_or(0);
    if *seen & bit != 0 {
        return Err(E::duplicate_field(key));
    }
    *seen |= bit;
    Ok(())
}

/// The request's top level, `messages` included: where its array starts (when its key
/// said so), its count and its token estimate.
pub(super) struct RequestSeed<'b> {
    pub(super) shared: &'b Bytes,
    /// The family's member table: what it reads, and into what.
    pub(super) members: &'static [Member],
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
        let keys = TopLevel(self.members);
        while let Some((found, key_end)) = map.next_key_seed(KeyIndex::located(&keys, shared))? {
            let key = found.map(|i| keys.key(i)).unwrap_or_default();
            r.seen.saw(key, || {
                key_end.and_then(|end| raw_json::value_after_key(shared, end))
            });
            let Some(index) = found else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            first_time(&mut seen, index, key)?;
            let Some(slot) = self.members.get(index).map(|m| m.slot) else {
                // Placed only: the core reads it again where it needs it.
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            match slot {
                Slot::Model => r.model = map.next_value()?,
                Slot::Messages => {
                    let start = key_end.and_then(|end| raw_json::value_after_key(shared, end));
                    messages = map.next_value_seed(NullableMessages { shared, start })?
                }
                Slot::Prompt => r.prompt = map.next_value_seed(nullable(|v| prompt(shared, v)))?,
                Slot::Stream => r.stream = map.next_value()?,
                Slot::StreamOptions => r.stream_options = map.next_value()?,
                Slot::MaxTokens => r.max_tokens = map.next_value()?,
                Slot::MaxCompletionTokens => r.max_completion_tokens = map.next_value()?,
                Slot::N => r.n = map.next_value()?,
                Slot::BestOf => r.best_of = map.next_value()?,
                Slot::UseBeamSearch => r.use_beam_search = map.next_value()?,
                Slot::Temperature => r.temperature = map.next_value()?,
                Slot::TopP => r.top_p = map.next_value()?,
                Slot::Seed => r.seed = map.next_value()?,
                Slot::Stop => r.stop = map.next_value_seed(nullable(|v| stop(shared, v)))?,
                Slot::Tools => r.tools = map.next_value_seed(nullable(|v| array(shared, v)))?,
                Slot::ToolChoice => {
                    r.tool_choice = map
                        .next_value::<Option<&RawValue>>()?
                        .map(|v| raw(shared, v))
                }
                Slot::ResponseFormat => {
                    r.response_format = map
                        .next_value::<Option<&RawValue>>()?
                        .map(|v| raw(shared, v))
                }
                Slot::Logprobs => r.logprobs = map.next_value()?,
                Slot::TopLogprobs => r.top_logprobs = map.next_value()?,
                Slot::System => r.system = map.next_value_seed(nullable(|v| content(shared, v)))?,
                Slot::Input => r.input = map.next_value_seed(nullable(|v| input(shared, v)))?,
                Slot::Instructions => {
                    r.instructions = map.next_value_seed(nullable(|v| text(shared, v)))?
                }
                Slot::PreviousResponseId => r.previous_response_id = map.next_value()?,
                Slot::Store => r.store = map.next_value()?,
                Slot::Background => r.background = map.next_value()?,
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
            let key = MESSAGE_FIELDS.get(index).copied().unwrap_or_default();
            first_time(&mut seen, index, key)?;
            match key {
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
