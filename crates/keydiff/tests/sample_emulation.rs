//! The device's sampler (`keydiff_sample_rows_*` in kernels/keydiff.cu) under the kernel
//! emulation against the host's draw (`keydiff::draw`), row by row: the same token, unless the
//! host's own token changes when `r`, top-p or min-p move by 2e-7 (the kernel sums weights in
//! fixed point, within ~n · 2^-45 of the host's f64 sums; such rows are counted and must stay
//! rare). Rows with no finite logit must come back as the host's argmax with the no-draw
//! flag; greedy rows (temperature 0) as the argmax. Every dtype, rows padded to a stride of
//! their own, two thread schedules; the memory checker is on.

use half::{bf16, f16};
use keydiff::kernel_check::host_draw;
use keydiff::Sampling;
use keydiff_kernels::emu::{sample_rows, Keys};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug)]
enum Dt {
    F32,
    F16,
    BF16,
}

fn rounded(x: &[f32], dt: Dt) -> Vec<f32> {
    match dt {
        Dt::F32 => x.to_vec(),
        Dt::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        Dt::BF16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
    }
}

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

/// A row of logits of kind `kind`: 0 spread values; 1 an LLM-like row (a few large values,
/// a long tail, the largest tied at two places); 2 small integers (ties everywhere); 3 NaN,
/// −∞ and +∞ among the values (none of them a candidate); 4 no finite value; 5 one finite
/// value; 6 zeros of both signs tied at the top, negative values below; 7 every value the same
/// (the order is the indices': a draw near 1 takes the last index).
fn row(cols: usize, kind: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut v: Vec<f32> = (0..cols).map(|_| rng.random_range(-8.0f32..8.0)).collect();
    match kind {
        1 => {
            v.iter_mut()
                .for_each(|x| *x = rng.random_range(-12.0f32..2.0));
            for _ in 0..5.min(cols) {
                let i = rng.random_range(0..cols);
                v[i] = rng.random_range(6.0f32..14.0);
            }
            let (a, b) = (rng.random_range(0..cols), rng.random_range(0..cols));
            v[a] = 15.0;
            v[b] = 15.0;
        }
        2 => v
            .iter_mut()
            .for_each(|x| *x = rng.random_range(-2i32..=2) as f32),
        3 => {
            for _ in 0..cols.div_ceil(5) {
                let i = rng.random_range(0..cols);
                v[i] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY][rng.random_range(0..3)];
            }
        }
        4 => {
            for x in v.iter_mut() {
                *x = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY][rng.random_range(0..3)];
            }
        }
        5 => {
            v.fill(f32::NEG_INFINITY);
            v[rng.random_range(0..cols)] = -3.5;
        }
        6 => {
            v.iter_mut()
                .for_each(|x| *x = rng.random_range(-6.0f32..-0.5));
            for _ in 0..3.min(cols) {
                let i = rng.random_range(0..cols);
                v[i] = if rng.random_bool(0.5) { 0.0 } else { -0.0 };
            }
        }
        7 => v.fill(0.75),
        _ => {}
    }
    v
}

/// Sampler settings: (temperature, top-k, top-p, min-p, temperature before top-p and min-p:
/// vLLM's order, else llama.cpp's).
const SETTINGS: [(f32, usize, f32, f32, bool); 13] = [
    (1.0, 0, 1.0, 0.0, false),
    (0.7, 40, 0.9, 0.0, false),
    (1.5, 0, 0.95, 0.05, false),
    (0.3, 5, 1.0, 0.0, false),
    (2.0, 0, 1.0, 0.1, false),
    (0.8, 1, 1.0, 0.0, false),
    (1.0, 1_000_000, 0.5, 0.0, false),
    (0.6, 3, 0.3, 0.9, false),
    (1.2, 0, 0.999, 0.0, false),
    (0.7, 0, 0.8, 0.1, true),
    (1.8, 40, 0.95, 0.05, true),
    (0.3, 0, 0.5, 0.2, true),
    (0.0, 0, 1.0, 0.0, false),
];

fn sampling(
    (temperature, top_k, top_p, min_p, temperature_first): (f32, usize, f32, f32, bool),
) -> Sampling {
    Sampling {
        temperature,
        top_k,
        top_p,
        min_p,
        temperature_first,
        ..Sampling::default()
    }
}

/// The host's token for `logits` and whether rounding cannot decide it
/// (`kernel_check::host_draw`, as `check-kernels` takes it).
fn host(logits: &[f32], c: &Sampling, r: f32) -> (u32, bool) {
    host_draw(logits, &c.draw_params(r))
}

