//! KV cache under a fixed budget.
//!
//! Each layer owns one [`LayerCache`]: K and V buffers of `[kv_heads, capacity, head_dim]`,
//! allocated once, with capacity N + B (or the request's prompt + output, when that is less).
//! Slots `[0, len)` hold the cached tokens; a new chunk is
//! written at `[len, len + chunk)`. After the chunk's attention, [`KvCache::after_attention`]
//! scores the slots with the active [`Policy`] (a `[kv_heads, n]` tensor on the cache's device),
//! keeps the best N per KV head (shared selection, [`select::SelectPlan`]; the reference is
//! [`select::select`]), and refills victim slots in `[0, N)` with surviving chunk slots
//! ([`select::ApplyPlan`] on K, V, positions and policy state). On CUDA these are the kernels of
//! `kernels/keydiff.cu`, so eviction never goes through the host. Keys are stored after RoPE, so
//! moving or dropping a slot never changes another one. See `DESIGN.md` (Cache layout) and
//! `POLICIES.md`.

mod cache;
pub mod config;
mod kv_type;
mod layer;
pub mod policy;
pub mod select;

pub use cache::{CacheCounters, KvCache, KvCacheParts, Profile};
pub use config::{Anchor, CacheConfig, PolicyKind};
/// Which GPUs the build's CUDA code runs on (flash attention and the device check read it).
pub use keydiff_kernels::arch;
pub use kv_type::{
    dequantize_block, dequantize_blocks, quantize_block, quantize_blocks, KvType, KvTypes, KV_BLOCK,
};
pub use layer::{LayerCache, LayerParts};
pub use policy::{AttnStats, Policy, StatsNeed};

/// Errors of the cache crate.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache full: {len} slots used + {chunk} new > capacity {capacity}")]
    Full {
        len: usize,
        chunk: usize,
        capacity: usize,
    },
    #[error("bad cache config: {0}")]
    Config(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error(transparent)]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for CacheError {
    fn from(e: candle_core::Error) -> Self {
        CacheError::Candle(without_backtrace(e))
    }
}

/// `e` without the backtraces candle attaches to its errors when `RUST_BACKTRACE` is set:
/// they would otherwise be part of the message, on the command line and in the server's
/// JSON replies. Each is logged at debug level instead. Every crate of keydiff converts
/// candle's errors through this.
pub fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    use candle_core::Error;
    match e {
        Error::WithBacktrace { inner, backtrace } => {
            tracing::debug!("backtrace of `{inner}`:\n{backtrace}");
            without_backtrace(*inner)
        }
        Error::Context { inner, context } => Error::Context {
            inner: Box::new(without_backtrace(*inner)),
            context,
        },
        Error::WithPath { inner, path } => Error::WithPath {
            inner: Box::new(without_backtrace(*inner)),
            path,
        },
        e => e,
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CacheError>;
