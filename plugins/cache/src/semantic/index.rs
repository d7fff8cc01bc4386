//! The embedded vector index: each stored answer's question, as a unit vector, under its
//! group (the tenant and the fingerprint of everything else in the request, so a question is
//! only ever compared with questions whose answers depend on nothing else), pointing at the
//! exact cache's entry that holds the answer.
//!
//! A group is searched by a scan of its vectors, kept in one contiguous array: exact, and
//! within a group of a few thousand 384-dimension vectors about as fast as a graph's hops (a
//! thousand dot products are ~0.1 ms on one core). Groups are what keeps most scans short:
//! one system prompt and sampling setup per application, one tenant each.
//!
//! A group of [`GRAPH_FROM`] questions or more (one application's traffic, all under one
//! system prompt) gets a graph as well: an HNSW index (`usearch`), built on a thread of its
//! own from a copy of the group's vectors, so neither lookups nor stores wait for it. The
//! graph is never changed once built (usearch cannot grow an index while it is searched):
//! questions added since are scanned exactly, questions removed since are filtered out of
//! its answers, and it is built again when either grows past an eighth or a half of it. A
//! build runs at a lower priority than the workers and costs about 0.6 ms of CPU per
//! question (384 floats): amortized, under 5 ms per question stored in such a group.
//! Its few best candidates are re-scored against the group's own vectors, so a similarity is
//! always exact; only which question is the nearest may be missed, as with any ANN.
//!
//! Bounded by `max_bytes` over all groups (each question weighs its vector and
//! [`SLOT_BYTES`], a graph [`graph_bytes`] per question in it): the oldest question goes
//! first. A vector lives as long as its answer's entry (the exact cache's TTL); an expired one
//! is dropped when its group is next searched, and a vector whose entry the exact store no
//! longer has is removed when a search finds it.

use super::learn::EntryExamples;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// What an indexed question holds besides its vector: its slot, its place in the eviction
/// order and the group's maps, its examples' allocation.
pub const SLOT_BYTES: usize = 256;

/// The size from which a group gets a graph: below it a scan is as fast.
pub const GRAPH_FROM: usize = 4096;

/// A group's graph is dropped when the group shrinks below this.
const GRAPH_UNTIL: usize = GRAPH_FROM / 2;

/// The graph's neighbours per node (HNSW's `M`; the base layer has twice as many).
const CONNECTIVITY: usize = 16;

/// How many of the graph's nearest candidates are re-scored exactly.
const CANDIDATES: usize = 8;

/// The bytes a graph holds per question of `dim` floats: its own copy of the vector and its
/// base layer's neighbour list, with the node's header (measured as resident memory; usearch's
/// own count includes the address space it reserves).
pub const fn graph_bytes(dim: usize) -> usize {
    dim * std::mem::size_of::<f32>() + 2 * CONNECTIVITY * 4 + 64
}

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
    /// When it was added, in the index's own count: its eviction record and the graph name
    /// it.
    seq: u64,
}

impl Slot {
    /// A question of the shared index: no place in this process's order.
    pub fn shared(entry: [u8; 32], examples: Arc<EntryExamples>) -> Self {
        Self {
            entry,
            expires: Instant::now(),
            examples,
            seq: 0,
        }
    }
}

/// A group's nearest question to a query.
#[derive(Debug, Clone)]
pub struct Nearest {
    pub slot: Slot,
    /// Cosine similarity (the vectors are unit length).
    pub similarity: f32,
}

/// A built graph over a group's questions.
struct Graph {
    hnsw: usearch::Index,
    /// The questions added up to this `seq` are in it (those still in the group); later
    /// ones are scanned. (It is the newest question of the copy it was built from: every
    /// older one still in the group was in that copy.)
    through: u64,
    /// How many it holds.
    questions: usize,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("through", &self.through)
            .field("questions", &self.questions)
            .finish()
    }
}

