//! The engine: load a model once, then generate with chunked prefill and streamed text.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use keydiff_cache::{CacheConfig, CacheCounters, KvCache, KvType, KvTypes};
use keydiff_model::memory::human;
use keydiff_model::{
    load_gguf, load_hf_dir, load_random, AttentionBackend, CpuWeights, Loaded, Logits,
    MemoryBudget, MemoryPlan, Message, ModelConfig, ModelFormat, RopeOverride,
};
use rand::rngs::StdRng;

use crate::error::{EngineError, Result};
use crate::grammar::{Grammar, GrammarState};
use crate::json_mode::JsonObject;
use crate::logprobs::{
    rows_logprobs, token_logprob, token_pieces, TokenLogprob, TokenPiece, MAX_TOP_LOGPROBS,
};
use crate::sampling::{Format, Sampler, Sampling};
use crate::source::ModelSource;
use crate::stream::{Stopped, TextStream};

/// Prefill chunk size B when none is given: the paper's setting.
pub const DEFAULT_CHUNK: usize = 128;

/// How and where the engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub device: Device,
    /// Activation dtype, and the KV cache's unless `kv_dtype` says otherwise (f32 on CPU is
    /// the reference; bf16 on GPU).
    pub dtype: DType,
    /// What the KV cache holds: f32, f16, bf16, fp8 (`DType::F8E4M3`) or blocks of one of
    /// llama.cpp's quantized types ([`KvType::Q8_0`], `Q5_1`, `Q5_0`, `Q4_1`, `Q4_0`), for
    /// keys and values alike or each its own ([`KvTypes`]; `None`: `dtype`; a `DType` or
    /// `KvType` converts with `.into()`). f16 on the CPU halves the cache's memory, as
    /// llama.cpp's default cache type does; q8_0 takes 1.06 bytes a value, q4_0 0.56.
    /// [`Engine::config`] reports the types in use.
    pub kv_dtype: Option<KvTypes>,
    /// Stores quantized caches Hadamard-rotated, as llama.cpp does (default true): keys and
    /// values of a block type are multiplied per head by an orthonormal Hadamard matrix
    /// before they are quantized, which spreads outlier channels over the block and leaves
    /// attention unchanged (`keydiff_model::kv_rotation`). No effect on float caches.
    pub kv_rotation: bool,
    /// Chunk size B, budget N, eviction policy and timing.
    pub cache: CacheConfig,
    /// How quantized GGUF weights are kept on the CPU: a dense copy for prefill chunks (GEMM
    /// instead of per-row quantized dots: faster and chunk-size invariant) and Q8_0 copies of
    /// types candle has no SIMD kernel for. Ignored on GPUs.
    pub cpu_weights: CpuWeights,
    /// How chunk attention is computed: eager (materialised probabilities, every device), flash
    /// (fused kernel; on CUDA it needs the `flash-attn` feature) or auto (resolved at load;
    /// [`Engine::config`] then reports the choice).
    pub attention: AttentionBackend,
    /// Memory the engine may plan with on its device, in bytes: host memory on the CPU, the
    /// GPU's memory on CUDA (`None`: what there is, measured when needed: on the CPU
    /// `MemAvailable` and free swap under the cgroup's limit and `ulimit -v`, on CUDA the
    /// device's free memory). The weights, their CPU copies and each request's KV cache and
    /// activations are planned against it before they are allocated: optional weight copies
    /// are dropped when they do not fit, and a model or cache that cannot fit is refused with
    /// the numbers.
    pub memory_limit: Option<u64>,
    /// Changes to the model's RoPE base and scaling (llama.cpp's `--rope-scaling`,
    /// `--rope-scale`, `--yarn-orig-ctx`, ...): e.g. YaRN for Qwen 2.5 beyond 32K tokens. The
    /// context grows with the scaling ([`ModelConfig::context`]).
    pub rope: RopeOverride,
    /// A Jinja chat template to use in place of the model's (llama.cpp's `--chat-template`,
    /// vLLM's `--chat-template`): for a model without one, or to fix or change its own. A
    /// built-in's name (`chatml`, `llama3`: [`keydiff_model::BUILTIN_TEMPLATES`]) stands for
    /// its text; other text without Jinja markup is refused.
    pub chat_template: Option<String>,
    /// Variables every chat template render gets beside the messages (llama.cpp's
    /// `--chat-template-kwargs`), such as `{"enable_thinking": false}` for Qwen 3; a request's
    /// own ([`Prompt::ChatTools`]) override them by name.
    pub chat_template_kwargs: crate::TemplateKwargs,
    /// The context to run with, prompt and output together (llama.cpp's `-c`, vLLM's
    /// `--max-model-len`): at most the model's ([`ModelConfig::context`], RoPE scaling
    /// included); `None` or 0: the model's. Longer prompts are refused and generation stops
    /// there, and a full cache never needs more slots.
    pub context: Option<usize>,
    /// Evict each layer's cache right after its own attention, as `DESIGN.md` first laid it
    /// out, instead of every layer at once after the last layer's (the default; see
    /// [`KvCache::after_attention`]). Both keep the same tokens; the default runs one
    /// selection and one set of moves per chunk instead of one per layer (and for KeyDiff
    /// on float caches and StreamingLLM one scoring). For measuring the difference
    /// (`keydiff bench ttft --eviction`).
    pub evict_per_layer: bool,
}

impl Default for EngineConfig {
    /// CPU, f32, full cache, B = 128, attention chosen at load (`auto`, as the CLI: eager on
    /// the CPU, flash on CUDA in a `flash-attn` build where the model and dtype allow it).
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
            kv_dtype: None,
            kv_rotation: true,
            cache: CacheConfig::full(DEFAULT_CHUNK),
            cpu_weights: CpuWeights::FAST,
            attention: AttentionBackend::Auto,
            memory_limit: None,
            rope: RopeOverride::default(),
            chat_template: None,
            chat_template_kwargs: crate::TemplateKwargs::new(),
            context: None,
            evict_per_layer: false,
        }
    }
}

impl EngineConfig {
    /// The memory budget of the device to plan with now: the limit, or what the system or
    /// the driver reports; `None` where neither says.
    fn memory_budget(&self) -> Option<MemoryBudget> {
        match self.memory_limit {
            Some(b) => Some(MemoryBudget::fixed(b)),
            None => MemoryBudget::detect_on(&self.device),
        }
    }
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Plain text, tokenized as is (BOS added when the model wants one).
    Text(String),
    /// Messages rendered with the model's chat template, generation prompt appended.
    Chat(Vec<Message>),
    /// Messages and the functions the model may call, rendered with the model's chat template
    /// (`tools`, none for a plain chat), generation prompt appended ([`crate::tools`]), with
    /// variables for the template (`template_kwargs`: a request's `chat_template_kwargs`,
    /// over [`EngineConfig::chat_template_kwargs`]).
    ChatTools {
        messages: Vec<Message>,
        tools: Vec<crate::tools::Tool>,
        template_kwargs: crate::TemplateKwargs,
    },
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// Fill in the middle: the model writes what goes between `prefix` and `suffix`, with its
    /// FIM tokens (`<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`, as
    /// llama.cpp's infill and OpenAI's `suffix`). Special tokens in the texts are not parsed.
    ///
    /// With `repo` (llama.cpp's `/infill` and its `input_extra`), the prompt is laid out as
    /// llama.cpp lays it out, for models trained on whole repositories (Qwen2.5-Coder): where
    /// the model has the tokens, `<|repo_name|>myproject\n`, then each file as
    /// `<|file_sep|>name\n` and its text (without a file separator, after a `--- snippet ---`
    /// line), then `<|file_sep|>filename\n` before the FIM tokens (llama.cpp's placeholder
    /// names of the project and the current file).
    Infill {
        prefix: String,
        suffix: String,
        repo: Option<Vec<InfillFile>>,
    },
}

/// A file of the project beside a fill in the middle (llama.cpp's `input_extra` chunk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfillFile {
    pub name: String,
    pub text: String,
}

impl Prompt {
    /// A chat's messages.
    pub fn messages(&self) -> Option<&[Message]> {
        match self {
            Prompt::Chat(m) | Prompt::ChatTools { messages: m, .. } => Some(m),
            _ => None,
        }
    }
}

/// One request.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub prompt: Prompt,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Generation ends when the text contains one of these (it is not emitted).
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (for benchmarks).
    pub ignore_eos: bool,
    /// Generation also ends at these tokens, as at an end-of-generation one
    /// ([`StopReason::Eos`], its text not in the output), `ignore_eos` or not (vLLM's
    /// `stop_token_ids`).
    pub stop_tokens: Vec<u32>,
    /// vLLM's `min_tokens`: before this many tokens, the end-of-generation tokens (unless
    /// `ignore_eos`, or a constraint on the output, which ends it when its text is whole) and
    /// `stop_tokens` cannot be sampled (their logits are −∞; logprobs stay the model's), and
    /// the stops are not looked for in the text (their check begins at this token). 0: off.
    pub min_tokens: usize,
    /// Time the prefill's regions ([`Stats::breakdown`]). This synchronises the device at every
    /// region boundary, so it slows GPU runs: benchmarks use a separate profiled run.
    pub profile: bool,
    /// Checked before every prefill chunk and every decode step: once cancelled, the request
    /// ends there with [`StopReason::Cancelled`] and what it generated so far (a server stops
    /// the work of a client that went away).
    pub cancel: Option<CancelToken>,
    /// Report each generated token's log-probability with this many alternatives (at most
    /// [`MAX_TOP_LOGPROBS`]; `Some(0)`: the token's own only) in [`Output::logprobs`] and as
    /// [`Event::Logprob`] events.
    pub logprobs: Option<usize>,
    /// Report the prompt tokens' log-probabilities, each after the tokens before it, with this
    /// many alternatives, in [`Output::prompt_logprobs`]. The prefill then computes every
    /// row's logits, and the whole prompt is prefilled (no reused prefix).
    pub prompt_logprobs: Option<usize>,
    /// End generation where a line after the first starts less indented than this many
    /// spaces or tabs, cut before that line's text ([`StopReason::Indent`]; llama.cpp's
    /// `n_indent`, which its editor plugins send so that a completion ends with its block;
    /// as there, an empty line ends it too). 0 never ends it.
    pub stop_indent: usize,
    /// End generation ([`StopReason::MaxTokens`]) at the first token with a line break that
    /// comes after this long since generation began (after the prefill) (llama.cpp's
    /// `t_max_predict_ms`, which its editor plugins send so that a completion comes in time;
    /// the text then depends on the machine's speed).
    pub time_limit: Option<std::time::Duration>,
    /// Speculative decoding by n-gram lookup ([`crate::NgramSpec`]): the same output, in
    /// fewer decode passes where the text repeats itself or its prompt. Not under a policy
    /// that accumulates attention from every token (H2O), which then decodes token by token.
    pub speculative: Option<crate::NgramSpec>,
}

/// A flag that stops a running request from another thread (or from its own event callback).
/// Clones share the flag.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token not cancelled yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// True when `other` is this token or a clone of it.
    pub fn same(&self, other: &CancelToken) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Asks the request to stop at its next chunk or token.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// True once [`CancelToken::cancel`] was called on it or a clone.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            prompt: Prompt::Text(String::new()),
            max_tokens: 256,
            sampling: Sampling::default(),
            stop: Vec::new(),
            ignore_eos: false,
            stop_tokens: Vec::new(),
            min_tokens: 0,
            profile: false,
            cancel: None,
            logprobs: None,
            prompt_logprobs: None,
            stop_indent: 0,
            time_limit: None,
            speculative: None,
        }
    }
}

impl GenerateParams {
    /// True once [`GenerateParams::cancel`] has been cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(CancelToken::is_cancelled)
    }

    /// Refuses settings the engine cannot honour: meaningless sampling values, more logprob
    /// alternatives than [`MAX_TOP_LOGPROBS`], or JSON mode or a grammar with `ignore_eos`.
    pub fn validate(&self) -> Result<()> {
        (self.sampling.check())
            .map_err(|(field, reason)| EngineError::BadField { field, reason })?;
        if let Some(s) = &self.speculative {
            s.validate()?;
        }
        if self.ignore_eos && self.sampling.format != Format::Text {
            return Err(EngineError::BadField {
                field: "ignore_eos",
                reason: format!(
                    "{} ends generation when the text is whole; it cannot ignore the end of \
                     generation",
                    Constraint::what(&self.sampling.format)
                ),
            });
        }
        for (name, top) in [
            ("logprobs", self.logprobs),
            ("prompt logprobs", self.prompt_logprobs),
        ] {
            if let Some(k) = top.filter(|&k| k > MAX_TOP_LOGPROBS) {
                return Err(EngineError::BadParams(format!(
                    "{name}: {k} alternatives asked, at most {MAX_TOP_LOGPROBS}"
                )));
            }
        }
        Ok(())
    }
}

/// Progress reported while generating.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event<'a> {
    /// `done` of `total` prompt tokens have been prefilled.
    Prefill { done: usize, total: usize },
    /// A piece of generated text, ready to print.
    Text(&'a str),
    /// A generated token's log-probability, when [`GenerateParams::logprobs`] asks for them:
    /// sent as soon as the token is sampled, before the text it completes.
    Logprob(&'a TokenLogprob),
    /// The prompt's tokens and their log-probabilities (`logprobs[i]` is `tokens[i + 1]`'s),
    /// once the prefill is done, when [`GenerateParams::prompt_logprobs`] asks for them.
    PromptLogprobs {
        tokens: &'a [u32],
        logprobs: &'a [TokenLogprob],
    },
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    /// A stop string came.
    StopString,
    /// A line started below [`GenerateParams::stop_indent`].
    Indent,
    MaxTokens,
    /// The model's context is full.
    Context,
    /// [`GenerateParams::cancel`] was cancelled.
    Cancelled,
}

/// Timings and sizes of one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub chunk: usize,
    /// Seconds from the call to the first sampled token (tokenization, prefill, sampling; in
    /// a batch, from [`crate::Batch::join`], so waiting behind earlier joiners too).
    pub ttft_s: f64,
    /// Seconds spent in the prefill forward passes (in a batch, the steps that ran its
    /// chunks, which also ran the other requests' rows).
    pub prefill_s: f64,
    /// Prompt tokens prefilled by this request (the prompt less a reused [`Prefix`]) per second
    /// of `prefill_s`.
    pub prefill_tok_s: f64,
    /// Prompt tokens taken from a reused [`Prefix`] instead of being prefilled (0 without).
    pub prefix_tokens: usize,
    /// Seconds of decode forward passes and sampling after the first token.
    pub decode_s: f64,
    pub decode_tok_s: f64,
    /// Bytes of the KV cache buffers, allocated once for the request.
    pub peak_kv_bytes: usize,
    /// What the KV cache held (`f32`, `f16`, `q8_0`, `f16/q4_0`, ...).
    pub kv_dtype: String,
    /// Whether it held keys or values Hadamard-rotated ([`EngineConfig::kv_rotation`]).
    pub kv_rotated: bool,
    /// Slots per layer and head at the end (at most N + K under a budget).
    pub final_cache_len: usize,
    /// Evictions, evicted slots, and seconds spent scoring and selecting/moving.
    pub eviction: CacheCounters,
    /// Where the prefill time went, when the request was profiled.
    pub breakdown: Option<Breakdown>,
    /// Name of the eviction policy.
    pub policy: String,
    /// The budget N, when one is set.
    pub budget: Option<usize>,
    pub stop_reason: StopReason,
    /// Drafted and accepted tokens, when the request decoded speculatively
    /// ([`GenerateParams::speculative`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<crate::SpecCounters>,
}

