//! Shared helpers of the end-to-end tests: paths, models, fixtures.

use std::path::PathBuf;

/// Repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Every eviction policy the engine runs under a budget (CLI names), `full` aside.
pub const EVICTING_POLICIES: [&str; 8] = [
    "keydiff",
    "keydiff-mean",
    "tova",
    "snapkv",
    "h2o",
    "sink",
    "knorm",
    "random",
];

/// SmolLM2-135M-Instruct Q4_1 (llama arch), fetched by scripts/fetch-models.sh.
pub const SMOLLM2: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Qwen2.5-Coder-0.5B-Instruct (qwen2 arch), fetched by scripts/fetch-models.sh.
pub const QWEN: &str = "models/qwen2.5-coder-0.5b-instruct.gguf";

/// Path of a real model; panics with the fix when it is missing (tests never skip silently).
pub fn model(rel: &str) -> PathBuf {
    let p = root().join(rel);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh (the test suite needs the real models)",
        p.display()
    );
    p
}

/// A real model (`rel` as for [`model`]) under KeyDiff with a 64-token budget and 32-token
/// chunks, so that a prompt of a few lines already evicts.
pub fn evicting_engine(rel: &str) -> keydiff::Engine {
    use keydiff::{CacheConfig, Engine, EngineConfig, ModelSource, PolicyKind};
    let cfg = EngineConfig {
        cache: CacheConfig {
            policy: PolicyKind::parse("keydiff", 8, 0).unwrap(),
            budget: Some(64),
            ..CacheConfig::full(32)
        },
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(rel)), &cfg).unwrap()
}

/// One prompt of a llama.cpp fixture (scripts/gen-fixtures.py).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct FixturePrompt {
    pub name: String,
    pub text: String,
    pub special: bool,
    pub tokens: Vec<u32>,
    pub top_logits: Vec<(u32, f32)>,
    pub greedy: Vec<u32>,
    /// llama.cpp's gap between its first and second logit at each greedy step (recorded in
    /// the RoPE fixtures only).
    #[serde(default)]
    pub greedy_gaps: Option<Vec<f32>>,
    #[serde(default)]
    pub messages: Option<Vec<serde_json::Value>>,
}

/// Reference outputs of llama.cpp on one GGUF file.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Fixture {
    pub model_file: String,
    pub prompts: Vec<FixturePrompt>,
    /// keydiff's `--rope-*` flags for llama.cpp's RoPE scaling parameters the fixture was
    /// recorded under (`rope_scaling`, `rope_scale`, `yarn_orig_ctx`), if any.
    #[serde(default)]
    pub rope_flags: Option<serde_json::Value>,
}

