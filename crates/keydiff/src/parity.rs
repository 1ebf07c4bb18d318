//! Logit agreement between two runs: CPU against GPU, GGUF against safetensors, chunk sizes.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::engine::{Engine, EngineConfig, GenerateParams, Prompt};
use crate::error::Result;
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
}

/// Compares two logit vectors of the same vocabulary.
pub fn compare_logits(reference: &[f32], other: &[f32]) -> LogitDiff {
    let max_abs = reference
        .iter()
        .zip(other)
        .map(|(a, b)| (a - b).abs())
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
/// final logits.
pub fn compare_devices(
    preset: &Path,
    seed: u64,
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
) -> Result<(LogitDiff, AttentionBackend)> {
    let (la, lb, attention) = on_both(preset, seed, reference, other, prompt_len, |e, t| {
        e.prefill_logits(t, e.config().cache.chunk)
    })?;
    Ok((compare_logits(&la, &lb), attention))
}

/// Loads the same seeded random model of `preset`'s shape (drawn on the host, so every device
/// gets the same weights) under `reference`, then under `other`, one at a time, and runs `f`
/// on the same `prompt_len` random tokens in each. Returns both results and the attention
/// backend `other` resolved to.
fn on_both<T>(
    preset: &Path,
    seed: u64,
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
    f: impl Fn(&Engine, &[u32]) -> Result<T>,
) -> Result<(T, T, AttentionBackend)> {
    let source = ModelSource::Random {
        config: preset.to_path_buf(),
        seed,
        on_host: true,
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
            .map(|(a, b)| (a - b).abs())
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
    reference: &EngineConfig,
    other: &EngineConfig,
    prompt_len: usize,
) -> Result<NllDiff> {
    let (pa, pb, _) = on_both(preset, seed, reference, other, prompt_len, |e, t| {
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
    })?;
    Ok(NllDiff {
        logprobs_max_abs: Some(pa.1.max(pb.1)),
        ..compare_nlls(&pa.0.nll, &pb.0.nll)
    })
}
