//! `keydiff`: the command line. Thin: parse, call the library, print.

mod bench;
mod eval;
mod plot;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use keydiff::tools::{Tool, ToolChoice, ToolSyntax};
use keydiff::{
    parse_device, parse_dtype, parse_kv_dtype, AttentionBackend, CacheConfig, CpuWeights, Engine,
    EngineConfig, Event, Format, GenerateParams, KvType, KvTypes, Message, ModelSource, PolicyKind,
    Prompt, Sampling, DEFAULT_CHUNK,
};

/// The model `run` uses when `-m` is not given (fetched by scripts/fetch-models.sh).
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// A prompt spanning more chunks than this gets a progress bar.
const PROGRESS_MIN_CHUNKS: usize = 4;

/// `keydiff --version`: the version, the commit built from and the GPU features built in.
fn version_line() -> &'static str {
    static LINE: std::sync::LazyLock<String> = std::sync::LazyLock::new(keydiff::build_info);
    LINE.as_str()
}

#[derive(Parser)]
#[command(
    name = "keydiff",
    version = version_line(),
    about = "Long-prompt LLM inference under a fixed KV-cache budget"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt.
    Run(Box<RunArgs>),
    /// Benchmarks: time to first token (ttft) and decode throughput (decode).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Accuracy under a budget: passkey, niah, phonebook or longbench, per policy × budget ×
    /// length. Prints a table and writes results.json (and heatmap.svg for niah).
    Eval(eval::EvalArgs),
    /// Multi-turn chat on stdin, one user message per line: the KV cache is kept between
    /// turns, so each turn prefills only the new message (under --budget/--policy, a long
    /// conversation stays in N + B slots per layer and head). Replies stream to stdout; a
    /// line of stats per turn goes to stderr.
    Chat(ChatArgs),
    /// OpenAI-compatible HTTP server: POST /v1/completions and /v1/chat/completions (with
    /// "stream": true as server-sent events), GET /v1/models and /health. Requests run one at
    /// a time under the cache settings given here, in arrival order; a request whose client
    /// disconnects is cancelled. Ctrl-C or SIGTERM stops the running request and exits.
    Serve(ServeArgs),
    /// Perplexity of a text under the cache settings: prefilled in chunks of B as a prompt
    /// is, evicting after each chunk under --budget/--policy, every token after the first
    /// scored on the logits before it (llama-perplexity's measure). A text beyond -c or the
    /// model's context is scored in overlapping windows (--stride). Prints the perplexity,
    /// the mean NLL ± its standard error and the perplexity of each quarter of the text.
    Perplexity(PplArgs),
    /// Print the token ids of a text as a JSON array (BOS first when the model adds one).
    Tokenize {
        #[command(flatten)]
        model: ModelArgs,
        /// The text (without -p or -f, it is read from stdin).
        #[arg(short = 'p', long, conflicts_with = "file")]
        prompt: Option<String>,
        /// Read the text from a file (one line break at its end left out, as llama.cpp does).
        #[arg(short = 'f', long)]
        file: Option<PathBuf>,
        /// Parse special tokens (e.g. <|im_start|>) written in the text.
        #[arg(long, visible_alias = "parse-special")]
        special: bool,
        #[command(flatten)]
        escape: EscapeArgs,
    },
    /// List the devices this keydiff can run on (llama.cpp's --list-devices): the CPU, and
    /// every CUDA device the driver sees, with its compute capability, memory and how much of
    /// this build's GPU code runs on it; or why there are none. Makes no context on any GPU.
    Devices {
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Print the architecture, shapes, dtype and quantization of a model.
    Info {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Check a device against the CPU: the same seeded random models (small real-code-path
    /// presets) run on CPU f32 and on DEVICE/DTYPE; the logits after a multi-chunk prefill
    /// (with eviction when --budget is given) are compared. Prints one JSON line per preset and
    /// policy; fails when the cosine similarity of the logits is below 0.99.
    CheckDevice {
        #[arg(long, default_value = "cuda:0")]
        device: String,
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// KV cache type on the checked device (default: --dtype). The CPU reference holds a
        /// float cache in f32, and a block type (q8_0, q4_0, ...) as it is: its CPU codec is
        /// the twin of the CUDA kernels, and an f32 cache would measure the codec's rounding.
        #[arg(long)]
        kv_dtype: Option<String>,
        /// Attention on the checked device (auto, eager, flash); the CPU reference is eager.
        #[arg(long, default_value = "auto")]
        attention: String,
        /// Preset configs to check.
        #[arg(long, default_values = ["configs/tiny-llama.json", "configs/tiny-qwen.json", "configs/tiny-qwen3.json", "configs/tiny-qwen3moe.json"])]
        preset: Vec<PathBuf>,
        #[arg(long, default_value_t = 300)]
        prompt_len: usize,
        #[arg(long, default_value_t = 64)]
        chunk: usize,
        /// Run the last N tokens of the prompt as decode steps, one at a time, as generated
        /// tokens run (decode weights; on a GPU the fused linears and the decode-attention
        /// kernel; decode-time eviction), after the rest is prefilled in chunks.
        #[arg(long, default_value_t = 0)]
        decode_steps: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// KV budget for the eviction runs (none: full cache only).
        #[arg(long)]
        budget: Option<usize>,
        /// Quantize the random models' linears and embedding to this GGML type (as
        /// `--weight-type`): both devices hold the same blocks. The CPU multiplies dense
        /// prefill copies of them (exact f32 products of the dequantized weights; experts,
        /// which keep no copies, through its quantized matmul, and nothing re-quantized); the
        /// device runs its quantized matmuls, as a GGUF model of that type runs there.
        #[arg(long)]
        weight_type: Option<String>,
        /// Policies to check under the budget.
        #[arg(long, value_delimiter = ',', default_value = "keydiff")]
        policies: Vec<String>,
        /// Also compare perplexity: every token's NLL after the same chunked prefill (adds
        /// `nll` to each line; fails when the NLLs correlate below 0.99).
        #[arg(long)]
        perplexity: bool,
        /// Instead: check batching on DEVICE itself. A batch decode step of three sequences,
        /// then a mixed pass (their decode rows and two prompt chunks of two more), against
        /// each sequence alone, on the full cache and each of --policies under N = 40, B = 16
        /// (evicting; --chunk, --budget, --prompt-len, --decode-steps and --perplexity do not
        /// apply). One JSON
        /// line per preset and policy; fails when a segment's logits differ by more than 2% of
        /// their scale (1e-4 on the CPU in f32).
        #[arg(long)]
        batch: bool,
    },
    /// Check and time the eviction kernels on a device: fused KeyDiff scoring, selection with
    /// its move plan, and slot moves, against the CPU references (candle ops, a sort), on odd
    /// sizes, head dims 64/128/256 and f32/f16/bf16. Then times one eviction at the given
    /// sizes against the device's copy bandwidth. Also encodes and decodes every KV cache type
    /// (llama.cpp's blocks, fp8) on the device and on the CPU: bytes and values must be equal.
    /// One JSON line per case on stdout, a table on stderr; fails when a parity case fails.
    CheckKernels {
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// Also check n = 131072 + 128.
        #[arg(long)]
        large: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Used slots (N + B) of the timed evictions; `--time-n` with no value: parity only.
        #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "8320,32896,131200")]
        time_n: Vec<usize>,
        /// KV heads, head dim and dtype of the timed evictions (Llama-3.1-8B: 8, 128, bf16).
        #[arg(long, default_value_t = 8)]
        time_kv_heads: usize,
        #[arg(long, default_value_t = 128)]
        time_head_dim: usize,
        #[arg(long, default_value = "bf16")]
        time_dtype: String,
        /// Chunk B: the timed evictions keep n − B.
        #[arg(long, default_value_t = 128)]
        time_chunk: usize,
        /// Layers evicted at once in the timed evictions, as `layers · kv_heads` heads: the
        /// engine evicts every layer of a model together after the last layer's attention
        /// (and KeyDiff on float caches scores them together), so 32 is Llama-3.1-8B's
        /// eviction of a chunk; 1 is one layer alone (as when each layer evicts after its own
        /// attention).
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        time_layers: Vec<usize>,
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
}

/// Least cosine similarity between CPU f32 and device logits that `check-device` accepts.
/// bf16 keeps 8 bits of mantissa: logits of a correct run agree to ~0.999; a wrong kernel,
/// position or eviction gives ~0.
const MIN_DEVICE_COSINE: f32 = 0.99;

/// Least correlation of per-token NLLs between the CPU f32 and the device that `check-device
/// --perplexity` accepts: a random model's NLLs all sit near ln(vocab), so agreement is asked
/// of which tokens are harder (bf16 on the CPU: 0.9994; a broken op: ~0).
const MIN_NLL_CORRELATION: f64 = 0.99;

/// Largest |−logprob − NLL| that `check-device --perplexity` accepts between a run's prompt
/// logprobs and its own perplexity: the same logits on the same device, so only the
/// log-softmax's rounding differs (f32: ~1e-6; a wrong row or target: ~1).
const MAX_LOGPROB_NLL_DIFF: f32 = 1e-3;

fn parse_memory(s: &str) -> std::result::Result<u64, String> {
    keydiff::parse_size(s)
}

/// Where the model comes from and where it runs.
#[derive(Args)]
struct LoadArgs {
    /// GGUF file, HF directory, hub id (org/name or org/name:file.gguf), or with
    /// --random-weights a preset config (configs/NAME.json or NAME).
    #[arg(short = 'm', long, visible_alias = "preset", default_value = DEFAULT_MODEL)]
    model: String,
    /// Random weights in the preset's real shapes (timing only: the text is meaningless).
    #[arg(long)]
    random_weights: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    weight_seed: u64,
    /// With --random-weights: quantize the linears and the embedding to this GGML type, as a
    /// GGUF file of that type holds them (q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k,
    /// q5_k, q6_k; norms stay dense), so that a preset times or checks the quantized matmuls
    /// a GGUF model runs. The values are drawn as dense ones are (on a GPU, there) and
    /// quantized on the host. The K types need widths that are multiples of 256.
    #[arg(long)]
    weight_type: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// What the KV cache holds: f32, f16, bf16, fp8 (E4M3 without a scale, vLLM's) or
    /// llama.cpp's blocks q8_0, q5_1, q5_0, q4_1, q4_0 (1.06, 0.75, 0.69, 0.63, 0.56 bytes a
    /// value) (default: --dtype). f16 halves the cache's memory and the bytes a decode step
    /// reads (llama.cpp's default cache type).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// The keys' cache type alone, over --kv-dtype (llama.cpp's `-ctk`): e.g. `--cache-type-k
    /// f16 --cache-type-v q8_0` keeps keys, which hold outliers, in f16.
    #[arg(long, visible_alias = "ctk")]
    cache_type_k: Option<String>,
    /// The values' cache type alone, over --kv-dtype (llama.cpp's `-ctv`).
    #[arg(long, visible_alias = "ctv")]
    cache_type_v: Option<String>,
    /// Store quantized caches as they are, not Hadamard-rotated. By default, as llama.cpp
    /// (whose `LLAMA_ATTN_ROT_DISABLE=1` this is), keys and values of a block type are
    /// rotated per head before they are quantized, which spreads outlier channels over the
    /// block; attention is unchanged.
    #[arg(long)]
    no_kv_rotation: bool,
    /// On the CPU, use the GGUF weights exactly as stored (llama.cpp's numerics; less memory,
    /// slower) instead of dense prefill copies and Q8_0 copies of Q4_1/Q5_x.
    #[arg(long)]
    as_stored: bool,
    /// Memory keydiff may plan with on its device (e.g. 16G, 512MiB): host memory on the CPU,
    /// the GPU's memory on CUDA. Default: what there is (on the CPU what the system reports
    /// available, under the cgroup's limit and `ulimit -v`; on CUDA the device's free memory).
    /// CPU weight copies that do not fit are dropped, and a model or KV cache that cannot fit
    /// is refused with the numbers before it is allocated.
    #[arg(long, value_parser = parse_memory)]
    memory_limit: Option<u64>,
    /// Chunk attention: eager (materialised probabilities), flash (fused kernel: candle-nn's on
    /// the CPU, FlashAttention-2 on CUDA with the `flash-attn` feature) or auto (flash on CUDA
    /// in bf16/f16 when built with it and with its kernels for the model's head size, a
    /// multiple of 8 up to 256; else eager).
    #[arg(long, default_value = "auto")]
    attention: String,
    #[command(flatten)]
    rope: RopeArgs,
    #[command(flatten)]
    template: TemplateArgs,
}

/// The chat template and its variables, llama.cpp's flags.
#[derive(Args)]
struct TemplateArgs {
    /// A Jinja chat template to use in place of the model's: its text, or `chatml` or
    /// `llama3` (llama.cpp's built-ins of those names).
    #[arg(long, help_heading = "Chat template", value_name = "JINJA")]
    chat_template: Option<String>,
    /// The same, read from a file.
    #[arg(
        long,
        help_heading = "Chat template",
        value_name = "FILE",
        conflicts_with = "chat_template"
    )]
    chat_template_file: Option<PathBuf>,
    /// Variables for the chat template, a JSON object: e.g. '{"enable_thinking": false}'
    /// turns Qwen 3's thinking off.
    #[arg(long, help_heading = "Chat template", value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// Thinking allowed (llama.cpp's flag): -1 unrestricted, 0 none (the template gets
    /// `enable_thinking: false`, as Qwen 3's reads it).
    #[arg(
        long,
        help_heading = "Chat template",
        value_name = "N",
        allow_negative_numbers = true
    )]
    reasoning_budget: Option<i64>,
}

