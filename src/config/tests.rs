//! The config's contract: every shipped file loads, every rule refuses with its key path and a
//! message that says what is wrong, and an almost empty file gets the documented defaults.

use super::*;
use crate::discovery::{dns, kubernetes, Source};
use sluice_sdk::{Balancing, HealthPolicy, OutlierPolicy, StaleAs, Timeouts, TokensPerSecond};

/// One pool with one backend: the smallest valid file.
const MINIMAL: &str = "
pools:
  - name: a
    backends:
      - address: 127.0.0.1:9
";

/// The core's pool calls, as the server hands them in.
fn calls() -> std::sync::Arc<dyn sluice_sdk::calls::PoolCalls> {
    std::sync::Arc::new(crate::proxy::pool_calls::CoreCalls)
}

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("/tmp/test.yaml"), &calls())
}

fn ok(text: &str) -> Config {
    parse(text).unwrap_or_else(|e| panic!("expected a valid config, got: {e}\n{text}"))
}

/// Asserts that `text` is refused at `path` with a message containing `needle`.
#[track_caller]
fn refused(text: &str, path: &str, needle: &str) -> ConfigError {
    let e = match parse(text) {
        Ok(_) => panic!("expected an error at `{path}`, the config was accepted:\n{text}"),
        Err(e) => e,
    };
    assert_eq!(e.file, Path::new("/tmp/test.yaml"), "{e}");
    assert_eq!(e.path, path, "wrong key path in: {e}");
    assert!(
        e.message.contains(needle),
        "message of `{e}` does not contain `{needle}`"
    );
    e
}

/// MINIMAL with its pool's `timeouts` section set to `timeouts` (flow style).
fn with_timeouts(timeouts: &str) -> String {
    format!("{MINIMAL}    timeouts: {timeouts}\n")
}

