//! H2O (Zhang et al. 2023): per KV head and slot, the attention every query so far (of the g
//! query heads) gave the slot, accumulated; the accumulator moves with its slot. The recent
//! window (50% of N by default) is protected by the shared selection. `h2o-normalized`
//! (kvpress ObservedAttention) divides by the number of queries that could see the slot.

use candle_core::{DType, Tensor};

use super::{Policy, StatsNeed};
use crate::layer::LayerCache;
use crate::{AttnStats, Result};

/// The H2O policy.
#[derive(Clone)]
pub struct H2o {
    pub normalized: bool,
}

impl Policy for H2o {
    fn needs(&self) -> StatsNeed {
        StatsNeed::AllRows
    }

    fn observe(&mut self, layer: &mut LayerCache, stats: &AttnStats) -> Result<()> {
        // [kv, T]: summed over the g query heads and the rows.
        layer.add_state(&stats.sums.sum(1)?)
    }

    fn score(&mut self, layer: &LayerCache, _: Option<&AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_tensor(layer, None)?.to_vec2::<f32>()?)
    }

    fn score_tensor(&mut self, layer: &LayerCache, _: Option<&AttnStats>) -> Result<Tensor> {
        let acc = layer.state_tensor()?;
        if !self.normalized {
            return Ok(acc.contiguous()?);
        }
        // Queries that could see slot p: newest − p + 1 (exact in f32 below 2^24 positions).
        let pos = layer.positions_tensor()?.to_dtype(DType::F32)?;
        let newest = pos.max_keepdim(1)?;
        let seen = (newest.broadcast_sub(&pos)? + 1.0)?;
        Ok((acc / seen)?)
    }
}
