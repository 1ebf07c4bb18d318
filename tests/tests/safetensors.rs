//! The HF safetensors loader against the GGUF loader, on SmolLM2's real weights.

use keydiff::{parity::compare_logits, Engine, EngineConfig, ModelSource};
use keydiff_tests::{export_hf, fixture, model, temp_dir, SMOLLM2};

/// The GGUF path multiplies Q4_1 weights with Q8-quantized activations; the exported HF copy
/// holds the same weights dequantized to f32 and multiplies in f32. The activation rounding
/// (≤ 1/254 of each 32-block's max) accumulates over 30 layers to a few tenths on logits of
/// magnitude ~20. A loader bug (wrong tensor, missed Q/K permutation, wrong RoPE variant) moves
/// them by whole units and flips the top token.
const HF_VS_GGUF_TOL: f32 = 1.0;

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
        eprintln!("{}: HF vs GGUF max abs {:.3} cos {:.6}", p.name, d.max_abs, d.cosine);
        assert!(d.top1_equal(), "{}: top-1 differs: {d:?}", p.name);
        assert!(d.max_abs <= HF_VS_GGUF_TOL, "{}: {d:?}", p.name);
    }
    std::fs::remove_dir_all(dir).ok();
}