impl TemplateArgs {
    /// True when any of these flags is given: `run` then applies the chat template.
    fn given(&self) -> bool {
        self.chat_template.is_some()
            || self.chat_template_file.is_some()
            || self.chat_template_kwargs.is_some()
            || self.reasoning_budget.is_some()
    }

    /// The template given, if any, and the kwargs (empty without the flag).
    fn resolve(&self) -> Result<(Option<String>, keydiff::TemplateKwargs)> {
        let template = match (&self.chat_template, &self.chat_template_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(p)) => Some(
                std::fs::read_to_string(p)
                    .with_context(|| format!("--chat-template-file {}", p.display()))?,
            ),
            (None, None) => None,
        };
        let kwargs = match &self.chat_template_kwargs {
            None => keydiff::TemplateKwargs::new(),
            Some(s) => match serde_json::from_str(s) {
                Ok(serde_json::Value::Object(m)) => m,
                Ok(other) => bail!("--chat-template-kwargs must be a JSON object, not {other}"),
                Err(e) => bail!("--chat-template-kwargs is not JSON: {e}"),
            },
        };
        let mut kwargs = kwargs;
        match self.reasoning_budget {
            None | Some(-1) => {}
            Some(0) => match kwargs.get("enable_thinking") {
                Some(serde_json::Value::Bool(true)) => {
                    bail!("--reasoning-budget 0 contradicts `enable_thinking: true` in --chat-template-kwargs")
                }
                _ => {
                    kwargs.insert("enable_thinking".into(), false.into());
                }
            },
            Some(n) => bail!(
                "--reasoning-budget {n}: only -1 (unrestricted) and 0 (no thinking) are \
                 supported, as in llama.cpp"
            ),
        }
        Ok((template, kwargs))
    }
}

/// RoPE base and scaling, llama.cpp's flags: e.g. `--rope-scaling yarn --rope-scale 4
/// --yarn-orig-ctx 32768` takes Qwen 2.5 from 32K to 128K tokens of context, as its model card
/// asks. Without them the model's own settings (config.json's `rope_scaling`, GGUF's
/// `rope.scaling.*`) apply.
#[derive(Args)]
struct RopeArgs {
    /// RoPE scaling: none, linear or yarn (default: the model's; with --rope-scale alone, the
    /// model's type, or linear).
    #[arg(long, help_heading = "RoPE", value_name = "TYPE")]
    rope_scaling: Option<String>,
    /// RoPE scaling factor: the context grows by it (YaRN: from --yarn-orig-ctx).
    #[arg(long, help_heading = "RoPE", value_name = "F")]
    rope_scale: Option<f64>,
    /// RoPE base frequency (`rope_theta`; default: the model's).
    #[arg(long, help_heading = "RoPE", value_name = "BASE")]
    rope_freq_base: Option<f64>,
    /// YaRN: the context the model was trained for (default: the model's YaRN setting, else
    /// its context).
    #[arg(long, help_heading = "RoPE", value_name = "N")]
    yarn_orig_ctx: Option<usize>,
    /// YaRN: frequencies that turn more than this many times over the original context are
    /// kept (default 32).
    #[arg(long, help_heading = "RoPE", value_name = "N")]
    yarn_beta_fast: Option<f64>,
    /// YaRN: frequencies that turn fewer than this many times are fully interpolated
    /// (default 1).
    #[arg(long, help_heading = "RoPE", value_name = "N")]
    yarn_beta_slow: Option<f64>,
    /// YaRN: multiplies the attention factor 0.1 ln(factor) + 1 (default 1).
    #[arg(long, help_heading = "RoPE", value_name = "F")]
    yarn_attn_factor: Option<f64>,
}

impl RopeArgs {
    fn to_override(&self) -> Result<keydiff::RopeOverride> {
        let scaling = match &self.rope_scaling {
            Some(s) => Some(
                s.parse()
                    .map_err(|e: String| anyhow::anyhow!("--rope-scaling: {e}"))?,
            ),
            None => None,
        };
        Ok(keydiff::RopeOverride {
            scaling,
            factor: self.rope_scale,
            freq_base: self.rope_freq_base,
            original_context: self.yarn_orig_ctx,
            beta_fast: self.yarn_beta_fast,
            beta_slow: self.yarn_beta_slow,
            attn_factor: self.yarn_attn_factor,
        })
    }
}

impl LoadArgs {
    /// Loads the model under `cache` settings.
    fn load(&self, cache: CacheConfig) -> Result<Engine> {
        self.load_with(cache, None)
    }

    /// Loads the model under `cache` settings, with a context of `context` tokens (`None`:
    /// the model's).
    fn load_with(&self, cache: CacheConfig, context: Option<usize>) -> Result<Engine> {
        let source = if self.random_weights {
            let p = PathBuf::from(&self.model);
            let config = if p.exists() {
                p
            } else {
                PathBuf::from(format!("configs/{}.json", self.model))
            };
            if !config.exists() {
                bail!(
                    "preset `{}` not found (looked for {})",
                    self.model,
                    config.display()
                );
            }
            ModelSource::Random {
                config,
                seed: self.weight_seed,
                on_host: false,
                weights: self
                    .weight_type
                    .as_deref()
                    .map(keydiff::parse_weight_type)
                    .transpose()?,
            }
        } else {
            if let Some(t) = &self.weight_type {
                bail!(
                    "--weight-type {t} applies to --random-weights only (a model file's weights \
                     are of the types it stores)"
                );
            }
            ModelSource::parse(&self.model)?
        };
        let device = parse_device(&self.device)?;
        let dtype = parse_dtype(&self.dtype)?;
        let both = self.kv_dtype.as_deref().map(parse_kv_dtype).transpose()?;
        let (k, v) = (
            self.cache_type_k
                .as_deref()
                .map(parse_kv_dtype)
                .transpose()?,
            self.cache_type_v
                .as_deref()
                .map(parse_kv_dtype)
                .transpose()?,
        );
        let kv_dtype = match (k, v) {
            (None, None) => both.map(KvTypes::from),
            (k, v) => {
                let base = both.unwrap_or(dtype.into());
                Some(KvTypes {
                    k: k.unwrap_or(base),
                    v: v.unwrap_or(base),
                })
            }
        };
        let (chat_template, chat_template_kwargs) = self.template.resolve()?;
        let cfg = EngineConfig {
            cpu_weights: if self.as_stored {
                CpuWeights::AS_STORED
            } else {
                CpuWeights::FAST
            },
            attention: self.attention.parse()?,
            device,
            dtype,
            kv_dtype,
            kv_rotation: !self.no_kv_rotation,
            cache,
            memory_limit: self.memory_limit,
            rope: self.rope.to_override()?,
            chat_template,
            chat_template_kwargs,
            context,
            // `bench ttft --eviction per-layer` sets it per case.
            evict_per_layer: false,
        };
        // A setting that cannot be (the cache's, the context's, the chat template's) is
        // reported as it is; anything else failed loading the model.
        let engine = Engine::load(&source, &cfg).map_err(|e| match e {
            keydiff::EngineError::BadParams(_) => anyhow::Error::new(e),
            e => anyhow::Error::new(e).context(format!("cannot load model `{}`", self.model)),
        })?;
        if self.random_weights {
            eprintln!("note: random weights: the generated text is meaningless by design");
        }
        Ok(engine)
    }
}

/// Policy parameters shared by `run` and the benchmarks.
#[derive(Args, Clone)]
struct PolicyArgs {
    /// Share of the budget reserved for the most recent tokens (KeyDiff + window: 0.2). H2O
    /// reserves 0.5 unless this is set (its reference's heavy:recent = 1:1); SnapKV at least
    /// its observation window.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    window: f64,
    /// First positions never evicted.
    #[arg(long, default_value_t = 0)]
    sinks: usize,
    /// SnapKV observation window W (SnapKV reference default).
    #[arg(long, default_value_t = keydiff::SNAPKV_WINDOW)]
    snap_window: usize,
    /// Decode evicts once N + K slots are used (default K = B; 1 = per-token eviction).
    #[arg(long)]
    evict_every: Option<usize>,
    /// Seed of the `random` policy.
    #[arg(long, default_value_t = 0)]
    policy_seed: u64,
}

impl PolicyArgs {
    fn policy(&self, name: &str) -> Result<PolicyKind> {
        Ok(PolicyKind::parse(name, self.snap_window, self.policy_seed)?)
    }

    fn cache(&self, name: &str, budget: Option<usize>, chunk: usize) -> Result<CacheConfig> {
        Ok(CacheConfig {
            policy: self.policy(name)?,
            budget,
            chunk,
            window: self.window,
            sinks: self.sinks,
            evict_every: self.evict_every,
        })
    }
}

#[derive(Args)]
struct ModelArgs {
    #[command(flatten)]
    load: LoadArgs,
    /// Prefill chunk size B.
    #[arg(long, default_value_t = DEFAULT_CHUNK)]
    chunk: usize,
    /// KV budget N: slots per layer and KV head kept after each eviction (needs a policy other
    /// than full).
    #[arg(long)]
    budget: Option<usize>,
    /// Eviction policy: full, keydiff, keydiff-mean, tova, tova-per-head, snapkv, h2o,
    /// h2o-normalized, sink, knorm, random. Default: keydiff with --budget, else full.
    #[arg(long)]
    policy: Option<String>,
    #[command(flatten)]
    policy_args: PolicyArgs,
}

impl ModelArgs {
    fn cache_config(&self) -> Result<CacheConfig> {
        let name = match (&self.policy, self.budget) {
            (Some(p), _) => p.as_str(),
            (None, Some(_)) => "keydiff",
            (None, None) => "full",
        };
        let cfg = self.policy_args.cache(name, self.budget, self.chunk)?;
        // Settings the policy never reads: said, not silently dropped.
        let p = &self.policy_args;
        let mut unused = vec![];
        if cfg.budget.is_none() {
            (p.window != 0.0).then(|| unused.push("--window"));
            (p.sinks != 0).then(|| unused.push("--sinks"));
            p.evict_every
                .is_some()
                .then(|| unused.push("--evict-every"));
        }
        let snapkv = matches!(cfg.policy, PolicyKind::SnapKv { .. });
        (!snapkv && p.snap_window != keydiff::SNAPKV_WINDOW).then(|| unused.push("--snap-window"));
        let random = matches!(cfg.policy, PolicyKind::Random { .. });
        (!random && p.policy_seed != 0).then(|| unused.push("--policy-seed"));
        if !unused.is_empty() {
            eprintln!(
                "warning: {} {} no effect under policy `{}`{}",
                unused.join(", "),
                if unused.len() == 1 { "has" } else { "have" },
                cfg.policy.name(),
                if cfg.budget.is_none() {
                    " (no --budget: nothing is evicted)"
                } else {
                    ""
                }
            );
        }
        Ok(cfg)
    }

    fn load(&self) -> Result<Engine> {
        self.load.load(self.cache_config()?)
    }

    /// [`ModelArgs::load`] with `-c/--ctx-size`.
    fn load_in(&self, ctx: &ContextArgs) -> Result<Engine> {
        self.load.load_with(self.cache_config()?, ctx.ctx_size)
    }
}

/// The context to run with (`run`, `chat`, `serve`).
#[derive(Args)]
struct ContextArgs {
    /// Context size in tokens, prompt and output together (llama.cpp's -c, vLLM's
    /// --max-model-len): at most the model's (with its RoPE scaling); 0: the model's. Longer
    /// prompts are refused, generation stops there, and a full cache never takes more.
    #[arg(short = 'c', long, value_name = "N", allow_negative_numbers = true)]
    ctx_size: Option<usize>,
}

/// llama.cpp's escapes in text given on the command line.
#[derive(Args)]
struct EscapeArgs {
    /// Take the text of -p, --stop and --suffix (those this command has) as written: by
    /// default their escapes (\n, \r, \t, \\, \", \', \xHH) are read, as llama.cpp reads
    /// them. A file (-f) and stdin are never changed.
    #[arg(long)]
    no_escape: bool,
    /// llama.cpp's -e: escapes are read (the default).
    #[arg(
        short = 'e',
        long = "escape",
        hide = true,
        conflicts_with = "no_escape"
    )]
    _escape: bool,
}

impl EscapeArgs {
    /// `text` with its escapes read, unless --no-escape.
    fn apply(&self, text: &str) -> String {
        if self.no_escape {
            text.to_string()
        } else {
            unescape(text)
        }
    }
}

