//! Batched decoding (`Engine::generate_batch`, `Batch`): every request of a batch gets exactly
//! what it gets alone (tokens, text, stop reason, logprobs, cache length, evictions) on the
//! real SmolLM2 under an evicting budget, with its own sampler, stop strings and cancel; a
//! batch step's logits equal single steps' on a random dense model, and on Qwen to the
//! difference of candle's kernels for one row and for several; requests can join between
//! steps; refusals stay with their request; memory is planned beside the running requests'
//! caches.
//!
//! SmolLM2's decode weights are Q8_0 (copies of its Q4_1), whose CPU kernels compute each row
//! alike however many rows there are, so a batch is bit-exact there. Qwen's `ffn_down` is Q6K:
//! on x86 candle runs one row on the compact weights and several on repacked tiles with the
//! activations quantized otherwise, so its batched rows differ from single ones (up to 0.33 in
//! a logit here), and sampled tokens can diverge where a single run's would be close.

use std::collections::HashMap;

use candle_core::{DType, Device};
use keydiff::{
    CacheConfig, CancelToken, Engine, EngineConfig, EngineError, Event, GenerateParams,
    ModelSource, Output, PolicyKind, Prompt, Sampling, StopReason,
};
use keydiff_tests::{model, root, QWEN, SMOLLM2};

fn engine(path: &str, cache: CacheConfig) -> Engine {
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(path)), &cfg).unwrap()
}

fn keydiff(n: usize, b: usize) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse("keydiff", 8, 0).unwrap(),
        budget: Some(n),
        ..CacheConfig::full(b)
    }
}

fn text(sentences: usize, topic: &str) -> String {
    format!("Notes on {topic}. ")
        + &format!("The committee met on Tuesday to review the plans for {topic}, which had grown twice as fast as expected. ").repeat(sentences)
}

/// Requests that differ in everything a request can: prompt length (some evict during the
/// prefill, some only in decode, one not at all), token budget, sampler, penalties, stop
/// strings, logprobs, chat.
fn requests() -> Vec<GenerateParams> {
    let base = GenerateParams {
        max_tokens: 24,
        ..Default::default()
    };
    vec![
        GenerateParams {
            prompt: Prompt::Text(text(12, "the library") + "In short,"),
            ..base.clone()
        },
        GenerateParams {
            prompt: Prompt::Text("Once upon a time".into()),
            max_tokens: 40,
            sampling: Sampling {
                temperature: 0.8,
                top_p: 0.9,
                seed: 7,
                ..Default::default()
            },
            logprobs: Some(3),
            ..base.clone()
        },
        GenerateParams {
            prompt: Prompt::Text(text(3, "the bridge") + "The bridge"),
            max_tokens: 5,
            sampling: Sampling {
                repetition_penalty: 1.3,
                frequency_penalty: 0.2,
                ..Default::default()
            },
            ..base.clone()
        },
        GenerateParams {
            prompt: Prompt::Chat(vec![keydiff::Message::new("user", "Name three colours.")]),
            stop: vec![",".into()],
            ignore_eos: true,
            ..base.clone()
        },
        GenerateParams {
            prompt: Prompt::Text(text(20, "the harbour") + "Therefore"),
            max_tokens: 30,
            prompt_logprobs: Some(1),
            ..base
        },
    ]
}

/// Two outputs are the same run: tokens, text, logprobs, how it ended, what it evicted.
fn assert_same(batched: &Output, alone: &Output, what: &str) {
    assert_eq!(batched.tokens, alone.tokens, "{what}: tokens");
    assert_eq!(batched.text, alone.text, "{what}: text");
    assert_eq!(batched.logprobs, alone.logprobs, "{what}: logprobs");
    assert_eq!(
        batched.prompt_logprobs, alone.prompt_logprobs,
        "{what}: prompt logprobs"
    );
    let (b, a) = (&batched.stats, &alone.stats);
    assert_eq!(b.stop_reason, a.stop_reason, "{what}: stop reason");
    assert_eq!(b.final_cache_len, a.final_cache_len, "{what}: cache length");
    assert_eq!(
        b.eviction.evictions, a.eviction.evictions,
        "{what}: evictions"
    );
    assert_eq!(b.prompt_tokens, a.prompt_tokens, "{what}: prompt tokens");
}