/// MINIMAL plus a top-level section.
fn with(section: &str) -> String {
    format!("{MINIMAL}{section}\n")
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn examples() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("conf/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    files
}

// ---- (a) shipped configs ---------------------------------------------------------------------

#[test]
fn the_shipped_config_loads() {
    let c = Config::load(&root().join("conf/sluice.yaml"), &calls()).unwrap();
    let names: Vec<&str> = c.pools.iter().map(|p| &*p.name).collect();
    assert_eq!(names, ["draft", "target"]);
    assert!(c.plugins.names().contains(&"request_id"));
}

#[test]
fn every_example_loads() {
    let files = examples();
    assert!(files.len() >= 3, "examples: {files:?}");
    for file in files {
        if let Err(e) = Config::load(&file, &calls()) {
            panic!("{e}");
        }
    }
}

#[test]
fn the_tls_example_has_a_tls_and_a_plain_listener() {
    let dir = root().join("conf/examples");
    let c = Config::load(&dir.join("tls.yaml"), &calls()).unwrap();
    let tls: Vec<_> = c.listeners.iter().filter_map(|l| l.tls.as_ref()).collect();
    assert_eq!(tls.len(), 1);
    assert_eq!(c.listeners.len(), 2);
    // Relative paths are resolved against the config file's folder.
    assert_eq!(tls[0].cert, dir.join("certs/localhost.crt"));
    assert_eq!(tls[0].key, dir.join("certs/localhost.key"));
}

#[test]
fn the_multi_pool_example_has_weights_a_catch_all_and_a_host_route() {
    let c = Config::load(&root().join("conf/examples/multi-pool.yaml"), &calls()).unwrap();
    assert!(c.pools.iter().count() >= 3);
    assert!(c
        .pools
        .iter()
        .any(|p| p.members().iter().any(|m| m.spec.weight > 1)));
    assert!(c.pools.iter().any(|p| p.is_catch_all()));
    assert!(c
        .pools
        .iter()
        .all(|p| p.is_catch_all() || p.settings.timeouts.sized_by_max_tokens.is_some()));
    assert!(c.routes.iter().any(|r| r.host.is_some()));
    // Public names: the pools sharing `llama` each send their engine's own name.
    let served: Vec<&str> = c
        .pools
        .iter()
        .filter(|p| p.serves("llama"))
        .filter_map(|p| p.settings.served_model.as_ref().map(|s| s.name()))
        .collect();
    assert_eq!(
        served,
        [
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Llama-3.1-70B-Instruct"
        ]
    );
}

#[test]
fn the_upstream_tls_example_sets_sni_on_every_pool() {
    let c = Config::load(&root().join("conf/examples/upstream-tls.yaml"), &calls()).unwrap();
    assert!(c.pools.iter().all(|p| p.settings.tls_sni.is_some()));
}

#[test]
fn a_missing_file_is_an_error_on_the_whole_file() {
    let e = Config::load(Path::new("/nonexistent/sluice.yaml"), &calls()).unwrap_err();
    assert_eq!(e.path, "");
    assert!(e.message.contains("cannot read the file"), "{e}");
}

// ---- (b) refusals: what the YAML layer catches ----------------------------------------------

#[test]
fn an_unknown_top_level_key_is_refused() {
    refused(&with("bogus: 1"), "bogus", "unknown field `bogus`");
}

#[test]
fn an_unknown_nested_key_is_refused_with_its_path() {
    refused(
        &with_timeouts("{ conect: 1s }"),
        "pools[0].timeouts.conect",
        "unknown field `conect`",
    );
    refused(
        &with("listeners: [{ address: 127.0.0.1:8080, port: 80 }]"),
        "listeners[0].port",
        "unknown field `port`",
    );
    refused(
        &with("plugins: { request_id: { enabled: true, bogus: 1 } }"),
        "plugins.request_id.bogus",
        "unknown field `bogus`",
    );
}

#[test]
fn an_unknown_plugin_is_refused() {
    refused(
        &with("plugins: { no_such_plugin: { enabled: true } }"),
        "plugins.no_such_plugin",
        "unknown field `no_such_plugin`",
    );
}

#[test]
fn a_wrong_type_is_refused() {
    refused(
        &with("pingora: { threads: many }"),
        "pingora.threads",
        "invalid type",
    );
    refused(
        "pools:\n  - name: a\n    backends: [{ address: 127.0.0.1:9, weight: -1 }]\n",
        "pools[0].backends[0].weight",
        "invalid type",
    );
    refused(
        &with("limits: { max_request_body_bytes: 8MiB }"),
        "limits.max_request_body_bytes",
        "invalid type",
    );
}

#[test]
fn a_bad_duration_is_refused() {
    refused(
        &with_timeouts("{ total: soon }"),
        "pools[0].timeouts.total",
        "`soon` is not a duration",
    );
    // A bare number has no unit.
    refused(
        &with("limits: { client_body_timeout: 30 }"),
        "limits.client_body_timeout",
        "`30` is not a duration",
    );
}

#[test]
fn a_bad_log_format_is_refused() {
    refused(
        &with("log: { format: xml }"),
        "log.format",
        "unknown variant `xml`",
    );
}

#[test]
fn pools_are_required() {
    refused("log: { level: info }\n", "", "missing field `pools`");
}

#[test]
fn a_pool_needs_backends_and_a_name() {
    refused(
        "pools: [{ name: a }]\n",
        "pools[0].backends",
        "at least one backend is needed (or a `discovery` source)",
    );
    refused(
        "pools: [{ backends: [{ address: 127.0.0.1:9 }] }]\n",
        "pools[0]",
        "missing field `name`",
    );
}

#[test]
fn upstream_tls_needs_an_sni() {
    refused(
        &format!("{MINIMAL}    tls: {{}}\n"),
        "pools[0].tls",
        "missing field `sni`",
    );
}

// ---- (b) refusals: server_conf ---------------------------------------------------------------

#[test]
fn zero_threads_are_refused() {
    refused(
        &with("pingora: { threads: 0 }"),
        "pingora.threads",
        "must be at least 1",
    );
}

#[test]
fn a_daemon_needs_an_error_log() {
    refused(
        &with("pingora: { daemon: true }"),
        "pingora.error_log",
        "set error_log to a file",
    );
    ok(&with(
        "pingora: { daemon: true, error_log: /tmp/sluice-error.log }",
    ));
}

// ---- (b) refusals: listeners and admin --------------------------------------------------------

#[test]
fn at_least_one_listener_is_needed() {
    refused(
        &with("listeners: []"),
        "listeners",
        "at least one listener is needed",
    );
}

#[test]
fn a_listener_address_must_be_host_port() {
    refused(
        &with("listeners: [{ address: '8080' }]"),
        "listeners[0].address",
        "is not a host:port address",
    );
}

#[test]
fn a_listener_address_is_used_once() {
    refused(
        &with("listeners: [{ address: 127.0.0.1:8080 }, { address: 127.0.0.1:8080 }]"),
        "listeners[1].address",
        "127.0.0.1:8080 clashes with 127.0.0.1:8080",
    );
}

#[test]
fn a_missing_tls_cert_is_refused() {
    refused(
        &with("listeners: [{ address: 127.0.0.1:8443, tls: { cert: nope.crt, key: nope.key } }]"),
        "listeners[0].tls.cert",
        "no file at /tmp/nope.crt",
    );
}

#[test]
fn a_missing_tls_key_is_refused() {
    let cert = root().join("conf/examples/certs/localhost.crt");
    refused(
        &with(&format!(
            "listeners: [{{ address: 127.0.0.1:8443, tls: {{ cert: '{}', key: nope.key }} }}]",
            cert.display()
        )),
        "listeners[0].tls.key",
        "no file at /tmp/nope.key",
    );
}

#[test]
fn the_admin_address_must_be_host_port() {
    refused(
        &with("admin: { address: localhost }"),
        "admin.address",
        "is not a host:port address",
    );
}

#[test]
fn the_admin_address_must_not_be_a_listener() {
    refused(
        &with("listeners: [{ address: 127.0.0.1:9090 }]"),
        "admin.address",
        "clashes with the proxy listener 127.0.0.1:9090",
    );
}

#[test]
fn a_disabled_admin_is_not_checked_and_not_started() {
    let c = ok(&with(
        "listeners: [{ address: 127.0.0.1:9090 }]\nadmin: { enabled: false }",
    ));
    assert_eq!(c.admin, None);
}

// ---- (b) refusals: limits and log ----------------------------------------------------------

#[test]
fn a_zero_body_limit_is_refused() {
    refused(
        &with("limits: { max_request_body_bytes: 0 }"),
        "limits.max_request_body_bytes",
        "must be between 1 and 1073741824",
    );
}

#[test]
fn a_body_limit_over_1_gib_is_refused() {
    refused(
        &with("limits: { max_request_body_bytes: 1073741825 }"),
        "limits.max_request_body_bytes",
        "must be between 1 and 1073741824",
    );
    ok(&with("limits: { max_request_body_bytes: 1073741824 }"));
}

#[test]
fn a_zero_client_body_timeout_is_refused() {
    refused(
        &with("limits: { client_body_timeout: 0s }"),
        "limits.client_body_timeout",
        "must be longer than 0",
    );
}

#[test]
fn client_timeouts_are_above_0_and_at_most_a_day() {
    for key in [
        "client_header_timeout",
        "client_body_timeout",
        "client_body_deadline",
        "send_timeout",
    ] {
        for value in ["0s", "25h"] {
            refused(
                &with(&format!("limits: {{ {key}: {value} }}")),
                &format!("limits.{key}"),
                "must be longer than 0 and at most",
            );
        }
    }
}

#[test]
fn connection_and_request_caps_are_at_least_1() {
    for key in [
        "max_connections",
        "max_connections_per_client",
        "max_requests_in_flight",
        "max_requests_in_flight_per_client",
    ] {
        refused(
            &with(&format!("limits: {{ {key}: 0 }}")),
            &format!("limits.{key}"),
            "must be at least 1",
        );
    }
}

#[test]
fn the_memory_budget_holds_at_least_one_whole_body() {
    refused(
        &with("limits: { max_request_body_bytes: 2048, max_buffered_bytes: 1024 }"),
        "limits.max_buffered_bytes",
        "must be at least limits.max_request_body_bytes (1024 < 2048)",
    );
    ok(&with(
        "limits: { max_request_body_bytes: 2048, max_buffered_bytes: 2048 }",
    ));
}

#[test]
fn trusted_proxies_are_addresses_or_networks() {
    refused(
        &with("trusted_proxies: [10.0.0.1, 10.0.0.0/8, proxy.internal]"),
        "trusted_proxies[2]",
        "`proxy.internal` is not an IP address or a network",
    );
    ok(&with(
        "trusted_proxies: [10.0.0.1, 10.0.0.0/8, '::1', 'fd00::/8']",
    ));
}

#[test]
fn a_bad_log_level_is_refused() {
    refused(
        &with("log: { level: 'sluice=loud' }"),
        "log.level",
        "is not a log level or filter",
    );
}

#[test]
fn log_filters_are_accepted() {
    let c = ok(&with("log: { level: 'info,sluice=debug', format: json }"));
    assert_eq!(c.log.level, "info,sluice=debug");
    assert_eq!(c.log.format, LogFormat::Json);
}

// ---- (b) refusals: pools ---------------------------------------------------------------------

#[test]
fn at_least_one_pool_is_needed() {
    refused("pools: []\n", "pools", "at least one pool is needed");
}

#[test]
fn a_pool_name_is_letters_digits_dash_underscore() {
    refused(
        "pools: [{ name: 'my pool', backends: [{ address: 127.0.0.1:9 }] }]\n",
        "pools[0].name",
        "`my pool` is not a name",
    );
    refused(
        "pools: [{ name: '', backends: [{ address: 127.0.0.1:9 }] }]\n",
        "pools[0].name",
        "is not a name",
    );
    ok("pools: [{ name: Draft-pool_2, backends: [{ address: 127.0.0.1:9 }] }]\n");
}

#[test]
fn a_pool_is_defined_once() {
    refused(
        "pools:\n  - { name: a, backends: [{ address: 127.0.0.1:9 }] }\n  - { name: a, backends: [{ address: 127.0.0.1:10 }] }\n",
        "pools[1].name",
        "pool `a` is defined twice",
    );
}

#[test]
fn a_pool_needs_at_least_one_backend() {
    refused(
        "pools: [{ name: a, backends: [] }]\n",
        "pools[0].backends",
        "at least one backend is needed",
    );
}

#[test]
fn discovery_sources_are_read_with_their_defaults() {
    let c = ok("pools:
  - name: a
    discovery:
      dns: { name: vllm.llm.svc.cluster.local., port: 8000, resolver: 10.96.0.10 }
  - name: b
    discovery:
      kubernetes: { service: vllm-draft, namespace: llm, port: http }
  - name: c
    backends: [{ address: localhost:9 }, { address: 127.0.0.2:9 }]
  - name: d
    backends: [{ address: 127.0.0.3:9 }]
");
    assert_eq!(c.discovery.len(), 3, "pool d has nothing to re-resolve");
    match &c.discovery[0].source {
        Source::Dns(d) => {
            assert_eq!(d.name, "vllm.llm.svc.cluster.local");
            assert_eq!(d.resolver, Some("10.96.0.10:53".parse().unwrap()));
            assert_eq!(d.min_refresh, Duration::from_secs(1));
            assert_eq!(d.max_refresh, Duration::from_secs(30));
            assert_eq!(d.on_empty, dns::OnEmpty::Drain);
        }
        other => panic!("{other:?}"),
    }
    match &c.discovery[1].source {
        Source::Kubernetes(k) => {
            assert_eq!(k.port, kubernetes::PortRef::Name("http".into()));
            assert_eq!(k.debounce, Duration::from_millis(300));
            assert_eq!(k.kubeconfig, None);
        }
        other => panic!("{other:?}"),
    }
    // A static pool named by host name is re-resolved; one by address is not.
    assert!(matches!(&c.discovery[2].source, Source::Names(n) if n[0].host == "localhost"));
    assert!(c.pools.get("a").unwrap().members().is_empty());
    assert_eq!(
        c.pools.get("a").unwrap().settings.source,
        "dns vllm.llm.svc.cluster.local:8000"
    );
}

#[test]
fn models_are_listed_or_learned() {
    let c =
        ok("pools: [{ name: a, models: auto, discovery: { dns: { name: vllm, port: 8000 } } }]\n");
    let pool = c.pools.get("a").unwrap();
    assert!(pool.settings.auto_models && !pool.is_catch_all());
    refused(
        "pools: [{ name: a, models: llama, backends: [{ address: 127.0.0.1:9 }] }]\n",
        "pools[0].models",
        "`llama` is neither a list of model names nor `auto`",
    );
    refused(
        "pools: [{ name: a, models: auto, health: { enabled: false }, backends: [{ address: 127.0.0.1:9 }] }]\n",
        "pools[0].models",
        "they must be on",
    );
}

#[test]
fn discovery_keys_are_checked() {
    let pool = |discovery: &str| format!("pools: [{{ name: a, discovery: {discovery} }}]\n");
    refused(
        "pools: [{ name: a, backends: [{ address: 127.0.0.1:9 }], discovery: { dns: { name: x, port: 1 } } }]\n",
        "pools[0].discovery",
        "not both",
    );
    refused(&pool("{}"), "pools[0].discovery", "give one source");
    refused(
        &pool("{ dns: { name: x, port: 1 }, kubernetes: { service: x, port: 1 } }"),
        "pools[0].discovery",
        "give one source",
    );
    refused(
        &pool("{ dns: { name: 'a b', port: 1 } }"),
        "pools[0].discovery.dns.name",
        "not a DNS name",
    );
    refused(
        &pool("{ dns: { name: x, port: 0 } }"),
        "pools[0].discovery.dns.port",
        "at least 1",
    );
    refused(
        &pool("{ dns: { name: x, port: 1, resolver: nowhere } }"),
        "pools[0].discovery.dns.resolver",
        "not an IP address",
    );
    refused(
        &pool("{ dns: { name: x, port: 1, min_refresh: 10s, max_refresh: 5s } }"),
        "pools[0].discovery.dns.max_refresh",
        "at least min_refresh",
    );
    refused(
        &pool("{ dns: { name: x, port: 1, on_empty: forget } }"),
        "pools[0].discovery.dns.on_empty",
        "unknown variant `forget`, expected `drain` or `keep`",
    );
    refused(
        &pool("{ kubernetes: { service: Vllm, port: http } }"),
        "pools[0].discovery.kubernetes.service",
        "not a Service name",
    );
    refused(
        &pool("{ kubernetes: { service: vllm, namespace: LLM, port: http } }"),
        "pools[0].discovery.kubernetes.namespace",
        "not a namespace name",
    );
    refused(
        &pool("{ kubernetes: { service: vllm, port: 'not a port' } }"),
        "pools[0].discovery.kubernetes.port",
        "not a port number or port name",
    );
    refused(
        &pool("{ kubernetes: { service: vllm, port: http, kubeconfig: /no/such/kubeconfig } }"),
        "pools[0].discovery.kubernetes.kubeconfig",
        "/no/such/kubeconfig",
    );
    refused(
        &pool("{ kubernetes: { service: vllm, port: http, debounce: 1m } }"),
        "pools[0].discovery.kubernetes.debounce",
        "at most 10s",
    );
}

#[test]
fn a_zero_weight_is_refused() {
    refused(
        "pools: [{ name: a, backends: [{ address: 127.0.0.1:9, weight: 0 }] }]\n",
        "pools[0].backends[0].weight",
        "must be at least 1",
    );
}

#[test]
fn a_backend_address_must_be_host_port() {
    refused(
        "pools: [{ name: a, backends: [{ address: 127.0.0.1 }] }]\n",
        "pools[0].backends[0].address",
        "`127.0.0.1` is not a host:port address",
    );
}

#[test]
fn a_backend_is_listed_once_per_pool() {
    refused(
        "pools: [{ name: a, backends: [{ address: 127.0.0.1:9 }, { address: 127.0.0.1:9, weight: 2 }] }]\n",
        "pools[0].backends[1].address",
        "127.0.0.1:9 is listed twice in this pool",
    );
    // The same backend in two pools is fine.
    ok("pools:\n  - { name: a, backends: [{ address: 127.0.0.1:9 }] }\n  - { name: b, backends: [{ address: 127.0.0.1:9 }] }\n");
}

#[test]
fn zero_timeouts_are_refused() {
    for key in ["connect", "first_byte", "total"] {
        refused(
            &with_timeouts(&format!("{{ {key}: 0s }}")),
            &format!("pools[0].timeouts.{key}"),
            "must be longer than 0",
        );
    }
}

#[test]
fn first_byte_must_not_be_longer_than_total() {
    refused(
        &with_timeouts("{ first_byte: 50s, total: 40s }"),
        "pools[0].timeouts.first_byte",
        "must not be longer than pools[0].timeouts.total (50s > 40s)",
    );
    // The whole line, as `sluice -t` prints it. Durations are shown by humantime, so 90s reads
    // `1m 30s` (the example in the module docs of config/mod.rs says `90s > 60s`).
    let text = with_timeouts("{ first_byte: 90s, total: 60s }");
    let e = Config::parse(&text, Path::new("conf/sluice.yaml"), &calls()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "conf/sluice.yaml: pools[0].timeouts.first_byte: must not be longer than pools[0].timeouts.total (1m 30s > 1m)"
    );
    // The default first_byte (60s) counts too.
    refused(
        &with_timeouts("{ total: 30s }"),
        "pools[0].timeouts.first_byte",
        "(1m > 30s)",
    );
}

#[test]
fn pool_timeouts_are_at_most_a_day() {
    for key in ["connect", "first_byte", "total", "keepalive_idle", "margin"] {
        refused(
            &with_timeouts(&format!("{{ {key}: 25h }}")),
            &format!("pools[0].timeouts.{key}"),
            "must be at most",
        );
    }
}

#[test]
fn connect_must_not_be_longer_than_total() {
    refused(
        &with_timeouts("{ connect: 2m, first_byte: 10s, total: 1m }"),
        "pools[0].timeouts.connect",
        "must not be longer than pools[0].timeouts.total",
    );
}

#[test]
fn min_tokens_per_second_must_be_above_zero() {
    for (rate, shown) in [("0", "got 0"), ("-5", "got -5"), (".nan", "got NaN")] {
        refused(
            &with_timeouts(&format!("{{ min_tokens_per_second: {rate} }}")),
            "pools[0].timeouts.min_tokens_per_second",
            shown,
        );
    }
}

#[test]
fn a_zero_max_model_len_is_refused() {
    refused(
        &format!("{MINIMAL}    max_model_len: 0\n"),
        "pools[0].max_model_len",
        "must be at least 1",
    );
}

// ---- (b) refusals: routes --------------------------------------------------------------------

#[test]
fn a_route_prefix_starts_with_a_slash() {
    refused(
        &with("routes: [{ path_prefix: tokenize, pool: a }]"),
        "routes[0].path_prefix",
        "must start with /",
    );
}

#[test]
fn a_route_names_an_existing_pool() {
    refused(
        &with("routes: [{ path_prefix: /ok, pool: a }, { path_prefix: /tokenize, pool: target }]"),
        "routes[1].pool",
        "no pool is named `target`",
    );
}

// ---- (b) refusals: plugins -------------------------------------------------------------------

#[test]
fn an_invalid_request_id_header_is_refused() {
    refused(
        &with("plugins: { request_id: { header: 'x request id' } }"),
        "plugins.request_id.header",
        "`x request id` is not a valid header name",
    );
}

// ---- (c) defaults and what valid values become -------------------------------------------------

#[test]
fn a_minimal_config_gets_the_documented_defaults() {
    let c = ok(MINIMAL);
    assert_eq!(c.source, Path::new("/tmp/test.yaml"));

    assert_eq!(c.listeners.len(), 1);
    assert_eq!(c.listeners[0].address, "0.0.0.0:8080".parse().unwrap());
    assert!(c.listeners[0].tls.is_none());
    assert_eq!(c.admin, Some("127.0.0.1:9090".parse().unwrap()));

    assert_eq!(c.limits.max_request_body_bytes, 8 * 1024 * 1024);
    assert_eq!(c.limits.client_body_timeout, Duration::from_secs(30));

    assert_eq!(c.log.level, "info");
    assert_eq!(c.log.format, LogFormat::Text);
    assert!(c.log.access_log);

    assert!(c.routes.is_empty());
    assert_eq!(c.plugins.names(), ["request_id"]);

    let s = &c.server;
    assert_eq!(s.threads, 1);
    assert!(s.work_stealing);
    assert_eq!(s.pid_file, "/tmp/sluice/sluice.pid");
    assert_eq!(s.upgrade_sock, "/tmp/sluice/upgrade.sock");
    assert_eq!(s.error_log, None);
    assert_eq!(s.user, None);
    assert_eq!(s.group, None);
    assert!(!s.daemon);
    assert_eq!(s.grace_period_seconds, Some(30));
    assert_eq!(s.graceful_shutdown_timeout_seconds, Some(5));
    assert_eq!(s.upstream_keepalive_pool_size, 128);
    assert_eq!(s.listener_tasks_per_fd, 1);
    assert_eq!(s.ca_file, None);

    let pool = c.pools.get("a").unwrap();
    assert!(pool.models().is_empty());
    assert_eq!(pool.settings.max_model_len, None);
    assert_eq!(pool.settings.tls_sni, None);
    let members = pool.members();
    assert_eq!(members.get(0).unwrap().spec.weight, 1);
    assert_eq!(members.get(0).unwrap().spec.address, "127.0.0.1:9");
    assert_eq!(pool.settings.source, "static");
    assert!(c.discovery.is_empty());
    let t = &pool.settings.timeouts;
    assert_eq!(t.connect, Duration::from_secs(2));
    assert_eq!(t.first_byte, Duration::from_secs(60));
    assert_eq!(t.total, Duration::from_secs(600));
    assert_eq!(t.keepalive_idle, Duration::from_secs(60));
    assert_eq!(t.sized_by_max_tokens, None);
    assert_eq!(*t, Timeouts::default());
}

#[test]
fn empty_sections_mean_their_defaults() {
    let c = ok(&with(
        "pingora:\nadmin:\nlimits:\nlog:\nroutes:\nplugins:\n  request_id:",
    ));
    assert_eq!(c.admin, Some("127.0.0.1:9090".parse().unwrap()));
    assert_eq!(c.limits.max_request_body_bytes, 8 * 1024 * 1024);
    assert!(c.plugins.names().contains(&"request_id"));
}

#[test]
fn durations_are_written_as_people_write_them() {
    let c = ok(&with_timeouts(
        "{ connect: 250ms, first_byte: 2s, total: 1h 30m, keepalive_idle: 5m }",
    ));
    let t = &c.pools.get("a").unwrap().settings.timeouts;
    assert_eq!(t.connect, Duration::from_millis(250));
    assert_eq!(t.first_byte, Duration::from_secs(2));
    assert_eq!(t.total, Duration::from_secs(90 * 60));
    assert_eq!(t.keepalive_idle, Duration::from_secs(300));
}

#[test]
fn min_tokens_per_second_sizes_the_total_timeout() {
    let c = ok(&with_timeouts(
        "{ first_byte: 10s, total: 100s, min_tokens_per_second: 10, margin: 5s }",
    ));
    let t = &c.pools.get("a").unwrap().settings.timeouts;
    assert_eq!(
        t.sized_by_max_tokens,
        Some(TokensPerSecond {
            min_tokens_per_second: 10.0,
            margin: Duration::from_secs(5),
        })
    );
    // first_byte + max_tokens / rate + margin, capped by total; total without max_tokens.
    assert_eq!(t.total_for(Some(200)), Duration::from_secs(35));
    assert_eq!(t.total_for(Some(100_000)), Duration::from_secs(100));
    assert_eq!(t.total_for(None), Duration::from_secs(100));

    // margin defaults to 30s; without min_tokens_per_second it is unused.
    let c = ok(&with_timeouts("{ min_tokens_per_second: 2.5 }"));
    let t = &c.pools.get("a").unwrap().settings.timeouts;
    assert_eq!(
        t.sized_by_max_tokens.as_ref().unwrap().margin,
        Duration::from_secs(30)
    );
    assert_eq!(t.total_for(Some(100)), Duration::from_secs(60 + 40 + 30));
}

#[test]
fn routes_are_named_by_their_prefix_unless_named_and_hosts_are_lowercased() {
    let c = ok(&with(
        "routes:\n  - { path_prefix: /tokenize, pool: a }\n  - { name: api, path_prefix: /, host: API.Example.com, pool: a }",
    ));
    assert_eq!(&*c.routes[0].name, "/tokenize");
    assert_eq!(c.routes[0].host, None);
    assert_eq!(&*c.routes[1].name, "api");
    assert_eq!(c.routes[1].host.as_deref(), Some("api.example.com"));
    assert_eq!(&*c.routes[1].pool.name, "a");
}

#[test]
fn models_map_to_the_first_pool_that_lists_them() {
    let c = ok("pools:
  - { name: small, models: [m1, m2], backends: [{ address: 127.0.0.1:9 }] }
  - { name: big, models: [m2, m3], backends: [{ address: 127.0.0.1:10 }] }
  - { name: rest, backends: [{ address: 127.0.0.1:11 }] }
");
    assert_eq!(&*c.pools.for_model("m2").unwrap().name, "small");
    assert_eq!(&*c.pools.for_model("m3").unwrap().name, "big");
    assert!(c.pools.for_model("other").is_none());
    assert_eq!(&*c.pools.default_pool().unwrap().name, "small");
}

#[test]
fn pingora_keys_reach_the_server_conf() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, self_signed_ca_pem()).unwrap();
    let c = ok(&with(&format!(
        "pingora:
  threads: 4
  work_stealing: false
  pid_file: /run/sluice.pid
  upgrade_sock: /run/sluice.sock
  error_log: /var/log/sluice.log
  user: nobody
  group: nogroup
  daemon: true
  grace_period_seconds: 60
  graceful_shutdown_timeout_seconds: 10
  upstream_keepalive_pool_size: 256
  listener_tasks_per_fd: 2
  ca_file: {}",
        ca.display()
    )));
    let s = &c.server;
    assert_eq!(s.threads, 4);
    assert!(!s.work_stealing);
    assert_eq!(s.pid_file, "/run/sluice.pid");
    assert_eq!(s.upgrade_sock, "/run/sluice.sock");
    assert_eq!(s.error_log.as_deref(), Some("/var/log/sluice.log"));
    assert_eq!(s.user.as_deref(), Some("nobody"));
    assert_eq!(s.group.as_deref(), Some("nogroup"));
    assert!(s.daemon);
    assert_eq!(s.grace_period_seconds, Some(60));
    assert_eq!(s.graceful_shutdown_timeout_seconds, Some(10));
    assert_eq!(s.upstream_keepalive_pool_size, 256);
    assert_eq!(s.listener_tasks_per_fd, 2);
    assert_eq!(s.ca_file.as_deref(), ca.to_str());
}

fn self_signed_ca_pem() -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.self_signed(&key).unwrap().pem()
}

