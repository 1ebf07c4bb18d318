//! The HF safetensors loader against the GGUF loader, on SmolLM2's real weights and on a tiny
//! random Qwen 3 and Qwen 3 MoE.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use keydiff::{
    parity::compare_logits, Engine, EngineConfig, EngineError, ModelSource, RopeOverride,
    RopeScalingType,
};
use keydiff_tests::{
    export_hf, fixture, model, temp_dir, write_tiny_qwen3, write_tiny_qwen3_moe, SMOLLM2,
};

/// The exported HF copy holds SmolLM2's weights dequantized to f32; the GGUF path prefills with
/// dense copies of the same dequantized weights (the CPU default). Both therefore compute the
/// same f32 arithmetic, up to summation order: the tolerance is relative to the largest |logit|.
/// A loader bug (wrong tensor, missed Q/K permutation, wrong RoPE variant) moves logits by
/// tens of percent.
const HF_VS_GGUF_TOL: f32 = 1e-4;

/// A text prompt in the model's own format (what the server's completion endpoints take):
/// special-token text parsed, and the BOS the model adds not doubled when the text begins
/// with it (a model with `add_bos_token`: SmolLM2's copy with it set).
#[test]
fn formatted_prompts_parse_special_tokens_and_keep_one_bos() {
    let dir = temp_dir("smollm2-hf-bos");
    export_hf(&model(SMOLLM2), &dir).unwrap();
    let path = dir.join("tokenizer_config.json");
    let mut tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tc["add_bos_token"] = true.into();
    std::fs::write(&path, tc.to_string()).unwrap();
    let e = Engine::load(&ModelSource::HfDir(dir), &EngineConfig::default()).unwrap();
    let bos_text = tc["bos_token"].as_str().unwrap();
    let bos = e.tokenize_special(bos_text).unwrap();
    assert_eq!(bos.len(), 1, "{bos_text}");
    let body = "Hi<|im_end|>\n<|im_start|>assistant\n";
    let parsed = e.tokenize_special(body).unwrap();
    assert!(parsed.len() + 4 < e.tokenize_continuation(body).unwrap().len());
    let want = [&bos[..], &parsed].concat();
    assert_eq!(e.tokenize_formatted(body).unwrap(), want);
    assert_eq!(
        e.tokenize_formatted(&format!("{bos_text}{body}")).unwrap(),
        want
    );
    // Plain text prompts keep special-token text as text.
    assert_ne!(e.tokenize(body, false).unwrap(), want);
    assert!(matches!(
        e.tokenize_formatted(""),
        Err(EngineError::EmptyPrompt)
    ));
}

#[test]
fn hf_directory_matches_gguf() {
    let gguf = model(SMOLLM2);
    let dir = temp_dir("smollm2-hf");
    export_hf(&gguf, &dir).unwrap();
    let cfg = EngineConfig::default();
    let a = Engine::load(&ModelSource::Gguf(gguf), &cfg).unwrap();
    let b = Engine::load(&ModelSource::HfDir(dir.clone()), &cfg).unwrap();
    let fx = fixture("smollm2");
    for p in &fx.prompts {
        // Same tokenizer, saved as tokenizer.json.
        if p.messages.is_none() {
            assert_eq!(
                b.tokenize(&p.text, p.special).unwrap(),
                p.tokens,
                "{}: tokens through tokenizer.json",
                p.name
            );
        }
        let la = a.prefill_logits(&p.tokens, 128).unwrap();
        let lb = b.prefill_logits(&p.tokens, 128).unwrap();
        let d = compare_logits(&la, &lb);
        eprintln!(
            "{}: HF vs GGUF max abs {:.2e}, relative {:.2e}",
            p.name, d.max_abs, d.max_rel
        );
        assert!(d.top1_equal(), "{}: top-1 differs: {d:?}", p.name);
        assert!(d.max_rel <= HF_VS_GGUF_TOL, "{}: {d:?}", p.name);
    }

    // YaRN in config.json (Qwen 2.5's model card form) computes what llama.cpp's flags give
    // the GGUF file (tests/tests/llamacpp_parity.rs holds those to llama.cpp's logits).
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 2048});
    std::fs::write(&path, config.to_string()).unwrap();
    let b = Engine::load(&ModelSource::HfDir(dir.clone()), &cfg).unwrap();
    let rope = RopeOverride {
        scaling: Some(RopeScalingType::Yarn),
        factor: Some(4.0),
        original_context: Some(2048),
        ..Default::default()
    };
    let cfg = EngineConfig { rope, ..cfg };
    let a_yarn = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
    assert_eq!(
        b.model_config().rope_scaling,
        a_yarn.model_config().rope_scaling
    );
    assert_eq!(
        (a.model_config().context(), b.model_config().context()),
        (8192, 8192)
    );
    let p = fx.prompts.iter().find(|p| p.name == "long").unwrap();
    let la = a_yarn.prefill_logits(&p.tokens, 128).unwrap();
    let lb = b.prefill_logits(&p.tokens, 128).unwrap();
    let d = compare_logits(&la, &lb);
    eprintln!(
        "YaRN: HF vs GGUF max abs {:.2e}, relative {:.2e}",
        d.max_abs, d.max_rel
    );
    assert!(d.top1_equal() && d.max_rel <= HF_VS_GGUF_TOL, "{d:?}");
    let plain = a.prefill_logits(&p.tokens, 128).unwrap();
    assert!(compare_logits(&plain, &lb).max_rel > 100.0 * HF_VS_GGUF_TOL);
    std::fs::remove_dir_all(dir).ok();
}

