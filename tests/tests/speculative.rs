//! Speculative decoding by n-gram lookup (`GenerateParams::speculative`, `--spec-type ngram`):
//! the same tokens as decoding token by token, under every policy, greedy and sampled, with
//! the cache evicting in decode; drafts are made and taken.

use keydiff::{
    CacheConfig, Engine, EngineConfig, GenerateParams, ModelSource, NgramSpec, Output, PolicyKind,
    Prompt, Sampling,
};
use keydiff_tests::{model, temp_dir, write_tiny_qwen3_moe, QWEN, SMOLLM2};

/// A text the model goes on to copy: the repeated sentence is in the prompt.
const COPY: &str = "The old lighthouse keeper wrote in his log every evening. On Monday the sea \
    was calm and three ships passed by. On Tuesday a storm came from the west and no ship passed \
    by. On Wednesday the keeper repaired the lamp and painted the door green.\n\nThe same log, \
    copied out again:\n\nThe old lighthouse keeper wrote in his log every evening. On Monday";

fn engine(source: &ModelSource, cache: CacheConfig) -> Engine {
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(source, &cfg).unwrap()
}

fn caches() -> Vec<CacheConfig> {
    let mut v = vec![CacheConfig::full(16)];
    // N = 48, B = 16: the prompt evicts, and decode evicts every 16 tokens.
    for p in [
        "keydiff", "tova", "snapkv", "sink", "knorm", "random", "h2o",
    ] {
        v.push(CacheConfig {
            policy: PolicyKind::parse(p, 8, 7).unwrap(),
            budget: Some(48),
            ..CacheConfig::full(16)
        });
    }
    v
}

fn params(temperature: f32, speculative: Option<NgramSpec>) -> GenerateParams {
    GenerateParams {
        prompt: Prompt::Text(COPY.into()),
        max_tokens: 60,
        logprobs: Some(2),
        sampling: Sampling {
            temperature,
            top_p: 0.95,
            seed: 11,
            ..Default::default()
        },
        speculative,
        ..Default::default()
    }
}

fn run(e: &Engine, p: &GenerateParams) -> Output {
    e.generate(p, |_| {}).unwrap()
}

/// SmolLM2 (Q4_1, decoded with Q8_0 weights, whose rows are independent): with speculation
/// the tokens, their logprobs (bit for bit), the stop reason and the evictions are those of
/// token-by-token decoding, under every policy, greedy and at temperature 0.8; drafts were
/// verified and some taken. H2O, whose sums would keep the attention of rejected tokens,
/// decodes token by token (no drafts).
#[test]
fn speculation_gives_the_tokens_of_token_by_token_decoding() {
    let source = ModelSource::Gguf(model(SMOLLM2));
    // Drafted tokens that were not taken (forgotten by `KvCache::rewind`), over all runs.
    let mut rejected = 0;
    for cache in caches() {
        let name = cache.policy.name();
        let e = engine(&source, cache);
        for temperature in [0.0, 0.8] {
            let what = format!("{name} at temperature {temperature}");
            let plain = run(&e, &params(temperature, None));
            let spec = run(&e, &params(temperature, Some(NgramSpec::default())));
            assert_eq!(
                plain.tokens, spec.tokens,
                "{what}: {:?} / {:?}",
                plain.text, spec.text
            );
            assert_eq!(plain.text, spec.text, "{what}");
            assert_eq!(
                format!("{:?}", plain.logprobs),
                format!("{:?}", spec.logprobs),
                "{what}: logprobs"
            );
            let (a, b) = (&plain.stats, &spec.stats);
            assert_eq!(a.stop_reason, b.stop_reason, "{what}");
            assert_eq!(a.eviction.evictions, b.eviction.evictions, "{what}");
            assert_eq!(a.eviction.evicted_slots, b.eviction.evicted_slots, "{what}");
            assert_eq!(a.final_cache_len, b.final_cache_len, "{what}");
            assert_eq!(a.speculative, None);
            if temperature > 0.0 {
                // Without logprobs the tokens are drawn where the logits are (one row a
                // step), and a draft's rows on the host: the same generator either way.
                for spec in [None, Some(NgramSpec::default())] {
                    let p = GenerateParams {
                        logprobs: None,
                        ..params(temperature, spec)
                    };
                    assert_eq!(run(&e, &p).tokens, plain.tokens, "{what}: drawn, {spec:?}");
                }
            }
            let c = b.speculative.expect("speculative counters");
            if name == "h2o" {
                assert_eq!(c.drafted, 0, "{what}: H2O cannot take tokens back");
                continue;
            }
            assert!(c.drafted > 0 && c.accepted > 0, "{what}: {c:?}");
            assert!(c.accepted <= c.drafted && c.passes > 0, "{what}: {c:?}");
            rejected += c.drafted - c.accepted;
            if name != "full" && temperature == 0.0 {
                assert!(b.eviction.evictions > 0, "{what}: the cache never evicted");
            }
        }
    }
    assert!(
        rejected > 0,
        "no draft was rejected: rewinding went untested"
    );
}

