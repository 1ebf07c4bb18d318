//! The KV cache of one layer.

use candle_core::{DType, Device, Tensor, TensorId};

use crate::kv_type::contiguous_rows;
use crate::select::{ApplyPlan, SelectBlocks, SelectPlan};
use crate::{CacheError, KvType, KvTypes, Result};

/// The used slots of one layer, apart from its buffers' free room: what a saved cache holds
/// ([`LayerCache::parts`], [`LayerCache::from_parts`]).
#[derive(Debug, Clone)]
pub struct LayerParts {
    /// What the keys and values are stored as.
    pub kv: KvTypes,
    /// As the cache stores them: `[kv_heads, len, head_dim]` in f32, f16, bf16 or f8e4m3, or
    /// u8 `[kv_heads, len, head_dim / 32 · bytes]`, blocks of a quantized type ([`KvType`]).
    pub keys: Tensor,
    /// As the cache stores them (their own type, see the keys).
    pub values: Tensor,
    /// `[kv_heads, len]` u32.
    pub positions: Tensor,
    /// `[kv_heads, len]` f32.
    pub state: Tensor,
    /// One past the largest position appended.
    pub next_position: usize,
}

/// K and V of one layer, preallocated at `capacity` slots per KV head.
///
/// Every head has the same number of used slots (`len`), but after per-head eviction slot `s` of
/// two heads may hold different tokens; `positions` records the absolute position per head and
/// slot, and `state` a policy's per-slot value (H2O's accumulated attention). Both live on the
/// cache's device, next to K and V, and move with their slot.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// `[kv_heads, capacity, row]`: rows of `head_dim` values in `kv`'s form.
    k: Tensor,
    /// `[kv_heads, capacity, row]`
    v: Tensor,
    kv: KvTypes,
    head_dim: usize,
    len: usize,
    /// `[kv_heads, capacity]` u32, absolute token position of each slot.
    positions: Tensor,
    /// `[kv_heads, capacity]` f32, per-slot policy state.
    state: Tensor,
    /// One past the largest position ever appended.
    next_position: usize,
    /// The last slots appended since the slots were last moved (an eviction, a copy): these
    /// are the newest tokens, in order at the end, so [`LayerCache::rewind`] can forget them.
    fresh: usize,
    /// Set when the buffers are a view of a model-wide stack ([`LayerCache::stack`]): the id
    /// of the stack's key buffer and this layer's index in it.
    stacked: Option<(TensorId, usize)>,
    /// Whether the last [`LayerCache::append`] ran as one kernel launch (CUDA).
    appended_by_kernel: bool,
}

