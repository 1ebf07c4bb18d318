//! Launch geometry and argument checks of the kernels, shared by the CUDA launches (`cuda`) and
//! the CPU emulation (`emulate`), so that the emulation runs the grids, blocks and bounds the
//! GPU gets.

use candle_core::{bail, Result};

/// `KD_ROWS_PER_BLOCK` of the kernel source: rows of one scoring block.
pub const ROWS_PER_BLOCK: usize = 64;
/// `KD_THREADS`: threads of a scoring block.
pub const THREADS: u32 = 256;
/// `KD_MAX_D`: largest head dimension the scoring kernels handle.
pub const MAX_HEAD_DIM: usize = 256;
/// `KD_SELECT_THREADS` / `KD_POOL_THREADS`: threads of a selection or pooling block.
pub const SELECT_THREADS: u32 = 1024;
/// Most slots per head: loop counters in the kernels are `int` and step by up to 1024.
pub const MAX_SLOTS: usize = i32::MAX as usize - 4096;
/// Most KV heads (grid.y of the scoring and move kernels).
pub const MAX_HEADS: usize = 65_535;
/// Moves per block of `keydiff_move_rows` (one warp each).
pub const MOVES_PER_BLOCK: u32 = 8;

/// A 1-D block over a 2-D grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32),
    pub block: u32,
}

/// `keydiff_pass1/2`: row blocks on grid.x (up to 2^31 − 1), heads on grid.y (up to 65535).
pub fn scores_launch(kv: usize, n: usize) -> Launch {
    Launch {
        grid: (n.div_ceil(ROWS_PER_BLOCK) as u32, kv as u32),
        block: THREADS,
    }
}

/// How the scoring kernels read key rows. The scores are the same up to rounding (the sums run
/// in another order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScoreLoads {
    /// 16-byte loads when the view takes them ([`vector_loads_fit`]), else one value at a time.
    #[default]
    Auto,
    /// `keydiff_pass1/2_<dtype>`: a lane reads one value of 32 at a time; any d ≤ 256 and
    /// stride.
    Scalar,
    /// `keydiff_pass1v/2v_<dtype>_<d>`: a lane reads 16 bytes at a time.
    Vector,
}

/// The head dims the 16-byte scoring kernels are built for (`KD_INSTANTIATE_VEC_DS`).
pub const VECTOR_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Whether a `[kv, n, d]` view of `elem`-byte values, starting `start` bytes past a 16-byte
/// boundary, with element strides `(head_stride, row_stride, 1)`, takes 16-byte loads: d of
/// [`VECTOR_HEAD_DIMS`], and every row starts on a 16-byte boundary.
pub fn vector_loads_fit(
    d: usize,
    elem: usize,
    start: usize,
    head_stride: usize,
    row_stride: usize,
) -> bool {
    VECTOR_HEAD_DIMS.contains(&d)
        && start.is_multiple_of(16)
        && (head_stride * elem).is_multiple_of(16)
        && (row_stride * elem).is_multiple_of(16)
}

impl ScoreLoads {
    /// What a view runs (`fits`: [`vector_loads_fit`]): never `Auto`. Asked for `Vector`, a
    /// view that cannot take it is an error, not a quiet fallback.
    pub fn resolve(self, fits: bool) -> Result<ScoreLoads> {
        match self {
            ScoreLoads::Auto if fits => Ok(ScoreLoads::Vector),
            ScoreLoads::Auto => Ok(ScoreLoads::Scalar),
            ScoreLoads::Vector if !fits => bail!(
                "keydiff-scores: 16-byte loads need d in {VECTOR_HEAD_DIMS:?} and rows on \
                 16-byte boundaries"
            ),
            l => Ok(l),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ScoreLoads::Auto => "auto",
            ScoreLoads::Scalar => "scalar loads",
            ScoreLoads::Vector => "16-byte loads",
        }
    }
}

/// `keydiff_select_plan` and `snapkv_pool`: one block per head.
pub fn per_head_launch(kv: usize) -> Launch {
    Launch {
        grid: (kv as u32, 1),
        block: SELECT_THREADS,
    }
}

