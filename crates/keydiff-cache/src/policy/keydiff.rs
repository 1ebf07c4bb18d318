//! KeyDiff (arXiv 2504.15364): keep the keys least similar to the anchor of the head's keys.
//!
//! s_i = −cos(k_i, μ), μ = mean of k̂ (normalised, default) or of k (`mean`), over all used
//! slots of the head, the new chunk included. Needs no attention weights.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, WithDType};
pub use keydiff_kernels::geometry::{vector_loads_fit, ScoreLoads, VECTOR_HEAD_DIMS};

use super::Policy;
use crate::config::Anchor;
use crate::layer::LayerCache;
use crate::{KvType, KvTypes, Result};

/// Guards the division by a key norm of zero.
const NORM_EPS: f64 = 1e-12;

/// The KeyDiff policy.
#[derive(Clone)]
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

/// KeyDiff scores in one fused op, `[kv_heads, n]` f32: two passes over each head's keys (norms
/// and anchor, then cosines) with no intermediate tensors, read in place from the cache view.
/// CPU: the twin below; CUDA: `keydiff_pass1/2` of `kernels/keydiff.cu` (f32/f16/bf16, head
/// dim up to 256; 16-byte loads where the view takes them). Other devices and shapes use
/// [`keydiff_scores`]. fp8 keys are read as f16, which holds every E4M3 value exactly.
pub fn keydiff_scores_fused(keys: &Tensor, anchor: Anchor) -> Result<Tensor> {
    keydiff_scores_fused_with(keys, anchor, ScoreLoads::Auto)
}

/// [`keydiff_scores_fused`] with the CUDA kernels' loads chosen (for `keydiff check-kernels`,
/// which checks and times both); the CPU twin has one way.
pub fn keydiff_scores_fused_with(
    keys: &Tensor,
    anchor: Anchor,
    loads: ScoreLoads,
) -> Result<Tensor> {
    if keys.dtype() == DType::F8E4M3 {
        return keydiff_scores_fused_with(&keys.to_dtype(DType::F16)?, anchor, loads);
    }
    let kernel = keys.device().is_cuda()
        && matches!(keys.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && keys.dim(2)? <= 256;
    if keys.device().is_cpu() || kernel {
        Ok(keys.apply_op1_no_bwd(&KeyDiffOp { anchor, loads })?)
    } else {
        keydiff_scores(keys, anchor)
    }
}

/// The fused scoring op: the CPU code is the twin of the CUDA kernel.
struct KeyDiffOp {
    anchor: Anchor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    loads: ScoreLoads,
}

/// Sum of `a[i] · b[i]` in f32 with 8 independent lanes (so that it vectorises).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

impl KeyDiffOp {
    /// `xs` holds `[kv, n, d]` f32 at `offset` with strides `st`; rows must be contiguous.
    /// Arithmetic in f32, as on the GPU.
    fn run(
        &self,
        xs: &[f32],
        offset: usize,
        (kv, n, d): (usize, usize, usize),
        st: &[usize],
    ) -> Vec<f32> {
        let mut out = vec![0f32; kv * n];
        let mut norms = vec![0f32; n];
        let mut acc = vec![0f32; d];
        for h in 0..kv {
            let row = |i: usize| {
                let at = offset + h * st[0] + i * st[1];
                &xs[at..at + d]
            };
            acc.iter_mut().for_each(|a| *a = 0.0);
            // Pass 1: norms and the anchor sum.
            for (i, norm) in norms.iter_mut().enumerate() {
                let r = row(i);
                *norm = dot(r, r).sqrt() + NORM_EPS as f32;
                let w = match self.anchor {
                    Anchor::Normalized => 1.0 / *norm,
                    Anchor::Mean => 1.0,
                };
                for (a, x) in acc.iter_mut().zip(r) {
                    *a += x * w;
                }
            }
            // The mean's 1/n cancels in the cosine, up to NORM_EPS; kept for parity.
            let inv_n = 1.0 / n.max(1) as f32;
            acc.iter_mut().for_each(|a| *a *= inv_n);
            let mu_norm = dot(&acc, &acc).sqrt() + NORM_EPS as f32;
            // Pass 2: s_i = −cos(k_i, μ).
            for (i, norm) in norms.iter().enumerate() {
                out[h * n + i] = -dot(row(i), &acc) / (norm * mu_norm);
            }
        }
        out
    }

    /// Other dtypes: each head widened to a contiguous f32 copy first, one head at a time, so
    /// that the copy is one head's keys whatever the number of heads (the cache's stack of
    /// every layer is scored at once).
    fn run_widened<T: WithDType>(
        &self,
        xs: &[T],
        offset: usize,
        dims: (usize, usize, usize),
        st: &[usize],
    ) -> Vec<f32> {
        let (kv, n, d) = dims;
        let mut out = Vec::with_capacity(kv * n);
        let mut wide = Vec::with_capacity(n * d);
        for h in 0..kv {
            wide.clear();
            for i in 0..n {
                let at = offset + h * st[0] + i * st[1];
                wide.extend(xs[at..at + d].iter().map(|x| x.to_f64() as f32));
            }
            out.extend(self.run(&wide, 0, (1, n, d), &[n * d, d, 1]));
        }
        out
    }
}

impl CustomOp1 for KeyDiffOp {
    fn name(&self) -> &'static str {
        "keydiff-scores"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (kv, n, d) = layout.shape().dims3()?;
        let st = layout.stride();
        if st[2] != 1 {
            candle_core::bail!("keydiff-scores needs contiguous key rows");
        }
        let o = layout.start_offset();
        let out = match storage {
            CpuStorage::F32(xs) => self.run(xs, o, (kv, n, d), st),
            CpuStorage::F16(xs) => self.run_widened(xs, o, (kv, n, d), st),
            CpuStorage::BF16(xs) => self.run_widened(xs, o, (kv, n, d), st),
            CpuStorage::F64(xs) => self.run_widened(xs, o, (kv, n, d), st),
            _ => candle_core::bail!("keydiff-scores: unsupported dtype"),
        };
        Ok((CpuStorage::F32(out), Shape::from((kv, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        keydiff_kernels::keydiff_scores(
            storage,
            layout,
            self.anchor == Anchor::Normalized,
            self.loads,
        )
    }
}

impl Policy for KeyDiff {
    /// The fused op reads float keys in place (two passes, no copy); fp8 keys are widened to
    /// f16 and block types dequantized first, which for every layer at once would be a copy
    /// of the whole cache.
    fn scores_layers_together(&self, kv: KvTypes) -> bool {
        matches!(kv.k, KvType::Float(DType::F32 | DType::F16 | DType::BF16))
    }

    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_tensor(layer, None)?.to_vec2::<f32>()?)
    }

    fn score_tensor(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Tensor> {
        keydiff_scores_fused(&layer.keys()?, self.anchor)
    }
}
