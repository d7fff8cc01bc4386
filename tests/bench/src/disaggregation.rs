//! Scenario 30 (issue #54, "Prefill and decode on separate pools"): long prompts with long
//! answers on four simulated engines run as vLLM 0.32 does by default (chunked prefill of 8,192
//! tokens a step, no `long_prefill_token_threshold`), where every step runs the decodes and the
//! prefill chunks together, so a long prefill stretches the inter-token latency of every
//! sequence its engine decodes. Two rows on the same four engines, at the same open-loop
//! arrivals: **aggregated** (one pool, every engine prefills and decodes), and
//! **disaggregated** (two engines prefill, two decode; `pools[].prefill` with vLLM's
//! `NixlConnector` wire, the transfer taking 5 µs a token). Reported: TTFT and inter-token
//! latency p50 / p99 side by side. A third row runs the split fleet while the prefill engines
//! answer transfer parameters for blocks they did not keep half the time (the decode engines,
//! under `kv_load_failure_policy: recompute`, compute the prompt again and answer 200): the
//! requests sent one at a time, how many it took Sluice to fall back, and the errors clients
//! saw.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{header, Method, Request};
use serde_json::json;
use tokio::sync::Mutex;

use crate::contenders::{free_addr, start_sluice_with, Contender};
use crate::phased::{checkout, Idle};
use crate::prefix_fleet::{pct, Fleet};
use crate::report::{Check, Noise, ScenarioReport};
use crate::resilience::labelled_sum;
use crate::scenarios::title;
use crate::Ctx;

const ID: u8 = 30;
const MODEL: &str = "long-model";
const REQUEST_LIMIT: Duration = Duration::from_secs(120);
const BYTES_PER_TOKEN: usize = 4;
const PROMPT_TOKENS: usize = 8_000;
const ANSWER_TOKENS: u32 = 200;

/// One engine: 40,000 prompt tokens a second, 15 ms a decode step; both legs of the wire.
fn engine(recompute: bool) -> vllm_sim::SimConfig {
    vllm_sim::SimConfig::default()
        .with_served_model_names(vec![MODEL.to_string()])
        .with_latency(vllm_sim::Latency {
            overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(25),
            inter_token: Duration::from_millis(15),
            jitter: 0.05,
        })
        .with_kv(65_536, 16)
        .with_max_model_len(32_768)
        .with_max_num_seqs(256)
        .with_answer_tokens(ANSWER_TOKENS, ANSWER_TOKENS)
        .with_record_requests(0)
        .v1_engine(8192)
        .with_kv_transfer(vllm_sim::KvTransferConfig {
            transfer_per_token: Duration::from_micros(5),
            load_failure_policy: if recompute {
                vllm_sim::LoadFailurePolicy::Recompute
            } else {
                vllm_sim::LoadFailurePolicy::Fail
            },
            ..vllm_sim::KvTransferConfig::default()
        })
}

/// A prompt of its own (no prefix shared with another request's).
fn prompt(i: usize) -> String {
    let mut text = String::with_capacity(PROMPT_TOKENS * BYTES_PER_TOKEN);
    let mut k = 0;
    while text.len() < PROMPT_TOKENS * BYTES_PER_TOKEN {
        text.push_str(&format!("r{i}.{k} "));
        k += 1;
    }
    text.truncate(PROMPT_TOKENS * BYTES_PER_TOKEN);
    text
}

/// One streamed request's timings.
#[derive(Default)]
struct Timed {
    ttft: Option<Duration>,
    /// Gaps between the answer's token events after the first.
    itl: Vec<Duration>,
    error: Option<String>,
}

async fn ask(addr: std::net::SocketAddr, idle: &Idle, i: usize) -> Timed {
    let mut timed = Timed::default();
    let sent = Instant::now();
    let work = async {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(i)}],
                          "max_tokens": ANSWER_TOKENS, "stream": true});
        let mut sender = checkout(idle, addr).await?;
        let req = Request::builder()
            .method(Method::POST)
            .uri("/v1/chat/completions")
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body)?)))?;
        let resp = sender.send_request(req).await.context("sending")?;
        let status = resp.status();
        let mut body = resp.into_body();
        let mut last: Option<Instant> = None;
        let mut all = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.context("reading")?.into_data() else {
                continue;
            };
            let now = Instant::now();
            let tokens = data.windows(9).filter(|w| w == b"\"content\"").count();
            if tokens > 0 {
                match last {
                    None => timed.ttft = Some(now.saturating_duration_since(sent)),
                    Some(previous) => timed.itl.push(now.saturating_duration_since(previous)),
                }
                // Events that came together: the gaps between them were nothing.
                timed
                    .itl
                    .extend(std::iter::repeat_n(Duration::ZERO, tokens - 1));
                last = Some(now);
            }
            all.extend_from_slice(&data);
        }
        idle.lock().await.push(sender);
        if !status.is_success() {
            anyhow::bail!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&all[..all.len().min(200)])
            );
        }
        if !all.windows(12).any(|w| w == b"data: [DONE]")
            || all.windows(9).any(|w| w == b"\"error\":")
        {
            anyhow::bail!("the stream did not end cleanly");
        }
        anyhow::Ok(())
    };
    match tokio::time::timeout(REQUEST_LIMIT, work).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => timed.error = Some(format!("{e:#}")),
        Err(_) => timed.error = Some(format!("no answer within {REQUEST_LIMIT:?}")),
    }
    timed
}

