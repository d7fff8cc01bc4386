//! The admin listener: `/` (a self-contained HTML dashboard of `/status` and `/metrics`),
//! `/metrics`, `/healthz`, `/readyz`, `/status`. On its own address (default 127.0.0.1:9090),
//! so it can be firewalled apart from the proxy.

use crate::proxy::Sluice;
use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use serde_json::json;
use sluice_sdk::prefix::PrefixRouting;
use sluice_sdk::{Member, Pool, Priority, TransferCheck};
use std::sync::Arc;
use std::time::Instant;

/// The dashboard: one page with its CSS and script inline, so it works air-gapped.
const DASHBOARD: &str = include_str!("dashboard.html");

/// The page may run its own inline script and style and fetch from its own origin, nothing
/// else: data from config (tenant and model names) cannot bring in markup or call out.
const DASHBOARD_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
    style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

pub struct Admin {
    /// The current generation: its pools, and its plugin chain in order (their names, and
    /// what each shows of itself).
    pub current: Arc<ArcSwap<Sluice>>,
    pub started: Instant,
    /// Host names answered besides IP addresses and `localhost` (`admin.hosts`).
    pub hosts: Vec<String>,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        // A page in an operator's browser could read the admin through DNS rebinding (its own
        // name, resolved to 127.0.0.1): only an address, `localhost` or a configured name is
        // answered, as a Host. (No Host at all: an HTTP/1.0 client, on a local socket.)
        if !self.serves_host(session.req_header()) {
            return respond(
                StatusCode::MISDIRECTED_REQUEST,
                "text/plain",
                b"this host is not served here (admin.hosts)\n".to_vec(),
            );
        }
        if session.req_header().method != http::Method::GET {
            return respond(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                b"GET only\n".to_vec(),
            );
        }
        match session.req_header().uri.path() {
            "/" | "/index.html" => dashboard(),
            "/metrics" => {
                crate::metrics::waiting_rooms(&self.current.load().pools);
                crate::metrics::flow_control(&self.current.load().pools);
                crate::metrics::disaggregated_routes(&self.current.load().pools);
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    crate::metrics::render(),
                )
            }
            "/healthz" => respond(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/readyz" => {
                if self.ready() {
                    respond(StatusCode::OK, "text/plain", b"ready\n".to_vec())
                } else {
                    respond(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        b"no backend\n".to_vec(),
                    )
                }
            }
            "/status" => respond(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec_pretty(&self.status()).unwrap_or_default(),
            ),
            _ => respond(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
        }
    }
}

impl Admin {
    /// Whether the request names a host the admin answers to.
    fn serves_host(&self, req: &pingora_http::RequestHeader) -> bool {
        let host = req
            .uri
            .host()
            .or_else(|| req.headers.get(http::header::HOST)?.to_str().ok());
        let Some(host) = host else {
            return true;
        };
        // Without its port; an IPv6 literal keeps its brackets off.
        let name = match host.strip_prefix('[') {
            Some(rest) => rest.split(']').next().unwrap_or(rest),
            None => host.rsplit_once(':').map_or(host, |(name, _)| name),
        };
        name.parse::<std::net::IpAddr>().is_ok()
            || name.eq_ignore_ascii_case("localhost")
            || self.hosts.iter().any(|h| h.eq_ignore_ascii_case(name))
    }

    /// Ready when some pool has a backend that may take a request now.
    fn ready(&self) -> bool {
        self.current
            .load()
            .pools
            .iter()
            .any(|p| p.has_usable_backend())
    }

    fn status(&self) -> serde_json::Value {
        let current = self.current.load();
        let pools: Vec<_> = current.pools.iter().map(|p| pool_status(p)).collect();
        let plugins = current.chain.plugins();
        let names: Vec<&str> = plugins.iter().map(|p| p.name()).collect();
        let plugin_status: serde_json::Map<String, serde_json::Value> = plugins
            .iter()
            .filter_map(|p| Some((p.name().to_string(), p.status()?)))
            .collect();
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_seconds": self.started.elapsed().as_secs(),
            "plugins": names,
            "plugin_status": plugin_status,
            "pools": pools,
        })
    }
}

