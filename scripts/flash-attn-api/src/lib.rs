//! Type-checking stand-in for `candle_flash_attn` 0.11.1 (see Cargo.toml): the signature of
//! `flash_attn` copied from the real crate, so that keydiff's `flash-attn` code is type-checked
//! in CI. Calling it is an error: builds that run use the real crate.

use candle_core::{Result, Tensor};

/// Same signature as `candle_flash_attn::flash_attn` 0.11.1.
pub fn flash_attn(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _softmax_scale: f32,
    _causal: bool,
) -> Result<Tensor> {
    candle_core::bail!("type-checking stand-in for candle-flash-attn: build with the real crate")
}