/// llama.cpp's `string_process_escapes`: `\n`, `\r`, `\t`, `\\`, `\"`, `\'` and `\xHH`
/// (ASCII only here, so that the text stays UTF-8) become the characters; any other
/// backslash stays as written.
fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let read = match chars.peek() {
            Some('n') => Some('\n'),
            Some('r') => Some('\r'),
            Some('t') => Some('\t'),
            Some('\\') => Some('\\'),
            Some('"') => Some('"'),
            Some('\'') => Some('\''),
            Some('x') => {
                let hex: String = chars.clone().skip(1).take(2).collect();
                match u8::from_str_radix(&hex, 16) {
                    Ok(b)
                        if hex.len() == 2
                            && hex.chars().all(|h| h.is_ascii_hexdigit())
                            && b.is_ascii() =>
                    {
                        chars.next();
                        chars.next();
                        Some(b as char)
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        match read {
            Some(r) => {
                chars.next();
                out.push(r);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// Stop strings as given: an empty one is refused (it would stop before anything).
fn stop_strings(stops: &[String], esc: &EscapeArgs) -> Result<Vec<String>> {
    stops
        .iter()
        .map(|s| match esc.apply(s) {
            s if s.is_empty() => bail!("--stop must not be empty"),
            s => Ok(s),
        })
        .collect()
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    ctx: ContextArgs,
    /// Prompt text (without -p or -f, the prompt is read from stdin).
    #[arg(short = 'p', long, conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the prompt from a file (one line break at its end left out, as llama.cpp does).
    #[arg(short = 'f', long)]
    file: Option<PathBuf>,
    #[command(flatten)]
    escape: EscapeArgs,
    /// Read the prompt as token ids (a JSON array) from a file, e.g. to feed two engines the
    /// very same ids in a benchmark.
    #[arg(long, conflicts_with_all = ["prompt", "file", "chat", "system"])]
    prompt_tokens: Option<PathBuf>,
    /// Read special-token text in the prompt as the special tokens (`<|im_start|>` as one
    /// token), as llama-cli and Hugging Face's tokenizers do; by default it is plain text, as
    /// in every text prompt of this engine (a chat's template text is always parsed).
    #[arg(long, conflicts_with_all = ["chat", "system", "suffix", "tools", "prompt_tokens"])]
    parse_special: bool,
    /// Do not stop at end-of-generation tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Tokens to generate at most; -1: until end of generation or the context (llama.cpp's).
    #[arg(short = 'n', long, default_value = "256", value_parser = count_or_all,
        allow_negative_numbers = true)]
    max_tokens: usize,
    /// Wrap the prompt in the model's chat template (implied by --system, --tools and the
    /// chat template flags).
    #[arg(long)]
    chat: bool,
    /// System message (implies --chat).
    #[arg(long)]
    system: Option<String>,
    /// Fill in the middle: the prompt is the text before the hole, this the text after it,
    /// and the model writes the hole with its FIM tokens (llama.cpp's infill; code models
    /// such as Qwen2.5-Coder).
    #[arg(long, conflicts_with_all = ["chat", "system", "prompt_tokens"])]
    suffix: Option<String>,
    /// Functions the model may call: a JSON file with OpenAI's `tools` array (implies
    /// --chat). The model's template renders them; its calls are read from the reply and
    /// printed (with --json, as OpenAI's `tool_calls`).
    #[arg(long, conflicts_with_all = ["suffix", "prompt_tokens"])]
    tools: Option<PathBuf>,
    /// With --tools: auto (text, or calls once one starts), required (calls only), none
    /// (text; the tools are only rendered), or a function's name (one call to it).
    #[arg(long, default_value = "auto", requires = "tools")]
    tool_choice: String,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// Stop when this string is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print the final stats as one JSON object on stdout instead of the timing line.
    #[arg(long)]
    json: bool,
    /// Add each generated token's log-probability (the model's, before sampling) and its K
    /// most likely alternatives to the JSON output (K at most 20).
    #[arg(long, value_name = "K", requires = "json")]
    logprobs: Option<usize>,
    /// Break prefill time down by region (attention, statistics, eviction, MLP). Synchronises
    /// the device at every region boundary, which slows GPU runs.
    #[arg(long)]
    profile: bool,
    /// Keep the prompt's KV cache in this file and start from it (llama.cpp's flag): a later
    /// run whose prompt extends the saved one prefills only what it adds. Made when missing;
    /// a file made with another model, cache dtype or cache settings is refused.
    #[arg(long, value_name = "FILE")]
    prompt_cache: Option<PathBuf>,
    /// With --prompt-cache: save the reply's cache too (llama.cpp's flag), for a next prompt
    /// that extends this prompt and its reply.
    #[arg(long, requires = "prompt_cache")]
    prompt_cache_all: bool,
    /// With --prompt-cache: start from the file but leave it as it is (llama.cpp's flag).
    #[arg(long, requires = "prompt_cache", conflicts_with = "prompt_cache_all")]
    prompt_cache_ro: bool,
    /// With --prompt-cache: `continue` (default) goes on from the whole saved cache, evicted
    /// or not, when the prompt extends what it holds (as `keydiff chat` goes on); `exact`
    /// reuses only what gives a fresh run's result (whole chunks, never an evicted cache).
    #[arg(long, value_name = "MODE", requires = "prompt_cache")]
    prompt_cache_reuse: Option<String>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a terminal (and not under NO_COLOR): a log file gets plain text.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
    if let Err(e) = real_main() {
        let text = format!("{e:#}");
        eprintln!("error: {text}");
        if let Some(hint) = keydiff::cuda_error_hint(&text) {
            eprintln!("hint: {hint}");
        }
        std::process::exit(1);
    }
}

/// A closed pipe on stdout (`keydiff run ... | head`) ends the process quietly, as it ends
/// llama.cpp's tools and every C filter, instead of a panic from `println!` (Rust ignores
/// SIGPIPE) and a generation that goes on for no reader. The server keeps ignoring it: a
/// client that hangs up must not end it.
fn die_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: called at start-up, before any thread exists; sets the default disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// llama.cpp's flags of several letters after one dash (`-ctk`, `-fa`, `-ngl`), which clap
/// would read as clusters of one-letter flags (`-ctk f16` as `-c tk`): those keydiff has are
/// rewritten to its names, those it has no use for are refused, saying why.
fn llama_cpp_flags(args: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>> {
    let mut out = Vec::with_capacity(args.len());
    let command = args.get(1).and_then(|c| c.to_str()).map(str::to_string);
    let chat = command.as_deref() == Some("chat");
    let mut it = args.into_iter().peekable();
    while let Some(a) = it.next() {
        let Some(flag) = a.to_str() else {
            out.push(a);
            continue;
        };
        let to = match flag {
            // `keydiff chat` is the conversation mode.
            "-cnv" | "--conversation" if chat => continue,
            "-mli" | "--multiline-input" => bail!(
                "{flag}: keydiff reads one message per line; end a line with \\ to go on \
                 to the next"
            ),
            // The system message from a file.
            "-sysf" | "--system-prompt-file" => {
                let Some(path) = it.next() else {
                    bail!("{flag} needs a file");
                };
                let text = read_text_file(std::path::Path::new(&path), "system message")?;
                out.push("--system".into());
                out.push(text.into());
                continue;
            }
            // llama.cpp's draft model (`-md` would read as `-m d`).
            f if ["-md", "--model-draft", "-hfd", "-hfrd", "--hf-repo-draft"].contains(&f)
                || f.starts_with("--model-draft=") =>
            {
                bail!(
                    "{flag}: keydiff has no draft-model speculative decoding; its drafts come \
                     from the text itself (--spec-type ngram, llama.cpp's prompt lookup)"
                )
            }
            "-ctk" => "--cache-type-k",
            "-ctv" => "--cache-type-v",
            "-sys" => "--system",
            "-hf" | "-hfr" => "--model",
            "-dev" => "--device",
            "-np" | "--parallel" if command.as_deref() == Some("serve") => "--max-batch",
            "-np" | "--parallel" => bail!(
                "{flag} is the server's number of requests run together: `keydiff serve \
                 --max-batch N` (llama-server's -np)"
            ),
            // Plain completion: what `run` does unless told --chat.
            "-no-cnv" => continue,
            // `-fa [on|off|auto]`, or alone (older llama.cpp): on.
            "-fa" | "--flash-attn" => {
                let value = match it.peek().and_then(|v| v.to_str()) {
                    Some("on" | "1" | "true") => Some("flash"),
                    Some("off" | "0" | "false") => Some("eager"),
                    Some("auto") => Some("auto"),
                    _ => None,
                };
                if value.is_some() {
                    it.next();
                }
                out.push("--attention".into());
                out.push(value.unwrap_or("flash").into());
                continue;
            }
            "-cnv" | "--conversation" => bail!(
                "{flag} is llama-cli's conversation mode: `keydiff chat` is keydiff's (one \
                 user message per line of stdin)"
            ),
            "-ngl" | "--n-gpu-layers" | "--gpu-layers" | "-ts" | "--tensor-split" | "-sm"
            | "--split-mode" | "-mg" | "--main-gpu" | "-nkvo" | "--no-kv-offload" => bail!(
                "{flag} (llama.cpp's layer offload) has no equivalent: keydiff runs the whole \
                 model and its KV cache on --device (cpu, cuda or cuda:N)"
            ),
            _ => {
                out.push(a);
                continue;
            }
        };
        out.push(to.into());
    }
    Ok(out)
}

fn real_main() -> Result<()> {
    let cli = Cli::parse_from(llama_cpp_flags(std::env::args_os().collect())?);
    if !matches!(cli.cmd, Cmd::Serve(_)) {
        die_on_closed_stdout();
    }
    match cli.cmd {
        Cmd::Run(a) => run(*a),
        Cmd::Bench(b) => bench::bench(b),
        Cmd::Eval(a) => eval::eval(a),
        Cmd::Tokenize {
            mut model,
            prompt,
            file,
            special,
            escape,
        } => {
            let prompt = match (prompt, file) {
                (Some(p), _) => escape.apply(&p),
                (None, Some(f)) => read_text_file(&f, "text")?,
                (None, None) => {
                    let mut s = String::new();
                    std::io::stdin()
                        .read_to_string(&mut s)
                        .context("cannot read the text from stdin")?;
                    s
                }
            };
            // Only the tokenizer is used: no dense copies of the weights.
            model.load.as_stored = true;
            let engine = model.load()?;
            let ids = engine.tokenize(&prompt, special)?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
        Cmd::Info { model } => info(&model),
        Cmd::Devices { json } => devices(json),
        Cmd::Perplexity(a) => perplexity(&a),
        Cmd::Chat(a) => chat(&a),
        Cmd::Serve(a) => serve(&a),
        Cmd::CheckDevice {
            device,
            dtype,
            kv_dtype,
            attention,
            preset,
            prompt_len,
            chunk,
            decode_steps,
            seed,
            budget,
            weight_type,
            policies,
            perplexity,
            batch,
        } => {
            let dev = parse_device(&device)?;
            let weights = weight_type
                .as_deref()
                .map(keydiff::parse_weight_type)
                .transpose()?;
            let dt = parse_dtype(&dtype)?;
            let kv_dt = kv_dtype
                .as_deref()
                .map(parse_kv_dtype)
                .transpose()?
                .map(KvTypes::from);
            let attention: AttentionBackend = attention.parse()?;
            if batch {
                let cfg = EngineConfig {
                    device: dev,
                    dtype: dt,
                    kv_dtype: kv_dt,
                    cache: CacheConfig::full(16),
                    cpu_weights: CpuWeights::FAST,
                    attention,
                    memory_limit: None,
                    ..Default::default()
                };
                return check_batch(&cfg, &preset, &policies, (seed, weights), (&device, &dtype));
            }
            let mut caches = vec![CacheConfig::full(chunk)];
            if let Some(n) = budget {
                for p in &policies {
                    caches.push(CacheConfig {
                        policy: PolicyKind::parse(p, keydiff::SNAPKV_WINDOW, seed)?,
                        budget: Some(n),
                        chunk,
                        window: 0.0,
                        sinks: 0,
                        evict_every: None,
                    });
                }
            }
            // Block types stay as they are in the reference (see `kv_dtype`'s help).
            let twin = |t: KvType| match t.block_bytes() {
                Some(_) => t,
                None => keydiff::DType::F32.into(),
            };
            let reference_kv = kv_dt.map(|t| KvTypes {
                k: twin(t.k),
                v: twin(t.v),
            });
            let mut failed = Vec::new();
            for p in &preset {
                for cache in &caches {
                    let reference = EngineConfig {
                        device: keydiff::Device::Cpu,
                        dtype: keydiff::DType::F32,
                        kv_dtype: reference_kv,
                        cache: cache.clone(),
                        // Quantized weights: the device's blocks as they are (no Q8_0 copies
                        // of Q4_1/Q5_x), multiplied exactly where dense copies are kept.
                        cpu_weights: if weights.is_some() {
                            CpuWeights {
                                dense_prefill: true,
                                requantize_slow: false,
                            }
                        } else {
                            CpuWeights::FAST
                        },
                        attention: AttentionBackend::Eager,
                        memory_limit: None,
                        ..Default::default()
                    };
                    let other = EngineConfig {
                        device: dev.clone(),
                        dtype: dt,
                        kv_dtype: kv_dt,
                        cache: cache.clone(),
                        cpu_weights: CpuWeights::FAST,
                        attention,
                        memory_limit: None,
                        ..Default::default()
                    };
                    let (d, used) = keydiff::parity::compare_devices_decoding(
                        p,
                        seed,
                        weights,
                        &reference,
                        &other,
                        prompt_len,
                        decode_steps,
                    )
                    .with_context(|| format!("preset {}", p.display()))?;
                    let nll = if perplexity {
                        Some(
                            keydiff::parity::compare_device_perplexity(
                                p, seed, weights, &reference, &other, prompt_len,
                            )
                            .with_context(|| format!("perplexity, preset {}", p.display()))?,
                        )
                    } else {
                        None
                    };
                    let v = serde_json::json!({
                        "preset": p.display().to_string(), "device": device, "dtype": dtype,
                        "kv_dtype": kv_dt.unwrap_or(dt.into()).to_string(),
                        "reference_kv_dtype": reference_kv
                            .unwrap_or(keydiff::DType::F32.into())
                            .to_string(),
                        "attention": used.name(),
                        "weights": weights.map(keydiff::weight_type_name),
                        "policy": cache.policy.name(), "budget": cache.budget,
                        "prompt_len": prompt_len, "chunk": chunk,
                        "decode_steps": decode_steps, "diff": d,
                        "top1_equal": d.top1_equal(), "nll": nll,
                    });
                    println!("{v}");
                    let nll_bad = nll.as_ref().is_some_and(|n| {
                        n.correlation.is_nan()
                            || n.correlation < MIN_NLL_CORRELATION
                            || !n
                                .logprobs_max_abs
                                .is_some_and(|d| d <= MAX_LOGPROB_NLL_DIFF)
                    });
                    // NaN logits give a NaN cosine, which `cosine < MIN` would let through.
                    if !d.cosine_at_least(MIN_DEVICE_COSINE) || nll_bad {
                        failed.push(format!("{} {}", p.display(), cache.policy.name()));
                    }
                }
            }
            if !failed.is_empty() {
                bail!(
                    "logits differ from the CPU (cosine < {MIN_DEVICE_COSINE}, NLL \
                     correlation < {MIN_NLL_CORRELATION}, or prompt logprobs further than \
                     {MAX_LOGPROB_NLL_DIFF} from the NLLs) on: {}",
                    failed.join(", ")
                );
            }
            Ok(())
        }
        Cmd::CheckKernels {
            device,
            large,
            seed,
            time_n,
            time_kv_heads,
            time_head_dim,
            time_dtype,
            time_chunk,
            time_layers,
            reps,
        } => check_kernels(
            &device,
            large,
            seed,
            (&time_n, &time_layers),
            (time_kv_heads, time_head_dim, &time_dtype, time_chunk),
            reps,
        ),
    }
}

/// `keydiff check-kernels`.
fn check_kernels(
    device: &str,
    large: bool,
    seed: u64,
    (time_n, time_layers): (&[usize], &[usize]),
    (kv, head_dim, dtype, chunk): (usize, usize, &str, usize),
    reps: usize,
) -> Result<()> {
    use keydiff::kernel_check::{
        copy_bandwidth, kernel_cases, kernel_parity, kernel_timing, launch_floor_us,
    };
    let dev = parse_device(device)?;
    let mut failed = Vec::new();
    eprintln!(
        "{:5} {:>3} {:>7} {:>4} {:>7} {:>10} {:>10} {:>11} {:>6} {:>9} {:>5} {:>9} {:>5}",
        "dtype",
        "kv",
        "n",
        "d",
        "N",
        "err(ref)",
        "err(twin)",
        "err(scalar)",
        "plans",
        "e2e diff",
        "moves",
        "snapkv",
        "pass"
    );
    for (i, c) in kernel_cases(large).iter().enumerate() {
        let r = kernel_parity(&dev, c, seed + i as u64)
            .with_context(|| format!("parity case {c:?}"))?;
        eprintln!(
            "{:5} {:>3} {:>7} {:>4} {:>7} {:>10.2e} {:>10.2e} {:>11.2e} {:>6} {:>9} {:>5} {:>9.1e} {:>5}",
            r.dtype,
            r.kv_heads,
            r.n,
            r.head_dim,
            r.budget,
            r.score_max_abs_vs_reference,
            r.score_max_abs_vs_twin,
            r.score_max_abs_scalar_vs_twin,
            if r.plan_heads_differing
                + r.plan_heads_differing_many
                + r.plan_heads_differing_few.unwrap_or(0)
                == 0
            {
                "same"
            } else {
                "DIFF"
            },
            format!(
                "{}{}",
                r.end_to_end_slots_differing,
                if r.end_to_end_ties_only { "" } else { "!" }
            ),
            if r.moves_equal { "same" } else { "DIFF" },
            r.snapkv_pool_max_abs,
            if r.pass { "ok" } else { "FAIL" },
        );
        if !r.pass {
            failed.push(format!("{c:?}"));
        }
        let mut v = serde_json::to_value(&r)?;
        v["kind"] = "parity".into();
        println!("{v}");
    }
    // The cache codecs (block types and fp8): the device's bytes and values against the CPU's.
    eprintln!(
        "{:6} {:5} {:>3} {:>7} {:>4} {:>14} {:>11} {:>10} {:>5}",
        "cache", "dtype", "kv", "n", "d", "bytes differ", "decode err", "as dtype", "pass"
    );
    for (i, c) in keydiff::kernel_check::codec_cases().into_iter().enumerate() {
        let r = keydiff::kernel_check::codec_parity(&dev, c, seed + 1000 + i as u64)
            .with_context(|| format!("codec case {} {:?}", c.0, c.1))?;
        eprintln!(
            "{:6} {:5} {:>3} {:>7} {:>4} {:>14} {:>11.1e} {:>10} {:>5}",
            r.kv_type,
            r.dtype,
            r.kv_heads,
            r.n,
            r.head_dim,
            format!("{}/{}", r.bytes_differing, r.bytes),
            r.decoded_max_abs,
            r.decoded_as_differing,
            if r.pass { "ok" } else { "FAIL" },
        );
        if !r.pass {
            failed.push(format!("codec {} {}", r.kv_type, r.dtype));
        }
        let mut v = serde_json::to_value(&r)?;
        v["kind"] = "codec".into();
        println!("{v}");
    }
    // A decode step's attention by the decode kernels (float caches, and quantized ones read
    // in place) against the eager path on the CPU over the CPU codec's cache.
    eprintln!(
        "decode kernels vs the CPU:    {:6} {:5} {:>3} {:>2} {:>4} {:>5} {:>9} {:>9} {:>5}",
        "cache", "q", "kv", "g", "d", "keys", "max |Δ|", "tol", "pass"
    );
    for (i, c) in keydiff::kernel_check::decode_cases(&dev)
        .into_iter()
        .enumerate()
    {
        let r = keydiff::kernel_check::decode_parity(&dev, c, seed + 2000 + i as u64)
            .with_context(|| format!("decode case {} {:?} {:?}", c.0, c.1, c.2))?;
        eprintln!(
            "                              {:6} {:5} {:>3} {:>2} {:>4} {:>5} {:>9.2e} {:>9.2e} {:>5}",
            r.kv_type,
            r.dtype,
            r.kv_heads,
            r.group,
            r.head_dim,
            r.keys,
            r.max_abs,
            r.tolerance,
            if r.pass {
                "ok"
            } else if r.ran {
                "FAIL"
            } else {
                "NOT RUN"
            },
        );
        if !r.pass {
            failed.push(format!("decode {} {} d {}", r.kv_type, r.dtype, r.head_dim));
        }
        let mut v = serde_json::to_value(&r)?;
        v["kind"] = "decode".into();
        println!("{v}");
    }
    // Greedy sampling where the logits are, against the host sampler's argmax.
    eprintln!(
        "greedy tokens vs the host:    {:5} {:>4} {:>7} {:>7} {:>9} {:>5}",
        "dtype", "rows", "vocab", "view", "differ", "pass"
    );
    for (i, c) in keydiff::kernel_check::greedy_cases()
        .into_iter()
        .enumerate()
    {
        let r = keydiff::kernel_check::greedy_parity(&dev, c, seed + 3000 + i as u64)
            .with_context(|| format!("greedy case {c:?}"))?;
        eprintln!(
            "                              {:5} {:>4} {:>7} {:>7} {:>9} {:>5}",
            r.dtype,
            r.rows,
            r.vocab,
            if r.strided { "strided" } else { "rows" },
            r.rows_differing,
            if r.pass { "ok" } else { "FAIL" },
        );
        if !r.pass {
            failed.push(format!("greedy {} {}x{}", r.dtype, r.rows, r.vocab));
        }
        let mut v = serde_json::to_value(&r)?;
        v["kind"] = "greedy".into();
        println!("{v}");
    }
    // Sampling where the logits are, against the host sampler's draw.
    eprintln!(
        "sampled tokens vs the host:   {:5} {:>4} {:>7} {:>7} {:>9} {:>5} {:>5}",
        "dtype", "rows", "vocab", "view", "differ", "near", "pass"
    );
    for (i, c) in keydiff::kernel_check::sample_cases()
        .into_iter()
        .enumerate()
    {
        let r = keydiff::kernel_check::sample_parity(&dev, c, seed + 4000 + i as u64)
            .with_context(|| format!("sampling case {c:?}"))?;
        eprintln!(
            "                              {:5} {:>4} {:>7} {:>7} {:>9} {:>5} {:>5}",
            r.dtype,
            r.rows,
            r.vocab,
            if r.strided { "strided" } else { "rows" },
            r.rows_differing,
            r.rows_near,
            match (r.ran, r.pass) {
                (false, _) => "host",
                (true, true) => "ok",
                (true, false) => "FAIL",
            },
        );
        if !r.pass {
            failed.push(format!("sampled {} {}x{}", r.dtype, r.rows, r.vocab));
        }
        let mut v = serde_json::to_value(&r)?;
        v["kind"] = "sampled".into();
        println!("{v}");
    }
    if !time_n.is_empty() {
        let dt = parse_dtype(dtype)?;
        let copy = copy_bandwidth(&dev)?;
        eprintln!("copy bandwidth (read + write): {copy:.1} GB/s");
        let floor = launch_floor_us(&dev, 500)?;
        eprintln!(
            "launch floor: {floor:.2} us per op (500 one-element ops back to back); an \
             eviction runs about a dozen ops"
        );
        println!(
            "{}",
            serde_json::json!({"kind": "launch_floor", "device": format!("{dev:?}"), "us_per_op": floor, "ops": 500})
        );
        if time_layers.contains(&0) {
            bail!("--time-layers: a layer count is at least 1");
        }
        eprintln!(
            "{:>5} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7}",
            "heads",
            "n",
            "N",
            "moves",
            "score us",
            "select us",
            "move us",
            "sum us",
            "evict us",
            "GB/s",
            "% copy"
        );
        use keydiff::kernel_check::{ScoreLoads, SelectBlocks, VECTOR_HEAD_DIMS};
        // Every way of splitting the selection (with the engine's loads) and both ways of
        // reading the keys (with the engine's split), in the same run: the engine's `Auto`
        // picks by n, evictions and the view alone, and this is what shows whether it picks
        // well. A row's score, select and move times are apart, so the splits compare on the
        // select column and the loads on the score column. On the CPU every variant is the
        // same twin: it is timed once.
        let mut variants = Vec::new();
        if !dev.is_cuda() {
            variants.push((SelectBlocks::Auto, ScoreLoads::Auto));
        } else {
            let vector = VECTOR_HEAD_DIMS.contains(&head_dim);
            if !vector {
                eprintln!("(no 16-byte scoring kernels for head dim {head_dim}: not timed)");
            }
            let loads = if vector {
                ScoreLoads::Vector
            } else {
                ScoreLoads::Scalar
            };
            for blocks in [SelectBlocks::One, SelectBlocks::Many, SelectBlocks::Few] {
                variants.push((blocks, loads));
            }
            if vector {
                variants.push((SelectBlocks::Auto, ScoreLoads::Scalar));
            }
        }
        for (&layers, &n) in time_layers
            .iter()
            .flat_map(|l| time_n.iter().map(move |n| (l, n)))
        {
            if n <= chunk {
                bail!("--time-n {n} must exceed --time-chunk {chunk}");
            }
            let c = keydiff::kernel_check::KernelCase {
                kv_heads: kv * layers,
                n,
                head_dim,
                dtype: dt,
                budget: n - chunk,
                sinks: 0,
                recent: 0,
                anchor: keydiff::Anchor::Normalized,
            };
            for &(blocks, loads) in &variants {
                if blocks == SelectBlocks::Few
                    && !keydiff::kernel_check::select_few_fits(c.n, c.budget, c.recent)
                {
                    eprintln!(
                        "({}: {} evictions of {} are too many for one launch: not timed)",
                        blocks.name(),
                        n - c.budget,
                        n
                    );
                    continue;
                }
                let t = kernel_timing(&dev, &c, reps, copy, blocks, loads)?;
                eprintln!(
                    "{:>5} {:>7} {:>7} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.1} {:>6.1}%  {}",
                    t.kv_heads,
                    t.n,
                    t.budget,
                    t.moves,
                    t.score_us,
                    t.select_us,
                    t.move_us,
                    t.total_us,
                    t.eviction_us,
                    t.gb_per_s,
                    t.percent_of_copy,
                    if t.select_blocks == t.score_loads {
                        t.select_blocks.clone()
                    } else {
                        format!("{}, {}", t.select_blocks, t.score_loads)
                    }
                );
                let mut v = serde_json::to_value(&t)?;
                v["kind"] = "timing".into();
                v["layers"] = layers.into();
                println!("{v}");
            }
        }
    }
    if !failed.is_empty() {
        bail!("kernel parity failed on: {}", failed.join("; "));
    }
    Ok(())
}

#[derive(Args)]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text (or -f FILE).
    #[arg(short = 'p', long, conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the text from a file (one line break at its end left out, as llama.cpp does).
    #[arg(short = 'f', long)]
    file: Option<PathBuf>,
    /// Score only the first N tokens (the run says so).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Score the text in windows of W tokens, each prefilled afresh under the cache settings
    /// (named as llama-perplexity's -c). Default: the whole text in one window, or, for a
    /// text beyond the model's context, windows of the context.
    #[arg(short = 'c', long, value_name = "W")]
    ctx_size: Option<usize>,
    /// Windows start S tokens apart; each scores only the tokens no earlier window scored,
    /// so every token beyond the first window has at least W − S tokens before it
    /// (Hugging Face's strided perplexity). 1 ≤ S < W; needs -c; default W / 2.
    #[arg(long, value_name = "S", requires = "ctx_size")]
    stride: Option<usize>,
    /// Print one JSON object instead of the summary line.
    #[arg(long)]
    json: bool,
}

/// A `-f` file's text, without the line break that ends it, as llama.cpp reads `-f` (an
/// editor ends every file with one; the prompt does not end there).
fn read_text_file(path: &Path, what: &str) -> Result<String> {
    let mut text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {what} file {}", path.display()))?;
    if text.ends_with('\n') {
        text.pop();
    }
    Ok(text)
}

fn perplexity(a: &PplArgs) -> Result<()> {
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_text_file(f, "text")?,
        (None, None) => bail!("give the text with -p TEXT or -f FILE"),
    };
    if a.max_tokens == Some(0) {
        bail!("invalid parameter: --max-tokens must be at least 2");
    }
    let engine = a.model.load()?;
    let mut tokens = engine.tokenize(&text, false)?;
    let total = tokens.len();
    if let Some(n) = a.max_tokens {
        tokens.truncate(n);
    }
    let context = engine.model_config().context();
    let window = a.ctx_size.unwrap_or(context.min(tokens.len()));
    let stride = a.stride.unwrap_or((window / 2).max(1));
    let r = engine.perplexity_windowed(&tokens, window, stride)?;
    let windowed = r.windows > 1;
    if windowed && a.ctx_size.is_none() {
        tracing::info!(
            "the text's {} tokens are beyond the model's context of {context}: scored in windows \
             of {window}, {stride} apart",
            tokens.len()
        );
    }
    let cache = engine.config().cache.clone();
    let quarters = r.ppl_by_part(4);
    if a.json {
        let v = serde_json::json!({
            "ppl": r.ppl(), "mean_nll": r.mean_nll(..), "nll_stderr": r.nll_stderr(),
            "ppl_by_quarter": quarters, "tokens": tokens.len(), "text_tokens": total,
            "scored": r.nll.len(), "ctx_size": window, "stride": windowed.then_some(stride),
            "windows": r.windows, "policy": cache.policy.name(), "budget": cache.budget,
            "chunk": cache.chunk, "window": cache.window, "sinks": cache.sinks,
            "evictions": r.evictions, "evicted_slots": r.evicted_slots,
            "peak_kv_bytes": r.peak_kv_bytes, "seconds": r.seconds,
            "model": engine.origin(), "dtype": engine.config().dtype.as_str(),
            "kv_dtype": engine.config().kv_dtype.map(|d| d.to_string()),
            "kv_rotated": engine.kv_rotated(),
            "cpu_weights": engine.cpu_weights().map(|c| c.describe()),
            "provenance": keydiff::bench::Provenance::collect(
                &engine,
                a.model.load.random_weights,
                bench::command_line(),
            ),
        });
        println!("{v}");
    } else {
        // Undefined (NaN: one scored token's error, a quarter with no token): `n/a`.
        let num = |x: f64, digits: usize| match x.is_nan() {
            true => "n/a".to_string(),
            false => format!("{x:.digits$}"),
        };
        let q: Vec<String> = quarters.iter().map(|&x| num(x, 3)).collect();
        let budget = cache.budget.map_or("none".to_string(), |n| n.to_string());
        println!(
            "perplexity {:.4} (mean NLL {:.4} ± {:.4}) over {} scored tokens{}{} | by quarter: {} \
             | policy {} budget {budget} chunk {} ({} evictions) | {:.2} s",
            r.ppl(),
            r.mean_nll(..),
            num(r.nll_stderr(), 4),
            r.nll.len(),
            if tokens.len() < total {
                format!(" (the first {} of the text's {total} tokens)", tokens.len())
            } else {
                String::new()
            },
            if windowed {
                format!(
                    " in {} windows of {window} tokens, {stride} apart",
                    r.windows
                )
            } else {
                String::new()
            },
            q.join(" "),
            cache.policy.name(),
            cache.chunk,
            r.evictions,
            r.seconds
        );
    }
    Ok(())
}

fn info(args: &ModelArgs) -> Result<()> {
    let engine = args.load()?;
    let c = engine.model_config();
    let map = |kinds: Vec<(&str, String)>| -> serde_json::Map<String, serde_json::Value> {
        kinds
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect()
    };
    let v = serde_json::json!({
        "origin": engine.origin(),
        "format": engine.format(),
        "config": c,
        "context": c.context(),
        "compute_dtype": format!("{:?}", engine.config().dtype),
        "kv_dtype": engine.config().kv_dtype.map(|d| d.to_string()),
        "kv_rotated": engine.kv_rotated(),
        "device": format!("{:?}", engine.config().device),
        "gpu": gpu_info(&engine.config().device),
        "attention": engine.config().attention.name(),
        "sampling_defaults": engine.sampling_defaults(),
        "weights": map(engine.weight_kinds()),
        "runtime_weights": map(engine.runtime_kinds()),
        "memory": {
            "weight_bytes": engine.weight_bytes(),
            "weights": keydiff::human_bytes(engine.weight_bytes()),
            "planned_weight_bytes": engine.weight_plan().resident,
            "device_taken_by_load": engine.load_taken_bytes(),
            "cpu_weights": engine.cpu_weights().map(|c| c.describe()),
            "available": engine.memory_budget().map(|b| b.to_string()),
        },
    });
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// `keydiff devices`.
fn devices(json: bool) -> Result<()> {
    use keydiff::arch::{Arch, Fit};
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let target = Arch::of_build().map(Arch::name);
    let cuda = keydiff::cuda_devices();
    if json {
        let list = |devs: &Vec<std::result::Result<keydiff::CudaDeviceInfo, String>>| {
            devs.iter()
                .enumerate()
                .map(|(i, d)| match d {
                    Ok(d) => serde_json::json!({
                        "device": format!("cuda:{}", d.ordinal), "name": d.name,
                        "compute_capability": format!("{}.{}", d.capability.0, d.capability.1),
                        "total_bytes": d.total_bytes,
                        "runs": d.fit.map(Fit::name),
                    }),
                    Err(e) => serde_json::json!({"device": format!("cuda:{i}"), "error": e}),
                })
                .collect::<Vec<_>>()
        };
        let v = serde_json::json!({
            "build": keydiff::build_info(),
            "build_target": target,
            "cpu": {"device": "cpu", "threads": threads},
            "cuda": cuda.as_ref().map(list).unwrap_or_default(),
            "cuda_error": cuda.as_ref().err(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("keydiff {}", keydiff::build_info());
    println!("cpu      {threads} threads");
    match &cuda {
        Err(why) => println!("cuda     none: {why}"),
        Ok(devs) if devs.is_empty() => println!("cuda     none: the CUDA driver sees no device"),
        Ok(devs) => {
            for (i, d) in devs.iter().enumerate() {
                match d {
                    Ok(d) => println!(
                        "cuda:{:<3} {}, compute {}.{}, {}; this build runs {}",
                        d.ordinal,
                        d.name,
                        d.capability.0,
                        d.capability.1,
                        keydiff::human_bytes(d.total_bytes),
                        match d.fit {
                            Some(Fit::All) => "all of its code here".to_string(),
                            Some(Fit::PtxOnly) => format!(
                                "its PTX here, not its machine code (flash attention, GGUF \
                                 matmuls): built for {}",
                                target.as_deref().unwrap_or("?")
                            ),
                            Some(Fit::None) => format!(
                                "nothing here: built for {}",
                                target.as_deref().unwrap_or("?")
                            ),
                            None => "here, unchecked (its target was not recorded)".to_string(),
                        }
                    ),
                    Err(e) => println!("cuda:{i:<3} cannot be opened: {e}"),
                }
            }
        }
    }
    Ok(())
}

/// A CUDA device's name and compute capability, the architecture this binary was built for,
/// and how much of its code runs there (`keydiff::arch`); null on the CPU.
fn gpu_info(dev: &keydiff::Device) -> serde_json::Value {
    use keydiff::arch::{device_capability, device_fit, Arch};
    match device_capability(dev) {
        Some(((major, minor), name)) => serde_json::json!({
            "name": name,
            "compute_capability": format!("{major}.{minor}"),
            "build_target": Arch::of_build().map(Arch::name),
            "runs": device_fit(dev).map(|f| f.fit.name()),
        }),
        None => serde_json::Value::Null,
    }
}

fn run(mut a: RunArgs) -> Result<()> {
    a.prompt = a.prompt.map(|p| a.escape.apply(&p));
    a.suffix = a.suffix.map(|p| a.escape.apply(&p));
    a.stop = stop_strings(&a.stop, &a.escape)?;
    // Before the prompt is read and the model loads, which can take minutes.
    sampling(&a)?
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid parameter: {e}"))?;
    let tools = match &a.tools {
        None => None,
        Some(p) => Some(read_tools(p, &a)?),
    };
    if let Some(path) = &a.prompt_tokens {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read token file {}", path.display()))?;
        let ids: Vec<u32> = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a JSON array of token ids", path.display()))?;
        let engine = a.model.load_in(&a.ctx)?;
        return generate(&a, &engine, Prompt::Tokens(ids));
    }
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_text_file(f, "prompt")?,
        (None, None) => {
            use std::io::IsTerminal;
            if std::io::stdin().is_terminal() {
                eprintln!("reading the prompt from stdin (end it with Ctrl-D; or give -p or -f)");
            }
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("cannot read the prompt from stdin")?;
            s
        }
    };
    let engine = a.model.load_in(&a.ctx)?;
    if let Some((list, choice)) = tools {
        let mut m = Vec::new();
        if let Some(s) = &a.system {
            m.push(Message::new("system", s.clone()));
        }
        m.push(Message::new("user", text));
        let reading = match (&choice, engine.tool_syntax()) {
            (ToolChoice::None, _) => None,
            (_, None) => anyhow::bail!(
                "--tools: this model's chat template writes no function calls keydiff can read \
                 (Hermes <tool_call> blocks, as Qwen 2.5, or Llama 3.x JSON calls); \
                 --tool-choice none renders the tools only"
            ),
            (_, Some(syntax)) => {
                let format = syntax.format(&list, &choice, true).context("--tools")?;
                Some((syntax, format))
            }
        };
        let prompt = Prompt::ChatTools {
            messages: m,
            tools: list.clone(),
            template_kwargs: keydiff::TemplateKwargs::new(),
        };
        return generate_with(&a, &engine, prompt, reading.map(|(s, f)| (s, list, f)));
    }
    // A chat template flag asks for the chat template (llama.cpp's apply it in conversation
    // mode, its default for a model with a template).
    let templated = a.model.load.template.given() && a.suffix.is_none();
    let prompt = if a.chat || a.system.is_some() || templated {
        let mut m = Vec::new();
        if let Some(s) = &a.system {
            m.push(Message::new("system", s.clone()));
        }
        m.push(Message::new("user", text));
        Prompt::Chat(m)
    } else if let Some(suffix) = &a.suffix {
        Prompt::Infill {
            prefix: text,
            suffix: suffix.clone(),
            repo: None,
        }
    } else {
        if a.parse_special && !text.is_empty() {
            Prompt::Tokens(engine.tokenize(&text, true)?)
        } else {
            Prompt::Text(text)
        }
    };
    generate(&a, &engine, prompt)
}

/// A count, or -1 for no limit (`usize::MAX`), as llama.cpp's flags take it.
fn count_or_all(s: &str) -> std::result::Result<usize, String> {
    match s.trim() {
        "-1" => Ok(usize::MAX),
        t => t
            .parse()
            .map_err(|_| format!("`{s}`: expected a count, or -1 for no limit")),
    }
}

/// `--top-k`: a count; 0 or less turns it off, as in llama.cpp.
fn top_k(s: &str) -> std::result::Result<usize, String> {
    let k: i64 = (s.trim().parse()).map_err(|_| format!("`{s}`: expected an integer"))?;
    Ok(k.max(0) as usize)
}

/// `--seed`: a number, or -1 for one drawn at random (llama.cpp's `LLAMA_DEFAULT_SEED`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Seed {
    Fixed(u64),
    Random,
}

/// The seed `--seed -1` drew.
static DRAWN_SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

fn seed(s: &str) -> std::result::Result<Seed, String> {
    match s.trim() {
        "-1" => Ok(Seed::Random),
        t => t.parse().map(Seed::Fixed).map_err(|_| {
            format!("`{s}`: expected a number from 0 to 2^64 - 1, or -1 for a random one")
        }),
    }
}

/// Sampling options shared by `run` and `chat`.
#[derive(Args)]
struct SamplingArgs {
    /// Temperature; 0 is greedy (the default here, unlike llama.cpp's 0.8: a run gives the
    /// same text each time unless asked to sample).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temp: f32,
    /// Keep the K most likely tokens; 0 or less: all. Default 40, llama.cpp's (it matters
    /// only when sampling: --temp above 0).
    #[arg(long, value_parser = top_k, allow_negative_numbers = true)]
    top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities add up to P (1 = off). Default 0.95,
    /// llama.cpp's.
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 = off). Default 0.05,
    /// llama.cpp's.
    #[arg(long, allow_negative_numbers = true)]
    min_p: Option<f32>,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the penalties look back on; -1: the whole context (llama.cpp's).
    #[arg(long, default_value = "64", value_parser = count_or_all,
        allow_negative_numbers = true)]
    repeat_last_n: usize,
    /// Subtracted from a token's logit per occurrence in the last --repeat-last-n tokens
    /// (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Subtracted once from the logit of every token in the last --repeat-last-n tokens
    /// (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Adds BIAS to a token's logit before sampling (greedy included), llama.cpp's form:
    /// `15043+1`, `15043-0.5`, `15043-inf` (bans the token). Repeatable.
    #[arg(long, short = 'l', value_name = "TOKEN_ID(+|-)BIAS", value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// `json`: the output is one JSON object, then the end of generation (tokens that would
    /// break it are masked before sampling; OpenAI's `response_format: json_object`).
    #[arg(long, value_enum, default_value_t = OutputFormat::Text, group = "constraint")]
    format: OutputFormat,
    /// The output is a text of this GBNF grammar (llama.cpp's syntax, from rule `root`);
    /// tokens that would leave it are masked before sampling, and generation ends only once
    /// the text is whole.
    #[arg(long, value_name = "GBNF", group = "constraint")]
    grammar: Option<String>,
    /// --grammar, read from FILE.
    #[arg(long, value_name = "FILE", group = "constraint")]
    grammar_file: Option<PathBuf>,
    /// The output is a JSON value of this JSON schema (compiled to a grammar: see the README
    /// for the keywords it compiles; others are refused).
    #[arg(long, short = 'j', value_name = "SCHEMA", group = "constraint")]
    json_schema: Option<String>,
    /// --json-schema, read from FILE.
    #[arg(long, value_name = "FILE", group = "constraint")]
    json_schema_file: Option<PathBuf>,
    /// Seed of the sampler: the same seed, settings and prompt give the same text; -1 draws
    /// one (printed on stderr), as llama.cpp's default does.
    #[arg(short = 's', long, default_value = "299792458", value_parser = seed,
        allow_negative_numbers = true)]
    seed: Seed,
}

/// Speculative decoding, shared by `run`, `chat` and `serve`.
#[derive(Args)]
struct SpecArgs {
    /// Speculative decoding: `ngram` looks the last few tokens up in the prompt and the
    /// output so far and proposes the tokens that followed them there (prompt lookup: vLLM's
    /// `ngram`, llama.cpp's `ngram-simple`), verified in one pass; the output is the same
    /// tokens, in fewer passes where the reply copies its prompt or itself.
    #[arg(long, value_enum, value_name = "TYPE")]
    spec_type: Option<SpecType>,
    /// With --spec-type: tokens proposed at most per pass (llama.cpp's --draft-max; default
    /// 8).
    #[arg(long, alias = "draft", value_name = "N", requires = "spec_type")]
    draft_max: Option<usize>,
    /// With --spec-type: the longest run of last tokens looked up, tried first (vLLM's
    /// prompt_lookup_max; default 4).
    #[arg(long, value_name = "N", requires = "spec_type")]
    spec_ngram_max: Option<usize>,
    /// With --spec-type: the shortest run of last tokens looked up (vLLM's
    /// prompt_lookup_min; default 2).
    #[arg(long, value_name = "N", requires = "spec_type")]
    spec_ngram_min: Option<usize>,
    /// With --spec-type: verify bit for bit, so the output is exactly token-by-token
    /// decoding's: weights whose kernel computes several rows otherwise than one (x86 Q6K,
    /// CUDA matmuls) run row by row in the verification pass (slower). Without it, the same up
    /// to the last bits of rounding, as a batch (exact anyway on the CPU for Q8_0).
    #[arg(long, requires = "spec_type")]
    spec_exact: bool,
}

/// What speculation saved: drafts taken, and decode passes.
fn speculation_line(c: &keydiff::SpecCounters) -> String {
    format!(
        "speculative: {} of {} drafted tokens accepted ({:.0}%) in {} verification passes",
        c.accepted,
        c.drafted,
        100.0 * c.acceptance(),
        c.passes
    )
}

/// `--spec-type`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SpecType {
    None,
    Ngram,
}

impl SpecArgs {
    /// The settings asked for, checked; `None` without --spec-type (or with `none`).
    fn get(&self) -> Result<Option<keydiff::NgramSpec>> {
        if self.spec_type != Some(SpecType::Ngram) {
            let tuned = self.draft_max.is_some()
                || self.spec_ngram_max.is_some()
                || self.spec_ngram_min.is_some()
                || self.spec_exact;
            if tuned {
                bail!("--draft-max, --spec-ngram-min/max and --spec-exact need --spec-type ngram");
            }
            return Ok(None);
        }
        let d = keydiff::NgramSpec::default();
        // One bound given: the other defaults within it.
        let (min, max) = (self.spec_ngram_min, self.spec_ngram_max);
        let spec = keydiff::NgramSpec {
            ngram_min: min.unwrap_or(d.ngram_min.min(max.unwrap_or(usize::MAX))),
            ngram_max: max.unwrap_or(d.ngram_max.max(min.unwrap_or(0))),
            draft_max: self.draft_max.unwrap_or(d.draft_max),
            exact: self.spec_exact,
        };
        spec.validate()?;
        Ok(Some(spec))
    }
}

/// `--format`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum OutputFormat {
    Text,
    Json,
}

/// `TOKEN_ID+BIAS` or `TOKEN_ID-BIAS` (llama.cpp's `--logit-bias`).
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let form = || format!("`{s}`: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043-inf");
    let split = s.find(['+', '-']).filter(|&i| i > 0).ok_or_else(form)?;
    let id = s[..split].parse::<u32>().map_err(|_| form())?;
    let bias = s[split..].parse::<f32>().map_err(|_| form())?;
    if bias.is_nan() || bias == f32::INFINITY {
        return Err(format!("`{s}`: the bias must be a number or -inf"));
    }
    Ok((id, bias))
}

