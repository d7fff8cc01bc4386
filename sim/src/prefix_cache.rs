//! Automatic prefix caching, as vLLM V1's block pool does it, at the granularity a router can
//! see: a prompt's token ids are cut into full blocks of `block_size`; each block's hash chains
//! on its parent's (so a block names its whole prefix); a request is served from the longest
//! run of leading blocks the cache holds and prefills only the rest; after its prefill its
//! blocks are kept (most recently used last) until the space is needed, and the least recently
//! used go first. Every block stored or evicted is told to the KV event publisher, as vLLM's
//! `BlockStored` / `BlockRemoved`.
//!
//! As in vLLM: only full blocks are cached; when the whole prompt is cached its last block is
//! computed again (the engine needs at least one token to run); a request's `cache_salt` is
//! part of its first block's hash, so salted prompts share nothing with other salts; a LoRA
//! adapter's name and path are part of every block's hash, so an adapter's blocks are its own.
//! The hash is SHA-256 over the parent hash, the block's token ids, the adapter and the salt,
//! of which the last 8 bytes are reported, as vLLM reports its hashes by default (an integer).
//!
//! Not modelled: the blocks' own memory is not taken from the KV cache the engine model
//! reserves (the cache holds up to what the engine has free, see [`PrefixCache::store`]), and
//! answers' decode blocks are not cached (a follow-up turn re-tokenizes them anyway).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::lora::Adapter;

/// A KV cache event, as vLLM's `vllm/distributed/kv_events.py` defines them.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks now in the cache: each hash names one `block_size` run of `token_ids`, the
    /// first chained on `parent` (none: the prompt's first block).
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        /// The `cache_salt` of a run that starts at the prompt's first block: that block's
        /// extra key, as vLLM publishes it.
        salt: Option<String>,
        /// The LoRA adapter's id and name: every block's extra key.
        lora: Option<(u32, String)>,
    },
    /// Blocks evicted.
    Removed { hashes: Vec<u64> },
    /// The whole cache was reset.
    AllCleared,
}

/// Where a cache's events go (the publisher); nothing when events are off.
pub type EventSink = tokio::sync::mpsc::UnboundedSender<KvEvent>;

#[derive(Debug, Default)]
struct Inner {
    /// Block hash → the tick of its last use.
    blocks: HashMap<u64, u64>,
    /// Tick → block hash: the least recently used first.
    by_use: BTreeMap<u64, u64>,
    tick: u64,
    /// Blocks of requests running now: not evictable (counted, not named).
    pinned: u64,
}

impl Inner {
    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(old) = self.blocks.insert(hash, self.tick) {
            self.by_use.remove(&old);
        }
        self.by_use.insert(self.tick, hash);
    }
}

#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    inner: Mutex<Inner>,
    events: Option<EventSink>,
}

/// A request's place in the cache: its blocks, how many were cached when it came.
#[derive(Debug, Default)]
pub struct Lookup {
    pub hashes: Vec<u64>,
    /// The request's `cache_salt`.
    pub salt: Option<String>,
    /// The request's LoRA adapter: its id and name.
    pub lora: Option<(u32, String)>,
    /// Tokens served from the cache.
    pub cached_tokens: u32,
}

impl PrefixCache {
    /// Publishes `events` as they are, beside the cache's own: `false` when events are off.
    pub fn publish(&self, events: impl IntoIterator<Item = KvEvent>) -> bool {
        let Some(sink) = &self.events else {
            return false;
        };
        events.into_iter().all(|event| sink.send(event).is_ok())
    }

