//! JSON mode (`Sampling::format = Format::JsonObject`) on the real models: every reply is one
//! JSON object that serde_json parses, ended by the model's end of generation, greedy and
//! sampled (a sampled one cut at `max_tokens` is the start of one), under an evicting budget,
//! and with several completions at once; the model's logprobs are reported unmasked.

use keydiff::{Format, GenerateParams, Message, Prompt, Sampling, StopReason};
use keydiff_tests::{evicting_engine as engine, QWEN, SMOLLM2};

fn ask(question: &str, sampling: Sampling) -> GenerateParams {
    let context = "The cat is called Tom. He is three years old, grey, and likes fish. ".repeat(4);
    GenerateParams {
        prompt: Prompt::Chat(vec![Message::new("user", format!("{context}\n{question}"))]),
        max_tokens: 160,
        sampling: Sampling {
            format: Format::JsonObject,
            ..sampling
        },
        logprobs: Some(1),
        ..Default::default()
    }
}

/// One JSON object, parsed, ended by the model.
fn check(out: &keydiff::Output, what: &str) {
    assert_eq!(
        out.stats.stop_reason,
        StopReason::Eos,
        "{what}: {:?}",
        out.text
    );
    let v: serde_json::Value =
        serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{what}: {e}: {:?}", out.text));
    assert!(v.is_object(), "{what}: {v}");
}

#[test]
fn replies_are_one_json_object() {
    for path in [SMOLLM2, QWEN] {
        let e = engine(path);
        let q = "Describe the cat as JSON with the keys name, age and colour.";
        let greedy = e.generate(&ask(q, Sampling::default()), |_| {}).unwrap();
        check(&greedy, &format!("{path} greedy"));
        assert!(
            greedy.stats.eviction.evictions > 0,
            "{path}: nothing evicted"
        );
        // The logprobs are the model's, before the mask: greedy, the mask made the model take
        // a token it did not rank first (it starts its replies with a code fence), which
        // renormalised logprobs would rank first.
        let lps = greedy.logprobs.as_ref().unwrap();
        assert_eq!(lps.len(), greedy.tokens.len());
        assert!(
            lps.iter()
                .any(|l| l.top[0].0 != l.token && l.top[0].1 > l.logprob),
            "{path}: the mask never changed the choice"
        );
        let sampled = Sampling {
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        };
        // Sampled at temperature 1, a reply may ramble past `max_tokens`: then it is cut
        // short, but still the start of an object (sampled first and masked on a miss, the
        // draw depends on the seed, not on whether the mask was needed).
        let outs = e.generate_n(&ask(q, sampled), 3, |_, _| {}).unwrap();
        for (i, out) in outs.into_iter().enumerate() {
            let out = out.unwrap();
            let what = format!("{path} sampled {i}");
            if out.stats.stop_reason == StopReason::MaxTokens {
                let mut j = keydiff::json_mode::JsonObject::new();
                assert!(
                    j.push_all(out.text.as_bytes()) && !j.is_done(),
                    "{what}: {:?}",
                    out.text
                );
            } else {
                check(&out, &what);
            }
        }
    }
}

/// The same prompt without JSON mode: the greedy reply is not a bare JSON object (so the mask
/// is what made it one above).
#[test]
fn without_json_mode_the_reply_is_prose() {
    let e = engine(SMOLLM2);
    let mut p = ask(
        "Describe the cat as JSON with the keys name, age and colour.",
        Sampling::default(),
    );
    p.sampling.format = Format::Text;
    let out = e.generate(&p, |_| {}).unwrap();
    let parsed: Result<serde_json::Map<String, serde_json::Value>, _> =
        serde_json::from_str(&out.text);
    assert!(parsed.is_err(), "{:?}", out.text);
}

/// A logit bias that bans what JSON mode needs: the end of generation is refused before the
/// prefill; every token that could open the object, once the whitespace allowed before it is
/// spent, ends the request with an error instead of text that is no JSON.
#[test]
fn a_logit_bias_that_bans_what_json_needs_is_refused() {
    let e = engine(SMOLLM2);
    let ids: Vec<u32> = (0..e.model_config().vocab_size as u32).collect();
    let pieces = e.token_pieces(&ids).unwrap();
    let ban = |keep: &dyn Fn(&keydiff::TokenPiece) -> bool| -> Sampling {
        let logit_bias = (ids.iter().zip(&pieces))
            .filter(|(_, p)| keep(p))
            .map(|(&id, _)| (id, f32::NEG_INFINITY))
            .collect();
        Sampling {
            logit_bias,
            ..Default::default()
        }
    };
    let q = "Describe the cat as JSON.";
    let err = e
        .generate(&ask(q, ban(&|p| p.special)), |_| {})
        .unwrap_err();
    assert!(
        err.to_string().contains("bans the end of generation"),
        "{err}"
    );
    let opening = ban(&|p| p.bytes.trim_ascii_start().first() == Some(&b'{'));
    assert!(opening.logit_bias.len() > 1);
    let err = e.generate(&ask(q, opening), |_| {}).unwrap_err();
    assert!(err.to_string().contains("left no token"), "{err}");
}
