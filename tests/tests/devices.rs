//! Tests that run on every device: each body is generated for the CPU and for CUDA by
//! `test_device!` (as candle's). Without the `cuda` feature the CUDA variants are reported as
//! ignored, with the reason, never as passed; built with it, a missing GPU fails them.
//! `scripts/gpu-check.sh` runs the same checks on a GPU host through `keydiff check-kernels`
//! and `keydiff check-device`.

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use keydiff::kernel_check::{
    kernel_cases, kernel_parity, kernel_timing, launch_floor_us, ScoreLoads, SelectBlocks,
};
use keydiff::parity::compare_devices;
use keydiff::{Anchor, CacheConfig, CpuWeights, EngineConfig, PolicyKind};
use keydiff_tests::root;

/// Held by every CUDA variant while it runs.
#[cfg(feature = "cuda")]
static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

macro_rules! test_device {
    ($body:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() -> Result<()> {
            $body(&Device::Cpu)
        }

        #[test]
        #[cfg_attr(
            not(feature = "cuda"),
            ignore = "needs `--features cuda` and a GPU (scripts/gpu-check.sh runs it there)"
        )]
        fn $cuda() -> Result<()> {
            #[cfg(feature = "cuda")]
            {
                // One test at a time on the GPU: memory figures (allocator_is_prepared) and
                // timings are not disturbed by another test's allocations.
                let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
                // As the engine opens it (its allocator set up: `prepare_cuda`).
                let dev = keydiff::parse_device("cuda:0")
                    .map_err(|e| anyhow::anyhow!("no CUDA device 0 in a cuda build: {e}"))?;
                $body(&dev)
            }
            #[cfg(not(feature = "cuda"))]
            {
                anyhow::bail!("built without the cuda feature: nothing to run on")
            }
        }
    };
}

/// A CUDA device that cannot be used is refused with the reason: in a build without CUDA, the
/// feature to build with; in one with it, the devices the driver sees, or the driver's error
/// where it sees none (an ordinal past the devices is a user's typo, not a driver fault).
/// Whether the library has CUDA is its own build's say (`build_info`): cargo unifies features,
/// so this crate's `cuda` feature need not match it.
#[test]
fn unusable_cuda_devices_are_refused_with_the_reason() {
    let cuda = keydiff::build_info().contains("features: cuda");
    let err = keydiff::parse_device("cuda:4096")
        .expect_err("cuda:4096 opened")
        .to_string();
    if cuda {
        assert!(
            err.starts_with("device `cuda:4096`: this machine has ")
                || err.starts_with("device `cuda:4096`: the CUDA driver says "),
            "{err}"
        );
    } else {
        assert!(
            err.starts_with(
                "device `cuda:4096`: this keydiff was built without CUDA; build it with \
                 `--features cuda`"
            ),
            "{err}"
        );
        let err = keydiff::parse_device("cuda")
            .expect_err("cuda opened")
            .to_string();
        assert!(
            err.starts_with("device `cuda`: this keydiff was built"),
            "{err}"
        );
    }
    assert!(matches!(keydiff::parse_device("cpu"), Ok(Device::Cpu)));
}

