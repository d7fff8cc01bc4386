//! The completion flow: faults, validation, admission to the engine, the latency model, and
//! rendering as one JSON answer or an SSE stream.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::config::ErrorShape;
use crate::engine::{Admission, Refusal, Ticket};
use crate::faults::Faults;
use crate::metrics::Ended;
use crate::openai::{self, ApiError, Kind, Parsed};
use crate::server::{self, Resp};
use crate::text::{self, ChoicePlan, Finish, PlanInput};
use crate::{unix_now, Shared};

const ENGINE_DEAD: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

fn injected_error(status: u16) -> ApiError {
    let msg = match status {
        429 => "Too Many Requests",
        503 => "Service Unavailable",
        500 => "Internal Server Error",
        _ => "Injected error",
    };
    ApiError::new(status, msg)
}

fn oom_error(need_blocks: u64, free_blocks: u64, block_size: u32) -> ApiError {
    // Rough bytes per block of a Llama-70B-like model (16 tokens * 320 KiB), for the message.
    let gib = |blocks: u64| blocks as f64 * f64::from(block_size) * 327_680.0 / (1u64 << 30) as f64;
    ApiError::new(
        500,
        format!(
            "CUDA out of memory. Tried to allocate {:.2} GiB. GPU 0 has a total capacity of 79.15 GiB of which {:.2} GiB is free. Of the allocated memory 76.02 GiB is allocated by PyTorch, and 1.13 GiB is reserved by PyTorch but unallocated.",
            gib(need_blocks),
            gib(free_blocks)
        ),
    )
}

fn context_error(
    shape: ErrorShape,
    max_len: u32,
    prompt: u32,
    max_tokens: Option<u32>,
) -> ApiError {
    let msg = match (shape, max_tokens) {
        (ErrorShape::New, Some(m)) if prompt < max_len => format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {max_len} tokens and your request has {prompt} input tokens ({m} > {max_len} - {prompt})."
        ),
        (ErrorShape::New, _) => format!(
            "This model's maximum context length is {max_len} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input messages."
        ),
        (ErrorShape::Old, Some(m)) => format!(
            "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({prompt} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
            u64::from(prompt) + u64::from(m)
        ),
        (ErrorShape::Old, None) => format!(
            "This model's maximum context length is {max_len} tokens. However, you requested {prompt} tokens in the messages, Please reduce the length of the messages."
        ),
    };
    ApiError::bad_request(msg)
}

pub fn models(shared: &Shared) -> Resp {
    #[derive(Serialize)]
    struct List<'a> {
        object: &'static str,
        data: Vec<Card<'a>>,
    }
    #[derive(Serialize)]
    struct Card<'a> {
        id: &'a str,
        object: &'static str,
        created: u64,
        owned_by: &'static str,
        root: &'a str,
        parent: Option<()>,
        max_model_len: u32,
        permission: [Perm; 1],
    }
    #[derive(Serialize)]
    struct Perm {
        id: String,
        object: &'static str,
        created: u64,
        allow_create_engine: bool,
        allow_sampling: bool,
        allow_logprobs: bool,
        allow_search_indices: bool,
        allow_view: bool,
        allow_fine_tuning: bool,
        organization: &'static str,
        group: Option<()>,
        is_blocking: bool,
    }
    let now = shared.started;
    let list = List {
        object: "list",
        data: shared
            .served
            .iter()
            .map(|name| Card {
                id: name,
                object: "model",
                created: now,
                owned_by: "vllm",
                root: &shared.cfg.model,
                parent: None,
                max_model_len: shared.cfg.max_model_len,
                permission: [Perm {
                    id: shared.next_id("modelperm-"),
                    object: "model_permission",
                    created: now,
                    allow_create_engine: false,
                    allow_sampling: true,
                    allow_logprobs: true,
                    allow_search_indices: false,
                    allow_view: true,
                    allow_fine_tuning: false,
                    organization: "*",
                    group: None,
                    is_blocking: false,
                }],
            })
            .collect(),
    };
    server::json(200, serde_json::to_vec(&list).unwrap_or_default())
}

