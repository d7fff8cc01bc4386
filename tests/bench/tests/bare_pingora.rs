//! The bare Pingora contenders proxy for real, with each of the knobs scenario 21 turns: the
//! same answer as the simulator's own.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use sluice_bench::contenders::{start_bare_pingora, Contender, MODEL};
use sluice_bench::loadgen::{fetch, Target};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bare_pingora_proxies_pass_requests_through() {
    let sim = vllm_sim::start(
        vllm_sim::SimConfig::default()
            .with_listen(([127, 0, 0, 1], 0).into())
            .with_model(MODEL),
    )
    .await
    .expect("simulator");
    let dir = tempfile::tempdir().expect("temporary directory");
    let body = Bytes::from(format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"temperature":0,"max_tokens":8}}"#
    ));
    let path = "/v1/chat/completions";
    let (_, _, direct) = fetch(&Target::post_json(sim.addr(), path, body.clone()))
        .await
        .expect("direct");
    let text = |b: &Bytes| {
        let v: serde_json::Value = serde_json::from_slice(b).expect("JSON");
        v["choices"][0]["message"]["content"].clone()
    };
    assert!(text(&direct).is_string());
    let variants = [
        Contender::BarePingora,
        Contender::BarePingoraNoWorkStealing,
        Contender::BarePingoraOneThread,
        Contender::BarePingoraTwoListenerTasks,
    ];
    // All at once, as scenario 21 runs them: each has its own pid file and socket.
    let mut running = Vec::new();
    for c in variants {
        let knobs = c.bare_knobs().expect("a bare Pingora contender");
        let started = start_bare_pingora(
            env!("CARGO_BIN_EXE_sluice-bench").as_ref(),
            dir.path(),
            sim.addr(),
            knobs,
        )
        .await
        .unwrap_or_else(|e| panic!("{c}: {e:#}"));
        running.push((c, started));
    }
    for (c, (_, addr)) in &running {
        let (status, _, proxied) = fetch(&Target::post_json(*addr, path, body.clone()))
            .await
            .unwrap_or_else(|e| panic!("{c}: {e:#}"));
        assert_eq!(status, 200, "{c}");
        assert_eq!(text(&proxied), text(&direct), "{c}");
    }
    // The knobs reach Pingora: `threads: 1` runs one worker thread fewer.
    let threads = |c: Contender| {
        let (proc, _) = &running.iter().find(|(k, _)| *k == c).expect("started").1;
        let pid = proc.pid().expect("a pid");
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("its threads")
            .count()
    };
    assert_eq!(
        threads(Contender::BarePingoraOneThread) + 1,
        threads(Contender::BarePingora)
    );
    drop(running);
    sim.shutdown();
}
