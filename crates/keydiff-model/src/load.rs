//! Loading a model and its vocabulary from a GGUF file, an HF directory or a random preset.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use tokenizers::Tokenizer;

use crate::chat::ChatTemplate;
use crate::config::{HfConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::memory::{human, MemoryBudget};
use crate::model::Model;
use crate::tokenizer::tokenizer_from_gguf;
use crate::weights::{weight_type_name, CpuWeights, Key, WeightPlan, Weights};

/// Where the weights of a loaded model came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelFormat {
    Gguf,
    Safetensors,
    /// Seeded random weights: the output is meaningless by design.
    Random,
}

/// A tokenizer with the facts generation needs.
pub struct Vocab {
    pub tokenizer: Tokenizer,
    pub bos_id: Option<u32>,
    /// Tokens that end generation (EOS, EOT, `<|im_end|>`, ...).
    pub eos_ids: Vec<u32>,
    /// Whether a BOS token is put before the prompt.
    pub add_bos: bool,
    pub chat_template: Option<ChatTemplate>,
    /// The BOS and EOS token texts a chat template sees as `bos_token` and `eos_token`
    /// (also for a template given in place of the model's).
    pub template_tokens: (Option<String>, Option<String>),
    /// Fill-in-the-middle tokens, when the vocabulary has them.
    pub fim: Option<crate::tokenizer::Fim>,
    /// The sampling its authors recommend, when the checkpoint says.
    pub sampling: SamplingDefaults,
}

/// Sampling settings a checkpoint recommends (GGUF `general.sampling.*`, llama.cpp's keys;
/// HF `generation_config.json`), which servers use for what a request leaves out (as
/// llama.cpp's and vLLM's do). `None`: the checkpoint does not say. A value out of its range
/// is dropped with a warning, never used.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SamplingDefaults {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// llama.cpp's `penalty_repeat`, HF's `repetition_penalty`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// llama.cpp's `penalty_last_n`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat_last_n: Option<usize>,
}

impl SamplingDefaults {
    /// Builds them from named numbers (`get(name)`, `None` when absent or not a number),
    /// checking each against its range. `names`: the keys of temperature, top-k, top-p, min-p,
    /// the repetition penalty and its window, in that order (`None`: not in this format).
    fn read(get: impl Fn(&str) -> Option<f64>, names: [Option<&str>; 6], origin: &str) -> Self {
        let value = |i: usize, ok: &dyn Fn(f64) -> bool| -> Option<f64> {
            let name = names[i]?;
            let v = get(name)?;
            if ok(v) {
                Some(v)
            } else {
                tracing::warn!("{origin}: `{name}` = {v} is out of range; not used");
                None
            }
        };
        let count = |v: f64| v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f64;
        Self {
            temperature: value(0, &|v| v >= 0.0).map(|v| v as f32),
            top_k: value(1, &count).map(|v| v as usize),
            top_p: value(2, &|v| v > 0.0 && v <= 1.0).map(|v| v as f32),
            min_p: value(3, &|v| (0.0..=1.0).contains(&v)).map(|v| v as f32),
            repetition_penalty: value(4, &|v| v > 0.0).map(|v| v as f32),
            // -1: the whole context (llama.cpp's `penalty_last_n`).
            repeat_last_n: value(5, &|v| v == -1.0 || count(v)).map(|v| {
                if v < 0.0 {
                    usize::MAX
                } else {
                    v as usize
                }
            }),
        }
    }

    /// From a GGUF file's `general.sampling.*` keys.
    pub fn from_gguf(ct: &candle_core::quantized::gguf_file::Content, origin: &str) -> Self {
        use candle_core::quantized::gguf_file::Value as V;
        let get = |name: &str| -> Option<f64> {
            let x = match ct.metadata.get(name)? {
                V::F32(x) => *x as f64,
                V::F64(x) => *x,
                V::U8(x) => *x as f64,
                V::U16(x) => *x as f64,
                V::U32(x) => *x as f64,
                V::U64(x) => *x as f64,
                V::I8(x) => *x as f64,
                V::I16(x) => *x as f64,
                V::I32(x) => *x as f64,
                V::I64(x) => *x as f64,
                _ => return None,
            };
            x.is_finite().then_some(x)
        };
        Self::read(
            get,
            [
                Some("general.sampling.temp"),
                Some("general.sampling.top_k"),
                Some("general.sampling.top_p"),
                Some("general.sampling.min_p"),
                Some("general.sampling.penalty_repeat"),
                Some("general.sampling.penalty_last_n"),
            ],
            origin,
        )
    }

