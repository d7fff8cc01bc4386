//! The speculative-first selector: a cheap draft pool (a small model on A10G-class GPUs)
//! answers first; the target pool (the large model on H100s) takes what the draft cannot or
//! should not serve.
//!
//! Before sending, in the request phase, a request goes straight to the target when
//! - the client asks for it (`x-sluice-tier: target`, if allowed): `forced`;
//! - it needs what the draft pool does not support (tools, logprobs, `n` > 1, `best_of` > 1
//!   or beam search, per the pool's `supports`): `unsupported`;
//! - its estimated prompt tokens plus `max_tokens` exceed the draft's `max_model_len`:
//!   `prompt-too-long`;
//! - no draft backend is usable, or the KV breaker is shedding the draft pool:
//!   `draft-unavailable`.
//!
//! Otherwise it goes to the first draft pool whose `when` matches (`code` for prompts that
//! look like code, `any`), and leaves the core an [`Escalation`] to the target: the core
//! moves the request there, with its whole body replayed, when the draft fails before any
//! byte reached the client (connect failure, 5xx, 429: `draft-error`; no header within
//! `draft_first_byte_budget`: `draft-timeout`), or when a non-stream answer's token
//! log-probabilities are below the threshold (`low-confidence`; the draft is asked for
//! logprobs and they are removed again if the client did not ask). Once a stream has
//! started there is no fallback: it ends with an SSE error event.
//!
//! Streams are not held back for judgement (a hold-back window is not built yet): a draft
//! stream is sent as it comes.
//!
//! ```yaml
//! plugins:
//!   speculative:
//!     enabled: true
//!     models:
//!       - model: llama            # what clients send; both pools must serve the name
//!         aliases: [llama-3]      # (vLLM: --served-model-name llama llama-3 ...)
//!         drafts:
//!           - {pool: draft-code, when: code}
//!           - {pool: draft}
//!         target: target
//!         draft_first_byte_budget: 2s
//!         confidence: {enabled: true, measure: mean, window: 32, min_logprob: -1.0}
//!     price_per_million_tokens: {draft: 0.10, draft-code: 0.10, target: 0.90}
//! ```

pub mod classify;
pub mod confidence;
pub mod config;
mod metrics;
pub mod usage;

pub use config::SpeculativeConfig;

use async_trait::async_trait;
use bytes::Bytes;
use confidence::{ConfidenceCheck, Measure};
use config::{DraftWhen, MeasureName, ModelConfig};
use pingora_proxy::Session;
use sluice_sdk::escalation::reason;
use sluice_sdk::llm::{Content, Logprobs, Prompt};
use sluice_sdk::{
    Error, Escalation, Flow, LlmCall, LlmRequest, Plugin, Pool, Pools, Priority, RequestCtx, Result,
};
use std::sync::Arc;
use usage::UsageScanner;

/// One model's pools, resolved.
struct Model {
    config: ModelConfig,
    drafts: Vec<(Arc<Pool>, DraftWhen)>,
    target: Arc<Pool>,
}

pub struct Speculative {
    config: SpeculativeConfig,
    models: Vec<Model>,
}

/// Per-request state: the answer's usage, for the token and cost metrics.
struct Handled {
    model: usize,
    usage: UsageScanner,
}

impl Speculative {
    pub fn new(config: SpeculativeConfig, pools: &Pools) -> std::result::Result<Self, String> {
        let models = resolve(&config, pools)
            .map_err(|(key, message)| format!("plugins.speculative.{key}: {message}"))?;
        let names: Vec<&str> = pools.iter().map(|p| &*p.name).collect();
        metrics::init(&names);
        Ok(Self { config, models })
    }

    /// Checks the section against the pools, as `sluice -t` does: errors are `(key path
    /// below plugins.speculative, message)`.
    pub fn check(
        config: &SpeculativeConfig,
        pools: &Pools,
    ) -> std::result::Result<(), (String, String)> {
        resolve(config, pools).map(|_| ())
    }

    fn model_for(&self, name: &str) -> Option<usize> {
        self.models
            .iter()
            .position(|m| m.config.model == name || m.config.aliases.iter().any(|a| a == name))
    }

    fn price(&self, pool: &str) -> f64 {
        self.config
            .price_per_million_tokens
            .get(pool)
            .copied()
            .unwrap_or(0.0)
    }

    /// Where the request goes first, and why it goes to the target at once, if it does.
    fn decide(
        &self,
        model: &Model,
        call: &LlmCall,
        tier: Option<&str>,
    ) -> std::result::Result<Arc<Pool>, &'static str> {
        let (request, demand) = (&call.request, call.demand);
        if tier == Some("target") && self.config.allow_forced_target {
            return Err(reason::FORCED);
        }
        let code = looks_like_code(request);
        let mut candidates = model
            .drafts
            .iter()
            .filter(|(_, when)| *when == DraftWhen::Any || code)
            .map(|(pool, _)| pool);
        let Some(first) = candidates.next() else {
            return Err(reason::DRAFT_UNAVAILABLE);
        };
        if !supports(first, request) {
            return Err(reason::UNSUPPORTED);
        }
        if first
            .max_model_len
            .is_some_and(|max| demand.tokens() > u64::from(max))
        {
            return Err(reason::PROMPT_TOO_LONG);
        }
        // The first draft that can take it now; a code prompt may fall back to a general one.
        std::iter::once(first)
            .chain(candidates)
            .find(|p| p.pressure().usable > 0 && !p.is_shedding(Priority::Standard))
            .cloned()
            .ok_or(reason::DRAFT_UNAVAILABLE)
    }

    fn escalation(&self, model: &Model, request: &LlmRequest, ctx: &RequestCtx) -> Escalation {
        let c = &model.config.confidence;
        let judge = c.enabled && !request.is_stream();
        let endpoint = ctx.llm.as_ref().map(|call| call.endpoint);
        let client_asked = asks_for_logprobs(request);
        let upstream_body = match (judge, client_asked, ctx.llm.as_ref()) {
            (true, false, Some(call)) => confidence::ask_for_logprobs(call.endpoint, &call.body),
            _ => None,
        };
        let check = match (judge, endpoint) {
            (true, Some(endpoint)) => Some(Arc::new(ConfidenceCheck {
                endpoint,
                measure: match c.measure {
                    MeasureName::Mean => Measure::Mean,
                    MeasureName::Min => Measure::Min,
                },
                window: c.window,
                min_logprob: c.min_logprob,
                client_asked,
            }) as Arc<dyn sluice_sdk::AnswerCheck>),
            _ => None,
        };
        Escalation {
            target: Arc::clone(&model.target),
            first_byte_budget: model.config.draft_first_byte_budget,
            upstream_body,
            check,
        }
    }
}

