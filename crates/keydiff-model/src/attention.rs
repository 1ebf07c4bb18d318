//! Chunk attention over the layer's KV cache, GQA without repeating K/V.
//!
//! The chunk's B queries see every cached slot plus the chunk's own earlier tokens: the causal
//! mask is bottom-right aligned.
//!
//! Two backends ([`AttentionBackend`]):
//! - **eager**: grouped queries are folded into the row dimension, `[kv_heads, g·B, d]`, so one
//!   batched matmul serves all query heads of a KV head; the probabilities `[kv_heads, g·B, T]`
//!   are materialised (softmax in f32), and the statistics of TOVA, SnapKV and H2O are sums of
//!   their rows ([`attention_probs_sums`]).
//!   On CUDA keydiff's causal softmax kernel ([`causal_softmax_cuda`]) takes the scores as the
//!   matmul wrote them and writes the probabilities in the values' dtype; where statistics are
//!   needed, its form with sums ([`softmax_sums_cuda`]) adds them up per key as it writes the
//!   probabilities, so no f32 copy of them is made.
//! - **flash**: a fused kernel that never materialises the scores (candle-flash-attn on CUDA with
//!   the `flash-attn` feature, candle-nn's flash attention on the CPU), reading the cache in
//!   place through a `[1, T, kv_heads, d]` view. Policies that need statistics get them from an
//!   extra pass over only the query rows they use ([`stats_pass`]): one row for TOVA, the window
//!   for SnapKV, every row for H2O. That extra pass is the cost KeyDiff does not pay.
//!
//! A chunk of one token (a decode step, or `--chunk 1`) on the CPU in f32 runs
//! [`decode_attention_cpu`] (module `decode_kernel`) under either backend: flash-decoding over
//! blocks of the cache, without candle's GEMMs, reading an f32, f16 or bf16 cache.
//!
//! A cache held in another dtype than the activations (`--kv-dtype`) is given to the general
//! path as a converted copy of the view, so flash then no longer reads the cache in place.

use std::str::FromStr;

use candle_core::{DType, Device, Tensor, D};

pub use crate::decode_kernel::{
    causal_softmax_cuda, decode_attention_cpu, decode_attention_cpu_blocks, decode_attention_cuda,
    decode_attention_cuda_kvq, softmax_sums_cuda, widen_cache_view,
};
use crate::error::{ModelError, Result};

/// How chunk attention is computed (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionBackend {
    /// Materialised probabilities with candle matmuls and softmax (every device and dtype;
    /// one-token chunks on the CPU in f32 take [`decode_attention_cpu`]).
    #[default]
    Eager,
    /// Fused flash attention; statistics from an extra pass.
    Flash,
    /// The best backend that can run the loaded model here, chosen when the model is loaded
    /// ([`Self::resolve`]); a loaded model never runs with `Auto` itself.
    Auto,
}

