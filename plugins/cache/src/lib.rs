//! The `cache` plugin: answers repeated LLM requests from a cache, before any upstream is
//! touched, and fills the cache from answers as they stream to the client.
//!
//! - **Key** ([`key`]): SHA-256 over the tenant, the endpoint, configured headers and the
//!   whole request in canonical JSON. Tenants never share entries unless told to.
//! - **Policy** ([`policy`]): deterministic requests only by default; `cache-control:
//!   no-cache` skips the lookup but may store, `no-store` does neither; TTL per model or
//!   endpoint.
//! - **Hits** are served in the form the client asks for, whatever form filled the entry
//!   (SSE or JSON, [`entry`]), with a fresh `id` and `created`, `x-cache: HIT` and `age`.
//! - **Tee**: each chunk of an upstream answer is kept as it passes (a reference-counted
//!   clone; the client is not delayed). When the answer completed normally (status 200, a
//!   stream ended by `[DONE]` after finish reasons, no error event, the client still there,
//!   under `max_entry_bytes`) it is assembled and stored in the logging phase, once the
//!   client has it all. The answer's usage is asked of the core for every request that may
//!   be stored, so an entry filled from a stream whose client did not ask for usage keeps it.
//! - **Stores** ([`store`]): `memory` (TinyUFO, bounded by bytes) or `redis` (single node or
//!   Cluster, with a lookup timeout and a cool-down; a failing Redis never fails a request).
//! - **Coalescing** ([`coalesce`]): identical requests in flight wait for the first one; when
//!   it fails, one of them at a time goes upstream in its place. Those that ask for a stream
//!   follow a streaming leader live ([`live`]): what it produced so far at once, then each
//!   event as it comes, under their own `id`.
//!
//! ```yaml
//! plugins:
//!   cache:
//!     enabled: true
//!     store: memory            # or redis (see conf/examples/redis-cache.yaml)
//!     memory: {max_bytes: 268435456}
//!     ttl: 1h
//!     cacheable: deterministic # or all
//!     tenant: {anonymous: bypass}  # requests without identity; `share`: one partition
//! ```

pub mod coalesce;
pub mod config;
pub mod entry;
pub mod key;
pub mod live;
mod metrics;
pub mod policy;
pub mod semantic;
pub mod store;

pub use config::CacheConfig;
use config::SemanticConfig;

