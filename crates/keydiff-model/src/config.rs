//! Model hyper-parameters, read from HF `config.json` or from GGUF metadata.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// The transformer families this crate runs. All are pre-norm decoders with GQA, SwiGLU and RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 3.x (and SmolLM2, which shares the architecture).
    Llama,
    /// Qwen 2.5: q/k/v projections carry biases.
    Qwen2,
    /// Qwen 3 (dense): no biases; each query and key head is RMS-normalised (its own weight
    /// per dimension) before RoPE, and the head size is its own (128), not hidden / heads.
    Qwen3,
    /// Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen 3's attention,
    /// and in every layer a mixture of SwiGLU experts in place of the MLP ([`MoeConfig`]).
    #[serde(rename = "qwen3moe")]
    Qwen3Moe,
}

impl Arch {
    /// Parses a GGUF `general.architecture` or HF `model_type`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            // GGUF's name, then transformers'.
            "qwen3moe" | "qwen3_moe" => Ok(Self::Qwen3Moe),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }
}

/// A mixture-of-experts feed-forward block, as Qwen 3 MoE has in every layer: a router (a
/// linear `[experts, hidden]`) scores each token row; the `experts_per_token` experts of
/// highest softmax probability run on the row (SwiGLU MLPs of width
/// `expert_intermediate_size`) and their outputs are summed, weighted by those probabilities,
/// renormalised to sum to 1 when `norm_topk_prob` (transformers' `Qwen3MoeSparseMoeBlock`,
/// llama.cpp's `build_moe_ffn` with softmax gating).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
}

/// Llama 3 `rope_scaling` with `rope_type = "llama3"`.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// YaRN (arXiv 2309.00071), as transformers, vLLM and llama.cpp compute it: frequencies that
/// turn more than `beta_fast` times over the original context are kept, those that turn fewer
/// than `beta_slow` times are divided by `factor`, with a linear ramp between (in dimension
/// index); cos and sin are multiplied by `attention_factor`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct YarnRopeScaling {
    pub factor: f64,
    /// The context the model was trained for before the extension.
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// cos and sin are multiplied by it, so attention logits by its square: by default
    /// `0.1 ln(factor) + 1` (the paper's, transformers', vLLM's and llama.cpp's).
    pub attention_factor: f64,
    /// The ramp's bounds rounded outward to whole dimensions (transformers' `truncate`,
    /// default true; vLLM and llama.cpp always round).
    pub truncate: bool,
}

impl YarnRopeScaling {
    /// YaRN with the paper's defaults: betas 32 and 1, attention factor `0.1 ln(factor) + 1`.
    pub fn new(factor: f64, original_max_position_embeddings: usize) -> Self {
        Self {
            factor,
            original_max_position_embeddings,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: yarn_mscale(factor, 1.0),
            truncate: true,
        }
    }
}

/// transformers' `get_mscale`: `0.1 · mscale · ln(scale) + 1`, or 1 for a scale up to 1.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// How a model's RoPE frequencies are scaled to reach a longer context than it was trained
/// for (`rope_scaling` of config.json, `{arch}.rope.scaling.*` of GGUF, or `--rope-scaling`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, smoothed between.
    Llama3(Llama3RopeScaling),
    /// Position interpolation: every frequency divided by `factor` (transformers' `linear`,
    /// llama.cpp's default type).
    Linear { factor: f64 },
    /// YaRN (Qwen 2.5's long-context setting).
    Yarn(YarnRopeScaling),
}

impl RopeScaling {
    /// The context this scaling reaches from a model's `max_position_embeddings`, as vLLM
    /// derives it: YaRN's original context times its factor (never less than the model's),
    /// linear scaling's context times its factor; Llama 3.1's config already states its own.
    pub fn context(&self, trained: usize) -> usize {
        // `as` saturates: a huge product fails `validate` as beyond MAX_CONTEXT.
        let scaled = |ctx: usize, factor: f64| (ctx as f64 * factor) as usize;
        match self {
            Self::Llama3(_) => trained,
            Self::Linear { factor } => scaled(trained, *factor).max(1),
            Self::Yarn(y) => scaled(y.original_max_position_embeddings, y.factor).max(trained),
        }
    }

    /// Checks the values the frequencies are computed from.
    fn validate(&self) -> std::result::Result<(), String> {
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        let ok = match self {
            Self::Llama3(r) => {
                finite_pos(r.factor)
                    && finite_pos(r.low_freq_factor)
                    && r.high_freq_factor.is_finite()
                    && r.high_freq_factor > r.low_freq_factor
                    && r.original_max_position_embeddings > 0
            }
            Self::Linear { factor } => finite_pos(*factor),
            Self::Yarn(y) => {
                if !(y.factor.is_finite() && y.factor >= 1.0) {
                    return Err(format!(
                        "YaRN RoPE scaling factor {} must be at least 1",
                        y.factor
                    ));
                }
                if !(finite_pos(y.beta_fast)
                    && finite_pos(y.beta_slow)
                    && y.beta_fast > y.beta_slow)
                {
                    return Err(format!(
                        "YaRN beta_fast {} and beta_slow {} must be finite and positive, \
                         beta_fast the larger",
                        y.beta_fast, y.beta_slow
                    ));
                }
                finite_pos(y.attention_factor) && y.original_max_position_embeddings > 0
            }
        };
        if ok {
            return Ok(());
        }
        Err(match self {
            Self::Llama3(r) => format!(
                "rope_scaling {r:?}: needs factor > 0, 0 < low_freq_factor < high_freq_factor \
                 and original_max_position_embeddings > 0"
            ),
            Self::Linear { factor } => {
                format!("linear RoPE scaling factor {factor} must be finite and positive")
            }
            Self::Yarn(y) => format!(
                "rope_scaling {y:?}: needs attention_factor > 0 and \
                 original_max_position_embeddings > 0"
            ),
        })
    }

