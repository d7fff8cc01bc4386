//! The `plugins.kv_breaker` config section.

use serde::Deserialize;
use sluice_sdk::{duration, ConfigError, Priority, StaleAs};
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvBreakerConfig {
    pub enabled: bool,
    /// When a request's preferred pool sheds it, send it to another pool that serves its
    /// model and still admits it, before answering 503.
    pub reroute: bool,
    /// Per class: shed above `shed_above`, admit again below `resume_below`.
    pub thresholds: Thresholds,
    pub priority: PriorityConfig,
    /// A bounded wait for capacity before a request is shed.
    pub queue: QueueConfig,
    /// How a backend whose metrics are stale (unreachable, or a page that cannot be read)
    /// counts: `unknown` (left out: a pool is not shed because its monitoring broke) or
    /// `saturated` (as a full KV cache: fail closed).
    pub stale_as: StaleAs,
    /// The status a shed request is answered with: 503 (the default), or 429 or 529 for
    /// fleets whose clients expect those for "overloaded". "No healthy backend" stays 503.
    pub overload_status: u16,
    /// Sheddable requests dropped with a probability that rises with the pool's projected
    /// KV usage (with the request): 0 at `from`, 1 at `to`; absent: shed at its threshold
    /// only.
    pub graded_shedding: Option<GradedShedding>,
    /// Bounds of the `retry-after` given with a 503.
    #[serde(deserialize_with = "duration::deserialize")]
    pub min_retry_after: Duration,
    #[serde(deserialize_with = "duration::deserialize")]
    pub max_retry_after: Duration,
}

impl Default for KvBreakerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            reroute: true,
            overload_status: 503,
            thresholds: Thresholds::default(),
            priority: PriorityConfig::default(),
            queue: QueueConfig::default(),
            stale_as: StaleAs::Unknown,
            graded_shedding: None,
            min_retry_after: Duration::from_secs(1),
            max_retry_after: Duration::from_secs(30),
        }
    }
}

/// The curve of graded shedding: the chance a sheddable request is dropped, linear in the
/// projected KV usage between `from` (0) and `to` (1).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GradedShedding {
    pub from: f64,
    pub to: f64,
}

impl GradedShedding {
    /// The chance of a drop at projected usage `usage`.
    pub fn probability(&self, usage: f64) -> f64 {
        ((usage - self.from) / (self.to - self.from)).clamp(0.0, 1.0)
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Threshold {
    /// Projected KV-cache usage (0..1) at which this class starts being shed.
    pub shed_above: f64,
    /// Usage below which it is admitted again (hysteresis: at most `shed_above`).
    pub resume_below: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Thresholds {
    pub sheddable: Threshold,
    pub standard: Threshold,
    pub critical: Threshold,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            sheddable: Threshold {
                shed_above: 0.75,
                resume_below: 0.70,
            },
            standard: Threshold {
                shed_above: 0.85,
                resume_below: 0.80,
            },
            critical: Threshold {
                shed_above: 0.95,
                resume_below: 0.90,
            },
        }
    }
}

impl Thresholds {
    pub fn of(&self, priority: Priority) -> Threshold {
        match priority {
            Priority::Sheddable => self.sheddable,
            Priority::Standard => self.standard,
            Priority::Critical => self.critical,
        }
    }
}

/// The admission queue: a request its pool cannot admit waits up to its class's `max_wait`
/// for capacity, highest class first, before it is answered `queue-timeout`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// `false`: a request the pool cannot admit is shed at once.
    pub enabled: bool,
    pub max_wait: MaxWait,
    /// Waiting requests per pool; a request that finds the queue full is refused at once
    /// (`queue-full`). Each holds its connection and body while it waits.
    pub max_queued: usize,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_wait: MaxWait::default(),
            max_queued: 256,
        }
    }
}

