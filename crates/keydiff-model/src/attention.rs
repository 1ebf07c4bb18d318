//! Chunk attention over the layer's KV cache, GQA without repeating K/V.
//!
//! The chunk's B queries see every cached slot plus the chunk's own earlier tokens: the causal
//! mask is bottom-right aligned.
//!
//! Two backends ([`AttentionBackend`]):
//! - **eager**: grouped queries are folded into the row dimension, `[kv_heads, g·B, d]`, so one
//!   batched matmul serves all query heads of a KV head; the probabilities `[kv_heads, g·B, T]`
//!   are materialised in f32, and the statistics of TOVA, SnapKV and H2O are sums of their rows.
//! - **flash**: a fused kernel that never materialises the scores (candle-flash-attn on CUDA with
//!   the `flash-attn` feature, candle-nn's flash attention on the CPU), reading the cache in
//!   place through a `[1, T, kv_heads, d]` view. Policies that need statistics get them from an
//!   extra pass over only the query rows they use ([`stats_pass`]): one row for TOVA, the window
//!   for SnapKV, every row for H2O. That extra pass is the cost KeyDiff does not pay.
//!
//! A chunk of one token (a decode step, or `--chunk 1`) on the CPU in f32 runs
//! [`decode_attention_cpu`] under either backend: flash-decoding over blocks of the cache,
//! without candle's GEMMs.

use std::str::FromStr;

use candle_core::{DType, Device, Tensor, D};

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
    /// `flash-attn` feature, bf16/f16, head_dim a multiple of 8 up to 256; on the CPU eager is
    /// faster for chunks: its matmuls are GEMMs, candle-nn's CPU kernel is not; one-token
    /// chunks run [`decode_attention_cpu`] under both) and eager otherwise. An
    /// explicit choice is kept, or refused when it cannot run ([`Self::check`]), so that it
    /// fails when the model is loaded rather than in the first chunk.
    pub fn resolve(self, device: &Device, dtype: DType, head_dim: usize) -> Result<Self> {
        match self {
            Self::Auto => Ok(Self::auto(
                device.is_cuda(),
                cfg!(feature = "flash-attn"),
                dtype,
                head_dim,
            )),
            explicit => {
                explicit.check(device, dtype, head_dim)?;
                Ok(explicit)
            }
        }
    }

    /// `Auto`'s rule, with the build and device as arguments so that tests cover every branch.
    fn auto(cuda: bool, flash_built: bool, dtype: DType, head_dim: usize) -> Self {
        if cuda
            && flash_built
            && matches!(dtype, DType::BF16 | DType::F16)
            && flash_head_dim(head_dim)
        {
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
                if !matches!(dtype, DType::F16 | DType::BF16) {
                    return unsupported(format!(
                        "dtype {dtype:?} on CUDA (flash attention takes bf16 or f16)"
                    ));
                }
                if !flash_head_dim(head_dim) {
                    return unsupported(format!(
                        "head_dim {head_dim} (flash attention takes multiples of 8 up to 256)"
                    ));
                }
                Ok(())
            }
            other => unsupported(format!("device {other:?}")),
        }
    }
}

/// Head sizes FlashAttention-2's CUDA kernels take.
fn flash_head_dim(head_dim: usize) -> bool {
    head_dim.is_multiple_of(8) && head_dim <= 256
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
    let probs = attention_probs(&qr, k, mask.as_ref(), g)?;
    row_sums(&probs, g, r)
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
    // [kv, g·B, T]. The scale goes on q first: unscaled q·k products in f16 overflow (65504)
    // on models with large q/k biases such as Qwen2.5, and cuBLAS writes f16 results.
    let scores = (q * scale)?.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    let scores = match mask {
        Some(m) => scores
            .reshape((kv_heads, group, chunk, t))?
            .broadcast_add(&m.to_dtype(DType::F32)?)?
            .reshape((kv_heads, rows, t))?,
        None => scores,
    };
    Ok(candle_nn::ops::softmax_last_dim(&scores)?)
}

