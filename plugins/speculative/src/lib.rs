//! The speculative-first selector: a cheap draft pool (a small model on A10G-class GPUs)
//! answers first; the target pool (the large model on H100s) takes what the draft cannot or
//! should not serve.
//!
//! Before sending, in the request phase, a request goes straight to the target when
//! - the client asks for it (`x-sluice-tier: target`, if `allow_forced_target` and the
//!   request's tenant allow it): `forced`;
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
//! Streams are sent as they come unless the model sets a hold-back window
//! (`confidence.stream_hold_back_tokens`): then the draft's stream is kept from the client
//! until its first K tokens are judged by the same measure, and either released and streamed
//! on, or dropped for the target's stream. The window delays every draft stream's first
//! byte by the time the draft takes to produce K tokens; it is off by default.
//!
//! Token counts come from the answer's usage, which the selector asks the core for
//! ([`RequestCtx::want_usage`]): a stream whose client did not ask for usage is asked for it
//! upstream by the core, and its usage chunk removed before the client sees the stream.
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
//!         confidence: {enabled: true, measure: mean, window: 32, min_logprob: -1.0,
//!                      stream_hold_back_tokens: 0}
//! ```

pub mod classify;
pub mod confidence;
pub mod config;
mod metrics;
pub mod sse;

pub use config::SpeculativeConfig;

use async_trait::async_trait;
use bytes::Bytes;
use confidence::{ConfidenceCheck, Measure, StreamConfidence};
use config::{ConfidenceConfig, DraftWhen, MeasureName, ModelConfig};
use http::HeaderName;
use sluice_sdk::config::header_name;
use sluice_sdk::escalation::reason;
use sluice_sdk::request::{Content, Prompt};
use sluice_sdk::{
    AnswerCheck, Client, ConfigError, Endpoint, Error, Escalation, Flow, Host, LlmCall, LlmRequest,
    Plugin, PluginBuilder, Pool, Pools, Priority, RequestCtx, Result, StreamCheck, Unfit,
};
use sse::StreamFilter;
use std::sync::Arc;

/// One model's pools, resolved, and its checks, built once.
struct Model {
    config: ModelConfig,
    drafts: Vec<(Arc<Pool>, DraftWhen)>,
    target: Arc<Pool>,
    checks: Checks,
}

/// A model's confidence checks per endpoint, when enabled.
#[derive(Default)]
struct Checks {
    /// Non-stream answers, indexed by endpoint and by whether the client asked for logprobs.
    answers: Vec<(Endpoint, bool, Arc<dyn AnswerCheck>)>,
    /// Stream starts (the hold-back window), by endpoint.
    streams: Vec<(Endpoint, Arc<dyn StreamCheck>)>,
}

impl Checks {
    fn new(config: &ConfidenceConfig) -> Self {
        if !config.enabled {
            return Self::default();
        }
        let measure = match config.measure {
            MeasureName::Mean => Measure::Mean,
            MeasureName::Min => Measure::Min,
        };
        // Every family whose answers carry log-probabilities.
        let endpoints = Endpoint::ALL
            .iter()
            .copied()
            .filter(|e| e.family().logprobs().is_some());
        let mut checks = Self::default();
        for endpoint in endpoints {
            for client_asked in [false, true] {
                let check = ConfidenceCheck {
                    endpoint,
                    measure,
                    window: config.window,
                    min_logprob: config.min_logprob,
                    client_asked,
                };
                checks
                    .answers
                    .push((endpoint, client_asked, Arc::new(check)));
            }
            if config.stream_hold_back_tokens > 0 {
                let check = StreamConfidence {
                    endpoint,
                    measure,
                    window: config.stream_hold_back_tokens,
                    min_logprob: config.min_logprob,
                };
                checks.streams.push((endpoint, Arc::new(check)));
            }
        }
        checks
    }

    fn answer(&self, endpoint: Endpoint, client_asked: bool) -> Option<Arc<dyn AnswerCheck>> {
        self.answers
            .iter()
            .find(|(e, asked, _)| *e == endpoint && *asked == client_asked)
            .map(|(_, _, check)| Arc::clone(check))
    }

