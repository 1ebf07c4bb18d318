//! Shared selection: keep the top N by score, never evict protected slots; then the move plan.

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
    fn plan_fills_holes_from_the_tail() {
        let keep = [true, false, true, false, true, true];
        assert_eq!(move_plan(&keep, 4), vec![(4, 1), (5, 3)]);
    }
}
