//! Sampling a row of logits: the host sampler's draw ([`draw`]: temperature, top-k, top-p,
//! min-p) and the same draw where the logits are ([`sample_rows`]: on CUDA keydiff's
//! `keydiff_sample_rows_*` kernel, on the CPU the draw over the rows in place). Logit bias,
//! penalties and constraints stay with the caller's sampler (`keydiff::Sampler`), which draws
//! the uniform `r` each row takes.

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

use crate::decode_kernel::{argmax, switched_on};
use crate::error::{ModelError, Result};

/// One row's draw for [`sample_rows`]: the sampler's temperature (0 or less is greedy), top-k
/// (0 is off), top-p (1 is off) and min-p (0 is off), the uniform `r` in [0, 1) the host's
/// generator gave for this step, and the temperature top-p and min-p see.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawParams {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub r: f32,
    /// The temperature of the weights top-p and min-p cut by: 1 in llama.cpp's order (the
    /// temperature after the truncations), `temperature` in vLLM's and Hugging Face's (before
    /// them). Positive.
    pub truncation_temperature: f32,
}

impl DrawParams {
    /// The kernel's words for this row (`SAMPLE_PARAM_WORDS`).
    pub fn words(&self) -> [u32; keydiff_kernels::geometry::SAMPLE_PARAM_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.r.to_bits(),
            self.truncation_temperature.to_bits(),
        ]
    }
}

/// Set in a token from [`sample_rows`] whose row had no finite logit: the token is the row's
/// argmax, and `r` was not used (the host's sampler draws nothing for such a row).
pub const NO_DRAW: u32 = keydiff_kernels::geometry::SAMPLE_NO_DRAW;

/// Whether [`sample_rows`] draws tokens on `device`: on the CPU (the host's draw over the rows
/// in place) and on CUDA (keydiff's kernel, unless `KEYDIFF_CUDA_SAMPLE=0`).
pub fn samples_on(device: &Device) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    device.is_cpu()
        || (cfg!(feature = "cuda") && device.is_cuda() && switched_on(&ON, "KEYDIFF_CUDA_SAMPLE"))
}

