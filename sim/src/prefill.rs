//! Chunked prefill, as vLLM V1's scheduler runs it: the engine works in steps, each taking at
//! most `max_num_batched_tokens` tokens, shared by the running decodes (one token each) and
//! the prefills, which take chunks of what is left in arrival order. A long prompt takes
//! several steps. By default (vLLM's: no `long_prefill_token_threshold`) the prompts ahead take
//! whole steps in arrival order, and a short prompt waits for every one queued before it, then
//! shares the step where the last of them ends. With a threshold set, one prompt takes at most
//! that many tokens of a step while others wait, so a short prompt gets the next step's
//! remainder and no longer waits for the whole of a long prefill.
//!
//! As in vLLM V1, a prompt is queued (`request_queue_time_seconds`) until a step first
//! schedules a chunk of it, and prefills (`request_prefill_time_seconds`) from then on.
//!
//! A step lasts `inter_token` (a decode step) or, when it prefills more, the time its prefill
//! tokens take at `prefill_per_token`, whichever is longer, scaled by the jitter and the fault
//! slowdown. While prompts prefill, a decoding sequence's next token comes with the end of the
//! step in progress, as in vLLM, where every step runs the decodes and the prefill chunks
//! together: a long prefill stretches every running sequence's inter-token latency (which
//! disaggregated prefill exists to avoid). With nothing prefilling, decodes keep their own
//! per-request pace (see `handlers::generation`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch, Notify};

use crate::Shared;

struct Job {
    remaining: u32,
    /// When a step first scheduled a chunk of it.
    scheduled: Option<Instant>,
    done: oneshot::Sender<Instant>,
}

pub struct PrefillQueue {
    budget: u32,
    /// Tokens one prompt may take in a step while others wait.
    long_threshold: u32,
    jobs: Mutex<VecDeque<Job>>,
    arrived: Notify,
    /// Counts the steps ended: decodes wait for the one in progress.
    steps: watch::Sender<u64>,
}