impl LayerCache {
    /// Allocates the buffers once; nothing grows afterwards. `kv`: a float dtype or a block
    /// type ([`KvType::Q8_0`], ...), for both keys and values or each its own ([`KvTypes`]).
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        kv: impl Into<KvTypes>,
        device: &Device,
    ) -> Result<Self> {
        let kv = kv.into();
        if capacity == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(CacheError::Config(format!(
                "empty cache: kv_heads={kv_heads} head_dim={head_dim} capacity={capacity}"
            )));
        }
        kv.check(head_dim).map_err(CacheError::Config)?;
        let buffer = |t: KvType| {
            Tensor::zeros(
                (kv_heads, capacity, t.row_len(head_dim)),
                t.storage_dtype(),
                device,
            )
        };
        let (k, v) = (buffer(kv.k)?, buffer(kv.v)?);
        Ok(Self {
            k,
            v,
            kv,
            head_dim,
            len: 0,
            positions: Tensor::zeros((kv_heads, capacity), DType::U32, device)?,
            state: Tensor::zeros((kv_heads, capacity), DType::F32, device)?,
            next_position: 0,
            fresh: 0,
            stacked: None,
            appended_by_kernel: false,
        })
    }

    /// Allocates every layer's buffers at once, as one `[layers · kv_heads, capacity, row]`
    /// buffer each for K, V, positions and state, and returns that stack with one view of it per
    /// layer (layer `l` holds heads `l · kv_heads ..`). The views are ordinary layers; the stack
    /// lets the cache evict every layer in one pass, with one set of kernel launches instead of
    /// one per layer (see [`crate::KvCache::after_attention`]).
    pub(crate) fn stack(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        kv: KvTypes,
        device: &Device,
    ) -> Result<(Self, Vec<Self>)> {
        if layers == 0 {
            return Err(CacheError::Config("a cache of no layers".into()));
        }
        let whole = Self::new(layers * kv_heads, head_dim, capacity, kv, device)?;
        let id = whole.k.id();
        let views = (0..layers)
            .map(|l| {
                let heads = |t: &Tensor| t.narrow(0, l * kv_heads, kv_heads);
                Ok(Self {
                    k: heads(&whole.k)?,
                    v: heads(&whole.v)?,
                    positions: heads(&whole.positions)?,
                    state: heads(&whole.state)?,
                    stacked: Some((id, l)),
                    ..whole.clone()
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((whole, views))
    }

    /// True when this layer is view `index` of `stack` ([`LayerCache::stack`]).
    pub(crate) fn is_view_of(&self, stack: &LayerCache, index: usize) -> bool {
        self.stacked == Some((stack.k.id(), index))
    }

    /// Sets the used length, after the slots were moved (by an eviction of the stack this
    /// layer is a view of) or before they are (the stack's own length).
    pub(crate) fn set_moved_len(&mut self, len: usize) {
        self.len = len;
        self.fresh = 0;
    }

    /// A layer whose first slots hold `parts` (as [`LayerCache::parts`] gave them, from a file
    /// perhaps), with room for `capacity` slots, on `device`. Shapes, dtypes and positions are
    /// checked: every head's positions distinct and below the next position, and with
    /// `in_order` (a cache that never evicted) exactly `0..len`.
    pub fn from_parts(
        parts: &LayerParts,
        capacity: usize,
        in_order: bool,
        device: &Device,
    ) -> Result<Self> {
        let (heads, head_dim) = Self::check_parts(parts, capacity, in_order)?;
        let mut layer = Self::new(heads, head_dim, capacity, parts.kv, device)?;
        layer.fill(parts)?;
        Ok(layer)
    }

    /// Checks `parts` as [`LayerCache::from_parts`] says; returns their KV heads and head dim.
    pub(crate) fn check_parts(
        parts: &LayerParts,
        capacity: usize,
        in_order: bool,
    ) -> Result<(usize, usize)> {
        let (heads, len, dim) = parts.keys.dims3()?;
        let bad = |why: String| Err(CacheError::Shape(why));
        let kv = parts.kv;
        let head_dim = kv.k.head_dim_of(dim).unwrap_or(0);
        if head_dim == 0
            || kv.check(head_dim).is_err()
            || parts.keys.dtype() != kv.k.storage_dtype()
            || parts.values.dtype() != kv.v.storage_dtype()
        {
            return bad(format!(
                "keys in {} and values in {}, rows of {dim}, said to be {kv} (expected one of \
                 {}; blocks as u8 rows)",
                parts.keys.dtype().as_str(),
                parts.values.dtype().as_str(),
                KvType::NAMES
            ));
        }
        let (vh, vl, vd) = parts.values.dims3()?;
        if (vh, vl) != (heads, len) || kv.v.head_dim_of(vd) != Some(head_dim) {
            return bad(format!(
                "values {:?} {} beside keys {:?} {}",
                parts.values.dims(),
                parts.values.dtype().as_str(),
                parts.keys.dims(),
                parts.keys.dtype().as_str()
            ));
        }
        for (name, t, dtype) in [
            ("positions", &parts.positions, DType::U32),
            ("state", &parts.state, DType::F32),
        ] {
            if t.dims() != [heads, len] || t.dtype() != dtype {
                return bad(format!(
                    "{name} {:?} {} for {heads} heads of {len} slots (expected {})",
                    t.dims(),
                    t.dtype().as_str(),
                    dtype.as_str()
                ));
            }
        }
        if len > capacity {
            return Err(CacheError::Full {
                len: 0,
                chunk: len,
                capacity,
            });
        }
        let next = parts.next_position;
        for (h, row) in parts.positions.to_vec2::<u32>()?.into_iter().enumerate() {
            if in_order {
                if row.iter().enumerate().any(|(i, &p)| p as usize != i) || next != len {
                    return bad(format!(
                        "head {h}: a cache that never evicted holds positions 0..{len} in order, \
                         and the next position is {len} (it is {next})"
                    ));
                }
                continue;
            }
            let mut sorted = row;
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return bad(format!("head {h} holds a position twice"));
            }
            if sorted.last().is_some_and(|&p| p as usize >= next) {
                return bad(format!(
                    "head {h} holds position {} at or past the next position {next}",
                    sorted[sorted.len() - 1]
                ));
            }
        }
        Ok((heads, head_dim))
    }

    /// Makes this (empty) layer hold `parts`, which [`LayerCache::check_parts`] accepted for
    /// this layer's shape and types.
    pub(crate) fn fill(&mut self, parts: &LayerParts) -> Result<()> {
        let (heads, len, _) = parts.keys.dims3()?;
        if heads != self.kv_heads() || len > self.capacity() || parts.kv != self.kv {
            return Err(CacheError::Shape(format!(
                "parts of {heads} heads, {len} slots, {} for a layer of {} heads, {} slots, {}",
                parts.kv,
                self.kv_heads(),
                self.capacity(),
                self.kv
            )));
        }
        if len > 0 {
            let device = self.k.device().clone();
            let on = |t: &Tensor| t.to_device(&device)?.contiguous();
            self.k.slice_set(&on(&parts.keys)?, 1, 0)?;
            self.v.slice_set(&on(&parts.values)?, 1, 0)?;
            self.positions.slice_set(&on(&parts.positions)?, 1, 0)?;
            self.state.slice_set(&on(&parts.state)?, 1, 0)?;
        }
        self.len = len;
        self.fresh = 0;
        self.next_position = parts.next_position;
        Ok(())
    }

    /// The used slots (views on the cache's device) and the next position: what a saved cache
    /// holds of this layer.
    pub fn parts(&self) -> Result<LayerParts> {
        Ok(LayerParts {
            kv: self.kv,
            keys: self.stored_keys()?,
            values: self.stored_values()?,
            positions: self.positions_tensor()?,
            state: self.state_tensor()?,
            next_position: self.next_position,
        })
    }

    /// Writes a chunk's keys and values (`[kv_heads, chunk, head_dim]`, post-RoPE, any float
    /// dtype: converted to the cache's) after the used slots. `pos0` is the absolute position
    /// of the chunk's first token.
    pub fn append(&mut self, k: &Tensor, v: &Tensor, pos0: usize) -> Result<()> {
        let (heads, chunk, dim) = k.dims3()?;
        let (kv_heads, capacity, head_dim) = (self.kv_heads(), self.capacity(), self.head_dim);
        if heads != kv_heads || dim != head_dim || v.dims() != k.dims() {
            return Err(CacheError::Shape(format!(
                "append k {:?} v {:?} into cache [{kv_heads}, {capacity}, {head_dim}]",
                k.dims(),
                v.dims()
            )));
        }
        if self.len + chunk > capacity {
            return Err(CacheError::Full {
                len: self.len,
                chunk,
                capacity,
            });
        }
        // Selection keys hold 31 bits of position (see kernels/keydiff.cu).
        if pos0 + chunk > 1 << 31 {
            return Err(CacheError::Config(format!(
                "position {} is past the cache's limit of 2^31 tokens",
                pos0 + chunk
            )));
        }
        // Rounded to the cache's dtype where it differs from the activations', or quantized.
        let (k, v) = (self.kv.k.encode(k)?, self.kv.v.encode(v)?);
        // On CUDA, one launch writes the rows, positions and state (see `append_kernel`); the
        // candle ops below are its reference, and what every other device runs.
        self.appended_by_kernel = append_kernel(
            (&k, &v),
            [&self.k, &self.v, &self.positions, &self.state],
            self.len,
            pos0,
        )?;
        if !self.appended_by_kernel {
            self.k.slice_set(&k.contiguous()?, 1, self.len)?;
            self.v.slice_set(&v.contiguous()?, 1, self.len)?;
            let dev = self.k.device();
            let pos = Tensor::arange(pos0 as u32, (pos0 + chunk) as u32, dev)?
                .unsqueeze(0)?
                .broadcast_as((kv_heads, chunk))?
                .contiguous()?;
            self.positions.slice_set(&pos, 1, self.len)?;
            self.state.slice_set(
                &Tensor::zeros((kv_heads, chunk), DType::F32, dev)?,
                1,
                self.len,
            )?;
        }
        self.len += chunk;
        self.fresh += chunk;
        self.next_position = self.next_position.max(pos0 + chunk);
        Ok(())
    }

    /// Whether the last [`LayerCache::append`] wrote its rows, positions and state in one
    /// launch of keydiff's CUDA kernel (`keydiff_append_rows`) rather than candle's ops.
    pub fn appended_by_kernel(&self) -> bool {
        self.appended_by_kernel
    }

    /// Keys of the used slots, `[kv_heads, len, head_dim]`: a view of a float cache (not a
    /// copy), or a block type's blocks dequantized to f32.
    pub fn keys(&self) -> Result<Tensor> {
        self.kv.k.decode(&self.stored_keys()?, self.head_dim)
    }

    /// Values of the used slots, as [`LayerCache::keys`].
    pub fn values(&self) -> Result<Tensor> {
        self.kv.v.decode(&self.stored_values()?, self.head_dim)
    }

    /// [`LayerCache::keys`] for attention in `dtype`: a block type's keys (and, on CUDA, an
    /// fp8 cache's) dequantized into `dtype`, the values `keys()?.to_dtype(dtype)` gives (on
    /// CUDA written so by the kernel, with no f32 copy of the view); a float cache's view as
    /// [`LayerCache::keys`] gives it, for the caller to widen or cast.
    pub fn keys_as(&self, dtype: DType) -> Result<Tensor> {
        rows_as(self.kv.k, &self.stored_keys()?, self.head_dim, dtype)
    }

    /// Values of the used slots, as [`LayerCache::keys_as`].
    pub fn values_as(&self, dtype: DType) -> Result<Tensor> {
        rows_as(self.kv.v, &self.stored_values()?, self.head_dim, dtype)
    }

    /// Keys of the used slots as stored, `[kv_heads, len, row]` (a view; for a block type, the
    /// u8 blocks).
    pub fn stored_keys(&self) -> Result<Tensor> {
        Ok(self.k.narrow(1, 0, self.len)?)
    }

    /// Values of the used slots as stored (see [`LayerCache::stored_keys`]).
    pub fn stored_values(&self) -> Result<Tensor> {
        Ok(self.v.narrow(1, 0, self.len)?)
    }

    /// What the cache holds keys and values in.
    pub fn kv_type(&self) -> KvTypes {
        self.kv
    }

    /// The whole K buffer, `[kv_heads, capacity, row]` (for kernels).
    pub fn k_buffer(&self) -> &Tensor {
        &self.k
    }

    /// The whole V buffer, `[kv_heads, capacity, row]` (for kernels).
    pub fn v_buffer(&self) -> &Tensor {
        &self.v
    }

    /// The device the cache lives on.
    pub fn device(&self) -> &Device {
        self.k.device()
    }

    /// Used slots per head.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no slot is used.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of KV heads.
    pub fn kv_heads(&self) -> usize {
        self.k.dims()[0]
    }

    /// Allocated slots per head.
    pub fn capacity(&self) -> usize {
        self.k.dims()[1]
    }

    /// Dimension of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// One past the largest position appended so far: every slot's position is below it.
    pub fn next_position(&self) -> usize {
        self.next_position
    }

    /// Positions of the used slots, `[kv_heads, len]` u32 (a view on the cache's device).
    pub fn positions_tensor(&self) -> Result<Tensor> {
        Ok(self.positions.narrow(1, 0, self.len)?)
    }

    /// Policy state of the used slots, `[kv_heads, len]` f32 (a view on the cache's device).
    pub fn state_tensor(&self) -> Result<Tensor> {
        Ok(self.state.narrow(1, 0, self.len)?)
    }

    /// Absolute positions of the used slots of `head` (copied to the host).
    pub fn positions(&self, head: usize) -> Result<Vec<u32>> {
        Ok(self
            .positions
            .get(head)?
            .narrow(0, 0, self.len)?
            .to_vec1()?)
    }

    /// Per-slot policy state of the used slots of `head` (copied to the host).
    pub fn state(&self, head: usize) -> Result<Vec<f32>> {
        Ok(self.state.get(head)?.narrow(0, 0, self.len)?.to_vec1()?)
    }

    /// Adds `delta` (`[kv_heads, len]`, f32) to the state of the used slots.
    pub fn add_state(&mut self, delta: &Tensor) -> Result<()> {
        let want = (self.kv_heads(), self.len);
        if delta.dims2()? != want {
            return Err(CacheError::Shape(format!(
                "state update {:?} for {want:?} used slots",
                delta.dims()
            )));
        }
        let sum = (self.state_tensor()? + delta.to_dtype(DType::F32)?)?;
        self.state.slice_set(&sum, 1, 0)?;
        Ok(())
    }

    /// Bytes held by the K and V buffers (allocated, not used).
    pub fn bytes(&self) -> usize {
        self.k.elem_count() * self.k.dtype().size_in_bytes()
            + self.v.elem_count() * self.v.dtype().size_in_bytes()
    }

    /// Makes this (empty) cache a copy of `src`'s used slots: K, V and positions, and the policy
    /// state when `with_state` (zeros otherwise, as after [`LayerCache::append`]). `src` is left
    /// as it is: the slots are copied, not shared, so both caches can go on independently.
    pub fn copy_from(&mut self, src: &LayerCache, with_state: bool) -> Result<()> {
        self.copy_first_from(src, src.len, with_state)?;
        self.next_position = src.next_position;
        Ok(())
    }

    /// As [`LayerCache::copy_from`], of `src`'s first `n` slots only: positions `0..n` of a
    /// cache that never evicted (the next position is then `n`).
    pub fn copy_prefix_from(&mut self, src: &LayerCache, n: usize, with_state: bool) -> Result<()> {
        self.copy_first_from(src, n, with_state)?;
        self.next_position = n;
        Ok(())
    }

    fn copy_first_from(&mut self, src: &LayerCache, n: usize, with_state: bool) -> Result<()> {
        if !self.is_empty() {
            return Err(CacheError::Shape(format!(
                "copy into a cache that holds {} slots",
                self.len
            )));
        }
        let (have, want) = (self.k.dims(), src.k.dims());
        if have[0] != want[0] || have[2] != want[2] || self.kv != src.kv {
            return Err(CacheError::Shape(format!(
                "copy a {:?} {} cache into a {:?} {} one",
                want, src.kv, have, self.kv
            )));
        }
        if n > src.len {
            return Err(CacheError::Shape(format!(
                "copy {n} slots of a cache that holds {}",
                src.len
            )));
        }
        if n > self.capacity() {
            return Err(CacheError::Full {
                len: 0,
                chunk: n,
                capacity: self.capacity(),
            });
        }
        if n > 0 {
            // `slice_set` copies into this cache's own buffers.
            let first = |t: Tensor| t.narrow(1, 0, n)?.contiguous();
            let rows = |t: Tensor| contiguous_rows(&t.narrow(1, 0, n)?, self.head_dim);
            self.k.slice_set(&rows(src.stored_keys()?)?, 1, 0)?;
            self.v.slice_set(&rows(src.stored_values()?)?, 1, 0)?;
            self.positions
                .slice_set(&first(src.positions_tensor()?)?, 1, 0)?;
            let state = if with_state {
                first(src.state_tensor()?)?
            } else {
                Tensor::zeros((src.kv_heads(), n), DType::F32, self.device())?
            };
            self.state.slice_set(&state, 1, 0)?;
        }
        self.len = n;
        self.fresh = 0;
        Ok(())
    }

    /// Keeps the first `len` slots, which must be positions `0..len` (a cache that never
    /// evicted); the rest become free.
    pub(crate) fn truncate(&mut self, len: usize) {
        debug_assert!(len <= self.len);
        self.fresh = self.fresh.saturating_sub(self.len - len);
        self.len = len;
        self.next_position = len;
    }

    /// Slots at the end that [`LayerCache::rewind`] can forget: appended since the slots were
    /// last moved (evicted, copied in).
    pub fn rewindable(&self) -> usize {
        self.fresh
    }

    /// Forgets the `n` newest slots, appended since the slots were last moved
    /// ([`LayerCache::rewindable`]): a speculative draft's tokens that were not accepted. The
    /// next position goes back by `n`, as these held the newest positions.
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        if n > self.fresh {
            return Err(CacheError::Config(format!(
                "cannot forget the last {n} slots: only {} were appended since the cache last \
                 moved its slots",
                self.fresh
            )));
        }
        self.len -= n;
        self.fresh -= n;
        self.next_position -= n;
        Ok(())
    }

    /// Forgets every slot; the buffers stay allocated.
    pub fn clear(&mut self) {
        self.len = 0;
        self.fresh = 0;
        self.next_position = 0;
    }

    /// Keeps the best `budget` slots of every head by `scores` (`[kv_heads, len]` f32, on this
    /// cache's device), protecting the first `sinks` positions and the `recent` newest: one
    /// [`SelectPlan`] and one [`ApplyPlan`] per buffer, on the device (no host round trip).
    /// Returns the plan.
    pub fn evict(
        &mut self,
        scores: &Tensor,
        budget: usize,
        sinks: usize,
        recent: usize,
    ) -> Result<Tensor> {
        let want = (self.kv_heads(), self.len);
        if scores.dims2()? != want {
            return Err(CacheError::Shape(format!(
                "scores {:?} for {want:?} used slots",
                scores.dims()
            )));
        }
        if self.len <= budget {
            // Nothing to evict: a plan of zero moves per head.
            return Ok(Tensor::zeros(
                (self.kv_heads(), 1),
                DType::U32,
                self.device(),
            )?);
        }
        let op = SelectPlan {
            budget,
            sinks,
            recent,
            blocks: SelectBlocks::Auto,
        };
        let scores = scores.to_dtype(DType::F32)?;
        let plan = scores.apply_op2_no_bwd(&self.positions_tensor()?, &op)?;
        self.apply_plan(&plan, budget)?;
        Ok(plan)
    }

    /// Applies a plan (`[kv_heads, 1 + 2M]` u32, see [`SelectPlan`]) to K, V, positions and
    /// state, then sets the used length to `new_len`.
    pub(crate) fn apply_plan(&mut self, plan: &Tensor, new_len: usize) -> Result<()> {
        if new_len > self.len {
            return Err(CacheError::Shape(format!(
                "new len {new_len} > {}",
                self.len
            )));
        }
        let used = self.len;
        for buf in [&self.k, &self.v, &self.positions, &self.state] {
            buf.narrow(1, 0, used)?.inplace_op2(plan, &ApplyPlan)?;
        }
        self.len = new_len;
        self.fresh = 0;
        Ok(())
    }

    /// Applies per-head move plans (`(src, dst)` slot pairs, see [`crate::select::move_plan`])
    /// to K, V, positions and state, then sets the used length to `new_len`.
    pub fn apply_moves(&mut self, plans: &[Vec<(u32, u32)>], new_len: usize) -> Result<()> {
        let kv_heads = self.kv_heads();
        if plans.len() != kv_heads || new_len > self.len {
            return Err(CacheError::Shape(format!(
                "{} plans for {kv_heads} heads, new len {new_len} > {}",
                plans.len(),
                self.len
            )));
        }
        // Sources past the kept length, destinations inside it: no move reads a slot another
        // one writes, so devices may run them all at once.
        for plan in plans {
            for &(s, t) in plan {
                let (s, t) = (s as usize, t as usize);
                if s >= self.len || s < new_len || t >= new_len {
                    return Err(CacheError::Shape(format!(
                        "move {s} -> {t}: sources must be in [{new_len}, {}), destinations \
                         in [0, {new_len})",
                        self.len
                    )));
                }
            }
        }
        let plan = crate::select::plan_tensor(plans, self.k.device())?;
        self.apply_plan(&plan, new_len)
    }
}

/// Appends a chunk's encoded keys and values (`[kv_heads, chunk, row]`, the buffers' dtype)
/// to `bufs` (K, V, positions, state) at `slot` by keydiff's CUDA kernel
/// (`keydiff_append_rows` of `kernels/keydiff.cu`): one launch in place of candle's seven
/// operations (two `slice_set`s of the rows, a copy of V's transposed view, positions made on
/// the host and uploaded, broadcast and set, a zeroed state and its `slice_set`), which at a
/// decode step, one row a head, cost a launch or a transfer each. Every cache type takes it
/// once its rows are encoded, if keys and values are stored alike. Returns `false` where it
/// does not apply (off CUDA, keys and values of two storage dtypes, rows not contiguous) or
/// where `KEYDIFF_CUDA_APPEND=0` turns it off: the caller then runs candle's ops.
fn append_kernel(
    (k, v): (&Tensor, &Tensor),
    bufs: [&Tensor; 4],
    slot: usize,
    pos0: usize,
) -> Result<bool> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("KEYDIFF_CUDA_APPEND").map_or(true, |v| v != "0"));
    let rows_contiguous = |x: &Tensor| x.stride().last() == Some(&1);
    let [kb, vb, ..] = bufs;
    // Beyond the kernel's heads (grid.y), or a chunk of no rows: candle's ops.
    let (heads, rows) = (k.dim(0)?, k.dim(1)?);
    if !on
        || !k.device().is_cuda()
        || rows == 0
        || heads > keydiff_kernels::geometry::MAX_HEADS
        || v.dtype() != k.dtype()
        || kb.dtype() != k.dtype()
        || vb.dtype() != k.dtype()
        || vb.layout() != kb.layout()
        || ![k, v, kb, vb].into_iter().all(rows_contiguous)
    {
        return Ok(false);
    }
    append_cuda((k, v), bufs, slot, pos0)
}

