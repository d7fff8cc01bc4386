//! Child processes: whether one listens on a port itself, stopping it, `sluice demo`, and
//! the message of a failed command.

use std::collections::HashSet;
use std::process::Child;

/// Whether process `pid` holds a socket listening on TCP `port` (any local address), read
/// from `/proc`. Unlike "the port accepts", this cannot be fooled by a stranger on the port.
pub(crate) fn listens(pid: u32, port: u16) -> bool {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            let target = target.to_string_lossy();
            target
                .strip_prefix("socket:[")
                .and_then(|rest| rest.strip_suffix(']'))
                .is_some_and(|inode| inodes.contains(inode))
        })
    })
}

/// The inodes of the sockets listening on `port`.
fn listening_inodes(port: u16) -> HashSet<String> {
    const LISTEN: &str = "0A";
    let port = format!("{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| {
            text.lines()
                .skip(1)
                .filter_map(|line| {
                    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let local_port = fields.get(1)?.rsplit(':').next()?;
                    (local_port == port && *fields.get(3)? == LISTEN)
                        .then(|| fields.get(9).map(|inode| inode.to_string()))
                        .flatten()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Kills the child (SIGKILL: a crash, not a shutdown) and reaps it.
pub(crate) fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A command's status, stdout and stderr under `what`: the message of a failed check.
pub fn explain(what: &str, output: &std::process::Output) -> String {
    format!(
        "{what} ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs one of the tests' Python scripts (`tests/<script>`, with `python3` and the packages
/// `scripts/bootstrap --test` installs) and fails the test, with its output, if it fails.
pub async fn run_python(script: &str, args: &[&str]) {
    let path = format!("{}/../{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .await
        .expect("python3 is needed for this test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named"),
        "install the test's Python packages first: scripts/bootstrap --test\n{stderr}"
    );
    assert!(out.status.success(), "{}", explain(script, &out));
    print!("{}", String::from_utf8_lossy(&out.stdout));
}

/// `sluice demo` on the given ports, killed on drop.
pub struct Demo {
    child: Child,
    /// The target pool's simulator URL, as the demo prints it.
    pub target: String,
}

impl Demo {
    /// Starts the demo and waits (at most a minute) for it to print its target simulator's
    /// URL; its output is read to the end, so it never blocks on a full pipe.
    pub fn start(proxy: u16, admin: u16) -> Demo {
        use std::io::{BufRead, BufReader};
        let mut child = std::process::Command::new(crate::proxy::binary())
            // The workspace root, as the README runs it.
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .args([
                "demo",
                "--port",
                &proxy.to_string(),
                "--admin-port",
                &admin.to_string(),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("sluice demo starts");
        let stdout = child.stdout.take().expect("the demo's stdout");
        let mut demo = Demo {
            child,
            target: String::new(),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent && line.trim_start().starts_with("target pool") {
                    if let Some(url) = line.split_whitespace().last() {
                        let _ = tx.send(url.to_string());
                        sent = true;
                    }
                }
            }
        });
        demo.target = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the demo prints its target simulator's URL");
        demo
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_listens_where_it_bound_and_nowhere_else() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens(std::process::id(), port));
        drop(listener);
        assert!(!listens(std::process::id(), port));
    }
}
