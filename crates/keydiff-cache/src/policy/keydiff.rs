//! KeyDiff (arXiv 2504.15364): keep the keys least similar to the anchor of the head's keys.
//!
//! s_i = −cos(k_i, μ), μ = mean of k̂ (normalised, default) or of k (`mean`), over all used
//! slots of the head, the new chunk included. Needs no attention weights.

use candle_core::{DType, Tensor};

use super::Policy;
use crate::config::Anchor;
use crate::layer::LayerCache;
use crate::Result;

/// Guards the division by a key norm of zero.
const NORM_EPS: f64 = 1e-12;

/// The KeyDiff policy.
pub struct KeyDiff {
    pub anchor: Anchor,
}

/// KeyDiff scores of `keys` (`[kv_heads, n, d]`, any dtype/device) as `[kv_heads, n]` f32:
/// the reference (candle ops) that the fused CUDA kernel is checked against.
pub fn keydiff_scores(keys: &Tensor, anchor: Anchor) -> Result<Tensor> {
    let k = keys.to_dtype(DType::F32)?;
    // [kv, n, 1]
    let norm = (k.sqr()?.sum_keepdim(2)?.sqrt()? + NORM_EPS)?;
    let kn = k.broadcast_div(&norm)?;
    // [kv, 1, d]
    let mu = match anchor {
        Anchor::Normalized => kn.mean_keepdim(1)?,
        Anchor::Mean => k.mean_keepdim(1)?,
    };
    let mu_norm = (mu.sqr()?.sum_keepdim(2)?.sqrt()? + NORM_EPS)?;
    let mu = mu.broadcast_div(&mu_norm)?;
    // cos(k_i, μ): [kv, n]
    let cos = kn.matmul(&mu.transpose(1, 2)?.contiguous()?)?.squeeze(2)?;
    Ok(cos.neg()?)
}

impl Policy for KeyDiff {
    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok(keydiff_scores(&layer.keys()?, self.anchor)?.to_vec2::<f32>()?)
    }
}