impl PrefillQueue {
    /// Starts the step loop of `shared`'s engine; it ends when `shared` is gone.
    pub fn start(budget: u32, long_threshold: Option<u32>, shared: Weak<Shared>) -> Arc<Self> {
        let budget = budget.max(1);
        let long_threshold = match long_threshold {
            None | Some(0) => budget,
            Some(tokens) => tokens,
        };
        let queue = Arc::new(PrefillQueue {
            budget,
            long_threshold,
            jobs: Mutex::new(VecDeque::new()),
            arrived: Notify::new(),
            steps: watch::channel(0).0,
        });
        tokio::spawn(run(Arc::clone(&queue), shared));
        queue
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Job>> {
        self.jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Prefills `tokens`: returns when the step that computes its last chunk ends, with
    /// when a step first scheduled a chunk of it (`None` for no tokens, or a queue that
    /// stopped). Dropping the future leaves the queue at the next step.
    pub async fn prefill(&self, tokens: u32) -> Option<Instant> {
        if tokens == 0 {
            return None;
        }
        let (done, finished) = oneshot::channel();
        self.lock().push_back(Job {
            remaining: tokens,
            scheduled: None,
            done,
        });
        self.arrived.notify_one();
        finished.await.ok()
    }

    /// A decoding sequence's next token, `own` after its last one when nothing prefills;
    /// while prompts prefill, at the end of the step in progress (which lasts as long as its
    /// prefill chunk, and at least a decode step).
    pub async fn decode_step(&self, own: Duration) {
        let mut steps = self.steps.subscribe();
        steps.borrow_and_update();
        if self.lock().is_empty() {
            if !own.is_zero() {
                tokio::time::sleep(own).await;
            }
            return;
        }
        let _ = steps.changed().await;
    }

    /// Plans one step: the tokens each waiting prefill computes in it, with `decoding`
    /// sequences taking one token each first. Returns the step's prefill tokens.
    fn plan_step(&self, decoding: u32) -> u32 {
        let mut jobs = self.lock();
        jobs.retain(|job| !job.done.is_closed());
        let mut left = self.budget.saturating_sub(decoding).max(1);
        let waiting = jobs.len();
        let mut planned = 0;
        for job in jobs.iter_mut() {
            if left == 0 {
                break;
            }
            let cap = if waiting > 1 {
                self.long_threshold
            } else {
                left
            };
            let take = job.remaining.min(left).min(cap);
            if take > 0 {
                job.scheduled.get_or_insert_with(Instant::now);
            }
            job.remaining -= take;
            left -= take;
            planned += take;
        }
        planned
    }

    /// Ends a step: the prefills whose last chunk it computed are done.
    fn end_step(&self) {
        let mut jobs = self.lock();
        let mut still = VecDeque::with_capacity(jobs.len());
        for job in jobs.drain(..) {
            if job.remaining == 0 {
                let scheduled = job.scheduled.unwrap_or_else(Instant::now);
                let _ = job.done.send(scheduled);
            } else {
                still.push_back(job);
            }
        }
        *jobs = still;
        drop(jobs);
        self.steps.send_modify(|ended| *ended += 1);
    }
}

async fn run(queue: Arc<PrefillQueue>, shared: Weak<Shared>) {
    loop {
        let pending = queue.lock().is_empty();
        if pending {
            queue.arrived.notified().await;
            continue;
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let snapshot = shared.engine.snapshot();
        let prefilling = queue.lock().len() as u32;
        let decoding = snapshot.running.saturating_sub(prefilling);
        let tokens = queue.plan_step(decoding);
        let latency = &shared.config.latency;
        let prefill = latency
            .prefill_per_token
            .checked_mul(tokens)
            .unwrap_or(Duration::from_secs(3600));
        let base = prefill.max(latency.inter_token);
        let jitter = latency.jitter.clamp(0.0, 1.0);
        let factor = (1.0 + jitter * (2.0 * rand::random::<f64>() - 1.0))
            * shared.faults().slowdown_factor();
        let step = Duration::try_from_secs_f64(base.as_secs_f64() * factor.clamp(0.0, 1e6))
            .unwrap_or(Duration::from_secs(3600));
        drop(shared);
        if !step.is_zero() {
            tokio::time::sleep(step).await;
        }
        queue.end_step();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(budget: u32) -> PrefillQueue {
        PrefillQueue {
            budget,
            long_threshold: budget / 4,
            jobs: Mutex::new(VecDeque::new()),
            arrived: Notify::new(),
            steps: watch::channel(0).0,
        }
    }

    fn push(queue: &PrefillQueue, tokens: u32) -> oneshot::Receiver<Instant> {
        let (done, finished) = oneshot::channel();
        queue.lock().push_back(Job {
            remaining: tokens,
            scheduled: None,
            done,
        });
        finished
    }

    #[test]
    fn a_short_prompt_gets_through_beside_a_long_one() {
        let q = queue(8192);
        let mut long = push(&q, 20_000);
        // Alone, the long prompt takes the whole budget, less the decodes.
        assert_eq!(q.plan_step(192), 8000);
        q.end_step();
        assert!(long.try_recv().is_err());
        let mut short = push(&q, 300);
        // Now two wait: each takes at most a quarter of the budget.
        assert_eq!(q.plan_step(0), 2048 + 300);
        q.end_step();
        assert!(
            short.try_recv().is_ok(),
            "the short prompt is done in one step"
        );
        assert!(long.try_recv().is_err());
        // 20,000 - 8,000 - 2,048 = 9,952 left: two more steps alone.
        assert_eq!(q.plan_step(0), 8192);
        q.end_step();
        assert_eq!(q.plan_step(0), 9952 - 8192);
        q.end_step();
        assert!(long.try_recv().is_ok());
    }

    #[test]
    fn without_a_threshold_prompts_take_whole_steps_in_arrival_order() {
        let q = PrefillQueue {
            long_threshold: 8192,
            ..queue(8192)
        };
        let mut long = push(&q, 20_000);
        let mut short = push(&q, 300);
        assert_eq!(q.plan_step(0), 8192);
        q.end_step();
        assert_eq!(q.plan_step(0), 8192);
        q.end_step();
        assert!(short.try_recv().is_err(), "behind the long prompt");
        // The long prompt's last 3,616 tokens, and the short one beside them.
        assert_eq!(q.plan_step(0), 3616 + 300);
        q.end_step();
        assert!(long.try_recv().is_ok() && short.try_recv().is_ok());
    }

    #[test]
    fn a_prompt_is_queued_until_a_step_first_schedules_it() {
        let q = PrefillQueue {
            long_threshold: 8192,
            ..queue(8192)
        };
        let mut long = push(&q, 10_000);
        let mut short = push(&q, 300);
        q.plan_step(0);
        q.end_step();
        let after_first_step = Instant::now();
        q.plan_step(0);
        q.end_step();
        let long_scheduled = long.try_recv().unwrap();
        let short_scheduled = short.try_recv().unwrap();
        assert!(
            long_scheduled < after_first_step,
            "the long one from the first step"
        );
        assert!(
            short_scheduled >= after_first_step,
            "the short one queued through the first step"
        );
    }

    #[test]
    fn a_prefill_whose_client_left_is_dropped() {
        let q = queue(100);
        drop(push(&q, 50));
        let _kept = push(&q, 10);
        assert_eq!(q.plan_step(0), 10);
    }
}
