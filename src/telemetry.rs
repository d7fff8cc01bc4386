//! Traces: an OpenTelemetry span for every request (kind server) and every upstream attempt
//! (kind client, named and described after the GenAI semantic conventions), exported over
//! OTLP (HTTP/protobuf or gRPC) to a collector. Absent `telemetry`, none of this exists: no
//! layer, no runtime, no header read or written.
//!
//! The spans are Sluice's `tracing` spans (`sluice::request`, `sluice::attempt`), made
//! OpenTelemetry spans by `tracing-opentelemetry`'s layer, and their events (a plugin's
//! `tracing` event under target [`sluice_sdk::SPAN_EVENTS`]: shed, escalated, coalesced follower, first
//! token) span events. A client's `traceparent` continues its trace (or, with
//! `client_traces: ignore`, an edge proxy starts its own); every attempt sends the engine a
//! `traceparent` naming the attempt's span, under which vLLM's own `llm_request` span nests.
//!
//! Sampling is decided before a request's span is made ([`open_request_span`]: the client's
//! decision when its trace is continued, else the ratio), and only a sampled request's spans
//! reach the traces layer: an unsampled one costs a draw and a branch, no OpenTelemetry span.
//! The engine is told either way, so that it samples as Sluice did.
//!
//! Export is off the request path: a finished span goes into a bounded queue (a span that
//! finds it full is dropped and counted), which a task of a runtime of its own (one thread,
//! started with the first span, so after a daemon's fork) sends in batches. The task is woken
//! by a full batch or by its clock, never by each span (a cross-thread wake-up per span cost
//! the proxy's threads more than the span). The SDK's own batch processor is not used
//! because it counts no drops and wakes its thread per span; the queue here is the few lines
//! that do neither.

use crate::config::{TelemetrySettings, TraceProtocol};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use sluice_sdk::metric;
use std::cell::Cell;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// Finished spans waiting to be sent; one that finds it full is dropped.
const QUEUE: usize = 4096;
/// The most spans sent in one export.
const BATCH: usize = 512;
/// The longest a span waits in the queue for a batch to fill (a full batch wakes the export
/// task at once).
const BATCH_EVERY: Duration = Duration::from_secs(1);
/// The longest one export may take (the collector down or slow: its spans are dropped).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most bytes of a span's name or of a text attribute a client's request sets (its path,
/// its model): a client cannot make the queue of [`QUEUE`] spans hold more than a few MB.
const MAX_TEXT: usize = 256;

/// `text` cut to [`MAX_TEXT`] bytes, at a character's boundary.
fn capped(text: &str) -> String {
    if text.len() <= MAX_TEXT {
        return text.to_string();
    }
    let mut end = MAX_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

metric!(SPANS: IntCounterVec = register_int_counter_vec!(
    "sluice_trace_spans_total",
    "Finished trace spans by what became of them: exported, dropped_queue_full (the export \
     queue was full), dropped_export_failed (the collector refused them or was unreachable).",
    &["result"]
));

/// What the proxy needs of tracing once it runs.
struct Tracing {
    /// Whether clients' `traceparent` continue their traces.
    continue_client_traces: bool,
    /// The share of new traces sampled.
    sampling: f64,
    /// Keeps the tracer's provider (and its span processor) alive.
    _provider: SdkTracerProvider,
    /// The span processor's queue, for [`stop`].
    queue: Arc<OnceLock<Option<Queue>>>,
}

static TRACING: OnceLock<Tracing> = OnceLock::new();

thread_local! {
    /// Whether the request or attempt span being made goes to the traces layer: set by
    /// [`kept`] around the span's making, read by the layer's filter.
    static KEEP: Cell<bool> = const { Cell::new(false) };
}

/// Makes a request's or attempt's span with `open`, in the traces layer when `sampled`.
pub fn kept(sampled: bool, open: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if !sampled {
        return open();
    }
    KEEP.with(|keep| keep.set(true));
    let span = open();
    KEEP.with(|keep| keep.set(false));
    span
}

/// Tracing, when the config turned it on (see [`start`]).
fn get() -> Option<&'static Tracing> {
    TRACING.get()
}

/// Whether traces are on in this process (`telemetry` in the config it started with).
pub fn enabled() -> bool {
    get().is_some()
}

