//! The exact prefix index of a pool: which of its backends hold which prompt blocks in their
//! prefix cache, known from vLLM's KV cache events (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), and the lookup of a tokenized request in it.
//!
//! An engine names a block by its own hash, which Sluice cannot compute (vLLM seeds it, salts
//! it, and may use any of several algorithms). So the index keys blocks by a hash of its own,
//! chained like the engine's: a block's key is the hash of its parent's key and its token ids,
//! both of which every `BlockStored` event carries. Each backend keeps the map from its
//! engine's hashes to these keys, for its `BlockRemoved` events and for the parents of later
//! blocks. A request's keys are computed the same way from the token ids Sluice makes of it
//! (see `sluice-tokenizer`), so a lookup is one map probe per block.
//!
//! Bounded: each backend holds at most [`MAX_BLOCKS_PER_BACKEND`] blocks in the index; a
//! backend that stores more loses the overflow (counted), as if the engine had evicted it.
//!
//! Written here rather than taken from NVIDIA Dynamo's `dynamo-kv-router` (Apache-2.0): that
//! crate's radix tree is built for Dynamo's runtime (its worker ids, its event types, its NATS
//! and ZMQ plumbing behind features), and what Sluice needs of it, a map of chained keys to
//! holders, is a few hundred lines.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::RwLock;

use crate::msgpack::Cursor;

/// The most blocks the index keeps for one backend (about 25 MB of index at most): enough
/// for the prefix cache of an engine with 4M tokens of KV cache at vLLM's 16-token blocks.
pub const MAX_BLOCKS_PER_BACKEND: usize = 262_144;

/// The block size vLLM uses unless told otherwise, until an event says what the pool's is.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The largest block size an event may name: vLLM's are 1 to a few hundred tokens (hybrid
/// models align theirs to the attention's page). A larger one is no engine's: its event is
/// refused.
pub const MAX_BLOCK_SIZE: usize = 4096;

/// Blocks applied under one hold of the index's write lock: a large batch is applied in
/// slices, so that a request's lookup never waits behind a whole batch.
const BLOCKS_PER_HOLD: usize = 1024;

/// A block as an engine names it: vLLM sends an integer by default, the hash's bytes when
/// configured so. Bytes are folded into 64 bits.
pub type EngineHash = u64;

/// One KV cache event, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks stored: `hashes[i]` holds `token_ids[i * block_size..][..block_size]`; the
    /// first is chained on `parent` (`None`: a prompt's first block). `extra[i]` is block
    /// `i`'s extra keys, hashed (the engine hashes them with its tokens: a LoRA adapter's
    /// name, the request's `cache_salt` on its first block, multi-modal inputs), if any.
    Stored {
        /// The blocks, in prompt order.
        hashes: Vec<EngineHash>,
        /// The block the first one chains on.
        parent: Option<EngineHash>,
        /// The blocks' tokens, `block_size` each.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// Each block's extra keys, hashed; empty when no block has any.
        extra: Vec<Option<u64>>,
    },
    /// Blocks evicted.
    Removed {
        /// The blocks evicted.
        hashes: Vec<EngineHash>,
    },
    /// The cache was emptied.
    AllCleared,
}

/// A batch of events as one message carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// When the engine sent it (seconds since the epoch).
    pub ts: f64,
    /// The events, in the order the engine made them.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that sent it, if the engine says.
    pub data_parallel_rank: Option<i64>,
    /// Events of kinds this version does not know, skipped.
    pub unknown: usize,
}

/// Why a message is not a KV event batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not a KV event batch: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

impl KvEventBatch {
    /// Decodes a msgpack `KVEventBatch` as vLLM sends it: msgspec's `array_like` form (`[ts,
    /// events, rank?]`, each event `[tag, fields...]`) or the map form (`{"ts", "events",
    /// "data_parallel_rank"}`, each event `{"type": tag, field: value...}`). Unknown event
    /// kinds are counted and skipped; unknown fields are ignored; a nil field is one left out.
    /// Read in place ([`crate::msgpack`]): no value is made but the events themselves.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut cursor = Cursor::new(bytes);
        let mut batch = KvEventBatch {
            ts: 0.0,
            events: Vec::new(),
            data_parallel_rank: None,
            unknown: 0,
        };
        let mut has_events = false;
        if let Some(items) = cursor.array() {
            for position in 0..items {
                let mut item = whole(&mut cursor)?;
                match position {
                    0 => batch.ts = item.float().unwrap_or(0.0),
                    1 => has_events = batch.read_events(item)?,
                    2 => batch.data_parallel_rank = item.signed(),
                    _ => {}
                }
            }
        } else if let Some(pairs) = cursor.map() {
            // A name's first occurrence only; a nil value is none.
            let (mut ts, mut events, mut rank) = (None, false, None);
            for _ in 0..pairs {
                let key = whole(&mut cursor)?.str();
                let mut value = whole(&mut cursor)?;
                match key {
                    Some("ts") if ts.is_none() => ts = Some(value.float()),
                    Some("events") if !events => {
                        events = true;
                        has_events = batch.read_events(value)?;
                    }
                    Some("data_parallel_rank") if rank.is_none() => rank = Some(value.signed()),
                    _ => {}
                }
            }
            batch.ts = ts.flatten().unwrap_or(0.0);
            batch.data_parallel_rank = rank.flatten();
        } else if cursor.peek().is_none() {
            return Err(DecodeError("msgpack: an empty message".to_string()));
        } else {
            return Err(DecodeError("neither an array nor a map".to_string()));
        }
        if !has_events {
            return Err(DecodeError("no event list".to_string()));
        }
        Ok(batch)
    }

    /// Reads the event list at `list` into the batch: `false` when it is no list.
    fn read_events(&mut self, mut list: Cursor<'_>) -> Result<bool, DecodeError> {
        let Some(count) = list.array() else {
            return Ok(false);
        };
        // Reserved for at most a batch's worth: a count the message cannot hold, or events
        // of kinds not kept, reserve nothing beyond it.
        self.events.reserve(count.min(RESERVED_EVENTS));
        for _ in 0..count {
            match decode_event(whole(&mut list)?)? {
                Some(event) => self.events.push(event),
                None => self.unknown += 1,
            }
        }
        Ok(true)
    }
}

