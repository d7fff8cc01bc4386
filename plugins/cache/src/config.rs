//! The `plugins.cache` config section.

use serde::Deserialize;
use sluice_sdk::{duration, ConfigError, Endpoint};
use std::collections::BTreeMap;
use std::time::Duration;

use crate::store::redis::RedisConfig;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// Off unless asked for: a wrong cache is worse than none.
    #[serde(default)]
    pub enabled: bool,
    /// `memory` (embedded, per proxy) or `redis` (shared).
    #[serde(default)]
    pub store: StoreKind,
    #[serde(default)]
    pub memory: MemoryConfig,
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// Prepended to every key in the store.
    #[serde(default = "default_prefix")]
    pub key_prefix: String,
    /// Request headers whose values become part of the key (e.g. a RAG index version).
    #[serde(default)]
    pub key_headers: Vec<String>,
    #[serde(default)]
    pub tenant: TenantConfig,
    /// Which requests may be cached at all.
    #[serde(default)]
    pub cacheable: Cacheable,
    /// How long an entry lives, unless a rule below says otherwise.
    #[serde(default = "default_ttl", deserialize_with = "duration::deserialize")]
    pub ttl: Duration,
    /// TTL per model (the request's `model` field); wins over `ttl_by_endpoint`.
    #[serde(default)]
    pub ttl_by_model: BTreeMap<String, HumanDuration>,
    /// TTL per endpoint, by its API family's name: `chat` or `completions`.
    #[serde(default)]
    pub ttl_by_endpoint: BTreeMap<String, HumanDuration>,
    /// Answers larger than this (as the upstream sent them) are not stored.
    #[serde(default = "default_max_entry_bytes")]
    pub max_entry_bytes: usize,
    #[serde(default)]
    pub coalesce: CoalesceConfig,
    /// Near-duplicate questions answered from the cache (see [`crate::semantic`]); off when
    /// absent.
    #[serde(default)]
    pub semantic: Option<SemanticConfig>,
}

/// `semantic`: on an exact miss, the question is embedded by `pool` and compared with the
/// stored answers' questions; a neighbour's answer is served only within `max_error_rate`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SemanticConfig {
    /// The pool serving the embedding model (a vLLM with `--runner pooling`).
    pub pool: String,
    /// The most often a semantic hit may be wrong (its answer not the one the model would
    /// have given), as a fraction.
    #[serde(default = "default_max_error_rate")]
    pub max_error_rate: f64,
    /// The model name sent to the pool; by default the first the pool serves.
    #[serde(default)]
    pub model: Option<String>,
    /// Questions less similar than this (cosine) are not neighbours: never served, never
    /// compared.
    #[serde(default = "default_min_similarity")]
    pub min_similarity: f32,
    /// The share of hits within the bound that go upstream anyway, their answer compared
    /// with the neighbour's, so that the bound keeps being checked.
    #[serde(default = "default_verify_rate")]
    pub verify_rate: f64,
    /// How sure the learned bound must be (one-sided).
    #[serde(default = "default_confidence")]
    pub confidence: f64,
    /// The embedding call's deadline; past it the request goes on as an exact miss.
    #[serde(
        default = "default_semantic_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub timeout: Duration,
    /// Tool-calling and agent requests (tools defined, tool calls or results in the turns,
    /// a stored conversation continued) take part too. Off: their answers depend on more
    /// than the question's words.
    /// `true` for every route, or the LLM routes (`chat`, `messages`, ...) that ask for it.
    #[serde(default)]
    pub agent_requests: AgentRequests,
    /// The most the index holds, in bytes (its vectors and their slots); the oldest
    /// questions go first.
    #[serde(default = "default_semantic_max_bytes")]
    pub max_bytes: usize,
    /// Where the questions are indexed: in this process (`memory`), or in the Redis store
    /// beside the exact entries, shared by the replicas (`redis`: Redis with vector search).
    #[serde(default)]
    pub index: IndexKind,
}

/// `semantic.agent_requests`: `true`/`false`, or a list of LLM routes by label.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum AgentRequests {
    All(bool),
    Routes(Vec<String>),
}

impl Default for AgentRequests {
    fn default() -> Self {
        Self::All(false)
    }
}

