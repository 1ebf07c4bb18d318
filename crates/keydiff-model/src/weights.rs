//! Where tensors come from: GGUF (quantized or not), HF safetensors, or seeded random values.
//!
//! The model asks for tensors by role ([`Key`]); each source maps roles to its own names.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gguf_check;

/// The role of a tensor in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Embed,
    LmHead,
    FinalNorm,
    AttnNorm,
    MlpNorm,
    Q,
    K,
    V,
    O,
    /// Qwen 3's per-head RMSNorm of the queries, `[head_dim]`.
    QNorm,
    /// Qwen 3's per-head RMSNorm of the keys, `[head_dim]`.
    KNorm,
    Gate,
    Up,
    Down,
    /// A mixture's router, `[experts, hidden]`.
    Router,
    /// A mixture's experts' gate, up and down projections: one `[experts, out, in]` tensor
    /// in GGUF, one `[out, in]` tensor per expert in HF checkpoints.
    GateExps,
    UpExps,
    DownExps,
}

impl Key {
    fn gguf(self) -> &'static str {
        match self {
            Key::Embed => "token_embd",
            Key::LmHead => "output",
            Key::FinalNorm => "output_norm",
            Key::AttnNorm => "attn_norm",
            Key::MlpNorm => "ffn_norm",
            Key::Q => "attn_q",
            Key::K => "attn_k",
            Key::V => "attn_v",
            Key::O => "attn_output",
            Key::QNorm => "attn_q_norm",
            Key::KNorm => "attn_k_norm",
            Key::Gate => "ffn_gate",
            Key::Up => "ffn_up",
            Key::Down => "ffn_down",
            Key::Router => "ffn_gate_inp",
            Key::GateExps => "ffn_gate_exps",
            Key::UpExps => "ffn_up_exps",
            Key::DownExps => "ffn_down_exps",
        }
    }

    fn hf(self) -> &'static str {
        match self {
            Key::Embed => "model.embed_tokens",
            Key::LmHead => "lm_head",
            Key::FinalNorm => "model.norm",
            Key::AttnNorm => "input_layernorm",
            Key::MlpNorm => "post_attention_layernorm",
            Key::Q => "self_attn.q_proj",
            Key::K => "self_attn.k_proj",
            Key::V => "self_attn.v_proj",
            Key::O => "self_attn.o_proj",
            Key::QNorm => "self_attn.q_norm",
            Key::KNorm => "self_attn.k_norm",
            Key::Gate => "mlp.gate_proj",
            Key::Up => "mlp.up_proj",
            Key::Down => "mlp.down_proj",
            Key::Router => "mlp.gate",
            // Within `mlp.experts.{e}` (see `Key::expert_name`).
            Key::GateExps => "gate_proj",
            Key::UpExps => "up_proj",
            Key::DownExps => "down_proj",
        }
    }

    /// Full tensor name (without `.weight`/`.bias`) in a format.
    fn name(self, gguf: bool, layer: Option<usize>) -> String {
        match (gguf, layer) {
            (true, Some(l)) => format!("blk.{l}.{}", self.gguf()),
            (true, None) => self.gguf().to_string(),
            (false, Some(l)) => format!("model.layers.{l}.{}", self.hf()),
            (false, None) => self.hf().to_string(),
        }
    }

    /// Name (without `.weight`) of an expert projection of layer `l`: GGUF stacks the
    /// experts in one tensor, HF names each (`model.layers.{l}.mlp.experts.{e}.gate_proj`).
    fn expert_name(self, gguf: bool, l: usize, e: usize) -> String {
        if gguf {
            self.name(true, Some(l))
        } else {
            format!("model.layers.{l}.mlp.experts.{e}.{}", self.hf())
        }
    }
}

/// A linear layer `y = x Wᵀ + b` whose weight is dense or GGML-quantized.
///
/// A quantized weight may also keep a dense copy for prefill chunks: a dense GEMM over B rows
/// is several times faster on the CPU than per-row quantized dot products, and it keeps
/// activations unquantized, so results do not depend on the chunk size. Decode (one row) uses
/// the quantized weight, which streams 4–8× fewer bytes.
#[derive(Debug, Clone)]
pub struct Linear {
    w: QMatMul,
    dense: Option<Tensor>,
    b: Option<Tensor>,
    /// Storage type in the checkpoint (`Q4_1`, `BF16`, ...).
    stored: String,
    /// Whether the decode weight computes each of several rows as it computes that row alone,
    /// by row count and dtype (found once each, when first asked: [`Pass::DecodeRows`]).
    /// Shared by clones, which hold the same weight.
    rows_alone: Arc<Mutex<std::collections::HashMap<(usize, DType), bool>>>,
}

/// Which weights a linear runs on, over which rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// A prompt chunk: the dense prefill copy, where there is one.
    Prefill,
    /// Decode rows, all at once with the decode weight.
    Decode,
    /// Decode rows that must each get exactly what a pass over that row alone gives (a
    /// speculative draft verified bit for bit): all at once where the decode weight's kernel
    /// computes each row as it computes a row alone, else row by row. candle picks other
    /// kernels for several rows for some types and devices (x86 Q6K, CUDA's quantized and
    /// dense matmuls); each weight is checked once per row count.
    DecodeRows,
}

impl From<bool> for Pass {
    /// `true`: [`Pass::Prefill`]; `false`: [`Pass::Decode`].
    fn from(prefill: bool) -> Self {
        if prefill {
            Pass::Prefill
        } else {
            Pass::Decode
        }
    }
}

/// `QMatMul::from_qtensor`, with unquantized GGUF weights (F32/F16/BF16, which candle keeps as
/// an f32 `QMatMul::Tensor`) cast once to the model's dtype: candle's plain matmul wants both
/// sides in one dtype, and bf16/f16 activations would otherwise meet an f32 weight.
/// (`QMatMul::TensorF16`, quantized weights under `CANDLE_DEQUANTIZE_ALL_F16`, casts its input
/// itself and is left as it is.)
fn gguf_matmul(q: QTensor, dtype: DType) -> Result<QMatMul> {
    Ok(match QMatMul::from_qtensor(q)? {
        QMatMul::Tensor(t) if t.dtype() != dtype => QMatMul::Tensor(t.to_dtype(dtype)?),
        m => m,
    })
}

impl Linear {
    /// `x`: `[.., in]` → `[.., out]`, in `x`'s dtype. `prefill` selects the dense copy when
    /// there is one.
    pub fn forward(&self, x: &Tensor, pass: impl Into<Pass>) -> Result<Tensor> {
        let pass = pass.into();
        let y = match (&self.dense, pass) {
            (Some(w), Pass::Prefill) => x.matmul(&w.t()?)?,
            (_, Pass::DecodeRows) if x.dim(0)? > 1 && !self.rows_alone(x)? => {
                let rows = (0..x.dim(0)?)
                    .map(|i| self.quantized_forward(&x.narrow(0, i, 1)?))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)?
            }
            _ => self.quantized_forward(x)?,
        };
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// True when the decode weight computes each of `x`'s rows (in its dtype, on its
    /// device) as it computes that row alone: checked once per row count, on as many
    /// reproducible rows, bit for bit (candle picks kernels by the row count: CUDA's
    /// matrix-vector kernels change their layout at 5 and 9 rows, aarch64 tiles 4 rows).
    fn rows_alone(&self, x: &Tensor) -> Result<bool> {
        let (m, k) = x.dims2()?;
        let known = |map: &std::collections::HashMap<(usize, DType), bool>| {
            map.get(&(m, x.dtype())).copied()
        };
        if let Some(alone) = known(&self.rows_alone.lock().expect("not poisoned")) {
            return Ok(alone);
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let values: Vec<f32> = (0..m * k)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        let probe = Tensor::from_vec(values, (m, k), x.device())?.to_dtype(x.dtype())?;
        let bits = |t: Tensor| -> Result<Vec<u32>> {
            let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.into_iter().map(f32::to_bits).collect())
        };
        let all = bits(self.quantized_forward(&probe)?)?;
        let mut one_by_one = Vec::with_capacity(all.len());
        for i in 0..m {
            one_by_one.extend(bits(self.quantized_forward(&probe.narrow(0, i, 1)?)?)?);
        }
        let same = all == one_by_one;
        (self.rows_alone.lock().expect("not poisoned")).insert((m, x.dtype()), same);
        Ok(same)
    }

