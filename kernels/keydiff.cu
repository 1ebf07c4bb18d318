// KeyDiff scoring on the GPU: s_i = -cos(k_i, mu) per KV head, mu = mean of the normalised keys
// (or of the raw keys). The CPU twin is `KeyDiffOp` in crates/keydiff-cache/src/policy/keydiff.rs.
//
// Layout: keys [kv_heads, n, d] with any head and row stride (a view of the [kv, N+B, d] cache
// buffer), elements of a row contiguous. d <= 256.
//
// Two passes, each over a (block of rows, head) grid so that the whole GPU streams the keys:
//   1. norms[h, i] = |k_i| + eps, and anchor_sum[h, :] += w_i * k_i (w_i = 1/norms[h, i] or 1),
//      summed per block in shared memory, then one atomicAdd per element and block;
//   2. scores[h, i] = -(k_i . mu) / (norms[h, i] * |mu|), mu = anchor_sum[h] / n.
// anchor_sum must be zeroed before pass 1. Two versions of the pair: keydiff_pass1/2_<dtype>
// (a warp per row, a lane reads one value in 32; any d <= 256 and stride) and
// keydiff_pass1v/2v_<dtype>_<d> (16-byte loads, d = 64/128/256, rows on 16-byte boundaries).
//
// Then, for every policy, `keydiff_select_plan` (one block per head) or `keydiff_select_pass`,
// `_count` and `_emit` (many blocks per head, for n > 4096) pick the survivors of each head and
// emit the move plan, and `keydiff_move_rows` applies it to K, V, positions and policy state.
// Their CPU twins are `select_radix` / `move_plan` in crates/keydiff-cache/src/select.rs (the
// reference is `select`, a sort) and `LayerCache::apply_moves`.
//
// Status: compiled for sm_80 and sm_90 in CI (scripts/check-cuda.sh) and wired in through
// crates/keydiff-kernels; checked on hardware only by scripts/gpu-check.sh.

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

// Rows a warp works on at once in both passes: their loads are all issued before the first
// reduction waits on them, so a warp has KD_ROW_BATCH rows in flight instead of one (the first
// H200 run: 1.3 TB/s for the two passes at n = 131200). Each row's arithmetic, and the order in
// which a lane adds rows into its share of the anchor, are the same as one row at a time.
#define KD_ROW_BATCH 4

// Lane `lane`'s elements (lane, lane + 32, ...) of rows rb, rb + step, ... (KD_ROW_BATCH of
// them) of head h: 0 past `row_end` and past d. Nothing is read there.
template <typename T>
__device__ __forceinline__ void kd_load_rows(const T* keys, int64_t head_stride,
                                             int64_t row_stride, int h, int rb, int step,
                                             int row_end, int d, int lane,
                                             float (&x)[KD_ROW_BATCH][KD_MAX_D / 32]) {
  for (int b = 0; b < KD_ROW_BATCH; ++b) {
    const int r = rb + b * step;
    const T* k = keys + h * head_stride + (int64_t)r * row_stride;
    for (int c = 0; c < KD_MAX_D / 32; ++c) {
      const int j = lane + 32 * c;
      x[b][c] = r < row_end && j < d ? kd_to_f(k[j]) : 0.f;
    }
  }
}

// The block's share of the anchor: `acc` (shared, d values) zeroed before the block's rows add
// to it, and added to the head's sum once they all have. (Arrays by reference, not pointers, so
// that -fsanitize=bounds in the emulation still knows their size.)
__device__ __forceinline__ void kd_anchor_zero(float (&acc)[KD_MAX_D], int d) {
  for (int j = threadIdx.x; j < d; j += blockDim.x) acc[j] = 0.f;
  __syncthreads();
}

__device__ __forceinline__ void kd_anchor_flush(const float (&acc)[KD_MAX_D], float* anchor_sum,
                                                int h, int d) {
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += blockDim.x) atomicAdd(&anchor_sum[h * d + j], acc[j]);
}

template <typename T>
__device__ void kd_pass1(const T* keys, int64_t head_stride, int64_t row_stride, int n, int d,
                         int normalized, float* norms, float* anchor_sum) {
  __shared__ float acc[KD_MAX_D];
  const int h = blockIdx.y;
  const int row0 = blockIdx.x * KD_ROWS_PER_BLOCK;
  kd_anchor_zero(acc, d);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int row_end = min(row0 + KD_ROWS_PER_BLOCK, n);
  // Lane l owns elements l, l + 32, ... of every row: it reads each once and sums its share of
  // the anchor in registers, then adds it to the block's sum once (not once per row).
  float part[KD_MAX_D / 32];
  for (int c = 0; c < KD_MAX_D / 32; ++c) part[c] = 0.f;
  for (int rb = row0 + warp; rb < row_end; rb += KD_ROW_BATCH * warps) {
    float x[KD_ROW_BATCH][KD_MAX_D / 32];
    kd_load_rows(keys, head_stride, row_stride, h, rb, warps, row_end, d, lane, x);
    for (int b = 0; b < KD_ROW_BATCH; ++b) {
      const int r = rb + b * warps;
      float ss = 0.f;
      for (int c = 0; c < KD_MAX_D / 32; ++c) ss += x[b][c] * x[b][c];
      // Uniform across the warp: every lane reaches the shuffles.
      if (r >= row_end) break;
      const float norm = sqrtf(kd_warp_sum(ss)) + KD_NORM_EPS;
      if (lane == 0) norms[(int64_t)h * n + r] = norm;
      const float w = normalized ? 1.f / norm : 1.f;
      for (int c = 0; c < KD_MAX_D / 32; ++c) part[c] += x[b][c] * w;
    }
  }
  for (int c = 0; c < KD_MAX_D / 32; ++c)
    if (lane + 32 * c < d) atomicAdd(&acc[lane + 32 * c], part[c]);
  kd_anchor_flush(acc, anchor_sum, h, d);
}

// mu = anchor_sum[h] / n into `mu` (shared, d values), for the whole block; returns |mu| + eps.
__device__ float kd_anchor_mean(const float* anchor_sum, int h, int n, int d,
                                float (&mu)[KD_MAX_D]) {
  __shared__ float partial[KD_THREADS / 32];
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
  return sqrtf(total) + KD_NORM_EPS;
}