    /// From an HF `generation_config.json` (vLLM's reading: the values stand whatever
    /// `do_sample` says).
    pub fn from_generation_config(gc: &serde_json::Value, origin: &str) -> Self {
        let get = |name: &str| gc.get(name)?.as_f64().filter(|x| x.is_finite());
        Self::read(
            get,
            [
                Some("temperature"),
                Some("top_k"),
                Some("top_p"),
                Some("min_p"),
                Some("repetition_penalty"),
                None,
            ],
            origin,
        )
    }
}

/// A model, its vocabulary and a description of both.
pub struct Loaded {
    pub model: Model,
    pub vocab: Vocab,
    pub format: ModelFormat,
    /// Human-readable origin (path or preset).
    pub origin: String,
    /// The CPU options the GGUF weights were loaded with: those asked for, or fewer copies
    /// when the memory plan did not leave room for them. `None` for other sources and devices.
    pub cpu_weights: Option<CpuWeights>,
    /// The memory the weights were planned to take on their device.
    pub weight_plan: WeightPlan,
    /// The files it was read from (a GGUF; an HF directory's config, tokenizer and
    /// safetensors; a preset's config), for telling models apart (a saved KV cache's model).
    pub files: Vec<PathBuf>,
}

/// Memory to plan a model's allocations against before loading it (host memory on the CPU,
/// the device's on a GPU).
pub struct MemoryPlan<'a> {
    pub budget: MemoryBudget,
    /// Bytes to leave free beside the weights for requests (a budgeted KV cache,
    /// activations), given the model's shape.
    pub reserve: &'a dyn Fn(&ModelConfig) -> u64,
}

/// The CPU options to load `weights` with under `mem`: `asked` when the weights and the
/// reserve fit in RAM, else without the dense prefill copies, else as stored; as stored beyond
/// RAM when swap holds it (with a warning); an error with the numbers when nothing fits. On a
/// GPU there are no copies to drop: the weights as stored fit in the device's memory or are
/// refused.
fn fit_weights(
    weights: &Weights,
    cfg: &ModelConfig,
    asked: CpuWeights,
    mem: Option<&MemoryPlan>,
    what: &str,
) -> Result<(CpuWeights, WeightPlan)> {
    let on_cpu = weights.device_dtype().0.is_cpu();
    let quantized = weights.gguf_content().is_some() || weights.random_weight_type().is_some();
    let describe = |c: CpuWeights| match (quantized, on_cpu) {
        (true, true) => c.describe(),
        (true, false) => "weights as stored",
        (false, _) => "dense weights",
    };
    let plan = weights.plan(cfg, asked);
    let Some(mem) = mem else {
        return Ok((asked, plan));
    };
    let reserve = (mem.reserve)(cfg);
    // The options in the order they are tried, each with its plan.
    let mut options = vec![(asked, plan)];
    for c in [
        CpuWeights {
            dense_prefill: false,
            ..asked
        },
        CpuWeights::AS_STORED,
    ] {
        if on_cpu && options.iter().all(|(o, _)| *o != c) {
            options.push((c, weights.plan(cfg, c)));
        }
    }
    for &(c, p) in &options {
        if p.peak().saturating_add(reserve) <= mem.budget.ram {
            if c != asked {
                tracing::warn!(
                    "{what}: {} need {}, beyond {}; loading {} ({}){}",
                    describe(asked),
                    human(plan.peak() + reserve),
                    mem.budget,
                    describe(c),
                    human(p.resident),
                    if asked.dense_prefill && !c.dense_prefill {
                        ": prefill runs quantized matmuls (slower, and results depend on the \
                         chunk size)"
                    } else {
                        ""
                    }
                );
            }
            return Ok((c, p));
        }
    }
    let (last, p) = *options.last().expect("one option");
    let need = p.peak().saturating_add(reserve);
    if need <= mem.budget.total {
        tracing::warn!(
            "{what}: {} ({} with what requests need) exceed the RAM available, {}: the system \
             will swap",
            describe(last),
            human(need),
            mem.budget
        );
        return Ok((last, p));
    }
    Err(ModelError::OutOfMemory(format!(
        "{what} need {} ({}: {} resident, {} in passing while loading) and a request {} beside \
         them; {}. Free memory, take a smaller model or quantization, or set the memory limit \
         (--memory-limit) if this is wrong",
        human(need),
        describe(last),
        human(p.resident),
        human(p.transient),
        human(reserve),
        mem.budget
    )))
}

