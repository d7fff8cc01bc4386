//! The building blocks a request's members are kept in: slices of the body (a reference
//! count each), with what Sluice needs of them counted as they were checked. Any family
//! reads its members into these; their items are read again from the bytes when asked.

use super::read::{content, input, part_text, MessageSeed, Mismatch};
use super::Input;
use crate::raw_json::{self, Unescaped};
use bytes::Bytes;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// A JSON string of the request, kept as the body's own bytes between its quotes, escapes as
/// the client wrote them: holding it costs a reference count, and its text is unescaped only
/// when read ([`Text::to_str`] copies only a string that has escapes; [`Text::pieces`] never
/// copies).
#[derive(Clone, Default)]
pub struct Text {
    /// The bytes between the quotes, escapes as sent; valid UTF-8.
    pub(super) raw: Bytes,
    /// The text's length in bytes, unescaped.
    pub(super) len: usize,
    /// Whether `raw` has escapes.
    pub(super) escaped: bool,
}

impl Text {
    /// The string whose JSON (quotes included) is `json`, a slice of `shared` when it is one.
    pub(super) fn from_json(shared: &Bytes, json: &str) -> Option<Self> {
        let inner = json.strip_prefix('"')?.strip_suffix('"')?;
        // One scan for a backslash: a prompt can be megabytes.
        let escaped = memchr::memchr(b'\\', inner.as_bytes()).is_some();
        Some(Self {
            raw: share(shared, inner.as_bytes()),
            len: if escaped {
                raw_json::unescaped_len(inner)
            } else {
                inner.len()
            },
            escaped,
        })
    }

    /// The text's length in bytes (UTF-8, unescaped).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the text is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the client wrote the string with escapes (then [`Text::to_str`] copies it).
    #[cfg(test)]
    pub fn has_escapes(&self) -> bool {
        self.escaped
    }

    /// The text: borrowed from the body when it has no escapes, else unescaped into a new
    /// string.
    pub fn to_str(&self) -> Cow<'_, str> {
        if !self.escaped {
            return Cow::Borrowed(self.raw_str());
        }
        let mut text = String::with_capacity(self.len);
        for piece in self.pieces() {
            match piece {
                raw_json::Piece::Str(s) => text.push_str(s),
                raw_json::Piece::Char(c) => text.push(c),
            }
        }
        Cow::Owned(text)
    }

    /// The text piece by piece, without copying: runs without escapes as they are in the
    /// body, and each escape's character.
    pub fn pieces(&self) -> Unescaped<'_> {
        Unescaped::new(self.raw_str())
    }

    pub(super) fn raw_str(&self) -> &str {
        // Always UTF-8: cut from a checked body at quotes.
        std::str::from_utf8(&self.raw).unwrap_or_default()
    }
}

impl From<&str> for Text {
    /// A text of its own (not from a body), for tests and for plugins that make requests.
    fn from(text: &str) -> Self {
        let mut json = Vec::with_capacity(text.len() + 2);
        raw_json::write_string(&mut json, text);
        let json = Bytes::from(json);
        std::str::from_utf8(&json)
            .ok()
            .and_then(|s| Text::from_json(&json, s))
            .unwrap_or_default()
    }
}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        self.len == other.len() && self.to_str() == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self == *other
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_str(), f)
    }
}

/// A JSON value of the request kept as its text, a slice of the body (`tool_choice`,
/// `response_format`, a tool, a content part).
#[derive(Clone)]
pub struct RawJson(pub(super) Bytes);

impl RawJson {
    /// The value's JSON text, as the client sent it.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The value's JSON text, as the client sent it.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// Parses the value into `T` (borrowing from it where `T` can).
    pub fn parse<'a, T: Deserialize<'a>>(&'a self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.0)
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RawJson({} bytes)", self.0.len())
    }
}

/// A JSON array of the request kept as its text (`tools`, a message's `tool_calls`), with
/// its length.
#[derive(Clone)]
pub struct JsonArray {
    pub(super) raw: Bytes,
    pub(super) len: usize,
}

impl JsonArray {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements, each as its JSON text.
    pub fn iter(&self) -> impl Iterator<Item = RawJson> + '_ {
        raw_json::elements(&self.raw).map(|e| RawJson(share(&self.raw, e)))
    }

    /// The array's JSON text, as the client sent it.
    pub fn as_bytes(&self) -> &[u8] {
        &self.raw
    }
}

impl fmt::Debug for JsonArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonArray({} elements)", self.len)
    }
}

