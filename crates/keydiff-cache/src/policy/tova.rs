//! TOVA (Oren et al. 2024): the attention of the newest token, averaged over all query heads of
//! the layer, so every KV head keeps the same slots; `tova-per-head` averages only over the g
//! query heads of each KV head.

use super::{per_kv_head_mean, Policy, StatsNeed};
use crate::layer::LayerCache;
use crate::{AttnStats, CacheError, Result};

/// The TOVA policy.
pub struct Tova {
    pub per_head: bool,
}

impl Policy for Tova {
    fn needs(&self) -> StatsNeed {
        StatsNeed::LastRows(1)
    }

    fn score(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Vec<Vec<f32>>> {
        let s =
            stats.ok_or_else(|| CacheError::Config("TOVA needs attention statistics".into()))?;
        let per_head = per_kv_head_mean(s)?;
        if self.per_head {
            return Ok(per_head);
        }
        let n = layer.len();
        let heads = per_head.len() as f32;
        let mean: Vec<f32> = (0..n)
            .map(|i| per_head.iter().map(|h| h[i]).sum::<f32>() / heads)
            .collect();
        Ok(vec![mean; per_head.len()])
    }
}