/// `KD_SEL_THREADS`: threads of a block of the many-block selection.
pub const SELECT_MULTI_THREADS: u32 = 512;
/// `KD_SEL_ITEMS`: slots of one slice (one block) of the many-block selection.
pub const SELECT_ITEMS: usize = 4096;
/// `KD_SEL_RECENT_PASSES`: passes (11-bit digits) of the recent window's 32-bit keys.
pub const SELECT_RECENT_PASSES: usize = 3;
/// `KD_SEL_PASSES`: passes in all, the recent window's and then the 64-bit slot keys' six.
pub const SELECT_PASSES: usize = 9;
/// `KD_SEL_COUNTS`: workspace words of a head before its per-slice counts (control entries,
/// tickets, a histogram of 2048 bins per pass).
pub const SELECT_COUNTS: usize = 96 + SELECT_PASSES * 2048;

/// How the selection runs on CUDA: one block per head (`keydiff_select_plan`, one launch),
/// many (`keydiff_select_pass` per digit, `_count`, `_emit`: every SM at work for large n), or
/// many in one launch for few evictions (`keydiff_select_few`). The plan is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SelectBlocks {
    /// Once a head has more than one slice of [`SELECT_ITEMS`] slots: `Few` where
    /// [`select_few_fits`], else `Many`. One block per head below that.
    #[default]
    Auto,
    One,
    Many,
    /// `keydiff_select_few`: a slice per block, one launch; only where [`select_few_fits`].
    Few,
}

impl SelectBlocks {
    /// What a selection of `budget` survivors of `n` slots per head, `recent` of them the
    /// window, runs: never `Auto`. `Few` where it does not fit is an error, not a quiet
    /// fallback.
    pub fn resolve(self, n: usize, budget: usize, recent: usize) -> Result<SelectBlocks> {
        let few = select_few_fits(n, budget, recent);
        match self {
            SelectBlocks::Auto if n <= SELECT_ITEMS => Ok(SelectBlocks::One),
            SelectBlocks::Auto if few => Ok(SelectBlocks::Few),
            SelectBlocks::Auto => Ok(SelectBlocks::Many),
            SelectBlocks::Few if !few => bail!(
                "select-plan: {} evictions and a window of {recent} from {n} slots are too \
                 many for one launch ({} candidates, at most {SELECT_FEW_CANDIDATES})",
                n.saturating_sub(budget),
                select_few_candidates(n, budget, recent)
            ),
            b => Ok(b),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SelectBlocks::Auto => "auto",
            SelectBlocks::One => "one block per head",
            SelectBlocks::Many => "many blocks per head",
            SelectBlocks::Few => "one launch, few evictions",
        }
    }
}

/// `KD_FEW_THREADS`: threads of a block of `keydiff_select_few`.
pub const SELECT_FEW_THREADS: u32 = 1024;
/// `KD_FEW_ITEMS`: slots of one slice (one block) of `keydiff_select_few`.
pub const SELECT_FEW_ITEMS: usize = 4096;
/// `KD_FEW_CAND`: most candidates per head that the last block of `keydiff_select_few` holds.
pub const SELECT_FEW_CANDIDATES: usize = 8192;

/// Candidates of a whole slice of `keydiff_select_few` (`c` in the kernel): its
/// min(m + recent, slice) smallest keys, m = n − budget evictions.
fn select_few_per_slice(n: usize, budget: usize, recent: usize) -> usize {
    (n.saturating_sub(budget) + recent).min(SELECT_FEW_ITEMS)
}

/// Candidates per head of `keydiff_select_few`: [`select_few_per_slice`] for every slice, the
/// last one's at most its length.
pub fn select_few_candidates(n: usize, budget: usize, recent: usize) -> usize {
    let c = select_few_per_slice(n, budget, recent);
    let slices = n.div_ceil(SELECT_FEW_ITEMS);
    (slices.saturating_sub(1)) * c + c.min(n - (slices.saturating_sub(1)) * SELECT_FEW_ITEMS)
}

/// Whether `keydiff_select_few` takes a selection (`check_select`'s limits apart): its
/// candidates fit the last block.
pub fn select_few_fits(n: usize, budget: usize, recent: usize) -> bool {
    budget < n && select_few_candidates(n, budget, recent) <= SELECT_FEW_CANDIDATES
}

/// `keydiff_select_few`: a slice of [`SELECT_FEW_ITEMS`] slots per block on grid.x, heads on
/// grid.y.
pub fn select_few_launch(kv: usize, n: usize) -> Launch {
    Launch {
        grid: (n.div_ceil(SELECT_FEW_ITEMS) as u32, kv as u32),
        block: SELECT_FEW_THREADS,
    }
}

