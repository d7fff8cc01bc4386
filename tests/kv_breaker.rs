//! The KV-pressure breaker end to end, against a simulator in its out-of-memory mode: a burst
//! of long requests overflows the KV cache without the breaker and never with it.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use vllm_sim::{Latency, SimConfig};

const MODEL: &str = "test-model";

/// The `plugins` section that turns the breaker on, with default thresholds.
fn breaker_on() -> Value {
    json!({"kv_breaker": {"enabled": true}})
}

/// 1000 blocks of 16 tokens; every answer is 300 tokens at 5 ms each (1.5 s), and a request
/// that does not fit the free blocks fails like a CUDA OOM.
async fn oom_sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_kv(1000, 16)
            .with_oom(true)
            .with_answer_tokens(300, 300)
            .with_latency(Latency::new(
                Duration::ZERO,
                Duration::ZERO,
                Duration::from_millis(5),
            )),
    )
    .await
    .expect("sim")
}

/// A long request: about 100 prompt tokens and 300 output tokens, 26 KV blocks in all.
fn long_request(i: usize) -> serde_json::Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("{i:04} {}", "abcd ".repeat(79))}],
        "max_tokens": 300,
    })
}

struct Burst {
    statuses: Vec<(String, u16, Option<u32>)>,
}

impl Burst {
    fn count(&self, priority: &str, status: u16) -> usize {
        self.statuses
            .iter()
            .filter(|(p, s, _)| p == priority && *s == status)
            .count()
    }
}

/// `sheddable` + `critical` concurrent requests, the critical ones 200 ms after the others:
/// the sheddable ones fill the pool to their class's line, and the critical ones, admitted
/// above it, take the pool past it, so that the class is shed as a whole. (Arriving first,
/// the critical ones would leave each sheddable request to be refused on its own, and the
/// pool below the line.)
async fn burst(proxy: &Arc<Proxy>, sheddable: usize, critical: usize) -> Burst {
    let mut tasks = Vec::new();
    for i in 0..sheddable + critical {
        let priority = if i < sheddable {
            "sheddable"
        } else {
            "critical"
        };
        if i == sheddable {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let proxy = proxy.clone();
        tasks.push(tokio::spawn(async move {
            let r = proxy
                .ask(&long_request(i), &[("x-sluice-priority", priority)])
                .await;
            let retry_after = r
                .headers
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse().ok());
            (priority.to_string(), r.status, retry_after)
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    Burst { statuses }
}

/// A proxy in front of `sim` with the `plugins` section `plugins`.
async fn start(sim: &vllm_sim::Sim, plugins: Value) -> Arc<Proxy> {
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()]).with_fast_health_checks()],
        "plugins": plugins,
    }))
    .await;
    // The breaker needs to know the cache's size before the burst.
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("main", sim.addr()).await["kv_capacity_tokens"] == 16_000
    })
    .await
    .is_some());
    Arc::new(proxy)
}

