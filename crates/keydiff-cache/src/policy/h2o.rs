//! H2O (Zhang et al. 2023): per KV head and slot, the attention every query so far (of the g
//! query heads) gave the slot, accumulated; the accumulator moves with its slot. The recent
//! window (50% of N by default) is protected by the shared selection. `h2o-normalized`
//! (kvpress ObservedAttention) divides by the number of queries that could see the slot.

use super::{Policy, StatsNeed};
use crate::layer::LayerCache;
use crate::{AttnStats, Result};

/// The H2O policy.
pub struct H2o {
    pub normalized: bool,
}

impl Policy for H2o {
    fn needs(&self) -> StatsNeed {
        StatsNeed::AllRows
    }

    fn observe(&mut self, layer: &mut LayerCache, stats: &AttnStats) -> Result<()> {
        // [kv, T]: summed over the g query heads and the rows.
        let sums = stats.sums.sum(1)?.to_vec2::<f32>()?;
        for (h, row) in sums.iter().enumerate() {
            for (acc, x) in layer.state_mut(h).iter_mut().zip(row) {
                *acc += x;
            }
        }
        Ok(())
    }

    fn score(&mut self, layer: &LayerCache, _: Option<&AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok((0..layer.kv_heads())
            .map(|h| {
                let acc = layer.state(h);
                if !self.normalized {
                    return acc.to_vec();
                }
                let pos = layer.positions(h);
                let newest = pos.iter().copied().max().unwrap_or(0);
                acc.iter()
                    .zip(pos)
                    .map(|(a, &p)| a / (newest - p + 1) as f32)
                    .collect()
            })
            .collect())
    }
}
