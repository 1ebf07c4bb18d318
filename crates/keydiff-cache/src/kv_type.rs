//! How a KV cache holds keys and values: a float dtype, or llama.cpp's Q8_0 blocks.
//!
//! Q8_0 (llama.cpp's `--cache-type-k q8_0 --cache-type-v q8_0`) stores each run of 32 values
//! of a row as one f16 scale `d = max|x| / 127` and 32 signed bytes `round(x / d)`: 34 bytes
//! for 32 values, 1.06 bytes a value against 2 for f16. The cache holds a head's row of `d`
//! values as `d / 32` such blocks, exactly GGML's `block_q8_0` layout, in a u8 buffer
//! `[kv_heads, capacity, d / 32 · 34]`, so slots move as rows of bytes like any other. The
//! codec is GGML's reference (`quantize_row_q8_0_ref`, which candle's `BlockQ8_0` follows):
//! tests compare it with candle's quantizer byte for byte. On CUDA, `keydiff_q8_0_quantize_*`
//! and `keydiff_q8_0_dequantize` of `kernels/keydiff.cu` do the same arithmetic, so their bytes
//! and values are the same (checked under the kernel emulation).
//!
//! fp8 (E4M3, `f8e4m3`) is vLLM's `--kv-cache-dtype fp8` with its default scale of 1: each
//! value is rounded to the nearest E4M3 (saturating at ±448), with no scale per row. It is a
//! float dtype here, read by conversion like f16 and bf16.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::f16;