/// A LoRA-serving backend's adapters (its `/v1/models`) and those in use (its metrics);
/// `null` for a backend that serves none.
fn lora_status(
    live: &sluice_sdk::BackendLive,
    load: Option<&sluice_sdk::Load>,
) -> serde_json::Value {
    let slots = load.and_then(|l| l.lora.as_ref());
    let adapters = live.adapters();
    if slots.is_none() && adapters.as_ref().is_none_or(|a| a.is_empty()) {
        return serde_json::Value::Null;
    }
    json!({
        "adapters": adapters.as_deref(),
        "active": slots.map(|s| &s.active),
        "max_loras": slots.map(|s| s.max_loras),
    })
}

fn pool_status(pool: &Pool) -> serde_json::Value {
    let pressure = pool.pressure();
    let shedding: Vec<&str> = Priority::ALL
        .into_iter()
        .filter(|p| pool.sheds(*p))
        .map(Priority::as_str)
        .collect();
    let members = pool.members();
    let backends: Vec<_> = members
        .iter()
        .map(|endpoint| backend_status(pool, endpoint))
        .collect();
    let prefix = pool.prefix().map(|routing| prefix_status(&routing));
    json!({
        "name": &*pool.name,
        "fairness": pool.flow_control().fairness().is_some(),
        "fairness_index": pool.fairness_index(),
        "flows": flow_shares(pool),
        "queued": pool.flow_control().held(),
        "prefill": pool.transfer_check().map(prefill_status),
        "models": *pool.models(),
        "models_auto": pool.settings.auto_models,
        "max_model_len": pool.settings.max_model_len,
        "prompt_scale": pool.prompt_scale(),
        "health_checks": pool.settings.health.enabled,
        "kv_cache_usage": pressure.kv_usage,
        "usable_backends": pressure.usable,
        "source": pool.settings.source,
        "balancing": pool.settings.balancing.name(),
        "sessions": pool.settings.sessions.as_ref().map(|_| pool.sessions_remembered()),
        "prefix_index": prefix,
        "breaker": {
            "state": if shedding.is_empty() { "closed" } else { "shedding" },
            "shedding": shedding,
        },
        "backends": backends,
    })
}

/// One backend's line in `/status`: its membership, health, load and what was learned of it.
fn backend_status(pool: &Pool, endpoint: &Member) -> serde_json::Value {
    let (spec, live) = (&endpoint.spec, &endpoint.live);
    let load = live.load();
    let own = live.accounting();
    json!({
        "address": spec.address,
        "resolved": spec.resolved.to_string(),
        "weight": spec.weight,
        "membership": endpoint.discovery_state(),
        "health": live.state(&pool.settings.health).as_str(),
        "kv_cache_usage": load.as_ref().and_then(|l| l.kv_usage),
        "projected_kv_cache_usage": live.projected_kv(&pool.settings.health),
        "running": load.as_ref().map(|l| l.running),
        "waiting": load.as_ref().map(|l| l.waiting),
        "kv_capacity_tokens": load.as_ref().and_then(|l| l.kv_capacity_tokens),
        "spec_decode_acceptance": load.as_ref().and_then(|l| l.spec_acceptance),
        "scraped_seconds_ago": load.as_ref().map(|l| l.scraped_at.elapsed().as_secs_f64()),
        "in_flight": live.in_flight(),
        "prefilling": own.prefilling,
        "outstanding_prefill_tokens": own.prefill_tokens,
        "decoding": own.decoding,
        "decode_tokens": own.decode_tokens,
        "prefill_tokens_per_second": live.prefill_speed(),
        "prefill_speed_samples": live.speed_samples(),
        "engine_prefill_samples": live.engine_speed_samples(),
        "base_ttft_seconds": live.base_ttft(),
        "predicted_ttft_seconds": pool.reference_ttft(live),
        "predicted_queue_seconds": pool.predicted_queue(live),
        "engine_queue_seconds": load.as_ref().and_then(|l| l.engine).map(|e| e.queue_seconds),
        "engine_prefill_tokens_per_second": load
            .as_ref()
            .and_then(|l| l.engine)
            .and_then(|e| e.prefill_speed()),
        "wait_scale": live.wait_scale(),
        "wait_scale_samples": live.wait_samples(),
        "prefix_index": pool.prefix().map(|routing| json!({
            "blocks": routing.index.blocks_of(spec.resolved),
            "event_lag_seconds": routing.index.lag_of(spec.resolved),
        })),
        "lora": lora_status(live, load.as_deref()),
    })
}

