//! How a KV cache holds keys and values: a float dtype, or blocks of llama.cpp's cache types.
//!
//! llama.cpp's `--cache-type-k/-v` types `q8_0`, `q5_1`, `q5_0`, `q4_1` and `q4_0` store each
//! run of 32 values of a row as one GGML block: an f16 scale `d` (and for `_1` types an f16
//! minimum `m`), then the values' codes. `q8_0`: 32 signed bytes `round(x / d)`, `d = max|x| /
//! 127`, 34 bytes. `q4_0`/`q5_0`: codes `x / d + 8` (`+ 16`) in 4 (5) bits with `d` the value
//! of largest magnitude over -8 (-16), 18 (22) bytes. `q4_1`/`q5_1`: codes `(x - min) / d` with
//! `d = (max - min) / 15` (`/ 31`), 20 (24) bytes. A fifth bit lives in a 32-bit word `qh`,
//! bit j for value j; nibbles pack value j in the low half of byte j and value j + 16 in its
//! high half. Bytes per value: 1.06, 0.75, 0.69, 0.63, 0.56 (f16: 2).
//!
//! The cache holds a head's row of `d` values as `d / 32` blocks, exactly GGML's layouts
//! (`block_q8_0`, `block_q4_0`, ...), in a u8 buffer `[kv_heads, capacity, d / 32 · bytes]`,
//! so slots move as rows of bytes like any other. The codecs are GGML's references
//! (`quantize_row_q4_0_ref`, ..., which candle's `BlockQ4_0`, ... follow): tests compare them
//! with candle's quantizers byte for byte. On CUDA, `keydiff_kvq_quantize_*` and
//! `keydiff_kvq_dequantize` of `kernels/keydiff.cu` do the same arithmetic (no fused
//! multiply-adds), so their bytes and values are the same (checked under the kernel
//! emulation).
//!
//! fp8 (E4M3, `f8e4m3`) is vLLM's `--kv-cache-dtype fp8` with its default scale of 1: each
//! value is rounded to the nearest E4M3 (saturating at ±448), with no scale per row. It is a
//! float dtype here, read by conversion like f16 and bf16.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::f16;

use crate::{CacheError, Result};

/// Values per block of every quantized cache type.
pub const KV_BLOCK: usize = 32;

/// What a KV cache holds: keys and values in a float dtype (f32, f16, bf16 or f8e4m3), or
/// GGML blocks of one of llama.cpp's quantized cache types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    Float(DType),
    Q8_0,
    Q5_1,
    Q5_0,
    Q4_1,
    Q4_0,
}