/// Keys per unit of work in [`decode_attention_cpu`].
const DECODE_ROWS: usize = 256;

/// One decode step's attention on the CPU, without GEMMs: the eager result for a single f32
/// query row per head over a cache held in f32, f16 or bf16, or `None` when the inputs are not
/// that, on the CPU with contiguous head rows and a head size of 64, 128 or 256 (the caller
/// then takes the general path).
///
/// - `q`: `[kv_heads, g, d]` f32; `k`, `v`: `[kv_heads, T, d]`, views of the cache read in
///   place, both of one dtype. f16/bf16 rows are widened to f32 as they are read, so the result
///   is the eager one over the widened cache.
/// - Returns `[kv_heads, g, d]`, and with `probs` the softmax rows `[kv_heads, g, T]` in f32
///   (TOVA's and H2O's statistics of a decode step).
///
/// Why not candle's matmuls: for one query row they run GEMMs of 1–7 rows, and the gemm crate
/// packs the whole K and V views into its own layout on every call (measured: 0.6 ms per
/// SmolLM2 layer at 1,700 slots, most of a decode step). A decode step reads the whole cache
/// for little arithmetic, so the work is laid out for memory, as in flash-decoding: a unit is
/// [`DECODE_ROWS`] keys of one KV head, whose K and V rows are read once, by one thread, for
/// all g query heads of the group. It gives, per query head, exp(score - the unit's max), their
/// sum, and the value rows weighted by them; the units are then merged with the usual rescaling
/// by exp(unit max - max). Units run on candle's CPU thread pool, the one its quantized matmuls
/// use, so no second pool competes for the cores. Checked against
/// [`attention_probs`]/[`attention_output`] in the tests.
pub fn decode_attention_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: bool,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    use candle_core::{CpuStorage, Storage};
    let (kv_heads, g, d) = q.dims3()?;
    let (kh, t, kd) = k.dims3()?;
    if (kh, kd) != (kv_heads, d) || v.dim(0)? != kh || v.dim(1)? != t || t == 0 || d == 0 {
        return Err(ModelError::Shape(format!(
            "decode attention: q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if v.dims() != k.dims() {
        // Values of another head size than keys: the general path.
        return Ok(None);
    }
    if !matches!(d, 64 | 128 | 256) {
        return Ok(None);
    }
    let on_cpu = q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu();
    if !on_cpu || q.dtype() != DType::F32 || k.dtype() != v.dtype() {
        return Ok(None);
    }
    // Element offset of head 0, the stride between heads and between rows; rows themselves
    // must be contiguous.
    let rows_of = |x: &Tensor| -> Option<Layout3> {
        let l = x.layout();
        let st = l.stride();
        (st[2] == 1).then_some((l.start_offset(), st[0], st[1]))
    };
    let (Some(kl), Some(vl)) = (rows_of(k), rows_of(v)) else {
        return Ok(None);
    };
    let q = (q * (1.0 / (d as f64).sqrt()))?.contiguous()?;
    let (qs, _) = q.storage_and_layout();
    let (ks, _) = k.storage_and_layout();
    let (vs, _) = v.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(qd)) = &*qs else {
        return Ok(None);
    };
    let qd = &qd[q.layout().start_offset()..][..kv_heads * g * d];
    let shape = (kv_heads, g, d, t);
    let (out, probs_out) = match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => {
            decode_typed(qd, (kd, kl), (vd, vl), shape, probs)?
        }
        (Storage::Cpu(CpuStorage::F16(kd)), Storage::Cpu(CpuStorage::F16(vd))) => {
            decode_typed(qd, (kd, kl), (vd, vl), shape, probs)?
        }
        (Storage::Cpu(CpuStorage::BF16(kd)), Storage::Cpu(CpuStorage::BF16(vd))) => {
            decode_typed(qd, (kd, kl), (vd, vl), shape, probs)?
        }
        _ => return Ok(None),
    };
    drop((qs, ks, vs));
    let y = Tensor::from_vec(out, (kv_heads, g, d), q.device())?;
    let p = match probs_out {
        Some(p) => Some(Tensor::from_vec(p, (kv_heads, g, t), q.device())?),
        None => None,
    };
    Ok(Some((y, p)))
}

