//! The embedded store: TinyUFO (S3-FIFO admission with TinyLFU), the eviction policy behind
//! Pingora's own caches, which keeps frequently used entries over merely recent ones.
//!
//! Bounded by bytes: each entry weighs its size in KiB against `max_bytes`. TinyUFO keys by a
//! 64-bit hash, so the entry's full digest is compared on every hit. Expired entries are
//! dropped when met.

use super::{CacheKey, Store, StoreError, WriteOutcome};
use crate::entry::Entry;
use crate::metrics;
use async_trait::async_trait;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tinyufo::TinyUfo;

/// TinyUFO weighs in `u16`: KiB units make that up to 64 MiB per entry.
const WEIGHT_UNIT: usize = 1024;

#[derive(Clone)]
struct Slot {
    entry: Arc<Entry>,
    expires: Instant,
    weight: u16,
}

pub struct MemoryStore {
    cache: TinyUfo<[u8; 32], Slot>,
    entries: AtomicI64,
    kib: AtomicI64,
}

impl MemoryStore {
    /// A store holding at most `max_bytes` of entries.
    pub fn new(max_bytes: usize) -> Self {
        let units = (max_bytes / WEIGHT_UNIT).max(1);
        // The ghost queue's size: a guess at how many entries fit, assuming ~4 KiB each.
        let estimated_entries = (units / 4).max(64);
        Self {
            cache: TinyUfo::new(units, estimated_entries),
            entries: AtomicI64::new(0),
            kib: AtomicI64::new(0),
        }
    }

    fn account(&self, entries: i64, kib: i64) {
        let e = self.entries.fetch_add(entries, Ordering::Relaxed) + entries;
        let k = self.kib.fetch_add(kib, Ordering::Relaxed) + kib;
        metrics::memory_usage(e.max(0), k.max(0) * WEIGHT_UNIT as i64);
    }

    fn lookup(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        let slot = self.cache.get(&key.digest)?;
        if slot.expires <= Instant::now() {
            if self.cache.remove(&key.digest).is_some() {
                self.account(-1, -i64::from(slot.weight));
            }
            return None;
        }
        // TinyUFO keys by a 64-bit hash of the digest: the whole digest must match.
        (slot.entry.digest == key.digest).then_some(slot.entry)
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn get(&self, key: &CacheKey) -> Result<Option<Arc<Entry>>, StoreError> {
        Ok(self.lookup(key))
    }

    fn put(&self, key: &CacheKey, entry: Arc<Entry>, ttl: Duration) -> WriteOutcome {
        let weight = entry
            .weight()
            .div_ceil(WEIGHT_UNIT)
            .clamp(1, usize::from(u16::MAX)) as u16;
        if let Some(old) = self.cache.remove(&key.digest) {
            self.account(-1, -i64::from(old.weight));
        }
        let slot = Slot {
            entry,
            // A TTL past the clock's range (config allows any) means "never expires" in
            // practice: cap it rather than overflow.
            expires: Instant::now()
                .checked_add(ttl)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)),
            weight,
        };
        let evicted = self.cache.put(key.digest, slot, weight);
        let evicted_kib: i64 = evicted.iter().map(|kv| i64::from(kv.weight)).sum();
        self.account(1 - evicted.len() as i64, i64::from(weight) - evicted_kib);
        WriteOutcome::Accepted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::Endpoint;

    fn entry(digest: [u8; 32], size: usize) -> Arc<Entry> {
        Arc::new(Entry {
            digest,
            created_unix: 0,
            kind: Endpoint::ChatCompletions,
            pool: "p".into(),
            answer: serde_json::value::to_raw_value(&serde_json::json!({"pad": "x".repeat(size)}))
                .unwrap()
                .into(),
            source_bytes: size,
        })
    }

    fn key(n: u8) -> CacheKey {
        CacheKey::new("t:", [n; 32])
    }

    #[tokio::test]
    async fn stores_and_expires() {
        let store = MemoryStore::new(1 << 20);
        store.put(&key(1), entry([1; 32], 10), Duration::from_secs(60));
        store.put(&key(2), entry([2; 32], 10), Duration::from_millis(1));
        assert!(store.get(&key(1)).await.unwrap().is_some());
        std::thread::sleep(Duration::from_millis(5));
        assert!(store.get(&key(2)).await.unwrap().is_none());
        assert!(store.get(&key(3)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_different_digest_under_the_same_key_is_a_miss() {
        let store = MemoryStore::new(1 << 20);
        // Stored under key 1 but made for another prompt: never served for key 1.
        store.put(&key(1), entry([9; 32], 10), Duration::from_secs(60));
        assert!(store.get(&key(1)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn stays_within_its_byte_budget() {
        let store = MemoryStore::new(64 * 1024);
        for n in 0..50u8 {
            store.put(&key(n), entry([n; 32], 8 * 1024), Duration::from_secs(60));
        }
        let kib = store.kib.load(Ordering::Relaxed);
        assert!(kib <= 64 + 9, "{kib} KiB held for a 64 KiB budget");
        assert!(store.entries.load(Ordering::Relaxed) < 50);
    }
}
