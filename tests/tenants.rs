//! The tenants plugin end to end: who may call, what a tenant may ask for, its limits, and
//! that no client can claim another tenant's identity, priority, tier or cached answers.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::SimConfig;

const MODEL: &str = "llama";
const ALPHA_KEY: &str = "sk-alpha-test";
const BETA_KEY: &str = "sk-beta-test";

fn bearer(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

async fn sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_record_requests(50),
    )
    .await
    .unwrap()
}

/// The tenants section: alpha and beta with their keys, `extra` merged in.
fn tenants(extra: Value) -> Value {
    let mut section = json!({
        "enabled": true,
        "tenants": {
            "alpha": {"keys": [key_digest(ALPHA_KEY)]},
            "beta": {"keys": [key_digest(BETA_KEY)], "may_force_target": true},
        },
    });
    merge(&mut section, extra);
    section
}

/// Merges `extra` into `base`, objects key by key.
fn merge(base: &mut Value, extra: Value) {
    match (base, extra) {
        (Value::Object(base), Value::Object(extra)) => {
            for (key, value) in extra {
                merge(base.entry(key).or_insert(Value::Null), value);
            }
        }
        (base, extra) => *base = extra,
    }
}

/// A proxy with one pool on `upstream` and the tenants plugin, `extra` merged into its section.
async fn tenants_proxy(upstream: &vllm_sim::Sim, extra: Value) -> Proxy {
    Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": tenants(extra)},
    }))
    .await
}

/// The body of the last request `sim` received at `path`, as JSON.
fn last_sent(sim: &vllm_sim::Sim, path: &str) -> Value {
    let sent = sim
        .stats()
        .recent
        .into_iter()
        .rev()
        .find(|r| r.path == path)
        .unwrap_or_else(|| panic!("no request at {path}"));
    serde_json::from_slice(&sent.body).unwrap()
}

async fn ask(proxy: &Proxy, body: &Value, headers: &[(&str, String)]) -> Answer {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    proxy.ask(body, &headers).await
}

fn error_body(answer: &Answer) -> Value {
    serde_json::from_str(&answer.body).unwrap_or_else(|_| panic!("JSON: {}", answer.body))
}

/// Without a key, or with a key no tenant has, a request gets OpenAI's 401, which never
/// repeats the key; with a tenant's key, in any of the headers clients send it in, it is
/// served, and the backend never sees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_needs_a_tenants_key_and_the_key_never_reaches_a_backend() {
    let upstream = sim().await;
    let proxy = tenants_proxy(&upstream, json!({})).await;
    let request = chat(MODEL, "hi", false);

    for (headers, what) in [
        (vec![], "no key"),
        (vec![bearer("sk-not-a-tenant")], "an unknown key"),
        (
            vec![("authorization", format!("Basic {ALPHA_KEY}"))],
            "another scheme",
        ),
    ] {
        let a = ask(&proxy, &request, &headers).await;
        assert_eq!(a.status, 401, "{what}: {}", a.body);
        assert_eq!(a.headers["x-sluice-rejected"], "unauthorized", "{what}");
        assert_eq!(a.headers["www-authenticate"], "Bearer", "{what}");
        assert!(
            a.headers.get("x-request-id").is_some(),
            "{what}: the id too"
        );
        let body = error_body(&a);
        assert_eq!(body["error"]["type"], "AuthenticationError", "{what}");
        assert!(
            !a.body.contains("sk-"),
            "{what}: a key in the answer: {}",
            a.body
        );
    }
    assert!(
        !proxy.logs().contains("sk-not-a-tenant"),
        "a key in the log"
    );

    for headers in [
        vec![bearer(ALPHA_KEY)],
        vec![("x-api-key", ALPHA_KEY.to_string())],
        vec![("api-key", BETA_KEY.to_string())],
    ] {
        let a = ask(&proxy, &request, &headers).await;
        assert_eq!(a.status, 200, "{headers:?}: {}", a.body);
    }
    let chats: Vec<_> = upstream
        .stats()
        .recent
        .into_iter()
        .filter(|r| r.path == "/v1/chat/completions")
        .collect();
    assert_eq!(chats.len(), 3);
    for r in chats {
        for header in ["authorization", "x-api-key", "api-key"] {
            assert_eq!(r.header(header), None, "the backend got `{header}`");
        }
    }
}

/// A tenant header names the tenant only when the connection comes from a trusted proxy;
/// from anyone else it is ignored, so it claims nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_header_counts_only_from_a_trusted_proxy() {
    let upstream = sim().await;
    let request = chat(MODEL, "hi", false);
    let header = |name: &str| ("x-sluice-tenant", name.to_string());

    let untrusted = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": tenants(json!({
            "tenant_header": "x-sluice-tenant", "trusted_proxies": ["10.0.0.0/8"]}))},
    }))
    .await;
    let a = ask(&untrusted, &request, &[header("alpha")]).await;
    assert_eq!(
        a.status, 401,
        "a spoofed tenant header was believed: {}",
        a.body
    );
    drop(untrusted);

    // This test's client is the trusted proxy (it connects from 127.0.0.1).
    let trusted = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": tenants(json!({
            "tenant_header": "x-sluice-tenant", "trusted_proxies": ["127.0.0.1"]}))},
    }))
    .await;
    assert_eq!(
        ask(&trusted, &request, &[header("alpha")]).await.status,
        200
    );
    assert_eq!(
        ask(&trusted, &request, &[header("gamma")]).await.status,
        401
    );
    // A gateway that appends its value after the client's: several values name no one.
    assert_eq!(
        ask(&trusted, &request, &[header("beta"), header("alpha")])
            .await
            .status,
        401
    );
}

