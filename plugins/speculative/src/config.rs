//! The `plugins.speculative` config section.

use serde::Deserialize;
use sluice_sdk::{duration, ConfigError};
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    pub enabled: bool,
    /// The header a client asks for a tier with (`draft` or `target`).
    pub tier_header: String,
    /// Whether clients may force the target pool with that header (`forced`).
    pub allow_forced_target: bool,
    pub models: Vec<ModelConfig>,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            tier_header: sluice_sdk::headers::TIER.as_str().into(),
            allow_forced_target: true,
            models: Vec::new(),
        }
    }
}

/// One served model: the name clients send, its draft pools in order, its target pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub model: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    pub drafts: Vec<DraftConfig>,
    pub target: String,
    /// The longest wait for a draft's response header before the target takes over.
    #[serde(default, deserialize_with = "duration::deserialize_option")]
    pub draft_first_byte_budget: Option<Duration>,
    #[serde(default)]
    pub confidence: ConfidenceConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraftConfig {
    pub pool: String,
    /// Which prompts this draft takes: `any`, or `code` (prompts that look like code).
    #[serde(default)]
    pub when: DraftWhen,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DraftWhen {
    #[default]
    Any,
    Code,
}

/// Escalation on low confidence: non-stream answers of a draft are judged by their tokens'
/// log-probabilities before the client sees them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfidenceConfig {
    pub enabled: bool,
    /// `mean` or `min` log-probability over the window.
    pub measure: MeasureName,
    /// Tokens judged from the start of the answer (0: all).
    pub window: usize,
    /// Escalate below this log-probability.
    pub min_logprob: f64,
    /// Streams: tokens of a draft's stream held back and judged before the client sees any
    /// (the hold-back window). 0, the default: streams are sent as they come, unjudged.
    pub stream_hold_back_tokens: usize,
}

impl Default for ConfidenceConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            measure: MeasureName::Mean,
            window: 32,
            min_logprob: -1.0,
            stream_hold_back_tokens: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MeasureName {
    Mean,
    Min,
}

/// The largest hold-back window: a few seconds of tokens at typical draft speeds.
pub const MAX_HOLD_BACK_TOKENS: usize = 256;

impl SpeculativeConfig {
    /// Checks what serde cannot; keys are relative to the section. Pool names are checked
    /// against the pools when the section is resolved.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.enabled && self.models.is_empty() {
            return Err(ConfigError::new("models", "at least one model is needed"));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let key = format!("models[{i}]");
            for name in std::iter::once(&m.model).chain(&m.aliases) {
                if !names.insert(name.as_str()) {
                    return Err(ConfigError::new(
                        format!("{key}.model"),
                        format!("`{name}` is named twice"),
                    ));
                }
            }
            if m.drafts.is_empty() {
                return Err(ConfigError::new(
                    format!("{key}.drafts"),
                    "at least one draft pool",
                ));
            }
            if m.drafts.iter().any(|d| d.pool == m.target) {
                return Err(ConfigError::new(
                    format!("{key}.target"),
                    "must not also be a draft pool",
                ));
            }
            if m.confidence.min_logprob.is_nan() || m.confidence.min_logprob > 0.0 {
                return Err(ConfigError::new(
                    format!("{key}.confidence.min_logprob"),
                    "must be a log-probability (≤ 0)",
                ));
            }
            if m.confidence.stream_hold_back_tokens > MAX_HOLD_BACK_TOKENS {
                return Err(ConfigError::new(
                    format!("{key}.confidence.stream_hold_back_tokens"),
                    format!("at most {MAX_HOLD_BACK_TOKENS}: the window delays every stream's first byte"),
                ));
            }
        }
        Ok(())
    }
}
