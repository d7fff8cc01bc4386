//! The reference cost policy, written in the harness (scenarios 24 and 27): each
//! engine's cache as the blocks sent to it (LRU at its capacity), and the uncached prompt
//! tokens sent there that have not had their first token; a request goes where its own
//! uncached tokens plus those are least. Also the limit every placement is measured
//! against: the prompt tokens an infinite prefix cache shared by every engine computes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http::{header, Method};
use http_body_util::{BodyExt, Full};
use serde_json::Value;

use crate::phased::{checkout, Idle};
use crate::prefix_fleet::{tokenizer_dir, Got};

/// The engines' KV block, in tokens.
pub(crate) const ENGINE_BLOCK: usize = 16;

pub(crate) struct Reference {
    pub(crate) engines: Vec<ReferenceEngine>,
    /// Blocks an engine's cache holds.
    capacity: usize,
    /// Counts the requests placed (the caches' clock).
    placed: u64,
}

#[derive(Default)]
pub(crate) struct ReferenceEngine {
    /// Block id → when it was last sent; and the reverse, oldest first.
    pub(crate) last_sent: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    pub(crate) outstanding: u64,
}

impl Reference {
    pub(crate) fn new(engines: usize, capacity: usize) -> Self {
        Reference {
            engines: (0..engines).map(|_| ReferenceEngine::default()).collect(),
            capacity,
            placed: 0,
        }
    }

    /// The engine for a prompt of `tokens` made of `blocks` of `block` tokens, the first
    /// `full` of them whole (only those can be cached), and its uncached tokens there;
    /// counts them as outstanding and the blocks as cached there.
    pub(crate) fn place(
        &mut self,
        blocks: &[u64],
        full: usize,
        tokens: u64,
        block: u64,
    ) -> (usize, u64) {
        let full = full.min(blocks.len());
        let uncached = |e: &ReferenceEngine| {
            let hits = blocks[..full]
                .iter()
                .take_while(|id| e.last_sent.contains_key(id))
                .count() as u64;
            tokens.saturating_sub(hits * block)
        };
        let (index, cost) = self
            .engines
            .iter()
            .enumerate()
            .map(|(i, e)| (i, uncached(e)))
            .min_by_key(|(i, u)| (u + self.engines[*i].outstanding, *i))
            .unwrap_or((0, tokens));
        let (capacity, clock) = (self.capacity, self.placed);
        self.placed += 1;
        let engine = &mut self.engines[index];
        engine.outstanding += cost;
        for (k, id) in blocks.iter().enumerate() {
            let stamp = clock * 1_000_000 + k as u64;
            if let Some(old) = engine.last_sent.insert(*id, stamp) {
                engine.by_age.remove(&old);
            }
            engine.by_age.insert(stamp, *id);
        }
        while engine.last_sent.len() > capacity {
            let Some((_, oldest)) = engine.by_age.pop_first() else {
                break;
            };
            engine.last_sent.remove(&oldest);
        }
        (index, cost)
    }

    /// The request placed on `engine` with `uncached` tokens had its first token.
    pub(crate) fn first_token(&mut self, engine: usize, uncached: u64) {
        if let Some(e) = self.engines.get_mut(engine) {
            e.outstanding = e.outstanding.saturating_sub(uncached);
        }
    }
}

/// The engines' tokenizer, and their blocks' keys, for the harness to see prompts as the
/// engines do.
pub(crate) struct EngineTokens(sluice_tokenizer::PromptTokenizer);

impl EngineTokens {
    pub(crate) fn load() -> Result<Self> {
        sluice_tokenizer::PromptTokenizer::load(&tokenizer_dir())
            .map(EngineTokens)
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// A chat body's prompt tokens as the engines count them, and the keys of its whole
    /// 16-token blocks.
    pub(crate) fn blocks(&self, body: &Value) -> Result<(u64, Vec<u64>)> {
        let ids = self
            .0
            .chat(&serde_json::to_vec(body)?)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let keys = sluice_pools::prefix_index::block_keys(&ids, ENGINE_BLOCK, None, None);
        Ok((ids.len() as u64, keys))
    }
}

/// The prompt tokens an infinite prefix cache shared by every engine computes for `bodies`
/// (in the order sent), in the engines' own tokens: each request's chat prompt tokenized as
/// the engines do, its leading 16-token blocks already seen by any earlier request served,
/// the rest computed.
pub(crate) fn limit_engine_tokens<'a>(bodies: impl IntoIterator<Item = &'a Value>) -> Result<u64> {
    let tokens = EngineTokens::load()?;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut total = 0u64;
    for body in bodies {
        let (len, keys) = tokens.blocks(body)?;
        let hits = keys.iter().take_while(|k| seen.contains(k)).count();
        total += len - (hits * ENGINE_BLOCK) as u64;
        seen.extend(keys);
    }
    Ok(total)
}

/// One request straight to an engine, calling `first` at its first chunk (a stream's first
/// event; a whole answer's first bytes). Returns the answer's bytes.
pub(crate) async fn send_direct(
    addr: SocketAddr,
    idle: &Idle,
    body: &Value,
    stream: bool,
    got: &mut Got,
    first: impl FnOnce(),
) -> Result<Vec<u8>> {
    let sent = Instant::now();
    let mut sender = checkout(idle, addr).await?;
    let req = http::Request::builder()
        .method(Method::POST)
        .uri(crate::scenarios::CHAT)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))
        .context("building the request")?;
    let resp = sender.send_request(req).await.context("sending")?;
    let status = resp.status();
    got.status = Some(status.as_u16());
    let mut answer = resp.into_body();
    let mut first = Some(first);
    let mut all = Vec::new();
    while let Some(frame) = answer.frame().await {
        let Ok(data) = frame.context("reading the answer")?.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if let Some(first) = first.take() {
            got.ttft = Some(sent.elapsed());
            first();
        }
        all.extend_from_slice(&data);
    }
    idle.lock().await.push(sender);
    if !status.is_success() {
        bail!("HTTP {status}");
    }
    if stream && !all.windows(12).any(|w| w == b"data: [DONE]") {
        bail!("the stream ended without data: [DONE]");
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_goes_where_the_uncached_and_the_outstanding_are_least() {
        let block = 128;
        let mut policy = Reference::new(2, 4);
        let (first, cost) = policy.place(&[1, 2, 3, 4], 3, 4 * block, block);
        assert_eq!((first, cost), (0, 4 * block));
        policy.first_token(0, 4 * block);
        assert_eq!(policy.engines[0].outstanding, 0);
        // Its continuation goes where its first four blocks are (the fourth was partial
        // then, whole now).
        let (next, cost) = policy.place(&[1, 2, 3, 4, 5, 6], 5, 6 * block, block);
        assert_eq!((next, cost), (0, 2 * block));
        // Another conversation: where less is outstanding.
        let (other, cost) = policy.place(&[9, 10], 1, 2 * block, block);
        assert_eq!((other, cost), (1, 2 * block));
        // The cache holds 4 blocks: the oldest are forgotten.
        assert_eq!(policy.engines[0].last_sent.len(), 4);
        assert!(!policy.engines[0].last_sent.contains_key(&1));
    }
}
