//! Chunk attention over the layer's KV cache, GQA without repeating K/V.
//!
//! The chunk's B queries see every cached slot plus the chunk's own earlier tokens: the causal
//! mask is bottom-right aligned. Grouped queries are folded into the row dimension,
//! `[kv_heads, g·B, d]`, so one batched matmul serves all query heads of a KV head.

use candle_core::{DType, Device, Tensor, D};

use crate::error::Result;

/// Additive mask `[B, T]` for a chunk of `chunk` queries whose keys are the last `chunk` of `total`
/// (bottom-right aligned causal): query `i` sees keys `j <= total - chunk + i`.
pub fn chunk_mask(chunk: usize, total: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let past = total - chunk;
    let mask: Vec<f32> = (0..chunk)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j <= past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (chunk, total), device)?.to_dtype(dtype)?)
}

/// Scaled dot-product attention.
///
/// - `q`: `[kv_heads, g·B, d]`, rows ordered (query head within group, token).
/// - `k`, `v`: `[kv_heads, T, d]`, the chunk's own keys last.
/// - `mask`: `[B, T]` or `None` when `B = 1`.
///
/// Returns `[kv_heads, g·B, d]`, and with `stats_rows = Some(r)` the softmax rows of the last
/// `r` queries summed per query head, `[kv_heads, g, T]` in f32 (what TOVA, SnapKV and H2O
/// need). Softmax runs in f32 whatever the input dtype.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    group: usize,
    stats_rows: Option<usize>,
) -> Result<(Tensor, Option<Tensor>)> {
    let probs = attention_probs(q, k, mask, group)?;
    let stats = match stats_rows {
        Some(r) => Some(row_sums(&probs, group, r)?),
        None => None,
    };
    Ok((attention_output(&probs, v)?, stats))
}

/// Attention probabilities in f32, `[kv_heads, g·B, T]`, of grouped queries `q`
/// (`[kv_heads, g·B, d]`) over keys `k` (`[kv_heads, T, d]`), masked bottom-right causal.
pub fn attention_probs(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&Tensor>,
    group: usize,
) -> Result<Tensor> {
    let (kv_heads, rows, d) = q.dims3()?;
    let chunk = rows / group;
    let t = k.dim(1)?;
    let scale = 1.0 / (d as f64).sqrt();
    // [kv, g·B, T]
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
    let scores = match mask {
        Some(m) => scores
            .reshape((kv_heads, group, chunk, t))?
            .broadcast_add(&m.to_dtype(DType::F32)?)?
            .reshape((kv_heads, rows, t))?,
        None => scores,
    };
    Ok(candle_nn::ops::softmax_last_dim(&scores)?)
}

/// The policy statistics: the last `rows` query rows of each query head's probabilities,
/// summed, `[kv_heads, g, T]`.
pub fn row_sums(probs: &Tensor, group: usize, rows: usize) -> Result<Tensor> {
    let (kv_heads, all, t) = probs.dims3()?;
    let chunk = all / group;
    let r = rows.min(chunk);
    Ok(probs
        .reshape((kv_heads, group, chunk, t))?
        .narrow(2, chunk - r, r)?
        .sum(2)?)
}

/// Probabilities times values, `[kv_heads, g·B, d]` in the values' dtype.
pub fn attention_output(probs: &Tensor, v: &Tensor) -> Result<Tensor> {
    Ok(probs.to_dtype(v.dtype())?.matmul(v)?)
}

/// Naive attention probabilities `[kv_heads, g, B, T]` with K/V repeated per query head, the
/// reference for attention statistics in tests.
pub fn probs_naive(q: &Tensor, k: &Tensor, group: usize) -> Result<Tensor> {
    let (kv_heads, rows, d) = q.dims3()?;
    let chunk = rows / group;
    let t = k.dim(1)?;
    let mut out = Vec::new();
    for h in 0..kv_heads {
        for g in 0..group {
            let qh = q.get(h)?.narrow(0, g * chunk, chunk)?;
            let s = (qh.matmul(&k.get(h)?.t()?)? / (d as f64).sqrt())?;
            let m = chunk_mask(chunk, t, DType::F32, q.device())?;
            out.push(candle_nn::ops::softmax(&(s + m)?, D::Minus1)?);
        }
    }
    Ok(Tensor::stack(&out, 0)?.reshape((kv_heads, group, chunk, t))?)
}

/// Reference attention with K/V repeated per query head, for tests: `[kv_heads, g·B, d]`.
pub fn attend_naive(q: &Tensor, k: &Tensor, v: &Tensor, group: usize) -> Result<Tensor> {
    let (kv_heads, rows, d) = q.dims3()?;
    let chunk = rows / group;
    let p = probs_naive(q, k, group)?; // [kv, g, B, T]
    let v = v
        .unsqueeze(1)?
        .broadcast_as((kv_heads, group, v.dim(1)?, d))?;
    Ok(p.matmul(&v.contiguous()?)?
        .reshape((kv_heads, group * chunk, d))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_attention_matches_naive() -> Result<()> {
        let dev = Device::Cpu;
        let (kv, g, b, past, d) = (2, 3, 5, 7, 8);
        let t = past + b;
        let q = Tensor::randn(0f32, 1., (kv, g * b, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
        let m = chunk_mask(b, t, DType::F32, &dev)?;
        let (fast, stats) = attend(&q, &k, &v, Some(&m), g, Some(3))?;
        let slow = attend_naive(&q, &k, &v, g)?;
        let diff = (fast - slow)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "max diff {diff}");
        // Statistics: the last 3 rows of the naive probability matrix, summed.
        let want = probs_naive(&q, &k, g)?.narrow(2, b - 3, 3)?.sum(2)?;
        let diff = (stats.unwrap() - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "stats max diff {diff}");
        Ok(())
    }

    #[test]
    fn mask_is_bottom_right_aligned() -> Result<()> {
        let m = chunk_mask(2, 4, DType::F32, &Device::Cpu)?.to_vec2::<f32>()?;
        assert_eq!(m[0][2], 0.0);
        assert!(m[0][3].is_infinite());
        assert_eq!(m[1][3], 0.0);
        Ok(())
    }
}
