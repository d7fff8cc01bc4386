//! Where entries live: [`memory`] (embedded, the default) or [`redis`] (shared by several
//! proxies, single node or Redis Cluster). Both answer lookups through [`Store::get`] and take
//! writes through [`Store::put`], which never waits on the network.

pub mod memory;
pub mod redis;

use crate::entry::Entry;
use async_trait::async_trait;
use std::sync::Arc;
use std::time::Duration;

/// An entry's key: the full SHA-256 digest, and the name it is stored under
/// (`<prefix><hex digest>`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub digest: [u8; 32],
    pub storage_key: String,
}

impl CacheKey {
    pub fn new(prefix: &str, digest: [u8; 32]) -> Self {
        // Built by hand: `format!` with `hex::encode` cost several times this on every
        // request the cache looks up.
        let mut hex = [0u8; 64];
        let mut storage_key = String::with_capacity(prefix.len() + hex.len());
        storage_key.push_str(prefix);
        // Exactly twice the digest's length: encoding cannot fail, and hex is ASCII.
        if hex::encode_to_slice(digest, &mut hex).is_ok() {
            storage_key.push_str(std::str::from_utf8(&hex).unwrap_or_default());
        }
        Self {
            digest,
            storage_key,
        }
    }
}

/// Why a lookup found nothing usable although the store may hold something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The store did not answer within the lookup timeout.
    Timeout,
    /// The store is skipped for a cool-down after repeated failures.
    CoolingDown,
    /// The store answered with an error, or could not be reached.
    Failed(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Timeout => f.write_str("lookup timed out"),
            StoreError::CoolingDown => f.write_str("skipped while cooling down after failures"),
            StoreError::Failed(e) => write!(f, "store error: {e}"),
        }
    }
}

/// What became of a write handed to [`Store::put`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Stored, or queued to be stored.
    Accepted,
    /// The write queue was full: the write was dropped.
    Dropped,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// `memory` or `redis`, for metrics and logs.
    fn name(&self) -> &'static str;

    /// The entry stored under `key`, if any. An entry whose digest differs from `key.digest`
    /// (a hash collision in a store keyed by less than the digest) is a miss.
    async fn get(&self, key: &CacheKey) -> Result<Option<Arc<Entry>>, StoreError>;

    /// Stores `entry` under `key` for `ttl`, or queues the write. Never waits on the network.
    fn put(&self, key: &CacheKey, entry: Arc<Entry>, ttl: Duration) -> WriteOutcome;

    /// Waits, at most `within`, for queued writes to be done: the server is stopping.
    async fn flush(&self, _within: Duration) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_storage_key_is_the_prefix_and_the_digest_in_lowercase_hex() {
        let mut digest = [0u8; 32];
        digest[0] = 0xab;
        digest[31] = 0x0f;
        let key = CacheKey::new("sluice:v1:", digest);
        assert_eq!(
            key.storage_key,
            format!("sluice:v1:ab{}0f", "00".repeat(30))
        );
        assert_eq!(key.digest, digest);
    }
}
