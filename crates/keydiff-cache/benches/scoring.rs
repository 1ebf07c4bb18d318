//! KeyDiff scoring on the CPU: the candle-ops reference against the fused op, on the cache
//! shapes of the models we test (one layer's keys after a chunk: N + B slots).
//!
//!     cargo bench -p keydiff-cache --bench scoring

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keydiff_cache::policy::{keydiff_scores, keydiff_scores_fused};
use keydiff_cache::Anchor;

fn scoring(c: &mut Criterion) {
    let mut g = c.benchmark_group("keydiff-scores");
    // (name, kv heads, slots N + B, head dim)
    for (name, kv, n, d) in [
        ("smollm2 N=2048 B=64", 3, 2112, 64),
        ("qwen0.5b N=2048 B=128", 2, 2176, 64),
        ("llama8b N=8192 B=128", 8, 8320, 128),
    ] {
        let buf = Tensor::randn(0f32, 1.0, (kv, n + 64, d), &Device::Cpu).unwrap();
        let keys = buf.narrow(1, 0, n).unwrap();
        g.throughput(Throughput::Bytes(
            (kv * n * d * DType::F32.size_in_bytes()) as u64,
        ));
        g.bench_with_input(BenchmarkId::new("candle-ops", name), &keys, |b, k| {
            b.iter(|| keydiff_scores(k, Anchor::Normalized).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("fused", name), &keys, |b, k| {
            b.iter(|| keydiff_scores_fused(k, Anchor::Normalized).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = scoring
}
criterion_main!(benches);
