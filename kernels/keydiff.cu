// KeyDiff scoring on the GPU: s_i = -cos(k_i, mu) per KV head, mu = mean of the normalised keys
// (or of the raw keys). The CPU twin is `KeyDiffOp` in crates/keydiff-cache/src/policy/keydiff.rs.
//
// Layout: keys [kv_heads, n, d] with any head and row stride (a view of the [kv, N+B, d] cache
// buffer), elements of a row contiguous. d <= 256.
//
// Two passes, each over a (head, block of rows) grid so that the whole GPU streams the keys:
//   1. norms[h, i] = |k_i| + eps, and anchor_sum[h, :] += w_i * k_i (w_i = 1/norms[h, i] or 1),
//      summed per block in shared memory, then one atomicAdd per element and block;
//   2. scores[h, i] = -(k_i . mu) / (norms[h, i] * |mu|), mu = anchor_sum[h] / n.
// anchor_sum must be zeroed before pass 1. One warp handles one row at a time.
//
// Status: compiled for sm_80 and sm_90 in CI (scripts/check-cuda.sh); not yet wired into the
// engine (issue 4), which scores with candle ops on GPUs meanwhile.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define KD_NORM_EPS 1e-12f
#define KD_ROWS_PER_BLOCK 64
#define KD_THREADS 256
#define KD_MAX_D 256

__device__ __forceinline__ float kd_to_f(float x) { return x; }
__device__ __forceinline__ float kd_to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kd_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float kd_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ void kd_pass1(const T* keys, int64_t head_stride, int64_t row_stride, int n, int d,
                         int normalized, float* norms, float* anchor_sum) {
  __shared__ float acc[KD_MAX_D];
  const int h = blockIdx.x;
  const int row0 = blockIdx.y * KD_ROWS_PER_BLOCK;
  for (int j = threadIdx.x; j < d; j += blockDim.x) acc[j] = 0.f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int r = row0 + warp; r < min(row0 + KD_ROWS_PER_BLOCK, n); r += warps) {
    const T* k = keys + h * head_stride + r * row_stride;
    float ss = 0.f;
    for (int j = lane; j < d; j += 32) {
      float x = kd_to_f(k[j]);
      ss += x * x;
    }
    const float norm = sqrtf(kd_warp_sum(ss)) + KD_NORM_EPS;
    if (lane == 0) norms[(int64_t)h * n + r] = norm;
    const float w = normalized ? 1.f / norm : 1.f;
    for (int j = lane; j < d; j += 32) atomicAdd(&acc[j], kd_to_f(k[j]) * w);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += blockDim.x) atomicAdd(&anchor_sum[h * d + j], acc[j]);
}

template <typename T>
__device__ void kd_pass2(const T* keys, int64_t head_stride, int64_t row_stride, int n, int d,
                         const float* norms, const float* anchor_sum, float* scores) {
  __shared__ float mu[KD_MAX_D];
  __shared__ float partial[KD_THREADS / 32];
  const int h = blockIdx.x;
  const int row0 = blockIdx.y * KD_ROWS_PER_BLOCK;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  float ss = 0.f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const float m = anchor_sum[h * d + j] / (float)n;
    mu[j] = m;
    ss += m * m;
  }
  ss = kd_warp_sum(ss);
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += partial[w];
  const float mu_norm = sqrtf(total) + KD_NORM_EPS;
  for (int r = row0 + warp; r < min(row0 + KD_ROWS_PER_BLOCK, n); r += warps) {
    const T* k = keys + h * head_stride + r * row_stride;
    float dot = 0.f;
    for (int j = lane; j < d; j += 32) dot += kd_to_f(k[j]) * mu[j];
    dot = kd_warp_sum(dot);
    if (lane == 0) scores[(int64_t)h * n + r] = -dot / (norms[(int64_t)h * n + r] * mu_norm);
  }
}

#define KD_INSTANTIATE(SUFFIX, T)                                                               \
  extern "C" __global__ void __launch_bounds__(KD_THREADS) keydiff_pass1_##SUFFIX(              \
      const T* keys, int64_t head_stride, int64_t row_stride, int n, int d, int normalized,     \
      float* norms, float* anchor_sum) {                                                        \
    kd_pass1<T>(keys, head_stride, row_stride, n, d, normalized, norms, anchor_sum);            \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(KD_THREADS) keydiff_pass2_##SUFFIX(              \
      const T* keys, int64_t head_stride, int64_t row_stride, int n, int d, const float* norms, \
      const float* anchor_sum, float* scores) {                                                 \
    kd_pass2<T>(keys, head_stride, row_stride, n, d, norms, anchor_sum, scores);                \
  }

KD_INSTANTIATE(f32, float)
KD_INSTANTIATE(f16, __half)
KD_INSTANTIATE(bf16, __nv_bfloat16)