/// Workspace words per head of `keydiff_select_few` (zeroed before it): the ticket, then per
/// slice its eviction candidates and its window candidates.
pub fn select_few_workspace(n: usize, budget: usize, recent: usize) -> usize {
    let c = select_few_per_slice(n, budget, recent);
    1 + n.div_ceil(SELECT_FEW_ITEMS) * (c + recent.min(SELECT_FEW_ITEMS))
}

/// The many-block selection's kernels: a slice of [`SELECT_ITEMS`] slots per block on grid.x,
/// heads on grid.y.
pub fn select_multi_launch(kv: usize, n: usize) -> Launch {
    Launch {
        grid: (n.div_ceil(SELECT_ITEMS) as u32, kv as u32),
        block: SELECT_MULTI_THREADS,
    }
}

/// Workspace words per head of the many-block selection (zeroed before its first pass).
pub fn select_workspace(n: usize) -> usize {
    SELECT_COUNTS + 4 * n.div_ceil(SELECT_ITEMS)
}

/// The `keydiff_select_pass` launches of a selection: the recent window's only when it has one.
pub fn select_passes(recent: usize) -> std::ops::Range<usize> {
    let first = if recent > 0 { 0 } else { SELECT_RECENT_PASSES };
    first..SELECT_PASSES
}

/// `keydiff_move_rows`: one warp per move, heads on grid.y.
pub fn move_launch(moves: usize, kv: usize) -> Launch {
    Launch {
        grid: ((moves as u32).div_ceil(MOVES_PER_BLOCK), kv as u32),
        block: 32 * MOVES_PER_BLOCK,
    }
}

/// `KD_APPEND_THREADS`: threads of a `keydiff_append_rows` block (a warp per row).
pub const APPEND_THREADS: u32 = 256;

/// `keydiff_append_rows`: one warp per appended row, heads on grid.y.
pub fn append_launch(chunk: usize, kv: usize) -> Launch {
    Launch {
        grid: ((chunk as u32).div_ceil(APPEND_THREADS / 32), kv as u32),
        block: APPEND_THREADS,
    }
}

/// The append kernel's limits: `chunk` rows of `row_bytes` bytes a head written at slots
/// `slot .. slot + chunk` of a buffer of `capacity`, positions from `pos0` below 2^31 (the
/// selection keys' 31 bits; `int` counts in the kernel).
pub fn check_append(
    kv: usize,
    chunk: usize,
    row_bytes: usize,
    slot: usize,
    capacity: usize,
    pos0: usize,
) -> Result<()> {
    if kv == 0 || kv > MAX_HEADS || chunk == 0 || row_bytes == 0 || row_bytes > i32::MAX as usize {
        bail!(
            "append: {kv} heads (1..={MAX_HEADS}), {chunk} rows (at least 1) of {row_bytes} \
             bytes (1..={})",
            i32::MAX
        );
    }
    if capacity > MAX_SLOTS || slot + chunk > capacity {
        bail!(
            "append: slots {slot}..{} past a buffer of {capacity}",
            slot + chunk
        );
    }
    if pos0 + chunk > 1 << 31 {
        bail!("append: position {} is past 2^31", pos0 + chunk);
    }
    Ok(())
}

/// `KD_ROPE_THREADS`: threads of a `keydiff_rope_qk_*` block (a thread per pair of values).
pub const ROPE_THREADS: u32 = 256;

/// `keydiff_rope_qk_*`: a grid-stride loop over `pairs` pairs of values.
pub fn rope_launch(pairs: usize) -> Launch {
    grid_stride_launch(pairs, ROPE_THREADS)
}

/// RoPE's limits: `hq` query and `hk` key heads of `rows` rows of `d` values (even), `int`
/// counts in the kernel.
pub fn check_rope(hq: usize, hk: usize, rows: usize, d: usize) -> Result<()> {
    let heads = hq + hk;
    let fits = |x: usize| x > 0 && x <= i32::MAX as usize;
    if !fits(hq) || !fits(hk) || !fits(heads) || !fits(rows) || !fits(d) || d % 2 == 1 {
        bail!(
            "rope: {hq} query and {hk} key heads of {rows} rows of {d} values (each at least \
             1, d even)"
        );
    }
    if (heads as u64 * rows as u64)
        .checked_mul(d as u64)
        .is_none_or(|n| n > i64::MAX as u64)
    {
        bail!("rope: {heads} heads of {rows} rows of {d} values overflow");
    }
    if (rows * (d / 2)) > i32::MAX as usize {
        bail!("rope: {rows} rows of cos and sin past the kernel's int");
    }
    Ok(())
}