/// The batch against each request alone, under a KeyDiff budget that evicts in prefill and
/// decode; and every event reaches the request it belongs to.
#[test]
fn batched_requests_equal_their_runs_alone() {
    {
        let path = SMOLLM2;
        let e = engine(path, keydiff(96, 32));
        let reqs = requests();
        let mut texts: HashMap<usize, String> = HashMap::new();
        let mut lps: HashMap<usize, usize> = HashMap::new();
        let outs = e
            .generate_batch(&reqs, |i, ev| match ev {
                Event::Text(t) => texts.entry(i).or_default().push_str(t),
                Event::Logprob(_) => *lps.entry(i).or_default() += 1,
                _ => {}
            })
            .unwrap();
        assert_eq!(outs.len(), reqs.len());
        let mut evicted = 0;
        for (i, (out, params)) in outs.into_iter().zip(&reqs).enumerate() {
            let out = out.unwrap_or_else(|err| panic!("{path} request {i}: {err}"));
            let alone = e.generate(params, |_| {}).unwrap();
            assert_same(&out, &alone, &format!("{path} request {i}"));
            assert_eq!(texts.get(&i).cloned().unwrap_or_default(), out.text, "{i}");
            assert_eq!(
                lps.get(&i).copied().unwrap_or(0),
                out.logprobs.map_or(0, |l| l.len())
            );
            evicted += out.stats.eviction.evictions;
        }
        assert!(evicted > 0, "{path}: the budget never evicted");
    }
}

/// A plain request's tokens are picked where the logits are: a greedy one's argmax
/// (`argmax_rows`) and a sampled one's draw (`sample_rows`, with the request's own generator:
/// on a GPU one launch each, 4 bytes a row back; on the CPU the rows in place). Any request
/// that needs its logits on the host (logprobs, a logit bias, here one of 0 that changes
/// nothing) reads them there. All give the same tokens, alone and in one batch step (greedy,
/// drawn and host rows side by side, prompts of different lengths, so a row given to the wrong
/// request shows).
#[test]
fn tokens_are_the_same_picked_where_the_logits_are_or_on_the_host() {
    let e = engine(SMOLLM2, keydiff(96, 32));
    let prompts = [
        text(12, "the library") + "In short,",
        "Once upon a time".to_string(),
        text(4, "the bridge") + "The bridge",
    ];
    let ways = [
        ("device", None, Vec::new()),
        ("logprobs", Some(1), Vec::new()),
        ("bias 0", None, vec![(0u32, 0.0f32)]),
    ];
    let sampled = Sampling {
        temperature: 0.9,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.02,
        seed: 7,
        ..Default::default()
    };
    let bases = [("greedy", Sampling::default()), ("sampled", sampled)];
    let mut reqs = Vec::new();
    for (_, base) in &bases {
        for p in &prompts {
            for (_, logprobs, bias) in &ways {
                reqs.push(GenerateParams {
                    prompt: Prompt::Text(p.clone()),
                    max_tokens: 24,
                    // Every run the whole 24 tokens: where a draw meets the end-of-sequence
                    // token depends on the host's float arithmetic (an AMD EPYC drew it at 16
                    // for one prompt), and it is compared as a token like the others.
                    ignore_eos: true,
                    logprobs: *logprobs,
                    sampling: Sampling {
                        logit_bias: bias.clone(),
                        ..base.clone()
                    },
                    ..Default::default()
                });
            }
        }
    }
    let batched = e.generate_batch(&reqs, |_, _| {}).unwrap();
    let mut firsts = Vec::new();
    let per_base = prompts.len() * ways.len();
    for (i, (params, out)) in reqs.iter().zip(batched).enumerate() {
        let what = format!(
            "{} prompt {} by {}",
            bases[i / per_base].0,
            i % per_base / ways.len(),
            ways[i % ways.len()].0
        );
        let out = out.unwrap_or_else(|err| panic!("{what}: {err}"));
        let alone = e.generate(params, |_| {}).unwrap();
        assert_eq!(out.tokens, alone.tokens, "{what}: batched and alone");
        assert_eq!(out.tokens.len(), 24, "{what}");
        firsts.push(out.tokens);
    }
    for (p, runs) in firsts.chunks(ways.len()).enumerate() {
        for (w, run) in runs.iter().enumerate().skip(1) {
            assert_eq!(
                run,
                &runs[0],
                "{} prompt {}: {} against the device's pick",
                bases[p / prompts.len()].0,
                p % prompts.len(),
                ways[w].0
            );
        }
    }
    for b in 0..bases.len() {
        // The prompts' outputs differ: a row given to another request would show.
        let f = |p: usize| &firsts[b * per_base + p * ways.len()];
        let (x, y, z) = (f(0), f(1), f(2));
        assert!(
            x != y && y != z && x != z,
            "{}: the prompts' outputs must differ",
            bases[b].0
        );
    }
    // The sampled requests drew: not the greedy tokens.
    assert!(
        (0..prompts.len()).any(|p| firsts[p * ways.len()] != firsts[per_base + p * ways.len()]),
        "the sampled outputs equal the greedy ones"
    );
}