/// Element offset of head 0, stride between heads, stride between rows.
type Layout3 = (usize, usize, usize);

/// [`decode_attention_cpu`] on the raw data of a cache whose elements are `E`: the output
/// `[kv_heads, g, d]` and, with `probs`, the probabilities `[kv_heads, g, T]`.
fn decode_typed<E: KvElem>(
    qd: &[f32],
    (kd, kl): (&[E], Layout3),
    (vd, vl): (&[E], Layout3),
    (kv_heads, g, d, t): (usize, usize, usize, usize),
    probs: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    use std::sync::OnceLock;
    let unit: DecodeUnit<E> = match d {
        64 => decode_unit::<64, E>,
        128 => decode_unit::<128, E>,
        256 => decode_unit::<256, E>,
        _ => {
            return Err(ModelError::Shape(format!(
                "decode attention: head size {d}"
            )))
        }
    };
    let head = |data, (off, head, row): Layout3, h: usize| Rows {
        data,
        start: off + h * head,
        stride: row,
    };
    let blocks = t.div_ceil(DECODE_ROWS);
    // Each unit fills its own slot, no lock shared between units.
    let slots: Vec<OnceLock<UnitOut>> = (0..kv_heads * blocks).map(|_| OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(slots.len(), |range| {
        for u in range {
            let (h, b) = (u / blocks, u % blocks);
            let r0 = b * DECODE_ROWS;
            let n = DECODE_ROWS.min(t - r0);
            let (keys, values) = (head(kd, kl, h), head(vd, vl, h));
            let mut out = UnitOut {
                max_sum: Vec::with_capacity(g),
                partial: vec![0f32; g * d],
                e: vec![0f32; g * n],
            };
            for (j, (e, acc)) in out
                .e
                .chunks_exact_mut(n)
                .zip(out.partial.chunks_exact_mut(d))
                .enumerate()
            {
                let row = h * g + j;
                out.max_sum
                    .push(unit(&qd[row * d..][..d], keys, values, r0, e, acc));
            }
            // Each index comes once from `execute_chunked`: the slot is empty.
            let _ = slots[u].set(out);
        }
    });
    let slots = slots
        .into_iter()
        .map(|s| {
            s.into_inner()
                .ok_or_else(|| ModelError::Shape("decode attention: a unit did not run".into()))
        })
        .collect::<Result<Vec<_>>>()?;
    // Merge per query head: unit b counts exp(max_b - max) / sum over units of
    // sum_b · exp(max_b - max).
    let mut out = vec![0f32; kv_heads * g * d];
    let mut probs_out = vec![0f32; if probs { kv_heads * g * t } else { 0 }];
    let mut coef = vec![0f32; blocks];
    for (row, o) in out.chunks_exact_mut(d).enumerate() {
        let (h, j) = (row / g, row % g);
        let units = &slots[h * blocks..][..blocks];
        let m = units
            .iter()
            .fold(f32::NEG_INFINITY, |m, u| m.max(u.max_sum[j].0));
        let z: f32 = units
            .iter()
            .map(|u| u.max_sum[j].1 * (u.max_sum[j].0 - m).exp())
            .sum();
        for (c, u) in coef.iter_mut().zip(units) {
            *c = (u.max_sum[j].0 - m).exp() / z;
        }
        for (u, &c) in units.iter().zip(&coef) {
            for (o, &x) in o.iter_mut().zip(&u.partial[j * d..][..d]) {
                *o = fma(c, x, *o);
            }
        }
        if probs {
            let p = &mut probs_out[row * t..][..t];
            for ((pb, u), &c) in p.chunks_mut(DECODE_ROWS).zip(units).zip(&coef) {
                let n = pb.len();
                for (p, &x) in pb.iter_mut().zip(&u.e[j * n..][..n]) {
                    *p = x * c;
                }
            }
        }
    }
    Ok((out, probs.then_some(probs_out)))
}

/// What one unit of [`decode_attention_cpu`] leaves for the merge, per query head `j` of its
/// group: (max, sum) of its scores, its weighted value rows (`partial[j·d..]`) and
/// exp(score - max) of its `n` keys (`e[j·n..]`).
struct UnitOut {
    max_sum: Vec<(f32, f32)>,
    partial: Vec<f32>,
    e: Vec<f32>,
}

/// [`decode_unit`] for one head size.
type DecodeUnit<E> = fn(&[f32], Rows<E>, Rows<E>, usize, &mut [f32], &mut [f32]) -> (f32, f32);

/// Rows of one KV head in a cache buffer: row `i` starts at `start + i * stride`.
struct Rows<'a, E> {
    data: &'a [E],
    start: usize,
    stride: usize,
}

