//! Shared selection: keep the top N by score, never evict protected slots; then the move plan.
//!
//! [`select`] is the reference (a sort). [`select_radix`] is the twin of the CUDA kernels
//! `keydiff_select_plan` and `keydiff_select_pass`/`_count`/`_emit` (the same 64-bit slot keys
//! and an MSB-first radix select, in O(n)); the engine uses it on the CPU, and the
//! [`SelectPlan`] / [`ApplyPlan`] ops run it or the kernels, whatever the device.

use candle_core::{CpuStorage, CustomOp2, InplaceOp2, Layout, Shape};
pub use keydiff_kernels::geometry::{select_few_fits, SelectBlocks};

/// Which slots of one head survive. `scores`, `positions`: one entry per used slot.
///
/// Protected: the first `sinks` absolute positions and the `recent` most recent positions.
/// The rest are ranked by score, ties broken by the more recent position. Returns a keep mask
/// with exactly `min(n, budget)` trues. The caller guarantees `sinks + recent <= budget`.
pub fn select(
    scores: &[f32],
    positions: &[u32],
    budget: usize,
    sinks: usize,
    recent: usize,
) -> Vec<bool> {
    let n = scores.len();
    debug_assert_eq!(n, positions.len());
    if n <= budget {
        return vec![true; n];
    }
    let mut keep = vec![false; n];
    let mut kept = 0;
    // Most recent first: positions are unique per head.
    let mut by_pos: Vec<usize> = (0..n).collect();
    by_pos.sort_unstable_by(|&a, &b| positions[b].cmp(&positions[a]));
    for &i in by_pos.iter().take(recent) {
        keep[i] = true;
        kept += 1;
    }
    for i in 0..n {
        if !keep[i] && (positions[i] as usize) < sinks {
            keep[i] = true;
            kept += 1;
        }
    }
    let mut rest: Vec<usize> = (0..n).filter(|&i| !keep[i]).collect();
    // NaN scores rank last.
    let key = |i: usize| {
        if scores[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            scores[i]
        }
    };
    rest.sort_unstable_by(|&a, &b| {
        key(b)
            .total_cmp(&key(a))
            .then(positions[b].cmp(&positions[a]))
    });
    for &i in rest.iter().take(budget.saturating_sub(kept)) {
        keep[i] = true;
    }
    keep
}

/// Moves that compact a head after selection: each `(src, dst)` copies a surviving slot from
/// `[budget, n)` into a victim slot of `[0, budget)`. At most `n - budget` moves.
pub fn move_plan(keep: &[bool], budget: usize) -> Vec<(u32, u32)> {
    let n = keep.len();
    if n <= budget {
        return Vec::new();
    }
    let holes = (0..budget).filter(|&i| !keep[i]);
    let movers = (budget..n).filter(|&i| keep[i]);
    holes
        .zip(movers)
        .map(|(d, s)| (s as u32, d as u32))
        .collect()
}

/// Bit 63 of a slot key: the slot is protected.
const PROTECTED: u64 = 1 << 63;

