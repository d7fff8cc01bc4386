//! The tenants plugin: who is calling, what they may ask for, and how much.
//!
//! - **Identity** ([`directory`]): the request's API key (`Authorization: Bearer`, `x-api-key`
//!   or `api-key`), by its SHA-256 digest, names a tenant; keys are in the config file as
//!   digests and optionally in a Redis hash. A `tenant_header` names the tenant only when the
//!   connection comes from one of `trusted_proxies`; from anyone else it is ignored. No key:
//!   401, unless the operator lets such requests in as the `anonymous` tenant. The tenant is
//!   put on the request's context ([`sluice_sdk::Tenant`]), where the KV breaker (priority
//!   class), the speculative selector (forced target tier) and the cache (its partition) read
//!   it. Keys never reach a log, a metric, an error or a backend.
//! - **Policy**, per tenant over `defaults`: the models it may use (else 403), a `max_tokens`
//!   ceiling (clamped, or refused with 400), its priority classes, whether it may force the
//!   target tier.
//! - **Limits and budget** ([`limits`]): requests and tokens per minute, concurrent requests,
//!   dollars per day and month, in this process or shared through Redis; over a limit: 429
//!   with `retry-after` and OpenAI's `x-ratelimit-*` headers, which successful answers carry
//!   too. Tokens are estimated at admission and corrected from the answer's usage; cached
//!   answers cost no tokens and no dollars.
//!
//! It runs right after `request_id` (so that a 401 carries its id too), identifies in
//! `early_request`, before the body is read (an unknown client never gets to send 8 MiB),
//! and applies the policy and limits in `request`, once the body is parsed.
//!
//! ```yaml
//! plugins:
//!   tenants:
//!     enabled: true
//!     defaults:
//!       priority: {default: standard, max: standard}
//!       may_force_target: false
//!       max_tokens: 4096
//!       ttft_slo: 2s                   # the TTFT its requests aim at (x-sluice-ttft-slo-ms)
//!     tenants:
//!       alpha:
//!         keys: ["sha256:…"]           # sluice hash-key prints one
//!         limits: {requests_per_minute: 5}
//!       beta:
//!         keys: ["sha256:…"]
//!         limits: {output_tokens_per_minute: 10000}
//!         budget: {usd_per_day: 20}
//!     anonymous:                       # absent: requests without a key get 401
//!       limits: {requests_per_minute: 60}
//! ```

pub mod config;
mod directory;
pub mod limits;
mod metrics;

pub use config::TenantsConfig;

use async_trait::async_trait;
use config::{OverMaxTokens, Policy};
use directory::{digest, Directory};
use http::{HeaderName, HeaderValue};
use ipnet::IpNet;
use limits::{anthropic_header, Admitted, Limiter, TenantLimits, Usage, Want};
use sluice_sdk::config::header_name;
use sluice_sdk::{
    api_key, Client, ConfigError, Error, ErrorReply, Flow, Host, LlmCall, Plugin, PluginBuilder,
    Reason, RequestCtx, ResponseHeader, Result, Route, Tenant,
};
use std::borrow::Cow;
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

/// One tenant, resolved: the SDK's view of it, and what this plugin enforces.
pub struct Entry {
    tenant: Arc<Tenant>,
    /// The models it may ask for; `None`: all.
    models: Option<HashSet<String>>,
    max_tokens: Option<u32>,
    over_max_tokens: OverMaxTokens,
    /// Its limits. Every tenant has them, even with no limit set: its concurrency is
    /// counted for `/status`.
    limits: TenantLimits,
    series: metrics::Series,
}

/// A tenant's place among the plugin's entries: what the directory gives and a request
/// keeps, copied rather than counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EntryId(usize);

impl Entry {
    fn new(name: Arc<str>, identified: bool, policy: &Policy, limiter: &mut Limiter) -> Self {
        Self {
            limits: limiter.add(
                Arc::clone(&name),
                policy.limits.clone(),
                policy.budget.clone(),
            ),
            series: metrics::Series::of(&name),
            tenant: Arc::new(Tenant {
                name,
                identified,
                default_priority: policy.priority.default,
                max_priority: policy.priority.max,
                may_force_target: policy.may_force_target.unwrap_or(false),
                ttft_slo: policy.ttft_slo,
            }),
            models: policy.models.as_ref().map(|m| m.iter().cloned().collect()),
            max_tokens: policy.max_tokens,
            over_max_tokens: policy.over_max_tokens.unwrap_or_default(),
        }
    }
}