    fn stream(&self, endpoint: Endpoint) -> Option<Arc<dyn StreamCheck>> {
        self.streams
            .iter()
            .find(|(e, _)| *e == endpoint)
            .map(|(_, check)| Arc::clone(check))
    }
}

/// The section, checked against the pools: each model's pools and checks, the tier header.
pub struct SpeculativeBuilder {
    config: SpeculativeConfig,
    models: Vec<Model>,
    tier_header: HeaderName,
    pool_names: Vec<String>,
}

impl PluginBuilder for SpeculativeBuilder {
    const NAME: &'static str = "speculative";
    type Config = SpeculativeConfig;

    /// A disabled section is checked on its own; its pool names only once it is enabled.
    fn resolve(
        config: SpeculativeConfig,
        host: &Host,
    ) -> std::result::Result<Option<Self>, ConfigError> {
        let pools = &host.pools;
        config.validate()?;
        let tier_header = header_name("tier_header", &config.tier_header)?;
        if !config.enabled {
            return Ok(None);
        }
        Ok(Some(Self {
            models: resolve(&config, pools)?,
            config,
            tier_header,
            pool_names: pools.iter().map(|p| p.name.to_string()).collect(),
        }))
    }

    fn start(self) -> Arc<dyn Plugin> {
        let names: Vec<&str> = self.pool_names.iter().map(String::as_str).collect();
        metrics::init(&names);
        Arc::new(Speculative {
            config: self.config,
            models: self.models,
            tier_header: self.tier_header,
        })
    }
}

pub struct Speculative {
    config: SpeculativeConfig,
    models: Vec<Model>,
    tier_header: HeaderName,
}

/// Per-request state: the model, for the cost metrics, and what to remove from a draft's
/// stream that was asked for more than the client asked.
struct Handled {
    model: usize,
    filter: StreamFilter,
    /// The draft was asked for logprobs the client did not ask for (a hold-back window):
    /// they are removed from its stream, not from the target's.
    draft_logprobs_added: bool,
}

impl Speculative {
    fn model_for(&self, name: &str) -> Option<usize> {
        self.models
            .iter()
            .position(|m| m.config.model == name || m.config.aliases.iter().any(|a| a == name))
    }

    /// Where the request goes first, and why it goes to the target at once, if it does.
    fn decide(
        &self,
        model: &Model,
        call: &LlmCall,
        tier: Option<&str>,
        priority: Priority,
    ) -> std::result::Result<Arc<Pool>, &'static str> {
        let request = &call.request;
        if tier == Some("target") {
            return Err(reason::FORCED);
        }
        // The classifier reads the whole prompt: only when a draft depends on it.
        let code = model
            .drafts
            .iter()
            .any(|(_, when)| *when == DraftWhen::Code)
            && looks_like_code(request);
        let mut candidates = model
            .drafts
            .iter()
            .filter(|(_, when)| *when == DraftWhen::Any || code)
            .map(|(pool, _)| pool);
        let Some(first) = candidates.next() else {
            return Err(reason::DRAFT_UNAVAILABLE);
        };
        match first.fit(call) {
            Err(Unfit::Unsupported) => return Err(reason::UNSUPPORTED),
            Err(Unfit::TooLong) => return Err(reason::PROMPT_TOO_LONG),
            Ok(()) => {}
        }
        // The first draft that can take it now; a code prompt may fall back to a general
        // one, if that one can serve it too.
        std::iter::once(first)
            .chain(candidates)
            .find(|p| p.fit(call).is_ok() && p.has_usable_backend() && !p.sheds(priority))
            .cloned()
            .ok_or(reason::DRAFT_UNAVAILABLE)
    }

    /// How the draft's attempt may give way to the target, and what it is asked for beyond
    /// the client's request: the escalation, and whether logprobs were added to its body.
    fn escalation(&self, model: &Model, call: &LlmCall, body: &Bytes) -> (Escalation, bool) {
        let client_asked = call.request.asks_for_logprobs();
        let (check, stream_check) = if call.request.is_stream() {
            (None, model.checks.stream(call.endpoint))
        } else {
            (model.checks.answer(call.endpoint, client_asked), None)
        };
        let judged = check.is_some() || stream_check.is_some();
        let upstream_body = if judged && !client_asked {
            (call.endpoint.family().logprobs()).and_then(|logprobs| logprobs.ask(body))
        } else {
            None
        };
        let logprobs_added = upstream_body.is_some();
        let escalation = Escalation {
            target: Arc::clone(&model.target),
            first_byte_budget: model.config.draft_first_byte_budget,
            upstream_body,
            check,
            stream_check,
        };
        (escalation, logprobs_added)
    }
}

