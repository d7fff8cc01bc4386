//! Coding agents' sessions, named where each harness names them (Claude Code's
//! `x-claude-code-session-id` and `metadata.user_id`, Codex's `session-id` and
//! `prompt_cache_key`, opencode's `x-session-affinity`, an OpenAI SDK user's
//! `prompt_cache_key`), sent by the official `anthropic` and `openai` Python packages: with no
//! key to configure, every turn of a session reaches one engine, and two tenants sending the
//! same session ids never share a pin. Needs `python3` with `openai` and `anthropic`
//! (`scripts/bootstrap --test` installs them).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use vllm_sim::SimConfig;

const MODEL: &str = "agent-model";
const TURNS: usize = 4;
const SESSIONS: [&str; 3] = ["3f1c9e", "8a07d2", "c55b41"];
/// The harnesses the script plays, as its `x-agent` header names them.
const AGENTS: [&str; 4] = ["claude-code", "codex", "opencode", "openai-sdk"];
const TENANTS: [(&str, &str); 2] = [("alpha", "sk-alpha"), ("beta", "sk-beta")];

async fn engine() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_record_requests(1024),
    )
    .await
    .unwrap()
}

/// The session a request that reached an engine belongs to, from what its harness sent:
/// (run, agent, session id).
fn session_of(request: &vllm_sim::RecordedRequest) -> Option<(String, String, String)> {
    let run = request.header("x-run")?.to_string();
    let agent = request.header("x-agent")?.to_string();
    let body: Value = serde_json::from_slice(&request.body).ok()?;
    let id = match agent.as_str() {
        "claude-code" => request.header("x-claude-code-session-id")?.to_string(),
        "codex" => request.header("session-id")?.to_string(),
        "opencode" => request.header("x-session-affinity")?.to_string(),
        _ => body["prompt_cache_key"].as_str()?.to_string(),
    };
    Some((run, agent, id))
}

/// For each session, how many of its turns each engine served.
fn turns_by_engine(engines: &[&vllm_sim::Sim]) -> BTreeMap<(String, String, String), Vec<usize>> {
    let mut seen: BTreeMap<_, Vec<usize>> = BTreeMap::new();
    for (i, engine) in engines.iter().enumerate() {
        for request in engine.stats().recent {
            if let Some(session) = session_of(&request) {
                seen.entry(session)
                    .or_insert_with(|| vec![0; engines.len()])[i] += 1;
            }
        }
    }
    seen
}

async fn agents_through(balancing: Value) {
    let (a, b) = (engine().await, engine().await);
    let addrs: Vec<SocketAddr> = vec![a.addr(), b.addr()];
    let tenants: serde_json::Map<String, Value> = TENANTS
        .iter()
        .map(|(name, key)| (name.to_string(), json!({"keys": [key_digest(key)]})))
        .collect();
    // No session key is configured: the defaults read what the harnesses send.
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &addrs).with("balancing", balancing.clone())],
        "plugins": {"tenants": {"enabled": true, "tenants": tenants}},
    }))
    .await;
    let base = format!("http://{}", proxy.addr);
    let turns = TURNS.to_string();
    for (run, key) in TENANTS {
        let mut args = vec![base.as_str(), MODEL, key, run, turns.as_str()];
        args.extend(SESSIONS);
        run_python("agent_sessions.py", &args).await;
    }
    let seen = turns_by_engine(&[&a, &b]);
    assert_eq!(
        seen.len(),
        TENANTS.len() * AGENTS.len() * SESSIONS.len(),
        "{balancing}: every run's every harness's sessions reached the engines: {seen:?}"
    );
    for (session, served) in &seen {
        assert_eq!(
            served.iter().sum::<usize>(),
            TURNS,
            "{balancing}: {session:?}"
        );
        assert!(
            served.contains(&TURNS),
            "{balancing}: {session:?}'s turns were split over the engines: {served:?}"
        );
    }
    // Scoped to the tenant: each tenant's ids are sessions of their own. Claude Code's,
    // Codex's and opencode's headers carry the same id (one session per tenant and id); the
    // SDK user's `prompt_cache_key` is another.
    let status = proxy.status().await;
    assert_eq!(
        status["pools"][0]["sessions"],
        json!(TENANTS.len() * SESSIONS.len() * 2),
        "{balancing}: {}",
        status["pools"][0]
    );
}

