//! keydiff's own attention kernels: the CPU decode kernel, one decode step's attention (a single
//! query row per head) over the cache, read in place in f32, f16 or bf16, without candle's
//! GEMMs ([`decode_attention_cpu`]); and the candle ops of the CUDA decode kernel
//! ([`decode_attention_cuda`]), of the CUDA causal softmax ([`causal_softmax_cuda`]) and its
//! form with the policies' statistics ([`softmax_sums_cuda`]), of the CUDA residual add and
//! RMSNorm ([`add_rms_norm_cuda`]), of SwiGLU's product on CUDA ([`silu_mul_cuda`]) and of RoPE
//! of queries and keys in one launch ([`rope_qk_cuda`]).

use std::sync::OnceLock;

use candle_core::{DType, Tensor};
use keydiff_cache::KvType;

use crate::error::{ModelError, Result};

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
    decode_attention(q, k, v, None, probs)
}

/// [`decode_attention_cpu`] over a quantized cache: `k` and `v` are u8 rows of `blocks`'s
/// blocks (`[kv_heads, T, d / 32 · bytes]`, views of the cache buffers), dequantized a row at
/// a time as they are read, so the result is the eager one over the dequantized cache.
pub fn decode_attention_cpu_blocks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: KvType,
    probs: bool,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    if blocks.block_bytes().is_none() || k.dtype() != DType::U8 || v.dtype() != DType::U8 {
        return Err(ModelError::Shape(format!(
            "decode attention over {blocks} blocks: k {}, v {} (u8 rows)",
            k.dtype().as_str(),
            v.dtype().as_str()
        )));
    }
    decode_attention(q, k, v, Some(blocks), probs)
}

/// One decode step's attention on CUDA by keydiff's flash-decoding kernel
/// (`keydiff_decode_*` of `kernels/keydiff.cu`): `q` `[kv_heads, g, d]`, `k` and `v`
/// `[kv_heads, T, d]` views of the cache read in place, all three of one float dtype; returns
/// `[kv_heads, g, d]` in that dtype, softmax(q · kᵀ / √d) · v with f32 sums. `None` where the
/// kernel does not apply (off CUDA, caches of another dtype than q or of blocks, more than
/// [`keydiff_kernels::geometry::DECODE_MAX_GROUP`] query heads per KV head, a head dim past
/// 256, values of another shape than keys, rows not contiguous) or where
/// `KEYDIFF_CUDA_DECODE_KERNEL=0` turns it off: the caller then takes the eager path (six
/// launches and a row of probabilities per head). It gives no probabilities: policies that
/// need a decode step's statistics take the eager path.
pub fn decode_attention_cuda(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<Tensor>> {
    if !q.device().is_cuda() || !cuda_decode_kernel_on() {
        return Ok(None);
    }
    let d = q.dim(2)?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() || !decode_fits(q, k, v, d)? {
        return Ok(None);
    }
    cuda_decode(&q.contiguous()?, k, v, None)
}

/// [`decode_attention_cuda`] over a quantized or fp8 cache (`keydiff_decode_kvq_*`): `k` and
/// `v` `[kv_heads, T, d / 32 · bytes]` views of the cache buffers as stored (u8 blocks of
/// `kv_type`, or F8E4M3 rows), read in place and dequantized as they are read, as the cache's
/// own `keydiff_kvq_dequantize` does; `q` `[kv_heads, g, d]` f32, f16 or bf16, the output's
/// dtype. The eager path dequantizes the whole view to f32 first, then casts it: three passes
/// over the cache in f32 and one in the activations' dtype, where this reads its blocks once.
/// `None` where it does not apply (off CUDA, a float cache of another type, the limits of
/// [`decode_attention_cuda`], a head dim that is not a multiple of 32) or where
/// `KEYDIFF_CUDA_DECODE_KERNEL=0` turns it off. Its CPU twin is [`decode_attention_cpu_blocks`]
/// (f32 queries).
pub fn decode_attention_cuda_kvq(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_type: KvType,
) -> Result<Option<Tensor>> {
    use keydiff_kernels::geometry::{KVQ_BYTES, KVQ_FP8};
    if !q.device().is_cuda() || !cuda_decode_kernel_on() {
        return Ok(None);
    }
    let kind = match kv_type {
        KvType::Float(DType::F8E4M3) => KVQ_FP8,
        t => match t.block_code() {
            Some(code) => code,
            None => return Ok(None),
        },
    };
    let bytes = KVQ_BYTES[kind as usize];
    let d = q.dim(2)?;
    if k.dtype() != kv_type.storage_dtype()
        || v.dtype() != k.dtype()
        || !d.is_multiple_of(32)
        || !decode_fits(q, k, v, d / 32 * bytes)?
    {
        return Ok(None);
    }
    cuda_decode(&q.contiguous()?, k, v, Some((kind, bytes)))
}

/// Whether the CUDA decode kernels take these shapes: `q` `[kv_heads, g, d]` in f32, f16 or
/// bf16, `k` and `v` of one shape `[kv_heads, T ≥ 1, row]` with rows contiguous, a group of at
/// most [`keydiff_kernels::geometry::DECODE_MAX_GROUP`] and a head dim of at most
/// [`keydiff_kernels::geometry::MAX_HEAD_DIM`] (their dtypes are the caller's to check).
fn decode_fits(q: &Tensor, k: &Tensor, v: &Tensor, row: usize) -> Result<bool> {
    use keydiff_kernels::geometry::{DECODE_MAX_GROUP, MAX_HEAD_DIM};
    let (kv_heads, g, d) = q.dims3()?;
    let (kh, t, kr) = k.dims3()?;
    let rows_contiguous = |x: &Tensor| x.stride().last() == Some(&1);
    Ok(matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && (kh, kr) == (kv_heads, row)
        && v.dims() == k.dims()
        && g <= DECODE_MAX_GROUP
        && d <= MAX_HEAD_DIM
        && t > 0
        && rows_contiguous(k)
        && rows_contiguous(v))
}

/// Whether the CUDA decode kernel runs (`KEYDIFF_CUDA_DECODE_KERNEL=0` turns it off, to time
/// or check the eager path against it).
fn cuda_decode_kernel_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "KEYDIFF_CUDA_DECODE_KERNEL")
}

