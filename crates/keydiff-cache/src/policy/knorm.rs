//! `knorm` (kvpress): keep the keys of smallest L2 norm, s_i = −‖k_i‖.

use candle_core::DType;

use super::Policy;
use crate::layer::LayerCache;
use crate::Result;

/// The key-norm policy.
pub struct Knorm;

impl Policy for Knorm {
    fn score(&mut self, layer: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        let k = layer.keys()?.to_dtype(DType::F32)?;
        Ok(k.sqr()?.sum(2)?.sqrt()?.neg()?.to_vec2::<f32>()?)
    }
}
