//! The kernels of `kernels/keydiff.cu` under a CPU emulation of the CUDA execution model
//! (`kernels/emu/cuda_emu.h`): the kernel source compiled unchanged by the host C++ compiler,
//! every CUDA thread a fiber, blocks one after another, threads switching at barriers and
//! warp-synchronous calls in an order drawn from `seed`. Launched with the same
//! [`geometry`](crate::geometry) and checks as the CUDA launches.
//!
//! Each function takes host slices with element strides, checks that every access the kernel
//! should make stays inside them, and returns what the kernel wrote. The kernel gets copies in
//! [fenced](crate::fence) mappings (the end of every buffer against a guard page for even
//! seeds, the start for odd ones), so that an access outside a buffer is reported, naming it,
//! instead of reading or corrupting a neighbour. An emulation error (a launch
//! configuration CUDA would refuse, diverged lanes at a warp-synchronous call, a barrier
//! deadlock) is an `Err` that names it, and so is a finding of the memory checker
//! (`kernels/emu/race.h`): a data race, `__shared__` memory read before it is written, an
//! access outside a buffer, outside the view the wrapper declares for it, or in another
//! head's rows than its block's.
//!
//! This tests the kernels' logic without a GPU: it is not a substitute for running them on one
//! (`scripts/gpu-check.sh`).

use std::ffi::{c_char, c_int, c_uint, CStr};

use candle_core::{bail, Result};
use half::{bf16, f16};

use crate::fence::{Fenced, HeadAxis, Side};
use crate::geometry::{
    act_launch, append_launch, argmax_launch, check_act, check_append, check_argmax, check_decode,
    check_decode_kvq, check_kvq, check_norm, check_pool, check_rope, check_sample, check_scores,
    check_select, check_softmax, check_softmax_sums, decode_combine_launch, decode_lanes,
    decode_launch, decode_split, kvq_launch, move_launch, norm_launch, per_head_launch, plan_moves,
    pool_words, rope_launch, sample_launch, scores_launch, select_few_launch, select_few_workspace,
    select_multi_launch, select_passes, select_workspace, softmax_launch, softmax_sums_launch,
    vector_loads_fit, ScoreLoads, SelectBlocks, KVQ_BYTES, SAMPLE_PARAM_WORDS,
};

