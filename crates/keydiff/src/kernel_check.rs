//! Kernel parity and speed: the eviction ops (fused KeyDiff scoring, selection with its move
//! plan, slot moves) on a device against their CPU references, and their throughput against the
//! device's measured copy bandwidth.
//!
//! `keydiff check-kernels` runs both; `scripts/gpu-check.sh` records them on a GPU; the tests run
//! the parity on every device the build has. On the CPU the "device" ops are the twins
//! themselves, so there the check is of the twins against the references (candle ops, a sort).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use keydiff_cache::policy::{
    keydiff_scores, keydiff_scores_fused, keydiff_scores_fused_with, vector_loads_fit,
    PoolByPosition,
};
pub use keydiff_cache::policy::{ScoreLoads, VECTOR_HEAD_DIMS};
use keydiff_cache::select::{move_plan, plan_tensor, select, ApplyPlan, SelectPlan};
pub use keydiff_cache::select::{select_few_fits, SelectBlocks};
use keydiff_cache::{Anchor, KvType};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::error::Result;
use crate::sampling::DrawParams;

/// Largest |score difference| accepted between a device and the references: scores are
/// computed in f32 from the same (dtype-rounded) keys, so only the summation order differs.
pub const SCORE_TOL: f32 = 1e-4;

/// One shape of the eviction ops.
#[derive(Debug, Clone, Copy)]
pub struct KernelCase {
    pub kv_heads: usize,
    /// Used slots per head (N + B at eviction time).
    pub n: usize,
    pub head_dim: usize,
    pub dtype: DType,
    pub budget: usize,
    pub sinks: usize,
    pub recent: usize,
    pub anchor: Anchor,
}

/// The parity cases: odd sizes, every head dim (64/128/256) and dtype, protected slots, both
/// anchors; with `large`, also n = 131072 + 128 (past candle's argsort limit of 8192 anyway
/// at 8320), and in bf16 256 heads of 8320 slots (Llama-3.1-8B's layers evicting together).
pub fn kernel_cases(large: bool) -> Vec<KernelCase> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let case = |kv_heads, n, head_dim, budget, sinks, recent, anchor| KernelCase {
            kv_heads,
            n,
            head_dim,
            dtype,
            budget,
            sinks,
            recent,
            anchor,
        };
        out.push(case(2, 1029, 64, 700, 4, 100, Anchor::Normalized));
        out.push(case(3, 8320, 128, 8192, 4, 1638, Anchor::Normalized));
        out.push(case(2, 517, 256, 300, 0, 0, Anchor::Mean));
        out.push(case(1, 129, 128, 1, 0, 0, Anchor::Normalized));
        if large {
            out.push(case(
                2,
                131_072 + 128,
                128,
                131_072,
                4,
                0,
                Anchor::Normalized,
            ));
            if dtype == DType::BF16 {
                // 32 layers of 8 KV heads at once, as the cache's stack evicts them.
                out.push(case(256, 8320, 128, 8192, 4, 64, Anchor::Normalized));
            }
        }
    }
    out
}

/// How a device's eviction ops compare with the CPU references on one case.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelParity {
    pub device: String,
    pub dtype: String,
    pub kv_heads: usize,
    pub n: usize,
    pub head_dim: usize,
    pub budget: usize,
    pub sinks: usize,
    pub recent: usize,
    pub anchor: String,
    /// Device scores against candle ops on the CPU (f32, same rounded keys).
    pub score_max_abs_vs_reference: f32,
    /// Device scores against the CPU twin of the fused op (the engine's kernels: 16-byte loads
    /// where the view takes them).
    pub score_max_abs_vs_twin: f32,
    /// The same with the scalar-load kernels (any view), which the engine runs otherwise.
    pub score_max_abs_scalar_vs_twin: f32,
    /// Heads whose plan (from the same scores) differs from the sorted reference's: the
    /// one-block-per-head selection, the many-block one, and the one-launch selection of few
    /// evictions (`None` where the case has too many for it: the engine runs `Many` there).
    pub plan_heads_differing: usize,
    pub plan_heads_differing_many: usize,
    pub plan_heads_differing_few: Option<usize>,
    /// Slots kept by one and not the other when each side selects from its own scores.
    pub end_to_end_slots_differing: usize,
    /// Every such slot's reference score is within 2·error + 1e-6 of its head's marginal
    /// score: the difference is a near tie, not a bug.
    pub end_to_end_ties_only: bool,
    /// K, positions and state after the device moves equal the CPU moves, bit for bit.
    pub moves_equal: bool,
    /// SnapKV's pooling along positions (shuffled, with gaps) against the CPU op.
    pub snapkv_pool_max_abs: f32,
    pub pass: bool,
}

fn anchor_name(a: Anchor) -> &'static str {
    match a {
        Anchor::Normalized => "normalized",
        Anchor::Mean => "mean",
    }
}

/// Keys shaped like a model's: a large per-head mean direction plus noise and a few outliers,
/// `[kv, cap, d]` f32 on the CPU.
fn random_keys(kv: usize, cap: usize, d: usize, rng: &mut StdRng) -> Result<Tensor> {
    let mut xs = Vec::with_capacity(kv * cap * d);
    for _ in 0..kv {
        let mean: Vec<f32> = (0..d).map(|_| rng.random_range(-2.0..2.0)).collect();
        for _ in 0..cap {
            let outlier = rng.random_bool(0.01);
            for m in &mean {
                let noise: f32 = rng.random_range(-1.0..1.0);
                xs.push(if outlier { -m + 3.0 * noise } else { m + noise });
            }
        }
    }
    Ok(Tensor::from_vec(xs, (kv, cap, d), &Device::Cpu)?)
}

