//! A corrupt model (GGUF, or an HF directory) fails to load with an error that names the
//! problem. It must never panic, abort on a wild allocation, or load and run on misread
//! weights.
//!
//! The fixture is a tiny Llama (2 layers, hidden 64) that keeps SmolLM2's real tokenizer
//! metadata, written by candle's GGUF writer, and its HF export. Each test corrupts it in one
//! way, then loads it and generates from it in this process. A panic is caught and fails the
//! test, naming the corruption.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use keydiff::{CacheConfig, Engine, EngineConfig, GenerateParams, ModelSource, Prompt};
use keydiff_tests::{export_hf, model, temp_dir, SMOLLM2};

const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const VOCAB: usize = 49152;

fn tiny_metadata() -> Vec<(String, Value)> {
    let mut f = std::fs::File::open(model(SMOLLM2)).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, Value)> = ct.metadata.into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, v) in [
        ("llama.embedding_length", HIDDEN),
        ("llama.block_count", LAYERS),
        ("llama.attention.head_count", 4),
        ("llama.attention.head_count_kv", 2),
        ("llama.feed_forward_length", 128),
        ("llama.context_length", 512),
        ("llama.rope.dimension_count", HIDDEN / 4),
    ] {
        set(&mut md, k, Some(Value::U32(v as u32)));
    }
    md
}

/// Sets (or with None removes) one metadata key.
fn set(md: &mut Vec<(String, Value)>, key: &str, v: Option<Value>) {
    md.retain(|(k, _)| k != key);
    if let Some(v) = v {
        md.push((key.to_string(), v));
    }
}

/// The tensors, in file order: Q8_0 matrices and f32 norms, with smooth, seeded values.
fn tiny_tensors() -> Vec<(String, QTensor)> {
    let q = |shape: &[usize], seed: f64| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f64 * seed).sin() * 0.1) as f32)
            .collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        let dtype = if shape.len() == 1 {
            GgmlDType::F32
        } else {
            GgmlDType::Q8_0
        };
        QTensor::quantize(&t, dtype).unwrap()
    };
    let mut ts = vec![
        ("token_embd.weight".to_string(), q(&[VOCAB, HIDDEN], 0.37)),
        ("output_norm.weight".to_string(), q(&[HIDDEN], 0.0)),
    ];
    for l in 0..LAYERS {
        for (n, s) in [
            ("attn_norm", vec![HIDDEN]),
            ("ffn_norm", vec![HIDDEN]),
            ("attn_q", vec![HIDDEN, HIDDEN]),
            ("attn_k", vec![HIDDEN / 2, HIDDEN]),
            ("attn_v", vec![HIDDEN / 2, HIDDEN]),
            ("attn_output", vec![HIDDEN, HIDDEN]),
            ("ffn_gate", vec![128, HIDDEN]),
            ("ffn_up", vec![128, HIDDEN]),
            ("ffn_down", vec![HIDDEN, 128]),
        ] {
            ts.push((format!("blk.{l}.{n}.weight"), q(&s, 1.3 + l as f64)));
        }
    }
    ts
}

/// A copy of `ts` (each tensor in its stored type) without tensor `name`, or with `with` in
/// its place.
fn replaced(ts: &[(String, QTensor)], name: &str, with: Option<QTensor>) -> Vec<(String, QTensor)> {
    let mut v: Vec<(String, QTensor)> = ts
        .iter()
        .filter(|(n, _)| n != name)
        .map(|(n, t)| {
            let q = QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), t.dtype());
            (n.clone(), q.unwrap())
        })
        .collect();
    if let Some(t) = with {
        v.push((name.to_string(), t));
    }
    v
}

fn write(path: &Path, md: &[(String, Value)], ts: &[(String, QTensor)]) {
    let mut out = std::fs::File::create(path).unwrap();
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md, &ts).unwrap();
}

