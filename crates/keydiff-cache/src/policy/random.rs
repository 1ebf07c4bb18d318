//! `random`: seeded uniform scores, a control.

use super::Policy;
use crate::layer::LayerCache;
use crate::Result;

/// Random scores from a seeded SplitMix64 stream.
#[derive(Clone)]
pub struct RandomPolicy {
    state: u64,
}

impl RandomPolicy {
    /// A stream starting at `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next(&mut self) -> f32 {
        // SplitMix64 (Steele et al. 2014)
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

impl Policy for RandomPolicy {
    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok((0..layer.kv_heads())
            .map(|_| (0..layer.len()).map(|_| self.next()).collect())
            .collect())
    }

    fn saved_state(&self) -> Vec<u64> {
        vec![self.state]
    }

    fn restore_state(&mut self, words: &[u64]) -> Result<()> {
        match words {
            [w] => {
                self.state = *w;
                Ok(())
            }
            _ => Err(crate::CacheError::Config(format!(
                "the random policy's state is one word, not {}",
                words.len()
            ))),
        }
    }
}