/// The most events reserved for at once while a batch is read (an engine step's batch holds
/// a few; more grow the list as they are read).
const RESERVED_EVENTS: usize = 64;

/// The next value, whole, as a cursor of its own; an error when the message ends inside it.
fn whole<'a>(cursor: &mut Cursor<'a>) -> Result<Cursor<'a>, DecodeError> {
    cursor
        .value()
        .map(Cursor::new)
        .ok_or_else(|| DecodeError("msgpack: the message ends inside a value".to_string()))
}

/// The fields of one event that the index reads, whichever form it came in: each one's
/// value, `None` when absent or nil.
#[derive(Default)]
struct Fields<'v> {
    tag: &'v str,
    block_hashes: Option<Cursor<'v>>,
    parent_block_hash: Option<Cursor<'v>>,
    token_ids: Option<Cursor<'v>>,
    block_size: Option<Cursor<'v>>,
    extra_keys: Option<Cursor<'v>>,
    /// The fields already given a value (by their position below), so that a name said
    /// twice in the map form keeps its first value, as a nil one counts.
    seen: u8,
}

/// The fields the index reads: their names, and their positions after the tag in the array
/// form.
const FIELDS: [(&str, usize); 5] = [
    ("block_hashes", 0),
    ("parent_block_hash", 1),
    ("token_ids", 2),
    ("block_size", 3),
    ("extra_keys", 7),
];

impl<'v> Fields<'v> {
    /// Gives field `which` (of [`FIELDS`]) its value, unless it has one.
    fn set(&mut self, which: usize, value: Cursor<'v>) {
        if self.seen & (1 << which) != 0 {
            return;
        }
        self.seen |= 1 << which;
        let value = Some(value).filter(|v| !v.is_nil());
        match which {
            0 => self.block_hashes = value,
            1 => self.parent_block_hash = value,
            2 => self.token_ids = value,
            3 => self.block_size = value,
            _ => self.extra_keys = value,
        }
    }

    fn read(mut event: Cursor<'v>) -> Result<Self, DecodeError> {
        let mut fields = Fields::default();
        if let Some(items) = event.array() {
            for position in 0..items {
                let mut value = whole(&mut event)?;
                if position == 0 {
                    fields.tag = value.str().unwrap_or("");
                } else if let Some(which) = FIELDS.iter().position(|f| f.1 == position - 1) {
                    fields.set(which, value);
                }
            }
        } else if let Some(pairs) = event.map() {
            let mut tagged = false;
            for _ in 0..pairs {
                let key = whole(&mut event)?.str().unwrap_or("");
                let mut value = whole(&mut event)?;
                if key == "type" {
                    if !tagged {
                        tagged = true;
                        fields.tag = value.str().unwrap_or("");
                    }
                } else if let Some(which) = FIELDS.iter().position(|f| f.0 == key) {
                    fields.set(which, value);
                }
            }
        } else {
            return Err(DecodeError(
                "an event is neither an array nor a map".to_string(),
            ));
        }
        Ok(fields)
    }
}

fn decode_event(event: Cursor<'_>) -> Result<Option<KvEvent>, DecodeError> {
    let fields = Fields::read(event)?;
    let bad = |what: &str| DecodeError(format!("{}: {what}", fields.tag));
    Ok(Some(match fields.tag {
        "BlockStored" => {
            let hashes = engine_hashes(fields.block_hashes).ok_or_else(|| bad("block_hashes"))?;
            let parent = fields
                .parent_block_hash
                .and_then(|mut v| engine_hash(&mut v));
            let token_ids = fields
                .token_ids
                .and_then(token_ids)
                .ok_or_else(|| bad("token_ids"))?;
            let block_size = fields
                .block_size
                .and_then(|mut v| v.unsigned())
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| bad("block_size"))?;
            // A size of 2^40 would overflow the product: checked, never wrapped.
            if hashes
                .len()
                .checked_mul(block_size)
                .is_none_or(|needed| token_ids.len() < needed)
            {
                return Err(bad("fewer token ids than blocks"));
            }
            // Per block, its extra keys (`[lora_name?, cache_salt?]`) or nil; the field is
            // left out when no block has any.
            let extra = match fields.extra_keys.map(extra_hashes) {
                Some(Some(list)) => list,
                _ => Vec::new(),
            };
            KvEvent::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                extra,
            }
        }
        "BlockRemoved" => KvEvent::Removed {
            hashes: engine_hashes(fields.block_hashes).ok_or_else(|| bad("block_hashes"))?,
        },
        "AllBlocksCleared" => KvEvent::AllCleared,
        _ => return Ok(None),
    }))
}

/// A list of token ids, each one that fits in 32 bits.
fn token_ids(mut list: Cursor<'_>) -> Option<Vec<u32>> {
    let count = list.array()?;
    let mut ids = Vec::with_capacity(count.min(list.rest().len()));
    for _ in 0..count {
        ids.push(u32::try_from(list.unsigned()?).ok()?);
    }
    Some(ids)
}

fn engine_hashes(list: Option<Cursor<'_>>) -> Option<Vec<EngineHash>> {
    let mut list = list?;
    let count = list.array()?;
    let mut hashes = Vec::with_capacity(count.min(list.rest().len()));
    for _ in 0..count {
        let mut value = whole(&mut list).ok()?;
        hashes.push(engine_hash(&mut value)?);
    }
    Some(hashes)
}

/// An engine's block hash: an integer (negative ones as their two's complement), or bytes.
fn engine_hash(value: &mut Cursor<'_>) -> Option<EngineHash> {
    value.bits().or_else(|| value.bytes().map(fold))
}

