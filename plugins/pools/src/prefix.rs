//! Prefix-aware routing of a pool with a tokenizer (`pools[].tokenizer`) and KV events
//! (`pools[].kv_events`): the request's prompt blocks as the engines hash them, looked up in the
//! pool's [`PrefixIndex`], give each backend the prompt tokens its prefix cache would serve.
//!
//! Tokenizing costs about 0.65 µs a token of text not seen before (2.8 ms for 15 KB of chat),
//! tens of microseconds for messages seen before (the tokenizer remembers them; `sluice-bench`
//! scenario 24 measures both). The request path tokenizes once per request and pool, and hands
//! bodies over [`PrefixRouting::INLINE_BYTES`] to Tokio's blocking pool, so that a large prompt
//! never holds an async worker.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use sluice_llm::model_name::tenant_cache_salt;
use sluice_llm::Endpoint;
use sluice_tokenizer::PromptTokenizer;

use crate::prefix_index::{block_keys, Matches, PrefixIndex};

/// Where a pool's backends publish their KV events (`pools[].kv_events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEventSource {
    /// As each backend's `GET /kv_event_sources` says (vLLM 0.32).
    Auto,
    /// Each backend's publisher on this port of its own address.
    Port(u16),
}

/// A pool's tokenizer and prefix index.
#[derive(Debug)]
pub struct PrefixRouting {
    /// The pool's tokenizer folder, loaded.
    pub tokenizer: Arc<PromptTokenizer>,
    /// Where the backends' KV events come from.
    pub kv_events: KvEventSource,
    /// Which backend holds which blocks.
    pub index: PrefixIndex,
    /// Of the answers whose engine reported its cached tokens, those the index predicted.
    pub predicted_tokens: AtomicU64,
    /// Prompt tokens of the requests sent with a lookup.
    pub looked_up_tokens: AtomicU64,
    /// Prompt tokens the engines reported cached (`prompt_tokens_details.cached_tokens`), of
    /// requests routed with the index.
    pub reported_tokens: AtomicU64,
    /// Requests whose prompt the tokenizer could not read (sent without the index).
    pub unreadable: AtomicU64,
}

/// What the index predicted of a request's attempt: kept in the request's state until its
/// answer's usage says what the engine served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Predicted {
    /// Prompt tokens predicted cached on the backend chosen.
    pub tokens: u64,
}

/// A request's prompt as the index sees it: its blocks' keys and its token count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixKeys {
    /// The keys of the prompt's full blocks.
    pub keys: Vec<u64>,
    /// The prompt's tokens.
    pub tokens: usize,
}

impl PrefixRouting {
    /// Bodies up to this size are tokenized on the async worker; larger ones on the
    /// blocking pool.
    pub const INLINE_BYTES: usize = 16 * 1024;

    /// A pool's prefix routing with `tokenizer`, its events from `kv_events`.
    pub fn new(tokenizer: Arc<PromptTokenizer>, kv_events: KvEventSource) -> Self {
        PrefixRouting {
            tokenizer,
            kv_events,
            index: PrefixIndex::default(),
            predicted_tokens: AtomicU64::new(0),
            looked_up_tokens: AtomicU64::new(0),
            reported_tokens: AtomicU64::new(0),
            unreadable: AtomicU64::new(0),
        }
    }

    /// The keys of `body` (a request to `endpoint`) as the index keys blocks; `None` when the
    /// tokenizer cannot read it (it then goes without the index). The engine keys every
    /// block of a LoRA `adapter`'s request with its name, and salts the prompt's first block
    /// with the request's `cache_salt` as it gets it: `tenant`'s own when the pool gives each
    /// tenant one (`salt_for_tenant`), else the client's.
    pub fn keys(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        adapter: Option<&str>,
        salt_for_tenant: Option<&str>,
    ) -> Option<PrefixKeys> {
        let tokenized = match endpoint {
            Endpoint::ChatCompletions => self.tokenizer.tokenize_chat(body),
            Endpoint::Completions => self.tokenizer.tokenize_completion(body),
            // Not yet rendered as the engine renders them (Messages and Responses convert to
            // a chat first): the approximate affinity places them. The others fill no cache.
            _ => return None,
        };
        match tokenized {
            Ok(tokenized) => {
                let client = tokenized.cache_salt.as_deref();
                let salt = match salt_for_tenant {
                    Some(tenant) => {
                        let json = tenant_cache_salt(tenant, client.map(str::as_bytes));
                        serde_json::from_slice::<String>(&json).ok()
                    }
                    None => client.and_then(|json| serde_json::from_str::<String>(json).ok()),
                };
                Some(PrefixKeys {
                    keys: block_keys(
                        &tokenized.ids,
                        self.index.block_size(),
                        adapter,
                        salt.as_deref(),
                    ),
                    tokens: tokenized.ids.len(),
                })
            }
            Err(error) => {
                self.unreadable.fetch_add(1, Relaxed);
                tracing::debug!(%error, "a prompt the pool's tokenizer cannot read");
                None
            }
        }
    }

    /// [`PrefixRouting::keys`] off the async workers when the body is large.
    pub async fn keys_off_worker(
        self: &Arc<Self>,
        endpoint: Endpoint,
        body: bytes::Bytes,
        adapter: Option<Arc<str>>,
        salt_for_tenant: Option<Arc<str>>,
    ) -> Option<PrefixKeys> {
        if body.len() <= Self::INLINE_BYTES {
            return self.keys(
                endpoint,
                &body,
                adapter.as_deref(),
                salt_for_tenant.as_deref(),
            );
        }
        let routing = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            routing.keys(
                endpoint,
                &body,
                adapter.as_deref(),
                salt_for_tenant.as_deref(),
            )
        })
        .await
        .ok()
        .flatten()
    }
}

/// What a selection credits each backend's prefix cache with, in the request's estimated
/// tokens (the unit the balancer's predictions use).
#[derive(Debug, Clone)]
pub(crate) enum Credit {
    /// Nothing is known: no backend is credited.
    Nothing,
    /// The approximate affinity's guess, for its home backend.
    Guess,
    /// The exact index: each backend's leading blocks held, scaled from the prompt's
    /// `tokens` to its `estimate`.
    Exact {
        matches: Matches,
        tokens: u64,
        estimate: u64,
    },
}

impl Credit {
    /// The exact index's cached tokens at `addr`, in estimated tokens.
    pub(crate) fn exact(&self, addr: std::net::SocketAddr) -> Option<u64> {
        match self {
            Credit::Exact {
                matches,
                tokens,
                estimate,
            } => {
                let cached = matches.served_tokens(addr, *tokens);
                Some(match *tokens {
                    0 => 0,
                    tokens => u64::try_from(
                        u128::from(cached) * u128::from(*estimate) / u128::from(tokens),
                    )
                    .unwrap_or(*estimate),
                })
            }
            _ => None,
        }
    }

    /// Whether the exact index knows of any backend holding a block of the prompt.
    pub(crate) fn any_exact(&self) -> bool {
        matches!(self, Credit::Exact { matches, .. } if matches.best() > 0)
    }
}