/// Round robin would take turns between the two engines: a session keeps its turns on one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_session_stays_on_its_engine_under_round_robin() {
    agents_through(json!({"strategy": "round_robin"})).await;
}

/// Under `ttft`, the session's engine holds what its last turns left cached: with nothing
/// queued anywhere, moving would only recompute it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_session_stays_on_its_engine_under_ttft() {
    agents_through(json!({"strategy": "ttft", "exploration": 0.0})).await;
}

/// Two proxies of one fleet share their sessions in Redis (`sessions.store: redis`): a
/// session's next turn reaching the other proxy goes to the engine its first turn went to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_sharing_redis_keep_a_session_on_its_engine() {
    let (a, b, c) = (engine().await, engine().await, engine().await);
    let redis = RedisServer::start();
    let fleet_proxy = || {
        Proxy::start(json!({
            "pools": [pool("main", &[MODEL], &[a.addr(), b.addr(), c.addr()])
                .with("balancing", json!({"strategy": "round_robin"}))],
            "sessions": {"store": "redis", "redis": {"url": redis.url(), "timeout": "2s"}},
        }))
    };
    let (one, two) = (fleet_proxy().await, fleet_proxy().await);
    let ask = |proxy: &Proxy, session: Option<&str>, turn: usize| {
        let url = proxy.url("/v1/chat/completions");
        let body = json!({"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": format!("{session:?}: turn {turn}")}]});
        let session = session.map(str::to_string);
        async move {
            let headers: Vec<(&str, &str)> = session
                .as_deref()
                .map(|s| vec![("x-session-id", s)])
                .unwrap_or_default();
            let answer = ask_url(&url, &body, &headers).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
        }
    };
    let sessions: Vec<String> = (0..8).map(|i| format!("fleet-session-{i}")).collect();
    for id in &sessions {
        ask(&one, Some(id), 1).await;
    }
    // Each binding is written by a task of its own: wait until all are in Redis.
    wait_for(std::time::Duration::from_secs(10), || async {
        redis_cli(
            redis.port(),
            &["--scan", "--pattern", "sluice:session:main:*"],
        )
        .lines()
        .count()
            == sessions.len()
    })
    .await
    .expect("every session's binding reaches Redis");
    // The other proxy, the sessions in reverse order: without the shared bindings, its own
    // round robin over three engines would put at most a third of them where they were.
    for id in sessions.iter().rev() {
        ask(&two, Some(id), 2).await;
    }
    let mut engine_of: BTreeMap<(String, usize), usize> = BTreeMap::new();
    for (i, engine) in [&a, &b, &c].iter().enumerate() {
        for request in engine.stats().recent {
            let Some(id) = request.header("x-session-id") else {
                continue;
            };
            let body: Value = serde_json::from_slice(&request.body).unwrap();
            let content = body["messages"][0]["content"].as_str().unwrap_or_default();
            let turn = if content.ends_with("turn 1") { 1 } else { 2 };
            engine_of.insert((id.to_string(), turn), i);
        }
    }
    for id in &sessions {
        let first = engine_of.get(&(id.clone(), 1));
        assert!(first.is_some(), "{id}'s first turn: {engine_of:?}");
        assert_eq!(
            first,
            engine_of.get(&(id.clone(), 2)),
            "{id} moved between the proxies: {engine_of:?}"
        );
    }
    let metrics = two.metrics().await;
    assert!(
        metrics.contains(r#"sluice_shared_sessions_total{event="adopted",pool="main"} 8"#),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("shared_sessions"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