/// Loads a GGUF file: metadata, tokenizer and weights (quantized weights stay quantized; `opts`
/// says what extra CPU copies to keep).
///
/// With `mem`, the weights are planned first (see [`fit_weights`]): copies that would not fit
/// are dropped, and a model that cannot fit at all is refused before anything is allocated.
pub fn load_gguf(
    path: &Path,
    device: &Device,
    dtype: DType,
    opts: CpuWeights,
    mem: Option<&MemoryPlan>,
) -> Result<Loaded> {
    if !path.exists() {
        return Err(ModelError::NotFound(path.to_path_buf()));
    }
    let mut weights = Weights::open_gguf(path, device, dtype, opts)?;
    let content = weights.gguf_content().expect("gguf source");
    let cfg = ModelConfig::from_gguf(content, path)?;
    if let Some(reason) = weights.mismatched_tensor(&cfg) {
        return Err(ModelError::BadGguf {
            path: path.to_path_buf(),
            reason: format!("its metadata does not match its tensors: {reason}"),
        });
    }
    let what = format!("the weights of {}", path.display());
    let (opts, weight_plan) = fit_weights(&weights, &cfg, opts, mem, &what)?;
    weights.set_cpu_weights(opts);
    let content = weights.gguf_content().expect("gguf source");
    let tok = tokenizer_from_gguf(content)?;
    let chat_template = match &tok.chat_template {
        Some(src) => Some(ChatTemplate::new(
            src,
            tok.bos_token.clone(),
            tok.eos_token.clone(),
        )?),
        None => None,
    };
    let vocab = Vocab {
        tokenizer: tok.tokenizer,
        bos_id: tok.bos_id,
        eos_ids: tok.eos_ids,
        add_bos: tok.add_bos,
        chat_template,
        template_tokens: (tok.bos_token, tok.eos_token),
        fim: tok.fim,
        sampling: SamplingDefaults::from_gguf(content, &path.display().to_string()),
    };
    let model = Model::load(&cfg, &weights)?;
    let unused = weights.unused_tensors();
    if !unused.is_empty() {
        return Err(ModelError::BadGguf {
            path: path.to_path_buf(),
            reason: format!(
                "{} tensor(s) that a {:?} model does not use: {}",
                unused.len(),
                cfg.arch,
                first_names(&unused)
            ),
        });
    }
    Ok(Loaded {
        model,
        vocab,
        format: ModelFormat::Gguf,
        origin: path.display().to_string(),
        cpu_weights: device.is_cpu().then_some(opts),
        weight_plan,
        files: vec![path.to_path_buf()],
    })
}

