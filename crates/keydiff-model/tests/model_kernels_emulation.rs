//! keydiff's CUDA kernels of the model's forward pass under the CPU emulation of CUDA
//! (`keydiff_kernels::emu`).
//!
//! - The decode-attention kernel (`keydiff_decode_*` of `kernels/keydiff.cu`) against the eager
//!   path (`attention_probs`, `attention_output` in f32 on the widened inputs) and the CPU
//!   decode kernel: every dtype, head dims 16 to 256 (odd ones too), GQA groups 1 to 8, one
//!   split and several, cache views with room past their rows. Its form over quantized caches
//!   (`keydiff_decode_kvq_*`: the five block types and fp8, read in place) against the eager
//!   path over the cache as keydiff-cache's codec dequantizes it, and against the CPU twin
//!   (`decode_attention_cpu_blocks`).
//! - The causal softmax of eager chunk attention (`keydiff_causal_softmax_*`) against the
//!   softmax the CPU runs (`masked_softmax`: candle's ops over the scores plus `chunk_mask`):
//!   every pair of dtypes it takes, chunks of 1 to 128 queries over their own keys and more,
//!   rows past 65536 keys, -inf and NaN scores.
//! - Its form with the statistics of TOVA, SnapKV and H2O (`keydiff_softmax_state_*`, then
//!   `keydiff_softmax_sums_*`) against the CPU's (`masked_softmax_sums`: the same softmax, then
//!   `row_sums` of its f32 probabilities): the probabilities bit for bit those of the one-launch
//!   softmax, the sums over the last 1 to all queries of each head, with and without the
//!   probabilities written.
//! - The residual add and RMSNorm (`keydiff_add_rms_norm_*`) against candle's add and
//!   `rms_norm` on the CPU (`add_rms_norm`): every dtype, hidden sizes of real models and odd
//!   ones, one row and several.
//! - SwiGLU's product (`keydiff_silu_mul_*`) against silu(gate) · up in f32 on the CPU, on the
//!   halves of a fused gate/up output (a row stride of twice the row) and on plain rows.
//! - Greedy sampling (`keydiff_argmax_rows_*`) against the host sampler's argmax
//!   (`keydiff_model::model::argmax`): ties within a thread's values, across a warp's lanes and
//!   across warps, NaNs, infinities, rows shorter than a block and views inside wider rows.
//!
//! On hardware they run in `scripts/gpu-check.sh`.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use keydiff_cache::KvType;
use keydiff_kernels::emu::{
    add_rms_norm, argmax_rows, causal_softmax, decode_attention, decode_attention_kvq, rope_qk,
    silu_mul, softmax_sums, Keys,
};
use keydiff_kernels::geometry::{decode_split, KVQ_FP8};
use keydiff_model::attention::{
    attention_output, attention_probs, chunk_mask, decode_attention_cpu,
    decode_attention_cpu_blocks, masked_softmax, masked_softmax_sums,
};

/// Seeded values: normal-ish, times `scale`.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            let mut u = 0f32;
            for _ in 0..4 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                u += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            }
            u * scale
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dt {
    F32,
    F16,
    BF16,
}

/// Values rounded to `dt` and back, as the kernel reads them.
fn rounded(x: &[f32], dt: Dt) -> Vec<f32> {
    match dt {
        Dt::F32 => x.to_vec(),
        Dt::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        Dt::BF16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
    }
}

/// Buffers of one dtype, kept alive while `Keys` borrow them.
enum Buf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Buf {
    fn new(x: &[f32], dt: Dt) -> Self {
        match dt {
            Dt::F32 => Buf::F32(x.to_vec()),
            Dt::F16 => Buf::F16(x.iter().map(|&v| f16::from_f32(v)).collect()),
            Dt::BF16 => Buf::BF16(x.iter().map(|&v| bf16::from_f32(v)).collect()),
        }
    }

    fn keys(&self) -> Keys<'_> {
        match self {
            Buf::F32(v) => Keys::F32(v),
            Buf::F16(v) => Keys::F16(v),
            Buf::BF16(v) => Keys::BF16(v),
        }
    }
}

struct Case {
    kv: usize,
    g: usize,
    d: usize,
    t: usize,
    /// Rows each head's K and V buffers hold (≥ t): the views' head strides.
    k_cap: usize,
    v_cap: usize,
    /// Spread of the keys: large values make the softmax peaky.
    key_scale: f32,
}

/// Runs the emulated kernel on a case; returns (kernel output, eager reference on the widened
/// inputs, the inputs widened: q, k rows and v rows `[kv, t, d]`).
fn run(c: &Case, dt: Dt, seed: u64) -> (Vec<f32>, Vec<f32>, [Vec<f32>; 3]) {
    let (kv, g, d, t) = (c.kv, c.g, c.d, c.t);
    let q = rounded(&values(kv * g * d, seed, 1.0), dt);
    let kb = rounded(&values(kv * c.k_cap * d, seed + 1, c.key_scale), dt);
    let vb = rounded(&values(kv * c.v_cap * d, seed + 2, 1.0), dt);
    let scale = 1.0 / (d as f32).sqrt();
    let (qb, kbuf, vbuf) = (Buf::new(&q, dt), Buf::new(&kb, dt), Buf::new(&vb, dt));
    let out = decode_attention(
        qb.keys(),
        kbuf.keys(),
        (c.k_cap * d, d),
        vbuf.keys(),
        (c.v_cap * d, d),
        (kv, g, t, d),
        scale,
        seed,
    )
    .unwrap_or_else(|e| panic!("kv {kv} g {g} d {d} t {t} {dt:?}: {e}"));
    // The views' rows, widened.
    let rows = |buf: &[f32], cap: usize| -> Vec<f32> {
        (0..kv)
            .flat_map(|h| buf[h * cap * d..(h * cap + t) * d].to_vec())
            .collect()
    };
    let (k, v) = (rows(&kb, c.k_cap), rows(&vb, c.v_cap));
    let dev = Device::Cpu;
    let qt = Tensor::from_vec(q.clone(), (kv, g, d), &dev).unwrap();
    let kt = Tensor::from_vec(k.clone(), (kv, t, d), &dev).unwrap();
    let vt = Tensor::from_vec(v.clone(), (kv, t, d), &dev).unwrap();
    let probs = attention_probs(&qt, &kt, None, g).unwrap();
    let want = attention_output(&probs, &vt)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    (out, want, [q, k, v])
}

/// The reference's largest magnitude (at least 1e-3), and the largest |out − want| (infinite
/// where a difference is NaN).
fn scale_and_worst(out: &[f32], want: &[f32]) -> (f32, f32) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
    let worst = out
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0f32,
            |m, x| if x.is_nan() { f32::INFINITY } else { m.max(x) },
        );
    (scale, worst)
}

/// The output's rounding: what `dt` loses on values up to `scale`, plus f32 sums, whose error in
/// a weight e^score grows with the scores (with the keys' spread).
fn tolerance(dt: Dt, scale: f32, key_scale: f32) -> f32 {
    scale
        * match dt {
            Dt::F32 => 2e-6 + 2.5e-8 * key_scale,
            Dt::F16 => 1e-3,
            Dt::BF16 => 8e-3,
        }
}

