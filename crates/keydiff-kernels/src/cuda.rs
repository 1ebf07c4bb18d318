//! Launch wrappers. Every function checks shapes and strides before it launches, and returns
//! candle errors, never panics.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape};
use half::{bf16, f16};

use crate::geometry::{
    act_launch, append_launch, argmax_launch, check_act, check_append, check_argmax, check_decode,
    check_decode_kvq, check_kvq, check_norm, check_pool, check_rope, check_sample, check_scores,
    check_select, check_softmax, check_softmax_sums, decode_combine_launch, decode_lanes,
    decode_launch, decode_split, kvq_launch, move_launch, norm_launch, per_head_launch, plan_moves,
    pool_words, rope_launch, sample_launch, scores_launch, select_few_launch, select_few_workspace,
    select_multi_launch, select_passes, select_workspace, softmax_launch, softmax_sums_launch,
    vector_loads_fit, Launch, ScoreLoads, SelectBlocks, KVQ_FP8, MAX_HEADS, SAMPLE_PARAM_WORDS,
};

/// PTX of `kernels/keydiff.cu`.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/keydiff.ptx"));
const MODULE: &str = "keydiff";

fn launch_cfg(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (l.grid.0, l.grid.1, 1),
        block_dim: (l.block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// KeyDiff scores of `keys` (`[kv_heads, n, d]`, any head and row stride, rows contiguous,
/// f32/f16/bf16): `[kv_heads, n]` f32, s_i = −cos(k_i, μ). Two kernels: norms and anchor, then
/// cosines. `normalized` picks the anchor: mean of k̂ (true) or of k. `loads` picks the kernels
/// (see [`ScoreLoads`]; `Auto` for the engine).
pub fn keydiff_scores(
    keys: &CudaStorage,
    layout: &Layout,
    normalized: bool,
    loads: ScoreLoads,
) -> Result<(CudaStorage, Shape)> {
    let (kv, n, d) = layout.shape().dims3()?;
    let st = layout.stride();
    if st[2] != 1 {
        bail!("keydiff-scores needs contiguous key rows, got strides {st:?}");
    }
    check_scores(kv, n, d)?;
    let dev = keys.device().clone();
    let stream = dev.cuda_stream();
    // SAFETY: every element is written by pass 1 / pass 2 before it is read.
    let norms = unsafe { dev.alloc::<f32>(kv * n)? };
    let scores = unsafe { dev.alloc::<f32>(kv * n)? };
    let anchor = dev.alloc_zeros::<f32>(kv * d)?;
    let cfg = launch_cfg(scores_launch(kv, n));
    let (o, hs, rs) = (layout.start_offset(), st[0] as i64, st[1] as i64);
    let (n32, d32, norm) = (n as i32, d as i32, normalized as i32);

    macro_rules! passes {
        ($t:ty, $sfx:literal) => {{
            let src = keys.as_cuda_slice::<$t>()?.slice(o..);
            // The view's address: a 16-byte boundary is what `vector_loads_fit` asks of it.
            let start = {
                let (ptr, _sync) = src.device_ptr(&stream);
                ptr as usize % 16
            };
            let fits = vector_loads_fit(d, std::mem::size_of::<$t>(), start, st[0], st[1]);
            let (k1, k2) = match loads.resolve(fits)? {
                ScoreLoads::Vector => (
                    format!("keydiff_pass1v_{}_{d}", $sfx),
                    format!("keydiff_pass2v_{}_{d}", $sfx),
                ),
                _ => (
                    concat!("keydiff_pass1_", $sfx).to_string(),
                    concat!("keydiff_pass2_", $sfx).to_string(),
                ),
            };
            let f1 = dev.get_or_load_custom_func(&k1, MODULE, PTX)?;
            let mut b = f1.builder();
            b.arg(&src);
            b.arg(&hs);
            b.arg(&rs);
            b.arg(&n32);
            b.arg(&d32);
            b.arg(&norm);
            b.arg(&norms);
            b.arg(&anchor);
            // SAFETY: argument list matches `keydiff_pass1_*` and `keydiff_pass1v_*` (whose d
            // is the one it was picked by); bounds and, for the latter, alignment were checked
            // above.
            unsafe { b.launch(cfg) }.w()?;
            let f2 = dev.get_or_load_custom_func(&k2, MODULE, PTX)?;
            let mut b = f2.builder();
            b.arg(&src);
            b.arg(&hs);
            b.arg(&rs);
            b.arg(&n32);
            b.arg(&d32);
            b.arg(&norms);
            b.arg(&anchor);
            b.arg(&scores);
            // SAFETY: argument list matches `keydiff_pass2_*` and `keydiff_pass2v_*`.
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match keys.dtype() {
        DType::F32 => passes!(f32, "f32"),
        DType::F16 => passes!(f16, "f16"),
        DType::BF16 => passes!(bf16, "bf16"),
        dt => bail!("keydiff-scores: unsupported dtype {dt:?} (f32, f16, bf16)"),
    }
    Ok((
        CudaStorage::wrap_cuda_slice(scores, dev),
        Shape::from((kv, n)),
    ))
}

/// Checks a `[kv, n]` per-slot tensor against a `[kv, ≥ n]` positions tensor, rows contiguous,
/// at most [`MAX_HEADS`] heads (one block each); returns `(kv, n)`.
fn per_slot_pair(op: &str, values: &Layout, positions: &Layout) -> Result<(usize, usize)> {
    let (kv, n) = values.shape().dims2()?;
    let (pkv, pn) = positions.shape().dims2()?;
    if pkv != kv
        || pn < n
        || values.stride()[1] != 1
        || positions.stride()[1] != 1
        || kv > MAX_HEADS
    {
        bail!(
            "{op}: per-slot values {:?}/{:?} and positions {:?}/{:?} do not match",
            values.dims(),
            values.stride(),
            positions.dims(),
            positions.stride()
        );
    }
    Ok((kv, n))
}

/// Survivors and move plan per KV head: `scores` `[kv, n]` f32 (rows contiguous), `positions`
/// `[kv, ≥ n]` u32 (rows contiguous). Returns the plan `[kv, 1 + 2M]` u32: per head the number
/// of moves, then M sources, then M destinations (see `kernels/keydiff.cu`). `blocks` picks
/// one block per head, many, or many in one launch ([`SelectBlocks`]); all give the same plan.
#[allow(clippy::too_many_arguments)]
pub fn select_plan(
    scores: &CudaStorage,
    scores_layout: &Layout,
    positions: &CudaStorage,
    positions_layout: &Layout,
    budget: usize,
    sinks: usize,
    recent: usize,
    blocks: SelectBlocks,
) -> Result<(CudaStorage, Shape)> {
    let (kv, n) = per_slot_pair("select-plan", scores_layout, positions_layout)?;
    let (ss, ps) = (scores_layout.stride(), positions_layout.stride());
    check_select(kv, n, budget, recent)?;
    if scores.dtype() != DType::F32 || positions.dtype() != DType::U32 {
        bail!("select-plan: scores must be f32 and positions u32");
    }
    let dev = scores.device().clone();
    let m = plan_moves(n, budget);
    let cols = 1 + 2 * m;
    let plan = dev.alloc_zeros::<u32>(kv * cols)?;
    let s = scores
        .as_cuda_slice::<f32>()?
        .slice(scores_layout.start_offset()..);
    let p = positions
        .as_cuda_slice::<u32>()?
        .slice(positions_layout.start_offset()..);
    let (s_stride, p_stride, plan_stride) = (ss[0] as i64, ps[0] as i64, cols as i64);
    let (n32, budget32, sinks32, recent32) = (
        n as i32,
        budget as i32,
        sinks.min(u32::MAX as usize) as u32,
        recent as i32,
    );
    // The arguments every selection kernel starts with.
    macro_rules! select_args {
        ($b:ident) => {
            $b.arg(&s);
            $b.arg(&s_stride);
            $b.arg(&p);
            $b.arg(&p_stride);
            $b.arg(&n32);
            $b.arg(&budget32);
            $b.arg(&sinks32);
            $b.arg(&recent32);
        };
    }
    let blocks = blocks.resolve(n, budget, recent)?;
    if blocks == SelectBlocks::One {
        let f = dev.get_or_load_custom_func("keydiff_select_plan", MODULE, PTX)?;
        let mut b = f.builder();
        select_args!(b);
        b.arg(&plan);
        b.arg(&plan_stride);
        // SAFETY: argument list matches `keydiff_select_plan`; one block per head.
        unsafe { b.launch(launch_cfg(per_head_launch(kv))) }.w()?;
    } else if blocks == SelectBlocks::Few {
        let ws_stride = select_few_workspace(n, budget, recent);
        let ws = dev.alloc_zeros::<u32>(kv * ws_stride)?;
        let ws_stride = ws_stride as i64;
        let f = dev.get_or_load_custom_func("keydiff_select_few", MODULE, PTX)?;
        let mut b = f.builder();
        select_args!(b);
        b.arg(&plan);
        b.arg(&plan_stride);
        b.arg(&ws);
        b.arg(&ws_stride);
        // SAFETY: argument list matches `keydiff_select_few`; the workspace holds
        // `select_few_workspace` zeroed words per head, `resolve` checked that the candidates
        // fit the kernel's shared memory, the grid is one slice per block.
        unsafe { b.launch(launch_cfg(select_few_launch(kv, n))) }.w()?;
    } else {
        let ws_stride = select_workspace(n);
        let ws = dev.alloc_zeros::<u32>(kv * ws_stride)?;
        let ws_stride = ws_stride as i64;
        let cfg = launch_cfg(select_multi_launch(kv, n));
        let f = dev.get_or_load_custom_func("keydiff_select_pass", MODULE, PTX)?;
        for pass in select_passes(recent) {
            let pass = pass as i32;
            let mut b = f.builder();
            select_args!(b);
            b.arg(&pass);
            b.arg(&ws);
            b.arg(&ws_stride);
            // SAFETY: argument list matches `keydiff_select_pass`; the workspace holds
            // `select_workspace(n)` zeroed words per head, the grid one slice per block.
            unsafe { b.launch(cfg) }.w()?;
        }
        for name in ["keydiff_select_count", "keydiff_select_emit"] {
            let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
            let mut b = f.builder();
            select_args!(b);
            b.arg(&plan);
            b.arg(&plan_stride);
            b.arg(&ws);
            b.arg(&ws_stride);
            // SAFETY: argument list matches `keydiff_select_count` / `_emit`, after the passes
            // above on the same stream and workspace; the plan has `cols` words per head.
            unsafe { b.launch(cfg) }.w()?;
        }
    }
    Ok((
        CudaStorage::wrap_cuda_slice(plan, dev),
        Shape::from((kv, cols)),
    ))
}

/// Applies a plan from [`select_plan`] in place to `buf`: `[kv, rows]` (positions, state) or
/// `[kv, rows, d]` (K, V), rows contiguous, any dtype. Sources and destinations are disjoint,
/// so every move runs in parallel.
pub fn move_rows(
    buf: &mut CudaStorage,
    layout: &Layout,
    plan: &CudaStorage,
    plan_layout: &Layout,
) -> Result<()> {
    let dims = layout.dims();
    let st = layout.stride();
    let (kv, rows, row_elems) = match *dims {
        [kv, rows] => (kv, rows, 1),
        [kv, rows, d] if st[2] == 1 => (kv, rows, d),
        _ => bail!("move-rows: buffer {dims:?} with strides {st:?} is not [kv, rows(, d)]"),
    };
    let (pkv, cols) = plan_layout.shape().dims2()?;
    if pkv != kv || cols == 0 || cols % 2 != 1 || !plan_layout.is_contiguous() {
        bail!(
            "move-rows: plan {:?} does not fit {kv} heads",
            plan_layout.dims()
        );
    }
    if plan.dtype() != DType::U32 {
        bail!("move-rows: the plan must be u32");
    }
    let m = (cols - 1) / 2;
    if m == 0 {
        return Ok(());
    }
    let elem = buf.dtype().size_in_bytes();
    let int_max = i32::MAX as usize;
    if kv > MAX_HEADS || m > int_max || rows > int_max || row_elems * elem > int_max {
        bail!("move-rows: {kv} heads, {m} moves or {rows} rows of {row_elems} out of range");
    }
    let (hs, rs) = ((st[0] * elem) as i64, (st[1] * elem) as i64);
    let (row_bytes, plan_stride, m32) = ((row_elems * elem) as i32, cols as i64, m as i32);
    let rows32 = rows as i32;
    let dev = buf.device().clone();
    let p = plan
        .as_cuda_slice::<u32>()?
        .slice(plan_layout.start_offset()..);
    let f = dev.get_or_load_custom_func("keydiff_move_rows", MODULE, PTX)?;
    let cfg = launch_cfg(move_launch(m, kv));
    let o = layout.start_offset();
    macro_rules! launch {
        ($t:ty) => {{
            let mut view = buf.as_cuda_slice_mut::<$t>()?.slice_mut(o..);
            let mut b = f.builder();
            b.arg(&mut view);
            b.arg(&hs);
            b.arg(&rs);
            b.arg(&row_bytes);
            b.arg(&rows32);
            b.arg(&p);
            b.arg(&plan_stride);
            b.arg(&m32);
            // SAFETY: argument list matches `keydiff_move_rows`; the kernel skips any move
            // naming a row outside [0, rows), so it writes only inside the buffer view.
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match buf.dtype() {
        DType::F32 => launch!(f32),
        DType::F16 => launch!(f16),
        DType::BF16 => launch!(bf16),
        DType::U32 => launch!(u32),
        DType::F64 => launch!(f64),
        DType::U8 => launch!(u8),
        DType::F8E4M3 => launch!(float8::F8E4M3),
        dt => bail!("move-rows: unsupported dtype {dt:?}"),
    }
    Ok(())
}

/// A chunk appended to a layer's cache in one launch (`keydiff_append_rows`; see the kernel
/// source): rows `slot .. slot + chunk` of each head of `kbuf` and `vbuf` (`[kv, capacity, d]`)
/// get `k` and `v` (`[kv, chunk, d]`, any head and row stride, rows contiguous, the buffers'
/// dtype), `positions` (u32 `[kv, capacity]`) get `pos0 ..`, and `state` (f32, the positions'
/// layout) zeros.
///
/// # Safety
///
/// The four buffers are written although they are passed by shared reference (candle lends no
/// more than one storage mutably to an op): the caller must own them, so that nothing else
/// reads or writes them through another tensor while this runs (`LayerCache::append` holds
/// `&mut self`). Reads queued on the device before or after are ordered by the stream, as for
/// candle's own `slice_set`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn append_rows(
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (kb, kbl): (&CudaStorage, &Layout),
    (vb, vbl): (&CudaStorage, &Layout),
    (pos, pl): (&CudaStorage, &Layout),
    (state, sl): (&CudaStorage, &Layout),
    slot: usize,
    pos0: usize,
) -> Result<()> {
    let (kv, chunk, d) = kl.shape().dims3()?;
    let (bkv, capacity, bd) = kbl.shape().dims3()?;
    let (ks, vs, bs) = (kl.stride(), vl.stride(), kbl.stride());
    if vl.dims() != kl.dims()
        || (bkv, bd) != (kv, d)
        || vbl.dims() != kbl.dims()
        || vbl.stride() != bs
        || ks[2] != 1
        || vs[2] != 1
        || bs[2] != 1
    {
        bail!(
            "append: k {:?} / {ks:?}, v {:?} / {vs:?} into buffers {:?} / {bs:?} and {:?} / {:?} \
             (rows contiguous, one layout for both buffers)",
            kl.dims(),
            vl.dims(),
            kbl.dims(),
            vbl.dims(),
            vbl.stride()
        );
    }
    let dt = k.dtype();
    if v.dtype() != dt || kb.dtype() != dt || vb.dtype() != dt {
        bail!(
            "append: k {:?}, v {:?} into buffers of {:?} and {:?} (one dtype)",
            dt,
            v.dtype(),
            kb.dtype(),
            vb.dtype()
        );
    }
    if pos.dtype() != DType::U32 || state.dtype() != DType::F32 {
        bail!(
            "append: positions {:?} (u32) and state {:?} (f32)",
            pos.dtype(),
            state.dtype()
        );
    }
    let meta = pl.stride();
    if pl.dims() != [kv, capacity] || sl.dims() != pl.dims() || sl.stride() != meta || meta[1] != 1
    {
        bail!(
            "append: positions {:?} / {meta:?} and state {:?} / {:?} for [{kv}, {capacity}] \
             (one layout, slots contiguous)",
            pl.dims(),
            sl.dims(),
            sl.stride()
        );
    }
    let elem = dt.size_in_bytes();
    check_append(kv, chunk, d * elem, slot, capacity, pos0)?;
    let b = |st: &[usize]| (st[0] as i64 * elem as i64, st[1] as i64 * elem as i64);
    let ((k_hs, k_rs), (v_hs, v_rs), (buf_hs, buf_rs)) = (b(ks), b(vs), b(bs));
    let (row_bytes, meta_hs) = ((d * elem) as i32, meta[0] as i64);
    let (slot32, chunk32, pos32) = (slot as i32, chunk as i32, pos0 as u32);
    let dev = k.device().clone();
    let f = dev.get_or_load_custom_func("keydiff_append_rows", MODULE, PTX)?;
    let pv = pos.as_cuda_slice::<u32>()?.slice(pl.start_offset()..);
    let sv = state.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
    let cfg = launch_cfg(append_launch(chunk, kv));
    macro_rules! launch {
        ($t:ty) => {{
            let kv_ = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
            let vv = v.as_cuda_slice::<$t>()?.slice(vl.start_offset()..);
            let kbv = kb.as_cuda_slice::<$t>()?.slice(kbl.start_offset()..);
            let vbv = vb.as_cuda_slice::<$t>()?.slice(vbl.start_offset()..);
            let mut b = f.builder();
            b.arg(&kv_);
            b.arg(&k_hs);
            b.arg(&k_rs);
            b.arg(&vv);
            b.arg(&v_hs);
            b.arg(&v_rs);
            b.arg(&kbv);
            b.arg(&vbv);
            b.arg(&buf_hs);
            b.arg(&buf_rs);
            b.arg(&row_bytes);
            b.arg(&pv);
            b.arg(&sv);
            b.arg(&meta_hs);
            b.arg(&slot32);
            b.arg(&chunk32);
            b.arg(&pos32);
            // SAFETY: argument list matches the kernel; it reads the chunk's rows of the k and
            // v views at these strides and writes slots slot .. slot + chunk of each head of
            // the buffers, inside them (checked above); the caller owns the buffers.
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match dt {
        DType::F32 => launch!(f32),
        DType::F16 => launch!(f16),
        DType::BF16 => launch!(bf16),
        DType::U8 => launch!(u8),
        DType::F8E4M3 => launch!(float8::F8E4M3),
        dt => bail!("append: unsupported dtype {dt:?} (f32, f16, bf16, u8, f8e4m3)"),
    }
    Ok(())
}

/// RoPE of a chunk's queries and keys in one launch (`keydiff_rope_qk_<dtype>`; see the kernel
/// source): `q` `[hq, B, d]` and `k` `[hk, B, d]` (any head and row stride, each head's values
/// contiguous), `cos` and `sin` `[B, d / 2]` contiguous, one dtype (f32/f16/bf16), pairs
/// `(2j, 2j + 1)` when `interleaved`, else `(j, j + d / 2)`. Returns `[hq + hk, B, d]`
/// contiguous: the rotated queries, then the keys.
pub fn rope_qk(
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (cos, cl): (&CudaStorage, &Layout),
    (sin, sl): (&CudaStorage, &Layout),
    interleaved: bool,
) -> Result<(CudaStorage, Shape)> {
    let (hq, b, d) = ql.shape().dims3()?;
    let (hk, kb, kd) = kl.shape().dims3()?;
    let (qs, ks) = (ql.stride(), kl.stride());
    if (kb, kd) != (b, d) || qs[2] != 1 || ks[2] != 1 {
        bail!(
            "rope: q {:?} / {qs:?}, k {:?} / {ks:?} (one chunk and head dim, values contiguous)",
            ql.dims(),
            kl.dims()
        );
    }
    check_rope(hq, hk, b, d)?;
    if cl.dims() != [b, d / 2]
        || sl.dims() != cl.dims()
        || !cl.is_contiguous()
        || !sl.is_contiguous()
    {
        bail!(
            "rope: cos {:?} and sin {:?} for {b} rows of {d} (contiguous [{b}, {}])",
            cl.dims(),
            sl.dims(),
            d / 2
        );
    }
    let dt = q.dtype();
    if [k.dtype(), cos.dtype(), sin.dtype()] != [dt; 3] {
        bail!(
            "rope: q {dt:?}, k {:?}, cos {:?}, sin {:?} (one dtype)",
            k.dtype(),
            cos.dtype(),
            sin.dtype()
        );
    }
    let dev = q.device().clone();
    let n = (hq + hk) * b * d;
    let (q_rs, q_hs, k_rs, k_hs) = (qs[1] as i64, qs[0] as i64, ks[1] as i64, ks[0] as i64);
    let (hq32, hk32, b32, d32) = (hq as i32, hk as i32, b as i32, d as i32);
    let inter = interleaved as i32;
    let cfg = launch_cfg(rope_launch(n / 2));
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            // SAFETY: the kernel writes every value (each pair of each row of each head).
            let mut out = unsafe { dev.alloc::<$t>(n)? };
            let qv = q.as_cuda_slice::<$t>()?.slice(ql.start_offset()..);
            let kv = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
            let cv = cos.as_cuda_slice::<$t>()?.slice(cl.start_offset()..);
            let sv = sin.as_cuda_slice::<$t>()?.slice(sl.start_offset()..);
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&qv);
            b.arg(&q_rs);
            b.arg(&q_hs);
            b.arg(&kv);
            b.arg(&k_rs);
            b.arg(&k_hs);
            b.arg(&cv);
            b.arg(&sv);
            b.arg(&mut out);
            b.arg(&hq32);
            b.arg(&hk32);
            b.arg(&b32);
            b.arg(&d32);
            b.arg(&inter);
            // SAFETY: argument list matches the kernel; it reads the q and k views at these
            // strides and cos/sin's b · d / 2 values, and writes the n values of `out`,
            // allocated here.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match dt {
        DType::F32 => launch!(f32, "keydiff_rope_qk_f32"),
        DType::F16 => launch!(f16, "keydiff_rope_qk_f16"),
        DType::BF16 => launch!(bf16, "keydiff_rope_qk_bf16"),
        dt => bail!("rope: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((out, Shape::from((hq + hk, b, d))))
}

/// SnapKV pooling along positions (`snapkv_pool`): `stats` `[kv, n]` f32 and `positions`
/// `[kv, ≥ n]` u32 (rows contiguous, unique per head, all `< span`) give `[kv, n]` f32, each
/// slot's stats avg-pooled (kernel 5, zero padding) with its neighbours in position order.
/// The kernel cannot refuse bad positions as the CPU op does; a position past the bitmap gets
/// NaN and a repeated one wrong neighbours, but memory outside the buffers is never touched.
pub fn snapkv_pool(
    stats: &CudaStorage,
    stats_layout: &Layout,
    positions: &CudaStorage,
    positions_layout: &Layout,
    span: usize,
) -> Result<(CudaStorage, Shape)> {
    let (kv, n) = per_slot_pair("snapkv-pool", stats_layout, positions_layout)?;
    let (ss, ps) = (stats_layout.stride(), positions_layout.stride());
    check_pool(kv, n, span)?;
    if stats.dtype() != DType::F32 || positions.dtype() != DType::U32 {
        bail!("snapkv-pool: stats must be f32 and positions u32");
    }
    let dev = stats.device().clone();
    let words = pool_words(span);
    let bitmap = dev.alloc_zeros::<u32>(kv * words)?;
    // SAFETY: written before read inside the kernel.
    let word_rank = unsafe { dev.alloc::<u32>(kv * words)? };
    // Zeroed: unique positions (the cache's invariant) fill every entry, but were one repeated,
    // an unwritten entry would send a read through garbage; zeros keep it inside `stats`.
    let sorted = dev.alloc_zeros::<u32>(kv * n)?;
    let scores = unsafe { dev.alloc::<f32>(kv * n)? };
    let s = stats
        .as_cuda_slice::<f32>()?
        .slice(stats_layout.start_offset()..);
    let p = positions
        .as_cuda_slice::<u32>()?
        .slice(positions_layout.start_offset()..);
    let (s_stride, p_stride, n32, w32) = (ss[0] as i64, ps[0] as i64, n as i32, words as i32);
    let f = dev.get_or_load_custom_func("snapkv_pool", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&s);
    b.arg(&s_stride);
    b.arg(&p);
    b.arg(&p_stride);
    b.arg(&n32);
    b.arg(&bitmap);
    b.arg(&w32);
    b.arg(&word_rank);
    b.arg(&sorted);
    b.arg(&scores);
    // SAFETY: argument list matches `snapkv_pool`; one block per head.
    unsafe { b.launch(launch_cfg(per_head_launch(kv))) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(scores, dev),
        Shape::from((kv, n)),
    ))
}

/// Blocks of quantized-cache type `kind` (`KVQ_BYTES[kind]` bytes each) of `x` (`[kv, n, d]`,
/// f32/f16/bf16, any head and row stride, rows contiguous; d a multiple of 32): u8
/// `[kv, n, d / 32 · bytes]`, contiguous (`keydiff_kvq_quantize_*`); for [`KVQ_FP8`], F8E4M3
/// `[kv, n, d]`.
pub fn kvq_quantize(
    x: &CudaStorage,
    layout: &Layout,
    kind: i32,
    bytes: usize,
) -> Result<(CudaStorage, Shape)> {
    let (kv, n, d) = layout.shape().dims3()?;
    let st = layout.stride();
    if st[2] != 1 {
        bail!("kv-block-quantize needs contiguous rows, got strides {st:?}");
    }
    check_kvq(kv, n, d, kind, bytes)?;
    let rb = d / 32 * bytes;
    let dev = x.device().clone();
    // SAFETY: every byte is written by the kernel (one thread per block of each row).
    let mut out = if kind == KVQ_FP8 {
        Out::Fp8(unsafe { dev.alloc::<float8::F8E4M3>(kv * n * rb)? })
    } else {
        Out::U8(unsafe { dev.alloc::<u8>(kv * n * rb)? })
    };
    let (hs, rs) = (st[0] as i64, st[1] as i64);
    let (n32, d32) = (n as i32, d as i32);
    let cfg = launch_cfg(kvq_launch(kv, n * (d / 32)));
    let o = layout.start_offset();
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let view = x.as_cuda_slice::<$t>()?.slice(o..);
            let mut b = f.builder();
            b.arg(&view);
            b.arg(&hs);
            b.arg(&rs);
            b.arg(&n32);
            b.arg(&d32);
            b.arg(&kind);
            match &mut out {
                Out::U8(o) => b.arg(o),
                Out::Fp8(o) => b.arg(o),
            };
            // SAFETY: argument list matches the kernel; reads stay in the [kv, n, d] view at
            // these strides, writes in the kv · n · rb bytes allocated here.
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match x.dtype() {
        DType::F32 => launch!(f32, "keydiff_kvq_quantize_f32"),
        DType::F16 => launch!(f16, "keydiff_kvq_quantize_f16"),
        DType::BF16 => launch!(bf16, "keydiff_kvq_quantize_bf16"),
        dt => bail!("kv-block-quantize: unsupported dtype {dt:?} (f32, f16, bf16)"),
    }
    let out = match out {
        Out::U8(o) => CudaStorage::wrap_cuda_slice(o, dev),
        Out::Fp8(o) => CudaStorage::wrap_cuda_slice(o, dev),
    };
    Ok((out, Shape::from((kv, n, rb))))
}

/// What `kvq_quantize` writes: blocks as bytes, or fp8 codes as candle's F8E4M3.
enum Out {
    U8(candle_core::cuda_backend::cudarc::driver::CudaSlice<u8>),
    Fp8(candle_core::cuda_backend::cudarc::driver::CudaSlice<float8::F8E4M3>),
}

/// Values of rows `q` of quantized-cache type `kind` (u8 `[kv, n, d / 32 · bytes]`, or F8E4M3
/// `[kv, n, d]` for [`KVQ_FP8`]; any head and row stride, rows contiguous: a view of a cache
/// buffer): `[kv, n, d]` contiguous in `out`, f32 (`keydiff_kvq_dequantize`) or f16/bf16,
/// rounded once from the f32 values as a cast rounds them (`keydiff_kvq_dequantize_<dtype>`).
pub fn kvq_dequantize(
    q: &CudaStorage,
    layout: &Layout,
    d: usize,
    kind: i32,
    bytes: usize,
    out: DType,
) -> Result<(CudaStorage, Shape)> {
    let (kv, n, rb) = layout.shape().dims3()?;
    let st = layout.stride();
    if st[2] != 1 || rb != d / 32 * bytes {
        bail!(
            "kv-block-dequantize: rows {:?} strides {st:?} for heads of {d} in blocks of {bytes}",
            layout.dims()
        );
    }
    check_kvq(kv, n, d, kind, bytes)?;
    let storage = if kind == KVQ_FP8 {
        DType::F8E4M3
    } else {
        DType::U8
    };
    if q.dtype() != storage {
        bail!(
            "kv-block-dequantize: kind {kind} is read from {storage:?} rows, not {:?}",
            q.dtype()
        );
    }
    let dev = q.device().clone();
    let (hs, rs) = (st[0] as i64, st[1] as i64);
    let (n32, d32) = (n as i32, d as i32);
    let o = layout.start_offset();
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            // SAFETY: every value is written by the kernel (one thread each).
            let mut y = unsafe { dev.alloc::<$t>(kv * n * d)? };
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let (u8s, fp8s);
            let mut b = f.builder();
            if kind == KVQ_FP8 {
                fp8s = q.as_cuda_slice::<float8::F8E4M3>()?.slice(o..);
                b.arg(&fp8s);
            } else {
                u8s = q.as_cuda_slice::<u8>()?.slice(o..);
                b.arg(&u8s);
            }
            b.arg(&hs);
            b.arg(&rs);
            b.arg(&n32);
            b.arg(&d32);
            b.arg(&kind);
            b.arg(&mut y);
            // SAFETY: argument list matches the kernel; reads stay in the [kv, n, rb] view at
            // these strides, writes in the kv · n · d values allocated here.
            unsafe { b.launch(launch_cfg(kvq_launch(kv, n * d))) }.w()?;
            CudaStorage::wrap_cuda_slice(y, dev.clone())
        }};
    }
    let y = match out {
        DType::F32 => launch!(f32, "keydiff_kvq_dequantize"),
        DType::F16 => launch!(f16, "keydiff_kvq_dequantize_f16"),
        DType::BF16 => launch!(bf16, "keydiff_kvq_dequantize_bf16"),
        dt => bail!("kv-block-dequantize: no kernel writes {dt:?} (f32, f16, bf16)"),
    };
    Ok((y, Shape::from((kv, n, d))))
}

/// One decode step's attention (`keydiff_decode_<dtype>_<NE>`, then for more than one split
/// `keydiff_decode_combine_<dtype>`; see the kernel source): `q` `[kv, g, d]` (contiguous), `k`
/// and `v` `[kv, t, d]` views of a cache (any head and row stride, rows contiguous), all of one
/// dtype (f32/f16/bf16). Returns softmax(q · kᵀ · scale) · v, `[kv, g, d]` in that dtype.
pub fn decode_attention(
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    scale: f32,
) -> Result<(CudaStorage, Shape)> {
    let (kv, g, d) = ql.shape().dims3()?;
    let (kh, t, kd) = kl.shape().dims3()?;
    if (kh, kd) != (kv, d) {
        bail!(
            "decode-attention: q {:?}, k {:?} (one head size)",
            ql.dims(),
            kl.dims()
        );
    }
    if q.dtype() != k.dtype() || k.dtype() != v.dtype() {
        bail!(
            "decode-attention: q {:?}, k {:?} and v {:?} must be of one dtype",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    check_decode(kv, g, t, d)?;
    decode_launch_all((q, ql), (k, kl), (v, vl), None, scale)
}

/// [`decode_attention`] over a quantized cache (`keydiff_decode_kvq_<dtype>_<NE>`): `k` and `v`
/// `[kv, t, d / 32 · bytes]` views of its buffers (u8 blocks of `kind`, or F8E4M3 codes for
/// [`KVQ_FP8`]; any head and row stride, rows contiguous), dequantized as they are read, as
/// [`kvq_dequantize`] does; `q` `[kv, g, d]` f32, f16 or bf16, the output's dtype.
pub fn decode_attention_kvq(
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    kind: i32,
    bytes: usize,
    scale: f32,
) -> Result<(CudaStorage, Shape)> {
    let (kv, g, d) = ql.shape().dims3()?;
    let (kh, t, rb) = kl.shape().dims3()?;
    check_decode_kvq(kv, g, t, d, kind, bytes)?;
    if (kh, rb) != (kv, d / 32 * bytes) {
        bail!(
            "decode-attention: q {:?}, k {:?}: rows of {d} values in blocks of {bytes} bytes",
            ql.dims(),
            kl.dims()
        );
    }
    let storage = if kind == KVQ_FP8 {
        DType::F8E4M3
    } else {
        DType::U8
    };
    if k.dtype() != storage || v.dtype() != storage {
        bail!(
            "decode-attention over blocks of kind {kind}: k {:?} and v {:?} ({storage:?})",
            k.dtype(),
            v.dtype()
        );
    }
    decode_launch_all((q, ql), (k, kl), (v, vl), Some(kind), scale)
}

/// The launches of [`decode_attention`] (`kind` `None`) and [`decode_attention_kvq`], after
/// their checks.
fn decode_launch_all(
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    kind: Option<i32>,
    scale: f32,
) -> Result<(CudaStorage, Shape)> {
    let (kv, g, d) = ql.shape().dims3()?;
    let t = kl.dims()[1];
    let (ks, vs) = (kl.stride(), vl.stride());
    if !ql.is_contiguous() || vl.dims() != kl.dims() || ks[2] != 1 || vs[2] != 1 {
        bail!(
            "decode-attention: q {:?} (contiguous), k {:?} strides {ks:?}, v {:?} strides {vs:?}",
            ql.dims(),
            kl.dims(),
            vl.dims()
        );
    }
    let Some(ne) = decode_lanes(d) else {
        bail!("decode-attention: no kernel for head_dim {d}");
    };
    let (splits, span) = decode_split(kv, t);
    let dev = q.device().clone();
    // SAFETY: with several splits every (m, l, acc) is written by the first kernel before the
    // combine reads it; with one the buffer is not touched.
    let mut part = unsafe {
        dev.alloc::<f32>(if splits > 1 {
            kv * splits * g * (d + 2)
        } else {
            1
        })?
    };
    // Element strides: bytes for u8 and fp8 rows.
    let (k_hs, k_rs, v_hs, v_rs) = (ks[0] as i64, ks[1] as i64, vs[0] as i64, vs[1] as i64);
    // `check_decode` bounds them to `int`.
    let (t32, g32, d32, span32, splits32) =
        (t as i32, g as i32, d as i32, span as i32, splits as i32);
    macro_rules! launch {
        ($t:ty, $sfx:literal) => {{
            // SAFETY: every value is written, by the first kernel (one split) or the combine.
            let mut out = unsafe { dev.alloc::<$t>(kv * g * d)? };
            let qv = q.as_cuda_slice::<$t>()?.slice(ql.start_offset()..);
            let name = match kind {
                None => format!("keydiff_decode_{}_{ne}", $sfx),
                Some(_) => format!("keydiff_decode_kvq_{}_{ne}", $sfx),
            };
            let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let (kt, ku, k8, vt, vu, v8);
            let mut b = f.builder();
            b.arg(&qv);
            match kind {
                None => {
                    kt = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
                    b.arg(&kt);
                }
                Some(KVQ_FP8) => {
                    k8 = k
                        .as_cuda_slice::<float8::F8E4M3>()?
                        .slice(kl.start_offset()..);
                    b.arg(&k8);
                }
                Some(_) => {
                    ku = k.as_cuda_slice::<u8>()?.slice(kl.start_offset()..);
                    b.arg(&ku);
                }
            }
            b.arg(&k_hs);
            b.arg(&k_rs);
            match kind {
                None => {
                    vt = v.as_cuda_slice::<$t>()?.slice(vl.start_offset()..);
                    b.arg(&vt);
                }
                Some(KVQ_FP8) => {
                    v8 = v
                        .as_cuda_slice::<float8::F8E4M3>()?
                        .slice(vl.start_offset()..);
                    b.arg(&v8);
                }
                Some(_) => {
                    vu = v.as_cuda_slice::<u8>()?.slice(vl.start_offset()..);
                    b.arg(&vu);
                }
            }
            b.arg(&v_hs);
            b.arg(&v_rs);
            if let Some(kind) = &kind {
                b.arg(kind);
            }
            b.arg(&t32);
            b.arg(&g32);
            b.arg(&d32);
            b.arg(&span32);
            b.arg(&scale);
            b.arg(&mut out);
            b.arg(&mut part);
            // SAFETY: argument list matches the kernel (`kind` only for the kvq one); reads
            // stay in the [kv, g, d] q and the [kv, t, row] views at these strides, writes in
            // `out` and `part` as allocated here.
            unsafe { b.launch(launch_cfg(decode_launch(kv, splits))) }.w()?;
            if splits > 1 {
                let f = dev.get_or_load_custom_func(
                    concat!("keydiff_decode_combine_", $sfx),
                    MODULE,
                    PTX,
                )?;
                let mut b = f.builder();
                b.arg(&part);
                b.arg(&splits32);
                b.arg(&g32);
                b.arg(&d32);
                b.arg(&mut out);
                // SAFETY: argument list matches the kernel; it reads the kv · splits · g ·
                // (d + 2) floats of `part` and writes the kv · g · d values of `out`.
                unsafe { b.launch(launch_cfg(decode_combine_launch(kv))) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match q.dtype() {
        DType::F32 => launch!(f32, "f32"),
        DType::F16 => launch!(f16, "f16"),
        DType::BF16 => launch!(bf16, "bf16"),
        dt => bail!("decode-attention: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((out, Shape::from((kv, g, d))))
}

/// The causal softmax of a chunk's attention scores (`keydiff_causal_softmax_<in>_<out>`; see
/// the kernel source): `scores` `[.., t]` contiguous (f32/f16/bf16), rows ordered so that row
/// r is the query at r % `chunk` of its chunk, whose keys are the last `chunk` of t. Returns
/// the probabilities in the same shape, in f32 (`out` = F32) or in the scores' dtype, 0 where
/// masked.
pub fn causal_softmax(
    (s, sl): (&CudaStorage, &Layout),
    chunk: usize,
    out: DType,
) -> Result<(CudaStorage, Shape)> {
    let t = sl.dims().last().copied().unwrap_or(0);
    if !sl.is_contiguous() || t == 0 {
        bail!(
            "causal-softmax: scores {:?} strides {:?} (contiguous rows of keys)",
            sl.dims(),
            sl.stride()
        );
    }
    let rows = sl.shape().elem_count() / t;
    check_softmax(rows, t, chunk)?;
    if out != DType::F32 && out != s.dtype() {
        bail!(
            "causal-softmax: probabilities in {out:?} from {:?} scores (f32 or the scores' dtype)",
            s.dtype()
        );
    }
    let dev = s.device().clone();
    let (t32, chunk32) = (t as i32, chunk as i32);
    let cfg = launch_cfg(softmax_launch(rows));
    macro_rules! launch {
        ($ti:ty, $to:ty, $name:literal) => {{
            // SAFETY: the kernel writes every value of every row.
            let mut p = unsafe { dev.alloc::<$to>(rows * t)? };
            let sv = s.as_cuda_slice::<$ti>()?.slice(sl.start_offset()..);
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&sv);
            b.arg(&mut p);
            b.arg(&t32);
            b.arg(&chunk32);
            // SAFETY: argument list matches the kernel; block r reads row r of the rows · t
            // scores and writes row r of `p`, allocated here.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(p, dev.clone())
        }};
    }
    let p = match (s.dtype(), out) {
        (DType::F32, _) => launch!(f32, f32, "keydiff_causal_softmax_f32_f32"),
        (DType::F16, DType::F32) => launch!(f16, f32, "keydiff_causal_softmax_f16_f32"),
        (DType::F16, _) => launch!(f16, f16, "keydiff_causal_softmax_f16_f16"),
        (DType::BF16, DType::F32) => launch!(bf16, f32, "keydiff_causal_softmax_bf16_f32"),
        (DType::BF16, _) => launch!(bf16, bf16, "keydiff_causal_softmax_bf16_bf16"),
        (dt, _) => bail!("causal-softmax: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((p, sl.shape().clone()))
}

/// The causal softmax of a chunk's attention scores with the policies' statistics
/// (`keydiff_softmax_state_<in>`, then `keydiff_softmax_sums_<in>_<out>`; see the kernel
/// source): `scores` `[heads · chunk, t]` contiguous (f32/f16/bf16), rows as for
/// [`causal_softmax`], head h's queries rows h · chunk ... Returns the probabilities in
/// `probs` (f32 or the scores' dtype; `None`: not written) and, `[heads, t]` in f32, the sum
/// over the last `stat_rows` queries of each head of its probabilities.
pub fn softmax_sums(
    (s, sl): (&CudaStorage, &Layout),
    chunk: usize,
    stat_rows: usize,
    probs: Option<DType>,
) -> Result<(Option<CudaStorage>, CudaStorage)> {
    let t = sl.dims().last().copied().unwrap_or(0);
    if !sl.is_contiguous() || t == 0 {
        bail!(
            "softmax sums: scores {:?} strides {:?} (contiguous rows of keys)",
            sl.dims(),
            sl.stride()
        );
    }
    let rows = sl.shape().elem_count() / t;
    check_softmax_sums(rows, t, chunk, stat_rows)?;
    if let Some(out) = probs.filter(|&o| o != DType::F32 && o != s.dtype()) {
        bail!(
            "softmax sums: probabilities in {out:?} from {:?} scores (f32 or the scores' dtype)",
            s.dtype()
        );
    }
    let heads = rows / chunk;
    let dev = s.device().clone();
    let (t32, chunk32, r32) = (t as i32, chunk as i32, stat_rows as i32);
    // SAFETY: the state kernel writes both values of every row, the sums kernel every key of
    // every head.
    let mut state = unsafe { dev.alloc::<f32>(rows * 2)? };
    let mut stats = unsafe { dev.alloc::<f32>(heads * t)? };
    let state_cfg = launch_cfg(softmax_launch(rows));
    let sums_cfg = launch_cfg(softmax_sums_launch(t, heads));
    macro_rules! launch {
        ($ti:ty, $to:ty, $state:literal, $sums:literal) => {{
            let sv = s.as_cuda_slice::<$ti>()?.slice(sl.start_offset()..);
            let f = dev.get_or_load_custom_func($state, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&sv);
            b.arg(&mut state);
            b.arg(&t32);
            b.arg(&chunk32);
            // SAFETY: argument list matches the kernel; block r reads row r of the rows · t
            // scores and writes the two values of row r of `state`, allocated here.
            unsafe { b.launch(state_cfg) }.w()?;
            // SAFETY: as above, the sums kernel writes every value of `p`.
            let mut p = match probs {
                Some(_) => Some(unsafe { dev.alloc::<$to>(rows * t)? }),
                None => None,
            };
            let null = 0u64;
            let f = dev.get_or_load_custom_func($sums, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&sv);
            b.arg(&state);
            match p.as_mut() {
                Some(p) => b.arg(p),
                // A null pointer: the kernel then writes no probabilities.
                None => b.arg(&null),
            };
            b.arg(&mut stats);
            b.arg(&t32);
            b.arg(&chunk32);
            b.arg(&r32);
            // SAFETY: argument list matches the kernel; the thread of key c of head h reads
            // column c of the head's rows of scores and `state`, and writes that column of the
            // head's rows of `p` and of `stats`, all allocated above for rows · t and heads · t.
            unsafe { b.launch(sums_cfg) }.w()?;
            p.map(|p| CudaStorage::wrap_cuda_slice(p, dev.clone()))
        }};
    }
    let p = match (s.dtype(), probs) {
        (DType::F32, _) => launch!(
            f32,
            f32,
            "keydiff_softmax_state_f32",
            "keydiff_softmax_sums_f32_f32"
        ),
        (DType::F16, Some(DType::F32)) => launch!(
            f16,
            f32,
            "keydiff_softmax_state_f16",
            "keydiff_softmax_sums_f16_f32"
        ),
        (DType::F16, _) => launch!(
            f16,
            f16,
            "keydiff_softmax_state_f16",
            "keydiff_softmax_sums_f16_f16"
        ),
        (DType::BF16, Some(DType::F32)) => launch!(
            bf16,
            f32,
            "keydiff_softmax_state_bf16",
            "keydiff_softmax_sums_bf16_f32"
        ),
        (DType::BF16, _) => launch!(
            bf16,
            bf16,
            "keydiff_softmax_state_bf16",
            "keydiff_softmax_sums_bf16_bf16"
        ),
        (dt, _) => bail!("softmax sums: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((p, CudaStorage::wrap_cuda_slice(stats, dev)))
}

/// A residual add and the RMSNorm of its sum in one launch (`keydiff_add_rms_norm_<dtype>`; see
/// the kernel source): `x` and `r` `[rows, cols]` contiguous, `w` `[cols]` contiguous, all of
/// one dtype (f32/f16/bf16). Returns `[2, rows, cols]`: x + r rounded to the dtype, then
/// rsqrt(mean((x + r)²) + eps) · (x + r) · w.
pub fn add_rms_norm(
    (x, xl): (&CudaStorage, &Layout),
    (r, rl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    let (rows, cols) = xl.shape().dims2()?;
    if !xl.is_contiguous()
        || !rl.is_contiguous()
        || !wl.is_contiguous()
        || rl.dims() != xl.dims()
        || wl.dims() != [cols]
    {
        bail!(
            "add-rms-norm: x {:?}, r {:?}, w {:?} (contiguous [rows, cols], [rows, cols], [cols])",
            xl.dims(),
            rl.dims(),
            wl.dims()
        );
    }
    if x.dtype() != r.dtype() || x.dtype() != w.dtype() {
        bail!(
            "add-rms-norm: x {:?}, r {:?} and w {:?} must be of one dtype",
            x.dtype(),
            r.dtype(),
            w.dtype()
        );
    }
    check_norm(rows, cols)?;
    let dev = x.device().clone();
    let (rows32, cols32) = (rows as i32, cols as i32);
    let cfg = launch_cfg(norm_launch(rows));
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            // SAFETY: the kernel writes every value of both halves.
            let mut out = unsafe { dev.alloc::<$t>(2 * rows * cols)? };
            let xv = x.as_cuda_slice::<$t>()?.slice(xl.start_offset()..);
            let rv = r.as_cuda_slice::<$t>()?.slice(rl.start_offset()..);
            let wv = w.as_cuda_slice::<$t>()?.slice(wl.start_offset()..);
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&xv);
            b.arg(&rv);
            b.arg(&wv);
            b.arg(&mut out);
            b.arg(&rows32);
            b.arg(&cols32);
            b.arg(&eps);
            // SAFETY: argument list matches the kernel; block i reads row i of x and r and the
            // cols values of w, and writes row i of each half of `out`, allocated here.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match x.dtype() {
        DType::F32 => launch!(f32, "keydiff_add_rms_norm_f32"),
        DType::F16 => launch!(f16, "keydiff_add_rms_norm_f16"),
        DType::BF16 => launch!(bf16, "keydiff_add_rms_norm_bf16"),
        dt => bail!("add-rms-norm: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((out, Shape::from((2, rows, cols))))
}

/// SwiGLU's product silu(gate) · up in one launch (`keydiff_silu_mul_<dtype>`; see the kernel
/// source): `gate` and `up` `[rows, cols]` views with rows contiguous (any row stride: the halves
/// of a fused gate/up output), of one dtype (f32/f16/bf16). Returns `[rows, cols]` contiguous.
pub fn silu_mul(
    (g, gl): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let (rows, cols) = gl.shape().dims2()?;
    let (gs, us) = (gl.stride(), ul.stride());
    if ul.dims() != gl.dims() || gs[1] != 1 || us[1] != 1 {
        bail!(
            "silu-mul: gate {:?} strides {gs:?}, up {:?} strides {us:?} (rows contiguous)",
            gl.dims(),
            ul.dims()
        );
    }
    if g.dtype() != u.dtype() {
        bail!(
            "silu-mul: gate {:?} and up {:?} must be of one dtype",
            g.dtype(),
            u.dtype()
        );
    }
    check_act(rows, cols)?;
    let dev = g.device().clone();
    let (g_rs, u_rs, rows64, cols32) = (gs[0] as i64, us[0] as i64, rows as i64, cols as i32);
    let cfg = launch_cfg(act_launch(rows * cols));
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            // SAFETY: the kernel writes every value.
            let mut out = unsafe { dev.alloc::<$t>(rows * cols)? };
            let gv = g.as_cuda_slice::<$t>()?.slice(gl.start_offset()..);
            let uv = u.as_cuda_slice::<$t>()?.slice(ul.start_offset()..);
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&gv);
            b.arg(&g_rs);
            b.arg(&uv);
            b.arg(&u_rs);
            b.arg(&mut out);
            b.arg(&rows64);
            b.arg(&cols32);
            // SAFETY: argument list matches the kernel; it reads the rows × cols views at these
            // strides and writes the rows · cols values of `out`, allocated here.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match g.dtype() {
        DType::F32 => launch!(f32, "keydiff_silu_mul_f32"),
        DType::F16 => launch!(f16, "keydiff_silu_mul_f16"),
        DType::BF16 => launch!(bf16, "keydiff_silu_mul_bf16"),
        dt => bail!("silu-mul: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((out, Shape::from((rows, cols))))
}

/// Greedy sampling on the device (`keydiff_argmax_rows_<dtype>`; see the kernel source): the
/// first index of each row's largest value of `x`, a `[rows, cols]` view with rows contiguous
/// (any row stride), f32/f16/bf16, NaNs skipped and 0 for a row that starts with NaN (the
/// host sampler's `argmax`). Returns `[rows]` u32.
pub fn argmax_rows((x, l): (&CudaStorage, &Layout)) -> Result<(CudaStorage, Shape)> {
    let (rows, cols) = l.shape().dims2()?;
    let st = l.stride();
    if (st[1] != 1 && cols > 1) || (st[0] < cols && rows > 1) {
        bail!(
            "argmax: {:?} at strides {st:?} (rows contiguous, apart)",
            l.dims()
        );
    }
    check_argmax(rows, cols)?;
    let dev = x.device().clone();
    let (rs, cols32) = (st[0] as i64, cols as i32);
    let cfg = launch_cfg(argmax_launch(rows));
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            // SAFETY: block r writes out[r], for every row.
            let mut out = unsafe { dev.alloc::<u32>(rows)? };
            let xv = x.as_cuda_slice::<$t>()?.slice(l.start_offset()..);
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&xv);
            b.arg(&rs);
            b.arg(&mut out);
            b.arg(&cols32);
            // SAFETY: argument list matches the kernel; block r reads the `cols` values of row
            // r of the view at row stride `rs` and writes out[r], allocated here with `rows`.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match x.dtype() {
        DType::F32 => launch!(f32, "keydiff_argmax_rows_f32"),
        DType::F16 => launch!(f16, "keydiff_argmax_rows_f16"),
        DType::BF16 => launch!(bf16, "keydiff_argmax_rows_bf16"),
        dt => bail!("argmax: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((out, Shape::from(rows)))
}

/// Sampling on the device (`keydiff_sample_rows_<dtype>`; see the kernel source): each row of
/// `x` (a `[rows, cols]` view with rows contiguous, any row stride, f32/f16/bf16) drawn as the
/// host sampler draws it, with `params` (`[rows, SAMPLE_PARAM_WORDS]` u32, contiguous:
/// temperature, top-k, top-p, min-p, the uniform draw and the truncations' temperature, the
/// floats as their bits). Returns
/// `[rows]` u32, with [`crate::geometry::SAMPLE_NO_DRAW`] set where a row has no finite logit.
pub fn sample_rows(
    (x, l): (&CudaStorage, &Layout),
    (p, pl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let (rows, cols) = l.shape().dims2()?;
    let st = l.stride();
    if (st[1] != 1 && cols > 1) || (st[0] < cols && rows > 1) {
        bail!(
            "sample: {:?} at strides {st:?} (rows contiguous, apart)",
            l.dims()
        );
    }
    check_sample(rows, cols)?;
    if pl.dims() != [rows, SAMPLE_PARAM_WORDS] || !pl.is_contiguous() || p.dtype() != DType::U32 {
        bail!(
            "sample: parameters {:?} {:?} for {rows} rows (u32, [{rows}, {SAMPLE_PARAM_WORDS}], \
             contiguous)",
            p.dtype(),
            pl.dims()
        );
    }
    let dev = x.device().clone();
    let (rs, cols32) = (st[0] as i64, cols as i32);
    let cfg = launch_cfg(sample_launch(rows));
    let pv = p.as_cuda_slice::<u32>()?.slice(pl.start_offset()..);
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            // SAFETY: block r writes out[r], for every row.
            let mut out = unsafe { dev.alloc::<u32>(rows)? };
            let xv = x.as_cuda_slice::<$t>()?.slice(l.start_offset()..);
            let f = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&xv);
            b.arg(&rs);
            b.arg(&pv);
            b.arg(&mut out);
            b.arg(&cols32);
            // SAFETY: argument list matches the kernel; block r reads the `cols` values of row
            // r of the view at row stride `rs` and the 5 words of its parameters (checked
            // above), and writes out[r], allocated here with `rows`.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match x.dtype() {
        DType::F32 => launch!(f32, "keydiff_sample_rows_f32"),
        DType::F16 => launch!(f16, "keydiff_sample_rows_f16"),
        DType::BF16 => launch!(bf16, "keydiff_sample_rows_bf16"),
        dt => bail!("sample: unsupported dtype {dt:?} (f32, f16, bf16)"),
    };
    Ok((out, Shape::from(rows)))
}