/// `n` seeded values, uniform in ±scale / 2 (xorshift).
fn seeded(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// The engine's CUDA devices keep freed memory in their pool across synchronisations and
/// create no per-allocation events (`prepare_cuda`), and the memory plan still sees memory this
/// process freed: a GiB allocated, freed and synchronised is free again for `detect_on` (which
/// counts the pool's idle bytes). The CPU has no such allocator.
fn allocator_is_prepared(dev: &Device) -> Result<()> {
    use keydiff_model::memory::{cuda_allocator, MemoryBudget};
    let state = cuda_allocator(dev).map_err(anyhow::Error::msg)?;
    if !dev.is_cuda() {
        ensure!(state.is_none(), "{state:?} on {dev:?}");
        return Ok(());
    }
    let state = state.context("no allocator state for a CUDA device")?;
    // As the environment asks (by default: a retaining pool, no events); the pool needs a
    // device with memory pools (every one since CUDA 11.2 on Linux).
    let retain = std::env::var("KEYDIFF_CUDA_POOL_RETAIN").map_or(true, |v| v != "0");
    let events = std::env::var("KEYDIFF_CUDA_EVENTS").is_ok_and(|v| v != "0");
    ensure!(
        state.pool_retains == retain && state.event_tracking == events,
        "{state:?}"
    );
    let free = |what: &str| -> Result<u64> {
        Ok(MemoryBudget::detect_on(dev)
            .with_context(|| format!("no free memory {what}"))?
            .ram)
    };
    let before = free("before")?;
    let t = Tensor::zeros((256, 1024, 1024), DType::F32, dev)?;
    dev.synchronize()?;
    let during = free("with a GiB in use")?;
    drop(t);
    dev.synchronize()?;
    let after = free("after")?;
    const MIB: u64 = 1 << 20;
    ensure!(
        during + 1000 * MIB <= before,
        "a GiB in use: free {before} -> {during}"
    );
    ensure!(
        after + 64 * MIB >= before,
        "freed memory not seen by the plan: free {before} before, {after} after"
    );
    Ok(())
}
test_device!(
    allocator_is_prepared,
    allocator_is_prepared_cpu,
    allocator_is_prepared_cuda
);

/// Scoring, selection/plan and moves against the CPU references, on every case: odd sizes,
/// head dims 64/128/256, f32/f16/bf16, protected slots, both anchors, n up to 131072 + 128.
fn eviction_ops_match_references(dev: &Device) -> Result<()> {
    for (i, c) in kernel_cases(true).iter().enumerate() {
        let r = kernel_parity(dev, c, 100 + i as u64)?;
        ensure!(r.pass, "{c:?}: {r:?}");
    }
    Ok(())
}
test_device!(
    eviction_ops_match_references,
    eviction_ops_match_references_cpu,
    eviction_ops_match_references_cuda
);

/// The timing path runs, moves exactly n − N rows per head after a chunk (positions ascending,
/// so every surviving chunk slot moves unless it scored below a cached one), and reports
/// consistent numbers.
fn eviction_timing_is_consistent(dev: &Device) -> Result<()> {
    let c = keydiff::kernel_check::KernelCase {
        kv_heads: 2,
        n: 600,
        head_dim: 64,
        dtype: DType::F32,
        budget: 472,
        sinks: 0,
        recent: 0,
        anchor: Anchor::Normalized,
    };
    for blocks in [SelectBlocks::One, SelectBlocks::Many] {
        for loads in [ScoreLoads::Scalar, ScoreLoads::Vector] {
            let t = kernel_timing(dev, &c, 2, 1.0, blocks, loads)?;
            check_timing(&t)?;
        }
    }
    // The per-op floor checks its chain's result itself.
    let floor = launch_floor_us(dev, 50)?;
    ensure!(floor > 0.0 && floor.is_finite(), "launch floor {floor}");
    Ok(())
}

fn check_timing(t: &keydiff::kernel_check::KernelTiming) -> Result<()> {
    ensure!(
        t.moves <= 2 * 128,
        "{} moves for 2 heads of 128 new slots",
        t.moves
    );
    ensure!(t.total_us > 0.0 && t.bytes > 2 * 2 * 600 * 64 * 4, "{t:?}");
    ensure!(
        (t.total_us - (t.score_us + t.select_us + t.move_us)).abs() < 1e-6,
        "{t:?}"
    );
    ensure!(
        t.eviction_us > 0.0 && (t.gb_per_s - t.bytes as f64 / t.eviction_us / 1e3).abs() < 1e-6,
        "{t:?}"
    );
    Ok(())
}
test_device!(
    eviction_timing_is_consistent,
    eviction_timing_is_consistent_cpu,
    eviction_timing_is_consistent_cuda
);

/// Model parity: the same seeded random Llama-, Qwen 2.5-, Qwen 3- and Qwen 3 MoE-shaped models in CPU f32 and in bf16 on
/// the device, after a multi-chunk prefill with KeyDiff eviction (and full, for contrast).
fn bf16_model_matches_cpu_f32(dev: &Device) -> Result<()> {
    for preset in ["tiny-llama", "tiny-qwen", "tiny-qwen3", "tiny-qwen3moe"] {
        for policy in [
            PolicyKind::Full,
            PolicyKind::KeyDiff {
                anchor: Anchor::Normalized,
            },
        ] {
            let cache = CacheConfig {
                budget: (policy != PolicyKind::Full).then_some(96),
                policy: policy.clone(),
                chunk: 32,
                window: 0.1,
                sinks: 2,
                evict_every: None,
            };
            let cfg = |device: Device, dtype| EngineConfig {
                attention: keydiff::AttentionBackend::Auto,
                device,
                dtype,
                kv_dtype: None,
                cache: cache.clone(),
                cpu_weights: CpuWeights::FAST,
                memory_limit: None,
                ..Default::default()
            };
            let preset_path = root().join(format!("configs/{preset}.json"));
            let (d, _) = compare_devices(
                &preset_path,
                3,
                None,
                &cfg(Device::Cpu, DType::F32),
                &cfg(dev.clone(), DType::BF16),
                250,
            )?;
            ensure!(d.cosine > 0.99, "{preset} {}: {d:?}", policy.name());
        }
    }
    Ok(())
}
test_device!(
    bf16_model_matches_cpu_f32,
    bf16_model_matches_cpu_f32_cpu,
    bf16_model_matches_cpu_f32_cuda
);

/// GGUF-typed weights on the device: the same seeded random models with their linears and
/// embedding quantized (`--weight-type`: llama.cpp's 32-value block types, and K types where
/// the preset's widths are multiples of 256), CPU f32 (exact products of the dequantized
/// weights, as stored: no Q8_0 copies; experts, which keep no dense copies, through the CPU's
/// quantized matmul) against bf16 on the device (on CUDA, candle's quantized matmuls), after a
/// multi-chunk prefill: chunks of 32 rows with H2O eviction, and chunks of 8 (CUDA runs up to
/// 8 rows through its matrix-vector kernels) under the full cache.
fn quantized_weights_match_cpu_f32(dev: &Device) -> Result<()> {
    use keydiff::GgmlDType as G;
    for (preset, types) in [
        ("tiny-llama", &[G::Q4_0, G::Q8_0, G::Q5_1][..]),
        ("tiny-qwen3moe", &[G::Q4_1][..]),
        ("tiny-qwen-d64", &[G::Q4K, G::Q6K, G::Q5_0][..]),
    ] {
        for &t in types {
            // H2O, not KeyDiff: bf16's rounding alone moves KeyDiff's choices on
            // tiny-qwen-d64 (the CPU in bf16: cosine down to 0.997 here, 0.984 on longer
            // prompts), which would blur what this checks; and chunks of 8 under the full
            // cache, since with an eviction after every chunk a mixture's routing moves too
            // (0.986 on tiny-qwen3moe in Q4_1 under KeyDiff).
            for (chunk, policy) in [
                (32, PolicyKind::H2o { normalized: false }),
                (8, PolicyKind::Full),
            ] {
                let cache = CacheConfig {
                    budget: (policy != PolicyKind::Full).then_some(96),
                    policy,
                    chunk,
                    window: 0.1,
                    sinks: 2,
                    evict_every: None,
                };
                let cfg = |device: Device, dtype| EngineConfig {
                    device,
                    dtype,
                    cache: cache.clone(),
                    cpu_weights: CpuWeights {
                        dense_prefill: true,
                        requantize_slow: false,
                    },
                    memory_limit: None,
                    ..Default::default()
                };
                let preset_path = root().join(format!("configs/{preset}.json"));
                let (d, _) = compare_devices(
                    &preset_path,
                    3,
                    Some(t),
                    &cfg(Device::Cpu, DType::F32),
                    &cfg(dev.clone(), DType::BF16),
                    200,
                )?;
                eprintln!("{preset} {t:?} chunk {chunk}: cosine {}", d.cosine);
                ensure!(d.cosine > 0.99, "{preset} {t:?} chunk {chunk}: {d:?}");
            }
            // The memory plan, made from shapes before anything loads, is what the device
            // holds; values drawn on the device this time (as `--weight-type` draws them).
            let source = keydiff::ModelSource::Random {
                config: root().join(format!("configs/{preset}.json")),
                seed: 3,
                on_host: false,
                weights: Some(t),
            };
            let e = keydiff::Engine::load(
                &source,
                &EngineConfig {
                    device: dev.clone(),
                    dtype: DType::BF16,
                    ..Default::default()
                },
            )?;
            ensure!(
                e.weight_plan().resident == e.weight_bytes(),
                "{preset} {t:?}: planned {:?}, holds {}",
                e.weight_plan(),
                e.weight_bytes()
            );
        }
    }
    Ok(())
}
test_device!(
    quantized_weights_match_cpu_f32,
    quantized_weights_match_cpu_f32_cpu,
    quantized_weights_match_cpu_f32_cuda
);

/// A cache of another dtype than the activations (`--kv-dtype`) on the device: f16 caches under
/// bf16 and f32 activations, after a multi-chunk prefill with KeyDiff and TOVA eviction, against
/// CPU f32 with an f32 cache.
fn half_cache_matches_cpu_f32(dev: &Device) -> Result<()> {
    for policy in ["keydiff", "tova"] {
        let cache = CacheConfig {
            policy: PolicyKind::parse(policy, keydiff::SNAPKV_WINDOW, 0)?,
            budget: Some(96),
            chunk: 32,
            window: 0.1,
            sinks: 2,
            evict_every: None,
        };
        let cfg = |device: Device, dtype, kv_dtype| EngineConfig {
            device,
            dtype,
            kv_dtype,
            cache: cache.clone(),
            ..Default::default()
        };
        let preset_path = root().join("configs/tiny-qwen.json");
        for dtype in [DType::BF16, DType::F32] {
            let (d, _) = compare_devices(
                &preset_path,
                3,
                None,
                &cfg(Device::Cpu, DType::F32, None),
                &cfg(dev.clone(), dtype, Some(DType::F16.into())),
                250,
            )?;
            ensure!(
                d.cosine > 0.99,
                "{policy} {dtype:?} with an f16 cache: {d:?}"
            );
        }
    }
    Ok(())
}
test_device!(
    half_cache_matches_cpu_f32,
    half_cache_matches_cpu_f32_cpu,
    half_cache_matches_cpu_f32_cuda
);

/// Perplexity's path (every logit row of a chunk, log-softmax, the target's log-probability)
/// in f32 and bf16 on the device against CPU f32, after a multi-chunk prefill with KeyDiff
/// eviction. Random weights predict almost uniformly (NLL ≈ ln 256 ± 0.05), so besides the
/// largest difference the test asks that the per-token NLLs correlate: which tokens are harder
/// must agree, and a broken row, reduction or gather makes them uncorrelated.
fn perplexity_matches_cpu_f32(dev: &Device) -> Result<()> {
    let cache = CacheConfig {
        policy: PolicyKind::parse("keydiff", keydiff::SNAPKV_WINDOW, 0)?,
        budget: Some(96),
        chunk: 32,
        window: 0.1,
        sinks: 2,
        evict_every: None,
    };
    let cfg = |device: Device, dtype| EngineConfig {
        device,
        dtype,
        cache: cache.clone(),
        ..Default::default()
    };
    let preset = root().join("configs/tiny-qwen.json");
    for dtype in [DType::F32, DType::BF16] {
        let d = keydiff::parity::compare_device_perplexity(
            &preset,
            3,
            None,
            &cfg(Device::Cpu, DType::F32),
            &cfg(dev.clone(), dtype),
            250,
        )?;
        // Measured on the CPU: f32 identical; bf16 worst 0.026, correlation 0.9994.
        let (max_abs, min_corr) = match dtype {
            DType::F32 => (5e-3, 0.999),
            _ => (0.1, 0.99),
        };
        ensure!(
            d.max_abs < max_abs && d.correlation > min_corr,
            "{dtype:?}: {d:?}"
        );
        // Each run's prompt logprobs (on the device: its log-softmax and top-k) are its own
        // NLLs, row for row.
        ensure!(
            d.logprobs_max_abs.is_some_and(|x| x < 1e-3),
            "{dtype:?}: {d:?}"
        );
    }
    Ok(())
}
test_device!(
    perplexity_matches_cpu_f32,
    perplexity_matches_cpu_f32_cpu,
    perplexity_matches_cpu_f32_cuda
);

/// Prompt logprobs on the device (`rows_logprobs_on_device`: log-softmax, targets, top-k by
/// rounds of argmax) against the host twin `token_logprob`, on random rows of Qwen's
/// vocabulary size (151936, past any one-block limit), in f32 and bf16.
fn logprobs_match_the_host(dev: &Device) -> Result<()> {
    use keydiff::logprobs::{rows_logprobs_on_device, token_logprob};
    let (rows, vocab) = (5, 151_936);
    let host = candle_core::Tensor::randn(0f32, 4.0, (rows, vocab), &Device::Cpu)?;
    let targets: Vec<u32> = (0..rows as u32)
        .map(|r| r * 30_011 % vocab as u32)
        .collect();
    for dtype in [DType::F32, DType::BF16] {
        // The host twin reads the same (rounded) values.
        let host = host.to_dtype(dtype)?.to_dtype(DType::F32)?;
        let on_dev = host.to_dtype(dtype)?.to_device(dev)?;
        let got = rows_logprobs_on_device(&on_dev, &targets, 8)?;
        let rows_host = host.to_vec2::<f32>()?;
        for ((g, row), &t) in got.iter().zip(&rows_host).zip(&targets) {
            let want = token_logprob(row, t, 8)?;
            ensure!(
                g.token == t && (g.logprob - want.logprob).abs() < 1e-4,
                "{g:?} vs {want:?}"
            );
            ensure!(g.top.len() == 8, "{g:?}");
            for (a, b) in g.top.iter().zip(&want.top) {
                // Equal values (bf16 has many ties) may come in either order.
                ensure!(
                    (a.1 - b.1).abs() < 1e-4,
                    "{dtype:?}: {:?} vs {:?}",
                    g.top,
                    want.top
                );
                ensure!(
                    a.0 == b.0 || (row[a.0 as usize] == row[b.0 as usize]),
                    "{dtype:?}"
                );
            }
        }
    }
    Ok(())
}
test_device!(
    logprobs_match_the_host,
    logprobs_match_the_host_cpu,
    logprobs_match_the_host_cuda
);

/// Memory is planned on the device the model runs on (host memory on the CPU, the GPU's on
/// CUDA): the weights' plan is what the loaded model holds there; under a limit, a model is
/// loaded at exactly its weights and reserved cache, refused a byte below, and a full cache
/// that cannot fit is refused per request with the fixes that apply to its dtype, while a
/// short request under the same limit runs. On CUDA the driver also reports what the load took.
fn memory_is_planned_on_the_device(dev: &Device) -> Result<()> {
    use keydiff::{EngineError, GenerateParams, ModelSource, Prompt};
    let source = ModelSource::Random {
        config: root().join("configs/tiny-llama.json"),
        seed: 2,
        on_host: true,
        weights: None,
    };
    let dtype = if dev.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let (chunk, budget, long) = (32, 64, 2000);
    for kv_dtype in [DType::F32, DType::BF16] {
        let cfg = |cache: CacheConfig, memory_limit| EngineConfig {
            device: dev.clone(),
            dtype,
            kv_dtype: Some(kv_dtype.into()),
            cache,
            attention: keydiff::AttentionBackend::Eager,
            memory_limit,
            ..Default::default()
        };
        let cache = |policy: &str, n: Option<usize>| -> Result<CacheConfig> {
            Ok(CacheConfig {
                policy: PolicyKind::parse(policy, 32, 0)?,
                budget: n,
                ..CacheConfig::full(chunk)
            })
        };
        let base = keydiff::Engine::load(&source, &cfg(cache("full", None)?, None))?;
        let plan = base.weight_plan();
        ensure!(
            plan.resident > 0 && plan.resident == base.weight_bytes(),
            "planned {plan:?}, the model holds {} bytes",
            base.weight_bytes()
        );
        ensure!(
            base.load_taken_bytes().is_some() != dev.is_cpu(),
            "the driver's figure is reported on GPUs only: {:?}",
            base.load_taken_bytes()
        );
        let m = base.model_config().clone();
        drop(base);
        let need = |slots: usize| {
            m.kv_cache_bytes(slots, kv_dtype) + m.request_scratch_bytes(slots, chunk, true)
        };
        let limit = plan.peak() + need(budget + chunk);
        let budgeted = cache("keydiff", Some(budget))?;
        let err = keydiff::Engine::load(&source, &cfg(budgeted.clone(), Some(limit - 1)))
            .err()
            .ok_or_else(|| anyhow::anyhow!("loaded a byte short of its plan"))?;
        ensure!(err.to_string().contains("not enough memory"), "{err}");
        let params = GenerateParams {
            prompt: Prompt::Tokens(keydiff::parity::random_tokens(long - 10, m.vocab_size, 3)),
            max_tokens: 10,
            ignore_eos: true,
            ..Default::default()
        };
        let e = keydiff::Engine::load(&source, &cfg(budgeted, Some(limit)))?;
        ensure!(e.generate(&params, |_| {})?.tokens.len() == 10);
        drop(e);

        let e = keydiff::Engine::load(&source, &cfg(cache("full", None)?, Some(limit)))?;
        let err = e.generate(&params, |_| {}).err().ok_or_else(|| {
            anyhow::anyhow!("a full cache of {long} slots ran under a limit for {budget}")
        })?;
        ensure!(matches!(err, EngineError::OutOfMemory(_)), "{err:?}");
        let msg = err.to_string();
        ensure!(
            msg.contains(&format!("KV cache of {long} slots")) && msg.contains("--budget"),
            "{msg}"
        );
        ensure!(
            msg.contains("--kv-dtype f16") == (kv_dtype.size_in_bytes() > 2),
            "f16 is suggested only for a wider cache ({kv_dtype:?}): {msg}"
        );
        let short = GenerateParams {
            prompt: Prompt::Tokens(vec![1, 2, 3]),
            ..params
        };
        ensure!(e.generate(&short, |_| {})?.tokens.len() == 10);
    }
    Ok(())
}
test_device!(
    memory_is_planned_on_the_device,
    memory_is_planned_on_the_device_cpu,
    memory_is_planned_on_the_device_cuda
);

/// A batched decode step (`Model::forward_batch`) and a pass mixing decode rows with prompt
/// chunks (`Model::forward_segments`) on the device, against each sequence alone there:
/// sequences at different positions under an evicting KeyDiff budget, each segment's logits
/// equal to its sequence's alone up to the rounding of a matmul over more rows (f32 on the
/// CPU; bf16 on CUDA, where the mixed pass runs all rows through one matmul, relative to the
/// logits' scale).
fn batch_step_matches_single_steps(dev: &Device) -> Result<()> {
    let dtype = if dev.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let config = root().join("configs/tiny-qwen.json");
    let loaded =
        keydiff_model::load_random(&config, dev, dtype, 4, true, None, CpuWeights::FAST, None)?;
    let cache = CacheConfig {
        policy: PolicyKind::KeyDiff {
            anchor: Anchor::Normalized,
        },
        budget: Some(40),
        ..CacheConfig::full(16)
    };
    let rows = keydiff::parity::batch_vs_single(&loaded.model, &cache)?;
    let tol = keydiff::parity::batch_tolerance(dev, dtype, false);
    for (i, d) in rows.into_iter().enumerate() {
        ensure!(
            d.max_abs <= tol.bound(d.scale),
            "segment {i}: {d:?}, beyond {tol}"
        );
    }
    Ok(())
}
test_device!(
    batch_step_matches_single_steps,
    batch_step_matches_single_steps_cpu,
    batch_step_matches_single_steps_cuda
);

/// The softmax of `x` (`[rows, t]`, rows in chunks of `chunk` queries over keys whose last
/// `chunk` are the chunk's own) masked bottom-right causal, naively in f64 row by row: the
/// reference of the softmax kernels' device tests.
fn naive_causal_softmax(x: &[f32], t: usize, chunk: usize) -> Vec<f64> {
    x.chunks(t)
        .enumerate()
        .flat_map(|(row, xr)| {
            let seen = t - chunk + row % chunk + 1;
            let max = xr[..seen]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let sum: f64 = xr[..seen].iter().map(|&v| (v as f64 - max).exp()).sum();
            (0..t).map(move |c| {
                if c < seen {
                    (xr[c] as f64 - max).exp() / sum
                } else {
                    0.0
                }
            })
        })
        .collect()
}

/// Relative error allowed of probabilities written in `dtype` against the naive ones: the
/// output's rounding; in f32, sums over up to 9000 keys.
fn probs_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        _ => 5e-5,
    }
}

