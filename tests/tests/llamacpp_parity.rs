//! Parity with llama.cpp on the real GGUF models: token ids, top-1, top-10 logits, and greedy
//! continuations, against fixtures recorded by scripts/gen-fixtures.py (llama-cpp-python),
//! also under RoPE scaling (YaRN and linear) given as llama.cpp's parameters.

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use keydiff::{
    CpuWeights, Engine, EngineConfig, GenerateParams, Message, ModelSource, Prompt, RopeOverride,
};
use keydiff_tests::{
    fixture, model, temp_dir, write_tiny_qwen3, write_tiny_qwen3_moe, QWEN, SMOLLM2, TINY_MOE,
};
use std::path::Path;

/// Largest accepted |logit − llama.cpp logit| over the reference top-10.
///
/// Both engines multiply the same quantized weights, but sum in a different order. With
/// quantized prefill both also round activations to Q8 blocks; a rounding that lands on the
/// other side of a step moves a value by 1/127 of its block, and over 24–30 layers that moves
/// logits of magnitude ~10–30 by up to a few tenths (measured: ≤ 0.45). With dense prefill
/// (the CPU default) activations stay f32, which differs from llama.cpp by the same order.
/// 0.75 is ~3% of the logit range.
const TOP10_TOL: f32 = 0.75;

/// With dense prefill, llama.cpp's own top-2 may be closer than our numeric difference; the top-1
/// is then a coin toss between two engines and is only required where llama.cpp's gap between
/// its first and second logit exceeds this.
const NEAR_TIE: f32 = 0.25;

/// Greedy tokens that must match llama.cpp exactly (the issue asks for at least 8).
const GREEDY_EXACT: usize = 8;

/// `dense_prefill = false` is llama.cpp's own numerics (Q8 activations): everything must match.
/// `dense_prefill = true` (the CPU default) keeps prefill activations in f32: ids, top-10
/// within tolerance, and top-1 wherever llama.cpp's top-1 is not a near-tie. Its greedy
/// continuation is reported, not required: every decode step is another chance for a
/// near-tie of a 135M Q4_1 model to fall the other way (measured: SmolLM2 `long` differs at
/// step 5, where llama.cpp itself picks between two continuations of a numbered list).
///
/// `kv_dtype` is the cache's: f32 (our CPU default) or f16. The fixtures were recorded under
/// llama.cpp's default f16 cache, but an f16 cache here is not llama.cpp's f16 numerics: its
/// CPU matmuls against an f16 cache also round the queries and the probabilities to f16, and
/// ours keep them in f32. So with an f16 cache it is held to the same as dense prefill
/// (measured: SmolLM2 `digits`, a near-tie, takes the other top-1).
fn check(name: &str, path: &str, dense_prefill: bool, kv_dtype: DType) {
    check_rope(name, path, dense_prefill, kv_dtype, RopeOverride::default());
}

fn check_rope(name: &str, path: &str, dense_prefill: bool, kv_dtype: DType, rope: RopeOverride) {
    check_within(name, &model(path), dense_prefill, kv_dtype, rope, TOP10_TOL);
}

/// [`check_rope`] on the GGUF at `path`, with `tol` as the top-10 logit tolerance (also the
/// greedy gap below which a step may fall either way).
fn check_within(
    name: &str,
    path: &Path,
    dense_prefill: bool,
    kv_dtype: DType,
    rope: RopeOverride,
    tol: f32,
) {
    check_gaps(name, path, dense_prefill, kv_dtype, rope, tol, tol);
}

