// Compiled (never run) by build.sh where the cargo registry holds the candle-flash-attn that
// Cargo.lock pins: the fields mockcudart.c reads from a FlashAttention launch must sit where
// the crate's own Flash_fwd_params has them, with the same sizes.
#include <cstddef>

#include <cuda_runtime_api.h>  // cudaStream_t, which flash.h uses without including it

#include "flash.h"
#include "mockflash.h"

#define SAME(f)                                                                         \
  static_assert(offsetof(Flash_fwd_params, f) == offsetof(FlashParams, f), #f " moved"); \
  static_assert(sizeof(Flash_fwd_params::f) == sizeof(FlashParams::f), #f " changed size")
SAME(q_ptr);
SAME(k_ptr);
SAME(v_ptr);
SAME(q_batch_stride);
SAME(k_batch_stride);
SAME(v_batch_stride);
SAME(q_row_stride);
SAME(k_row_stride);
SAME(v_row_stride);
SAME(q_head_stride);
SAME(k_head_stride);
SAME(v_head_stride);
SAME(h);
SAME(h_k);
SAME(h_h_k_ratio);
SAME(o_ptr);
SAME(o_batch_stride);
SAME(o_row_stride);
SAME(o_head_stride);
SAME(p_ptr);
SAME(softmax_lse_ptr);
SAME(b);
SAME(seqlen_q);
SAME(seqlen_k);
SAME(d);
SAME(seqlen_q_rounded);
SAME(seqlen_k_rounded);
SAME(d_rounded);
SAME(scale_softmax);
SAME(scale_softmax_log2);
SAME(cu_seqlens_q);
SAME(cu_seqlens_k);
SAME(knew_ptr);
SAME(block_table);
SAME(window_size_left);
SAME(window_size_right);
SAME(is_bf16);
SAME(is_causal);
SAME(num_splits);
