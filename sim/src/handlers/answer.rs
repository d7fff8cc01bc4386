//! The planned answer to one request (every choice's tokens, decided up front) and its
//! rendering: one JSON body, or the SSE chunks of a stream.

use bytes::Bytes;

use crate::openai::{
    self, ChatChoice, ChatLogprobs, ChatMessage, Chunk, ChunkChoice, Completion, CompletionRequest,
    Delta, Kind, StreamUsage, TextChoice, TextChunkChoice, TextLogprobs, Usage,
};
use crate::text::{self, ChoicePlan, Finish, PlanInput};
use crate::{unix_now, Shared};

pub struct Answer {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub request: CompletionRequest,
    pub choices: Vec<ChoicePlan>,
}

impl Answer {
    /// Plan every choice; `max_tokens` is the request's token budget.
    pub fn plan(shared: &Shared, request: CompletionRequest, max_tokens: u32) -> Self {
        let config = &shared.config;
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
        };
        let choices = (0..request.choice_count)
            .map(|index| text::plan_choice(&input, index))
            .collect();
        Answer {
            id: shared.next_id(match request.kind {
                Kind::Chat => "chatcmpl-",
                Kind::Completion => "cmpl-",
            }),
            model: shared.model_name().to_string(),
            created: unix_now(),
            request,
            choices,
        }
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

    fn usage(&self) -> Usage {
        let completion_tokens = self.completion_tokens();
        Usage {
            prompt_tokens: self.prompt_tokens(),
            total_tokens: self.prompt_tokens().saturating_add(completion_tokens),
            completion_tokens,
            prompt_tokens_details: None,
        }
    }

    fn completion<Choice>(
        &self,
        object: &'static str,
        choices: Vec<Choice>,
        prompt_logprobs: Option<Option<()>>,
    ) -> Completion<'_, Choice> {
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            service_tier: None,
            system_fingerprint: None,
            usage: self.usage(),
            prompt_logprobs,
            kv_transfer_params: None,
        }
    }

    /// The whole non-stream answer as JSON.
    pub fn full_body(&self) -> Vec<u8> {
        let serialized = match self.request.kind {
            Kind::Chat => {
                let choices = self
                    .indexed()
                    .map(|(index, plan)| self.chat_choice(index, plan));
                let body = self.completion("chat.completion", choices.collect(), Some(None));
                serde_json::to_vec(&body)
            }
            Kind::Completion => {
                let choices = self
                    .indexed()
                    .map(|(index, plan)| self.text_choice(index, plan));
                let body = self.completion("text_completion", choices.collect(), None);
                serde_json::to_vec(&body)
            }
        };
        // Plain structs of strings and numbers always serialize.
        serialized.unwrap_or_default()
    }

    fn indexed(&self) -> impl Iterator<Item = (u32, &ChoicePlan)> {
        (0u32..).zip(&self.choices)
    }

    fn chat_choice(&self, index: u32, plan: &ChoicePlan) -> ChatChoice {
        ChatChoice {
            index,
            message: ChatMessage::assistant(plan.text()),
            logprobs: self.request.logprobs.then(|| ChatLogprobs {
                content: plan
                    .tokens
                    .iter()
                    .zip(&plan.logprobs)
                    .map(|(token, logprob)| {
                        openai::chat_logprob(*token, *logprob, self.request.top_logprobs)
                    })
                    .collect(),
            }),
            finish_reason: plan.finish.as_str(),
            stop_reason: None,
        }
    }

    fn text_choice(&self, index: u32, plan: &ChoicePlan) -> TextChoice {
        TextChoice {
            index,
            text: plan.text(),
            logprobs: self.request.logprobs.then(|| {
                let mut logprobs = TextLogprobs::default();
                let mut offset = 0u32;
                for (token, logprob) in plan.tokens.iter().zip(&plan.logprobs) {
                    logprobs.push(offset, *token, *logprob, self.request.top_logprobs);
                    offset += text::token_str(*token).len() as u32;
                }
                logprobs
            }),
            finish_reason: plan.finish.as_str(),
            stop_reason: None,
            prompt_logprobs: None,
        }
    }

    fn chunk<Choices: serde::Serialize>(
        &self,
        choices: Choices,
        usage: Option<Option<StreamUsage>>,
    ) -> Bytes {
        openai::sse(&Chunk {
            id: &self.id,
            object: self.request.kind.chunk_object(),
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }

    fn chat_chunk(&self, choice: ChunkChoice<'_>) -> Bytes {
        self.chunk([choice], None)
    }

    /// Chat: the first event of each choice, `{"role":"assistant","content":""}`.
    pub fn role_chunk(&self, index: u32) -> Bytes {
        self.chat_chunk(ChunkChoice {
            index,
            delta: Delta {
                role: Some("assistant"),
                content: "",
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        })
    }

    /// Chat: one token of choice `index`.
    pub fn content_chunk(&self, index: u32, token: u16, logprob: f32) -> Bytes {
        self.chat_chunk(ChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: text::token_str(token),
            },
            logprobs: self.request.logprobs.then(|| ChatLogprobs {
                content: vec![openai::chat_logprob(
                    token,
                    logprob,
                    self.request.top_logprobs,
                )],
            }),
            finish_reason: None,
            stop_reason: None,
        })
    }

    /// Chat: the event after a choice's last token, with an empty delta and the finish reason.
    pub fn finish_chunk(&self, index: u32, finish: Finish) -> Bytes {
        self.chat_chunk(ChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: "",
            },
            logprobs: None,
            finish_reason: Some(finish.as_str()),
            stop_reason: Some(None),
        })
    }

    /// Completions: one token of choice `index`, which starts at character `offset` of its
    /// text. The last token's chunk carries the finish reason, as vLLM sends it.
    pub fn text_chunk(
        &self,
        index: u32,
        offset: u32,
        token: u16,
        logprob: f32,
        finish: Option<Finish>,
    ) -> Bytes {
        let choice = TextChunkChoice {
            index,
            text: text::token_str(token),
            logprobs: self.request.logprobs.then(|| {
                let mut logprobs = TextLogprobs::default();
                logprobs.push(offset, token, logprob, self.request.top_logprobs);
                logprobs
            }),
            finish_reason: finish.map(Finish::as_str),
            stop_reason: None,
        };
        self.chunk([choice], Some(None))
    }

    /// The usage event (`"choices":[]`) sent with `stream_options.include_usage`.
    pub fn usage_chunk(&self) -> Bytes {
        let usage = self.usage();
        let stream_usage = StreamUsage {
            prompt_tokens: usage.prompt_tokens,
            total_tokens: usage.total_tokens,
            completion_tokens: usage.completion_tokens,
        };
        self.chunk([(); 0], Some(Some(stream_usage)))
    }
}
