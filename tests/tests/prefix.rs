//! Prefix reuse: a request that starts from a shared, already prefilled prefix gives exactly
//! what a fresh request gives (bit for bit), under every policy, and prefixes that would change
//! the result are refused.

use keydiff::{CacheConfig, Engine, EngineConfig, GenerateParams, ModelSource, PolicyKind, Prompt};
use keydiff_tests::root;

const CHUNK: usize = 64;

fn tiny(preset: &str) -> Engine {
    let source = ModelSource::Random {
        config: root().join(format!("configs/{preset}.json")),
        seed: 5,
        on_host: false,
        weights: None,
    };
    let cfg = EngineConfig {
        cache: CacheConfig::full(CHUNK),
        ..Default::default()
    };
    Engine::load(&source, &cfg).unwrap()
}

fn cache(policy: &str, budget: Option<usize>) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse(policy, keydiff::SNAPKV_WINDOW, 0).unwrap(),
        budget,
        chunk: CHUNK,
        window: 0.1,
        sinks: 4,
        evict_every: None,
    }
}

fn greedy(tokens: &[u32]) -> GenerateParams {
    GenerateParams {
        prompt: Prompt::Tokens(tokens.to_vec()),
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Prefixes of 64, 192 and 320 tokens, one grown from the other, made under `chain`; every
/// policy at budgets 192 and 350 starts from the longest one its budget allows, and its logits
/// after the whole prompt, its generated tokens and its eviction count equal a fresh run's.
#[test]
fn reused_prefix_gives_bit_identical_results() {
    for preset in ["tiny-llama", "tiny-qwen"] {
        let mut e = tiny(preset);
        let vocab = e.model_config().vocab_size;
        let tokens = keydiff::parity::random_tokens(700, vocab, 21);
        for chain in ["full", "h2o"] {
            let mut prefixes = Vec::new();
            for point in [64, 192, 320] {
                let budget = (chain != "full").then_some(point);
                let p = e
                    .prefill_prefix(&tokens[..point], prefixes.last(), cache(chain, budget))
                    .unwrap();
                assert_eq!(p.len(), point);
                prefixes.push(p);
            }
            let policies = [
                "full", "keydiff", "tova", "snapkv", "sink", "knorm", "random",
            ];
            let policies = policies
                .iter()
                .chain((chain == "h2o").then_some(&"h2o"))
                .copied();
            for policy in policies {
                for budget in [Some(192), Some(350)] {
                    let budget = (policy != "full").then_some(budget).flatten();
                    let cfg = cache(policy, budget);
                    e.set_cache_config(cfg.clone()).unwrap();
                    let want = e.generate(&greedy(&tokens), |_| {}).unwrap();
                    let want_logits = e.prefill_logits_from(&tokens, None).unwrap();
                    let free = budget.unwrap_or(tokens.len());
                    let prefix = prefixes.iter().rev().find(|p| p.len() <= free).unwrap();
                    let got = e
                        .generate_from(&greedy(&tokens), Some(prefix), |_| {})
                        .unwrap();
                    let got_logits = e.prefill_logits_from(&tokens, Some(prefix)).unwrap();
                    let what = format!("{preset} chain {chain} {policy} N={budget:?}");
                    assert_eq!(got.stats.prefix_tokens, prefix.len(), "{what}");
                    assert_eq!(got.tokens, want.tokens, "{what}");
                    assert_eq!(
                        got.stats.eviction.evictions, want.stats.eviction.evictions,
                        "{what}"
                    );
                    if budget.is_some() {
                        assert!(want.stats.eviction.evictions > 0, "{what}");
                    }
                    let same = got_logits
                        .iter()
                        .zip(&want_logits)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: logits differ");
                }
            }
        }
    }
}

/// Prefixes that would not reproduce a fresh run are refused with a reason.
#[test]
fn unusable_prefixes_are_refused() {
    let mut e = tiny("tiny-llama");
    let tokens = keydiff::parity::random_tokens(600, 256, 4);
    let err = |r: keydiff::Result<keydiff::Output>| r.expect_err("must fail").to_string();

    // Not a whole number of chunks, and a budget that would evict inside the prefix.
    let msg = e
        .prefill_prefix(&tokens[..100], None, cache("full", None))
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("whole number of chunks"), "{msg}");
    let msg = e
        .prefill_prefix(&tokens[..256], None, cache("h2o", Some(128)))
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("would evict"), "{msg}");

    let full = e
        .prefill_prefix(&tokens[..256], None, cache("full", None))
        .unwrap();
    // A budget below the prefix: the policy would have evicted in it.
    e.set_cache_config(cache("keydiff", Some(192))).unwrap();
    let msg = err(e.generate_from(&greedy(&tokens), Some(&full), |_| {}));
    assert!(msg.contains("longer than the budget"), "{msg}");
    // H2O needs the attention it accumulates over the prefix.
    e.set_cache_config(cache("h2o", Some(320))).unwrap();
    let msg = err(e.generate_from(&greedy(&tokens), Some(&full), |_| {}));
    assert!(msg.contains("accumulates attention"), "{msg}");
    // A prompt that does not extend the prefix.
    e.set_cache_config(cache("keydiff", Some(320))).unwrap();
    let mut other = tokens.clone();
    other[3] = (other[3] + 1) % 256;
    let msg = err(e.generate_from(&greedy(&other), Some(&full), |_| {}));
    assert!(msg.contains("does not extend"), "{msg}");
    let msg = err(e.generate_from(&greedy(&tokens[..256]), Some(&full), |_| {}));
    assert!(msg.contains("does not extend"), "{msg}");
    // Another chunk size.
    e.set_cache_config(CacheConfig {
        chunk: 32,
        ..cache("keydiff", Some(320))
    })
    .unwrap();
    let msg = err(e.generate_from(&greedy(&tokens), Some(&full), |_| {}));
    assert!(msg.contains("chunks of 64"), "{msg}");
}

