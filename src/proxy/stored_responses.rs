//! Where each stored response lives. vLLM keeps a Responses API response (`store`, the
//! default) in the memory of the one engine that made it: a `previous_response_id`
//! follow-up, `GET /v1/responses/{id}` or its cancel sent to another engine of the pool gets
//! a 404. So the core notes which backend made each response as its answer passes (the id is
//! the answer's first `"id"`, before any output), and sends the follow-ups there; when that
//! backend has left its pool (or the note is older than the TTL), the client gets OpenAI's
//! 404, not a retry on an engine that never had it.
//!
//! Kept in this process's memory, bounded (the oldest notes go first) and shared by every
//! generation of the config. A note is a few dozen bytes; vLLM itself keeps responses only
//! in memory, so a note cannot usefully outlive the engine's own copy by much.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most responses noted at once; the oldest go first.
const CAPACITY: usize = 200_000;
/// How long a note is kept.
const TTL: Duration = Duration::from_secs(6 * 3600);
/// The most bytes of an answer's start searched for its id: vLLM puts it first.
const ID_WITHIN: usize = 4096;
/// How a response's id starts in vLLM's answers and events.
const ID_KEY: &[u8] = b"\"id\":\"resp_";

/// The backend that made a response, and its pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Home {
    pub pool: Arc<str>,
    pub backend: SocketAddr,
}

/// The notes: which backend made which response.
#[derive(Debug, Default)]
pub struct ResponseHomes {
    inner: Mutex<Notes>,
}

#[derive(Debug, Default)]
struct Notes {
    by_id: HashMap<Box<str>, (Home, Instant)>,
    /// Ids in the order they were noted, for the capacity.
    order: VecDeque<Box<str>>,
}

impl ResponseHomes {
    /// Notes that `home` made response `id`.
    pub fn remember(&self, id: &str, home: Home) {
        let Ok(mut notes) = self.inner.lock() else {
            return;
        };
        let id: Box<str> = id.into();
        if notes
            .by_id
            .insert(id.clone(), (home, Instant::now()))
            .is_none()
        {
            notes.order.push_back(id);
        }
        while notes.order.len() > CAPACITY {
            if let Some(old) = notes.order.pop_front() {
                notes.by_id.remove(&old);
            }
        }
    }

    /// The backend that made response `id`, if it is noted and the note is not too old.
    pub fn find(&self, id: &str) -> Option<Home> {
        let notes = self.inner.lock().ok()?;
        let (home, at) = notes.by_id.get(id)?;
        (at.elapsed() < TTL).then(|| home.clone())
    }
}

/// In a request's state while its answer may carry a stored response's id: the scanner, and
/// where to note the id.
#[derive(Debug)]
pub struct NoteHome {
    scanner: IdScanner,
    homes: Arc<ResponseHomes>,
}

impl NoteHome {
    pub fn new(homes: Arc<ResponseHomes>) -> Self {
        Self {
            scanner: IdScanner::default(),
            homes,
        }
    }

    /// Whether the id is still being looked for.
    pub fn looking(&self) -> bool {
        !self.scanner.done
    }

    /// Reads a chunk of an upstream's answer (`home` made it, with status `status`); notes
    /// the id once it is found in a successful answer.
    pub fn feed(&mut self, chunk: &[u8], status: Option<u16>, home: Option<Home>) {
        if status != Some(200) {
            return;
        }
        if let (Some(id), Some(home)) = (self.scanner.feed(chunk), home) {
            self.homes.remember(&id, home);
        }
    }
}

/// Finds a response's id in the first bytes of its answer (a JSON body or its stream), as
/// they pass: nothing is kept but those first bytes, at most [`ID_WITHIN`].
#[derive(Debug, Default)]
pub struct IdScanner {
    seen: Vec<u8>,
    done: bool,
}

impl IdScanner {
    /// Looks at the next chunk; the id, once, when it is found.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        let room = ID_WITHIN.saturating_sub(self.seen.len());
        self.seen
            .extend_from_slice(chunk.get(..room.min(chunk.len()))?);
        let Some(at) = memchr::memmem::find(&self.seen, ID_KEY) else {
            self.done = self.seen.len() >= ID_WITHIN;
            return None;
        };
        let start = at + ID_KEY.len() - "resp_".len();
        let Some(len) = self
            .seen
            .get(start..)
            .and_then(|rest| memchr::memchr(b'"', rest))
        else {
            self.done = self.seen.len() >= ID_WITHIN;
            return None;
        };
        self.done = true;
        let id = self.seen.get(start..start + len)?;
        // An id is plain ASCII (letters, digits, `_`, `-`): anything else is not one.
        id.iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-')
            .then(|| String::from_utf8_lossy(id).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_found_across_chunks_in_answers_and_streams() {
        let stream = b"event: response.created\ndata: {\"response\":{\"id\":\"resp_af47\",\"created_at\":1}}\n\n";
        for cut in [1, 20, 45, 50, stream.len()] {
            let mut scanner = IdScanner::default();
            let first = scanner.feed(&stream[..cut]);
            let found = first.or_else(|| scanner.feed(&stream[cut..]));
            assert_eq!(found.as_deref(), Some("resp_af47"), "cut at {cut}");
            assert_eq!(scanner.feed(b"\"id\":\"resp_other\""), None, "once");
        }
        let mut scanner = IdScanner::default();
        assert_eq!(
            scanner
                .feed(br#"{"id":"resp_8d9e","created_at":1,"output":[]}"#)
                .as_deref(),
            Some("resp_8d9e")
        );
        // Far past the start, an id is some text's, not the response's.
        let mut scanner = IdScanner::default();
        let late = [vec![b' '; ID_WITHIN], br#""id":"resp_x""#.to_vec()].concat();
        assert_eq!(scanner.feed(&late), None);
    }

    #[test]
    fn a_home_is_found_until_it_is_pushed_out() {
        let homes = ResponseHomes::default();
        let home = |port| Home {
            pool: Arc::from("p"),
            backend: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        homes.remember("resp_a", home(1));
        assert_eq!(homes.find("resp_a"), Some(home(1)));
        assert_eq!(homes.find("resp_b"), None);
        for i in 0..CAPACITY {
            homes.remember(&format!("resp_{i}"), home(2));
        }
        assert_eq!(homes.find("resp_a"), None, "the oldest went first");
        assert_eq!(homes.find("resp_7"), Some(home(2)));
    }
}