/// Keys like [`random_keys`]' (a mean per head, uniform noise, 1% outliers pointing away)
/// drawn on `device` in `dtype`, eight heads at a time: the timed evictions of every layer at
/// once take billions of values, which the host would draw slowly and hold in f32.
fn device_keys(kv: usize, n: usize, d: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let keys = Tensor::zeros((kv, n, d), dtype, device)?;
    let mut h0 = 0;
    while h0 < kv {
        let g = 8.min(kv - h0);
        let mean = Tensor::rand(-2f32, 2f32, (g, 1, d), device)?;
        let noise = Tensor::rand(-1f32, 1f32, (g, n, d), device)?;
        let outlier = Tensor::rand(0f32, 1f32, (g, n, 1), device)?
            .lt(0.01)?
            .broadcast_as((g, n, d))?;
        let usual = noise.broadcast_add(&mean)?;
        let away = (noise * 3.0)?.broadcast_sub(&mean)?;
        let group = outlier.where_cond(&away, &usual)?.to_dtype(dtype)?;
        keys.slice_set(&group, 0, h0)?;
        h0 += g;
    }
    Ok(keys)
}

/// Unique positions per head, shuffled (slot order after evictions), with gaps: `[kv, n]`.
fn random_positions(kv: usize, n: usize, rng: &mut StdRng) -> Vec<u32> {
    let mut out = Vec::with_capacity(kv * n);
    for _ in 0..kv {
        let mut p: Vec<u32> = (0..n as u32).map(|i| i * 2 + (i % 3 == 0) as u32).collect();
        p.shuffle(rng);
        out.extend(p);
    }
    out
}

fn max_abs(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(
            0f32,
            |m, x| if x.is_nan() { f32::INFINITY } else { m.max(x) },
        )
}

fn plan_rows(plan: &Tensor) -> Result<Vec<Vec<(u32, u32)>>> {
    let rows = plan.to_device(&Device::Cpu)?.to_vec2::<u32>()?;
    Ok(rows
        .iter()
        .map(|r| {
            let m = (r.len() - 1) / 2;
            (0..r[0] as usize)
                .map(|i| (r[1 + i], r[1 + m + i]))
                .collect()
        })
        .collect())
}

