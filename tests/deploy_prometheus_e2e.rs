//! The shipped Prometheus rules (`deploy/prometheus/sluice-rules.yaml`) and Grafana dashboard
//! (`deploy/grafana/sluice.json`) against a real Prometheus (Debian's `prometheus`) scraping a
//! real Sluice in front of simulated vLLM backends, with traffic of every kind running:
//!
//! - `SluiceKvCacheHigh` goes pending, then fires for the pool pushed over 90 % KV usage (and
//!   not for the other), and clears once the usage is back down;
//! - every expression of the dashboard (panels' targets, the alert annotation, the template
//!   variables' selectors) and of the rules evaluates without error, the dashboard's and the
//!   recording rules' return data, and the key panels return positive values;
//! - every metric name those expressions use is one Prometheus scraped from Sluice (or a
//!   recording rule's, or one Sluice exports only with a Redis store, checked in its sources).
//!
//! The shipped alerts wait minutes (`for:`) and the recording rules run every 30 s: the test
//! loads a copy of the shipped rules made by parsing the file and changing only the `for:`
//! durations (to 2 s) and the groups' `interval` (to 1 s), never a second hand-kept copy. The
//! expressions themselves are the shipped ones; rate windows need no change (with a 1 s scrape
//! a 5 m window already holds enough samples).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DRAFT: &str = "meta-llama/Llama-3.2-1B-Instruct";
const TARGET: &str = "meta-llama/Llama-3.1-70B-Instruct";
/// `sha256` of `sk-alpha-demo`, the demo's rate-limited tenant (conf/examples/tenants.yaml).
const ALPHA_KEY_HASH: &str =
    "sha256:684455aba2f4e49856693f862d62ed1756ea87a33e1d4340560fe704c7eee471";

/// How long any one wait on Prometheus may take (scrapes and evaluations every second).
const WAIT: Duration = Duration::from_secs(30);
/// How long a panel that must be positive may take to become so, after the KV spike.
const POSITIVE_WAIT: Duration = Duration::from_secs(10);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A running `prometheus`, killed on drop; its log printed when the test fails.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
    /// Config, log and TSDB; removed on drop.
    dir: Option<tempfile::TempDir>,
}

impl Prometheus {
    /// Starts `prometheus` scraping Sluice's admin listener `admin` every second, with the rule
    /// file `rules`, on a free port; returns once it is ready.
    async fn start(admin: std::net::SocketAddr, rules: &Path) -> Prometheus {
        let mut dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        // JSON is YAML.
        let text = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules],
            "scrape_configs": [{
                "job_name": "sluice",
                "static_configs": [{"targets": [admin.to_string()]}],
            }],
        });
        std::fs::write(&config, text.to_string()).expect("write prometheus.yml");
        let log = dir.path().join("prometheus.log");
        for _ in 0..5 {
            let port = free_port();
            let stderr = std::fs::File::create(&log).expect("log file");
            let child = match Command::new("prometheus")
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
            {
                Ok(child) => child,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                    "prometheus is missing (Debian's `prometheus` package): run scripts/bootstrap --test"
                ),
                Err(e) => panic!("prometheus could not be run: {e}"),
            };
            let mut prometheus = Prometheus {
                child,
                url: format!("http://127.0.0.1:{port}"),
                log: log.clone(),
                dir: Some(dir),
            };
            if prometheus.wait_ready(&config).await {
                return prometheus;
            }
            // Its port was taken before it bound it: again, on another.
            let _ = prometheus.child.kill();
            let _ = prometheus.child.wait();
            dir = prometheus.dir.take().expect("the temp dir");
        }
        panic!("prometheus found its port taken 5 times");
    }

    /// `true` once `/-/ready` answers 200 and the flags there name `config` (this process, not
    /// a stranger that took the port); `false` when the port was taken. Panics when Prometheus
    /// exits otherwise or is not ready in time.
    async fn wait_ready(&mut self, config: &Path) -> bool {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                if self.logs().contains("address already in use") {
                    return false;
                }
                panic!("prometheus exited ({status}):\n{}", self.logs());
            }
            if let Ok(r) = client().get(format!("{}/-/ready", self.url)).send().await {
                if r.status().is_success() {
                    let flags: Value = client()
                        .get(format!("{}/api/v1/status/flags", self.url))
                        .send()
                        .await
                        .expect("the flags")
                        .json()
                        .await
                        .unwrap_or_default();
                    return flags["data"]["config.file"] == config.display().to_string();
                }
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET `path` of the HTTP API with `query` parameters; its `data`, after checking that
    /// the status is `success` (panics with Prometheus' error otherwise).
    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let v: Value = client()
            .get(format!("{}{path}", self.url))
            .query(query)
            .send()
            .await
            .expect("prometheus answers")
            .json()
            .await
            .expect("a JSON answer");
        assert_eq!(v["status"], "success", "{path} {query:?}: {v}");
        v["data"].clone()
    }

    /// The result vector of an instant query (panics when the expression is an error).
    async fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api("/api/v1/query", &[("query", expr)]).await;
        match data["resultType"].as_str() {
            Some("vector") | Some("matrix") => data["result"].as_array().cloned().unwrap(),
            // A scalar or string is one value.
            _ => vec![data["result"].clone()],
        }
    }

    /// The active alerts named `name` (pending or firing), as /api/v1/alerts lists them.
    async fn alerts(&self, name: &str) -> Vec<Value> {
        self.api("/api/v1/alerts", &[]).await["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["labels"]["alertname"] == name)
            .cloned()
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let _ = writeln!(std::io::stderr(), "--- prometheus log ---\n{}", self.logs());
        }
    }
}

