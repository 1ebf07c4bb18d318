//! SnapKV (Li et al. 2024): attention of the last W queries of the chunk, summed, avg-pooled
//! along the token axis (kernel 5, padding 2, zero padding counted, as `F.avg_pool1d`), averaged
//! over the g query heads of each KV head (kvpress's GQA form). The window's own tokens are
//! protected by the shared selection.
//!
//! Slots are not in position order after compaction, so pooling runs over the head's slots
//! sorted by position: neighbours in the text, as in the reference.

use super::{per_kv_head_mean, Policy, StatsNeed};
use crate::layer::LayerCache;
use crate::{AttnStats, CacheError, Result};

/// SnapKV's pooling kernel (reference code).
pub const POOL_KERNEL: usize = 5;

/// The SnapKV policy.
pub struct SnapKv {
    pub window: usize,
}

/// Average pooling of `xs` with `POOL_KERNEL`, zero padding, divisor always the kernel size.
pub fn avg_pool(xs: &[f32]) -> Vec<f32> {
    let half = POOL_KERNEL / 2;
    (0..xs.len())
        .map(|i| {
            let lo = i.saturating_sub(half);
            let hi = (i + half + 1).min(xs.len());
            xs[lo..hi].iter().sum::<f32>() / POOL_KERNEL as f32
        })
        .collect()
}

impl Policy for SnapKv {
    fn needs(&self) -> StatsNeed {
        StatsNeed::LastRows(self.window)
    }

    fn score(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Vec<Vec<f32>>> {
        let s =
            stats.ok_or_else(|| CacheError::Config("SnapKV needs attention statistics".into()))?;
        let per_head = per_kv_head_mean(s)?;
        per_head
            .iter()
            .enumerate()
            .map(|(h, row)| {
                let pos = layer.positions(h)?;
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.sort_unstable_by_key(|&i| pos[i]);
                let sorted: Vec<f32> = order.iter().map(|&i| row[i]).collect();
                let pooled = avg_pool(&sorted);
                let mut out = vec![0f32; row.len()];
                for (rank, &i) in order.iter().enumerate() {
                    out[i] = pooled[rank];
                }
                Ok(out)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_matches_torch_avg_pool1d() {
        // torch.nn.functional.avg_pool1d(x, 5, 1, 2) on [1,2,3,4,5,6]
        let p = avg_pool(&[1., 2., 3., 4., 5., 6.]);
        let want = [1.2, 2.0, 3.0, 4.0, 3.6, 3.0];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{p:?}");
        }
    }
}