/// The stop strings and limits end requests at different steps: the reasons differ, so the
/// batch shrank as it ran (checked through `Batch` directly).
#[test]
fn requests_join_and_leave_between_steps() {
    let e = engine(SMOLLM2, keydiff(64, 16));
    let reqs = requests();
    let mut batch = e.batch();
    let mut outs: HashMap<u64, Output> = HashMap::new();
    let mut sizes = Vec::new();
    // Two start; the others join one by one after some steps.
    for (i, p) in reqs.iter().enumerate().take(2) {
        assert!(batch.add(i as u64, p, |_| {}).unwrap().is_none());
    }
    let err = batch.add(1, &reqs[0], |_| {}).unwrap_err();
    assert!(err.to_string().contains("already in this batch"), "{err}");
    let mut waiting: Vec<(u64, &GenerateParams)> = reqs
        .iter()
        .enumerate()
        .skip(2)
        .map(|(i, p)| (i as u64, p))
        .collect();
    let mut step = 0;
    while !batch.is_empty() || !waiting.is_empty() {
        if step % 3 == 0 {
            if let Some((id, p)) = (!waiting.is_empty()).then(|| waiting.remove(0)) {
                if let Some(out) = batch.add(id, p, |_| {}).unwrap() {
                    outs.insert(id, out);
                }
            }
        }
        sizes.push(batch.len());
        for (id, out) in batch.step(|_, _| {}).unwrap() {
            outs.insert(id, out.unwrap());
        }
        step += 1;
    }
    assert!(sizes.iter().any(|&s| s >= 3), "{sizes:?}");
    assert_eq!(outs.len(), reqs.len());
    for (i, p) in reqs.iter().enumerate() {
        let alone = e.generate(p, |_| {}).unwrap();
        assert_same(&outs[&(i as u64)], &alone, &format!("request {i}"));
    }
    let reasons: Vec<StopReason> = (0..reqs.len() as u64)
        .map(|i| outs[&i].stats.stop_reason)
        .collect();
    assert!(reasons.contains(&StopReason::StopString), "{reasons:?}");
    assert!(reasons.contains(&StopReason::MaxTokens), "{reasons:?}");
}

/// What each step did for each request: tokens sampled (its logprob events) and prompt
/// tokens prefilled so far (its last prefill event).
#[derive(Default, Debug, Clone, PartialEq)]
struct Did {
    tokens: usize,
    prefilled: Option<usize>,
}

fn step_recording(
    batch: &mut keydiff::Batch<'_>,
    outs: &mut HashMap<u64, Output>,
) -> HashMap<u64, Did> {
    let mut did: HashMap<u64, Did> = HashMap::new();
    let ended = batch
        .step(|id, ev| match ev {
            Event::Logprob(_) => did.entry(id).or_default().tokens += 1,
            Event::Prefill { done, .. } => did.entry(id).or_default().prefilled = Some(done),
            _ => {}
        })
        .unwrap();
    for (id, out) in ended {
        outs.insert(id, out.unwrap());
    }
    did
}

