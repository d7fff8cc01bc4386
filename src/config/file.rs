//! The config file as written: serde types that mirror the YAML, with defaults, and that refuse
//! unknown keys. Nothing here is validated beyond types; `super::validate` does the rest.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub pingora: PingoraFile,
    #[serde(default = "default_listeners")]
    pub listeners: Vec<ListenerFile>,
    #[serde(default)]
    pub admin: AdminFile,
    #[serde(default)]
    pub limits: LimitsFile,
    /// Addresses or CIDRs of proxies in front whose `X-Forwarded-For` is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    #[serde(default)]
    pub log: LogFile,
    pub pools: Vec<PoolFile>,
    #[serde(default)]
    pub routes: Vec<RouteFile>,
    /// Where stored responses (Responses API) were made: kept how, for how long.
    #[serde(default)]
    pub responses: ResponsesFile,
    /// Where the pools' sessions are kept: in this process, or in Redis for a fleet.
    #[serde(default)]
    pub sessions: SessionsFile,
    /// Traces over OTLP; absent: no tracing at all.
    #[serde(default)]
    pub telemetry: Option<TelemetryFile>,
    /// Each plugin's section, read by the plugin's own config type (`crate::chain`).
    #[serde(default)]
    pub plugins: crate::chain::Sections,
}

/// Pingora's own `ServerConf` keys that Sluice supports (the rest keep Pingora's defaults).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PingoraFile {
    pub threads: usize,
    pub work_stealing: bool,
    pub pid_file: String,
    pub upgrade_sock: String,
    pub error_log: Option<String>,
    pub user: Option<String>,
    pub group: Option<String>,
    pub daemon: bool,
    pub grace_period_seconds: Option<u64>,
    pub graceful_shutdown_timeout_seconds: Option<u64>,
    pub upstream_keepalive_pool_size: usize,
    pub listener_tasks_per_fd: usize,
    pub ca_file: Option<String>,
}

