//! Keeping the last request's KV cache for the next request that starts with the same tokens:
//! llama.cpp server's `cache_prompt`, for a client that sends a growing conversation or asks
//! several questions about one long document.

use std::time::Instant;

use keydiff_cache::KvCache;

use crate::engine::{Engine, Event, GenerateParams, Output};
use crate::error::{EngineError, Result};

/// The KV cache of the last request run through [`Engine::generate_cached`], and the tokens it
/// holds.
#[derive(Default)]
pub struct PromptCache {
    tokens: Vec<u32>,
    cache: Option<KvCache>,
}

impl PromptCache {
    /// An empty prompt cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The tokens held (the last prompt and what was generated after it, as far as they were
    /// fed to the model).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes of the KV buffers held (0 when empty).
    pub fn bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::bytes)
    }

    /// Frees the cache.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.cache = None;
    }
}

impl Engine {
    /// [`Engine::generate`], starting from the cache of the previous request run through `pc`
    /// where that gives what a fresh prefill gives, and keeping this request's cache in `pc`
    /// for the next one. `stats.prefix_tokens` says how many prompt tokens were reused.
    ///
    /// Reused: the longest common prefix of the held tokens and the new prompt, rounded down to
    /// a whole number of chunks (so that the rest is prefilled in the chunks a fresh prefill
    /// would use), leaving at least one token to prefill, and only while no eviction would have
    /// happened in it: the held cache never evicted, and under a budget N the reused prefix is
    /// at most N. H2O (whose attention sums include later tokens) never reuses. The reused
    /// tokens' K/V may differ from a fresh prefill's by float rounding where they were made by
    /// decode steps (the reply of a previous turn); tested: greedy output equal.
    pub fn generate_cached(
        &self,
        params: &GenerateParams,
        pc: &mut PromptCache,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Output> {
        params.sampling.validate().map_err(EngineError::BadParams)?;
        let t0 = Instant::now();
        let context = self.model_config().max_position_embeddings;
        let prompt = self.prompt_tokens(&params.prompt)?;
        let n = prompt.len();
        if n > context {
            return Err(EngineError::PromptTooLong { tokens: n, context });
        }
        let need = n.saturating_add(params.max_tokens).min(context);
        let cfg = self.config().cache.clone();
        let reuse = self.reusable(pc, &prompt);
        let held = pc.cache.take();
        pc.tokens.clear();
        let (mut cache, start) = match held {
            Some(mut c) if reuse > 0 => {
                c.truncate(reuse)?;
                if c.capacity() >= cfg.slots_for(need) {
                    (c, reuse)
                } else {
                    let mut bigger = self.alloc_cache(cfg, need)?;
                    bigger.resume_from(&c)?;
                    (bigger, reuse)
                }
            }
            held => {
                // Freed before the new cache is allocated.
                drop(held);
                (self.new_cache(need)?, 0)
            }
        };
        let (out, _) = self.run_request(&mut cache, &prompt, start, params, t0, &mut on_event)?;
        if cache.can_truncate() {
            let fed = cache.position();
            pc.tokens = prompt
                .iter()
                .chain(&out.tokens)
                .take(fed)
                .copied()
                .collect();
            pc.cache = Some(cache);
        }
        Ok(out)
    }

    /// Prompt tokens of `prompt` that `pc`'s cache can stand in for (see
    /// [`Engine::generate_cached`]).
    fn reusable(&self, pc: &PromptCache, prompt: &[u32]) -> usize {
        let Some(c) = &pc.cache else {
            return 0;
        };
        let cfg = &self.config().cache;
        if !c.can_truncate() || c.config() != cfg {
            return 0;
        }
        let common = pc
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let mut r = common.min(prompt.len() - 1);
        if let Some(budget) = cfg.budget {
            r = r.min(budget);
        }
        r - r % cfg.chunk
    }
}
