//! Logit agreement between two runs: CPU against GPU, GGUF against safetensors, chunk sizes.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::engine::{Engine, EngineConfig};
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
    let source = ModelSource::Random {
        config: preset.to_path_buf(),
        seed,
        on_host: true,
    };
    let a = Engine::load(&source, reference)?;
    let tokens = random_tokens(prompt_len, a.model_config().vocab_size, seed);
    let la = a.prefill_logits(&tokens, reference.cache.chunk)?;
    drop(a);
    let b = Engine::load(&source, other)?;
    let lb = b.prefill_logits(&tokens, other.cache.chunk)?;
    Ok((compare_logits(&la, &lb), b.config().attention))
}