impl Default for PingoraFile {
    fn default() -> Self {
        let d = pingora_core::server::configuration::ServerConf::default();
        Self {
            threads: d.threads,
            work_stealing: d.work_stealing,
            pid_file: "/tmp/sluice/sluice.pid".into(),
            upgrade_sock: "/tmp/sluice/upgrade.sock".into(),
            error_log: None,
            user: None,
            group: None,
            daemon: false,
            // In-flight requests get this long after SIGTERM or an upgrade: LLM streams are long.
            grace_period_seconds: Some(30),
            graceful_shutdown_timeout_seconds: Some(5),
            upstream_keepalive_pool_size: d.upstream_keepalive_pool_size,
            listener_tasks_per_fd: d.listener_tasks_per_fd,
            ca_file: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerFile {
    pub address: String,
    pub tls: Option<TlsFile>,
    /// TLS listeners: offer `h2` by ALPN (default on).
    pub http2: Option<bool>,
    /// Plain listeners: take HTTP/2 with prior knowledge beside HTTP/1.1 (default off).
    #[serde(default)]
    pub h2c: bool,
}

fn default_listeners() -> Vec<ListenerFile> {
    vec![ListenerFile {
        address: "0.0.0.0:8080".into(),
        tls: None,
        http2: None,
        h2c: false,
    }]
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFile {
    pub cert: String,
    pub key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminFile {
    pub enabled: bool,
    pub address: String,
    /// Host names the admin answers to, besides IP addresses and `localhost`.
    pub hosts: Vec<String>,
}

impl Default for AdminFile {
    fn default() -> Self {
        Self {
            enabled: true,
            address: "127.0.0.1:9090".into(),
            hosts: Vec::new(),
        }
    }
}

/// `telemetry`: OpenTelemetry traces of requests and attempts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryFile {
    pub otlp: OtlpFile,
    /// The share of new traces kept (a client's sampled trace is kept whatever it is).
    #[serde(default = "default_sampling")]
    pub sampling: f64,
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// `continue` (a client's `traceparent` continues its trace) or `ignore` (every request
    /// starts a trace of its own: an edge proxy facing the internet).
    #[serde(default)]
    pub client_traces: ClientTraces,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpFile {
    pub endpoint: String,
    #[serde(default)]
    pub protocol: OtlpProtocol,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum OtlpProtocol {
    #[default]
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
    #[serde(rename = "grpc")]
    Grpc,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientTraces {
    #[default]
    Continue,
    Ignore,
}

impl TelemetryFile {
    /// Whether clients' traces are continued.
    pub fn otlp_client_traces_continue(&self) -> bool {
        self.client_traces == ClientTraces::Continue
    }
}

fn default_sampling() -> f64 {
    1.0
}

fn default_service_name() -> String {
    "sluice".into()
}

/// `responses`: the notes of which backend made each stored response (Responses API), in this
/// process's memory or in Redis, which every proxy of a fleet then shares.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesFile {
    /// How long a note is kept.
    #[serde(deserialize_with = "duration")]
    pub ttl: Duration,
    /// `memory` or `redis`.
    pub store: ResponsesStore,
    pub redis: Option<ResponsesRedisFile>,
}

impl Default for ResponsesFile {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(6 * 3600),
            store: ResponsesStore::Memory,
            redis: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponsesStore {
    Memory,
    Redis,
}

/// `responses.redis`: as the cache's Redis section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRedisFile {
    #[serde(default, deserialize_with = "sluice_sdk::redis::url")]
    pub url: Option<String>,
    #[serde(default, deserialize_with = "sluice_sdk::redis::urls")]
    pub cluster_nodes: Vec<String>,
    /// The longest a follow-up waits on Redis to find where its response is.
    #[serde(default = "default_responses_timeout", deserialize_with = "duration")]
    pub timeout: Duration,
    #[serde(
        default = "sluice_sdk::redis::default_connect_timeout",
        deserialize_with = "duration"
    )]
    pub connect_timeout: Duration,
    #[serde(default = "sluice_sdk::redis::default_failure_threshold")]
    pub failure_threshold: u32,
    #[serde(
        default = "sluice_sdk::redis::default_cooldown",
        deserialize_with = "duration"
    )]
    pub cooldown: Duration,
}

fn default_responses_timeout() -> Duration {
    Duration::from_millis(50)
}

/// `sessions`: where the pools' session bindings are kept: each process's own table, or
/// shared in Redis by a fleet of proxies (`redis` as `responses.redis`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionsFile {
    /// `memory` or `redis`.
    pub store: ResponsesStore,
    pub redis: Option<ResponsesRedisFile>,
}

impl Default for SessionsFile {
    fn default() -> Self {
        Self {
            store: ResponsesStore::Memory,
            redis: None,
        }
    }
}

/// What one client may cost, and all clients together (`conf/README.md` explains each).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsFile {
    pub max_request_body_bytes: usize,
    #[serde(deserialize_with = "duration")]
    pub client_header_timeout: Duration,
    #[serde(deserialize_with = "duration")]
    pub client_body_timeout: Duration,
    #[serde(deserialize_with = "duration")]
    pub client_body_deadline: Duration,
    #[serde(deserialize_with = "duration")]
    pub send_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_client: usize,
    pub max_requests_in_flight: usize,
    pub max_requests_in_flight_per_client: usize,
    pub max_buffered_bytes: usize,
    pub h2_max_concurrent_streams: u32,
}

