//! vLLM's OpenAI wire format, the answer side: non-stream answers, stream chunks, the model
//! list, with field order and null fields as vLLM sends them.
//!
//! One set of structs serves every vLLM generation: a field only one generation has is an
//! `Option` skipped when `None`. `Some(None)` serializes as `null` ([`Null`]).

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use crate::text::{self, StopReason};

/// A field that is `null` when present (`Some(None)`) and absent when `None`.
pub type Null = Option<Option<()>>;

/// `Some(None)` (a `null` field) when `present`, else absent.
pub fn null_if(present: bool) -> Null {
    present.then_some(None)
}

impl Serialize for StopReason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            StopReason::None => serializer.serialize_none(),
            StopReason::Eos => serializer.serialize_u32(text::EOS_TOKEN_ID),
            StopReason::Text(stop) => serializer.serialize_str(stop),
        }
    }
}

#[derive(Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
    pub completion_tokens: u32,
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Null,
}

/// `usage.prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`).
#[derive(Serialize, Clone, Copy, Debug)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
    /// vLLM 0.32: the prompt tokens computed into new cache blocks (whole blocks).
    pub created_cache_tokens: u32,
    pub multimodal_tokens: Option<()>,
}

/// The usage of a stream: on the last chunk, or on every chunk with `continuous_usage_stats`
/// (which, in vLLM 0.32, adds `completion_tokens_details`).
#[derive(Serialize)]
pub struct StreamUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
    pub completion_tokens: u32,
    /// Only with `--enable-prompt-tokens-details`, on the final usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Null,
}

/// A non-stream answer; `Choice` is [`ChatChoice`] or [`TextChoice`].
#[derive(Serialize)]
pub struct Completion<'a, Choice> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<Choice>,
    pub service_tier: Option<()>,
    /// `null` before vLLM 0.32, `"vllm-0.32.0-…"` since.
    pub system_fingerprint: Option<&'a str>,
    pub usage: Usage,
    /// Chat answers carry `"prompt_logprobs":null` here; text answers carry it per choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Null,
    /// vLLM 0.32, chat only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Null,
    /// vLLM 0.32, chat only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_text: Null,
    pub kv_transfer_params: Option<&'a serde_json::Value>,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ec_transfer_params: Null,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Null,
}

#[derive(Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: StopReason,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Null,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Null,
}

#[derive(Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    pub content: String,
    pub refusal: Option<()>,
    pub annotations: Option<()>,
    pub audio: Option<()>,
    pub function_call: Option<()>,
    /// `[]` before vLLM 0.32, absent since.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<[(); 0]>,
    /// Before vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Null,
    /// vLLM 0.32's name for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Null,
}

impl ChatMessage {
    pub fn assistant(content: String, v0_32: bool) -> Self {
        ChatMessage {
            role: "assistant",
            content,
            refusal: None,
            annotations: None,
            audio: None,
            function_call: None,
            tool_calls: (!v0_32).then_some([]),
            reasoning_content: null_if(!v0_32),
            reasoning: null_if(v0_32),
        }
    }
}

#[derive(Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprob>,
}

#[derive(Serialize)]
pub struct ChatLogprob {
    pub token: &'static str,
    pub logprob: f32,
    pub bytes: &'static [u8],
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Serialize)]
pub struct TopLogprob {
    pub token: &'static str,
    pub logprob: f32,
    pub bytes: &'static [u8],
}

pub fn chat_logprob(token: u16, logprob: f32, top: u32) -> ChatLogprob {
    let text = text::token_str(token);
    ChatLogprob {
        token: text,
        logprob,
        bytes: text.as_bytes(),
        top_logprobs: text::top_alternatives(token, logprob, top)
            .into_iter()
            .map(|(alternative, logprob)| {
                let text = text::token_str(alternative);
                TopLogprob {
                    token: text,
                    logprob,
                    bytes: text.as_bytes(),
                }
            })
            .collect(),
    }
}

#[derive(Serialize)]
pub struct TextChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: StopReason,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Null,
    pub prompt_logprobs: Option<()>,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Null,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Null,
}

/// Completions-API logprobs: parallel arrays.
#[derive(Serialize, Default)]
pub struct TextLogprobs {
    pub text_offset: Vec<u32>,
    pub token_logprobs: Vec<f32>,
    pub tokens: Vec<&'static str>,
    pub top_logprobs: Vec<OrderedMap>,
}

/// A JSON object whose keys keep the given order (the sampled token first, like vLLM's dict).
pub struct OrderedMap(pub Vec<(&'static str, f32)>);

impl Serialize for OrderedMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

impl TextLogprobs {
    /// Append a token starting at character `offset` of the generated text.
    pub fn push(&mut self, offset: u32, token: u16, logprob: f32, top: u32) {
        let text = text::token_str(token);
        self.text_offset.push(offset);
        self.token_logprobs.push(logprob);
        self.tokens.push(text);
        // vLLM always returns the sampled token's entry, plus `top` alternatives.
        let alternatives = text::top_alternatives(token, logprob, top.max(1));
        self.top_logprobs.push(OrderedMap(
            alternatives
                .into_iter()
                .map(|(alternative, logprob)| (text::token_str(alternative), logprob))
                .collect(),
        ));
    }
}

/// One SSE event of a stream; `Choices` is one [`ChunkChoice`] (chat), one
/// [`TextChunkChoice`] (completions), or none (the usage chunk).
#[derive(Serialize)]
pub struct Chunk<'a, Choices> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Choices,
    /// Absent from chat chunks, `null` on text chunks before vLLM 0.32, the counts on the
    /// usage chunk (and on every chunk with `continuous_usage_stats`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<StreamUsage>>,
    /// vLLM 0.32: on the role chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Null,
    /// vLLM 0.32: on the role chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_text: Null,
    /// vLLM 0.32: on the last event before `[DONE]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<&'a str>,
}

#[derive(Serialize)]
pub struct ChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// Only the finish chunk carries `stop_reason` (vLLM dumps with exclude_unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<&'a StopReason>,
    /// vLLM 0.32: on every chunk but the role chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Null,
}

#[derive(Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    pub content: &'a str,
}

#[derive(Serialize)]
pub struct TextChunkChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: &'a StopReason,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Null,
    /// vLLM 0.32.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Null,
}

/// `data: <json>\n\n`
pub fn sse<T: Serialize>(value: &T) -> bytes::Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut out, value).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    bytes::Bytes::from(out)
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// `GET /v1/models`: one card per served name.
#[derive(Serialize)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<ModelCard<'a>>,
}

#[derive(Serialize)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    pub parent: Option<&'a str>,
    pub max_model_len: Option<u32>,
    pub permission: [ModelPermission; 1],
}

#[derive(Serialize)]
pub struct ModelPermission {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub allow_create_engine: bool,
    pub allow_sampling: bool,
    pub allow_logprobs: bool,
    pub allow_search_indices: bool,
    pub allow_view: bool,
    pub allow_fine_tuning: bool,
    pub organization: &'static str,
    pub group: Option<()>,
    pub is_blocking: bool,
}

impl ModelPermission {
    /// vLLM's fixed permission card.
    pub fn vllm(id: String, created: u64) -> Self {
        ModelPermission {
            id,
            object: "model_permission",
            created,
            allow_create_engine: false,
            allow_sampling: true,
            allow_logprobs: true,
            allow_search_indices: false,
            allow_view: true,
            allow_fine_tuning: false,
            organization: "*",
            group: None,
            is_blocking: false,
        }
    }
}
