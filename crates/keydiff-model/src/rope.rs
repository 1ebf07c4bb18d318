//! Rotary position embedding at absolute positions, with Llama 3, linear and YaRN frequency
//! scaling.
//!
//! cos/sin are computed per chunk from the positions actually used, so there is no table and no
//! maximum position baked in (candle's quantized_llama stops at 4096; we do not).

use candle_core::{DType, Device, Tensor};

use crate::config::{Llama3RopeScaling, ModelConfig, RopeScaling, YarnRopeScaling};
use crate::error::Result;

/// Inverse frequencies of one model, and which rotation layout its Q/K weights expect.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// cos and sin are multiplied by it (YaRN's attention factor; 1 otherwise).
    scale: f32,
    interleaved: bool,
    /// GGUF `rope_freqs` factors, kept to rebuild the frequencies for another config.
    freq_factors: Option<Vec<f32>>,
}

impl Rope {
    /// Builds the frequencies from `rope_theta`, the RoPE scaling, and GGUF `rope_freqs`
    /// factors.
    pub fn new(cfg: &ModelConfig, freq_factors: Option<Vec<f32>>) -> Self {
        let d = cfg.head_dim;
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64) as f32)
            .collect();
        let mut scale = 1.0;
        match &cfg.rope_scaling {
            None => {}
            Some(RopeScaling::Llama3(s)) => llama3_scale(&mut inv_freq, s),
            Some(RopeScaling::Linear { factor }) => {
                for f in inv_freq.iter_mut() {
                    *f = (*f as f64 / factor) as f32;
                }
            }
            Some(RopeScaling::Yarn(y)) => {
                yarn_scale(&mut inv_freq, y, cfg.rope_theta, d);
                scale = y.attention_factor as f32;
            }
        }
        if let Some(f) = &freq_factors {
            // llama.cpp divides theta by the factor of each frequency (Llama 3.1 `rope_freqs`).
            for (x, f) in inv_freq.iter_mut().zip(f) {
                *x /= f;
            }
        }
        Self {
            inv_freq,
            scale,
            interleaved: cfg.rope_interleaved,
            freq_factors,
        }
    }

    /// The same model's RoPE under another config (its `rope_theta` or scaling changed).
    pub fn rebuilt(&self, cfg: &ModelConfig) -> Self {
        Self::new(cfg, self.freq_factors.clone())
    }

    /// The inverse frequencies, one per pair of dimensions.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    pub fn scale(&self) -> f32 {
        self.scale
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
                cos.push(theta.cos() * self.scale);
                sin.push(theta.sin() * self.scale);
            }
        }
        let cos = Tensor::from_vec(cos, (len, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (len, half), device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }

    /// Rotates a chunk's queries and keys, `q` `[heads, len, head_dim]` and `k`
    /// `[kv_heads, len, head_dim]` (views: each head's values contiguous, any head and row
    /// stride, such as a projection's output transposed): returns `[1, heads, len, head_dim]`
    /// and `[kv_heads, len, head_dim]`. On CUDA one launch of keydiff's kernel
    /// ([`crate::decode_kernel::rope_qk_cuda`]) in place of two copies and two rope launches;
    /// elsewhere candle's ops, its reference: [`Rope::apply`] on contiguous copies.
    pub fn apply_qk(
        &self,
        q: &Tensor,
        k: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        if let Some((q, k)) = crate::decode_kernel::rope_qk_cuda(q, k, cos, sin, self.interleaved)?
        {
            return Ok((q.unsqueeze(0)?, k));
        }
        let q = self.apply(&q.contiguous()?.unsqueeze(0)?, cos, sin)?;
        let k = self.apply(&k.contiguous()?.unsqueeze(0)?, cos, sin)?;
        Ok((q, k.squeeze(0)?))
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

/// YaRN's frequencies, as transformers' `_compute_yarn_parameters` (and vLLM's and llama.cpp's
/// `rope_yarn`): for pair `i`, the share `1 − ramp(i)` of the original frequency and `ramp(i)`
/// of it divided by the factor, where the ramp rises from 0 to 1 between the dimensions at
/// which a frequency turns `beta_fast` and `beta_slow` times over the original context.
fn yarn_scale(inv_freq: &mut [f32], y: &YarnRopeScaling, theta: f64, dim: usize) {
    let ctx = y.original_max_position_embeddings as f64;
    // The dimension at which a frequency turns `turns` times over the original context.
    let dim_at = |turns: f64| {
        dim as f64 * (ctx / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (dim_at(y.beta_fast), dim_at(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    // transformers widens an empty ramp by 0.001 (llama.cpp takes the span at least 0.001).
    let span = if high == low { 0.001 } else { high - low };
    for (i, f) in inv_freq.iter_mut().enumerate() {
        let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
        let freq = *f as f64;
        *f = (freq / y.factor * ramp + freq * (1.0 - ramp)) as f32;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, RopeScaling, YarnRopeScaling};

    fn config(head_dim: usize, theta: f64, scaling: Option<RopeScaling>) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            vocab_size: 16,
            hidden_size: head_dim * 2,
            intermediate_size: 8,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim,
            rms_norm_eps: 1e-6,
            rope_theta: theta,
            rope_scaling: scaling,
            max_position_embeddings: 32768,
            tie_word_embeddings: true,
            attention_bias: false,
            rope_interleaved: false,
            qk_norm: false,
            moe: None,
            context_limit: None,
        }
    }

    fn assert_close(ours: &[f32], reference: &[f64]) {
        assert_eq!(ours.len(), reference.len());
        for (i, (&a, &b)) in ours.iter().zip(reference).enumerate() {
            let rel = ((a as f64 - b) / b).abs();
            assert!(rel < 1e-6, "pair {i}: {a} against {b} (relative {rel:e})");
        }
    }

    /// YaRN's frequencies and attention factor equal transformers' `_compute_yarn_parameters`
    /// (scripts/yarn-reference.py prints these values).
    #[test]
    fn yarn_matches_transformers() {
        // Qwen 2.5's model card: factor 4 from 32768.
        let qwen = [
            1.000000000e+00,
            6.493816316e-01,
            4.216965034e-01,
            2.738419634e-01,
            1.778279410e-01,
            1.154781985e-01,
            7.498942093e-02,
            4.869675252e-02,
            3.162277660e-02,
            2.053525026e-02,
            1.333521432e-02,
            8.659643234e-03,
            5.154795481e-03,
            3.043117727e-03,
            1.778530279e-03,
            1.026617684e-03,
            5.833333333e-04,
            3.246908158e-04,
            1.757068764e-04,
            9.128065448e-05,
            4.445698525e-05,
            2.886954962e-05,
            1.874735523e-05,
            1.217418813e-05,
            7.905694150e-06,
            5.133812566e-06,
            3.333803580e-06,
            2.164910808e-06,
            1.405853313e-06,
            9.129353181e-07,
            5.928434264e-07,
            3.849816315e-07,
        ];
        let y = YarnRopeScaling::new(4.0, 32768);
        let rope = Rope::new(&config(64, 1e6, Some(RopeScaling::Yarn(y))), None);
        assert_close(rope.inv_freq(), &qwen);
        assert!((rope.scale() as f64 - 1.138629436111989).abs() < 1e-6);

        // Another head size, base and betas, and DeepSeek's mscale ratio, from config.json.
        let llama = [
            1.000000000e+00,
            8.146172339e-01,
            6.636012377e-01,
            5.405810046e-01,
            4.403666027e-01,
            3.587302238e-01,
            2.922278226e-01,
            2.380538205e-01,
            1.939227447e-01,
            1.579728099e-01,
            1.286873734e-01,
            1.048309522e-01,
            8.539710029e-02,
            6.956594961e-02,
            5.666962145e-02,
            4.616405027e-02,
            3.760603093e-02,
            3.063452089e-02,
            2.495540867e-02,
            2.032910598e-02,
            1.656044008e-02,
            1.349041989e-02,
            1.011536149e-02,
            7.528036260e-03,
            5.552369743e-03,
            4.050497983e-03,
            2.914651492e-03,
            2.060735198e-03,
            1.423254475e-03,
            9.513088192e-04,
            6.054316866e-04,
            3.551004618e-04,
            1.767766953e-04,
            1.440053425e-04,
            1.173092338e-04,
            9.556212354e-05,
            7.784655274e-05,
            6.341514346e-05,
            5.165906875e-05,
            4.208236769e-05,
            3.428102196e-05,
            2.792591128e-05,
            2.274892860e-05,
            1.853166929e-05,
            1.509621718e-05,
            1.229763868e-05,
            1.001786840e-05,
            8.160728247e-06,
            6.647869871e-06,
            5.415469365e-06,
            4.411534675e-06,
            3.593712174e-06,
            2.927499870e-06,
            2.384791846e-06,
            1.942692537e-06,
            1.582550821e-06,
            1.289173172e-06,
            1.050182683e-06,
            8.554969126e-07,
            6.969025286e-07,
            5.677088101e-07,
            4.624653805e-07,
            3.767322690e-07,
            3.068925989e-07,
        ];
        let hf = serde_json::json!({"rope_type": "yarn", "factor": 8.0,
            "original_max_position_embeddings": 8192, "beta_fast": 16, "beta_slow": 2,
            "mscale": 0.707, "mscale_all_dim": 1.0});
        let scaling = RopeScaling::from_hf(&hf, 131072).unwrap();
        let rope = Rope::new(&config(128, 5e5, scaling), None);
        assert_close(rope.inv_freq(), &llama);
        assert!((rope.scale() as f64 - 0.9495608824621653).abs() < 1e-6);
    }

    /// The attention factor multiplies cos and sin; linear scaling divides every frequency.
    #[test]
    fn scaling_reaches_cos_sin() {
        let plain = Rope::new(&config(8, 1e4, None), None);
        let linear = Rope::new(
            &config(8, 1e4, Some(RopeScaling::Linear { factor: 2.0 })),
            None,
        );
        for (a, b) in plain.inv_freq().iter().zip(linear.inv_freq()) {
            assert!((a / 2.0 - b).abs() <= 1e-7 * a);
        }
        let y = YarnRopeScaling::new(4.0, 64);
        let yarn = Rope::new(&config(8, 1e4, Some(RopeScaling::Yarn(y.clone()))), None);
        let (cos, sin) = yarn.cos_sin(0, 3, DType::F32, &Device::Cpu).unwrap();
        let (cos, sin) = (cos.to_vec2::<f32>().unwrap(), sin.to_vec2::<f32>().unwrap());
        let s = y.attention_factor as f32;
        for (i, &f) in yarn.inv_freq().iter().enumerate() {
            for p in 0..3 {
                let t = p as f32 * f;
                assert!((cos[p][i] - s * t.cos()).abs() < 1e-6);
                assert!((sin[p][i] - s * t.sin()).abs() < 1e-6);
            }
        }
        assert!(
            (cos[0][0] - 1.138_629_4).abs() < 1e-6,
            "cos(0) · 0.1 ln 4 + 1"
        );
    }
}