/// Runs one parity case on `device` (seeded).
pub fn kernel_parity(device: &Device, c: &KernelCase, seed: u64) -> Result<KernelParity> {
    let cpu = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(seed);
    // A strided view, as the cache's [kv, N + B, d] buffer gives.
    let cap = c.n + 3;
    let keys = random_keys(c.kv_heads, cap, c.head_dim, &mut rng)?;
    let keys_dev = keys.to_dtype(c.dtype)?.to_device(device)?;
    let keys_ref = keys_dev.to_device(&cpu)?.to_dtype(DType::F32)?;
    let view_ref = keys_ref.narrow(1, 0, c.n)?;
    let s_ref = keydiff_scores(&view_ref, c.anchor)?.to_vec2::<f32>()?;
    let twin = keydiff_scores_fused(&view_ref, c.anchor)?;
    let s_twin = twin.to_vec2::<f32>()?;
    let device_scores = |loads| -> Result<Vec<Vec<f32>>> {
        Ok(
            keydiff_scores_fused_with(&keys_dev.narrow(1, 0, c.n)?, c.anchor, loads)?
                .to_device(&cpu)?
                .to_vec2::<f32>()?,
        )
    };
    let s_dev = device_scores(ScoreLoads::Auto)?;
    let err_ref = max_abs(&s_dev, &s_ref);
    let err_twin = max_abs(&s_dev, &s_twin);
    let err_scalar = max_abs(&device_scores(ScoreLoads::Scalar)?, &s_twin);

    let pos = random_positions(c.kv_heads, c.n, &mut rng);
    let pos_of = |h: usize| &pos[h * c.n..(h + 1) * c.n];
    let pos_dev = Tensor::from_vec(pos.clone(), (c.kv_heads, c.n), device)?;
    let op_with = |blocks| SelectPlan {
        budget: c.budget,
        sinks: c.sinks,
        recent: c.recent,
        blocks,
    };
    let op = op_with(SelectBlocks::Auto);
    // The same scores on both sides: plans must be identical, whichever way the device splits
    // the selection.
    let keep_ref: Vec<Vec<bool>> = (0..c.kv_heads)
        .map(|h| select(&s_twin[h], pos_of(h), c.budget, c.sinks, c.recent))
        .collect();
    let plans_ref: Vec<Vec<(u32, u32)>> = keep_ref.iter().map(|k| move_plan(k, c.budget)).collect();
    let twin_dev = twin.to_device(device)?;
    let differing = |blocks| -> Result<usize> {
        let plans_dev = plan_rows(&twin_dev.apply_op2_no_bwd(&pos_dev, &op_with(blocks))?)?;
        Ok(plans_ref
            .iter()
            .zip(&plans_dev)
            .filter(|(a, b)| a != b)
            .count())
    };
    let plan_heads_differing = differing(SelectBlocks::One)?;
    let plan_heads_differing_many = differing(SelectBlocks::Many)?;
    let plan_heads_differing_few = if select_few_fits(c.n, c.budget, c.recent) {
        Some(differing(SelectBlocks::Few)?)
    } else {
        None
    };

    // End to end: each side selects from its own scores.
    let e2e_plan = Tensor::new(s_dev.clone(), &cpu)?
        .to_device(device)?
        .apply_op2_no_bwd(&pos_dev, &op)?;
    let e2e_dev = plan_rows(&e2e_plan)?;
    let mut differing = 0;
    let mut ties_only = true;
    let tol = 2.0 * err_ref + 1e-6;
    for h in 0..c.kv_heads {
        let keep_r = select(&s_ref[h], pos_of(h), c.budget, c.sinks, c.recent);
        let mut keep_d: Vec<bool> = (0..c.n).map(|i| i < c.budget).collect();
        for &(s, d) in &e2e_dev[h] {
            keep_d[s as usize] = true;
            keep_d[d as usize] = false;
        }
        let recent_min = {
            let mut p = pos_of(h).to_vec();
            p.sort_unstable();
            if c.recent > 0 {
                p[c.n - c.recent]
            } else {
                u32::MAX
            }
        };
        let protected = |i: usize| {
            let p = pos_of(h)[i];
            (p as usize) < c.sinks || p >= recent_min
        };
        let marginal = (0..c.n)
            .filter(|&i| keep_r[i] && !protected(i))
            .map(|i| s_ref[h][i])
            .fold(f32::INFINITY, f32::min);
        for i in 0..c.n {
            if keep_r[i] != keep_d[i] {
                differing += 1;
                if (s_ref[h][i] - marginal).abs() > tol {
                    ties_only = false;
                }
            }
        }
    }

    // Moves: the reference plans applied on both sides to K, positions and state.
    let state: Vec<f32> = (0..c.kv_heads * c.n)
        .map(|_| rng.random_range(0.0..1.0))
        .collect();
    let run_moves = |dev: &Device| -> Result<(Vec<f32>, Vec<u32>, Vec<f32>)> {
        let plan = plan_tensor(&plans_ref, dev)?;
        let k = keys_dev.narrow(1, 0, c.n)?.to_device(dev)?.contiguous()?;
        let p = Tensor::from_vec(pos.clone(), (c.kv_heads, c.n), dev)?;
        let s = Tensor::from_vec(state.clone(), (c.kv_heads, c.n), dev)?;
        for t in [&k, &p, &s] {
            t.inplace_op2(&plan, &ApplyPlan)?;
        }
        Ok((
            k.to_device(&cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?,
            p.to_device(&cpu)?.flatten_all()?.to_vec1()?,
            s.to_device(&cpu)?.flatten_all()?.to_vec1()?,
        ))
    };
    let (kd, pd, sd) = run_moves(device)?;
    let (kc, pc, sc) = run_moves(&cpu)?;
    let moves_equal = kd == kc && pd == pc && sd == sc;

    // SnapKV pooling: the same stats and positions on both sides.
    let span = pos.iter().copied().max().unwrap_or(0) as usize + 1;
    let pool = PoolByPosition { span };
    let stats = Tensor::from_vec(state.clone(), (c.kv_heads, c.n), &cpu)?;
    let pos_cpu = Tensor::from_vec(pos.clone(), (c.kv_heads, c.n), &cpu)?;
    let pooled_cpu = stats.apply_op2_no_bwd(&pos_cpu, &pool)?.to_vec2::<f32>()?;
    let pooled_dev = stats
        .to_device(device)?
        .apply_op2_no_bwd(&pos_dev, &pool)?
        .to_device(&cpu)?
        .to_vec2::<f32>()?;
    let pool_err = max_abs(&pooled_dev, &pooled_cpu);

    let pass = err_ref <= SCORE_TOL
        && err_twin <= SCORE_TOL
        && err_scalar <= SCORE_TOL
        && plan_heads_differing == 0
        && plan_heads_differing_many == 0
        && plan_heads_differing_few.unwrap_or(0) == 0
        && ties_only
        && moves_equal
        && pool_err <= 1e-6;
    Ok(KernelParity {
        device: format!("{device:?}"),
        dtype: c.dtype.as_str().to_string(),
        kv_heads: c.kv_heads,
        n: c.n,
        head_dim: c.head_dim,
        budget: c.budget,
        sinks: c.sinks,
        recent: c.recent,
        anchor: anchor_name(c.anchor).to_string(),
        score_max_abs_vs_reference: err_ref,
        score_max_abs_vs_twin: err_twin,
        score_max_abs_scalar_vs_twin: err_scalar,
        plan_heads_differing,
        plan_heads_differing_many,
        plan_heads_differing_few,
        end_to_end_slots_differing: differing,
        end_to_end_ties_only: ties_only,
        moves_equal,
        snapkv_pool_max_abs: pool_err,
        pass,
    })
}

/// One case of the KV cache codecs on a device against the CPU: a cache type's encoding
/// (llama.cpp's blocks, or fp8) of a strided `[kv, n, d]` view, and the decoding of a used
/// view of the encoded buffer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CodecParity {
    pub kv_type: String,
    pub dtype: String,
    pub kv_heads: usize,
    pub n: usize,
    pub head_dim: usize,
    /// Bytes of the device's encoding that differ from the CPU's (0: the kernels are the CPU
    /// codec's twins).
    pub bytes_differing: usize,
    pub bytes: usize,
    /// Largest |device − CPU| of the decoded values of the same bytes (0 expected).
    pub decoded_max_abs: f32,
    /// Values of the same bytes read for attention in the case's dtype
    /// (`KvType::decode_as`: on CUDA the kernel writes that dtype) that differ from the CPU's
    /// decoding cast to it, bit for bit (0 expected).
    pub decoded_as_differing: usize,
    pub pass: bool,
}

/// The cache codecs' cases: every block type and fp8, from f32, f16 and bf16, on an odd shape
/// and one of n > 8192.
pub fn codec_cases() -> Vec<(KvType, DType, usize, usize, usize)> {
    let mut out = Vec::new();
    for t in KvType::BLOCKS
        .into_iter()
        .chain([KvType::Float(DType::F8E4M3)])
    {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            out.push((t, dt, 3, 37, 64));
            out.push((t, dt, 2, 8197, 128));
        }
    }
    out
}