extern "C" {
    fn kd_emu_keydiff_scores(
        dtype: c_int,
        vec_d: c_int,
        keys: *const u8,
        head_stride: i64,
        row_stride: i64,
        n: c_int,
        d: c_int,
        normalized: c_int,
        norms: *mut f32,
        anchor: *mut f32,
        scores: *mut f32,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_select_plan(
        scores: *const f32,
        score_stride: i64,
        positions: *const u32,
        pos_stride: i64,
        n: c_int,
        budget: c_int,
        sinks: u32,
        recent: c_int,
        plan: *mut u32,
        plan_stride: i64,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_select_multi(
        which: c_int,
        scores: *const f32,
        score_stride: i64,
        positions: *const u32,
        pos_stride: i64,
        n: c_int,
        budget: c_int,
        sinks: u32,
        recent: c_int,
        pass: c_int,
        plan: *mut u32,
        plan_stride: i64,
        ws: *mut u32,
        ws_stride: i64,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_move_rows(
        buf: *mut u8,
        head_stride: i64,
        row_stride: i64,
        row_bytes: c_int,
        rows: c_int,
        plan: *const u32,
        plan_stride: i64,
        max_moves: c_int,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_append_rows(
        k: *const u8,
        k_hs: i64,
        k_rs: i64,
        v: *const u8,
        v_hs: i64,
        v_rs: i64,
        kbuf: *mut u8,
        vbuf: *mut u8,
        buf_hs: i64,
        buf_rs: i64,
        row_bytes: c_int,
        positions: *mut u32,
        state: *mut f32,
        meta_hs: i64,
        slot: c_int,
        chunk: c_int,
        pos0: c_uint,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_rope_qk(
        dtype: c_int,
        q: *const u8,
        q_rs: i64,
        q_hs: i64,
        k: *const u8,
        k_rs: i64,
        k_hs: i64,
        cos: *const u8,
        sin: *const u8,
        out: *mut u8,
        hq: c_int,
        hk: c_int,
        b: c_int,
        d: c_int,
        interleaved: c_int,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_decode(
        dtype: c_int,
        ne: c_int,
        kind: c_int,
        q: *const u8,
        k: *const u8,
        k_hs: i64,
        k_rs: i64,
        v: *const u8,
        v_hs: i64,
        v_rs: i64,
        t: c_int,
        g: c_int,
        d: c_int,
        span: c_int,
        scale: f32,
        out: *mut u8,
        part: *mut f32,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_argmax_rows(
        dtype: c_int,
        x: *const u8,
        x_rs: i64,
        out: *mut u32,
        cols: c_int,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_sample_rows(
        dtype: c_int,
        x: *const u8,
        x_rs: i64,
        params: *const u32,
        out: *mut u32,
        cols: c_int,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_silu_mul(
        dtype: c_int,
        gate: *const u8,
        gate_rs: i64,
        up: *const u8,
        up_rs: i64,
        out: *mut u8,
        rows: i64,
        cols: c_int,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_add_rms_norm(
        dtype: c_int,
        x: *const u8,
        r: *const u8,
        w: *const u8,
        out: *mut u8,
        rows: c_int,
        cols: c_int,
        eps: f32,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_causal_softmax(
        in_dtype: c_int,
        out_dtype: c_int,
        s: *const u8,
        p: *mut u8,
        t: c_int,
        chunk: c_int,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_softmax_state(
        in_dtype: c_int,
        s: *const u8,
        state: *mut f32,
        t: c_int,
        chunk: c_int,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_softmax_sums(
        in_dtype: c_int,
        out_dtype: c_int,
        s: *const u8,
        state: *const f32,
        p: *mut u8,
        stats: *mut f32,
        t: c_int,
        chunk: c_int,
        stat_rows: c_int,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_snapkv_pool(
        stats: *const f32,
        stats_stride: i64,
        positions: *const u32,
        pos_stride: i64,
        n: c_int,
        bitmap: *mut u32,
        words: c_int,
        word_rank: *mut u32,
        sorted: *mut u32,
        scores: *mut f32,
        grid_x: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_kvq_quantize(
        dtype: c_int,
        x: *const u8,
        head_stride: i64,
        row_stride: i64,
        n: c_int,
        d: c_int,
        kind: c_int,
        out: *mut u8,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_kvq_dequantize(
        q: *const u8,
        head_stride: i64,
        row_stride: i64,
        n: c_int,
        d: c_int,
        kind: c_int,
        out_dtype: c_int,
        out: *mut u8,
        grid_x: c_uint,
        grid_y: c_uint,
        block: c_uint,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn kd_emu_selftest(
        which: c_int,
        seed: u64,
        out: *mut c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Runs one FFI call with an error buffer; a non-zero return becomes an error naming `what`.
fn call(what: &str, f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<()> {
    let mut err = vec![0 as c_char; 1024];
    let rc = f(err.as_mut_ptr(), err.len());
    if rc != 0 {
        // SAFETY: the C side writes a NUL-terminated string that fits (snprintf).
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        bail!("{what} (emulated): {msg}");
    }
    Ok(())
}

/// `len` must hold index `(heads − 1)·hs + (rows − 1)·rs + row_len − 1`, and the strides in
/// bytes must fit the kernels' `int64_t`; overflow is an error, not a wrap. Returns the extent
/// (that index + 1; 0 for an empty view): the kernel gets exactly that many elements, so that
/// an access past the last one it may touch meets the guard page.
#[allow(clippy::too_many_arguments)]
fn check_extent(
    what: &str,
    len: usize,
    elem: usize,
    heads: usize,
    rows: usize,
    row_len: usize,
    hs: usize,
    rs: usize,
) -> Result<usize> {
    if heads == 0 || rows == 0 || row_len == 0 {
        return Ok(0);
    }
    let last = (heads - 1)
        .checked_mul(hs)
        .and_then(|a| (rows - 1).checked_mul(rs).and_then(|b| a.checked_add(b)))
        .and_then(|a| a.checked_add(row_len));
    let byte_strides_fit = [hs, rs]
        .iter()
        .all(|&s| s.checked_mul(elem).is_some_and(|b| b <= i64::MAX as usize));
    match last {
        Some(last) if last <= len && byte_strides_fit => Ok(last),
        _ => bail!(
            "{what}: {heads} heads × {rows} rows × {row_len} with strides ({hs}, {rs}) exceed \
             {len} elements"
        ),
    }
}

/// Keys of one layer in a dtype the scoring kernels take.
#[derive(Debug, Clone, Copy)]
pub enum Keys<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Keys<'_> {
    /// The kernels' dtype code, the bytes, the length in elements and an element's bytes.
    fn parts(&self) -> (c_int, &[u8], usize, usize) {
        fn bytes<T>(s: &[T]) -> &[u8] {
            // SAFETY: f32, f16 and bf16 are plain data without padding; the bytes live as long
            // as the slice.
            unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
        }
        match self {
            Keys::F32(s) => (0, bytes(s), s.len(), 4),
            Keys::F16(s) => (1, bytes(s), s.len(), 2),
            Keys::BF16(s) => (2, bytes(s), s.len(), 2),
        }
    }
}

/// `keydiff_pass1` + `keydiff_pass2` (or, as `loads` resolves, `keydiff_pass1v/2v` for d) on
/// `keys` viewed as `[kv, n, d]` with element strides `(head_stride, row_stride, 1)`:
/// `[kv · n]` scores, s_i = −cos(k_i, μ). The keys are copied to a 16-byte boundary, as a
/// CUDA allocation starts on one.
#[allow(clippy::too_many_arguments)]
pub fn keydiff_scores(
    keys: Keys<'_>,
    kv: usize,
    n: usize,
    d: usize,
    head_stride: usize,
    row_stride: usize,
    normalized: bool,
    loads: ScoreLoads,
    seed: u64,
) -> Result<Vec<f32>> {
    check_scores(kv, n, d)?;
    let (dtype, key_bytes, len, elem) = keys.parts();
    let extent = check_extent(
        "keydiff-scores",
        len,
        elem,
        kv,
        n,
        d,
        head_stride,
        row_stride,
    )?;
    let vec_d = match loads.resolve(vector_loads_fit(d, elem, 0, head_stride, row_stride))? {
        ScoreLoads::Vector => d as c_int,
        _ => 0,
    };
    let l = scores_launch(kv, n);
    let side = Side::for_seed(seed);
    let keys = Fenced::copy_of("keydiff-scores keys", &key_bytes[..extent * elem], side, 16)?;
    let mut norms = Fenced::filled("keydiff-scores norms", kv * n, 0f32, side, 4)?;
    let mut anchor = Fenced::filled("keydiff-scores anchor", kv * d, 0f32, side, 4)?;
    let mut scores = Fenced::filled("keydiff-scores scores", kv * n, f32::NAN, side, 4)?;
    // Blocks of (rows, head): each touches its head's rows only.
    // (`keys` is bytes; `check_extent` has checked that the byte strides fit.)
    keys.view(
        kv,
        head_stride * elem,
        n,
        row_stride * elem,
        d * elem,
        HeadAxis::Y,
    )?;
    norms.view(kv, n, 1, 0, n, HeadAxis::Y)?;
    anchor.view(kv, d, 1, 0, d, HeadAxis::Y)?;
    scores.view(kv, n, 1, 0, n, HeadAxis::Y)?;
    call("keydiff-scores", |err, err_len| {
        // SAFETY: the kernels read keys inside the extent checked above and write
        // norms/scores [kv, n] and anchor [kv, d], the sizes allocated here.
        unsafe {
            kd_emu_keydiff_scores(
                dtype,
                vec_d,
                keys.as_ptr(),
                head_stride as i64,
                row_stride as i64,
                n as c_int,
                d as c_int,
                normalized as c_int,
                norms.as_mut_ptr(),
                anchor.as_mut_ptr(),
                scores.as_mut_ptr(),
                l.grid.0,
                l.grid.1,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    keys.finish()?;
    norms.finish()?;
    anchor.finish()?;
    scores.finish()
}

/// `keydiff_kvq_quantize_*` of block type `kind` (`KVQ_BYTES[kind]` bytes a block) on `x`
/// viewed as `[kv, n, d]` with element strides `(head_stride, row_stride, 1)`: u8
/// `[kv · n · d / 32 · bytes]`.
#[allow(clippy::too_many_arguments)]
pub fn kvq_quantize(
    x: Keys<'_>,
    kind: i32,
    kv: usize,
    n: usize,
    d: usize,
    head_stride: usize,
    row_stride: usize,
    seed: u64,
) -> Result<Vec<u8>> {
    let bytes = kvq_bytes(kind)?;
    check_kvq(kv, n, d, kind, bytes)?;
    let (dtype, data, len, elem) = x.parts();
    let extent = check_extent(
        "kv-block-quantize",
        len,
        elem,
        kv,
        n,
        d,
        head_stride,
        row_stride,
    )?;
    let rb = d / 32 * bytes;
    let l = kvq_launch(kv, n * (d / 32));
    let side = Side::for_seed(seed);
    let x = Fenced::copy_of("kv-block-quantize x", &data[..extent * elem], side, elem)?;
    let mut out = Fenced::filled("kv-block-quantize out", kv * n * rb, 0xAAu8, side, 1)?;
    x.view(
        kv,
        head_stride * elem,
        n,
        row_stride * elem,
        d * elem,
        HeadAxis::Y,
    )?;
    out.view(kv, n * rb, n, rb, rb, HeadAxis::Y)?;
    call("kv-block-quantize", |err, err_len| {
        // SAFETY: the kernel reads x inside the extent checked above and writes the
        // kv · n · rb bytes of `out`.
        unsafe {
            kd_emu_kvq_quantize(
                dtype,
                x.as_ptr(),
                head_stride as i64,
                row_stride as i64,
                n as c_int,
                d as c_int,
                kind as c_int,
                out.as_mut_ptr(),
                l.grid.0,
                l.grid.1,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    x.finish()?;
    out.finish()
}

/// `keydiff_kvq_dequantize` of block type `kind` on `q` viewed as `[kv, n, d / 32 · bytes]`
/// bytes with byte strides `(head_stride, row_stride, 1)`: f32 `[kv · n · d]`.
#[allow(clippy::too_many_arguments)]
pub fn kvq_dequantize(
    q: &[u8],
    kind: i32,
    kv: usize,
    n: usize,
    d: usize,
    head_stride: usize,
    row_stride: usize,
    seed: u64,
) -> Result<Vec<f32>> {
    kvq_dequantize_in(q, kind, kv, n, d, head_stride, row_stride, 0, seed)
}

/// [`kvq_dequantize`] into `out_dtype` (0 f32, 1 f16, 2 bf16: `keydiff_kvq_dequantize`,
/// `keydiff_kvq_dequantize_f16`, `keydiff_kvq_dequantize_bf16`), widened back to f32 (exactly).
#[allow(clippy::too_many_arguments)]
pub fn kvq_dequantize_in(
    q: &[u8],
    kind: i32,
    kv: usize,
    n: usize,
    d: usize,
    head_stride: usize,
    row_stride: usize,
    out_dtype: i32,
    seed: u64,
) -> Result<Vec<f32>> {
    let bytes = kvq_bytes(kind)?;
    check_kvq(kv, n, d, kind, bytes)?;
    let elem = match out_dtype {
        0 => 4,
        1 | 2 => 2,
        _ => bail!("kv-block-dequantize: no output dtype {out_dtype} (0 f32, 1 f16, 2 bf16)"),
    };
    let rb = d / 32 * bytes;
    let extent = check_extent(
        "kv-block-dequantize",
        q.len(),
        1,
        kv,
        n,
        rb,
        head_stride,
        row_stride,
    )?;
    let l = kvq_launch(kv, n * d);
    let side = Side::for_seed(seed);
    let q = Fenced::copy_of("kv-block-dequantize q", &q[..extent], side, 2)?;
    // Bytes of all ones: NaN in every dtype, so a value never written shows.
    let mut out = Fenced::filled(
        "kv-block-dequantize out",
        kv * n * d * elem,
        0xFFu8,
        side,
        4,
    )?;
    q.view(kv, head_stride, n, row_stride, rb, HeadAxis::Y)?;
    out.view(kv, n * d * elem, n, d * elem, d * elem, HeadAxis::Y)?;
    call("kv-block-dequantize", |err, err_len| {
        // SAFETY: the kernel reads q inside the extent checked above and writes the kv · n · d
        // values of `out`.
        unsafe {
            kd_emu_kvq_dequantize(
                q.as_ptr(),
                head_stride as i64,
                row_stride as i64,
                n as c_int,
                d as c_int,
                kind as c_int,
                out_dtype as c_int,
                out.as_mut_ptr(),
                l.grid.0,
                l.grid.1,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    q.finish()?;
    Ok(widen(out_dtype as c_int, &out.finish()?))
}

/// `keydiff_decode_<dtype>_<NE>` and, for more than one split, `keydiff_decode_combine_<dtype>`
/// (the split of [`decode_split`]): one decode step's attention for `q` `[kv, g, d]`
/// (contiguous) over `k` and `v` viewed as `[kv, t, d]` with element strides `k_strides` /
/// `v_strides` (head, row; rows contiguous), all three of one dtype. Returns the output
/// `[kv · g · d]` in that dtype, widened to f32 (exactly).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: Keys<'_>,
    k: Keys<'_>,
    k_strides: (usize, usize),
    v: Keys<'_>,
    v_strides: (usize, usize),
    (kv, g, t, d): (usize, usize, usize, usize),
    scale: f32,
    seed: u64,
) -> Result<Vec<f32>> {
    check_decode(kv, g, t, d)?;
    let (dtype, _, _, elem) = q.parts();
    let (k_dtype, k_bytes, k_len, _) = k.parts();
    let (v_dtype, v_bytes, v_len, _) = v.parts();
    if k_dtype != dtype || v_dtype != dtype {
        bail!("decode-attention: q, k and v must be of one dtype");
    }
    let rows = DecodeRows {
        k: k_bytes,
        v: v_bytes,
        len: (k_len, v_len),
        elem,
        strides: (k_strides, v_strides),
        row_len: d,
        kind: -1,
    };
    decode_run(q, rows, (kv, g, t, d), scale, seed)
}

/// `keydiff_decode_kvq_<dtype>_<NE>` (then the combine, as [`decode_attention`]): the same
/// attention over a quantized cache, `k` and `v` u8 rows of blocks of `kind` (`KD_KVQ_*`, fp8
/// codes for [`crate::geometry::KVQ_FP8`]) viewed as `[kv, t, d / 32 · bytes]` at byte strides
/// `k_strides` / `v_strides`, dequantized as they are read; `q` f32, f16 or bf16.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_kvq(
    q: Keys<'_>,
    k: &[u8],
    k_strides: (usize, usize),
    v: &[u8],
    v_strides: (usize, usize),
    (kv, g, t, d): (usize, usize, usize, usize),
    kind: i32,
    scale: f32,
    seed: u64,
) -> Result<Vec<f32>> {
    let bytes = kvq_bytes(kind)?;
    check_decode_kvq(kv, g, t, d, kind, bytes)?;
    let rows = DecodeRows {
        k,
        v,
        len: (k.len(), v.len()),
        elem: 1,
        strides: (k_strides, v_strides),
        row_len: d / 32 * bytes,
        kind,
    };
    decode_run(q, rows, (kv, g, t, d), scale, seed)
}

/// The K and V rows a decode kernel reads: bytes of `len` elements of `elem` bytes, strides in
/// elements, rows of `row_len` elements; `kind` < 0 for rows in q's dtype, else a `KD_KVQ_*`.
struct DecodeRows<'a> {
    k: &'a [u8],
    v: &'a [u8],
    len: (usize, usize),
    elem: usize,
    strides: ((usize, usize), (usize, usize)),
    row_len: usize,
    kind: i32,
}

/// Runs a decode kernel (checked by the caller) and, for several splits, the combine.
fn decode_run(
    q: Keys<'_>,
    rows: DecodeRows<'_>,
    (kv, g, t, d): (usize, usize, usize, usize),
    scale: f32,
    seed: u64,
) -> Result<Vec<f32>> {
    let Some(ne) = decode_lanes(d) else {
        bail!("decode-attention: no kernel for head_dim {d}");
    };
    let (dtype, q_bytes, q_len, q_elem) = q.parts();
    if q_len < kv * g * d {
        bail!("decode-attention: q holds {q_len} values, not {kv} × {g} × {d}");
    }
    let DecodeRows {
        k: k_bytes,
        v: v_bytes,
        len: (k_len, v_len),
        elem,
        strides: ((k_hs, k_rs), (v_hs, v_rs)),
        row_len,
        kind,
    } = rows;
    let k_extent = check_extent(
        "decode-attention k",
        k_len,
        elem,
        kv,
        t,
        row_len,
        k_hs,
        k_rs,
    )?;
    let v_extent = check_extent(
        "decode-attention v",
        v_len,
        elem,
        kv,
        t,
        row_len,
        v_hs,
        v_rs,
    )?;
    let (splits, span) = decode_split(kv, t);
    let l = decode_launch(kv, splits);
    debug_assert_eq!(decode_combine_launch(kv).block, l.block);
    let side = Side::for_seed(seed);
    let n_out = kv * g * d;
    let qf = Fenced::copy_of("decode-attention q", &q_bytes[..n_out * q_elem], side, 16)?;
    let kf = Fenced::copy_of("decode-attention k", &k_bytes[..k_extent * elem], side, 16)?;
    let vf = Fenced::copy_of("decode-attention v", &v_bytes[..v_extent * elem], side, 16)?;
    // Bytes of all ones: NaN in every dtype, so a value never written shows.
    let mut out = Fenced::filled("decode-attention out", n_out * q_elem, 0xFFu8, side, 16)?;
    let part_len = if splits > 1 {
        kv * splits * g * (d + 2)
    } else {
        1
    };
    let mut part = Fenced::filled("decode-attention part", part_len, f32::NAN, side, 4)?;
    qf.view(kv, g * d * q_elem, g, d * q_elem, d * q_elem, HeadAxis::Y)?;
    kf.view(kv, k_hs * elem, t, k_rs * elem, row_len * elem, HeadAxis::Y)?;
    vf.view(kv, v_hs * elem, t, v_rs * elem, row_len * elem, HeadAxis::Y)?;
    out.view(kv, g * d * q_elem, g, d * q_elem, d * q_elem, HeadAxis::Y)?;
    if splits > 1 {
        let row = d + 2;
        part.view(kv, splits * g * row, splits * g, row, row, HeadAxis::Y)?;
    }
    // `check_decode` bounds them to `int`.
    let (t32, g32, d32, span32) = (t as c_int, g as c_int, d as c_int, span as c_int);
    call("decode-attention", |err, err_len| {
        // SAFETY: the kernels read q, k and v inside the extents checked above and write the
        // kv · g · d values of `out` and, with several splits, the kv · splits · g · (d + 2)
        // floats of `part`.
        unsafe {
            kd_emu_decode(
                dtype,
                ne as c_int,
                kind as c_int,
                qf.as_ptr(),
                kf.as_ptr(),
                k_hs as i64,
                k_rs as i64,
                vf.as_ptr(),
                v_hs as i64,
                v_rs as i64,
                t32,
                g32,
                d32,
                span32,
                scale,
                out.as_mut_ptr(),
                part.as_mut_ptr(),
                l.grid.0,
                l.grid.1,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    qf.finish()?;
    kf.finish()?;
    vf.finish()?;
    part.finish()?;
    Ok(widen(dtype, &out.finish()?))
}

/// `keydiff_causal_softmax_<in>_<out>` on `scores`, `[rows, t]` contiguous: the queries of
/// chunks of `chunk` (row r is the query at r % chunk of its chunk) over keys whose last
/// `chunk` are the chunk's own, masked bottom-right causal. Returns the probabilities
/// `[rows · t]` widened to f32 (exactly), written in f32 when `f32_out`, else in the scores'
/// dtype.
pub fn causal_softmax(
    scores: Keys<'_>,
    rows: usize,
    t: usize,
    chunk: usize,
    f32_out: bool,
    seed: u64,
) -> Result<Vec<f32>> {
    check_softmax(rows, t, chunk)?;
    let (dtype, bytes, len, elem) = scores.parts();
    let n = rows * t;
    if len < n {
        bail!("causal-softmax: {len} scores, not {rows} × {t}");
    }
    let (out_dtype, out_elem) = if f32_out { (0, 4) } else { (dtype, elem) };
    let l = softmax_launch(rows);
    let side = Side::for_seed(seed);
    let sf = Fenced::copy_of("causal-softmax scores", &bytes[..n * elem], side, 16)?;
    // Bytes of all ones: NaN in every dtype, so a value never written shows.
    let mut out = Fenced::filled(
        "causal-softmax probabilities",
        n * out_elem,
        0xFFu8,
        side,
        16,
    )?;
    // Block r touches row r alone.
    sf.view(rows, t * elem, 1, t * elem, t * elem, HeadAxis::X)?;
    out.view(
        rows,
        t * out_elem,
        1,
        t * out_elem,
        t * out_elem,
        HeadAxis::X,
    )?;
    // `check_softmax` bounds them to `int`.
    let (t32, chunk32) = (t as c_int, chunk as c_int);
    call("causal-softmax", |err, err_len| {
        // SAFETY: block r reads the t scores of row r and writes the t probabilities of row r,
        // of the rows · t checked and allocated above.
        unsafe {
            kd_emu_causal_softmax(
                dtype,
                out_dtype,
                sf.as_ptr(),
                out.as_mut_ptr(),
                t32,
                chunk32,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    sf.finish()?;
    Ok(widen(out_dtype, &out.finish()?))
}

/// `keydiff_softmax_state_<in>` then `keydiff_softmax_sums_<in>_<out>` on `scores`,
/// `[rows, t]` contiguous, rows as for [`causal_softmax`] (head h's queries are rows
/// h · chunk ..). Returns the probabilities `[rows · t]` widened to f32 (exactly), written in
/// f32 (`probs` = `Some(true)`) or in the scores' dtype (`Some(false)`), or `None` when `probs`
/// is `None` (none written); and the sums over the last `stat_rows` queries of each head of its
/// probabilities, `[rows / chunk · t]` in f32.
pub fn softmax_sums(
    scores: Keys<'_>,
    rows: usize,
    t: usize,
    chunk: usize,
    stat_rows: usize,
    probs: Option<bool>,
    seed: u64,
) -> Result<(Option<Vec<f32>>, Vec<f32>)> {
    check_softmax_sums(rows, t, chunk, stat_rows)?;
    let (dtype, bytes, len, elem) = scores.parts();
    let n = rows * t;
    if len < n {
        bail!("softmax sums: {len} scores, not {rows} × {t}");
    }
    let heads = rows / chunk;
    let (out_dtype, out_elem) = match probs {
        Some(true) => (0, 4),
        Some(false) => (dtype, elem),
        None => (-1, 0),
    };
    let side = Side::for_seed(seed);
    let sf = Fenced::copy_of("softmax-sums scores", &bytes[..n * elem], side, 16)?;
    // NaN bytes (all ones) wherever a value is never written.
    let mut state = Fenced::filled("softmax-sums row states", rows * 2, f32::NAN, side, 16)?;
    let mut out = Fenced::filled("softmax-sums probabilities", n * out_elem, 0xFFu8, side, 16)?;
    let mut stats = Fenced::filled("softmax-sums statistics", heads * t, f32::NAN, side, 16)?;
    // `check_softmax_sums` bounds them to `int`.
    let (t32, chunk32, r32) = (t as c_int, chunk as c_int, stat_rows as c_int);
    // Launch 1: block r reads row r and writes its state.
    let l = softmax_launch(rows);
    sf.view(rows, t * elem, 1, t * elem, t * elem, HeadAxis::X)?;
    state.view(rows, 2, 1, 2, 2, HeadAxis::X)?;
    call("softmax state", |err, err_len| {
        // SAFETY: block r reads the t scores of row r and writes the two values of row r of
        // the state, both checked and allocated above.
        unsafe {
            kd_emu_softmax_state(
                dtype,
                sf.as_ptr(),
                state.as_mut_ptr(),
                t32,
                chunk32,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    // Launch 2: the blocks of grid.y = h touch head h's rows and statistics alone.
    let l = softmax_sums_launch(t, heads);
    sf.view(
        heads,
        chunk * t * elem,
        chunk,
        t * elem,
        t * elem,
        HeadAxis::Y,
    )?;
    state.view(heads, 2 * chunk, chunk, 2, 2, HeadAxis::Y)?;
    out.view(
        heads,
        chunk * t * out_elem,
        chunk,
        t * out_elem,
        t * out_elem,
        HeadAxis::Y,
    )?;
    stats.view(heads, t, 1, t, t, HeadAxis::Y)?;
    call("softmax sums", |err, err_len| {
        // SAFETY: the thread of key c of head h reads column c of the head's rows of scores
        // and their states, and writes that column of the head's rows of probabilities (when
        // asked for) and of its statistics, all checked and allocated above.
        unsafe {
            kd_emu_softmax_sums(
                dtype,
                out_dtype,
                sf.as_ptr(),
                state.as_ptr(),
                if probs.is_some() {
                    out.as_mut_ptr()
                } else {
                    std::ptr::null_mut()
                },
                stats.as_mut_ptr(),
                t32,
                chunk32,
                r32,
                l.grid.0,
                l.grid.1,
                l.block,
                seed + 1,
                err,
                err_len,
            )
        }
    })?;
    sf.finish()?;
    state.finish()?;
    let p = out.finish()?;
    let p = probs.map(|_| widen(out_dtype, &p));
    Ok((p, stats.finish()?))
}

/// `keydiff_add_rms_norm_<dtype>` on `x` and `r` (`[rows, cols]` contiguous) and the norm's
/// weight `w` (`[cols]`), all of one dtype: returns `[2, rows, cols]` widened to f32 (exactly),
/// the sums x + r as rounded to the dtype, then their RMSNorm times `w`.
pub fn add_rms_norm(
    x: Keys<'_>,
    r: Keys<'_>,
    w: Keys<'_>,
    rows: usize,
    cols: usize,
    eps: f32,
    seed: u64,
) -> Result<Vec<f32>> {
    check_norm(rows, cols)?;
    let (dtype, xb, x_len, elem) = x.parts();
    let (r_dtype, rb, r_len, _) = r.parts();
    let (w_dtype, wb, w_len, _) = w.parts();
    if r_dtype != dtype || w_dtype != dtype {
        bail!("add-rms-norm: x, r and w must be of one dtype");
    }
    let n = rows * cols;
    if x_len < n || r_len < n || w_len < cols {
        bail!("add-rms-norm: x {x_len}, r {r_len}, w {w_len} values for {rows} rows of {cols}");
    }
    let l = norm_launch(rows);
    let side = Side::for_seed(seed);
    let xf = Fenced::copy_of("add-rms-norm x", &xb[..n * elem], side, 16)?;
    let rf = Fenced::copy_of("add-rms-norm r", &rb[..n * elem], side, 16)?;
    let wf = Fenced::copy_of("add-rms-norm w", &wb[..cols * elem], side, 16)?;
    // Bytes of all ones: NaN in every dtype, so a value never written shows.
    let mut out = Fenced::filled("add-rms-norm out", 2 * n * elem, 0xFFu8, side, 16)?;
    // Block i touches row i of x, r and both halves of out.
    let row = cols * elem;
    xf.view(rows, row, 1, row, row, HeadAxis::X)?;
    rf.view(rows, row, 1, row, row, HeadAxis::X)?;
    out.view(rows, row, 2, n * elem, row, HeadAxis::X)?;
    // `check_norm` bounds them to `int`.
    let (rows32, cols32) = (rows as c_int, cols as c_int);
    call("add-rms-norm", |err, err_len| {
        // SAFETY: block i reads row i of x and r and all of w, and writes row i of each half of
        // the 2 · rows · cols values of `out`, as checked and allocated above.
        unsafe {
            kd_emu_add_rms_norm(
                dtype,
                xf.as_ptr(),
                rf.as_ptr(),
                wf.as_ptr(),
                out.as_mut_ptr(),
                rows32,
                cols32,
                eps,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    xf.finish()?;
    rf.finish()?;
    wf.finish()?;
    Ok(widen(dtype, &out.finish()?))
}

/// `keydiff_argmax_rows_<dtype>` on `x`, a `[rows, cols]` view at element row stride `rs`
/// (rows contiguous): each row's greedy token, the first index of its largest value (NaNs
/// skipped; 0 when the row starts with NaN).
pub fn argmax_rows(
    x: Keys<'_>,
    rs: usize,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Vec<u32>> {
    check_argmax(rows, cols)?;
    let (dtype, xb, x_len, elem) = x.parts();
    if rs < cols {
        bail!("argmax: row stride {rs} below the {cols} values of a row");
    }
    let extent = (rows - 1) * rs + cols;
    if x_len < extent {
        bail!("argmax: a view of {extent} values exceeds the {x_len} given");
    }
    let l = argmax_launch(rows);
    let side = Side::for_seed(seed);
    let xf = Fenced::copy_of("argmax x", &xb[..extent * elem], side, 16)?;
    // Never a token of a row of `cols`: a row left unwritten shows.
    let mut out = Fenced::filled("argmax out", rows, u32::MAX, side, 16)?;
    // Block r reads row r only (a "head" per row, by blockIdx.x), and writes its one word.
    xf.view(rows, rs * elem, 1, cols * elem, cols * elem, HeadAxis::X)?;
    out.view(rows, 1, 1, 1, 1, HeadAxis::X)?;
    call("argmax", |err, err_len| {
        // SAFETY: block r reads the `cols` values of row r of the view checked above and
        // writes out[r].
        unsafe {
            kd_emu_argmax_rows(
                dtype,
                xf.as_ptr(),
                rs as i64,
                out.as_mut_ptr(),
                cols as c_int,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    xf.finish()?;
    out.finish()
}

/// `keydiff_sample_rows_<dtype>` on `x`, a `[rows, cols]` view at element row stride `rs`
/// (rows contiguous), with `params` (`[rows, SAMPLE_PARAM_WORDS]`: temperature, top-k, top-p,
/// min-p, the draw, the truncations' temperature): each row's token as the host sampler draws it (see the kernel), with
/// [`crate::geometry::SAMPLE_NO_DRAW`] set where a row has no finite logit.
pub fn sample_rows(
    x: Keys<'_>,
    rs: usize,
    rows: usize,
    cols: usize,
    params: &[u32],
    seed: u64,
) -> Result<Vec<u32>> {
    check_sample(rows, cols)?;
    let (dtype, xb, x_len, elem) = x.parts();
    if rs < cols {
        bail!("sample: row stride {rs} below the {cols} values of a row");
    }
    let extent = (rows - 1) * rs + cols;
    if x_len < extent {
        bail!("sample: a view of {extent} values exceeds the {x_len} given");
    }
    if params.len() != rows * SAMPLE_PARAM_WORDS {
        bail!(
            "sample: {} parameter words for {rows} rows ({SAMPLE_PARAM_WORDS} a row)",
            params.len()
        );
    }
    let l = sample_launch(rows);
    let side = Side::for_seed(seed);
    let xf = Fenced::copy_of("sample x", &xb[..extent * elem], side, 16)?;
    let pf = Fenced::copy_of("sample params", params, side, 16)?;
    // Never a token of a row of `cols` (nor the no-draw flag with one): a row left unwritten
    // shows.
    let mut out = Fenced::filled("sample out", rows, u32::MAX, side, 16)?;
    // Block r reads row r and its parameters only, and writes its one word.
    xf.view(rows, rs * elem, 1, cols * elem, cols * elem, HeadAxis::X)?;
    let w = SAMPLE_PARAM_WORDS;
    pf.view(rows, w, 1, w, w, HeadAxis::X)?;
    out.view(rows, 1, 1, 1, 1, HeadAxis::X)?;
    call("sample", |err, err_len| {
        // SAFETY: block r reads the `cols` values of row r of the view checked above and its
        // SAMPLE_PARAM_WORDS parameter words, and writes out[r].
        unsafe {
            kd_emu_sample_rows(
                dtype,
                xf.as_ptr(),
                rs as i64,
                pf.as_ptr().cast(),
                out.as_mut_ptr(),
                cols as c_int,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    xf.finish()?;
    pf.finish()?;
    out.finish()
}

/// `keydiff_silu_mul_<dtype>` on `gate` and `up`, `[rows, cols]` views at element row strides
/// `gate_rs` and `up_rs` (rows contiguous), of one dtype: returns silu(gate) · up, `[rows ·
/// cols]` widened to f32 (exactly).
pub fn silu_mul(
    gate: Keys<'_>,
    gate_rs: usize,
    up: Keys<'_>,
    up_rs: usize,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Vec<f32>> {
    check_act(rows, cols)?;
    let (dtype, gb, g_len, elem) = gate.parts();
    let (u_dtype, ub, u_len, _) = up.parts();
    if u_dtype != dtype {
        bail!("silu-mul: gate and up must be of one dtype");
    }
    if gate_rs < cols || up_rs < cols {
        bail!("silu-mul: row strides {gate_rs}, {up_rs} below the {cols} values of a row");
    }
    let g_extent = (rows - 1) * gate_rs + cols;
    let u_extent = (rows - 1) * up_rs + cols;
    if g_len < g_extent || u_len < u_extent {
        bail!(
            "silu-mul: views of {g_extent} and {u_extent} values exceed gate {g_len}, up {u_len}"
        );
    }
    let n = rows * cols;
    let l = act_launch(n);
    let side = Side::for_seed(seed);
    let gf = Fenced::copy_of("silu-mul gate", &gb[..g_extent * elem], side, 16)?;
    let uf = Fenced::copy_of("silu-mul up", &ub[..u_extent * elem], side, 16)?;
    // Bytes of all ones: NaN in every dtype, so a value never written shows.
    let mut out = Fenced::filled("silu-mul out", n * elem, 0xFFu8, side, 16)?;
    // Any block may touch any row (one "head": the whole view).
    gf.view(
        1,
        g_extent * elem,
        rows,
        gate_rs * elem,
        cols * elem,
        HeadAxis::Y,
    )?;
    uf.view(
        1,
        u_extent * elem,
        rows,
        up_rs * elem,
        cols * elem,
        HeadAxis::Y,
    )?;
    call("silu-mul", |err, err_len| {
        // SAFETY: the kernel reads the rows · cols values of both views checked above and
        // writes the rows · cols values of `out`.
        unsafe {
            kd_emu_silu_mul(
                dtype,
                gf.as_ptr(),
                gate_rs as i64,
                uf.as_ptr(),
                up_rs as i64,
                out.as_mut_ptr(),
                rows as i64,
                cols as c_int,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    gf.finish()?;
    uf.finish()?;
    Ok(widen(dtype, &out.finish()?))
}

/// `keydiff_rope_qk_<dtype>` on `q` (`hq` heads) and `k` (`hk` heads) of `rows` rows of `d`
/// values at element strides `(head, row)` (each head's values contiguous), `cos` and `sin`
/// `[rows, d / 2]`, one dtype: returns the rotated queries then keys, `[(hq + hk) · rows · d]`
/// widened to f32 (exactly).
#[allow(clippy::too_many_arguments)]
pub fn rope_qk(
    (q, q_hs, q_rs): (Keys<'_>, usize, usize),
    (k, k_hs, k_rs): (Keys<'_>, usize, usize),
    cos: Keys<'_>,
    sin: Keys<'_>,
    (hq, hk, rows, d): (usize, usize, usize, usize),
    interleaved: bool,
    seed: u64,
) -> Result<Vec<f32>> {
    check_rope(hq, hk, rows, d)?;
    let (dtype, qb, q_len, elem) = q.parts();
    let (k_dtype, kb, k_len, _) = k.parts();
    let (c_dtype, cb, c_len, _) = cos.parts();
    let (s_dtype, sb, s_len, _) = sin.parts();
    if [k_dtype, c_dtype, s_dtype] != [dtype; 3] {
        bail!("rope: q, k, cos and sin must be of one dtype");
    }
    let half = d / 2;
    if c_len < rows * half || s_len < rows * half {
        bail!("rope: cos ({c_len}) and sin ({s_len}) hold fewer than {rows} rows of {half}");
    }
    let q_extent = check_extent("rope q", q_len, elem, hq, rows, d, q_hs, q_rs)?;
    let k_extent = check_extent("rope k", k_len, elem, hk, rows, d, k_hs, k_rs)?;
    let n = (hq + hk) * rows * d;
    let l = rope_launch(n / 2);
    let side = Side::for_seed(seed);
    let qf = Fenced::copy_of("rope q", &qb[..q_extent * elem], side, 16)?;
    let kf = Fenced::copy_of("rope k", &kb[..k_extent * elem], side, 16)?;
    let cf = Fenced::copy_of("rope cos", &cb[..rows * half * elem], side, 16)?;
    let sf = Fenced::copy_of("rope sin", &sb[..rows * half * elem], side, 16)?;
    // Bytes of all ones: NaN in every dtype, so a value never written shows.
    let mut out = Fenced::filled("rope out", n * elem, 0xFFu8, side, 16)?;
    // Any block may touch any pair: each view as one "head" of rows, where its heads nest in
    // its rows (a projection's output, heads side by side) or its rows in its heads (heads one
    // after another); other layouts are only fenced.
    let one_head = |f: &Fenced<u8>, heads: usize, hs: usize, rs: usize| -> Result<()> {
        if hs == d && rs >= heads * d {
            f.view(1, 0, rows, rs * elem, heads * d * elem, HeadAxis::Y)
        } else if rs == d && (heads == 1 || hs == rows * d) {
            f.view(1, 0, heads * rows, d * elem, d * elem, HeadAxis::Y)
        } else {
            Ok(())
        }
    };
    one_head(&qf, hq, q_hs, q_rs)?;
    one_head(&kf, hk, k_hs, k_rs)?;
    call("rope", |err, err_len| {
        // SAFETY: the kernel reads the q and k views and cos/sin's rows · d / 2 values checked
        // above, and writes the n values of `out`.
        unsafe {
            kd_emu_rope_qk(
                dtype,
                qf.as_ptr(),
                q_rs as i64,
                q_hs as i64,
                kf.as_ptr(),
                k_rs as i64,
                k_hs as i64,
                cf.as_ptr(),
                sf.as_ptr(),
                out.as_mut_ptr(),
                hq as c_int,
                hk as c_int,
                rows as c_int,
                d as c_int,
                interleaved as c_int,
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    qf.finish()?;
    kf.finish()?;
    cf.finish()?;
    sf.finish()?;
    Ok(widen(dtype, &out.finish()?))
}

/// Values of dtype code `dtype` (0 f32, 1 f16, 2 bf16) from their little-endian bytes, as f32.
fn widen(dtype: c_int, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        0 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        1 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

/// Bytes of a block of `kind` (an unknown kind is an error).
fn kvq_bytes(kind: i32) -> Result<usize> {
    match usize::try_from(kind).ok().and_then(|k| KVQ_BYTES.get(k)) {
        Some(&b) => Ok(b),
        None => bail!("kv blocks: no block type {kind}"),
    }
}

/// The selection and move plan, split as `blocks` says: `keydiff_select_plan` (one block per
/// head), `keydiff_select_pass` per digit, `keydiff_select_count` and `keydiff_select_emit`
/// (many blocks per head, launched in that order on one zeroed workspace, as on CUDA), or
/// `keydiff_select_few` (many blocks, one launch, on its own zeroed workspace).
/// `scores` and `positions` hold `kv` rows of `n` at their strides. Returns the plan
/// `[kv, 1 + 2M]`: per head the number of moves, M sources, M destinations.
#[allow(clippy::too_many_arguments)]
pub fn select_plan(
    scores: &[f32],
    score_stride: usize,
    positions: &[u32],
    pos_stride: usize,
    kv: usize,
    n: usize,
    budget: usize,
    sinks: usize,
    recent: usize,
    blocks: SelectBlocks,
    seed: u64,
) -> Result<Vec<u32>> {
    check_select(kv, n, budget, recent)?;
    let score_extent = check_extent(
        "select-plan scores",
        scores.len(),
        4,
        kv,
        1,
        n,
        score_stride,
        0,
    )?;
    let pos_extent = check_extent(
        "select-plan positions",
        positions.len(),
        4,
        kv,
        1,
        n,
        pos_stride,
        0,
    )?;
    let cols = 1 + 2 * plan_moves(n, budget);
    let side = Side::for_seed(seed);
    let scores = Fenced::copy_of("select-plan scores", &scores[..score_extent], side, 4)?;
    let positions = Fenced::copy_of("select-plan positions", &positions[..pos_extent], side, 4)?;
    // Not zeroed, unlike the CUDA launch: every entry the kernel should write is checked.
    let mut plan = Fenced::filled("select-plan plan", kv * cols, u32::MAX, side, 4)?;
    let sinks32 = sinks.min(u32::MAX as usize) as u32;
    let blocks = blocks.resolve(n, budget, recent)?;
    if blocks == SelectBlocks::One {
        // One block per head.
        scores.view(kv, score_stride, 1, 0, n, HeadAxis::X)?;
        positions.view(kv, pos_stride, 1, 0, n, HeadAxis::X)?;
        plan.view(kv, cols, 1, 0, cols, HeadAxis::X)?;
        let l = per_head_launch(kv);
        call("select-plan", |err, err_len| {
            // SAFETY: reads kv rows of n inside the checked extents; writes the plan rows
            // allocated here (the kernel caps its writes at M per row).
            unsafe {
                kd_emu_select_plan(
                    scores.as_ptr(),
                    score_stride as i64,
                    positions.as_ptr(),
                    pos_stride as i64,
                    n as c_int,
                    budget as c_int,
                    sinks32,
                    recent as c_int,
                    plan.as_mut_ptr(),
                    cols as i64,
                    l.grid.0,
                    l.block,
                    seed,
                    err,
                    err_len,
                )
            }
        })?;
    } else {
        // Slices of a head on grid.x, heads on grid.y.
        scores.view(kv, score_stride, 1, 0, n, HeadAxis::Y)?;
        positions.view(kv, pos_stride, 1, 0, n, HeadAxis::Y)?;
        plan.view(kv, cols, 1, 0, cols, HeadAxis::Y)?;
        let few = blocks == SelectBlocks::Few;
        let ws_stride = if few {
            select_few_workspace(n, budget, recent)
        } else {
            select_workspace(n)
        };
        let mut ws = Fenced::filled("select-plan workspace", kv * ws_stride, 0u32, side, 4)?;
        ws.view(kv, ws_stride, 1, 0, ws_stride, HeadAxis::Y)?;
        let (l, launches): (_, Vec<(c_int, usize)>) = if few {
            (select_few_launch(kv, n), vec![(3, 0)])
        } else {
            let passes = select_passes(recent).map(|p| (0, p));
            (
                select_multi_launch(kv, n),
                passes.chain([(1, 0), (2, 0)]).collect(),
            )
        };
        for (i, (which, pass)) in launches.into_iter().enumerate() {
            let what = ["select-pass", "select-count", "select-emit", "select-few"][which as usize];
            call(what, |err, err_len| {
                // SAFETY: reads kv rows of n inside the checked extents; reads and writes the
                // workspace and plan rows allocated here (ws_stride and cols words per head).
                unsafe {
                    kd_emu_select_multi(
                        which,
                        scores.as_ptr(),
                        score_stride as i64,
                        positions.as_ptr(),
                        pos_stride as i64,
                        n as c_int,
                        budget as c_int,
                        sinks32,
                        recent as c_int,
                        pass as c_int,
                        plan.as_mut_ptr(),
                        cols as i64,
                        ws.as_mut_ptr(),
                        ws_stride as i64,
                        l.grid.0,
                        l.grid.1,
                        l.block,
                        seed.wrapping_add(i as u64),
                        err,
                        err_len,
                    )
                }
            })?;
        }
        ws.finish()?;
    }
    scores.finish()?;
    positions.finish()?;
    plan.finish()
}

/// `keydiff_move_rows` on `buf` viewed as `[kv, rows, row_len]` with element strides
/// `(head_stride, row_stride, 1)`, after a plan `[kv, 1 + 2M]` from [`select_plan`]. As on the
/// GPU, the kernel itself skips moves that name a row outside `[0, rows)`; this wrapper only
/// refuses indices past what `buf` holds at these strides, so that the kernel's own bound is
/// what keeps moves inside the view (and can be tested). The kernel gets a fenced copy of the
/// view's extent; the rest of `buf` is left as it was.
#[allow(clippy::too_many_arguments)]
pub fn move_rows<T: Copy>(
    buf: &mut [T],
    kv: usize,
    rows: usize,
    row_len: usize,
    head_stride: usize,
    row_stride: usize,
    plan: &[u32],
    seed: u64,
) -> Result<()> {
    if kv == 0 || !plan.len().is_multiple_of(kv) || (plan.len() / kv).is_multiple_of(2) {
        bail!(
            "move-rows: plan of {} entries does not fit {kv} heads",
            plan.len()
        );
    }
    let elem = std::mem::size_of::<T>();
    let extent = check_extent(
        "move-rows",
        buf.len(),
        elem,
        kv,
        rows,
        row_len,
        head_stride,
        row_stride,
    )?;
    let cols = plan.len() / kv;
    let m = (cols - 1) / 2;
    if m > i32::MAX as usize || row_len * elem > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("move-rows: {m} moves or rows of {row_len} × {elem} bytes past the kernel's int");
    }
    // Rows of the last head that fit in `buf` (the extent check above covers `rows`).
    let tail = (kv - 1)
        .checked_mul(head_stride)
        .and_then(|start| buf.len().checked_sub(start))
        .and_then(|left| left.checked_sub(row_len));
    let held = match (row_stride, tail) {
        (_, None) => 0,
        (0, Some(_)) => rows,
        (rs, Some(t)) => t / rs + 1,
    };
    for (h, row) in plan.chunks(cols).enumerate() {
        let count = (row[0] as usize).min(m);
        let (src, dst) = (&row[1..1 + count], &row[1 + m..1 + m + count]);
        if let Some(bad) = src.iter().chain(dst).find(|&&i| i as usize >= held) {
            bail!("move-rows: head {h} moves row {bad}, past the {held} rows the buffer holds");
        }
    }
    if m == 0 {
        return Ok(());
    }
    let l = move_launch(m, kv);
    let side = Side::for_seed(seed);
    // The view's extent only: a move past the view faults. 16-byte aligned, like a device
    // allocation, where the strides and rows are multiples of 16 bytes (then the extent is
    // too, and the end lies flush against the guard), so that the kernel's vector path runs.
    let align = if [head_stride, row_stride, row_len]
        .iter()
        .all(|&x| (x * elem).is_multiple_of(16))
    {
        16
    } else {
        elem
    };
    let mut fenced = Fenced::copy_of("move-rows buffer", &buf[..extent], side, align)?;
    let plan = Fenced::copy_of("move-rows plan", plan, side, 4)?;
    // Blocks of (moves, head).
    fenced.view(kv, head_stride, rows, row_stride, row_len, HeadAxis::Y)?;
    plan.view(kv, cols, 1, 0, cols, HeadAxis::Y)?;
    call("move-rows", |err, err_len| {
        // SAFETY: every row the plan names lies inside `buf` (checked above), and the kernel
        // writes no row outside [0, rows).
        unsafe {
            kd_emu_move_rows(
                fenced.as_mut_ptr().cast(),
                (head_stride * elem) as i64,
                (row_stride * elem) as i64,
                (row_len * elem) as c_int,
                rows as c_int,
                plan.as_ptr(),
                cols as i64,
                m as c_int,
                l.grid.0,
                l.grid.1,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    plan.finish()?;
    buf[..extent].copy_from_slice(&fenced.finish()?);
    Ok(())
}

/// Bytes at a head stride and a row stride (both in bytes): the rows of a view.
#[derive(Debug, Clone, Copy)]
pub struct ByteRows<'a> {
    pub bytes: &'a [u8],
    pub head_stride: usize,
    pub row_stride: usize,
}

/// A layer cache's buffers as `keydiff_append_rows` writes them: K and V, `[kv, capacity]`
/// rows at one pair of byte strides; positions and state, `[kv, capacity]` at one head stride
/// (elements, slots contiguous).
#[derive(Debug, Clone)]
pub struct AppendBuffers {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    pub head_stride: usize,
    pub row_stride: usize,
    pub capacity: usize,
    pub positions: Vec<u32>,
    pub state: Vec<f32>,
    pub meta_stride: usize,
}

/// `keydiff_append_rows`: `kv` heads × `chunk` rows of `row_bytes` bytes of `k` and `v` written
/// to slots `slot .. slot + chunk` of `bufs`' K and V, positions `pos0 ..` and state 0, in
/// place. Everything else in the buffers must come out unchanged (the caller compares).
#[allow(clippy::too_many_arguments)]
pub fn append_rows(
    k: ByteRows<'_>,
    v: ByteRows<'_>,
    bufs: &mut AppendBuffers,
    kv: usize,
    chunk: usize,
    row_bytes: usize,
    slot: usize,
    pos0: usize,
    seed: u64,
) -> Result<()> {
    check_append(kv, chunk, row_bytes, slot, bufs.capacity, pos0)?;
    let rows = |what, r: &ByteRows<'_>| {
        check_extent(
            what,
            r.bytes.len(),
            1,
            kv,
            chunk,
            row_bytes,
            r.head_stride,
            r.row_stride,
        )
    };
    let (k_extent, v_extent) = (rows("append k", &k)?, rows("append v", &v)?);
    let (hs, rs, cap) = (bufs.head_stride, bufs.row_stride, bufs.capacity);
    let buf_extent = check_extent(
        "append k buffer",
        bufs.k.len(),
        1,
        kv,
        cap,
        row_bytes,
        hs,
        rs,
    )?;
    check_extent(
        "append v buffer",
        bufs.v.len(),
        1,
        kv,
        cap,
        row_bytes,
        hs,
        rs,
    )?;
    let ms = bufs.meta_stride;
    let meta_extent = check_extent(
        "append positions",
        bufs.positions.len(),
        4,
        kv,
        1,
        cap,
        ms,
        0,
    )?;
    check_extent("append state", bufs.state.len(), 4, kv, 1, cap, ms, 0)?;
    let l = append_launch(chunk, kv);
    let side = Side::for_seed(seed);
    // 16-byte aligned, like a device allocation, where the strides and rows allow it, so that
    // the kernel's vector path runs; else aligned to a row's 4-byte words or to bytes.
    let align = |strides: [usize; 2]| {
        let all = [strides[0], strides[1], row_bytes];
        if all.iter().all(|x| x % 16 == 0) {
            16
        } else if all.iter().all(|x| x % 4 == 0) {
            4
        } else {
            1
        }
    };
    let kf = Fenced::copy_of(
        "append k",
        &k.bytes[..k_extent],
        side,
        align([k.head_stride, k.row_stride]),
    )?;
    let vf = Fenced::copy_of(
        "append v",
        &v.bytes[..v_extent],
        side,
        align([v.head_stride, v.row_stride]),
    )?;
    let mut kb = Fenced::copy_of(
        "append k buffer",
        &bufs.k[..buf_extent],
        side,
        align([hs, rs]),
    )?;
    let mut vb = Fenced::copy_of(
        "append v buffer",
        &bufs.v[..buf_extent],
        side,
        align([hs, rs]),
    )?;
    let mut pf = Fenced::copy_of("append positions", &bufs.positions[..meta_extent], side, 4)?;
    let mut sf = Fenced::copy_of("append state", &bufs.state[..meta_extent], side, 4)?;
    // Blocks of (rows, head): each head's chunk rows, and its slots up to the last written.
    kf.view(
        kv,
        k.head_stride,
        chunk,
        k.row_stride,
        row_bytes,
        HeadAxis::Y,
    )?;
    vf.view(
        kv,
        v.head_stride,
        chunk,
        v.row_stride,
        row_bytes,
        HeadAxis::Y,
    )?;
    let end = slot + chunk;
    kb.view(kv, hs, end, rs, row_bytes, HeadAxis::Y)?;
    vb.view(kv, hs, end, rs, row_bytes, HeadAxis::Y)?;
    pf.view(kv, ms, 1, 0, end, HeadAxis::Y)?;
    sf.view(kv, ms, 1, 0, end, HeadAxis::Y)?;
    call("append", |err, err_len| {
        // SAFETY: the kernel reads the chunk's rows of both views and writes slots below
        // `slot + chunk` of each head of the buffers, all checked to fit above.
        unsafe {
            kd_emu_append_rows(
                kf.as_ptr(),
                k.head_stride as i64,
                k.row_stride as i64,
                vf.as_ptr(),
                v.head_stride as i64,
                v.row_stride as i64,
                kb.as_mut_ptr(),
                vb.as_mut_ptr(),
                hs as i64,
                rs as i64,
                row_bytes as c_int,
                pf.as_mut_ptr(),
                sf.as_mut_ptr(),
                ms as i64,
                slot as c_int,
                chunk as c_int,
                pos0 as c_uint,
                l.grid.0,
                l.grid.1,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    kf.finish()?;
    vf.finish()?;
    bufs.k[..buf_extent].copy_from_slice(&kb.finish()?);
    bufs.v[..buf_extent].copy_from_slice(&vb.finish()?);
    bufs.positions[..meta_extent].copy_from_slice(&pf.finish()?);
    bufs.state[..meta_extent].copy_from_slice(&sf.finish()?);
    Ok(())
}

/// `snapkv_pool`: `stats` and `positions` hold `kv` rows of `n` at their strides; positions are
/// unique per head. Returns `[kv · n]` pooled scores. As on the GPU, where nothing can refuse
/// them, positions at or past the bitmap (`span` rounded up to 32) are the kernel's to skip:
/// their slots get NaN and the others pool over the positions that remain. The bitmap and word
/// ranks get spare words past every position, so that a kernel that failed to skip could not
/// touch memory outside them; a write there is reported as an error.
#[allow(clippy::too_many_arguments)]
pub fn snapkv_pool(
    stats: &[f32],
    stats_stride: usize,
    positions: &[u32],
    pos_stride: usize,
    kv: usize,
    n: usize,
    span: usize,
    seed: u64,
) -> Result<Vec<f32>> {
    check_pool(kv, n, span)?;
    let stats_extent = check_extent(
        "snapkv-pool stats",
        stats.len(),
        4,
        kv,
        1,
        n,
        stats_stride,
        0,
    )?;
    let pos_extent = check_extent(
        "snapkv-pool positions",
        positions.len(),
        4,
        kv,
        1,
        n,
        pos_stride,
        0,
    )?;
    let words = pool_words(span);
    let rows = |h: usize| &positions[h * pos_stride..h * pos_stride + n];
    let top_word = (0..kv)
        .flat_map(|h| rows(h).iter())
        .map(|&p| (p >> 5) as usize)
        .max()
        .unwrap_or(0);
    // Unique positions give ranks below n (a repeated one would leave a slot of `sorted`
    // unwritten, and the kernel would read through it).
    let mut seen = vec![0u32; top_word + 1];
    for h in 0..kv {
        seen.fill(0);
        for &p in rows(h) {
            let (w, bit) = ((p >> 5) as usize, 1u32 << (p & 31));
            if seen[w] & bit != 0 {
                bail!("snapkv-pool: head {h} has position {p} twice");
            }
            seen[w] |= bit;
        }
    }
    // Room for any word a position names from the last head; spare word ranks are 0, so that
    // a rank read from them stays below n.
    let len = (kv * words).max((kv - 1) * words + top_word + 1);
    let side = Side::for_seed(seed);
    let stats = Fenced::copy_of("snapkv-pool stats", &stats[..stats_extent], side, 4)?;
    let positions = Fenced::copy_of("snapkv-pool positions", &positions[..pos_extent], side, 4)?;
    let mut bitmap = Fenced::filled("snapkv-pool bitmap", len, 0u32, side, 4)?;
    let mut word_rank = vec![u32::MAX; kv * words];
    word_rank.resize(len, 0);
    let mut word_rank = Fenced::copy_of("snapkv-pool word ranks", &word_rank, side, 4)?;
    let mut sorted = Fenced::filled("snapkv-pool sorted", kv * n, u32::MAX, side, 4)?;
    let mut scores = Fenced::filled("snapkv-pool scores", kv * n, f32::NAN, side, 4)?;
    // One block per head; the spare words past kv · words are no head's.
    stats.view(kv, stats_stride, 1, 0, n, HeadAxis::X)?;
    positions.view(kv, pos_stride, 1, 0, n, HeadAxis::X)?;
    bitmap.view(kv, words, 1, 0, words, HeadAxis::X)?;
    word_rank.view(kv, words, 1, 0, words, HeadAxis::X)?;
    sorted.view(kv, n, 1, 0, n, HeadAxis::X)?;
    scores.view(kv, n, 1, 0, n, HeadAxis::X)?;
    let l = per_head_launch(kv);
    call("snapkv-pool", |err, err_len| {
        // SAFETY: reads inside the checked extents; every position's word lies inside the
        // bitmap and word ranks (sized above); unique positions have ranks < n, which index
        // `sorted`; skipped ones leave entries past the ranked count, which no window reads.
        unsafe {
            kd_emu_snapkv_pool(
                stats.as_ptr(),
                stats_stride as i64,
                positions.as_ptr(),
                pos_stride as i64,
                n as c_int,
                bitmap.as_mut_ptr(),
                words as c_int,
                word_rank.as_mut_ptr(),
                sorted.as_mut_ptr(),
                scores.as_mut_ptr(),
                l.grid.0,
                l.block,
                seed,
                err,
                err_len,
            )
        }
    })?;
    if bitmap.as_slice()[kv * words..].iter().any(|&w| w != 0) {
        bail!("snapkv-pool (emulated): the kernel set bits past its bitmap");
    }
    stats.finish()?;
    positions.finish()?;
    bitmap.finish()?;
    word_rank.finish()?;
    sorted.finish()?;
    scores.finish()
}

/// The emulation's self-test kernels (`kernels/emu/launch.cpp`): 0 a correct reduction,
/// 1 diverged shuffle, 2 exited lane, 3 split barrier, 4 partial mask, 5 a race, 6–9 launch
/// configurations CUDA refuses, 10 shared memory read before it is written, 11 a race between
/// blocks, 12 correct atomics over two blocks, 13 a read racing atomics, 14 a block reading
/// another head's rows (`out` viewed as 2 heads of 128), 15 writes to row padding (`out` viewed
/// as 4 rows of 32 at a stride of 64), 16 a read one past the end of `out` (odd seeds only: for
/// even ones the buffer's end touches its guard page, and the process aborts), 17 a shared
/// counter zeroed and updated atomically with no barrier between, 18 a thread that outgrows its
/// fiber stack (the process aborts: the fault handler of [`crate::fence`] reports it). Returns the
/// kernel's 256 outputs (global memory, fenced as `self-test out`, initially −1), or the
/// emulation's error.
pub fn selftest(which: i32, seed: u64) -> Result<Vec<i32>> {
    let side = Side::for_seed(seed);
    if which == 16 && side == Side::End {
        bail!("self-test 16 reads past the end of its buffer: it needs an odd seed");
    }
    let mut out = Fenced::filled("self-test out", 256, -1 as c_int, side, 4)?;
    match which {
        14 => out.view(2, 128, 1, 0, 128, HeadAxis::X)?,
        15 => out.view(1, 256, 4, 64, 32, HeadAxis::X)?,
        _ => {}
    }
    call("self-test", |err, err_len| {
        // SAFETY: the self-test kernels write at most 256 ints; 16 reads one past them, inside
        // the mapping (odd seeds fence the start).
        unsafe { kd_emu_selftest(which, seed, out.as_mut_ptr(), err, err_len) }
    })?;
    out.finish()
}
