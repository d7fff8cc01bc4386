//! Deterministic text generation: hashes, the vocabulary, answer plans and logprobs.
//!
//! Rules (documented in README.md):
//! - prompt tokens ≈ ceil(chars / 4): completions count the prompt's bytes; chat counts each
//!   message's text bytes plus 16 (≈ 4 tokens of chat template per message); at least 1.
//! - the text of a choice depends on the prompt hash, the sampling hash (temperature, top_p,
//!   top_k, min_p, penalties, and the seed when temperature > 0), and the choice index. With
//!   temperature > 0 and no seed a per-request nonce is mixed in, so answers vary.
//! - natural length = min_answer_tokens + h % (max - min + 1); `max_tokens` below that cuts the
//!   answer with finish_reason "length", else "stop".
//! - logprobs: confident answers draw each token's logprob uniformly from [-0.18, -0.02]
//!   (mean ≈ -0.10); low-confidence answers from [-4.4, -2.6] (mean ≈ -3.5). Whether a prompt is
//!   low-confidence depends on the prompt hash only (share = `low_confidence_share`).

/// One token per word, each with a leading space.
pub const VOCAB: &[&str] = &[
    " the",
    " model",
    " answer",
    " is",
    " a",
    " simple",
    " token",
    " stream",
    " of",
    " words",
    " that",
    " looks",
    " like",
    " text",
    " from",
    " an",
    " engine",
    " with",
    " cache",
    " blocks",
    " and",
    " queue",
    " latency",
    " for",
    " each",
    " request",
    " in",
    " order",
    " to",
    " test",
    " proxy",
    " edge",
    " server",
    " response",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " lazy",
    " dog",
    " Paris",
    " capital",
    " France",
    " city",
    " river",
    " light",
    " data",
    " value",
    " number",
    " time",
    " first",
    " last",
    " next",
    " good",
    " fast",
    " slow",
    " high",
    " low",
    " open",
    " close",
    " GPU",
    " memory",
    " batch",
];

/// FNV-1a over bytes, finished with a splitmix round so nearby inputs spread well.
#[derive(Clone, Copy, Debug)]
pub struct Hasher(u64);