/// Encodes the same values with `t` on `device` and on the CPU (a view: rows inside a wider
/// buffer, heads transposed out of `[n, kv, d]` as attention's keys come), compares the bytes,
/// then decodes a used view (all but the last 3 slots) of the device's buffer on both.
pub fn codec_parity(
    device: &Device,
    (t, dtype, kv, n, d): (KvType, DType, usize, usize, usize),
    seed: u64,
) -> Result<CodecParity> {
    let mut rng = StdRng::seed_from_u64(seed);
    // Magnitudes from 1e-3 to 300 (fp8 saturates past 448), one per block of 32.
    let vals: Vec<f32> = (0..n * kv * (d + 32))
        .map(|i| {
            let z = rng.sample::<f32, _>(rand_distr::StandardNormal);
            z * [1e-3f32, 0.05, 2.0, 300.0][(i / 32) % 4]
        })
        .collect();
    let buf = Tensor::from_vec(vals, (n, kv, d + 32), &Device::Cpu)?.to_dtype(dtype)?;
    // Rows start 16 values into the buffer's (a start offset), heads interleaved.
    let view = |b: &Tensor| -> Result<Tensor> { Ok(b.narrow(2, 16, d)?.transpose(0, 1)?) };
    let cpu = t.encode(&view(&buf)?)?;
    let dev = t.encode(&view(&buf.to_device(device)?)?)?;
    let raw = |x: &Tensor| -> Result<Vec<u8>> {
        let x = x.to_device(&Device::Cpu)?.flatten_all()?;
        Ok(match x.dtype() {
            DType::F8E4M3 => x
                .to_vec1::<float8::F8E4M3>()?
                .iter()
                .map(|c| c.to_bits())
                .collect(),
            _ => x.to_vec1::<u8>()?,
        })
    };
    let (a, b) = (raw(&dev)?, raw(&cpu)?);
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    let used = n - 3;
    let on_dev = t.decode(&dev.narrow(1, 0, used)?, d)?;
    let on_cpu = t.decode(&dev.to_device(&Device::Cpu)?.narrow(1, 0, used)?, d)?;
    let flat = |x: &Tensor| -> Result<Vec<f32>> {
        Ok(x.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let (y, z) = (flat(&on_dev)?, flat(&on_cpu)?);
    let mut err = if y.len() == z.len() {
        0f32
    } else {
        f32::INFINITY
    };
    for (p, q) in y.iter().zip(&z) {
        if !(p.is_nan() && q.is_nan()) {
            err = err.max((p - q).abs());
        }
    }
    // Read in the case's dtype, as attention in that dtype reads the cache.
    let as_dev = flat(&t.decode_as(&dev.narrow(1, 0, used)?, d, dtype)?)?;
    let as_cpu = flat(&on_cpu.to_dtype(dtype)?)?;
    let as_differing = as_dev
        .iter()
        .zip(&as_cpu)
        .filter(|(p, q)| p.to_bits() != q.to_bits() && !(p.is_nan() && q.is_nan()))
        .count()
        + as_dev.len().abs_diff(as_cpu.len());
    Ok(CodecParity {
        kv_type: t.to_string(),
        dtype: dtype.as_str().to_string(),
        kv_heads: kv,
        n,
        head_dim: d,
        bytes_differing: differing,
        bytes: b.len(),
        decoded_max_abs: err,
        decoded_as_differing: as_differing,
        pass: differing == 0 && err == 0.0 && as_differing == 0,
    })
}

/// One case of a decode step's attention by the device's decode kernel (on CUDA
/// `keydiff_decode_<dtype>_<NE>` over a float cache, `keydiff_decode_kvq_*` over blocks or fp8
/// rows, read in place; on the CPU their twins) over the cache as the device encodes it,
/// against the eager path in f32 on the CPU over the same values encoded and decoded by the CPU
/// codec. Nothing of the reference runs on the device, so a device that computes nothing (or
/// wrongly everywhere) fails.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DecodeParity {
    pub kv_type: String,
    /// The queries' dtype, and the output's.
    pub dtype: String,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub keys: usize,
    /// Whether the kernel took the inputs (it must).
    pub ran: bool,
    pub max_abs: f32,
    /// The output's rounding in its dtype, plus f32 sums, scaled by its largest value.
    pub tolerance: f32,
    pub pass: bool,
}

/// The decode cases: float caches in the queries' dtype (the kernel the engine runs over a
/// `--kv-dtype` left at the activations' dtype), every block type and fp8; queries in f32, f16
/// and bf16 on CUDA (the CPU kernel takes f32); (kv, g, d, keys, rows held, first row): views
/// past the buffer's start, one split of the keys and several, head dims 64/128/256 (each
/// kernel's values a lane: 2, 4, 8).
pub fn decode_cases(device: &Device) -> Vec<(KvType, DType, [usize; 6])> {
    let dtypes: &[DType] = if device.is_cuda() {
        &[DType::F32, DType::F16, DType::BF16]
    } else {
        &[DType::F32]
    };
    let mut out = Vec::new();
    for t in [KvType::Float(DType::F32)] // stands for the queries' dtype below
        .into_iter()
        .chain(KvType::BLOCKS)
        .chain([KvType::Float(DType::F8E4M3)])
    {
        for &dt in dtypes {
            let t = match t {
                KvType::Float(DType::F32) => KvType::Float(dt),
                t => t,
            };
            for shape in [
                [2, 3, 128, 300, 320, 7],
                [8, 4, 128, 3000, 3000, 0],
                [1, 8, 64, 700, 720, 5],
                [1, 7, 256, 500, 520, 3],
            ] {
                out.push((t, dt, shape));
            }
        }
    }
    out
}

/// Runs one of [`decode_cases`] on `device`.
pub fn decode_parity(
    device: &Device,
    (t, dtype, [kv, g, d, keys, cap, at]): (KvType, DType, [usize; 6]),
    seed: u64,
) -> Result<DecodeParity> {
    use keydiff_model::attention::{
        attention_output, attention_probs, decode_attention_cpu, decode_attention_cpu_blocks,
        decode_attention_cuda, decode_attention_cuda_kvq,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut normal = |n: usize, scale: f32| -> Result<Tensor> {
        let v: Vec<f32> = (0..n)
            .map(|_| scale * rng.sample::<f32, _>(rand_distr::StandardNormal))
            .collect();
        Ok(Tensor::from_vec(v, n, &Device::Cpu)?)
    };
    // Values on the host; the cache encoded on the device (as the engine writes it) for the
    // kernel, and by the CPU codec for the reference.
    let (k0, v0) = (
        normal(kv * cap * d, 2.0)?.reshape((kv, cap, d))?,
        normal(kv * cap * d, 1.0)?.reshape((kv, cap, d))?,
    );
    let q_cpu = normal(kv * g * d, 1.0)?
        .reshape((kv, g, d))?
        .to_dtype(dtype)?;
    let kb = t.encode(&k0.to_device(device)?)?;
    let vb = t.encode(&v0.to_device(device)?)?;
    let q = q_cpu.to_device(device)?;
    let (k, v) = (kb.narrow(1, at, keys)?, vb.narrow(1, at, keys)?);
    let y = if device.is_cuda() {
        match t {
            KvType::Float(DType::F8E4M3) => decode_attention_cuda_kvq(&q, &k, &v, t)?,
            KvType::Float(_) => decode_attention_cuda(&q, &k, &v)?,
            _ => decode_attention_cuda_kvq(&q, &k, &v, t)?,
        }
    } else {
        match t {
            KvType::Float(_) => decode_attention_cpu(&q, &k, &v, false)?,
            _ => decode_attention_cpu_blocks(&q, &k, &v, t, false)?,
        }
        .map(|(y, _)| y)
    };
    // The reference, on the CPU: the same values through the CPU codec (the device's must give
    // the same bytes: `codec_parity`), and q as the kernel read it.
    let kf = t.decode(&t.encode(&k0)?.narrow(1, at, keys)?, d)?;
    let vf = t.decode(&t.encode(&v0)?.narrow(1, at, keys)?, d)?;
    let want = attention_output(
        &attention_probs(
            &q_cpu.to_dtype(DType::F32)?,
            &kf.to_dtype(DType::F32)?,
            None,
            g,
        )?,
        &vf.to_dtype(DType::F32)?,
    )?;
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-3);
    let tolerance = scale
        * match dtype {
            DType::F16 => 1e-3,
            DType::BF16 => 8e-3,
            _ => 1e-5,
        };
    let (ran, max_abs) = match y {
        Some(y) => (
            true,
            (y.to_device(&Device::Cpu)?.to_dtype(DType::F32)? - &want)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?,
        ),
        None => (false, f32::INFINITY),
    };
    Ok(DecodeParity {
        kv_type: t.to_string(),
        dtype: dtype.as_str().to_string(),
        kv_heads: kv,
        group: g,
        head_dim: d,
        keys,
        ran,
        max_abs,
        tolerance,
        // A NaN fails (not <=).
        pass: ran && max_abs <= tolerance,
    })
}

/// One case of greedy sampling where the logits are (`keydiff_model::model::argmax_rows`; on
/// CUDA `keydiff_argmax_rows_*`) against the host sampler's argmax over the same values.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GreedyParity {
    pub dtype: String,
    pub rows: usize,
    pub vocab: usize,
    /// The rows are a view inside a wider buffer (a row stride past the vocabulary, an offset).
    pub strided: bool,
    /// Rows whose token differs from the host's (0 expected: the same first index of the
    /// largest value, NaNs skipped).
    pub rows_differing: usize,
    pub pass: bool,
}