/// The section, checked: every tenant's policy merged over the defaults.
pub struct TenantsBuilder {
    config: TenantsConfig,
    trusted_proxies: Vec<IpNet>,
    tenant_header: Option<HeaderName>,
}

impl PluginBuilder for TenantsBuilder {
    const NAME: &'static str = "tenants";
    type Config = TenantsConfig;

    fn resolve(
        config: TenantsConfig,
        _host: &Host,
    ) -> std::result::Result<Option<Self>, ConfigError> {
        config.validate()?;
        let trusted_proxies = config
            .trusted_proxies
            .iter()
            .enumerate()
            .map(|(i, text)| {
                address_or_network(text)
                    .map_err(|message| ConfigError::new(format!("trusted_proxies[{i}]"), message))
            })
            .collect::<std::result::Result<_, _>>()?;
        let tenant_header = match &config.tenant_header {
            Some(name) => Some(header_name("tenant_header", name)?),
            None => None,
        };
        Ok(config.enabled.then_some(Self {
            config,
            trusted_proxies,
            tenant_header,
        }))
    }

    fn start(self) -> Arc<dyn Plugin> {
        let config = self.config;
        let mut limiter = Limiter::new(&config.limits_store);
        let mut entries = Vec::with_capacity(config.tenants.len() + 1);
        let mut listed = Vec::with_capacity(config.tenants.len());
        for (name, section) in &config.tenants {
            let policy = section.over(&config.defaults);
            let name: Arc<str> = name.as_str().into();
            entries.push(Entry::new(Arc::clone(&name), true, &policy, &mut limiter));
            listed.push((name, policy.keys, EntryId(entries.len() - 1)));
        }
        let anonymous = config.anonymous.as_ref().map(|section| {
            let policy = section.over(&config.defaults);
            let name = Tenant::ANONYMOUS.into();
            entries.push(Entry::new(name, false, &policy, &mut limiter));
            EntryId(entries.len() - 1)
        });
        Arc::new(Tenants {
            directory: Arc::new(Directory::new(listed, config.keys_from_redis.clone())),
            entries,
            anonymous,
            trusted_proxies: self.trusted_proxies,
            tenant_header: self.tenant_header,
            limiter,
            unknown_key: config
                .unknown_key_message
                .clone()
                .map_or(Cow::Borrowed(UNKNOWN_KEY), Cow::Owned),
        })
    }
}

/// An address (`10.0.0.1`) or a network (`10.0.0.0/8`).
fn address_or_network(text: &str) -> std::result::Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| format!("`{text}` is neither an IP address nor a CIDR network"))
}

pub struct Tenants {
    directory: Arc<Directory<EntryId>>,
    /// Every configured tenant's entry, then `anonymous`'s when it is let in.
    entries: Vec<Entry>,
    anonymous: Option<EntryId>,
    trusted_proxies: Vec<IpNet>,
    tenant_header: Option<HeaderName>,
    limiter: Limiter,
    /// The 401's message for a key no tenant has.
    unknown_key: Cow<'static, str>,
}

/// The request's tenant and, once admitted, its admission by the limits (its concurrency
/// slot, its estimate, its headers): one entry of the request's state for both.
struct Caller {
    entry: EntryId,
    admitted: Option<Admitted>,
}

impl Tenants {
    /// The tenant of a request, or the 401 it gets.
    async fn identify(&self, client: &dyn Client) -> std::result::Result<EntryId, ErrorReply> {
        let headers = &client.request_header().headers;
        if let Some(header) = self
            .tenant_header
            .as_ref()
            .filter(|h| headers.contains_key(*h))
        {
            // From anyone but a trusted proxy, the header means nothing.
            if self.peer_is_trusted_proxy(client) {
                // A gateway that appends rather than replaces would let the client's own
                // value stand first: several values name no one.
                let mut values = headers.get_all(header).iter();
                let (Some(named), None) = (values.next(), values.next()) else {
                    return Err(unauthorized(
                        "The tenant header came more than once; the proxy in front must set it, once.",
                    ));
                };
                return named
                    .to_str()
                    .ok()
                    .and_then(|name| self.directory.named(name.trim()))
                    .ok_or_else(|| {
                        unauthorized("The tenant the proxy in front named is not configured.")
                    });
            }
        }
        match api_key(headers) {
            Some(key) => self
                .directory
                .find(&digest(key))
                .await
                .ok_or_else(|| unauthorized(&self.unknown_key)),
            None => self.anonymous.ok_or_else(|| {
                unauthorized(
                    "You didn't provide an API key. Provide it in an Authorization header \
                     using Bearer auth (Authorization: Bearer YOUR_KEY).",
                )
            }),
        }
    }