/// [`check_within`], with greedy steps whose llama.cpp gap is under `gap_tol` (rather than
/// `tol`) allowed to fall either way.
fn check_gaps(
    name: &str,
    path: &Path,
    dense_prefill: bool,
    kv_dtype: DType,
    rope: RopeOverride,
    tol: f32,
    gap_tol: f32,
) {
    let fx = fixture(name);
    // Everything must match only under llama.cpp's own activation numerics.
    let exact = !dense_prefill && kv_dtype == DType::F32;
    let cfg = EngineConfig {
        cpu_weights: if dense_prefill {
            CpuWeights::FAST
        } else {
            CpuWeights::AS_STORED
        },
        kv_dtype: Some(kv_dtype.into()),
        rope,
        ..Default::default()
    };
    let engine = Engine::load(&ModelSource::Gguf(path.to_path_buf()), &cfg).unwrap();
    let mut report = Vec::new();
    for p in &fx.prompts {
        let ids = match &p.messages {
            Some(m) => {
                let msgs: Vec<Message> = m
                    .iter()
                    .map(|v| {
                        Message::new(v["role"].as_str().unwrap(), v["content"].as_str().unwrap())
                    })
                    .collect();
                let rendered = engine.render_chat(&msgs).unwrap();
                assert_eq!(
                    rendered, p.text,
                    "{name}/{}: chat template rendering",
                    p.name
                );
                engine.prompt_tokens(&Prompt::Chat(msgs)).unwrap()
            }
            None => engine.tokenize(&p.text, p.special).unwrap(),
        };
        assert_eq!(ids, p.tokens, "{name}/{}: token ids", p.name);

        let logits = engine.prefill_logits(&p.tokens, 128).unwrap();
        let top1 = keydiff::parity::compare_logits(&logits, &logits).reference_top1;
        let gap = p.top_logits[0].1 - p.top_logits[1].1;
        let strict = exact || gap > NEAR_TIE;
        if strict {
            assert_eq!(top1, p.top_logits[0].0, "{name}/{}: top-1", p.name);
        }
        let worst = p
            .top_logits
            .iter()
            .map(|&(id, l)| (logits[id as usize] - l).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= tol,
            "{name}/{}: top-10 logit error {worst} > {tol}",
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
        // Where llama.cpp's own gaps are known, a step whose two best logits are closer than
        // the logit tolerance may fall either way: free-running, the continuation must match
        // up to the first such step, and every step beyond it whose gap is wider is checked
        // on llama.cpp's own continuation (teacher-forced, through prompt logprobs).
        let mut required = GREEDY_EXACT.min(p.greedy.len());
        if let Some(gaps) = &p.greedy_gaps {
            let close = gaps.iter().position(|&g| g < gap_tol);
            required = required.min(close.unwrap_or(gaps.len()));
            let mut forced = p.tokens.clone();
            forced.extend(&p.greedy);
            let params = GenerateParams {
                prompt: Prompt::Tokens(forced),
                max_tokens: 1,
                prompt_logprobs: Some(1),
                ..Default::default()
            };
            let rows = engine
                .generate(&params, |_| {})
                .unwrap()
                .prompt_logprobs
                .unwrap();
            let n = p.tokens.len();
            let mut checked = 0;
            for (k, (&want, &gap)) in p.greedy.iter().zip(gaps).enumerate() {
                if gap >= gap_tol {
                    let ours = rows[n + k - 1].top[0].0;
                    assert_eq!(
                        ours, want,
                        "{name}/{}: greedy step {k} on llama.cpp's continuation (its gap {gap})",
                        p.name
                    );
                    checked += 1;
                }
            }
            report.push(format!(
                "{}: {checked}/{} steps with a gap over {gap_tol} agree on llama.cpp's \
                 continuation",
                p.name,
                p.greedy.len()
            ));
        }
        assert!(
            !exact || same >= required,
            "{name}/{}: greedy continuation diverges at token {same}: ours {:?} llama.cpp {:?}",
            p.name,
            out.tokens,
            p.greedy
        );
        report.push(format!(
            "{}: top10 max err {worst:.4}, top-1 {}, greedy {same}/{} identical{}",
            p.name,
            if top1 == p.top_logits[0].0 {
                "same"
            } else {
                "differs"
            },
            p.greedy.len(),
            if strict {
                ""
            } else {
                " (near-tie: top-1 not required)"
            }
        ));
    }
    let mode = if dense_prefill {
        "dense prefill"
    } else {
        "quantized prefill"
    };
    eprintln!(
        "{name} vs llama.cpp, {mode}, {} cache:\n  {}",
        kv_dtype.as_str(),
        report.join("\n  ")
    );
}

#[test]
fn smollm2_quantized_matches_llamacpp() {
    check("smollm2", SMOLLM2, false, DType::F32);
}

#[test]
fn smollm2_quantized_f16_cache_matches_llamacpp() {
    check("smollm2", SMOLLM2, false, DType::F16);
}

#[test]
fn smollm2_dense_prefill_matches_llamacpp() {
    check("smollm2", SMOLLM2, true, DType::F32);
}

#[test]
fn qwen_quantized_matches_llamacpp() {
    check("qwen", QWEN, false, DType::F32);
}

#[test]
fn qwen_quantized_f16_cache_matches_llamacpp() {
    check("qwen", QWEN, false, DType::F16);
}

#[test]
fn qwen_dense_prefill_matches_llamacpp() {
    check("qwen", QWEN, true, DType::F32);
}

/// The fixture's llama.cpp RoPE parameters as keydiff's override (its `--rope-*` flags).
fn rope_of(name: &str) -> RopeOverride {
    let flags = fixture(name).rope_flags.expect("a RoPE fixture");
    RopeOverride {
        scaling: Some(flags["rope_scaling"].as_str().unwrap().parse().unwrap()),
        factor: flags["rope_scale"].as_f64(),
        original_context: flags["yarn_orig_ctx"].as_u64().map(|n| n as usize),
        ..Default::default()
    }
}

/// `engine`'s largest |logit − llama.cpp logit| over the top-10 of every prompt of fixture
/// `name`, after a prefill.
fn worst_top10_error(engine: &Engine, name: &str) -> f32 {
    fixture(name)
        .prompts
        .iter()
        .map(|p| {
            let logits = engine.prefill_logits(&p.tokens, 128).unwrap();
            p.top_logits
                .iter()
                .map(|&(id, l)| (logits[id as usize] - l).abs())
                .fold(0f32, f32::max)
        })
        .fold(0f32, f32::max)
}

/// The scaled fixture tells scaled from unscaled: the model run without the scaling misses
/// its top-10 logits by more than the tolerance, so that matching it needs the scaling
/// computed as llama.cpp computes it.
fn fixture_needs_the_scaling(name: &str, path: &str) {
    let cfg = EngineConfig {
        cpu_weights: CpuWeights::AS_STORED,
        ..Default::default()
    };
    let engine = Engine::load(&ModelSource::Gguf(model(path)), &cfg).unwrap();
    let worst = worst_top10_error(&engine, name);
    eprintln!("{name} without the scaling: top-10 logit error {worst}");
    assert!(
        worst > TOP10_TOL,
        "{name}: unscaled, the error is {worst} only"
    );
}

#[test]
fn qwen_yarn_matches_llamacpp() {
    fixture_needs_the_scaling("qwen-yarn", QWEN);
    check_rope("qwen-yarn", QWEN, false, DType::F32, rope_of("qwen-yarn"));
}

#[test]
fn smollm2_yarn_matches_llamacpp() {
    fixture_needs_the_scaling("smollm2-yarn", SMOLLM2);
    check_rope(
        "smollm2-yarn",
        SMOLLM2,
        false,
        DType::F32,
        rope_of("smollm2-yarn"),
    );
}

#[test]
fn smollm2_linear_matches_llamacpp() {
    fixture_needs_the_scaling("smollm2-linear", SMOLLM2);
    check_rope(
        "smollm2-linear",
        SMOLLM2,
        false,
        DType::F32,
        rope_of("smollm2-linear"),
    );
}

/// Qwen 3 against llama.cpp on a tiny random model in f32 (`write_tiny_qwen3`: Qwen 3's
/// shapes in small, with the real tokenizer), so that the two engines differ by summation
/// order only and the tolerance can be tight: the per-head q/k RMSNorm before RoPE, a head
/// size that is not hidden / heads, and NeoX RoPE at base 1e6, over six prompts and their
/// greedy continuations.
#[test]
fn tiny_qwen3_matches_llamacpp() {
    const TOL: f32 = 2e-3;
    let dir = temp_dir("tiny-qwen3");
    let path = dir.join("tiny-qwen3.gguf");
    write_tiny_qwen3(&path, false).unwrap();
    for (dense, kv) in [(false, DType::F32), (true, DType::F32)] {
        check_within("tiny-qwen3", &path, dense, kv, RopeOverride::default(), TOL);
    }
    // The fixture depends on the q/k norms: the same model with unit norm weights misses it.
    let unit = dir.join("tiny-qwen3-unit-norms.gguf");
    write_tiny_qwen3(&unit, true).unwrap();
    let engine = Engine::load(&ModelSource::Gguf(unit), &EngineConfig::default()).unwrap();
    let worst = worst_top10_error(&engine, "tiny-qwen3");
    eprintln!("tiny-qwen3 with unit q/k norm weights: top-10 logit error {worst}");
    assert!(worst > 100.0 * TOL, "unit q/k norms miss by {worst} only");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Qwen 3 MoE against llama.cpp on a tiny random model (`write_tiny_qwen3_moe`: the tiny
/// Qwen 3 with a mixture of 8 SwiGLU experts, 2 per token, in each layer), over six prompts
/// and their greedy continuations: the router's softmax, top-2 choice and renormalised
/// weights, and the experts split from GGUF's stacked `[experts, out, in]` tensors. With f32
/// experts the engines differ by summation order only. With Q8_0 experts both quantize the
/// activations to Q8_0 for the experts' dot products (llama.cpp's and candle's CPU kernels):
/// the prompts' last logits still agree within the tight tolerance, but a decode step may
/// differ by a few hundredths (measured: 0.02 to 0.06 on two steps of one prompt, where each
/// engine gives the same logits evaluating the step in a batch or alone), the size of a
/// lightly weighted expert choice that the rounding tips over. Steps whose llama.cpp gap is
/// under 0.1 may therefore fall either way there.
#[test]
fn tiny_qwen3_moe_matches_llamacpp() {
    const TOL: f32 = 2e-3;
    let dir = temp_dir("tiny-qwen3moe");
    let path = dir.join("tiny-qwen3moe.gguf");
    write_tiny_qwen3_moe(&path, GgmlDType::F32).unwrap();
    for dense in [false, true] {
        check_within(
            "tiny-qwen3moe",
            &path,
            dense,
            DType::F32,
            RopeOverride::default(),
            TOL,
        );
    }
    let q8 = dir.join("tiny-qwen3moe-q8_0.gguf");
    write_tiny_qwen3_moe(&q8, GgmlDType::Q8_0).unwrap();
    check_gaps(
        "tiny-qwen3moe-q8_0",
        &q8,
        false,
        DType::F32,
        RopeOverride::default(),
        TOL,
        0.1,
    );
    // The fixture depends on the routing: the same weights running one expert per token, or
    // all eight, miss it.
    let (experts, used, _) = TINY_MOE;
    for k in [1, experts] {
        assert_ne!(k, used);
        let other = dir.join(format!("tiny-qwen3moe-k{k}.gguf"));
        with_experts_used(&path, &other, k);
        let engine = Engine::load(&ModelSource::Gguf(other), &EngineConfig::default()).unwrap();
        let worst = worst_top10_error(&engine, "tiny-qwen3moe");
        eprintln!("tiny-qwen3moe with {k} experts per token: top-10 logit error {worst}");
        assert!(
            worst > 100.0 * TOL,
            "{k} experts per token miss by {worst} only"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Copies a `qwen3moe` GGUF with `expert_used_count` set to `k`.
fn with_experts_used(from: &Path, to: &Path, k: usize) {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::QTensor;
    let (mut md, ts) = keydiff_tests::read_gguf(from).unwrap();
    for (key, v) in md.iter_mut() {
        if key == "qwen3moe.expert_used_count" {
            *v = Value::U32(k as u32);
        }
    }
    let mut out = std::fs::File::create(to).unwrap();
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md, &ts).unwrap();
}