    /// transformers' `rope_scaling` object: `llama3`, `linear` or `yarn` (`type` or
    /// `rope_type`); `default` and `null` are none. `trained` is the model's
    /// `max_position_embeddings` (YaRN's original context when it names none).
    pub fn from_hf(
        v: &serde_json::Value,
        trained: usize,
    ) -> std::result::Result<Option<Self>, String> {
        use serde_json::Value;
        let m = match v {
            Value::Null => return Ok(None),
            Value::Object(m) => m,
            v => return Err(format!("rope_scaling must be an object or null, found {v}")),
        };
        let kind = m
            .get("rope_type")
            .or_else(|| m.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("");
        // A number, where null or absent gives `None` and anything else is an error.
        let num = |k: &str| -> std::result::Result<Option<f64>, String> {
            match m.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| format!("rope_scaling.{k} must be a number, found {x}")),
            }
        };
        let factor =
            || num("factor")?.ok_or_else(|| format!("rope_scaling `{kind}` needs a `factor`"));
        Ok(Some(match kind {
            "default" => return Ok(None),
            "llama3" => Self::Llama3(
                serde_json::from_value(v.clone()).map_err(|e| format!("rope_scaling: {e}"))?,
            ),
            "linear" => Self::Linear { factor: factor()? },
            "yarn" => {
                let factor = factor()?;
                let original = match m.get("original_max_position_embeddings") {
                    None | Some(Value::Null) => trained,
                    Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                        format!(
                            "rope_scaling.original_max_position_embeddings must be a \
                             positive integer, found {x}"
                        )
                    })?,
                };
                let mut y = YarnRopeScaling::new(factor, original);
                // transformers: `beta_fast or 32`, so 0 is the default too.
                if let Some(b) = num("beta_fast")?.filter(|&b| b != 0.0) {
                    y.beta_fast = b;
                }
                if let Some(b) = num("beta_slow")?.filter(|&b| b != 0.0) {
                    y.beta_slow = b;
                }
                y.attention_factor = match (
                    num("attention_factor")?,
                    num("mscale")?,
                    num("mscale_all_dim")?,
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(ms), Some(all)) if ms != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, ms) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                };
                if let Some(t) = m.get("truncate") {
                    y.truncate = t.as_bool().ok_or_else(|| {
                        format!("rope_scaling.truncate must be a boolean, found {t}")
                    })?;
                }
                Self::Yarn(y)
            }
            other => {
                return Err(format!(
                    "unsupported rope_scaling type `{other}` (supported: llama3, linear, yarn)"
                ))
            }
        }))
    }
}

/// The kinds of RoPE scaling `--rope-scaling` chooses from (llama.cpp's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeScalingType {
    None,
    Linear,
    Yarn,
}

impl std::str::FromStr for RopeScalingType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "linear" => Ok(Self::Linear),
            "yarn" => Ok(Self::Yarn),
            other => Err(format!(
                "unknown RoPE scaling `{other}` (expected none, linear or yarn)"
            )),
        }
    }
}

/// Changes to a model's RoPE made when it loads, as llama.cpp's `--rope-scaling`,
/// `--rope-scale`, `--rope-freq-base` and `--yarn-*` flags make them (vLLM:
/// `--hf-overrides '{"rope_scaling": ...}'`): e.g. YaRN ×4 from 32K on a Qwen 2.5 GGUF that
/// does not carry it. Fields left `None` keep the model's own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RopeOverride {
    /// The scaling type. `None` keeps the model's; with a factor and no scaling in the model,
    /// linear (llama.cpp's default type).
    pub scaling: Option<RopeScalingType>,
    /// The scaling factor (llama.cpp's `--rope-scale`).
    pub factor: Option<f64>,
    /// RoPE's base frequency, `rope_theta`.
    pub freq_base: Option<f64>,
    /// YaRN: the context the model was trained for (default: the model's YaRN setting, else
    /// its context).
    pub original_context: Option<usize>,
    /// YaRN: the betas (default 32 and 1).
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    /// YaRN: multiplies the attention factor `0.1 ln(factor) + 1` (llama.cpp's
    /// `--yarn-attn-factor`, default 1).
    pub attn_factor: Option<f64>,
}

impl RopeOverride {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Applies the changes to `cfg`, refusing settings that contradict each other.
    pub fn apply(&self, cfg: &mut ModelConfig) -> std::result::Result<(), String> {
        if let Some(b) = self.freq_base {
            cfg.rope_theta = b;
        }
        let yarn_args = self.original_context.is_some()
            || self.beta_fast.is_some()
            || self.beta_slow.is_some()
            || self.attn_factor.is_some();
        let own = cfg.rope_scaling.clone();
        let kind = match (self.scaling, &own) {
            (Some(k), _) => k,
            (None, _) if self.factor.is_none() && !yarn_args => return cfg.validate(),
            (None, Some(RopeScaling::Yarn(_))) => RopeScalingType::Yarn,
            (None, Some(RopeScaling::Linear { .. }) | None) => RopeScalingType::Linear,
            (None, Some(RopeScaling::Llama3(_))) => {
                return Err(
                    "the model's RoPE scaling is Llama 3.1's, which takes no factor \
                            or YaRN settings; give a scaling type (none, linear or yarn) to \
                            replace it"
                        .into(),
                )
            }
        };
        if yarn_args && kind != RopeScalingType::Yarn {
            return Err(
                "the YaRN settings (original context, betas, attention factor) need YaRN \
                 RoPE scaling"
                    .into(),
            );
        }
        // The factor: given, or the model's own of a linear or YaRN scaling.
        let own_factor = match &own {
            Some(RopeScaling::Linear { factor }) => Some(*factor),
            Some(RopeScaling::Yarn(y)) => Some(y.factor),
            _ => None,
        };
        let factor = || {
            self.factor.or(own_factor).ok_or_else(|| {
                "linear or YaRN RoPE scaling needs a factor (llama.cpp's --rope-scale)".to_string()
            })
        };
        cfg.rope_scaling = match kind {
            RopeScalingType::None => None,
            RopeScalingType::Linear => Some(RopeScaling::Linear { factor: factor()? }),
            RopeScalingType::Yarn => {
                let factor = factor()?;
                let own = match own {
                    Some(RopeScaling::Yarn(y)) => Some(y),
                    _ => None,
                };
                let original = self
                    .original_context
                    .or(own.as_ref().map(|y| y.original_max_position_embeddings))
                    .unwrap_or(cfg.max_position_embeddings);
                let mut y = YarnRopeScaling::new(factor, original);
                if let Some(o) = &own {
                    (y.beta_fast, y.beta_slow, y.truncate) = (o.beta_fast, o.beta_slow, o.truncate);
                    // The model's own attention factor stands while its factor does.
                    if o.factor == factor {
                        y.attention_factor = o.attention_factor;
                    }
                }
                y.beta_fast = self.beta_fast.unwrap_or(y.beta_fast);
                y.beta_slow = self.beta_slow.unwrap_or(y.beta_slow);
                if let Some(a) = self.attn_factor {
                    y.attention_factor = a * yarn_mscale(factor, 1.0);
                }
                Some(RopeScaling::Yarn(y))
            }
        };
        cfg.validate()
    }
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// The context the model was trained for (before any RoPE scaling; the context prompts
    /// plus output may fill is [`ModelConfig::context`]).
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections have a bias (Qwen 2.5).
    pub attention_bias: bool,
    /// Q/K rows are permuted for interleaved RoPE (GGUF `llama`); otherwise NeoX halves.
    pub rope_interleaved: bool,
    /// Each query and key head is RMS-normalised with its own `[head_dim]` weight before
    /// RoPE (Qwen 3's `q_norm`/`k_norm`, GGUF `attn_q_norm`/`attn_k_norm`).
    pub qk_norm: bool,
    /// Every layer's feed-forward block is a mixture of experts (Qwen 3 MoE); otherwise an
    /// MLP of `intermediate_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// A shorter context to run with than the model allows (llama.cpp's `-c`, vLLM's
    /// `--max-model-len`; [`ModelConfig::limit_context`]): it changes no computation, only
    /// how many tokens a request may fill, so it is not serialized (a saved cache's model
    /// digest does not depend on it).
    #[serde(skip)]
    pub context_limit: Option<usize>,
}