#[test]
fn a_ca_file_must_exist_and_hold_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let e = refused(
        &with(&format!("pingora: {{ ca_file: {} }}", missing.display())),
        "pingora.ca_file",
        "missing.pem",
    );
    assert!(e.message.len() > "missing.pem".len() + 10, "says why: {e}");
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    refused(
        &with(&format!("pingora: {{ ca_file: {} }}", empty.display())),
        "pingora.ca_file",
        "holds no PEM certificate",
    );
    let key_only = dir.path().join("key.pem");
    std::fs::write(
        &key_only,
        rcgen::KeyPair::generate().unwrap().serialize_pem(),
    )
    .unwrap();
    refused(
        &with(&format!("pingora: {{ ca_file: {} }}", key_only.display())),
        "pingora.ca_file",
        "certificate",
    );
}

#[test]
fn a_disabled_plugin_keeps_its_section() {
    let c = ok(&with(
        "plugins: { request_id: { enabled: false, header: X-Trace-Id } }",
    ));
    // Checked, and out of the chain.
    assert!(c.plugins.names().is_empty());
}

#[test]
fn zero_listener_tasks_are_refused() {
    refused(
        &format!("pingora:\n  listener_tasks_per_fd: 0\n{MINIMAL}"),
        "pingora.listener_tasks_per_fd",
        "at least 1",
    );
}

