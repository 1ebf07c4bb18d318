//! `Engine::generate_cached` / `PromptCache`: the next request that starts with the tokens of
//! the last one prefills only the rest, and answers as a fresh request does.

use keydiff::{
    CacheConfig, Engine, EngineConfig, GenerateParams, Message, ModelSource, PolicyKind, Prompt,
    PromptCache,
};
use keydiff_tests::{model, SMOLLM2};

fn engine(cache: CacheConfig) -> Engine {
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap()
}

fn budget(policy: &str, n: usize, b: usize) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse(policy, 8, 0).unwrap(),
        budget: Some(n),
        ..CacheConfig::full(b)
    }
}

fn greedy(prompt: Prompt, n: usize) -> GenerateParams {
    GenerateParams {
        prompt,
        max_tokens: n,
        ..Default::default()
    }
}

fn chat(turns: &[(&str, &str)]) -> Prompt {
    Prompt::Chat(turns.iter().map(|(r, c)| Message::new(*r, *c)).collect())
}

/// Runs `p` through the prompt cache and fresh; both must give the same tokens. Returns the
/// cached run's output.
fn same_as_fresh(e: &Engine, pc: &mut PromptCache, p: &GenerateParams) -> keydiff::Output {
    let cached = e.generate_cached(p, pc, |_| {}).unwrap();
    let fresh = e.generate(p, |_| {}).unwrap();
    assert_eq!(cached.tokens, fresh.tokens, "{:?}", cached.text);
    assert_eq!(cached.prompt_tokens, fresh.prompt_tokens);
    cached
}

/// A growing conversation under a full cache: the second request reuses the first one's
/// prompt and reply (whole chunks of them), prefills the rest, and answers as a fresh
/// request; the same request again reuses all but its last chunk; an unrelated one reuses
/// nothing.
#[test]
fn a_growing_conversation_reuses_the_last_cache() {
    let e = engine(CacheConfig::full(16));
    let mut pc = PromptCache::new();
    let q1 = "What is the capital of France?";
    let first = same_as_fresh(&e, &mut pc, &greedy(chat(&[("user", q1)]), 24));
    assert_eq!(first.stats.prefix_tokens, 0);
    let held = pc.tokens().len();
    assert!(held > first.prompt_tokens.len(), "the reply is held too");
    assert_eq!(
        pc.tokens()[..first.prompt_tokens.len()],
        first.prompt_tokens[..]
    );

    let turn2 = greedy(
        chat(&[
            ("user", q1),
            ("assistant", &first.text),
            ("user", "And the capital of Italy?"),
        ]),
        24,
    );
    let second = same_as_fresh(&e, &mut pc, &turn2);
    let reused = second.stats.prefix_tokens;
    assert!(reused >= first.prompt_tokens.len() - 16, "{reused} reused");
    assert_eq!(reused % 16, 0);
    assert!(reused <= held);
    assert_eq!(
        second.prompt_tokens[..reused],
        first
            .prompt_tokens
            .iter()
            .chain(&first.tokens)
            .copied()
            .collect::<Vec<_>>()[..reused]
    );

    // The same request again: all of it (the cache is cut back to the prompt, and the first
    // token comes from the logits the prompt left).
    let n = second.prompt_tokens.len();
    let again = same_as_fresh(&e, &mut pc, &turn2);
    assert_eq!(again.stats.prefix_tokens, n);
    assert!(
        !n.is_multiple_of(16),
        "a prompt that ends mid-chunk ({n} tokens)"
    );

    let other = same_as_fresh(
        &e,
        &mut pc,
        &greedy(Prompt::Text("Once upon a time".into()), 8),
    );
    assert_eq!(other.stats.prefix_tokens, 0);
}