template <typename T>
__device__ void kd_pass2(const T* keys, int64_t head_stride, int64_t row_stride, int n, int d,
                         const float* norms, const float* anchor_sum, float* scores) {
  __shared__ float mu[KD_MAX_D];
  const int h = blockIdx.y;
  const int row0 = blockIdx.x * KD_ROWS_PER_BLOCK;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int row_end = min(row0 + KD_ROWS_PER_BLOCK, n);
  const float mu_norm = kd_anchor_mean(anchor_sum, h, n, d, mu);
  for (int rb = row0 + warp; rb < row_end; rb += KD_ROW_BATCH * warps) {
    float x[KD_ROW_BATCH][KD_MAX_D / 32];
    kd_load_rows(keys, head_stride, row_stride, h, rb, warps, row_end, d, lane, x);
    for (int b = 0; b < KD_ROW_BATCH; ++b) {
      const int r = rb + b * warps;
      float dot = 0.f;
      for (int c = 0; c < KD_MAX_D / 32; ++c)
        if (lane + 32 * c < d) dot += x[b][c] * mu[lane + 32 * c];
      if (r >= row_end) break;
      dot = kd_warp_sum(dot);
      if (lane == 0) scores[(int64_t)h * n + r] = -dot / (norms[(int64_t)h * n + r] * mu_norm);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The same two passes with 16-byte loads, for d = 64, 128 and 256 (D, a template argument) when
// the view allows them: its start, head stride and row stride are multiples of 16 bytes (the
// launch wrappers check, and take the kernels above otherwise).
//
// A row of D values of T is D·sizeof(T)/16 vectors. KdVec::kLanes = min(32, that) lanes share a
// row, so one warp-wide load covers kRows = 32/kLanes whole rows (2 rows of 128 bf16 values),
// and a warp issues KD_VEC_BATCH such loads before it reduces the first. Per lane that is a
// uint4 per vector instead of one 2- or 4-byte load per 32 values, and with D known the loop
// bounds and registers fit the head size. The sums run in another order than above (a lane adds
// its kElems values first), so scores agree with the scalar kernels to rounding, not bit for bit.
// ---------------------------------------------------------------------------------------------

#define KD_VEC_BATCH 4

template <typename T, int D>
struct KdVec {
  static constexpr int kElems = 16 / (int)sizeof(T);    // values of a vector
  static constexpr int kVecs = D / kElems;               // vectors of a row
  static constexpr int kLanes = kVecs < 32 ? kVecs : 32;  // lanes of a row
  static constexpr int kRows = 32 / kLanes;              // rows of a warp-wide load
  static constexpr int kPerLane = kVecs / kLanes;        // vectors of a lane in a row
  static constexpr int kVals = kPerLane * kElems;        // values of a lane in a row
};

// A vector's values (little-endian: value 0 in the low bits of x).
__device__ __forceinline__ void kd_unpack(const uint4& u, float* out, const float*) {
  out[0] = __uint_as_float(u.x);
  out[1] = __uint_as_float(u.y);
  out[2] = __uint_as_float(u.z);
  out[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void kd_unpack(const uint4& u, float* out, const __nv_bfloat16*) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void kd_unpack(const uint4& u, float* out, const __half*) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
    out[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
  }
}

// The raw vectors of lane `lane` in rows rb + b·step + lane / kLanes (b < KD_VEC_BATCH): vectors
// lane % kLanes + kLanes·v of each row. Zero bits (0.0 in every dtype) for rows at or past
// `row_end`; nothing is read there.
template <typename T, int D>
__device__ __forceinline__ void kd_load_vecs(const T* keys, int64_t head_stride,
                                             int64_t row_stride, int h, int rb, int step,
                                             int row_end, int lane,
                                             uint4 (&raw)[KD_VEC_BATCH][KdVec<T, D>::kPerLane]) {
  using G = KdVec<T, D>;
  const int sub = lane / G::kLanes, place = lane % G::kLanes;
  for (int b = 0; b < KD_VEC_BATCH; ++b) {
    const int r = rb + b * step + sub;
    const uint4* row =
        reinterpret_cast<const uint4*>(keys + h * head_stride + (int64_t)r * row_stride);
    for (int v = 0; v < G::kPerLane; ++v) {
      if (r < row_end) {
        raw[b][v] = row[place + G::kLanes * v];
      } else {
        raw[b][v].x = raw[b][v].y = raw[b][v].z = raw[b][v].w = 0u;
      }
    }
  }
}

// Sum over the kLanes lanes of one row (aligned groups of a power of two).
template <int L>
__device__ __forceinline__ float kd_row_sum(float v) {
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Runs f(r, x) for the rows of [row0, row_end) of head h, x the lane's kVals values of row r
// (lane / kLanes picks the row within a warp-wide load). Every lane of a warp calls f the same
// number of times, so f may use warp shuffles; r may be past row_end (then x is 0 and f must not
// write for it).
template <typename T, int D, typename F>
__device__ __forceinline__ void kd_rows_vec(const T* keys, int64_t head_stride,
                                            int64_t row_stride, int h, int row0, int row_end,
                                            F&& f) {
  using G = KdVec<T, D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int sub = lane / G::kLanes;
  const int step = warps * G::kRows;
  for (int rb = row0 + warp * G::kRows; rb < row_end; rb += KD_VEC_BATCH * step) {
    uint4 raw[KD_VEC_BATCH][G::kPerLane];
    kd_load_vecs<T, D>(keys, head_stride, row_stride, h, rb, step, row_end, lane, raw);
    for (int b = 0; b < KD_VEC_BATCH; ++b) {
      // Uniform across the warp (its first row of load b): every lane reaches the shuffles.
      if (rb + b * step >= row_end) break;
      float x[G::kVals];
      for (int v = 0; v < G::kPerLane; ++v) kd_unpack(raw[b][v], &x[v * G::kElems], keys);
      f(rb + b * step + sub, x);
    }
  }
}

template <typename T, int D>
__device__ void kd_pass1_vec(const T* keys, int64_t head_stride, int64_t row_stride, int n,
                             int normalized, float* norms, float* anchor_sum) {
  using G = KdVec<T, D>;
  __shared__ float acc[KD_MAX_D];
  const int h = blockIdx.y;
  const int row0 = blockIdx.x * KD_ROWS_PER_BLOCK;
  kd_anchor_zero(acc, D);
  const int lane = threadIdx.x % 32;
  const int sub = lane / G::kLanes, place = lane % G::kLanes;
  const int row_end = min(row0 + KD_ROWS_PER_BLOCK, n);
  float part[G::kVals];
  for (int j = 0; j < G::kVals; ++j) part[j] = 0.f;
  kd_rows_vec<T, D>(keys, head_stride, row_stride, h, row0, row_end,
                    [&](int r, const float (&x)[G::kVals]) {
                      float ss = 0.f;
                      for (int j = 0; j < G::kVals; ++j) ss += x[j] * x[j];
                      const float norm = sqrtf(kd_row_sum<G::kLanes>(ss)) + KD_NORM_EPS;
                      if (r < row_end) {
                        if (place == 0) norms[(int64_t)h * n + r] = norm;
                        const float w = normalized ? 1.f / norm : 1.f;
                        for (int j = 0; j < G::kVals; ++j) part[j] += x[j] * w;
                      }
                    });
  // Lanes at the same place of the warp's rows hold sums of the same values: add them across
  // the rows, then the lanes of the first row add them to the block's share.
  for (int o = G::kLanes; o < 32; o <<= 1)
    for (int j = 0; j < G::kVals; ++j) part[j] += __shfl_xor_sync(0xffffffffu, part[j], o);
  if (sub == 0)
    for (int v = 0; v < G::kPerLane; ++v)
      for (int e = 0; e < G::kElems; ++e)
        atomicAdd(&acc[(place + G::kLanes * v) * G::kElems + e], part[v * G::kElems + e]);
  kd_anchor_flush(acc, anchor_sum, h, D);
}

template <typename T, int D>
__device__ void kd_pass2_vec(const T* keys, int64_t head_stride, int64_t row_stride, int n,
                             const float* norms, const float* anchor_sum, float* scores) {
  using G = KdVec<T, D>;
  __shared__ float mu[KD_MAX_D];
  const int h = blockIdx.y;
  const int row0 = blockIdx.x * KD_ROWS_PER_BLOCK;
  const int place = threadIdx.x % 32 % G::kLanes;
  const int row_end = min(row0 + KD_ROWS_PER_BLOCK, n);
  const float mu_norm = kd_anchor_mean(anchor_sum, h, n, D, mu);
  // The lane's values of mu, in the order of its values of a row.
  float m[G::kVals];
  for (int v = 0; v < G::kPerLane; ++v)
    for (int e = 0; e < G::kElems; ++e)
      m[v * G::kElems + e] = mu[(place + G::kLanes * v) * G::kElems + e];
  kd_rows_vec<T, D>(keys, head_stride, row_stride, h, row0, row_end,
                    [&](int r, const float (&x)[G::kVals]) {
                      float dot = 0.f;
                      for (int j = 0; j < G::kVals; ++j) dot += x[j] * m[j];
                      dot = kd_row_sum<G::kLanes>(dot);
                      if (r < row_end && place == 0)
                        scores[(int64_t)h * n + r] =
                            -dot / (norms[(int64_t)h * n + r] * mu_norm);
                    });
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

// keydiff_pass1v_<dtype>_<D> / keydiff_pass2v_<dtype>_<D>: the argument lists of the kernels
// above; `d` must be D (the wrappers pick the kernel by it).
#define KD_INSTANTIATE_VEC(SUFFIX, T, D)                                                        \
  extern "C" __global__ void __launch_bounds__(KD_THREADS) keydiff_pass1v_##SUFFIX##_##D(       \
      const T* keys, int64_t head_stride, int64_t row_stride, int n, int d, int normalized,     \
      float* norms, float* anchor_sum) {                                                        \
    (void)d;                                                                                    \
    kd_pass1_vec<T, D>(keys, head_stride, row_stride, n, normalized, norms, anchor_sum);        \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(KD_THREADS) keydiff_pass2v_##SUFFIX##_##D(       \
      const T* keys, int64_t head_stride, int64_t row_stride, int n, int d, const float* norms, \
      const float* anchor_sum, float* scores) {                                                 \
    (void)d;                                                                                    \
    kd_pass2_vec<T, D>(keys, head_stride, row_stride, n, norms, anchor_sum, scores);            \
  }

#define KD_INSTANTIATE_VEC_DS(SUFFIX, T) \
  KD_INSTANTIATE_VEC(SUFFIX, T, 64)      \
  KD_INSTANTIATE_VEC(SUFFIX, T, 128)     \
  KD_INSTANTIATE_VEC(SUFFIX, T, 256)

KD_INSTANTIATE_VEC_DS(f32, float)
KD_INSTANTIATE_VEC_DS(f16, __half)
KD_INSTANTIATE_VEC_DS(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Selection and move plan: one block per KV head.
//
// Every slot i gets a 64-bit key, unique within the head because positions are:
//   bit 63      protected (one of the first `sinks` positions, or one of the `recent` newest)
//   bits 31-62  the score as an order-preserving uint (NaN ranks as -inf, -0 below +0)
//   bits 0-30   the position (ties go to the more recent slot)
// The N = budget largest keys survive. The threshold is the budget-th largest key, found by an
// MSB-first radix select (8 passes of 8 bits, a 256-bin histogram in shared memory); the `recent`
// newest positions are found the same way on 32-bit keys. No sort, so any n works (candle's
// argsort stops at 8192).
//
// Plan, as the CPU `move_plan`: holes are the non-survivors in [0, N), movers the survivors in
// [N, n), both ascending; move r copies slot src[r] = mover r into dst[r] = hole r. Sources and
// destinations are disjoint, so all moves run in parallel. Layout per head (row of `plan`):
//   [count, src[0..M), dst[0..M)], M = min(N, n - N).
// ---------------------------------------------------------------------------------------------

#define KD_SELECT_THREADS 1024
#define KD_PROTECTED (1ull << 63)

__device__ __forceinline__ uint32_t kd_ord(float s) {
  uint32_t b = __float_as_uint(s);
  if (isnan(s)) b = 0xff800000u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct KdPosKey {
  const uint32_t* pos;
  __device__ __forceinline__ uint64_t operator()(int i) const { return pos[i]; }
};

struct KdSlotKey {
  const float* scores;
  const uint32_t* pos;
  uint32_t sinks;
  uint32_t recent_min;
  int has_recent;
  __device__ __forceinline__ uint64_t operator()(int i) const {
    const uint32_t p = pos[i];
    const bool prot = p < sinks || (has_recent && p >= recent_min);
    return (prot ? KD_PROTECTED : 0ull) | ((uint64_t)kd_ord(scores[i]) << 31) |
           (uint64_t)(p & 0x7fffffffu);
  }
};

struct KdSelectShared {
  unsigned hist[256];
  unsigned long long prefix;
  int k;
  int done;
  unsigned warp_total[2][KD_SELECT_THREADS / 32];
  unsigned base[2];
};

// A threshold t such that exactly k (1 <= k <= n) of key(0..n) are >= t, over the low BITS bits;
// every thread returns it. It is the k-th largest key, except that the search stops early once
// the k-th largest closes its bin (then t is that bin's lowest possible key): the same slots
// pass `key >= t`, and with spread scores it takes 3-4 passes instead of 8.
template <int BITS, typename F>
__device__ uint64_t kd_radix_kth(const F& key, int n, int k, KdSelectShared& sh) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.k = k;
    sh.done = 0;
  }
  uint64_t mask = 0;
  for (int shift = BITS - 8; shift >= 0; shift -= 8) {
    for (int j = threadIdx.x; j < 256; j += blockDim.x) sh.hist[j] = 0;
    __syncthreads();
    const uint64_t prefix = sh.prefix;
    // Warp-aggregated counting: the lanes of a warp that share a bin add once, by their lowest
    // lane. Early passes put almost every key into two or three bins (the score's sign and
    // exponent), where one shared atomic per key would serialise the whole block. The bounds
    // of the loop are uniform, so every lane reaches __match_any_sync.
    for (int t0 = 0; t0 < n; t0 += blockDim.x) {
      const int i = t0 + (int)threadIdx.x;
      unsigned bin = 256u;  // no bin: past n, or outside the prefix
      if (i < n) {
        const uint64_t x = key(i);
        if ((x & mask) == prefix) bin = (unsigned)((x >> shift) & 255u);
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256u && (int)(threadIdx.x & 31u) == __ffs(peers) - 1)
        atomicAdd(&sh.hist[bin], (unsigned)__popc(peers));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned kk = (unsigned)sh.k;
      unsigned above = 0;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (above + sh.hist[digit] >= kk) break;
        above += sh.hist[digit];
      }
      sh.k = (int)(kk - above);
      sh.prefix = prefix | ((uint64_t)digit << shift);
      sh.done = sh.hist[digit] == kk - above;
    }
    mask |= 255ull << shift;
    __syncthreads();
    if (sh.done) break;
  }
  const uint64_t r = sh.prefix;
  __syncthreads();
  return r;
}

extern "C" __global__ void __launch_bounds__(KD_SELECT_THREADS)
    keydiff_select_plan(const float* scores, int64_t score_stride, const uint32_t* positions,
                        int64_t pos_stride, int n, int budget, uint32_t sinks, int recent,
                        uint32_t* plan, int64_t plan_stride) {
  __shared__ KdSelectShared sh;
  const int h = blockIdx.x;
  const float* s = scores + h * score_stride;
  const uint32_t* pos = positions + h * pos_stride;
  uint32_t* out = plan + h * plan_stride;
  const int max_moves = min(budget, n - budget);
  uint32_t* src = out + 1;
  uint32_t* dst = out + 1 + max_moves;

  uint32_t recent_min = 0;
  if (recent > 0) recent_min = (uint32_t)kd_radix_kth<32>(KdPosKey{pos}, n, recent, sh);
  const KdSlotKey key{s, pos, sinks, recent_min, recent > 0};
  const uint64_t threshold = kd_radix_kth<64>(key, n, budget, sh);

  if (threadIdx.x == 0) sh.base[0] = sh.base[1] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  for (int t0 = 0; t0 < n; t0 += blockDim.x) {
    const int i = t0 + threadIdx.x;
    const bool keep = i < n && key(i) >= threshold;
    const bool hole = i < budget && !keep;
    const bool mover = i >= budget && keep;
    const unsigned bh = __ballot_sync(0xffffffffu, hole);
    const unsigned bm = __ballot_sync(0xffffffffu, mover);
    if (lane == 0) {
      sh.warp_total[0][warp] = __popc(bh);
      sh.warp_total[1][warp] = __popc(bm);
    }
    __syncthreads();
    unsigned oh = sh.base[0], om = sh.base[1];
    for (int w = 0; w < warp; ++w) {
      oh += sh.warp_total[0][w];
      om += sh.warp_total[1][w];
    }
    oh += __popc(bh & below);
    om += __popc(bm & below);
    if (hole && oh < (unsigned)max_moves) dst[oh] = (uint32_t)i;
    if (mover && om < (unsigned)max_moves) src[om] = (uint32_t)i;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < warps; ++w) {
        sh.base[0] += sh.warp_total[0][w];
        sh.base[1] += sh.warp_total[1][w];
      }
    }
    __syncthreads();
  }
  // Holes and movers are equal in number when exactly N keys reach the threshold, which unique
  // positions guarantee; the minimum keeps a broken invariant from moving garbage.
  if (threadIdx.x == 0) out[0] = min(min(sh.base[0], sh.base[1]), (unsigned)max_moves);
}

// ---------------------------------------------------------------------------------------------
// The same selection and plan over many blocks per head, for large n: one block per head puts
// 4–8 of the GPU's SMs to work (the first H200 run: 563 µs to select at n = 131200). Here a
// head's slots are cut into slices of KD_SEL_ITEMS, one block each, grid (slices, heads), and
// the radix select runs as a sequence of launches, one per digit of 11 bits:
//   keydiff_select_pass, pass 0..2 (only when `recent` > 0): the `recent` newest positions,
//     32-bit keys (digits at bits 21, 10, 0);
//   keydiff_select_pass, pass 3..8: the threshold on the 64-bit slot keys (bits 53, 42, 31, 20,
//     9, 0);
//   keydiff_select_count: holes and movers per slice, and their offsets (an exclusive scan);
//   keydiff_select_emit: the plan, each slice writing its holes and movers at its offsets.
// Every block of a pass adds its slice's histogram to the head's histogram for that pass; the
// last block to finish (a ticket counter) picks the digit and writes the control entry the
// next pass reads. A stage that ends early (its digit's bin holds exactly the survivors still
// needed: then every key of the bin survives, as in kd_radix_kth) marks its entry done, and
// the passes after it only carry the entry on. The selected set, and so the plan, is the
// single-block kernel's: exactly `budget` keys reach the threshold either way.
//
// Workspace per head (u32 words, zeroed before the first pass, `ws_stride` apart):
//   [0, 80)     control entries ctl[0..=9], 8 words each: prefix (low, high), k still to
//               find, done, recent_min (the recent stage's result, carried on). Pass p reads
//               ctl[p] and its last block writes ctl[p + 1];
//   [80, 90)    ticket counters of passes 0..8 and of the count kernel;
//   [96, ...)   histograms of passes 0..8, KD_SEL_BINS each;
//   then        per slice (holes, movers), then per slice their offsets (holes, movers).
// Values one block writes and another block of the same launch reads go through atomics (the
// counts, the histograms), after a __threadfence.
// ---------------------------------------------------------------------------------------------

#define KD_SEL_THREADS 512
#define KD_SEL_ITEMS 4096
#define KD_SEL_DIGIT 11
#define KD_SEL_BINS (1 << KD_SEL_DIGIT)
#define KD_SEL_RECENT_PASSES 3
#define KD_SEL_PASSES 9
#define KD_SEL_CTL 8
#define KD_SEL_TICKETS ((KD_SEL_PASSES + 1) * KD_SEL_CTL)
#define KD_SEL_HIST 96
#define KD_SEL_COUNTS (KD_SEL_HIST + KD_SEL_PASSES * KD_SEL_BINS)

static_assert(KD_SEL_BINS == 4 * KD_SEL_THREADS, "the digit scan takes 4 bins per thread");
static_assert(KD_SEL_TICKETS + KD_SEL_PASSES + 1 <= KD_SEL_HIST, "tickets overlap histograms");

// Key of slot i in pass `pass`: the position in the recent stage, the slot key after it.
__device__ __forceinline__ uint64_t kd_sel_key(int pass, const KdSlotKey& key, int i) {
  return pass < KD_SEL_RECENT_PASSES ? (uint64_t)key.pos[i] : key(i);
}

// Sum of `v` over the block (KD_SEL_THREADS), returned to every thread; `tmp` holds a word per
// warp. Ends with a barrier, so `tmp` may be reused.
__device__ __forceinline__ unsigned kd_sel_block_sum(unsigned v, unsigned* tmp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) tmp[warp] = v;
  __syncthreads();
  unsigned total = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += tmp[w];
  __syncthreads();
  return total;
}

// Exclusive prefix sum of `v` over the block's threads in order; `tmp` holds a word per warp.
// Ends with a barrier.
__device__ __forceinline__ unsigned kd_sel_block_scan(unsigned v, unsigned* tmp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) tmp[warp] = x;
  __syncthreads();
  unsigned off = x - v;
  for (int w = 0; w < warp; ++w) off += tmp[w];
  __syncthreads();
  return off;
}

// After this block's atomic adds to the workspace: whether it is the last block of the launch
// to get here (`ticket` counts them). Every thread of the block gets the same answer. The last
// block then sees every other block's adds, read through atomics. Every thread fences its own
// adds; thread 0 fences again after the barrier before it takes the ticket (the canonical
// last-block pattern).
__device__ __forceinline__ bool kd_sel_last_block(unsigned* ticket) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  const bool is_last = last;
  __threadfence();
  return is_last;
}