impl From<DType> for KvType {
    fn from(dtype: DType) -> Self {
        KvType::Float(dtype)
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl KvType {
    /// The quantized types, largest first.
    pub const BLOCKS: [KvType; 5] = [
        KvType::Q8_0,
        KvType::Q5_1,
        KvType::Q5_0,
        KvType::Q4_1,
        KvType::Q4_0,
    ];

    /// Names this type takes: candle's dtype names, llama.cpp's `q8_0`, `q5_1`, `q5_0`,
    /// `q4_1`, `q4_0`, and vLLM's `fp8` and `fp8_e4m3` for `f8e4m3`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "f32" => DType::F32.into(),
            "f16" => DType::F16.into(),
            "bf16" => DType::BF16.into(),
            "f8e4m3" | "fp8" | "fp8_e4m3" => DType::F8E4M3.into(),
            _ => return Self::BLOCKS.into_iter().find(|t| t.as_str() == name),
        })
    }

    /// The names [`KvType::parse`] takes, for messages.
    pub const NAMES: &'static str = "f32, f16, bf16, fp8 (f8e4m3), q8_0, q5_1, q5_0, q4_1, q4_0";

    /// `f32`, `f16`, `bf16`, `f8e4m3`, or the block type's llama.cpp name (`q8_0`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            KvType::Float(dt) => dt.as_str(),
            KvType::Q8_0 => "q8_0",
            KvType::Q5_1 => "q5_1",
            KvType::Q5_0 => "q5_0",
            KvType::Q4_1 => "q4_1",
            KvType::Q4_0 => "q4_0",
        }
    }

    /// Bytes of one block of 32 values; `None` for a float type.
    pub fn block_bytes(&self) -> Option<usize> {
        match self {
            KvType::Float(_) => None,
            KvType::Q8_0 => Some(34),
            KvType::Q5_1 => Some(24),
            KvType::Q5_0 => Some(22),
            KvType::Q4_1 => Some(20),
            KvType::Q4_0 => Some(18),
        }
    }

    /// The number `kernels/keydiff.cu` knows a block type by (`KD_KVQ_*`); `None` for a
    /// float type.
    pub fn block_code(&self) -> Option<i32> {
        Self::BLOCKS
            .iter()
            .position(|t| t == self)
            .map(|i| i as i32)
    }

    /// The dtype of the cache's buffers: the float dtype, or u8 for blocks.
    pub fn storage_dtype(&self) -> DType {
        match self {
            KvType::Float(dt) => *dt,
            _ => DType::U8,
        }
    }

    /// Elements of the buffer per head and slot for heads of `head_dim` values.
    pub fn row_len(&self, head_dim: usize) -> usize {
        match self.block_bytes() {
            None => head_dim,
            Some(b) => head_dim / KV_BLOCK * b,
        }
    }

    /// Bytes one head's keys (or values) of one slot take.
    pub fn row_bytes(&self, head_dim: usize) -> usize {
        self.row_len(head_dim) * self.storage_dtype().size_in_bytes()
    }

    /// The head size a buffer row of `row_len` elements holds, when it is a whole row.
    pub fn head_dim_of(&self, row_len: usize) -> Option<usize> {
        match self.block_bytes() {
            None => Some(row_len),
            Some(b) => row_len.is_multiple_of(b).then_some(row_len / b * KV_BLOCK),
        }
    }

    /// Fails unless a cache can hold heads of `head_dim` values in this type: a float dtype
    /// of f32, f16, bf16 or f8e4m3; a block type needs a multiple of 32.
    pub fn check(&self, head_dim: usize) -> std::result::Result<(), String> {
        match self {
            KvType::Float(DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3) => Ok(()),
            KvType::Float(dt) => Err(format!(
                "a KV cache in {} (expected one of {})",
                dt.as_str(),
                Self::NAMES
            )),
            t if !head_dim.is_multiple_of(KV_BLOCK) || head_dim == 0 => Err(format!(
                "a {t} KV cache needs heads of a multiple of {KV_BLOCK} values; this model's \
                 have {head_dim}"
            )),
            _ => Ok(()),
        }
    }

    /// Puts rows `[.., head_dim]` (any float dtype) into this type's buffer form.
    pub fn encode(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            KvType::Float(DType::F8E4M3) if x.device().is_cuda() => {
                Ok(x.apply_op1_no_bwd(&Fp8Rows {
                    encode: true,
                    out: DType::F8E4M3,
                })?)
            }
            KvType::Float(dt) => Ok(x.to_dtype(*dt)?),
            t => quantize_blocks(x, *t),
        }
    }

    /// Reads buffer rows back as values: a float cache's rows as they are (no copy), blocks
    /// as f32 rows of `head_dim` values. On CUDA, fp8 rows too are read into f32 (candle's
    /// CUDA casts of F8E4M3 cannot be reached; see [`Fp8Rows`]).
    pub fn decode(&self, x: &Tensor, head_dim: usize) -> Result<Tensor> {
        match self {
            KvType::Float(DType::F8E4M3) if x.device().is_cuda() => {
                Ok(x.apply_op1_no_bwd(&Fp8Rows {
                    encode: false,
                    out: DType::F32,
                })?)
            }
            KvType::Float(_) => Ok(x.clone()),
            t => dequantize_blocks(x, *t, head_dim),
        }
    }

    /// [`KvType::decode`] into `dtype` (f32, f16 or bf16): the values `decode(..).to_dtype(dtype)`
    /// gives. On CUDA the kernels write block and fp8 rows in `dtype` directly (one pass, no
    /// f32 copy of the view); float caches are cast as `to_dtype` casts them.
    pub fn decode_as(&self, x: &Tensor, head_dim: usize, dtype: DType) -> Result<Tensor> {
        let cuda = x.device().is_cuda();
        match self {
            KvType::Float(DType::F8E4M3) if cuda => Ok(x.apply_op1_no_bwd(&Fp8Rows {
                encode: false,
                out: dtype,
            })?),
            KvType::Float(_) => Ok(x.to_dtype(dtype)?),
            t if cuda => dequantize_blocks_as(x, *t, head_dim, dtype),
            t => Ok(dequantize_blocks(x, *t, head_dim)?.to_dtype(dtype)?),
        }
    }
}

/// What a cache holds its keys and its values in: one type for both, or two (llama.cpp's
/// `--cache-type-k` and `--cache-type-v`: Qwen 2.5's keys lose more to Q8_0 than its values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl From<KvType> for KvTypes {
    fn from(t: KvType) -> Self {
        KvTypes { k: t, v: t }
    }
}

