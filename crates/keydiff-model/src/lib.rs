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
pub use chat::{
    resolve_template, ChatTemplate, Message, TemplateKwargs, ToolCall, BUILTIN_TEMPLATES,
};
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

/// True when this build's CPU code uses AVX2, FMA and F16C (the target has them: `-C
/// target-cpu=native` or x86-64-v3), as candle's CPU matmuls and keydiff's decode kernel do
/// only then.
pub const SIMD_BUILD: bool = cfg!(avx2_f16c);

/// The reason a CPU run is slower than it could be: this machine has AVX2, FMA and F16C but
/// the build does not use them (a program that depends on keydiff without
/// `-C target-cpu=native`). `None` where the build fits the machine.
pub fn cpu_build_note() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    if !SIMD_BUILD
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
    {
        return Some(
            "this CPU has AVX2/FMA/F16C but the build does not use them: CPU inference runs \
             3-4x slower (build with RUSTFLAGS=\"-C target-cpu=native\")",
        );
    }
    None
}
