//! Perplexity of a text under a cache policy: the text is prefilled in chunks exactly as a
//! prompt is (evicting after each chunk), and every token after the first is scored on the
//! logits of the position before it.
//!
//! A text longer than one window is scored in overlapping windows (Hugging Face's strided
//! perplexity): window k runs tokens `k·S .. k·S + W` on a fresh cache, and scores only the
//! tokens no earlier window scored. Every token after the first is scored exactly once, each
//! beyond the first window with at least `W − S` tokens before it.

use std::time::Instant;

use candle_core::Tensor;
use serde::Serialize;

use crate::error::{EngineError, Result};
use crate::Engine;

/// Per-token negative log-likelihoods of one text, with what the run cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Perplexity {
    /// `nll[i]` = −ln p(token i + 1 | the tokens of its window up to i), natural log; one
    /// fewer than the tokens.
    pub nll: Vec<f32>,
    /// Seconds of the chunked prefills and scoring.
    pub seconds: f64,
    /// Windows run (1 unless the text was scored in windows).
    pub windows: usize,
    /// Evictions run and slots evicted (per layer and head, summed over windows).
    pub evictions: usize,
    pub evicted_slots: usize,
    /// Bytes of one window's K/V buffers (each window allocates its own, after the previous
    /// one's are freed).
    pub peak_kv_bytes: usize,
}

impl Engine {
    /// Perplexity of `tokens` under the engine's cache settings: they are prefilled in chunks
    /// of B as a prompt is, evicting after each chunk, and token i + 1 is scored on the logits
    /// at token i (every logit row of every chunk; llama-perplexity's measure over one
    /// window). At least two tokens, at most the model's context.
    pub fn perplexity(&self, tokens: &[u32]) -> Result<Perplexity> {
        self.check_ppl_tokens(tokens)?;
        self.within_context(tokens.len())?;
        self.ppl_windows(tokens, tokens.len(), 1)
    }

    /// Perplexity of `tokens` in windows of `window` tokens, `stride` apart (see the module
    /// doc): each window is prefilled afresh as [`Engine::perplexity`] prefills a text, and
    /// scores only the tokens earlier windows did not. `1 <= stride < window <= context`, so
    /// that consecutive windows share at least one token. A text of at most `window` tokens
    /// is one window: the same numbers as [`Engine::perplexity`].
    pub fn perplexity_windowed(
        &self,
        tokens: &[u32],
        window: usize,
        stride: usize,
    ) -> Result<Perplexity> {
        self.check_ppl_tokens(tokens)?;
        let context = self.model_config().context();
        if window < 2 {
            return Err(EngineError::BadParams(format!(
                "a perplexity window needs at least 2 tokens, got {window}"
            )));
        }
        if window > context {
            return Err(EngineError::BadParams(format!(
                "a perplexity window of {window} tokens is beyond the model's context of {context}"
            )));
        }
        if stride == 0 || stride >= window {
            return Err(EngineError::BadParams(format!(
                "the perplexity stride must be from 1 to the window minus 1 ({}), got {stride}: \
                 each window must share a token with the one before, to score the token after it",
                window - 1
            )));
        }
        self.ppl_windows(tokens, window, stride)
    }

