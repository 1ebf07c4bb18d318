//! All layers' caches of one request, the active policy, and when eviction runs.

use std::time::Instant;

use candle_core::{Device, Tensor};

use crate::config::{CacheConfig, PolicyKind};
use crate::layer::{LayerCache, LayerParts};
use crate::policy::{build, AttnStats, Policy, StatsNeed};
use crate::{CacheError, KvTypes, Result};

/// What eviction cost, summed over layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CacheCounters {
    /// Evictions performed (one per layer and eviction point).
    pub evictions: usize,
    /// Slots dropped, over layers and heads.
    pub evicted_slots: usize,
    /// Seconds spent scoring.
    pub score_s: f64,
    /// Seconds spent selecting survivors and moving slots.
    pub select_move_s: f64,
}

impl CacheCounters {
    /// What was added since `before` (counters of the same cache, taken earlier): one
    /// request's share of a cache that a conversation or a prompt cache carries on.
    pub fn since(&self, before: &CacheCounters) -> CacheCounters {
        CacheCounters {
            evictions: self.evictions - before.evictions,
            evicted_slots: self.evicted_slots - before.evicted_slots,
            score_s: self.score_s - before.score_s,
            select_move_s: self.select_move_s - before.select_move_s,
        }
    }
}

/// Seconds of the model's own regions, summed over layers, collected only when profiling is on
/// (the device is synchronised at each region boundary, which costs time on GPUs, so normal runs
/// leave it off).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Profile {
    /// Norm, Q/K/V/O projections, RoPE, cache append, scores, softmax and the value product.
    pub attention_s: f64,
    /// Attention statistics for the policy: summing the rows it needs (flash attention's extra
    /// pass, or the sums of a decode step's probabilities; under eager attention over a chunk
    /// the softmax sums them as it makes them, and that time is attention's) and folding them
    /// into its state.
    pub stats_s: f64,
    /// Norm, gate/up/down projections and the residual adds.
    pub mlp_s: f64,
}

/// A cache's contents apart from its buffers' free room: what a saved cache holds
/// ([`KvCache::parts`], [`KvCache::from_parts`]).
#[derive(Debug, Clone)]
pub struct KvCacheParts {
    /// The settings it ran under.
    pub config: CacheConfig,
    /// Tokens seen (the absolute position of the next one).
    pub position: usize,
    /// Eviction counters so far (a cache that evicted can no longer be cut back).
    pub counters: CacheCounters,
    /// The policy object's own state ([`Policy::saved_state`]).
    pub policy_state: Vec<u64>,
    /// Every layer's used slots.
    pub layers: Vec<LayerParts>,
}

/// The KV cache of every layer of one request, under one policy.
pub struct KvCache {
    /// Views of `stack`, one per layer.
    layers: Vec<LayerCache>,
    /// Every layer's buffers as one ([`LayerCache::stack`]): where the layers evict together.
    stack: LayerCache,
    /// Evict each layer after its own attention, not every layer after the last one's.
    per_layer: bool,
    /// Per layer, its scores at this step, waiting for the last layer's attention (policies
    /// that score each layer alone; see [`KvCache::after_attention`]).
    pending: Vec<Option<Tensor>>,
    cfg: CacheConfig,
    policy: Box<dyn Policy>,
    counters: CacheCounters,
    /// `Some` while profiling.
    profile: Option<Profile>,
    device: Device,
    /// Tokens seen so far: the absolute position of the next token.
    position: usize,
}

impl KvCache {
    /// Allocates `layers` caches for a request that will see at most `max_tokens` tokens (its
    /// prompt and output, at most the context). With `full`, capacity is `max_tokens`; with a
    /// budget, N + max(B, K), or `max_tokens` when that is less: a budget beyond the request
    /// never binds, and allocating it would only waste memory.
    pub fn new(
        cfg: CacheConfig,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        max_tokens: usize,
        kv: impl Into<KvTypes>,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        let capacity = cfg.slots_for(max_tokens);
        let (stack, layers) =
            LayerCache::stack(layers, kv_heads, head_dim, capacity, kv.into(), device)?;
        Ok(Self {
            policy: build(&cfg.policy),
            layers,
            pending: Vec::new(),
            stack,
            per_layer: false,
            cfg,
            counters: CacheCounters::default(),
            profile: None,
            device: device.clone(),
            position: 0,
        })
    }

