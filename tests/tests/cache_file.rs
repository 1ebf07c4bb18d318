//! Prompt caches saved to a file and loaded again (`Engine::save_prompt_cache`,
//! `Engine::load_prompt_cache`; `keydiff run --prompt-cache`, tested in `cli.rs`): a loaded
//! cache goes on exactly as the one kept in memory, and a file that is not one, is damaged, or
//! was made with another model or other settings is refused, saying why.

use std::path::Path;

use keydiff::{
    CacheConfig, DType, Engine, EngineConfig, GenerateParams, KvType, KvTypes, ModelSource,
    PolicyKind, Prompt, PromptCache, Reuse,
};
use keydiff_tests::{model, root, temp_dir, write_tiny_qwen3, SMOLLM2};

fn engine_on(source: &ModelSource, cache: CacheConfig, kv_dtype: Option<KvTypes>) -> Engine {
    let cfg = EngineConfig {
        cache,
        kv_dtype,
        ..Default::default()
    };
    Engine::load(source, &cfg).unwrap()
}

fn smollm2(cache: CacheConfig) -> Engine {
    engine_on(&ModelSource::Gguf(model(SMOLLM2)), cache, None)
}

fn budget(policy: &str, n: usize, b: usize) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse(policy, 8, 7).unwrap(),
        budget: Some(n),
        ..CacheConfig::full(b)
    }
}

/// Greedy, with every token's logprobs (compared bit for bit).
fn greedy(prompt: Prompt, n: usize) -> GenerateParams {
    GenerateParams {
        prompt,
        max_tokens: n,
        logprobs: Some(3),
        ..Default::default()
    }
}

const DOC: &str = "The lighthouse keeper wrote in his log every evening. On Monday the sea was \
    calm and three ships passed. On Tuesday a storm came from the west and no ship passed. On \
    Wednesday the keeper repaired the lamp and painted the door green. On Thursday a fishing \
    boat brought him bread, apples and a letter from his sister. On Friday the fog was so \
    thick that he rang the bell every ten minutes until dawn.";

/// What two runs must agree on: tokens, logprobs, the prompt tokens reused, and the evictions.
fn same_run(a: &keydiff::Output, b: &keydiff::Output, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: {:?} / {:?}", a.text, b.text);
    assert_eq!(
        format!("{:?}", a.logprobs),
        format!("{:?}", b.logprobs),
        "{what}: logprobs"
    );
    assert_eq!(a.stats.prefix_tokens, b.stats.prefix_tokens, "{what}");
    assert_eq!(a.prompt_tokens, b.prompt_tokens, "{what}");
    let ev = |o: &keydiff::Output| (o.stats.eviction.evictions, o.stats.eviction.evicted_slots);
    assert_eq!(ev(a), ev(b), "{what}: evictions");
}

