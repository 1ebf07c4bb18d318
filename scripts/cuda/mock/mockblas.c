// Stand-ins for cuBLAS, cuRAND and NVRTC beside the mock driver (mockcuda.c): the calls candle's
// CUDA backend makes, checked as the real libraries check them, doing no arithmetic (but the
// matmuls, when MOCKCUDA_EXEC is set: the executing mock, see mockcuda.c). A matmul
// must have non-negative sizes, leading dimensions the library accepts, and every operand
// inside a live device allocation; a random fill must stay inside its buffer. build.sh
// compiles this file once per library (-DMOCK_CUBLAS, -DMOCK_CURAND, -DMOCK_NVRTC) and adds a
// refusing stub for every other symbol the real library exports.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mockcommon.h"

// In the mock driver (libcuda.so.1): is [p, p + bytes) inside one live allocation?
int mock_device_range(uintptr_t p, size_t bytes);

static int dummy_handle;

// The executing mock (MOCKCUDA_EXEC set to a folder; see mockcuda.c): compute, not just check.
static int executing(void) {
  const char* e = getenv("MOCKCUDA_EXEC");
  return e && *e;
}

#ifdef MOCK_CUBLAS
enum { OK = 0, INVALID_VALUE = 7 };

// cudaDataType_t: bytes of one element (0: a type the stand-in does not know).
static size_t elem_bytes(int t) {
  switch (t) {
    case 0: return 4;   // CUDA_R_32F
    case 1: return 8;   // CUDA_R_64F
    case 2: return 2;   // CUDA_R_16F
    case 3: return 1;   // CUDA_R_8I
    case 10: return 4;  // CUDA_R_32I
    case 14: return 2;  // CUDA_R_16BF
    case 28: return 1;  // CUDA_R_8F_E4M3
    case 29: return 1;  // CUDA_R_8F_E5M2
    default: return 0;
  }
}

// An operand of `rows` × `cols` (column-major, leading dimension ld), `batch` of them `stride`
// elements apart: its last element must be in the same live allocation as its first.
static int operand(const char* fn, const char* name, const void* p, long long rows, long long cols,
                   long long ld, long long stride, long long batch, size_t es) {
  if (rows == 0 || cols == 0 || batch == 0) return OK;
  if (!p) return mock_error(INVALID_VALUE, "%s: %s is null", fn, name);
  if (stride < 0) return mock_error(INVALID_VALUE, "%s: %s has a negative stride %lld", fn, name, stride);
  long long a, b, last;
  unsigned long long bytes;
  if (__builtin_mul_overflow(cols - 1, ld, &a) || __builtin_mul_overflow(batch - 1, stride, &b) ||
      __builtin_add_overflow(a, b, &last) || __builtin_add_overflow(last, rows, &last) ||
      __builtin_mul_overflow((unsigned long long)last, (unsigned long long)es, &bytes))
    return mock_error(INVALID_VALUE, "%s: %s's extent overflows (ld %lld, stride %lld, batch %lld)", fn, name, ld,
                      stride, batch);
  if (!mock_device_range((uintptr_t)p, (size_t)bytes))
    return mock_error(INVALID_VALUE,
                      "%s: %s (%lld × %lld, ld %lld, %lld × stride %lld, %zu-byte elements) leaves its "
                      "device allocation",
                      fn, name, rows, cols, ld, batch, stride, es);
  return OK;
}

// cuBLAS's checks of a gemm (column-major C = op(A) op(B)), then the operands' extents.
static unsigned long long n_gemm;

__attribute__((destructor)) static void report(void) {
  FILE* out = mock_log();
  if (!out) return;
  fprintf(out, "calls gemm %llu\n", n_gemm);
  fclose(out);
}