/// Per-request timing and accounting; counts an abort if dropped before finishing.
struct Run {
    shared: Arc<Shared>,
    t0: Instant,
    last_token: Option<Instant>,
    generated: u64,
    finished: bool,
    slow: f64,
    jitter: f64,
    zero: bool,
}

impl Run {
    fn delay(&self, base: Duration) -> Duration {
        if self.zero || base.is_zero() {
            return Duration::ZERO;
        }
        let j = if self.jitter > 0.0 {
            1.0 + self.jitter * (2.0 * rand::random::<f64>() - 1.0)
        } else {
            1.0
        };
        // Capped so an absurd slowdown cannot overflow Duration (mul_f64 would panic).
        let factor = (self.slow * j).clamp(0.0, 1e6);
        Duration::try_from_secs_f64(base.as_secs_f64() * factor)
            .unwrap_or(Duration::from_secs(86_400))
    }

    fn ttft(&self, prompt_tokens: u32) -> Duration {
        let l = &self.shared.cfg.latency;
        let prefill = l
            .prefill_per_token
            .checked_mul(prompt_tokens)
            .unwrap_or(Duration::from_secs(86_400));
        self.delay(l.overhead.saturating_add(prefill))
    }

    fn itl(&self) -> Duration {
        self.delay(self.shared.cfg.latency.inter_token)
    }

