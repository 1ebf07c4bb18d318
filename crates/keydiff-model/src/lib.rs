//! Llama 3.x / Qwen 2.5 for keydiff: config, weights (GGUF | safetensors | random), RoPE,
//! chunk attention over a budgeted KV cache, tokenizer and chat template.

pub mod attention;
pub mod chat;
pub mod config;
mod decode_kernel;
pub mod error;
mod gguf_check;
pub mod kv_rotation;
mod load;
pub mod memory;
pub mod model;
pub mod rope;
mod sample;
pub mod tokenizer;
pub mod weights;

pub use attention::AttentionBackend;
pub use chat::{ChatTemplate, Message, TemplateKwargs, ToolCall};
pub use config::{
    Arch, Llama3RopeScaling, ModelConfig, MoeConfig, RopeOverride, RopeScaling, RopeScalingType,
    YarnRopeScaling,
};
pub use error::{ModelError, Result};
pub use load::{
    load_gguf, load_hf_dir, load_random, Loaded, MemoryPlan, ModelFormat, SamplingDefaults, Vocab,
};
pub use memory::MemoryBudget;
pub use model::{Logits, Model, Segment};
pub use weights::{parse_weight_type, weight_type_name, CpuWeights, WeightPlan, WEIGHT_TYPES};
