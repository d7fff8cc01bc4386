//! What every plugin's config step shares: one error type that names the key at fault, and
//! parsers for the values plugins hold typed (header names; durations are in
//! [`crate::duration`]).
//!
//! A plugin checks its section in [`crate::PluginBuilder::resolve`] and answers with
//! `ConfigError::new("ttl", "must be longer than 0")`, a key path relative to its section; the
//! core places it under `plugins.<name>` and adds the file, so `sluice -t` prints
//! `conf/sluice.yaml: plugins.cache.ttl: must be longer than 0`.

use http::HeaderName;
use std::fmt;

/// A config value that cannot be used: where (a key path such as `thresholds.standard`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key path, relative to the section that reported it; empty for the whole section.
    pub key: String,
    /// What is wrong with the value, read after the key (`must be longer than 0`).
    pub message: String,
}

impl ConfigError {
    /// An error at `key`, a path relative to the reporting section (empty: the whole section).
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The same error seen from an enclosing section: `under("plugins.cache")` turns
    /// `ttl` into `plugins.cache.ttl`, and `under("redis")` turns `url` into `redis.url`.
    #[must_use]
    pub fn under(self, section: &str) -> Self {
        let key = match (section.is_empty(), self.key.is_empty()) {
            (true, _) => self.key,
            (false, true) => section.to_string(),
            (false, false) => format!("{section}.{}", self.key),
        };
        Self { key, ..self }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.key, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

/// A header name from config, at `key`; parsed once so the request path never looks one up
/// as text.
pub fn header_name(key: &str, value: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(value.as_bytes())
        .map_err(|_| ConfigError::new(key, format!("`{value}` is not a valid header name")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_nest_under_their_sections() {
        let e = ConfigError::new("url", "bad")
            .under("redis")
            .under("plugins.cache");
        assert_eq!(e.key, "plugins.cache.redis.url");
        assert_eq!(e.to_string(), "plugins.cache.redis.url: bad");
        assert_eq!(
            ConfigError::new("", "x").under("plugins.a").key,
            "plugins.a"
        );
    }

    #[test]
    fn header_names_are_checked() {
        assert_eq!(header_name("h", "X-Tenant").unwrap().as_str(), "x-tenant");
        let e = header_name("h", "bad header").unwrap_err();
        assert_eq!(e.key, "h");
        assert!(e
            .message
            .contains("`bad header` is not a valid header name"));
    }
}
