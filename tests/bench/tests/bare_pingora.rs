//! The bare Pingora contender proxies for real: the same answer as the simulator's own.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use sluice_bench::contenders::{start_bare_pingora, MODEL};
use sluice_bench::loadgen::{fetch, Target};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bare_pingora_proxy_passes_requests_through() {
    let sim = vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_listen(([127, 0, 0, 1], 0).into())
            .with_model(MODEL),
    )
    .await
    .expect("simulator");
    let dir = tempfile::tempdir().expect("temporary directory");
    let (proc, addr) = start_bare_pingora(
        env!("CARGO_BIN_EXE_sluice-bench").as_ref(),
        dir.path(),
        sim.addr(),
    )
    .await
    .expect("bare pingora");
    let body = Bytes::from(format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"temperature":0,"max_tokens":8}}"#
    ));
    let path = "/v1/chat/completions";
    let (status, _, proxied) = fetch(&Target::post_json(addr, path, body.clone()))
        .await
        .expect("through the proxy");
    let (_, _, direct) = fetch(&Target::post_json(sim.addr(), path, body))
        .await
        .expect("direct");
    assert_eq!(status, 200);
    let text = |b: &Bytes| {
        let v: serde_json::Value = serde_json::from_slice(b).expect("JSON");
        v["choices"][0]["message"]["content"].clone()
    };
    assert_eq!(text(&proxied), text(&direct));
    assert!(text(&proxied).is_string());
    drop(proc);
    sim.shutdown();
}
