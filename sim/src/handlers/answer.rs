//! The planned answer to one request (every choice's tokens, decided up front) and its
//! rendering: one JSON body, or the SSE chunks of a stream.

use bytes::Bytes;

use crate::openai::{
    self, null_if, ChatChoice, ChatLogprobs, ChatMessage, Chunk, ChunkChoice, Completion,
    CompletionRequest, Delta, Kind, StreamUsage, TextChoice, TextChunkChoice, TextLogprobs, Usage,
};
use crate::text::{self, ChoicePlan, Finish, PlanInput, StopReason};
use crate::{unix_now, Shared};

pub struct Answer {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub request: CompletionRequest,
    pub choices: Vec<ChoicePlan>,
    /// The token budget: `max_tokens`, or what is left of the context.
    pub max_tokens: u32,
    /// vLLM 0.32's shapes (else the older ones).
    v0_32: bool,
    /// `system_fingerprint` (vLLM 0.32; `null` before).
    fingerprint: Option<String>,
    /// Prompt tokens the prefix cache served, once the prefill began.
    cached_tokens: std::sync::atomic::AtomicU32,
    /// Prompt tokens computed into new cache blocks, once the prefill is done.
    created_tokens: std::sync::atomic::AtomicU32,
    /// `--enable-prompt-tokens-details`: usage tells them.
    prompt_details: bool,
    /// The API the answer is written in.
    pub wire: Wire,
    /// A prefill leg's answer: where its blocks are kept for the decode leg.
    pub kv_transfer_params: Option<serde_json::Value>,
}

/// The API an answer is written in: OpenAI's chat or text completions, or another API run as
/// a chat.
#[derive(Debug)]
pub enum Wire {
    OpenAi,
    /// Anthropic's Messages (`messages.rs`).
    Anthropic,
    /// OpenAI's Responses (`responses_api.rs`), with what the response echoes.
    Responses(Box<super::responses_api::ResponseRequest>),
}

/// What a stream has sent of one choice so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sent {
    /// Bytes of the choice's text.
    text: usize,
    /// Tokens (their logprobs went out with them).
    tokens: usize,
    /// Where the next token starts in the text, for completions' `text_offset`.
    offset: u32,
}

impl Answer {
    /// Plan every choice; `max_tokens` is the request's token budget, `request_id` the
    /// client's `X-Request-Id`, which vLLM makes the answer's id.
    pub fn plan(
        shared: &Shared,
        request: CompletionRequest,
        max_tokens: u32,
        request_id: Option<&str>,
    ) -> Self {
        let config = &shared.config;
        let v0_32 = config.error_shape.is_v0_32();
        let sampling = request.sampling;
        let sampling_hash = if sampling.temperature > 0.0 && sampling.seed.is_none() {
            // Unseeded sampling: a fresh draw each time.
            text::mix(sampling.hash ^ rand::random::<u64>())
        } else {
            sampling.hash
        };
        let input = PlanInput {
            prompt_hash: request.prompt.hash,
            sampling_hash,
            max_tokens,
            min_len: config.min_answer_tokens,
            max_len: config.max_answer_tokens,
            low_confidence: text::is_low_confidence(
                request.prompt.hash,
                config.low_confidence_share,
            ),
            v0_32,
            ignore_eos: request.ignore_eos,
            stop: &request.stop,
        };
        let choices = (0..request.choice_count)
            .map(|index| text::plan_choice(&input, index))
            .collect();
        let prefix = match request.kind {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        };
        let id = match request_id.or(request.request_id.as_deref()) {
            Some(id) => format!("{prefix}{id}"),
            None => shared.next_id(prefix),
        };
        Answer {
            id,
            // vLLM answers with the adapter's name for an adapter's request.
            model: request
                .lora
                .as_ref()
                .map_or_else(|| shared.model_name().to_string(), |a| a.name.clone()),
            created: unix_now(),
            choices,
            max_tokens,
            v0_32,
            fingerprint: v0_32.then(|| shared.system_fingerprint()),
            request,
            cached_tokens: std::sync::atomic::AtomicU32::new(0),
            created_tokens: std::sync::atomic::AtomicU32::new(0),
            prompt_details: config.prompt_tokens_details,
            kv_transfer_params: None,
            wire: Wire::OpenAi,
        }
    }