extern "C" __global__ void __launch_bounds__(KD_SEL_THREADS)
    keydiff_select_pass(const float* scores, int64_t score_stride, const uint32_t* positions,
                        int64_t pos_stride, int n, int budget, uint32_t sinks, int recent,
                        int pass, uint32_t* ws, int64_t ws_stride) {
  __shared__ unsigned hist[KD_SEL_BINS];
  __shared__ unsigned tmp[KD_SEL_THREADS / 32];
  __shared__ unsigned found[3];
  const int h = blockIdx.y;
  uint32_t* w = ws + h * ws_stride;
  const uint32_t* in = w + pass * KD_SEL_CTL;
  uint32_t* out = w + (pass + 1) * KD_SEL_CTL;
  const bool recent_stage = pass < KD_SEL_RECENT_PASSES;
  const bool first = pass == 0 || pass == KD_SEL_RECENT_PASSES;
  uint64_t prefix = 0;
  unsigned k = recent_stage ? (unsigned)recent : (unsigned)budget;
  if (!first) {
    if (in[3]) {  // the stage is over: carry its entry on
      if (blockIdx.x == 0 && threadIdx.x < KD_SEL_CTL) out[threadIdx.x] = in[threadIdx.x];
      return;
    }
    prefix = (uint64_t)in[0] | ((uint64_t)in[1] << 32);
    k = in[2];
  }
  // The recent stage's result, carried from ctl[3] on (0 and unused when recent is 0).
  const uint32_t recent_min = recent_stage ? 0u : in[4];
  const int bits = recent_stage ? 32 : 64;
  const int hi = bits - KD_SEL_DIGIT * (recent_stage ? pass : pass - KD_SEL_RECENT_PASSES);
  const int shift = max(hi - KD_SEL_DIGIT, 0);
  const uint64_t mask = hi >= 64 ? 0ull : ~0ull << hi;
  const uint64_t width_mask = (1ull << (hi - shift)) - 1ull;
  const KdSlotKey key{scores + h * score_stride, positions + h * pos_stride, sinks, recent_min,
                      recent > 0};

  for (int j = threadIdx.x; j < KD_SEL_BINS; j += blockDim.x) hist[j] = 0;
  __syncthreads();
  const int i0 = blockIdx.x * KD_SEL_ITEMS, i1 = min(i0 + KD_SEL_ITEMS, n);
  for (int t0 = i0; t0 < i1; t0 += blockDim.x) {
    const int i = t0 + (int)threadIdx.x;
    unsigned bin = KD_SEL_BINS;  // no bin: past the slice, or outside the prefix
    if (i < i1) {
      const uint64_t x = kd_sel_key(pass, key, i);
      if ((x & mask) == prefix) bin = (unsigned)((x >> shift) & width_mask);
    }
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (bin < KD_SEL_BINS && (int)(threadIdx.x & 31u) == __ffs(peers) - 1)
      atomicAdd(&hist[bin], (unsigned)__popc(peers));
  }
  __syncthreads();
  uint32_t* gh = w + KD_SEL_HIST + pass * KD_SEL_BINS;
  for (int j = threadIdx.x; j < KD_SEL_BINS; j += blockDim.x)
    if (hist[j]) atomicAdd(&gh[j], hist[j]);
  if (!kd_sel_last_block(&w[KD_SEL_TICKETS + pass])) return;

  // The last block: bins from the top, 4 per thread; the digit is the bin where the count of
  // keys at or above it first reaches k.
  unsigned v[4], sum = 0;
  for (int c = 0; c < 4; ++c) {
    v[c] = atomicAdd(&gh[KD_SEL_BINS - 1 - 4 * (int)threadIdx.x - c], 0u);
    sum += v[c];
  }
  if (threadIdx.x == 0) {
    // Unless a bin is found (it always is when k <= the keys under the prefix): stop here.
    found[0] = 0;
    found[1] = k;
    found[2] = 1;
  }
  unsigned above = kd_sel_block_scan(sum, tmp);
  for (int c = 0; c < 4; ++c) {
    if (above < k && above + v[c] >= k) {
      found[0] = (unsigned)(KD_SEL_BINS - 1 - 4 * (int)threadIdx.x - c);
      found[1] = k - above;
      found[2] = v[c] == k - above;
    }
    above += v[c];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t np = prefix | ((uint64_t)found[0] << shift);
    const unsigned done = found[2] || shift == 0;
    out[0] = (uint32_t)np;
    out[1] = (uint32_t)(np >> 32);
    out[2] = found[1];
    out[3] = done;
    out[4] = recent_stage ? (done ? (uint32_t)np : 0u) : recent_min;
  }
}

// Holes (non-survivors below `budget`) and movers (survivors from `budget` on) of each slice,
// then, in the last block, their offsets and the head's move count plan[0].
extern "C" __global__ void __launch_bounds__(KD_SEL_THREADS)
    keydiff_select_count(const float* scores, int64_t score_stride, const uint32_t* positions,
                         int64_t pos_stride, int n, int budget, uint32_t sinks, int recent,
                         uint32_t* plan, int64_t plan_stride, uint32_t* ws, int64_t ws_stride) {
  __shared__ unsigned tmp[KD_SEL_THREADS / 32];
  __shared__ unsigned carry[2];
  const int h = blockIdx.y;
  uint32_t* w = ws + h * ws_stride;
  const uint32_t* ctl = w + KD_SEL_PASSES * KD_SEL_CTL;
  const uint64_t threshold = (uint64_t)ctl[0] | ((uint64_t)ctl[1] << 32);
  const KdSlotKey key{scores + h * score_stride, positions + h * pos_stride, sinks, ctl[4],
                      recent > 0};
  const int blocks = (int)gridDim.x;
  uint32_t* counts = w + KD_SEL_COUNTS;
  uint32_t* offsets = counts + 2 * blocks;
  const int i0 = blockIdx.x * KD_SEL_ITEMS, i1 = min(i0 + KD_SEL_ITEMS, n);
  unsigned holes = 0, movers = 0;
  for (int i = i0 + (int)threadIdx.x; i < i1; i += blockDim.x) {
    const bool keep = key(i) >= threshold;
    holes += i < budget && !keep;
    movers += i >= budget && keep;
  }
  holes = kd_sel_block_sum(holes, tmp);
  movers = kd_sel_block_sum(movers, tmp);
  if (threadIdx.x == 0) {
    atomicAdd(&counts[2 * blockIdx.x], holes);
    atomicAdd(&counts[2 * blockIdx.x + 1], movers);
    carry[0] = carry[1] = 0;
  }
  if (!kd_sel_last_block(&w[KD_SEL_TICKETS + KD_SEL_PASSES])) return;
  for (int b0 = 0; b0 < blocks; b0 += blockDim.x) {
    const int b = b0 + (int)threadIdx.x;
    const unsigned ch = b < blocks ? atomicAdd(&counts[2 * b], 0u) : 0u;
    const unsigned cm = b < blocks ? atomicAdd(&counts[2 * b + 1], 0u) : 0u;
    const unsigned oh = kd_sel_block_scan(ch, tmp), om = kd_sel_block_scan(cm, tmp);
    if (b < blocks) {
      offsets[2 * b] = carry[0] + oh;
      offsets[2 * b + 1] = carry[1] + om;
    }
    const unsigned th = kd_sel_block_sum(ch, tmp), tm = kd_sel_block_sum(cm, tmp);
    if (threadIdx.x == 0) {
      carry[0] += th;
      carry[1] += tm;
    }
    __syncthreads();
  }
  // Holes and movers are equal in number when exactly N keys reach the threshold, which unique
  // positions guarantee; the minimum keeps a broken invariant from moving garbage.
  const unsigned max_moves = (unsigned)min(budget, n - budget);
  if (threadIdx.x == 0) plan[h * plan_stride] = min(min(carry[0], carry[1]), max_moves);
}

// Each slice writes its holes and movers, ascending, at the offsets keydiff_select_count gave.
extern "C" __global__ void __launch_bounds__(KD_SEL_THREADS)
    keydiff_select_emit(const float* scores, int64_t score_stride, const uint32_t* positions,
                        int64_t pos_stride, int n, int budget, uint32_t sinks, int recent,
                        uint32_t* plan, int64_t plan_stride, uint32_t* ws, int64_t ws_stride) {
  __shared__ unsigned warp_total[2][KD_SEL_THREADS / 32];
  __shared__ unsigned base[2];
  const int h = blockIdx.y;
  const uint32_t* w = ws + h * ws_stride;
  const uint32_t* ctl = w + KD_SEL_PASSES * KD_SEL_CTL;
  const int blocks = (int)gridDim.x;
  const uint32_t* counts = w + KD_SEL_COUNTS;
  const uint32_t* offsets = counts + 2 * blocks;
  // Most slices hold neither (an eviction moves at most B rows of a head).
  if (counts[2 * blockIdx.x] == 0 && counts[2 * blockIdx.x + 1] == 0) return;
  const uint64_t threshold = (uint64_t)ctl[0] | ((uint64_t)ctl[1] << 32);
  const KdSlotKey key{scores + h * score_stride, positions + h * pos_stride, sinks, ctl[4],
                      recent > 0};
  const int max_moves = min(budget, n - budget);
  uint32_t* src = plan + h * plan_stride + 1;
  uint32_t* dst = src + max_moves;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  if (threadIdx.x == 0) {
    base[0] = offsets[2 * blockIdx.x];
    base[1] = offsets[2 * blockIdx.x + 1];
  }
  const int i0 = blockIdx.x * KD_SEL_ITEMS, i1 = min(i0 + KD_SEL_ITEMS, n);
  for (int t0 = i0; t0 < i1; t0 += blockDim.x) {
    const int i = t0 + (int)threadIdx.x;
    const bool keep = i < i1 && key(i) >= threshold;
    const bool hole = i < i1 && i < budget && !keep;
    const bool mover = i >= budget && keep;
    const unsigned bh = __ballot_sync(0xffffffffu, hole);
    const unsigned bm = __ballot_sync(0xffffffffu, mover);
    if (lane == 0) {
      warp_total[0][warp] = __popc(bh);
      warp_total[1][warp] = __popc(bm);
    }
    __syncthreads();
    unsigned oh = base[0], om = base[1];
    for (int v = 0; v < warp; ++v) {
      oh += warp_total[0][v];
      om += warp_total[1][v];
    }
    oh += __popc(bh & below);
    om += __popc(bm & below);
    if (hole && oh < (unsigned)max_moves) dst[oh] = (uint32_t)i;
    if (mover && om < (unsigned)max_moves) src[om] = (uint32_t)i;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int v = 0; v < warps; ++v) {
        base[0] += warp_total[0][v];
        base[1] += warp_total[1][v];
      }
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// The same selection and plan in one launch, for evictions of few slots (m = n - budget, plus
// the `recent` window, small against a slice): grid (slices, heads), a slice of KD_FEW_ITEMS
// slots per block, as above. The many-block kernels need a launch per digit and read every
// slot's key in each; here every slot is read once, and one block per head finishes.
//
//   1. Each block takes the c = min(m + recent, KD_FEW_ITEMS) smallest keys of its slice,
//      protected by sinks only (the recent window is not known yet), and writes their slots in
//      ascending order; with a recent window, also the slice's min(recent, KD_FEW_ITEMS)
//      largest positions.
//   2. The last block of the head (a ticket, as above) finds the exact recent-th largest
//      position among those (the window's lowest, recent_min), then the m smallest full keys
//      among the candidates: the evicted slots.
//   3. It marks the evicted slots of [budget, n) in a bitmap, and emits the plan: holes are the
//      evicted candidates below `budget` (ascending, as the candidates are), movers the slots
//      of [budget, n) not evicted (ascending).
// Why the candidates hold every evicted slot: a slot x outside its slice's c smallest has
// m + recent keys of its slice below it, at most `recent` of them protected by the window, so
// m unprotected slots whose full keys are below x's: x survives. The same holds for the
// window: a position outside its slice's top min(recent, slice) is below the recent-th
// largest. The threshold of each radix search may stop at the lowest key of a bin (as in
// kd_radix_kth); it picks the right slots among those searched, and only those are compared
// with it, except recent_min, which every slot is compared with: it is made exact first.
//
// Workspace per head (u32 words, zeroed, `ws_stride` apart): [0] the ticket; then slices x c
// candidate slots (slice b from 1 + b * c); then slices x min(recent, KD_FEW_ITEMS) positions.
// Blocks write them with atomicOr and the last block reads them with atomics, after the fence
// of kd_sel_last_block. It holds every candidate in shared memory: slices x c <= KD_FEW_CAND,
// which the launch wrappers check (crates/keydiff-kernels, `select_few_fits`).
// ---------------------------------------------------------------------------------------------

#define KD_FEW_THREADS 1024
#define KD_FEW_ITEMS 4096
#define KD_FEW_CAND 8192
#define KD_FEW_DIGIT 11
#define KD_FEW_BINS (1 << KD_FEW_DIGIT)

static_assert(KD_FEW_BINS == 2 * KD_FEW_THREADS, "the digit search takes 2 bins per thread");

struct KdFewShared {
  unsigned hist[KD_FEW_BINS];
  unsigned tmp[KD_FEW_THREADS / 32];
  unsigned digit;
  unsigned k;
  unsigned done;
};

// As kd_radix_kth: a threshold t such that exactly k (1 <= k <= count) of key(0..count) are
// >= t, over the low BITS bits, to every thread; 11-bit digits, and the digit is found by a
// scan over the block (2 bins per thread) instead of one thread walking the bins.
template <int BITS, typename F>
__device__ uint64_t kd_few_kth(const F& key, int count, unsigned k, KdFewShared& sh) {
  const int lane = (int)(threadIdx.x & 31u);
  uint64_t prefix = 0, mask = 0;
  for (int hi = BITS; hi > 0; hi -= KD_FEW_DIGIT) {
    const int shift = max(hi - KD_FEW_DIGIT, 0);
    const uint64_t width = (1ull << (hi - shift)) - 1ull;
    for (int j = threadIdx.x; j < KD_FEW_BINS; j += blockDim.x) sh.hist[j] = 0;
    __syncthreads();
    for (int t0 = 0; t0 < count; t0 += blockDim.x) {
      const int i = t0 + (int)threadIdx.x;
      unsigned bin = KD_FEW_BINS;  // no bin: past count, or outside the prefix
      if (i < count) {
        const uint64_t x = key(i);
        if ((x & mask) == prefix) bin = (unsigned)((x >> shift) & width);
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin < KD_FEW_BINS && lane == __ffs(peers) - 1)
        atomicAdd(&sh.hist[bin], (unsigned)__popc(peers));
    }
    __syncthreads();
    // Thread t holds bins BINS - 1 - 2t and BINS - 2 - 2t: the scan runs from the top bin down.
    // (Blocks are KD_FEW_THREADS threads: the launch wrappers give no other size.)
    const unsigned b0 = KD_FEW_BINS - 1 - 2 * threadIdx.x, b1 = b0 - 1;
    const unsigned v0 = sh.hist[b0], v1 = sh.hist[b1];
    if (threadIdx.x == 0) {  // unless a bin is found (it always is when k <= count): stop
      sh.digit = 0;
      sh.k = k;
      sh.done = 1;
    }
    unsigned above = kd_sel_block_scan(v0 + v1, sh.tmp);
    if (above < k && above + v0 >= k) {
      sh.digit = b0;
      sh.k = k - above;
      sh.done = v0 == k - above;
    }
    above += v0;
    if (above < k && above + v1 >= k) {
      sh.digit = b1;
      sh.k = k - above;
      sh.done = v1 == k - above;
    }
    __syncthreads();
    prefix |= (uint64_t)sh.digit << shift;
    mask |= width << shift;
    k = sh.k;
    const bool done = sh.done || shift == 0;
    __syncthreads();
    if (done) break;
  }
  return prefix;
}

// Calls emit(rank, i) for the i in [0, count) where pred(i) holds, rank the number of such i
// before it; returns how many there are, to every thread. Ends with a barrier.
template <typename P, typename E>
__device__ unsigned kd_few_compact(int count, const P& pred, const E& emit, unsigned* tmp) {
  const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
  const int warps = (int)(blockDim.x >> 5);
  unsigned base = 0;
  for (int t0 = 0; t0 < count; t0 += blockDim.x) {
    const int i = t0 + (int)threadIdx.x;
    const bool p = i < count && pred(i);
    const unsigned bits = __ballot_sync(0xffffffffu, p);
    if (lane == 0) tmp[warp] = (unsigned)__popc(bits);
    __syncthreads();
    unsigned rank = base + (unsigned)__popc(bits & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < warps; ++w) {
      if (w < warp) rank += tmp[w];
      total += tmp[w];
    }
    if (p) emit(rank, i);
    base += total;
    __syncthreads();
  }
  return base;
}

// The smallest `v` of the block, to every thread. Ends with a barrier.
__device__ __forceinline__ unsigned kd_few_min(unsigned v, unsigned* tmp) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, (unsigned)__shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31u) == 0) tmp[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned r = 0xffffffffu;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) r = min(r, tmp[w]);
  __syncthreads();
  return r;
}