/// The shipped rules with the `for:` of every alert set to 2 s and every group evaluated
/// every second, written to `dir`; the rest (expressions, labels, annotations) untouched.
fn fast_rules(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(root().join("deploy/prometheus/sluice-rules.yaml"))
        .expect("read the shipped rules");
    let mut rules: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("rules YAML");
    let mut alerts = 0;
    for group in rules["groups"]
        .as_sequence_mut()
        .expect("groups")
        .iter_mut()
    {
        let group = group.as_mapping_mut().expect("a group");
        if group.contains_key("interval") {
            group.insert("interval".into(), "1s".into());
        }
        for rule in group
            .get_mut("rules")
            .and_then(|r| r.as_sequence_mut())
            .expect("rules")
        {
            let rule = rule.as_mapping_mut().expect("a rule");
            if rule.contains_key("alert") {
                alerts += 1;
                rule.insert("for".into(), "2s".into());
            }
        }
    }
    assert!(alerts > 0, "no alerts in the shipped rules");
    let path = dir.join("sluice-rules.fast.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&rules).expect("YAML")).expect("write");
    path
}

/// The shipped rules: (`record` or `alert` name, expression).
fn shipped_rules() -> Vec<(String, String, bool)> {
    let text = std::fs::read_to_string(root().join("deploy/prometheus/sluice-rules.yaml"))
        .expect("read the shipped rules");
    let rules: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("rules YAML");
    let mut out = Vec::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let expr = rule["expr"].as_str().expect("expr").to_string();
            if let Some(record) = rule["record"].as_str() {
                out.push((record.to_string(), expr, true));
            } else {
                let alert = rule["alert"].as_str().expect("record or alert");
                out.push((alert.to_string(), expr, false));
            }
        }
    }
    out
}

/// One query of the dashboard: where it is (panel title and refId, or what else), and its
/// expression with Grafana's variables still in.
struct DashboardQuery {
    place: String,
    panel: String,
    ref_id: String,
    expr: String,
}