#[async_trait]
impl Plugin for Speculative {
    fn name(&self) -> &'static str {
        "speculative"
    }

    async fn request(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<Flow> {
        let Some(index) = ctx.model().and_then(|m| self.model_for(m)) else {
            return Ok(Flow::Continue);
        };
        let (Some(model), Some(call)) = (self.models.get(index), ctx.llm.as_ref()) else {
            return Ok(Flow::Continue);
        };
        let tier = session
            .req_header()
            .headers
            .get(self.config.tier_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        match self.decide(model, call, tier) {
            Ok(draft) => {
                let escalation = self.escalation(model, &call.request, ctx);
                ctx.pool = Some(draft);
                ctx.escalation = Some(escalation);
            }
            Err(why) => {
                ctx.pool = Some(Arc::clone(&model.target));
                ctx.escalated = Some(why);
            }
        }
        ctx.state.insert(Handled {
            model: index,
            usage: UsageScanner::default(),
        });
        Ok(Flow::Continue)
    }

    fn response_body(
        &self,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let (Some(handled), Some(chunk)) = (ctx.state.get_mut::<Handled>(), body.as_ref()) {
            handled.usage.feed(chunk);
        }
        Ok(())
    }

    fn logging(&self, _error: Option<&Error>, ctx: &mut RequestCtx) {
        let Some(handled) = ctx.state.remove::<Handled>() else {
            return;
        };
        // Cache hits never reach a pool: they are the cache's, not the selector's.
        if ctx.cache_hit || ctx.upstream_status.is_none() {
            return;
        }
        let pool = ctx.pool_name().to_string();
        metrics::request(&pool, ctx.escalated);
        if let (Some(usage), Some(model)) = (handled.usage.usage(), self.models.get(handled.model))
        {
            metrics::tokens(
                &pool,
                usage.prompt_tokens,
                usage.completion_tokens,
                self.price(&pool),
                self.price(&model.target.name),
            );
        }
    }
}

/// The configured models with their pools, checked: every pool exists and serves the model's
/// names.
fn resolve(
    config: &SpeculativeConfig,
    pools: &Pools,
) -> std::result::Result<Vec<Model>, (String, String)> {
    config.validate()?;
    let mut models = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let pool = |key: String, name: &str| {
            let p = pools
                .get(name)
                .ok_or_else(|| (key.clone(), format!("no pool is named `{name}`")))?;
            let serves_all = std::iter::once(&m.model)
                .chain(&m.aliases)
                .all(|n| p.models.is_empty() || p.serves(n));
            if !serves_all {
                return Err((
                    key,
                    format!(
                        "pool `{name}` must serve `{}` and its aliases (list them in its models)",
                        m.model
                    ),
                ));
            }
            Ok(Arc::clone(p))
        };
        let drafts = m
            .drafts
            .iter()
            .enumerate()
            .map(|(j, d)| {
                Ok((
                    pool(format!("models[{i}].drafts[{j}].pool"), &d.pool)?,
                    d.when,
                ))
            })
            .collect::<std::result::Result<Vec<_>, (String, String)>>()?;
        let target = pool(format!("models[{i}].target"), &m.target)?;
        models.push(Model {
            config: m.clone(),
            drafts,
            target,
        });
    }
    Ok(models)
}

/// Whether the draft pool can serve what the request asks for.
fn supports(pool: &Pool, r: &LlmRequest) -> bool {
    let s = pool.supports;
    let wants_tools = r.tools.as_ref().is_some_and(|t| !t.is_empty());
    let wants_best_of = r.best_of.is_some_and(|n| n > 1) || r.use_beam_search == Some(true);
    (s.tools || !wants_tools)
        && (s.logprobs || !asks_for_logprobs(r))
        && (s.multiple_choices || r.n.unwrap_or(1) <= 1)
        && (s.best_of || !wants_best_of)
}

fn asks_for_logprobs(r: &LlmRequest) -> bool {
    matches!(
        r.logprobs,
        Some(Logprobs::Flag(true)) | Some(Logprobs::Count(_))
    )
}

/// Whether any of the prompt's text looks like code.
fn looks_like_code(r: &LlmRequest) -> bool {
    if let Some(messages) = &r.messages {
        return messages.iter().any(|m| match &m.content {
            Some(Content::Text(t)) => classify::looks_like_code(t),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .any(classify::looks_like_code),
            None => false,
        });
    }
    match &r.prompt {
        Some(Prompt::Text(t)) => classify::looks_like_code(t),
        Some(Prompt::Texts(ts)) => ts.iter().any(|t| classify::looks_like_code(t)),
        _ => false,
    }
}
