//! The plugin chain: one table of the plugins Sluice ships, in their defined order; each
//! section resolved once at load, started once, then driven hook by hook.
//!
//! The order is part of the product (documented in `conf/README.md`): plugins that identify a
//! request come first, then those that may answer it without an upstream, then those that
//! choose where it goes. A disabled plugin is not in the chain and costs nothing.
//!
//! 1. `request_id`: every answer, errors included, carries the id.
//! 2. `tenants`: who is calling (401 otherwise), what it may ask for, its limits; the
//!    plugins after it read the tenant, never client headers.
//! 3. `cache`: a hit is answered before any upstream is touched.
//! 4. `speculative`: sends the request to a draft pool first, with the target pool as its
//!    escalation, or straight to the target.
//! 5. `kv_breaker`: admits the request to its pool, sends it to another pool serving its
//!    model, or sheds it with 503 before the pool's KV cache runs out.
//!
//! Response hooks run in the reverse order, as Envoy runs its encoder filters: the plugin
//! nearest the upstream sees its answer first, so the cache stores the answer exactly as the
//! client gets it, after the selector removed what it had asked for on the client's behalf.
//!
//! The core observes requests through the same hooks (`crate::observers`: attempt metrics,
//! traces, the access log), registered only when on. Its observers hear of an attempt's end
//! before the plugins (the attempt's span carries its outcome when they read it), and shape
//! the upstream request and hear of a request's end after them (the trace context a plugin
//! cannot overwrite; the log line has what the plugins recorded).

use bytes::Bytes;
use pingora_error::{Error, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use sluice_sdk::{
    AttemptReport, AttemptStart, ConfigError, ErrorReply, Flow, Host, LocalResponse, Plugin,
    PluginBuilder, RequestCtx,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Every plugin, in chain order. Adding a plugin is its crate in `Cargo.toml` and one line
/// here.
const PLUGINS: [Entry; 5] = [
    Entry::of::<sluice_plugin_request_id::RequestIdBuilder>(),
    Entry::of::<sluice_plugin_tenants::TenantsBuilder>(),
    Entry::of::<sluice_plugin_cache::CacheBuilder>(),
    Entry::of::<sluice_plugin_speculative::SpeculativeBuilder>(),
    Entry::of::<sluice_plugin_kv_breaker::KvBreakerBuilder>(),
];

/// The config file's `plugins` section: one section per plugin, by name.
pub type Sections = BTreeMap<String, serde_yaml_ng::Value>;

/// One row of [`PLUGINS`]: a plugin's name and how its section is resolved.
struct Entry {
    name: &'static str,
    resolve: ResolveSection,
}

/// Reads a plugin's section (absent: `None`) and resolves it: `Ok(None)` when disabled.
type ResolveSection =
    fn(Option<serde_yaml_ng::Value>, &Host) -> Result<Option<Resolved>, ConfigError>;

impl Entry {
    const fn of<B: PluginBuilder>() -> Self {
        Self {
            name: B::NAME,
            resolve: resolve_section::<B>,
        }
    }
}

/// Reads a section into the plugin's config type (absent: its defaults) and resolves it.
/// Keys in errors are relative to the section.
fn resolve_section<B: PluginBuilder>(
    section: Option<serde_yaml_ng::Value>,
    host: &Host,
) -> Result<Option<Resolved>, ConfigError> {
    let config = match section {
        None => B::Config::default(),
        Some(value) => serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            let key = if key == "." { String::new() } else { key };
            ConfigError::new(key, e.into_inner().to_string())
        })?,
    };
    Ok(B::resolve(config, host)?.map(|ready| Resolved {
        name: B::NAME,
        ready: Box::new(ready),
    }))
}

/// A plugin whose section resolved, ready to start.
pub struct Resolved {
    name: &'static str,
    ready: Box<dyn Start>,
}

/// [`PluginBuilder::start`] behind a box, so the table can hold every plugin's type.
trait Start: Send {
    fn start(self: Box<Self>) -> Arc<dyn Plugin>;
}

impl<B: PluginBuilder> Start for B {
    fn start(self: Box<Self>) -> Arc<dyn Plugin> {
        PluginBuilder::start(*self)
    }
}