/// Every PromQL expression of the dashboard: panels' targets (rows' nested panels too), the
/// annotations', and the metric selectors of the template variables' `label_values(...)`.
fn dashboard_queries() -> Vec<DashboardQuery> {
    let text = std::fs::read_to_string(root().join("deploy/grafana/sluice.json"))
        .expect("read the dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut out = Vec::new();
    let mut panels: Vec<Value> = dashboard["panels"].as_array().expect("panels").clone();
    while let Some(panel) = panels.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            panels.extend(nested.iter().cloned());
        }
        let title = panel["title"].as_str().unwrap_or_default().to_string();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let ref_id = target["refId"].as_str().unwrap_or_default().to_string();
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title} {ref_id}: no expr"));
            out.push(DashboardQuery {
                place: format!("panel \"{title}\" {ref_id}"),
                panel: title.clone(),
                ref_id,
                expr: expr.to_string(),
            });
        }
    }
    for annotation in dashboard["annotations"]["list"].as_array().expect("list") {
        if let Some(expr) = annotation["expr"].as_str() {
            out.push(DashboardQuery {
                place: format!("annotation {}", annotation["name"]),
                panel: String::new(),
                ref_id: String::new(),
                expr: expr.to_string(),
            });
        }
    }
    for variable in dashboard["templating"]["list"].as_array().expect("list") {
        if variable["type"] != "query" {
            continue;
        }
        let definition = variable["definition"].as_str().expect("definition");
        let inner = definition
            .strip_prefix("label_values(")
            .and_then(|d| d.rsplit_once(','))
            .map(|(selector, _label)| selector.trim().to_string())
            .unwrap_or_else(|| panic!("variable query {definition}: not label_values(m, l)"));
        out.push(DashboardQuery {
            place: format!("variable {}", variable["name"]),
            panel: String::new(),
            ref_id: String::new(),
            expr: inner,
        });
    }
    out.sort_by(|a, b| a.place.cmp(&b.place));
    out
}

/// `expr` with Grafana's variables replaced: `vars` for the dashboard's own, windows that
/// hold enough 1 s samples for Grafana's interval variables.
fn substitute(expr: &str, vars: &BTreeMap<&str, String>) -> String {
    let mut out = expr
        .replace("$__rate_interval", "20s")
        .replace("$__interval", "5s")
        .replace("$__range", "5m");
    for (name, value) in vars {
        out = out
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    assert!(!out.contains('$'), "a variable left in {out}");
    out
}

/// The metric names an expression selects, by a small PromQL tokenizer: strings, label
/// matchers, ranges and grouping label lists removed; of the identifiers left, those that are
/// not functions (followed by `(`), keywords or numbers.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Strings, {…} and […] out.
    let mut plain = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                let mut escaped = false;
                for d in chars.by_ref() {
                    if !escaped && d == c {
                        break;
                    }
                    escaped = !escaped && d == '\\';
                }
                plain.push(' ');
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                for d in chars.by_ref() {
                    if d == close {
                        break;
                    }
                }
                plain.push(' ');
            }
            c => plain.push(c),
        }
    }
    // Identifiers, with the character after each (past spaces).
    let bytes: Vec<char> = plain.chars().collect();
    let mut tokens: Vec<(String, Option<char>)> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_digit() || (c == '.' && i + 1 < bytes.len() && bytes[i + 1].is_ascii_digit())
        {
            // A number or a duration (1e3, 0.9, 5m): never a name.
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_' || bytes[i] == ':')
            {
                i += 1;
            }
            let word: String = bytes[start..i].iter().collect();
            let next = bytes[i..].iter().find(|c| !c.is_whitespace()).copied();
            tokens.push((word, next));
        } else {
            i += 1;
        }
    }
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: [&str; 8] = [
        "and", "or", "unless", "bool", "offset", "inf", "nan", "atan2",
    ];
    // Aggregations may be followed by their grouping (`sum by (pool) (…)`), not by `(`.
    const AGGREGATIONS: [&str; 12] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let mut names = BTreeSet::new();
    let mut skip_group = false;
    for (word, next) in tokens {
        if GROUPING.contains(&word.to_ascii_lowercase().as_str()) {
            // Its label list follows in parentheses: those words are labels.
            skip_group = next == Some('(');
            continue;
        }
        if skip_group {
            // Labels, until the one the list's `)` follows.
            if next == Some(')') {
                skip_group = false;
            }
            continue;
        }
        let lower = word.to_ascii_lowercase();
        if next == Some('(')
            || KEYWORDS.contains(&lower.as_str())
            || AGGREGATIONS.contains(&lower.as_str())
        {
            continue;
        }
        names.insert(word);
    }
    names
}

