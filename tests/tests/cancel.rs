//! Cancelling a running request (`GenerateParams::cancel`): it stops at the next chunk or
//! token with what it has, which is what an uncancelled run would have produced so far.

use keydiff::{
    CacheConfig, CancelToken, Conversation, Engine, EngineConfig, Event, GenerateParams,
    ModelSource, Prompt, StopReason,
};
use keydiff_tests::{model, SMOLLM2};

fn engine() -> Engine {
    let cfg = EngineConfig {
        cache: CacheConfig::full(128),
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap()
}

fn params(prompt: &str, n: usize, cancel: Option<CancelToken>) -> GenerateParams {
    GenerateParams {
        prompt: Prompt::Text(prompt.into()),
        max_tokens: n,
        ignore_eos: true,
        cancel,
        ..Default::default()
    }
}

#[test]
fn cancelling_in_decode_keeps_what_was_generated() {
    let e = engine();
    let prompt = "The history of the printing press begins";
    let full = e.generate(&params(prompt, 40, None), |_| {}).unwrap();
    assert_eq!(full.stats.stop_reason, StopReason::MaxTokens);

    let cancel = CancelToken::new();
    let mut pieces = 0;
    let out = e
        .generate(&params(prompt, 40, Some(cancel.clone())), |ev| {
            if let Event::Text(_) = ev {
                pieces += 1;
                if pieces == 5 {
                    cancel.cancel();
                }
            }
        })
        .unwrap();
    assert_eq!(out.stats.stop_reason, StopReason::Cancelled);
    assert!(
        out.tokens.len() >= 5 && out.tokens.len() < full.tokens.len(),
        "{} of {} tokens",
        out.tokens.len(),
        full.tokens.len()
    );
    assert_eq!(out.tokens[..], full.tokens[..out.tokens.len()]);
    assert!(full.text.starts_with(&out.text), "{:?}", out.text);
}

#[test]
fn cancelling_in_prefill_stops_after_the_chunk() {
    let e = engine();
    let prompt = "All work and no play makes Jack a dull boy. ".repeat(60);
    let cancel = CancelToken::new();
    let mut chunks = 0;
    let out = e
        .generate(&params(&prompt, 8, Some(cancel.clone())), |ev| {
            if let Event::Prefill { .. } = ev {
                chunks += 1;
                cancel.cancel();
            }
        })
        .unwrap();
    assert!(
        out.stats.prompt_tokens > 4 * 128,
        "{}",
        out.stats.prompt_tokens
    );
    assert_eq!(chunks, 1);
    assert_eq!(out.stats.stop_reason, StopReason::Cancelled);
    assert!(out.tokens.is_empty() && out.text.is_empty());
    assert_eq!(out.stats.final_cache_len, 128);

    // Cancelled before it starts: nothing runs.
    let out = e
        .generate(&params(&prompt, 8, Some(cancel)), |_| {
            panic!("no event expected")
        })
        .unwrap();
    assert_eq!(out.stats.stop_reason, StopReason::Cancelled);
    assert_eq!(out.stats.final_cache_len, 0);
}

/// A chat turn cancelled before its reply began is not recorded; the next turn prefills the
/// conversation afresh and answers as a fresh conversation would.
#[test]
fn a_chat_turn_cancelled_in_prefill_is_not_recorded() {
    let e = engine();
    let mut conv = Conversation::new(None);
    let greedy = GenerateParams {
        max_tokens: 8,
        ..Default::default()
    };
    let first = e
        .chat_turn(&mut conv, "What is the capital of France?", &greedy, |_| {})
        .unwrap();
    assert!(!first.tokens.is_empty());
    let before = conv.messages().to_vec();

    let cancel = CancelToken::new();
    cancel.cancel();
    let cancelled = GenerateParams {
        cancel: Some(cancel),
        ..greedy.clone()
    };
    let out = e
        .chat_turn(&mut conv, "And of Italy?", &cancelled, |_| {})
        .unwrap();
    assert_eq!(out.stats.stop_reason, StopReason::Cancelled);
    assert_eq!(conv.messages(), &before[..]);

    let next = e
        .chat_turn(&mut conv, "And of Spain?", &greedy, |_| {})
        .unwrap();
    assert_eq!(next.stats.prefix_tokens, 0, "prefilled afresh");
    let mut fresh = Conversation::new(None);
    e.chat_turn(
        &mut fresh,
        "What is the capital of France?",
        &greedy,
        |_| {},
    )
    .unwrap();
    let again = e
        .chat_turn(&mut fresh, "And of Spain?", &greedy, |_| {})
        .unwrap();
    assert_eq!(next.tokens, again.tokens);
    assert_eq!(conv.messages(), fresh.messages());
}

/// A chat turn cancelled during its reply keeps the reply so far, and the next turn goes on
/// as a conversation with that reply would (full cache: as a fresh request on it); the last
/// sampled token is not fed twice.
#[test]
fn a_chat_turn_cancelled_in_its_reply_goes_on() {
    let e = engine();
    let mut conv = Conversation::new(None);
    let cancel = CancelToken::new();
    let params = GenerateParams {
        max_tokens: 40,
        ignore_eos: true,
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let mut pieces = 0;
    let first = e
        .chat_turn(
            &mut conv,
            "Tell me about the history of Paris.",
            &params,
            |ev| {
                if let Event::Text(_) = ev {
                    pieces += 1;
                    if pieces == 3 {
                        cancel.cancel();
                    }
                }
            },
        )
        .unwrap();
    assert_eq!(first.stats.stop_reason, StopReason::Cancelled);
    assert!(!first.tokens.is_empty() && first.tokens.len() < 40);
    let greedy = GenerateParams {
        max_tokens: 12,
        ..Default::default()
    };
    let before = conv.position();
    let next = e
        .chat_turn(&mut conv, "And of Rome?", &greedy, |_| {})
        .unwrap();
    assert_eq!(next.stats.prefix_tokens, before);
    let fresh = e
        .generate(
            &GenerateParams {
                prompt: Prompt::Chat(conv.messages()[..conv.messages().len() - 1].to_vec()),
                ..greedy.clone()
            },
            |_| {},
        )
        .unwrap();
    assert_eq!(
        next.tokens, fresh.tokens,
        "{:?} vs {:?}",
        next.text, fresh.text
    );
}
