//! Logprobs (`GenerateParams::logprobs`, `prompt_logprobs`) and token pieces on the real
//! SmolLM2 and Qwen: prompt logprobs equal the perplexity path's (device log-softmax) under an
//! evicting budget and llama.cpp's on 1024 tokens; generated tokens' logprobs equal a naive
//! recomputation; they are the model's distribution whatever the sampler does; token bytes
//! add up to the text.

use keydiff::{
    CacheConfig, Conversation, Engine, EngineConfig, EngineError, Event, GenerateParams,
    ModelSource, PolicyKind, Prompt, PromptCache, Sampling, TokenLogprob,
};
use keydiff_tests::{model, ppl_fixture, root, QWEN, SMOLLM2};

fn engine(path: &str, cache: CacheConfig) -> Engine {
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(path)), &cfg).unwrap()
}

fn budget(policy: &str, n: usize, b: usize) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse(policy, 8, 0).unwrap(),
        budget: Some(n),
        ..CacheConfig::full(b)
    }
}

fn text(words: usize) -> String {
    let base = "The committee met on Tuesday to review the budget for the new library, \
                which had grown twice as fast as planned. ";
    base.repeat(words / 20 + 1)
}

/// Under budgets that evict, the prompt's logprobs are the perplexity path's, token for token:
/// the same chunks and evictions, with the log-softmax taken on the host in f64 instead of on
/// the device.
#[test]
fn prompt_logprobs_equal_the_perplexity_path_under_eviction() {
    for policy in ["keydiff", "tova", "h2o", "snapkv"] {
        let e = engine(SMOLLM2, budget(policy, 96, 32));
        let prompt = e.prompt_tokens(&Prompt::Text(text(300))).unwrap();
        assert!(prompt.len() > 250);
        let p = GenerateParams {
            prompt: Prompt::Tokens(prompt.clone()),
            max_tokens: 1,
            prompt_logprobs: Some(2),
            ..Default::default()
        };
        let mut events = 0;
        let out = e
            .generate(&p, |ev| {
                if let Event::PromptLogprobs { tokens, logprobs } = ev {
                    assert_eq!(tokens, &prompt[..]);
                    assert_eq!(logprobs.len(), prompt.len() - 1);
                    events += 1;
                }
            })
            .unwrap();
        assert_eq!(events, 1);
        assert!(out.logprobs.is_none());
        let lps = out.prompt_logprobs.unwrap();
        let ppl = e.perplexity(&prompt).unwrap();
        assert!(ppl.evictions > 0, "{policy}: the budget must evict");
        assert_eq!(out.stats.eviction.evictions, ppl.evictions, "{policy}");
        assert_eq!(lps.len(), ppl.nll.len());
        for (i, (lp, nll)) in lps.iter().zip(&ppl.nll).enumerate() {
            assert_eq!(lp.token, prompt[i + 1]);
            assert!(
                (-lp.logprob - nll).abs() < 2e-4,
                "{policy} token {i}: {} vs {nll}",
                -lp.logprob
            );
            assert_eq!(lp.top.len(), 2);
            assert!(lp.top[0].1 >= lp.top[1].1 && lp.top[0].1 >= lp.logprob);
        }
        // Every prompt row was computed: the same first token as without logprobs.
        let plain = e
            .generate(
                &GenerateParams {
                    prompt_logprobs: None,
                    ..p.clone()
                },
                |_| {},
            )
            .unwrap();
        assert_eq!(plain.tokens, out.tokens, "{policy}");
    }
}

/// On 1024 tokens of the GPL v3 with a full cache, against llama.cpp's per-token NLL (the
/// perplexity fixture; the bounds are `perplexity_matches_llamacpp`'s, which explains them).
#[test]
fn prompt_logprobs_match_llamacpp() {
    let fx = ppl_fixture("smollm2");
    let e = engine(SMOLLM2, CacheConfig::full(128));
    let p = GenerateParams {
        prompt: Prompt::Tokens(fx.tokens.clone()),
        max_tokens: 1,
        prompt_logprobs: Some(0),
        ..Default::default()
    };
    let lps = e.generate(&p, |_| {}).unwrap().prompt_logprobs.unwrap();
    assert_eq!(lps.len(), fx.nll.len());
    let diffs: Vec<f64> = lps
        .iter()
        .zip(&fx.nll)
        .map(|(lp, &nll)| (-lp.logprob as f64 - nll).abs())
        .collect();
    let mean: f64 = -lps.iter().map(|l| l.logprob as f64).sum::<f64>() / lps.len() as f64;
    let avg = diffs.iter().sum::<f64>() / diffs.len() as f64;
    let max = diffs.iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "mean NLL {mean:.5} vs llama.cpp {:.5}; per token |Δ| mean {avg:.5} max {max:.5}",
        fx.mean_nll
    );
    assert!((mean - fx.mean_nll).abs() < 0.012);
    assert!(avg < 0.2 && max < 1.5);
}

