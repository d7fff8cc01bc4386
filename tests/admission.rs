//! A pool's admission, as every plugin sees it: asked of the pool, computed from its live load.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::{Duration, Instant};
use vllm_sim::SimConfig;

const MODEL: &str = "llama";

/// How often the pools are scraped here.
const SCRAPE_INTERVAL: Duration = Duration::from_millis(100);

async fn sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()]),
    )
    .await
    .expect("sim")
}

fn scraped_often(p: Pool) -> Pool {
    p.with(
        "health",
        json!({"interval": "100ms", "timeout": "300ms", "stale_after": "1s"}),
    )
}

/// A draft and a target pool, scraped often, with the selector and the breaker.
async fn speculative_with_breaker(draft: &vllm_sim::Sim, target: &vllm_sim::Sim) -> Proxy {
    Proxy::start(json!({
        "pools": [
            scraped_often(pool("draft", &[MODEL], &[draft.addr()])),
            scraped_often(pool("target", &[MODEL], &[target.addr()])),
        ],
        "plugins": {
            "speculative": {"enabled": true, "models": [
                {"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"}]},
            "kv_breaker": {"enabled": true},
        },
    }))
    .await
}

/// The pools that served `n` requests for the speculative model, in order.
async fn pools_serving(proxy: &Proxy, n: usize) -> Vec<String> {
    let mut served = Vec::new();
    for i in 0..n {
        let a = proxy
            .ask(&chat(MODEL, &format!("question {i}"), false), &[])
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        served.push(
            a.headers
                .get("x-sluice-pool")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_string(),
        );
    }
    served
}

/// The KV usage last scraped from the first backend of the `pool`th pool.
async fn scraped_kv(proxy: &Proxy, pool: usize) -> Option<f64> {
    let status: Value = proxy.status().await;
    status["pools"][pool]["backends"][0]["kv_cache_usage"].as_f64()
}

/// Whether, within 5 s, a scrape of the `pool`th pool's first backend shows a usage `seen`
/// accepts.
async fn scraped(proxy: &Proxy, pool: usize, seen: impl Fn(f64) -> bool) -> bool {
    wait_for(Duration::from_secs(5), || async {
        scraped_kv(proxy, pool).await.is_some_and(&seen)
    })
    .await
    .is_some()
}

/// The latch this replaced: a pool's "shedding" bit was recomputed only when the KV breaker
/// judged a request for that pool, so after one pressure spike on the draft pool the
/// selector sent every request to the target, and the breaker never looked at the draft
/// again: it stayed "shedding" at KV 0.1 for minutes. Admission is now asked of the pool and
/// computed from its load each time, so the draft takes traffic again as soon as a scrape
/// shows its pressure fell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_draft_pool_takes_traffic_again_within_one_scrape_after_its_pressure_falls() {
    let (draft, target) = (sim().await, sim().await);
    let proxy = speculative_with_breaker(&draft, &target).await;
    let first = scraped(&proxy, 0, |_| true).await;
    assert!(first, "the draft was scraped");
    assert_eq!(pools_serving(&proxy, 10).await, vec!["draft"; 10]);

    // A spike on the draft: its requests go to the target meanwhile.
    draft.set_phantom_kv(0.95);
    let seen = scraped(&proxy, 0, |kv| kv >= 0.9).await;
    assert!(seen, "the spike was scraped");
    assert_eq!(pools_serving(&proxy, 5).await, vec!["target"; 5]);

    // The spike is over: from the first scrape that shows it, the draft serves again.
    draft.set_phantom_kv(0.0);
    let fallen = Instant::now();
    let seen = scraped(&proxy, 0, |kv| kv < 0.5).await;
    assert!(seen, "the fall was scraped");
    assert!(
        fallen.elapsed() < SCRAPE_INTERVAL * 5,
        "the scrape came late: {:?}",
        fallen.elapsed()
    );
    assert_eq!(pools_serving(&proxy, 10).await, vec!["draft"; 10]);
    let shedding = proxy
        .metric(r#"sluice_breaker_shedding{pool="draft",priority="standard"}"#)
        .await;
    assert_eq!(
        shedding,
        Some(0.0),
        "the breaker's gauge follows the pool's load"
    );
}

