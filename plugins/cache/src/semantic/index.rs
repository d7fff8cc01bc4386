//! The embedded vector index: each stored answer's question, as a unit vector, under its
//! group (the tenant and the fingerprint of everything else in the request, so a question is
//! only ever compared with questions whose answers depend on nothing else), pointing at the
//! exact cache's entry that holds the answer.
//!
//! A group is searched by a scan of its vectors, kept in one contiguous array: exact, and
//! within a group of a few thousand 384-dimension vectors faster than a graph's hops (a
//! thousand dot products are ~0.1 ms on one core). Groups are what keeps the scan short: one
//! system prompt and sampling setup per application, one tenant each.
//!
//! Bounded by `max_bytes` over all groups (each question weighs its vector and
//! [`SLOT_BYTES`]): the oldest question goes first. A vector lives as
//! long as its answer's entry (the exact cache's TTL); an expired one is dropped when its
//! group is next searched, and a vector whose entry the exact store no longer has is removed
//! when a search finds it.

use super::learn::EntryExamples;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// What an indexed question holds besides its vector: its slot, its place in the eviction
/// order, its examples' allocation.
pub const SLOT_BYTES: usize = 192;

/// A group's id: a digest of the tenant and the request's fingerprint.
pub type GroupId = [u8; 32];

/// One indexed question.
#[derive(Debug, Clone)]
pub struct Slot {
    /// The exact cache's key digest of the entry holding the answer.
    pub entry: [u8; 32],
    pub expires: Instant,
    /// Its verified examples.
    pub examples: Arc<EntryExamples>,
    /// When it was added, in the index's own count: its eviction record names it.
    seq: u64,
}

/// A group's nearest question to a query.
#[derive(Debug, Clone)]
pub struct Nearest {
    pub slot: Slot,
    /// Cosine similarity (the vectors are unit length).
    pub similarity: f32,
}

#[derive(Debug, Default)]
struct Group {
    /// The vectors, one after another, `dim` floats each.
    vectors: Vec<f32>,
    slots: Vec<Slot>,
}

impl Group {
    fn remove(&mut self, at: usize, dim: usize) {
        let last = self.slots.len() - 1;
        self.slots.swap_remove(at);
        if at != last {
            let (head, tail) = self.vectors.split_at_mut(last * dim);
            head[at * dim..(at + 1) * dim].copy_from_slice(&tail[..dim]);
        }
        self.vectors.truncate(last * dim);
    }

    fn position(&self, entry: &[u8; 32]) -> Option<usize> {
        self.slots.iter().position(|s| &s.entry == entry)
    }
}

/// The index (see the module's header).
#[derive(Debug)]
pub struct Index {
    groups: RwLock<Groups>,
    max_bytes: usize,
}

/// Everything under the one lock: the vectors' dimension with the vectors it describes.
#[derive(Debug, Default)]
struct Groups {
    /// The vectors' dimension, once the first was added: a query of another one (the
    /// pool's model changed) finds nothing.
    dim: Option<usize>,
    by_id: HashMap<GroupId, Group>,
    /// Insertion order, for eviction: (group, entry, the slot's `seq`). A record whose slot
    /// was replaced or removed since is skipped.
    order: VecDeque<(GroupId, [u8; 32], u64)>,
    len: usize,
    next_seq: u64,
}

impl Groups {
    /// Removes `entry`'s question from `group`, when it is the one added as `seq` (any,
    /// when `None`).
    fn remove(&mut self, group: &GroupId, entry: &[u8; 32], seq: Option<u64>) {
        let Some(dim) = self.dim else {
            return;
        };
        let Some(g) = self.by_id.get_mut(group) else {
            return;
        };
        if let Some(at) = g.position(entry) {
            if seq.is_none_or(|seq| g.slots[at].seq == seq) {
                g.remove(at, dim);
                self.len -= 1;
            }
        }
        if g.slots.is_empty() {
            self.by_id.remove(group);
        }
    }
}