/// `KD_KVQ_THREADS`: threads of a block of the quantized-cache kernels.
pub const KVQ_THREADS: u32 = 256;

/// Bytes of a block of 32 values for each `kind` the quantized-cache kernels take (`KD_KVQ_*`:
/// q8_0, q5_1, q5_0, q4_1, q4_0; keydiff-cache's `KvType::block_code` numbers them so; then
/// fp8 E4M3, [`KVQ_FP8`]).
pub const KVQ_BYTES: [usize; 6] = [34, 24, 22, 20, 18, 32];

/// `KD_KVQ_FP8`: the kernels' `kind` for fp8 E4M3 rows (one byte a value, no scale; the
/// quantize kernel writes an F8E4M3 buffer, the dequantize kernel reads one).
pub const KVQ_FP8: i32 = 5;

/// `keydiff_kvq_quantize_*` (`values` = blocks of 32 per head) and `keydiff_kvq_dequantize`
/// (`values` = values per head): one thread each, heads on grid.y.
pub fn kvq_launch(kv: usize, values: usize) -> Launch {
    Launch {
        grid: (
            (values as u64).div_ceil(KVQ_THREADS as u64) as u32,
            kv as u32,
        ),
        block: KVQ_THREADS,
    }
}

/// The quantized-cache kernels' limits: a known `kind` of `bytes` per block, rows of whole
/// blocks of 32, `int` counts.
pub fn check_kvq(kv: usize, n: usize, d: usize, kind: i32, bytes: usize) -> Result<()> {
    if usize::try_from(kind).ok().and_then(|k| KVQ_BYTES.get(k)) != Some(&bytes) {
        bail!("kv blocks: kind {kind} of {bytes} bytes is not one of the kernels' ({KVQ_BYTES:?})");
    }
    if d == 0 || !d.is_multiple_of(32) || n == 0 || n > MAX_SLOTS || kv == 0 || kv > MAX_HEADS {
        bail!(
            "kv blocks: head_dim {d} (a multiple of 32), n {n} (1..={MAX_SLOTS}) or {kv} heads \
             (1..={MAX_HEADS}) out of range"
        );
    }
    if (n as u64 * d as u64).div_ceil(KVQ_THREADS as u64) > i32::MAX as u64 {
        bail!("kv blocks: {n} rows of {d} values are past the kernel's grid");
    }
    Ok(())
}

/// `KD_DEC_THREADS`: threads of a `keydiff_decode_*` block (4 warps).
pub const DECODE_THREADS: u32 = 128;
/// `KD_DEC_MAX_G`: most query heads per KV head the decode kernel takes (the GQA groups of
/// Llama 3.x and Qwen 2.5/3 are 1 to 8).
pub const DECODE_MAX_GROUP: usize = 8;
/// Keys a decode block takes before the keys of a head are split over more blocks.
pub const DECODE_SPAN: usize = 256;
/// Most blocks of a decode launch over all KV heads (a few per SM of an H100/H200, 132), so
/// that a long cache is read by the whole GPU.
pub const DECODE_BLOCKS: usize = 512;

/// How `keydiff_decode_*` splits the `t` keys of each of `kv` heads: `(splits, span)`, block s
/// taking keys `[s · span, min(t, (s + 1) · span))`, none of them empty. It depends on the
/// shape alone, so a device gives the same sums for the same cache.
pub fn decode_split(kv: usize, t: usize) -> (usize, usize) {
    let most = (DECODE_BLOCKS / kv.max(1)).max(1);
    let splits = t.div_ceil(DECODE_SPAN).clamp(1, most);
    let span = t.div_ceil(splits).max(1);
    (t.div_ceil(span).max(1), span)
}

/// The values each lane of the decode kernel holds of a row (the `NE` of
/// `keydiff_decode_<dtype>_<NE>`): 2, 4 or 8 for head dims up to 64, 128 or 256.
pub fn decode_lanes(d: usize) -> Option<usize> {
    [2, 4, 8].into_iter().find(|ne| d <= 32 * ne)
}

