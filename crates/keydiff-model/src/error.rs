//! One error enum for everything that can go wrong while loading or running a model.

use std::path::PathBuf;

/// Errors of the model crate. Every variant names the file or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file or directory not found: {0}")]
    NotFound(PathBuf),
    #[error("unsupported architecture `{0}` (supported: llama, qwen2, qwen3)")]
    UnsupportedArch(String),
    #[error("invalid GGUF file {path}: {reason}")]
    BadGguf { path: PathBuf, reason: String },
    #[error("invalid safetensors in {path}: {reason}")]
    BadSafetensors { path: PathBuf, reason: String },
    #[error("invalid config {path}: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error("missing metadata key `{0}`")]
    MissingKey(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("unknown pre-tokenizer `tokenizer.ggml.pre = {0}` (supported: {known})", known = crate::tokenizer::known_pre_tokenizers())]
    UnknownPreTokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A planned allocation cannot fit in the memory there is (the message has the numbers).
    #[error("not enough memory: {0}")]
    OutOfMemory(String),
    /// The message has the I/O error's own; it is not also the [`std::error::Error::source`],
    /// which a printer of the chain (anyhow's `{:#}`) would print a second time.
    #[error("io error on {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Cache(#[from] keydiff_cache::CacheError),
    #[error(transparent)]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Candle(keydiff_cache::without_backtrace(e))
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

/// Returns early with a [`ModelError`].
#[macro_export]
macro_rules! bail {
    ($e:expr) => {
        return Err($e.into())
    };
}