    fn quantized_forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.w {
            // candle's CUDA quantized matmul takes bf16/f16 rows itself (its matrix-vector
            // kernels quantize them to Q8_1 as they do f32 rows of the same values, and write
            // the output in their dtype; its matrix-matrix kernels cast in and out) for the
            // block types of llama.cpp's weight files, on contiguous rows. Anything else goes
            // through f32, which its fallbacks need: two more launches and allocations per
            // linear, which a decode step, launch-bound, pays hundreds of times.
            QMatMul::QTensor(q)
                if !x.device().is_cpu()
                    && x.dtype() != DType::F32
                    && !(half_rows_direct() && q_takes_half_rows(q.dtype(), x)) =>
            {
                self.w
                    .forward(&x.to_dtype(DType::F32)?)?
                    .to_dtype(x.dtype())?
            }
            _ => self.w.forward(x)?,
        })
    }

    /// Bytes held: the weight, its dense copy and the bias.
    pub fn bytes(&self) -> u64 {
        let w = match &self.w {
            QMatMul::QTensor(q) => q.storage_size_in_bytes() as u64,
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => tensor_bytes(t),
        };
        w + self.dense.as_ref().map_or(0, tensor_bytes) + self.b.as_ref().map_or(0, tensor_bytes)
    }

    /// The type of the weight in the checkpoint (GGML type name, or the dense dtype).
    pub fn kind(&self) -> String {
        self.stored.clone()
    }

    /// What actually runs: the decode weight's type, and the prefill copy's dtype if any.
    pub fn runtime_kind(&self) -> String {
        let decode = match &self.w {
            QMatMul::QTensor(q) => format!("{:?}", q.dtype()),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => format!("{:?}", t.dtype()),
        };
        match &self.dense {
            Some(d) => format!("decode {decode}, prefill {:?}", d.dtype()),
            None => decode,
        }
    }
}

/// Dense linears that read the same input (a layer's q/k/v projections, its MLP's gate and up),
/// fused into one matmul for decode rows: a decode step on a GPU is bound by launches (the first
/// H200 run: 8.6 ms a token for a 3B model whose weights take 1.5 ms to read), and one matmul
/// (and one bias add) launches once where the parts launch each. Their weights and biases are
/// concatenated once, and each part's weight and bias become views of their rows, so nothing
/// is held twice: the parts still run prefill chunks (and say what is stored), the fused
/// linear runs [`Pass::Decode`] and [`Pass::DecodeRows`] (its own weight's row check, so a
/// verified draft gets what its rows get alone, as before).
#[derive(Debug, Clone)]
pub struct FusedLinear {
    linear: Linear,
    /// Output width of each part, in order.
    outs: Vec<usize>,
}

impl FusedLinear {
    /// Fuses `parts`: dense weights (no quantized ones, no prefill copies) of one dtype,
    /// device and input width, all with a bias or none. `None`, changing nothing, when they
    /// are not.
    pub fn fuse(parts: &mut [&mut Linear]) -> Result<Option<FusedLinear>> {
        let mut ws = Vec::with_capacity(parts.len());
        for p in parts.iter() {
            match (&p.w, &p.dense) {
                (QMatMul::Tensor(w), None) if w.rank() == 2 => ws.push(w.clone()),
                _ => return Ok(None),
            }
        }
        let Some(first) = ws.first() else {
            return Ok(None);
        };
        let same = ws.iter().all(|w| {
            w.dtype() == first.dtype()
                && w.device().same_device(first.device())
                && w.dim(1).ok() == first.dim(1).ok()
        });
        let with_bias = parts.iter().filter(|p| p.b.is_some()).count();
        if !same || (with_bias != 0 && with_bias != parts.len()) {
            return Ok(None);
        }
        let outs = ws
            .iter()
            .map(|w| w.dim(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let w = Tensor::cat(&ws, 0)?;
        drop(ws);
        let b = match with_bias {
            0 => None,
            _ => {
                let bs: Vec<Tensor> = parts.iter().filter_map(|p| p.b.clone()).collect();
                Some(Tensor::cat(&bs, 0)?)
            }
        };
        let mut at = 0;
        for (p, &n) in parts.iter_mut().zip(&outs) {
            p.w = QMatMul::Tensor(w.narrow(0, at, n)?);
            if let Some(b) = &b {
                p.b = Some(b.narrow(0, at, n)?);
            }
            at += n;
        }
        Ok(Some(FusedLinear {
            linear: Linear {
                w: QMatMul::Tensor(w),
                dense: None,
                b,
                stored: parts[0].stored.clone(),
                rows_alone: Default::default(),
            },
            outs,
        }))
    }

    /// `x`: `[.., in]` → `[.., Σ out]`, the parts' outputs side by side.
    pub fn forward(&self, x: &Tensor, pass: impl Into<Pass>) -> Result<Tensor> {
        self.linear.forward(x, pass)
    }

    /// The parts' output widths, in order.
    pub fn outs(&self) -> &[usize] {
        &self.outs
    }
}

/// Whether a model on `device` fuses its linears for decode ([`FusedLinear`]): on a GPU, unless
/// `KEYDIFF_CUDA_FUSE=0` (to time or check the parts against it). On the CPU a decode step is
/// not bound by launches, and its quantized weights do not fuse.
pub fn fuses_linears(device: &Device) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !device.is_cpu()
        && *ON.get_or_init(|| std::env::var("KEYDIFF_CUDA_FUSE").map_or(true, |v| v != "0"))
}

/// Whether candle's CUDA quantized matmul takes `x` (bf16/f16 rows) itself for a weight of
/// type `t`: the types its MMVQ and MMQ kernels run (candle 0.11.1's `fast_mmvq` and
/// `fast_mmq` gates: llama.cpp's weight types, [`WEIGHT_TYPES`]), rows `[m, k]` or `[b, m, k]`,
/// at least one, laid out contiguously (its f32-only fallbacks would otherwise get them).
fn q_takes_half_rows(t: GgmlDType, x: &Tensor) -> bool {
    matches!(x.dtype(), DType::BF16 | DType::F16)
        && matches!(x.rank(), 2 | 3)
        && x.elem_count() > 0
        && x.is_contiguous()
        && is_weight_type(t)
}

/// Whether `t` is one of [`WEIGHT_TYPES`].
fn is_weight_type(t: GgmlDType) -> bool {
    WEIGHT_TYPES.iter().any(|(_, w)| *w == t)
}

/// False when `KEYDIFF_CUDA_QMATMUL_F32` is set (to anything but `0`): every quantized matmul
/// on a GPU then takes f32 rows, cast in and out, as before candle ran half-precision rows
/// itself (for comparing the two on a GPU host; `scripts/gpu-check.sh` does). Read once.
fn half_rows_direct() -> bool {
    static DIRECT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DIRECT.get_or_init(|| std::env::var("KEYDIFF_CUDA_QMATMUL_F32").map_or(true, |v| v == "0"))
}

/// Token embedding table, dense or quantized (rows are dequantized on lookup).
#[derive(Debug, Clone)]
pub enum Embedding {
    Dense(Tensor),
    Quantized(Arc<QTensor>),
}

/// Bytes of a tensor's elements.
pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

impl Embedding {
    /// Bytes held by the table.
    pub fn bytes(&self) -> u64 {
        match self {
            Embedding::Dense(t) => tensor_bytes(t),
            Embedding::Quantized(q) => q.storage_size_in_bytes() as u64,
        }
    }

    /// `ids`: `[len]` u32 → `[len, hidden]` in `dtype`.
    pub fn forward(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(match self {
            Embedding::Dense(w) => w.index_select(ids, 0)?.to_dtype(dtype)?,
            Embedding::Quantized(q) => q.embedding(ids)?.to_dtype(dtype)?,
        })
    }
}

/// How quantized GGUF linears are kept on the CPU. Both options trade memory for speed; neither
/// applies on GPUs (candle's CUDA kernels handle every type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuWeights {
    /// Keep a dense copy for prefill chunks (see [`Linear`]).
    pub dense_prefill: bool,
    /// Re-quantize types without a SIMD dot product in candle (Q4_1, Q5_0, Q5_1: measured 4–6×
    /// slower per row than Q8_0) to Q8_0 for decode. Q8_0 keeps them to within 1/254 of each
    /// 32-block's range.
    pub requantize_slow: bool,
}

impl CpuWeights {
    /// Both options on: the fastest CPU setting.
    pub const FAST: Self = Self {
        dense_prefill: true,
        requantize_slow: true,
    };
    /// Weights exactly as stored: the numerics of llama.cpp.
    pub const AS_STORED: Self = Self {
        dense_prefill: false,
        requantize_slow: false,
    };