impl From<DType> for KvTypes {
    fn from(dtype: DType) -> Self {
        KvType::Float(dtype).into()
    }
}

impl std::fmt::Display for KvTypes {
    /// The type, or `K/V` (`f16/q8_0`) when they differ.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.k == self.v {
            write!(f, "{}", self.k)
        } else {
            write!(f, "{}/{}", self.k, self.v)
        }
    }
}

impl KvTypes {
    /// `T` (both) or `K/V`, as [`KvTypes`] displays them.
    pub fn parse(s: &str) -> Option<Self> {
        match s.split_once('/') {
            Some((k, v)) => Some(KvTypes {
                k: KvType::parse(k)?,
                v: KvType::parse(v)?,
            }),
            None => KvType::parse(s).map(Into::into),
        }
    }

    /// Bytes one slot of one head takes, key and value.
    pub fn slot_bytes(&self, head_dim: usize) -> usize {
        self.k.row_bytes(head_dim) + self.v.row_bytes(head_dim)
    }

    /// Fails unless a cache can hold heads of `head_dim` values in these types.
    pub fn check(&self, head_dim: usize) -> std::result::Result<(), String> {
        if self.k == self.v {
            return self.k.check(head_dim);
        }
        self.k.check(head_dim).map_err(|e| format!("keys: {e}"))?;
        self.v.check(head_dim).map_err(|e| format!("values: {e}"))
    }
}

fn put_f16(out: &mut [u8], x: f32) {
    out[..2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
}

fn get_f16(q: &[u8]) -> f32 {
    f16::from_le_bytes([q[0], q[1]]).to_f32()
}

/// The value of largest magnitude (the first of equals), as GGML's `_0` quantizers find it.
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// Packs 32 codes of 4 bits (`qs`, value j low and j + 16 high in byte j) and, for 5-bit
/// codes, their fifth bits (`qh`, bit j for value j, little endian).
fn pack_codes(codes: &[u8; KV_BLOCK], qh: Option<&mut [u8]>, qs: &mut [u8]) {
    for j in 0..KV_BLOCK / 2 {
        qs[j] = (codes[j] & 0x0f) | ((codes[j + 16] & 0x0f) << 4);
    }
    if let Some(qh) = qh {
        let bits = codes
            .iter()
            .enumerate()
            .fold(0u32, |h, (j, &c)| h | (((c as u32 & 0x10) >> 4) << j));
        qh.copy_from_slice(&bits.to_le_bytes());
    }
}

/// The 32 codes of a block packed by [`pack_codes`].
fn unpack_codes(qh: Option<&[u8]>, qs: &[u8]) -> [u8; KV_BLOCK] {
    let h = qh.map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    std::array::from_fn(|j| {
        let nib = if j < 16 {
            qs[j] & 0x0f
        } else {
            qs[j - 16] >> 4
        };
        nib | ((((h >> j) & 1) as u8) << 4)
    })
}

/// One block of 32 values into `t`'s bytes: GGML's `quantize_row_q8_0_ref`,
/// `quantize_row_q5_1_ref`, `quantize_row_q5_0_ref`, `quantize_row_q4_1_ref` or
/// `quantize_row_q4_0_ref`. Panics on a float type.
pub fn quantize_block(t: KvType, x: &[f32], out: &mut [u8]) {
    debug_assert_eq!((x.len(), Some(out.len())), (KV_BLOCK, t.block_bytes()));
    match t {
        KvType::Q8_0 => {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(out, d);
            for (q, &v) in out[2..].iter_mut().zip(x) {
                *q = (v * id).round() as i8 as u8;
            }
        }
        KvType::Q4_0 | KvType::Q5_0 => {
            let half = if t == KvType::Q4_0 { 8.0 } else { 16.0 };
            let d = signed_max(x) / -half;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(out, d);
            let top = 2.0 * half - 1.0;
            let codes = std::array::from_fn(|j| ((x[j] * id + (half + 0.5)) as u8).min(top as u8));
            if t == KvType::Q4_0 {
                pack_codes(&codes, None, &mut out[2..]);
            } else {
                let (qh, qs) = out[2..].split_at_mut(4);
                pack_codes(&codes, Some(qh), qs);
            }
        }
        KvType::Q4_1 | KvType::Q5_1 => {
            let top: u8 = if t == KvType::Q4_1 { 15 } else { 31 };
            let (min, max) = min_max(x);
            let d = (max - min) / top as f32;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(out, d);
            put_f16(&mut out[2..], min);
            let codes = std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as u8).min(top));
            if t == KvType::Q4_1 {
                pack_codes(&codes, None, &mut out[4..]);
            } else {
                let (qh, qs) = out[4..].split_at_mut(4);
                pack_codes(&codes, Some(qh), qs);
            }
        }
        KvType::Float(dt) => panic!("quantize_block: {} is not a block type", dt.as_str()),
    }
}