/// Two tenants asking the same thing never share a cache entry; and a forced-target request
/// never gets the draft's cached answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_share_cache_entries_nor_tiers() {
    let (draft, target) = (sim().await, sim().await);
    let proxy = Proxy::start(json!({
        "pools": [
            pool("draft", &[MODEL], &[draft.addr()]),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": {
            "tenants": tenants(json!({})),
            "cache": {"enabled": true},
            "speculative": {"enabled": true, "models": [
                {"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"}]},
        },
    }))
    .await;
    let request = chat(MODEL, "one question, two tenants", false);
    let alpha = [bearer(ALPHA_KEY)];
    let beta = [bearer(BETA_KEY)];

    assert_eq!(ask(&proxy, &request, &alpha).await.x_cache, "MISS");
    let alpha_headers: Vec<(&str, &str)> = alpha.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(
        proxy.until_hit(&request, &alpha_headers).await.x_cache,
        "HIT"
    );
    assert_eq!(
        ask(&proxy, &request, &beta).await.x_cache,
        "MISS",
        "beta got alpha's entry"
    );

    // beta's answer came from the draft and is cached; forcing the target misses it.
    let beta_headers: Vec<(&str, &str)> = beta.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let hit = proxy.until_hit(&request, &beta_headers).await;
    assert_eq!(hit.headers["x-sluice-pool"], "draft");
    let forced = [bearer(BETA_KEY), ("x-sluice-tier", "target".to_string())];
    let a = ask(&proxy, &request, &forced).await;
    assert_eq!(
        a.x_cache, "MISS",
        "a forced-target request got the draft's answer"
    );
    assert_eq!(a.headers["x-sluice-pool"], "target");
    assert_eq!(a.headers["x-sluice-escalated"], "forced");
}

/// What a tenant may ask for: its models (else 403), its `max_tokens` ceiling (clamped, or
/// refused with 400), the target tier only when allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_only_what_its_policy_allows() {
    let (draft, target) = (sim().await, sim().await);
    let proxy = Proxy::start(json!({
        "pools": [
            pool("draft", &[MODEL, "other"], &[draft.addr()]),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": {
            "tenants": tenants(json!({
                "defaults": {"models": [MODEL], "max_tokens": 32},
                "tenants": {"beta": {"over_max_tokens": "refuse"}},
            })),
            "speculative": {"enabled": true, "models": [
                {"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"}]},
        },
    }))
    .await;
    let alpha = [bearer(ALPHA_KEY)];
    let beta = [bearer(BETA_KEY)];

    let other = ask(&proxy, &chat("other", "hi", false), &alpha).await;
    assert_eq!(other.status, 403, "{}", other.body);
    assert_eq!(other.headers["x-sluice-rejected"], "forbidden");
    assert_eq!(error_body(&other)["error"]["param"], "model");

    // alpha's 500 tokens are lowered to 32: the backend is asked for 32.
    let mut long = chat(MODEL, "a long answer", false);
    long["max_tokens"] = json!(500);
    let a = ask(&proxy, &long, &alpha).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let sent = last_sent(&draft, "/v1/chat/completions");
    assert_eq!(sent["max_tokens"], 32, "{sent}");
    assert_eq!(sent["messages"], long["messages"]);
    // beta's are refused.
    let refused = ask(&proxy, &long, &beta).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(error_body(&refused)["error"]["param"], "max_tokens");

    // On /v1/completions vLLM reads only `max_tokens`: a `max_completion_tokens` there must
    // not stand for the budget (it passed any ceiling, and vLLM generated 100,000).
    let completions = proxy.url("/v1/completions");
    let sneaky = json!({"model": MODEL, "prompt": "count", "max_completion_tokens": 1,
                        "max_tokens": 100_000});
    let headers = [("authorization", format!("Bearer {BETA_KEY}"))];
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let refused = ask_url(&completions, &sneaky, &headers).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(error_body(&refused)["error"]["param"], "max_tokens");
    let alpha_headers = [("authorization", format!("Bearer {ALPHA_KEY}"))];
    let alpha_headers: Vec<(&str, &str)> = alpha_headers
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .collect();
    let clamped = ask_url(&completions, &sneaky, &alpha_headers).await;
    assert_eq!(clamped.status, 200, "{}", clamped.body);
    let sent = last_sent(&draft, "/v1/completions");
    assert_eq!(sent["max_tokens"], 32, "{sent}");
    // A text completion that states no budget gets vLLM's 16, within the ceiling: it is not
    // raised to the ceiling (and billed so).
    let bare = json!({"model": MODEL, "prompt": "count"});
    let a = ask_url(&completions, &bare, &alpha_headers).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let sent = last_sent(&draft, "/v1/completions");
    assert!(sent.get("max_tokens").is_none(), "{sent}");

    // alpha may not force the target: the header is ignored. beta may.
    let forced = |key| [bearer(key), ("x-sluice-tier", "target".to_string())];
    let a = ask(&proxy, &chat(MODEL, "tier", false), &forced(ALPHA_KEY)).await;
    assert_eq!(a.headers["x-sluice-pool"], "draft");
    let a = ask(&proxy, &chat(MODEL, "tier", false), &forced(BETA_KEY)).await;
    assert_eq!(a.headers["x-sluice-pool"], "target");
}