/// Prefill time by region, summed over layers and chunks (a profiled request).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Breakdown {
    /// Norms, Q/K/V/O projections, RoPE, cache append, softmax attention.
    pub attention_s: f64,
    /// Attention statistics for TOVA, SnapKV and H2O (row sums, H2O's accumulation).
    pub attention_stats_s: f64,
    /// Eviction: scoring the slots.
    pub eviction_score_s: f64,
    /// Eviction: selecting survivors and moving slots.
    pub select_move_s: f64,
    /// Norms, gate/up/down projections, residuals.
    pub mlp_s: f64,
    /// The rest of prefill: embedding, mask, RoPE tables, LM head, copying logits out.
    pub other_s: f64,
}

impl Breakdown {
    /// Sum of all regions: the prefill time.
    pub fn total(&self) -> f64 {
        self.attention_s
            + self.attention_stats_s
            + self.eviction_score_s
            + self.select_move_s
            + self.mlp_s
            + self.other_s
    }

    fn new(profile: keydiff_cache::Profile, eviction: CacheCounters, prefill_s: f64) -> Self {
        let known = profile.attention_s
            + profile.stats_s
            + eviction.score_s
            + eviction.select_move_s
            + profile.mlp_s;
        Self {
            attention_s: profile.attention_s,
            attention_stats_s: profile.stats_s,
            eviction_score_s: eviction.score_s,
            select_move_s: eviction.select_move_s,
            mlp_s: profile.mlp_s,
            other_s: (prefill_s - known).max(0.0),
        }
    }
}

/// Result of one request.
#[derive(Debug, Clone)]
pub struct Output {
    pub text: String,
    /// Prompt token ids as fed to the model.
    pub prompt_tokens: Vec<u32>,
    /// Generated token ids (an end-of-generation token included when one ended the run).
    pub tokens: Vec<u32>,
    /// Each generated token's log-probability, when [`GenerateParams::logprobs`] asked.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The log-probability of every prompt token after the first (which has nothing before
    /// it), when [`GenerateParams::prompt_logprobs`] asked (`None` when a cancel stopped the
    /// prefill).
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// The stop string that ended it ([`StopReason::StopString`]; llama.cpp's
    /// `stopping_word`).
    pub stop_string: Option<String>,
    pub stats: Stats,
}

/// A request's prompt being prefilled, a chunk at a time: alone ([`Engine::prefill_request`])
/// or interleaved with a batch's decode steps ([`crate::Batch::join`]).
pub(crate) struct Prefill<'e> {
    engine: &'e Engine,
    pub(crate) prompt: Vec<u32>,
    start: usize,
    params: GenerateParams,
    t0: Instant,
    /// When its first chunk started (prefill time runs from there).
    tp: Option<Instant>,
    done: usize,
    /// The last chunk's logits, `[vocab]`.
    logits: Option<Tensor>,
    prompt_lp: Vec<TokenLogprob>,
    counted: CacheCounters,
    peak_kv_bytes: usize,
}

impl<'e> Prefill<'e> {
    /// Checks the request and starts it on `cache` (which holds `prompt[..start]`).
    pub(crate) fn new(
        engine: &'e Engine,
        cache: &mut KvCache,
        prompt: Vec<u32>,
        start: usize,
        params: GenerateParams,
        t0: Instant,
    ) -> Result<Self> {
        engine.check_params(&params)?;
        if params.prompt_logprobs.is_some() && start > 0 {
            return Err(EngineError::BadParams(format!(
                "prompt logprobs need the whole prompt prefilled, but {start} of its tokens \
                 come from a cache"
            )));
        }
        // A carried-on cache (a chat turn, a prompt cache) has counters of its own: the
        // request reports what it added.
        let counted = cache.counters();
        cache.set_profiling(params.profile);
        Ok(Self {
            engine,
            peak_kv_bytes: cache.bytes(),
            prompt,
            start,
            params,
            t0,
            tp: None,
            done: start,
            logits: None,
            prompt_lp: Vec::new(),
            counted,
        })
    }

    /// A request whose cache already holds its whole prompt, with the logits the prompt left
    /// (kept by a prompt cache): nothing is prefilled, the first token is sampled from them.
    /// Without them (or with a prompt not all in the cache) it prefills as [`Prefill::new`].
    pub(crate) fn with_logits(mut self, logits: Option<Tensor>) -> Self {
        if let (Some(l), true) = (logits, self.start == self.prompt.len()) {
            self.logits = Some(l);
        }
        self
    }

    /// The prompt tokens the next chunk takes, or `None` when the prompt is done or the
    /// request was cancelled. Chunks of B; in a chat turn the cache may come out of decode
    /// with up to N + K - 1 slots, so the first chunk takes only the room left (it then
    /// evicts to N).
    pub(crate) fn piece(&self, cache: &KvCache) -> Option<std::ops::Range<usize>> {
        let n = self.prompt.len();
        if self.done >= n || self.params.is_cancelled() {
            return None;
        }
        let room = cache.capacity() - cache.len();
        let chunk = self.engine.cfg.cache.chunk;
        Some(self.done..(self.done + chunk.min(room).max(1)).min(n))
    }

    /// The logits the chunk `piece` needs: every row's for prompt logprobs, else the last
    /// row's when it ends the prompt.
    pub(crate) fn logits(&self, piece: &std::ops::Range<usize>) -> Logits {
        match self.params.prompt_logprobs {
            Some(_) => Logits::All,
            None if piece.end == self.prompt.len() => Logits::Last,
            None => Logits::None,
        }
    }

    /// Notes that the chunk `piece`, started at `started`, ran, with the rows
    /// [`Prefill::logits`] asked for (`[1, vocab]` or `[len, vocab]`; any rows when it asked
    /// for none).
    pub(crate) fn took(
        &mut self,
        piece: std::ops::Range<usize>,
        logits: Option<Tensor>,
        started: Instant,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<()> {
        self.tp.get_or_insert(started);
        let n = self.prompt.len();
        if let (Some(top), Some(all)) = (self.params.prompt_logprobs, &logits) {
            // Row i predicts prompt token done + i + 1; the last row of the prompt predicts
            // the first generated token.
            let scored = piece.end.min(n - 1) - piece.start;
            if scored > 0 {
                let targets = &self.prompt[piece.start + 1..piece.start + 1 + scored];
                let rows = all.narrow(0, 0, scored)?;
                self.prompt_lp.extend(rows_logprobs(&rows, targets, top)?);
            }
        }
        self.logits = match logits {
            Some(l) => Some(l.get(l.dim(0)? - 1)?),
            None => None,
        };
        self.done = piece.end;
        on_event(Event::Prefill {
            done: self.done,
            total: n,
        });
        Ok(())
    }

    /// True once every prompt token ran.
    pub(crate) fn is_done(&self) -> bool {
        self.done >= self.prompt.len()
    }

    /// The prefill ended (done or cancelled): the request's state, ready to sample its first
    /// token.
    pub(crate) fn finish(
        self,
        cache: &mut KvCache,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Decoding<'e>> {
        let n = self.prompt.len();
        if self.start == n && self.logits.is_some() {
            // All of the prompt came from a cache with its logits: nothing ran, but the
            // request's events are as ever (a stream starts on its prefill's).
            on_event(Event::Prefill { done: n, total: n });
        }
        let prefill_s = self.tp.map_or(0.0, |t| t.elapsed().as_secs_f64());
        if self.params.prompt_logprobs.is_some() && self.done == n {
            on_event(Event::PromptLogprobs {
                tokens: &self.prompt,
                logprobs: &self.prompt_lp,
            });
        }
        let breakdown = cache
            .profile()
            .map(|p| Breakdown::new(p, cache.counters().since(&self.counted), prefill_s));
        cache.set_profiling(false);
        let e = self.engine;
        let constraint = Constraint::new(&self.params.sampling.format)?;
        let pick = match &self.logits {
            Some(l) => Pick::of(
                &self.params,
                &constraint,
                keydiff_model::model::samples_on(l.device()),
            ),
            None => Pick::Host,
        };
        // Cancelled during prefill: nothing to sample from.
        let mut prompt_logits = None;
        let (logits, reason) = match self.logits {
            Some(l) if self.done == n => {
                // Broken weights (or an overflow) give NaN logits, whose argmax is token 0:
                // refused once per request, on the first row (a sum: one small reduction).
                let total = l
                    .to_dtype(candle_core::DType::F32)?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                if !total.is_finite() {
                    return Err(EngineError::NonFiniteLogits {
                        dtype: format!("{:?}", e.config().dtype).to_lowercase(),
                    });
                }
                let next = Next::of(&l, pick)?;
                // A copy of the row: in a batch's step it is a view of every row's logits,
                // which keeping it would keep alive.
                prompt_logits = Some(l.copy()?);
                (next, StopReason::MaxTokens)
            }
            _ if self.done == n => {
                return Err(EngineError::Model(keydiff_model::ModelError::Shape(
                    "the prompt's last chunk ran without its logits".into(),
                )))
            }
            _ => (Next::Logits(Vec::new()), StopReason::Cancelled),
        };
        Ok(Decoding {
            engine: e,
            sampler: Sampler::new(self.params.sampling.clone()).with_prompt_len(self.prompt.len()),
            history: self.prompt.clone(),
            stream: TextStream::new(&e.loaded.vocab.tokenizer, self.params.stop.clone())
                .stop_below_indent(self.params.stop_indent)
                .min_tokens(self.params.min_tokens),
            params: self.params,
            prompt: self.prompt,
            start: self.start,
            t0: self.t0,
            done: self.done,
            prefill_s,
            prompt_lp: self.prompt_lp,
            breakdown,
            counted: self.counted,
            peak_kv_bytes: self.peak_kv_bytes,
            generated: Vec::new(),
            logprobs: Vec::new(),
            ttft_s: 0.0,
            td: Instant::now(),
            decode_steps: 0,
            spec: crate::SpecCounters::default(),
            spec_text: Vec::new(),
            spec_base: 0,
            spec_earlier: Vec::new(),
            spec_schedule: None,
            reason,
            logits,
            pick,
            drawn: None,
            constraint,
            prompt_logits,
        })
    }
}

/// Where a request's tokens are picked from its logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pick {
    /// The row is read to the host and sampled there.
    Host,
    /// The argmax, picked where the logits are ([`keydiff_model::model::argmax_rows`]): a
    /// plain greedy request ([`Sampling::is_plain_greedy`]).
    Greedy,
    /// Drawn on the device ([`keydiff_model::model::sample_rows`]) with the host sampler's
    /// settings and generator: a sampled request without a logit bias or an active penalty, on
    /// a device that samples ([`keydiff_model::model::samples_on`]).
    Device,
}

impl Pick {
    /// Where `params`' tokens are picked, on a device that draws tokens or not
    /// (`device_samples`, [`keydiff_model::model::samples_on`]). A constraint on the output, or
    /// logprobs to report, need the row on the host. On a GPU the others read a token a step
    /// instead of the vocabulary's row of logits.
    fn of(params: &GenerateParams, constraint: &Option<Constraint>, device_samples: bool) -> Pick {
        let s = &params.sampling;
        // `min_tokens` masks the end of generation on the host's row.
        if constraint.is_some() || params.logprobs.is_some() || params.min_tokens > 0 {
            Pick::Host
        } else if s.is_plain_greedy() {
            Pick::Greedy
        } else if s.is_plain() && device_samples {
            Pick::Device
        } else {
            Pick::Host
        }
    }
}

/// What a request samples its next token from.
#[derive(Clone)]
enum Next {
    /// The model's logits, read to the host.
    Logits(Vec<f32>),
    /// The token, picked where the logits are ([`Pick::Greedy`], or drawn for
    /// [`Pick::Device`]).
    Token(u32),
    /// A `[vocab]` row of logits left on the device, to draw the token from there
    /// ([`Pick::Device`]) when it is asked for: a fork of the request draws its own.
    Row(Tensor),
}

impl Next {
    /// The next token's distribution from a `[vocab]` row of logits, as `pick` takes it.
    fn of(logits: &Tensor, pick: Pick) -> Result<Self> {
        Ok(match pick {
            Pick::Greedy => match keydiff_model::model::argmax_rows(logits)?[..] {
                [tok] => Next::Token(tok),
                ref other => {
                    return Err(EngineError::Model(keydiff_model::ModelError::Shape(
                        format!("{} greedy tokens for one row of logits", other.len()),
                    )))
                }
            },
            Pick::Device => Next::Row(logits.clone()),
            Pick::Host => Next::Logits(logits.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?),
        })
    }
}

/// A request between its prefill and its end: what it sampled so far, and the distribution
/// to sample next from. [`Engine::run_request`] drives one alone; a [`crate::Batch`] steps
/// several together.
#[derive(Clone)]
pub(crate) struct Decoding<'e> {
    engine: &'e Engine,
    params: GenerateParams,
    prompt: Vec<u32>,
    /// Prompt tokens that came from a cache.
    start: usize,
    t0: Instant,
    /// Prompt tokens prefilled (`prompt.len()` unless a cancel cut the prefill short).
    done: usize,
    prefill_s: f64,
    prompt_lp: Vec<TokenLogprob>,
    breakdown: Option<Breakdown>,
    counted: CacheCounters,
    peak_kv_bytes: usize,
    sampler: Sampler,
    history: Vec<u32>,
    stream: TextStream<'e>,
    generated: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    ttft_s: f64,
    td: Instant,
    decode_steps: usize,
    /// Speculative drafts so far.
    spec: crate::SpecCounters,
    /// What came before the prompt, the prompt and the output, where drafts are looked up
    /// (built when first needed).
    spec_text: Vec<u32>,
    /// Where the output starts in `spec_text`.
    spec_base: usize,
    /// Tokens before the prompt (a conversation's earlier turns), to look drafts up in too.
    spec_earlier: Vec<u32>,
    /// The next drafts' lengths, from how the last ones went.
    spec_schedule: Option<crate::speculative::Schedule>,
    reason: StopReason,
    /// What the next token is sampled from.
    logits: Next,
    /// Where the tokens are picked.
    pick: Pick,
    /// The generator's state before [`Decoding::draw_on_device`] drew for a row not yet fed:
    /// given back if the row had nothing to draw from, or came to the host after all.
    drawn: Option<StdRng>,
    /// JSON mode's checker or the grammar's state, over what was generated so far.
    constraint: Option<Constraint>,
    /// The logits after the whole prompt (`[vocab]`), which the first token is sampled from:
    /// a prompt cache keeps them, so that the same prompt again needs no prefill at all.
    prompt_logits: Option<Tensor>,
}

/// What constrains a request's output ([`Format`]), over what was generated so far.
#[derive(Debug, Clone)]
enum Constraint {
    Json(JsonObject),
    Grammar(GrammarState),
    Lazy(Lazy),
    AfterThink(Box<AfterThink>),
}

/// [`Format::AfterReasoning`]: a reasoning block of free text, then JSON mode or a grammar
/// over the answer after it (its leading whitespace aside).
#[derive(Debug, Clone)]
struct AfterThink {
    think: Think,
    /// The answer has brought whitespace only so far (none of it read by `inner`).
    lead: bool,
    inner: Constraint,
}

impl AfterThink {
    fn in_answer(&self) -> bool {
        matches!(self.think, Think::Off)
    }

    fn is_done(&self) -> bool {
        self.in_answer() && self.inner.is_done()
    }

    /// Reads a token's bytes; false when the answer's constraint refuses them.
    fn push_all(&mut self, bytes: &[u8]) -> bool {
        let Some(mut answer) = self.think.feed(bytes) else {
            return true;
        };
        if self.lead {
            let ws = answer
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
            answer.drain(..ws);
            if answer.is_empty() {
                return true;
            }
            self.lead = false;
        }
        self.inner.push_bytes(&answer)
    }