/// The softmax of a chunk's attention scores as the device runs it (on CUDA keydiff's
/// `keydiff_causal_softmax_*`, on the CPU candle's ops) against a naive one computed here row by
/// row in f64: scores in f32, f16 and bf16, probabilities in f32 and in the scores' dtype,
/// chunks of 1 to 128 queries, 0 exactly where masked.
fn causal_softmax_matches_naive(dev: &Device) -> Result<()> {
    use keydiff_model::attention::{causal_softmax_cuda, chunk_mask, masked_softmax};
    for (heads, chunk, t) in [(3, 1, 40), (4, 7, 7), (2, 128, 1000), (1, 16, 9000)] {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let n = heads * chunk * t;
            let x = seeded(n, n as u64, 10.0);
            let scores = Tensor::from_vec(x, (heads, chunk, t), dev)?.to_dtype(dt)?;
            // On CUDA the kernel must take them (not candle's ops in its place).
            if dev.is_cuda() {
                ensure!(
                    causal_softmax_cuda(&scores, chunk, DType::F32)?.is_some(),
                    "the CUDA softmax kernel declined {dt:?} scores \
                     (KEYDIFF_CUDA_SOFTMAX_KERNEL=0?)"
                );
            }
            let x = scores
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let mask = (chunk > 1)
                .then(|| chunk_mask(chunk, t, dt, dev))
                .transpose()?;
            let naive = naive_causal_softmax(&x, t, chunk);
            for out in [DType::F32, dt] {
                let p = masked_softmax(&scores, mask.as_ref(), chunk, out)?;
                ensure!(p.dtype() == out && p.dims() == scores.dims(), "{p:?}");
                let p = p.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                for (i, (&got, &want)) in p.iter().zip(&naive).enumerate() {
                    ensure!(
                        (got as f64 - want).abs() <= probs_tolerance(out) * want + 1e-7,
                        "heads {heads} chunk {chunk} t {t} {dt:?} -> {out:?}: row {} key {}: \
                         {got} against {want}",
                        i / t,
                        i % t
                    );
                }
            }
        }
    }
    Ok(())
}
test_device!(
    causal_softmax_matches_naive,
    causal_softmax_matches_naive_cpu,
    causal_softmax_matches_naive_cuda
);

