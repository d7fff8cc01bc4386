//! Discovery end to end, against real servers: a real DNS server (dnsmasq) whose records
//! change under steady load, simulated vLLM backends on several loopback addresses sharing
//! one port (as pods behind a headless Service), and a DNS server that stops or lies.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::dns::{sims_on_loopbacks_with, BadDns, DnsServer, Misbehaviour};
use sluice_testkit::*;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vllm_sim::{Latency, SimConfig};

const MODEL: &str = "test-model";
const NAME: &str = "vllm.fleet.test";

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// A pool that follows `NAME` on `dns`, checked every 100 ms.
fn dns_pool(dns: SocketAddr, port: u16, extra: Value) -> Pool {
    let mut source = json!({"name": NAME, "port": port, "resolver": dns.to_string(),
                            "min_refresh": "1s", "max_refresh": "2s"});
    if let (Some(source), Some(extra)) = (source.as_object_mut(), extra.as_object()) {
        source.extend(extra.clone());
    }
    pool("fleet", &[MODEL], &[])
        .with_fast_health_checks()
        .with("discovery", json!({"dns": source}))
}

/// Streams that take about `tokens × 10 ms`: long enough to be running when the fleet
/// changes.
fn slow_streams(count: usize, tokens: u32) -> Vec<SimConfig> {
    let config = SimConfig::default()
        .with_model(MODEL)
        .with_latency(Latency::new(
            Duration::ZERO,
            Duration::ZERO,
            Duration::from_millis(10),
        ))
        .with_answer_tokens(tokens, tokens);
    vec![config; count]
}

/// Requests sent one after another by `workers` clients until stopped: every answer that is
/// not a whole 200 is kept, with what it said.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(proxy: &Proxy, workers: usize) -> Load {
        let (stop, sent) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let failures = Arc::new(Mutex::new(Vec::new()));
        let url = proxy.url("/v1/chat/completions");
        let tasks = (0..workers)
            .map(|w| {
                let (stop, sent, failures, url) =
                    (stop.clone(), sent.clone(), failures.clone(), url.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(Relaxed) {
                        n += 1;
                        let body = chat(MODEL, &format!("worker {w} request {n}"), true);
                        let answer = ask_url(&url, &body, &[]).await;
                        sent.fetch_add(1, Relaxed);
                        let whole = answer.body.trim_end().ends_with("data: [DONE]")
                            && !answer.body.contains("\"error\"");
                        if answer.status != 200 || !whole {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("{} {}", answer.status, answer.body));
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            sent,
            failures,
            tasks,
        }
    }

    fn sent(&self) -> u64 {
        self.sent.load(Relaxed)
    }

    /// Stops the clients, waits for their last answers, and returns the failures.
    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.sent.load(Relaxed), failures)
    }
}

fn chat_calls(sim: &vllm_sim::Sim) -> u64 {
    sim.stats()
        .requests_by_path
        .get("/v1/chat/completions")
        .copied()
        .unwrap_or(0)
}

