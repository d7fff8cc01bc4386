//! The `plugins.tenants` config section.

use crate::limits::{BudgetConfig, LimitsConfig, StoreConfig};
use serde::Deserialize;
use sluice_sdk::{duration, ConfigError, Priority};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantsConfig {
    pub enabled: bool,
    /// What every tenant gets unless its own section says otherwise.
    pub defaults: Policy,
    /// By name: each tenant's keys (as `sha256:<hex>` digests) and what differs from `defaults`.
    pub tenants: BTreeMap<String, Policy>,
    /// Requests without a key: refused with 401 when absent; else let in as the tenant
    /// `anonymous`, with this policy (limits of its own, say). An operator's explicit choice.
    pub anonymous: Option<Policy>,
    /// Addresses or CIDRs of the proxies in front whose `tenant_header` is trusted.
    pub trusted_proxies: Vec<String>,
    /// A header naming the tenant, set by a trusted proxy that authenticated the client
    /// itself; from anyone else it is ignored.
    pub tenant_header: Option<String>,
    /// Keys kept in Redis, so they can be added and revoked without a reload.
    pub keys_from_redis: Option<RedisKeys>,
    /// Where the limits' counters live: in this process, or in Redis shared by replicas.
    pub limits_store: StoreConfig,
    /// The 401's message for a key no tenant has; absent: OpenAI's wording. Where to get a key,
    /// say (the demo names its own keys here).
    pub unknown_key_message: Option<String>,
}

/// What a tenant may ask for, and how much. Every field is optional: a tenant's section is
/// laid over `defaults`, field by field.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// The tenant's API keys, each as `sha256:<64 hex digits>` (`sluice hash-key` prints one).
    /// Only in a tenant's section.
    pub keys: Vec<String>,
    /// The models it may ask for; absent: all.
    pub models: Option<Vec<String>>,
    pub priority: PriorityPolicy,
    /// Whether it may force the target tier of a speculative model (`x-sluice-tier: target`).
    pub may_force_target: Option<bool>,
    /// The most output tokens one request may ask for (`max_tokens` or
    /// `max_completion_tokens`, per sequence); a request without either gets this.
    pub max_tokens: Option<u32>,
    /// What happens to a request over `max_tokens`: `clamp` (the default) or `refuse`.
    pub over_max_tokens: Option<OverMaxTokens>,
    pub limits: LimitsConfig,
    pub budget: BudgetConfig,
    /// The time to first token its requests aim at when they name none
    /// (`x-sluice-ttft-slo-ms`): `2s`, `500ms`.
    #[serde(default, deserialize_with = "duration::deserialize_option")]
    pub ttft_slo: Option<Duration>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityPolicy {
    /// The class of its requests that name none.
    pub default: Option<Priority>,
    /// The highest class its requests may claim.
    pub max: Option<Priority>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OverMaxTokens {
    /// Lowered to the ceiling, and sent on.
    #[default]
    Clamp,
    /// Refused with 400.
    Refuse,
}

/// A Redis hash of key digests (`sha256:<hex>` → tenant name), read every `refresh`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisKeys {
    /// `redis://host:port/db` (or `{from_env: VAR}`, `{from_file: path}`).
    #[serde(deserialize_with = "sluice_sdk::redis::required_url")]
    pub url: String,
    /// The hash's name.
    #[serde(default = "default_hash")]
    pub hash: String,
    /// How often it is read: a key added or revoked takes effect within this.
    #[serde(
        default = "default_refresh",
        deserialize_with = "duration::deserialize"
    )]
    pub refresh: Duration,
}

fn default_hash() -> String {
    "sluice:tenant-keys".into()
}

fn default_refresh() -> Duration {
    Duration::from_secs(5)
}

/// How a key is written in the config: its SHA-256, never the key itself.
pub const DIGEST_PREFIX: &str = "sha256:";