    /// The prefix cache served `tokens` of the prompt.
    /// The prompt tokens computed into new cache blocks (usage's `created_cache_tokens`).
    pub fn set_created_tokens(&self, tokens: u32) {
        self.created_tokens
            .store(tokens, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn set_cached_tokens(&self, tokens: u32) {
        self.cached_tokens
            .store(tokens, std::sync::atomic::Ordering::Relaxed);
    }

    /// Prompt tokens the prefix cache served.
    pub fn cached_tokens(&self) -> u32 {
        self.cached_tokens
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The prompt tokens the prefix cache served, when the server says
    /// (`--enable-prompt-tokens-details`).
    pub fn reported_cached_tokens(&self) -> Option<u32> {
        self.prompt_details.then(|| self.cached_tokens())
    }

    /// `usage.prompt_tokens_details`, with `--enable-prompt-tokens-details`.
    fn prompt_tokens_details(&self) -> Option<openai::PromptTokensDetails> {
        self.prompt_details.then(|| openai::PromptTokensDetails {
            cached_tokens: self
                .cached_tokens
                .load(std::sync::atomic::Ordering::Relaxed),
            created_cache_tokens: self
                .created_tokens
                .load(std::sync::atomic::Ordering::Relaxed),
            multimodal_tokens: None,
        })
    }

    pub fn prompt_tokens(&self) -> u32 {
        self.request.prompt.tokens
    }

    /// What the request will hold in the KV cache at the end: the prompt and every choice.
    pub fn kv_tokens(&self) -> u64 {
        let answer_tokens: u64 = self
            .choices
            .iter()
            .map(|choice| choice.tokens.len() as u64)
            .sum();
        u64::from(self.prompt_tokens()) + answer_tokens
    }

    /// Engine steps: the longest choice's length (all choices advance together).
    pub fn steps(&self) -> usize {
        self.choices
            .iter()
            .map(|choice| choice.tokens.len())
            .max()
            .unwrap_or(0)
    }

    /// Tokens produced at `step`: one per choice still generating.
    pub fn tokens_at(&self, step: usize) -> u64 {
        self.choices
            .iter()
            .filter(|choice| choice.tokens.len() > step)
            .count() as u64
    }

    /// Saturating: an absurd config (huge answers, n = 128) must not overflow into a panic.
    pub fn completion_tokens(&self) -> u32 {
        self.choices.iter().fold(0u32, |sum, choice| {
            sum.saturating_add(u32::try_from(choice.tokens.len()).unwrap_or(u32::MAX))
        })
    }

    /// How the request ends on /metrics: as its first choice does.
    pub fn finish(&self) -> Finish {
        self.choices
            .first()
            .map(|choice| choice.finish)
            .unwrap_or(Finish::Stop)
    }

    pub fn is_v0_32(&self) -> bool {
        self.v0_32
    }

    fn usage(&self) -> Usage {
        let completion_tokens = self.completion_tokens();
        Usage {
            prompt_tokens: self.prompt_tokens(),
            total_tokens: self.prompt_tokens().saturating_add(completion_tokens),
            completion_tokens,
            prompt_tokens_details: self.prompt_tokens_details(),
            completion_tokens_details: null_if(self.v0_32),
        }
    }

    fn completion<Choice>(
        &self,
        object: &'static str,
        choices: Vec<Choice>,
    ) -> Completion<'_, Choice> {
        let chat = self.request.kind == Kind::Chat;
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            service_tier: None,
            system_fingerprint: self.fingerprint.as_deref(),
            usage: self.usage(),
            prompt_logprobs: null_if(chat),
            prompt_token_ids: null_if(chat && self.v0_32),
            prompt_text: null_if(chat && self.v0_32),
            kv_transfer_params: self.kv_transfer_params.as_ref(),
            ec_transfer_params: null_if(self.v0_32),
            metrics: null_if(self.v0_32),
        }
    }

    /// The whole non-stream answer as JSON.
    pub fn full_body(&self) -> Vec<u8> {
        let serialized = match self.request.kind {
            Kind::Chat => {
                let choices = self
                    .indexed()
                    .map(|(index, plan)| self.chat_choice(index, plan));
                serde_json::to_vec(&self.completion("chat.completion", choices.collect()))
            }
            Kind::Completion => {
                let choices = self
                    .indexed()
                    .map(|(index, plan)| self.text_choice(index, plan));
                serde_json::to_vec(&self.completion("text_completion", choices.collect()))
            }
        };
        // Plain structs of strings and numbers always serialize.
        serialized.unwrap_or_default()
    }

    fn indexed(&self) -> impl Iterator<Item = (u32, &ChoicePlan)> {
        (0u32..).zip(&self.choices)
    }

    fn chat_logprobs(&self, tokens: &[u16], logprobs: &[f32]) -> Option<ChatLogprobs> {
        self.request.logprobs.then(|| ChatLogprobs {
            content: tokens
                .iter()
                .zip(logprobs)
                .map(|(token, logprob)| {
                    openai::chat_logprob(*token, *logprob, self.request.top_logprobs)
                })
                .collect(),
        })
    }

    /// Completions logprobs of `tokens`, the first starting at character `offset`; returns
    /// them and where the text goes on after them.
    fn text_logprobs(
        &self,
        tokens: &[u16],
        logprobs: &[f32],
        mut offset: u32,
    ) -> (Option<TextLogprobs>, u32) {
        let mut out = TextLogprobs::default();
        for (token, logprob) in tokens.iter().zip(logprobs) {
            out.push(offset, *token, *logprob, self.request.top_logprobs);
            offset += text::token_text(*token).len() as u32;
        }
        (self.request.logprobs.then_some(out), offset)
    }

    fn chat_choice(&self, index: u32, plan: &ChoicePlan) -> ChatChoice {
        ChatChoice {
            index,
            message: ChatMessage::assistant(plan.text(), self.v0_32),
            logprobs: self.chat_logprobs(&plan.tokens, &plan.logprobs),
            finish_reason: plan.finish.as_str(),
            stop_reason: plan.stop_reason.clone(),
            token_ids: null_if(self.v0_32),
            routed_experts: null_if(self.v0_32),
        }
    }

    fn text_choice(&self, index: u32, plan: &ChoicePlan) -> TextChoice {
        TextChoice {
            index,
            text: plan.text(),
            logprobs: self.text_logprobs(&plan.tokens, &plan.logprobs, 0).0,
            finish_reason: plan.finish.as_str(),
            stop_reason: plan.stop_reason.clone(),
            token_ids: null_if(self.v0_32),
            prompt_logprobs: None,
            prompt_token_ids: null_if(self.v0_32),
            routed_experts: null_if(self.v0_32),
        }
    }

    fn chunk<Choices: serde::Serialize>(
        &self,
        choices: Choices,
        usage: Option<Option<StreamUsage>>,
        role_chunk: bool,
        fingerprint: bool,
    ) -> Bytes {
        openai::sse(&Chunk {
            id: &self.id,
            object: self.request.kind.chunk_object(),
            created: self.created,
            model: &self.model,
            choices,
            usage,
            prompt_token_ids: null_if(role_chunk && self.v0_32),
            prompt_text: null_if(role_chunk && self.v0_32),
            system_fingerprint: self.fingerprint.as_deref().filter(|_| fingerprint),
        })
    }

    /// `continuous_usage_stats`: the counts so far of one choice, on each of its chunks.
    fn running_usage(&self, completion_tokens: usize) -> Option<StreamUsage> {
        let completion_tokens = u32::try_from(completion_tokens).unwrap_or(u32::MAX);
        self.request.continuous_usage.then(|| StreamUsage {
            prompt_tokens: self.prompt_tokens(),
            total_tokens: self.prompt_tokens().saturating_add(completion_tokens),
            completion_tokens,
            prompt_tokens_details: None,
            completion_tokens_details: null_if(self.v0_32),
        })
    }

    /// Chat: the first event of each choice, `{"role":"assistant","content":""}`.
    pub fn role_chunk(&self, index: u32) -> Bytes {
        let choice = ChunkChoice {
            index,
            delta: Delta {
                role: Some("assistant"),
                content: "",
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
            token_ids: None,
        };
        self.chunk([choice], self.running_usage(0).map(Some), true, false)
    }

    /// The event for choice `index` once its token `step` is out, or `None` when that token
    /// has no chunk of its own (it goes out with the next one). It carries the text shown
    /// since the last event and the logprobs of every token since; in vLLM 0.32 (and always
    /// for completions) the last one carries the finish reason. `fingerprint` puts the
    /// `system_fingerprint` on it (vLLM 0.32's last event before `[DONE]`).
    pub fn token_event(
        &self,
        index: u32,
        step: usize,
        sent: &mut Sent,
        fingerprint: bool,
    ) -> Option<Bytes> {
        let plan = self.choices.get(usize::try_from(index).ok()?)?;
        let shown = (*plan.visible.get(step)?)?;
        let content = plan.text_str().get(sent.text..shown).unwrap_or("");
        let tokens = plan.tokens.get(sent.tokens..=step).unwrap_or(&[]);
        let logprobs = plan.logprobs.get(sent.tokens..=step).unwrap_or(&[]);
        let last = step + 1 == plan.tokens.len();
        let finish = last && (self.v0_32 || self.request.kind == Kind::Completion);
        let usage = self.running_usage(step + 1);
        let event = match self.request.kind {
            Kind::Chat => {
                let choice = ChunkChoice {
                    index,
                    delta: Delta {
                        role: None,
                        content,
                    },
                    logprobs: self.chat_logprobs(tokens, logprobs),
                    finish_reason: finish.then(|| plan.finish.as_str()),
                    stop_reason: finish.then_some(&plan.stop_reason),
                    token_ids: null_if(self.v0_32),
                };
                self.chunk([choice], usage.map(Some), false, fingerprint)
            }
            Kind::Completion => {
                let (text_logprobs, offset) = self.text_logprobs(tokens, logprobs, sent.offset);
                sent.offset = offset;
                let choice = TextChunkChoice {
                    index,
                    text: content,
                    logprobs: text_logprobs,
                    finish_reason: finish.then(|| plan.finish.as_str()),
                    stop_reason: if finish {
                        &plan.stop_reason
                    } else {
                        &StopReason::None
                    },
                    prompt_token_ids: null_if(self.v0_32),
                    token_ids: null_if(self.v0_32),
                };
                // Before 0.32 every text chunk had `"usage":null`.
                let usage = match usage {
                    Some(usage) => Some(Some(usage)),
                    None => (!self.v0_32).then_some(None),
                };
                self.chunk([choice], usage, false, fingerprint)
            }
        };
        sent.text = shown.max(sent.text);
        sent.tokens = step + 1;
        Some(event)
    }

    /// Chat before vLLM 0.32: the event after a choice's last token, with an empty delta and
    /// the finish reason.
    pub fn finish_chunk(&self, index: u32) -> Option<Bytes> {
        let plan = self.choices.get(usize::try_from(index).ok()?)?;
        let choice = ChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: "",
            },
            logprobs: None,
            finish_reason: Some(plan.finish.as_str()),
            stop_reason: Some(&plan.stop_reason),
            token_ids: None,
        };
        let usage = self.running_usage(plan.tokens.len());
        Some(self.chunk([choice], usage.map(Some), false, false))
    }

    /// The choice and step whose event is the stream's last before the usage chunk and
    /// `[DONE]`: the last choice that runs the longest.
    pub fn last_token_event(&self) -> Option<(u32, usize)> {
        let steps = self.steps();
        let index = self
            .indexed()
            .filter(|(_, plan)| plan.tokens.len() == steps)
            .map(|(index, _)| index)
            .last()?;
        Some((index, steps.checked_sub(1)?))
    }

    /// The usage event (`"choices":[]`) sent with `stream_options.include_usage`.
    pub fn usage_chunk(&self) -> Bytes {
        let usage = self.usage();
        let stream_usage = StreamUsage {
            prompt_tokens: usage.prompt_tokens,
            total_tokens: usage.total_tokens,
            completion_tokens: usage.completion_tokens,
            prompt_tokens_details: usage.prompt_tokens_details,
            completion_tokens_details: None,
        };
        self.chunk([(); 0], Some(Some(stream_usage)), false, true)
    }
}