/// `keydiff_decode_*`: splits on grid.x, heads on grid.y.
pub fn decode_launch(kv: usize, splits: usize) -> Launch {
    Launch {
        grid: (splits as u32, kv as u32),
        block: DECODE_THREADS,
    }
}

/// `keydiff_decode_combine_*`: one block per head, on grid.y.
pub fn decode_combine_launch(kv: usize) -> Launch {
    decode_launch(kv, 1)
}

/// The decode kernel's limits: `kv` heads of `g` query heads each, `t` keys of `d` values.
pub fn check_decode(kv: usize, g: usize, t: usize, d: usize) -> Result<()> {
    if kv == 0 || kv > MAX_HEADS || g == 0 || g > DECODE_MAX_GROUP {
        bail!(
            "decode-attention: {kv} KV heads (1..={MAX_HEADS}) of {g} query heads \
             (1..={DECODE_MAX_GROUP})"
        );
    }
    if t == 0 || t > MAX_SLOTS || d == 0 || d > MAX_HEAD_DIM {
        bail!("decode-attention: {t} keys (1..={MAX_SLOTS}) of head_dim {d} (1..={MAX_HEAD_DIM})");
    }
    Ok(())
}

/// The limits of the decode kernel over a quantized cache (`keydiff_decode_kvq_*`): those of
/// [`check_decode`], a known `kind` of `bytes` per block (as [`check_kvq`]), and heads of whole
/// blocks of 32 values.
pub fn check_decode_kvq(
    kv: usize,
    g: usize,
    t: usize,
    d: usize,
    kind: i32,
    bytes: usize,
) -> Result<()> {
    check_decode(kv, g, t, d)?;
    if usize::try_from(kind).ok().and_then(|k| KVQ_BYTES.get(k)) != Some(&bytes) {
        bail!(
            "decode-attention: kind {kind} of {bytes} bytes is not one of the kernels' \
             ({KVQ_BYTES:?})"
        );
    }
    if !d.is_multiple_of(32) {
        bail!("decode-attention over blocks: head_dim {d} is not a multiple of 32");
    }
    Ok(())
}

/// `KD_SMX_THREADS`: threads of a causal-softmax block.
pub const SOFTMAX_THREADS: u32 = 256;

/// `keydiff_causal_softmax_*`: one block per row of scores, on grid.x (up to 2^31 − 1).
pub fn softmax_launch(rows: usize) -> Launch {
    Launch {
        grid: (rows as u32, 1),
        block: SOFTMAX_THREADS,
    }
}

/// The causal softmax's limits: `rows` rows of `t` scores, the queries of chunks of `chunk`
/// whose keys are the last `chunk` of `t`.
pub fn check_softmax(rows: usize, t: usize, chunk: usize) -> Result<()> {
    if chunk == 0 || t < chunk || t > MAX_SLOTS {
        bail!(
            "causal-softmax: a chunk of {chunk} queries over {t} keys \
             (1 <= chunk <= keys <= {MAX_SLOTS})"
        );
    }
    if rows == 0 || !rows.is_multiple_of(chunk) || rows > i32::MAX as usize {
        bail!(
            "causal-softmax: {rows} rows, not a positive multiple of the chunk {chunk} \
             (at most {})",
            i32::MAX
        );
    }
    Ok(())
}

/// `keydiff_softmax_sums_*`: a thread per key, blocks of [`SOFTMAX_THREADS`] keys on grid.x,
/// one query head per grid.y (up to 65535).
pub fn softmax_sums_launch(t: usize, heads: usize) -> Launch {
    Launch {
        grid: (t.div_ceil(SOFTMAX_THREADS as usize) as u32, heads as u32),
        block: SOFTMAX_THREADS,
    }
}

/// The limits of the softmax with statistics (`keydiff_softmax_state_*` then
/// `keydiff_softmax_sums_*`): those of [`check_softmax`], then the last `stat_rows` queries of
/// each head's chunk summed (1 to the chunk), and at most 65535 heads (`rows / chunk`, grid.y).
pub fn check_softmax_sums(rows: usize, t: usize, chunk: usize, stat_rows: usize) -> Result<()> {
    check_softmax(rows, t, chunk)?;
    if stat_rows == 0 || stat_rows > chunk {
        bail!("softmax sums: the last {stat_rows} queries of chunks of {chunk} (1..={chunk})");
    }
    let heads = rows / chunk;
    if heads > 65535 {
        bail!("softmax sums: {heads} query heads (at most 65535)");
    }
    Ok(())
}

