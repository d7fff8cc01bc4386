//! Real `redis-server` processes for tests: on free ports, in temp dirs, killed on drop.
//! Never a fixed port, never a Redis the machine happens to run.

use crate::ports::{reserve_port, reserve_this_port, ReservedPort};
use crate::proc::{kill, listens};
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const HOW_TO_INSTALL: &str =
    "redis-server / redis-cli not found: `scripts/bootstrap --test` installs them";

/// Ports to try before giving up on starting a node.
const START_ATTEMPTS: usize = 5;

/// Redis Cluster nodes talk to each other on their port + 10000.
const CLUSTER_BUS_OFFSET: u16 = 10_000;

fn require(binary: &str) {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(found, "{HOW_TO_INSTALL}");
}

/// Whether the server on `port` answers `PING`.
fn pings(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if std::io::Write::write_all(&mut stream, b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    stream
        .read(&mut buf)
        .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
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

fn spawn_server(binary: &str, port: u16, dir: &Path, extra: &[String]) -> Child {
    require(binary);
    let log = std::fs::File::create(dir.join(format!("redis-{port}.log"))).ok();
    let mut cmd = Command::new(binary);
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

/// Starts a server and waits until it listens on `port` itself and answers `PING`; `None`
/// when it exited first (the port was taken in between).
fn start_node(port: u16, dir: &Path, extra: &[String]) -> Option<Child> {
    start_binary("redis-server", port, dir, extra)
}

fn start_binary(binary: &str, port: u16, dir: &Path, extra: &[String]) -> Option<Child> {
    let mut child = Some(spawn_server(binary, port, dir, extra));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let running = child.as_mut().expect("spawned");
        if let Ok(Some(_)) = running.try_wait() {
            return None;
        }
        if listens(running.id(), port) && pings(port) {
            return child;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill(&mut child);
    panic!("redis-server on port {port} did not answer PING within 10s");
}

/// The Redis with vector search that `scripts/install-redis-stack` installs.
fn search_server() -> String {
    let dir =
        std::env::var("SLUICE_REDIS_STACK").unwrap_or_else(|_| "/opt/sluice-redis-stack".into());
    let wrapper = format!("{dir}/bin/redis-search-server");
    assert!(
        Path::new(&wrapper).exists(),
        "{wrapper} not found: `scripts/bootstrap --test` installs it (scripts/install-redis-stack)"
    );
    wrapper
}

/// A single-node Redis.
pub struct RedisServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
    binary: String,
}

impl RedisServer {
    /// On a free port.
    pub fn start() -> RedisServer {
        Self::start_binary("redis-server".into())
    }

    /// A Redis with vector search (RediSearch loaded), on a free port.
    pub fn start_with_search() -> RedisServer {
        Self::start_binary(search_server())
    }

    fn start_binary(binary: String) -> RedisServer {
        for _ in 0..START_ATTEMPTS {
            if let Some(server) = Self::try_start_on(reserve_port(), &binary) {
                return server;
            }
        }
        panic!("{binary} would not start ({START_ATTEMPTS} ports tried)");
    }

    /// On `port`, reserved until now: e.g. one a store was pointed at before Redis existed.
    pub fn start_on(port: ReservedPort) -> RedisServer {
        let number = port.port();
        Self::try_start_on(port, "redis-server")
            .unwrap_or_else(|| panic!("redis-server exited at start on port {number}"))
    }

    fn try_start_on(port: ReservedPort, binary: &str) -> Option<RedisServer> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let port = port.release();
        let child = start_binary(binary, port, dir.path(), &[])?;
        Some(RedisServer {
            port,
            dir,
            child: Some(child),
            binary: binary.to_string(),
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
            if let Some(child) = start_binary(&self.binary, self.port, self.dir.path(), &[]) {
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
    _dir: TempDir,
    children: Vec<Option<Child>>,
}

impl RedisCluster {
    pub fn start(nodes: usize) -> RedisCluster {
        require("redis-cli");
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let (mut ports, mut children) = (Vec::new(), Vec::new());
        let mut attempts = 0;
        while ports.len() < nodes {
            attempts += 1;
            assert!(
                attempts <= nodes * START_ATTEMPTS,
                "redis-server cluster nodes would not start"
            );
            let (port, bus) = reserve_port_and_bus();
            let port = port.release();
            drop(bus);
            let extra = [
                "--cluster-enabled".to_string(),
                "yes".to_string(),
                "--cluster-config-file".to_string(),
                format!("nodes-{port}.conf"),
                "--cluster-node-timeout".to_string(),
                "2000".to_string(),
            ];
            if let Some(child) = start_node(port, dir.path(), &extra) {
                ports.push(port);
                children.push(Some(child));
            }
        }
        let cluster = RedisCluster {
            ports,
            _dir: dir,
            children,
        };
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

/// A port for a cluster node, and its bus port (port + 10000), both reserved.
fn reserve_port_and_bus() -> (ReservedPort, ReservedPort) {
    for _ in 0..1000 {
        let port = reserve_port();
        let bus = port
            .port()
            .checked_add(CLUSTER_BUS_OFFSET)
            .and_then(reserve_this_port);
        if let Some(bus) = bus {
            return (port, bus);
        }
    }
    panic!("no port whose bus port (+{CLUSTER_BUS_OFFSET}) was free too");
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

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP relay in front of a Redis that holds every chunk coming back from it for a delay
/// (in order, pipelined): a Redis that answers everything that late. The delay can change
/// while it runs ([`SlowRelay::set_delay`]); a chunk keeps the delay it came under.
pub struct SlowRelay {
    addr: std::net::SocketAddr,
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowRelay {
    pub async fn start(upstream: std::net::SocketAddr, delay: std::time::Duration) -> SlowRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let delay_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
            u64::try_from(delay.as_millis()).unwrap(),
        ));
        let shared = delay_ms.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay(client, upstream, shared.clone()));
            }
        });
        SlowRelay {
            addr,
            delay_ms,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Where it listens (it relays any TCP, not only Redis).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The delay of the answers that come from now on.
    pub fn set_delay(&self, delay: std::time::Duration) {
        self.delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap(),
            std::sync::atomic::Ordering::SeqCst,
        );
    }
}

impl Drop for SlowRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    client: tokio::net::TcpStream,
    upstream: std::net::SocketAddr,
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let down = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from_server.read(&mut buf).await {
            let delay = std::time::Duration::from_millis(
                delay_ms.load(std::sync::atomic::Ordering::SeqCst),
            );
            if n == 0
                || tx
                    .send((tokio::time::Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    while let Some((due, bytes)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if to_client.write_all(&bytes).await.is_err() {
            break;
        }
    }
    up.abort();
    down.abort();
}