    pub fn new(block_size: u32, events: Option<EventSink>) -> Self {
        PrefixCache {
            block_size: block_size.max(1) as usize,
            inner: Mutex::new(Inner::default()),
            events,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The chained hashes of `ids`' full blocks, each keyed with the LoRA adapter `lora`, the
    /// first salted with `salt`.
    pub fn block_hashes(
        &self,
        ids: &[u32],
        salt: Option<&str>,
        lora: Option<&Adapter>,
    ) -> Vec<u64> {
        let mut parent: Option<[u8; 32]> = None;
        ids.chunks_exact(self.block_size)
            .enumerate()
            .map(|(index, block)| {
                let mut hasher = Sha256::new();
                if let Some(parent) = &parent {
                    hasher.update(parent);
                } else {
                    hasher.update(b"none");
                }
                for id in block {
                    hasher.update(id.to_le_bytes());
                }
                if let Some(adapter) = lora {
                    hasher.update(b"lora");
                    hasher.update(adapter.name.as_bytes());
                    hasher.update([0]);
                    hasher.update(adapter.path.as_bytes());
                }
                if index == 0 {
                    if let Some(salt) = salt {
                        hasher.update(b"salt");
                        hasher.update(salt.as_bytes());
                    }
                }
                let digest: [u8; 32] = hasher.finalize().into();
                parent = Some(digest);
                let mut last = [0u8; 8];
                last.copy_from_slice(&digest[24..]);
                u64::from_be_bytes(last)
            })
            .collect()
    }

    /// Looks `ids` up: the leading blocks the cache holds are served from it (and count as
    /// used now). Of a prompt cached whole, the last block is computed again.
    pub fn lookup(&self, ids: &[u32], salt: Option<&str>, lora: Option<&Adapter>) -> Lookup {
        let hashes = self.block_hashes(ids, salt, lora);
        let mut inner = self.lock();
        let mut hit = hashes
            .iter()
            .take_while(|hash| inner.blocks.contains_key(hash))
            .count();
        if hit * self.block_size >= ids.len() {
            hit = hit.saturating_sub(1);
        }
        for hash in &hashes[..hit] {
            inner.touch(*hash);
        }
        Lookup {
            cached_tokens: u32::try_from(hit * self.block_size).unwrap_or(u32::MAX),
            hashes,
            salt: salt.map(str::to_string),
            lora: lora.map(|a| (a.id, a.name.clone())),
        }
    }

    /// Keeps a prefilled request's blocks (`ids` cut as [`PrefixCache::lookup`] cut them),
    /// pinned while it runs (give them back with [`PrefixCache::unpin`]), and evicts the least
    /// recently used beyond `capacity` blocks. Tells the publisher what changed.
    pub fn store(&self, lookup: &Lookup, ids: &[u32], capacity: u64) {
        let mut stored = Vec::new();
        let mut first_new = None;
        let mut removed = Vec::new();
        {
            let mut inner = self.lock();
            for (index, hash) in lookup.hashes.iter().enumerate() {
                if !inner.blocks.contains_key(hash) {
                    first_new.get_or_insert(index);
                    stored.push(*hash);
                }
                inner.touch(*hash);
            }
            inner.pinned += lookup.hashes.len() as u64;
            let room = capacity.max(inner.pinned);
            while inner.blocks.len() as u64 > room {
                let Some((_, hash)) = inner.by_use.pop_first() else {
                    break;
                };
                // The request's own blocks were touched last: they go last.
                inner.blocks.remove(&hash);
                removed.push(hash);
            }
        }
        let Some(events) = &self.events else {
            return;
        };
        if let Some(first) = first_new {
            // The new blocks are a run at the end of the prompt's: vLLM stores them as one
            // event, chained on the last cached block.
            let run = &lookup.hashes[first..];
            if run.len() == stored.len() {
                let _ = events.send(KvEvent::Stored {
                    hashes: run.to_vec(),
                    parent: first.checked_sub(1).map(|p| lookup.hashes[p]),
                    token_ids: ids[first * self.block_size..lookup.hashes.len() * self.block_size]
                        .to_vec(),
                    block_size: self.block_size as u32,
                    salt: lookup.salt.clone().filter(|_| first == 0),
                    lora: lookup.lora.clone(),
                });
            } else {
                // Evicted blocks in the middle came back: one event per block.
                for (index, hash) in lookup.hashes.iter().enumerate().skip(first) {
                    if stored.contains(hash) {
                        let _ = events.send(KvEvent::Stored {
                            hashes: vec![*hash],
                            parent: index.checked_sub(1).map(|p| lookup.hashes[p]),
                            token_ids: ids[index * self.block_size..(index + 1) * self.block_size]
                                .to_vec(),
                            block_size: self.block_size as u32,
                            salt: lookup.salt.clone().filter(|_| index == 0),
                            lora: lookup.lora.clone(),
                        });
                    }
                }
            }
        }
        // vLLM tells each evicted block in an event of its own.
        for hash in removed {
            let _ = events.send(KvEvent::Removed { hashes: vec![hash] });
        }
    }

    /// A request that [`PrefixCache::store`]d its blocks ended: they may be evicted now.
    pub fn unpin(&self, blocks: usize) {
        let mut inner = self.lock();
        inner.pinned = inner.pinned.saturating_sub(blocks as u64);
    }

    /// Empties the cache (`POST /reset_prefix_cache`).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.blocks.clear();
        inner.by_use.clear();
        drop(inner);
        if let Some(events) = &self.events {
            let _ = events.send(KvEvent::AllCleared);
        }
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.lock().blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32, seed: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + seed).collect()
    }

