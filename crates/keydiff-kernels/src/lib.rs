//! CUDA kernels of keydiff: fused KeyDiff scoring, victim selection with its move plan, the
//! slot moves and SnapKV's pooling. `build.rs` compiles `kernels/*.cu` to PTX (see there for
//! why at build time); the PTX is embedded and loaded once per device through candle's
//! custom-module cache.
//!
//! - [`geometry`]: the launch geometry and argument checks, always built.
//! - [`arch`]: which GPUs the build's CUDA code runs on, always built.
//! - `cuda` (feature `cuda`): the launch functions that the candle ops of `keydiff-cache` call
//!   from their `cuda_fwd`; the same ops' `cpu_fwd` are the reference twins.
//! - [`emu`] (feature `emulate`): the same kernel source, compiled by the host C++ compiler and
//!   run under a CPU emulation of the CUDA execution model (`kernels/emu/`), with the same
//!   geometry; keydiff-cache's tests check it against the twins on machines without a GPU.
//! - [`fence`] (feature `emulate`): the guard-page buffers the emulated kernels get, so that an
//!   out-of-bounds access is reported, naming the buffer.

pub mod arch;
pub mod geometry;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

#[cfg(feature = "emulate")]
pub mod emu;
#[cfg(feature = "emulate")]
pub mod fence;
