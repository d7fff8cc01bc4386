//! Balancing on predicted time to first token, end to end against simulators that prefill one
//! request at a time (as vLLM without chunked prefill does): Sluice's own accounting of each
//! backend's outstanding prefill, the prefill speed it learns, and the choices made from them.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::net::SocketAddr;
use std::time::Duration;
use vllm_sim::{Latency, SimConfig};

const MODEL: &str = "test-model";

/// A simulator that prefills one request at a time at `per_token`, with no other latency.
async fn serial_sim(per_token: Duration) -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_serial_prefill(true)
            .with_answer_tokens(4, 4)
            .with_latency(Latency::new(Duration::ZERO, per_token, Duration::ZERO)),
    )
    .await
    .expect("sim")
}

/// A chat request whose prompt is about `tokens` tokens (four bytes each), starting with
/// `prefix`.
fn prompt(prefix: &str, tokens: usize, stream: bool) -> Value {
    let filler = "abc ".repeat(tokens.saturating_sub(prefix.len() / 4));
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("{prefix}{filler}")}],
        "stream": stream,
        "max_tokens": 4,
    })
}

/// A proxy with one pool `main` over `sims`, balanced as `balancing` says.
async fn proxy(sims: &[SocketAddr], balancing: Value) -> Proxy {
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], sims)
            .with_fast_health_checks()
            .with("balancing", balancing)],
    }))
    .await;
    for addr in sims {
        let healthy = wait_for(Duration::from_secs(5), || async {
            proxy.backend_status("main", *addr).await["health"] == "healthy"
        })
        .await;
        assert!(healthy.is_some(), "{addr} never became healthy");
    }
    proxy
}

fn ttft(extra: Value) -> Value {
    let mut balancing = json!({"strategy": "ttft", "exploration": 0});
    if let (Value::Object(b), Value::Object(extra)) = (&mut balancing, extra) {
        b.extend(extra);
    }
    balancing
}

/// Sends `body` in the background, and returns once a simulator has admitted it.
async fn send_long(
    proxy: &Proxy,
    sims: &[&vllm_sim::Sim],
    body: Value,
) -> tokio::task::JoinHandle<Answer> {
    let before: u64 = sims.iter().map(|s| upstream_calls(s)).sum();
    let url = proxy.url("/v1/chat/completions");
    let task = tokio::spawn(async move { ask_url(&url, &body, &[]).await });
    let reached = wait_for(Duration::from_secs(5), || async {
        sims.iter().map(|s| upstream_calls(s)).sum::<u64>() > before
    })
    .await;
    assert!(
        reached.is_some(),
        "the long request never reached a backend"
    );
    task
}

/// Every backend's own accounting, from `/status`: requests prefilling and decoding, and the
/// outstanding prefill tokens.
async fn accounting(proxy: &Proxy) -> Vec<(u64, u64, u64)> {
    let status = proxy.status().await;
    status["pools"][0]["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| {
            (
                b["prefilling"].as_u64().expect("prefilling"),
                b["outstanding_prefill_tokens"].as_u64().expect("tokens"),
                b["decoding"].as_u64().expect("decoding"),
            )
        })
        .collect()
}

