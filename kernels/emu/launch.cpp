// Host entry points that run the kernels of kernels/keydiff.cu under the CPU emulation
// (cuda_emu.h), with the grid and block sizes the caller computes (crates/keydiff-kernels: the
// same functions the CUDA launches use). Each returns 0, or 1 with the error in `err`.
// Self-test kernels at the end show that the emulation's checks fire.

#include "cuda_emu.h"

#include <stdio.h>

#include "../keydiff.cu"

namespace {

int finish(const std::string& e, char* err, size_t err_len) {
  if (e.empty()) return 0;
  if (err_len) snprintf(err, err_len, "%s", e.c_str());
  return 1;
}

dim3 d3(unsigned x, unsigned y = 1) { return dim3{x, y, 1}; }

// No C++ exception may cross the extern "C" boundary (e.g. bad_alloc for the fiber stacks).
std::string guarded(dim3 grid, dim3 block, unsigned bounds, uint64_t seed,
                    const std::function<void()>& body) {
  try {
    return kd_emu::launch(grid, block, bounds, seed, body);
  } catch (const std::exception& e) {
    return std::string("emulation failed: ") + e.what();
  }
}

}  // namespace

// keydiff_pass1 then keydiff_pass2 (vec_d 0), or keydiff_pass1v/2v for head dim vec_d (64,
// 128, 256; the caller has checked that the view takes 16-byte loads). dtype: 0 f32, 1 f16,
// 2 bf16. `anchor` must be zeroed.
extern "C" int kd_emu_keydiff_scores(int dtype, int vec_d, const void* keys, int64_t head_stride,
                                     int64_t row_stride, int n, int d, int normalized,
                                     float* norms, float* anchor, float* scores, unsigned grid_x,
                                     unsigned grid_y, unsigned block, uint64_t seed, char* err,
                                     size_t err_len) {
  std::function<void()> p1, p2;
#define KD_EMU_PASSES(K1, K2, T)                                                                 \
  p1 = [=] {                                                                                     \
    kd_emu::run_kernel(K1, (const T*)keys, head_stride, row_stride, n, d, normalized, norms,     \
                       anchor);                                                                  \
  };                                                                                             \
  p2 = [=] {                                                                                     \
    kd_emu::run_kernel(K2, (const T*)keys, head_stride, row_stride, n, d, (const float*)norms,   \
                       (const float*)anchor, scores);                                            \
  };
#define KD_EMU_DTYPE(SUFFIX, T)                                                                  \
  switch (vec_d) {                                                                               \
    case 0:                                                                                      \
      KD_EMU_PASSES(keydiff_pass1_##SUFFIX, keydiff_pass2_##SUFFIX, T)                           \
      break;                                                                                     \
    case 64:                                                                                     \
      KD_EMU_PASSES(keydiff_pass1v_##SUFFIX##_64, keydiff_pass2v_##SUFFIX##_64, T)               \
      break;                                                                                     \
    case 128:                                                                                    \
      KD_EMU_PASSES(keydiff_pass1v_##SUFFIX##_128, keydiff_pass2v_##SUFFIX##_128, T)             \
      break;                                                                                     \
    case 256:                                                                                    \
      KD_EMU_PASSES(keydiff_pass1v_##SUFFIX##_256, keydiff_pass2v_##SUFFIX##_256, T)             \
      break;                                                                                     \
    default:                                                                                     \
      return finish("no 16-byte scoring kernel for d " + std::to_string(vec_d), err, err_len);  \
  }
  switch (dtype) {
    case 0:
      KD_EMU_DTYPE(f32, float)
      break;
    case 1:
      KD_EMU_DTYPE(f16, __half)
      break;
    case 2:
      KD_EMU_DTYPE(bf16, __nv_bfloat16)
      break;
    default:
      return finish("unknown dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_DTYPE
#undef KD_EMU_PASSES
  std::string e = guarded(d3(grid_x, grid_y), d3(block), KD_THREADS, seed, p1);
  if (e.empty()) e = guarded(d3(grid_x, grid_y), d3(block), KD_THREADS, seed + 1, p2);
  return finish(e, err, err_len);
}

extern "C" int kd_emu_select_plan(const float* scores, int64_t score_stride,
                                  const uint32_t* positions, int64_t pos_stride, int n,
                                  int budget, uint32_t sinks, int recent, uint32_t* plan,
                                  int64_t plan_stride, unsigned grid_x, unsigned block,
                                  uint64_t seed, char* err, size_t err_len) {
  const std::string e =
      guarded(d3(grid_x), d3(block), KD_SELECT_THREADS, seed, [=] {
        kd_emu::run_kernel(keydiff_select_plan, scores, score_stride, positions, pos_stride, n,
                           budget, sinks, recent, plan, plan_stride);
      });
  return finish(e, err, err_len);
}

// The many-block selection: keydiff_select_pass (which 0, with `pass`; `plan` unused),
// keydiff_select_count (1), keydiff_select_emit (2); and the one-launch selection of few
// evictions, keydiff_select_few (3; `pass` unused).
extern "C" int kd_emu_select_multi(int which, const float* scores, int64_t score_stride,
                                   const uint32_t* positions, int64_t pos_stride, int n,
                                   int budget, uint32_t sinks, int recent, int pass,
                                   uint32_t* plan, int64_t plan_stride, uint32_t* ws,
                                   int64_t ws_stride, unsigned grid_x, unsigned grid_y,
                                   unsigned block, uint64_t seed, char* err, size_t err_len) {
  std::function<void()> body;
  switch (which) {
    case 0:
      body = [=] {
        kd_emu::run_kernel(keydiff_select_pass, scores, score_stride, positions, pos_stride, n,
                           budget, sinks, recent, pass, ws, ws_stride);
      };
      break;
    case 1:
      body = [=] {
        kd_emu::run_kernel(keydiff_select_count, scores, score_stride, positions, pos_stride, n,
                           budget, sinks, recent, plan, plan_stride, ws, ws_stride);
      };
      break;
    case 2:
      body = [=] {
        kd_emu::run_kernel(keydiff_select_emit, scores, score_stride, positions, pos_stride, n,
                           budget, sinks, recent, plan, plan_stride, ws, ws_stride);
      };
      break;
    case 3:
      body = [=] {
        kd_emu::run_kernel(keydiff_select_few, scores, score_stride, positions, pos_stride, n,
                           budget, sinks, recent, plan, plan_stride, ws, ws_stride);
      };
      break;
    default:
      return finish("unknown selection kernel " + std::to_string(which), err, err_len);
  }
  const unsigned bounds = which == 3 ? KD_FEW_THREADS : KD_SEL_THREADS;
  return finish(guarded(d3(grid_x, grid_y), d3(block), bounds, seed, body), err, err_len);
}

extern "C" int kd_emu_move_rows(char* buf, int64_t head_stride, int64_t row_stride,
                                int row_bytes, int rows, const uint32_t* plan,
                                int64_t plan_stride, int max_moves, unsigned grid_x,
                                unsigned grid_y, unsigned block, uint64_t seed, char* err,
                                size_t err_len) {
  const std::string e = guarded(d3(grid_x, grid_y), d3(block), 0, seed, [=] {
    kd_emu::run_kernel(keydiff_move_rows, buf, head_stride, row_stride, row_bytes, rows, plan,
                       plan_stride, max_moves);
  });
  return finish(e, err, err_len);
}

extern "C" int kd_emu_append_rows(const char* k, int64_t k_hs, int64_t k_rs, const char* v,
                                  int64_t v_hs, int64_t v_rs, char* kbuf, char* vbuf,
                                  int64_t buf_hs, int64_t buf_rs, int row_bytes,
                                  uint32_t* positions, float* state, int64_t meta_hs, int slot,
                                  int chunk, uint32_t pos0, unsigned grid_x, unsigned grid_y,
                                  unsigned block, uint64_t seed, char* err, size_t err_len) {
  const std::string e = guarded(d3(grid_x, grid_y), d3(block), KD_APPEND_THREADS, seed, [=] {
    kd_emu::run_kernel(keydiff_append_rows, k, k_hs, k_rs, v, v_hs, v_rs, kbuf, vbuf, buf_hs,
                       buf_rs, row_bytes, positions, state, meta_hs, slot, chunk, pos0);
  });
  return finish(e, err, err_len);
}

// keydiff_kvq_quantize_*: dtype 0 f32, 1 f16, 2 bf16; kind as KD_KVQ_*.
extern "C" int kd_emu_kvq_quantize(int dtype, const void* x, int64_t head_stride,
                                   int64_t row_stride, int n, int d, int kind, uint8_t* out,
                                   unsigned grid_x, unsigned grid_y, unsigned block,
                                   uint64_t seed, char* err, size_t err_len) {
  std::function<void()> body;
  switch (dtype) {
    case 0:
      body = [=] {
        kd_emu::run_kernel(keydiff_kvq_quantize_f32, (const float*)x, head_stride, row_stride, n,
                           d, kind, out);
      };
      break;
    case 1:
      body = [=] {
        kd_emu::run_kernel(keydiff_kvq_quantize_f16, (const __half*)x, head_stride, row_stride,
                           n, d, kind, out);
      };
      break;
    case 2:
      body = [=] {
        kd_emu::run_kernel(keydiff_kvq_quantize_bf16, (const __nv_bfloat16*)x, head_stride,
                           row_stride, n, d, kind, out);
      };
      break;
    default:
      return finish("unknown dtype " + std::to_string(dtype), err, err_len);
  }
  return finish(guarded(d3(grid_x, grid_y), d3(block), KD_KVQ_THREADS, seed, body), err, err_len);
}

// out_dtype: 0 f32 (keydiff_kvq_dequantize), 1 f16, 2 bf16 (keydiff_kvq_dequantize_<dtype>).
extern "C" int kd_emu_kvq_dequantize(const uint8_t* q, int64_t head_stride, int64_t row_stride,
                                     int n, int d, int kind, int out_dtype, void* out,
                                     unsigned grid_x, unsigned grid_y, unsigned block,
                                     uint64_t seed, char* err, size_t err_len) {
  std::function<void()> run;
  switch (out_dtype) {
    case 0:
      run = [=] {
        kd_emu::run_kernel(keydiff_kvq_dequantize, q, head_stride, row_stride, n, d, kind,
                           (float*)out);
      };
      break;
    case 1:
      run = [=] {
        kd_emu::run_kernel(keydiff_kvq_dequantize_f16, q, head_stride, row_stride, n, d, kind,
                           (__half*)out);
      };
      break;
    case 2:
      run = [=] {
        kd_emu::run_kernel(keydiff_kvq_dequantize_bf16, q, head_stride, row_stride, n, d, kind,
                           (__nv_bfloat16*)out);
      };
      break;
    default:
      return finish("no dequantize kernel for dtype " + std::to_string(out_dtype), err, err_len);
  }
  const std::string e = guarded(d3(grid_x, grid_y), d3(block), KD_KVQ_THREADS, seed, run);
  return finish(e, err, err_len);
}

// keydiff_decode_<dtype>_<ne> (kind < 0: k and v in the dtype, element strides) or
// keydiff_decode_kvq_<dtype>_<ne> (kind: a KD_KVQ_*, k and v u8 rows, byte strides) on grid
// (grid_x, grid_y), then for more than one split keydiff_decode_combine_<dtype> on (1, grid_y),
// as the CUDA wrapper launches them. dtype: 0 f32, 1 f16, 2 bf16; ne: 2, 4 or 8.
extern "C" int kd_emu_decode(int dtype, int ne, int kind, const void* q, const void* k,
                             int64_t k_hs, int64_t k_rs, const void* v, int64_t v_hs, int64_t v_rs,
                             int t, int g, int d, int span, float scale, void* out, float* part,
                             unsigned grid_x, unsigned grid_y, unsigned block, uint64_t seed,
                             char* err, size_t err_len) {
  std::function<void()> run, combine;
#define KD_EMU_DECODE(SUFFIX, T, NE)                                                             \
  run = [=] {                                                                                    \
    if (kind < 0)                                                                                \
      kd_emu::run_kernel(keydiff_decode_##SUFFIX##_##NE, (const T*)q, (const T*)k, k_hs, k_rs,   \
                         (const T*)v, v_hs, v_rs, t, g, d, span, scale, (T*)out, part);          \
    else                                                                                         \
      kd_emu::run_kernel(keydiff_decode_kvq_##SUFFIX##_##NE, (const T*)q, (const uint8_t*)k,     \
                         k_hs, k_rs, (const uint8_t*)v, v_hs, v_rs, kind, t, g, d, span, scale,  \
                         (T*)out, part);                                                         \
  };                                                                                             \
  combine = [=] {                                                                                \
    kd_emu::run_kernel(keydiff_decode_combine_##SUFFIX, (const float*)part, (int)grid_x, g, d,   \
                       (T*)out);                                                                 \
  };
#define KD_EMU_DECODE_NE(SUFFIX, T)                                                              \
  switch (ne) {                                                                                  \
    case 2:                                                                                      \
      KD_EMU_DECODE(SUFFIX, T, 2)                                                                \
      break;                                                                                     \
    case 4:                                                                                      \
      KD_EMU_DECODE(SUFFIX, T, 4)                                                                \
      break;                                                                                     \
    case 8:                                                                                      \
      KD_EMU_DECODE(SUFFIX, T, 8)                                                                \
      break;                                                                                     \
    default:                                                                                     \
      return finish("no decode kernel for " + std::to_string(ne) + " values a lane", err,        \
                    err_len);                                                                    \
  }
  switch (dtype) {
    case 0:
      KD_EMU_DECODE_NE(f32, float)
      break;
    case 1:
      KD_EMU_DECODE_NE(f16, __half)
      break;
    case 2:
      KD_EMU_DECODE_NE(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no decode kernel for dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_DECODE_NE
#undef KD_EMU_DECODE
  std::string e = guarded(d3(grid_x, grid_y), d3(block), KD_DEC_THREADS, seed, run);
  if (e.empty() && grid_x > 1)
    e = guarded(d3(1, grid_y), d3(block), KD_DEC_THREADS, seed + 1, combine);
  return finish(e, err, err_len);
}

// in: 0 f32, 1 f16, 2 bf16; out: 0 f32, or the scores' own dtype.
extern "C" int kd_emu_causal_softmax(int in, int out, const void* s, void* p, int t, int chunk,
                                     unsigned grid_x, unsigned block, uint64_t seed, char* err,
                                     size_t err_len) {
  std::function<void()> run;
#define KD_EMU_SMX(SI, TI, SO, TO) \
  run = [=] { kd_emu::run_kernel(keydiff_causal_softmax_##SI##_##SO, (const TI*)s, (TO*)p, t, chunk); };
  if (in == 0 && out == 0) {
    KD_EMU_SMX(f32, float, f32, float)
  } else if (in == 1 && out == 0) {
    KD_EMU_SMX(f16, __half, f32, float)
  } else if (in == 1 && out == 1) {
    KD_EMU_SMX(f16, __half, f16, __half)
  } else if (in == 2 && out == 0) {
    KD_EMU_SMX(bf16, __nv_bfloat16, f32, float)
  } else if (in == 2 && out == 2) {
    KD_EMU_SMX(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
  } else {
    return finish("no causal softmax from dtype " + std::to_string(in) + " to " +
                      std::to_string(out),
                  err, err_len);
  }
#undef KD_EMU_SMX
  return finish(guarded(d3(grid_x), d3(block), KD_SMX_THREADS, seed, run), err, err_len);
}

// in: 0 f32, 1 f16, 2 bf16.
extern "C" int kd_emu_softmax_state(int in, const void* s, float* state, int t, int chunk,
                                    unsigned grid_x, unsigned block, uint64_t seed, char* err,
                                    size_t err_len) {
  std::function<void()> run;
#define KD_EMU_SMX_STATE(SI, TI) \
  run = [=] { kd_emu::run_kernel(keydiff_softmax_state_##SI, (const TI*)s, state, t, chunk); };
  switch (in) {
    case 0:
      KD_EMU_SMX_STATE(f32, float)
      break;
    case 1:
      KD_EMU_SMX_STATE(f16, __half)
      break;
    case 2:
      KD_EMU_SMX_STATE(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no softmax state kernel for dtype " + std::to_string(in), err, err_len);
  }
#undef KD_EMU_SMX_STATE
  return finish(guarded(d3(grid_x), d3(block), KD_SMX_THREADS, seed, run), err, err_len);
}

// in: 0 f32, 1 f16, 2 bf16; out: 0 f32, the scores' own dtype, or -1 for no probabilities
// (p is then passed as a null pointer).
extern "C" int kd_emu_softmax_sums(int in, int out, const void* s, const float* state, void* p,
                                   float* stats, int t, int chunk, int stat_rows,
                                   unsigned grid_x, unsigned grid_y, unsigned block,
                                   uint64_t seed, char* err, size_t err_len) {
  std::function<void()> run;
#define KD_EMU_SMX_SUMS(SI, TI, SO, TO)                                                       \
  run = [=] {                                                                                 \
    kd_emu::run_kernel(keydiff_softmax_sums_##SI##_##SO, (const TI*)s, state,                 \
                       out < 0 ? (TO*)nullptr : (TO*)p, stats, t, chunk, stat_rows);          \
  };
  if (in == 0 && out <= 0) {
    KD_EMU_SMX_SUMS(f32, float, f32, float)
  } else if (in == 1 && out == 0) {
    KD_EMU_SMX_SUMS(f16, __half, f32, float)
  } else if (in == 1 && (out == 1 || out < 0)) {
    KD_EMU_SMX_SUMS(f16, __half, f16, __half)
  } else if (in == 2 && out == 0) {
    KD_EMU_SMX_SUMS(bf16, __nv_bfloat16, f32, float)
  } else if (in == 2 && (out == 2 || out < 0)) {
    KD_EMU_SMX_SUMS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
  } else {
    return finish("no softmax sums from dtype " + std::to_string(in) + " to " +
                      std::to_string(out),
                  err, err_len);
  }
#undef KD_EMU_SMX_SUMS
  return finish(guarded(d3(grid_x, grid_y), d3(block), KD_SMX_THREADS, seed, run), err,
                err_len);
}

// dtype: 0 f32, 1 f16, 2 bf16.
extern "C" int kd_emu_add_rms_norm(int dtype, const void* x, const void* r, const void* w,
                                   void* out, int rows, int cols, float eps, unsigned grid_x,
                                   unsigned block, uint64_t seed, char* err, size_t err_len) {
  std::function<void()> run;
#define KD_EMU_NORM(SUFFIX, T)                                                            \
  run = [=] {                                                                             \
    kd_emu::run_kernel(keydiff_add_rms_norm_##SUFFIX, (const T*)x, (const T*)r, (const T*)w, \
                       (T*)out, rows, cols, eps);                                         \
  };
  switch (dtype) {
    case 0:
      KD_EMU_NORM(f32, float)
      break;
    case 1:
      KD_EMU_NORM(f16, __half)
      break;
    case 2:
      KD_EMU_NORM(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no add-rms-norm kernel for dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_NORM
  return finish(guarded(d3(grid_x), d3(block), KD_NORM_THREADS, seed, run), err, err_len);
}

// dtype: 0 f32, 1 f16, 2 bf16.
extern "C" int kd_emu_silu_mul(int dtype, const void* gate, int64_t gate_rs, const void* up,
                               int64_t up_rs, void* out, int64_t rows, int cols,
                               unsigned grid_x, unsigned block, uint64_t seed, char* err,
                               size_t err_len) {
  std::function<void()> run;
#define KD_EMU_ACT(SUFFIX, T)                                                                    \
  run = [=] {                                                                                    \
    kd_emu::run_kernel(keydiff_silu_mul_##SUFFIX, (const T*)gate, gate_rs, (const T*)up, up_rs, \
                       (T*)out, rows, cols);                                                     \
  };
  switch (dtype) {
    case 0:
      KD_EMU_ACT(f32, float)
      break;
    case 1:
      KD_EMU_ACT(f16, __half)
      break;
    case 2:
      KD_EMU_ACT(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no silu-mul kernel for dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_ACT
  return finish(guarded(d3(grid_x), d3(block), KD_ACT_THREADS, seed, run), err, err_len);
}

// dtype: 0 f32, 1 f16, 2 bf16.
extern "C" int kd_emu_argmax_rows(int dtype, const void* x, int64_t x_rs, unsigned* out,
                                  int cols, unsigned grid_x, unsigned block, uint64_t seed,
                                  char* err, size_t err_len) {
  std::function<void()> run;
#define KD_EMU_ARGMAX(SUFFIX, T)                                                   \
  run = [=] { kd_emu::run_kernel(keydiff_argmax_rows_##SUFFIX, (const T*)x, x_rs, out, cols); };
  switch (dtype) {
    case 0:
      KD_EMU_ARGMAX(f32, float)
      break;
    case 1:
      KD_EMU_ARGMAX(f16, __half)
      break;
    case 2:
      KD_EMU_ARGMAX(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no argmax kernel for dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_ARGMAX
  return finish(guarded(d3(grid_x), d3(block), KD_ARGMAX_THREADS, seed, run), err, err_len);
}

// dtype: 0 f32, 1 f16, 2 bf16. params: [rows, 5] words (see the kernel).
extern "C" int kd_emu_sample_rows(int dtype, const void* x, int64_t x_rs, const unsigned* params,
                                  unsigned* out, int cols, unsigned grid_x, unsigned block,
                                  uint64_t seed, char* err, size_t err_len) {
  std::function<void()> run;
#define KD_EMU_SAMPLE(SUFFIX, T)                                                             \
  run = [=] {                                                                                \
    kd_emu::run_kernel(keydiff_sample_rows_##SUFFIX, (const T*)x, x_rs, params, out, cols); \
  };
  switch (dtype) {
    case 0:
      KD_EMU_SAMPLE(f32, float)
      break;
    case 1:
      KD_EMU_SAMPLE(f16, __half)
      break;
    case 2:
      KD_EMU_SAMPLE(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no sample kernel for dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_SAMPLE
  return finish(guarded(d3(grid_x), d3(block), KD_SAMPLE_THREADS, seed, run), err, err_len);
}

extern "C" int kd_emu_rope_qk(int dtype, const void* q, int64_t q_rs, int64_t q_hs,
                              const void* k, int64_t k_rs, int64_t k_hs, const void* cos,
                              const void* sin, void* out, int hq, int hk, int b, int d,
                              int interleaved, unsigned grid_x, unsigned block, uint64_t seed,
                              char* err, size_t err_len) {
  std::function<void()> run;
#define KD_EMU_ROPE(SUFFIX, T)                                                                  \
  run = [=] {                                                                                   \
    kd_emu::run_kernel(keydiff_rope_qk_##SUFFIX, (const T*)q, q_rs, q_hs, (const T*)k, k_rs,   \
                       k_hs, (const T*)cos, (const T*)sin, (T*)out, hq, hk, b, d,              \
                       interleaved);                                                           \
  };
  switch (dtype) {
    case 0:
      KD_EMU_ROPE(f32, float)
      break;
    case 1:
      KD_EMU_ROPE(f16, __half)
      break;
    case 2:
      KD_EMU_ROPE(bf16, __nv_bfloat16)
      break;
    default:
      return finish("no rope kernel for dtype " + std::to_string(dtype), err, err_len);
  }
#undef KD_EMU_ROPE
  return finish(guarded(d3(grid_x), d3(block), KD_ROPE_THREADS, seed, run), err, err_len);
}

// `bitmap` must be zeroed.
extern "C" int kd_emu_snapkv_pool(const float* stats, int64_t stats_stride,
                                  const uint32_t* positions, int64_t pos_stride, int n,
                                  uint32_t* bitmap, int words, uint32_t* word_rank,
                                  uint32_t* sorted, float* scores, unsigned grid_x,
                                  unsigned block, uint64_t seed, char* err, size_t err_len) {
  const std::string e = guarded(d3(grid_x), d3(block), KD_POOL_THREADS, seed, [=] {
    kd_emu::run_kernel(snapkv_pool, stats, stats_stride, positions, pos_stride, n, bitmap, words,
                       word_rank, sorted, scores);
  });
  return finish(e, err, err_len);
}

// ---------------------------------------------------------------------------------------------
// Self-tests of the emulation: kernels with known defects must fail, a correct one must pass,
// and a racy one must give schedule-dependent results. `out` holds 256 ints.
// ---------------------------------------------------------------------------------------------

namespace {

// A correct block reduction with shuffles and a barrier: out[0] = 0 + 1 + ... + 255.
void st_reduce(int* out) {
  __shared__ float part[8];
  float v = (float)threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < 8; ++w) s += part[w];
    out[0] = (int)s;
  }
}

// Half of each warp skips a shuffle: the lanes meet at different calls.
void st_diverged_shuffle(int* out) {
  float v = 1.f;
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  v = __shfl_xor_sync(0xffffffffu, v, 2);
  out[threadIdx.x] = (int)v;
}

// One lane leaves before a ballot that names it.
void st_exited_lane(int* out) {
  if (threadIdx.x % 32 == 5) return;
  out[threadIdx.x] = (int)__ballot_sync(0xffffffffu, 1);
}

// Half of a warp waits at the barrier, the other half in a ballot: a deadlock.
void st_split_barrier(int* out) {
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = (int)__ballot_sync(0xffffffffu, 1);
  }
}

// A partial mask, which the emulation does not model.
void st_partial_mask(int* out) { out[threadIdx.x] = (int)__ballot_sync(0x0000ffffu, 1); }

// A missing barrier: thread 1 writes what the others read in the same phase, so who reads 7
// depends on the schedule; the race checker reports it whatever the schedule.
void st_race(int* out) {
  __shared__ int x;
  if (threadIdx.x == 0) x = 0;
  __syncthreads();
  if (threadIdx.x == 1) x = 7;
  out[threadIdx.x] = x;
}

// Shared memory read before any thread of the block wrote it (y[1]).
void st_uninit(int* out) {
  __shared__ int y[2];
  if (threadIdx.x == 0) y[0] = 1;
  __syncthreads();
  out[threadIdx.x] = y[threadIdx.x % 2];
}

// Two blocks write the same global word: a race whatever the barriers.
void st_block_race(int* out) {
  if (threadIdx.x == 0) out[0] = (int)blockIdx.x;
}

// Correct: atomics from every thread of every block, plain accesses ordered by barriers.
// out[0] = -1 + 2 * 256.
void st_atomics(int* out) {
  __shared__ unsigned c;
  if (threadIdx.x == 0) c = 0;
  __syncthreads();
  atomicAdd(&c, 1u);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned*>(out), c);
}

// A plain read of a counter that other threads update atomically in the same phase.
void st_atomic_read(int* out) {
  __shared__ unsigned c;
  if (threadIdx.x == 0) c = 0;
  __syncthreads();
  atomicAdd(&c, 1u);
  out[threadIdx.x] = (int)c;
}

// With `out` viewed as 2 heads of 128 (one block per head): block h writes its head and reads
// a word of the other's (the comparison keeps the load; it never holds).
void st_other_head(int* out) {
  const unsigned h = blockIdx.x;
  if (threadIdx.x < 128) out[h * 128 + threadIdx.x] = (int)h;
  if (threadIdx.x == 200 && out[(1 - h) * 128 + 5] == 12345) out[h * 128 + 127] = 0;
}

// With `out` viewed as 4 rows of 32 at a row stride of 64: threads 32..63 write row padding.
void st_padding(int* out) {
  if (threadIdx.x < 64) out[threadIdx.x] = 1;
}

// A counter zeroed by thread 0 and updated by every thread with no barrier between: a race
// (or, when another thread runs first, an update of uninitialised shared memory).
void st_zero_then_add(int* out) {
  __shared__ unsigned c;
  if (threadIdx.x == 0) c = 0;
  atomicAdd(&c, 1u);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = (int)c;
}

// Reads one int past the 256 of `out`.
void st_past_end(int* out) {
  if (threadIdx.x == 0) out[0] = out[256];
}

// A thread whose frame outgrows its fiber stack (80 KiB of locals, every 512th byte written):
// it must meet the guard page below its stack and fault, not write over its neighbour's.
void st_stack_overflow(int* out) {
  volatile char big[80 * 1024];
  for (size_t i = 0; i < sizeof big; i += 512) big[i] = (char)i;
  out[threadIdx.x] = big[threadIdx.x];
}

}  // namespace

// 1 when `addr` lies in the fiber stacks of a launch this OS thread is running: a fault there
// is a thread that outgrew its stack into the guard page below it (the rest is writable).
// Async-signal-safe (two thread-local words).
// Untracked: it runs in a signal handler, where the memory checker (which allocates) must not.
extern "C" KD_EMU_UNTRACKED int kd_emu_in_fiber_stacks(uintptr_t addr) {
  return addr >= kd_emu::g_stacks_lo && addr < kd_emu::g_stacks_hi;
}

// which: 0 reduce, 1 diverged shuffle, 2 exited lane, 3 split barrier, 4 partial mask, 5 race,
// 6 reduce with a 2048-thread block, 7 reduce with a 48-thread block, 8 grid.y of 70000,
// 9 reduce with 512 threads against __launch_bounds__(256), 10 uninitialised shared memory,
// 11 a race between blocks, 12 correct atomics over 2 blocks, 13 a read racing atomics,
// 14 another head's rows, 15 row padding, 16 a read past the end of `out`, 17 a counter
// zeroed and updated with no barrier between, 18 a thread that overflows its stack (the process
// faults: SIGSEGV).
extern "C" int kd_emu_selftest(int which, uint64_t seed, int* out, char* err, size_t err_len) {
  struct SelfTest {
    void (*kernel)(int*);
    dim3 grid, block;
    unsigned bounds;
  };
  const dim3 one = d3(1), b256 = d3(256);
  const SelfTest tests[] = {
      {st_reduce, one, b256, 0},             // 0
      {st_diverged_shuffle, one, b256, 0},   // 1
      {st_exited_lane, one, b256, 0},        // 2
      {st_split_barrier, one, b256, 0},      // 3
      {st_partial_mask, one, b256, 0},       // 4
      {st_race, one, b256, 0},               // 5
      {st_reduce, one, d3(2048), 0},         // 6
      {st_reduce, one, d3(48), 0},           // 7
      {st_reduce, d3(1, 70000), b256, 0},    // 8
      {st_reduce, one, d3(512), 256},        // 9
      {st_uninit, one, b256, 0},             // 10
      {st_block_race, d3(2), b256, 0},       // 11
      {st_atomics, d3(2), b256, 0},          // 12
      {st_atomic_read, one, b256, 0},        // 13
      {st_other_head, d3(2), b256, 0},       // 14
      {st_padding, one, b256, 0},            // 15
      {st_past_end, one, b256, 0},           // 16
      {st_zero_then_add, one, b256, 0},      // 17
      {st_stack_overflow, one, d3(32), 0},   // 18
  };
  if (which < 0 || which >= (int)(sizeof tests / sizeof tests[0]))
    return finish("unknown self-test " + std::to_string(which), err, err_len);
  const SelfTest& t = tests[which];
  const auto kernel = t.kernel;
  const std::function<void()> body = [=] { kd_emu::run_kernel(kernel, out); };
  return finish(guarded(t.grid, t.block, t.bounds, seed, body), err, err_len);
}