/// A Qwen 3 checkpoint (`model_type: qwen3`, `self_attn.q_norm`/`k_norm`, `head_dim` wider
/// than hidden / heads) computes what its GGUF computes, and what llama.cpp computes on it.
#[test]
fn qwen3_hf_directory_matches_gguf_and_llamacpp() {
    let dir = temp_dir("tiny-qwen3-hf");
    let gguf = dir.join("tiny-qwen3.gguf");
    write_tiny_qwen3(&gguf, false).unwrap();
    let (_, b) = hf_matches_gguf(&dir, &gguf, "Qwen3ForCausalLM", "tiny-qwen3");
    assert!(b.model_config().qk_norm);
    std::fs::remove_dir_all(dir).ok();
}

/// A Qwen 3 MoE checkpoint (`mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`, one tensor
/// per expert) computes what its GGUF computes (stacked experts), and what llama.cpp
/// computes on it. Its `norm_topk_prob` is read: without it (transformers' default, false)
/// the chosen experts' weights are not renormalised, and the logits move.
#[test]
fn qwen3_moe_hf_directory_matches_gguf_and_llamacpp() {
    let dir = temp_dir("tiny-qwen3moe-hf");
    let gguf = dir.join("tiny-qwen3moe.gguf");
    write_tiny_qwen3_moe(&gguf, GgmlDType::F32).unwrap();
    let (a, b) = hf_matches_gguf(&dir, &gguf, "Qwen3MoeForCausalLM", "tiny-qwen3moe");
    assert!(b.model_config().moe.as_ref().unwrap().norm_topk_prob);
    let path = dir.join("hf").join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("norm_topk_prob");
    std::fs::write(&path, config.to_string()).unwrap();
    let c = Engine::load(
        &ModelSource::HfDir(dir.join("hf")),
        &EngineConfig::default(),
    )
    .unwrap();
    assert!(!c.model_config().moe.as_ref().unwrap().norm_topk_prob);
    let p = &fixture("tiny-qwen3moe").prompts[0];
    let la = a.prefill_logits(&p.tokens, 128).unwrap();
    let lc = c.prefill_logits(&p.tokens, 128).unwrap();
    let d = compare_logits(&la, &lc);
    eprintln!("without norm_topk_prob: {d:?}");
    assert!(d.max_rel > 100.0 * HF_VS_GGUF_TOL, "{d:?}");
    std::fs::remove_dir_all(dir).ok();
}

/// Exports `gguf` as an HF directory under `dir` whose architecture is named only in
/// `architectures` (as the hub has it), loads both, and checks that they agree with each
/// other and with llama.cpp's fixture `name`.
fn hf_matches_gguf(dir: &Path, gguf: &Path, architecture: &str, name: &str) -> (Engine, Engine) {
    let hf = dir.join("hf");
    export_hf(gguf, &hf).unwrap();
    let path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("model_type");
    config["architectures"] = serde_json::json!([architecture]);
    std::fs::write(&path, config.to_string()).unwrap();
    let cfg = EngineConfig::default();
    let a = Engine::load(&ModelSource::Gguf(gguf.to_path_buf()), &cfg).unwrap();
    let b = Engine::load(&ModelSource::HfDir(hf), &cfg).unwrap();
    assert_eq!(a.model_config(), b.model_config());
    for p in &fixture(name).prompts {
        let la = a.prefill_logits(&p.tokens, 128).unwrap();
        let lb = b.prefill_logits(&p.tokens, 128).unwrap();
        let d = compare_logits(&la, &lb);
        let llamacpp = p
            .top_logits
            .iter()
            .map(|&(id, l)| (lb[id as usize] - l).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{name}/{}: HF vs GGUF max abs {:.2e}, relative {:.2e}; vs llama.cpp's top-10 \
             {llamacpp:.2e}",
            p.name, d.max_abs, d.max_rel
        );
        assert!(
            d.top1_equal() && d.max_rel <= HF_VS_GGUF_TOL,
            "{name}/{}: {d:?}",
            p.name
        );
        assert!(
            llamacpp <= 2e-3,
            "{name}/{}: {llamacpp} from llama.cpp",
            p.name
        );
    }
    (a, b)
}
