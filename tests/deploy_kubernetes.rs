//! deploy/kubernetes/: every kustomization renders with `kubectl kustomize`, every object is
//! valid (core kinds against the Kubernetes 1.32 schemas of `kubernetes-validate`, strictly;
//! KEDA and prometheus-operator objects against the CRD schemas shipped beside them), the facts
//! Sluice depends on hold (`validate.py`: probes, grace, restricted security context, admin port
//! kept in the cluster and open to Prometheus's pods only, by concrete selectors, the
//! PrometheusRule equal to deploy/prometheus's rules, for the pools that follow EndpointSlices
//! the headless Services and the Role of `vllm-discovery`, bound to the Deployment's
//! ServiceAccount, whose token is mounted, and for the Redis overlay a password on every Redis,
//! filled into Sluice's URLs from the same Secret, and the tenants' keys, limits and budgets in
//! a Redis of their own that evicts nothing), and the rendered ConfigMap's
//! sluice.yaml passes `sluice -t`, with the cluster's service names resolved as the cluster's
//! DNS would (an /etc/hosts of the test's own, in a mount namespace of its own).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sluice_testkit::explain;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn run(command: &mut Command, what: &str) -> Output {
    match command.output() {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("{what} is missing: run scripts/bootstrap --test")
        }
        Err(e) => panic!("{what} could not be run: {e}"),
    }
}

/// `kubectl kustomize deploy/kubernetes/<dir>`, written to a file in `out`.
fn render(dir: &str, out: &Path) -> PathBuf {
    let output = run(
        Command::new("kubectl")
            .arg("kustomize")
            .arg(root().join("deploy/kubernetes").join(dir)),
        "kubectl",
    );
    assert!(
        output.status.success(),
        "{}",
        explain("kubectl kustomize", &output)
    );
    let path = out.join(format!("{}.yaml", dir.replace('/', "-")));
    std::fs::write(&path, &output.stdout).unwrap();
    path
}

/// validate.py on rendered objects: its output, and whether it passed.
fn validate(rendered: &Path, extra: &[&str]) -> (bool, String) {
    let output = run(
        Command::new("python3")
            .arg(root().join("deploy/kubernetes/validate.py"))
            .arg(rendered)
            .args(extra),
        "python3",
    );
    let text = explain("validate.py", &output);
    if String::from_utf8_lossy(&output.stderr).contains("ModuleNotFoundError") {
        panic!("the Python package kubernetes-validate is missing: run scripts/bootstrap --test\n{text}");
    }
    (output.status.success(), text)
}

/// The host names a sluice.yaml connects to: backends' `address: host:port`,
/// `redis://[:password@]host:port[/db]`.
fn host_names(config: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in config.lines() {
        let line = line.trim().trim_start_matches("- ");
        let value = if let Some(rest) = line.strip_prefix("address:") {
            rest.trim()
        } else if let Some(at) = line.find("redis://") {
            let authority = line[at + "redis://".len()..]
                .split('/')
                .next()
                .unwrap_or("");
            authority
                .rsplit_once('@')
                .map_or(authority, |(_, host)| host)
        } else {
            continue;
        };
        let host = value.rsplit_once(':').map_or(value, |(host, _)| host);
        if host.parse::<std::net::IpAddr>().is_err() && !host.is_empty() {
            names.push(host.to_string());
        }
    }
    names
}

/// `sluice -c <config> -t`, with every name the config uses resolving to 127.0.0.1 (pools
/// that follow EndpointSlices name none: `-t` does not reach the cluster).
fn sluice_check(config: &Path, dir: &Path) {
    let text = std::fs::read_to_string(config).unwrap();
    let mut names = host_names(&text);
    // overlays/redis reads its Redis URLs from the environment, as its Deployment composes
    // them from the Secret.
    let redis_urls = [
        (
            "SLUICE_REDIS_CACHE_URL",
            "redis://:test@sluice-redis-cache:6379/0",
        ),
        (
            "SLUICE_REDIS_LIMITS_URL",
            "redis://:test@sluice-redis-limits:6379/0",
        ),
    ];
    names.extend([
        "sluice-redis-cache".to_string(),
        "sluice-redis-limits".to_string(),
    ]);
    let hosts = dir.join("hosts");
    let mut lines = String::from("127.0.0.1 localhost\n");
    if !names.is_empty() {
        lines += &format!("127.0.0.1 {}\n", names.join(" "));
    }
    std::fs::write(&hosts, lines).unwrap();
    let script = format!(
        "mount --bind '{}' /etc/hosts && exec '{}' -c '{}' -t",
        hosts.display(),
        env!("CARGO_BIN_EXE_sluice"),
        config.display()
    );
    let output = run(
        Command::new("unshare")
            .args(["--mount", "sh", "-c", &script])
            .env("VLLM_API_KEY", "test-secret")
            .envs(redis_urls),
        "unshare (util-linux; needs root)",
    );
    assert!(
        output.status.success(),
        "{}",
        explain(
            &format!("sluice -t {} (names {names:?})", config.display()),
            &output
        )
    );
}