/// Overload is answered with the status the operator chose for it (here 429), with a
/// `retry-after` and the reason machine-readable in a header and in the body; "no healthy
/// backend" stays a 503, so a client can tell "busy" from "down".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_has_a_status_of_its_own_and_says_why() {
    let busy = sim().await;
    let dead = reserve_port();
    let proxy = Proxy::start(json!({
        "pools": [
            scraped_often(pool("busy", &[MODEL], &[busy.addr()])),
            scraped_often(pool("down", &["other"], &[dead.addr()])),
        ],
        // Refused at once: the wait is tested below.
        "plugins": {"kv_breaker": {
            "enabled": true, "overload_status": 429, "queue": {"enabled": false}}},
    }))
    .await;
    busy.set_phantom_kv(0.99);
    let seen = scraped(&proxy, 0, |kv| kv >= 0.9).await;
    assert!(seen, "the pressure was scraped");

    let shed = proxy.ask(&chat(MODEL, "hi", false), &[]).await;
    assert_eq!(shed.status, 429, "{}", shed.body);
    assert!(shed.headers.get("retry-after").is_some());
    assert_eq!(shed.headers["x-sluice-rejected"], "kv-pressure");
    let body: Value = serde_json::from_str(&shed.body).unwrap();
    assert_eq!(body["error"]["code"], 429);
    assert_eq!(body["error"]["type"], "RateLimitError");
    assert_eq!(
        body["error"]["reason"], "kv-pressure",
        "the reason in the body too"
    );

    let probed = wait_for(Duration::from_secs(5), || async {
        proxy.backend_status("down", dead.addr()).await["health"] == "unhealthy"
    })
    .await;
    assert!(
        probed.is_some(),
        "the dead backend was never found unhealthy: {}",
        proxy.status().await
    );
    let down = proxy.ask(&chat("other", "hi", false), &[]).await;
    assert_eq!(down.status, 503, "{}", down.body);
    assert_eq!(down.headers["x-sluice-rejected"], "no-healthy-backend");
}

/// The breaker counts what the GPU will hold: `n` (and `best_of`) sequences each hold their
/// own output, so a request asking for 128 of them is judged as 128, not as one completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sequence_a_request_asks_for_counts_against_the_kv_cache() {
    // A KV cache of 16,000 tokens.
    let small = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_kv(1000, 16),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({
        "pools": [scraped_often(pool("small", &[MODEL], &[small.addr()]))],
        "plugins": {"kv_breaker": {"enabled": true}},
    }))
    .await;
    let seen = scraped(&proxy, 0, |_| true).await;
    assert!(seen, "scraped");
    let mut one = chat(MODEL, "a short answer", false);
    one["max_tokens"] = json!(120);
    let a = proxy.ask(&one, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);

    // 128 × 120 tokens = 96 % of the cache: past the standard class's line (85 %) on its own,
    // so it is refused at once: no wait in the queue could make room for it.
    let mut many = one.clone();
    many["n"] = json!(128);
    let a = proxy.ask(&many, &[]).await;
    assert_eq!(a.status, 503, "got {} ({} bytes)", a.status, a.body.len());
    assert_eq!(a.headers["x-sluice-rejected"], "kv-pressure");
}

/// A reroute, like any choice of pool, goes only where the request can be served: with the
/// target shedding, a prompt too long for the draft's context gets the 503 it would have had,
/// not the draft's own "context too long" 400, which would tell the client its request is
/// wrong when the fleet is only busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reroute_to_a_pool_whose_context_cannot_hold_the_request() {
    let draft = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_max_model_len(2048)
            .with_record_requests(10),
    )
    .await
    .unwrap();
    let target = sim().await;
    let proxy = Proxy::start(json!({
        "pools": [
            scraped_often(pool("draft", &[MODEL], &[draft.addr()])).with("max_model_len", 2048),
            scraped_often(pool("target", &[MODEL], &[target.addr()])),
        ],
        "plugins": {
            "speculative": {"enabled": true, "models": [
                {"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"}]},
            "kv_breaker": {"enabled": true, "queue": {"enabled": false}},
        },
    }))
    .await;
    target.set_phantom_kv(0.99);
    let seen = scraped(&proxy, 1, |kv| kv >= 0.9).await;
    assert!(seen, "the target's pressure was scraped");

    // About 3,000 tokens: more than the draft's 2,048.
    let long = chat(MODEL, &"word ".repeat(2_400), false);
    let a = proxy.ask(&long, &[]).await;
    assert_eq!(
        a.status,
        503,
        "got {}: {}",
        a.status,
        &a.body[..a.body.len().min(300)]
    );
    assert!(a.headers.get("retry-after").is_some());
    assert_eq!(a.headers["x-sluice-rejected"], "kv-pressure");
    assert_eq!(draft.stats().count("/v1/chat/completions"), 0);
}

