//! Each policy's scores against a naive implementation of its definition (POLICIES.md).
#![allow(clippy::needless_range_loop)] // index loops mirror the definitions they check

use candle_core::{DType, Device, Tensor};
use keydiff_cache::policy::{build, keydiff_scores};
use keydiff_cache::{Anchor, AttnStats, LayerCache, PolicyKind};

const KV: usize = 2;
const G: usize = 3;
const D: usize = 16;

fn layer_with(n: usize, seed: u64) -> (LayerCache, Vec<Vec<Vec<f64>>>) {
    let dev = Device::Cpu;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..KV * n * D)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let k = Tensor::from_vec(data, (KV, n, D), &dev).unwrap();
    let mut l = LayerCache::new(KV, D, n + 4, DType::F32, &dev).unwrap();
    l.append(&k, &k, 0).unwrap();
    let kf = k.to_vec3::<f32>().unwrap();
    let k64 = kf
        .iter()
        .map(|h| {
            h.iter()
                .map(|r| r.iter().map(|&x| x as f64).collect())
                .collect()
        })
        .collect();
    (l, k64)
}

fn cos(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// KeyDiff's anchor form ranks slots exactly as the O(n²) pairwise definition
/// s_i = −Σ_j cos(k_i, k_j), computed here in f64.
#[test]
fn keydiff_ranking_matches_pairwise_definition() {
    for (n, seed) in [(37, 1), (200, 2), (1000, 3)] {
        let (l, k) = layer_with(n, seed);
        let fast = keydiff_scores(&l.keys().unwrap(), Anchor::Normalized)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for h in 0..KV {
            let pair: Vec<f64> = (0..n)
                .map(|i| -(0..n).map(|j| cos(&k[h][i], &k[h][j])).sum::<f64>())
                .collect();
            // Same order for every pair whose exact scores are not within float noise.
            let scale = pair.iter().map(|x| x.abs()).fold(0.0, f64::max);
            for i in 0..n {
                for j in 0..n {
                    if pair[i] - pair[j] > 1e-4 * scale {
                        assert!(
                            fast[h][i] > fast[h][j],
                            "n={n} head {h}: slots {i},{j} ordered differently"
                        );
                    }
                }
            }
        }
    }
}

/// The `mean` anchor is the cosine with the plain mean key.
#[test]
fn keydiff_mean_anchor_matches_definition() {
    let (l, k) = layer_with(50, 9);
    let fast = keydiff_scores(&l.keys().unwrap(), Anchor::Mean)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for h in 0..KV {
        let mu: Vec<f64> = (0..D)
            .map(|c| k[h].iter().map(|r| r[c]).sum::<f64>() / 50.0)
            .collect();
        for i in 0..50 {
            let want = -cos(&k[h][i], &mu);
            assert!((fast[h][i] as f64 - want).abs() < 1e-5);
        }
    }
}

/// A full attention matrix `[KV, G, B, T]` of random probabilities (rows sum to one).
fn probs(b: usize, t: usize, seed: u64) -> Vec<Vec<Vec<Vec<f64>>>> {
    let mut x = seed | 1;
    (0..KV)
        .map(|_| {
            (0..G)
                .map(|_| {
                    (0..b)
                        .map(|_| {
                            let raw: Vec<f64> = (0..t)
                                .map(|_| {
                                    x ^= x << 13;
                                    x ^= x >> 7;
                                    x ^= x << 17;
                                    (x % 997) as f64 + 1.0
                                })
                                .collect();
                            let s: f64 = raw.iter().sum();
                            raw.into_iter().map(|r| r / s).collect()
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// Sums the last `r` rows per query head into the `AttnStats` the model hands to policies.
fn stats_of(p: &[Vec<Vec<Vec<f64>>>], r: usize) -> AttnStats {
    let (b, t) = (p[0][0].len(), p[0][0][0].len());
    let mut v = Vec::new();
    for kv in p {
        for g in kv {
            for s in 0..t {
                v.push((b - r..b).map(|q| g[q][s]).sum::<f64>() as f32);
            }
        }
    }
    AttnStats {
        sums: Tensor::from_vec(v, (KV, G, t), &Device::Cpu).unwrap(),
        rows: r,
    }
}

fn close(a: &[f32], b: &[f64]) {
    for (x, y) in a.iter().zip(b) {
        assert!((*x as f64 - y).abs() < 1e-5, "{x} vs {y}");
    }
}

#[test]
fn tova_is_last_row_mean_over_all_query_heads() {
    let (b, t) = (6, 20);
    let (l, _) = layer_with(t, 4);
    let p = probs(b, t, 5);
    for per_head in [false, true] {
        let mut pol = build(&PolicyKind::Tova { per_head });
        let s = pol.score(&l, Some(&stats_of(&p, 1))).unwrap();
        for h in 0..KV {
            let want: Vec<f64> = (0..t)
                .map(|i| {
                    let heads: Vec<usize> = if per_head { vec![h] } else { (0..KV).collect() };
                    let tot: f64 = heads
                        .iter()
                        .flat_map(|&kv| (0..G).map(move |g| (kv, g)))
                        .map(|(kv, g)| p[kv][g][b - 1][i])
                        .sum();
                    tot / (heads.len() * G) as f64
                })
                .collect();
            close(&s[h], &want);
        }
    }
}

#[test]
fn snapkv_is_pooled_window_sum_mean_over_group() {
    let (b, t, w) = (10, 30, 4);
    let (l, _) = layer_with(t, 6);
    let p = probs(b, t, 7);
    let mut pol = build(&PolicyKind::SnapKv { window: w });
    let s = pol.score(&l, Some(&stats_of(&p, w))).unwrap();
    for h in 0..KV {
        let summed: Vec<f64> = (0..t)
            .map(|i| {
                (0..G)
                    .map(|g| (b - w..b).map(|q| p[h][g][q][i]).sum::<f64>())
                    .sum::<f64>()
                    / G as f64
            })
            .collect();
        // avg_pool1d(kernel 5, stride 1, padding 2, count_include_pad)
        let want: Vec<f64> = (0..t)
            .map(|i| {
                (i as i64 - 2..=i as i64 + 2)
                    .filter(|&j| j >= 0 && (j as usize) < t)
                    .map(|j| summed[j as usize])
                    .sum::<f64>()
                    / 5.0
            })
            .collect();
        close(&s[h], &want);
    }
}

#[test]
fn h2o_accumulates_every_query_row() {
    let (b, t) = (5, 12);
    let (mut l, _) = layer_with(t, 8);
    let mut pol = build(&PolicyKind::H2o { normalized: false });
    let p1 = probs(b, t, 9);
    let p2 = probs(b, t, 10);
    pol.observe(&mut l, &stats_of(&p1, b)).unwrap();
    pol.observe(&mut l, &stats_of(&p2, b)).unwrap();
    let s = pol.score(&l, None).unwrap();
    for h in 0..KV {
        let want: Vec<f64> = (0..t)
            .map(|i| {
                [&p1, &p2]
                    .iter()
                    .map(|p| {
                        (0..G)
                            .map(|g| (0..b).map(|q| p[h][g][q][i]).sum::<f64>())
                            .sum::<f64>()
                    })
                    .sum()
            })
            .collect();
        close(&s[h], &want);
    }
    // Normalised: divided by the number of queries that could see the slot.
    let mut pol = build(&PolicyKind::H2o { normalized: true });
    let (mut l2, _) = layer_with(t, 8);
    pol.observe(&mut l2, &stats_of(&p1, b)).unwrap();
    let s = pol.score(&l2, None).unwrap();
    let raw: f64 = (0..G)
        .map(|g| (0..b).map(|q| p1[0][g][q][0]).sum::<f64>())
        .sum();
    assert!((s[0][0] as f64 - raw / t as f64).abs() < 1e-5);
}

#[test]
fn knorm_and_sink_scores() {
    let (l, k) = layer_with(10, 11);
    let s = build(&PolicyKind::Knorm).score(&l, None).unwrap();
    let n0: f64 = k[0][3].iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((s[0][3] as f64 + n0).abs() < 1e-5);
    let s = build(&PolicyKind::Sink).score(&l, None).unwrap();
    assert_eq!(s[1][7], 7.0);
}

/// The fused CPU op (the CUDA kernel's twin) equals the candle-ops reference, for both anchors,
/// every float dtype, on a strided view of a larger buffer (as the cache hands it over).
#[test]
fn fused_scores_equal_reference() {
    use candle_core::{DType, Device, Tensor};
    use keydiff_cache::policy::keydiff_scores_fused;
    let dev = Device::Cpu;
    for (n, d) in [(1usize, 64usize), (37, 64), (300, 128), (1029, 256)] {
        let buf = Tensor::randn(0f32, 1.0, (3, n + 5, d), &dev).unwrap();
        let view = buf.narrow(1, 2, n).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let keys = view.to_dtype(dtype).unwrap();
            let keys = if dtype == DType::F32 {
                view.clone()
            } else {
                keys
            };
            for anchor in [Anchor::Normalized, Anchor::Mean] {
                let want = keydiff_scores(&keys, anchor)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                let got = keydiff_scores_fused(&keys, anchor)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                for (w, g) in want.iter().flatten().zip(got.iter().flatten()) {
                    assert!(
                        (w - g).abs() < 2e-5,
                        "n={n} d={d} {dtype:?} {anchor:?}: {w} vs {g}"
                    );
                }
            }
        }
    }
}