#[derive(Debug, Default)]
struct Group {
    /// The vectors, one after another, `dim` floats each.
    vectors: Vec<f32>,
    slots: Vec<Slot>,
    /// Each question's place in `slots`, by its entry and by its `seq`.
    by_entry: HashMap<[u8; 32], usize>,
    by_seq: HashMap<u64, usize>,
    graph: Option<Arc<Graph>>,
    /// A thread builds a new graph (the build of this number); the old one serves
    /// meanwhile.
    building: Option<u64>,
    /// Its questions newer than its graph (0 without one): kept as they come and go, so
    /// that deciding on a rebuild is not a pass over the group.
    newer: usize,
}

impl Group {
    fn push(&mut self, vector: &[f32], slot: Slot) {
        // A new question's `seq` is past every graph's.
        self.newer += usize::from(self.graph.is_some());
        self.by_entry.insert(slot.entry, self.slots.len());
        self.by_seq.insert(slot.seq, self.slots.len());
        self.vectors.extend_from_slice(vector);
        self.slots.push(slot);
    }

    fn remove(&mut self, at: usize, dim: usize) {
        let last = self.slots.len() - 1;
        let gone = self.slots.swap_remove(at);
        if self.graph.as_ref().is_some_and(|g| gone.seq > g.through) {
            self.newer -= 1;
        }
        self.by_entry.remove(&gone.entry);
        self.by_seq.remove(&gone.seq);
        if at != last {
            let (head, tail) = self.vectors.split_at_mut(last * dim);
            head[at * dim..(at + 1) * dim].copy_from_slice(&tail[..dim]);
            let moved = &self.slots[at];
            self.by_entry.insert(moved.entry, at);
            self.by_seq.insert(moved.seq, at);
        }
        self.vectors.truncate(last * dim);
        if self.slots.len() < GRAPH_UNTIL {
            self.graph = None;
            self.building = None;
            self.newer = 0;
        }
    }

    fn graph(&self) -> Option<&Graph> {
        self.graph.as_deref()
    }

    /// The bytes its graph holds.
    fn graph_bytes(&self, dim: usize) -> usize {
        self.graph().map_or(0, |g| g.questions * graph_bytes(dim))
    }

    /// Whether a graph should be built now: the group is large and has none, or its graph
    /// misses too many of its questions or holds too many gone ones.
    fn wants_graph(&self) -> bool {
        if self.building.is_some() {
            return false;
        }
        match self.graph() {
            None => self.slots.len() >= GRAPH_FROM,
            Some(graph) => {
                let gone = graph
                    .questions
                    .saturating_sub(self.slots.len() - self.newer);
                self.newer > graph.questions / 8 || gone > graph.questions / 2
            }
        }
    }

    /// The best question at `i` in `slots` at least `floor` similar, among those `consider`
    /// admits, and whether an expired one was seen.
    fn scan(
        &self,
        query: &[f32],
        floor: f32,
        now: Instant,
        consider: impl Fn(&Slot) -> bool,
    ) -> (Option<(usize, f32)>, bool) {
        let mut best: Option<(usize, f32)> = None;
        let mut expired = false;
        for (i, (vector, slot)) in self
            .vectors
            .chunks_exact(query.len())
            .zip(&self.slots)
            .enumerate()
        {
            if !consider(slot) {
                continue;
            }
            if slot.expires <= now {
                expired = true;
                continue;
            }
            let similarity = dot(vector, query);
            if similarity >= floor && best.is_none_or(|(_, b)| similarity > b) {
                best = Some((i, similarity));
            }
        }
        (best, expired)
    }