/// Loads an HF checkpoint directory: config.json, (sharded) safetensors, tokenizer.json,
/// tokenizer_config.json and generation_config.json.
pub fn load_hf_dir(
    dir: &Path,
    device: &Device,
    dtype: DType,
    mem: Option<&MemoryPlan>,
) -> Result<Loaded> {
    if !dir.is_dir() {
        return Err(ModelError::NotFound(dir.to_path_buf()));
    }
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Err(ModelError::NotFound(cfg_path));
    }
    let hf = HfConfig::load(&cfg_path)?;
    let cfg = hf.to_model_config(&cfg_path)?;
    let files = safetensors_files(dir)?;
    let weights = Weights::open_safetensors(&files, device, dtype)?;
    if weights.has(Key::AttnNorm, Some(cfg.num_layers)) {
        return Err(ModelError::BadConfig {
            path: cfg_path,
            reason: format!(
                "num_hidden_layers is {} but the checkpoint has tensors of layer {}",
                cfg.num_layers, cfg.num_layers
            ),
        });
    }
    if !cfg.tie_word_embeddings && !weights.has(Key::LmHead, None) {
        return Err(ModelError::BadConfig {
            path: cfg_path,
            reason: "the checkpoint has no `lm_head.weight` and tie_word_embeddings is not \
                     true: the output layer is missing"
                .into(),
        });
    }
    if let Some(reason) = weights.mismatched_tensor(&cfg) {
        return Err(ModelError::BadConfig {
            path: cfg_path,
            reason: format!("it does not match the checkpoint: {reason}"),
        });
    }
    let what = format!("the weights of {}", dir.display());
    let (_, weight_plan) = fit_weights(&weights, &cfg, CpuWeights::AS_STORED, mem, &what)?;
    let model = Model::load(&cfg, &weights)?;
    // Tensors the model did not read would be dropped without a word (biases under
    // `attention_bias: false`, layers past `num_hidden_layers`, another architecture's
    // norms). Not counted: RoPE's precomputed frequencies, which older checkpoints carry,
    // and an LM head saved beside tied embeddings (transformers ties it too).
    let unused: Vec<String> = weights
        .unused_tensors()
        .into_iter()
        .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
        .filter(|n| !(cfg.tie_word_embeddings && n == "lm_head.weight"))
        .collect();
    if !unused.is_empty() {
        return Err(ModelError::BadConfig {
            path: cfg_path,
            reason: format!(
                "the checkpoint has {} tensor(s) that a {:?} model of this config does not \
                 use: {}",
                unused.len(),
                cfg.arch,
                first_names(&unused)
            ),
        });
    }
    let vocab = hf_vocab(dir, &hf)?;
    let mut read = vec![cfg_path, dir.join("tokenizer.json")];
    read.extend(files);
    Ok(Loaded {
        model,
        vocab,
        format: ModelFormat::Safetensors,
        origin: dir.display().to_string(),
        cpu_weights: None,
        weight_plan,
        files: read,
    })
}

/// Builds a model of a preset's shape (an HF `config.json`) with seeded random weights.
/// Its tokenizer is a plain byte-level one: the text it produces is meaningless.
/// `on_host` draws the values on the CPU so that every device gets the same model.
/// `weight_type` quantizes its linears and embedding to that GGML type on the host, as a GGUF
/// file of that type holds them (see [`Weights::random_quantized`]), kept on the CPU with
/// `opts`' copies.
#[allow(clippy::too_many_arguments)]
pub fn load_random(
    config: &Path,
    device: &Device,
    dtype: DType,
    seed: u64,
    on_host: bool,
    weight_type: Option<GgmlDType>,
    opts: CpuWeights,
    mem: Option<&MemoryPlan>,
) -> Result<Loaded> {
    let hf = HfConfig::load(config)?;
    let cfg = hf.to_model_config(config)?;
    let (mut weights, asked) = match weight_type {
        Some(t) => (
            Weights::random_quantized(device, dtype, seed, on_host, t, opts)?,
            opts,
        ),
        None => (
            Weights::random(device, dtype, seed, on_host)?,
            CpuWeights::AS_STORED,
        ),
    };
    let what = format!("the random weights of {}", config.display());
    let (opts, weight_plan) = fit_weights(&weights, &cfg, asked, mem, &what)?;
    weights.set_cpu_weights(opts);
    let model = Model::load(&cfg, &weights)?;
    let kind = weight_type.map_or(String::new(), |t| format!(" in {}", weight_type_name(t)));
    Ok(Loaded {
        model,
        vocab: byte_vocab(cfg.vocab_size)?,
        format: ModelFormat::Random,
        origin: format!("{} (random weights{kind}, seed {seed})", config.display()),
        cpu_weights: (weight_type.is_some() && device.is_cpu()).then_some(opts),
        weight_plan,
        files: vec![config.to_path_buf()],
    })
}

