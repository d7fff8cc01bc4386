//! Request coalescing: identical cacheable requests that arrive while the first is still in
//! flight wait for its answer instead of going upstream again (per proxy instance).
//!
//! The first request becomes the leader and holds a [`Leader`]; it publishes the entry once
//! its answer is complete and stored. Followers wait on a watch channel, bounded by
//! `max_wait`. If the leader fails, its `Leader` is dropped without publishing, the channel
//! closes, and the followers go upstream themselves.

use crate::entry::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

type Answer = Option<Arc<Entry>>;

#[derive(Default)]
pub struct Inflight {
    /// Held only to insert or remove a digest: never across an await.
    waiting: Mutex<HashMap<[u8; 32], watch::Receiver<Answer>>>,
}

pub enum Role {
    Leader(Leader),
    Follower(watch::Receiver<Answer>),
}

impl Inflight {
    /// Joins the requests in flight for `digest`: the first leads, the others follow.
    pub fn join(self: &Arc<Self>, digest: [u8; 32]) -> Role {
        let Ok(mut waiting) = self.waiting.lock() else {
            // A poisoned map only costs the coalescing: lead, and share with nobody.
            let (tx, _) = watch::channel(None);
            return Role::Leader(Leader {
                inflight: None,
                digest,
                tx,
            });
        };
        if let Some(rx) = waiting.get(&digest) {
            return Role::Follower(rx.clone());
        }
        let (tx, rx) = watch::channel(None);
        waiting.insert(digest, rx);
        Role::Leader(Leader {
            inflight: Some(self.clone()),
            digest,
            tx,
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiting.lock().map_or(0, |w| w.len())
    }
}

/// Waits for the leader's answer: `None` if it failed or took longer than `max_wait`.
pub async fn follow(mut rx: watch::Receiver<Answer>, max_wait: Duration) -> Option<Arc<Entry>> {
    let answer = tokio::time::timeout(max_wait, rx.wait_for(Option::is_some)).await;
    match answer {
        Ok(Ok(entry)) => entry.clone(),
        _ => None,
    }
}

/// The leader's duty: publish the answer, or leave (on drop) so that followers go on.
pub struct Leader {
    inflight: Option<Arc<Inflight>>,
    digest: [u8; 32],
    tx: watch::Sender<Answer>,
}

impl Leader {
    pub fn publish(self, entry: Arc<Entry>) {
        self.tx.send_replace(Some(entry));
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        // Later identical requests look the entry up in the store from now on.
        if let Some(inflight) = &self.inflight {
            if let Ok(mut waiting) = inflight.waiting.lock() {
                waiting.remove(&self.digest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::AnswerKind;

    fn entry() -> Arc<Entry> {
        Arc::new(Entry {
            digest: [1; 32],
            created_unix: 0,
            kind: AnswerKind::Chat,
            pool: "p".into(),
            answer: serde_json::value::to_raw_value(&serde_json::json!({})).unwrap(),
            source_bytes: 0,
        })
    }

    #[tokio::test]
    async fn followers_get_the_leaders_answer() {
        let inflight = Arc::new(Inflight::default());
        let Role::Leader(leader) = inflight.join([1; 32]) else {
            panic!("first leads")
        };
        let Role::Follower(rx) = inflight.join([1; 32]) else {
            panic!("second follows")
        };
        let waiter = tokio::spawn(follow(rx, Duration::from_secs(5)));
        leader.publish(entry());
        assert!(waiter.await.unwrap().is_some());
        assert_eq!(inflight.len(), 0);
        assert!(matches!(inflight.join([1; 32]), Role::Leader(_)));
    }

    #[tokio::test]
    async fn a_failed_leader_releases_its_followers() {
        let inflight = Arc::new(Inflight::default());
        let Role::Leader(leader) = inflight.join([2; 32]) else {
            panic!("first leads")
        };
        let Role::Follower(rx) = inflight.join([2; 32]) else {
            panic!("second follows")
        };
        let waiter = tokio::spawn(follow(rx, Duration::from_secs(30)));
        drop(leader);
        assert!(waiter.await.unwrap().is_none());
    }

    #[tokio::test]
    async fn followers_wait_a_bounded_time() {
        let inflight = Arc::new(Inflight::default());
        let _leader = inflight.join([3; 32]);
        let Role::Follower(rx) = inflight.join([3; 32]) else {
            panic!("second follows")
        };
        assert!(follow(rx, Duration::from_millis(10)).await.is_none());
    }
}
