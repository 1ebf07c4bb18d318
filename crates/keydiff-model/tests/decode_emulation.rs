//! The CUDA decode-attention kernel (`keydiff_decode_*` of `kernels/keydiff.cu`) under the CPU
//! emulation of CUDA (`keydiff_kernels::emu`), against the eager path (`attention_probs`,
//! `attention_output` in f32 on the widened inputs) and the CPU decode kernel: every dtype, head
//! dims 16 to 256 (odd ones too), GQA groups 1 to 8, one split and several, cache views with
//! room past their rows. On hardware it runs in `scripts/gpu-check.sh`.

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use keydiff_kernels::emu::{decode_attention, Keys};
use keydiff_kernels::geometry::decode_split;
use keydiff_model::attention::{attention_output, attention_probs, decode_attention_cpu};

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
                let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
                let worst = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(
                        0f32,
                        |m, x| if x.is_nan() { f32::INFINITY } else { m.max(x) },
                    );
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