static int gemm(const char* fn, int ta, int tb, long long m, long long n, long long k, const void* a,
                size_t ea, long long lda, long long sa, const void* b, size_t eb, long long ldb,
                long long sb, void* c, size_t ec, long long ldc, long long sc, long long batch) {
  __atomic_add_fetch(&n_gemm, 1, __ATOMIC_RELAXED);
  if (m < 0 || n < 0 || k < 0 || batch < 0)
    return mock_error(INVALID_VALUE, "%s: negative size m %lld n %lld k %lld batch %lld", fn, m, n, k,
                      batch);
  if (ta < 0 || ta > 2 || tb < 0 || tb > 2)
    return mock_error(INVALID_VALUE, "%s: unknown operation %d / %d", fn, ta, tb);
  if (!ea || !eb || !ec) return mock_error(INVALID_VALUE, "%s: a data type the mock does not know", fn);
  long long ar = ta == 0 ? m : k, ac = ta == 0 ? k : m;
  long long br = tb == 0 ? k : n, bc = tb == 0 ? n : k;
  if (lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) || ldc < (m > 1 ? m : 1))
    return mock_error(INVALID_VALUE,
                      "%s: leading dimensions lda %lld ldb %lld ldc %lld too small for m %lld n %lld "
                      "k %lld (ops %d, %d)",
                      fn, lda, ldb, ldc, m, n, k, ta, tb);
  int r;
  if ((r = operand(fn, "A", a, ar, k == 0 ? 0 : ac, lda, sa, batch, ea))) return r;
  if ((r = operand(fn, "B", b, k == 0 ? 0 : br, bc, ldb, sb, batch, eb))) return r;
  return operand(fn, "C", c, m, n, ldc, sc, batch, ec);
}

