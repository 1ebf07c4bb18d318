//! The CUDA kernels of `kernels/keydiff.cu`, run on the CPU under the emulation of the CUDA
//! execution model (`keydiff-kernels`, feature `emulate`), against their CPU twins here:
//! `KeyDiffOp` and the candle-ops reference for scoring, `select_radix` / `select` and
//! `move_plan` for selection, sequential row copies for the moves, `PoolByPosition` for SnapKV.
//!
//! These run on every machine and check the kernels' logic with the launch geometry the GPU
//! gets, under several thread schedules. They do not replace the GPU run
//! (`scripts/gpu-check.sh`): compiler, hardware and timing are not emulated.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use keydiff_cache::policy::{keydiff_scores, keydiff_scores_fused, PoolByPosition};
use keydiff_cache::select::{move_plan, select, select_radix, SelectBlocks};
use keydiff_cache::{Anchor, KvType};
use keydiff_kernels::emu::{self, AppendBuffers};
use keydiff_kernels::geometry::{select_few_fits, vector_loads_fit, ScoreLoads, KVQ_BYTES};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// Scores are computed in f32 from the same dtype-rounded keys; only summation order differs
/// (observed: at most 3e-7). `keydiff::kernel_check::SCORE_TOL` allows 1e-4 on a GPU, where
/// the compiler may also contract to FMAs; the emulation compiles without contraction.
const SCORE_TOL: f32 = 1e-5;

/// Schedules each case runs under; one odd and one even, so that the emulation fences both
/// sides of every buffer (`keydiff_kernels::fence::Side::for_seed`).
const SEEDS: [u64; 2] = [1, 0x9e37_79b9_7f4a_7c14];

/// Largest |a − b|; a NaN on either side (an unwritten output is NaN) counts as infinite.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x - y).abs();
            if d.is_nan() {
                f32::INFINITY
            } else {
                d
            }
        })
        .fold(0f32, f32::max)
}

#[test]
fn emulation_self_tests_fire() {
    // A correct kernel passes under every schedule.
    for seed in 0..4 {
        assert_eq!(emu::selftest(0, seed).unwrap()[0], (0..256).sum::<i32>());
    }
    // Defective kernels and launches CUDA would refuse fail, naming the defect.
    for (which, needle) in [
        (1, "diverged"),
        (2, "exited"),
        (3, "deadlock"),
        (4, "full warp masks"),
        (6, "2048 threads"),
        (7, "48 threads"),
        (8, "70000"),
        (9, "__launch_bounds__(256)"),
    ] {
        let err = emu::selftest(which, 3)
            .expect_err("a defect passed")
            .to_string();
        assert!(err.contains(needle), "self-test {which}: {err}");
    }
    // The memory checker (kernels/emu/race.h) reports races and uninitialised shared memory
    // under every schedule, naming the threads and, for global memory, the buffer.
    for seed in 0..4 {
        for (which, needles) in [
            (
                5,
                &[
                    "data race on __shared__ memory",
                    "thread 1 of block (0, 0, 0) after 1 __syncthreads writes",
                ][..],
            ),
            (
                10,
                &[
                    "__shared__ memory",
                    "read before any thread of its block wrote it",
                ],
            ),
            (
                11,
                &[
                    "data race on `self-test out` byte 0",
                    "thread 0 of block (0, 0, 0)",
                    "thread 0 of block (1, 0, 0)",
                ],
            ),
            (
                13,
                &["data race on __shared__ memory", "atomically updates"],
            ),
        ] {
            let err = emu::selftest(which, seed)
                .expect_err("a defect passed the checker")
                .to_string();
            for needle in needles {
                assert!(err.contains(needle), "self-test {which} seed {seed}: {err}");
            }
        }
        // Atomics from every thread of two blocks, read after barriers: no finding.
        assert_eq!(emu::selftest(12, seed).unwrap()[0], -1 + 2 * 256);
        // Zeroed by one thread and updated by all with no barrier between: a race when thread
        // 0 runs first, uninitialised shared memory otherwise; never a pass.
        let err = emu::selftest(17, seed)
            .expect_err("zeroing unordered with the updates passed")
            .to_string();
        assert!(
            err.contains("data race on __shared__ memory")
                || err.contains("read before any thread of its block wrote it"),
            "self-test 17 seed {seed}: {err}"
        );
    }
    // Inside the buffer but outside what the launch works on: another head's rows, row
    // padding; and a read past the end that stays inside the mapping (odd seeds), which the
    // guard page alone would miss.
    for (which, seeds, needles) in [
        (
            14,
            &[0u64, 1, 2, 3][..],
            &[
                // Byte 20 of head 0 or byte 532 of head 1: the block that runs first.
                "in row 0 of head ",
                "thread 200 of block (",
                "reads it, but its block works on head ",
            ][..],
        ),
        (
            15,
            &[0, 1, 2, 3],
            &[
                ": outside the view the launch works on (1 heads x 4 rows \
                 x 128 bytes, strides 1024 and 256 bytes)",
                "of block (0, 0, 0) after 0 __syncthreads writes it",
            ],
        ),
        (
            16,
            &[1, 3],
            &["`self-test out` (1024 bytes) accessed at byte offset 1024 (4 bytes): out of bounds"],
        ),
    ] {
        for &seed in seeds {
            let err = emu::selftest(which, seed)
                .expect_err("an access outside the view passed")
                .to_string();
            for needle in needles {
                assert!(err.contains(needle), "self-test {which} seed {seed}: {err}");
            }
        }
    }
}

