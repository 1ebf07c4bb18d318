//! The chunk size B must not change results beyond float noise.

use keydiff::{parity::compare_logits, Engine, EngineConfig, ModelSource};
use keydiff_tests::{fixture, model, root, SMOLLM2};

/// Largest accepted logit difference between chunk sizes. Different B only reorders f32 sums
/// (matmul tiling, softmax over a different mask shape); on logits of magnitude ~20 that is
/// ~1e-4 relative. A wrong mask or position would move them by whole units.
const CHUNK_TOL: f32 = 2e-2;

fn check(engine: &Engine, tokens: &[u32], label: &str) {
    let whole = engine.prefill_logits(tokens, tokens.len()).unwrap();
    for b in [1, 7, 128] {
        let l = engine.prefill_logits(tokens, b).unwrap();
        let d = compare_logits(&whole, &l);
        eprintln!("{label}: B={b} vs whole prompt: max abs {:.2e}", d.max_abs);
        assert!(d.top1_equal(), "{label}: B={b} changes the top-1 token");
        assert!(d.max_abs <= CHUNK_TOL, "{label}: B={b}: max abs {} > {CHUNK_TOL}", d.max_abs);
    }
}

#[test]
fn chunk_size_does_not_change_logits_smollm2() {
    let engine = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &EngineConfig::default()).unwrap();
    let fx = fixture("smollm2");
    let long = fx.prompts.iter().find(|p| p.name == "long").expect("long prompt");
    check(&engine, &long.tokens, "smollm2");
}

#[test]
fn chunk_size_does_not_change_logits_random_archs() {
    for preset in ["tiny-llama", "tiny-qwen"] {
        let source = ModelSource::Random {
            config: root().join(format!("configs/{preset}.json")),
            seed: 3,
            on_host: true,
        };
        let engine = Engine::load(&source, &EngineConfig::default()).unwrap();
        let tokens = keydiff::parity::random_tokens(300, 256, 11);
        check(&engine, &tokens, preset);
    }
}
