//! The kernel twin of selection (`select_radix`, and the `SelectPlan` / `ApplyPlan` ops the
//! engine runs on every device) against the reference (`select`, a sort, and `move_plan`).

use candle_core::{Device, Tensor};
use keydiff_cache::select::{move_plan, select, select_radix, ApplyPlan, SelectBlocks, SelectPlan};
use proptest::prelude::*;

/// Scores with many ties (a few distinct values), NaNs, ±0 and infinities, and a permutation
/// of positions (unique per head, as in the cache) with gaps.
fn head(n: usize) -> impl Strategy<Value = (Vec<f32>, Vec<u32>)> {
    let score = prop_oneof![
        4 => (-3i32..3).prop_map(|x| x as f32 * 0.5),
        4 => any::<f32>(),
        1 => Just(f32::NAN),
        1 => Just(-0.0f32),
        1 => Just(f32::NEG_INFINITY),
    ];
    (
        proptest::collection::vec(score, n),
        Just((0..n as u32).map(|p| p * 3 + (p % 5)).collect::<Vec<u32>>()).prop_shuffle(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn radix_select_equals_sorted_select(
        (scores, pos) in (2usize..300).prop_flat_map(head),
        b in 0.0f64..1.0, s in 0usize..4, r in 0.0f64..1.0,
    ) {
        let n = scores.len();
        let budget = 1 + ((n - 1) as f64 * b) as usize; // 1..n
        let sinks = s.min(budget);
        let recent = ((budget - sinks) as f64 * r) as usize;
        let want = select(&scores, &pos, budget, sinks, recent);
        let got = select_radix(&scores, &pos, budget, sinks, recent);
        prop_assert_eq!(got.iter().filter(|&&k| k).count(), budget.min(n));
        prop_assert_eq!(got, want);
    }

    #[test]
    fn plan_op_equals_reference_plan_and_moves(
        heads in proptest::collection::vec((40usize..41).prop_flat_map(head), 1..4),
        budget in 1usize..40, sinks in 0usize..3, r in 0.0f64..1.0,
    ) {
        let dev = Device::Cpu;
        let n = 40;
        let sinks = sinks.min(budget);
        let recent = ((budget - sinks) as f64 * r) as usize;
        let kv = heads.len();
        let flat_s: Vec<f32> = heads.iter().flat_map(|(s, _)| s.clone()).collect();
        let flat_p: Vec<u32> = heads.iter().flat_map(|(_, p)| p.clone()).collect();
        let scores = Tensor::from_vec(flat_s, (kv, n), &dev).unwrap();
        let positions = Tensor::from_vec(flat_p.clone(), (kv, n), &dev).unwrap();
        let op = SelectPlan { budget, sinks, recent, blocks: SelectBlocks::Auto };
        let plan = scores.apply_op2_no_bwd(&positions, &op).unwrap().to_vec2::<u32>().unwrap();
        let m = budget.min(n - budget);
        for (h, (s, p)) in heads.iter().enumerate() {
            let want = move_plan(&select(s, p, budget, sinks, recent), budget);
            let count = plan[h][0] as usize;
            let got: Vec<(u32, u32)> =
                (0..count).map(|r| (plan[h][1 + r], plan[h][1 + m + r])).collect();
            prop_assert_eq!(got, want);
        }
        // ApplyPlan moves whole rows: apply it to the positions and compare with the reference.
        positions.inplace_op2(&Tensor::new(plan.clone(), &dev).unwrap(), &ApplyPlan).unwrap();
        let moved = positions.narrow(1, 0, budget).unwrap().to_vec2::<u32>().unwrap();
        for (h, (s, p)) in heads.iter().enumerate() {
            let keep = select(s, p, budget, sinks, recent);
            let mut want = p.clone();
            for (src, dst) in move_plan(&keep, budget) {
                want[dst as usize] = want[src as usize];
            }
            let mut kept: Vec<u32> = (0..n).filter(|&i| keep[i]).map(|i| p[i]).collect();
            let mut have = moved[h].clone();
            prop_assert_eq!(&have[..], &want[..budget]);
            kept.sort_unstable();
            have.sort_unstable();
            prop_assert_eq!(have, kept);
        }
    }
}

#[test]
fn radix_select_past_the_argsort_limit() {
    // n = 131072 + 128 with a budget of 96K: more than candle's argsort handles.
    let n = 131_072 + 128;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let scores: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) % 1000) as f32 / 1000.0
        })
        .collect();
    let pos: Vec<u32> = (0..n as u32).collect();
    let (budget, sinks, recent) = (98_304, 4, 1024);
    assert_eq!(
        select_radix(&scores, &pos, budget, sinks, recent),
        select(&scores, &pos, budget, sinks, recent)
    );
}
