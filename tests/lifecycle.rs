//! The process's life: config checks, graceful stop, zero-downtime upgrade.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use serde_json::json;
use sluice_testkit::*;
use std::process::Command;
use std::time::{Duration, Instant};
use vllm_sim::SimConfig;

const MODEL: &str = "test-model";

fn check(config: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("-t")
        .arg("-c")
        .arg(config)
        .output()
        .expect("run sluice -t");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// `--help` describes the options as Sluice uses them, not in Pingora's library words.
#[test]
fn help_describes_the_options_in_sluices_words() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("--help")
        .output()
        .expect("run sluice --help");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for said in [
        "zero-downtime upgrade",
        "as a daemon",
        "Check the config file",
        "conf/sluice.yaml",
    ] {
        assert!(help.contains(said), "{said:?} in {help}");
    }
    assert!(!help.contains("pingora-based service"), "{help}");
}

#[test]
fn dash_t_accepts_the_shipped_config_and_names_what_is_wrong_in_a_bad_one() {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/sluice.yaml");
    let (ok, text) = check(&shipped);
    assert!(ok, "{text}");
    assert!(text.contains("is valid"), "{text}");

    let dir = tempfile::tempdir().unwrap();
    let backends = json!([{"address": "127.0.0.1:9"}]);
    for (config, key, rule) in [
        (
            json!({"pools": [{
                "name": "a",
                "backends": backends,
                "timeouts": {"first_byte": "90s", "total": "60s"},
            }]}),
            "pools[0].timeouts.first_byte",
            "must not be longer than pools[0].timeouts.total",
        ),
        (
            json!({
                "pools": [{"name": "a", "backends": backends}],
                "plugins": {"request_id": {"enabled": true, "headr": "x"}},
            }),
            "plugins.request_id.headr",
            "unknown field",
        ),
        (
            json!({"listeners": [], "pools": []}),
            "listeners",
            "at least one listener",
        ),
        (
            json!({
                "pools": [{"name": "a", "backends": backends}],
                "plugins": {"cache": {"enabled": true, "store": "redis",
                    "redis": {"url": {"from_env": "SLUICE_TEST_NEVER_SET"}}}},
            }),
            "plugins.cache.redis.url",
            "`SLUICE_TEST_NEVER_SET` is not set",
        ),
    ] {
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, config.to_string()).unwrap();
        let (ok, text) = check(&path);
        assert!(!ok, "{config} passed");
        assert!(
            text.contains(&path.display().to_string()),
            "names the file: {text}"
        );
        assert!(text.contains(key), "names the key {key}: {text}");
        assert!(text.contains(rule), "names the rule: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_running_stream_finish_then_exits() {
    let upstream = streaming_sim(MODEL, Duration::from_millis(30), 40).await;
    let mut proxy =
        Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let (text, _, mut child) = stream_through_sigterm(&mut proxy, 40).await;
    assert_eq!(
        sse_data(&text).last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    // Finished, not cut: a cut stream also ends with `[DONE]`, after an error event.
    assert!(!text.contains("\"error\""), "{text}");
    assert_eq!(text.matches("\"finish_reason\":\"").count(), 1, "{text}");

    exits_within(&mut child, Duration::from_secs(15)).await;
}

/// Starts a stream of `tokens` tokens, sends the proxy `SIGTERM` once its first chunk came,
/// and reads it to its end (which must be clean, not a cut). Returns the stream's text, how
/// long after the signal it ended, and the proxy's process.
async fn stream_through_sigterm(
    proxy: &mut Proxy,
    tokens: u32,
) -> (String, Duration, std::process::Child) {
    let mut request = chat(MODEL, "a story", true);
    request["max_tokens"] = json!(tokens);
    let response = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&request)
        .send()
        .await
        .unwrap();
    let mut stream = response.bytes_stream();
    let mut body = stream.next().await.unwrap().unwrap().to_vec();
    let child = proxy.take_child();
    signal(child.id(), "TERM");
    let signalled = Instant::now();
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.expect("the stream ends cleanly, not cut"));
    }
    (String::from_utf8(body).unwrap(), signalled.elapsed(), child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_an_idle_proxy_exits_at_once_not_after_the_grace_period() {
    let upstream = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let mut proxy = Proxy::start(json!({
        "pingora": {"grace_period_seconds": 30},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
    }))
    .await;
    let a = proxy.ask(&chat(MODEL, "hello", false), &[]).await;
    assert_eq!(a.status, 200);
    let mut child = proxy.take_child();
    signal(child.id(), "TERM");
    let took = exits_within(&mut child, Duration::from_secs(30)).await;
    assert!(took < Duration::from_secs(1), "exited after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_grace_period_ends_with_an_error_event_and_done() {
    // 100 tokens 100 ms apart: ten seconds, against a grace period of three.
    let upstream = streaming_sim(MODEL, Duration::from_millis(100), 100).await;
    let mut proxy = Proxy::start(json!({
        "pingora": {"grace_period_seconds": 3},
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
    }))
    .await;
    let (text, ended, mut child) = stream_through_sigterm(&mut proxy, 100).await;
    let events = sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let error = events.iter().rev().nth(1).cloned().unwrap_or_default();
    assert!(error.contains("\"error\""), "ended with {error}");
    assert!(
        ended < Duration::from_secs(3),
        "ended {ended:?} after SIGTERM"
    );
    assert!(
        ended >= Duration::from_secs(1),
        "ended {ended:?} after SIGTERM: too soon"
    );
    exits_within(&mut child, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_hands_over_the_listeners_without_refusing_anyone() {
    let upstream = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let mut proxy =
        Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let url = proxy.url("/v1/chat/completions");

    // Requests run all through the upgrade, each on a new connection.
    let load = tokio::spawn(async move {
        let (mut ok, mut failed) = (0, Vec::new());
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            let c = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            match c.post(&url).json(&chat(MODEL, "hi", false)).send().await {
                Ok(r) if r.status() == 200 => ok += 1,
                Ok(r) => failed.push(format!("status {}", r.status())),
                Err(e) => failed.push(e.to_string()),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (ok, failed)
    });

    let mut old = upgrade(&mut proxy, None).await;

    let (ok, failed) = load.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} ok, failures: {failed:?}\n{}",
        ok,
        proxy.logs()
    );
    assert!(ok > 20, "only {ok} requests ran");
    old_exits(&mut old, &proxy).await;
    // The new process serves on the same address.
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat(MODEL, "after", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// `sluice -d` runs as a daemon: it serves, and stops at once on `SIGTERM` when idle. (A
/// thread started before Pingora's fork once made the daemon panic on its first phase.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_serves_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, admin) = (reserve_port().release(), reserve_port().release());
    let d = dir.path().display();
    let config = dir.path().join("sluice.yaml");
    std::fs::write(
        &config,
        format!(
            "pingora:\n  pid_file: {d}/sluice.pid\n  upgrade_sock: {d}/sluice.sock\n  error_log: {d}/error.log\n  grace_period_seconds: 30\nlisteners: [{{address: \"127.0.0.1:{proxy}\"}}]\nadmin: {{address: \"127.0.0.1:{admin}\"}}\npools:\n  - name: main\n    models: [{MODEL}]\n    backends: [{{address: \"127.0.0.1:9\"}}]\n"
        ),
    )
    .unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["-d", "-c"])
        .arg(&config)
        .status()
        .unwrap();
    assert!(status.success(), "the parent of the daemon exits at once");
    let models = format!("http://127.0.0.1:{proxy}/v1/models");
    let served = wait_for(Duration::from_secs(10), || async {
        client()
            .get(&models)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    let log = || std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
    assert!(served.is_some(), "the daemon never served: {}", log());
    // Still serving a moment later: the daemon did not die after its start.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(client().get(&models).send().await.unwrap().status(), 200);

    let pid: u32 = std::fs::read_to_string(dir.path().join("sluice.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(pid, "TERM");
    let gone = wait_for(Duration::from_secs(10), || async {
        client().get(&models).send().await.is_err()
            && !std::path::Path::new(&format!("/proc/{pid}/status")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/status"))
                .is_ok_and(|s| s.contains("State:\tZ"))
    })
    .await;
    assert!(gone.is_some(), "the daemon did not stop: {}", log());
    assert!(!log().contains("panicked"), "{}", log());
}

/// The allocator runs the background thread that returns freed pages to the system
/// (`.cargo/config.toml` builds jemalloc with it): without it, the memory a burst of streams
/// took stays resident after the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allocator_returns_freed_memory_from_a_background_thread() {
    let upstream = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let mut proxy =
        Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let child = proxy.take_child();
    let tasks = std::fs::read_dir(format!("/proc/{}/task", child.id())).unwrap();
    let names: Vec<String> = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect();
    proxy.set_child(child);
    assert!(
        names.iter().any(|n| n == "jemalloc_bg_thd"),
        "no jemalloc background thread among {names:?}"
    );
}

/// `SIGHUP` reloads the config in place, as nginx does: a revoked key is refused at once on
/// every connection, kept-alive ones included, and a new key works; a stream that began
/// before finishes whole on the old config; a file that does not pass `sluice -t`'s checks
/// leaves the running config as it is. (`SIGHUP` used to end the process.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_in_place_and_a_bad_file_changes_nothing() {
    use sha2::{Digest, Sha256};
    let digest = |key: &str| format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())));
    let upstream = streaming_sim(MODEL, Duration::from_millis(100), 20).await;
    let mut proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": {"enabled": true,
            "tenants": {"team": {"keys": [digest("sk-old")]}}}},
    }))
    .await;
    // One kept-alive connection for every request below.
    let kept_alive = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let url = proxy.url("/v1/chat/completions");
    let ask = |key: &'static str| {
        let (client, url) = (kept_alive.clone(), url.clone());
        async move {
            client
                .post(&url)
                .bearer_auth(key)
                .json(&chat(MODEL, "hello", false))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(ask("sk-old").await, 200);
    assert_eq!(ask("sk-new").await, 401);

    // A stream that began before the reload: two seconds long.
    let streaming = tokio::spawn({
        let url = url.clone();
        async move {
            let r = client()
                .post(&url)
                .bearer_auth("sk-old")
                .json(&chat(MODEL, "a story", true))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // sk-old revoked, sk-new added.
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(proxy.config_file()).unwrap()).unwrap();
    config["plugins"]["tenants"]["tenants"]["team"]["keys"] = json!([digest("sk-new")]);
    std::fs::write(proxy.config_file(), config.to_string()).unwrap();
    signal(proxy.pid(), "HUP");
    let switched = wait_for(Duration::from_secs(10), || async {
        ask("sk-new").await == 200
    })
    .await;
    assert!(
        switched.is_some(),
        "the new key never worked\n{}",
        proxy.logs()
    );
    assert_eq!(
        ask("sk-old").await,
        401,
        "a revoked key on a kept-alive connection"
    );

    let (status, body) = streaming.await.unwrap();
    assert_eq!(status, 200);
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");

    // A bad file: refused, and the running config stays.
    std::fs::write(proxy.config_file(), "pools: [this is not a pool").unwrap();
    signal(proxy.pid(), "HUP");
    let refused = wait_for(Duration::from_secs(10), || async {
        proxy
            .metric(r#"sluice_config_reloads_total{result="refused"}"#)
            .await
            == Some(1.0)
    })
    .await;
    assert!(refused.is_some(), "{}", proxy.logs());
    assert!(!proxy.exited(), "SIGHUP ended the process");
    assert_eq!(ask("sk-new").await, 200);
    assert!(proxy.logs().contains("config reload refused"));
}

/// N23: at an upgrade, whoever holds `upgrade_sock` receives the listening sockets, so a
/// socket in a directory other users can write to (a shared `/tmp`) is refused at start, with
/// why; a missing directory is created private.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_socket_in_a_directory_others_can_write_is_refused() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (proxy, admin) = (reserve_port().release(), reserve_port().release());
    let config = dir.path().join("sluice.yaml");
    let write = |sock: &std::path::Path, pid: &std::path::Path| {
        std::fs::write(
            &config,
            format!(
                "pingora:\n  pid_file: {}\n  upgrade_sock: {}\nlisteners: [{{address: \"127.0.0.1:{proxy}\"}}]\nadmin: {{address: \"127.0.0.1:{admin}\"}}\npools:\n  - name: main\n    models: [{MODEL}]\n    backends: [{{address: \"127.0.0.1:9\"}}]\n",
                pid.display(),
                sock.display()
            ),
        )
        .unwrap();
    };
    write(&shared.join("upgrade.sock"), &dir.path().join("sluice.pid"));
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("-c")
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started: {text}");
    assert!(
        text.contains("pingora.upgrade_sock") && text.contains("other users can write"),
        "{text}"
    );

    // A directory that does not exist yet is made, for this user alone; the proxy serves.
    let run = dir.path().join("run/sluice");
    write(&run.join("upgrade.sock"), &run.join("sluice.pid"));
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("-c")
        .arg(&config)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let models = format!("http://127.0.0.1:{proxy}/v1/models");
    let served = wait_for(Duration::from_secs(10), || async {
        client()
            .get(&models)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(served.is_some(), "the proxy never served");
    let made = std::fs::metadata(&run).unwrap();
    assert_eq!(made.mode() & 0o777, 0o700);
    child.kill().await.unwrap();
}

/// At a binary upgrade the old process, which Pingora keeps accepting and serving kept-alive
/// connections for 5 s after it has handed its listeners over, reads the config again and
/// closes each connection after its answer: a key revoked in the file is refused on a
/// connection kept alive from before, and fresh connections never meet the old key set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_never_lets_a_revoked_key_through() {
    upgrade_revoking_a_key(false).await;
}

/// The same when the new process is started with another file (`sluice -u -c new.yaml`):
/// the old process read its own file again, and served a key the new file revoked for 5 s.
/// It now reads the new process's file, whose path the new process leaves beside the
/// upgrade socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_with_another_file_never_lets_a_key_it_revokes_through() {
    upgrade_revoking_a_key(true).await;
}

/// Revokes `sk-old` (in place, or in a new file given to the new process) and upgrades.
async fn upgrade_revoking_a_key(new_file: bool) {
    use sha2::{Digest, Sha256};
    let digest = |key: &str| format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())));
    let upstream = vllm_sim::start(SimConfig::default().with_model(MODEL))
        .await
        .unwrap();
    let mut proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": {"enabled": true,
            "tenants": {"team": {"keys": [digest("sk-old")]}}}},
    }))
    .await;
    let kept_alive = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let url = proxy.url("/v1/chat/completions");
    let ask = |client: reqwest::Client, key: &'static str| {
        let url = url.clone();
        async move {
            client
                .post(&url)
                .bearer_auth(key)
                .json(&chat(MODEL, "hello", false))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(ask(kept_alive.clone(), "sk-old").await, 200);

    // sk-old revoked in the file, then the upgrade.
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(proxy.config_file()).unwrap()).unwrap();
    config["plugins"]["tenants"]["tenants"]["team"]["keys"] = json!([digest("sk-new")]);
    let file = if new_file {
        proxy.config_file().with_file_name("new.yaml")
    } else {
        proxy.config_file().to_path_buf()
    };
    std::fs::write(&file, config.to_string()).unwrap();
    let mut old = upgrade(&mut proxy, Some(&file)).await;
    let handed = wait_for(Duration::from_secs(10), || async {
        proxy.logs().contains("listeners handed to the new process")
            && proxy.logs().contains("config reloaded")
    })
    .await;
    assert!(handed.is_some(), "{}", proxy.logs());
    assert!(
        old.try_wait().unwrap().is_none(),
        "the old process still runs"
    );

    assert_eq!(
        ask(kept_alive.clone(), "sk-old").await,
        401,
        "a revoked key on a connection kept alive from before the upgrade"
    );
    for _ in 0..20 {
        let fresh = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        assert_eq!(ask(fresh.clone(), "sk-old").await, 401);
        assert_eq!(ask(fresh, "sk-new").await, 200);
    }
    assert_eq!(ask(kept_alive, "sk-new").await, 200);
    let _ = old.kill();
}