/// `KD_NORM_THREADS`: threads of a residual-add-and-RMSNorm block.
pub const NORM_THREADS: u32 = 256;

/// `keydiff_add_rms_norm_*`: one block per row, on grid.x (up to 2^31 − 1).
pub fn norm_launch(rows: usize) -> Launch {
    Launch {
        grid: (rows as u32, 1),
        block: NORM_THREADS,
    }
}

/// The residual-add-and-RMSNorm kernel's limits: `rows` rows of `cols` values.
pub fn check_norm(rows: usize, cols: usize) -> Result<()> {
    if rows == 0 || rows > i32::MAX as usize || cols == 0 || cols > MAX_SLOTS {
        bail!(
            "add-rms-norm: {rows} rows (1..={}) of {cols} values (1..={MAX_SLOTS})",
            i32::MAX
        );
    }
    Ok(())
}

/// `KD_ACT_THREADS`: threads of a SwiGLU-product block.
pub const ACT_THREADS: u32 = 256;
/// Most blocks of a SwiGLU-product or RoPE launch: 262,144 threads, an H100's or H200's
/// resident threads (132 SMs × 2048); a grid-stride loop covers the rest of a prompt chunk's.
pub const ACT_MAX_BLOCKS: usize = 1024;

/// `keydiff_silu_mul_*`: a grid-stride loop over `n` values.
pub fn act_launch(n: usize) -> Launch {
    grid_stride_launch(n, ACT_THREADS)
}

/// A grid-stride loop over `n` items, `threads` a block: a thread per item up to
/// [`ACT_MAX_BLOCKS`] blocks, which then turn over the rest.
fn grid_stride_launch(n: usize, threads: u32) -> Launch {
    Launch {
        grid: (
            n.div_ceil(threads as usize).clamp(1, ACT_MAX_BLOCKS) as u32,
            1,
        ),
        block: threads,
    }
}

/// The SwiGLU product's limits: `rows` rows of `cols` values.
pub fn check_act(rows: usize, cols: usize) -> Result<()> {
    if rows == 0 || cols == 0 || cols > i32::MAX as usize || rows.checked_mul(cols).is_none() {
        bail!(
            "silu-mul: {rows} rows of {cols} values (both at least 1, cols at most {})",
            i32::MAX
        );
    }
    Ok(())
}

/// `KD_ARGMAX_THREADS`: threads of a greedy-sampling (argmax) block, one block a row.
pub const ARGMAX_THREADS: u32 = 1024;

/// `keydiff_argmax_rows_*`: a block per row.
pub fn argmax_launch(rows: usize) -> Launch {
    Launch {
        grid: (rows as u32, 1),
        block: ARGMAX_THREADS,
    }
}

/// The argmax's limits: `rows` rows (a block each) of `cols` values, an `int` in the kernel
/// whose strided loop steps a block past the row's end.
pub fn check_argmax(rows: usize, cols: usize) -> Result<()> {
    let most_cols = i32::MAX as usize - ARGMAX_THREADS as usize;
    if rows == 0 || rows > i32::MAX as usize || cols == 0 || cols > most_cols {
        bail!(
            "argmax: {rows} rows of {cols} values (rows from 1 to {}, values from 1 to {most_cols})",
            i32::MAX
        );
    }
    Ok(())
}

/// `KD_SAMPLE_THREADS`: threads of a sampling block, one block a row.
pub const SAMPLE_THREADS: u32 = 1024;

/// Words of one row's parameters for `keydiff_sample_rows_*`: temperature, top-k, top-p,
/// min-p, the uniform draw and the truncations' temperature (the floats as their bits).
pub const SAMPLE_PARAM_WORDS: usize = 6;

/// `KD_SAMPLE_NO_DRAW`: set in a sampled token whose row has no finite logit (the token is the
/// row's argmax, and the draw was not used).
pub const SAMPLE_NO_DRAW: u32 = 1 << 31;

/// `keydiff_sample_rows_*`: a block per row.
pub fn sample_launch(rows: usize) -> Launch {
    Launch {
        grid: (rows as u32, 1),
        block: SAMPLE_THREADS,
    }
}

/// Most values a row of `keydiff_sample_rows_*` may hold: each weight is at most 2^44 units
/// of the kernel's fixed point, and their sum must fit 64 bits.
pub const SAMPLE_MAX_COLS: usize = 1 << 20;