/// Keys like a cache buffer `[kv, rows, d]` (rows ≥ n used slots), with a shared direction so
/// that the anchor is not tiny. Returns the f32 values already rounded to `dtype`.
fn cache_keys(kv: usize, rows: usize, d: usize, dtype: DType, rng: &mut StdRng) -> Tensor {
    let bias: Vec<f32> = (0..d)
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect();
    let mut v: Vec<f32> = (0..kv * rows * d)
        .map(|i| 0.7 * bias[i % d] + rng.sample::<f32, _>(StandardNormal))
        .collect();
    // A zero key (norm guarded by eps) in the first head.
    if rows > 3 {
        v[2 * d..3 * d].fill(0.0);
    }
    Tensor::from_vec(v, (kv, rows, d), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A buffer's values on the host in its own dtype, for the emulated kernels.
enum HostRows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl HostRows {
    fn of(buf: &Tensor) -> Self {
        let flat = buf.flatten_all().unwrap();
        match buf.dtype() {
            DType::F32 => HostRows::F32(flat.to_vec1().unwrap()),
            DType::F16 => HostRows::F16(flat.to_vec1().unwrap()),
            DType::BF16 => HostRows::BF16(flat.to_vec1().unwrap()),
            dt => panic!("no emulated kernel reads {dt:?}"),
        }
    }

    fn keys(&self) -> emu::Keys<'_> {
        match self {
            HostRows::F32(v) => emu::Keys::F32(v),
            HostRows::F16(v) => emu::Keys::F16(v),
            HostRows::BF16(v) => emu::Keys::BF16(v),
        }
    }
}

#[test]
fn scores_match_the_cpu_twin_and_the_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    // (kv, n, rows, d, row stride, anchor): odd sizes, every head dim, a d that is not a
    // multiple of 32, padded row strides (one that keeps f16/bf16 rows off 16-byte
    // boundaries). Each case runs with scalar loads and, where the view takes them, 16-byte
    // loads; n is mostly odd, so a head's last warp-wide 16-byte load (2 or 4 rows) runs past
    // its rows.
    let cases = [
        (2, 1029, 1100, 64, 64, Anchor::Normalized),
        (3, 517, 517, 128, 128, Anchor::Mean),
        (1, 129, 256, 256, 256, Anchor::Normalized),
        (2, 1, 8, 128, 128, Anchor::Normalized),
        (2, 70, 75, 72, 72, Anchor::Mean),
        (2, 300, 310, 64, 80, Anchor::Normalized),
        (2, 301, 303, 64, 68, Anchor::Normalized),
        (2, 67, 70, 256, 264, Anchor::Mean),
    ];
    let mut vector_runs = 0;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(kv, n, rows, d, rs, anchor) in &cases {
            let buf = cache_keys(kv, rows, rs, dtype, &mut rng);
            // The cache view: the first n rows and d columns of every head, strides
            // (rows·rs, rs, 1).
            let view = buf.narrow(1, 0, n).unwrap().narrow(2, 0, d).unwrap();
            let twin = keydiff_scores_fused(&view, anchor)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let reference = keydiff_scores(&view, anchor)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let host = HostRows::of(&buf);
            let keys = host.keys();
            let normalized = anchor == Anchor::Normalized;
            let elem = dtype.size_in_bytes();
            let mut loads = vec![ScoreLoads::Scalar];
            if vector_loads_fit(d, elem, 0, rows * rs, rs) {
                loads.push(ScoreLoads::Vector);
                vector_runs += 1;
            } else {
                // Asked for explicitly, 16-byte loads a view cannot take are refused.
                let err = emu::keydiff_scores(
                    keys,
                    kv,
                    n,
                    d,
                    rows * rs,
                    rs,
                    normalized,
                    ScoreLoads::Vector,
                    1,
                );
                assert!(err.unwrap_err().to_string().contains("16-byte"));
            }
            for l in loads {
                let mut runs = Vec::new();
                for seed in SEEDS {
                    let got =
                        emu::keydiff_scores(keys, kv, n, d, rows * rs, rs, normalized, l, seed)
                            .unwrap();
                    let (dt, dr) = (max_diff(&got, &twin), max_diff(&got, &reference));
                    assert!(
                        dt <= SCORE_TOL && dr <= SCORE_TOL,
                        "{dtype:?} kv {kv} n {n} d {d} {anchor:?} {} seed {seed}: \
                         |emu - twin| {dt}, |emu - reference| {dr}",
                        l.name()
                    );
                    runs.push(got);
                }
                let between = max_diff(&runs[0], &runs[1]);
                assert!(between <= SCORE_TOL);
                let (dt, dr) = (max_diff(&runs[0], &twin), max_diff(&runs[0], &reference));
                eprintln!(
                    "scores {dtype:?} kv {kv} n {n} d {d} row stride {rs} {anchor:?} {}: \
                     |emu - twin| {dt:.2e}, |emu - reference| {dr:.2e}, \
                     between schedules {between:.2e}",
                    l.name()
                );
            }
        }
    }
    // Six cases in every dtype; the row stride of 68 only in f32 (136 bytes in f16/bf16).
    assert_eq!(vector_runs, 3 * 6 + 1);
}

#[test]
fn wrappers_reject_bad_arguments() {
    let keys = vec![0f32; 4 * 300];
    let err = emu::keydiff_scores(
        emu::Keys::F32(&keys),
        1,
        4,
        300,
        1200,
        300,
        true,
        ScoreLoads::Auto,
        1,
    );
    assert!(err.unwrap_err().to_string().contains("head_dim 300"));
    // A view that runs past the buffer, and one whose extent overflows instead of wrapping.
    let err = emu::keydiff_scores(
        emu::Keys::F32(&keys),
        2,
        4,
        64,
        1200,
        64,
        true,
        ScoreLoads::Auto,
        1,
    );
    assert!(err.unwrap_err().to_string().contains("exceed"));
    let err = emu::keydiff_scores(
        emu::Keys::F32(&keys),
        1,
        3,
        64,
        0,
        1 << 63,
        true,
        ScoreLoads::Auto,
        1,
    );
    assert!(err.unwrap_err().to_string().contains("exceed"));
    // SnapKV pooling needs unique positions.
    let stats = [1f32; 4];
    let err = emu::snapkv_pool(&stats, 4, &[0, 1, 1, 3], 4, 1, 4, 8, 1);
    assert!(err.unwrap_err().to_string().contains("position 1 twice"));
}

/// The guard page below each emulated thread's fiber stack: a thread that outgrows its 64 KiB
/// (self-test 18) aborts the process with a report, instead of writing over its neighbour's
/// frames (checked in a child process: this test runs itself with `KD_STACK_CHILD` set).
#[test]
fn a_thread_that_outgrows_its_stack_is_reported() {
    if std::env::var_os("KD_STACK_CHILD").is_some() {
        let r = emu::selftest(18, 1);
        panic!("self-test 18 returned without a fault: {r:?}");
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_thread_that_outgrows_its_stack_is_reported",
            "--nocapture",
        ])
        .env("KD_STACK_CHILD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the child survived: {stderr}");
    assert!(
        stderr.contains("outgrew its fiber stack") && !stderr.contains("without a fault"),
        "{stderr}"
    );
}