/// A Sluice over `fleet`: one pool of all four engines, or two prefilling for two decoding.
async fn sluice(ctx: &Ctx, fleet: &Fleet, split: bool, name: &str) -> Result<Running> {
    let (listen, admin) = (free_addr()?, free_addr()?);
    let dir = tempfile::tempdir_in(ctx.root.path())?;
    let list = |sims: &[vllm_sim::Sim]| -> String {
        sims.iter()
            .map(|s| format!("      - address: {}\n", s.addr()))
            .collect()
    };
    let pools = if split {
        format!(
            "pools:\n  - name: decode\n    models: [\"{MODEL}\"]\n    health: {{interval: 250ms}}\n    \
             prefill: {{pool: prefill, min_prefill_tokens: 1024}}\n    backends:\n{}\
             \x20 - name: prefill\n    models: [\"{MODEL}\"]\n    health: {{interval: 250ms}}\n    backends:\n{}",
            list(&fleet.sims[2..]),
            list(&fleet.sims[..2]),
        )
    } else {
        format!(
            "pools:\n  - name: all\n    models: [\"{MODEL}\"]\n    health: {{interval: 250ms}}\n    backends:\n{}",
            list(&fleet.sims),
        )
    };
    let yaml = format!(
        "# Generated by sluice-bench (scenario 30).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         log:\n  level: warn\n{pools}",
        pid = dir.path().join(format!("{name}.pid")).display(),
        sock = dir.path().join(format!("{name}.sock")).display(),
    );
    let proc = start_sluice_with(&ctx.sluice_bin, dir.path(), name, &yaml, &[listen, admin])
        .await
        .context("starting sluice")?;
    Ok(Running {
        _proc: proc,
        _dir: dir,
        listen,
        admin,
    })
}

/// A Sluice of a row, stopped (and its files removed) when dropped.
struct Running {
    _proc: crate::contenders::Proc,
    _dir: tempfile::TempDir,
    listen: std::net::SocketAddr,
    admin: std::net::SocketAddr,
}

/// Open-loop arrivals: one request every `every`, `count` of them.
async fn open_loop(addr: std::net::SocketAddr, count: usize, every: Duration) -> Vec<Timed> {
    let idle: Idle = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..count {
        let idle = Arc::clone(&idle);
        let at = start + every.mul_f64(i as f64);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            ask(addr, &idle, i).await
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        match task.await {
            Ok(timed) => out.push(timed),
            Err(e) => out.push(Timed {
                error: Some(e.to_string()),
                ..Timed::default()
            }),
        }
    }
    out
}

fn ms(values: impl Iterator<Item = Duration>) -> Vec<f64> {
    values.map(|d| d.as_secs_f64() * 1e3).collect()
}

struct Row {
    ttft: Vec<f64>,
    itl: Vec<f64>,
    errors: usize,
    requests: usize,
    first_error: Option<String>,
}

async fn row(ctx: &Ctx, split: bool) -> Result<Row> {
    let fleet = Fleet::of_configs((0..4).map(|_| engine(false)).collect())?;
    let name = if split { "pd-split" } else { "pd-aggregated" };
    let sluice = sluice(ctx, &fleet, split, name).await?;
    let timed = open_loop(sluice.listen, ctx.p.pd_requests, ctx.p.pd_every).await;
    let errors: Vec<&Timed> = timed.iter().filter(|t| t.error.is_some()).collect();
    Ok(Row {
        ttft: ms(timed.iter().filter_map(|t| t.ttft)),
        itl: ms(timed.iter().flat_map(|t| t.itl.iter().copied())),
        errors: errors.len(),
        requests: timed.len(),
        first_error: errors.first().and_then(|t| t.error.clone()),
    })
}