/// A long prompt joining a running request is prefilled a chunk per step beside its decode
/// steps: the running request gets a token every step while the prompt is prefilled, one
/// chunk of B per step; and both equal their runs alone, bit for bit (SmolLM2).
#[test]
fn joining_prompts_are_prefilled_between_decode_steps() {
    let e = engine(SMOLLM2, keydiff(64, 16));
    let reqs = requests();
    let running = GenerateParams {
        max_tokens: 80,
        ignore_eos: true,
        ..reqs[1].clone()
    };
    let joining = GenerateParams {
        logprobs: Some(1),
        ..reqs[4].clone()
    };
    let mut batch = e.batch();
    let mut outs = HashMap::new();
    batch.join(0, &running).unwrap();
    // Its short prompt is one chunk: the first step prefills it and samples a token.
    let did = step_recording(&mut batch, &mut outs);
    assert_eq!(did[&0].tokens, 1, "{did:?}");
    assert_eq!(batch.prefilling(), 0);
    batch.join(1, &joining).unwrap();
    assert_eq!((batch.len(), batch.prefilling()), (2, 1));
    let mut chunks = 0;
    let mut last = 0;
    while batch.prefilling() > 0 {
        let did = step_recording(&mut batch, &mut outs);
        assert_eq!(did[&0].tokens, 1, "the running request waited: {did:?}");
        let now = did[&1].prefilled.expect("a chunk each step");
        assert!(now > last && now - last <= 16, "{last} -> {now}");
        last = now;
        chunks += 1;
    }
    let prompt = e.prompt_tokens(&joining.prompt).unwrap().len();
    assert_eq!(last, prompt);
    assert_eq!(chunks, prompt.div_ceil(16), "one chunk per step");
    while !batch.is_empty() {
        step_recording(&mut batch, &mut outs);
    }
    for (id, p) in [(0u64, &running), (1, &joining)] {
        let alone = e.generate(p, |_| {}).unwrap();
        assert_same(&outs[&id], &alone, &format!("request {id}"));
    }
}

/// With a step budget of three chunks, three joining prompts are prefilled together, a chunk
/// of each per step, first come first served past the budget; every request equals its run
/// alone. A joiner cancelled during its prefill ends with no tokens, and the next in line
/// takes its place; `join` refuses an id in the batch and a profiled request.
#[test]
fn several_prompts_are_prefilled_in_one_step() {
    let e = engine(SMOLLM2, keydiff(64, 16));
    let reqs = requests();
    let mut batch = e.batch();
    batch.set_prefill_tokens(48);
    let cancel = CancelToken::new();
    let cancelled = GenerateParams {
        cancel: Some(cancel.clone()),
        ..reqs[4].clone()
    };
    let joiners = [&reqs[0], &reqs[2], &cancelled, &reqs[4]];
    for (i, p) in joiners.iter().enumerate() {
        batch.join(i as u64, p).unwrap();
    }
    let err = batch.join(2, &reqs[1]).unwrap_err();
    assert!(err.to_string().contains("already in this batch"), "{err}");
    let profiled = GenerateParams {
        profile: true,
        ..reqs[1].clone()
    };
    let err = batch.join(9, &profiled).unwrap_err();
    assert!(matches!(err, EngineError::BadParams(_)), "{err}");
    let mut outs = HashMap::new();
    let prefilled = |did: &HashMap<u64, Did>| {
        let mut ids: Vec<u64> = did
            .iter()
            .filter(|(_, d)| d.prefilled.is_some())
            .map(|(id, _)| *id)
            .collect();
        ids.sort();
        ids
    };
    let did = step_recording(&mut batch, &mut outs);
    assert_eq!(prefilled(&did), [0, 1, 2], "the first three: {did:?}");
    assert_eq!(did[&2].prefilled, Some(16));
    cancel.cancel();
    let did = step_recording(&mut batch, &mut outs);
    assert_eq!(
        prefilled(&did),
        [0, 1, 3],
        "the fourth after the cancelled: {did:?}"
    );
    assert!(batch.ids().iter().all(|&id| id != 2));
    while !batch.is_empty() {
        let did = step_recording(&mut batch, &mut outs);
        assert!(!prefilled(&did).contains(&2), "{did:?}");
    }
    let out = &outs[&2];
    assert_eq!(out.stats.stop_reason, StopReason::Cancelled);
    assert!(out.tokens.is_empty());
    for i in [0, 1, 3] {
        let alone = e.generate(joiners[i], |_| {}).unwrap();
        assert_same(&outs[&(i as u64)], &alone, &format!("request {i}"));
    }
}

