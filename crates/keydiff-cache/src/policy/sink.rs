//! StreamingLLM (Xiao et al. 2024): the first sinks plus the most recent tokens. Sinks are
//! protected by the shared selection; the score is the position, so the newest survive.
//! Positions are not re-assigned.

use candle_core::{DType, Tensor};

use super::Policy;
use crate::layer::LayerCache;
use crate::Result;

/// The attention-sink policy.
#[derive(Clone)]
pub struct Sink;

impl Policy for Sink {
    /// Scores are the positions: `[heads, len]` whatever the keys.
    fn scores_layers_together(&self, _kv: crate::KvTypes) -> bool {
        true
    }

    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_tensor(layer, None)?.to_vec2::<f32>()?)
    }

    /// The position as the score; selection breaks f32 rounding ties (past 2^24) by position.
    fn score_tensor(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Tensor> {
        Ok(layer.positions_tensor()?.to_dtype(DType::F32)?)
    }
}
