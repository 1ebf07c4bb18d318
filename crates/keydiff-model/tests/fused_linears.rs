//! Fused linears for decode rows (`Model::fuse_linears`: q/k/v, and a dense MLP's gate/up, as
//! one matmul each; on a GPU the loader fuses them): the same logits as the parts give, for
//! decode steps (with eviction), verified drafts (`forward_decode_rows`, exact) and batch steps,
//! on every architecture of the random presets; the same bytes counted; quantized weights
//! unfused.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use keydiff_cache::{Anchor, CacheConfig, KvCache, PolicyKind};
use keydiff_model::{load_random, CpuWeights, Model};

fn preset(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../configs/{name}.json"))
}

fn load(name: &str, weight_type: Option<candle_core::quantized::GgmlDType>) -> Model {
    load_random(
        &preset(name),
        &Device::Cpu,
        DType::F32,
        5,
        true,
        weight_type,
        CpuWeights::AS_STORED,
        None,
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
    .model
}

fn cache(m: &Model) -> KvCache {
    let cfg = CacheConfig {
        policy: PolicyKind::KeyDiff {
            anchor: Anchor::Normalized,
        },
        budget: Some(24),
        chunk: 8,
        window: 0.0,
        sinks: 0,
        evict_every: Some(4),
    };
    m.new_cache(cfg, 200).unwrap()
}

/// max |a − b| against max |a|: f32 sums of the same products, perhaps in another order.
fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0f32,
            |m, x| if x.is_nan() { f32::INFINITY } else { m.max(x) },
        );
    assert!(
        worst <= 1e-5 * scale.max(1.0),
        "{what}: max |Δ| {worst} (scale {scale})"
    );
}

#[test]
fn fused_linears_give_the_parts_logits() {
    for (name, groups_per_layer) in [
        ("tiny-llama", 2),
        // Biases on q/k/v.
        ("tiny-qwen", 2),
        // q/k RMSNorms.
        ("tiny-qwen3", 2),
        // Experts keep their own gate/up: q/k/v only.
        ("tiny-qwen3moe", 1),
    ] {
        let parts = load(name, None);
        let mut fused = parts.clone();
        let layers = fused.config().num_layers;
        assert_eq!(
            fused.fuse_linears().unwrap(),
            groups_per_layer * layers,
            "{name}"
        );
        assert_eq!(fused.fuse_linears().unwrap(), 0, "{name}: fused twice");
        // The views count what the parts held (that they share one storage is checked in
        // weights.rs's unit tests).
        assert_eq!(
            fused.weight_bytes(),
            parts.weight_bytes(),
            "{name}: bytes counted"
        );
        let vocab = parts.config().vocab_size as u32;
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let (mut ca, mut cb) = (cache(&parts), cache(&fused));
        // A prompt in chunks (the parts run both), then decode steps past the budget.
        for c in tokens[..16].chunks(8) {
            let a = parts.forward(c, &mut ca, false).unwrap();
            let b = fused.forward(c, &mut cb, false).unwrap();
            assert_close(&a, &b, &format!("{name}: prompt chunk"));
        }
        for (i, &t) in tokens[16..30].iter().enumerate() {
            let a = parts.forward(&[t], &mut ca, true).unwrap();
            let b = fused.forward(&[t], &mut cb, true).unwrap();
            assert_close(&a, &b, &format!("{name}: decode step {i}"));
        }
        assert_eq!(ca.len(), cb.len(), "{name}: caches of other lengths");
        // A verified draft: several decode rows, each exactly as alone. On the fused model,
        // the draft's rows bit for bit against the same tokens as single decode steps (a cache
        // brought to the same state by the same calls).
        let mut cs = cache(&fused);
        for c in tokens[..16].chunks(8) {
            fused.forward(c, &mut cs, false).unwrap();
        }
        for &t in &tokens[16..30] {
            fused.forward(&[t], &mut cs, true).unwrap();
        }
        let a = parts
            .forward_decode_rows(&tokens[30..34], &mut ca, true)
            .unwrap();
        let b = fused
            .forward_decode_rows(&tokens[30..34], &mut cb, true)
            .unwrap();
        assert_close(&a, &b, &format!("{name}: decode rows"));
        let rows = b.to_vec2::<f32>().unwrap();
        assert_eq!(rows.len(), 4, "{name}: a row of logits per draft token");
        for (i, &t) in tokens[30..34].iter().enumerate() {
            let one = fused
                .forward(&[t], &mut cs, true)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(
                one == rows[i],
                "{name}: draft row {i} differs from its decode step"
            );
        }
        // A batch step of two sequences.
        let (mut c2a, mut c2b) = (cache(&parts), cache(&fused));
        parts.forward(&tokens[..8], &mut c2a, false).unwrap();
        fused.forward(&tokens[..8], &mut c2b, false).unwrap();
        let a = parts
            .forward_batch(&tokens[34..36], &mut [&mut ca, &mut c2a])
            .unwrap();
        let b = fused
            .forward_batch(&tokens[34..36], &mut [&mut cb, &mut c2b])
            .unwrap();
        assert_close(&a, &b, &format!("{name}: batch step"));
    }
}

/// Quantized weights are not fused: there is nothing to view rows of.
#[test]
fn quantized_weights_are_not_fused() {
    let mut m = load("tiny-llama", Some(candle_core::quantized::GgmlDType::Q8_0));
    assert_eq!(m.fuse_linears().unwrap(), 0);
}
