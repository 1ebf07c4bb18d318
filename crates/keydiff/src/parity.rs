//! Logit agreement between two runs: CPU against GPU, GGUF against safetensors, chunk sizes.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use keydiff_cache::{CacheConfig, KvCache};
use keydiff_model::{Logits, Model, Segment};

use crate::engine::{Engine, EngineConfig, GenerateParams, Prompt};
use crate::error::{EngineError, Result};
use crate::source::ModelSource;
use crate::AttentionBackend;

/// How far `other` logits are from `reference` logits.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LogitDiff {
    /// max |other − reference|
    pub max_abs: f32,
    /// `max_abs` divided by max |reference|.
    pub max_rel: f32,
    /// Cosine similarity of the two logit vectors.
    pub cosine: f32,
    pub reference_top1: u32,
    pub other_top1: u32,
}

impl LogitDiff {
    /// True when both pick the same most likely token.
    pub fn top1_equal(&self) -> bool {
        self.reference_top1 == self.other_top1
    }

    /// True when the cosine is at least `min`; never for a NaN cosine (NaN logits).
    pub fn cosine_at_least(&self, min: f32) -> bool {
        self.cosine >= min
    }
}

/// |a − b|, infinite where either is NaN or both are the same infinity: `f32::max` skips NaN,
/// so a NaN logit would otherwise leave the largest difference small.
fn abs_diff(a: f32, b: f32) -> f32 {
    let d = (a - b).abs();
    if d.is_nan() {
        f32::INFINITY
    } else {
        d
    }
}