/// The longest wait per class; 0 for no wait.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MaxWait {
    #[serde(deserialize_with = "duration::deserialize")]
    pub sheddable: Duration,
    #[serde(deserialize_with = "duration::deserialize")]
    pub standard: Duration,
    #[serde(deserialize_with = "duration::deserialize")]
    pub critical: Duration,
}

impl Default for MaxWait {
    fn default() -> Self {
        // Sheddable work is what gives way in a burst: it is refused at once.
        Self {
            sheddable: Duration::ZERO,
            standard: Duration::from_secs(2),
            critical: Duration::from_secs(2),
        }
    }
}

impl MaxWait {
    pub fn of(&self, priority: Priority) -> Duration {
        match priority {
            Priority::Sheddable => self.sheddable,
            Priority::Standard => self.standard,
            Priority::Critical => self.critical,
        }
    }
}

/// The longest `queue.max_wait` accepted: a client waiting longer has long given up.
const MAX_QUEUE_WAIT: Duration = Duration::from_secs(60);

/// How a request's class is decided: the header, else the tenant's default, else `default`;
/// then capped by the tenant's highest class, else by `max`. Tenants come from the `tenants`
/// plugin.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    pub header: String,
    pub default: Priority,
    /// The highest class a client may ask for by header.
    pub max: Priority,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        Self {
            header: sluice_sdk::headers::PRIORITY.as_str().into(),
            default: Priority::Standard,
            max: Priority::Critical,
        }
    }
}

impl KvBreakerConfig {
    /// Checks what serde cannot; keys are relative to the section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for p in Priority::ALL {
            let t = self.thresholds.of(p);
            let key = format!("thresholds.{}", p.as_str());
            if !(t.shed_above > 0.0 && t.shed_above <= 1.5) {
                return Err(ConfigError::new(
                    format!("{key}.shed_above"),
                    format!("must be above 0 and at most 1.5 (got {})", t.shed_above),
                ));
            }
            if !(t.resume_below > 0.0 && t.resume_below <= t.shed_above) {
                return Err(ConfigError::new(
                    format!("{key}.resume_below"),
                    format!(
                        "must be above 0 and at most {key}.shed_above ({} > {})",
                        t.resume_below, t.shed_above
                    ),
                ));
            }
        }
        let t = &self.thresholds;
        if !(t.sheddable.shed_above <= t.standard.shed_above
            && t.standard.shed_above <= t.critical.shed_above)
        {
            return Err(ConfigError::new(
                "thresholds",
                "shed_above must not decrease from sheddable to standard to critical",
            ));
        }
        if let Some(g) = &self.graded_shedding {
            if !(g.from >= 0.0 && g.from < g.to && g.to <= 1.5) {
                return Err(ConfigError::new(
                    "graded_shedding",
                    format!(
                        "needs 0 ≤ from < to ≤ 1.5 (got from {}, to {})",
                        g.from, g.to
                    ),
                ));
            }
        }
        if self.min_retry_after.is_zero() || self.max_retry_after < self.min_retry_after {
            return Err(ConfigError::new(
                "max_retry_after",
                "min_retry_after must be above 0 and at most max_retry_after",
            ));
        }
        if !matches!(self.overload_status, 429 | 503 | 529) {
            return Err(ConfigError::new(
                "overload_status",
                format!("must be 503, 429 or 529 (got {})", self.overload_status),
            ));
        }
        for p in Priority::ALL {
            if self.queue.max_wait.of(p) > MAX_QUEUE_WAIT {
                return Err(ConfigError::new(
                    format!("queue.max_wait.{}", p.as_str()),
                    format!("must be at most {}s", MAX_QUEUE_WAIT.as_secs()),
                ));
            }
        }
        if !(1..=100_000).contains(&self.queue.max_queued) {
            return Err(ConfigError::new(
                "queue.max_queued",
                format!(
                    "must be between 1 and 100000 (got {})",
                    self.queue.max_queued
                ),
            ));
        }
        Ok(())
    }
}