/// The pool's backends as `/status` lists them: address → membership.
async fn members(proxy: &Proxy) -> Vec<(String, String)> {
    let status = proxy.status().await;
    let pool = status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "fleet")
        .cloned()
        .unwrap();
    let mut out: Vec<(String, String)> = pool["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["address"].as_str().unwrap().to_string(),
                b["membership"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Waits (up to 15 s) until the pool's backends are `want` (address, membership).
async fn until_members(proxy: &Proxy, want: &[(String, &str)]) {
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, s)| (a.clone(), s.to_string()))
        .collect();
    let seen = wait_for(Duration::from_secs(15), || async {
        members(proxy).await == want
    })
    .await;
    assert!(
        seen.is_some(),
        "wanted {want:?}, have {:?}\n{}",
        members(proxy).await,
        proxy.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_named_in_dns_is_followed_under_load_without_a_failed_request() {
    let ttl = Duration::from_secs(1);
    let dns = DnsServer::start(ttl).await;
    let (port, sims) = sims_on_loopbacks_with(slow_streams(3, 30)).await;
    dns.set(NAME, &[ip(2), ip(3)]).await;
    let proxy = Proxy::start(json!({"pools": [dns_pool(dns.addr(), port, json!({}))]})).await;
    let both = wait_for(Duration::from_secs(10), || async {
        members(&proxy).await.len() == 2
    })
    .await;
    assert!(both.is_some(), "{}", proxy.status().await);
    assert_eq!(
        proxy.status().await["pools"][0]["source"],
        format!("dns {NAME}:{port}")
    );

    let load = Load::start(&proxy, 4);
    wait_for(Duration::from_secs(10), || async { load.sent() >= 8 }).await;

    // A record added: its backend gets requests within two TTLs.
    let before = chat_calls(&sims[2]);
    dns.set(NAME, &[ip(2), ip(3), ip(4)]).await;
    let joined = wait_for(2 * ttl + Duration::from_millis(500), || async {
        chat_calls(&sims[2]) > before
    })
    .await;
    assert!(
        joined.is_some(),
        "127.0.0.4 got no request within 2 × TTL: {}",
        proxy.status().await
    );

    // A record removed: its backend drains (its running streams end whole), then leaves;
    // only then is it killed.
    let gone = format!("127.0.0.2:{port}");
    dns.set(NAME, &[ip(3), ip(4)]).await;
    let left = wait_for(Duration::from_secs(10), || async {
        !members(&proxy).await.iter().any(|(a, _)| *a == gone)
    })
    .await;
    assert!(left.is_some(), "{}", proxy.status().await);
    // Its leaving is said, as every change is.
    let said = wait_for(Duration::from_secs(5), || async {
        proxy
            .logs()
            .lines()
            .any(|l| l.contains(&format!("left=[\"{gone}\"]")))
    })
    .await;
    assert!(said.is_some(), "{}", proxy.logs());
    let served_before_kill = chat_calls(&sims[0]);
    sims[0].shutdown();

    // The DNS server stopped: the pool keeps what it knew, and counts the errors.
    let mut dns = dns;
    let before = discovery_errors(&proxy, "dns").await;
    dns.stop().await;
    let counted = wait_for(Duration::from_secs(10), || async {
        discovery_errors(&proxy, "dns").await > before
    })
    .await;
    assert!(counted.is_some(), "{}", proxy.metrics().await);
    let sent = load.sent();
    wait_for(Duration::from_secs(10), || async {
        load.sent() >= sent + 8
    })
    .await;
    assert_eq!(
        members(&proxy).await,
        vec![
            (format!("127.0.0.3:{port}"), "ready".to_string()),
            (format!("127.0.0.4:{port}"), "ready".to_string()),
        ]
    );

    let (sent, failures) = load.finish().await;
    assert!(sent >= 24, "only {sent} requests were sent");
    assert!(
        failures.is_empty(),
        "{} failed: {failures:#?}",
        failures.len()
    );
    assert!(
        served_before_kill > 0,
        "the removed backend served nothing before"
    );
    assert!(
        proxy.logs().contains("pool backends changed"),
        "{}",
        proxy.logs()
    );
    let metrics = proxy.metrics().await;
    assert!(
        metric_value(&metrics, r#"sluice_discovery_updates_total{pool="fleet"}"#).unwrap() >= 3.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(
            &metrics,
            r#"sluice_discovery_endpoints{pool="fleet",state="ready"}"#
        ),
        Some(2.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_answer_drains_the_pool_or_keeps_it_as_on_empty_says() {
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, _sims) = sims_on_loopbacks(2, MODEL).await;
    dns.set(NAME, &[ip(2), ip(3)]).await;
    // (Without the waiting room: an emptied pool answers at once.)
    let draining = Proxy::start(json!({"pools": [
        dns_pool(dns.addr(), port, json!({})).with("no_backend_wait", json!("0s"))
    ]}))
    .await;
    let keeping = Proxy::start(json!({"pools": [
        dns_pool(dns.addr(), port, json!({"on_empty": "keep"}))
    ]}))
    .await;
    for proxy in [&draining, &keeping] {
        let both = wait_for(Duration::from_secs(10), || async {
            members(proxy).await.len() == 2
        })
        .await;
        assert!(both.is_some(), "{}", proxy.status().await);
    }

    dns.set(NAME, &[]).await;
    let emptied = wait_for(Duration::from_secs(10), || async {
        members(&draining).await.is_empty()
    })
    .await;
    assert!(emptied.is_some(), "{}", draining.status().await);
    let answer = draining.ask(&chat(MODEL, "anyone?", false), &[]).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert!(
        answer.body.contains("no-healthy-backend"),
        "{}",
        answer.body
    );

    // The keeping pool saw the same empty answers and still serves from its two.
    assert_eq!(members(&keeping).await.len(), 2);
    let answer = keeping.ask(&chat(MODEL, "anyone?", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolver_that_lies_or_is_silent_leaves_the_pool_serving_what_it_knew() {
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, _sims) = sims_on_loopbacks(2, MODEL).await;
    dns.set(NAME, &[ip(2), ip(3)]).await;
    let proxy = Proxy::start(json!({"pools": [dns_pool(dns.addr(), port, json!({}))]})).await;
    let both = wait_for(Duration::from_secs(10), || async {
        members(&proxy).await.len() == 2
    })
    .await;
    assert!(both.is_some(), "{}", proxy.status().await);

    let mut resolver = dns.addr().to_string();
    for how in [
        Misbehaviour::Garbage,
        Misbehaviour::Silent,
        Misbehaviour::ServFail,
    ] {
        let bad = BadDns::start(how).await;
        // A reload points the pool at the bad resolver: the new generation starts from the
        // backends the old one knew.
        let config = std::fs::read_to_string(proxy.config_file()).unwrap();
        assert!(config.contains(&resolver), "{config}");
        let config = config.replace(&resolver, &bad.addr().to_string());
        resolver = bad.addr().to_string();
        std::fs::write(proxy.config_file(), config).unwrap();
        let before = discovery_errors(&proxy, "dns").await;
        signal(proxy.pid(), "HUP");
        let counted = wait_for(Duration::from_secs(15), || async {
            discovery_errors(&proxy, "dns").await > before
        })
        .await;
        assert!(counted.is_some(), "{how:?}: {}", proxy.logs());
        assert_eq!(members(&proxy).await.len(), 2, "{how:?}");
        let answer = proxy.ask(&chat(MODEL, "still there?", false), &[]).await;
        assert_eq!(answer.status, 200, "{how:?}: {}", answer.body);
    }
}

/// `sluice_discovery_errors_total` of the pool `fleet` and `source`.
async fn discovery_errors(proxy: &Proxy, source: &str) -> f64 {
    let series = format!(r#"sluice_discovery_errors_total{{pool="fleet",source="{source}"}}"#);
    proxy.metric(&series).await.unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_declared_by_discovery_alone_learns_its_models_from_its_backends() {
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, _sims) = sims_on_loopbacks(2, MODEL).await;
    dns.set(NAME, &[ip(2), ip(3)]).await;
    let proxy = Proxy::start(json!({"pools": [
        dns_pool(dns.addr(), port, json!({})).with("models", "auto")
    ]}))
    .await;
    let learned = wait_for(Duration::from_secs(10), || async {
        proxy.status().await["pools"][0]["models"] == json!([MODEL])
    })
    .await;
    assert!(learned.is_some(), "{}", proxy.status().await);
    let answer = proxy.ask(&chat(MODEL, "hello", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let listed: Value = client()
        .get(proxy.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["data"][0]["id"], MODEL, "{listed}");
    let unknown = proxy.ask(&chat("another-model", "hello", false), &[]).await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_endpoint_is_followed_and_leaves_nothing_behind() {
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, _sims) = sims_on_loopbacks(2, MODEL).await;
    dns.set(NAME, &[ip(2)]).await;
    let proxy = Proxy::start(json!({"pools": [dns_pool(dns.addr(), port, json!({}))]})).await;
    let flapper = format!("127.0.0.3:{port}");
    let series = format!(r#"sluice_backend_healthy{{backend="{flapper}",pool="fleet"}}"#);
    for round in 0..3 {
        dns.set(NAME, &[ip(2), ip(3)]).await;
        let joined = wait_for(Duration::from_secs(10), || async {
            proxy.metric(&series).await == Some(1.0)
        })
        .await;
        assert!(joined.is_some(), "round {round}: {}", proxy.status().await);
        dns.set(NAME, &[ip(2)]).await;
        // Gone: its series too, so that an endpoint coming and going does not grow the page.
        let left = wait_for(Duration::from_secs(10), || async {
            proxy.metric(&series).await.is_none()
        })
        .await;
        assert!(left.is_some(), "round {round}: {}", proxy.metrics().await);
        let answer = proxy.ask(&chat(MODEL, "still here", false), &[]).await;
        assert_eq!(answer.status, 200, "round {round}: {}", answer.body);
    }
    // Counted and logged by the discovery task, which may still be at it when the health
    // service has already let the last one go.
    let counted = wait_for(Duration::from_secs(5), || async {
        let updates = proxy
            .metric(r#"sluice_discovery_updates_total{pool="fleet"}"#)
            .await
            .unwrap_or(0.0);
        let changes = proxy
            .logs()
            .lines()
            .filter(|l| l.contains("pool backends changed"))
            .count();
        updates >= 7.0 && changes >= 7
    })
    .await;
    assert!(
        counted.is_some(),
        "1 + 3 joins and 3 leaves:\n{}",
        proxy.logs()
    );
}

mod kubernetes {
    //! The EndpointSlice watcher against a local server that speaks the Kubernetes API's
    //! list and watch protocol (`sluice_testkit::kube_api`): no API server can be installed
    //! on these machines, so this is the real protocol, not a real cluster.
    use super::*;
    use sluice_testkit::kube_api::{endpoint_slice, Endpoint, FakeKubeApi};

    const NAMESPACE: &str = "llm";

    fn slice(name: &str, port: u16, endpoints: &[Endpoint]) -> Value {
        endpoint_slice(NAMESPACE, "vllm", name, "http", port, endpoints)
    }

    fn ep(last: u8) -> String {
        format!("127.0.0.{last}")
    }

    async fn kube_proxy(api: &FakeKubeApi, dir: &std::path::Path) -> Proxy {
        let kubeconfig = api.kubeconfig(dir, "default");
        Proxy::start(json!({"pools": [
            pool("fleet", &[MODEL], &[])
                .with_fast_health_checks()
                .with("discovery", json!({"kubernetes": {
                    "service": "vllm", "namespace": NAMESPACE, "port": "http",
                    "kubeconfig": kubeconfig.to_string_lossy(), "debounce": "100ms"}}))
                // An empty pool's requests wait this long for a backend (60 s by default).
                .with("no_backend_wait", json!("2s"))
        ]}))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn endpoint_slices_are_followed_through_a_rollout_without_a_failed_request() {
        let api = FakeKubeApi::start().await;
        let dir = tempfile::tempdir().unwrap();
        let (port, sims) = sims_on_loopbacks_with(slow_streams(3, 30)).await;
        let at = |last: u8| format!("127.0.0.{last}:{port}");
        api.apply(slice(
            "vllm-a",
            port,
            &[Endpoint::ready(&ep(2)), Endpoint::ready(&ep(3))],
        ));
        // Another slice of another Service: not this pool's.
        api.apply(endpoint_slice(
            NAMESPACE,
            "other",
            "other-a",
            "http",
            port,
            &[Endpoint::ready(&ep(9))],
        ));
        let proxy = kube_proxy(&api, dir.path()).await;
        until_members(&proxy, &[(at(2), "ready"), (at(3), "ready")]).await;
        assert!(api.requests().iter().any(|r| r
            .contains("/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices")
            && r.contains("labelSelector=kubernetes.io%2Fservice-name%3Dvllm")));

        let load = Load::start(&proxy, 4);
        wait_for(Duration::from_secs(10), || async { load.sent() >= 8 }).await;

        // Two new pods in a second slice: one ready (it gets traffic), one not ready yet
        // (nothing listens there: a request sent to it would fail).
        api.bookmark();
        let before = chat_calls(&sims[2]);
        api.apply(slice(
            "vllm-b",
            port,
            &[Endpoint::not_ready(&ep(7)), Endpoint::ready(&ep(4))],
        ));
        let joined = wait_for(Duration::from_secs(5), || async {
            chat_calls(&sims[2]) > before
        })
        .await;
        assert!(joined.is_some(), "{}", proxy.status().await);
        until_members(
            &proxy,
            &[(at(2), "ready"), (at(3), "ready"), (at(4), "ready")],
        )
        .await;

        // The first pod terminates: drained, its streams finish; then its slice entry goes.
        api.apply(slice(
            "vllm-a",
            port,
            &[Endpoint::terminating(&ep(2)), Endpoint::ready(&ep(3))],
        ));
        until_members(&proxy, &[(at(3), "ready"), (at(4), "ready")]).await;
        api.apply(slice("vllm-a", port, &[Endpoint::ready(&ep(3))]));
        sims[0].shutdown();

        // A lost watch is resumed, an expired one relisted: changes made meanwhile arrive.
        api.drop_watches();
        api.apply(slice(
            "vllm-a",
            port,
            &[Endpoint::ready(&ep(3)), Endpoint::not_ready(&ep(5))],
        ));
        api.expire_watches();
        api.delete(NAMESPACE, "vllm-b");
        until_members(&proxy, &[(at(3), "ready")]).await;

        // The API server refuses (403): the pool keeps what it knows, and counts it. (The
        // expired watch above may have counted already: the 403 must add.)
        let before = discovery_errors(&proxy, "kubernetes").await;
        api.fail_with(Some(403));
        api.drop_watches();
        let counted = wait_for(Duration::from_secs(15), || async {
            discovery_errors(&proxy, "kubernetes").await > before
        })
        .await;
        assert!(counted.is_some(), "{}", proxy.logs());
        assert_eq!(members(&proxy).await, vec![(at(3), "ready".to_string())]);
        api.fail_with(None);
        api.apply(slice("vllm-b", port, &[Endpoint::ready(&ep(4))]));
        until_members(&proxy, &[(at(3), "ready"), (at(4), "ready")]).await;

        let (sent, failures) = load.finish().await;
        assert!(sent >= 16, "only {sent} requests were sent");
        assert!(
            failures.is_empty(),
            "{} failed: {failures:#?}",
            failures.len()
        );
        assert!(
            proxy.logs().contains("discovery answers again"),
            "{}",
            proxy.logs()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_api_server_leaves_an_empty_pool_that_says_why() {
        let api = FakeKubeApi::start().await;
        let dir = tempfile::tempdir().unwrap();
        api.fail_with(Some(403));
        let proxy = kube_proxy(&api, dir.path()).await;
        let counted = wait_for(Duration::from_secs(15), || async {
            discovery_errors(&proxy, "kubernetes").await >= 1.0
        })
        .await;
        assert!(counted.is_some(), "{}", proxy.logs());
        assert!(proxy.logs().contains("403"), "{}", proxy.logs());
        let ready = client()
            .get(proxy.admin_url("/readyz"))
            .send()
            .await
            .unwrap();
        assert_eq!(ready.status(), 503);
        // The empty pool holds the request for its wait, then says why it could not serve.
        let answer = proxy.ask(&chat(MODEL, "anyone?", false), &[]).await;
        assert_eq!(answer.status, 503, "{}", answer.body);
        assert_eq!(answer.headers["x-sluice-rejected"], "backend-wait-timeout");
    }
}

mod inference_pool {
    //! The Gateway API Inference Extension's InferencePool, against the testkit's API server:
    //! the real list/watch protocol for `inference.networking.k8s.io/v1` and core pods, not a
    //! real cluster (none runs on these machines).
    use super::*;
    use sluice_testkit::kube_api::{inference_pool, pod, FakeKubeApi, INFERENCE_POOLS, PODS};

    const NAMESPACE: &str = "llm";

    fn vllm_pod(name: &str, last: u8, ready: bool, terminating: bool) -> Value {
        let ip = format!("127.0.0.{last}");
        let labels = [("app", "vllm"), ("model", "llama")];
        pod(NAMESPACE, name, &labels, Some(&ip), ready, terminating)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_inference_pools_pods_are_followed_through_a_rollout_without_a_failed_request() {
        let api = FakeKubeApi::start().await;
        let dir = tempfile::tempdir().unwrap();
        let (port, sims) = sims_on_loopbacks_with(slow_streams(3, 30)).await;
        let at = |last: u8| format!("127.0.0.{last}:{port}");
        api.apply(inference_pool(
            NAMESPACE,
            "llama",
            &[("app", "vllm"), ("model", "llama")],
            &[port],
        ));
        api.apply(vllm_pod("vllm-0", 2, true, false));
        api.apply(vllm_pod("vllm-1", 3, true, false));
        // A pod its selector does not pick.
        api.apply(pod(
            NAMESPACE,
            "other",
            &[("app", "other")],
            Some("127.0.0.9"),
            true,
            false,
        ));
        let kubeconfig = api.kubeconfig(dir.path(), "default");
        let proxy = Proxy::start(json!({"pools": [
            pool("fleet", &[MODEL], &[])
                .with_fast_health_checks()
                .with("discovery", json!({"inference_pool": {
                    "name": "llama", "namespace": NAMESPACE,
                    "kubeconfig": kubeconfig.to_string_lossy(), "debounce": "100ms"}}))
        ]}))
        .await;
        until_members(&proxy, &[(at(2), "ready"), (at(3), "ready")]).await;
        let asked = api.requests();
        assert!(
            asked.iter().any(|r| r
                .contains("/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools")
                && r.contains("fieldSelector=metadata.name%3Dllama")),
            "{asked:#?}"
        );
        assert!(
            asked
                .iter()
                .any(|r| r.contains("/api/v1/namespaces/llm/pods")
                    && r.contains("labelSelector=app%3Dvllm%2Cmodel%3Dllama")),
            "{asked:#?}"
        );
        let status = proxy.status().await;
        assert_eq!(
            status["pools"][0]["source"], "inferencepool llm/llama",
            "{status}"
        );

        let load = Load::start(&proxy, 4);
        wait_for(Duration::from_secs(10), || async { load.sent() >= 8 }).await;

        // The rollout: a new pod ready (it gets traffic), one not ready yet (nothing listens).
        let before = chat_calls(&sims[2]);
        api.apply(vllm_pod("vllm-2", 4, true, false));
        api.apply(vllm_pod("vllm-3", 7, false, false));
        let joined = wait_for(Duration::from_secs(5), || async {
            chat_calls(&sims[2]) > before
        })
        .await;
        assert!(joined.is_some(), "{}", proxy.status().await);
        until_members(
            &proxy,
            &[(at(2), "ready"), (at(3), "ready"), (at(4), "ready")],
        )
        .await;

        // The first pod is deleted: drained while it terminates, then gone.
        api.apply(vllm_pod("vllm-0", 2, true, true));
        until_members(&proxy, &[(at(3), "ready"), (at(4), "ready")]).await;
        api.delete_object(&PODS, NAMESPACE, "vllm-0");
        sims[0].shutdown();

        // Lost and expired watches are resumed or relisted: what changed meanwhile arrives.
        api.drop_watches();
        api.delete_object(&PODS, NAMESPACE, "vllm-3");
        api.expire_watches();
        api.apply(vllm_pod("vllm-3", 5, false, false));
        until_members(&proxy, &[(at(3), "ready"), (at(4), "ready")]).await;

        // A pod relabelled out of the selector leaves; a wider selector takes it back (its
        // pods are watched anew).
        api.apply(pod(
            NAMESPACE,
            "vllm-1",
            &[("app", "vllm")],
            Some("127.0.0.3"),
            true,
            false,
        ));
        until_members(&proxy, &[(at(4), "ready")]).await;
        api.apply(inference_pool(
            NAMESPACE,
            "llama",
            &[("app", "vllm")],
            &[port],
        ));
        until_members(&proxy, &[(at(3), "ready"), (at(4), "ready")]).await;

        let (sent, failures) = load.finish().await;
        assert!(sent >= 16, "only {sent} requests were sent");
        assert!(
            failures.is_empty(),
            "{} failed: {failures:#?}",
            failures.len()
        );

        // The pool object deleted while the watches were away, its events compacted: the
        // relist that no longer has it takes its backends away.
        api.fail_with(Some(500));
        api.drop_watches();
        api.delete_object(&INFERENCE_POOLS, NAMESPACE, "llama");
        api.compact();
        api.fail_with(None);
        until_members(&proxy, &[]).await;
    }
}

/// One empty answer (a DNS hiccup, a spoofed UDP reply) emptied the pool at once: every
/// request got `503 no-healthy-backend` until the next refresh, and the backends came back as
/// strangers. Now `on_empty: drain` waits for three empty answers in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_empty_answer_empties_nothing() {
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, _sims) = sims_on_loopbacks(2, MODEL).await;
    dns.set(NAME, &[ip(2), ip(3)]).await;
    let proxy = Proxy::start(json!({"pools": [dns_pool(dns.addr(), port, json!({}))]})).await;
    let both = wait_for(Duration::from_secs(10), || async {
        members(&proxy).await.len() == 2
    })
    .await;
    assert!(both.is_some(), "{}", proxy.status().await);
    let load = Load::start(&proxy, 2);
    dns.set(NAME, &[]).await;
    // A lookup asks A and AAAA: three queries after the name emptied hold one whole lookup
    // answered empty; the fleet is back before two more lookups could be.
    let asked = dns.queries(NAME);
    wait_for(Duration::from_secs(10), || async {
        dns.queries(NAME) >= asked + 3
    })
    .await
    .expect("the proxy asks again, and hears nothing");
    dns.set(NAME, &[ip(2), ip(3)]).await;
    assert_eq!(members(&proxy).await.len(), 2, "{}", proxy.status().await);
    let sent_then = load.sent();
    wait_for(Duration::from_secs(10), || async {
        load.sent() > sent_then + 10
    })
    .await
    .expect("requests flow");
    let (sent, failures) = load.finish().await;
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {:?}",
        failures.len(),
        failures
    );
}

/// An API server that accepted the list and never answered froze discovery for good: the
/// pool stayed empty and no error was counted. The list is now bounded: counted, and tried
/// again until the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_api_server_is_counted_and_tried_again() {
    use sluice_testkit::kube_api::{endpoint_slice, Endpoint, FakeKubeApi};
    let (port, _sims) = sims_on_loopbacks(1, MODEL).await;
    let api = FakeKubeApi::start().await;
    api.apply(endpoint_slice(
        "default",
        "vllm",
        "vllm-a",
        "http",
        port,
        &[Endpoint::ready("127.0.0.2")],
    ));
    api.stall(true);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.kubeconfig(dir.path(), "default");
    let proxy = Proxy::start(json!({"pools": [
        pool("fleet", &[MODEL], &[])
            .with_fast_health_checks()
            .with("discovery", json!({"kubernetes": {
                "service": "vllm", "namespace": "default", "port": "http",
                "kubeconfig": kubeconfig.to_string_lossy(), "debounce": "100ms"}}))
    ]}))
    .await;
    let counted = wait_for(Duration::from_secs(30), || async {
        discovery_errors(&proxy, "kubernetes").await >= 1.0
    })
    .await;
    assert!(
        counted.is_some(),
        "the stall was never counted: {}",
        proxy.logs()
    );
    assert!(members(&proxy).await.is_empty());
    api.stall(false);
    let listed = wait_for(Duration::from_secs(60), || async {
        members(&proxy).await.len() == 1
    })
    .await;
    assert!(listed.is_some(), "{}", proxy.logs());
    let answer = proxy.ask(&chat(MODEL, "there?", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
}

/// A backend that left the pool (its name answered empty until the pool drained) and was
/// listed again came back a stranger: an ejected backend was back in rotation at once. Now an
/// address listed again within five minutes comes back with the state it left with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_leaves_and_returns_keeps_its_state() {
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, sims) = sims_on_loopbacks(2, MODEL).await;
    dns.set(NAME, &[ip(2), ip(3)]).await;
    let proxy = Proxy::start(json!({"pools": [
        dns_pool(dns.addr(), port, json!({})).with(
            "outlier_detection",
            json!({"consecutive_failures": 2, "base_ejection": "60s"}),
        )
    ]}))
    .await;
    let both = wait_for(Duration::from_secs(10), || async {
        members(&proxy).await.len() == 2
    })
    .await;
    assert!(both.is_some(), "{}", proxy.status().await);
    let bad = SocketAddr::new(ip(3), port);
    sims[1].set_faults(vllm_sim::Faults::error_rate(1.0, 500));
    let ejected = wait_for(Duration::from_secs(10), || async {
        proxy.ask(&chat(MODEL, "anyone?", false), &[]).await;
        proxy.backend_status("fleet", bad).await["health"] == "ejected"
    })
    .await;
    assert!(ejected.is_some(), "{}", proxy.status().await);

    dns.set(NAME, &[]).await;
    let emptied = wait_for(Duration::from_secs(20), || async {
        members(&proxy).await.is_empty()
    })
    .await;
    assert!(emptied.is_some(), "{}", proxy.status().await);
    dns.set(NAME, &[ip(2), ip(3)]).await;
    let back = wait_for(Duration::from_secs(10), || async {
        members(&proxy).await.len() == 2
    })
    .await;
    assert!(back.is_some(), "{}", proxy.status().await);
    assert_eq!(
        proxy.backend_status("fleet", bad).await["health"],
        "ejected",
        "{}",
        proxy.status().await
    );
    let failing_calls = chat_calls(&sims[1]);
    for i in 0..10 {
        let answer = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    assert_eq!(
        chat_calls(&sims[1]),
        failing_calls,
        "the ejected backend got none"
    );
}

/// A backend's host name was resolved at load by the blocking `getaddrinfo`, and one that did
/// not resolve refused the start (and a reload, and an upgrade's new process). Now a name that
/// has no address within 2 s leaves the pool without it, and is asked again every few
/// seconds, its failures counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_name_that_does_not_resolve_refuses_nothing() {
    let sim = sim_serving(MODEL).await;
    let proxy = Proxy::start(json!({"pools": [
        pool("fleet", &[MODEL], &[sim.addr()]).with("backends", json!([
            {"address": sim.addr().to_string()},
            {"address": "no-such-backend.invalid:8000"},
        ]))
    ]}))
    .await;
    let answer = proxy.ask(&chat(MODEL, "anyone?", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        members(&proxy).await,
        vec![(sim.addr().to_string(), "ready".to_string())]
    );
    proxy.reload().await;
    let answer = proxy.ask(&chat(MODEL, "still?", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let counted = wait_for(Duration::from_secs(30), || async {
        discovery_errors(&proxy, "static_dns").await > 0.0
    })
    .await;
    assert!(counted.is_some(), "{}", proxy.logs());
}

/// A pool scaled to zero (its name answers nothing) holds its requests in the waiting room:
/// the waiting metric counts them, a reload meanwhile loses none, and they are all served
/// once a backend joins; a pool whose backend never comes answers `503 backend-wait-timeout`
/// when its wait is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_at_zero_holds_its_requests_until_a_backend_joins() {
    const WAITING: &str = r#"sluice_pool_waiting_requests{pool="fleet"}"#;
    const OLDEST: &str = r#"sluice_pool_oldest_waiting_seconds{pool="fleet"}"#;
    let dns = DnsServer::start(Duration::from_secs(1)).await;
    let (port, _sims) = sims_on_loopbacks(1, MODEL).await;
    dns.set(NAME, &[]).await;
    let never = pool("never", &["other"], &[])
        .with_fast_health_checks()
        .with(
            "discovery",
            json!({"dns": {"name": "nobody.fleet.test", "port": port,
                           "resolver": dns.addr().to_string(), "min_refresh": "1s"}}),
        )
        .with("no_backend_wait", json!("1s"));
    let proxy = Proxy::start(json!({
        "pools": [
            dns_pool(dns.addr(), port, json!({})).with("no_backend_wait", json!("60s")),
            never,
        ],
        "routes": [{"path_prefix": "/health", "pool": "fleet"}],
    }))
    .await;

    let asks: Vec<_> = (0..6)
        .map(|i| {
            let url = proxy.url("/v1/chat/completions");
            tokio::spawn(async move {
                ask_url(
                    &url,
                    &chat(MODEL, &format!("are you up? {i}"), i % 2 == 0),
                    &[],
                )
                .await
            })
        })
        .collect();
    // A plain route's request waits too.
    let plain = {
        let url = proxy.url("/health");
        tokio::spawn(async move { client().get(url).send().await.unwrap().status() })
    };
    let all_waiting = wait_for(Duration::from_secs(20), || async {
        proxy.metric(WAITING).await == Some(7.0)
    })
    .await;
    assert!(all_waiting.is_some(), "{}", proxy.metrics().await);
    assert!(proxy.metric(OLDEST).await.unwrap_or(0.0) > 0.0);
    // A reload while they wait: the new generation takes the room over (and its discovery
    // is the one that sees the backend join).
    proxy.reload().await;
    assert_eq!(proxy.metric(WAITING).await, Some(7.0));

    // The backend joins: every waiting request is served, and the room empties.
    dns.set(NAME, &[ip(2)]).await;
    for ask in asks {
        let answer = ask.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    assert_eq!(plain.await.unwrap(), 200);
    assert_eq!(proxy.metric_once(WAITING, 0.0).await, Some(0.0));
    assert_eq!(proxy.metric(OLDEST).await, Some(0.0));

    // A pool whose backend never comes: its wait ends in a 503 that says so.
    let late = proxy.ask(&chat("other", "anyone?", false), &[]).await;
    assert_eq!(late.status, 503, "{}", late.body);
    assert_eq!(late.headers["x-sluice-rejected"], "backend-wait-timeout");
    assert!(late.headers.get("retry-after").is_some());
}