impl AttentionBackend {
    /// The backend's name, as `--attention` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Eager => "eager",
            Self::Flash => "flash",
            Self::Auto => "auto",
        }
    }

    /// The backend a model with heads of `head_dim`, on `device` with activations of `dtype`,
    /// runs with: `Auto` becomes flash where this build can run it there (CUDA, the
    /// `flash-attn` feature with the kernel for these heads (logged when it lacks it), bf16/f16,
    /// head_dim a multiple of 8 up to 256; on the CPU eager is
    /// faster for chunks: its matmuls are GEMMs, candle-nn's CPU kernel is not; one-token
    /// chunks run [`decode_attention_cpu`] under both) and eager otherwise. An
    /// explicit choice is kept, or refused when it cannot run ([`Self::check`]), so that it
    /// fails when the model is loaded rather than in the first chunk.
    pub fn resolve(self, device: &Device, dtype: DType, head_dim: usize) -> Result<Self> {
        match self {
            Self::Auto => {
                if let (Some(why), true) = (flash_cannot_run_on(device), FLASH_KERNELS.is_some()) {
                    tracing::info!("attention: eager, since {why}");
                    return Ok(Self::Eager);
                }
                let chosen = Self::auto(device.is_cuda(), FLASH_KERNELS, dtype, head_dim);
                if let (Self::Eager, true, Some(kernels), Some(kernel)) = (
                    chosen,
                    device.is_cuda(),
                    FLASH_KERNELS,
                    flash_kernel(dtype, head_dim),
                ) {
                    tracing::info!(
                        "attention: eager, since this build's flash kernels ({kernels}) lack \
                         {kernel} for heads of {head_dim} in {dtype:?}"
                    );
                }
                Ok(chosen)
            }
            explicit => {
                explicit.check(device, dtype, head_dim)?;
                Ok(explicit)
            }
        }
    }

    /// `Auto`'s rule, with the build ([`FLASH_KERNELS`]) and device as arguments so that tests
    /// cover every branch.
    fn auto(cuda: bool, flash: Option<&str>, dtype: DType, head_dim: usize) -> Self {
        let built =
            |kernels| flash_kernel(dtype, head_dim).is_some_and(|k| kernel_built(kernels, &k));
        if cuda && flash.is_some_and(built) {
            Self::Flash
        } else {
            Self::Eager
        }
    }

    /// Checks that this build can run the backend on `device` with activations of `dtype` and
    /// heads of `head_dim` (`Auto` always can: it falls back to eager).
    pub fn check(self, device: &Device, dtype: DType, head_dim: usize) -> Result<()> {
        if self != Self::Flash {
            return Ok(());
        }
        let unsupported =
            |why: String| Err(ModelError::Unsupported(format!("--attention flash: {why}")));
        match device {
            Device::Cpu => {
                if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
                    return unsupported(format!(
                        "dtype {dtype:?} (the CPU kernel takes f32, f16, bf16)"
                    ));
                }
                Ok(())
            }
            Device::Cuda(_) => {
                if !cfg!(feature = "flash-attn") {
                    return unsupported(
                        "this binary was built without the `flash-attn` feature (build with \
                         `--features flash-attn`, see GPU.md)"
                            .into(),
                    );
                }
                if let Some(why) = flash_cannot_run_on(device) {
                    return unsupported(why);
                }
                if !matches!(dtype, DType::F16 | DType::BF16) {
                    return unsupported(format!(
                        "dtype {dtype:?} on CUDA (flash attention takes bf16 or f16)"
                    ));
                }
                let Some(kernel) = flash_kernel(dtype, head_dim) else {
                    return unsupported(format!(
                        "head_dim {head_dim} (flash attention takes multiples of 8 up to 256)"
                    ));
                };
                let kernels = FLASH_KERNELS.unwrap_or_default();
                if !kernel_built(kernels, &kernel) {
                    return unsupported(format!(
                        "heads of {head_dim} in {dtype:?} need the {kernel} kernels, and this \
                         binary was built with only `{kernels}` (KEYDIFF_FLASH_KERNELS; see \
                         scripts/build-cuda.sh)"
                    ));
                }
                Ok(())
            }
            other => unsupported(format!("device {other:?}")),
        }
    }
}

/// The FlashAttention kernels this binary holds: `None` without the `flash-attn` feature; with
/// it, the names `KEYDIFF_FLASH_KERNELS` listed when it was built (`scripts/cuda/flash-nvcc.sh`
/// builds only those; the others are stubs that abort), or `""` for all of candle-flash-attn's.
pub const FLASH_KERNELS: Option<&str> = if cfg!(feature = "flash-attn") {
    match option_env!("KEYDIFF_FLASH_KERNELS") {
        Some(kernels) => Some(kernels),
        None => Some(""),
    }
} else {
    None
};

/// Why this build's flash kernels cannot run on `device`, a GPU of another architecture than
/// the build's: they are machine code for the build's target (see `keydiff_cache::arch`).
/// `None` where they can, or where the build's target is unknown.
fn flash_cannot_run_on(device: &Device) -> Option<String> {
    use keydiff_cache::arch::{device_fit, Fit};
    device_fit(device).filter(|f| f.fit != Fit::All).map(|f| {
        format!(
            "{}; flash attention's kernels are machine code for {}: {}",
            f.describe(),
            f.arch.runs_on(),
            f.remedy(true)
        )
    })
}

