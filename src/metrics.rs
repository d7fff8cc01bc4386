//! The core's Prometheus series. Names the seeds' dashboards use are kept as `conf/README.md`
//! lists them; all others are `sluice_*`. They live in `prometheus`' default registry, which
//! the admin listener's `/metrics` serves.
//!
//! Label values come from config (pool, route) or from a fixed set, never from raw client
//! input, so a client cannot blow up cardinality: an unknown model is `-`.

use prometheus::{Encoder, TextEncoder};
use sluice_sdk::metric;
use sluice_sdk::metrics::{inc_by, touch};
use sluice_sdk::{AttemptOutcome, Pools, Reason};

pub use sluice_sdk::metrics::{inc, observe, set, set_gauge};

/// Buckets for whole LLM requests: from a cache hit (sub-millisecond) to long generations.
const REQUEST_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];

/// Buckets for time to first byte.
const TTFB_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

metric!(LLM_REQUEST_DURATION: HistogramVec = register_histogram_vec!(
    "llm_request_duration_seconds",
    "Duration of LLM requests, from the request to the last byte of the answer.",
    &["cache_hit", "model"],
    REQUEST_BUCKETS.to_vec()
));

metric!(ROUTER_REQUEST_DURATION: HistogramVec = register_histogram_vec!(
    "router_request_duration_seconds",
    "Duration of proxied requests by the pool that served them.",
    &["pool"],
    REQUEST_BUCKETS.to_vec()
));

metric!(STREAM_FIRST_BYTE: HistogramVec = register_histogram_vec!(
    "sluice_stream_first_byte_seconds",
    "Time from a streaming request's arrival to its first response byte sent to the client.",
    &["pool"],
    TTFB_BUCKETS.to_vec()
));

/// Buckets for Sluice's own time in a request's path: tens of microseconds for a small
/// request's work (every 10 µs up to 200 µs, where the latency targets are), to the
/// milliseconds of tokenizing or hashing a long prompt.
const ADDED_BUCKETS: &[f64] = &[
    0.00001, 0.00002, 0.00003, 0.00004, 0.00005, 0.00006, 0.00007, 0.00008, 0.00009, 0.0001,
    0.00011, 0.00012, 0.00013, 0.00014, 0.00015, 0.00016, 0.00017, 0.00018, 0.00019, 0.0002,
    0.00025, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    1.0,
];

metric!(ADDED: HistogramVec = register_histogram_vec!(
    "sluice_added_seconds",
    "Sluice's own time in an LLM request's path, by phase: `request`, from its body read whole \
     to its last byte written to the first backend tried (parsing, the plugins' request hooks, \
     the choice of a backend, a connection); `chunk`, from a chunk of the answer read from the \
     backend to its write to the client returning. A request held for room (`fairness`, the \
     breaker's queue) counts its wait in `request`.",
    &["phase"],
    ADDED_BUCKETS.to_vec()
));

/// The `request` and `chunk` series of [`ADDED`], found once: a chunk's observation is on
/// the hot path, and finding a series by its label hashes it each time.
static ADDED_REQUEST: std::sync::LazyLock<Option<prometheus::Histogram>> =
    std::sync::LazyLock::new(|| sluice_sdk::metrics::series(&ADDED, &["request"]));
static ADDED_CHUNK: std::sync::LazyLock<Option<prometheus::Histogram>> =
    std::sync::LazyLock::new(|| sluice_sdk::metrics::series(&ADDED, &["chunk"]));

/// Records Sluice's own time for a request, from `since` (see [`ADDED`]).
pub fn added_request(since: std::time::Instant) {
    if let Some(h) = ADDED_REQUEST.as_ref() {
        h.observe(since.elapsed().as_secs_f64());
    }
}

/// Records Sluice's own time for one chunk of an answer, from `since` (see [`ADDED`]).
pub fn added_chunk(since: std::time::Instant) {
    if let Some(h) = ADDED_CHUNK.as_ref() {
        h.observe(since.elapsed().as_secs_f64());
    }
}

metric!(REQUESTS: IntCounterVec = register_int_counter_vec!(
    "sluice_requests_total",
    "Requests on the proxy listener by route and status class.",
    &["route", "status"]
));

