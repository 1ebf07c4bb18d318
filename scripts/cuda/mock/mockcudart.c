// A stand-in CUDA runtime (libcudart.so.13) beside the mock driver (mockcuda.c), for the kernels
// that nvcc compiled with host code into the binary (candle-kernels' static library): their
// registration at start-up, and their <<<>>> launches, which are checked (empty or oversized
// grids and blocks, dynamic shared memory past the limit) and counted like the driver's, under
// the kernel's device name. Memory calls go to the mock driver.
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "mockcommon.h"

typedef struct Kernel {
  const void* host;
  char name[256];
  int max_dynamic_shared;
  unsigned long long launches;
  struct Kernel* next;
} Kernel;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static Kernel* kernels = NULL;
static int dummy_fatbin;

static Kernel* find(const void* host) {
  pthread_mutex_lock(&lock);
  Kernel* k = kernels;
  while (k && k->host != host) k = k->next;
  pthread_mutex_unlock(&lock);
  return k;
}

void** __cudaRegisterFatBinary(void* fatbin) {
  (void)fatbin;
  return (void**)&dummy_fatbin;
}
void __cudaRegisterFatBinaryEnd(void** h) { (void)h; }
void __cudaUnregisterFatBinary(void** h) { (void)h; }
void __cudaRegisterFunction(void** h, const char* host, char* dev, const char* name, int limit, void* tid,
                            void* bid, void* bdim, void* gdim, int* wsize) {
  (void)h;
  (void)dev;
  (void)limit;
  (void)tid;
  (void)bid;
  (void)bdim;
  (void)gdim;
  (void)wsize;
  Kernel* k = calloc(1, sizeof(Kernel));
  k->host = host;
  snprintf(k->name, sizeof k->name, "%s", name);
  pthread_mutex_lock(&lock);
  k->next = kernels;
  kernels = k;
  pthread_mutex_unlock(&lock);
}
void __cudaRegisterVar(void** h, char* host, char* dev, const char* name, int ext, size_t size, int constant,
                       int global) {
  (void)h;
  (void)host;
  (void)dev;
  (void)name;
  (void)ext;
  (void)size;
  (void)constant;
  (void)global;
}

cudaError_t __cudaGetKernel(cudaKernel_t* out, const void* host) {
  Kernel* k = find(host);
  if (!k) return mock_error(cudaErrorInvalidDeviceFunction, "__cudaGetKernel: a function never registered");
  *out = (cudaKernel_t)k;
  return cudaSuccess;
}

static __thread dim3 cfg_grid, cfg_block;
static __thread size_t cfg_shared;
static __thread void* cfg_stream;

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, void* stream) {
  cfg_grid = grid;
  cfg_block = block;
  cfg_shared = shared;
  cfg_stream = stream;
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shared, void** stream) {
  *grid = cfg_grid;
  *block = cfg_block;
  *shared = cfg_shared;
  *stream = cfg_stream;
  return cudaSuccess;
}

// The runtime's sticky error: a refused launch is what the next cudaGetLastError answers
// (the launch stub nvcc writes discards the launch's own return value).
static __thread cudaError_t last_error = cudaSuccess;

static cudaError_t check_launch(cudaKernel_t kernel, dim3 g, dim3 b, void** args, size_t shared);
static cudaError_t launch(cudaKernel_t kernel, dim3 g, dim3 b, void** args, size_t shared) {
  cudaError_t r = check_launch(kernel, g, b, args, shared);
  if (r != cudaSuccess) last_error = r;
  return r;
}
// No __launch_bounds__ here: these kernels come as SASS in the binary's fat binary, not as PTX
// the mock reads.
static cudaError_t check_launch(cudaKernel_t kernel, dim3 g, dim3 b, void** args, size_t shared) {
  Kernel* k = (Kernel*)kernel;
  if (!k) return mock_error(cudaErrorInvalidDeviceFunction, "runtime launch of a null kernel");
  if (!g.x || !g.y || !g.z || !b.x || !b.y || !b.z)
    return mock_error(cudaErrorInvalidConfiguration, "%s: launch with an empty grid (%u,%u,%u) or block (%u,%u,%u)",
                      k->name, g.x, g.y, g.z, b.x, b.y, b.z);
  if (g.y > 65535 || g.z > 65535 || g.x > 2147483647u)
    return mock_error(cudaErrorInvalidConfiguration, "%s: grid (%u,%u,%u) past the limits", k->name, g.x, g.y, g.z);
  if (b.x > 1024 || b.y > 1024 || b.z > 64 || (unsigned long long)b.x * b.y * b.z > 1024)
    return mock_error(cudaErrorInvalidConfiguration, "%s: block (%u,%u,%u) past 1024 threads", k->name, b.x, b.y, b.z);
  int limit = k->max_dynamic_shared > 49152 ? k->max_dynamic_shared : 49152;
  if (shared > (size_t)limit)
    return mock_error(cudaErrorInvalidValue, "%s: %zu bytes of dynamic shared memory, past %d", k->name, shared, limit);
  if (!args) return mock_error(cudaErrorInvalidValue, "%s: launch without arguments", k->name);
  __atomic_add_fetch(&k->launches, 1, __ATOMIC_RELAXED);
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 g, dim3 b, void** args, size_t shared, cudaStream_t s) {
  (void)s;
  return launch(k, g, b, args, shared);
}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t k, dim3 g, dim3 b, void** args, size_t shared, cudaStream_t s) {
  (void)s;
  return launch(k, g, b, args, shared);
}
cudaError_t cudaLaunchKernel(const void* host, dim3 g, dim3 b, void** args, size_t shared, cudaStream_t s) {
  (void)s;
  return launch((cudaKernel_t)find(host), g, b, args, shared);
}