impl AgentRequests {
    /// Whether an agent's request on `endpoint` takes part.
    pub fn takes(&self, endpoint: Endpoint) -> bool {
        match self {
            Self::All(all) => *all,
            Self::Routes(routes) => routes.iter().any(|r| r == endpoint.label()),
        }
    }
}

/// `semantic.index`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexKind {
    #[default]
    Memory,
    Redis,
}

fn default_max_error_rate() -> f64 {
    0.02
}

fn default_min_similarity() -> f32 {
    0.75
}

fn default_verify_rate() -> f64 {
    0.05
}

fn default_confidence() -> f64 {
    0.95
}

fn default_semantic_timeout() -> Duration {
    Duration::from_secs(1)
}

fn default_semantic_max_bytes() -> usize {
    64 * 1024 * 1024
}

impl SemanticConfig {
    /// Checks what serde cannot; keys are relative to the `semantic` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.max_error_rate > 0.0 && self.max_error_rate < 0.5) {
            return Err(ConfigError::new(
                "max_error_rate",
                "must be more than 0 and less than 0.5",
            ));
        }
        if !(self.min_similarity > 0.0 && self.min_similarity < 1.0) {
            return Err(ConfigError::new(
                "min_similarity",
                "must be more than 0 and less than 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.verify_rate) {
            return Err(ConfigError::new("verify_rate", "must be from 0 to 1"));
        }
        if !(self.confidence >= 0.5 && self.confidence < 1.0) {
            return Err(ConfigError::new(
                "confidence",
                "must be at least 0.5 and less than 1",
            ));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::new("timeout", "must be longer than 0"));
        }
        if let AgentRequests::Routes(routes) = &self.agent_requests {
            for (i, route) in routes.iter().enumerate() {
                if !Endpoint::ALL.iter().any(|e| e.label() == route) {
                    let names: Vec<&str> = Endpoint::ALL.iter().map(|e| e.label()).collect();
                    return Err(ConfigError::new(
                        format!("agent_requests[{i}]"),
                        format!("no LLM route is named `{route}` ({})", names.join(", ")),
                    ));
                }
            }
        }
        if self.max_bytes < 65536 {
            return Err(ConfigError::new(
                "max_bytes",
                "must be at least 65536 (to turn the semantic cache off, remove the section)",
            ));
        }
        Ok(())
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            store: StoreKind::Memory,
            memory: MemoryConfig::default(),
            redis: None,
            key_prefix: default_prefix(),
            key_headers: Vec::new(),
            tenant: TenantConfig::default(),
            cacheable: Cacheable::Deterministic,
            ttl: default_ttl(),
            ttl_by_model: BTreeMap::new(),
            ttl_by_endpoint: BTreeMap::new(),
            max_entry_bytes: default_max_entry_bytes(),
            coalesce: CoalesceConfig::default(),
            semantic: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    #[default]
    Memory,
    Redis,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// The most the memory store holds.
    pub max_bytes: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            max_bytes: 256 * 1024 * 1024,
        }
    }
}

/// Whose entries a request may see. The tenant is the one the `tenants` plugin identified
/// (never a header a client may set); without that plugin, a digest of the request's API key.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantConfig {
    /// Requests without identity (no API key, or the tenants plugin's anonymous tenant).
    pub anonymous: Anonymous,
    /// Let tenants share entries. Off: identical prompts of two tenants never meet.
    pub share_across_tenants: bool,
}

/// What the cache does for requests without identity.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Anonymous {
    /// They neither read nor fill the cache (`x-cache: BYPASS`).
    #[default]
    Bypass,
    /// They share one partition of their own: the operator's choice, for a fleet whose
    /// clients are all one party.
    Share,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Cacheable {
    /// Every request (sampled answers too: one sample is served to all).
    All,
    /// Only requests whose answer is reproducible: temperature 0, or a fixed seed.
    #[default]
    Deterministic,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoalesceConfig {
    /// Identical cacheable requests that arrive while the first is in flight wait for its
    /// answer instead of going upstream again.
    pub enabled: bool,
    /// How long such a request (a follower) waits for an answer. Then it goes upstream itself
    /// if the request it waits for has been in flight that long too; otherwise it gets a 504.
    #[serde(deserialize_with = "duration::deserialize")]
    pub max_wait: Duration,
    /// Followers per key at most; more identical requests go upstream uncoalesced. Each
    /// holds a connection and its body while it waits.
    pub max_followers: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_wait: Duration::from_secs(60),
            max_followers: 64,
        }
    }
}

