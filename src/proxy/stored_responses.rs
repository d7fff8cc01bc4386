//! Where each stored response lives. vLLM keeps a Responses API response (`store`, the
//! default) in the memory of the one engine that made it: a `previous_response_id`
//! follow-up, `GET /v1/responses/{id}` or its cancel sent to another engine of the pool gets
//! a 404. So the core notes which backend made each response as its answer passes (the id is
//! the answer's first `"id"`, before any output), and sends the follow-ups there; when that
//! backend has left its pool (or the note is older than the TTL), the client gets OpenAI's
//! 404, not a retry on an engine that never had it.
//!
//! Kept in this process's memory, bounded (the oldest notes go first, and a tenant past a
//! quarter of them loses its own oldest: no tenant pushes the others' out) and shared by every
//! generation of the config; with `responses.store: redis`, in Redis too, for a fleet of
//! proxies: a follow-up may come to another proxy than its predecessor. A note is written to
//! Redis off the request path, and read from it only when this process has none, within
//! `responses.redis.timeout` (Redis down or slow: the follow-up is OpenAI's 404, as the
//! engine's own would be on a wrong backend). A note is a few dozen bytes, kept `ttl`; vLLM
//! keeps responses only in memory, so a note cannot usefully outlive the engine's copy by
//! much.
//!
//! A note names the tenant whose request made the response, and only that tenant's requests
//! find it (an engine keeps every tenant's responses alike, and knows no tenants): another
//! tenant's follow-up, read or cancel gets the same 404 as an id never made.
//!
//! The notes outlive the process that made them, so that an upgrade or a restart does not
//! make every response the engines still hold unreachable: a stopping process writes them to
//! a file beside the upgrade socket (in the run directory, this user's alone) when its grace
//! period begins and again when it exits; a process reads that file when it starts, and again
//! whenever a lookup finds nothing and the file has changed since (the old process of an
//! upgrade writes it after the new one started).

use crate::config::ResponsesSettings;
use bytes::Bytes;
use sluice_sdk::{RedisLink, RequestCtx};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The most responses noted at once in memory; the oldest go first.
const CAPACITY: usize = 200_000;
/// The most one tenant's notes may take of them: past it, that tenant's own oldest go, so no
/// tenant's cheap requests push every other tenant's notes out.
const TENANT_SHARE: usize = CAPACITY / 4;
/// Where a response's note is in Redis: this, then its id.
const REDIS_PREFIX: &str = "sluice:response:";
/// The most bytes of an answer's start searched for its id: vLLM puts it first.
const ID_WITHIN: usize = 4096;
/// How a response's id starts in vLLM's answers and events.
const ID_KEY: &[u8] = b"\"id\":\"resp_";
/// The longest id looked up: vLLM's are `resp_` and 32 hex digits; a longer one is no
/// engine's, and is not asked of Redis.
const MAX_ID: usize = 256;

/// The file beside the upgrade socket `upgrade_sock` where the notes are handed over.
pub fn handoff_file(upgrade_sock: &str) -> PathBuf {
    PathBuf::from(format!("{upgrade_sock}.responses"))
}

/// The backend that made a response, its pool, and the tenant that asked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Home {
    pub pool: Arc<str>,
    pub backend: SocketAddr,
    /// `None` when the tenants plugin is off (or the request had no tenant).
    pub tenant: Option<Arc<str>>,
    /// The conversation's tokens once its answer ended (its prompt and output, by its
    /// usage; 0 before): the engine builds a follow-up's prompt from it, so the follow-up is
    /// estimated with it.
    pub tokens: u64,
}

impl Home {
    /// As written to Redis: `pool`, `backend`, `tenant`, `tokens`, a line each.
    fn encode(&self) -> String {
        format!(
            "{}\n{}\n{}\n{}",
            self.pool,
            self.backend,
            self.tenant.as_deref().unwrap_or(""),
            self.tokens
        )
    }

    fn decode(note: &str) -> Option<Home> {
        let mut parts = note.splitn(4, '\n');
        let (pool, backend) = (parts.next()?, parts.next()?);
        Some(Home {
            pool: Arc::from(pool),
            backend: backend.parse().ok()?,
            tenant: parts.next().filter(|t| !t.is_empty()).map(Arc::from),
            tokens: parts.next().and_then(|t| t.parse().ok()).unwrap_or(0),
        })
    }
}

