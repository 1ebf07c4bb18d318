//! Grammars and JSON schemas (`Sampling::format = Format::Grammar`) on the real models: every
//! reply is a whole text of the grammar, ended by the model's end of generation, greedy and
//! sampled (sampled first and masked on a miss, and masked first under top-k), under an
//! evicting budget; what cannot be honoured is refused, before the prefill where it can be.

use keydiff::{
    json_schema, EngineError, Format, GenerateParams, Message, Prompt, Sampling, StopReason,
};
use keydiff_tests::{evicting_engine as engine, QWEN, SMOLLM2};
use serde_json::{json, Value};

fn ask(question: &str, grammar: &str, sampling: Sampling) -> GenerateParams {
    let context = "The cat is called Tom. He is three years old, grey, and likes fish. ".repeat(4);
    GenerateParams {
        prompt: Prompt::Chat(vec![Message::new("user", format!("{context}\n{question}"))]),
        max_tokens: 160,
        sampling: Sampling {
            format: Format::Grammar(grammar.into()),
            ..sampling
        },
        ..Default::default()
    }
}

/// Greedy, sampled with nothing truncating, and sampled under top-k.
fn samplings() -> Vec<(&'static str, Sampling)> {
    vec![
        ("greedy", Sampling::default()),
        (
            "temperature 1",
            Sampling {
                temperature: 1.0,
                seed: 5,
                ..Default::default()
            },
        ),
        (
            "top-k 20",
            Sampling {
                temperature: 0.8,
                top_k: 20,
                seed: 6,
                ..Default::default()
            },
        ),
    ]
}

#[test]
fn replies_are_texts_of_the_grammar() {
    let g = "root ::= (\"yes\" | \"no\") \", because \" [a-z ]{1,40} \".\"";
    for path in [SMOLLM2, QWEN] {
        let e = engine(path);
        for (what, s) in samplings() {
            let out = e
                .generate(&ask("Is Tom a dog? Say why.", g, s), |_| {})
                .unwrap();
            assert_eq!(
                out.stats.stop_reason,
                StopReason::Eos,
                "{path} {what}: {:?}",
                out.text
            );
            let t = &out.text;
            let rest = t
                .strip_prefix("yes, because ")
                .or_else(|| t.strip_prefix("no, because "))
                .unwrap_or_else(|| panic!("{path} {what}: {t:?}"));
            let why = rest
                .strip_suffix('.')
                .unwrap_or_else(|| panic!("{path} {what}: {t:?}"));
            assert!(
                (1..=40).contains(&why.len())
                    && why.chars().all(|c| c.is_ascii_lowercase() || c == ' '),
                "{path} {what}: {t:?}"
            );
        }
    }
}

/// Checks `v` against the schema of [`replies_follow_the_json_schema`] by hand.
fn check_cat(v: &Value, what: &str) {
    let o = v.as_object().unwrap_or_else(|| panic!("{what}: {v}"));
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    assert!(
        keys == ["name", "age", "colour", "chip", "kg"]
            || keys == ["name", "age", "colour", "chip", "kg", "likes"],
        "{what}: {v}"
    );
    assert!(o["name"].is_string(), "{what}: {v}");
    assert!(
        o["age"].as_i64().is_some_and(|a| (0..=30).contains(&a)),
        "{what}: {v}"
    );
    assert!(
        o["kg"].as_f64().is_some_and(|w| w > 0.5 && w <= 12.5),
        "{what}: {v}"
    );
    let chip = o["chip"].as_str().unwrap_or_else(|| panic!("{what}: {v}"));
    let b = chip.as_bytes();
    assert!(
        b.len() == 6
            && b[..2].iter().all(u8::is_ascii_uppercase)
            && b[2] == b'-'
            && b[3..].iter().all(u8::is_ascii_digit),
        "{what}: {v}"
    );
    assert!(
        ["grey", "black", "white"].contains(&o["colour"].as_str().unwrap()),
        "{what}: {v}"
    );
    if let Some(l) = o.get("likes") {
        let l = l.as_array().unwrap_or_else(|| panic!("{what}: {v}"));
        assert!(
            l.len() <= 2 && l.iter().all(Value::is_string),
            "{what}: {v}"
        );
    }
}

#[test]
fn replies_follow_the_json_schema() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "colour": {"enum": ["grey", "black", "white"]},
            "chip": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
            "kg": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 12.5},
            "likes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2}
        },
        "required": ["name", "age", "colour", "chip", "kg"]
    });
    let g = json_schema::to_grammar(&schema).unwrap();
    let q = "Describe the cat as JSON with the keys name, age, colour, chip, kg and likes.";
    for path in [SMOLLM2, QWEN] {
        let e = engine(path);
        for (what, s) in samplings() {
            let what = format!("{path} {what}");
            let out = e.generate(&ask(q, &g, s), |_| {}).unwrap();
            assert_eq!(
                out.stats.stop_reason,
                StopReason::Eos,
                "{what}: {:?}",
                out.text
            );
            assert!(out.stats.eviction.evictions > 0, "{what}: nothing evicted");
            let v: Value = serde_json::from_str(&out.text)
                .unwrap_or_else(|e| panic!("{what}: {e}: {:?}", out.text));
            check_cat(&v, &what);
        }
        // Several completions of one prompt, each its own text of the grammar.
        let s = Sampling {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        };
        for (i, out) in e
            .generate_n(&ask(q, &g, s), 3, |_, _| {})
            .unwrap()
            .iter()
            .enumerate()
        {
            let what = format!("{path} completion {i}");
            let out = out.as_ref().unwrap();
            let v: Value = serde_json::from_str(&out.text)
                .unwrap_or_else(|e| panic!("{what}: {e}: {:?}", out.text));
            check_cat(&v, &what);
        }
    }
}

#[test]
fn what_cannot_be_honoured_is_refused() {
    let e = engine(SMOLLM2);
    let bad = |p: &GenerateParams, want: &str| match e.generate(p, |ev| {
        assert!(
            !matches!(ev, keydiff::Event::Text(_)),
            "{want}: generated {ev:?}"
        )
    }) {
        Err(EngineError::BadParams(m) | EngineError::BadField { reason: m, .. }) => {
            assert!(m.contains(want), "{m}")
        }
        other => panic!("{want}: {other:?}"),
    };
    bad(
        &ask("?", "root ::= answer", Sampling::default()),
        "rule `answer` is used",
    );
    let mut p = ask("?", "root ::= \"a\"", Sampling::default());
    p.ignore_eos = true;
    bad(&p, "the grammar ends generation when the text is whole");
    let eos = e.eos_ids().to_vec();
    let mut p = ask("?", "root ::= \"a\"", Sampling::default());
    p.sampling.logit_bias = eos.iter().map(|&t| (t, f32::NEG_INFINITY)).collect();
    bad(&p, "the logit bias bans the end of generation");
    // Banning the one token that spells the text: the mask leaves nothing else.
    let mut p = ask("?", "root ::= \"zzzzzz\"", Sampling::default());
    p.sampling.logit_bias = (0..e.model_config().vocab_size as u32)
        .filter(|t| !eos.contains(t))
        .map(|t| (t, f32::NEG_INFINITY))
        .collect();
    bad(
        &p,
        "the grammar: the logit bias left no token that can continue the text",
    );
}