// Derived `Clone`/`Copy` would require `E: Copy`; a view is copyable whatever it holds.
impl<E> Clone for Rows<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Rows<'_, E> {}

impl<'a, E> Rows<'a, E> {
    fn row<const W: usize>(self, i: usize) -> &'a [E; W] {
        let at = self.start + i * self.stride;
        self.data[at..at + W]
            .try_into()
            .expect("a row of W elements")
    }
}

/// One query head (`q`, already scaled; `W` = head size) over keys `r0..r0 + e.len()`: `e`
/// gets exp(score - max), `acc` the sum of value rows weighted by `e`, and the result is (max,
/// sum of `e`). Rows are fixed-size arrays so that each step compiles to whole-vector
/// operations.
fn decode_unit<const W: usize, E: KvElem>(
    q: &[f32],
    keys: Rows<E>,
    values: Rows<E>,
    r0: usize,
    e: &mut [f32],
    acc: &mut [f32],
) -> (f32, f32) {
    let q: &[f32; W] = q.try_into().expect("a query row of W elements");
    let mut m = f32::NEG_INFINITY;
    for (i, ei) in e.iter_mut().enumerate() {
        *ei = E::dot(q, keys.row::<W>(r0 + i));
        m = m.max(*ei);
    }
    let mut z = 0f32;
    for ei in e.iter_mut() {
        *ei = (*ei - m).exp();
        z += *ei;
    }
    // Apart from the `exp` calls: around a call every vector register would be saved.
    let mut a = [0f32; W];
    for (i, &ei) in e.iter().enumerate() {
        E::axpy(ei, values.row::<W>(r0 + i), &mut a);
    }
    acc.copy_from_slice(&a);
    (m, z)
}

/// Element types a KV cache may hold, as [`decode_unit`] reads them: widened to f32 on the fly.
trait KvElem: Copy + Send + Sync + 'static {
    /// `q · k` over `W` (a multiple of 16) elements.
    fn dot<const W: usize>(q: &[f32; W], k: &[Self; W]) -> f32;
    /// `acc += e · v`.
    fn axpy<const W: usize>(e: f32, v: &[Self; W], acc: &mut [f32; W]);
}

impl KvElem for f32 {
    #[inline(always)]
    fn dot<const W: usize>(q: &[f32; W], k: &[f32; W]) -> f32 {
        dot(q, k)
    }

    #[inline(always)]
    fn axpy<const W: usize>(e: f32, v: &[f32; W], acc: &mut [f32; W]) {
        for c in 0..W {
            acc[c] = fma(e, v[c], acc[c]);
        }
    }
}

