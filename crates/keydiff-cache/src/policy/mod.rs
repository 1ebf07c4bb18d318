//! The `Policy` trait and one file per policy (definitions in POLICIES.md).

mod full;
mod h2o;
mod keydiff;
mod knorm;
mod random;
mod sink;
mod snapkv;
mod tova;

use candle_core::Tensor;

use crate::config::PolicyKind;
use crate::layer::LayerCache;
use crate::{KvTypes, Result};

pub use keydiff::{
    keydiff_scores, keydiff_scores_fused, keydiff_scores_fused_with, vector_loads_fit, ScoreLoads,
    VECTOR_HEAD_DIMS,
};
pub use snapkv::PoolByPosition;

/// Attention statistics a policy needs from the model's attention step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsNeed {
    /// None: KeyDiff, Knorm, Random, Sink, Full work with any attention backend.
    None,
    /// Probabilities of the last `r` query rows of the chunk, summed over those rows.
    LastRows(usize),
    /// Probabilities of every query row, summed (H2O).
    AllRows,
}

/// Attention probabilities of one layer for one chunk: `sums` is `[kv_heads, g, T]` (f32), the
/// softmax rows of the observed queries summed per query head, over the `T` used slots.
#[derive(Debug, Clone)]
pub struct AttnStats {
    pub sums: Tensor,
    /// Number of query rows summed.
    pub rows: usize,
}

/// A boxed copy of a policy, in the state it is in (`random`'s generator included), for a
/// cache copied with [`crate::KvCache::fork`]. Every `Clone` policy has it.
pub trait PolicyClone {
    fn clone_box(&self) -> Box<dyn Policy>;
}

impl<T: Policy + Clone + 'static> PolicyClone for T {
    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

/// An eviction policy: scores the used slots of one layer; higher scores survive.
pub trait Policy: Send + PolicyClone {
    /// What the attention step must compute for this policy.
    fn needs(&self) -> StatsNeed {
        StatsNeed::None
    }

    /// Called after every attention step that computed statistics (H2O accumulates here, also
    /// when nothing is evicted). Whatever must last across chunks goes into the layer's per-slot
    /// state, not into the policy: a request resumed from a shared prefix
    /// ([`crate::KvCache::resume_from`]) gets a fresh policy and a copy of the layers.
    fn observe(&mut self, _layer: &mut LayerCache, _stats: &AttnStats) -> Result<()> {
        Ok(())
    }

    /// True when this policy can score many layers at once, as one layer of `layers ·
    /// kv_heads` heads (the cache's stack), from the keys or positions alone, with temporary
    /// memory that grows with the slots but not with the head dim: the cache then scores
    /// every layer together after the last layer's attention, where it evicts them all
    /// ([`crate::KvCache::after_attention`]). False (the default) for policies that need
    /// attention statistics, keep state of their own between layers (`random`'s generator),
    /// or widen the keys into a copy to score them: the cache scores each layer after its
    /// attention.
    fn scores_layers_together(&self, _kv: KvTypes) -> bool {
        false
    }

    /// Scores of the used slots, `[kv_heads][len]`, on the host.
    fn score(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Vec<Vec<f32>>>;

    /// What the policy object itself carries from one eviction to the next (`random`: its
    /// generator's state), for a cache saved to a file ([`crate::KvCache::parts`]). Empty for
    /// policies that keep nothing (their per-slot state is in the layers).
    fn saved_state(&self) -> Vec<u64> {
        Vec::new()
    }

    /// Puts back what [`Policy::saved_state`] gave.
    fn restore_state(&mut self, words: &[u64]) -> Result<()> {
        if words.is_empty() {
            Ok(())
        } else {
            Err(crate::CacheError::Config(format!(
                "this policy keeps no state, and {} word(s) of it were given",
                words.len()
            )))
        }
    }

    /// Scores of the used slots as a `[kv_heads, len]` f32 tensor on the cache's device, which
    /// the eviction uses. The default uploads [`Policy::score`]; policies that can score on the
    /// device (all but `random`) override it, so that nothing goes through the host.
    fn score_tensor(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Tensor> {
        let rows = self.score(layer, stats)?;
        let n = layer.len();
        if rows.len() != layer.kv_heads() || rows.iter().any(|r| r.len() != n) {
            return Err(crate::CacheError::Shape(format!(
                "policy returned {} score rows for {} heads of {n} slots",
                rows.len(),
                layer.kv_heads()
            )));
        }
        let flat: Vec<f32> = rows.into_iter().flatten().collect();
        Ok(Tensor::from_vec(
            flat,
            (layer.kv_heads(), n),
            layer.device(),
        )?)
    }
}

impl PolicyKind {
    /// What the attention step must compute for this policy (`None` for `full`).
    pub fn stats_need(&self) -> StatsNeed {
        if *self == PolicyKind::Full {
            StatsNeed::None
        } else {
            build(self).needs()
        }
    }
}

/// Builds the policy of a kind.
pub fn build(kind: &PolicyKind) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Full => Box::new(full::Full),
        PolicyKind::KeyDiff { anchor } => Box::new(keydiff::KeyDiff { anchor: *anchor }),
        PolicyKind::Tova { per_head } => Box::new(tova::Tova {
            per_head: *per_head,
        }),
        PolicyKind::SnapKv { window } => Box::new(snapkv::SnapKv { window: *window }),
        PolicyKind::H2o { normalized } => Box::new(h2o::H2o {
            normalized: *normalized,
        }),
        PolicyKind::Sink => Box::new(sink::Sink),
        PolicyKind::Knorm => Box::new(knorm::Knorm),
        PolicyKind::Random { seed } => Box::new(random::RandomPolicy::new(*seed)),
    }
}
