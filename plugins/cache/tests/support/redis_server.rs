//! Real `redis-server` processes for tests: on free ports, in temp dirs, killed on drop.
//! Never a fixed port, never a Redis the machine happens to run.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const HOW_TO_INSTALL: &str =
    "redis-server / redis-cli not found: `scripts/bootstrap --test` installs them";

/// A port nobody listens on now (the OS picks it). `with_bus` also requires `port + 10000`
/// free, for a cluster node's bus.
pub fn free_port(with_bus: bool) -> u16 {
    for _ in 0..200 {
        let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(addr) = listener.local_addr() else {
            continue;
        };
        let port = addr.port();
        if !with_bus {
            return port;
        }
        if port <= 55_535 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port found");
}

fn require(binary: &str) {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(found, "{HOW_TO_INSTALL}");
}

/// Sends one inline command and returns what arrives first (enough for `PING`).
fn send_inline(port: u16, command: &str) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    stream.write_all(format!("{command}\r\n").as_bytes()).ok()?;
    let mut buf = [0u8; 4096];
    let n = stream.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

pub fn pings(port: u16) -> bool {
    send_inline(port, "PING").is_some_and(|r| r.starts_with("+PONG"))
}

/// `redis-cli -p PORT ARGS...`, its stdout.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    require("redis-cli");
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("redis-cli: {e}; {HOW_TO_INSTALL}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

fn spawn_server(port: u16, dir: &Path, extra: &[String]) -> Child {
    require("redis-server");
    let log = std::fs::File::create(dir.join(format!("redis-{port}.log"))).ok();
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.map(Stdio::from).unwrap_or_else(Stdio::null))
        .stderr(Stdio::null());
    cmd.spawn()
        .unwrap_or_else(|e| panic!("cannot start redis-server: {e}; {HOW_TO_INSTALL}"))
}

/// Starts a server and waits until it answers `PING`; `None` if it exited first (e.g. the
/// port was taken in between).
fn start_node(port: u16, dir: &Path, extra: &[String]) -> Option<Child> {
    let mut child = spawn_server(port, dir, extra);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if pings(port) {
            return Some(child);
        }
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("redis-server on port {port} did not answer PING within 10s");
}

fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A single-node Redis.
pub struct RedisServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl RedisServer {
    /// On a free port.
    pub fn start() -> RedisServer {
        for _ in 0..5 {
            let port = free_port(false);
            if let Some(server) = Self::try_start_on(port) {
                return server;
            }
        }
        panic!("redis-server would not start (5 ports tried)");
    }

    /// On `port` (e.g. one a store was pointed at before Redis existed).
    pub fn start_on(port: u16) -> RedisServer {
        Self::try_start_on(port)
            .unwrap_or_else(|| panic!("redis-server exited at start on port {port}"))
    }

    fn try_start_on(port: u16) -> Option<RedisServer> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let child = start_node(port, dir.path(), &[])?;
        Some(RedisServer {
            port,
            dir,
            child: Some(child),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL: a crash, not a shutdown).
    pub fn stop(&mut self) {
        kill(&mut self.child);
    }

    /// Starts it again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(child) = start_node(self.port, self.dir.path(), &[]) {
                self.child = Some(child);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server would not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}

/// A Redis Cluster of masters without replicas.
pub struct RedisCluster {
    ports: Vec<u16>,
    dir: TempDir,
    children: Vec<Option<Child>>,
}

impl RedisCluster {
    pub fn start(nodes: usize) -> RedisCluster {
        require("redis-cli");
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let mut cluster = RedisCluster {
            ports: Vec::new(),
            dir,
            children: Vec::new(),
        };
        while cluster.ports.len() < nodes {
            let port = free_port(true);
            let extra = [
                "--cluster-enabled".to_string(),
                "yes".to_string(),
                "--cluster-config-file".to_string(),
                format!("nodes-{port}.conf"),
                "--cluster-node-timeout".to_string(),
                "2000".to_string(),
            ];
            if let Some(child) = start_node(port, cluster.dir.path(), &extra) {
                cluster.ports.push(port);
                cluster.children.push(Some(child));
            }
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("redis-cli --cluster create: {e}; {HOW_TO_INSTALL}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for &port in &cluster.ports {
            wait_until(
                &format!("cluster_state:ok on port {port}"),
                Duration::from_secs(20),
                || redis_cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"),
            );
        }
        cluster
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// Seed URLs, one per node.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// Keys held by each node.
    pub fn dbsizes(&self) -> Vec<u64> {
        self.ports
            .iter()
            .map(|&p| redis_cli(p, &["DBSIZE"]).trim().parse().unwrap_or(0))
            .collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            kill(child);
        }
    }
}

/// Accepts connections and never answers: a Redis that hangs.
pub struct SilentServer {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl SilentServer {
    pub async fn start() -> SilentServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("local_addr: {e}"))
            .port();
        let task = tokio::spawn(async move {
            // Held open, never read or written.
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        SilentServer { port, task }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
