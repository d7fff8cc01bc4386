//! Durations in config files, as people write them: `250ms`, `2s`, `5m`, `1h 30m`.
//! Use with `#[serde(deserialize_with = "sluice_sdk::duration::deserialize")]`.

use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// Reads a duration written as text; a bad value is a config error that shows how to write one.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "`{text}` is not a duration ({e}); write it like 250ms, 2s or 5m"
        ))
    })
}

/// The same, for an optional key (`#[serde(default, deserialize_with = ...)]`).
pub fn deserialize_option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    deserialize(d).map(Some)
}
