//! Several requests decoded together.
//!
//! Every running request's next token goes through the model in one pass
//! ([`keydiff_model::Model::forward_segments`]): the linears and the LM head read their
//! weights once for all of them, which is what bounds a decode step (memory bandwidth), while
//! attention and eviction run per request on its own cache. Requests join between steps and
//! leave when they end (continuous batching): [`Batch`]. [`Engine::generate_batch`] runs a
//! list of requests to the end.
//!
//! A joining request's prompt is prefilled in chunks of B, evicting under its own KV budget as
//! a single request does. With [`Batch::join`] its chunks run in the batch's steps, beside the
//! running requests' tokens (chunked prefill mixed with decode, as llama.cpp's server and
//! vLLM do): a long prompt delays the others' next tokens by a chunk per step, not by its
//! whole prefill. [`Batch::set_prefill_tokens`] sets how many prompt tokens a step takes (one
//! chunk by default). [`Batch::add`] prefills a request at once, the others waiting.
//! [`Batch::keep_prompts`] keeps ended requests' caches, and a request that joins starts from
//! the one that holds most of its prompt (a server's prompt cache, one per slot).
//! [`Batch::join_n`] joins several completions of one prompt, prefilled once
//! ([`Engine::generate_n`]).
//!
//! A request's tokens and text are the ones it gets alone (its sampler, penalties, seed, stop
//! strings, logprobs and cancel are its own), up to the difference between a matmul over one
//! row and over several: none for kernels that compute each row alike (candle's CPU Q8_0, so
//! SmolLM2's decode copies: tested bit for bit), the last bits for dense f32 GEMMs, and more
//! where candle picks another kernel for several rows (its CPU Q6K on x86 repacks the weights
//! and quantizes the activations otherwise: up to 0.33 in one of Qwen's logits). Sampled text
//! can then diverge where two tokens are close. On the CPU each prompt chunk takes its linears
//! alone (see `forward_segments`), so it is computed as in a single request, bit for bit.

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::Tensor;
use keydiff_cache::KvCache;
use keydiff_model::{Logits, Segment};

use crate::engine::{Decoding, Pick, Prefill};
use crate::error::{EngineError, Result};
use crate::prompt_cache::{logits_to_keep, Resumed};
use crate::sampling::DrawParams;
use crate::{Engine, Event, GenerateParams, Output, PromptCache, Reuse};

/// Requests being decoded together on one engine (see the module docs). Ids are the
/// caller's, to route events and outputs.
pub struct Batch<'e> {
    engine: &'e Engine,
    /// Requests whose prompts are being prefilled in the steps, in the order they joined.
    joining: VecDeque<Joining<'e>>,
    running: Vec<Running<'e>>,
    /// Prompt tokens a step takes from the joining requests.
    prefill_tokens: usize,
    /// Ended requests' caches kept for later ones ([`Batch::keep_prompts`]).
    kept: Option<Kept>,
    /// Bytes held outside the batch that a configured memory limit must count
    /// ([`Batch::hold_outside`]).
    outside: u64,
}

/// Ended requests' caches, most recently used first, at most `slots`.
struct Kept {
    reuse: Reuse,
    slots: usize,
    caches: VecDeque<PromptCache>,
}

/// What a request leaves for later ones when the batch keeps caches: its tokens and text
/// (see `PromptCache::store`).
struct Keep {
    prompt: Vec<u32>,
    text: Option<String>,
    /// The logits the whole prompt left (set when its prefill ends).
    logits: Option<Tensor>,
    /// It goes on from a conversation's held cache (see `Resumed::continued`).
    continued: bool,
}

/// A request whose prompt is being prefilled in the batch's steps.
struct Joining<'e> {
    id: u64,
    /// The ids of its other completions ([`Batch::join_n`]): each goes on from a fork of the
    /// prompt's cache once the prefill ends.
    forks: Vec<u64>,
    cache: KvCache,
    prefill: Prefill<'e>,
    keep: Option<Keep>,
}

/// A running request: its cache, its state, and the token it feeds next.
struct Running<'e> {
    id: u64,
    cache: KvCache,
    decoding: Decoding<'e>,
    next: u32,
    /// This step's tokens: `next`, and its speculative draft when the request has one.
    fed: Vec<u32>,
    keep: Option<Keep>,
}

/// What a step returns: the requests that ended, with their ids, each with its output or the
/// error that ended it alone.
pub type Ended = Vec<(u64, Result<Output>)>;

impl Engine {
    /// An empty batch on this engine; a step takes one chunk (B tokens) of prompt.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            engine: self,
            joining: VecDeque::new(),
            running: Vec::new(),
            prefill_tokens: self.config().cache.chunk,
            kept: None,
            outside: 0,
        }
    }

    /// Runs `requests` to their ends, decoding them together: they join at once, their
    /// prompts are prefilled a chunk per step beside the running requests' tokens (a
    /// profiled request is prefilled alone first, see [`Batch::join`]), and each runs until
    /// it ends. `on_event` gets each request's events with its index. A request refused or
    /// failed on its own (an empty or too long prompt, a cache that does not fit in memory
    /// beside the others', bad parameters, a failed sample) gets its error in its place; the
    /// others run. The outer error is a failed model pass, which ends them all.
    pub fn generate_batch(
        &self,
        requests: &[GenerateParams],
        mut on_event: impl FnMut(usize, Event<'_>),
    ) -> Result<Vec<Result<Output>>> {
        let mut outputs: Vec<Option<Result<Output>>> = requests.iter().map(|_| None).collect();
        let mut batch = self.batch();
        for (i, params) in requests.iter().enumerate() {
            let joined = if params.profile {
                batch.add(i as u64, params, |e| on_event(i, e))
            } else {
                batch.join(i as u64, params).map(|()| None)
            };
            match joined {
                Ok(Some(out)) => outputs[i] = Some(Ok(out)),
                Ok(None) => {}
                Err(e) => outputs[i] = Some(Err(e)),
            }
        }
        run_out(batch, outputs, on_event)
    }
}