    #[test]
    fn shared_prefixes_hit_and_salts_separate() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cache = PrefixCache::new(4, Some(tx));
        let first = ids(10, 1);
        let lookup = cache.lookup(&first, None, None);
        assert_eq!((lookup.hashes.len(), lookup.cached_tokens), (2, 0));
        cache.store(&lookup, &first, 100);
        let Ok(KvEvent::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            ..
        }) = rx.try_recv()
        else {
            panic!("stored")
        };
        assert_eq!(
            (hashes.len(), parent, token_ids.len(), block_size),
            (2, None, 8, 4)
        );
        // The same first 8 tokens, then others: 8 cached.
        let mut second = first[..8].to_vec();
        second.extend(ids(9, 99));
        let lookup = cache.lookup(&second, None, None);
        assert_eq!(lookup.cached_tokens, 8);
        cache.store(&lookup, &second, 100);
        let Ok(KvEvent::Stored { parent, hashes, .. }) = rx.try_recv() else {
            panic!("stored")
        };
        assert_eq!(parent, Some(lookup.hashes[1]));
        assert_eq!(hashes, lookup.hashes[2..].to_vec());
        // A whole-prompt hit recomputes the last block.
        assert_eq!(cache.lookup(&first[..8], None, None).cached_tokens, 4);
        // Salted: nothing shared.
        assert_eq!(cache.lookup(&first, Some("tenant"), None).cached_tokens, 0);
        // An adapter's blocks are its own: not the base model's, nor another path's.
        let adapter = Adapter {
            id: 1,
            name: "sql".into(),
            path: "/a".into(),
        };
        let lookup = cache.lookup(&first, None, Some(&adapter));
        assert_eq!(lookup.cached_tokens, 0);
        assert_eq!(lookup.lora, Some((1, "sql".to_string())));
        cache.store(&lookup, &first, 100);
        assert_eq!(cache.lookup(&first, None, Some(&adapter)).cached_tokens, 8);
        let moved = Adapter {
            path: "/b".into(),
            ..adapter
        };
        assert_eq!(cache.lookup(&first, None, Some(&moved)).cached_tokens, 0);
    }

    #[test]
    fn least_recently_used_blocks_are_evicted_and_told() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cache = PrefixCache::new(4, Some(tx));
        let a = ids(8, 1);
        let b = ids(8, 2);
        let lookup_a = cache.lookup(&a, None, None);
        cache.store(&lookup_a, &a, 4);
        cache.unpin(2);
        let lookup_b = cache.lookup(&b, None, None);
        cache.store(&lookup_b, &b, 2);
        let events: Vec<KvEvent> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        let removed: Vec<&KvEvent> = events
            .iter()
            .filter(|e| matches!(e, KvEvent::Removed { .. }))
            .collect();
        assert_eq!(
            removed,
            lookup_a
                .hashes
                .iter()
                .map(|h| KvEvent::Removed { hashes: vec![*h] })
                .collect::<Vec<_>>()
                .iter()
                .collect::<Vec<_>>()
        );
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.lookup(&a, None, None).cached_tokens, 0);
        cache.clear();
        assert_eq!(rx.try_recv(), Ok(KvEvent::AllCleared));
        assert_eq!(cache.len(), 0);
    }
}
