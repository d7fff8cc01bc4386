//! The real `sluice` binary, started on free ports with a config a test builds as JSON.

use crate::llm::{ask_url, client, wait_for, Answer};
use crate::ports::reserve_port;
use crate::proc::{kill, listens};
use serde_json::{json, Value};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the binary gets to listen on both ports.
const START_LIMIT: Duration = Duration::from_secs(20);

/// Fresh ports to try when the ones handed over were taken before the binary bound them.
const START_ATTEMPTS: usize = 5;

/// What Pingora logs, then retries for half a minute, when its port is taken.
const PORT_TAKEN: &str = "is in use, will try again";

/// A running `sluice`, killed on drop; its log is printed when the test fails.
pub struct Proxy {
    child: Option<Child>,
    /// The proxy listener.
    pub addr: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    /// Holds the config, the log, the pid file and the upgrade socket; removed on drop.
    _dir: tempfile::TempDir,
    config: PathBuf,
    log: PathBuf,
}

impl Proxy {
    /// Starts the binary with `config`, a JSON object of the config file's sections
    /// (conf/README.md): usually `pools`, and `plugins`, `routes` or `limits` as a test needs.
    /// The harness adds the listener and admin addresses on free ports, a `log` section and
    /// the `pingora` keys a test process needs (pid file and upgrade socket in a temp dir, two
    /// threads, short grace periods); `pingora` keys in `config` win over those. Written as
    /// JSON, which is YAML too. Returns once the process itself listens on both addresses.
    pub async fn start(config: Value) -> Proxy {
        let Value::Object(mut sections) = config else {
            panic!("the config is a JSON object: {config}");
        };
        for owned in ["listeners", "admin"] {
            assert!(
                !sections.contains_key(owned),
                "`{owned}` belongs to the harness: it picks the ports"
            );
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let mut pingora = json!({
            "threads": 2,
            "pid_file": dir.path().join("sluice.pid"),
            "upgrade_sock": dir.path().join("upgrade.sock"),
            "grace_period_seconds": 3,
            "graceful_shutdown_timeout_seconds": 5,
        });
        if let Some(Value::Object(keys)) = sections.remove("pingora") {
            pingora.as_object_mut().expect("an object").extend(keys);
        }
        sections.insert("pingora".into(), pingora);
        sections
            .entry("log")
            .or_insert_with(|| json!({"level": "info"}));

        let mut proxy = Proxy {
            child: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            config: dir.path().join("sluice.yaml"),
            log: dir.path().join("sluice.log"),
            _dir: dir,
        };
        for _ in 0..START_ATTEMPTS {
            let (addr, admin) = (reserve_port(), reserve_port());
            (proxy.addr, proxy.admin) = (addr.addr(), admin.addr());
            sections.insert(
                "listeners".into(),
                json!([{"address": proxy.addr.to_string()}]),
            );
            sections.insert("admin".into(), json!({"address": proxy.admin.to_string()}));
            let text = serde_json::to_string_pretty(&sections).expect("JSON");
            std::fs::write(&proxy.config, text).expect("write the config");
            let _ = std::fs::remove_file(&proxy.log);
            // Held until now: released just before the binary binds them.
            addr.release();
            admin.release();
            proxy.child = Some(proxy.spawn(&[]));
            if proxy.wait_listening().await {
                return proxy;
            }
            kill(&mut proxy.child);
        }
        panic!(
            "sluice found its ports taken {START_ATTEMPTS} times:\n{}",
            proxy.logs()
        );
    }

    /// Starts another process of the binary on this proxy's config, with extra flags (`-u`
    /// for an upgrade); the harness does not hold it (see [`Proxy::set_child`]).
    pub fn spawn(&self, extra: &[&str]) -> Child {
        self.spawn_with(&self.config, extra)
    }

    /// [`Proxy::spawn`] with another config file (`sluice -u -c new.yaml`).
    pub fn spawn_with(&self, config: &std::path::Path, extra: &[&str]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        Command::new(binary())
            .arg("-c")
            .arg(config)
            .args(extra)
            // The config's `log.level` decides (the harness sets `info` unless a test says).
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn sluice")
    }

    /// `true` once the running process listens on both addresses; `false` when one of its
    /// ports was taken. Panics when it exits or does not start in time.
    async fn wait_listening(&mut self) -> bool {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            let child = self.child.as_mut().expect("running");
            let pid = child.id();
            if let Ok(Some(status)) = child.try_wait() {
                if self.logs().contains("Address already in use") {
                    return false;
                }
                panic!("sluice exited early ({status}):\n{}", self.logs());
            }
            if self.logs().contains(PORT_TAKEN) {
                return false;
            }
            if listens(pid, self.addr.port()) && listens(pid, self.admin.port()) {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "sluice did not start:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// The config file the process runs with (JSON): a reload test rewrites it.
    pub fn config_file(&self) -> &std::path::Path {
        &self.config
    }

    /// The running process's id, for signals.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some())
    }

    /// Everything the processes of this proxy logged.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Takes the process out of the harness (for signal tests); it is not killed on drop.
    pub fn take_child(&mut self) -> Child {
        self.child.take().expect("running")
    }

    /// Hands a process (one from [`Proxy::spawn`]) to the harness, to be killed on drop.
    pub fn set_child(&mut self, child: Child) {
        self.child = Some(child);
    }

    /// POSTs `body` to `/v1/chat/completions` with extra `headers`.
    pub async fn ask(&self, body: &Value, headers: &[(&str, &str)]) -> Answer {
        ask_url(&self.url("/v1/chat/completions"), body, headers).await
    }

    /// Asks until the answer is a cache hit, for at most 5 s: write-backs are asynchronous.
    /// Every answer on the way must be a 200. Returns the last answer.
    pub async fn until_hit(&self, body: &Value, headers: &[(&str, &str)]) -> Answer {
        self.until_hit_within(body, headers, Duration::from_secs(5))
            .await
    }

    /// As [`Proxy::until_hit`], for at most `within` (a store recovering takes longer).
    pub async fn until_hit_within(
        &self,
        body: &Value,
        headers: &[(&str, &str)],
        within: Duration,
    ) -> Answer {
        let deadline = Instant::now() + within;
        loop {
            let a = self.ask(body, headers).await;
            assert_eq!(a.status, 200, "{}", a.body);
            if a.x_cache == "HIT" || Instant::now() > deadline {
                return a;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The admin `/status` document.
    pub async fn status(&self) -> Value {
        client()
            .get(self.admin_url("/status"))
            .send()
            .await
            .expect("admin answers")
            .json()
            .await
            .expect("status is JSON")
    }

    /// One backend's entry in `/status`, by pool name and address (`null` when absent).
    pub async fn backend_status(&self, pool: &str, addr: SocketAddr) -> Value {
        let status = self.status().await;
        status["pools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["name"] == pool)
            .flat_map(|p| p["backends"].as_array().cloned().unwrap_or_default())
            .find(|b| b["address"] == addr.to_string())
            .unwrap_or(Value::Null)
    }

    /// The admin `/metrics` text.
    pub async fn metrics(&self) -> String {
        client()
            .get(self.admin_url("/metrics"))
            .send()
            .await
            .expect("admin answers")
            .text()
            .await
            .expect("metrics text")
    }

    /// The value of one series in `/metrics` now (see [`metric_value`]).
    pub async fn metric(&self, series: &str) -> Option<f64> {
        metric_value(&self.metrics().await, series)
    }

    /// Sends `SIGHUP` and waits until the reload is taken (`sluice_config_reloads_total{result="ok"}`
    /// one higher); panics with the logs when it is not within 20 s.
    pub async fn reload(&self) {
        const OK: &str = r#"sluice_config_reloads_total{result="ok"}"#;
        let before = self.metric(OK).await.unwrap_or(0.0);
        signal(self.pid(), "HUP");
        let taken = wait_for(Duration::from_secs(20), || async {
            self.metric(OK).await.unwrap_or(0.0) > before
        })
        .await;
        assert!(taken.is_some(), "the reload was not taken: {}", self.logs());
    }

    /// The value of one series once it is `want`, or its last value after 5 s: what a request
    /// counts when it ends (its logging hook) is counted just after the client has its answer.
    pub async fn metric_once(&self, series: &str, want: f64) -> Option<f64> {
        // The value the last look read: the one that matched, without asking again.
        let last = &std::sync::Mutex::new(None);
        wait_for(Duration::from_secs(5), move || async move {
            let value = self.metric(series).await;
            *last.lock().unwrap_or_else(|e| e.into_inner()) = value;
            value == Some(want)
        })
        .await;
        let value = *last.lock().unwrap_or_else(|e| e.into_inner());
        value
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        kill(&mut self.child);
        if std::thread::panicking() {
            let _ = writeln!(std::io::stderr(), "--- sluice log ---\n{}", self.logs());
        }
    }
}

/// The value of the series `name{labels}` in a `/metrics` text (labels as Prometheus prints
/// them, sorted), if any.
pub fn metric_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// The binary under test. Cargo builds it for the root package's integration tests and
/// says where, when it runs them.
pub(crate) fn binary() -> PathBuf {
    std::env::var_os("CARGO_BIN_EXE_sluice")
        .map(PathBuf::from)
        .expect("CARGO_BIN_EXE_sluice: run the tests with `cargo test`")
}

/// Waits for `child` to exit successfully; returns how long it took, or panics after `limit`.
pub async fn exits_within(child: &mut Child, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            assert!(status.success(), "exit status {status}");
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "still running {limit:?} after the signal"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends a signal (`TERM`, `QUIT`, ...) to a process.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{sig} {pid}");
}