impl Engine {
    /// `n` completions of one prompt (OpenAI's `n`): the prompt is prefilled once, and the
    /// completions decode together, each from its own copy of the prompt's cache, completion
    /// `i` sampling with the seed `params.sampling.seed + i` ([`Batch::join_n`]). `on_event`
    /// gets each completion's events with its index (the prefill's go to completion 0). A
    /// completion failed on its own (a failed sample) gets its error in its place; the outer
    /// error is a refused request (as [`Engine::generate`] refuses it, or `n` = 0, or copies
    /// that do not fit in memory) or a failed model pass.
    pub fn generate_n(
        &self,
        params: &GenerateParams,
        n: usize,
        on_event: impl FnMut(usize, Event<'_>),
    ) -> Result<Vec<Result<Output>>> {
        let ids: Vec<u64> = (0..n as u64).collect();
        let mut batch = self.batch();
        batch.join_n(&ids, params)?;
        run_out(batch, ids.iter().map(|_| None).collect(), on_event)
    }
}

/// Steps `batch`, whose ids are indices into `outputs`, until every request in it has ended;
/// each output goes to its place.
fn run_out(
    mut batch: Batch<'_>,
    mut outputs: Vec<Option<Result<Output>>>,
    mut on_event: impl FnMut(usize, Event<'_>),
) -> Result<Vec<Result<Output>>> {
    while !batch.is_empty() {
        for (id, out) in batch.step(|id, e| on_event(id as usize, e))? {
            outputs[id as usize] = Some(out);
        }
    }
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every request ends"))
        .collect())
}

impl<'e> Batch<'e> {
    /// Sequences in the batch: running, or joining (their prompts being prefilled; a request
    /// joined with several completions counts one per completion).
    pub fn len(&self) -> usize {
        let joining: usize = self.joining.iter().map(|j| 1 + j.forks.len()).sum();
        self.running.len() + joining
    }

    /// True when no request is running or joining.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Prompts still being prefilled.
    pub fn prefilling(&self) -> usize {
        self.joining.len()
    }

    /// The ids of the requests: the running ones in the order they started decoding, then the
    /// joining ones in the order they joined (with their other completions' ids).
    pub fn ids(&self) -> Vec<u64> {
        let running = self.running.iter().map(|r| r.id);
        let joining = self
            .joining
            .iter()
            .flat_map(|j| std::iter::once(j.id).chain(j.forks.iter().copied()));
        running.chain(joining).collect()
    }

    /// Bytes held by the requests' KV caches.
    pub fn cache_bytes(&self) -> usize {
        self.caches().map(KvCache::bytes).sum()
    }

    /// Sets how many prompt tokens a step takes from joining requests: a chunk (at most B)
    /// from each, in the order they joined, while they fit (one chunk always runs). More
    /// favours the joiners' time to first token, fewer the running requests' time between
    /// tokens (vLLM's `max_num_batched_tokens`, llama.cpp's `--batch-size`). At least 1.
    /// The activations of the rows beyond B are planned beside each joining request's cache.
    pub fn set_prefill_tokens(&mut self, tokens: usize) {
        self.prefill_tokens = tokens.max(1);
    }

    /// Keeps the KV caches of up to `slots` ended requests for later ones, as a server's
    /// prompt cache does (llama.cpp's `cache_prompt`, a cache per slot): a request that joins
    /// (or is added) starts from the kept cache that stands for most of its prompt, exactly as
    /// [`Engine::generate_cached`] starts from a [`PromptCache`] with this `reuse`, and
    /// `stats.prefix_tokens` says how many of its tokens it reused. That cache is the
    /// request's from then on; when it ends, its own cache is kept in turn. The least recently
    /// used kept cache goes first, when there are more than `slots` or when a joining
    /// request's cache would not fit in memory beside them. 0 (the default) keeps none.
    pub fn keep_prompts(&mut self, reuse: Reuse, slots: usize) {
        self.kept = (slots > 0).then(|| Kept {
            reuse,
            slots,
            caches: VecDeque::new(),
        });
    }

    /// Counts `bytes` that the caller holds outside the batch on this engine's device (a
    /// prompt cache of its own) beside the batch's caches, when the engine's memory is a
    /// configured limit: a measured budget sees them already.
    pub fn hold_outside(&mut self, bytes: u64) {
        self.outside = bytes;
    }

    /// The tokens each kept cache holds, most recently used first (see
    /// [`Batch::keep_prompts`]).
    pub fn kept_tokens(&self) -> Vec<usize> {
        self.kept
            .iter()
            .flat_map(|k| k.caches.iter().map(|pc| pc.tokens().len()))
            .collect()
    }

    /// How many caches the batch keeps at most (0: none; see [`Batch::keep_prompts`]).
    pub fn max_kept(&self) -> usize {
        self.kept.as_ref().map_or(0, |k| k.slots)
    }