/// Drafts of one token and of the most allowed, and n-grams of one token only: the same
/// tokens as token-by-token decoding under KeyDiff.
#[test]
fn every_draft_size_gives_the_same_tokens() {
    let e = engine(
        &ModelSource::Gguf(model(SMOLLM2)),
        CacheConfig {
            policy: PolicyKind::parse("keydiff", 8, 7).unwrap(),
            budget: Some(40),
            evict_every: Some(4),
            ..CacheConfig::full(8)
        },
    );
    let plain = run(&e, &params(0.0, None));
    for (min, max, draft) in [(1, 1, 1), (2, 4, keydiff::MAX_DRAFT), (1, 3, 3)] {
        let spec = NgramSpec {
            ngram_min: min,
            ngram_max: max,
            draft_max: draft,
            exact: false,
        };
        let out = run(&e, &params(0.0, Some(spec)));
        assert_eq!(plain.tokens, out.tokens, "{spec:?}");
        let c = out.stats.speculative.unwrap();
        assert!(c.accepted > 0, "{spec:?}: {c:?}");
    }
    let bad = NgramSpec {
        ngram_min: 3,
        ngram_max: 2,
        ..NgramSpec::default()
    };
    let err = e.generate(&params(0.0, Some(bad)), |_| {}).unwrap_err();
    assert!(err.to_string().contains("n-gram sizes"), "{err}");
}

/// Qwen2.5-Coder's GGUF decodes its `ffn_down` as Q6K, whose x86 kernel computes several rows
/// otherwise than one: with `exact`, the verification pass runs that weight row by row, and
/// the tokens and logprobs are token-by-token decoding's bit for bit, under KeyDiff evicting
/// in decode; drafts were taken.
#[test]
fn exact_speculation_is_bit_for_bit_where_kernels_differ() {
    let e = engine(
        &ModelSource::Gguf(model(QWEN)),
        CacheConfig {
            policy: PolicyKind::parse("keydiff", 8, 7).unwrap(),
            budget: Some(48),
            ..CacheConfig::full(16)
        },
    );
    let mut p = params(0.0, None);
    p.max_tokens = 40;
    let plain = run(&e, &p);
    p.speculative = Some(NgramSpec {
        exact: true,
        ..NgramSpec::default()
    });
    let spec = run(&e, &p);
    assert_eq!(
        plain.tokens, spec.tokens,
        "{:?} / {:?}",
        plain.text, spec.text
    );
    assert_eq!(
        format!("{:?}", plain.logprobs),
        format!("{:?}", spec.logprobs)
    );
    assert!(spec.stats.speculative.unwrap().accepted > 0);
    assert!(spec.stats.eviction.evictions > 0);
}

/// A mixture of experts (tiny random Qwen 3 MoE, Q8_0 experts): the verification pass routes
/// each row to its own experts; the tokens are those of token-by-token decoding and the
/// logprobs agree to rounding (its dense f32 linears sum over several rows otherwise than
/// over one).
#[test]
fn a_mixture_of_experts_speculates_alike() {
    let dir = temp_dir("speculative-moe");
    let path = dir.join("tiny-qwen3moe.gguf");
    write_tiny_qwen3_moe(&path, candle_core::quantized::GgmlDType::Q8_0).unwrap();
    let e = engine(
        &ModelSource::Gguf(path),
        CacheConfig {
            policy: PolicyKind::parse("keydiff", 8, 7).unwrap(),
            budget: Some(32),
            ..CacheConfig::full(8)
        },
    );
    let plain = run(&e, &params(0.0, None));
    let spec = run(&e, &params(0.0, Some(NgramSpec::default())));
    assert_eq!(plain.tokens, spec.tokens);
    let lp = |o: &Output| -> Vec<f32> {
        o.logprobs
            .as_ref()
            .unwrap()
            .iter()
            .map(|t| t.logprob)
            .collect()
    };
    for (a, b) in lp(&plain).iter().zip(lp(&spec)) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    assert!(spec.stats.speculative.unwrap().drafted > 0);
}

