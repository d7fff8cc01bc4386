//! `sluice demo`, as the README runs it: its commands work as printed.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use sluice_testkit::*;
use std::time::Duration;

/// The README's keyless request hits the cache the second time; the demo's tenants get their
/// limits: alpha's sixth request of a minute gets 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_serves_the_readmes_requests_and_its_tenants_limits() {
    let (proxy, admin) = (reserve_port().release(), reserve_port().release());
    let demo = Demo::start(proxy, admin);
    let url = format!("http://127.0.0.1:{proxy}/v1/chat/completions");
    let ready = wait_for(Duration::from_secs(30), || async {
        client()
            .get(format!("http://127.0.0.1:{admin}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(ready.is_some(), "the demo did not get ready");

    let hello = json!({"model": "meta-llama/Llama-3.2-1B-Instruct",
                       "messages": [{"role": "user", "content": "Hello!"}], "temperature": 0});
    let first = ask_url(&url, &hello, &[]).await;
    // The entry is stored as the answer ends: the next request, or one soon after, hits.
    let hit = wait_for(Duration::from_secs(10), || async {
        ask_url(&url, &hello, &[]).await.x_cache == "HIT"
    })
    .await;
    // vLLM's docs have clients send the key `EMPTY`: the demo says which keys it takes.
    let empty = ask_url(&url, &hello, &[("authorization", "Bearer EMPTY")]).await;
    let alpha = [("authorization", "Bearer sk-alpha-demo")];
    let mut alpha_statuses = Vec::new();
    for i in 0..6 {
        let body =
            json!({"model": "llama", "messages": [{"role": "user", "content": format!("q{i}")}]});
        alpha_statuses.push(ask_url(&url, &body, &alpha).await.status);
    }
    drop(demo);

    assert_eq!(first.status, 200, "{}", first.body);
    assert!(hit.is_some(), "the README's request, again, is a cache hit");
    assert_eq!(empty.status, 401, "{}", empty.body);
    assert!(empty.body.contains("sk-alpha-demo"), "{}", empty.body);
    assert_eq!(alpha_statuses, [200, 200, 200, 200, 200, 429]);
}
