//! Fill in the middle (`Prompt::Infill`, the CLI's `--suffix`, the server's `suffix`): the
//! prompt is the model's FIM tokens around the two texts, as llama.cpp's infill builds it, and
//! a code model writes the hole; a model without FIM tokens refuses.

use keydiff::{EngineError, GenerateParams, Prompt};
use keydiff_tests::{evicting_engine as engine, QWEN, SMOLLM2};

fn infill(prefix: &str, suffix: &str) -> Prompt {
    Prompt::Infill {
        prefix: prefix.into(),
        suffix: suffix.into(),
    }
}

#[test]
fn a_code_model_fills_the_hole() {
    let e = engine(QWEN);
    let (prefix, suffix) = ("def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n");
    // The same ids as the FIM tokens' texts parsed as special tokens around the texts.
    let ids = e.prompt_tokens(&infill(prefix, suffix)).unwrap();
    let want = e
        .tokenize_special(&format!(
            "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
        ))
        .unwrap();
    assert_eq!(ids, want);
    // Special-token text inside the texts stays text.
    let odd = e.prompt_tokens(&infill("<|fim_middle|>", "x")).unwrap();
    assert_eq!(
        odd.iter().filter(|&&t| t == want[want.len() - 1]).count(),
        1
    );

    // A prompt longer than the budget: filled under eviction.
    let long_prefix = format!("{}{prefix}", "# a helper module\n".repeat(12));
    let out = e
        .generate(
            &GenerateParams {
                prompt: infill(&long_prefix, suffix),
                max_tokens: 24,
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
    assert!(out.stats.eviction.evictions > 0, "nothing evicted");
    assert!(out.text.starts_with("a + b"), "{:?}", out.text);
}

#[test]
fn models_without_fim_tokens_and_empty_infills_are_refused() {
    let e = engine(SMOLLM2);
    let err = e.prompt_tokens(&infill("def f():", "")).unwrap_err();
    assert!(
        matches!(&err, EngineError::BadParams(m) if m.contains("no fill-in-the-middle tokens")),
        "{err}"
    );
    let e = engine(QWEN);
    assert!(matches!(
        e.prompt_tokens(&infill("", "")),
        Err(EngineError::EmptyPrompt)
    ));
    // One side empty is a prompt.
    assert!(e.prompt_tokens(&infill("", "return x\n")).is_ok());
}