    /// The settings this cache runs under.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// One layer's cache.
    pub fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }

    /// One layer's cache, mutable (the model appends to it).
    pub fn layer_mut(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }

    /// Used slots per head (equal across layers between forward passes).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Allocated slots per head.
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, |l| l.capacity())
    }

    /// Bytes of all K/V buffers: allocated once, so this is also the peak.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }

    /// Absolute position of the next token (tokens seen, evicted or not).
    pub fn position(&self) -> usize {
        self.position
    }

    /// Marks `n` more tokens as seen (after a forward pass over them).
    pub fn advance(&mut self, n: usize) {
        self.position += n;
    }

    /// A copy of this cache with room for `capacity` slots per head, for a cache without a
    /// budget that a conversation outgrows: slots, positions, policy state, counters and the
    /// position carry over. A budgeted cache never needs it (it has its N + B slots).
    pub fn grown(&self, capacity: usize) -> Result<Self> {
        if self.cfg.budget.is_some() {
            return Err(CacheError::Config(
                "only a cache without a budget grows; a budgeted one keeps N + B slots".into(),
            ));
        }
        if capacity < self.len() {
            return Err(CacheError::Config(format!(
                "cannot shrink a cache holding {} slots to {capacity}",
                self.len()
            )));
        }
        let mut copy = self.copied(capacity)?;
        copy.policy = build(&self.cfg.policy);
        Ok(copy)
    }

    /// An exact copy in new buffers: the same slots, positions, policy state, counters,
    /// position and capacity, and the policy in the state it is in. Several completions of one
    /// prompt (`n` > 1) each go on from a fork of the prompt's cache, evicted or not, exactly
    /// as the cache itself would have gone on.
    pub fn fork(&self) -> Result<Self> {
        let mut copy = self.copied(self.capacity())?;
        copy.profile = self.profile;
        Ok(copy)
    }

    /// Everything this cache holds (the layers' used slots as views on its device), for
    /// saving it: [`KvCache::from_parts`] makes the same cache again.
    pub fn parts(&self) -> Result<KvCacheParts> {
        Ok(KvCacheParts {
            config: self.cfg.clone(),
            position: self.position,
            counters: self.counters,
            policy_state: self.policy.saved_state(),
            layers: self
                .layers
                .iter()
                .map(LayerCache::parts)
                .collect::<Result<_>>()?,
        })
    }

    /// The cache `parts` describe, with room for `capacity` slots per head, on `device`: it
    /// goes on exactly as the cache they were taken from would have (slots, positions,
    /// per-slot state, the policy in its state, counters). What may come from a file is
    /// checked: the settings, that every layer has the same shape and length, that positions
    /// are consistent (see [`LayerCache::from_parts`]), and that the length fits `capacity`.
    pub fn from_parts(parts: &KvCacheParts, capacity: usize, device: &Device) -> Result<Self> {
        let cfg = parts.config.clone();
        cfg.validate()?;
        let Some(first) = parts.layers.first() else {
            return Err(CacheError::Shape("a cache of no layers".into()));
        };
        let (heads, len, dim) = first.keys.dims3()?;
        let shape = [heads, len, dim];
        if let Some((i, l)) = parts.layers.iter().enumerate().find(|(_, l)| {
            l.keys.dims() != shape
                || l.keys.dtype() != first.keys.dtype()
                || l.values.dims() != first.values.dims()
                || l.values.dtype() != first.values.dtype()
        }) {
            return Err(CacheError::Shape(format!(
                "layer {i} holds {:?} {} keys and {:?} {} values, layer 0 {shape:?} {} and \
                 {:?} {}",
                l.keys.dims(),
                l.keys.dtype().as_str(),
                l.values.dims(),
                l.values.dtype().as_str(),
                first.keys.dtype().as_str(),
                first.values.dims(),
                first.values.dtype().as_str()
            )));
        }
        let in_order = parts.counters.evictions == 0;
        if in_order && shape[1] != parts.position {
            return Err(CacheError::Shape(format!(
                "a cache that never evicted holds one slot per token seen: {} slots for {} tokens",
                shape[1], parts.position
            )));
        }
        if let Some(l) = parts
            .layers
            .iter()
            .find(|l| l.next_position > parts.position)
        {
            return Err(CacheError::Shape(format!(
                "a layer's next position {} is past the tokens seen, {}",
                l.next_position, parts.position
            )));
        }
        let mut head_dim = 0;
        for l in &parts.layers {
            head_dim = LayerCache::check_parts(l, capacity, in_order)?.1;
        }
        let (stack, mut layers) = LayerCache::stack(
            parts.layers.len(),
            heads,
            head_dim,
            capacity,
            first.kv,
            device,
        )?;
        for (layer, p) in layers.iter_mut().zip(&parts.layers) {
            layer.fill(p)?;
        }
        let mut policy = build(&cfg.policy);
        policy.restore_state(&parts.policy_state)?;
        Ok(Self {
            layers,
            pending: Vec::new(),
            stack,
            per_layer: false,
            cfg,
            policy,
            counters: parts.counters,
            profile: None,
            device: device.clone(),
            position: parts.position,
        })
    }

    fn copied(&self, capacity: usize) -> Result<Self> {
        let first = &self.layers[0];
        let (stack, mut layers) = LayerCache::stack(
            self.layers.len(),
            first.kv_heads(),
            first.head_dim(),
            capacity,
            first.kv_type(),
            first.device(),
        )?;
        for (n, l) in layers.iter_mut().zip(&self.layers) {
            n.copy_from(l, true)?;
        }
        Ok(Self {
            layers,
            pending: Vec::new(),
            stack,
            per_layer: self.per_layer,
            cfg: self.cfg.clone(),
            policy: self.policy.clone_box(),
            counters: self.counters,
            profile: None,
            device: self.device.clone(),
            position: self.position,
        })
    }

    /// Continues from `prefix`, a cache that has prefilled a prompt's first tokens and never
    /// evicted: this (fresh) cache gets copies of its slots and position, so that prefilling the
    /// rest of the prompt gives exactly what prefilling the whole prompt would have.
    ///
    /// That holds when no eviction under this cache's budget would have happened in the prefix
    /// (`prefix.len() <= N`), and, for a policy that accumulates statistics over every chunk
    /// (H2O), when `prefix` was made under the same policy. Both are checked, and that the
    /// prefix ends on a chunk boundary.
    ///
    /// The policy object itself is not copied: this relies on policies keeping what they learn
    /// across chunks in the layers' per-slot state (H2O), never in their own fields. `random`
    /// advances its generator only when it scores, at an eviction, which a prefix never has.
    pub fn resume_from(&mut self, prefix: &KvCache) -> Result<()> {
        self.resume_from_first(prefix, prefix.len())
    }

    /// As [`KvCache::resume_from`], from the first `len` tokens of `prefix` only, which is left
    /// as it is: a request that shares a prompt's beginning with a kept cache goes on from a
    /// copy of it, and the kept cache stays for others. `len` must be a whole number of
    /// chunks, and, when it is less than all of `prefix`, `prefix` one that
    /// [`KvCache::truncate`] could cut back (it never evicted, and its policy keeps no per-slot
    /// state); all of it is taken as [`KvCache::resume_from`] takes it.
    pub fn resume_from_prefix(&mut self, prefix: &KvCache, len: usize) -> Result<()> {
        if len > prefix.len() {
            return Err(CacheError::Config(format!(
                "cannot take {len} tokens from a cache of {}",
                prefix.len()
            )));
        }
        if len < prefix.len() {
            if let Some(why) = prefix.uncuttable() {
                return Err(CacheError::Config(why));
            }
        }
        self.resume_from_first(prefix, len)
    }

    fn resume_from_first(&mut self, prefix: &KvCache, len: usize) -> Result<()> {
        if self.position != 0 || !self.is_empty() {
            return Err(CacheError::Config(
                "a cache can resume from a prefix only while it is fresh".into(),
            ));
        }
        if prefix.counters.evictions != 0 {
            return Err(CacheError::Config(
                "the prefix has evicted: it is not a prefill every policy shares".into(),
            ));
        }
        if prefix.layers.len() != self.layers.len() {
            return Err(CacheError::Shape(format!(
                "prefix of {} layers for a model of {}",
                prefix.layers.len(),
                self.layers.len()
            )));
        }
        if let Some(n) = self.cfg.budget {
            if len > n {
                return Err(CacheError::Config(format!(
                    "prefix of {len} tokens is longer than the budget {n}: this policy would have evicted in it"
                )));
            }
        }
        if prefix.cfg.chunk != self.cfg.chunk {
            return Err(CacheError::Config(format!(
                "prefix prefilled in chunks of {}, this cache uses {}",
                prefix.cfg.chunk, self.cfg.chunk
            )));
        }
        if !len.is_multiple_of(self.cfg.chunk) {
            return Err(CacheError::Config(format!(
                "prefix of {len} tokens does not end on a chunk boundary (B = {})",
                self.cfg.chunk
            )));
        }
        // H2O's state sums attention over every chunk seen: only a prefix made under the same
        // policy has it. Other policies keep no per-slot state across chunks.
        let with_state = self.sums_every_token();
        if with_state && prefix.cfg.policy != self.cfg.policy {
            return Err(CacheError::Config(format!(
                "policy `{}` accumulates attention over every chunk, and the prefix (made under `{}`) did not",
                self.cfg.policy.name(),
                prefix.cfg.policy.name()
            )));
        }
        for (dst, src) in self.layers.iter_mut().zip(&prefix.layers) {
            if len == prefix.len() {
                dst.copy_from(src, with_state)?;
            } else {
                dst.copy_prefix_from(src, len, with_state)?;
            }
        }
        // A cache that never evicted holds one slot per token seen.
        self.position = len;
        Ok(())
    }

    /// Keeps the first `len` tokens and forgets the rest, so that a request whose prompt starts
    /// with them can go on from here (a server's prompt cache). Only a cache that never evicted
    /// holds the tokens `0..len` in its first `len` slots, and only a policy that keeps no
    /// per-slot state can be cut: H2O's attention sums include what later tokens attended, which
    /// cutting cannot take back. Both are checked.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if let Some(why) = self.uncuttable() {
            return Err(CacheError::Config(why));
        }
        if len > self.len() {
            return Err(CacheError::Config(format!(
                "cannot cut a cache of {} tokens back to {len}",
                self.len()
            )));
        }
        for l in &mut self.layers {
            l.truncate(len);
        }
        self.position = len;
        Ok(())
    }

    /// Forgets the `n` newest tokens, appended in decode since the cache last evicted: a
    /// speculative draft's tokens that were not accepted ([`KvCache::draft_room`] bounds a
    /// draft so that none of its tokens evicts). The cache is then as it was before they
    /// were appended, evicted or not, except under a policy that accumulates attention from
    /// every token (H2O), whose sums cannot take theirs back: refused.
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if let Some(why) = self.unrewindable() {
            return Err(CacheError::Config(why));
        }
        if n > self.position {
            return Err(CacheError::Config(format!(
                "cannot forget {n} tokens of a cache that has seen {}",
                self.position
            )));
        }
        if let Some(l) = self.layers.iter().find(|l| l.rewindable() < n) {
            return Err(CacheError::Config(format!(
                "cannot forget the last {n} tokens: only {} were appended since the cache last \
                 evicted",
                l.rewindable()
            )));
        }
        for l in &mut self.layers {
            l.rewind(n)?;
        }
        self.position -= n;
        Ok(())
    }

    /// True when the policy folds the attention of every token into per-slot state (H2O):
    /// such a cache can be neither cut back nor rewound.
    fn sums_every_token(&self) -> bool {
        self.cfg.policy != PolicyKind::Full && self.policy.needs() == StatsNeed::AllRows
    }

    /// True when [`KvCache::rewind`] can take tokens back under this cache's policy (a cheap
    /// check for every decode step; [`KvCache::unrewindable`] says why not).
    pub fn can_rewind(&self) -> bool {
        !self.sums_every_token()
    }

    /// Why [`KvCache::rewind`] can never take tokens back under this cache's policy, if so.
    pub fn unrewindable(&self) -> Option<String> {
        self.sums_every_token().then(|| {
            format!(
                "policy `{}` accumulates attention from every token: tokens it has seen cannot \
                 be taken back",
                self.cfg.policy.name()
            )
        })
    }

    /// How many decode tokens can follow the next one such that none of them evicts and all
    /// fit in the buffers: the longest speculative draft after a token whose slots
    /// [`KvCache::rewind`] can take back. The next token itself may evict (it is never taken
    /// back). Under a budget N with eviction every K tokens, a decode token evicts when the
    /// cache reaches N + K slots, so the room is what is left below that.
    pub fn draft_room(&self) -> usize {
        let (len, cap) = (self.len(), self.capacity());
        let after_next = match self.cfg.budget {
            Some(n) if len + 1 >= n + self.cfg.evict_every() => n.min(len + 1),
            _ => len + 1,
        };
        let below_eviction = match self.cfg.budget {
            Some(n) => (n + self.cfg.evict_every()).saturating_sub(after_next + 1),
            None => usize::MAX,
        };
        cap.saturating_sub(after_next).min(below_eviction)
    }

    /// True when `truncate` can cut this cache back: it never evicted and its policy keeps no
    /// per-slot state.
    pub fn can_truncate(&self) -> bool {
        self.uncuttable().is_none()
    }

    /// Why [`KvCache::truncate`] cannot cut this cache back, if it cannot.
    fn uncuttable(&self) -> Option<String> {
        if self.counters.evictions != 0 {
            Some("a cache that has evicted cannot be cut back to a prefix".into())
        } else if self.sums_every_token() {
            Some(format!(
                "policy `{}` accumulates attention from every later token: its cache cannot be cut back",
                self.cfg.policy.name()
            ))
        } else {
            None
        }
    }

    /// Eviction costs so far.
    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    /// Turns profiling on (zeroing the profile) or off. While on, eviction timings synchronise
    /// the device first, and the model records its regions with [`KvCache::profile_mut`].
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(Profile::default);
    }

    /// True while profiling.
    pub fn profiling(&self) -> bool {
        self.profile.is_some()
    }

    /// The model's region timings so far, when profiling.
    pub fn profile(&self) -> Option<Profile> {
        self.profile
    }

    /// The profile to add region timings to, when profiling.
    pub fn profile_mut(&mut self) -> Option<&mut Profile> {
        self.profile.as_mut()
    }

    /// Waits for the device when profiling, so that host timers measure finished work.
    fn sync_if_profiling(&self) -> Result<()> {
        if self.profile.is_some() {
            self.device.synchronize()?;
        }
        Ok(())
    }

    /// Query rows of a chunk of `chunk` tokens, just appended to layer `i`, whose attention
    /// the policy needs, if any (`decode` as [`KvCache::after_attention`] gets it). A policy
    /// that scores from the last rows (TOVA, SnapKV) needs them only when this pass evicts:
    /// a prompt chunk that leaves the layer within its budget, and the decode steps before
    /// the one that reaches N + K, take none (nor the decode kernel's detour through the
    /// probabilities, nor flash's statistics pass). H2O sums every row into its state.
    pub fn stats_rows(&self, i: usize, chunk: usize, decode: bool) -> Option<usize> {
        if self.cfg.policy == PolicyKind::Full {
            return None;
        }
        match self.policy.needs() {
            StatsNeed::None => None,
            StatsNeed::LastRows(r) => self.due(i, decode).then_some(r.min(chunk)),
            StatsNeed::AllRows => Some(chunk),
        }
    }

    /// Runs after layer `i`'s attention over a chunk (`decode`: a single generated token).
    /// Lets the policy observe the statistics, and evicts back to N when it is time: after
    /// every prefill chunk that overflows N, and in decode once N + K slots are used.
    ///
    /// Every layer evicts at once, after the last layer's attention, on the model-wide
    /// buffers ([`LayerCache::stack`]): one selection and one set of moves per chunk over
    /// `layers · kv_heads` heads, instead of one per layer. A policy that scores from the keys
    /// or positions alone with no more memory for many layers than for one
    /// ([`Policy::scores_layers_together`]: KeyDiff on float caches, StreamingLLM) scores them
    /// all at once too; any other scores each layer here, after its attention, as it did when
    /// each layer evicted alone (its statistics are this layer's, and `random` draws in layer
    /// order), and the scores wait for the last layer. The survivors are the same as evicting
    /// each layer after its own attention: a layer's cache is read again only by the next
    /// chunk, and every head is selected and moved alone. A pass must therefore call this
    /// for every layer, the last one last, and append to each layer once (several rows of a
    /// layer attended one after another need [`KvCache::set_evict_per_layer`], which turns
    /// this off).
    pub fn after_attention(
        &mut self,
        i: usize,
        stats: Option<&AttnStats>,
        decode: bool,
    ) -> Result<()> {
        if let Some(s) = stats {
            let t = Instant::now();
            self.policy.observe(&mut self.layers[i], s)?;
            if self.profile.is_some() {
                self.sync_if_profiling()?;
                let dt = t.elapsed().as_secs_f64();
                if let Some(p) = self.profile.as_mut() {
                    p.stats_s += dt;
                }
            }
        }
        if !self.due(i, decode) {
            return Ok(());
        }
        if !self.evicts_together() {
            let scores = self.score_layer(Some(i), stats)?;
            return self.evict_layer(i, &scores);
        }
        if !self.scores_together() {
            self.pending.resize(self.layers.len(), None);
            self.pending[i] = Some(self.score_layer(Some(i), stats)?);
        }
        if i + 1 < self.layers.len() {
            // The last layer's call evicts this one too.
            return Ok(());
        }
        let len = self.layers[i].len();
        let mut pending = std::mem::take(&mut self.pending);
        pending.resize(self.layers.len(), None);
        if self.layers.iter().any(|l| l.len() != len) {
            // Layers appended unevenly (a test driving one layer): each due one alone.
            for (j, scores) in pending.into_iter().enumerate() {
                if self.due(j, decode) {
                    let scores = match scores {
                        Some(s) => s,
                        None => self.score_layer(Some(j), None)?,
                    };
                    self.evict_layer(j, &scores)?;
                }
            }
            return Ok(());
        }
        // The stack's length is every layer's.
        self.stack.set_moved_len(len);
        let scores = if self.scores_together() {
            self.score_layer(None, None)?
        } else {
            match pending.into_iter().collect::<Option<Vec<Tensor>>>() {
                Some(rows) => Tensor::cat(&rows, 0)?,
                None => {
                    return Err(CacheError::Shape(
                        "a layer's scores are missing: a layer's attention was skipped".into(),
                    ))
                }
            }
        };
        self.evict_stack(&scores)
    }

    /// Evicts each layer after its own attention (`true`), or every layer at once after the
    /// last one's (`false`, the default; see [`KvCache::after_attention`]). Both keep the same slots; this is for measuring the
    /// difference, and for a pass that attends several rows of a layer one after the other
    /// (a speculative draft verified row by row): each row's eviction must come before the
    /// next row attends, as in token-by-token decoding.
    pub fn set_evict_per_layer(&mut self, on: bool) {
        self.per_layer = on;
    }

    /// True when each layer evicts after its own attention ([`KvCache::set_evict_per_layer`]).
    pub fn evicts_per_layer(&self) -> bool {
        self.per_layer
    }

    /// True when layer `i` holds more slots than its budget lets it keep at this step.
    fn due(&self, i: usize, decode: bool) -> bool {
        let (Some(budget), layer) = (self.cfg.budget, &self.layers[i]) else {
            return false;
        };
        if decode {
            layer.len() >= budget + self.cfg.evict_every()
        } else {
            layer.len() > budget
        }
    }

    /// True when the layers evict together: it was not turned off, the policy evicts at all,
    /// and every layer is still a view of the stack.
    fn evicts_together(&self) -> bool {
        !self.per_layer
            && self.cfg.policy != PolicyKind::Full
            && self
                .layers
                .iter()
                .enumerate()
                .all(|(l, layer)| layer.is_view_of(&self.stack, l))
    }

    /// True when the policy scores every layer at once, on the stack.
    fn scores_together(&self) -> bool {
        self.policy.scores_layers_together(self.stack.kv_type())
    }

    /// Scores of layer `i` (`None`: of the stack, every layer at once), timed.
    fn score_layer(&mut self, i: Option<usize>, stats: Option<&AttnStats>) -> Result<Tensor> {
        let layer = match i {
            None => &self.stack,
            Some(i) => &self.layers[i],
        };
        self.sync_if_profiling()?;
        let t = Instant::now();
        let scores = self.policy.score_tensor(layer, stats)?;
        self.sync_if_profiling()?;
        self.counters.score_s += t.elapsed().as_secs_f64();
        Ok(scores)
    }

    /// Selects and moves layer `i` alone by its `scores`.
    fn evict_layer(&mut self, i: usize, scores: &Tensor) -> Result<()> {
        let Some(budget) = self.cfg.budget else {
            return Ok(());
        };
        let t = Instant::now();
        let sinks = self.cfg.protected_sinks();
        let recent = self.cfg.protected_recent(budget);
        let layer = &mut self.layers[i];
        self.counters.evicted_slots += (layer.len() - budget) * layer.kv_heads();
        // Selection, plan and moves stay on the cache's device (CUDA: two kernels + moves).
        layer.evict(scores, budget, sinks, recent)?;
        self.sync_if_profiling()?;
        self.counters.select_move_s += t.elapsed().as_secs_f64();
        self.counters.evictions += 1;
        Ok(())
    }

    /// Selects and moves every layer at once, on the stack, by `scores` (`[layers · kv_heads,
    /// len]`; every layer holds the stack's `len` slots). Counted as one eviction per layer, as
    /// [`KvCache::evict_layer`] counts them.
    fn evict_stack(&mut self, scores: &Tensor) -> Result<()> {
        let Some(budget) = self.cfg.budget else {
            return Ok(());
        };
        let len = self.stack.len();
        let t = Instant::now();
        let sinks = self.cfg.protected_sinks();
        let recent = self.cfg.protected_recent(budget);
        self.counters.evicted_slots += (len - budget) * self.stack.kv_heads();
        self.stack.evict(scores, budget, sinks, recent)?;
        for l in &mut self.layers {
            l.set_moved_len(budget);
        }
        self.sync_if_profiling()?;
        self.counters.select_move_s += t.elapsed().as_secs_f64();
        self.counters.evictions += self.layers.len();
        Ok(())
    }
}