/// A control of the simulator, not a test of Sluice: the burst the breaker test sends does run
/// the simulated KV cache out of memory when nothing sheds, so that "no OOM with the breaker"
/// there means something.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulator_control_a_burst_without_the_breaker_runs_the_kv_cache_out_of_memory() {
    let sim = oom_sim().await;
    let proxy = start(&sim, json!({})).await;
    let b = burst(&proxy, 60, 5).await;
    let oom = sim.stats().oom;
    assert!(oom > 0, "the simulator ran out of KV cache: {oom}");
    assert!(b.count("sheddable", 500) + b.count("critical", 500) > 0);
    println!("breaker off: {oom} OOMs in a burst of 65");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_sheds_low_priority_first_and_prevents_oom_then_recovers() {
    let sim = oom_sim().await;
    let proxy = start(&sim, breaker_on()).await;
    // The shedding gauge, watched while the burst runs: it is on while the pool is full,
    // and may be off again by the time the burst's last answer is in.
    let watching = Arc::new(AtomicBool::new(true));
    let gauge_seen = tokio::spawn({
        let (proxy, watching) = (proxy.clone(), watching.clone());
        async move {
            let mut seen = Vec::new();
            while watching.load(Ordering::Relaxed) {
                seen.push(
                    proxy
                        .metric(r#"sluice_breaker_shedding{pool="main",priority="sheddable"}"#)
                        .await,
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        }
    });
    let b = burst(&proxy, 60, 5).await;
    watching.store(false, Ordering::Relaxed);
    let gauge_seen = gauge_seen.await.unwrap();

    assert_eq!(sim.stats().oom, 0, "no OOM with the breaker on");
    let shed = b.count("sheddable", 503);
    assert!(shed > 0, "{:?}", b.statuses);
    assert_eq!(b.count("critical", 200), 5, "{:?}", b.statuses);
    assert_eq!(
        b.count("sheddable", 200) + shed,
        60,
        "every sheddable request was served or shed: {:?}",
        b.statuses
    );
    for (_, status, retry_after) in &b.statuses {
        if *status == 503 {
            let secs = retry_after.expect("retry-after on every 503");
            assert!((1..=30).contains(&secs), "{secs}");
        }
    }
    let metrics = proxy.metrics().await;
    assert_eq!(
        metric_value(
            &metrics,
            r#"router_rejections_total{priority="sheddable",reason="kv-pressure"}"#
        ),
        Some(shed as f64),
        "{metrics}"
    );
    assert!(
        gauge_seen.contains(&Some(1.0)),
        "the shedding gauge was on during the burst: {gauge_seen:?}"
    );
    assert!(gauge_seen
        .iter()
        .all(|g| matches!(g, Some(v) if *v == 0.0 || *v == 1.0)));
    println!(
        "breaker on: {} sheddable served, {shed} shed with 503, 5/5 critical served, 0 OOMs",
        b.count("sheddable", 200)
    );

    // Recovery: once the burst is over and a scrape shows it, traffic is admitted again and
    // the breaker closes.
    let recovered = wait_for(Duration::from_secs(5), || async {
        proxy
            .ask(&long_request(9999), &[("x-sluice-priority", "sheddable")])
            .await
            .status
            == 200
    })
    .await;
    assert!(recovered.is_some());
    let status = proxy.status().await;
    assert_eq!(status["pools"][0]["breaker"]["state"], "closed", "{status}");
    assert_eq!(
        proxy
            .metric(r#"sluice_breaker_shedding{pool="main",priority="sheddable"}"#)
            .await,
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_pressure_pool_sends_requests_to_another_pool_of_the_model() {
    let full = oom_sim().await;
    let spare = oom_sim().await;
    let proxy = Proxy::start(json!({
        "pools": [
            pool("first", &[MODEL], &[full.addr()]).with_fast_health_checks(),
            pool("second", &[MODEL], &[spare.addr()]).with_fast_health_checks(),
        ],
        "plugins": {"kv_breaker": {
            "enabled": true,
            "thresholds": {
                "sheddable": {"shed_above": 0.1, "resume_below": 0.05},
                "standard": {"shed_above": 0.2, "resume_below": 0.15},
            },
        }},
    }))
    .await;
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("second", spare.addr()).await["kv_capacity_tokens"] == 16_000
            && proxy.backend_status("first", full.addr()).await["kv_capacity_tokens"] == 16_000
    })
    .await
    .is_some());
    // Fill the first pool's backend directly: 15 requests hold 39% of its cache.
    let mut fillers = Vec::new();
    for i in 0..15 {
        let url = format!("{}/v1/chat/completions", full.url());
        fillers.push(tokio::spawn(async move {
            client()
                .post(url)
                .json(&long_request(i))
                .send()
                .await
                .map(|r| r.status())
        }));
    }
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("first", full.addr()).await["kv_cache_usage"]
            .as_f64()
            .is_some_and(|kv| kv > 0.2)
    })
    .await
    .is_some());
    let r = proxy.ask(&chat(MODEL, "hi", false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-sluice-pool"], "second");
    let metrics = proxy.metrics().await;
    assert_eq!(
        metric_value(
            &metrics,
            r#"sluice_breaker_rerouted_total{from="first",to="second"}"#
        ),
        Some(1.0),
        "{metrics}"
    );
    for f in fillers {
        let _ = f.await;
    }
}

/// A waiter too large to fit yet, kept at the head of the queue, held back every request
/// behind it: an almost idle pool answered every standard request `queue-timeout`. A request
/// that fits is now admitted at once, whatever waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_waiter_at_the_head_does_not_hold_back_requests_that_fit() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_kv(1000, 16)
            .with_answer_tokens(5, 5),
    )
    .await
    .expect("sim");
    sim.set_phantom_kv(0.1);
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()]).with_fast_health_checks()],
        "plugins": {"kv_breaker": {"enabled": true,
            "queue": {"max_wait": {"critical": "20s", "standard": "2s"}}}},
    }))
    .await;
    let proxy = Arc::new(proxy);
    let scraped = wait_for(Duration::from_secs(5), || async {
        proxy.backend_status("main", sim.addr()).await["kv_cache_usage"]
            .as_f64()
            .is_some_and(|kv| kv >= 0.09)
    })
    .await;
    assert!(scraped.is_some(), "the pool's usage was scraped");
    // 9 × 1,600 tokens: 90 % of the cache, on top of the 10 % held: it waits.
    let big = tokio::spawn({
        let proxy = proxy.clone();
        async move {
            let request = json!({"model": MODEL, "n": 9, "max_tokens": 1600,
                                 "messages": [{"role": "user", "content": "big"}]});
            proxy
                .ask(&request, &[("x-sluice-priority", "critical")])
                .await
        }
    });
    let depth = r#"sluice_admission_queue_depth{pool="main",priority="critical"}"#;
    let waiting = wait_for(Duration::from_secs(5), || async {
        proxy.metric(depth).await == Some(1.0)
    })
    .await;
    assert!(waiting.is_some(), "the large request waits at the head");
    for i in 0..5 {
        let mut small = chat(MODEL, &format!("small {i}"), false);
        small["max_tokens"] = json!(5);
        let a = proxy
            .ask(&small, &[("x-sluice-priority", "standard")])
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert_eq!(proxy.metric(depth).await, Some(1.0), "still waiting");
    big.abort();
}