fn sampling(a: &RunArgs) -> Result<Sampling> {
    a.sampling.get()
}

impl SamplingArgs {
    /// The sampling settings; a grammar or a JSON schema is read, compiled and checked here,
    /// before a model loads.
    fn get(&self) -> Result<Sampling> {
        let read = |p: &Path, what: &str| {
            std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the {what} file {}", p.display()))
        };
        let schema = |text: &str, from: &str| -> Result<String> {
            let v: serde_json::Value =
                serde_json::from_str(text).with_context(|| format!("{from} is not JSON"))?;
            keydiff::json_schema::to_grammar(&v).with_context(|| from.to_string())
        };
        let format = if let Some(g) = &self.grammar {
            Format::Grammar(g.clone())
        } else if let Some(p) = &self.grammar_file {
            Format::Grammar(read(p, "grammar")?)
        } else if let Some(s) = &self.json_schema {
            Format::Grammar(schema(s, "--json-schema")?)
        } else if let Some(p) = &self.json_schema_file {
            let from = format!("--json-schema-file {}", p.display());
            Format::Grammar(schema(&read(p, "JSON schema")?, &from)?)
        } else {
            match self.format {
                OutputFormat::Text => Format::Text,
                OutputFormat::Json => Format::JsonObject,
            }
        };
        if let Format::Grammar(g) = &format {
            keydiff::grammar::Grammar::parse(g)?;
        }
        // Greedy is the default here (llama.cpp's is 0.8): truncation asked for at
        // temperature 0 would do nothing, silently.
        let truncation = self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some();
        let seeded = self.seed != Seed::Fixed(299_792_458);
        if self.temp == 0.0 && (truncation || seeded) {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "warning: --temp is 0 (greedy, keydiff's default): --top-k, --top-p, \
                     --min-p and --seed have no effect; give --temp to sample"
                )
            });
        }
        Ok(Sampling {
            temperature: self.temp,
            // llama-cli's chain and its defaults: top-k 40, top-p 0.95, min-p 0.05.
            top_k: self.top_k.unwrap_or(40),
            top_p: self.top_p.unwrap_or(0.95),
            min_p: self.min_p.unwrap_or(0.05),
            repetition_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logit_bias: self.logit_bias.clone(),
            format,
            seed: match self.seed {
                Seed::Fixed(n) => n,
                // Drawn once a process (the settings are read more than once), and said.
                Seed::Random => *DRAWN_SEED.get_or_init(|| {
                    use std::hash::{BuildHasher, Hasher};
                    let n = std::collections::hash_map::RandomState::new()
                        .build_hasher()
                        .finish();
                    eprintln!("seed: {n} (drawn for --seed -1)");
                    n
                }),
            },
            // llama.cpp's order, as its flags.
            temperature_first: false,
            output_penalties: false,
        })
    }
}