#[test]
fn every_overlay_renders_validates_and_its_config_checks() {
    let dir = tempfile::tempdir().unwrap();
    // The vLLM namespace's side of discovery, checked with each overlay's Sluice.
    let vllm = render("vllm-discovery", dir.path());
    for (overlay, kinds) in [
        (
            "base",
            &[
                "Deployment",
                "Service",
                "ConfigMap",
                "PodDisruptionBudget",
                "HorizontalPodAutoscaler",
                "NetworkPolicy",
                "ServiceAccount",
                "Role",
                "RoleBinding",
            ][..],
        ),
        (
            "overlays/production",
            &["ServiceMonitor", "PrometheusRule"][..],
        ),
        (
            "overlays/redis",
            &["StatefulSet", "ServiceMonitor", "PrometheusRule"][..],
        ),
    ] {
        let rendered = render(overlay, dir.path());
        let config = dir
            .path()
            .join(format!("{}.sluice.yaml", overlay.replace('/', "-")));
        let (valid, report) = validate(
            &rendered,
            &[
                vllm.to_str().unwrap(),
                "--config-out",
                config.to_str().unwrap(),
            ],
        );
        assert!(valid, "{overlay}: {report}");
        for kind in kinds {
            assert!(
                report.contains(kind),
                "{overlay} renders no {kind}: {report}"
            );
        }
        sluice_check(&config, dir.path());
        let text = std::fs::read_to_string(&config).unwrap();
        assert!(
            text.matches("service: vllm-").count() == 2 && !text.contains("backends:"),
            "{overlay}: both pools follow their EndpointSlices: {text}"
        );
        if overlay == "overlays/redis" {
            let text = std::fs::read_to_string(&config).unwrap();
            assert!(
                text.contains("store: redis") && text.contains("kind: redis"),
                "{text}"
            );
            // The cache in one Redis, the keys and limits in the other; the URLs, password
            // included, from the environment the Deployment composes from the Secret, never
            // the ConfigMap's.
            assert!(
                text.contains("url: {from_env: SLUICE_REDIS_CACHE_URL}")
                    && text
                        .matches("url: {from_env: SLUICE_REDIS_LIMITS_URL}")
                        .count()
                        == 2
                    && !text.contains("redis://"),
                "{text}"
            );
        }
    }
}