/// Eight f16 (`f16 = true`) or bf16 values at `p`, widened to f32.
///
/// # Safety
/// The build targets AVX2 and F16C (the callers' cfg) and `p..p + 8` is readable.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
#[inline(always)]
unsafe fn widen8<const F16: bool>(p: *const u16) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let h = _mm_loadu_si128(p.cast());
    if F16 {
        _mm256_cvtph_ps(h)
    } else {
        // bf16 is the top half of an f32.
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// `q · k` and `acc += e · v` for 16-bit rows, with AVX2/FMA/F16C where the build targets them
/// (x86-64-v3 has all three).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod half_rows {
    use std::arch::x86_64::*;

    use super::widen8;

    #[inline(always)]
    pub fn dot<const W: usize, const F16: bool>(q: &[f32; W], k: &[u16; W]) -> f32 {
        const { assert!(W.is_multiple_of(16)) };
        // SAFETY: the module's cfg enables AVX2, FMA and F16C, and c + 16 <= W, so each load
        // reads inside `q` and `k`.
        unsafe {
            let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in (0..W).step_by(16) {
                let (pq, pk) = (q.as_ptr().add(c), k.as_ptr().add(c));
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pq), widen8::<F16>(pk), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(8)), widen8::<F16>(pk.add(8)), s1);
            }
            super::hsum(_mm256_add_ps(s0, s1))
        }
    }

    #[inline(always)]
    pub fn axpy<const W: usize, const F16: bool>(e: f32, v: &[u16; W], acc: &mut [f32; W]) {
        const { assert!(W.is_multiple_of(8)) };
        // SAFETY: as in `dot`; c + 8 <= W for `v` and `acc`.
        unsafe {
            let e = _mm256_set1_ps(e);
            for c in (0..W).step_by(8) {
                let pa = acc.as_mut_ptr().add(c);
                let x = widen8::<F16>(v.as_ptr().add(c));
                _mm256_storeu_ps(pa, _mm256_fmadd_ps(e, x, _mm256_loadu_ps(pa)));
            }
        }
    }
}

/// The portable 16-bit rows: each element widened by `half`, then the f32 paths.
#[cfg_attr(
    all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ),
    allow(dead_code)
)]
mod half_rows_portable {
    #[inline(always)]
    pub fn dot<const W: usize, E: Copy>(q: &[f32; W], k: &[E; W], f: impl Fn(E) -> f32) -> f32 {
        super::dot_portable(q, &k.map(f))
    }

    #[inline(always)]
    pub fn axpy<const W: usize, E: Copy>(
        e: f32,
        v: &[E; W],
        acc: &mut [f32; W],
        f: impl Fn(E) -> f32,
    ) {
        for c in 0..W {
            acc[c] = super::fma(e, f(v[c]), acc[c]);
        }
    }
}

/// Implements [`KvElem`] for a 16-bit float type: SIMD when the build targets AVX2/FMA/F16C,
/// else portable.
macro_rules! half_elem {
    ($t:ty, $f16:expr) => {
        impl KvElem for $t {
            #[inline(always)]
            fn dot<const W: usize>(q: &[f32; W], k: &[$t; W]) -> f32 {
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma",
                    target_feature = "f16c"
                ))]
                return half_rows::dot::<W, { $f16 }>(q, bits(k));
                #[allow(unreachable_code)]
                half_rows_portable::dot(q, k, <$t>::to_f32)
            }

            #[inline(always)]
            fn axpy<const W: usize>(e: f32, v: &[$t; W], acc: &mut [f32; W]) {
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma",
                    target_feature = "f16c"
                ))]
                return half_rows::axpy::<W, { $f16 }>(e, bits(v), acc);
                #[allow(unreachable_code)]
                half_rows_portable::axpy(e, v, acc, <$t>::to_f32)
            }
        }
    };
}

/// A row of f16 or bf16 as its bit patterns (no copy).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
#[inline(always)]
fn bits<const W: usize, E>(row: &[E; W]) -> &[u16; W]
where
    [E]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    row.as_slice()
        .reinterpret_cast()
        .try_into()
        .expect("a row of W elements")
}

half_elem!(half::f16, true);
half_elem!(half::bf16, false);