/// The first four of `names` in backquotes, then `…` when there are more.
fn first_names(names: &[String]) -> String {
    let shown: Vec<String> = names.iter().take(4).map(|n| format!("`{n}`")).collect();
    let more = if names.len() > shown.len() {
        ", …"
    } else {
        ""
    };
    format!("{}{more}", shown.join(", "))
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            error: source,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::BadSafetensors {
                path: index.clone(),
                reason: e.to_string(),
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::BadSafetensors {
                path: index.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let mut files: Vec<PathBuf> = Vec::new();
        for (tensor, f) in map {
            let name = f.as_str().ok_or_else(|| ModelError::BadSafetensors {
                path: index.clone(),
                reason: format!("`weight_map` gives tensor `{tensor}` the file {f}, not a name"),
            })?;
            // Shards are files of the model's directory: no absolute path, no `..`.
            let rel = Path::new(name);
            let inside = !name.is_empty()
                && rel
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(ModelError::BadSafetensors {
                    path: index.clone(),
                    reason: format!(
                        "`weight_map` puts tensor `{tensor}` in `{name}`, which is not a file \
                         of the model's directory"
                    ),
                });
            }
            files.push(dir.join(rel));
        }
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(ModelError::NotFound(single))
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        error: source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// A special-token field of tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

/// Token ids under `key` of a JSON file (`file`): absent or null is none, else one id or a
/// list of ids, each an integer below `vocab` (the model's vocabulary).
fn ids_of(v: Option<&serde_json::Value>, key: &str, file: &Path, vocab: usize) -> Result<Vec<u32>> {
    let bad = |what: String| ModelError::BadConfig {
        path: file.to_path_buf(),
        reason: format!("{key}: {what}"),
    };
    let id = |x: &serde_json::Value| -> Result<u32> {
        match x.as_u64() {
            Some(i) if (i as usize) < vocab => Ok(i as u32),
            Some(i) => Err(bad(format!(
                "token id {i} is outside the model's vocabulary of {vocab}"
            ))),
            None => Err(bad(format!("{x} is not a token id"))),
        }
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(vec![]),
        Some(serde_json::Value::Array(a)) => a.iter().map(id).collect(),
        Some(x) => Ok(vec![id(x)?]),
    }
}

/// The chat template's source in an HF directory, where transformers looks for it:
/// `chat_template.jinja` (what transformers 4.50 and later save), else tokenizer_config.json's
/// `chat_template` (a string, or a list of named templates, of which `default` is used), else
/// `chat_template.json` (processors').
fn hf_chat_template(dir: &Path, tc: &serde_json::Value) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|error| ModelError::Io { path: jinja, error });
    }
    let from = |v: Option<&serde_json::Value>, file: &Path| -> Result<Option<String>> {
        let bad = |reason: String| ModelError::BadConfig {
            path: file.to_path_buf(),
            reason,
        };
        match v {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(serde_json::Value::Array(named)) => {
                fn name(t: &serde_json::Value) -> Option<&str> {
                    t.get("name").and_then(|n| n.as_str())
                }
                let default = named.iter().find(|t| name(t) == Some("default"));
                match default
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                {
                    Some(src) => Ok(Some(src.to_string())),
                    None => Err(bad(format!(
                        "chat_template is a list of templates ({}) without a `default` one \
                         with a `template` string",
                        named.iter().filter_map(name).collect::<Vec<_>>().join(", ")
                    ))),
                }
            }
            Some(other) => Err(bad(format!(
                "chat_template must be a string or a list of named templates, found {other}"
            ))),
        }
    };
    let tc_path = dir.join("tokenizer_config.json");
    if let Some(src) = from(tc.get("chat_template"), &tc_path)? {
        return Ok(Some(src));
    }
    let json_path = dir.join("chat_template.json");
    match read_json(&json_path)? {
        Some(v) => from(v.get("chat_template"), &json_path),
        None => Ok(None),
    }
}

