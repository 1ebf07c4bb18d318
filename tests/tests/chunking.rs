//! The chunk size B must not change results beyond float noise.

use keydiff::{parity::compare_logits, Engine, EngineConfig, ModelSource};
use keydiff_tests::{fixture, model, root, SMOLLM2};

/// Largest accepted logit difference between chunk sizes, relative to the largest |logit|.
/// Different B only reorders f32 sums (matmul tiling, softmax over another mask shape): ~1e-7
/// relative. A wrong mask or position moves logits by tens of percent.
const CHUNK_TOL: f32 = 1e-4;

fn check(engine: &Engine, tokens: &[u32], label: &str) {
    let whole = engine.prefill_logits(tokens, tokens.len()).unwrap();
    for b in [1, 7, 128] {
        let l = engine.prefill_logits(tokens, b).unwrap();
        let d = compare_logits(&whole, &l);
        eprintln!(
            "{label}: B={b} vs whole prompt: max abs {:.2e}, relative {:.2e}",
            d.max_abs, d.max_rel
        );
        assert!(d.top1_equal(), "{label}: B={b} changes the top-1 token");
        assert!(d.max_rel <= CHUNK_TOL, "{label}: B={b}: {d:?}");
    }
}

#[test]
fn chunk_size_does_not_change_logits_smollm2() {
    let engine =
        Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &EngineConfig::default()).unwrap();
    let fx = fixture("smollm2");
    let long = fx
        .prompts
        .iter()
        .find(|p| p.name == "long")
        .expect("long prompt");
    check(&engine, &long.tokens, "smollm2");
}

#[test]
fn chunk_size_does_not_change_logits_random_archs() {
    for preset in ["tiny-llama", "tiny-qwen", "tiny-qwen3", "tiny-qwen3moe"] {
        let source = ModelSource::Random {
            config: root().join(format!("configs/{preset}.json")),
            seed: 3,
            on_host: true,
            weights: None,
        };
        let engine = Engine::load(&source, &EngineConfig::default()).unwrap();
        let tokens = keydiff::parity::random_tokens(300, 256, 11);
        check(&engine, &tokens, preset);
    }
}