/// A refused request (empty, beyond the context, bad parameters) gets its error in its place;
/// a cancelled one ends with what it had; the others are unaffected.
#[test]
fn refusals_and_cancels_stay_with_their_request() {
    let e = engine(SMOLLM2, keydiff(64, 16));
    let context = e.model_config().context();
    let good = requests().remove(0);
    let cancel = CancelToken::new();
    let reqs = vec![
        GenerateParams {
            prompt: Prompt::Text(String::new()),
            ..good.clone()
        },
        good.clone(),
        GenerateParams {
            prompt: Prompt::Tokens(vec![1; context + 1]),
            ..good.clone()
        },
        GenerateParams {
            logprobs: Some(99),
            ..good.clone()
        },
        GenerateParams {
            cancel: Some(cancel.clone()),
            max_tokens: 100,
            ignore_eos: true,
            ..good.clone()
        },
    ];
    let mut seen = 0;
    let outs = e
        .generate_batch(&reqs, |i, ev| {
            if i == 4 && matches!(ev, Event::Text(_)) {
                seen += 1;
                if seen == 3 {
                    cancel.cancel();
                }
            }
        })
        .unwrap();
    let mut outs = outs.into_iter();
    assert!(matches!(
        outs.next().unwrap(),
        Err(EngineError::EmptyPrompt)
    ));
    let alone = e.generate(&good, |_| {}).unwrap();
    assert_same(&outs.next().unwrap().unwrap(), &alone, "the good request");
    assert!(matches!(
        outs.next().unwrap(),
        Err(EngineError::PromptTooLong { .. })
    ));
    assert!(matches!(
        outs.next().unwrap(),
        Err(EngineError::BadParams(_))
    ));
    let cancelled = outs.next().unwrap().unwrap();
    assert_eq!(cancelled.stats.stop_reason, StopReason::Cancelled);
    assert!(
        (3..10).contains(&cancelled.tokens.len()),
        "{}",
        cancelled.tokens.len()
    );
}

/// One batch step, and one pass mixing decode rows with prompt chunks, against each sequence
/// alone, at different positions under an evicting budget: each segment's logits equal its
/// sequence's alone, to the rounding of a dense f32 matmul over more rows (random Llama),
/// exactly (SmolLM2), and within the difference of candle's one-row and tiled Q6K kernels
/// (Qwen). Prompt chunks take their linears alone on the CPU: exact on every model.
#[test]
fn a_batch_step_equals_single_steps() {
    let config = root().join("configs/tiny-llama.json");
    let random = keydiff_model::load_random(
        &config,
        &Device::Cpu,
        DType::F32,
        5,
        false,
        None,
        keydiff::CpuWeights::FAST,
        None,
    )
    .unwrap();
    batch_step_against_single_steps(&random.model, 1e-4, "random f32 Llama");
    let gguf = |path: &str| {
        keydiff_model::load_gguf(
            &model(path),
            &Device::Cpu,
            DType::F32,
            keydiff::CpuWeights::FAST,
            None,
        )
        .unwrap()
    };
    batch_step_against_single_steps(&gguf(SMOLLM2).model, 0.0, "SmolLM2");
    batch_step_against_single_steps(&gguf(QWEN).model, 1.0, "Qwen");
}

fn batch_step_against_single_steps(m: &keydiff_model::Model, tol: f32, what: &str) {
    let rows = keydiff::parity::batch_vs_single(m, &keydiff(40, 16)).unwrap();
    assert_eq!(rows.len(), 3 + 5, "three batched rows, five mixed segments");
    for (i, d) in rows.into_iter().enumerate() {
        // Segments 6 and 7 are the mixed pass's prompt chunks.
        let tol = if i >= 6 { 0.0 } else { tol };
        assert!(d.max_abs <= tol, "{what}, segment {i}: {d:?}");
        if tol == 0.0 {
            assert!(d.top1_equal, "{what}, segment {i}");
        }
    }
    assert!(
        m.forward_batch(&[1, 2, 3], &mut []).is_err(),
        "3 tokens, 0 caches"
    );
}