metric!(REJECTIONS: IntCounterVec = register_int_counter_vec!(
    "router_rejections_total",
    format!(
        "Requests answered with an error made by Sluice, by reason ({}) and by the request's \
         priority class (`-` when none was decided).",
        Reason::ALL.map(Reason::as_str).join(", ")
    ),
    &["reason", "priority"]
));

metric!(RELOADS: IntCounterVec = register_int_counter_vec!(
    "sluice_config_reloads_total",
    "Config reloads asked for with SIGHUP, by result: ok (a new generation serves new \
     requests) or refused (the file did not pass the checks; the running config stays).",
    &["result"]
));

metric!(OPEN_CONNECTIONS: IntGauge = register_int_gauge!(
    "sluice_connections_open",
    "Client connections open on the proxy listeners."
));

metric!(POOL_RETRIES: IntCounterVec = register_int_counter_vec!(
    "sluice_pool_retries_total",
    "Retries inside a pool after an upstream's 5xx or 429, within the pool's retry budget.",
    &["pool"]
));

metric!(LOG_LINES_DROPPED: IntCounterVec = register_int_counter_vec!(
    "sluice_log_lines_dropped_total",
    "Pingora's log lines not written because their target wrote more than 10 a second (a \
     client failing handshakes by the thousand), by target.",
    &["target"]
));

metric!(UNANSWERED_RETRIES: IntCounterVec = register_int_counter_vec!(
    "sluice_upstream_unanswered_retries_total",
    "Requests sent again on another backend because their connection failed before any byte \
     of answer (a backend that died, or dropped the request unanswered), by pool.",
    &["pool"]
));

/// Counts one request sent again on a new connection (see [`STALE_CONNECTIONS`]).
pub fn stale_connection() {
    if let Some(counter) = STALE_CONNECTIONS.as_ref() {
        counter.inc();
    }
}

metric!(STALE_CONNECTIONS: IntCounter = register_int_counter!(
    "sluice_upstream_stale_connections_total",
    "Requests sent again on a new connection to the same backend because the pooled \
     connection they went out on was closed before any byte of answer (the backend's \
     keep-alive timeout crossing the request)."
));

metric!(EJECTIONS: IntCounterVec = register_int_counter_vec!(
    "sluice_backend_ejections_total",
    "Backends ejected by passive outlier detection (connect failures, 5xx), by pool.",
    &["pool"]
));

metric!(BACKEND_KV_USAGE: GaugeVec = register_gauge_vec!(
    "sluice_backend_kv_cache_usage_ratio",
    "KV-cache usage of each backend (0..1), as last scraped from its vLLM /metrics.",
    &["pool", "backend"]
));

metric!(BACKEND_RUNNING: GaugeVec = register_gauge_vec!(
    "sluice_backend_requests_running",
    "Requests running on each backend, as last scraped.",
    &["pool", "backend"]
));

metric!(BACKEND_WAITING: GaugeVec = register_gauge_vec!(
    "sluice_backend_requests_waiting",
    "Requests waiting in each backend's queue, as last scraped.",
    &["pool", "backend"]
));

metric!(BACKEND_STATE: IntGaugeVec = register_int_gauge_vec!(
    "sluice_backend_state",
    "1 for the state each backend is in (healthy, unhealthy, ejected, stale, probation, \
     unchecked), 0 for the others.",
    &["pool", "backend", "state"]
));

metric!(BACKEND_HEALTHY: IntGaugeVec = register_int_gauge_vec!(
    "sluice_backend_healthy",
    "1 when a backend may take new requests (healthy, stale, on probation or unchecked).",
    &["pool", "backend"]
));

metric!(BACKEND_IN_FLIGHT: IntGaugeVec = register_int_gauge_vec!(
    "sluice_backend_in_flight_requests",
    "Requests this proxy has in flight on each backend.",
    &["pool", "backend"]
));

metric!(BACKEND_PREFILL_TOKENS: IntGaugeVec = register_int_gauge_vec!(
    "sluice_backend_outstanding_prefill_tokens",
    "Prompt tokens of the requests this proxy sent to each backend that have not produced \
     their first byte yet.",
    &["pool", "backend"]
));

metric!(BACKEND_PREFILL_SPEED: GaugeVec = register_gauge_vec!(
    "sluice_backend_prefill_tokens_per_second",
    "Each backend's prefill speed as learned from its times to first token (seeded from the \
     pool's balancing.prefill_tokens_per_second).",
    &["pool", "backend"]
));