#[test]
fn a_wildcard_listener_clashes_with_an_admin_on_the_same_port() {
    refused(
        &format!(
            "listeners:\n  - address: 0.0.0.0:9090\nadmin:\n  address: 127.0.0.1:9090\n{MINIMAL}"
        ),
        "admin.address",
        "clashes with the proxy listener 0.0.0.0:9090",
    );
}

#[test]
fn a_log_level_typo_is_refused_not_taken_as_a_target() {
    for typo in ["loud", "warning", "", "info,verbose"] {
        refused(
            &format!("log:\n  level: \"{typo}\"\n{MINIMAL}"),
            "log.level",
            "is not a log level or filter",
        );
    }
}

#[test]
fn a_yaml_syntax_error_is_reported_on_the_whole_file_with_its_line() {
    let e = parse("pools: [\n  {name: a\n").unwrap_err();
    assert!(!e.path.contains('?'), "{e}");
    assert!(e.message.contains("line"), "{e}");
}

#[test]
fn the_cache_section_is_checked_with_its_key_paths() {
    refused(
        &with("plugins: { cache: { enabled: true, store: redis } }"),
        "plugins.cache.redis",
        "needs a redis section",
    );
    refused(
        &with("plugins: { cache: { enabled: true, ttl: 0s } }"),
        "plugins.cache.ttl",
        "longer than 0",
    );
    refused(
        &with("plugins: { cache: { enabled: true, redis: { url: \"redis://a:1\", cluster_nodes: [\"redis://b:1\"] } } }"),
        "plugins.cache.redis.url",
        "not both",
    );
    let c = ok(&with("plugins: { cache: { enabled: true } }"));
    assert!(c.plugins.names().contains(&"cache"));
}

/// MINIMAL with its pool's section `key` set to `value` (flow style).
fn with_pool_key(key: &str, value: &str) -> String {
    format!("{MINIMAL}    {key}: {value}\n")
}

#[test]
fn health_balancing_and_outlier_defaults() {
    let c = ok(MINIMAL);
    let pool = c.pools.iter().next().unwrap();
    assert_eq!(pool.settings.health, HealthPolicy::default());
    assert_eq!(pool.settings.health.interval, Duration::from_millis(250));
    assert_eq!(pool.settings.outlier, OutlierPolicy::default());
    assert_eq!(
        pool.settings.balancing,
        Balancing::KvAware {
            prefix_affinity: None
        }
    );
    let c = ok(&format!(
        "{MINIMAL}    health: {{interval: 50ms, stale_as: unknown}}\n    balancing: {{strategy: kv_aware, prefix_affinity_bytes: 512}}\n"
    ));
    let pool = c.pools.iter().next().unwrap();
    assert_eq!(pool.settings.health.stale_as, StaleAs::Unknown);
    assert_eq!(
        pool.settings.balancing,
        Balancing::KvAware {
            prefix_affinity: Some(512)
        }
    );
}

#[test]
fn health_rules_are_enforced() {
    refused(
        &with_pool_key("health", "{interval: 10ms}"),
        "pools[0].health.interval",
        "at least 50ms",
    );
    refused(
        &with_pool_key("health", "{interval: 1s, stale_after: 500ms}"),
        "pools[0].health.stale_after",
        "interval",
    );
    refused(
        &with_pool_key("health", "{unhealthy_after: 0}"),
        "pools[0].health.unhealthy_after",
        "at least 1",
    );
    refused(
        &with_pool_key("health", "{metrics_path: metrics}"),
        "pools[0].health.metrics_path",
        "start with /",
    );
    refused(
        &with_pool_key("health", "{stale_as: maybe}"),
        "pools[0].health.stale_as",
        "unknown variant",
    );
    refused(
        &with_pool_key(
            "outlier_detection",
            "{base_ejection: 10s, max_ejection: 5s}",
        ),
        "pools[0].outlier_detection.max_ejection",
        "base_ejection",
    );
    refused(
        &with_pool_key(
            "balancing",
            "{strategy: round_robin, prefix_affinity_bytes: 64}",
        ),
        "pools[0].balancing.prefix_affinity_bytes",
        "kv_aware",
    );
}

#[test]
fn a_zero_health_timeout_is_refused() {
    refused(
        &with_pool_key("health", "{timeout: 0s}"),
        "pools[0].health.timeout",
        "must be longer than 0",
    );
}

#[test]
fn zero_healthy_after_is_refused() {
    refused(
        &with_pool_key("health", "{healthy_after: 0}"),
        "pools[0].health.healthy_after",
        "must be at least 1",
    );
}

#[test]
fn a_health_path_starts_with_a_slash() {
    refused(
        &with_pool_key("health", "{health_path: health}"),
        "pools[0].health.health_path",
        "must start with /",
    );
}

#[test]
fn ejection_needs_a_length() {
    refused(
        &with_pool_key(
            "outlier_detection",
            "{consecutive_failures: 3, base_ejection: 0s}",
        ),
        "pools[0].outlier_detection.base_ejection",
        "must be longer than 0",
    );
    // With ejection off, its length is not used.
    ok(&with_pool_key(
        "outlier_detection",
        "{consecutive_failures: 0, base_ejection: 0s}",
    ));
}

#[test]
fn the_ejected_share_is_a_percentage() {
    refused(
        &with_pool_key("outlier_detection", "{max_ejection_percent: 150}"),
        "pools[0].outlier_detection.max_ejection_percent",
        "between 0 and 100",
    );
    let c = ok(&with_pool_key(
        "outlier_detection",
        "{max_ejection_percent: 100}",
    ));
    assert_eq!(
        c.pools
            .get("a")
            .unwrap()
            .settings
            .outlier
            .max_ejection_percent,
        100
    );
}

