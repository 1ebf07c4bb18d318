// FlashAttention-2's parameter block (candle-flash-attn 0.11.1, kernels/flash.h: Qkv_params,
// then Flash_fwd_params' own fields), as far as mockcudart.c's checks read it. Its kernels take
// it by value: a launch's args[0] points to it. build.sh compares these offsets with the
// crate's own header where the cargo registry has it (flashlayout.cpp), and every launch
// checks that the block reads consistently (GQA ratio, rounded sizes, the softmax scale's log2
// twin, the dtype the kernel was compiled for), which a shifted layout would not.
#pragma once
#include <stdbool.h>
#include <stdint.h>

typedef struct FlashParams {
  void *q_ptr, *k_ptr, *v_ptr;
  int64_t q_batch_stride, k_batch_stride, v_batch_stride;
  int64_t q_row_stride, k_row_stride, v_row_stride;
  int64_t q_head_stride, k_head_stride, v_head_stride;
  int h, h_k, h_h_k_ratio;
  void *o_ptr, *oaccum_ptr;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  void* p_ptr;
  void *softmax_lse_ptr, *softmax_lseaccum_ptr;
  int b, seqlen_q, seqlen_k, seqlen_knew, d, seqlen_q_rounded, seqlen_k_rounded, d_rounded, rotary_dim, total_q;
  float scale_softmax, scale_softmax_log2;
  int *cu_seqlens_q, *cu_seqlens_k, *leftpad_k, *seqused_k, *blockmask;
  void *knew_ptr, *vnew_ptr;
  int64_t knew_batch_stride, vnew_batch_stride, knew_row_stride, vnew_row_stride, knew_head_stride,
      vnew_head_stride;
  void *rotary_cos_ptr, *rotary_sin_ptr;
  int* cache_batch_idx;
  int* block_table;
  int64_t block_table_batch_stride;
  int page_block_size;
  int* mm_prefix_ranges;
  int64_t mm_prefix_range_batch_stride;
  int max_mm_prefix_ranges;
  float p_dropout;
  uint8_t p_dropout_in_uint8_t;
  float rp_dropout, scale_softmax_rp_dropout;
  int window_size_left, window_size_right;
  float softcap;
  uint64_t* rng_state;
  bool is_bf16, is_causal, is_seqlens_k_cumulative, is_rotary_interleaved;
  int num_splits;
} FlashParams;
