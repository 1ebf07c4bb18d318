//! Model hyper-parameters, read from HF `config.json` or from GGUF metadata.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::DType;
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// The transformer families this crate runs. Both are pre-norm decoders with GQA, SwiGLU and RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 3.x (and SmolLM2, which shares the architecture).
    Llama,
    /// Qwen 2.5: q/k/v projections carry biases.
    Qwen2,
}

impl Arch {
    /// Parses a GGUF `general.architecture` or HF `model_type`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }
}

/// Llama 3 `rope_scaling` with `rope_type = "llama3"`.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
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
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// The context the model was trained for; prompts plus output beyond it are refused.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections have a bias (Qwen 2.5).
    pub attention_bias: bool,
    /// Q/K rows are permuted for interleaved RoPE (GGUF `llama`); otherwise NeoX halves.
    pub rope_interleaved: bool,
}

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
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
    }

    /// Converts to the engine's config, checking what the engine cannot run.
    pub fn to_model_config(&self, path: &Path) -> Result<ModelConfig> {
        let arch_name = match (&self.model_type, self.architectures.first()) {
            (Some(t), _) => t.clone(),
            (None, Some(a)) if a.starts_with("Llama") => "llama".into(),
            (None, Some(a)) if a.starts_with("Qwen2") => "qwen2".into(),
            (None, Some(a)) => a.clone(),
            (None, None) => String::from("<none>"),
        };
        let arch = Arch::parse(&arch_name)?;
        let rope_scaling = match &self.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) if !v.is_object() => {
                return Err(ModelError::BadConfig {
                    path: path.to_path_buf(),
                    reason: format!("rope_scaling must be an object or null, found {v}"),
                })
            }
            Some(v) => {
                let kind = v
                    .get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(|t| t.as_str())
                    .unwrap_or("");
                match kind {
                    "llama3" => Some(serde_json::from_value(v.clone()).map_err(|e| {
                        ModelError::BadConfig {
                            path: path.to_path_buf(),
                            reason: format!("rope_scaling: {e}"),
                        }
                    })?),
                    "default" => None,
                    other => {
                        return Err(ModelError::BadConfig {
                            path: path.to_path_buf(),
                            reason: format!("unsupported rope_scaling type `{other}`"),
                        })
                    }
                }
            }
        };
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
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
            rope_theta: self.rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias.unwrap_or(arch == Arch::Qwen2),
            rope_interleaved: false,
        };
        cfg.validate().map_err(|reason| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(cfg)
    }
}

impl ModelConfig {
    /// Bytes of K and V at `slots` per layer and KV head in `dtype`: slots · layers · kv_heads
    /// · head_dim · 2 · bytes(dtype), the cache's peak (what `KvCache::bytes` reports).
    pub fn kv_cache_bytes(&self, slots: usize, dtype: DType) -> u64 {
        (slots as u64)
            * (self.num_layers * self.num_kv_heads * self.head_dim * 2 * dtype.size_in_bytes())
                as u64
    }

    /// Activation bytes of one token row through a layer in f32, estimated: hidden states,
    /// q/k/v and the MLP (part of [`ModelConfig::request_scratch_bytes`]).
    pub fn row_activation_bytes(&self) -> u64 {
        4 * (6 * self.hidden_size + 3 * self.intermediate_size) as u64
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
                reason: e.to_string(),
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
        let head_dim = opt_int("attention.key_length")?.unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match opt_int("vocab_size")? {
            Some(v) => v,
            None => get("tokenizer.ggml.tokens")?
                .to_vec()
                .map_err(|e| ModelError::BadGguf {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })?
                .len(),
        };
        let tie_word_embeddings = !ct.tensor_infos.contains_key("output.weight");
        let attention_bias = ct.tensor_infos.contains_key("blk.0.attn_q.bias");
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: int("feed_forward_length")?,
            num_layers: int("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")?,
            rope_theta: opt_float("rope.freq_base")?.unwrap_or(10_000.0),
            // GGUF carries Llama 3.1 scaling as the `rope_freqs.weight` tensor instead.
            rope_scaling: None,
            max_position_embeddings: int("context_length")?,
            tie_word_embeddings,
            attention_bias,
            rope_interleaved: arch == Arch::Llama,
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
        // linear when no type is given; 0 and 1 mean no scaling.
        let kind = match md.get(&format!("{a}.rope.scaling.type")) {
            None => "linear".to_string(),
            Some(v) => v
                .to_string()
                .map_err(|_| bad(&format!("{a}.rope.scaling.type"), "a string", v))?
                .clone(),
        };
        // llama.cpp never scales when the type is `none`, whatever the factor.
        let keys: &[&str] = if kind == "none" {
            &[]
        } else {
            &["rope.scaling.factor", "rope.scale_linear"]
        };
        for key in keys {
            if let Some(f) = opt_float(key)? {
                if f != 0.0 && f != 1.0 {
                    return Err(unsupported(format!(
                        "`{a}.{key}` is {f} ({kind} RoPE scaling): only unscaled RoPE and \
                         Llama 3.1 `rope_freqs` are supported"
                    )));
                }
            }
        }
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
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!(
                "rms_norm_eps {} must be finite and non-negative",
                self.rms_norm_eps
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!(
                "rope_theta {} must be finite and positive",
                self.rope_theta
            ));
        }
        if let Some(r) = &self.rope_scaling {
            let ok = r.factor.is_finite()
                && r.factor > 0.0
                && r.low_freq_factor.is_finite()
                && r.low_freq_factor > 0.0
                && r.high_freq_factor.is_finite()
                && r.high_freq_factor > r.low_freq_factor
                && r.original_max_position_embeddings > 0;
            if !ok {
                return Err(format!(
                    "rope_scaling {r:?}: needs factor > 0, 0 < low_freq_factor < \
                     high_freq_factor and original_max_position_embeddings > 0"
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
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}
