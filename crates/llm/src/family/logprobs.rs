//! Where OpenAI's chat and text completion answers carry their token log-probabilities,
//! for a confidence check ([`Logprobs`]): asking an engine for them, reading them from an
//! answer or a stream event's data as the bytes are (no tree of the answer), and setting
//! them back to `null` when the client did not ask.

use super::Logprobs;
use crate::raw_json::{self, Edit};
use bytes::Bytes;
use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use std::fmt;

/// OpenAI's log-probabilities: chat's (`logprobs.content[].logprob`, asked with
/// `logprobs: true`) or text completions' (`logprobs.token_logprobs[]`, asked with
/// `logprobs: 0`).
#[derive(Debug)]
pub struct OpenAiLogprobs {
    chat: bool,
}

/// Chat completions'.
pub static CHAT: OpenAiLogprobs = OpenAiLogprobs { chat: true };
/// Text completions'.
pub static COMPLETIONS: OpenAiLogprobs = OpenAiLogprobs { chat: false };

impl Logprobs for OpenAiLogprobs {
    fn ask(&self, body: &[u8]) -> Option<Bytes> {
        ask_for_logprobs(self.chat, body)
    }

    fn read(&self, answer: &[u8], choice: u64, each: &mut dyn FnMut(f64) -> bool) {
        if let Some(logprobs) = Answer::read(answer).and_then(|a| a.choice_logprobs(choice)) {
            add_logprobs(self.chat, logprobs, each);
        }
    }

    fn strip(&self, answer: &[u8]) -> Option<Vec<u8>> {
        // Most stream events have none: look before reading.
        memchr::memmem::find(answer, b"\"logprobs\"")?;
        Answer::read(answer)?.without_logprobs()
    }
}

/// An answer as the judge reads it: its bytes, checked to be one JSON object, and where its
/// `choices` are (the last, if repeated, as parsers that keep the last read it).
struct Answer<'a> {
    body: &'a [u8],
    choices: Option<&'a [u8]>,
}

impl<'a> Answer<'a> {
    fn read(body: &'a [u8]) -> Option<Self> {
        let spans = raw_json::object_spans(body, &["choices"])?;
        let choices = spans
            .value("choices")
            .and_then(|range| body.get(range))
            .filter(|c| c.first() == Some(&b'['));
        Some(Self { body, choices })
    }

    /// Each choice's text, with its `index` and `logprobs` values' texts when it is an object.
    fn choices(&self) -> impl Iterator<Item = (&'a [u8], Option<&'a [u8]>, Option<&'a [u8]>)> + '_ {
        raw_json::elements(self.choices.unwrap_or_default()).map(|choice| {
            let spans = (choice.first() == Some(&b'{'))
                .then(|| raw_json::object_spans(choice, &["index", "logprobs"]))
                .flatten();
            let value = |key| {
                spans
                    .as_ref()
                    .and_then(|s| s.value(key))
                    .and_then(|range| choice.get(range))
            };
            (choice, value("index"), value("logprobs"))
        })
    }

    /// The `logprobs` of the choice with this index (streams may interleave choices, so a
    /// chunk's first choice is not necessarily choice 0); a choice without a readable index
    /// is choice 0.
    fn choice_logprobs(&self, index: u64) -> Option<&'a [u8]> {
        let (_, _, logprobs) = self.choices().find(|(_, i, _)| {
            i.and_then(|i| serde_json::from_slice::<u64>(i).ok())
                .unwrap_or(0)
                == index
        })?;
        logprobs
    }

    /// The answer with every choice's `logprobs` set to `null`, as vLLM answers when none
    /// were asked for: copied once, every other byte kept. None when none had any.
    fn without_logprobs(&self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        let mut from = 0;
        for (_, _, logprobs) in self.choices() {
            let Some(logprobs) = logprobs.filter(|l| *l != b"null") else {
                continue;
            };
            let range = raw_json::position(self.body, logprobs)?;
            if out.capacity() == 0 {
                out.reserve_exact(self.body.len());
            }
            out.extend_from_slice(self.body.get(from..range.start)?);
            out.extend_from_slice(b"null");
            from = range.end;
        }
        if from == 0 {
            return None;
        }
        out.extend_from_slice(self.body.get(from..)?);
        Some(out)
    }
}

/// Feeds `each` the token log-probabilities of one choice's `logprobs` (its JSON text), in
/// answer order, while it returns true. Chat puts them in `content[].logprob`;
/// completions in `token_logprobs[]`, where vLLM writes `null` for a token without one (the
/// first prompt token under `echo`), which is skipped. Reads the text as it goes: nothing
/// is collected.
fn add_logprobs(chat: bool, logprobs: &[u8], each: &mut dyn FnMut(f64) -> bool) {
    let field = if chat { "content" } else { "token_logprobs" };
    let Some(tokens) = raw_json::object_spans(logprobs, &[field])
        .and_then(|s| s.value(field))
        .and_then(|range| logprobs.get(range))
        .filter(|t| t.first() == Some(&b'['))
    else {
        return;
    };
    let mut de = serde_json::Deserializer::from_slice(tokens);
    let _ = de.deserialize_seq(TokensVisitor { chat, each });
}