/// The enabled plugins, resolved, in chain order.
pub struct ResolvedPlugins(Vec<Resolved>);

impl std::fmt::Debug for ResolvedPlugins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl ResolvedPlugins {
    /// The names of the enabled plugins, in chain order.
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|r| r.name).collect()
    }
}

/// Resolves every plugin's section, in chain order (every section, enabled or not, so that
/// `sluice -t` finds a mistake before the plugin is turned on). Keys in errors start at
/// `plugins`.
pub fn resolve(mut sections: Sections, host: &Host) -> Result<ResolvedPlugins, ConfigError> {
    if let Some(unknown) = sections
        .keys()
        .find(|k| PLUGINS.iter().all(|p| p.name != *k))
    {
        let known: Vec<String> = PLUGINS.iter().map(|p| format!("`{}`", p.name)).collect();
        return Err(ConfigError::new(
            format!("plugins.{unknown}"),
            format!(
                "unknown field `{unknown}`, expected one of {}",
                known.join(", ")
            ),
        ));
    }
    let mut resolved = Vec::new();
    for entry in &PLUGINS {
        let section = sections.remove(entry.name);
        let under = format!("plugins.{}", entry.name);
        if let Some(ready) = (entry.resolve)(section, host).map_err(|e| e.under(&under))? {
            resolved.push(ready);
        }
    }
    Ok(ResolvedPlugins(resolved))
}

pub struct Chain {
    plugins: Vec<Arc<dyn Plugin>>,
    /// The core's own observers (see the module's header): they use `upstream_request`,
    /// `attempt_end` and `logging` only.
    observers: Vec<Arc<dyn Plugin>>,
    /// The sum of the plugins' [`Plugin::response_headers_added`].
    response_headers_added: usize,
}

impl Chain {
    /// Starts the resolved plugins (their metrics, stores and background work) after the
    /// core's `observers`.
    pub fn start(resolved: ResolvedPlugins, observers: Vec<Arc<dyn Plugin>>) -> Self {
        let plugins: Vec<Arc<dyn Plugin>> =
            resolved.0.into_iter().map(|r| r.ready.start()).collect();
        let response_headers_added = plugins.iter().map(|p| p.response_headers_added()).sum();
        Self {
            plugins,
            observers,
            response_headers_added,
        }
    }

    /// The most headers the plugins' `response_header` hooks add to one answer together.
    pub fn response_headers_added(&self) -> usize {
        self.response_headers_added
    }