impl Default for LimitsFile {
    fn default() -> Self {
        Self {
            max_request_body_bytes: 8 * 1024 * 1024,
            // nginx's defaults for the three timeouts it shares with Sluice.
            client_header_timeout: Duration::from_secs(60),
            client_body_timeout: Duration::from_secs(30),
            client_body_deadline: Duration::from_secs(120),
            send_timeout: Duration::from_secs(60),
            max_connections: 16_384,
            max_connections_per_client: 1024,
            max_requests_in_flight: 16_384,
            max_requests_in_flight_per_client: 1024,
            max_buffered_bytes: 1024 * 1024 * 1024,
            // Envoy's and Pingora's default (nginx: 128).
            h2_max_concurrent_streams: 100,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogFile {
    pub level: String,
    pub format: LogFormat,
    pub access_log: bool,
}

impl Default for LogFile {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
            access_log: true,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFile {
    pub name: String,
    #[serde(default)]
    pub models: ModelsFile,
    #[serde(default)]
    pub max_model_len: Option<u32>,
    #[serde(default)]
    pub backends: Vec<BackendFile>,
    /// Where the backends come from instead of `backends`.
    #[serde(default)]
    pub discovery: Option<DiscoveryFile>,
    #[serde(default)]
    pub timeouts: TimeoutsFile,
    #[serde(default)]
    pub tls: Option<UpstreamTlsFile>,
    #[serde(default)]
    pub health: HealthFile,
    #[serde(default)]
    pub outlier_detection: OutlierFile,
    #[serde(default)]
    pub balancing: BalancingFile,
    #[serde(default)]
    pub supports: SupportsFile,
    #[serde(default)]
    pub retry: RetryFile,
    /// Dollars per million tokens, for the cost metrics and the tenants' budgets.
    #[serde(default)]
    pub price_per_million_tokens: f64,
    #[serde(default)]
    pub headers: HeaderRulesFile,
    /// The credential the pool's backends demand (vLLM's `--api-key`).
    #[serde(default)]
    pub upstream_auth: Option<UpstreamAuthFile>,
    /// Send the client's own API key headers upstream (off: removed).
    #[serde(default)]
    pub forward_client_key: bool,
    /// The model name sent upstream (vLLM's `--served-model-name`); absent: the client's.
    #[serde(default)]
    pub served_model: Option<String>,
    /// What the answers' `model` says when `served_model` is set.
    #[serde(default)]
    pub answer_model: Option<AnswerModelFile>,
    /// What of the client's body the engine gets as sent.
    #[serde(default)]
    pub client_fields: ClientFieldsFile,
    /// The pool's Hugging Face tokenizer folder, for the exact prefix index.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Where the backends publish their KV cache events: `auto` or `{port: N}`.
    #[serde(default)]
    pub kv_events: Option<KvEventsFile>,
    /// How long a request waits for a backend when the pool has none usable; `0s`: none.
    #[serde(default, deserialize_with = "optional_duration")]
    pub no_backend_wait: Option<Duration>,
    /// Fair order among the flows waiting in each class: `on` (the default), `off`, or its
    /// settings.
    #[serde(default)]
    pub fairness: Option<FairnessFile>,
    /// This pool decodes; long prompts are prefilled on the pool named here first.
    #[serde(default)]
    pub prefill: Option<PrefillFile>,
}

/// `pools[].prefill`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillFile {
    /// The prefill pool's name.
    pub pool: String,
    /// `nixl` (vLLM's `NixlConnector`) or `mooncake`.
    #[serde(default)]
    pub connector: Option<String>,
    #[serde(default)]
    pub min_prefill_tokens: Option<u64>,
    /// Recomputed transfers among the last ten checked that make the route fall back.
    #[serde(default)]
    pub fail_after: Option<u32>,
    /// How long a fallen-back route stays so.
    #[serde(default, deserialize_with = "optional_duration")]
    pub recover_after: Option<Duration>,
    /// The prefill engines' `kv_lease_duration`.
    #[serde(default, deserialize_with = "optional_duration")]
    pub kv_lease_duration: Option<Duration>,
    /// Mooncake: the prefill engines' bootstrap server port.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// `pools[].fairness`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum FairnessFile {
    /// `on` or `off`.
    Word(String),
    /// `true` or `false`.
    Switch(bool),
    /// On, with these settings.
    Settings(FairnessSettingsFile),
}

/// `pools[].fairness` as a map: each absent setting at its default.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FairnessSettingsFile {
    /// A flow's service halves in this long.
    #[serde(deserialize_with = "optional_duration")]
    pub half_life: Option<Duration>,
    /// What an output token counts, in prompt tokens.
    pub output_weight: Option<f64>,
    /// Prefill queued on every backend above which requests are held in Sluice.
    pub hold_above_tokens: Option<u64>,
    /// The longest a request is held for an engine that queues.
    #[serde(deserialize_with = "optional_duration")]
    pub max_hold: Option<Duration>,
    /// The most requests held at once.
    pub max_held: Option<usize>,
}

/// `pools[].kv_events`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum KvEventsFile {
    /// `auto`: ask each backend's `GET /kv_event_sources`.
    Word(String),
    /// `{port: N}`: each backend's publisher on that port of its own address.
    Port(KvEventsPortFile),
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsPortFile {
    pub port: u16,
}

/// `pools[].client_fields`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientFieldsFile {
    #[serde(default)]
    pub cache_salt: CacheSaltFile,
    #[serde(default)]
    pub engine_controls: EngineControlsFile,
}

/// `pools[].client_fields.cache_salt`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheSaltFile {
    /// A salt of the tenant's own on each request: vLLM's prefix cache shared within a tenant.
    #[default]
    PerTenant,
    /// The client's `cache_salt` as sent (none: the cache is shared by all).
    AsSent,
}

/// `pools[].client_fields.engine_controls`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineControlsFile {
    /// `priority`, `kv_transfer_params`, `vllm_xargs` reset to vLLM's defaults; `request_id`
    /// replaced by Sluice's.
    #[default]
    Reset,
    /// Passed as sent: for clients trusted with the engine.
    Pass,
}

/// `pools[].answer_model`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerModelFile {
    /// The name the client asked for.
    Requested,
    /// The name the pool's engine served.
    Served,
}

