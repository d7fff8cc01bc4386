//! The benchmark harness's smoke run (tests/bench): every scenario with tiny loads, so the
//! harness keeps working. It checks that each implemented scenario measured something and that
//! no contender failed a request; it never looks at timings.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_harness_smoke_run() {
    let dir = tempfile::tempdir().unwrap();
    let progress = dir.path().join("report.md.partial");
    let report = sluice_bench::smoke(env!("CARGO_BIN_EXE_sluice").into(), Some(progress.clone()))
        .await
        .expect("the smoke run");
    assert_eq!(report.scenarios.len(), sluice_bench::scenarios::ALL.len());
    // The report so far, rewritten after each scenario, holds every scenario by the end: a
    // run stopped part way keeps what it measured.
    let so_far = std::fs::read_to_string(&progress).expect("the report so far");
    for sc in &report.scenarios {
        let heading = format!("\n### {}. ", sc.id);
        assert!(
            so_far.contains(&heading),
            "scenario {} is not in {so_far}",
            sc.id
        );
    }
    for sc in &report.scenarios {
        match &sc.outcome {
            sluice_bench::Outcome::Pending(_) => continue,
            sluice_bench::Outcome::Failed(e) => panic!("scenario {} failed: {e}", sc.id),
            sluice_bench::Outcome::Done => {}
        }
        assert!(
            !sc.measured.is_empty(),
            "scenario {} measured nothing",
            sc.id
        );
        assert!(!sc.rows.is_empty(), "scenario {} has no table", sc.id);
        for m in &sc.measured {
            assert!(
                m.requests > 0,
                "scenario {}: {} made no requests",
                sc.id,
                m.contender
            );
            assert_eq!(
                m.errors, 0,
                "scenario {}: {} had errors: {:?}",
                sc.id, m.contender, m.first_error
            );
        }
        // Scenario 7 measures Sluice's own health checks, 10 a backend killed behind it, 11
        // its KV breaker's burst handling, 12 its tenants plugin, 13 and 25 its balancing
        // strategies, 18 its plugins one by one, 20 its HTTP/2 streams against its own
        // HTTP/1.1 ones, 22 its backend discovery, 23 its own soak under faults, 24 its
        // prefix routing, 26 its traces, 28 its waiting room, 29 its flow control, 30 its
        // disaggregated prefill, 31 its semantic cache, 32 its features' costs, 33 what
        // following a fleet costs it and 34 its instructions under callgrind: nginx has none
        // of them.
        let nginx = sc
            .measured
            .iter()
            .any(|m| m.contender == sluice_bench::Contender::Nginx);
        assert!(
            nginx
                || [7, 10, 11, 12, 13, 18, 20, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34,]
                    .contains(&sc.id),
            "scenario {}: nginx did not run",
            sc.id
        );
    }
    let text = report.markdown();
    assert!(!text.contains("pending"), "{text}");
}