/// A tenant's sixth request in a minute gets OpenAI's 429: `retry-after`, the rate-limit
/// headers every answer of a limited tenant carries, and the reason; other tenants are not
/// affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_sixth_request_in_a_minute_gets_429_with_the_rate_limit_headers() {
    let upstream = sim().await;
    let proxy = tenants_proxy(
        &upstream,
        json!({
            "tenants": {"alpha": {"limits": {"requests_per_minute": 5}}}}),
    )
    .await;
    let alpha = [bearer(ALPHA_KEY)];
    for i in 0..5 {
        let a = ask(&proxy, &chat(MODEL, &format!("q{i}"), false), &alpha).await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
        assert_eq!(a.headers["x-ratelimit-limit-requests"], "5");
        assert_eq!(
            a.headers["x-ratelimit-remaining-requests"],
            (4 - i).to_string().as_str()
        );
        assert!(a.headers.get("x-ratelimit-reset-requests").is_some());
    }
    let sixth = ask(&proxy, &chat(MODEL, "q5", false), &alpha).await;
    assert_eq!(sixth.status, 429, "{}", sixth.body);
    assert_eq!(sixth.headers["x-sluice-rejected"], "rate-limited");
    assert_eq!(sixth.headers["x-ratelimit-remaining-requests"], "0");
    let retry_after: u64 = sixth.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let body = error_body(&sixth);
    assert_eq!(body["error"]["type"], "RateLimitError");
    assert_eq!(body["error"]["reason"], "rate-limited");

    // beta has no request limit, and its answers carry no request-limit headers.
    let b = ask(&proxy, &chat(MODEL, "q", false), &[bearer(BETA_KEY)]).await;
    assert_eq!(b.status, 200);
    assert!(b.headers.get("x-ratelimit-limit-requests").is_none());
    let rejected = proxy
        .metric(r#"sluice_tenant_rejections_total{reason="rate-limited",tenant="alpha"}"#)
        .await;
    assert_eq!(rejected, Some(1.0));
}

/// Tokens are estimated at admission (the whole `max_tokens`) and corrected from the answer's
/// usage, streams included: a tenant whose answers are short gets on, where the estimates
/// alone would have stopped it; the stream's client never sees the usage it did not ask for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limits_are_corrected_from_the_answers_usage_streams_included() {
    // Answers of 4 to 6 tokens, asked for up to 80.
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_answer_tokens(4, 6),
    )
    .await
    .unwrap();
    let proxy = tenants_proxy(
        &upstream,
        json!({
            "tenants": {"beta": {"limits": {"output_tokens_per_minute": 100}}}}),
    )
    .await;
    let beta = [bearer(BETA_KEY)];
    for (i, stream) in [false, true, false, true].into_iter().enumerate() {
        let mut request = chat(MODEL, &format!("short answer {i}"), stream);
        request["max_tokens"] = json!(80);
        let a = ask(&proxy, &request, &beta).await;
        assert_eq!(
            a.status, 200,
            "request {i} (estimates not corrected?): {}",
            a.body
        );
        if stream {
            assert!(
                !a.body.contains("\"usage\""),
                "the client got a usage chunk it did not ask for"
            );
        }
        // The correction is made as the request ends, just after its last byte was sent:
        // the next request waits for it, as a client's next one would a moment later.
        let settled = wait_for(std::time::Duration::from_secs(5), || async {
            proxy
                .metric(r#"sluice_tenant_requests_total{tenant="beta"}"#)
                .await
                == Some(i as f64 + 1.0)
        })
        .await;
        assert!(settled.is_some(), "request {i} never ended");
    }
    let used = proxy
        .metric(r#"sluice_tenant_tokens_total{kind="output",tenant="beta"}"#)
        .await
        .unwrap();
    assert!(
        (16.0..=24.0).contains(&used),
        "output tokens counted: {used}"
    );
    // An estimate over what is left is refused: the whole minute's 100, with ~20 used (the
    // bucket refills 100 a minute: this holds for the ~10 s the test may take).
    let mut big = chat(MODEL, "big", false);
    big["max_tokens"] = json!(100);
    let a = ask(&proxy, &big, &beta).await;
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.headers["x-sluice-rejected"], "rate-limited");
}

/// `/status` shows each tenant's limits and what is left of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_each_tenants_limits_and_use() {
    let upstream = sim().await;
    let proxy = tenants_proxy(
        &upstream,
        json!({
            "tenants": {"alpha": {"limits": {"requests_per_minute": 5}}}}),
    )
    .await;
    for _ in 0..2 {
        assert_eq!(
            ask(&proxy, &chat(MODEL, "q", false), &[bearer(ALPHA_KEY)])
                .await
                .status,
            200
        );
    }
    let status = proxy.status().await;
    let tenants = status["plugin_status"]["tenants"].as_array().unwrap();
    let alpha = tenants.iter().find(|t| t["tenant"] == "alpha").unwrap();
    assert_eq!(alpha["requests_per_minute"], 5, "{alpha}");
    assert_eq!(alpha["requests_remaining"], 3, "{alpha}");
    assert!(tenants.iter().any(|t| t["tenant"] == "beta"));
    assert!(
        !status.to_string().contains("sha256"),
        "no key digest in /status"
    );
}