/// `keydiff chat`: one user message per line of stdin.
#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    ctx: ContextArgs,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Tokens to generate at most per reply; -1: until end of generation or the context.
    #[arg(short = 'n', long, default_value = "512", value_parser = count_or_all,
        allow_negative_numbers = true)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// End a reply when this string is generated (repeatable; it is not printed).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    escape: EscapeArgs,
    /// Keep the conversation (its messages and KV cache) in this file: resumed from it when
    /// it exists, saved after every turn, so a later `keydiff chat` goes on without
    /// prefilling what was said (under --budget the file holds N slots per layer and head).
    #[arg(long, value_name = "FILE")]
    prompt_cache: Option<PathBuf>,
}

fn chat(a: &ChatArgs) -> Result<()> {
    use std::io::{IsTerminal, Write};
    let sampling = a.sampling.get()?;
    sampling
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid parameter: {e}"))?;
    let stop = stop_strings(&a.stop, &a.escape)?;
    let engine = a.model.load_in(&a.ctx)?;
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling,
        stop,
        speculative: a.spec.get()?,
        ..Default::default()
    };
    let mut conv = match &a.prompt_cache {
        Some(path) if path.exists() => {
            let conv = engine.load_conversation(path).with_context(|| {
                format!(
                    "--prompt-cache: delete {} or give another file to start afresh",
                    path.display()
                )
            })?;
            let saved = conv.messages().first().filter(|m| m.role == "system");
            if let Some(s) = &a.system {
                if saved.map(|m| m.content.as_str()) != Some(s.as_str()) {
                    bail!(
                        "--system differs from the system message of the conversation saved in {}",
                        path.display()
                    );
                }
            }
            eprintln!(
                "resumed the conversation in {}: {} messages, {} tokens, {} cached slots",
                path.display(),
                conv.messages().len(),
                conv.position(),
                conv.cache_len()
            );
            conv
        }
        _ => keydiff::Conversation::new(a.system.as_deref()),
    };
    if let Some(path) = &a.prompt_cache {
        check_writable(path).context("--prompt-cache")?;
    }
    let interactive = std::io::stdin().is_terminal();
    let cache = engine.config().cache.clone();
    if interactive {
        eprintln!(
            "chat with {} (policy {}, budget {}): one message per line (end a line with \\ \
             to go on to the next), /clear starts a new conversation, /exit or Ctrl-D ends; \
             Ctrl-C stops a reply",
            engine.origin(),
            cache.policy.name(),
            cache.budget.map_or("none".to_string(), |n| n.to_string())
        );
        interrupt::install();
    }
    let mut stdin = std::io::stdin().lock();
    let mut failed = 0usize;
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(message) = read_message(&mut stdin, interactive)? else {
            if interactive {
                eprintln!();
            }
            break;
        };
        match message.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/clear" => {
                // The same system message: the one given, or the resumed conversation's.
                let system = a.system.clone().or_else(|| {
                    let first = conv.messages().first()?;
                    (first.role == "system").then(|| first.content.clone())
                });
                conv = keydiff::Conversation::new(system.as_deref());
                eprintln!("[a new conversation]");
                continue;
            }
            _ => {}
        }
        let mut out = std::io::stdout().lock();
        let cancel = keydiff::CancelToken::new();
        let turn = GenerateParams {
            cancel: Some(cancel.clone()),
            ..params.clone()
        };
        let result = interrupt::while_generating(&cancel, || {
            engine.chat_turn(&mut conv, &message, &turn, |ev| {
                if let Event::Text(t) = ev {
                    let _ = out.write_all(t.as_bytes());
                    let _ = out.flush();
                }
            })
        });
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                // As a server fails one request: this message is dropped, the conversation
                // (and its file) stay as they were, and the next line is read.
                failed += 1;
                let full = matches!(
                    e,
                    keydiff::EngineError::PromptTooLong { .. }
                        | keydiff::EngineError::PromptTextTooLong { .. }
                );
                eprintln!(
                    "error: {e}{}",
                    if full {
                        " (the conversation's positions count every turn, evicted or not: \
                         /clear starts a new one, a larger -c or model context holds more)"
                    } else {
                        ""
                    }
                );
                continue;
            }
        };
        writeln!(out)?;
        let s = &result.stats;
        eprintln!(
            "[turn: {} new tokens ({} reused), {} generated | TTFT {:.3} s | decode {:.1} tok/s | \
             cache {} slots at position {} | {} evictions | stop: {:?}]",
            s.prompt_tokens,
            s.prefix_tokens,
            s.generated_tokens,
            s.ttft_s,
            s.decode_tok_s,
            conv.cache_len(),
            conv.position(),
            s.eviction.evictions,
            s.stop_reason
        );
        if let Some(c) = &s.speculative {
            eprintln!("[{}]", speculation_line(c));
        }
        if let Some(path) = &a.prompt_cache {
            if let Some(bytes) = engine.save_conversation(&conv, path)? {
                eprintln!(
                    "[saved to {} ({})]",
                    path.display(),
                    keydiff::human_bytes(bytes)
                );
            }
        }
    }
    if failed > 0 {
        bail!("{failed} message(s) failed");
    }
    Ok(())
}