#[async_trait]
impl Plugin for Speculative {
    fn name(&self) -> &'static str {
        SpeculativeBuilder::NAME
    }

    async fn request(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<Flow> {
        let Some(index) = ctx.model().and_then(|m| self.model_for(m)) else {
            return Ok(Flow::Continue);
        };
        let (Some(model), Some(call)) = (self.models.get(index), ctx.llm()) else {
            return Ok(Flow::Continue);
        };
        // Nothing to draft (a tokenizer's, a pooling model's answer), or a continuation of a
        // response an engine keeps: it goes where the core sends it.
        if !call.endpoint.family().generates() || call.request.previous_response_id.is_some() {
            return Ok(Flow::Continue);
        }
        // Forcing the 9×-pricier pool is the operator's to allow, and then the tenant's.
        let may_force = self.config.allow_forced_target
            && ctx.tenant().is_none_or(|tenant| tenant.may_force_target);
        let tier = client
            .request_header()
            .headers
            .get(&self.tier_header)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|_| may_force);
        // The class is decided in `early_request` (the breaker's); without a plugin that
        // decides it, every request is standard.
        let priority = ctx.priority().unwrap_or(Priority::Standard);
        // Decided before any copy of the body is made: the code classifier may unescape a
        // prompt's text, and that copy is gone before the body's is made.
        let decision = self.decide(model, call, tier, priority);
        let mut handled = Handled {
            model: index,
            filter: StreamFilter::new(call.endpoint.family().logprobs()),
            draft_logprobs_added: false,
        };
        match decision {
            Ok(draft) => {
                let (escalation, logprobs_added) = self.escalation(model, call, &call.body);
                handled.draft_logprobs_added = logprobs_added && call.request.is_stream();
                ctx.try_first(draft, escalation);
            }
            Err(why) => ctx.escalate_to(Arc::clone(&model.target), why),
        }
        // The token metrics read the answer's usage, which the core finds (and asks a stream
        // for, on whichever body each attempt sends).
        ctx.want_usage();
        ctx.state.insert(handled);
        Ok(Flow::Continue)
    }

    fn response_body(
        &self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let on_draft = ctx.escalated().is_none();
        let Some(handled) = ctx.state.get_mut::<Handled>() else {
            return Ok(());
        };
        handled.filter.strip_logprobs = handled.draft_logprobs_added && on_draft;
        handled.filter.apply(body, end_of_stream);
        Ok(())
    }

    fn logging(&self, _error: Option<&Error>, ctx: &mut RequestCtx) {
        let Some(handled) = ctx.state.remove::<Handled>() else {
            return;
        };
        // Cache hits never reach a pool: they are the cache's, not the selector's.
        if ctx.answered_locally() || ctx.progress().upstream_status.is_none() {
            return;
        }
        let pool = ctx.pool_name();
        metrics::request(pool, ctx.escalated());
        if let (Some(usage), Some(model)) = (ctx.usage(), self.models.get(handled.model)) {
            metrics::cost(
                pool,
                usage.prompt_tokens,
                usage.completion_tokens,
                ctx.pool()
                    .map_or(0.0, |p| p.settings.price_per_million_tokens),
                model.target.settings.price_per_million_tokens,
            );
        }
    }
}

