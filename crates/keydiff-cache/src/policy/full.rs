//! `full`: nothing is evicted, so nothing is ever scored.

use super::Policy;
use crate::layer::LayerCache;
use crate::{CacheError, Result};

/// The full cache.
#[derive(Clone)]
pub struct Full;

impl Policy for Full {
    fn score(&mut self, _: &LayerCache, _: Option<&crate::AttnStats>) -> Result<Vec<Vec<f32>>> {
        Err(CacheError::Config("policy `full` never evicts".into()))
    }
}