/// Whether one of keydiff's CUDA kernels runs: on unless the environment variable `var` is `0`
/// (to time or check candle's ops against it), read once into `cell`.
pub(crate) fn switched_on(cell: &OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// The decode kernel on CUDA: over float rows (`blocks` `None`) or blocks of (kind, bytes).
#[cfg(feature = "cuda")]
fn cuda_decode(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: Option<(i32, usize)>,
) -> Result<Option<Tensor>> {
    let scale = 1.0 / (q.dim(2)? as f32).sqrt();
    let op = CudaDecode { scale, blocks };
    Ok(Some(q.apply_op3_no_bwd(k, v, &op)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_decode(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _blocks: Option<(i32, usize)>,
) -> Result<Option<Tensor>> {
    Ok(None)
}

/// The candle op of [`decode_attention_cuda`] and, with `blocks` (kind, bytes),
/// [`decode_attention_cuda_kvq`]: CUDA only (the CPU has [`decode_attention_cpu`] and
/// [`decode_attention_cpu_blocks`]).
#[cfg(feature = "cuda")]
struct CudaDecode {
    scale: f32,
    blocks: Option<(i32, usize)>,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp3 for CudaDecode {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("decode-attention: the CUDA kernel's op runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &candle_core::Layout,
        k: &candle_core::CudaStorage,
        kl: &candle_core::Layout,
        v: &candle_core::CudaStorage,
        vl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        match self.blocks {
            None => keydiff_kernels::decode_attention((q, ql), (k, kl), (v, vl), self.scale),
            Some((kind, bytes)) => keydiff_kernels::decode_attention_kvq(
                (q, ql),
                (k, kl),
                (v, vl),
                kind,
                bytes,
                self.scale,
            ),
        }
    }
}

/// The softmax of a chunk's attention scores on CUDA by keydiff's kernel
/// (`keydiff_causal_softmax_*` of `kernels/keydiff.cu`), masked bottom-right causal by index:
/// `scores` `[kv_heads, g·B, T]` as q · kᵀ wrote them (f32, f16 or bf16), row r the query at
/// r % `chunk` of its chunk, whose keys are the last `chunk` of T. Returns the probabilities in
/// `dtype`, f32 or the scores' dtype, computed in f32: what [`attention_probs`] gives over the
/// same scores with [`chunk_mask`]`(chunk, T)`, in one launch instead of four (a cast to f32,
/// the mask added, softmax, a cast for the value product). `None` where it does not apply (off
/// CUDA, another dtype, fewer keys than queries) or where `KEYDIFF_CUDA_SOFTMAX_KERNEL=0` turns
/// it off: the caller then runs candle's ops.
///
/// [`attention_probs`]: crate::attention::attention_probs
/// [`chunk_mask`]: crate::attention::chunk_mask
pub fn causal_softmax_cuda(scores: &Tensor, chunk: usize, dtype: DType) -> Result<Option<Tensor>> {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = switched_on(&ON, "KEYDIFF_CUDA_SOFTMAX_KERNEL");
    let float = matches!(scores.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let t = scores.dims().last().copied().unwrap_or(0);
    if !on
        || !scores.device().is_cuda()
        || !float
        || (dtype != DType::F32 && dtype != scores.dtype())
        || chunk == 0
        || t < chunk
    {
        return Ok(None);
    }
    cuda_softmax(&scores.contiguous()?, chunk, dtype)
}

#[cfg(feature = "cuda")]
fn cuda_softmax(scores: &Tensor, chunk: usize, dtype: DType) -> Result<Option<Tensor>> {
    Ok(Some(
        scores.apply_op1_no_bwd(&CudaSoftmax { chunk, dtype })?,
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_softmax(_scores: &Tensor, _chunk: usize, _dtype: DType) -> Result<Option<Tensor>> {
    Ok(None)
}

/// The candle op of [`causal_softmax_cuda`]: CUDA only (the CPU runs candle's ops).
#[cfg(feature = "cuda")]
struct CudaSoftmax {
    chunk: usize,
    dtype: DType,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp1 for CudaSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("causal-softmax: the CUDA kernel's op runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        sl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        keydiff_kernels::causal_softmax((s, sl), self.chunk, self.dtype)
    }
}

/// The softmax of a chunk's attention scores with the statistics of TOVA, SnapKV and H2O on
/// CUDA by keydiff's kernels (`keydiff_softmax_state_*`, then `keydiff_softmax_sums_*` of
/// `kernels/keydiff.cu`), masked bottom-right causal by index: `scores` `[heads · chunk, T]`
/// (any shape whose last dimension is T and whose rows are the chunks of each query head in
/// turn), f32, f16 or bf16. Returns the probabilities in `probs` (f32 or the scores' dtype;
/// none when `None`) and the sums over the last `stat_rows` queries of each head of its
/// probabilities, `[heads, T]` in f32: what [`masked_softmax`] in f32 then [`row_sums`] give,
/// without the f32 probabilities written, summed and cast by three more passes. `None` where it
/// does not apply (off CUDA, another dtype, fewer keys than queries) or where
/// `KEYDIFF_CUDA_SOFTMAX_SUMS=0` turns it off: the caller then runs candle's ops.
///
/// [`masked_softmax`]: crate::attention::masked_softmax
/// [`row_sums`]: crate::attention::row_sums
pub fn softmax_sums_cuda(
    scores: &Tensor,
    chunk: usize,
    stat_rows: usize,
    probs: Option<DType>,
) -> Result<Option<(Option<Tensor>, Tensor)>> {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = switched_on(&ON, "KEYDIFF_CUDA_SOFTMAX_SUMS");
    let float = matches!(scores.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let t = scores.dims().last().copied().unwrap_or(0);
    let probs_fit = probs.is_none_or(|dt| dt == DType::F32 || dt == scores.dtype());
    if !on
        || !scores.device().is_cuda()
        || !float
        || !probs_fit
        || chunk == 0
        || t < chunk
        || stat_rows == 0
        || stat_rows > chunk
    {
        return Ok(None);
    }
    cuda_softmax_sums(&scores.contiguous()?, chunk, stat_rows, probs)
}

#[cfg(feature = "cuda")]
fn cuda_softmax_sums(
    scores: &Tensor,
    chunk: usize,
    stat_rows: usize,
    probs: Option<DType>,
) -> Result<Option<(Option<Tensor>, Tensor)>> {
    use candle_core::op::BackpropOp;
    use candle_core::Storage;
    let t = scores.dims().last().copied().unwrap_or(0);
    let heads = scores.elem_count() / t / chunk;
    let (p, stats) = {
        let (s, l) = scores.storage_and_layout();
        let Storage::Cuda(s) = &*s else {
            return Ok(None);
        };
        keydiff_kernels::softmax_sums((s, l), chunk, stat_rows, probs)?
    };
    let wrap = |st, shape: &[usize]| {
        Tensor::from_storage(Storage::Cuda(st), shape, BackpropOp::none(), false)
    };
    let p = p.map(|p| wrap(p, scores.dims()));
    Ok(Some((p, wrap(stats, &[heads, t]))))
}

#[cfg(not(feature = "cuda"))]
fn cuda_softmax_sums(
    _scores: &Tensor,
    _chunk: usize,
    _stat_rows: usize,
    _probs: Option<DType>,
) -> Result<Option<(Option<Tensor>, Tensor)>> {
    Ok(None)
}

/// A residual add and the RMSNorm of its sum on CUDA by keydiff's kernel
/// (`keydiff_add_rms_norm_*` of `kernels/keydiff.cu`), vLLM's `fused_add_rms_norm`: `x` and `r`
/// `[rows, cols]`, the norm's weight `w` `[cols]`, one float dtype. Returns (x + r, its RMSNorm
/// times w), the sum rounded to the dtype as candle's add rounds it and the norm taken of the
/// rounded sum: what `x + r` then candle's `rms_norm` give, in one launch instead of two.
/// `None` where it does not apply (off CUDA, another dtype or shape) or where
/// `KEYDIFF_CUDA_ADD_NORM=0` turns it off: the caller then runs candle's ops.
pub fn add_rms_norm_cuda(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = switched_on(&ON, "KEYDIFF_CUDA_ADD_NORM");
    let float = matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let two_d = x.rank() == 2 && r.dims() == x.dims() && w.dims() == [x.dim(1)?];
    if !on
        || !x.device().is_cuda()
        || !float
        || r.dtype() != x.dtype()
        || w.dtype() != x.dtype()
        || !two_d
        || x.elem_count() == 0
    {
        return Ok(None);
    }
    cuda_add_norm(&x.contiguous()?, &r.contiguous()?, &w.contiguous()?, eps)
}

#[cfg(feature = "cuda")]
fn cuda_add_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f32) -> Result<Option<(Tensor, Tensor)>> {
    let both = x.apply_op3_no_bwd(r, w, &CudaAddNorm { eps })?;
    Ok(Some((both.get(0)?, both.get(1)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_add_norm(
    _x: &Tensor,
    _r: &Tensor,
    _w: &Tensor,
    _eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    Ok(None)
}

/// The candle op of [`add_rms_norm_cuda`]: CUDA only.
#[cfg(feature = "cuda")]
struct CudaAddNorm {
    eps: f32,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp3 for CudaAddNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("add-rms-norm: the CUDA kernel's op runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &candle_core::Layout,
        r: &candle_core::CudaStorage,
        rl: &candle_core::Layout,
        w: &candle_core::CudaStorage,
        wl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        keydiff_kernels::add_rms_norm((x, xl), (r, rl), (w, wl), self.eps)
    }
}

/// RoPE of a chunk's queries and keys on CUDA by keydiff's kernel (`keydiff_rope_qk_*` of
/// `kernels/keydiff.cu`): `q` `[heads, B, d]` and `k` `[kv_heads, B, d]`, views with each
/// head's values contiguous (a projection's output transposed, or normed copies), `cos` and
/// `sin` `[B, d / 2]`, one float dtype; returns `[heads, B, d]` and `[kv_heads, B, d]`, views
/// of one contiguous output, the values of candle's `rope` / `rope_i` on contiguous copies
/// (`interleaved`). One launch instead of four (two copies, two rope launches; at a decode
/// step the copies are free, so two). `None` where it does not apply (off CUDA, another dtype
/// or shape, an odd head dim, values not contiguous) or where `KEYDIFF_CUDA_ROPE=0` turns it
/// off: the caller then runs candle's ops.
pub fn rope_qk_cuda(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Result<Option<(Tensor, Tensor)>> {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = switched_on(&ON, "KEYDIFF_CUDA_ROPE");
    let dt = q.dtype();
    let float = matches!(dt, DType::F32 | DType::F16 | DType::BF16);
    let (Ok((hq, b, d)), Ok((hk, kb, kd))) = (q.dims3(), k.dims3()) else {
        return Ok(None);
    };
    let values_contiguous = |x: &Tensor| x.stride().last() == Some(&1);
    if !on
        || !q.device().is_cuda()
        || !float
        || [k.dtype(), cos.dtype(), sin.dtype()] != [dt; 3]
        || (kb, kd) != (b, d)
        || d % 2 == 1
        || hq == 0
        || hk == 0
        || b == 0
        || cos.dims() != [b, d / 2]
        || sin.dims() != cos.dims()
        || !values_contiguous(q)
        || !values_contiguous(k)
    {
        return Ok(None);
    }
    cuda_rope_qk(q, k, &cos.contiguous()?, &sin.contiguous()?, interleaved)
}

#[cfg(feature = "cuda")]
fn cuda_rope_qk(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Result<Option<(Tensor, Tensor)>> {
    use candle_core::op::BackpropOp;
    use candle_core::Storage;
    let (hq, hk) = (q.dim(0)?, k.dim(0)?);
    let (out, shape) = {
        let ((qs, ql), (ks, kl)) = (q.storage_and_layout(), k.storage_and_layout());
        let ((cs, cl), (ss, sl)) = (cos.storage_and_layout(), sin.storage_and_layout());
        let (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(cs), Storage::Cuda(ss)) =
            (&*qs, &*ks, &*cs, &*ss)
        else {
            return Ok(None);
        };
        keydiff_kernels::rope_qk((qs, ql), (ks, kl), (cs, cl), (ss, sl), interleaved)?
    };
    let out = Tensor::from_storage(Storage::Cuda(out), shape, BackpropOp::none(), false);
    Ok(Some((out.narrow(0, 0, hq)?, out.narrow(0, hq, hk)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_rope_qk(
    _q: &Tensor,
    _k: &Tensor,
    _cos: &Tensor,
    _sin: &Tensor,
    _interleaved: bool,
) -> Result<Option<(Tensor, Tensor)>> {
    Ok(None)
}

/// SwiGLU's product silu(gate) · up on CUDA by keydiff's kernel (`keydiff_silu_mul_*` of
/// `kernels/keydiff.cu`): `gate` and `up` `[rows, cols]` (views with contiguous rows, such as the
/// halves of a fused gate/up output), one float dtype; returns `[rows, cols]`, computed in f32
/// and rounded once (candle rounds silu's result, then the product). One launch instead of two.
/// `None` where it does not apply (off CUDA, another dtype or shape, rows not contiguous) or
/// where `KEYDIFF_CUDA_SILU_MUL=0` turns it off: the caller then runs candle's ops.
pub fn silu_mul_cuda(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = switched_on(&ON, "KEYDIFF_CUDA_SILU_MUL");
    let float = matches!(gate.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let rows_contiguous = |x: &Tensor| x.stride().last() == Some(&1);
    if !on
        || !gate.device().is_cuda()
        || !float
        || up.dtype() != gate.dtype()
        || gate.rank() != 2
        || up.dims() != gate.dims()
        || gate.elem_count() == 0
        || !rows_contiguous(gate)
        || !rows_contiguous(up)
    {
        return Ok(None);
    }
    cuda_silu_mul(gate, up)
}

#[cfg(feature = "cuda")]
fn cuda_silu_mul(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    Ok(Some(gate.apply_op2_no_bwd(up, &CudaSiluMul)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_silu_mul(_gate: &Tensor, _up: &Tensor) -> Result<Option<Tensor>> {
    Ok(None)
}

/// The candle op of [`silu_mul_cuda`]: CUDA only.
#[cfg(feature = "cuda")]
struct CudaSiluMul;

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for CudaSiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("silu-mul: the CUDA kernel's op runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &candle_core::Layout,
        u: &candle_core::CudaStorage,
        ul: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        keydiff_kernels::silu_mul((g, gl), (u, ul))
    }
}

fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: Option<KvType>,
    probs: bool,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    use candle_core::{CpuStorage, Storage};
    let (kv_heads, g, d) = q.dims3()?;
    let (kh, t, kd) = k.dims3()?;
    // A u8 cache holds blocks of a quantized type: rows of d / 32 · bytes.
    let row = match blocks {
        Some(b) => b.row_len(d),
        None if k.dtype() == DType::U8 => {
            return Err(ModelError::Shape(
                "decode attention: u8 rows without their block type \
                 (decode_attention_cpu_blocks)"
                    .into(),
            ))
        }
        None => d,
    };
    if (kh, kd) != (kv_heads, row) || v.dim(0)? != kh || v.dim(1)? != t || t == 0 || d == 0 {
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
        (Storage::Cpu(CpuStorage::F8E4M3(kd)), Storage::Cpu(CpuStorage::F8E4M3(vd))) => {
            decode_typed(qd, (kd, kl), (vd, vl), shape, probs)?
        }
        (Storage::Cpu(CpuStorage::U8(kd)), Storage::Cpu(CpuStorage::U8(vd))) => {
            fn run<B: BlockKind>(
                qd: &[f32],
                (kd, kl): (&[u8], Layout3),
                (vd, vl): (&[u8], Layout3),
                shape: (usize, usize, usize, usize),
                probs: bool,
            ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
                let (k, v) = (QByte::<B>::cast(kd), QByte::<B>::cast(vd));
                decode_typed(qd, (k, kl), (v, vl), shape, probs)
            }
            let (k, v) = ((&kd[..], kl), (&vd[..], vl));
            match blocks {
                Some(KvType::Q8_0) => run::<Q8_0B>(qd, k, v, shape, probs)?,
                Some(KvType::Q5_1) => run::<Q5_1B>(qd, k, v, shape, probs)?,
                Some(KvType::Q5_0) => run::<Q5_0B>(qd, k, v, shape, probs)?,
                Some(KvType::Q4_1) => run::<Q4_1B>(qd, k, v, shape, probs)?,
                Some(KvType::Q4_0) => run::<Q4_0B>(qd, k, v, shape, probs)?,
                _ => return Ok(None),
            }
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

/// An f16/bf16/fp8 cache view `[kv_heads, T, d]` on the CPU widened to a contiguous f32 tensor,
/// eight values at a time with SIMD where the build has it; `None` for anything else (other
/// dtypes or devices, rows not contiguous). The general attention path takes this copy of a
/// cache held in half precision under f32 activations, every chunk and layer; candle's
/// `to_dtype` widens one value at a time.
pub fn widen_cache_view(x: &Tensor) -> Result<Option<Tensor>> {
    use candle_core::{CpuStorage, Storage};
    let Ok((heads, t, d)) = x.dims3() else {
        return Ok(None);
    };
    let Some((off, hs, rs)) = rows_of(x).filter(|_| x.device().is_cpu()) else {
        return Ok(None);
    };
    fn widen<E: KvElem>(
        data: &[E],
        (heads, t, d): (usize, usize, usize),
        (off, hs, rs): Layout3,
    ) -> Vec<f32> {
        let mut out = vec![0f32; heads * t * d];
        for (i, o) in out.chunks_exact_mut(d).enumerate() {
            let at = off + (i / t) * hs + (i % t) * rs;
            E::widen_into(&data[at..at + d], o);
        }
        out
    }
    let (s, _) = x.storage_and_layout();
    let out = match &*s {
        Storage::Cpu(CpuStorage::F16(data)) => widen(data, (heads, t, d), (off, hs, rs)),
        Storage::Cpu(CpuStorage::BF16(data)) => widen(data, (heads, t, d), (off, hs, rs)),
        Storage::Cpu(CpuStorage::F8E4M3(data)) => widen(data, (heads, t, d), (off, hs, rs)),
        _ => return Ok(None),
    };
    drop(s);
    Ok(Some(Tensor::from_vec(out, (heads, t, d), x.device())?))
}

/// Element offset of head 0, stride between heads, stride between rows.
type Layout3 = (usize, usize, usize);

/// The [`Layout3`] of a `[heads, rows, d]` view whose rows are contiguous, else `None`.
fn rows_of(x: &Tensor) -> Option<Layout3> {
    let l = x.layout();
    let st = l.stride();
    (st.len() == 3 && st[2] == 1).then_some((l.start_offset(), st[0], st[1]))
}

/// [`decode_attention_cpu`] on the raw data of a cache whose elements are `E`: the output
/// `[kv_heads, g, d]` and, with `probs`, the probabilities `[kv_heads, g, T]`.
fn decode_typed<E: KvElem>(
    qd: &[f32],
    (kd, kl): (&[E], Layout3),
    (vd, vl): (&[E], Layout3),
    (kv_heads, g, d, t): (usize, usize, usize, usize),
    probs: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
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
            unit(&qd[h * g * d..][..g * d], keys, values, r0, &mut out);
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
type DecodeUnit<E> = fn(&[f32], Rows<E>, Rows<E>, usize, &mut UnitOut);

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

    /// Row `i` as `len` stored elements.
    fn row_of(self, i: usize, len: usize) -> &'a [E] {
        let at = self.start + i * self.stride;
        &self.data[at..at + len]
    }
}

impl<'a, E: KvElem> Rows<'a, E> {
    /// Rows `i..i + nb` (1 <= nb <= 8) as f32, the last repeated up to 8: read in place when
    /// the cache is f32, else widened into `buf`.
    fn block<'b, const W: usize>(
        self,
        i: usize,
        nb: usize,
        buf: &'b mut [[f32; W]; 8],
    ) -> [&'b [f32; W]; 8]
    where
        'a: 'b,
    {
        match E::as_f32(self.data) {
            Some(data) => {
                let rows = Rows {
                    data,
                    start: self.start,
                    stride: self.stride,
                };
                std::array::from_fn(|l| rows.row::<W>(i + l.min(nb - 1)))
            }
            None => {
                for (l, b) in buf.iter_mut().enumerate().take(nb) {
                    E::widen_row(self.row_of(i + l, E::row_len(W)), b);
                }
                let buf: &'b [[f32; W]; 8] = buf;
                std::array::from_fn(|l| &buf[l.min(nb - 1)])
            }
        }
    }
}

/// The g query heads of one KV head (`q`: g rows of `W`, already scaled; `W` = head size) over
/// keys `r0..r0 + n` (`n` = `out.e.len() / g`). Per head `j`: `out.e[j·n..]` gets exp(score -
/// max), `out.partial[j·W..]` the sum of value rows weighted by them, `out.max_sum` (max, sum).
///
/// Keys and values are taken eight rows at a time, widened once (f16/bf16: into a block on the
/// stack, which stays in L1; f32: read in place) and used for all g heads, so each row is read
/// from memory once and converted once. Rows are fixed-size arrays so that each step compiles
/// to whole-vector operations.
fn decode_unit<const W: usize, E: KvElem>(
    q: &[f32],
    keys: Rows<E>,
    values: Rows<E>,
    r0: usize,
    out: &mut UnitOut,
) {
    let g = q.len() / W;
    let n = out.e.len() / g;
    let q: Vec<&[f32; W]> = q
        .chunks_exact(W)
        .map(|r| r.try_into().expect("a query row of W elements"))
        .collect();
    let mut buf = [[0f32; W]; 8];
    // Scores: eight keys at a time for each head (independent sums, one reduction for all
    // eight). A last block of fewer than 8 repeats its last row; those scores are dropped.
    for i in (0..n).step_by(8) {
        let nb = 8.min(n - i);
        let rows = keys.block(r0 + i, nb, &mut buf);
        for (j, qj) in q.iter().enumerate() {
            let s = lanes::scores8(qj, rows);
            out.e[j * n + i..][..nb].copy_from_slice(&s[..nb]);
        }
    }
    for e in out.e.chunks_exact_mut(n) {
        let m = max(e);
        out.max_sum.push((m, lanes::exp_shifted(e, m)));
    }
    // Values: each block of rows weighted into every head's sum.
    for i in (0..n).step_by(8) {
        let nb = 8.min(n - i);
        let rows = values.block(r0 + i, nb, &mut buf);
        for (e, acc) in out.e.chunks_exact(n).zip(out.partial.chunks_exact_mut(W)) {
            let acc: &mut [f32; W] = acc.try_into().expect("W sums");
            let mut a = *acc;
            for (l, row) in rows.iter().take(nb).enumerate() {
                lanes::axpy(e[i + l], row, &mut a);
            }
            *acc = a;
        }
    }
}

/// The largest of `x` (not empty, no NaN), in 8 independent lanes.
fn max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let mut blocks = x.chunks_exact(8);
    for b in &mut blocks {
        for l in 0..8 {
            m[l] = if b[l] > m[l] { b[l] } else { m[l] };
        }
    }
    let rest = blocks.remainder().iter().copied();
    m.into_iter().chain(rest).fold(f32::NEG_INFINITY, f32::max)
}

/// Element types a KV cache may hold, widened to f32 for [`decode_unit`].
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;

    /// `x` itself when it already is f32.
    fn as_f32(x: &[Self]) -> Option<&[f32]>;

    /// `out[i] = widen(src[i])`, eight at a time where the build has SIMD for it.
    fn widen_into(src: &[Self], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(src) {
            *o = x.widen();
        }
    }

    /// Stored elements of a row of `w` values.
    fn row_len(w: usize) -> usize {
        w
    }

    /// A stored row (`row_len(out.len())` elements) as its values.
    fn widen_row(src: &[Self], out: &mut [f32]) {
        Self::widen_into(src, out)
    }
}

/// A block type of a quantized cache, for [`QByte`].
trait BlockKind: Copy + Send + Sync + 'static {
    const TYPE: KvType;
    /// Bytes of a block of 32 values.
    const BYTES: usize;
}

macro_rules! block_kinds {
    ($($name:ident: $t:expr, $bytes:expr;)*) => {$(
        #[derive(Clone, Copy)]
        struct $name;
        impl BlockKind for $name {
            const TYPE: KvType = $t;
            const BYTES: usize = $bytes;
        }
    )*};
}

block_kinds! {
    Q8_0B: KvType::Q8_0, 34;
    Q5_1B: KvType::Q5_1, 24;
    Q5_0B: KvType::Q5_0, 22;
    Q4_1B: KvType::Q4_1, 20;
    Q4_0B: KvType::Q4_0, 18;
}

/// A byte of a quantized cache's rows (GGML blocks of type `B`, 32 values each): read a row
/// at a time, never a byte alone.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct QByte<B>(u8, std::marker::PhantomData<B>);

impl<B: BlockKind> QByte<B> {
    fn cast(x: &[u8]) -> &[QByte<B>] {
        // SAFETY: `QByte` is `repr(transparent)` over `u8` (its other field is zero-sized):
        // same size, alignment and validity.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) }
    }

    fn bytes(x: &[QByte<B>]) -> &[u8] {
        // SAFETY: as in `cast`, the other way.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) }
    }
}

impl<B: BlockKind> KvElem for QByte<B> {
    /// Not a value: a byte of a block (`widen_row` reads the blocks).
    fn widen(self) -> f32 {
        self.0 as f32
    }

    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }

    fn row_len(w: usize) -> usize {
        w / 32 * B::BYTES
    }

    fn widen_row(src: &[Self], out: &mut [f32]) {
        let blocks = Self::bytes(src).chunks_exact(B::BYTES);
        for (b, y) in blocks.zip(out.chunks_exact_mut(32)) {
            keydiff_cache::dequantize_block(B::TYPE, b, y);
        }
    }
}

impl KvElem for f32 {
    fn widen(self) -> f32 {
        self
    }

    fn as_f32(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }
}

/// Implements [`KvElem`] for a 16-bit float type, whose eight values at a pointer `load8`
/// widens to a vector.
macro_rules! half_elem {
    ($t:ty, $load8:path) => {
        impl KvElem for $t {
            fn widen(self) -> f32 {
                self.to_f32()
            }

            fn as_f32(_: &[$t]) -> Option<&[f32]> {
                None
            }

            #[cfg(avx2_f16c)]
            fn widen_into(src: &[$t], out: &mut [f32]) {
                use std::arch::x86_64::_mm256_storeu_ps;
                let n = src.len().min(out.len());
                let mut i = 0;
                while i + 8 <= n {
                    // SAFETY: i + 8 <= n, within both slices; the build targets AVX2 and
                    // F16C (the cfg).
                    unsafe {
                        _mm256_storeu_ps(
                            out.as_mut_ptr().add(i),
                            $load8(src.as_ptr().add(i).cast()),
                        )
                    };
                    i += 8;
                }
                for (o, x) in out[i..n].iter_mut().zip(&src[i..n]) {
                    *o = x.widen();
                }
            }
        }
    };
}

half_elem!(half::f16, simd::load8_f16);
half_elem!(half::bf16, simd::load8_bf16);

/// Every E4M3 value as f32, by its bits: a table read in place of `float8`'s bit-by-bit
/// conversion (the values are the same: the table is made by it).
const F8E4M3_TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = float8::F8E4M3::from_bits(i as u8).to_f32();
        i += 1;
    }
    t
};

impl KvElem for float8::F8E4M3 {
    fn widen(self) -> f32 {
        F8E4M3_TABLE[self.to_bits() as usize]
    }

    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

// The row operations of `decode_unit` (`lanes`): AVX2/FMA/F16C where the build targets them
// (`-C target-cpu=native` here, x86-64-v3 for carried binaries; `avx2_f16c`, set by
// build.rs), else portable. The compiler does not find the SIMD forms itself: it vectorised
// the portable dot product 2 lanes wide.
#[cfg(not(avx2_f16c))]
use portable as lanes;
#[cfg(avx2_f16c)]
use simd as lanes;

/// AVX2/FMA/F16C forms of the row operations.
#[cfg(avx2_f16c)]
mod simd {
    use std::arch::x86_64::*;

    /// Eight f16 at `p`, widened.
    ///
    /// # Safety
    /// `p..p + 8` is readable.
    #[inline(always)]
    pub unsafe fn load8_f16(p: *const u16) -> __m256 {
        // SAFETY: the caller's contract; the build targets F16C (the module's cfg).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    /// Eight bf16 at `p`, widened: bf16 is the top half of an f32.
    ///
    /// # Safety
    /// `p..p + 8` is readable.
    #[inline(always)]
    pub unsafe fn load8_bf16(p: *const u16) -> __m256 {
        // SAFETY: the caller's contract; the build targets AVX2 (the module's cfg).
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// `q · k[l]` for eight rows: one accumulator per row, reduced together.
    #[inline(always)]
    pub fn scores8<const W: usize>(q: &[f32; W], k: [&[f32; W]; 8]) -> [f32; 8] {
        const { assert!(W.is_multiple_of(8)) };
        // SAFETY: the build targets AVX2/FMA (the module's cfg), and c + 8 <= W, so each
        // 8-float load reads inside `q` and `k[l]`.
        unsafe {
            let mut s = [_mm256_setzero_ps(); 8];
            for c in (0..W).step_by(8) {
                let x = _mm256_loadu_ps(q.as_ptr().add(c));
                for l in 0..8 {
                    s[l] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[l].as_ptr().add(c)), s[l]);
                }
            }
            // Lane sums of all eight, in order: pairwise horizontal adds, then the 128-bit
            // halves of rows 0–3 and 4–7 added.
            let t0 = _mm256_hadd_ps(s[0], s[1]);
            let t1 = _mm256_hadd_ps(s[2], s[3]);
            let t2 = _mm256_hadd_ps(s[4], s[5]);
            let t3 = _mm256_hadd_ps(s[6], s[7]);
            let u0 = _mm256_hadd_ps(t0, t1);
            let u1 = _mm256_hadd_ps(t2, t3);
            let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
            let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
            out
        }
    }

    /// `acc += e · v`.
    #[inline(always)]
    pub fn axpy<const W: usize>(e: f32, v: &[f32; W], acc: &mut [f32; W]) {
        const { assert!(W.is_multiple_of(8)) };
        // SAFETY: the build targets AVX2/FMA (the module's cfg); c + 8 <= W for `v` and `acc`.
        unsafe {
            let e = _mm256_set1_ps(e);
            for c in (0..W).step_by(8) {
                let pa = acc.as_mut_ptr().add(c);
                let x = _mm256_loadu_ps(v.as_ptr().add(c));
                _mm256_storeu_ps(pa, _mm256_fmadd_ps(e, x, _mm256_loadu_ps(pa)));
            }
        }
    }

    /// `x[i] = exp(x[i] - m)` (every x[i] <= m) and their sum: [`exp8`] eight at a time, the
    /// rest with `f32::exp`.
    #[inline(always)]
    pub fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
        let mut blocks = x.chunks_exact_mut(8);
        // SAFETY: the build targets AVX2/FMA (the module's cfg); each block has 8 elements.
        let mut z = unsafe {
            let (mm, mut z) = (_mm256_set1_ps(m), _mm256_setzero_ps());
            for b in &mut blocks {
                let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(b.as_ptr()), mm));
                _mm256_storeu_ps(b.as_mut_ptr(), y);
                z = _mm256_add_ps(z, y);
            }
            hsum(z)
        };
        for v in blocks.into_remainder() {
            *v = (*v - m).exp();
            z += *v;
        }
        z
    }

    /// exp of eight values at most 0 (Cephes' `expf`: x = n·ln 2 + r with |r| <= ln 2 / 2,
    /// a degree-7 polynomial in r, times 2^n; within 2 ulp of `f32::exp`). Below -87.3 (past
    /// the smallest normal f32) it gives 0, as the softmax needs.
    #[inline(always)]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: the caller's build targets AVX2/FMA.
        unsafe {
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.336_55));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            // ln 2 in two parts, so that n · ln2_hi is exact.
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
            let mut p = _mm256_set1_ps(1.987_569_1e-4);
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                0.166_666_65,
                0.5,
            ] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let r2 = _mm256_mul_ps(r, r);
            let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
            // 2^n through the exponent bits (n >= -126 here).
            let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            let y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
            _mm256_andnot_ps(tiny, y)
        }
    }

    /// Horizontal sum of 8 lanes.
    #[inline(always)]
    fn hsum(s: __m256) -> f32 {
        // SAFETY: the build targets AVX2 (the module's cfg), which includes AVX and SSE3.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }
}

/// Portable forms of the row operations (compiled everywhere, so that their tests run on x86
/// too).
#[cfg_attr(avx2_f16c, allow(dead_code))]
mod portable {
    use super::fma;

    /// `q · k`: 16 independent lanes reduced pairwise.
    #[inline(always)]
    pub fn dot<const W: usize>(q: &[f32; W], k: &[f32; W]) -> f32 {
        const L: usize = 16;
        let mut acc = [0f32; L];
        for (x, y) in q.as_chunks::<L>().0.iter().zip(k.as_chunks::<L>().0) {
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

    #[inline(always)]
    pub fn scores8<const W: usize>(q: &[f32; W], k: [&[f32; W]; 8]) -> [f32; 8] {
        k.map(|k| dot(q, k))
    }

    #[inline(always)]
    pub fn axpy<const W: usize>(e: f32, v: &[f32; W], acc: &mut [f32; W]) {
        for c in 0..W {
            acc[c] = fma(e, v[c], acc[c]);
        }
    }

    #[inline(always)]
    pub fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
        let mut z = 0f32;
        for v in x.iter_mut() {
            *v = (*v - m).exp();
            z += *v;
        }
        z
    }
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

/// Index of the largest value of `xs`; the first one on ties, NaNs skipped, and 0 when `xs`
/// starts with NaN (or is empty): greedy sampling's choice, on the host. The reference of
/// `keydiff_argmax_rows_*`.
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy sampling where the logits are: [`argmax`] of each row of `logits` (`[vocab]` or
/// `[rows, vocab]`, f32/f16/bf16). On CUDA one launch of keydiff's kernel
/// (`keydiff_argmax_rows_*`), and 4 bytes a row come back to the host instead of the row;
/// elsewhere, or with `KEYDIFF_CUDA_ARGMAX=0`, the host reads the rows.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    static ON: OnceLock<bool> = OnceLock::new();
    let x = match logits.rank() {
        1 => logits.unsqueeze(0)?,
        2 => logits.clone(),
        r => {
            return Err(ModelError::Shape(format!(
                "greedy sampling over logits of rank {r} (1 or 2)"
            )))
        }
    };
    let (rows, cols) = x.dims2()?;
    if cols == 0 {
        return Err(ModelError::Shape(
            "greedy sampling over an empty vocabulary".into(),
        ));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let float = matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if switched_on(&ON, "KEYDIFF_CUDA_ARGMAX")
        && x.device().is_cuda()
        && float
        && x.stride()[1] == 1
    {
        if let Some(t) = cuda_argmax_rows(&x)? {
            return Ok(t.to_vec1::<u32>()?);
        }
    }
    let x = x.to_dtype(DType::F32)?;
    let (s, l) = x.storage_and_layout();
    if let (candle_core::Storage::Cpu(c), Some((start, end))) = (&*s, l.contiguous_offsets()) {
        // The CPU's rows in place: no copy of the vocabulary per step.
        let all = &c.as_slice::<f32>()?[start..end];
        return Ok(all.chunks_exact(cols).map(argmax).collect());
    }
    drop(s);
    Ok(x.to_vec2::<f32>()?.iter().map(|r| argmax(r)).collect())
}

#[cfg(feature = "cuda")]
fn cuda_argmax_rows(x: &Tensor) -> Result<Option<Tensor>> {
    Ok(Some(x.apply_op1_no_bwd(&CudaArgmax)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_argmax_rows(_x: &Tensor) -> Result<Option<Tensor>> {
    Ok(None)
}

/// The candle op of [`argmax_rows`] on CUDA.
#[cfg(feature = "cuda")]
struct CudaArgmax;

#[cfg(feature = "cuda")]
impl candle_core::CustomOp1 for CudaArgmax {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("argmax-rows: the CUDA kernel's op runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        keydiff_kernels::argmax_rows((x, l))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, D};

    use super::*;
    use crate::attention::{attention_output, attention_probs};

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
            // f32 sums over T slots in another order: relative to the output's size, within
            // 1e-5 or the bound of a sum of T terms, T × f32's unit roundoff (the inputs are
            // random and unseeded: at T = 9000 and spread 8, 7.6e-5 was seen once).
            let diff = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let size = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
            let tol = 1e-5f32.max(k.dim(1)? as f32 * f32::EPSILON / 2.0);
            assert!(diff < tol * size, "{label}: output max diff {diff}");
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
    const KV_DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F8E4M3];

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

    /// Rows of every block type read in place (blocks of a cache buffer's used slots) give
    /// what the eager path gives on their dequantized values; u8 rows without their type
    /// are refused, not guessed.
    #[test]
    fn decode_kernel_reads_quantized_blocks() -> Result<()> {
        use keydiff_cache::{dequantize_blocks, quantize_blocks};
        let dev = Device::Cpu;
        for b in KvType::BLOCKS {
            for (kv, g, d) in [(2, 3, 64), (1, 4, 128), (2, 1, 256)] {
                for t in [1, 9, 300] {
                    let kx = Tensor::randn(0f32, 2., (kv, t + 5, d), &dev)?;
                    let vx = (Tensor::randn(0f32, 1., (kv, t + 3, d), &dev)? + 0.5)?;
                    let (kb, vb) = (quantize_blocks(&kx, b)?, quantize_blocks(&vx, b)?);
                    let (k, v) = (kb.narrow(1, 0, t)?, vb.narrow(1, 0, t)?);
                    let q = Tensor::randn(0f32, 1., (kv, g, d), &dev)?;
                    let (kf, vf) = (dequantize_blocks(&k, b, d)?, dequantize_blocks(&v, b, d)?);
                    let probs = attention_probs(&q, &kf, None, g)?;
                    let want = attention_output(&probs, &vf)?;
                    let (y, p) = decode_attention_cpu_blocks(&q, &k, &v, b, true)?
                        .expect("blocks of 64/128/256 values take the kernel");
                    let diff = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    let size = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
                    assert!(diff < 1e-5 * size, "{b} kv {kv} g {g} d {d} t {t}: {diff}");
                    let err = ((&p.unwrap() - &probs)?.abs()? / (probs.abs()? + 1e-5)?)?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    assert!(
                        err < 1e-4,
                        "{b} kv {kv} g {g} d {d} t {t}: probabilities {err}"
                    );
                }
            }
        }
        let q = Tensor::randn(0f32, 1., (1, 2, 64), &dev)?;
        let k = quantize_blocks(&Tensor::randn(0f32, 1., (1, 4, 64), &dev)?, KvType::Q4_0)?;
        assert!(
            decode_attention_cpu(&q, &k, &k, false).is_err(),
            "u8 without a type"
        );
        // q4_0 rows (36 bytes) said to be q8_0 (68 bytes a row) do not fit.
        assert!(decode_attention_cpu_blocks(&q, &k, &k, KvType::Q8_0, false).is_err());
        assert!(decode_attention_cpu_blocks(&q, &k, &k, DType::F16.into(), false).is_err());
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

    /// The row operations this build uses (SIMD on x86-64-v3) and the portable ones against
    /// f64 sums.
    #[test]
    fn row_operations_match_naive() -> Result<()> {
        let x = Tensor::randn(0f32, 1., (9, 128), &Device::Cpu)?.to_vec2::<f32>()?;
        let row = |i: usize| -> &[f32; 128] { x[i].as_slice().try_into().expect("128") };
        let q = row(0);
        let naive = |k: &[f32; 128]| -> f32 {
            q.iter()
                .zip(k)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        };
        let k8: [&[f32; 128]; 8] = std::array::from_fn(|l| row(l + 1));
        let (fast8, port8) = (lanes::scores8(q, k8), portable::scores8(q, k8));
        for (l, k) in k8.into_iter().enumerate() {
            let want = naive(k);
            for (name, got) in [
                ("portable dot", portable::dot(q, k)),
                ("scores8", fast8[l]),
                ("portable scores8", port8[l]),
            ] {
                assert!((got - want).abs() < 1e-4, "{name} row {l}: {got} vs {want}");
            }
        }
        let mut want = *q;
        for (w, v) in want.iter_mut().zip(k8[0]) {
            *w = fma(0.37, *v, *w);
        }
        let (mut got, mut port) = (*q, *q);
        lanes::axpy(0.37, k8[0], &mut got);
        portable::axpy(0.37, k8[0], &mut port);
        assert_eq!(got, want, "axpy");
        assert_eq!(port, want, "portable axpy");
        Ok(())
    }

    /// f16/bf16 rows widened (SIMD where built, eight at a time, then the rest) exactly as
    /// `half` widens each value.
    #[test]
    fn widening_is_exact() -> Result<()> {
        fn check<E: KvElem>(x: &[f32], to: fn(f32) -> E) {
            for n in [1, 8, 13, 64, 256] {
                let src: Vec<E> = x[..n].iter().map(|&v| to(v)).collect();
                let mut out = vec![f32::NAN; n];
                E::widen_into(&src, &mut out);
                let want: Vec<f32> = src.iter().map(|v| v.widen()).collect();
                assert_eq!(out, want, "n = {n}");
            }
        }
        let x = (Tensor::randn(0f32, 1., 256, &Device::Cpu)? * 100.0)?.to_vec1::<f32>()?;
        check(&x, half::f16::from_f32);
        check(&x, half::bf16::from_f32);
        assert_eq!(half::f16::from_f32(1.5).widen(), 1.5);
        assert_eq!(half::bf16::from_f32(-2.5).widen(), -2.5);
        Ok(())
    }

    /// The softmax's exp against `f32::exp`: within 2 ulp from 0 down to where f32 runs out of
    /// normal numbers, 0 below that, and the sum of the shifted values; lengths that leave a
    /// remainder after the blocks of 8.
    #[test]
    fn exp_shifted_matches_f32_exp() {
        for n in [1usize, 7, 8, 9, 4099] {
            // From m down to m - 104, past the cut-off at -87.34.
            let m = 3.25f32;
            let x: Vec<f32> = (0..n).map(|i| m - 104.0 * i as f32 / (n as f32)).collect();
            for (name, exp) in [
                (
                    "this build's",
                    lanes::exp_shifted as fn(&mut [f32], f32) -> f32,
                ),
                ("portable", portable::exp_shifted),
            ] {
                let mut y = x.clone();
                let z = exp(&mut y, m);
                let mut sum = 0f64;
                for (xi, yi) in x.iter().zip(&y) {
                    let want = (xi - m).exp();
                    sum += *yi as f64;
                    if xi - m < -87.0 {
                        assert!(*yi == 0.0 || (*yi - want).abs() <= 2.0 * f32::MIN_POSITIVE);
                    } else {
                        let ulp = want * f32::EPSILON;
                        assert!(
                            (yi - want).abs() <= 2.0 * ulp,
                            "{name} exp({}) = {yi}, want {want}",
                            xi - m
                        );
                    }
                }
                assert!(
                    (z as f64 - sum).abs() <= 1e-6 * sum,
                    "{name}: sum {z} vs {sum}"
                );
            }
        }
    }

    /// The widened cache view is `to_dtype`'s, for views with offsets and strides as the
    /// cache gives them, and in either row order.
    #[test]
    fn widened_views_equal_to_dtype() -> Result<()> {
        let dev = Device::Cpu;
        for dt in [DType::F16, DType::BF16, DType::F8E4M3] {
            let buf = Tensor::randn(0f32, 1., (3, 40, 64), &dev)?.to_dtype(dt)?;
            let outer = Tensor::randn(0f32, 1., (40, 3, 64), &dev)?.to_dtype(dt)?;
            for v in [
                buf.narrow(0, 1, 2)?.narrow(1, 3, 29)?,
                outer.narrow(0, 0, 17)?.transpose(0, 1)?,
            ] {
                let got = widen_cache_view(&v)?.expect("a CPU half-precision view");
                assert_eq!(got.dims(), v.dims());
                let want = v.to_dtype(DType::F32)?;
                let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{dt:?}");
            }
        }
        let f32_view = Tensor::zeros((2, 3, 64), DType::F32, &dev)?;
        assert!(widen_cache_view(&f32_view)?.is_none());
        Ok(())
    }

    #[test]
    fn max_of_blocks_and_rest() {
        for n in [1usize, 5, 8, 13, 64] {
            for at in 0..n {
                let mut x: Vec<f32> = (0..n).map(|i| -(i as f32) - 1.0).collect();
                x[at] = 0.5;
                assert_eq!(max(&x), 0.5, "n={n} at={at}");
            }
        }
    }
}
