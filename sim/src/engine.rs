//! KV-cache and queue model, like vLLM's scheduler at the granularity Sluice can see.
//!
//! A request reserves the blocks its whole answer will need (its answer length is known in
//! advance, being deterministic), so admitted requests never stall (but see phantom blocks
//! below); it *holds* only ceil((prompt + generated so far) / block_size) blocks, growing as it
//! generates, and that is what `kv_usage` reports. At most `max_num_seqs` run; the rest wait in FIFO order. With
//! `oom_on_overload`, a request whose reservation does not fit fails like a CUDA OOM instead of
//! waiting.
//!
//! As in vLLM's block pool, one of the `num_gpu_blocks` is the null block, never handed out:
//! requests share the other `num_gpu_blocks - 1`, and the usage is held / (num_gpu_blocks - 1).
//!
//! Phantom blocks (`set_phantom_usage`) stand for memory taken by something the simulator does
//! not model. They count as held and as reserved: new requests wait (or OOM) as on a full GPU,
//! and a running request that needs a block that is no longer free is preempted, as vLLM does:
//! it gives back its blocks and batch slot, goes to the head of the queue, and recomputes what
//! it had when it runs again.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

#[derive(Debug)]
struct State {
    reserved: u64,
    used: u64,
    running: u32,
    waiting: VecDeque<Waiter>,
    next_id: u64,
    phantom_blocks: u64,
    /// The share asked for, as given (the blocks are rounded up from it).
    phantom_usage: f64,
    preemptions: u64,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    need_blocks: u64,
    /// A preempted request: it waits for room even in OOM mode, since it was already running.
    resumes: bool,
    /// Told when the request is admitted (or refused, in OOM mode).
    turn: oneshot::Sender<Result<(), Refusal>>,
}

/// Why a request could not be admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The KV blocks would be oversubscribed (OOM mode only); carries the blocks asked for.
    Oom { need_blocks: u64, free_blocks: u64 },
    /// The waiting queue is at its configured bound.
    QueueFull,
}

#[derive(Debug)]
pub struct Engine {
    total_blocks: u64,
    block_size: u64,
    max_num_seqs: u32,
    max_waiting: Option<usize>,
    oom: bool,
    state: Mutex<State>,
}

/// A snapshot of the scheduler state.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineSnapshot {
    pub running: u32,
    pub waiting: u32,
    /// Blocks held by requests (phantom blocks not included).
    pub used_blocks: u64,
    pub reserved_blocks: u64,
    /// Blocks requests can have: `num_gpu_blocks - 1` (vLLM keeps one as its null block).
    pub total_blocks: u64,
    /// Blocks taken by phantom KV pressure (`Sim::set_phantom_kv`).
    pub phantom_blocks: u64,
    /// Requests preempted since the start (`vllm:num_preemptions_total`).
    pub preemptions: u64,
}

impl EngineSnapshot {
    /// The share of the cache in use, phantom blocks included, at most 1.
    pub fn kv_usage(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            let taken = (self.used_blocks + self.phantom_blocks).min(self.total_blocks);
            taken as f64 / self.total_blocks as f64
        }
    }
}

pub enum Admission {
    Running(Ticket),
    Queued(Pending),
}

impl Engine {
    pub fn new(
        num_gpu_blocks: u32,
        block_size: u32,
        max_num_seqs: u32,
        max_waiting: Option<usize>,
        oom: bool,
    ) -> Arc<Self> {
        Arc::new(Engine {
            // The null block is never handed out.
            total_blocks: u64::from(num_gpu_blocks.saturating_sub(1).max(1)),
            block_size: u64::from(block_size.max(1)),
            max_num_seqs: max_num_seqs.max(1),
            max_waiting,
            oom,
            state: Mutex::new(State {
                reserved: 0,
                used: 0,
                running: 0,
                waiting: VecDeque::new(),
                next_id: 0,
                phantom_blocks: 0,
                phantom_usage: 0.0,
                preemptions: 0,
            }),
        })
    }