    fn check_ppl_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.len() < 2 {
            return Err(EngineError::BadParams(format!(
                "perplexity needs at least 2 tokens, got {}",
                tokens.len()
            )));
        }
        self.check_vocab(tokens)
    }

    /// Scores `tokens` in windows (parameters checked).
    fn ppl_windows(&self, tokens: &[u32], window: usize, stride: usize) -> Result<Perplexity> {
        let t0 = Instant::now();
        let model = self.model();
        let cache_cfg = &self.config().cache;
        let chunk = cache_cfg.chunk;
        let n = tokens.len();
        // A window runs all its tokens but the last, which is only a target.
        let run = window.min(n) - 1;
        let logits_bytes = self.chunk_logits_bytes(run);
        let mut out = Perplexity {
            nll: Vec::with_capacity(n - 1),
            seconds: 0.0,
            windows: 0,
            evictions: 0,
            evicted_slots: 0,
            peak_kv_bytes: 0,
        };
        let mut start = 0;
        loop {
            let end = (start + window).min(n);
            let inputs = &tokens[start..end - 1];
            // Row r of this window scores token start + r + 1; the rows before `first` score
            // tokens an earlier window scored.
            let first = out.nll.len() - start;
            let mut cache = self.alloc_cache_with(cache_cfg.clone(), inputs.len(), logits_bytes)?;
            for (i, piece) in inputs.chunks(chunk).enumerate() {
                let a = i * chunk;
                if a + piece.len() <= first {
                    // Only its K/V are needed: the LM head runs on one row.
                    model.forward(piece, &mut cache, false)?;
                    continue;
                }
                let logits = model.forward_all(piece, &mut cache)?;
                let skip = first.saturating_sub(a);
                let rows = logits.narrow(0, skip, piece.len() - skip)?;
                let targets = &tokens[start + a + skip + 1..start + a + piece.len() + 1];
                out.nll.extend(rows_nll(&rows, targets)?);
            }
            let counters = cache.counters();
            out.evictions += counters.evictions;
            out.evicted_slots += counters.evicted_slots;
            out.peak_kv_bytes = out.peak_kv_bytes.max(cache.bytes());
            out.windows += 1;
            if end == n {
                break;
            }
            start += stride;
        }
        debug_assert_eq!(out.nll.len(), n - 1);
        out.seconds = t0.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// −ln softmax(row)[target] for each logit row `[rows, vocab]` (f32) and its target.
fn rows_nll(rows: &Tensor, targets: &[u32]) -> Result<Vec<f32>> {
    let max = rows.max_keepdim(1)?;
    let lse = (rows.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
    let target = Tensor::new(targets, rows.device())?.unsqueeze(1)?;
    let picked = rows.gather(&target, 1)?;
    Ok((lse - picked)?.squeeze(1)?.to_vec1::<f32>()?)
}

impl Perplexity {
    /// Mean NLL over `range` of the scored tokens (all of them for `..`).
    pub fn mean_nll(&self, range: impl std::slice::SliceIndex<[f32], Output = [f32]>) -> f64 {
        let v = &self.nll[range];
        v.iter().map(|&x| x as f64).sum::<f64>() / v.len().max(1) as f64
    }

    /// exp(mean NLL): the perplexity.
    pub fn ppl(&self) -> f64 {
        self.mean_nll(..).exp()
    }

    /// Standard error of the mean NLL (sample standard deviation / √n), as llama-perplexity
    /// reports it. Tokens of one text are not independent: read it as a scale, not a bound.
    pub fn nll_stderr(&self) -> f64 {
        let n = self.nll.len();
        if n < 2 {
            return f64::NAN;
        }
        let mean = self.mean_nll(..);
        let var = self
            .nll
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / (n - 1) as f64;
        (var / n as f64).sqrt()
    }

    /// Perplexity over each of `parts` equal spans of the scored tokens, in order: eviction
    /// shows as a rise in the later parts.
    pub fn ppl_by_part(&self, parts: usize) -> Vec<f64> {
        let n = self.nll.len();
        (0..parts)
            .map(|p| {
                let (a, b) = (p * n / parts, (p + 1) * n / parts);
                // A part with no token has no perplexity (not exp(0) = 1).
                if a == b {
                    return f64::NAN;
                }
                self.mean_nll(a..b).exp()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(nll: Vec<f32>) -> Perplexity {
        Perplexity {
            nll,
            seconds: 0.0,
            windows: 1,
            evictions: 0,
            evicted_slots: 0,
            peak_kv_bytes: 0,
        }
    }

    #[test]
    fn statistics() {
        let x = p(vec![1.0, 2.0, 3.0, 6.0]);
        assert_eq!(x.mean_nll(..), 3.0);
        assert!((x.ppl() - 3f64.exp()).abs() < 1e-12);
        // sample sd of [1,2,3,6] = sqrt(14/3); / sqrt(4)
        assert!((x.nll_stderr() - (14.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12);
        let parts = x.ppl_by_part(2);
        assert!((parts[0] - 1.5f64.exp()).abs() < 1e-12);
        assert!((parts[1] - 4.5f64.exp()).abs() < 1e-12);
        assert!(p(vec![1.0]).nll_stderr().is_nan());
        // Fewer tokens than parts: the empty parts have none.
        let parts = p(vec![1.0, 2.0]).ppl_by_part(4);
        assert!(parts[0].is_nan() && parts[2].is_nan(), "{parts:?}");
        assert!((parts[1] - 1f64.exp()).abs() < 1e-12 && (parts[3] - 2f64.exp()).abs() < 1e-12);
    }
}