impl Default for Hasher {
    fn default() -> Self {
        Hasher(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher {
    pub fn bytes(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub fn u64(&mut self, value: u64) {
        self.bytes(&value.to_le_bytes());
    }
    /// A separator so that ["ab","c"] and ["a","bc"] hash differently.
    pub fn separator(&mut self) {
        self.bytes(&[0xff, 0x00]);
    }
    /// The old name of [`Hasher::separator`], kept because `text` is public.
    #[deprecated(note = "renamed to `separator`")]
    pub fn sep(&mut self) {
        self.separator();
    }
    pub fn finish(&self) -> u64 {
        mix(self.0)
    }
}

/// splitmix64's finaliser: spreads every input bit over the whole output.
pub fn mix(mut state: u64) -> u64 {
    state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    state = (state ^ (state >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    state = (state ^ (state >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    state ^ (state >> 31)
}

/// splitmix64: tiny, fast, reproducible.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A hash mapped uniformly to [0, 1).
pub fn unit_of(hash: u64) -> f64 {
    (mix(hash) >> 11) as f64 / (1u64 << 53) as f64
}

/// Token estimate for a byte count: ceil(bytes / 4).
pub fn tokens_for_bytes(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(4)).unwrap_or(u32::MAX)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The planned output of one choice.
#[derive(Clone, Debug)]
pub struct ChoicePlan {
    /// Indices into VOCAB.
    pub tokens: Vec<u16>,
    pub logprobs: Vec<f32>,
    pub finish: Finish,
}

impl ChoicePlan {
    pub fn text(&self) -> String {
        let mut text = String::with_capacity(self.tokens.len() * 7);
        for &token in &self.tokens {
            text.push_str(token_str(token));
        }
        text
    }
}

pub fn token_str(token: u16) -> &'static str {
    VOCAB.get(usize::from(token)).copied().unwrap_or(" the")
}

pub const CONFIDENT_LOGPROB: (f32, f32) = (-0.18, -0.02);
pub const LOW_CONFIDENCE_LOGPROB: (f32, f32) = (-4.4, -2.6);

/// Whether a prompt produces a low-confidence answer: by prompt hash only.
pub fn is_low_confidence(prompt_hash: u64, share: f64) -> bool {
    share > 0.0 && unit_of(prompt_hash ^ 0x10c0_f1de_0000_0001) < share
}

pub struct PlanInput {
    pub prompt_hash: u64,
    pub sampling_hash: u64,
    pub max_tokens: u32,
    pub min_len: u32,
    pub max_len: u32,
    pub low_confidence: bool,
}

pub fn plan_choice(input: &PlanInput, index: u32) -> ChoicePlan {
    let mut seed = Hasher::default();
    seed.u64(input.prompt_hash);
    seed.u64(input.sampling_hash);
    seed.u64(u64::from(index));
    let mut rng = Rng::new(seed.finish());
    let span = u64::from(input.max_len.saturating_sub(input.min_len)) + 1;
    let natural = input.min_len + (rng.next_u64() % span) as u32;
    let (len, finish) = if input.max_tokens < natural {
        (input.max_tokens, Finish::Length)
    } else {
        (natural, Finish::Stop)
    };
    let (lowest, highest) = if input.low_confidence {
        LOW_CONFIDENCE_LOGPROB
    } else {
        CONFIDENT_LOGPROB
    };
    let mut tokens = Vec::with_capacity(len as usize);
    let mut logprobs = Vec::with_capacity(len as usize);
    for _ in 0..len {
        tokens.push((rng.next_u64() % VOCAB.len() as u64) as u16);
        logprobs.push(lowest + (highest - lowest) * rng.unit() as f32);
    }
    ChoicePlan {
        tokens,
        logprobs,
        finish,
    }
}

/// Alternatives for top_logprobs: the sampled token first, then other words, each less likely.
pub fn top_alternatives(token: u16, logprob: f32, count: u32) -> Vec<(u16, f32)> {
    let mut out = Vec::with_capacity(count as usize);
    if count == 0 {
        return out;
    }
    out.push((token, logprob));
    let vocab_size = VOCAB.len() as u32;
    for rank in 1..count {
        let alternative = ((u32::from(token) + rank * 7) % vocab_size) as u16;
        out.push((alternative, logprob - 1.5 - 0.75 * rank as f32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(prompt_hash: u64, sampling_hash: u64, max_tokens: u32) -> PlanInput {
        PlanInput {
            prompt_hash,
            sampling_hash,
            max_tokens,
            min_len: 8,
            max_len: 64,
            low_confidence: false,
        }
    }

    #[test]
    fn plans_are_deterministic_and_bounded() {
        let first = plan_choice(&input(1, 2, 1000), 0);
        let again = plan_choice(&input(1, 2, 1000), 0);
        assert_eq!(first.tokens, again.tokens);
        assert!(first.tokens.len() >= 8 && first.tokens.len() <= 64);
        assert_eq!(first.finish, Finish::Stop);
        let other_sampling = plan_choice(&input(1, 3, 1000), 0);
        assert_ne!(first.tokens, other_sampling.tokens);
        let cut = plan_choice(&input(1, 2, 3), 0);
        assert_eq!(cut.tokens.len(), 3);
        assert_eq!(cut.finish, Finish::Length);
        assert_eq!(&cut.tokens[..], &first.tokens[..3]);
    }

    #[test]
    fn token_estimate() {
        assert_eq!(tokens_for_bytes(0), 0);
        assert_eq!(tokens_for_bytes(4), 1);
        assert_eq!(tokens_for_bytes(5), 2);
    }

    #[test]
    fn low_confidence_share_is_roughly_right() {
        let low = (0..10_000u64)
            .filter(|hash| is_low_confidence(*hash, 0.3))
            .count();
        assert!((2700..3300).contains(&low), "{low}");
        assert!(!(0..100u64).any(|hash| is_low_confidence(hash, 0.0)));
    }
}
