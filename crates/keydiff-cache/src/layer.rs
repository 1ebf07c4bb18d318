//! The KV cache of one layer.

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

use crate::{CacheError, Result};

/// K and V of one layer, preallocated at `capacity` slots per KV head.
///
/// Every head has the same number of used slots (`len`), but after per-head eviction slot `s` of
/// two heads may hold different tokens; `positions` records the absolute position per head and
/// slot, and `state` a policy's per-slot value (H2O's accumulated attention). Both move with
/// their slot.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// `[kv_heads, capacity, head_dim]`
    k: Tensor,
    /// `[kv_heads, capacity, head_dim]`
    v: Tensor,
    len: usize,
    /// `[kv_heads * capacity]`, absolute token position of each slot.
    positions: Vec<u32>,
    /// `[kv_heads * capacity]`, per-slot policy state.
    state: Vec<f32>,
}

impl LayerCache {
    /// Allocates the buffers once; nothing grows afterwards.
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if capacity == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(CacheError::Config(format!(
                "empty cache: kv_heads={kv_heads} head_dim={head_dim} capacity={capacity}"
            )));
        }
        let k = Tensor::zeros((kv_heads, capacity, head_dim), dtype, device)?;
        let v = Tensor::zeros((kv_heads, capacity, head_dim), dtype, device)?;
        Ok(Self {
            k,
            v,
            len: 0,
            positions: vec![0; kv_heads * capacity],
            state: vec![0.0; kv_heads * capacity],
        })
    }

    /// Writes a chunk's keys and values (`[kv_heads, chunk, head_dim]`, post-RoPE) after the
    /// used slots. `pos0` is the absolute position of the chunk's first token.
    pub fn append(&mut self, k: &Tensor, v: &Tensor, pos0: usize) -> Result<()> {
        let (heads, chunk, dim) = k.dims3()?;
        let (kv_heads, capacity, head_dim) = self.k.dims3()?;
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
        self.k.slice_set(&k.contiguous()?, 1, self.len)?;
        self.v.slice_set(&v.contiguous()?, 1, self.len)?;
        for h in 0..kv_heads {
            let base = h * capacity + self.len;
            for i in 0..chunk {
                self.positions[base + i] = (pos0 + i) as u32;
                self.state[base + i] = 0.0;
            }
        }
        self.len += chunk;
        Ok(())
    }

    /// Keys of the used slots, `[kv_heads, len, head_dim]` (a view, not a copy).
    pub fn keys(&self) -> Result<Tensor> {
        Ok(self.k.narrow(1, 0, self.len)?)
    }

    /// Values of the used slots, `[kv_heads, len, head_dim]` (a view, not a copy).
    pub fn values(&self) -> Result<Tensor> {
        Ok(self.v.narrow(1, 0, self.len)?)
    }

    /// The whole K buffer, `[kv_heads, capacity, head_dim]` (for kernels).
    pub fn k_buffer(&self) -> &Tensor {
        &self.k
    }

    /// The whole V buffer, `[kv_heads, capacity, head_dim]` (for kernels).
    pub fn v_buffer(&self) -> &Tensor {
        &self.v
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
        self.k.dims()[2]
    }

    /// Absolute positions of the used slots of `head`.
    pub fn positions(&self, head: usize) -> &[u32] {
        let cap = self.capacity();
        &self.positions[head * cap..head * cap + self.len]
    }

    /// Per-slot policy state of the used slots of `head`.
    pub fn state(&self, head: usize) -> &[f32] {
        let cap = self.capacity();
        &self.state[head * cap..head * cap + self.len]
    }

    /// Mutable per-slot policy state of the used slots of `head`.
    pub fn state_mut(&mut self, head: usize) -> &mut [f32] {
        let cap = self.capacity();
        &mut self.state[head * cap..head * cap + self.len]
    }

    /// Bytes held by the K and V buffers (allocated, not used).
    pub fn bytes(&self) -> usize {
        2 * self.k.elem_count() * self.k.dtype().size_in_bytes()
    }

    /// Forgets every slot; the buffers stay allocated.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Applies per-head move plans (`(src, dst)` slot pairs, see [`crate::select::move_plan`])
    /// to K, V, positions and state, then sets the used length to `new_len`.
    pub fn apply_moves(&mut self, plans: &[Vec<(u32, u32)>], new_len: usize) -> Result<()> {
        let (kv_heads, cap, d) = self.k.dims3()?;
        if plans.len() != kv_heads || new_len > self.len {
            return Err(CacheError::Shape(format!(
                "{} plans for {kv_heads} heads, new len {new_len} > {}",
                plans.len(),
                self.len
            )));
        }
        for (h, plan) in plans.iter().enumerate() {
            for &(s, t) in plan {
                let (s, t) = (s as usize, t as usize);
                if s >= self.len || t >= new_len {
                    return Err(CacheError::Shape(format!(
                        "move {s} -> {t} outside used {} / kept {new_len}",
                        self.len
                    )));
                }
                self.positions[h * cap + t] = self.positions[h * cap + s];
                self.state[h * cap + t] = self.state[h * cap + s];
            }
        }
        if plans.iter().any(|p| !p.is_empty()) {
            let moves: Vec<(u32, u32, u32)> = plans
                .iter()
                .enumerate()
                .flat_map(|(h, p)| p.iter().map(move |&(s, t)| (h as u32, s, t)))
                .collect();
            if self.k.device().is_cpu() {
                let op = MoveSlots { moves, cap, d };
                self.k.inplace_op1(&op)?;
                self.v.inplace_op1(&op)?;
            } else {
                self.gather_compact(plans, new_len)?;
            }
        }
        self.len = new_len;
        Ok(())
    }
}

