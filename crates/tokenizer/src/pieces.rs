//! Tokenizing a rendered chat piece by piece, with the pieces remembered.
//!
//! A Hugging Face tokenizer first splits its input at its added tokens (`<|im_start|>`,
//! `<|eot_id|>`...), and tokenizes each text between them on its own. A chat template writes
//! such a token at every message's start, so a conversation's next turn, an agent's next call
//! or a RAG prompt over known documents is mostly pieces tokenized before: the system prompt,
//! the tool list, the history. Those are looked up by their text's hash instead of being
//! tokenized again.
//!
//! Exact only when the split is plain: every added token matched as written (not normalized,
//! no `lstrip`/`rstrip`/`single_word`), leftmost-longest as the tokenizer matches them. A
//! tokenizer whose added tokens are not all plain is not split here (each text is tokenized
//! whole).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

/// Pieces shorter than this are tokenized each time: cheap, and not worth a cache slot.
const MIN_CACHED_BYTES: usize = 256;

/// The most token ids the cache keeps, over all its pieces (4 bytes each: 16 MB).
const MAX_CACHED_TOKENS: usize = 4 << 20;

/// The added tokens, to split at, and the pieces between them seen lately.
pub(crate) struct Pieces {
    matcher: AhoCorasick,
    ids: Vec<u32>,
    cache: Mutex<Cache>,
    hasher: RandomState,
}

#[derive(Default)]
struct Cache {
    by_hash: HashMap<u64, Arc<[u32]>>,
    /// Insertion order, for eviction (first in, first out).
    order: VecDeque<u64>,
    tokens: usize,
}

impl Pieces {
    /// The splitter of `tokenizer`, if its added tokens can be split at exactly.
    pub(crate) fn of(tokenizer: &tokenizers::Tokenizer) -> Option<Pieces> {
        let added = tokenizer.get_added_tokens_decoder();
        if added.is_empty()
            || added
                .values()
                .any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word)
        {
            return None;
        }
        let (ids, contents): (Vec<u32>, Vec<String>) = added
            .into_iter()
            .map(|(id, token)| (id, token.content))
            .unzip();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&contents)
            .ok()?;
        Some(Pieces {
            matcher,
            ids,
            cache: Mutex::new(Cache::default()),
            hasher: RandomState::new(),
        })
    }

    /// The ids of `text` (no special tokens added): the added tokens in it as they are, the
    /// texts between them through `encode`, or the cache.
    pub(crate) fn encode<E>(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        let mut ids = Vec::new();
        let mut from = 0;
        for found in self.matcher.find_iter(text) {
            self.piece(&text[from..found.start()], &encode, &mut ids)?;
            if let Some(id) = self.ids.get(found.pattern().as_usize()) {
                ids.push(*id);
            }
            from = found.end();
        }
        self.piece(&text[from..], &encode, &mut ids)?;
        Ok(ids)
    }

    fn piece<E>(
        &self,
        piece: &str,
        encode: &impl Fn(&str) -> Result<Vec<u32>, E>,
        ids: &mut Vec<u32>,
    ) -> Result<(), E> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_CACHED_BYTES {
            ids.extend(encode(piece)?);
            return Ok(());
        }
        let hash = self.hasher.hash_one(piece);
        let known = self.lock().by_hash.get(&hash).cloned();
        match known {
            Some(known) => ids.extend_from_slice(&known),
            None => {
                let made: Arc<[u32]> = encode(piece)?.into();
                ids.extend_from_slice(&made);
                self.remember(hash, made);
            }
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn remember(&self, hash: u64, ids: Arc<[u32]>) {
        if ids.len() > MAX_CACHED_TOKENS / 4 {
            return;
        }
        let mut cache = self.lock();
        cache.tokens += ids.len();
        match cache.by_hash.insert(hash, ids) {
            // Two requests made the same piece at once: counted once.
            Some(same) => cache.tokens = cache.tokens.saturating_sub(same.len()),
            None => cache.order.push_back(hash),
        }
        while cache.tokens > MAX_CACHED_TOKENS {
            let Some(oldest) = cache.order.pop_front() else {
                break;
            };
            if let Some(gone) = cache.by_hash.remove(&oldest) {
                cache.tokens = cache.tokens.saturating_sub(gone.len());
            }
        }
    }

    /// Pieces remembered now.
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.lock().by_hash.len()
    }
}
