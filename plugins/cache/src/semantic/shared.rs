//! The shared vector index: the questions in Redis with vector search (RediSearch, as the
//! Redis Stack server ships it), beside the exact entries the replicas already share, so a
//! question one replica stored is a neighbour for all of them.
//!
//! One hash per question, `{key_prefix}sem:{dim}:{entry}` (its group as a TAG, its vector as
//! little-endian f32), expiring with its answer's exact entry; one index per dimension over
//! them (`FT.CREATE {key_prefix}sem:{dim} … HNSW … COSINE`), made on first use and again if
//! Redis lost it. A lookup is a KNN query pre-filtered by the group's tag, so neither another
//! tenant's nor another fingerprint's questions are ever candidates; RediSearch scores the
//! candidates on the full vectors, so a similarity is exact.
//!
//! The Redis store's rules hold: lookups are bounded by its `lookup_timeout` and share its
//! cool-down (a failing Redis makes a lookup an exact miss, counted as `index_failed`), writes
//! are sent from a task of their own and dropped past [`MAX_PENDING_WRITES`]. What each entry
//! learned (its verified examples) stays the process's own: replicas learn apart.

use super::index::{GroupId, Nearest, Slot};
use super::learn::EntryExamples;
use crate::store::redis::count_semantic_write;
use redis::Value;
use sluice_sdk::redis::{RedisFailure, RedisLink, RedisSettings};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Writes (stores and removals) on their way to Redis; more are dropped.
pub const MAX_PENDING_WRITES: usize = 256;

/// Entries whose examples this process keeps; the oldest are forgotten.
const MAX_EXAMPLES: usize = 65_536;

/// The Redis index (see the module's header). Cheap to share.
#[derive(Clone)]
pub struct RedisIndex {
    inner: Arc<Inner>,
}

struct Inner {
    link: RedisLink,
    /// `{key_prefix}sem:`
    prefix: String,
    /// The dimensions whose index is known to exist.
    ready: Mutex<HashSet<usize>>,
    examples: Mutex<Examples>,
    pending: AtomicUsize,
    /// Whether the missing vector search was logged.
    warned: AtomicBool,
}

#[derive(Default)]
struct Examples {
    by_entry: HashMap<[u8; 32], Arc<EntryExamples>>,
    order: VecDeque<[u8; 32]>,
}

impl std::fmt::Debug for RedisIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisIndex")
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

/// Why a lookup found nothing to compare.
#[derive(Debug)]
pub struct IndexFailed;

impl RedisIndex {
    /// A link of its own to what `settings` names (the cache's Redis store, one node).
    pub fn new(settings: &RedisSettings, key_prefix: &str) -> Self {
        Self {
            inner: Arc::new(Inner {
                link: RedisLink::new("semantic index", settings),
                prefix: format!("{key_prefix}sem:"),
                ready: Mutex::default(),
                examples: Mutex::default(),
                pending: AtomicUsize::new(0),
                warned: AtomicBool::new(false),
            }),
        }
    }

    fn index_name(&self, dim: usize) -> String {
        format!("{}{dim}", self.inner.prefix)
    }

    fn key(&self, dim: usize, entry: &[u8; 32]) -> String {
        format!("{}{dim}:{}", self.inner.prefix, hex::encode(entry))
    }