/// Each block's extra keys, hashed: `None` for a block whose keys are no list.
fn extra_hashes(mut list: Cursor<'_>) -> Option<Vec<Option<u64>>> {
    let count = list.array()?;
    let mut hashes = Vec::with_capacity(count.min(list.rest().len()));
    for _ in 0..count {
        let keys = whole(&mut list).ok()?;
        // Rare (a LoRA adapter, a salted first block): read as values, to hash them exactly
        // as a request's keys are hashed (`extra_hash`, over their msgpack encoding).
        let hash = match keys.peek() {
            Some(rmp::Marker::FixArray(_) | rmp::Marker::Array16 | rmp::Marker::Array32) => {
                match rmpv::decode::read_value(&mut keys.rest()) {
                    Ok(rmpv::Value::Array(keys)) => Some(extra_hash(&keys)),
                    _ => None,
                }
            }
            _ => None,
        };
        hashes.push(hash);
    }
    Some(hashes)
}

/// A block's extra keys, hashed as the index keys them: their msgpack encoding, folded.
pub fn extra_hash(keys: &[rmpv::Value]) -> u64 {
    let mut bytes = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut bytes, &rmpv::Value::Array(keys.to_vec()));
    fold(&bytes)
}

/// 64 bits of FNV-1a over `bytes`, spread by splitmix's finaliser.
fn fold(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(hash)
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The key of a block: its parent's key and its token ids.
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut hash = parent ^ 0x51_7cc1_b727_220a;
    for token in tokens {
        hash = mix(hash ^ u64::from(*token));
    }
    hash
}

/// The key a prompt's first block chains on.
const ROOT: u64 = 0x2545_f491_4f6c_dd1d;

/// The key of a block whose parent's key is `parent`, with its extra keys' hash if any.
fn block_key(parent: u64, tokens: &[u32], extra: Option<u64>) -> u64 {
    let key = chain(parent, tokens);
    match extra {
        Some(extra) => mix(key ^ extra),
        None => key,
    }
}

/// The keys of a prompt's full blocks of `block_size` tokens, as the index keys what the
/// engines store. The blocks' extra keys are the engine's: a LoRA `adapter`'s name on every
/// block, then `cache_salt` (the salt the engine gets) on the first.
pub fn block_keys(
    token_ids: &[u32],
    block_size: usize,
    adapter: Option<&str>,
    cache_salt: Option<&str>,
) -> Vec<u64> {
    let extra = |first: bool| {
        let keys: Vec<rmpv::Value> = adapter
            .into_iter()
            .chain(cache_salt.filter(|_| first))
            .map(rmpv::Value::from)
            .collect();
        (!keys.is_empty()).then(|| extra_hash(&keys))
    };
    let (first_extra, other_extra) = (extra(true), extra(false));
    let mut parent = ROOT;
    token_ids
        .chunks_exact(block_size.max(1))
        .enumerate()
        .map(|(index, block)| {
            let extra = if index == 0 { first_extra } else { other_extra };
            parent = block_key(parent, block, extra);
            parent
        })
        .collect()
}

/// What one backend holds, as its events told.
#[derive(Debug, Default)]
struct Holdings {
    /// Its engine's hash → the index's key.
    keys: HashMap<EngineHash, u64>,
}

#[derive(Debug, Default)]
struct Index {
    /// Block key → the backends holding it (their index ids).
    holders: HashMap<u64, Vec<u32>>,
    backends: HashMap<u32, Holdings>,
}

impl Index {
    fn forget_block(&mut self, key: u64, id: u32) {
        forget_holder(&mut self.holders, key, id);
    }
}

/// Takes `id` off the holders of block `key`, and the block off the map when none is left.
fn forget_holder(holders: &mut HashMap<u64, Vec<u32>>, key: u64, id: u32) {
    if let Some(list) = holders.get_mut(&key) {
        list.retain(|holder| *holder != id);
        if list.is_empty() {
            holders.remove(&key);
        }
    }
}

/// A request's blocks found in the index: for each backend (by address), how many of the
/// request's leading blocks it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    /// (backend, leading blocks held), backends with none left out.
    pub held: Vec<(SocketAddr, usize)>,
    /// The block size the keys were cut at.
    pub block_size: usize,
}

impl Matches {
    /// Tokens of the request `addr` holds in its prefix cache.
    pub fn cached_tokens(&self, addr: SocketAddr) -> u64 {
        self.held
            .iter()
            .find(|(a, _)| *a == addr)
            .map_or(0, |(_, blocks)| (*blocks * self.block_size) as u64)
    }

    /// Of a prompt of `tokens`, those `addr`'s engine would serve from its cache: what it
    /// holds, but at least one token computed (vLLM recomputes the last block of a prompt it
    /// holds whole).
    pub fn served_tokens(&self, addr: SocketAddr, tokens: u64) -> u64 {
        let size = self.block_size.max(1) as u64;
        self.cached_tokens(addr)
            .min(tokens.saturating_sub(1) / size * size)
    }

    /// The most tokens any backend holds.
    pub fn best(&self) -> u64 {
        self.held
            .iter()
            .map(|(_, blocks)| (*blocks * self.block_size) as u64)
            .max()
            .unwrap_or(0)
    }
}

/// A pool's prefix index (see the module's header).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    index: RwLock<Index>,
    /// Backend address → its id in the index.
    ids: RwLock<HashMap<SocketAddr, u32>>,
    next_id: AtomicU64,
    /// The pool's block size: the one most of its backends' events name (one backend
    /// cannot set it for the others); 0 until an event said.
    block_size: AtomicUsize,
    /// Each backend's block size, as its last `BlockStored` said.
    sizes: RwLock<HashMap<u32, usize>>,
    /// Events refused: a block size no engine has.
    pub refused: AtomicU64,
    /// Blocks not indexed because their backend was at [`MAX_BLOCKS_PER_BACKEND`].
    pub overflowed: AtomicU64,
    /// Stored blocks whose parent the index did not know (events missed): not indexed.
    pub orphans: AtomicU64,
    /// Each backend's last event lag: how old its last batch was when it came, seconds.
    lags: RwLock<HashMap<SocketAddr, f64>>,
}