cudaError_t cudaFuncSetAttribute(const void* host, enum cudaFuncAttribute a, int v) {
  Kernel* k = find(host);
  if (!k) return mock_error(cudaErrorInvalidDeviceFunction, "cudaFuncSetAttribute: a function never registered");
  if (a == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (v < 0 || v > 232448)
      return mock_error(cudaErrorInvalidValue, "%s: dynamic shared memory %d past 227 KiB", k->name, v);
    k->max_dynamic_shared = v;
  }
  return cudaSuccess;
}
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attr, const void* host) {
  Kernel* k = find(host);
  if (!k) return mock_error(cudaErrorInvalidDeviceFunction, "cudaFuncGetAttributes: a function never registered");
  memset(attr, 0, sizeof *attr);
  attr->maxThreadsPerBlock = 1024;
  attr->numRegs = 32;
  attr->maxDynamicSharedSizeBytes = k->max_dynamic_shared;
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, const void* host, int block, size_t shared,
                                                                   unsigned flags) {
  (void)host;
  (void)shared;
  (void)flags;
  *n = block > 0 ? 2048 / block : 0;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t r = last_error;
  last_error = cudaSuccess;
  return r;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
// cudaDeviceAttr has CUdevice_attribute's numbers.
cudaError_t cudaDeviceGetAttribute(int* v, enum cudaDeviceAttr a, int d) {
  return cuDeviceGetAttribute(v, (CUdevice_attribute)a, d) == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}
static cudaError_t from_driver(CUresult r) {
  return r == CUDA_SUCCESS ? cudaSuccess : r == CUDA_ERROR_OUT_OF_MEMORY ? cudaErrorMemoryAllocation : cudaErrorInvalidValue;
}
cudaError_t cudaMalloc(void** p, size_t n) {
  CUdeviceptr d = 0;
  cudaError_t r = from_driver(cuMemAlloc_v2(&d, n));
  *p = (void*)(uintptr_t)d;
  return r;
}
cudaError_t cudaFree(void* p) { return from_driver(cuMemFree_v2((CUdeviceptr)(uintptr_t)p)); }
cudaError_t cudaMallocAsync_ptsz(void** p, size_t n, cudaStream_t s) {
  (void)s;
  return cudaMalloc(p, n);
}
cudaError_t cudaFreeAsync_ptsz(void* p, cudaStream_t s) {
  (void)s;
  return cudaFree(p);
}
cudaError_t cudaMemsetAsync_ptsz(void* p, int v, size_t n, cudaStream_t s) {
  (void)s;
  return from_driver(cuMemsetD8_v2((CUdeviceptr)(uintptr_t)p, (unsigned char)v, n));
}
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) {
  (void)s;
  return from_driver(cuStreamSynchronize(NULL));  // counted with the driver's
}
const char* cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaError (mock)"; }
const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

__attribute__((destructor)) static void report(void) {
  FILE* out = mock_log();
  if (!out) return;
  static char buf[1 << 16];
  setvbuf(out, buf, _IOFBF, sizeof buf);
  for (Kernel* k = kernels; k; k = k->next)
    if (k->launches) fprintf(out, "launch %s %llu\n", k->name, k->launches);
  fclose(out);
}
