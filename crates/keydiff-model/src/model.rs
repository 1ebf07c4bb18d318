//! The decoder: embedding, N × (attention + SwiGLU MLP, pre-RMSNorm), final norm, LM head.
//!
//! One implementation for Llama 3.x, Qwen 2.5 and Qwen 3, with dense or GGML-quantized
//! linears. The model owns no cache: each call gets the per-layer [`LayerCache`]s of the
//! request.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use keydiff_cache::{AttnStats, CacheConfig, KvCache, KvType, KvTypes};

use crate::attention::{
    attention_output, attention_probs_in, attention_probs_sums, chunk_mask, decode_attention_cpu,
    decode_attention_cpu_blocks, decode_attention_cuda, decode_attention_cuda_kvq, flash_attend,
    row_sums, stats_pass, widen_cache_view, AttentionBackend,
};
use crate::config::{Arch, ModelConfig, RopeOverride};
use crate::error::{ModelError, Result};
use crate::kv_rotation::{rotate, KvRotation};
use crate::rope::Rope;
use crate::weights::{fuses_linears, Embedding, FusedLinear, Key, Linear, Pass, Weights};

#[derive(Debug, Clone)]
struct RmsNorm {
    w: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(x, &self.w, self.eps)?)
    }

    /// The norm of `x` after adding to it the residual `pending` (the previous block's output,
    /// when it was left to be added here): the add and the norm in one launch on CUDA
    /// ([`add_rms_norm`]).
    fn add_forward(&self, x: &mut Tensor, pending: Option<Tensor>) -> Result<Tensor> {
        match pending {
            Some(r) => {
                let (sum, norm) = add_rms_norm(x, &r, &self.w, self.eps)?;
                *x = sum;
                Ok(norm)
            }
            None => self.forward(x),
        }
    }
}

pub use crate::decode_kernel::{
    add_rms_norm_cuda, argmax, argmax_rows, rope_qk_cuda, silu_mul_cuda,
};
pub use crate::sample::{draw, order, pick, sample_rows, samples_on, DrawParams, NO_DRAW};

/// SwiGLU's product silu(gate) · up (`[rows, cols]` each): one launch on CUDA
/// ([`silu_mul_cuda`]), candle's `silu` and product elsewhere, the kernel's reference.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if let Some(y) = silu_mul_cuda(gate, up)? {
        return Ok(y);
    }
    Ok((gate.silu()? * up)?)
}

/// A residual add `x + r` (`[rows, hidden]`) and the RMSNorm of the sum with weight `w`:
/// (sum, norm). One launch on CUDA ([`add_rms_norm_cuda`]); candle's add and `rms_norm`
/// elsewhere, the kernel's reference.
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if let Some(both) = add_rms_norm_cuda(x, r, w, eps)? {
        return Ok(both);
    }
    let s = (x + r)?;
    let n = candle_nn::ops::rms_norm(&s, w, eps)?;
    Ok((s, n))
}