/// nginx's `proxy_set_header`, `add_header` and `proxy_hide_header`, per direction.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeaderRulesFile {
    pub request: RequestRulesFile,
    pub response: ResponseRulesFile,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestRulesFile {
    pub set: BTreeMap<String, String>,
    pub remove: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponseRulesFile {
    pub set: BTreeMap<String, String>,
    pub hide: Vec<String>,
}

/// Where the pool's credential comes from: never the config file itself.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamAuthFile {
    /// The header it is sent in; `authorization` (as `Bearer <secret>`) by default.
    #[serde(default)]
    pub header: Option<String>,
    /// An environment variable holding the secret.
    #[serde(default)]
    pub from_env: Option<String>,
    /// A file holding the secret (surrounding whitespace is not part of it).
    #[serde(default)]
    pub from_file: Option<PathBuf>,
}

/// Retries in the pool on an upstream's 5xx or 429, within a retry budget.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryFile {
    pub max_retries: u32,
    /// nginx's `proxy_next_upstream` condition names.
    pub on: Vec<String>,
    pub budget_ratio: f64,
    pub min_retries: u32,
    #[serde(deserialize_with = "duration")]
    pub backoff_base: Duration,
    #[serde(deserialize_with = "duration")]
    pub backoff_max: Duration,
}

impl Default for RetryFile {
    fn default() -> Self {
        let d = sluice_sdk::RetryPolicy::default();
        let on = sluice_sdk::RetryOn::NAMED
            .iter()
            .filter(|(_, on)| d.on.contains(*on))
            .map(|(name, _)| (*name).to_owned())
            .collect();
        Self {
            max_retries: d.max_retries,
            on,
            budget_ratio: d.budget_ratio,
            min_retries: d.min_retries,
            backoff_base: d.backoff_base,
            backoff_max: d.backoff_max,
        }
    }
}

/// What the pool's model can do (the speculative selector sends requests that need more
/// elsewhere).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SupportsFile {
    pub tools: bool,
    pub logprobs: bool,
    pub multiple_choices: bool,
    pub best_of: bool,
}

impl Default for SupportsFile {
    fn default() -> Self {
        let d = sluice_sdk::Capabilities::default();
        Self {
            tools: d.tools,
            logprobs: d.logprobs,
            multiple_choices: d.multiple_choices,
            best_of: d.best_of,
        }
    }
}

/// Active health checks: `/health` probes and `/metrics` scrapes of every backend.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthFile {
    pub enabled: bool,
    #[serde(deserialize_with = "duration")]
    pub interval: Duration,
    #[serde(deserialize_with = "duration")]
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
    #[serde(deserialize_with = "duration")]
    pub stale_after: Duration,
    pub stale_as: StaleAsFile,
    pub health_path: String,
    pub metrics_path: String,
}