metric!(BACKEND_PREDICTED_TTFT: GaugeVec = register_gauge_vec!(
    "sluice_backend_predicted_ttft_seconds",
    "The time to first token a 1,000-token prompt would be predicted on each backend now.",
    &["pool", "backend"]
));

metric!(POOL_WAITING: GaugeVec = register_gauge_vec!(
    "sluice_pool_waiting_requests",
    "Requests waiting for a pool with no usable backend to get one (pools[].no_backend_wait): \
     what an autoscaler reads to scale a pool from zero.",
    &["pool"]
));

metric!(POOL_OLDEST_WAIT: GaugeVec = register_gauge_vec!(
    "sluice_pool_oldest_waiting_seconds",
    "How long the oldest request waiting for a usable backend of each pool has waited (0: none \
     waits).",
    &["pool"]
));

/// Sets the pools' waiting-room gauges: read when the metrics are, so the oldest wait is
/// its age now.
pub fn waiting_rooms(pools: &sluice_sdk::pool::Pools) {
    for pool in pools.iter() {
        let (waiting, oldest) = pool.waiting_room().waiting();
        set(&POOL_WAITING, &[&pool.name], waiting as f64);
        set(&POOL_OLDEST_WAIT, &[&pool.name], oldest.as_secs_f64());
    }
}

/// Each disaggregated route's state, at scrape time: a fall-back whose time is over reads 1
/// before the next long prompt comes.
pub fn disaggregated_routes(pools: &sluice_sdk::pool::Pools) {
    for pool in pools.iter() {
        if let Some(check) = pool.transfer_check() {
            let disaggregated = check.state() == sluice_sdk::RouteState::Disaggregated;
            set(
                &PD_ROUTE_DISAGGREGATED,
                &[&pool.name],
                i64::from(disaggregated),
            );
        }
    }
}

metric!(QUEUE_DEPTH: IntGaugeVec = register_int_gauge_vec!(
    "sluice_admission_queue_depth",
    "Requests waiting in each pool's queue, by class: for KV-cache headroom (the breaker's \
     admission) or for an engine that would not queue them (pools[].fairness).",
    &["pool", "priority"]
));

metric!(HOLD_SECONDS: HistogramVec = register_histogram_vec!(
    "sluice_flow_hold_seconds",
    "How long requests were held in their pool's fair order while every engine would queue \
     them, by how the hold ended: sent (an engine had room), max_hold (sent at the bound or \
     its total timeout), deadline (a sheddable request past its TTFT objective, refused), \
     no_backend (no backend usable any more), client_gone.",
    &["pool", "result"],
    vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]
));

/// How a request to a disaggregated route was served: [`PD_REQUESTS`]' `path` label.
pub const PD_PATHS: [&str; 5] = [
    "disaggregated",
    "short",
    "fallen_back",
    "no_prefill_backend",
    "prefill_failed",
];

metric!(PD_REQUESTS: IntCounterVec = register_int_counter_vec!(
    "sluice_pd_requests_total",
    "Requests to a pool that decodes for a prefill pool (pools[].prefill), by how they were \
     served: disaggregated (a prefill leg, then the decode leg with its transfer), or whole \
     on the decode backend because the prompt left it too little to compute (short), the \
     route had fallen back (fallen_back), the prefill pool had no backend (no_prefill_backend) \
     or the prefill leg failed, was refused or answered no transfer parameters \
     (prefill_failed).",
    &["pool", "path"]
));

metric!(PD_TRANSFERS: IntCounterVec = register_int_counter_vec!(
    "sluice_pd_transfers_total",
    "Decode legs of disaggregated requests, by what their usage said of the transfer: \
     transferred (the decode engine computed less than half of what the transfer was to \
     bring), recomputed (half or more: the transfer did nothing), unverified (the answer did \
     not say).",
    &["pool", "outcome"]
));

metric!(PD_ROUTE_DISAGGREGATED: IntGaugeVec = register_int_gauge_vec!(
    "sluice_pd_route_disaggregated",
    "1 while a pool's disaggregated route is in use, 0 while it has fallen back to the \
     decode pool alone after recomputed transfers.",
    &["pool"]
));