// The executing mock (MOCKCUDA_EXEC set, see mockcuda.c): the product itself, column-major
// C = alpha op(A) op(B) + beta C, summed in double. Elements of f32, f64, f16 and bf16.
static double load(const void* p, int t, long long i) {
  switch (t) {
    case 0: return ((const float*)p)[i];
    case 1: return ((const double*)p)[i];
    case 2: return (double)((const _Float16*)p)[i];
    case 14: {
      uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
      float f;
      memcpy(&f, &u, 4);
      return f;
    }
    default: return 0;
  }
}
static void store(void* p, int t, long long i, double v) {
  switch (t) {
    case 0: ((float*)p)[i] = (float)v; break;
    case 1: ((double*)p)[i] = v; break;
    case 2: ((_Float16*)p)[i] = (_Float16)(float)v; break;
    case 14: {
      float f = (float)v;
      uint32_t x;
      memcpy(&x, &f, 4);
      uint16_t h = (x & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((x >> 16) | 0x40u)
                                                   : (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
      ((uint16_t*)p)[i] = h;
      break;
    }
    default: break;
  }
}
static int computable(int t) { return t == 0 || t == 1 || t == 2 || t == 14; }
// Returns OK, or refuses element types it does not compute (int8, int32, fp8), which would
// otherwise leave C as it was.
static int gemm_run(const char* fn, int ta, int tb, long long m, long long n, long long k, double alpha,
                    const void* a, int at, long long lda, long long sa, const void* b, int bt, long long ldb,
                    long long sb, double beta, void* c, int ct, long long ldc, long long sc, long long batch) {
  if (!computable(at) || !computable(bt) || !computable(ct))
    return mock_error(INVALID_VALUE, "%s: data types %d, %d, %d the executing mock does not compute", fn, at, bt,
                      ct);
  for (long long z = 0; z < batch; z++)
    for (long long j = 0; j < n; j++)
      for (long long i = 0; i < m; i++) {
        double acc = 0;
        // cuBLAS reads neither A nor B when alpha is 0 (nor C when beta is 0).
        for (long long l = 0; alpha != 0 && l < k; l++) {
          long long ia = z * sa + (ta == 0 ? i + l * lda : l + i * lda);
          long long ib = z * sb + (tb == 0 ? l + j * ldb : j + l * ldb);
          acc += load(a, at, ia) * load(b, bt, ib);
        }
        long long ic = z * sc + i + j * ldc;
        double v = alpha * acc;
        if (beta != 0) v += beta * load(c, ct, ic);
        store(c, ct, ic, v);
      }
  return OK;
}
// alpha and beta as a cublasComputeType_t (or, in the older form, a cudaDataType_t) says; -1
// for a compute type the executing mock does not take (the 32-bit integer ones).
static int scalar_kind(int compute) {
  if (compute == 64 || compute == 65 || compute == 2) return 2;                // 16F
  if (compute == 70 || compute == 71 || compute == 1) return 1;                // 64F
  if ((compute >= 66 && compute <= 69) || (compute >= 74 && compute <= 77) || compute == 0) return 0;  // 32F
  return -1;
}
static double scalar(const void* p, int compute) {
  switch (scalar_kind(compute)) {
    case 2: return (double)*(const _Float16*)p;
    case 1: return *(const double*)p;
    default: return *(const float*)p;
  }
}

// Every gemm entry point: cuBLAS's checks, then, under the executing mock, the product (alpha
// and beta already read as `compute` says; a compute type it does not take is refused).
static int gemm_call(const char* fn, int ta, int tb, long long m, long long n, long long k, double alpha,
                     const void* a, int at, long long lda, long long sa, const void* b, int bt, long long ldb,
                     long long sb, double beta, void* c, int ct, long long ldc, long long sc, long long batch,
                     int compute) {
  int r = gemm(fn, ta, tb, m, n, k, a, elem_bytes(at), lda, sa, b, elem_bytes(bt), ldb, sb, c, elem_bytes(ct), ldc,
               sc, batch);
  if (r || !executing()) return r;
  if (scalar_kind(compute) < 0)
    return mock_error(INVALID_VALUE, "%s: compute type %d the executing mock does not compute", fn, compute);
  return gemm_run(fn, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc, sc, batch);
}

int cublasCreate_v2(void** h) {
  *h = &dummy_handle;
  return OK;
}
int cublasDestroy_v2(void* h) {
  (void)h;
  return OK;
}
int cublasSetStream_v2(void* h, void* s) {
  (void)h;
  (void)s;
  return OK;
}
int cublasGetStream_v2(void* h, void** s) {
  (void)h;
  *s = NULL;
  return OK;
}
int cublasSetPointerMode_v2(void* h, int m) {
  (void)h;
  (void)m;
  return OK;
}
int cublasGetPointerMode_v2(void* h, int* m) {
  (void)h;
  *m = 0;
  return OK;
}
int cublasSetMathMode(void* h, int m) {
  (void)h;
  (void)m;
  return OK;
}
int cublasGetMathMode(void* h, int* m) {
  (void)h;
  *m = 0;
  return OK;
}
int cublasSetWorkspace_v2(void* h, void* w, size_t bytes) {
  (void)h;
  if (bytes && !mock_device_range((uintptr_t)w, bytes))
    return mock_error(INVALID_VALUE, "cublasSetWorkspace: %zu bytes outside device memory", bytes);
  return OK;
}

int cublasSgemm_v2(void* h, int ta, int tb, int m, int n, int k, const float* al, const float* a, int lda,
                   const float* b, int ldb, const float* be, float* c, int ldc) {
  (void)h;
  return gemm_call("cublasSgemm", ta, tb, m, n, k, *al, a, 0, lda, 0, b, 0, ldb, 0, *be, c, 0, ldc, 0, 1, 68);
}
int cublasDgemm_v2(void* h, int ta, int tb, int m, int n, int k, const double* al, const double* a,
                   int lda, const double* b, int ldb, const double* be, double* c, int ldc) {
  (void)h;
  return gemm_call("cublasDgemm", ta, tb, m, n, k, *al, a, 1, lda, 0, b, 1, ldb, 0, *be, c, 1, ldc, 0, 1, 70);
}
int cublasSgemmStridedBatched(void* h, int ta, int tb, int m, int n, int k, const float* al, const float* a,
                              int lda, long long sa, const float* b, int ldb, long long sb, const float* be,
                              float* c, int ldc, long long sc, int batch) {
  (void)h;
  return gemm_call("cublasSgemmStridedBatched", ta, tb, m, n, k, *al, a, 0, lda, sa, b, 0, ldb, sb, *be, c, 0,
                   ldc, sc, batch, 68);
}
int cublasDgemmStridedBatched(void* h, int ta, int tb, int m, int n, int k, const double* al,
                              const double* a, int lda, long long sa, const double* b, int ldb, long long sb,
                              const double* be, double* c, int ldc, long long sc, int batch) {
  (void)h;
  return gemm_call("cublasDgemmStridedBatched", ta, tb, m, n, k, *al, a, 1, lda, sa, b, 1, ldb, sb, *be, c, 1,
                   ldc, sc, batch, 70);
}
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* al, const void* a, int at, int lda,
                 const void* b, int bt, int ldb, const void* be, void* c, int ct, int ldc, int compute,
                 int algo) {
  (void)h;
  (void)algo;
  return gemm_call("cublasGemmEx", ta, tb, m, n, k, scalar(al, compute), a, at, lda, 0, b, bt, ldb, 0,
                   scalar(be, compute), c, ct, ldc, 0, 1, compute);
}
int cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* al, const void* a,
                               int at, int lda, long long sa, const void* b, int bt, int ldb, long long sb,
                               const void* be, void* c, int ct, int ldc, long long sc, int batch, int compute,
                               int algo) {
  (void)h;
  (void)algo;
  return gemm_call("cublasGemmStridedBatchedEx", ta, tb, m, n, k, scalar(al, compute), a, at, lda, sa, b, bt,
                   ldb, sb, scalar(be, compute), c, ct, ldc, sc, batch, compute);
}
#endif

