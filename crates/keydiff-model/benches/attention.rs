//! Chunk attention on the CPU: eager (materialised probabilities) against flash (candle-nn's
//! fused kernel), one layer's chunk of B = 128 queries over a cache of N + B slots read in place,
//! on the shapes of the models we test; and the statistics TOVA needs (the last query row), which
//! eager gets from its probabilities and flash from an extra pass. Then one decode step (one
//! query row per head): eager's candle matmuls against the decode kernel the model uses, on
//! f32, f16 and bf16 caches.
//!
//!     cargo bench -p keydiff-model --bench attention

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keydiff_model::attention::{
    attend, chunk_mask, decode_attention_cpu, flash_attend, stats_pass,
};

fn attention(c: &mut Criterion) {
    let mut grp = c.benchmark_group("chunk-attention");
    let dev = Device::Cpu;
    let b = 128;
    // (name, kv heads, group, head dim, slots N + B)
    for (name, kv, g, d, t) in [
        ("smollm2 N=2048", 3, 3, 64, 2048 + b),
        ("qwen0.5b N=2048", 2, 7, 64, 2048 + b),
        ("qwen0.5b N=6144", 2, 7, 64, 6144 + b),
    ] {
        // The cache buffer has B spare slots, as in keydiff-cache; attention reads a view.
        let kbuf = Tensor::randn(0f32, 1., (kv, t + b, d), &dev).unwrap();
        let vbuf = Tensor::randn(0f32, 1., (kv, t + b, d), &dev).unwrap();
        let (k, v) = (kbuf.narrow(1, 0, t).unwrap(), vbuf.narrow(1, 0, t).unwrap());
        // Queries as the model makes them: [1, heads, B, d].
        let q = Tensor::randn(0f32, 1., (1, kv * g, b, d), &dev).unwrap();
        let mask = chunk_mask(b, t, DType::F32, &dev).unwrap();
        let q_eager = q.reshape((kv, g * b, d)).unwrap();
        let q_flash = q.transpose(1, 2).unwrap();
        let view = |x: &Tensor| x.transpose(0, 1).unwrap().unsqueeze(0).unwrap();
        let (kf, vf) = (view(&k), view(&v));
        grp.bench_function(BenchmarkId::new("eager", name), |bch| {
            bch.iter(|| attend(&q_eager, &k, &v, Some(&mask), g, None).unwrap())
        });
        grp.bench_function(BenchmarkId::new("flash", name), |bch| {
            bch.iter(|| flash_attend(&q_flash, &kf, &vf).unwrap())
        });
        grp.bench_function(BenchmarkId::new("eager+tova-stats", name), |bch| {
            bch.iter(|| attend(&q_eager, &k, &v, Some(&mask), g, Some(1)).unwrap())
        });
        let q_groups = q.reshape((kv, g, b, d)).unwrap();
        grp.bench_function(BenchmarkId::new("flash+tova-stats", name), |bch| {
            bch.iter(|| {
                let y = flash_attend(&q_flash, &kf, &vf).unwrap();
                (y, stats_pass(&q_groups, &k, 1).unwrap())
            })
        });
    }
    grp.finish();
    let mut grp = c.benchmark_group("decode-attention");
    for (name, kv, g, d, t) in [
        ("smollm2 T=2048", 3, 3, 64, 2048),
        ("qwen0.5b T=2048", 2, 7, 64, 2048),
        ("llama3-8b T=8192", 8, 4, 128, 8192),
    ] {
        let kbuf = Tensor::randn(0f32, 1., (kv, t + b, d), &dev).unwrap();
        let vbuf = Tensor::randn(0f32, 1., (kv, t + b, d), &dev).unwrap();
        let (k, v) = (kbuf.narrow(1, 0, t).unwrap(), vbuf.narrow(1, 0, t).unwrap());
        let q = Tensor::randn(0f32, 1., (kv, g, d), &dev).unwrap();
        grp.bench_function(BenchmarkId::new("eager", name), |bch| {
            bch.iter(|| attend(&q, &k, &v, None, g, None).unwrap())
        });
        grp.bench_function(BenchmarkId::new("kernel", name), |bch| {
            bch.iter(|| decode_attention_cpu(&q, &k, &v, false).unwrap().unwrap())
        });
        grp.bench_function(BenchmarkId::new("kernel+probs", name), |bch| {
            bch.iter(|| decode_attention_cpu(&q, &k, &v, true).unwrap().unwrap())
        });
        // The same cache held in f16 and bf16 (`--kv-dtype`): half the bytes to read.
        for dt in [DType::F16, DType::BF16] {
            let (kh, vh) = (kbuf.to_dtype(dt).unwrap(), vbuf.to_dtype(dt).unwrap());
            let (kh, vh) = (kh.narrow(1, 0, t).unwrap(), vh.narrow(1, 0, t).unwrap());
            let id = BenchmarkId::new(format!("kernel {}-cache", dt.as_str()), name);
            grp.bench_function(id, |bch| {
                bch.iter(|| decode_attention_cpu(&q, &kh, &vh, false).unwrap().unwrap())
            });
        }
    }
    grp.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = attention
}
criterion_main!(benches);