/// A reference for generated token `i`: the logits after prefilling the prompt and the tokens
/// before it, full cache.
fn naive(e: &Engine, prompt: &[u32], generated: &[u32], i: usize, top: usize) -> TokenLogprob {
    let seq: Vec<u32> = prompt.iter().chain(&generated[..i]).copied().collect();
    // The prompt as one chunk, then the generated tokens one at a time (as decode runs them).
    let mut cache = e.new_cache(seq.len()).unwrap();
    let mut logits = e.prefill_with(prompt, 128, &mut cache).unwrap();
    for &t in &generated[..i] {
        logits = e.prefill_with(&[t], 1, &mut cache).unwrap();
    }
    keydiff::logprobs::token_logprob(&logits, generated[i], top).unwrap()
}

/// Generates 8 greedy tokens of `prompt` with 4 alternatives each and checks them against a
/// recomputation from scratch: the largest difference of a logprob. The greedy token is
/// always the top alternative, and events come one per token, in order.
fn against_naive(e: &Engine, prompt: Prompt, what: &str) -> f32 {
    let p = GenerateParams {
        prompt,
        max_tokens: 8,
        ignore_eos: true,
        logprobs: Some(4),
        ..Default::default()
    };
    let mut streamed = Vec::new();
    let out = e
        .generate(&p, |ev| {
            if let Event::Logprob(t) = ev {
                streamed.push(t.clone());
            }
        })
        .unwrap();
    let lps = out.logprobs.clone().unwrap();
    assert_eq!(streamed, lps);
    assert_eq!(lps.len(), 8);
    let mut worst = 0f32;
    for (i, lp) in lps.iter().enumerate() {
        assert_eq!(lp.token, out.tokens[i]);
        assert_eq!(lp.top.len(), 4);
        assert_eq!(
            lp.top[0],
            (lp.token, lp.logprob),
            "{what} {i}: greedy is the top"
        );
        let want = naive(e, &out.prompt_tokens, &out.tokens, i, 4);
        worst = worst.max((lp.logprob - want.logprob).abs());
        for (a, b) in lp.top.iter().zip(&want.top) {
            worst = worst.max((a.1 - b.1).abs());
        }
    }
    eprintln!("{what}: largest |Δ logprob| against the recomputation {worst:.2e}");
    worst
}

/// Random f32 models (Llama- and Qwen-shaped) and the real ones: each generated token's
/// logprob and alternatives equal those of a recomputation in a fresh cache, the prompt as one
/// chunk and the generated tokens one at a time, with no sampler in between. The real models
/// run with their weights as stored, where a one-token prefill multiplies as decode does; with
/// the default dense prefill copies (f32, where decode uses Q8 activations as llama.cpp does)
/// the recomputation differs by up to 0.2 (measured 2026-12-02), as any prefill does from
/// decode.
#[test]
fn generated_logprobs_equal_a_naive_recomputation() {
    for config in ["tiny-llama", "tiny-qwen"] {
        let src = ModelSource::Random {
            config: root().join(format!("configs/{config}.json")),
            seed: 3,
            on_host: false,
            weights: None,
        };
        let e = Engine::load(&src, &EngineConfig::default()).unwrap();
        let vocab = e.model_config().vocab_size;
        let prompt = keydiff::parity::random_tokens(40, vocab, 5);
        let worst = against_naive(&e, Prompt::Tokens(prompt), config);
        assert!(worst < 1e-5, "{config}: {worst}");
    }
    for path in [SMOLLM2, QWEN] {
        let cfg = EngineConfig {
            cpu_weights: keydiff::CpuWeights::AS_STORED,
            ..Default::default()
        };
        let e = Engine::load(&ModelSource::Gguf(model(path)), &cfg).unwrap();
        let prompt = Prompt::Text("The three primary colours are".into());
        let worst = against_naive(&e, prompt, path);
        assert!(worst < 1e-5, "{path}: {worst}");
    }
}

/// Logprobs are the model's distribution: a sampled run with penalties and a temperature
/// reports, for its first token, the same alternatives as a greedy run, and the logprob of
/// the token it drew.
#[test]
fn logprobs_do_not_see_the_sampler() {
    let e = engine(SMOLLM2, CacheConfig::full(128));
    let prompt = Prompt::Text("Once upon a time".into());
    let run = |sampling: Sampling| {
        let p = GenerateParams {
            prompt: prompt.clone(),
            max_tokens: 6,
            sampling,
            logprobs: Some(20),
            ..Default::default()
        };
        e.generate(&p, |_| {}).unwrap().logprobs.unwrap()
    };
    let greedy = run(Sampling::default());
    let hot = run(Sampling {
        temperature: 1.5,
        repetition_penalty: 1.8,
        presence_penalty: 1.5,
        seed: 7,
        ..Default::default()
    });
    assert_eq!(hot[0].top, greedy[0].top);
    let drawn = hot[0].token;
    let want = greedy[0].top.iter().find(|t| t.0 == drawn).map(|t| t.1);
    if let Some(w) = want {
        assert_eq!(hot[0].logprob, w);
    }
    assert!(hot[0].logprob <= greedy[0].logprob);
}

