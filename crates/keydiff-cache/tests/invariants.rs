//! Property tests of the cache invariants under every policy, with synthetic keys and
//! attention statistics.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use keydiff_cache::{AttnStats, CacheConfig, KvCache, KvType, PolicyKind};
use proptest::prelude::*;

const KV: usize = 3;
const G: usize = 2;
const D: usize = 8;

/// Key/value row of (head, position): a unique, reproducible pattern with a random part.
fn row(h: usize, p: usize, salt: u64) -> Vec<f32> {
    let mut x = (h as u64 * 1_000_003 + p as u64 * 7919) ^ salt;
    (0..D)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if i == 0 {
                (h * 100_000 + p) as f32
            } else {
                ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            }
        })
        .collect()
}

fn chunk_tensor(pos0: usize, len: usize, salt: u64) -> Tensor {
    let data: Vec<f32> = (0..KV)
        .flat_map(|h| (pos0..pos0 + len).flat_map(move |p| row(h, p, salt)))
        .collect();
    Tensor::from_vec(data, (KV, len, D), &Device::Cpu).unwrap()
}

fn policies() -> impl Strategy<Value = PolicyKind> {
    prop_oneof![
        Just(PolicyKind::parse("keydiff", 4, 0).unwrap()),
        Just(PolicyKind::parse("keydiff-mean", 4, 0).unwrap()),
        Just(PolicyKind::parse("tova", 4, 0).unwrap()),
        Just(PolicyKind::parse("tova-per-head", 4, 0).unwrap()),
        Just(PolicyKind::parse("snapkv", 4, 0).unwrap()),
        Just(PolicyKind::parse("h2o", 4, 0).unwrap()),
        Just(PolicyKind::parse("h2o-normalized", 4, 0).unwrap()),
        Just(PolicyKind::parse("sink", 4, 0).unwrap()),
        Just(PolicyKind::parse("knorm", 4, 0).unwrap()),
        (0u64..100).prop_map(|seed| PolicyKind::Random { seed }),
    ]
}

/// Random normalised attention statistics `[KV, G, T]` summed over `rows` rows.
fn stats(t: usize, rows: usize, salt: u64) -> AttnStats {
    let mut x = salt | 1;
    let mut v = Vec::with_capacity(KV * G * t);
    for _ in 0..KV * G {
        let raw: Vec<f32> = (0..t)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 1000) as f32 + 1.0
            })
            .collect();
        let s: f32 = raw.iter().sum();
        v.extend(raw.iter().map(|r| r / s * rows as f32));
    }
    AttnStats {
        sums: Tensor::from_vec(v, (KV, G, t), &Device::Cpu).unwrap(),
        rows,
    }
}