/// Two replicas share a tenant's limit through one Redis: together they never let more in
/// than the limit. When Redis dies, they fail open as configured, and count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_a_limit_through_redis_and_fail_open_when_it_dies() {
    let upstream = sim().await;
    let mut redis = RedisServer::start();
    let config = json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": tenants(json!({
            "tenants": {"alpha": {"limits": {"requests_per_minute": 5}}},
            "limits_store": {"kind": "redis", "redis": {"url": redis.url(), "timeout": "200ms"},
                             "on_redis_error": "allow"},
        }))},
    });
    let replicas = [
        Proxy::start(config.clone()).await,
        Proxy::start(config).await,
    ];
    let alpha = [bearer(ALPHA_KEY)];

    let mut served = 0;
    for i in 0..20 {
        let replica = &replicas[i % 2];
        let a = ask(replica, &chat(MODEL, &format!("q{i}"), false), &alpha).await;
        match a.status {
            200 => served += 1,
            429 => assert_eq!(a.headers["x-sluice-rejected"], "rate-limited"),
            other => panic!("request {i}: {other} {}", a.body),
        }
    }
    assert_eq!(served, 5, "the two replicas together let {served} in");

    // Redis gone: requests are let in (fail open), and the failures are counted.
    redis.stop();
    for i in 0..4 {
        let a = ask(
            &replicas[i % 2],
            &chat(MODEL, &format!("later {i}"), false),
            &alpha,
        )
        .await;
        assert_eq!(a.status, 200, "request {i} with Redis down: {}", a.body);
    }
    let mut errors = 0.0;
    for replica in &replicas {
        let text = replica.metrics().await;
        errors += text
            .lines()
            .filter(|l| l.starts_with("sluice_tenant_limit_store_errors_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    assert!(errors >= 4.0, "Redis failures counted: {errors}");
}

/// Redis killed and restarted empty: meanwhile each replica holds the tenant to its limits
/// with its own buckets (failing open let 78 requests through a limit of 5), and the
/// restarted Redis is used again at once, found by the link's own probe, not by a request
/// after a second cool-down (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_down_the_limits_hold_locally_and_a_restarted_redis_is_used_again() {
    let upstream = sim().await;
    let mut redis = RedisServer::start();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": tenants(json!({
            "tenants": {"alpha": {"limits": {"requests_per_minute": 5}}},
            "limits_store": {"kind": "redis",
                             "redis": {"url": redis.url(), "timeout": "200ms", "cooldown": "30s"}},
        }))},
    }))
    .await;
    let alpha = [bearer(ALPHA_KEY)];
    assert_eq!(
        ask(&proxy, &chat(MODEL, "before", false), &alpha)
            .await
            .status,
        200
    );

    redis.stop();
    let mut statuses = Vec::new();
    for i in 0..20 {
        let a = ask(&proxy, &chat(MODEL, &format!("down {i}"), false), &alpha).await;
        statuses.push(a.status);
    }
    let served = statuses.iter().filter(|s| **s == 200).count();
    assert!(
        served <= 5,
        "{served} of 20 let in with Redis down: {statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    assert!(
        proxy
            .logs()
            .contains("failing, skipping it for a cool-down"),
        "{}",
        proxy.logs()
    );

    // Back, empty. No request is sent: the link finds it by itself, well within the
    // 30 s cool-down.
    redis.restart();
    let back = wait_for(Duration::from_secs(10), || async {
        proxy.logs().contains("answers again, cool-down over")
    })
    .await;
    assert!(back.is_some(), "{}", proxy.logs());
    let a = ask(&proxy, &chat(MODEL, "after", false), &alpha).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let keys = redis_cli(redis.port(), &["KEYS", "sluice:limits:*"]);
    assert!(!keys.trim().is_empty(), "the admission went to Redis");
}