/// A fixed pseudo-random sequence (splitmix64) of numbers below `n`, so that a failure can be
/// rerun.
fn seeded(seed: u64) -> impl FnMut(usize) -> usize {
    let mut state = seed;
    move |n: usize| -> usize {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

#[derive(Debug)]
enum Outcome {
    /// Loaded and generated.
    Ran,
    Failed(String),
    Panicked(String),
}

/// Loads `path` (a GGUF file or an HF directory) and generates two tokens, catching a panic.
fn load_and_run(path: &Path) -> Outcome {
    load_and_run_prompt(path, Prompt::Text("Hello there, how are you".into()))
}

/// Loads `path` and generates two tokens from `prompt`, catching a panic.
fn load_and_run_prompt(path: &Path, prompt: Prompt) -> Outcome {
    let run = || -> keydiff::Result<()> {
        let cfg = EngineConfig {
            cache: CacheConfig::full(32),
            ..Default::default()
        };
        let source = if path.is_dir() {
            ModelSource::HfDir(path.to_path_buf())
        } else {
            ModelSource::Gguf(path.to_path_buf())
        };
        let e = Engine::load(&source, &cfg)?;
        let params = GenerateParams {
            prompt,
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        };
        e.generate(&params, |_| {})?;
        Ok(())
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => Outcome::Ran,
        Ok(Err(e)) => Outcome::Failed(e.to_string()),
        Err(p) => Outcome::Panicked(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
    }
}

/// Expects a load failure whose message contains `needle`.
fn expect_error(what: &str, path: &Path, needle: &str) {
    match load_and_run(path) {
        Outcome::Failed(e) => assert!(e.contains(needle), "{what}: expected `{needle}` in: {e}"),
        other => panic!("{what}: expected an error with `{needle}`, got {other:?}"),
    }
}

#[test]
fn the_uncorrupted_fixture_runs() {
    let d = temp_dir("gguf-fixture");
    let p = d.join("tiny.gguf");
    write(&p, &tiny_metadata(), &tiny_tensors());
    assert!(matches!(load_and_run(&p), Outcome::Ran));
}

/// Each wrong metadata value fails, and the message names the key or the quantity.
#[test]
fn metadata_corruptions_are_named() {
    let d = temp_dir("gguf-metadata");
    let p = d.join("m.gguf");
    let ts = tiny_tensors();
    let cases: Vec<(&str, Option<Value>, &str)> = vec![
        // candle divides by the alignment unchecked: 0 used to panic.
        (
            "general.alignment",
            Some(Value::U32(0)),
            "`general.alignment` is 0",
        ),
        (
            "general.alignment",
            Some(Value::U8(0)),
            "`general.alignment` is 0",
        ),
        (
            "general.alignment",
            Some(Value::U32(48)),
            "must be a power of two",
        ),
        // One part of a split GGUF: named as such, not as the tensors it lacks.
        (
            "split.count",
            Some(Value::U16(3)),
            "part of a GGUF split in 3 files",
        ),
        // Used to abort on allocating 4G layers.
        (
            "llama.block_count",
            Some(Value::U32(u32::MAX)),
            "layers 4294967295 is beyond the supported maximum 512",
        ),
        // Used to wrap to 2^64 - 1 (`as usize`).
        (
            "llama.embedding_length",
            Some(Value::I32(-1)),
            "`llama.embedding_length` must be a non-negative integer, found I32(-1)",
        ),
        // candle's to_u64 reads a bool as 0 or 1.
        (
            "llama.block_count",
            Some(Value::Bool(true)),
            "`llama.block_count` must be a non-negative integer",
        ),
        // Used to fall back to the default silently.
        (
            "llama.attention.head_count_kv",
            Some(Value::String("2".into())),
            "`llama.attention.head_count_kv` must be a non-negative integer",
        ),
        (
            "llama.rope.freq_base",
            Some(Value::F32(f32::NAN)),
            "`llama.rope.freq_base` must be a finite number",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Some(Value::F32(-1e-5)),
            "must be from 0 to 0.1",
        ),
        (
            "llama.context_length",
            Some(Value::U64(1 << 40)),
            "context length 1099511627776 is beyond",
        ),
        // Used to be ignored: RoPE on all of the head, and unscaled.
        (
            "llama.rope.dimension_count",
            Some(Value::U32(8)),
            "partial RoPE is not supported",
        ),
        (
            "llama.rope.scaling.factor",
            Some(Value::F32(f32::INFINITY)),
            "`llama.rope.scaling.factor` must be a finite number",
        ),
        (
            "llama.rope.scale_linear",
            Some(Value::F32(-2.0)),
            "linear RoPE scaling factor -2 must be finite and positive",
        ),
        (
            "llama.rope.scaling.type",
            Some(Value::U32(1)),
            "`llama.rope.scaling.type` must be a string",
        ),
        // Used to run the first layer only.
        (
            "llama.block_count",
            Some(Value::U32(1)),
            "`llama.block_count` is 1 but the file has tensor `blk.1.attn_norm.weight`",
        ),
        (
            "llama.block_count",
            Some(Value::U32(3)),
            "blk.2.attn_norm.weight",
        ),
        ("llama.block_count", None, "`llama.block_count`"),
        (
            "tokenizer.ggml.bos_token_id",
            Some(Value::U64(u64::MAX)),
            "holds 18446744073709551615, expected a u32",
        ),
        (
            "tokenizer.ggml.eos_token_id",
            Some(Value::U32(VOCAB as u32)),
            "outside the vocab of 49152 tokens",
        ),
        // Used to be refused as "not enough memory": the memory plan came before the shapes.
        (
            "llama.feed_forward_length",
            Some(Value::U32(1 << 20)),
            "its metadata does not match its tensors: tensor `blk.0.ffn_gate.weight` has shape \
             [128, 64]",
        ),
        // As llama.cpp: the embedding has a row per token of the list.
        (
            "llama.vocab_size",
            Some(Value::U32(40_000)),
            "`llama.vocab_size` is 40000 but tokenizer.ggml.tokens has 49152 tokens",
        ),
        // Used to divide by zero (a panic) in attention.
        (
            "llama.attention.head_count",
            Some(Value::U32(0)),
            "query heads must be non-zero",
        ),
        // Used to be blamed on partial RoPE.
        (
            "llama.attention.head_count",
            Some(Value::U32(6)),
            "`llama.embedding_length` 64 is not a multiple of `llama.attention.head_count` 6",
        ),
        // Used to give NaN logits, then an empty reply.
        (
            "llama.attention.layer_norm_rms_epsilon",
            Some(Value::F32(1e30)),
            "must be from 0 to 0.1",
        ),
        (
            "llama.rope.freq_base",
            Some(Value::F32(1e-30)),
            "must be above 1 and at most 1e12",
        ),
    ];
    let mut failures = Vec::new();
    for (key, value, needle) in cases {
        let mut md = tiny_metadata();
        let what = format!("{key} = {value:?}");
        set(&mut md, key, value);
        write(&p, &md, &ts);
        match load_and_run(&p) {
            Outcome::Failed(e) if e.contains(needle) => {}
            other => failures.push(format!("{what}: expected `{needle}`, got {other:?}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    // Cut inside the header: said so, not as std's "failed to fill whole buffer".
    write(&p, &tiny_metadata(), &ts);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..20]).unwrap();
    expect_error(
        "cut header",
        &p,
        "the file ends inside its header (20 bytes)",
    );
    // NaN weights (a norm, stored as f32) load, but give NaN logits: refused at the first
    // token, instead of an empty or garbage reply (the argmax of NaNs is token 0).
    let nan = Tensor::full(f32::NAN, HIDDEN, &Device::Cpu).unwrap();
    let broken = replaced(
        &ts,
        "output_norm.weight",
        Some(QTensor::quantize(&nan, GgmlDType::F32).unwrap()),
    );
    write(&p, &tiny_metadata(), &broken);
    expect_error("NaN weights", &p, "logits after the prompt are not finite");
    // A key twice: candle keeps the last value, llama.cpp refuses the file; so do we.
    let mut md = tiny_metadata();
    md.push(("llama.rope.freq_base".into(), Value::F32(10.0)));
    write(&p, &md, &ts);
    expect_error(
        "duplicate key",
        &p,
        "metadata key `llama.rope.freq_base` appears twice",
    );
    // Scaling that changes nothing still loads.
    for (ty, factor, legacy) in [
        (Some("none"), None, None),
        (Some("linear"), Some(1.0), None),
        (Some("yarn"), None, None),
        // llama.cpp never scales when the type is `none`.
        (Some("none"), Some(4.0), Some(2.0)),
        (None, Some(0.0), Some(1.0)),
    ] {
        let mut md = tiny_metadata();
        set(
            &mut md,
            "llama.rope.scaling.type",
            ty.map(|t| Value::String(t.into())),
        );
        set(&mut md, "llama.rope.scaling.factor", factor.map(Value::F32));
        set(&mut md, "llama.rope.scale_linear", legacy.map(Value::F32));
        write(&p, &md, &ts);
        let got = load_and_run(&p);
        assert!(
            matches!(got, Outcome::Ran),
            "{ty:?} {factor:?} {legacy:?}: {got:?}"
        );
    }
    // Scalings keydiff does not compute are refused, naming the key.
    // What, the keys beside YaRN ×4, the error.
    type Refused = (&'static str, Vec<(&'static str, Value)>, &'static str);
    let refused: [Refused; 4] = [
        (
            "longrope",
            vec![("llama.rope.scaling.type", Value::String("longrope".into()))],
            "`llama.rope.scaling.type` is `longrope` (factor 4)",
        ),
        (
            "yarn log multiplier",
            vec![("llama.rope.scaling.yarn_log_multiplier", Value::F32(0.1))],
            "`llama.rope.scaling.yarn_log_multiplier` is 0.1",
        ),
        (
            "yarn ext factor",
            vec![("llama.rope.scaling.yarn_ext_factor", Value::F32(0.5))],
            "`llama.rope.scaling.yarn_ext_factor` is 0.5",
        ),
        (
            "yarn x0.5",
            vec![("llama.rope.scaling.factor", Value::F32(0.5))],
            "YaRN RoPE scaling factor 0.5 must be at least 1",
        ),
    ];
    for (what, keys, needle) in refused {
        let mut md = tiny_metadata();
        set(
            &mut md,
            "llama.rope.scaling.type",
            Some(Value::String("yarn".into())),
        );
        set(&mut md, "llama.rope.scaling.factor", Some(Value::F32(4.0)));
        for (k, v) in keys {
            set(&mut md, k, Some(v));
        }
        write(&p, &md, &ts);
        expect_error(what, &p, needle);
    }
}

/// GGUF's RoPE scaling keys (as convert_hf_to_gguf.py writes YaRN for Qwen 2.5) are read:
/// the config holds the scaling and its context, the same as the unscaled file's under the
/// same scaling given as llama.cpp's flags (which tests/tests/llamacpp_parity.rs holds to
/// llama.cpp's logits on the real models; this fixture's logits hardly depend on attention),
/// and `--rope-scaling none` removes it.
#[test]
fn rope_scaling_keys_are_read() {
    use keydiff::{RopeOverride, RopeScaling, RopeScalingType};
    let d = temp_dir("gguf-rope-scaling");
    let ts = tiny_tensors();
    let load = |md: &[(String, Value)], rope: RopeOverride| {
        let p = d.join("a.gguf");
        write(&p, md, &ts);
        let cfg = EngineConfig {
            cache: CacheConfig::full(32),
            rope,
            ..Default::default()
        };
        Engine::load(&ModelSource::Gguf(p), &cfg).unwrap()
    };
    let yarn = |f: f64| RopeOverride {
        scaling: Some(RopeScalingType::Yarn),
        factor: Some(f),
        ..Default::default()
    };
    let plain = load(&tiny_metadata(), RopeOverride::default());
    assert_eq!(plain.model_config().rope_scaling, None);
    // What, the keys, the same as flags, the context.
    type Case = (
        &'static str,
        Vec<(&'static str, Value)>,
        RopeOverride,
        usize,
    );
    let cases: Vec<Case> = vec![
        (
            "yarn x4 from 128",
            vec![
                ("llama.rope.scaling.type", Value::String("yarn".into())),
                ("llama.rope.scaling.factor", Value::F32(4.0)),
                (
                    "llama.rope.scaling.original_context_length",
                    Value::U32(128),
                ),
                ("llama.rope.scaling.yarn_beta_fast", Value::F32(16.0)),
                ("llama.rope.scaling.yarn_ext_factor", Value::F32(-1.0)),
            ],
            RopeOverride {
                original_context: Some(128),
                beta_fast: Some(16.0),
                ..yarn(4.0)
            },
            // The file's 512 stands: 4 × 128 is no more.
            512,
        ),
        (
            "yarn x4",
            vec![
                ("llama.rope.scaling.type", Value::String("yarn".into())),
                ("llama.rope.scaling.factor", Value::F32(4.0)),
            ],
            yarn(4.0),
            2048,
        ),
        (
            "linear x2, no type",
            vec![("llama.rope.scaling.factor", Value::F32(2.0))],
            RopeOverride {
                scaling: Some(RopeScalingType::Linear),
                factor: Some(2.0),
                ..Default::default()
            },
            1024,
        ),
        (
            "legacy scale_linear x3",
            vec![("llama.rope.scale_linear", Value::F32(3.0))],
            RopeOverride {
                factor: Some(3.0),
                ..Default::default()
            },
            1536,
        ),
    ];
    for (what, keys, rope, context) in cases {
        let mut md = tiny_metadata();
        for (k, v) in keys {
            set(&mut md, k, Some(v));
        }
        let from_file = load(&md, RopeOverride::default());
        let c = from_file.model_config();
        assert_eq!(c.context(), context, "{what}");
        assert!(
            matches!(
                (&c.rope_scaling, what.starts_with("yarn")),
                (Some(RopeScaling::Yarn(_)), true) | (Some(RopeScaling::Linear { .. }), false)
            ),
            "{what}: {:?}",
            c.rope_scaling
        );
        let overridden = load(&tiny_metadata(), rope);
        assert_eq!(overridden.model_config(), c, "{what}");
        // `--rope-scaling none` on the scaled file gives the unscaled model back.
        let off = RopeOverride {
            scaling: Some(RopeScalingType::None),
            ..Default::default()
        };
        let off = load(&md, off);
        assert_eq!(off.model_config(), plain.model_config(), "{what}");
    }
}

/// A zero alignment is found wherever candle would read it: candle would divide by it.
#[test]
fn zero_alignment_is_found_where_candle_reads_it() {
    let d = temp_dir("gguf-alignment");
    let p = d.join("a.gguf");
    let ts = tiny_tensors();
    let zero = || Value::U32(0);
    let nested = (0..6).fold(Value::U8(1), |v, _| Value::Array(vec![v]));
    let cases: Vec<(&str, Vec<(String, Value)>)> = vec![
        // candle keeps the last of duplicate keys.
        (
            "duplicate key, last 0",
            vec![
                ("general.alignment".into(), Value::U32(32)),
                ("general.alignment".into(), zero()),
            ],
        ),
        // candle drops trailing NULs from keys.
        (
            "key with NULs",
            vec![("general.alignment\0\0".into(), zero())],
        ),
        // Nested arrays before the key.
        (
            "after nested arrays",
            vec![
                ("a.nested".into(), nested),
                ("general.alignment".into(), zero()),
            ],
        ),
        ("as i16", vec![("general.alignment".into(), Value::I16(0))]),
    ];
    for (what, extra) in cases {
        let mut md = tiny_metadata();
        md.retain(|(k, _)| k != "general.alignment");
        // Write the extra entries first, so that the tokenizer arrays come after them.
        let md: Vec<(String, Value)> = extra.into_iter().chain(md).collect();
        write(&p, &md, &ts);
        expect_error(what, &p, "`general.alignment` is 0");
    }
    // candle also reads the byte-swapped magic `FUGG`.
    let mut md = tiny_metadata();
    set(&mut md, "general.alignment", Some(zero()));
    write(&p, &md, &ts);
    let mut b = std::fs::read(&p).unwrap();
    b[..4].copy_from_slice(b"FUGG");
    std::fs::write(&p, &b).unwrap();
    expect_error("FUGG magic", &p, "`general.alignment` is 0");
    // A negative alignment is not taken by candle (it keeps 32), so the file loads.
    let mut md = tiny_metadata();
    set(&mut md, "general.alignment", Some(Value::I32(-8)));
    write(&p, &md, &ts);
    assert!(matches!(load_and_run(&p), Outcome::Ran));
}

/// Llama 3.1's `rope_freqs` must hold one positive factor per rotated pair (head_dim / 2 = 8
/// here); a short tensor used to scale only the first pairs, and a 0 to give infinities.
#[test]
fn rope_freqs_are_checked() {
    let d = temp_dir("gguf-rope-freqs");
    let p = d.join("r.gguf");
    for (values, ok) in [
        (vec![1.0f32; 8], true),
        (vec![1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0], true),
        (vec![1.0; 4], false),
        (vec![1.0; 16], false),
        (vec![1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], false),
        (vec![1.0, 1.0, f32::NAN, 1.0, 1.0, 1.0, 1.0, 1.0], false),
    ] {
        let mut ts = tiny_tensors();
        let n = values.len();
        let t = Tensor::from_vec(values.clone(), n, &Device::Cpu).unwrap();
        ts.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&t, GgmlDType::F32).unwrap(),
        ));
        write(&p, &tiny_metadata(), &ts);
        match load_and_run(&p) {
            Outcome::Ran if ok => {}
            Outcome::Failed(e) if !ok => assert!(
                e.contains("`rope_freqs.weight` must hold 8 finite positive factors"),
                "{values:?}: {e}"
            ),
            other => panic!("{values:?}: {other:?}"),
        }
    }
}

/// A tensor the architecture does not use is refused, as llama.cpp refuses it ("wrong number
/// of tensors"): the file is likely another variant than its metadata says. Llama 3.1's
/// `rope_freqs` counts as unused in a Qwen 2 file; it used to be applied there.
#[test]
fn unused_tensors_are_refused() {
    let d = temp_dir("gguf-unused");
    let p = d.join("u.gguf");
    let f32_tensor = |n: usize| {
        let t = Tensor::ones(n, candle_core::DType::F32, &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::F32).unwrap()
    };
    let mut ts = tiny_tensors();
    ts.push(("blk.0.ffn_gate_inp.weight".into(), f32_tensor(64)));
    write(&p, &tiny_metadata(), &ts);
    expect_error(
        "MoE router",
        &p,
        "1 tensor(s) that a Llama model does not use: `blk.0.ffn_gate_inp.weight`",
    );
    // The same model as Qwen 2: runs, but not with rope_freqs.
    let qwen: Vec<(String, Value)> = tiny_metadata()
        .into_iter()
        .map(|(k, v)| match k.strip_prefix("llama.") {
            Some(rest) => (format!("qwen2.{rest}"), v),
            None if k == "general.architecture" => (k, Value::String("qwen2".into())),
            None => (k, v),
        })
        .collect();
    write(&p, &qwen, &tiny_tensors());
    let got = load_and_run(&p);
    assert!(matches!(got, Outcome::Ran), "{got:?}");
    let mut ts = tiny_tensors();
    ts.push(("rope_freqs.weight".into(), f32_tensor(8)));
    write(&p, &qwen, &ts);
    expect_error(
        "qwen rope_freqs",
        &p,
        "a Qwen2 model does not use: `rope_freqs.weight`",
    );
}

/// Qwen 3's q/k norms: missing, of another size than a head, or in a Qwen 2 file, each is
/// refused naming the tensor; and a model run with them must have them all.
#[test]
fn qwen3_norms_are_checked() {
    let d = temp_dir("gguf-qwen3");
    let good = d.join("q3.gguf");
    keydiff_tests::write_tiny_qwen3(&good, false).unwrap();
    let (md, ts) = keydiff_tests::read_gguf(&good).unwrap();
    let p = d.join("bad.gguf");
    let without = |gone: &str| replaced(&ts, gone, None);
    for gone in ["blk.1.attn_q_norm.weight", "blk.0.attn_k_norm.weight"] {
        write(&p, &md, &without(gone));
        expect_error(gone, &p, gone);
    }
    // A norm over the whole hidden state instead of one head.
    let mut wide = without("blk.0.attn_q_norm.weight");
    let t = Tensor::ones(64, candle_core::DType::F32, &Device::Cpu).unwrap();
    wide.push((
        "blk.0.attn_q_norm.weight".into(),
        QTensor::quantize(&t, GgmlDType::F32).unwrap(),
    ));
    write(&p, &md, &wide);
    expect_error("hidden-wide q norm", &p, "blk.0.attn_q_norm.weight");
    // The same tensors declared as Qwen 2, which has no such norms.
    let qwen2: Vec<(String, Value)> = md
        .iter()
        .map(|(k, v)| match k.strip_prefix("qwen3.") {
            Some(rest) => (format!("qwen2.{rest}"), v.clone()),
            None if k == "general.architecture" => (k.clone(), Value::String("qwen2".into())),
            None => (k.clone(), v.clone()),
        })
        .collect();
    write(&p, &qwen2, &without(""));
    expect_error(
        "qwen3 tensors as qwen2",
        &p,
        "tensor(s) that a Qwen2 model does not use: `blk.0.attn_k_norm.weight`",
    );
    let got = load_and_run(&good);
    assert!(matches!(got, Outcome::Ran), "{got:?}");
    std::fs::remove_dir_all(d).ok();
}

/// Qwen 3 MoE: a missing or misshapen expert tensor, missing mixture settings, settings that
/// llama.cpp would run otherwise than we do, and a mixture in another architecture, each fail
/// by name.
#[test]
fn qwen3_moe_tensors_and_settings_are_checked() {
    let d = temp_dir("gguf-qwen3moe");
    let good = d.join("moe.gguf");
    keydiff_tests::write_tiny_qwen3_moe(&good, GgmlDType::Q8_0).unwrap();
    let (md, ts) = keydiff_tests::read_gguf(&good).unwrap();
    let p = d.join("bad.gguf");
    let replaced = |name: &str, with: Option<QTensor>| replaced(&ts, name, with);
    for gone in [
        "blk.1.ffn_down_exps.weight",
        "blk.0.ffn_gate_inp.weight",
        "blk.0.ffn_up_exps.weight",
    ] {
        write(&p, &md, &replaced(gone, None));
        expect_error(gone, &p, gone);
    }
    // Seven experts stacked where the metadata says eight.
    let seven = Tensor::zeros((7, 64, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
    let seven = QTensor::quantize(&seven, GgmlDType::Q8_0).unwrap();
    write(
        &p,
        &md,
        &replaced("blk.0.ffn_gate_exps.weight", Some(seven)),
    );
    expect_error(
        "seven experts",
        &p,
        "tensor `blk.0.ffn_gate_exps.weight` has shape [7, 64, 64] (28672 values), but the \
         model's settings",
    );
    let same = replaced("", None);
    for (key, v, needle) in [
        ("qwen3moe.expert_count", None, "qwen3moe.expert_count"),
        (
            "qwen3moe.expert_used_count",
            None,
            "qwen3moe.expert_used_count",
        ),
        (
            "qwen3moe.expert_feed_forward_length",
            None,
            "qwen3moe.expert_feed_forward_length",
        ),
        (
            "qwen3moe.expert_used_count",
            Some(Value::U32(9)),
            "9 experts per token of 8",
        ),
        (
            "qwen3moe.expert_weights_norm",
            Some(Value::Bool(false)),
            "`qwen3moe.expert_weights_norm` must be true",
        ),
        (
            "qwen3moe.expert_gating_func",
            Some(Value::U32(2)),
            "`qwen3moe.expert_gating_func` must be 1 (softmax",
        ),
    ] {
        let mut m = md.clone();
        set(&mut m, key, v.clone());
        write(&p, &m, &same);
        expect_error(&format!("{key} = {v:?}"), &p, needle);
    }
    // The expert count on a Llama (Mixtral's GGUF layout) is refused, not ignored.
    let mut m = tiny_metadata();
    set(&mut m, "llama.expert_count", Some(Value::U32(8)));
    write(&p, &m, &tiny_tensors());
    expect_error(
        "llama with experts",
        &p,
        "`llama.expert_count` is 8: mixtures of experts are supported for Qwen 3 MoE",
    );
    let got = load_and_run(&good);
    assert!(matches!(got, Outcome::Ran), "{got:?}");
    std::fs::remove_dir_all(d).ok();
}

/// A broken chat template fails with its error, not a panic; one that renders nothing says so.
#[test]
fn broken_chat_templates_are_named() {
    let d = temp_dir("gguf-template");
    let p = d.join("t.gguf");
    let ts = tiny_tensors();
    for (template, needle) in [
        ("{% for %}", "chat template: syntax error"),
        ("{{ messages | nosuchfilter }}", "unknown filter"),
        (
            "{% for i in range(1000000000) %}x{% endfor %}",
            "range has too many elements",
        ),
        (
            "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
            "recursion limit exceeded",
        ),
        (
            "",
            "the chat template rendered 1 message(s) as an empty prompt",
        ),
    ] {
        let mut md = tiny_metadata();
        set(
            &mut md,
            "tokenizer.chat_template",
            Some(Value::String(template.into())),
        );
        write(&p, &md, &ts);
        let chat = Prompt::Chat(vec![keydiff::Message::new("user", "hi")]);
        match load_and_run_prompt(&p, chat) {
            Outcome::Failed(e) => assert!(e.contains(needle), "{template}: {e}"),
            other => panic!("{template}: expected `{needle}`, got {other:?}"),
        }
    }
}

/// Where each tensor's info fields (dims, type, offset) lie in the file.
struct InfoAt {
    name: String,
    dims: Vec<usize>,
    dtype: usize,
    offset: usize,
}

fn info_positions(bytes: &[u8], names: &[String]) -> Vec<InfoAt> {
    names
        .iter()
        .map(|n| {
            let key: Vec<u8> = (n.len() as u64)
                .to_le_bytes()
                .iter()
                .chain(n.as_bytes())
                .copied()
                .collect();
            let at = bytes
                .windows(key.len())
                .rposition(|w| w == key.as_slice())
                .unwrap_or_else(|| panic!("tensor info of {n} not found"))
                + key.len();
            let nd = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            InfoAt {
                name: n.clone(),
                dims: (0..nd).map(|j| at + 4 + 8 * j).collect(),
                dtype: at + 4 + 8 * nd,
                offset: at + 8 + 8 * nd,
            }
        })
        .collect()
}

/// Every change to a tensor's dims, type or data offset fails to load, for the first, a
/// middle and the next-to-last tensor in the file: none loads as misread weights.
///
/// The last tensor is left out: a type that makes it smaller only leaves unread bytes at the
/// end of the file, which llama.cpp accepts too, and so do we.
#[test]
fn tensor_info_corruptions_fail() {
    let d = temp_dir("gguf-infos");
    let base = d.join("base.gguf");
    let ts = tiny_tensors();
    write(&base, &tiny_metadata(), &ts);
    assert!(matches!(load_and_run(&base), Outcome::Ran));
    let bytes = std::fs::read(&base).unwrap();
    let names: Vec<String> = [0, ts.len() / 2, ts.len() - 2]
        .iter()
        .map(|&i| ts[i].0.clone())
        .collect();
    let p = d.join("c.gguf");
    let mut failures = Vec::new();
    let mut tried = 0;
    for info in info_positions(&bytes, &names) {
        let mut muts: Vec<(String, usize, Vec<u8>)> = Vec::new();
        for (j, &at) in info.dims.iter().enumerate() {
            for v in [0u64, 1, 31, 96, 4096, 1 << 32, u64::MAX / 2, u64::MAX] {
                muts.push((format!("dim {j} = {v}"), at, v.to_le_bytes().to_vec()));
            }
        }
        // Q8_0 (8) and F32 (0) are the types in use; 16 and 40 are not types.
        for v in [0u32, 1, 2, 3, 6, 8, 12, 16, 30, 40, u32::MAX] {
            muts.push((format!("type = {v}"), info.dtype, v.to_le_bytes().to_vec()));
        }
        for v in [7u64, 32, 1 << 20, 1 << 40, u64::MAX - 100, u64::MAX] {
            muts.push((
                format!("offset = {v}"),
                info.offset,
                v.to_le_bytes().to_vec(),
            ));
        }
        for (what, at, v) in muts {
            let mut b = bytes.clone();
            if b[at..at + v.len()] == v[..] {
                continue; // not a change
            }
            b[at..at + v.len()].copy_from_slice(&v);
            std::fs::write(&p, &b).unwrap();
            tried += 1;
            match load_and_run(&p) {
                Outcome::Failed(_) => {}
                other => failures.push(format!("{} {what}: {other:?}", info.name)),
            }
        }
    }
    assert!(tried > 80, "only {tried} corruptions tried");
    assert!(failures.is_empty(), "{failures:#?}");

    // The messages name the tensor and the problem.
    let infos = info_positions(&bytes, &["blk.0.attn_q.weight".to_string()]);
    let q = &infos[0];
    let cases: [(usize, Vec<u8>, &str); 7] = [
        (
            q.dims[0],
            33u64.to_le_bytes().to_vec(),
            "not whole Q8_0 blocks of 32",
        ),
        // A type candle cannot run (IQ4_XS), and an id this keydiff does not know.
        (
            q.dtype,
            23u32.to_le_bytes().to_vec(),
            "tensor `blk.0.attn_q.weight` is IQ4_XS (GGML type 23), which keydiff cannot run",
        ),
        (
            q.dtype,
            40u32.to_le_bytes().to_vec(),
            "tensor `blk.0.attn_q.weight` is of GGML type 40, which this keydiff does not know",
        ),
        (q.dims[1], (1u64 << 62).to_le_bytes().to_vec(), "overflows"),
        (q.dtype, 0u32.to_le_bytes().to_vec(), "blk.0.attn_q.weight"),
        (
            q.offset,
            7u64.to_le_bytes().to_vec(),
            "not a multiple of the alignment 32",
        ),
        (q.offset, 0u64.to_le_bytes().to_vec(), "starts at byte"),
    ];
    for (at, v, needle) in cases {
        let mut b = bytes.clone();
        b[at..at + v.len()].copy_from_slice(&v);
        std::fs::write(&p, &b).unwrap();
        expect_error(&format!("{needle} case"), &p, needle);
    }
    // Two tensors of one size with their offsets swapped leave no gap and no overlap: the
    // header's order (llama.cpp's check) finds them, where the offsets' order cannot.
    let pair = info_positions(
        &bytes,
        &[
            "blk.0.attn_q.weight".to_string(),
            "blk.0.attn_output.weight".to_string(),
        ],
    );
    let (a, b) = (&pair[0], &pair[1]);
    let mut swapped = bytes.clone();
    let (oa, ob) = (
        bytes[a.offset..a.offset + 8].to_vec(),
        bytes[b.offset..b.offset + 8].to_vec(),
    );
    assert_ne!(oa, ob);
    swapped[a.offset..a.offset + 8].copy_from_slice(&ob);
    swapped[b.offset..b.offset + 8].copy_from_slice(&oa);
    std::fs::write(&p, &swapped).unwrap();
    expect_error("swapped offsets", &p, "starts at byte");
}

/// Seeded random corruption (truncation, bytes, and 4- or 8-byte extreme values in the
/// header) never panics, and most of it is refused.
#[test]
fn random_corruptions_never_panic() {
    let d = temp_dir("gguf-random");
    let base = d.join("base.gguf");
    write(&base, &tiny_metadata(), &tiny_tensors());
    let bytes = std::fs::read(&base).unwrap();
    let header = {
        let mut f = std::fs::File::open(&base).unwrap();
        gguf_file::Content::read(&mut f).unwrap().tensor_data_offset as usize
    };
    let mut next = seeded(0x5eed);
    let extremes = [0u64, 1, u32::MAX as u64, u64::MAX, 1 << 32, 1 << 63, 31];
    let p = d.join("c.gguf");
    let (mut panics, mut refused, cases) = (Vec::new(), 0, 120);
    for i in 0..cases {
        let mut b = bytes.clone();
        let what = match next(3) {
            0 => {
                let at = next(b.len());
                b.truncate(at);
                format!("truncated to {at} bytes")
            }
            1 => {
                let (at, v) = (next(header), next(256) as u8);
                b[at] = v;
                format!("byte {at} = {v}")
            }
            _ => {
                let (at, v) = (next(header - 8), extremes[next(extremes.len())]);
                let w = [4, 8][next(2)];
                b[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
                format!("{w} bytes at {at} = {v:#x}")
            }
        };
        std::fs::write(&p, &b).unwrap();
        match load_and_run(&p) {
            Outcome::Panicked(m) => panics.push(format!("case {i}, {what}: {m}")),
            Outcome::Failed(_) => refused += 1,
            Outcome::Ran => {} // e.g. a changed character in a token or an unused key
        }
    }
    assert!(panics.is_empty(), "{panics:#?}");
    assert!(
        refused * 2 > cases,
        "only {refused} of {cases} corruptions refused"
    );
}

/// The tiny model as an HF directory, and a scratch copy of it to corrupt.
fn tiny_hf(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let d = temp_dir(name);
    let gguf = d.join("tiny.gguf");
    write(&gguf, &tiny_metadata(), &tiny_tensors());
    let base = d.join("base");
    export_hf(&gguf, &base).unwrap();
    (base, d.join("case"))
}

/// Makes `case` a fresh copy of `base`.
fn copy_dir(base: &Path, case: &Path) {
    let _ = std::fs::remove_dir_all(case);
    std::fs::create_dir_all(case).unwrap();
    for f in std::fs::read_dir(base).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), case.join(f.file_name())).unwrap();
    }
}

/// Each wrong config.json value fails, and the message names the field or the quantity.
#[test]
fn hf_config_corruptions_are_named() {
    let (base, case) = tiny_hf("hf-config");
    assert!(matches!(load_and_run(&base), Outcome::Ran));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    let llama3 = |factor: f64, low: f64, high: f64| {
        serde_json::json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": 8192})
    };
    let cases = [
        // Used to run the first layer only.
        (
            "num_hidden_layers",
            serde_json::json!(1),
            "num_hidden_layers is 1 but the checkpoint has tensors of layer 1",
        ),
        (
            "num_hidden_layers",
            serde_json::json!(u32::MAX),
            "layers 4294967295 is beyond the supported maximum 512",
        ),
        ("num_hidden_layers", serde_json::json!(-1), "expected usize"),
        (
            "vocab_size",
            serde_json::json!(1u64 << 40),
            "vocabulary size",
        ),
        ("head_dim", serde_json::json!(3), "head_dim 3 must be even"),
        (
            "rope_theta",
            serde_json::json!(0),
            "rope_theta 0 must be above 1 and at most 1e12",
        ),
        (
            "rms_norm_eps",
            serde_json::json!(-1),
            "rms_norm_eps -1 must be from 0 to 0.1",
        ),
        (
            "rope_scaling",
            serde_json::json!("llama3"),
            "rope_scaling must be an object or null",
        ),
        ("rope_scaling", llama3(0.0, 1.0, 4.0), "needs factor > 0"),
        // transformers divides by high - low.
        (
            "rope_scaling",
            llama3(8.0, 4.0, 4.0),
            "low_freq_factor < high_freq_factor",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "dynamic", "factor": 4.0}),
            "unsupported rope_scaling type `dynamic`",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 0.25}),
            "YaRN RoPE scaling factor 0.25 must be at least 1",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "beta_slow": "1"}),
            "rope_scaling.beta_slow must be a number",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1,
                "beta_slow": 32}),
            "beta_fast the larger",
        ),
        // Used to divide by zero (a panic).
        (
            "num_attention_heads",
            serde_json::json!(0),
            "query heads must be non-zero",
        ),
        // Used to give NaN logits, then an empty reply.
        (
            "rope_theta",
            serde_json::json!(1e-300),
            "must be above 1 and at most 1e12",
        ),
        (
            "rms_norm_eps",
            serde_json::json!(1e30),
            "must be from 0 to 0.1",
        ),
        // Used to be refused as "not enough memory": the memory plan came before the shapes.
        (
            "intermediate_size",
            serde_json::json!(1u64 << 20),
            "does not match the checkpoint: tensor `model.layers.0.mlp.gate_proj.weight` has \
             shape [128, 64]",
        ),
        (
            "hidden_size",
            serde_json::json!(1u64 << 20),
            "does not match the checkpoint: tensor `",
        ),
        // Used to be ignored: the forward pass computes none of these.
        ("hidden_act", serde_json::json!("gelu"), "hidden_act `gelu`"),
        ("mlp_bias", serde_json::json!(true), "mlp_bias true"),
        (
            "use_sliding_window",
            serde_json::json!(true),
            "sliding-window attention",
        ),
        (
            "quantization_config",
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
            "quant_method \"fp8\"",
        ),
        // The export is tied (no lm_head.weight): untied, the output layer is missing.
        (
            "tie_word_embeddings",
            serde_json::json!(false),
            "no `lm_head.weight`",
        ),
        (
            "eos_token_id",
            serde_json::json!(4294967298u64),
            "token id 4294967298 is outside the model's vocabulary",
        ),
        (
            "eos_token_id",
            serde_json::json!("2"),
            "\"2\" is not a token id",
        ),
    ];
    let mut failures = Vec::new();
    for (key, value, needle) in cases {
        copy_dir(&base, &case);
        let mut c = cfg.clone();
        c[key] = value.clone();
        std::fs::write(case.join("config.json"), c.to_string()).unwrap();
        match load_and_run(&case) {
            Outcome::Failed(e) if e.contains(needle) && e.contains("config.json") => {}
            other => failures.push(format!(
                "{key} = {value}: expected `{needle}`, got {other:?}"
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The files around the weights: a tensor the model does not read, a non-float tensor, a
/// tensor in two shards, an index pointing outside the directory, and a BOS that does not
/// exist are refused by name; a chat template is found where transformers puts it.
#[test]
fn hf_weights_and_tokenizer_files_are_checked() {
    let (base, case) = tiny_hf("hf-files");
    let dev = Device::Cpu;
    let tensors = candle_core::safetensors::load(base.join("model.safetensors"), &dev).unwrap();
    let save = |ts: &std::collections::HashMap<String, Tensor>, file: &str| {
        candle_core::safetensors::save(ts, case.join(file)).unwrap();
    };
    let fails = |needle: &str| expect_error(needle, &case, needle);

    // A tensor no part of the model reads (q/k/v biases under `attention_bias: false`).
    copy_dir(&base, &case);
    let mut ts = tensors.clone();
    ts.insert(
        "model.layers.0.self_attn.q_proj.bias".into(),
        Tensor::zeros(HIDDEN, candle_core::DType::F32, &dev).unwrap(),
    );
    save(&ts, "model.safetensors");
    fails("`model.layers.0.self_attn.q_proj.bias`");
    // RoPE frequencies saved by older exports are not weights: still loads.
    let mut ts = tensors.clone();
    ts.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::ones(16, candle_core::DType::F32, &dev).unwrap(),
    );
    save(&ts, "model.safetensors");
    assert!(matches!(load_and_run(&case), Outcome::Ran));

    // A non-float tensor (as an FP8 or integer-quantized release stores its linears).
    let mut ts = tensors.clone();
    let name = "model.layers.1.mlp.up_proj.weight";
    let w = ts[name].clone();
    ts.insert(name.into(), w.to_dtype(candle_core::DType::I64).unwrap());
    save(&ts, "model.safetensors");
    fails(&format!("tensor `{name}` is stored as I64"));

    // Two shards, with one tensor in both; then an index naming a file outside.
    let shard = |names: &dyn Fn(&str) -> bool| -> std::collections::HashMap<String, Tensor> {
        tensors
            .iter()
            .filter(|(n, _)| names(n))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect()
    };
    copy_dir(&base, &case);
    std::fs::remove_file(case.join("model.safetensors")).unwrap();
    save(&shard(&|n| n.contains("layers.0")), "a.safetensors");
    save(
        &shard(&|n| !n.contains("layers.0") || n.ends_with("0.input_layernorm.weight")),
        "b.safetensors",
    );
    let index = |file_of: &dyn Fn(&str) -> &'static str| {
        let map: serde_json::Map<String, serde_json::Value> = tensors
            .keys()
            .map(|n| (n.clone(), file_of(n).into()))
            .collect();
        std::fs::write(
            case.join("model.safetensors.index.json"),
            serde_json::json!({ "weight_map": map }).to_string(),
        )
        .unwrap();
    };
    index(&|n| match n.contains("layers.0") {
        true => "a.safetensors",
        false => "b.safetensors",
    });
    fails("tensor `model.layers.0.input_layernorm.weight` is also in");
    save(&shard(&|n| !n.contains("layers.0")), "b.safetensors");
    assert!(matches!(load_and_run(&case), Outcome::Ran));
    index(&|n| match n.contains("layers.0") {
        true => "../a.safetensors",
        false => "b.safetensors",
    });
    fails("which is not a file of the model's directory");

    // A BOS to add that the tokenizer does not have.
    copy_dir(&base, &case);
    let tc_path = case.join("tokenizer_config.json");
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc_path).unwrap()).unwrap();
    let mut bad = tc.clone();
    bad["add_bos_token"] = true.into();
    bad["bos_token"] = "<no such token>".into();
    std::fs::write(&tc_path, bad.to_string()).unwrap();
    fails("add_bos_token is true but the BOS token (<no such token>) is not in tokenizer.json");
    // generation_config.json's ids are checked as config.json's.
    copy_dir(&base, &case);
    std::fs::write(
        case.join("generation_config.json"),
        r#"{"eos_token_id": [2, 70000]}"#,
    )
    .unwrap();
    fails("token id 70000 is outside the model's vocabulary of 49152");

    // Chat templates: a list of named ones (transformers' form) uses `default`, and
    // chat_template.jinja (where transformers 4.50 and later save it) stands over both.
    let chat = |dir: &Path| -> String {
        let cfg = EngineConfig::default();
        let e = Engine::load(&ModelSource::HfDir(dir.to_path_buf()), &cfg).unwrap();
        let ids = e
            .prompt_tokens(&Prompt::Chat(vec![keydiff::Message::new("user", "hi")]))
            .unwrap();
        e.detokenize(&ids).unwrap()
    };
    copy_dir(&base, &case);
    let mut listed = tc.clone();
    listed["chat_template"] = serde_json::json!([
        {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
    ]);
    std::fs::write(&tc_path, listed.to_string()).unwrap();
    assert_eq!(chat(&case), "DEFAULT hi");
    std::fs::write(
        case.join("chat_template.jinja"),
        "JINJA {{ messages[0].content }}",
    )
    .unwrap();
    assert_eq!(chat(&case), "JINJA hi");
    listed["chat_template"] = serde_json::json!([{"name": "tool_use", "template": "x"}]);
    std::fs::remove_file(case.join("chat_template.jinja")).unwrap();
    std::fs::write(&tc_path, listed.to_string()).unwrap();
    fails("without a `default` one");
}

/// Seeded random corruption of model.safetensors (its header's length, its JSON, truncation)
/// never panics, and most of it is refused.
#[test]
fn random_safetensors_corruptions_never_panic() {
    let (base, case) = tiny_hf("hf-safetensors");
    let st = std::fs::read(base.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let mut next = seeded(0x5afe);
    let (mut panics, mut refused, cases) = (Vec::new(), 0, 100);
    for i in 0..cases {
        let mut b = st.clone();
        let what = match next(3) {
            0 => {
                let at = next(b.len());
                b.truncate(at);
                format!("truncated to {at} bytes")
            }
            1 => {
                let at = 8 + next(header);
                let c = b"0123456789,:{}[]\"FU"[next(19)];
                b[at] = c;
                format!("header byte {at} = {:?}", c as char)
            }
            _ => {
                let at = next(8);
                b[at] = next(256) as u8;
                format!("length byte {at} = {}", b[at])
            }
        };
        copy_dir(&base, &case);
        std::fs::write(case.join("model.safetensors"), &b).unwrap();
        match load_and_run(&case) {
            Outcome::Panicked(m) => panics.push(format!("case {i}, {what}: {m}")),
            Outcome::Failed(_) => refused += 1,
            Outcome::Ran => {} // e.g. a changed digit in the `__metadata__` strings
        }
    }
    assert!(panics.is_empty(), "{panics:#?}");
    assert!(
        refused * 2 > cases,
        "only {refused} of {cases} corruptions refused"
    );
}