extern "C" __global__ void __launch_bounds__(KD_FEW_THREADS)
    keydiff_select_few(const float* scores, int64_t score_stride, const uint32_t* positions,
                       int64_t pos_stride, int n, int budget, uint32_t sinks, int recent,
                       uint32_t* plan, int64_t plan_stride, uint32_t* ws, int64_t ws_stride) {
  __shared__ KdFewShared sh;
  __shared__ unsigned list[KD_FEW_CAND];
  __shared__ unsigned tail[KD_FEW_CAND / 32];
  const int h = blockIdx.y;
  const float* s = scores + h * score_stride;
  const uint32_t* pos = positions + h * pos_stride;
  uint32_t* w = ws + h * ws_stride;
  const int m = n - budget;
  const int slices = (int)gridDim.x;
  const int c = min(m + recent, KD_FEW_ITEMS), rr = min(recent, KD_FEW_ITEMS);
  uint32_t* cand = w + 1;
  uint32_t* rcand = cand + (int64_t)slices * c;
  const int i0 = blockIdx.x * KD_FEW_ITEMS, len = min(KD_FEW_ITEMS, n - i0);

  // 1. The slice's candidates. Keys are inverted so that the smallest come first.
  {
    const KdSlotKey sink_key{s, pos, sinks, 0u, 0};
    const auto inv = [&](int i) { return ~sink_key(i0 + i); };
    const unsigned k = (unsigned)min(c, len);
    const uint64_t t = kd_few_kth<64>(inv, len, k, sh);
    uint32_t* out = cand + (int64_t)blockIdx.x * c;
    // Exactly k pass with unique positions; the bound keeps duplicates inside the workspace.
    kd_few_compact(
        len, [&](int i) { return inv(i) >= t; },
        [&](unsigned r, int i) {
          if (r < k) atomicOr(&out[r], (unsigned)(i0 + i));
        },
        sh.tmp);
  }
  if (recent > 0) {
    const auto newest = [&](int i) { return (uint64_t)pos[i0 + i]; };
    const unsigned k = (unsigned)min(rr, len);
    const uint64_t t = kd_few_kth<32>(newest, len, k, sh);
    uint32_t* out = rcand + (int64_t)blockIdx.x * rr;
    kd_few_compact(
        len, [&](int i) { return newest(i) >= t; },
        [&](unsigned r, int i) {
          if (r < k) atomicOr(&out[r], pos[i0 + i]);
        },
        sh.tmp);
  }
  if (!kd_sel_last_block(&w[0])) return;

  // 2. The last block: the window's lowest position, exact. (The wrappers keep the candidates
  // within KD_FEW_CAND; past it, the plan moves nothing rather than write outside `list`.)
  const int last = (slices - 1) * KD_FEW_ITEMS;
  if ((int64_t)(slices - 1) * c + min(c, n - last) > KD_FEW_CAND) {
    if (threadIdx.x == 0) plan[h * plan_stride] = 0;
    return;
  }
  uint32_t recent_min = 0;
  if (recent > 0) {
    const int count = (slices - 1) * rr + min(rr, n - last);
    for (int j = threadIdx.x; j < count; j += blockDim.x) list[j] = atomicAdd(&rcand[j], 0u);
    __syncthreads();
    const auto newest = [&](int i) { return (uint64_t)list[i]; };
    const uint64_t t = kd_few_kth<32>(newest, count, (unsigned)recent, sh);
    unsigned low = 0xffffffffu;
    for (int j = threadIdx.x; j < count; j += blockDim.x)
      if (list[j] >= t) low = min(low, list[j]);
    recent_min = kd_few_min(low, sh.tmp);
  }

  // The m smallest full keys of the candidates are evicted.
  const KdSlotKey key{s, pos, sinks, recent_min, recent > 0};
  const int count = (slices - 1) * c + min(c, n - last);
  for (int j = threadIdx.x; j < count; j += blockDim.x) list[j] = atomicAdd(&cand[j], 0u);
  for (int j = threadIdx.x; j < (m + 31) / 32; j += blockDim.x) tail[j] = 0;
  __syncthreads();
  const auto inv = [&](int i) { return ~key((int)list[i]); };
  const uint64_t t = kd_few_kth<64>(inv, count, (unsigned)m, sh);
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    const int x = (int)list[j] - budget;
    if (x >= 0 && inv(j) >= t) atomicOr(&tail[x >> 5], 1u << (x & 31));
  }
  __syncthreads();

  // 3. The plan.
  const int max_moves = min(budget, m);
  uint32_t* out = plan + h * plan_stride;
  uint32_t* src = out + 1;
  uint32_t* dst = out + 1 + max_moves;
  const unsigned holes = kd_few_compact(
      count, [&](int i) { return (int)list[i] < budget && inv(i) >= t; },
      [&](unsigned r, int i) {
        if (r < (unsigned)max_moves) dst[r] = list[i];
      },
      sh.tmp);
  const unsigned movers = kd_few_compact(
      m, [&](int j) { return ((tail[j >> 5] >> (j & 31)) & 1u) == 0; },
      [&](unsigned r, int j) {
        if (r < (unsigned)max_moves) src[r] = (uint32_t)(budget + j);
      },
      sh.tmp);
  // Holes and movers are equal in number (m evicted, of which those at or past budget leave
  // as many survivors there as holes below it); the minimum keeps a broken invariant safe.
  if (threadIdx.x == 0) out[0] = min(min(holes, movers), (unsigned)max_moves);
}

// One row of `row_bytes` bytes copied by the 32 lanes of a warp, in 16-byte words where both
// ends and the length allow, else 4-byte words, else bytes.
__device__ __forceinline__ void kd_copy_row(char* to, const char* from, int row_bytes,
                                            int lane) {
  if ((((uintptr_t)from | (uintptr_t)to | (uintptr_t)row_bytes) & 15u) == 0) {
    for (int j = lane; j < row_bytes / 16; j += 32)
      reinterpret_cast<uint4*>(to)[j] = reinterpret_cast<const uint4*>(from)[j];
  } else if ((((uintptr_t)from | (uintptr_t)to | (uintptr_t)row_bytes) & 3u) == 0) {
    for (int j = lane; j < row_bytes / 4; j += 32)
      reinterpret_cast<uint32_t*>(to)[j] = reinterpret_cast<const uint32_t*>(from)[j];
  } else {
    for (int j = lane; j < row_bytes; j += 32) to[j] = from[j];
  }
}

// Applies the plan to one buffer of rows: [heads, rows, row_bytes] with byte strides. One warp
// per move. Used for K, V (row = head_dim elements, or the bytes of head_dim / 32 quantized blocks),
// positions and policy state (row = 4 bytes). Grid (ceil(M / warps per block), heads).
// A move naming a row outside [0, rows) is skipped (the CPU op refuses such a plan; a kernel
// cannot, but it never writes outside the buffer).
extern "C" __global__ void keydiff_move_rows(char* buf, int64_t head_stride, int64_t row_stride,
                                             int row_bytes, int rows, const uint32_t* plan,
                                             int64_t plan_stride, int max_moves) {
  const int h = blockIdx.y;
  const uint32_t* p = plan + h * plan_stride;
  const int lane = threadIdx.x & 31;
  const int m = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (m >= min((int)p[0], max_moves)) return;
  const uint32_t src = p[1 + m], dst = p[1 + max_moves + m];
  if (src >= (uint32_t)rows || dst >= (uint32_t)rows) return;
  kd_copy_row(buf + h * head_stride + (int64_t)dst * row_stride,
              buf + h * head_stride + (int64_t)src * row_stride, row_bytes, lane);
}

// ---------------------------------------------------------------------------------------------
// A chunk appended to a layer's cache in one launch: its keys and values written after the used
// slots, with their positions and zeroed policy state. candle took seven operations a layer for
// it (a slice_set each for K and V, a copy of V's transposed view, positions made on the host and
// uploaded, their broadcast over the heads and its slice_set, a zeroed state and its slice_set),
// which at decode, one row, cost a launch or a transfer each for a few hundred bytes. Reference:
// `LayerCache::append`'s candle ops (crates/keydiff-cache/src/layer.rs), which the CPU runs.
//
// k, v: [heads, chunk] rows of `row_bytes` bytes at byte strides (k_hs, k_rs), (v_hs, v_rs) (a
// row's bytes contiguous; any head and row order: V is a transposed view of the projection's
// output). kbuf, vbuf: [heads, capacity] rows at byte strides (buf_hs, buf_rs), one layout for
// both; positions (u32) and state (f32): [heads, capacity] at head stride meta_hs elements.
// Row r of head h goes to slot `slot + r`, with position pos0 + r and state 0. The keys and
// values are already in the cache's dtype: bytes are copied as they are. One warp per row, grid
// (ceil(chunk / warps a block), heads).
#define KD_APPEND_THREADS 256

extern "C" __global__ void __launch_bounds__(KD_APPEND_THREADS) keydiff_append_rows(
    const char* k, int64_t k_hs, int64_t k_rs, const char* v, int64_t v_hs, int64_t v_rs,
    char* kbuf, char* vbuf, int64_t buf_hs, int64_t buf_rs, int row_bytes, uint32_t* positions,
    float* state, int64_t meta_hs, int slot, int chunk, uint32_t pos0) {
  const int h = blockIdx.y, lane = threadIdx.x & 31;
  const int r = blockIdx.x * (KD_APPEND_THREADS / 32) + (threadIdx.x >> 5);
  if (r >= chunk) return;
  const int64_t to = h * buf_hs + (int64_t)(slot + r) * buf_rs;
  kd_copy_row(kbuf + to, k + h * k_hs + (int64_t)r * k_rs, row_bytes, lane);
  kd_copy_row(vbuf + to, v + h * v_hs + (int64_t)r * v_rs, row_bytes, lane);
  if (lane == 0) {
    positions[h * meta_hs + slot + r] = pos0 + (uint32_t)r;
    state[h * meta_hs + slot + r] = 0.f;
  }
}

// ---------------------------------------------------------------------------------------------
// SnapKV pooling along positions: after compaction slots are not in position order, so each
// head's slots are ranked by position (a bitmap of the positions, then prefix popcounts; no
// sort), and scores[i] = (sum of stats over the 5 slots ranked r-2..r+2) / 5, zero padding
// counted, as F.avg_pool1d(kernel 5, padding 2). The additions run in the CPU twin's order
// (`avg_pool` in crates/keydiff-cache/src/policy/snapkv.rs), so results are bit-identical.
// One block per head. bitmap [heads, words] must be zeroed; words * 32 > every position (a
// position past the bitmap is skipped, never written through: its slot gets NaN and the
// others pool over the positions that remain).
// ---------------------------------------------------------------------------------------------

#define KD_POOL_THREADS 1024
#define KD_POOL_HALF 2