impl Default for HealthFile {
    fn default() -> Self {
        let d = sluice_sdk::HealthPolicy::default();
        Self {
            enabled: d.enabled,
            interval: d.interval,
            timeout: d.timeout,
            unhealthy_after: d.unhealthy_after,
            healthy_after: d.healthy_after,
            stale_after: d.stale_after,
            stale_as: StaleAsFile::Saturated,
            health_path: d.health_path,
            metrics_path: d.metrics_path,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StaleAsFile {
    Saturated,
    Unknown,
}

/// Passive outlier detection: ejection on connect failures and 5xx of real traffic.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierFile {
    pub consecutive_failures: u32,
    #[serde(deserialize_with = "duration")]
    pub base_ejection: Duration,
    #[serde(deserialize_with = "duration")]
    pub max_ejection: Duration,
    pub max_ejection_percent: u32,
}

impl Default for OutlierFile {
    fn default() -> Self {
        let d = sluice_sdk::OutlierPolicy::default();
        Self {
            consecutive_failures: d.consecutive_failures,
            base_ejection: d.base_ejection,
            max_ejection: d.max_ejection,
            max_ejection_percent: d.max_ejection_percent,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BalancingFile {
    pub strategy: StrategyFile,
    /// Bytes of prompt that key prefix affinity (kv_aware and ttft); absent: off.
    pub prefix_affinity_bytes: Option<usize>,
    /// ttft only: the prefill speed backends start from, tokens per second.
    pub prefill_tokens_per_second: Option<f64>,
    /// ttft only: the share of requests sent to a random backend with nothing ahead.
    pub exploration: Option<f64>,
    /// Session affinity: off, soft (default) or hard.
    pub session_affinity: SessionModeFile,
    /// Where a request names its session, in order (`header:<name>`, `body:<member>`);
    /// what the agents send when absent.
    pub session_keys: Option<Vec<String>>,
    /// The one header naming a request's session (`session_keys: [header:<name>]`).
    pub session_header: Option<String>,
    /// How long an idle session is remembered.
    #[serde(default, deserialize_with = "optional_duration")]
    pub session_idle_ttl: Option<Duration>,
    /// The most sessions remembered.
    pub session_capacity: Option<usize>,
}

impl Default for BalancingFile {
    fn default() -> Self {
        Self {
            strategy: StrategyFile::KvAware,
            prefix_affinity_bytes: None,
            prefill_tokens_per_second: None,
            exploration: None,
            session_affinity: SessionModeFile::Soft,
            session_keys: None,
            session_header: None,
            session_idle_ttl: None,
            session_capacity: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum StrategyFile {
    RoundRobin,
    KvAware,
    Ttft,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SessionModeFile {
    Off,
    Soft,
    Hard,
}

fn optional_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

/// `pools[].models`: a list of names, or `auto` (learned from the backends' `/v1/models`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ModelsFile {
    Names(Vec<String>),
    Word(String),
}

impl Default for ModelsFile {
    fn default() -> Self {
        ModelsFile::Names(Vec::new())
    }
}

/// `pools[].discovery`: one source (checked by `super::validate`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryFile {
    #[serde(default)]
    pub dns: Option<DnsFile>,
    #[serde(default)]
    pub kubernetes: Option<KubernetesFile>,
    #[serde(default)]
    pub inference_pool: Option<InferencePoolFile>,
}

/// `pools[].discovery.inference_pool`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolFile {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub kubeconfig: Option<String>,
    #[serde(default = "default_debounce", deserialize_with = "duration")]
    pub debounce: Duration,
}

/// `pools[].discovery.dns`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsFile {
    pub name: String,
    pub port: u16,
    /// `ip` or `ip:port`; absent: the system's resolver configuration.
    #[serde(default)]
    pub resolver: Option<String>,
    #[serde(default = "default_min_refresh", deserialize_with = "duration")]
    pub min_refresh: Duration,
    #[serde(default = "default_max_refresh", deserialize_with = "duration")]
    pub max_refresh: Duration,
    /// One query's bound, retries included.
    #[serde(default = "default_dns_timeout", deserialize_with = "duration")]
    pub timeout: Duration,
    #[serde(default)]
    pub on_empty: OnEmptyFile,
}

fn default_min_refresh() -> Duration {
    Duration::from_secs(1)
}

fn default_max_refresh() -> Duration {
    Duration::from_secs(30)
}

fn default_dns_timeout() -> Duration {
    Duration::from_secs(2)
}

/// `pools[].discovery.dns.on_empty`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnEmptyFile {
    #[default]
    Drain,
    Keep,
}

/// `pools[].discovery.kubernetes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesFile {
    pub service: String,
    #[serde(default)]
    pub namespace: Option<String>,
    pub port: PortFile,
    #[serde(default)]
    pub kubeconfig: Option<String>,
    #[serde(default = "default_debounce", deserialize_with = "duration")]
    pub debounce: Duration,
}

fn default_debounce() -> Duration {
    Duration::from_millis(300)
}

/// A port by number or by name.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PortFile {
    Number(u16),
    Name(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendFile {
    pub address: String,
    #[serde(default = "default_weight")]
    pub weight: usize,
}

fn default_weight() -> usize {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTlsFile {
    /// The name to send as SNI and to verify the certificate against.
    pub sni: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsFile {
    #[serde(deserialize_with = "duration")]
    pub connect: Duration,
    #[serde(deserialize_with = "duration")]
    pub first_byte: Duration,
    #[serde(deserialize_with = "duration")]
    pub total: Duration,
    #[serde(deserialize_with = "duration")]
    pub keepalive_idle: Duration,
    pub min_tokens_per_second: Option<f64>,
    #[serde(deserialize_with = "duration")]
    pub margin: Duration,
}

impl Default for TimeoutsFile {
    fn default() -> Self {
        let d = sluice_sdk::Timeouts::default();
        Self {
            connect: d.connect,
            first_byte: d.first_byte,
            total: d.total,
            keepalive_idle: d.keepalive_idle,
            min_tokens_per_second: None,
            margin: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteFile {
    #[serde(default)]
    pub name: Option<String>,
    pub path_prefix: String,
    #[serde(default)]
    pub host: Option<String>,
    pub pool: String,
    /// Applied after the pool's.
    #[serde(default)]
    pub headers: HeaderRulesFile,
}

pub use sluice_sdk::duration::deserialize as duration;
