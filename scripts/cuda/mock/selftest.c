// The mock libraries' own test (run by build.sh): each check refuses what the real library
// refuses and lets through what it accepts.
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mockflash.h"

void __cudaRegisterFunction(void** h, const char* host, char* dev, const char* name, int limit, void* tid,
                            void* bid, void* bdim, void* gdim, int* wsize);

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
    ".visible .entry free_kernel(\n\t.param .u64 free_kernel_param_0\n)\n{\n\tret;\n}\n"
    ".visible .entry pointers(\n\t.param .u64 pointers_param_0,\n\t.param .u64 pointers_param_1,\n"
    "\t.param .u32 pointers_param_2\n)\n{\n\t.reg .b64 %rd<4>;\n"
    "\tld.param.u64 %rd1, [pointers_param_0];\n\tld.param.u64 %rd2, [pointers_param_1];\n"
    "\tcvta.to.global.u64 %rd3, %rd2;\n\tret;\n}\n";

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

  // `pointers`: parameter 1 is a global pointer (its body cvta's it), 0 a plain u64.
  CUfunction pf;
  EXPECT("a kernel with a pointer", cuModuleGetFunction(&pf, m, "pointers"), CUDA_SUCCESS);
  CUdeviceptr live = 0, gone = 0;
  cuMemAlloc_v2(&live, 256);
  cuMemAlloc_v2(&gone, 256);
  cuMemFree_v2(gone);
  unsigned long long word = 12345, at = live + 100, past = live + 256, beyond = live + 264, freed = gone, null = 0;
  unsigned small = 7;
#define POINTERS(what, p1, want)                                                        \
  do {                                                                                  \
    void* pargs[] = {&word, &p1, &small};                                               \
    EXPECT(what, cuLaunchKernel(pf, 1, 1, 1, 32, 1, 1, 0, NULL, pargs, NULL), want);    \
  } while (0)
  POINTERS("a pointer inside a live allocation", at, CUDA_SUCCESS);
  POINTERS("a null pointer", null, CUDA_SUCCESS);
  POINTERS("a pointer just past its allocation's end (an empty view)", past, CUDA_SUCCESS);
  POINTERS("a pointer further past it", beyond, CUDA_ERROR_INVALID_VALUE);
  POINTERS("a pointer to freed memory", freed, CUDA_ERROR_INVALID_VALUE);
  POINTERS("an integer in a pointer's place", word, CUDA_ERROR_INVALID_VALUE);
  cuMemFree_v2(live);

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
  // Past the end of the allocation below it, before the next one's start.
  CUdeviceptr lower, upper;
  cuMemAlloc_v2(&lower, 256);
  cuMemAlloc_v2(&upper, 256);
  CUdeviceptr gap = (lower < upper ? lower : upper) + 256 + 8;
  if (gap + 4 <= (lower < upper ? upper : lower))
    EXPECT("copy from past an allocation's end", cuMemcpyDtoH_v2(host, gap, 4), CUDA_ERROR_INVALID_VALUE);
  else
    fprintf(stderr, "selftest: no gap between two allocations here; that case did not run\n");
  cuMemFree_v2(lower);
  cuMemFree_v2(upper);
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

  // FlashAttention-2 (through the runtime): a bf16, causal, head-size-128 kernel over a chunk
  // of 128 queries (8 heads) and a view of 300 keys (2 KV heads) of a cache of 512 slots a head.
  static const char flash_host = 0;  // stands for the kernel's host stub
  static char flash_name[] =
      "_Z16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi128ELi64ELi4ELb0ELb0EN7cutlass10bfloat16_tE19Flash_"
      "kernel_traitsILi128ELi128ELi64ELi4ES2_EELb0ELb1ELb0ELb0ELb0ELb1ELb0ELb0EEv16Flash_fwd_params";
  __cudaRegisterFunction(NULL, &flash_host, flash_name, flash_name, -1, NULL, NULL, NULL, NULL, NULL);
  CUdeviceptr q, kv, o, lse, lse_short;
  cuMemAlloc_v2(&q, 128 * 8 * 128 * 2);
  cuMemAlloc_v2(&kv, 2 * 512 * 128 * 2);
  cuMemAlloc_v2(&o, 128 * 8 * 128 * 2);
  cuMemAlloc_v2(&lse, 8 * 128 * 4);
  cuMemAlloc_v2(&lse_short, 8 * 128 * 4 - 4);
  FlashParams good;
  memset(&good, 0, sizeof good);
  good.q_ptr = (void*)(uintptr_t)q;
  good.k_ptr = good.v_ptr = (void*)(uintptr_t)kv;
  good.o_ptr = (void*)(uintptr_t)o;
  good.softmax_lse_ptr = (void*)(uintptr_t)lse;
  good.q_batch_stride = good.o_batch_stride = 128 * 8 * 128;
  good.q_row_stride = good.o_row_stride = 8 * 128;
  good.q_head_stride = good.o_head_stride = 128;
  good.k_batch_stride = good.v_batch_stride = 2 * 512 * 128;
  good.k_row_stride = good.v_row_stride = 128;
  good.k_head_stride = good.v_head_stride = 512 * 128;
  good.b = 1, good.h = 8, good.h_k = 2, good.h_h_k_ratio = 4, good.d = good.d_rounded = 128;
  good.seqlen_q = 128, good.seqlen_k = 300, good.seqlen_q_rounded = 128, good.seqlen_k_rounded = 384;
  good.scale_softmax = 1 / sqrtf(128.f), good.scale_softmax_log2 = good.scale_softmax * (float)M_LOG2E;
  good.window_size_left = 300, good.window_size_right = 0;
  good.is_bf16 = good.is_causal = true, good.num_splits = 1;
  FlashParams bad;
  void* flash_args[] = {&bad};
  dim3 grid = {1, 8, 1}, block = {128, 1, 1};