/// The softmax with the statistics of TOVA, SnapKV and H2O as the device runs it (on CUDA
/// keydiff's `keydiff_softmax_state_*` and `keydiff_softmax_sums_*`, which must take it; on the
/// CPU candle's softmax and `row_sums`) against sums computed here in f64: scores in f32, f16
/// and bf16, groups of query heads, the last 1, some or all queries of a chunk summed, the
/// probabilities written in f32, in the scores' dtype (within their rounding of the naive ones)
/// or not at all.
fn softmax_sums_match_naive(dev: &Device) -> Result<()> {
    use keydiff_model::attention::{chunk_mask, masked_softmax_sums, softmax_sums_cuda};
    for (kv, g, chunk, t, r) in [(2, 3, 1, 40, 1), (1, 2, 7, 7, 7), (2, 2, 128, 1000, 32)] {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let n = kv * g * chunk * t;
            let x = seeded(n, n as u64 + 7, 10.0);
            let scores = Tensor::from_vec(x, (kv, g * chunk, t), dev)?.to_dtype(dt)?;
            if dev.is_cuda() {
                ensure!(
                    softmax_sums_cuda(&scores, chunk, r, None)?.is_some(),
                    "the CUDA softmax-sums kernels declined {dt:?} scores \
                     (KEYDIFF_CUDA_SOFTMAX_SUMS=0?)"
                );
            }
            let x = scores
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let mask = (chunk > 1)
                .then(|| chunk_mask(chunk, t, dt, dev))
                .transpose()?;
            let naive = naive_causal_softmax(&x, t, chunk);
            let what = format!("kv {kv} g {g} chunk {chunk} t {t} last {r} {dt:?}");
            for out in [None, Some(DType::F32), Some(dt)] {
                let (p, sums) = masked_softmax_sums(&scores, mask.as_ref(), chunk, g, r, out)?;
                ensure!(sums.dims() == [kv, g, t], "{what}: sums {:?}", sums.dims());
                let sums = sums.flatten_all()?.to_vec1::<f32>()?;
                for (head, hs) in sums.chunks(t).enumerate() {
                    for (c, &got) in hs.iter().enumerate() {
                        let want: f64 = (chunk - r..chunk)
                            .map(|q| naive[(head * chunk + q) * t + c])
                            .sum();
                        ensure!(
                            (got as f64 - want).abs() <= 5e-5 * want + 1e-7,
                            "{what} -> {out:?}: sum of head {head} key {c}: {got} against {want}"
                        );
                    }
                }
                match (out, p) {
                    (None, None) => {}
                    (Some(o), Some(p)) => {
                        ensure!(p.dtype() == o && p.dims() == scores.dims(), "{what}: {p:?}");
                        let p = p.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                        for (i, (&got, &want)) in p.iter().zip(&naive).enumerate() {
                            ensure!(
                                (got as f64 - want).abs() <= probs_tolerance(o) * want + 1e-7,
                                "{what} -> {o:?}: row {} key {}: {got} against {want}",
                                i / t,
                                i % t
                            );
                        }
                    }
                    (o, p) => anyhow::bail!("{what}: asked {o:?}, got {p:?}"),
                }
            }
        }
    }
    Ok(())
}
test_device!(
    softmax_sums_match_naive,
    softmax_sums_match_naive_cpu,
    softmax_sums_match_naive_cuda
);