/// A chat request's `messages`: checked, counted and kept as the body's bytes. Each
/// [`Message`] is read again from them, one at a time, by [`Messages::iter`].
#[derive(Clone)]
pub struct Messages {
    pub(super) raw: Bytes,
    pub(super) len: usize,
    pub(super) estimated_tokens: usize,
}

impl Messages {
    /// The number of messages.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The messages in order, each read from the body as it is reached (nothing copied but
    /// reference counts).
    pub fn iter(&self) -> impl Iterator<Item = Message> + '_ {
        raw_json::elements(&self.raw).filter_map(|element| {
            let mut de = serde_json::Deserializer::from_slice(element);
            MessageSeed { shared: &self.raw }.deserialize(&mut de).ok()
        })
    }

    /// The body from the messages' JSON array on: the array as the client sent it, then the
    /// rest of the body. A reader of one JSON value (serde_json's `Deserializer` without
    /// `end`) reads the array alone, and nothing need find where it ends first.
    pub fn json_onward(&self) -> &[u8] {
        &self.raw
    }

    /// The estimate of the messages' prompt tokens (see
    /// [`LlmRequest::estimated_prompt_tokens`]).
    pub fn estimated_tokens(&self) -> usize {
        self.estimated_tokens
    }
}

impl fmt::Debug for Messages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One chat message. `content` is text or a list of typed parts (text, images, ...).
#[derive(Debug, Clone)]
pub struct Message {
    /// `role`: `system`, `user`, `assistant`, `tool`, ...; not checked here.
    pub role: Text,
    /// `content`; `None` for an assistant message that only calls tools.
    pub content: Option<Content>,
    /// `name`: the participant's name, if given.
    pub name: Option<Text>,
    /// `tool_calls` of an assistant message, kept as JSON.
    pub tool_calls: Option<JsonArray>,
    /// `tool_call_id` of a `tool` message: the call it answers.
    pub tool_call_id: Option<Text>,
}

/// A message's `content`.
#[derive(Debug, Clone)]
pub enum Content {
    /// Plain text.
    Text(Text),
    /// Typed parts (text, images, ...), kept as JSON; only text parts are read.
    Parts(Parts),
}

/// A message's content parts, kept as JSON, with the length of their text.
#[derive(Clone)]
pub struct Parts {
    pub(super) raw: Bytes,
    pub(super) len: usize,
    pub(super) text_len: usize,
}

impl Parts {
    /// The number of parts.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes of text in the parts (the `text` of each part that has a string one).
    pub fn text_len(&self) -> usize {
        self.text_len
    }

    /// The parts, each as its JSON text.
    pub fn iter(&self) -> impl Iterator<Item = RawJson> + '_ {
        raw_json::elements(&self.raw).map(|e| RawJson(share(&self.raw, e)))
    }

    /// The `text` of each part that has a string one, in order.
    pub fn texts(&self) -> impl Iterator<Item = Text> + '_ {
        raw_json::elements(&self.raw).filter_map(|e| part_text(&self.raw, e))
    }
}

impl fmt::Debug for Parts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Parts({} parts, {} bytes of text)",
            self.len, self.text_len
        )
    }
}

/// The `prompt` of a text completion: text, several texts, or token ids.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// One prompt.
    Text(Text),
    /// A batch of prompts.
    Texts(Texts),
    /// One prompt, as token ids.
    Tokens(Tokens),
    /// A batch of prompts, as token ids.
    TokenBatches(TokenBatches),
}

/// A list of strings (a batch of prompts, stop sequences), kept as JSON, counted.
#[derive(Clone)]
pub struct Texts {
    pub(super) raw: Bytes,
    pub(super) len: usize,
    pub(super) text_len: usize,
    pub(super) estimated_tokens: usize,
}

impl Texts {
    /// The number of strings.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes of text in all the strings.
    pub fn text_len(&self) -> usize {
        self.text_len
    }

    /// The strings in order.
    pub fn iter(&self) -> impl Iterator<Item = Text> + '_ {
        raw_json::elements(&self.raw)
            .filter_map(|e| Text::from_json(&self.raw, std::str::from_utf8(e).ok()?))
    }

    /// The first string, if any.
    pub fn first(&self) -> Option<Text> {
        self.iter().next()
    }
}

impl fmt::Debug for Texts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A prompt as token ids, kept as JSON: counted, not collected.
#[derive(Clone)]
pub struct Tokens {
    pub(super) raw: Bytes,
    pub(super) len: usize,
}

impl Tokens {
    /// The number of token ids.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The token ids in order, each read as it is reached.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        raw_json::elements(&self.raw)
            .filter_map(|e| std::str::from_utf8(e).ok()?.parse::<u32>().ok())
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokens({} ids)", self.len)
    }
}

