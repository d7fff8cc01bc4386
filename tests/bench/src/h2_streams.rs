//! Scenario 20: streams over HTTP/2 from clients beside the same streams over HTTP/1.1. One
//! Sluice (plugins off) with an h2c listener; HTTP/1.1 streams each on a connection of their
//! own, HTTP/2 streams all multiplexed on one connection; the simulator itself as the floor.
//! Per stream: time to first token, DATA frames (h2) or body chunks (h1) against SSE events
//! (one event per frame: nothing coalesced on the way), and Sluice's RSS.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;

use crate::contenders::{
    free_addr, reset_peak_rss, sluice_config, start_sluice_with, status_bytes, RunningSim, Setup,
    SimSpec,
};
use crate::loadgen::{record, Target};
use crate::report::{Measured, ScenarioReport};
use crate::scenarios::{chat_body, title, CHAT};
use crate::sse::{self, SseLoad, SseResult};
use crate::{Contender, Ctx};

pub async fn h2_streams(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(20, title(20));
    let dir = tempfile::tempdir_in(ctx.root.path())?;
    let spec = SimSpec::streaming(ctx.p.stream_itl_ms, ctx.p.stream_tokens);
    let sim = RunningSim::start(&ctx.sim, &spec, dir.path()).await?;
    let (listen, admin) = (free_addr()?, free_addr()?);
    let yaml = sluice_config(
        dir.path(),
        "sluice-h2",
        listen,
        admin,
        sim.addr,
        &Setup::Off,
        None,
    )
    .replace(
        &format!("listeners:\n  - address: {listen}\n"),
        &format!("listeners:\n  - address: {listen}\n    h2c: true\n"),
    );
    let proc = start_sluice_with(
        &ctx.sluice_bin,
        dir.path(),
        "sluice-h2",
        &yaml,
        &[listen, admin],
    )
    .await?;
    let pid = proc.pid().ok_or_else(|| anyhow!("sluice has no pid"))?;
    let body = chat_body("Tell me a story.", true, 4096);
    let load = SseLoad::steady(
        ctx.p.stream_concurrency,
        ctx.p.stream_duration,
        ctx.p.stream_tokens,
        ctx.p.stream_itl_ms,
    );

    report.header = [
        "client",
        "streams",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "added TTFT p50 ms",
        "added TTFT p99 ms",
        "chunks/stream",
        "events/stream",
        "chunks with >1 event",
        "Sluice peak RSS MB",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let mut runs: Vec<(&str, Contender, SseResult, Option<u64>)> = Vec::new();
    for round in 0..ctx.p.rounds {
        let _ = round;
        let direct = sse::run(
            Arc::new(Target::post_json(sim.addr, CHAT, body.clone())),
            load.clone(),
            Arc::new(AtomicUsize::new(0)),
        )
        .await?;
        runs.push(("direct, HTTP/1.1", Contender::Direct, direct, None));
        reset_peak_rss(pid)?;
        let h1 = sse::run(
            Arc::new(Target::post_json(listen, CHAT, body.clone())),
            load.clone(),
            Arc::new(AtomicUsize::new(0)),
        )
        .await?;
        let rss = status_bytes(pid, "VmHWM")?;
        runs.push((
            "sluice, HTTP/1.1 (a connection per stream)",
            Contender::SluiceOff,
            h1,
            Some(rss),
        ));
        reset_peak_rss(pid)?;
        let h2 = h2_run(listen, &body, &load).await?;
        let rss = status_bytes(pid, "VmHWM")?;
        runs.push((
            "sluice, HTTP/2 (h2c, every stream on one connection)",
            Contender::SluiceOff,
            h2,
            Some(rss),
        ));
    }
    let direct_ttft = |p: f64| {
        let v: Vec<f64> = runs
            .iter()
            .filter(|r| r.1 == Contender::Direct)
            .map(|r| r.2.ttft_ms(p))
            .collect();
        median(&v)
    };
    let (d50, d99) = (direct_ttft(50.0), direct_ttft(99.0));
    for label in [
        "direct, HTTP/1.1",
        "sluice, HTTP/1.1 (a connection per stream)",
        "sluice, HTTP/2 (h2c, every stream on one connection)",
    ] {
        let mine: Vec<&(&str, Contender, SseResult, Option<u64>)> =
            runs.iter().filter(|r| r.0 == label).collect();
        let med = |f: &dyn Fn(&SseResult) -> f64| {
            median(&mine.iter().map(|r| f(&r.2)).collect::<Vec<_>>())
        };
        let rss: Vec<f64> = mine
            .iter()
            .filter_map(|r| r.3)
            .map(|b| b as f64 / 1e6)
            .collect();
        let streams: u64 = mine.iter().map(|r| r.2.streams).sum();
        let errors: u64 = mine.iter().map(|r| r.2.errors).sum();
        let merged: u64 = mine.iter().map(|r| r.2.merged).sum();
        let first_error = mine.iter().find_map(|r| r.2.first_error.clone());
        report.rows.push(vec![
            label.to_string(),
            format!("{streams}"),
            format!("{:.3}", med(&|r| r.ttft_ms(50.0))),
            format!("{:.3}", med(&|r| r.ttft_ms(99.0))),
            format!("{:.3}", med(&|r| r.ttft_ms(50.0)) - d50),
            format!("{:.3}", med(&|r| r.ttft_ms(99.0)) - d99),
            format!("{:.1}", med(&|r| r.chunks_per_stream())),
            format!("{:.1}", med(&|r| r.events_per_stream())),
            format!("{merged}"),
            if rss.is_empty() {
                "-".into()
            } else {
                format!("{:.1}", median(&rss))
            },
            match &first_error {
                Some(e) => format!("{errors}: {}", e.chars().take(80).collect::<String>()),
                None => format!("{errors}"),
            },
        ]);
        report.measured.push(Measured {
            contender: mine.first().map_or(Contender::SluiceOff, |r| r.1),
            requests: streams,
            errors,
            first_error,
        });
    }
    report.notes.push(format!(
        "{} streams open at a time for {:?} per client and round ({} rounds), {} tokens every {} ms, \
         starts spread over one stream's length; \
         a chunk is one read of the chunked HTTP/1.1 body or one HTTP/2 DATA frame. Sluice's \
         peak RSS (VmHWM, reset before each run) covers that run alone.",
        ctx.p.stream_concurrency,
        ctx.p.stream_duration,
        ctx.p.rounds,
        ctx.p.stream_tokens,
        ctx.p.stream_itl_ms
    ));
    drop(proc);
    drop(sim);
    Ok(report)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `load.concurrency` workers on one h2c connection, each running streams back to back until
/// `load.duration` has passed; every DATA frame is timestamped and its events counted.
async fn h2_run(addr: std::net::SocketAddr, body: &Bytes, load: &SseLoad) -> Result<SseResult> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .context("connecting")?;
    tcp.set_nodelay(true)?;
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(1 << 20)
        .initial_connection_window_size(16 << 20)
        .handshake::<_, Bytes>(tcp)
        .await
        .context("h2 handshake")?;
    let driver = tokio::spawn(connection);
    let start = Instant::now();
    let end = start + load.duration;
    let n = load.concurrency.max(1);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (send, body) = (send.clone(), body.clone());
        let delay = load.ramp.mul_f64(i as f64 / n as f64);
        let uri = format!("http://{addr}{CHAT}");
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut out = SseResult::empty()?;
            while Instant::now() < end {
                if let Err(e) = one_stream(&send, &uri, &body, &mut out).await {
                    out.errors += 1;
                    out.first_error.get_or_insert_with(|| format!("{e:#}"));
                }
            }
            anyhow::Ok(out)
        }));
    }
    let mut all = SseResult::empty()?;
    for t in tasks {
        all.merge(t.await.context("h2 worker")??);
    }
    driver.abort();
    Ok(all)
}