/// Greedy sampling's cases: f32, f16 and bf16 logits; vocabularies of Qwen 2.5 (151,936),
/// Llama 3 (128,256), an odd one and a few tiny ones; a batch's rows; contiguous rows and views.
pub fn greedy_cases() -> Vec<(DType, usize, usize, bool)> {
    let mut out = Vec::new();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        out.push((dt, 6, 151_936, false));
        out.push((dt, 7, 32_007, true));
        out.push((dt, 6, 1025, false));
        out.push((dt, 3, 1, true));
    }
    out.push((DType::F32, 9, 128_256, true));
    out
}

/// Greedy tokens of `rows` rows of `vocab` logits in `dtype` on `device` against the host's
/// [`crate::sampling::argmax`] over the same (rounded) values. Row r is, by r mod 6: random
/// values; random with the largest planted at four places across the row (a tie: the first
/// wins); NaN first (0, as the host scan gives); NaNs sprinkled with the largest past them;
/// all −∞ (0); all −∞ but the last value.
pub fn greedy_parity(
    device: &Device,
    (dtype, rows, vocab, strided): (DType, usize, usize, bool),
    seed: u64,
) -> Result<GreedyParity> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (pad_rows, pad_cols) = if strided { (2, 5) } else { (0, 0) };
    let width = vocab + pad_cols;
    let mut xs = Vec::with_capacity((rows + pad_rows) * width);
    for r in 0..rows + pad_rows {
        // Around the view, values larger than any inside it: a kernel that reads past its
        // row's view picks one of them.
        let mut row = vec![100.0f32; width];
        if r < pad_rows / 2 || r >= pad_rows / 2 + rows {
            xs.extend(row);
            continue;
        }
        let v = &mut row[pad_cols.min(2)..pad_cols.min(2) + vocab];
        v.iter_mut().for_each(|x| *x = rng.random_range(-8.0..8.0));
        match (r - pad_rows / 2) % 6 {
            1 => {
                for at in [vocab - 1, vocab / 2, 1025 % vocab, 3 % vocab] {
                    v[at] = 9.5;
                }
            }
            2 => v[0] = f32::NAN,
            3 => {
                for (i, x) in v.iter_mut().enumerate() {
                    if i % 10 == 3 {
                        *x = f32::NAN;
                    }
                }
                v[vocab - 1] = 9.0;
            }
            4 => v.fill(f32::NEG_INFINITY),
            5 => {
                v.fill(f32::NEG_INFINITY);
                v[vocab - 1] = -3.0;
            }
            _ => {}
        }
        xs.extend(row);
    }
    // Rounded to the dtype on the CPU, then copied: the reference never reads back what the
    // device computed (a device that computes nothing fails).
    let host = Tensor::from_vec(xs, (rows + pad_rows, width), &Device::Cpu)?.to_dtype(dtype)?;
    let view = |all: &Tensor| -> Result<Tensor> {
        Ok(match strided {
            true => all.narrow(0, pad_rows / 2, rows)?.narrow(1, 2, vocab)?,
            false => all.clone(),
        })
    };
    let want: Vec<u32> = (view(&host)?.to_dtype(DType::F32)?)
        .to_vec2::<f32>()?
        .iter()
        .map(|r| crate::sampling::argmax(r))
        .collect();
    let got = keydiff_model::model::argmax_rows(&view(&host.to_device(device)?)?)?;
    let rows_differing = match got.len() == want.len() {
        true => got.iter().zip(&want).filter(|(a, b)| a != b).count(),
        false => rows,
    };
    Ok(GreedyParity {
        dtype: dtype.as_str().to_string(),
        rows,
        vocab,
        strided,
        rows_differing,
        pass: rows_differing == 0,
    })
}

