//! Who is calling: a request's API key, by its SHA-256 digest, names its tenant. Keys come from
//! the config file and, optionally, from a Redis hash read every `refresh`, so keys can be
//! added and revoked without a reload. Only digests are kept, compared and logged about:
//! never a key.
//!
//! A Redis key names a tenant of the config file (its policy and limits are there); a digest
//! naming another tenant is skipped and logged once per read.

use crate::config::{digest_of, RedisKeys};
use arc_swap::ArcSwap;
use redis::AsyncCommands;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// A key's digest.
pub type KeyDigest = [u8; 32];

/// Digests to tenants, hashed by the digest's first eight bytes.
type DigestMap<T> = HashMap<KeyDigest, T, BuildHasherDefault<DigestHasher>>;

/// A digest is already uniform: hashing it again with std's SipHash, on every request, buys
/// no spread. Nor is there flooding to defend against: these maps hold only the operator's
/// keys, and a client's key is only looked up, never inserted. Written here because it is
/// these few lines.
#[derive(Default)]
struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        if let Some(head) = bytes.first_chunk::<8>() {
            self.0 = u64::from_le_bytes(*head);
        }
    }

    /// The length an array writes before its bytes: always 32 here.
    fn write_usize(&mut self, _: usize) {}
}

/// The digest of a key as a client presents it.
pub fn digest(key: &[u8]) -> KeyDigest {
    let mut out = [0; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, key).as_ref());
    out
}

/// Key digests → tenants, from the config and from Redis. A tenant is a small `Copy` value
/// (the plugin's id of it): a lookup copies it, and no count shared by every worker thread
/// is written per request.
pub struct Directory<T> {
    configured: DigestMap<T>,
    by_name: HashMap<Arc<str>, T>,
    redis: Option<RedisDirectory<T>>,
}

/// What the Redis hash says, as last read.
struct RedisDirectory<T> {
    source: RedisKeys,
    /// Swapped whole at each read of the hash; requests read it without a lock.
    keys: ArcSwap<DigestMap<T>>,
    /// Flips once the first read was made (or failed): requests wait for it, briefly.
    loaded: watch::Sender<bool>,
    started: AtomicBool,
}

/// How long a request waits for the first read of the Redis keys after start-up.
const FIRST_READ_WAIT: Duration = Duration::from_secs(1);

