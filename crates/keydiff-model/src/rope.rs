//! Rotary position embedding at absolute positions, with Llama 3 frequency scaling.
//!
//! cos/sin are computed per chunk from the positions actually used, so there is no table and no
//! maximum position baked in (candle's quantized_llama stops at 4096; we do not).

use candle_core::{DType, Device, Tensor};

use crate::config::{Llama3RopeScaling, ModelConfig};
use crate::error::Result;

/// Inverse frequencies of one model, and which rotation layout its Q/K weights expect.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    interleaved: bool,
}

impl Rope {
    /// Builds the frequencies from `rope_theta`, Llama 3 scaling, and GGUF `rope_freqs` factors.
    pub fn new(cfg: &ModelConfig, freq_factors: Option<Vec<f32>>) -> Self {
        let d = cfg.head_dim;
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64) as f32)
            .collect();
        if let Some(s) = &cfg.rope_scaling {
            llama3_scale(&mut inv_freq, s);
        }
        if let Some(f) = freq_factors {
            // llama.cpp divides theta by the factor of each frequency (Llama 3.1 `rope_freqs`).
            for (x, f) in inv_freq.iter_mut().zip(f) {
                *x /= f;
            }
        }
        Self {
            inv_freq,
            interleaved: cfg.rope_interleaved,
        }
    }

    /// cos and sin, `[len, head_dim / 2]`, for positions `pos0 .. pos0 + len`.
    pub fn cos_sin(
        &self,
        pos0: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.cos_sin_at(pos0..pos0 + len, dtype, device)
    }

    /// cos and sin, `[len, head_dim / 2]`, a row for each of `positions` (the rows of a batch
    /// of sequences, each at its own position).
    pub fn cos_sin_at(
        &self,
        positions: impl ExactSizeIterator<Item = usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let len = positions.len();
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for p in positions {
            for &f in &self.inv_freq {
                let theta = p as f32 * f;
                cos.push(theta.cos());
                sin.push(theta.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (len, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (len, half), device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }

    /// Rotates `x`, `[1, heads, len, head_dim]` (contiguous).
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        Ok(if self.interleaved {
            candle_nn::rotary_emb::rope_i(x, cos, sin)?
        } else {
            candle_nn::rotary_emb::rope(x, cos, sin)?
        })
    }
}

/// Llama 3 `rope_type = "llama3"`, as transformers' `_compute_llama3_parameters`.
fn llama3_scale(inv_freq: &mut [f32], s: &Llama3RopeScaling) {
    let old_ctx = s.original_max_position_embeddings as f64;
    let low_wavelen = old_ctx / s.low_freq_factor;
    let high_wavelen = old_ctx / s.high_freq_factor;
    for f in inv_freq.iter_mut() {
        let freq = *f as f64;
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let scaled = if wavelen < high_wavelen {
            freq
        } else if wavelen > low_wavelen {
            freq / s.factor
        } else {
            let smooth =
                (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
            (1.0 - smooth) * freq / s.factor + smooth * freq
        };
        *f = scaled as f32;
    }
}