    /// The graph's best live question at least `floor` similar, re-scored exactly, and
    /// whether it passed an expired one. (The filter runs inside usearch's C++: it must not
    /// panic, and does not.)
    fn search_graph(
        &self,
        graph: &Graph,
        query: &[f32],
        floor: f32,
        now: Instant,
    ) -> (Option<(usize, f32)>, bool) {
        let expired = std::cell::Cell::new(false);
        let live = |seq: u64| match self.by_seq.get(&seq).and_then(|&at| self.slots.get(at)) {
            Some(slot) if slot.expires > now => true,
            Some(_) => {
                expired.set(true);
                false
            }
            None => false,
        };
        let found = match graph.hnsw.filtered_search(query, CANDIDATES, live) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "semantic graph search failed");
                return (None, expired.get());
            }
        };
        let best = found
            .keys
            .iter()
            .filter_map(|seq| self.by_seq.get(seq).copied())
            .filter_map(|at| {
                let vector = self.vectors.get(at * query.len()..(at + 1) * query.len())?;
                Some((at, dot(vector, query)))
            })
            .filter(|&(_, similarity)| similarity >= floor)
            .max_by(|a, b| a.1.total_cmp(&b.1));
        (best, expired.get())
    }
}

/// The index (see the module's header).
#[derive(Debug, Clone)]
pub struct Index {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    groups: RwLock<Groups>,
    max_bytes: usize,
    /// The graph builds started, for tests to wait on.
    #[cfg(test)]
    builds: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
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
    /// The bytes the groups' graphs hold.
    graph_bytes: usize,
    /// Graph builds started, to number them.
    builds: u64,
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
        if let Some(&at) = g.by_entry.get(entry) {
            if seq.is_none_or(|seq| g.slots[at].seq == seq) {
                self.graph_bytes -= g.graph_bytes(dim);
                g.remove(at, dim);
                self.graph_bytes += g.graph_bytes(dim);
                self.len -= 1;
            }
        }
        if g.slots.is_empty() {
            self.by_id.remove(group);
        }
    }

    /// The bytes held: the questions, their slots and the graphs.
    fn bytes(&self) -> usize {
        self.dim.map_or(0, |d| {
            self.len * (d * std::mem::size_of::<f32>() + SLOT_BYTES) + self.graph_bytes
        })
    }

    /// Removes the oldest questions until at most `max_bytes` are held.
    fn evict(&mut self, max_bytes: usize) {
        while self.bytes() > max_bytes {
            let Some((old_group, old_entry, old_seq)) = self.order.pop_front() else {
                break;
            };
            self.remove(&old_group, &old_entry, Some(old_seq));
        }
    }
}