/// A residual add and the RMSNorm of its sum as the device runs them (on CUDA keydiff's
/// `keydiff_add_rms_norm_*`, which must take them; on the CPU candle's add and `rms_norm`)
/// against a reference computed here: the sums rounded once to the dtype, exactly; the norms in
/// f64 over those sums, within the output's rounding (on the CPU candle rounds its f16/bf16
/// divisor to the dtype: a few ulps more).
fn add_rms_norm_matches_reference(dev: &Device) -> Result<()> {
    use keydiff_model::model::{add_rms_norm, add_rms_norm_cuda};
    for (rows, cols) in [(1, 576), (3, 3072), (2, 257)] {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let t = |v: Vec<f32>, shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::from_vec(v, shape, dev)?.to_dtype(dt)?)
            };
            let x = t(seeded(rows * cols, 1, 4.0), &[rows, cols])?;
            let r = t(seeded(rows * cols, 2, 2.0), &[rows, cols])?;
            let w = t(seeded(cols, 3, 2.0), &[cols])?;
            let eps = 1e-6;
            if dev.is_cuda() {
                ensure!(
                    add_rms_norm_cuda(&x, &r, &w, eps)?.is_some(),
                    "the CUDA add+norm kernel declined {dt:?} rows of {cols} \
                     (KEYDIFF_CUDA_ADD_NORM=0?)"
                );
            }
            let (sum, norm) = add_rms_norm(&x, &r, &w, eps)?;
            let host = |t: &Tensor| -> Result<Vec<f32>> {
                Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
            };
            let (xs, rs, ws) = (host(&x)?, host(&r)?, host(&w)?);
            let (sum, norm) = (host(&sum)?, host(&norm)?);
            // x + r in f32, rounded to dt once (by the CPU's cast), as the kernel and candle add.
            let exact: Vec<f32> = xs.iter().zip(&rs).map(|(a, b)| a + b).collect();
            let want_sum =
                host(&Tensor::from_vec(exact, rows * cols, &Device::Cpu)?.to_dtype(dt)?)?;
            ensure!(sum == want_sum, "{dt:?} rows of {cols}: sums differ");
            let ulps = if dev.is_cuda() { 1.0 } else { 3.0 };
            let rel = ulps
                * match dt {
                    DType::F16 => 1e-3,
                    DType::BF16 => 8e-3,
                    _ => 2e-6,
                };
            for (i, row) in want_sum.chunks(cols).enumerate() {
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
                let scale = 1.0 / (ms + eps as f64).sqrt();
                for (c, &v) in row.iter().enumerate() {
                    let want = scale * v as f64 * ws[c] as f64;
                    let got = norm[i * cols + c] as f64;
                    ensure!(
                        (got - want).abs() <= rel * want.abs() + 1e-6,
                        "{dt:?} rows of {cols}: norm of row {i} col {c}: {got} against {want}"
                    );
                }
            }
        }
    }
    Ok(())
}
test_device!(
    add_rms_norm_matches_reference,
    add_rms_norm_matches_reference_cpu,
    add_rms_norm_matches_reference_cuda
);