/// A duration in a map value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct HumanDuration(#[serde(deserialize_with = "duration::deserialize")] pub Duration);

fn default_prefix() -> String {
    "llm:cache:".into()
}

fn default_ttl() -> Duration {
    Duration::from_secs(3600)
}

fn default_max_entry_bytes() -> usize {
    1024 * 1024
}

impl CacheConfig {
    /// Checks what serde cannot (header names are parsed by the builder); keys are relative
    /// to the section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.ttl.is_zero() {
            return Err(ConfigError::new("ttl", "must be longer than 0"));
        }
        for (model, ttl) in &self.ttl_by_model {
            if ttl.0.is_zero() {
                return Err(ConfigError::new(
                    format!("ttl_by_model.{model}"),
                    "must be longer than 0",
                ));
            }
        }
        for name in self.ttl_by_endpoint.keys() {
            if !Endpoint::ALL.iter().any(|e| e.label() == name) {
                let names: Vec<&str> = Endpoint::ALL.iter().map(|e| e.label()).collect();
                return Err(ConfigError::new(
                    format!("ttl_by_endpoint.{name}"),
                    format!("no endpoint is named `{name}` ({})", names.join(", ")),
                ));
            }
        }
        if self.max_entry_bytes == 0 {
            return Err(ConfigError::new("max_entry_bytes", "must be at least 1"));
        }
        if self.memory.max_bytes < 64 * 1024 {
            return Err(ConfigError::new(
                "memory.max_bytes",
                "must be at least 65536",
            ));
        }
        match (self.store, &self.redis) {
            (StoreKind::Redis, None) => {
                return Err(ConfigError::new(
                    "redis",
                    "store: redis needs a redis section",
                ))
            }
            (_, Some(redis)) => redis.validate().map_err(|e| e.under("redis"))?,
            _ => {}
        }
        if self.coalesce.max_wait.is_zero() && self.coalesce.enabled {
            return Err(ConfigError::new(
                "coalesce.max_wait",
                "must be longer than 0",
            ));
        }
        if self.coalesce.max_followers == 0 && self.coalesce.enabled {
            return Err(ConfigError::new(
                "coalesce.max_followers",
                "must be at least 1 (to coalesce nothing, set coalesce.enabled: false)",
            ));
        }
        if let Some(semantic) = &self.semantic {
            semantic.validate().map_err(|e| e.under("semantic"))?;
            if semantic.index == IndexKind::Redis {
                let single_node = self.redis.as_ref().is_some_and(|r| r.url.is_some());
                if self.store != StoreKind::Redis || !single_node {
                    return Err(ConfigError::new(
                        "semantic.index",
                        "redis needs the exact store in Redis on one node (store: redis with \
                         redis.url): its questions point at the shared entries, and \
                         RediSearch's open-source build does not search across a cluster's \
                         shards",
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coalesce(json: &str) -> Result<(), ConfigError> {
        let config = CacheConfig {
            coalesce: serde_json::from_str(json).unwrap(),
            ..CacheConfig::default()
        };
        config.validate()
    }

    #[test]
    fn coalescing_defaults_are_bounded() {
        let defaults = CoalesceConfig::default();
        assert_eq!(defaults.max_followers, 64);
        assert_eq!(defaults.max_wait, Duration::from_secs(60));
        assert!(coalesce("{}").is_ok());
    }

    #[test]
    fn coalescing_needs_room_for_a_follower_when_on() {
        let e = coalesce(r#"{"max_followers": 0}"#).unwrap_err().to_string();
        assert!(e.contains("coalesce.max_followers"), "{e}");
        assert!(e.contains("must be at least 1"), "{e}");
        assert!(coalesce(r#"{"enabled": false, "max_followers": 0}"#).is_ok());
        assert!(coalesce(r#"{"max_followers": 500}"#).is_ok());
    }
}
