//! The config sections of the limits: a tenant's `limits` and `budget` (merged over the
//! plugin's `defaults` by [`LimitsConfig::or`] / [`BudgetConfig::or`]), and `limits_store`.

use serde::{Deserialize, Serialize};
use sluice_sdk::redis::{
    default_connect_timeout, default_cooldown, default_failure_threshold, RedisSettings,
};
use sluice_sdk::{duration, ConfigError};
use std::time::Duration;

/// The most tokens per minute a limit may name: far above any real fleet, and low enough that
/// the arithmetic of the Lua script (doubles) stays exact.
const MAX_TOKENS_PER_MINUTE: u64 = 1_000_000_000_000;

/// The largest budget, in dollars: its micro-dollars must stay exact in a Lua double (2^53).
const MAX_USD: f64 = 1_000_000_000.0;

/// A tenant's rate limits; every field optional (`None`: no such limit).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Requests admitted per minute (GCRA: a burst of the whole minute, refilled evenly).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Prompt tokens per minute: estimated at admission, corrected from `usage` afterwards.
    #[serde(default)]
    pub input_tokens_per_minute: Option<u64>,
    /// Completion tokens per minute: `max_tokens` × sequences charged at admission, corrected
    /// from `usage` afterwards.
    #[serde(default)]
    pub output_tokens_per_minute: Option<u64>,
    /// Requests in flight at once (per replica: see the module header).
    #[serde(default)]
    pub max_concurrent: Option<u32>,
}

impl LimitsConfig {
    /// This tenant's section merged over `defaults`, field by field: what the tenant sets wins.
    #[must_use]
    pub fn or(self, defaults: &LimitsConfig) -> LimitsConfig {
        LimitsConfig {
            requests_per_minute: self.requests_per_minute.or(defaults.requests_per_minute),
            input_tokens_per_minute: self
                .input_tokens_per_minute
                .or(defaults.input_tokens_per_minute),
            output_tokens_per_minute: self
                .output_tokens_per_minute
                .or(defaults.output_tokens_per_minute),
            max_concurrent: self.max_concurrent.or(defaults.max_concurrent),
        }
    }

    /// Checks what serde cannot; `key` is this section's path (`tenants.alpha.limits`), and the
    /// error names the field under it.
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let at = |field: &str| ConfigError::new(field, "").under(key).key;
        const ZERO: &str = "must be at least 1 (leave it out for no limit)";
        if self.requests_per_minute == Some(0) {
            return Err(ConfigError::new(at("requests_per_minute"), ZERO));
        }
        if self.max_concurrent == Some(0) {
            return Err(ConfigError::new(at("max_concurrent"), ZERO));
        }
        for (field, value) in [
            ("input_tokens_per_minute", self.input_tokens_per_minute),
            ("output_tokens_per_minute", self.output_tokens_per_minute),
        ] {
            match value {
                Some(0) => return Err(ConfigError::new(at(field), ZERO)),
                Some(n) if n > MAX_TOKENS_PER_MINUTE => {
                    return Err(ConfigError::new(
                        at(field),
                        format!("must be at most {MAX_TOKENS_PER_MINUTE}"),
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether any per-minute limit is set (concurrency aside).
    pub(crate) fn has_rates(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.input_tokens_per_minute.is_some()
            || self.output_tokens_per_minute.is_some()
    }
}

/// What a spent budget does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetMode {
    /// Refuse with 429 `budget-exceeded` once the day's or the month's budget is spent.
    #[default]
    Enforce,
    /// Count the spend and the admissions over budget, never refuse.
    Shadow,
}

impl BudgetMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BudgetMode::Enforce => "enforce",
            BudgetMode::Shadow => "shadow",
        }
    }
}

/// A tenant's spend limits, in dollars per UTC calendar day and month.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// Dollars per UTC day. Default: none.
    #[serde(default)]
    pub usd_per_day: Option<f64>,
    /// Dollars per UTC calendar month. Default: none.
    #[serde(default)]
    pub usd_per_month: Option<f64>,
    /// `enforce` (default) or `shadow`.
    #[serde(default)]
    pub mode: Option<BudgetMode>,
}

impl BudgetConfig {
    /// This tenant's section merged over `defaults`, field by field: what the tenant sets wins.
    #[must_use]
    pub fn or(self, defaults: &BudgetConfig) -> BudgetConfig {
        BudgetConfig {
            usd_per_day: self.usd_per_day.or(defaults.usd_per_day),
            usd_per_month: self.usd_per_month.or(defaults.usd_per_month),
            mode: self.mode.or(defaults.mode),
        }
    }