/// N21: vLLM shares its prefix cache across every request, and how fast a prompt's prefix
/// comes back tells whether someone sent it before: each tenant's requests get a
/// `cache_salt` of their own, which no client can choose for another tenant. The fields that
/// act on the engine beyond the request (`priority` reorders vLLM's own queue,
/// `request_id` is what vLLM aborts by) are reset; a pool may pass them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_gets_its_own_cache_salt_and_engine_controls_are_reset() {
    let upstream = sim().await;
    let trusted = sim().await;
    let proxy = Proxy::start(json!({
        "pools": [
            pool("main", &[MODEL], &[upstream.addr()]),
            pool("trusted", &["trusted-model"], &[trusted.addr()])
                .with("served_model", MODEL)
                .with("client_fields", json!({"cache_salt": "as_sent", "engine_controls": "pass"})),
        ],
        "plugins": {"tenants": tenants(json!({}))},
    }))
    .await;
    let mut body = chat(MODEL, "the same long system prompt", false);
    body["priority"] = json!(-100);
    body["request_id"] = json!("someone-elses-request");
    body["cache_salt"] = json!("alpha-chosen");
    body["kv_transfer_params"] = json!({"do_remote_prefill": true});
    let answer = ask(&proxy, &body, &[bearer(ALPHA_KEY)]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let alpha = last_sent(&upstream, "/v1/chat/completions");
    assert_eq!(ask(&proxy, &body, &[bearer(BETA_KEY)]).await.status, 200);
    let beta = last_sent(&upstream, "/v1/chat/completions");
    let salt = |v: &Value| v["cache_salt"].as_str().unwrap_or_default().to_string();
    assert_eq!(salt(&alpha).len(), 32, "{alpha}");
    assert_ne!(salt(&alpha), salt(&beta), "one salt per tenant");
    assert_ne!(salt(&alpha), "alpha-chosen");
    assert_eq!(alpha["priority"], 0);
    assert!(alpha["kv_transfer_params"].is_null());
    let request_id = answer.headers["x-request-id"].to_str().unwrap().to_string();
    let sent_id = alpha["request_id"].as_str().unwrap();
    assert!(
        sent_id.starts_with(&format!("{request_id}-")),
        "Sluice's own id, with a suffix no client can choose: {sent_id}"
    );
    assert_eq!(
        alpha["messages"], body["messages"],
        "the request itself as sent"
    );

    // A pool whose clients are trusted with the engine gets their fields as sent.
    let mut passed = body.clone();
    passed["model"] = json!("trusted-model");
    assert_eq!(ask(&proxy, &passed, &[bearer(ALPHA_KEY)]).await.status, 200);
    let sent = last_sent(&trusted, "/v1/chat/completions");
    assert_eq!(sent["priority"], -100);
    assert_eq!(sent["request_id"], "someone-elses-request");
    assert_eq!(sent["cache_salt"], "alpha-chosen");
}

/// `sluice hash-key` prints the digest the config wants, from standard input.
#[test]
fn hash_key_prints_the_digest_the_config_takes() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{ALPHA_KEY}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        key_digest(ALPHA_KEY)
    );
}

/// Keys kept in Redis are added and revoked without a reload: within `refresh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_redis_are_added_and_revoked_without_a_reload() {
    let upstream = sim().await;
    let redis = RedisServer::start();
    let proxy = tenants_proxy(
        &upstream,
        json!({
            "keys_from_redis": {"url": redis.url(), "refresh": "100ms"}}),
    )
    .await;
    let gamma_key = "sk-gamma-from-redis";
    let request = chat(MODEL, "hi", false);
    let status = || async { ask(&proxy, &request, &[bearer(gamma_key)]).await.status };
    assert_eq!(status().await, 401, "not added yet");

    redis_cli(
        redis.port(),
        &["HSET", "sluice:tenant-keys", &key_digest(gamma_key), "beta"],
    );
    let added = wait_for(std::time::Duration::from_secs(5), || async {
        status().await == 200
    })
    .await;
    assert!(added.is_some(), "a key added to Redis was never accepted");

    // A field that is not UTF-8 is skipped; it froze the directory: no key revoked after it
    // took effect.
    redis_cli(
        redis.port(),
        &[
            "EVAL",
            "return redis.call('HSET', KEYS[1], string.char(255), 'x')",
            "1",
            "sluice:tenant-keys",
        ],
    );
    redis_cli(
        redis.port(),
        &["HDEL", "sluice:tenant-keys", &key_digest(gamma_key)],
    );
    let revoked = wait_for(std::time::Duration::from_secs(5), || async {
        status().await == 401
    })
    .await;
    assert!(
        revoked.is_some(),
        "a key removed from Redis was still accepted"
    );
    // The file's keys are not Redis's to revoke.
    assert_eq!(
        ask(&proxy, &request, &[bearer(ALPHA_KEY)]).await.status,
        200
    );
}