#define FLASH(what, change, want)                                                        \
  do {                                                                                   \
    bad = good;                                                                          \
    change;                                                                              \
    EXPECT(what, cudaLaunchKernel(&flash_host, grid, block, flash_args, 0, NULL), want); \
    cudaGetLastError();                                                                  \
  } while (0)
  FLASH("flash in bounds", (void)0, cudaSuccess);
  FLASH("flash over all 512 slots", (bad.seqlen_k = bad.window_size_left = 512, bad.seqlen_k_rounded = 512),
        cudaSuccess);
  FLASH("flash keys past the cache's slots", (bad.seqlen_k = bad.window_size_left = 513, bad.seqlen_k_rounded = 640),
        cudaErrorInvalidValue);
  FLASH("flash k's head stride past its buffer", bad.k_head_stride = 800 * 128, cudaErrorInvalidValue);
  FLASH("flash q's rows past its buffer", bad.q_row_stride = 9 * 128, cudaErrorInvalidValue);
  FLASH("flash o's rows past its buffer", bad.o_row_stride = 9 * 128, cudaErrorInvalidValue);
  FLASH("flash a GQA ratio that is not h / h_k", bad.h_h_k_ratio = 2, cudaErrorInvalidValue);
  FLASH("flash f16 data in a bf16 kernel", bad.is_bf16 = false, cudaErrorInvalidValue);
  FLASH("flash not causal in a causal kernel", (bad.is_causal = false, bad.window_size_left = -1,
                                                 bad.window_size_right = -1),
        cudaErrorInvalidValue);
  FLASH("flash causal with a left window", bad.window_size_left = 100, cudaErrorInvalidValue);
  // 64 queries: the wider heads stay inside q's and o's buffers, so only the bucket refuses.
  FLASH("flash head size past the kernel's", (bad.d = bad.d_rounded = 160, bad.seqlen_q = 64),
        cudaErrorInvalidValue);
  FLASH("flash head size 120 in an even-K kernel", (bad.d = 120), cudaErrorInvalidValue);
  FLASH("flash a log-sum-exp past its buffer", bad.softmax_lse_ptr = (void*)(uintptr_t)lse_short,
        cudaErrorInvalidValue);
  FLASH("flash more queries than rounded", (bad.seqlen_q = 64, bad.seqlen_q_rounded = 32), cudaErrorInvalidValue);
  FLASH("flash a softmax scale without its log2 twin", bad.scale_softmax_log2 = bad.scale_softmax,
        cudaErrorInvalidValue);

  if (failures) return 1;
  printf("mock selftest: all checks behave\n");
  return 0;
}