#[test]
fn ttft_balancing_and_session_affinity_are_read_with_defaults() {
    use sluice_sdk::pool::{SessionAffinity, SessionKey, SessionMode, TtftBalancing};
    let c = ok(&with_pool_key("balancing", "{strategy: ttft}"));
    let pool = c.pools.iter().next().unwrap();
    assert_eq!(
        pool.settings.balancing,
        Balancing::Ttft(TtftBalancing::default())
    );
    // On by default, reading what the agents send.
    let sessions = pool.settings.sessions.clone().expect("on by default");
    assert_eq!(sessions.mode, SessionMode::Soft);
    let keys: Vec<String> = sessions.keys.iter().map(ToString::to_string).collect();
    assert_eq!(keys, crate::config::pools::DEFAULT_SESSION_KEYS);
    let c = ok(&with_pool_key("balancing", "{session_affinity: off}"));
    assert_eq!(c.pools.iter().next().unwrap().settings.sessions, None);
    let c = ok(&with_pool_key(
        "balancing",
        "{strategy: ttft, prefix_affinity_bytes: 256, prefill_tokens_per_second: 4000, \
         exploration: 0.05, session_affinity: hard, session_header: X-Conversation, \
         session_idle_ttl: 5m, session_capacity: 1000}",
    ));
    let pool = c.pools.iter().next().unwrap();
    assert_eq!(
        pool.settings.balancing,
        Balancing::Ttft(TtftBalancing {
            prefix_affinity: Some(256),
            prefill_tokens_per_second: 4000.0,
            exploration: 0.05,
        })
    );
    assert_eq!(
        pool.settings.sessions,
        Some(SessionAffinity {
            keys: vec![SessionKey::Header("x-conversation".into())],
            mode: SessionMode::Hard,
            idle_ttl: Duration::from_secs(300),
            capacity: 1000,
        })
    );
    // Sessions work under any strategy, with the default header.
    let c = ok(&with_pool_key(
        "balancing",
        "{strategy: round_robin, session_affinity: soft}",
    ));
    let sessions = c
        .pools
        .iter()
        .next()
        .unwrap()
        .settings
        .sessions
        .clone()
        .unwrap();
    assert_eq!(
        (sessions.keys.len(), sessions.mode, sessions.capacity),
        (DEFAULT_KEYS, SessionMode::Soft, 65_536)
    );
    assert_eq!(sessions.idle_ttl, Duration::from_secs(1800));
    // An ordered list of headers and body members.
    let c = ok(&with_pool_key(
        "balancing",
        "{session_keys: ['header:X-Agent-Session', 'body:prompt_cache_key', 'body:metadata.user_id']}",
    ));
    let keys = c
        .pools
        .iter()
        .next()
        .unwrap()
        .settings
        .sessions
        .clone()
        .unwrap()
        .keys;
    assert_eq!(
        keys,
        vec![
            SessionKey::Header("x-agent-session".into()),
            SessionKey::Body {
                member: "prompt_cache_key",
                inner: None
            },
            SessionKey::Body {
                member: "metadata",
                inner: Some("user_id".into())
            },
        ]
    );
}

const DEFAULT_KEYS: usize = crate::config::pools::DEFAULT_SESSION_KEYS.len();

#[test]
fn ttft_and_session_rules_are_enforced() {
    for (value, key, why) in [
        (
            "{prefill_tokens_per_second: 1000}",
            "prefill_tokens_per_second",
            "needs strategy: ttft",
        ),
        ("{exploration: 0.1}", "exploration", "needs strategy: ttft"),
        (
            "{strategy: ttft, prefill_tokens_per_second: 0}",
            "prefill_tokens_per_second",
            "above 0",
        ),
        (
            "{strategy: ttft, exploration: 1.5}",
            "exploration",
            "between 0 and 1",
        ),
        (
            "{session_affinity: off, session_header: x-session-id}",
            "session_header",
            "needs session_affinity",
        ),
        (
            "{session_affinity: off, session_keys: ['header:x']}",
            "session_keys",
            "needs session_affinity",
        ),
        (
            "{session_keys: ['header:x'], session_header: x}",
            "session_header",
            "set one of the two",
        ),
        ("{session_keys: []}", "session_keys", "at least one"),
        (
            "{session_keys: ['x-session-id']}",
            "session_keys[0]",
            "header:<name>",
        ),
        (
            "{session_keys: ['header:x', 'body:messages']}",
            "session_keys[1]",
            "names no body member",
        ),
        (
            "{session_keys: ['body:metadata']}",
            "session_keys[0]",
            "names no body member",
        ),
        (
            "{session_keys: ['header:bad header']}",
            "session_keys[0]",
            "not a header name",
        ),
        (
            "{session_affinity: soft, session_header: 'bad header'}",
            "session_header",
            "not a header name",
        ),
        (
            "{session_affinity: soft, session_capacity: 1}",
            "session_capacity",
            "between 2",
        ),
        (
            "{session_affinity: soft, session_idle_ttl: 0s}",
            "session_idle_ttl",
            "at least 1s",
        ),
    ] {
        refused(
            &with_pool_key("balancing", value),
            &format!("pools[0].balancing.{key}"),
            why,
        );
    }
}

#[test]
fn zero_prefix_affinity_bytes_are_refused() {
    refused(
        &with_pool_key("balancing", "{prefix_affinity_bytes: 0}"),
        "pools[0].balancing.prefix_affinity_bytes",
        "must be at least 1",
    );
}

#[test]
fn a_retry_budget_ratio_is_between_0_and_1() {
    for (ratio, shown) in [
        ("1.5", "got 1.5"),
        ("-0.1", "got -0.1"),
        (".nan", "got NaN"),
    ] {
        refused(
            &with_pool_key("retry", &format!("{{budget_ratio: {ratio}}}")),
            "pools[0].retry.budget_ratio",
            shown,
        );
    }
    ok(&with_pool_key("retry", "{budget_ratio: 1}"));
}

#[test]
fn retry_conditions_are_nginx_names() {
    let c = ok(&with_pool_key(
        "retry",
        "{max_retries: 1, on: [error, timeout, http_503]}",
    ));
    let on = c.pools.iter().next().unwrap().settings.retry.on;
    assert!(on.contains(sluice_sdk::RetryOn::TIMEOUT) && on.status(503) && !on.status(502));
    let c = ok(MINIMAL);
    let on = c.pools.iter().next().unwrap().settings.retry.on;
    assert_eq!(on, sluice_sdk::RetryOn::default());
    refused(
        &with_pool_key("retry", "{on: [http_503, http_418]}"),
        "pools[0].retry.on[1]",
        "unknown condition `http_418`; known: error, timeout, http_500",
    );
}

#[test]
fn a_pool_price_is_dollars_0_or_more() {
    let c = ok(&with_pool_key("price_per_million_tokens", "0.9"));
    assert_eq!(
        c.pools
            .iter()
            .next()
            .unwrap()
            .settings
            .price_per_million_tokens,
        0.9
    );
    refused(
        &with_pool_key("price_per_million_tokens", "-1"),
        "pools[0].price_per_million_tokens",
        "0 or more",
    );
}

#[test]
fn the_longest_backoff_is_not_shorter_than_the_first() {
    refused(
        &with_pool_key("retry", "{backoff_base: 100ms, backoff_max: 50ms}"),
        "pools[0].retry.backoff_max",
        "must not be shorter than pools[0].retry.backoff_base",
    );
}

#[test]
fn kv_breaker_rules_are_enforced() {
    let c = ok(&with("plugins:\n  kv_breaker:\n    enabled: true"));
    assert!(c.plugins.names().contains(&"kv_breaker"));
    ok(&with("plugins:\n  kv_breaker:\n    overload_status: 529"));
    refused(
        &with("plugins:\n  kv_breaker:\n    overload_status: 500"),
        "plugins.kv_breaker.overload_status",
        "must be 503, 429 or 529",
    );
    refused(
        &with("plugins:\n  kv_breaker:\n    thresholds:\n      standard: {shed_above: 0.8, resume_below: 0.9}"),
        "plugins.kv_breaker.thresholds.standard.resume_below",
        "at most",
    );
    refused(
        &with("plugins:\n  kv_breaker:\n    thresholds:\n      sheddable: {shed_above: 0.9, resume_below: 0.8}"),
        "plugins.kv_breaker.thresholds",
        "must not decrease",
    );
    // Tenants' classes come from the tenants plugin, not from a header a client may set.
    refused(
        &with("plugins:\n  kv_breaker:\n    priority: {tenants: {a: {max: standard}}}"),
        "plugins.kv_breaker.priority.tenants",
        "unknown field",
    );
    refused(
        &with("plugins:\n  kv_breaker:\n    priority: {default: vip}"),
        "plugins.kv_breaker.priority.default",
        "unknown variant",
    );
    ok(&with(
        "plugins:\n  kv_breaker:\n    queue: {max_wait: {sheddable: 500ms}, max_queued: 10}",
    ));
    refused(
        &with("plugins:\n  kv_breaker:\n    queue: {max_wait: {critical: 2m}}"),
        "plugins.kv_breaker.queue.max_wait.critical",
        "at most 60s",
    );
    refused(
        &with("plugins:\n  kv_breaker:\n    queue: {max_queued: 0}"),
        "plugins.kv_breaker.queue.max_queued",
        "between 1 and 100000",
    );
    refused(
        &with("plugins:\n  kv_breaker:\n    queue: {wait: 2s}"),
        "plugins.kv_breaker.queue.wait",
        "unknown field",
    );
}

#[test]
fn kv_breaker_thresholds_are_between_0_and_1_5() {
    for shed_above in ["2", "0"] {
        refused(
            &with(&format!(
                "plugins:\n  kv_breaker:\n    enabled: true\n    thresholds:\n      critical: {{shed_above: {shed_above}, resume_below: 0.1}}"
            )),
            "plugins.kv_breaker.thresholds.critical.shed_above",
            &format!("must be above 0 and at most 1.5 (got {shed_above})"),
        );
    }
}

#[test]
fn kv_breaker_retry_after_bounds_are_ordered() {
    for bounds in [
        "min_retry_after: 0s",
        "min_retry_after: 10s, max_retry_after: 5s",
    ] {
        refused(
            &with(&format!(
                "plugins:\n  kv_breaker: {{enabled: true, {bounds}}}"
            )),
            "plugins.kv_breaker.max_retry_after",
            "min_retry_after must be above 0 and at most max_retry_after",
        );
    }
}