fn cases() -> Vec<Case> {
    let c = |kv, g, d, t, k_cap, v_cap, key_scale| Case {
        kv,
        g,
        d,
        t,
        k_cap,
        v_cap,
        key_scale,
    };
    vec![
        // One key.
        c(1, 1, 64, 1, 1, 1, 1.0),
        // Fewer keys than warps; a tiny head dim.
        c(2, 3, 16, 3, 9, 5, 1.0),
        // One split, views with room past their rows, keys of distinct strides for K and V.
        c(2, 4, 64, 256, 300, 260, 1.0),
        // Two splits (257 keys), Llama 3's shape.
        c(8, 4, 128, 257, 320, 257, 1.0),
        // A group of 8 and peaky scores.
        c(2, 8, 128, 700, 700, 704, 6.0),
        // d = 256, Qwen 2.5's group of 7, many splits.
        c(1, 7, 256, 1500, 1600, 1500, 1.0),
        // An odd head dim (lanes past d idle), and SmolLM2's group of 3.
        c(3, 3, 100, 513, 520, 513, 2.0),
        // Many splits of one head: 12 of 250.
        c(4, 1, 32, 3000, 3000, 3001, 1.0),
        // Scores near 100 apart: e^score overflows f32 unless each merge subtracts its max.
        c(2, 2, 64, 600, 600, 600, 400.0),
    ]
}

#[test]
fn decode_kernel_matches_eager_attention() {
    for (i, c) in cases().iter().enumerate() {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            for seed in [11 + i as u64, 40 + i as u64] {
                let (out, want, _) = run(c, dt, seed);
                let (scale, worst) = scale_and_worst(&out, &want);
                let splits = decode_split(c.kv, c.t).0;
                assert!(
                    worst <= tolerance(dt, scale, c.key_scale),
                    "kv {} g {} d {} t {} ({splits} splits) {dt:?} seed {seed}: max |Δ| {worst} \
                     against the eager path (scale {scale})",
                    c.kv,
                    c.g,
                    c.d,
                    c.t
                );
            }
        }
    }
}

/// The CPU twin (`decode_attention_cpu`, head dims 64/128/256) gives the same output in f32.
#[test]
fn decode_kernel_matches_its_cpu_twin() {
    for c in cases().iter().filter(|c| matches!(c.d, 64 | 128 | 256)) {
        let (out, _, [q, k, v]) = run(c, Dt::F32, 7);
        let dev = Device::Cpu;
        let qt = Tensor::from_vec(q, (c.kv, c.g, c.d), &dev).unwrap();
        let kt = Tensor::from_vec(k, (c.kv, c.t, c.d), &dev).unwrap();
        let vt = Tensor::from_vec(v, (c.kv, c.t, c.d), &dev).unwrap();
        let (y, _) = decode_attention_cpu(&qt, &kt, &vt, false)
            .unwrap()
            .expect("the CPU kernel takes f32 rows of 64/128/256");
        let twin = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = twin.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
        for (a, b) in out.iter().zip(&twin) {
            assert!(
                (a - b).abs() <= 2e-6 * scale,
                "kv {} g {} d {} t {}: {a} against the CPU twin's {b}",
                c.kv,
                c.g,
                c.d,
                c.t
            );
        }
    }
}

/// A NaN in one head's keys gives NaN for that head's query heads only, with one split and
/// with several: the kernel must not drop it while merging.
#[test]
fn a_nan_key_reaches_its_heads_output() {
    for t in [40, 1000] {
        let (kv, g, d) = (2, 2, 64);
        let q = values(kv * g * d, 3, 1.0);
        let mut k = values(kv * t * d, 4, 1.0);
        let v = values(kv * t * d, 5, 1.0);
        // Head 1, the first key: also the first of its warp and of its split.
        k[t * d] = f32::NAN;
        let out = decode_attention(
            Keys::F32(&q),
            Keys::F32(&k),
            (t * d, d),
            Keys::F32(&v),
            (t * d, d),
            (kv, g, t, d),
            0.125,
            9,
        )
        .unwrap();
        let (head0, head1) = out.split_at(g * d);
        assert!(head0.iter().all(|x| x.is_finite()), "t {t}: head 0");
        assert!(
            head1.iter().all(|x| x.is_nan()),
            "t {t}: head 1 lost its NaN"
        );
    }
}

