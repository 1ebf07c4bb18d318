//! Keeping the last request's KV cache for the next request that starts with the same tokens:
//! llama.cpp server's `cache_prompt`, for a client that sends a growing conversation or asks
//! several questions about one long document.

use std::time::Instant;

use candle_core::Tensor;
use keydiff_cache::KvCache;

use crate::engine::{Engine, Event, GenerateParams, Output, Prefill, Prompt, StopReason};
use crate::error::{EngineError, Result};

/// What a [`PromptCache`] may reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reuse {
    /// Only what gives exactly a fresh request's result: whole chunks of the common prefix,
    /// where no eviction would have happened.
    #[default]
    Exact,
    /// Also go on from the whole held cache, evicted or not, when the new prompt extends every
    /// token it holds: a conversation then runs as [`Engine::chat_turn`] runs it, each turn
    /// prefilling only what it adds, in N + B slots under a budget. Under a budget the answer
    /// differs from a fresh request on the whole conversation (whose prefill would evict at
    /// other points); it equals the turn of a [`crate::Conversation`]. Otherwise as `Exact`.
    Continue,
}

impl std::str::FromStr for Reuse {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "exact" => Ok(Self::Exact),
            "continue" => Ok(Self::Continue),
            other => Err(EngineError::BadParams(format!(
                "unknown prompt cache mode `{other}` (expected exact or continue)"
            ))),
        }
    }
}

/// The KV cache of the last request run through [`Engine::generate_cached`], and the tokens it
/// holds.
#[derive(Default)]
pub struct PromptCache {
    reuse: Reuse,
    /// Tokens fed to the cache.
    pub(crate) tokens: Vec<u32>,
    /// How many of them were the request's prompt (the rest it generated).
    pub(crate) prompt_len: usize,
    pub(crate) cache: Option<KvCache>,
    /// The text those tokens and `pending` stand for (the prompt's text or rendered chat,
    /// then the reply as sent), when known: a conversation is continued from the text, as
    /// [`Engine::chat_turn`] does, so that a reply that re-tokenizes differently still matches.
    pub(crate) text: Option<String>,
    /// Generated tokens the text includes but the cache was not fed (the last sampled one).
    pub(crate) pending: Vec<u32>,
    /// Keep the cache as the prompt left it, without the reply.
    pub(crate) prompt_only: bool,
    /// The engine whose requests made the cache ([`Engine::id`]).
    pub(crate) engine: Option<u64>,
    /// The logits after the prompt (`tokens[..prompt_len]`, `[vocab]`), when the cache can be
    /// put back to where the prompt left it (it is there, or it never evicted) and is what a
    /// fresh prefill of the prompt makes ([`logits_to_keep`]): the same prompt again then
    /// samples from them, with nothing to prefill, exactly as a fresh request.
    pub(crate) logits: Option<Tensor>,
}

impl PromptCache {
    /// An empty prompt cache that reuses only what gives a fresh request's result.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty prompt cache with the given reuse.
    pub fn with_reuse(reuse: Reuse) -> Self {
        Self {
            reuse,
            ..Self::default()
        }
    }

    /// Keeps only the prompt's part of a request's cache, not its reply (llama.cpp's
    /// `--prompt-cache` without `--prompt-cache-all`): the next request then goes on from the
    /// prompt, e.g. a document, whatever the reply was. An evicting cache is copied when its
    /// prompt is prefilled (its decode may evict further); one that never evicts is cut back
    /// when the request ends. Off by default.
    pub fn set_prompt_only(&mut self, on: bool) {
        self.prompt_only = on;
    }

    /// What it may reuse.
    pub fn reuse(&self) -> Reuse {
        self.reuse
    }

    /// The tokens held (the last prompt and what was generated after it, as far as they were
    /// fed to the model).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Slots per layer and KV head the held cache uses (0 when empty).
    pub fn slots(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::len)
    }

    /// Bytes of the KV buffers held (0 when empty).
    pub fn bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::bytes)
    }

    /// The cache held, if any.
    pub(crate) fn cache(&self) -> Option<&KvCache> {
        self.cache.as_ref()
    }

    /// True when it holds no cache.
    pub fn is_empty(&self) -> bool {
        self.cache.is_none()
    }

    /// Frees the cache.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.prompt_len = 0;
        self.cache = None;
        self.text = None;
        self.pending.clear();
        self.logits = None;
    }
}