#[test]
fn kv_breaker_header_names_are_checked() {
    refused(
        &with("plugins:\n  kv_breaker: {enabled: true, priority: {header: 'x priority'}}"),
        "plugins.kv_breaker.priority.header",
        "`x priority` is not a valid header name",
    );
}

// ---- (b) refusals: the cache's section, every rule --------------------------------------------

/// MINIMAL with the cache on and `keys` (flow style, without braces) in its section.
fn cache_with(keys: &str) -> String {
    with(&format!("plugins:\n  cache: {{enabled: true, {keys}}}"))
}

#[test]
fn cache_sizes_and_ttls_are_positive() {
    refused(
        &cache_with("ttl_by_model: {m: 0s}"),
        "plugins.cache.ttl_by_model.m",
        "must be longer than 0",
    );
    refused(
        &cache_with("max_entry_bytes: 0"),
        "plugins.cache.max_entry_bytes",
        "must be at least 1",
    );
    refused(
        &cache_with("memory: {max_bytes: 65535}"),
        "plugins.cache.memory.max_bytes",
        "must be at least 65536",
    );
}

#[test]
fn coalescing_needs_a_wait_when_on() {
    refused(
        &cache_with("coalesce: {max_wait: 0s}"),
        "plugins.cache.coalesce.max_wait",
        "must be longer than 0",
    );
    ok(&cache_with("coalesce: {enabled: false, max_wait: 0s}"));
}

#[test]
fn coalescing_needs_room_for_a_follower_when_on() {
    refused(
        &cache_with("coalesce: {max_followers: 0}"),
        "plugins.cache.coalesce.max_followers",
        "must be at least 1",
    );
    ok(&cache_with("coalesce: {enabled: false, max_followers: 0}"));
}

#[test]
fn cache_header_names_are_checked() {
    refused(
        &cache_with("key_headers: [x-index, 'x index']"),
        "plugins.cache.key_headers[1]",
        "`x index` is not a valid header name",
    );
    refused(
        &cache_with("tenant: {header: x-tenant-id}"),
        "plugins.cache.tenant.header",
        "unknown field",
    );
    refused(
        &cache_with("tenant: {anonymous: everyone}"),
        "plugins.cache.tenant.anonymous",
        "unknown variant",
    );
}

#[test]
fn the_redis_section_needs_one_valid_target() {
    refused(
        &cache_with("store: redis, redis: {}"),
        "plugins.cache.redis.url",
        "set url (single node) or cluster_nodes",
    );
    refused(
        &cache_with("store: redis, redis: {url: 'http://cache:6379'}"),
        "plugins.cache.redis.url",
        "is not a Redis URL",
    );
    refused(
        &cache_with("store: redis, redis: {cluster_nodes: ['redis://a:1', 'http://b:1']}"),
        "plugins.cache.redis.cluster_nodes[1]",
        "is not a Redis URL",
    );
}

#[test]
fn redis_timeouts_and_counts_are_positive() {
    for key in ["lookup_timeout", "connect_timeout", "cooldown"] {
        refused(
            &cache_with(&format!(
                "store: redis, redis: {{url: 'redis://cache:6379', {key}: 0s}}"
            )),
            &format!("plugins.cache.redis.{key}"),
            "must be more than 0",
        );
    }
    for key in ["failure_threshold", "write_queue"] {
        refused(
            &cache_with(&format!(
                "store: redis, redis: {{url: 'redis://cache:6379', {key}: 0}}"
            )),
            &format!("plugins.cache.redis.{key}"),
            "must be at least 1",
        );
    }
}

// ---- (b) refusals: the speculative selector's section -----------------------------------------

/// A draft and a target pool serving `m` (alias `m2` on the draft only), a pool serving
/// another model, and the selector's section `section` (flow style).
fn speculative(section: &str) -> String {
    format!(
        "pools:
  - {{ name: draft, models: [m, m2], backends: [{{ address: 127.0.0.1:9 }}] }}
  - {{ name: target, models: [m], backends: [{{ address: 127.0.0.1:10 }}] }}
  - {{ name: other, models: [x], backends: [{{ address: 127.0.0.1:11 }}] }}
plugins:
  speculative: {section}
"
    )
}

/// The selector on, with one model entry `model` (flow style, without braces).
fn speculative_model(model: &str) -> String {
    speculative(&format!("{{enabled: true, models: [{{{model}}}]}}"))
}

const DRAFT_THEN_TARGET: &str = "model: m, drafts: [{pool: draft}], target: target";

#[test]
fn the_speculative_section_loads() {
    let c = ok(&speculative_model(DRAFT_THEN_TARGET));
    assert!(c.plugins.names().contains(&"speculative"));
    // Off, it needs no models.
    let c = ok(&speculative("{enabled: false}"));
    assert!(!c.plugins.names().contains(&"speculative"));
}

#[test]
fn an_enabled_selector_needs_a_model() {
    refused(
        &speculative("{enabled: true}"),
        "plugins.speculative.models",
        "at least one model is needed",
    );
}

#[test]
fn a_model_name_is_configured_once() {
    refused(
        &speculative(&format!(
            "{{enabled: true, models: [{{{DRAFT_THEN_TARGET}}}, {{{DRAFT_THEN_TARGET}}}]}}"
        )),
        "plugins.speculative.models[1].model",
        "`m` is named twice",
    );
    refused(
        &speculative_model(&format!("{DRAFT_THEN_TARGET}, aliases: [m]")),
        "plugins.speculative.models[0].model",
        "`m` is named twice",
    );
}

#[test]
fn a_model_needs_a_draft_pool_other_than_its_target() {
    refused(
        &speculative_model("model: m, drafts: [], target: target"),
        "plugins.speculative.models[0].drafts",
        "at least one draft pool",
    );
    refused(
        &speculative_model("model: m, drafts: [{pool: draft}, {pool: target}], target: target"),
        "plugins.speculative.models[0].target",
        "must not also be a draft pool",
    );
}

#[test]
fn min_logprob_is_a_log_probability() {
    for min_logprob in ["0.5", ".nan"] {
        refused(
            &speculative_model(&format!(
                "{DRAFT_THEN_TARGET}, confidence: {{enabled: true, min_logprob: {min_logprob}}}"
            )),
            "plugins.speculative.models[0].confidence.min_logprob",
            "must be a log-probability",
        );
    }
    ok(&speculative_model(&format!(
        "{DRAFT_THEN_TARGET}, confidence: {{enabled: true, min_logprob: 0}}"
    )));
}

#[test]
fn the_hold_back_window_is_at_most_256_tokens() {
    refused(
        &speculative_model(&format!(
            "{DRAFT_THEN_TARGET}, confidence: {{enabled: true, stream_hold_back_tokens: 257}}"
        )),
        "plugins.speculative.models[0].confidence.stream_hold_back_tokens",
        "at most 256",
    );
    ok(&speculative_model(&format!(
        "{DRAFT_THEN_TARGET}, confidence: {{enabled: true, stream_hold_back_tokens: 256}}"
    )));
}

#[test]
fn prices_are_the_pools_not_the_selectors() {
    refused(
        &speculative(&format!(
            "{{enabled: true, models: [{{{DRAFT_THEN_TARGET}}}], price_per_million_tokens: {{draft: 0.1}}}}"
        )),
        "plugins.speculative.price_per_million_tokens",
        "unknown field",
    );
}

#[test]
fn the_tier_header_is_a_header_name() {
    refused(
        &speculative(&format!(
            "{{enabled: true, tier_header: 'x tier', models: [{{{DRAFT_THEN_TARGET}}}]}}"
        )),
        "plugins.speculative.tier_header",
        "`x tier` is not a valid header name",
    );
}

#[test]
fn draft_and_target_pools_must_exist() {
    refused(
        &speculative_model("model: m, drafts: [{pool: draft}, {pool: nope}], target: target"),
        "plugins.speculative.models[0].drafts[1].pool",
        "no pool is named `nope`",
    );
    refused(
        &speculative_model("model: m, drafts: [{pool: draft}], target: nope"),
        "plugins.speculative.models[0].target",
        "no pool is named `nope`",
    );
}

#[test]
fn draft_and_target_pools_must_serve_the_model_and_its_aliases() {
    refused(
        &speculative_model("model: m, drafts: [{pool: draft}], target: other"),
        "plugins.speculative.models[0].target",
        "pool `other` must serve `m`",
    );
    refused(
        &speculative_model("model: x, drafts: [{pool: draft}], target: other"),
        "plugins.speculative.models[0].drafts[0].pool",
        "pool `draft` must serve `x`",
    );
    // `m2` is an alias the target pool does not list.
    refused(
        &speculative_model(&format!("{DRAFT_THEN_TARGET}, aliases: [m2]")),
        "plugins.speculative.models[0].target",
        "pool `target` must serve `m` and its aliases",
    );
}

// ---- (b) refusals: the tenants section ---------------------------------------------------------

fn tenants_with(keys: &str) -> String {
    with(&format!("plugins:\n  tenants: {{enabled: true, {keys}}}"))
}

const A_DIGEST: &str = "sha256:684455aba2f4e49856693f862d62ed1756ea87a33e1d4340560fe704c7eee471";