/// One block of `t`'s bytes into its 32 values: GGML's `dequantize_row_*`. Panics on a float
/// type.
pub fn dequantize_block(t: KvType, q: &[u8], out: &mut [f32]) {
    debug_assert_eq!((Some(q.len()), out.len()), (t.block_bytes(), KV_BLOCK));
    let d = get_f16(q);
    match t {
        KvType::Q8_0 => {
            for (o, &b) in out.iter_mut().zip(&q[2..]) {
                *o = b as i8 as f32 * d;
            }
        }
        KvType::Q4_0 | KvType::Q5_0 => {
            let (codes, half) = match t {
                KvType::Q4_0 => (unpack_codes(None, &q[2..]), 8),
                _ => (unpack_codes(Some(&q[2..6]), &q[6..]), 16),
            };
            for (o, &c) in out.iter_mut().zip(&codes) {
                *o = (c as i32 - half) as f32 * d;
            }
        }
        KvType::Q4_1 | KvType::Q5_1 => {
            let m = get_f16(&q[2..]);
            let codes = match t {
                KvType::Q4_1 => unpack_codes(None, &q[4..]),
                _ => unpack_codes(Some(&q[4..8]), &q[8..]),
            };
            for (o, &c) in out.iter_mut().zip(&codes) {
                *o = c as f32 * d + m;
            }
        }
        KvType::Float(dt) => panic!("dequantize_block: {} is not a block type", dt.as_str()),
    }
}

/// Blocks of `t` for rows `[.., d]` (f32, f16 or bf16; d a multiple of 32): u8
/// `[.., d / 32 · bytes]`.
pub fn quantize_blocks(x: &Tensor, t: KvType) -> Result<Tensor> {
    let d = x.dims().last().copied().unwrap_or(0);
    if t.block_bytes().is_none() {
        return Err(CacheError::Config(format!("{t} is not a block type")));
    }
    t.check(d).map_err(CacheError::Config)?;
    if x.elem_count() == 0 {
        let mut shape = x.dims().to_vec();
        *shape.last_mut().unwrap() = t.row_len(d);
        return Ok(Tensor::zeros(shape, DType::U8, x.device())?);
    }
    Ok(x.apply_op1_no_bwd(&BlockQuantize { t })?)
}

/// Rows of `t`'s blocks, u8 `[.., head_dim / 32 · bytes]` (rows contiguous; any outer
/// strides, such as a view of a cache's used slots), into f32 `[.., head_dim]`.
pub fn dequantize_blocks(q: &Tensor, t: KvType, head_dim: usize) -> Result<Tensor> {
    dequantize_blocks_as(q, t, head_dim, DType::F32)
}

/// [`dequantize_blocks`] into `dtype` (f32, f16 or bf16): on CUDA the kernel writes it directly;
/// on the CPU the f32 values are cast (the same values).
fn dequantize_blocks_as(q: &Tensor, t: KvType, head_dim: usize, dtype: DType) -> Result<Tensor> {
    let row = q.dims().last().copied().unwrap_or(0);
    if q.dtype() != DType::U8 || t.block_bytes().is_none() || t.head_dim_of(row) != Some(head_dim) {
        return Err(CacheError::Shape(format!(
            "{t} rows {:?} {} for heads of {head_dim} values",
            q.dims(),
            q.dtype().as_str()
        )));
    }
    if q.elem_count() == 0 {
        // No rows (an empty cache): no launch, on any device.
        let mut shape = q.dims().to_vec();
        *shape.last_mut().unwrap() = head_dim;
        return Ok(Tensor::zeros(shape, dtype, q.device())?);
    }
    if q.device().is_cuda() {
        return Ok(q.apply_op1_no_bwd(&BlockDequantize {
            t,
            head_dim,
            out: dtype,
        })?);
    }
    let y = q.apply_op1_no_bwd(&BlockDequantize {
        t,
        head_dim,
        out: DType::F32,
    })?;
    Ok(y.to_dtype(dtype)?)
}

