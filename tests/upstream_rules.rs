//! What a pool and a route change on the way up and back: the pool's own credential instead of
//! the client's key, and header rules (nginx's `proxy_set_header`, `add_header`,
//! `proxy_hide_header`), on LLM and plain routes.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use sluice_testkit::*;
use vllm_sim::SimConfig;

const MODEL: &str = "llama";

async fn sim_with_key(key: &str) -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_api_key(key)
            .with_record_requests(20),
    )
    .await
    .unwrap()
}

fn chats(sim: &vllm_sim::Sim) -> Vec<vllm_sim::RecordedRequest> {
    sim.stats()
        .recent
        .into_iter()
        .filter(|r| r.path.starts_with("/v1"))
        .collect()
}

/// A backend started with vLLM's `--api-key` gets its key from the pool (read from a file
/// when the config is loaded) and never the client's; a pool without a credential strips the
/// client's key as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_sends_its_own_credential_and_never_the_clients_key() {
    let upstream = sim_with_key("vllm-secret").await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("vllm-key");
    std::fs::write(&secret, "vllm-secret\n").unwrap();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])
            .with("upstream_auth", json!({"from_file": secret}))],
    }))
    .await;
    let client_key = [
        ("authorization", "Bearer sk-client"),
        ("x-api-key", "sk-client"),
    ];
    let a = proxy.ask(&chat(MODEL, "hi", false), &client_key).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let r = proxy.ask(&chat(MODEL, "a stream", true), &client_key).await;
    assert_eq!(r.status, 200, "{}", r.body);
    for request in chats(&upstream) {
        assert_eq!(request.header("authorization"), Some("Bearer vllm-secret"));
        assert_eq!(
            request.header("x-api-key"),
            None,
            "the client's key went upstream"
        );
    }
    assert!(
        !proxy.logs().contains("vllm-secret"),
        "the secret in the log"
    );

    // Not even at `trace`: Pingora's HTTP/1 client logs each request's raw header there.
    let traced = Proxy::start(json!({
        "log": {"level": "trace"},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])
            .with("upstream_auth", json!({"from_file": secret}))],
    }))
    .await;
    let a = traced.ask(&chat(MODEL, "traced", false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let logs = traced.logs();
    assert!(logs.contains("TRACE"), "the log is at trace");
    assert!(!logs.contains("vllm-secret"), "the secret in a trace log");

    // Without the pool's credential, the backend refuses; the client's key is not passed on.
    let bare = Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let a = bare
        .ask(
            &chat(MODEL, "hi", false),
            &[("authorization", "Bearer vllm-secret")],
        )
        .await;
    assert_eq!(
        a.status, 401,
        "the client's key reached the backend: {}",
        a.body
    );
    // ...unless the pool says to forward it.
    let forwarding = Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])
        .with("forward_client_key", true)]}))
    .await;
    let a = forwarding
        .ask(
            &chat(MODEL, "hi", false),
            &[("authorization", "Bearer vllm-secret")],
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// `sluice -t` refuses a credential it cannot read, and names the key, not the secret.
#[test]
fn a_missing_credential_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.yaml");
    std::fs::write(
        &config,
        "pools:\n  - name: main\n    models: [llama]\n    backends: [{address: 127.0.0.1:9}]\n    upstream_auth: {from_env: SLUICE_TEST_NO_SUCH_VARIABLE}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["-t", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("pools[0].upstream_auth.from_env")
            && stderr.contains("SLUICE_TEST_NO_SUCH_VARIABLE"),
        "{stderr}"
    );
}

/// Header rules of the pool and of a plain route, both ways: set and removed on the way up,
/// set and hidden on the way back; on LLM answers, cache hits and plain routes alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_rules_apply_both_ways_on_llm_and_plain_routes() {
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_record_requests(20),
    )
    .await
    .unwrap();
    let rules = json!({
        "request": {"set": {"x-team": "llm"}, "remove": ["x-debug"]},
        "response": {"set": {"strict-transport-security": "max-age=31536000"},
                     "hide": ["server"]},
    });
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()]).with("headers", rules)],
        "routes": [{"name": "version", "path_prefix": "/version", "pool": "main",
                    "headers": {"request": {"set": {"x-route": "version"}},
                                "response": {"set": {"x-served-by": "sluice"}}}}],
        "plugins": {"cache": {"enabled": true, "tenant": {"anonymous": "share"}}},
    }))
    .await;
    let sent = [("x-team", "spoofed"), ("x-debug", "1")];
    let mut request = chat(MODEL, "rules", false);
    request["temperature"] = json!(0);
    let a = proxy.ask(&request, &sent).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let hit = proxy.until_hit(&request, &sent).await;
    for answer in [&a, &hit] {
        assert_eq!(
            answer.headers["strict-transport-security"],
            "max-age=31536000"
        );
        assert!(
            answer.headers.get("server").is_none(),
            "server: uvicorn was not hidden"
        );
    }
    let up = chats(&upstream).into_iter().last().unwrap();
    assert_eq!(up.header("x-team"), Some("llm"));
    assert_eq!(up.header("x-debug"), None);

    // A plain route: the pool's rules, then the route's.
    let r = client()
        .get(proxy.url("/version"))
        .header("x-debug", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-served-by"], "sluice");
    assert_eq!(r.headers()["strict-transport-security"], "max-age=31536000");
    let up = upstream
        .stats()
        .recent
        .into_iter()
        .rev()
        .find(|r| r.path == "/version")
        .unwrap();
    assert_eq!(up.header("x-route"), Some("version"));
    assert_eq!(up.header("x-team"), Some("llm"));
    assert_eq!(up.header("x-debug"), None);
}