/// `Reuse::Continue` under a budget, the prompt only kept: a document's evicted cache,
/// saved and loaded, answers a question on the document exactly as the cache kept in memory
/// does (the same tokens and logprobs, the whole document reused, the same evictions), and
/// the cache the question leaves goes on alike too. Under KeyDiff, H2O (whose per-slot
/// attention sums the file carries) and `random` (whose generator it carries); and under
/// KeyDiff with a cache of Q8_0 blocks, one of Q4_0 blocks, one of fp8, one of f16 keys beside
/// Q8_0 values and one of Q5_1 keys beside Q4_1 values, which the file holds as stored. The
/// file holds only the used slots.
#[test]
fn a_saved_cache_goes_on_as_the_one_in_memory() {
    let dir = temp_dir("cache-file-continue");
    let f32_cache = KvTypes::from(DType::F32);
    let split = KvTypes {
        k: DType::F16.into(),
        v: KvType::Q8_0,
    };
    for (policy, kv) in [
        ("keydiff", f32_cache),
        ("h2o", f32_cache),
        ("random", f32_cache),
        ("keydiff", KvType::Q8_0.into()),
        ("keydiff", KvType::Q4_0.into()),
        ("keydiff", DType::F8E4M3.into()),
        ("keydiff", split),
        (
            "keydiff",
            KvTypes {
                k: KvType::Q5_1,
                v: KvType::Q4_1,
            },
        ),
    ] {
        let e = engine_on(
            &ModelSource::Gguf(model(SMOLLM2)),
            budget(policy, 64, 16),
            Some(kv),
        );
        let policy = format!("{policy} {kv}");
        let mut mem = PromptCache::with_reuse(Reuse::Continue);
        mem.set_prompt_only(true);
        let first = e
            .generate_cached(&greedy(Prompt::Text(DOC.into()), 6), &mut mem, |_| {})
            .unwrap();
        assert!(first.stats.eviction.evictions > 0, "{policy}: must evict");
        // The prompt only: not the reply.
        assert_eq!(mem.tokens(), &first.prompt_tokens[..], "{policy}");
        assert!(mem.slots() <= 64 + 16, "{policy}");

        let path = dir.join(format!("{}.kv", policy.replace(['/', ' '], "-")));
        let bytes = e.save_prompt_cache(&mem, &path).unwrap().unwrap();
        let m = e.model_config();
        let kv = m.num_layers * m.num_kv_heads * mem.slots() * kv.slot_bytes(m.head_dim);
        // Positions and state (8 bytes a slot), and the prompt's logits (f32).
        let per_slot = 8 * m.num_layers * m.num_kv_heads * mem.slots() + 4 * m.vocab_size;
        assert!(
            (bytes as usize) > kv + per_slot && (bytes as usize) < kv + per_slot + 64 * 1024,
            "{policy}: {bytes} bytes for {kv} of K and V"
        );
        // Saved with the logits its prompt left: the same prompt again from the file needs
        // no prefill.
        let mut same = e.load_prompt_cache(&path, Reuse::Continue).unwrap();
        let p = greedy(Prompt::Text(DOC.into()), 6);
        let again = e.generate_cached(&p, &mut same, |_| {}).unwrap();
        assert_eq!(
            again.stats.prefix_tokens,
            first.prompt_tokens.len(),
            "{policy}"
        );
        assert_eq!(again.tokens, first.tokens, "{policy}");
        let mut file = e.load_prompt_cache(&path, Reuse::Continue).unwrap();
        file.set_prompt_only(true);
        assert_eq!(file.tokens(), mem.tokens(), "{policy}");
        assert_eq!(file.slots(), mem.slots(), "{policy}");

        let q1 = format!("{DOC} What did the keeper paint?");
        let q2 = format!("{q1} Answer in one word.");
        for (i, q) in [q1, q2].into_iter().enumerate() {
            let p = greedy(Prompt::Text(q), 10);
            let a = e.generate_cached(&p, &mut mem, |_| {}).unwrap();
            let b = e.generate_cached(&p, &mut file, |_| {}).unwrap();
            same_run(&a, &b, &format!("{policy}, question {i}"));
            assert!(
                a.stats.prefix_tokens >= first.prompt_tokens.len(),
                "{policy}, question {i}: {} reused",
                a.stats.prefix_tokens
            );
        }
    }
}

/// `Reuse::Exact` with a full cache: a saved document's cache gives a question on it
/// exactly a fresh request's answer, reusing whole chunks of the document.
#[test]
fn an_exact_reuse_from_a_file_answers_as_a_fresh_request() {
    let dir = temp_dir("cache-file-exact");
    let e = smollm2(CacheConfig::full(16));
    let mut pc = PromptCache::new();
    pc.set_prompt_only(true);
    let doc = greedy(Prompt::Text(DOC.into()), 4);
    let first = e.generate_cached(&doc, &mut pc, |_| {}).unwrap();
    assert_eq!(pc.tokens(), &first.prompt_tokens[..]);
    let path = dir.join("doc.kv");
    e.save_prompt_cache(&pc, &path).unwrap().unwrap();
    drop(pc);
    let mut pc = e.load_prompt_cache(&path, Reuse::Exact).unwrap();
    let p = greedy(Prompt::Text(format!("{DOC} What came on Thursday?")), 12);
    let cached = e.generate_cached(&p, &mut pc, |_| {}).unwrap();
    let fresh = e.generate(&p, |_| {}).unwrap();
    assert_eq!(cached.tokens, fresh.tokens, "{:?}", cached.text);
    assert_eq!(
        format!("{:?}", cached.logprobs),
        format!("{:?}", fresh.logprobs)
    );
    let n = first.prompt_tokens.len();
    assert_eq!(cached.stats.prefix_tokens, n / 16 * 16);
    assert!(cached.stats.prefix_tokens > 0);
}

