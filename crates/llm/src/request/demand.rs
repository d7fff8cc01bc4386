//! What the balancer, the breaker and the selector know of a request's size: its
//! [`Demand`], estimated once at parse from what the parse counted (no text is read again),
//! and the hash of the prompt's first bytes for prefix affinity.

use super::{Content, LlmRequest, Prompt, Text};

/// What the balancer knows of a request's size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// The prompt's estimated size in tokens (about four characters a token).
    pub prompt_tokens: u64,
    /// The output budget of each sequence (`max_tokens`, or a default when the request
    /// states none).
    pub output_tokens: u64,
    /// A hash of the prompt's first bytes, for prefix affinity.
    pub affinity: Option<u64>,
    /// Sequences the engine generates at once: `max(n, best_of)` (with beam search,
    /// `best_of` is the beam width); 0 counts as 1.
    pub sequences: u32,
    /// A hash of the request's session id, for session affinity (`sluice_pools::Pool::session_key`).
    pub session: Option<u64>,
}

impl Demand {
    /// The KV tokens the request may come to hold: the prompt once (its blocks are shared
    /// by the sequences), every sequence's output.
    pub fn tokens(&self) -> u64 {
        let sequences = u64::from(self.sequences.max(1));
        self.prompt_tokens
            .saturating_add(self.output_tokens.saturating_mul(sequences))
    }

    /// The context one sequence needs (prompt and its output), for a model's
    /// `max_model_len`.
    #[cfg(test)]
    pub fn context_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.output_tokens)
    }
}

/// vLLM's `max_tokens` for a text completion that states none.
pub use crate::family::openai::COMPLETIONS_DEFAULT_MAX_TOKENS;

/// The output budget assumed for a request that states none: vLLM would allow up to the
/// model's context, but most answers are far shorter.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 512;

impl LlmRequest {
    /// What the balancer and the breaker need to know of the request's size; with
    /// `affinity_bytes`, a hash of that many leading bytes of the prompt text.
    pub fn demand(&self, affinity_bytes: Option<usize>) -> Demand {
        Demand {
            prompt_tokens: self.estimated_prompt_tokens() as u64,
            output_tokens: self
                .max_output_tokens()
                .map_or(DEFAULT_OUTPUT_TOKENS, u64::from),
            affinity: affinity_bytes.map(|n| self.prompt_prefix_hash(n)),
            // vLLM generates every candidate (`best_of`, or the beam width) at once and
            // returns `n` of them: each holds its own output's KV blocks.
            sequences: self.n.unwrap_or(1).max(self.best_of.unwrap_or(1)).max(1),
            // From a header, not the body: see `Pool::session_key`.
            session: None,
        }
    }

    /// FNV-1a over the first `limit` bytes of the prompt's text (messages in order, roles
    /// included; token ids as little-endian `u32`s): requests that share a system prompt or a
    /// conversation's start hash alike. Reads no further into the body than it hashes.
    pub fn prompt_prefix_hash(&self, limit: usize) -> u64 {
        let mut prefix = Prefix {
            hash: Fnv1a::default(),
            left: limit,
        };
        if let Some(messages) = &self.messages {
            for m in messages.iter() {
                if !prefix.text(&m.role) {
                    break;
                }
                let more = match &m.content {
                    Some(Content::Text(t)) => prefix.text(t),
                    Some(Content::Parts(parts)) => parts.texts().all(|t| prefix.text(&t)),
                    None => true,
                };
                if !more {
                    break;
                }
            }
        } else {
            match &self.prompt {
                Some(Prompt::Text(t)) => {
                    prefix.text(t);
                }
                Some(Prompt::Texts(ts)) => {
                    if let Some(t) = ts.first() {
                        prefix.text(&t);
                    }
                }
                Some(Prompt::Tokens(ids)) => {
                    for id in ids.ids() {
                        if !prefix.feed(&id.to_le_bytes()) {
                            break;
                        }
                    }
                }
                Some(Prompt::TokenBatches(_)) | None => {}
            }
        }
        prefix.hash.0
    }
}

/// The prefix hash as it is fed: the hash, and the bytes it may still take.
pub(super) struct Prefix {
    pub(super) hash: Fnv1a,
    pub(super) left: usize,
}

impl Prefix {
    /// Hashes what fits of `bytes`; whether more may follow.
    pub(super) fn feed(&mut self, bytes: &[u8]) -> bool {
        let take = bytes.len().min(self.left);
        self.hash.write(bytes.get(..take).unwrap_or_default());
        self.left -= take;
        self.left > 0
    }

    /// Hashes what fits of a text, unescaped, piece by piece; whether more may follow.
    pub(super) fn text(&mut self, text: &Text) -> bool {
        let mut buf = [0u8; 4];
        for piece in text.pieces() {
            if !self.feed(piece.bytes(&mut buf)) {
                return false;
            }
        }
        self.left > 0
    }
}

/// The 64-bit FNV-1a hash: tiny, and stable across processes and releases (unlike std's
/// `DefaultHasher`), so every proxy of a fleet maps a prefix to the same backend.
pub(super) struct Fnv1a(pub(super) u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub(super) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}