    // A poisoned lock only means a panic elsewhere; the counters are still usable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size)
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        let state = self.lock();
        EngineSnapshot {
            running: state.running,
            waiting: state.waiting.len() as u32,
            used_blocks: state.used,
            reserved_blocks: state.reserved,
            total_blocks: self.total_blocks,
            phantom_blocks: state.phantom_blocks,
            preemptions: state.preemptions,
        }
    }

    /// Take `usage` (0..=1) of the cache with phantom blocks; 0 gives them back. The blocks
    /// are rounded up, so the usage reported is at least `usage`.
    pub fn set_phantom_usage(&self, usage: f64) {
        // NaN would poison every comparison below: treat it as "no pressure".
        let usage = if usage.is_nan() {
            0.0
        } else {
            usage.clamp(0.0, 1.0)
        };
        let total = self.total_blocks as f64;
        let mut blocks = (usage * total).round() as u64;
        if (blocks as f64) < usage * total {
            blocks += 1;
        }
        let mut state = self.lock();
        state.phantom_blocks = blocks.min(self.total_blocks);
        state.phantom_usage = usage;
        // Less pressure can let waiting requests in.
        self.schedule(&mut state);
    }

    pub fn phantom_usage(&self) -> f64 {
        self.lock().phantom_usage
    }

    /// Blocks neither reserved by a request nor taken by phantom pressure.
    fn free_blocks(&self, state: &State) -> u64 {
        self.total_blocks
            .saturating_sub(state.reserved + state.phantom_blocks)
    }

    /// Ask to run a request that will need `total_tokens` (prompt + whole answer) in the cache.
    pub fn admit(self: &Arc<Self>, total_tokens: u64) -> Result<Admission, Refusal> {
        // Without OOM mode a request bigger than the cache would never run: let it run alone.
        let need_blocks = if self.oom {
            self.blocks_for(total_tokens).max(1)
        } else {
            self.blocks_for(total_tokens).clamp(1, self.total_blocks)
        };
        let mut state = self.lock();
        if state.waiting.is_empty() && state.running < self.max_num_seqs {
            if need_blocks <= self.free_blocks(&state) {
                state.reserved += need_blocks;
                state.running += 1;
                return Ok(Admission::Running(self.ticket(need_blocks)));
            }
            if self.oom {
                return Err(Refusal::Oom {
                    need_blocks,
                    free_blocks: self.free_blocks(&state),
                });
            }
        }
        if let Some(max_waiting) = self.max_waiting {
            if state.waiting.len() >= max_waiting {
                return Err(Refusal::QueueFull);
            }
        }
        Ok(Admission::Queued(self.enqueue(
            &mut state,
            need_blocks,
            false,
        )))
    }

    /// Queue a request: new ones at the back, preempted ones (`resumes`) at the head.
    fn enqueue(self: &Arc<Self>, state: &mut State, need_blocks: u64, resumes: bool) -> Pending {
        let id = state.next_id;
        state.next_id += 1;
        let (turn, turn_received) = oneshot::channel();
        let waiter = Waiter {
            id,
            need_blocks,
            resumes,
            turn,
        };
        if resumes {
            state.waiting.push_front(waiter);
        } else {
            state.waiting.push_back(waiter);
        }
        Pending {
            engine: Arc::clone(self),
            id,
            need_blocks,
            turn: Some(turn_received),
        }
    }

    fn ticket(self: &Arc<Self>, reserved: u64) -> Ticket {
        Ticket {
            engine: Arc::clone(self),
            reserved,
            held: 0,
            in_batch: true,
        }
    }

    /// Admit waiting requests from the head of the queue while they fit.
    fn schedule(&self, state: &mut State) {
        while state.running < self.max_num_seqs {
            let Some(head) = state.waiting.front() else {
                break;
            };
            let need_blocks = head.need_blocks;
            let fits = need_blocks <= self.free_blocks(state);
            if !fits && (!self.oom || head.resumes) {
                break;
            }
            let Some(waiter) = state.waiting.pop_front() else {
                break;
            };
            if fits {
                state.reserved += need_blocks;
                state.running += 1;
                if waiter.turn.send(Ok(())).is_err() {
                    // The waiter went away between queueing and now: give the slot back.
                    state.reserved -= need_blocks;
                    state.running -= 1;
                }
            } else {
                let _ = waiter.turn.send(Err(Refusal::Oom {
                    need_blocks,
                    free_blocks: self.free_blocks(state),
                }));
            }
        }
    }
}