/// The notes: which backend made which response.
#[derive(Debug)]
pub struct ResponseHomes {
    inner: Mutex<Notes>,
    ttl: Duration,
    redis: Option<Arc<RedisLink>>,
    /// The file the notes are handed over in, between processes; `None`: not handed over.
    handoff: Option<PathBuf>,
    /// The handoff file's modification time when it was last read.
    read_at: Mutex<Option<SystemTime>>,
}

#[derive(Debug, Default)]
struct Notes {
    by_id: HashMap<Box<str>, (Home, Instant)>,
    /// Ids in the order they were noted, for the capacity (an id whose note went already is
    /// passed over when it comes out).
    order: VecDeque<Box<str>>,
    /// Each tenant's ids in the order they were noted, for its share.
    by_tenant: HashMap<Option<Arc<str>>, VecDeque<Box<str>>>,
}

impl ResponseHomes {
    /// The notes, handed over between processes in `handoff` when set; what an earlier
    /// process left there is read at once.
    pub fn new(settings: &ResponsesSettings, handoff: Option<PathBuf>) -> Self {
        let homes = Self {
            inner: Mutex::default(),
            ttl: settings.ttl,
            redis: settings
                .redis
                .as_ref()
                .map(|r| Arc::new(RedisLink::new("responses store", r))),
            handoff,
            read_at: Mutex::new(None),
        };
        homes.read_handoff();
        homes
    }

    /// Writes every note still valid to the handoff file (whole, then renamed into place, so
    /// a reader never sees half of it): one line each, `id pool backend expiry tokens
    /// tenant`, the expiry in Unix seconds.
    pub fn hand_over(&self) {
        use std::fmt::Write as _;
        let Some(path) = &self.handoff else { return };
        let mut text = String::new();
        {
            let Ok(notes) = self.inner.lock() else { return };
            let now = SystemTime::now();
            for (id, (home, at)) in &notes.by_id {
                let Some(left) = self.ttl.checked_sub(at.elapsed()) else {
                    continue;
                };
                let expiry = (now + left)
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                let _ = writeln!(
                    text,
                    "{id} {} {} {expiry} {} {}",
                    home.pool,
                    home.backend,
                    home.tokens,
                    home.tenant.as_deref().unwrap_or("")
                );
            }
        }
        let partial = path.with_extension("responses.partial");
        let written = std::fs::write(&partial, text).and_then(|()| std::fs::rename(&partial, path));
        if let Err(e) = written {
            tracing::warn!(
                "the stored responses' notes were not handed over in {}: {e}",
                path.display()
            );
        }
    }

    /// Reads the handoff file if it changed since it was last read; whether it did.
    fn read_handoff(&self) -> bool {
        let Some(path) = &self.handoff else {
            return false;
        };
        let Ok(modified) = std::fs::metadata(path).and_then(|m| m.modified()) else {
            return false;
        };
        if self.read_at.lock().is_ok_and(|at| *at == Some(modified)) {
            return false;
        }
        // Read and parsed before the notes are locked, then taken in one go: once a handoff
        // (twice an upgrade, on a lookup that missed).
        let Ok(text) = std::fs::read_to_string(path) else {
            return false;
        };
        let now = SystemTime::now();
        let mut taken = Vec::new();
        for line in text.lines().take(CAPACITY) {
            let mut parts = line.splitn(6, ' ');
            let (Some(id), Some(pool), Some(backend), Some(expiry), Some(tokens), Some(tenant)) = (
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
            ) else {
                continue;
            };
            let (Ok(backend), Ok(expiry), Ok(tokens)) = (
                backend.parse(),
                expiry.parse::<u64>(),
                tokens.parse::<u64>(),
            ) else {
                continue;
            };
            let Ok(left) = (UNIX_EPOCH + Duration::from_secs(expiry)).duration_since(now) else {
                continue; // Expired.
            };
            if !is_id(id) {
                continue;
            }
            // Noted as long ago as its expiry says.
            let at = Instant::now()
                .checked_sub(self.ttl.saturating_sub(left))
                .unwrap_or_else(Instant::now);
            let home = Home {
                pool: Arc::from(pool),
                backend,
                tenant: (!tenant.is_empty()).then(|| Arc::from(tenant)),
                tokens,
            };
            taken.push((id, home, at));
        }
        let count = taken.len();
        if let Ok(mut notes) = self.inner.lock() {
            for (id, home, at) in taken {
                // A note this process made stands.
                if !notes.by_id.contains_key(id) {
                    note_in(&mut notes, id, home, at);
                }
            }
        }
        if let Ok(mut read_at) = self.read_at.lock() {
            *read_at = Some(modified);
        }
        tracing::info!(
            "{count} stored responses' notes taken over from {}",
            path.display()
        );
        true
    }