/// The configured models with their pools, checked: every pool exists and serves the model's
/// names.
fn resolve(
    config: &SpeculativeConfig,
    pools: &Pools,
) -> std::result::Result<Vec<Model>, ConfigError> {
    let mut models = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let pool = |key: String, name: &str| {
            let p = pools.get(name).ok_or_else(|| {
                ConfigError::new(key.clone(), format!("no pool is named `{name}`"))
            })?;
            let serves_all = std::iter::once(&m.model)
                .chain(&m.aliases)
                .all(|n| p.settings.auto_models || p.is_catch_all() || p.serves(n));
            if !serves_all {
                return Err(ConfigError::new(
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
            .collect::<std::result::Result<Vec<_>, ConfigError>>()?;
        let target = pool(format!("models[{i}].target"), &m.target)?;
        models.push(Model {
            checks: Checks::new(&m.confidence),
            config: m.clone(),
            drafts,
            target,
        });
    }
    Ok(models)
}

/// Whether any of the prompt's text looks like code. A text the client wrote with escapes
/// is unescaped for the classifier, one at a time.
fn looks_like_code(r: &LlmRequest) -> bool {
    if let Some(messages) = &r.messages {
        return messages.iter().any(|m| match &m.content {
            Some(Content::Text(t)) => classify::looks_like_code(&t.to_str()),
            Some(Content::Parts(parts)) => parts
                .texts()
                .any(|t| classify::looks_like_code(&t.to_str())),
            None => false,
        });
    }
    match &r.prompt {
        Some(Prompt::Text(t)) => classify::looks_like_code(&t.to_str()),
        Some(Prompt::Texts(ts)) => ts.iter().any(|t| classify::looks_like_code(&t.to_str())),
        _ => false,
    }
}

/// The request hook against a fake client: where a request goes first, without sockets.
#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::{BackendSpec, PoolSettings, Tenant};
    use sluice_testkit::{plugin_host, routed_chat, FakeClient};

    /// A healthy pool of one backend serving `m`.
    fn pool(name: &str, port: u16) -> Arc<Pool> {
        let address = format!("127.0.0.1:{port}");
        let backend = BackendSpec {
            resolved: address.parse().unwrap(),
            address,
            weight: 1,
        };
        let pool = Arc::new(Pool::new(PoolSettings::new(
            name,
            vec!["m".into()],
            vec![backend],
        )));
        let live = pool.live_at(0).unwrap();
        for _ in 0..pool.settings.health.healthy_after {
            live.record_probe(true, &pool.settings.health);
        }
        pool
    }

    /// The selector for `m`: the pool `draft` first, `target` when it must.
    fn selector() -> Arc<dyn Plugin> {
        let config: SpeculativeConfig = serde_json::from_value(serde_json::json!({
            "enabled": true,
            "models": [{"model": "m", "drafts": [{"pool": "draft"}], "target": "target"}],
        }))
        .unwrap();
        let host = plugin_host(vec![pool("draft", 9), pool("target", 10)]);
        SpeculativeBuilder::resolve(config, &host)
            .unwrap()
            .unwrap()
            .start()
    }

    fn routed(tenant_may_force: Option<bool>) -> RequestCtx {
        let mut ctx =
            routed_chat(r#"{"model":"m","messages":[{"role":"user","content":"Say hi."}]}"#);
        if let Some(may_force_target) = tenant_may_force {
            ctx.set_tenant(Arc::new(Tenant {
                name: "acme".into(),
                identified: true,
                default_priority: None,
                max_priority: None,
                may_force_target,
                ttft_slo: None,
            }));
        }
        ctx
    }

    #[tokio::test]
    async fn a_request_goes_to_the_draft_first_unless_the_target_is_forced_by_one_who_may() {
        let selector = selector();
        let plain = || FakeClient::post("/v1/chat/completions");
        let forcing = || plain().with_header("x-sluice-tier", "target");
        for (mut client, tenant_may_force, first, escalated) in [
            (plain(), None, "draft", None),
            (forcing(), None, "target", Some(reason::FORCED)),
            (forcing(), Some(true), "target", Some(reason::FORCED)),
            (forcing(), Some(false), "draft", None),
        ] {
            let mut ctx = routed(tenant_may_force);
            let flow = selector.request(&mut client, &mut ctx).await.unwrap();
            assert!(matches!(flow, Flow::Continue));
            assert_eq!(ctx.pool_name(), first, "{tenant_may_force:?}");
            assert_eq!(ctx.escalated(), escalated, "{tenant_may_force:?}");
            // A draft's attempt carries the way to the target.
            let escalation = ctx.escalation().map(|e| e.target.name.to_string());
            let expected = (first == "draft").then(|| "target".to_string());
            assert_eq!(escalation, expected);
        }
    }
}
