#![warn(missing_docs)]
//! A prompt's token ids as vLLM makes them: a Hugging Face tokenizer folder read with the
//! `tokenizers` crate, and its chat template rendered with `minijinja`, set up as transformers
//! sets up Jinja for chat templates (`trim_blocks`, `lstrip_blocks`, loop controls, Python's
//! string methods, `raise_exception`, and a `tojson` that writes what Python's `json.dumps`
//! writes: `", "` and `": "` between items, keys in their order, non-ASCII kept).
//!
//! The template is picked as transformers and vLLM pick it: `chat_template.jinja` when the
//! folder has one, else `tokenizer_config.json`'s `chat_template` (a string, or a list of named
//! templates, of which `default` is taken). Chat messages are rendered with
//! `add_generation_prompt` (the request's, `true` by default) and the request's `tools` and
//! `chat_template_kwargs`, then encoded without special tokens (the template writes them);
//! a text prompt is encoded with them, as vLLM's completions endpoint does. As vLLM does,
//! a tool call's `arguments` string is parsed into the object the template expects.
//!
//! A caller that has parsed the request already (the proxy) hands over the members the
//! template reads as [`ChatParts`], so the body is not parsed again; the body-taking methods
//! (`chat`, `tokenize_chat`, `completion`) find them themselves.
//!
//! Written here, not taken from a crate: no maintained crate renders Hugging Face chat
//! templates the way transformers does (minijinja alone lacks the Python-compatible `tojson`
//! and the globals), and the part that is ours is small.

mod pieces;

use std::fmt::Write as _;
use std::path::Path;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::Environment;
use serde::Deserialize;
use serde_json::value::RawValue;

/// Why a tokenizer folder cannot be used, or a prompt cannot be tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The folder's files are missing or malformed.
    Load(String),
    /// The chat template failed to render (or raised, as templates do for unsupported input).
    Template(String),
    /// The request is not one the tokenizer can read (no messages, no prompt).
    Request(String),
    /// The tokenizer failed to encode the text.
    Encode(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Load(why) => write!(f, "cannot load the tokenizer: {why}"),
            Error::Template(why) => write!(f, "the chat template failed: {why}"),
            Error::Request(why) => write!(f, "cannot tokenize the request: {why}"),
            Error::Encode(why) => write!(f, "cannot encode the prompt: {why}"),
        }
    }
}

impl std::error::Error for Error {}

/// The name the chat template is registered under in the environment.
const CHAT: &str = "chat";