    /// Notes that `home` made response `id`: here at once, in Redis (when shared) by a task
    /// of its own, which is returned: the answer's end waits for it, so that no follow-up the
    /// client sends after it can reach another proxy before the note.
    pub fn remember(&self, id: &str, home: Home) -> Option<tokio::task::JoinHandle<()>> {
        self.remember_here(id, home.clone());
        let redis = Arc::clone(self.redis.as_ref()?);
        let mut set = redis::cmd("SET");
        set.arg(format!("{REDIS_PREFIX}{id}"))
            .arg(home.encode())
            .arg("EX")
            .arg(self.ttl.as_secs().max(1))
            // The first note of an id stands: no later answer takes another's response over.
            .arg("NX");
        Some(tokio::spawn(async move {
            let within = redis.timeout();
            if let Err(e) = redis.query::<()>(&set, within).await {
                tracing::debug!("a stored response's note was not written to Redis: {e:?}");
            }
        }))
    }

    fn remember_here(&self, id: &str, home: Home) {
        self.note_at(id, home, Instant::now());
    }

    /// Notes `home` for `id` as noted at `at`.
    fn note_at(&self, id: &str, home: Home, at: Instant) {
        let Ok(mut notes) = self.inner.lock() else {
            return;
        };
        note_in(&mut notes, id, home, at);
    }

    /// The backend that made response `id`, if it is noted and the note is not too old:
    /// here, else in Redis (when shared), whose answer is then kept here too.
    pub async fn find(&self, id: &str) -> Option<Home> {
        if id.len() > MAX_ID {
            return None;
        }
        if let Some(home) = self.find_here(id) {
            return Some(home);
        }
        // Another process may have handed its notes over since (the old one of an upgrade).
        if self.read_handoff() {
            if let Some(home) = self.find_here(id) {
                return Some(home);
            }
        }
        let redis = self.redis.as_ref()?;
        let mut get = redis::cmd("GET");
        get.arg(format!("{REDIS_PREFIX}{id}"));
        let note: Option<String> = match redis.query(&get, redis.timeout()).await {
            Ok(note) => note,
            Err(e) => {
                tracing::debug!("a stored response's note could not be read from Redis: {e:?}");
                None
            }
        };
        let home = Home::decode(&note?)?;
        self.remember_here(id, home.clone());
        Some(home)
    }

    /// Notes the size of response `id`'s conversation (its prompt and output), when its
    /// answer ended: here, and in Redis (when shared) by a task of its own, not waited for.
    pub fn note_tokens(&self, id: &str, tokens: u64) {
        let home = {
            let Ok(mut notes) = self.inner.lock() else {
                return;
            };
            let Some((home, _)) = notes.by_id.get_mut(id) else {
                return;
            };
            home.tokens = tokens;
            home.clone()
        };
        let Some(redis) = self.redis.as_ref().map(Arc::clone) else {
            return;
        };
        let mut set = redis::cmd("SET");
        set.arg(format!("{REDIS_PREFIX}{id}"))
            .arg(home.encode())
            .arg("EX")
            .arg(self.ttl.as_secs().max(1))
            // Only over the note there: never made anew once it is gone.
            .arg("XX");
        tokio::spawn(async move {
            if let Err(e) = redis.query::<()>(&set, redis.timeout()).await {
                tracing::debug!("a stored response's size was not written to Redis: {e:?}");
            }
        });
    }

    fn find_here(&self, id: &str) -> Option<Home> {
        let notes = self.inner.lock().ok()?;
        let (home, at) = notes.by_id.get(id)?;
        (at.elapsed() < self.ttl).then(|| home.clone())
    }
}