impl PrefixIndex {
    /// The block size requests are cut at: the engines', once an event told it.
    pub fn block_size(&self) -> usize {
        match self.block_size.load(Relaxed) {
            0 => DEFAULT_BLOCK_SIZE,
            size => size,
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    fn id_of(&self, addr: SocketAddr) -> Option<u32> {
        self.ids
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&addr)
            .copied()
    }

    /// The id of `addr`, given one if it has none.
    fn register(&self, addr: SocketAddr) -> u32 {
        if let Some(id) = self.id_of(addr) {
            return id;
        }
        let mut ids = self.ids.write().unwrap_or_else(|p| p.into_inner());
        *ids.entry(addr)
            .or_insert_with(|| self.next_id.fetch_add(1, Relaxed) as u32)
    }

    /// Applies `addr`'s events, in order, a slice of at most [`BLOCKS_PER_HOLD`] blocks under
    /// each hold of the write lock: an event of half a million removed blocks lets readers in
    /// between its slices.
    pub fn apply(&self, addr: SocketAddr, events: &[KvEvent]) {
        let id = self.register(addr);
        for event in events {
            match event {
                KvEvent::Stored {
                    hashes,
                    parent,
                    token_ids,
                    block_size,
                    extra,
                } => {
                    let size = *block_size;
                    if size == 0 || size > MAX_BLOCK_SIZE {
                        self.refused.fetch_add(1, Relaxed);
                        continue;
                    }
                    self.note_block_size(id, size);
                    let parent_key = match parent {
                        None => Some(ROOT),
                        Some(parent) => self
                            .read()
                            .backends
                            .get(&id)
                            .and_then(|holdings| holdings.keys.get(parent).copied()),
                    };
                    let Some(mut parent_key) = parent_key else {
                        self.orphans.fetch_add(hashes.len() as u64, Relaxed);
                        continue;
                    };
                    let mut blocks = hashes
                        .iter()
                        .zip(token_ids.chunks_exact(size))
                        .enumerate()
                        .peekable();
                    while blocks.peek().is_some() {
                        let mut index = self.write();
                        let index = &mut *index;
                        let holdings = index.backends.entry(id).or_default();
                        for (position, (hash, tokens)) in blocks.by_ref().take(BLOCKS_PER_HOLD) {
                            let extra = extra.get(position).copied().flatten();
                            let key = block_key(parent_key, tokens, extra);
                            parent_key = key;
                            if holdings.keys.len() >= MAX_BLOCKS_PER_BACKEND
                                && !holdings.keys.contains_key(hash)
                            {
                                self.overflowed.fetch_add(1, Relaxed);
                                continue;
                            }
                            if let Some(old) = holdings.keys.insert(*hash, key) {
                                if old == key {
                                    continue;
                                }
                                // The same engine hash for other tokens (a hash collision or a
                                // restarted engine): the old block is gone.
                                forget_holder(&mut index.holders, old, id);
                            }
                            let list = index.holders.entry(key).or_default();
                            if !list.contains(&id) {
                                list.push(id);
                            }
                        }
                    }
                }
                KvEvent::Removed { hashes } => self.evict(id, hashes),
                KvEvent::AllCleared => forget_all(&mut self.write(), id),
            }
        }
    }

    /// Backend `id` evicted the blocks of `hashes`; the lock is let go every
    /// [`BLOCKS_PER_HOLD`] blocks, as for stored ones.
    fn evict(&self, id: u32, hashes: &[EngineHash]) {
        for slice in hashes.chunks(BLOCKS_PER_HOLD) {
            let mut index = self.write();
            for hash in slice {
                let key = index
                    .backends
                    .get_mut(&id)
                    .and_then(|holdings| holdings.keys.remove(hash));
                if let Some(key) = key {
                    index.forget_block(key, id);
                }
            }
        }
    }

    /// `id`'s engine cuts blocks of `size` tokens: the pool's size is then the one most
    /// backends name (on a tie, the one it had).
    fn note_block_size(&self, id: u32, size: usize) {
        let mut sizes = self.sizes.write().unwrap_or_else(|p| p.into_inner());
        if sizes.insert(id, size) == Some(size) {
            return;
        }
        self.elect_block_size(&sizes);
    }

    /// The pool's block size: the one most backends name (on a tie, the one it had).
    fn elect_block_size(&self, sizes: &HashMap<u32, usize>) {
        let current = self.block_size.load(Relaxed);
        let votes = |size: usize| sizes.values().filter(|s| **s == size).count();
        let best = sizes
            .values()
            .copied()
            .max_by_key(|s| (votes(*s), *s == current))
            .unwrap_or(current);
        self.block_size.store(best, Relaxed);
    }

    /// Forgets everything `addr` holds: its engine restarted, its events were lost, or it
    /// left the pool.
    pub fn clear(&self, addr: SocketAddr) {
        if let Some(id) = self.id_of(addr) {
            forget_all(&mut self.write(), id);
        }
    }

    /// Forgets `addr` altogether: it left the pool.
    pub fn remove(&self, addr: SocketAddr) {
        self.clear(addr);
        if let Some(id) = self.id_of(addr) {
            let mut sizes = self.sizes.write().unwrap_or_else(|p| p.into_inner());
            if sizes.remove(&id).is_some() {
                self.elect_block_size(&sizes);
            }
        }
        self.lags
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addr);
        self.ids
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addr);
    }

    /// Records that `addr`'s last batch was `seconds` old when it came.
    pub fn record_lag(&self, addr: SocketAddr, seconds: f64) {
        self.lags
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr, seconds);
    }

    /// How old `addr`'s last batch was when it came, if one came.
    pub fn lag_of(&self, addr: SocketAddr) -> Option<f64> {
        self.lags
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&addr)
            .copied()
    }

    /// Blocks the index holds for `addr`.
    pub fn blocks_of(&self, addr: SocketAddr) -> usize {
        self.id_of(addr).map_or(0, |id| {
            self.read()
                .backends
                .get(&id)
                .map_or(0, |holdings| holdings.keys.len())
        })
    }

    /// How many of `keys`' leading blocks each backend holds.
    pub fn lookup(&self, keys: &[u64]) -> Matches {
        let block_size = self.block_size();
        let index = self.read();
        // (id, blocks matched so far); a backend drops out at its first missing block.
        let mut held: Vec<(u32, usize)> = Vec::new();
        for (position, key) in keys.iter().enumerate() {
            let Some(holders) = index.holders.get(key) else {
                break;
            };
            if position == 0 {
                held = holders.iter().map(|id| (*id, 1)).collect();
                continue;
            }
            let mut advanced = false;
            for (id, count) in held.iter_mut() {
                if *count == position && holders.contains(id) {
                    *count += 1;
                    advanced = true;
                }
            }
            if !advanced {
                break;
            }
        }
        drop(index);
        if held.is_empty() {
            return Matches {
                held: Vec::new(),
                block_size,
            };
        }
        let ids = self.ids.read().unwrap_or_else(|p| p.into_inner());
        let held = ids
            .iter()
            .filter_map(|(addr, id)| {
                held.iter()
                    .find(|(held_id, _)| held_id == id)
                    .map(|(_, count)| (*addr, *count))
            })
            .collect();
        Matches { held, block_size }
    }
}

