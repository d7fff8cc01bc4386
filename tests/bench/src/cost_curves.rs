//! Scenario 32 (issue #56, "where each feature's cost goes, per request and as work grows"):
//! Sluice's CPU time per request against the prompt's size, for plugins off, each feature
//! alone (the cache missing, tenants, the exact prefix index with text it has never seen and
//! with text it has, traces at sampling 1.0) and every one of them on together.
//!
//! - **Upstream**: one simulator (in this process, on a runtime of its own) answering 4
//!   tokens at no latency, with the pool's tokenizer and KV events, so the exact index
//!   follows it as it follows vLLM.
//! - **Requests**: chat requests of a system prompt of plain words of the size measured, and
//!   a short user question; one at a time on one kept connection, so nothing but the request
//!   itself is measured (no queueing, no contention between requests).
//!   - Every request differs from every other at its system prompt's start (a number), so
//!     the cache misses and the tokenizer sees the long text for the first time...
//!   - ...except for "text seen before": the system prompt is the same for every request of a
//!     size, its question a number of its own. The tokenizer splits a rendered chat at its
//!     special tokens and keeps the long pieces it made, so only the question is new.
//! - **Measured**: the CPU time of Sluice's threads (schedstat, ns) over the requests ÷ the
//!   requests. The sizes and the contenders are interleaved within each round (a size's
//!   contenders one after the other, the rounds one after the other), so a slow minute
//!   weighs on every contender alike; each cell is the median of the rounds with their range.
//!   Before each measured batch, one request of its kind is sent unmeasured (a "seen" text is
//!   then seen, connections are open). Every Sluice with the exact index follows the same
//!   engine's events, whoever's requests caused them, and applies them after the answers: so
//!   each batch starts with every index idle (then its unmeasured request), and a batch with
//!   the index ends when its Sluice is idle again. Its CPU counts the events its own requests
//!   caused (a real cost of the index) and none of another contender's (but the unmeasured
//!   request's, being taken by the others meanwhile); an idle Sluice's background work in the
//!   50 ms that tell it is idle counts too, a few µs a request.
//! - **The curve**: a least-squares line through each contender's medians: its slope (µs of
//!   CPU per KiB of prompt) and its value at 0 KiB (what a request costs whatever its size).
//!   The line is fitted to the sizes measured; its slope is what a larger prompt adds.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION};
use serde_json::{json, Value};

use crate::contenders::{
    free_addr, hash_key, start_sluice_with, tenants_section, tree_usage, Contender, Proc, MODEL,
    TENANT_KEY,
};
use crate::loadgen::{fetch, send_one, Target};
use crate::prefix_fleet::{subscribers_live, tokenizer_dir, Fleet};
use crate::report::{ScenarioReport, Series, Table};
use crate::scenarios::{title, CHAT};
use crate::Ctx;

const ID: u8 = 32;

/// The contenders, in the order each size runs them.
const CONTENDERS: [Contender; 7] = [
    Contender::SluiceOff,
    Contender::SluiceOnlyCache,
    Contender::SluiceTenantsLocal,
    Contender::SluiceIndexNewText,
    Contender::SluiceIndexSeenText,
    Contender::SluiceTracedOnly,
    Contender::SluiceEveryFeature,
];

/// What a contender's Sluice has on.
#[derive(Clone, Copy, Default)]
struct Features {
    cache: bool,
    tenants: bool,
    index: bool,
    traces: bool,
}

fn features(c: Contender) -> Features {
    let none = Features::default();
    match c {
        Contender::SluiceOnlyCache => Features {
            cache: true,
            ..none
        },
        Contender::SluiceTenantsLocal => Features {
            tenants: true,
            ..none
        },
        Contender::SluiceIndexNewText | Contender::SluiceIndexSeenText => Features {
            index: true,
            ..none
        },
        Contender::SluiceTracedOnly => Features {
            traces: true,
            ..none
        },
        Contender::SluiceEveryFeature => Features {
            cache: true,
            tenants: true,
            index: true,
            traces: true,
        },
        _ => none,
    }
}

/// One Sluice of the scenario.
struct Running {
    contender: Contender,
    addr: SocketAddr,
    admin: SocketAddr,
    proc: Proc,
    /// The traced contenders' OTLP receiver (kept alive while Sluice sends to it).
    _receiver: Option<sluice_testkit::OtlpReceiver>,
}

