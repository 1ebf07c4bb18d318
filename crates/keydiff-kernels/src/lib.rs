//! CUDA kernels of keydiff: fused KeyDiff scoring, victim selection with its move plan, and the
//! slot moves. `build.rs` compiles `kernels/*.cu` to PTX (see there for why at build time);
//! the PTX is embedded and loaded once per device through candle's custom-module cache.
//!
//! These are the launch functions that the candle ops of `keydiff-cache` call from their
//! `cuda_fwd`; the same ops' `cpu_fwd` are the reference twins. Without the `cuda` feature the
//! crate is empty.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;
