//! Errors of the engine.

use keydiff_model::ModelError;

/// Everything `Engine` can refuse or fail at; each message names the problem.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `limited`: the context is the one the engine was set to run with
    /// ([`crate::EngineConfig::context`]), shorter than the model's.
    #[error("the prompt has {tokens} tokens, beyond {} of {context}", whose_context(.limited))]
    PromptTooLong {
        tokens: usize,
        context: usize,
        limited: bool,
    },
    /// A prompt text too long for the context whatever its tokens, refused before it is
    /// tokenized ([`crate::Engine::check_text_fits`]): `tokens` is a lower bound.
    #[error(
        "the prompt's text of {bytes} bytes has at least {tokens} tokens, beyond {} of {context}",
        whose_context(.limited)
    )]
    PromptTextTooLong {
        bytes: usize,
        tokens: usize,
        context: usize,
        limited: bool,
    },
    #[error("this model has no chat template (tokenizer.chat_template / tokenizer_config.json)")]
    NoChatTemplate,
    #[error("Hugging Face hub: {0}")]
    Hub(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid parameter: {0}")]
    BadParams(String),
    /// A request setting the engine cannot honour, by its field's name (`min_tokens`,
    /// `logit_bias`, `stop_token_ids`, `suffix`, `ignore_eos`, `top_p`, ...), which an API
    /// error names.
    #[error("invalid parameter: {reason}")]
    BadField { field: &'static str, reason: String },
    /// A device that cannot be used here (`--device`): the reason says why.
    #[error("device `{name}`: {reason}")]
    Device { name: String, reason: String },
    /// A request's KV cache cannot fit in the memory there is (the message has the numbers).
    #[error("not enough memory: {0}")]
    OutOfMemory(String),
    /// The prefill of a prompt shared by several completions failed (the first completion has
    /// the error itself).
    #[error("the prefill of the prompt, shared with another completion, failed: {0}")]
    SharedPrefill(String),
    /// A saved KV cache that cannot be written, read or used here (the reason says which).
    #[error("KV cache file {}: {reason}", path.display())]
    CacheFile {
        path: std::path::PathBuf,
        reason: String,
    },
    /// The model's logits after a prompt hold a NaN or an infinity: every token would be a
    /// meaningless pick (an argmax of NaNs is the first id).
    #[error(
        "the model's logits after the prompt are not finite (NaN or infinity): its weights are \
         broken{}",
        overflow_hint(.dtype)
    )]
    NonFiniteLogits { dtype: String },
    #[error(transparent)]
    Cache(#[from] keydiff_cache::CacheError),
    #[error(transparent)]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Candle(keydiff_cache::without_backtrace(e))
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, EngineError>;

fn overflow_hint(dtype: &str) -> String {
    match dtype {
        "f32" => String::new(),
        d => format!(", or its activations overflow in {d} (--dtype bf16 or f32 may hold them)"),
    }
}

fn whose_context(limited: &bool) -> &'static str {
    if *limited {
        "the context set to run with (-c/--ctx-size)"
    } else {
        "the model's context"
    }
}