#[derive(Debug, Clone)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// q, k and v as one matmul for decode rows ([`FusedLinear`]; on a GPU).
    qkv_fused: Option<FusedLinear>,
    /// Per-head RMSNorms of queries and keys before RoPE (Qwen 3).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(cfg: &ModelConfig, w: &Weights, l: usize) -> Result<Self> {
        let (h, kv, d, hid) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let bias = cfg.attention_bias;
        let qk_norm = if cfg.qk_norm {
            let eps = cfg.rms_norm_eps as f32;
            let norm = |key| -> Result<RmsNorm> {
                Ok(RmsNorm {
                    w: w.norm(key, Some(l), d)?,
                    eps,
                })
            };
            Some((norm(Key::QNorm)?, norm(Key::KNorm)?))
        } else {
            None
        };
        Ok(Self {
            q: w.linear(Key::Q, Some(l), h * d, hid, bias)?,
            k: w.linear(Key::K, Some(l), kv * d, hid, bias)?,
            v: w.linear(Key::V, Some(l), kv * d, hid, bias)?,
            o: w.linear(Key::O, Some(l), hid, h * d, false)?,
            qkv_fused: None,
            qk_norm,
            heads: h,
            kv_heads: kv,
            head_dim: d,
        })
    }

    /// `x`: `[B, hidden]` → `[B, hidden]`. Appends the chunk's K/V to layer `li` of `cache`,
    /// attends, then lets the cache evict.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        cos_sin: &(Tensor, Tensor),
        mask: Option<&Tensor>,
        cache: &mut KvCache,
        li: usize,
        pos0: usize,
        decode: bool,
        backend: AttentionBackend,
        rot: Option<&KvRotation>,
        clock: &mut Clock,
    ) -> Result<Tensor> {
        let (q, k, v) = self.qkv(x, rope, cos_sin, !decode)?;
        let y = self.attend_cached(
            &q, &k, &v, mask, cache, li, pos0, decode, backend, rot, clock,
        )?;
        let out = self.o.forward(&y, !decode)?;
        clock.lap(cache, Region::Attention)?;
        Ok(out)
    }

    /// The rows' queries `[1, heads, B, d]`, keys and values `[kv_heads, B, d]`, RoPE applied
    /// at `cos_sin`'s positions (one row each). `pf` selects the linears' prefill weights.
    fn qkv(
        &self,
        x: &Tensor,
        rope: &Rope,
        cos_sin: &(Tensor, Tensor),
        pass: impl Into<Pass>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let pf = pass.into();
        let b = x.dim(0)?;
        let (h, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        // Each `[B, n, d]`: views of one fused output, or the parts' own.
        let (q, k, v) = match (&self.qkv_fused, pf) {
            (Some(f), Pass::Decode | Pass::DecodeRows) => {
                let y = f.forward(x, pf)?.reshape((b, h + 2 * kv, d))?;
                (
                    y.narrow(1, 0, h)?,
                    y.narrow(1, h, kv)?,
                    y.narrow(1, h + kv, kv)?,
                )
            }
            _ => (
                self.q.forward(x, pf)?.reshape((b, h, d))?,
                self.k.forward(x, pf)?.reshape((b, kv, d))?,
                self.v.forward(x, pf)?.reshape((b, kv, d))?,
            ),
        };
        // [heads, B, d] views
        let (mut q, mut k, v) = (q.transpose(0, 1)?, k.transpose(0, 1)?, v.transpose(0, 1)?);
        if let Some((qn, kn)) = &self.qk_norm {
            // Over each head's d values (the last dimension), before RoPE.
            q = qn.forward(&q.contiguous()?)?;
            k = kn.forward(&k.contiguous()?)?;
        }
        let (cos, sin) = cos_sin;
        let (q, k) = rope.apply_qk(&q, &k, cos, sin)?;
        Ok((q, k, v))
    }

    /// Appends a chunk's `k`, `v` (`[kv_heads, B, d]`, positions from `pos0`) to layer `li`
    /// of `cache`, attends with its queries `q` (`[1, heads, B, d]`), then lets the cache
    /// evict. Returns `[B, heads·d]`, before the output projection. With `rot`, a cache of
    /// block types holds its keys (and queries meet them) and values rotated (see
    /// [`crate::kv_rotation`]), and the output is rotated back.
    #[allow(clippy::too_many_arguments)]
    fn attend_cached(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        cache: &mut KvCache,
        li: usize,
        pos0: usize,
        decode: bool,
        backend: AttentionBackend,
        rot: Option<&KvRotation>,
        clock: &mut Clock,
    ) -> Result<Tensor> {
        let b = q.dim(2)?;
        let (h, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let g = h / kv;
        let layer = cache.layer_mut(li);
        let (rot_k, rot_v) = match rot {
            Some(r) => r.for_types(layer.kv_type()),
            None => (None, None),
        };
        let (qr, kr, vr);
        let (q, k) = match rot_k {
            Some(hk) => {
                (qr, kr) = (rotate(q, hk)?, rotate(k, hk)?);
                (&qr, &kr)
            }
            None => (q, k),
        };
        let v = match rot_v {
            Some(hv) => {
                vr = rotate(v, hv)?;
                &vr
            }
            None => v,
        };
        layer.append(k, v, pos0)?;
        let rows = cache.stats_rows(li, b, decode);
        let layer = cache.layer(li);
        let eager = backend != AttentionBackend::Flash;
        let one_row = b == 1 && mask.is_none();
        // A quantized cache's decode step gives the decode kernel the blocks to read in place
        // (dequantized, the whole view would first be written out as f32), unless a flash
        // step's statistics pass needs the keys as values, or keys and values are of two
        // types. Should the kernel decline them, the values are dequantized below. On CUDA an
        // fp8 cache's rows go to the kernel as stored too (its reads of them are widened to
        // f32 by keydiff's kernels, candle's fp8 casts being unreachable there).
        let kvt = layer.kv_type();
        let blocks = (kvt.k == kvt.v && kvt.k.block_bytes().is_some()).then_some(kvt.k);
        let fp8 = KvType::Float(DType::F8E4M3);
        let cuda_fp8 = (kvt.k == fp8 && kvt.v == fp8 && q.device().is_cuda()).then_some(fp8);
        let in_place = blocks.or(cuda_fp8);
        // Otherwise a quantized cache is read in the activations' dtype (on CUDA the kernel
        // writes it so, with no f32 copy of the view between).
        let (keys, values) = if in_place.is_some() && one_row && (eager || rows.is_none()) {
            (layer.stored_keys()?, layer.stored_values()?)
        } else {
            (layer.keys_as(q.dtype())?, layer.values_as(q.dtype())?)
        };
        // A cache held in another dtype than the activations (`Model::set_kv_dtype`) is read
        // in place by the decode kernel; the general path gets a converted copy of the view.
        let cast = |t: &Tensor| -> Result<Tensor> {
            if t.dtype() == q.dtype() {
                return Ok(t.clone());
            }
            match q.dtype() {
                DType::F32 => match widen_cache_view(t)? {
                    Some(w) => Ok(w),
                    None => Ok(t.to_dtype(DType::F32)?),
                },
                dt => Ok(t.to_dtype(dt)?),
            }
        };
        // A one-token chunk (a decode step) on the CPU in f32 runs the decode kernel under
        // either backend (see decode_attention_cpu): `[kv, g, d]`, and for eager the
        // probabilities its statistics need; flash takes its statistics from the extra pass,
        // as for every chunk. On CUDA, keydiff's decode kernel runs it (decode_attention_cuda)
        // unless the eager statistics need the probabilities.
        let decoded = match (b, mask) {
            // Keys and values of different types (`--cache-type-k/-v`): the kernel reads one
            // type, so both are widened first.
            (1, None) if keys.dtype() != values.dtype() => {
                let q = q.reshape((kv, g, d))?;
                decode_attention_cpu(&q, &cast(&keys)?, &cast(&values)?, eager && rows.is_some())?
            }
            (1, None) => {
                let q = q.reshape((kv, g, d))?;
                let probs = eager && rows.is_some();
                match in_place.filter(|t| keys.dtype() == t.storage_dtype()) {
                    // On CUDA, keydiff's decode kernel reads the blocks (or fp8 rows) in place,
                    // when no probabilities are needed.
                    Some(t) if q.device().is_cuda() => match probs {
                        false => {
                            decode_attention_cuda_kvq(&q, &keys, &values, t)?.map(|y| (y, None))
                        }
                        true => None,
                    },
                    Some(t) => decode_attention_cpu_blocks(&q, &keys, &values, t, probs)?,
                    // On CUDA, one launch (two for a long cache) in place of the eager path's
                    // six, when no probabilities are needed (flash takes its statistics from
                    // its own pass below).
                    None if q.device().is_cuda() && !probs => {
                        decode_attention_cuda(&q, &keys, &values)?.map(|y| (y, None))
                    }
                    None => decode_attention_cpu(&q, &keys, &values, probs)?,
                }
            }
            _ => None,
        };
        // Rows as stored that no decode kernel took: read as values.
        let (keys, values) = match decoded {
            None if in_place.is_some_and(|t| keys.dtype() == t.storage_dtype()) => {
                (layer.keys_as(q.dtype())?, layer.values_as(q.dtype())?)
            }
            _ => (keys, values),
        };
        let (y, stats) = match backend {
            // `Model::set_attention` resolves `Auto`: a model never holds it.
            AttentionBackend::Eager | AttentionBackend::Auto => {
                // Probabilities [kv, g·B, T], then [kv, g·B, d]
                let q = q.reshape((kv, g * b, d))?;
                let (y, sums) = match decoded {
                    // The decode kernel's f32 probabilities, summed here.
                    Some((y, probs)) => match (rows, probs) {
                        (Some(r), Some(probs)) => {
                            clock.lap(cache, Region::Attention)?;
                            let sums = row_sums(&probs, g, r)?;
                            clock.lap(cache, Region::Stats)?;
                            (y, Some(sums))
                        }
                        (Some(_), None) => {
                            return Err(ModelError::Shape(
                                "decode attention returned no probabilities for the statistics"
                                    .into(),
                            ))
                        }
                        (None, _) => (y, None),
                    },
                    // Probabilities in the values' dtype (written so by the CUDA softmax
                    // kernels, saving a cast). The statistics are summed from them in f32 as
                    // the softmax makes them (on CUDA, in the same launches): under eager
                    // attention their time is attention's.
                    None => {
                        let values = cast(&values)?;
                        let keys = cast(&keys)?;
                        let dt = values.dtype();
                        match rows {
                            Some(r) => {
                                let (probs, sums) =
                                    attention_probs_sums(&q, &keys, mask, g, r, Some(dt))?;
                                let probs = probs.ok_or_else(|| {
                                    ModelError::Shape(
                                        "the softmax returned no probabilities".into(),
                                    )
                                })?;
                                (attention_output(&probs, &values)?, Some(sums))
                            }
                            None => {
                                let probs = attention_probs_in(&q, &keys, mask, g, dt)?;
                                (attention_output(&probs, &values)?, None)
                            }
                        }
                    }
                };
                let stats = match (rows, sums) {
                    (Some(r), Some(sums)) => Some(AttnStats { sums, rows: r }),
                    _ => None,
                };
                clock.lap(cache, Region::Attention)?;
                // [B, heads·d]
                let y = y.reshape((h, b, d))?.transpose(0, 1)?.reshape((b, h * d))?;
                (y, stats)
            }
            AttentionBackend::Flash => {
                // The cache read in place as [1, T, kv, d].
                let view = |t: Tensor| -> Result<Tensor> { Ok(t.transpose(0, 1)?.unsqueeze(0)?) };
                // The decode kernel is flash-decoding: it never holds a row of probabilities.
                let keys = match (&decoded, rows) {
                    (Some(_), None) => keys,
                    _ => cast(&keys)?,
                };
                let y = match decoded {
                    Some((y, _)) => y.reshape((b, h * d))?,
                    None => flash_attend(
                        &q.transpose(1, 2)?,
                        &view(keys.clone())?,
                        &view(cast(&values)?)?,
                    )?,
                };
                clock.lap(cache, Region::Attention)?;
                let stats = match rows {
                    Some(r) => {
                        let sums = stats_pass(&q.reshape((kv, g, b, d))?, &keys, r)?;
                        clock.lap(cache, Region::Stats)?;
                        Some(AttnStats { sums, rows: r })
                    }
                    None => None,
                };
                (y, stats)
            }
        };
        // Times its own parts (statistics folded into policy state, scoring, selection/moves).
        cache.after_attention(li, stats.as_ref(), decode)?;
        clock.restart()?;
        match rot_v {
            Some(hv) => rotate(&y, hv),
            None => Ok(y),
        }
    }
}

/// Runs `pass` with every cache of `caches` that attends several rows of a layer one after the
/// other (`rows[i] > 1`: decode rows, a speculative draft verified row by row) evicting each
/// layer after its own attention, then restores the caches' setting. Each row's eviction must
/// come before the next row of that layer attends, as in token-by-token decoding; evicting
/// every layer at once after the last layer's attention ([`KvCache::after_attention`]) would
/// come after all of them.
fn rows_evicting_per_layer<T>(
    caches: &mut [&mut KvCache],
    rows: &[usize],
    pass: impl FnOnce(&mut [&mut KvCache]) -> Result<T>,
) -> Result<T> {
    let was: Vec<bool> = caches.iter().map(|c| c.evicts_per_layer()).collect();
    for (c, &r) in caches.iter_mut().zip(rows) {
        if r > 1 {
            c.set_evict_per_layer(true);
        }
    }
    let out = pass(caches);
    for (c, w) in caches.iter_mut().zip(was) {
        c.set_evict_per_layer(w);
    }
    out
}

/// Regions of a layer that profiling separates.
#[derive(Debug, Clone, Copy)]
enum Region {
    Attention,
    Stats,
    Mlp,
}

/// Host timer over device work for profiling: when on, each lap synchronises the device and
/// adds the elapsed time to a region of the cache's profile. When off it does nothing, so normal
/// runs keep the device's queue asynchronous.
struct Clock {
    on: bool,
    device: Device,
    t: Instant,
}

impl Clock {
    fn new(on: bool, device: &Device) -> Result<Self> {
        if on {
            device.synchronize()?;
        }
        Ok(Self {
            on,
            device: device.clone(),
            t: Instant::now(),
        })
    }

    /// Charges the time since the last lap to `region`.
    fn lap(&mut self, cache: &mut KvCache, region: Region) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        self.device.synchronize()?;
        let dt = self.t.elapsed().as_secs_f64();
        if let Some(p) = cache.profile_mut() {
            match region {
                Region::Attention => p.attention_s += dt,
                Region::Stats => p.stats_s += dt,
                Region::Mlp => p.mlp_s += dt,
            }
        }
        self.t = Instant::now();
        Ok(())
    }

    /// Starts the next lap now (after a region timed elsewhere).
    fn restart(&mut self) -> Result<()> {
        if self.on {
            self.device.synchronize()?;
            self.t = Instant::now();
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    /// gate and up as one matmul for decode rows ([`FusedLinear`]; on a GPU).
    gate_up: Option<FusedLinear>,
}

impl Mlp {
    fn forward(&self, x: &Tensor, pass: impl Into<Pass>) -> Result<Tensor> {
        let pass = pass.into();
        let (gate, up) = match (&self.gate_up, pass) {
            (Some(f), Pass::Decode | Pass::DecodeRows) => {
                let y = f.forward(x, pass)?;
                let n = f.outs()[0];
                (y.narrow(D::Minus1, 0, n)?, y.narrow(D::Minus1, n, n)?)
            }
            _ => (self.gate.forward(x, pass)?, self.up.forward(x, pass)?),
        };
        self.down.forward(&silu_mul(&gate, &up)?, pass)
    }

    fn linears(&self) -> [&Linear; 3] {
        [&self.gate, &self.up, &self.down]
    }
}

/// A mixture of SwiGLU experts ([`crate::MoeConfig`]).
#[derive(Debug, Clone)]
struct Moe {
    router: Linear,
    experts: Vec<Mlp>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl Moe {
    /// `x`: `[rows, hidden]` → `[rows, hidden]`. The router's softmax is taken in f32 and read
    /// on the host, where each row's experts are chosen; each chosen expert then runs once
    /// over the rows that chose it, and all their outputs, weighted, are added into an f32
    /// sum at once.
    fn forward(&self, x: &Tensor, pass: impl Into<Pass>) -> Result<Tensor> {
        let prefill = pass.into();
        let logits = self.router.forward(x, prefill)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?.to_vec2::<f32>()?;
        let (rows, weights) = route(&probs, self.top_k, self.norm_topk_prob);
        let (mut ids, mut outs) = (Vec::new(), Vec::new());
        for ((expert, rows), weights) in self.experts.iter().zip(rows).zip(weights) {
            if rows.is_empty() {
                continue;
            }
            let at = Tensor::new(rows.as_slice(), x.device())?;
            let w = Tensor::from_vec(weights, (rows.len(), 1), x.device())?;
            let y = expert.forward(&x.index_select(&at, 0)?, prefill)?;
            outs.push(y.to_dtype(DType::F32)?.broadcast_mul(&w)?);
            ids.extend(rows);
        }
        let n = ids.len();
        let ids = Tensor::from_vec(ids, n, x.device())?;
        let sum = Tensor::zeros(x.dims(), DType::F32, x.device())?;
        Ok(sum
            .index_add(&ids, &Tensor::cat(&outs, 0)?, 0)?
            .to_dtype(x.dtype())?)
    }
}

/// Top-k routing of each row's expert probabilities `probs[row][expert]`: for each expert,
/// the rows that chose it and their weights. A row chooses its `k` most probable experts
/// (the lower index first among equals); their weights are the probabilities, divided by
/// their sum when `norm`.
fn route(probs: &[Vec<f32>], k: usize, norm: bool) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let n = probs.first().map_or(0, Vec::len);
    let (mut rows, mut weights) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for (r, p) in probs.iter().enumerate() {
        order.clear();
        order.extend(0..n);
        // Stable: equal probabilities keep index order.
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let chosen = &order[..k.min(n)];
        let total: f32 = chosen.iter().map(|&e| p[e]).sum();
        for &e in chosen {
            rows[e].push(r as u32);
            weights[e].push(if norm { p[e] / total } else { p[e] });
        }
    }
    (rows, weights)
}

/// A layer's feed-forward block.
#[derive(Debug, Clone)]
enum Ffn {
    Mlp(Mlp),
    Moe(Moe),
}

impl Ffn {
    fn forward(&self, x: &Tensor, pass: impl Into<Pass>) -> Result<Tensor> {
        let prefill = pass.into();
        match self {
            Ffn::Mlp(m) => m.forward(x, prefill),
            Ffn::Moe(m) => m.forward(x, prefill),
        }
    }

    /// Every linear it holds.
    fn linears(&self) -> Vec<&Linear> {
        match self {
            Ffn::Mlp(m) => m.linears().to_vec(),
            Ffn::Moe(m) => std::iter::once(&m.router)
                .chain(m.experts.iter().flat_map(Mlp::linears))
                .collect(),
        }
    }
}

/// What a segment of [`Model::forward_segments`] wants from the LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Nothing (a prompt chunk before the last, without prompt logprobs).
    None,
    /// The last row's: the next token's distribution.
    Last,
    /// Every row's (prompt logprobs).
    All,
}

/// A sequence's part of a [`Model::forward_segments`] pass.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// The tokens, continuing the sequence from its cache's position.
    pub tokens: &'a [u32],
    /// Generated tokens rather than a prompt chunk, as [`Model::forward`]'s `decode`: it
    /// selects the decode weights and the cache's decode eviction timing. Several tokens (one
    /// and its speculative draft) are decode steps in one pass, attended row by row as
    /// [`Model::forward_decode_rows`] attends them.
    pub decode: bool,
    /// Which logits to return.
    pub logits: Logits,
}