/// Notes `home` for `id` as noted at `at`, in `notes`: the first note of an id stands, a
/// tenant past its share loses its own oldest, the oldest go past the capacity.
fn note_in(notes: &mut Notes, id: &str, home: Home, at: Instant) {
    let id: Box<str> = id.into();

    // The first note of an id stands (an engine's ids are unique; one noted again for
    // another tenant is a client's choosing).
    match notes.by_id.get(&id) {
        Some((noted, _)) if noted.tenant != home.tenant => return,
        Some(_) => {
            notes.by_id.insert(id, (home, at));
        }
        None => {
            let tenant = home.tenant.clone();
            notes.by_id.insert(id.clone(), (home, at));
            notes.order.push_back(id.clone());
            let Notes {
                by_id, by_tenant, ..
            } = notes;
            let own = by_tenant.entry(tenant.clone()).or_default();
            own.push_back(id);
            while own.len() > TENANT_SHARE {
                let Some(old) = own.pop_front() else { break };
                if by_id
                    .get(&old)
                    .is_some_and(|(noted, _)| noted.tenant == tenant)
                {
                    by_id.remove(&old);
                }
            }
        }
    }
    while notes.by_id.len() > CAPACITY {
        let Some(old) = notes.order.pop_front() else {
            break;
        };
        notes.by_id.remove(&old);
    }
    // Ids whose note went with their tenant's share stay in the order until they come
    // out: swept when they are as many as the notes (amortized, once in CAPACITY notes).
    if notes.order.len() > 2 * CAPACITY {
        let Notes { by_id, order, .. } = notes;
        order.retain(|id| by_id.contains_key(id));
    }
}

/// A stage of a request's answer (`super::downstream::Answer`) while it may carry a stored
/// response's id: the scanner, and where to note the id.
#[derive(Debug)]
pub struct NoteHome {
    scanner: IdScanner,
    homes: Arc<ResponseHomes>,
    /// The note being written to Redis, which the answer's end waits for.
    sharing: Option<tokio::task::JoinHandle<()>>,
    /// The id noted, for its size at the answer's end.
    noted: Option<String>,
}

impl NoteHome {
    pub fn new(homes: Arc<ResponseHomes>) -> Self {
        Self {
            scanner: IdScanner::default(),
            homes,
            sharing: None,
            noted: None,
        }
    }

    /// A chunk of the request's answer passes: an upstream's answer (not a local one) is
    /// read for its id until it is found.
    pub fn passed(&mut self, ctx: &RequestCtx, chunk: Option<&Bytes>) {
        let (Some(chunk), false, true) = (chunk, ctx.answered_locally(), self.looking()) else {
            return;
        };
        let home = match (ctx.pool(), ctx.progress().backend) {
            (Some(pool), Some(backend)) => Some(Home {
                pool: Arc::clone(&pool.name),
                backend,
                tenant: ctx.tenant().map(|t| Arc::clone(&t.name)),
                tokens: 0,
            }),
            _ => None,
        };
        self.feed(chunk, ctx.progress().upstream_status, home);
    }

    /// The answer ended with `usage`: the note is shared before the answer's end reaches the
    /// client (a follow-up sent at once finds it), and learns the conversation's size after
    /// it is written, never before.
    pub async fn answer_ended(&mut self, usage: Option<sluice_sdk::Usage>) {
        if let Some(sharing) = self.sharing.take() {
            let _ = sharing.await;
        }
        if let (Some(id), Some(usage)) = (self.noted.take(), usage) {
            let tokens = usage.prompt_tokens.saturating_add(usage.completion_tokens);
            self.homes.note_tokens(&id, tokens);
        }
    }

    /// Whether the id is still being looked for.
    fn looking(&self) -> bool {
        !self.scanner.done
    }

    /// Reads a chunk of an upstream's answer (`home` made it, with status `status`); notes
    /// the id once it is found in a successful answer.
    fn feed(&mut self, chunk: &[u8], status: Option<u16>, home: Option<Home>) {
        if status != Some(200) {
            return;
        }
        if let (Some(id), Some(home)) = (self.scanner.feed(chunk), home) {
            self.sharing = self.homes.remember(&id, home);
            self.noted = Some(id);
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
        let id = std::str::from_utf8(id).ok()?;
        is_id(id).then(|| id.to_string())
    }
}

/// Whether `id` may be a response's: plain ASCII (letters, digits, `_`, `-`), at most
/// [`MAX_ID`] bytes.
fn is_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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

