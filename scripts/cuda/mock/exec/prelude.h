// Included first (g++ -include) when build.sh compiles a kernel source for the executing mock
// (MOCKCUDA_EXEC, see runtime.cpp): the toolkit's half, bfloat16 and fp8 types (their headers
// compile for the host, with operators and conversions), then the CPU emulation of the CUDA
// execution model (kernels/emu/cuda_emu.h), then the device intrinsics the kernels call that
// those headers declare for the device only.
//
// __CUDA_ARCH__ is defined after the toolkit's headers (which would otherwise take their
// device-only inline-PTX paths) so that candle's `#if __CUDA_ARCH__ >= 800` kernels (bf16,
// fp8) exist, as in the sm_90 build.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <cmath>
#include <limits>

// The toolkit's host_defines.h gives these attributes; the emulation's are plain.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define KD_EMU_REAL_FP_TYPES 1
#include "cuda_emu.h"

#define __CUDA_ARCH__ 900
#define __CUDACC_VER_MAJOR__ 13
#define __CUDACC_VER_MINOR__ 0
#define __restrict__ __restrict

// int64_t and uint64_t are long here, which the emulation's overloads (int, unsigned,
// long long) leave ambiguous.
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }

// CUDA's mixed overloads compare as unsigned.
inline unsigned min(unsigned a, int b) { return a < (unsigned)b ? a : (unsigned)b; }
inline unsigned min(int a, unsigned b) { return (unsigned)a < b ? (unsigned)a : b; }
inline unsigned max(unsigned a, int b) { return a > (unsigned)b ? a : (unsigned)b; }
inline unsigned max(int a, unsigned b) { return (unsigned)a > b ? (unsigned)a : b; }

// Byte-wise integer SIMD (candle's quantized matmuls).
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
  return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
  for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
  return c;
}
inline int __vsubss4(int a, int b) {
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    int d = (int)(int8_t)(a >> (8 * i)) - (int)(int8_t)(b >> (8 * i));
    d = d < -128 ? -128 : (d > 127 ? 127 : d);
    r |= ((unsigned)d & 0xffu) << (8 * i);
  }
  return (int)r;
}
inline unsigned __vsub4(unsigned a, unsigned b) {
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xffu) << (8 * i);
  return r;
}
inline unsigned __vcmpne4(unsigned a, unsigned b) {
  unsigned r = 0;
  for (int i = 0; i < 4; ++i)
    if (((a >> (8 * i)) & 0xffu) != ((b >> (8 * i)) & 0xffu)) r |= 0xffu << (8 * i);
  return r;
}
// Byte i of the result is byte (s >> 4i) & 7 of the eight of {y, x} (x the low four).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long xy = (unsigned long long)y << 32 | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
inline void __trap() { ::kd_emu::fail("__trap() reached (a device-side assertion or NO_DEVICE_CODE)"); }

// Device math on the half types, through f32 (as the device's own conversions).
#define KX_HALF_FN(NAME, F)                                                  \
  inline __half NAME(__half a) { return __float2half(F(__half2float(a))); } \
  inline __nv_bfloat16 NAME(__nv_bfloat16 a) { return __float2bfloat16(F(__bfloat162float(a))); }