/// The sampler's limits: `rows` rows (a block each) of at most [`SAMPLE_MAX_COLS`] values.
pub fn check_sample(rows: usize, cols: usize) -> Result<()> {
    let most_cols = SAMPLE_MAX_COLS;
    if rows == 0 || rows > i32::MAX as usize || cols == 0 || cols > most_cols {
        bail!(
            "sample: {rows} rows of {cols} values (rows from 1 to {}, values from 1 to {most_cols})",
            i32::MAX
        );
    }
    Ok(())
}

/// Number of moves a plan row holds: M = min(N, n − N).
pub fn plan_moves(n: usize, budget: usize) -> usize {
    budget.min(n.saturating_sub(budget))
}

/// Words of `snapkv_pool`'s position bitmap for positions below `span`.
pub fn pool_words(span: usize) -> usize {
    span.div_ceil(32).max(1)
}

/// The scoring kernels' limits.
pub fn check_scores(kv: usize, n: usize, d: usize) -> Result<()> {
    if d == 0 || d > MAX_HEAD_DIM || n == 0 || n > MAX_SLOTS || kv == 0 || kv > MAX_HEADS {
        bail!(
            "keydiff-scores: head_dim {d} (1..={MAX_HEAD_DIM}), n {n} (1..={MAX_SLOTS}) or \
             {kv} heads (1..={MAX_HEADS}) out of range"
        );
    }
    Ok(())
}

/// The selection kernel's limits.
pub fn check_select(kv: usize, n: usize, budget: usize, recent: usize) -> Result<()> {
    if budget == 0 || budget >= n || recent > budget || n > MAX_SLOTS {
        bail!(
            "select-plan: budget {budget} must be in 1..{n} and >= recent {recent}, \
             n <= {MAX_SLOTS}"
        );
    }
    if kv == 0 || kv > MAX_HEADS {
        bail!("select-plan: {kv} heads (1..={MAX_HEADS})");
    }
    Ok(())
}

