//! Deterministic text generation: hashes, the vocabulary, answer plans and logprobs.
//!
//! Rules (documented in README.md):
//! - prompt tokens ≈ ceil(chars / 4): completions count the prompt's bytes; chat counts each
//!   message's text bytes plus 16 (≈ 4 tokens of chat template per message); at least 1.
//! - the text of a choice depends on the prompt hash, the sampling hash (temperature, top_p,
//!   top_k, min_p, penalties, and the seed when temperature > 0), and the choice index. With
//!   temperature > 0 and no seed a per-request nonce is mixed in, so answers vary.
//! - natural length = min_answer_tokens + h % (max - min + 1); `max_tokens` below that cuts the
//!   answer with finish_reason "length", else "stop". As vLLM 0.32 counts it, the last token of
//!   a natural end is the EOS token, which has no text.
//! - a stop string ends the answer at the token that completes it; the text stops before it.
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

/// The end-of-sequence token, Llama 3's `<|eot_id|>`: it ends an answer and adds no text.
pub const EOS: u16 = u16::MAX;
/// Its id in the tokenizer, which vLLM 0.32 reports as `stop_reason`.
pub const EOS_TOKEN_ID: u32 = 128_009;
const EOS_TOKEN_STR: &str = "<|eot_id|>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

/// What ended an answer beyond its `finish_reason`: vLLM's `stop_reason`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `null`: cut by `max_tokens`, or (before vLLM 0.32) a plain end of sequence.
    None,
    /// The EOS token, reported by its id.
    Eos,
    /// The stop string that matched.
    Text(String),
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
    /// Indices into VOCAB, or [`EOS`].
    pub tokens: Vec<u16>,
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    pub stop_reason: StopReason,
    /// The answer's text: the tokens' text, cut before a matched stop string.
    text: String,
    /// Per token, how much of `text` a stream has shown once the token is out; `None` when
    /// the token has no chunk of its own and goes out with the next one.
    pub visible: Vec<Option<usize>>,
}

impl ChoicePlan {
    pub fn text(&self) -> String {
        self.text.clone()
    }

    pub fn text_str(&self) -> &str {
        &self.text
    }
}

/// What a token shows in logprobs (`<|eot_id|>` for the EOS token).
pub fn token_str(token: u16) -> &'static str {
    if token == EOS {
        return EOS_TOKEN_STR;
    }
    VOCAB.get(usize::from(token)).copied().unwrap_or(" the")
}

/// What a token adds to the answer's text (nothing for the EOS token).
pub fn token_text(token: u16) -> &'static str {
    if token == EOS {
        ""
    } else {
        token_str(token)
    }
}

pub const CONFIDENT_LOGPROB: (f32, f32) = (-0.18, -0.02);
pub const LOW_CONFIDENCE_LOGPROB: (f32, f32) = (-4.4, -2.6);

/// Whether a prompt produces a low-confidence answer: by prompt hash only.
pub fn is_low_confidence(prompt_hash: u64, share: f64) -> bool {
    share > 0.0 && unit_of(prompt_hash ^ 0x10c0_f1de_0000_0001) < share
}

pub struct PlanInput<'a> {
    pub prompt_hash: u64,
    pub sampling_hash: u64,
    pub max_tokens: u32,
    pub min_len: u32,
    pub max_len: u32,
    pub low_confidence: bool,
    /// vLLM 0.32: the last token of a natural end is the EOS token, and streams show its
    /// detokenizer's quirks (see [`plan_choice`]).
    pub v0_32: bool,
    /// `ignore_eos`: no natural end, the answer runs to `max_tokens`.
    pub ignore_eos: bool,
    /// Stop strings, in the request's order.
    pub stop: &'a [String],
}

/// How a stream shows one token (vLLM 0.32's detokenizer, made deterministic).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// Its text in a chunk of its own.
    Alone,
    /// A chunk with `""`: the token ended inside a UTF-8 character, so its text waits for the
    /// next token's chunk.
    HeldBack,
    /// No chunk: the engine produced it and the next token before the server sent either, so
    /// both share the next chunk.
    Merged,
}

/// One in `QUIRK_ODDS` tokens is held back, and as many are merged with the next.
const QUIRK_ODDS: u64 = 24;

