//! One admitted request's generation: when its tokens are due (the latency model) and what it
//! reports (metrics and stats).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::answer::Answer;
use crate::faults::Faults;
use crate::kv_transfer::{LoadFailurePolicy, TransferAsk};
use crate::metrics::{Ended, FinishedRequest};
use crate::openai::ApiError;
use crate::text::Finish;
use crate::Shared;

/// Stands in for "forever" where a delay would overflow `Duration`.
const A_DAY: Duration = Duration::from_secs(86_400);

/// Per-request timing and accounting; counts an abort if dropped before finishing.
pub struct Generation {
    shared: Arc<Shared>,
    started: Instant,
    /// When the request got its place in the batch (it waited in the queue until then).
    admitted: Option<Instant>,
    /// When a chunked-prefill step first scheduled its prompt: until then it was queued, as
    /// vLLM V1 counts it.
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    generated: u64,
    /// Engine steps that produced tokens.
    steps: u64,
    /// Times the request was preempted (a shared reference counts them, hence atomic).
    preemptions: AtomicU32,
    prompt_tokens: u32,
    choices: u32,
    max_tokens: u32,
    finished: bool,
    /// Prefix-cache blocks kept for this request while it runs (see `prefix_cache.rs`).
    pinned_blocks: usize,
    /// Of the prompt, the tokens the prefix cache served.
    cached_tokens: u32,
    /// Its LoRA adapter was not in a GPU slot: it is loaded before the prefill.
    loads_adapter: bool,
    slowdown: f64,
    jitter: f64,
    zero_latency: bool,
}

impl Generation {
    pub fn new(shared: Arc<Shared>, started: Instant, faults: &Faults, answer: &Answer) -> Self {
        let latency = &shared.config.latency;
        Generation {
            slowdown: faults.slowdown_factor(),
            jitter: latency.jitter.clamp(0.0, 1.0),
            zero_latency: latency.is_zero(),
            shared,
            started,
            admitted: None,
            scheduled: None,
            first_token: None,
            last_token: None,
            generated: 0,
            steps: 0,
            preemptions: AtomicU32::new(0),
            prompt_tokens: answer.prompt_tokens(),
            choices: answer.request.choice_count,
            max_tokens: answer.max_tokens,
            finished: false,
            pinned_blocks: 0,
            cached_tokens: 0,
            loads_adapter: false,
        }
    }

    /// The request got its place in the batch (`ticket`).
    pub fn admitted(&mut self, ticket: &crate::engine::Ticket) {
        self.admitted.get_or_insert_with(Instant::now);
        self.loads_adapter = ticket.loaded_adapter();
    }

