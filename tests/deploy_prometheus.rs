//! The shipped Prometheus rules (`deploy/prometheus/`): valid for `promtool check rules`, and
//! their alerts fire and stay quiet as `sluice-rules.test.yaml`'s unit tests say.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

/// Runs `promtool` with `args` from the workspace root; panics with its output unless it passes.
fn promtool(args: &[&str]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = match Command::new("promtool")
        .args(args)
        .current_dir(root)
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!(
                "promtool is missing (Debian's `prometheus` package): run scripts/bootstrap --test"
            )
        }
        Err(e) => panic!("promtool could not be run: {e}"),
    };
    assert!(
        output.status.success(),
        "promtool {} failed ({}):\n{}{}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

#[test]
fn the_rules_are_valid() {
    promtool(&["check", "rules", "deploy/prometheus/sluice-rules.yaml"]);
}

#[test]
fn the_rules_unit_tests_pass() {
    promtool(&["test", "rules", "deploy/prometheus/sluice-rules.test.yaml"]);
}
