//! The official `openai` Python package against Sluice and a simulated vLLM backend.
//! Needs `python3` with `openai` installed (`.ci/run` installs it).

mod common;

use common::*;
use vllm_sim::SimConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_sluice() {
    let upstream = vllm_sim::start(SimConfig::default().with_model("test-model"))
        .await
        .unwrap();
    let proxy = Proxy::start(&format!(
        "pools:\n{}",
        pool("main", &["test-model"], &[upstream.addr()], "")
    ))
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let base = format!("http://{}", proxy.addr);
    let out = tokio::process::Command::new("python3")
        .args([script, base.as_str(), "test-model"])
        .output()
        .await
        .expect("python3 is needed for this test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "install the client first: pip install openai"
    );
    assert!(
        out.status.success(),
        "{}{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
}