extern "C" __global__ void __launch_bounds__(KD_POOL_THREADS)
    snapkv_pool(const float* stats, int64_t stats_stride, const uint32_t* positions,
                int64_t pos_stride, int n, uint32_t* bitmap, int words, uint32_t* word_rank,
                uint32_t* sorted, float* scores) {
  __shared__ unsigned warp_total[KD_POOL_THREADS / 32];
  __shared__ unsigned base;
  const int h = blockIdx.x;
  const float* st = stats + h * stats_stride;
  const uint32_t* pos = positions + h * pos_stride;
  uint32_t* bm = bitmap + (int64_t)h * words;
  uint32_t* wr = word_rank + (int64_t)h * words;
  uint32_t* srt = sorted + (int64_t)h * n;
  float* out = scores + (int64_t)h * n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint32_t p = pos[i];
    if ((p >> 5) < (uint32_t)words) atomicOr(&bm[p >> 5], 1u << (p & 31u));
  }
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  // word_rank[w] = number of positions in words [0, w).
  for (int t0 = 0; t0 < words; t0 += blockDim.x) {
    const int w = t0 + threadIdx.x;
    const unsigned c = w < words ? __popc(bm[w]) : 0u;
    unsigned x = c;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_total[warp] = x;
    __syncthreads();
    unsigned off = base;
    for (int v = 0; v < warp; ++v) off += warp_total[v];
    if (w < words) wr[w] = off + x - c;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int v = 0; v < warps; ++v) base += warp_total[v];
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint32_t p = pos[i];
    if ((p >> 5) >= (uint32_t)words) continue;
    const uint32_t r = wr[p >> 5] + __popc(bm[p >> 5] & ((1u << (p & 31u)) - 1u));
    srt[r] = (uint32_t)i;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint32_t p = pos[i];
    if ((p >> 5) >= (uint32_t)words) {
      out[i] = __uint_as_float(0x7fc00000u);  // NaN
      continue;
    }
    const int r = (int)(wr[p >> 5] + __popc(bm[p >> 5] & ((1u << (p & 31u)) - 1u)));
    float s = 0.f;
    // Ranks run to base - 1 (= n - 1 for valid positions; fewer if some were skipped).
    const int last = min(n, (int)base) - 1;
    for (int j = max(r - KD_POOL_HALF, 0); j <= min(r + KD_POOL_HALF, last); ++j) s += st[srt[j]];
    out[i] = s / (float)(2 * KD_POOL_HALF + 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Quantized KV caches (llama.cpp's `q8_0`, `q5_1`, `q5_0`, `q4_1`, `q4_0` cache types): each run
// of 32 values of a row is one GGML block, an f16 scale d (little endian), for `_1` types an f16
// minimum m, for 5-bit types a 32-bit word qh of fifth bits (bit j: value j), then the codes:
// q8_0 32 signed bytes round(x / d); 4- and 5-bit codes as nibbles, value j low and j + 16 high
// in byte j. `kind` numbers the types as `KvType::block_code` does. The CPU twins are
// `quantize_block` / `dequantize_block` in crates/keydiff-cache/src/kv_type.rs (GGML's
// reference codecs); the arithmetic is the same IEEE operations in the same order, with no
// fused multiply-adds (__fmul_rn / __fadd_rn), so the bytes and values are identical.
// ---------------------------------------------------------------------------------------------

#define KD_KVQ_BLOCK 32
#define KD_KVQ_THREADS 256
#define KD_KVQ_Q8_0 0
#define KD_KVQ_Q5_1 1
#define KD_KVQ_Q5_0 2
#define KD_KVQ_Q4_1 3
#define KD_KVQ_Q4_0 4
// fp8 E4M3 (`--kv-dtype fp8`): not a block type, but the same walk with "blocks" of 32 bytes of
// one code each. candle 0.11.1's CUDA casts for F8E4M3 are unreachable (it asks for
// `cast_f8e4m3_*`, its kernels are named `cast_f8_e4m3_*`), so the cache converts here.
#define KD_KVQ_FP8 5

// Bytes of a block of `kind`; 0 for an unknown kind.
__device__ __forceinline__ int kd_kvq_bytes(int kind) {
  switch (kind) {
    case KD_KVQ_Q8_0: return 34;
    case KD_KVQ_Q5_1: return 24;
    case KD_KVQ_Q5_0: return 22;
    case KD_KVQ_Q4_1: return 20;
    case KD_KVQ_Q4_0: return 18;
    case KD_KVQ_FP8: return 32;
    default: return 0;
  }
}

// f32 -> E4M3, round to nearest even, saturating to +-448, NaN to 0x7f (with its sign): CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) and the `float8` crate's `from_f32` (a
// port of cuda_fp8.hpp's double path; on f32 bits the same decisions, the dropped bits being 0).
__device__ __forceinline__ uint8_t kd_f_to_fp8(float x) {
  const unsigned bits = __float_as_uint(x), ax = bits & 0x7fffffffu;
  const uint8_t sign = (uint8_t)((bits >> 31) << 7);
  const int exp = (int)((bits >> 23) & 0xffu) - 127 + 7;
  const unsigned mant = (bits >> 20) & 7u, half_ulp = 1u << 19;
  unsigned res;
  if (ax <= 0x3a800000u) {  // |x| <= 2^-10: zero
    res = 0;
  } else if (ax > 0x7f800000u) {  // NaN
    res = 0x7f;
  } else if (ax > 0x43e80000u) {  // past 464: the largest finite, 448
    res = 0x7e;
  } else if (ax >= 0x3c800000u) {  // normal: |x| >= 2^-6
    res = ((unsigned)exp << 3) | mant;
    const unsigned round = bits & ((half_ulp << 1) - 1);
    if (round > half_ulp || (round == half_ulp && (mant & 1u))) res += 1;
  } else {  // subnormal
    const int shift = 1 - exp;
    res = (mant | 8u) >> shift;
    const unsigned round = (bits | (1u << 23)) & ((half_ulp << (shift + 1)) - 1);
    if (round > (half_ulp << shift) || (round == (half_ulp << shift) && (res & 1u))) res += 1;
  }
  return (uint8_t)(res | sign);
}

// E4M3 -> f32, exact (0x7f and 0xff are NaN).
__device__ __forceinline__ float kd_fp8_to_f(uint8_t b) {
  const unsigned s = (unsigned)(b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 7u;
  if (e == 15 && m == 7) return __uint_as_float(s | 0x7fc00000u);
  if (e == 0) return __uint_as_float(s | __float_as_uint(__fmul_rn((float)m, 0.001953125f)));
  return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}

__device__ __forceinline__ void kd_put_f16(uint8_t* o, float x) {
  const unsigned short bits = __half_as_ushort(__float2half_rn(x));
  o[0] = (uint8_t)(bits & 0xffu);
  o[1] = (uint8_t)(bits >> 8);
}

__device__ __forceinline__ float kd_get_f16(const uint8_t* q) {
  return __half2float(__ushort_as_half((unsigned short)(q[0] | (q[1] << 8))));
}

// x [heads, n, d] (element strides; rows contiguous) -> out [heads, n, d / 32 * bytes],
// contiguous. One thread per block of 32 values; grid (ceil(n * d / 32 / threads), heads).
template <typename T>
__device__ void kd_kvq_quantize(const T* x, int64_t head_stride, int64_t row_stride, int n, int d,
                                int kind, uint8_t* out) {
  const int nb = d / KD_KVQ_BLOCK, bytes = kd_kvq_bytes(kind);
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int h = blockIdx.y;
  if (i >= (int64_t)n * nb || bytes == 0) return;
  const int r = (int)(i / nb), b = (int)(i % nb);
  const T* src = x + h * head_stride + r * row_stride + b * KD_KVQ_BLOCK;
  uint8_t* o = out + ((int64_t)h * n * nb + i) * bytes;
  float v[KD_KVQ_BLOCK];
  for (int j = 0; j < KD_KVQ_BLOCK; ++j) v[j] = kd_to_f(src[j]);
  if (kind == KD_KVQ_FP8) {
    for (int j = 0; j < KD_KVQ_BLOCK; ++j) o[j] = kd_f_to_fp8(v[j]);
    return;
  }
  if (kind == KD_KVQ_Q8_0) {
    float amax = 0.f;
    for (int j = 0; j < KD_KVQ_BLOCK; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const float dq = amax / 127.f;
    const float id = dq != 0.f ? 1.f / dq : 0.f;
    kd_put_f16(o, dq);
    for (int j = 0; j < KD_KVQ_BLOCK; ++j) o[2 + j] = (uint8_t)(int8_t)roundf(__fmul_rn(v[j], id));
    return;
  }
  uint8_t code[KD_KVQ_BLOCK];
  const bool five = kind == KD_KVQ_Q5_0 || kind == KD_KVQ_Q5_1;
  uint8_t* qs;
  if (kind == KD_KVQ_Q4_0 || kind == KD_KVQ_Q5_0) {
    // The value of largest magnitude (the first of equals) is -half steps.
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < KD_KVQ_BLOCK; ++j) {
      if (amax < fabsf(v[j])) {
        amax = fabsf(v[j]);
        mx = v[j];
      }
    }
    const float half = five ? 16.f : 8.f;
    const int top = five ? 31 : 15;
    const float dq = mx / -half;
    const float id = dq != 0.f ? 1.f / dq : 0.f;
    kd_put_f16(o, dq);
    for (int j = 0; j < KD_KVQ_BLOCK; ++j)
      code[j] = (uint8_t)min(top, (int)__fadd_rn(__fmul_rn(v[j], id), half + 0.5f));
    qs = o + (five ? 6 : 2);
  } else {
    float lo = v[0], hi = v[0];
    for (int j = 1; j < KD_KVQ_BLOCK; ++j) {
      lo = fminf(lo, v[j]);
      hi = fmaxf(hi, v[j]);
    }
    const int top = five ? 31 : 15;
    const float dq = __fsub_rn(hi, lo) / (float)top;
    const float id = dq != 0.f ? 1.f / dq : 0.f;
    kd_put_f16(o, dq);
    kd_put_f16(o + 2, lo);
    for (int j = 0; j < KD_KVQ_BLOCK; ++j)
      code[j] = (uint8_t)min(top, (int)__fadd_rn(__fmul_rn(__fsub_rn(v[j], lo), id), 0.5f));
    qs = o + (five ? 8 : 4);
  }
  for (int j = 0; j < KD_KVQ_BLOCK / 2; ++j)
    qs[j] = (uint8_t)((code[j] & 0x0f) | ((code[j + 16] & 0x0f) << 4));
  if (five) {
    unsigned qh = 0;
    for (int j = 0; j < KD_KVQ_BLOCK; ++j) qh |= ((unsigned)(code[j] >> 4) & 1u) << j;
    uint8_t* w = qs - 4;
    for (int k = 0; k < 4; ++k) w[k] = (uint8_t)(qh >> (8 * k));
  }
}

#define KD_KVQ_QUANTIZE(SUFFIX, T)                                                                \
  extern "C" __global__ void __launch_bounds__(KD_KVQ_THREADS) keydiff_kvq_quantize_##SUFFIX(    \
      const T* x, int64_t head_stride, int64_t row_stride, int n, int d, int kind, uint8_t* out) { \
    kd_kvq_quantize<T>(x, head_stride, row_stride, n, d, kind, out);                              \
  }
KD_KVQ_QUANTIZE(f32, float)
KD_KVQ_QUANTIZE(f16, __half)
KD_KVQ_QUANTIZE(bf16, __nv_bfloat16)

// Value j (0..31) of a block of `kind` (KD_KVQ_*; for fp8, of 32 codes): llama.cpp's
// dequantization, each step rounded as the CPU codec rounds it (no fused multiply-add).
__device__ __forceinline__ float kd_kvq_value(const uint8_t* blk, int kind, int j) {
  if (kind == KD_KVQ_FP8) return kd_fp8_to_f(blk[j]);
  const float scale = kd_get_f16(blk);
  if (kind == KD_KVQ_Q8_0) return __fmul_rn((float)(int8_t)blk[2 + j], scale);
  const bool five = kind == KD_KVQ_Q5_0 || kind == KD_KVQ_Q5_1;
  const bool with_min = kind == KD_KVQ_Q4_1 || kind == KD_KVQ_Q5_1;
  const uint8_t* qs = blk + 2 + (with_min ? 2 : 0) + (five ? 4 : 0);
  int code = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
  if (five) {
    const uint8_t* w = qs - 4;
    const unsigned qh = (unsigned)w[0] | ((unsigned)w[1] << 8) | ((unsigned)w[2] << 16) |
                        ((unsigned)w[3] << 24);
    code |= (int)((qh >> j) & 1u) << 4;
  }
  if (with_min) return __fadd_rn(__fmul_rn((float)code, scale), kd_get_f16(blk + 2));
  return __fmul_rn((float)(code - (five ? 16 : 8)), scale);
}

// A value in f32, f16 or bf16 (rounded to nearest even, as candle's casts round).
__device__ __forceinline__ void kd_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kd_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kd_store(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

// q [heads, n, d / 32 * bytes] (byte strides: a view of the cache buffer) -> out [heads, n, d]
// contiguous, in f32 (keydiff_kvq_dequantize) or rounded once from f32 to the activations'
// dtype (keydiff_kvq_dequantize_<f16|bf16>: what a cast of the f32 values gives, in one pass
// and a third of the bytes). One thread per value; grid (ceil(n * d / threads), heads).
template <typename O>
__device__ void kd_kvq_dequantize(const uint8_t* q, int64_t head_stride, int64_t row_stride, int n,
                                  int d, int kind, O* out) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int h = blockIdx.y;
  const int bytes = kd_kvq_bytes(kind);
  if (i >= (int64_t)n * d || bytes == 0) return;
  const int r = (int)(i / d), c = (int)(i % d);
  const uint8_t* blk = q + h * head_stride + r * row_stride + (c / KD_KVQ_BLOCK) * bytes;
  kd_store(out + (int64_t)h * n * d + i, kd_kvq_value(blk, kind, c % KD_KVQ_BLOCK));
}

#define KD_KVQ_DEQUANTIZE(NAME, O)                                                                 \
  extern "C" __global__ void __launch_bounds__(KD_KVQ_THREADS)                                     \
      NAME(const uint8_t* q, int64_t head_stride, int64_t row_stride, int n, int d, int kind,      \
           O* out) {                                                                               \
    kd_kvq_dequantize<O>(q, head_stride, row_stride, n, d, kind, out);                             \
  }
KD_KVQ_DEQUANTIZE(keydiff_kvq_dequantize, float)
KD_KVQ_DEQUANTIZE(keydiff_kvq_dequantize_f16, __half)
KD_KVQ_DEQUANTIZE(keydiff_kvq_dequantize_bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Decode attention (flash-decoding): a decode step's one query row per query head over its KV
// head's cache, read in place. The eager path runs six launches for it (q · scale, q · kᵀ, a
// cast to f32, softmax, a cast back, p · v) and writes a row of probabilities per head between
// them; this is one launch, or two when the keys are split over several blocks. Its CPU twin is
// `decode_attention_cpu` (crates/keydiff-model/src/decode_kernel.rs), the same online softmax
// over units of keys; the reference is the eager path (`attention_probs`, `attention_output`).
//
// q [kv, g, d] contiguous (query head h · g + j attends KV head h: GQA); k, v [kv, t, d] views
// of the cache (element strides, rows contiguous), all of one dtype T; d <= 32 · NE. Or
// (keydiff_decode_kvq_*) k, v u8 rows of a quantized cache, blocks of 32 values of `kind`
// (KD_KVQ_*, fp8 too; byte strides), dequantized as they are read, as keydiff_kvq_dequantize
// does: the eager path's result over the dequantized cache, without writing it out. Grid
// (splits, kv), KD_DEC_THREADS threads: block (s, h) takes keys [s · span, min(t, (s + 1) ·
// span)), which is never empty (the wrapper's split), its warps every KD_DEC_WARPS-th of them. A
// warp reads each of its key and value rows once (lane l holds elements l, l + 32, ...) for all
// g query heads, and keeps per head the running max m of the scores, the sum l of
// exp(score - m) and the value rows weighted by those (f32). Scores are (q · scale) · k, q
// scaled in f32. The warps are merged in shared memory; with one split the block writes
// out [kv, g, d] in T, else (m, l, acc[d]) to part [kv, splits, g, d + 2] in f32, which
// keydiff_decode_combine merges into out.
#define KD_DEC_THREADS 128
#define KD_DEC_WARPS (KD_DEC_THREADS / 32)
#define KD_DEC_MAX_G 8

__device__ __forceinline__ float kd_neg_inf() { return __uint_as_float(0xff800000u); }

// Merges n partial softmax states (m, l, acc) at stride `step` floats into (mx, sl, sa): mx the
// largest m, sl = sum(l · e^(m - mx)), sa = sum(acc · e^(m - mx)); the value is sa / sl. At least
// one state holds a key; one that holds none (m = -inf, l = acc = 0) adds 0, and a NaN anywhere
// gives NaN.
__device__ __forceinline__ void kd_softmax_merge(const float* m, const float* l, const float* acc,
                                                 int n, int step, float& mx, float& sl,
                                                 float& sa) {
  mx = kd_neg_inf();
  for (int i = 0; i < n; ++i) mx = fmaxf(mx, m[i * step]);
  sl = 0.f;
  sa = 0.f;
  for (int i = 0; i < n; ++i) {
    const float f = expf(m[i * step] - mx);
    sl += l[i * step] * f;
    sa += acc[i * step] * f;
  }
}

// The K and V rows of a decode step: in the activations' dtype (element strides) ...
template <typename T>
struct KdDecodeRows {
  const T* k;
  int64_t k_hs, k_rs;
  const T* v;
  int64_t v_hs, v_rs;
  __device__ __forceinline__ float key(int h, int r, int c) const {
    return kd_to_f(k[h * k_hs + (int64_t)r * k_rs + c]);
  }
  __device__ __forceinline__ float value(int h, int r, int c) const {
    return kd_to_f(v[h * v_hs + (int64_t)r * v_rs + c]);
  }
};

// ... or of a quantized cache: blocks of `bytes` of `kind` (byte strides).
struct KdDecodeBlockRows {
  const uint8_t* k;
  int64_t k_hs, k_rs;
  const uint8_t* v;
  int64_t v_hs, v_rs;
  int kind, bytes;
  __device__ __forceinline__ float key(int h, int r, int c) const {
    return kd_kvq_value(k + h * k_hs + (int64_t)r * k_rs + (c / KD_KVQ_BLOCK) * bytes, kind,
                        c % KD_KVQ_BLOCK);
  }
  __device__ __forceinline__ float value(int h, int r, int c) const {
    return kd_kvq_value(v + h * v_hs + (int64_t)r * v_rs + (c / KD_KVQ_BLOCK) * bytes, kind,
                        c % KD_KVQ_BLOCK);
  }
};

template <typename T, int NE, typename Rows>
__device__ void kd_decode(const T* q, const Rows& rows, int t, int g, int d, int span,
                          float scale, T* out, float* part) {
  __shared__ float sm_m[KD_DEC_MAX_G][KD_DEC_WARPS];
  __shared__ float sm_l[KD_DEC_MAX_G][KD_DEC_WARPS];
  __shared__ float sm_acc[KD_DEC_MAX_G][32 * NE][KD_DEC_WARPS];
  const int h = blockIdx.y, s = blockIdx.x, splits = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // (s + 1) · span may pass INT_MAX for the last block of a huge cache; s · span < t does not.
  const int r0 = s * span, r1 = (int)min((long long)t, (long long)r0 + span);
  float qr[KD_DEC_MAX_G][NE], acc[KD_DEC_MAX_G][NE], m[KD_DEC_MAX_G], l[KD_DEC_MAX_G];
  for (int j = 0; j < KD_DEC_MAX_G; ++j) {
    m[j] = kd_neg_inf();
    l[j] = 0.f;
    for (int e = 0; e < NE; ++e) {
      const int c = lane + 32 * e;
      qr[j][e] = j < g && c < d ? kd_to_f(q[((int64_t)h * g + j) * d + c]) * scale : 0.f;
      acc[j][e] = 0.f;
    }
  }
  for (int r = r0 + warp; r < r1; r += KD_DEC_WARPS) {
    float kx[NE], vx[NE];
    for (int e = 0; e < NE; ++e) {
      const int c = lane + 32 * e;
      kx[e] = c < d ? rows.key(h, r, c) : 0.f;
      vx[e] = c < d ? rows.value(h, r, c) : 0.f;
    }
    for (int j = 0; j < KD_DEC_MAX_G; ++j) {
      if (j < g) {  // the same for every lane: the warp stays converged
        float p = 0.f;
        for (int e = 0; e < NE; ++e) p += qr[j][e] * kx[e];
        p = kd_warp_sum(p);
        // A score of -inf (an infinite key) weighs 0, as in softmax, also as the first key
        // (where m is -inf too); a NaN score (fmaxf passes it by) makes everything NaN.
        const float mn = fmaxf(m[j], p);
        const bool none = mn == kd_neg_inf() && p == kd_neg_inf();
        const float c = none ? 1.f : expf(m[j] - mn), w = none ? 0.f : expf(p - mn);
        l[j] = l[j] * c + w;
        for (int e = 0; e < NE; ++e) acc[j][e] = acc[j][e] * c + w * vx[e];
        m[j] = mn;
      }
    }
  }
  for (int j = 0; j < KD_DEC_MAX_G; ++j) {
    if (j < g) {
      if (lane == 0) {
        sm_m[j][warp] = m[j];
        sm_l[j][warp] = l[j];
      }
      for (int e = 0; e < NE; ++e) sm_acc[j][lane + 32 * e][warp] = acc[j][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < g * d; i += KD_DEC_THREADS) {
    const int j = i / d, c = i % d;
    // The warps' states of head j, then of element c, each KD_DEC_WARPS floats in a row.
    float mx, sl, sa;
    kd_softmax_merge(sm_m[j], sm_l[j], sm_acc[j][c], KD_DEC_WARPS, 1, mx, sl, sa);
    if (splits == 1) {
      kd_store(out + ((int64_t)h * g + j) * d + c, sa / sl);
    } else {
      float* p = part + (((int64_t)h * splits + s) * g + j) * (d + 2);
      if (c == 0) {
        p[0] = mx;
        p[1] = sl;
      }
      p[2 + c] = sa;
    }
  }
}

// part [kv, splits, g, d + 2] (m, l, acc[d] of each split) -> out [kv, g, d]. Grid (1, kv).
template <typename T>
__device__ void kd_decode_combine(const float* part, int splits, int g, int d, T* out) {
  const int h = blockIdx.y;
  const int step = g * (d + 2);
  for (int i = threadIdx.x; i < g * d; i += blockDim.x) {
    const int j = i / d, c = i % d;
    const float* p = part + ((int64_t)h * splits * g + j) * (d + 2);
    float mx, sl, sa;
    kd_softmax_merge(p, p + 1, p + 2 + c, splits, step, mx, sl, sa);
    kd_store(out + ((int64_t)h * g + j) * d + c, sa / sl);
  }
}

// keydiff_decode_kvq_<dtype>_<NE>: `kind` must be a KD_KVQ_* (the wrapper checks it) and d a
// multiple of 32.
#define KD_DECODE(SUFFIX, T, NE)                                                                  \
  extern "C" __global__ void __launch_bounds__(KD_DEC_THREADS) keydiff_decode_##SUFFIX##_##NE(   \
      const T* q, const T* k, int64_t k_hs, int64_t k_rs, const T* v, int64_t v_hs, int64_t v_rs, \
      int t, int g, int d, int span, float scale, T* out, float* part) {                          \
    const KdDecodeRows<T> rows{k, k_hs, k_rs, v, v_hs, v_rs};                                     \
    kd_decode<T, NE>(q, rows, t, g, d, span, scale, out, part);                                   \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(KD_DEC_THREADS)                                    \
      keydiff_decode_kvq_##SUFFIX##_##NE(const T* q, const uint8_t* k, int64_t k_hs, int64_t k_rs, \
                                         const uint8_t* v, int64_t v_hs, int64_t v_rs, int kind,  \
                                         int t, int g, int d, int span, float scale, T* out,      \
                                         float* part) {                                           \
    const KdDecodeBlockRows rows{k, k_hs, k_rs, v, v_hs, v_rs, kind, kd_kvq_bytes(kind)};        \
    kd_decode<T, NE>(q, rows, t, g, d, span, scale, out, part);                                   \
  }
#define KD_DECODE_DTYPE(SUFFIX, T)                                                                \
  KD_DECODE(SUFFIX, T, 2)                                                                         \
  KD_DECODE(SUFFIX, T, 4)                                                                         \
  KD_DECODE(SUFFIX, T, 8)                                                                         \
  extern "C" __global__ void __launch_bounds__(KD_DEC_THREADS) keydiff_decode_combine_##SUFFIX(  \
      const float* part, int splits, int g, int d, T* out) {                                      \
    kd_decode_combine<T>(part, splits, g, d, out);                                                \
  }
KD_DECODE_DTYPE(f32, float)
KD_DECODE_DTYPE(f16, __half)
KD_DECODE_DTYPE(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Causal softmax of a chunk's attention scores (eager attention on CUDA). The eager path ran it
// as four passes over a row of T scores per query row (a cast of q · kᵀ to f32, the mask added,
// softmax, and for the value product a cast back), writing an f32 copy of the scores twice; a
// chunk of 128 queries of Llama-3.1-8B over 8192 keys holds 34 M scores a layer. This is one
// launch that reads the scores in their dtype twice and writes the probabilities once, in the
// scores' dtype (for the value product) or in f32. Where a policy needs statistics,
// keydiff_softmax_state_* and keydiff_softmax_sums_* (below) run instead.
// Reference: `attention_probs` in crates/keydiff-model/src/attention.rs (softmax in f32 over
// the scores plus `chunk_mask`), which the CPU runs.
//
// s [rows, t] contiguous, rows = heads · chunk with row r the query at position r % chunk of
// the chunk, whose keys are the last `chunk` of t: it sees keys j < t - chunk + r % chunk + 1
// (bottom-right causal; with chunk = 1 all t). p [rows, t]: softmax in f32 over those, 0 past
// them. One block of KD_SMX_THREADS threads per row (grid.x = rows). Pass 1: each thread keeps
// the running max m of its scores and the sum l of e^(score - m) (an online softmax), the block
// merges them; pass 2 writes e^(score - m) / l. A NaN score makes its row NaN; a -inf score
// weighs 0.
#define KD_SMX_THREADS 256
#define KD_SMX_WARPS (KD_SMX_THREADS / 32)

// Adds the state (m2, l2) to (m, l): the larger max, the sums rescaled to it. A state holding
// no score is (-inf, 0); where both maxima are equal (both -inf too) nothing is rescaled.
__device__ __forceinline__ void kd_smx_merge(float& m, float& l, float m2, float l2) {
  const float mx = fmaxf(m, m2);
  const float a = m == mx ? 1.f : expf(m - mx);
  const float b = m2 == mx ? 1.f : expf(m2 - mx);
  l = l * a + l2 * b;
  m = mx;
}

// Keys the query at q of its chunk sees (bottom-right causal): j < t - chunk + q + 1.
__device__ __forceinline__ int kd_smx_seen(int t, int chunk, int q) { return t - chunk + q + 1; }

// Pass 1, block-wide over one row x: the max m of its first `seen` scores and the sum l of
// e^(score - m) (an online softmax per thread, then the warps', then the block's), the same in
// every thread.
template <typename TI>
__device__ void kd_smx_state(const TI* x, int seen, float& m_out, float& l_out) {
  __shared__ float sm_m[KD_SMX_WARPS], sm_l[KD_SMX_WARPS];
  float m = kd_neg_inf(), l = 0.f;
  for (int c = threadIdx.x; c < seen; c += KD_SMX_THREADS) {
    const float v = kd_to_f(x[c]);
    if (v > m) {
      l = l * expf(m - v) + 1.f;  // m = -inf: l = 0 · 0 + 1
      m = v;
    } else if (v != kd_neg_inf()) {
      l += expf(v - m);  // v NaN: l NaN
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
    kd_smx_merge(m, l, m2, l2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
  __syncthreads();
  // Every thread merges the warps' states in the same order, so all hold the same (m, l).
  m = sm_m[0];
  l = sm_l[0];
  for (int w = 1; w < KD_SMX_WARPS; ++w) kd_smx_merge(m, l, sm_m[w], sm_l[w]);
  m_out = m;
  l_out = l;
}

template <typename TI, typename TO>
__device__ void kd_causal_softmax(const TI* s, TO* p, int t, int chunk) {
  const int64_t row = blockIdx.x;
  const int seen = kd_smx_seen(t, chunk, (int)(row % chunk));
  const TI* x = s + row * t;
  TO* y = p + row * t;
  float m, l;
  kd_smx_state(x, seen, m, l);
  for (int c = threadIdx.x; c < t; c += KD_SMX_THREADS) {
    kd_store(&y[c], c < seen ? expf(kd_to_f(x[c]) - m) / l : 0.f);
  }
}

// keydiff_causal_softmax_<scores dtype>_<probabilities dtype>
#define KD_INSTANTIATE_SMX(SI, TI, SO, TO)                                                      \
  extern "C" __global__ void __launch_bounds__(KD_SMX_THREADS)                                  \
      keydiff_causal_softmax_##SI##_##SO(const TI* s, TO* p, int t, int chunk) {                \
    kd_causal_softmax<TI, TO>(s, p, t, chunk);                                                  \
  }

KD_INSTANTIATE_SMX(f32, float, f32, float)
KD_INSTANTIATE_SMX(f16, __half, f32, float)
KD_INSTANTIATE_SMX(f16, __half, f16, __half)
KD_INSTANTIATE_SMX(bf16, __nv_bfloat16, f32, float)
KD_INSTANTIATE_SMX(bf16, __nv_bfloat16, bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// The causal softmax with the statistics of TOVA, SnapKV and H2O: the probabilities of the
// last `stat_rows` queries of each query head summed per key, in f32 (`row_sums` in
// crates/keydiff-model/src/attention.rs over `attention_probs`, which the CPU runs). The
// one-launch softmax above would write the probabilities in f32 for candle to sum and cast
// (four passes over them); here they are summed as they are made, and written only for the
// value product, in its dtype (or not at all: flash attention's statistics pass).
//
// s [heads · chunk, t] contiguous, rows as for keydiff_causal_softmax (head h's queries are
// rows h · chunk ..). Two launches:
// 1. keydiff_softmax_state_<in>: the state (m, l) of every row, f32 [rows, 2] (pass 1 of the
//    softmax above, one block of KD_SMX_THREADS per row).
// 2. keydiff_softmax_sums_<in>_<out>: grid (ceil(t / KD_SMX_THREADS), heads), a thread per key:
//    it walks the head's queries in order (reading KD_SMX_BATCH of them at a time), writes each
//    probability e^(score - m) / l (0 where masked) to p when p is not null, and sums those of
//    the last stat_rows queries into stats [heads, t] (f32). Without p only those queries are
//    read. Consecutive threads read consecutive keys of a row: coalesced.
template <typename TI>
__device__ void kd_softmax_state(const TI* s, float* state, int t, int chunk) {
  const int64_t row = blockIdx.x;
  float m, l;
  kd_smx_state(s + row * t, kd_smx_seen(t, chunk, (int)(row % chunk)), m, l);
  if (threadIdx.x == 0) {
    state[2 * row] = m;
    state[2 * row + 1] = l;
  }
}

// Queries a thread of keydiff_softmax_sums_* reads before it computes with them (loads in
// flight together).
#define KD_SMX_BATCH 4

template <typename TI, typename TO>
__device__ void kd_softmax_sums(const TI* __restrict__ s, const float* __restrict__ state,
                                TO* __restrict__ p, float* __restrict__ stats, int t, int chunk,
                                int stat_rows) {
  const int64_t head = blockIdx.y;
  const int c = blockIdx.x * KD_SMX_THREADS + threadIdx.x;
  if (c >= t) return;
  const int counted = chunk - stat_rows;
  float acc = 0.f;
  for (int q0 = p != nullptr ? 0 : counted; q0 < chunk; q0 += KD_SMX_BATCH) {
    float x[KD_SMX_BATCH];
    for (int b = 0; b < KD_SMX_BATCH; ++b) {
      const int q = q0 + b;
      const bool read = q < chunk && c < kd_smx_seen(t, chunk, q);
      x[b] = read ? kd_to_f(s[(head * chunk + q) * t + c]) : 0.f;
    }
    for (int b = 0; b < KD_SMX_BATCH && q0 + b < chunk; ++b) {
      const int q = q0 + b;
      const int64_t row = head * chunk + q;
      const float v =
          c < kd_smx_seen(t, chunk, q) ? expf(x[b] - state[2 * row]) / state[2 * row + 1] : 0.f;
      if (p != nullptr) kd_store(&p[row * t + c], v);
      if (q >= counted) acc += v;
    }
  }
  stats[head * t + c] = acc;
}

#define KD_INSTANTIATE_SMX_STATE(SI, TI)                                                        \
  extern "C" __global__ void __launch_bounds__(KD_SMX_THREADS)                                  \
      keydiff_softmax_state_##SI(const TI* s, float* state, int t, int chunk) {                 \
    kd_softmax_state<TI>(s, state, t, chunk);                                                   \
  }
#define KD_INSTANTIATE_SMX_SUMS(SI, TI, SO, TO)                                                 \
  extern "C" __global__ void __launch_bounds__(KD_SMX_THREADS)                                  \
      keydiff_softmax_sums_##SI##_##SO(const TI* s, const float* state, TO* p, float* stats,    \
                                       int t, int chunk, int stat_rows) {                       \
    kd_softmax_sums<TI, TO>(s, state, p, stats, t, chunk, stat_rows);                           \
  }

KD_INSTANTIATE_SMX_STATE(f32, float)
KD_INSTANTIATE_SMX_STATE(f16, __half)
KD_INSTANTIATE_SMX_STATE(bf16, __nv_bfloat16)
KD_INSTANTIATE_SMX_SUMS(f32, float, f32, float)
KD_INSTANTIATE_SMX_SUMS(f16, __half, f32, float)
KD_INSTANTIATE_SMX_SUMS(f16, __half, f16, __half)
KD_INSTANTIATE_SMX_SUMS(bf16, __nv_bfloat16, f32, float)
KD_INSTANTIATE_SMX_SUMS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Residual add and RMSNorm in one launch (vLLM's fused_add_rms_norm): a layer's hidden state x
// plus a block's output r, and the next block's norm of that sum. candle runs them as two
// launches (x + r, then rms_norm), which at decode, one row, cost a launch each for a few KB.
// Reference: `x + r` then candle's `rms_norm` (crates/keydiff-model/src/model.rs, RmsNorm),
// which the CPU runs: the sum is rounded to T, and the norm is taken of the rounded sum,
// (scale · s) · w with scale = rsqrt(mean(s²) + eps), as candle's kernel computes it.
//
// x, r [rows, cols] contiguous, w [cols]; out [2, rows, cols]: out[0] = T(x + r), out[1] =
// T(scale · s · w). One block of KD_NORM_THREADS threads per row (grid.x = rows); a thread
// reads back only the sums it wrote.
#define KD_NORM_THREADS 256

template <typename T>
__device__ void kd_add_rms_norm(const T* x, const T* r, const T* w, T* out, int rows, int cols,
                                float eps) {
  __shared__ float warp_sums[KD_NORM_THREADS / 32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const T* rr = r + row * cols;
  T* s = out + row * cols;
  T* y = out + ((int64_t)rows + row) * cols;
  float ss = 0.f;
  for (int c = threadIdx.x; c < cols; c += KD_NORM_THREADS) {
    kd_store(&s[c], kd_to_f(xr[c]) + kd_to_f(rr[c]));
    const float v = kd_to_f(s[c]);
    ss += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < KD_NORM_THREADS / 32; ++i) total += warp_sums[i];
  const float scale = rsqrtf(total / cols + eps);
  for (int c = threadIdx.x; c < cols; c += KD_NORM_THREADS) {
    kd_store(&y[c], scale * kd_to_f(s[c]) * kd_to_f(w[c]));
  }
}

#define KD_INSTANTIATE_NORM(SUFFIX, T)                                                          \
  extern "C" __global__ void __launch_bounds__(KD_NORM_THREADS) keydiff_add_rms_norm_##SUFFIX(  \
      const T* x, const T* r, const T* w, T* out, int rows, int cols, float eps) {              \
    kd_add_rms_norm<T>(x, r, w, out, rows, cols, eps);                                          \
  }

KD_INSTANTIATE_NORM(f32, float)
KD_INSTANTIATE_NORM(f16, __half)
KD_INSTANTIATE_NORM(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// SwiGLU's product silu(gate) · up in one launch (candle runs silu, then the product). Reference:
// `gate.silu() * up` (crates/keydiff-model/src/model.rs, Mlp), which the CPU runs: silu(g) =
// g / (1 + e^-g). Here in f32 from the inputs' values, rounded to T once (candle rounds silu's
// result and then the product in bf16/f16).
//
// gate, up [rows, cols] views with rows contiguous (the halves of a fused gate/up matmul's
// output are at a row stride of 2 · cols); out [rows, cols] contiguous. A grid-stride loop over
// the rows · cols values, KD_ACT_THREADS threads a block.
#define KD_ACT_THREADS 256

template <typename T>
__device__ void kd_silu_mul(const T* gate, int64_t gate_rs, const T* up, int64_t up_rs, T* out,
                            int64_t rows, int cols) {
  const int64_t n = rows * cols;
  for (int64_t i = (int64_t)blockIdx.x * KD_ACT_THREADS + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * KD_ACT_THREADS) {
    const int64_t r = i / cols, c = i % cols;
    const float g = kd_to_f(gate[r * gate_rs + c]);
    const float u = kd_to_f(up[r * up_rs + c]);
    kd_store(&out[i], g / (1.f + expf(-g)) * u);
  }
}

#define KD_INSTANTIATE_ACT(SUFFIX, T)                                                           \
  extern "C" __global__ void __launch_bounds__(KD_ACT_THREADS) keydiff_silu_mul_##SUFFIX(       \
      const T* gate, int64_t gate_rs, const T* up, int64_t up_rs, T* out, int64_t rows,         \
      int cols) {                                                                               \
    kd_silu_mul<T>(gate, gate_rs, up, up_rs, out, rows, cols);                                  \
  }

KD_INSTANTIATE_ACT(f32, float)
KD_INSTANTIATE_ACT(f16, __half)
KD_INSTANTIATE_ACT(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// RoPE of a chunk's queries and keys in one launch. candle takes four: a contiguous copy of each
// from the projection's output ([B, heads, d] → [heads, B, d]), then its rope kernel on each.
// Reference: candle_nn::rotary_emb::rope / rope_i on those copies (crates/keydiff-model/src/
// rope.rs, Rope::apply), which the CPU runs in T: out1 = x1·c − x2·s, out2 = x1·s + x2·c, each
// product and the sum rounded to T (half's operators). Here the products of two T values are
// exact in f32 and rounded to T once, and so is the sum of two of them (f32 holds at least
// 2p + 2 bits of a p-bit T, so rounding through it is the same as rounding once): the CPU's
// values, bit for bit. candle's CUDA kernel may be an ulp off both, since PTX may fuse its
// multiplies (mul.bf16 / mul.f16 without .rn) into the sum. For f32 the expression is the
// same, which nvcc may contract to FMAs as it does candle's.
//
// q: [B, hq, d] at element strides (q_rs, q_hs) (each head's d values contiguous), k: [B, hk, d]
// at (k_rs, k_hs): the projections' outputs, or [heads, B, d] tensors given as such strides.
// cos, sin: [B, d / 2] contiguous. out: [hq + hk, B, d] contiguous, q's heads then k's.
// interleaved: pairs (2j, 2j + 1) (rope_i, GGUF Llama); else (j, j + d / 2). One thread per
// pair, a grid-stride loop over the (hq + hk) · B · d / 2 pairs.
#define KD_ROPE_THREADS 256

__device__ __forceinline__ float kd_round(float x, const float*) { return x; }
__device__ __forceinline__ float kd_round(float x, const __half*) {
  return __half2float(__float2half_rn(x));
}
__device__ __forceinline__ float kd_round(float x, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

template <typename T>
__device__ void kd_rope_qk(const T* q, int64_t q_rs, int64_t q_hs, const T* k, int64_t k_rs,
                           int64_t k_hs, const T* cos, const T* sin, T* out, int hq, int hk,
                           int b, int d, int interleaved) {
  const int half = d / 2;
  const int64_t pairs = (int64_t)(hq + hk) * b * half;
  for (int64_t i = (int64_t)blockIdx.x * KD_ROPE_THREADS + threadIdx.x; i < pairs;
       i += (int64_t)gridDim.x * KD_ROPE_THREADS) {
    const int j = (int)(i % half);
    const int64_t row = i / half;
    const int t = (int)(row % b), h = (int)(row / b);
    const T* x = h < hq ? q + t * q_rs + h * q_hs : k + t * k_rs + (h - hq) * k_hs;
    T* y = out + row * d;
    const int i1 = interleaved ? 2 * j : j, i2 = interleaved ? 2 * j + 1 : j + half;
    const float c = kd_to_f(cos[t * half + j]), s = kd_to_f(sin[t * half + j]);
    const float x1 = kd_to_f(x[i1]), x2 = kd_to_f(x[i2]);
    kd_store(&y[i1], kd_round(x1 * c, y) - kd_round(x2 * s, y));
    kd_store(&y[i2], kd_round(x1 * s, y) + kd_round(x2 * c, y));
  }
}

#define KD_INSTANTIATE_ROPE(SUFFIX, T)                                                          \
  extern "C" __global__ void __launch_bounds__(KD_ROPE_THREADS) keydiff_rope_qk_##SUFFIX(       \
      const T* q, int64_t q_rs, int64_t q_hs, const T* k, int64_t k_rs, int64_t k_hs,         \
      const T* cos, const T* sin, T* out, int hq, int hk, int b, int d, int interleaved) {    \
    kd_rope_qk<T>(q, q_rs, q_hs, k, k_rs, k_hs, cos, sin, out, hq, hk, b, d, interleaved);    \
  }

KD_INSTANTIATE_ROPE(f32, float)
KD_INSTANTIATE_ROPE(f16, __half)
KD_INSTANTIATE_ROPE(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Greedy sampling on the device: the index of each row's largest value, so that a greedy decode
// step reads 4 bytes a request back to the host instead of its whole row of logits. Reference:
// `argmax` of crates/keydiff-model/src/decode_kernel.rs (the host sampler's greedy choice, and
// `argmax_rows`' CPU path): the first index of the largest value, NaNs skipped, and 0 when the
// row's first value is NaN (what a scan keeping `x > best` gives). Equal values keep the lower
// index, so the answer does not depend on the thread schedule.
//
// x: [rows, cols] at element row stride x_rs (rows contiguous); out: [rows] u32. One block of
// KD_ARGMAX_THREADS threads a row: each thread scans a strided part of the row in ascending
// order, then a warp shuffle and a pass over the warps' winners.
#define KD_ARGMAX_THREADS 1024
#define KD_ARGMAX_NONE 0xFFFFFFFFu

// Whether (v, i) is to be preferred to (bv, bi): a number beats nothing, a larger value beats a
// smaller one, and of two equal values the lower index wins.
__device__ __forceinline__ bool kd_argmax_better(float v, unsigned i, float bv, unsigned bi) {
  if (i == KD_ARGMAX_NONE || isnan(v)) return false;
  return bi == KD_ARGMAX_NONE || v > bv || (v == bv && i < bi);
}

template <typename T>
__device__ void kd_argmax_rows(const T* x, int64_t x_rs, unsigned* out, int cols) {
  __shared__ float s_val[KD_ARGMAX_THREADS / 32];
  __shared__ unsigned s_idx[KD_ARGMAX_THREADS / 32];
  const T* row = x + (int64_t)blockIdx.x * x_rs;
  float bv = 0.f;
  unsigned bi = KD_ARGMAX_NONE;
  for (int c = threadIdx.x; c < cols; c += KD_ARGMAX_THREADS) {
    const float v = kd_to_f(row[c]);
    if (kd_argmax_better(v, (unsigned)c, bv, bi)) {
      bv = v;
      bi = (unsigned)c;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (kd_argmax_better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_val[warp] = bv;
    s_idx[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    bv = lane < KD_ARGMAX_THREADS / 32 ? s_val[lane] : 0.f;
    bi = lane < KD_ARGMAX_THREADS / 32 ? s_idx[lane] : KD_ARGMAX_NONE;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (kd_argmax_better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) out[blockIdx.x] = bi == KD_ARGMAX_NONE || isnan(kd_to_f(row[0])) ? 0u : bi;
  }
}

#define KD_INSTANTIATE_ARGMAX(SUFFIX, T)                                                        \
  extern "C" __global__ void __launch_bounds__(KD_ARGMAX_THREADS) keydiff_argmax_rows_##SUFFIX( \
      const T* x, int64_t x_rs, unsigned* out, int cols) {                                      \
    kd_argmax_rows<T>(x, x_rs, out, cols);                                                      \
  }

KD_INSTANTIATE_ARGMAX(f32, float)
KD_INSTANTIATE_ARGMAX(f16, __half)
KD_INSTANTIATE_ARGMAX(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Sampling on the device: each row's token drawn as the host sampler draws it (temperature,
// top-k, top-p, min-p) from the uniform r the host drew for it, so that a sampled decode step
// reads 4 bytes a request back instead of its row of logits, and the host does not sort a
// vocabulary. Reference: `keydiff_model::model::draw` (crates/keydiff-model/src/sample.rs),
// which walks the finite logits in their order (largest first, equal values by index) and keeps
//   1. the k first (top-k, when 0 < k < their count);
//   2. of those, the shortest head whose weights exp((l - max) / Tc) sum to at least top_p of
//      all of theirs (top-p, when top_p < 1);
//   3. of those, the ones with exp((l - max) / Tc) >= min_p, the first always (min-p, when > 0);
// then draws the first whose running sum of exp((l - max) / T) passes r times their sum. Tc,
// the truncations' temperature, is 1 (llama.cpp's order: temperature after top-p and min-p) or
// T (vLLM's and Hugging Face's: before).
// Each step keeps a head of that order, so each is a select over 64-bit keys (the logit's
// order bits, largest first; then the index): a radix select of 8-bit digits whose histogram
// counts (top-k) or sums the weights (top-p, the draw) of the keys kept so far. Weights are
// summed in fixed point, units of 2^-44, in exact integer sums: the token does not depend on
// the thread schedule, and each sum is within n · 2^-45 of the host's f64 sums (the largest
// weight is 1). min-p's test is the host's, in f64. A row with no finite logit has no draw:
// its token is the host's argmax, flagged with KD_SAMPLE_NO_DRAW so that the host can give r
// back. A temperature <= 0 (or NaN) is greedy: the argmax (`kd_argmax_better`'s order).
//
// x: [rows, cols] at element row stride x_rs (rows contiguous); params: [rows, 6] words
// (temperature, top_k, top_p, min_p, r, Tc; the floats as their bits); out: [rows] u32. One block
// of KD_SAMPLE_THREADS threads a row; cols <= 2^20, so that a sum of weights (each at most 2^44
// units) fits 64 bits.
#define KD_SAMPLE_THREADS 1024
#define KD_SAMPLE_NO_DRAW 0x80000000u
#define KD_SAMPLE_UNIT 17592186044416.0  // 2^44: a weight of 1 in fixed point

// The order of the host's candidates as one ascending 64-bit key: larger logits first (by
// their bits, so -0 after +0, as `f32::total_cmp`), then lower indices.
__device__ __forceinline__ unsigned long long kd_sample_key(float l, unsigned i) {
  const unsigned b = __float_as_uint(l);
  const unsigned desc = (b & 0x80000000u) ? b : b ^ 0x7fffffffu;  // descending with l
  return ((unsigned long long)desc << 32) | i;
}

// exp((l - mx) / t) in units of 2^-44, rounded (l <= mx: at most 2^44).
__device__ __forceinline__ unsigned long long kd_sample_units(float l, float mx, double t) {
  return (unsigned long long)(exp((double)(l - mx) / t) * KD_SAMPLE_UNIT + 0.5);
}

struct KdSampleShared {
  unsigned long long hist[256];
  unsigned long long prefix;
  unsigned long long kmin;
  unsigned count, argmax;
  unsigned long long warp_kmin[KD_SAMPLE_THREADS / 32];
  unsigned warp_count[KD_SAMPLE_THREADS / 32];
  float warp_val[KD_SAMPLE_THREADS / 32];
  unsigned warp_idx[KD_SAMPLE_THREADS / 32];
};

// The first key, in ascending order, at which the kept keys' running count (mode 0) reaches
// `goal`, or their running weight exp((l - mx) / t) reaches (mode 1) or passes (mode 2) `goal`
// times their total. Kept: finite, key <= cut, and with `minp` exp((l - mx) / tc) >= min_p or
// the first key `kmin`. Where rounding leaves the goal past every key, the last kept key (the
// host's walk ends there too). Digits of the index above `top_shift` are 0 for every key.
template <typename T>
__device__ unsigned long long kd_sample_select(const T* row, int cols, int top_shift,
                                               unsigned long long cut, bool minp, double min_p,
                                               double tc, unsigned long long kmin, float mx,
                                               int mode, double t, double goal,
                                               KdSampleShared& sh) {
  const int lane = threadIdx.x % 32;
  unsigned long long prefix = 0, mask = 0, before = 0;
  double target = goal;
  for (int shift = 56; shift >= 0; shift -= 8) {
    if (shift < 32 && shift > top_shift) {
      mask |= 255ull << shift;
      continue;
    }
    for (int b = threadIdx.x; b < 256; b += KD_SAMPLE_THREADS) sh.hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < cols; base += KD_SAMPLE_THREADS) {
      const int i = base + threadIdx.x;
      bool in = false;
      unsigned bin = 0;
      unsigned long long w = 0;
      if (i < cols) {
        const float l = kd_to_f(row[i]);
        const unsigned long long k = kd_sample_key(l, (unsigned)i);
        if (isfinite(l) && (k & mask) == prefix && k <= cut &&
            (!minp || k == kmin || exp((double)(l - mx) / tc) >= min_p)) {
          in = true;
          bin = (unsigned)(k >> shift) & 255u;
          if (mode != 0) w = kd_sample_units(l, mx, t);
        }
      }
      if (mode == 0) {
        // Counts: one atomic per bin a warp touches (logits crowd into few top digits).
        const unsigned peers = __match_any_sync(0xffffffffu, in ? bin : 256u);
        if (in && __ffs(peers) - 1 == lane)
          atomicAdd(&sh.hist[bin], (unsigned long long)__popc(peers));
      } else if (in) {
        atomicAdd(&sh.hist[bin], w);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (shift == 56 && mode != 0) {
        unsigned long long total = 0;
        for (int j = 0; j < 256; ++j) total += sh.hist[j];
        target = goal * (double)total;
      }
      int chosen = -1, last = -1;
      for (int j = 0; j < 256; ++j) {
        const unsigned long long h = sh.hist[j];
        if (h == 0) continue;
        last = j;
        const double cum = (double)(before + h);
        if (mode == 0 ? cum >= goal : mode == 1 ? cum >= target : target < cum) {
          chosen = j;
          break;
        }
        before += h;
      }
      if (chosen < 0 && last >= 0) {
        chosen = last;
        before -= sh.hist[last];
      }
      sh.prefix = prefix | ((unsigned long long)max(chosen, 0) << shift);
    }
    __syncthreads();
    prefix = sh.prefix;
    mask |= 255ull << shift;
  }
  return prefix;
}

template <typename T>
__device__ void kd_sample_rows(const T* x, int64_t x_rs, const unsigned* params, unsigned* out,
                               int cols) {
  __shared__ KdSampleShared sh;
  const T* row = x + (int64_t)blockIdx.x * x_rs;
  const unsigned* p = params + 6 * (int64_t)blockIdx.x;
  const float temperature = __uint_as_float(p[0]);
  const unsigned top_k = p[1];
  const float top_p = __uint_as_float(p[2]), min_p = __uint_as_float(p[3]);
  const float r = __uint_as_float(p[4]);
  const double tc = (double)__uint_as_float(p[5]);
  // The finite logits' count and first key, and the argmax (greedy, or a row without a draw).
  unsigned n = 0, bi = KD_ARGMAX_NONE;
  unsigned long long kmin = ~0ull;
  float bv = 0.f;
  for (int c = threadIdx.x; c < cols; c += KD_SAMPLE_THREADS) {
    const float v = kd_to_f(row[c]);
    if (kd_argmax_better(v, (unsigned)c, bv, bi)) {
      bv = v;
      bi = (unsigned)c;
    }
    if (isfinite(v)) {
      ++n;
      const unsigned long long k = kd_sample_key(v, (unsigned)c);
      kmin = k < kmin ? k : kmin;
    }
  }
  for (int o = 16; o >= 1; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (kd_argmax_better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
    n += __shfl_xor_sync(0xffffffffu, n, o);
    const unsigned long long ok = __shfl_xor_sync(0xffffffffu, kmin, o);
    kmin = ok < kmin ? ok : kmin;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sh.warp_val[warp] = bv;
    sh.warp_idx[warp] = bi;
    sh.warp_count[warp] = n;
    sh.warp_kmin[warp] = kmin;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < KD_SAMPLE_THREADS / 32; ++w) {
      if (kd_argmax_better(sh.warp_val[w], sh.warp_idx[w], bv, bi)) {
        bv = sh.warp_val[w];
        bi = sh.warp_idx[w];
      }
      n += sh.warp_count[w];
      kmin = sh.warp_kmin[w] < kmin ? sh.warp_kmin[w] : kmin;
    }
    sh.count = n;
    sh.kmin = kmin;
    sh.argmax = bi == KD_ARGMAX_NONE || isnan(kd_to_f(row[0])) ? 0u : bi;
  }
  __syncthreads();
  const unsigned count = sh.count;
  kmin = sh.kmin;
  const bool greedy = !(temperature > 0.f);  // NaN too, as `sample_rows`' CPU path
  if (greedy || count == 0) {
    if (threadIdx.x == 0) out[blockIdx.x] = sh.argmax | (greedy ? 0u : KD_SAMPLE_NO_DRAW);
    return;
  }
  const float mx = kd_to_f(row[(unsigned)kmin]);
  const unsigned last_id = (unsigned)cols - 1;
  const int top_shift = last_id < (1u << 8) ? 0 : last_id < (1u << 16) ? 8 : last_id < (1u << 24) ? 16 : 24;
  unsigned long long cut = ~0ull;
  if (top_k > 0 && top_k < count)
    cut = kd_sample_select(row, cols, top_shift, cut, false, 0.0, 1.0, kmin, mx, 0, 1.0,
                           (double)top_k, sh);
  if (top_p < 1.f)
    cut = kd_sample_select(row, cols, top_shift, cut, false, 0.0, 1.0, kmin, mx, 1, tc,
                           (double)top_p, sh);
  const unsigned long long k = kd_sample_select(row, cols, top_shift, cut, min_p > 0.f,
                                                (double)min_p, tc, kmin, mx, 2,
                                                (double)temperature, (double)r, sh);
  if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)k;
}

#define KD_INSTANTIATE_SAMPLE(SUFFIX, T)                                                        \
  extern "C" __global__ void __launch_bounds__(KD_SAMPLE_THREADS) keydiff_sample_rows_##SUFFIX( \
      const T* x, int64_t x_rs, const unsigned* params, unsigned* out, int cols) {              \
    kd_sample_rows<T>(x, x_rs, params, out, cols);                                              \
  }

KD_INSTANTIATE_SAMPLE(f32, float)
KD_INSTANTIATE_SAMPLE(f16, __half)
KD_INSTANTIATE_SAMPLE(bf16, __nv_bfloat16)