/// Settings the engine refuses, and where prompt logprobs run afresh.
#[test]
fn logprob_requests_that_cannot_be_honoured() {
    let e = engine(SMOLLM2, CacheConfig::full(16));
    let base = GenerateParams {
        prompt: Prompt::Text("Hello there".into()),
        max_tokens: 2,
        ..Default::default()
    };
    for p in [
        GenerateParams {
            logprobs: Some(21),
            ..base.clone()
        },
        GenerateParams {
            prompt_logprobs: Some(99),
            ..base.clone()
        },
    ] {
        let err = e.generate(&p, |_| {}).unwrap_err();
        assert!(
            matches!(&err, EngineError::BadParams(m) if m.contains("at most 20")),
            "{err}"
        );
    }
    let mut conv = Conversation::new(None);
    let err = e
        .chat_turn(
            &mut conv,
            "hi",
            &GenerateParams {
                prompt_logprobs: Some(0),
                ..base.clone()
            },
            |_| {},
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("not available in a chat turn"),
        "{err}"
    );

    // Through a prompt cache: the second request shares the first's prompt, but asks for
    // prompt logprobs, so it prefills everything and equals a fresh request.
    let long = GenerateParams {
        prompt: Prompt::Text(text(100)),
        max_tokens: 2,
        ..Default::default()
    };
    let mut pc = PromptCache::new();
    e.generate_cached(&long, &mut pc, |_| {}).unwrap();
    assert!(!pc.tokens().is_empty());
    // A request refused for its prompt leaves the held cache as it was.
    let held = pc.tokens().to_vec();
    let context = e.model_config().context();
    let too_long = GenerateParams {
        prompt: Prompt::Tokens(vec![1; context + 1]),
        prompt_logprobs: Some(1),
        ..long.clone()
    };
    let err = e.generate_cached(&too_long, &mut pc, |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::PromptTooLong { .. }), "{err:?}");
    assert_eq!(
        pc.tokens(),
        held,
        "a refused request keeps the prompt cache"
    );
    let with_lp = GenerateParams {
        prompt_logprobs: Some(1),
        ..long.clone()
    };
    let cached = e.generate_cached(&with_lp, &mut pc, |_| {}).unwrap();
    assert_eq!(cached.stats.prefix_tokens, 0);
    assert!(pc.tokens().is_empty(), "the prompt cache is left empty");
    let fresh = e.generate(&with_lp, |_| {}).unwrap();
    assert_eq!(cached.prompt_logprobs, fresh.prompt_logprobs);
}

/// Every token's bytes: equal to its decoded text wherever that is whole UTF-8, and adding
/// up to the text for a prompt whose characters split across tokens. Special tokens are
/// flagged and carry their own text.
#[test]
fn token_pieces_are_the_bytes_of_the_text() {
    for path in [SMOLLM2, QWEN] {
        let e = engine(path, CacheConfig::full(128));
        let vocab = e.model_config().vocab_size as u32;
        let ids: Vec<u32> = (0..vocab).collect();
        let pieces = e.token_pieces(&ids).unwrap();
        let mut whole = 0;
        for (id, p) in ids.iter().zip(&pieces) {
            if p.special {
                continue;
            }
            if let Ok(s) = std::str::from_utf8(&p.bytes) {
                assert_eq!(s, e.detokenize(&[*id]).unwrap(), "{path}: token {id}");
                whole += 1;
            }
        }
        assert!(
            whole as f64 > 0.9 * vocab as f64,
            "{path}: {whole} of {vocab}"
        );
        let eos = e.eos_token().unwrap();
        let eos_ids = e.tokenize_special(&eos).unwrap();
        assert_eq!(eos_ids.len(), 1, "{path}: {eos}");
        // Without special-token parsing the same text is plain text, several tokens.
        let plain = e.tokenize_continuation(&eos).unwrap();
        assert!(
            plain.len() > 1 && !plain.contains(&eos_ids[0]),
            "{path}: {plain:?}"
        );
        let text_prompt = e.prompt_tokens(&Prompt::Text(format!("a{eos}b"))).unwrap();
        assert!(
            !text_prompt.contains(&eos_ids[0]),
            "{path}: {text_prompt:?}"
        );
        let eos_piece = &pieces[eos_ids[0] as usize];
        assert!(eos_piece.special, "{path}");
        assert_eq!(eos_piece.text(), eos);

        let text = "Café 東京 — naïve 🦀 résumé\n\tend";
        let ids = e.tokenize_continuation(text).unwrap();
        let bytes: Vec<u8> = e
            .token_pieces(&ids)
            .unwrap()
            .iter()
            .flat_map(|p| p.bytes.clone())
            .collect();
        assert_eq!(bytes, text.as_bytes(), "{path}");
        let split = e
            .token_pieces(&ids)
            .unwrap()
            .iter()
            .filter(|p| std::str::from_utf8(&p.bytes).is_err())
            .count();
        eprintln!(
            "{path}: {} tokens, {split} end inside a character",
            ids.len()
        );
        assert!(e.token_pieces(&[vocab + 10]).is_err());
    }
}