impl<T: Copy + Send + Sync + 'static> Directory<T> {
    /// `tenants` by name, with their configured key digests (already validated).
    pub fn new(tenants: Vec<(Arc<str>, Vec<String>, T)>, redis: Option<RedisKeys>) -> Self {
        let mut configured = DigestMap::default();
        let mut by_name = HashMap::new();
        for (name, keys, tenant) in tenants {
            for written in keys {
                if let Ok(d) = digest_of(&written) {
                    configured.insert(d, tenant);
                }
            }
            by_name.insert(name, tenant);
        }
        let redis = redis.map(|source| RedisDirectory {
            source,
            keys: ArcSwap::from_pointee(DigestMap::default()),
            loaded: watch::channel(false).0,
            started: AtomicBool::new(false),
        });
        Self {
            configured,
            by_name,
            redis,
        }
    }

    /// The tenant configured under `name`.
    pub fn named(&self, name: &str) -> Option<T> {
        self.by_name.get(name).copied()
    }

    /// The tenant whose key has `digest`, if any.
    pub async fn find(self: &Arc<Self>, digest: &KeyDigest) -> Option<T> {
        if let Some(&found) = self.configured.get(digest) {
            return Some(found);
        }
        let redis = self.redis.as_ref()?;
        self.start_reading();
        let mut loaded = redis.loaded.subscribe();
        if !*loaded.borrow() {
            let _ = tokio::time::timeout(FIRST_READ_WAIT, loaded.wait_for(|done| *done)).await;
        }
        redis.keys.load().get(digest).copied()
    }

    /// Starts the task that reads the Redis keys every `refresh`, once, inside the runtime.
    fn start_reading(self: &Arc<Self>) {
        let Some(redis) = &self.redis else {
            return;
        };
        if redis.started.swap(true, Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            redis.started.store(false, Relaxed);
            return;
        };
        let this = Arc::clone(self);
        runtime.spawn(async move { this.read_forever().await });
    }

    async fn read_forever(self: Arc<Self>) {
        let Some(redis) = &self.redis else {
            return;
        };
        let client = match redis::Client::open(redis.source.url.as_str()) {
            Ok(client) => client,
            Err(e) => {
                tracing::error!("tenants: keys_from_redis.url is unusable: {e}");
                redis.loaded.send_replace(true);
                return;
            }
        };
        let mut tick = tokio::time::interval(redis.source.refresh);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut connection = None;
        loop {
            tick.tick().await;
            // The plugin is gone (a reload replaced it): nobody reads these keys any more.
            if Arc::strong_count(&self) == 1 {
                return;
            }
            let timeout = redis.source.refresh.min(Duration::from_secs(2));
            let read = tokio::time::timeout(timeout, async {
                if connection.is_none() {
                    connection = Some(client.get_multiplexed_async_connection().await?);
                }
                match connection.as_mut() {
                    // Read as bytes: one field that is not UTF-8 failed the whole read, and
                    // every key added or revoked after it never took effect.
                    Some(c) => {
                        c.hgetall::<_, HashMap<Vec<u8>, Vec<u8>>>(&redis.source.hash)
                            .await
                    }
                    None => Ok(HashMap::new()),
                }
            })
            .await;
            match read {
                Ok(Ok(raw)) => {
                    let read = raw.len();
                    let entries: HashMap<String, String> = raw
                        .into_iter()
                        .filter_map(|(field, value)| {
                            Some((
                                String::from_utf8(field).ok()?,
                                String::from_utf8(value).ok()?,
                            ))
                        })
                        .collect();
                    if entries.len() < read {
                        tracing::warn!(
                            "tenants: {} entries of the Redis hash `{}` are not UTF-8; skipped",
                            read - entries.len(),
                            redis.source.hash
                        );
                    }
                    self.replace_redis_keys(redis, entries);
                }
                Ok(Err(e)) => {
                    connection = None;
                    tracing::warn!(
                        "tenants: cannot read the keys from Redis, keeping the last ones: {e}"
                    );
                }
                Err(_) => {
                    connection = None;
                    tracing::warn!(
                        "tenants: reading the keys from Redis timed out, keeping the last ones"
                    );
                }
            }
            redis.loaded.send_replace(true);
        }
    }

    fn replace_redis_keys(&self, redis: &RedisDirectory<T>, entries: HashMap<String, String>) {
        let mut keys = DigestMap::with_capacity_and_hasher(entries.len(), Default::default());
        let mut skipped = 0usize;
        for (written, name) in entries {
            match (digest_of(&written), self.by_name.get(name.as_str())) {
                (Ok(d), Some(&tenant)) => {
                    keys.insert(d, tenant);
                }
                _ => skipped += 1,
            }
        }
        if skipped > 0 {
            tracing::warn!(
                "tenants: {skipped} entries of the Redis hash `{}` are not `sha256:<hex>` → a configured tenant; skipped",
                redis.source.hash
            );
        }
        redis.keys.store(Arc::new(keys));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(d: &KeyDigest) -> String {
        format!("sha256:{}", hex::encode(d))
    }

    #[tokio::test]
    async fn a_digest_is_found_by_all_its_bytes_not_by_the_eight_it_is_hashed_by() {
        let alpha = digest(b"sk-alpha");
        // Another digest that hashes the same: the same first eight bytes, then different.
        let mut twin = alpha;
        twin[8..].iter_mut().for_each(|b| *b = !*b);
        let directory = Arc::new(Directory::new(
            vec![
                ("alpha".into(), vec![written(&alpha)], 1u8),
                ("beta".into(), vec![written(&digest(b"sk-beta"))], 2u8),
            ],
            None,
        ));
        assert_eq!(directory.find(&alpha).await, Some(1));
        assert_eq!(directory.find(&digest(b"sk-beta")).await, Some(2));
        assert_eq!(directory.find(&twin).await, None, "same hash, other key");
        assert_eq!(directory.find(&digest(b"sk-other")).await, None);
        assert_eq!(directory.named("beta"), Some(2));
    }
}
