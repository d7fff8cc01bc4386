//! "From nginx to Sluice" (deploy/README.md): the nginx config for a vLLM fleet and the
//! sluice.yaml that replaces it are both real: `nginx -t` and `sluice -t` accept them, from a
//! folder laid out as the README says (the config beside a `certs/` folder).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sluice_testkit::explain;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh folder holding `file` from deploy/from-nginx/ and the example certificates.
fn layout(file: &str) -> (tempfile::TempDir, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        root.join("deploy/from-nginx").join(file),
        dir.path().join(file),
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("certs")).unwrap();
    for cert in ["localhost.crt", "localhost.key"] {
        std::fs::copy(
            root.join("conf/examples/certs").join(cert),
            dir.path().join("certs").join(cert),
        )
        .unwrap();
    }
    let path = dir.path().join(file);
    (dir, path)
}

#[test]
fn the_sluice_config_that_replaces_nginx_is_valid() {
    let (_dir, config) = layout("sluice.yaml");
    let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("-c")
        .arg(&config)
        .arg("-t")
        .env("VLLM_API_KEY", "vllm-fleet-secret")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", explain("sluice -t", &output));

    // The upstream credential is read at load: without it the config is refused, naming the key.
    let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("-c")
        .arg(&config)
        .arg("-t")
        .env_remove("VLLM_API_KEY")
        .output()
        .unwrap();
    assert!(
        !output.status.success(),
        "{}",
        explain("sluice -t", &output)
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("upstream_auth"),
        "{}",
        explain("sluice -t without VLLM_API_KEY", &output)
    );
}

#[test]
fn the_nginx_config_it_replaces_is_valid() {
    let (dir, config) = layout("nginx.conf");
    let nginx = ["nginx", "/usr/sbin/nginx"]
        .into_iter()
        .find(|candidate| Command::new(candidate).arg("-v").output().is_ok())
        .unwrap_or_else(|| panic!("nginx is missing: run scripts/bootstrap --test"));
    let prefix = dir.path();
    let globals = format!(
        "pid {}; error_log {};",
        prefix.join("nginx.pid").display(),
        prefix.join("error.log").display()
    );
    let output = Command::new(nginx)
        .arg("-t")
        .arg("-p")
        .arg(prefix)
        .arg("-c")
        .arg(&config)
        .arg("-g")
        .arg(&globals)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", explain("nginx -t", &output));
}