async fn one_stream(
    send: &h2::client::SendRequest<Bytes>,
    uri: &str,
    body: &Bytes,
    out: &mut SseResult,
) -> Result<()> {
    let mut send = send.clone().ready().await.context("h2 slot")?;
    let request = http::Request::post(uri)
        .header("content-type", "application/json")
        .body(())?;
    let sent = Instant::now();
    let (response, mut upload) = send.send_request(request, false)?;
    upload.send_data(body.clone(), true)?;
    let response = response.await.context("h2 response")?;
    if !response.status().is_success() {
        return Err(anyhow!("status {}", response.status()));
    }
    let mut data = response.into_body();
    let mut last: Option<Instant> = None;
    while let Some(frame) = data.data().await {
        let frame = frame.context("h2 DATA")?;
        let now = Instant::now();
        let _ = data.flow_control().release_capacity(frame.len());
        match last {
            None => record(&mut out.ttft, now - sent),
            Some(prev) => record(&mut out.gaps, now - prev),
        }
        last = Some(now);
        let events = frame
            .split(|&b| b == b'\n')
            .filter(|line| line.starts_with(b"data:"))
            .count() as u64;
        out.chunks += 1;
        out.events += events;
        out.merged += u64::from(events > 1);
    }
    out.streams += 1;
    Ok(())
}