/// Horizontal sum of 8 lanes.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
fn hsum(s: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the build enables AVX2 (the cfg above), which includes AVX and SSE3.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// `a · b` for rows of `W` (a multiple of 16) floats, with AVX2/FMA where the build targets
/// them (`-C target-cpu=native` here, x86-64-v3 for carried binaries): two 8-lane
/// accumulators. The compiler does not find this form itself: it vectorises the portable loop
/// 2 lanes wide.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
fn dot<const W: usize>(a: &[f32; W], b: &[f32; W]) -> f32 {
    use std::arch::x86_64::*;
    const { assert!(W.is_multiple_of(16)) };
    // SAFETY: the build enables AVX2 and FMA (the cfg above), and c + 16 <= W, so each
    // unaligned 8-float load reads inside `a` and `b`.
    unsafe {
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in (0..W).step_by(16) {
            let (pa, pb) = (a.as_ptr().add(c), b.as_ptr().add(c));
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(8)), _mm256_loadu_ps(pb.add(8)), s1);
        }
        hsum(_mm256_add_ps(s0, s1))
    }
}

/// `a · b`, portable: 16 independent lanes reduced pairwise.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[inline(always)]
fn dot<const W: usize>(a: &[f32; W], b: &[f32; W]) -> f32 {
    dot_portable(a, b)
}

