//! Request coalescing: identical cacheable requests that arrive while the first is still in
//! flight wait for its answer instead of going upstream again (per proxy instance).
//!
//! Per key there is at most one *leader* (the request sent upstream) and a queue of at most
//! `max_followers` *followers*; a request beyond the cap goes upstream alone, uncoalesced (its
//! answer is not recorded: the leader's is the one stored).
//!
//! - The leader publishes its stored answer: every follower gets it, and the key is free again.
//! - A leader that ends without an answer (an error, a cut stream, its client gone: its
//!   [`Leader`] is dropped unpublished) hands the lead to the oldest follower still waiting,
//!   and to nobody else: the others keep waiting for the new leader. A failing upstream thus
//!   sees one request at a time per key, never the whole queue at once.
//! - A follower waits at most `max_wait`. When that ends and the current leader has been in
//!   flight for `max_wait` or longer (stuck, or very slow), the follower takes the lead over
//!   and goes upstream itself, the old leader's answer still being welcome. When the current
//!   leader is younger (the lead passed on while this follower waited), the follower gives up
//!   ([`Waited::TimedOut`]) rather than add a request to a key that already has a fresh one.
//! - A follower that leaves (its client gone) leaves the queue, and passes on a lead it was
//!   handed but never read.
//!
//! - **Live fan-out** ([`crate::live`]): once a leader's upstream answers with a `200` event
//!   stream, it goes live ([`Leader::go_live`]): the followers that asked for a stream leave
//!   the queue with a place in its live log, and later ones join it at once ([`Role::Live`]),
//!   getting what was produced so far, then each event as it comes. Followers that asked for
//!   JSON still wait for the stored answer. Live followers count against `max_followers`. A
//!   live log that fails before a follower wrote anything sends it back here: it joins again
//!   (queued, not joining the failed log), so hand-overs stay one at a time.
//! - **A stream follower of a JSON leader** would see nothing until the leader's end, when
//!   going upstream itself would give it a first token much sooner: it goes upstream alone
//!   ([`Role::Alone`]) unless the leader is predicted to finish first. The prediction uses
//!   two moving averages measured here: how long JSON leaders take (join to publish), and how
//!   long stream leaders take to their first event. The leader finishes first when the
//!   first, less its time in flight so far, is at most the second. With either unmeasured
//!   yet, there is no prediction, and the follower goes upstream.
//!
//! The map's lock is held only to change the map: never across an await, and never while a
//! live `Leader` drops (its drop takes the lock again; a lead nobody took is defused first).

use crate::entry::Entry;
use crate::live::{Live, Ticket};
use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

type Digest = [u8; 32];

pub struct Inflight {
    max_followers: usize,
    max_wait: Duration,
    /// Ids of slots, leads and followers: unique, so that a stale handle never acts on a
    /// later slot of the same key.
    next_id: AtomicU64,
    slots: Mutex<HashMap<Digest, Slot>>,
    timing: Mutex<Timing>,
}

/// Moving averages, in seconds, for the prediction a stream follower of a JSON leader needs.
#[derive(Debug, Default, Clone, Copy)]
struct Timing {
    /// JSON leaders: join to publish.
    answer: Option<f64>,
    /// Stream leaders: join to their first event.
    first_event: Option<f64>,
}

/// The weight of the newest measure in [`Timing`]'s averages.
const TIMING_WEIGHT: f64 = 0.2;

fn average(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |old| old + TIMING_WEIGHT * (new - old)))
}

/// One key in flight.
struct Slot {
    id: u64,
    /// The lead that hand-overs follow; an older leader that was taken over hands nothing on.
    lead: u64,
    /// When the current lead went upstream.
    led_since: Instant,
    /// Whether the current lead asked for a stream.
    stream: bool,
    /// The current lead's live log, once it went live.
    live: Option<Arc<Live>>,
    /// Followers, oldest first.
    queue: VecDeque<Waiting>,
}

impl Slot {
    /// Followers: queued, and reading the live log.
    fn followers(&self) -> usize {
        self.queue.len() + self.live.as_ref().map_or(0, |l| l.readers())
    }

    /// The live log a new stream follower may join: not one that failed.
    fn joinable(&self) -> Option<&Arc<Live>> {
        self.live.as_ref().filter(|l| !l.failed())
    }
}

