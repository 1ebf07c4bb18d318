//! The HF safetensors loader against the GGUF loader, on SmolLM2's real weights.

use keydiff::{parity::compare_logits, Engine, EngineConfig, ModelSource};
use keydiff_tests::{export_hf, fixture, model, temp_dir, SMOLLM2};

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
    std::fs::remove_dir_all(dir).ok();
}