/// Refuses a file that cannot be written where it is: a directory, or one in a folder that
/// does not exist (found before a generation, not after it).
fn check_writable(path: &std::path::Path) -> Result<()> {
    if path.is_dir() {
        bail!("{} is a directory, not a file", path.display());
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if !parent.is_dir() {
        bail!(
            "cannot write {}: the folder {} does not exist",
            path.display(),
            parent.display()
        );
    }
    Ok(())
}

/// One chat message from `input`: a line (its line break left out), or several when each but
/// the last ends with `\` (llama-cli's way; the backslash becomes a line break). Bytes that
/// are not UTF-8 are replaced (with a warning) rather than ending the chat. `None` at the end
/// of input.
fn read_message(input: &mut impl std::io::BufRead, interactive: bool) -> Result<Option<String>> {
    let mut message = String::new();
    let mut any = false;
    loop {
        let mut buf = Vec::new();
        if input
            .read_until(b'\n', &mut buf)
            .context("cannot read stdin")?
            == 0
        {
            return Ok(any.then_some(message));
        }
        any = true;
        while matches!(buf.last(), Some(b'\n' | b'\r')) {
            buf.pop();
        }
        let line = match String::from_utf8(buf) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("a line of input is not UTF-8: its bad bytes are read as U+FFFD");
                String::from_utf8_lossy(e.as_bytes()).into_owned()
            }
        };
        match line.strip_suffix('\\') {
            Some(head) => {
                message.push_str(head);
                message.push('\n');
                if interactive {
                    eprint!(". ");
                }
            }
            None => {
                message.push_str(&line);
                return Ok(Some(message));
            }
        }
    }
}

