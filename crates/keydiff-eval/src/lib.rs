//! keydiff-eval: long-context accuracy tasks for comparing eviction policies at equal budget.
//!
//! Each task turns a seed (or a LongBench record) into [`Sample`]s: a user turn, the text the
//! answer starts with, the reference answers and the metric that scores a prediction. The
//! runner ([`run`]) feeds samples to a [`keydiff::Engine`] under every policy and budget,
//! greedy, and aggregates the scores.

pub mod filler;
pub mod longbench;
pub mod metrics;
pub mod run;
pub mod synthetic;

pub use metrics::Metric;

/// One prompt to answer and how to score the answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Sample {
    /// `passkey`, `niah`, `phonebook` or `longbench/<task>`.
    pub task: String,
    /// Unique within the task (seed or record id).
    pub id: String,
    /// The user turn: context and question.
    pub prompt: String,
    /// Text the answer begins with, placed after the prompt (after the chat template's
    /// generation prompt when chat is used). May be empty.
    pub answer_prefix: String,
    /// Reference answers: the prediction is scored against each and the best score counts.
    pub answers: Vec<String>,
    /// Classes of a classification task (LongBench `all_classes`), else empty.
    pub all_classes: Vec<String>,
    pub metric: Metric,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// The length bucket in tokens this sample was made for (synthetic tasks) or its measured
    /// length (LongBench).
    pub length: usize,
    /// Where the needle sits, as a fraction of the context (synthetic tasks).
    pub depth: Option<f64>,
    /// Whether the model's chat template should wrap the prompt: `None` leaves it to the user's
    /// `--chat`; LongBench forces `Some(false)` for its few-shot and code tasks.
    pub chat: Option<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{path}: {msg}")]
    Data { path: String, msg: String },
    #[error("bad eval parameters: {0}")]
    Params(String),
    #[error(transparent)]
    Engine(#[from] keydiff::EngineError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, EvalError>;