/// The kernel (as candle-flash-attn's files name it, `hdim128_bf16`) that runs heads of
/// `head_dim` in `dtype`, or `None` where FlashAttention-2 has none: its CUDA kernels take bf16
/// and f16, head sizes that are multiples of 8 up to 256, rounded up to its buckets as its
/// `HEADDIM_SWITCH` does.
fn flash_kernel(dtype: DType, head_dim: usize) -> Option<String> {
    let dtype = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
        _ => return None,
    };
    if !head_dim.is_multiple_of(8) {
        return None;
    }
    let bucket = [32, 64, 96, 128, 160, 192, 224, 256]
        .into_iter()
        .find(|&b| head_dim <= b)?;
    Some(format!("hdim{bucket}_{dtype}"))
}

/// Whether `kernels` (a [`FLASH_KERNELS`] list; empty: all) has `kernel`.
fn kernel_built(kernels: &str, kernel: &str) -> bool {
    kernels.trim().is_empty() || kernels.split_whitespace().any(|k| k == kernel)
}

impl FromStr for AttentionBackend {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "eager" => Ok(Self::Eager),
            "flash" => Ok(Self::Flash),
            "auto" => Ok(Self::Auto),
            other => Err(ModelError::Unsupported(format!(
                "attention backend `{other}` (expected auto, eager or flash)"
            ))),
        }
    }
}

impl std::fmt::Display for AttentionBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Flash attention of a chunk over the cache.
///
/// - `q`: `[1, B, heads, d]`, the chunk's queries (only the last dim needs stride 1).
/// - `k`, `v`: `[1, T, kv_heads, d]`, the cache with the chunk's own keys last (views of the
///   cache buffers are read in place on CUDA).
///
/// Returns `[B, heads·d]` in `q`'s dtype. Causal is bottom-right aligned, as in [`chunk_mask`].
pub fn flash_attend(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, b, h, d) = q.dims4()?;
    let t = k.dim(1)?;
    if t < b {
        return Err(ModelError::Shape(format!("{b} queries over {t} keys")));
    }
    let scale = 1.0 / (d as f32).sqrt();
    match q.device() {
        Device::Cpu => {
            use candle_nn::attention::{flash_attn, AttnMask};
            let mask = AttnMask::causal_with_offset(t - b);
            // candle-nn returns `[1, heads, B, d]`.
            let y = match q.dtype() {
                DType::F32 => flash_attn::<f32>(q, k, v, scale, mask, None, None)?,
                DType::F16 => flash_attn::<half::f16>(q, k, v, scale, mask, None, None)?,
                DType::BF16 => flash_attn::<half::bf16>(q, k, v, scale, mask, None, None)?,
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "flash attention on the CPU in {other:?}"
                    )))
                }
            };
            // Its f16/bf16 kernels return f32: back to q's dtype, as on CUDA and in eager.
            let y = y.squeeze(0)?.transpose(0, 1)?.reshape((b, h * d))?;
            Ok(y.to_dtype(q.dtype())?)
        }
        #[cfg(feature = "flash-attn")]
        Device::Cuda(_) => {
            // `[1, B, heads, d]`, contiguous. Causal (bottom-right) only matters for B > 1.
            let y = candle_flash_attn::flash_attn(q, k, v, scale, b > 1)?;
            Ok(y.reshape((b, h * d))?)
        }
        other => Err(ModelError::Unsupported(format!(
            "flash attention on {other:?} (CUDA needs the `flash-attn` feature)"
        ))),
    }
}