/// Ctrl-C in `keydiff chat` at a terminal, as in llama-cli: while a reply is generated the
/// first one stops it (the turn keeps what it had) and a second one ends the process; at the
/// prompt one ends it.
mod interrupt {
    use std::sync::atomic::{AtomicBool, Ordering};

    static GENERATING: AtomicBool = AtomicBool::new(false);
    static INTERRUPTED: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_sigint(_: libc::c_int) {
        if GENERATING.load(Ordering::SeqCst) && !INTERRUPTED.swap(true, Ordering::SeqCst) {
            return;
        }
        // SAFETY: async-signal-safe; ends the process as the default action would.
        unsafe { libc::_exit(130) }
    }

    pub fn install() {
        #[cfg(unix)]
        // SAFETY: sets a handler that touches only atomics and calls `_exit`.
        unsafe {
            libc::signal(
                libc::SIGINT,
                on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }

    /// Runs `f` (a generation), cancelling `cancel` on the first Ctrl-C meanwhile.
    pub fn while_generating<T>(cancel: &keydiff::CancelToken, f: impl FnOnce() -> T) -> T {
        INTERRUPTED.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let done = AtomicBool::new(false);
        let out = std::thread::scope(|scope| {
            scope.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    if INTERRUPTED.load(Ordering::SeqCst) {
                        cancel.cancel();
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            });
            let out = f();
            done.store(true, Ordering::SeqCst);
            out
        });
        GENERATING.store(false, Ordering::SeqCst);
        out
    }
}

/// `keydiff serve`.
#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    ctx: ContextArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Model id that /v1/models lists and responses carry (default: the model's file or
    /// hub name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests that may wait while one runs; beyond that a request gets 503.
    #[arg(long, default_value_t = 16)]
    max_queue: usize,
    /// Tokens generated when a request sets no max_tokens (default: until end of generation
    /// or the context).
    #[arg(short = 'n', long)]
    max_tokens: Option<usize>,
    /// Keep the last request's KV cache for the next request that starts with its tokens
    /// (the next turn of a conversation, another question on a document): `exact` reuses only
    /// what gives a fresh request's answer (whole chunks where no eviction would have
    /// happened); `continue` also goes on from an evicted cache when the prompt extends all of
    /// it, as `keydiff chat` does (under --budget a long conversation then prefills only each
    /// turn, and answers as a chat, not as a fresh request); `off`. With --max-batch above 1
    /// the last that many requests' caches are kept, and a request starts from the one that
    /// holds most of its prompt. Default: exact.
    #[arg(long)]
    prompt_cache: Option<String>,
    /// Requests decoded together at most (continuous batching): the running ones go through
    /// the model together each step; waiting requests join between steps, and their prompts
    /// are prefilled in the steps, a chunk at a time beside the others' tokens. Each has its
    /// own KV cache (N + B slots under --budget). 1: one request at a time.
    #[arg(long, default_value_t = 1)]
    max_batch: usize,
    /// With --max-batch above 1, prompt tokens a step takes from joining requests: a chunk
    /// (at most B) from each in arrival order, while they fit (vLLM's
    /// max-num-batched-tokens). More favours their time to first token, fewer the running
    /// requests' time between tokens. Default: one chunk, B.
    #[arg(long)]
    prefill_tokens: Option<usize>,
    /// Chat replies' `<think>` blocks: deepseek returns them apart, as `reasoning_content`
    /// (streams: `delta.reasoning_content`); none leaves them in the content; auto does as
    /// deepseek for chat templates that write `</think>` (Qwen 3, DeepSeek-R1).
    #[arg(long, default_value = "auto", value_name = "FORMAT")]
    reasoning_format: String,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (401 otherwise).
    #[arg(long, env = "KEYDIFF_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// No CORS: by default browsers' preflights are answered and answers allow any origin
    /// (llama-server's and vLLM's default), so a web page of any site can call this server.
    #[arg(long)]
    no_cors: bool,
    /// Sampling for the fields a request leaves out: `auto` takes the checkpoint's
    /// recommendation (GGUF general.sampling.*, generation_config.json; `keydiff info` shows
    /// it), as vLLM's --generation-config auto and llama.cpp's server do; `none` (or `vllm`)
    /// keeps the API's own defaults (OpenAI's temperature 1, top-p 1; llama.cpp's for its
    /// endpoints).
    #[arg(long, default_value = "auto", value_name = "MODE")]
    generation_config: String,
    /// Directory where `POST /slots/{id}?action=save|restore` (llama.cpp's slot actions)
    /// write and read prompt caches, as `run --prompt-cache` files (without it those actions
    /// answer 501).
    #[arg(long, value_name = "DIR")]
    slot_save_path: Option<PathBuf>,
    #[command(flatten)]
    spec: SpecArgs,
}