/// A batch of prompts as token ids, kept as JSON: counted, not collected.
#[derive(Clone)]
pub struct TokenBatches {
    pub(super) raw: Bytes,
    pub(super) len: usize,
    pub(super) tokens: usize,
}

impl TokenBatches {
    /// The number of prompts.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The number of token ids in all the prompts.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The prompts in order.
    pub fn iter(&self) -> impl Iterator<Item = Tokens> + '_ {
        raw_json::elements(&self.raw).map(|e| Tokens {
            raw: share(&self.raw, e),
            len: raw_json::elements(e).count(),
        })
    }
}

impl fmt::Debug for TokenBatches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenBatches({} prompts, {} ids)", self.len, self.tokens)
    }
}

/// The `stop` field: one sequence or several.
#[derive(Debug, Clone)]
pub enum Stop {
    /// A single stop sequence.
    One(Text),
    /// Several stop sequences.
    Many(Texts),
}

/// The `logprobs` field, whose type depends on the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logprobs {
    /// Chat: whether to return the chosen tokens' log-probabilities.
    Flag(bool),
    /// Completions: how many top log-probabilities to return per token.
    Count(u32),
}

impl<'de> Deserialize<'de> for Logprobs {
    /// A boolean or a count, by the value's own type: nothing is buffered.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(LogprobsVisitor)
    }
}

pub(super) struct LogprobsVisitor;

impl LogprobsVisitor {
    pub(super) fn mismatch<E: de::Error>() -> E {
        E::custom(Mismatch::Untagged("Logprobs"))
    }
}

impl<'de> Visitor<'de> for LogprobsVisitor {
    type Value = Logprobs;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a boolean or a count")
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Logprobs, E> {
        Ok(Logprobs::Flag(b))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Logprobs, E> {
        u32::try_from(n)
            .map(Logprobs::Count)
            .map_err(|_| Self::mismatch())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Logprobs, E> {
        Err(Self::mismatch())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Logprobs, E> {
        Err(Self::mismatch())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Logprobs, E> {
        Err(Self::mismatch())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Logprobs, E> {
        Err(Self::mismatch())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Logprobs, A::Error> {
        Err(Self::mismatch())
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Logprobs, A::Error> {
        Err(Self::mismatch())
    }
}

impl Message {
    /// The bytes a chat template renders of the message besides its markers: its text, its
    /// tool calls (names and arguments, counted as their JSON), its name and the id of the
    /// call it answers.
    pub fn rendered_len(&self) -> usize {
        self.text_len()
            .saturating_add(self.tool_calls.as_ref().map_or(0, |c| c.as_bytes().len()))
            .saturating_add(self.name.as_ref().map_or(0, Text::len))
            .saturating_add(self.tool_call_id.as_ref().map_or(0, Text::len))
    }

    /// The number of bytes of text in the message (text parts only).
    pub fn text_len(&self) -> usize {
        match &self.content {
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts.text_len,
            None => 0,
        }
    }
}

// ---- the parse ----
//
// One pass of serde_json over the body, through serde_path_to_error for the parameter's
// path. Scalars are read as they are; every other field is read as `&RawValue` (its exact
// text, borrowed from the body, found without building anything) and then checked and
// counted from that text, by its type, without serde's untagged buffering. `messages` is
// checked and counted in the same pass, message by message; where its array starts is read
// off its key's place in the body (`raw_json::KeyIndex::located`), so nothing has to scan it again to find it.

/// A slice of `shared` for `part` when `part` lies inside it, else a copy.
pub(super) fn share(shared: &Bytes, part: &[u8]) -> Bytes {
    match raw_json::position(shared, part) {
        Some(range) => shared.slice(range),
        None => Bytes::copy_from_slice(part),
    }
}

/// A Responses (or embeddings) `input`: a string, or a list counted by its JSON's length
/// (items are messages, tool calls and their outputs, whose text is all the prompt's).
impl Input {
    /// The input whose JSON is `json` (a text, or a list of items with its estimate), as
    /// slices of `shared` when it is one: for a family that reads its own members.
    pub fn from_json(shared: &Bytes, json: &RawValue) -> Option<Input> {
        input(shared, json).ok()
    }
}

impl Content {
    /// The content whose JSON is `json` (a text, or parts with their texts' length), as
    /// slices of `shared` when it is one: for a family that reads its own members.
    pub fn from_json(shared: &Bytes, json: &RawValue) -> Option<Content> {
        content(shared, json).ok()
    }
}