    /// What these options keep, in words.
    pub fn describe(self) -> &'static str {
        match (self.dense_prefill, self.requantize_slow) {
            (true, true) => "weights with dense prefill copies and Q8_0 decode copies",
            (true, false) => "weights with dense prefill copies",
            (false, true) => "weights with Q8_0 decode copies only",
            (false, false) => "weights as stored",
        }
    }

    fn prepare(
        self,
        q: QTensor,
        device: &Device,
        dtype: DType,
    ) -> Result<(QTensor, Option<Tensor>)> {
        let requantize = self.requantize_slow
            && matches!(
                q.dtype(),
                GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1
            );
        if !device.is_cpu() || q.dtype().block_size() == 1 || !(requantize || self.dense_prefill) {
            return Ok((q, None));
        }
        let dense = q.dequantize(device)?;
        let q = if requantize {
            QTensor::quantize(&dense, GgmlDType::Q8_0)?
        } else {
            q
        };
        let dense = if self.dense_prefill {
            Some(dense.to_dtype(dtype)?)
        } else {
            None
        };
        Ok((q, dense))
    }
}

/// What a tensor becomes when the model loads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A linear weight (a quantized one may get CPU copies, see [`CpuWeights`]).
    Linear,
    /// The weights of this many experts, stacked (GGUF) or one (HF): linears that may be
    /// re-quantized but get no dense prefill copies (see [`Weights::experts`]).
    Experts(u64),
    /// The embedding table (kept quantized when stored quantized).
    Embedding,
    /// Anything else (norms, biases): dense, in the model's dtype.
    Plain,
}

/// Memory the weights take once loaded, on the device they load to (host memory on the CPU),
/// planned before anything is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightPlan {
    /// Bytes held by the loaded model: what [`crate::Model::weight_bytes`] then reports. On
    /// CUDA, candle pads each quantized tensor's buffer by 512 columns' worth of blocks (288
    /// bytes for Q4_0), which neither counts.
    pub resident: u64,
    /// The most one tensor needs in passing while it loads (its file bytes and a dequantized
    /// f32 copy).
    pub transient: u64,
}

impl WeightPlan {
    /// Peak bytes while loading.
    pub fn peak(&self) -> u64 {
        self.resident + self.transient
    }
}

/// A source of named tensors on a device.
pub enum Weights {
    /// A GGUF file; tensors are read lazily from the open file.
    Gguf {
        path: PathBuf,
        content: gguf_file::Content,
        file: Mutex<File>,
        device: Device,
        dtype: DType,
        /// CPU speed options for quantized linears.
        opts: CpuWeights,
        /// Names of the tensors read so far (see [`Weights::unused_tensors`]).
        used: Mutex<HashSet<String>>,
    },
    /// HF safetensors (memory-mapped).
    Safetensors {
        vb: VarBuilder<'static>,
        /// Every tensor of the checkpoint, by name, with its shape.
        shapes: HashMap<String, Vec<usize>>,
        /// Names of the tensors read so far (see [`Weights::unused_tensors`]).
        used: Mutex<HashSet<String>>,
    },
    /// Seeded random values in real shapes, for timing without a checkpoint. With `on_host`,
    /// values are drawn on the CPU and copied, so that every device gets the same weights
    /// (slower; for parity checks).
    Random {
        device: Device,
        dtype: DType,
        on_host: bool,
        /// Host generator (candle's CPU backend cannot be seeded).
        rng: Mutex<StdRng>,
        /// The GGML type linears and the embedding are quantized to (see
        /// [`Weights::random_quantized`]); `None`: dense in `dtype`.
        quantized: Option<GgmlDType>,
        /// CPU copies of quantized linears, as for a GGUF file.
        opts: CpuWeights,
    },
}

/// The GGML types a random model's weights can be quantized to (`--weight-type`), by the
/// names llama.cpp's `quantize` gives them: the block types of its weight files that candle's
/// CPU and CUDA matmuls run.
pub const WEIGHT_TYPES: [(&str, GgmlDType); 10] = [
    ("q4_0", GgmlDType::Q4_0),
    ("q4_1", GgmlDType::Q4_1),
    ("q5_0", GgmlDType::Q5_0),
    ("q5_1", GgmlDType::Q5_1),
    ("q8_0", GgmlDType::Q8_0),
    ("q2_k", GgmlDType::Q2K),
    ("q3_k", GgmlDType::Q3K),
    ("q4_k", GgmlDType::Q4K),
    ("q5_k", GgmlDType::Q5K),
    ("q6_k", GgmlDType::Q6K),
];

/// A weight type of [`WEIGHT_TYPES`] by name (any case: `Q4_K` too), or an error that lists
/// them.
pub fn parse_weight_type(name: &str) -> Result<GgmlDType> {
    let lower = name.to_ascii_lowercase();
    WEIGHT_TYPES
        .iter()
        .find(|(n, _)| *n == lower)
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            let names: Vec<&str> = WEIGHT_TYPES.iter().map(|(n, _)| *n).collect();
            ModelError::Unsupported(format!(
                "weight type `{name}` (expected one of {})",
                names.join(", ")
            ))
        })
}

/// The name [`WEIGHT_TYPES`] gives `t` (its debug name for other types).
pub fn weight_type_name(t: GgmlDType) -> String {
    WEIGHT_TYPES
        .iter()
        .find(|(_, x)| *x == t)
        .map_or_else(|| format!("{t:?}"), |(n, _)| n.to_string())
}