/// The guard pages around the emulated kernels' buffers: an access one element outside a
/// buffer, on its fenced side, aborts the process with a report naming the buffer and offset
/// (checked in a child process: this test runs itself with `KD_FENCE_CHILD` set); a write into
/// the slack on the other side is an error from `finish`.
#[test]
fn fences_report_out_of_bounds_accesses() {
    use keydiff_kernels::fence::{Fenced, Side};
    if let Ok(which) = std::env::var("KD_FENCE_CHILD") {
        let side = if which == "end" {
            Side::End
        } else {
            Side::Start
        };
        let f = Fenced::filled("child buffer", 10, 7u32, side, 4).unwrap();
        // SAFETY: deliberately one element outside the buffer, into its guard page: the fence
        // handler reports it and aborts.
        let v = unsafe {
            let p = f.as_ptr();
            std::ptr::read_volatile(if side == Side::End {
                p.add(10)
            } else {
                p.sub(1)
            })
        };
        panic!("read {v} outside the buffer without a fault");
    }
    for (which, offset) in [("end", "byte offset 40"), ("start", "byte offset -4")] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "fences_report_out_of_bounds_accesses",
                "--nocapture",
            ])
            .env("KD_FENCE_CHILD", which)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{which}: the child survived: {stderr}"
        );
        assert!(
            stderr.contains("accessed `child buffer` (40 bytes) at ")
                && stderr.contains(offset)
                && !stderr.contains("without a fault"),
            "{which}: {stderr}"
        );
    }
    // Inside the mapping but outside the buffer: the slack pattern shows the write.
    for (side, align, index, want) in [
        (Side::End, 16, -1isize, "byte offset -4"),
        (Side::End, 16, 3, "byte offset 12"),
        (Side::Start, 4, 3, "byte offset 12"),
    ] {
        let mut f = Fenced::filled("slack", 3, 1u32, side, align).unwrap();
        // SAFETY: inside the mapping's accessible body (End with 16-byte alignment leaves 4
        // bytes after 12; both sides leave a page elsewhere).
        unsafe { f.as_mut_ptr().offset(index).write(9) };
        let err = f.finish().expect_err("a write outside the buffer");
        assert!(err.to_string().contains(want), "{side:?} {index}: {err}");
    }
    let f = Fenced::copy_of("clean", &[1u16, 2, 3], Side::End, 2).unwrap();
    assert_eq!(f.finish().unwrap(), [1, 2, 3]);
}

/// Positions past SnapKV's bitmap cannot be refused on a GPU: the kernel skips them (NaN) and
/// pools the other slots over the positions that remain, touching nothing outside its buffers.
#[test]
fn snapkv_pool_skips_positions_past_its_bitmap() {
    let mut rng = StdRng::seed_from_u64(13);
    let (kv, n, span) = (2, 40, 64);
    let mut positions: Vec<u32> = Vec::new();
    for _ in 0..kv {
        let mut pos: Vec<u32> = (0..span as u32).collect();
        pos.shuffle(&mut rng);
        positions.extend_from_slice(&pos[..n]);
    }
    // Head 0 slot 5 and head 1 slot 7 name positions past the bitmap (64 bits).
    positions[5] = 100;
    positions[n + 7] = 200;
    let stats: Vec<f32> = (0..kv * n).map(|_| rng.random::<f32>()).collect();
    for seed in SEEDS {
        let got = emu::snapkv_pool(&stats, n, &positions, n, kv, n, span, seed).unwrap();
        for (h, bad) in [(0, 5), (1, 7)] {
            assert!(got[h * n + bad].is_nan(), "head {h}: skipped slot");
            // The others: the CPU twin over the head's slots without the bad one.
            let keep: Vec<usize> = (0..n).filter(|&i| i != bad).collect();
            let st: Vec<f32> = keep.iter().map(|&i| stats[h * n + i]).collect();
            let ps: Vec<u32> = keep.iter().map(|&i| positions[h * n + i]).collect();
            let want = twin_pool(st, ps, 1, n - 1, n - 1, span);
            let got: Vec<f32> = keep.iter().map(|&i| got[h * n + i]).collect();
            assert_eq!(got, want, "head {h} seed {seed}");
        }
    }
}

/// Per-head scores with ties, NaN, ±0 and ±∞, and unique positions with gaps, shuffled as
/// after compaction; rows padded to `stride ≥ n`.
fn selection_inputs(kv: usize, n: usize, stride: usize, rng: &mut StdRng) -> (Vec<f32>, Vec<u32>) {
    let mut scores = vec![f32::NAN; kv * stride];
    let mut positions = vec![u32::MAX; kv * stride];
    for h in 0..kv {
        let mut pos: Vec<u32> = (0..2 * n as u32).collect();
        pos.shuffle(rng);
        pos.truncate(n);
        positions[h * stride..h * stride + n].copy_from_slice(&pos);
        for s in &mut scores[h * stride..h * stride + n] {
            *s = match rng.random_range(0..20) {
                0 => f32::NAN,
                1 => 0.0,
                2 => -0.0,
                3 => f32::INFINITY,
                4 => f32::NEG_INFINITY,
                // Coarse values: many ties, broken by position.
                5..=9 => (rng.random_range(-4..4) as f32) * 0.25,
                _ => rng.sample::<f32, _>(StandardNormal),
            };
        }
    }
    (scores, positions)
}

/// Runs the emulated selection and moves on one case and checks them against the twins;
/// returns the number of moves over all heads.
fn check_selection(
    kv: usize,
    n: usize,
    budget: usize,
    sinks: usize,
    recent: usize,
    seed: u64,
    rng: &mut StdRng,
) -> usize {
    let stride = n + 7;
    let (scores, positions) = selection_inputs(kv, n, stride, rng);
    check_selection_on(
        &scores, &positions, stride, kv, n, budget, sinks, recent, seed,
    )
}