KX_HALF_FN(hexp, expf)
KX_HALF_FN(hlog, logf)
KX_HALF_FN(hsqrt, sqrtf)
KX_HALF_FN(hsin, sinf)
KX_HALF_FN(hcos, cosf)
KX_HALF_FN(hrsqrt, 1.0f / sqrtf)
#undef KX_HALF_FN

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * (float)M_SQRT1_2); }
inline double normcdf(double x) { return 0.5 * erfc(-x * M_SQRT1_2); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline int __float_as_int(float x) { return (int)kd_emu::f2u(x); }
inline float __int_as_float(int x) { return kd_emu::u2f((uint32_t)x); }
inline long long __double_as_longlong(double x) {
  long long r;
  memcpy(&r, &x, 8);
  return r;
}
inline double __longlong_as_double(long long x) {
  double r;
  memcpy(&r, &x, 8);
  return r;
}
inline void __threadfence_block() {}
// A warp-wide meeting point, as the device's: every lane must reach it (the emulation's
// warp-synchronous check), and none goes on before all have.
#define __syncwarp(...) ((void)::kd_emu::ballot(0xffffffffu, 0, __FILE__, __LINE__))

// Atomics: threads switch only at synchronisation points, so a read-modify-write is atomic.
#define KX_ATOMIC(NAME, T, EXPR)          \
  inline T NAME(T* a, T v) {              \
    const T old = *a;                     \
    *a = EXPR;                            \
    return old;                           \
  }
KX_ATOMIC(atomicAdd, int, old + v)
KX_ATOMIC(atomicAdd, double, old + v)
KX_ATOMIC(atomicAdd, __half, __float2half(__half2float(old) + __half2float(v)))
KX_ATOMIC(atomicAdd, __nv_bfloat16, __float2bfloat16(__bfloat162float(old) + __bfloat162float(v)))
KX_ATOMIC(atomicMax, int, old > v ? old : v)
KX_ATOMIC(atomicMax, unsigned, old > v ? old : v)
KX_ATOMIC(atomicMin, int, old < v ? old : v)
KX_ATOMIC(atomicMin, unsigned, old < v ? old : v)
KX_ATOMIC(atomicMax, long long, old > v ? old : v)
KX_ATOMIC(atomicMax, unsigned long long, old > v ? old : v)
KX_ATOMIC(atomicMin, long long, old < v ? old : v)
KX_ATOMIC(atomicMin, unsigned long long, old < v ? old : v)
KX_ATOMIC(atomicExch, unsigned, v)
KX_ATOMIC(atomicExch, int, v)
KX_ATOMIC(atomicExch, float, v)
#undef KX_ATOMIC
inline unsigned atomicCAS(unsigned* a, unsigned cmp, unsigned v) {
  const unsigned old = *a;
  if (old == cmp) *a = v;
  return old;
}
inline int atomicCAS(int* a, int cmp, int v) {
  const int old = *a;
  if (old == cmp) *a = v;
  return old;
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long cmp,
                                    unsigned long long v) {
  const unsigned long long old = *a;
  if (old == cmp) *a = v;
  return old;
}
inline unsigned short atomicCAS(unsigned short* a, unsigned short cmp, unsigned short v) {
  const unsigned short old = *a;
  if (old == cmp) *a = v;
  return old;
}

// candle passes the width (always 32, the only one the emulation has).
#undef __shfl_xor_sync
#undef __shfl_sync
#undef __shfl_up_sync
#define __shfl_xor_sync(m, x, o, ...) ::kd_emu::shfl_xor((m), (x), (o), __FILE__, __LINE__)
#define __shfl_sync(m, x, l, ...) ::kd_emu::shfl((m), (x), (l), __FILE__, __LINE__)
#define __shfl_up_sync(m, x, d, ...) ::kd_emu::shfl_up((m), (x), (d), __FILE__, __LINE__)

// The host launch code (kept for the kernels it instantiates, never run here) raises a
// kernel's shared memory limit through the runtime's C++ overload.
template <typename... A>
inline int cudaFuncSetAttribute(void (*)(A...), int, int) {
  return 0;
}

// Warp-wide reductions (sm_80), over the warp exchange.
#define __reduce_add_sync(m, x) ::kx_reduce_sync((m), (x), 0, __FILE__, __LINE__)
#define __reduce_max_sync(m, x) ::kx_reduce_sync((m), (x), 1, __FILE__, __LINE__)
template <typename T>
inline T kx_reduce_sync(unsigned mask, T x, int max, const char* file, int line) {
  static_assert(sizeof(T) == 4, "__reduce_*_sync takes 32-bit integers");
  const uint64_t* v = ::kd_emu::warp_exchange(mask, (uint64_t)(uint32_t)x, "__reduce_*_sync", file, line);
  T r = (T)(uint32_t)v[0];
  uint32_t sum = (uint32_t)v[0];  // wraps, as the device's
  for (int l = 1; l < ::kd_emu::kWarp; ++l) {
    const T y = (T)(uint32_t)v[l];
    r = y > r ? y : r;
    sum += (uint32_t)v[l];
  }
  return max ? r : (T)sum;
}

// Dynamic shared memory (`extern __shared__ T name[];` is rewritten by build.sh to a pointer
// from here): the launch's bytes, one buffer per OS thread, reused by the blocks that run one
// after another on it.
extern "C" void* kx_dynamic_shared();

// Inline PTX (hostify.py rewrites `asm(...)` of the runtime-launched kernels to this): the
// operands' bits, and the instruction run by runtime.cpp over the warp exchange.
#include <initializer_list>
template <typename T>
inline unsigned long long kx_bits(const T& v) {
  static_assert(sizeof(T) <= 8, "an asm operand wider than 64 bits");
  unsigned long long r = 0;
  memcpy(&r, &v, sizeof(T));
  return r;
}
void kx_asm(const char* ptx, const char* out_kinds, std::initializer_list<void*> outs,
            std::initializer_list<unsigned long long> ins, const char* file, int line);
// hostify.py's stand-in for a launch in host code: keeps the kernel's instantiation (and so
// its symbol) in the library.
extern "C" void kx_keep(const void* kernel);