/// Loads `tests/fixtures/llamacpp/<name>.json`.
pub fn fixture(name: &str) -> Fixture {
    let p = root().join(format!("tests/fixtures/llamacpp/{name}.json"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// llama.cpp's per-token NLL over a text's tokens, one full-cache pass
/// (scripts/gen-ppl-fixtures.py).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct PplFixture {
    pub model_file: String,
    pub tokens: Vec<u32>,
    /// `nll[i]`: the NLL of `tokens[i + 1]`.
    pub nll: Vec<f64>,
    pub mean_nll: f64,
}

/// Loads `tests/fixtures/llamacpp/ppl-<name>.json`.
pub fn ppl_fixture(name: &str) -> PplFixture {
    let p = root().join(format!("tests/fixtures/llamacpp/ppl-{name}.json"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Path of the built `keydiff` binary (cargo builds it for integration tests of this package).
pub fn keydiff_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe path");
    // target/<profile>/deps/<test> -> target/<profile>/keydiff
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("keydiff");
    assert!(
        bin.exists(),
        "{} not built: run `cargo build --release -p keydiff-cli` first (scripts/test.sh does)",
        bin.display()
    );
    bin
}

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};

/// HF name of a GGUF tensor name (`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`).
fn hf_name(gguf: &str) -> Option<String> {
    let map = |s: &str| -> Option<&'static str> {
        Some(match s {
            "attn_norm" => "input_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_output" => "self_attn.o_proj",
            "attn_q_norm" => "self_attn.q_norm",
            "attn_k_norm" => "self_attn.k_norm",
            "ffn_gate" => "mlp.gate_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            "ffn_gate_inp" => "mlp.gate",
            _ => return None,
        })
    };
    let parts: Vec<&str> = gguf.split('.').collect();
    match parts.as_slice() {
        ["token_embd", s] => Some(format!("model.embed_tokens.{s}")),
        ["output_norm", s] => Some(format!("model.norm.{s}")),
        ["output", s] => Some(format!("lm_head.{s}")),
        ["blk", l, t, s] => Some(format!("model.layers.{l}.{}.{s}", map(t)?)),
        _ => None,
    }
}

/// Undoes llama.cpp's Q/K row permutation (HF halves → GGUF interleaved pairs), per head.
pub fn unpermute_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let d = rows / heads;
    Ok(w.reshape((heads, d / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// Writes a GGUF model as an HF checkpoint directory: dequantized f32 safetensors (Q/K
/// un-permuted for `llama`), config.json, tokenizer.json and tokenizer_config.json.
pub fn export_hf(gguf: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut f = std::fs::File::open(gguf)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let cfg = keydiff_model::ModelConfig::from_gguf(&ct, gguf)?;
    let mut tensors = HashMap::new();
    for name in ct.tensor_infos.keys() {
        // A mixture's stacked experts: one tensor per expert.
        let experts = [
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ];
        if let ["blk", l, t, "weight"] = name.split('.').collect::<Vec<_>>().as_slice() {
            if let Some((_, proj)) = experts.iter().find(|(g, _)| g == t) {
                let w = ct
                    .tensor(&mut f, name, &Device::Cpu)?
                    .dequantize(&Device::Cpu)?;
                for e in 0..w.dim(0)? {
                    tensors.insert(
                        format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight"),
                        w.get(e)?.to_dtype(DType::F32)?,
                    );
                }
                continue;
            }
        }
        let Some(hf) = hf_name(name) else { continue };
        let mut t = ct
            .tensor(&mut f, name, &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        if cfg.rope_interleaved && name.ends_with("attn_q.weight") {
            t = unpermute_qk(&t, cfg.num_heads)?;
        } else if cfg.rope_interleaved && name.ends_with("attn_k.weight") {
            t = unpermute_qk(&t, cfg.num_kv_heads)?;
        }
        tensors.insert(hf, t.to_dtype(DType::F32)?);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    let mut config = serde_json::json!({
        "model_type": match cfg.arch {
            keydiff_model::Arch::Llama => "llama",
            keydiff_model::Arch::Qwen2 => "qwen2",
            keydiff_model::Arch::Qwen3 => "qwen3",
            keydiff_model::Arch::Qwen3Moe => "qwen3_moe",
        },
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
    });
    if let Some(m) = &cfg.moe {
        config.as_object_mut().expect("an object").extend(
            serde_json::json!({
                "num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
                "moe_intermediate_size": m.expert_intermediate_size,
                "norm_topk_prob": m.norm_topk_prob,
            })
            .as_object()
            .expect("an object")
            .clone(),
        );
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let tok = keydiff_model::tokenizer::tokenizer_from_gguf(&ct)?;
    tok.tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("saving tokenizer.json: {e}"))?;
    let tc = serde_json::json!({
        "add_bos_token": tok.add_bos,
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc)?,
    )?;
    let gc = serde_json::json!({ "eos_token_id": tok.eos_ids });
    std::fs::write(dir.join("generation_config.json"), gc.to_string())
        .context("generation_config.json")?;
    Ok(())
}

/// A GGUF file's metadata and its tensors, each by name and sorted.
pub type GgufParts = (
    Vec<(String, gguf_file::Value)>,
    Vec<(String, candle_core::quantized::QTensor)>,
);

/// A GGUF file's metadata and tensors, to write again changed.
pub fn read_gguf(path: &Path) -> Result<GgufParts> {
    let mut f = std::fs::File::open(path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut md: Vec<(String, gguf_file::Value)> = ct.metadata.clone().into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    let ts = names
        .iter()
        .map(|n| Ok(((*n).clone(), ct.tensor(&mut f, n, &Device::Cpu)?)))
        .collect::<Result<_>>()?;
    Ok((md, ts))
}

/// A fresh, empty temporary directory for one test.
pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("keydiff-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A tiny Qwen 3 (`general.architecture = qwen3`) with seeded random f32 weights and the real
/// tokenizer of Qwen2.5-Coder's GGUF (Qwen 3 uses the same), written by candle's GGUF writer.
/// Its shapes are Qwen 3's in small: 2 layers, hidden 64, 4 query heads and 2 KV heads of
/// size 32 (so queries are wider than the hidden state, as in Qwen 3's head_dim 128), an
/// MLP of 192, tied embeddings, RoPE base 1e6, and per-head q/k RMSNorm weights spread over
/// [0.5, 4] (`unit_qk_norms`: all 1 instead, to show a test depends on them).
///
/// The same bytes on every machine: `scripts/gen-fixtures.py qwen3` records llama.cpp's
/// logits on the file `cargo run -p keydiff-tests --example tiny-qwen3` writes, and the
/// parity test writes it again.
pub fn write_tiny_qwen3(path: &Path, unit_qk_norms: bool) -> Result<()> {
    write_tiny_qwen3_like(path, unit_qk_norms, None)
}

/// A tiny Qwen 3 MoE (`general.architecture = qwen3moe`): [`write_tiny_qwen3`]'s model with a
/// mixture in place of each MLP, as Qwen3-30B-A3B has in small: 8 experts of width 64, 2 of
/// them run per token, renormalised. The router is drawn wider than the other linears
/// (U(-3a, 3a)) so that each token's choice is clear. Experts are stored as `experts`
/// (F32 for the exact-parity fixture, Q8_0 or Q4_0 to test the split of a stacked quantized
/// tensor); everything else is F32.
///
/// `scripts/gen-fixtures.py qwen3moe` records llama.cpp's logits on the files
/// `cargo run -p keydiff-tests --example tiny-qwen3 -- OUT.gguf --moe [q8_0]` writes.
pub fn write_tiny_qwen3_moe(path: &Path, experts: candle_core::quantized::GgmlDType) -> Result<()> {
    write_tiny_qwen3_like(path, false, Some(experts))
}

/// Experts per layer, experts per token and expert width of [`write_tiny_qwen3_moe`].
pub const TINY_MOE: (usize, usize, usize) = (8, 2, 64);

fn write_tiny_qwen3_like(
    path: &Path,
    unit_qk_norms: bool,
    moe: Option<candle_core::quantized::GgmlDType>,
) -> Result<()> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::{GgmlDType, QTensor};
    const HIDDEN: usize = 64;
    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 32;
    const FFN: usize = 192;
    const LAYERS: usize = 2;

    let mut f = std::fs::File::open(model(QWEN))?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut md: Vec<(String, Value)> = ct
        .metadata
        .into_iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let vocab = match md.iter().find(|(k, _)| k == "tokenizer.ggml.tokens") {
        Some((_, Value::Array(a))) => a.len(),
        _ => anyhow::bail!("{QWEN} has no token list"),
    };
    let arch = if moe.is_some() { "qwen3moe" } else { "qwen3" };
    let (experts, used, expert_ff) = TINY_MOE;
    md.push(("general.architecture".into(), Value::String(arch.into())));
    md.push((
        "general.name".into(),
        Value::String(format!("tiny random {arch}")),
    ));
    if moe.is_some() {
        for (k, v) in [
            ("expert_count", experts),
            ("expert_used_count", used),
            ("expert_feed_forward_length", expert_ff),
        ] {
            md.push((format!("{arch}.{k}"), Value::U32(v as u32)));
        }
    }
    for (k, v) in [
        ("block_count", LAYERS),
        ("context_length", 4096),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("attention.key_length", HEAD_DIM),
        ("attention.value_length", HEAD_DIM),
    ] {
        md.push((format!("{arch}.{k}"), Value::U32(v as u32)));
    }
    md.push((format!("{arch}.rope.freq_base"), Value::F32(1e6)));
    md.push((
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-6),
    ));

    // splitmix64, uniform in [lo, hi).
    let mut state = 0x5EED_0003u64;
    let mut uniform = move |lo: f32, hi: f32| -> f32 {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        lo + (hi - lo) * ((z >> 40) as f32 / (1u64 << 24) as f32)
    };
    let mut tensor = |shape: &[usize], lo: f32, hi: f32, t: GgmlDType| -> Result<QTensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| uniform(lo, hi)).collect();
        let x = Tensor::from_vec(v, shape, &Device::Cpu)?;
        Ok(QTensor::quantize(&x, t)?)
    };
    let f32t = GgmlDType::F32;
    // Linears keep unit variance: U(-a, a) with a = sqrt(3 / fan_in).
    let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut ts = vec![
        (
            "token_embd.weight".to_string(),
            tensor(&[vocab, HIDDEN], -1.0, 1.0, f32t)?,
        ),
        (
            "output_norm.weight".to_string(),
            tensor(&[HIDDEN], 0.5, 1.5, f32t)?,
        ),
    ];
    for l in 0..LAYERS {
        let (nlo, nhi) = if unit_qk_norms {
            (1.0, 1.0)
        } else {
            (0.5, 4.0)
        };
        let mut layer = vec![
            ("attn_norm", vec![HIDDEN], 0.5, 1.5, f32t),
            ("attn_q", vec![q, HIDDEN], -lin(HIDDEN), lin(HIDDEN), f32t),
            ("attn_k", vec![kv, HIDDEN], -lin(HIDDEN), lin(HIDDEN), f32t),
            ("attn_v", vec![kv, HIDDEN], -lin(HIDDEN), lin(HIDDEN), f32t),
            ("attn_q_norm", vec![HEAD_DIM], nlo, nhi, f32t),
            ("attn_k_norm", vec![HEAD_DIM], nlo, nhi, f32t),
            ("attn_output", vec![HIDDEN, q], -lin(q), lin(q), f32t),
            ("ffn_norm", vec![HIDDEN], 0.5, 1.5, f32t),
        ];
        let (a, b) = (lin(HIDDEN), lin(expert_ff));
        match moe {
            None => layer.extend([
                ("ffn_gate", vec![FFN, HIDDEN], -a, a, f32t),
                ("ffn_up", vec![FFN, HIDDEN], -a, a, f32t),
                ("ffn_down", vec![HIDDEN, FFN], -lin(FFN), lin(FFN), f32t),
            ]),
            Some(t) => layer.extend([
                (
                    "ffn_gate_inp",
                    vec![experts, HIDDEN],
                    -3.0 * a,
                    3.0 * a,
                    f32t,
                ),
                ("ffn_gate_exps", vec![experts, expert_ff, HIDDEN], -a, a, t),
                ("ffn_up_exps", vec![experts, expert_ff, HIDDEN], -a, a, t),
                ("ffn_down_exps", vec![experts, HIDDEN, expert_ff], -b, b, t),
            ]),
        }
        for (name, shape, lo, hi, t) in layer {
            ts.push((format!("blk.{l}.{name}.weight"), tensor(&shape, lo, hi, t)?));
        }
    }
    let mut out = std::fs::File::create(path)?;
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md, &ts)?;
    Ok(())
}
