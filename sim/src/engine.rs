//! KV-cache and queue model, like vLLM's scheduler at the granularity Sluice can see.
//!
//! A request reserves the blocks its whole answer will need (its answer length is known in
//! advance, being deterministic), so admitted requests never stall; it *holds* only
//! ceil((prompt + generated so far) / block_size) blocks, growing as it generates, and that is
//! what `kv_usage` reports. At most `max_num_seqs` run; the rest wait in FIFO order. With
//! `oom_on_overload`, a request whose reservation does not fit fails like a CUDA OOM instead of
//! waiting.

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
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    need: u64,
    tx: oneshot::Sender<Result<(), Refusal>>,
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
    pub used_blocks: u64,
    pub reserved_blocks: u64,
    pub total_blocks: u64,
}

impl EngineSnapshot {
    pub fn kv_usage(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.used_blocks as f64 / self.total_blocks as f64
        }
    }
}

pub enum Admission {
    Running(Ticket),
    Queued(Pending),
}

impl Engine {
    pub fn new(
        total_blocks: u32,
        block_size: u32,
        max_num_seqs: u32,
        max_waiting: Option<usize>,
        oom: bool,
    ) -> Arc<Self> {
        Arc::new(Engine {
            total_blocks: u64::from(total_blocks.max(1)),
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
            }),
        })
    }

    // A poisoned lock only means a panic elsewhere; the counters are still usable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size)
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        let s = self.lock();
        EngineSnapshot {
            running: s.running,
            waiting: s.waiting.len() as u32,
            used_blocks: s.used,
            reserved_blocks: s.reserved,
            total_blocks: self.total_blocks,
        }
    }

    /// Ask to run a request that will need `total_tokens` (prompt + whole answer) in the cache.
    pub fn admit(self: &Arc<Self>, total_tokens: u64) -> Result<Admission, Refusal> {
        // Without OOM mode a request bigger than the cache would never run: let it run alone.
        let need = self.blocks_for(total_tokens).clamp(1, self.total_blocks);
        let need = if self.oom {
            self.blocks_for(total_tokens).max(1)
        } else {
            need
        };
        let mut s = self.lock();
        if s.waiting.is_empty() && s.running < self.max_num_seqs {
            if s.reserved + need <= self.total_blocks {
                s.reserved += need;
                s.running += 1;
                return Ok(Admission::Running(self.ticket(need)));
            }
            if self.oom {
                return Err(Refusal::Oom {
                    need_blocks: need,
                    free_blocks: self.total_blocks.saturating_sub(s.reserved),
                });
            }
        }
        if let Some(max) = self.max_waiting {
            if s.waiting.len() >= max {
                return Err(Refusal::QueueFull);
            }
        }
        let id = s.next_id;
        s.next_id += 1;
        let (tx, rx) = oneshot::channel();
        s.waiting.push_back(Waiter { id, need, tx });
        Ok(Admission::Queued(Pending {
            engine: Arc::clone(self),
            id,
            need,
            rx: Some(rx),
        }))
    }

    fn ticket(self: &Arc<Self>, reserved: u64) -> Ticket {
        Ticket {
            engine: Arc::clone(self),
            reserved,
            held: 0,
        }
    }

    /// Admit waiting requests from the head of the queue while they fit.
    fn schedule(&self, s: &mut State) {
        while s.running < self.max_num_seqs {
            let Some(head) = s.waiting.front() else { break };
            let need = head.need;
            let fits = s.reserved + need <= self.total_blocks;
            if !fits && !self.oom {
                break;
            }
            let Some(w) = s.waiting.pop_front() else {
                break;
            };
            if fits {
                s.reserved += need;
                s.running += 1;
                if w.tx.send(Ok(())).is_err() {
                    // The waiter went away between queueing and now: give the slot back.
                    s.reserved -= need;
                    s.running -= 1;
                }
            } else {
                let free = self.total_blocks.saturating_sub(s.reserved);
                let _ = w.tx.send(Err(Refusal::Oom {
                    need_blocks: need,
                    free_blocks: free,
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
}

impl Ticket {
    /// Record that the request now has `tokens` tokens (prompt + generated) in the cache.
    pub fn set_tokens(&mut self, tokens: u64) {
        let want = self.engine.blocks_for(tokens).min(self.reserved);
        if want != self.held {
            let mut s = self.engine.lock();
            s.used = s.used + want - self.held;
            self.held = want;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let engine = Arc::clone(&self.engine);
        let mut s = engine.lock();
        s.used = s.used.saturating_sub(self.held);
        s.reserved = s.reserved.saturating_sub(self.reserved);
        s.running = s.running.saturating_sub(1);
        engine.schedule(&mut s);
    }
}

/// A queued request; await `wait` for its ticket. Dropping it leaves the queue.
#[derive(Debug)]
pub struct Pending {
    engine: Arc<Engine>,
    id: u64,
    need: u64,
    rx: Option<oneshot::Receiver<Result<(), Refusal>>>,
}

impl Pending {
    pub async fn wait(mut self) -> Result<Ticket, Refusal> {
        // Poll through a reference so that, if this future is dropped while queued, `Drop`
        // still finds the receiver and takes the request out of the queue.
        let res = match self.rx.as_mut() {
            Some(rx) => rx.await,
            None => return Err(Refusal::QueueFull),
        };
        self.rx = None;
        match res {
            Ok(Ok(())) => Ok(self.engine.ticket(self.need)),
            Ok(Err(r)) => Err(r),
            Err(_) => Err(Refusal::QueueFull),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        let engine = Arc::clone(&self.engine);
        let mut s = engine.lock();
        if let Some(pos) = s.waiting.iter().position(|w| w.id == self.id) {
            s.waiting.remove(pos);
        } else if let Ok(Ok(())) = rx.try_recv() {
            // Admitted but never picked up: release what the scheduler gave it.
            s.reserved = s.reserved.saturating_sub(self.need);
            s.running = s.running.saturating_sub(1);
            engine.schedule(&mut s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_and_blocks() {
        let e = Engine::new(10, 16, 2, None, false);
        let Ok(Admission::Running(mut a)) = e.admit(64) else {
            panic!("a")
        };
        a.set_tokens(20);
        assert_eq!(e.snapshot().used_blocks, 2);
        let Ok(Admission::Running(b)) = e.admit(16) else {
            panic!("b")
        };
        let Ok(Admission::Queued(c)) = e.admit(16) else {
            panic!("c")
        };
        assert_eq!(e.snapshot().waiting, 1);
        assert_eq!(e.snapshot().running, 2);
        drop(b);
        let c = c.wait().await.unwrap();
        assert_eq!(e.snapshot().running, 2);
        drop(a);
        drop(c);
        assert_eq!(
            e.snapshot(),
            EngineSnapshot {
                total_blocks: 10,
                ..Default::default()
            }
        );
    }

    #[tokio::test]
    async fn oom_mode_refuses() {
        let e = Engine::new(4, 16, 8, None, true);
        let Ok(Admission::Running(_a)) = e.admit(48) else {
            panic!("a")
        };
        assert!(matches!(e.admit(32), Err(Refusal::Oom { .. })));
    }

    #[tokio::test]
    async fn dropped_pending_leaves_queue() {
        let e = Engine::new(4, 16, 1, Some(1), false);
        let Ok(Admission::Running(a)) = e.admit(16) else {
            panic!("a")
        };
        let Ok(Admission::Queued(p)) = e.admit(16) else {
            panic!("p")
        };
        assert!(matches!(e.admit(16), Err(Refusal::QueueFull)));
        drop(p);
        assert_eq!(e.snapshot().waiting, 0);
        drop(a);
        assert_eq!(e.snapshot().running, 0);
    }
}