/// The token list of a choice's `logprobs`, fed on as it is read.
struct TokensVisitor<'t> {
    /// Chat: each token is an object with its `logprob`; completions: the number itself.
    chat: bool,
    each: &'t mut dyn FnMut(f64) -> bool,
}

impl<'de> Visitor<'de> for TokensVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of tokens")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        loop {
            let logprob = if self.chat {
                seq.next_element_seed(ChatToken)?
            } else {
                seq.next_element::<MaybeNumber>()?.map(|n| n.0)
            };
            match logprob {
                None => return Ok(()),
                Some(Some(logprob)) => {
                    if !(self.each)(logprob) {
                        break;
                    }
                }
                Some(None) => {}
            }
        }
        // Enough was read: the rest is skipped, unread.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

/// A JSON value read as a number when it is one (any number, as `f64`), else skipped.
struct MaybeNumber(Option<f64>);

impl<'de> Deserialize<'de> for MaybeNumber {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NumberVisitor)
    }
}

struct NumberVisitor;

impl<'de> Visitor<'de> for NumberVisitor {
    type Value = MaybeNumber;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_f64<E>(self, n: f64) -> Result<MaybeNumber, E> {
        Ok(MaybeNumber(Some(n)))
    }

    fn visit_i64<E>(self, n: i64) -> Result<MaybeNumber, E> {
        Ok(MaybeNumber(Some(n as f64)))
    }

    fn visit_u64<E>(self, n: u64) -> Result<MaybeNumber, E> {
        Ok(MaybeNumber(Some(n as f64)))
    }

    fn visit_bool<E>(self, _: bool) -> Result<MaybeNumber, E> {
        Ok(MaybeNumber(None))
    }

    fn visit_str<E>(self, _: &str) -> Result<MaybeNumber, E> {
        Ok(MaybeNumber(None))
    }

    fn visit_unit<E>(self) -> Result<MaybeNumber, E> {
        Ok(MaybeNumber(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MaybeNumber, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(MaybeNumber(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MaybeNumber, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(MaybeNumber(None))
    }
}

/// A chat token: its `logprob` (the last, if repeated) when it is an object with a number
/// there.
struct ChatToken;

impl<'de> DeserializeSeed<'de> for ChatToken {
    type Value = Option<f64>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<f64>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ChatToken {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<f64>, A::Error> {
        let mut logprob = None;
        while let Some(is_logprob) = map.next_key_seed(KeyIs("logprob"))? {
            if is_logprob {
                logprob = map.next_value::<MaybeNumber>()?.0;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(logprob)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<f64>, A::Error> {
        NumberVisitor.visit_seq(seq).map(|_| None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Option<f64>, E> {
        Ok(None)
    }
}

/// Whether a key is this one (compared unescaped, without copying).
struct KeyIs(&'static str);

impl<'de> DeserializeSeed<'de> for KeyIs {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

/// The request body with token log-probabilities asked for, when the client did not ask:
/// chat gets `"logprobs": true` (`top_logprobs` untouched), completions `"logprobs": 0` (an
/// integer count of alternatives; 0 still returns each sampled token's log-probability).
/// The body is copied once with the one member spliced in: every other byte is kept, and an
/// existing `"logprobs": null`/`false` is replaced in place.
///
/// Returns None, meaning "send the client's body as is", when the body is not a JSON object,
/// already asks for logprobs (or sets `logprobs` to anything but absent, `null` or chat's
/// `false`), or when adding them would change more than the answer's logprobs:
/// - chat with `top_logprobs` > 0 but no `logprobs`: vLLM refuses it, so the draft must too;
/// - completions with `"echo": true`: vLLM would also score the prompt, and the token
///   log-probabilities would start with the prompt's rather than the answer's.
fn ask_for_logprobs(chat: bool, body: &[u8]) -> Option<Bytes> {
    let spans = raw_json::object_spans(body, &["logprobs", "top_logprobs", "echo"])?;
    let value = |key| spans.value(key).and_then(|range| body.get(range));
    let not_asked = match value("logprobs") {
        None | Some(b"null") => true,
        Some(b"false") => chat,
        Some(_) => false,
    };
    if !not_asked {
        return None;
    }
    let asked_for: &[u8] = if chat {
        let wants_top = value("top_logprobs")
            .and_then(|top| serde_json::from_slice::<u64>(top).ok())
            .is_some_and(|top| top > 0);
        if wants_top {
            return None;
        }
        b"true"
    } else {
        if value("echo") == Some(b"true") {
            return None;
        }
        b"0"
    };
    let edit = match spans.value("logprobs") {
        Some(range) => Edit {
            range,
            text: asked_for.to_vec(),
        },
        None => spans.append("logprobs", asked_for),
    };
    raw_json::apply(body, vec![edit]).map(Bytes::from)
}