/// Starts the exporter and returns the layer that makes Sluice's request and attempt spans
/// OpenTelemetry spans, for the logging set-up to add. Once per process (a reload cannot
/// change `telemetry`).
pub fn start<S>(settings: &TelemetrySettings) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    let resource = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .build();
    let processor = QueueProcessor {
        settings: settings.clone(),
        resource: resource.clone(),
        queue: Arc::new(OnceLock::new()),
    };
    let queue = Arc::clone(&processor.queue);
    let provider = SdkTracerProvider::builder()
        // Every span that reaches the layer is sampled: see `open_request_span`.
        .with_sampler(Sampler::AlwaysOn)
        .with_resource(resource)
        .with_span_processor(processor)
        .build();
    let tracer = provider.tracer("sluice");
    metrics_init();
    let _ = TRACING.set(Tracing {
        continue_client_traces: settings.continue_client_traces,
        sampling: settings.sampling,
        _provider: provider,
        queue,
    });
    // Targets at `info`, not a filter function: its level hint keeps the subscriber's (and
    // with it the `log` bridge's) maximum level where the log layer put it. A hint of `trace`
    // would make every `log::trace!` of Pingora's evaluate its arguments (on every chunk of a
    // chunked answer), for nobody.
    let only_ours = tracing_subscriber::filter::Targets::new()
        .with_target("sluice::request", tracing::Level::INFO)
        .with_target("sluice::attempt", tracing::Level::INFO)
        .with_target(sluice_sdk::SPAN_EVENTS, tracing::Level::INFO);
    // Spans only when sampled (asked at each); events always (one outside a sampled span
    // finds no span of the layer's to go on).
    let only_sampled = tracing_subscriber::filter::DynFilterFn::new(|meta, _| {
        !meta.is_span() || KEEP.with(Cell::get)
    })
    .with_callsite_filter(|meta| {
        if meta.is_span() {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::always()
        }
    })
    .with_max_level_hint(tracing::level_filters::LevelFilter::TRACE);
    // Only what a trace needs: no OpenTelemetry context made current at every poll of an
    // instrumented future (nothing here reads it), no busy/idle time, no source location,
    // thread or target attributes on every span.
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_context_activation(false)
        .with_tracked_inactivity(false)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_level(false)
        .with_filter(tracing_subscriber::filter::FilterExt::and(
            only_ours,
            only_sampled,
        ))
}

/// Creates the exported series at zero, so dashboards see them from start-up.
fn metrics_init() {
    for result in ["exported", "dropped_queue_full", "dropped_export_failed"] {
        sluice_sdk::metrics::touch(&SPANS, &[result]);
    }
}

fn exporter(settings: &TelemetrySettings) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match settings.protocol {
        TraceProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(http_traces_url(&settings.endpoint))
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
        TraceProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(settings.endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
    };
    built.map_err(|e| format!("telemetry.otlp: {e}"))
}

/// The collector's traces URL: the endpoint as given when it has a path, else OTLP's
/// `/v1/traces` under it (`http://collector:4318` → `http://collector:4318/v1/traces`).
fn http_traces_url(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    let after_scheme = trimmed.split_once("://").map_or(trimmed, |(_, rest)| rest);
    if after_scheme.contains('/') {
        trimmed.to_string()
    } else {
        format!("{trimmed}/v1/traces")
    }
}

/// Ends tracing as the process exits: the spans still queued are sent, for at most `within`.
pub fn stop(within: Duration) {
    let Some(Some(queue)) = TRACING.get().and_then(|t| t.queue.get()) else {
        return;
    };
    let (sent, done) = std::sync::mpsc::channel();
    if queue.flushes.send(sent).is_ok() {
        queue.wake.notify_one();
        let _ = done.recv_timeout(within);
    }
}

/// Finished spans into a bounded queue, sent in batches by a task of the telemetry runtime.
#[derive(Debug)]
struct QueueProcessor {
    settings: TelemetrySettings,
    resource: Resource,
    /// The queue, once the first span started the runtime; `None` when it could not start.
    /// Shared with [`stop`].
    queue: Arc<OnceLock<Option<Queue>>>,
}