/// Speculative requests in a batch (`serve --max-batch`): each request's draft runs in the
/// batch's steps as decode rows beside the other requests' rows and prompt chunks, and every
/// request gets the tokens and logprobs it gets alone, decoded token by token (SmolLM2's Q8_0
/// rows are computed alone in any pass), under KeyDiff evicting in decode, greedy and
/// sampled, a request without speculation among them; drafts were taken. A batch refuses
/// `exact`, which would run its rows one by one.
#[test]
fn speculative_requests_in_a_batch_get_what_they_get_alone() {
    let e = engine(
        &ModelSource::Gguf(model(SMOLLM2)),
        CacheConfig {
            policy: PolicyKind::parse("keydiff", 8, 7).unwrap(),
            budget: Some(48),
            ..CacheConfig::full(16)
        },
    );
    let spec = Some(NgramSpec::default());
    let mut story = params(0.0, spec);
    story.prompt = Prompt::Text("Once upon a time, in a small village by the sea,".into());
    let mut other = params(0.0, None);
    other.prompt = Prompt::Text(format!("{COPY} Tuesday"));
    let requests = [params(0.0, spec), params(0.8, spec), story, other];
    let batched = e.generate_batch(&requests, |_, _| {}).unwrap();
    let mut taken = 0;
    for (i, (p, b)) in requests.iter().zip(batched).enumerate() {
        let b = b.unwrap();
        let mut alone = p.clone();
        alone.speculative = None;
        let a = run(&e, &alone);
        assert_eq!(
            a.tokens, b.tokens,
            "request {i}: {:?} / {:?}",
            a.text, b.text
        );
        assert_eq!(
            format!("{:?}", a.logprobs),
            format!("{:?}", b.logprobs),
            "request {i}"
        );
        assert_eq!(
            a.stats.eviction.evictions, b.stats.eviction.evictions,
            "request {i}"
        );
        taken += b.stats.speculative.map_or(0, |c| c.accepted);
    }
    assert!(taken > 0, "no draft was taken in the batch");
    let exact = Some(NgramSpec {
        exact: true,
        ..NgramSpec::default()
    });
    let err = e.batch().join(1, &params(0.0, exact)).unwrap_err();
    assert!(err.to_string().contains("exact"), "{err}");
}

/// A conversation's turn looks its drafts up in the earlier turns too (they are in its cache,
/// not in the turn's prompt): asked to copy its last reply, the second turn takes most of its
/// tokens from drafts (on an Intel Xeon 25 taken, 7 when only the turn's own tokens were
/// looked up; on an AMD EPYC the reply is shorter, 14 taken of its 16 drafted), and every
/// turn's tokens are those of the same conversation decoded token by token.
#[test]
fn a_chat_turn_drafts_from_earlier_turns() {
    let e = engine(&ModelSource::Gguf(model(SMOLLM2)), CacheConfig::full(16));
    let turns = [
        "Write one sentence about a red fox.",
        "Copy your previous sentence, word for word.",
    ];
    let talk = |spec: Option<NgramSpec>| -> Vec<Output> {
        let mut conv = keydiff::Conversation::new(None);
        let p = GenerateParams {
            max_tokens: 48,
            speculative: spec,
            ..Default::default()
        };
        turns
            .iter()
            .map(|t| e.chat_turn(&mut conv, t, &p, |_| {}).unwrap())
            .collect()
    };
    let plain = talk(None);
    let spec = talk(Some(NgramSpec::default()));
    for (a, b) in plain.iter().zip(&spec) {
        assert_eq!(a.tokens, b.tokens, "{:?} / {:?}", a.text, b.text);
    }
    // At least half of the copy came from accepted drafts. The reply's length follows the
    // host's float arithmetic, so the bound is relative to it, not a count.
    let second = spec[1].stats.speculative.unwrap();
    assert!(
        second.accepted >= 8 && 2 * second.accepted >= spec[1].tokens.len(),
        "{second:?} for {} tokens: {:?}",
        spec[1].tokens.len(),
        spec[1].text
    );
}

/// At the end of the context (`-c`), drafts stop inside it: the request ends where
/// token-by-token decoding ends it (`stop_reason: context`), with the same tokens.
#[test]
fn drafts_stay_inside_the_context() {
    let cfg = EngineConfig {
        cache: CacheConfig {
            policy: PolicyKind::parse("keydiff", 8, 7).unwrap(),
            budget: Some(48),
            ..CacheConfig::full(16)
        },
        context: Some(100),
        ..Default::default()
    };
    let e = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
    let plain = run(&e, &params(0.0, None));
    let spec = run(&e, &params(0.0, Some(NgramSpec::default())));
    assert_eq!(plain.stats.stop_reason, keydiff::StopReason::Context);
    assert_eq!(spec.stats.stop_reason, keydiff::StopReason::Context);
    assert_eq!(plain.tokens, spec.tokens);
    assert!(spec.stats.speculative.unwrap().accepted > 0);
}