fn forget_all(index: &mut Index, id: u32) {
    let Some(holdings) = index.backends.remove(&id) else {
        return;
    };
    for key in holdings.keys.into_values() {
        index.forget_block(key, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    /// The decoder as it was, building a tree of `rmpv::Value`s: the reference the in-place
    /// reader must agree with.
    mod tree {
        use super::super::{extra_hash, fold, DecodeError, EngineHash, KvEvent, KvEventBatch};

        pub(super) fn decode(mut bytes: &[u8]) -> Result<KvEventBatch, DecodeError> {
            let value = rmpv::decode::read_value(&mut bytes)
                .map_err(|e| DecodeError(format!("msgpack: {e}")))?;
            let (ts, events, rank) = match &value {
                rmpv::Value::Array(items) => (items.first(), items.get(1), items.get(2)),
                rmpv::Value::Map(_) => (
                    field(&value, "ts"),
                    field(&value, "events"),
                    field(&value, "data_parallel_rank"),
                ),
                _ => return Err(DecodeError("neither an array nor a map".to_string())),
            };
            let ts = ts.and_then(rmpv::Value::as_f64).unwrap_or(0.0);
            let events = events
                .and_then(rmpv::Value::as_array)
                .ok_or_else(|| DecodeError("no event list".to_string()))?;
            let mut batch = KvEventBatch {
                ts,
                events: Vec::with_capacity(events.len()),
                data_parallel_rank: rank.and_then(rmpv::Value::as_i64),
                unknown: 0,
            };
            for event in events {
                match decode_event(event)? {
                    Some(event) => batch.events.push(event),
                    None => batch.unknown += 1,
                }
            }
            Ok(batch)
        }

        fn field<'v>(map: &'v rmpv::Value, name: &str) -> Option<&'v rmpv::Value> {
            map.as_map()?
                .iter()
                .find(|(key, _)| key.as_str() == Some(name))
                .map(|(_, value)| value)
                .filter(|value| !value.is_nil())
        }

        /// The fields of one event, by name, whichever form it came in.
        struct Fields<'v> {
            tag: &'v str,
            array: Option<&'v [rmpv::Value]>,
            map: Option<&'v rmpv::Value>,
        }

        impl<'v> Fields<'v> {
            /// Field `name`, the `position`th after the tag in the array form.
            fn get(&self, position: usize, name: &str) -> Option<&'v rmpv::Value> {
                match (self.array, self.map) {
                    (Some(items), _) => items.get(position + 1).filter(|v| !v.is_nil()),
                    (None, Some(map)) => field(map, name),
                    (None, None) => None,
                }
            }
        }

        fn decode_event(value: &rmpv::Value) -> Result<Option<KvEvent>, DecodeError> {
            let fields = match value {
                rmpv::Value::Array(items) => Fields {
                    tag: items.first().and_then(rmpv::Value::as_str).unwrap_or(""),
                    array: Some(items),
                    map: None,
                },
                rmpv::Value::Map(_) => Fields {
                    tag: field(value, "type")
                        .and_then(rmpv::Value::as_str)
                        .unwrap_or(""),
                    array: None,
                    map: Some(value),
                },
                _ => {
                    return Err(DecodeError(
                        "an event is neither an array nor a map".to_string(),
                    ))
                }
            };
            let bad = |what: &str| DecodeError(format!("{}: {what}", fields.tag));
            Ok(Some(match fields.tag {
                "BlockStored" => {
                    let hashes = engine_hashes(fields.get(0, "block_hashes"))
                        .ok_or_else(|| bad("block_hashes"))?;
                    let parent = fields.get(1, "parent_block_hash").and_then(engine_hash);
                    let token_ids = fields
                        .get(2, "token_ids")
                        .and_then(rmpv::Value::as_array)
                        .ok_or_else(|| bad("token_ids"))?
                        .iter()
                        .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| bad("token_ids"))?;
                    let block_size = fields
                        .get(3, "block_size")
                        .and_then(rmpv::Value::as_u64)
                        .and_then(|n| usize::try_from(n).ok())
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad("block_size"))?;
                    // A size of 2^40 would overflow the product: checked, never wrapped.
                    if hashes
                        .len()
                        .checked_mul(block_size)
                        .is_none_or(|needed| token_ids.len() < needed)
                    {
                        return Err(bad("fewer token ids than blocks"));
                    }
                    // Per block, its extra keys (`[lora_name?, cache_salt?]`) or nil; the field is
                    // left out when no block has any.
                    let extra = match fields.get(7, "extra_keys").and_then(rmpv::Value::as_array) {
                        Some(list) => list
                            .iter()
                            .map(|keys| keys.as_array().map(|keys| extra_hash(keys)))
                            .collect(),
                        None => Vec::new(),
                    };
                    KvEvent::Stored {
                        hashes,
                        parent,
                        token_ids,
                        block_size,
                        extra,
                    }
                }
                "BlockRemoved" => KvEvent::Removed {
                    hashes: engine_hashes(fields.get(0, "block_hashes"))
                        .ok_or_else(|| bad("block_hashes"))?,
                },
                "AllBlocksCleared" => KvEvent::AllCleared,
                _ => return Ok(None),
            }))
        }

        fn engine_hashes(value: Option<&rmpv::Value>) -> Option<Vec<EngineHash>> {
            value?.as_array()?.iter().map(engine_hash).collect()
        }

        /// An engine's block hash: an integer (negative ones as their two's complement), or bytes.
        fn engine_hash(value: &rmpv::Value) -> Option<EngineHash> {
            match value {
                rmpv::Value::Integer(n) => n.as_u64().or_else(|| n.as_i64().map(|n| n as u64)),
                rmpv::Value::Binary(bytes) => Some(fold(bytes)),
                rmpv::Value::String(text) => Some(fold(text.as_bytes())),
                _ => None,
            }
        }
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        KvEvent::Stored {
            hashes: hashes.to_vec(),
            parent,
            token_ids: tokens.to_vec(),
            block_size: 4,
            extra: Vec::new(),
        }
    }

    fn encode(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, value).unwrap();
        out
    }

    fn stored_sized(hash: u64, size: usize) -> KvEvent {
        KvEvent::Stored {
            hashes: vec![hash],
            parent: None,
            token_ids: (0..size as u32).collect(),
            block_size: size,
            extra: Vec::new(),
        }
    }

    /// One event named a block size of 2^40: the pool's requests were cut at it, and no
    /// backend was credited again. A size no engine has is refused; a size one backend of
    /// three names is its own, not the pool's.
    #[test]
    fn no_backend_sets_the_pools_block_size_alone() {
        let index = PrefixIndex::default();
        for port in 1..=3 {
            index.apply(addr(port), &[stored_sized(u64::from(port), 16)]);
        }
        assert_eq!(index.block_size(), 16);
        let lie = KvEvent::Stored {
            hashes: Vec::new(),
            parent: None,
            token_ids: Vec::new(),
            block_size: 1 << 40,
            extra: Vec::new(),
        };
        index.apply(addr(3), &[lie]);
        assert_eq!(index.block_size(), 16);
        assert_eq!(index.refused.load(Relaxed), 1);
        index.apply(addr(3), &[stored_sized(99, 1024)]);
        assert_eq!(index.block_size(), 16, "one of three");
        // Most of the pool moves (engines restarted with another size): so does the pool.
        index.apply(addr(2), &[stored_sized(98, 1024)]);
        assert_eq!(index.block_size(), 1024);
        // A backend that leaves takes its vote with it.
        index.remove(addr(3));
        index.remove(addr(2));
        index.apply(addr(1), &[stored_sized(97, 16)]);
        assert_eq!(index.block_size(), 16);
    }

    /// An engine hash stored again for other tokens left an empty holder list behind, for
    /// ever; and a large batch is applied whole, slice by slice.
    #[test]
    fn re_stored_hashes_leave_nothing_behind_and_large_batches_apply_whole() {
        let index = PrefixIndex::default();
        index.apply(addr(1), &[stored(&[1], None, &[1, 2, 3, 4])]);
        for round in 0..100u32 {
            index.apply(addr(1), &[stored(&[1], None, &[round, 9, 9, 9])]);
        }
        assert_eq!(index.read().holders.len(), 1);
        let many: Vec<KvEvent> = (0..5000u64)
            .map(|i| stored(&[1000 + i], None, &[i as u32, 1, 2, 3]))
            .collect();
        index.apply(addr(2), &many);
        assert_eq!(index.blocks_of(addr(2)), 5000);
        let removed = KvEvent::Removed {
            hashes: (0..5000u64).map(|i| 1000 + i).collect(),
        };
        index.apply(addr(2), &[removed]);
        assert_eq!(index.blocks_of(addr(2)), 0);
        assert_eq!(index.read().holders.len(), 1);
    }

    #[test]
    fn decodes_the_array_form_as_msgspec_writes_it() {
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![Value::from(7u64), Value::from(u64::MAX)]),
                    Value::Nil,
                    Value::Array((0..8u32).map(Value::from).collect()),
                    Value::from(4),
                    Value::Nil,
                    "GPU".into(),
                ]),
                Value::Array(vec![
                    "BlockRemoved".into(),
                    Value::Array(vec![Value::Binary(vec![1, 2, 3])]),
                    "GPU".into(),
                ]),
                Value::Array(vec!["AllBlocksCleared".into()]),
                Value::Array(vec!["SomethingNew".into(), Value::from(1)]),
            ]),
        ]);
        let decoded = KvEventBatch::decode(&encode(&batch)).unwrap();
        assert_eq!(decoded.ts, 1.5);
        assert_eq!(decoded.unknown, 1);
        assert_eq!(decoded.data_parallel_rank, None);
        assert_eq!(
            decoded.events,
            vec![
                KvEvent::Stored {
                    hashes: vec![7, u64::MAX],
                    parent: None,
                    token_ids: (0..8).collect(),
                    block_size: 4,
                    extra: Vec::new(),
                },
                KvEvent::Removed {
                    hashes: vec![fold(&[1, 2, 3])]
                },
                KvEvent::AllCleared,
            ]
        );
    }

    /// A random value of the kinds a publisher might put anywhere.
    fn any_value(rng: &mut fastrand::Rng) -> Value {
        match rng.u8(0..12) {
            0 => Value::Nil,
            1 => Value::from(rng.bool()),
            2 => Value::from(rng.u64(..) >> rng.u32(0..64)),
            3 => Value::from(-(rng.i64(0..i64::MAX) >> rng.u32(0..63)) - 1),
            4 => Value::F64(f64::from(rng.i32(-100..100)) / 4.0),
            5 => Value::F32(rng.u8(..) as f32),
            6 => Value::from(["GPU", "salt", "", "BlockStored"][rng.usize(0..4)]),
            7 => Value::Binary((0..rng.usize(0..12)).map(|_| rng.u8(..)).collect()),
            8 => Value::Ext(rng.i8(..), vec![1; rng.usize(0..20)]),
            9 => Value::Array(
                (0..rng.usize(0..4))
                    .map(|_| Value::from(rng.u8(..)))
                    .collect(),
            ),
            10 => Value::Map(vec![(Value::from("k"), Value::Nil)]),
            _ => Value::from(rng.u32(..)),
        }
    }

    /// Mostly the values a field should hold, sometimes any value.
    fn field_value(rng: &mut fastrand::Rng, position: usize) -> Value {
        if rng.u8(0..10) == 0 {
            return any_value(rng);
        }
        let hash = |rng: &mut fastrand::Rng| match rng.u8(0..4) {
            0 => Value::from(rng.u64(..)),
            1 => Value::from(-rng.i64(1..i64::MAX)),
            2 => Value::Binary((0..32).map(|_| rng.u8(..)).collect()),
            _ => Value::from(rng.u16(..)),
        };
        match position {
            0 => Value::Array((0..rng.usize(0..4)).map(|_| hash(rng)).collect()),
            1 => hash(rng),
            2 => Value::Array(
                (0..rng.usize(0..40))
                    .map(|_| match rng.u8(0..50) {
                        0 => Value::from(u64::from(u32::MAX) + 1),
                        1 => Value::from(-1),
                        _ => Value::from(rng.u32(0..200_000)),
                    })
                    .collect(),
            ),
            3 => Value::from(rng.u64(0..9)),
            7 => Value::Array(
                (0..rng.usize(0..4))
                    .map(|_| match rng.u8(0..3) {
                        0 => Value::Nil,
                        1 => Value::Array(vec!["adapter".into(), Value::from(rng.u8(..))]),
                        _ => Value::Array(vec![Value::from("salt")]),
                    })
                    .collect(),
            ),
            _ => any_value(rng),
        }
    }

    const NAMES: [&str; 9] = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ];

    fn any_event(rng: &mut fastrand::Rng) -> Value {
        let tag: Value = match rng.u8(0..8) {
            0..=2 => "BlockStored".into(),
            3..=4 => "BlockRemoved".into(),
            5 => "AllBlocksCleared".into(),
            6 => "SomethingNew".into(),
            _ => any_value(rng),
        };
        // Mostly every field, as vLLM writes them; sometimes fewer.
        let fields = match rng.u8(0..4) {
            0 => rng.usize(0..=NAMES.len()),
            _ => rng.usize(NAMES.len() - 1..=NAMES.len()),
        };
        if rng.bool() {
            let mut items = vec![tag];
            items.extend((0..fields).map(|position| field_value(rng, position)));
            return Value::Array(items);
        }
        let mut pairs = vec![(Value::from("type"), tag)];
        for (position, name) in NAMES.iter().enumerate().take(fields) {
            pairs.push((Value::from(*name), field_value(rng, position)));
        }
        // A name said twice, an unknown one, the order shuffled.
        if rng.u8(0..8) == 0 {
            let position = rng.usize(0..NAMES.len());
            pairs.push((Value::from(NAMES[position]), field_value(rng, position)));
        }
        if rng.bool() {
            pairs.push((Value::from("from_a_newer_vllm"), any_value(rng)));
        }
        rng.shuffle(&mut pairs);
        Value::Map(pairs)
    }

    fn any_batch(rng: &mut fastrand::Rng) -> Value {
        let events = Value::Array((0..rng.usize(0..6)).map(|_| any_event(rng)).collect());
        let ts = || Value::F64(1.5);
        if rng.bool() {
            let mut items = vec![ts(), events, Value::from(rng.u8(0..4))];
            items.truncate(rng.usize(0..=4));
            return Value::Array(items);
        }
        let mut pairs = vec![
            (Value::from("ts"), ts()),
            (Value::from("events"), events),
            (Value::from("data_parallel_rank"), Value::from(rng.u8(0..4))),
            (Value::from("other"), Value::Nil),
        ];
        pairs.truncate(rng.usize(1..=4));
        rng.shuffle(&mut pairs);
        Value::Map(pairs)
    }

    /// The in-place reader reads every batch as the tree of values did, in either form,
    /// whole, cut anywhere, or with a byte changed: the same events, or an error for both.
    #[test]
    fn the_in_place_reader_agrees_with_the_tree_of_values() {
        let mut rng = fastrand::Rng::with_seed(56);
        let same = |bytes: &[u8]| match (KvEventBatch::decode(bytes), tree::decode(bytes)) {
            (Ok(read), Ok(reference)) => assert_eq!(read, reference, "{bytes:?}"),
            (Err(_), Err(_)) => {}
            (read, reference) => panic!("{read:?} where the tree gave {reference:?}: {bytes:?}"),
        };
        let (mut decoded, mut stored) = (0, 0);
        for round in 0..20_000 {
            let bytes = encode(&any_batch(&mut rng));
            if let Ok(batch) = KvEventBatch::decode(&bytes) {
                decoded += 1;
                stored += batch
                    .events
                    .iter()
                    .filter(|e| matches!(e, KvEvent::Stored { .. }))
                    .count();
            }
            same(&bytes);
            if round % 10 == 0 {
                same(&bytes[..rng.usize(0..=bytes.len())]);
                let mut changed = bytes.clone();
                if !changed.is_empty() {
                    let at = rng.usize(0..changed.len());
                    changed[at] = rng.u8(..);
                }
                same(&changed);
            }
        }
        // The batches are not all refused: the comparison covers real events.
        assert!(decoded > 5_000 && stored > 1_000, "{decoded} {stored}");
    }

    #[test]
    fn decodes_the_map_form() {
        let map = |pairs: Vec<(&str, Value)>| {
            Value::Map(
                pairs
                    .into_iter()
                    .map(|(k, v)| (Value::from(k), v))
                    .collect(),
            )
        };
        let batch = map(vec![
            ("ts", Value::F64(2.0)),
            (
                "events",
                Value::Array(vec![map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", Value::Array(vec![Value::from(-5i64)])),
                    ("parent_block_hash", Value::from(9u64)),
                    (
                        "token_ids",
                        Value::Array((0..4u32).map(Value::from).collect()),
                    ),
                    ("block_size", Value::from(4)),
                    ("lora_id", Value::Nil),
                    ("medium", "GPU".into()),
                    ("lora_name", Value::Nil),
                    (
                        "extra_keys",
                        Value::Array(vec![Value::Array(vec!["salt".into()])]),
                    ),
                    ("group_idx", Value::from(0)),
                    ("extra_field_of_a_newer_vllm", Value::from(true)),
                ])]),
            ),
            ("data_parallel_rank", Value::from(1)),
        ]);
        let decoded = KvEventBatch::decode(&encode(&batch)).unwrap();
        assert_eq!(decoded.data_parallel_rank, Some(1));
        assert_eq!(
            decoded.events,
            vec![KvEvent::Stored {
                hashes: vec![(-5i64) as u64],
                parent: Some(9),
                token_ids: (0..4).collect(),
                block_size: 4,
                extra: vec![Some(extra_hash(&["salt".into()]))],
            }]
        );
    }

    #[test]
    fn malformed_batches_are_errors() {
        assert!(KvEventBatch::decode(b"").is_err());
        assert!(KvEventBatch::decode(&encode(&Value::from(1))).is_err());
        let short = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Array(vec![
                "BlockStored".into(),
                Value::Array(vec![Value::from(1), Value::from(2)]),
                Value::Nil,
                Value::Array(vec![Value::from(1)]),
                Value::from(4),
            ])]),
        ]);
        assert!(KvEventBatch::decode(&encode(&short)).is_err());
    }

    #[test]
    fn lookups_follow_stores_evictions_and_clears() {
        let index = PrefixIndex::default();
        let tokens: Vec<u32> = (100..116).collect();
        let keys = block_keys(&tokens, 4, None, None);
        // Backend 1 holds the first three blocks, stored in two events chained by parent.
        index.apply(addr(1), &[stored(&[11, 12], None, &tokens[..8])]);
        index.apply(addr(1), &[stored(&[13], Some(12), &tokens[8..12])]);
        // Backend 2 holds the first block only, under other engine hashes.
        index.apply(addr(2), &[stored(&[91], None, &tokens[..4])]);
        let matches = index.lookup(&keys);
        assert_eq!(matches.cached_tokens(addr(1)), 12);
        assert_eq!(matches.cached_tokens(addr(2)), 4);
        assert_eq!(matches.best(), 12);
        assert_eq!(index.blocks_of(addr(1)), 3);
        // Evicting the middle block cuts backend 1's prefix there.
        index.apply(addr(1), &[KvEvent::Removed { hashes: vec![12] }]);
        assert_eq!(index.lookup(&keys).cached_tokens(addr(1)), 4);
        // A block whose parent the index never saw is not indexed.
        index.apply(addr(2), &[stored(&[95], Some(12345), &tokens[4..8])]);
        assert_eq!(index.orphans.load(Relaxed), 1);
        index.apply(addr(1), &[KvEvent::AllCleared]);
        assert_eq!(index.lookup(&keys).cached_tokens(addr(1)), 0);
        assert_eq!(index.blocks_of(addr(1)), 0);
        index.clear(addr(2));
        assert_eq!(
            index.lookup(&keys),
            Matches {
                held: vec![],
                block_size: 4
            }
        );
        // A salted prompt's blocks are not the unsalted one's, nor another salt's.
        index.apply(
            addr(3),
            &[KvEvent::Stored {
                hashes: vec![1, 2],
                parent: None,
                token_ids: tokens[..8].to_vec(),
                block_size: 4,
                extra: vec![Some(extra_hash(&["tenant-a".into()])), None],
            }],
        );
        assert_eq!(index.lookup(&keys).best(), 0);
        assert_eq!(
            index
                .lookup(&block_keys(&tokens, 4, None, Some("tenant-b")))
                .best(),
            0
        );
        assert_eq!(
            index
                .lookup(&block_keys(&tokens, 4, None, Some("tenant-a")))
                .best(),
            8
        );
        // A LoRA adapter's blocks, its name on each (and the salt after it on the first, as
        // vLLM orders them): only that adapter's requests are credited with them.
        let sql = |first: &[&str]| {
            let first: Vec<rmpv::Value> = first.iter().map(|k| (*k).into()).collect();
            vec![Some(extra_hash(&first)), Some(extra_hash(&["sql".into()]))]
        };
        for (extra, salt) in [
            (sql(&["sql"]), None),
            (sql(&["sql", "tenant-a"]), Some("tenant-a")),
        ] {
            let index = PrefixIndex::default();
            index.apply(
                addr(4),
                &[KvEvent::Stored {
                    hashes: vec![1, 2],
                    parent: None,
                    token_ids: tokens[..8].to_vec(),
                    block_size: 4,
                    extra,
                }],
            );
            let credited = |adapter| index.lookup(&block_keys(&tokens, 4, adapter, salt)).best();
            assert_eq!(credited(Some("sql")), 8);
            assert_eq!(credited(Some("poet")), 0);
            assert_eq!(credited(None), 0);
        }
    }

    #[test]
    fn a_backend_holds_at_most_its_bound() {
        let index = PrefixIndex::default();
        let hashes: Vec<u64> = (0..MAX_BLOCKS_PER_BACKEND as u64 + 10).collect();
        let tokens: Vec<u32> = (0..hashes.len() as u32 * 4).collect();
        index.apply(addr(1), &[stored(&hashes, None, &tokens)]);
        assert_eq!(index.blocks_of(addr(1)), MAX_BLOCKS_PER_BACKEND);
        assert_eq!(index.overflowed.load(Relaxed), 10);
    }
}