#[test]
fn tenants_rules_are_enforced() {
    let c = ok(&tenants_with(&format!(
        "tenants: {{alpha: {{keys: ['{A_DIGEST}'], limits: {{requests_per_minute: 5}}}}}}"
    )));
    assert!(c.plugins.names().contains(&"tenants"));
    refused(
        &tenants_with("tenants: {alpha: {keys: [sk-alpha-demo]}}"),
        "plugins.tenants.tenants.alpha.keys[0]",
        "never the key itself: `sluice hash-key` prints one",
    );
    refused(
        &tenants_with(&format!(
            "tenants: {{alpha: {{keys: ['{A_DIGEST}']}}, beta: {{keys: ['{A_DIGEST}']}}}}"
        )),
        "plugins.tenants.tenants.beta.keys[0]",
        "is tenant `alpha`'s key too",
    );
    refused(
        &tenants_with("tenant_header: x-sluice-tenant"),
        "plugins.tenants.trusted_proxies",
        "is needed with tenant_header",
    );
    refused(
        &tenants_with("trusted_proxies: [10.0.0.0/33]"),
        "plugins.tenants.trusted_proxies[0]",
        "neither an IP address nor a CIDR network",
    );
    refused(
        &tenants_with(&format!("defaults: {{keys: ['{A_DIGEST}']}}")),
        "plugins.tenants.defaults.keys",
        "a tenant's own section",
    );
    refused(
        &tenants_with("tenants: {anonymous: {}}"),
        "plugins.tenants.tenants.anonymous",
        "is not a tenant name",
    );
    refused(
        &tenants_with("defaults: {priority: {default: critical, max: standard}}"),
        "plugins.tenants.defaults.priority.default",
        "must not be above priority.max",
    );
    refused(
        &tenants_with("defaults: {limits: {requests_per_minute: 0}}"),
        "plugins.tenants.defaults.limits.requests_per_minute",
        "",
    );
    refused(
        &tenants_with("limits_store: {kind: redis}"),
        "plugins.tenants.limits_store.redis",
        "",
    );
}

// ---- (b) refusals: header rules and upstream credentials ---------------------------------------

#[test]
fn header_rules_and_credentials_are_checked() {
    let c = ok(&with_pool_key(
        "headers",
        "{request: {set: {x-team: llm}, remove: [x-debug]}, response: {set: {x-a: b}, hide: [server]}}",
    ));
    let pool = c.pools.iter().next().unwrap();
    assert_eq!(pool.settings.headers.request_set.len(), 1);
    assert_eq!(pool.settings.headers.response_hide[0].as_str(), "server");
    assert!(
        !pool.settings.forward_client_key,
        "client keys are removed by default"
    );
    refused(
        &with_pool_key("headers", "{request: {set: {content-length: '5'}}}"),
        "pools[0].headers.request.set.content-length",
        "frames the message",
    );
    refused(
        &with_pool_key("headers", "{response: {hide: ['bad name']}}"),
        "pools[0].headers.response.hide[0]",
        "is not a valid header name",
    );
    refused(
        &with_pool_key("headers", "{request: {set: {x-a: \"line\\nbreak\"}}}"),
        "pools[0].headers.request.set.x-a",
        "not a valid header value",
    );
    refused(
        &with_pool_key("upstream_auth", "{}"),
        "pools[0].upstream_auth",
        "exactly one of from_env and from_file",
    );
    refused(
        &with_pool_key("upstream_auth", "{from_file: /nonexistent/sluice-key}"),
        "pools[0].upstream_auth.from_file",
        "cannot read /nonexistent/sluice-key",
    );
    refused(
        &with_pool_key("upstream_auth", "{secret: s3cret}"),
        "pools[0].upstream_auth.secret",
        "unknown field",
    );
}

// ---- (b) refusals: the model name a pool serves ------------------------------------------------

#[test]
fn served_model_names_are_checked() {
    let c = ok(MINIMAL);
    assert!(c
        .pools
        .iter()
        .next()
        .unwrap()
        .settings
        .served_model
        .is_none());
    let c = ok(&with_pool_key(
        "served_model",
        "meta-llama/Llama-3.2-1B-Instruct",
    ));
    let served = c
        .pools
        .iter()
        .next()
        .unwrap()
        .settings
        .served_model
        .clone()
        .unwrap();
    assert_eq!(served.name(), "meta-llama/Llama-3.2-1B-Instruct");
    assert_eq!(served.answer, sluice_sdk::AnswerModel::Requested);
    let c = ok(&format!(
        "{}    answer_model: served\n",
        with_pool_key("served_model", "big")
    ));
    let served = c
        .pools
        .iter()
        .next()
        .unwrap()
        .settings
        .served_model
        .clone()
        .unwrap();
    assert_eq!(served.answer, sluice_sdk::AnswerModel::Served);
    refused(
        &with_pool_key("served_model", "''"),
        "pools[0].served_model",
        "must not be empty",
    );
    refused(
        &with_pool_key("served_model", "'a\"b'"),
        "pools[0].served_model",
        "a quote or a backslash",
    );
    refused(
        &with_pool_key("answer_model", "served"),
        "pools[0].answer_model",
        "only read with served_model",
    );
    refused(
        &format!(
            "{}    answer_model: client\n",
            with_pool_key("served_model", "big")
        ),
        "pools[0].answer_model",
        "unknown variant",
    );
}

/// MINIMAL's pool with `keys` added (block style, pool-level).
fn pool_with(keys: &str) -> String {
    format!("{MINIMAL}{keys}")
}

#[test]
fn the_exact_prefix_index_needs_a_tokenizer_events_and_a_reading_strategy() {
    let tokenizer = root().join("tests/fixtures/tokenizer-chatml");
    let tokenizer = tokenizer.display();
    let config = ok(&pool_with(&format!(
        "    tokenizer: {tokenizer}\n    kv_events: auto\n    balancing: {{strategy: ttft}}\n"
    )));
    let routing = config.pools.iter().next().unwrap().prefix().unwrap();
    assert_eq!(routing.kv_events, sluice_sdk::prefix::KvEventSource::Auto);
    assert!(routing.tokenizer.has_chat_template());
    let config = ok(&pool_with(&format!(
        "    tokenizer: {tokenizer}\n    kv_events: {{port: 5557}}\n"
    )));
    let routing = config.pools.iter().next().unwrap().prefix().unwrap();
    assert_eq!(
        routing.kv_events,
        sluice_sdk::prefix::KvEventSource::Port(5557)
    );
    refused(
        &pool_with("    kv_events: auto\n"),
        "pools[0].kv_events",
        "needs `tokenizer`",
    );
    refused(
        &pool_with(&format!("    tokenizer: {tokenizer}\n")),
        "pools[0].tokenizer",
        "set `kv_events` too",
    );
    refused(
        &pool_with(&format!(
            "    tokenizer: {tokenizer}\n    kv_events: auto\n    balancing: {{strategy: round_robin}}\n"
        )),
        "pools[0].kv_events",
        "not `round_robin`",
    );
    refused(
        &pool_with(&format!(
            "    tokenizer: {tokenizer}\n    kv_events: sometimes\n"
        )),
        "pools[0].kv_events",
        "must be `auto`",
    );
    refused(
        &pool_with("    tokenizer: no-such-folder\n    kv_events: auto\n"),
        "pools[0].tokenizer",
        "/tmp/no-such-folder/tokenizer.json",
    );
}

#[test]
fn telemetry_is_off_unless_asked_and_checked_when_it_is() {
    assert_eq!(ok(MINIMAL).telemetry, None);
    let on = ok(&with(
        "telemetry: {otlp: {endpoint: 'http://collector:4318'}, sampling: 0.1}",
    ));
    assert_eq!(
        on.telemetry,
        Some(TelemetrySettings {
            endpoint: "http://collector:4318".into(),
            protocol: TraceProtocol::HttpProtobuf,
            sampling: 0.1,
            service_name: "sluice".into(),
            continue_client_traces: true,
        })
    );
    let grpc = ok(&with(
        "telemetry: {otlp: {endpoint: 'http://collector:4317', protocol: grpc}, client_traces: ignore, service_name: edge}",
    ));
    let grpc = grpc.telemetry.unwrap();
    assert_eq!(grpc.protocol, TraceProtocol::Grpc);
    assert!(!grpc.continue_client_traces);
    assert_eq!(grpc.service_name, "edge");
    refused(
        &with("telemetry: {otlp: {endpoint: 'http://c:4318'}, sampling: 1.5}"),
        "telemetry.sampling",
        "between 0 and 1",
    );
    refused(
        &with("telemetry: {otlp: {endpoint: 'collector:4318'}}"),
        "telemetry.otlp.endpoint",
        "not an http://",
    );
    refused(
        &with("telemetry: {otlp: {endpoint: 'http://c:4318', protocol: http/json}}"),
        "telemetry.otlp.protocol",
        "unknown variant",
    );
    refused(
        &with("telemetry: {otlp: {endpoint: 'http://c:4318'}, samping: 0.5}"),
        "telemetry.samping",
        "unknown field `samping`",
    );
}

#[test]
fn responses_are_kept_in_memory_unless_redis_is_named() {
    let memory = ok(MINIMAL).responses;
    assert_eq!(memory.redis, None);
    assert_eq!(memory.ttl, Duration::from_secs(6 * 3600));
    let redis = ok(&with(
        "responses: {store: redis, ttl: 10m, redis: {url: 'redis://127.0.0.1:6379'}}",
    ))
    .responses;
    assert_eq!(redis.ttl, Duration::from_secs(600));
    assert_eq!(
        redis.redis.unwrap().url.as_deref(),
        Some("redis://127.0.0.1:6379")
    );
    refused(
        &with("responses: {store: redis}"),
        "responses.redis",
        "needs a redis section",
    );
    refused(
        &with("responses: {ttl: 0s}"),
        "responses.ttl",
        "more than 0",
    );
}

#[test]
fn fairness_is_on_by_default_with_the_agents_session_keys() {
    let c = ok(MINIMAL);
    let pool = c.pools.iter().next().unwrap();
    let fairness = pool.settings.fairness.clone().expect("on by default");
    assert_eq!(fairness.half_life, Duration::from_secs(60));
    assert_eq!(fairness.output_weight, 2.0);
    let keys: Vec<String> = fairness
        .session_keys
        .iter()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(
        keys.first().map(String::as_str),
        Some("header:x-session-id")
    );
    assert!(
        keys.iter().any(|k| k == "body:prompt_cache_key"),
        "{keys:?}"
    );
}