    #[tokio::test]
    async fn a_home_is_found_until_it_is_pushed_out() {
        let homes = ResponseHomes::new(
            &ResponsesSettings {
                ttl: Duration::from_secs(60),
                redis: None,
            },
            None,
        );
        let home = |port| Home {
            pool: Arc::from("p"),
            backend: SocketAddr::from(([127, 0, 0, 1], port)),
            tenant: None,
            tokens: 0,
        };
        assert!(
            homes.remember("resp_a", home(1)).is_none(),
            "nothing to share"
        );
        assert_eq!(homes.find("resp_a").await, Some(home(1)));
        assert_eq!(homes.find("resp_b").await, None);
        for i in 0..CAPACITY {
            homes.remember(&format!("resp_{i}"), home(2));
        }
        assert_eq!(homes.find("resp_a").await, None, "the oldest went first");
        assert_eq!(homes.find("resp_7").await, None, "past the tenant's share");
        let last = format!("resp_{}", CAPACITY - 1);
        assert_eq!(homes.find(&last).await, Some(home(2)));
    }

    /// One tenant's notes never push another's out, and no tenant takes another's id over.
    #[tokio::test]
    async fn a_tenant_keeps_its_notes_whatever_another_does() {
        let homes = ResponseHomes::new(
            &ResponsesSettings {
                ttl: Duration::from_secs(60),
                redis: None,
            },
            None,
        );
        let home = |tenant: &str, port| Home {
            pool: Arc::from("p"),
            backend: SocketAddr::from(([127, 0, 0, 1], port)),
            tenant: Some(Arc::from(tenant)),
            tokens: 0,
        };
        homes.remember("resp_mine", home("a", 1));
        homes.remember("resp_mine", home("b", 2));
        assert_eq!(homes.find("resp_mine").await, Some(home("a", 1)));
        for i in 0..CAPACITY {
            homes.remember(&format!("resp_{i}"), home("b", 2));
        }
        assert_eq!(homes.find("resp_mine").await, Some(home("a", 1)));
    }
    /// What one process noted, another finds: at its start, and when the first process
    /// hands over again after it started (an upgrade's old process at its exit).
    #[tokio::test]
    async fn the_notes_are_handed_to_the_next_process() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sluice.sock.responses");
        let settings = ResponsesSettings {
            ttl: Duration::from_secs(60),
            redis: None,
        };
        let home = |tenant: Option<&str>| Home {
            pool: Arc::from("p"),
            backend: "10.0.0.1:8000".parse().unwrap(),
            tenant: tenant.map(Arc::from),
            tokens: 0,
        };
        let old = ResponseHomes::new(&settings, Some(file.clone()));
        old.remember_here("resp_a", home(Some("t1")));
        old.remember_here("resp_b", home(None));
        old.hand_over();
        let new = ResponseHomes::new(&settings, Some(file.clone()));
        assert_eq!(new.find("resp_a").await, Some(home(Some("t1"))));
        assert_eq!(new.find("resp_b").await, Some(home(None)));
        assert_eq!(new.find("resp_c").await, None);
        // The old process answers on while the new one runs, then hands over again.
        old.remember_here("resp_c", home(Some("t2")));
        // Read again when its time changed (set ahead: a coarse clock may not move between
        // the two writes).
        let before = std::fs::metadata(&file).unwrap().modified().unwrap();
        old.hand_over();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(before + Duration::from_secs(1))
            .unwrap();
        assert_eq!(new.find("resp_c").await, Some(home(Some("t2"))));
        // Lines that are not notes, and expired notes, are passed over.
        std::fs::write(
            &file,
            "garbage\nresp_x p 10.0.0.1:8000 1 t\nresp_y p nowhere 99999999999 t\n",
        )
        .unwrap();
        let third = ResponseHomes::new(&settings, Some(file));
        assert_eq!(third.find("resp_x").await, None);
        assert_eq!(third.find("resp_y").await, None);
        assert_eq!(third.find(&"x".repeat(MAX_ID + 1)).await, None);
    }
}