    /// The entry the directory's id names (always one of ours).
    fn entry(&self, id: EntryId) -> Option<&Entry> {
        self.entries.get(id.0)
    }

    fn peer_is_trusted_proxy(&self, client: &dyn Client) -> bool {
        client.peer().is_some_and(|peer| {
            let ip = peer.ip().to_canonical();
            self.trusted_proxies.iter().any(|net| net.contains(&ip))
        })
    }

    /// What the tenant may not ask for: a model outside its list (403), more output tokens
    /// than its ceiling when it refuses rather than clamps (400). A request over a clamping
    /// ceiling comes back rewritten to it, as if the client had asked so.
    fn apply_policy(entry: &Entry, call: &LlmCall) -> Result<Option<LlmCall>> {
        if let Some(models) = &entry.models {
            let model = call.request.model.as_deref().unwrap_or("");
            if !models.contains(model) {
                return Err(ErrorReply {
                    param: Some("model".into()),
                    ..ErrorReply::new(
                        403,
                        Reason::Forbidden,
                        "The model you asked for is not available to your API key.",
                    )
                }
                .into_error());
            }
        }
        let Some(ceiling) = entry.max_tokens else {
            return Ok(None);
        };
        let asked = call.request.max_output_tokens();
        if entry.over_max_tokens == OverMaxTokens::Refuse && asked.is_some_and(|n| n > ceiling) {
            let param = call.endpoint.family().budget_key(&call.request);
            return Err(ErrorReply {
                param: Some(param.into()),
                ..ErrorReply::new(
                    400,
                    Reason::Forbidden,
                    format!("`{param}` is at most {ceiling} for your API key."),
                )
            }
            .into_error());
        }
        call.capped(ceiling)
            .transpose()
            .map_err(|invalid| ErrorReply::bad_request(invalid).into_error())
    }
}

/// The 401's message for a key no tenant has.
const UNKNOWN_KEY: &str = "Incorrect API key provided. Check the key, or ask the operator for one.";

/// 401 in OpenAI's shape, with the challenge HTTP asks for.
fn unauthorized(message: &str) -> ErrorReply {
    ErrorReply {
        headers: vec![(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        )],
        ..ErrorReply::new(401, Reason::Unauthorized, message)
    }
}