/// A request set up on a [`PromptCache`]: its tokens, its cache (holding `prompt[..start]`),
/// and what to keep of it when it ends ([`PromptCache::store`]).
pub(crate) struct Resumed {
    pub(crate) prompt: Vec<u32>,
    pub(crate) cache: KvCache,
    pub(crate) start: usize,
    /// The prompt's text (a continued conversation goes on from it), when known.
    pub(crate) text: Option<String>,
    /// False for a request whose cache is not kept (prompt logprobs).
    pub(crate) keep: bool,
    /// The logits the whole prompt left, when the cache holds all of it (`start` is the
    /// prompt's length): the first token is sampled from them.
    pub(crate) logits: Option<Tensor>,
    /// The cache goes on from a conversation's held cache ([`Reuse::Continue`]): if it has
    /// evicted, it is not what a fresh prefill of the prompt makes, and the logits the
    /// prompt leaves are not kept (they stand for a fresh prefill's: [`PromptCache::logits`]).
    pub(crate) continued: bool,
}

/// The logits `d`'s prompt left, to keep with its cache: those of a cache that is what a
/// fresh prefill of the prompt makes (exactly, or, where it never evicted, up to float
/// rounding), not a continued conversation's evicted one.
pub(crate) fn logits_to_keep(
    logits: Option<&Tensor>,
    continued: bool,
    cache: &KvCache,
) -> Option<Tensor> {
    logits
        .filter(|_| !(continued && cache.counters().evictions > 0))
        .cloned()
}

impl PromptCache {
    /// Keeps `cache`, which `prompt` (with text `text`) and then `out` ran on, for the next
    /// request: when it can be reused at all (it never evicted, or it may be continued).
    /// `logits`: those the whole prompt left, kept when the cache can be cut back to it.
    pub(crate) fn store(
        &mut self,
        cache: KvCache,
        prompt: &[u32],
        text: Option<String>,
        out: &Output,
        logits: Option<&Tensor>,
    ) {
        self.clear();
        if self.reuse != Reuse::Continue && !cache.can_truncate() {
            return;
        }
        let n = prompt.len();
        let fed = cache.position();
        self.tokens = prompt
            .iter()
            .chain(&out.tokens)
            .take(fed)
            .copied()
            .collect();
        self.prompt_len = n.min(fed);
        if fed == n || (fed > n && cache.can_truncate()) {
            self.logits = logits.cloned();
        }
        // The reply as the client got it; after a stop string (or an indentation stop) it
        // lacks tokens the cache was fed, and a prompt cut short in prefill has no reply.
        let cut = matches!(
            out.stats.stop_reason,
            StopReason::StopString | StopReason::Indent
        );
        let whole = fed >= n && !cut;
        if let (Some(t), true) = (text, whole) {
            let mut pending = out.tokens[fed - n..].to_vec();
            if out.stats.stop_reason == StopReason::Eos {
                // The end-of-turn token is the template's text, which the next turn adds.
                pending.pop();
            }
            self.text = Some(format!("{t}{}", out.text));
            self.pending = pending;
        }
        self.cache = Some(cache);
    }
}

impl PromptCache {
    /// As [`PromptCache::store`], of a cache that holds (the beginning of) `prompt` only, as
    /// the prefill left it; with `logits` when it holds all of it. An evicted cache is kept
    /// for [`Reuse::Exact`] too when it holds the whole prompt with its logits: the same
    /// prompt again is then exactly what a fresh prefill would give.
    pub(crate) fn store_prompt(
        &mut self,
        cache: KvCache,
        prompt: &[u32],
        text: Option<String>,
        logits: Option<&Tensor>,
    ) {
        self.clear();
        let whole = cache.position() == prompt.len() && logits.is_some();
        if self.reuse != Reuse::Continue && !cache.can_truncate() && !whole {
            return;
        }
        let fed = cache.position().min(prompt.len());
        self.tokens = prompt[..fed].to_vec();
        self.prompt_len = fed;
        if fed == prompt.len() {
            self.text = text;
            self.logits = logits.cloned();
        }
        self.cache = Some(cache);
    }
}