/// Most experts a mixture may have (llama.cpp's `LLAMA_MAX_EXPERTS`).
pub const MAX_EXPERTS: usize = 512;

/// Most layers a model may have (llama.cpp's `LLAMA_MAX_LAYERS`).
pub const MAX_LAYERS: usize = 512;
/// Largest hidden or intermediate size accepted (the largest open models use ~53K).
pub const MAX_WIDTH: usize = 1 << 20;
/// Largest vocabulary accepted (the largest open models use ~256K).
pub const MAX_VOCAB: usize = 1 << 24;
/// Most query or KV heads accepted.
pub const MAX_HEADS: usize = 1 << 12;
/// Largest head size accepted (the largest open models use 256).
pub const MAX_HEAD_DIM: usize = 1 << 12;
/// Longest context accepted (the longest open models use 10M).
pub const MAX_CONTEXT: usize = 1 << 30;
/// Largest `rms_norm_eps` accepted (real models: 1e-6 to 1e-5).
pub const MAX_NORM_EPS: f64 = 0.1;

/// A GGUF metadata value as a count: any non-negative integer type. Booleans, which candle's
/// `to_u64` would accept, and negative numbers, which `as usize` would wrap, are refused.
fn gguf_count(v: &gguf_file::Value) -> Option<usize> {
    use gguf_file::Value as V;
    let x: u64 = match *v {
        V::U8(x) => x.into(),
        V::U16(x) => x.into(),
        V::U32(x) => x.into(),
        V::U64(x) => x,
        V::I8(x) => u64::try_from(x).ok()?,
        V::I16(x) => u64::try_from(x).ok()?,
        V::I32(x) => u64::try_from(x).ok()?,
        V::I64(x) => u64::try_from(x).ok()?,
        _ => return None,
    };
    usize::try_from(x).ok()
}

/// A GGUF metadata value as a finite float.
fn gguf_float(v: &gguf_file::Value) -> Option<f64> {
    use gguf_file::Value as V;
    let x = match *v {
        V::F32(x) => x as f64,
        V::F64(x) => x,
        _ => return None,
    };
    x.is_finite().then_some(x)
}

/// `config.json` of a Hugging Face checkpoint, field for field as far as we use it.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Transformers 5's form of `rope_theta` and `rope_scaling` together (`{"rope_type":
    /// "default", "rope_theta": 1e6}`, or a scaling's fields beside `rope_theta`); where it
    /// is given, it stands over both.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Qwen 3 MoE: experts per layer, experts run per token, each expert's MLP width, and
    /// whether the chosen experts' weights are renormalised (transformers' default: false).
    /// Transformers 5 may save the first as `num_local_experts`.
    #[serde(default, alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// Qwen 3 MoE: every `decoder_sparse_step`-th layer is sparse, except `mlp_only_layers`
    /// (only 1 and none are supported: every layer sparse, as in every released model).
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Read to refuse what the forward pass does not compute: an MLP activation other than
    /// SiLU, MLP biases, sliding-window attention, and a quantized checkpoint's scheme.
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_max_pos() -> usize {
    4096
}