/// The export task's inputs.
#[derive(Debug)]
struct Queue {
    spans: mpsc::Sender<SpanData>,
    /// Wakes the export task: a batch is full, or a flush is asked for.
    wake: Arc<Notify>,
    /// Flushes asked for: each is answered once what was queued before it went out.
    flushes: mpsc::UnboundedSender<std::sync::mpsc::Sender<()>>,
}

impl QueueProcessor {
    /// Starts the runtime, the exporter and its task.
    fn start(&self) -> Option<Queue> {
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sluice-otlp")
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!("telemetry: cannot start its runtime: {e}");
                return None;
            }
        };
        // The gRPC client needs a Tokio runtime when it is made.
        let exporter = {
            let _entered = runtime.enter();
            exporter(&self.settings)
        };
        let mut exporter = match exporter {
            Ok(exporter) => exporter,
            Err(e) => {
                tracing::error!("telemetry: {e}");
                return None;
            }
        };
        exporter.set_resource(&self.resource);
        let (queue, spans) = mpsc::channel(QUEUE);
        let (flushes, flushes_asked) = mpsc::unbounded_channel();
        let wake = Arc::new(Notify::new());
        runtime.spawn(export_loop(
            exporter,
            spans,
            Arc::clone(&wake),
            flushes_asked,
        ));
        // The runtime lives as long as the process: its thread sends the batches.
        std::mem::forget(runtime);
        Some(Queue {
            spans: queue,
            wake,
            flushes,
        })
    }
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        let queue = self.queue.get_or_init(|| self.start());
        match queue {
            Some(queue) => {
                if queue.spans.try_send(span).is_err() {
                    sluice_sdk::metrics::inc(&SPANS, &["dropped_queue_full"]);
                } else if QUEUE - queue.spans.capacity() >= BATCH {
                    queue.wake.notify_one();
                }
            }
            None => sluice_sdk::metrics::inc(&SPANS, &["dropped_export_failed"]),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Sends the queue's spans in batches of at most [`BATCH`]: when woken by a full batch or a
/// flush, or [`BATCH_EVERY`] after the last round. It never waits on the queue itself, so a
/// span's sending wakes nobody.
async fn export_loop<E: SpanExporter>(
    exporter: E,
    mut spans: mpsc::Receiver<SpanData>,
    wake: Arc<Notify>,
    mut flushes: mpsc::UnboundedReceiver<std::sync::mpsc::Sender<()>>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(BATCH_EVERY) => {}
        }
        let flushed: Vec<_> = std::iter::from_fn(|| flushes.try_recv().ok()).collect();
        loop {
            while batch.len() < BATCH {
                match spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) if batch.is_empty() => return,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            }
            if batch.is_empty() {
                break;
            }
            let full = batch.len() == BATCH;
            export(&exporter, std::mem::take(&mut batch)).await;
            if !full {
                break;
            }
        }
        for done in flushed {
            let _ = done.send(());
        }
    }
}

/// Sends one batch, counting its spans as exported or dropped.
async fn export<E: SpanExporter>(exporter: &E, batch: Vec<SpanData>) {
    let count = batch.len() as u64;
    match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(batch)).await {
        Ok(Ok(())) => sluice_sdk::metrics::inc_by(&SPANS, &["exported"], count),
        Ok(Err(e)) => {
            sluice_sdk::metrics::inc_by(&SPANS, &["dropped_export_failed"], count);
            tracing::debug!("telemetry: {count} spans not exported: {e}");
        }
        Err(_) => sluice_sdk::metrics::inc_by(&SPANS, &["dropped_export_failed"], count),
    }
}