/// As [`check_selection`], on given scores and positions (`kv` rows of `n`, `stride` apart,
/// padded with `u32::MAX` positions).
#[allow(clippy::too_many_arguments)]
fn check_selection_on(
    scores: &[f32],
    positions: &[u32],
    stride: usize,
    kv: usize,
    n: usize,
    budget: usize,
    sinks: usize,
    recent: usize,
    seed: u64,
) -> usize {
    let select_with = |blocks| {
        emu::select_plan(
            scores, stride, positions, stride, kv, n, budget, sinks, recent, blocks, seed,
        )
    };
    // Every way of splitting the selection gives the same plan; the moves below use it.
    let case = format!("kv {kv} n {n} budget {budget} sinks {sinks} recent {recent} seed {seed}");
    let plan = select_with(SelectBlocks::One).unwrap();
    assert_eq!(
        select_with(SelectBlocks::Many).unwrap(),
        plan,
        "many blocks vs one: {case}"
    );
    if select_few_fits(n, budget, recent) {
        assert_eq!(
            select_with(SelectBlocks::Few).unwrap(),
            plan,
            "one launch for few evictions vs one block: {case}"
        );
    } else {
        let e = select_with(SelectBlocks::Few).unwrap_err().to_string();
        assert!(e.contains("too many for one launch"), "{case}: {e}");
    }
    let cols = plan.len() / kv;
    let m = (cols - 1) / 2;
    let mut moved = positions.to_vec();
    let mut total_moves = 0;
    emu::move_rows(&mut moved, kv, n, 1, stride, 1, &plan, seed).unwrap();
    for h in 0..kv {
        let (s, p) = (&scores[h * stride..][..n], &positions[h * stride..][..n]);
        let keep = select_radix(s, p, budget, sinks, recent);
        assert_eq!(
            keep,
            select(s, p, budget, sinks, recent),
            "twin vs sort reference"
        );
        let want = move_plan(&keep, budget);
        let row = &plan[h * cols..][..cols];
        let count = row[0] as usize;
        total_moves += count;
        let got: Vec<(u32, u32)> = (0..count).map(|r| (row[1 + r], row[1 + m + r])).collect();
        assert_eq!(
            got, want,
            "head {h} of kv {kv} n {n} budget {budget} sinks {sinks} recent {recent} seed {seed}"
        );
        // After the moves the first `budget` slots hold exactly the kept positions.
        let mut kept: Vec<u32> = (0..n).filter(|&i| keep[i]).map(|i| p[i]).collect();
        let mut front = moved[h * stride..][..budget].to_vec();
        kept.sort_unstable();
        front.sort_unstable();
        assert_eq!(front, kept, "head {h}: slots after the moves");
        // Padding past n is untouched.
        assert!(moved[h * stride + n..(h + 1) * stride]
            .iter()
            .all(|&x| x == u32::MAX));
    }
    total_moves
}

#[test]
fn selection_matches_the_twin_past_the_argsort_limit() {
    let mut rng = StdRng::seed_from_u64(5);
    // (kv, n, budget, sinks, recent), as `keydiff check-kernels`, plus n − N > N.
    let cases = [
        (2, 1029, 700, 4, 100),
        (3, 8320, 8192, 4, 1638),
        (2, 517, 300, 0, 0),
        (1, 129, 1, 0, 0),
        (2, 1000, 100, 8, 50),
        (2, 131_072 + 128, 131_072, 4, 0),
        (1, 131_072 + 128, 131_072, 4, 64),
        // Slices of the many-block selection (4096 slots): a last slice of one slot; holes in
        // one slice and movers in every other; a recent window across slices; M = N.
        (2, 4097, 4000, 2, 30),
        (1, 9000, 100, 0, 0),
        (2, 12_289, 6000, 3, 2500),
        (1, 16_384, 8192, 0, 0),
        // Many heads, as the cache's stack of every layer evicts them at once (a small model's
        // layers · KV heads), each past one slice of the many-block selection.
        (48, 4224, 4096, 4, 0),
        // The one-launch selection of few evictions on whole slices only (n a multiple of
        // 4096), and with a window wider than a slice (every slot a candidate: 8192 of them,
        // its limit).
        (2, 12_288, 12_160, 2, 100),
        (1, 8192, 8000, 0, 5000),
    ];
    for (kv, n, budget, sinks, recent) in cases {
        for seed in SEEDS {
            let t = std::time::Instant::now();
            let moves = check_selection(kv, n, budget, sinks, recent, seed, &mut rng);
            eprintln!(
                "select kv {kv} n {n} N {budget} sinks {sinks} recent {recent} seed {seed}: \
                 plans equal, {moves} moves, {:.2} s",
                t.elapsed().as_secs_f64()
            );
        }
    }
}

/// The one-launch selection gathers each slice's smallest keys, and each slice's newest
/// positions for the window: these inputs put every eviction, or the whole window, in one
/// slice, or spread them one to a slice, and tie every score.
#[test]
fn few_evictions_selection_where_they_gather_in_one_slice() {
    let (kv, n) = (1, 3 * 4096 + 100);
    let stride = n + 7;
    let pad = |mut v: Vec<u32>| {
        v.resize(stride, u32::MAX);
        v
    };
    let ascending: Vec<u32> = (0..n as u32).collect();
    let descending: Vec<u32> = (0..n as u32).rev().collect();
    // Slot i of slice b at (i % slices) * 4096 + i / slices: neighbours in slots are a slice
    // apart, so the m lowest and the window's newest spread over every slice.
    let slices = n.div_ceil(4096);
    let mut spread: Vec<u32> = (0..n)
        .map(|i| ((i % slices) * 4096 + i / slices) as u32)
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| spread[i]);
    for (rank, &i) in order.iter().enumerate() {
        spread[i] = rank as u32;
    }
    let scores_of = |pos: &[u32], f: &dyn Fn(u32) -> f32| -> Vec<f32> {
        let mut s: Vec<f32> = pos.iter().map(|&p| f(p)).collect();
        s.resize(stride, f32::NAN);
        s
    };
    let by_position = |p: u32| p as f32;
    let against_position = |p: u32| -(p as f32);
    let tied = |_: u32| 0.5f32;
    let mut cases = 0;
    for positions in [&ascending, &descending, &spread] {
        for f in [
            &by_position as &dyn Fn(u32) -> f32,
            &against_position,
            &tied,
        ] {
            let scores = scores_of(positions, f);
            let positions = pad(positions.clone());
            for (budget, sinks, recent) in [(n - 128, 0, 0), (n - 128, 4, 64), (n - 300, 2, 1000)] {
                check_selection_on(
                    &scores,
                    &positions,
                    stride,
                    kv,
                    n,
                    budget,
                    sinks,
                    recent,
                    7 + cases,
                );
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 27);
}

proptest! {
    // No regression file: scripts/kernel-mutants.sh makes this fail on purpose.
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn selection_matches_the_twin_on_random_shapes(
        kv in 1usize..3,
        n in 2usize..2500,
        budget_frac in 0.0f64..1.0,
        sinks in 0usize..16,
        recent_frac in 0.0f64..0.5,
        seed in any::<u64>(),
    ) {
        let budget = ((n - 1) as f64 * budget_frac) as usize + 1;
        let recent = (budget as f64 * recent_frac) as usize;
        let sinks = sinks.min(budget - recent);
        let mut rng = StdRng::seed_from_u64(seed);
        check_selection(kv, n, budget, sinks, recent, seed, &mut rng);
    }
}

proptest! {
    // Past one slice of 4096, where the engine takes the one-launch selection of few
    // evictions: random evictions (to past a slice's worth with the window) and windows.
    #![proptest_config(ProptestConfig { cases: 6, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn selection_matches_the_twin_on_random_shapes_past_a_slice(
        n in 4097usize..13_000,
        evict in 1usize..4500,
        recent in 0usize..600,
        sinks in 0usize..8,
        seed in any::<u64>(),
    ) {
        let budget = n - evict.min(n - 1 - recent - sinks);
        let mut rng = StdRng::seed_from_u64(seed);
        check_selection(2, n, budget, sinks, recent, seed, &mut rng);
    }
}