pub fn plan_choice(input: &PlanInput<'_>, index: u32) -> ChoicePlan {
    let mut seed = Hasher::default();
    seed.u64(input.prompt_hash);
    seed.u64(input.sampling_hash);
    seed.u64(u64::from(index));
    let seed = seed.finish();
    let mut rng = Rng::new(seed);
    let span = u64::from(input.max_len.saturating_sub(input.min_len)) + 1;
    let natural = (input.min_len + (rng.next_u64() % span) as u32).max(1);
    let (len, mut finish) = if input.ignore_eos || input.max_tokens < natural {
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
    let mut stop_reason = StopReason::None;
    if finish == Finish::Stop && input.v0_32 {
        // The same draws, so that max_tokens still only cuts the same text.
        if let Some(last) = tokens.last_mut() {
            *last = EOS;
        }
        stop_reason = StopReason::Eos;
    }
    let mut text = String::with_capacity(tokens.len() * 7);
    for &token in &tokens {
        text.push_str(token_text(token));
    }
    if let Some((last_token, cut_at, matched)) = find_stop(&tokens, input.stop) {
        tokens.truncate(last_token + 1);
        logprobs.truncate(last_token + 1);
        text.truncate(cut_at);
        finish = Finish::Stop;
        stop_reason = StopReason::Text(matched.to_string());
    }
    let shown = shown(&tokens, input.v0_32, seed);
    let visible = visible(&tokens, &text, &shown, input.stop);
    ChoicePlan {
        tokens,
        logprobs,
        finish,
        stop_reason,
        text,
        visible,
    }
}

/// The first token whose text completes a stop string, where the text is cut, and the stop
/// string; as vLLM checks them, after each token, the first of the list found winning.
fn find_stop<'a>(tokens: &[u16], stop: &'a [String]) -> Option<(usize, usize, &'a str)> {
    if stop.iter().all(String::is_empty) {
        return None;
    }
    let longest = stop.iter().map(String::len).max().unwrap_or(0);
    let mut text = String::new();
    for (position, &token) in tokens.iter().enumerate() {
        let before = text.len();
        text.push_str(token_text(token));
        // Only a match that ends in this token's text is new.
        let mut from = before.saturating_sub(longest.saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let window = text.get(from..).unwrap_or("");
        for candidate in stop.iter().filter(|candidate| !candidate.is_empty()) {
            if let Some(found) = window.find(candidate.as_str()) {
                return Some((position, from + found, candidate.as_str()));
            }
        }
    }
    None
}

/// Which tokens a stream shows alone, held back or merged: a deterministic draw, never the
/// first token nor the last two, so that an answer's end looks as vLLM's does.
fn shown(tokens: &[u16], quirks: bool, seed: u64) -> Vec<Shown> {
    let mut rng = Rng::new(seed ^ 0x5eed_0f0d_e70c_0001);
    (0..tokens.len())
        .map(|position| {
            let draw = rng.next_u64() % QUIRK_ODDS;
            if !quirks || position == 0 || position + 2 >= tokens.len() {
                Shown::Alone
            } else if draw == 0 {
                Shown::HeldBack
            } else if draw == 1 {
                Shown::Merged
            } else {
                Shown::Alone
            }
        })
        .collect()
}

/// How much text a stream has shown after each token. Until the end, the last characters
/// that could start a stop string are held back, as vLLM's detokenizer does.
fn visible(tokens: &[u16], text: &str, shown: &[Shown], stop: &[String]) -> Vec<Option<usize>> {
    let hold = stop
        .iter()
        .map(|candidate| candidate.chars().count())
        .max()
        .unwrap_or(0)
        .saturating_sub(1);
    let mut produced = 0usize;
    let mut sent = 0usize;
    let mut out = Vec::with_capacity(tokens.len());
    for (position, &token) in tokens.iter().enumerate() {
        produced += token_text(token).len();
        if position + 1 == tokens.len() {
            out.push(Some(text.len()));
            break;
        }
        match shown.get(position).copied().unwrap_or(Shown::Alone) {
            Shown::Merged => out.push(None),
            Shown::HeldBack => out.push(Some(sent)),
            Shown::Alone => {
                let mut end = produced.saturating_sub(hold).min(text.len()).max(sent);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                sent = end.max(sent);
                out.push(Some(sent));
            }
        }
    }
    out
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

    fn input(prompt_hash: u64, sampling_hash: u64, max_tokens: u32) -> PlanInput<'static> {
        PlanInput {
            prompt_hash,
            sampling_hash,
            max_tokens,
            min_len: 8,
            max_len: 64,
            low_confidence: false,
            v0_32: false,
            ignore_eos: false,
            stop: &[],
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
    fn vllm_0_32_ends_with_eos_and_stop_strings() {
        let mut eos = input(1, 2, 1000);
        eos.v0_32 = true;
        let natural = plan_choice(&eos, 0);
        let old = plan_choice(&input(1, 2, 1000), 0);
        // The same draws: the EOS token takes the last one's place and adds no text.
        assert_eq!(natural.tokens.len(), old.tokens.len());
        assert_eq!(natural.tokens.last(), Some(&EOS));
        assert_eq!(natural.stop_reason, StopReason::Eos);
        assert!(old.text().starts_with(natural.text_str()));
        assert_eq!(
            natural.visible.last(),
            Some(&Some(natural.text_str().len()))
        );

        let stop = [" never".to_string(), token_str(old.tokens[3]).to_string()];
        let mut stopped = input(1, 2, 1000);
        stopped.stop = &stop;
        let plan = plan_choice(&stopped, 0);
        let first = old.text().find(&stop[1]).unwrap_or(0);
        assert_eq!(plan.text_str(), &old.text()[..first]);
        assert_eq!(plan.stop_reason, StopReason::Text(stop[1].clone()));
        assert_eq!(plan.finish, Finish::Stop);
        // Until the end a stream holds back what could begin a stop string.
        let hold = stop[1].len() - 1;
        let mut produced = 0;
        for (position, shown) in plan.visible.iter().enumerate() {
            produced += token_text(plan.tokens[position]).len();
            if position + 1 < plan.tokens.len() {
                assert!(shown.unwrap() <= produced.saturating_sub(hold));
            }
        }
    }

    #[test]
    fn stream_quirks_are_rare_and_never_at_the_edges() {
        let mut quirky = input(7, 9, 1000);
        quirky.v0_32 = true;
        quirky.min_len = 400;
        quirky.max_len = 400;
        let plan = plan_choice(&quirky, 0);
        let merged = plan.visible.iter().filter(|shown| shown.is_none()).count();
        let held = plan
            .visible
            .windows(2)
            .filter(|pair| pair[0].is_some() && pair[0] == pair[1])
            .count();
        assert!((5..=40).contains(&merged), "{merged}");
        assert!(held >= 5, "{held}");
        let last = plan.visible.len() - 1;
        assert!(plan.visible[0].is_some() && plan.visible[last - 1].is_some());
        assert_eq!(plan.visible[last], Some(plan.text_str().len()));
        // Without quirks (vLLM before 0.32) every token shows its text at once.
        let plain = plan_choice(&input(7, 9, 1000), 0);
        assert!(plain.visible.iter().all(Option::is_some));
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