/// Compares two logit vectors of the same vocabulary. A NaN on either side makes `max_abs`
/// and `max_rel` infinite and `cosine` NaN (which no threshold accepts).
pub fn compare_logits(reference: &[f32], other: &[f32]) -> LogitDiff {
    let max_abs = reference
        .iter()
        .zip(other)
        .map(|(a, b)| abs_diff(*a, *b))
        .fold(0f32, f32::max);
    let scale = reference.iter().map(|x| x.abs()).fold(0f32, f32::max);
    let dot: f64 = reference
        .iter()
        .zip(other)
        .map(|(a, b)| (*a as f64) * (*b as f64))
        .sum();
    let na: f64 = reference
        .iter()
        .map(|a| (*a as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let nb: f64 = other
        .iter()
        .map(|b| (*b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    LogitDiff {
        max_abs,
        max_rel: max_abs / scale.max(f32::MIN_POSITIVE),
        cosine: (dot / (na * nb).max(f64::MIN_POSITIVE)) as f32,
        reference_top1: crate::sampling::argmax(reference),
        other_top1: crate::sampling::argmax(other),
    }
}

/// Seeded random token ids in `[0, vocab)`.
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Loads the same seeded random model of `preset`'s shape under two engine configs (e.g. CPU f32
/// and CUDA bf16), prefills the same `prompt_len` random tokens in chunks, and compares the
/// final logits. `weights`: its linears and embedding quantized to that GGML type (the same
/// blocks on both devices; see [`ModelSource::Random`]), else dense.
pub fn compare_devices(
    preset: &Path,
    seed: u64,
    weights: Option<GgmlDType>,
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
) -> Result<(LogitDiff, AttentionBackend)> {
    compare_devices_decoding(preset, seed, weights, reference, other, prompt_len, 0)
}

/// [`compare_devices`] with the last `decode_steps` tokens of the prompt run as decode steps,
/// one at a time, on both ([`Engine::decode_logits`]): the decode path (decode weights, on a
/// GPU the fused linears and the decode-attention kernel, decode-time eviction).
pub fn compare_devices_decoding(
    preset: &Path,
    seed: u64,
    weights: Option<GgmlDType>,
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
    decode_steps: usize,
) -> Result<(LogitDiff, AttentionBackend)> {
    let (la, lb, attention) = on_both(
        preset,
        seed,
        weights,
        reference,
        other,
        prompt_len,
        |e, t| e.decode_logits(t, e.config().cache.chunk, decode_steps),
    )?;
    Ok((compare_logits(&la, &lb), attention))
}

/// Loads the same seeded random model of `preset`'s shape (drawn on the host, so every device
/// gets the same weights) under `reference`, then under `other`, one at a time, and runs `f`
/// on the same `prompt_len` random tokens in each. Returns both results and the attention
/// backend `other` resolved to.
fn on_both<T>(
    preset: &Path,
    seed: u64,
    weights: Option<GgmlDType>,
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
    f: impl Fn(&Engine, &[u32]) -> Result<T>,
) -> Result<(T, T, AttentionBackend)> {
    let source = ModelSource::Random {
        config: preset.to_path_buf(),
        seed,
        on_host: true,
        weights,
    };
    let a = Engine::load(&source, reference)?;
    let tokens = random_tokens(prompt_len, a.model_config().vocab_size, seed);
    let ra = f(&a, &tokens)?;
    drop(a);
    let b = Engine::load(&source, other)?;
    let rb = f(&b, &tokens)?;
    Ok((ra, rb, b.config().attention))
}

/// How far the per-token NLLs of a perplexity run are from a reference run's.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NllDiff {
    /// max |other − reference| over the scored tokens.
    pub max_abs: f32,
    /// Pearson correlation of the two NLL sequences: which tokens are harder must agree, even
    /// for a random model whose NLLs all sit near ln(vocab).
    pub correlation: f64,
    pub reference_mean: f64,
    pub other_mean: f64,
    /// max |−logprob − NLL| of each run's prompt logprobs ([`GenerateParams::prompt_logprobs`],
    /// with alternatives) against its own perplexity NLLs, over both runs: the same logits
    /// through the logprob path (on a GPU, its device log-softmax and top-k). `None` from
    /// [`compare_nlls`] alone.
    pub logprobs_max_abs: Option<f32>,
}

/// Compares two per-token NLL sequences of the same tokens.
pub fn compare_nlls(reference: &[f32], other: &[f32]) -> NllDiff {
    let mean = |v: &[f32]| v.iter().map(|&x| x as f64).sum::<f64>() / v.len().max(1) as f64;
    let (ma, mb) = (mean(reference), mean(other));
    let (mut sab, mut saa, mut sbb) = (0f64, 0f64, 0f64);
    for (a, b) in reference.iter().zip(other) {
        let (a, b) = (*a as f64 - ma, *b as f64 - mb);
        sab += a * b;
        saa += a * a;
        sbb += b * b;
    }
    NllDiff {
        max_abs: reference
            .iter()
            .zip(other)
            .map(|(a, b)| abs_diff(*a, *b))
            .fold(0f32, f32::max),
        correlation: sab / (saa * sbb).sqrt().max(f64::MIN_POSITIVE),
        reference_mean: ma,
        other_mean: mb,
        logprobs_max_abs: None,
    }
}

/// [`compare_devices`] for perplexity: the same seeded random model and tokens under two
/// configs, every token scored after a chunked prefill (with eviction when the configs have
/// a budget); compares the per-token NLLs.
pub fn compare_device_perplexity(
    preset: &Path,
    seed: u64,
    weights: Option<GgmlDType>,
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
) -> Result<NllDiff> {
    let (pa, pb, _) = on_both(
        preset,
        seed,
        weights,
        reference,
        other,
        prompt_len,
        |e, t| {
            let ppl = e.perplexity(t)?;
            // Perplexity runs all but the last token: so does this prompt, in the same chunks.
            let p = GenerateParams {
                prompt: Prompt::Tokens(t[..t.len() - 1].to_vec()),
                max_tokens: 1,
                prompt_logprobs: Some(5),
                ..Default::default()
            };
            let lps = e.generate(&p, |_| {})?.prompt_logprobs.unwrap_or_default();
            let mut worst = if lps.len() + 1 == ppl.nll.len() {
                0f32
            } else {
                f32::INFINITY
            };
            for (lp, nll) in lps.iter().zip(&ppl.nll) {
                let d = (-lp.logprob - nll).abs();
                // A NaN counts as the worst.
                worst = if d.is_nan() {
                    f32::INFINITY
                } else {
                    worst.max(d)
                };
                // The alternatives come most likely first, and none is less likely than the
                // target unless the target is not among them.
                let sorted = lp.top.windows(2).all(|w| w[0].1 >= w[1].1);
                let first = lp.top.first().map_or(f32::NAN, |t| t.1);
                if !sorted || lp.top.len() != 5 || first < lp.logprob {
                    worst = f32::INFINITY;
                }
            }
            Ok((ppl, worst))
        },
    )?;
    Ok(NllDiff {
        logprobs_max_abs: Some(pa.1.max(pb.1)),
        ..compare_nlls(&pa.0.nll, &pb.0.nll)
    })
}

/// How a segment of a batched pass compares with the same segment run alone (see
/// [`batch_vs_single`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SegmentDiff {
    /// Largest |Δ| between the two sets of logits.
    pub max_abs: f32,
    /// The single run's largest |logit|.
    pub scale: f32,
    /// Every row's top token is the single run's.
    pub top1_equal: bool,
}

/// Largest |Δ| relative to the logits' scale that `check-device --batch` accepts between a
/// batched segment and the same segment alone on a device in bf16/f16 (all rows of a step
/// share one matmul there); on the CPU in f32 it accepts 1e-4 absolute.
pub const MAX_BATCH_REL_DIFF: f32 = 2e-2;

/// [`MAX_BATCH_REL_DIFF`] for GGUF-typed weights on a device. There the kernel is chosen by
/// the number of rows (candle's CUDA quantized matmul: MMVQ up to 8 rows, MMQ above), so a
/// row alone and the same row in a bigger batched step go through different kernels, which
/// quantize the activations to q8_1 in different layouts: measured under the executing mock
/// (bench/results/2026-12-07-executing-mock-gguf.md), rows through the same kernel agreed
/// exactly and rows through the other one by up to 3.0e-2 of the scale (q4_k,
/// tiny-qwen-d64), each within 2.1e-2 of the CPU's exact products. A batch that mixed up
/// sequences differs by the scale itself.
pub const MAX_BATCH_REL_DIFF_QUANTIZED: f32 = 5e-2;

/// The largest |Δ| [`batch_vs_single`]'s segments may have against single runs: absolute,
/// or relative to the logits' scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BatchTolerance {
    /// A bound on |Δ| itself.
    Absolute(f32),
    /// A bound on |Δ| / the logits' scale.
    Relative(f32),
}

impl BatchTolerance {
    /// The bound on |Δ| for logits of `scale`.
    pub fn bound(self, scale: f32) -> f32 {
        match self {
            Self::Absolute(t) => t,
            Self::Relative(t) => t * scale,
        }
    }
}

impl std::fmt::Display for BatchTolerance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Absolute(t) => write!(f, "{t}"),
            Self::Relative(t) => write!(f, "{t} of the logits' scale"),
        }
    }
}