impl Weights {
    /// Opens a GGUF file and reads its metadata (tensors are read on demand).
    pub fn open_gguf(path: &Path, device: &Device, dtype: DType, opts: CpuWeights) -> Result<Self> {
        let mut file = open_file(path)?;
        let bad = |reason: String| ModelError::BadGguf {
            path: path.to_path_buf(),
            reason,
        };
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            error: source,
        };
        let scan = gguf_check::scan(&mut file).map_err(io)?;
        if scan.alignment == Some(0) {
            return Err(bad(
                "`general.alignment` is 0; it must be a power of two".into()
            ));
        }
        if let Some((tensor, ty)) = &scan.unreadable {
            let kind = match gguf_check::ggml_type_name(*ty) {
                Some(name) => format!("{name} (GGML type {ty})"),
                None => format!("of GGML type {ty}, which this keydiff does not know"),
            };
            return Err(bad(format!(
                "tensor `{tensor}` is {kind}, which keydiff cannot run (candle's types: F32, \
                 F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K to Q8_K): use a file in one \
                 of those"
            )));
        }
        let content = gguf_file::Content::read(&mut file).map_err(|e| {
            let reason = keydiff_cache::without_backtrace(e).to_string();
            // std's message for a read past the end.
            let reason = match reason.contains("failed to fill whole buffer") {
                true => format!(
                    "the file ends inside its header ({} bytes): truncated, or not a GGUF file",
                    file.metadata().map_or(0, |m| m.len())
                ),
                false => reason,
            };
            ModelError::BadGguf {
                path: path.to_path_buf(),
                reason,
            }
        })?;
        // llama.cpp's `gguf-split` parts: keydiff reads one file (the first part alone would
        // be refused for the tensors the others hold).
        let parts = content
            .metadata
            .get("split.count")
            .and_then(|v| v.to_u64().ok());
        if let Some(n) = parts.filter(|&n| n > 1) {
            return Err(bad(format!(
                "it is a part of a GGUF split in {n} files (`split.count`), and keydiff reads a \
                 model from one file: merge the parts with llama.cpp's `llama-gguf-split \
                 --merge`"
            )));
        }
        // A truncated or inconsistent file is caught here rather than half-way through loading.
        let len = file
            .metadata()
            .map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                error: source,
            })?
            .len();
        if let Some(key) = scan.duplicate_key {
            // llama.cpp refuses such a file; candle would keep the last value silently.
            return Err(bad(format!("metadata key `{key}` appears twice")));
        }
        gguf_check::tensor_layout(&content, len, scan.tensors.as_deref()).map_err(bad)?;
        Ok(Weights::Gguf {
            path: path.to_path_buf(),
            content,
            file: Mutex::new(file),
            device: device.clone(),
            dtype,
            opts,
            used: Mutex::new(HashSet::new()),
        })
    }

    /// Memory-maps safetensors files.
    ///
    /// Every tensor must be a float (f32, f16, bf16, f64: converted to `dtype`) and in one
    /// file only: an FP8 or integer checkpoint is refused by name rather than cast (its scales
    /// would be lost), and a tensor in two shards is refused rather than one taken.
    pub fn open_safetensors(paths: &[PathBuf], device: &Device, dtype: DType) -> Result<Self> {
        let mut at: HashMap<String, &PathBuf> = Default::default();
        let mut shapes = HashMap::new();
        for p in paths {
            for (name, stored, shape) in check_safetensors_header(p)? {
                let float = matches!(
                    stored,
                    safetensors::Dtype::F32
                        | safetensors::Dtype::F16
                        | safetensors::Dtype::BF16
                        | safetensors::Dtype::F64
                );
                if !float {
                    return Err(ModelError::BadSafetensors {
                        path: p.clone(),
                        reason: format!(
                            "tensor `{name}` is stored as {stored:?}: keydiff loads float \
                             checkpoints (f32, f16, bf16); an FP8 or integer-quantized release \
                             needs its float original or a GGUF file"
                        ),
                    });
                }
                shapes.insert(name.clone(), shape);
                if let Some(first) = at.insert(name.clone(), p) {
                    return Err(ModelError::BadSafetensors {
                        path: p.clone(),
                        reason: format!(
                            "tensor `{name}` is also in {}: a tensor must be in one shard",
                            first.display()
                        ),
                    });
                }
            }
        }
        // SAFETY: the files are not modified while mapped (they are model checkpoints).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(paths, dtype, device)? };
        Ok(Weights::Safetensors {
            vb,
            shapes,
            used: Mutex::new(HashSet::new()),
        })
    }

    /// Seeded random weights: drawn on `device` (after seeding it), or on the host when
    /// `on_host` or when the device is the CPU.
    pub fn random(device: &Device, dtype: DType, seed: u64, on_host: bool) -> Result<Self> {
        if !on_host && !device.is_cpu() {
            device.set_seed(seed)?;
        }
        Ok(Weights::Random {
            device: device.clone(),
            dtype,
            on_host,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            quantized: None,
            opts: CpuWeights::AS_STORED,
        })
    }

    /// Seeded random weights whose linears (experts and the LM head included) and embedding
    /// table are quantized to `t`, as a GGUF file of that type stores them: each is drawn as
    /// [`Weights::random`] draws it (with `on_host`, or on the CPU: the same values; else on
    /// the device, a run of rows at a time, and copied to the host), quantized by candle's CPU
    /// quantizer, then loaded as a GGUF tensor is (candle's quantized matmul on every device;
    /// on the CPU with `opts`' copies). Norms and biases stay dense. Every quantized tensor's
    /// rows must be whole blocks of `t` (32 values, 256 for the K types): a shape that is not
    /// is refused by name when the model loads.
    pub fn random_quantized(
        device: &Device,
        dtype: DType,
        seed: u64,
        on_host: bool,
        t: GgmlDType,
        opts: CpuWeights,
    ) -> Result<Self> {
        if !is_weight_type(t) {
            return Err(ModelError::Unsupported(format!(
                "random weights of type {t:?} (a weight type of llama.cpp's files is needed)"
            )));
        }
        let mut w = Weights::random(device, dtype, seed, on_host)?;
        if let Weights::Random {
            quantized, opts: o, ..
        } = &mut w
        {
            (*quantized, *o) = (Some(t), opts);
        }
        Ok(w)
    }

    /// The type a random source quantizes linears and embeddings to, if any.
    pub fn random_weight_type(&self) -> Option<GgmlDType> {
        match self {
            Weights::Random { quantized, .. } => *quantized,
            _ => None,
        }
    }

    /// A random source's tensor `name` of `shape` (2-D or more, rows last) drawn on the host
    /// and quantized to `t`, on the source's device, as [`Weights::qtensor`] reads a GGUF
    /// tensor.
    fn random_qtensor(&self, name: &str, shape: &[usize], t: GgmlDType) -> Result<QTensor> {
        let Weights::Random {
            device,
            rng,
            on_host,
            ..
        } = self
        else {
            unreachable!("random_qtensor on a non-random source")
        };
        let row = shape.last().copied().unwrap_or(0);
        if !row.is_multiple_of(t.block_size()) {
            let hint = if t.block_size() > 32 && row.is_multiple_of(32) {
                "pick a type of 32-value blocks, q4_0 to q8_0, or a preset whose widths are \
                 multiples of 256"
            } else {
                "pick a preset whose widths are multiples of the block"
            };
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}` {shape:?} in {}: its rows of {row} values are not whole \
                 blocks of {} ({hint})",
                weight_type_name(t),
                t.block_size()
            )));
        }
        // The values a run of rows at a time, each its own tensor on the host (candle 0.11.1's
        // `QTensor::quantize` reads a view's storage from the start, whatever its offset):
        // from the host generator in the dense draw's order, or drawn on the device (fast, for
        // timing) and copied. Then each run is quantized on its own thread: candle's quantizer
        // runs on one, and a row's blocks depend on that row alone.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let runs = {
            let mut rng = rng.lock().expect("rng lock poisoned");
            row_runs(shape[0], threads)
                .into_iter()
                .map(|rows| {
                    let mut run = shape.to_vec();
                    run[0] = rows;
                    if *on_host || device.is_cpu() {
                        Init::Normal.host(&run, &mut rng)
                    } else {
                        Ok(Init::Normal
                            .make(&run, DType::F32, device)?
                            .to_device(&Device::Cpu)?)
                    }
                })
                .collect::<Result<Vec<_>>>()?
        };
        let bytes = quantize_runs(&runs, t)?;
        drop(runs);
        let storage =
            candle_core::quantized::QStorage::from_data(std::borrow::Cow::Owned(bytes), device, t)?;
        Ok(QTensor::new(storage, shape)?)
    }

    /// The GGUF content, if this is a GGUF source.
    pub fn gguf_content(&self) -> Option<&gguf_file::Content> {
        match self {
            Weights::Gguf { content, .. } => Some(content),
            _ => None,
        }
    }

    fn is_gguf(&self) -> bool {
        matches!(self, Weights::Gguf { .. })
    }

    /// True when the LM head is the embedding table (tied, or no separate output tensor).
    pub fn lm_head_tied(&self, cfg: &ModelConfig) -> bool {
        cfg.tie_word_embeddings || !self.has(Key::LmHead, None)
    }

    /// CPU options of a GGUF source or a quantized random one (set before the model loads;
    /// see [`Weights::plan`]).
    pub fn set_cpu_weights(&mut self, cpu: CpuWeights) {
        if let Weights::Gguf { opts, .. } | Weights::Random { opts, .. } = self {
            *opts = cpu;
        }
    }

    /// Every tensor [`crate::Model::load`] reads, with its role and element count. A tied LM
    /// head is listed twice (embedding and linear): they are two allocations.
    fn model_tensors(&self, cfg: &ModelConfig) -> Vec<(String, Role, u64)> {
        let g = self.is_gguf();
        let (hid, inter) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
        let (q, kv) = (
            (cfg.num_heads * cfg.head_dim) as u64,
            (cfg.num_kv_heads * cfg.head_dim) as u64,
        );
        let vocab = cfg.vocab_size as u64;
        let mut v = Vec::new();
        let add = |v: &mut Vec<_>, key: Key, layer, role, n: u64, bias: Option<u64>| {
            let base = key.name(g, layer);
            v.push((format!("{base}.weight"), role, n));
            if let Some(b) = bias {
                v.push((format!("{base}.bias"), Role::Plain, b));
            }
        };
        for layer in 0..cfg.num_layers {
            let l = Some(layer);
            let bias = |n| cfg.attention_bias.then_some(n);
            add(&mut v, Key::AttnNorm, l, Role::Plain, hid, None);
            add(&mut v, Key::Q, l, Role::Linear, q * hid, bias(q));
            add(&mut v, Key::K, l, Role::Linear, kv * hid, bias(kv));
            add(&mut v, Key::V, l, Role::Linear, kv * hid, bias(kv));
            add(&mut v, Key::O, l, Role::Linear, hid * q, None);
            if cfg.qk_norm {
                let d = cfg.head_dim as u64;
                add(&mut v, Key::QNorm, l, Role::Plain, d, None);
                add(&mut v, Key::KNorm, l, Role::Plain, d, None);
            }
            add(&mut v, Key::MlpNorm, l, Role::Plain, hid, None);
            match &cfg.moe {
                None => {
                    add(&mut v, Key::Gate, l, Role::Linear, inter * hid, None);
                    add(&mut v, Key::Up, l, Role::Linear, inter * hid, None);
                    add(&mut v, Key::Down, l, Role::Linear, hid * inter, None);
                }
                Some(m) => {
                    let (e, ff) = (m.num_experts as u64, m.expert_intermediate_size as u64);
                    add(&mut v, Key::Router, l, Role::Linear, e * hid, None);
                    for key in [Key::GateExps, Key::UpExps, Key::DownExps] {
                        if g {
                            v.push((
                                format!("{}.weight", key.expert_name(true, layer, 0)),
                                Role::Experts(e),
                                e * ff * hid,
                            ));
                        } else {
                            for x in 0..m.num_experts {
                                v.push((
                                    format!("{}.weight", key.expert_name(false, layer, x)),
                                    Role::Experts(1),
                                    ff * hid,
                                ));
                            }
                        }
                    }
                }
            }
        }
        add(&mut v, Key::Embed, None, Role::Embedding, vocab * hid, None);
        add(&mut v, Key::FinalNorm, None, Role::Plain, hid, None);
        let head = if self.lm_head_tied(cfg) {
            Key::Embed
        } else {
            Key::LmHead
        };
        add(&mut v, head, None, Role::Linear, vocab * hid, None);
        v
    }

    /// The memory the model's weights will take on their device under `cpu` (for GGUF
    /// sources and quantized random ones on the CPU; the others ignore it), computed from the shapes and stored types
    /// alone. On a GPU the weights are kept as stored (quantized ones stay quantized, candle's
    /// CUDA kernels run every type), in device memory. Tensors the source lacks are left out
    /// (loading then fails on them by name).
    pub fn plan(&self, cfg: &ModelConfig, cpu: CpuWeights) -> WeightPlan {
        let (device, dtype) = self.device_dtype();
        let mut plan = WeightPlan {
            resident: 0,
            transient: 0,
        };
        // The copies are made on the CPU only (`CpuWeights::prepare`).
        let cpu = if device.is_cpu() {
            cpu
        } else {
            CpuWeights::AS_STORED
        };
        let dsize = dtype.size_in_bytes() as u64;
        let bytes_of = |t: GgmlDType, n: u64| n / t.block_size() as u64 * t.type_size() as u64;
        for (name, role, n) in self.model_tensors(cfg) {
            let stored_type = match self {
                Weights::Gguf { content, .. } => match content.tensor_infos.get(&name) {
                    Some(info) => Some(info.ggml_dtype),
                    None => continue,
                },
                Weights::Random {
                    quantized: Some(t), ..
                } if role != Role::Plain => Some(*t),
                _ => None,
            };
            let (resident, transient) = match stored_type {
                Some(t) => {
                    let stored = bytes_of(t, n);
                    // Read from the file, dequantized to f32, cast: what passes through.
                    let passing = stored + 4 * n;
                    let (resident, transient) = match (role, t.block_size() > 1) {
                        (Role::Embedding, true) => (stored, stored),
                        // Read whole on the host, then copied expert by expert (each
                        // dequantized in passing when re-quantized).
                        (Role::Experts(e), true) => match t {
                            GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1
                                if cpu.requantize_slow =>
                            {
                                (bytes_of(GgmlDType::Q8_0, n), stored + 4 * n / e.max(1))
                            }
                            _ => (stored, stored),
                        },
                        // Read whole on the host, each expert then widened to f32 and cast.
                        (Role::Experts(e), false) => (n * dsize, stored + 4 * n / e.max(1)),
                        (Role::Linear, true) => {
                            let decode = match t {
                                GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1
                                    if cpu.requantize_slow =>
                                {
                                    bytes_of(GgmlDType::Q8_0, n)
                                }
                                _ => stored,
                            };
                            let dense = if cpu.dense_prefill { n * dsize } else { 0 };
                            let copies = cpu.dense_prefill || decode != stored;
                            (decode + dense, if copies { passing } else { stored })
                        }
                        _ => (n * dsize, passing),
                    };
                    // A quantized random tensor passes through more: drawn in f32 (in runs
                    // of rows), each run's blocks, their concatenation, and on the CPU the
                    // storage's own copy of them (then what the options make of it, as a
                    // GGUF tensor's, which is less).
                    if matches!(self, Weights::Random { .. }) {
                        (resident, transient.max(4 * n + 3 * stored))
                    } else {
                        (resident, transient)
                    }
                }
                // Safetensors are mapped and converted tensor by tensor; random values are
                // drawn in f32 and cast.
                None => (n * dsize, 4 * n),
            };
            plan.resident += resident;
            plan.transient = plan.transient.max(transient);
        }
        // On a GPU a layer's dense q/k/v (and gate/up) are concatenated for decode
        // ([`FusedLinear`]): the concatenation and its parts are held together for a moment.
        if fuses_linears(&device) {
            let (hid, d) = (cfg.hidden_size as u64, cfg.head_dim as u64);
            let qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) as u64 * d * hid;
            let gate_up = 2 * cfg.intermediate_size as u64 * hid;
            let (fuse_qkv, fuse_gate_up) = self.fuses_dense(cfg);
            let most = (if fuse_qkv { qkv } else { 0 }).max(if fuse_gate_up { gate_up } else { 0 });
            plan.transient = plan.transient.max(most * dtype.size_in_bytes() as u64);
        }
        plan
    }

    /// Whether some layer's q/k/v, and some layer's gate/up (a dense MLP's), load as dense
    /// weights, which [`FusedLinear`] fuses: always from safetensors and dense random draws;
    /// from a GGUF file where they are stored unquantized (F32, F16, BF16).
    fn fuses_dense(&self, cfg: &ModelConfig) -> (bool, bool) {
        let mlp = cfg.moe.is_none();
        match self {
            Weights::Safetensors { .. } => (true, mlp),
            Weights::Random { quantized, .. } => (quantized.is_none(), quantized.is_none() && mlp),
            Weights::Gguf { content, .. } => {
                let dense = |keys: &[Key]| {
                    (0..cfg.num_layers).any(|l| {
                        keys.iter().all(|k| {
                            let name = format!("{}.weight", k.name(true, Some(l)));
                            content
                                .tensor_infos
                                .get(&name)
                                .is_some_and(|i| i.ggml_dtype.block_size() == 1)
                        })
                    })
                };
                (
                    dense(&[Key::Q, Key::K, Key::V]),
                    mlp && dense(&[Key::Gate, Key::Up]),
                )
            }
        }
    }

    /// The first tensor the model reads whose stored size is not the one `cfg` gives it,
    /// described; checked before the weights are planned or read, so that settings that do not
    /// match their weights (a wrong `hidden_size`, say) are named as such and not as a lack of
    /// memory. Tensors the source lacks are left to loading, which names them.
    pub fn mismatched_tensor(&self, cfg: &ModelConfig) -> Option<String> {
        for (name, _, n) in self.model_tensors(cfg) {
            let shape: Vec<usize> = match self {
                Weights::Gguf { content, .. } => match content.tensor_infos.get(&name) {
                    Some(info) => info.shape.dims().to_vec(),
                    None => continue,
                },
                Weights::Safetensors { shapes, .. } => match shapes.get(&name) {
                    Some(s) => s.clone(),
                    None => continue,
                },
                Weights::Random { .. } => return None,
            };
            let have = shape.iter().map(|&d| d as u64).product::<u64>();
            if have != n {
                return Some(format!(
                    "tensor `{name}` has shape {shape:?} ({have} values), but the model's \
                     settings (hidden size {}, {} query and {} KV heads of {}, MLP width {}, \
                     vocabulary {}) give it {n} values",
                    cfg.hidden_size,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    cfg.intermediate_size,
                    cfg.vocab_size
                ));
            }
        }
        None
    }

    /// True when the source has a tensor for `key` (used for tied embeddings).
    pub fn has(&self, key: Key, layer: Option<usize>) -> bool {
        let name = format!("{}.weight", key.name(self.is_gguf(), layer));
        match self {
            Weights::Gguf { content, .. } => content.tensor_infos.contains_key(&name),
            Weights::Safetensors { vb, .. } => vb.contains_tensor(&name),
            Weights::Random { .. } => true,
        }
    }

    /// Tensors of a GGUF file that nothing has read, sorted: after the model has loaded,
    /// these are tensors the architecture does not use. llama.cpp refuses such a file ("wrong
    /// number of tensors"), since it is likely another variant than the metadata says.
    pub fn unused_tensors(&self) -> Vec<String> {
        let (names, used): (Vec<&String>, _) = match self {
            Weights::Gguf { content, used, .. } => (content.tensor_infos.keys().collect(), used),
            Weights::Safetensors { shapes, used, .. } => (shapes.keys().collect(), used),
            Weights::Random { .. } => return Vec::new(),
        };
        let used = used.lock().expect("tensor set poisoned");
        let mut unused: Vec<String> = names
            .into_iter()
            .filter(|k| !used.contains(*k))
            .cloned()
            .collect();
        unused.sort();
        unused
    }

    fn qtensor(&self, name: &str) -> Result<QTensor> {
        let Weights::Gguf { device, .. } = self else {
            unreachable!("qtensor on a non-GGUF source")
        };
        self.qtensor_on(name, device)
    }

    /// A GGUF tensor as stored, read onto `device`.
    fn qtensor_on(&self, name: &str, device: &Device) -> Result<QTensor> {
        let Weights::Gguf {
            path,
            content,
            file,
            used,
            ..
        } = self
        else {
            unreachable!("qtensor on a non-GGUF source")
        };
        if !content.tensor_infos.contains_key(name) {
            return Err(ModelError::MissingTensor(name.to_string()));
        }
        used.lock()
            .expect("gguf tensor set poisoned")
            .insert(name.to_string());
        let mut f = file.lock().expect("gguf file lock poisoned");
        content
            .tensor(&mut *f, name, device)
            .map_err(|e| ModelError::BadGguf {
                path: path.clone(),
                reason: format!("tensor `{name}`: {}", keydiff_cache::without_backtrace(e)),
            })
    }

    /// A dense tensor of the given shape (dequantized if stored quantized).
    pub fn tensor(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let t = match self {
            Weights::Gguf { device, dtype, .. } => {
                self.qtensor(name)?.dequantize(device)?.to_dtype(*dtype)?
            }
            Weights::Safetensors { vb, used, .. } => {
                if !vb.contains_tensor(name) {
                    return Err(ModelError::MissingTensor(name.to_string()));
                }
                used.lock()
                    .expect("tensor set poisoned")
                    .insert(name.to_string());
                vb.get(shape, name)?
            }
            Weights::Random {
                device,
                dtype,
                on_host,
                rng,
                ..
            } => {
                if *on_host || device.is_cpu() {
                    let mut rng = rng.lock().expect("rng lock poisoned");
                    init.host(shape, &mut rng)?
                        .to_dtype(*dtype)?
                        .to_device(device)?
                } else {
                    init.make(shape, *dtype, device)?
                }
            }
        };
        if t.dims() != shape {
            return Err(ModelError::Shape(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t)
    }

    /// An RMSNorm weight, `[dim]`.
    pub fn norm(&self, key: Key, layer: Option<usize>, dim: usize) -> Result<Tensor> {
        let name = format!("{}.weight", key.name(self.is_gguf(), layer));
        self.tensor(&name, &[dim], Init::Ones)
    }

    /// A linear layer `[out, in]`, optionally with a bias `[out]`.
    pub fn linear(
        &self,
        key: Key,
        layer: Option<usize>,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        self.linear_named(&key.name(self.is_gguf(), layer), out_dim, in_dim, bias)
    }

    /// [`Weights::linear`] of the tensor `{base}.weight` (and `{base}.bias`).
    fn linear_named(
        &self,
        base: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        let wname = format!("{base}.weight");
        let mut linear = match self.stored_qtensor(&wname, &[out_dim, in_dim])? {
            Some(q) => self.quantized_linear(q, false)?,
            None => {
                let t = self.tensor(&wname, &[out_dim, in_dim], Init::Normal)?;
                Linear {
                    stored: format!("{:?}", t.dtype()),
                    w: QMatMul::Tensor(t),
                    dense: None,
                    b: None,
                    rows_alone: Default::default(),
                }
            }
        };
        if bias {
            linear.b = Some(self.tensor(&format!("{base}.bias"), &[out_dim], Init::Zeros)?);
        }
        Ok(linear)
    }

    /// The tensor `name` as a GGUF file stores it, checked to be of `shape`: a GGUF source's
    /// (any type), a quantized random source's (drawn and quantized); `None` for the dense
    /// sources.
    fn stored_qtensor(&self, name: &str, shape: &[usize]) -> Result<Option<QTensor>> {
        let q = match self {
            Weights::Gguf { .. } => self.qtensor(name)?,
            Weights::Random {
                quantized: Some(t), ..
            } => self.random_qtensor(name, shape, *t)?,
            _ => return Ok(None),
        };
        if q.shape().dims() != shape {
            return Err(ModelError::Shape(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                q.shape().dims()
            )));
        }
        Ok(Some(q))
    }

    /// CPU options for quantized linears ([`Weights::set_cpu_weights`]).
    fn cpu_opts(&self) -> CpuWeights {
        match self {
            Weights::Gguf { opts, .. } | Weights::Random { opts, .. } => *opts,
            Weights::Safetensors { .. } => CpuWeights::AS_STORED,
        }
    }

    /// A linear (no bias) of a weight as a GGUF file stores it: with the CPU copies
    /// [`Weights::cpu_opts`] asks for (an expert's without a dense prefill copy, see
    /// [`Weights::experts`]), unquantized types cast to the model's dtype.
    fn quantized_linear(&self, q: QTensor, expert: bool) -> Result<Linear> {
        let (device, dtype) = self.device_dtype();
        let stored = format!("{:?}", q.dtype());
        let mut opts = self.cpu_opts();
        opts.dense_prefill &= !expert;
        let (q, dense) = opts.prepare(q, &device, dtype)?;
        Ok(Linear {
            w: gguf_matmul(q, dtype)?,
            dense,
            b: None,
            stored,
            rows_alone: Default::default(),
        })
    }

    /// The `n` experts' projections `key` of layer `l`, each a linear `[out_dim, in_dim]`
    /// without bias. A GGUF file's stacked `[n, out_dim, in_dim]` tensor is read on the host
    /// and split into one matrix per expert: quantized ones as stored (or re-quantized, under
    /// [`CpuWeights::requantize_slow`]), F32/F16/BF16 ones dense in the model's dtype, as
    /// the other linears are. Experts get no dense prefill copy, whatever
    /// [`CpuWeights::dense_prefill`] says: a chunk's rows spread over the experts (each sees
    /// about B·k/n of them), so the copies would cost the weights' size several times over for
    /// little speed.
    pub fn experts(
        &self,
        key: Key,
        l: usize,
        n: usize,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Vec<Linear>> {
        let Weights::Gguf { device, .. } = self else {
            return (0..n)
                .map(|e| {
                    let name = format!("{}.weight", key.expert_name(false, l, e));
                    match self.stored_qtensor(&name, &[out_dim, in_dim])? {
                        Some(q) => self.quantized_linear(q, true),
                        None => {
                            self.linear_named(&key.expert_name(false, l, e), out_dim, in_dim, false)
                        }
                    }
                })
                .collect();
        };
        let name = format!("{}.weight", key.expert_name(true, l, 0));
        let q = self.qtensor_on(&name, &Device::Cpu)?;
        if q.shape().dims() != [n, out_dim, in_dim] {
            return Err(ModelError::Shape(format!(
                "tensor `{name}` has shape {:?}, expected [{n}, {out_dim}, {in_dim}]",
                q.shape().dims()
            )));
        }
        let t = q.dtype();
        let data = q.data()?;
        // Rows are whole blocks (the GGUF layout check makes sure), so each expert's
        // out_dim rows are a contiguous run of bytes.
        let per = out_dim * in_dim / t.block_size() * t.type_size();
        if data.len() != n * per {
            return Err(ModelError::Shape(format!(
                "tensor `{name}` holds {} bytes, expected {} for {n} experts of {per}",
                data.len(),
                n * per
            )));
        }
        (0..n)
            .map(|e| {
                let bytes = std::borrow::Cow::Borrowed(&data[e * per..(e + 1) * per]);
                let storage = candle_core::quantized::QStorage::from_data(bytes, device, t)?;
                self.quantized_linear(QTensor::new(storage, (out_dim, in_dim))?, true)
            })
            .collect()
    }

    /// The embedding table `[vocab, hidden]`; kept quantized when stored quantized.
    pub fn embedding(&self, vocab: usize, hidden: usize) -> Result<Embedding> {
        let name = format!("{}.weight", Key::Embed.name(self.is_gguf(), None));
        match self.stored_qtensor(&name, &[vocab, hidden])? {
            Some(q) if q.dtype().block_size() > 1 => Ok(Embedding::Quantized(Arc::new(q))),
            Some(q) => {
                let (device, dtype) = self.device_dtype();
                Ok(Embedding::Dense(q.dequantize(&device)?.to_dtype(dtype)?))
            }
            None => Ok(Embedding::Dense(self.tensor(
                &name,
                &[vocab, hidden],
                Init::Normal,
            )?)),
        }
    }

    /// The output projection tied to the embedding table.
    pub fn tied_lm_head(&self, vocab: usize, hidden: usize) -> Result<Linear> {
        let name = format!("{}.weight", Key::Embed.name(self.is_gguf(), None));
        match self.stored_qtensor(&name, &[vocab, hidden])? {
            Some(q) => self.quantized_linear(q, false),
            None => {
                let t = self.tensor(&name, &[vocab, hidden], Init::Normal)?;
                Ok(Linear {
                    stored: format!("{:?}", t.dtype()),
                    w: QMatMul::Tensor(t),
                    dense: None,
                    b: None,
                    rows_alone: Default::default(),
                })
            }
        }
    }

    /// GGUF `rope_freqs.weight` (Llama 3.1 frequency factors), when present: `expected`
    /// (head_dim / 2) finite positive values, or an error.
    pub fn rope_freqs(&self, expected: usize) -> Result<Option<Vec<f32>>> {
        match self {
            Weights::Gguf { content, path, .. }
                if content.tensor_infos.contains_key("rope_freqs.weight") =>
            {
                let t = self
                    .qtensor("rope_freqs.weight")?
                    .dequantize(&Device::Cpu)?;
                let f = t.flatten_all()?.to_vec1::<f32>()?;
                // One divisor per rotated pair; RoPE divides each frequency by it.
                if f.len() != expected || !f.iter().all(|x| x.is_finite() && *x > 0.0) {
                    return Err(ModelError::BadGguf {
                        path: path.clone(),
                        reason: format!(
                            "`rope_freqs.weight` must hold {expected} finite positive factors \
                             (head_dim / 2), found {} values",
                            f.len()
                        ),
                    });
                }
                Ok(Some(f))
            }
            _ => Ok(None),
        }
    }

    /// Device and compute dtype of this source.
    pub fn device_dtype(&self) -> (Device, DType) {
        match self {
            Weights::Gguf { device, dtype, .. } | Weights::Random { device, dtype, .. } => {
                (device.clone(), *dtype)
            }
            Weights::Safetensors { vb, .. } => (vb.device().clone(), vb.dtype()),
        }
    }
}

/// Row counts of the runs a tensor of `rows` rows is quantized in on up to `threads` threads,
/// at most one run per 64 rows (small tensors stay on one thread), the last one shorter if need
/// be.
fn row_runs(rows: usize, threads: usize) -> Vec<usize> {
    let parts = threads.clamp(1, rows.div_ceil(64).max(1));
    let per = rows.div_ceil(parts).max(1);
    (0..rows).step_by(per).map(|s| per.min(rows - s)).collect()
}

/// The blocks of `t` of the tensors `runs` (f32 on the host, rows of whole blocks, each with
/// its storage to itself), one thread each, in order: the bytes of one quantization of their
/// rows stacked.
fn quantize_runs(runs: &[Tensor], t: GgmlDType) -> Result<Vec<u8>> {
    let parts = std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .iter()
            .map(|run| {
                scope.spawn(move || -> Result<Vec<u8>> {
                    Ok(QTensor::quantize(run, t)?.data()?.into_owned())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a quantizing thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(parts.concat())
}

/// Opens a file, naming it in the error (a missing file is `NotFound`).
fn open_file(path: &Path) -> Result<File> {
    File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::NotFound(path.to_path_buf())
        } else {
            ModelError::Io {
                path: path.to_path_buf(),
                error: source,
            }
        }
    })
}

/// Validates a safetensors header (JSON table of tensors whose data lies inside the file)
/// without reading the tensor data, so that a bad file names itself.
/// Checks a safetensors file's header; returns its tensors' names, stored types and shapes.
fn check_safetensors_header(path: &Path) -> Result<Vec<(String, safetensors::Dtype, Vec<usize>)>> {
    let f = open_file(path)?;
    // SAFETY: read-only mapping of a checkpoint that is not modified while we read it.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        error: source,
    })?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&map).map_err(|e| ModelError::BadSafetensors {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.dtype, info.shape.clone()))
        .collect())
}

/// How a random weight is initialised.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// N(0, 0.02²), the usual initializer range of these models.
    Normal,
    Ones,
    Zeros,
}

/// Standard deviation of random weights: `initializer_range` in the models' config.json.
const INIT_STD: f64 = 0.02;

impl Init {
    /// Draws on the host from a seeded generator, identical on every machine.
    fn host(self, shape: &[usize], rng: &mut StdRng) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = match self {
            Init::Normal => (0..n)
                .map(|_| rng.sample::<f32, _>(StandardNormal) * INIT_STD as f32)
                .collect(),
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
        };
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }

    /// Draws on the device from its own (seeded) generator.
    fn make(self, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        Ok(match self {
            Init::Normal => Tensor::randn(0f32, INIT_STD as f32, shape, device)?.to_dtype(dtype)?,
            Init::Ones => Tensor::ones(shape, dtype, device)?,
            Init::Zeros => Tensor::zeros(shape, dtype, device)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fused parts are views of the fused weight and bias (one storage each, nothing copied
    /// twice), in order; quantized or mixed parts are left as they are.
    #[test]
    fn fused_parts_are_views_of_one_weight() -> Result<()> {
        let dev = Device::Cpu;
        let dense = |out: usize, bias: bool| -> Result<Linear> {
            let w = Tensor::randn(0f32, 1., (out, 8), &dev)?;
            Ok(Linear {
                stored: "F32".into(),
                w: QMatMul::Tensor(w),
                dense: None,
                b: if bias {
                    Some(Tensor::randn(0f32, 1., out, &dev)?)
                } else {
                    None
                },
                rows_alone: Default::default(),
            })
        };
        let (mut a, mut b, mut c) = (dense(4, true)?, dense(2, true)?, dense(3, true)?);
        let x = Tensor::randn(0f32, 1., (3, 8), &dev)?;
        let want: Vec<Tensor> = [&a, &b, &c]
            .iter()
            .map(|l| l.forward(&x, Pass::Decode))
            .collect::<Result<_>>()?;
        let f = FusedLinear::fuse(&mut [&mut a, &mut b, &mut c])?.expect("dense parts fuse");
        assert_eq!(f.outs(), [4, 2, 3]);
        let storage = |t: &Tensor| {
            let (s, _) = t.storage_and_layout();
            &*s as *const candle_core::Storage as usize
        };
        let weight = |l: &Linear| match &l.w {
            QMatMul::Tensor(t) => t.clone(),
            _ => unreachable!(),
        };
        let (fw, fb) = (weight(&f.linear), f.linear.b.clone().expect("fused bias"));
        let y = f.forward(&x, Pass::Decode)?;
        let mut at = 0;
        for (part, want) in [&a, &b, &c].iter().zip(&want) {
            assert_eq!(storage(&weight(part)), storage(&fw));
            assert_eq!(storage(part.b.as_ref().expect("bias")), storage(&fb));
            // The parts (views) and the fused output's columns give the parts' old outputs.
            let n = want.dim(1)?;
            for got in [part.forward(&x, Pass::Prefill)?, y.narrow(1, at, n)?] {
                let d = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(d < 1e-6, "{d}");
            }
            at += n;
        }
        // A bias on some parts only, a quantized part, another width: not fused.
        let (mut a, mut b) = (dense(4, true)?, dense(2, false)?);
        assert!(FusedLinear::fuse(&mut [&mut a, &mut b])?.is_none());
        let q = QTensor::quantize(&Tensor::randn(0f32, 1., (4, 32), &dev)?, GgmlDType::Q8_0)?;
        let mut q = Linear {
            stored: "Q8_0".into(),
            w: QMatMul::from_qtensor(q)?,
            dense: None,
            b: None,
            rows_alone: Default::default(),
        };
        let mut d = dense(4, false)?;
        assert!(FusedLinear::fuse(&mut [&mut q, &mut d])?.is_none());
        Ok(())
    }

    /// A quantized random source draws the values the dense one draws (`on_host`, same seed,
    /// in the same order) and stores candle's quantization of them, as a GGUF file of that type
    /// would: the dequantized blocks are exactly those of the dense draw quantized, for two
    /// linears one after the other (the first with a bias, tall enough to be quantized in runs
    /// of rows on several threads), experts, a tied LM head and the embedding table; norms and
    /// biases stay dense and equal.
    #[test]
    fn quantized_random_weights_are_the_dense_draw_quantized() -> Result<()> {
        let dev = Device::Cpu;
        let blocks_of = |l: &Linear| -> Result<Tensor> {
            match &l.w {
                QMatMul::QTensor(q) => Ok(q.dequantize(&Device::Cpu)?),
                _ => panic!("a quantized random linear is a QTensor"),
            }
        };
        for (t, (out_dim, in_dim)) in [(GgmlDType::Q4_0, (200, 64)), (GgmlDType::Q4K, (136, 512))] {
            let dense = Weights::random(&dev, DType::F32, 9, true)?;
            let quant = Weights::random_quantized(&dev, DType::F32, 9, true, t, CpuWeights::FAST)?;
            let same = |d: &Tensor, q: &Tensor, what: &str| -> Result<()> {
                let want = QTensor::quantize(d, t)?.dequantize(&dev)?;
                let diff = (want - q)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{t:?} {what}: not the dense draw's blocks");
                Ok(())
            };
            let dense_w = |l: &Linear| -> Tensor {
                match &l.w {
                    QMatMul::Tensor(w) => w.clone(),
                    _ => panic!("a dense random linear is a tensor"),
                }
            };
            let (a, b) = (
                dense.linear(Key::Q, Some(0), out_dim, in_dim, true)?,
                quant.linear(Key::Q, Some(0), out_dim, in_dim, true)?,
            );
            assert_eq!(b.kind(), format!("{t:?}"));
            let got = blocks_of(&b)?;
            same(&dense_w(&a), &got, "q_proj")?;
            // The dense prefill copy is the dequantized weight.
            let copy = (b.dense.as_ref().expect("FAST keeps a prefill copy") - &got)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(copy, 0.0);
            let bias = |l: &Linear| l.b.as_ref().expect("a bias").to_vec1::<f32>();
            assert_eq!(bias(&a)?, bias(&b)?);
            let norm = |w: &Weights| w.norm(Key::AttnNorm, Some(0), in_dim);
            assert_eq!(
                norm(&dense)?.to_vec1::<f32>()?,
                norm(&quant)?.to_vec1::<f32>()?
            );
            let (a, b) = (
                dense.linear(Key::K, Some(0), 32, in_dim, false)?,
                quant.linear(Key::K, Some(0), 32, in_dim, false)?,
            );
            same(&dense_w(&a), &blocks_of(&b)?, "k_proj, drawn second")?;
            let (a, b) = (
                dense.experts(Key::GateExps, 0, 3, 16, in_dim)?,
                quant.experts(Key::GateExps, 0, 3, 16, in_dim)?,
            );
            for (e, (a, b)) in a.iter().zip(&b).enumerate() {
                same(&dense_w(a), &blocks_of(b)?, &format!("expert {e}"))?;
                assert!(b.dense.is_none(), "experts keep no prefill copy");
            }
            let (a, b) = (
                dense.tied_lm_head(24, in_dim)?,
                quant.tied_lm_head(24, in_dim)?,
            );
            same(&dense_w(&a), &blocks_of(&b)?, "tied head")?;
            // The embedding table is kept quantized, its rows those of the dense draw.
            let (e_dense, e_quant) = (dense.embedding(16, in_dim)?, quant.embedding(16, in_dim)?);
            let (Embedding::Dense(e), Embedding::Quantized(eq)) = (&e_dense, &e_quant) else {
                panic!("embeddings: dense and quantized expected")
            };
            same(e, &eq.dequantize(&dev)?, "embedding")?;
        }
        Ok(())
    }

    /// Quantizing runs of rows on several threads gives the bytes of one quantization of the
    /// whole tensor, for every split (runs of 64 rows and more, uneven last runs).
    #[test]
    fn quantizing_on_threads_gives_the_whole_tensors_blocks() -> Result<()> {
        assert_eq!(row_runs(300, 1), [300]);
        assert_eq!(row_runs(300, 3), [100, 100, 100]);
        assert_eq!(row_runs(300, 16), [60, 60, 60, 60, 60]);
        assert_eq!(row_runs(129, 2), [65, 64]);
        assert_eq!(row_runs(40, 8), [40]);
        assert!(row_runs(0, 4).is_empty());
        let x = Tensor::randn(0f32, 1.0, (300, 256), &Device::Cpu)?;
        for t in [
            GgmlDType::Q4_0,
            GgmlDType::Q5_1,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let whole = QTensor::quantize(&x, t)?.data()?.into_owned();
            for threads in [1, 2, 3, 5, 16] {
                let mut start = 0;
                let mut runs = Vec::new();
                for rows in row_runs(300, threads) {
                    let values = x.narrow(0, start, rows)?.flatten_all()?.to_vec1::<f32>()?;
                    runs.push(Tensor::from_vec(values, (rows, 256), &Device::Cpu)?);
                    start += rows;
                }
                assert_eq!(start, 300);
                assert!(
                    quantize_runs(&runs, t)? == whole,
                    "{t:?} on {threads} threads"
                );
            }
        }
        Ok(())
    }

    /// Which rows go to candle's CUDA quantized matmul as they are: bf16/f16, 2-D or 3-D,
    /// contiguous, for llama.cpp's weight types; anything else is cast to f32 first (candle's
    /// fallbacks read f32 only).
    #[test]
    fn half_rows_go_to_the_quantized_matmul_only_where_candle_takes_them() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((4, 64), DType::BF16, &dev)?;
        for (_, t) in WEIGHT_TYPES {
            assert!(q_takes_half_rows(t, &x), "{t:?}");
            assert!(q_takes_half_rows(t, &x.to_dtype(DType::F16)?), "{t:?}");
            assert!(q_takes_half_rows(t, &x.unsqueeze(0)?), "{t:?}");
        }
        let q = GgmlDType::Q4K;
        assert!(!q_takes_half_rows(q, &x.to_dtype(DType::F32)?));
        assert!(!q_takes_half_rows(q, &x.t()?));
        assert!(!q_takes_half_rows(q, &x.unsqueeze(0)?.unsqueeze(0)?));
        assert!(!q_takes_half_rows(q, &x.flatten_all()?));
        assert!(!q_takes_half_rows(q, &x.narrow(0, 0, 0)?));
        for t in [GgmlDType::F16, GgmlDType::Q8_1, GgmlDType::Q8K] {
            assert!(!q_takes_half_rows(t, &x), "{t:?}");
        }
        Ok(())
    }

    /// Types and shapes a quantized random source cannot take are refused by name.
    #[test]
    fn quantized_random_weights_refuse_what_they_cannot_hold() -> Result<()> {
        assert_eq!(parse_weight_type("Q4_K")?, GgmlDType::Q4K);
        assert_eq!(parse_weight_type("q8_0")?, GgmlDType::Q8_0);
        let err = parse_weight_type("q8_1").unwrap_err().to_string();
        assert!(err.contains("`q8_1`") && err.contains("q6_k"), "{err}");
        let dev = Device::Cpu;
        assert!(Weights::random_quantized(
            &dev,
            DType::F32,
            0,
            true,
            GgmlDType::Q8K,
            CpuWeights::FAST
        )
        .is_err());
        let w =
            Weights::random_quantized(&dev, DType::F32, 0, true, GgmlDType::Q6K, CpuWeights::FAST)?;
        let err = w
            .linear(Key::Q, Some(1), 64, 96, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.layers.1.self_attn.q_proj.weight") && err.contains("256"),
            "{err}"
        );
        Ok(())
    }

    /// GGUF files may store linears unquantized (F32/F16/BF16); candle dequantizes those to an
    /// f32 matrix, which a bf16 or f16 model must still be able to multiply.
    #[test]
    fn unquantized_gguf_linears_run_in_half_precision() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (6, 32), &dev)?;
        let x = Tensor::randn(0f32, 1., (3, 32), &dev)?;
        let want = x.matmul(&w.t()?)?;
        for stored in [GgmlDType::F32, GgmlDType::F16, GgmlDType::BF16] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let linear = Linear {
                    w: gguf_matmul(QTensor::quantize(&w, stored)?, dtype)?,
                    dense: None,
                    b: None,
                    stored: format!("{stored:?}"),
                    rows_alone: Default::default(),
                };
                let y = linear.forward(&x.to_dtype(dtype)?, false)?;
                assert_eq!(y.dtype(), dtype, "{stored:?} weights, {dtype:?} model");
                let err = (y.to_dtype(DType::F32)? - &want)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert!(
                    err < 0.2,
                    "{stored:?} weights, {dtype:?} model: max error {err}"
                );
            }
        }
        Ok(())
    }
}