/// The notes of which engine made which stored response lived in the process's memory only:
/// after an upgrade every follow-up was a 404, though the engines still held the responses.
/// The old process now hands its notes over, and the new one takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_keeps_the_stored_responses_reachable() {
    let upstream = vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_responses_store(true),
    )
    .await
    .unwrap();
    let mut proxy =
        Proxy::start(json!({"pools": [pool("main", &[MODEL], &[upstream.addr()])]})).await;
    let url = proxy.url("/v1/responses");
    let made = client()
        .post(&url)
        .json(&json!({"model": MODEL, "input": "hello", "max_output_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 200);
    let made: serde_json::Value = made.json().await.unwrap();

    let mut old = upgrade(&mut proxy, None).await;
    old_exits(&mut old, &proxy).await;

    let follow_up = client()
        .post(&url)
        .json(
            &json!({"model": MODEL, "input": "and then?", "max_output_tokens": 4,
                      "previous_response_id": made["id"]}),
        )
        .send()
        .await
        .unwrap();
    let status = follow_up.status();
    let body = follow_up.text().await.unwrap();
    assert_eq!(status, 200, "{body}\n{}", proxy.logs());
}

/// Starts a new process with `-u` (on `file`, else the proxy's own config), waits until it
/// waits on the upgrade socket for the listeners, and sends the old one `SIGQUIT`, which
/// hands them over; the old process, now the caller's.
async fn upgrade(proxy: &mut Proxy, file: Option<&std::path::Path>) -> std::process::Child {
    let socket = proxy.config_file().with_file_name("upgrade.sock");
    let old = proxy.take_child();
    let new = match file {
        Some(file) => proxy.spawn_with(file, &["-u"]),
        None => proxy.spawn(&["-u"]),
    };
    proxy.set_child(new);
    let waiting = wait_for(Duration::from_secs(10), || async { socket.exists() }).await;
    assert!(
        waiting.is_some(),
        "the new process never waited for the listeners"
    );
    signal(old.id(), "QUIT");
    old
}

/// Waits (15 s at most) for the old process of an upgrade to exit.
async fn old_exits(old: &mut std::process::Child, proxy: &Proxy) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while old.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the old process did not exit: {}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
