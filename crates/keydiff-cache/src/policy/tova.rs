//! TOVA (Oren et al. 2024): the attention of the newest token, averaged over all query heads of
//! the layer, so every KV head keeps the same slots; `tova-per-head` averages only over the g
//! query heads of each KV head.

use candle_core::{DType, Tensor};

use super::{Policy, StatsNeed};
use crate::layer::LayerCache;
use crate::{AttnStats, CacheError, Result};

/// The TOVA policy.
#[derive(Clone)]
pub struct Tova {
    pub per_head: bool,
}

impl Policy for Tova {
    fn needs(&self) -> StatsNeed {
        StatsNeed::LastRows(1)
    }

    /// On the cache's device: `[kv, g, T]` → mean over g (per head), or over g and kv.
    fn score_tensor(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Tensor> {
        let s =
            stats.ok_or_else(|| CacheError::Config("TOVA needs attention statistics".into()))?;
        let per_head = s.sums.mean(1)?;
        if self.per_head {
            return Ok(per_head.to_dtype(DType::F32)?);
        }
        let kv = layer.kv_heads();
        Ok(per_head
            .mean_keepdim(0)?
            .to_dtype(DType::F32)?
            .broadcast_as((kv, layer.len()))?
            .contiguous()?)
    }

    fn score(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_tensor(layer, stats)?.to_vec2::<f32>()?)
    }
}