/// The YAML of the Sluice of `features` in front of `upstream`.
fn yaml(
    dir: &Path,
    name: &str,
    (listen, admin): (SocketAddr, SocketAddr),
    upstream: SocketAddr,
    f: Features,
    tenant_digest: &str,
    otlp: Option<SocketAddr>,
) -> String {
    let index = if f.index {
        format!(
            "    balancing: {{strategy: ttft}}\n    tokenizer: {}\n    kv_events: auto\n",
            tokenizer_dir().display()
        )
    } else {
        String::new()
    };
    let telemetry = otlp
        .map(|addr| {
            format!(
                "telemetry:\n  otlp: {{endpoint: \"http://{addr}\", protocol: http/protobuf}}\n  \
                 sampling: 1.0\n"
            )
        })
        .unwrap_or_default();
    let tenants = if f.tenants {
        tenants_section(tenant_digest, None)
    } else {
        String::new()
    };
    let cache = if f.cache {
        "  cache:\n    enabled: true\n    store: memory\n    tenant: {anonymous: share}\n"
    } else {
        "  cache:\n    enabled: false\n"
    };
    // Health checks every 5 s: their CPU would otherwise weigh on the small prompts' figures
    // (each check is tens of µs; scenario 7 measures them).
    format!(
        "# Generated by sluice-bench (scenario {ID}).\n\
         pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
         grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
         listeners:\n  - address: {listen}\n\
         admin:\n  address: {admin}\n\
         limits:\n  max_request_body_bytes: 8388608\n\
         log:\n  level: warn\n  access_log: true\n\
         pools:\n  - name: sim\n    models: [\"{MODEL}\"]\n    \
         health: {{interval: 5s, timeout: 2s, stale_after: 15s}}\n{index}    backends:\n      - address: {upstream}\n\
         {telemetry}plugins:\n  request_id:\n    enabled: {all}\n{cache}  speculative:\n    \
         enabled: false\n  kv_breaker:\n    enabled: {all}\n{tenants}",
        pid = dir.join(format!("{name}.pid")).display(),
        sock = dir.join(format!("{name}.sock")).display(),
        all = f.cache && f.tenants && f.index && f.traces,
    )
}

/// The simulator: 4 tokens at no latency, the prompts' sizes within its context, the pool's
/// tokenizer and KV events.
fn upstream(max_bytes: usize) -> vllm_sim::SimConfig {
    // Plain words cut to about one token per 4 bytes; twice that, for the margin.
    let context = u32::try_from(max_bytes / 2).unwrap_or(u32::MAX).max(32_768);
    vllm_sim::SimConfig::default()
        .with_served_model_names(vec![MODEL.to_string()])
        .with_max_model_len(context)
        .with_kv(context / 16 * 4, 16)
        .with_answer_tokens(4, 4)
        .with_record_requests(0)
        .with_tokenizer(tokenizer_dir())
        .v1_engine(8192)
        .with_kv_events(vllm_sim::KvEventsConfig::default())
}

/// A system prompt of plain words, `bytes` long.
fn words(bytes: usize) -> String {
    "the quick brown fox jumps over the lazy dog "
        .chars()
        .cycle()
        .take(bytes)
        .collect()
}

/// The request of `contender` at `bytes`: each different at its system prompt's start, or
/// (text seen before) at its question's.
fn target(r: &Running, bytes: usize, auth: &HeaderValue) -> Target {
    let body = Bytes::from(
        json!({
            "model": MODEL,
            "messages": [
                {"role": "system", "content": words(bytes)},
                {"role": "user", "content": "Question: what comes next?"},
            ],
            "max_tokens": 4,
        })
        .to_string(),
    );
    let target = Target::post_json(r.addr, CHAT, body);
    let target = if r.contender == Contender::SluiceIndexSeenText {
        target.varied_after(b"\"content\":\"Question", b":")
    } else {
        target.varied()
    };
    if features(r.contender).tenants {
        target.with_header(AUTHORIZATION, auth.clone())
    } else {
        target
    }
}

/// 32. CPU per request against the prompt's size, per feature.
pub async fn cost_curves(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    let p = ctx.p.clone();
    let max_bytes = p.curve_sizes.iter().copied().max().unwrap_or(1024);
    let fleet = Fleet::of_configs(vec![upstream(max_bytes)])?;
    let sim = fleet
        .sims
        .first()
        .map(vllm_sim::Sim::addr)
        .context("the simulator")?;
    let dir = tempfile::Builder::new()
        .prefix("curves.")
        .tempdir_in(ctx.root.path())
        .context("the scenario's directory")?;
    let digest = hash_key(&ctx.sluice_bin, TENANT_KEY)?;
    let auth = HeaderValue::from_str(&format!("Bearer {TENANT_KEY}"))
        .context("the Authorization header")?;
    let mut running = Vec::new();
    for contender in CONTENDERS {
        let f = features(contender);
        let receiver = if f.traces {
            Some(sluice_testkit::OtlpReceiver::http().await)
        } else {
            None
        };
        let name = format!("curve-{}", running.len());
        let (listen, admin) = (free_addr()?, free_addr()?);
        let text = yaml(
            dir.path(),
            &name,
            (listen, admin),
            sim,
            f,
            &digest,
            receiver.as_ref().map(|r| r.addr),
        );
        let proc =
            start_sluice_with(&ctx.sluice_bin, dir.path(), &name, &text, &[listen, admin]).await?;
        if f.index {
            subscribers_live(admin, &fleet).await?;
        }
        running.push(Running {
            contender,
            addr: listen,
            admin,
            proc,
            _receiver: receiver,
        });
    }

    // Every Sluice with the index follows the one engine's events, whoever's requests made
    // them: each cell starts and ends with every index caught up, so that a cell's CPU holds
    // the events of its own requests and no others'.
    let indexes: Vec<u32> = running
        .iter()
        .filter(|r| features(r.contender).index)
        .filter_map(|r| r.proc.pid())
        .collect();
    // (contender, size) → CPU µs per request, one per round.
    let mut cpu: BTreeMap<(Contender, usize), Series> = BTreeMap::new();
    for _ in 0..p.rounds {
        for &bytes in &p.curve_sizes {
            for r in &running {
                let target = target(r, bytes, &auth);
                let pid = r.proc.pid().context("Sluice's pid")?;
                // The last cell's events taken by every index first; then the measured
                // Sluice is not left idle before its batch: with a wait for its own idleness
                // first, a 1 KiB request with plugins off measured 1,183 µs where back to
                // back it measured 238 (likely the allocator handing its pages back while
                // idle, and the batch faulting them in again; not profiled).
                idle(&indexes).await?;
                let mut conn = None;
                // Unmeasured: opens the connection, and makes a "seen" text seen.
                send_one(&mut conn, &target).await.with_context(|| {
                    format!("{} at {bytes} bytes: {}", r.contender, r.proc.log_tail())
                })?;
                let before = tree_usage(pid)?.cpu;
                let mut errors = 0u64;
                let mut first_error = None;
                for _ in 0..p.curve_requests {
                    if let Err(e) = send_one(&mut conn, &target).await {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
                // Its own events in, before the reading; the others' wait for the next cell.
                if features(r.contender).index {
                    idle(&[pid]).await?;
                }
                let spent = tree_usage(pid)?.cpu.saturating_sub(before);
                let done = p.curve_requests as u64 - errors;
                report.measured(r.contender, done, errors, first_error);
                cpu.entry((r.contender, bytes))
                    .or_default()
                    .push(spent.as_secs_f64() * 1e6 / p.curve_requests.max(1) as f64);
            }
        }
    }

    let kib = |bytes: usize| bytes as f64 / 1024.0;
    report.header = std::iter::once("contender".to_string())
        .chain(
            p.curve_sizes
                .iter()
                .map(|&b| format!("{} KiB: CPU µs/req", kib(b))),
        )
        .chain([
            "µs per KiB (fit)".to_string(),
            "µs at 0 KiB (fit)".to_string(),
        ])
        .collect();
    let mut fits = BTreeMap::new();
    for &c in &CONTENDERS {
        let points: Vec<(f64, f64)> = p
            .curve_sizes
            .iter()
            .map(|&b| (kib(b), cpu.get(&(c, b)).map_or(f64::NAN, Series::median)))
            .collect();
        let (slope, at_zero) = least_squares(&points);
        fits.insert(c, (slope, at_zero));
        let mut row = vec![c.label().to_string()];
        row.extend(
            p.curve_sizes
                .iter()
                .map(|&b| cpu.get(&(c, b)).map_or("–".into(), |s| s.show(0))),
        );
        row.push(format!("{slope:.2}"));
        row.push(format!("{at_zero:.0}"));
        report.rows.push(row);
    }
    let off = fits
        .get(&Contender::SluiceOff)
        .copied()
        .unwrap_or((f64::NAN, f64::NAN));
    report.tables.push(Table {
        caption: "Each feature over plugins off (the fits' differences):".into(),
        header: [
            "feature",
            "µs per KiB it adds",
            "µs per request it adds at 0 KiB",
        ]
        .map(String::from)
        .to_vec(),
        rows: fits
            .iter()
            .filter(|(c, _)| **c != Contender::SluiceOff)
            .map(|(c, (slope, at_zero))| {
                vec![
                    c.label().to_string(),
                    format!("{:.2}", slope - off.0),
                    format!("{:.0}", at_zero - off.1),
                ]
            })
            .collect(),
    });
    // The index's own account: how many prompts it could not read, found too long or passed
    // over (a prompt it skipped would make its curve look cheaper than tokenizing is).
    for r in running.iter().filter(|r| features(r.contender).index) {
        let (_, _, body) = fetch(&Target::get(r.admin, "/status")).await?;
        let status: Value = serde_json::from_slice(&body).context("/status")?;
        let index = &status["pools"][0]["prefix_index"];
        let count = |name: &str| index[name].as_u64().unwrap_or(0);
        report.notes.push(format!(
            "{}: prompts the index could not read {}, found too long {}, passed over {} \
             (tokens looked up: {}).",
            r.contender.label(),
            count("unreadable_prompts"),
            count("too_long_prompts"),
            count("passed_over_prompts"),
            count("looked_up_tokens"),
        ));
    }
    report.notes.push(format!(
        "{} rounds; per size and contender, {} requests one at a time on one connection after \
         one unmeasured. Chat requests: a system prompt of plain words of the size shown, a \
         short question, 4 tokens answered at no latency by one simulator (in the harness's \
         process, with the pool's tokenizer and KV events). CPU: Sluice's threads' run time \
         (schedstat) over the requests ÷ the requests; median of the rounds (range). \
         \"Every feature\": the cache (missing), tenants, the exact index (new text), traces at \
         1.0, request ids and the KV breaker.",
        p.rounds, p.curve_requests
    ));
    Ok(report)
}

/// Waits until every process of `pids` is idle: under 1 ms of CPU in 50 ms. A Sluice with
/// the exact index applies the engine's events after the answers that caused them; read from
/// its own CPU, not asked of its admin (a metrics page would be work counted in the cell).
async fn idle(pids: &[u32]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for &pid in pids {
        loop {
            let before = tree_usage(pid)?.cpu;
            tokio::time::sleep(Duration::from_millis(50)).await;
            if tree_usage(pid)?.cpu.saturating_sub(before) < Duration::from_millis(1) {
                break;
            }
            if Instant::now() > deadline {
                bail!("Sluice (pid {pid}) was still busy after 60 s");
            }
        }
    }
    Ok(())
}

/// The least-squares line through `points` (x, y): its slope and its value at x = 0. NaN when
/// fewer than two points are finite.
fn least_squares(points: &[(f64, f64)]) -> (f64, f64) {
    let finite: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let n = finite.len() as f64;
    if finite.len() < 2 {
        return (f64::NAN, f64::NAN);
    }
    let mean_x = finite.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = finite.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = finite.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = finite.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    if sxx == 0.0 {
        return (f64::NAN, f64::NAN);
    }
    let slope = sxy / sxx;
    (slope, mean_y - slope * mean_x)
}

#[cfg(test)]
mod tests {
    use super::least_squares;

    #[test]
    fn a_line_is_fitted_exactly() {
        let (slope, at_zero) = least_squares(&[(1.0, 12.0), (2.0, 14.0), (4.0, 18.0)]);
        assert!((slope - 2.0).abs() < 1e-9);
        assert!((at_zero - 10.0).abs() < 1e-9);
        assert!(least_squares(&[(1.0, 1.0)]).0.is_nan());
    }
}