#[test]
fn fairness_is_switched_off_or_set() {
    for off in ["off", "false"] {
        let c = ok(&format!("{MINIMAL}    fairness: {off}\n"));
        assert!(
            c.pools.iter().next().unwrap().settings.fairness.is_none(),
            "{off}"
        );
    }
    let c = ok(&format!(
        "{MINIMAL}    fairness: {{half_life: 30s, output_weight: 4, hold_above_tokens: 2048}}\n    balancing: {{session_keys: [\"header:x-conversation\"]}}\n"
    ));
    let fairness = c
        .pools
        .iter()
        .next()
        .unwrap()
        .settings
        .fairness
        .clone()
        .unwrap();
    assert_eq!(fairness.half_life, Duration::from_secs(30));
    assert_eq!(fairness.output_weight, 4.0);
    assert_eq!(fairness.hold_above_tokens, 2048);
    let keys: Vec<String> = fairness
        .session_keys
        .iter()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(
        keys,
        vec!["header:x-conversation"],
        "the pool's own session keys"
    );
}

#[test]
fn fairness_settings_are_checked() {
    let with_fairness = |f: &str| format!("{MINIMAL}    fairness: {f}\n");
    refused(&with_fairness("maybe"), "pools[0].fairness", "neither `on`");
    refused(
        &with_fairness("{half_life: 100ms}"),
        "pools[0].fairness.half_life",
        "at least 1s",
    );
    refused(
        &with_fairness("{output_weight: -1}"),
        "pools[0].fairness.output_weight",
        "between 0 and 1000",
    );
    refused(
        &with_fairness("{hold_above_tokens: 0}"),
        "pools[0].fairness.hold_above_tokens",
        "at least 1",
    );
    refused(
        &with_fairness("{max_held: 0}"),
        "pools[0].fairness.max_held",
        "between 1 and 100000",
    );
    refused(
        &with_fairness("{max_hold: 2d}"),
        "pools[0].fairness.max_hold",
        "",
    );
}

#[test]
fn an_inference_pool_source_is_read_and_checked() {
    let pool =
        |discovery: &str| format!("pools:\n  - name: a\n    discovery:\n      {discovery}\n");
    let c = ok(&pool("inference_pool: {name: llama-70b, namespace: llm}"));
    match &c.discovery[0].source {
        Source::InferencePool(p) => {
            assert_eq!(p.name, "llama-70b");
            assert_eq!(p.namespace.as_deref(), Some("llm"));
            assert_eq!(p.debounce, Duration::from_millis(300));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        c.pools.get("a").unwrap().settings.source,
        "inferencepool llm/llama-70b"
    );
    refused(
        &pool("inference_pool: {name: Llama}"),
        "pools[0].discovery.inference_pool.name",
        "not an object name",
    );
    refused(
        &pool("inference_pool: {name: x, debounce: 11s}"),
        "pools[0].discovery.inference_pool.debounce",
        "at most 10s",
    );
    refused(
        &pool("{inference_pool: {name: x}, kubernetes: {service: s, port: 80}}"),
        "pools[0].discovery",
        "give one source",
    );
}

const DISAGGREGATED: &str = "
pools:
  - name: decode
    backends:
      - address: 127.0.0.1:9
    prefill: PREFILL
  - name: prefill
    backends:
      - address: 127.0.0.1:10
";

fn disaggregated(prefill: &str) -> String {
    DISAGGREGATED.replace("PREFILL", prefill)
}

#[test]
fn a_pool_decodes_for_the_prefill_pool_it_names() {
    let c = ok(&disaggregated("{pool: prefill}"));
    let decode = c.pools.get("decode").unwrap();
    let route = decode.settings.prefill.clone().unwrap();
    assert_eq!(route.pool, "prefill");
    assert_eq!(route.connector, sluice_sdk::Connector::Nixl);
    assert_eq!(route.min_prefill_tokens, 1024);
    assert_eq!(
        (route.fail_after, route.recover_after),
        (3, Duration::from_secs(30))
    );
    assert_eq!(route.kv_lease_duration, Duration::from_secs(30));
    assert!(decode.transfer_check().is_some());
    assert!(c.pools.get("prefill").unwrap().transfer_check().is_none());
    let c = ok(&disaggregated(
        "{pool: prefill, connector: nixl, min_prefill_tokens: 4096, fail_after: 5, recover_after: 2m, kv_lease_duration: 2m}",
    ));
    let route = c
        .pools
        .get("decode")
        .unwrap()
        .settings
        .prefill
        .clone()
        .unwrap();
    assert_eq!(route.min_prefill_tokens, 4096);
    assert_eq!(
        (route.fail_after, route.recover_after),
        (5, Duration::from_secs(120))
    );
    assert_eq!(route.kv_lease_duration, Duration::from_secs(120));
    for (given, port) in [
        ("{pool: prefill, connector: mooncake}", 8998),
        (
            "{pool: prefill, connector: mooncake, bootstrap_port: 9100}",
            9100,
        ),
    ] {
        let c = ok(&disaggregated(given));
        let route = c.pools.get("decode").unwrap().settings.prefill.clone();
        assert_eq!(
            route.unwrap().connector,
            sluice_sdk::Connector::Mooncake {
                bootstrap_port: port
            }
        );
    }
    refused(
        &disaggregated("{pool: prefill, kv_lease_duration: 0s}"),
        "pools[0].prefill.kv_lease_duration",
        "must be more than 0",
    );
}

#[test]
fn a_prefill_route_names_another_pool_that_exists_with_a_known_connector() {
    refused(
        &disaggregated("{pool: nowhere}"),
        "pools[0].prefill.pool",
        "no pool is named `nowhere`",
    );
    refused(
        &disaggregated("{pool: decode}"),
        "pools[0].prefill.pool",
        "cannot prefill for itself",
    );
    refused(
        &disaggregated("{pool: prefill, bootstrap_port: 9000}"),
        "pools[0].prefill.bootstrap_port",
        "Mooncake's",
    );
    refused(
        &disaggregated("{pool: prefill, connector: mooncake, bootstrap_port: 0}"),
        "pools[0].prefill.bootstrap_port",
        "must be a port",
    );
    refused(
        &disaggregated("{pool: prefill, connector: lmcache}"),
        "pools[0].prefill.connector",
        "not a connector",
    );
    refused(
        &disaggregated("{pool: prefill, min_prefill_tokens: 0}"),
        "pools[0].prefill.min_prefill_tokens",
        "at least 1",
    );
    refused(
        &disaggregated("{pool: prefill, fail_after: 11}"),
        "pools[0].prefill.fail_after",
        "1 to 10",
    );
    refused(
        &disaggregated("{pool: prefill, surprise: 1}"),
        "pools[0].prefill.surprise",
        "unknown field",
    );
    refused(
        &DISAGGREGATED.replace(
            "    prefill: PREFILL",
            "    prefill: {pool: prefill}\n    client_fields: {engine_controls: pass}",
        ),
        "pools[0].prefill.pool",
        "engine_controls: reset",
    );
    // A prefill pool that itself decodes for another.
    let chained = "
pools:
  - name: a
    backends: [{address: 127.0.0.1:9}]
    prefill: {pool: b}
  - name: b
    backends: [{address: 127.0.0.1:10}]
    prefill: {pool: c}
  - name: c
    backends: [{address: 127.0.0.1:11}]
";
    refused(
        chained,
        "pools[0].prefill.pool",
        "decodes for a prefill pool itself",
    );
}

#[test]
fn the_semantic_cache_needs_an_existing_pool_and_sane_bounds() {
    let cache = |semantic: &str| {
        with(&format!(
            "plugins:\n  cache:\n    enabled: true\n    semantic: {semantic}"
        ))
    };
    let config = ok(&cache("{pool: a}"));
    assert!(config.plugins.names().contains(&"cache"));
    refused(
        &cache("{pool: nope}"),
        "plugins.cache.semantic.pool",
        "no pool is named `nope`",
    );
    refused(
        &cache("{pool: a, max_error_rate: 0}"),
        "plugins.cache.semantic.max_error_rate",
        "more than 0",
    );
    refused(
        &cache("{pool: a, verify_rate: 2}"),
        "plugins.cache.semantic.verify_rate",
        "from 0 to 1",
    );
    refused(
        &cache("{pool: a, max_bytes: 10}"),
        "plugins.cache.semantic.max_bytes",
        "at least 65536",
    );
    ok(&cache("{pool: a, agent_requests: [chat, responses]}"));
    refused(
        &cache("{pool: a, agent_requests: [chats]}"),
        "plugins.cache.semantic.agent_requests[0]",
        "no LLM route is named `chats`",
    );
    // A shared index points at shared entries, on one node.
    refused(
        &cache("{pool: a, index: redis}"),
        "plugins.cache.semantic.index",
        "store: redis with redis.url",
    );
    refused(
        &with(
            "plugins:\n  cache:\n    enabled: true\n    store: redis\n    redis: {cluster_nodes: [\"redis://127.0.0.1:1\"]}\n    semantic: {pool: a, index: redis}",
        ),
        "plugins.cache.semantic.index",
        "does not search across a cluster",
    );
    ok(&with(
        "plugins:\n  cache:\n    enabled: true\n    store: redis\n    redis: {url: \"redis://127.0.0.1:1\"}\n    semantic: {pool: a, index: redis}",
    ));
    refused(
        &cache("{pool: a, threshold: 0.9}"),
        "plugins.cache.semantic.threshold",
        "unknown field `threshold`",
    );
}