impl Engine {
    /// [`Engine::generate`], starting from the cache of the previous request run through `pc`
    /// and keeping this request's cache in `pc` for the next one. `stats.prefix_tokens` says
    /// how many prompt tokens were reused.
    ///
    /// [`Reuse::Exact`] reuses the longest common prefix of the held tokens and the new prompt,
    /// rounded down to a whole number of chunks (so that the rest is prefilled in the chunks a
    /// fresh prefill would use), leaving at least one token to prefill, and only while no
    /// eviction would have happened in it: the held cache never evicted, and under a budget N
    /// the reused prefix is at most N. H2O (whose attention sums include later tokens) never
    /// reuses this way. The same prompt again (token for token) reuses all of it, evicted or
    /// not (H2O too), where the cache is as that prompt left it or can be cut back to it: the
    /// first token is sampled from the logits the prompt left, kept with the cache, and
    /// nothing is prefilled (llama.cpp and vLLM run the last prompt token again; an evicted
    /// cache could not). The reused tokens' K/V may differ from a fresh prefill's by float
    /// rounding where they were made by decode steps (the reply of a previous turn); tested:
    /// greedy output equal. [`Reuse::Continue`] also goes on from the whole held cache when the
    /// prompt extends all of it.
    pub fn generate_cached(
        &self,
        params: &GenerateParams,
        pc: &mut PromptCache,
        on_event: impl FnMut(Event<'_>),
    ) -> Result<Output> {
        let out = self.generate_cached_here(params, pc, on_event);
        // The kept cache (a copy, a cut) may still be being written (see [`Engine`]).
        self.settle()?;
        out
    }

    fn generate_cached_here(
        &self,
        params: &GenerateParams,
        pc: &mut PromptCache,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Output> {
        let t0 = Instant::now();
        let Resumed {
            prompt,
            mut cache,
            start,
            text,
            keep,
            logits,
            continued,
        } = self.resume(params, pc, 0, None)?;
        let p = Prefill::new(self, &mut cache, prompt.clone(), start, params.clone(), t0)?;
        let d = self.prefill(p.with_logits(logits), &mut cache, &mut on_event)?;
        let logits = logits_to_keep(d.prompt_logits(), continued, &cache);
        if !(keep && pc.prompt_only) {
            let (out, _) = self.decode_request(d, &mut cache, &mut on_event)?;
            if keep {
                pc.store(cache, &prompt, text, &out, logits.as_ref());
            }
            return Ok(out);
        }
        // The cache as the prompt left it: a budgeted one may evict while it decodes, so it
        // is copied now (N + B slots, beside it in memory), when it can be kept at all; one
        // that never evicts is cut back to the prompt afterwards. The copy is optional: where
        // it does not fit, the request runs and nothing is kept.
        enum Keep {
            Copy(Box<KvCache>),
            Cut,
            Nothing,
        }
        let keep = match cache.config().budget {
            None => Keep::Cut,
            // Under exact reuse an evicted cache is kept for the same prompt again only,
            // which needs the prompt's logits (none when a cancel cut the prefill short).
            Some(_) if pc.reuse != Reuse::Continue && !cache.can_truncate() && logits.is_none() => {
                Keep::Nothing
            }
            Some(_) => {
                let beside = if self.config().memory_limit.is_some() {
                    cache.bytes() as u64
                } else {
                    0
                };
                match self.check_cache_memory_beside(cache.config(), cache.capacity(), 0, beside) {
                    Ok(()) => Keep::Copy(Box::new(cache.fork()?)),
                    Err(EngineError::OutOfMemory(why)) => {
                        tracing::warn!("the prompt's cache is not kept: its copy {why}");
                        Keep::Nothing
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let (out, _) = self.decode_request(d, &mut cache, &mut on_event)?;
        match keep {
            Keep::Copy(c) => pc.store_prompt(*c, &prompt, text, logits.as_ref()),
            Keep::Cut => {
                cache.truncate(cache.position().min(prompt.len()))?;
                pc.store_prompt(cache, &prompt, text, logits.as_ref());
            }
            Keep::Nothing => pc.clear(),
        }
        Ok(out)
    }

    /// The prompt's text, when it has one (a chat is rendered).
    pub(crate) fn prompt_text(&self, prompt: &Prompt) -> Result<Option<String>> {
        Ok(match prompt {
            Prompt::Text(t) => Some(t.clone()),
            Prompt::Chat(m) => Some(self.render_chat(m)?),
            Prompt::ChatTools {
                messages,
                tools,
                template_kwargs,
            } => Some(self.render_chat_with(messages, tools, template_kwargs)?),
            Prompt::Tokens(_) | Prompt::Infill { .. } => None,
        })
    }

    /// How many tokens of the request on `prompt` (text `text`, tokens `ids`) `pc`'s cache
    /// would stand for: what [`Engine::resume`] reuses (0 for prompt logprobs).
    pub(crate) fn reuse_len(
        &self,
        pc: &PromptCache,
        params: &GenerateParams,
        text: Option<&str>,
        ids: &[u32],
    ) -> Result<usize> {
        if params.prompt_logprobs.is_some() {
            return Ok(0);
        }
        let (prompt, go_on) = self.continuation(pc, &params.prompt, text, Some(ids))?;
        Ok(if go_on > 0 {
            go_on
        } else {
            self.reusable(pc, &prompt)
        })
    }

    /// Sets a request up on `pc` (see [`Engine::generate_cached`]): checks it, takes `pc`'s
    /// cache (`pc` is left empty) and reuses what it may, else allocates a fresh cache, beside
    /// `held` bytes that the memory budget does not see (a batch's other caches). `ids`: the
    /// prompt's tokens, when known.
    pub(crate) fn resume(
        &self,
        params: &GenerateParams,
        pc: &mut PromptCache,
        held: u64,
        ids: Option<&[u32]>,
    ) -> Result<Resumed> {
        self.check_params(params)?;
        if pc.cache.is_some() {
            self.check_owner(pc.engine, "the prompt cache")?;
        }
        // What this request leaves in it is this engine's.
        pc.engine = Some(self.id());
        let context = self.model_config().context();
        if params.prompt_logprobs.is_some() {
            // Every prompt row's logits are needed, so nothing can be reused; the request
            // runs afresh and the next one finds no cache (freed first, as below: the new
            // cache may need its memory). A prompt refused outright keeps the cache.
            self.within_context(self.prompt_tokens(&params.prompt)?.len())?;
            pc.clear();
            let (prompt, cache) = self.request_cache(params, held)?;
            return Ok(Resumed {
                prompt,
                cache,
                start: 0,
                text: None,
                keep: false,
                logits: None,
                continued: false,
            });
        }
        let text = self.prompt_text(&params.prompt)?;
        // Continuing a conversation: the held tokens, then what the text adds.
        let (prompt, go_on) = self.continuation(pc, &params.prompt, text.as_deref(), ids)?;
        let (need, alloc) = self.request_slots(pc.reuse, prompt.len(), params)?;
        let cfg = self.config().cache.clone();
        let reuse = if go_on > 0 {
            0
        } else {
            self.reusable(pc, &prompt)
        };
        // The same prompt again: its cache as the prompt left it, and the logits it left.
        let whole = reuse == prompt.len();
        let logits = pc.logits.take().filter(|_| whole);
        let held_cache = pc.cache.take();
        pc.clear();
        let fresh = || self.alloc_cache_beside(cfg.clone(), alloc, held);
        // While a held cache is copied into a bigger one both exist: under a configured limit
        // (which measures nothing) the old one is counted; a measured budget sees it.
        let configured = self.config().memory_limit.is_some();
        let beside = |c: &KvCache| held + if configured { c.bytes() as u64 } else { 0 };
        let (cache, start) = match held_cache {
            Some(c) if go_on > 0 && c.capacity() >= cfg.slots_for(need) => (c, go_on),
            Some(c) if go_on > 0 => {
                // Only a cache without a budget is short here: it grows, as a chat's does.
                // The copy briefly needs both; when that does not fit, the prompt is
                // prefilled afresh in the memory the old cache held.
                let grown = need.max(2 * c.capacity()).min(context);
                match self.check_cache_memory_beside(&cfg, grown, 0, beside(&c)) {
                    Ok(()) => (c.grown(grown)?, go_on),
                    Err(EngineError::OutOfMemory(_)) => {
                        drop(c);
                        (fresh()?, 0)
                    }
                    Err(e) => return Err(e),
                }
            }
            Some(mut c) if reuse > 0 => {
                // (A cache kept where the prompt left it may have evicted: it is not cut.)
                if c.position() != reuse {
                    c.truncate(reuse)?;
                }
                if c.capacity() >= cfg.slots_for(need) {
                    (c, reuse)
                } else if whole {
                    // Too small for this request's output: a cache without a budget grows
                    // (where that fits), a budgeted one that has fewer than its N + B slots
                    // cannot, and the prompt is prefilled afresh.
                    let grown = need.min(context);
                    let fits = cfg.budget.is_none()
                        && match self.check_cache_memory_beside(&cfg, grown, 0, beside(&c)) {
                            Ok(()) => true,
                            Err(EngineError::OutOfMemory(_)) => false,
                            Err(e) => return Err(e),
                        };
                    if fits {
                        (c.grown(grown)?, reuse)
                    } else {
                        drop(c);
                        (fresh()?, 0)
                    }
                } else {
                    match self.alloc_cache_beside(cfg.clone(), alloc, beside(&c)) {
                        Ok(mut bigger) => {
                            bigger.resume_from(&c)?;
                            (bigger, reuse)
                        }
                        // As above: afresh, in the memory the old cache held.
                        Err(EngineError::OutOfMemory(_)) => {
                            drop(c);
                            (fresh()?, 0)
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            held_cache => {
                // Freed before the new cache is allocated.
                drop(held_cache);
                (fresh()?, 0)
            }
        };
        Ok(Resumed {
            logits: logits.filter(|_| start == prompt.len()),
            continued: go_on > 0 && start == go_on,
            prompt,
            cache,
            start,
            text,
            keep: true,
        })
    }

    /// Sets a request up on a fresh cache that starts with a copy of the beginning of `pc`'s
    /// cache, which `pc` keeps (a batch's kept cache, which other requests can then share):
    /// when `pc` stands for whole chunks of the prompt exactly (as [`Engine::resume`] would cut
    /// it back to), and the prompt goes another way than the earlier request's prompt (another
    /// question on the same document or system prompt), so that cutting the cache back would
    /// lose what others may reuse. A prompt that starts with all of the earlier prompt (a
    /// follow-up, the same prompt again) takes the cache over instead ([`Engine::resume`]), and
    /// so does a request for which a fresh cache would not fit in memory without swapping:
    /// taking one over needs no more memory, or, when it is too small for the request, frees
    /// it once it is copied into a bigger one (for which a batch frees its least recently used
    /// kept caches first). `None` when it does not apply. `text` and `ids`: the prompt's;
    /// `held`: as for [`Engine::resume`].
    pub(crate) fn share_prefix(
        &self,
        params: &GenerateParams,
        pc: &PromptCache,
        text: Option<&str>,
        ids: &[u32],
        held: u64,
    ) -> Result<Option<Resumed>> {
        let Some(src) = &pc.cache else {
            return Ok(None);
        };
        self.check_owner(pc.engine, "the prompt cache")?;
        if params.prompt_logprobs.is_some() {
            return Ok(None);
        }
        let (prompt, go_on) = self.continuation(pc, &params.prompt, text, Some(ids))?;
        let reuse = self.reusable(pc, &prompt);
        let common = common_prefix(&pc.tokens, &prompt);
        if go_on > 0 || reuse == 0 || common >= pc.prompt_len {
            return Ok(None);
        }
        let (_, alloc) = self.request_slots(pc.reuse, prompt.len(), params)?;
        let cfg = self.config().cache.clone();
        if self.ram_shortfall(&cfg, cfg.slots_for(alloc), held, 0) > 0 {
            return Ok(None);
        }
        let mut cache = self.alloc_cache_beside(cfg, alloc, held)?;
        cache.resume_from_prefix(src, reuse)?;
        Ok(Some(Resumed {
            prompt,
            cache,
            start: reuse,
            text: text.map(str::to_owned),
            keep: true,
            logits: None,
            continued: false,
        }))
    }

    /// The cache slots a request of `n` prompt tokens needs at most, and those to allocate for
    /// it: continuing needs a budgeted cache's N + B slots from the start, as a chat does (a
    /// shorter one could not hold the next turn, and a budgeted cache does not grow). A prompt
    /// beyond the context is refused.
    pub(crate) fn request_slots(
        &self,
        reuse: Reuse,
        n: usize,
        params: &GenerateParams,
    ) -> Result<(usize, usize)> {
        let context = self.within_context(n)?;
        let need = n.saturating_add(params.max_tokens).min(context);
        let alloc = match (reuse, self.config().cache.budget) {
            (Reuse::Continue, Some(_)) => context,
            _ => need,
        };
        Ok((need, alloc))
    }

    /// The request's tokens, and how many of them `pc` holds when it may go on from its whole
    /// cache (else 0). Going on needs a prompt that extends the held conversation: its text
    /// extends the held text (the added text is tokenized on its own, after the pending reply
    /// token, as [`Engine::chat_turn`] does; the tokens are then the held ones and those), or
    /// its tokens extend the held tokens. `ids` are the prompt's tokens when known (else they
    /// are made when needed).
    fn continuation(
        &self,
        pc: &PromptCache,
        prompt: &Prompt,
        text: Option<&str>,
        ids: Option<&[u32]>,
    ) -> Result<(Vec<u32>, usize)> {
        let held = pc.tokens.len();
        let can = held > 0
            && pc.reuse == Reuse::Continue
            && pc
                .cache
                .as_ref()
                .is_some_and(|c| c.config() == &self.config().cache);
        let mut fresh: Option<Vec<u32>> = None;
        if let (true, Some(t), Some(h)) = (can, text, &pc.text) {
            if let Some(delta) = t.strip_prefix(h.as_str()).filter(|d| !d.is_empty()) {
                let chat = matches!(prompt, Prompt::Chat(_) | Prompt::ChatTools { .. });
                let added = match chat {
                    true => self.tokenize_special(delta)?,
                    false => self.tokenize_continuation(delta)?,
                };
                // A plain prompt may extend the held text inside a word ("Ita" + "ly"): the
                // added text alone then tokenizes otherwise than in the whole prompt, and the
                // model would see words no fresh run sees (and answer otherwise). There it
                // goes on by text only where the whole prompt's tokens are the held ones
                // (or, after a held reply, read as the held text) and then the added text's;
                // else the tokens decide, below. At a word's edge (a space, a line break,
                // punctuation) it goes on by text, as a chat's turns do.
                let mid_word = !chat
                    && h.chars().last().is_some_and(char::is_alphanumeric)
                    && delta.chars().next().is_some_and(char::is_alphanumeric);
                let clean = !mid_word || {
                    let all = match ids {
                        Some(ids) => ids.to_vec(),
                        None => self.prompt_tokens(prompt)?,
                    };
                    let head = all.len().saturating_sub(added.len());
                    let before = &all[..head];
                    let ok = all.ends_with(&added)
                        && match pc.prompt_only {
                            true => {
                                before.len() == held + pc.pending.len()
                                    && before.starts_with(&pc.tokens)
                                    && before[held..] == pc.pending[..]
                            }
                            false => self.detokenize(before)? == *h,
                        };
                    fresh = Some(all);
                    ok
                };
                if clean {
                    let mut ids = pc.tokens.clone();
                    ids.extend(&pc.pending);
                    ids.extend(added);
                    self.check_vocab(&ids)?;
                    if ids.len() > held {
                        return Ok((ids, held));
                    }
                }
            }
        }
        let ids = match (fresh, ids) {
            (Some(f), _) => f,
            (None, Some(ids)) => ids.to_vec(),
            (None, None) => self.prompt_tokens(prompt)?,
        };
        let go_on = if can && ids.len() > held && ids.starts_with(&pc.tokens) {
            held
        } else {
            0
        };
        Ok((ids, go_on))
    }

    /// Prompt tokens of `prompt` that `pc`'s cache can stand in for exactly (see
    /// [`Engine::generate_cached`]).
    fn reusable(&self, pc: &PromptCache, prompt: &[u32]) -> usize {
        let Some(c) = &pc.cache else {
            return 0;
        };
        let cfg = &self.config().cache;
        if c.config() != cfg {
            return 0;
        }
        // The same prompt again, with the logits it left, where the cache is as the prompt
        // left it or can be put back there: all of it, with nothing to prefill (exactly a
        // fresh request's cache and logits, evicted or not).
        let n = prompt.len();
        if pc.logits.is_some()
            && pc.prompt_len == n
            && pc.tokens.starts_with(prompt)
            && (c.position() == n || c.can_truncate())
        {
            return n;
        }
        if !c.can_truncate() {
            return 0;
        }
        let mut r = common_prefix(&pc.tokens, prompt).min(prompt.len() - 1);
        if let Some(budget) = cfg.budget {
            r = r.min(budget);
        }
        r - r % cfg.chunk
    }
}

/// How many tokens `a` and `b` start with alike.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