/// The policy statistics without the full probability matrix: the probabilities of only the
/// last `rows` queries of each query head (`q`: `[kv_heads, g, B, d]`, rows in token order)
/// over the keys `k` (`[kv_heads, T, d]`), summed per query head, `[kv_heads, g, T]` in f32.
/// Equal to [`row_sums`] of the eager probabilities.
pub fn stats_pass(q: &Tensor, k: &Tensor, rows: usize) -> Result<Tensor> {
    let (kv_heads, g, b, d) = q.dims4()?;
    let r = rows.min(b);
    let t = k.dim(1)?;
    let qr = q
        .narrow(2, b - r, r)?
        .contiguous()?
        .reshape((kv_heads, g * r, d))?;
    let mask = if r > 1 {
        Some(chunk_mask(r, t, DType::F32, q.device())?)
    } else {
        None
    };
    Ok(attention_probs_sums(&qr, k, mask.as_ref(), g, r, None)?.1)
}

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
    match stats_rows {
        Some(r) => {
            let (probs, sums) = attention_probs_sums(q, k, mask, group, r, Some(v.dtype()))?;
            let probs = probs.ok_or_else(|| ModelError::Shape("no probabilities".into()))?;
            Ok((attention_output(&probs, v)?, Some(sums)))
        }
        None => {
            let probs = attention_probs_in(q, k, mask, group, v.dtype())?;
            Ok((attention_output(&probs, v)?, None))
        }
    }
}

/// Attention probabilities in f32, `[kv_heads, g·B, T]`, of grouped queries `q`
/// (`[kv_heads, g·B, d]`) over keys `k` (`[kv_heads, T, d]`), masked bottom-right causal:
/// `mask` is [`chunk_mask`]`(B, T)`, or `None` when B = 1.
pub fn attention_probs(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&Tensor>,
    group: usize,
) -> Result<Tensor> {
    attention_probs_in(q, k, mask, group, DType::F32)
}

/// [`attention_probs`] in `dtype`: the values' dtype for the value product, f32 where they
/// are summed ([`attention_probs_sums`] makes both at once). Softmax runs in f32 either way.
/// On CUDA keydiff's causal softmax kernel ([`causal_softmax_cuda`]) reads the scores as the
/// matmul wrote them and writes the probabilities in `dtype` in one launch, applying the mask
/// by index; elsewhere (or with `KEYDIFF_CUDA_SOFTMAX_KERNEL=0`) candle's ops cast the scores
/// to f32, add `mask`, take the softmax and cast the result.
pub fn attention_probs_in(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&Tensor>,
    group: usize,
    dtype: DType,
) -> Result<Tensor> {
    let rows = q.dim(1)?;
    masked_softmax(&attention_scores(q, k)?, mask, rows / group, dtype)
}

/// The scaled scores q · kᵀ / √d, `[kv_heads, g·B, T]` in q's dtype, of grouped queries `q`
/// (`[kv_heads, g·B, d]`) over keys `k` (`[kv_heads, T, d]`).
fn attention_scores(q: &Tensor, k: &Tensor) -> Result<Tensor> {
    let d = q.dim(2)?;
    let scale = 1.0 / (d as f64).sqrt();
    // The scale goes on q first: unscaled q·k products in f16 overflow (65504) on models with
    // large q/k biases such as Qwen2.5, and cuBLAS writes f16 results.
    Ok((q * scale)?.matmul(&k.t()?)?)
}

/// [`attention_probs`] with the policies' statistics: the probabilities in `probs` (f32 or the
/// scores' dtype; `None`: not made) and [`row_sums`] of the last `rows` queries of each query
/// head, `[kv_heads, g, T]` in f32. On CUDA keydiff's kernels ([`softmax_sums_cuda`]) sum the
/// probabilities as they write them (or without writing them); elsewhere the f32
/// probabilities of [`masked_softmax`] are summed by [`row_sums`] and cast, the kernels'
/// reference.
pub fn attention_probs_sums(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&Tensor>,
    group: usize,
    rows: usize,
    probs: Option<DType>,
) -> Result<(Option<Tensor>, Tensor)> {
    let chunk = q.dim(1)? / group;
    masked_softmax_sums(&attention_scores(q, k)?, mask, chunk, group, rows, probs)
}