impl Index {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                groups: RwLock::new(Groups::default()),
                max_bytes,
                #[cfg(test)]
                builds: std::sync::Mutex::default(),
            }),
        }
    }

    /// How many questions are indexed.
    pub fn questions(&self) -> usize {
        self.shared.groups.read().map_or(0, |g| g.len)
    }

    /// The bytes the index holds now.
    pub fn bytes(&self) -> usize {
        self.shared.groups.read().map_or(0, |g| g.bytes())
    }

    /// How many groups have a graph being built.
    pub fn building(&self) -> usize {
        self.shared.groups.read().map_or(0, |g| {
            g.by_id.values().filter(|g| g.building.is_some()).count()
        })
    }

    /// How many questions the groups' graphs hold.
    pub fn graphed(&self) -> usize {
        self.shared.groups.read().map_or(0, |g| {
            g.by_id
                .values()
                .filter_map(|g| g.graph().map(|g| g.questions))
                .sum()
        })
    }

    /// The nearest unexpired question of `group` to `query`, at least `floor` similar.
    pub fn nearest(&self, group: &GroupId, query: &[f32], floor: f32) -> Option<Nearest> {
        let now = Instant::now();
        let (found, expired, wants_graph) = {
            let groups = self.shared.groups.read().ok()?;
            if groups.dim != Some(query.len()) {
                return None;
            }
            let g = groups.by_id.get(group)?;
            let (found, expired) = match g.graph() {
                None => g.scan(query, floor, now, |_| true),
                Some(graph) => {
                    let (after, expired_after) =
                        g.scan(query, floor, now, |slot| slot.seq > graph.through);
                    let (within, expired_within) = g.search_graph(graph, query, floor, now);
                    let best = [after, within]
                        .into_iter()
                        .flatten()
                        .max_by(|a, b| a.1.total_cmp(&b.1));
                    (best, expired_after || expired_within)
                }
            };
            let found = found.and_then(|(i, similarity)| {
                Some(Nearest {
                    slot: g.slots.get(i)?.clone(),
                    similarity,
                })
            });
            (found, expired, g.wants_graph())
        };
        if expired {
            self.drop_expired(group, now);
        }
        if wants_graph {
            self.build_graph(*group);
        }
        found
    }

    /// Adds `vector` (unit length) as the question of `entry` in `group`, replacing the
    /// entry's earlier one; the oldest questions go when the index is full.
    pub fn insert(&self, group: GroupId, vector: Vec<f32>, entry: [u8; 32], expires: Instant) {
        let dim = vector.len();
        if dim * std::mem::size_of::<f32>() + SLOT_BYTES > self.shared.max_bytes {
            return;
        }
        let wants_graph = {
            let Ok(mut groups) = self.shared.groups.write() else {
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
            groups.by_id.entry(group).or_default().push(
                &vector,
                Slot {
                    entry,
                    expires,
                    examples: Arc::default(),
                    seq,
                },
            );
            groups.len += 1;
            groups.order.push_back((group, entry, seq));
            groups.evict(self.shared.max_bytes);
            // The order keeps the records of replaced and expired questions too: dropped
            // when it grows past twice the questions, in one pass over the groups.
            if groups.order.len() > 2 * groups.len.max(1024) {
                let live: std::collections::HashSet<u64> = groups
                    .by_id
                    .values()
                    .flat_map(|g| g.slots.iter().map(|s| s.seq))
                    .collect();
                groups.order.retain(|(_, _, seq)| live.contains(seq));
            }
            groups.by_id.get(&group).is_some_and(Group::wants_graph)
        };
        if wants_graph {
            self.build_graph(group);
        }
    }

    /// Forgets `entry`'s question in `group` (its answer is gone from the exact store).
    pub fn remove(&self, group: &GroupId, entry: &[u8; 32]) {
        if let Ok(mut groups) = self.shared.groups.write() {
            groups.remove(group, entry, None);
        }
    }

    fn drop_expired(&self, group: &GroupId, now: Instant) {
        let Ok(mut groups) = self.shared.groups.write() else {
            return;
        };
        let groups = &mut *groups;
        let Some(g) = groups.by_id.get(group) else {
            return;
        };
        let expired: Vec<([u8; 32], u64)> = g
            .slots
            .iter()
            .filter(|s| s.expires <= now)
            .map(|s| (s.entry, s.seq))
            .collect();
        for (entry, seq) in expired {
            groups.remove(group, &entry, Some(seq));
        }
    }

    /// Starts building `group`'s graph on a thread, unless one is being built.
    fn build_graph(&self, group: GroupId) {
        let Some(build) = self.shared.mark_build(&group) else {
            return;
        };
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name("sluice-semantic-graph".into())
            .spawn(move || {
                // The graph only speeds lookups up: it takes what the requests leave.
                sluice_sdk::cpu::be_nicer();
                let mut build = Some(build);
                while let Some(this) = build {
                    build = shared.build(group, this);
                }
            });
        match spawned {
            #[cfg(test)]
            Ok(handle) => {
                if let Ok(mut builds) = self.shared.builds.lock() {
                    builds.push(handle);
                }
            }
            #[cfg(not(test))]
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "could not start a semantic graph build");
                self.shared.abandon(&group, build);
            }
        }
    }

    /// Waits for the graph builds started so far.
    #[cfg(test)]
    fn wait_for_graphs(&self) {
        let builds = std::mem::take(&mut *self.shared.builds.lock().unwrap());
        for build in builds {
            build.join().unwrap();
        }
    }
}