/// Sends one of each kind of request, `i` making the uncacheable ones unique.
async fn traffic_round(proxy: &Proxy, i: u64) {
    // A cache miss, then hits on one question asked again and again.
    proxy
        .ask(&chat(DRAFT, &format!("question {i}"), false), &[])
        .await;
    proxy
        .ask(&chat(DRAFT, "the same question", false), &[])
        .await;
    // A stream, not cacheable (temperature 1): time to first token on the target pool.
    let mut stream = chat(TARGET, &format!("a story {i}"), true);
    stream["temperature"] = json!(1.0);
    proxy.ask(&stream, &[]).await;
    // The speculative selector: a draft answer, and one forced to the target.
    proxy
        .ask(&chat("llama", &format!("hello {i}"), false), &[])
        .await;
    proxy
        .ask(
            &chat("llama", &format!("hello target {i}"), false),
            &[("x-sluice-tier", "target")],
        )
        .await;
    // Errors: a bad request, and a rate-limited tenant (alpha: 5 requests a minute).
    proxy
        .ask(&json!({"model": DRAFT, "messages": []}), &[])
        .await;
    proxy
        .ask(
            &chat(DRAFT, &format!("alpha {i}"), false),
            &[("authorization", "Bearer sk-alpha-demo")],
        )
        .await;
}

/// Whether a query result holds a finite value over 0.
fn has_positive(result: &[Value]) -> bool {
    result.iter().any(|r| {
        let value = if r["value"].is_array() {
            &r["value"][1]
        } else {
            &r[1]
        };
        value
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| v.is_finite() && v > 0.0)
    })
}

/// Panels whose every target must hold a positive value with this traffic, but for the
/// (panel, refId) pairs of [`NOT_POSITIVE`].
const POSITIVE_PANELS: &[&str] = &[
    "Requests/s",
    "p99 latency (worst pool)",
    "Cache hit ratio",
    "Speculative acceptance",
    "Healthy backends",
    "Requests/s by pool",
    "Request latency by pool (p50/p95/p99)",
    "Time to first token, streams (p50/p95/p99)",
    "Responses/s by status",
    "LLM latency p99 by model, cache hits apart",
    "Tokens/s by pool",
    "Cache lookups/s by result",
    "Escalations/s by reason",
    "Cache writes/s by outcome",
    "Cost per hour by pool",
    "Saving against all-target, per hour",
    "Cost and saving over the time range",
    "Rejections/s by reason",
    "Upstream attempts/s by outcome",
    "Requests/s by tenant",
    "Tokens/s by tenant",
    "Cost per hour by tenant",
    "Rejections/s by tenant and reason",
    "Healthy backends per pool",
    "Backend state",
    "Ejections and failed health checks",
];

/// Targets of [`POSITIVE_PANELS`] that are rightly zero here: no backend was ejected.
const NOT_POSITIVE: &[(&str, &str)] = &[("Ejections and failed health checks", "A")];

