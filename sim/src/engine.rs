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
//!
//! LoRA adapters, as vLLM's V1 scheduler takes them: the running batch uses at most
//! `max_loras` adapters at once; a waiting request for another adapter is skipped (it waits,
//! "deferred" in vLLM's words) while requests behind it may run. The adapters in use sit in
//! `max_loras` GPU slots, the least recently used given up for a new one: a request whose
//! adapter was not in a slot loads it first ([`Ticket::loaded_adapter`]).

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
    /// Per adapter with requests in the engine, first seen first (what
    /// `vllm:lora_requests_info` lists).
    loras: Vec<LoraRequests>,
    /// Adapters in the GPU slots, the least recently used first.
    slots: VecDeque<u32>,
}

/// One adapter's requests in the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraRequests {
    /// The adapter's id (vLLM's `lora_int_id`).
    pub adapter: u32,
    pub waiting: u32,
    pub running: u32,
}

impl State {
    fn lora(&mut self, adapter: u32) -> &mut LoraRequests {
        let at = match self.loras.iter().position(|l| l.adapter == adapter) {
            Some(at) => at,
            None => {
                self.loras.push(LoraRequests {
                    adapter,
                    waiting: 0,
                    running: 0,
                });
                self.loras.len() - 1
            }
        };
        &mut self.loras[at]
    }

    /// Moves one of `adapter`'s requests: out of `from` (waiting: true, running: false, or
    /// nowhere: None) into `to`; an adapter with no request left is no longer listed.
    fn move_lora(&mut self, adapter: Option<u32>, from: Option<bool>, to: Option<bool>) {
        let Some(adapter) = adapter else {
            return;
        };
        let lora = self.lora(adapter);
        match from {
            Some(true) => lora.waiting = lora.waiting.saturating_sub(1),
            Some(false) => lora.running = lora.running.saturating_sub(1),
            None => {}
        }
        match to {
            Some(true) => lora.waiting += 1,
            Some(false) => lora.running += 1,
            None => {}
        }
        self.loras.retain(|l| l.waiting > 0 || l.running > 0);
    }

