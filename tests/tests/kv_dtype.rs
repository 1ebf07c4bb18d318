//! A KV cache held in another dtype than the activations (`--kv-dtype`): f16/bf16 caches under
//! f32 activations on the CPU, read in place by the decode kernel and converted for the general
//! path, under every policy.

use candle_core::DType;
use keydiff::{
    AttentionBackend, CacheConfig, Engine, EngineConfig, GenerateParams, ModelSource, PolicyKind,
    Prompt,
};
use keydiff_tests::{root, EVICTING_POLICIES};

/// tiny-qwen-d64: heads of 64, so one-token chunks take the CPU decode kernel.
fn source() -> ModelSource {
    ModelSource::Random {
        config: root().join("configs/tiny-qwen-d64.json"),
        seed: 5,
        on_host: false,
    }
}

fn config(kv_dtype: Option<DType>, attention: AttentionBackend) -> EngineConfig {
    EngineConfig {
        kv_dtype,
        attention,
        ..Default::default()
    }
}

/// Within one cache dtype, one-token chunks (the decode kernel reading f16/bf16 rows in place)
/// and the whole prompt as one chunk (the general path on a converted copy) round the same
/// keys and values: their logits agree to f32 rounding, amplified where a key computed in
/// another summation order lands on the other side of a rounding step of the cache dtype (one
/// step is 2^-8 of a value in bf16, 2^-11 in f16; measured max_rel: 1.7e-4 in bf16, below 1e-4
/// in f16). Against an f32 cache they differ (the cache really is rounded) but stay close.
#[test]
fn half_caches_are_read_in_place_and_converted_alike() {
    let tokens = keydiff::parity::random_tokens(300, 256, 4);
    for attention in [AttentionBackend::Eager, AttentionBackend::Flash] {
        let f32_cache = Engine::load(&source(), &config(None, attention)).unwrap();
        assert_eq!(f32_cache.config().kv_dtype, Some(DType::F32));
        let reference = f32_cache.prefill_logits(&tokens, tokens.len()).unwrap();
        for kv in [DType::F16, DType::BF16] {
            let e = Engine::load(&source(), &config(Some(kv), attention)).unwrap();
            assert_eq!(e.config().kv_dtype, Some(kv));
            assert_eq!(e.config().dtype, DType::F32);
            let whole = e.prefill_logits(&tokens, tokens.len()).unwrap();
            let single = e.prefill_logits(&tokens, 1).unwrap();
            let d = keydiff::parity::compare_logits(&whole, &single);
            let tol = if kv == DType::BF16 { 1e-3 } else { 1e-4 };
            assert!(
                d.max_rel < tol && d.top1_equal(),
                "{attention} {kv:?}: B = 1 vs the whole prompt: {d:?}"
            );
            let d = keydiff::parity::compare_logits(&reference, &whole);
            assert!(d.max_abs > 0.0, "{attention} {kv:?}: same logits as f32");
            assert!(
                d.cosine > 0.999,
                "{attention} {kv:?}: far from the f32 cache: {d:?}"
            );
        }
    }
}

/// An f16 cache under a budget: every policy evicts, eager and flash generate the same tokens
/// (decode steps through the kernel, with and without probabilities), and the cache takes half
/// the bytes of an f32 one.
#[test]
fn f16_cache_under_every_policy() {
    let params = GenerateParams {
        prompt: Prompt::Tokens(keydiff::parity::random_tokens(250, 256, 8)),
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    for policy in EVICTING_POLICIES {
        let cache = CacheConfig {
            policy: PolicyKind::parse(policy, keydiff::SNAPKV_WINDOW, 0).unwrap(),
            budget: Some(96),
            chunk: 32,
            window: 0.1,
            sinks: 2,
            evict_every: None,
        };
        let run = |kv, attention| {
            let cfg = EngineConfig {
                cache: cache.clone(),
                ..config(kv, attention)
            };
            let e = Engine::load(&source(), &cfg).unwrap();
            e.generate(&params, |_| {}).unwrap()
        };
        let eager = run(Some(DType::F16), AttentionBackend::Eager);
        let flash = run(Some(DType::F16), AttentionBackend::Flash);
        assert_eq!(eager.tokens, flash.tokens, "{policy}: generated tokens");
        assert!(eager.stats.eviction.evicted_slots > 0, "{policy}");
        assert_eq!(
            eager.stats.eviction.evicted_slots, flash.stats.eviction.evicted_slots,
            "{policy}: evictions"
        );
        assert_eq!(eager.stats.kv_dtype, "f16");
        let full = run(None, AttentionBackend::Eager);
        assert_eq!(full.stats.kv_dtype, "f32");
        assert_eq!(
            2 * eager.stats.peak_kv_bytes,
            full.stats.peak_kv_bytes,
            "{policy}: f16 cache bytes"
        );
    }
}

/// Only float caches the kernels and policies take.
#[test]
fn other_cache_dtypes_are_refused() {
    for dt in [DType::F64, DType::U32] {
        let err = match Engine::load(&source(), &config(Some(dt), AttentionBackend::Eager)) {
            Ok(_) => panic!("{dt:?} cache accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("KV cache dtype"), "{err}");
    }
}