/// Metric names the dashboard or rules may use that this test's Sluice does not export: their
/// series appear only with a Redis store. Each must be registered in the file named.
const REDIS_ONLY: &[(&str, &str)] = &[
    (
        "sluice_cache_store_errors_total",
        "plugins/cache/src/store/redis.rs",
    ),
    (
        "sluice_tenant_limit_store_errors_total",
        "plugins/tenants/src/limits/metrics.rs",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_rules_and_dashboard_work_against_a_real_prometheus_scraping_sluice() {
    // Each serves its own name and the shared one, as vLLM's --served-model-name would.
    let sim = |names: [&str; 2]| {
        vllm_sim::start(
            vllm_sim::SimConfig::default()
                .with_served_model_names(names.map(String::from).to_vec()),
        )
    };
    let draft = sim([DRAFT, "llama"]).await.expect("draft simulator");
    let target = sim([TARGET, "llama"]).await.expect("target simulator");
    let proxy = Arc::new(
        Proxy::start(json!({
            "pools": [
                pool("draft", &[DRAFT, "llama"], &[draft.addr()])
                    .with_fast_health_checks()
                    .with("price_per_million_tokens", 0.1),
                pool("target", &[TARGET, "llama"], &[target.addr()])
                    .with_fast_health_checks()
                    .with("price_per_million_tokens", 0.9),
            ],
            "plugins": {
                "request_id": {"enabled": true},
                "tenants": {
                    "enabled": true,
                    "defaults": {"may_force_target": true},
                    "tenants": {
                        "alpha": {
                            "keys": [ALPHA_KEY_HASH],
                            "limits": {"requests_per_minute": 5},
                        },
                    },
                    "anonymous": {"limits": {"requests_per_minute": 100_000}},
                },
                // Requests without a key share the cache, as in the demo.
                "cache": {"enabled": true, "store": "memory", "tenant": {"anonymous": "share"}},
                "speculative": {
                    "enabled": true,
                    "models": [{"model": "llama", "drafts": [{"pool": "draft"}], "target": "target"}],
                },
                "kv_breaker": {"enabled": true},
            },
        }))
        .await,
    );

    let dir = tempfile::tempdir().expect("temp dir");
    let rules = fast_rules(dir.path());
    let prometheus = Prometheus::start(proxy.admin, &rules).await;
    assert!(
        wait_for(WAIT, || async {
            !prometheus
                .query(r#"up{job="sluice"} == 1"#)
                .await
                .is_empty()
        })
        .await
        .is_some(),
        "prometheus never scraped sluice"
    );

    // Traffic of every kind, all along, so that rates are positive wherever they are read.
    let running = Arc::new(AtomicBool::new(true));
    let traffic = tokio::spawn({
        let (proxy, running) = (proxy.clone(), running.clone());
        async move {
            let mut i = 0;
            while running.load(Ordering::Relaxed) {
                traffic_round(&proxy, i).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            i
        }
    });

    // Before: the pools' KV usage is recorded, low, and the alert is quiet.
    let kv = r#"sluice:pool_kv_cache_usage_ratio:avg{pool="draft"}"#;
    assert!(
        wait_for(WAIT, || async { !prometheus.query(kv).await.is_empty() })
            .await
            .is_some(),
        "the recording rule {kv} was never evaluated"
    );
    assert!(prometheus.alerts("SluiceKvCacheHigh").await.is_empty());

    // The draft pool's only backend at 97 % KV usage: pending, then firing, for it alone.
    let kv_url = format!("{}/sim/kv", draft.url());
    let r = client()
        .post(&kv_url)
        .json(&json!({"phantom_usage": 0.97}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "POST /sim/kv: {}", r.status());
    let mut states = Vec::new();
    let started = Instant::now();
    let firing = loop {
        let alerts = prometheus.alerts("SluiceKvCacheHigh").await;
        for a in &alerts {
            assert_eq!(a["labels"]["pool"], "draft", "only draft is full: {a}");
        }
        if let Some(a) = alerts.first() {
            let state = a["state"].as_str().unwrap().to_string();
            if states.last() != Some(&state) {
                states.push(state.clone());
            }
            if state == "firing" {
                break a.clone();
            }
        }
        assert!(
            started.elapsed() < WAIT,
            "SluiceKvCacheHigh did not fire for pool draft at 97 % (states seen: {states:?}); \
             the recorded usage: {:?}",
            prometheus.query(kv).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(firing["labels"]["severity"], "warning");
    let summary = firing["annotations"]["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("Pool draft: KV cache 97"),
        "summary: {summary}"
    );
    println!("SluiceKvCacheHigh states seen: {states:?}");

    // Back down: the alert clears.
    let r = client().delete(&kv_url).send().await.unwrap();
    assert!(r.status().is_success(), "DELETE /sim/kv: {}", r.status());
    assert!(
        wait_for(WAIT, || async {
            prometheus.alerts("SluiceKvCacheHigh").await.is_empty()
        })
        .await
        .is_some(),
        "SluiceKvCacheHigh still active after the KV usage went down: {:?}",
        prometheus.alerts("SluiceKvCacheHigh").await
    );

    // Every expression evaluates; the dashboard's and the recording rules' return data.
    let queries = dashboard_queries();
    assert!(queries.len() > 30, "{} dashboard queries", queries.len());
    let every: BTreeMap<&str, String> = [
        ("pool", ".*".to_string()),
        ("backend", ".*".to_string()),
        ("tenant", ".*".to_string()),
    ]
    .into();
    let one: BTreeMap<&str, String> = [
        ("pool", "draft".to_string()),
        ("backend", draft.addr().to_string()),
        ("tenant", "anonymous".to_string()),
    ]
    .into();
    let mut failures = Vec::new();
    for q in &queries {
        // The annotation lists firing alerts: none is firing now, so it may be empty.
        let must_have_data = !q.place.starts_with("annotation");
        for vars in [&every, &one] {
            let expr = substitute(&q.expr, vars);
            let positive = vars == &every
                && POSITIVE_PANELS.contains(&q.panel.as_str())
                && !NOT_POSITIVE.contains(&(q.panel.as_str(), q.ref_id.as_str()));
            if positive {
                // A rate is positive once two scrapes after an increase are in: the
                // speculative selector, for one, accepts drafts again only once the draft
                // pool's KV scrape has come down.
                wait_for(POSITIVE_WAIT, || async {
                    has_positive(&prometheus.query(&expr).await)
                })
                .await;
            }
            let result = prometheus.query(&expr).await;
            if must_have_data && result.is_empty() {
                failures.push(format!("{}: no data for {expr}", q.place));
            }
            if positive && !has_positive(&result) {
                failures.push(format!(
                    "{}: no positive value for {expr}: {result:?}",
                    q.place
                ));
            }
        }
    }
    let rules = shipped_rules();
    for (name, expr, record) in &rules {
        let result = prometheus.query(expr).await;
        if *record && result.is_empty() {
            failures.push(format!("recording rule {name}: no data for {expr}"));
        }
    }

    // Every metric name used is one Prometheus has, from Sluice or the recording rules.
    let scraped: BTreeSet<String> = prometheus
        .api("/api/v1/label/__name__/values", &[])
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    for (name, file) in REDIS_ONLY {
        let source = std::fs::read_to_string(root().join(file)).unwrap();
        assert!(
            source.contains(&format!("\"{name}\"")),
            "{name} is not registered in {file}"
        );
    }
    let mut known: BTreeSet<String> = scraped.clone();
    known.extend(rules.iter().filter(|r| r.2).map(|r| r.0.clone()));
    known.extend(REDIS_ONLY.iter().map(|(n, _)| n.to_string()));
    // Prometheus' own series of its alerts.
    known.insert("ALERTS".into());
    let used = queries
        .iter()
        .map(|q| (q.place.clone(), q.expr.clone()))
        .chain(rules.iter().map(|r| (format!("rule {}", r.0), r.1.clone())));
    let mut names_used = BTreeSet::new();
    for (place, expr) in used {
        let names = metric_names(&expr);
        if names.is_empty() {
            failures.push(format!("{place}: no metric name found in {expr}"));
        }
        for name in names {
            if !known.contains(&name) {
                failures.push(format!("{place}: unknown metric {name} in {expr}"));
            }
            names_used.insert(name);
        }
    }

    running.store(false, Ordering::Relaxed);
    let rounds = traffic.await.unwrap();
    assert!(
        failures.is_empty(),
        "{} problems:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!(
        "{} dashboard queries and {} rules checked; {} metric names used, {} scraped; {rounds} \
         rounds of traffic",
        queries.len(),
        rules.len(),
        names_used.len(),
        scraped.len()
    );
}

#[test]
fn the_tokenizer_finds_metric_names_and_nothing_else() {
    let names = |e| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            r#"histogram_quantile(0.99, sum by (pool, le) (rate(router_request_duration_seconds_bucket{pool=~"$pool"}[5m])))"#
        ),
        ["router_request_duration_seconds_bucket"]
    );
    assert_eq!(
        names(
            "sum by (reason) (rate(router_rejections_total[5m])) / ignoring(reason) group_left sum(rate(sluice_requests_total[5m]))"
        ),
        ["router_rejections_total", "sluice_requests_total"]
    );
    assert_eq!(
        names("sluice:pool_request_duration_seconds:p99_5m > on(pool) sluice:pool_request_duration_seconds:slo"),
        [
            "sluice:pool_request_duration_seconds:p99_5m",
            "sluice:pool_request_duration_seconds:slo"
        ]
    );
    assert_eq!(
        names("3600 * sluice:pool_cost_dollars:rate1h > 0.5 and sluice_x offset 5m"),
        ["sluice:pool_cost_dollars:rate1h", "sluice_x"]
    );
    assert_eq!(
        names("10 + 0 * sum by (pool) (rate(no_such_metric_total[5m]))"),
        ["no_such_metric_total"]
    );
}