/// `move_rows` on a `[kv, cap, row_stride]` buffer against sequential copies of the plan.
fn check_moves<T: Copy + PartialEq + std::fmt::Debug>(
    fill: impl Fn(usize) -> T,
    row_len: usize,
    row_stride: usize,
    rng: &mut StdRng,
) {
    let (kv, n, budget, cap) = (3, 777, 500, 800);
    let head_stride = cap * row_stride;
    let buf: Vec<T> = (0..kv * head_stride).map(fill).collect();
    let m = budget.min(n - budget);
    let mut plan = vec![0u32; kv * (1 + 2 * m)];
    let mut want = buf.clone();
    for h in 0..kv {
        let mut keep = vec![true; budget];
        keep.extend(vec![false; n - budget]);
        keep.shuffle(rng);
        let pairs = move_plan(&keep, budget);
        let row = &mut plan[h * (1 + 2 * m)..][..1 + 2 * m];
        row[0] = pairs.len() as u32;
        for (r, &(s, d)) in pairs.iter().enumerate() {
            row[1 + r] = s;
            row[1 + m + r] = d;
            let (s, d) = (
                h * head_stride + s as usize * row_stride,
                h * head_stride + d as usize * row_stride,
            );
            for j in 0..row_len {
                want[d + j] = want[s + j];
            }
        }
    }
    for seed in SEEDS {
        let mut got = buf.clone();
        emu::move_rows(
            &mut got,
            kv,
            n,
            row_len,
            head_stride,
            row_stride,
            &plan,
            seed,
        )
        .unwrap();
        assert!(
            got == want,
            "row_len {row_len} row_stride {row_stride} seed {seed}"
        );
    }
}

#[test]
fn moves_match_sequential_copies() {
    let mut rng = StdRng::seed_from_u64(7);
    // K/V rows of 128 f32 (512 bytes: the 16-byte path), padded 16-bit rows of 64 (bf16's
    // size; the 16-byte path with a row stride of 72), positions (the 4-byte path), rows of
    // 3 16-bit values (6 bytes: the byte path). Every element is distinct within a head (the
    // kernel moves bytes, whatever the dtype).
    check_moves(|i| i as f32, 128, 128, &mut rng);
    check_moves(|i| i as u16, 64, 72, &mut rng);
    check_moves(|i| i as u32, 1, 1, &mut rng);
    check_moves(|i| i as u16, 3, 3, &mut rng);
    // A plan naming a row past what the buffer holds is refused before launch.
    let mut buf = vec![0u32; 10];
    let bad = [1u32, 12, 0];
    assert!(emu::move_rows(&mut buf, 1, 10, 1, 10, 1, &bad, 1).is_err());
    // One naming a row past the view (rows = 6) but inside the buffer: the kernel skips that
    // move (as it must on a GPU, where nothing refuses the plan) and does the others. The
    // kernel gets the view's extent only, fenced: a kernel that failed to skip would abort on
    // the guard page (even seeds) or move the slack pattern (odd seeds).
    for seed in SEEDS {
        let mut buf: Vec<u32> = (0..10).collect();
        // Two moves: 7 -> 2 (outside the view: skipped), 5 -> 1 (done).
        let plan = [2u32, 7, 5, 2, 1];
        emu::move_rows(&mut buf, 1, 6, 1, 10, 1, &plan, seed).unwrap();
        assert_eq!(buf, [0, 5, 2, 3, 4, 5, 6, 7, 8, 9], "seed {seed}");
        let plan = [2u32, 5, 4, 8, 1];
        emu::move_rows(&mut buf, 1, 6, 1, 10, 1, &plan, seed).unwrap();
        assert_eq!(buf, [0, 4, 2, 3, 4, 5, 6, 7, 8, 9], "seed {seed}: row 8");
        // Row 6, the first past the view, is outside too: 6 -> 0 and 3 -> 6 are both skipped.
        let plan = [2u32, 6, 3, 0, 6];
        emu::move_rows(&mut buf, 1, 6, 1, 10, 1, &plan, seed).unwrap();
        assert_eq!(buf, [0, 4, 2, 3, 4, 5, 6, 7, 8, 9], "seed {seed}: row 6");
    }
    // The kernel runs all moves at once, so a plan whose sources and destinations overlap is a
    // race on the GPU (the result depends on which warp runs first); the checker reports it,
    // naming the buffer and a byte of the row. Rows of 32 bytes: 5 -> 3 reads row 5 (bytes
    // 160..192) while 6 -> 5 writes it.
    for seed in SEEDS {
        let mut buf: Vec<u32> = (0..80).collect();
        let plan = [2u32, 5, 6, 3, 5];
        let err = emu::move_rows(&mut buf, 1, 10, 8, 80, 8, &plan, seed)
            .expect_err("overlapping moves passed the race checker")
            .to_string();
        let byte: usize = err
            .split("data race on `move-rows buffer` byte ")
            .nth(1)
            .and_then(|rest| rest.split(':').next())
            .and_then(|b| b.parse().ok())
            .unwrap_or_else(|| panic!("seed {seed}: {err}"));
        assert!((160..192).contains(&byte), "seed {seed}: {err}");
    }
}

