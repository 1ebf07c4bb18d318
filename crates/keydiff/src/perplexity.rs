//! Perplexity of a text under a cache policy: the text is prefilled in chunks exactly as a
//! prompt is (evicting after each chunk), and every token after the first is scored on the
//! logits of the position before it.

use serde::Serialize;

/// Per-token negative log-likelihoods of one text, with what the run cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Perplexity {
    /// `nll[i]` = −ln p(token i + 1 | tokens ..= i), natural log; one fewer than the tokens.
    pub nll: Vec<f32>,
    /// Seconds of the chunked prefill and scoring.
    pub seconds: f64,
    /// Evictions run and slots evicted (per layer and head, summed).
    pub evictions: usize,
    pub evicted_slots: usize,
    /// Bytes of the K/V buffers (allocated once).
    pub peak_kv_bytes: usize,
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
    }
}