/// Under a budget, reuse stops where a fresh prefill would have evicted: at most N tokens,
/// never from a cache that evicted, never under H2O.
#[test]
fn under_a_budget_only_what_never_evicted_is_reused() {
    let e = engine(budget("keydiff", 64, 16));
    let mut pc = PromptCache::new();
    let q1 = "What is the capital of France?";
    let first = same_as_fresh(&e, &mut pc, &greedy(chat(&[("user", q1)]), 8));
    assert_eq!(first.stats.eviction.evictions, 0);
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let turn2 = greedy(
        chat(&[
            ("user", q1),
            ("assistant", &first.text),
            ("user", &format!("{long} What does the text repeat?")),
        ]),
        8,
    );
    let second = same_as_fresh(&e, &mut pc, &turn2);
    assert!(second.stats.prefix_tokens > 0);
    assert!(second.stats.prefix_tokens <= 64);
    assert!(second.stats.eviction.evictions > 0);
    // That cache evicted: nothing is held, the next request prefills afresh.
    assert!(pc.tokens().is_empty() && pc.bytes() == 0);
    let third = same_as_fresh(&e, &mut pc, &turn2);
    assert_eq!(third.stats.prefix_tokens, 0);

    let e = engine(budget("h2o", 64, 16));
    let mut pc = PromptCache::new();
    let p = greedy(chat(&[("user", q1)]), 8);
    same_as_fresh(&e, &mut pc, &p);
    assert!(pc.tokens().is_empty(), "H2O's cache cannot be cut back");
    assert_eq!(same_as_fresh(&e, &mut pc, &p).stats.prefix_tokens, 0);
}

/// The same prompt again, under a budget it evicted under: a prompt-only cache (kept as the
/// prefill left it) is all reused, the first token coming from the logits the prompt left,
/// with nothing prefilled, and the output is a fresh request's, greedy or seeded, under
/// exact and continued reuse, KeyDiff and H2O (whose sums the kept copy holds). Another
/// prompt reuses none of it.
#[test]
fn the_same_prompt_again_reuses_an_evicted_cache_whole() {
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(16);
    let p = greedy(
        chat(&[("user", &format!("{long} What does the text repeat?"))]),
        8,
    );
    let seeded = GenerateParams {
        sampling: keydiff::Sampling {
            temperature: 0.9,
            seed: 7,
            ..Default::default()
        },
        ..p.clone()
    };
    for (policy, reuse) in [
        ("keydiff", keydiff::Reuse::Exact),
        ("keydiff", keydiff::Reuse::Continue),
        ("h2o", keydiff::Reuse::Exact),
    ] {
        let e = engine(budget(policy, 64, 16));
        let mut pc = PromptCache::with_reuse(reuse);
        pc.set_prompt_only(true);
        let first = same_as_fresh(&e, &mut pc, &p);
        let n = first.prompt_tokens.len();
        assert!(first.stats.eviction.evictions > 0, "{policy}");
        assert_eq!(first.stats.prefix_tokens, 0);
        assert_eq!(pc.tokens().len(), n, "{policy}: the prompt's cache is kept");
        for q in [&p, &seeded, &p] {
            let again = same_as_fresh(&e, &mut pc, q);
            assert_eq!(again.stats.prefix_tokens, n, "{policy} {reuse:?}");
            assert_eq!(pc.tokens().len(), n);
        }
        if reuse == keydiff::Reuse::Continue {
            // A turn that goes on from the evicted cache is a conversation's, not a fresh
            // prefill's: its logits are not kept, and the same request again is prefilled
            // afresh.
            let long_q = format!("{long} What does the text repeat?");
            let turn = greedy(
                chat(&[("user", &long_q), ("assistant", "Foxes."), ("user", "Why?")]),
                4,
            );
            let went_on = e.generate_cached(&turn, &mut pc, |_| {}).unwrap();
            assert_eq!(
                went_on.stats.prefix_tokens, n,
                "it went on from the held cache"
            );
            assert_eq!(same_as_fresh(&e, &mut pc, &turn).stats.prefix_tokens, 0);
        }
        let other = greedy(chat(&[("user", "What is the capital of France?")]), 4);
        assert_eq!(same_as_fresh(&e, &mut pc, &other).stats.prefix_tokens, 0);
    }
}

/// A cache can hold more than N tokens without having evicted (decode evicts only at N + K);
/// a fresh prefill of those tokens would have evicted, so at most N of them are reused.
#[test]
fn no_more_than_the_budget_is_reused() {
    let e = engine(budget("keydiff", 56, 16));
    let mut pc = PromptCache::new();
    let text = "In the beginning the universe was created. This has made a lot of people very \
                angry and been widely regarded as a bad move. ";
    let ids = e.tokenize(&text.repeat(4), false).unwrap();
    let p1 = GenerateParams {
        ignore_eos: true,
        ..greedy(Prompt::Tokens(ids[..50].to_vec()), 15)
    };
    let first = same_as_fresh(&e, &mut pc, &p1);
    assert_eq!(first.stats.eviction.evictions, 0);
    assert_eq!(pc.tokens().len(), 64, "50 prompt + 14 fed of 15 generated");
    let mut next: Vec<u32> = pc.tokens().to_vec();
    next.extend_from_slice(&ids[50..90]);
    let second = same_as_fresh(&e, &mut pc, &greedy(Prompt::Tokens(next), 8));
    assert_eq!(
        second.stats.prefix_tokens, 48,
        "N = 56 rounded down to chunks of 16"
    );
    assert!(second.stats.eviction.evictions > 0);
}

