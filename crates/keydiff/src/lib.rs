//! keydiff: long-prompt LLM inference on candle under a fixed KV-cache budget.
//!
//! ```no_run
//! use keydiff::{Engine, EngineConfig, GenerateParams, ModelSource, Prompt};
//! let engine = Engine::load(&ModelSource::parse("models/SmolLM2-135M-Instruct.Q4_1.gguf")?,
//!                           &EngineConfig::default())?;
//! let params = GenerateParams { prompt: Prompt::Text("Hello".into()), ..Default::default() };
//! let out = engine.generate(&params, |ev| if let keydiff::Event::Text(t) = ev { print!("{t}") })?;
//! println!("\n{:?}", out.stats);
//! # Ok::<(), keydiff::EngineError>(())
//! ```

mod batch;
pub mod bench;
mod cache_file;
mod conversation;
mod devices;
mod engine;
mod error;
pub mod grammar;
pub mod json_mode;
pub mod json_schema;
pub mod kernel_check;
pub mod logprobs;
pub mod parity;
mod perplexity;
mod prompt_cache;
pub mod reasoning;
mod sampling;
mod source;
mod speculative;
mod stream;
pub mod tools;

pub use batch::{Batch, Ended};
pub use cache_file::{CACHE_FILE_FORMAT, CACHE_FILE_VERSION};
pub use candle_core::quantized::GgmlDType;
pub use candle_core::{DType, Device};
pub use conversation::Conversation;
pub use devices::{cuda_devices, cuda_error_hint, parse_device, CudaDeviceInfo};
pub use engine::{
    Breakdown, CancelToken, Engine, EngineConfig, Event, GenerateParams, InfillFile, Output,
    Prefix, Prompt, Stats, StopReason, DEFAULT_CHUNK,
};
pub use error::{EngineError, Result};
pub use keydiff_cache::arch;
pub use keydiff_cache::config::SNAPKV_WINDOW;
pub use keydiff_cache::{
    Anchor, CacheConfig, CacheCounters, KvCache, KvType, KvTypes, PolicyKind, StatsNeed,
};
pub use keydiff_model::chat::check_template_kwargs;
pub use keydiff_model::memory::{human as human_bytes, parse_size};
pub use keydiff_model::{
    parse_weight_type, weight_type_name, AttentionBackend, CpuWeights, MemoryBudget, Message,
    ModelConfig, ModelError, ModelFormat, RopeOverride, RopeScaling, RopeScalingType,
    SamplingDefaults, TemplateKwargs, WEIGHT_TYPES,
};
pub use logprobs::{TokenLogprob, TokenPiece, MAX_TOP_LOGPROBS};
pub use perplexity::Perplexity;
pub use prompt_cache::{PromptCache, Reuse};
pub use sampling::{draw, DrawParams, Format, Sampler, Sampling};
pub use source::ModelSource;
pub use speculative::{NgramSpec, SpecCounters, MAX_DRAFT};
pub use stream::{Stopped, TextStream};

/// The commit this library was built from (`git describe --always --dirty`), when it was built
/// in a git checkout; `None` otherwise (a crates.io build).
pub const BUILD_COMMIT: Option<&str> = option_env!("KEYDIFF_BUILD_COMMIT");

/// The version, the commit it was built from and the GPU features built in, e.g.
/// `0.1.0 (build 46d9d06a1b2c, features: cuda sm_90a, flash-attn)`: what `keydiff --version` prints,
/// for bug reports and results. A FlashAttention build with only some kernels
/// (`scripts/build-cuda.sh --flash`) names them: `flash-attn [hdim64_bf16 hdim128_bf16]`.
pub fn build_info() -> String {
    let flash = match keydiff_model::attention::FLASH_KERNELS.map(str::trim) {
        None => None,
        Some("") => Some("flash-attn".to_string()),
        Some(some) => Some(format!(
            "flash-attn [{}]",
            some.split_whitespace().collect::<Vec<_>>().join(" ")
        )),
    };
    // The architecture the CUDA code was built for (`arch`), when the build recorded it.
    let cuda = cfg!(feature = "cuda").then(|| match arch::Arch::of_build() {
        Some(a) => format!("cuda {}", a.name()),
        None => "cuda".to_string(),
    });
    let features: Vec<String> = [cuda, flash].into_iter().flatten().collect();
    format!(
        "{} (build {}, features: {})",
        env!("CARGO_PKG_VERSION"),
        BUILD_COMMIT.unwrap_or("unknown"),
        if features.is_empty() {
            "cpu only".to_string()
        } else {
            features.join(", ")
        }
    )
}

/// Parses what a KV cache holds: `f32`, `f16`, `bf16`, `fp8` (`f8e4m3`, `fp8_e4m3`), `q8_0`,
/// `q5_1`, `q5_0`, `q4_1` or `q4_0` ([`KvType::parse`]).
pub fn parse_kv_dtype(s: &str) -> Result<KvType> {
    KvType::parse(s).ok_or_else(|| {
        EngineError::BadParams(format!(
            "unknown KV cache type `{s}` (expected {})",
            KvType::NAMES
        ))
    })
}

/// Parses `f32`, `f16`, `bf16`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => Err(EngineError::BadParams(format!(
            "unknown dtype `{other}` (expected f32, f16, bf16)"
        ))),
    }
}
