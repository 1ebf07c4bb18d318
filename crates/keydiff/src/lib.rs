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
pub use candle_core::{DType, Device};
pub use conversation::Conversation;
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
    AttentionBackend, CpuWeights, MemoryBudget, Message, ModelConfig, ModelError, ModelFormat,
    RopeOverride, RopeScaling, RopeScalingType, SamplingDefaults, TemplateKwargs,
};
pub use logprobs::{TokenLogprob, TokenPiece, MAX_TOP_LOGPROBS};
pub use perplexity::Perplexity;
pub use prompt_cache::{PromptCache, Reuse};
pub use sampling::{Format, Sampler, Sampling};
pub use source::ModelSource;
pub use speculative::{NgramSpec, SpecCounters, MAX_DRAFT};
pub use stream::TextStream;

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

/// Parses `cpu`, `cuda`, `cuda:N` into a device, opening a CUDA device. A device that cannot
/// be used is refused with what is wrong: a build without the `cuda` feature, an ordinal past
/// the devices the driver sees (it names them), or the driver's own error.
pub fn parse_device(s: &str) -> Result<Device> {
    let ordinal = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        s if s.starts_with("cuda:") => s[5..]
            .parse()
            .map_err(|_| EngineError::BadParams(format!("bad device `{s}` (expected cuda:N)")))?,
        other => {
            return Err(EngineError::BadParams(format!(
                "unknown device `{other}` (expected cpu, cuda, cuda:N)"
            )))
        }
    };
    open_cuda(s, ordinal)
}

#[cfg(feature = "cuda")]
fn open_cuda(name: &str, ordinal: usize) -> Result<Device> {
    use candle_core::cuda_backend::cudarc::driver::{sys::CUresult, CudaContext, DriverError};
    let refuse = |reason: String| EngineError::Device {
        name: name.to_string(),
        reason,
    };
    let said = |e: &DriverError| {
        // A stub or broken driver may not describe its own error.
        let text = e
            .error_string()
            .map_or(String::new(), |s| format!(": {}", s.to_string_lossy()));
        let hint = match e.0 {
            CUresult::CUDA_ERROR_NO_DEVICE => {
                " (is a GPU there? see nvidia-smi, and CUDA_VISIBLE_DEVICES)"
            }
            CUresult::CUDA_ERROR_STUB_LIBRARY => {
                " (the libcuda.so.1 found is CUDA's link stub: no NVIDIA driver is installed, \
                 or the stub comes first on LD_LIBRARY_PATH)"
            }
            _ => "",
        };
        format!("the CUDA driver says {:?}{text}{hint}", e.0)
    };
    let count = CudaContext::device_count().map_err(|e| refuse(said(&e)))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(refuse(match count {
            0 => "the CUDA driver sees no device (see nvidia-smi, and CUDA_VISIBLE_DEVICES)".into(),
            1 => "this machine has 1 CUDA device, cuda:0".into(),
            n => format!(
                "this machine has {n} CUDA devices, cuda:0 to cuda:{}",
                n - 1
            ),
        }));
    }
    Device::new_cuda(ordinal).map_err(|e| refuse(format!("cannot open it: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(name: &str, _ordinal: usize) -> Result<Device> {
    Err(EngineError::Device {
        name: name.to_string(),
        reason: "this keydiff was built without CUDA; build it with `--features cuda` \
                 (scripts/build-cuda.sh builds one without a GPU)"
            .into(),
    })
}

/// What to do about a CUDA failure, from the text of its error (the driver names the cause:
/// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, ...): for the causes a user can fix. `None` for other
/// errors. `keydiff` prints it under the error.
pub fn cuda_error_hint(error: &str) -> Option<String> {
    if error.contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION") {
        let built = match (arch::BUILD_CUDA_VERSION, arch::ptx_isa()) {
            (Some(v), Some(isa)) => format!(" (CUDA {v}, PTX ISA {isa})"),
            (Some(v), None) => format!(" (CUDA {v})"),
            (None, Some(isa)) => format!(" (PTX ISA {isa})"),
            (None, None) => String::new(),
        };
        return Some(format!(
            "the NVIDIA driver is older than the CUDA toolkit this keydiff's GPU code was built \
             with{built}: update the driver (nvidia-smi shows the newest CUDA it supports), or \
             build keydiff with a toolkit it supports"
        ));
    }
    if error.contains("CUDA_ERROR_NO_BINARY_FOR_GPU")
        || error.contains("no kernel image is available")
    {
        let target = arch::Arch::of_build().map_or("an unrecorded architecture".into(), |a| {
            format!("{} ({})", a.name(), a.runs_on())
        });
        return Some(format!(
            "nothing of this keydiff's GPU code could be loaded for this GPU. Either the build \
             targets another architecture, {target}: build it for this GPU's compute capability \
             (nvidia-smi --query-gpu=compute_cap --format=csv; `scripts/build-cuda.sh 80` for an \
             A100); or the driver's PTX compiler (libnvidia-ptxjitcompiler.so.1) is missing, as in \
             containers given only part of the driver"
        ));
    }
    if error.contains("CUDA_ERROR_OUT_OF_MEMORY") {
        return Some(
            "the GPU ran out of memory beyond what keydiff planned (another process, or \
             candle's temporaries): a smaller --budget or --ctx-size, a quantized cache \
             (--kv-dtype q8_0), or a --memory-limit below the free memory, which requests are \
             then planned within"
                .into(),
        );
    }
    None
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_failures_a_user_can_fix_get_a_hint() {
        let ptx =
            "loading weights: DriverError(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, \"the provided \
                   PTX was compiled with an unsupported toolchain.\")";
        let h = cuda_error_hint(ptx).expect("a hint for an old driver");
        assert!(
            h.starts_with("the NVIDIA driver is older than the CUDA toolkit"),
            "{h}"
        );
        let h = cuda_error_hint("CUDA_ERROR_NO_BINARY_FOR_GPU").expect("a hint for the arch");
        let target = arch::Arch::of_build().map_or("an unrecorded architecture".into(), |a| {
            format!("targets another architecture, {}", a.name())
        });
        assert!(h.contains(&target), "{h}");
        assert!(h.contains("libnvidia-ptxjitcompiler.so.1"), "{h}");
        let h = cuda_error_hint("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
            .expect("a hint for memory");
        assert!(h.contains("--memory-limit"), "{h}");
        for other in [
            "the prompt is empty",
            "DriverError(CUDA_ERROR_UNKNOWN, \"\")",
            "",
        ] {
            assert_eq!(cuda_error_hint(other), None, "{other}");
        }
    }
}