    /// The request was preempted once more.
    pub fn preempted(&self) {
        self.preemptions.fetch_add(1, Ordering::Relaxed);
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Zero-latency mode never sleeps (and the non-stream path skips the per-token loop).
    pub fn is_zero_latency(&self) -> bool {
        self.zero_latency
    }

    /// `base` scaled by the jitter draw and the fault slowdown.
    fn delay(&self, base: Duration) -> Duration {
        if self.zero_latency || base.is_zero() {
            return Duration::ZERO;
        }
        let jitter_factor = if self.jitter > 0.0 {
            1.0 + self.jitter * (2.0 * rand::random::<f64>() - 1.0)
        } else {
            1.0
        };
        // Capped so an absurd slowdown cannot overflow Duration (mul_f64 would panic).
        let factor = (self.slowdown * jitter_factor).clamp(0.0, 1e6);
        Duration::try_from_secs_f64(base.as_secs_f64() * factor).unwrap_or(A_DAY)
    }

    /// Time to prefill `tokens` (the TTFT of a prompt, or the recompute after a preemption).
    pub fn prefill_delay(&self, tokens: u32) -> Duration {
        let latency = &self.shared.config.latency;
        let prefill = latency
            .prefill_per_token
            .checked_mul(tokens)
            .unwrap_or(A_DAY);
        self.delay(latency.overhead.saturating_add(prefill))
    }

    /// Prefills the prompt of `answer`: with prefix caching, only what the cache does not
    /// hold, then keeps its blocks in the cache; a decode leg of disaggregated prefill first
    /// reads the blocks its prefill engine kept (see `kv_transfer.rs`). Tells `answer` how
    /// many tokens were cached. Fails only when a decode leg's read fails and the engine's
    /// `kv_load_failure_policy` is `fail`.
    pub async fn prefill_prompt(&mut self, answer: &Answer) -> Result<(), ApiError> {
        let shared = Arc::clone(&self.shared);
        if self.loads_adapter {
            let load_time = shared.lora.as_ref().map_or(Duration::ZERO, |l| l.load_time);
            sleep(self.delay(load_time)).await;
        }
        let transferred = self.read_transferred(answer).await?;
        let Some(cache) = shared.prefix_cache.as_ref() else {
            self.note_cached(answer, transferred);
            self.scheduled = self
                .prefill(answer.prompt_tokens().saturating_sub(transferred))
                .await;
            return Ok(());
        };
        let ids = &answer.request.prompt_ids;
        let lookup = cache.lookup(
            ids,
            answer.request.cache_salt.as_deref(),
            answer.request.lora.as_ref(),
        );
        // What was read counts as computed here; the cache may hold more.
        let cached = lookup.cached_tokens.max(transferred);
        self.note_cached(answer, cached);
        self.scheduled = self
            .prefill(answer.prompt_tokens().saturating_sub(cached))
            .await;
        let engine = shared.engine.snapshot();
        let free = engine
            .total_blocks
            .saturating_sub(engine.phantom_blocks + engine.used_blocks);
        cache.store(&lookup, ids, free);
        self.pinned_blocks += lookup.hashes.len();
        Ok(())
    }

    /// Records `cached` prompt tokens as not computed here. The answer's usage says so
    /// (`cached_tokens`), and how many it computed into new whole blocks
    /// (`created_cache_tokens`); a decode leg's `cached_tokens` is what the prefill engine's
    /// cache served instead (`remote_prefill_cached_tokens`), as vLLM 0.32 reports it.
    fn note_cached(&mut self, answer: &Answer, cached: u32) {
        let block = self.shared.config.block_size.max(1);
        let whole = |tokens: u32| tokens / block * block;
        answer.set_created_tokens(whole(answer.prompt_tokens()).saturating_sub(whole(cached)));
        let reported = match &answer.request.kv_transfer {
            Some(TransferAsk::RemotePrefill(remote)) => remote.prefill_cached.unwrap_or(cached),
            _ => cached,
        };
        answer.set_cached_tokens(reported);
        self.cached_tokens = cached;
        self.shared
            .metrics
            .cached_tokens
            .fetch_add(u64::from(cached), Ordering::Relaxed);
    }

    /// A decode leg's read of the blocks its prefill engine kept: the prompt tokens it
    /// spares (all but the last, which vLLM's scheduler computes again). 0 for any other
    /// request, for parameters without what a read needs (ignored, as vLLM does), and for a
    /// failed read under `kv_load_failure_policy: recompute`.
    async fn read_transferred(&self, answer: &Answer) -> Result<u32, ApiError> {
        let (Some(transfer), Some(ask)) = (&self.shared.kv_transfer, &answer.request.kv_transfer)
        else {
            return Ok(0);
        };
        let read = match ask {
            TransferAsk::RemotePrefill(remote) => transfer.read(remote).await,
            TransferAsk::Pull(pull) => transfer.pull(pull).await,
            TransferAsk::Invalid => {
                tracing::warn!("kv_transfer_params without what a read needs: prefilled here");
                return Ok(0);
            }
            TransferAsk::RemoteDecode { .. } => return Ok(0),
        };
        match read {
            Ok(tokens) => Ok(tokens.min(answer.prompt_tokens().saturating_sub(1))),
            Err(failure) => {
                tracing::warn!(?failure, "the remote KV blocks could not be read");
                match transfer.config().load_failure_policy {
                    LoadFailurePolicy::Recompute => Ok(0),
                    LoadFailurePolicy::Fail => Err(ApiError::new(500, "Internal server error")),
                }
            }
        }
    }

    /// Prefills `tokens`: waits out [`Generation::prefill_delay`], in chunked prefill's steps
    /// when the instance has them, or after the prefills ahead of it when it prefills one
    /// request at a time. Returns when a chunked-prefill step first scheduled it (`None`
    /// without chunked prefill).
    pub async fn prefill(&self, tokens: u32) -> Option<Instant> {
        if let Some(queue) = &self.shared.prefill_queue {
            if !self.zero_latency {
                sleep(self.delay(self.shared.config.latency.overhead)).await;
            }
            return queue.prefill(tokens).await;
        }
        let delay = self.prefill_delay(tokens);
        if delay.is_zero() {
            return None;
        }
        let _turn = if self.shared.config.serial_prefill {
            Some(self.shared.prefill_turn.lock().await)
        } else {
            None
        };
        tokio::time::sleep(delay).await;
        None
    }

    /// Waits for the request's next token: its own pace, or with chunked prefill the end of
    /// the engine's step in progress while prompts prefill (see `prefill.rs`).
    pub async fn next_token(&self) {
        let own = self.inter_token_delay();
        match &self.shared.prefill_queue {
            Some(queue) if !self.zero_latency => queue.decode_step(own).await,
            _ => sleep(own).await,
        }
    }

    pub fn inter_token_delay(&self) -> Duration {
        self.delay(self.shared.config.latency.inter_token)
    }

    pub fn count_prompt(&self, tokens: u64) {
        let metrics = &self.shared.metrics;
        metrics.prompt_tokens.fetch_add(tokens, Ordering::Relaxed);
        // The prefill is one engine step of the prompt's tokens.
        metrics.iteration_tokens.observe(tokens as f64);
    }

    /// `tokens` tokens were produced in one engine step (one per running choice).
    pub fn step(&mut self, tokens: u64) {
        let now = Instant::now();
        let metrics = &self.shared.metrics;
        match self.last_token {
            None => metrics
                .ttft
                .observe(now.saturating_duration_since(self.started).as_secs_f64()),
            Some(previous) => metrics
                .itl
                .observe(now.saturating_duration_since(previous).as_secs_f64()),
        }
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        self.generated += tokens;
        self.steps += 1;
        metrics
            .generation_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        metrics.iteration_tokens.observe(tokens as f64);
    }

    pub fn finish(&mut self, how: Finish) {
        let now = Instant::now();
        let started = self.started;
        let admitted = self.scheduled.or(self.admitted).unwrap_or(started);
        let first_token = self.first_token.unwrap_or(now);
        let seconds = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
        let decode = seconds(first_token, now);
        let request = FinishedRequest {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            generated: self.generated,
            choices: self.choices,
            max_tokens: self.max_tokens,
            e2e: seconds(started, now),
            queued: seconds(started, admitted),
            prefill: seconds(admitted, first_token),
            decode,
            time_per_output_token: (self.steps > 1).then(|| decode / (self.steps - 1) as f64),
            preemptions: self.preemptions.load(Ordering::Relaxed),
        };
        self.shared
            .metrics
            .ended(Ended::Finished(how), self.generated, Some(&request));
        self.shared.stats.count_completed();
        self.finished = true;
    }

    /// The request ended with an error part-way (an injected error event).
    pub fn fail(&mut self) {
        self.shared
            .metrics
            .ended(Ended::Error, self.generated, None);
        self.finished = true;
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if let Some(cache) = &self.shared.prefix_cache {
            cache.unpin(self.pinned_blocks);
        }
        if !self.finished {
            self.shared
                .metrics
                .ended(Ended::Abort, self.generated, None);
        }
    }
}

pub async fn sleep(duration: Duration) {
    if !duration.is_zero() {
        tokio::time::sleep(duration).await;
    }
}