/// The split fleet with half the transfers lost: requests one at a time until the route
/// falls back (or `limit` are sent); how many it took, and the errors clients saw.
async fn lossy(ctx: &Ctx, limit: usize) -> Result<(Option<usize>, usize, usize)> {
    let configs = (0..4).map(|i| engine(i >= 2)).collect();
    let fleet = Fleet::of_configs(configs)?;
    for sim in &fleet.sims[..2] {
        sim.set_faults(vllm_sim::Faults {
            kv_transfer_lost: 0.5,
            ..vllm_sim::Faults::default()
        });
    }
    let sluice = sluice(ctx, &fleet, true, "pd-lossy").await?;
    let (listen, admin) = (sluice.listen, sluice.admin);
    let idle: Idle = Arc::new(Mutex::new(Vec::new()));
    let (mut fell_back_at, mut errors) = (None, 0);
    for i in 0..limit {
        if ask(listen, &idle, 10_000 + i).await.error.is_some() {
            errors += 1;
        }
        // The verdict is counted as the answer ends; give the log hook its moment.
        let page = crate::fleet::page_of(admin).await.unwrap_or_default();
        let disaggregated = labelled_sum(&page, "sluice_pd_route_disaggregated", "pool", "decode");
        if disaggregated == 0.0 && page.contains("sluice_pd_route_disaggregated") {
            fell_back_at = Some(i + 1);
            break;
        }
    }
    let sent = fell_back_at.unwrap_or(limit);
    // A few more after the fall-back: served whole, without errors.
    for i in 0..3 {
        if ask(listen, &idle, 20_000 + i).await.error.is_some() {
            errors += 1;
        }
    }
    Ok((fell_back_at, errors, sent + 3))
}

pub async fn disaggregation(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    report.header = [
        "contender",
        "TTFT p50 / p99 ms",
        "inter-token p50 / p99 ms",
        "requests",
        "errors",
    ]
    .map(String::from)
    .to_vec();
    let aggregated = row(ctx, false).await?;
    let split = row(ctx, true).await?;
    for (contender, r) in [
        (Contender::SluiceAggregated, &aggregated),
        (Contender::SluiceDisaggregated, &split),
    ] {
        report.rows.push(vec![
            contender.label().to_string(),
            format!("{:.0} / {:.0}", pct(&r.ttft, 0.5), pct(&r.ttft, 0.99)),
            format!("{:.1} / {:.1}", pct(&r.itl, 0.5), pct(&r.itl, 0.99)),
            r.requests.to_string(),
            r.errors.to_string(),
        ]);
        report.measured(
            contender,
            r.requests as u64,
            r.errors as u64,
            r.first_error.clone(),
        );
    }
    report.checks.push(Check::at_most(
        "inter-token latency p99, disaggregated over aggregated",
        pct(&split.itl, 0.99) / pct(&aggregated.itl, 0.99),
        1.0,
        "×",
        Noise::Tail,
    ));
    report.checks.push(Check::at_most(
        "TTFT p99, disaggregated over aggregated",
        pct(&split.ttft, 0.99) / pct(&aggregated.ttft, 0.99),
        1.1,
        "×",
        Noise::Tail,
    ));
    let (fell_back_at, errors, sent) = lossy(ctx, 30).await?;
    report.rows.push(vec![
        Contender::SluiceDisaggregatedLossy.label().to_string(),
        "-".into(),
        "-".into(),
        sent.to_string(),
        errors.to_string(),
    ]);
    report.measured(
        Contender::SluiceDisaggregatedLossy,
        sent as u64,
        errors as u64,
        None,
    );
    report.checks.push(Check::at_most(
        "half the transfers lost: requests until the route fell back",
        fell_back_at.map_or(f64::INFINITY, |n| n as f64),
        10.0,
        "",
        Noise::Exact,
    ));
    report.checks.push(Check::at_most(
        "half the transfers lost: client errors",
        errors as f64,
        0.0,
        "",
        Noise::Exact,
    ));
    report.notes.push(format!(
        "{} requests of {PROMPT_TOKENS} prompt tokens (each its own) and {ANSWER_TOKENS} \
         streamed answer tokens, one every {:?}, on fresh fleets of 4 simulators (40,000 \
         prompt tokens / s each, 15 ms a decode step, chunked prefill of 8,192 tokens a step \
         shared with the decodes). Disaggregated: 2 prefill + 2 decode engines, \
         min_prefill_tokens 1024, 5 µs a token of transfer. Inter-token latency is the gap \
         between a stream's token events as the client reads them. Lossy: the prefill engines \
         lose half their transfers at random; the requests go one at a time, fail_after 3 of \
         the last 10.",
        ctx.p.pd_requests, ctx.p.pd_every,
    ));
    Ok(report)
}