impl HfConfig {
    /// Reads and parses `config.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let bad = |reason: String| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            error: source,
        })?;
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
    }

    /// Converts to the engine's config, checking what the engine cannot run.
    pub fn to_model_config(&self, path: &Path) -> Result<ModelConfig> {
        let arch_name = match (&self.model_type, self.architectures.first()) {
            (Some(t), _) => t.clone(),
            (None, Some(a)) if a.starts_with("Llama") => "llama".into(),
            (None, Some(a)) if a.starts_with("Qwen2") => "qwen2".into(),
            (None, Some(a)) if a == "Qwen3ForCausalLM" => "qwen3".into(),
            (None, Some(a)) if a == "Qwen3MoeForCausalLM" => "qwen3_moe".into(),
            (None, Some(a)) => a.clone(),
            (None, None) => String::from("<none>"),
        };
        let arch = Arch::parse(&arch_name)?;
        let bad_config = |reason: String| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(q) = self.quantization_config.as_ref().filter(|q| !q.is_null()) {
            let method = q
                .get("quant_method")
                .map_or("unnamed".into(), |m| m.to_string());
            return Err(bad_config(format!(
                "quantization_config (quant_method {method}): keydiff loads float checkpoints; \
                 use the model's float release or a GGUF file"
            )));
        }
        if let Some(act) = self
            .hidden_act
            .as_deref()
            .filter(|a| !matches!(*a, "silu" | "swish"))
        {
            return Err(bad_config(format!(
                "hidden_act `{act}`: keydiff's MLP computes SiLU (`silu`) only"
            )));
        }
        if self.mlp_bias == Some(true) {
            return Err(bad_config(
                "mlp_bias true: keydiff's MLP has no biases".into(),
            ));
        }
        if self.use_sliding_window == Some(true) {
            return Err(bad_config(
                "use_sliding_window true: sliding-window attention is not supported".into(),
            ));
        }
        let (rope_theta, rope_scaling) =
            match self.rope_parameters.as_ref().filter(|v| !v.is_null()) {
                Some(p) => {
                    let theta = match p.get("rope_theta") {
                        None | Some(serde_json::Value::Null) => self.rope_theta,
                        Some(t) => t.as_f64().ok_or_else(|| {
                            bad_config(format!(
                                "rope_parameters.rope_theta must be a number, found {t}"
                            ))
                        })?,
                    };
                    let kind = p.get("rope_type").or_else(|| p.get("type"));
                    let scaling = match kind {
                        // Only a base given: no scaling.
                        None => None,
                        Some(_) => RopeScaling::from_hf(p, self.max_position_embeddings)
                            .map_err(|e| bad_config(format!("rope_parameters: {e}")))?,
                    };
                    (theta, scaling)
                }
                None => (
                    self.rope_theta,
                    match &self.rope_scaling {
                        None => None,
                        Some(v) => RopeScaling::from_hf(v, self.max_position_embeddings)
                            .map_err(bad_config)?,
                    },
                ),
            };
        // transformers' default: hidden / heads, but 128 for Qwen 3 (`Qwen3Config`; its
        // MoE config has no default, and its attention takes hidden / heads).
        let head_dim = self.head_dim.unwrap_or(match arch {
            Arch::Qwen3 => 128,
            _ => self.hidden_size / self.num_attention_heads.max(1),
        });
        let bad = bad_config;
        let moe = match arch {
            Arch::Qwen3Moe => {
                if let Some(step) = self.decoder_sparse_step.filter(|&s| s != 1) {
                    return Err(bad(format!(
                        "decoder_sparse_step {step}: only 1 (every layer a mixture of \
                         experts) is supported"
                    )));
                }
                if let Some(l) = self.mlp_only_layers.as_ref().filter(|l| !l.is_empty()) {
                    return Err(bad(format!(
                        "mlp_only_layers {l:?}: dense layers in a Qwen 3 MoE model are not \
                         supported"
                    )));
                }
                let need = |v: Option<usize>, k: &str| {
                    v.ok_or_else(|| bad(format!("a qwen3_moe config needs `{k}`")))
                };
                Some(MoeConfig {
                    num_experts: need(self.num_experts, "num_experts")?,
                    experts_per_token: need(self.num_experts_per_tok, "num_experts_per_tok")?,
                    expert_intermediate_size: need(
                        self.moe_intermediate_size,
                        "moe_intermediate_size",
                    )?,
                    norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
                })
            }
            _ => {
                if let Some(n) = self.num_experts.filter(|&n| n > 0) {
                    return Err(bad(format!(
                        "`{arch_name}` with {n} experts: mixtures of experts are supported \
                         for Qwen 3 MoE only"
                    )));
                }
                None
            }
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias.unwrap_or(arch == Arch::Qwen2),
            rope_interleaved: false,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            moe,
            context_limit: None,
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }
}

impl ModelConfig {
    /// Bytes of K and V at `slots` per layer and KV head held as `kv` (a float dtype or
    /// Q8_0, or one for each): slots · layers · kv_heads · a head's key and value bytes, the
    /// cache's peak (what `KvCache::bytes` reports).
    pub fn kv_cache_bytes(&self, slots: usize, kv: impl Into<keydiff_cache::KvTypes>) -> u64 {
        (slots as u64)
            * (self.num_layers * self.num_kv_heads * kv.into().slot_bytes(self.head_dim)) as u64
    }

    /// Activation bytes of one token row through a layer in f32, estimated: hidden states,
    /// q/k/v and the MLP (part of [`ModelConfig::request_scratch_bytes`]).
    pub fn row_activation_bytes(&self) -> u64 {
        // A mixture also holds its router's probabilities and each expert's gathered rows
        // and output.
        let moe = self.moe.as_ref().map_or(0, |m| {
            m.num_experts + 2 * m.experts_per_token * self.hidden_size
        });
        4 * (6 * self.hidden_size + 3 * self.ffn_row_width() + moe) as u64
    }

    /// Bytes a request needs beside K and V on its device, estimated: the cache's per-slot
    /// positions and policy state (8 bytes), a chunk's activations in f32 (hidden states,
    /// q/k/v, the MLP, one row of logits), one layer's K and V view copied (contiguous or
    /// widened to f32) for the chunk's attention and, for eager attention, its scores, mask and
    /// probabilities over every slot.
    pub fn request_scratch_bytes(&self, slots: usize, chunk: usize, eager: bool) -> u64 {
        let (slots, chunk) = (slots as u64, chunk as u64);
        let meta = 8 * slots * (self.num_layers * self.num_kv_heads) as u64;
        let rows = chunk * self.row_activation_bytes();
        let view = 2 * 4 * slots * (self.num_kv_heads * self.head_dim) as u64;
        let scores = if eager {
            3 * 4 * chunk * slots * self.num_heads as u64
        } else {
            0
        };
        meta + rows + view + 4 * self.vocab_size as u64 + scores
    }