impl LayerCache {
    /// Device path of [`LayerCache::apply_moves`]: one gather of the `new_len` kept rows per
    /// head (identity plus the moves) and one copy back, for K and V: four kernels, whatever
    /// the number of moves.
    fn gather_compact(&mut self, plans: &[Vec<(u32, u32)>], new_len: usize) -> Result<()> {
        let (kv_heads, cap, d) = self.k.dims3()?;
        let mut idx: Vec<u32> = Vec::with_capacity(kv_heads * new_len);
        for (h, plan) in plans.iter().enumerate() {
            let base = (h * cap) as u32;
            let start = idx.len();
            idx.extend((0..new_len as u32).map(|s| base + s));
            for &(s, t) in plan {
                idx[start + t as usize] = base + s;
            }
        }
        let idx = Tensor::from_vec(idx, kv_heads * new_len, self.k.device())?;
        for buf in [&self.k, &self.v] {
            let kept = buf
                .reshape((kv_heads * cap, d))?
                .index_select(&idx, 0)?
                .reshape((kv_heads, new_len, d))?;
            buf.slice_set(&kept, 1, 0)?;
        }
        Ok(())
    }
}

/// In-place row moves inside a `[kv_heads, cap, d]` buffer on the CPU: `(head, src, dst)`.
struct MoveSlots {
    moves: Vec<(u32, u32, u32)>,
    cap: usize,
    d: usize,
}

impl MoveSlots {
    fn run<T: Copy>(&self, xs: &mut [T], offset: usize) {
        for &(h, s, t) in &self.moves {
            let base = offset + h as usize * self.cap * self.d;
            let src = base + s as usize * self.d;
            xs.copy_within(src..src + self.d, base + t as usize * self.d);
        }
    }
}

impl InplaceOp1 for MoveSlots {
    fn name(&self) -> &'static str {
        "kv-move-slots"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        if !layout.is_contiguous() {
            candle_core::bail!("kv-move-slots needs a contiguous buffer");
        }
        let o = layout.start_offset();
        match storage {
            CpuStorage::F32(xs) => self.run(xs, o),
            CpuStorage::F16(xs) => self.run(xs, o),
            CpuStorage::BF16(xs) => self.run(xs, o),
            CpuStorage::F64(xs) => self.run(xs, o),
            _ => candle_core::bail!("kv-move-slots: unsupported dtype"),
        }
        Ok(())
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
        assert_eq!(c.positions(1), &[10, 11, 12, 13]);
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
    fn gather_path_equals_in_place_path() -> Result<()> {
        let dev = Device::Cpu;
        let k = Tensor::arange(0f32, 2. * 6. * 3., &dev)?.reshape((2, 6, 3))?;
        let plans = vec![vec![(4, 1), (5, 2)], vec![(3, 0)]];
        let mut a = LayerCache::new(2, 3, 8, DType::F32, &dev)?;
        a.append(&k, &k, 0)?;
        let mut b = a.clone();
        b.k = b.k.copy()?;
        b.v = b.v.copy()?;
        a.apply_moves(&plans, 4)?;
        b.gather_compact(&plans, 4)?;
        b.len = 4;
        assert_eq!(a.keys()?.to_vec3::<f32>()?, b.keys()?.to_vec3::<f32>()?);
        assert_eq!(a.values()?.to_vec3::<f32>()?, b.values()?.to_vec3::<f32>()?);
        Ok(())
    }

    #[test]
    fn moves_are_per_head() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = LayerCache::new(2, 2, 4, DType::F32, &dev)?;
        let k = Tensor::arange(0f32, 16., &dev)?.reshape((2, 4, 2))?;
        c.append(&k, &k, 0)?;
        c.apply_moves(&[vec![(3, 0)], vec![(2, 1)]], 2)?;
        assert_eq!(
            c.keys()?.to_vec3::<f32>()?,
            vec![
                vec![vec![6., 7.], vec![2., 3.]],
                vec![vec![8., 9.], vec![12., 13.]]
            ]
        );
        assert_eq!(c.positions(0), &[3, 1]);
        assert_eq!(c.positions(1), &[0, 2]);
        Ok(())
    }
}