/// A running request's hold on the engine; releases its blocks and batch slot when dropped.
#[derive(Debug)]
pub struct Ticket {
    engine: Arc<Engine>,
    reserved: u64,
    held: u64,
    /// False once preempted: the blocks and the slot were given back already.
    in_batch: bool,
}

impl Ticket {
    /// Record that the request now has `tokens` tokens (prompt + generated) in the cache.
    ///
    /// `Some` when the blocks it needs are not free (phantom pressure): the request was
    /// preempted and waits at the head of the queue. Await the `Pending` for a new ticket, then
    /// set the tokens again; this ticket no longer holds anything.
    #[must_use = "a preempted request must wait for its turn again"]
    pub fn set_tokens(&mut self, tokens: u64) -> Option<Pending> {
        let wanted = self.engine.blocks_for(tokens).min(self.reserved);
        if !self.in_batch || wanted == self.held {
            return None;
        }
        let engine = Arc::clone(&self.engine);
        let mut state = engine.lock();
        let growth = wanted.saturating_sub(self.held);
        if growth > 0 && state.used + state.phantom_blocks + growth > engine.total_blocks {
            return Some(self.preempt(&mut state));
        }
        state.used = state.used + wanted - self.held;
        self.held = wanted;
        None
    }

    /// Give back the blocks and the batch slot, and queue again at the head.
    fn preempt(&mut self, state: &mut State) -> Pending {
        self.release(state);
        state.preemptions += 1;
        let pending = self.engine.enqueue(state, self.reserved, true);
        self.engine.schedule(state);
        pending
    }

    fn release(&mut self, state: &mut State) {
        state.used = state.used.saturating_sub(self.held);
        state.reserved = state.reserved.saturating_sub(self.reserved);
        state.running = state.running.saturating_sub(1);
        self.held = 0;
        self.in_batch = false;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.in_batch {
            return;
        }
        let engine = Arc::clone(&self.engine);
        let mut state = engine.lock();
        self.release(&mut state);
        engine.schedule(&mut state);
    }
}

/// A queued request; await `wait` for its ticket. Dropping it leaves the queue.
#[derive(Debug)]
pub struct Pending {
    engine: Arc<Engine>,
    id: u64,
    need_blocks: u64,
    turn: Option<oneshot::Receiver<Result<(), Refusal>>>,
}