/// SwiGLU's product as the device runs it (on CUDA keydiff's `keydiff_silu_mul_*`, which must
/// take it; on the CPU candle's `silu` and product) against silu(g) · u computed here in f64,
/// on the halves of a fused gate/up output (the layout decode rows give it) and on plain rows:
/// within the output's rounding (on the CPU candle rounds silu's result too: an ulp more).
fn silu_mul_matches_reference(dev: &Device) -> Result<()> {
    use keydiff_model::model::{silu_mul, silu_mul_cuda};
    for (rows, cols) in [(1, 8192), (3, 896), (2, 257)] {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let v = seeded(rows * 2 * cols, (rows * cols) as u64, 12.0);
            let both = Tensor::from_vec(v, (rows, 2 * cols), dev)?.to_dtype(dt)?;
            let (g, u) = (both.narrow(1, 0, cols)?, both.narrow(1, cols, cols)?);
            for (g, u) in [(g.clone(), u.clone()), (g.contiguous()?, u.contiguous()?)] {
                if dev.is_cuda() {
                    ensure!(
                        silu_mul_cuda(&g, &u)?.is_some(),
                        "the CUDA silu·mul kernel declined {dt:?} rows of {cols} \
                         (KEYDIFF_CUDA_SILU_MUL=0?)"
                    );
                }
                let got = silu_mul(&g, &u)?;
                let host = |t: &Tensor| -> Result<Vec<f32>> {
                    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
                };
                let (got, gs, us) = (host(&got)?, host(&g)?, host(&u)?);
                let ulps = if dev.is_cuda() { 1.0 } else { 2.0 };
                let rel = ulps
                    * match dt {
                        DType::F16 => 1e-3,
                        DType::BF16 => 8e-3,
                        _ => 2e-6,
                    };
                for (i, ((&a, &gv), &uv)) in got.iter().zip(&gs).zip(&us).enumerate() {
                    let (gv, uv) = (gv as f64, uv as f64);
                    let want = gv / (1.0 + (-gv).exp()) * uv;
                    ensure!(
                        (a as f64 - want).abs() <= rel * want.abs() + 1e-6,
                        "{dt:?} rows of {cols}: value {i}: {a} against {want}"
                    );
                }
            }
        }
    }
    Ok(())
}
test_device!(
    silu_mul_matches_reference,
    silu_mul_matches_reference_cpu,
    silu_mul_matches_reference_cuda
);

/// A layer cache's appends on the device (on CUDA keydiff's `keydiff_append_rows`, which must
/// take them where keys and values are stored alike; on the CPU candle's ops) against the same
/// appends on the CPU, byte for byte: keys, values, positions and state of every used slot, for
/// float caches of each dtype (the values a transposed view, as the model passes them), a q8_0
/// cache and an fp8 one (encoded rows), and f16 keys beside q8_0 values (candle's ops on every
/// device), over a first chunk, a decode row and a chunk that fills the buffer. The layer is
/// the middle one of a model's cache, a view of the stacked buffers at an offset; its
/// neighbours' rows, appended first, must come out as they went in.
fn cache_appends_match_the_cpu(dev: &Device) -> Result<()> {
    use keydiff_cache::{KvCache, KvType, KvTypes};
    let (layers, kv, d, cap) = (3, 4, 64, 200);
    let f16_q8 = KvTypes {
        k: KvType::Float(DType::F16),
        v: KvType::Q8_0,
    };
    for kv_types in [
        KvType::Float(DType::F32).into(),
        KvType::Float(DType::F16).into(),
        KvType::Float(DType::BF16).into(),
        KvType::Q8_0.into(),
        KvType::Float(DType::F8E4M3).into(),
        f16_q8,
    ] {
        let dt = match kv_types.k {
            KvType::Float(dt) if dt != DType::F8E4M3 => dt,
            _ => DType::F32,
        };
        let alike = kv_types.k == kv_types.v;
        let new =
            |dev: &Device| KvCache::new(CacheConfig::full(64), layers, kv, d, cap, kv_types, dev);
        let (mut on_dev, mut on_cpu) = (new(dev)?, new(&Device::Cpu)?);
        let rows = |n: usize, seed: u64, dev: &Device| -> Result<Tensor> {
            Ok(Tensor::from_vec(seeded(kv * n * d, seed, 4.0), (kv, n, d), dev)?.to_dtype(dt)?)
        };
        // The neighbours' rows first: appends to layer 1 must leave them as they are.
        for l in [0, 2] {
            let (k, v) = (rows(50, 10 + l as u64, dev)?, rows(50, 20 + l as u64, dev)?);
            on_dev.layer_mut(l).append(&k, &v, 0)?;
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
            on_cpu.layer_mut(l).append(&cpu(&k)?, &cpu(&v)?, 0)?;
        }
        let mut pos = 0;
        for (i, chunk) in [128, 1, 71].into_iter().enumerate() {
            let k = rows(chunk, 2 * i as u64, dev)?;
            let v = Tensor::from_vec(
                seeded(chunk * kv * d, 2 * i as u64 + 1, 4.0),
                (chunk, kv, d),
                dev,
            )?
            .to_dtype(dt)?
            .transpose(0, 1)?;
            let layer = on_dev.layer_mut(1);
            layer.append(&k, &v, pos)?;
            ensure!(
                layer.appended_by_kernel() == (dev.is_cuda() && alike),
                "{kv_types}: chunk {i} appended by the kernel: {} on {dev:?} \
                 (KEYDIFF_CUDA_APPEND=0?)",
                layer.appended_by_kernel()
            );
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
            on_cpu.layer_mut(1).append(&cpu(&k)?, &cpu(&v)?, pos)?;
            pos += chunk + 5;
        }
        for l in 0..layers {
            let (a, b) = (on_dev.layer(l).parts()?, on_cpu.layer(l).parts()?);
            let bytes = |t: &Tensor| -> Result<Vec<u8>> {
                let t = t.to_device(&Device::Cpu)?.flatten_all()?;
                Ok(match t.dtype() {
                    DType::U8 => t.to_vec1::<u8>()?,
                    _ => t
                        .to_dtype(DType::F32)?
                        .to_vec1::<f32>()?
                        .iter()
                        .flat_map(|x| x.to_bits().to_le_bytes())
                        .collect(),
                })
            };
            ensure!(
                bytes(&a.keys)? == bytes(&b.keys)?,
                "{kv_types}: layer {l}: keys differ"
            );
            ensure!(
                bytes(&a.values)? == bytes(&b.values)?,
                "{kv_types}: layer {l}: values differ"
            );
            ensure!(
                a.positions.to_device(&Device::Cpu)?.to_vec2::<u32>()?
                    == b.positions.to_vec2::<u32>()?,
                "{kv_types}: layer {l}: positions differ"
            );
            ensure!(
                bytes(&a.state)? == bytes(&b.state)?,
                "{kv_types}: layer {l}: state differs"
            );
        }
    }
    Ok(())
}
test_device!(
    cache_appends_match_the_cpu,
    cache_appends_match_the_cpu_cpu,
    cache_appends_match_the_cpu_cuda
);

