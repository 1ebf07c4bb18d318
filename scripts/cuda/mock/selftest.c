// The mock libraries' own test (run by build.sh): each check refuses what the real library
// refuses and lets through what it accepts.
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cublasCreate_v2(void** h);
int cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* al, const void* a, int at,
                               int lda, long long sa, const void* b, int bt, int ldb, long long sb, const void* be,
                               void* c, int ct, int ldc, long long sc, int batch, int compute, int algo);

static int failures = 0;
#define EXPECT(what, got, want)                                                            \
  do {                                                                                     \
    long long g_ = (long long)(got), w_ = (long long)(want);                               \
    if (g_ != w_) {                                                                        \
      fprintf(stderr, "selftest FAILED: %s: got %lld, want %lld\n", what, g_, w_);         \
      failures++;                                                                          \
    }                                                                                      \
  } while (0)

static const char* ptx =
    ".version 9.0\n.target sm_90\n.address_size 64\n"
    ".visible .entry bounded(\n\t.param .u64 bounded_param_0\n)\n.maxntid 256, 1, 1\n{\n\tret;\n}\n"
    ".visible .entry free_kernel(\n\t.param .u64 free_kernel_param_0\n)\n{\n\tret;\n}\n";

int main(void) {
  CUmodule m;
  CUfunction f, g;
  EXPECT("load PTX", cuModuleLoadData(&m, ptx), CUDA_SUCCESS);
  EXPECT("a kernel the module has", cuModuleGetFunction(&f, m, "bounded"), CUDA_SUCCESS);
  EXPECT("another", cuModuleGetFunction(&g, m, "free_kernel"), CUDA_SUCCESS);
  EXPECT("a kernel it lacks", cuModuleGetFunction(&g, m, "bounded_f8e4m3"), CUDA_ERROR_NOT_FOUND);
  CUdeviceptr d = 0;
  EXPECT("alloc", cuMemAlloc_v2(&d, 1000), CUDA_SUCCESS);
  void* args[] = {&d};
  EXPECT("launch within bounds", cuLaunchKernel(f, 10, 1, 1, 256, 1, 1, 0, NULL, args, NULL), CUDA_SUCCESS);
  EXPECT("launch past __launch_bounds__", cuLaunchKernel(f, 10, 1, 1, 512, 1, 1, 0, NULL, args, NULL),
         CUDA_ERROR_INVALID_VALUE);
  EXPECT("1024 threads unbounded", cuLaunchKernel(g, 1, 1, 1, 1024, 1, 1, 0, NULL, args, NULL), CUDA_SUCCESS);
  EXPECT("past 1024 threads", cuLaunchKernel(g, 1, 1, 1, 32, 33, 1, 0, NULL, args, NULL), CUDA_ERROR_INVALID_VALUE);
  EXPECT("an empty grid", cuLaunchKernel(g, 0, 1, 1, 32, 1, 1, 0, NULL, args, NULL), CUDA_ERROR_INVALID_VALUE);
  EXPECT("grid y past 65535", cuLaunchKernel(g, 1, 65536, 1, 32, 1, 1, 0, NULL, args, NULL),
         CUDA_ERROR_INVALID_VALUE);
  EXPECT("48 KiB of dynamic shared memory", cuLaunchKernel(g, 1, 1, 1, 32, 1, 1, 49152, NULL, args, NULL),
         CUDA_SUCCESS);
  EXPECT("past 48 KiB without opting in", cuLaunchKernel(g, 1, 1, 1, 32, 1, 1, 49153, NULL, args, NULL),
         CUDA_ERROR_INVALID_VALUE);
  EXPECT("opt in", cuFuncSetAttribute(g, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000), CUDA_SUCCESS);
  EXPECT("opted in", cuLaunchKernel(g, 1, 1, 1, 32, 1, 1, 100000, NULL, args, NULL), CUDA_SUCCESS);

  char host[2000];
  memset(host, 7, sizeof host);
  EXPECT("copy in", cuMemcpyHtoD_v2(d, host, 1000), CUDA_SUCCESS);
  EXPECT("copy in past the end", cuMemcpyHtoD_v2(d + 1, host, 1000), CUDA_ERROR_INVALID_VALUE);
  EXPECT("copy out of the middle", cuMemcpyDtoH_v2(host, d + 500, 500), CUDA_SUCCESS);
  EXPECT("the bytes came back", host[0], 7);
  EXPECT("copy out past the end", cuMemcpyDtoH_v2(host, d + 500, 501), CUDA_ERROR_INVALID_VALUE);
  EXPECT("memset past the end", cuMemsetD8_v2(d, 0, 1001), CUDA_ERROR_INVALID_VALUE);
  EXPECT("free", cuMemFree_v2(d), CUDA_SUCCESS);
  EXPECT("copy from freed memory", cuMemcpyDtoH_v2(host, d, 4), CUDA_ERROR_INVALID_VALUE);
  EXPECT("free twice", cuMemFree_v2(d), CUDA_ERROR_INVALID_VALUE);

  // A bf16 (type 14) C[4 × 3] = A[4 × 5] · B[5 × 3], column-major, 2 batches.
  void* h;
  CUdeviceptr a, b, c;
  cublasCreate_v2(&h);
  cuMemAlloc_v2(&a, 2 * 4 * 5 * 2);
  cuMemAlloc_v2(&b, 2 * 5 * 3 * 2);
  cuMemAlloc_v2(&c, 2 * 4 * 3 * 2);
  float one = 1, zero = 0;
#define GEMM(lda, sa, ldb, sb, ldc, sc)                                                                        \
  cublasGemmStridedBatchedEx(h, 0, 0, 4, 3, 5, &one, (void*)(uintptr_t)a, 14, lda, sa, (void*)(uintptr_t)b, 14, \
                             ldb, sb, &zero, (void*)(uintptr_t)c, 14, ldc, sc, 2, 68, -1)
  EXPECT("gemm in bounds", GEMM(4, 20, 5, 15, 4, 12), 0);
  EXPECT("gemm lda < m", GEMM(3, 20, 5, 15, 4, 12), 7);
  EXPECT("gemm ldb < k", GEMM(4, 20, 4, 15, 4, 12), 7);
  EXPECT("gemm A's batch stride past its buffer", GEMM(4, 21, 5, 15, 4, 12), 7);
  EXPECT("gemm C's batch stride past its buffer", GEMM(4, 20, 5, 15, 4, 13), 7);
  EXPECT("gemm on a broadcast B (stride 0)", GEMM(4, 20, 5, 0, 4, 12), 0);
  if (failures) return 1;
  printf("mock selftest: all checks behave\n");
  return 0;
}