/// The exact prefix index's counters, when the pool has one.
fn prefix_status(routing: &PrefixRouting) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    json!({
        "kv_events": match routing.kv_events {
            sluice_sdk::prefix::KvEventSource::Auto => json!("auto"),
            sluice_sdk::prefix::KvEventSource::Port(port) => json!({"port": port}),
        },
        "block_size": routing.index.block_size(),
        "looked_up_tokens": routing.looked_up_tokens.load(Relaxed),
        "predicted_cached_tokens": routing.predicted_tokens.load(Relaxed),
        "reported_cached_tokens": routing.reported_tokens.load(Relaxed),
        "unreadable_prompts": routing.unreadable.load(Relaxed),
        "too_long_prompts": routing.too_long.load(Relaxed),
        "passed_over_prompts": routing.passed_over.load(Relaxed),
        "orphan_blocks": routing.index.orphans.load(Relaxed),
        "overflowed_blocks": routing.index.overflowed.load(Relaxed),
        "refused_events": routing.index.refused.load(Relaxed),
    })
}

/// A decode pool's prefill route and what its transfers came to.
fn prefill_status(check: &TransferCheck) -> serde_json::Value {
    let route = check.route();
    let (transferred, recomputed, unverified) = check.counts();
    json!({
        "pool": route.pool,
        "connector": route.connector.as_str(),
        "bootstrap_port": match route.connector {
            sluice_sdk::Connector::Mooncake { bootstrap_port } => Some(bootstrap_port),
            sluice_sdk::Connector::Nixl => None,
        },
        "min_prefill_tokens": route.min_prefill_tokens,
        "state": check.state().as_str(),
        "recent_recomputed": check.recent_recomputed(),
        "transfers": {
            "transferred": transferred,
            "recomputed": recomputed,
            "unverified": unverified,
        },
    })
}

/// The most flows `/status` lists per pool.
const MAX_FLOWS_SHOWN: usize = 20;

/// The pool's most served flows and their share of its recent service (decayed tokens).
fn flow_shares(pool: &Pool) -> serde_json::Value {
    let flows = pool.flow_control().flows();
    let total: f64 = flows.iter().map(|(_, s)| s).sum();
    flows
        .iter()
        .take(MAX_FLOWS_SHOWN)
        .map(|(label, served)| {
            json!({"flow": &**label, "tokens": served.round(), "share": served / total.max(1.0)})
        })
        .collect()
}

fn dashboard() -> Response<Vec<u8>> {
    let mut response = respond(
        StatusCode::OK,
        "text/html; charset=utf-8",
        DASHBOARD.as_bytes().to_vec(),
    );
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_SECURITY_POLICY,
        http::HeaderValue::from_static(DASHBOARD_CSP),
    );
    headers.insert(
        http::header::X_CONTENT_TYPE_OPTIONS,
        http::HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    );
    headers.insert(
        http::header::REFERRER_POLICY,
        http::HeaderValue::from_static("no-referrer"),
    );
    response
}

fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    response
}