/// Drives one layer through chunks then decode steps, checking every invariant on the way.
fn drive(
    cfg: CacheConfig,
    chunks: &[usize],
    decode: usize,
    salt: u64,
) -> Result<(), TestCaseError> {
    let budget = cfg.budget.unwrap();
    let sinks = cfg.protected_sinks();
    let recent = cfg.protected_recent(budget);
    let total = chunks.iter().sum::<usize>() + decode;
    let cap = (budget + cfg.chunk.max(cfg.evict_every())).min(total);
    let mut cache = KvCache::new(cfg.clone(), 1, KV, D, total, DType::F32, &Device::Cpu).unwrap();
    prop_assert_eq!(cache.capacity(), cap);
    let steps: Vec<(usize, bool)> = chunks
        .iter()
        .map(|&c| (c, false))
        .chain(std::iter::repeat_n((1, true), decode))
        .collect();
    for (step, (len, is_decode)) in steps.into_iter().enumerate() {
        let pos0 = cache.position();
        let t = chunk_tensor(pos0, len, salt);
        cache
            .layer_mut(0)
            .append(&t, &(&t * 2.0).unwrap(), pos0)
            .unwrap();
        let n = cache.layer(0).len();
        prop_assert!(n <= cap, "{n} slots > N+B = {cap}");
        let rows = cache.stats_rows(0, len, is_decode);
        let st = rows.map(|r| stats(n, r, salt ^ step as u64));
        cache.after_attention(0, st.as_ref(), is_decode).unwrap();
        cache.advance(len);
        let seen = cache.position();
        let l = cache.layer(0);
        let due = if is_decode {
            n >= budget + cfg.evict_every()
        } else {
            n > budget
        };
        prop_assert_eq!(l.len(), if due { budget } else { n });
        prop_assert!(l.len() <= budget.max(n.min(cap)));
        let keys = l.keys().unwrap().to_vec3::<f32>().unwrap();
        let vals = l.values().unwrap().to_vec3::<f32>().unwrap();
        for h in 0..KV {
            let pos = l.positions(h).unwrap();
            let mut uniq = pos.to_vec();
            uniq.sort_unstable();
            uniq.dedup();
            prop_assert_eq!(uniq.len(), pos.len(), "duplicate positions in head {}", h);
            let present: HashMap<u32, usize> =
                pos.iter().enumerate().map(|(i, &p)| (p, i)).collect();
            for s in 0..sinks.min(seen) {
                prop_assert!(present.contains_key(&(s as u32)), "sink {} evicted", s);
            }
            for p in seen.saturating_sub(recent.min(l.len()))..seen {
                prop_assert!(
                    present.contains_key(&(p as u32)),
                    "recent {} evicted (recent {})",
                    p,
                    recent
                );
            }
            for (i, &p) in pos.iter().enumerate() {
                let want = row(h, p as usize, salt);
                prop_assert_eq!(&keys[h][i], &want, "K of head {} pos {} corrupted", h, p);
                let want_v: Vec<f32> = want.iter().map(|x| x * 2.0).collect();
                prop_assert_eq!(&vals[h][i], &want_v);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn invariants_hold(
        policy in policies(),
        budget in 8usize..40,
        chunk_frac in 1usize..=4,
        window in 0.0f64..0.3,
        sinks in 0usize..3,
        k_frac in 1usize..=4,
        chunks in prop::collection::vec(1usize..=1000, 1..8),
        decode in 0usize..40,
        salt in any::<u64>(),
    ) {
        let chunk = (budget * chunk_frac / 4).max(1);
        let evict_every = (chunk * k_frac / 4).max(1);
        let cfg = CacheConfig {
            policy,
            budget: Some(budget),
            chunk,
            window,
            sinks,
            evict_every: Some(evict_every),
        };
        prop_assume!(cfg.validate().is_ok());
        let chunks: Vec<usize> = chunks.iter().map(|c| 1 + c % chunk).collect();
        drive(cfg, &chunks, decode, salt)?;
    }
}

/// One step of a layer-0 cache: appends `len` tokens, runs the policy (evicting when due)
/// with statistics drawn from `salt`, advances.
fn step(cache: &mut KvCache, len: usize, decode: bool, salt: u64) {
    let pos0 = cache.position();
    let t = chunk_tensor(pos0, len, salt);
    cache
        .layer_mut(0)
        .append(&t, &(&t * 2.0).unwrap(), pos0)
        .unwrap();
    let n = cache.layer(0).len();
    let st = cache
        .stats_rows(0, len, decode)
        .map(|r| stats(n, r, salt ^ pos0 as u64));
    cache.after_attention(0, st.as_ref(), decode).unwrap();
    cache.advance(len);
}

/// K, V, positions per head, policy state, position and evictions of layer 0.
type Snapshot = (Vec<f32>, Vec<f32>, Vec<Vec<u32>>, Vec<f32>, usize, usize);

/// Everything a cache's future depends on, as host values.
fn snapshot(c: &KvCache) -> Snapshot {
    let l = c.layer(0);
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (
        flat(l.keys().unwrap()),
        flat(l.values().unwrap()),
        (0..KV).map(|h| l.positions(h).unwrap()).collect(),
        flat(l.state_tensor().unwrap()),
        c.position(),
        c.counters().evictions,
    )
}

/// A one-layer cache under `policy` and `budget` (B = 8, K = 4, one sink) with room for
/// `chunks` chunks and `decode` steps, after its chunks were prefilled; `None` when the
/// settings are invalid.
fn prefilled(
    policy: PolicyKind,
    budget: usize,
    chunks: usize,
    decode: usize,
    salt: u64,
) -> Option<KvCache> {
    let cfg = CacheConfig {
        policy,
        budget: Some(budget),
        chunk: 8,
        window: 0.0,
        sinks: 1,
        evict_every: Some(4),
    };
    cfg.validate().ok()?;
    let total = chunks * 8 + decode;
    let mut a = KvCache::new(cfg, 1, KV, D, total, DType::F32, &Device::Cpu).unwrap();
    for _ in 0..chunks {
        step(&mut a, 8, false, salt);
    }
    Some(a)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// `KvCache::fork` after a prefill that evicted: the fork and the original, fed the same
    /// decode steps, stay equal (slots, positions, policy state and generator, counters);
    /// feeding the fork other tokens leaves the original as it was.
    #[test]
    fn a_forked_cache_goes_on_as_the_original(
        policy in policies(),
        budget in 8usize..24,
        chunks in 2usize..6,
        decode in 1usize..30,
        salt in any::<u64>(),
    ) {
        let a = prefilled(policy, budget, chunks, decode, salt);
        prop_assume!(a.is_some());
        let mut a = a.unwrap();
        let before = snapshot(&a);
        let mut b = a.fork().unwrap();
        prop_assert_eq!(&snapshot(&b), &before);
        prop_assert_eq!(b.capacity(), a.capacity());
        // Other tokens at the same position, in a fork only, leave the original as it was.
        let mut c = a.fork().unwrap();
        step(&mut c, 1, true, !salt);
        prop_assert_eq!(snapshot(&a), before);
        for _ in 0..decode {
            step(&mut a, 1, true, salt);
            step(&mut b, 1, true, salt);
        }
        prop_assert_eq!(snapshot(&a), snapshot(&b));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// `KvCache::parts` then `KvCache::from_parts` (a saved cache loaded again), after a prefill
    /// that evicted or not: the copy holds the same slots, positions, state and counters, and
    /// fed the same decode steps it stays equal to the original (the policy's generator
    /// included). Taken through the host and back in another capacity, as a file is.
    #[test]
    fn a_cache_made_from_its_parts_goes_on_as_the_original(
        policy in policies(),
        budget in 8usize..24,
        chunks in 1usize..6,
        decode in 1usize..30,
        salt in any::<u64>(),
    ) {
        let a = prefilled(policy, budget, chunks, decode, salt);
        prop_assume!(a.is_some());
        let mut a = a.unwrap();
        let mut parts = a.parts().unwrap();
        for l in &mut parts.layers {
            // As a file stores them: contiguous host copies of the used slots.
            for t in [&mut l.keys, &mut l.values, &mut l.positions, &mut l.state] {
                *t = t.copy().unwrap();
            }
        }
        let mut b = KvCache::from_parts(&parts, a.capacity() + 3, &Device::Cpu).unwrap();
        prop_assert_eq!(snapshot(&b), snapshot(&a));
        prop_assert_eq!(b.counters(), a.counters());
        prop_assert_eq!(b.config(), a.config());
        prop_assert_eq!(b.can_truncate(), a.can_truncate());
        for _ in 0..decode {
            step(&mut a, 1, true, salt);
            step(&mut b, 1, true, salt);
        }
        prop_assert_eq!(snapshot(&a), snapshot(&b));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A speculative draft taken back: after a token (which may evict), the draft's tokens
    /// (at most `KvCache::draft_room`, so none evicts) are decoded, and the `rejected` last of
    /// them forgotten with `KvCache::rewind`. The cache is then the one that decoded only the
    /// kept tokens (slots, positions, state, counters), and goes on alike. A policy that
    /// accumulates attention from every token (H2O) refuses to rewind.
    #[test]
    fn a_rewound_draft_leaves_the_cache_that_decoded_only_the_kept_tokens(
        policy in policies(),
        budget in 8usize..24,
        chunks in 1usize..5,
        before in 0usize..12,
        draft in 1usize..10,
        rejected in 0usize..10,
        salt in any::<u64>(),
    ) {
        let a = prefilled(policy, budget, chunks, before + 1 + draft + 8, salt);
        prop_assume!(a.is_some());
        let mut a = a.unwrap();
        for _ in 0..before {
            step(&mut a, 1, true, salt);
        }
        let draft = draft.min(a.draft_room());
        let rejected = rejected.min(draft);
        let mut b = a.fork().unwrap();
        step(&mut a, 1, true, salt);
        let evicted = a.counters().evictions;
        for _ in 0..draft {
            step(&mut a, 1, true, salt);
        }
        prop_assert_eq!(a.counters().evictions, evicted, "a draft within the room evicted");
        if a.unrewindable().is_some() {
            prop_assert!(a.rewind(rejected.max(1)).is_err());
            return Ok(());
        }
        a.rewind(rejected).unwrap();
        for _ in 0..1 + draft - rejected {
            step(&mut b, 1, true, salt);
        }
        prop_assert_eq!(snapshot(&a), snapshot(&b));
        prop_assert_eq!(a.layer(0).next_position(), b.layer(0).next_position());
        let slots = |c: &KvCache| c.counters().evicted_slots;
        prop_assert_eq!(slots(&a), slots(&b));
        for _ in 0..8 {
            step(&mut a, 1, true, !salt);
            step(&mut b, 1, true, !salt);
        }
        prop_assert_eq!(snapshot(&a), snapshot(&b));
    }
}

/// `KvCache::rewind` forgets only tokens appended since the cache last evicted (or copied its
/// slots), and `draft_room` stops a draft before the decode step that evicts: at N + K slots.
#[test]
fn only_tokens_appended_since_the_last_eviction_can_be_taken_back() {
    let mut a = prefilled(PolicyKind::parse("keydiff", 4, 0).unwrap(), 12, 3, 40, 5).unwrap();
    // 24 tokens prefilled into N = 12: evicted back to 12; nothing appended since.
    assert_eq!((a.len(), a.counters().evictions), (12, 2));
    let err = a.rewind(1).unwrap_err().to_string();
    assert!(err.contains("since the cache last evicted"), "{err}");
    // K = 4: decode evicts when the cache reaches 16 slots. The next token makes 13, and a
    // draft of 2 more stays below 16.
    assert_eq!(a.draft_room(), 2);
    step(&mut a, 1, true, 5);
    step(&mut a, 1, true, 5);
    assert_eq!(a.draft_room(), 0);
    a.rewind(2).unwrap();
    assert_eq!((a.len(), a.position()), (12, 24));
    // The token that makes 16 evicts back to 12, so a draft after it may take 13 to 15.
    for _ in 0..3 {
        step(&mut a, 1, true, 5);
    }
    assert_eq!(a.len(), 15);
    assert_eq!(a.draft_room(), 3);
    step(&mut a, 1, true, 5);
    assert_eq!((a.len(), a.counters().evictions), (12, 3));
    assert!(a.rewind(1).is_err());
    let mut full =
        KvCache::new(CacheConfig::full(8), 1, KV, D, 10, DType::F32, &Device::Cpu).unwrap();
    step(&mut full, 6, false, 1);
    // A full cache: room for what its buffers hold after the next token.
    assert_eq!(full.draft_room(), 3);
    full.rewind(6).unwrap();
    assert_eq!((full.len(), full.position()), (0, 0));
    assert!(full.rewind(1).is_err());
}

/// Parts that could not come from a cache are refused, each naming what is wrong.
#[test]
fn inconsistent_parts_are_refused() {
    let cfg = CacheConfig {
        policy: PolicyKind::Random { seed: 3 },
        budget: Some(16),
        chunk: 8,
        window: 0.0,
        sinks: 0,
        evict_every: None,
    };
    let mut a = KvCache::new(cfg.clone(), 1, KV, D, 64, DType::F32, &Device::Cpu).unwrap();
    step(&mut a, 8, false, 1);
    let good = a.parts().unwrap();
    let refused = |p: &keydiff_cache::KvCacheParts, cap: usize| {
        KvCache::from_parts(p, cap, &Device::Cpu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(KvCache::from_parts(&good, 24, &Device::Cpu).is_ok());
    assert!(
        refused(&good, 7).contains("capacity 7"),
        "{}",
        refused(&good, 7)
    );
    // A cache that never evicted holds positions 0..len in order.
    let mut p = good.clone();
    let pos: Vec<u32> = (0..KV as u32 * 8).map(|i| (i % 8 + 1) % 8).collect();
    p.layers[0].positions = Tensor::from_vec(pos, (KV, 8), &Device::Cpu).unwrap();
    assert!(refused(&p, 24).contains("in order"), "{}", refused(&p, 24));
    // One that evicted may hold any positions, each once, below the next.
    p.counters.evictions = 1;
    p.position = 20;
    p.layers[0].next_position = 20;
    assert!(KvCache::from_parts(&p, 24, &Device::Cpu).is_ok());
    let twice: Vec<u32> = (0..KV as u32 * 8).map(|i| i % 8 / 2).collect();
    p.layers[0].positions = Tensor::from_vec(twice, (KV, 8), &Device::Cpu).unwrap();
    assert!(refused(&p, 24).contains("twice"), "{}", refused(&p, 24));
    let past: Vec<u32> = (0..KV as u32 * 8).map(|i| i % 8 + 13).collect();
    p.layers[0].positions = Tensor::from_vec(past, (KV, 8), &Device::Cpu).unwrap();
    assert!(
        refused(&p, 24).contains("past the next position"),
        "{}",
        refused(&p, 24)
    );
    // Shapes and dtypes.
    let mut p = good.clone();
    p.layers[0].values = p.layers[0].values.narrow(1, 0, 4).unwrap();
    assert!(refused(&p, 24).contains("values"), "{}", refused(&p, 24));
    let mut p = good.clone();
    p.layers[0].state = p.layers[0].state.to_dtype(DType::F16).unwrap();
    assert!(refused(&p, 24).contains("state"), "{}", refused(&p, 24));
    let mut p = good.clone();
    p.position = 9;
    assert!(
        refused(&p, 24).contains("one slot per token"),
        "{}",
        refused(&p, 24)
    );
    // The random policy's generator is one word.
    let mut p = good.clone();
    p.policy_state = vec![];
    assert!(refused(&p, 24).contains("one word"), "{}", refused(&p, 24));
    let mut p = good;
    p.config.budget = Some(4);
    assert!(refused(&p, 24).contains("budget 4"), "{}", refused(&p, 24));
}

/// Heads are independent: changing head 1's keys never changes head 0's survivors (KeyDiff).
#[test]
fn heads_are_independent() {
    let cfg = CacheConfig {
        policy: PolicyKind::parse("keydiff", 4, 0).unwrap(),
        budget: Some(16),
        chunk: 8,
        window: 0.0,
        sinks: 0,
        evict_every: None,
    };
    let survivors = |perturb: bool| -> Vec<u32> {
        let mut c = KvCache::new(cfg.clone(), 1, KV, D, 48, DType::F32, &Device::Cpu).unwrap();
        for _ in 0..6 {
            let p0 = c.position();
            let mut t = chunk_tensor(p0, 8, 42);
            if perturb {
                let h1 = (t.narrow(0, 1, 1).unwrap().sqr().unwrap() * 3.0).unwrap();
                t = Tensor::cat(
                    &[t.narrow(0, 0, 1).unwrap(), h1, t.narrow(0, 2, 1).unwrap()],
                    0,
                )
                .unwrap();
            }
            c.layer_mut(0).append(&t, &t, p0).unwrap();
            c.after_attention(0, None, false).unwrap();
            c.advance(8);
        }
        let mut p = c.layer(0).positions(0).unwrap();
        p.sort_unstable();
        p
    };
    assert_eq!(survivors(false), survivors(true));
}

/// A budget beyond what the request will see never binds: the cache allocates the request
/// (prompt + output), not N + B, and runs it without evicting.
#[test]
fn a_budget_beyond_the_request_allocates_only_the_request() {
    let cfg = CacheConfig {
        policy: PolicyKind::parse("keydiff", 4, 0).unwrap(),
        budget: Some(100_000),
        chunk: 8,
        window: 0.0,
        sinks: 0,
        evict_every: None,
    };
    let mut c = KvCache::new(cfg.clone(), 2, KV, D, 20, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.capacity(), 20);
    for len in [8, 8, 4] {
        let p0 = c.position();
        let t = chunk_tensor(p0, len, 7);
        for l in 0..2 {
            c.layer_mut(l).append(&t, &t, p0).unwrap();
        }
        c.advance(len);
    }
    assert_eq!(c.len(), 20);
    // Within the budget, N + B is still the bound.
    let small = CacheConfig {
        budget: Some(16),
        ..cfg
    };
    let c = KvCache::new(small, 1, KV, D, 1000, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.capacity(), 24);
}

/// `KvCache::grown`: a full cache that a conversation outgrows keeps every slot, position and
/// counter in a larger buffer; a budgeted cache, or a smaller capacity, is refused.
#[test]
fn a_full_cache_grows_without_losing_slots() {
    let mut c = KvCache::new(CacheConfig::full(4), 2, KV, D, 10, DType::F32, &Device::Cpu).unwrap();
    for l in 0..2 {
        let k = chunk_tensor(0, 7, l as u64);
        let v = chunk_tensor(0, 7, 100 + l as u64);
        c.layer_mut(l).append(&k, &v, 0).unwrap();
    }
    c.advance(7);
    let g = c.grown(32).unwrap();
    assert_eq!((g.capacity(), g.len(), g.position()), (32, 7, 7));
    for l in 0..2 {
        let (a, b) = (c.layer(l), g.layer(l));
        let same = |x: Tensor, y: Tensor| {
            assert_eq!(
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            )
        };
        same(a.keys().unwrap(), b.keys().unwrap());
        same(a.values().unwrap(), b.values().unwrap());
        for h in 0..KV {
            assert_eq!(a.positions(h).unwrap(), b.positions(h).unwrap());
        }
    }
    assert!(c.grown(6).is_err(), "shrinking below the slots held");
    let budgeted = CacheConfig {
        policy: PolicyKind::parse("keydiff", 4, 0).unwrap(),
        budget: Some(8),
        ..CacheConfig::full(4)
    };
    let b = KvCache::new(budgeted, 1, KV, D, 100, DType::F32, &Device::Cpu).unwrap();
    assert!(b.grown(64).is_err(), "a budgeted cache grew");
}

/// `KvCache::truncate`: a cache that never evicted is cut back to its first tokens (slots,
/// positions and the position follow, and appending goes on from there); cutting beyond what
/// it holds, an H2O cache (whose sums include later tokens) are refused.
#[test]
fn a_cache_that_never_evicted_is_cut_back_to_a_prefix() {
    let mut c = KvCache::new(CacheConfig::full(4), 2, KV, D, 16, DType::F32, &Device::Cpu).unwrap();
    for l in 0..2 {
        let k = chunk_tensor(0, 7, l as u64);
        let v = chunk_tensor(0, 7, 100 + l as u64);
        c.layer_mut(l).append(&k, &v, 0).unwrap();
    }
    c.advance(7);
    let before = c.layer(1).keys().unwrap();
    assert!(c.can_truncate());
    assert!(c.truncate(8).is_err(), "cut beyond the slots held");
    c.truncate(4).unwrap();
    assert_eq!((c.len(), c.position()), (4, 4));
    let kept = c.layer(1).keys().unwrap();
    assert_eq!(
        kept.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        before
            .narrow(1, 0, 4)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    );
    for h in 0..KV {
        assert_eq!(c.layer(0).positions(h).unwrap(), vec![0, 1, 2, 3]);
    }
    // Appending goes on at position 4, in slot 4.
    let k = chunk_tensor(4, 2, 7);
    c.layer_mut(0).append(&k, &k, 4).unwrap();
    assert_eq!(c.layer(0).positions(0).unwrap(), vec![0, 1, 2, 3, 4, 5]);

    let h2o = CacheConfig {
        policy: PolicyKind::parse("h2o", 4, 0).unwrap(),
        budget: Some(8),
        ..CacheConfig::full(4)
    };
    let mut h = KvCache::new(h2o, 1, KV, D, 100, DType::F32, &Device::Cpu).unwrap();
    assert!(!h.can_truncate());
    let e = h.truncate(0).unwrap_err().to_string();
    assert!(e.contains("accumulates attention"), "{e}");
}

/// `KvCache::resume_from_prefix`: a fresh cache gets a copy of another's first whole chunks
/// (K, V, positions; the position follows) and goes on from there, while the source keeps all
/// it held; a prefix that is not whole chunks, longer than the source, or beyond the budget,
/// a source that evicted, and a cut of an H2O cache are refused.
#[test]
fn a_fresh_cache_copies_a_prefix_of_another() {
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut src =
        KvCache::new(CacheConfig::full(4), 2, KV, D, 16, DType::F32, &Device::Cpu).unwrap();
    for l in 0..2 {
        let k = chunk_tensor(0, 11, l as u64);
        let v = chunk_tensor(0, 11, 100 + l as u64);
        src.layer_mut(l).append(&k, &v, 0).unwrap();
    }
    src.advance(11);
    let fresh =
        || KvCache::new(CacheConfig::full(4), 2, KV, D, 16, DType::F32, &Device::Cpu).unwrap();
    let mut c = fresh();
    c.resume_from_prefix(&src, 8).unwrap();
    assert_eq!((c.len(), c.position()), (8, 8));
    assert_eq!((src.len(), src.position()), (11, 11), "the source changed");
    for l in 0..2 {
        let (a, b) = (c.layer(l), src.layer(l));
        assert_eq!(
            flat(a.keys().unwrap()),
            flat(b.keys().unwrap().narrow(1, 0, 8).unwrap())
        );
        assert_eq!(
            flat(a.values().unwrap()),
            flat(b.values().unwrap().narrow(1, 0, 8).unwrap())
        );
        for h in 0..KV {
            assert_eq!(a.positions(h).unwrap(), (0..8).collect::<Vec<_>>());
        }
    }
    // It goes on at position 8, in slot 8; the source's slot 8 is untouched.
    let k = chunk_tensor(8, 2, 9);
    c.layer_mut(0).append(&k, &k, 8).unwrap();
    assert_eq!(
        c.layer(0).positions(1).unwrap(),
        (0..10).collect::<Vec<_>>()
    );
    assert_ne!(
        flat(c.layer(0).keys().unwrap().narrow(1, 8, 1).unwrap()),
        flat(src.layer(0).keys().unwrap().narrow(1, 8, 1).unwrap())
    );
    // Nothing of it: an empty, fresh cache.
    let mut none = fresh();
    none.resume_from_prefix(&src, 0).unwrap();
    assert_eq!((none.len(), none.position()), (0, 0));

    for (len, why) in [
        (6, "chunk boundary"),
        (12, "cannot take 12 tokens from a cache of 11"),
    ] {
        let e = fresh()
            .resume_from_prefix(&src, len)
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{len}: {e}");
    }
    let budgeted = CacheConfig {
        policy: PolicyKind::parse("keydiff", 4, 0).unwrap(),
        budget: Some(4),
        ..CacheConfig::full(4)
    };
    let mut b = KvCache::new(budgeted, 2, KV, D, 16, DType::F32, &Device::Cpu).unwrap();
    let e = b.resume_from_prefix(&src, 8).unwrap_err().to_string();
    assert!(e.contains("longer than the budget 4"), "{e}");

    let h2o = CacheConfig {
        policy: PolicyKind::parse("h2o", 4, 0).unwrap(),
        budget: Some(8),
        ..CacheConfig::full(4)
    };
    let mut h = KvCache::new(h2o.clone(), 1, KV, D, 16, DType::F32, &Device::Cpu).unwrap();
    let t = chunk_tensor(0, 8, 3);
    h.layer_mut(0).append(&t, &t, 0).unwrap();
    h.advance(8);
    let mut into = KvCache::new(h2o, 1, KV, D, 16, DType::F32, &Device::Cpu).unwrap();
    let e = into.resume_from_prefix(&h, 4).unwrap_err().to_string();
    assert!(e.contains("accumulates attention"), "{e}");
    // All of it, as `resume_from`: the slots and the policy state.
    into.resume_from_prefix(&h, 8).unwrap();
    assert_eq!((into.len(), into.position()), (8, 8));
    let (a, b) = (into.layer(0), h.layer(0));
    assert_eq!(flat(a.keys().unwrap()), flat(b.keys().unwrap()));
    assert_eq!(
        flat(a.state_tensor().unwrap()),
        flat(b.state_tensor().unwrap())
    );
}

/// Rows of 64 values for the Q8_0 tests: a spread of magnitudes, with an outlier column as
/// real keys have.
fn wide_chunk(pos0: usize, len: usize, salt: u64) -> Tensor {
    let mut x = salt | 1;
    let data: Vec<f32> = (0..KV * len * 64)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let (p, c) = (pos0 + (i / 64) % len, i % 64);
            match c {
                0 => 40.0 + p as f32 * 0.01,
                _ => u * [0.01, 0.3, 3.0][c % 3],
            }
        })
        .collect();
    Tensor::from_vec(data, (KV, len, 64), &Device::Cpu).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// A quantized cache (every block type) is an f32 cache of its rounded values: fed the
    /// same chunks (the f32 one their round trip through the blocks), under every policy and
    /// the same statistics, it keeps the same slots, and its keys and values read back as the
    /// f32 cache's, bit for bit.
    #[test]
    fn a_quantized_cache_is_an_f32_cache_of_its_rounded_values(
        kind in proptest::sample::select(KvType::BLOCKS.to_vec()),
        policy in policies(),
        chunks in proptest::collection::vec(1usize..=8, 1..8),
        salt in 0u64..1000,
    ) {
        let cfg = CacheConfig {
            policy,
            budget: Some(12),
            ..CacheConfig::full(8)
        };
        let total: usize = chunks.iter().sum();
        let new = |kv: KvType| {
            KvCache::new(cfg.clone(), 1, KV, 64, total, kv, &Device::Cpu).unwrap()
        };
        let (mut q, mut f) = (new(kind), new(DType::F32.into()));
        let rounded = |t: &Tensor| {
            let blocks = keydiff_cache::quantize_blocks(t, kind).unwrap();
            keydiff_cache::dequantize_blocks(&blocks, kind, 64).unwrap()
        };
        for (i, &len) in chunks.iter().enumerate() {
            let pos0 = q.position();
            let (k, v) = (wide_chunk(pos0, len, salt + i as u64), wide_chunk(pos0, len, !salt));
            q.layer_mut(0).append(&k, &v, pos0).unwrap();
            f.layer_mut(0).append(&rounded(&k), &rounded(&v), pos0).unwrap();
            let n = q.layer(0).len();
            let st = q.stats_rows(0, len, false).map(|r| stats(n, r, salt ^ i as u64));
            q.after_attention(0, st.as_ref(), false).unwrap();
            f.after_attention(0, st.as_ref(), false).unwrap();
            q.advance(len);
            f.advance(len);
            let (a, b) = (q.layer(0), f.layer(0));
            prop_assert_eq!(a.len(), b.len());
            for h in 0..KV {
                prop_assert_eq!(a.positions(h).unwrap(), b.positions(h).unwrap());
            }
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            prop_assert_eq!(flat(a.keys().unwrap()), flat(b.keys().unwrap()));
            prop_assert_eq!(flat(a.values().unwrap()), flat(b.values().unwrap()));
            prop_assert_eq!(a.bytes() * 128, b.bytes() * kind.block_bytes().unwrap());
        }
    }
}

/// Appends a chunk (or decode token) to every layer of `c`, each layer its own keys, and runs
/// `after_attention` layer by layer with statistics of its own, as a model's forward does.
/// Returns each layer's length right after its own `after_attention`.
fn step_layers(c: &mut KvCache, len: usize, decode: bool, salt: u64) -> Vec<usize> {
    let pos0 = c.position();
    let mut after = Vec::new();
    for l in 0..c.num_layers() {
        let salt = salt ^ (l as u64).wrapping_mul(0x9e37_79b9);
        let t = chunk_tensor(pos0, len, salt);
        c.layer_mut(l)
            .append(&t, &(&t * 2.0).unwrap(), pos0)
            .unwrap();
        let n = c.layer(l).len();
        let st = c
            .stats_rows(l, len, decode)
            .map(|r| stats(n, r, salt ^ pos0 as u64));
        c.after_attention(l, st.as_ref(), decode).unwrap();
        after.push(c.layer(l).len());
    }
    c.advance(len);
    after
}

/// K, V, positions and state of one layer, as host values.
type LayerSnapshot = (Vec<f32>, Vec<f32>, Vec<u32>, Vec<f32>);

/// Every layer's K, V, positions and state, as host values.
fn layer_snapshots(c: &KvCache) -> Vec<LayerSnapshot> {
    let flat = |t: Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    (0..c.num_layers())
        .map(|l| {
            let l = c.layer(l);
            (
                flat(l.keys().unwrap()),
                flat(l.values().unwrap()),
                l.positions_tensor()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<u32>()
                    .unwrap(),
                flat(l.state_tensor().unwrap()),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Evicting every layer at once after the last layer's attention (the default) keeps
    /// exactly what evicting each layer after its own attention keeps:
    /// the same slots, positions, keys, values and state in every layer, the same counters,
    /// in every float dtype, over prefill chunks and decode steps, under every policy (those
    /// that score every layer at once and those that score each after its attention). A layer
    /// before the last is still full right after its own attention.
    #[test]
    fn layers_evicted_together_keep_what_each_alone_keeps(
        policy in policies(),
        dtype in proptest::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        layers in 1usize..4,
        budget in 8usize..24,
        chunks in 1usize..6,
        decode in 0usize..12,
        salt in any::<u64>(),
    ) {
        let cfg = CacheConfig {
            policy: policy.clone(),
            budget: Some(budget),
            chunk: 8,
            window: 0.0,
            sinks: 1,
            evict_every: Some(4),
        };
        prop_assume!(cfg.validate().is_ok());
        let total = chunks * 8 + decode;
        let new = || KvCache::new(cfg.clone(), layers, KV, D, total, dtype, &Device::Cpu).unwrap();
        let (mut together, mut alone) = (new(), new());
        alone.set_evict_per_layer(true);
        let steps = std::iter::repeat_n((8, false), chunks).chain(std::iter::repeat_n((1, true), decode));
        for (i, (len, decode)) in steps.enumerate() {
            let salt = salt ^ i as u64;
            let before = together.len() + len;
            let t = step_layers(&mut together, len, decode, salt);
            let a = step_layers(&mut alone, len, decode, salt);
            prop_assert_eq!(layer_snapshots(&together), layer_snapshots(&alone));
            let counts = |c: &KvCache| (c.counters().evictions, c.counters().evicted_slots);
            prop_assert_eq!(counts(&together), counts(&alone));
            prop_assert_eq!(t[layers - 1], a[layers - 1]);
            if a[0] < before && layers > 1 {
                // Deferred to the last layer's call.
                prop_assert_eq!(t[0], before);
            } else {
                prop_assert_eq!(&t, &a);
            }
        }
    }
}

/// KeyDiff scores every layer at once on float caches only (fp8 and block types would be
/// widened or dequantized for all layers at once). The layers evict together, and a layer
/// that is no longer a view of the cache's buffers (replaced from outside) turns that off:
/// each layer then evicts after its own attention, and keeps what it would have.
#[test]
fn layers_evict_together_only_while_they_are_views_of_one_buffer() {
    let cfg = CacheConfig {
        policy: PolicyKind::parse("keydiff", 4, 0).unwrap(),
        budget: Some(8),
        chunk: 8,
        window: 0.0,
        sinks: 0,
        evict_every: None,
    };
    assert!(keydiff_cache::policy::build(&cfg.policy)
        .scores_layers_together(KvType::Float(DType::BF16).into()));
    for kv in [KvType::Q8_0, KvType::Float(DType::F8E4M3)] {
        assert!(!keydiff_cache::policy::build(&cfg.policy).scores_layers_together(kv.into()));
    }
    let new = || KvCache::new(cfg.clone(), 2, KV, D, 32, DType::F32, &Device::Cpu).unwrap();
    let mut c = new();
    step_layers(&mut c, 8, false, 1);
    assert_eq!(step_layers(&mut c, 8, false, 2), vec![16, 8]);
    let mut alone = new();
    alone.set_evict_per_layer(true);
    step_layers(&mut alone, 8, false, 1);
    assert_eq!(step_layers(&mut alone, 8, false, 2), vec![8, 8]);
    assert_eq!(layer_snapshots(&c), layer_snapshots(&alone));
    // Layer 1 replaced by a layer of another cache: no longer a view of `c`'s buffers.
    let other = new();
    let mut d = new();
    *d.layer_mut(1) = other.layer(1).clone();
    step_layers(&mut d, 8, false, 1);
    assert_eq!(step_layers(&mut d, 8, false, 2), vec![8, 8]);
    assert_eq!(layer_snapshots(&d), layer_snapshots(&alone));
}

/// TOVA and SnapKV score from the statistics of the pass that evicts: the others take none
/// (a prompt chunk within the budget, decode steps before N + K). H2O sums every pass's.
#[test]
fn statistics_only_where_the_policy_reads_them() {
    let (budget, chunk, every) = (8, 4, 3);
    for (policy, every_pass) in [
        (PolicyKind::Tova { per_head: false }, false),
        (PolicyKind::SnapKv { window: 2 }, false),
        (PolicyKind::H2o { normalized: false }, true),
    ] {
        let cfg = CacheConfig {
            policy: policy.clone(),
            budget: Some(budget),
            evict_every: Some(every),
            ..CacheConfig::full(chunk)
        };
        let mut cache = KvCache::new(cfg, 1, KV, D, 64, DType::F32, &Device::Cpu).unwrap();
        // Three prompt chunks (4, 8, then 12 > N), then decode steps.
        let steps = [(chunk, false); 3].into_iter().chain([(1, true); 8]);
        let mut evicted_at = vec![];
        for (step, (len, decode)) in steps.enumerate() {
            let pos0 = cache.position();
            let t = chunk_tensor(pos0, len, 5);
            cache.layer_mut(0).append(&t, &t, pos0).unwrap();
            let n = cache.layer(0).len();
            let due = if decode {
                n >= budget + every
            } else {
                n > budget
            };
            let rows = cache.stats_rows(0, len, decode);
            let want = (every_pass || due).then_some(match policy {
                PolicyKind::Tova { .. } => 1,
                PolicyKind::SnapKv { window } => window.min(len),
                _ => len,
            });
            assert_eq!(rows, want, "{policy:?} step {step}: {n} slots");
            let st = rows.map(|r| stats(n, r, step as u64));
            cache.after_attention(0, st.as_ref(), decode).unwrap();
            cache.advance(len);
            if cache.layer(0).len() < n {
                evicted_at.push(step);
            }
        }
        // The third chunk (12 slots) evicts to 8; decode then evicts at 8 + 3 = 11 slots.
        assert_eq!(evicted_at, [2, 5, 8], "{policy:?}");
    }
}
