//! Pools reached over TLS: requests and health checks both verify the backend's certificate
//! against `pingora.ca_file` (its CA) and the pool's `tls.sni` (its name). The backends are simulators behind a
//! real TLS front, with certificates from a CA made for the test.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::SimConfig;

const SNI: &str = "vllm.internal.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_pools_verify_backends_against_the_configured_ca_for_requests_and_checks() {
    let trusted = TestCa::new("Sluice test CA");
    let stranger = TestCa::new("Some other CA");
    let good_sim = vllm_sim::start(
        SimConfig::default()
            .with_model("good-model")
            .with_kv(1000, 16),
    )
    .await
    .expect("sim");
    let bad_sim = vllm_sim::start(SimConfig::default().with_model("bad-model"))
        .await
        .expect("sim");
    // Requests (not only checks) must refuse a certificate: these two pools run no checks,
    // so their backends are always tried.
    let stranger_sim = vllm_sim::start(SimConfig::default().with_model("stranger-model"))
        .await
        .expect("sim");
    let misnamed_sim = vllm_sim::start(SimConfig::default().with_model("misnamed-model"))
        .await
        .expect("sim");
    let good = tls_front(trusted.server_config(SNI), good_sim.addr()).await;
    let bad = tls_front(stranger.server_config(SNI), bad_sim.addr()).await;
    let stranger_front = tls_front(stranger.server_config(SNI), stranger_sim.addr()).await;
    let misnamed = tls_front(trusted.server_config("other.test"), misnamed_sim.addr()).await;

    let dir = tempfile::tempdir().expect("temp dir");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &trusted.pem).expect("write CA");
    let checked = |p: Pool| {
        p.with("tls", json!({"sni": SNI}))
            .with("health", json!({"interval": "100ms", "timeout": "500ms"}))
    };
    let unchecked = |p: Pool| p.with("tls", json!({"sni": SNI})).without_health_checks();
    let proxy = Proxy::start(json!({
        "pingora": {"ca_file": ca_file},
        "pools": [
            checked(pool("good", &["good-model"], &[good])),
            checked(pool("bad", &["bad-model"], &[bad])),
            unchecked(pool("stranger", &["stranger-model"], &[stranger_front])),
            unchecked(pool("misnamed", &["misnamed-model"], &[misnamed])),
        ],
    }))
    .await;

    // The checks reach the backend through TLS: its probe passes and its metrics are read.
    let healthy = wait_for(Duration::from_secs(5), || async {
        let s = proxy.backend_status("good", good).await;
        s["health"] == "healthy" && s["kv_capacity_tokens"] == 16_000
    })
    .await;
    assert!(
        healthy.is_some(),
        "{}\n{}",
        proxy.status().await,
        proxy.logs()
    );
    let answer = proxy
        .ask(&chat("good-model", "hello over TLS", false), &[])
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.headers["x-sluice-pool"], "good");
    assert!(!content(&answer).is_empty(), "{}", answer.body);

    // A certificate from a CA the file does not hold fails the checks and the requests alike.
    let refused = wait_for(Duration::from_secs(5), || async {
        proxy.backend_status("bad", bad).await["health"] == "unhealthy"
    })
    .await;
    assert!(refused.is_some(), "{}", proxy.status().await);
    let answer = proxy
        .ask(&chat("bad-model", "hello over TLS", false), &[])
        .await;
    assert!(
        matches!(answer.status, 502 | 503),
        "{} {}",
        answer.status,
        answer.body
    );
    // A request to an unchecked backend with a stranger's certificate, or one for another
    // name, fails at the handshake: 502, and nothing reaches the simulator.
    for model in ["stranger-model", "misnamed-model"] {
        let answer = proxy.ask(&chat(model, "hello over TLS", false), &[]).await;
        assert_eq!(answer.status, 502, "{model}: {}", answer.body);
    }
    for (name, sim) in [
        ("bad", &bad_sim),
        ("stranger", &stranger_sim),
        ("misnamed", &misnamed_sim),
    ] {
        assert_eq!(
            sim.stats().requests_total,
            0,
            "{name}: nothing, not even a check, got past the refused handshake"
        );
    }
    assert!(good_sim.stats().requests_by_path.contains_key("/metrics"));
}