/// Consecutive segments of a pass whose linears run together: their segment indices, their
/// rows (first, count), and whether they take the prefill weights.
struct Run {
    segs: std::ops::Range<usize>,
    rows: (usize, usize),
    pf: bool,
}

#[derive(Debug, Clone)]
struct Layer {
    attn_norm: RmsNorm,
    attn: Attention,
    mlp_norm: RmsNorm,
    mlp: Ffn,
}

impl Layer {
    /// Fuses q/k/v and a dense MLP's gate/up for decode rows ([`FusedLinear`]), where they are
    /// dense; returns how many groups it fused (again: 0).
    fn fuse_linears(&mut self) -> Result<usize> {
        let mut n = 0;
        let a = &mut self.attn;
        if a.qkv_fused.is_none() {
            a.qkv_fused = FusedLinear::fuse(&mut [&mut a.q, &mut a.k, &mut a.v])?;
            n += a.qkv_fused.is_some() as usize;
        }
        if let Ffn::Mlp(m) = &mut self.mlp {
            if m.gate_up.is_none() {
                m.gate_up = FusedLinear::fuse(&mut [&mut m.gate, &mut m.up])?;
                n += m.gate_up.is_some() as usize;
            }
        }
        Ok(n)
    }
}

/// A loaded model, ready to run chunks.
#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    device: Device,
    dtype: DType,
    /// What the KV cache holds (`dtype` unless [`Model::set_kv_dtype`] chose another).
    kv_dtype: KvTypes,
    /// The Hadamard rotation of quantized caches ([`Model::set_kv_rotation`]); `None` when
    /// off, or when heads are not a multiple of 64.
    kv_rotation: Option<KvRotation>,
    attention: AttentionBackend,
}

