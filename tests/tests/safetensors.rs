//! The HF safetensors loader against the GGUF loader, on SmolLM2's real weights and on a tiny
//! random Qwen 3.

use keydiff::{
    parity::compare_logits, Engine, EngineConfig, ModelSource, RopeOverride, RopeScalingType,
};
use keydiff_tests::{export_hf, fixture, model, temp_dir, write_tiny_qwen3, SMOLLM2};

/// The exported HF copy holds SmolLM2's weights dequantized to f32; the GGUF path prefills with
/// dense copies of the same dequantized weights (the CPU default). Both therefore compute the
/// same f32 arithmetic, up to summation order: the tolerance is relative to the largest |logit|.
/// A loader bug (wrong tensor, missed Q/K permutation, wrong RoPE variant) moves logits by
/// tens of percent.
const HF_VS_GGUF_TOL: f32 = 1e-4;

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
    let hf = dir.join("hf");
    export_hf(&gguf, &hf).unwrap();
    // As the hub has it: the architecture named only in `architectures`.
    let path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("model_type");
    config["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    std::fs::write(&path, config.to_string()).unwrap();
    let cfg = EngineConfig::default();
    let a = Engine::load(&ModelSource::Gguf(gguf), &cfg).unwrap();
    let b = Engine::load(&ModelSource::HfDir(hf), &cfg).unwrap();
    assert_eq!(a.model_config(), b.model_config());
    assert!(b.model_config().qk_norm);
    for p in &fixture("tiny-qwen3").prompts {
        let la = a.prefill_logits(&p.tokens, 128).unwrap();
        let lb = b.prefill_logits(&p.tokens, 128).unwrap();
        let d = compare_logits(&la, &lb);
        let llamacpp = p
            .top_logits
            .iter()
            .map(|&(id, l)| (lb[id as usize] - l).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{}: HF vs GGUF max abs {:.2e}, relative {:.2e}; vs llama.cpp's top-10 {llamacpp:.2e}",
            p.name, d.max_abs, d.max_rel
        );
        assert!(
            d.top1_equal() && d.max_rel <= HF_VS_GGUF_TOL,
            "{}: {d:?}",
            p.name
        );
        assert!(llamacpp <= 2e-3, "{}: {llamacpp} from llama.cpp", p.name);
    }
    std::fs::remove_dir_all(dir).ok();
}