/// Sampling where the logits are: each row of `logits` (`[rows, vocab]`, f32/f16/bf16, rows
/// contiguous) drawn with its [`DrawParams`] as the host's sampler draws it ([`draw`]; the
/// argmax for a temperature of 0 or less). On CUDA one launch of `keydiff_sample_rows_*` (up
/// to the rounding of the sums: the kernel sums weights in fixed point), and 4 bytes a row come
/// back; on the CPU [`draw`] over the rows in place. `None` where the device does not sample
/// ([`samples_on`]), or for logits it cannot take: the caller reads the rows and samples on
/// the host. [`NO_DRAW`] is set in the token of a row with no finite logit (its argmax).
pub fn sample_rows(logits: &Tensor, params: &[DrawParams]) -> Result<Option<Vec<u32>>> {
    let (rows, cols) = logits.dims2()?;
    if rows != params.len() {
        return Err(ModelError::Shape(format!(
            "{} draws for {rows} rows of logits",
            params.len()
        )));
    }
    let float = matches!(logits.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if rows == 0 || cols == 0 || !float || !samples_on(logits.device()) || logits.stride()[1] != 1 {
        return Ok(None);
    }
    if logits.device().is_cpu() {
        let x = logits.to_dtype(DType::F32)?;
        let (s, l) = x.storage_and_layout();
        let one = |row: &[f32], p: &DrawParams| match p.temperature > 0.0 {
            true => draw(row, p).unwrap_or_else(|| argmax(row) | NO_DRAW),
            false => argmax(row),
        };
        if let (candle_core::Storage::Cpu(c), Some((start, end))) = (&*s, l.contiguous_offsets()) {
            // The CPU's rows in place: no copy of the vocabulary per step.
            let all = &c.as_slice::<f32>()?[start..end];
            return Ok(Some(
                all.chunks_exact(cols)
                    .zip(params)
                    .map(|(r, p)| one(r, p))
                    .collect(),
            ));
        }
        drop(s);
        let rows = x.to_vec2::<f32>()?;
        return Ok(Some(
            rows.iter().zip(params).map(|(r, p)| one(r, p)).collect(),
        ));
    }
    if cols > keydiff_kernels::geometry::SAMPLE_MAX_COLS {
        // Past the kernel's fixed point: the host draws.
        return Ok(None);
    }
    let words: Vec<u32> = params.iter().flat_map(|p| p.words()).collect();
    let p = Tensor::from_vec(
        words,
        (rows, keydiff_kernels::geometry::SAMPLE_PARAM_WORDS),
        logits.device(),
    )?;
    cuda_sample_rows(logits, &p)
}

#[cfg(feature = "cuda")]
fn cuda_sample_rows(x: &Tensor, p: &Tensor) -> Result<Option<Vec<u32>>> {
    Ok(Some(x.apply_op2_no_bwd(p, &CudaSample)?.to_vec1::<u32>()?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_sample_rows(_x: &Tensor, _p: &Tensor) -> Result<Option<Vec<u32>>> {
    Ok(None)
}

/// The candle op of [`sample_rows`] on CUDA (logits, parameters).
#[cfg(feature = "cuda")]
struct CudaSample;

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for CudaSample {
    fn name(&self) -> &'static str {
        "sample-rows"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("sample-rows: the CUDA kernel's op runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &candle_core::Layout,
        p: &candle_core::CudaStorage,
        pl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        keydiff_kernels::sample_rows((x, l), (p, pl))
    }
}

/// The host sampler's draw from a row of logits with `c`'s top-k, top-p, min-p, temperature
/// (> 0) and uniform `r` in [0, 1) (any logit bias and penalties applied before): the finite
/// logits in [`order`], truncated (top-p and min-p at `c.truncation_temperature`), and the first
/// whose running probability passes `r`. `None`
/// when no logit is finite (there is nothing to draw). The reference of the device's sampler
/// (`keydiff_sample_rows_*`).
pub fn draw(logits: &[f32], c: &DrawParams) -> Option<u32> {
    let cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    (!cand.is_empty()).then(|| pick(cand, c))
}

/// Candidates by logit, descending; ties keep the lower id first (a total order).
pub fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Candidates sorted by [`order`] only as far as they are read: the first `sorted` are the
/// first of all in order, and [`Ranked::get`] sorts on (in growing chunks) when asked for one
/// past them. A draw mostly ends in the first few tokens, so this costs a selection over the
/// vocabulary where a whole sort cost several milliseconds a step.
struct Ranked {
    cand: Vec<(u32, f32)>,
    sorted: usize,
}

impl Ranked {
    fn get(&mut self, i: usize) -> (u32, f32) {
        if i >= self.sorted {
            let upto = (self.sorted * 2).max(i + 1).max(64).min(self.cand.len());
            let rest = &mut self.cand[self.sorted..];
            let n = upto - self.sorted;
            if n < rest.len() {
                rest.select_nth_unstable_by(n - 1, order);
            }
            rest[..n].sort_by(order);
            self.sorted = upto;
        }
        self.cand[i]
    }

    /// Keeps the first `n` in order.
    fn truncate(&mut self, n: usize) {
        if n <= self.sorted {
            self.cand.truncate(n);
            self.sorted = n;
        } else if n < self.cand.len() {
            // The next `n - sorted` in order, unsorted: the draw sorts what it reads of them.
            self.cand[self.sorted..].select_nth_unstable_by(n - 1 - self.sorted, order);
            self.cand.truncate(n);
        }
    }
}

/// Draws from the finite candidates `cand` (non-empty) with top-k, top-p, min-p, the
/// temperature and the uniform `r` of `c`: walking the candidates in [`order`], the first
/// whose running probability passes `r`. The same draw as sorting all of them first, up to
/// the rounding of the sums (`tests::pick_whole_sort`).
pub fn pick(mut cand: Vec<(u32, f32)>, c: &DrawParams) -> u32 {
    let r = c.r;
    let top_k = c.top_k as usize;
    if top_k > 0 && top_k < cand.len() {
        // The order is total, so the k first are the same as after a whole sort.
        cand.select_nth_unstable_by(top_k - 1, order);
        cand.truncate(top_k);
    }
    let max = cand.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
    let mut ranked = Ranked { cand, sorted: 0 };
    // Weights and sums in f64: the sums are taken in two orders (all candidates as they lie,
    // the running sum in rank order), and in f32 the tail of a 150K vocabulary rounds away
    // in one but not the other, leaving the running sum short of the total.
    let tc = c.truncation_temperature as f64;
    if c.top_p < 1.0 {
        let w = |l: f32| ((l - max) as f64 / tc).exp();
        let total: f64 = ranked.cand.iter().map(|x| w(x.1)).sum();
        let target = c.top_p as f64 * total;
        let (mut acc, mut keep, len) = (0.0, ranked.cand.len(), ranked.cand.len());
        for i in 0..len {
            acc += w(ranked.get(i).1);
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        ranked.truncate(keep.max(1));
    }
    if c.min_p > 0.0 {
        // p ≥ p_max · min_p, with p ∝ exp((logit − max) / tc): the tokens whose logit is
        // within −tc · ln(min_p) of the best.
        let keep = ranked
            .cand
            .iter()
            .filter(|x| ((x.1 - max) as f64 / tc).exp() >= c.min_p as f64)
            .count();
        ranked.truncate(keep.max(1));
    }
    let w = |l: f32| ((l - max) as f64 / c.temperature as f64).exp();
    let total: f64 = ranked.cand.iter().map(|x| w(x.1)).sum();
    let target = r as f64 * total;
    let mut acc = 0.0;
    let len = ranked.cand.len();
    for i in 0..len {
        let (tok, l) = ranked.get(i);
        acc += w(l);
        if target < acc {
            return tok;
        }
    }
    // Only rounding gets here (`r` < 1 and the sums agree to ~1e-16): the last token read.
    ranked.get(len - 1).0
}