#[cfg(feature = "cuda")]
fn append_cuda(
    (k, v): (&Tensor, &Tensor),
    [kb, vb, pos, state]: [&Tensor; 4],
    slot: usize,
    pos0: usize,
) -> Result<bool> {
    use candle_core::{CudaStorage, Storage};
    fn on_cuda(s: &Storage) -> Result<&CudaStorage> {
        match s {
            Storage::Cuda(c) => Ok(c),
            _ => Err(CacheError::Config(
                "append: a CUDA cache with a tensor off the device".into(),
            )),
        }
    }
    let ((ks, kl), (vs, vl)) = (k.storage_and_layout(), v.storage_and_layout());
    let ((kbs, kbl), (vbs, vbl)) = (kb.storage_and_layout(), vb.storage_and_layout());
    let ((ps, pl), (ss, sl)) = (pos.storage_and_layout(), state.storage_and_layout());
    // SAFETY: the buffers are the layer's own (`LayerCache::append` holds `&mut self`), and
    // nothing else writes or reads them while the launch is queued; reads queued before or
    // after are ordered by the stream, as after `slice_set`.
    unsafe {
        keydiff_kernels::append_rows(
            (on_cuda(&ks)?, kl),
            (on_cuda(&vs)?, vl),
            (on_cuda(&kbs)?, kbl),
            (on_cuda(&vbs)?, vbl),
            (on_cuda(&ps)?, pl),
            (on_cuda(&ss)?, sl),
            slot,
            pos0,
        )?;
    }
    Ok(true)
}