/// A tenant's budget, from the answering pool's price: once spent, 429 `budget-exceeded`;
/// in shadow mode it is only counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_budget_refuses_and_a_shadow_budget_only_counts() {
    let upstream = sim().await;
    // A million dollars a million tokens: one answer of a few dozen tokens spends the cent.
    let priced =
        pool("main", &[MODEL], &[upstream.addr()]).with("price_per_million_tokens", 1_000_000.0);
    let proxy = Proxy::start(json!({
        "pools": [priced],
        "plugins": {"tenants": tenants(json!({"tenants": {
            "alpha": {"budget": {"usd_per_day": 0.01}},
            "beta": {"budget": {"usd_per_day": 0.01, "mode": "shadow"}},
        }}))},
    }))
    .await;
    let first = ask(&proxy, &chat(MODEL, "spend", false), &[bearer(ALPHA_KEY)]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    // The spend is charged once the answer has ended: the next requests find it spent.
    let mut refused = None;
    for i in 0..20 {
        let next = ask(
            &proxy,
            &chat(MODEL, &format!("more {i}"), false),
            &[bearer(ALPHA_KEY)],
        )
        .await;
        if next.status == 429 {
            refused = Some(next);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let refused = refused.expect("alpha's spent budget never refused");
    assert_eq!(refused.headers["x-sluice-rejected"], "budget-exceeded");
    assert!(refused.headers.get("retry-after").is_some());
    for i in 0..5 {
        let a = ask(
            &proxy,
            &chat(MODEL, &format!("shadow {i}"), false),
            &[bearer(BETA_KEY)],
        )
        .await;
        assert_eq!(a.status, 200, "a shadow budget refused: {}", a.body);
    }
    let cost = proxy
        .metric(r#"sluice_tenant_cost_dollars_total{tenant="beta"}"#)
        .await
        .unwrap();
    assert!(cost > 0.01, "beta's spend counted: {cost}");
}

/// A tenant's key never reaches the backend, even from a pool that forwards client keys, and
/// the pool's own credential (vLLM's `--api-key`) does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_key_stays_behind_and_the_pools_credential_goes_up() {
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_api_key("vllm-secret")
            .with_record_requests(20),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("vllm-key");
    std::fs::write(&secret, "vllm-secret").unwrap();
    let keyed = pool("main", &[MODEL], &[upstream.addr()])
        .with("upstream_auth", json!({"from_file": secret}))
        .with("forward_client_key", true);
    let proxy = Proxy::start(json!({
        "pools": [keyed],
        "plugins": {"tenants": tenants(json!({}))},
    }))
    .await;
    let a = ask(
        &proxy,
        &chat(MODEL, "hi", false),
        &[("x-api-key", ALPHA_KEY.to_string())],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let sent = upstream
        .stats()
        .recent
        .into_iter()
        .rev()
        .find(|r| r.path == "/v1/chat/completions")
        .unwrap();
    assert_eq!(sent.header("authorization"), Some("Bearer vllm-secret"));
    assert_eq!(
        sent.header("x-api-key"),
        None,
        "a tenant's key went upstream"
    );
}

/// Requests Sluice itself refused (the KV breaker shedding them) generated nothing: their
/// estimates are given back. Three shed requests of 4,000 tokens each left a tenant limited to
/// 10,000 output tokens a minute refused for the rest of the minute although nothing was made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sluice_refused_are_not_charged() {
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_kv(1000, 16),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()]).with_fast_health_checks()],
        "plugins": {
            "tenants": tenants(json!({
                "tenants": {"beta": {"limits": {"output_tokens_per_minute": 10_000}}}})),
            "kv_breaker": {"enabled": true, "queue": {"enabled": false}},
        },
    }))
    .await;
    let scraped = |want: f64| {
        let proxy = &proxy;
        let addr = upstream.addr();
        async move {
            wait_for(std::time::Duration::from_secs(5), || async {
                proxy.backend_status("main", addr).await["kv_cache_usage"]
                    .as_f64()
                    .is_some_and(|kv| (kv - want).abs() < 0.02)
            })
            .await
            .is_some()
        }
    };
    upstream.set_phantom_kv(0.95);
    assert!(scraped(0.95).await, "the pressure was scraped");
    let mut big = chat(MODEL, "a long one", false);
    big["max_tokens"] = json!(4_000);
    for _ in 0..3 {
        let shed = ask(&proxy, &big, &[bearer(BETA_KEY)]).await;
        assert_eq!(
            shed.headers["x-sluice-rejected"], "kv-pressure",
            "{} {}",
            shed.status, shed.body
        );
    }
    upstream.set_phantom_kv(0.0);
    assert!(scraped(0.0).await, "the pressure's end was scraped");
    let a = ask(&proxy, &big, &[bearer(BETA_KEY)]).await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// A stream closed before its usage chunk spent nothing of a budget: ten such streams by a
/// tenant with $0.005 a day were all admitted, `usd_spent_today` 0. A cut answer is now
/// charged its estimate, in dollars too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_before_its_usage_is_charged_its_estimate() {
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_answer_tokens(20, 20)
            .with_latency(vllm_sim::Latency::new(
                std::time::Duration::ZERO,
                std::time::Duration::ZERO,
                std::time::Duration::from_millis(20),
            )),
    )
    .await
    .unwrap();
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])
            .with("price_per_million_tokens", 1000.0)],
        "plugins": {"tenants": tenants(json!({
            "tenants": {"beta": {"budget": {"usd_per_day": 0.005}}}}))},
    }))
    .await;
    let mut request = chat(MODEL, "cut me", true);
    request["max_tokens"] = json!(20);
    let response = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {BETA_KEY}"))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut seen = String::new();
    use futures_util::StreamExt;
    while let Some(chunk) = stream.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if seen.contains(r#""finish_reason":"length""#)
            || seen.contains(r#""finish_reason":"stop""#)
        {
            break;
        }
    }
    drop(stream);
    let spent = wait_for(std::time::Duration::from_secs(5), || async {
        let status = proxy.status().await;
        status["plugin_status"]["tenants"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["tenant"] == "beta").cloned())
            .and_then(|beta| beta["usd_spent_today"].as_f64())
            .is_some_and(|usd| usd > 0.005)
    })
    .await;
    assert!(spent.is_some(), "the cut stream spent nothing");
    let next = ask(&proxy, &chat(MODEL, "again", false), &[bearer(BETA_KEY)]).await;
    assert_eq!(next.status, 429, "{}", next.body);
    assert_eq!(next.headers["x-sluice-rejected"], "budget-exceeded");
}