/// The portable `dot` (compiled everywhere, so that its test runs on x86 too).
#[cfg_attr(
    all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ),
    allow(dead_code)
)]
#[inline(always)]
fn dot_portable<const W: usize>(a: &[f32; W], b: &[f32; W]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    for (x, y) in a.as_chunks::<L>().0.iter().zip(b.as_chunks::<L>().0) {
        for l in 0..L {
            acc[l] = fma(x[l], y[l], acc[l]);
        }
    }
    let mut w = L;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// `a · b + c`, fused where the target has FMA (software `fmaf` would be far slower).
#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    // Every aarch64 CPU has it.
    if cfg!(any(target_feature = "fma", target_arch = "aarch64")) {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
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
        assert_eq!(AttentionBackend::auto(true, true, DType::BF16, 128), Flash);
        assert_eq!(AttentionBackend::auto(true, true, DType::F16, 256), Flash);
        assert_eq!(AttentionBackend::auto(true, true, DType::F32, 128), Eager);
        assert_eq!(AttentionBackend::auto(true, false, DType::BF16, 128), Eager);
        assert_eq!(AttentionBackend::auto(false, true, DType::BF16, 128), Eager);
        assert_eq!(AttentionBackend::auto(true, true, DType::BF16, 260), Eager);
        assert_eq!(AttentionBackend::auto(true, true, DType::BF16, 100), Eager);
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

    /// The decode kernel against the eager path (candle matmuls and softmax), on `q` and on
    /// K/V views as a cache's layer gives them; the eager path gets them widened to f32 (a
    /// copy), the kernel reads them as they are.
    fn check_decode_kernel(q: &Tensor, k: &Tensor, v: &Tensor, label: &str) -> Result<()> {
        let g = q.dim(1)?;
        let label = &format!("{label} kv {:?}", k.dtype());
        let probs = attention_probs(q, &k.to_dtype(DType::F32)?, None, g)?;
        let want = attention_output(&probs, &v.to_dtype(DType::F32)?)?;
        for with_probs in [false, true] {
            let (y, p) = decode_attention_cpu(q, k, v, with_probs)?
                .expect("CPU f32 queries, head_dim 64/128/256 take the kernel");
            // f32 sums in another order: relative to the output's size.
            let diff = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let size = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
            assert!(diff < 1e-5 * size, "{label}: output max diff {diff}");
            assert_eq!(p.is_some(), with_probs, "{label}");
            if let Some(p) = p {
                // Each probability to 1e-4 of itself (or 1e-9 absolute, for those that
                // underflow), and each row sums to 1.
                let err = ((&p - &probs)?.abs()? / (probs.abs()? + 1e-5)?)?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert!(err < 1e-4, "{label}: probabilities max relative diff {err}");
                let sums = p.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
                assert!(
                    sums.iter().all(|s| (s - 1.0).abs() < 1e-4),
                    "{label}: row sums {sums:?}"
                );
            }
        }
        Ok(())
    }

    /// The dtypes a cache may hold.
    const KV_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// K and V as a cache gives them, in every cache dtype: the first T slots of buffers with
    /// spare slots and a head before them; V from a buffer of another capacity and head offset than K, so that a
    /// mixed-up stride or offset shows. T spans one block of 256 keys, its edge, and many
    /// blocks (the merge across blocks); scores with a spread of ~±30.
    #[test]
    fn decode_kernel_matches_eager() -> Result<()> {
        let dev = Device::Cpu;
        for (kv, g, d) in [(3, 3, 64), (2, 7, 64), (1, 4, 128), (2, 1, 256)] {
            for t in [1, 2, 17, 256, 257, 1000, 9000] {
                for spread in [1f32, 8.0] {
                    let sd = spread.sqrt();
                    let kb = Tensor::randn(0f32, sd, (kv + 1, t + 5, d), &dev)?;
                    let vb = (Tensor::randn(0f32, sd, (kv + 2, t + 11, d), &dev)? + 0.5)?;
                    let q = Tensor::randn(0f32, sd, (kv, g, d), &dev)?;
                    for dt in KV_DTYPES {
                        let (kb, vb) = (kb.to_dtype(dt)?, vb.to_dtype(dt)?);
                        let k = kb.narrow(0, 1, kv)?.narrow(1, 0, t)?;
                        let v = vb.narrow(0, 2, kv)?.narrow(1, 0, t)?;
                        let label = format!("{kv}x{g} d={d} T={t} spread={spread}");
                        check_decode_kernel(&q, &k, &v, &label)?;
                    }
                }
            }
            // Slots outermost, `[T, kv, d]` read as `[kv, T, d]`: rows kv·d apart, heads d.
            let t = 700;
            let q = Tensor::randn(0f32, 1., (kv, g, d), &dev)?;
            for dt in KV_DTYPES {
                let kv_of = || -> Result<Tensor> {
                    Ok(Tensor::randn(0f32, 1., (t, kv, d), &dev)?
                        .to_dtype(dt)?
                        .transpose(0, 1)?)
                };
                let (k, v) = (kv_of()?, kv_of()?);
                check_decode_kernel(&q, &k, &v, &format!("{kv}x{g} d={d} slots outermost"))?;
            }
        }
        Ok(())
    }

    /// Scores far beyond exp's range: without subtracting the max (or with a wrong max per
    /// block) exp overflows. One key, in the last block, dominates; and with q = 0 every key
    /// gets 1/T.
    #[test]
    fn decode_kernel_softmax_is_stable() -> Result<()> {
        let dev = Device::Cpu;
        let (kv, g, d, t) = (2, 3, 64, 1000);
        let k = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (kv, t, d), &dev)?;
        // Scores of several hundred: q = 60 · (key 990 of its head) + noise.
        let winner = k.narrow(1, 990, 1)?.broadcast_as((kv, g, d))?;
        let q = ((winner * 60.0)? + Tensor::randn(0f32, 1., (kv, g, d), &dev)?)?;
        check_decode_kernel(&q, &k, &v, "scores of hundreds")?;
        let (y, p) = decode_attention_cpu(&q, &k, &v, true)?.expect("kernel");
        let p = p.expect("probabilities");
        let top = p.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?;
        assert!(top.iter().all(|&i| i == 990), "{top:?}");
        let want = v.narrow(1, 990, 1)?.broadcast_as((kv, g, d))?;
        let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "the dominant key's value row: max diff {diff}");
        // q = 0: uniform.
        let (y, p) = decode_attention_cpu(&q.zeros_like()?, &k, &v, true)?.expect("kernel");
        let p = p.expect("probabilities").flatten_all()?.to_vec1::<f32>()?;
        assert!(p.iter().all(|x| (x * t as f32 - 1.0).abs() < 1e-4));
        let mean = v.mean_keepdim(1)?.broadcast_as((kv, g, d))?;
        let diff = (y - mean)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff < 1e-5,
            "q = 0 gives the mean value row: max diff {diff}"
        );
        Ok(())
    }

    /// The portable dot product (other targets) against the one this build uses.
    #[test]
    fn portable_dot_matches() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 256), &dev)?.to_vec2::<f32>()?;
        let (a, b): (&[f32; 256], &[f32; 256]) = (
            x[0].as_slice().try_into().expect("256"),
            x[1].as_slice().try_into().expect("256"),
        );
        let naive: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        for (name, got) in [("dot", dot(a, b)), ("portable", dot_portable(a, b))] {
            assert!(
                (got as f64 - naive).abs() < 1e-4,
                "{name}: {got} vs {naive}"
            );
        }
        let (a64, b64): (&[f32; 64], &[f32; 64]) = (
            a[..64].try_into().expect("64"),
            b[..64].try_into().expect("64"),
        );
        assert!((dot(a64, b64) - dot_portable(a64, b64)).abs() < 1e-5);
        Ok(())
    }

    /// The 16-bit rows' dot and axpy, as this build compiles them and portable, against the
    /// f32 ones on the widened row (exact inputs: only the summation order may differ).
    #[test]
    fn half_rows_match_f32() -> Result<()> {
        fn check<E: KvElem>(q: &[f32; 128], k: &[E; 128], wide: &[f32; 128], f: fn(E) -> f32) {
            let want = dot_portable(q, wide);
            for (name, got) in [
                ("dot", E::dot(q, k)),
                ("portable", half_rows_portable::dot(q, k, f)),
            ] {
                assert!((got - want).abs() < 1e-4, "{name}: {got} vs {want}");
            }
            let mut want = *q;
            <f32 as KvElem>::axpy(0.37, wide, &mut want);
            let (mut got, mut port) = (*q, *q);
            E::axpy(0.37, k, &mut got);
            half_rows_portable::axpy(0.37, k, &mut port, f);
            assert_eq!(got, want, "axpy");
            assert_eq!(port, want, "portable axpy");
        }
        let x = Tensor::randn(0f32, 1., (2, 128), &Device::Cpu)?.to_vec2::<f32>()?;
        let q: &[f32; 128] = x[0].as_slice().try_into().expect("128");
        let k16: [half::f16; 128] = std::array::from_fn(|i| half::f16::from_f32(x[1][i]));
        let kb16: [half::bf16; 128] = std::array::from_fn(|i| half::bf16::from_f32(x[1][i]));
        check(q, &k16, &k16.map(half::f16::to_f32), half::f16::to_f32);
        check(q, &kb16, &kb16.map(half::bf16::to_f32), half::bf16::to_f32);
        Ok(())
    }

    /// Inputs the kernel does not take are left to the general path, never misread.
    #[test]
    fn decode_kernel_declines_what_it_does_not_take() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (2, 3, 80), &dev)?;
        let k = Tensor::randn(0f32, 1., (2, 9, 80), &dev)?;
        assert!(
            decode_attention_cpu(&q, &k, &k, false)?.is_none(),
            "head_dim 80"
        );
        let q = Tensor::randn(0f32, 1., (2, 3, 64), &dev)?;
        let k = Tensor::randn(0f32, 1., (2, 9, 64), &dev)?;
        let h = |x: &Tensor| x.to_dtype(DType::BF16);
        assert!(
            decode_attention_cpu(&h(&q)?, &h(&k)?, &h(&k)?, false)?.is_none(),
            "bf16 queries"
        );
        let f16 = k.to_dtype(DType::F16)?;
        assert!(
            decode_attention_cpu(&q, &f16, &h(&k)?, false)?.is_none(),
            "K and V of different dtypes"
        );
        assert!(
            decode_attention_cpu(
                &q,
                &k.to_dtype(DType::F64)?,
                &k.to_dtype(DType::F64)?,
                false
            )?
            .is_none(),
            "f64 cache"
        );
        // Rows not contiguous (a transposed view).
        let kt = Tensor::randn(0f32, 1., (2, 64, 9), &dev)?.transpose(1, 2)?;
        assert!(
            decode_attention_cpu(&q, &kt, &kt, false)?.is_none(),
            "strided rows"
        );
        // Mismatched shapes are an error, not a guess.
        let k8 = Tensor::randn(0f32, 1., (2, 9, 32), &dev)?;
        assert!(decode_attention_cpu(&q, &k8, &k8, false).is_err());
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
