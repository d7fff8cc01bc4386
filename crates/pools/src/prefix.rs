//! Prefix-aware routing of a pool with a tokenizer (`pools[].tokenizer`) and KV events
//! (`pools[].kv_events`): the request's prompt blocks as the engines hash them, looked up in the
//! pool's [`PrefixIndex`], give each backend the prompt tokens its prefix cache would serve.
//!
//! Tokenizing costs about 0.65 µs a token of text not seen before (2.8 ms for 15 KB of chat),
//! tens of microseconds for messages seen before (the tokenizer remembers them; `sluice-bench`
//! scenario 24 measures both). The request path tokenizes once per request and pool, from the
//! core's parse of the body (the messages and the members the template reads, where the parse
//! found them: the body is not parsed again). The core tokenizes bodies over
//! [`PrefixRouting::INLINE_BYTES`] off the workers, as optional work (`sluice_sdk::cpu`): on a
//! thread of its own that no body's parse waits behind, dropped when it waited over
//! [`PrefixRouting::MAX_WAIT`] or its client left; bodies over [`PrefixRouting::MAX_BYTES`] are
//! not tokenized at all. Such a request is placed without the index, by the approximate
//! affinity.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use sluice_llm::family::PromptSource;
use sluice_llm::model_name::tenant_cache_salt;
use sluice_llm::request::Prompt;
use sluice_llm::LlmCall;
use sluice_tokenizer::{ChatParts, PromptTokenizer};

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
    /// Requests whose body was over [`PrefixRouting::MAX_BYTES`] (sent without the index).
    pub too_long: AtomicU64,
    /// Requests whose prompt was not tokenized in time, or whose client left while it waited
    /// (sent without the index, or not at all).
    pub passed_over: AtomicU64,
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
    /// Bodies up to this size are tokenized on the async worker; larger ones on the body
    /// pool (`sluice_sdk::cpu`).
    pub const INLINE_BYTES: usize = 16 * 1024;

    /// Bodies over this size are not tokenized: 2 MiB is about half a million tokens, past
    /// any engine's context, and about a second of one core's tokenizing.
    pub const MAX_BYTES: usize = 2 * 1024 * 1024;

    /// The longest a prompt waits to be tokenized before it goes without the index.
    pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

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
            too_long: AtomicU64::new(0),
            passed_over: AtomicU64::new(0),
        }
    }

    /// Whether `other`'s index holds what this one would: the same tokenizer (the same ids,
    /// so the same block keys) and the same events' source.
    pub fn same_index_as(&self, other: &PrefixRouting) -> bool {
        self.kv_events == other.kv_events
            && self.tokenizer.fingerprint() == other.tokenizer.fingerprint()
    }

    /// The keys of `call`'s prompt as the index keys blocks; `None` when the tokenizer
    /// cannot read it (it then goes without the index). The engine keys every block of a
    /// LoRA `adapter`'s request with its name, and salts the prompt's first block with the
    /// request's `cache_salt` as it gets it: `tenant`'s own when the pool gives each tenant
    /// one (`salt_for_tenant`), else the client's.
    ///
    /// The body is not parsed again: the core's parse found the prompt and noted where the
    /// members the chat template reads are; only those are read, into the template's values.
    pub fn keys(
        &self,
        call: &LlmCall,
        adapter: Option<&str>,
        salt_for_tenant: Option<&str>,
    ) -> Option<PrefixKeys> {
        let ids = match call.endpoint.family().prompt_source(call)? {
            PromptSource::Chat {
                messages,
                tools,
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
            } => self.tokenizer.chat_ids(ChatParts {
                messages,
                tools,
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
            }),
            PromptSource::Prompt(prompt) => self.prompt_ids(prompt),
        };
        let ids = match ids {
            Ok(ids) => ids,
            Err(error) => {
                self.unreadable.fetch_add(1, Relaxed);
                tracing::debug!(%error, "a prompt the pool's tokenizer cannot read");
                return None;
            }
        };
        let members = call.placed_members();
        let client = members
            .as_ref()
            .and_then(|m| m.value("cache_salt"))
            .and_then(|range| call.body.get(range));
        let salt = match salt_for_tenant {
            Some(tenant) => {
                let json = tenant_cache_salt(tenant, client);
                serde_json::from_slice::<String>(&json).ok()
            }
            None => client.and_then(|json| serde_json::from_slice::<String>(json).ok()),
        };
        Some(PrefixKeys {
            keys: block_keys(&ids, self.index.block_size(), adapter, salt.as_deref()),
            tokens: ids.len(),
        })
    }

    /// A text completion's token ids, as vLLM's completions endpoint makes them: its prompt,
    /// or the first of a batch, encoded with the tokenizer's special tokens; a prompt given
    /// as token ids is taken as it is.
    fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, sluice_tokenizer::Error> {
        let text = match prompt {
            Prompt::Text(text) => Some(text.clone()),
            Prompt::Texts(texts) => texts.first(),
            Prompt::Tokens(tokens) => return Ok(tokens.ids().collect()),
            Prompt::TokenBatches(batches) => {
                if let Some(first) = batches.iter().next() {
                    return Ok(first.ids().collect());
                }
                None
            }
        };
        match text {
            Some(text) => self.tokenizer.encode(&text.to_str(), true),
            None => Err(sluice_tokenizer::Error::Request("no prompt".to_string())),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use serde_json::value::RawValue;
    use sluice_llm::Endpoint;
    use std::collections::HashMap;

    fn routing() -> PrefixRouting {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tokenizer-chatml");
        let tokenizer = PromptTokenizer::load(&dir).unwrap();
        PrefixRouting::new(Arc::new(tokenizer), KvEventSource::Port(1))
    }

    fn call(endpoint: Endpoint, body: &str) -> LlmCall {
        LlmCall::parse(endpoint, Bytes::from(body.to_string())).unwrap()
    }

    fn expected(routing: &PrefixRouting, ids: &[u32], salt: Option<&str>) -> PrefixKeys {
        PrefixKeys {
            keys: block_keys(ids, routing.index.block_size(), None, salt),
            tokens: ids.len(),
        }
    }

    /// The ids transformers made of the real tier's tokenizer (`golden.json`) come out of the
    /// core's parse, the body not read again.
    #[test]
    fn a_parsed_requests_keys_are_the_engines_tokens() {
        let routing = routing();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tokenizer-chatml/golden.json");
        // Read raw: the tools' keys must keep their order.
        let golden = std::fs::read_to_string(dir).unwrap();
        let cases: Vec<HashMap<&str, &RawValue>> = serde_json::from_str(&golden).unwrap();
        assert_eq!(cases.len(), 7);
        for case in cases {
            let ids: Vec<u32> = serde_json::from_str(case["ids"].get()).unwrap();
            let (endpoint, body) = match case.get("chat") {
                Some(chat) => (
                    Endpoint::ChatCompletions,
                    format!(r#"{{"model":"m",{}"#, &chat.get()[1..]),
                ),
                None => (
                    Endpoint::Completions,
                    format!(r#"{{"model":"m","prompt":{}}}"#, case["prompt"].get()),
                ),
            };
            let keys = routing.keys(&call(endpoint, &body), None, None);
            assert_eq!(keys, Some(expected(&routing, &ids, None)), "{body}");
        }
    }

    /// What the template reads besides the messages, and the salt, are found where the
    /// parse placed them, or by reading the body again when a key was escaped: the result
    /// is the tokenizer's reading of the whole body.
    #[test]
    fn the_templates_members_and_the_salt_count_as_the_body_says() {
        let routing = routing();
        let chats = [
            r#"{"messages":[{"role":"user","content":"Go on"}],"add_generation_prompt":false}"#,
            r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hel"}],"continue_final_message":true,"add_generation_prompt":false}"#,
            r#"{"messages":[{"role":"user","content":"Hi"}],"add_generation_prom\u0070t":false,"cache_salt":"s1"}"#,
            r#"{"chat_template_kwargs":{"enable_thinking":false},"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi \u00e9"}],"tools":null}"#,
        ];
        for body in chats {
            let whole = routing.tokenizer.tokenize_chat(body.as_bytes()).unwrap();
            let salt = whole
                .cache_salt
                .as_deref()
                .map(|json| serde_json::from_str::<String>(json).unwrap());
            let keys = routing.keys(&call(Endpoint::ChatCompletions, body), None, None);
            assert_eq!(
                keys,
                Some(expected(&routing, &whole.ids, salt.as_deref())),
                "{body}"
            );
        }
        // Without the generation prompt, the rendering is shorter.
        let with = routing.keys(
            &call(
                Endpoint::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"Go on"}]}"#,
            ),
            None,
            None,
        );
        let without = routing.keys(&call(Endpoint::ChatCompletions, chats[0]), None, None);
        assert!(with.unwrap().tokens > without.unwrap().tokens);

        let completions = [
            (r#"{"prompt":"caf\u00e9 au lait"}"#, None),
            (r#"{"prompt":["first one","second"]}"#, None),
            (r#"{"prompt":[5,6,7]}"#, Some(vec![5, 6, 7])),
            (r#"{"prompt":[[8,9],[10]]}"#, Some(vec![8, 9])),
        ];
        for (body, ids) in completions {
            let ids = ids.unwrap_or_else(|| routing.tokenizer.completion(body.as_bytes()).unwrap());
            let keys = routing.keys(&call(Endpoint::Completions, body), None, None);
            assert_eq!(keys, Some(expected(&routing, &ids, None)), "{body}");
        }
    }

    /// `chat_template_kwargs` reach the template from where the parse placed them: with a
    /// template that writes one of them, the prompt is longer by it.
    #[test]
    fn the_templates_kwargs_are_rendered() {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tokenizer-chatml");
        let dir = tempfile::tempdir().unwrap();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixture.join(file), dir.path().join(file)).unwrap();
        }
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{%- for m in messages %}{{ m.content }}{%- endfor %}{{ greeting }}",
        )
        .unwrap();
        let tokenizer = PromptTokenizer::load(dir.path()).unwrap();
        let routing = PrefixRouting::new(Arc::new(tokenizer), KvEventSource::Port(1));
        let plain = r#"{"messages":[{"role":"user","content":"Hi"}]}"#;
        let greeted = r#"{"messages":[{"role":"user","content":"Hi"}],"chat_template_kwargs":{"greeting":" and a very warm welcome to you"}}"#;
        let tokens = |body: &str| {
            routing
                .keys(&call(Endpoint::ChatCompletions, body), None, None)
                .unwrap()
                .tokens
        };
        let whole = routing.tokenizer.tokenize_chat(greeted.as_bytes()).unwrap();
        assert_eq!(tokens(greeted), whole.ids.len());
        assert!(
            tokens(greeted) > tokens(plain) + 3,
            "the greeting is rendered"
        );
    }

    /// A prompt the template cannot render is counted and goes without the index.
    #[test]
    fn a_prompt_the_tokenizer_cannot_read_is_counted() {
        let routing = routing();
        let body = r#"{"messages":[{"role":"user","content":"Hi"}],"add_generation_prompt":"yes"}"#;
        assert_eq!(
            routing.keys(&call(Endpoint::ChatCompletions, body), None, None),
            None
        );
        assert_eq!(routing.unreadable.load(Relaxed), 1);
    }
}