/// The softmax of [`attention_probs_sums`]: `scores` `[kv_heads, g·chunk, T]`, rows ordered
/// (query head within group, token), plus `mask` ([`chunk_mask`]`(chunk, T)`, or `None` for one
/// query). Returns the probabilities in `probs` and the sums over the last `rows` queries of
/// each query head, `[kv_heads, g, T]` in f32.
pub fn masked_softmax_sums(
    scores: &Tensor,
    mask: Option<&Tensor>,
    chunk: usize,
    group: usize,
    rows: usize,
    probs: Option<DType>,
) -> Result<(Option<Tensor>, Tensor)> {
    let (kv, _, t) = scores.dims3()?;
    let r = rows.min(chunk);
    if is_causal(mask, chunk, t) {
        if let Some((p, sums)) = softmax_sums_cuda(scores, chunk, r, probs)? {
            return Ok((p, sums.reshape((kv, group, t))?));
        }
    }
    let p = masked_softmax(scores, mask, chunk, DType::F32)?;
    let sums = row_sums(&p, group, r)?;
    let p = match probs {
        Some(dt) => Some(p.to_dtype(dt)?),
        None => None,
    };
    Ok((p, sums))
}

/// Whether `mask` is the one the causal kernels apply by index: [`chunk_mask`]`(chunk, t)`, or
/// none for one query.
fn is_causal(mask: Option<&Tensor>, chunk: usize, t: usize) -> bool {
    match mask {
        Some(m) => m.dims() == [chunk, t],
        None => chunk == 1,
    }
}