/// One case of sampling where the logits are (`keydiff_model::model::sample_rows`; on CUDA
/// `keydiff_sample_rows_*`) against the host sampler's draw over the same values.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SampleParity {
    pub dtype: String,
    pub rows: usize,
    pub vocab: usize,
    /// The rows are a view inside a wider buffer (a row stride past the vocabulary, an offset).
    pub strided: bool,
    /// The device drew (false where `sample_rows` declines: the host samples there).
    pub ran: bool,
    /// Rows whose token differs from the host's (0 expected).
    pub rows_differing: usize,
    /// Rows left out: the host's own token changes when `r`, top-p or min-p move by 2e-7, so
    /// rounding may decide (the kernel sums weights in fixed point, within ~n · 2^-45).
    pub rows_near: usize,
    pub pass: bool,
}

/// Sampling's cases: those of greedy sampling ([`greedy_cases`]).
pub fn sample_cases() -> Vec<(DType, usize, usize, bool)> {
    greedy_cases()
}

/// Sampler settings the sampling check cycles through: (temperature, top-k, top-p, min-p,
/// the truncations' temperature: 1 in llama.cpp's order, the temperature in vLLM's); the last
/// is greedy.
const SAMPLE_SETTINGS: [(f32, u32, f32, f32, f32); 10] = [
    (1.0, 0, 1.0, 0.0, 1.0),
    (0.7, 40, 0.9, 0.0, 1.0),
    (1.5, 0, 0.95, 0.05, 1.0),
    (0.3, 5, 1.0, 0.0, 1.0),
    (0.8, 1, 1.0, 0.0, 1.0),
    (0.6, 3, 0.3, 0.9, 1.0),
    (1.2, 0, 0.999, 0.02, 1.0),
    (0.7, 0, 0.8, 0.1, 0.7),
    (1.6, 20, 0.9, 0.05, 1.6),
    (0.0, 0, 1.0, 0.0, 1.0),
];

/// The host's token for a row (with [`keydiff_model::model::NO_DRAW`] where it has no finite
/// logit, as `sample_rows` gives it) and whether it holds when `r`, top-p and min-p move by
/// 2e-7 (rounding cannot decide it).
pub fn host_draw(logits: &[f32], p: &DrawParams) -> (u32, bool) {
    use keydiff_model::model::{argmax, draw, NO_DRAW};
    if p.temperature <= 0.0 {
        return (argmax(logits), true);
    }
    let Some(tok) = draw(logits, p) else {
        return (argmax(logits) | NO_DRAW, true);
    };
    let d = 2e-7f32;
    let mut moved = vec![
        DrawParams {
            r: (p.r - d).max(0.0),
            ..*p
        },
        DrawParams {
            r: (p.r + d).min(1.0 - f32::EPSILON / 2.0),
            ..*p
        },
    ];
    if p.top_p < 1.0 {
        for top_p in [p.top_p - d, (p.top_p + d).min(1.0 - f32::EPSILON)] {
            moved.push(DrawParams { top_p, ..*p });
        }
    }
    if p.min_p > 0.0 {
        for min_p in [(p.min_p - d).max(1e-9), p.min_p + d] {
            moved.push(DrawParams { min_p, ..*p });
        }
    }
    let stable = moved.iter().all(|m| draw(logits, m) == Some(tok));
    (tok, stable)
}

