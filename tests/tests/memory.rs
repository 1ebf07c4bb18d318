//! Host memory planning: the weights' plan (made from shapes and stored types before anything
//! is read) against what the loaded model holds, the fallback to fewer CPU copies at the exact
//! thresholds, refusals with the numbers, and the per-request KV cache check.

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device};
use keydiff::{
    CacheConfig, CpuWeights, Engine, EngineConfig, EngineError, GenerateParams, ModelSource,
    PolicyKind, Prompt,
};
use keydiff_tests::{
    export_hf, model, root, temp_dir, write_tiny_qwen3, write_tiny_qwen3_moe, QWEN, SMOLLM2,
};

/// Every combination of the CPU weight options.
const OPTIONS: [CpuWeights; 4] = [
    CpuWeights::FAST,
    CpuWeights {
        dense_prefill: false,
        requantize_slow: true,
    },
    CpuWeights {
        dense_prefill: true,
        requantize_slow: false,
    },
    CpuWeights::AS_STORED,
];

/// A limit no test machine reaches: planning runs, nothing is refused.
const UNLIMITED: u64 = 1 << 50;

fn config(cpu_weights: CpuWeights, dtype: DType, memory_limit: Option<u64>) -> EngineConfig {
    EngineConfig {
        dtype,
        cpu_weights,
        memory_limit,
        ..Default::default()
    }
}

/// SmolLM2 rewritten with a different GGUF type per tensor: dense (F32, F16, BF16) and
/// quantized (Q4_0 … Q8_0, Q6K where rows allow) linears, norms and an F16 embedding, so that
/// every branch of the plan meets a real tensor.
fn mixed_gguf(dir: &Path) -> PathBuf {
    let src = model(SMOLLM2);
    let mut f = std::fs::File::open(&src).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let cycle = [
        GgmlDType::F16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::BF16,
        GgmlDType::F32,
    ];
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let t = ct
            .tensor(&mut f, name, &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        let dtype = if t.rank() == 1 {
            GgmlDType::F32
        } else if name.as_str() == "token_embd.weight" {
            GgmlDType::F16
        } else if t.dim(1).unwrap().is_multiple_of(256) && i.is_multiple_of(3) {
            GgmlDType::Q6K
        } else {
            cycle[i % cycle.len()]
        };
        tensors.push((name.to_string(), QTensor::quantize(&t, dtype).unwrap()));
    }
    let path = dir.join("mixed.gguf");
    let mut out = std::fs::File::create(&path).unwrap();
    let md: Vec<(&str, &gguf_file::Value)> =
        ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md, &ts).unwrap();
    path
}

fn assert_plan_holds(source: &ModelSource, cfg: &EngineConfig, what: &str) -> Engine {
    let e = Engine::load(source, cfg).unwrap_or_else(|e| panic!("{what}: {e}"));
    let plan = e.weight_plan();
    assert!(plan.resident > 0, "{what}: empty plan");
    assert_eq!(
        plan.resident,
        e.weight_bytes(),
        "{what}: planned {} bytes, the model holds {}",
        plan.resident,
        e.weight_bytes()
    );
    e
}

