//! Pieces of the config a test hands to [`crate::Proxy::start`], as JSON values: keys as
//! conf/README.md documents them, no YAML indentation to count.

use serde::{Serialize, Serializer};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;

/// A `pools[]` entry; goes into `json!` as it is.
#[derive(Debug, Clone)]
pub struct Pool(Map<String, Value>);

/// A pool named `name` serving `models` (none: a catch-all) on `backends`, all else default.
pub fn pool(name: &str, models: &[&str], backends: &[SocketAddr]) -> Pool {
    let backends: Vec<Value> = backends
        .iter()
        .map(|b| json!({"address": b.to_string()}))
        .collect();
    let mut keys = Map::new();
    keys.insert("name".into(), json!(name));
    keys.insert("models".into(), json!(models));
    keys.insert("backends".into(), Value::Array(backends));
    Pool(keys)
}

impl Pool {
    /// Sets the pool's key `key` (e.g. `retry`, `timeouts`) to `value`.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Pool {
        self.0.insert(key.to_string(), value.into());
        self
    }

    /// No health checks: for upstreams that are not vLLM (their probes would get scripted
    /// answers too), and for tests of the request path alone.
    pub fn without_health_checks(self) -> Pool {
        self.with("health", json!({"enabled": false}))
    }

    /// Checks every 100 ms, stale after 1 s: health changes show within a second, so tests
    /// do not wait long.
    pub fn with_fast_health_checks(self) -> Pool {
        self.with(
            "health",
            json!({"interval": "100ms", "timeout": "300ms", "stale_after": "1s"}),
        )
    }
}

impl Serialize for Pool {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// An API key as the config writes it (`tenants[].keys`): `sha256:` and its digest in hex.
pub fn key_digest(key: &str) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())))
}