#[async_trait]
impl Plugin for Tenants {
    fn name(&self) -> &'static str {
        TenantsBuilder::NAME
    }

    async fn early_request(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<()> {
        let id = self
            .identify(client)
            .await
            .map_err(ErrorReply::into_error)?;
        // Every id the directory gives is one of the entries; were it not, the request
        // would be refused, never let through without a tenant.
        let entry = self
            .entry(id)
            .ok_or_else(|| unauthorized(&self.unknown_key).into_error())?;
        ctx.set_tenant(Arc::clone(&entry.tenant));
        ctx.state.insert(Caller {
            entry: id,
            admitted: None,
        });
        Ok(())
    }

    async fn request(&self, _client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<Flow> {
        let Some(caller) = ctx.state.get::<Caller>() else {
            return Ok(Flow::Continue);
        };
        let Some(entry) = self.entry(caller.entry) else {
            return Ok(Flow::Continue);
        };
        let Some(call) = ctx.llm() else {
            // Every route to an upstream is metered: a plain one (`/tokenize`, a catch-all to
            // vLLM) counts as a request and holds a concurrency slot; it carries no token
            // estimate. What Sluice answers itself (`/v1/models`) is not.
            if !matches!(ctx.route(), Route::Plain(_) | Route::StoredResponse) {
                return Ok(Flow::Continue);
            }
            let want = Want {
                input_tokens: 0,
                output_tokens: 0,
            };
            let admitted = entry
                .limits
                .admit(want)
                .await
                .map_err(ErrorReply::into_error)?;
            if let Some(caller) = ctx.state.get_mut::<Caller>() {
                caller.admitted = Some(admitted);
            }
            return Ok(Flow::Continue);
        };
        let capped = Self::apply_policy(entry, call)?;
        let call = capped.as_ref().unwrap_or(call);
        let demand = call.demand;
        let want = Want {
            input_tokens: demand.prompt_tokens,
            output_tokens: demand
                .output_tokens
                .saturating_mul(u64::from(demand.sequences.max(1))),
        };
        let anthropic = anthropic_headers(call);
        let admitted = entry.limits.admit(want).await.map_err(|mut reply| {
            if anthropic {
                let now = std::time::SystemTime::now();
                for (name, value) in &mut reply.headers {
                    let (n, v) = anthropic_header(name.clone(), value.clone(), now);
                    (*name, *value) = (n, v);
                }
            }
            reply.into_error()
        })?;
        if let Some(capped) = capped {
            ctx.rewrite_request(capped);
        }
        if let Some(caller) = ctx.state.get_mut::<Caller>() {
            caller.admitted = Some(admitted);
        }
        // The real counts correct the estimate once the answer is in.
        ctx.want_usage();
        Ok(Flow::Continue)
    }

    fn response_header(&self, response: &mut ResponseHeader, ctx: &mut RequestCtx) -> Result<()> {
        let Some(Caller {
            admitted: Some(admitted),
            ..
        }) = ctx.state.get::<Caller>()
        else {
            return Ok(());
        };
        // An unlimited tenant's answer is left as it came.
        if admitted.has_headers() {
            let anthropic = ctx.llm().is_some_and(anthropic_headers);
            let now = std::time::SystemTime::now();
            let Ok(()) = sluice_sdk::headers::edit(response, |headers| {
                admitted.each_header(|name, value| {
                    let (name, value) = if anthropic {
                        anthropic_header(name, value, now)
                    } else {
                        (name, value)
                    };
                    headers.insert(name, value);
                    Ok::<(), std::convert::Infallible>(())
                })
            });
        }
        Ok(())
    }

    fn response_headers_added(&self) -> usize {
        Admitted::MAX_HEADERS
    }

    /// Each tenant's limits and what is left of them, its spend against its budget.
    fn status(&self) -> Option<serde_json::Value> {
        serde_json::to_value(self.limiter.snapshot()).ok()
    }

    fn error(&self, reply: &ErrorReply, ctx: &mut RequestCtx) {
        let tenant = ctx.tenant().map_or("-", |t| &*t.name);
        metrics::rejected(tenant, reply.reason);
    }

    fn logging(&self, _error: Option<&Error>, ctx: &mut RequestCtx) {
        let Some(Caller { entry, admitted }) = ctx.state.remove::<Caller>() else {
            return;
        };
        let usage = used(ctx);
        if let Some(admitted) = admitted {
            // Settled before anything else is recorded: whoever sees this request counted
            // sees its correction made.
            admitted.settle(Some(usage));
        }
        if let Some(entry) = self.entry(entry) {
            entry.series.used(&usage);
            entry.series.request();
        }
    }
}

/// What an answer used, in tokens and dollars at the answering pool's price:
/// - nothing for a cached answer (it used no GPU), nor for a request no upstream generated
///   for: refused by Sluice before any attempt (a shed request, a queue timeout), or answered
///   with an upstream's error (five shed requests left a tenant rate-limited for nothing);
/// - the counts the core found in a whole answer;
/// - an answer cut short (a client that closed its stream, a timeout mid-generation) is
///   charged the estimate it was admitted with, or what its usage so far said if more: the
///   same on every route, whether its family's stream says a usage early (Anthropic's
///   `message_start`: the input and 0 output), as it goes (`continuous_usage_stats`), or
///   only at its end;
/// - and in every case, what answers generated but not sent used (a draft the speculative
///   selector rejected, at the draft pool's price): the engine spent it for this request.
fn used(ctx: &RequestCtx) -> Usage {
    let price = ctx
        .pool()
        .map_or(0.0, |p| p.settings.price_per_million_tokens);
    let discarded = ctx.progress().discarded;
    let priced = |input_tokens: u64, output_tokens: u64| Usage {
        input_tokens: input_tokens.saturating_add(discarded.prompt_tokens),
        output_tokens: output_tokens.saturating_add(discarded.completion_tokens),
        usd: input_tokens.saturating_add(output_tokens) as f64 * price / 1e6 + discarded.usd,
    };
    if ctx.answered_locally() {
        return priced(0, 0);
    }
    let progress = ctx.progress();
    let found = ctx.usage();
    if let Some(u) = found.filter(|_| !progress.response_incomplete) {
        return priced(u.prompt_tokens, u.completion_tokens);
    }
    if found.is_none()
        && (progress.attempts == 0 || progress.upstream_status.is_some_and(|s| s >= 400))
    {
        return priced(0, 0);
    }
    let demand = ctx.llm().map(|call| call.demand).unwrap_or_default();
    let output = demand
        .output_tokens
        .saturating_mul(u64::from(demand.sequences.max(1)));
    let so_far = found.unwrap_or_default();
    priced(
        demand.prompt_tokens.max(so_far.prompt_tokens),
        output.max(so_far.completion_tokens),
    )
}

/// Whether the request's answers carry Anthropic's rate-limit headers (its API family's
/// clients read those), not OpenAI's.
fn anthropic_headers(call: &LlmCall) -> bool {
    call.endpoint.family().rate_limit_headers() == sluice_sdk::family::RateLimitHeaders::Anthropic
}

/// The request hooks against a fake client: no socket, no proxy.
#[cfg(test)]
mod tests {
    use super::*;
    use sluice_testkit::{key_digest, plugin_host, routed_chat, FakeClient};

    fn tenants(config: serde_json::Value) -> Arc<dyn Plugin> {
        let config: TenantsConfig = serde_json::from_value(config).unwrap();
        let host = plugin_host(Vec::new());
        TenantsBuilder::resolve(config, &host)
            .unwrap()
            .unwrap()
            .start()
    }

    /// The answer a refused hook gives.
    fn refusal(e: &Error) -> ErrorReply {
        ErrorReply::carried_by(e).unwrap_or_else(|| panic!("no answer carried by {e}"))
    }

    fn chat() -> FakeClient {
        FakeClient::post("/v1/chat/completions").with_header("content-type", "application/json")
    }

    /// A context routed to chat with `model` asked for, as the core leaves it before
    /// `request`.
    fn routed(model: &str) -> RequestCtx {
        routed_chat(&format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#
        ))
    }

    /// The `early_request` hook on `client`'s request: its result, and the context after it.
    async fn identified(plugin: &dyn Plugin, mut client: FakeClient) -> (Result<()>, RequestCtx) {
        let mut ctx = RequestCtx::new();
        let early = plugin.early_request(&mut client, &mut ctx).await;
        (early, ctx)
    }

    /// `acme`'s request for `model`, from its start to its end.
    async fn asking(plugin: &dyn Plugin, model: &str) -> Result<Flow> {
        let mut client = chat().with_header("authorization", "Bearer sk-acme");
        let mut ctx = routed(model);
        plugin.early_request(&mut client, &mut ctx).await?;
        let asked = plugin.request(&mut client, &mut ctx).await;
        plugin.logging(None, &mut ctx);
        asked
    }

    #[tokio::test]
    async fn a_request_without_a_known_key_is_refused_with_401() {
        let plugin = tenants(serde_json::json!({
            "enabled": true,
            "tenants": {"acme": {"keys": [key_digest("sk-acme")]}},
        }));
        for client in [
            chat(),
            chat().with_header("authorization", "Bearer sk-someone-else"),
        ] {
            let (early, ctx) = identified(&*plugin, client).await;
            assert_eq!(refusal(&early.unwrap_err()).status, 401);
            assert!(ctx.tenant().is_none());
        }
        let acme = chat().with_header("authorization", "Bearer sk-acme");
        let (early, ctx) = identified(&*plugin, acme).await;
        early.unwrap();
        assert_eq!(&*ctx.tenant().unwrap().name, "acme");
    }

    #[tokio::test]
    async fn the_tenant_header_names_the_tenant_only_from_a_trusted_proxy() {
        let plugin = tenants(serde_json::json!({
            "enabled": true,
            "tenants": {"acme": {}},
            "trusted_proxies": ["10.0.0.0/8"],
            "tenant_header": "x-tenant",
        }));
        let named = || chat().with_header("x-tenant", "acme");
        let gateway = named().from_peer("10.1.2.3:5000".parse().unwrap());
        let (early, ctx) = identified(&*plugin, gateway).await;
        early.unwrap();
        assert_eq!(&*ctx.tenant().unwrap().name, "acme");

        // The same header straight from a client means nothing: no key, no tenant.
        let stranger = named().from_peer("192.0.2.7:5000".parse().unwrap());
        let (early, _) = identified(&*plugin, stranger).await;
        assert_eq!(refusal(&early.unwrap_err()).status, 401);
    }

    #[tokio::test]
    async fn a_model_not_the_tenants_is_403_and_a_request_over_its_rate_is_429() {
        let plugin = tenants(serde_json::json!({
            "enabled": true,
            "tenants": {"acme": {
                "keys": [key_digest("sk-acme")],
                "models": ["m"],
                "limits": {"requests_per_minute": 1},
            }},
        }));
        let e = asking(&*plugin, "other").await.unwrap_err();
        let reply = refusal(&e);
        assert_eq!((reply.status, reply.param.as_deref()), (403, Some("model")));

        assert!(matches!(asking(&*plugin, "m").await, Ok(Flow::Continue)));
        let e = asking(&*plugin, "m").await.unwrap_err();
        let reply = refusal(&e);
        assert_eq!(reply.status, 429);
        assert!(reply.retry_after.is_some_and(|s| s > 0), "{reply:?}");
    }
}