/// A tokenizer folder, ready to tokenize requests.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// Splits rendered chats at the added tokens and remembers the pieces (see `pieces.rs`).
    pieces: Option<pieces::Pieces>,
    env: Environment<'static>,
    has_template: bool,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token`, as the template sees them.
    specials: Vec<(&'static str, String)>,
    /// A hash of the files it was read from: two tokenizers with the same make the same ids.
    fingerprint: u64,
    /// Whether a text between added tokens may be encoded in parts cut before a word's
    /// space (see [`cuts_at_words`]).
    cuts_at_words: bool,
}

/// The longest part of a long text encoded at once (see [`cuts_at_words`]).
const PART_BYTES: usize = 16 * 1024;

/// Whether `tokenizer.json` (its JSON) encodes a text the same whole and cut into parts at
/// any "letter, space, letter" point, the space starting the second part: so a long text
/// is encoded in parts of about [`PART_BYTES`]. `tokenizers` keeps two offsets per byte of
/// the text it encodes and grows its vectors by copying: a 256 KiB piece held 4 MiB of
/// offsets, and two thirds of its CPU went to fresh pages and copies (a profile of scenario
/// 32 of `sluice-bench`), where parts reuse the same memory.
///
/// Exact only where the pre-tokenizer splits there itself and nothing else spans the cut:
/// no normalizer or NFC (which never composes across a space), a model that encodes each
/// pre-token on its own (BPE, as every byte-level tokenizer is), and a split whose pre-tokens
/// end a run of letters before a space and start the next at the space:
/// - GPT-2's byte-level regex (` ?\p{L}+`);
/// - Llama 3's and Qwen 2's split (the Qwen 2.5 and Qwen 3 families' too) before a
///   byte-level step without a regex of its own ([`SPLITS_AT_WORDS`]): each alternative that
///   takes a letter stops at a space (a letter run, or a contraction within one), and at a
///   space before a letter only `[^\r\n\p{L}\p{N}]?\p{L}+` matches, the space and the run.
///
/// Any other tokenizer is encoded whole.
fn cuts_at_words(tokenizer_json: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Parts {
        normalizer: Option<serde_json::Value>,
        pre_tokenizer: Option<serde_json::Value>,
        model: Option<serde_json::Value>,
    }
    let Ok(parts) = serde_json::from_slice::<Parts>(tokenizer_json) else {
        return false;
    };
    let normalizer_ok = match &parts.normalizer {
        None | Some(serde_json::Value::Null) => true,
        Some(n) => n["type"] == "NFC",
    };
    let pre = parts.pre_tokenizer.unwrap_or_default();
    let byte_level = |step: &serde_json::Value, regex: bool| {
        step["type"] == "ByteLevel"
            && step["add_prefix_space"] == false
            && if regex {
                step["use_regex"] != false
            } else {
                step["use_regex"] == false
            }
    };
    let split_at_words = |step: &serde_json::Value| {
        step["type"] == "Split"
            && step["behavior"] == "Isolated"
            && step["invert"] == false
            && step["pattern"]["Regex"]
                .as_str()
                .is_some_and(|r| SPLITS_AT_WORDS.contains(&r))
    };
    let split_then_bytes = |steps: &Vec<serde_json::Value>| match steps.as_slice() {
        [split, bytes] => split_at_words(split) && byte_level(bytes, false),
        _ => false,
    };
    let pre_ok = byte_level(&pre, true)
        || (pre["type"] == "Sequence"
            && pre["pretokenizers"]
                .as_array()
                .is_some_and(split_then_bytes));
    let bpe = parts.model.is_some_and(|m| m["type"] == "BPE");
    normalizer_ok && pre_ok && bpe
}

/// The split regexes of `tokenizer.json`s a long text may be cut at words under, as
/// Hugging Face's files write them: Llama 3's (numbers in threes) and Qwen 2's (digit by
/// digit), which Qwen 2.5 and Qwen 3 keep.
const SPLITS_AT_WORDS: [&str; 2] = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Where a long `text` is cut into parts: past [`PART_BYTES`] from the last cut, at the first
/// space with an ASCII letter on each side (the space starts the next part).
fn word_cuts(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut from = 0;
    std::iter::from_fn(move || {
        if from >= bytes.len() {
            return None;
        }
        let start = from;
        let mut at = start + PART_BYTES;
        while at + 1 < bytes.len() {
            if bytes[at] == b' '
                && bytes[at - 1].is_ascii_alphabetic()
                && bytes[at + 1].is_ascii_alphabetic()
            {
                break;
            }
            at += 1;
        }
        let end = if at + 1 < bytes.len() {
            at
        } else {
            bytes.len()
        };
        from = end;
        // Cut at an ASCII space: always a character boundary.
        text.get(start..end)
    })
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("has_template", &self.has_template)
            .finish()
    }
}

/// The parts of `tokenizer_config.json` that matter here.
#[derive(Deserialize, Default)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    bos_token: Option<SpecialToken>,
    #[serde(default)]
    eos_token: Option<SpecialToken>,
    #[serde(default)]
    pad_token: Option<SpecialToken>,
    #[serde(default)]
    unk_token: Option<SpecialToken>,
}

/// A special token: a string, or an `AddedToken` object with its `content`.
#[derive(Deserialize)]
#[serde(untagged)]
enum SpecialToken {
    Text(String),
    Added { content: String },
}

impl SpecialToken {
    fn into_text(self) -> String {
        match self {
            SpecialToken::Text(text) | SpecialToken::Added { content: text } => text,
        }
    }
}

/// `chat_template`: one template, or named ones.
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A request's prompt, tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The request's `cache_salt`, as JSON text, if it has one (the engine salts the prompt's
    /// first block in its prefix cache with it).
    pub cache_salt: Option<String>,
}

/// What a chat template reads of a request: each part the JSON text the client sent. A
/// caller that has parsed the body already hands over the parts it found, so the body is not
/// read again; [`PromptTokenizer::tokenize_chat`] finds them itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatParts<'a> {
    /// `messages`: the array's text (whatever follows its closing bracket is not read).
    pub messages: &'a [u8],
    /// `tools`, if sent.
    pub tools: Option<&'a [u8]>,
    /// `add_generation_prompt`, if sent (`true` by default).
    pub add_generation_prompt: Option<&'a [u8]>,
    /// `continue_final_message`, if sent (`false` by default).
    pub continue_final_message: Option<&'a [u8]>,
    /// `chat_template_kwargs`, if sent: more variables for the template.
    pub chat_template_kwargs: Option<&'a [u8]>,
}

/// The members of a chat request the template reads, found in its body.
#[derive(Deserialize)]
struct ChatFields<'a> {
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    continue_final_message: Option<&'a RawValue>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
}

impl<'a> ChatFields<'a> {
    fn parse(body: &'a [u8]) -> Result<Self, Error> {
        serde_json::from_slice(body).map_err(|e| Error::Request(e.to_string()))
    }

    fn parts(&self) -> Result<ChatParts<'a>, Error> {
        let bytes = |raw: Option<&'a RawValue>| raw.map(|raw| raw.get().as_bytes());
        Ok(ChatParts {
            messages: bytes(self.messages)
                .ok_or_else(|| Error::Request("no messages".to_string()))?,
            tools: bytes(self.tools),
            add_generation_prompt: bytes(self.add_generation_prompt),
            continue_final_message: bytes(self.continue_final_message),
            chat_template_kwargs: bytes(self.chat_template_kwargs),
        })
    }
}

/// One part of a request, read as `T`; a part not sent, or `null`, is `None`.
fn read_part<'a, T: Deserialize<'a>>(
    part: Option<&'a [u8]>,
    name: &str,
) -> Result<Option<T>, Error> {
    let Some(text) = part else {
        return Ok(None);
    };
    let mut de = serde_json::Deserializer::from_slice(text);
    Option::<T>::deserialize(&mut de).map_err(|e| Error::Request(format!("{name}: {e}")))
}

/// The field of a text completion request that is tokenized.
#[derive(Deserialize)]
struct CompletionFields<'a> {
    prompt: Option<serde_json::Value>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
}

impl PromptTokenizer {
    /// Reads a Hugging Face tokenizer folder: `tokenizer.json`, and `tokenizer_config.json`
    /// and `chat_template.jinja` when present.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        use std::hash::{Hash, Hasher};
        let tokenizer_path = dir.join("tokenizer.json");
        let load_error =
            |e: &dyn std::fmt::Display| Error::Load(format!("{}: {e}", tokenizer_path.display()));
        let tokenizer_bytes = std::fs::read(&tokenizer_path).map_err(|e| load_error(&e))?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&tokenizer_bytes).map_err(|e| load_error(&e))?;
        // Fixed keys: the same files give the same fingerprint in a process.
        let mut fingerprint = std::hash::DefaultHasher::new();
        tokenizer_bytes.hash(&mut fingerprint);
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = match std::fs::read(&config_path) {
            Ok(bytes) => {
                bytes.hash(&mut fingerprint);
                serde_json::from_slice(&bytes)
                    .map_err(|e| Error::Load(format!("{}: {e}", config_path.display())))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => TokenizerConfig::default(),
            Err(e) => return Err(Error::Load(format!("{}: {e}", config_path.display()))),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let template = match std::fs::read_to_string(&jinja_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match config.chat_template {
                Some(TemplateField::One(text)) => Some(text),
                Some(TemplateField::Named(list)) => list
                    .into_iter()
                    .find(|t| t.name == "default")
                    .map(|t| t.template),
                None => None,
            },
            Err(e) => return Err(Error::Load(format!("{}: {e}", jinja_path.display()))),
        };
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Load(format!("the template syntax: {e}")))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", python_tojson);
        env.add_function("raise_exception", raise_exception);
        let has_template = template.is_some();
        template.hash(&mut fingerprint);
        if let Some(template) = template {
            env.add_template_owned(CHAT, template)
                .map_err(|e| Error::Load(format!("the chat template: {e}")))?;
        }
        let specials = [
            ("bos_token", config.bos_token),
            ("eos_token", config.eos_token),
            ("pad_token", config.pad_token),
            ("unk_token", config.unk_token),
        ]
        .into_iter()
        .filter_map(|(name, token)| Some((name, token?.into_text())))
        .collect();
        Ok(PromptTokenizer {
            pieces: pieces::Pieces::of(&tokenizer),
            cuts_at_words: cuts_at_words(&tokenizer_bytes),
            tokenizer,
            env,
            has_template,
            specials,
            fingerprint: fingerprint.finish(),
        })
    }

    /// A hash of the files it was read from: equal for two loads of the same folder.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Whether the folder has a chat template (without one, chat requests cannot be read).
    pub fn has_chat_template(&self) -> bool {
        self.has_template
    }

    /// The chat request `body` as the template renders it.
    #[cfg(test)]
    pub fn render_chat(&self, body: &[u8]) -> Result<String, Error> {
        self.render(ChatFields::parse(body)?.parts()?)
    }

    /// A chat request's `parts` as the template renders them.
    pub fn render(&self, parts: ChatParts<'_>) -> Result<String, Error> {
        let messages: Value = read_part(Some(parts.messages), "messages")?
            .ok_or_else(|| Error::Request("no messages".to_string()))?;
        let messages = parse_tool_arguments(messages);
        let template = self
            .env
            .get_template(CHAT)
            .map_err(|_| Error::Template("the tokenizer has no chat template".to_string()))?;
        let mut context: Vec<(String, Value)> = self
            .specials
            .iter()
            .map(|(name, text)| ((*name).to_string(), Value::from(text.as_str())))
            .collect();
        let continue_final =
            read_part(parts.continue_final_message, "continue_final_message")?.unwrap_or(false);
        // vLLM: the generation prompt is off when the last message is continued.
        let generation_prompt = read_part(parts.add_generation_prompt, "add_generation_prompt")?
            .unwrap_or(true)
            && !continue_final;
        let tools: Option<Value> = read_part(parts.tools, "tools")?;
        context.push(("messages".to_string(), messages));
        context.push(("tools".to_string(), tools.unwrap_or(Value::from(()))));
        context.push((
            "add_generation_prompt".to_string(),
            Value::from(generation_prompt),
        ));
        let kwargs: Option<Value> = read_part(parts.chat_template_kwargs, "chat_template_kwargs")?;
        if let Some(kwargs) = kwargs {
            if let Ok(keys) = kwargs.try_iter() {
                for key in keys {
                    if let (Some(name), Ok(value)) = (key.as_str(), kwargs.get_item(&key)) {
                        context.push((name.to_string(), value));
                    }
                }
            }
        }
        let context: std::collections::BTreeMap<String, Value> = context.into_iter().collect();
        let context = Value::from(context);
        template
            .render(context)
            .map_err(|e| Error::Template(e.to_string()))
    }

    /// The token ids of a chat request (`/v1/chat/completions` body).
    pub fn chat(&self, body: &[u8]) -> Result<Vec<u32>, Error> {
        Ok(self.tokenize_chat(body)?.ids)
    }

    /// A chat request's token ids and `cache_salt`, from one parse of its body.
    pub fn tokenize_chat(&self, body: &[u8]) -> Result<Tokenized, Error> {
        let fields = ChatFields::parse(body)?;
        Ok(Tokenized {
            ids: self.chat_ids(fields.parts()?)?,
            cache_salt: fields.cache_salt.map(|raw| raw.get().to_string()),
        })
    }

    /// The token ids of a chat request's `parts`: rendered, then encoded without special
    /// tokens (the template writes them).
    pub fn chat_ids(&self, parts: ChatParts<'_>) -> Result<Vec<u32>, Error> {
        let text = self.render(parts)?;
        match &self.pieces {
            Some(pieces) => pieces.encode(&text, |piece| self.encode_piece(piece)),
            None => self.encode(&text, false),
        }
    }

    /// A text between added tokens, without special tokens: in parts when it is long and
    /// the tokenizer allows (see [`cuts_at_words`]).
    fn encode_piece(&self, piece: &str) -> Result<Vec<u32>, Error> {
        if !self.cuts_at_words || piece.len() <= PART_BYTES {
            return self.encode(piece, false);
        }
        let mut ids = Vec::with_capacity(piece.len() / 3);
        for part in word_cuts(piece) {
            ids.extend(self.encode(part, false)?);
        }
        Ok(ids)
    }

    /// The token ids of a text completion request (`/v1/completions` body): its prompt, or
    /// the first of a list of prompts; a prompt given as token ids is taken as it is.
    pub fn completion(&self, body: &[u8]) -> Result<Vec<u32>, Error> {
        Ok(self.tokenize_completion(body)?.ids)
    }

    /// A text completion request's token ids and `cache_salt`, from one parse of its body.
    pub fn tokenize_completion(&self, body: &[u8]) -> Result<Tokenized, Error> {
        let fields: CompletionFields =
            serde_json::from_slice(body).map_err(|e| Error::Request(e.to_string()))?;
        let cache_salt = fields.cache_salt.map(|raw| raw.get().to_string());
        let ids = self.prompt_ids(fields.prompt)?;
        Ok(Tokenized { ids, cache_salt })
    }

    fn prompt_ids(&self, prompt: Option<serde_json::Value>) -> Result<Vec<u32>, Error> {
        let prompt = prompt.ok_or_else(|| Error::Request("no prompt".to_string()))?;
        let first = match prompt {
            serde_json::Value::Array(mut items) if !items.is_empty() => {
                if items.iter().all(serde_json::Value::is_u64) {
                    return Ok(items
                        .iter()
                        .filter_map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                        .collect());
                }
                items.swap_remove(0)
            }
            other => other,
        };
        match first {
            serde_json::Value::String(text) => self.encode(&text, true),
            serde_json::Value::Array(ids) => Ok(ids
                .iter()
                .filter_map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect()),
            _ => Err(Error::Request("the prompt is not text".to_string())),
        }
    }

    /// The text of token `ids`, special tokens included (vLLM's `/detokenize`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| Error::Encode(e.to_string()))
    }

    /// Encodes `text`; with `special`, the tokenizer's post-processor adds its special tokens.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, Error> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| Error::Encode(e.to_string()))
    }
}

/// vLLM parses each tool call's `arguments` string into an object before rendering, since
/// templates write it with `tojson`. Rebuilt as minijinja values, which keep keys in order.
fn parse_tool_arguments(messages: Value) -> Value {
    let has_calls = messages.try_iter().is_ok_and(|mut all| {
        all.any(|m| {
            m.get_attr("tool_calls")
                .is_ok_and(|c| c.kind() == ValueKind::Seq)
        })
    });
    if !has_calls {
        return messages;
    }
    let Ok(list) = messages.try_iter() else {
        return messages;
    };
    list.map(|message| {
        map_entries(&message, |key, value| match key {
            "tool_calls" => value
                .try_iter()
                .map(|calls| calls.map(|call| parse_call(&call)).collect())
                .unwrap_or(value),
            _ => value,
        })
    })
    .collect()
}

fn parse_call(call: &Value) -> Value {
    map_entries(call, |key, value| match key {
        "function" => map_entries(&value, |key, value| match (key, value.as_str()) {
            ("arguments", Some(text)) => serde_json::from_str::<Value>(text).unwrap_or(value),
            _ => value,
        }),
        _ => value,
    })
}

/// A map with each entry's value passed through `edit`, in the map's order; other values as
/// they are.
fn map_entries(map: &Value, edit: impl Fn(&str, Value) -> Value) -> Value {
    if map.kind() != ValueKind::Map {
        return map.clone();
    }
    let Ok(keys) = map.try_iter() else {
        return map.clone();
    };
    let edited: indexmap::IndexMap<Value, Value> = keys
        .map(|key| {
            let value = map.get_item(&key).unwrap_or_default();
            let value = match key.as_str() {
                Some(name) => edit(name, value),
                None => value,
            };
            (key, value)
        })
        .collect();
    Value::from(edited)
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, marked safe.
fn python_tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, minijinja::Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        Some(v) if v.is_number() => i64::try_from(v).ok().map(|n| " ".repeat(n.max(0) as usize)),
        Some(v) => v.as_str().map(str::to_string),
        None => None,
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _ = kwargs.get::<Option<Value>>("ensure_ascii")?;
    let _ = kwargs.get::<Option<Value>>("separators")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let style = JsonStyle { indent, sort_keys };
    write_json(&mut out, value, &style, 0);
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<String>,
    sort_keys: bool,
}

impl JsonStyle {
    /// A newline and `depth` indents, when indenting.
    fn break_line(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    /// Python's item separator: `", "`, or `","` before a newline when indenting.
    fn item_separator(&self) -> &'static str {
        if self.indent.is_some() {
            ","
        } else {
            ", "
        }
    }
}

fn write_json(out: &mut String, value: &Value, style: &JsonStyle, depth: usize) {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match (i64::try_from(value.clone()), f64::try_from(value.clone())) {
            (Ok(int), _) if value.is_integer() => {
                let _ = write!(out, "{int}");
            }
            (_, Ok(float)) => write_python_float(out, float),
            _ => out.push_str("null"),
        },
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map(Iterator::collect).unwrap_or_default();
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item_separator());
                }
                style.break_line(out, depth + 1);
                write_json(out, item, style, depth + 1);
            }
            style.break_line(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter().map(Iterator::collect).unwrap_or_default();
            if keys.is_empty() {
                out.push_str("{}");
                return;
            }
            if style.sort_keys {
                keys.sort_by_key(ToString::to_string);
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item_separator());
                }
                style.break_line(out, depth + 1);
                match key.as_str() {
                    Some(text) => write_json_string(out, text),
                    None => write_json_string(out, &key.to_string()),
                }
                out.push_str(": ");
                let item = value.get_item(key).unwrap_or_default();
                write_json(out, &item, style, depth + 1);
            }
            style.break_line(out, depth);
            out.push('}');
        }
        _ => write_json_string(out, &value.to_string()),
    }
}

/// A float as Python's `repr` writes it: `1.0`, `0.5`, `1e+20`.
fn write_python_float(out: &mut String, float: f64) {
    if !float.is_finite() {
        out.push_str(if float.is_nan() {
            "NaN"
        } else if float > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
    } else if float.fract() == 0.0 && float.abs() < 1e16 {
        let _ = write!(out, "{float:.1}");
    } else {
        let text = format!("{float:?}");
        // Rust writes `1e20`, Python `1e+20`.
        match text.split_once('e') {
            Some((mantissa, exp)) if !exp.starts_with('-') => {
                let _ = write!(out, "{mantissa}e+{exp}");
            }
            _ => out.push_str(&text),
        }
    }
}

/// A JSON string as Python's `json.dumps(..., ensure_ascii=False)` writes it.
fn write_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer-chatml")
    }

    /// The ids transformers 5 makes of each case (`golden.json`, written by the script in
    /// tests/fixtures/README.md): the same chat template, the same tokenizer.
    #[test]
    fn token_ids_equal_transformers() {
        let tokenizer = PromptTokenizer::load(&fixture()).unwrap();
        assert!(tokenizer.has_chat_template());
        // Read raw, so that each case's keys reach the tokenizer in the file's order.
        #[derive(serde::Deserialize)]
        struct Case {
            chat: Option<Box<serde_json::value::RawValue>>,
            prompt: Option<String>,
            ids: Vec<u32>,
        }
        let golden: Vec<Case> =
            serde_json::from_slice(&std::fs::read(fixture().join("golden.json")).unwrap()).unwrap();
        assert!(golden.len() >= 7);
        for case in golden {
            let ids = match (&case.chat, &case.prompt) {
                (Some(chat), _) => tokenizer.chat(chat.get().as_bytes()).unwrap(),
                (None, Some(prompt)) => {
                    let body = serde_json::json!({ "prompt": prompt });
                    tokenizer
                        .completion(&serde_json::to_vec(&body).unwrap())
                        .unwrap()
                }
                (None, None) => panic!("a case without input"),
            };
            assert_eq!(
                ids,
                case.ids,
                "case {:?}",
                case.chat.as_ref().map(|c| c.get())
            );
        }
    }

    /// A picker of `list`'s words in a fixed pseudo-random order (an LCG from a fixed seed).
    fn words<'a>(list: &'a [&'a str]) -> impl FnMut() -> &'a str {
        let mut seed = 7u64;
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            list[(seed >> 33) as usize % list.len()]
        }
    }

    /// Piece by piece, remembered or not, the ids are the whole text's.
    #[test]
    fn pieces_make_the_same_ids_as_the_whole_text() {
        let tokenizer = PromptTokenizer::load(&fixture()).unwrap();
        let pieces = tokenizer
            .pieces
            .as_ref()
            .expect("ChatML's added tokens are plain");
        let mut word = words(&[
            "the ",
            "cache ",
            "éé ",
            "<|im",
            "_end|>",
            "\n",
            "  ",
            "def f(x):\n",
            "x",
            ".",
        ]);
        let mut history = vec![
            serde_json::json!({"role": "system", "content": (0..400).map(|_| word()).collect::<String>()}),
        ];
        for turn in 0..6 {
            history.push(serde_json::json!({"role": "user", "content": (0..(60 + turn * 40)).map(|_| word()).collect::<String>()}));
            let body = serde_json::to_vec(&serde_json::json!({"messages": history})).unwrap();
            let text = tokenizer.render_chat(&body).unwrap();
            assert_eq!(
                tokenizer.chat(&body).unwrap(),
                tokenizer.encode(&text, false).unwrap(),
                "turn {turn}"
            );
            history.push(serde_json::json!({"role": "assistant", "content": (0..30).map(|_| word()).collect::<String>()}));
        }
        assert!(
            pieces.remembered() >= 2,
            "the system prompt and the long turns are remembered"
        );
    }

    /// A long text between added tokens is encoded in parts (a byte-level BPE), and its ids
    /// are those of the text encoded whole.
    #[test]
    fn a_long_piece_cut_at_words_gives_the_ids_of_the_whole() {
        let tokenizer = PromptTokenizer::load(&fixture()).unwrap();
        assert!(tokenizer.cuts_at_words, "the fixture is a byte-level BPE");
        assert_cut_ids_are_the_whole_text_s(&tokenizer);
        // A text with no cut in it is one part.
        let unbroken = "x".repeat(3 * PART_BYTES);
        assert_eq!(word_cuts(&unbroken).count(), 1);
    }

    /// Llama 3's and Qwen 2's pre-tokenizers (a split, then bytes) cut long texts too, with
    /// the ids of the whole: the fixture's vocabulary under each one's `pre_tokenizer` (and
    /// Qwen's NFC normalizer), as their `tokenizer.json`s write them.
    #[test]
    fn llama_3_and_qwen_2_splits_cut_at_words_with_the_ids_of_the_whole() {
        let fixture_json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(fixture().join("tokenizer.json")).unwrap())
                .unwrap();
        for (family, regex, normalizer) in [
            ("llama 3", SPLITS_AT_WORDS[0], serde_json::Value::Null),
            (
                "qwen 2",
                SPLITS_AT_WORDS[1],
                serde_json::json!({"type": "NFC"}),
            ),
        ] {
            let mut json = fixture_json.clone();
            json["normalizer"] = normalizer;
            json["pre_tokenizer"] = serde_json::json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
                ],
            });
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(
                dir.path().join("tokenizer.json"),
                serde_json::to_vec(&json).unwrap(),
            )
            .unwrap();
            let tokenizer = PromptTokenizer::load(dir.path()).unwrap();
            assert!(tokenizer.cuts_at_words, "{family}");
            // The split is the one in force: digits in threes (Llama 3) or one by one (Qwen 2),
            // where GPT-2's regex keeps them together.
            let mut digits = tokenizers::PreTokenizedString::from("12345");
            tokenizers::PreTokenizer::pre_tokenize(
                tokenizer.tokenizer.get_pre_tokenizer().unwrap(),
                &mut digits,
            )
            .unwrap();
            let splits = digits
                .get_splits(
                    tokenizers::OffsetReferential::Original,
                    tokenizers::OffsetType::Byte,
                )
                .len();
            assert_eq!(splits, if family == "llama 3" { 2 } else { 5 }, "{family}");
            assert_cut_ids_are_the_whole_text_s(&tokenizer);
        }
    }

    /// A long text of words, runs of spaces, newlines, numbers, punctuation, contractions and
    /// accented letters at and around every cut: cut into parts, each after the first
    /// starting with its space, and encoded in parts with the ids of the text encoded whole.
    fn assert_cut_ids_are_the_whole_text_s(tokenizer: &PromptTokenizer) {
        let mut word = words(&[
            "the ",
            "cache ",
            "éé ",
            "don't ",
            "'really ",
            "  ",
            "\n",
            "\r\n",
            "x",
            ".",
            "12345 ",
            "A ",
            "b\t",
            " ",
            "end. ",
            "(it's) ",
            "ünïcödé ",
        ]);
        let text: String = (0..40_000).map(|_| word()).collect();
        assert!(text.len() > 4 * PART_BYTES);
        let parts: Vec<&str> = word_cuts(&text).collect();
        assert!(parts.len() >= 4, "cut into {} parts", parts.len());
        assert_eq!(parts.concat(), text);
        assert!(parts[1..].iter().all(|p| p.starts_with(' ')));
        assert_eq!(
            tokenizer.encode_piece(&text).unwrap(),
            tokenizer.encode(&text, false).unwrap()
        );
    }

    #[test]
    fn only_byte_level_bpe_tokenizers_are_cut() {
        let json = |normalizer: &str, pre: &str, model: &str| {
            format!(
                r#"{{"normalizer": {normalizer}, "pre_tokenizer": {pre}, "model": {{"type": "{model}"}}}}"#
            )
        };
        let byte_level = r#"{"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}"#;
        assert!(cuts_at_words(json("null", byte_level, "BPE").as_bytes()));
        assert!(cuts_at_words(
            json(r#"{"type": "NFC"}"#, byte_level, "BPE").as_bytes()
        ));
        // A prefix space, a lowercasing normalizer, a custom split, SentencePiece's
        // Metaspace, WordPiece: encoded whole.
        let prefixed = r#"{"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}"#;
        assert!(!cuts_at_words(json("null", prefixed, "BPE").as_bytes()));
        assert!(!cuts_at_words(
            json(r#"{"type": "Lowercase"}"#, byte_level, "BPE").as_bytes()
        ));
        let no_regex = r#"{"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}"#;
        assert!(!cuts_at_words(json("null", no_regex, "BPE").as_bytes()));
        let metaspace = r#"{"type": "Metaspace", "replacement": "▁"}"#;
        assert!(!cuts_at_words(json("null", metaspace, "BPE").as_bytes()));
        assert!(!cuts_at_words(
            json("null", byte_level, "WordPiece").as_bytes()
        ));
        // A split then bytes: Llama 3's regex is cut; another regex, a split that drops what
        // it matches, or bytes with a regex of their own after it are not.
        let split = |regex: &str, behavior: &str, use_regex: bool| {
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": behavior, "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "use_regex": use_regex},
            ]})
            .to_string()
        };
        let llama = SPLITS_AT_WORDS[0];
        assert!(cuts_at_words(
            json("null", &split(llama, "Isolated", false), "BPE").as_bytes()
        ));
        let digits_first = r"\p{N}{1,3}|[^\r\n\p{L}\p{N}]?\p{L}+";
        for pre in [
            split(digits_first, "Isolated", false),
            split(llama, "Removed", false),
            split(llama, "Isolated", true),
        ] {
            assert!(
                !cuts_at_words(json("null", &pre, "BPE").as_bytes()),
                "{pre}"
            );
        }
    }

    #[test]
    fn tool_arguments_given_as_text_render_as_objects() {
        let tokenizer = PromptTokenizer::load(&fixture()).unwrap();
        let as_text = br#"{"messages":[{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"city\": \"Paris\", \"a\": 1}"}}]}]}"#;
        let rendered = tokenizer.render_chat(as_text).unwrap();
        assert!(
            rendered.contains(r#"{"name": "f", "arguments": {"city": "Paris", "a": 1}}"#),
            "{rendered}"
        );
    }

    #[test]
    fn python_json() {
        let value: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, 3.0, "é\n\"x\"", null, true], "a": {}, "c": []}"#,
        )
        .unwrap();
        let mut out = String::new();
        let style = JsonStyle {
            indent: None,
            sort_keys: false,
        };
        write_json(&mut out, &value, &style, 0);
        assert_eq!(
            out,
            r#"{"b": [1, 2.5, 3.0, "é\n\"x\"", null, true], "a": {}, "c": []}"#
        );
        let mut out = String::new();
        let style = JsonStyle {
            indent: Some("  ".to_string()),
            sort_keys: true,
        };
        write_json(&mut out, &value, &style, 0);
        assert_eq!(out, "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    3.0,\n    \"é\\n\\\"x\\\"\",\n    null,\n    true\n  ],\n  \"c\": []\n}");
    }

    #[test]
    fn requests_it_cannot_read_are_errors() {
        let tokenizer = PromptTokenizer::load(&fixture()).unwrap();
        assert!(matches!(tokenizer.chat(b"{}"), Err(Error::Request(_))));
        assert!(matches!(
            tokenizer.chat(b"not json"),
            Err(Error::Request(_))
        ));
        assert!(matches!(
            tokenizer.completion(br#"{"prompt": 5}"#),
            Err(Error::Request(_))
        ));
        assert_eq!(
            tokenizer.completion(br#"{"prompt": [1, 2, 3]}"#).unwrap(),
            vec![1, 2, 3]
        );
        assert!(matches!(
            PromptTokenizer::load(Path::new("/nonexistent")),
            Err(Error::Load(_))
        ));
    }
}