/// The pooling kernel's limits.
pub fn check_pool(kv: usize, n: usize, span: usize) -> Result<()> {
    if n == 0 || n > MAX_SLOTS || span > 1 << 32 || kv == 0 || kv > MAX_HEADS {
        bail!("snapkv-pool: n {n}, position span {span} or {kv} heads out of range");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_splits_cover_every_key_once_and_none_is_empty() {
        for kv in [1, 2, 3, 8, 64, 600] {
            for t in (1..3000).chain([4095, 4096, 4097, 131_072, 131_200, 1 << 24]) {
                let (splits, span) = decode_split(kv, t);
                assert!(splits >= 1 && span >= 1, "kv {kv} t {t}");
                // The last block starts inside the keys and the blocks reach the end.
                assert!(
                    (splits - 1) * span < t && splits * span >= t,
                    "kv {kv} t {t}"
                );
                assert!(kv * splits <= DECODE_BLOCKS.max(kv), "kv {kv} t {t}");
                assert!(splits == 1 || span >= DECODE_SPAN / 2, "kv {kv} t {t}");
            }
        }
        assert_eq!(decode_split(8, 256), (1, 256));
        assert_eq!(decode_split(8, 257), (2, 129));
        assert_eq!(decode_split(8, 131_072), (64, 2048));
        assert_eq!(decode_lanes(16), Some(2));
        assert_eq!(decode_lanes(65), Some(4));
        assert_eq!(decode_lanes(256), Some(8));
        assert_eq!(decode_lanes(257), None);
        assert!(check_decode(8, 9, 10, 128).is_err());
        assert!(check_decode(8, 8, 0, 128).is_err());
        assert!(check_decode(8, 8, 10, 257).is_err());
        assert!(check_decode(8, 8, 10, 256).is_ok());
    }

    #[test]
    fn geometry_stays_inside_cuda_limits() {
        let l = scores_launch(MAX_HEADS, 131_072 + 128);
        assert_eq!(l.grid, (2050, 65_535));
        assert_eq!(l.block, 256);
        assert_eq!(move_launch(9, 3).grid, (2, 3));
        assert_eq!(move_launch(8, 3).grid, (1, 3));
        assert_eq!(per_head_launch(7).grid, (7, 1));
        assert_eq!(select_multi_launch(8, 131_072 + 128).grid, (33, 8));
        assert_eq!(select_multi_launch(2, 4096).grid, (1, 2));
        assert_eq!(select_workspace(4097), SELECT_COUNTS + 8);
        assert_eq!(select_passes(0), 3..9);
        assert_eq!(select_passes(1), 0..9);
        let resolve = |b: SelectBlocks, n, budget, recent| b.resolve(n, budget, recent).unwrap();
        assert_eq!(
            resolve(SelectBlocks::Auto, 4096, 4000, 0),
            SelectBlocks::One
        );
        assert_eq!(
            resolve(SelectBlocks::Auto, 4097, 4000, 0),
            SelectBlocks::Few
        );
        assert_eq!(resolve(SelectBlocks::Many, 10, 5, 0), SelectBlocks::Many);
        assert_eq!(resolve(SelectBlocks::Few, 10, 5, 0), SelectBlocks::Few);
        // 8K and 128K budgets with B = 128: 3 × 128 and 33 × 128 candidates.
        assert_eq!(select_few_candidates(8320, 8192, 0), 384);
        assert_eq!(select_few_candidates(131_200, 131_072, 1), 32 * 129 + 128);
        assert_eq!(select_few_candidates(5000, 100, 0), 4096 + 904);
        assert_eq!(select_few_candidates(10, 5, 3), 8);
        // A window wider than a slice: every slot a candidate, at the limit.
        assert_eq!(select_few_candidates(8192, 8000, 5000), 8192);
        assert!(select_few_fits(8192, 8000, 5000));
        assert!(!select_few_fits(8193, 8000, 5000));
        assert_eq!(
            resolve(SelectBlocks::Auto, 131_200, 131_072, 0),
            SelectBlocks::Few
        );
        // H2O's half-budget window, or a chunk of 4096 at 128K: too many candidates.
        assert_eq!(
            resolve(SelectBlocks::Auto, 8320, 8192, 4096),
            SelectBlocks::Many
        );
        assert_eq!(
            resolve(SelectBlocks::Auto, 135_168, 131_072, 0),
            SelectBlocks::Many
        );
        assert!(SelectBlocks::Few.resolve(135_168, 131_072, 0).is_err());
        assert_eq!(select_few_launch(8, 131_200).grid, (33, 8));
        assert_eq!(select_few_launch(8, 131_200).block, 1024);
        assert_eq!(select_few_workspace(8320, 8192, 0), 1 + 3 * 128);
        assert_eq!(select_few_workspace(8320, 8192, 2), 1 + 3 * 132);
        assert_eq!(select_few_workspace(10, 5, 3), 1 + 8 + 3);
        assert_eq!(plan_moves(8320, 8192), 128);
        assert_eq!(plan_moves(10, 3), 3);
        assert_eq!(pool_words(0), 1);
        assert_eq!(pool_words(33), 2);
        assert!(check_scores(1, 1, 257).is_err());
        assert!(check_scores(1, 0, 64).is_err());
        assert!(check_scores(MAX_HEADS + 1, 1, 64).is_err());
        assert!(check_select(1, 10, 10, 0).is_err());
        assert!(check_select(1, 10, 4, 5).is_err());
        assert!(check_select(1, 10, 4, 4).is_ok());
        assert!(check_pool(1, 1, (1 << 32) + 1).is_err());
    }

    #[test]
    fn vector_loads_need_the_built_head_dims_and_aligned_rows() {
        // bf16 rows of 128 (256 bytes) in a [kv, 8320 + 3, 128] buffer.
        assert!(vector_loads_fit(128, 2, 0, 8323 * 128, 128));
        assert!(!vector_loads_fit(72, 4, 0, 72 * 10, 72));
        assert!(!vector_loads_fit(128, 2, 2, 8323 * 128, 128));
        assert!(!vector_loads_fit(64, 2, 0, 64 * 5 + 4, 64));
        assert!(!vector_loads_fit(64, 2, 0, 64 * 5, 68));
        assert!(vector_loads_fit(64, 4, 0, 80 * 310, 80));
        assert_eq!(ScoreLoads::Auto.resolve(true).unwrap(), ScoreLoads::Vector);
        assert_eq!(ScoreLoads::Auto.resolve(false).unwrap(), ScoreLoads::Scalar);
        assert_eq!(
            ScoreLoads::Scalar.resolve(true).unwrap(),
            ScoreLoads::Scalar
        );
        assert!(ScoreLoads::Vector.resolve(false).is_err());
    }
}
