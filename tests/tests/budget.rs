//! The engine under a KV budget: no eviction below the budget, memory bounded by N + B, and a
//! real model that still answers from early context after heavy eviction.

use keydiff::{
    CacheConfig, Engine, EngineConfig, GenerateParams, Message, ModelSource, PolicyKind, Prompt,
};
use keydiff_tests::{model, root, SMOLLM2};

fn budgeted(policy: &str, budget: usize, chunk: usize) -> EngineConfig {
    EngineConfig {
        cache: CacheConfig {
            policy: PolicyKind::parse(policy, keydiff::SNAPKV_WINDOW, 0).unwrap(),
            budget: Some(budget),
            chunk,
            window: 0.0,
            sinks: 0,
            evict_every: None,
        },
        ..Default::default()
    }
}

fn greedy(tokens: Vec<u32>, n: usize) -> GenerateParams {
    GenerateParams {
        prompt: Prompt::Tokens(tokens),
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Below the budget nothing is evicted and the output is bit-identical to the full cache.
#[test]
fn short_prompt_is_identical_to_full() {
    let fx = keydiff_tests::fixture("smollm2");
    let p = fx.prompts.iter().find(|p| p.name == "prose").unwrap();
    let full = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &EngineConfig::default()).unwrap();
    let want = full
        .generate(&greedy(p.tokens.clone(), 16), |_| {})
        .unwrap();
    let want_logits = full.prefill_logits(&p.tokens, 128).unwrap();
    for policy in ["keydiff", "tova", "snapkv", "h2o", "sink"] {
        let e = Engine::load(
            &ModelSource::Gguf(model(SMOLLM2)),
            &budgeted(policy, 512, 128),
        )
        .unwrap();
        let got = e.generate(&greedy(p.tokens.clone(), 16), |_| {}).unwrap();
        assert_eq!(got.stats.eviction.evictions, 0, "{policy}");
        assert_eq!(got.tokens, want.tokens, "{policy}");
        assert_eq!(
            e.prefill_logits(&p.tokens, 128).unwrap(),
            want_logits,
            "{policy}: logits"
        );
    }
}

/// Peak KV bytes do not grow with the prompt: 2K and 8K prompts at budget N use exactly
/// (N+B)·layers·kv_heads·head_dim·2·bytes, and the cache never holds more than N + B slots.
#[test]
fn peak_kv_is_bounded_by_budget() {
    let (n, b) = (256, 64);
    for preset in ["tiny-llama", "tiny-qwen"] {
        let source = ModelSource::Random {
            config: root().join(format!("configs/{preset}.json")),
            seed: 1,
            on_host: false,
            weights: None,
        };
        let e = Engine::load(&source, &budgeted("keydiff", n, b)).unwrap();
        let c = e.model_config().clone();
        let expect = (n + b) * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4;
        for len in [2048, 8192] {
            let tokens = keydiff::parity::random_tokens(len, c.vocab_size, 5);
            let out = e.generate(&greedy(tokens, 8), |_| {}).unwrap();
            let s = &out.stats;
            assert_eq!(s.peak_kv_bytes, expect, "{preset} {len}");
            assert!(
                s.final_cache_len <= n + b,
                "{preset} {len}: {}",
                s.final_cache_len
            );
            assert!(
                s.eviction.evictions >= (len - n) / b,
                "{preset} {len}: {:?}",
                s.eviction
            );
        }
    }
}

/// A budget beyond the request (prompt + output) never binds, and the cache allocates the
/// request rather than N + B: a 100K budget on a 300-token request costs what `full` costs.
#[test]
fn a_budget_beyond_the_request_costs_what_full_costs() {
    let source = ModelSource::Random {
        config: root().join("configs/tiny-llama.json"),
        seed: 1,
        on_host: false,
        weights: None,
    };
    let full = Engine::load(&source, &EngineConfig::default()).unwrap();
    let big = Engine::load(&source, &budgeted("keydiff", 100_000, 64)).unwrap();
    let tokens = keydiff::parity::random_tokens(300, full.model_config().vocab_size, 3);
    let want = full.generate(&greedy(tokens.clone(), 8), |_| {}).unwrap();
    let got = big.generate(&greedy(tokens, 8), |_| {}).unwrap();
    assert_eq!(got.stats.eviction.evictions, 0);
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.stats.peak_kv_bytes, want.stats.peak_kv_bytes);
    let c = full.model_config();
    assert_eq!(
        got.stats.peak_kv_bytes,
        308 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4
    );
}