    /// The plugin names in chain order.
    pub fn names(&self) -> Vec<&'static str> {
        self.plugins.iter().map(|p| p.name()).collect()
    }

    /// The plugins themselves, shared: for what runs beside the chain (the stop).
    pub fn plugins(&self) -> Vec<Arc<dyn Plugin>> {
        self.plugins.clone()
    }

    pub async fn early_request(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<()> {
        for p in &self.plugins {
            p.early_request(session, ctx).await?;
        }
        Ok(())
    }

    /// Runs `request` hooks until one answers or fails. `Some` is the answer to send.
    pub async fn request(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Box<LocalResponse>>> {
        for p in &self.plugins {
            if let Flow::Respond(response) = p.request(session, ctx).await? {
                return Ok(Some(response));
            }
        }
        Ok(None)
    }

    pub fn upstream_select(&self, ctx: &mut RequestCtx) -> Result<()> {
        self.plugins.iter().try_for_each(|p| p.upstream_select(ctx))
    }

    /// The plugins' headers, then the core's (the trace context).
    pub fn upstream_request(
        &self,
        request: &mut RequestHeader,
        attempt: &AttemptStart<'_>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.plugins
            .iter()
            .chain(&self.observers)
            .try_for_each(|p| p.upstream_request(request, attempt, ctx))
    }

    pub fn response_header(
        &self,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.plugins
            .iter()
            .rev()
            .try_for_each(|p| p.response_header(response, ctx))
    }

    pub fn response_body(
        &self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.plugins
            .iter()
            .rev()
            .try_for_each(|p| p.response_body(body, end_of_stream, ctx))
    }

    /// An upstream attempt ended: the core's observers first, then the plugins in reverse
    /// order, as the response hooks.
    pub fn attempt_end(&self, attempt: &AttemptReport, ctx: &mut RequestCtx) {
        self.observers
            .iter()
            .chain(self.plugins.iter().rev())
            .for_each(|p| p.attempt_end(attempt, ctx));
    }

    pub fn error(&self, reply: &ErrorReply, ctx: &mut RequestCtx) {
        self.plugins.iter().for_each(|p| p.error(reply, ctx));
    }

    /// The request ended: the plugins, then the core's observers.
    pub fn logging(&self, error: Option<&Error>, ctx: &mut RequestCtx) {
        self.plugins
            .iter()
            .chain(&self.observers)
            .for_each(|p| p.logging(error, ctx));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::AttemptOutcome;
    use std::sync::Mutex;

    /// Who heard of which attempt, and how it ended.
    type Heard = Arc<Mutex<Vec<(&'static str, u32, AttemptOutcome)>>>;

    /// Records the attempts it is told of, under its name.
    struct Observer {
        name: &'static str,
        seen: Heard,
    }

    impl Plugin for Observer {
        fn name(&self) -> &'static str {
            self.name
        }

        fn attempt_end(&self, attempt: &AttemptReport, _ctx: &mut RequestCtx) {
            self.seen
                .lock()
                .unwrap()
                .push((self.name, attempt.number, attempt.outcome));
        }

        fn upstream_request(
            &self,
            request: &mut RequestHeader,
            attempt: &AttemptStart<'_>,
            _ctx: &mut RequestCtx,
        ) -> Result<()> {
            let heard = format!("{}:{}", self.name, attempt.number);
            request.append_header("x-heard", heard)?;
            Ok(())
        }

        fn logging(&self, _error: Option<&Error>, _ctx: &mut RequestCtx) {
            self.seen
                .lock()
                .unwrap()
                .push((self.name, 0, AttemptOutcome::Response));
        }
    }

    #[test]
    fn the_core_hears_of_an_attempt_first_then_each_plugin_nearest_the_upstream_first() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let observer = |name| -> Arc<dyn Plugin> {
            Arc::new(Observer {
                name,
                seen: Arc::clone(&seen),
            })
        };
        let chain = Chain {
            plugins: vec![observer("first"), observer("second")],
            observers: vec![observer("core")],
            response_headers_added: 0,
        };
        let mut ctx = RequestCtx::new();
        // The upstream request: the plugins' headers, then the core's.
        let mut request = RequestHeader::build("POST", b"/v1/completions", None).unwrap();
        let span = tracing::Span::none();
        let start = AttemptStart {
            number: 1,
            pool: "draft",
            backend: ([127, 0, 0, 1], 8000).into(),
            span: &span,
            prefill_leg: false,
        };
        chain
            .upstream_request(&mut request, &start, &mut ctx)
            .unwrap();
        let heard: Vec<_> = request
            .headers
            .get_all("x-heard")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(heard, ["first:1", "second:1", "core:1"]);
        for (number, outcome) in [(1, AttemptOutcome::Timeout), (2, AttemptOutcome::Response)] {
            let attempt = AttemptReport {
                number,
                pool: "draft".into(),
                backend: ([127, 0, 0, 1], 8000).into(),
                started: std::time::Instant::now(),
                elapsed: std::time::Duration::ZERO,
                status: None,
                outcome,
                span: tracing::Span::none(),
            };
            chain.attempt_end(&attempt, &mut ctx);
        }
        chain.logging(None, &mut ctx);
        use AttemptOutcome::{Response, Timeout};
        assert_eq!(
            *seen.lock().unwrap(),
            [
                ("core", 1, Timeout),
                ("second", 1, Timeout),
                ("first", 1, Timeout),
                ("core", 2, Response),
                ("second", 2, Response),
                ("first", 2, Response),
                // The request's end: the plugins, then the core.
                ("first", 0, Response),
                ("second", 0, Response),
                ("core", 0, Response),
            ]
        );
    }
}