#[test]
fn the_keda_scaler_scales_vllm_on_queue_depth_and_validates_against_its_crd() {
    let dir = tempfile::tempdir().unwrap();
    let rendered = render("vllm-autoscaling", dir.path());
    let (valid, report) = validate(&rendered, &["--schemas-only"]);
    assert!(valid, "{report}");
    let text = std::fs::read_to_string(&rendered).unwrap();
    assert!(text.contains("kind: ScaledObject"), "{text}");
    assert!(text.contains("sum(vllm:num_requests_waiting"), "{text}");
    assert!(text.contains("threshold: \"50\""), "{text}");
    // The target pool scales from zero on the requests Sluice holds for it.
    assert!(text.contains("minReplicaCount: 0"), "{text}");
    assert!(
        text.contains(r#"sum(sluice_pool_waiting_requests{pool="target"})"#),
        "{text}"
    );
}

/// The validator validates: broken objects of each family are refused, naming the field.
#[test]
fn the_validator_refuses_broken_objects() {
    let dir = tempfile::tempdir().unwrap();
    // Production with the vLLM namespace's side, as they are checked together.
    let production = std::fs::read_to_string(render("overlays/production", dir.path())).unwrap()
        + "---\n"
        + &std::fs::read_to_string(render("vllm-discovery", dir.path())).unwrap();
    let redis = std::fs::read_to_string(render("overlays/redis", dir.path())).unwrap()
        + "---\n"
        + &std::fs::read_to_string(render("vllm-discovery", dir.path())).unwrap();
    let scaler = std::fs::read_to_string(render("vllm-autoscaling", dir.path())).unwrap();
    // The admin port's peer: Prometheus's namespace and pods, by label.
    let prometheus_peer = "    - namespaceSelector:\n        matchLabels:\n          \
        kubernetes.io/metadata.name: monitoring\n      podSelector:\n        matchExpressions:\n        \
        - key: app.kubernetes.io/name\n          operator: In\n          values:\n          - prometheus\n";
    let cases = [
        // A core kind with a wrong type, and with an unknown field.
        (
            "replicas: 3",
            "replicas: three",
            &production,
            "spec.replicas",
        ),
        (
            "  revisionHistoryLimit: 5",
            "  revisionHistoryLimt: 5",
            &production,
            "revisionHistoryLimt",
        ),
        // A CRD kind with an unknown field, and with a wrong type.
        (
            "    scrapeTimeout: 5s",
            "    scrapeTimeot: 5s",
            &production,
            "scrapeTimeot",
        ),
        ("threshold: \"50\"", "threshold: 50", &scaler, "threshold"),
        // Sluice's facts: the grace period, the admin port's policy, the probes.
        (
            "terminationGracePeriodSeconds: 45",
            "terminationGracePeriodSeconds: 30",
            &production,
            "terminationGracePeriodSeconds",
        ),
        (
            "path: /readyz",
            "path: /healthz",
            &production,
            "readinessProbe",
        ),
        (
            "readOnlyRootFilesystem: true",
            "readOnlyRootFilesystem: false",
            &production,
            "readOnlyRootFilesystem",
        ),
        // Discovery: the Role, the token, the ServiceAccount, the Service's port name.
        ("  - watch\n", "", &production, "list and watch"),
        (
            "automountServiceAccountToken: true",
            "automountServiceAccountToken: false",
            &production,
            "automountServiceAccountToken",
        ),
        (
            "serviceAccountName: sluice",
            "serviceAccountName: sluice-gateway",
            &production,
            "serviceAccountName",
        ),
        (
            "  - name: http\n    port: 8000",
            "  - name: web\n    port: 8000",
            &production,
            "no port named http",
        ),
        (
            "record: sluice:pool_requests:rate5m",
            "record: sluice:pool_requests:rate1m",
            &production,
            "PrometheusRule differs",
        ),
        // The admin port (N14): every namespace's pods, as it once was; every pod of
        // Prometheus's namespace; Sluice's own labels, as kustomize's `labels` would write them.
        (
            prometheus_peer,
            "    - namespaceSelector: {}\n",
            &production,
            "namespaceSelector {} (every namespace)",
        ),
        (
            "      podSelector:\n        matchExpressions:\n        - key: app.kubernetes.io/name\n          \
             operator: In\n          values:\n          - prometheus\n",
            "",
            &production,
            "no concrete podSelector",
        ),
        (
            "        matchExpressions:\n        - key: app.kubernetes.io/name\n          operator: In\n          \
             values:\n          - prometheus\n",
            "        matchLabels:\n          app.kubernetes.io/name: sluice\n          \
             app.kubernetes.io/part-of: llm-gateway\n",
            &production,
            "selects Sluice's own labels",
        ),
        // Redis requires a password (the cache's instance, first rendered), from a Secret.
        (
            "        - --requirepass\n        - $(REDIS_PASSWORD)\n",
            "",
            &redis,
            "sluice-redis-cache requires no password",
        ),
        (
            "        - --requirepass\n        - $(REDIS_PASSWORD)\n",
            "        - --requirepass\n        - hunter2\n",
            &redis,
            "--requirepass is written in the manifest",
        ),
        // Sluice uses it: in every URL, never written in the ConfigMap, read from the
        // environment, composed from the Secret Redis requires.
        (
            "url: {from_env: SLUICE_REDIS_LIMITS_URL}",
            "url: redis://sluice-redis-limits:6379/0",
            &redis,
            "keys_from_redis.url: redis://sluice-redis-limits:6379/0 has no password",
        ),
        (
            "url: {from_env: SLUICE_REDIS_CACHE_URL}",
            "url: redis://:hunter2@sluice-redis-cache:6379/0",
            &redis,
            "password is written in the ConfigMap",
        ),
        (
            "        - name: SLUICE_REDIS_CACHE_URL\n",
            "        - name: SLUICE_REDIS_CACHE\n",
            &redis,
            "from_env SLUICE_REDIS_CACHE_URL, which the Sluice container does not define",
        ),
        (
            "value: redis://:$(REDIS_PASSWORD)@sluice-redis-cache",
            "value: redis://:hunter2@sluice-redis-cache",
            &redis,
            "must carry the password as $(VAR)",
        ),
        (
            "              name: sluice-redis\n        - name: SLUICE_REDIS_CACHE_URL\n",
            "              name: sluice-redis-auth\n        - name: SLUICE_REDIS_CACHE_URL\n",
            &redis,
            "comes from Secret sluice-redis-auth/password",
        ),
        // Cache writes never evict the tenants' keys, limits or budgets: not by an allkeys-*
        // or volatile-* policy of theirs, not by sharing the cache's Redis (another DB number
        // shares its maxmemory).
        (
            "        - noeviction\n",
            "        - allkeys-lru\n",
            &redis,
            "maxmemory-policy allkeys-lru, which evicts them",
        ),
        (
            "        - noeviction\n",
            "        - volatile-lru\n",
            &redis,
            "maxmemory-policy volatile-lru, which evicts them",
        ),
        (
            "@sluice-redis-cache:6379/0",
            "@sluice-redis-limits:6379/1",
            &redis,
            "share Redis Service sluice-redis-limits",
        ),
    ];
    for (from, to, source, named) in cases {
        assert!(
            source.contains(from),
            "the rendered objects have no `{from}`"
        );
        let broken = dir.path().join("broken.yaml");
        std::fs::write(&broken, source.replacen(from, to, 1)).unwrap();
        let extra: &[&str] = if source == &scaler {
            &["--schemas-only"]
        } else {
            &[]
        };
        let (valid, report) = validate(&broken, extra);
        assert!(!valid, "`{from}` → `{to}` was accepted: {report}");
        assert!(
            report.contains(named),
            "`{from}` → `{to}`: {named} not named: {report}"
        );
    }
}