    /// `k` tokens were produced in one engine step.
    fn step(&mut self, k: u64) {
        let now = Instant::now();
        let m = &self.shared.metrics;
        match self.last_token {
            None => m.ttft.observe((now - self.t0).as_secs_f64()),
            Some(prev) => m.itl.observe((now - prev).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.generated += k;
        m.generation_tokens.fetch_add(k, Ordering::Relaxed);
    }

    fn finish(&mut self, how: Finish) {
        let m = &self.shared.metrics;
        m.e2e.observe(self.t0.elapsed().as_secs_f64());
        m.ended(Ended::Finished(how), self.generated);
        self.shared.stats.completed.fetch_add(1, Ordering::Relaxed);
        self.finished = true;
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.metrics.ended(Ended::Abort, self.generated);
        }
    }
}

async fn sleep(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

pub async fn completion(shared: &Arc<Shared>, kind: Kind, body: Bytes) -> Resp {
    let t0 = Instant::now();
    let faults = shared.faults();
    let cfg = &shared.cfg;
    if faults.engine_dead {
        shared.stats.faults.fetch_add(1, Ordering::Relaxed);
        return server::error(shared, &ApiError::new(500, ENGINE_DEAD));
    }
    if faults.hang_before_headers {
        shared.stats.faults.fetch_add(1, Ordering::Relaxed);
        shared.shutdown_signal().await;
        return server::error(shared, &ApiError::new(503, "Service Unavailable"));
    }
    if faults.error_rate > 0.0 {
        let n = shared.fault_counter.fetch_add(1, Ordering::Relaxed);
        if faults.should_error(n) {
            shared.stats.faults.fetch_add(1, Ordering::Relaxed);
            return server::error(shared, &injected_error(faults.error_status));
        }
    }
    let p = match openai::parse(kind, &body, cfg.default_temperature) {
        Ok(p) => p,
        Err(e) => return server::error(shared, &e),
    };
    if let Some(m) = &p.model {
        if !shared.served.iter().any(|s| s == m) {
            return server::error(
                shared,
                &ApiError::new(404, format!("The model `{m}` does not exist.")),
            );
        }
    }
    let max_len = cfg.max_model_len;
    let too_long = match p.max_tokens {
        Some(m) => u64::from(p.prompt_tokens) + u64::from(m) > u64::from(max_len),
        None => p.prompt_tokens >= max_len,
    };
    if too_long {
        return server::error(
            shared,
            &context_error(cfg.error_shape, max_len, p.prompt_tokens, p.max_tokens),
        );
    }
    let max_tokens = p.max_tokens.unwrap_or(max_len - p.prompt_tokens);
    let sampling_hash = if p.temperature > 0.0 && p.seed.is_none() {
        // Unseeded sampling: a fresh draw each time.
        text::mix(p.sampling_hash ^ rand::random::<u64>())
    } else {
        p.sampling_hash
    };
    let input = PlanInput {
        prompt_hash: p.prompt_hash,
        sampling_hash,
        max_tokens,
        min_len: cfg.min_answer_tokens,
        max_len: cfg.max_answer_tokens,
        low_confidence: text::is_low_confidence(p.prompt_hash, cfg.low_confidence_share),
    };
    let plans: Vec<ChoicePlan> = (0..p.n).map(|i| text::plan_choice(&input, i)).collect();
    let answer_tokens: u64 = plans.iter().map(|c| c.tokens.len() as u64).sum();
    let admission = match shared
        .engine
        .admit(u64::from(p.prompt_tokens) + answer_tokens)
    {
        Ok(a) => a,
        Err(r) => return refusal(shared, r),
    };
    let run = Run {
        shared: Arc::clone(shared),
        t0,
        last_token: None,
        generated: 0,
        finished: false,
        slow: faults.slowdown_factor(),
        jitter: cfg.latency.jitter.clamp(0.0, 1.0),
        zero: cfg.latency.is_zero(),
    };
    let ctx = Ctx {
        id: shared.next_id(match kind {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }),
        model: shared.model_name().to_string(),
        created: unix_now(),
        p,
        plans,
    };
    if ctx.p.stream {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(stream_task(run, admission, ctx, faults, tx));
        server::stream_response(
            200,
            "text/event-stream; charset=utf-8",
            server::channel_body(rx),
        )
    } else {
        non_stream(run, admission, ctx, faults).await
    }
}

fn refusal(shared: &Shared, r: Refusal) -> Resp {
    match r {
        Refusal::Oom {
            need_blocks,
            free_blocks,
        } => {
            shared.metrics.oom.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(need_blocks, free_blocks, "simulated CUDA OOM");
            server::error(
                shared,
                &oom_error(need_blocks, free_blocks, shared.cfg.block_size),
            )
        }
        Refusal::QueueFull => server::error(
            shared,
            &ApiError::new(503, "Service Unavailable: the waiting queue is full."),
        ),
    }
}

fn refusal_error(shared: &Shared, r: Refusal) -> ApiError {
    match r {
        Refusal::Oom {
            need_blocks,
            free_blocks,
        } => {
            shared.metrics.oom.fetch_add(1, Ordering::Relaxed);
            oom_error(need_blocks, free_blocks, shared.cfg.block_size)
        }
        Refusal::QueueFull => ApiError::new(503, "Service Unavailable"),
    }
}

struct Ctx {
    id: String,
    model: String,
    created: u64,
    p: Parsed,
    plans: Vec<ChoicePlan>,
}

impl Ctx {
    fn steps(&self) -> usize {
        self.plans.iter().map(|c| c.tokens.len()).max().unwrap_or(0)
    }
    fn tokens_at(&self, step: usize) -> u64 {
        self.plans.iter().filter(|c| c.tokens.len() > step).count() as u64
    }
    fn completion_tokens(&self) -> u32 {
        self.plans.iter().map(|c| c.tokens.len() as u32).sum()
    }
}

async fn non_stream(mut run: Run, admission: Admission, ctx: Ctx, faults: Arc<Faults>) -> Resp {
    let shared = Arc::clone(&run.shared);
    let mut ticket = match admission {
        Admission::Running(t) => t,
        Admission::Queued(p) => match p.wait().await {
            Ok(t) => t,
            Err(r) => return refusal(&shared, r),
        },
    };
    let prompt = u64::from(ctx.p.prompt_tokens);
    ticket.set_tokens(prompt);
    shared
        .metrics
        .prompt_tokens
        .fetch_add(prompt, Ordering::Relaxed);
    sleep(run.ttft(ctx.p.prompt_tokens)).await;
    let steps = ctx.steps();
    if run.zero {
        let all = u64::from(ctx.completion_tokens());
        run.step(all);
        ticket.set_tokens(prompt + all);
    } else {
        let mut held = prompt;
        for s in 0..steps {
            if s > 0 {
                sleep(run.itl()).await;
            }
            let k = ctx.tokens_at(s);
            run.step(k);
            held += k;
            ticket.set_tokens(held);
        }
    }
    let body = render_full(&ctx);
    let finish = ctx.plans.first().map(|c| c.finish).unwrap_or(Finish::Stop);
    run.finish(finish);
    drop(ticket);
    if faults.affects_streams() {
        return truncated(&shared, body, &faults);
    }
    server::json(200, body)
}

/// A non-stream answer hit by a mid-body fault: headers promise the full length, half arrives.
fn truncated(shared: &Arc<Shared>, body: Vec<u8>, faults: &Faults) -> Resp {
    shared.stats.faults.fetch_add(1, Ordering::Relaxed);
    let len = body.len();
    let half = Bytes::from(body).slice(..len / 2);
    let (tx, rx) = mpsc::channel(2);
    let hang = faults.hang_after_chunks.is_some();
    let s = Arc::clone(shared);
    tokio::spawn(async move {
        let _ = tx.send(Ok(half)).await;
        if hang {
            tokio::select! {
                _ = tx.closed() => {}
                _ = s.shutdown_signal() => {}
            }
        } else {
            s.stats.errors.fetch_add(1, Ordering::Relaxed);
            flush_then_abort(&tx, "sim: connection dropped mid-body").await;
        }
    });
    server::with_content_length(
        server::stream_response(200, "application/json", server::channel_body(rx)),
        len,
    )
}

fn render_full(ctx: &Ctx) -> Vec<u8> {
    let model = ctx.model.as_str();
    let completion_tokens = ctx.completion_tokens();
    let usage = openai::Usage {
        prompt_tokens: ctx.p.prompt_tokens,
        total_tokens: ctx.p.prompt_tokens + completion_tokens,
        completion_tokens,
        prompt_tokens_details: None,
    };
    let res = match ctx.p.kind {
        Kind::Chat => serde_json::to_vec(&openai::ChatCompletion {
            id: &ctx.id,
            object: "chat.completion",
            created: ctx.created,
            model,
            choices: ctx
                .plans
                .iter()
                .enumerate()
                .map(|(i, c)| openai::ChatChoice {
                    index: i as u32,
                    message: openai::ChatMessage {
                        role: "assistant",
                        content: c.text(),
                        refusal: None,
                        annotations: None,
                        audio: None,
                        function_call: None,
                        tool_calls: [],
                        reasoning_content: None,
                    },
                    logprobs: ctx.p.logprobs.then(|| openai::ChatLogprobs {
                        content: c
                            .tokens
                            .iter()
                            .zip(&c.logprobs)
                            .map(|(t, lp)| openai::chat_logprob(*t, *lp, ctx.p.top_logprobs))
                            .collect(),
                    }),
                    finish_reason: c.finish.as_str(),
                    stop_reason: None,
                })
                .collect(),
            service_tier: None,
            system_fingerprint: None,
            usage,
            prompt_logprobs: None,
            kv_transfer_params: None,
        }),
        Kind::Completion => serde_json::to_vec(&openai::TextCompletion {
            id: &ctx.id,
            object: "text_completion",
            created: ctx.created,
            model,
            choices: ctx
                .plans
                .iter()
                .enumerate()
                .map(|(i, c)| openai::TextChoice {
                    index: i as u32,
                    text: c.text(),
                    logprobs: ctx.p.logprobs.then(|| {
                        let mut l = openai::TextLogprobs::default();
                        let mut off = 0u32;
                        for (t, lp) in c.tokens.iter().zip(&c.logprobs) {
                            l.push(off, *t, *lp, ctx.p.top_logprobs);
                            off += text::token_str(*t).len() as u32;
                        }
                        l
                    }),
                    finish_reason: c.finish.as_str(),
                    stop_reason: None,
                    prompt_logprobs: None,
                })
                .collect(),
            service_tier: None,
            system_fingerprint: None,
            usage,
            kv_transfer_params: None,
        }),
    };
    res.unwrap_or_default()
}

/// Abort the connection after what was sent so far reached the socket: hyper discards its
/// write buffer on a body error, so wait until the channel is drained and the chunks flushed.
async fn flush_then_abort(tx: &mpsc::Sender<Result<Bytes, io::Error>>, why: &'static str) {
    for _ in 0..200 {
        if tx.capacity() == tx.max_capacity() || tx.is_closed() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _ = tx
        .send(Err(io::Error::new(io::ErrorKind::ConnectionAborted, why)))
        .await;
}

/// Sends SSE events, applying the mid-stream faults.
struct Emitter {
    shared: Arc<Shared>,
    tx: mpsc::Sender<Result<Bytes, io::Error>>,
    faults: Arc<Faults>,
    sent: u32,
}

enum Flow {
    Go,
    Stop,
}

impl Emitter {
    async fn emit(&mut self, b: Bytes) -> Flow {
        let f = Arc::clone(&self.faults);
        if f.hang_after_chunks.is_some_and(|k| self.sent >= k) {
            self.shared.stats.faults.fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = self.tx.closed() => {}
                _ = self.shared.shutdown_signal() => {}
            }
            return Flow::Stop;
        }
        if f.drop_after_chunks.is_some_and(|k| self.sent >= k) {
            self.shared.stats.faults.fetch_add(1, Ordering::Relaxed);
            self.shared.stats.errors.fetch_add(1, Ordering::Relaxed);
            flush_then_abort(&self.tx, "sim: connection dropped mid-stream").await;
            return Flow::Stop;
        }
        if f.error_after_chunks.is_some_and(|k| self.sent >= k) {
            self.shared.stats.faults.fetch_add(1, Ordering::Relaxed);
            self.error(&ApiError::new(500, "Internal Server Error"))
                .await;
            return Flow::Stop;
        }
        if self.tx.send(Ok(b)).await.is_err() {
            return Flow::Stop;
        }
        self.sent += 1;
        Flow::Go
    }

    async fn error(&mut self, e: &ApiError) {
        self.shared.stats.errors.fetch_add(1, Ordering::Relaxed);
        let ev = openai::stream_error_event(self.shared.cfg.error_shape, e);
        if self.tx.send(Ok(Bytes::from(ev))).await.is_ok() {
            let _ = self.tx.send(Ok(Bytes::from_static(openai::DONE))).await;
        }
    }

    /// Sleep, but stop early if the client went away.
    async fn sleep(&self, d: Duration) -> Flow {
        if d.is_zero() {
            return Flow::Go;
        }
        tokio::select! {
            _ = tokio::time::sleep(d) => Flow::Go,
            _ = self.tx.closed() => Flow::Stop,
        }
    }
}

async fn stream_task(
    mut run: Run,
    admission: Admission,
    ctx: Ctx,
    faults: Arc<Faults>,
    tx: mpsc::Sender<Result<Bytes, io::Error>>,
) {
    let shared = Arc::clone(&run.shared);
    let mut em = Emitter {
        shared: Arc::clone(&shared),
        tx,
        faults,
        sent: 0,
    };
    let mut ticket: Ticket = match admission {
        Admission::Running(t) => t,
        Admission::Queued(p) => {
            let res = tokio::select! {
                r = p.wait() => Some(r),
                _ = em.tx.closed() => None,
            };
            match res {
                Some(Ok(t)) => t,
                Some(Err(r)) => {
                    let e = refusal_error(&shared, r);
                    em.error(&e).await;
                    return;
                }
                None => return,
            }
        }
    };
    let prompt = u64::from(ctx.p.prompt_tokens);
    ticket.set_tokens(prompt);
    shared
        .metrics
        .prompt_tokens
        .fetch_add(prompt, Ordering::Relaxed);
    if let Flow::Stop = em.sleep(run.ttft(ctx.p.prompt_tokens)).await {
        return;
    }
    let model = ctx.model.as_str();
    let chat = ctx.p.kind == Kind::Chat;
    let mut offsets = vec![0u32; ctx.plans.len()];
    let mut held = prompt;
    for step in 0..ctx.steps() {
        if step > 0 {
            if let Flow::Stop = em.sleep(run.itl()).await {
                return;
            }
        }
        let k = ctx.tokens_at(step);
        run.step(k);
        held += k;
        ticket.set_tokens(held);
        if step == 0 && chat {
            for i in 0..ctx.plans.len() {
                let ev = openai::sse(&openai::ChatChunk {
                    id: &ctx.id,
                    object: "chat.completion.chunk",
                    created: ctx.created,
                    model,
                    choices: [openai::ChunkChoice {
                        index: i as u32,
                        delta: openai::Delta {
                            role: Some("assistant"),
                            content: "",
                        },
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                    }],
                });
                if let Flow::Stop = em.emit(ev).await {
                    return;
                }
            }
        }
        for (i, c) in ctx.plans.iter().enumerate() {
            let (Some(&tok), Some(&lp)) = (c.tokens.get(step), c.logprobs.get(step)) else {
                continue;
            };
            let last = step + 1 == c.tokens.len();
            let t = text::token_str(tok);
            let ev = if chat {
                openai::sse(&openai::ChatChunk {
                    id: &ctx.id,
                    object: "chat.completion.chunk",
                    created: ctx.created,
                    model,
                    choices: [openai::ChunkChoice {
                        index: i as u32,
                        delta: openai::Delta {
                            role: None,
                            content: t,
                        },
                        logprobs: ctx.p.logprobs.then(|| openai::ChatLogprobs {
                            content: vec![openai::chat_logprob(tok, lp, ctx.p.top_logprobs)],
                        }),
                        finish_reason: None,
                        stop_reason: None,
                    }],
                })
            } else {
                let off = offsets.get(i).copied().unwrap_or(0);
                if let Some(o) = offsets.get_mut(i) {
                    *o += t.len() as u32;
                }
                openai::sse(&openai::TextChunk {
                    id: &ctx.id,
                    object: "text_completion",
                    created: ctx.created,
                    model,
                    choices: [openai::TextChunkChoice {
                        index: i as u32,
                        text: t,
                        logprobs: ctx.p.logprobs.then(|| {
                            let mut l = openai::TextLogprobs::default();
                            l.push(off, tok, lp, ctx.p.top_logprobs);
                            l
                        }),
                        // Completions carry the finish reason on the last token's chunk.
                        finish_reason: last.then(|| c.finish.as_str()),
                        stop_reason: None,
                    }],
                    usage: None,
                })
            };
            if let Flow::Stop = em.emit(ev).await {
                return;
            }
            if last && chat {
                let ev = openai::sse(&openai::ChatChunk {
                    id: &ctx.id,
                    object: "chat.completion.chunk",
                    created: ctx.created,
                    model,
                    choices: [openai::ChunkChoice {
                        index: i as u32,
                        delta: openai::Delta {
                            role: None,
                            content: "",
                        },
                        logprobs: None,
                        finish_reason: Some(c.finish.as_str()),
                        stop_reason: Some(None),
                    }],
                });
                if let Flow::Stop = em.emit(ev).await {
                    return;
                }
            }
        }
    }
    let finish = ctx.plans.first().map(|c| c.finish).unwrap_or(Finish::Stop);
    run.finish(finish);
    drop(ticket);
    if ctx.p.include_usage {
        let completion_tokens = ctx.completion_tokens();
        let ev = openai::sse(&openai::UsageChunk {
            id: &ctx.id,
            object: if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            },
            created: ctx.created,
            model,
            choices: [],
            usage: openai::StreamUsage {
                prompt_tokens: ctx.p.prompt_tokens,
                total_tokens: ctx.p.prompt_tokens + completion_tokens,
                completion_tokens,
            },
        });
        if let Flow::Stop = em.emit(ev).await {
            return;
        }
    }
    let _ = em.emit(Bytes::from_static(openai::DONE)).await;
}