/// The tolerance of [`batch_vs_single`] for a model on `device` in `dtype`, its weights
/// GGUF-typed when `quantized`: 1e-4 absolute on the CPU in f32 (rows are computed one by one
/// there, quantized or not), else relative to the logits' scale:
/// [`MAX_BATCH_REL_DIFF_QUANTIZED`] for quantized weights on a device, [`MAX_BATCH_REL_DIFF`]
/// otherwise.
pub fn batch_tolerance(
    device: &candle_core::Device,
    dtype: candle_core::DType,
    quantized: bool,
) -> BatchTolerance {
    if device.is_cpu() && dtype == candle_core::DType::F32 {
        BatchTolerance::Absolute(1e-4)
    } else if quantized && !device.is_cpu() {
        BatchTolerance::Relative(MAX_BATCH_REL_DIFF_QUANTIZED)
    } else {
        BatchTolerance::Relative(MAX_BATCH_REL_DIFF)
    }
}

/// A batch decode step ([`keydiff_model::Model::forward_batch`]) of three sequences (70, 9
/// and 33 random prompt tokens prefilled in chunks of 16 under `cache`), then a mixed pass
/// ([`keydiff_model::Model::forward_segments`]) of their decode steps with two prompt chunks
/// (a 16-token chunk of a fourth sequence after its first 16 tokens, all its rows' logits; a
/// 5-token first chunk of a fifth, its last row's), against each alone on a fresh copy of its
/// cache, on the model's device. One [`SegmentDiff`] per compared segment: the three batched
/// rows, then the mixed pass's five segments. Fails when a cache's length or position differs
/// between the two. `cache.chunk` must be at least 16.
pub fn batch_vs_single(m: &Model, cache: &CacheConfig) -> Result<Vec<SegmentDiff>> {
    let prompts: Vec<Vec<u32>> = [70usize, 9, 33, 32, 5]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(n, m.config().vocab_size, i as u64))
        .collect();
    // The three decoding sequences prefilled, the fourth's first chunk, the fifth empty.
    let prefilled = || -> Result<Vec<_>> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut c = m.new_cache(cache.clone(), p.len() + 4)?;
                let upto = match i {
                    3 => 16,
                    4 => 0,
                    _ => p.len(),
                };
                for chunk in p[..upto].chunks(16) {
                    m.forward(chunk, &mut c, false)?;
                }
                Ok(c)
            })
            .collect()
    };
    let next = [5u32, 17, 3];
    let segments: Vec<Segment<'_>> = next
        .iter()
        .map(|t| Segment {
            tokens: std::slice::from_ref(t),
            decode: true,
            logits: Logits::Last,
        })
        .chain([
            Segment {
                tokens: &prompts[3][16..],
                decode: false,
                logits: Logits::All,
            },
            Segment {
                tokens: &prompts[4],
                decode: false,
                logits: Logits::Last,
            },
        ])
        .collect();
    // Each segment alone on a fresh copy of its cache: `[rows, vocab]`, and the cache.
    let alone = |i: usize| -> Result<(Vec<Vec<f32>>, KvCache)> {
        let mut c = prefilled()?.swap_remove(i);
        let s = &segments[i];
        let rows = match s.logits {
            Logits::All => m.forward_all(s.tokens, &mut c)?.to_vec2::<f32>()?,
            _ => vec![m.forward(s.tokens, &mut c, s.decode)?.to_vec1::<f32>()?],
        };
        Ok((rows, c))
    };
    let compare = |i: usize, got: &[Vec<f32>], c: &KvCache| -> Result<SegmentDiff> {
        let (want, single) = alone(i)?;
        let mismatch = |what: String| {
            Err(EngineError::Model(keydiff_model::ModelError::Shape(
                format!("sequence {i}: {what}"),
            )))
        };
        if c.len() != single.len() || c.position() != single.position() {
            return mismatch(format!(
                "the batched cache holds {} slots at position {}, alone {} at {}",
                c.len(),
                c.position(),
                single.len(),
                single.position()
            ));
        }
        if got.len() != want.len() {
            return mismatch(format!(
                "{} rows of logits, alone {}",
                got.len(),
                want.len()
            ));
        }
        let mut d = SegmentDiff {
            max_abs: 0.0,
            scale: 0.0,
            top1_equal: true,
        };
        for (g, w) in got.iter().zip(&want) {
            let row = compare_logits(w, g);
            d.max_abs = d.max_abs.max(row.max_abs);
            d.scale = w.iter().fold(d.scale, |a, x| a.max(x.abs()));
            d.top1_equal &= row.top1_equal();
        }
        Ok(d)
    };
    let mut out = Vec::new();
    let mut batched = prefilled()?;
    let mut refs: Vec<_> = batched.iter_mut().take(3).collect();
    let rows = m.forward_batch(&next, &mut refs)?.to_vec2::<f32>()?;
    for (i, row) in rows.into_iter().enumerate() {
        out.push(compare(i, &[row], &batched[i])?);
    }
    let mut mixed = prefilled()?;
    let mut refs: Vec<_> = mixed.iter_mut().collect();
    let logits = m.forward_segments(&segments, &mut refs)?;
    for (i, l) in logits.into_iter().enumerate() {
        let l = l.ok_or_else(|| {
            EngineError::Model(keydiff_model::ModelError::Shape(format!(
                "segment {i} got no logits"
            )))
        })?;
        out.push(compare(i, &l.to_vec2::<f32>()?, &mixed[i])?);
    }
    Ok(out)
}