/// The plan made before loading is exactly what the loaded model holds, for every CPU option,
/// stored type and dtype: the fallback decisions rest on it.
#[test]
fn weight_plans_match_the_loaded_models() {
    let dir = temp_dir("memory-plans");
    let mixed = mixed_gguf(&dir);
    let qwen3 = dir.join("tiny-qwen3.gguf");
    write_tiny_qwen3(&qwen3, false).unwrap();
    // Stacked experts, split on load: Q4_1 ones are re-quantized under `requantize_slow`.
    let moe = dir.join("tiny-qwen3moe-q4_1.gguf");
    write_tiny_qwen3_moe(&moe, GgmlDType::Q4_1).unwrap();
    for (path, dtypes) in [
        (model(SMOLLM2), &[DType::F32, DType::BF16][..]),
        (mixed.clone(), &[DType::F32, DType::F16][..]),
        (model(QWEN), &[DType::F32][..]),
        (qwen3, &[DType::F32, DType::BF16][..]),
        (moe, &[DType::F32, DType::BF16][..]),
    ] {
        for dtype in dtypes {
            for opts in OPTIONS {
                let what = format!("{} {dtype:?} {opts:?}", path.display());
                let e = assert_plan_holds(
                    &ModelSource::Gguf(path.clone()),
                    &config(opts, *dtype, Some(UNLIMITED)),
                    &what,
                );
                assert_eq!(e.cpu_weights(), Some(opts), "{what}");
            }
        }
    }
    // The options really change what is held: on a Q4_1 model dense copies are the bulk.
    let bytes = |opts| {
        Engine::load(
            &ModelSource::Gguf(model(SMOLLM2)),
            &config(opts, DType::F32, None),
        )
        .unwrap()
        .weight_bytes()
    };
    let (fast, stored) = (bytes(CpuWeights::FAST), bytes(CpuWeights::AS_STORED));
    assert!(fast > 2 * stored, "fast {fast} vs as stored {stored}");

    let hf = dir.join("hf");
    export_hf(&model(SMOLLM2), &hf).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        assert_plan_holds(
            &ModelSource::HfDir(hf.clone()),
            &config(CpuWeights::FAST, dtype, None),
            &format!("hf {dtype:?}"),
        );
    }
    for preset in [
        "tiny-llama",
        "tiny-qwen",
        "tiny-qwen3",
        "tiny-qwen3moe",
        "smollm2-135m",
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let source = ModelSource::Random {
                config: root().join(format!("configs/{preset}.json")),
                seed: 1,
                on_host: false,
                weights: None,
            };
            assert_plan_holds(
                &source,
                &config(CpuWeights::FAST, dtype, None),
                &format!("{preset} {dtype:?}"),
            );
        }
    }
    // Random weights quantized as a GGUF file's (`--weight-type`): the plan counts their
    // blocks and the CPU copies each option keeps (Q4_1 and Q5_0 re-quantized to Q8_0 under
    // `requantize_slow`; experts without dense copies).
    for (preset, t) in [
        ("tiny-llama", GgmlDType::Q4_1),
        ("tiny-qwen3moe", GgmlDType::Q5_0),
        ("tiny-qwen-d64", GgmlDType::Q4K),
    ] {
        for opts in OPTIONS {
            let source = ModelSource::Random {
                config: root().join(format!("configs/{preset}.json")),
                seed: 1,
                on_host: false,
                weights: Some(t),
            };
            let what = format!("{preset} {t:?} {opts:?}");
            let e = assert_plan_holds(&source, &config(opts, DType::F32, None), &what);
            assert_eq!(e.cpu_weights(), Some(opts), "{what}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Under a memory limit, the engine keeps the options asked for while they fit, then drops
/// the dense prefill copies, then the Q8_0 copies, and refuses the model when even the stored
/// weights cannot fit: each step at its exact threshold (planned peak + what a request needs).
#[test]
fn copies_are_dropped_at_the_exact_thresholds() {
    let source = ModelSource::Gguf(model(SMOLLM2));
    let chunk = EngineConfig::default().cache.chunk;
    let peak = |opts| {
        Engine::load(&source, &config(opts, DType::F32, Some(UNLIMITED)))
            .unwrap()
            .weight_plan()
            .peak()
    };
    let e = Engine::load(&source, &config(CpuWeights::FAST, DType::F32, None)).unwrap();
    // No budget: a request's activations with eager attention over one chunk.
    let reserve = e.model_config().request_scratch_bytes(chunk, chunk, true);
    let decode_only = OPTIONS[1];
    let (fast, decode, stored) = (
        peak(CpuWeights::FAST) + reserve,
        peak(decode_only) + reserve,
        peak(CpuWeights::AS_STORED) + reserve,
    );
    assert!(fast > decode && decode > stored, "{fast} {decode} {stored}");
    let chosen = |limit: u64| -> Result<Option<CpuWeights>, String> {
        Engine::load(&source, &config(CpuWeights::FAST, DType::F32, Some(limit)))
            .map(|e| e.cpu_weights())
            .map_err(|e| e.to_string())
    };
    assert_eq!(chosen(fast), Ok(Some(CpuWeights::FAST)));
    assert_eq!(chosen(fast - 1), Ok(Some(decode_only)));
    assert_eq!(chosen(decode), Ok(Some(decode_only)));
    assert_eq!(chosen(decode - 1), Ok(Some(CpuWeights::AS_STORED)));
    assert_eq!(chosen(stored), Ok(Some(CpuWeights::AS_STORED)));
    let err = chosen(stored - 1).unwrap_err();
    for needle in [
        "not enough memory",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "weights as stored",
        "available (--memory-limit",
    ] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // Without dense copies asked for, the first fallback is the stored weights.
    let e = Engine::load(&source, &config(decode_only, DType::F32, Some(decode - 1))).unwrap();
    assert_eq!(e.cpu_weights(), Some(CpuWeights::AS_STORED));

    // A fallback model runs, and is exactly the model loaded with those options.
    let params = GenerateParams {
        prompt: Prompt::Text("The capital of France is".into()),
        max_tokens: 6,
        ..Default::default()
    };
    let fallback = Engine::load(&source, &config(CpuWeights::FAST, DType::F32, Some(decode)))
        .unwrap()
        .generate(&params, |_| {})
        .unwrap();
    let direct = Engine::load(&source, &config(decode_only, DType::F32, None))
        .unwrap()
        .generate(&params, |_| {})
        .unwrap();
    assert_eq!(fallback.tokens, direct.tokens);
    assert_eq!(fallback.text, direct.text);
}

/// The tiny Llama preset with seeded random weights.
fn tiny_llama() -> ModelSource {
    ModelSource::Random {
        config: root().join("configs/tiny-llama.json"),
        seed: 2,
        on_host: false,
        weights: None,
    }
}

/// A budgeted KV cache is reserved at load; a full cache, which grows with the request, is
/// checked when the request allocates it and refused with the numbers and the fixes.
#[test]
fn kv_caches_that_cannot_fit_are_refused_per_request() {
    let source = tiny_llama();
    let base = Engine::load(&source, &EngineConfig::default()).unwrap();
    let m = base.model_config().clone();
    let weights = base.weight_plan().peak();
    let (chunk, budget, long) = (32, 64, 2000);
    let need = |slots: usize| {
        m.kv_cache_bytes(slots, DType::F32) + m.request_scratch_bytes(slots, chunk, true)
    };
    // Room for the weights and a budgeted cache of N + B slots, not for 2000 slots.
    let limit = weights + need(budget + chunk);
    assert!(need(long) > need(budget + chunk));
    let cache = |policy: &str, n: Option<usize>| CacheConfig {
        policy: PolicyKind::parse(policy, 32, 0).unwrap(),
        budget: n,
        ..CacheConfig::full(chunk)
    };
    let params = GenerateParams {
        prompt: Prompt::Tokens(keydiff::parity::random_tokens(long - 10, m.vocab_size, 3)),
        max_tokens: 10,
        ignore_eos: true,
        ..Default::default()
    };
    let limited = |c| EngineConfig {
        cache: c,
        memory_limit: Some(limit),
        ..Default::default()
    };
    let e = Engine::load(&source, &limited(cache("keydiff", Some(budget)))).unwrap();
    let out = e.generate(&params, |_| {}).unwrap();
    assert_eq!(out.tokens.len(), 10);
    assert_eq!(
        out.stats.peak_kv_bytes as u64,
        m.kv_cache_bytes(budget + chunk, DType::F32),
        "kv_cache_bytes is what the cache holds"
    );

    let e = Engine::load(&source, &limited(cache("full", None))).unwrap();
    let err = e.generate(&params, |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
    let msg = err.to_string();
    for needle in [
        "not enough memory",
        &format!("KV cache of {long} slots"),
        "--budget",
        "--kv-dtype f16",
    ] {
        assert!(msg.contains(needle), "`{needle}` not in: {msg}");
    }
    // Blocks of 32 do not fit this model's heads of 16, so no block type is offered.
    assert_eq!(m.head_dim, 16);
    assert!(!msg.contains("q8_0") && !msg.contains("q4_0"), "{msg}");
    // A short request fits under the same limit.
    let short = GenerateParams {
        prompt: Prompt::Tokens(vec![1, 2, 3]),
        ..params.clone()
    };
    assert_eq!(e.generate(&short, |_| {}).unwrap().tokens.len(), 10);

    // A budget too large for the memory is refused when the model loads.
    let err = Engine::load(&source, &limited(cache("keydiff", Some(long))))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("not enough memory"), "{err}");
    // A budget far beyond the context reserves the context's slots, which no request passes
    // (it used to reserve the budget's, and be refused as not enough memory).
    let context = m.context();
    let room = EngineConfig {
        memory_limit: Some(weights + need(context)),
        ..limited(cache("keydiff", Some(100 * context)))
    };
    let e = Engine::load(&source, &room).unwrap();
    assert_eq!(e.generate(&short, |_| {}).unwrap().tokens.len(), 10);
    let tight = EngineConfig {
        memory_limit: Some(weights + need(context) - 1),
        ..room
    };
    let err = Engine::load(&source, &tight).err().expect("refused");
    assert!(err.to_string().contains("not enough memory"), "{err}");
    // A chunk beyond the context is planned as no longer than the slots it fills, at load and
    // per request (a request was refused for a chunk × slots score matrix it never makes).
    let ctx = 64;
    let huge_chunk = EngineConfig {
        cache: CacheConfig::full(100_000),
        context: Some(ctx),
        memory_limit: Some(
            weights + m.kv_cache_bytes(ctx, DType::F32) + m.request_scratch_bytes(ctx, ctx, true),
        ),
        ..Default::default()
    };
    let e = Engine::load(&source, &huge_chunk).unwrap();
    assert_eq!(e.generate(&short, |_| {}).unwrap().tokens.len(), 10);

    // Heads of 64 hold llama.cpp's blocks: the hint offers q8_0 and q4_0 beside f16.
    let source = ModelSource::Random {
        config: root().join("configs/tiny-qwen-d64.json"),
        seed: 2,
        on_host: false,
        weights: None,
    };
    let base = Engine::load(&source, &EngineConfig::default()).unwrap();
    let m = base.model_config().clone();
    assert_eq!(m.head_dim, 64);
    let need = m.kv_cache_bytes(budget + chunk, DType::F32)
        + m.request_scratch_bytes(budget + chunk, chunk, true);
    let config = EngineConfig {
        memory_limit: Some(base.weight_plan().peak() + need),
        ..limited(cache("full", None))
    };
    let err = Engine::load(&source, &config)
        .unwrap()
        .generate(&params, |_| {})
        .unwrap_err();
    let msg = err.to_string();
    for needle in ["--kv-dtype f16", "--kv-dtype q8_0", "--kv-dtype q4_0"] {
        assert!(msg.contains(needle), "`{needle}` not in: {msg}");
    }
}

/// Perplexity also plans its chunk's logit rows (B × vocab f32 and the temporaries of a
/// log-softmax or the top-k of prompt logprobs: 24 bytes a logit): refused one byte short of
/// the cache, activations and logits, run at exactly that.
#[test]
fn perplexity_plans_its_logits() {
    let source = tiny_llama();
    let base = Engine::load(&source, &EngineConfig::default()).unwrap();
    let m = base.model_config().clone();
    let (resident, transient) = (base.weight_plan().resident, base.weight_plan().transient);
    let (chunk, budget) = (32, 64);
    let slots = budget + chunk;
    let need = m.kv_cache_bytes(slots, DType::F32) + m.request_scratch_bytes(slots, chunk, true);
    let logits = 24 * (chunk * m.vocab_size) as u64;
    assert!(logits > transient, "the threshold must leave room to load");
    let tokens = keydiff::parity::random_tokens(200, m.vocab_size, 9);
    let run = |limit: u64| {
        let cfg = EngineConfig {
            cache: CacheConfig {
                policy: PolicyKind::parse("keydiff", 32, 0).unwrap(),
                budget: Some(budget),
                ..CacheConfig::full(chunk)
            },
            memory_limit: Some(limit),
            ..Default::default()
        };
        Engine::load(&source, &cfg).unwrap().perplexity(&tokens)
    };
    let exact = resident + need + logits;
    assert_eq!(run(exact).unwrap().nll.len(), 199);
    let err = run(exact - 1).unwrap_err().to_string();
    assert!(
        err.contains("not enough memory") && err.contains("activations and logits"),
        "{err}"
    );
}