/// An f32 as a u32 with the same order (`total_cmp`); NaN ranks as −∞.
fn ord(s: f32) -> u32 {
    let b = if s.is_nan() {
        f32::NEG_INFINITY.to_bits()
    } else {
        s.to_bits()
    };
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// A threshold t such that exactly k (1 ≤ k ≤ n) of `key(0..n)` (distinct) are ≥ t, over the
/// low `bits` bits (a multiple of 8): an MSB-first radix select with 256 bins per pass, as the
/// kernel's `kd_radix_kth`. It stops as soon as the k-th largest closes its bin; t is then the
/// lowest key of that bin, and the same keys pass.
fn radix_kth(key: impl Fn(usize) -> u64, n: usize, k: usize, bits: u32) -> u64 {
    let (mut prefix, mut mask, mut k) = (0u64, 0u64, k as u64);
    let mut shift = bits;
    while shift >= 8 {
        shift -= 8;
        let mut hist = [0u64; 256];
        for i in 0..n {
            let x = key(i);
            if x & mask == prefix {
                hist[((x >> shift) & 255) as usize] += 1;
            }
        }
        let mut above = 0;
        let mut digit = 255;
        while digit > 0 {
            if above + hist[digit] >= k {
                break;
            }
            above += hist[digit];
            digit -= 1;
        }
        k -= above;
        prefix |= (digit as u64) << shift;
        mask |= 255 << shift;
        if hist[digit] == k {
            break;
        }
    }
    prefix
}

/// [`select`] computed as the CUDA kernel does: every slot gets a key (protected bit, score
/// order, position), unique because positions are, and the `budget` largest keys survive.
/// Returns the same keep mask as [`select`].
pub fn select_radix(
    scores: &[f32],
    positions: &[u32],
    budget: usize,
    sinks: usize,
    recent: usize,
) -> Vec<bool> {
    let n = scores.len();
    debug_assert_eq!(n, positions.len());
    if n <= budget {
        return vec![true; n];
    }
    let recent_min = (recent > 0).then(|| radix_kth(|i| positions[i] as u64, n, recent, 32));
    let key = |i: usize| {
        let p = positions[i];
        let protected = (p as usize) < sinks || recent_min.is_some_and(|m| p as u64 >= m);
        (if protected { PROTECTED } else { 0 })
            | ((ord(scores[i]) as u64) << 31)
            | (p & 0x7fff_ffff) as u64
    };
    let threshold = radix_kth(key, n, budget, 64);
    (0..n).map(|i| key(i) >= threshold).collect()
}

/// Moves a plan row holds: M = min(N, n − N).
pub fn plan_moves(n: usize, budget: usize) -> usize {
    budget.min(n.saturating_sub(budget))
}

/// Checks a `[kv, n]` per-slot tensor against a `[kv, ≥ n]` positions tensor, both with
/// contiguous rows (the inputs of [`SelectPlan`] and SnapKV's pooling); returns `(kv, n)`.
pub(crate) fn per_slot_pair(
    op: &str,
    l1: &Layout,
    l2: &Layout,
) -> candle_core::Result<(usize, usize)> {
    let (kv, n) = l1.shape().dims2()?;
    let (pkv, pn) = l2.shape().dims2()?;
    if pkv != kv || pn < n || l1.stride()[1] != 1 || l2.stride()[1] != 1 {
        candle_core::bail!(
            "{op}: per-slot values {:?} and positions {:?}",
            l1.dims(),
            l2.dims()
        );
    }
    Ok((kv, n))
}

/// The plan tensor of [`SelectPlan`]'s layout from per-head `(src, dst)` lists (moves per row:
/// the longest list), on `device`.
pub fn plan_tensor(
    plans: &[Vec<(u32, u32)>],
    device: &candle_core::Device,
) -> candle_core::Result<candle_core::Tensor> {
    let m = plans.iter().map(Vec::len).max().unwrap_or(0);
    let cols = 1 + 2 * m;
    let mut table = vec![0u32; plans.len() * cols];
    for (row, plan) in table.chunks_exact_mut(cols).zip(plans) {
        row[0] = plan.len() as u32;
        for (r, &(src, dst)) in plan.iter().enumerate() {
            row[1 + r] = src;
            row[1 + m + r] = dst;
        }
    }
    candle_core::Tensor::from_vec(table, (plans.len(), cols), device)
}

/// Selection and move plan of every head as one op: `scores` `[kv, n]` f32 and `positions`
/// `[kv, ≥ n]` u32 give the plan `[kv, 1 + 2M]` u32 (per head: the number of moves, M sources,
/// M destinations). CPU: [`select_radix`] and [`move_plan`]; CUDA: `keydiff_select_plan` (one
/// block per head), or `keydiff_select_pass`/`_count`/`_emit` (many), as `blocks` says.
#[derive(Debug, Clone, Copy)]
pub struct SelectPlan {
    pub budget: usize,
    pub sinks: usize,
    pub recent: usize,
    /// How the CUDA kernels split the work (the plan is the same; the CPU ignores it).
    pub blocks: SelectBlocks,
}

impl SelectPlan {
    fn check(&self, n: usize) -> candle_core::Result<()> {
        if self.budget == 0 || self.budget >= n || self.recent > self.budget {
            candle_core::bail!(
                "select-plan: budget {} must be in 1..{n} and >= recent {}",
                self.budget,
                self.recent
            );
        }
        Ok(())
    }
}

impl CustomOp2 for SelectPlan {
    fn name(&self) -> &'static str {
        "keydiff-select-plan"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (kv, n) = per_slot_pair("select-plan", l1, l2)?;
        let (ss, ps) = (l1.stride(), l2.stride());
        self.check(n)?;
        let (CpuStorage::F32(scores), CpuStorage::U32(positions)) = (s1, s2) else {
            candle_core::bail!("select-plan: scores must be f32 and positions u32");
        };
        let m = plan_moves(n, self.budget);
        let cols = 1 + 2 * m;
        let mut out = vec![0u32; kv * cols];
        for (h, row) in out.chunks_exact_mut(cols).enumerate() {
            let s0 = l1.start_offset() + h * ss[0];
            let p0 = l2.start_offset() + h * ps[0];
            let keep = select_radix(
                &scores[s0..s0 + n],
                &positions[p0..p0 + n],
                self.budget,
                self.sinks,
                self.recent,
            );
            let plan = move_plan(&keep, self.budget);
            row[0] = plan.len() as u32;
            for (r, &(src, dst)) in plan.iter().enumerate() {
                row[1 + r] = src;
                row[1 + m + r] = dst;
            }
        }
        Ok((CpuStorage::U32(out), Shape::from((kv, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.check(l1.shape().dims2()?.1)?;
        keydiff_kernels::select_plan(
            s1,
            l1,
            s2,
            l2,
            self.budget,
            self.sinks,
            self.recent,
            self.blocks,
        )
    }
}

/// Applies a [`SelectPlan`] plan in place to a buffer of rows, `[kv, rows]` (positions, state)
/// or `[kv, rows, d]` (K, V). CPU: row copies; CUDA: `keydiff_move_rows`, all moves at once.
#[derive(Debug, Clone, Copy)]
pub struct ApplyPlan;

impl ApplyPlan {
    fn apply<T: Copy>(
        xs: &mut [T],
        layout: &Layout,
        plan: &[u32],
        plan_layout: &Layout,
    ) -> candle_core::Result<()> {
        let dims = layout.dims();
        let st = layout.stride();
        let (kv, rows, d) = match *dims {
            [kv, rows] => (kv, rows, 1),
            [kv, rows, d] if st[2] == 1 => (kv, rows, d),
            _ => candle_core::bail!("apply-plan: buffer {dims:?} / {st:?} is not [kv, rows(, d)]"),
        };
        let (pkv, cols) = plan_layout.shape().dims2()?;
        if pkv != kv || cols % 2 != 1 || !plan_layout.is_contiguous() {
            candle_core::bail!("apply-plan: plan {:?} for {kv} heads", plan_layout.dims());
        }
        let m = (cols - 1) / 2;
        let plan = &plan[plan_layout.start_offset()..];
        for h in 0..kv {
            let row = &plan[h * cols..(h + 1) * cols];
            let count = row[0] as usize;
            if count > m {
                candle_core::bail!("apply-plan: {count} moves in a plan of {m}");
            }
            let base = layout.start_offset() + h * st[0];
            for r in 0..count {
                let (s, t) = (row[1 + r] as usize, row[1 + m + r] as usize);
                if s >= rows || t >= rows {
                    candle_core::bail!("apply-plan: move {s} -> {t} outside {rows} rows");
                }
                xs.copy_within(base + s * st[1]..base + s * st[1] + d, base + t * st[1]);
            }
        }
        Ok(())
    }
}

impl InplaceOp2 for ApplyPlan {
    fn name(&self) -> &'static str {
        "keydiff-apply-plan"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let CpuStorage::U32(plan) = s2 else {
            candle_core::bail!("apply-plan: the plan must be u32");
        };
        match s1 {
            CpuStorage::F32(xs) => Self::apply(xs, l1, plan, l2),
            CpuStorage::F16(xs) => Self::apply(xs, l1, plan, l2),
            CpuStorage::BF16(xs) => Self::apply(xs, l1, plan, l2),
            CpuStorage::F64(xs) => Self::apply(xs, l1, plan, l2),
            CpuStorage::U32(xs) => Self::apply(xs, l1, plan, l2),
            CpuStorage::U8(xs) => Self::apply(xs, l1, plan, l2),
            CpuStorage::F8E4M3(xs) => Self::apply(xs, l1, plan, l2),
            _ => candle_core::bail!("apply-plan: unsupported dtype"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        keydiff_kernels::move_rows(s1, l1, s2, l2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_top_scores_and_protected() {
        // positions 0..8, budget 4, 1 sink, 1 recent
        let scores = [0.0, 9.0, 1.0, 8.0, 2.0, 7.0, 3.0, -5.0];
        let pos: Vec<u32> = (0..8).collect();
        let keep = select(&scores, &pos, 4, 1, 1);
        assert_eq!(
            keep,
            vec![true, true, false, true, false, false, false, true]
        );
    }

    #[test]
    fn ties_prefer_recent() {
        let keep = select(&[1.0; 4], &[0, 1, 2, 3], 2, 0, 0);
        assert_eq!(keep, vec![false, false, true, true]);
    }

    #[test]
    fn radix_twin_handles_nan_signed_zero_and_extremes() {
        let scores = [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-30,
            -1e-30,
            f32::MAX,
        ];
        let pos: Vec<u32> = vec![7, 3, 9, 1, 0, 20, 5, 2];
        for budget in 1..scores.len() {
            for (sinks, recent) in [(0, 0), (1, 0), (0, 1), (2, budget.min(2))] {
                if sinks + recent > budget {
                    continue;
                }
                assert_eq!(
                    select_radix(&scores, &pos, budget, sinks, recent),
                    select(&scores, &pos, budget, sinks, recent),
                    "budget {budget} sinks {sinks} recent {recent}"
                );
            }
        }
    }

    #[test]
    fn plan_fills_holes_from_the_tail() {
        let keep = [true, false, true, false, true, true];
        assert_eq!(move_plan(&keep, 4), vec![(4, 1), (5, 3)]);
    }
}