struct Waiting {
    id: u64,
    stream: bool,
    tx: oneshot::Sender<Handoff>,
}

/// What a follower is handed.
enum Handoff {
    Answer(Arc<Entry>),
    Lead(Leader),
    Live(Ticket),
}

pub enum Role {
    /// Go upstream; publish the answer, or drop the `Leader` to hand the lead on.
    Leader(Leader),
    /// Wait with [`Follower::wait`].
    Follower(Follower),
    /// Read the leader's live stream.
    Live(Ticket),
    /// The key already has `max_followers` followers, or this stream request would wait
    /// longer for a JSON leader than for an upstream: go upstream, uncoalesced.
    Alone,
}

/// How a follower's wait ended.
pub enum Waited {
    /// The answer a leader stored.
    Answer(Arc<Entry>),
    /// This request leads now: it goes upstream.
    Lead(Leader),
    /// The leader went live: read its stream.
    Live(Ticket),
    /// No answer within `max_wait`, and another request was sent upstream meanwhile.
    TimedOut,
}

impl Inflight {
    pub fn new(max_followers: usize, max_wait: Duration) -> Self {
        Self {
            max_followers,
            max_wait,
            next_id: AtomicU64::new(0),
            slots: Mutex::default(),
            timing: Mutex::default(),
        }
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The map, even after a panic elsewhere: every change to it is a single step, so it is
    /// never left half-done.
    fn slots(&self) -> MutexGuard<'_, HashMap<Digest, Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn timing(&self) -> MutexGuard<'_, Timing> {
        self.timing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a JSON leader in flight for `elapsed` is predicted to answer before a new
    /// stream request's first event would come.
    fn finishes_first(&self, elapsed: Duration) -> bool {
        let timing = *self.timing();
        match (timing.answer, timing.first_event) {
            (Some(answer), Some(first_event)) => answer - elapsed.as_secs_f64() <= first_event,
            _ => false,
        }
    }

    /// Joins the requests in flight for `digest`: the first leads, the next `max_followers`
    /// follow, any more go alone. `stream`: whether this request asks for a stream.
    pub fn join(self: &Arc<Self>, digest: Digest, stream: bool) -> Role {
        let id = self.id();
        let mut slots = self.slots();
        match slots.entry(digest) {
            MapEntry::Occupied(mut slot) => {
                let slot = slot.get_mut();
                if slot.followers() >= self.max_followers {
                    return Role::Alone;
                }
                if stream {
                    if let Some(live) = slot.joinable() {
                        return Role::Live(live.enter());
                    }
                    if !slot.stream && !self.finishes_first(slot.led_since.elapsed()) {
                        return Role::Alone;
                    }
                }
                let (tx, rx) = oneshot::channel();
                slot.queue.push_back(Waiting { id, stream, tx });
                Role::Follower(Follower {
                    inflight: self.clone(),
                    digest,
                    slot: slot.id,
                    id,
                    rx,
                })
            }
            MapEntry::Vacant(vacant) => {
                vacant.insert(Slot {
                    id,
                    lead: id,
                    led_since: Instant::now(),
                    stream,
                    live: None,
                    queue: VecDeque::new(),
                });
                Role::Leader(self.leader(digest, id, id, stream))
            }
        }
    }

    fn leader(self: &Arc<Self>, digest: Digest, slot: u64, lead: u64, stream: bool) -> Leader {
        Leader {
            inflight: Some(self.clone()),
            digest,
            slot,
            lead,
            stream,
            since: Instant::now(),
        }
    }

    /// A leader ended without an answer: the oldest follower still there leads now.
    fn hand_over(self: &Arc<Self>, digest: Digest, slot_id: u64, lead: u64) {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(&digest) else {
            return;
        };
        if slot.id != slot_id || slot.lead != lead {
            return;
        }
        // The failed lead's live log, if any, is not the new lead's.
        slot.live = None;
        while let Some(next) = slot.queue.pop_front() {
            let lead = self.id();
            slot.lead = lead;
            slot.led_since = Instant::now();
            slot.stream = next.stream;
            match next.tx.send(Handoff::Lead(self.leader(
                digest,
                slot_id,
                lead,
                next.stream,
            ))) {
                Ok(()) => return,
                // That follower has left: defuse the lead (its drop would lock again).
                Err(Handoff::Lead(mut unread)) => unread.inflight = None,
                Err(Handoff::Answer(_) | Handoff::Live(_)) => {}
            }
        }
        slots.remove(&digest);
    }

    /// A follower's `max_wait` ended: it takes a stale lead over, or gives up. `None` when it
    /// was handed something meanwhile (it is no longer queued).
    fn time_out(self: &Arc<Self>, digest: Digest, slot_id: u64, id: u64) -> Option<Waited> {
        let mut slots = self.slots();
        let slot = slots.get_mut(&digest).filter(|s| s.id == slot_id)?;
        let at = slot.queue.iter().position(|w| w.id == id)?;
        let waiting = slot.queue.remove(at)?;
        if slot.led_since.elapsed() < self.max_wait {
            return Some(Waited::TimedOut);
        }
        let lead = self.id();
        slot.lead = lead;
        slot.led_since = Instant::now();
        slot.stream = waiting.stream;
        slot.live = None;
        Some(Waited::Lead(self.leader(
            digest,
            slot_id,
            lead,
            waiting.stream,
        )))
    }

    /// A follower left: out of the queue, if still in it.
    fn leave(&self, digest: Digest, slot_id: u64, id: u64) {
        let mut slots = self.slots();
        if let Some(slot) = slots.get_mut(&digest).filter(|s| s.id == slot_id) {
            slot.queue.retain(|w| w.id != id);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots().len()
    }

    #[cfg(test)]
    fn followers(&self, digest: Digest) -> usize {
        self.slots().get(&digest).map_or(0, |s| s.queue.len())
    }

    /// Followers waiting now, for every key.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.slots().values().map(|s| s.queue.len()).sum()
    }
}

/// The leader's duty: publish the answer, or leave (on drop) so that one follower leads.
pub struct Leader {
    /// `None` once published, or for a lead that was never read.
    inflight: Option<Arc<Inflight>>,
    digest: Digest,
    slot: u64,
    lead: u64,
    /// Whether this lead's request asked for a stream.
    stream: bool,
    /// When it began to lead.
    since: Instant,
}

impl Leader {
    /// The upstream answers with a `200` event stream, which `live` now carries: the stream
    /// followers waiting leave the queue to read it, and later ones join it directly.
    pub fn go_live(&self, live: &Arc<Live>) {
        let Some(inflight) = self.inflight.as_ref() else {
            return;
        };
        let mut slots = inflight.slots();
        let Some(slot) = slots
            .get_mut(&self.digest)
            .filter(|s| s.id == self.slot && s.lead == self.lead)
        else {
            return;
        };
        slot.live = Some(live.clone());
        let (streams, rest) = std::mem::take(&mut slot.queue)
            .into_iter()
            .partition(|w| w.stream);
        slot.queue = rest;
        for follower in streams {
            // A follower that left drops its ticket with the error.
            let _ = follower.tx.send(Handoff::Live(live.enter()));
        }
    }

    /// Its stream's first event came: how long that took, for [`Inflight::finishes_first`].
    pub fn first_event(&self) {
        if let Some(inflight) = &self.inflight {
            let mut timing = inflight.timing();
            timing.first_event = average(timing.first_event, self.since.elapsed().as_secs_f64());
        }
    }

    /// Hands the stored answer to every follower; later identical requests find it in the
    /// store.
    pub fn publish(mut self, entry: Arc<Entry>) {
        let Some(inflight) = self.inflight.take() else {
            return;
        };
        if !self.stream {
            let mut timing = inflight.timing();
            timing.answer = average(timing.answer, self.since.elapsed().as_secs_f64());
        }
        let waiting = {
            let mut slots = inflight.slots();
            match slots.get(&self.digest) {
                Some(slot) if slot.id == self.slot => slots
                    .remove(&self.digest)
                    .map(|s| s.queue)
                    .unwrap_or_default(),
                _ => VecDeque::new(),
            }
        };
        for follower in waiting {
            let _ = follower.tx.send(Handoff::Answer(entry.clone()));
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if let Some(inflight) = self.inflight.take() {
            inflight.hand_over(self.digest, self.slot, self.lead);
        }
    }
}

/// A request waiting for the leader of its key; dropping it leaves the queue.
pub struct Follower {
    inflight: Arc<Inflight>,
    digest: Digest,
    slot: u64,
    id: u64,
    rx: oneshot::Receiver<Handoff>,
}

impl Follower {
    /// Waits for an answer or the lead, at most `max_wait` (then see [`Inflight::time_out`]).
    pub async fn wait(mut self) -> Waited {
        if let Ok(handed) = tokio::time::timeout(self.inflight.max_wait, &mut self.rx).await {
            return received(handed);
        }
        match self.inflight.time_out(self.digest, self.slot, self.id) {
            Some(waited) => waited,
            // Handed something while timing out: an answer is being sent, or a lead was.
            None => received((&mut self.rx).await),
        }
    }
}

fn received(handed: Result<Handoff, oneshot::error::RecvError>) -> Waited {
    match handed {
        Ok(Handoff::Answer(entry)) => Waited::Answer(entry),
        Ok(Handoff::Lead(leader)) => Waited::Lead(leader),
        Ok(Handoff::Live(ticket)) => Waited::Live(ticket),
        // Only when the plugin itself is gone (shutdown): nothing will come.
        Err(_) => Waited::TimedOut,
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        // The receiver drops after this; a lead it holds unread then hands itself on.
        self.inflight.leave(self.digest, self.slot, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::Live;
    use sluice_sdk::Endpoint;

    const LONG: Duration = Duration::from_secs(30);

    fn entry() -> Arc<Entry> {
        Arc::new(Entry {
            digest: [1; 32],
            created_unix: 0,
            kind: Endpoint::ChatCompletions,
            pool: "p".into(),
            answer: serde_json::value::to_raw_value(&serde_json::json!({}))
                .unwrap()
                .into(),
            source_bytes: 0,
        })
    }

    fn inflight(max_followers: usize, max_wait: Duration) -> Arc<Inflight> {
        Arc::new(Inflight::new(max_followers, max_wait))
    }

    fn lead(inflight: &Arc<Inflight>, key: Digest) -> Leader {
        match inflight.join(key, false) {
            Role::Leader(leader) => leader,
            _ => panic!("expected to lead"),
        }
    }

    fn follow(inflight: &Arc<Inflight>, key: Digest) -> tokio::task::JoinHandle<Waited> {
        match inflight.join(key, false) {
            Role::Follower(f) => tokio::spawn(f.wait()),
            _ => panic!("expected to follow"),
        }
    }

    /// Lets spawned followers run until they wait.
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    fn is_lead(w: &Waited) -> bool {
        matches!(w, Waited::Lead(_))
    }

    #[tokio::test]
    async fn followers_get_the_leaders_answer() {
        let inflight = inflight(8, LONG);
        let leader = lead(&inflight, [1; 32]);
        let waiters: Vec<_> = (0..3).map(|_| follow(&inflight, [1; 32])).collect();
        leader.publish(entry());
        for w in waiters {
            assert!(matches!(w.await.unwrap(), Waited::Answer(_)));
        }
        assert_eq!(inflight.len(), 0);
        assert!(matches!(inflight.join([1; 32], false), Role::Leader(_)));
    }

    #[tokio::test]
    async fn a_failed_leader_promotes_exactly_one_follower() {
        let inflight = inflight(8, LONG);
        let leader = lead(&inflight, [2; 32]);
        let mut waiters: Vec<_> = (0..4).map(|_| follow(&inflight, [2; 32])).collect();
        settle().await;
        drop(leader);
        // The oldest follower leads; the other three still wait.
        let first = waiters.remove(0).await.unwrap();
        let Waited::Lead(promoted) = first else {
            panic!("the oldest follower leads")
        };
        settle().await;
        assert!(waiters.iter().all(|w| !w.is_finished()));
        assert_eq!(inflight.followers([2; 32]), 3);
        // New identical requests follow the promoted leader too.
        assert!(matches!(inflight.join([2; 32], false), Role::Follower(_)));
        promoted.publish(entry());
        for w in waiters {
            assert!(matches!(w.await.unwrap(), Waited::Answer(_)));
        }
        assert_eq!(inflight.len(), 0);
    }

    #[tokio::test]
    async fn a_promoted_follower_that_fails_promotes_the_next() {
        let inflight = inflight(8, LONG);
        let mut leader = lead(&inflight, [3; 32]);
        let mut waiters: VecDeque<_> = (0..3).map(|_| follow(&inflight, [3; 32])).collect();
        settle().await;
        for left in (0..3).rev() {
            drop(leader);
            let Waited::Lead(next) = waiters.pop_front().unwrap().await.unwrap() else {
                panic!("the next follower leads")
            };
            leader = next;
            settle().await;
            assert_eq!(inflight.followers([3; 32]), left);
            assert!(waiters.iter().all(|w| !w.is_finished()));
        }
        // The last leader fails with nobody left: the key is free.
        drop(leader);
        assert_eq!(inflight.len(), 0);
    }

    #[tokio::test]
    async fn followers_are_capped_per_key() {
        let inflight = inflight(2, LONG);
        let leader = lead(&inflight, [4; 32]);
        let waiters: Vec<_> = (0..2).map(|_| follow(&inflight, [4; 32])).collect();
        assert!(matches!(inflight.join([4; 32], false), Role::Alone));
        assert_eq!(inflight.followers([4; 32]), 2);
        // Other keys are not affected.
        assert!(matches!(inflight.join([5; 32], false), Role::Leader(_)));
        leader.publish(entry());
        for w in waiters {
            assert!(matches!(w.await.unwrap(), Waited::Answer(_)));
        }
    }

    #[tokio::test]
    async fn a_follower_that_leaves_frees_its_place_and_is_skipped() {
        let inflight = inflight(1, LONG);
        let leader = lead(&inflight, [6; 32]);
        let gone = follow(&inflight, [6; 32]);
        settle().await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(inflight.followers([6; 32]), 0);
        let stays = follow(&inflight, [6; 32]);
        settle().await;
        drop(leader);
        assert!(is_lead(&stays.await.unwrap()));
    }

    #[tokio::test]
    async fn a_lead_handed_to_a_follower_that_never_reads_it_passes_on() {
        let inflight = inflight(8, LONG);
        let leader = lead(&inflight, [7; 32]);
        // Joined but never waiting: its lead sits unread in the channel.
        let Role::Follower(idle) = inflight.join([7; 32], false) else {
            panic!("follows")
        };
        let next = follow(&inflight, [7; 32]);
        settle().await;
        drop(leader);
        assert!(!next.is_finished(), "the idle follower holds the lead");
        drop(idle);
        assert!(is_lead(&next.await.unwrap()));
    }

    #[tokio::test]
    async fn a_follower_takes_a_stale_lead_over_and_one_only() {
        let wait = Duration::from_millis(100);
        let inflight = inflight(8, wait);
        let stale = lead(&inflight, [8; 32]);
        let waiters: Vec<_> = (0..3).map(|_| follow(&inflight, [8; 32])).collect();
        let mut took_over = None;
        let mut timed_out = 0;
        for w in waiters {
            match w.await.unwrap() {
                Waited::Lead(l) => assert!(took_over.replace(l).is_none(), "one takes over"),
                Waited::TimedOut => timed_out += 1,
                Waited::Answer(_) | Waited::Live(_) => panic!("nothing was published"),
            }
        }
        assert_eq!(timed_out, 2);
        // The stale leader failing later hands nothing on: the new leader is in flight.
        let later = follow(&inflight, [8; 32]);
        settle().await;
        drop(stale);
        settle().await;
        assert!(!later.is_finished());
        took_over.unwrap().publish(entry());
        assert!(matches!(later.await.unwrap(), Waited::Answer(_)));
    }

    #[tokio::test]
    async fn a_follower_of_a_fresh_leader_gives_up_after_max_wait() {
        let wait = Duration::from_millis(150);
        let inflight = inflight(8, wait);
        let leader = lead(&inflight, [9; 32]);
        let first = follow(&inflight, [9; 32]);
        let second = follow(&inflight, [9; 32]);
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The lead passes on 100 ms in: it is fresh when the others' wait ends.
        drop(leader);
        let Waited::Lead(_fresh) = first.await.unwrap() else {
            panic!("promoted")
        };
        assert!(matches!(second.await.unwrap(), Waited::TimedOut));
    }

    #[tokio::test]
    async fn a_stale_leader_never_touches_a_later_slot_of_its_key() {
        let inflight = inflight(8, Duration::from_millis(50));
        let stale = lead(&inflight, [10; 32]);
        let Waited::Lead(took_over) = follow(&inflight, [10; 32]).await.unwrap() else {
            panic!("takes the stale lead over")
        };
        took_over.publish(entry());
        // The key is in flight again, under a new leader.
        let current = lead(&inflight, [10; 32]);
        let waiter = follow(&inflight, [10; 32]);
        settle().await;
        drop(stale);
        settle().await;
        assert!(!waiter.is_finished(), "nobody was promoted");
        assert_eq!(inflight.followers([10; 32]), 1);
        current.publish(entry());
        assert!(matches!(waiter.await.unwrap(), Waited::Answer(_)));
    }

    fn join_stream(inflight: &Arc<Inflight>, key: Digest) -> Role {
        inflight.join(key, true)
    }

    #[tokio::test]
    async fn a_leader_going_live_takes_its_stream_followers_along_and_keeps_json_ones_waiting() {
        let inflight = inflight(3, LONG);
        let Role::Leader(leader) = join_stream(&inflight, [11; 32]) else {
            panic!("leads")
        };
        let Role::Follower(streams) = join_stream(&inflight, [11; 32]) else {
            panic!("a stream follower of a stream leader waits in the queue until it goes live")
        };
        let streams = tokio::spawn(streams.wait());
        let json = follow(&inflight, [11; 32]);
        settle().await;
        let live = Live::new(Endpoint::ChatCompletions, "p");
        leader.go_live(&live);
        assert!(matches!(streams.await.unwrap(), Waited::Live(_)));
        settle().await;
        assert!(
            !json.is_finished(),
            "a JSON follower waits for the stored answer"
        );
        // A later stream request joins the live stream at once.
        let late = join_stream(&inflight, [11; 32]);
        assert!(matches!(late, Role::Live(_)));
        // Live readers count against the cap: the queued JSON one and the late reader make 2
        // (the first reader's ticket was dropped with its task's result).
        assert_eq!(live.readers(), 1);
        let third = join_stream(&inflight, [11; 32]);
        assert!(matches!(third, Role::Live(_)));
        assert!(matches!(join_stream(&inflight, [11; 32]), Role::Alone));
        drop((late, third));
        leader.publish(entry());
        assert!(matches!(json.await.unwrap(), Waited::Answer(_)));
    }

    #[tokio::test]
    async fn a_failed_live_log_is_not_joined_and_its_lead_passes_on() {
        let inflight = inflight(8, LONG);
        let Role::Leader(leader) = join_stream(&inflight, [12; 32]) else {
            panic!("leads")
        };
        let live = Live::new(Endpoint::ChatCompletions, "p");
        leader.go_live(&live);
        let mut writer = crate::live::Writer::new(live.clone(), 1 << 20);
        writer.end(None);
        assert!(live.failed());
        // Joining again after the failure: queued, and promoted when the leader leaves.
        let Role::Follower(again) = join_stream(&inflight, [12; 32]) else {
            panic!("queued, not joined to the failed log")
        };
        let again = tokio::spawn(again.wait());
        settle().await;
        drop(leader);
        assert!(is_lead(&again.await.unwrap()));
    }

    #[tokio::test]
    async fn a_stream_follower_of_a_json_leader_goes_alone_unless_the_leader_finishes_first() {
        let inflight = inflight(8, LONG);
        let json_leader = lead(&inflight, [13; 32]);
        // Nothing measured yet: no prediction, upstream.
        assert!(matches!(join_stream(&inflight, [13; 32]), Role::Alone));
        // What the prediction needs is measured: how long a JSON leader took, and how long a
        // stream leader took to its first event.
        json_leader.publish(entry());
        let Role::Leader(stream_leader) = join_stream(&inflight, [14; 32]) else {
            panic!("leads")
        };
        stream_leader.first_event();
        let measured = *inflight.timing();
        assert!(measured.answer.is_some() && measured.first_event.is_some());
        // JSON answers quicker than a first event: the leader finishes first; follow it.
        *inflight.timing() = Timing {
            answer: Some(0.5),
            first_event: Some(1.0),
        };
        let json_leader = lead(&inflight, [13; 32]);
        assert!(matches!(
            join_stream(&inflight, [13; 32]),
            Role::Follower(_)
        ));
        // JSON answers that take long, against quick first events: upstream.
        inflight.timing().answer = Some(30.0);
        assert!(matches!(join_stream(&inflight, [13; 32]), Role::Alone));
        drop((json_leader, stream_leader));
    }
}