impl Index {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            groups: RwLock::new(Groups::default()),
            max_bytes,
        }
    }

    /// How many questions of `dim` floats fit in `max_bytes`.
    fn capacity(&self, dim: usize) -> usize {
        self.max_bytes / (dim * std::mem::size_of::<f32>() + SLOT_BYTES)
    }

    /// How many questions are indexed.
    pub fn questions(&self) -> usize {
        self.groups.read().map_or(0, |g| g.len)
    }

    /// The bytes the index holds now.
    pub fn bytes(&self) -> usize {
        self.groups.read().map_or(0, |g| {
            g.dim
                .map_or(0, |d| g.len * (d * std::mem::size_of::<f32>() + SLOT_BYTES))
        })
    }

    /// The nearest unexpired question of `group` to `query`, at least `floor` similar.
    pub fn nearest(&self, group: &GroupId, query: &[f32], floor: f32) -> Option<Nearest> {
        let now = Instant::now();
        let mut expired = false;
        let found = {
            let groups = self.groups.read().ok()?;
            if groups.dim != Some(query.len()) {
                return None;
            }
            let g = groups.by_id.get(group)?;
            let mut best: Option<(usize, f32)> = None;
            for (i, (vector, slot)) in g
                .vectors
                .chunks_exact(query.len())
                .zip(&g.slots)
                .enumerate()
            {
                if slot.expires <= now {
                    expired = true;
                    continue;
                }
                let similarity = dot(vector, query);
                if similarity >= floor && best.is_none_or(|(_, b)| similarity > b) {
                    best = Some((i, similarity));
                }
            }
            best.and_then(|(i, similarity)| {
                Some(Nearest {
                    slot: g.slots.get(i)?.clone(),
                    similarity,
                })
            })
        };
        if expired {
            self.drop_expired(group, now);
        }
        found
    }

    /// Adds `vector` (unit length) as the question of `entry` in `group`, replacing the
    /// entry's earlier one; the oldest questions go when the index is full.
    pub fn insert(&self, group: GroupId, vector: Vec<f32>, entry: [u8; 32], expires: Instant) {
        let dim = vector.len();
        let capacity = self.capacity(dim);
        if capacity == 0 {
            return;
        }
        let Ok(mut groups) = self.groups.write() else {
            return;
        };
        let groups = &mut *groups;
        if groups.dim != Some(dim) {
            // The model's dimension changed: the old vectors mean nothing now.
            *groups = Groups {
                dim: Some(dim),
                next_seq: groups.next_seq,
                ..Groups::default()
            };
        }
        groups.remove(&group, &entry, None);
        let seq = groups.next_seq;
        groups.next_seq += 1;
        let g = groups.by_id.entry(group).or_default();
        g.vectors.extend_from_slice(&vector);
        g.slots.push(Slot {
            entry,
            expires,
            examples: Arc::default(),
            seq,
        });
        groups.len += 1;
        groups.order.push_back((group, entry, seq));
        while groups.len > capacity {
            let Some((old_group, old_entry, old_seq)) = groups.order.pop_front() else {
                break;
            };
            groups.remove(&old_group, &old_entry, Some(old_seq));
        }
        // The order keeps the records of replaced and expired questions too: dropped when it
        // grows past twice the questions, in one pass over the groups.
        if groups.order.len() > 2 * capacity.max(groups.len) {
            let live: std::collections::HashSet<u64> = groups
                .by_id
                .values()
                .flat_map(|g| g.slots.iter().map(|s| s.seq))
                .collect();
            groups.order.retain(|(_, _, seq)| live.contains(seq));
        }
    }

    /// Forgets `entry`'s question in `group` (its answer is gone from the exact store).
    pub fn remove(&self, group: &GroupId, entry: &[u8; 32]) {
        if let Ok(mut groups) = self.groups.write() {
            groups.remove(group, entry, None);
        }
    }

    fn drop_expired(&self, group: &GroupId, now: Instant) {
        let Ok(mut groups) = self.groups.write() else {
            return;
        };
        let groups = &mut *groups;
        let Some(dim) = groups.dim else {
            return;
        };
        let Some(g) = groups.by_id.get_mut(group) else {
            return;
        };
        let mut i = 0;
        while i < g.slots.len() {
            if g.slots[i].expires <= now {
                g.remove(i, dim);
                groups.len -= 1;
            } else {
                i += 1;
            }
        }
        if g.slots.is_empty() {
            groups.by_id.remove(group);
        }
    }
}

/// The dot product, in four lanes so the compiler vectorizes it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_rest, b_rest) = (a_chunks.remainder(), b_chunks.remainder());
    for (x, y) in a_chunks.zip(b_chunks) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// `vector` scaled to unit length; `None` for a zero or non-finite one.