/// Walks the rows of `layout` (last dimension contiguous): calls `f` with each row's start
/// offset, in row-major order.
fn for_each_row(layout: &Layout, mut f: impl FnMut(usize)) -> candle_core::Result<()> {
    let dims = layout.dims();
    let st = layout.stride();
    let Some((&last, outer)) = dims.split_last() else {
        candle_core::bail!("kv blocks: a scalar is not rows");
    };
    if last > 1 && st[dims.len() - 1] != 1 {
        candle_core::bail!("kv blocks: rows must be contiguous, strides {st:?}");
    }
    let rows: usize = outer.iter().product();
    for r in 0..rows {
        let (mut rem, mut off) = (r, layout.start_offset());
        for (i, &n) in outer.iter().enumerate().rev() {
            off += (rem % n) * st[i];
            rem /= n;
        }
        f(off);
    }
    Ok(())
}

struct BlockQuantize {
    t: KvType,
}

impl CustomOp1 for BlockQuantize {
    fn name(&self) -> &'static str {
        "kv-block-quantize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.dims();
        let d = dims[dims.len() - 1];
        let (t, bb) = (self.t, self.t.block_bytes().unwrap_or(0));
        let rb = t.row_len(d);
        let mut out = vec![0u8; l.shape().elem_count() / d * rb];
        let mut row = vec![0f32; d];
        let mut o = 0;
        macro_rules! run {
            ($xs:expr, $conv:expr) => {
                for_each_row(l, |at| {
                    for (r, v) in row.iter_mut().zip(&$xs[at..at + d]) {
                        *r = $conv(*v);
                    }
                    for (x, q) in row
                        .chunks_exact(KV_BLOCK)
                        .zip(out[o..o + rb].chunks_exact_mut(bb))
                    {
                        quantize_block(t, x, q);
                    }
                    o += rb;
                })?
            };
        }
        match s {
            CpuStorage::F32(xs) => run!(xs, |v: f32| v),
            CpuStorage::F16(xs) => run!(xs, |v: f16| v.to_f32()),
            CpuStorage::BF16(xs) => run!(xs, |v: half::bf16| v.to_f32()),
            _ => candle_core::bail!("{t}-quantize: f32, f16 or bf16 rows, not {:?}", s.dtype()),
        }
        let mut shape = dims.to_vec();
        *shape.last_mut().unwrap() = rb;
        Ok((CpuStorage::U8(out), Shape::from(shape)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        // A cache's chunk is `[kv, B, d]`.
        let (Some(code), Some(bytes)) = (self.t.block_code(), self.t.block_bytes()) else {
            candle_core::bail!("{} is not a block type", self.t);
        };
        match l.dims().len() {
            3 => keydiff_kernels::kvq_quantize(s, l, code, bytes),
            _ => candle_core::bail!(
                "{}-quantize on CUDA takes [kv, n, d], not {:?}",
                self.t,
                l.dims()
            ),
        }
    }
}

/// A contiguous copy of a view of cache rows `[kv, n, row]`. candle 0.11.1's strided copy of
/// F8E4M3 on CUDA asks for a kernel it does not have (`ucopy_f8e4m3`; its kernel is
/// `ucopy_f8_e4m3`), so an fp8 view there goes to f32 and back through the cache kernels,
/// which gives every code back as it was.
pub fn contiguous_rows(t: &Tensor, head_dim: usize) -> Result<Tensor> {
    if t.dtype() == DType::F8E4M3 && t.device().is_cuda() {
        let fp8 = KvType::Float(DType::F8E4M3);
        return fp8.encode(&fp8.decode(t, head_dim)?);
    }
    Ok(t.contiguous()?)
}

/// fp8 E4M3 rows `[kv, n, d]` to and from f32/f16/bf16, by the quantized-cache kernels with
/// `kind` [`keydiff_kernels::geometry::KVQ_FP8`] on CUDA: candle 0.11.1 names its CUDA fp8 casts
/// `cast_f8_e4m3_*` but asks for `cast_f8e4m3_*` (CUDA_ERROR_NOT_FOUND), so a cache cannot use
/// `to_dtype` there. On the CPU the op is the twin of the kernels: `F8E4M3::from_f32` (round to
/// nearest even, saturating at ±448) and `to_f32`, which `to_dtype` also does.
struct Fp8Rows {
    /// Values into fp8 codes; else fp8 codes into `out`.
    encode: bool,
    /// What decoding writes: f32, f16 or bf16 (on the CPU, f32 alone).
    out: DType,
}

impl CustomOp1 for Fp8Rows {
    fn name(&self) -> &'static str {
        if self.encode {
            "kv-fp8-encode"
        } else {
            "kv-fp8-decode"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use float8::F8E4M3;
        let d = l.dims().last().copied().unwrap_or(0);
        let n = l.shape().elem_count();
        macro_rules! rows {
            ($xs:expr, $conv:expr) => {{
                let mut out = Vec::with_capacity(n);
                for_each_row(l, |at| {
                    out.extend($xs[at..at + d].iter().map(|v| $conv(*v)))
                })?;
                out
            }};
        }
        let out = match (self.encode, s) {
            (true, CpuStorage::F32(xs)) => CpuStorage::F8E4M3(rows!(xs, F8E4M3::from_f32)),
            (true, CpuStorage::F16(xs)) => {
                CpuStorage::F8E4M3(rows!(xs, |v: f16| F8E4M3::from_f32(v.to_f32())))
            }
            (true, CpuStorage::BF16(xs)) => {
                CpuStorage::F8E4M3(rows!(xs, |v: half::bf16| F8E4M3::from_f32(v.to_f32())))
            }
            (false, CpuStorage::F8E4M3(xs)) if self.out == DType::F32 => {
                CpuStorage::F32(rows!(xs, |v: F8E4M3| v.to_f32()))
            }
            _ => candle_core::bail!("{}: unsupported rows {:?}", self.name(), s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use keydiff_kernels::geometry::{KVQ_BYTES, KVQ_FP8};
        let dims = l.dims();
        let d = dims.last().copied().unwrap_or(0);
        if dims.len() != 3 || !d.is_multiple_of(KV_BLOCK) {
            candle_core::bail!(
                "an fp8 KV cache on CUDA takes [kv, n, d] rows of a multiple of {KV_BLOCK} values, \
                 not {dims:?}"
            );
        }
        let bytes = KVQ_BYTES[KVQ_FP8 as usize];
        if self.encode {
            keydiff_kernels::kvq_quantize(s, l, KVQ_FP8, bytes)
        } else {
            keydiff_kernels::kvq_dequantize(s, l, d, KVQ_FP8, bytes, self.out)
        }
    }
}

struct BlockDequantize {
    t: KvType,
    head_dim: usize,
    /// f32, f16 or bf16 on CUDA; f32 on the CPU.
    out: DType,
}

impl CustomOp1 for BlockDequantize {
    fn name(&self) -> &'static str {
        "kv-block-dequantize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::U8(qs) = s else {
            candle_core::bail!("{}-dequantize: u8 blocks, not {:?}", self.t, s.dtype());
        };
        if self.out != DType::F32 {
            candle_core::bail!(
                "{}-dequantize on the CPU writes f32, not {:?}",
                self.t,
                self.out
            );
        }
        let dims = l.dims();
        let (d, rb) = (self.head_dim, dims[dims.len() - 1]);
        let (t, bb) = (self.t, self.t.block_bytes().unwrap_or(0));
        let mut out = vec![0f32; l.shape().elem_count() / rb * d];
        let mut o = 0;
        for_each_row(l, |at| {
            for (q, y) in qs[at..at + rb]
                .chunks_exact(bb)
                .zip(out[o..o + d].chunks_exact_mut(KV_BLOCK))
            {
                dequantize_block(t, q, y);
            }
            o += d;
        })?;
        let mut shape = dims.to_vec();
        *shape.last_mut().unwrap() = d;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (Some(code), Some(bytes)) = (self.t.block_code(), self.t.block_bytes()) else {
            candle_core::bail!("{} is not a block type", self.t);
        };
        match l.dims().len() {
            3 => keydiff_kernels::kvq_dequantize(s, l, self.head_dim, code, bytes, self.out),
            _ => candle_core::bail!(
                "{}-dequantize on CUDA takes [kv, n, rb], not {:?}",
                self.t,
                l.dims()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::Device;

    fn rows(n: usize, d: usize, seed: u64) -> Tensor {
        // A spread of magnitudes per row, zeros and an all-zero block included.
        let mut s = seed;
        let v: Vec<f32> = (0..n * d)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0;
                let scale = [0.003f32, 0.2, 7.0, 300.0][(i / d) % 4];
                if (i % d) < 32 && (i / d) % 5 == 4 {
                    0.0
                } else {
                    u * scale
                }
            })
            .collect();
        Tensor::from_vec(v, (n, d), &Device::Cpu).unwrap()
    }

    fn ggml(t: KvType) -> GgmlDType {
        match t {
            KvType::Q8_0 => GgmlDType::Q8_0,
            KvType::Q5_1 => GgmlDType::Q5_1,
            KvType::Q5_0 => GgmlDType::Q5_0,
            KvType::Q4_1 => GgmlDType::Q4_1,
            KvType::Q4_0 => GgmlDType::Q4_0,
            KvType::Float(_) => unreachable!(),
        }
    }

    #[test]
    fn blocks_are_ggml_s_byte_for_byte() -> Result<()> {
        for t in KvType::BLOCKS {
            assert_eq!(t.block_bytes(), Some(ggml(t).type_size()), "{t}");
            for d in [32, 64, 128, 256] {
                let x = rows(10, d, d as u64);
                let ours = quantize_blocks(&x, t)?.flatten_all()?.to_vec1::<u8>()?;
                let theirs = QTensor::quantize(&x, ggml(t))?;
                assert_eq!(ours, theirs.data()?.to_vec(), "{t} d={d}");
                let back = dequantize_blocks(&quantize_blocks(&x, t)?, t, d)?;
                let want = theirs.dequantize(&Device::Cpu)?;
                assert_eq!(back.to_vec2::<f32>()?, want.to_vec2::<f32>()?, "{t} d={d}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_round_trip_is_within_a_step_of_each_block() -> Result<()> {
        let x = rows(16, 64, 7);
        for t in KvType::BLOCKS {
            let back = dequantize_blocks(&quantize_blocks(&x, t)?, t, 64)?.to_vec2::<f32>()?;
            for (xr, br) in x.to_vec2::<f32>()?.iter().zip(&back) {
                for (xb, bb) in xr.chunks(32).zip(br.chunks(32)) {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let (lo, hi) = min_max(xb);
                    // Half a step, and a whole one for the `_0` types' far end (-8d of a
                    // 4-bit code is the value of largest magnitude, +8d is clamped to +7d);
                    // plus the scales' own f16 rounding (2^-11 relative).
                    let tol = match t {
                        KvType::Q8_0 => amax / 127.0 * 0.5,
                        KvType::Q5_0 => amax / 16.0,
                        KvType::Q4_0 => amax / 8.0,
                        KvType::Q5_1 => (hi - lo) / 31.0 * 0.5,
                        KvType::Q4_1 => (hi - lo) / 15.0 * 0.5,
                        KvType::Float(_) => unreachable!(),
                    } + amax * 1e-3
                        + 1e-30;
                    for (a, b) in xb.iter().zip(bb) {
                        assert!((a - b).abs() <= tol, "{t}: {a} -> {b} (amax {amax})");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn strided_views_and_half_inputs_are_read_row_by_row() -> Result<()> {
        // [heads, capacity, d] with the first 5 of 9 slots used: the view of a cache.
        let x = rows(2 * 9, 64, 3).reshape((2, 9, 64))?;
        let view = x.narrow(1, 0, 5)?;
        for t in KvType::BLOCKS {
            let q = quantize_blocks(&view, t)?;
            assert_eq!(q.dims(), [2, 5, t.row_len(64)]);
            let whole = quantize_blocks(&x, t)?;
            assert_eq!(
                q.flatten_all()?.to_vec1::<u8>()?,
                whole.narrow(1, 0, 5)?.flatten_all()?.to_vec1::<u8>()?
            );
            let back = dequantize_blocks(&whole.narrow(1, 0, 5)?, t, 64)?;
            let want = dequantize_blocks(&q, t, 64)?;
            assert_eq!(
                back.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?
            );
            for dt in [DType::F16, DType::BF16] {
                let h = x.to_dtype(dt)?;
                let got = quantize_blocks(&h, t)?.flatten_all()?.to_vec1::<u8>()?;
                let via = quantize_blocks(&h.to_dtype(DType::F32)?, t)?
                    .flatten_all()?
                    .to_vec1::<u8>()?;
                assert_eq!(got, via, "{t} {dt:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_constant_block_comes_back_exactly_where_f16_holds_it() -> Result<()> {
        // max = min: d = 0 and every code 0, so `_1` types give back m; the 4- and 5-bit
        // `_0` types give back their value of largest magnitude exactly when d = max / -8
        // (-16) is an f16, as 0.75 / 8 is. (Q8_0's d = max / 127 is not.)
        let x = Tensor::full(-0.75f32, (1, 32), &Device::Cpu)?;
        for t in [KvType::Q5_1, KvType::Q5_0, KvType::Q4_1, KvType::Q4_0] {
            let back = dequantize_blocks(&quantize_blocks(&x, t)?, t, 32)?;
            assert!(
                back.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .all(|&v| v == -0.75),
                "{t}"
            );
        }
        Ok(())
    }

    #[test]
    fn types_parse_size_and_refuse() {
        assert_eq!(KvType::parse("fp8"), Some(KvType::Float(DType::F8E4M3)));
        for t in KvType::BLOCKS {
            assert_eq!(KvType::parse(t.as_str()), Some(t));
            assert!(KvType::NAMES.contains(t.as_str()));
        }
        assert_eq!(KvType::parse("q4_k"), None);
        assert_eq!(KvType::parse("iq4_nl"), None);
        assert_eq!(KvType::Q8_0.row_bytes(128), 136);
        assert_eq!(KvType::Q4_0.row_bytes(128), 72);
        assert_eq!(KvType::Q5_1.row_bytes(64), 48);
        assert_eq!(KvType::Float(DType::F8E4M3).row_bytes(128), 128);
        assert_eq!(KvType::Q8_0.head_dim_of(136), Some(128));
        assert_eq!(KvType::Q8_0.head_dim_of(135), None);
        assert_eq!(KvType::Q4_1.head_dim_of(40), Some(64));
        assert_eq!(KvType::Q8_0.block_code(), Some(0));
        assert_eq!(KvType::Q4_0.block_code(), Some(4));
        assert_eq!(KvType::Float(DType::F16).block_code(), None);
        assert!(KvType::Q8_0
            .check(48)
            .unwrap_err()
            .contains("multiple of 32"));
        assert!(KvType::Q5_0
            .check(48)
            .unwrap_err()
            .contains("a q5_0 KV cache"));
        assert!(KvType::Float(DType::F64).check(64).is_err());
        let split = KvTypes {
            k: DType::F16.into(),
            v: KvType::Q8_0,
        };
        assert_eq!(split.to_string(), "f16/q8_0");
        assert_eq!(KvTypes::from(KvType::Q8_0).to_string(), "q8_0");
        assert_eq!(
            KvTypes::parse("f16/q4_0"),
            Some(KvTypes {
                k: DType::F16.into(),
                v: KvType::Q4_0
            })
        );
        assert_eq!(KvTypes::parse("q5_1"), Some(KvType::Q5_1.into()));
        assert_eq!(KvTypes::parse("f16/"), None);
        assert_eq!(split.slot_bytes(64), 128 + 68);
        assert!(split.check(48).unwrap_err().starts_with("values: "));
        assert!(!KvTypes::from(KvType::Q8_0)
            .check(48)
            .unwrap_err()
            .contains(": a"));
        for t in KvType::BLOCKS {
            let empty = Tensor::zeros((2, 0, 64), DType::F32, &Device::Cpu).unwrap();
            let q = quantize_blocks(&empty, t).unwrap();
            assert_eq!(q.dims(), [2, 0, t.row_len(64)]);
            assert_eq!(dequantize_blocks(&q, t, 64).unwrap().dims(), [2, 0, 64]);
        }
        let x48 = Tensor::zeros((2, 48), DType::F32, &Device::Cpu).unwrap();
        assert!(quantize_blocks(&x48, KvType::Q4_1).is_err());
        assert!(
            quantize_blocks(&x48.pad_with_zeros(1, 0, 16).unwrap(), DType::F16.into()).is_err()
        );
        // A q4_0 row read as q8_0 is refused by its length.
        let q4 = quantize_blocks(
            &Tensor::zeros((1, 64), DType::F32, &Device::Cpu).unwrap(),
            KvType::Q4_0,
        )
        .unwrap();
        assert!(dequantize_blocks(&q4, KvType::Q8_0, 64).is_err());
    }

    /// The fp8 op CUDA runs (`Fp8Rows`) has a CPU side equal to candle's `to_dtype` both ways,
    /// on a strided view with a start offset, from f32, f16 and bf16, saturation included.
    #[test]
    fn fp8_rows_op_is_to_dtype() {
        let v: Vec<f32> = (0..4 * 6 * 96)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0 * [1e-3f32, 1.0, 600.0][i % 3] - 0.2)
            .collect();
        let buf = Tensor::from_vec(v, (6, 4, 96), &Device::Cpu).unwrap();
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let view = buf
                .to_dtype(dt)
                .unwrap()
                .narrow(2, 16, 64)
                .unwrap()
                .transpose(0, 1)
                .unwrap();
            let ours = view
                .apply_op1_no_bwd(&Fp8Rows {
                    encode: true,
                    out: DType::F8E4M3,
                })
                .unwrap();
            let bits = |t: &Tensor| -> Vec<u8> {
                let t = t
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<float8::F8E4M3>()
                    .unwrap();
                t.iter().map(|c| c.to_bits()).collect()
            };
            let want = view.to_dtype(DType::F8E4M3).unwrap();
            assert_eq!(bits(&ours), bits(&want), "{dt:?}");
            let back = want
                .narrow(1, 0, 5)
                .unwrap()
                .apply_op1_no_bwd(&Fp8Rows {
                    encode: false,
                    out: DType::F32,
                })
                .unwrap();
            let want_back = want.narrow(1, 0, 5).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(
                back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want_back.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
    }
}
