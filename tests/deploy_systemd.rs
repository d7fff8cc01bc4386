//! deploy/systemd: the unit passes `systemd-analyze verify`, and its start and reload command
//! lines, run by hand, start the proxy and reload its config in place.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const SYSTEMD_ANALYZE: &str = "/usr/bin/systemd-analyze";
const UNIT_BIN: &str = "/usr/bin/sluice";
const UNIT_CONF: &str = "/etc/sluice/sluice.yaml";
const UNIT_RUN: &str = "/run/sluice/";

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/systemd")
        .join(file)
}

fn unit() -> String {
    std::fs::read_to_string(deploy("sluice.service")).unwrap()
}

/// The values of `key=` in the unit, in order.
fn values(unit: &str, key: &str) -> Vec<String> {
    let prefix = format!("{key}=");
    unit.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    assert!(
        Path::new(SYSTEMD_ANALYZE).exists(),
        "{SYSTEMD_ANALYZE} is missing: install systemd (Debian: apt-get install systemd)"
    );
    // verify checks that every Exec*= binary exists: point the unit at the built one.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.service");
    std::fs::write(
        &path,
        unit().replace(UNIT_BIN, env!("CARGO_BIN_EXE_sluice")),
    )
    .unwrap();
    let out = Command::new(SYSTEMD_ANALYZE)
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{stderr}"
    );
    // Unknown keys and bad values are only warnings (exit status 0): none is allowed.
    assert!(
        !stderr.contains("sluice.service"),
        "systemd-analyze verify warns about the unit:\n{stderr}"
    );
}

#[test]
fn the_unit_matches_the_production_config() {
    let unit = unit();
    let conf = std::fs::read_to_string(deploy("sluice.yaml")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("-t")
        .arg("-c")
        .arg(deploy("sluice.yaml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The PID file the unit writes, the upgrade socket, both in its RuntimeDirectory.
    assert_eq!(values(&unit, "PIDFile"), ["/run/sluice/sluice.pid"]);
    assert_eq!(values(&unit, "RuntimeDirectory"), ["sluice"]);
    assert!(conf.contains("pid_file: /run/sluice/sluice.pid"));
    assert!(conf.contains("upgrade_sock: /run/sluice/upgrade.sock"));
    // TimeoutStopSec covers the grace period and the runtimes' shutdown timeout.
    let number = |key: &str| -> u64 {
        let line = conf
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{key}:")))
            .unwrap();
        let value = line.split(':').nth(1).unwrap();
        value.split('#').next().unwrap().trim().parse().unwrap()
    };
    let stop: u64 = values(&unit, "TimeoutStopSec")[0].parse().unwrap();
    assert!(
        stop > number("grace_period_seconds") + number("graceful_shutdown_timeout_seconds"),
        "TimeoutStopSec={stop} does not cover the grace period"
    );
}

/// A command line of the unit, made runnable here: the built binary, a test config, a
/// temporary runtime directory, and systemd's `$$` escape undone.
fn localize(line: &str, conf: &Path, run: &Path) -> String {
    line.replace(UNIT_BIN, env!("CARGO_BIN_EXE_sluice"))
        .replace(UNIT_CONF, conf.to_str().unwrap())
        .replace(UNIT_RUN, &format!("{}/", run.display()))
        .replace("$$", "$")
}

/// Runs one command line as systemd would (words split on spaces; `/bin/sh -c '...'` keeps
/// its quoted script whole), with `$MAINPID` set.
fn run_like_systemd(line: &str, mainpid: Option<u32>, log: &Path) {
    let mut command = if let Some(script) = line.strip_prefix("/bin/sh -c '") {
        let mut c = Command::new("/bin/sh");
        c.arg("-c").arg(script.strip_suffix('\'').unwrap());
        c
    } else {
        let line = match mainpid {
            Some(pid) => line.replace("$MAINPID", &pid.to_string()),
            None => line.to_string(),
        };
        let mut words = line.split_whitespace();
        let mut c = Command::new(words.next().unwrap());
        c.args(words);
        c
    };
    if let Some(pid) = mainpid {
        command.env("MAINPID", pid.to_string());
    }
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let status = command
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .status()
        .unwrap();
    assert!(status.success(), "`{line}` failed: {status}");
}

fn read_pid(file: &Path) -> u32 {
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Alive, and not a zombie waiting for a parent that is not the test to reap it.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap().trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

/// Status code of `GET path`, or None when nothing answers.
fn get(port: u16, path: &str) -> Option<u16> {
    body(port, path)?.split_whitespace().nth(1)?.parse().ok()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGTERMs the processes left behind, whatever the outcome.
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in &self.0 {
            if alive(*pid) {
                let _ = Command::new("kill").arg(pid.to_string()).status();
            }
        }
    }
}

#[test]
fn the_reload_command_lines_reload_the_config_in_place() {
    let unit = unit();
    let run = tempfile::tempdir().unwrap();
    let proxy = sluice_testkit::free_port();
    let admin = sluice_testkit::free_port();
    // The production config, on free local ports and the temporary runtime directory.
    let conf = std::fs::read_to_string(deploy("sluice.yaml"))
        .unwrap()
        .replace("0.0.0.0:8080", &format!("127.0.0.1:{proxy}"))
        .replace("127.0.0.1:9090", &format!("127.0.0.1:{admin}"))
        .replace(UNIT_RUN, &format!("{}/", run.path().display()));
    let conf_path = run.path().join("sluice.yaml");
    std::fs::write(&conf_path, conf).unwrap();
    let pid_file = run.path().join("sluice.pid");
    let log = run.path().join("sluice.log");
    let mut reaper = Reaper(Vec::new());

    for line in values(&unit, "ExecStartPre")
        .iter()
        .chain(&values(&unit, "ExecStart"))
    {
        run_like_systemd(&localize(line, &conf_path, run.path()), None, &log);
    }
    let old = read_pid(&pid_file);
    reaper.0.push(old);
    wait_for("the first process serves", || {
        get(proxy, "/v1/models") == Some(200)
    });

    // A model added to the first pool: served once the reload is done.
    let edited = std::fs::read_to_string(&conf_path).unwrap().replacen(
        "models: [",
        "models: [reloaded-model, ",
        1,
    );
    std::fs::write(&conf_path, edited).unwrap();
    let reload = values(&unit, "ExecReload");
    assert!(reload.iter().any(|l| l.contains("HUP")), "{reload:?}");
    for line in &reload {
        run_like_systemd(&localize(line, &conf_path, run.path()), Some(old), &log);
    }
    wait_for("the reloaded config serves", || {
        body(proxy, "/v1/models").is_some_and(|b| b.contains("reloaded-model"))
    });
    // In place: the same process, the PID file unchanged.
    assert!(alive(old), "the process is gone");
    assert_eq!(read_pid(&pid_file), old);
    assert_eq!(get(admin, "/healthz"), Some(200));
}

/// The answer of `GET path`, whole, or None when nothing answers.
fn body(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    Some(answer)
}