/// A score of -inf (an infinite key element meeting a negative query element) weighs 0, as in
/// softmax, also when it is the first key of its warp and its block.
#[test]
fn a_key_scoring_minus_infinity_weighs_nothing() {
    for t in [40, 1000] {
        let (kv, g, d) = (1, 3, 64);
        let mut q = values(kv * g * d, 6, 1.0);
        for j in 0..g {
            q[j * d] = -1.0;
        }
        let mut k = values(kv * t * d, 7, 1.0);
        let v = values(kv * t * d, 8, 1.0);
        k[0] = f32::INFINITY;
        let scale = 1.0 / (d as f32).sqrt();
        let out = decode_attention(
            Keys::F32(&q),
            Keys::F32(&k),
            (t * d, d),
            Keys::F32(&v),
            (t * d, d),
            (kv, g, t, d),
            scale,
            10,
        )
        .unwrap();
        // The reference: the other keys alone (attention_probs scales by 1/√d itself).
        let dev = Device::Cpu;
        let qt = Tensor::from_vec(q, (kv, g, d), &dev).unwrap();
        let kt = Tensor::from_vec(k[d..].to_vec(), (kv, t - 1, d), &dev).unwrap();
        let vt = Tensor::from_vec(v[d..].to_vec(), (kv, t - 1, d), &dev).unwrap();
        let probs = attention_probs(&qt, &kt, None, g).unwrap();
        let want = attention_output(&probs, &vt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5, "t {t}: {a} against {b}");
        }
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn decode_kernel_refuses_what_it_cannot_run() {
    let x = vec![0f32; 4096];
    let run = |kv, g, t, d| {
        decode_attention(
            Keys::F32(&x),
            Keys::F32(&x),
            (t * d, d),
            Keys::F32(&x),
            (t * d, d),
            (kv, g, t, d),
            1.0,
            1,
        )
    };
    let err = |r: candle_core::Result<Vec<f32>>| r.unwrap_err().to_string();
    assert!(err(run(1, 9, 4, 64)).contains("query heads"));
    assert!(err(run(1, 1, 0, 64)).contains("keys"));
    assert!(err(run(1, 1, 4, 300)).contains("head_dim"));
    // Views past their buffers.
    assert!(err(run(1, 1, 100, 64)).contains("exceed"));
    let f16s = vec![f16::ZERO; 4096];
    let mixed = decode_attention(
        Keys::F16(&f16s),
        Keys::F32(&x),
        (64, 64),
        Keys::F32(&x),
        (64, 64),
        (1, 1, 1, 64),
        1.0,
        1,
    );
    assert!(err(mixed).contains("one dtype"));
}

/// A quantized cache's buffers for a case: K and V rows `[kv, cap, d]` (the seeds of [`run`])
/// encoded by keydiff-cache's CPU codec. Returns the bytes of K and V, a row's bytes, and the
/// first `t` rows of each head as the codec decodes them, `[kv, t, d]` f32.
fn encoded(c: &Case, t: KvType, seed: u64) -> ([Vec<u8>; 2], usize, [Vec<f32>; 2]) {
    let (kv, d) = (c.kv, c.d);
    let dev = Device::Cpu;
    let code = |x: Vec<f32>, cap: usize| -> (Vec<u8>, Vec<f32>) {
        let x = Tensor::from_vec(x, (kv, cap, d), &dev).unwrap();
        let enc = t.encode(&x).unwrap();
        let dec = t
            .decode(&enc, d)
            .unwrap()
            .narrow(1, 0, c.t)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let bytes = match enc.dtype() {
            DType::U8 => enc.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
            DType::F8E4M3 => enc
                .flatten_all()
                .unwrap()
                .to_vec1::<float8::F8E4M3>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            dt => panic!("{t}: buffers of {dt:?}"),
        };
        (bytes, dec)
    };
    let (kb, kd) = code(values(kv * c.k_cap * d, seed + 1, c.key_scale), c.k_cap);
    let (vb, vd) = code(values(kv * c.v_cap * d, seed + 2, 1.0), c.v_cap);
    ([kb, vb], t.row_bytes(d), [kd, vd])
}

/// The kernels' `kind` of a quantized cache type.
fn kind_of(t: KvType) -> i32 {
    match t {
        KvType::Float(DType::F8E4M3) => KVQ_FP8,
        t => t.block_code().expect("a block type"),
    }
}

/// The quantized cache types the decode kernel reads in place.
fn quantized() -> Vec<KvType> {
    let mut v = KvType::BLOCKS.to_vec();
    v.push(KvType::Float(DType::F8E4M3));
    v
}

/// Runs `keydiff_decode_kvq_*` on a case's cache in `t`, with q in `dt`; returns the output
/// and the eager path's over the codec's dequantized rows (q widened).
fn run_kvq(c: &Case, t: KvType, dt: Dt, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (kv, g, d) = (c.kv, c.g, c.d);
    let q = rounded(&values(kv * g * d, seed, 1.0), dt);
    let ([kb, vb], row, [k, v]) = encoded(c, t, seed);
    let qb = Buf::new(&q, dt);
    let out = decode_attention_kvq(
        qb.keys(),
        &kb,
        (c.k_cap * row, row),
        &vb,
        (c.v_cap * row, row),
        (kv, g, c.t, d),
        kind_of(t),
        1.0 / (d as f32).sqrt(),
        seed,
    )
    .unwrap_or_else(|e| panic!("{t} kv {kv} g {g} d {d} t {} {dt:?}: {e}", c.t));
    let dev = Device::Cpu;
    let qt = Tensor::from_vec(q.clone(), (kv, g, d), &dev).unwrap();
    let kt = Tensor::from_vec(k, (kv, c.t, d), &dev).unwrap();
    let vt = Tensor::from_vec(v, (kv, c.t, d), &dev).unwrap();
    let probs = attention_probs(&qt, &kt, None, g).unwrap();
    let want = attention_output(&probs, &vt)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    (out, want, q)
}

/// The decode kernel over every quantized cache type reads the blocks as the codec does: the
/// eager result over the dequantized cache, within the output's rounding, for every dtype of
/// q, one split and several, views with room past their rows.
#[test]
fn decode_kernel_over_quantized_caches_matches_eager_attention() {
    let all = cases();
    for t in quantized() {
        for (i, c) in all.iter().enumerate().filter(|(_, c)| c.d % 32 == 0) {
            // The long cases, and f16 queries, for q8_0; every type runs the rest in f32 and
            // bf16 (the engine's GPU dtype).
            let wide = t == KvType::Q8_0;
            if c.kv * c.t > 1500 && !wide {
                continue;
            }
            let dts: &[Dt] = if wide {
                &[Dt::F32, Dt::F16, Dt::BF16]
            } else {
                &[Dt::F32, Dt::BF16]
            };
            for &dt in dts {
                let seed = 60 + i as u64;
                let (out, want, _) = run_kvq(c, t, dt, seed);
                let (scale, worst) = scale_and_worst(&out, &want);
                assert!(
                    worst <= tolerance(dt, scale, c.key_scale),
                    "{t} kv {} g {} d {} t {} ({} splits) {dt:?}: max |Δ| {worst} against \
                     the eager path over the dequantized cache (scale {scale})",
                    c.kv,
                    c.g,
                    c.d,
                    c.t,
                    decode_split(c.kv, c.t).0
                );
            }
        }
    }
}

/// In f32 the kernel over blocks gives what its CPU twin gives (`decode_attention_cpu_blocks`;
/// for fp8, `decode_attention_cpu` over the F8E4M3 rows), head dims 64/128/256.
#[test]
fn decode_kernel_over_quantized_caches_matches_its_cpu_twin() {
    let dev = Device::Cpu;
    for t in quantized() {
        for c in cases().iter().filter(|c| matches!(c.d, 64 | 128 | 256)) {
            if c.kv * c.t > 1500 && t != KvType::Q4_0 {
                continue;
            }
            let (out, _, q) = run_kvq(c, t, Dt::F32, 8);
            let ([kb, vb], row, _) = encoded(c, t, 8);
            let view = |b: Vec<u8>, cap: usize| -> Tensor {
                let x = Tensor::from_vec(b, (c.kv, cap, row), &dev).unwrap();
                let x = match t {
                    KvType::Float(DType::F8E4M3) => {
                        let codes: Vec<float8::F8E4M3> = x
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<u8>()
                            .unwrap()
                            .into_iter()
                            .map(float8::F8E4M3::from_bits)
                            .collect();
                        Tensor::from_vec(codes, (c.kv, cap, row), &dev).unwrap()
                    }
                    _ => x,
                };
                x.narrow(1, 0, c.t).unwrap()
            };
            let (kt, vt) = (view(kb, c.k_cap), view(vb, c.v_cap));
            let qt = Tensor::from_vec(q, (c.kv, c.g, c.d), &dev).unwrap();
            let twin = match t {
                KvType::Float(_) => decode_attention_cpu(&qt, &kt, &vt, false),
                _ => decode_attention_cpu_blocks(&qt, &kt, &vt, t, false),
            }
            .unwrap()
            .expect("the CPU kernel takes these rows")
            .0
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            let scale = twin.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
            for (a, b) in out.iter().zip(&twin) {
                assert!(
                    (a - b).abs() <= 2e-6 * scale,
                    "{t} kv {} g {} d {} t {}: {a} against the CPU twin's {b}",
                    c.kv,
                    c.g,
                    c.d,
                    c.t
                );
            }
        }
    }
}

/// Over blocks, what the kernel cannot run is an error naming it, before anything runs.
#[test]
fn decode_kernel_over_blocks_refuses_what_it_cannot_run() {
    let q = vec![0f32; 4096];
    let b = vec![0u8; 65536];
    let run = |t: usize, d: usize, kind: i32, row: usize| {
        decode_attention_kvq(
            Keys::F32(&q),
            &b,
            (t * row, row),
            &b,
            (t * row, row),
            (1, 2, t, d),
            kind,
            1.0,
            1,
        )
    };
    let err = |r: candle_core::Result<Vec<f32>>| r.unwrap_err().to_string();
    assert!(err(run(4, 48, 0, 34)).contains("multiple of 32"));
    assert!(err(run(4, 64, 6, 64)).contains("no block type 6"));
    assert!(err(run(4, 64, -1, 64)).contains("no block type -1"));
    assert!(err(run(0, 64, 0, 68)).contains("keys"));
    // A view past its buffer: 1000 rows of two q8_0 blocks.
    assert!(err(run(1000, 64, 0, 68)).contains("exceed"));
}

/// The CPU's softmax of `scores` (`[rows, t]`, rows in chunks of `chunk` queries), masked
/// bottom-right causal, in f32: the kernel's reference.
fn softmax_reference(scores: &[f32], rows: usize, t: usize, chunk: usize) -> Vec<f32> {
    let dev = Device::Cpu;
    let s = Tensor::from_vec(scores.to_vec(), (rows / chunk, chunk, t), &dev).unwrap();
    let mask = (chunk > 1).then(|| chunk_mask(chunk, t, DType::F32, &dev).unwrap());
    masked_softmax(&s, mask.as_ref(), chunk, DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Keys a query row sees: row r is the query at r % chunk of its chunk.
fn seen(r: usize, t: usize, chunk: usize) -> usize {
    t - chunk + r % chunk + 1
}

/// The emulated kernel on `scores` rounded to `dt`, probabilities in f32 or in `dt`, against
/// the reference on the same rounded scores: within the output's rounding, and exactly 0 where
/// masked.
fn check_softmax(scores: &[f32], rows: usize, t: usize, chunk: usize, dt: Dt, f32_out: bool) {
    let x = rounded(scores, dt);
    let buf = Buf::new(&x, dt);
    let what = format!("rows {rows} t {t} chunk {chunk} {dt:?} f32 out {f32_out}");
    let want = softmax_reference(&x, rows, t, chunk);
    for seed in [1, 2] {
        let got = causal_softmax(buf.keys(), rows, t, chunk, f32_out, seed)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.len(), rows * t, "{what}");
        // The reference rounded to the output's dtype, as the kernel writes it.
        let rel = match (f32_out, dt) {
            (true, _) | (_, Dt::F32) => 2e-6,
            (false, Dt::F16) => 1e-3,
            (false, Dt::BF16) => 8e-3,
        };
        for r in 0..rows {
            let lim = seen(r, t, chunk);
            for c in 0..t {
                let (g, w) = (got[r * t + c], want[r * t + c]);
                if c >= lim {
                    assert_eq!(g.to_bits(), 0, "{what}: row {r} key {c} masked, got {g}");
                } else {
                    assert!(
                        (g - w).abs() <= rel * w.abs() + 1e-7,
                        "{what} seed {seed}: row {r} key {c}: {g} against {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn causal_softmax_matches_the_cpu_softmax() {
    // (rows, t, chunk): one query over one key; decode rows (chunk 1); a chunk over its own
    // keys only (t = chunk); groups of query heads; a chunk of 128 over an evicting cache;
    // rows of fewer keys than a block's threads and of a few more than a block's stride.
    let cases = [
        (1, 1, 1),
        (6, 5, 1),
        (12, 3, 3),
        (4 * 7, 300, 7),
        (2 * 128, 700, 128),
        (3 * 2, 255, 2),
        (2 * 5, 257, 5),
    ];
    for (i, &(rows, t, chunk)) in cases.iter().enumerate() {
        // Spread 12: peaky rows, whose weights span many orders of magnitude.
        let scores = values(rows * t, 40 + i as u64, 12.0);
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            check_softmax(&scores, rows, t, chunk, dt, true);
            if dt != Dt::F32 {
                check_softmax(&scores, rows, t, chunk, dt, false);
            }
        }
    }
}

#[test]
fn causal_softmax_over_a_long_row() {
    // 70,000 keys: each thread of a block runs 274 of them through the online softmax.
    let (rows, t, chunk) = (4, 70_000, 4);
    let scores = values(rows * t, 77, 6.0);
    check_softmax(&scores, rows, t, chunk, Dt::BF16, true);
    check_softmax(&scores, rows, t, chunk, Dt::BF16, false);
}

#[test]
fn causal_softmax_weighs_minus_infinity_zero() {
    // -inf as a row's first score (the running max starts at -inf), a thread's only score, and
    // one in the middle: each weighs 0, as in the reference.
    let (rows, t, chunk) = (6, 300, 3);
    let mut scores = values(rows * t, 5, 4.0);
    for (r, c) in [(0, 0), (1, 7), (2, 0), (2, 256), (4, 150), (5, 299)] {
        scores[r * t + c] = f32::NEG_INFINITY;
    }
    for dt in [Dt::F32, Dt::BF16] {
        check_softmax(&scores, rows, t, chunk, dt, true);
    }
}

#[test]
fn a_nan_score_makes_its_row_nan_and_a_masked_one_is_never_read() {
    let (rows, t, chunk) = (4, 300, 2);
    let clean = values(rows * t, 9, 3.0);
    let mut scores = clean.clone();
    // Row 1 sees every key: a NaN among them. Row 2 sees t - 1: a NaN in its masked key.
    scores[t + 10] = f32::NAN;
    scores[2 * t + t - 1] = f32::NAN;
    let x = Buf::new(&scores, Dt::F32);
    let clean_p =
        causal_softmax(Buf::new(&clean, Dt::F32).keys(), rows, t, chunk, true, 3).unwrap();
    for seed in [3, 4] {
        let got = causal_softmax(x.keys(), rows, t, chunk, true, seed).unwrap();
        let row = |r: usize| &got[r * t..(r + 1) * t];
        assert!(row(1).iter().all(|p| p.is_nan()), "a NaN score's row");
        for r in [0, 2, 3] {
            assert_eq!(row(r), &clean_p[r * t..(r + 1) * t], "row {r}");
        }
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn causal_softmax_refuses_what_it_cannot_run() {
    let x = vec![0f32; 64];
    let err = |rows, t, chunk| {
        causal_softmax(Keys::F32(&x), rows, t, chunk, true, 1)
            .unwrap_err()
            .to_string()
    };
    assert!(err(4, 3, 4).contains("chunk of 4 queries over 3 keys"));
    assert!(err(4, 8, 0).contains("chunk of 0"));
    assert!(err(6, 8, 4).contains("multiple of the chunk"));
    assert!(err(0, 8, 4).contains("0 rows"));
    assert!(err(16, 8, 4).contains("scores"));
}

/// One case of the softmax with sums: `kv` KV heads of `g` query heads, chunks of `chunk`
/// queries over `t` keys, the last `stat_rows` of each head's queries summed.
#[derive(Clone, Copy, Debug)]
struct SumsCase {
    kv: usize,
    g: usize,
    chunk: usize,
    t: usize,
    stat_rows: usize,
}

impl SumsCase {
    fn rows(&self) -> usize {
        self.kv * self.g * self.chunk
    }
}

/// The CPU's probabilities (f32) and sums `[kv · g · t]` of `scores` `[kv, g · chunk, t]`.
fn softmax_sums_reference(scores: &[f32], c: SumsCase) -> (Vec<f32>, Vec<f32>) {
    let dev = Device::Cpu;
    let s = Tensor::from_vec(scores.to_vec(), (c.kv, c.g * c.chunk, c.t), &dev).unwrap();
    let mask = (c.chunk > 1).then(|| chunk_mask(c.chunk, c.t, DType::F32, &dev).unwrap());
    let (p, sums) = masked_softmax_sums(
        &s,
        mask.as_ref(),
        c.chunk,
        c.g,
        c.stat_rows,
        Some(DType::F32),
    )
    .unwrap();
    let flat = |x: Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(sums.dims(), [c.kv, c.g, c.t]);
    (flat(p.unwrap()), flat(sums))
}

/// The emulated kernels on `scores` rounded to `dt` against the CPU on the same rounded scores:
/// the sums within f32 rounding of the reference's, whatever the probabilities are written in
/// (and equal bit for bit to those made without writing them); the probabilities exactly those
/// of the one-launch causal softmax (same row states, same expression), so within its
/// tolerance of the reference and 0 where masked.
fn check_softmax_sums(scores: &[f32], c: SumsCase, dt: Dt) {
    let (rows, t) = (c.rows(), c.t);
    let x = rounded(scores, dt);
    let buf = Buf::new(&x, dt);
    let (_, want_sums) = softmax_sums_reference(&x, c);
    let outs: &[Option<bool>] = match dt {
        Dt::F32 => &[None, Some(true)],
        _ => &[None, Some(true), Some(false)],
    };
    let mut first: Option<Vec<f32>> = None;
    for &probs in outs {
        for seed in [1, 2] {
            let what = format!("{c:?} {dt:?} probs {probs:?} seed {seed}");
            let (got_p, got_sums) =
                softmax_sums(buf.keys(), rows, t, c.chunk, c.stat_rows, probs, seed)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(got_sums.len(), c.kv * c.g * t, "{what}");
            for (i, (&g, &w)) in got_sums.iter().zip(&want_sums).enumerate() {
                assert!(
                    (g - w).abs() <= 4e-6 * w.abs() + 1e-7,
                    "{what}: head {} key {}: sum {g} against {w}",
                    i / t,
                    i % t
                );
            }
            // The sums do not depend on whether or how the probabilities are written.
            match &first {
                None => first = Some(got_sums.clone()),
                Some(f) => assert!(
                    f.iter()
                        .zip(&got_sums)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: sums differ from the first run's"
                ),
            }
            match (probs, got_p) {
                (None, None) => {}
                (Some(f32_out), Some(p)) => {
                    let one = causal_softmax(buf.keys(), rows, t, c.chunk, f32_out, seed).unwrap();
                    assert!(
                        p.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: probabilities differ from the one-launch softmax's"
                    );
                }
                (probs, p) => panic!("{what}: asked {probs:?}, got {:?}", p.map(|p| p.len())),
            }
        }
    }
}

#[test]
fn softmax_sums_match_the_cpu_statistics() {
    let case = |kv, g, chunk, t, stat_rows| SumsCase {
        kv,
        g,
        chunk,
        t,
        stat_rows,
    };
    // One query over one key; decode rows (chunk 1); a chunk over its own keys only; H2O (every
    // query summed) with groups; TOVA (the last query) and SnapKV's window (the last 32) over a
    // chunk of 128; keys a few past one block of 256, and past two.
    let cases = [
        case(1, 1, 1, 1, 1),
        case(2, 3, 1, 5, 1),
        case(1, 2, 3, 3, 3),
        case(2, 2, 7, 300, 7),
        case(1, 4, 128, 700, 1),
        case(2, 1, 128, 700, 32),
        case(1, 2, 5, 257, 2),
        case(3, 1, 2, 513, 1),
    ];
    for (i, &c) in cases.iter().enumerate() {
        let scores = values(c.rows() * c.t, 60 + i as u64, 12.0);
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            check_softmax_sums(&scores, c, dt);
        }
    }
}

#[test]
fn softmax_sums_over_a_long_row() {
    // 70,000 keys: 274 blocks of keys, each thread's queries over a key read row by row.
    let c = SumsCase {
        kv: 1,
        g: 2,
        chunk: 3,
        t: 70_000,
        stat_rows: 2,
    };
    check_softmax_sums(&values(c.rows() * c.t, 78, 6.0), c, Dt::BF16);
}

#[test]
fn softmax_sums_read_only_the_rows_they_need() {
    // Two heads of chunks of 3, the last 2 queries summed. A NaN in head 0's last query (a
    // key it sees) makes every sum of head 0 NaN. Head 1 holds a NaN in its first query, which
    // is not summed (its probabilities are NaN, its sums clean), and one in its second query's
    // masked key, which weighs nothing (its row state ignores it: neither its probabilities
    // nor the sums turn NaN).
    let c = SumsCase {
        kv: 1,
        g: 2,
        chunk: 3,
        t: 300,
        stat_rows: 2,
    };
    let t = c.t;
    let clean = values(c.rows() * t, 11, 3.0);
    let mut scores = clean.clone();
    scores[2 * t + 10] = f32::NAN;
    scores[3 * t + 5] = f32::NAN;
    scores[4 * t + t - 1] = f32::NAN;
    let x = Buf::new(&scores, Dt::F32);
    let (_, clean_sums) =
        softmax_sums(Buf::new(&clean, Dt::F32).keys(), 6, t, 3, 2, None, 3).unwrap();
    for probs in [None, Some(true)] {
        for seed in [3, 4] {
            let (p, sums) = softmax_sums(x.keys(), 6, t, 3, 2, probs, seed).unwrap();
            assert!(sums[..t].iter().all(|s| s.is_nan()), "head 0's sums");
            assert_eq!(&sums[t..], &clean_sums[t..], "head 1's sums");
            if let Some(p) = p {
                // Its last two keys are masked: 0, not read.
                assert!(
                    p[3 * t..4 * t - 2].iter().all(|v| v.is_nan()),
                    "head 1's first query"
                );
                assert_eq!(&p[4 * t - 2..4 * t], &[0.0, 0.0], "head 1's first query");
                assert!(
                    p[4 * t..5 * t].iter().all(|v| !v.is_nan()),
                    "head 1's second query"
                );
            }
        }
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn softmax_sums_refuse_what_they_cannot_run() {
    let x = vec![0f32; 65_536];
    let err = |rows, t, chunk, stat_rows| {
        softmax_sums(Keys::F32(&x), rows, t, chunk, stat_rows, None, 1)
            .unwrap_err()
            .to_string()
    };
    assert!(err(4, 8, 4, 0).contains("last 0 queries"));
    assert!(err(4, 8, 4, 5).contains("last 5 queries of chunks of 4"));
    assert!(err(4, 3, 4, 1).contains("chunk of 4 queries over 3 keys"));
    assert!(err(6, 8, 4, 1).contains("multiple of the chunk"));
    assert!(err(65_536, 1, 1, 1).contains("65536 query heads"));
    let short = softmax_sums(Keys::F32(&x[..64]), 16, 8, 4, 1, None, 1).unwrap_err();
    assert!(short.to_string().contains("64 scores"), "{short}");
}

/// The emulated residual add and RMSNorm against candle's on the CPU, on inputs rounded to `dt`:
/// the sums exactly (both round x + r once), the norms within the output's rounding (the sums of
/// squares run in another order, and candle's CPU divides by the root where the kernel
/// multiplies by its reciprocal).
fn check_add_norm(rows: usize, cols: usize, dt: Dt, seed: u64, scale: f32) {
    let x = rounded(&values(rows * cols, seed, 2.0 * scale), dt);
    let r = rounded(&values(rows * cols, seed + 1, scale), dt);
    let w = rounded(&values(cols, seed + 2, 1.0), dt);
    let eps = 1e-6;
    let what = format!("rows {rows} cols {cols} {dt:?}");
    let (xb, rb, wb) = (Buf::new(&x, dt), Buf::new(&r, dt), Buf::new(&w, dt));
    let got = add_rms_norm(xb.keys(), rb.keys(), wb.keys(), rows, cols, eps, seed)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let dev = Device::Cpu;
    let cdt = match dt {
        Dt::F32 => DType::F32,
        Dt::F16 => DType::F16,
        Dt::BF16 => DType::BF16,
    };
    let t = |v: &[f32], shape: &[usize]| {
        Tensor::from_vec(v.to_vec(), shape, &dev)
            .unwrap()
            .to_dtype(cdt)
            .unwrap()
    };
    let (sum, _) = keydiff_model::model::add_rms_norm(
        &t(&x, &[rows, cols]),
        &t(&r, &[rows, cols]),
        &t(&w, &[cols]),
        eps,
    )
    .unwrap();
    // The norm in f32 over the rounded sums, rounded to dt once, as the kernel (and candle's
    // CUDA kernel) computes it: candle's CPU norm for f16 and bf16 rounds its divisor to the
    // dtype, two ulps off.
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let norm = candle_nn::ops::rms_norm(&f32s(&sum), &f32s(&t(&w, &[cols])), eps)
        .unwrap()
        .to_dtype(cdt)
        .unwrap();
    let flat = |t: Tensor| f32s(&t).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (sum, norm) = (flat(sum), flat(norm));
    assert_eq!(&got[..rows * cols], &sum[..], "{what}: sums");
    assert_within_rounding(
        &format!("{what}: norms"),
        &got[rows * cols..],
        &norm,
        dt,
        cols,
    );
}

/// `got` within the rounding of `dt` (an ulp; 2e-6 in f32) of `want`, value by value of rows
/// of `cols`.
fn assert_within_rounding(what: &str, got: &[f32], want: &[f32], dt: Dt, cols: usize) {
    let rel = match dt {
        Dt::F32 => 2e-6,
        Dt::F16 => 1e-3,
        Dt::BF16 => 8e-3,
    };
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs() + 1e-6,
            "{what}: value {} of row {}: {g} against {w}",
            i % cols,
            i / cols
        );
    }
}

#[test]
fn add_rms_norm_matches_candle() {
    // Hidden sizes: SmolLM2-135M (576), Qwen2.5-0.5B (896), Llama-3.2-3B (3072); odd ones
    // below and past a block's 256 threads.
    for (i, &(rows, cols)) in [(1, 576), (3, 896), (1, 3072), (5, 100), (2, 257), (4, 1000)]
        .iter()
        .enumerate()
    {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            for seed in [60 + 2 * i as u64, 61 + 2 * i as u64] {
                check_add_norm(rows, cols, dt, seed, 1.0);
            }
        }
    }
    // Values about 1e-3: their mean square is of the order of eps (1e-6), which then counts.
    check_add_norm(2, 576, Dt::F32, 90, 1e-3);
}

/// The norm is taken of the sum as rounded to the dtype, as candle's add then `rms_norm` take
/// it: 1 + 0.0035 rounds to 1 in bf16, so every sum is 1 and every norm (weights 1) is
/// bf16(1 / sqrt(1 + eps)) = 1 exactly; the norm of the unrounded sums would be 0.9961.
#[test]
fn add_rms_norm_normalises_the_rounded_sum() {
    let (rows, cols) = (2, 300);
    let x = vec![bf16::ONE; rows * cols];
    let r = vec![bf16::from_f32(0.0035); rows * cols];
    let w = vec![bf16::ONE; cols];
    for seed in [1, 2] {
        let got = add_rms_norm(
            Keys::BF16(&x),
            Keys::BF16(&r),
            Keys::BF16(&w),
            rows,
            cols,
            1e-6,
            seed,
        )
        .unwrap();
        assert!(
            got.iter().all(|&v| v == 1.0),
            "sums and norms: {:?}",
            &got[rows * cols..][..4]
        );
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn add_rms_norm_refuses_what_it_cannot_run() {
    let x = vec![0f32; 64];
    let err = |rows, cols, w: &[f32]| {
        add_rms_norm(
            Keys::F32(&x),
            Keys::F32(&x),
            Keys::F32(w),
            rows,
            cols,
            1e-6,
            1,
        )
        .unwrap_err()
        .to_string()
    };
    assert!(err(0, 8, &x).contains("0 rows"));
    assert!(err(2, 0, &x).contains("0 values"));
    assert!(err(8, 16, &x).contains("values for 8 rows of 16"));
    assert!(err(2, 16, &x[..8]).contains("w 8"));
    let f16s = vec![f16::ZERO; 64];
    let mixed = add_rms_norm(
        Keys::F32(&x),
        Keys::F16(&f16s),
        Keys::F32(&x),
        2,
        8,
        1e-6,
        1,
    );
    assert!(mixed.unwrap_err().to_string().contains("one dtype"));
}

/// The emulated SwiGLU product against candle's `silu` and product in f32 on the CPU over the
/// same rounded inputs, rounded to `dt` once: within the output's rounding. `fused`: gate and up
/// are the two halves of each row of one `[rows, 2 · cols]` buffer, as a fused gate/up matmul
/// writes them; else each in a buffer of its own with padded rows.
fn check_silu_mul(rows: usize, cols: usize, dt: Dt, fused: bool, seed: u64) {
    let what = format!("rows {rows} cols {cols} {dt:?} fused {fused}");
    let (g, u, rs) = if fused {
        let both = rounded(&values(rows * 2 * cols, seed, 8.0), dt);
        let half = |k: usize| -> Vec<f32> {
            both.chunks(2 * cols)
                .flat_map(|r| r[k * cols..(k + 1) * cols].to_vec())
                .collect()
        };
        (half(0), half(1), 2 * cols)
    } else {
        (
            rounded(&values(rows * cols, seed, 8.0), dt),
            rounded(&values(rows * cols, seed + 1, 2.0), dt),
            cols,
        )
    };
    // The kernel reads the views: for `fused` one buffer holding both halves.
    let got = if fused {
        let both: Vec<f32> = g
            .chunks(cols)
            .zip(u.chunks(cols))
            .flat_map(|(a, b)| a.iter().chain(b).copied().collect::<Vec<_>>())
            .collect();
        let buf = Buf::new(&both, dt);
        let keys = buf.keys();
        let up = match keys {
            Keys::F32(v) => Keys::F32(&v[cols..]),
            Keys::F16(v) => Keys::F16(&v[cols..]),
            Keys::BF16(v) => Keys::BF16(&v[cols..]),
        };
        silu_mul(keys, rs, up, rs, rows, cols, seed)
    } else {
        // Rows padded with NaN to strides of their own (cols + 3, cols + 5): a read of the
        // padding, or of one view at the other's stride, shows.
        let padded = |x: &[f32], pad: usize| -> Vec<f32> {
            x.chunks(cols)
                .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(f32::NAN, pad)))
                .collect()
        };
        let (gb, ub) = (Buf::new(&padded(&g, 3), dt), Buf::new(&padded(&u, 5), dt));
        silu_mul(gb.keys(), rs + 3, ub.keys(), rs + 5, rows, cols, seed)
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let dev = Device::Cpu;
    let gt = Tensor::from_vec(g, (rows, cols), &dev).unwrap();
    let ut = Tensor::from_vec(u, (rows, cols), &dev).unwrap();
    let want = keydiff_model::model::silu_mul(&gt, &ut).unwrap();
    let want = match dt {
        Dt::F32 => want,
        Dt::F16 => want.to_dtype(DType::F16).unwrap(),
        Dt::BF16 => want.to_dtype(DType::BF16).unwrap(),
    };
    let want = want
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_within_rounding(&what, &got, &want, dt, cols);
}

#[test]
fn silu_mul_matches_candle() {
    // One decode row of Llama-3.2-3B's 8192, prompt rows of Qwen2.5-0.5B's 4864, odd sizes,
    // and 40 rows of 8192: past the 262,144 values one grid covers (`act_launch`), so the
    // grid-stride loop takes a second turn.
    let shapes = [(1, 8192), (3, 4864), (5, 100), (2, 257), (40, 8192)];
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            for fused in [true, false] {
                check_silu_mul(rows, cols, dt, fused, 80 + i as u64 + fused as u64);
            }
        }
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn silu_mul_refuses_what_it_cannot_run() {
    let x = vec![0f32; 64];
    let err = |rs, rows, cols| {
        silu_mul(Keys::F32(&x), rs, Keys::F32(&x), rs, rows, cols, 1)
            .unwrap_err()
            .to_string()
    };
    assert!(err(8, 0, 8).contains("0 rows"));
    assert!(err(4, 2, 8).contains("below the 8 values"));
    assert!(err(16, 8, 16).contains("exceed"));
    let f16s = vec![f16::ZERO; 64];
    let mixed = silu_mul(Keys::F32(&x), 8, Keys::F16(&f16s), 8, 2, 8, 1);
    assert!(mixed.unwrap_err().to_string().contains("one dtype"));
}

/// A row of `cols` logits for greedy sampling: random values in ±8, and by `kind`: 0 as they
/// are; 1 the largest (9.5) at 2 to 9 random places (a tie: the first must win, wherever the
/// others fall among the threads, lanes and warps); 2 all one value (0: ties within each
/// thread's values too); 3 NaN first (0, as the host scan gives); 4 NaNs at random places and
/// the largest at another; 5 all −∞ (0); 6 all −∞ but one value; 7 +∞ at two places (the first
/// wins); 8 NaN everywhere but the first value and the largest, last.
fn greedy_row(cols: usize, kind: usize, seed: u64) -> Vec<f32> {
    let mut v = values(cols, seed, 8.0);
    let mut s = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let mut at = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % cols as u64) as usize
    };
    match kind {
        1 => {
            let ties = 2 + at() % 8;
            for _ in 0..ties {
                v[at()] = 9.5;
            }
        }
        2 => v.fill(1.25),
        3 => v[0] = f32::NAN,
        4 => {
            for _ in 0..cols.div_ceil(4) {
                v[at()] = f32::NAN;
            }
            let i = at();
            v[i] = 9.0;
        }
        5 => v.fill(f32::NEG_INFINITY),
        6 => {
            v.fill(f32::NEG_INFINITY);
            v[at()] = -2.0;
        }
        7 => {
            let i = at();
            v[i] = f32::INFINITY;
            // Another place, where there is one.
            v[(i + 1 + at() % cols.saturating_sub(1).max(1)) % cols] = f32::INFINITY;
        }
        8 => {
            v.fill(f32::NAN);
            v[0] = -1.0;
            v[cols - 1] = 3.0;
        }
        _ => {}
    }
    v
}

fn check_argmax(rows: usize, cols: usize, dt: Dt, pad: usize, seed: u64) {
    let what = format!("rows {rows} cols {cols} {dt:?} pad {pad} seed {seed}");
    let logits: Vec<Vec<f32>> = (0..rows)
        .map(|r| {
            rounded(
                &greedy_row(cols, (r + seed as usize) % 9, seed + r as u64),
                dt,
            )
        })
        .collect();
    // Each row padded to a stride of its own with values larger than any logit: a read past
    // the view (which the fence reports too) would pick one.
    let flat: Vec<f32> = (logits.iter())
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(100.0, pad)))
        .collect();
    let buf = Buf::new(&flat, dt);
    let got = argmax_rows(buf.keys(), cols + pad, rows, cols, seed)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let want: Vec<u32> = logits
        .iter()
        .map(|r| keydiff_model::model::argmax(r))
        .collect();
    assert_eq!(got, want, "{what}");
}

#[test]
fn argmax_rows_matches_the_host_sampler() {
    // Rows shorter than a warp and a block, a block exactly, a block and one, Qwen 2.5's
    // vocabulary (148 values a thread); every dtype; contiguous rows and padded ones; two
    // thread schedules each.
    let shapes = [
        (9, 1),
        (9, 31),
        (9, 1000),
        (9, 1024),
        (9, 1025),
        (9, 5000),
        (2, 151_936),
    ];
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            for (j, pad) in [0, 3].into_iter().enumerate() {
                check_argmax(rows, cols, dt, pad, 300 + 10 * i as u64 + j as u64);
            }
        }
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn argmax_rows_refuses_what_it_cannot_run() {
    let x = vec![0f32; 64];
    let err = |rs, rows, cols| {
        argmax_rows(Keys::F32(&x), rs, rows, cols, 1)
            .unwrap_err()
            .to_string()
    };
    assert!(err(8, 0, 8).contains("0 rows"));
    assert!(err(8, 2, 0).contains("of 0 values"));
    assert!(err(8, 1, i32::MAX as usize - 1000).contains("values from 1 to"));
    assert!(err(4, 2, 8).contains("below the 8 values"));
    assert!(err(16, 8, 16).contains("exceeds"));
}

/// `keys` from element `off` on.
fn keys_from(keys: Keys<'_>, off: usize) -> Keys<'_> {
    match keys {
        Keys::F32(v) => Keys::F32(&v[off..]),
        Keys::F16(v) => Keys::F16(&v[off..]),
        Keys::BF16(v) => Keys::BF16(&v[off..]),
    }
}

/// Where a chunk's queries and keys lie for the RoPE kernel.
#[derive(Clone, Copy, Debug)]
enum RopeLayout {
    /// One fused q/k/v projection output `[rows, (hq + 2 hk) · d]` (a decode step's).
    Fused,
    /// Separate projection outputs `[rows, hq · d]` and `[rows, hk · d]` (a prompt chunk's).
    Separate,
    /// Contiguous `[heads, rows, d]` tensors (Qwen 3's normed queries and keys).
    Heads,
}

/// The emulated RoPE of queries and keys against candle's `rope` / `rope_i` on the CPU over
/// contiguous `[1, heads, rows, d]` copies of the same rounded values (what `Rope::apply_qk`
/// runs off CUDA): bit for bit, in every dtype.
fn check_rope(
    hq: usize,
    hk: usize,
    rows: usize,
    d: usize,
    inter: bool,
    layout: RopeLayout,
    dt: Dt,
) {
    let what = format!("hq {hq} hk {hk} rows {rows} d {d} interleaved {inter} {layout:?} {dt:?}");
    let seed = (hq * 131 + hk * 17 + rows * 7 + d) as u64;
    let half = d / 2;
    // cos and sin of positions 1000 + t at Llama's frequencies, rounded to dt.
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for t in 0..rows {
        for j in 0..half {
            let theta = (1000 + t) as f32 / 500000f32.powf(2.0 * j as f32 / d as f32);
            cos.push(theta.cos());
            sin.push(theta.sin());
        }
    }
    let (cos, sin) = (rounded(&cos, dt), rounded(&sin, dt));
    // The buffers as the layout holds them; element (head, row, j) of q and k at these strides.
    let (q_buf, (q_off, q_hs, q_rs), k_buf, (k_off, k_hs, k_rs)) = match layout {
        RopeLayout::Fused => {
            let w = (hq + 2 * hk) * d;
            let b = rounded(&values(rows * w, seed, 3.0), dt);
            (b.clone(), (0, d, w), b, (hq * d, d, w))
        }
        RopeLayout::Separate => (
            rounded(&values(rows * hq * d, seed, 3.0), dt),
            (0, d, hq * d),
            rounded(&values(rows * hk * d, seed + 1, 3.0), dt),
            (0, d, hk * d),
        ),
        RopeLayout::Heads => (
            rounded(&values(hq * rows * d, seed, 3.0), dt),
            (0, rows * d, d),
            rounded(&values(hk * rows * d, seed + 1, 3.0), dt),
            (0, rows * d, d),
        ),
    };
    let gather = |b: &[f32], heads: usize, (off, hs, rs): (usize, usize, usize)| -> Vec<f32> {
        let mut out = Vec::with_capacity(heads * rows * d);
        for h in 0..heads {
            for t in 0..rows {
                out.extend_from_slice(&b[off + h * hs + t * rs..][..d]);
            }
        }
        out
    };
    let tensor_in = |x: Vec<f32>, shape: &[usize]| {
        let t = Tensor::from_vec(x, shape, &Device::Cpu).unwrap();
        match dt {
            Dt::F32 => t,
            Dt::F16 => t.to_dtype(DType::F16).unwrap(),
            Dt::BF16 => t.to_dtype(DType::BF16).unwrap(),
        }
    };
    let (ct, st) = (
        tensor_in(cos.clone(), &[rows, half]),
        tensor_in(sin.clone(), &[rows, half]),
    );
    let mut want = Vec::new();
    for (b, heads, view) in [
        (&q_buf, hq, (q_off, q_hs, q_rs)),
        (&k_buf, hk, (k_off, k_hs, k_rs)),
    ] {
        let x = tensor_in(gather(b, heads, view), &[1, heads, rows, d]);
        let y = if inter {
            candle_nn::rotary_emb::rope_i(&x, &ct, &st).unwrap()
        } else {
            candle_nn::rotary_emb::rope(&x, &ct, &st).unwrap()
        };
        want.extend(
            y.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
        );
    }
    let (qb, kb) = (Buf::new(&q_buf, dt), Buf::new(&k_buf, dt));
    let (cb, sb) = (Buf::new(&cos, dt), Buf::new(&sin, dt));
    for seed in [1, 2] {
        let got = rope_qk(
            (keys_from(qb.keys(), q_off), q_hs, q_rs),
            (keys_from(kb.keys(), k_off), k_hs, k_rs),
            cb.keys(),
            sb.keys(),
            (hq, hk, rows, d),
            inter,
            seed,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.len(), want.len(), "{what}");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!(
                "{what}, seed {seed}: value {} of row {} of head {}: {} against {}",
                i % d,
                i / d % rows,
                i / d / rows,
                got[i],
                want[i]
            );
        }
    }
}

#[test]
fn rope_matches_candle() {
    // A decode row of Llama-3.2-3B (24 query heads, 8 KV heads, d 128) in the fused q/k/v
    // output; a prompt chunk of Qwen2.5-0.5B (14 and 2, d 64) in separate outputs; Qwen 3's
    // normed heads; d 256; an odd half (d 6); and an 8B-shaped chunk of 128 rows (32 and 8
    // heads, d 128: 327,680 pairs, past the 262,144 one grid covers, so the grid-stride loop
    // takes a second turn). Both pairings (GGUF Llama's interleaved, and halves).
    let cases = [
        (24, 8, 1, 128, RopeLayout::Fused),
        (14, 2, 128, 64, RopeLayout::Separate),
        (16, 8, 9, 128, RopeLayout::Heads),
        (4, 2, 5, 256, RopeLayout::Separate),
        (3, 1, 3, 6, RopeLayout::Fused),
        (32, 8, 128, 128, RopeLayout::Separate),
    ];
    for (hq, hk, rows, d, layout) in cases {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            for inter in [false, true] {
                check_rope(hq, hk, rows, d, inter, layout, dt);
            }
        }
    }
}

/// Bad shapes are errors naming the problem, before anything runs.
#[test]
fn rope_refuses_what_it_cannot_run() {
    let x = vec![0f32; 64];
    let k = |v| (Keys::F32(v), 8, 8);
    let err = |dims, cos_len: usize| {
        rope_qk(
            k(&x),
            k(&x),
            Keys::F32(&x[..cos_len]),
            Keys::F32(&x[..cos_len]),
            dims,
            false,
            1,
        )
        .unwrap_err()
        .to_string()
    };
    assert!(err((1, 1, 2, 7), 8).contains("d even"));
    assert!(err((0, 1, 2, 8), 8).contains("each at least"));
    assert!(err((1, 1, 2, 8), 7).contains("fewer than 2 rows of 4"));
    assert!(err((2, 1, 8, 8), 32).contains("exceed"));
    let f16s = vec![f16::ZERO; 64];
    let mixed = rope_qk(
        k(&x),
        (Keys::F16(&f16s), 8, 8),
        Keys::F32(&x),
        Keys::F32(&x),
        (1, 1, 2, 8),
        false,
        1,
    );
    assert!(mixed.unwrap_err().to_string().contains("one dtype"));
}