/// `PoolByPosition` on the CPU over the first `n` of `kv` rows of `stride`: `[kv · n]`.
fn twin_pool(
    stats: Vec<f32>,
    positions: Vec<u32>,
    kv: usize,
    stride: usize,
    n: usize,
    span: usize,
) -> Vec<f32> {
    let dev = Device::Cpu;
    Tensor::from_vec(stats, (kv, stride), &dev)
        .unwrap()
        .narrow(1, 0, n)
        .unwrap()
        .apply_op2_no_bwd(
            &Tensor::from_vec(positions, (kv, stride), &dev).unwrap(),
            &PoolByPosition { span },
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn snapkv_pool_matches_the_cpu_twin() {
    let mut rng = StdRng::seed_from_u64(9);
    // Spans past 32768 positions (1024 bitmap words) take several passes of the word scan.
    for (kv, n, span) in [
        (2, 1, 43),
        (2, 5, 55),
        (3, 1029, 3127),
        (2, 8320, 25_000),
        (2, 1029, 70_000),
    ] {
        let stride = n + 3;
        let mut stats = vec![f32::NAN; kv * stride];
        let mut positions = vec![u32::MAX; kv * stride];
        for h in 0..kv {
            let mut pos: Vec<u32> = (0..span as u32).collect();
            pos.shuffle(&mut rng);
            positions[h * stride..][..n].copy_from_slice(&pos[..n]);
            for s in &mut stats[h * stride..][..n] {
                *s = rng.random::<f32>();
            }
        }
        let twin = twin_pool(stats.clone(), positions.clone(), kv, stride, n, span);
        for seed in SEEDS {
            let got =
                emu::snapkv_pool(&stats, stride, &positions, stride, kv, n, span, seed).unwrap();
            // The same additions in the same order: equal, not just close.
            assert_eq!(got, twin, "kv {kv} n {n} seed {seed}");
        }
        eprintln!(
            "snapkv pool kv {kv} n {n} span {span}: equal to the twin under {} schedules",
            SEEDS.len()
        );
    }
}

#[test]
fn interleaved_layouts_score_like_contiguous_ones() {
    // Keys as [n, kv, d] (head stride d, row stride kv·d, as a [B, kv, d] projection would
    // be): the same scores as a [kv, n, d] copy, and the memory checker's views take the
    // layout (each block still only touches its head's rows).
    let (kv, n, d) = (2, 300, 64);
    let mut rng = StdRng::seed_from_u64(13);
    let inter: Vec<f32> = (0..n * kv * d).map(|_| rng.random::<f32>() - 0.5).collect();
    let mut contiguous = vec![0f32; kv * n * d];
    for r in 0..n {
        for h in 0..kv {
            let (to, from) = ((h * n + r) * d, (r * kv + h) * d);
            contiguous[to..to + d].copy_from_slice(&inter[from..from + d]);
        }
    }
    for loads in [ScoreLoads::Scalar, ScoreLoads::Vector] {
        for seed in SEEDS {
            let score = |keys: &[f32], head_stride, row_stride| {
                emu::keydiff_scores(
                    emu::Keys::F32(keys),
                    kv,
                    n,
                    d,
                    head_stride,
                    row_stride,
                    true,
                    loads,
                    seed,
                )
                .unwrap()
            };
            let (a, b) = (score(&inter, d, kv * d), score(&contiguous, n * d, d));
            let diff = max_diff(&a, &b);
            assert!(diff < 1e-6, "{} seed {seed}: {diff}", loads.name());
        }
    }
}

/// The quantized-cache kernels give the CPU twin's bytes and values exactly (the same IEEE
/// operations, none fused), for every block type, from f32, f16 and bf16 rows of cache views
/// (padded row strides, a used prefix of the slots), with values from 1e-4 to 300 and a zero
/// block; the dequantized view reads the blocks in place at the buffer's strides.
#[test]
fn quantized_cache_kernels_match_the_cpu_twin_exactly() {
    let mut rng = StdRng::seed_from_u64(23);
    // (kv, n, rows, d, row stride in values)
    let cases = [
        (2, 37, 40, 64, 64),
        (3, 5, 9, 128, 160),
        (1, 300, 300, 256, 256),
        (2, 1, 4, 32, 32),
    ];
    for t in KvType::BLOCKS {
        let kind = t.block_code().unwrap();
        let bb = t.block_bytes().unwrap();
        assert_eq!(KVQ_BYTES[kind as usize], bb, "{t}: the kernels' block size");
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for &(kv, n, rows, d, rs) in &cases {
                let scale: Vec<f32> = (0..kv * rows * rs)
                    .map(|i| [1e-4f32, 0.05, 2.0, 300.0][(i / 32) % 4])
                    .collect();
                let mut v: Vec<f32> = scale
                    .iter()
                    .map(|s| s * rng.sample::<f32, _>(StandardNormal))
                    .collect();
                v[..32].fill(0.0);
                let buf = Tensor::from_vec(v, (kv, rows, rs), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let view = buf.narrow(1, 0, n).unwrap().narrow(2, 0, d).unwrap();
                let twin = keydiff_cache::quantize_blocks(&view, t).unwrap();
                let twin_bytes = twin.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                let host = HostRows::of(&buf);
                let x = host.keys();
                for seed in SEEDS {
                    let got = emu::kvq_quantize(x, kind, kv, n, d, rows * rs, rs, seed).unwrap();
                    assert!(
                        got == twin_bytes,
                        "{t} {dtype:?} kv {kv} n {n} d {d}: bytes differ"
                    );
                }
                // The blocks inside a cache buffer of `rows + 3` slots, read as the used view.
                let rb = d / 32 * bb;
                let padded = Tensor::zeros((kv, rows + 3, rb), DType::U8, &Device::Cpu).unwrap();
                padded.slice_set(&twin, 1, 0).unwrap();
                let want = keydiff_cache::dequantize_blocks(&padded.narrow(1, 0, n).unwrap(), t, d)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let bytes = padded.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                for seed in SEEDS {
                    let got =
                        emu::kvq_dequantize(&bytes, kind, kv, n, d, (rows + 3) * rb, rb, seed)
                            .unwrap();
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{t} {dtype:?} kv {kv} n {n} d {d}: values differ"
                    );
                }
                // Written in f16 and bf16: the f32 values rounded once, as a cast rounds them.
                for (code, round) in [
                    (
                        1,
                        (|x: f32| half::f16::from_f32(x).to_f32()) as fn(f32) -> f32,
                    ),
                    (2, |x: f32| half::bf16::from_f32(x).to_f32()),
                ] {
                    let got = emu::kvq_dequantize_in(
                        &bytes,
                        kind,
                        kv,
                        n,
                        d,
                        (rows + 3) * rb,
                        rb,
                        code,
                        SEEDS[0],
                    )
                    .unwrap();
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == round(*b).to_bits()),
                        "{t} {dtype:?} kv {kv} n {n} d {d}: values written in dtype {code} differ"
                    );
                }
            }
        }
    }
    // Heads not of whole blocks, and kinds the kernels do not know, are refused before any
    // launch.
    let x = vec![0f32; 64];
    assert!(emu::kvq_quantize(emu::Keys::F32(&x[..48]), 0, 1, 1, 48, 48, 48, 0).is_err());
    assert!(emu::kvq_quantize(emu::Keys::F32(&x), 6, 1, 1, 64, 64, 64, 0).is_err());
    assert!(emu::kvq_dequantize(&[0u8; 68], -1, 1, 1, 64, 68, 68, 0).is_err());
    assert!(emu::kvq_dequantize_in(&[0u8; 68], 0, 1, 1, 64, 68, 68, 3, 0).is_err());
}