/// RoPE of a chunk's queries and keys as the device runs it (`Rope::apply_qk`: on CUDA
/// keydiff's `keydiff_rope_qk_*`, which must take them; on the CPU candle's `rope` on
/// contiguous copies) against candle's `rope` / `rope_i` on the CPU over the same values: bit
/// for bit in f16 and bf16 (both round each product and sum once), within an f32 rounding in
/// f32 (the GPU may fuse a product into the sum). Queries and keys as a fused projection gives
/// them (transposed views), Llama-3.2-3B's frequencies, one row and a chunk, both pairings.
fn rope_matches_the_cpu(dev: &Device) -> Result<()> {
    use keydiff_model::config::HfConfig;
    use keydiff_model::model::rope_qk_cuda;
    use keydiff_model::rope::Rope;
    let (hq, hk, d) = (24, 8, 128);
    for interleaved in [false, true] {
        let path = root().join("configs/llama-3.2-3b.json");
        let mut cfg = HfConfig::load(&path)?.to_model_config(&path)?;
        cfg.rope_interleaved = interleaved;
        let rope = Rope::new(&cfg, None);
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for rows in [1, 77] {
                let (cos, sin) = rope.cos_sin(3000, rows, dt, dev)?;
                let w = (hq + 2 * hk) * d;
                let fused = Tensor::from_vec(seeded(rows * w, rows as u64, 6.0), (rows, w), dev)?
                    .to_dtype(dt)?
                    .reshape((rows, hq + 2 * hk, d))?;
                let q = fused.narrow(1, 0, hq)?.transpose(0, 1)?;
                let k = fused.narrow(1, hq, hk)?.transpose(0, 1)?;
                if dev.is_cuda() {
                    ensure!(
                        rope_qk_cuda(&q, &k, &cos, &sin, interleaved)?.is_some(),
                        "the CUDA RoPE kernel declined {dt:?} (KEYDIFF_CUDA_ROPE=0?)"
                    );
                }
                let (gq, gk) = rope.apply_qk(&q, &k, &cos, &sin)?;
                let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
                let (cc, sc) = (cpu(&cos)?, cpu(&sin)?);
                // `Rope::apply`: candle's `rope` / `rope_i` on a contiguous copy.
                let reference = |x: &Tensor| -> Result<Tensor> {
                    Ok(rope.apply(&cpu(x)?.contiguous()?.unsqueeze(0)?, &cc, &sc)?)
                };
                let host = |t: &Tensor| -> Result<Vec<f32>> {
                    Ok(cpu(t)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?)
                };
                for (what, got, want) in [
                    ("queries", host(&gq)?, host(&reference(&q)?)?),
                    ("keys", host(&gk)?, host(&reference(&k)?.squeeze(0)?)?),
                ] {
                    ensure!(got.len() == want.len(), "{what}: {} values", got.len());
                    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
                        let ok = match dt {
                            DType::F32 => (a - b).abs() <= 2.4e-7 * b.abs().max(1.0),
                            _ => a.to_bits() == b.to_bits(),
                        };
                        ensure!(
                            ok,
                            "{dt:?} rows {rows} interleaved {interleaved}: {what} value {i}: \
                             {a} against {b}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
test_device!(
    rope_matches_the_cpu,
    rope_matches_the_cpu_cpu,
    rope_matches_the_cpu_cuda
);

/// A decode step's attention by the device's decode kernel (on CUDA keydiff's
/// `keydiff_decode_*`, which must take these inputs; on the CPU `decode_attention_cpu`) against
/// the eager path on the same device in f32 over the same (widened) cache: caches of f32, f16
/// and bf16, views with room past their rows, one split of the keys and several.
fn decode_attention_matches_eager(dev: &Device) -> Result<()> {
    use candle_core::Tensor;
    use keydiff_model::attention::{
        attention_output, attention_probs, decode_attention_cpu, decode_attention_cuda,
    };
    // (kv, g, d, t, rows held, first row of the view): a view may start past the buffer's
    // start (the kernels take its offset).
    for (kv, g, d, t, cap, at) in [
        (2, 4, 64, 40, 64, 0),
        (2, 3, 128, 300, 320, 7),
        (8, 4, 128, 3000, 3000, 0),
        (1, 8, 256, 700, 720, 5),
    ] {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let q = Tensor::randn(0f32, 1., (kv, g, d), dev)?;
            let kb = Tensor::randn(0f32, 2., (kv, cap, d), dev)?.to_dtype(dt)?;
            let vb = Tensor::randn(0f32, 1., (kv, cap, d), dev)?.to_dtype(dt)?;
            let (k, v) = (kb.narrow(1, at, t)?, vb.narrow(1, at, t)?);
            let y = if dev.is_cuda() {
                let q = q.to_dtype(dt)?;
                let y = decode_attention_cuda(&q, &k, &v)?;
                ensure!(
                    y.is_some(),
                    "the CUDA decode kernel declined {dt:?} rows of {d}"
                );
                y.unwrap().to_dtype(DType::F32)?
            } else {
                let y = decode_attention_cpu(&q, &k, &v, false)?;
                ensure!(
                    y.is_some(),
                    "the CPU decode kernel declined {dt:?} rows of {d}"
                );
                y.unwrap().0
            };
            // The reference from the query the kernel read (rounded to dt on CUDA).
            let q = if dev.is_cuda() {
                q.to_dtype(dt)?.to_dtype(DType::F32)?
            } else {
                q
            };
            let (kf, vf) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
            let want = attention_output(&attention_probs(&q, &kf, None, g)?, &vf)?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-3);
            let worst = (y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            // The output's rounding in dt (the CPU kernel writes f32), plus f32 sums.
            let tol = match (dev.is_cuda(), dt) {
                (true, DType::F16) => 1e-3,
                (true, DType::BF16) => 8e-3,
                _ => 1e-5,
            } * scale;
            ensure!(
                worst <= tol,
                "kv {kv} g {g} d {d} t {t} {dt:?}: max |Δ| {worst} against eager (scale {scale})"
            );
        }
    }
    Ok(())
}
test_device!(
    decode_attention_matches_eager,
    decode_attention_matches_eager_cpu,
    decode_attention_matches_eager_cuda
);

/// A decode step's attention by the device's decode kernels (on CUDA keydiff's
/// `keydiff_decode_<dtype>_<NE>` over a float cache in the queries' dtype, and
/// `keydiff_decode_kvq_*` reading blocks or fp8 rows in place, which must take them; on the CPU
/// `decode_attention_cpu` and `decode_attention_cpu_blocks`) against the eager path in f32 on
/// the CPU over the same values through the CPU codec (`kernel_check::decode_parity`, as
/// `keydiff check-kernels` runs it): float caches, every block type and fp8, encoded on the device,
/// views past the buffer's start, one split and several, head dims 64/128/256; on CUDA with
/// queries in f32, f16 and bf16.
fn decode_kernels_match_eager_on_the_cpu(dev: &Device) -> Result<()> {
    use keydiff::kernel_check::{decode_cases, decode_parity};
    for (i, c) in decode_cases(dev).into_iter().enumerate() {
        let r = decode_parity(dev, c, 70 + i as u64)?;
        ensure!(
            r.pass,
            "{} cache, q {} (kv {} g {} d {} keys {}): ran {}, max |Δ| {} against eager \
             (tolerance {})",
            r.kv_type,
            r.dtype,
            r.kv_heads,
            r.group,
            r.head_dim,
            r.keys,
            r.ran,
            r.max_abs,
            r.tolerance
        );
    }
    Ok(())
}
test_device!(
    decode_kernels_match_eager_on_the_cpu,
    decode_kernels_match_eager_on_the_cpu_cpu,
    decode_kernels_match_eager_on_the_cpu_cuda
);

/// Greedy sampling where the logits are (`argmax_rows`: on CUDA `keydiff_argmax_rows_*`, one
/// launch and 4 bytes a row back) against the host sampler's argmax over the same values
/// (`kernel_check::greedy_parity`, as `keydiff check-kernels` runs it): ties, NaNs, −∞ rows,
/// strided views, every float dtype, vocabularies to 151,936.
fn greedy_tokens_match_the_host(dev: &Device) -> Result<()> {
    use keydiff::kernel_check::{greedy_cases, greedy_parity};
    for (i, c) in greedy_cases().into_iter().enumerate() {
        let r = greedy_parity(dev, c, 40 + i as u64)?;
        ensure!(
            r.pass,
            "{c:?}: {} of {} rows differ",
            r.rows_differing,
            r.rows
        );
    }
    Ok(())
}
test_device!(
    greedy_tokens_match_the_host,
    greedy_tokens_match_the_host_cpu,
    greedy_tokens_match_the_host_cuda
);

/// Sampling where the logits are (`sample_rows`: on CUDA `keydiff_sample_rows_*`, one launch
/// and 4 bytes a row back) against the host sampler's draw over the same values
/// (`kernel_check::sample_parity`, as `keydiff check-kernels` runs it): temperature, top-k,
/// top-p and min-p settings, ties, NaNs, ±∞, rows without a finite logit, strided views, every
/// float dtype, vocabularies to 151,936. On the CPU `sample_rows` is the host's draw itself
/// (over the rows in place): there this checks the views and the no-draw flag only.
fn sampled_tokens_match_the_host(dev: &Device) -> Result<()> {
    use keydiff::kernel_check::{sample_cases, sample_parity};
    for (i, c) in sample_cases().into_iter().enumerate() {
        let r = sample_parity(dev, c, 60 + i as u64)?;
        ensure!(
            r.pass,
            "{c:?}: the device drew: {}; {} of {} rows differ, {} near a boundary",
            r.ran,
            r.rows_differing,
            r.rows,
            r.rows_near
        );
    }
    Ok(())
}
test_device!(
    sampled_tokens_match_the_host,
    sampled_tokens_match_the_host_cpu,
    sampled_tokens_match_the_host_cuda
);

/// The cache codecs on the device against the CPU's (`kernel_check::codec_parity`, as
/// `keydiff check-kernels` runs it): the same bytes from a strided view, the same values back,
/// and the same values read for attention in the activations' dtype (`KvType::decode_as`,
/// which `LayerCache::keys_as` takes: on CUDA `keydiff_kvq_dequantize_<dtype>` writes it
/// directly), for every block type and fp8 from f32, f16 and bf16.
fn cache_codecs_match_the_cpu(dev: &Device) -> Result<()> {
    use keydiff::kernel_check::{codec_cases, codec_parity};
    for (i, c) in codec_cases().into_iter().enumerate() {
        let r = codec_parity(dev, c, 90 + i as u64)?;
        ensure!(
            r.pass,
            "{} from {} (kv {} n {} d {}): {} of {} bytes differ, decoded values {} apart, {} \
             read in the dtype differ",
            r.kv_type,
            r.dtype,
            r.kv_heads,
            r.n,
            r.head_dim,
            r.bytes_differing,
            r.bytes,
            r.decoded_max_abs,
            r.decoded_as_differing
        );
    }
    Ok(())
}
test_device!(
    cache_codecs_match_the_cpu,
    cache_codecs_match_the_cpu_cpu,
    cache_codecs_match_the_cpu_cuda
);