/// `Reuse::Continue` under a budget: a conversation sent whole each turn (as an OpenAI client
/// does) goes on from the evicted cache, prefilling only each turn's new tokens, and answers
/// exactly as `Engine::chat_turn` does for the same conversation. A prompt that does not
/// extend the held tokens starts afresh.
#[test]
fn continuing_a_conversation_matches_chat_turns() {
    let e = engine(budget("keydiff", 48, 16));
    let mut pc = PromptCache::with_reuse(keydiff::Reuse::Continue);
    let mut conv = keydiff::Conversation::new(None);
    let params = GenerateParams {
        max_tokens: 24,
        ..Default::default()
    };
    let turns = [
        "What is the capital of France? Tell me about the city in detail.",
        "And the capital of Italy?",
        "Which of the two is older?",
    ];
    let mut held = 0;
    let mut evictions = 0;
    for (i, user) in turns.iter().enumerate() {
        let mut messages = conv.messages().to_vec();
        messages.push(Message::new("user", *user));
        let turn = e.chat_turn(&mut conv, user, &params, |_| {}).unwrap();
        let p = GenerateParams {
            prompt: Prompt::Chat(messages),
            ..params.clone()
        };
        let out = e.generate_cached(&p, &mut pc, |_| {}).unwrap();
        assert_eq!(out.tokens, turn.tokens, "turn {i}: {:?}", out.text);
        assert_eq!(out.stats.prefix_tokens, held, "turn {i}");
        assert_eq!(turn.stats.prefix_tokens, held, "turn {i}");
        assert!(out.stats.final_cache_len <= 48 + 16, "turn {i}");
        held = pc.tokens().len();
        evictions += out.stats.eviction.evictions;
        let counts =
            |o: &keydiff::Output| (o.stats.eviction.evictions, o.stats.eviction.evicted_slots);
        assert_eq!(
            counts(&out),
            counts(&turn),
            "turn {i}: this turn's evictions"
        );
    }
    assert!(evictions > 0, "the conversation must outgrow the budget");
    // Another conversation: nothing is continued.
    let other = GenerateParams {
        prompt: chat(&[("user", "Hello!")]),
        ..params.clone()
    };
    assert_eq!(
        e.generate_cached(&other, &mut pc, |_| {})
            .unwrap()
            .stats
            .prefix_tokens,
        0
    );
}

/// A reply cut by `max_tokens` may not re-tokenize to the tokens generated (a word split
/// across tokens in another way); the client sends the text back, and the conversation still
/// continues, from the text, as `Engine::chat_turn` continues it.
#[test]
fn a_reply_that_retokenizes_differently_still_continues() {
    let e = engine(budget("keydiff", 48, 16));
    let user = "Write the word 'unbelievably' five times, then count to ten.";
    let mut differing = 0;
    for n in 2..=14 {
        let mut pc = PromptCache::with_reuse(keydiff::Reuse::Continue);
        let mut conv = keydiff::Conversation::new(None);
        let params = GenerateParams {
            max_tokens: n,
            ..Default::default()
        };
        let first = e
            .generate_cached(
                &GenerateParams {
                    prompt: chat(&[("user", user)]),
                    ..params.clone()
                },
                &mut pc,
                |_| {},
            )
            .unwrap();
        e.chat_turn(&mut conv, user, &params, |_| {}).unwrap();
        let retok = e.tokenize_continuation(&first.text).unwrap();
        let mut generated = first.tokens.clone();
        if first.stats.stop_reason == keydiff::StopReason::Eos {
            generated.pop();
        }
        if retok != generated {
            differing += 1;
        }
        let held = pc.tokens().len();
        let next = chat(&[
            ("user", user),
            ("assistant", &first.text),
            ("user", "Again."),
        ]);
        let out = e
            .generate_cached(
                &GenerateParams {
                    prompt: next,
                    ..params.clone()
                },
                &mut pc,
                |_| {},
            )
            .unwrap();
        let turn = e.chat_turn(&mut conv, "Again.", &params, |_| {}).unwrap();
        assert_eq!(out.stats.prefix_tokens, held, "max_tokens {n}");
        assert_eq!(out.tokens, turn.tokens, "max_tokens {n}");
    }
    assert!(
        differing > 0,
        "no reply re-tokenized differently: the text path went untested"
    );
}