/// A fact stated once near the start of a ~2K-token prompt is still answered after KeyDiff
/// evicts down to a budget of 1024 (and the cache never exceeds N + B).
#[test]
fn keydiff_keeps_an_early_fact() {
    let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
    let mut text = String::from("Remember this: the secret code is 4721.\n");
    for _ in 0..90 {
        text.push_str(filler);
    }
    text.push_str("\nWhat is the secret code? Answer with the number only.");
    let msgs = vec![Message::new("user", text)];
    for (label, cfg) in [
        ("full", EngineConfig::default()),
        ("keydiff", budgeted("keydiff", 1024, 128)),
    ] {
        let e = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
        let params = GenerateParams {
            prompt: Prompt::Chat(msgs.clone()),
            max_tokens: 12,
            ..Default::default()
        };
        let out = e.generate(&params, |_| {}).unwrap();
        eprintln!(
            "{label}: prompt {} tokens, {} evictions, answer {:?}",
            out.stats.prompt_tokens, out.stats.eviction.evictions, out.text
        );
        assert!(
            out.stats.prompt_tokens > 1800,
            "prompt too short: {}",
            out.stats.prompt_tokens
        );
        assert!(out.text.contains("4721"), "{label}: {:?}", out.text);
        if label == "keydiff" {
            assert!(out.stats.eviction.evictions > 0);
            assert!(out.stats.final_cache_len <= 1024 + 128);
            assert_eq!(out.stats.peak_kv_bytes, (1024 + 128) * 30 * 3 * 64 * 2 * 4);
        }
    }
}

/// Every layer evicting at once after the last layer's attention (the default) gives the
/// tokens, logits and evictions of each layer evicting after its own, bit for bit, on a real
/// model (SmolLM2's 30 layers), in prefill and in decode (every 4 tokens): policies that score
/// every layer at once (KeyDiff on float caches, StreamingLLM) and those that score each
/// layer after its attention (TOVA, SnapKV, H2O with their statistics; KeyDiff on a q8_0
/// cache).
#[test]
fn layers_evicting_together_give_what_per_layer_eviction_gives() {
    use candle_core::DType;
    use keydiff::KvType;
    let fx = keydiff_tests::fixture("smollm2");
    let p = fx.prompts.iter().find(|p| p.name == "prose").unwrap();
    let f32_ = KvType::Float(DType::F32);
    let cases = [
        ("keydiff", f32_),
        ("keydiff", KvType::Float(DType::F16)),
        ("keydiff", KvType::Q8_0),
        ("keydiff-mean", f32_),
        ("sink", KvType::Float(DType::BF16)),
        ("tova", f32_),
        ("snapkv", f32_),
        ("h2o", f32_),
    ];
    for (policy, kv) in cases {
        let run = |per_layer: bool| {
            let mut cfg = budgeted(policy, 48, 16);
            cfg.cache.evict_every = Some(4);
            cfg.kv_dtype = Some(kv.into());
            cfg.evict_per_layer = per_layer;
            let e = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
            let out = e.generate(&greedy(p.tokens.clone(), 12), |_| {}).unwrap();
            let logits = e.prefill_logits(&p.tokens, 16).unwrap();
            (out.tokens, out.stats.eviction.evictions, logits)
        };
        let (together, alone) = (run(false), run(true));
        assert!(together.1 > 0, "{policy} {kv}: the prompt did not evict");
        assert_eq!(together, alone, "{policy} {kv}");
    }
}