impl Pending {
    pub async fn wait(mut self) -> Result<Ticket, Refusal> {
        // Poll through a reference so that, if this future is dropped while queued, `Drop`
        // still finds the receiver and takes the request out of the queue.
        let told = match self.turn.as_mut() {
            Some(turn) => turn.await,
            None => return Err(Refusal::QueueFull),
        };
        self.turn = None;
        match told {
            Ok(Ok(())) => Ok(self.engine.ticket(self.need_blocks)),
            Ok(Err(refusal)) => Err(refusal),
            // The engine dropped the waiter without an answer; nothing else can admit it.
            Err(_) => Err(Refusal::QueueFull),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(mut turn) = self.turn.take() else {
            return;
        };
        let engine = Arc::clone(&self.engine);
        let mut state = engine.lock();
        if let Some(position) = state.waiting.iter().position(|waiter| waiter.id == self.id) {
            state.waiting.remove(position);
        } else if let Ok(Ok(())) = turn.try_recv() {
            // Admitted but never picked up: release what the scheduler gave it.
            state.reserved = state.reserved.saturating_sub(self.need_blocks);
            state.running = state.running.saturating_sub(1);
            engine.schedule(&mut state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_and_blocks() {
        let engine = Engine::new(11, 16, 2, None, false);
        let Ok(Admission::Running(mut first)) = engine.admit(64) else {
            panic!("first")
        };
        assert!(first.set_tokens(20).is_none());
        assert_eq!(engine.snapshot().used_blocks, 2);
        let Ok(Admission::Running(second)) = engine.admit(16) else {
            panic!("second")
        };
        let Ok(Admission::Queued(third)) = engine.admit(16) else {
            panic!("third")
        };
        assert_eq!(engine.snapshot().waiting, 1);
        assert_eq!(engine.snapshot().running, 2);
        drop(second);
        let third = third.wait().await.unwrap();
        assert_eq!(engine.snapshot().running, 2);
        drop(first);
        drop(third);
        assert_eq!(
            engine.snapshot(),
            EngineSnapshot {
                total_blocks: 10,
                ..Default::default()
            }
        );
    }

    #[tokio::test]
    async fn oom_mode_refuses() {
        let engine = Engine::new(4, 16, 8, None, true);
        let Ok(Admission::Running(_running)) = engine.admit(48) else {
            panic!("first")
        };
        assert!(matches!(engine.admit(32), Err(Refusal::Oom { .. })));
    }

    #[tokio::test]
    async fn dropped_pending_leaves_queue() {
        let engine = Engine::new(4, 16, 1, Some(1), false);
        let Ok(Admission::Running(running)) = engine.admit(16) else {
            panic!("running")
        };
        let Ok(Admission::Queued(pending)) = engine.admit(16) else {
            panic!("pending")
        };
        assert!(matches!(engine.admit(16), Err(Refusal::QueueFull)));
        drop(pending);
        assert_eq!(engine.snapshot().waiting, 0);
        drop(running);
        assert_eq!(engine.snapshot().running, 0);
    }

    #[tokio::test]
    async fn phantom_blocks_are_reported_and_make_new_requests_wait() {
        let engine = Engine::new(11, 16, 8, None, false);
        engine.set_phantom_usage(0.85);
        let snapshot = engine.snapshot();
        // Rounded up: at least the share asked for.
        assert_eq!(snapshot.phantom_blocks, 9);
        assert_eq!(snapshot.kv_usage(), 0.9);
        assert_eq!(engine.phantom_usage(), 0.85);
        // One block is free: a one-block request runs, a two-block one waits.
        let Ok(Admission::Running(small)) = engine.admit(16) else {
            panic!("small")
        };
        let Ok(Admission::Queued(large)) = engine.admit(32) else {
            panic!("large")
        };
        engine.set_phantom_usage(0.0);
        let large = large.wait().await.unwrap();
        assert_eq!(engine.snapshot().running, 2);
        drop((small, large));
        engine.set_phantom_usage(f64::NAN);
        assert_eq!(engine.snapshot().kv_usage(), 0.0);
        engine.set_phantom_usage(7.0);
        assert_eq!(engine.snapshot().kv_usage(), 1.0);
    }

    #[tokio::test]
    async fn phantom_pressure_preempts_a_growing_request() {
        let engine = Engine::new(11, 16, 8, None, true);
        let Ok(Admission::Running(mut ticket)) = engine.admit(64) else {
            panic!("running")
        };
        assert!(ticket.set_tokens(16).is_none());
        engine.set_phantom_usage(1.0);
        // Within its block it goes on; the next block is not free.
        assert!(ticket.set_tokens(16).is_none());
        let preempted = ticket.set_tokens(17).expect("preempted");
        let snapshot = engine.snapshot();
        assert_eq!((snapshot.running, snapshot.waiting), (0, 1));
        assert_eq!((snapshot.used_blocks, snapshot.preemptions), (0, 1));
        // Even in OOM mode the preempted request waits for room, and new ones queue behind it.
        let Ok(Admission::Queued(behind)) = engine.admit(16) else {
            panic!("behind")
        };
        engine.set_phantom_usage(0.0);
        let mut ticket = preempted.wait().await.unwrap();
        assert!(ticket.set_tokens(17).is_none());
        assert_eq!(engine.snapshot().used_blocks, 2);
        let behind = behind.wait().await.unwrap();
        drop((ticket, behind));
        assert_eq!(engine.snapshot().reserved_blocks, 0);
    }
}