    /// In the answer: the inner constraint's mask (and whitespace before the answer). Before
    /// or in the reasoning block: bans ending generation, and the tokens that would end the
    /// block (or, at the start, show there is none) with an answer the constraint refuses.
    fn mask(
        &self,
        logits: &mut [f32],
        tokens: &[Box<[u8]>],
        by_bytes: &[u32],
        eos: &[u32],
    ) -> usize {
        let bytes_of = |id: usize| tokens.get(id).map_or(&[][..], |b| &b[..]);
        if self.in_answer() {
            if !self.lead {
                return self.inner.mask(logits, tokens, by_bytes, eos);
            }
            // A token that starts with whitespace is read past it: each on a copy.
            let before = logits.to_vec();
            self.inner.mask(logits, tokens, by_bytes, eos);
            let mut left = 0;
            for (id, l) in logits.iter_mut().enumerate() {
                let b = bytes_of(id);
                if before[id].is_finite() && b.first().is_some_and(u8::is_ascii_whitespace) {
                    *l = match self.clone().push_all(b) {
                        true => before[id],
                        false => f32::NEG_INFINITY,
                    };
                }
                if l.is_finite() {
                    left += 1;
                }
            }
            return left;
        }
        // At the start any token may show there is no block; inside it only one with the
        // closing `>` may end it. A token that leaves the block is read on a copy.
        let start = matches!(self.think, Think::Start(_));
        let mut left = 0;
        for (id, l) in logits.iter_mut().enumerate() {
            if !l.is_finite() {
                continue;
            }
            let b = bytes_of(id);
            let leaves = (start || b.contains(&b'>')) && self.think.clone().feed(b).is_some();
            if eos.contains(&(id as u32)) || (leaves && !self.clone().push_all(b)) {
                *l = f32::NEG_INFINITY;
                continue;
            }
            left += 1;
        }
        left
    }
}

/// [`Format::Lazy`]: free text until a trigger, then the grammar from the trigger on.
#[derive(Debug, Clone)]
struct Lazy {
    /// Triggers anywhere in the text.
    anywhere: Arc<[Box<[u8]>]>,
    /// Triggers that count at the start of the text only, after whitespace.
    at_start: Arc<[Box<[u8]>]>,
    /// The last bytes of the text, fewer than the longest trigger's.
    tail: Vec<u8>,
    /// The text after its leading whitespace, while it may still become a start trigger.
    lead: Option<Vec<u8>>,
    /// The grammar: nothing read until a trigger comes, then what came from it on.
    grammar: GrammarState,
    active: bool,
    /// Where the reply stands against a reasoning block, whose text no trigger counts in.
    think: Think,
}

/// Where a reply stands against its reasoning block (`<think>…</think>`,
/// [`crate::reasoning`]), for a constraint that applies to the answer after it (a lazy
/// grammar's triggers, [`AfterThink`]).
#[derive(Debug, Clone)]
enum Think {
    /// No block, or after it.
    Off,
    /// Before the first byte that is not whitespace: the bytes held, which may open one.
    Start(Vec<u8>),
    /// Inside it: its last bytes, fewer than `</think>`'s.
    Inside(Vec<u8>),
}

impl Think {
    /// Where a reply stands before its first token: `reasoning` is `None` (no block is
    /// looked for) or `Some(open)` (`open`: the prompt opened it).
    fn new(reasoning: Option<bool>) -> Self {
        match reasoning {
            None => Think::Off,
            Some(false) => Think::Start(Vec::new()),
            Some(true) => Think::Inside(Vec::new()),
        }
    }

    /// Reads reply bytes; returns those of the answer (after the block, or all of them once
    /// the reply shows it has none), or `None` while they are in the block or may open one.
    fn feed(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        use crate::reasoning::{THINK_END, THINK_START};
        let (open, close) = (THINK_START.as_bytes(), THINK_END.as_bytes());
        match self {
            Think::Off => Some(bytes.to_vec()),
            Think::Start(held) => {
                held.extend_from_slice(bytes);
                let ws = held.iter().take_while(|b| b.is_ascii_whitespace()).count();
                let t = &held[ws..];
                if let Some(rest) = t.strip_prefix(open) {
                    let rest = rest.to_vec();
                    *self = Think::Inside(Vec::new());
                    return self.feed(&rest);
                }
                if open.starts_with(t) {
                    return None;
                }
                // No block: the held text is the reply's start.
                let held = std::mem::take(held);
                *self = Think::Off;
                Some(held)
            }
            Think::Inside(tail) => {
                let mut text = std::mem::take(tail);
                text.extend_from_slice(bytes);
                if let Some(p) = text.windows(close.len()).position(|w| w == close) {
                    *self = Think::Off;
                    return Some(text[p + close.len()..].to_vec());
                }
                let keep = text.len().min(close.len() - 1);
                *tail = text[text.len() - keep..].to_vec();
                None
            }
        }
    }
}

impl Lazy {
    /// `reasoning`: `None` reads every byte for triggers; `Some(open)` skips a reasoning
    /// block at the start of the reply (`open`: the prompt opened it).
    fn new(
        triggers: &[String],
        at_start: &[String],
        grammar: GrammarState,
        reasoning: Option<bool>,
    ) -> Result<Self> {
        let all = triggers.iter().chain(at_start);
        if triggers.is_empty() && at_start.is_empty() {
            return Err(EngineError::BadParams(
                "a lazy grammar needs a trigger".into(),
            ));
        }
        for t in all {
            if t.is_empty() || !grammar.clone().push_all(t.as_bytes()) {
                return Err(EngineError::BadParams(format!(
                    "a lazy grammar must allow a text that starts with its trigger `{t}`"
                )));
            }
        }
        let bytes = |v: &[String]| v.iter().map(|t| t.as_bytes().into()).collect();
        Ok(Self {
            anywhere: bytes(triggers),
            at_start: bytes(at_start),
            tail: Vec::new(),
            lead: (!at_start.is_empty()).then(Vec::new),
            grammar,
            active: false,
            think: Think::new(reasoning),
        })
    }

    fn is_done(&self) -> bool {
        !self.active || self.grammar.is_done()
    }

    /// The text after its leading whitespace once `bytes` are added, while it may still
    /// become a start trigger.
    fn lead_after(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        let lead = self.lead.as_ref()?;
        let mut t = lead.clone();
        t.extend_from_slice(bytes);
        let ws = t.iter().take_while(|b| b.is_ascii_whitespace()).count();
        t.drain(..ws);
        let may = |s: &[u8]| s.starts_with(&t) || t.starts_with(s);
        self.at_start.iter().any(|s| may(s)).then_some(t)
    }

    /// The text from the trigger on, when `bytes` bring one.
    fn trigger_in(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        if let Some(t) = self.lead_after(bytes) {
            if self.at_start.iter().any(|s| t.starts_with(s)) {
                return Some(t);
            }
        }
        // A trigger was not in the tail (it would have come): it ends in `bytes`.
        let text: Vec<u8> = self.tail.iter().chain(bytes).copied().collect();
        let p = (0..text.len()).find(|&p| {
            self.anywhere
                .iter()
                .any(|t| text[p..].starts_with(t) && p + t.len() > self.tail.len())
        })?;
        Some(text[p..].to_vec())
    }

    /// Reads a token's bytes; false when the grammar refuses them.
    fn push_all(&mut self, bytes: &[u8]) -> bool {
        let owned;
        let bytes = match self.think {
            Think::Off => bytes,
            _ => match self.think.feed(bytes) {
                None => return true,
                Some(b) => {
                    owned = b;
                    &owned[..]
                }
            },
        };
        if self.active {
            return self.grammar.push_all(bytes);
        }
        if let Some(from) = self.trigger_in(bytes) {
            self.active = true;
            return self.grammar.push_all(&from);
        }
        self.lead = self.lead_after(bytes);
        self.tail.extend_from_slice(bytes);
        let keep = self.anywhere.iter().map(|t| t.len() - 1).max().unwrap_or(0);
        if self.tail.len() > keep {
            self.tail.drain(..self.tail.len() - keep);
        }
        true
    }

    /// Before a trigger: bans the tokens that would bring one and then leave the grammar.
    /// After it: the grammar's mask.
    fn mask(
        &self,
        logits: &mut [f32],
        tokens: &[Box<[u8]>],
        by_bytes: &[u32],
        eos: &[u32],
    ) -> usize {
        if self.active {
            return self.grammar.mask(logits, tokens, by_bytes, eos);
        }
        // Only a token with a trigger's last byte can end one.
        let mut lasts: Vec<u8> = (self.anywhere.iter().chain(self.at_start.iter()))
            .map(|t| *t.last().expect("not empty"))
            .collect();
        if !matches!(self.think, Think::Off) {
            // Before or in a reasoning block a token may also end it (`>`) and go on into
            // the answer: each such token is read on a copy.
            lasts.push(b'>');
            let mut left = 0;
            for (id, l) in logits.iter_mut().enumerate() {
                if !l.is_finite() {
                    continue;
                }
                let bytes = tokens.get(id).map_or(&[][..], |b| &b[..]);
                if bytes.iter().any(|b| lasts.contains(b)) && !self.clone().push_all(bytes) {
                    *l = f32::NEG_INFINITY;
                    continue;
                }
                left += 1;
            }
            return left;
        }
        let mut left = 0;
        for (id, l) in logits.iter_mut().enumerate() {
            if !l.is_finite() {
                continue;
            }
            let bytes = tokens.get(id).map_or(&[][..], |b| &b[..]);
            if bytes.iter().any(|b| lasts.contains(b)) {
                if let Some(from) = self.trigger_in(bytes) {
                    if !self.grammar.clone().push_all(&from) {
                        *l = f32::NEG_INFINITY;
                        continue;
                    }
                }
            }
            left += 1;
        }
        left
    }
}

impl Constraint {
    fn new(format: &Format) -> Result<Option<Self>> {
        Ok(match format {
            Format::Text => None,
            Format::JsonObject => Some(Constraint::Json(JsonObject::new())),
            Format::Grammar(g) => {
                let g = GrammarState::new(Arc::new(
                    Grammar::parse(g).map_err(|e| EngineError::BadParams(e.to_string()))?,
                ));
                let c = Constraint::Grammar(g);
                c.check()?;
                Some(c)
            }
            Format::Lazy {
                grammar,
                triggers,
                at_start,
                reasoning,
            } => {
                let g = GrammarState::new(Arc::new(
                    Grammar::parse(grammar).map_err(|e| EngineError::BadParams(e.to_string()))?,
                ));
                let c = Constraint::Lazy(Lazy::new(triggers, at_start, g, *reasoning)?);
                c.check()?;
                Some(c)
            }
            Format::AfterReasoning { format, open } => match Constraint::new(format)? {
                None => None,
                Some(inner @ (Constraint::Json(_) | Constraint::Grammar(_))) => {
                    Some(Constraint::AfterThink(Box::new(AfterThink {
                        think: Think::new(Some(*open)),
                        lead: true,
                        inner,
                    })))
                }
                Some(_) => {
                    return Err(EngineError::BadParams(
                        "after a reasoning block: JSON mode or a grammar (a lazy grammar \
                         reads the reasoning itself)"
                            .into(),
                    ))
                }
            },
        })
    }

    /// Refuses a grammar that needed more ways to read the text at once than it may have:
    /// what its mask refused may have been allowed.
    fn check(&self) -> Result<()> {
        match self {
            Constraint::AfterThink(a) => a.inner.check(),
            Constraint::Grammar(g) | Constraint::Lazy(Lazy { grammar: g, .. })
                if g.is_ambiguous() =>
            {
                Err(EngineError::BadParams(format!(
                    "grammar: more than {} ways to read the text at once; it is too ambiguous \
                 to follow",
                    crate::grammar::MAX_STACKS
                )))
            }
            _ => Ok(()),
        }
    }

    /// What constrains the output, in messages.
    fn what(format: &Format) -> &'static str {
        match format {
            Format::Text => "nothing",
            Format::JsonObject => "JSON mode",
            Format::Grammar(_) => "the grammar",
            Format::Lazy { .. } => "the grammar after its trigger",
            Format::AfterReasoning { format, .. } => match **format {
                Format::JsonObject => "JSON mode after the reasoning",
                _ => "the grammar after the reasoning",
            },
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Constraint::Json(j) => j.is_done(),
            Constraint::Grammar(g) => g.is_done(),
            Constraint::Lazy(l) => l.is_done(),
            Constraint::AfterThink(a) => a.is_done(),
        }
    }

    /// Reads bytes of the text (not a special token's).
    fn push_bytes(&mut self, bytes: &[u8]) -> bool {
        match self {
            Constraint::Json(j) => !j.is_done() && j.push_all(bytes),
            Constraint::Grammar(g) => g.push_all(bytes),
            Constraint::Lazy(l) => l.push_all(bytes),
            Constraint::AfterThink(a) => a.push_all(bytes),
        }
    }

    /// Sets to −∞ the logits of the tokens that cannot come next; how many are left.
    /// `tokens[id]` is token `id`'s bytes, `by_bytes` their ids sorted by bytes (for a
    /// grammar), `eos` the end-of-generation tokens.
    fn mask(
        &self,
        logits: &mut [f32],
        tokens: &[Box<[u8]>],
        by_bytes: &[u32],
        eos: &[u32],
    ) -> usize {
        match self {
            Constraint::Json(j) => j.mask(logits, tokens, eos),
            Constraint::Grammar(g) => g.mask(logits, tokens, by_bytes, eos),
            Constraint::Lazy(l) => l.mask(logits, tokens, by_bytes, eos),
            Constraint::AfterThink(a) => a.mask(logits, tokens, by_bytes, eos),
        }
    }

    /// Reads token `tok`; false when it cannot come next.
    fn push(&mut self, tok: u32, tokens: &[Box<[u8]>], eos: &[u32]) -> bool {
        if eos.contains(&tok) {
            return self.is_done();
        }
        let bytes = tokens.get(tok as usize).map_or(&[][..], |b| &b[..]);
        // Before a lazy grammar's trigger, and in a reasoning block, any token goes, special
        // ones too; elsewhere a token must bring text.
        let free = match self {
            Constraint::Lazy(l) => !l.active,
            Constraint::AfterThink(a) => !a.in_answer(),
            _ => false,
        };
        if bytes.is_empty() && !free {
            return false;
        }
        self.push_bytes(bytes)
    }
}