/// A plain prompt that extends the held one inside a word ("Ita" + "ly"): going on by text
/// would feed the model "Ita", "ly" where a fresh run reads "Italy". It is refused: the whole
/// prompt's tokens decide (here they do not extend the held ones, so the run is a fresh
/// one's), while an extension at a word boundary still goes on from the whole cache.
#[test]
fn a_prompt_that_extends_the_held_one_inside_a_word_is_tokenized_whole() {
    let e = engine(budget("keydiff", 48, 16));
    // Longer than the budget: the held cache evicted, so it cannot be cut back either.
    let pairs = [
        ("France", "Paris"),
        ("Germany", "Berlin"),
        ("Portugal", "Lisbon"),
        ("Austria", "Vienna"),
        ("Poland", "Warsaw"),
        ("Greece", "Athens"),
        ("Sweden", "Stockholm"),
        ("Norway", "Oslo"),
        ("Egypt", "Cairo"),
        ("Japan", "Tokyo"),
    ];
    let mut head: String = pairs
        .iter()
        .map(|(c, k)| format!("The capital of {c} is {k}. "))
        .collect();
    head.push_str("The capital of Ita");
    let head = head.as_str();
    let whole = format!("{head}ly is");
    let held = e.prompt_tokens(&Prompt::Text(head.into())).unwrap();
    let fresh = e.prompt_tokens(&Prompt::Text(whole.clone())).unwrap();
    let alone = e.tokenize_continuation("ly is").unwrap();
    assert!(!fresh.starts_with(&held) && !fresh.ends_with(&alone));
    assert!(held.len() > 48);
    let mut pc = PromptCache::with_reuse(keydiff::Reuse::Continue);
    // As `run --prompt-cache` keeps it: the prompt, not the reply.
    pc.set_prompt_only(true);
    e.generate_cached(&greedy(Prompt::Text(head.into()), 1), &mut pc, |_| {})
        .unwrap();
    let cut = same_as_fresh(&e, &mut pc, &greedy(Prompt::Text(whole.clone()), 6));
    assert_eq!(cut.stats.prefix_tokens, 0);
    // At a word boundary, the held (evicted) cache is gone on from.
    let held = pc.tokens().len();
    let more = format!("{whole} Rome. The capital of Spain is");
    let out = e
        .generate_cached(&greedy(Prompt::Text(more.clone()), 4), &mut pc, |_| {})
        .unwrap();
    assert_eq!(out.stats.prefix_tokens, held);
    assert_eq!(
        out.prompt_tokens,
        e.prompt_tokens(&Prompt::Text(more)).unwrap()
    );
}

/// Joins `requests` to `batch` and steps it until they all ended; their outputs by id.
fn run_batch(
    batch: &mut keydiff::Batch<'_>,
    requests: &[(u64, &GenerateParams)],
) -> std::collections::HashMap<u64, keydiff::Output> {
    for (id, p) in requests {
        batch.join(*id, p).unwrap();
    }
    let mut outs = std::collections::HashMap::new();
    while !batch.is_empty() {
        for (id, out) in batch.step(|_, _| {}).unwrap() {
            outs.insert(id, out.unwrap());
        }
    }
    assert_eq!(outs.len(), requests.len());
    outs
}

/// The tiny random Llama (for tests under a memory limit), its hyper-parameters, and the
/// bytes its weights hold.
fn tiny_llama() -> (ModelSource, keydiff::ModelConfig, u64) {
    let source = ModelSource::Random {
        config: keydiff_tests::root().join("configs/tiny-llama.json"),
        seed: 2,
        on_host: false,
        weights: None,
    };
    let base = Engine::load(&source, &EngineConfig::default()).unwrap();
    let (m, resident) = (base.model_config().clone(), base.weight_plan().resident);
    (source, m, resident)
}

