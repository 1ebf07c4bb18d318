//! StreamingLLM (Xiao et al. 2024): the first sinks plus the most recent tokens. Sinks are
//! protected by the shared selection; the score is the position, so the newest survive.
//! Positions are not re-assigned.

use super::Policy;
use crate::layer::LayerCache;
use crate::Result;

/// The attention-sink policy.
pub struct Sink;

impl Policy for Sink {
    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok((0..layer.kv_heads())
            .map(|h| layer.positions(h).iter().map(|&p| p as f32).collect())
            .collect())
    }
}