/// The softmax of [`attention_probs_in`]: `scores` `[heads, chunk, T]` (or any shape whose
/// rows run over the chunk's queries in order and whose last dim is T), plus `mask`
/// ([`chunk_mask`]`(chunk, T)`, or `None` for one query), softmax in f32, in `dtype`. On CUDA
/// keydiff's kernel ([`causal_softmax_cuda`]); candle's ops elsewhere, the kernel's reference.
pub fn masked_softmax(
    scores: &Tensor,
    mask: Option<&Tensor>,
    chunk: usize,
    dtype: DType,
) -> Result<Tensor> {
    let t = scores.dims().last().copied().unwrap_or(0);
    // The kernel masks by index: it takes the mask `chunk_mask` makes, or none for one query.
    if is_causal(mask, chunk, t) {
        if let Some(p) = causal_softmax_cuda(scores, chunk, dtype)? {
            return Ok(p);
        }
    }
    let f = scores.to_dtype(DType::F32)?;
    let f = match mask {
        Some(m) => {
            let rows = f.elem_count() / t.max(1);
            f.reshape((rows / chunk.max(1), chunk, t))?
                .broadcast_add(&m.to_dtype(DType::F32)?)?
                .reshape(scores.shape())?
        }
        None => f,
    };
    Ok(candle_nn::ops::softmax_last_dim(&f)?.to_dtype(dtype)?)
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

    /// `[kv, g·B, d]` grouped rows (query head within group, token) as flash's `[1, B, heads, d]`.
    fn as_flash_q(q: &Tensor, kv: usize, g: usize, b: usize) -> Result<Tensor> {
        let d = q.dim(2)?;
        Ok(q.reshape((kv * g, b, d))?.transpose(0, 1)?.unsqueeze(0)?)
    }

    /// `[kv, T, d]` as flash's `[1, T, kv, d]` view (not contiguous, as the cache is read).
    fn as_flash_kv(k: &Tensor) -> Result<Tensor> {
        Ok(k.transpose(0, 1)?.unsqueeze(0)?)
    }

    /// Eager output `[kv, g·B, d]` as `[B, heads·d]`.
    fn eager_rows(y: &Tensor, heads: usize, b: usize) -> Result<Tensor> {
        let d = y.dim(2)?;
        Ok(y.reshape((heads, b, d))?
            .transpose(0, 1)?
            .reshape((b, heads * d))?)
    }

    #[test]
    fn flash_matches_eager_on_the_cpu() -> Result<()> {
        let dev = Device::Cpu;
        // (kv heads, group, chunk, past, head dim): GQA and MHA, a decode step, no past.
        for (kv, g, b, past, d) in [
            (2, 3, 5, 7, 8),
            (2, 4, 32, 100, 64),
            (1, 1, 16, 0, 16),
            (3, 2, 1, 40, 32),
        ] {
            let t = past + b;
            let q = Tensor::randn(0f32, 1., (kv, g * b, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
            let v = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
            let m = (b > 1)
                .then(|| chunk_mask(b, t, DType::F32, &dev))
                .transpose()?;
            let (eager, _) = attend(&q, &k, &v, m.as_ref(), g, None)?;
            let eager = eager_rows(&eager, kv * g, b)?;
            let fq = as_flash_q(&q, kv, g, b)?;
            let flash = flash_attend(&fq, &as_flash_kv(&k)?, &as_flash_kv(&v)?)?;
            assert_eq!(flash.dims(), &[b, kv * g * d]);
            let diff = (&flash - &eager)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff < 1e-5,
                "{kv}x{g} B={b} past={past} d={d}: max diff {diff}"
            );
            // Half precision: the same up to bf16 rounding of inputs and output.
            let cast = |x: &Tensor| x.to_dtype(DType::BF16);
            let flash16 = flash_attend(
                &cast(&fq)?,
                &cast(&as_flash_kv(&k)?)?,
                &cast(&as_flash_kv(&v)?)?,
            )?;
            // In the input's dtype: the next layer's matmuls need it.
            assert_eq!(flash16.dtype(), DType::BF16);
            let diff = (flash16.to_dtype(DType::F32)? - &eager)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 0.05, "bf16 {kv}x{g} B={b}: max diff {diff}");
        }
        Ok(())
    }

    /// Unscaled q·k products past f16's range (65504) must not turn into inf/NaN: the scale is
    /// applied to q before the product.
    #[test]
    fn f16_scores_do_not_overflow() -> Result<()> {
        let dev = Device::Cpu;
        let (kv, b, t, d) = (1, 4, 6, 64);
        // Every query and key is ±40 with the same signs, but one key flipped:
        // q·k = ±64 · 40 · 40 = ±102400 unscaled, ±12800 scaled.
        let signs = Tensor::randn(0f32, 1., (kv, 1, d), &dev)?.sign()?;
        let q = (signs.broadcast_as((kv, b, d))? * 40.0)?;
        let flip = Tensor::new(&[1f32, -1., 1., 1., 1., 1.], &dev)?.reshape((1, t, 1))?;
        let k = (signs.broadcast_mul(&flip)? * 40.0)?;
        let mask = chunk_mask(b, t, DType::F32, &dev)?;
        let want = attention_probs(&q, &k, Some(&mask), 1)?;
        let half = |x: &Tensor| x.to_dtype(DType::F16);
        let got = attention_probs(&half(&q)?, &half(&k)?, Some(&half(&mask)?), 1)?;
        let got = got.flatten_all()?.to_vec1::<f32>()?;
        assert!(got.iter().all(|p| p.is_finite()), "{got:?}");
        let want = want.flatten_all()?.to_vec1::<f32>()?;
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-2, "max error {err}");
        Ok(())
    }

    #[test]
    fn flash_refuses_more_queries_than_keys() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 4, 2, 8), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 3, 2, 8), DType::F32, &dev)?;
        let err = flash_attend(&q, &k, &k).expect_err("4 queries over 3 keys");
        assert!(err.to_string().contains("4 queries over 3 keys"), "{err}");
        Ok(())
    }

    #[test]
    fn stats_pass_equals_eager_row_sums() -> Result<()> {
        let dev = Device::Cpu;
        let (kv, g, b, past, d) = (2, 3, 9, 11, 8);
        let t = past + b;
        let q = Tensor::randn(0f32, 1., (kv, g * b, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
        let m = chunk_mask(b, t, DType::F32, &dev)?;
        // TOVA (1 row), SnapKV (a window), H2O (every row), and more rows than the chunk has.
        for rows in [1, 4, b, b + 5] {
            let (_, want) = attend(&q, &k, &v, Some(&m), g, Some(rows))?;
            let got = stats_pass(&q.reshape((kv, g, b, d))?, &k, rows)?;
            let diff = (got - want.unwrap())?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-5, "rows {rows}: max diff {diff}");
        }
        Ok(())
    }

    #[test]
    fn backend_names_and_checks() -> Result<()> {
        use AttentionBackend::{Auto, Eager, Flash};
        let cpu = Device::Cpu;
        for b in [Eager, Flash, Auto] {
            assert_eq!(b.name().parse::<AttentionBackend>()?, b);
        }
        assert_eq!(Auto.resolve(&cpu, DType::BF16, 64)?, Eager);
        assert_eq!(Flash.resolve(&cpu, DType::F32, 64)?, Flash);
        assert_eq!(Eager.resolve(&cpu, DType::F64, 7)?, Eager);
        // auto picks flash only where it can run: CUDA, a flash build, half precision, and a
        // head size the kernels take.
        let all = Some("");
        assert_eq!(AttentionBackend::auto(true, all, DType::BF16, 128), Flash);
        assert_eq!(AttentionBackend::auto(true, all, DType::F16, 256), Flash);
        assert_eq!(AttentionBackend::auto(true, all, DType::F32, 128), Eager);
        assert_eq!(AttentionBackend::auto(true, None, DType::BF16, 128), Eager);
        assert_eq!(AttentionBackend::auto(false, all, DType::BF16, 128), Eager);
        assert_eq!(AttentionBackend::auto(true, all, DType::BF16, 260), Eager);
        assert_eq!(AttentionBackend::auto(true, all, DType::BF16, 100), Eager);
        // A build with some of the kernels (scripts/cuda/flash-nvcc.sh) takes flash only for
        // the heads and dtypes they cover.
        let some = Some("hdim32_bf16 hdim128_bf16");
        assert_eq!(AttentionBackend::auto(true, some, DType::BF16, 128), Flash);
        assert_eq!(AttentionBackend::auto(true, some, DType::BF16, 120), Flash);
        assert_eq!(AttentionBackend::auto(true, some, DType::BF16, 16), Flash);
        assert_eq!(AttentionBackend::auto(true, some, DType::BF16, 64), Eager);
        assert_eq!(AttentionBackend::auto(true, some, DType::F16, 128), Eager);
        let err = "sdpa"
            .parse::<AttentionBackend>()
            .expect_err("unknown backend");
        assert!(err.to_string().contains("`sdpa`"), "{err}");
        let err = Flash
            .resolve(&cpu, DType::F64, 64)
            .expect_err("f64 on the CPU kernel");
        assert!(err.to_string().contains("F64"), "{err}");
        Ok(())
    }

    #[test]
    fn flash_kernels_are_named_as_candle_flash_attn_files() {
        // flash_fwd_hdim{bucket}_{bf16,fp16}[_causal]_sm80.cu; HEADDIM_SWITCH rounds up.
        let name = |dtype, d| flash_kernel(dtype, d);
        assert_eq!(name(DType::BF16, 8).as_deref(), Some("hdim32_bf16"));
        assert_eq!(name(DType::BF16, 32).as_deref(), Some("hdim32_bf16"));
        assert_eq!(name(DType::F16, 40).as_deref(), Some("hdim64_fp16"));
        assert_eq!(name(DType::BF16, 72).as_deref(), Some("hdim96_bf16"));
        assert_eq!(name(DType::BF16, 128).as_deref(), Some("hdim128_bf16"));
        assert_eq!(name(DType::F16, 136).as_deref(), Some("hdim160_fp16"));
        assert_eq!(name(DType::BF16, 256).as_deref(), Some("hdim256_bf16"));
        assert_eq!(name(DType::BF16, 264), None);
        assert_eq!(name(DType::BF16, 100), None);
        assert_eq!(name(DType::F32, 128), None);
        assert!(kernel_built("", "hdim96_bf16"));
        assert!(kernel_built(" hdim64_bf16  hdim96_bf16\n", "hdim96_bf16"));
        assert!(!kernel_built("hdim64_bf16", "hdim64_fp16"));
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