/// Sampled tokens of `rows` rows of `vocab` logits in `dtype` on `device` against the host's
/// draw ([`host_draw`]) over the same (rounded) values. Row r takes setting r mod 10 of
/// [`SAMPLE_SETTINGS`] and is, by r mod 5: spread values; an LLM-like row (a long tail, a few
/// large values, the largest at two places); small integers (ties everywhere); NaN, ±∞ among
/// the values; no finite value (the argmax, flagged).
pub fn sample_parity(
    device: &Device,
    (dtype, rows, vocab, strided): (DType, usize, usize, bool),
    seed: u64,
) -> Result<SampleParity> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (pad_rows, pad_cols) = if strided { (2, 5) } else { (0, 0) };
    let width = vocab + pad_cols;
    let mut xs = Vec::with_capacity((rows + pad_rows) * width);
    let mut params = Vec::with_capacity(rows);
    for r in 0..rows + pad_rows {
        // Around the view, values larger than any inside it: a kernel that reads past its
        // row's view draws one of them.
        let mut row = vec![100.0f32; width];
        if r < pad_rows / 2 || r >= pad_rows / 2 + rows {
            xs.extend(row);
            continue;
        }
        let i = r - pad_rows / 2;
        let v = &mut row[pad_cols.min(2)..pad_cols.min(2) + vocab];
        v.iter_mut().for_each(|x| *x = rng.random_range(-8.0..8.0));
        match i % 5 {
            1 => {
                v.iter_mut().for_each(|x| *x = rng.random_range(-12.0..2.0));
                for _ in 0..5 {
                    v[rng.random_range(0..vocab)] = rng.random_range(6.0..14.0);
                }
                v[rng.random_range(0..vocab)] = 15.0;
                v[rng.random_range(0..vocab)] = 15.0;
            }
            2 => v
                .iter_mut()
                .for_each(|x| *x = rng.random_range(-2i32..=2) as f32),
            3 => {
                for _ in 0..vocab.div_ceil(5) {
                    let at = rng.random_range(0..vocab);
                    v[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..3)];
                }
            }
            4 => v.fill(f32::NEG_INFINITY),
            _ => {}
        }
        let (temperature, top_k, top_p, min_p, truncation_temperature) =
            SAMPLE_SETTINGS[i % SAMPLE_SETTINGS.len()];
        params.push(DrawParams {
            temperature,
            top_k,
            top_p,
            min_p,
            r: rng.random(),
            truncation_temperature,
        });
        xs.extend(row);
    }
    // Rounded to the dtype on the CPU, then copied: the reference never reads back what the
    // device computed.
    let host = Tensor::from_vec(xs, (rows + pad_rows, width), &Device::Cpu)?.to_dtype(dtype)?;
    let view = |all: &Tensor| -> Result<Tensor> {
        Ok(match strided {
            true => all.narrow(0, pad_rows / 2, rows)?.narrow(1, 2, vocab)?,
            false => all.clone(),
        })
    };
    let want: Vec<(u32, bool)> = (view(&host)?.to_dtype(DType::F32)?)
        .to_vec2::<f32>()?
        .iter()
        .zip(&params)
        .map(|(r, p)| host_draw(r, p))
        .collect();
    let got = keydiff_model::model::sample_rows(&view(&host.to_device(device)?)?, &params)?;
    let ran = got.is_some();
    let got = got.unwrap_or_default();
    let rows_near = want.iter().filter(|(_, stable)| !stable).count();
    let rows_differing = match got.len() == want.len() {
        true => (got.iter().zip(&want))
            .filter(|(g, (w, stable))| *stable && g != &w)
            .count(),
        false => rows,
    };
    Ok(SampleParity {
        dtype: dtype.as_str().to_string(),
        rows,
        vocab,
        strided,
        ran,
        rows_differing,
        rows_near,
        // Not one row decided by rounding in four.
        pass: ran && rows_differing == 0 && rows_near * 4 <= rows,
    })
}

/// Timing of one eviction (scoring + selection/plan + moves of K, V, positions and state).
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelTiming {
    pub device: String,
    pub dtype: String,
    pub kv_heads: usize,
    pub n: usize,
    pub head_dim: usize,
    pub budget: usize,
    /// How the selection was split (`SelectBlocks::name`).
    pub select_blocks: String,
    /// How the scoring kernels read the keys ([`ScoreLoads`], resolved).
    pub score_loads: String,
    /// Rows moved, all heads.
    pub moves: usize,
    pub reps: usize,
    /// Medians, microseconds, each op timed alone (the device synchronised before and after).
    pub score_us: f64,
    pub select_us: f64,
    pub move_us: f64,
    /// `score_us + select_us + move_us`.
    pub total_us: f64,
    /// One whole eviction (scores, plan, moves of K, V, positions and state) as the engine runs
    /// it: `reps` evictions back to back, one synchronisation at the end, divided by `reps`.
    /// Launch latency overlaps with work here, as it does in a prefill.
    pub eviction_us: f64,
    /// Bytes the eviction must touch at least: keys read twice, scores written and read,
    /// positions read, moved rows of K, V, positions and state read and written.
    pub bytes: usize,
    /// `bytes / eviction_us`.
    pub gb_per_s: f64,
    /// Device-to-device copy of 512 MiB, read + write bytes per second (best of 5).
    pub copy_gb_per_s: f64,
    pub percent_of_copy: f64,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Device-to-device copy bandwidth (read + write), GB/s, best of 5 copies of 512 MiB.
pub fn copy_bandwidth(device: &Device) -> Result<f64> {
    // Both buffers exist before the clock starts. `Tensor::copy` allocated 512 MiB inside the
    // timed region in every round: the first H200 run measured 1607 GB/s so, under half of the
    // ~4.3 TB/s GPU.md records for that host, which flattered the kernels' "% of copy".
    let src = Tensor::ones((4096, 32768), DType::F32, device)?;
    let dst = Tensor::zeros((4096, 32768), DType::F32, device)?;
    dst.slice_set(&src, 0, 0)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        device.synchronize()?;
        let t0 = Instant::now();
        dst.slice_set(&src, 0, 0)?;
        device.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * (512u64 << 20) as f64 / best / 1e9)
}

