//! The flash attention backend against the eager one, end to end on the CPU: the same seeded
//! random Llama- and Qwen-shaped models, under every policy with eviction, give the same logits
//! (to f32 rounding), the same greedy tokens and the same evictions. Statistics policies get
//! theirs from flash's extra pass, so this also checks that pass inside the engine.
//!
//! On CUDA the flash backend is candle-flash-attn (`flash-attn` feature); it is checked against
//! the CPU by `keydiff check-device --attention flash` on a GPU host (scripts/gpu-check.sh).

use keydiff::{
    AttentionBackend, CacheConfig, Engine, EngineConfig, GenerateParams, ModelSource, PolicyKind,
    Prompt,
};
use keydiff_tests::{root, EVICTING_POLICIES};

fn config(policy: &str, attention: AttentionBackend) -> EngineConfig {
    let policy = PolicyKind::parse(policy, keydiff::SNAPKV_WINDOW, 0).unwrap();
    EngineConfig {
        cache: CacheConfig {
            budget: (policy != PolicyKind::Full).then_some(96),
            policy,
            chunk: 32,
            window: 0.1,
            sinks: 2,
            evict_every: None,
        },
        attention,
        ..Default::default()
    }
}

#[test]
fn flash_backend_matches_eager_under_every_policy() {
    let policies = std::iter::once("full").chain(EVICTING_POLICIES);
    // tiny-qwen-d64: heads of 64, so decode steps run the CPU decode kernel in both backends
    // (eager: with the probabilities TOVA and H2O take; flash: without, statistics from the
    // extra pass), against the general path's prefill chunks.
    for preset in ["tiny-llama", "tiny-qwen", "tiny-qwen-d64"] {
        let path = root().join(format!("configs/{preset}.json"));
        let source = ModelSource::Random {
            config: path.clone(),
            seed: 3,
            on_host: false,
            weights: None,
        };
        for policy in policies.clone() {
            let eager = config(policy, AttentionBackend::Eager);
            let flash = config(policy, AttentionBackend::Flash);
            // Prefill of 250 tokens in chunks of 32 (eviction from the fourth chunk on).
            let (d, used) =
                keydiff::parity::compare_devices(&path, 3, None, &eager, &flash, 250).unwrap();
            assert_eq!(used, AttentionBackend::Flash);
            assert!(
                d.max_rel < 1e-4 && d.top1_equal(),
                "{preset} {policy}: prefill logits differ: {d:?}"
            );
            // Prefill then 12 greedy decode steps (B = 1), which evict again past N + K.
            let params = GenerateParams {
                prompt: Prompt::Tokens(keydiff::parity::random_tokens(250, 256, 8)),
                max_tokens: 12,
                ignore_eos: true,
                ..Default::default()
            };
            let run = |cfg: &EngineConfig| {
                let e = Engine::load(&source, cfg).unwrap();
                assert_eq!(e.config().attention, cfg.attention);
                e.generate(&params, |_| {}).unwrap()
            };
            let (a, b) = (run(&eager), run(&flash));
            assert_eq!(a.tokens, b.tokens, "{preset} {policy}: generated tokens");
            assert_eq!(
                a.stats.eviction.evicted_slots, b.stats.eviction.evicted_slots,
                "{preset} {policy}: evictions"
            );
            if policy != "full" {
                assert!(
                    a.stats.eviction.evicted_slots > 0,
                    "{preset} {policy}: never evicted"
                );
            }
        }
    }
}

/// In half precision the flash backend hands the next layer activations in the model's dtype
/// (candle-nn's CPU kernel computes and returns f32 for f16/bf16): a bf16 prefill with
/// eviction runs and matches eager bf16 up to bf16 rounding, also for policies that take their
/// statistics from flash's extra pass.
#[test]
fn flash_backend_runs_in_bf16() {
    let path = root().join("configs/tiny-qwen.json");
    for policy in ["keydiff", "snapkv", "h2o"] {
        let bf16 = |attention| EngineConfig {
            dtype: candle_core::DType::BF16,
            ..config(policy, attention)
        };
        let (d, _) = keydiff::parity::compare_devices(
            &path,
            3,
            None,
            &bf16(AttentionBackend::Eager),
            &bf16(AttentionBackend::Flash),
            250,
        )
        .unwrap();
        assert!(
            d.cosine > 0.999 && d.max_rel < 0.1,
            "{policy}: bf16 flash vs eager: {d:?}"
        );
    }
}

#[test]
fn default_config_resolves_attention_at_load() {
    // The library's default is `auto`, as the CLI's: on the CPU it resolves to eager (faster
    // there), and the engine reports the backend it runs, never `auto`.
    assert_eq!(EngineConfig::default().attention, AttentionBackend::Auto);
    let source = ModelSource::Random {
        config: root().join("configs/tiny-llama.json"),
        seed: 3,
        on_host: false,
        weights: None,
    };
    let engine = Engine::load(&source, &EngineConfig::default()).unwrap();
    assert_eq!(engine.config().attention, AttentionBackend::Eager);
}

/// Chunks of one token (as decode steps) take the CPU decode kernel, in both backends; the
/// whole prompt as one chunk takes the general path (GEMMs, or candle-nn's flash kernel).
/// Their last logits must agree to f32 rounding.
#[test]
fn one_token_chunks_match_the_whole_prompt() {
    let path = root().join("configs/tiny-qwen-d64.json");
    let source = ModelSource::Random {
        config: path,
        seed: 5,
        on_host: false,
        weights: None,
    };
    let tokens = keydiff::parity::random_tokens(300, 256, 4);
    for attention in [AttentionBackend::Eager, AttentionBackend::Flash] {
        let cfg = EngineConfig {
            attention,
            ..Default::default()
        };
        let e = Engine::load(&source, &cfg).unwrap();
        let whole = e.prefill_logits(&tokens, tokens.len()).unwrap();
        let single = e.prefill_logits(&tokens, 1).unwrap();
        let d = keydiff::parity::compare_logits(&whole, &single);
        assert!(
            d.max_rel < 1e-4 && d.top1_equal(),
            "{attention}: B = 1 vs the whole prompt: {d:?}"
        );
    }
}