/// A request its pool cannot admit waits in the pool's queue for capacity instead of being
/// refused at once, so a short spike is absorbed: two queued requests get 200 once the
/// pressure falls. Bounded: a full queue refuses at once (`queue-full`), a wait has an end
/// (`queue-timeout`), `sheddable` requests do not wait, and a client that leaves gives its
/// place up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_in_a_bounded_queue_for_capacity_before_it_is_refused() {
    let busy = sim().await;
    let proxy = Proxy::start(json!({
        "pools": [scraped_often(pool("busy", &[MODEL], &[busy.addr()]))],
        "plugins": {"kv_breaker": {"enabled": true, "queue": {
            "max_wait": {"standard": "3s", "critical": "3s"}, "max_queued": 2}}},
    }))
    .await;
    let depth = r#"sluice_admission_queue_depth{pool="busy",priority="standard"}"#;
    let waited = |result: &str| {
        format!(r#"sluice_admission_wait_seconds_count{{pool="busy",result="{result}"}}"#)
    };
    busy.set_phantom_kv(0.99);
    assert!(scraped(&proxy, 0, |kv| kv >= 0.9).await, "pressure scraped");

    let sheddable = [("x-sluice-priority", "sheddable")];
    let shed = proxy.ask(&chat(MODEL, "no wait", false), &sheddable).await;
    assert_eq!(shed.status, 503, "{}", shed.body);
    assert_eq!(shed.headers["x-sluice-rejected"], "kv-pressure");

    // Two standard requests wait; a third finds the queue full; then the pressure falls.
    let third = async {
        let queued = wait_for(Duration::from_secs(5), || async {
            proxy.metric(depth).await == Some(2.0)
        })
        .await;
        assert!(queued.is_some(), "two requests queued");
        let full = proxy.ask(&chat(MODEL, "three", false), &[]).await;
        busy.set_phantom_kv(0.0);
        full
    };
    let (first, second) = (chat(MODEL, "one", false), chat(MODEL, "two", false));
    let (one, two, full) = tokio::join!(proxy.ask(&first, &[]), proxy.ask(&second, &[]), third);
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(two.status, 200, "{}", two.body);
    assert_eq!(full.status, 503, "{}", full.body);
    assert_eq!(full.headers["x-sluice-rejected"], "queue-full");
    assert!(full.headers.get("retry-after").is_some());
    assert_eq!(proxy.metric(&waited("admitted")).await, Some(2.0));
    assert_eq!(proxy.metric(depth).await, Some(0.0));

    // A wait that capacity never ends.
    busy.set_phantom_kv(0.99);
    assert!(scraped(&proxy, 0, |kv| kv >= 0.9).await, "pressure scraped");
    let started = Instant::now();
    let late = proxy.ask(&chat(MODEL, "too late", false), &[]).await;
    assert_eq!(late.status, 503, "{}", late.body);
    assert_eq!(late.headers["x-sluice-rejected"], "queue-timeout");
    let body: Value = serde_json::from_str(&late.body).unwrap();
    assert_eq!(body["error"]["reason"], "queue-timeout");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("admission wait"));
    assert!(
        started.elapsed() >= Duration::from_millis(2900),
        "it waited"
    );
    assert_eq!(proxy.metric(&waited("timeout")).await, Some(1.0));

    // A client that gives up while waiting leaves the queue.
    let gave_up = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat(MODEL, "gone", false))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(gave_up.is_err(), "the client timed out");
    let left = wait_for(Duration::from_secs(5), || async {
        proxy.metric(&waited("client_gone")).await == Some(1.0)
    })
    .await;
    assert!(left.is_some(), "the wait ended when the client left");
    assert_eq!(proxy.metric(depth).await, Some(0.0));
}

/// The class is a fact decided before any plugin's `request` hook reads it: the selector
/// judges the draft for a `critical` request as `critical`. At KV 0.9 the draft sheds
/// `standard` (0.85) but not `critical` (0.95): a critical request stays on the draft, a
/// standard one goes to the 9× target. (The selector read the class before the breaker
/// decided it, and judged every request as `standard`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_selector_judges_a_critical_request_as_critical() {
    let (draft, target) = (sim().await, sim().await);
    let proxy = speculative_with_breaker(&draft, &target).await;
    draft.set_phantom_kv(0.9);
    assert!(
        scraped(&proxy, 0, |kv| kv >= 0.89).await,
        "pressure scraped"
    );
    let ask = |priority: &'static str| {
        let proxy = &proxy;
        async move {
            let a = proxy
                .ask(
                    &chat(MODEL, &format!("a {priority} question"), false),
                    &[("x-sluice-priority", priority)],
                )
                .await;
            assert_eq!(a.status, 200, "{}", a.body);
            a.headers["x-sluice-pool"].to_str().unwrap().to_string()
        }
    };
    assert_eq!(ask("standard").await, "target");
    assert_eq!(ask("critical").await, "draft");
}