/// Greedy generation of `max_tokens` tokens (EOS ignored) after the token ids `prompt`.
fn tokens(prompt: Vec<u32>, max_tokens: usize) -> GenerateParams {
    GenerateParams {
        prompt: Prompt::Tokens(prompt),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// A batch that keeps its requests' caches (`Batch::keep_prompts`, a server's prompt cache
/// under `--max-batch`): follow-ups on two documents, joining together, each start from the
/// cache of the earlier request on their own document (whole chunks of it), and answer as
/// fresh requests; an unrelated prompt reuses nothing; no more caches than slots are kept.
#[test]
fn a_batch_keeps_caches_for_the_next_requests() {
    let e = engine(CacheConfig::full(16));
    let mut batch = e.batch();
    batch.keep_prompts(keydiff::Reuse::Exact, 2);
    let doc = |topic: &str| {
        format!("Notes on {topic}. ")
            + &format!("The committee reviewed the plans for {topic} on Tuesday. ").repeat(6)
    };
    let ask = |topic: &str, q: &str| greedy(Prompt::Text(format!("{}Q: {q}\nA:", doc(topic))), 12);
    let first = [ask("the bridge", "When?"), ask("the harbour", "Who?")];
    let outs = run_batch(&mut batch, &[(0, &first[0]), (1, &first[1])]);
    assert_eq!(batch.kept_tokens().len(), 2, "{:?}", batch.kept_tokens());
    assert!(batch.kept_bytes() > 0);
    for (i, p) in first.iter().enumerate() {
        let out = &outs[&(i as u64)];
        assert_eq!(out.stats.prefix_tokens, 0);
        assert_eq!(out.tokens, e.generate(p, |_| {}).unwrap().tokens);
    }

    let next = [
        ask("the harbour", "What did they review?"),
        ask("the bridge", "What did they review?"),
        greedy(Prompt::Text("Once upon a time".into()), 12),
    ];
    let outs = run_batch(&mut batch, &[(2, &next[0]), (3, &next[1]), (4, &next[2])]);
    for (i, p) in next.iter().enumerate() {
        let out = &outs[&(i as u64 + 2)];
        let fresh = e.generate(p, |_| {}).unwrap();
        assert_eq!(
            out.tokens,
            fresh.tokens,
            "request {}: {:?}",
            i + 2,
            out.text
        );
        let reused = out.stats.prefix_tokens;
        if i == 2 {
            assert_eq!(reused, 0, "an unrelated prompt");
            continue;
        }
        // The document's tokens are common with the earlier request on it.
        let topic = if i == 0 { "the harbour" } else { "the bridge" };
        let doc_tokens = e.tokenize(&doc(topic), true).unwrap().len();
        assert_eq!(reused % 16, 0);
        assert!(
            reused + 16 > doc_tokens - 1,
            "request {}: {reused} of {doc_tokens}",
            i + 2
        );
        assert!(reused < out.prompt_tokens.len());
    }
    assert_eq!(batch.kept_tokens().len(), 2, "at most 2 slots");
    // A request refused after it chose a kept cache (its prompt, which starts with a kept
    // document, is beyond the context) leaves that cache kept.
    let kept = batch.kept_tokens();
    let context = e.model_config().context();
    let words = "and so on ".repeat(context / 2);
    let long = greedy(Prompt::Text(format!("{}{words}", doc("the bridge"))), 4);
    let err = batch.join(9, &long).unwrap_err();
    assert!(
        matches!(err, keydiff::EngineError::PromptTooLong { .. }),
        "{err:?}"
    );
    assert_eq!(batch.kept_tokens(), kept);
}

/// `Reuse::Continue` in a batch: two conversations sent whole each turn, their turns joining
/// the batch together, each go on from the cache of their own last turn (prefilling only the
/// new tokens under an evicting budget) and answer exactly as `Engine::chat_turn` does for
/// that conversation.
#[test]
fn batched_conversations_continue_from_their_own_caches() {
    let e = engine(budget("keydiff", 48, 16));
    let mut batch = e.batch();
    batch.keep_prompts(keydiff::Reuse::Continue, 2);
    let params = GenerateParams {
        max_tokens: 16,
        ..Default::default()
    };
    // Each turn's message in the two conversations.
    let turns = [
        [
            "What is the capital of France? Tell me about the city in detail.",
            "Write a short poem about the sea, with a storm and a lighthouse in it.",
        ],
        ["And the capital of Italy?", "Now one about the mountains."],
        [
            "Which of the two is older?",
            "Which of the two do you prefer?",
        ],
    ];
    let mut convs = [
        keydiff::Conversation::new(None),
        keydiff::Conversation::new(None),
    ];
    let mut held = [0, 0];
    let mut evictions = 0;
    for (t, users) in turns.iter().enumerate() {
        let mut reqs = Vec::new();
        let mut want = Vec::new();
        for (conv, user) in convs.iter_mut().zip(users) {
            let mut messages = conv.messages().to_vec();
            messages.push(Message::new("user", *user));
            want.push(e.chat_turn(conv, user, &params, |_| {}).unwrap());
            reqs.push(GenerateParams {
                prompt: Prompt::Chat(messages),
                ..params.clone()
            });
        }
        let outs = run_batch(&mut batch, &[(0, &reqs[0]), (1, &reqs[1])]);
        for c in 0..2 {
            let out = &outs[&(c as u64)];
            assert_eq!(
                out.tokens, want[c].tokens,
                "turn {t} of {c}: {:?}",
                out.text
            );
            assert_eq!(out.stats.prefix_tokens, held[c], "turn {t} of {c}");
            assert_eq!(want[c].stats.prefix_tokens, held[c], "turn {t} of {c}");
            assert!(out.stats.final_cache_len <= 48 + 16);
            evictions += out.stats.eviction.evictions;
        }
        // Each conversation's cache holds its prompt and reply as far as they were fed.
        let kept = batch.kept_tokens();
        assert_eq!(kept.len(), 2);
        for c in 0..2 {
            let out = &outs[&(c as u64)];
            held[c] = out.prompt_tokens.len() + out.tokens.len() - 1;
            assert!(kept.contains(&held[c]), "{kept:?} {held:?}");
        }
    }
    assert!(evictions > 0, "the conversations must outgrow the budget");
}

/// Under a memory limit, kept caches make room: a request that does not fit beside them
/// frees the least recently used, and a request on a kept cache's prompt takes it over
/// without new memory.
#[test]
fn kept_caches_make_room_under_a_memory_limit() {
    let (source, m, resident) = tiny_llama();
    let (chunk, len) = (32, 300);
    let slots = CacheConfig::full(chunk).slots_for(len + 3);
    let kv = m.kv_cache_bytes(slots, candle_core::DType::F32);
    let need = kv + m.request_scratch_bytes(slots, chunk, true);
    // Room for the weights, one request's cache and activations, and half a cache more.
    let cfg = EngineConfig {
        cache: CacheConfig::full(chunk),
        memory_limit: Some(resident + need + kv / 2),
        ..Default::default()
    };
    let e = Engine::load(&source, &cfg).unwrap();
    let request = |token: u32| tokens(vec![token; len], 3);
    let (a, b) = (request(3), request(5));
    let mut batch = e.batch();
    batch.keep_prompts(keydiff::Reuse::Exact, 4);
    let out = run_batch(&mut batch, &[(0, &a)]).remove(&0).unwrap();
    assert_eq!(batch.kept_tokens(), vec![len + 2]);
    assert_eq!(out.stats.prefix_tokens, 0);
    // Another prompt: its cache fits only once the kept one is freed.
    batch.join(1, &b).unwrap();
    assert!(batch.kept_tokens().is_empty());
    while !batch.is_empty() {
        batch.step(|_, _| {}).unwrap();
    }
    assert_eq!(batch.kept_tokens(), vec![len + 2]);
    // The same prompt again: it takes the kept cache over, all of its prompt (with the
    // logits the prompt left: nothing to prefill).
    let again = run_batch(&mut batch, &[(2, &b)]).remove(&2).unwrap();
    assert_eq!(again.stats.prefix_tokens, len);
    assert_eq!(again.tokens, e.generate(&b, |_| {}).unwrap().tokens);
    // Without kept caches, the second request could not have joined beside the first's.
    let mut plain = e.batch();
    plain.join(0, &a).unwrap();
    let err = plain.join(1, &b).unwrap_err();
    assert!(
        matches!(err, keydiff::EngineError::OutOfMemory(_)),
        "{err:?}"
    );
}

/// A kept cache larger than a request needs (made for a long answer) that does not fit
/// beside the batch's running request is not forced on it: the request starts afresh in a
/// cache of its own size.
#[test]
fn a_kept_cache_too_large_to_take_over_gives_way_to_a_fresh_one() {
    let (source, m, resident) = tiny_llama();
    let chunk = 32;
    let cfg = CacheConfig::full(chunk);
    let kv = |slots: usize| m.kv_cache_bytes(slots, candle_core::DType::F32);
    let need = |slots: usize| kv(slots) + m.request_scratch_bytes(slots, chunk, true);
    // A: a long answer's cache, kept. R: running beside it. B: a short request that goes on
    // from A's prompt (so it would take A's cache over rather than share a copy of it).
    let a = tokens(vec![3; 200], 2000);
    let r = tokens(vec![5; 100], 2000);
    let mut b_prompt = vec![3; 200];
    b_prompt.extend([7; 10]);
    let b = tokens(b_prompt, 3);
    let (cap_a, cap_r, cap_b) = (200 + 2000, 100 + 2000, 210 + 3);
    // R's join beside kept A, and taking A over beside R (its cache, one decode row, its
    // logits): the limit lies between.
    let r_beside_a = need(cap_r) + kv(cap_a);
    let per_row = m.row_activation_bytes();
    let held_r = kv(cap_r) + per_row + 12 * m.vocab_size as u64;
    let taken = need(cap_a) + held_r;
    assert!(
        r_beside_a < taken && need(cap_a) < taken,
        "the test's sizes"
    );
    let limit = (r_beside_a.max(need(cap_a)) + taken) / 2;
    assert!(need(cap_b) + held_r <= limit, "a fresh cache for B fits");
    let e = Engine::load(
        &source,
        &EngineConfig {
            cache: cfg,
            memory_limit: Some(resident + limit),
            ..Default::default()
        },
    )
    .unwrap();
    let mut batch = e.batch();
    batch.keep_prompts(keydiff::Reuse::Exact, 2);
    // A runs a few tokens only, but its cache has room for its 2000.
    let mut short_a = a.clone();
    let cancel = keydiff::CancelToken::new();
    short_a.cancel = Some(cancel.clone());
    batch.join(0, &short_a).unwrap();
    for _ in 0..12 {
        batch.step(|_, _| {}).unwrap();
    }
    cancel.cancel();
    while !batch.is_empty() {
        batch.step(|_, _| {}).unwrap();
    }
    assert_eq!(batch.kept_tokens().len(), 1);
    assert!(batch.kept_bytes() as u64 >= kv(cap_a));
    batch.join(1, &r).unwrap();
    assert_eq!(batch.kept_tokens().len(), 1, "R fits beside the kept cache");
    batch.join(2, &b).unwrap();
    assert!(batch.kept_tokens().is_empty());
    // Until B ends (R, with its 2000 tokens, is left running).
    let mut outs = std::collections::HashMap::new();
    while !outs.contains_key(&2) {
        for (id, out) in batch.step(|_, _| {}).unwrap() {
            outs.insert(id, out.unwrap());
        }
    }
    let out_b = &outs[&2];
    assert_eq!(out_b.stats.prefix_tokens, 0, "B started afresh");
    assert_eq!(out_b.tokens, e.generate(&b, |_| {}).unwrap().tokens);
}

/// Requests that start like a kept cache's prompt and then go another way (other questions on
/// one document), joining together, each start from a copy of its beginning, and answer as
/// fresh requests; the kept cache stays for the next ones (vLLM's shared prefix blocks).
#[test]
fn requests_on_one_document_share_a_kept_cache() {
    let e = engine(CacheConfig::full(16));
    let mut batch = e.batch();
    batch.keep_prompts(keydiff::Reuse::Exact, 4);
    let doc = "Notes on the bridge. ".to_string()
        + &"The committee reviewed the plans for the bridge on Tuesday. ".repeat(6);
    let ask = |q: &str| greedy(Prompt::Text(format!("{doc}Q: {q}\nA:")), 8);
    run_batch(&mut batch, &[(0, &ask("When?"))]);
    assert_eq!(batch.kept_tokens().len(), 1);
    let qs = [ask("Who?"), ask("What did they review?"), ask("Where?")];
    let outs = run_batch(&mut batch, &[(1, &qs[0]), (2, &qs[1]), (3, &qs[2])]);
    let doc_tokens = e.tokenize(&doc, true).unwrap().len();
    for (i, q) in qs.iter().enumerate() {
        let out = &outs[&(i as u64 + 1)];
        let reused = out.stats.prefix_tokens;
        assert!(
            reused.is_multiple_of(16) && reused + 16 > doc_tokens - 1,
            "request {}: {reused} of the document's {doc_tokens}",
            i + 1
        );
        assert_eq!(
            out.tokens,
            e.generate(q, |_| {}).unwrap().tokens,
            "request {}",
            i + 1
        );
    }
    // The first request's cache is kept beside the three new ones (one taken over would be
    // gone).
    assert_eq!(batch.kept_tokens().len(), 4, "{:?}", batch.kept_tokens());
}

/// Sharing a kept cache costs a fresh cache: where that does not fit beside the kept one, the
/// request takes the kept cache over (cut back to the common prefix) instead; with room for
/// both, it shares.
#[test]
fn a_request_takes_a_kept_cache_over_when_a_copy_does_not_fit() {
    let (source, m, resident) = tiny_llama();
    let (chunk, len) = (32, 300);
    let slots = CacheConfig::full(chunk).slots_for(len + 3);
    let kv = m.kv_cache_bytes(slots, candle_core::DType::F32);
    let need = kv + m.request_scratch_bytes(slots, chunk, true);
    let request = |prompt: Vec<u32>| tokens(prompt, 3);
    let a = request(vec![3; len]);
    let mut b_prompt = vec![3; 200];
    b_prompt.extend(vec![5; len - 200]);
    let b = request(b_prompt);
    // Room for one request's cache and half a cache more; then for two caches.
    for (room, shares) in [(need + kv / 2, false), (need + kv + kv / 2, true)] {
        let cfg = EngineConfig {
            cache: CacheConfig::full(chunk),
            memory_limit: Some(resident + room),
            ..Default::default()
        };
        let e = Engine::load(&source, &cfg).unwrap();
        let mut batch = e.batch();
        batch.keep_prompts(keydiff::Reuse::Exact, 4);
        run_batch(&mut batch, &[(0, &a)]);
        assert_eq!(batch.kept_tokens(), vec![len + 2]);
        batch.join(1, &b).unwrap();
        let kept = if shares { vec![len + 2] } else { vec![] };
        assert_eq!(batch.kept_tokens(), kept, "shares: {shares}");
        let mut out = None;
        while !batch.is_empty() {
            for (_, o) in batch.step(|_, _| {}).unwrap() {
                out = Some(o.unwrap());
            }
        }
        let out = out.unwrap();
        assert_eq!(
            out.stats.prefix_tokens,
            200 / chunk * chunk,
            "shares: {shares}"
        );
        assert_eq!(out.tokens, e.generate(&b, |_| {}).unwrap().tokens);
    }
}

/// A kept cache too small for the request that takes it over (a longer answer) is copied into
/// a bigger one; the other kept caches make room for it first, least recently used first, so
/// that the one it goes on from is not the one freed.
#[test]
fn a_kept_cache_copied_into_a_bigger_one_keeps_its_place() {
    let (source, m, resident) = tiny_llama();
    let (chunk, len) = (32, 300);
    let full = CacheConfig::full(chunk);
    let kv = |tokens: usize| m.kv_cache_bytes(full.slots_for(tokens), candle_core::DType::F32);
    let need =
        |tokens: usize| kv(tokens) + m.request_scratch_bytes(full.slots_for(tokens), chunk, true);
    let a = tokens(vec![3; len], 3);
    let c = tokens(vec![5; len], 3);
    let mut b_prompt = vec![3; len];
    b_prompt.extend([7; 20]);
    let b = tokens(b_prompt, 400);
    // B's bigger cache fits beside A's (while A is copied) but not beside both A's and C's.
    let limit = need(320 + 400) + kv(len + 3) + kv(len + 3) / 2;
    let cfg = EngineConfig {
        cache: full,
        memory_limit: Some(resident + limit),
        ..Default::default()
    };
    let e = Engine::load(&source, &cfg).unwrap();
    let mut batch = e.batch();
    batch.keep_prompts(keydiff::Reuse::Exact, 4);
    run_batch(&mut batch, &[(0, &a)]);
    run_batch(&mut batch, &[(1, &c)]);
    assert_eq!(batch.kept_tokens(), vec![len + 2, len + 2], "C beside A");
    let out = run_batch(&mut batch, &[(2, &b)]).remove(&2).unwrap();
    // It went on from A's cache (C was freed for it), and answers as a fresh request.
    assert_eq!(out.stats.prefix_tokens, len / chunk * chunk);
    assert_eq!(out.tokens, e.generate(&b, |_| {}).unwrap().tokens);
    assert_eq!(batch.kept_tokens(), vec![len + 20 + 400 - 1]);
}
