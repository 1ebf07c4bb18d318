//! llama.cpp's rotation of quantized KV caches (its PR 21038, 2026-04): before keys and values
//! are quantized into a cache of a block type (`q8_0`, `q4_0`, ...), each head's keys and the
//! queries are multiplied by an orthonormal Hadamard matrix H, and so are the values, whose
//! attention output is multiplied by H again on its way out (H is symmetric and H·H = I).
//! Scores are unchanged, q·k = (Hq)·(Hk), and so is the output, a sum of rows Hv weighted by
//! the same probabilities; but a key's outlier channels are spread over the whole block, so a
//! block's scale no longer flattens its other values. As llama.cpp: keys are rotated by the
//! largest H (of 64, 128, 256, ... values) that divides the head, values by H of 64, and only
//! where the head is a multiple of 64; a float cache is never rotated.
//!
//! KeyDiff's scores, cosines between keys and their mean, are unchanged by the rotation (an
//! orthonormal map keeps cosines, and the mean of rotated keys is the rotated mean), and so
//! are the attention statistics TOVA, SnapKV and H2O score with.

use candle_core::{DType, Device, Tensor};
use keydiff_cache::KvTypes;

use crate::error::Result;

/// The Hadamard matrices of one model's heads, in its activation dtype on its device.
#[derive(Debug, Clone)]
pub struct KvRotation {
    /// For keys and queries: the largest power of two of at least 64 that divides the head.
    k: Tensor,
    /// For values and the attention output: 64 × 64.
    v: Tensor,
}

impl KvRotation {
    /// The rotation of heads of `head_dim` values; `None` when the head is not a multiple of
    /// 64 (as llama.cpp, which then does not rotate).
    pub fn new(head_dim: usize, dtype: DType, device: &Device) -> Result<Option<Self>> {
        if head_dim == 0 || !head_dim.is_multiple_of(64) {
            return Ok(None);
        }
        let mut nk = 64;
        while head_dim.is_multiple_of(nk * 2) {
            nk *= 2;
        }
        Ok(Some(Self {
            k: hadamard(nk, dtype, device)?,
            v: hadamard(64, dtype, device)?,
        }))
    }

    /// The matrices that apply to a cache of `kv`'s types: keys' when they are blocks,
    /// values' when they are.
    pub fn for_types(&self, kv: KvTypes) -> (Option<&Tensor>, Option<&Tensor>) {
        (
            kv.k.block_bytes().map(|_| &self.k),
            kv.v.block_bytes().map(|_| &self.v),
        )
    }
}

/// Sylvester's Hadamard matrix of order `n` (a power of two), normalised to be orthonormal:
/// `H[i][j] = (-1)^popcount(i & j) / sqrt(n)`, symmetric, `H·H = I`.
pub fn hadamard(n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    if !n.is_power_of_two() {
        return Err(crate::error::ModelError::Unsupported(format!(
            "a Hadamard matrix of order {n}: the order must be a power of two"
        )));
    }
    let s = 1.0 / (n as f32).sqrt();
    let data: Vec<f32> = (0..n * n)
        .map(|ij| {
            let (i, j) = (ij / n, ij % n);
            if (i & j).count_ones() % 2 == 0 {
                s
            } else {
                -s
            }
        })
        .collect();
    Ok(Tensor::from_vec(data, (n, n), device)?.to_dtype(dtype)?)
}