/// [`batch_vs_single`] on a seeded random model of `preset`'s shape (`weights` as in
/// [`compare_devices`]) under `cfg` (its device, dtypes and attention; the cache is `cache`),
/// and the attention backend it resolved to.
pub fn compare_batch(
    preset: &Path,
    seed: u64,
    weights: Option<GgmlDType>,
    cfg: &EngineConfig,
    cache: &CacheConfig,
) -> Result<(Vec<SegmentDiff>, AttentionBackend)> {
    let source = ModelSource::Random {
        config: preset.to_path_buf(),
        seed,
        on_host: true,
        weights,
    };
    let e = Engine::load(&source, cfg)?;
    Ok((batch_vs_single(e.model(), cache)?, e.config().attention))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_logits_compare_as_equal() {
        let a = [1.0f32, -2.0, 0.5];
        let d = compare_logits(&a, &a);
        assert_eq!((d.max_abs, d.max_rel), (0.0, 0.0));
        assert!((d.cosine - 1.0).abs() < 1e-6);
        assert!(d.top1_equal());
    }

    #[test]
    fn a_nan_logit_is_never_close() {
        let reference = [1.0f32, -2.0, 0.5, 0.25];
        for other in [
            [1.0f32, f32::NAN, 0.5, 0.25],
            [f32::NAN; 4],
            [1.0, -2.0, f32::INFINITY, 0.25],
        ] {
            let d = compare_logits(&reference, &other);
            assert_eq!(d.max_abs, f32::INFINITY, "{other:?}");
            assert_eq!(d.max_rel, f32::INFINITY, "{other:?}");
            // check-device accepts only `cosine >= MIN`: NaN fails it.
            assert!(!d.cosine_at_least(0.99), "{other:?}: cosine {}", d.cosine);
        }
        // A NaN on the reference's side too.
        let d = compare_logits(&[f32::NAN, 1.0], &[0.0, 1.0]);
        assert_eq!(d.max_abs, f32::INFINITY);
        let n = compare_nlls(&[1.0, f32::NAN], &[1.0, 2.0]);
        assert_eq!(n.max_abs, f32::INFINITY);
        assert!(n.correlation.is_nan());
    }

    /// Exact on the CPU in f32 (quantized or not: the CPU computes rows one by one); the wider
    /// bound only where the kernel depends on the rows, quantized weights on a device.
    #[test]
    fn batch_tolerance_by_device_dtype_and_weights() {
        use candle_core::{DType, Device};
        use BatchTolerance::{Absolute, Relative};
        let cpu = Device::Cpu;
        assert_eq!(batch_tolerance(&cpu, DType::F32, false), Absolute(1e-4));
        assert_eq!(batch_tolerance(&cpu, DType::F32, true), Absolute(1e-4));
        for q in [false, true] {
            assert_eq!(
                batch_tolerance(&cpu, DType::BF16, q),
                Relative(MAX_BATCH_REL_DIFF)
            );
        }
        const { assert!(MAX_BATCH_REL_DIFF < MAX_BATCH_REL_DIFF_QUANTIZED) };
        // The bound: absolute ignores the scale, relative scales with it.
        assert_eq!(Absolute(1e-4).bound(7.0), 1e-4);
        assert_eq!(Relative(0.5).bound(7.0), 3.5);
        assert_eq!(Absolute(1e-4).to_string(), "0.0001");
        assert_eq!(Relative(0.02).to_string(), "0.02 of the logits' scale");
        // A device (the CUDA build only: without it there is none to ask for).
        #[cfg(feature = "cuda")]
        if let Ok(gpu) = Device::new_cuda(0) {
            for dtype in [DType::F32, DType::BF16] {
                assert_eq!(
                    batch_tolerance(&gpu, dtype, false),
                    Relative(MAX_BATCH_REL_DIFF)
                );
                assert_eq!(
                    batch_tolerance(&gpu, dtype, true),
                    Relative(MAX_BATCH_REL_DIFF_QUANTIZED)
                );
            }
        }
    }
}
