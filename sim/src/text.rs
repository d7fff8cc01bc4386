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
    pub fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    /// A separator so that ["ab","c"] and ["a","bc"] hash differently.
    pub fn sep(&mut self) {
        self.bytes(&[0xff, 0x00]);
    }
    pub fn finish(&self) -> u64 {
        mix(self.0)
    }
}

pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
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

pub fn unit_of(h: u64) -> f64 {
    (mix(h) >> 11) as f64 / (1u64 << 53) as f64
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
        let mut s = String::with_capacity(self.tokens.len() * 7);
        for &t in &self.tokens {
            s.push_str(token_str(t));
        }
        s
    }
}

pub fn token_str(t: u16) -> &'static str {
    VOCAB.get(usize::from(t)).copied().unwrap_or(" the")
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
    let mut h = Hasher::default();
    h.u64(input.prompt_hash);
    h.u64(input.sampling_hash);
    h.u64(u64::from(index));
    let mut rng = Rng::new(h.finish());
    let span = u64::from(input.max_len.saturating_sub(input.min_len)) + 1;
    let natural = input.min_len + (rng.next_u64() % span) as u32;
    let (len, finish) = if input.max_tokens < natural {
        (input.max_tokens, Finish::Length)
    } else {
        (natural, Finish::Stop)
    };
    let (lo, hi) = if input.low_confidence {
        LOW_CONFIDENCE_LOGPROB
    } else {
        CONFIDENT_LOGPROB
    };
    let mut tokens = Vec::with_capacity(len as usize);
    let mut logprobs = Vec::with_capacity(len as usize);
    for _ in 0..len {
        tokens.push((rng.next_u64() % VOCAB.len() as u64) as u16);
        logprobs.push(lo + (hi - lo) * rng.unit() as f32);
    }
    ChoicePlan {
        tokens,
        logprobs,
        finish,
    }
}

/// Alternatives for top_logprobs: the sampled token first, then other words, each less likely.
pub fn top_alternatives(token: u16, logprob: f32, k: u32) -> Vec<(u16, f32)> {
    let mut out = Vec::with_capacity(k as usize);
    if k == 0 {
        return out;
    }
    out.push((token, logprob));
    let n = VOCAB.len() as u32;
    for i in 1..k {
        let alt = ((u32::from(token) + i * 7) % n) as u16;
        out.push((alt, logprob - 1.5 - 0.75 * i as f32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(p: u64, s: u64, max: u32) -> PlanInput {
        PlanInput {
            prompt_hash: p,
            sampling_hash: s,
            max_tokens: max,
            min_len: 8,
            max_len: 64,
            low_confidence: false,
        }
    }

    #[test]
    fn plans_are_deterministic_and_bounded() {
        let a = plan_choice(&input(1, 2, 1000), 0);
        let b = plan_choice(&input(1, 2, 1000), 0);
        assert_eq!(a.tokens, b.tokens);
        assert!(a.tokens.len() >= 8 && a.tokens.len() <= 64);
        assert_eq!(a.finish, Finish::Stop);
        let c = plan_choice(&input(1, 3, 1000), 0);
        assert_ne!(a.tokens, c.tokens);
        let cut = plan_choice(&input(1, 2, 3), 0);
        assert_eq!(cut.tokens.len(), 3);
        assert_eq!(cut.finish, Finish::Length);
        assert_eq!(&cut.tokens[..], &a.tokens[..3]);
    }

    #[test]
    fn token_estimate() {
        assert_eq!(tokens_for_bytes(0), 0);
        assert_eq!(tokens_for_bytes(4), 1);
        assert_eq!(tokens_for_bytes(5), 2);
    }

    #[test]
    fn low_confidence_share_is_roughly_right() {
        let n = (0..10_000u64)
            .filter(|h| is_low_confidence(*h, 0.3))
            .count();
        assert!((2700..3300).contains(&n), "{n}");
        assert!(!(0..100u64).any(|h| is_low_confidence(h, 0.0)));
    }
}