    /// Reads the config from GGUF metadata (`{arch}.*` keys).
    pub fn from_gguf(ct: &gguf_file::Content, path: &Path) -> Result<Self> {
        let md = &ct.metadata;
        let get = |k: &str| {
            md.get(k)
                .ok_or_else(|| ModelError::MissingKey(k.to_string()))
        };
        let arch_name = get("general.architecture")?
            .to_string()
            .map_err(|e| ModelError::BadGguf {
                path: path.to_path_buf(),
                reason: keydiff_cache::without_backtrace(e).to_string(),
            })?
            .clone();
        let arch = Arch::parse(&arch_name)?;
        let a = arch_name.as_str();
        let bad = |key: &str, what: &str, v: &gguf_file::Value| ModelError::BadGguf {
            path: path.to_path_buf(),
            reason: format!("`{key}` must be {what}, found {v:?}"),
        };
        // Optional keys: absent gives None; present but malformed is an error, not a default.
        let opt_int = |k: &str| -> Result<Option<usize>> {
            let key = format!("{a}.{k}");
            md.get(&key)
                .map(|v| gguf_count(v).ok_or_else(|| bad(&key, "a non-negative integer", v)))
                .transpose()
        };
        let int = |k: &str| -> Result<usize> {
            opt_int(k)?.ok_or_else(|| ModelError::MissingKey(format!("{a}.{k}")))
        };
        let opt_float = |k: &str| -> Result<Option<f64>> {
            let key = format!("{a}.{k}");
            md.get(&key)
                .map(|v| gguf_float(v).ok_or_else(|| bad(&key, "a finite number", v)))
                .transpose()
        };
        let float = |k: &str| -> Result<f64> {
            opt_float(k)?.ok_or_else(|| ModelError::MissingKey(format!("{a}.{k}")))
        };
        let hidden_size = int("embedding_length")?;
        let num_heads = int("attention.head_count")?;
        let num_kv_heads = opt_int("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match opt_int("attention.key_length")? {
            Some(d) => d,
            None if num_heads > 0 && hidden_size % num_heads != 0 => {
                return Err(ModelError::BadGguf {
                    path: path.to_path_buf(),
                    reason: format!(
                        "`{a}.embedding_length` {hidden_size} is not a multiple of \
                         `{a}.attention.head_count` {num_heads} (and no \
                         `{a}.attention.key_length` gives the head size)"
                    ),
                })
            }
            None => hidden_size / num_heads.max(1),
        };
        // As llama.cpp: the vocabulary is the tokenizer's list (its converter pads the list
        // to the embedding's rows), and the embedding must have a row per token.
        let tokens = get("tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(|e| ModelError::BadGguf {
                path: path.to_path_buf(),
                reason: format!(
                    "tokenizer.ggml.tokens: {}",
                    keydiff_cache::without_backtrace(e)
                ),
            })?
            .len();
        let vocab_size = match opt_int("vocab_size")? {
            Some(v) if v != tokens => {
                return Err(ModelError::BadGguf {
                    path: path.to_path_buf(),
                    reason: format!(
                        "`{a}.vocab_size` is {v} but tokenizer.ggml.tokens has {tokens} tokens"
                    ),
                })
            }
            _ => tokens,
        };
        let tie_word_embeddings = !ct.tensor_infos.contains_key("output.weight");
        let attention_bias = ct.tensor_infos.contains_key("blk.0.attn_q.bias");
        let moe = match arch {
            Arch::Qwen3Moe => {
                // llama.cpp always renormalises Qwen 3 MoE's chosen weights and gates by
                // softmax; a file that says otherwise is refused rather than misread.
                let norm_key = format!("{a}.expert_weights_norm");
                if let Some(v) = md.get(&norm_key) {
                    match v {
                        gguf_file::Value::Bool(true) => {}
                        v => return Err(bad(&norm_key, "true (Qwen 3 MoE renormalises)", v)),
                    }
                }
                if let Some(g) = opt_int("expert_gating_func")?.filter(|&g| g != 1) {
                    return Err(bad(
                        &format!("{a}.expert_gating_func"),
                        "1 (softmax, Qwen 3 MoE's gating)",
                        &gguf_file::Value::U32(g as u32),
                    ));
                }
                Some(MoeConfig {
                    num_experts: int("expert_count")?,
                    experts_per_token: int("expert_used_count")?,
                    expert_intermediate_size: int("expert_feed_forward_length")?,
                    norm_topk_prob: true,
                })
            }
            _ => {
                if let Some(n) = opt_int("expert_count")?.filter(|&n| n > 0) {
                    return Err(ModelError::BadGguf {
                        path: path.to_path_buf(),
                        reason: format!(
                            "`{a}.expert_count` is {n}: mixtures of experts are supported for \
                             Qwen 3 MoE (`qwen3moe`) only"
                        ),
                    });
                }
                None
            }
        };
        // A MoE file's dense width is unused (and may be absent).
        let intermediate_size = match &moe {
            Some(m) => opt_int("feed_forward_length")?.unwrap_or(m.expert_intermediate_size),
            None => int("feed_forward_length")?,
        };
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers: int("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")?,
            rope_theta: opt_float("rope.freq_base")?.unwrap_or(10_000.0),
            // Read below. GGUF carries Llama 3.1 scaling as the `rope_freqs.weight` tensor.
            rope_scaling: None,
            max_position_embeddings: int("context_length")?,
            tie_word_embeddings,
            attention_bias,
            rope_interleaved: arch == Arch::Llama,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            moe,
            context_limit: None,
        };
        cfg.validate().map_err(|reason| ModelError::BadGguf {
            path: path.to_path_buf(),
            reason,
        })?;
        // What the forward pass would otherwise get silently wrong.
        let unsupported = |reason: String| ModelError::BadGguf {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(d) = opt_int("rope.dimension_count")? {
            if d != cfg.head_dim {
                return Err(unsupported(format!(
                    "`{a}.rope.dimension_count` is {d} but head_dim is {}: partial RoPE is \
                     not supported",
                    cfg.head_dim
                )));
            }
        }
        // llama.cpp scales RoPE by `rope.scaling.factor` (or the older `rope.scale_linear`),
        // linear when no type is given; 0 and 1 mean no scaling, and the type `none` never
        // scales, whatever the factor.
        let kind_key = format!("{a}.rope.scaling.type");
        let kind = match md.get(&kind_key) {
            None => "linear".to_string(),
            Some(v) => v
                .to_string()
                .map_err(|_| bad(&kind_key, "a string", v))?
                .clone(),
        };
        let factor = match opt_float("rope.scaling.factor")? {
            Some(f) => Some(f),
            None => opt_float("rope.scale_linear")?,
        }
        .filter(|&f| f != 0.0 && f != 1.0);
        let scaling = match (kind.as_str(), factor) {
            ("none", _) | (_, None) => None,
            ("linear", Some(factor)) => Some(RopeScaling::Linear { factor }),
            ("yarn", Some(factor)) => {
                let original = opt_int("rope.scaling.original_context_length")?
                    .unwrap_or(cfg.max_position_embeddings);
                let mut y = YarnRopeScaling::new(factor, original);
                y.beta_fast = opt_float("rope.scaling.yarn_beta_fast")?.unwrap_or(y.beta_fast);
                y.beta_slow = opt_float("rope.scaling.yarn_beta_slow")?.unwrap_or(y.beta_slow);
                // What llama.cpp does with these beyond their defaults differs by
                // architecture (DeepSeek's and GPT-OSS's attention factors): refused.
                for (key, defaults) in [
                    ("rope.scaling.attn_factor", &[1.0][..]),
                    ("rope.scaling.yarn_attn_factor", &[1.0]),
                    ("rope.scaling.yarn_ext_factor", &[-1.0, 1.0]),
                    ("rope.scaling.yarn_log_multiplier", &[0.0]),
                ] {
                    if let Some(x) = opt_float(key)?.filter(|x| !defaults.contains(x)) {
                        return Err(unsupported(format!(
                            "`{a}.{key}` is {x}: only YaRN's defaults are supported there"
                        )));
                    }
                }
                Some(RopeScaling::Yarn(y))
            }
            (other, Some(f)) => {
                return Err(unsupported(format!(
                    "`{kind_key}` is `{other}` (factor {f}): only none, linear and yarn RoPE \
                     scaling are supported"
                )))
            }
        };
        let cfg = ModelConfig {
            rope_scaling: scaling,
            ..cfg
        };
        cfg.validate().map_err(|reason| ModelError::BadGguf {
            path: path.to_path_buf(),
            reason,
        })?;
        let extra = format!("blk.{}.attn_norm.weight", cfg.num_layers);
        if ct.tensor_infos.contains_key(&extra) {
            return Err(unsupported(format!(
                "`{a}.block_count` is {} but the file has tensor `{extra}`",
                cfg.num_layers
            )));
        }
        Ok(cfg)
    }

    /// Checks the shape relations the forward pass relies on, and that every size is within
    /// bounds no real model comes near: a corrupt value fails here, with its name, instead of
    /// as an allocation of terabytes later.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err("layers, hidden size and vocab must be non-zero".into());
        }
        if self.num_heads == 0 {
            return Err("the number of query heads must be non-zero".into());
        }
        if self.moe.is_none() && self.intermediate_size == 0 {
            return Err("the MLP's intermediate size must be non-zero".into());
        }
        let limits = [
            ("layers", self.num_layers, MAX_LAYERS),
            ("hidden size", self.hidden_size, MAX_WIDTH),
            ("intermediate size", self.intermediate_size, MAX_WIDTH),
            ("vocabulary size", self.vocab_size, MAX_VOCAB),
            ("query heads", self.num_heads, MAX_HEADS),
            ("KV heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("context length", self.max_position_embeddings, MAX_CONTEXT),
        ];
        for (what, v, max) in limits {
            if v > max {
                return Err(format!("{what} {v} is beyond the supported maximum {max}"));
            }
        }
        // Real models use 1e-6 to 1e-5; anything near 1 drowns the activations.
        if !(self.rms_norm_eps.is_finite() && (0.0..=MAX_NORM_EPS).contains(&self.rms_norm_eps)) {
            return Err(format!(
                "rms_norm_eps {} must be from 0 to {MAX_NORM_EPS}",
                self.rms_norm_eps
            ));
        }
        // Real models use 1e4 to 1e8; at 1 or below no position rotates (or the frequencies
        // overflow), past 1e12 none rotates measurably.
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0 && self.rope_theta <= 1e12) {
            return Err(format!(
                "rope_theta {} must be above 1 and at most 1e12",
                self.rope_theta
            ));
        }
        if let Some(r) = &self.rope_scaling {
            r.validate()?;
            // YaRN's ramp divides by ln(rope_theta).
            if matches!(r, RopeScaling::Yarn(_)) && self.rope_theta <= 1.0 {
                return Err(format!(
                    "YaRN RoPE scaling needs rope_theta above 1, found {}",
                    self.rope_theta
                ));
            }
            let context = self.context();
            if context > MAX_CONTEXT {
                return Err(format!(
                    "context length {context} (with RoPE scaling) is beyond the supported \
                     maximum {MAX_CONTEXT}"
                ));
            }
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even", self.head_dim));
        }
        if self.max_position_embeddings == 0 {
            return Err("context length must be non-zero".into());
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.num_experts > MAX_EXPERTS {
                return Err(format!(
                    "{} experts per layer (expected 1 to {MAX_EXPERTS})",
                    m.num_experts
                ));
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return Err(format!(
                    "{} experts per token of {} (expected 1 to {})",
                    m.experts_per_token, m.num_experts, m.num_experts
                ));
            }
            if m.expert_intermediate_size == 0 || m.expert_intermediate_size > MAX_WIDTH {
                return Err(format!(
                    "expert intermediate size {} (expected 1 to {MAX_WIDTH})",
                    m.expert_intermediate_size
                ));
            }
        }
        Ok(())
    }

    /// Width of the feed-forward activations of one token row: the MLP's, or the chosen
    /// experts' together.
    pub fn ffn_row_width(&self) -> usize {
        match &self.moe {
            Some(m) => m.experts_per_token * m.expert_intermediate_size,
            None => self.intermediate_size,
        }
    }

    /// The context prompts plus output may fill: `max_position_embeddings`, extended by the
    /// RoPE scaling as vLLM derives it ([`RopeScaling::context`]).
    pub fn context(&self) -> usize {
        let full = self.full_context();
        self.context_limit.map_or(full, |n| n.min(full))
    }

    /// Whether a limit makes [`ModelConfig::context`] shorter than the model's.
    pub fn context_limited(&self) -> bool {
        self.context() < self.full_context()
    }

    /// The context the model allows: [`ModelConfig::context`] without a limit.
    pub fn full_context(&self) -> usize {
        match &self.rope_scaling {
            Some(r) => r.context(self.max_position_embeddings),
            None => self.max_position_embeddings,
        }
    }

    /// Runs with a context of `n` tokens (prompt and output together), at most the model's;
    /// `None` (or 0, llama.cpp's "the model's") lifts a limit. A longer one is refused: it
    /// takes RoPE scaling, which changes the computation (`--rope-scaling`).
    pub fn limit_context(&mut self, n: Option<usize>) -> std::result::Result<(), String> {
        let full = self.full_context();
        match n.filter(|&n| n > 0) {
            Some(n) if n > full => Err(format!(
                "a context of {n} tokens is beyond this model's {full}{}; a longer one takes \
                 RoPE scaling (--rope-scaling yarn --rope-scale F, where the model supports it)",
                if self.rope_scaling.is_some() {
                    " (with its RoPE scaling)"
                } else {
                    ""
                }
            )),
            n => {
                self.context_limit = n;
                Ok(())
            }
        }
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen(scaling: Option<RopeScaling>) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            vocab_size: 16,
            hidden_size: 128,
            intermediate_size: 8,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 64,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            rope_scaling: scaling,
            max_position_embeddings: 32768,
            tie_word_embeddings: true,
            attention_bias: true,
            rope_interleaved: false,
            qk_norm: false,
            moe: None,
            context_limit: None,
        }
    }

    fn yarn(v: serde_json::Value) -> std::result::Result<YarnRopeScaling, String> {
        match RopeScaling::from_hf(&v, 32768)? {
            Some(RopeScaling::Yarn(y)) => Ok(y),
            other => panic!("{other:?}"),
        }
    }

    /// Qwen 2.5's model card setting, with transformers' defaults for what it leaves out, and
    /// the context vLLM derives from it.
    #[test]
    fn hf_yarn_defaults_and_context() {
        let y = yarn(json!({"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}))
        .unwrap();
        assert_eq!(y, YarnRopeScaling::new(4.0, 32768));
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
        assert!((y.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(qwen(Some(RopeScaling::Yarn(y))).context(), 131072);
        // No original context: the model's own; 0 betas are the defaults, as `or 32` reads.
        let y = yarn(json!({"rope_type": "yarn", "factor": 2, "beta_fast": 0,
            "attention_factor": 1.5, "truncate": false}))
        .unwrap();
        assert_eq!(y.original_max_position_embeddings, 32768);
        assert_eq!(
            (y.beta_fast, y.attention_factor, y.truncate),
            (32.0, 1.5, false)
        );
        // A config whose max_position_embeddings is already the extended context keeps it.
        let mut c = qwen(Some(RopeScaling::Yarn(YarnRopeScaling::new(2.0, 4096))));
        assert_eq!(c.context(), 32768);
        c.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 });
        assert_eq!(c.context(), 65536);
        c.rope_scaling = None;
        assert_eq!(c.context(), 32768);
    }

    #[test]
    fn hf_scaling_errors_are_named() {
        let err = |v: serde_json::Value| RopeScaling::from_hf(&v, 32768).unwrap_err();
        assert!(err(json!({"type": "yarn"})).contains("needs a `factor`"));
        assert!(err(json!({"type": "yarn", "factor": "4"})).contains("rope_scaling.factor"));
        assert!(err(json!({"type": "dynamic", "factor": 2.0}))
            .contains("unsupported rope_scaling type `dynamic`"));
        assert!(err(json!({"type": "yarn", "factor": 4, "truncate": 1}))
            .contains("rope_scaling.truncate"));
        assert!(
            err(json!({"type": "yarn", "factor": 4, "original_max_position_embeddings": -1}))
                .contains("original_max_position_embeddings")
        );
        assert_eq!(
            RopeScaling::from_hf(&json!({"type": "default"}), 1),
            Ok(None)
        );
        // Values that parse but cannot scale are refused by `validate`, with the reason.
        let c = qwen(Some(RopeScaling::Yarn(YarnRopeScaling::new(0.5, 32768))));
        assert!(c.validate().unwrap_err().contains("must be at least 1"));
        let c = qwen(Some(RopeScaling::Linear { factor: f64::NAN }));
        assert!(c
            .validate()
            .unwrap_err()
            .contains("must be finite and positive"));
        let mut c = qwen(Some(RopeScaling::Yarn(YarnRopeScaling::new(4.0, 32768))));
        c.rope_theta = 1.0;
        assert!(c.validate().unwrap_err().contains("must be above 1"));
        let c = qwen(Some(RopeScaling::Yarn(YarnRopeScaling::new(1e30, 32768))));
        assert!(c
            .validate()
            .unwrap_err()
            .contains("beyond the supported maximum"));
    }

    /// llama.cpp's flags: a type, a factor, YaRN's settings, over what the model has.
    #[test]
    fn hf_qwen3_configs() {
        let parse = |v: serde_json::Value| {
            let hf: HfConfig = serde_json::from_value(v).unwrap();
            hf.to_model_config(Path::new("config.json"))
        };
        let base = json!({"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
            "tie_word_embeddings": true});
        let with = |extra: serde_json::Value| {
            let mut v = base.clone();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            v
        };
        // Named by `architectures` only, without `head_dim`: transformers' Qwen3Config
        // default of 128 (not hidden / heads = 64), q/k norms, no biases, NeoX RoPE.
        let c = parse(with(json!({"architectures": ["Qwen3ForCausalLM"]}))).unwrap();
        assert_eq!(c.arch, Arch::Qwen3);
        assert_eq!(c.head_dim, 128);
        assert!(c.qk_norm && !c.attention_bias && !c.rope_interleaved);
        let c = parse(with(json!({"model_type": "qwen3", "head_dim": 64}))).unwrap();
        assert_eq!((c.arch, c.head_dim), (Arch::Qwen3, 64));
        // Qwen 2.5 has neither the norms nor that default.
        let c = parse(with(json!({"model_type": "qwen2"}))).unwrap();
        assert!(!c.qk_norm && c.attention_bias && c.head_dim == 64);
        // Qwen 3 MoE (Qwen3-30B-A3B's config.json, in part): the mixture's settings, Qwen 3's
        // attention.
        let moe = json!({"model_type": "qwen3_moe", "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": []});
        let c = parse(with(moe.clone())).unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe);
        // Without `head_dim`, hidden / heads: transformers' Qwen3MoeConfig has no default
        // of 128 (the released configs all give 128).
        assert!(c.qk_norm && !c.attention_bias && c.head_dim == 64);
        assert_eq!(
            c.moe,
            Some(MoeConfig {
                num_experts: 128,
                experts_per_token: 8,
                expert_intermediate_size: 768,
                norm_topk_prob: true,
            })
        );
        assert_eq!(c.ffn_row_width(), 8 * 768);
        // Named by `architectures`; transformers' default leaves the weights as they are.
        let mut v = with(moe.clone());
        let o = v.as_object_mut().unwrap();
        o.remove("model_type");
        o.remove("norm_topk_prob");
        o.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
        let c = parse(v).unwrap();
        assert_eq!(
            (c.arch, c.moe.unwrap().norm_topk_prob),
            (Arch::Qwen3Moe, false)
        );
        // Transformers 5 saves the expert count as `num_local_experts`.
        let mut v = with(moe.clone());
        let o = v.as_object_mut().unwrap();
        o.remove("num_experts");
        o.insert("num_local_experts".into(), json!(64));
        assert_eq!(parse(v).unwrap().moe.unwrap().num_experts, 64);
        // What the engine cannot run, or cannot know, is refused by name.
        let refused = |extra: serde_json::Value, want: &str| {
            let mut v = with(moe.clone());
            let o = v.as_object_mut().unwrap();
            for (k, x) in extra.as_object().unwrap() {
                if x.is_null() {
                    o.remove(k);
                } else {
                    o.insert(k.clone(), x.clone());
                }
            }
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains(want), "{extra}: {err}");
        };
        refused(json!({"decoder_sparse_step": 2}), "decoder_sparse_step 2");
        refused(json!({"mlp_only_layers": [0, 3]}), "mlp_only_layers [0, 3]");
        refused(json!({"num_experts": null}), "needs `num_experts`");
        refused(
            json!({"moe_intermediate_size": null}),
            "needs `moe_intermediate_size`",
        );
        refused(
            json!({"num_experts_per_tok": 129}),
            "129 experts per token of 128",
        );
        refused(json!({"num_experts_per_tok": 0}), "0 experts per token");
        refused(json!({"num_experts": 100000}), "100000 experts per layer");
        // Other mixtures are not read as dense models.
        let err = parse(with(json!({"model_type": "qwen3", "num_experts": 8})))
            .unwrap_err()
            .to_string();
        assert!(err.contains("Qwen 3 MoE only"), "{err}");
        let err = parse(with(json!({"model_type": "qwen2_moe"})))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`qwen2_moe`"), "{err}");
    }

    /// Transformers 5's `rope_parameters` (base and scaling in one object) stands over
    /// `rope_theta` and `rope_scaling`, rather than leaving the default base of 10000.
    #[test]
    fn hf_rope_parameters() {
        let parse = |extra: serde_json::Value| {
            let mut v = json!({"model_type": "qwen2", "vocab_size": 16, "hidden_size": 128,
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 32768});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let hf: HfConfig = serde_json::from_value(v).unwrap();
            hf.to_model_config(Path::new("config.json"))
        };
        let c =
            parse(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (1e6, None));
        let c = parse(json!({"rope_theta": 5e5, "rope_parameters": {"rope_theta": 1e6}})).unwrap();
        assert_eq!(c.rope_theta, 1e6);
        let c = parse(
            json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768, "rope_theta": 1e6}}),
        )
        .unwrap();
        assert_eq!(c.context(), 131072);
        assert_eq!(
            (c.rope_theta, c.rope_scaling),
            (
                1e6,
                Some(RopeScaling::Yarn(YarnRopeScaling::new(4.0, 32768)))
            )
        );
        // Without it, the old fields as before.
        let c = parse(json!({"rope_theta": 5e5})).unwrap();
        assert_eq!(c.rope_theta, 5e5);
        for (bad, want) in [
            (
                json!({"rope_theta": "1e6"}),
                "rope_parameters.rope_theta must be a number",
            ),
            (
                json!({"rope_type": "dynamic", "factor": 2.0}),
                "rope_parameters: unsupported",
            ),
        ] {
            let err = parse(json!({ "rope_parameters": bad }))
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn overrides_follow_llama_cpp_flags() {
        let apply = |o: RopeOverride, own: Option<RopeScaling>| {
            let mut c = qwen(own);
            o.apply(&mut c).map(|()| c)
        };
        // YaRN ×4 on a model without scaling: 128K.
        let c = apply(
            RopeOverride {
                scaling: Some(RopeScalingType::Yarn),
                factor: Some(4.0),
                ..Default::default()
            },
            None,
        )
        .unwrap();
        assert_eq!(
            c.rope_scaling,
            Some(RopeScaling::Yarn(YarnRopeScaling::new(4.0, 32768)))
        );
        assert_eq!(c.context(), 131072);
        // A factor alone: linear on a model without scaling (llama.cpp's default type), the
        // model's type otherwise.
        let factor = |f| RopeOverride {
            factor: Some(f),
            ..Default::default()
        };
        let c = apply(factor(2.0), None).unwrap();
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
        let own = RopeScaling::Yarn(YarnRopeScaling {
            beta_fast: 16.0,
            attention_factor: 1.5,
            ..YarnRopeScaling::new(4.0, 8192)
        });
        let c = apply(factor(8.0), Some(own.clone())).unwrap();
        let Some(RopeScaling::Yarn(y)) = c.rope_scaling else {
            panic!()
        };
        // The model's betas stay; its attention factor was for its own factor.
        assert_eq!(
            (y.factor, y.beta_fast, y.original_max_position_embeddings),
            (8.0, 16.0, 8192)
        );
        assert_eq!(y.attention_factor, yarn_mscale(8.0, 1.0));
        // Settings of the model's own factor keep its attention factor; --yarn-attn-factor
        // multiplies the default one.
        let o = RopeOverride {
            original_context: Some(4096),
            ..Default::default()
        };
        let Some(RopeScaling::Yarn(y)) = apply(o, Some(own.clone())).unwrap().rope_scaling else {
            panic!()
        };
        assert_eq!(
            (y.original_max_position_embeddings, y.attention_factor),
            (4096, 1.5)
        );
        let o = RopeOverride {
            attn_factor: Some(0.5),
            ..Default::default()
        };
        let Some(RopeScaling::Yarn(y)) = apply(o, Some(own.clone())).unwrap().rope_scaling else {
            panic!()
        };
        assert_eq!(y.attention_factor, 0.5 * yarn_mscale(4.0, 1.0));
        // `none` removes it; the base changes alone.
        let o = RopeOverride {
            scaling: Some(RopeScalingType::None),
            freq_base: Some(5e5),
            ..Default::default()
        };
        let c = apply(o, Some(own.clone())).unwrap();
        assert_eq!(
            (c.context(), c.rope_theta, c.rope_scaling),
            (32768, 5e5, None)
        );
        // Contradictions are refused.
        let o = RopeOverride {
            scaling: Some(RopeScalingType::Linear),
            beta_fast: Some(8.0),
            ..Default::default()
        };
        assert!(apply(o, None).unwrap_err().contains("need YaRN"));
        let o = RopeOverride {
            scaling: Some(RopeScalingType::Yarn),
            ..Default::default()
        };
        assert!(apply(o, None).unwrap_err().contains("needs a factor"));
        let llama3 = RopeScaling::Llama3(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        assert!(apply(factor(2.0), Some(llama3))
            .unwrap_err()
            .contains("Llama 3.1"));
        let o = RopeOverride {
            freq_base: Some(-1.0),
            ..Default::default()
        };
        assert!(apply(o, None).unwrap_err().contains("rope_theta -1"));
        assert!(apply(factor(0.0), None)
            .unwrap_err()
            .contains("finite and positive"));
    }
}