use crate::{CacheError, Result};

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: an f16 scale and 32 signed bytes.
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// What a KV cache holds: keys and values in a float dtype (f32, f16, bf16 or f8e4m3), or
/// Q8_0 blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    Float(DType),
    Q8_0,
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
    /// Names this type takes: candle's dtype names, `q8_0` (llama.cpp's), and vLLM's `fp8`
    /// and `fp8_e4m3` for `f8e4m3`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "f32" => DType::F32.into(),
            "f16" => DType::F16.into(),
            "bf16" => DType::BF16.into(),
            "f8e4m3" | "fp8" | "fp8_e4m3" => DType::F8E4M3.into(),
            "q8_0" => KvType::Q8_0,
            _ => return None,
        })
    }

    /// The names [`KvType::parse`] takes, for messages.
    pub const NAMES: &'static str = "f32, f16, bf16, fp8 (f8e4m3), q8_0";

    /// `f32`, `f16`, `bf16`, `f8e4m3` or `q8_0`.
    pub fn as_str(&self) -> &'static str {
        match self {
            KvType::Float(dt) => dt.as_str(),
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The dtype of the cache's buffers: the float dtype, or u8 for Q8_0 blocks.
    pub fn storage_dtype(&self) -> DType {
        match self {
            KvType::Float(dt) => *dt,
            KvType::Q8_0 => DType::U8,
        }
    }

    /// Elements of the buffer per head and slot for heads of `head_dim` values.
    pub fn row_len(&self, head_dim: usize) -> usize {
        match self {
            KvType::Float(_) => head_dim,
            KvType::Q8_0 => head_dim / Q8_0_BLOCK * Q8_0_BLOCK_BYTES,
        }
    }

    /// Bytes one head's keys (or values) of one slot take.
    pub fn row_bytes(&self, head_dim: usize) -> usize {
        self.row_len(head_dim) * self.storage_dtype().size_in_bytes()
    }

    /// The head size a buffer row of `row_len` elements holds, when it is a whole row.
    pub fn head_dim_of(&self, row_len: usize) -> Option<usize> {
        match self {
            KvType::Float(_) => Some(row_len),
            KvType::Q8_0 => row_len
                .is_multiple_of(Q8_0_BLOCK_BYTES)
                .then_some(row_len / Q8_0_BLOCK_BYTES * Q8_0_BLOCK),
        }
    }

    /// The type whose buffers are in `dtype` (u8: Q8_0 blocks).
    pub fn of_storage(dtype: DType) -> Self {
        match dtype {
            DType::U8 => KvType::Q8_0,
            dt => KvType::Float(dt),
        }
    }

    /// Fails unless a cache can hold heads of `head_dim` values in this type: a float dtype
    /// of f32, f16, bf16 or f8e4m3; Q8_0 needs a multiple of 32.
    pub fn check(&self, head_dim: usize) -> std::result::Result<(), String> {
        match self {
            KvType::Float(DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3) => Ok(()),
            KvType::Float(dt) => Err(format!(
                "a KV cache in {} (expected one of {})",
                dt.as_str(),
                Self::NAMES
            )),
            KvType::Q8_0 if !head_dim.is_multiple_of(Q8_0_BLOCK) || head_dim == 0 => Err(format!(
                "a q8_0 KV cache needs heads of a multiple of {Q8_0_BLOCK} values; this \
                 model's have {head_dim}"
            )),
            KvType::Q8_0 => Ok(()),
        }
    }

    /// Puts rows `[.., head_dim]` (any float dtype) into this type's buffer form.
    pub fn encode(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            KvType::Float(dt) => Ok(x.to_dtype(*dt)?),
            KvType::Q8_0 => quantize_q8_0(x),
        }
    }

    /// Reads buffer rows back as values: a float cache's rows as they are (no copy), Q8_0
    /// blocks as f32 rows of `head_dim` values.
    pub fn decode(&self, x: &Tensor, head_dim: usize) -> Result<Tensor> {
        match self {
            KvType::Float(_) => Ok(x.clone()),
            KvType::Q8_0 => dequantize_q8_0(x, head_dim),
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

/// GGML's `quantize_row_q8_0_ref` for one block: 32 values into 34 bytes.
pub fn quantize_block_q8_0(x: &[f32], out: &mut [u8]) {
    debug_assert_eq!((x.len(), out.len()), (Q8_0_BLOCK, Q8_0_BLOCK_BYTES));
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, &v) in out[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// GGML's `dequantize_row_q8_0` for one block: 34 bytes into 32 values.
pub fn dequantize_block_q8_0(q: &[u8], out: &mut [f32]) {
    debug_assert_eq!((q.len(), out.len()), (Q8_0_BLOCK_BYTES, Q8_0_BLOCK));
    let d = f16::from_le_bytes([q[0], q[1]]).to_f32();
    for (o, &b) in out.iter_mut().zip(&q[2..]) {
        *o = b as i8 as f32 * d;
    }
}

/// Q8_0 blocks of rows: `[.., d]` (f32, f16 or bf16; d a multiple of 32) into u8
/// `[.., d / 32 · 34]`.
pub fn quantize_q8_0(x: &Tensor) -> Result<Tensor> {
    let d = x.dims().last().copied().unwrap_or(0);
    KvType::Q8_0.check(d).map_err(CacheError::Config)?;
    if x.elem_count() == 0 {
        let mut shape = x.dims().to_vec();
        *shape.last_mut().unwrap() = KvType::Q8_0.row_len(d);
        return Ok(Tensor::zeros(shape, DType::U8, x.device())?);
    }
    Ok(x.apply_op1_no_bwd(&Q8_0Quantize)?)
}

/// Rows of Q8_0 blocks, u8 `[.., head_dim / 32 · 34]` (rows contiguous; any outer strides,
/// such as a view of a cache's used slots), into f32 `[.., head_dim]`.
pub fn dequantize_q8_0(q: &Tensor, head_dim: usize) -> Result<Tensor> {
    let row = q.dims().last().copied().unwrap_or(0);
    if q.dtype() != DType::U8 || KvType::Q8_0.head_dim_of(row) != Some(head_dim) {
        return Err(CacheError::Shape(format!(
            "q8_0 rows {:?} {} for heads of {head_dim} values",
            q.dims(),
            q.dtype().as_str()
        )));
    }
    if q.elem_count() == 0 {
        // No rows (an empty cache): no launch, on any device.
        let mut shape = q.dims().to_vec();
        *shape.last_mut().unwrap() = head_dim;
        return Ok(Tensor::zeros(shape, DType::F32, q.device())?);
    }
    Ok(q.apply_op1_no_bwd(&Q8_0Dequantize { head_dim })?)
}

/// Walks the rows of `layout` (last dimension contiguous): calls `f` with each row's start
/// offset, in row-major order.
fn for_each_row(layout: &Layout, mut f: impl FnMut(usize)) -> candle_core::Result<()> {
    let dims = layout.dims();
    let st = layout.stride();
    let Some((&last, outer)) = dims.split_last() else {
        candle_core::bail!("q8_0: a scalar is not rows");
    };
    if last > 1 && st[dims.len() - 1] != 1 {
        candle_core::bail!("q8_0: rows must be contiguous, strides {st:?}");
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

struct Q8_0Quantize;

impl CustomOp1 for Q8_0Quantize {
    fn name(&self) -> &'static str {
        "q8_0-quantize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.dims();
        let d = dims[dims.len() - 1];
        let rb = d / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
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
                        .chunks_exact(Q8_0_BLOCK)
                        .zip(out[o..o + rb].chunks_exact_mut(Q8_0_BLOCK_BYTES))
                    {
                        quantize_block_q8_0(x, q);
                    }
                    o += rb;
                })?
            };
        }
        match s {
            CpuStorage::F32(xs) => run!(xs, |v: f32| v),
            CpuStorage::F16(xs) => run!(xs, |v: f16| v.to_f32()),
            CpuStorage::BF16(xs) => run!(xs, |v: half::bf16| v.to_f32()),
            _ => candle_core::bail!("q8_0-quantize: f32, f16 or bf16 rows, not {:?}", s.dtype()),
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
        match l.dims().len() {
            3 => keydiff_kernels::q8_0_quantize(s, l),
            _ => candle_core::bail!("q8_0-quantize on CUDA takes [kv, n, d], not {:?}", l.dims()),
        }
    }
}

struct Q8_0Dequantize {
    head_dim: usize,
}

impl CustomOp1 for Q8_0Dequantize {
    fn name(&self) -> &'static str {
        "q8_0-dequantize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::U8(qs) = s else {
            candle_core::bail!("q8_0-dequantize: u8 blocks, not {:?}", s.dtype());
        };
        let dims = l.dims();
        let (d, rb) = (self.head_dim, dims[dims.len() - 1]);
        let mut out = vec![0f32; l.shape().elem_count() / rb * d];
        let mut o = 0;
        for_each_row(l, |at| {
            for (q, y) in qs[at..at + rb]
                .chunks_exact(Q8_0_BLOCK_BYTES)
                .zip(out[o..o + d].chunks_exact_mut(Q8_0_BLOCK))
            {
                dequantize_block_q8_0(q, y);
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
        match l.dims().len() {
            3 => keydiff_kernels::q8_0_dequantize(s, l, self.head_dim),
            _ => candle_core::bail!(
                "q8_0-dequantize on CUDA takes [kv, n, rb], not {:?}",
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

    #[test]
    fn q8_0_blocks_are_ggml_s_byte_for_byte() -> Result<()> {
        for d in [32, 64, 128, 256] {
            let x = rows(10, d, d as u64);
            let ours = quantize_q8_0(&x)?.flatten_all()?.to_vec1::<u8>()?;
            let ggml = QTensor::quantize(&x, GgmlDType::Q8_0)?;
            assert_eq!(ours, ggml.data()?.to_vec(), "d={d}");
            let back = dequantize_q8_0(&quantize_q8_0(&x)?, d)?;
            let want = ggml.dequantize(&Device::Cpu)?;
            assert_eq!(back.to_vec2::<f32>()?, want.to_vec2::<f32>()?, "d={d}");
        }
        Ok(())
    }

    #[test]
    fn q8_0_round_trip_is_within_half_a_step_of_each_block() -> Result<()> {
        let x = rows(16, 64, 7);
        let back = dequantize_q8_0(&quantize_q8_0(&x)?, 64)?.to_vec2::<f32>()?;
        for (xr, br) in x.to_vec2::<f32>()?.iter().zip(&back) {
            for (xb, bb) in xr.chunks(32).zip(br.chunks(32)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                // Half a step of d = amax / 127, and d's own f16 rounding (2^-11 relative).
                let tol = amax / 127.0 * 0.5 + amax * 1e-3 + 1e-30;
                for (a, b) in xb.iter().zip(bb) {
                    assert!((a - b).abs() <= tol, "{a} -> {b} (amax {amax})");
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
        let q = quantize_q8_0(&view)?;
        assert_eq!(q.dims(), [2, 5, 68]);
        let whole = quantize_q8_0(&x)?;
        assert_eq!(
            q.flatten_all()?.to_vec1::<u8>()?,
            whole.narrow(1, 0, 5)?.flatten_all()?.to_vec1::<u8>()?
        );
        let back = dequantize_q8_0(&whole.narrow(1, 0, 5)?, 64)?;
        let want = dequantize_q8_0(&q, 64)?;
        assert_eq!(
            back.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?
        );
        for dt in [DType::F16, DType::BF16] {
            let h = x.to_dtype(dt)?;
            let got = quantize_q8_0(&h)?.flatten_all()?.to_vec1::<u8>()?;
            let via = quantize_q8_0(&h.to_dtype(DType::F32)?)?
                .flatten_all()?
                .to_vec1::<u8>()?;
            assert_eq!(got, via, "{dt:?}");
        }
        Ok(())
    }

    #[test]
    fn types_parse_size_and_refuse() {
        assert_eq!(KvType::parse("fp8"), Some(KvType::Float(DType::F8E4M3)));
        assert_eq!(KvType::parse("q8_0").map(|t| t.as_str()), Some("q8_0"));
        assert_eq!(KvType::parse("q4_0"), None);
        assert_eq!(KvType::Q8_0.row_bytes(128), 136);
        assert_eq!(KvType::Float(DType::F8E4M3).row_bytes(128), 128);
        assert_eq!(KvType::Q8_0.head_dim_of(136), Some(128));
        assert_eq!(KvType::Q8_0.head_dim_of(135), None);
        assert!(KvType::Q8_0
            .check(48)
            .unwrap_err()
            .contains("multiple of 32"));
        assert!(KvType::Float(DType::F64).check(64).is_err());
        let split = KvTypes {
            k: DType::F16.into(),
            v: KvType::Q8_0,
        };
        assert_eq!(split.to_string(), "f16/q8_0");
        assert_eq!(KvTypes::from(KvType::Q8_0).to_string(), "q8_0");
        assert_eq!(split.slot_bytes(64), 128 + 68);
        assert!(split.check(48).unwrap_err().starts_with("values: "));
        assert!(!KvTypes::from(KvType::Q8_0)
            .check(48)
            .unwrap_err()
            .contains(": a"));
        let empty = Tensor::zeros((2, 0, 64), DType::F32, &Device::Cpu).unwrap();
        let q = quantize_q8_0(&empty).unwrap();
        assert_eq!(q.dims(), [2, 0, 68]);
        assert_eq!(dequantize_q8_0(&q, 64).unwrap().dims(), [2, 0, 64]);
        assert!(quantize_q8_0(&Tensor::zeros((2, 48), DType::F32, &Device::Cpu).unwrap()).is_err());
    }
}
