//! The health service end to end: live simulators scraped, garbage metrics (skipped lines,
//! pages that are not metrics, a hostile page), a backend that dies during a run, passive
//! ejection, and KV-aware balancing.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use sluice_testkit::*;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::{Faults, Latency, MetricsFlavor, SimConfig};

const MODEL: &str = "test-model";

async fn sim(config: SimConfig) -> vllm_sim::Sim {
    vllm_sim::start(config.with_model(MODEL))
        .await
        .expect("sim")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_metric_generations_are_scraped_and_shown() {
    let v1 = sim(SimConfig::default().with_kv(1000, 16)).await;
    let v0 = sim(SimConfig::default()
        .with_kv(500, 16)
        .with_metrics(MetricsFlavor::V0))
    .await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[v1.addr(), v0.addr()]).with_fast_health_checks()
    ]}))
    .await;
    let took = wait_for(Duration::from_secs(3), || async {
        let a = proxy.backend_status("main", v1.addr()).await;
        let b = proxy.backend_status("main", v0.addr()).await;
        a["health"] == "healthy" && b["health"] == "healthy"
    })
    .await;
    assert!(took.is_some(), "{}", proxy.status().await);

    let a = proxy.backend_status("main", v1.addr()).await;
    let b = proxy.backend_status("main", v0.addr()).await;
    assert_eq!(a["kv_capacity_tokens"], 16_000, "{a}");
    assert_eq!(b["kv_capacity_tokens"], 8_000, "{b}");
    assert_eq!(a["kv_cache_usage"], 0.0, "{a}");
    assert_eq!(b["running"], 0.0, "{b}");
    assert!(a["scraped_seconds_ago"].as_f64().unwrap() < 1.0, "{a}");

    let metrics = proxy.metrics().await;
    for backend in [v1.addr(), v0.addr()] {
        for series in [
            "sluice_backend_kv_cache_usage_ratio",
            "sluice_backend_requests_running",
            "sluice_backend_requests_waiting",
            "sluice_backend_healthy",
        ] {
            let s = format!(r#"{series}{{backend="{backend}",pool="main"}}"#);
            assert!(metric_value(&metrics, &s).is_some(), "{s} in\n{metrics}");
        }
        let s =
            format!(r#"sluice_backend_state{{backend="{backend}",pool="main",state="healthy"}}"#);
        assert_eq!(metric_value(&metrics, &s), Some(1.0), "{s}");
    }
    assert!(
        metric_value(
            &metrics,
            r#"sluice_health_checks_total{kind="metrics",pool="main",result="ok"}"#
        )
        .unwrap_or(0.0)
            >= 2.0,
        "{metrics}"
    );
    assert_eq!(
        client()
            .get(proxy.admin_url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

/// What a [`FakeVllm`] answers on `/metrics` (its `/health` is always 200).
#[derive(Clone)]
enum MetricsAnswer {
    Page(String),
    Status(u16),
    /// `content-length` promises more than is sent, then the connection closes.
    CutShort(String),
}

/// A backend whose `/health` is fine and whose `/metrics` answers what the test says.
struct FakeVllm {
    addr: SocketAddr,
    answer: Arc<Mutex<MetricsAnswer>>,
}

impl FakeVllm {
    async fn start(answer: MetricsAnswer) -> FakeVllm {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let answer = Arc::new(Mutex::new(answer));
        let shared = answer.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let answer = shared.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut byte = [0u8; 1024];
                    loop {
                        let Ok(n) = stream.read(&mut byte).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&byte[..n]);
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        buf.drain(..end + 4);
                        let path = head.split(' ').nth(1).unwrap_or("/").to_string();
                        let current = answer.lock().unwrap().clone();
                        let reply = if path == "/health" {
                            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_string()
                        } else {
                            match current {
                                MetricsAnswer::Page(p) => format!(
                                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{p}",
                                    p.len()
                                ),
                                MetricsAnswer::Status(s) => format!(
                                    "HTTP/1.1 {s} Nope\r\ncontent-type: text/html\r\ncontent-length: 9\r\n\r\nnot here\n"
                                ),
                                MetricsAnswer::CutShort(p) => {
                                    let r = format!(
                                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}",
                                        p.len() * 2,
                                        p
                                    );
                                    let _ = stream.write_all(r.as_bytes()).await;
                                    return;
                                }
                            }
                        };
                        if stream.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        FakeVllm { addr, answer }
    }

    fn set(&self, answer: MetricsAnswer) {
        *self.answer.lock().unwrap() = answer;
    }
}

/// A fake vLLM serving the V1 fixture page (returned too), behind a proxy whose pool `main`
/// checks it fast, once the proxy sees it healthy.
async fn healthy_fake_vllm() -> (String, FakeVllm, Proxy) {
    let good = String::from_utf8(fixture("vllm-v1-metrics.txt")).unwrap();
    let fake = FakeVllm::start(MetricsAnswer::Page(good.clone())).await;
    let proxy = Proxy::start(
        json!({"pools": [pool("main", &[MODEL], &[fake.addr]).with_fast_health_checks()]}),
    )
    .await;
    let healthy = wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("main", fake.addr).await["health"] == "healthy"
    })
    .await;
    assert!(
        healthy.is_some(),
        "{}",
        proxy.backend_status("main", fake.addr).await
    );
    (good, fake, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_metrics_make_a_backend_stale_never_crash_the_scraper() {
    let (good, fake, proxy) = healthy_fake_vllm().await;
    let state = || async { proxy.backend_status("main", fake.addr).await };
    assert_eq!(state().await["kv_cache_usage"], 0.2346);
    assert_eq!(state().await["running"], 48.0);

    let html = "<!DOCTYPE html>\n<html><body>502 Bad Gateway</body></html>\n".to_string();
    let truncated = good[..good.len() / 2].to_string();
    for (answer, result) in [
        (MetricsAnswer::Page(html), "unparsable"),
        (MetricsAnswer::Page(truncated.clone()), "unparsable"),
        (MetricsAnswer::CutShort(truncated), "error"),
        (MetricsAnswer::Status(404), "bad_status"),
    ] {
        fake.set(MetricsAnswer::Page(good.clone()));
        assert!(wait_for(Duration::from_secs(3), || async {
            state().await["health"] == "healthy"
        })
        .await
        .is_some());
        let series = format!(
            r#"sluice_health_checks_total{{kind="metrics",pool="main",result="{result}"}}"#
        );
        let before = proxy.metric(&series).await.unwrap_or(0.0);
        fake.set(answer);
        // Stale after `stale_after` (1 s) without a good scrape; alive all the while.
        let took = wait_for(Duration::from_secs(3), || async {
            state().await["health"] == "stale"
        })
        .await;
        assert!(took.is_some(), "{result}: {}", state().await);
        let after = proxy.metric(&series).await.unwrap_or(0.0);
        assert!(after > before, "{series}: {before} → {after}");
    }
    // A page the parser gives up on counts no skipped lines: those count only on pages read.
    let skipped = format!(
        r#"sluice_health_metric_lines_skipped_total{{backend="{}",pool="main"}}"#,
        fake.addr
    );
    assert_eq!(proxy.metric(&skipped).await, Some(0.0));
    // The backend still serves: stale is not dead (the pool's only backend, so the balancer's
    // default `stale_as: saturated` still lets it through).
    fake.set(MetricsAnswer::Page(good));
    assert!(wait_for(Duration::from_secs(3), || async {
        state().await["health"] == "healthy"
    })
    .await
    .is_some());
}

/// One non-stream request; `Err` carries the status and body of a failure.
async fn one_request(proxy: &Proxy, i: usize) -> Result<(), String> {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("question {i}")}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    if status == 200 {
        Ok(())
    } else {
        Err(format!("{status}: {text}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_during_a_run_gets_no_new_requests_within_2s() {
    let latency = Latency::new(
        Duration::from_millis(5),
        Duration::ZERO,
        Duration::from_millis(1),
    );
    let a = sim(SimConfig::default().with_latency(latency.clone())).await;
    let b = sim(SimConfig::default().with_latency(latency)).await;
    // Default health settings (250 ms interval), as shipped.
    let proxy = Arc::new(
        Proxy::start(json!({"pools": [pool("main", &[MODEL], &[a.addr(), b.addr()])]})).await,
    );
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("main", a.addr()).await["health"] == "healthy"
    })
    .await
    .is_some());

    // Four clients in closed loops; the kill happens in the middle.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failures: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let mut clients = Vec::new();
    for c in 0..4 {
        let (proxy, stop, failures) = (proxy.clone(), stop.clone(), failures.clone());
        clients.push(tokio::spawn(async move {
            let mut i = c * 100_000;
            let mut sent = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                if let Err(e) = one_request(&proxy, i).await {
                    failures.lock().unwrap().push((started, e));
                }
                i += 1;
                sent += 1;
            }
            sent
        }));
    }
    let served = wait_for(Duration::from_secs(5), || async {
        a.stats().count("/v1/chat/completions") > 0
    })
    .await;
    assert!(served.is_some(), "a served before it died");
    let killed = Instant::now();
    a.set_faults(Faults {
        refuse_connections: true,
        ..Faults::default()
    });
    let dead_within = wait_for(Duration::from_secs(3), || async {
        let s = proxy.backend_status("main", a.addr()).await;
        s["health"] == "unhealthy" || s["health"] == "ejected"
    })
    .await;
    let connect_errors = || async {
        proxy
            .metric(r#"sluice_upstream_attempts_total{outcome="connect_error",pool="main"}"#)
            .await
            .unwrap_or(0.0)
    };
    tokio::time::sleep(Duration::from_secs(2).saturating_sub(killed.elapsed())).await;
    let attempts_at_2s = connect_errors().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let attempts_at_4s = connect_errors().await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for c in clients {
        total += c.await.unwrap();
    }

    let dead_within = dead_within.expect("the dead backend is noticed");
    assert!(dead_within < Duration::from_secs(2), "{dead_within:?}");
    assert_eq!(
        attempts_at_4s, attempts_at_2s,
        "no request tried the dead backend after 2 s"
    );
    // Requests that had not reached the dead backend were retried elsewhere: only those in
    // flight on it when it died may fail.
    let failures = failures.lock().unwrap();
    let late: Vec<_> = failures.iter().filter(|(t, _)| *t > killed).collect();
    assert!(late.is_empty(), "{late:?}");
    assert!(failures.len() <= 4, "{failures:?}");
    assert!(b.stats().count("/v1/chat/completions") > 0);
    println!(
        "killed backend noticed after {dead_within:?}; {total} requests, {} failed in flight, \
         {attempts_at_2s} connect errors (all before 2 s)",
        failures.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_is_unhealthy_and_readyz_follows() {
    let a = sim(SimConfig::default()).await;
    let proxy = Proxy::start(
        json!({"pools": [pool("main", &[MODEL], &[a.addr()]).with_fast_health_checks()]}),
    )
    .await;
    let ready = || async {
        client()
            .get(proxy.admin_url("/readyz"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert!(
        wait_for(Duration::from_secs(3), || async { ready().await == 200 })
            .await
            .is_some()
    );
    a.set_faults(Faults {
        engine_dead: true,
        ..Faults::default()
    });
    assert!(
        wait_for(Duration::from_secs(2), || async { ready().await == 503 })
            .await
            .is_some()
    );
    assert_eq!(
        proxy.backend_status("main", a.addr()).await["health"],
        "unhealthy"
    );
    // With no backend left: 503 with retry-after, made by Sluice.
    let r = proxy.ask(&chat(MODEL, "hi", false), &[]).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.headers.get("retry-after").is_some());
    assert!(r.body.contains("No healthy backend"), "{}", r.body);
    a.set_faults(Faults::none());
    assert!(
        wait_for(Duration::from_secs(2), || async { ready().await == 200 })
            .await
            .is_some()
    );
    let r = proxy.ask(&chat(MODEL, "hi", false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_backends_are_ejected_by_real_traffic() {
    let good = sim(SimConfig::default()).await;
    let bad = sim(SimConfig::default()).await;
    // Health probes say fine (the engine answers /health); its completions fail.
    bad.set_faults(Faults::error_rate(1.0, 500));
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[good.addr(), bad.addr()]).with(
            "outlier_detection",
            json!({"consecutive_failures": 2, "base_ejection": "30s"}),
        ),
    ]}))
    .await;
    let mut statuses = Vec::new();
    for i in 0..20 {
        let r = proxy.ask(&chat(MODEL, &format!("q{i}"), false), &[]).await;
        statuses.push(r.status);
    }
    // A 500 is the backend's answer and passes through; after two, it is ejected.
    let errors = statuses.iter().filter(|s| **s == 500).count();
    assert_eq!(errors, 2, "{statuses:?}");
    assert_eq!(bad.stats().count("/v1/chat/completions"), 2);
    assert_eq!(
        proxy.backend_status("main", bad.addr()).await["health"],
        "ejected"
    );
    let metrics = proxy.metrics().await;
    assert_eq!(
        metric_value(&metrics, r#"sluice_backend_ejections_total{pool="main"}"#),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_routes_eject_failing_backends_too() {
    let good = Scripted::start(Script::fixed("text/plain", b"fine".to_vec())).await;
    let mut failing = Script::fixed("text/plain", b"broken".to_vec());
    failing.head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 6\r\n\r\n".to_vec();
    let bad = Scripted::start(failing).await;
    let proxy = Proxy::start(json!({
        "pools": [pool("web", &[], &[good.addr, bad.addr])
            .without_health_checks()
            .with(
                "outlier_detection",
                json!({"consecutive_failures": 2, "base_ejection": "30s"}),
            )],
        "routes": [{"path_prefix": "/web", "pool": "web"}],
    }))
    .await;
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let r = client().get(proxy.url("/web/page")).send().await.unwrap();
        statuses.push(r.status().as_u16());
    }
    let errors = statuses.iter().filter(|s| **s == 500).count();
    assert_eq!(errors, 2, "{statuses:?}");
    assert_eq!(bad.received.lock().unwrap().len(), 2);
    assert_eq!(
        proxy.backend_status("web", bad.addr).await["health"],
        "ejected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_requests_avoid_a_backend_with_a_full_kv_cache() {
    // Slow answers, so requests hold their KV blocks while the test looks.
    let slow = Latency::new(Duration::ZERO, Duration::ZERO, Duration::from_millis(20));
    let busy = sim(SimConfig::default()
        .with_kv(200, 16)
        .with_latency(slow.clone())
        .with_answer_tokens(200, 200))
    .await;
    let idle = sim(SimConfig::default()
        .with_kv(200, 16)
        .with_latency(slow)
        .with_answer_tokens(5, 5))
    .await;
    // Fill `busy` directly, not through the proxy: the proxy learns of it from /metrics alone.
    let long_prompt = "word ".repeat(400);
    let mut fillers = Vec::new();
    for i in 0..4 {
        let url = format!("{}/v1/chat/completions", busy.url());
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("{i} {long_prompt}")}], "max_tokens": 200});
        fillers.push(tokio::spawn(async move {
            client()
                .post(url)
                .json(&body)
                .send()
                .await
                .map(|r| r.status())
        }));
    }
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[busy.addr(), idle.addr()]).with_fast_health_checks()
    ]}))
    .await;
    assert!(
        wait_for(Duration::from_secs(3), || async {
            proxy.backend_status("main", busy.addr()).await["kv_cache_usage"]
                .as_f64()
                .is_some_and(|kv| kv > 0.5)
        })
        .await
        .is_some(),
        "{}",
        proxy.status().await
    );
    let before = busy.stats().count("/v1/chat/completions");
    for i in 0..20 {
        let r = proxy
            .ask(&chat(MODEL, &format!("small {i}"), false), &[])
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let to_busy = busy.stats().count("/v1/chat/completions") - before;
    let to_idle = idle.stats().count("/v1/chat/completions");
    assert_eq!(to_busy, 0, "busy {to_busy}, idle {to_idle}");
    assert_eq!(to_idle, 20);
    for f in fillers {
        let _ = f.await;
    }
}