/// What scoring a contiguous `[kv, n, d]` tensor of `dtype` on `device` runs, as `loads`
/// resolves.
fn loads_name(device: &Device, loads: ScoreLoads, dtype: DType, n: usize, d: usize) -> String {
    if !device.is_cuda() {
        return "cpu twin".to_string();
    }
    let fits = vector_loads_fit(d, dtype.size_in_bytes(), 0, n * d, d);
    loads
        .resolve(fits)
        .map_or("refused", ScoreLoads::name)
        .to_string()
}

/// What one small op costs on `device` when ops run back to back: microseconds per op of a
/// chain of `ops` affine maps of a one-element tensor (a launch and an output allocation each,
/// as every eviction op has), one synchronisation at the end, best of 3 chains. An eviction is
/// about a dozen such ops: at small n this floor may bound its time rather than the bandwidth.
pub fn launch_floor_us(device: &Device, ops: usize) -> Result<f64> {
    let ops = ops.max(1);
    let mut x = Tensor::zeros(1, DType::F32, device)?;
    // Warm-up: module load, allocator.
    for _ in 0..16 {
        x = x.affine(1.0, 1.0)?;
    }
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        for _ in 0..ops {
            x = x.affine(1.0, 1.0)?;
        }
        device.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    // The chain's result, so that nothing of it can be skipped: 16 + 3·ops increments.
    let got = x.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0];
    let want = (16 + 3 * ops) as f32;
    if got != want {
        return Err(candle_core::Error::Msg(format!(
            "launch floor: the chain gave {got}, not {want}"
        ))
        .into());
    }
    Ok(best / ops as f64 * 1e6)
}

/// Times the eviction ops on `device` for a case's shape, dtype, budget, protection and anchor,
/// with positions ascending (the newest chunk last, as after a prefill chunk), the selection
/// split as `blocks` says, the keys read as `loads` says. One warm-up, then the median of
/// `reps`; the device is synchronised around every op.
pub fn kernel_timing(
    device: &Device,
    c: &KernelCase,
    reps: usize,
    copy_gb_per_s: f64,
    blocks: SelectBlocks,
    loads: ScoreLoads,
) -> Result<KernelTiming> {
    let (kv, n, head_dim, dtype, budget) = (c.kv_heads, c.n, c.head_dim, c.dtype, c.budget);
    let k = device_keys(kv, n, head_dim, dtype, device)?;
    let v = k.copy()?;
    let pos0 = Tensor::arange(0u32, n as u32, device)?
        .unsqueeze(0)?
        .broadcast_as((kv, n))?
        .contiguous()?;
    let state = Tensor::zeros((kv, n), DType::F32, device)?;
    let op = SelectPlan {
        budget,
        sinks: c.sinks,
        recent: c.recent,
        blocks,
    };
    let (mut ts, mut tp, mut tm) = (Vec::new(), Vec::new(), Vec::new());
    let mut moves = 0;
    let reps = reps.max(1);
    for rep in 0..reps + 1 {
        let pos = pos0.copy()?;
        device.synchronize()?;
        let t0 = Instant::now();
        let scores = keydiff_scores_fused_with(&k, c.anchor, loads)?;
        device.synchronize()?;
        let t1 = Instant::now();
        let plan = scores.apply_op2_no_bwd(&pos, &op)?;
        device.synchronize()?;
        let t2 = Instant::now();
        for t in [&k, &v, &pos, &state] {
            t.inplace_op2(&plan, &ApplyPlan)?;
        }
        device.synchronize()?;
        let t3 = Instant::now();
        if rep == 0 {
            // warm-up (module load, allocator)
            moves = plan_rows(&plan)?.iter().map(Vec::len).sum();
            continue;
        }
        ts.push((t1 - t0).as_secs_f64());
        tp.push((t2 - t1).as_secs_f64());
        tm.push((t3 - t2).as_secs_f64());
    }
    let (score, sel, mv) = (median(ts), median(tp), median(tm));
    let total = score + sel + mv;
    // Back to back: every eviction sees the same shapes (positions are permuted by the moves
    // before, which changes which rows move, not how many).
    let pos = pos0.copy()?;
    device.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..reps {
        let scores = keydiff_scores_fused_with(&k, c.anchor, loads)?;
        let plan = scores.apply_op2_no_bwd(&pos, &op)?;
        for t in [&k, &v, &pos, &state] {
            t.inplace_op2(&plan, &ApplyPlan)?;
        }
    }
    device.synchronize()?;
    let eviction = t0.elapsed().as_secs_f64() / reps as f64;
    let e = dtype.size_in_bytes();
    let bytes =
        2 * kv * n * head_dim * e + kv * n * (4 + 4 + 4) + moves * 2 * (2 * head_dim * e + 8);
    let gbps = bytes as f64 / eviction / 1e9;
    Ok(KernelTiming {
        device: format!("{device:?}"),
        dtype: dtype.as_str().to_string(),
        kv_heads: kv,
        n,
        head_dim,
        budget,
        select_blocks: if device.is_cuda() {
            blocks.resolve(n, budget, c.recent)?.name()
        } else {
            "cpu twin"
        }
        .to_string(),
        score_loads: loads_name(device, loads, dtype, n, head_dim),
        moves,
        reps,
        score_us: score * 1e6,
        select_us: sel * 1e6,
        move_us: mv * 1e6,
        total_us: total * 1e6,
        eviction_us: eviction * 1e6,
        bytes,
        gb_per_s: gbps,
        copy_gb_per_s,
        percent_of_copy: 100.0 * gbps / copy_gb_per_s,
    })
}