/// `per` rows of `cols` logits under each setting (kinds in turn), in `dt`, padded by `pad`
/// with values larger than any logit: returns (rows compared, rows left out as within
/// rounding of a boundary).
fn check(cols: usize, dt: Dt, pad: usize, seed: u64, per: usize) -> (usize, usize) {
    let what = format!("cols {cols} {dt:?} pad {pad} seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut logits = Vec::new();
    let mut params = Vec::new();
    for (s, &set) in SETTINGS.iter().enumerate() {
        for j in 0..per {
            let kind = (s + j) % 8;
            logits.push(rounded(&row(cols, kind, &mut rng), dt));
            // Each setting's rows take r = 0, 1 − 2^-25 and random ones in turn (one row a
            // setting still sees all three over the settings); rows of one value, near 1 or
            // random.
            let near_one = 1.0 - f32::EPSILON / 2.0;
            let r = match kind {
                7 if j % 2 == 0 => near_one,
                7 => rng.random::<f32>(),
                _ => match (s + j) % 5 {
                    0 => 0.0,
                    1 => near_one,
                    _ => rng.random::<f32>(),
                },
            };
            params.push((sampling(set), r));
        }
    }
    // And a row of one value drawn from untruncated near 1: the last index.
    logits.push(rounded(&row(cols, 7, &mut rng), dt));
    params.push((sampling(SETTINGS[0]), 1.0 - f32::EPSILON / 2.0));
    let flat: Vec<f32> = (logits.iter())
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(100.0, pad)))
        .collect();
    let words: Vec<u32> = (params.iter())
        .flat_map(|(c, r)| c.draw_params(*r).words())
        .collect();
    let buf = Buf::new(&flat, dt);
    let got = sample_rows(buf.keys(), cols + pad, logits.len(), cols, &words, seed)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (mut compared, mut near) = (0, 0);
    for (i, (l, (c, r))) in logits.iter().zip(&params).enumerate() {
        let (want, stable) = host(l, c, *r);
        if !stable {
            near += 1;
            continue;
        }
        compared += 1;
        assert_eq!(
            got[i],
            want,
            "{what}: row {i} (kind {}), {c:?}, r {r}",
            (i / per + i % per) % 8
        );
    }
    (compared, near)
}

#[test]
fn sampled_tokens_are_the_host_draws() {
    let (mut compared, mut near) = (0, 0);
    // 257: the first vocabulary with a second index digit.
    for (i, &(cols, per)) in [(1, 4), (31, 4), (257, 3), (300, 7), (1025, 3), (5000, 3)]
        .iter()
        .enumerate()
    {
        for dt in [Dt::F32, Dt::F16, Dt::BF16] {
            for (j, pad) in [0, 3].into_iter().enumerate() {
                let (c, n) = check(cols, dt, pad, 500 + 10 * i as u64 + j as u64, per);
                compared += c;
                near += n;
            }
        }
    }
    eprintln!("{compared} rows compared, {near} within rounding of a boundary");
    assert!(
        near * 20 <= compared,
        "{near} of {compared} rows near a boundary"
    );
}

/// Qwen 2.5's vocabulary (148 values a thread) in f32 and bf16, and 65,537 values (the first
/// with a third index digit) in f16: each setting once.
#[test]
fn sampled_tokens_over_a_large_vocabulary_are_the_host_draws() {
    let mut near = 0;
    for (j, (cols, dt)) in [(151_936, Dt::F32), (151_936, Dt::BF16), (65_537, Dt::F16)]
        .into_iter()
        .enumerate()
    {
        near += check(cols, dt, 0, 700 + j as u64, 1).1;
    }
    assert!(near <= 3, "{near} rows near a boundary");
}

/// Bad shapes and parameters are errors naming the problem, before anything runs.
#[test]
fn sample_rows_refuses_what_it_cannot_run() {
    let x = vec![0f32; 64];
    let w = vec![0u32; 5 * 8];
    let err = |rs, rows, cols, p: &[u32]| {
        sample_rows(Keys::F32(&x), rs, rows, cols, p, 1)
            .unwrap_err()
            .to_string()
    };
    assert!(err(8, 0, 8, &[]).contains("0 rows"));
    assert!(err(8, 2, 0, &w[..10]).contains("of 0 values"));
    // Past 2^20 values a sum of weights could overflow the kernel's fixed point.
    assert!(err(8, 1, (1 << 20) + 1, &w[..5]).contains("values from 1 to 1048576"));
    assert!(err(4, 2, 8, &w[..10]).contains("below the 8 values"));
    assert!(err(16, 8, 16, &w).contains("exceeds"));
    assert!(err(8, 2, 8, &w[..9]).contains("9 parameter words for 2 rows"));
}