/// Every route is metered: a tenant limited to 2 requests a minute was served 20
/// `POST /ping` through a plain route (which carries the pool's credential).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_routes_count_against_a_tenants_limits() {
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "routes": [{"path_prefix": "/ping", "pool": "main"}],
        "plugins": {"tenants": tenants(json!({
            "tenants": {"alpha": {"limits": {"requests_per_minute": 2}}}}))},
    }))
    .await;
    let url = proxy.url("/ping");
    let body = json!({"model": MODEL, "prompt": "count me"});
    let key = format!("Bearer {ALPHA_KEY}");
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let a = ask_url(&url, &body, &[("authorization", key.as_str())]).await;
        statuses.push((a.status, a.headers.get("x-sluice-rejected").cloned()));
    }
    assert!(statuses[..2].iter().all(|(s, _)| *s != 429), "{statuses:?}");
    assert!(
        statuses[2..]
            .iter()
            .all(|(s, why)| *s == 429 && why.as_ref().is_some_and(|w| w == "rate-limited")),
        "{statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_the_slow_store_charged_after_it_gave_up_is_given_back() {
    // Answers of 4 tokens; each request asks for up to 100.
    let upstream = vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_model(MODEL)
            .with_answer_tokens(4, 4),
    )
    .await
    .unwrap();
    let redis = RedisServer::start();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", redis.port()).parse().unwrap();
    let slow = SlowRelay::start(addr, Duration::ZERO).await;
    let proxy = tenants_proxy(
        &upstream,
        json!({
            "tenants": {"alpha": {"limits": {"output_tokens_per_minute": 120}}},
            "limits_store": {"kind": "redis",
                             "redis": {"url": slow.url(), "timeout": "50ms",
                                       "failure_threshold": 1000},
                             "on_redis_error": "allow"},
        }),
    )
    .await;
    let alpha = [bearer(ALPHA_KEY)];
    let body = |i: usize| {
        let mut body = chat(MODEL, &format!("q{i}"), false);
        body["max_tokens"] = json!(100);
        body
    };
    // Redis answers after the admissions gave up: each request is let in uncharged (fail
    // open) and settles its 4 tokens; each one the script ran meanwhile (the first, and any
    // that found no call in flight) was charged 100 there.
    slow.set_delay(Duration::from_millis(120));
    for i in 0..10 {
        let a = ask(&proxy, &body(i), &alpha).await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
    }
    let refunded = wait_for(Duration::from_secs(10), || async {
        proxy
            .metric("sluice_tenant_limit_refunded_admissions_total")
            .await
            .unwrap_or(0.0)
            >= 1.0
    })
    .await;
    assert!(refunded.is_some(), "{}", proxy.metrics().await);
    // Redis fast again. A charge of 100 kept, plus the 40 tokens settled, would be over the
    // 120 a minute: this request would be refused for seconds.
    slow.set_delay(Duration::ZERO);
    // An answer the store decided (it carries the limits' headers; one admitted while a slow
    // call was still in flight was let in without them), and let in. A refund still on its
    // way through the relay may refuse the first few; a charge kept would refuse them for
    // longer than this wait (the old loop's 5 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut last = None;
    while std::time::Instant::now() < deadline {
        let a = ask(&proxy, &body(99), &alpha).await;
        if a.headers.contains_key("x-ratelimit-limit-tokens") && a.status == 200 {
            return;
        }
        last = Some((a.status, a.body));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never admitted by the store: {last:?}");
}

/// Reads a stream until `enough` says so, then closes it.
async fn read_then_close(response: reqwest::Response, enough: impl Fn(&str) -> bool) {
    use futures_util::StreamExt;
    let mut stream = response.bytes_stream();
    let mut seen = String::new();
    while let Some(chunk) = stream.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if enough(&seen) {
            return;
        }
    }
    panic!("the stream ended before it was cut: {seen}");
}

fn tenant_tokens(metrics: &str, tenant: &str, kind: &str) -> f64 {
    metric_value(
        metrics,
        &format!("sluice_tenant_tokens_total{{kind=\"{kind}\",tenant=\"{tenant}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Messages and Responses streams say a usage before their end: Anthropic's `message_start`
/// (the input, 0 output), and Responses' `response.created`, which echoes the request's
/// `tools`, whose schema a client may fill with `"usage": {"input_tokens": 0, ...}`. A
/// stream cut before its end was charged that: 0 output tokens, or nothing at all. Now it
/// is charged its estimate, as on chat; and a usage of the client's making never teaches the
/// pool its prompt scale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_messages_or_responses_stream_is_charged_its_estimate_not_an_early_usage() {
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_served_model_names(vec![MODEL.into()])
            .with_answer_tokens(40, 40)
            .with_latency(vllm_sim::Latency::new(
                Duration::ZERO,
                Duration::ZERO,
                Duration::from_millis(20),
            )),
    )
    .await
    .unwrap();
    let proxy = tenants_proxy(&upstream, json!({})).await;
    let send = |path: &'static str, body: Value| {
        client()
            .post(proxy.url(path))
            .header("authorization", format!("Bearer {BETA_KEY}"))
            .json(&body)
            .send()
    };
    let messages = json!({"model": MODEL, "max_tokens": 50, "stream": true,
        "messages": [{"role": "user", "content": "Tell me a long story"}]});
    let response = send("/v1/messages", messages).await.unwrap();
    assert_eq!(response.status(), 200);
    read_then_close(response, |seen| {
        seen.matches("content_block_delta").count() >= 6
    })
    .await;
    let charged = wait_for(Duration::from_secs(10), || async {
        tenant_tokens(&proxy.metrics().await, "beta", "output") >= 50.0
    })
    .await;
    assert!(
        charged.is_some(),
        "the cut Messages stream was charged {} output tokens, not its 50",
        tenant_tokens(&proxy.metrics().await, "beta", "output")
    );

    let fake = json!({"type": "object", "properties": {},
        "usage": {"input_tokens": 1_000_000_000u64, "output_tokens": 0}});
    let responses = json!({"model": MODEL, "max_output_tokens": 50, "stream": true,
        "input": "Tell me a long story", "tool_choice": "none",
        "tools": [{"type": "function", "name": "f", "parameters": fake}]});
    let before = proxy.metrics().await;
    let response = send("/v1/responses", responses.clone()).await.unwrap();
    assert_eq!(response.status(), 200);
    read_then_close(response, |seen| seen.contains("response.output_text.delta")).await;
    let charged = wait_for(Duration::from_secs(10), || async {
        let now = proxy.metrics().await;
        tenant_tokens(&now, "beta", "output") - tenant_tokens(&before, "beta", "output") >= 50.0
    })
    .await;
    let now = proxy.metrics().await;
    assert!(
        charged.is_some(),
        "the cut Responses stream was charged {} output tokens, not its 50",
        tenant_tokens(&now, "beta", "output") - tenant_tokens(&before, "beta", "output")
    );
    let input = tenant_tokens(&now, "beta", "input") - tenant_tokens(&before, "beta", "input");
    assert!(input > 0.0 && input < 1_000_000.0, "input charged: {input}");

    // Whole streams with the fake usage in their tools: the engine's own usage counts, and
    // the pool's prompt scale stays where the engine's counts put it.
    for _ in 0..5 {
        let answer = send("/v1/responses", responses.clone()).await.unwrap();
        assert_eq!(answer.status(), 200);
        let body = answer.text().await.unwrap();
        assert!(body.contains("response.completed"), "{body}");
    }
    let status = proxy.status().await;
    let scale = status["pools"][0]["prompt_scale"].as_f64().unwrap();
    assert!(
        scale < 2.0,
        "the client's usage taught the pool: prompt_scale {scale}"
    );
    let metrics = proxy.metrics().await;
    let input = tenant_tokens(&metrics, "beta", "input") - tenant_tokens(&now, "beta", "input");
    assert!(
        input > 0.0 && input < 10_000.0,
        "five whole streams were charged {input} input tokens"
    );
}