impl<'e> Decoding<'e> {
    /// Samples the next token (emitting its events) and returns it when it must be fed to
    /// the model; `None` once the request has ended (an end-of-generation token, a stop
    /// string, `max_tokens`, the context, a cancel). `position` is the cache's position.
    pub(crate) fn next(
        &mut self,
        position: usize,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Option<u32>> {
        if self.reason != StopReason::MaxTokens || self.generated.len() >= self.params.max_tokens {
            return Ok(None);
        }
        // A prompt that fills the context leaves no room for a token: prompt and output
        // together stay within it (as every later token is checked in `sampled`).
        if position >= self.engine.model_config().context() {
            self.reason = StopReason::Context;
            return Ok(None);
        }
        self.draw_row()?;
        let params = &self.params;
        let vocab = &self.engine.loaded.vocab;
        if let Next::Token(tok) = self.logits {
            return self.sampled(tok, None, position, on_event);
        }
        let Next::Logits(logits) = &mut self.logits else {
            unreachable!("matched above")
        };
        // The model's distribution, before the sampler's penalties and temperature.
        let raw = params.logprobs.map(|top| (logits.clone(), top));
        if self.generated.len() < params.min_tokens {
            // vLLM's stop ids: the end of generation unless ignored, and `stop_tokens`. A
            // constraint (grammar, JSON) decides itself when its text may end: it wins.
            let eos = (!params.ignore_eos && self.constraint.is_none()).then_some(&vocab.eos_ids);
            for &t in eos.into_iter().flatten().chain(&params.stop_tokens) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let tok = match &mut self.constraint {
            None => self.sampler.sample(logits, &self.history),
            Some(c) => {
                let (tokens, eos) = (self.engine.token_bytes()?, &vocab.eos_ids);
                let by_bytes = match c {
                    Constraint::Grammar(_) | Constraint::Lazy(_) | Constraint::AfterThink(_) => {
                        self.engine.tokens_by_bytes()?
                    }
                    Constraint::Json(_) => &[],
                };
                let tok = self.sampler.sample_constrained(
                    logits,
                    &self.history,
                    c,
                    |c, t| c.push(t, tokens, eos),
                    |c, l| c.mask(l, tokens, by_bytes, eos),
                );
                c.check()?;
                tok.map_err(|e| {
                    EngineError::BadParams(format!(
                        "{}: {e}",
                        Constraint::what(&params.sampling.format)
                    ))
                })?
            }
        };
        self.sampled(tok, raw, position, on_event)
    }

    /// [`Decoding::next`] once `tok` is sampled (`raw`: the logits it was sampled from, and how
    /// many alternatives to report, when logprobs are asked for).
    fn sampled(
        &mut self,
        tok: u32,
        raw: Option<(Vec<f32>, usize)>,
        position: usize,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Option<u32>> {
        let params = &self.params;
        let vocab = &self.engine.loaded.vocab;
        if self.generated.is_empty() {
            self.ttft_s = self.t0.elapsed().as_secs_f64();
        }
        if let Some((raw, top)) = raw {
            self.logprobs.push(token_logprob(&raw, tok, top)?);
            on_event(Event::Logprob(self.logprobs.last().expect("just pushed")));
        }
        self.generated.push(tok);
        self.history.push(tok);
        if (!params.ignore_eos && vocab.eos_ids.contains(&tok)) || params.stop_tokens.contains(&tok)
        {
            self.reason = StopReason::Eos;
            return Ok(None);
        }
        let before = self.stream.text().len();
        let piece = self.stream.push(tok)?;
        if !piece.is_empty() {
            on_event(Event::Text(&piece));
        }
        if let Some(why) = self.stream.stopped_by() {
            self.reason = match why {
                Stopped::String => StopReason::StopString,
                Stopped::Indent => StopReason::Indent,
            };
            return Ok(None);
        }
        if self.generated.len() >= params.max_tokens {
            return Ok(None);
        }
        // llama.cpp's `t_max_predict_ms`: a token with a line break, past the time.
        let line_break = || (self.stream.text().get(before..)).is_some_and(|t| t.contains('\n'));
        if params.time_limit.is_some_and(|t| self.td.elapsed() > t) && line_break() {
            return Ok(None);
        }
        if position + 1 >= self.engine.model_config().context() {
            self.reason = StopReason::Context;
            return Ok(None);
        }
        // Checked here, so that whatever ends the request, its last sampled token is not in
        // the cache (a chat turn or a prompt cache feeds it next).
        if params.is_cancelled() {
            self.reason = StopReason::Cancelled;
            return Ok(None);
        }
        Ok(Some(tok))
    }

    /// The draft to verify after `tok`, the token about to be fed: looked up in the prompt
    /// and the output, as long as the cache can take back and the request may still use.
    fn draft(&mut self, spec: &crate::NgramSpec, tok: u32, cache: &KvCache) -> Vec<u32> {
        debug_assert_eq!(self.generated.last(), Some(&tok));
        // A drafted token is kept only when the token sampled after it may come too: within
        // `max_tokens` and inside the context (`Decoding::next` ends the request before
        // feeding a token that reaches either).
        let context = self.engine.model_config().context();
        let left = (self.params.max_tokens.saturating_sub(self.generated.len()))
            .min(context.saturating_sub(cache.position() + 1))
            .saturating_sub(1);
        // What came before, the prompt, then the output as it grows (copied once, not at
        // every token).
        if self.spec_base == 0 {
            self.spec_text = std::mem::take(&mut self.spec_earlier);
            self.spec_text.extend_from_slice(&self.prompt);
            self.spec_base = self.spec_text.len();
        }
        let have = self.spec_text.len() - self.spec_base;
        self.spec_text.extend_from_slice(&self.generated[have..]);
        let len = (self.spec_schedule)
            .get_or_insert_with(|| crate::speculative::Schedule::new(spec))
            .next_len();
        if len == 0 {
            return Vec::new();
        }
        spec.draft_for(&self.spec_text, cache, left.min(len))
    }

    /// The tokens to feed next: `tok`, the token [`Decoding::next`] returned, and when the
    /// request decodes speculatively, the draft to verify after it (none under a policy whose
    /// cache cannot take tokens back).
    pub(crate) fn with_draft(&mut self, tok: u32, cache: &KvCache) -> Vec<u32> {
        let mut fed = vec![tok];
        if let Some(spec) = self.params.speculative {
            if cache.can_rewind() {
                fed.extend(self.draft(&spec, tok, cache));
            }
        }
        fed
    }

    /// After a pass over a token and its `draft` ([`Decoding::with_draft`], then
    /// [`keydiff_model::Model::forward_decode_rows`] or a batch's decode rows), whose rows'
    /// logits are `rows`: each row is fed and sampled in turn, a drafted token kept while it
    /// is the token sampled, and the rest taken back from `cache`. Returns what
    /// [`Decoding::next`] returned last: the token to feed next, or `None` once the request
    /// has ended.
    pub(crate) fn verify(
        &mut self,
        rows: Vec<Vec<f32>>,
        draft: &[u32],
        cache: &mut KvCache,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Option<u32>> {
        if rows.len() != draft.len() + 1 {
            return Err(EngineError::Model(keydiff_model::ModelError::Shape(
                format!(
                    "{} rows of logits for a token and a draft of {}",
                    rows.len(),
                    draft.len()
                ),
            )));
        }
        // The cache's position before the pass.
        let p0 = cache.position() - rows.len();
        let mut rows = rows.into_iter();
        let mut kept = 0;
        let next = loop {
            self.fed(rows.next().expect("a row per fed token"));
            match self.next(p0 + kept + 1, on_event)? {
                Some(s) if kept < draft.len() && s == draft[kept] => kept += 1,
                other => break other,
            }
        };
        cache.rewind(draft.len() - kept)?;
        self.spec.passes += 1;
        self.spec.drafted += draft.len();
        self.spec.accepted += kept;
        if let (Some(s), Some(spec)) = (&mut self.spec_schedule, &self.params.speculative) {
            s.update(spec, draft.len(), kept);
        }
        Ok(next)
    }

    /// The logits after the whole prompt, which the first token was sampled from (`None`
    /// when a cancel cut the prefill short).
    pub(crate) fn prompt_logits(&self) -> Option<&Tensor> {
        self.prompt_logits.as_ref()
    }

    /// Tokens that came before the prompt (a conversation's earlier turns, in its cache), set
    /// before the first token is sampled. They are context as the prompt is: the penalties
    /// count them (llama-cli's window, `repeat_last_n`, reaches back into earlier turns; a
    /// repetition penalty counts the whole context), and speculative drafts are looked up in
    /// them.
    pub(crate) fn after(&mut self, earlier: &[u32]) {
        debug_assert!(self.generated.is_empty(), "earlier tokens after sampling");
        if earlier.is_empty() {
            return;
        }
        let mut history = earlier.to_vec();
        history.extend_from_slice(&self.history);
        self.history = history;
        self.sampler = self.sampler.clone().with_prompt_len(self.history.len());
        if self.params.speculative.is_some() {
            self.spec_earlier = earlier.to_vec();
        }
    }

    /// The seed of this request's sampler.
    pub(crate) fn seed(&self) -> u64 {
        self.params.sampling.seed
    }

    /// Another completion of the same prompt, before either has sampled: the same prompt,
    /// prefill figures and next-token distribution, with its own sampler seeded `seed`. It
    /// goes on from a fork of the prompt's cache ([`KvCache::fork`]).
    pub(crate) fn fork(&self, seed: u64) -> Self {
        debug_assert!(
            self.generated.is_empty(),
            "a fork of a request that sampled"
        );
        let mut d = self.clone();
        d.params.sampling.seed = seed;
        d.sampler = Sampler::new(d.params.sampling.clone()).with_prompt_len(d.history.len());
        d
    }

    /// The logits after the token [`Decoding::next`] returned was fed, on the host (a draw
    /// taken for the device is given back: the host draws again).
    pub(crate) fn fed(&mut self, logits: Vec<f32>) {
        if let Some(rng) = self.drawn.take() {
            self.sampler.give_back(rng);
        }
        self.logits = Next::Logits(logits);
        self.decode_steps += 1;
    }

    /// The token after the token [`Decoding::next`] returned was fed, picked where the logits
    /// are: the argmax ([`Pick::Greedy`]), or drawn with [`Decoding::draw_on_device`]'s
    /// parameters ([`Pick::Device`]; with [`keydiff_model::model::NO_DRAW`] set when the row
    /// had no finite logit).
    pub(crate) fn fed_token(&mut self, tok: u32) {
        debug_assert!(self.pick != Pick::Host);
        self.logits = Next::Token(self.took_drawn(tok));
        self.decode_steps += 1;
    }

    /// Where this request's tokens are picked: for [`Pick::Greedy`] and [`Pick::Device`],
    /// [`Decoding::fed_token`] takes the place of [`Decoding::fed`].
    pub(crate) fn pick(&self) -> Pick {
        self.pick
    }

    /// The parameters of the device's draw for the next row ([`Pick::Device`]), taking the
    /// uniform number from this request's generator as the host's sampler would; `None` for
    /// other requests.
    pub(crate) fn draw_on_device(&mut self) -> Option<keydiff_model::model::DrawParams> {
        if self.pick != Pick::Device {
            return None;
        }
        let (p, before) = self.sampler.device_draw()?;
        self.drawn = Some(before);
        Some(p)
    }

    /// A row left on the device ([`Next::Row`]) drawn from there, or read to the host where the
    /// device does not draw.
    fn draw_row(&mut self) -> Result<()> {
        let Next::Row(row) = &self.logits else {
            return Ok(());
        };
        let row = row.reshape((1, ()))?;
        self.logits = match self.draw_on_device() {
            Some(p) => match keydiff_model::model::sample_rows(&row, &[p])?.as_deref() {
                Some(&[tok]) => Next::Token(self.took_drawn(tok)),
                Some(other) => {
                    return Err(EngineError::Model(keydiff_model::ModelError::Shape(
                        format!("{} drawn tokens for one row of logits", other.len()),
                    )))
                }
                None => self.read_to_host(&row)?,
            },
            None => self.read_to_host(&row)?,
        };
        Ok(())
    }

    /// The token of a device draw: without the no-draw flag, the generator given back when it
    /// is set (the host's sampler draws nothing for a row without a finite logit).
    fn took_drawn(&mut self, tok: u32) -> u32 {
        let before = self.drawn.take();
        match tok & keydiff_model::model::NO_DRAW {
            0 => tok,
            _ => {
                if let Some(rng) = before {
                    self.sampler.give_back(rng);
                }
                tok & !keydiff_model::model::NO_DRAW
            }
        }
    }

    /// A row the device did not draw from, read to the host (a draw taken is given back).
    fn read_to_host(&mut self, row: &Tensor) -> Result<Next> {
        if let Some(rng) = self.drawn.take() {
            self.sampler.give_back(rng);
        }
        Ok(Next::Logits(
            row.to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        ))
    }

    /// The logits after the token [`Decoding::next`] returned was fed, a `[vocab]` row where
    /// the model left it: read to the host, its argmax for a greedy request, or kept there
    /// for the device's draw.
    pub(crate) fn fed_row(&mut self, logits: &Tensor) -> Result<()> {
        self.logits = Next::of(logits, self.pick)?;
        self.decode_steps += 1;
        Ok(())
    }

    /// The output, once [`Decoding::next`] has returned `None`; and the last sampled token,
    /// which is not in `cache`.
    pub(crate) fn finish(
        mut self,
        cache: &KvCache,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> (Output, Option<u32>) {
        let rest = self.stream.finish();
        if !rest.is_empty() {
            on_event(Event::Text(&rest));
        }
        // A stop in the last character, complete only in the flush (a token cut short at the
        // limit): the text ends at the stop, so the stop ended it.
        if matches!(self.reason, StopReason::MaxTokens | StopReason::Context) {
            match self.stream.stopped_by() {
                Some(Stopped::String) => self.reason = StopReason::StopString,
                Some(Stopped::Indent) => self.reason = StopReason::Indent,
                None => {}
            }
        }
        let decode_s = self.td.elapsed().as_secs_f64();
        let e = self.engine;
        let n = self.prompt.len();
        let stats = Stats {
            prompt_tokens: n,
            generated_tokens: self.generated.len(),
            chunk: e.cfg.cache.chunk,
            ttft_s: self.ttft_s,
            prefill_s: self.prefill_s,
            prefill_tok_s: (self.done - self.start) as f64 / self.prefill_s.max(1e-9),
            prefix_tokens: self.start,
            decode_s,
            decode_tok_s: if self.decode_steps > 0 {
                self.decode_steps as f64 / decode_s.max(1e-9)
            } else {
                0.0
            },
            peak_kv_bytes: self.peak_kv_bytes,
            kv_dtype: e.loaded.model.kv_dtype().to_string(),
            kv_rotated: e.loaded.model.kv_rotated(),
            final_cache_len: cache.len(),
            eviction: cache.counters().since(&self.counted),
            breakdown: self.breakdown,
            policy: e.cfg.cache.policy.name(),
            budget: e.cfg.cache.budget,
            stop_reason: self.reason,
            speculative: self.params.speculative.map(|_| self.spec),
        };
        let last = self.generated.last().copied();
        let complete = self.done == n;
        (
            Output {
                text: self.stream.text().to_string(),
                prompt_tokens: self.prompt,
                tokens: self.generated,
                logprobs: self.params.logprobs.map(|_| self.logprobs),
                // A prefill cut short by a cancel scored only part of the prompt: none.
                prompt_logprobs: self
                    .params
                    .prompt_logprobs
                    .filter(|_| complete)
                    .map(|_| self.prompt_lp),
                stop_string: (self.reason == StopReason::StopString)
                    .then(|| self.stream.stop_string().map(str::to_string))
                    .flatten(),
                stats,
            },
            last,
        )
    }
}

/// A prompt's first tokens, prefilled once so that several requests can start from them (for
/// example every policy and budget of an evaluation sample).
///
/// A prefix is reused only where that gives exactly what a fresh prefill would: it ends on a
/// chunk boundary, it never evicted, and it holds at most the budget N of any request that
/// uses it, so no policy would have evicted inside it ([`KvCache::resume_from`] checks each).
/// H2O accumulates attention over every chunk, so an H2O request needs a prefix made under H2O
/// ([`Engine::prefill_prefix`] with an H2O cache config); every other policy can use it too.
/// A prefix is used only under the attention backend it was prefilled with (eager and flash
/// round differently, [`Engine::set_attention`]).
pub struct Prefix {
    tokens: Vec<u32>,
    cache: KvCache,
    attention: AttentionBackend,
    /// The engine that made it ([`Engine::id`]).
    engine: u64,
}

impl Prefix {
    /// The prompt tokens it holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True for an empty prefix (never made by the engine).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The cache settings it was prefilled under.
    pub fn config(&self) -> &CacheConfig {
        self.cache.config()
    }
}

/// A loaded model ready to serve requests: one at a time, or several decoded together
/// ([`Engine::batch`], [`Engine::generate_batch`]).
///
/// An `Engine` is `Send + Sync`: share it (`Arc<Engine>`) and call it from several threads.
/// Each call runs on its own (on CUDA, on the calling thread's stream, candle's per-thread
/// default stream), and what a call hands back holding device memory ([`Prefix`],
/// [`crate::PromptCache`], [`crate::Conversation`]; `Send`, not `Sync`) is complete when it
/// returns, so it may be moved to another thread and go on there. Concurrent calls each plan
/// their memory as if alone: to run requests together within the device's memory, decode
/// them in one [`Engine::batch`], which counts them all.
pub struct Engine {
    loaded: Loaded,
    cfg: EngineConfig,
    /// The tokenizer with special-token text read as plain text, made on first use.
    plain_tokenizer: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// Every token's bytes, for JSON mode, made on first use ([`Engine::token_bytes`]).
    token_bytes: std::sync::OnceLock<std::result::Result<Vec<Box<[u8]>>, String>>,
    /// [`Engine::text_bytes_per_token`], computed once.
    text_bytes_per_token: std::sync::OnceLock<usize>,
    /// The ids of the tokens with text sorted by their bytes, for grammars
    /// ([`Engine::tokens_by_bytes`]).
    tokens_by_bytes: std::sync::OnceLock<Vec<u32>>,
    /// Device memory the load took, as the driver reports it (GPUs only).
    load_taken: Option<u64>,
    /// The model's digest ([`Engine::model_digest`]), made on first use.
    digest: std::sync::OnceLock<String>,
    /// This engine among the process's ([`Engine::id`]).
    id: u64,
}

/// The next [`Engine::id`].
static NEXT_ENGINE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

// What the docs above promise: an engine can be shared between threads, and what a call
// hands back moved to another.
const _: () = {
    const fn shared<T: Send + Sync>() {}
    const fn sent<T: Send>() {}
    shared::<Engine>();
    sent::<Prefix>();
    sent::<crate::PromptCache>();
    sent::<crate::Conversation>();
};

impl Engine {
    /// Waits for the work this thread queued on the device (a no-op on the CPU): each thread
    /// has its own CUDA stream, so device state handed to the caller must be complete
    /// before another thread may read it (see [`Engine`]).
    pub(crate) fn settle(&self) -> Result<()> {
        if !self.cfg.device.is_cpu() {
            self.cfg.device.synchronize()?;
        }
        Ok(())
    }

    /// Loads a model from `source` onto the configured device.
    pub fn load(source: &ModelSource, cfg: &EngineConfig) -> Result<Self> {
        cfg.cache
            .validate()
            .map_err(|e| EngineError::BadParams(e.to_string()))?;
        check_device_arch(&cfg.device, source)?;
        // A given chat template and its variables are checked before the weights load.
        keydiff_model::chat::check_template_kwargs(&cfg.chat_template_kwargs)?;
        if let Some(given) = &cfg.chat_template {
            keydiff_model::ChatTemplate::new(keydiff_model::resolve_template(given)?, None, None)?;
        }
        // Room to leave beside the weights: a budgeted cache is allocated at N + B slots for
        // every request; a full cache depends on the prompt and is checked per request.
        let kv_dtype = cfg.kv_dtype.unwrap_or(cfg.dtype.into());
        let eager = cfg.attention != AttentionBackend::Flash;
        let reserve = |m: &ModelConfig| {
            // No request holds more than the context (after the RoPE settings and the
            // context limit): a budget or chunk beyond it reserves no more than that.
            let mut run = m.clone();
            let context = match cfg.rope.apply(&mut run) {
                Ok(()) => {
                    let _ = run.limit_context(cfg.context);
                    run.context()
                }
                // Refused once the model loads; plan as if there were no limit.
                Err(_) => usize::MAX,
            };
            let chunk = cfg.cache.chunk.min(context);
            let capacity = cfg.cache.capacity().map(|c| c.min(context));
            let slots = capacity.unwrap_or(chunk);
            let kv = capacity.map_or(0, |c| m.kv_cache_bytes(c, kv_dtype));
            kv + m.request_scratch_bytes(slots, chunk, eager)
        };
        let mem = cfg.memory_budget().map(|budget| MemoryPlan {
            budget,
            reserve: &reserve,
        });
        let mem = mem.as_ref();
        // On a GPU, what the load takes is measured as well as planned (`keydiff info`).
        let free = || {
            (!cfg.device.is_cpu())
                .then(|| MemoryBudget::detect_on(&cfg.device))
                .flatten()
                .map(|b| b.ram)
        };
        let free_before = free();
        if cfg.device.is_cpu() {
            if let Some(note) = keydiff_model::cpu_build_note() {
                tracing::warn!("{note}");
            }
        }
        let mut loaded = match source {
            ModelSource::Gguf(p) => load_gguf(p, &cfg.device, cfg.dtype, cfg.cpu_weights, mem)?,
            ModelSource::HfDir(d) => load_hf_dir(d, &cfg.device, cfg.dtype, mem)?,
            ModelSource::Random {
                config,
                seed,
                on_host,
                weights,
            } => load_random(
                config,
                &cfg.device,
                cfg.dtype,
                *seed,
                *on_host,
                *weights,
                cfg.cpu_weights,
                mem,
            )?,
            ModelSource::Hub { repo, file } => {
                let local = ModelSource::resolve_hub(repo, file.as_deref())?;
                return Self::load(&local, cfg);
            }
        };
        if let Some(given) = &cfg.chat_template {
            let (bos, eos) = loaded.vocab.template_tokens.clone();
            let src = keydiff_model::resolve_template(given)?;
            loaded.vocab.chat_template = Some(keydiff_model::ChatTemplate::new(src, bos, eos)?);
        }
        loaded.model.set_attention(cfg.attention)?;
        if !cfg.rope.is_empty() {
            loaded.model.set_rope(&cfg.rope)?;
        }
        loaded
            .model
            .limit_context(cfg.context)
            .map_err(EngineError::BadParams)?;
        loaded
            .model
            .set_kv_dtype(cfg.kv_dtype.unwrap_or(cfg.dtype.into()))
            .map_err(|e| EngineError::BadParams(e.to_string()))?;
        loaded.model.set_kv_rotation(cfg.kv_rotation)?;
        // The config reports the backend and cache dtype in use: `Auto` resolved for this
        // model.
        let cfg = EngineConfig {
            attention: loaded.model.attention(),
            kv_dtype: Some(loaded.model.kv_dtype()),
            ..cfg.clone()
        };
        let load_taken = free_before
            .zip(free())
            .map(|(before, after)| before.saturating_sub(after));
        tracing::info!(
            origin = %loaded.origin,
            attention = %cfg.attention,
            kv_dtype = %loaded.model.kv_dtype(),
            kv_rotated = loaded.model.kv_rotated(),
            weights_planned = loaded.weight_plan.resident,
            device_memory_taken = load_taken,
            "model loaded"
        );
        Ok(Self {
            loaded,
            cfg,
            plain_tokenizer: std::sync::OnceLock::new(),
            token_bytes: std::sync::OnceLock::new(),
            text_bytes_per_token: std::sync::OnceLock::new(),
            tokens_by_bytes: std::sync::OnceLock::new(),
            load_taken,
            digest: std::sync::OnceLock::new(),
            id: NEXT_ENGINE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// This engine's number in the process, unique: what a [`Prefix`], a
    /// [`crate::PromptCache`] or a [`crate::Conversation`] it made is checked against, so that
    /// one is never continued by another engine (another model of the same shape would give
    /// wrong text, silently).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Refuses state (a cache) that engine `made` made, when this is another.
    pub(crate) fn check_owner(&self, made: Option<u64>, what: &str) -> Result<()> {
        match made {
            Some(id) if id != self.id => Err(EngineError::BadParams(format!(
                "{what} holds the cache of another engine (engine {id}, this is {}): a cache \
                 goes on only with the engine that made it",
                self.id
            ))),
            _ => Ok(()),
        }
    }

    /// The loaded model.
    pub(crate) fn model(&self) -> &keydiff_model::Model {
        &self.loaded.model
    }

    /// The model, its vocabulary and where they came from.
    pub(crate) fn loaded(&self) -> &Loaded {
        &self.loaded
    }

    /// Where the model's digest is kept once made.
    pub(crate) fn digest_cell(&self) -> &std::sync::OnceLock<String> {
        &self.digest
    }

    /// Refuses `tokens` tokens beyond the model's context (`PromptTooLong`); gives the
    /// context.
    pub fn within_context(&self, tokens: usize) -> Result<usize> {
        let context = self.model_config().context();
        if tokens > context {
            return Err(EngineError::PromptTooLong {
                tokens,
                context,
                limited: self.model_config().context_limited(),
            });
        }
        Ok(context)
    }

    /// The model's hyper-parameters.
    pub fn model_config(&self) -> &ModelConfig {
        self.loaded.model.config()
    }

    /// Whether this engine's caches hold keys or values Hadamard-rotated
    /// ([`EngineConfig::kv_rotation`] on, a block type, heads a multiple of 64).
    pub fn kv_rotated(&self) -> bool {
        self.loaded.model.kv_rotated()
    }

    /// Where the weights came from.
    pub fn format(&self) -> &ModelFormat {
        &self.loaded.format
    }

    /// The path or preset the model was loaded from.
    pub fn origin(&self) -> &str {
        &self.loaded.origin
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Weight storage kinds by role (quantization types), for `keydiff info`.
    pub fn weight_kinds(&self) -> Vec<(&'static str, String)> {
        self.loaded.model.weight_kinds()
    }

    /// The weights that actually run, by role (CPU decode/prefill copies).
    pub fn runtime_kinds(&self) -> Vec<(&'static str, String)> {
        self.loaded.model.runtime_kinds()
    }

    /// The CPU options the GGUF weights were loaded with: [`EngineConfig::cpu_weights`], or
    /// fewer copies when memory did not allow them. `None` for other sources and on GPUs.
    pub fn cpu_weights(&self) -> Option<CpuWeights> {
        self.loaded.cpu_weights
    }

    /// Bytes held by the weights (with their CPU copies).
    pub fn weight_bytes(&self) -> u64 {
        self.loaded.model.weight_bytes()
    }

    /// The memory the weights were planned to take on their device before loading (what
    /// [`Engine::weight_bytes`] should then report).
    pub fn weight_plan(&self) -> keydiff_model::WeightPlan {
        self.loaded.weight_plan
    }

    /// The device memory the model's load took, as the driver reported its free memory
    /// before and after (CUDA only; it includes anything else that allocated on the device
    /// meanwhile). Against [`Engine::weight_plan`], it shows how good the plan is.
    pub fn load_taken_bytes(&self) -> Option<u64> {
        self.load_taken
    }

    /// The memory requests are planned against now, on the engine's device: what the system
    /// (CPU) or the driver (CUDA) reports free, or the configured limit less the weights.
    /// `None` where neither says.
    pub fn memory_budget(&self) -> Option<MemoryBudget> {
        let b = self.cfg.memory_budget()?;
        Some(match self.cfg.memory_limit {
            Some(_) => b.less(self.weight_bytes()),
            None => b,
        })
    }

    /// A cache for a request of at most `max_tokens` tokens under `cache`, after checking
    /// that it and the request's activations fit in the device's memory: a cache that cannot
    /// fit is refused with the numbers instead of taking the process down or failing mid-way.
    pub(crate) fn alloc_cache(&self, cache: CacheConfig, max_tokens: usize) -> Result<KvCache> {
        self.alloc_cache_with(cache, max_tokens, 0)
    }

    /// A new cache of the model's shape, evicting as [`EngineConfig::evict_per_layer`] says.
    fn model_cache(&self, cache: CacheConfig, max_tokens: usize) -> Result<KvCache> {
        let mut c = self.loaded.model.new_cache(cache, max_tokens)?;
        c.set_evict_per_layer(self.cfg.evict_per_layer);
        Ok(c)
    }

    /// [`Engine::alloc_cache`] beside `held` bytes that the memory budget does not see (see
    /// [`Engine::check_cache_memory_beside`]).
    pub(crate) fn alloc_cache_beside(
        &self,
        cache: CacheConfig,
        max_tokens: usize,
        held: u64,
    ) -> Result<KvCache> {
        self.check_cache_memory_beside(&cache, cache.slots_for(max_tokens), 0, held)?;
        self.model_cache(cache, max_tokens)
    }

    /// [`Engine::alloc_cache`] for a request that needs `extra` bytes more while it runs.
    pub(crate) fn alloc_cache_with(
        &self,
        cache: CacheConfig,
        max_tokens: usize,
        extra: u64,
    ) -> Result<KvCache> {
        self.check_cache_memory(&cache, cache.slots_for(max_tokens), extra)?;
        self.model_cache(cache, max_tokens)
    }

    /// Refuses a cache of `slots` per layer and head (and the activations of a request on
    /// it, and `extra` bytes) that cannot fit in the device's memory; warns when it would
    /// swap (CPU).
    pub(crate) fn check_cache_memory(
        &self,
        cache: &CacheConfig,
        slots: usize,
        extra: u64,
    ) -> Result<()> {
        self.check_cache_memory_beside(cache, slots, extra, 0)
    }

    /// Bytes a cache of `slots` (and a request's activations on it), of which `seen` bytes are
    /// in memory already, lacks to fit in the memory the device has without swapping, beside
    /// `held` bytes (see [`Engine::check_cache_memory_beside`]); 0 when it fits or memory is
    /// not planned.
    pub(crate) fn ram_shortfall(
        &self,
        cache: &CacheConfig,
        slots: usize,
        held: u64,
        seen: u64,
    ) -> u64 {
        self.memory_budget().map_or(0, |b| {
            let b = b.less(held);
            let m = self.model_config();
            let kv = m.kv_cache_bytes(slots, self.loaded.model.kv_dtype());
            let eager = self.loaded.model.attention() == AttentionBackend::Eager;
            // No piece of a prompt is longer than the slots it goes into.
            let chunk = cache.chunk.min(slots);
            kv.saturating_add(m.request_scratch_bytes(slots, chunk, eager))
                .saturating_sub(seen)
                .saturating_sub(b.ram)
        })
    }

    /// Bytes of `cache` that a measured memory budget sees as taken: on the CPU the slots
    /// written so far (a zeroed allocation's pages are mapped when first written), on a GPU
    /// all; none under a configured limit, which measures nothing (callers count caches).
    pub(crate) fn seen_bytes(&self, cache: &KvCache) -> u64 {
        let (bytes, cap) = (cache.bytes() as u64, cache.capacity().max(1) as u64);
        match (self.cfg.memory_limit, self.cfg.device.is_cpu()) {
            (Some(_), _) => 0,
            (None, true) => bytes * (cache.len() as u64).min(cap) / cap,
            (None, false) => bytes,
        }
    }

    /// What freeing `cache` gives back to the memory budget: all of it under a configured
    /// limit (where it was counted), what the measured budget saw taken otherwise.
    pub(crate) fn freed_bytes(&self, cache: &KvCache) -> u64 {
        match self.cfg.memory_limit {
            Some(_) => cache.bytes() as u64,
            None => self.seen_bytes(cache),
        }
    }

    /// Checks that a request fits on a cache it takes over (a kept prompt cache), beside
    /// `held` bytes: its activations, and the part of the cache the budget does not see.
    pub(crate) fn check_taken_cache(&self, cache: &KvCache, held: u64) -> Result<()> {
        let seen = self.seen_bytes(cache);
        self.check_memory(cache.config(), cache.capacity(), 0, held, seen)
    }

    /// [`Engine::check_cache_memory`] beside `held` bytes that other requests still running
    /// (a batch's) hold or will touch and the budget does not see: taken from it.
    pub(crate) fn check_cache_memory_beside(
        &self,
        cache: &CacheConfig,
        slots: usize,
        extra: u64,
        held: u64,
    ) -> Result<()> {
        self.check_memory(cache, slots, extra, held, 0)
    }

    /// [`Engine::check_cache_memory_beside`] for a cache of which `seen` bytes are in memory
    /// already (and so in the measured budget).
    fn check_memory(
        &self,
        cache: &CacheConfig,
        slots: usize,
        extra: u64,
        held: u64,
        seen: u64,
    ) -> Result<()> {
        if let Some(budget) = self.memory_budget().map(|b| b.less(held)) {
            let m = self.model_config();
            let dtype = self.loaded.model.kv_dtype();
            let kv = m.kv_cache_bytes(slots, dtype);
            let eager = self.loaded.model.attention() == AttentionBackend::Eager;
            // No piece of a prompt is longer than the slots it goes into.
            let chunk = cache.chunk.min(slots);
            let need = kv
                .saturating_add(m.request_scratch_bytes(slots, chunk, eager))
                .saturating_add(extra);
            let what = || {
                format!(
                    "the KV cache of {slots} slots ({} layers × {} KV heads × {} × K and V in \
                     {}: {}) and the request's activations{} need {}",
                    m.num_layers,
                    m.num_kv_heads,
                    m.head_dim,
                    dtype,
                    human(kv),
                    if extra > 0 { " and logits" } else { "" },
                    human(need)
                ) + &if seen > 0 {
                    format!(" ({} of it in memory already)", human(seen))
                } else {
                    String::new()
                }
            };
            let more = need.saturating_sub(seen);
            if more > budget.total {
                let beside = if held > 0 {
                    format!(
                        ", beside {} for the batch it joins (the caches of the other requests, \
                         running or kept, and the step's rows beyond its own chunk)",
                        human(held)
                    )
                } else {
                    String::new()
                };
                return Err(EngineError::OutOfMemory(format!(
                    "{}{beside}; {budget}. Bound the cache with a budget (--budget N), {}or ask for \
                     fewer tokens (-n)",
                    what(),
                    {
                        // Smaller types than the one in use, that this model can hold.
                        let d = m.head_dim;
                        let smaller: Vec<&str> =
                            [DType::F16.into(), KvType::Q8_0, KvType::Q4_0]
                                .into_iter()
                                .map(KvTypes::from)
                                .filter(|t| {
                                    t.check(d).is_ok() && t.slot_bytes(d) < dtype.slot_bytes(d)
                                })
                                .map(|t| t.k.as_str())
                                .collect();
                        let flags: Vec<String> =
                            smaller.iter().map(|t| format!("--kv-dtype {t}")).collect();
                        match smaller.as_slice() {
                            [] => String::new(),
                            [t] => format!("store it in {t} (--kv-dtype {t}), "),
                            [rest @ .., last] => format!(
                                "store it in {} or {last} ({}), ",
                                rest.join(", "),
                                flags.join(", ")
                            ),
                        }
                    }
                )));
            }
            if more > budget.ram {
                tracing::warn!("{}, beyond {budget}: the system will swap", what());
            }
        }
        Ok(())
    }

    /// Token ids of `text` (BOS first when the model adds one). Special tokens written in the
    /// text are parsed as such only when `special` is true.
    pub fn tokenize(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let v = &self.loaded.vocab;
        let mut ids: Vec<u32> = if v.add_bos {
            v.bos_id.into_iter().collect()
        } else {
            Vec::new()
        };
        ids.extend(self.encode(text, special)?);
        Ok(ids)
    }

    /// Every token's bytes by id, up to the model's vocabulary (empty for special tokens and
    /// ids the tokenizer lacks): what JSON mode checks candidates with. Made on first use.
    pub(crate) fn token_bytes(&self) -> Result<&[Box<[u8]>]> {
        let made = self.token_bytes.get_or_init(|| {
            let ids: Vec<u32> = (0..self.model_config().vocab_size as u32).collect();
            let pieces =
                token_pieces(&self.loaded.vocab.tokenizer, &ids).map_err(|e| e.to_string())?;
            Ok(pieces
                .into_iter()
                .map(|p| match p.special {
                    true => Box::default(),
                    false => p.bytes.into_boxed_slice(),
                })
                .collect())
        });
        made.as_deref().map_err(|e| {
            EngineError::Tokenizer(format!(
                "JSON mode and grammars need every token's bytes: {e}"
            ))
        })
    }

    /// The ids of the tokens with text, sorted by their bytes: what a grammar's mask walks
    /// ([`crate::grammar::sorted_by_bytes`]). Made on first use.
    pub(crate) fn tokens_by_bytes(&self) -> Result<&[u32]> {
        if let Some(t) = self.tokens_by_bytes.get() {
            return Ok(t);
        }
        let sorted = crate::grammar::sorted_by_bytes(self.token_bytes()?);
        Ok(self.tokens_by_bytes.get_or_init(|| sorted))
    }

    /// Token ids of `text`, never a BOS; special tokens parsed only when `special` is true.
    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let t = if special {
            &self.loaded.vocab.tokenizer
        } else {
            // The tokenizers crate splits special-token text out unless told to encode it
            // as text, a setting of the tokenizer itself: a copy keeps that setting.
            self.plain_tokenizer.get_or_init(|| {
                let mut t = self.loaded.vocab.tokenizer.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        Ok(t.encode_fast(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// The most bytes of text one token can stand for: the longest entry of the vocabulary
    /// (special tokens' text included; a byte-level or SentencePiece entry is never shorter
    /// than the text it reads), times 4 for a normalizer that composes characters (Unicode
    /// composition shortens a text less than 3 times).
    fn text_bytes_per_token(&self) -> usize {
        *self.text_bytes_per_token.get_or_init(|| {
            let longest = (self.loaded.vocab.tokenizer.get_vocab(true).keys())
                .map(String::len)
                .max()
                .unwrap_or(1);
            4 * longest.max(1)
        })
    }

    /// Refuses a prompt text that is beyond the context whatever its tokens, before it is
    /// tokenized: a text of more than the context times [`Engine::text_bytes_per_token`]
    /// bytes. Tokenizing takes about 100 times a text's size in memory for a moment, so a
    /// text of megabytes sent to a small context is refused at once instead (exact counts
    /// come after tokenizing, [`Engine::within_context`]).
    pub fn check_text_fits(&self, text: &str) -> Result<()> {
        let context = self.model_config().context();
        let per_token = self.text_bytes_per_token();
        if text.len() / per_token > context {
            return Err(EngineError::PromptTextTooLong {
                bytes: text.len(),
                tokens: text.len() / per_token,
                context,
                limited: self.model_config().context_limited(),
            });
        }
        Ok(())
    }

    /// Token ids of a prompt written in the model's own format, as llama-server's and vLLM's
    /// completion endpoints take it: special-token text (`<|im_start|>`) parsed, BOS first
    /// when the model adds one, but not a second time when the text begins with it.
    pub fn tokenize_formatted(&self, text: &str) -> Result<Vec<u32>> {
        if text.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let mut ids = self.tokenize(text, true)?;
        let bos = self.loaded.vocab.bos_id;
        if self.loaded.vocab.add_bos && ids.len() > 1 && bos == Some(ids[1]) {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// Token ids of `text` with special tokens parsed and no BOS: a chat template's text
    /// that continues a conversation, or Hugging Face's `add_special_tokens=False`.
    pub fn tokenize_special(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(text, true)
    }

    /// Token ids of `text` as a continuation: never a BOS, special tokens not parsed.
    pub fn tokenize_continuation(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(text, false)
    }

    /// Text of `ids` (special tokens skipped).
    pub fn detokenize(&self, ids: &[u32]) -> Result<String> {
        self.loaded
            .vocab
            .tokenizer
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// What each of `ids` stands for: its bytes, and whether it is a special token
    /// (for logprobs).
    pub fn token_pieces(&self, ids: &[u32]) -> Result<Vec<TokenPiece>> {
        self.check_vocab(ids)?;
        crate::logprobs::token_pieces(&self.loaded.vocab.tokenizer, ids)
    }

    /// The sampling the checkpoint recommends (GGUF `general.sampling.*`,
    /// `generation_config.json`): what `keydiff serve` uses for fields a request leaves out.
    pub fn sampling_defaults(&self) -> keydiff_model::SamplingDefaults {
        self.loaded.vocab.sampling
    }

    /// The text of the BOS token, when the model has one.
    pub fn bos_token(&self) -> Option<String> {
        let v = &self.loaded.vocab;
        v.tokenizer.id_to_token(v.bos_id?)
    }

    /// The text of the first end-of-generation token.
    pub fn eos_token(&self) -> Option<String> {
        let v = &self.loaded.vocab;
        v.tokenizer.id_to_token(*v.eos_ids.first()?)
    }

    /// The end-of-generation token ids (a constrained reply ends with one of them).
    pub fn eos_ids(&self) -> &[u32] {
        &self.loaded.vocab.eos_ids
    }

    /// Whether a BOS token is put before a text prompt.
    pub fn adds_bos(&self) -> bool {
        self.loaded.vocab.add_bos
    }

    /// The chat template's source, when the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        Some(self.loaded.vocab.chat_template.as_ref()?.source())
    }

    /// Renders messages with the model's chat template, generation prompt appended.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String> {
        self.render_chat_tools(messages, &[])
    }

    /// Renders messages and the functions the model may call with the model's chat template,
    /// generation prompt appended.
    pub fn render_chat_tools(
        &self,
        messages: &[Message],
        tools: &[crate::tools::Tool],
    ) -> Result<String> {
        self.render_chat_with(messages, tools, &crate::TemplateKwargs::new())
    }

    /// Renders messages and tools with the chat template, generation prompt appended, and
    /// `kwargs` as variables over [`EngineConfig::chat_template_kwargs`].
    pub fn render_chat_with(
        &self,
        messages: &[Message],
        tools: &[crate::tools::Tool],
        kwargs: &crate::TemplateKwargs,
    ) -> Result<String> {
        let t = self
            .loaded
            .vocab
            .chat_template
            .as_ref()
            .ok_or(EngineError::NoChatTemplate)?;
        let tools: Vec<serde_json::Value> = tools.iter().map(|t| t.to_openai()).collect();
        let mut all = self.cfg.chat_template_kwargs.clone();
        all.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        Ok(t.render_with(messages, &tools, true, &all)?)
    }

    /// How the reply to `prompt` splits into reasoning and answer under `format`
    /// ([`crate::reasoning`]): `Some(open)` for a chat whose template `format` applies to
    /// (`open`: the rendered prompt opens the block, as DeepSeek-R1's does), `None` for other
    /// prompts and templates.
    pub fn reasoning_start(
        &self,
        prompt: &Prompt,
        format: crate::reasoning::ReasoningFormat,
    ) -> Result<Option<bool>> {
        if !format.applies(self.chat_template()) {
            return Ok(None);
        }
        let text = match prompt {
            Prompt::Chat(m) => self.render_chat(m)?,
            Prompt::ChatTools {
                messages,
                tools,
                template_kwargs,
            } => self.render_chat_with(messages, tools, template_kwargs)?,
            _ => return Ok(None),
        };
        Ok(Some(crate::reasoning::opens_reasoning(&text)))
    }

    /// How the model writes function calls, told by its chat template; `None` without a
    /// template or when it writes none keydiff reads ([`crate::tools::ToolSyntax`]).
    pub fn tool_syntax(&self) -> Option<crate::tools::ToolSyntax> {
        crate::tools::ToolSyntax::of_template(self.chat_template()?)
    }

    /// A fill in the middle's tokens, in three parts: the whole prompt without the project's
    /// files, the files' block (empty without `repo`; it goes before the FIM part), and the
    /// FIM part (from `<|fim_prefix|>` on, also the end of the first).
    fn infill_parts(
        &self,
        prefix: &str,
        suffix: &str,
        repo: Option<&[InfillFile]>,
    ) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        let files = repo.unwrap_or_default();
        // `/infill` (with `repo`) takes the three FIM tokens alone, as llama.cpp does.
        if repo.is_none() && prefix.is_empty() && suffix.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let v = &self.loaded.vocab;
        let Some(fim) = v.fim else {
            return Err(EngineError::BadField {
                field: "suffix",
                reason: "this model has no fill-in-the-middle tokens (<|fim_prefix|>, \
                         <|fim_suffix|>, <|fim_middle|> or their kin), so a suffix cannot be \
                         honoured"
                    .into(),
            });
        };
        let mut ids: Vec<u32> = match v.add_bos {
            true => v.bos_id.into_iter().collect(),
            false => Vec::new(),
        };
        let mut block = Vec::new();
        if repo.is_some() {
            if let Some(r) = fim.repo {
                block.push(r);
                block.extend(self.encode("myproject\n", false)?);
            }
            for f in files {
                match fim.file_sep {
                    Some(sep) => {
                        block.push(sep);
                        block.extend(self.encode(&format!("{}\n", f.name), false)?);
                    }
                    None => block.extend(self.encode("\n\n--- snippet ---\n\n", false)?),
                }
                block.extend(self.encode(&f.text, false)?);
            }
            if let Some(sep) = fim.file_sep {
                block.push(sep);
                block.extend(self.encode("filename\n", false)?);
            }
        }
        let mut part = vec![fim.prefix];
        part.extend(self.encode(prefix, false)?);
        part.push(fim.suffix);
        part.extend(self.encode(suffix, false)?);
        part.push(fim.middle);
        ids.extend(&part);
        Ok((ids, block, part))
    }

    /// The tokens of a fill in the middle with the project's files (`repo`): the files'
    /// block keeps at most `files_max` tokens, and fewer where the prompt would leave the
    /// reply less than `room` tokens of the context, losing tokens from its start, as
    /// llama.cpp's `/infill` cuts it (an editor sends what it has gathered, the latest files
    /// last). A fixed `files_max` cuts the same files the same way whatever the prefix, so
    /// that the next request finds them in the prompt cache. Returns the ids and how many
    /// were cut. The rest of the prompt is never cut (beyond the context, it is refused).
    pub fn infill_within(
        &self,
        prefix: &str,
        suffix: &str,
        repo: &[InfillFile],
        room: usize,
        files_max: usize,
    ) -> Result<(Vec<u32>, usize)> {
        let (mut ids, block, part) = self.infill_parts(prefix, suffix, Some(repo))?;
        let context = self.model_config().context();
        let fits = context.saturating_sub(room).saturating_sub(ids.len());
        let cut = block.len().saturating_sub(fits.min(files_max));
        let at = ids.len() - part.len();
        ids.splice(at..at, block[cut..].iter().copied());
        self.check_vocab(&ids)?;
        self.within_context(ids.len())?;
        Ok((ids, cut))
    }

    /// Token ids of a prompt.
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let ids = match prompt {
            Prompt::Text(t) => {
                if t.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                self.check_text_fits(t)?;
                self.tokenize(t, false)?
            }
            Prompt::Chat(_) | Prompt::ChatTools { .. } => {
                let text = self.prompt_text(prompt)?.expect("a chat has text");
                self.check_text_fits(&text)?;
                let m = prompt.messages().expect("a chat");
                if text.is_empty() {
                    return Err(EngineError::BadParams(format!(
                        "the chat template rendered {} message(s) as an empty prompt",
                        m.len()
                    )));
                }
                let bos = self.loaded.vocab.bos_id;
                let mut ids = self.tokenize(&text, true)?;
                // Templates that write the BOS text themselves must not get a second one.
                if ids.len() > 1 && bos.is_some() && ids[0] == ids[1] && ids[0] == bos.unwrap() {
                    ids.remove(0);
                }
                ids
            }
            Prompt::Tokens(t) => t.clone(),
            Prompt::Infill {
                prefix,
                suffix,
                repo,
            } => {
                let (mut ids, block, part) = self.infill_parts(prefix, suffix, repo.as_deref())?;
                let at = ids.len() - part.len();
                ids.splice(at..at, block);
                ids
            }
        };
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_vocab(&ids)?;
        Ok(ids)
    }

    /// Refuses a request the engine cannot honour: [`GenerateParams::validate`], and logit
    /// biases or stop tokens on token ids outside the model's vocabulary.
    pub fn check_params(&self, params: &GenerateParams) -> Result<()> {
        params.validate()?;
        let format = &params.sampling.format;
        if *format != Format::Text {
            Constraint::new(format)?;
            self.token_bytes()?;
            let eos = &self.loaded.vocab.eos_ids;
            let banned = |t: &u32| {
                let bias: f32 = (params.sampling.logit_bias.iter())
                    .filter(|b| b.0 == *t)
                    .map(|b| b.1)
                    .sum();
                bias == f32::NEG_INFINITY
            };
            if !eos.is_empty() && eos.iter().all(banned) {
                return Err(EngineError::BadField {
                    field: "logit_bias",
                    reason: format!(
                        "{} ends generation when the text is whole; the logit bias bans the end \
                         of generation",
                        Constraint::what(format)
                    ),
                });
            }
        }
        if params.min_tokens > params.max_tokens {
            return Err(EngineError::BadField {
                field: "min_tokens",
                reason: format!(
                    "min_tokens {} is more than max_tokens {}",
                    params.min_tokens, params.max_tokens
                ),
            });
        }
        let vocab = self.model_config().vocab_size;
        if let Some(bad) = params.stop_tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadField {
                field: "stop_token_ids",
                reason: format!("stop token id {bad}, outside the vocabulary of {vocab}"),
            });
        }
        match params
            .sampling
            .logit_bias
            .iter()
            .find(|b| b.0 as usize >= vocab)
        {
            Some((bad, _)) => Err(EngineError::BadField {
                field: "logit_bias",
                reason: format!("logit bias on token id {bad}, outside the vocabulary of {vocab}"),
            }),
            None => Ok(()),
        }
    }

    /// Refuses token ids outside the model's vocabulary.
    pub fn check_vocab(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.model_config().vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadParams(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(())
    }

    /// Runs one request: chunked prefill, then token-by-token decode, streaming text to
    /// `on_event` as it is produced.
    pub fn generate(
        &self,
        params: &GenerateParams,
        on_event: impl FnMut(Event<'_>),
    ) -> Result<Output> {
        self.generate_from(params, None, on_event)
    }

    /// Prefills `tokens` under the cache settings `cache` (with the engine's chunk size) and
    /// keeps them as a [`Prefix`], continuing from `base` when given (whose tokens must start
    /// `tokens`). `tokens` must be a whole number of chunks, and `cache` must not evict in them.
    pub fn prefill_prefix(
        &self,
        tokens: &[u32],
        base: Option<&Prefix>,
        cache: CacheConfig,
    ) -> Result<Prefix> {
        let chunk = self.cfg.cache.chunk;
        let bad = |m: String| Err(EngineError::BadParams(m));
        if cache.chunk != chunk {
            return bad(format!(
                "prefix chunk {} differs from the engine's {chunk}",
                cache.chunk
            ));
        }
        if tokens.is_empty() || !tokens.len().is_multiple_of(chunk) {
            return bad(format!(
                "a prefix must be a whole number of chunks of {chunk}, not {} tokens",
                tokens.len()
            ));
        }
        if let Some(n) = cache.budget {
            if tokens.len() > n {
                return bad(format!(
                    "prefix of {} tokens would evict under the budget {n}",
                    tokens.len()
                ));
            }
        }
        let start = match base {
            Some(b) if !tokens.starts_with(&b.tokens) => {
                return bad("the prefix does not start with its base".into())
            }
            Some(b) => b.len(),
            None => 0,
        };
        self.check_vocab(tokens)?;
        self.within_context(tokens.len())?;
        let mut kv = self.alloc_cache(cache, tokens.len())?;
        let model = &self.loaded.model;
        if let Some(b) = base {
            same_attention(b, self)?;
            kv.resume_from(&b.cache)?;
        }
        for piece in tokens[start..].chunks(chunk) {
            model.forward(piece, &mut kv, false)?;
        }
        // Nothing of the prefill was read back: it may still be running.
        self.settle()?;
        Ok(Prefix {
            tokens: tokens.to_vec(),
            cache: kv,
            attention: model.attention(),
            engine: self.id,
        })
    }

    /// [`Engine::generate`], starting from `prefix` when given: its cache is copied (the
    /// prefix stays reusable) and only the rest of the prompt is prefilled. The output is the
    /// one a fresh request gives; the prompt must start with the prefix's tokens and be longer.
    pub fn generate_from(
        &self,
        params: &GenerateParams,
        prefix: Option<&Prefix>,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Output> {
        let t0 = Instant::now();
        let (prompt, mut cache) = self.request_cache(params, 0)?;
        let start = start_from(&mut cache, &prompt, prefix, self)?;
        let (out, _) = self.run_request(&mut cache, &prompt, start, params, t0, &mut on_event)?;
        Ok(out)
    }

    /// A fresh request's prompt tokens and its cache, after checking its parameters, its
    /// length against the context, and that the cache (with a chunk's logit rows when it asks
    /// for prompt logprobs) fits in memory beside `held` bytes the budget does not see (a
    /// batch's running caches).
    pub(crate) fn request_cache(
        &self,
        params: &GenerateParams,
        held: u64,
    ) -> Result<(Vec<u32>, KvCache)> {
        self.check_params(params)?;
        let prompt = self.prompt_tokens(&params.prompt)?;
        let n = prompt.len();
        let context = self.within_context(n)?;
        // The cache holds at most the prompt and the output, never beyond the context.
        let max_tokens = n.saturating_add(params.max_tokens).min(context);
        let extra = match params.prompt_logprobs {
            Some(_) => self.chunk_logits_bytes(n),
            None => 0,
        };
        let cfg = self.cfg.cache.clone();
        self.check_cache_memory_beside(&cfg, cfg.slots_for(max_tokens), extra, held)?;
        let cache = self.model_cache(cfg, max_tokens)?;
        Ok((prompt, cache))
    }

    /// Prefills `prompt[start..]` into `cache` (which holds `prompt[..start]`, or for a chat
    /// turn whatever came before) and decodes. Returns the output and the last sampled
    /// token, which is not in the cache.
    pub(crate) fn run_request(
        &self,
        cache: &mut KvCache,
        prompt: &[u32],
        start: usize,
        params: &GenerateParams,
        t0: Instant,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(Output, Option<u32>)> {
        self.run_request_after(cache, &[], prompt, start, params, t0, on_event)
    }

    /// [`Engine::run_request`] for a prompt that follows `earlier` tokens in `cache` (a
    /// conversation's turn): speculative drafts are looked up in them too.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_request_after(
        &self,
        cache: &mut KvCache,
        earlier: &[u32],
        prompt: &[u32],
        start: usize,
        params: &GenerateParams,
        t0: Instant,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(Output, Option<u32>)> {
        let mut d =
            self.prefill_request(cache, prompt.to_vec(), start, params.clone(), t0, on_event)?;
        d.after(earlier);
        self.decode_request(d, cache, on_event)
    }

    /// Decodes a prefilled request ([`Engine::prefill_request`]) token by token to its end.
    pub(crate) fn decode_request(
        &self,
        mut d: Decoding<'_>,
        cache: &mut KvCache,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(Output, Option<u32>)> {
        let model = &self.loaded.model;
        if let (Some(_), Some(why)) = (&d.params.speculative, cache.unrewindable()) {
            tracing::warn!("speculative decoding is off for this request: {why}");
        }
        let mut next = d.next(cache.position(), on_event)?;
        while let Some(tok) = next {
            let fed = d.with_draft(tok, cache);
            if fed.len() == 1 {
                let logits = model.forward(&fed, cache, true)?;
                d.fed_row(&logits)?;
                next = d.next(cache.position(), on_event)?;
                continue;
            }
            let exact = d.params.speculative.is_some_and(|s| s.exact);
            let rows = model.forward_decode_rows(&fed, cache, exact)?;
            next = d.verify(rows.to_vec2::<f32>()?, &fed[1..], cache, on_event)?;
        }
        Ok(d.finish(cache, on_event))
    }

    /// Prefills `prompt[start..]` into `cache` (which holds `prompt[..start]`, or for a chat
    /// turn whatever came before): the request's state, ready to sample its first token
    /// ([`Decoding::next`]).
    pub(crate) fn prefill_request(
        &self,
        cache: &mut KvCache,
        prompt: Vec<u32>,
        start: usize,
        params: GenerateParams,
        t0: Instant,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Decoding<'_>> {
        let p = Prefill::new(self, cache, prompt, start, params, t0)?;
        self.prefill(p, cache, on_event)
    }

    /// Runs the prefill `p` (on `cache`) to its end ([`Engine::prefill_request`]).
    pub(crate) fn prefill<'e>(
        &'e self,
        mut p: Prefill<'e>,
        cache: &mut KvCache,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<Decoding<'e>> {
        let model = &self.loaded.model;
        while let Some(piece) = p.piece(cache) {
            let started = Instant::now();
            let tokens = &p.prompt[piece.clone()];
            // `forward` runs the LM head on the last row of every chunk (one row).
            let logits = match p.logits(&piece) {
                Logits::All => model.forward_all(tokens, cache)?,
                _ => model.forward(tokens, cache, false)?.unsqueeze(0)?,
            };
            p.took(piece, Some(logits), started, on_event)?;
        }
        p.finish(cache, on_event)
    }

    /// Changes the cache settings (policy, budget, chunk) for later requests; the model stays
    /// loaded.
    pub fn set_cache_config(&mut self, cache: CacheConfig) -> Result<()> {
        cache
            .validate()
            .map_err(|e| EngineError::BadParams(e.to_string()))?;
        self.cfg.cache = cache;
        Ok(())
    }

    /// Evict each layer after its own attention (`true`) or every layer at once after the
    /// last one's (see [`EngineConfig::evict_per_layer`]), for later requests.
    pub fn set_evict_per_layer(&mut self, on: bool) {
        self.cfg.evict_per_layer = on;
    }

    /// Computes chunk attention with `backend` for later requests (`Auto` resolves as at
    /// load). A backend this build, device or model cannot run is refused, and the engine
    /// keeps the one it had. [`Engine::config`] reports the backend in use. A [`Prefix`] made
    /// under the other backend is refused from then on; a [`crate::PromptCache`] kept by the
    /// caller is not checked (its entries round as the backend they were prefilled with did).
    pub fn set_attention(&mut self, backend: AttentionBackend) -> Result<()> {
        self.loaded.model.set_attention(backend)?;
        self.cfg.attention = self.loaded.model.attention();
        Ok(())
    }

    /// What a prefill of `tokens` tokens that keeps every row's logits needs beyond its cache:
    /// a chunk's logit rows in f32, and the temporaries of their log-softmax, top-k masks or
    /// host copy (24 bytes per logit).
    pub(crate) fn chunk_logits_bytes(&self, tokens: usize) -> u64 {
        6 * 4 * (self.cfg.cache.chunk.min(tokens) * self.model_config().vocab_size) as u64
    }

    /// A fresh cache under the engine's cache settings, for a request that will see at most
    /// `max_tokens` tokens (see [`KvCache::new`]).
    pub fn new_cache(&self, max_tokens: usize) -> Result<KvCache> {
        self.alloc_cache(self.cfg.cache.clone(), max_tokens)
    }

    /// Logits after prefilling `tokens` in chunks of `chunk` under the engine's cache policy
    /// (for parity tests), `[vocab]`.
    pub fn prefill_logits(&self, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let mut cache = self.new_cache(tokens.len())?;
        self.prefill_with(tokens, chunk, &mut cache)
    }

    /// Logits after `tokens`: all but the last `decode_steps` prefilled in chunks of `chunk`,
    /// then those one at a time as decode steps (as generated tokens run: the decode weights,
    /// on a GPU the fused linears and the decode-attention kernel, decode-time eviction),
    /// `[vocab]`. For device parity checks of the decode path.
    pub fn decode_logits(
        &self,
        tokens: &[u32],
        chunk: usize,
        decode_steps: usize,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if decode_steps >= tokens.len() {
            return Err(EngineError::BadParams(format!(
                "{decode_steps} decode steps need a prompt of more tokens than that, not {}",
                tokens.len()
            )));
        }
        // Ids beyond the vocabulary: a CUDA embedding lookup does not check them.
        self.check_vocab(tokens)?;
        let mut cache = self.new_cache(tokens.len())?;
        let (prompt, steps) = tokens.split_at(tokens.len() - decode_steps);
        let mut logits = self.prefill_with(prompt, chunk, &mut cache)?;
        for &t in steps {
            logits = self
                .loaded
                .model
                .forward(&[t], &mut cache, true)?
                .to_vec1::<f32>()?;
        }
        Ok(logits)
    }

    /// Logits after prefilling `tokens` under the engine's cache settings, starting from
    /// `prefix` when given (for parity tests of prefix reuse), `[vocab]`.
    pub fn prefill_logits_from(&self, tokens: &[u32], prefix: Option<&Prefix>) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let mut cache = self.new_cache(tokens.len())?;
        let start = start_from(&mut cache, tokens, prefix, self)?;
        self.prefill_with(&tokens[start..], self.cfg.cache.chunk, &mut cache)
    }

    /// Prefills `tokens` in chunks of `chunk` into `cache`; returns the last logits.
    pub fn prefill_with(
        &self,
        tokens: &[u32],
        chunk: usize,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if chunk == 0 || (chunk > self.cfg.cache.chunk && self.cfg.cache.budget.is_some()) {
            return Err(EngineError::BadParams(format!(
                "chunk {chunk} must be in 1..={} under a budget",
                self.cfg.cache.chunk
            )));
        }
        // Ids beyond the vocabulary: a CUDA embedding lookup does not check them.
        self.check_vocab(tokens)?;
        let model = &self.loaded.model;
        let mut logits = None;
        for piece in tokens.chunks(chunk) {
            logits = Some(model.forward(piece, cache, false)?);
        }
        Ok(logits.expect("non-empty").to_vec1::<f32>()?)
    }
}

/// Refuses a CUDA device that this build's code does not run on, naming the build to make for
/// it. On one where only its PTX runs (a build for an earlier major version: sm_80 code on an
/// sm_90 GPU), GGUF weights (and random weights of a `--weight-type`) are refused too, since
/// candle's GGUF matrix kernels are machine code (`fast_mmvq`, `fast_mmq`; its fallback
/// dequantizes each weight to f32 for every prefill matmul, beyond any memory plan), and other
/// models load with a warning; flash attention is then not chosen either
/// ([`AttentionBackend::resolve`]).
fn check_device_arch(dev: &Device, source: &ModelSource) -> Result<()> {
    use keydiff_cache::arch::{device_fit, Fit};
    let Some(f) = device_fit(dev) else {
        return Ok(());
    };
    let name = match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    };
    let refuse = |why: String| EngineError::Device {
        name: name.clone(),
        reason: why,
    };
    match (f.fit, source) {
        (Fit::All, _) => Ok(()),
        (Fit::None, _) => Err(refuse(format!(
            "{}, whose code runs on {}: {}",
            f.describe(),
            f.arch.runs_on(),
            f.remedy(false)
        ))),
        (Fit::PtxOnly, ModelSource::Gguf(_)) => Err(refuse(format!(
            "{}: candle's GGUF matrix kernels are machine code for {} and do not run on it; {}, \
             or load the model's safetensors",
            f.describe(),
            f.arch.runs_on(),
            f.remedy(false)
        ))),
        (
            Fit::PtxOnly,
            ModelSource::Random {
                weights: Some(t), ..
            },
        ) => Err(refuse(format!(
            "{}: candle's GGUF matrix kernels, which random weights in {} run, are machine code \
             for {} and do not run on it; {}, or drop --weight-type",
            f.describe(),
            keydiff_model::weight_type_name(*t),
            f.arch.runs_on(),
            f.remedy(false)
        ))),
        (Fit::PtxOnly, _) => {
            tracing::warn!(
                "{name}: {}: its PTX kernels run here (the driver compiles them), its machine \
                 code (flash attention) does not; {}",
                f.describe(),
                f.remedy(false)
            );
            Ok(())
        }
    }
}

/// Refuses a prefix prefilled under another attention backend than `attention`.
fn same_attention(p: &Prefix, engine: &Engine) -> Result<()> {
    engine.check_owner(Some(p.engine), "the prefix")?;
    let attention = engine.loaded.model.attention();
    if p.attention != attention {
        return Err(EngineError::BadParams(format!(
            "the prefix was prefilled with {} attention and the engine now runs {attention}",
            p.attention
        )));
    }
    Ok(())
}

/// Starts a fresh `cache` from `prefix`, when given, for a request on `prompt` under
/// `attention`; returns the number of prompt tokens it covers.
fn start_from(
    cache: &mut KvCache,
    prompt: &[u32],
    prefix: Option<&Prefix>,
    engine: &Engine,
) -> Result<usize> {
    let Some(p) = prefix else {
        return Ok(0);
    };
    same_attention(p, engine)?;
    if p.len() >= prompt.len() || !prompt.starts_with(&p.tokens) {
        return Err(EngineError::BadParams(format!(
            "the prompt ({} tokens) does not extend the prefix of {} tokens",
            prompt.len(),
            p.len()
        )));
    }
    cache.resume_from(&p.cache)?;
    Ok(p.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens are picked where the logits are only for requests drawn from the logits as they
    /// come: the argmax of a greedy one everywhere, and a sampled one's draw on a device that
    /// draws; never with logprobs (even of no alternatives), an output format, a logit bias or
    /// an active penalty.
    #[test]
    fn tokens_are_picked_where_the_logits_are_only_for_plain_requests() {
        let decide = |p: GenerateParams, device_samples: bool| {
            let c = Constraint::new(&p.sampling.format).unwrap();
            Pick::of(&p, &c, device_samples)
        };
        let with = |s: Sampling| GenerateParams {
            sampling: s,
            ..Default::default()
        };
        let sampled = Sampling {
            temperature: 0.3,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            ..Default::default()
        };
        for device_samples in [false, true] {
            let d = |p| decide(p, device_samples);
            assert_eq!(d(GenerateParams::default()), Pick::Greedy);
            assert_eq!(
                d(GenerateParams {
                    prompt_logprobs: Some(3),
                    ..Default::default()
                }),
                Pick::Greedy
            );
            let drawn = match device_samples {
                true => Pick::Device,
                false => Pick::Host,
            };
            assert_eq!(d(with(sampled.clone())), drawn);
            // A penalty with an empty window is none.
            assert_eq!(
                d(with(Sampling {
                    presence_penalty: 0.5,
                    repeat_last_n: 0,
                    ..sampled.clone()
                })),
                drawn
            );
            for s in [Sampling::default(), sampled.clone()] {
                assert_eq!(
                    d(GenerateParams {
                        logprobs: Some(0),
                        sampling: s.clone(),
                        ..Default::default()
                    }),
                    Pick::Host
                );
                for format in [
                    Format::JsonObject,
                    Format::Grammar(r#"root ::= "a" | "b""#.into()),
                ] {
                    let p = with(Sampling {
                        format: format.clone(),
                        ..s.clone()
                    });
                    assert_eq!(d(p), Pick::Host, "{format:?}");
                }
                let biased = Sampling {
                    logit_bias: vec![(1, -1.0)],
                    ..s.clone()
                };
                assert_eq!(d(with(biased)), Pick::Host);
                let penalised = Sampling {
                    presence_penalty: 0.5,
                    ..s.clone()
                };
                assert_eq!(d(with(penalised)), Pick::Host);
                let repeated = Sampling {
                    repetition_penalty: 1.1,
                    ..s.clone()
                };
                assert_eq!(d(with(repeated)), Pick::Host);
            }
        }
    }

    /// A lazy constraint with `<tool_call>` anywhere and `{"name"` at the start, over the
    /// grammar of `<tool_call>\nX\n</tool_call>` or `{"name":1}`.
    fn lazy() -> Constraint {
        let grammar = r#"root ::= "<tool_call>\nX\n</tool_call>" | "{\"name\":1}""#.to_string();
        let format = Format::Lazy {
            grammar,
            triggers: vec!["<tool_call>".into()],
            at_start: vec!["{\"name\"".into()],
            reasoning: None,
        };
        Constraint::new(&format).unwrap().unwrap()
    }

    fn vocab(words: &[&str]) -> Vec<Box<[u8]>> {
        words.iter().map(|w| w.as_bytes().into()).collect()
    }

    /// Reads `words` as tokens; false at the first one refused.
    fn read(c: &mut Constraint, tokens: &[Box<[u8]>], ids: &[u32]) -> bool {
        ids.iter().all(|&t| c.push(t, tokens, &[0]))
    }

    /// The mask bans exactly the tokens reading refuses, and counts the rest.
    fn assert_mask_is_push(c: &Constraint, tokens: &[Box<[u8]>], by_bytes: &[u32], what: &str) {
        let mut logits = vec![0.0; tokens.len()];
        let left = c.mask(&mut logits, tokens, by_bytes, &[0]);
        for t in 0..tokens.len() as u32 {
            assert_eq!(
                c.clone().push(t, tokens, &[0]),
                logits[t as usize] == 0.0,
                "{what}: token {t}"
            );
        }
        assert_eq!(left, logits.iter().filter(|l| l.is_finite()).count());
    }

    #[test]
    fn a_lazy_grammar_applies_from_its_trigger() {
        // 0 is the end of generation; 1 a special token with no text.
        let tokens = vocab(&[
            "",
            "",
            "Hi ",
            "<tool",
            "_call>",
            "\nX\n",
            "</tool_call>",
            "_call>Y",
            "{\"",
            "name\":1}",
            " ",
            "{\"x",
            "<tool_call>\nX\n</tool_call>",
        ]);
        // Free text, special tokens and the end before the trigger.
        let mut c = lazy();
        assert!(read(&mut c, &tokens, &[2, 1, 10, 11, 2, 0]));
        // A trigger across tokens, then the grammar to its end.
        let mut c = lazy();
        assert!(read(&mut c, &tokens, &[2, 3, 4, 5]));
        assert!(
            !c.clone().push(0, &tokens, &[0]),
            "the end before the call is whole"
        );
        assert!(
            !c.clone().push(2, &tokens, &[0]),
            "text the grammar refuses"
        );
        assert!(
            !c.clone().push(1, &tokens, &[0]),
            "a special token inside the call"
        );
        assert!(read(&mut c, &tokens, &[6, 0]));
        // A token that brings the trigger and what the grammar refuses.
        let mut c = lazy();
        assert!(read(&mut c, &tokens, &[3]));
        assert!(!c.clone().push(7, &tokens, &[0]));
        // The mask bans exactly the tokens push refuses.
        let mut logits = vec![0.0; tokens.len()];
        let left = c.mask(&mut logits, &tokens, &[], &[0]);
        let allowed: Vec<usize> = (0..tokens.len()).filter(|&i| logits[i] == 0.0).collect();
        assert_eq!(allowed, [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12]);
        assert_eq!(left, allowed.len());
        for t in 0..tokens.len() as u32 {
            assert_eq!(
                c.clone().push(t, &tokens, &[0]),
                allowed.contains(&(t as usize)),
                "{t}"
            );
        }
        // A start trigger after whitespace, at the start only.
        let mut c = lazy();
        assert!(read(&mut c, &tokens, &[10, 8, 9, 0]));
        let mut c = lazy();
        assert!(read(&mut c, &tokens, &[8]));
        assert!(
            read(&mut c, &tokens, &[11, 9, 0]),
            "`{{\"{{\"x` is text, not a call"
        );
        let mut c = lazy();
        assert!(
            read(&mut c, &tokens, &[2, 8, 2, 0]),
            "not at the start: text"
        );
        // One token that is a whole call.
        let mut c = lazy();
        assert!(read(&mut c, &tokens, &[2, 12, 0]));
    }

    /// With `reasoning`, a `<think>` block at the start of the reply is free text: a trigger
    /// inside it does not count, the answer after it starts the text (start triggers count
    /// there), and the mask still bans exactly what reading refuses.
    #[test]
    fn a_lazy_grammar_skips_a_reasoning_block() {
        let tokens = vocab(&[
            "",
            "",
            "<think>",
            "I could use <tool_call> here",
            "</think>",
            "\n\n",
            "<tool_call>",
            "\nX\n",
            "</tool_call>",
            "</think>\n<tool_call>Y",
            "{\"",
            "name\":1}",
            "Hi ",
            " ",
            "<thi",
            "nk>",
        ]);
        let lazy_with = |reasoning| {
            let format = Format::Lazy {
                grammar: r#"root ::= "<tool_call>\nX\n</tool_call>" | "{\"name\":1}""#.into(),
                triggers: vec!["<tool_call>".into()],
                at_start: vec!["{\"name\"".into()],
                reasoning,
            };
            Constraint::new(&format).unwrap().unwrap()
        };
        // Without it, the trigger in the reasoning starts the grammar, which refuses the rest.
        let mut c = lazy_with(None);
        assert!(read(&mut c, &tokens, &[2]));
        assert!(!c.clone().push(3, &tokens, &[0]));
        // With it, the reasoning is text, and so is an answer without a call.
        let mut c = lazy_with(Some(false));
        assert!(read(&mut c, &tokens, &[2, 3, 4, 5, 12, 0]));
        // A call in the answer follows the grammar.
        let mut c = lazy_with(Some(false));
        assert!(read(&mut c, &tokens, &[2, 3, 4, 5, 6]));
        assert!(!c.clone().push(12, &tokens, &[0]));
        assert!(read(&mut c, &tokens, &[7, 8, 0]));
        // The answer's start is the text's: a start trigger after the block.
        let mut c = lazy_with(Some(false));
        assert!(read(&mut c, &tokens, &[2, 3, 4, 5, 10, 11, 0]));
        // Whitespace and a tag split across tokens; a prompt that opened the block.
        let mut c = lazy_with(Some(false));
        assert!(read(&mut c, &tokens, &[13, 14, 15, 3, 4, 12, 0]));
        let mut c = lazy_with(Some(true));
        assert!(read(&mut c, &tokens, &[3, 4, 5, 6, 7, 8, 0]));
        // A reply that does not open a block reads as without reasoning.
        let mut c = lazy_with(Some(false));
        assert!(read(&mut c, &tokens, &[12]));
        assert!(!c.clone().push(3, &tokens, &[0]));
        // The mask bans exactly what reading refuses, before, in and after the block.
        for prefix in [&[][..], &[14], &[13], &[2], &[2, 3], &[2, 3, 4], &[12]] {
            let mut c = lazy_with(Some(false));
            assert!(read(&mut c, &tokens, prefix));
            assert_mask_is_push(&c, &tokens, &[], &format!("after {prefix:?}"));
        }
        // Token 9 ends the block and starts a call the grammar refuses.
        let mut c = lazy_with(Some(false));
        assert!(read(&mut c, &tokens, &[2]));
        assert!(!c.clone().push(9, &tokens, &[0]));
    }

    /// `Format::AfterReasoning`: the reasoning block is free (a call's text inside it too),
    /// generation cannot end in it, the answer after it (whitespace aside) follows the grammar
    /// or JSON mode, a reply without a block is all answer, and the mask bans exactly what
    /// reading refuses, before, in and after the block.
    #[test]
    fn a_format_after_reasoning_leaves_the_block_free() {
        let tokens = vocab(&[
            "",
            "",
            "<think>",
            "Call f? {no json here",
            "</think>",
            "\n\n",
            "<tool_call>",
            "\nX\n",
            "</tool_call>",
            "</think>\n<tool_call>",
            "</think>Hi",
            "Hi ",
            " ",
            "<thi",
            "nk>",
            "{\"a\": 1}",
            "\n<tool_call>",
            " {\"a\": 1}",
        ]);
        let by_bytes = crate::grammar::sorted_by_bytes(&tokens);
        let grammar = Format::Grammar(r#"root ::= "<tool_call>\nX\n</tool_call>""#.into());
        let after = |format: &Format, open| {
            let f = format.clone().after_reasoning(Some(open));
            assert!(matches!(f, Format::AfterReasoning { .. }), "{f:?}");
            Constraint::new(&f).unwrap().unwrap()
        };
        // Reasoning, then the call.
        let mut c = after(&grammar, false);
        assert!(read(&mut c, &tokens, &[2, 3, 4, 5, 6, 7, 8, 0]));
        // Not ended inside the block, nor before the call is whole.
        let mut c = after(&grammar, false);
        assert!(read(&mut c, &tokens, &[2, 3]));
        assert!(!c.clone().push(0, &tokens, &[0]));
        assert!(read(&mut c, &tokens, &[4, 5]));
        assert!(
            !c.clone().push(0, &tokens, &[0]),
            "the answer must be a call"
        );
        assert!(
            !c.clone().push(11, &tokens, &[0]),
            "text instead of the call"
        );
        // One token that ends the block and starts the call; one that starts text instead.
        let mut c = after(&grammar, false);
        assert!(read(&mut c, &tokens, &[2, 3]));
        assert!(c.clone().push(9, &tokens, &[0]));
        assert!(!c.clone().push(10, &tokens, &[0]));
        // No block: the call from the start (after whitespace, the tag split across tokens
        // read as a possible block first).
        let mut c = after(&grammar, false);
        assert!(read(&mut c, &tokens, &[12, 6, 7, 8, 0]));
        let mut c = after(&grammar, false);
        assert!(!c.push(11, &tokens, &[0]));
        // A prompt that opened the block.
        let mut c = after(&grammar, true);
        assert!(read(&mut c, &tokens, &[3, 4, 6, 7, 8, 0]));
        // JSON mode after the block.
        let mut c = after(&Format::JsonObject, false);
        assert!(read(&mut c, &tokens, &[13, 14, 3, 4, 5, 15, 0]));
        let mut c = after(&Format::JsonObject, false);
        assert!(read(&mut c, &tokens, &[2, 4]));
        assert!(!c.clone().push(11, &tokens, &[0]));
        // The mask bans exactly what reading refuses.
        for (format, prefix) in [
            (&grammar, &[][..]),
            (&grammar, &[13]),
            (&grammar, &[12]),
            (&grammar, &[2]),
            (&grammar, &[2, 3]),
            (&grammar, &[2, 3, 4]),
            (&grammar, &[2, 3, 4, 5]),
            (&grammar, &[2, 3, 4, 6]),
            (&Format::JsonObject, &[2, 4]),
            (&Format::JsonObject, &[2, 4, 5]),
            (&Format::JsonObject, &[]),
        ] {
            let mut c = after(format, false);
            assert!(read(&mut c, &tokens, prefix));
            let what = format!("{format:?} after {prefix:?}");
            assert_mask_is_push(&c, &tokens, &by_bytes, &what);
        }
        // Without reasoning, or on text, nothing changes; a lazy grammar takes it itself.
        assert_eq!(grammar.clone().after_reasoning(None), grammar);
        assert_eq!(Format::Text.after_reasoning(Some(false)), Format::Text);
        let lazy = Format::Lazy {
            grammar: r#"root ::= "<tool_call>\nX\n</tool_call>""#.into(),
            triggers: vec!["<tool_call>".into()],
            at_start: Vec::new(),
            reasoning: None,
        };
        assert!(matches!(
            lazy.after_reasoning(Some(true)),
            Format::Lazy {
                reasoning: Some(true),
                ..
            }
        ));
    }

    #[test]
    fn a_lazy_grammar_must_take_its_triggers() {
        let format = Format::Lazy {
            grammar: r#"root ::= "<call>""#.into(),
            triggers: vec!["<tool_call>".into()],
            at_start: Vec::new(),
            reasoning: None,
        };
        let e = Constraint::new(&format).unwrap_err().to_string();
        assert!(e.contains("trigger `<tool_call>`"), "{e}");
        let none = Format::Lazy {
            grammar: r#"root ::= "x""#.into(),
            triggers: Vec::new(),
            at_start: Vec::new(),
            reasoning: None,
        };
        assert!(Constraint::new(&none).is_err());
    }
}