/// `check-device --batch`: batched passes against single ones on `cfg`'s device.
fn check_batch(
    cfg: &EngineConfig,
    presets: &[PathBuf],
    policies: &[String],
    (seed, weights): (u64, Option<keydiff::GgmlDType>),
    (device, dtype): (&str, &str),
) -> Result<()> {
    let mut caches = vec![CacheConfig::full(16)];
    for p in policies {
        caches.push(CacheConfig {
            policy: PolicyKind::parse(p, keydiff::SNAPKV_WINDOW, seed)?,
            budget: Some(40),
            ..CacheConfig::full(16)
        });
    }
    let tol = keydiff::parity::batch_tolerance(&cfg.device, cfg.dtype, weights.is_some());
    let mut failed = Vec::new();
    for p in presets {
        for cache in &caches {
            let (segments, attention) =
                keydiff::parity::compare_batch(p, seed, weights, cfg, cache)
                    .with_context(|| format!("batch check, preset {}", p.display()))?;
            let worst = segments
                .iter()
                .map(|d| d.max_abs / d.scale.max(f32::MIN_POSITIVE))
                .fold(0f32, f32::max);
            // Logits that are all 0 (or NaN) agree with anything: a device that computes
            // nothing would pass, so the single runs' logits must be non-zero.
            let pass = segments
                .iter()
                .all(|d| d.scale > 0.0 && d.max_abs <= tol.bound(d.scale));
            let v = serde_json::json!({
                "check": "batch", "preset": p.display().to_string(), "device": device,
                "dtype": dtype, "attention": attention.name(),
                "weights": weights.map(keydiff::weight_type_name), "policy": cache.policy.name(),
                "budget": cache.budget, "chunk": cache.chunk, "segments": segments,
                "max_rel": worst, "pass": pass,
            });
            println!("{v}");
            if !pass {
                failed.push(format!("{} {}", p.display(), cache.policy.name()));
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "a batched pass differs from single ones (beyond {tol}), or the single ones' logits \
             are all 0, on: {}",
            failed.join(", ")
        );
    }
    Ok(())
}

fn serve(a: &ServeArgs) -> Result<()> {
    if a.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    if a.max_tokens == Some(0) {
        bail!("--max-tokens must be at least 1");
    }
    if a.api_key.as_deref() == Some("") {
        // Most likely an unset variable: refuse rather than serve without the key asked for.
        bail!("--api-key (or KEYDIFF_API_KEY) is empty");
    }
    if a.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    match a.prefill_tokens {
        Some(0) => bail!("--prefill-tokens must be at least 1"),
        Some(_) if a.max_batch == 1 => {
            bail!("--prefill-tokens sets a batch's steps: it needs --max-batch above 1")
        }
        _ => {}
    }
    let speculative = a.spec.get()?;
    if speculative.is_some_and(|s| s.exact) && a.max_batch > 1 {
        bail!(
            "--spec-exact runs weights row by row where their kernels compute several rows \
             otherwise; a batch runs all its rows through each weight at once: it needs \
             --max-batch 1"
        );
    }
    let generation_config = match a.generation_config.as_str() {
        "auto" => true,
        "none" | "vllm" => false,
        other => bail!("--generation-config `{other}`: expected auto or none"),
    };
    if let Some(dir) = &a.slot_save_path {
        if !dir.is_dir() {
            bail!("--slot-save-path {}: not a directory", dir.display());
        }
    }
    let prompt_cache = match a.prompt_cache.as_deref().unwrap_or("exact") {
        "off" => None,
        mode => Some(mode.parse::<keydiff::Reuse>().map_err(|_| {
            anyhow::anyhow!("--prompt-cache `{mode}`: expected exact, continue or off")
        })?),
    };
    let reasoning_format: keydiff::reasoning::ReasoningFormat = a
        .reasoning_format
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--reasoning-format: {e}"))?;
    // Before the model loads (which can take minutes): a taken port fails at once.
    let listener = keydiff_server::listen(&format!("{}:{}", a.host, a.port))?;
    let engine = a.model.load_in(&a.ctx)?;
    let id = a.served_model_name.clone().unwrap_or_else(|| {
        let m = &a.model.load.model;
        let name = Path::new(m).file_name().map_or(m.clone(), |f| {
            f.to_string_lossy().trim_end_matches(".gguf").to_string()
        });
        if name.is_empty() {
            m.clone()
        } else {
            name
        }
    });
    let cache = engine.config().cache.clone();
    let cfg = keydiff_server::ServerConfig {
        model_id: id.clone(),
        max_queue: a.max_queue,
        max_tokens: a.max_tokens,
        prompt_cache,
        api_key: a.api_key.clone(),
        max_batch: a.max_batch,
        prefill_tokens: a.prefill_tokens,
        reasoning_format,
        slot_save_path: a.slot_save_path.clone(),
        generation_config,
        speculative,
        cors: !a.no_cors,
    };
    let server = keydiff_server::Server::from_listener(listener, engine, cfg)?;
    eprintln!(
        "keydiff: serving `{id}` on http://{} (policy {}, budget {}): POST /v1/completions, \
         /v1/chat/completions; GET /v1/models, /health.{} Ctrl-C stops.",
        server.local_addr(),
        cache.policy.name(),
        cache.budget.map_or("none".to_string(), |n| n.to_string()),
        if a.api_key.is_some() {
            " API key required."
        } else {
            ""
        }
    );
    server.run(async {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = ctrl_c => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = ctrl_c.await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        eprintln!("keydiff: stopping: the running request ends at its next token");
    })?;
    Ok(())
}

/// Generated tokens' logprobs for `run --json`: id, text, log-probability, alternatives.
fn logprobs_json(engine: &Engine, lps: &[keydiff::TokenLogprob]) -> Result<serde_json::Value> {
    let item = |id: u32, lp: f32| -> Result<serde_json::Value> {
        let text = engine.token_pieces(&[id])?[0].text();
        Ok(serde_json::json!({"id": id, "text": text, "logprob": lp}))
    };
    lps.iter()
        .map(|e| {
            let mut v = item(e.token, e.logprob)?;
            v["top"] = e
                .top
                .iter()
                .map(|&(id, lp)| item(id, lp))
                .collect::<Result<_>>()?;
            Ok(v)
        })
        .collect()
}

/// `--tools FILE` and `--tool-choice`, read and checked before the model loads.
fn read_tools(path: &Path, a: &RunArgs) -> Result<(Vec<Tool>, ToolChoice)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the tools file {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--tools {} is not JSON", path.display()))?;
    let Some(list) = v.as_array() else {
        anyhow::bail!(
            "--tools {}: expected a JSON array of tools ({{\"type\": \"function\", \
             \"function\": {{...}}}}), not a JSON {}",
            path.display(),
            match v {
                serde_json::Value::Object(_) => "object",
                serde_json::Value::String(_) => "string",
                serde_json::Value::Number(_) => "number",
                serde_json::Value::Bool(_) => "boolean",
                _ => "null",
            }
        );
    };
    let tools = keydiff::tools::tools_from_openai(list)
        .with_context(|| format!("--tools {}", path.display()))?;
    if tools.is_empty() {
        bail!(
            "--tools {}: the file declares no functions (an empty array)",
            path.display()
        );
    }
    let choice = match a.tool_choice.as_str() {
        c @ ("auto" | "required" | "none") => serde_json::json!(c),
        name => serde_json::json!({"type": "function", "function": {"name": name}}),
    };
    let choice = ToolChoice::from_openai(&choice, &tools).context("--tool-choice")?;
    let s = &a.sampling;
    let formatted = s.grammar.is_some()
        || s.grammar_file.is_some()
        || s.json_schema.is_some()
        || s.json_schema_file.is_some()
        || !matches!(s.format, OutputFormat::Text);
    if formatted && choice != ToolChoice::None {
        anyhow::bail!(
            "--tools set the output's form (calls, or text then calls); --format, --grammar and \
             --json-schema cannot be added to it (--tool-choice none allows them)"
        );
    }
    Ok((tools, choice))
}

/// The prompt cache of `--prompt-cache FILE`: the file's, or an empty one when there is no
/// file yet.
fn open_prompt_cache(a: &RunArgs, engine: &Engine, path: &Path) -> Result<keydiff::PromptCache> {
    let reuse: keydiff::Reuse = a
        .prompt_cache_reuse
        .as_deref()
        .unwrap_or("continue")
        .parse()
        .context("--prompt-cache-reuse")?;
    let mut pc = if path.exists() {
        engine.load_prompt_cache(path, reuse).with_context(|| {
            format!(
                "--prompt-cache: delete {} or give another file to start afresh",
                path.display()
            )
        })?
    } else if a.prompt_cache_ro {
        // As llama-cli: the run goes on without one (and, read-only, makes none).
        tracing::warn!(
            "--prompt-cache-ro: {} does not exist: nothing to start from (--prompt-cache makes \
             it)",
            path.display()
        );
        keydiff::PromptCache::with_reuse(reuse)
    } else {
        check_writable(path).context("--prompt-cache")?;
        keydiff::PromptCache::with_reuse(reuse)
    };
    // Read-only: nothing is saved, so the cache is not copied either.
    pc.set_prompt_only(!a.prompt_cache_all && !a.prompt_cache_ro);
    Ok(pc)
}

fn generate(a: &RunArgs, engine: &Engine, prompt: Prompt) -> Result<()> {
    generate_with(a, engine, prompt, None)
}

/// Generates from `prompt`; with `tools` (their syntax, the tools, the calls' format), the
/// reply is constrained by that format and read for calls.
fn generate_with(
    a: &RunArgs,
    engine: &Engine,
    prompt: Prompt,
    tools: Option<(ToolSyntax, Vec<Tool>, Option<Format>)>,
) -> Result<()> {
    let mut sampling = sampling(a)?;
    // A reasoning model's chat reply (its template writes `</think>`): the reasoning apart,
    // and tool calls read and constrained in the answer only (`--grammar`, `--json-schema`
    // and `--format` constrain the whole reply, as llama.cpp's do).
    let reasoning = engine.reasoning_start(&prompt, keydiff::reasoning::ReasoningFormat::Auto)?;
    if let Some((_, _, Some(f))) = &tools {
        sampling.format = f.clone().after_reasoning(reasoning);
    }
    let params = GenerateParams {
        prompt,
        max_tokens: a.max_tokens,
        sampling,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        stop_tokens: Vec::new(),
        min_tokens: 0,
        profile: a.profile,
        cancel: None,
        logprobs: a.logprobs,
        prompt_logprobs: None,
        stop_indent: 0,
        time_limit: None,
        speculative: a.spec.get()?,
    };
    let chunk = engine.config().cache.chunk;
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut out = std::io::stdout();
    let mut pc = match &a.prompt_cache {
        Some(path) => Some(open_prompt_cache(a, engine, path)?),
        None => None,
    };
    let on_event = |ev: Event<'_>| match ev {
        Event::Prefill { done, total } => {
            if total > PROGRESS_MIN_CHUNKS * chunk {
                let b = bar.get_or_insert_with(|| {
                    let b = indicatif::ProgressBar::with_draw_target(
                        Some(total as u64),
                        indicatif::ProgressDrawTarget::stderr(),
                    );
                    b.set_style(
                        indicatif::ProgressStyle::with_template(
                            "prefill {bar:30} {pos}/{len} tokens {per_sec} eta {eta}",
                        )
                        .expect("static template"),
                    );
                    b
                });
                b.set_position(done as u64);
                if done == total {
                    b.finish_and_clear();
                }
            }
        }
        Event::Text(t) => {
            if !a.json {
                let _ = out.write_all(t.as_bytes());
                let _ = out.flush();
            }
        }
        Event::Logprob(_) | Event::PromptLogprobs { .. } => {}
    };
    let result = match &mut pc {
        Some(pc) => engine.generate_cached(&params, pc, on_event)?,
        None => engine.generate(&params, on_event)?,
    };
    if !a.json {
        // The streamed text's line ends before anything else is said.
        println!();
    }
    if let (Some(path), Some(pc)) = (&a.prompt_cache, &pc) {
        let s = &result.stats;
        eprintln!(
            "prompt cache: {} of {} prompt tokens from {}",
            s.prefix_tokens,
            s.prompt_tokens,
            path.display()
        );
        if !a.prompt_cache_ro {
            match engine.save_prompt_cache(pc, path)? {
                Some(bytes) => eprintln!(
                    "prompt cache: saved {} tokens ({} slots per layer and KV head, {}) to {}",
                    pc.tokens().len(),
                    pc.slots(),
                    keydiff::human_bytes(bytes),
                    path.display()
                ),
                None if a.prompt_cache_all => eprintln!(
                    "prompt cache: nothing saved: under --prompt-cache-reuse exact a cache that \
                     evicted, or whose policy sums attention (H2O), cannot be cut back to the \
                     prompt a later run would share with it (without --prompt-cache-all, the \
                     prompt's own cache is saved)"
                ),
                None => eprintln!(
                    "prompt cache: nothing saved: the prompt's cache could not be kept (a \
                     cancelled prefill, or no memory for its copy)"
                ),
            }
        }
    }
    let s = &result.stats;
    let thinking = reasoning.map(|open| keydiff::reasoning::split(&result.text, open));
    let answer = thinking.as_ref().map_or(&result.text, |t| &t.content);
    let calls = tools.map(|(syntax, list, _)| syntax.parse(answer, &list));
    let calls = calls.filter(|p| !p.calls.is_empty());
    if a.json {
        let mut v = serde_json::json!({ "text": result.text, "stats": s });
        if let Some(t) = &thinking {
            v["reasoning_content"] = t.reasoning.clone().into();
            v["content"] = t.content.clone().into();
        }
        if let Some(p) = &calls {
            v["content"] = p.content.clone().into();
            v["tool_calls"] = keydiff_server::api::tool_calls(&p.calls, false);
        }
        if let Some(lps) = &result.logprobs {
            v["logprobs"] = logprobs_json(engine, lps)?;
        }
        println!("{}", serde_json::to_string(&v)?);
    } else {
        for c in calls.iter().flat_map(|p| &p.calls) {
            eprintln!("tool call: {} {}", c.name, c.arguments);
        }
        eprintln!(
            "prompt {} tok | TTFT {:.3} s | prefill {:.1} tok/s | decode {:.1} tok/s ({} tok) | peak KV {:.1} MiB {} | policy {} ({} evictions, {:.3} s) | stop: {:?}",
            s.prompt_tokens,
            s.ttft_s,
            s.prefill_tok_s,
            s.decode_tok_s,
            s.generated_tokens,
            s.peak_kv_bytes as f64 / (1024.0 * 1024.0),
            match s.kv_rotated {
                true => format!("{} rotated", s.kv_dtype),
                false => s.kv_dtype.clone(),
            },
            s.policy,
            s.eviction.evictions,
            s.eviction.score_s + s.eviction.select_move_s,
            s.stop_reason
        );
        if let Some(c) = &s.speculative {
            eprintln!("{}", speculation_line(c));
        }
        if let Some(b) = &s.breakdown {
            let pct = |x: f64| 100.0 * x / s.prefill_s.max(1e-12);
            eprintln!(
                "prefill breakdown: attention {:.1}% | attention stats {:.1}% | eviction scoring {:.1}% | selection/moves {:.1}% | MLP {:.1}% | other {:.1}%",
                pct(b.attention_s),
                pct(b.attention_stats_s),
                pct(b.eviction_score_s),
                pct(b.select_move_s),
                pct(b.mlp_s),
                pct(b.other_s)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's escapes; others, a lone backslash and non-ASCII `\x` stay as written.
    #[test]
    fn escapes_are_read_as_llama_cpp_reads_them() {
        assert_eq!(
            unescape(r#"a\nb\tc\rd\\e\"f\'g\x41\x4"#),
            "a\nb\tc\rd\\e\"f'gA\\x4"
        );
        assert_eq!(unescape(r"\q \x+1 \xff \"), r"\q \x+1 \xff \");
        assert_eq!(unescape("é\\n"), "é\n");
    }

    /// llama.cpp's -1 (no limit) for counts, and a top-k of 0 or less (off).
    #[test]
    fn counts_take_minus_one_and_top_k_takes_negatives() {
        assert_eq!(count_or_all("-1"), Ok(usize::MAX));
        assert_eq!(count_or_all("64"), Ok(64));
        assert!(count_or_all("-2").unwrap_err().contains("-1 for no limit"));
        assert!(count_or_all("x").is_err());
        assert_eq!(top_k("-1"), Ok(0));
        assert_eq!(top_k("40"), Ok(40));
        assert!(top_k("4.5").is_err());
        let cli = Cli::try_parse_from([
            "keydiff",
            "run",
            "-m",
            "m.gguf",
            "-p",
            "hi",
            "-n",
            "-1",
            "--repeat-last-n",
            "-1",
            "--top-k",
            "-1",
        ])
        .unwrap();
        let Cmd::Run(a) = cli.cmd else {
            panic!("not run")
        };
        assert_eq!(a.max_tokens, usize::MAX);
        assert_eq!(a.sampling.repeat_last_n, usize::MAX);
        assert_eq!(a.sampling.top_k, Some(0));
        // The defaults still parse.
        let Cmd::Run(a) = Cli::try_parse_from(["keydiff", "run", "-m", "m", "-p", "hi"])
            .unwrap()
            .cmd
        else {
            panic!("not run")
        };
        assert_eq!((a.max_tokens, a.sampling.repeat_last_n), (256, 64));
        assert!(Cli::try_parse_from(["keydiff", "run", "-m", "m", "-n", "-3"]).is_err());
    }

    /// llama.cpp's seed -1 (a random one), and negative values reach their own checks
    /// instead of reading as flags.
    #[test]
    fn seed_minus_one_draws_and_negatives_are_values() {
        assert_eq!(seed("-1"), Ok(Seed::Random));
        assert_eq!(seed("42"), Ok(Seed::Fixed(42)));
        assert!(seed("-2").unwrap_err().contains("-1 for a random one"));
        let parse = |extra: &[&str]| {
            let mut args = vec!["keydiff", "run", "-m", "m", "-p", "hi"];
            args.extend_from_slice(extra);
            match Cli::try_parse_from(args).map(|c| c.cmd) {
                Ok(Cmd::Run(a)) => Ok(a),
                Ok(_) => panic!("not run"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(parse(&["-s", "-1"]).unwrap().sampling.seed, Seed::Random);
        assert_eq!(parse(&[]).unwrap().sampling.seed, Seed::Fixed(299_792_458));
        let a = parse(&["--temp", "-1", "--top-p", "-0.5", "--min-p", "-1"]).unwrap();
        assert_eq!((a.sampling.temp, a.sampling.top_p), (-1.0, Some(-0.5)));
        assert!(
            a.sampling.get().unwrap().validate().is_err(),
            "refused by the sampler's checks"
        );
        let Err(err) = parse(&["-c", "-1"]) else {
            panic!("-c -1 parsed")
        };
        assert!(err.contains("invalid value '-1' for '--ctx-size"), "{err}");
    }

    /// llama.cpp's multi-letter single-dash flags: rewritten to keydiff's, or refused with
    /// the reason; everything else is left as it is.
    #[test]
    fn llama_cpp_flags_are_read_or_refused() {
        let tr = |args: &[&str]| {
            llama_cpp_flags(args.iter().map(Into::into).collect())
                .map(|v| {
                    v.into_iter()
                        .map(|a| a.into_string().unwrap())
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            tr(&["run", "-ctk", "f16", "-ctv", "q8_0", "-sys", "be brief", "-no-cnv"]).unwrap(),
            [
                "run",
                "--cache-type-k",
                "f16",
                "--cache-type-v",
                "q8_0",
                "--system",
                "be brief"
            ]
        );
        assert_eq!(
            tr(&["keydiff", "serve", "-fa", "on", "-np", "4"]).unwrap(),
            [
                "keydiff",
                "serve",
                "--attention",
                "flash",
                "--max-batch",
                "4"
            ]
        );
        // The server's flag: elsewhere it said "unexpected argument '--max-batch'".
        assert!(tr(&["keydiff", "run", "-np", "2"])
            .unwrap_err()
            .contains("`keydiff serve --max-batch N`"));
        // A draft model: refused as such (`-md` read as `-m d` before).
        for flag in ["-md", "--model-draft", "--model-draft=d.gguf"] {
            assert!(tr(&["keydiff", "run", flag, "d.gguf"])
                .unwrap_err()
                .contains("no draft-model speculative decoding"));
        }
        assert_eq!(
            tr(&["run", "-fa", "-p", "x"]).unwrap()[1..3],
            ["--attention", "flash"]
        );
        assert_eq!(
            tr(&["run", "-fa", "off"]).unwrap()[1..],
            ["--attention", "eager"]
        );
        assert!(tr(&["run", "-ngl", "99"])
            .unwrap_err()
            .contains("keydiff runs the whole"));
        assert!(tr(&["run", "-cnv"]).unwrap_err().contains("`keydiff chat`"));
        // In `keydiff chat`, the conversation mode it is.
        assert_eq!(
            tr(&["keydiff", "chat", "-cnv", "-m", "m"]).unwrap(),
            ["keydiff", "chat", "-m", "m"]
        );
        assert!(tr(&["keydiff", "chat", "-mli"])
            .unwrap_err()
            .contains("end a line with \\"));
        let sys = std::env::temp_dir().join(format!("keydiff-sysf-{}", std::process::id()));
        std::fs::write(&sys, "Be brief.\n").unwrap();
        assert_eq!(
            tr(&["keydiff", "chat", "-sysf", sys.to_str().unwrap()]).unwrap(),
            ["keydiff", "chat", "--system", "Be brief."]
        );
        std::fs::remove_file(&sys).unwrap();
        assert!(tr(&["keydiff", "chat", "-sysf", sys.to_str().unwrap()])
            .unwrap_err()
            .contains("cannot read system message file"));
        let plain = ["run", "-p", "-1", "-c", "4", "-n", "-1", "--stop", "x"];
        assert_eq!(tr(&plain).unwrap(), plain);
        // What the rewrite gives parses.
        let args = tr(&[
            "keydiff", "run", "-m", "m", "-p", "hi", "-ctk", "f16", "-fa", "on",
        ]);
        let Cmd::Run(a) = Cli::try_parse_from(args.unwrap()).unwrap().cmd else {
            panic!("not run")
        };
        assert_eq!(a.model.load.cache_type_k.as_deref(), Some("f16"));
    }
}