/// One engine shared between threads (`Arc<Engine>`): a prefix made on one thread goes on
/// on another as it does on its own, and requests on two threads at once give what each
/// gives alone. The parity helpers refuse ids beyond the vocabulary (on CUDA an embedding
/// lookup would read out of bounds).
#[test]
fn an_engine_and_its_prefixes_cross_threads() {
    let e = std::sync::Arc::new(tiny("tiny-llama"));
    let vocab = e.model_config().vocab_size;
    let tokens = keydiff::parity::random_tokens(200, vocab, 8);
    let alone = e.generate(&greedy(&tokens), |_| {}).unwrap().tokens;
    let made = {
        let (e, t) = (e.clone(), tokens.clone());
        std::thread::spawn(move || e.prefill_prefix(&t[..128], None, cache("full", None)))
            .join()
            .unwrap()
            .unwrap()
    };
    let (a, b) = std::thread::scope(|s| {
        let (e, tokens) = (&e, &tokens);
        let from = s.spawn(move || {
            let made = made;
            (e.generate_from(&greedy(tokens), Some(&made), |_| {}))
                .unwrap()
                .tokens
        });
        let fresh = s.spawn(move || e.generate(&greedy(tokens), |_| {}).unwrap().tokens);
        (from.join().unwrap(), fresh.join().unwrap())
    });
    assert_eq!(a, alone);
    assert_eq!(b, alone);
    let mut bad = tokens.clone();
    bad[3] = vocab as u32;
    for err in [
        e.prefill_logits(&bad, CHUNK).unwrap_err(),
        e.decode_logits(&bad, CHUNK, 2).unwrap_err(),
        e.prefill_logits_from(&bad, None).unwrap_err(),
    ] {
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    }
}

/// A prefix, a prompt cache or a conversation goes on only with the engine that made it:
/// another engine of the very same shape (here the same model loaded twice) refuses it
/// instead of continuing someone else's cache.
#[test]
fn state_goes_on_only_with_its_engine() {
    let (a, b) = (tiny("tiny-llama"), tiny("tiny-llama"));
    assert_ne!(a.id(), b.id());
    let tokens = keydiff::parity::random_tokens(200, a.model_config().vocab_size, 9);
    let prefix = a
        .prefill_prefix(&tokens[..128], None, cache("full", None))
        .unwrap();
    let err = b.generate_from(&greedy(&tokens), Some(&prefix), |_| {});
    assert!(err.unwrap_err().to_string().contains("another engine"));
    a.generate_from(&greedy(&tokens), Some(&prefix), |_| {})
        .unwrap();
    let mut pc = keydiff::PromptCache::new();
    a.generate_cached(&greedy(&tokens), &mut pc, |_| {})
        .unwrap();
    let err = b.generate_cached(&greedy(&tokens), &mut pc, |_| {});
    assert!(err.unwrap_err().to_string().contains("another engine"));
    a.generate_cached(&greedy(&tokens), &mut pc, |_| {})
        .unwrap();
}