/// Opens the request's span with `open`, sampled or not (see the module's header): with the
/// client's trace as its parent when it sent one and the config trusts it, named after the
/// request (`POST /v1/chat/completions`) and marked the server's. Returns the span and
/// whether it is sampled.
pub fn open_request_span(
    header: &pingora_http::RequestHeader,
    open: impl FnOnce() -> tracing::Span,
) -> (tracing::Span, bool) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let Some(tracing) = get() else {
        return (open(), false);
    };
    let parent = (tracing.continue_client_traces && header.headers.contains_key("traceparent"))
        .then(|| TraceContextPropagator::new().extract(&HeaderExtractor(&header.headers)))
        .filter(|parent| parent.span().span_context().is_valid());
    // A client's sampled flag is honoured up to the operator's ratio, never beyond: any
    // client could otherwise make every request of its own a span.
    let sampled = match &parent {
        Some(parent) => {
            parent.span().span_context().is_sampled() && fastrand::f64() < tracing.sampling
        }
        None => fastrand::f64() < tracing.sampling,
    };
    let span = kept(sampled, open);
    if sampled {
        span.record(
            "otel.name",
            capped(&format!("{} {}", header.method, header.uri.path())),
        );
        span.record("otel.kind", "server");
        if let Some(parent) = parent {
            let _ = span.set_parent(parent);
        }
    }
    (span, sampled)
}

/// Tells the engine how the attempt is traced, with the `traceparent` it goes with (the
/// client's trace headers never reach it: see `llm_route::upstream_header`): the attempt's
/// span when sampled, under which vLLM's own span nests; when not, a new trace marked
/// unsampled (so an engine that traces does not start one of its own for it, and no client
/// decides what the engine traces).
pub fn trace_upstream(
    header: &mut pingora_http::RequestHeader,
    span: &tracing::Span,
    sampled: bool,
) -> pingora_error::Result<()> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if get().is_none() {
        return Ok(());
    }
    if !sampled {
        return header.insert_header("traceparent", unsampled_traceparent().as_slice());
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(header));
    Ok(())
}

/// What the request came to, on its span as it ends: Sluice's facts as `sluice.*`.
pub fn request_ended(ctx: &sluice_sdk::RequestCtx) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !ctx.traced() {
        return;
    }
    let span = ctx.span();
    span.set_attribute("sluice.route", ctx.route().label().to_string());
    let cache = if ctx.answered_locally() {
        "hit"
    } else {
        "miss"
    };
    span.set_attribute("sluice.cache", cache);
    let retries = ctx.progress().attempts.saturating_sub(1);
    span.set_attribute("sluice.retries", i64::from(retries));
    if let Some(id) = ctx.request_id() {
        span.set_attribute("sluice.request_id", id.to_string());
    }
    if let Some(model) = ctx.model() {
        span.set_attribute("sluice.model", capped(model));
    }
    if let Some(pool) = ctx.pool() {
        span.set_attribute("sluice.pool", pool.name.to_string());
    }
    if let Some(tenant) = ctx.tenant() {
        span.set_attribute("sluice.tenant", tenant.name.to_string());
    }
    if let Some(reason) = ctx.escalated() {
        span.set_attribute("sluice.escalation.reason", reason);
    }
    if let Some(status) = ctx.progress().status {
        span.set_attribute("http.response.status_code", i64::from(status));
    }
}

/// Names an attempt's span after the GenAI conventions (`chat {model}`), marks it a client's,
/// and gives it the request's `gen_ai.*` attributes and the backend it goes to.
pub fn describe_attempt(
    span: &tracing::Span,
    ctx: &sluice_sdk::RequestCtx,
    pool: &sluice_sdk::Pool,
    backend: std::net::SocketAddr,
    prefill_leg: bool,
) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !ctx.traced() {
        return;
    }
    span.record("otel.kind", "client");
    span.set_attribute("server.address", backend.ip().to_string());
    span.set_attribute("server.port", i64::from(backend.port()));
    span.set_attribute("sluice.pool", pool.name.to_string());
    let Some(call) = ctx.llm() else {
        return;
    };
    let operation = call.endpoint.family().operation();
    let model = call.request.model.as_deref().unwrap_or("");
    span.record(
        "otel.name",
        capped(format!("{operation} {model}").trim_end()),
    );
    span.set_attribute("gen_ai.operation.name", operation);
    span.set_attribute("gen_ai.provider.name", "vllm");
    span.set_attribute("gen_ai.request.model", capped(model));
    if prefill_leg {
        // A prefill leg asks for one token, whatever the client asked.
        pd_leg(span, "prefill");
        span.set_attribute("gen_ai.request.max_tokens", 1);
    } else if let Some(max) = call.request.max_output_tokens() {
        span.set_attribute("gen_ai.request.max_tokens", i64::from(max));
    }
}