/// `x` with each run of `n` values of its last dimension multiplied by `h` (`[n, n]`), the
/// last dimension a multiple of `n`.
pub fn rotate(x: &Tensor, h: &Tensor) -> Result<Tensor> {
    let n = h.dim(0)?;
    let rows = x.elem_count() / n;
    Ok(x.contiguous()?
        .reshape((rows, n))?
        .matmul(h)?
        .reshape(x.shape())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keydiff_cache::KvType;

    #[test]
    fn hadamard_is_orthonormal_and_its_own_inverse() -> Result<()> {
        for n in [64, 128, 256] {
            let h = hadamard(n, DType::F32, &Device::Cpu)?;
            let hh = h.matmul(&h)?;
            let eye = Tensor::eye(n, DType::F32, &Device::Cpu)?;
            let diff = (hh - eye)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "n {n}: |H·H - I| {diff}");
            assert_eq!(h.t()?.to_vec2::<f32>()?, h.to_vec2::<f32>()?, "symmetric");
        }
        Ok(())
    }

    #[test]
    fn rotation_keeps_dot_products_and_undoes_itself() -> Result<()> {
        let dev = Device::Cpu;
        let r = KvRotation::new(128, DType::F32, &dev)?.expect("heads of 128");
        assert_eq!(r.k.dims(), [128, 128]);
        assert_eq!(r.v.dims(), [64, 64]);
        // [heads, rows, d] queries and keys, an outlier channel in the keys.
        let q = Tensor::randn(0f32, 1., (2, 3, 128), &dev)?;
        let mut kv: Vec<f32> = Tensor::randn(0f32, 1., (2, 5, 128), &dev)?
            .flatten_all()?
            .to_vec1()?;
        for row in kv.chunks_mut(128) {
            row[7] = 200.0;
        }
        let k = Tensor::from_vec(kv, (2, 5, 128), &dev)?;
        let scores = q.matmul(&k.t()?)?;
        let (qr, kr) = (rotate(&q, &r.k)?, rotate(&k, &r.k)?);
        let rotated = qr.matmul(&kr.t()?)?;
        let diff = (&scores - &rotated)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-3, "scores move by {diff}");
        // The outlier is spread: no rotated value is near 200.
        let top = kr.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(top < 50.0, "largest rotated value {top}");
        // Values by H of 64 per run of 64, back again.
        let back = rotate(&rotate(&k, &r.v)?, &r.v)?;
        let diff = (&back - &k)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-3, "H·H·v moves by {diff}");
        Ok(())
    }

    /// KeyDiff scores rotated keys as it scores the keys themselves, under either anchor.
    #[test]
    fn keydiff_scores_do_not_see_the_rotation() -> Result<()> {
        use keydiff_cache::policy::keydiff_scores;
        use keydiff_cache::Anchor;
        let dev = Device::Cpu;
        let r = KvRotation::new(64, DType::F32, &dev)?.unwrap();
        let k = (Tensor::randn(0f32, 1., (2, 40, 64), &dev)? + 0.3)?;
        for anchor in [Anchor::Normalized, Anchor::Mean] {
            let a = keydiff_scores(&k, anchor)?;
            let b = keydiff_scores(&rotate(&k, &r.k)?, anchor)?;
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{anchor:?}: scores move by {diff}");
        }
        Ok(())
    }

    #[test]
    fn sizes_and_types_choose_as_llamacpp() -> Result<()> {
        let dev = Device::Cpu;
        let size = |d| -> Result<Option<(usize, usize)>> {
            Ok(KvRotation::new(d, DType::F32, &dev)?
                .map(|r| (r.k.dim(0).unwrap(), r.v.dim(0).unwrap())))
        };
        assert_eq!(size(64)?, Some((64, 64)));
        assert_eq!(size(128)?, Some((128, 64)));
        assert_eq!(size(256)?, Some((256, 64)));
        assert_eq!(size(192)?, Some((64, 64)));
        assert_eq!(size(96)?, None);
        assert_eq!(size(32)?, None);
        let r = KvRotation::new(64, DType::F32, &dev)?.unwrap();
        let has = |kv: KvTypes| {
            let (k, v) = r.for_types(kv);
            (k.is_some(), v.is_some())
        };
        assert_eq!(has(DType::F16.into()), (false, false));
        assert_eq!(has(DType::F8E4M3.into()), (false, false));
        assert_eq!(has(KvType::Q4_0.into()), (true, true));
        let split = KvTypes {
            k: DType::F16.into(),
            v: KvType::Q8_0,
        };
        assert_eq!(has(split), (false, true));
        Ok(())
    }
}