#[cfg(not(feature = "cuda"))]
fn append_cuda(
    _kv: (&Tensor, &Tensor),
    _bufs: [&Tensor; 4],
    _slot: usize,
    _pos0: usize,
) -> Result<bool> {
    Ok(false)
}

/// Rows of a cache buffer view `x` of type `t` read for attention in `dtype`
/// ([`LayerCache::keys_as`]).
fn rows_as(t: KvType, x: &Tensor, head_dim: usize, dtype: DType) -> Result<Tensor> {
    let fp8_on_cuda = t == KvType::Float(DType::F8E4M3) && x.device().is_cuda();
    if t.block_bytes().is_some() || fp8_on_cuda {
        t.decode_as(x, head_dim, dtype)
    } else {
        t.decode(x, head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_then_read_back() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = LayerCache::new(2, 4, 8, DType::F32, &dev)?;
        let k = Tensor::arange(0f32, 24., &dev)?.reshape((2, 3, 4))?;
        let v = (&k * 2.0)?;
        c.append(&k, &v, 10)?;
        c.append(&k.narrow(1, 0, 1)?, &v.narrow(1, 0, 1)?, 13)?;
        assert_eq!(c.len(), 4);
        assert_eq!(c.positions(1)?, vec![10, 11, 12, 13]);
        let keys = c.keys()?.to_vec3::<f32>()?;
        assert_eq!(keys[1][2], vec![20., 21., 22., 23.]);
        assert_eq!(keys[1][3], vec![12., 13., 14., 15.]);
        let vals = c.values()?.to_vec3::<f32>()?;
        assert_eq!(vals[0][1], vec![8., 10., 12., 14.]);
        assert_eq!(c.bytes(), 2 * 2 * 8 * 4 * 4);
        Ok(())
    }

    #[test]
    fn overflow_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = LayerCache::new(1, 2, 2, DType::F32, &dev)?;
        let k = Tensor::zeros((1, 3, 2), DType::F32, &dev)?;
        assert!(matches!(c.append(&k, &k, 0), Err(CacheError::Full { .. })));
        Ok(())
    }

    #[test]
    fn evict_keeps_the_best_and_moves_everything_with_its_slot() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = LayerCache::new(2, 2, 8, DType::F32, &dev)?;
        let k = Tensor::arange(0f32, 2. * 6. * 2., &dev)?.reshape((2, 6, 2))?;
        c.append(&k, &(&k + 100.)?, 0)?;
        c.add_state(&Tensor::arange(0f32, 12., &dev)?.reshape((2, 6))?)?;
        // head 0 keeps slots 4, 5 and 2; head 1 keeps 3, 1 and 4
        let scores = Tensor::new(
            &[[0f32, 1., 5., 2., 9., 8.], [-1., 1., 0., 7., 0.5, -3.]],
            &dev,
        )?;
        let plan = c.evict(&scores, 3, 0, 0)?;
        assert_eq!(plan.to_vec2::<u32>()?[0], vec![2, 4, 5, 0, 0, 1, 0]);
        assert_eq!(c.len(), 3);
        assert_eq!(c.positions(0)?, vec![4, 5, 2]);
        assert_eq!(c.positions(1)?, vec![3, 1, 4]);
        assert_eq!(c.state(0)?, vec![4., 5., 2.]);
        assert_eq!(c.state(1)?, vec![9., 7., 10.]);
        let keys = c.keys()?.to_vec3::<f32>()?;
        assert_eq!(keys[0], vec![vec![8., 9.], vec![10., 11.], vec![4., 5.]]);
        assert_eq!(
            keys[1],
            vec![vec![18., 19.], vec![14., 15.], vec![20., 21.]]
        );
        let vals = c.values()?.to_vec3::<f32>()?;
        assert_eq!(vals[1][0], vec![118., 119.]);
        // protection: 1 sink (position 0) and 1 recent (the newest) survive any score
        let mut c = LayerCache::new(1, 2, 8, DType::F32, &dev)?;
        c.append(&k.narrow(0, 0, 1)?, &k.narrow(0, 0, 1)?, 0)?;
        let low = Tensor::new(&[[-9f32, 1., 5., 2., 3., -9.]], &dev)?;
        c.evict(&low, 3, 1, 1)?;
        assert_eq!(c.positions(0)?, vec![0, 5, 2]);
        // At or under the budget nothing moves.
        let plan = c.evict(&Tensor::new(&[[1f32, 2., 3.]], &dev)?, 3, 0, 0)?;
        assert_eq!(plan.to_vec2::<u32>()?, vec![vec![0]]);
        assert_eq!(c.positions(0)?, vec![0, 5, 2]);
        Ok(())
    }

    #[test]
    fn moves_are_per_head() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = LayerCache::new(2, 2, 4, DType::F32, &dev)?;
        let k = Tensor::arange(0f32, 16., &dev)?.reshape((2, 4, 2))?;
        c.append(&k, &k, 0)?;
        // A source inside the kept range could be another move's destination: refused.
        assert!(matches!(
            c.clone().apply_moves(&[vec![(3, 1), (1, 0)], vec![]], 2),
            Err(CacheError::Shape(_))
        ));
        c.apply_moves(&[vec![(3, 0)], vec![(2, 1)]], 2)?;
        assert_eq!(
            c.keys()?.to_vec3::<f32>()?,
            vec![
                vec![vec![6., 7.], vec![2., 3.]],
                vec![vec![8., 9.], vec![12., 13.]]
            ]
        );
        assert_eq!(c.positions(0)?, vec![3, 1]);
        assert_eq!(c.positions(1)?, vec![0, 2]);
        Ok(())
    }
}
