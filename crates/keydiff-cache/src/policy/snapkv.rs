//! SnapKV (Li et al. 2024): attention of the last W queries of the chunk, summed, avg-pooled
//! along the token axis (kernel 5, padding 2, zero padding counted, as `F.avg_pool1d`), averaged
//! over the g query heads of each KV head (kvpress's GQA form). The window's own tokens are
//! protected by the shared selection.
//!
//! Slots are not in position order after compaction, so pooling runs over the head's slots
//! sorted by position: neighbours in the text, as in the reference.
//!
//! Known difference: the reference code and kvpress pool only the tokens before the window
//! (`attn_weights[..., -window:, :-window]`, zeros past its end); here the window's slots are
//! pooled too, so its attention to itself lifts the two tokens just before it. Zeroing the
//! window's sums before the pooling (tried 2026-12-07) made eager and flash attention pick
//! different tokens on one near-tie case of `tests/tests/kv_dtype.rs` (f16 keys, q8_0 values)
//! and was taken back until that is understood.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use super::{Policy, StatsNeed};
use crate::layer::LayerCache;
use crate::{AttnStats, CacheError, Result};

/// SnapKV's pooling kernel (reference code).
pub const POOL_KERNEL: usize = 5;

/// The SnapKV policy.
#[derive(Clone)]
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
        Ok(self.score_tensor(layer, stats)?.to_vec2::<f32>()?)
    }

    /// On the cache's device: the mean over the g query heads, then [`PoolByPosition`].
    fn score_tensor(&mut self, layer: &LayerCache, stats: Option<&AttnStats>) -> Result<Tensor> {
        let s =
            stats.ok_or_else(|| CacheError::Config("SnapKV needs attention statistics".into()))?;
        let per_head = s.sums.mean(1)?.to_dtype(DType::F32)?.contiguous()?;
        let op = PoolByPosition {
            span: layer.next_position(),
        };
        Ok(per_head.apply_op2_no_bwd(&layer.positions_tensor()?, &op)?)
    }
}

/// SnapKV's pooling along positions as one op: `stats` `[kv, n]` f32 and `positions`
/// `[kv, ≥ n]` u32 (unique per head, all `< span`) give `[kv, n]`: each slot's value
/// avg-pooled with its neighbours in position order. CPU: sort by position and [`avg_pool`];
/// CUDA: `snapkv_pool` (a position bitmap and prefix popcounts, same additions in the same
/// order, so bit-identical).
#[derive(Debug, Clone, Copy)]
pub struct PoolByPosition {
    pub span: usize,
}

impl CustomOp2 for PoolByPosition {
    fn name(&self) -> &'static str {
        "snapkv-pool"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (kv, n) = crate::select::per_slot_pair("snapkv-pool", l1, l2)?;
        let (ss, ps) = (l1.stride(), l2.stride());
        let (CpuStorage::F32(stats), CpuStorage::U32(positions)) = (s1, s2) else {
            candle_core::bail!("snapkv-pool: stats must be f32 and positions u32");
        };
        let mut out = vec![0f32; kv * n];
        for h in 0..kv {
            let row = &stats[l1.start_offset() + h * ss[0]..][..n];
            let pos = &positions[l2.start_offset() + h * ps[0]..][..n];
            if let Some(&p) = pos.iter().find(|&&p| p as usize >= self.span) {
                candle_core::bail!("snapkv-pool: position {p} >= span {}", self.span);
            }
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_unstable_by_key(|&i| pos[i]);
            let sorted: Vec<f32> = order.iter().map(|&i| row[i]).collect();
            let pooled = avg_pool(&sorted);
            for (rank, &i) in order.iter().enumerate() {
                out[h * n + i] = pooled[rank];
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((kv, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        keydiff_kernels::snapkv_pool(s1, l1, s2, l2, self.span)
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

    #[test]
    fn pool_by_position_pools_text_neighbours_of_scrambled_slots() {
        // Slots after compaction: positions out of order, with gaps.
        let pos: Vec<u32> = vec![40, 3, 17, 8, 55, 0, 21, 9];
        let stats: Vec<f32> = (0..8).map(|i| (i * i + 1) as f32).collect();
        let dev = candle_core::Device::Cpu;
        let out = Tensor::from_vec(stats.clone(), (1, 8), &dev)
            .unwrap()
            .apply_op2_no_bwd(
                &Tensor::from_vec(pos.clone(), (1, 8), &dev).unwrap(),
                &PoolByPosition { span: 56 },
            )
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for i in 0..8 {
            // Naively: the slots whose positions are among the 2 below and 2 above pos[i].
            let below = pos.iter().filter(|&&q| q < pos[i]).count();
            let sum: f32 = (0..8)
                .filter(|&j| {
                    let rank = pos.iter().filter(|&&q| q < pos[j]).count() as i64;
                    (rank - below as i64).abs() <= 2
                })
                .map(|j| stats[j])
                .sum();
            assert!((out[0][i] - sum / 5.0).abs() < 1e-6, "slot {i}: {out:?}");
        }
        // A position outside the span is an error, not a wrong answer.
        let bad = Tensor::from_vec(stats, (1, 8), &dev)
            .unwrap()
            .apply_op2_no_bwd(
                &Tensor::from_vec(pos, (1, 8), &dev).unwrap(),
                &PoolByPosition { span: 55 },
            );
        assert!(bad.is_err());
    }
}