/// Marks an attempt span as one leg of a disaggregated request: `decode`, or `prefill`
/// (see [`describe_attempt`]).
pub fn pd_leg(span: &tracing::Span, leg: &'static str) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !span.is_none() {
        span.set_attribute("sluice.pd.leg", leg);
    }
}

/// Records how a try (or a prefill leg) ended on its span: the backend's status and
/// `outcome`.
pub fn try_ended(span: &tracing::Span, status: Option<u16>, outcome: &str) {
    if let Some(status) = status {
        span.record("http.response.status_code", status);
    }
    span.record("sluice.outcome", outcome);
}

/// What an attempt came to, on its span: how it ended, and on LLM routes the model that
/// answered and the tokens used, when the answer said (a stream's too: its usage is read as
/// it passes).
pub fn attempt_ended(attempt: &sluice_sdk::AttemptReport, ctx: &sluice_sdk::RequestCtx) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = &attempt.span;
    try_ended(span, attempt.status, attempt.outcome.as_str());
    if ctx.llm().is_none() || !ctx.traced() {
        return;
    }
    let requested = ctx.model();
    // The pool the attempt went to (the request's until the core decides what follows).
    let served = ctx
        .pool()
        .filter(|pool| pool.name == attempt.pool)
        .and_then(|pool| pool.served_model_for(requested));
    let answered = match served {
        Some(served) => served.name().to_string(),
        None => requested.unwrap_or("").to_string(),
    };
    span.set_attribute("gen_ai.response.model", capped(&answered));
    if let Some(usage) = ctx.usage() {
        span.set_attribute(
            "gen_ai.usage.input_tokens",
            i64::try_from(usage.prompt_tokens).unwrap_or(i64::MAX),
        );
        span.set_attribute(
            "gen_ai.usage.output_tokens",
            i64::try_from(usage.completion_tokens).unwrap_or(i64::MAX),
        );
    }
}

/// The trace id of the request, when it is sampled.
pub fn trace_id(ctx: &sluice_sdk::RequestCtx) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !ctx.traced() {
        return None;
    }
    let cx = ctx.span().context();
    let span_context = cx.span().span_context().clone();
    span_context
        .is_valid()
        .then(|| span_context.trace_id().to_string())
}

/// A `traceparent` of a new trace, flagged unsampled: random non-zero ids, written by hand
/// (`format!` of a `u128` cost more than the rest of an unsampled request's tracing).
fn unsampled_traceparent() -> [u8; 55] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    let (trace, span) = (fastrand::u128(1..), fastrand::u64(1..));
    for (i, digit) in out[3..35].iter_mut().enumerate() {
        *digit = HEX[((trace >> (124 - 4 * i)) & 0xf) as usize];
    }
    for (i, digit) in out[36..52].iter_mut().enumerate() {
        *digit = HEX[((span >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Writes the propagator's headers straight into an upstream request.
struct HeaderInjector<'a>(&'a mut pingora_http::RequestHeader);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The W3C propagator sets only these; named statically, they are not copied.
        let name = match key {
            "traceparent" => "traceparent",
            "tracestate" => "tracestate",
            _ => return,
        };
        // Its values are always valid header values.
        let _ = self.0.insert_header(name, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsampled_traceparent_is_w3cs_with_the_sampled_flag_off() {
        use opentelemetry::trace::TraceContextExt;
        let a = unsampled_traceparent();
        let b = unsampled_traceparent();
        assert_ne!(a, b);
        let text = std::str::from_utf8(&a).unwrap();
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", text.parse().unwrap());
        let parsed = TraceContextPropagator::new().extract(&HeaderExtractor(&headers));
        let context = parsed.span().span_context().clone();
        assert!(context.is_valid() && context.is_remote(), "{text}");
        assert!(!context.is_sampled(), "{text}");
        assert_eq!(
            format!("00-{}-{}-00", context.trace_id(), context.span_id()),
            text
        );
    }

    #[test]
    fn the_traces_url_is_otlps_under_a_bare_endpoint() {
        assert_eq!(
            http_traces_url("http://collector:4318"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            http_traces_url("http://collector:4318/"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            http_traces_url("https://otel.example/custom/traces"),
            "https://otel.example/custom/traces"
        );
    }
}