    /// Checks what serde cannot; `key` is this section's path, as for [`LimitsConfig::validate`].
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        for (field, value) in [
            ("usd_per_day", self.usd_per_day),
            ("usd_per_month", self.usd_per_month),
        ] {
            if let Some(usd) = value {
                if !(usd.is_finite() && usd > 0.0 && usd <= MAX_USD) {
                    return Err(ConfigError::new(
                        ConfigError::new(field, "").under(key).key,
                        format!(
                            "must be more than 0 and at most {MAX_USD} (leave it out for no budget)"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn mode(&self) -> BudgetMode {
        self.mode.unwrap_or_default()
    }

    pub(crate) fn is_set(&self) -> bool {
        self.usd_per_day.is_some() || self.usd_per_month.is_some()
    }
}

/// Where the limits' state lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// In this process: each replica limits on its own.
    #[default]
    Local,
    /// In Redis (or Redis Cluster), shared by every replica pointed at it.
    Redis,
}

/// What an admission does when Redis cannot answer (error, timeout, cool-down).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRedisError {
    /// Fall back to this replica's own buckets (the default): each replica admits up to the
    /// tenant's limits by itself until Redis answers again, so N replicas let in at most N
    /// times the limit, never an unlimited flood. Counted in
    /// `sluice_tenant_limit_store_errors_total`.
    #[default]
    Local,
    /// Fail open: admit without the shared limits, counted in
    /// `sluice_tenant_limit_store_errors_total`.
    Allow,
    /// Fail closed: refuse with 503 `rate-limited` and `retry-after`.
    Deny,
}

/// `limits_store.redis`: where the shared limits live and how long an admission may wait.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// A single node, `redis://host:port`. Exactly one of `url` and `cluster_nodes` is set.
    #[serde(default, deserialize_with = "sluice_sdk::redis::url")]
    pub url: Option<String>,
    /// Redis Cluster seed nodes; the rest of the cluster is discovered from them.
    #[serde(default, deserialize_with = "sluice_sdk::redis::urls")]
    pub cluster_nodes: Vec<String>,
    /// The longest an admission waits on Redis before `on_redis_error` applies. Default `50ms`.
    #[serde(
        default = "default_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub timeout: Duration,
    /// Bounds each connection attempt and each correction after an answer. Default `1s`.
    #[serde(
        default = "default_connect_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub connect_timeout: Duration,
    /// Prefix of every key; a tenant's keys are `<prefix>{<tenant>}:...`, the braces keeping
    /// them on one Cluster slot. Default `sluice:limits:`.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// Consecutive failures after which Redis is not asked for `cooldown`. Default 3.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// How long Redis is skipped (each admission then follows `on_redis_error` at once);
    /// the first admission after it probes. Default `5s`.
    #[serde(
        default = "default_cooldown",
        deserialize_with = "duration::deserialize"
    )]
    pub cooldown: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_millis(50)
}
fn default_key_prefix() -> String {
    "sluice:limits:".to_string()
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            cluster_nodes: Vec::new(),
            timeout: default_timeout(),
            connect_timeout: default_connect_timeout(),
            key_prefix: default_key_prefix(),
            failure_threshold: default_failure_threshold(),
            cooldown: default_cooldown(),
        }
    }
}

impl RedisConfig {
    /// Keys relative to this section.
    fn validate(&self) -> Result<(), ConfigError> {
        self.settings().validate("timeout")?;
        if self.key_prefix.is_empty() {
            return Err(ConfigError::new(
                "key_prefix",
                "must not be empty (keys would mix with the database's others)",
            ));
        }
        Ok(())
    }

    /// The keys every plugin's Redis section shares, `timeout` as the request timeout.
    pub(crate) fn settings(&self) -> RedisSettings {
        RedisSettings {
            url: self.url.clone(),
            cluster_nodes: self.cluster_nodes.clone(),
            timeout: self.timeout,
            connect_timeout: self.connect_timeout,
            failure_threshold: self.failure_threshold,
            cooldown: self.cooldown,
        }
    }
}

/// The plugin's `limits_store` section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `local` (default) or `redis`.
    #[serde(default)]
    pub kind: StoreKind,
    /// Required with `kind: redis`, refused otherwise.
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// `local` (default: this replica's own buckets), `allow` (fail open) or `deny` (503);
    /// each counted.
    #[serde(default)]
    pub on_redis_error: OnRedisError,
}

impl StoreConfig {
    /// Checks what serde cannot; keys are relative to `limits_store`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match (self.kind, &self.redis) {
            (StoreKind::Redis, None) => Err(ConfigError::new(
                "redis",
                "is required with kind: redis (url or cluster_nodes)",
            )),
            (StoreKind::Redis, Some(redis)) => redis.validate().map_err(|e| e.under("redis")),
            (StoreKind::Local, Some(_)) => Err(ConfigError::new(
                "redis",
                "is only read with kind: redis; set the kind or remove the section",
            )),
            (StoreKind::Local, None) => Ok(()),
        }
    }
}