/// A tiny random Llama under KeyDiff N = 256, B = 32, with a memory limit that holds the
/// weights, one request's cache (N + B slots) and activations, and half a cache more; a
/// request whose cache gets its N + B slots; the model's config; a cache's bytes.
fn limited_engine() -> (Engine, GenerateParams, keydiff::ModelConfig, u64) {
    let source = ModelSource::Random {
        config: root().join("configs/tiny-llama.json"),
        seed: 2,
        on_host: false,
        weights: None,
    };
    let (chunk, n) = (32, 256);
    let base = Engine::load(&source, &EngineConfig::default()).unwrap();
    let m = base.model_config().clone();
    let plan = base.weight_plan();
    drop(base);
    let kv = m.kv_cache_bytes(n + chunk, DType::F32);
    let need = kv + m.request_scratch_bytes(n + chunk, chunk, true);
    assert!(
        plan.transient < kv / 2,
        "the test needs a cache larger than the load's transient memory"
    );
    let cfg = EngineConfig {
        cache: keydiff(n, chunk),
        memory_limit: Some(plan.resident + need + kv / 2),
        ..Default::default()
    };
    let e = Engine::load(&source, &cfg).unwrap();
    let p = GenerateParams {
        // Longer than N + B: the cache gets its N + B slots.
        prompt: Prompt::Tokens(vec![3; n + chunk + 12]),
        max_tokens: 3,
        ignore_eos: true,
        ..Default::default()
    };
    (e, p, m, kv)
}