metric!(FAIRNESS_INDEX: GaugeVec = register_gauge_vec!(
    "sluice_pool_fairness_index",
    "Jain's fairness index of the service (prefill and weighted output tokens, decayed) of \
     each pool's flows: 1 when every flow had as much, 1/n when one had all; absent before \
     any service, or with fairness off.",
    &["pool"]
));

metric!(FLOWS: IntGaugeVec = register_int_gauge_vec!(
    "sluice_pool_flows",
    "Flows (sessions, else tenants or clients) with service in the recent past in each pool \
     (their shares are in /status).",
    &["pool"]
));

/// How a hold in a pool's fair order ended.
#[derive(Debug, Clone, Copy)]
pub enum HoldEnd {
    Sent,
    MaxHold,
    Deadline,
    NoBackend,
    ClientGone,
}

impl HoldEnd {
    const ALL: [HoldEnd; 5] = [
        HoldEnd::Sent,
        HoldEnd::MaxHold,
        HoldEnd::Deadline,
        HoldEnd::NoBackend,
        HoldEnd::ClientGone,
    ];

    fn as_str(self) -> &'static str {
        match self {
            HoldEnd::Sent => "sent",
            HoldEnd::MaxHold => "max_hold",
            HoldEnd::Deadline => "deadline",
            HoldEnd::NoBackend => "no_backend",
            HoldEnd::ClientGone => "client_gone",
        }
    }
}

pub fn held(pool: &str, end: HoldEnd, seconds: f64) {
    observe(&HOLD_SECONDS, &[pool, end.as_str()], seconds);
}

/// Sets each pool's queue and fairness gauges: read when the metrics are.
pub fn flow_control(pools: &sluice_sdk::pool::Pools) {
    for pool in pools.iter() {
        let control = pool.flow_control();
        for p in sluice_sdk::Priority::ALL {
            set(
                &QUEUE_DEPTH,
                &[&pool.name, p.as_str()],
                control.depth(p) as i64,
            );
        }
        if control.fairness().is_none() {
            continue;
        }
        let flows = control.flows();
        set(&FLOWS, &[&pool.name], flows.len() as i64);
        if let Some(index) = sluice_sdk::pool::jain_index(flows.iter().map(|(_, s)| *s)) {
            set(&FAIRNESS_INDEX, &[&pool.name], index);
        }
        for end in HoldEnd::ALL {
            touch(&HOLD_SECONDS, &[&pool.name, end.as_str()]);
        }
    }
}

metric!(TTFT_PREDICTION_ERROR: HistogramVec = register_histogram_vec!(
    "sluice_pool_ttft_prediction_error_seconds",
    "How far each streamed request's time to first token was from the one predicted when \
     its backend was chosen, by pool and direction (late: it took longer; early: less).",
    &["pool", "direction"],
    TTFB_BUCKETS.to_vec()
));

metric!(SHARED_SESSIONS: IntCounterVec = register_int_counter_vec!(
    "sluice_shared_sessions_total",
    "Sessions shared through Redis (`sessions.store: redis`), by pool and event: adopted (a \
     session this process had no binding for, bound where Redis said), missed (Redis had none, \
     or named a backend the pool does not have), published (a new binding written), error.",
    &["pool", "event"]
));

metric!(TTFT_PREDICTION_RATIO: HistogramVec = register_histogram_vec!(
    "sluice_pool_ttft_measured_over_predicted",
    "Each streamed request's time to first token over the one predicted when its backend was \
     chosen, by pool: 1 is a perfect prediction; the share within 0.8-1.25 says how often the \
     model is within 25 %.",
    &["pool"],
    vec![0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0]
));

metric!(DISCOVERY_ENDPOINTS: IntGaugeVec = register_int_gauge_vec!(
    "sluice_discovery_endpoints",
    "Each pool's backends by state: ready, draining (no new requests; leaving once idle), \
     unknown (joined, not yet scraped: a growing share) and ejected.",
    &["pool", "state"]
));

metric!(DISCOVERY_UPDATES: IntCounterVec = register_int_counter_vec!(
    "sluice_discovery_updates_total",
    "Changes of each pool's backends made by its discovery source.",
    &["pool"]
));

metric!(DISCOVERY_ERRORS: IntCounterVec = register_int_counter_vec!(
    "sluice_discovery_errors_total",
    "Discovery failures by pool and source (dns, static_dns, kubernetes): the pool kept the \
     backends it knew.",
    &["pool", "source"]
));