#ifdef MOCK_CURAND
enum { OK = 0, LENGTH_NOT_MULTIPLE = 105, LAUNCH_FAILURE = 201 };

int curandCreateGenerator(void** g, int type) {
  (void)type;
  *g = &dummy_handle;
  return OK;
}
int curandDestroyGenerator(void* g) {
  (void)g;
  return OK;
}
int curandSetStream(void* g, void* s) {
  (void)g;
  (void)s;
  return OK;
}
int curandSetPseudoRandomGeneratorSeed(void* g, unsigned long long seed) {
  (void)g;
  (void)seed;
  return OK;
}
int curandSetGeneratorOffset(void* g, unsigned long long off) {
  (void)g;
  (void)off;
  return OK;
}
static int fill(const char* fn, void* p, size_t n, size_t es, int pairs) {
  // cuRAND's normal generators take an even count.
  if (pairs && n % 2) return mock_error(LENGTH_NOT_MULTIPLE, "%s: an odd count %zu", fn, n);
  if (n && !mock_device_range((uintptr_t)p, n * es))
    return mock_error(LAUNCH_FAILURE, "%s: %zu values leave their device allocation", fn, n);
  return OK;
}
// Under the executing mock the values are drawn too (not cuRAND's sequence: a splitmix64 stream
// per process, uniform in (0, 1], normal by Box-Muller), so that what reads them reads numbers
// of the right law rather than zeros.
static unsigned long long rng_state = 0x6b657964696666ull;
static double uniform01(void) {
  unsigned long long z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return ((double)(z >> 11) + 1.0) / 9007199254740992.0;  // (0, 1]
}
static double normal01(void) { return sqrt(-2.0 * log(uniform01())) * cos(6.283185307179586 * uniform01()); }
int curandGenerateUniform(void* g, float* p, size_t n) {
  (void)g;
  int r = fill("curandGenerateUniform", p, n, 4, 0);
  for (size_t i = 0; !r && executing() && i < n; i++) p[i] = (float)uniform01();
  return r;
}
int curandGenerateUniformDouble(void* g, double* p, size_t n) {
  (void)g;
  int r = fill("curandGenerateUniformDouble", p, n, 8, 0);
  for (size_t i = 0; !r && executing() && i < n; i++) p[i] = uniform01();
  return r;
}
int curandGenerateNormal(void* g, float* p, size_t n, float mean, float sd) {
  (void)g;
  int r = fill("curandGenerateNormal", p, n, 4, 1);
  for (size_t i = 0; !r && executing() && i < n; i++) p[i] = (float)(mean + sd * normal01());
  return r;
}
int curandGenerateNormalDouble(void* g, double* p, size_t n, double mean, double sd) {
  (void)g;
  int r = fill("curandGenerateNormalDouble", p, n, 8, 1);
  for (size_t i = 0; !r && executing() && i < n; i++) p[i] = mean + sd * normal01();
  return r;
}
#endif