#[tokio::test]
async fn the_accounting_balances_to_zero_after_normal_failed_and_cancelled_requests() {
    // 4,000 prompt tokens take 1 s to prefill.
    let sim = serial_sim(Duration::from_micros(250)).await;
    let proxy = proxy(&[sim.addr()], ttft(json!({}))).await;

    // Normal: streamed and whole.
    for stream in [true, false] {
        let a = proxy.ask(&prompt("", 200, stream), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    // Cancelled before its first byte: counted while it prefills, then given back.
    let long = send_long(&proxy, &[&sim], prompt("", 4_000, true)).await;
    let counted = accounting(&proxy).await;
    assert_eq!(counted[0].0, 1, "{counted:?}");
    assert!(
        counted[0].1 >= 3_900,
        "the prompt is outstanding: {counted:?}"
    );
    long.abort();
    // Failed: the backend answers 500 (an injected fault) or refuses (a bad request).
    sim.set_faults(vllm_sim::Faults {
        error_rate: 1.0,
        error_status: 500,
        ..Default::default()
    });
    let failed = proxy.ask(&prompt("", 100, true), &[]).await;
    assert!(failed.status >= 500, "{} {}", failed.status, failed.body);
    sim.set_faults(vllm_sim::Faults::default());

    let settled = wait_for(Duration::from_secs(5), || async {
        accounting(&proxy).await == vec![(0, 0, 0)]
    })
    .await;
    assert!(
        settled.is_some(),
        "still counted: {:?}",
        accounting(&proxy).await
    );
    let status = proxy.backend_status("main", sim.addr()).await;
    assert_eq!(status["in_flight"], 0);
}

#[tokio::test]
async fn the_prefill_speed_is_learned_from_first_tokens() {
    // 50 µs a token: 20,000 tokens a second; the pool starts from 5,000.
    let sim = serial_sim(Duration::from_micros(50)).await;
    let proxy = proxy(
        &[sim.addr()],
        ttft(json!({"prefill_tokens_per_second": 5000})),
    )
    .await;
    let speed = |status: &Value| status["prefill_tokens_per_second"].as_f64().expect("speed");
    assert_eq!(
        speed(&proxy.backend_status("main", sim.addr()).await),
        5_000.0
    );
    for _ in 0..25 {
        let a = proxy.ask(&prompt("", 2_000, true), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let status = proxy.backend_status("main", sim.addr()).await;
    let learned = speed(&status);
    assert!(
        (15_000.0..=24_000.0).contains(&learned),
        "learned {learned} tokens/s for 20,000: {status}"
    );
    assert!(status["prefill_speed_samples"].as_u64().unwrap() >= 20);
    // The prediction for a 1,000-token prompt follows the speed: about 50 ms.
    let predicted = status["predicted_ttft_seconds"].as_f64().unwrap();
    assert!((0.03..=0.08).contains(&predicted), "{predicted}");
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(
            "sluice_pool_ttft_prediction_error_seconds_count{direction=\"late\",pool=\"main\"}"
        ) || metrics.contains(
            "sluice_pool_ttft_prediction_error_seconds_count{direction=\"early\",pool=\"main\"}"
        ),
    );
    let errors: f64 = ["early", "late"]
        .iter()
        .filter_map(|d| {
            metric_value(
                &metrics,
                &format!(
                    "sluice_pool_ttft_prediction_error_seconds_count{{direction=\"{d}\",pool=\"main\"}}"
                ),
            )
        })
        .sum();
    assert_eq!(errors, 25.0, "one prediction error per streamed request");
}

/// A prompt its engine's prefix cache serves is not prefilled: its quick first token must not
/// teach the backend a prefill speed it does not have (the engine's usage says what it
/// computed).
#[tokio::test]
async fn prefix_cache_hits_do_not_inflate_the_prefill_speed() {
    // vLLM V1's engine, 50 µs a token: 20,000 tokens a second, the pool's seed.
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_answer_tokens(4, 4)
            .with_latency(Latency::new(
                Duration::ZERO,
                Duration::from_micros(50),
                Duration::ZERO,
            ))
            .v1_engine(8192),
    )
    .await
    .expect("sim");
    let proxy = proxy(
        &[sim.addr()],
        ttft(json!({"prefill_tokens_per_second": 20000})),
    )
    .await;
    let speed = |status: &Value| status["prefill_tokens_per_second"].as_f64().expect("speed");
    // The same 2,000-token prompt: the first is prefilled whole, the others are served from
    // the cache but for their last block (a first token in about a millisecond).
    for _ in 0..10 {
        let a = proxy.ask(&prompt("", 2_000, true), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let status = proxy.backend_status("main", sim.addr()).await;
    let learned = speed(&status);
    assert!(
        (14_000.0..=30_000.0).contains(&learned),
        "learned {learned} tokens/s for 20,000: {status}"
    );
    assert_eq!(
        status["prefill_speed_samples"], 1,
        "only the prefill taught: {status}"
    );
}

/// A pool that never asks its engines what they computed (`kv_aware`) learns their prefill
/// speed from the engines' own prefill histograms (vLLM V1), read at each scrape.
#[tokio::test]
async fn the_engines_prefill_histograms_teach_a_pool_its_speed() {
    // vLLM V1's engine at 25 µs a token: 40,000 tokens a second, 4× the default seed.
    let sim = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_answer_tokens(4, 4)
            .with_latency(Latency::new(
                Duration::ZERO,
                Duration::from_micros(25),
                Duration::ZERO,
            ))
            .v1_engine(8192),
    )
    .await
    .expect("sim");
    let proxy = proxy(&[sim.addr()], json!({"strategy": "kv_aware"})).await;
    // Distinct prompts, one at a time, until the speed learned is near the engine's (each
    // scrape that saw some finish moves it a fifth of the way).
    let speed = |status: &Value| status["prefill_tokens_per_second"].as_f64().expect("speed");
    let mut taught = false;
    for i in 0..60 {
        let a = proxy
            .ask(&prompt(&format!("prompt {i} "), 4_000, false), &[])
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        if speed(&proxy.backend_status("main", sim.addr()).await) >= 32_000.0 {
            taught = true;
            break;
        }
    }
    let status = proxy.backend_status("main", sim.addr()).await;
    assert!(taught, "never learned 40,000 tokens/s: {status}");
    assert!(speed(&status) <= 50_000.0, "{status}");
    assert_eq!(status["prefill_speed_samples"], 0, "no first token taught");
    assert!(
        status["engine_prefill_samples"].as_u64().unwrap_or(0) >= 1,
        "{status}"
    );
}

/// Where three short prompts go while one backend prefills a long one, under `balancing`:
/// the requests the busy backend got, and the other's.
async fn shorts_beside_a_long_prefill(balancing: Value) -> (u64, u64) {
    // 6,000 prompt tokens take 1.5 s to prefill.
    let a = serial_sim(Duration::from_micros(250)).await;
    let b = serial_sim(Duration::from_micros(250)).await;
    let proxy = proxy(&[a.addr(), b.addr()], balancing).await;
    let long = send_long(&proxy, &[&a, &b], prompt("", 6_000, true)).await;
    let (busy, other) = if upstream_calls(&a) == 1 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    for i in 0..3 {
        let r = proxy
            .ask(&prompt(&format!("short {i} "), 20, false), &[])
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(long.await.unwrap().status, 200);
    (upstream_calls(busy), upstream_calls(other))
}

#[tokio::test]
async fn ttft_sends_a_short_prompt_away_from_a_backend_busy_prefilling() {
    let (busy, other) = shorts_beside_a_long_prefill(ttft(json!({}))).await;
    assert_eq!(
        (busy, other),
        (1, 3),
        "ttft: every short one went to the idle backend"
    );
    // Round robin takes turns, whatever the backend is doing.
    let (busy, _) = shorts_beside_a_long_prefill(json!({"strategy": "round_robin"})).await;
    assert!(
        busy >= 2,
        "round robin sent a short prompt behind the long one"
    );
}

#[tokio::test]
async fn prefix_affinity_is_kept_when_idle_and_broken_under_load() {
    let a = serial_sim(Duration::from_micros(250)).await;
    let b = serial_sim(Duration::from_micros(250)).await;
    let proxy = proxy(
        &[a.addr(), b.addr()],
        // Seeded with the simulators' true speed, so that what the long prompt teaches its
        // backend does not tip the last choice.
        ttft(json!({"prefix_affinity_bytes": 64, "prefill_tokens_per_second": 4000})),
    )
    .await;
    let shared = "You are a helpful assistant of the Sluice test suite; be brief. ";
    assert!(shared.len() >= 64);
    // Idle: the shared prefix keeps every request on one backend.
    for _ in 0..4 {
        let r = proxy.ask(&prompt(shared, 30, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let (home, away) = if upstream_calls(&a) == 4 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert_eq!((upstream_calls(home), upstream_calls(away)), (4, 0));
    // A long prompt of the same prefix goes home too, and keeps it busy for 1.5 s: the next
    // ones would wait longer there than the cache saves them.
    let long = send_long(&proxy, &[&a, &b], prompt(shared, 6_000, true)).await;
    assert_eq!(upstream_calls(home), 5, "the long one went home");
    for _ in 0..3 {
        let r = proxy.ask(&prompt(shared, 30, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(
        upstream_calls(away),
        3,
        "affinity broken while home is busy"
    );
    assert_eq!(long.await.unwrap().status, 200);
    // Idle again: home again.
    let r = proxy.ask(&prompt(shared, 30, false), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(upstream_calls(home), 6);
}

/// A conversation's `x-session-id` keeps it on one backend: round robin alone would take
/// turns; a soft session moves off a backend busy prefilling a long prompt, a hard one stays.
#[tokio::test]
async fn a_session_stays_on_its_backend_softly_or_always() {
    let a = serial_sim(Duration::from_micros(250)).await;
    let b = serial_sim(Duration::from_micros(250)).await;
    let sims = [a.addr(), b.addr()];
    let session = |id: &str| [("x-session-id", id.to_string())];
    let served =
        |before: (u64, u64)| (upstream_calls(&a) - before.0, upstream_calls(&b) - before.1);

    let rr = proxy(
        &sims,
        json!({"strategy": "round_robin", "session_affinity": "soft"}),
    )
    .await;
    let before = (upstream_calls(&a), upstream_calls(&b));
    for i in 0..6 {
        let h = session("conversation-1");
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = rr.ask(&prompt(&format!("turn {i} "), 20, false), &h).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let (on_a, on_b) = served(before);
    assert!(
        (on_a, on_b) == (6, 0) || (on_a, on_b) == (0, 6),
        "a session was split: {on_a} + {on_b}"
    );
    let before = (upstream_calls(&a), upstream_calls(&b));
    for i in 0..6 {
        rr.ask(&prompt(&format!("no session {i} "), 20, false), &[])
            .await;
    }
    assert_eq!(
        served(before),
        (3, 3),
        "without a session, round robin takes turns"
    );
    drop(rr);

    // The session's backend busy with a long prefill (1.5 s at the simulators' 4,000 tokens a
    // second, which the balancer is told): soft moves, hard stays.
    for (mode, stays) in [("soft", false), ("hard", true)] {
        let proxy = proxy(
            &sims,
            ttft(json!({"session_affinity": mode, "prefill_tokens_per_second": 4000})),
        )
        .await;
        let id = format!("conversation-{mode}");
        let h: Vec<(&str, &str)> = vec![("x-session-id", id.as_str())];
        let a_before = upstream_calls(&a);
        proxy.ask(&prompt("first ", 20, false), &h).await;
        let home_is_a = upstream_calls(&a) > a_before;
        let home = if home_is_a { &a } else { &b };
        // The long prompt goes to the session's own backend: it is the same session.
        let home_before = upstream_calls(home);
        let long = {
            let (url, body) = (proxy.url("/v1/chat/completions"), prompt("", 6_000, true));
            let id = id.clone();
            tokio::spawn(
                async move { ask_url(&url, &body, &[("x-session-id", id.as_str())]).await },
            )
        };
        let busy = wait_for(Duration::from_secs(5), || async {
            upstream_calls(home) > home_before
        })
        .await;
        assert!(
            busy.is_some(),
            "{mode}: the long prompt never reached the session's backend"
        );
        let before = upstream_calls(home);
        let r = proxy.ask(&prompt("next turn ", 20, false), &h).await;
        assert_eq!(r.status, 200);
        let stayed = upstream_calls(home) > before;
        assert_eq!(stayed, stays, "{mode} session");
        let _ = long.await;
    }
}

/// A LoRA-serving simulator of `MODEL` with one adapter slot, its adapters `adapters`, one
/// token every 10 ms.
async fn lora_sim(adapters: &[&str]) -> vllm_sim::Sim {
    let mut lora = vllm_sim::LoraConfig::new(1);
    for name in adapters {
        lora = lora.with_module(*name, format!("/adapters/{name}"));
    }
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_latency(Latency::new(
                Duration::ZERO,
                Duration::ZERO,
                Duration::from_millis(10),
            ))
            .with_lora(lora),
    )
    .await
    .expect("sim")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_requests_go_where_it_is_listed_and_has_a_slot() {
    let only_sql = lora_sim(&["sql"]).await;
    let both = lora_sim(&["sql", "poet"]).await;
    let sims = [&only_sql, &both];
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr()).collect();
    // Round robin: without the adapters' routing, requests would alternate.
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[], &addrs)
            .with("models", "auto")
            .with_fast_health_checks()
            .with("balancing", json!({"strategy": "round_robin"}))],
    }))
    .await;
    for (addr, adapters) in [
        (addrs[0], json!(["sql"])),
        (addrs[1], json!(["sql", "poet"])),
    ] {
        wait_for(Duration::from_secs(10), || async {
            proxy.backend_status("main", addr).await["lora"]["adapters"] == adapters
        })
        .await
        .expect("the pool learns each backend's adapters from its /v1/models");
    }
    wait_for(Duration::from_secs(10), || async {
        let models = reqwest::get(proxy.url("/v1/models"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        models.contains("\"poet\"")
    })
    .await
    .expect("the pool serves the adapters its backends list");
    let ask = |model: &str, max_tokens: u32| {
        json!({"model": model, "max_tokens": max_tokens, "ignore_eos": true,
               "messages": [{"role": "user", "content": "write"}]})
    };
    let served = || sims.map(|s| s.stats().count("/v1/chat/completions"));

    // `poet` only where it is listed.
    let before = served();
    for _ in 0..6 {
        let answer = proxy.ask(&ask("poet", 2), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let after = served();
    assert_eq!((after[0] - before[0], after[1] - before[1]), (0, 6));

    // A long `poet` stream holds the second backend's only slot: `sql` goes where a slot is
    // free, rather than wait there.
    let arrived_before = served()[1];
    let long_poet = tokio::spawn({
        let url = proxy.url("/v1/chat/completions");
        let body = json!({"model": "poet", "max_tokens": 20_000, "ignore_eos": true, "stream": true,
                          "messages": [{"role": "user", "content": "a long poem"}]});
        async move {
            let mut answer = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            while answer.chunk().await.unwrap().is_some() {}
        }
    });
    // The stream must have reached its backend before the count below starts (the scrape's
    // adapters alone may still be the short requests' above: vLLM keeps the last set while
    // idle).
    wait_for(Duration::from_secs(10), || async {
        served()[1] > arrived_before
            && proxy.backend_status("main", addrs[1]).await["lora"]["active"] == json!(["poet"])
    })
    .await
    .expect("the stream reached its backend and the scrape shows the adapter in use");
    let before = served();
    for _ in 0..6 {
        let answer = proxy.ask(&ask("sql", 2), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let after = served();
    assert_eq!((after[0] - before[0], after[1] - before[1]), (6, 0));
    long_poet.abort();
}