metric!(DISCOVERY_LAST_CHANGE: GaugeVec = register_gauge_vec!(
    "sluice_discovery_last_change_timestamp_seconds",
    "When each pool's backends last changed (Unix time).",
    &["pool"]
));

metric!(HEALTH_CHECKS: IntCounterVec = register_int_counter_vec!(
    "sluice_health_checks_total",
    "Health probes and metrics scrapes by pool, kind (health, metrics) and result (ok, \
     error, timeout, bad_status, unparsable, parse_timeout).",
    &["pool", "kind", "result"]
));

metric!(PREFIX_INDEX_BLOCKS: IntGaugeVec = register_int_gauge_vec!(
    "sluice_prefix_index_blocks",
    "Prompt blocks the exact prefix index holds for each backend, from its KV cache events.",
    &["pool", "backend"]
));

metric!(KV_EVENT_BATCHES: IntCounterVec = register_int_counter_vec!(
    "sluice_kv_event_batches_total",
    "KV cache event batches received from each backend.",
    &["pool", "backend"]
));

metric!(KV_EVENT_LAG: GaugeVec = register_gauge_vec!(
    "sluice_kv_event_lag_seconds",
    "How old each backend's last KV event batch was when it arrived (its timestamp to now).",
    &["pool", "backend"]
));

metric!(KV_EVENT_GAPS: IntCounterVec = register_int_counter_vec!(
    "sluice_kv_event_gaps_total",
    "Batches missed from a backend's KV events, by what was done: replayed (from its replay \
     socket), cleared (no replay: its blocks forgotten), restarted (its sequence began again: \
     the engine restarted), joined (Sluice subscribed after the engine began publishing).",
    &["pool", "backend", "outcome"]
));

metric!(KV_EVENT_ERRORS: IntCounterVec = register_int_counter_vec!(
    "sluice_kv_event_errors_total",
    "Connections to a backend's KV event publisher that failed or were dropped, by reason: \
     connect (unreachable, or no ZMTP handshake within 5 s), too_large (a message over 4 MiB \
     or 4 frames), protocol (broken ZMTP), closed (the publisher went away), silent (nothing \
     for 15 s while the engine's /metrics showed it computing prompt tokens).",
    &["pool", "backend", "reason"]
));

metric!(PREFIX_TOKENS: IntCounterVec = register_int_counter_vec!(
    "sluice_prefix_tokens_total",
    "Prompt tokens of requests routed with the exact prefix index: looked_up (all of them); \
     of the answers whose engine reported its cached tokens \
     (`usage.prompt_tokens_details.cached_tokens`), reported (those) and predicted (those the \
     index said the chosen backend held).",
    &["pool", "kind"]
));

metric!(METRIC_LINES_SKIPPED: IntCounterVec = register_int_counter_vec!(
    "sluice_health_metric_lines_skipped_total",
    "Invalid lines skipped on backends' /metrics pages that were otherwise read (a page that \
     is mostly invalid is not read at all: sluice_health_checks_total result unparsable).",
    &["pool", "backend"]
));

metric!(UPSTREAM_ATTEMPTS: IntCounterVec = register_int_counter_vec!(
    "sluice_upstream_attempts_total",
    format!(
        "Upstream attempts by pool and outcome ({}).",
        AttemptOutcome::COUNTED.map(AttemptOutcome::as_str).join(", ")
    ),
    &["pool", "outcome"]
));

/// Counts a `SIGHUP` reload, done or refused.
pub fn reload(done: bool) {
    inc(&RELOADS, &[if done { "ok" } else { "refused" }]);
}

/// Counts one upstream attempt of `pool`; one the client left is not counted.
pub fn attempt(pool: &str, outcome: AttemptOutcome) {
    if outcome != AttemptOutcome::ClientGone {
        inc(&UPSTREAM_ATTEMPTS, &[pool, outcome.as_str()]);
    }
}

/// Counts how far a streamed request's TTFT (`observed`) was from the one `predicted`, both
/// in seconds.
pub fn ttft_prediction(pool: &str, predicted: f64, observed: f64) {
    let direction = if observed >= predicted {
        "late"
    } else {
        "early"
    };
    observe(
        &TTFT_PREDICTION_ERROR,
        &[pool, direction],
        (observed - predicted).abs(),
    );
    if predicted > 0.0 && observed.is_finite() {
        observe(&TTFT_PREDICTION_RATIO, &[pool], observed / predicted);
    }
}