/// The fp8 kind of the same kernels (an fp8 cache on CUDA, where candle's F8E4M3 casts cannot
/// be reached) gives candle's CPU conversion exactly: every E4M3 code's value, the midpoints
/// between neighbouring codes (ties to even), values just off them, the subnormal and
/// underflow range, saturation past 448, and infinities; from f32, f16 and bf16 rows of a view.
#[test]
fn fp8_kernels_match_candle_exactly() {
    let codes: Vec<f32> = (0..=255u8)
        .map(|b| float8::F8E4M3::from_bits(b).to_f32())
        .filter(|v| v.is_finite())
        .collect();
    let mut sorted = codes.clone();
    sorted.sort_by(f32::total_cmp);
    let mut v = codes.clone();
    for w in sorted.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        v.extend([
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits() - 1),
        ]);
    }
    v.extend([
        1e-3,
        -1e-3,
        9.7e-4,
        2f32.powi(-10),
        -(2f32.powi(-10)),
        1e-5,
        449.0,
        464.0,
        465.0,
        -1000.0,
        1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    let mut rng = StdRng::seed_from_u64(5);
    while !v.len().is_multiple_of(64) || v.len() < 3 * 64 * 8 {
        v.push(rng.sample::<f32, _>(StandardNormal) * [0.01f32, 1.0, 100.0][v.len() % 3]);
    }
    let d = 64;
    let rows = v.len() / d;
    let (kv, n) = (2, rows / 2 - 1);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let buf = Tensor::from_vec(v.clone(), (kv, rows / 2, d), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let view = buf.narrow(1, 0, n).unwrap();
        let want: Vec<u8> = view
            .to_dtype(DType::F8E4M3)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<float8::F8E4M3>()
            .unwrap()
            .iter()
            .map(|c| c.to_bits())
            .collect();
        let host = HostRows::of(&buf);
        for seed in SEEDS {
            let got = emu::kvq_quantize(host.keys(), 5, kv, n, d, rows / 2 * d, d, seed).unwrap();
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "{dtype:?}: {bad} of {} codes differ", want.len());
        }
    }
    // Every code back to f32 (2 heads of 4 rows of 32), then the used view of 3 rows of each;
    // 0x7f and 0xff are NaN.
    let all: Vec<u8> = (0..=255u8).collect();
    for (n, seed) in [4, 3].into_iter().zip(SEEDS) {
        let got = emu::kvq_dequantize(&all, 5, 2, n, 32, 128, 32, seed).unwrap();
        assert_eq!(got.len(), 2 * n * 32);
        for (i, y) in got.iter().enumerate() {
            let b = (i / (n * 32)) * 128 + i % (n * 32);
            let want = float8::F8E4M3::from_bits(b as u8).to_f32();
            assert!(
                y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()),
                "code {b:#04x}: {y} vs {want}"
            );
        }
        // Back to codes (what `contiguous_rows` does to an fp8 view on CUDA): every code,
        // NaNs with their sign, comes back as it was.
        if n == 4 {
            let again =
                emu::kvq_quantize(emu::Keys::F32(&got), 5, 2, 4, 32, 128, 32, seed).unwrap();
            assert_eq!(again, all, "fp8 -> f32 -> fp8");
        }
        // Written in f16 and bf16 (an fp8 cache read for attention in the activations' dtype):
        // every code is exact in both.
        for code in [1, 2] {
            let half = emu::kvq_dequantize_in(&all, 5, 2, n, 32, 128, 32, code, seed).unwrap();
            for (y, x) in half.iter().zip(&got) {
                assert!(
                    y.to_bits() == x.to_bits() || (y.is_nan() && x.is_nan()),
                    "dtype {code}: {y} vs {x}"
                );
            }
        }
    }
}

/// A tensor's elements as little-endian bytes, in its own dtype (rows as stored).
fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let flat = t.flatten_all().unwrap();
    match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>().unwrap(),
        DType::F32 => flat
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        dt => panic!("no bytes for {dt:?}"),
    }
}