/// The skipped-lines counter of one backend of pool `main`.
fn skipped_lines(backend: SocketAddr) -> String {
    format!(r#"sluice_health_metric_lines_skipped_total{{backend="{backend}",pool="main"}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_lines_are_skipped_and_counted_and_the_page_still_read() {
    let (good, fake, proxy) = healthy_fake_vllm().await;
    let state = || async { proxy.backend_status("main", fake.addr).await };
    assert_eq!(proxy.metric(&skipped_lines(fake.addr)).await, Some(0.0));

    // In series the scrape reads (the others are not parsed): a syntax this parser does not
    // know (an OpenMetrics exemplar), a bad escape, and the usage changed, so that only a
    // page read after the change can show it.
    let junky = good.replace("} 0.2346\n", "} 0.61\n")
        + "vllm:num_requests_waiting{engine=\"1\"} 7 # {trace_id=\"4bf92f35\"} 1.0\n"
        + "vllm:num_requests_running{path=\"C:\\temp\"} 1\n"
        + "sidecar_info{path=\"C:\\temp\"} 1\n";
    assert!(junky.contains("} 0.61\n"), "the usage line was changed");
    fake.set(MetricsAnswer::Page(junky));
    let took = wait_for(Duration::from_secs(3), || async {
        state().await["kv_cache_usage"] == 0.61
    })
    .await;
    assert!(took.is_some(), "{}", state().await);
    let first = proxy.metric(&skipped_lines(fake.addr)).await.unwrap();
    assert!(first >= 2.0 && first % 2.0 == 0.0, "two a page: {first}");
    assert!(
        wait_for(Duration::from_secs(2), || async {
            proxy.metric(&skipped_lines(fake.addr)).await.unwrap() > first
        })
        .await
        .is_some(),
        "it counts on every scrape"
    );
    let s = state().await;
    assert_eq!(s["health"], "healthy", "{s}");
    assert_eq!(s["running"], 48.0, "{s}");
    assert!(
        proxy.logs().contains("2 invalid lines"),
        "the skipping is logged: {}",
        proxy.logs()
    );
}

/// An HTML error page, the bytes of something else: `/metrics` pages that cannot be read.
fn unreadable_pages() -> [String; 2] {
    [
        "<!DOCTYPE html>\n<html><body>502 Bad Gateway</body></html>\n".to_string(),
        "\u{1f}\u{8b}\u{8}garbage}{\"\n\\x00 1 2 3 4\n".to_string(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_metrics_cannot_be_read_is_not_shed_by_the_breaker() {
    let mut sims = Vec::new();
    for page in unreadable_pages() {
        sims.push(
            sim(SimConfig::default().with_faults(Faults {
                metrics_page: Some(page),
                ..Faults::default()
            }))
            .await,
        );
    }
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr()).collect();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &addrs).with_fast_health_checks()],
        "plugins": {"kv_breaker": {"enabled": true}},
    }))
    .await;
    let unparsable = || async {
        proxy
            .metric(r#"sluice_health_checks_total{kind="metrics",pool="main",result="unparsable"}"#)
            .await
            .unwrap_or(0.0)
    };
    // Alive, their load unknown: stale, with no scrape newer than `stale_after` (1 s), and
    // the pages failed to parse a few times (as counted at the end).
    let all_stale = wait_for(Duration::from_secs(5), || async {
        let status = proxy.status().await;
        let backends = status["pools"][0]["backends"].as_array().cloned();
        backends.is_some_and(|b| {
            b.iter().all(|b| {
                b["health"] == "stale"
                    && b["scraped_seconds_ago"]
                        .as_f64()
                        .is_none_or(|ago| ago > 1.0)
            })
        }) && unparsable().await >= 4.0
    })
    .await;
    assert!(all_stale.is_some(), "{}", proxy.status().await);

    for i in 0..10 {
        for priority in ["sheddable", "standard"] {
            let r = proxy
                .ask(
                    &chat(MODEL, &format!("question {i}"), false),
                    &[("x-sluice-priority", priority)],
                )
                .await;
            assert_eq!(r.status, 200, "{priority}: {}", r.body);
        }
    }
    let status = proxy.status().await;
    let main = &status["pools"][0];
    assert_eq!(main["breaker"]["state"], "closed", "{main}");
    assert_eq!(main["kv_cache_usage"], serde_json::Value::Null, "{main}");
    for backend in main["backends"].as_array().unwrap() {
        assert_eq!(backend["health"], "stale", "{backend}");
    }
    assert!(sims
        .iter()
        .all(|s| s.stats().count("/v1/chat/completions") > 0));
    assert_eq!(
        proxy
            .metric(r#"router_rejections_total{priority="sheddable",reason="kv-pressure"}"#)
            .await
            .unwrap_or(0.0),
        0.0
    );
    let unparsable = unparsable().await;
    assert!(unparsable >= 4.0, "{unparsable}");
}

/// `vllm:num_requests_running{l0="\\",l1="\\",…} 1`: one label line, of a series the scrape
/// reads, of nearly the largest body read (8 MiB), which costs a quadratic parser minutes.
fn hostile_page() -> String {
    let mut page = String::from("vllm:num_requests_running{");
    let mut i = 0;
    while page.len() < (8 << 20) - 64 {
        page.push_str(&format!("l{i}=\"\\\\\","));
        i += 1;
    }
    page.push_str("} 1\n");
    page
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_page_does_not_stall_the_checks_of_other_backends() {
    let healthy = sim(SimConfig::default()).await;
    let hostile = FakeVllm::start(MetricsAnswer::Page(hostile_page())).await;
    let proxy = Proxy::start(json!({"pools": [
        pool("main", &[MODEL], &[healthy.addr(), hostile.addr]).with_fast_health_checks()
    ]}))
    .await;
    let failed = || async {
        let mut failed = 0.0;
        for result in ["unparsable", "parse_timeout", "timeout", "error"] {
            let series = format!(
                r#"sluice_health_checks_total{{kind="metrics",pool="main",result="{result}"}}"#
            );
            failed += proxy.metric(&series).await.unwrap_or(0.0);
        }
        failed
    };
    assert!(
        wait_for(Duration::from_secs(5), || async {
            proxy.backend_status("main", healthy.addr()).await["health"] == "healthy"
                && failed().await >= 1.0
        })
        .await
        .is_some(),
        "{}",
        proxy.status().await
    );

    // For two seconds, while the hostile page is scraped every 100 ms, the healthy backend's
    // scrape stays within a few intervals of now.
    let watched = Instant::now();
    let mut oldest: f64 = 0.0;
    while watched.elapsed() < Duration::from_secs(2) {
        let b = proxy.backend_status("main", healthy.addr()).await;
        assert_eq!(b["health"], "healthy", "{b}");
        oldest = oldest.max(b["scraped_seconds_ago"].as_f64().unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        oldest < 0.8,
        "the healthy backend's metrics were {oldest} s old"
    );
    let before = failed().await;
    let failed_again = wait_for(Duration::from_secs(5), || async { failed().await > before }).await;
    assert!(
        failed_again.is_some(),
        "every scrape of the hostile page fails"
    );
    let h = proxy.backend_status("main", hostile.addr).await;
    assert_eq!(h["health"], "stale", "{h}");
    assert_eq!(
        proxy
            .metric(r#"sluice_health_checks_total{kind="metrics",pool="main",result="unparsable"}"#)
            .await
            .map(|v| v > 0.0),
        Some(true),
        "an 8 MiB line is a bad line, and a page of only that is no metrics page"
    );
}