/// Under `exact`, an evicted cache that went on past its prompt cannot be reused, so nothing
/// is kept to save; one kept as its prompt left it (prompt only) stands for that prompt
/// again, with its logits: saved, and the same prompt from the file answers as a fresh
/// request without a prefill.
#[test]
fn nothing_is_saved_that_cannot_be_reused() {
    let e = smollm2(budget("keydiff", 32, 16));
    let doc = greedy(Prompt::Text(DOC.into()), 2);
    let mut pc = PromptCache::new();
    let out = e.generate_cached(&doc, &mut pc, |_| {}).unwrap();
    assert!(out.stats.eviction.evictions > 0);
    let dir = temp_dir("cache-file-nothing");
    let path = dir.join("doc.kv");
    assert_eq!(e.save_prompt_cache(&pc, &path).unwrap(), None);
    assert!(!path.exists());

    pc.set_prompt_only(true);
    e.generate_cached(&doc, &mut pc, |_| {}).unwrap();
    assert!(e.save_prompt_cache(&pc, &path).unwrap().is_some());
    let mut file = e.load_prompt_cache(&path, Reuse::Exact).unwrap();
    let again = e.generate_cached(&doc, &mut file, |_| {}).unwrap();
    assert_eq!(again.stats.prefix_tokens, out.prompt_tokens.len());
    assert_eq!(again.tokens, out.tokens);
    // Another prompt on it: nothing reused (its cache evicted).
    let other = greedy(Prompt::Text(format!("{DOC} What came on Thursday?")), 2);
    let mut file = e.load_prompt_cache(&path, Reuse::Exact).unwrap();
    let out = e.generate_cached(&other, &mut file, |_| {}).unwrap();
    assert_eq!(out.stats.prefix_tokens, 0);
}

/// A file's tensors by name.
type Named = Vec<(String, candle_core::Tensor)>;

fn tiny_llama(seed: u64) -> ModelSource {
    ModelSource::Random {
        config: root().join("configs/tiny-llama.json"),
        seed,
        on_host: false,
        weights: None,
    }
}

/// The message of loading `path` on `e`, which must fail; it names the file.
fn refusal(e: &Engine, path: &Path) -> String {
    let msg = match e.load_prompt_cache(path, Reuse::Continue) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(err) => err.to_string(),
    };
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    msg
}