pub fn normalized(mut vector: Vec<f32>) -> Option<Vec<f32>> {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if !norm.is_finite() || norm == 0.0 {
        return None;
    }
    vector.iter_mut().for_each(|x| *x /= norm);
    Some(vector)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn unit(v: &[f32]) -> Vec<f32> {
        normalized(v.to_vec()).unwrap()
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn the_nearest_question_of_the_group_is_found_and_other_groups_are_not_searched() {
        let index = Index::new(1 << 20);
        index.insert([1; 32], unit(&[1.0, 0.0, 0.0]), [10; 32], later());
        index.insert([1; 32], unit(&[0.0, 1.0, 0.0]), [11; 32], later());
        index.insert([2; 32], unit(&[0.9, 0.1, 0.0]), [20; 32], later());
        let found = index
            .nearest(&[1; 32], &unit(&[0.8, 0.2, 0.0]), 0.5)
            .unwrap();
        assert_eq!(found.slot.entry, [10; 32]);
        assert!((found.similarity - 0.970_142_5).abs() < 1e-5);
        assert!(index
            .nearest(&[3; 32], &unit(&[1.0, 0.0, 0.0]), 0.0)
            .is_none());
        // Below the floor nothing is a neighbour.
        assert!(index
            .nearest(&[1; 32], &unit(&[0.0, 0.0, 1.0]), 0.5)
            .is_none());
    }

    #[test]
    fn the_oldest_question_goes_when_full_and_an_entry_has_one_question() {
        // Room for two questions of two floats.
        let index = Index::new(2 * (8 + SLOT_BYTES));
        index.insert([1; 32], unit(&[1.0, 0.0]), [10; 32], later());
        index.insert([1; 32], unit(&[0.0, 1.0]), [11; 32], later());
        index.insert([1; 32], unit(&[0.0, 1.0]), [11; 32], later());
        assert_eq!(index.questions(), 2);
        index.insert([2; 32], unit(&[1.0, 1.0]), [20; 32], later());
        assert_eq!(index.questions(), 2);
        assert!(index.nearest(&[1; 32], &unit(&[1.0, 0.0]), 0.9).is_none());
        index.remove(&[2; 32], &[20; 32]);
        assert_eq!(index.questions(), 1);
    }

    #[test]
    fn an_expired_question_is_not_found_and_is_dropped() {
        let index = Index::new(1 << 20);
        index.insert([1; 32], unit(&[1.0, 0.0]), [10; 32], Instant::now());
        assert!(index.nearest(&[1; 32], &unit(&[1.0, 0.0]), 0.0).is_none());
        assert_eq!(index.questions(), 0);
    }

    #[test]
    fn a_query_of_another_dimension_finds_nothing_and_a_new_dimension_starts_afresh() {
        let index = Index::new(1 << 20);
        index.insert([1; 32], unit(&[1.0, 0.0]), [10; 32], later());
        assert!(index
            .nearest(&[1; 32], &unit(&[1.0, 0.0, 0.0]), 0.0)
            .is_none());
        index.insert([1; 32], unit(&[1.0, 0.0, 0.0]), [11; 32], later());
        assert_eq!(index.questions(), 1);
    }

    #[test]
    fn a_replaced_question_is_not_evicted_by_its_old_record() {
        // Room for two questions of two floats.
        let index = Index::new(2 * (8 + SLOT_BYTES));
        index.insert([1; 32], unit(&[1.0, 0.0]), [10; 32], later());
        index.insert([1; 32], unit(&[0.0, 1.0]), [11; 32], later());
        // [10] asked again: its question is the newest now.
        index.insert([1; 32], unit(&[1.0, 0.1]), [10; 32], later());
        index.insert([2; 32], unit(&[1.0, 1.0]), [20; 32], later());
        // [11] was the oldest; [10]'s first record is stale and evicts nothing.
        assert!(index.nearest(&[1; 32], &unit(&[0.0, 1.0]), 0.99).is_none());
        assert!(index.nearest(&[1; 32], &unit(&[1.0, 0.1]), 0.99).is_some());
        assert_eq!(index.questions(), 2);
    }

    #[test]
    fn the_dot_product_reads_every_lane_and_the_tail() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let expected: f32 = a.iter().map(|x| x * x).sum();
        assert_eq!(dot(&a, &a), expected);
    }
}