use bytes::Bytes;
use coalesce::{Follower, Inflight, Leader, Role, Waited};
use entry::{not_stored_label, Entry, NotStored};
use http::{HeaderName, HeaderValue};
use live::{Live, Reader, Readiness, Writer};
use policy::Use;
use semantic::{Decision, Neighbour, Semantic};
use sluice_sdk::calls::PoolCalls;
use sluice_sdk::client::{watch, while_connected, Watched};
use sluice_sdk::config::header_name;
use sluice_sdk::cpu::body_work;
use sluice_sdk::headers::{self, is_event_stream};
use sluice_sdk::MemoryBudget;
use sluice_sdk::Pool;
use sluice_sdk::{
    async_trait, AnswerText, Client, ConfigError, Endpoint, Error, ErrorReply, Flow, Host, LlmCall,
    LocalResponse, Plugin, PluginBuilder, RequestCtx, ResponseHeader, Result, Tenant,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use store::{memory::MemoryStore, redis::RedisStore, CacheKey, Store, WriteOutcome};

/// Writes queued for Redis hold at most this fraction of the memory budget (N12).
const WRITE_SHARE_OF_BUDGET: usize = 4;

/// The section, checked, with its header names parsed.
pub struct CacheBuilder {
    config: CacheConfig,
    /// What queued Redis writes take their bytes from.
    memory: Arc<MemoryBudget>,
    key_headers: Vec<HeaderName>,
    /// The semantic part's settings, its pool and the core's way to it, when configured.
    semantic: Option<(SemanticConfig, Arc<Pool>, Arc<dyn PoolCalls>)>,
}

impl PluginBuilder for CacheBuilder {
    const NAME: &'static str = "cache";
    type Config = CacheConfig;

    /// A disabled cache's section is checked for its keys and types only.
    fn resolve(config: CacheConfig, host: &Host) -> std::result::Result<Option<Self>, ConfigError> {
        if !config.enabled {
            return Ok(None);
        }
        config.validate()?;
        let key_headers = config
            .key_headers
            .iter()
            .enumerate()
            .map(|(i, h)| header_name(&format!("key_headers[{i}]"), h))
            .collect::<std::result::Result<_, _>>()?;
        let semantic = match &config.semantic {
            None => None,
            Some(semantic) => {
                let pool = host.pools.get(&semantic.pool).ok_or_else(|| {
                    ConfigError::new(
                        "semantic.pool",
                        format!("no pool is named `{}`", semantic.pool),
                    )
                })?;
                Some((semantic.clone(), Arc::clone(pool), Arc::clone(&host.calls)))
            }
        };
        Ok(Some(Self {
            config,
            memory: Arc::clone(&host.memory),
            key_headers,
            semantic,
        }))
    }

    /// Redis is connected in the background: Sluice starts without it.
    fn start(self) -> Arc<dyn Plugin> {
        Arc::new(Cache::new(self))
    }
}

pub struct Cache {
    config: CacheConfig,
    store: Arc<dyn Store>,
    inflight: Arc<Inflight>,
    key_headers: Vec<HeaderName>,
    /// Near-duplicate questions' answers, when configured.
    semantic: Option<Semantic>,
    /// Fresh ids for answers served from the cache: `<nonce><counter>`.
    id_nonce: u64,
    id_counter: AtomicU64,
}

/// What the cache knows of one request.
struct State {
    result: Lookup,
    key: CacheKey,
    ttl: Duration,
    kind: Endpoint,
    tee: Tee,
    leader: Option<Leader>,
    /// The leader's stream, published to its live followers.
    live: Option<Writer>,
    /// A coalesced follower that read the leader's stream live (not its stored answer).
    followed_live: bool,
    /// An identical request in flight leads this key, and this one went upstream beside it
    /// (beyond `max_followers`, or a stream that would wait too long for a JSON leader): the
    /// leader's answer is the one stored, so this one's is not kept to be stored again (a
    /// thousand identical streams would each hold their whole answer).
    behind_leader: bool,
    /// The tokens the client allowed (`sluice_sdk::context::output_budget`): an answer that
    /// stopped for `length` short of it was cut by a model's context, and is not stored.
    output_budget: u64,
    /// A semantic lookup that sent the request upstream: its answer is compared with the
    /// neighbour's and its question indexed.
    asked: Option<semantic::Asked>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lookup {
    Hit,
    Coalesced,
    Miss,
}

/// What is recorded of the upstream's answer while it may still be stored.
#[derive(Default)]
struct Tee {
    recording: bool,
    event_stream: bool,
    /// A JSON answer's chunks. A stream's answer is added up in its live log instead (see
    /// [`live`]): a thousand open streams hold their answers so far, not their events.
    chunks: Vec<Bytes>,
    bytes: usize,
    too_big: bool,
    ended: bool,
}

impl Cache {
    fn new(ready: CacheBuilder) -> Self {
        let CacheBuilder {
            config,
            memory,
            key_headers,
            semantic,
        } = ready;
        let semantic = semantic.map(|(settings, pool, calls)| {
            // Validated: `index: redis` comes with a single-node Redis store.
            let shared = match (settings.index, &config.redis) {
                (config::IndexKind::Redis, Some(redis)) => Some(semantic::shared::RedisIndex::new(
                    &redis.settings(),
                    &config.key_prefix,
                )),
                _ => None,
            };
            Semantic::new(pool, calls, settings, shared)
        });
        let store: Arc<dyn Store> = match (&config.store, &config.redis) {
            (config::StoreKind::Redis, Some(redis)) => {
                // Queued writes are optional: a quarter of the budget at most, so that a slow
                // Redis never leaves the requests without memory.
                let share = memory.share(memory.limit() / WRITE_SHARE_OF_BUDGET);
                Arc::new(RedisStore::connect(redis.clone(), share))
            }
            _ => Arc::new(MemoryStore::new(config.memory.max_bytes)),
        };
        metrics::init(store.name());
        Self {
            store,
            inflight: Arc::new(Inflight::new(
                config.coalesce.max_followers,
                config.coalesce.max_wait,
            )),
            key_headers,
            semantic,
            id_nonce: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            id_counter: AtomicU64::new(0),
            config,
        }
    }

    /// A fresh `id` for an answer Sluice serves itself.
    fn fresh_id(&self, kind: Endpoint) -> String {
        let prefix = kind.family().id_prefix();
        let n = self.id_counter.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{n:016x}", self.id_nonce)
    }

    /// The answer to a hit, in the form the request asks for.
    fn answer(&self, entry: &Entry, call: &LlmCall) -> Result<LocalResponse> {
        let id = self.fresh_id(entry.kind);
        let now = unix_now();
        let (content_type, body) = if call.request.is_stream() {
            let body = entry.render_sse(&id, now, call.request.include_usage());
            ("text/event-stream", body)
        } else {
            ("application/json", entry.render_json(&id, now))
        };
        let mut header = ResponseHeader::build(200, Some(5))?;
        header.insert_header(http::header::CONTENT_TYPE, content_type)?;
        header.insert_header(http::header::CONTENT_LENGTH, body.len())?;
        header.insert_header(http::header::AGE, now.saturating_sub(entry.created_unix))?;
        header.insert_header(headers::POOL, entry.pool.as_str())?;
        Ok(LocalResponse {
            header,
            body,
            stream: None,
        })
    }

    /// The answer of a live follower: the leader's stream as it comes, under its own id.
    fn live_answer(&self, reader: Reader) -> Result<LocalResponse> {
        let mut header = ResponseHeader::build(200, Some(5))?;
        header.insert_header(http::header::CONTENT_TYPE, "text/event-stream")?;
        header.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
        header.insert_header(http::header::AGE, 0)?;
        header.insert_header(headers::POOL, reader.live().pool())?;
        Ok(LocalResponse {
            header,
            body: Bytes::new(),
            stream: Some(Box::new(reader)),
        })
    }

    /// What the request's key is made of besides its body: its partition (the tenant) and
    /// the extra parts. `None` when the request may not use the cache: it has no identity
    /// and anonymous requests bypass.
    fn key_parts(
        &self,
        client: &dyn Client,
        tenant: Option<&Tenant>,
        call: &LlmCall,
    ) -> Option<KeyParts> {
        let headers = &client.request_header().headers;
        let tenant = key::partition(
            headers,
            tenant,
            self.config.tenant.anonymous,
            self.config.tenant.share_across_tenants,
        )?;
        let mut extra: Vec<(String, Vec<u8>)> = self
            .key_headers
            .iter()
            .map(|h| {
                let value = headers.get(h).map_or(&b""[..], |v| v.as_bytes());
                (h.as_str().to_string(), value.to_vec())
            })
            .collect();
        // A tier asked for changes which pool answers: a forced-target request never gets a
        // draft's answer, nor the reverse.
        if let Some(tier) = headers.get(&sluice_sdk::headers::TIER) {
            extra.push((
                sluice_sdk::headers::TIER.to_string(),
                tier.as_bytes().to_vec(),
            ));
        }
        // A model named in the path (not the body) chooses the answer as the body's does. No
        // header is named with a space, so this cannot be a header's value.
        if let Some(model) = &call.route.model {
            extra.push(("path model".to_string(), model.as_bytes().to_vec()));
        }
        Some(KeyParts {
            tenant: Arc::from(tenant),
            extra: Arc::new(extra),
        })
    }

    /// The request's key: hashed off the workers when the body is large (see
    /// [`sluice_sdk::cpu`]). `None` when its body cannot be keyed.
    async fn key_for(&self, parts: &KeyParts, call: &LlmCall) -> Option<CacheKey> {
        let (endpoint, body, parts) = (call.endpoint, call.body.clone(), parts.clone());
        let digest = body_work(body.len(), move || parts.digest(endpoint, &body)).await??;
        Some(CacheKey::new(&self.config.key_prefix, digest))
    }

    async fn lookup(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        let started = Instant::now();
        let found = self.store.get(key).await;
        metrics::lookup(self.store.name(), started.elapsed().as_secs_f64());
        match found {
            Ok(entry) => entry,
            Err(e) => {
                let kind = match e {
                    store::StoreError::Timeout => "timeout",
                    store::StoreError::CoolingDown => "cooldown",
                    store::StoreError::Failed(_) => "error",
                };
                metrics::lookup_error(self.store.name(), kind);
                tracing::debug!("cache lookup failed, going upstream: {e}");
                None
            }
        }
    }
}

#[async_trait]
impl Plugin for Cache {
    fn name(&self) -> &'static str {
        CacheBuilder::NAME
    }

    async fn request(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<Flow> {
        let Some(call) = ctx.llm() else {
            return Ok(Flow::Continue);
        };
        let use_ = policy::decide(&self.config, call, &client.request_header().headers);
        // The key (a second parse of the body, and a hash) only when the cache takes part.
        let parts = match use_ {
            Use::Bypass => None,
            _ => self.key_parts(client, ctx.tenant().map(|t| &**t), call),
        };
        let key = match &parts {
            Some(parts) => self.key_for(parts, call).await,
            None => None,
        };
        let (Some(key), Some(parts)) = (key, parts) else {
            metrics::request(metrics::Outcome::Bypass);
            ctx.state.insert(Bypassed);
            return Ok(Flow::Continue);
        };
        let mut state = self.state(key, call);
        if use_ == Use::LookupAndStore {
            match self.find(client, call, &state.key, &parts).await? {
                Found::Semantic(neighbour) => {
                    let mut response = self.answer(&neighbour.entry, call)?;
                    response.header.insert_header(
                        semantic::SIMILARITY_HEADER,
                        format!("{:.4}", neighbour.similarity),
                    )?;
                    metrics::request(metrics::Outcome::Hit);
                    return Ok(answered_locally(ctx, state, Lookup::Hit, response));
                }
                Found::Asked(asked, leader) => {
                    state.asked = Some(asked);
                    state.leader = leader;
                }
                Found::Entry(entry, result) => {
                    let response = self.answer(&entry, call)?;
                    metrics::request(match result {
                        Lookup::Coalesced => metrics::Outcome::Coalesced,
                        _ => metrics::Outcome::Hit,
                    });
                    return Ok(answered_locally(ctx, state, result, response));
                }
                Found::Live(reader) => {
                    metrics::request(metrics::Outcome::Coalesced);
                    let response = self.live_answer(reader)?;
                    state.followed_live = true;
                    return Ok(answered_locally(ctx, state, Lookup::Coalesced, response));
                }
                Found::Upstream(leader) => state.leader = leader,
                Found::BehindLeader => state.behind_leader = true,
            }
        }
        metrics::request(metrics::Outcome::Miss);
        ctx.state.insert(state);
        // An entry keeps its answer's usage, whichever form later hits ask for.
        ctx.want_usage();
        Ok(Flow::Continue)
    }

    fn response_header(&self, response: &mut ResponseHeader, ctx: &mut RequestCtx) -> Result<()> {
        let upstream_ok =
            ctx.progress().upstream_status == Some(200) && response.status.as_u16() == 200;
        // The pool itself (a reference count), not a copy of its name: the name is needed
        // only when a stream starts being recorded.
        let pool = ctx.pool().cloned();
        let pool = pool.as_ref().map_or("-", |p| &*p.name);
        let label = if ctx.state.get::<Bypassed>().is_some() {
            "BYPASS"
        } else if let Some(state) = ctx.state.get_mut::<State>() {
            // Record only an upstream's 200 to a miss: never an error, never Sluice's own.
            state.tee.recording =
                state.result == Lookup::Miss && upstream_ok && !state.behind_leader;
            state.tee.event_stream = is_event_stream(response);
            // A stream is added up in a live log, followed or not (a leader's followers read
            // it). A retried attempt's header comes again: the log is made once.
            if state.tee.recording && state.tee.event_stream && state.live.is_none() {
                let live = Live::new(state.kind, pool);
                if let Some(leader) = state.leader.as_ref() {
                    leader.go_live(&live);
                }
                state.live = Some(Writer::new(live, self.config.max_entry_bytes));
            }
            match state.result {
                Lookup::Hit | Lookup::Coalesced => "HIT",
                Lookup::Miss => "MISS",
            }
        } else {
            return Ok(());
        };
        headers::edit(response, |map| {
            map.insert(headers::CACHE, HeaderValue::from_static(label));
        });
        Ok(())
    }

    fn response_headers_added(&self) -> usize {
        1
    }

    fn response_body(
        &self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let usage = ctx.usage();
        let Some(state) = ctx.state.get_mut::<State>() else {
            return Ok(());
        };
        if let Some(live) = state.live.as_mut() {
            if let Some(chunk) = body.as_ref() {
                if live.feed(chunk) {
                    if let Some(leader) = &state.leader {
                        leader.first_event();
                    }
                }
            }
            if end_of_stream {
                live.end(usage);
            }
        }
        let (tee, live) = (&mut state.tee, &state.live);
        if !tee.recording {
            return Ok(());
        }
        if let Some(chunk) = body.as_ref() {
            tee.bytes += chunk.len();
            if tee.bytes > self.config.max_entry_bytes {
                tee.too_big = true;
                tee.recording = false;
                tee.chunks = Vec::new();
                return Ok(());
            }
            if live.is_none() {
                tee.chunks.push(chunk.clone());
            }
        }
        tee.ended |= end_of_stream;
        Ok(())
    }

    fn logging(&self, error: Option<&Error>, ctx: &mut RequestCtx) {
        let Some(mut state) = ctx.state.remove::<State>() else {
            return;
        };
        if state.result == Lookup::Coalesced {
            if let Some(first_byte) = ctx.progress().first_byte {
                metrics::coalesced_first_byte(state.followed_live, first_byte.as_secs_f64());
            }
        }
        if state.result != Lookup::Miss || state.behind_leader {
            return;
        }
        let usage = ctx.usage();
        let streamed = state.live.take().and_then(|writer| {
            // A stream's answer was added up in its live log as it passed.
            let answer = (state.tee.recording && state.tee.ended)
                .then(|| writer.answer(usage))
                .flatten();
            // A stream that did not end fails its live followers as its writer goes (before
            // the lead passes on, so that those that wrote nothing join the new leader's queue).
            drop(writer);
            answer
        });
        // Dropping the leader without publishing hands the lead to one follower.
        let leader = state.leader.take();
        let tee = std::mem::take(&mut state.tee);
        let outcome = if tee.too_big {
            "too_big"
        } else if !tee.recording {
            "not_ok"
        } else if !tee.ended || ctx.progress().response_incomplete || error.is_some() {
            "incomplete"
        } else {
            // The client has its whole answer by now: storing it here delays nobody, and
            // leaves the in-flight list before any later identical request can join it.
            write_back(
                self.store.as_ref(),
                self.semantic.as_ref(),
                state,
                tee,
                streamed,
                ctx.pool_name(),
                leader,
            );
            return;
        };
        metrics::write(outcome);
    }

    /// The semantic part's index and what it learned, when it is on.
    fn status(&self) -> Option<serde_json::Value> {
        let semantic = self.semantic.as_ref()?;
        Some(serde_json::json!({"semantic": semantic.status()}))
    }

    /// The server is stopping: queued writes get their bounded chance to reach the store.
    async fn stop(&self, within: Duration) {
        self.store.flush(within).await;
    }
}

impl Cache {
    /// What the cache keeps of a request it takes part in, before the lookup: a miss.
    fn state(&self, key: CacheKey, call: &LlmCall) -> State {
        State {
            result: Lookup::Miss,
            key,
            ttl: policy::ttl(&self.config, call.request.model.as_deref(), call.endpoint),
            kind: call.endpoint,
            tee: Tee::default(),
            leader: None,
            live: None,
            followed_live: false,
            behind_leader: false,
            output_budget: sluice_sdk::context::output_budget(call),
            asked: None,
        }
    }

    /// The stored answer to `key`; on a miss, a near-duplicate question's answer when the
    /// semantic part may serve it; then, with coalescing on, what the identical requests in
    /// flight give this one.
    async fn find(
        &self,
        client: &mut dyn Client,
        call: &LlmCall,
        key: &CacheKey,
        parts: &KeyParts,
    ) -> Result<Found> {
        if let Some(entry) = self.lookup(key).await {
            return Ok(Found::Entry(entry, Lookup::Hit));
        }
        let asked = match &self.semantic {
            None => None,
            Some(semantic) => match self.by_meaning(semantic, client, call, parts).await? {
                Decision::Serve(neighbour) => return Ok(Found::Semantic(neighbour)),
                Decision::Upstream(asked) => Some(asked),
                Decision::Skip => None,
            },
        };
        let found = self.find_inflight(client, call, key).await?;
        Ok(match (asked, found) {
            (Some(asked), Found::Upstream(leader)) => Found::Asked(asked, leader),
            (_, found) => found,
        })
    }

    /// A semantic lookup for the request (see [`semantic`]): `Err` when the client left
    /// while its question was embedded.
    async fn by_meaning(
        &self,
        semantic: &Semantic,
        client: &mut dyn Client,
        call: &LlmCall,
        parts: &KeyParts,
    ) -> Result<Decision> {
        let started = Instant::now();
        let (endpoint, body, key_parts) = (call.endpoint, call.body.clone(), parts.clone());
        let read = body_work(body.len(), move || {
            let question = endpoint.family().question(&body)?;
            let group = key_parts.digest(endpoint, &question.rest)?;
            Some((question.text, question.agentic, group))
        })
        .await
        .flatten();
        let Some((text, agentic, group)) = read else {
            semantic::note_skip("no_question");
            return Ok(Decision::Skip);
        };
        if text.len() > semantic::MAX_QUESTION_BYTES {
            semantic::note_skip("too_long");
            return Ok(Decision::Skip);
        }
        if agentic && !semantic.takes_agents(call.endpoint) {
            semantic::note_skip("agent");
            return Ok(Decision::Skip);
        }
        let (vector, embedding) = match while_connected(client, semantic.embed(&text)).await {
            Ok(Some(embedded)) => embedded,
            Ok(None) => return Ok(Decision::Skip),
            Err(gone) => return Err(client_left(gone)),
        };
        let neighbour = match semantic.nearest(&group, &vector).await {
            Err(_) => return Ok(Decision::Skip),
            Ok(None) => None,
            Ok(Some(near)) => {
                let key = CacheKey::new(&self.config.key_prefix, near.slot.entry);
                match self.lookup(&key).await {
                    Some(entry) => Some(Neighbour {
                        slot: near.slot,
                        similarity: near.similarity,
                        entry,
                    }),
                    None => {
                        semantic.forget(&group, &near.slot.entry, vector.len());
                        None
                    }
                }
            }
        };
        let decision = semantic.decide(group, vector, neighbour);
        semantic.took(started.elapsed().saturating_sub(embedding));
        Ok(decision)
    }

    /// On a miss, with coalescing on, what the identical requests in flight give this one.
    async fn find_inflight(
        &self,
        client: &mut dyn Client,
        call: &LlmCall,
        key: &CacheKey,
    ) -> Result<Found> {
        // A stream whose family cannot be relayed live is not made to wait for a whole answer.
        let waits_whole = call.request.is_stream() && !call.endpoint.family().relays_live();
        if !self.config.coalesce.enabled || waits_whole {
            return Ok(Found::Upstream(None));
        }
        self.coalesce(client, call, key).await
    }

    /// Joins the identical requests in flight: waits for their answer, follows their stream
    /// live, leads them upstream, or goes upstream uncoalesced ([`Role::Alone`]).
    async fn coalesce(
        &self,
        client: &mut dyn Client,
        call: &LlmCall,
        key: &CacheKey,
    ) -> Result<Found> {
        let stream = call.request.is_stream();
        let mut role = self.inflight.join(key.digest, stream);
        loop {
            let ticket = match role {
                Role::Leader(leader) => return Ok(Found::Upstream(Some(leader))),
                Role::Alone => return Ok(Found::BehindLeader),
                Role::Follower(follower) => match follow(client, follower).await? {
                    Waited::Answer(entry) => return Ok(Found::Entry(entry, Lookup::Coalesced)),
                    Waited::Lead(leader) => return Ok(Found::Upstream(Some(leader))),
                    Waited::Live(ticket) => ticket,
                    Waited::TimedOut => return Err(timed_out()),
                },
                Role::Live(ticket) => ticket,
            };
            let reader = ticket.reader(
                self.fresh_id(call.endpoint),
                unix_now(),
                call.request.include_usage(),
            );
            match self.first_bytes(client, reader).await? {
                Some(reader) => return Ok(Found::Live(reader)),
                // The leader failed before this follower wrote anything: it coalesces
                // again, as a follower of a failed leader would.
                None => role = self.inflight.join(key.digest, stream),
            }
        }
    }

    /// Waits for a live follower's first bytes while watching the client, at most
    /// `max_wait`: the reader, or `None` when the leader failed before this follower wrote
    /// anything.
    async fn first_bytes(
        &self,
        client: &mut dyn Client,
        mut reader: Reader,
    ) -> Result<Option<Reader>> {
        let deadline = tokio::time::Instant::now() + self.config.coalesce.max_wait;
        loop {
            match reader.readiness() {
                Readiness::Ready => return Ok(Some(reader)),
                Readiness::Failed => return Ok(None),
                Readiness::Waiting => {}
            }
            match watch(client, reader.changed(), deadline).await {
                Watched::Done(()) => {}
                Watched::Deadline => return Err(timed_out()),
                Watched::ClientGone(e) => return Err(client_left(e)),
            }
        }
    }
}

/// A follower's wait ended without an answer: `504`, counted as a miss.
fn timed_out() -> Box<Error> {
    metrics::request(metrics::Outcome::Miss);
    ErrorReply::gateway_timeout(
        "An identical request is in flight and its answer did not come in time; try again.",
    )
    .into_error()
}

/// A waiting follower's client left (or sent data it should not have): counted as a miss.
fn client_left(gone: Box<Error>) -> Box<Error> {
    metrics::request(metrics::Outcome::Miss);
    gone
}

/// Waits as a follower while watching the client: `Err` when the client left (its place in
/// the queue, and any lead it was handed, pass on).
async fn follow(client: &mut dyn Client, follower: Follower) -> Result<Waited> {
    // On the request's trace span, when traces are on.
    tracing::info!(target: sluice_sdk::SPAN_EVENTS, "coalesced_follower");
    while_connected(client, follower.wait())
        .await
        .map_err(client_left)
}

/// What a request that may be answered from the cache gets before going upstream.
enum Found {
    /// A near-duplicate question's answer, within the error bound.
    Semantic(Neighbour),
    /// Nothing: the request goes upstream (leading the identical ones when it holds the
    /// lead), and its answer is compared with a semantic neighbour's and indexed.
    Asked(semantic::Asked, Option<Leader>),
    /// A stored answer (`Hit`), or the one an identical request published (`Coalesced`).
    Entry(Arc<Entry>, Lookup),
    /// An identical request's stream, followed live, its first bytes already there.
    Live(Reader),
    /// Nothing: the request goes upstream, leading the identical ones when it holds the lead.
    Upstream(Option<Leader>),
    /// Nothing: the request goes upstream beside the leader of its key, which stores the
    /// answer.
    BehindLeader,
}

/// The request is answered by the cache with `response`: the core sends it, and the later
/// hooks know how the request was served.
fn answered_locally(
    ctx: &mut RequestCtx,
    mut state: State,
    result: Lookup,
    response: LocalResponse,
) -> Flow {
    ctx.mark_answered_locally();
    state.result = result;
    ctx.state.insert(state);
    Flow::Respond(Box::new(response))
}

/// Marks a request the cache stays out of (`x-cache: BYPASS`).
struct Bypassed;

/// What a request's key is made of besides its body and endpoint (see
/// [`Cache::key_parts`]): shared by the exact key and the semantic group.
#[derive(Clone)]
struct KeyParts {
    tenant: Arc<str>,
    extra: Arc<Vec<(String, Vec<u8>)>>,
}

impl KeyParts {
    /// The digest of `body` sent to `endpoint` with these parts.
    fn digest(&self, endpoint: Endpoint, body: &[u8]) -> Option<[u8; 32]> {
        let extra: Vec<(&str, &[u8])> = self
            .extra
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        key::digest(&self.tenant, endpoint, &extra, body)
    }
}

/// Stores a complete answer (never waiting on the network) and hands it to the requests that
/// waited for it: a stream's, added up as it passed (`streamed`), or the tee's JSON.
fn write_back(
    store: &dyn Store,
    semantic: Option<&Semantic>,
    mut state: State,
    tee: Tee,
    streamed: Option<Result<AnswerText, NotStored>>,
    pool: &str,
    leader: Option<Leader>,
) {
    let answer = match (streamed, tee.event_stream, tee.chunks.as_slice()) {
        (Some(answer), _, _) => answer,
        // A stream that outgrew its log's bound (the tee's is the same).
        (None, true, _) => Err(NotStored::Incomplete),
        // A JSON answer usually arrives in one chunk: no copy then.
        (None, false, [one]) => entry::from_json(state.kind, one.clone()),
        (None, false, chunks) => entry::from_json(state.kind, Bytes::from(chunks.concat())),
    };
    let answer = match answer {
        // Cut by a draft's context: another pool would have answered in full.
        Ok(answer) if answer.cut_by_context(state.output_budget) => {
            metrics::write(not_stored_label(NotStored::Incomplete));
            return;
        }
        Ok(answer) => answer,
        Err(reason) => {
            metrics::write(not_stored_label(reason));
            return;
        }
    };
    let entry = Arc::new(Entry {
        digest: state.key.digest,
        created_unix: unix_now(),
        kind: state.kind,
        pool: pool.to_string(),
        answer,
        source_bytes: tee.bytes,
    });
    let stored = store.put(&state.key, entry.clone(), state.ttl);
    metrics::write(match stored {
        WriteOutcome::Accepted => "stored",
        WriteOutcome::Dropped => "dropped",
    });
    // The waiting requests first: the comparison below reads two whole answers.
    if let Some(leader) = leader {
        leader.publish(Arc::clone(&entry));
    }
    if let (Some(semantic), Some(asked)) = (semantic, state.asked.take()) {
        let expires = Instant::now() + state.ttl;
        let stored = stored == WriteOutcome::Accepted;
        semantic.answered(asked, &entry.answer, state.key.digest, stored, expires);
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The request hook against fake clients: coalesced followers, without sockets.
#[cfg(test)]
mod tests {
    use super::*;
    use sluice_testkit::{plugin_host, routed_chat, run_until_waiting, FakeClient};

    const ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}"#;

    fn cache() -> Cache {
        let config: CacheConfig =
            serde_json::from_value(serde_json::json!({"enabled": true})).unwrap();
        let host = plugin_host(Vec::new());
        Cache::new(CacheBuilder::resolve(config, &host).unwrap().unwrap())
    }

    /// One client of the key `sk-1` asking the same question.
    fn asking() -> (FakeClient, RequestCtx) {
        let client =
            FakeClient::post("/v1/chat/completions").with_header("authorization", "Bearer sk-1");
        // Deterministic, so cached by default.
        let body = r#"{"model":"m","messages":[{"role":"user","content":"The capital of France?"}],"temperature":0}"#;
        (client, routed_chat(body))
    }

    /// The leader's upstream answers `200` with [`ANSWER`], which passes to its client whole.
    fn answer_as_leader(cache: &Cache, ctx: &mut RequestCtx) {
        ctx.progress_mut().upstream_status = Some(200);
        let mut header = ResponseHeader::build(200, None).unwrap();
        header
            .insert_header("content-type", HeaderValue::from_static("application/json"))
            .unwrap();
        cache.response_header(&mut header, ctx).unwrap();
        let mut body = Some(Bytes::from_static(ANSWER.as_bytes()));
        cache.response_body(&mut body, true, ctx).unwrap();
        cache.logging(None, ctx);
    }

    #[tokio::test]
    async fn a_follower_waits_for_the_leaders_answer_and_is_answered_with_it() {
        let cache = cache();
        let (mut first, mut leading) = asking();
        assert!(matches!(
            cache.request(&mut first, &mut leading).await,
            Ok(Flow::Continue)
        ));
        let (mut second, mut following) = asking();
        let followed = {
            let asked = cache.request(&mut second, &mut following);
            tokio::pin!(asked);
            run_until_waiting(&mut asked, || cache.inflight.waiting() == 1).await;
            answer_as_leader(&cache, &mut leading);
            asked.await
        };
        let Ok(Flow::Respond(answer)) = followed else {
            panic!("the follower was not answered locally");
        };
        assert_eq!(answer.header.status.as_u16(), 200);
        let body: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "Paris.");
        assert_eq!(cache.inflight.waiting(), 0);
    }

    #[tokio::test]
    async fn a_follower_whose_client_leaves_stops_waiting_and_the_leader_goes_on() {
        let cache = cache();
        let (mut first, mut leading) = asking();
        cache.request(&mut first, &mut leading).await.unwrap();
        let (mut second, mut following) = asking();
        let leave = second.leaving();
        let followed = {
            let asked = cache.request(&mut second, &mut following);
            tokio::pin!(asked);
            run_until_waiting(&mut asked, || cache.inflight.waiting() == 1).await;
            leave.now();
            asked.await
        };
        let e = followed.err().unwrap();
        assert_eq!(e.etype(), &sluice_sdk::ErrorType::ConnectionClosed);
        assert_eq!(cache.inflight.waiting(), 0);
        // The leader's answer is stored all the same: the next identical request hits it.
        answer_as_leader(&cache, &mut leading);
        let (mut third, mut later) = asking();
        let hit = cache.request(&mut third, &mut later).await;
        assert!(
            matches!(hit, Ok(Flow::Respond(_))),
            "the stored answer is served"
        );
    }
}