/// Files that are not a cache of this model under these settings are refused, each with the
/// reason; the same file elsewhere still loads.
#[test]
fn files_that_cannot_be_used_are_refused() {
    let dir = temp_dir("cache-file-refused");
    let cfg = budget("keydiff", 32, 8);
    let e = engine_on(&tiny_llama(2), cfg.clone(), None);
    let mut pc = PromptCache::with_reuse(Reuse::Continue);
    pc.set_prompt_only(true);
    let prompt: Vec<u32> = (0..45).map(|i| (i * 37 % 250) as u32).collect();
    let params = GenerateParams {
        prompt: Prompt::Tokens(prompt.clone()),
        max_tokens: 3,
        ignore_eos: true,
        ..Default::default()
    };
    e.generate_cached(&params, &mut pc, |_| {}).unwrap();
    let good = dir.join("good.kv");
    e.save_prompt_cache(&pc, &good).unwrap().unwrap();
    let bytes = std::fs::read(&good).unwrap();

    // The same file elsewhere loads, and goes on from the 45 tokens.
    let moved = dir.join("moved.kv");
    std::fs::copy(&good, &moved).unwrap();
    let mut again = e.load_prompt_cache(&moved, Reuse::Continue).unwrap();
    assert_eq!(again.tokens(), &prompt[..]);
    let mut longer = prompt.clone();
    longer.extend([5, 6, 7]);
    let out = e
        .generate_cached(
            &GenerateParams {
                prompt: Prompt::Tokens(longer),
                ..params.clone()
            },
            &mut again,
            |_| {},
        )
        .unwrap();
    assert_eq!(out.stats.prefix_tokens, 45);

    let missing = dir.join("missing.kv");
    assert!(refusal(&e, &missing).contains("no such file"));

    let garbage = dir.join("garbage.kv");
    std::fs::write(&garbage, b"these are not tensors at all").unwrap();
    assert!(refusal(&e, &garbage).contains("not a safetensors file"));

    let cut = dir.join("cut.kv");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    assert!(refusal(&e, &cut).contains("not a safetensors file"));

    let other = dir.join("other.safetensors");
    let t = candle_core::Tensor::zeros((2, 3), DType::F32, &candle_core::Device::Cpu).unwrap();
    candle_core::safetensors::save(&std::collections::HashMap::from([("w", t)]), &other).unwrap();
    assert!(refusal(&e, &other).contains("not a keydiff KV cache"));

    // Header fields, edited in place (the header is JSON inside the file's JSON metadata).
    let edited = |from: &str, to: &str, name: &str| {
        let (from, to) = (from.as_bytes(), to.as_bytes());
        assert_eq!(from.len(), to.len());
        let at = bytes
            .windows(from.len())
            .position(|w| w == from)
            .unwrap_or_else(|| panic!("{} not in the file", String::from_utf8_lossy(from)));
        let mut b = bytes.clone();
        b[at..at + to.len()].copy_from_slice(to);
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let v = edited(r#"\"version\":2"#, r#"\"version\":7"#, "version.kv");
    assert!(
        refusal(&e, &v).contains("version 7; this keydiff reads versions 1 to 2"),
        "{}",
        refusal(&e, &v)
    );
    let p = edited(r#"\"position\":45"#, r#"\"position\":44"#, "position.kv");
    assert!(
        refusal(&e, &p).contains("45 tokens (45 of the prompt) for a cache that saw 44"),
        "{}",
        refusal(&e, &p)
    );

    // Another model: the same preset with other random weights.
    let seed3 = engine_on(&tiny_llama(3), cfg.clone(), None);
    assert!(refusal(&seed3, &good).contains("made with another model"));
    // Other cache settings, another cache dtype.
    let wider = engine_on(&tiny_llama(2), budget("keydiff", 40, 8), None);
    let msg = refusal(&wider, &good);
    assert!(
        msg.contains("made under policy keydiff, budget 32, chunk 8")
            && msg.contains("this run has policy keydiff, budget 40"),
        "{msg}"
    );
    let half = engine_on(&tiny_llama(2), cfg, Some(DType::F16.into()));
    assert!(refusal(&half, &good).contains("holds a f32 cache; this run's is f16"));
    // Under exact reuse, an evicted cache stands for the same prompt again only, with the
    // logits that prompt left: it loads, and that prompt samples from them.
    let mut exact = e.load_prompt_cache(&good, Reuse::Exact).unwrap();
    let same = e.generate_cached(&params, &mut exact, |_| {}).unwrap();
    assert_eq!(same.stats.prefix_tokens, 45);
    assert_eq!(same.tokens, e.generate(&params, |_| {}).unwrap().tokens);

    // Hostile contents: the file rewritten with one thing changed. Each is refused, none
    // panics.
    let rewrite = |name: &str, change: &dyn Fn(&mut serde_json::Value, &mut Named)| {
        let (_, md) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let mut meta = md.metadata().clone().unwrap();
        let mut header: serde_json::Value = serde_json::from_str(&meta["keydiff"]).unwrap();
        let mut tensors: Named =
            candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)
                .unwrap()
                .into_iter()
                .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        change(&mut header, &mut tensors);
        meta.insert("keydiff".into(), header.to_string());
        let p = dir.join(name);
        safetensors::serialize_to_file(tensors, Some(meta), &p).unwrap();
        p
    };
    let set =
        |tensors: &mut Vec<(String, candle_core::Tensor)>, key: &str, t: candle_core::Tensor| {
            let slot = tensors.iter_mut().find(|(k, _)| k == key).unwrap();
            slot.1 = t;
        };
    // A digest that is not one (not hex, multi-byte characters).
    let p = rewrite("digest.kv", &|h, _| {
        h["model"]["digest"] = "é".repeat(20).into()
    });
    assert!(refusal(&e, &p).contains("made with another model"));
    // A position twice in a head of an evicted cache.
    let p = rewrite("twice.kv", &|_, t| {
        let pos = t
            .iter()
            .find(|(k, _)| k == "layers.1.positions")
            .unwrap()
            .1
            .clone();
        let mut rows = pos.to_vec2::<u32>().unwrap();
        rows[0][1] = rows[0][0];
        let flat: Vec<u32> = rows.concat();
        let dims = pos.dims2().unwrap();
        set(
            t,
            "layers.1.positions",
            candle_core::Tensor::from_vec(flat, dims, &candle_core::Device::Cpu).unwrap(),
        );
    });
    assert!(
        refusal(&e, &p).contains("holds a position twice"),
        "{}",
        refusal(&e, &p)
    );
    // Keys one wider than the model's heads, keys in another dtype, a tensor left out.
    let p = rewrite("wide.kv", &|_, t| {
        let k = t
            .iter()
            .find(|(k, _)| k == "layers.1.keys")
            .unwrap()
            .1
            .clone();
        let wide = candle_core::Tensor::cat(&[&k, &k.narrow(2, 0, 1).unwrap()], 2).unwrap();
        set(t, "layers.1.keys", wide);
    });
    assert!(
        refusal(&e, &p).contains("tensor `layers.1.keys` is"),
        "{}",
        refusal(&e, &p)
    );
    let p = rewrite("dtype.kv", &|_, t| {
        let k = t
            .iter()
            .find(|(k, _)| k == "layers.0.values")
            .unwrap()
            .1
            .clone();
        set(t, "layers.0.values", k.to_dtype(DType::F16).unwrap());
    });
    assert!(
        refusal(&e, &p).contains("tensor `layers.0.values` is"),
        "{}",
        refusal(&e, &p)
    );
    let p = rewrite("missing.kv", &|_, t| {
        t.retain(|(k, _)| k != "layers.1.state")
    });
    assert!(
        refusal(&e, &p).contains("7 cache tensors"),
        "{}",
        refusal(&e, &p)
    );
    // Logits of another width; logits of a cache that went on past its prompt and evicted.
    let p = rewrite("logits.kv", &|_, t| {
        let l = t
            .iter()
            .find(|(k, _)| k == "prompt_logits")
            .unwrap()
            .1
            .clone();
        set(
            t,
            "prompt_logits",
            l.narrow(0, 1, l.dim(0).unwrap() - 1).unwrap(),
        );
    });
    assert!(
        refusal(&e, &p).contains("tensor `prompt_logits` is"),
        "{}",
        refusal(&e, &p)
    );
    // A header edited to say the prompt was shorter: the logits follow 45 tokens, not 40.
    let p = rewrite("past.kv", &|h, _| h["prompt_len"] = 40.into());
    assert!(
        refusal(&e, &p).contains("do not follow the 40 prompt tokens its header lists"),
        "{}",
        refusal(&e, &p)
    );
    // A file of version 1 (before the logits): it loads under continued reuse, and the same
    // prompt again is prefilled (it has no logits to start from); exact reuse refuses it.
    let v1 = rewrite("v1.kv", &|h, t| {
        h["version"] = 1.into();
        t.retain(|(k, _)| k != "prompt_logits");
    });
    let mut old = e.load_prompt_cache(&v1, Reuse::Continue).unwrap();
    assert_eq!(old.tokens(), &prompt[..]);
    let out = e.generate_cached(&params, &mut old, |_| {}).unwrap();
    assert_eq!(out.stats.prefix_tokens, 0);
    let msg = match e.load_prompt_cache(&v1, Reuse::Exact) {
        Ok(_) => panic!("an evicted cache without logits loaded under exact reuse"),
        Err(err) => err.to_string(),
    };
    assert!(msg.contains("has evicted, and exact reuse"), "{msg}");
}

/// The model digest tells weight files apart by their bytes, not by their paths: a copy of a
/// GGUF has its digest, the same model with other q/k norm weights does not.
#[test]
fn the_model_digest_follows_the_weights() {
    let dir = temp_dir("cache-file-digest");
    let (a, b, c) = (dir.join("a.gguf"), dir.join("b.gguf"), dir.join("c.gguf"));
    write_tiny_qwen3(&a, false).unwrap();
    std::fs::copy(&a, &b).unwrap();
    write_tiny_qwen3(&c, true).unwrap();
    let digest = |p: &Path| {
        engine_on(
            &ModelSource::Gguf(p.to_path_buf()),
            CacheConfig::full(16),
            None,
        )
        .model_digest()
        .unwrap()
    };
    let da = digest(&a);
    assert_eq!(da.len(), 64);
    assert_eq!(da, digest(&b));
    assert_ne!(da, digest(&c));
    // The RoPE settings the model runs with are part of it.
    let yarn = Engine::load(
        &ModelSource::Gguf(a.clone()),
        &EngineConfig {
            cache: CacheConfig::full(16),
            rope: keydiff::RopeOverride {
                scaling: None,
                freq_base: Some(12345.0),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .unwrap();
    assert_ne!(da, yarn.model_digest().unwrap());
}

/// A conversation saved after its first turn (`Engine::save_conversation`) and loaded again
/// (`Engine::load_conversation`, `keydiff chat --prompt-cache`) goes on exactly as the one
/// kept in memory: the next turn's tokens, logprobs, kept tokens and evictions. A prompt
/// cache's file is not a conversation, nor a conversation's a prompt cache.
#[test]
fn a_saved_conversation_goes_on_as_the_one_in_memory() {
    let dir = temp_dir("cache-file-conversation");
    let e = smollm2(budget("keydiff", 48, 16));
    let params = GenerateParams {
        max_tokens: 16,
        logprobs: Some(2),
        ..Default::default()
    };
    let mut mem = keydiff::Conversation::new(Some("You are a helpful assistant."));
    let first = e
        .chat_turn(
            &mut mem,
            &format!("{DOC} What did the keeper paint?"),
            &params,
            |_| {},
        )
        .unwrap();
    assert!(first.stats.eviction.evictions > 0, "must evict");
    let path = dir.join("chat.kv");
    e.save_conversation(&mem, &path).unwrap().unwrap();
    let mut file = e.load_conversation(&path).unwrap();
    assert_eq!(file.messages(), mem.messages());
    assert_eq!(
        (file.position(), file.cache_len()),
        (mem.position(), mem.cache_len())
    );
    for user in ["And on Thursday?", "Which day was calm?"] {
        let a = e.chat_turn(&mut mem, user, &params, |_| {}).unwrap();
        let b = e.chat_turn(&mut file, user, &params, |_| {}).unwrap();
        same_run(&a, &b, user);
        assert!(a.stats.prefix_tokens > 0, "{user}");
    }
    // A prompt cache's file holds no conversation.
    let mut pc = PromptCache::with_reuse(Reuse::Continue);
    e.generate_cached(&greedy(Prompt::Text(DOC.into()), 2), &mut pc, |_| {})
        .unwrap();
    let other = dir.join("prompt.kv");
    e.save_prompt_cache(&pc, &other).unwrap().unwrap();
    assert!(refusal(&e, &dir.join("nothing.kv")).contains("no such file"));
    let msg = match e.load_conversation(&other) {
        Ok(_) => panic!("a prompt cache loaded as a conversation"),
        Err(err) => err.to_string(),
    };
    assert!(msg.contains("not a conversation"), "{msg}");
    // Nor is a conversation's file a prompt cache (`run --prompt-cache` would save one over
    // it); the file is left as it was.
    let before = std::fs::read(&path).unwrap();
    let msg = match e.load_prompt_cache(&path, Reuse::Continue) {
        Ok(_) => panic!("a conversation loaded as a prompt cache"),
        Err(err) => err.to_string(),
    };
    assert!(msg.contains("holds a conversation"), "{msg}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

/// A cache saved Hadamard-rotated (a quantized cache, the default) is refused by an engine
/// that does not rotate (`--no-kv-rotation`), and the other way round: its keys would be
/// read in the wrong basis.
#[test]
fn a_rotated_cache_file_needs_a_rotating_engine() {
    let dir = temp_dir("cache-file-rotation");
    let load = |kv_rotation: bool| {
        let cfg = EngineConfig {
            cache: budget("keydiff", 64, 16),
            kv_dtype: Some(KvType::Q4_0.into()),
            kv_rotation,
            ..Default::default()
        };
        Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap()
    };
    let (on, off) = (load(true), load(false));
    assert!(on.kv_rotated() && !off.kv_rotated());
    for (from, into, says) in [
        (
            &on,
            &off,
            "holds a rotated q4_0 cache; this run's is not rotated",
        ),
        (
            &off,
            &on,
            "holds a not rotated q4_0 cache; this run's is rotated",
        ),
    ] {
        let mut mem = PromptCache::with_reuse(Reuse::Continue);
        from.generate_cached(&greedy(Prompt::Text(DOC.into()), 2), &mut mem, |_| {})
            .unwrap();
        let path = dir.join(format!("rotated-{}.kv", from.kv_rotated()));
        from.save_prompt_cache(&mem, &path).unwrap().unwrap();
        // The engine that wrote it takes it back.
        from.load_prompt_cache(&path, Reuse::Continue).unwrap();
        let err = match into.load_prompt_cache(&path, Reuse::Continue) {
            Ok(_) => panic!("{says}: loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(says), "{err}");
    }
}