/// Under a memory limit, a request's cache is planned beside the caches of the requests
/// running with it: the second of two budgeted requests is refused with the numbers when the
/// limit holds one, and runs once the first has ended.
#[test]
fn batch_memory_is_planned_beside_the_running_caches() {
    let (e, p, _, _) = limited_engine();
    let mut batch = e.batch();
    assert!(batch.add(0, &p, |_| {}).unwrap().is_none());
    let err = batch.add(1, &p, |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    assert!(err.to_string().contains("for the batch it joins"), "{err}");
    while !batch.is_empty() {
        batch.step(|_, _| {}).unwrap();
    }
    assert!(batch.add(1, &p, |_| {}).unwrap().is_none());
    // A joining request's cache counts as a running one's, before its prompt has run.
    let mut batch = e.batch();
    batch.join(0, &p).unwrap();
    let err = batch.join(1, &p).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    let err = batch.add(1, &p, |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
}

/// Under a memory limit, a step's rows are planned too: a step that may take many prompt
/// tokens (`set_prefill_tokens` far above B) needs their activations beside the joining
/// request's cache, and a request that fits with the default (one chunk a step) is refused
/// with the numbers when they do not fit.
#[test]
fn a_step_s_prompt_rows_are_planned() {
    let (e, p, m, kv) = limited_engine();
    let chunk = e.config().cache.chunk;
    let mut batch = e.batch();
    batch.join(0, &p).unwrap();
    // Prompt rows whose activations take a whole cache's bytes more.
    let per_row = m.row_activation_bytes();
    let mut wide = e.batch();
    wide.set_prefill_tokens(chunk + (kv / per_row) as usize + 1);
    let err = wide.join(0, &p).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    assert!(err.to_string().contains("for the batch it joins"), "{err}");
    // Rows of a quarter of a cache's bytes more still fit (half a cache is free).
    wide.set_prefill_tokens(chunk + (kv / 4 / per_row) as usize);
    wide.join(0, &p).unwrap();
}

/// `Engine::generate_n`: completions of one prompt, prefilled once under a budget that
/// evicts in the prefill, each equal to the request alone with seed + i (tokens, logprobs,
/// evictions, how it ended), under KeyDiff and under H2O (whose per-slot sums the copies
/// carry); the prefill's events go to the first completion only.
#[test]
fn several_completions_equal_their_runs_alone() {
    // With logprobs each row is read and drawn from on the host; without, drawn where the
    // logits are: each fork with its own generator.
    for (policy, logprobs) in [("keydiff", Some(2)), ("h2o", Some(2)), ("keydiff", None)] {
        let cache = CacheConfig {
            policy: PolicyKind::parse(policy, 8, 0).unwrap(),
            ..keydiff(96, 32)
        };
        let e = engine(SMOLLM2, cache);
        let params = GenerateParams {
            prompt: Prompt::Text(text(12, "the library") + "In short,"),
            max_tokens: 16,
            sampling: Sampling {
                temperature: 0.9,
                top_p: 0.95,
                seed: 11,
                ..Default::default()
            },
            logprobs,
            ..Default::default()
        };
        let mut texts: HashMap<usize, String> = HashMap::new();
        let mut prefill_events: HashMap<usize, usize> = HashMap::new();
        let outs = e
            .generate_n(&params, 3, |i, ev| match ev {
                Event::Text(t) => texts.entry(i).or_default().push_str(t),
                Event::Prefill { .. } => *prefill_events.entry(i).or_default() += 1,
                _ => {}
            })
            .unwrap();
        assert_eq!(outs.len(), 3);
        let outs: Vec<Output> = outs.into_iter().map(Result::unwrap).collect();
        for (i, out) in outs.iter().enumerate() {
            let mut alone = params.clone();
            alone.sampling.seed = 11 + i as u64;
            let alone = e.generate(&alone, |_| {}).unwrap();
            assert_same(out, &alone, &format!("{policy} completion {i}"));
            assert!(
                out.stats.eviction.evictions > 0,
                "{policy}: nothing evicted"
            );
            assert_eq!(texts.get(&i).cloned().unwrap_or_default(), out.text);
        }
        assert!(
            outs[0].tokens != outs[1].tokens || outs[1].tokens != outs[2].tokens,
            "{policy}: three samples, one text"
        );
        assert_eq!(prefill_events.keys().collect::<Vec<_>>(), [&0], "{policy}");
    }
}

/// Completions of one prompt are planned as a cache each, beside the batch, and beside what
/// the caller holds outside it; ids are checked.
#[test]
fn several_completions_are_planned_and_checked() {
    let (e, p, _, kv) = limited_engine();
    let mut held = e.batch();
    held.hold_outside(kv);
    let err = held.join(0, &p).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    held.hold_outside(kv / 4);
    held.join(0, &p).unwrap();
    let mut batch = e.batch();
    let err = batch.join_n(&[0, 1], &p).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    assert!(
        err.to_string().contains("2 completions of one prompt"),
        "{err}"
    );
    assert!(batch.is_empty(), "a refused request left something behind");
    let err = e.generate_n(&p, 2, |_, _| {}).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    for ids in [&[][..], &[4, 4][..]] {
        let err = batch.join_n(ids, &p).unwrap_err();
        assert!(matches!(err, EngineError::BadParams(_)), "{ids:?}: {err:?}");
    }
    batch.join_n(&[7], &p).unwrap();
    assert_eq!(batch.ids(), [7]);
    // A joining request's other completion counts before its copy is made: as many more
    // requests fit beside it as beside two requests.
    let mid = GenerateParams {
        prompt: Prompt::Tokens(vec![3; 40]),
        max_tokens: 8,
        ..p.clone()
    };
    let room = |mut b: keydiff::Batch<'_>| {
        for k in 10.. {
            if let Err(err) = b.join(k, &mid) {
                assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
                return k - 10;
            }
        }
        unreachable!()
    };
    let mut forked = e.batch();
    forked.join_n(&[0, 1], &mid).unwrap();
    let mut two = e.batch();
    two.join(0, &mid).unwrap();
    two.join(1, &mid).unwrap();
    let (a, b) = (room(forked), room(two));
    assert!(b >= 1, "the test needs room for a third request");
    assert_eq!(a, b);
    let small = GenerateParams {
        prompt: Prompt::Tokens(vec![3; 5]),
        ..p.clone()
    };
    let err = batch.join_n(&[8, 7], &small).unwrap_err();
    assert!(err.to_string().contains("already in this batch"), "{err}");
}