/// A stream read slowly kept its whole projected KV until the client had read it all, long
/// after the engine had finished it and freed its blocks: the breaker shed others on load
/// that no longer existed. The projection now counts only what the engine still runs, by
/// its scrapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_has_finished_holds_no_projected_kv_while_its_reader_is_slow() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_kv(4000, 16)
            .with_answer_tokens(4000, 4000)
            .with_latency(Latency::new(
                Duration::ZERO,
                Duration::ZERO,
                Duration::from_millis(1),
            )),
    )
    .await
    .expect("sim");
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()]).with_fast_health_checks()],
        "plugins": {"kv_breaker": {"enabled": true}},
    }))
    .await;
    // A client that reads the start of its answer, then nothing: about 8 MB of events wait.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(proxy.addr).await.unwrap();
    let body = serde_json::to_vec(&json!({"model": MODEL, "stream": true, "n": 8,
        "max_tokens": 4000, "messages": [{"role": "user", "content": "a long story"}]}))
    .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&body).await.unwrap();
    let mut start = [0u8; 512];
    let n = slow.read(&mut start).await.unwrap();
    assert!(String::from_utf8_lossy(&start[..n]).starts_with("HTTP/1.1 200"));

    // The engine finishes generating (its blocks freed) while the client reads nothing.
    let began = wait_for(Duration::from_secs(10), || async {
        sim.engine_state().running > 0
    })
    .await;
    assert!(began.is_some(), "the engine never ran the request");
    let finished = wait_for(Duration::from_secs(30), || async {
        sim.engine_state().running == 0
    })
    .await;
    assert!(finished.is_some(), "the engine never finished");
    let released = wait_for(Duration::from_secs(10), || async {
        let state = proxy.backend_status("main", sim.addr()).await;
        state["projected_kv_cache_usage"]
            .as_f64()
            .is_some_and(|kv| kv < 0.1)
    })
    .await;
    let state = proxy.backend_status("main", sim.addr()).await;
    assert!(released.is_some(), "still projected: {state}");
    let mut sheddable = chat(MODEL, "room for me", false);
    sheddable["max_tokens"] = json!(2000);
    let a = proxy
        .ask(&sheddable, &[("x-sluice-priority", "sheddable")])
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    drop(slow);
}

/// A `previous_response_id` follow-up with a tiny input was admitted and projected as a few
/// tokens while the engine prefilled the whole stored conversation. The note of the response
/// now carries the conversation's size, and the follow-up is projected with it: on a cache
/// the conversation fills past the sheddable class's line, a sheddable follow-up is shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_is_projected_with_its_conversation() {
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_kv(1000, 16)
            .with_responses_store(true)
            .with_answer_tokens(4, 4),
    )
    .await
    .expect("sim");
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[sim.addr()]).with_fast_health_checks()],
        "plugins": {"kv_breaker": {"enabled": true, "thresholds": {
            "sheddable": {"shed_above": 0.5, "resume_below": 0.4},
        }}},
    }))
    .await;
    assert!(wait_for(Duration::from_secs(3), || async {
        proxy.backend_status("main", sim.addr()).await["kv_capacity_tokens"] == 16_000
    })
    .await
    .is_some());
    // A conversation of about 10,000 tokens (of the cache's 16,000).
    let responses = proxy.url("/v1/responses");
    let made = ask_url(
        &responses,
        &json!({"model": MODEL, "input": "abcd ".repeat(10_000), "max_output_tokens": 4}),
        &[("x-sluice-priority", "critical")],
    )
    .await;
    assert_eq!(made.status, 200, "{}", made.body);
    let made: Value = serde_json::from_str(&made.body).unwrap();
    let conversation = made["usage"]["total_tokens"].as_u64().unwrap();
    assert!(conversation > 8_000, "{made}");
    // Once the engine is seen to have finished it, nothing is held or projected.
    let idle = wait_for(Duration::from_secs(10), || async {
        let backend = proxy.backend_status("main", sim.addr()).await;
        backend["projected_kv_cache_usage"]
            .as_f64()
            .is_some_and(|p| p < 0.05)
    })
    .await;
    assert!(idle.is_some(), "{}", proxy.status().await);
    // A follow-up of a few new tokens, projected with its conversation.
    let follow_up = json!({"model": MODEL, "input": "ok", "max_output_tokens": 4,
                           "previous_response_id": made["id"]});
    let shed = ask_url(
        &responses,
        &follow_up,
        &[("x-sluice-priority", "sheddable")],
    )
    .await;
    assert_eq!(shed.status, 503, "{}", shed.body);
    assert_eq!(
        shed.headers
            .get("x-sluice-rejected")
            .and_then(|v| v.to_str().ok()),
        Some("kv-pressure")
    );
    // A critical one is admitted, and served where the conversation is.
    let served = ask_url(&responses, &follow_up, &[("x-sluice-priority", "critical")]).await;
    assert_eq!(served.status, 200, "{}", served.body);
}