    /// The kept cache at `i`, most recently used first (a server's slot `i`).
    pub fn kept_cache(&self, i: usize) -> Option<&PromptCache> {
        self.kept.as_ref()?.caches.get(i)
    }

    /// Keeps `pc` (a cache loaded from a file, say) as the most recently used, for later
    /// requests; beyond the slots, the least recently used goes. Refused when the batch keeps
    /// no caches, when `pc` holds none, when it reuses otherwise than the batch, or when
    /// another engine made it.
    pub fn keep_cache(&mut self, pc: PromptCache) -> Result<()> {
        self.engine.check_owner(pc.engine, "the prompt cache")?;
        let Some(k) = &mut self.kept else {
            return Err(EngineError::BadParams(
                "this batch keeps no prompt caches".into(),
            ));
        };
        if pc.is_empty() || pc.reuse() != k.reuse {
            return Err(EngineError::BadParams(format!(
                "a prompt cache to keep must hold a cache and reuse as the batch does ({:?})",
                k.reuse
            )));
        }
        k.caches.push_front(pc);
        k.caches.truncate(k.slots);
        Ok(())
    }

    /// Loads a saved prompt cache ([`Engine::load_prompt_cache`]) and keeps it as the most
    /// recently used (see [`Batch::keep_cache`]), planned beside the batch's caches: while it
    /// does not fit, the least recently used kept caches are freed first. The tokens it holds.
    pub fn restore(&mut self, path: &std::path::Path) -> Result<usize> {
        let Some(reuse) = self.kept.as_ref().map(|k| k.reuse) else {
            return Err(EngineError::BadParams(
                "this batch keeps no prompt caches".into(),
            ));
        };
        let pc = loop {
            match self
                .engine
                .load_prompt_cache_beside(path, reuse, self.held_bytes())
            {
                Err(EngineError::OutOfMemory(why)) => {
                    if self.free_oldest().is_none() {
                        return Err(EngineError::OutOfMemory(why));
                    }
                }
                r => break r?,
            }
        };
        let n = pc.tokens().len();
        self.keep_cache(pc)?;
        Ok(n)
    }

    /// Frees the kept cache at `i` (see [`Batch::kept_cache`]); the tokens it held.
    pub fn forget_kept(&mut self, i: usize) -> Option<usize> {
        let pc = self.kept.as_mut()?.caches.remove(i)?;
        Some(pc.tokens().len())
    }

    /// Bytes held by the kept caches.
    pub fn kept_bytes(&self) -> usize {
        self.kept
            .iter()
            .flat_map(|k| k.caches.iter().map(PromptCache::bytes))
            .sum()
    }

    fn caches(&self) -> impl Iterator<Item = &KvCache> {
        let running = self.running.iter().map(|r| &r.cache);
        running.chain(self.joining.iter().map(|j| &j.cache))
    }

    /// Bytes of the requests' caches that the memory budget does not see yet: all of them
    /// under a configured limit (it is not measured); under a measured budget on the CPU, the
    /// slots not written yet (a zeroed allocation's pages are mapped when first written, so
    /// `MemAvailable` counts them free until then; slots fill up to N + B under a budget);
    /// none on a GPU, whose allocations take their memory at once.
    /// Kept caches are seen under a measured budget (written, or never to be written while
    /// kept), and counted whole under a configured limit. The copies a joining request's other
    /// completions will take ([`Batch::join_n`]) count whole.
    fn unseen_bytes(&self) -> u64 {
        let e = self.engine;
        let kept = match e.config().memory_limit {
            Some(_) => self.kept_bytes() as u64 + self.outside,
            None => 0,
        };
        // The copies that joining requests' other completions will take when their prompts
        // end: not allocated yet.
        let forks: u64 = self
            .joining
            .iter()
            .map(|j| (j.forks.len() * j.cache.bytes()) as u64)
            .sum();
        let caches = self.caches();
        kept + forks
            + caches
                .map(|c| (c.bytes() as u64).saturating_sub(e.seen_bytes(c)))
                .sum::<u64>()
    }

    /// Bytes the batch takes beside a joining request's own plan (its cache and one chunk's
    /// activations): the caches of the others (see `unseen_bytes`), and the rows a step
    /// runs beyond one chunk: every other request's decode row with its logits, and the
    /// prompt rows beyond B that [`Batch::set_prefill_tokens`] lets a step take.
    fn held_bytes(&self) -> u64 {
        let e = self.engine;
        let m = e.model_config();
        let chunk = e.config().cache.chunk;
        let others = self.len() as u64;
        let rows = others + self.prefill_tokens.saturating_sub(chunk) as u64;
        let per_row = m.row_activation_bytes();
        // A decode row's logits: on the device, in the step's concatenation, on the host.
        let logits = 12 * others * m.vocab_size as u64;
        self.unseen_bytes() + rows * per_row + logits
    }

    fn check_new_ids(&self, ids: &[u64]) -> Result<()> {
        let held = self.ids();
        for (i, id) in ids.iter().enumerate() {
            if held.contains(id) || ids[..i].contains(id) {
                return Err(EngineError::BadParams(format!(
                    "request id {id} is already in this batch"
                )));
            }
        }
        Ok(())
    }