impl Policy {
    /// This section over `defaults`, field by field (keys are the tenant's own).
    pub fn over(&self, defaults: &Policy) -> Policy {
        Policy {
            keys: self.keys.clone(),
            models: self.models.clone().or_else(|| defaults.models.clone()),
            priority: PriorityPolicy {
                default: self.priority.default.or(defaults.priority.default),
                max: self.priority.max.or(defaults.priority.max),
            },
            may_force_target: self.may_force_target.or(defaults.may_force_target),
            max_tokens: self.max_tokens.or(defaults.max_tokens),
            over_max_tokens: self.over_max_tokens.or(defaults.over_max_tokens),
            limits: self.limits.clone().or(&defaults.limits),
            budget: self.budget.clone().or(&defaults.budget),
            ttft_slo: self.ttft_slo.or(defaults.ttft_slo),
        }
    }

    /// Checks what serde cannot; `key` is the section's path, relative to the plugin's.
    fn validate(&self, key: &str, may_have_keys: bool) -> Result<(), ConfigError> {
        if !may_have_keys && !self.keys.is_empty() {
            return Err(ConfigError::new(
                format!("{key}.keys"),
                "keys belong to a tenant's own section",
            ));
        }
        for (i, k) in self.keys.iter().enumerate() {
            digest_of(k)
                .map_err(|message| ConfigError::new(format!("{key}.keys[{i}]"), message))?;
        }
        if let (Some(default), Some(max)) = (self.priority.default, self.priority.max) {
            if default > max {
                return Err(ConfigError::new(
                    format!("{key}.priority.default"),
                    format!(
                        "must not be above priority.max ({} > {})",
                        default.as_str(),
                        max.as_str()
                    ),
                ));
            }
        }
        if self.max_tokens == Some(0) {
            return Err(ConfigError::new(
                format!("{key}.max_tokens"),
                "must be at least 1",
            ));
        }
        self.limits.validate(&format!("{key}.limits"))?;
        self.budget.validate(&format!("{key}.budget"))
    }
}

/// How `key` is written in the config: `sha256:<64 hex digits>` (what `sluice hash-key`
/// prints).
pub fn written_digest(key: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, key);
    format!("{DIGEST_PREFIX}{}", hex::encode(digest))
}

/// The 32 bytes of a configured key digest (`sha256:<64 hex digits>`).
pub fn digest_of(written: &str) -> Result<[u8; 32], String> {
    let Some(hex_digits) = written.strip_prefix(DIGEST_PREFIX) else {
        return Err(
            "must be a key's SHA-256 digest, `sha256:<64 hex digits>`, never the key itself: \
             `sluice hash-key` prints one"
                .into(),
        );
    };
    let mut digest = [0u8; 32];
    hex::decode_to_slice(hex_digits, &mut digest)
        .map_err(|_| "must be `sha256:` followed by 64 hex digits".to_string())?;
    Ok(digest)
}

impl TenantsConfig {
    /// Checks what serde cannot; keys are relative to the section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.defaults.validate("defaults", false)?;
        if let Some(anonymous) = &self.anonymous {
            anonymous.validate("anonymous", false)?;
        }
        let mut owners = BTreeMap::new();
        for (name, tenant) in &self.tenants {
            let key = format!("tenants.{name}");
            if name.is_empty() || name == sluice_sdk::Tenant::ANONYMOUS {
                return Err(ConfigError::new(
                    key,
                    "is not a tenant name (`anonymous` is the `anonymous` section's)",
                ));
            }
            tenant.validate(&key, true)?;
            for (i, written) in tenant.keys.iter().enumerate() {
                if let Some(other) = owners.insert(written.to_ascii_lowercase(), name) {
                    return Err(ConfigError::new(
                        format!("{key}.keys[{i}]"),
                        format!("is tenant `{other}`'s key too"),
                    ));
                }
            }
        }
        if self.tenant_header.is_some() && self.trusted_proxies.is_empty() {
            return Err(ConfigError::new(
                "trusted_proxies",
                "is needed with tenant_header: the header is trusted only from these addresses",
            ));
        }
        if let Some(redis) = &self.keys_from_redis {
            if !redis.url.starts_with("redis://") {
                return Err(ConfigError::new(
                    "keys_from_redis.url",
                    "must be a redis:// URL",
                ));
            }
            if redis.refresh < Duration::from_millis(100) {
                return Err(ConfigError::new(
                    "keys_from_redis.refresh",
                    "must be at least 100ms",
                ));
            }
        }
        self.limits_store
            .validate()
            .map_err(|e| e.under("limits_store"))
    }
}