/// A Starlette app served by uvicorn, vLLM's own server stack: it answers a chat completion
/// with 20 output tokens on `/v1/chat/completions` (uvicorn decodes `%2F` before it routes),
/// and any other path with 200, counting every request it gets. Runs in the real-vLLM tier's
/// python, which has both.
const UVICORN_ENGINE: &str = r#"
import json, sys
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
import uvicorn
seen = []
async def chat(request):
    seen.append(request.url.path)
    return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
        "model": "llama", "choices": [{"index": 0, "finish_reason": "length",
        "message": {"role": "assistant", "content": "word " * 20}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}})
async def anything(request):
    seen.append(request.url.path)
    return JSONResponse({"seen": seen})
app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/{rest:path}", anything, methods=["GET", "POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"#;

/// With a catch-all route, `POST /v1/chat%2Fcompletions` reached the engine's chat endpoint
/// (uvicorn decodes `%2F`) as a plain request: no token limit, budget or breaker; and vLLM's
/// own `/v1/chat/completions/batch` and `/scale_elastic_ep` passed the same way. The path is
/// now matched as the engine reads it, and the engine's own endpoints are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_slash_is_the_metered_chat_route_and_engine_only_paths_are_refused() {
    /// Killed however the test ends.
    struct Engine(std::process::Child);
    impl Drop for Engine {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let port = free_port();
    let _engine = Engine(
        std::process::Command::new(vllm_python())
            .args(["-c", UVICORN_ENGINE, &port.to_string()])
            .spawn()
            .unwrap(),
    );
    let engine_addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let seen = || async move {
        let r = client()
            .get(format!("http://{engine_addr}/seen"))
            .send()
            .await
            .ok()?;
        let body: Value = r.json().await.ok()?;
        Some(body["seen"].as_array()?.len())
    };
    wait_for(Duration::from_secs(60), || async { seen().await.is_some() })
        .await
        .expect("uvicorn serves");
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[engine_addr]).without_health_checks()],
        "routes": [{"path_prefix": "/", "pool": "main"}],
        "plugins": {"tenants": tenants(json!({
            "tenants": {"alpha": {"limits": {"output_tokens_per_minute": 30}}}}))},
    }))
    .await;
    let key = format!("Bearer {ALPHA_KEY}");
    let body = chat(MODEL, "hi", false);
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let url = proxy.url("/v1/chat%2Fcompletions");
        let answer = ask_url(&url, &body, &[("authorization", key.as_str())]).await;
        statuses.push(answer.status);
    }
    assert!(
        statuses.contains(&429),
        "the escaped chat route was not metered: {statuses:?}"
    );
    let metrics = proxy.metrics().await;
    assert!(
        tenant_tokens(&metrics, "alpha", "output") >= 20.0,
        "{metrics}"
    );
    let before = seen().await.unwrap();
    for path in [
        "/v1/chat/completions/batch",
        "/v1/chat%2Fcompletions%2Fbatch",
        "/scale_elastic_ep",
        "/invocations",
    ] {
        let answer = ask_url(&proxy.url(path), &body, &[("authorization", key.as_str())]).await;
        assert_eq!(answer.status, 404, "{path}: {}", answer.body);
    }
    assert_eq!(
        seen().await.unwrap(),
        before + 1,
        "only our own look reached it"
    );
}