    fn runs_adapter(&self, adapter: u32) -> bool {
        self.loras
            .iter()
            .any(|l| l.adapter == adapter && l.running > 0)
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    need_blocks: u64,
    /// The LoRA adapter it asks for.
    lora: Option<u32>,
    /// A preempted request: it waits for room even in OOM mode, since it was already running.
    resumes: bool,
    /// Told when the request is admitted (whether its adapter was loaded for it), or
    /// refused (OOM mode).
    turn: oneshot::Sender<Result<bool, Refusal>>,
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
    /// `--max-loras`; 0 without LoRA.
    max_loras: usize,
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
        max_loras: u32,
    ) -> Arc<Self> {
        Arc::new(Engine {
            // The null block is never handed out.
            total_blocks: u64::from(num_gpu_blocks.saturating_sub(1).max(1)),
            block_size: u64::from(block_size.max(1)),
            max_num_seqs: max_num_seqs.max(1),
            max_waiting,
            oom,
            max_loras: max_loras as usize,
            state: Mutex::new(State {
                reserved: 0,
                used: 0,
                running: 0,
                waiting: VecDeque::new(),
                next_id: 0,
                phantom_blocks: 0,
                phantom_usage: 0.0,
                preemptions: 0,
                loras: Vec::new(),
                slots: VecDeque::new(),
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

    /// The adapters with requests in the engine, first seen first.
    pub fn lora_requests(&self) -> Vec<LoraRequests> {
        self.lock().loras.clone()
    }

    /// Whether a request for `lora` may join the running batch: its adapter runs already,
    /// or fewer than `max_loras` adapters do.
    fn lora_fits(&self, state: &State, lora: Option<u32>) -> bool {
        let Some(adapter) = lora else {
            return true;
        };
        self.max_loras == 0
            || state.runs_adapter(adapter)
            || state.loras.iter().filter(|l| l.running > 0).count() < self.max_loras
    }

    /// A request for `lora` joins the running batch (from the queue when `waited`); returns
    /// whether its adapter had to be loaded into a slot, the least recently used given up.
    fn start_running(&self, state: &mut State, lora: Option<u32>, waited: bool) -> bool {
        state.move_lora(lora, waited.then_some(true), Some(false));
        let Some(adapter) = lora else {
            return false;
        };
        if let Some(at) = state.slots.iter().position(|&a| a == adapter) {
            state.slots.remove(at);
            state.slots.push_back(adapter);
            return false;
        }
        if state.slots.len() >= self.max_loras.max(1) {
            // At most `max_loras` adapters run, this one included: one in a slot is idle.
            let idle = state.slots.iter().position(|&a| !state.runs_adapter(a));
            if let Some(at) = idle {
                state.slots.remove(at);
            }
        }
        state.slots.push_back(adapter);
        true
    }

    /// Blocks neither reserved by a request nor taken by phantom pressure.
    fn free_blocks(&self, state: &State) -> u64 {
        self.total_blocks
            .saturating_sub(state.reserved + state.phantom_blocks)
    }

    /// Ask to run a request that will need `total_tokens` (prompt + whole answer) in the cache,
    /// with the LoRA adapter `lora` if any.
    pub fn admit(
        self: &Arc<Self>,
        total_tokens: u64,
        lora: Option<u32>,
    ) -> Result<Admission, Refusal> {
        // Without OOM mode a request bigger than the cache would never run: let it run alone.
        let need_blocks = if self.oom {
            self.blocks_for(total_tokens).max(1)
        } else {
            self.blocks_for(total_tokens).clamp(1, self.total_blocks)
        };
        let mut state = self.lock();
        if state.waiting.is_empty()
            && state.running < self.max_num_seqs
            && self.lora_fits(&state, lora)
        {
            if need_blocks <= self.free_blocks(&state) {
                state.reserved += need_blocks;
                state.running += 1;
                let loaded = self.start_running(&mut state, lora, false);
                return Ok(Admission::Running(self.ticket(need_blocks, lora, loaded)));
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
        let pending = self.enqueue(&mut state, need_blocks, lora, false);
        // Those ahead may all be waiting for their adapters: this one may run now.
        self.schedule(&mut state);
        Ok(Admission::Queued(pending))
    }

    /// Queue a request: new ones at the back, preempted ones (`resumes`) at the head.
    fn enqueue(
        self: &Arc<Self>,
        state: &mut State,
        need_blocks: u64,
        lora: Option<u32>,
        resumes: bool,
    ) -> Pending {
        let id = state.next_id;
        state.next_id += 1;
        let (turn, turn_received) = oneshot::channel();
        state.move_lora(lora, None, Some(true));
        let waiter = Waiter {
            id,
            need_blocks,
            lora,
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
            lora,
            turn: Some(turn_received),
        }
    }

    fn ticket(self: &Arc<Self>, reserved: u64, lora: Option<u32>, loaded: bool) -> Ticket {
        Ticket {
            engine: Arc::clone(self),
            reserved,
            held: 0,
            in_batch: true,
            lora,
            loaded_adapter: loaded,
        }
    }

    /// Admit waiting requests in queue order while they fit; one whose adapter cannot join
    /// the batch now is passed over (vLLM skips it), one whose blocks do not fit stops the
    /// rest.
    fn schedule(&self, state: &mut State) {
        let mut at = 0;
        while state.running < self.max_num_seqs && at < state.waiting.len() {
            let waiter = &state.waiting[at];
            if !self.lora_fits(state, waiter.lora) {
                at += 1;
                continue;
            }
            let need_blocks = waiter.need_blocks;
            let fits = need_blocks <= self.free_blocks(state);
            if !fits && (!self.oom || waiter.resumes) {
                break;
            }
            let Some(waiter) = state.waiting.remove(at) else {
                break;
            };
            if fits {
                state.reserved += need_blocks;
                state.running += 1;
                let loaded = self.start_running(state, waiter.lora, true);
                if waiter.turn.send(Ok(loaded)).is_err() {
                    // The waiter went away between queueing and now: give the slot back.
                    state.reserved -= need_blocks;
                    state.running -= 1;
                    state.move_lora(waiter.lora, Some(false), None);
                }
            } else {
                state.move_lora(waiter.lora, Some(true), None);
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
    lora: Option<u32>,
    loaded_adapter: bool,
}

impl Ticket {
    /// Whether the request's LoRA adapter was loaded into a slot for it (it waits for the
    /// load before its prefill).
    pub fn loaded_adapter(&self) -> bool {
        self.loaded_adapter
    }

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
        let pending = self.engine.enqueue(state, self.reserved, self.lora, true);
        self.engine.schedule(state);
        pending
    }

    fn release(&mut self, state: &mut State) {
        state.used = state.used.saturating_sub(self.held);
        state.reserved = state.reserved.saturating_sub(self.reserved);
        state.running = state.running.saturating_sub(1);
        state.move_lora(self.lora, Some(false), None);
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
    lora: Option<u32>,
    turn: Option<oneshot::Receiver<Result<bool, Refusal>>>,
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
            Ok(Ok(loaded)) => Ok(self.engine.ticket(self.need_blocks, self.lora, loaded)),
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
            state.move_lora(self.lora, Some(true), None);
        } else if let Ok(Ok(_)) = turn.try_recv() {
            // Admitted but never picked up: release what the scheduler gave it.
            state.reserved = state.reserved.saturating_sub(self.need_blocks);
            state.running = state.running.saturating_sub(1);
            state.move_lora(self.lora, Some(false), None);
            engine.schedule(&mut state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_and_blocks() {
        let engine = Engine::new(11, 16, 2, None, false, 0);
        let Ok(Admission::Running(mut first)) = engine.admit(64, None) else {
            panic!("first")
        };
        assert!(first.set_tokens(20).is_none());
        assert_eq!(engine.snapshot().used_blocks, 2);
        let Ok(Admission::Running(second)) = engine.admit(16, None) else {
            panic!("second")
        };
        let Ok(Admission::Queued(third)) = engine.admit(16, None) else {
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
        let engine = Engine::new(4, 16, 8, None, true, 0);
        let Ok(Admission::Running(_running)) = engine.admit(48, None) else {
            panic!("first")
        };
        assert!(matches!(engine.admit(32, None), Err(Refusal::Oom { .. })));
    }

    #[tokio::test]
    async fn dropped_pending_leaves_queue() {
        let engine = Engine::new(4, 16, 1, Some(1), false, 0);
        let Ok(Admission::Running(running)) = engine.admit(16, None) else {
            panic!("running")
        };
        let Ok(Admission::Queued(pending)) = engine.admit(16, None) else {
            panic!("pending")
        };
        assert!(matches!(engine.admit(16, None), Err(Refusal::QueueFull)));
        drop(pending);
        assert_eq!(engine.snapshot().waiting, 0);
        drop(running);
        assert_eq!(engine.snapshot().running, 0);
    }

    #[tokio::test]
    async fn phantom_blocks_are_reported_and_make_new_requests_wait() {
        let engine = Engine::new(11, 16, 8, None, false, 0);
        engine.set_phantom_usage(0.85);
        let snapshot = engine.snapshot();
        // Rounded up: at least the share asked for.
        assert_eq!(snapshot.phantom_blocks, 9);
        assert_eq!(snapshot.kv_usage(), 0.9);
        assert_eq!(engine.phantom_usage(), 0.85);
        // One block is free: a one-block request runs, a two-block one waits.
        let Ok(Admission::Running(small)) = engine.admit(16, None) else {
            panic!("small")
        };
        let Ok(Admission::Queued(large)) = engine.admit(32, None) else {
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
        let engine = Engine::new(11, 16, 8, None, true, 0);
        let Ok(Admission::Running(mut ticket)) = engine.admit(64, None) else {
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
        let Ok(Admission::Queued(behind)) = engine.admit(16, None) else {
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

    #[tokio::test]
    async fn a_batch_uses_at_most_max_loras_adapters() {
        let engine = Engine::new(1000, 16, 8, None, false, 1);
        let Ok(Admission::Running(first_a)) = engine.admit(16, Some(1)) else {
            panic!("a")
        };
        assert!(
            first_a.loaded_adapter(),
            "the first request loads its adapter"
        );
        // Adapter 2 cannot join while 1 runs: it waits, and requests behind it pass.
        let Ok(Admission::Queued(b)) = engine.admit(16, Some(2)) else {
            panic!("b waits")
        };
        let Ok(Admission::Queued(base)) = engine.admit(16, None) else {
            panic!("queued behind b")
        };
        let base = base.wait().await.unwrap();
        assert!(!base.loaded_adapter());
        let Ok(Admission::Queued(second_a)) = engine.admit(16, Some(1)) else {
            panic!("queued behind b")
        };
        let second_a = second_a.wait().await.unwrap();
        assert!(!second_a.loaded_adapter(), "adapter 1 is in its slot");
        assert_eq!(
            engine.lora_requests(),
            [
                LoraRequests {
                    adapter: 1,
                    waiting: 0,
                    running: 2
                },
                LoraRequests {
                    adapter: 2,
                    waiting: 1,
                    running: 0
                },
            ]
        );
        drop(first_a);
        assert_eq!(engine.snapshot().waiting, 1, "adapter 1 still runs");
        drop(second_a);
        let b = b.wait().await.unwrap();
        assert!(b.loaded_adapter(), "adapter 2 took adapter 1's slot");
        assert_eq!(
            engine.lora_requests(),
            [LoraRequests {
                adapter: 2,
                waiting: 0,
                running: 1
            }]
        );
        drop((b, base));
        assert!(engine.lora_requests().is_empty());
    }
}
