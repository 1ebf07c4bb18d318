//! `knorm` (kvpress): keep the keys of smallest L2 norm, s_i = −‖k_i‖.

use candle_core::{DType, Tensor};

use super::Policy;
use crate::layer::LayerCache;
use crate::Result;

/// The key-norm policy.
#[derive(Clone)]
pub struct Knorm;

impl Policy for Knorm {
    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_tensor(layer, None)?.to_vec2::<f32>()?)
    }

    /// On the cache's device.
    fn score_tensor(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Tensor> {
        let k = layer.keys()?.to_dtype(DType::F32)?;
        Ok(k.sqr()?.sum(2)?.sqrt()?.neg()?)
    }
}