    /// Makes the index of `dim`-float vectors, unless it is known to exist.
    async fn ensure_index(&self, dim: usize) -> Result<(), String> {
        if self.inner.ready.lock().is_ok_and(|r| r.contains(&dim)) {
            return Ok(());
        }
        let mut create = redis::cmd("FT.CREATE");
        create
            .arg(self.index_name(dim))
            .arg(&["ON", "HASH", "PREFIX", "1"][..])
            .arg(format!("{}{dim}:", self.inner.prefix))
            .arg(
                &[
                    "SCHEMA", "g", "TAG", "v", "VECTOR", "HNSW", "6", "TYPE", "FLOAT32",
                ][..],
            )
            .arg("DIM")
            .arg(dim)
            .arg(&["DISTANCE_METRIC", "COSINE"][..]);
        let made: Result<(), RedisFailure> = self
            .inner
            .link
            .query(&create, self.inner.link.connect_timeout())
            .await;
        match made {
            Ok(()) => {}
            Err(RedisFailure::Error(e)) if e.to_lowercase().contains("already exists") => {}
            Err(RedisFailure::Error(e)) if e.to_lowercase().contains("unknown command") => {
                if !self.inner.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = e,
                        "the cache's Redis has no vector search (RediSearch): semantic \
                         lookups are exact misses"
                    );
                }
                return Err(e);
            }
            Err(e) => return Err(describe(e)),
        }
        if let Ok(mut ready) = self.inner.ready.lock() {
            ready.insert(dim);
        }
        Ok(())
    }

    /// The group's nearest question to `query` at least `floor` similar, with this
    /// process's examples of its entry.
    pub async fn nearest(
        &self,
        group: &GroupId,
        query: &[f32],
        floor: f32,
    ) -> Result<Option<Nearest>, IndexFailed> {
        let dim = query.len();
        if let Err(e) = self.ensure_index(dim).await {
            tracing::debug!(error = e, "the semantic index in Redis could not be made");
            return Err(IndexFailed);
        }
        let mut search = redis::cmd("FT.SEARCH");
        search
            .arg(self.index_name(dim))
            .arg(format!(
                "(@g:{{{}}})=>[KNN 1 @v $q AS d]",
                hex::encode(group)
            ))
            .arg(&["PARAMS", "2", "q"][..])
            .arg(vector_bytes(query))
            .arg(
                &[
                    "SORTBY", "d", "RETURN", "1", "d", "LIMIT", "0", "1", "DIALECT", "2",
                ][..],
            );
        let link = &self.inner.link;
        let found = match link.query::<Value>(&search, link.timeout()).await {
            Ok(found) => found,
            Err(e) => {
                if let RedisFailure::Error(e) = &e {
                    if e.to_lowercase().contains("no such index") {
                        // Redis lost it (a flush, a restart without persistence).
                        if let Ok(mut ready) = self.inner.ready.lock() {
                            ready.remove(&dim);
                        }
                    }
                }
                tracing::debug!(error = describe(e), "semantic lookup in Redis failed");
                return Err(IndexFailed);
            }
        };
        let Some((key, distance)) = first_match(&found) else {
            return Ok(None);
        };
        // COSINE distance is 1 − cosine similarity.
        let similarity = 1.0 - distance;
        let entry = key
            .rsplit(':')
            .next()
            .and_then(|h| hex::decode(h).ok())
            .and_then(|b| <[u8; 32]>::try_from(b).ok());
        let (Some(entry), true) = (entry, similarity >= floor) else {
            return Ok(None);
        };
        Ok(Some(Nearest {
            slot: Slot::shared(entry, self.examples(entry)),
            similarity,
        }))
    }

    /// This process's examples of `entry` (made on first use; the oldest forgotten).
    fn examples(&self, entry: [u8; 32]) -> Arc<EntryExamples> {
        let Ok(mut examples) = self.inner.examples.lock() else {
            return Arc::default();
        };
        let examples = &mut *examples;
        if let Some(found) = examples.by_entry.get(&entry) {
            return Arc::clone(found);
        }
        while examples.by_entry.len() >= MAX_EXAMPLES {
            let Some(old) = examples.order.pop_front() else {
                break;
            };
            examples.by_entry.remove(&old);
        }
        examples.order.push_back(entry);
        Arc::clone(examples.by_entry.entry(entry).or_default())
    }

    /// Stores `vector` as the question of `entry` in `group` until `expires`, from a task
    /// of its own.
    pub fn insert(&self, group: GroupId, vector: Vec<f32>, entry: [u8; 32], expires: Instant) {
        let ttl = expires.saturating_duration_since(Instant::now());
        if ttl < Duration::from_millis(1) {
            return;
        }
        let index = self.clone();
        self.write(async move {
            let dim = vector.len();
            index.ensure_index(dim).await?;
            let mut set = redis::cmd("HSET");
            set.arg(index.key(dim, &entry))
                .arg("g")
                .arg(hex::encode(group))
                .arg("v")
                .arg(vector_bytes(&vector));
            let mut expire = redis::cmd("PEXPIRE");
            expire
                .arg(index.key(dim, &entry))
                .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
            let mut both = redis::pipe();
            both.atomic().add_command(set).add_command(expire);
            let within = index.inner.link.connect_timeout();
            let mut connection = index.inner.link.connection()?;
            tokio::time::timeout(within, both.query_async::<()>(&mut connection))
                .await
                .map_err(|_| "timed out".to_string())?
                .map_err(|e| e.to_string())
        });
    }

    /// Forgets `entry`'s question (its answer is gone from the exact store).
    pub fn remove(&self, dim: usize, entry: &[u8; 32]) {
        let (index, key) = (self.clone(), self.key(dim, entry));
        self.write(async move {
            let mut del = redis::cmd("DEL");
            del.arg(key);
            let link = &index.inner.link;
            link.query::<()>(&del, link.connect_timeout())
                .await
                .map_err(describe)
        });
    }

    /// Runs a write on a task, unless [`MAX_PENDING_WRITES`] are on their way (dropped and
    /// counted) or there is no runtime.
    fn write(&self, write: impl std::future::Future<Output = Result<(), String>> + Send + 'static) {
        if tokio::runtime::Handle::try_current().is_err()
            || self.inner.pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_WRITES
        {
            self.inner.pending.fetch_sub(1, Ordering::AcqRel);
            count_semantic_write(true);
            return;
        }
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            if let Err(e) = write.await {
                tracing::debug!(error = e, "a semantic index write to Redis failed");
                count_semantic_write(false);
            }
            inner.pending.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

fn describe(failure: RedisFailure) -> String {
    match failure {
        RedisFailure::CoolingDown => "cooling down".into(),
        RedisFailure::Timeout => "timed out".into(),
        RedisFailure::Error(e) => e,
    }
}

/// The bytes RediSearch reads a FLOAT32 vector from.
fn vector_bytes(vector: &[f32]) -> Vec<u8> {
    vector.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The first match of an `FT.SEARCH … RETURN 1 d` answer: its key and distance. RESP2 gives
/// `[total, key, [field, value, …], …]`; RESP3 a map with `results`.
fn first_match(found: &Value) -> Option<(String, f32)> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Double(d) => Some(d.to_string()),
        _ => None,
    };
    let distance_in = |fields: &[Value]| {
        fields
            .chunks_exact(2)
            .find(|pair| text(&pair[0]).as_deref() == Some("d"))
            .and_then(|pair| text(&pair[1])?.parse::<f32>().ok())
    };
    match found {
        Value::Array(items) => {
            let key = text(items.get(1)?)?;
            let Value::Array(fields) = items.get(2)? else {
                return None;
            };
            Some((key, distance_in(fields)?))
        }
        Value::Map(pairs) => {
            let results = pairs
                .iter()
                .find(|(k, _)| text(k).as_deref() == Some("results"))
                .map(|(_, v)| v)?;
            let Value::Array(results) = results else {
                return None;
            };
            let Value::Map(first) = results.first()? else {
                return None;
            };
            let field = |name: &str| {
                first
                    .iter()
                    .find(|(k, _)| text(k).as_deref() == Some(name))
                    .map(|(_, v)| v)
            };
            let key = text(field("id")?)?;
            let distance = match field("extra_attributes")? {
                Value::Map(attributes) => attributes
                    .iter()
                    .find(|(k, _)| text(k).as_deref() == Some("d"))
                    .and_then(|(_, v)| text(v)?.parse::<f32>().ok())?,
                _ => return None,
            };
            Some((key, distance))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resp2_search_answer_gives_its_first_key_and_distance() {
        let found = Value::Array(vec![
            Value::Int(1),
            Value::BulkString(b"sluice:sem:3:ab".to_vec()),
            Value::Array(vec![
                Value::BulkString(b"d".to_vec()),
                Value::BulkString(b"0.125".to_vec()),
            ]),
        ]);
        assert_eq!(
            first_match(&found),
            Some(("sluice:sem:3:ab".to_string(), 0.125))
        );
        assert_eq!(first_match(&Value::Array(vec![Value::Int(0)])), None);
    }

    #[test]
    fn vectors_go_as_little_endian_floats() {
        assert_eq!(vector_bytes(&[1.0, -2.0]), [0, 0, 128, 63, 0, 0, 0, 192]);
    }
}