/// Counts one event of a shared session of `pool` (see [`SHARED_SESSIONS`]).
pub fn shared_session(pool: &str, event: &str) {
    inc(&SHARED_SESSIONS, &[pool, event]);
}

/// Registers every series and creates the per-pool ones at zero, so dashboards and alerts
/// find them from start-up rather than after the first request of each kind.
pub fn init(pools: &Pools) {
    let _ = (
        &*LLM_REQUEST_DURATION,
        &*REQUESTS,
        &*ADDED_REQUEST,
        &*ADDED_CHUNK,
        &*STALE_CONNECTIONS,
    );
    for result in ["ok", "refused"] {
        touch(&RELOADS, &[result]);
    }
    for reason in Reason::ALL {
        touch(&REJECTIONS, &[reason.as_str(), "-"]);
    }
    for pool in pools.iter() {
        touch(&ROUTER_REQUEST_DURATION, &[&pool.name]);
        touch(&STREAM_FIRST_BYTE, &[&pool.name]);
        touch(&EJECTIONS, &[&pool.name]);
        touch(&UNANSWERED_RETRIES, &[&pool.name]);
        for direction in ["late", "early"] {
            touch(&TTFT_PREDICTION_ERROR, &[&pool.name, direction]);
        }
        if pool.settings.health.enabled {
            for endpoint in pool.members().iter() {
                touch(&METRIC_LINES_SKIPPED, &[&pool.name, &endpoint.spec.address]);
            }
        }
        for outcome in AttemptOutcome::COUNTED {
            touch(&UPSTREAM_ATTEMPTS, &[&pool.name, outcome.as_str()]);
        }
        for kind in ["prompt", "completion"] {
            touch(&TOKENS, &[&pool.name, kind]);
        }
        if pool.transfer_check().is_some() {
            for path in PD_PATHS {
                touch(&PD_REQUESTS, &[&pool.name, path]);
            }
            for outcome in sluice_sdk::TransferOutcome::ALL {
                touch(&PD_TRANSFERS, &[&pool.name, outcome.as_str()]);
            }
            set(&PD_ROUTE_DISAGGREGATED, &[&pool.name], 1);
        }
        touch(&COST, &[&pool.name]);
        if pool.prefix().is_some() {
            for kind in ["looked_up", "predicted", "reported"] {
                touch(&PREFIX_TOKENS, &[&pool.name, kind]);
            }
        }
    }
}

metric!(TOKENS: IntCounterVec = register_int_counter_vec!(
    "sluice_tokens_total",
    "Tokens by pool and kind (prompt, completion), from the usage of the answers the pool's \
     engines gave (cache hits are not counted).",
    &["pool", "kind"]
));

metric!(COST: CounterVec = register_counter_vec!(
    "sluice_cost_dollars_total",
    "Estimated cost of the tokens each pool's engines produced, at its configured price.",
    &["pool"]
));

/// Counts what one answer of `pool`'s engines used, and its cost at the pool's price. Every
/// LLM request's, once, here: the dashboard, the tenants' spend and the selector's saving
/// read the same tokens.
pub fn answered_usage(pool: &sluice_sdk::Pool, usage: sluice_sdk::Usage) {
    let name = &*pool.name;
    inc_by(&TOKENS, &[name, "prompt"], usage.prompt_tokens);
    inc_by(&TOKENS, &[name, "completion"], usage.completion_tokens);
    // Counts come from the upstream: never trusted not to overflow.
    let millions = usage.prompt_tokens.saturating_add(usage.completion_tokens) as f64 / 1e6;
    inc_by(
        &COST,
        &[name],
        millions * pool.settings.price_per_million_tokens,
    );
}

/// The status class label: `2xx`, `4xx`, ...; 499 (client gone) is kept as is.
pub fn status_class(status: u16) -> &'static str {
    match status {
        499 => "499",
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// Everything in the default registry, in the Prometheus text format.
pub fn render() -> Vec<u8> {
    let mut out = Vec::with_capacity(16 * 1024);
    if let Err(e) = TextEncoder::new().encode(&prometheus::gather(), &mut out) {
        tracing::error!("cannot encode metrics: {e}");
    }
    out
}