/// A usearch error, as words.
fn failed(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Shared {
    /// Marks `group` as having a graph built, when it wants one and none is being built:
    /// the build's number.
    fn mark_build(&self, group: &GroupId) -> Option<u64> {
        let mut groups = self.groups.write().ok()?;
        let groups = &mut *groups;
        let g = groups.by_id.get_mut(group)?;
        if !g.wants_graph() {
            return None;
        }
        groups.builds += 1;
        g.building = Some(groups.builds);
        Some(groups.builds)
    }

    /// Builds a graph over a copy of a group's questions (taken under the read lock, so
    /// lookups go on meanwhile; built with no lock held) and installs it, unless the group
    /// changed too much meanwhile (its dimension changed, it was emptied or shrank, or the
    /// build was abandoned). Then the next build's number, if the group has moved on enough
    /// for another.
    fn build(&self, group: GroupId, build: u64) -> Option<u64> {
        let (dim, seqs, vectors) = {
            let groups = self.groups.read().ok()?;
            let g = groups.by_id.get(&group)?;
            if g.building != Some(build) {
                return None;
            }
            let seqs: Vec<u64> = g.slots.iter().map(|s| s.seq).collect();
            (groups.dim?, seqs, g.vectors.clone())
        };
        let started = Instant::now();
        let built = (|| -> Result<usearch::Index, String> {
            let hnsw = usearch::Index::new(&usearch::IndexOptions {
                dimensions: dim,
                metric: usearch::MetricKind::IP,
                quantization: usearch::ScalarKind::F32,
                connectivity: CONNECTIVITY,
                expansion_add: 64,
                // 64 candidates a hop. 32 searched random vectors faster alone (0.38 against
                // 0.49 ms at 20,000), but in bench scenario 31, with questions evicted and
                // filtered out of the graph, a 20,000-question group's misses took ≤ 10 ms at
                // p99 against ≤ 1.5 ms at 64 (one run each).
                expansion_search: 64,
                multi: false,
            })
            .map_err(failed)?;
            hnsw.reserve(seqs.len()).map_err(failed)?;
            for (seq, vector) in seqs.iter().zip(vectors.chunks_exact(dim)) {
                hnsw.add(*seq, vector).map_err(failed)?;
            }
            Ok(hnsw)
        })();
        drop(vectors);
        let mut groups = self.groups.write().ok()?;
        let groups = &mut *groups;
        let same_dim = groups.dim == Some(dim);
        let g = groups.by_id.get_mut(&group)?;
        if !same_dim || g.building != Some(build) {
            return None;
        }
        g.building = None;
        match built {
            Ok(hnsw) => {
                tracing::debug!(
                    questions = seqs.len(),
                    took_ms = started.elapsed().as_secs_f64() * 1e3,
                    "semantic graph built"
                );
                groups.graph_bytes -= g.graph_bytes(dim);
                let through = seqs.iter().copied().max().unwrap_or(0);
                g.newer = g.slots.iter().filter(|s| s.seq > through).count();
                g.graph = Some(Arc::new(Graph {
                    hnsw,
                    through,
                    questions: seqs.len(),
                }));
                groups.graph_bytes += g.graph_bytes(dim);
                groups.evict(self.max_bytes);
            }
            Err(e) => {
                tracing::warn!(error = %e, "a semantic graph build failed; the group is scanned");
                return None;
            }
        }
        // Questions came and went while it was built: another build now, if they were many.
        let g = groups.by_id.get_mut(&group)?;
        if !g.wants_graph() {
            return None;
        }
        groups.builds += 1;
        g.building = Some(groups.builds);
        Some(groups.builds)
    }

    /// Marks a build that never started as not running.
    fn abandon(&self, group: &GroupId, build: u64) {
        let Ok(mut groups) = self.groups.write() else {
            return;
        };
        if let Some(g) = groups.by_id.get_mut(group) {
            if g.building == Some(build) {
                g.building = None;
            }
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

    /// `n` random unit vectors of `dim` floats (xorshift: the same every run).
    fn random_vectors(n: usize, dim: usize) -> Vec<Vec<f32>> {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 2001) as f32 / 1000.0 - 1.0
        };
        (0..n)
            .map(|_| unit(&(0..dim).map(|_| next()).collect::<Vec<_>>()))
            .collect()
    }

    fn entry(i: usize) -> [u8; 32] {
        let mut e = [0; 32];
        e[..8].copy_from_slice(&(i as u64).to_le_bytes());
        e
    }

    #[test]
    fn a_large_group_is_searched_through_its_graph_and_finds_what_a_scan_finds() {
        let dim = 32;
        let vectors = random_vectors(GRAPH_FROM + 200, dim);
        let index = Index::new(1 << 30);
        for (i, v) in vectors.iter().enumerate().take(GRAPH_FROM) {
            index.insert([1; 32], v.clone(), entry(i), later());
        }
        index.wait_for_graphs();
        assert_eq!(index.graphed(), GRAPH_FROM, "the group's graph was built");
        assert!(index.bytes() >= GRAPH_FROM * (dim * 4 + SLOT_BYTES + graph_bytes(dim)));
        // Added after the build: found by the scan beside the graph.
        for (i, v) in vectors.iter().enumerate().skip(GRAPH_FROM) {
            index.insert([1; 32], v.clone(), entry(i), later());
        }
        assert_eq!(
            index.graphed(),
            GRAPH_FROM,
            "too few new ones for a rebuild"
        );
        let mut found = 0;
        for (i, v) in vectors.iter().enumerate().step_by(41) {
            let nearest = index.nearest(&[1; 32], v, 0.99).unwrap();
            assert!(nearest.similarity > 0.999, "{}", nearest.similarity);
            found += usize::from(nearest.slot.entry == entry(i));
        }
        // Each of them is its own nearest; the graph may miss one in a hundred.
        let asked = vectors.len().div_ceil(41);
        assert!(found * 100 >= asked * 99, "{found} of {asked}");
        // A removed question is not answered from the graph.
        index.remove(&[1; 32], &entry(0));
        assert!(index.nearest(&[1; 32], &vectors[0], 0.99).is_none());
    }

    #[test]
    fn a_graph_is_rebuilt_when_its_group_moved_on_and_dropped_when_it_shrank() {
        let dim = 16;
        let vectors = random_vectors(2 * GRAPH_FROM, dim);
        let index = Index::new(1 << 30);
        for (i, v) in vectors.iter().enumerate().take(GRAPH_FROM) {
            index.insert([1; 32], v.clone(), entry(i), later());
        }
        index.wait_for_graphs();
        assert_eq!(index.graphed(), GRAPH_FROM);
        // An eighth more and one: the last insert starts a build over all of them.
        for (i, v) in vectors
            .iter()
            .enumerate()
            .skip(GRAPH_FROM)
            .take(GRAPH_FROM / 8 + 1)
        {
            index.insert([1; 32], v.clone(), entry(i), later());
        }
        index.wait_for_graphs();
        assert_eq!(index.graphed(), GRAPH_FROM + GRAPH_FROM / 8 + 1);
        // Below half the size, the group is only scanned.
        for i in 0..=(GRAPH_FROM / 2 + GRAPH_FROM / 8 + 1) {
            index.remove(&[1; 32], &entry(i));
        }
        assert_eq!(index.graphed(), 0);
        let last = GRAPH_FROM + GRAPH_FROM / 8;
        let nearest = index.nearest(&[1; 32], &vectors[last], 0.99).unwrap();
        assert_eq!(nearest.slot.entry, entry(last));
    }

    #[test]
    fn a_graph_counts_in_the_bound_and_eviction_makes_room_for_it() {
        let dim = 16;
        let per_question = dim * 4 + SLOT_BYTES;
        // Room for the group's questions and not for their graph as well.
        let index = Index::new(GRAPH_FROM * per_question + 100 * graph_bytes(dim));
        for (i, v) in random_vectors(GRAPH_FROM, dim).into_iter().enumerate() {
            index.insert([1; 32], v, entry(i), later());
        }
        index.wait_for_graphs();
        assert!(index.bytes() <= GRAPH_FROM * per_question + 100 * graph_bytes(dim));
        assert!(index.questions() < GRAPH_FROM);
    }

    #[test]
    fn the_dot_product_reads_every_lane_and_the_tail() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let expected: f32 = a.iter().map(|x| x * x).sum();
        assert_eq!(dot(&a, &a), expected);
    }
}