/// `keydiff_append_rows` against `LayerCache::append`'s candle ops on the CPU: a layer holding
/// `slot` rows gets a chunk of `chunk` rows at position `pos0`, its keys contiguous and its
/// values the transposed view of a `[chunk, kv, d]` projection output, as the model passes
/// them (block types: the encoded, contiguous rows). The kernel runs on buffers of random bytes
/// (slots the cache has not used, or that eviction left behind): the chunk's slots must hold
/// the cache's rows, positions and zeroed state, and every other byte must be as it was.
fn check_append(kv_type: KvType, kv: usize, d: usize, cap: usize, slot: usize, chunk: usize) {
    let mut rng = StdRng::seed_from_u64((kv * 1000 + d * 10 + slot) as u64 ^ chunk as u64);
    let dt = match kv_type {
        KvType::Float(dt) => dt,
        _ => DType::F32,
    };
    let pos0 = slot + 17;
    let mut cache = keydiff_cache::LayerCache::new(kv, d, cap, kv_type, &Device::Cpu).unwrap();
    if slot > 0 {
        let k0 = cache_keys(kv, slot, d, dt, &mut rng);
        let v0 = cache_keys(kv, slot, d, dt, &mut rng);
        cache.append(&k0, &v0, 0).unwrap();
    }
    let k = cache_keys(kv, chunk, d, dt, &mut rng);
    // The projection's output [chunk, kv, d]; attention passes its transposed view.
    let v_rows = cache_keys(chunk, kv, d, dt, &mut rng);
    let v = v_rows.transpose(0, 1).unwrap();
    cache.append(&k, &v, pos0).unwrap();
    let parts = cache.parts().unwrap();
    let rb = kv_type.row_len(d) * kv_type.storage_dtype().size_in_bytes();
    let (ke, ve) = (kv_type.encode(&k).unwrap(), kv_type.encode(&v).unwrap());
    let (k_bytes, v_bytes) = (tensor_bytes(&ke), tensor_bytes(&ve.contiguous().unwrap()));
    // What the kernel reads: the encoded keys as they are; float values as the view strides
    // them, encoded ones contiguous.
    let (v_src, v_hs, v_rs) = match kv_type {
        KvType::Float(_) => (tensor_bytes(&v_rows), rb, kv * rb),
        _ => (v_bytes.clone(), chunk * rb, rb),
    };
    let initial = AppendBuffers {
        k: (0..kv * cap * rb).map(|_| rng.random()).collect(),
        v: (0..kv * cap * rb).map(|_| rng.random()).collect(),
        head_stride: cap * rb,
        row_stride: rb,
        capacity: cap,
        positions: (0..kv * cap).map(|_| rng.random()).collect(),
        state: (0..kv * cap).map(|_| rng.random_range(-1.0..1.0)).collect(),
        meta_stride: cap,
    };
    let mut want = initial.clone();
    let positions = parts.positions.to_vec2::<u32>().unwrap();
    let state = parts.state.to_vec2::<f32>().unwrap();
    let (stored_k, stored_v) = (tensor_bytes(&parts.keys), tensor_bytes(&parts.values));
    let used = slot + chunk;
    for h in 0..kv {
        for r in slot..used {
            let (to, from) = (h * cap * rb + r * rb, (h * used + r) * rb);
            want.k[to..to + rb].copy_from_slice(&stored_k[from..from + rb]);
            want.v[to..to + rb].copy_from_slice(&stored_v[from..from + rb]);
            want.positions[h * cap + r] = positions[h][r];
            want.state[h * cap + r] = state[h][r];
        }
    }
    // The reference itself: the chunk's encoded rows, positions from pos0, zeroed state.
    for h in 0..kv {
        assert_eq!(
            &stored_k[(h * used + slot) * rb..(h + 1) * used * rb],
            &k_bytes[h * chunk * rb..(h + 1) * chunk * rb]
        );
        assert_eq!(
            &stored_v[(h * used + slot) * rb..(h + 1) * used * rb],
            &v_bytes[h * chunk * rb..(h + 1) * chunk * rb]
        );
        assert!(positions[h][slot..]
            .iter()
            .zip(pos0..)
            .all(|(&p, q)| p as usize == q));
        assert!(state[h][slot..].iter().all(|&s| s == 0.0));
    }
    let what = format!("{kv_type} kv {kv} d {d} cap {cap} slot {slot} chunk {chunk}");
    for seed in SEEDS {
        let mut got = initial.clone();
        emu::append_rows(
            emu::ByteRows {
                bytes: &k_bytes,
                head_stride: chunk * rb,
                row_stride: rb,
            },
            emu::ByteRows {
                bytes: &v_src,
                head_stride: v_hs,
                row_stride: v_rs,
            },
            &mut got,
            kv,
            chunk,
            rb,
            slot,
            pos0,
            seed,
        )
        .unwrap_or_else(|e| panic!("{what}, seed {seed}: {e}"));
        assert!(got.k == want.k, "{what}, seed {seed}: keys");
        assert!(got.v == want.v, "{what}, seed {seed}: values");
        assert_eq!(got.positions, want.positions, "{what}, seed {seed}");
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.state), bits(&want.state), "{what}, seed {seed}");
    }
}

#[test]
fn appends_match_the_cache_ops() {
    // Every copy path: rows of 16-byte words (f32 d 64, bf16 d 128, f16 d 256), of 4-byte
    // words (bf16 d 6: 12 bytes; q8_0 d 64: 68; q4_0 d 128: 72) and of bytes (f16 d 3: 6).
    // One row (a decode step), a chunk of one block's warps and one past it, a chunk of 300
    // (38 blocks a head), appended to an empty layer, after some rows, and up to capacity.
    for (kv_type, kv, d, cap, slot, chunk) in [
        (KvType::Float(DType::F32), 2, 64, 40, 5, 1),
        (KvType::Float(DType::BF16), 8, 128, 64, 0, 8),
        (KvType::Float(DType::F16), 3, 256, 50, 31, 9),
        (KvType::Float(DType::BF16), 4, 6, 400, 100, 300),
        (KvType::Float(DType::F16), 5, 3, 20, 7, 13),
        (KvType::Q8_0, 2, 64, 30, 3, 27),
        (KvType::Q4_0, 3, 128, 12, 11, 1),
        (KvType::Float(DType::F32), 1, 128, 300, 0, 300),
    ] {
        check_append(kv_type, kv, d, cap, slot, chunk);
    }
    // Refused before launch: a chunk past the buffer, positions past 2^31, no rows.
    let mut bufs = AppendBuffers {
        k: vec![0; 2 * 4 * 8],
        v: vec![0; 2 * 4 * 8],
        head_stride: 32,
        row_stride: 8,
        capacity: 4,
        positions: vec![0; 8],
        state: vec![0.0; 8],
        meta_stride: 4,
    };
    let rows = [0u8; 2 * 3 * 8];
    let src = emu::ByteRows {
        bytes: &rows,
        head_stride: 24,
        row_stride: 8,
    };
    for (chunk, slot, pos0, needle) in [
        (3, 2, 0, "past a buffer of 4"),
        (3, 0, (1 << 31) - 2, "past 2^31"),
        (0, 0, 0, "rows (at least 1)"),
    ] {
        let err = emu::append_rows(src, src, &mut bufs, 2, chunk, 8, slot, pos0, 1)
            .expect_err("a bad append passed")
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
}
