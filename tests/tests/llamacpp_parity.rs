//! Parity with llama.cpp on the real GGUF models: token ids, top-1, top-10 logits, and greedy
//! continuations, against fixtures recorded by scripts/gen-fixtures.py (llama-cpp-python).

use keydiff::{Engine, EngineConfig, GenerateParams, Message, ModelSource, Prompt};
use keydiff_tests::{fixture, model, QWEN, SMOLLM2};

/// Largest accepted |logit − llama.cpp logit| over the reference top-10.
///
/// Both engines multiply the same quantized weights, but not in the same order, and llama.cpp
/// quantizes activations to Q8 blocks for every quantized matmul while our CPU path may use f32
/// activations (dequantized GEMM for prefill chunks). Over 24–30 layers that moves logits of
/// magnitude ~10–30 by up to a few tenths; 0.75 is about 3% of the logit range and still far
/// below the gap that would flip a confident top-1. Top-1 and token ids must match exactly.
const TOP10_TOL: f32 = 0.75;

/// Greedy tokens that must match llama.cpp exactly (the issue asks for at least 8).
const GREEDY_EXACT: usize = 8;

fn check(name: &str, path: &str) {
    let fx = fixture(name);
    let engine = Engine::load(
        &ModelSource::Gguf(model(path)),
        &EngineConfig::default(),
    )
    .unwrap();
    let mut report = Vec::new();
    for p in &fx.prompts {
        let ids = match &p.messages {
            Some(m) => {
                let msgs: Vec<Message> = m
                    .iter()
                    .map(|v| Message {
                        role: v["role"].as_str().unwrap().into(),
                        content: v["content"].as_str().unwrap().into(),
                    })
                    .collect();
                let rendered = engine.render_chat(&msgs).unwrap();
                assert_eq!(rendered, p.text, "{name}/{}: chat template rendering", p.name);
                engine.prompt_tokens(&Prompt::Chat(msgs)).unwrap()
            }
            None => engine.tokenize(&p.text, p.special).unwrap(),
        };
        assert_eq!(ids, p.tokens, "{name}/{}: token ids", p.name);

        let logits = engine.prefill_logits(&p.tokens, 128).unwrap();
        let top1 = keydiff::parity::compare_logits(&logits, &logits).reference_top1;
        assert_eq!(top1, p.top_logits[0].0, "{name}/{}: top-1", p.name);
        let worst = p
            .top_logits
            .iter()
            .map(|&(id, l)| (logits[id as usize] - l).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= TOP10_TOL,
            "{name}/{}: top-10 logit error {worst} > {TOP10_TOL}",
            p.name
        );

        let params = GenerateParams {
            prompt: Prompt::Tokens(p.tokens.clone()),
            max_tokens: p.greedy.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let out = engine.generate(&params, |_| {}).unwrap();
        let same = out
            .tokens
            .iter()
            .zip(&p.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        assert!(
            same >= GREEDY_EXACT.min(p.greedy.len()),
            "{name}/{}: greedy continuation diverges at token {same}: ours {:?} llama.cpp {:?}",
            p.name,
            out.tokens,
            p.greedy
        );
        report.push(format!(
            "{}: top10 max err {worst:.4}, greedy {same}/{} identical",
            p.name,
            p.greedy.len()
        ));
    }
    eprintln!("{name} vs llama.cpp:\n  {}", report.join("\n  "));
}

#[test]
fn smollm2_matches_llamacpp() {
    check("smollm2", SMOLLM2);
}

#[test]
fn qwen_matches_llamacpp() {
    check("qwen", QWEN);
}