fn hf_vocab(dir: &Path, hf: &HfConfig) -> Result<Vocab> {
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        return Err(ModelError::NotFound(tok_path));
    }
    let tokenizer = Tokenizer::from_file(&tok_path)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
    let gc = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
    let bos_token = token_text(tc.get("bos_token"));
    let eos_token = token_text(tc.get("eos_token"));
    let cfg_path = dir.join("config.json");
    let gc_path = dir.join("generation_config.json");
    let tc_path = dir.join("tokenizer_config.json");
    let vocab = hf.vocab_size;
    let bos_id = match bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
        Some(id) => Some(id),
        None => ids_of(hf.bos_token_id.as_ref(), "bos_token_id", &cfg_path, vocab)?
            .first()
            .copied(),
    };
    let mut eos_ids = ids_of(gc.get("eos_token_id"), "eos_token_id", &gc_path, vocab)?;
    eos_ids.extend(ids_of(
        hf.eos_token_id.as_ref(),
        "eos_token_id",
        &cfg_path,
        vocab,
    )?);
    if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
        eos_ids.push(id);
    }
    eos_ids.sort_unstable();
    eos_ids.dedup();
    // We encode without the post-processor and add BOS ourselves: when tokenizer_config.json
    // does not say, BOS is added iff the tokenizer's own post-processor adds it (Llama 3).
    let add_bos = match tc.get("add_bos_token").and_then(|b| b.as_bool()) {
        Some(b) => b,
        None => match (bos_id, tokenizer.encode("a", true)) {
            (Some(bos), Ok(enc)) => enc.get_ids().first() == Some(&bos),
            _ => false,
        },
    };
    if add_bos && bos_id.is_none() {
        return Err(ModelError::BadConfig {
            path: tc_path,
            reason: format!(
                "add_bos_token is true but the BOS token ({}) is not in tokenizer.json, and \
                 config.json gives no bos_token_id",
                bos_token.as_deref().unwrap_or("none named")
            ),
        });
    }
    let chat_template = match hf_chat_template(dir, &tc)? {
        Some(src) => Some(ChatTemplate::new(
            &src,
            bos_token.clone(),
            eos_token.clone(),
        )?),
        None => None,
    };
    let fim = crate::tokenizer::Fim::by_text(|t| tokenizer.token_to_id(t));
    let origin = dir.join("generation_config.json").display().to_string();
    Ok(Vocab {
        tokenizer,
        bos_id,
        eos_ids,
        add_bos,
        chat_template,
        template_tokens: (bos_token, eos_token),
        fim,
        sampling: SamplingDefaults::from_generation_config(&gc, &origin),
    })
}

/// A byte-level BPE with no merges: ids 0..256 are the bytes, the rest are never produced.
fn byte_vocab(vocab_size: usize) -> Result<Vocab> {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let alphabet = ByteLevel::alphabet();
    let mut chars: Vec<char> = alphabet.into_iter().collect();
    chars.sort_unstable();
    let vocab: tokenizers::models::bpe::Vocab = chars
        .iter()
        .enumerate()
        .take(vocab_size)
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, false)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(Vocab {
        tokenizer,
        bos_id: None,
        eos_ids: vec![],
        add_bos: false,
        chat_template: None,
        template_tokens: (None, None),
        fim: None,
        sampling: SamplingDefaults::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `generation_config.json`'s sampling fields, as vLLM reads them; values out of range
    /// are dropped, the rest kept.
    #[test]
    fn sampling_defaults_from_a_generation_config() {
        let gc = serde_json::json!({
            "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
            "min_p": 0.0, "repetition_penalty": 1.05, "eos_token_id": [1, 2]
        });
        let d = SamplingDefaults::from_generation_config(&gc, "test");
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_k: Some(20),
                top_p: Some(0.95),
                min_p: Some(0.0),
                repetition_penalty: Some(1.05),
                repeat_last_n: None,
            }
        );
        let bad = serde_json::json!({"temperature": -1.0, "top_k": 2.5, "top_p": 0.0,
                                     "min_p": 1.5, "repetition_penalty": 0.0});
        assert_eq!(
            SamplingDefaults::from_generation_config(&bad, "test"),
            SamplingDefaults::default()
        );
        assert_eq!(
            SamplingDefaults::from_generation_config(&serde_json::json!({}), "test"),
            SamplingDefaults::default()
        );
    }
}