impl Model {
    /// Builds the model from a weight source.
    pub fn load(cfg: &ModelConfig, w: &Weights) -> Result<Self> {
        let (device, dtype) = w.device_dtype();
        let eps = cfg.rms_norm_eps as f32;
        let norm = |key, l, dim| -> Result<RmsNorm> {
            Ok(RmsNorm {
                w: w.norm(key, l, dim)?,
                eps,
            })
        };
        let hid = cfg.hidden_size;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            // In this order, so that a file missing several tensors names its first.
            let attn_norm = norm(Key::AttnNorm, Some(l), hid)?;
            let attn = Attention::new(cfg, w, l)?;
            let mlp_norm = norm(Key::MlpNorm, Some(l), hid)?;
            let mlp = match &cfg.moe {
                None => Ffn::Mlp(Mlp {
                    gate: w.linear(Key::Gate, Some(l), cfg.intermediate_size, hid, false)?,
                    up: w.linear(Key::Up, Some(l), cfg.intermediate_size, hid, false)?,
                    down: w.linear(Key::Down, Some(l), hid, cfg.intermediate_size, false)?,
                    gate_up: None,
                }),
                Some(m) => {
                    let (n, ff) = (m.num_experts, m.expert_intermediate_size);
                    let router = w.linear(Key::Router, Some(l), n, hid, false)?;
                    let gate = w.experts(Key::GateExps, l, n, ff, hid)?;
                    let up = w.experts(Key::UpExps, l, n, ff, hid)?;
                    let down = w.experts(Key::DownExps, l, n, hid, ff)?;
                    Ffn::Moe(Moe {
                        router,
                        experts: gate
                            .into_iter()
                            .zip(up)
                            .zip(down)
                            .map(|((gate, up), down)| Mlp {
                                gate,
                                up,
                                down,
                                gate_up: None,
                            })
                            .collect(),
                        top_k: m.experts_per_token,
                        norm_topk_prob: m.norm_topk_prob,
                    })
                }
            };
            let mut layer = Layer {
                attn_norm,
                attn,
                mlp_norm,
                mlp,
            };
            // Layer by layer, so that one layer's concatenation is all that passes through.
            if fuses_linears(&device) {
                layer.fuse_linears()?;
            }
            layers.push(layer);
        }
        let lm_head = if w.lm_head_tied(cfg) {
            w.tied_lm_head(cfg.vocab_size, hid)?
        } else {
            w.linear(Key::LmHead, None, cfg.vocab_size, hid, false)?
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed: w.embedding(cfg.vocab_size, hid)?,
            layers,
            norm: norm(Key::FinalNorm, None, hid)?,
            lm_head,
            // Llama 3.1's frequency factors; llama.cpp reads them for Llama only.
            rope: Rope::new(
                cfg,
                match cfg.arch {
                    Arch::Llama => w.rope_freqs(cfg.head_dim / 2)?,
                    Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => None,
                },
            ),
            kv_rotation: KvRotation::new(cfg.head_dim, dtype, &device)?,
            device,
            dtype,
            kv_dtype: dtype.into(),
            attention: AttentionBackend::Eager,
        })
    }

    /// Chooses what the KV cache holds, whatever the activations' dtype: f32, f16, bf16,
    /// fp8 (E4M3, unscaled: vLLM's `fp8`) or blocks of llama.cpp's `q8_0`, `q5_1`, `q5_0`,
    /// `q4_1` or `q4_0` (heads of a multiple of 32 values; on CUDA by the kernels of
    /// `kernels/keydiff.cu`), for keys and values alike or each its own ([`KvTypes`]). Keys
    /// and values are rounded or quantized when they are appended, and eviction scores them
    /// as stored. Attention reads the cache in place where it can (the CPU decode kernel: f16,
    /// bf16, fp8 and block rows of one type for both); elsewhere
    /// a cache of another type than the activations is converted (or dequantized) to theirs
    /// for each chunk, a copy of the view.
    pub fn set_kv_dtype(&mut self, kv: impl Into<KvTypes>) -> Result<()> {
        let kv = kv.into();
        kv.check(self.cfg.head_dim)
            .map_err(ModelError::Unsupported)?;
        self.kv_dtype = kv;
        Ok(())
    }

    /// Fuses each layer's q/k/v projections, and a dense MLP's gate and up, into one matmul
    /// each for decode rows ([`crate::weights::FusedLinear`]), where their weights are dense:
    /// the parts become views of one concatenated weight, so no memory is added (unless a
    /// clone made before still holds the parts' old weights). A model loaded onto a GPU has
    /// them fused already (unless `KEYDIFF_CUDA_FUSE=0`); on the CPU this is for tests.
    /// Returns how many groups it fused.
    pub fn fuse_linears(&mut self) -> Result<usize> {
        let mut n = 0;
        for l in &mut self.layers {
            n += l.fuse_linears()?;
        }
        Ok(n)
    }

    /// What the KV cache holds.
    pub fn kv_dtype(&self) -> KvTypes {
        self.kv_dtype
    }

    /// Turns the Hadamard rotation of quantized caches on (the default, as llama.cpp's) or
    /// off ([`crate::kv_rotation`]): where keys (values) are held in a block type and heads
    /// are a multiple of 64, they are stored rotated. Float caches are never rotated. A cache
    /// follows the setting of the model it runs on: change it only between caches.
    pub fn set_kv_rotation(&mut self, on: bool) -> Result<()> {
        self.kv_rotation = match on {
            true => KvRotation::new(self.cfg.head_dim, self.dtype, &self.device)?,
            false => None,
        };
        Ok(())
    }

    /// Whether this model's caches hold rotated keys or values: the rotation is on, the heads
    /// take it, and the cache type is a block type for keys or values.
    pub fn kv_rotated(&self) -> bool {
        self.kv_rotation.as_ref().is_some_and(|r| {
            let (k, v) = r.for_types(self.kv_dtype);
            k.is_some() || v.is_some()
        })
    }

    /// Chooses how chunk attention is computed, resolving `Auto` for this model, device and
    /// dtype ([`AttentionBackend::resolve`]); fails when this build, device or dtype cannot run
    /// an explicit `backend` (eager always can).
    pub fn set_attention(&mut self, backend: AttentionBackend) -> Result<()> {
        self.attention = backend.resolve(&self.device, self.dtype, self.cfg.head_dim)?;
        Ok(())
    }

    /// Changes the RoPE base or scaling ([`RopeOverride`], llama.cpp's `--rope-*` flags), and
    /// with it the context ([`ModelConfig::context`]).
    pub fn set_rope(&mut self, o: &RopeOverride) -> Result<()> {
        let mut cfg = self.cfg.clone();
        o.apply(&mut cfg)
            .map_err(|e| ModelError::Unsupported(format!("RoPE settings: {e}")))?;
        self.rope = self.rope.rebuilt(&cfg);
        self.cfg = cfg;
        Ok(())
    }

    /// Runs with a shorter context than the model's (see [`ModelConfig::limit_context`]).
    pub fn limit_context(&mut self, n: Option<usize>) -> std::result::Result<(), String> {
        self.cfg.limit_context(n)
    }

    /// The attention backend in use (eager or flash, never `Auto`).
    pub fn attention(&self) -> AttentionBackend {
        self.attention
    }

    /// Allocates the KV cache of a request that will see at most `max_tokens` tokens. With
    /// `full`, it holds `max_tokens` slots per head; with a budget, N + B, or `max_tokens` when
    /// that is less.
    pub fn new_cache(&self, cfg: CacheConfig, max_tokens: usize) -> Result<KvCache> {
        Ok(KvCache::new(
            cfg,
            self.cfg.num_layers,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            max_tokens,
            self.kv_dtype,
            &self.device,
        )?)
    }

    /// Runs the next chunk of tokens (absolute positions continue from `cache.position()`),
    /// appending to `cache`, which may evict after each layer's attention. `decode` marks a
    /// generated token rather than a prompt chunk. Returns the logits of the chunk's last token,
    /// `[vocab]` in f32.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, decode: bool) -> Result<Tensor> {
        let x = self.hidden(tokens, cache, decode)?;
        let b = tokens.len();
        // Only the last row feeds the LM head: [1, hidden]
        let last = self.norm.forward(&x.narrow(0, b - 1, 1)?)?;
        let logits = self.lm_head.forward(&last, !decode)?;
        Ok(logits.squeeze(0)?.to_dtype(DType::F32)?)
    }

    /// [`Model::forward`] for a prompt chunk, returning the logits of every token of the chunk,
    /// `[B, vocab]` in f32 (row i predicts the token after `tokens[i]`): for perplexity.
    pub fn forward_all(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let x = self.hidden(tokens, cache, false)?;
        let logits = self.lm_head.forward(&self.norm.forward(&x)?, true)?;
        Ok(logits.to_dtype(DType::F32)?)
    }

    /// Decode steps over `tokens` in one pass, as a speculative draft is verified: row `i` of
    /// the result is what [`Model::forward`] gives for `tokens[i]` as a decode step after
    /// `tokens[..i]` were decoded one by one, `[len, vocab]` in f32. The linears and the LM
    /// head run once over all rows with the decode weights, so the weights are read once for
    /// all of them; attention runs row by row in each layer: a row appends its key and value,
    /// attends over the cache as it then is and lets the cache evict as a decode step does,
    /// so each row sees the cache token-by-token decoding would give it. Rows differ from
    /// single steps only as a matmul over one row differs from one over several (not at all
    /// for candle's CPU Q8_0; see [`Model::forward_batch`]), and with `exact` not at all:
    /// weights whose kernel computes several rows otherwise than one run row by row
    /// ([`Pass::DecodeRows`]). The cache can take back the last rows with
    /// [`KvCache::rewind`] when none of them evicted ([`KvCache::draft_room`]).
    pub fn forward_decode_rows(
        &self,
        tokens: &[u32],
        mut cache: &mut KvCache,
        exact: bool,
    ) -> Result<Tensor> {
        rows_evicting_per_layer(std::slice::from_mut(&mut cache), &[tokens.len()], |c| {
            self.decode_rows_pass(tokens, c[0], exact)
        })
    }

    /// [`Model::forward_decode_rows`], with the cache evicting as it is set to.
    fn decode_rows_pass(&self, tokens: &[u32], cache: &mut KvCache, exact: bool) -> Result<Tensor> {
        let pass = if exact {
            Pass::DecodeRows
        } else {
            Pass::Decode
        };
        let (pos0, b) = (cache.position(), tokens.len());
        // [B, hidden]
        let (mut x, cos_sin) = self.embed_chunk(tokens, cache)?;
        let mut clock = Clock::new(cache.profiling(), &self.device)?;
        // The MLP's output, added to x by the next layer's norm (or after the last).
        let mut pending = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.add_forward(&mut x, pending.take())?;
            let (q, k, v) = layer.attn.qkv(&h, &self.rope, &cos_sin, pass)?;
            let mut ys = Vec::with_capacity(b);
            for i in 0..b {
                ys.push(layer.attn.attend_cached(
                    &q.narrow(2, i, 1)?.contiguous()?,
                    &k.narrow(1, i, 1)?.contiguous()?,
                    &v.narrow(1, i, 1)?.contiguous()?,
                    None,
                    cache,
                    li,
                    pos0 + i,
                    true,
                    self.attention,
                    self.kv_rotation.as_ref(),
                    &mut clock,
                )?);
            }
            let y = match ys.len() {
                1 => ys.pop().expect("one row"),
                _ => Tensor::cat(&ys, 0)?,
            };
            let h = layer.attn.o.forward(&y, pass)?;
            clock.lap(cache, Region::Attention)?;
            let h = layer.mlp_norm.add_forward(&mut x, Some(h))?;
            pending = Some(layer.mlp.forward(&h, pass)?);
            clock.lap(cache, Region::Mlp)?;
        }
        cache.advance(b);
        let logits = self
            .lm_head
            .forward(&self.norm.add_forward(&mut x, pending)?, pass)?;
        Ok(logits.to_dtype(DType::F32)?)
    }

    /// One decode step of several sequences at once: `tokens[i]` is the next token of the
    /// sequence whose cache is `caches[i]` (each at its own position, under its own budget).
    /// The linears and the LM head run once over the `[n, hidden]` rows, so their weights are
    /// read once for all sequences; attention, and each cache's eviction, run per sequence.
    /// Returns the next-token logits, `[n, vocab]` in f32: row `i` is what [`Model::forward`]
    /// gives for `tokens[i]` on `caches[i]` alone, up to the difference between a matmul over
    /// one row and over several (none for candle's CPU Q8_0; the last bits for dense GEMMs;
    /// more where candle picks another kernel for several rows, as its x86 Q6K does).
    pub fn forward_batch(&self, tokens: &[u32], caches: &mut [&mut KvCache]) -> Result<Tensor> {
        let segments: Vec<Segment<'_>> = tokens
            .iter()
            .map(|t| Segment {
                tokens: std::slice::from_ref(t),
                decode: true,
                logits: Logits::Last,
            })
            .collect();
        let rows = self
            .forward_segments(&segments, caches)?
            .into_iter()
            .map(|l| l.ok_or_else(|| ModelError::Shape("a decode row without logits".into())))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// One pass over several sequences' segments: `segments[i]` continues the sequence whose
    /// cache is `caches[i]` (a prompt chunk, or a generated token), so prompt chunks of
    /// requests joining a batch run in the same pass as the running requests' decode steps
    /// (chunked prefill mixed with decode, as llama.cpp's server and vLLM do). Embedding,
    /// norms, Q/K/V/O, MLP and LM head run over all rows; attention, and each cache's append
    /// and eviction, run per segment, exactly as [`Model::forward`] runs them for that chunk.
    /// Returns each segment's logits as it asked ([`Logits`]): `[1, vocab]` or `[len, vocab]`
    /// in f32.
    ///
    /// On the CPU the linears run over each prompt chunk alone and over consecutive decode
    /// rows together, each with the weights [`Model::forward`] would use (a dense prefill
    /// copy, a decode copy): a prompt chunk's rows are what it gets alone, bit for bit, and
    /// decode rows are as in [`Model::forward_batch`]. On a GPU they run once over all rows.
    pub fn forward_segments(
        &self,
        segments: &[Segment<'_>],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<Option<Tensor>>> {
        // Decode rows are attended one after the other in each layer.
        let rows: Vec<usize> = segments
            .iter()
            .map(|s| if s.decode { s.tokens.len() } else { 1 })
            .collect();
        rows_evicting_per_layer(caches, &rows, |c| self.segments_pass(segments, c))
    }

    /// [`Model::forward_segments`], with each cache evicting as it is set to.
    fn segments_pass(
        &self,
        segments: &[Segment<'_>],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<Option<Tensor>>> {
        let n = segments.len();
        if n == 0 || caches.len() != n {
            return Err(ModelError::Shape(format!(
                "a pass over {n} segments for {} caches",
                caches.len()
            )));
        }
        if let Some(s) = segments.iter().find(|s| s.tokens.is_empty()) {
            return Err(ModelError::Shape(format!(
                "an empty {} segment",
                if s.decode { "decode" } else { "prompt" },
            )));
        }
        if let Some(c) = caches.iter().find(|c| c.num_layers() != self.layers.len()) {
            return Err(ModelError::Shape(format!(
                "{} layer caches for {} layers",
                c.num_layers(),
                self.layers.len()
            )));
        }
        let pos0: Vec<usize> = caches.iter().map(|c| c.position()).collect();
        let mut offsets = Vec::with_capacity(n);
        let (mut ids, mut positions) = (Vec::new(), Vec::new());
        for (s, &p) in segments.iter().zip(&pos0) {
            offsets.push(ids.len());
            ids.extend_from_slice(s.tokens);
            positions.extend(p..p + s.tokens.len());
        }
        // Runs of segments whose linears run together: on the CPU, consecutive decode rows,
        // and each prompt chunk alone (a dense GEMM's rounding depends on its row count:
        // alone, a chunk is computed as in a single request); on a GPU, where prefill and
        // decode weights are the same, all rows.
        let mut runs: Vec<Run> = Vec::new();
        for (i, s) in segments.iter().enumerate() {
            let pf = !s.decode;
            match runs.last_mut() {
                Some(r) if (!r.pf && !pf) || !self.device.is_cpu() => {
                    r.segs.end = i + 1;
                    r.rows.1 += s.tokens.len();
                    r.pf |= pf;
                }
                _ => runs.push(Run {
                    segs: i..i + 1,
                    rows: (offsets[i], s.tokens.len()),
                    pf,
                }),
            }
        }
        let cos_sin: Vec<(Tensor, Tensor)> = runs
            .iter()
            .map(|r| {
                let (at, len) = r.rows;
                self.rope.cos_sin_at(
                    positions[at..at + len].iter().copied(),
                    self.dtype,
                    &self.device,
                )
            })
            .collect::<Result<_>>()?;
        // A linear (or the MLP) over each run's rows with that run's weights.
        let by_run = |x: &Tensor, f: &dyn Fn(&Tensor, bool) -> Result<Tensor>| -> Result<Tensor> {
            if let [r] = runs.as_slice() {
                return f(x, r.pf);
            }
            let parts = runs
                .iter()
                .map(|r| f(&x.narrow(0, r.rows.0, r.rows.1)?, r.pf))
                .collect::<Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        };
        // The flash kernels mask by index; only eager attention adds a mask tensor.
        let masks = segments
            .iter()
            .zip(caches.iter())
            .map(|(s, c)| {
                let b = s.tokens.len();
                if b > 1 && !s.decode && self.attention != AttentionBackend::Flash {
                    Ok(Some(chunk_mask(b, c.len() + b, self.dtype, &self.device)?))
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let ids = Tensor::new(ids.as_slice(), &self.device)?;
        // [rows, hidden]
        let mut x = self.embed.forward(&ids, self.dtype)?;
        // Profiling is per request; a pass over several is not profiled.
        let mut clock = Clock::new(false, &self.device)?;
        // The MLP's output, added to x by the next layer's norm (or after the last).
        let mut pending = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.add_forward(&mut x, pending.take())?;
            let mut qkv = Vec::with_capacity(runs.len());
            for (r, cs) in runs.iter().zip(&cos_sin) {
                let h = match runs.len() {
                    1 => h.clone(),
                    _ => h.narrow(0, r.rows.0, r.rows.1)?,
                };
                qkv.push(layer.attn.qkv(&h, &self.rope, cs, r.pf)?);
            }
            let (q, k, v) = match qkv.len() {
                1 => qkv.pop().expect("one run"),
                _ => {
                    let cat = |d: usize, f: fn(&(Tensor, Tensor, Tensor)) -> &Tensor| {
                        Tensor::cat(&qkv.iter().map(f).collect::<Vec<_>>(), d)
                    };
                    (cat(2, |t| &t.0)?, cat(1, |t| &t.1)?, cat(1, |t| &t.2)?)
                }
            };
            let mut ys = Vec::with_capacity(n);
            for (i, cache) in caches.iter_mut().enumerate() {
                let (at, b) = (offsets[i], segments[i].tokens.len());
                // Decode rows one at a time, each a decode step; a prompt chunk at once.
                let steps = match segments[i].decode {
                    true => (0..b).map(|r| (at + r, 1, pos0[i] + r)).collect(),
                    false => vec![(at, b, pos0[i])],
                };
                for (from, len, pos) in steps {
                    ys.push(layer.attn.attend_cached(
                        &q.narrow(2, from, len)?.contiguous()?,
                        &k.narrow(1, from, len)?.contiguous()?,
                        &v.narrow(1, from, len)?.contiguous()?,
                        masks[i].as_ref(),
                        cache,
                        li,
                        pos,
                        segments[i].decode,
                        self.attention,
                        self.kv_rotation.as_ref(),
                        &mut clock,
                    )?);
                }
            }
            let y = match ys.len() {
                1 => ys.pop().expect("one segment"),
                _ => Tensor::cat(&ys, 0)?,
            };
            let h = by_run(&y, &|y, pf| layer.attn.o.forward(y, pf))?;
            let h = layer.mlp_norm.add_forward(&mut x, Some(h))?;
            pending = Some(by_run(&h, &|h, pf| layer.mlp.forward(h, pf))?);
        }
        if let Some(r) = pending {
            x = (x + r)?;
        }
        for (c, s) in caches.iter_mut().zip(segments) {
            c.advance(s.tokens.len());
        }
        // The LM head over the rows asked for, run by run.
        let mut out = vec![None; n];
        for r in &runs {
            let mut picks = Vec::new();
            let mut who = Vec::new();
            for i in r.segs.clone() {
                let (at, b) = (offsets[i], segments[i].tokens.len());
                let (from, len) = match segments[i].logits {
                    Logits::None => continue,
                    Logits::Last => (at + b - 1, 1),
                    Logits::All => (at, b),
                };
                picks.push(x.narrow(0, from, len)?);
                who.push((i, len));
            }
            if picks.is_empty() {
                continue;
            }
            let rows = match picks.len() {
                1 => picks.pop().expect("one"),
                _ => Tensor::cat(&picks, 0)?,
            };
            let logits = self
                .lm_head
                .forward(&self.norm.forward(&rows)?, r.pf)?
                .to_dtype(DType::F32)?;
            let mut at = 0;
            for (i, len) in who {
                out[i] = Some(logits.narrow(0, at, len)?);
                at += len;
            }
        }
        Ok(out)
    }

    /// A chunk's embeddings, `[B, hidden]`, and its RoPE tables from the cache's position,
    /// after checking the chunk and the cache against the model.
    fn embed_chunk(&self, tokens: &[u32], cache: &KvCache) -> Result<(Tensor, (Tensor, Tensor))> {
        if tokens.is_empty() {
            return Err(ModelError::Shape("empty chunk".into()));
        }
        if cache.num_layers() != self.layers.len() {
            return Err(ModelError::Shape(format!(
                "{} layer caches for {} layers",
                cache.num_layers(),
                self.layers.len()
            )));
        }
        let ids = Tensor::new(tokens, &self.device)?;
        let x = self.embed.forward(&ids, self.dtype)?;
        let cos_sin =
            self.rope
                .cos_sin(cache.position(), tokens.len(), self.dtype, &self.device)?;
        Ok((x, cos_sin))
    }

    /// The layers over a chunk: its hidden states before the final norm, `[B, hidden]`.
    fn hidden(&self, tokens: &[u32], cache: &mut KvCache, decode: bool) -> Result<Tensor> {
        let (pos0, b) = (cache.position(), tokens.len());
        // [B, hidden]
        let (mut x, cos_sin) = self.embed_chunk(tokens, cache)?;
        let total = cache.len() + b;
        // The flash kernels mask by index; only eager attention adds a mask tensor.
        let mask = if b > 1 && self.attention != AttentionBackend::Flash {
            Some(chunk_mask(b, total, self.dtype, &self.device)?)
        } else {
            None
        };
        let mut clock = Clock::new(cache.profiling(), &self.device)?;
        // The MLP's output, added to x by the next layer's norm (or after the last).
        let mut pending = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.add_forward(&mut x, pending.take())?;
            let h = layer.attn.forward(
                &h,
                &self.rope,
                &cos_sin,
                mask.as_ref(),
                cache,
                li,
                pos0,
                decode,
                self.attention,
                self.kv_rotation.as_ref(),
                &mut clock,
            )?;
            let h = layer.mlp_norm.add_forward(&mut x, Some(h))?;
            pending = Some(layer.mlp.forward(&h, !decode)?);
            clock.lap(cache, Region::Mlp)?;
        }
        if let Some(r) = pending {
            x = (x + r)?;
        }
        cache.advance(b);
        Ok(x)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Compute dtype of the activations (the KV cache's may differ: [`Model::kv_dtype`]).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Linears of layer 0 (a mixture's router and first expert) and the LM head by role, for
    /// `keydiff info`.
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let l = &self.layers[0];
        let mut v = vec![
            ("attn_q", &l.attn.q),
            ("attn_k", &l.attn.k),
            ("attn_v", &l.attn.v),
            ("attn_output", &l.attn.o),
        ];
        match &l.mlp {
            Ffn::Mlp(m) => v.extend([
                ("ffn_gate", &m.gate),
                ("ffn_up", &m.up),
                ("ffn_down", &m.down),
            ]),
            Ffn::Moe(m) => v.extend([
                ("ffn_gate_inp", &m.router),
                ("ffn_gate_exps", &m.experts[0].gate),
                ("ffn_up_exps", &m.experts[0].up),
                ("ffn_down_exps", &m.experts[0].down),
            ]),
        }
        v.push(("lm_head", &self.lm_head));
        v
    }

    /// Host or device bytes held by the weights (with CPU copies; see
    /// [`crate::weights::Weights::plan`], which predicts this before loading).
    pub fn weight_bytes(&self) -> u64 {
        use crate::weights::tensor_bytes;
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                [&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o]
                    .into_iter()
                    .chain(l.mlp.linears())
                    .map(Linear::bytes)
                    .sum::<u64>()
                    + tensor_bytes(&l.attn_norm.w)
                    + tensor_bytes(&l.mlp_norm.w)
                    + l.attn
                        .qk_norm
                        .as_ref()
                        .map_or(0, |(q, k)| tensor_bytes(&q.w) + tensor_bytes(&k.w))
            })
            .sum();
        layers + self.embed.bytes() + tensor_bytes(&self.norm.w) + self.lm_head.bytes()
    }

    /// Checkpoint weight types by role (e.g. `attn_q: Q4_1`).
    pub fn weight_kinds(&self) -> Vec<(&'static str, String)> {
        self.linears().iter().map(|(n, l)| (*n, l.kind())).collect()
    }

    /// What runs by role (e.g. `attn_q: decode Q8_0, prefill F32` on the CPU).
    pub fn runtime_kinds(&self) -> Vec<(&'static str, String)> {
        self.linears()
            .iter()
            .map(|(n, l)| (*n, l.runtime_kind()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_the_top_k_and_renormalises() {
        let probs = vec![
            vec![0.1, 0.5, 0.3, 0.1],
            // A tie for second place: the lower index wins.
            vec![0.4, 0.2, 0.2, 0.2],
        ];
        let (rows, weights) = route(&probs, 2, true);
        assert_eq!(rows, vec![vec![1], vec![0, 1], vec![0], vec![]]);
        let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
        assert!(close(weights[1][0], 0.5 / 0.8) && close(weights[2][0], 0.3 / 0.8));
        assert!(close(weights[0][0], 0.4 / 0.6) && close(weights[1][1], 0.2 / 0.6));
        // Without renormalisation the probabilities stand; with k = n every expert runs.
        let (_, weights) = route(&probs, 2, false);
        assert_eq!(weights[1], vec![0.5, 0.2]);
        let (rows, _) = route(&probs, 4, true);
        assert!(rows.iter().all(|r| r == &vec![0, 1]));
    }

    /// The mixture (experts run over gathered rows, outputs scattered back) against running
    /// every expert on every row and summing the chosen ones row by row.
    #[test]
    fn mixture_matches_a_dense_reference() -> Result<()> {
        let (hid, ff, n, k, rows) = (16, 8, 6, 2, 9);
        let dev = Device::Cpu;
        let w = Weights::random(&dev, DType::F32, 7, true)?;
        let (gate, up, down) = (
            w.experts(Key::GateExps, 0, n, ff, hid)?,
            w.experts(Key::UpExps, 0, n, ff, hid)?,
            w.experts(Key::DownExps, 0, n, hid, ff)?,
        );
        let experts: Vec<Mlp> = gate
            .into_iter()
            .zip(up)
            .zip(down)
            .map(|((gate, up), down)| Mlp {
                gate,
                up,
                down,
                gate_up: None,
            })
            .collect();
        // Its probabilities are computed the same way here, so near-ties choose alike.
        let router = w.linear(Key::Router, Some(0), n, hid, false)?;
        let x = Tensor::randn(0f32, 1.0, (rows, hid), &dev)?;
        for norm in [true, false] {
            let moe = Moe {
                router: router.clone(),
                experts: experts.clone(),
                top_k: k,
                norm_topk_prob: norm,
            };
            let got = moe.forward(&x, true)?.to_vec2::<f32>()?;
            let probs = candle_nn::ops::softmax_last_dim(&moe.router.forward(&x, true)?)?
                .to_vec2::<f32>()?;
            let all: Vec<Vec<Vec<f32>>> = experts
                .iter()
                .map(|e| Ok(e.forward(&x, true)?.to_vec2::<f32>()?))
                .collect::<Result<_>>()?;
            let mut used = vec![false; n];
            for r in 0..rows {
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| probs[r][b].total_cmp(&probs[r][a]));
                let total: f32 = order[..k].iter().map(|&e| probs[r][e]).sum();
                for c in 0..hid {
                    let want: f32 = order[..k]
                        .iter()
                        .map(|&e| {
                            used[e] = true;
                            let w = if norm {
                                probs[r][e] / total
                            } else {
                                probs[r][e]
                            };
                            w * all[e][r][c]
                        })
                        .sum();
                    assert!(
                        (got[r][c] - want).abs() < 1e-5,
                        "row {r} col {c}: {} vs {want}",
                        got[r][c]
                    );
                }
            }
            // The rows spread over several experts, not one.
            assert!(used.iter().filter(|&&u| u).count() > k);
        }
        Ok(())
    }
}