    /// Checks that `forks` copies of a joining request's `cache` fit in memory beside it and
    /// the batch, with a decode row each (its activations and logits).
    fn check_forks(&mut self, cache: &KvCache, forks: usize) -> Result<()> {
        let Some(more) = forks.checked_sub(1) else {
            return Ok(());
        };
        let e = self.engine;
        let m = e.model_config();
        let kv = cache.bytes() as u64;
        let rows = forks as u64 * (m.row_activation_bytes() + 12 * m.vocab_size as u64);
        let cfg = cache.config();
        loop {
            // The request's own cache, where the budget does not see it yet.
            let held = self.held_bytes() + kv.saturating_sub(e.seen_bytes(cache));
            match e.check_cache_memory_beside(cfg, cache.capacity(), more as u64 * kv + rows, held)
            {
                Ok(()) => return Ok(()),
                // Kept prompt caches give way, least recently used first.
                Err(EngineError::OutOfMemory(_)) if self.free_oldest().is_some() => {}
                Err(EngineError::OutOfMemory(why)) => {
                    return Err(EngineError::OutOfMemory(format!(
                        "{} completions of one prompt, a KV cache each: {why}",
                        forks + 1
                    )))
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// Prefills a request at once (its events go to `on_event`; the others wait) and samples
    /// its first token. It then runs with the others' steps, or, when that token already ends
    /// it, its output is returned here. Its KV cache is planned beside the others'. `id` must
    /// not be in the batch already.
    pub fn add(
        &mut self,
        id: u64,
        params: &GenerateParams,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Option<Output>> {
        let t0 = Instant::now();
        let e = self.engine;
        self.check_new_ids(&[id])?;
        let (prompt, mut cache, start, keep, logits) = self.admit(params)?;
        let p = Prefill::new(e, &mut cache, prompt, start, params.clone(), t0)?;
        let decoding = e.prefill(p.with_logits(logits), &mut cache, &mut on_event)?;
        self.start(id, cache, decoding, keep, &mut on_event)
    }

    /// Queues a request: its prompt is prefilled in the coming steps, a chunk per step beside
    /// the running requests' tokens ([`Batch::set_prefill_tokens`]), and its first token is
    /// sampled in the step that ends its prompt; its events and output come from
    /// [`Batch::step`]. Refused here: bad parameters, an empty or too long prompt, a KV cache
    /// that does not fit beside the others', an id already in the batch, and a profiled
    /// request (its breakdown times its own prefill: [`Batch::add`] it).
    pub fn join(&mut self, id: u64, params: &GenerateParams) -> Result<()> {
        self.join_n(&[id], params)
    }

    /// [`Batch::join`] for several completions of one prompt (OpenAI's `n`), one per id: the
    /// prompt is prefilled once, then each completion goes on from its own copy of the
    /// prompt's cache ([`KvCache::fork`]), evicted as it is, and decodes as a request of its
    /// own. Completion `i` samples with the seed `params.sampling.seed + i` (wrapping), so
    /// each is exactly the request it would be alone with that seed; with greedy sampling
    /// they are all the same. The prefill's events (progress, prompt logprobs) go to the
    /// first id. Refused here too: ids already in the batch or given twice, no ids, and
    /// copies that do not fit in memory beside the batch.
    pub fn join_n(&mut self, ids: &[u64], params: &GenerateParams) -> Result<()> {
        let t0 = Instant::now();
        let e = self.engine;
        let Some((&id, forks)) = ids.split_first() else {
            return Err(EngineError::BadParams(
                "a request needs at least one id".into(),
            ));
        };
        self.check_new_ids(ids)?;
        if params.profile {
            return Err(EngineError::BadParams(
                "a profiled request times its own prefill: add it to the batch with \
                 Batch::add, not Batch::join"
                    .into(),
            ));
        }
        let (prompt, mut cache, start, keep, logits) = self.admit(params)?;
        self.check_forks(&cache, forks.len())?;
        let prefill =
            Prefill::new(e, &mut cache, prompt, start, params.clone(), t0)?.with_logits(logits);
        self.joining.push_back(Joining {
            id,
            forks: forks.to_vec(),
            cache,
            prefill,
            keep,
        });
        Ok(())
    }

    /// A new request's prompt tokens, its cache (holding `prompt[..start]`), `start`, and what
    /// it keeps: from the kept cache that stands for most of its prompt, when the batch keeps
    /// caches: on a copy of its beginning when the cache also holds tokens the prompt goes
    /// another way from (the cache stays kept, for others), else taken over (the least
    /// recently used ones are freed while its cache does not fit).
    fn admit(&mut self, params: &GenerateParams) -> Result<Admitted> {
        let e = self.engine;
        if params.speculative.is_some_and(|s| s.exact) {
            return Err(EngineError::BadParams(
                "exact speculative decoding runs weights row by row where their kernels compute \
                 several rows otherwise; a batch runs all its rows through each weight at once \
                 (run it alone: Engine::generate, or serve --max-batch 1)"
                    .into(),
            ));
        }
        if self.kept.is_none() {
            let (prompt, cache) = e.request_cache(params, self.held_bytes())?;
            return Ok((prompt, cache, 0, None, None));
        }
        e.check_params(params)?;
        let prompt = self.prompt_for_kept(params)?;
        let best = self.best_index(params, prompt.as_ref())?;
        if let Some(r) = self.share_kept(params, prompt.as_ref(), best)? {
            return Ok(admitted(r));
        }
        // The best kept cache's place, while the list is as it was when it was found.
        let mut found = Some(best);
        // After a kept cache that was taken over could not hold the request: a fresh one.
        let mut fresh_only = false;
        loop {
            let (mut pc, from) = match &self.kept {
                Some(k) if fresh_only => (PromptCache::with_reuse(k.reuse), None),
                _ => {
                    let best = match found.take() {
                        Some(best) => best,
                        None => self.best_index(params, prompt.as_ref())?,
                    };
                    self.take_kept(best)
                }
            };
            let ids = prompt.as_ref().map(|(_, ids)| ids.as_slice());
            self.free_kept_for(params, ids.map(<[u32]>::len), pc.cache())?;
            match e.resume(params, &mut pc, self.held_bytes(), ids) {
                Ok(r) => {
                    if r.start > 0 && !self.fit_taken(&r.cache)? {
                        // It takes more than a fresh cache would (a kept cache can be larger
                        // than the request needs): dropped, and the request starts afresh.
                        drop(r);
                        fresh_only = true;
                        continue;
                    }
                    return Ok(admitted(r));
                }
                Err(err) => {
                    // Refused before it took the cache (a prompt beyond the context, a bad
                    // token): the cache stays kept, where it was.
                    if let (Some(k), Some(i), false) = (&mut self.kept, from, pc.is_empty()) {
                        k.caches.insert(i.min(k.caches.len()), pc);
                    }
                    let EngineError::OutOfMemory(why) = err else {
                        return Err(err);
                    };
                    if self.free_oldest().is_none() {
                        return Err(EngineError::OutOfMemory(why));
                    }
                    tracing::debug!("freed a kept prompt cache for a request: {why}");
                }
            }
        }
    }

    /// The prompt's text and tokens, to match with the kept caches (`None` when none is kept,
    /// or for prompt logprobs, which reuse nothing).
    fn prompt_for_kept(
        &self,
        params: &GenerateParams,
    ) -> Result<Option<(Option<String>, Vec<u32>)>> {
        let e = self.engine;
        if self.kept.as_ref().is_none_or(|k| k.caches.is_empty())
            || params.prompt_logprobs.is_some()
        {
            return Ok(None);
        }
        Ok(Some((
            e.prompt_text(&params.prompt)?,
            e.prompt_tokens(&params.prompt)?,
        )))
    }

    /// The request set up on a copy of the beginning of the kept cache at `best`, the one that
    /// stands for most of its prompt, which stays kept and becomes the most recently used (see
    /// `Engine::share_prefix`); `None` when that does not apply, or the copy does not fit.
    fn share_kept(
        &mut self,
        params: &GenerateParams,
        prompt: Option<&(Option<String>, Vec<u32>)>,
        best: Option<usize>,
    ) -> Result<Option<Resumed>> {
        let e = self.engine;
        let (Some((text, ids)), Some(i)) = (prompt, best) else {
            return Ok(None);
        };
        let held = self.held_bytes();
        let Some(k) = &mut self.kept else {
            return Ok(None);
        };
        match e.share_prefix(params, &k.caches[i], text.as_deref(), ids, held) {
            Ok(Some(r)) => {
                if let Some(pc) = k.caches.remove(i) {
                    k.caches.push_front(pc);
                }
                tracing::debug!("a request shares {} tokens of a kept prompt cache", r.start);
                Ok(Some(r))
            }
            Ok(None) | Err(EngineError::OutOfMemory(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Frees the least recently used kept cache; what that gives back to the memory budget
    /// (`None` when none is kept).
    fn free_oldest(&mut self) -> Option<u64> {
        let pc = self.kept.as_mut()?.caches.pop_back()?;
        Some(pc.cache().map_or(0, |c| self.engine.freed_bytes(c)))
    }

    /// Frees kept caches, the least recently used first, until `short` bytes are given back
    /// (or none is left).
    fn free_kept(&mut self, mut short: u64) {
        while short > 0 {
            match self.free_oldest() {
                None => break,
                Some(freed) => {
                    tracing::debug!("freed a kept prompt cache: a request needs its memory");
                    short = short.saturating_sub(freed);
                }
            }
        }
    }

    /// Whether a request fits on the kept cache it took over (its activations, and the part
    /// of the cache the budget does not see), after freeing the least recently used other
    /// kept caches while it would swap, or not fit at all.
    fn fit_taken(&mut self, cache: &KvCache) -> Result<bool> {
        let e = self.engine;
        let seen = e.seen_bytes(cache);
        let short = e.ram_shortfall(cache.config(), cache.capacity(), self.held_bytes(), seen);
        self.free_kept(short);
        loop {
            match e.check_taken_cache(cache, self.held_bytes()) {
                Ok(()) => return Ok(true),
                Err(EngineError::OutOfMemory(_)) => {
                    if self.free_oldest().is_none() {
                        return Ok(false);
                    }
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Frees kept caches, the least recently used first, while a fresh cache for the request
    /// would not fit in memory beside them without swapping: idle caches do not push the
    /// running requests into swap. The shortfall is measured once and the bytes freed are
    /// counted off it (the next measurement sees them too: it gives the heap's free pages back
    /// to the system first, `memory::release_freed_heap`).
    /// (A cache that would not fit at all is refused by the memory check, and `admit` frees
    /// kept caches then too.)
    /// `tokens`: the prompt's, when known. `taken`: the kept cache the request takes over, if
    /// any: nothing is freed when it can hold the request (no new cache is allocated), else
    /// it is copied into a fresh one, which the others make room for.
    fn free_kept_for(
        &mut self,
        params: &GenerateParams,
        tokens: Option<usize>,
        taken: Option<&KvCache>,
    ) -> Result<()> {
        let e = self.engine;
        let Some(reuse) = self.kept.as_ref().map(|k| k.reuse) else {
            return Ok(());
        };
        if self.kept.as_ref().is_some_and(|k| k.caches.is_empty()) {
            return Ok(());
        }
        let cfg = &e.config().cache;
        let n = match tokens {
            Some(n) => n,
            None => e.prompt_tokens(&params.prompt)?.len(),
        };
        // A prompt beyond the context is refused as such by `resume`; nothing to free for it.
        let Ok((need, alloc)) = e.request_slots(reuse, n, params) else {
            return Ok(());
        };
        if taken.is_some_and(|c| c.capacity() >= cfg.slots_for(need)) {
            return Ok(());
        }
        // While the taken cache is copied both exist: under a configured limit (which
        // measures nothing) it is counted, as `Engine::resume` counts it; a measured budget
        // sees it.
        let copied = match (taken, e.config().memory_limit) {
            (Some(c), Some(_)) => c.bytes() as u64,
            _ => 0,
        };
        let short = e.ram_shortfall(cfg, cfg.slots_for(alloc), self.held_bytes() + copied, 0);
        self.free_kept(short);
        Ok(())
    }

    /// Where the kept cache that would stand for most of the request's prompt is (the most
    /// recently used of equals), if any would. `prompt`: see `prompt_for_kept`.
    fn best_index(
        &self,
        params: &GenerateParams,
        prompt: Option<&(Option<String>, Vec<u32>)>,
    ) -> Result<Option<usize>> {
        let e = self.engine;
        let (Some(k), Some((text, ids))) = (&self.kept, prompt) else {
            return Ok(None);
        };
        let mut best = (0, None);
        for (i, pc) in k.caches.iter().enumerate() {
            // A cache the prompt cannot go on from (its continuation would not tokenize)
            // stands for nothing.
            let r = e.reuse_len(pc, params, text.as_deref(), ids).unwrap_or(0);
            if r > best.0 {
                best = (r, Some(i));
            }
        }
        Ok(best.1)
    }

    /// Takes out the kept cache at `best` (see `best_index`), with its place in the list, or
    /// gives an empty one when there is none.
    fn take_kept(&mut self, best: Option<usize>) -> (PromptCache, Option<usize>) {
        let Some(k) = &mut self.kept else {
            return (PromptCache::new(), None);
        };
        match best.and_then(|i| Some((k.caches.remove(i)?, i))) {
            Some((pc, i)) => (pc, Some(i)),
            None => (PromptCache::with_reuse(k.reuse), None),
        }
    }

    /// Keeps an ended request's cache for later ones, when the batch keeps caches and it can
    /// be reused.
    fn keep(&mut self, cache: KvCache, keep: Option<Keep>, out: &Output) {
        if let (
            Some(k),
            Some(Keep {
                prompt,
                text,
                logits,
                ..
            }),
        ) = (&mut self.kept, keep)
        {
            let mut pc = PromptCache::with_reuse(k.reuse);
            pc.store(cache, &prompt, text, out, logits.as_ref());
            if !pc.is_empty() {
                k.caches.push_front(pc);
                k.caches.truncate(k.slots);
            }
        }
    }

    /// Samples a prefilled request's first token: it runs, or its output is returned when that
    /// token ends it.
    fn start(
        &mut self,
        id: u64,
        cache: KvCache,
        mut decoding: Decoding<'e>,
        keep: Option<Keep>,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Option<Output>> {
        let keep = keep.map(|k| Keep {
            logits: logits_to_keep(decoding.prompt_logits(), k.continued, &cache),
            ..k
        });
        match decoding.next(cache.position(), on_event)? {
            Some(next) => {
                self.running.push(Running {
                    id,
                    cache,
                    decoding,
                    next,
                    fed: Vec::new(),
                    keep,
                });
                Ok(None)
            }
            None => {
                let out = decoding.finish(&cache, on_event).0;
                self.keep(cache, keep, &out);
                Ok(Some(out))
            }
        }
    }

    /// A joining request whose prefill ended (done, or cancelled): it starts decoding, or
    /// ends.
    fn prefilled(
        &mut self,
        j: Joining<'e>,
        on_event: &mut impl FnMut(u64, Event<'_>),
        ended: &mut Ended,
    ) {
        let Joining {
            id,
            forks,
            mut cache,
            prefill,
            keep,
        } = j;
        let mut events = |e: Event<'_>| on_event(id, e);
        let decoding = match prefill.finish(&mut cache, &mut events) {
            Ok(d) => d,
            Err(e) => {
                let why = e.to_string();
                ended.push((id, Err(e)));
                for f in forks {
                    ended.push((f, Err(EngineError::SharedPrefill(why.clone()))));
                }
                return;
            }
        };
        // The other completions, before the first samples: copies of the prompt's cache and
        // state, each with its seed.
        let seed = decoding.seed();
        let mut started = Vec::with_capacity(1 + forks.len());
        for (i, f) in forks.into_iter().enumerate() {
            match cache.fork() {
                Ok(c) => {
                    let d = decoding.fork(seed.wrapping_add(i as u64 + 1));
                    started.push((f, c, d, None));
                }
                Err(e) => ended.push((f, Err(e.into()))),
            }
        }
        started.insert(0, (id, cache, decoding, keep));
        for (id, cache, decoding, keep) in started {
            let mut events = |e: Event<'_>| on_event(id, e);
            match self.start(id, cache, decoding, keep, &mut events) {
                Ok(None) => {}
                Ok(Some(out)) => ended.push((id, Ok(out))),
                Err(e) => ended.push((id, Err(e))),
            }
        }
    }

    /// One step: every running request's next token, and the next prompt chunks of joining
    /// requests, go through the model together; then each running request samples its token
    /// after, and a request whose prompt this step ended samples its first token (it decodes
    /// from the next step on). Returns the requests that ended, with their ids: each with its
    /// output, or the error that ended it alone (a failed sample: the others go on). The
    /// outer error is a failed model pass, which ends the batch: its requests' caches are in
    /// an unknown state.
    pub fn step(&mut self, mut on_event: impl FnMut(u64, Event<'_>)) -> Result<Ended> {
        let mut ended = Vec::new();
        // This step's prompt chunks: one from each joiner in turn, within the token budget.
        // Each joiner's next chunk is read once: a cancel (another thread's) that lands later
        // is seen at the next step. Joiners cancelled before their next chunk leave now.
        let mut pieces = Vec::new();
        let mut budget = self.prefill_tokens;
        let mut full = false;
        for j in std::mem::take(&mut self.joining) {
            if full {
                self.joining.push_back(j);
                continue;
            }
            match j.prefill.piece(&j.cache) {
                None => self.prefilled(j, &mut on_event, &mut ended),
                Some(piece) if !pieces.is_empty() && piece.len() > budget => {
                    full = true;
                    self.joining.push_back(j);
                }
                Some(piece) => {
                    budget = budget.saturating_sub(piece.len());
                    let logits = j.prefill.logits(&piece);
                    pieces.push((piece, logits));
                    self.joining.push_back(j);
                }
            }
        }
        if self.running.is_empty() && pieces.is_empty() {
            return Ok(ended);
        }
        let started = Instant::now();
        let decoded = self.running.len();
        let passed = {
            let mut segments = Vec::with_capacity(decoded + pieces.len());
            let mut caches: Vec<&mut KvCache> = Vec::with_capacity(segments.capacity());
            for r in self.running.iter_mut() {
                r.fed = r.decoding.with_draft(r.next, &r.cache);
            }
            // A request fed one token has its token picked where the logits are when it can
            // (greedy requests' argmax in one launch, the device's draws in another, on a GPU);
            // the others read their rows.
            let picks: Vec<RowPick> = (self.running.iter_mut())
                .map(|r| match (r.fed.len(), r.decoding.pick()) {
                    (1, Pick::Greedy) => RowPick::Greedy,
                    (1, Pick::Device) => match r.decoding.draw_on_device() {
                        Some(p) => RowPick::Draw(p),
                        None => RowPick::Host,
                    },
                    _ => RowPick::Host,
                })
                .collect();
            for Running { cache, fed, .. } in self.running.iter_mut() {
                segments.push(Segment {
                    tokens: fed,
                    decode: true,
                    logits: match fed.len() {
                        1 => Logits::Last,
                        _ => Logits::All,
                    },
                });
                caches.push(cache);
            }
            for (Joining { cache, prefill, .. }, (piece, logits)) in
                self.joining.iter_mut().zip(&pieces)
            {
                segments.push(Segment {
                    tokens: &prefill.prompt[piece.clone()],
                    decode: false,
                    logits: *logits,
                });
                caches.push(cache);
            }
            self.engine
                .model()
                .forward_segments(&segments, &mut caches)
                .map_err(EngineError::from)
                .and_then(|mut out| {
                    let prompt_rows = out.split_off(decoded);
                    // Each running request's rows: one, or its token's and its draft's.
                    let rows = match out.into_iter().collect::<Option<Vec<_>>>() {
                        Some(rows) if rows.is_empty() => Vec::new(),
                        Some(rows) => decode_rows(&rows, &picks)?,
                        None => {
                            return Err(EngineError::Model(keydiff_model::ModelError::Shape(
                                "a decode row without logits".into(),
                            )))
                        }
                    };
                    Ok((rows, prompt_rows))
                })
        };
        let (rows, prompt_rows) = match passed {
            Ok(r) => r,
            Err(e) => {
                self.running.clear();
                self.joining.clear();
                return Err(e);
            }
        };
        // The joiners whose chunks ran; those whose prompts ended start (after the running
        // requests' samples below, so that they decode from the next step on).
        // Those still joining keep their places at the front (first come, first served).
        let mut prefilled = Vec::new();
        let taken: Vec<Joining<'e>> = self.joining.drain(..pieces.len()).collect();
        let mut kept = Vec::new();
        for (mut j, ((piece, _), logits)) in
            taken.into_iter().zip(pieces.into_iter().zip(prompt_rows))
        {
            let id = j.id;
            let mut events = |e: Event<'_>| on_event(id, e);
            match j.prefill.took(piece, logits, started, &mut events) {
                Err(e) => {
                    let why = e.to_string();
                    ended.push((id, Err(e)));
                    for &f in &j.forks {
                        ended.push((f, Err(EngineError::SharedPrefill(why.clone()))));
                    }
                }
                Ok(()) if j.prefill.is_done() => prefilled.push(j),
                Ok(()) => kept.push(j),
            }
        }
        for j in kept.into_iter().rev() {
            self.joining.push_front(j);
        }
        let mut still = Vec::with_capacity(self.running.len());
        for (mut r, rows) in std::mem::take(&mut self.running).into_iter().zip(rows) {
            let id = r.id;
            let mut events = |e: Event<'_>| on_event(id, e);
            let next = match (r.fed.len(), rows) {
                (1, Rows::Token(tok)) => {
                    r.decoding.fed_token(tok);
                    r.decoding.next(r.cache.position(), &mut events)
                }
                (1, Rows::Host(mut rows)) => match rows.pop() {
                    Some(row) => {
                        r.decoding.fed(row);
                        r.decoding.next(r.cache.position(), &mut events)
                    }
                    None => Err(EngineError::Model(keydiff_model::ModelError::Shape(
                        "a decode row without logits".into(),
                    ))),
                },
                (_, Rows::Host(rows)) => {
                    (r.decoding).verify(rows, &r.fed[1..], &mut r.cache, &mut events)
                }
                (_, Rows::Token(_)) => Err(EngineError::Model(keydiff_model::ModelError::Shape(
                    "a picked token for a token and its draft".into(),
                ))),
            };
            match next {
                Ok(Some(next)) => {
                    r.next = next;
                    still.push(r);
                }
                Ok(None) => {
                    let out = r.decoding.finish(&r.cache, &mut events).0;
                    self.keep(r.cache, r.keep, &out);
                    ended.push((id, Ok(out)));
                }
                Err(e) => ended.push((id, Err(e))),
            }
        }
        self.running = still;
        for j in prefilled {
            self.prefilled(j, &mut on_event, &mut ended);
        }
        Ok(ended)
    }
}

/// A running request's logits after a step: its rows on the host, or its token picked where
/// they are (the argmax, or the device's draw with its no-draw flag).
enum Rows {
    Host(Vec<Vec<f32>>),
    Token(u32),
}

/// How a running request's row is taken this step.
#[derive(Clone, Copy)]
enum RowPick {
    /// Its rows read to the host.
    Host,
    /// The argmax of its one row.
    Greedy,
    /// Its one row drawn from on the device with these parameters.
    Draw(DrawParams),
}

/// Each running request's logits from its `rows` (`[fed tokens, vocab]` each), as `picks`
/// says: one argmax launch over all the greedy rows, one launch of the device's draws, and one
/// read of the other rows, so that a step costs at most three small waits on the device. Rows
/// the device cannot draw from (`sample_rows` gives `None`) are read with the others.
fn decode_rows(rows: &[candle_core::Tensor], picks: &[RowPick]) -> Result<Vec<Rows>> {
    use candle_core::Tensor;
    let shape = |what: String| EngineError::Model(keydiff_model::ModelError::Shape(what));
    let (mut greedy, mut drawn, mut draws) = (Vec::new(), Vec::new(), Vec::new());
    for (t, p) in rows.iter().zip(picks) {
        match p {
            RowPick::Greedy | RowPick::Draw(_) if t.dim(0)? != 1 => {
                return Err(shape(format!(
                    "{} rows of logits for a request fed one token",
                    t.dim(0)?
                )))
            }
            RowPick::Greedy => greedy.push(t.clone()),
            RowPick::Draw(d) => {
                drawn.push(t.clone());
                draws.push(*d);
            }
            RowPick::Host => {}
        }
    }
    let mut greedy = match greedy.is_empty() {
        true => Vec::new(),
        false => keydiff_model::model::argmax_rows(&Tensor::cat(&greedy, 0)?)?,
    }
    .into_iter();
    let mut drawn = match drawn.is_empty() {
        true => Some(Vec::new()),
        false => keydiff_model::model::sample_rows(&Tensor::cat(&drawn, 0)?, &draws)?,
    }
    .map(|t| t.into_iter());
    let h: Vec<Tensor> = (rows.iter().zip(picks))
        .filter(|(_, p)| {
            matches!(p, RowPick::Host) || (drawn.is_none() && matches!(p, RowPick::Draw(_)))
        })
        .map(|(t, _)| t.clone())
        .collect();
    let mut host = match h.is_empty() {
        true => Vec::new(),
        false => Tensor::cat(&h, 0)?.to_vec2::<f32>()?,
    }
    .into_iter();
    let mut out = Vec::with_capacity(rows.len());
    for (t, p) in rows.iter().zip(picks) {
        let n = t.dim(0)?;
        let token = match (p, &mut drawn) {
            (RowPick::Greedy, _) => greedy.next(),
            (RowPick::Draw(_), Some(d)) => d.next(),
            _ => {
                out.push(Rows::Host(host.by_ref().take(n).collect()));
                continue;
            }
        };
        out.push(Rows::Token(token.ok_or_else(|| {
            shape("fewer picked tokens than rows to pick".into())
        })?));
    }
    Ok(out)
}

/// What `Batch::admit` gives for a request set up on a kept cache or a fresh one.
/// A request set up by `Batch::admit`: its prompt tokens, its cache (holding `prompt[..start]`),
/// `start`, what it keeps, and the logits its whole prompt left when the cache holds all of it.
type Admitted = (Vec<u32>, KvCache, usize, Option<Keep>, Option<Tensor>);

fn admitted(r: Resumed) -> Admitted {
    let Resumed {
        prompt,
        cache,
        start,
        text,
        keep,
        logits,
        continued,
    } = r;
    let keep = keep.then(|| Keep {
        prompt: prompt.clone(),
        text,
        logits: None,
        continued,
    });
    (prompt, cache, start, keep, logits)
}
