// A stand-in CUDA driver (libcuda.so.1) for running a CUDA build of keydiff on a machine without
// a GPU: every host-side path of the engine's CUDA code (candle's CUDA backend, cudarc, our
// wrappers in keydiff-kernels, the model's and cache's CUDA branches) runs, and the driver calls
// it makes are checked the way the real driver would refuse them. Kernels do not run: a launch
// is checked and counted, then does nothing. Device memory is host memory, zeroed at
// allocation, so every kernel's output reads as zeros. Unless MOCKCUDA_EXEC names the folder
// of the kernels' host builds (exec/build.sh): then each launch, once checked, runs its
// kernel's host build over the CPU emulation (exec/runtime.cpp), and mockblas.c computes the
// matmuls, so that the CUDA path computes real values (the executing mock).
//
// What it finds (each is printed to stderr as "mockcuda: ERROR ..." and the call fails with
// the real driver's error code):
//   - a kernel name its module does not have (CUDA_ERROR_NOT_FOUND, as candle 0.11.1's fp8
//     casts asked for on the first GPU run);
//   - a launch with a zero or oversized grid or block, more threads than the kernel's
//     __launch_bounds__ (.maxntid in its PTX), or more dynamic shared memory than allowed;
//   - a copy or memset that leaves the allocation it starts in, or reads freed memory;
//   - a launch whose pointer parameters (those the kernel's PTX turns into global addresses)
//     are not null and in no live allocation;
//   - a driver call this stand-in does not implement (so that nothing silently succeeds).
// At exit, with MOCKCUDA_LOG=path, it appends each launched kernel with its count and each
// error to that file.
//
// Built by scripts/cuda/mock/build.sh together with libcublas/libcublasLt/libcurand/libnvrtc
// stand-ins (mockblas.c), and used by scripts/cuda-mock-check.sh.
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mockcommon.h"

// ---------------------------------------------------------------------------------------
// Device memory: host memory with a registry of live ranges (sorted by start).

typedef struct {
  uintptr_t start;
  size_t size;
} Range;

// What the process asked of the driver, for the exit report.
static unsigned long long n_alloc, n_free, n_htod, n_dtoh, n_dtod, n_memset, b_htod, b_dtoh, n_sync;
#define COUNT(c) __atomic_add_fetch(&(c), 1, __ATOMIC_RELAXED)
#define ADD(c, v) __atomic_add_fetch(&(c), (v), __ATOMIC_RELAXED)

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static Range* live = NULL;
static size_t live_n = 0, live_cap = 0;
static size_t used = 0, used_high = 0, release_threshold = 0;

static size_t total_mem(void) {
  const char* g = getenv("MOCKCUDA_MEM_GIB");
  double gib = g ? atof(g) : 80.0;
  return (size_t)(gib * 1024.0 * 1024.0 * 1024.0);
}

// Index of the first range starting after p.
static size_t upper(uintptr_t p) {
  size_t lo = 0, hi = live_n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (live[mid].start <= p) lo = mid + 1; else hi = mid;
  }
  return lo;
}

static CUresult mem_alloc(CUdeviceptr* out, size_t bytes, const char* what) {
  if (!out) return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: null result pointer", what);
  if (bytes == 0) {
    // cuMemAlloc documents CUDA_ERROR_INVALID_VALUE for 0 bytes; what the stream-ordered
    // allocator answers is not documented, so that one is let through (a null pointer).
    if (strcmp(what, "cuMemAlloc") == 0)
      return mock_error(CUDA_ERROR_INVALID_VALUE, "%s of 0 bytes", what);
    *out = 0;
    return CUDA_SUCCESS;
  }
  pthread_mutex_lock(&mem_lock);
  if (used + bytes > total_mem()) {
    pthread_mutex_unlock(&mem_lock);
    // Not a defect of the caller: the real driver answers the same (the memory plan checks it).
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // 256-byte aligned, as cudaMalloc's, and zeroed. From 1 MiB on, a fresh mapping: its pages
  // are zero and cost nothing until touched (kernels touch nothing).
  size_t padded = (bytes + 255) & ~(size_t)255;
  void* p;
  if (padded >= (1u << 20)) {
    p = mmap(NULL, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = NULL;
  } else {
    p = aligned_alloc(256, padded);
    if (p) memset(p, 0, padded);
  }
  if (!p) {
    pthread_mutex_unlock(&mem_lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // MOCKCUDA_FILL=BYTE (e.g. 0xff: NaN in every float type): new memory holds that byte instead
  // of zeros, as the real allocator's recycled memory holds anything. With the executing mock,
  // a result that then changes read memory nothing had written.
  const char* fill_byte = getenv("MOCKCUDA_FILL");
  if (fill_byte && *fill_byte) memset(p, (int)strtol(fill_byte, NULL, 0), bytes);
  if (live_n == live_cap) {
    size_t cap = live_cap ? live_cap * 2 : 1024;
    Range* grown = realloc(live, cap * sizeof(Range));
    if (!grown) {
      pthread_mutex_unlock(&mem_lock);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    live = grown;
    live_cap = cap;
  }
  size_t at = upper((uintptr_t)p);
  memmove(&live[at + 1], &live[at], (live_n - at) * sizeof(Range));
  live[at] = (Range){(uintptr_t)p, bytes};
  live_n++;
  used += bytes;
  if (used > used_high) used_high = used;
  pthread_mutex_unlock(&mem_lock);
  COUNT(n_alloc);
  *out = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

static CUresult mem_free(CUdeviceptr d, const char* what) {
  if (d == 0) return CUDA_SUCCESS;
  pthread_mutex_lock(&mem_lock);
  size_t at = upper((uintptr_t)d);
  if (at == 0 || live[at - 1].start != (uintptr_t)d) {
    pthread_mutex_unlock(&mem_lock);
    return mock_error(CUDA_ERROR_INVALID_VALUE, "%s of %#llx: not the start of a live allocation",
                      what, (unsigned long long)d);
  }
  size_t bytes = live[at - 1].size, padded = (bytes + 255) & ~(size_t)255;
  used -= bytes;
  memmove(&live[at - 1], &live[at], (live_n - at) * sizeof(Range));
  live_n--;
  pthread_mutex_unlock(&mem_lock);
  COUNT(n_free);
  if (padded >= (1u << 20)) munmap((void*)(uintptr_t)d, padded);
  else free((void*)(uintptr_t)d);
  return CUDA_SUCCESS;
}

// With mem_lock held.
static int in_range(uintptr_t p, size_t bytes) {
  if (bytes == 0) return 1;
  size_t at = upper(p);
  if (at == 0) return 0;
  // p in [start, start + size), then [p, p + bytes) within it (no unsigned wrap for a p past
  // the end of the allocation below it).
  size_t into = p - live[at - 1].start, size = live[at - 1].size;
  return into < size && bytes <= size - into;
}

int mock_device_range(uintptr_t p, size_t bytes) {
  pthread_mutex_lock(&mem_lock);
  int ok = in_range(p, bytes);
  pthread_mutex_unlock(&mem_lock);
  return ok;
}

// Checks [d, d + bytes) and, on success, returns with mem_lock held (so that no free comes
// between the check and the copy): the caller copies, then unlocks.
static CUresult lock_range(CUdeviceptr d, size_t bytes, const char* what) {
  pthread_mutex_lock(&mem_lock);
  if (in_range((uintptr_t)d, bytes)) return CUDA_SUCCESS;
  pthread_mutex_unlock(&mem_lock);
  return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: %zu bytes at %#llx leave every live allocation",
                    what, bytes, (unsigned long long)d);
}

// ---------------------------------------------------------------------------------------
// Modules: the entries of the PTX text loaded, with their .maxntid.

typedef struct Func {
  char* name;
  unsigned maxntid;  // threads a block at most (0: no bound given)
  int n_params;
  unsigned long long pointers;  // bit i: parameter i is a global pointer (its body cvta's it)
  int max_dynamic_shared;
  unsigned long long launches;
  struct Func* next;
  // For the executing mock (MOCKCUDA_EXEC): each parameter's type as exec/runtime.cpp reads
  // it (u / i: unsigned / signed integer of `sizes` bytes, f: float, d: double; 0 past
  // n_params or unreadable), and
  // whether the body has no barrier and no warp-synchronous instruction (threads may run as
  // plain calls).
  char types[65];
  unsigned char sizes[64];
  int plain;
  void* host_fn;   // the kernel's host build and its library's kx_launch, found at its first
  void* host_run;  // launch
  // The FNV-1a 64 of the source its PTX was compiled from, where the PTX says (our own
  // kernels: crates/keydiff-kernels/build.rs appends `// keydiff.cu fnv1a64 <hex>`), else "".
  char source[80];
} Func;

typedef struct Module {
  Func* funcs;
  struct Module* next;
} Module;

static pthread_mutex_t mod_lock = PTHREAD_MUTEX_INITIALIZER;
static Module* modules = NULL;  // every module loaded, for the exit report

// The first occurrence of `needle` in [from, to), or NULL.
static const char* find_in(const char* from, const char* to, const char* needle) {
  size_t n = strlen(needle);
  for (const char* p = from; p + n <= to; p++)
    if (memcmp(p, needle, n) == 0) return p;
  return NULL;
}

// Threads a block at most from the directives between an entry's name and its body's '{'.
static unsigned parse_maxntid(const char* from, const char* to) {
  const char* m = find_in(from, to, ".maxntid");
  if (!m) m = find_in(from, to, ".reqntid");
  if (!m) return 0;
  unsigned x = 1, y = 1, z = 1;
  int got = sscanf(m + 8, " %u , %u , %u", &x, &y, &z);
  if (got < 1) return 0;
  return x * (got > 1 ? y : 1) * (got > 2 ? z : 1);
}

// The parameters of an entry whose body turns them into global addresses (`ld.param.u64 %rdA,
// [NAME_param_K];` then `cvta.to.global.u64 %rdB, %rdA;`): the pointers, which a launch must
// give as addresses in live allocations (or null). A parameter may be loaded into several
// registers (nvcc reloads them); a load at an offset (`[NAME_param_K+8]`, a struct's field) is
// not a pointer parameter. Parameters past 64 are not checked.
static void parse_pointers(Func* f, const char* from, const char* to) {
  size_t klen = strlen(f->name) + 8;  // "[" NAME "_param_"
  char* key = malloc(klen + 1);
  if (!key) return;
  snprintf(key, klen + 1, "[%s_param_", f->name);
  // Each load: its register and parameter.
  size_t n = 0, cap = 0;
  struct Load {
    int reg, param;
  }* loads = NULL;
  for (const char* p = from; (p = find_in(p, to, "ld.param.u64")) != NULL; p++) {
    const char* eol = memchr(p, '\n', (size_t)(to - p));
    if (!eol) eol = to;
    int reg, k, used = 0;
    const char* at = find_in(p, eol, key);
    if (!at || sscanf(p + 12, " %%rd%d ,", &reg) != 1 || sscanf(at + klen, "%d]%n", &k, &used) != 1 || !used ||
        k < 0 || k >= 64)
      continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      struct Load* grown = realloc(loads, cap * sizeof *loads);
      if (!grown) break;
      loads = grown;
    }
    loads[n++] = (struct Load){reg, k};
  }
  for (const char* p = from; (p = find_in(p, to, "cvta.to.global.u64")) != NULL; p++) {
    int dst, src;
    if (sscanf(p + 18, " %%rd%d , %%rd%d", &dst, &src) != 2) continue;
    for (size_t i = 0; i < n; i++)
      if (loads[i].reg == src) f->pointers |= 1ull << loads[i].param;
  }
  free(loads);
  free(key);
}

// Each parameter's type, from the entry's parameter list [from, to): `.param .u64 NAME`,
// `.param .f32 NAME`, `.param .align 2 .b8 NAME[2]` (a struct of 2 bytes by value), ...
static void parse_param_types(Func* f, const char* from, const char* to) {
  int k = 0;
  for (const char* q = from; k < 64 && (q = find_in(q, to, ".param")) != NULL; k++) {
    const char* next = find_in(q + 6, to, ".param");
    const char* end = next ? next : to;
    char t = 0;
    int size = 0;
    static const struct {
      const char* name;
      char type;
      int size;
    } kinds[] = {{".u64", 'u', 8}, {".s64", 'i', 8}, {".b64", 'u', 8}, {".f64", 'd', 8},
                 {".u32", 'u', 4}, {".s32", 'i', 4}, {".b32", 'u', 4}, {".f32", 'f', 4},
                 {".u16", 'u', 2}, {".s16", 'i', 2}, {".b16", 'u', 2}, {".f16", 'u', 2},
                 {".u8", 'u', 1},  {".s8", 'i', 1}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0] && !t; i++)
      if (find_in(q + 6, end, kinds[i].name)) t = kinds[i].type, size = kinds[i].size;
    const char* b8 = find_in(q + 6, end, ".b8");
    if (!t && b8) {
      // A struct by value: `NAME[N]`. Up to 8 bytes it travels as an integer of its size
      // (the half types, fp8); larger ones are not read (0: the launch is refused).
      const char* br = find_in(b8, end, "[");
      int n = 0;
      if (br && sscanf(br + 1, "%d", &n) == 1 && (n == 1 || n == 2 || n == 4 || n == 8)) t = 'u', size = n;
    }
    f->types[k] = t;
    f->sizes[k] = (unsigned char)size;
    q = end - 1;
  }
  f->types[k] = 0;
}

// The end of the body that opens at `body` (its matching '}'), or the text's end.
static const char* body_end(const char* body) {
  int depth = 0;
  for (const char* p = body; *p; p++) {
    if (*p == '{') depth++;
    else if (*p == '}' && --depth == 0) return p;
  }
  return body + strlen(body);
}

static Module* load_ptx(const char* ptx) {
  Module* m = calloc(1, sizeof(Module));
  // `// NAME.cu fnv1a64 HEX` (crates/keydiff-kernels/build.rs): "NAME.cu\tHEX", as
  // exec/build.sh's kx_sources.tsv writes it.
  char source[80] = "";
  const char* mark = strstr(ptx, ".cu fnv1a64 ");
  if (mark) {
    const char* start = mark;
    while (start > ptx && start[-1] != ' ' && start[-1] != '/' && start[-1] != '\n') start--;
    char name[32], hex[17];
    if (mark - start < (long)sizeof name - 3 && sscanf(mark + 12, "%16[0-9a-f]", hex) == 1) {
      snprintf(name, sizeof name, "%.*s.cu", (int)(mark - start), start);
      snprintf(source, sizeof source, "%s\t%s", name, hex);
    }
  }
  const char* p = ptx;
  while ((p = strstr(p, ".entry ")) != NULL) {
    p += 7;
    while (*p == ' ' || *p == '\t') p++;
    const char* e = p;
    while (*e && *e != '(' && *e != ' ' && *e != '\n' && *e != '\t' && *e != '{') e++;
    Func* f = calloc(1, sizeof(Func));
    f->name = strndup(p, (size_t)(e - p));
    memcpy(f->source, source, sizeof source);
    // The directives (.maxntid, .reqntid, ...) sit before the body's '{'.
    const char* body = strchr(e, '{');
    f->maxntid = body ? parse_maxntid(e, body) : 0;
    if (body) {
      // The parameters, and the body (to its matching brace: not a .func after it).
      const char* close = find_in(e, body, ")");
      for (const char* q = e; close && (q = find_in(q, close, ".param")) != NULL; q++) f->n_params++;
      if (close) parse_param_types(f, e, close);
      const char* end = body_end(body);
      parse_pointers(f, body, end);
      static const char* const sync[] = {"bar.", "barrier", "shfl.", "vote.", "match.", "redux.", "call"};
      f->plain = 1;
      for (size_t i = 0; i < sizeof sync / sizeof sync[0]; i++)
        if (find_in(body, end, sync[i])) f->plain = 0;
    }
    f->next = m->funcs;
    m->funcs = f;
    p = e;
  }
  return m;
}

// ---------------------------------------------------------------------------------------
// Driver API.

static int dummy_ctx, dummy_stream, dummy_event, dummy_pool;

CUresult cuInit(unsigned int flags) {
  (void)flags;
  return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  (void)d;
  snprintf(name, (size_t)len, "keydiff mock GPU (no kernels run)");
  return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
  (void)d;
  *bytes = total_mem();
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(CUuuid* u, CUdevice d) {
  (void)d;
  memset(u, 0x4b, sizeof(*u));
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(CUuuid* u, CUdevice d) { return cuDeviceGetUuid(u, d); }
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 50331648; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: *v = 0; break;
    default: *v = 0; break;
  }
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  (void)d;
  *c = (CUcontext)&dummy_ctx;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  (void)d;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  (void)c;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = (CUcontext)&dummy_ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext c) {
  (void)c;
  return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent_v2(CUcontext* c) {
  if (c) *c = (CUcontext)&dummy_ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) {
  COUNT(n_sync);
  return CUDA_SUCCESS;
}
CUresult cuCtxSetLimit(CUlimit l, size_t v) {
  (void)l;
  (void)v;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetLimit(size_t* v, CUlimit l) {
  (void)l;
  *v = 0;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream* s, unsigned int flags) {
  (void)flags;
  *s = (CUstream)&dummy_stream;
  return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned int flags, int prio) {
  (void)prio;
  return cuStreamCreate(s, flags);
}
CUresult cuStreamDestroy_v2(CUstream s) {
  (void)s;
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s) {
  (void)s;
  COUNT(n_sync);
  return CUDA_SUCCESS;
}
CUresult cuStreamQuery(CUstream s) {
  (void)s;
  return CUDA_SUCCESS;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) {
  (void)s;
  (void)e;
  (void)f;
  return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* st) {
  (void)s;
  *st = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned int flags) {
  (void)flags;
  *e = (CUevent)&dummy_event;
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) {
  (void)e;
  return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
  (void)e;
  (void)s;
  return CUDA_SUCCESS;
}
CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int f) {
  (void)f;
  return cuEventRecord(e, s);
}
CUresult cuEventSynchronize(CUevent e) {
  (void)e;
  COUNT(n_sync);
  return CUDA_SUCCESS;
}
CUresult cuEventQuery(CUevent e) {
  (void)e;
  return CUDA_SUCCESS;
}
// Timings are not measured: every interval reads as 1 µs.
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
  (void)a;
  (void)b;
  *ms = 0.001f;
  return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuMemAlloc_v2(CUdeviceptr* d, size_t bytes) { return mem_alloc(d, bytes, "cuMemAlloc"); }
CUresult cuMemAllocAsync(CUdeviceptr* d, size_t bytes, CUstream s) {
  (void)s;
  return mem_alloc(d, bytes, "cuMemAllocAsync");
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr* d, size_t bytes, CUmemoryPool p, CUstream s) {
  (void)p;
  (void)s;
  return mem_alloc(d, bytes, "cuMemAllocFromPoolAsync");
}
CUresult cuMemFree_v2(CUdeviceptr d) { return mem_free(d, "cuMemFree"); }
CUresult cuMemFreeAsync(CUdeviceptr d, CUstream s) {
  (void)s;
  return mem_free(d, "cuMemFreeAsync");
}
CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total_b) {
  pthread_mutex_lock(&mem_lock);
  size_t t = total_mem();
  if (free_b) *free_b = t - used;
  if (total_b) *total_b = t;
  pthread_mutex_unlock(&mem_lock);
  return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int flags) {
  (void)flags;
  *p = calloc(1, bytes ? bytes : 1);
  return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
CUresult cuMemFreeHost(void* p) {
  free(p);
  return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  CUresult r = lock_range(dst, n, "copy host to device");
  if (r != CUDA_SUCCESS) return r;
  if (n) memcpy((void*)(uintptr_t)dst, src, n);
  pthread_mutex_unlock(&mem_lock);
  COUNT(n_htod);
  ADD(b_htod, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  (void)s;
  return cuMemcpyHtoD_v2(dst, src, n);
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  CUresult r = lock_range(src, n, "copy device to host");
  if (r != CUDA_SUCCESS) return r;
  if (n) memcpy(dst, (const void*)(uintptr_t)src, n);
  pthread_mutex_unlock(&mem_lock);
  COUNT(n_dtoh);
  ADD(b_dtoh, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
  (void)s;
  return cuMemcpyDtoH_v2(dst, src, n);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  if (!mock_device_range((uintptr_t)src, n))
    return mock_error(CUDA_ERROR_INVALID_VALUE, "copy device to device (source): %zu bytes at %#llx leave "
                      "every live allocation", n, (unsigned long long)src);
  CUresult r = lock_range(dst, n, "copy device to device (destination)");
  if (r != CUDA_SUCCESS) return r;
  // The source is checked again under the lock the copy holds.
  int ok = in_range((uintptr_t)src, n);
  if (ok && n) memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
  pthread_mutex_unlock(&mem_lock);
  if (!ok) return mock_error(CUDA_ERROR_INVALID_VALUE, "copy device to device: the source was freed meanwhile");
  COUNT(n_dtod);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  (void)s;
  return cuMemcpyDtoD_v2(dst, src, n);
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoD_v2(dst, src, n); }
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  (void)s;
  return cuMemcpyDtoD_v2(dst, src, n);
}
// Sets n values of `width` bytes (1, 2 or 4) to v.
static CUresult fill(CUdeviceptr d, unsigned v, size_t n, size_t width, const char* what) {
  COUNT(n_memset);
  size_t bytes;
  if (__builtin_mul_overflow(n, width, &bytes))
    return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: %zu values overflow", what, n);
  CUresult r = lock_range(d, bytes, what);
  if (r != CUDA_SUCCESS) return r;
  if (width == 1) memset((void*)(uintptr_t)d, (int)(v & 0xff), n);
  for (size_t i = 0; width > 1 && i < n; i++) {
    if (width == 2) ((unsigned short*)(uintptr_t)d)[i] = (unsigned short)v;
    else ((unsigned int*)(uintptr_t)d)[i] = v;
  }
  pthread_mutex_unlock(&mem_lock);
  return CUDA_SUCCESS;
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return fill(d, v, n, 1, "memset (8 bits)"); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
  (void)s;
  return cuMemsetD8_v2(d, v, n);
}
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return fill(d, v, n, 2, "memset (16 bits)"); }
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) {
  (void)s;
  return cuMemsetD16_v2(d, v, n);
}
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { return fill(d, v, n, 4, "memset (32 bits)"); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) {
  (void)s;
  return cuMemsetD32_v2(d, v, n);
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* p, CUdevice d) {
  (void)d;
  *p = (CUmemoryPool)&dummy_pool;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetMemPool(CUmemoryPool* p, CUdevice d) { return cuDeviceGetDefaultMemPool(p, d); }
CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool p) {
  (void)d;
  (void)p;
  return CUDA_SUCCESS;
}
CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t keep) {
  (void)p;
  (void)keep;
  return CUDA_SUCCESS;
}
// The pool holds exactly what is allocated (no cached blocks): reserved = used.
CUresult cuMemPoolSetAttribute(CUmemoryPool p, CUmemPool_attribute a, void* v) {
  (void)p;
  pthread_mutex_lock(&mem_lock);
  switch (a) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: release_threshold = *(cuuint64_t*)v; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: used_high = used; break;  // may only be reset
    default: break;
  }
  pthread_mutex_unlock(&mem_lock);
  return CUDA_SUCCESS;
}
CUresult cuMemPoolGetAttribute(CUmemoryPool p, CUmemPool_attribute a, void* v) {
  (void)p;
  pthread_mutex_lock(&mem_lock);
  switch (a) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t*)v = release_threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t*)v = used; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t*)v = used_high; break;
    default: *(int*)v = 0; break;
  }
  pthread_mutex_unlock(&mem_lock);
  return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  const char* text = image;
  if (!text) return mock_error(CUDA_ERROR_INVALID_VALUE, "cuModuleLoadData: no image");
  if (!strstr(text, ".version") || !strstr(text, ".target"))
    return mock_unimplemented("cuModuleLoadData of a cubin or fatbin (the mock reads PTX text only)");
  Module* mod = load_ptx(text);
  pthread_mutex_lock(&mod_lock);
  mod->next = modules;
  modules = mod;
  pthread_mutex_unlock(&mod_lock);
  *m = (CUmodule)mod;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule m) {
  (void)m;  // kept for the exit report
  return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction* out, CUmodule m, const char* name) {
  for (Func* f = ((Module*)m)->funcs; f; f = f->next) {
    if (strcmp(f->name, name) == 0) {
      *out = (CUfunction)f;
      return CUDA_SUCCESS;
    }
  }
  return mock_error(CUDA_ERROR_NOT_FOUND,
                    "kernel `%s` is not in the module it is asked of (named symbol not found)", name);
}
CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction fn) {
  Func* f = (Func*)fn;
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = f->maxntid ? (int)f->maxntid : 1024; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = f->max_dynamic_shared; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 32; break;
    default: *v = 0; break;
  }
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction fn, CUfunction_attribute a, int v) {
  Func* f = (Func*)fn;
  if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (v < 0 || v > 232448)
      return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: dynamic shared memory %d past 227 KiB",
                        f->name, v);
    f->max_dynamic_shared = v;
  }
  return CUDA_SUCCESS;
}
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache c) {
  (void)f;
  (void)c;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------
// The executing mock: with MOCKCUDA_EXEC=DIR (the kernel libraries exec/build.sh makes), a
// launch runs the kernel's host build over the CPU emulation (exec/runtime.cpp) after the
// checks above, so that device memory holds what the GPU would compute.

typedef int (*KxLaunch)(void (*)(void), int, const char*, const unsigned char*, void**, unsigned,
                        unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, int, char*,
                        size_t);
static pthread_once_t exec_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t exec_lock = PTHREAD_MUTEX_INITIALIZER;  // the lookups' caches
static void* exec_libs[64];
static int exec_n = 0;

// The runtime-launched kernels' host builds (exec/build.sh's kx_runtime.tsv, one line each:
// the name the binary registers the kernel by, the host symbol, and the parameters' types and
// sizes as KxLaunch takes them, read from the symbol's demangled name).
typedef struct RtKernel {
  char* key;
  char* sym;
  int n_params;
  char types[65];
  unsigned char sizes[64];
} RtKernel;
static RtKernel* rt_index = NULL;
static int rt_n = 0;

static void exec_index_load(const char* dir) {
  char path[4096];
  snprintf(path, sizeof path, "%s/kx_runtime.tsv", dir);
  FILE* in = fopen(path, "r");
  if (!in) return;
  char line[8192];
  int cap = 0;
  while (fgets(line, sizeof line, in)) {
    char* save = NULL;
    char* key = strtok_r(line, "\t\n", &save);
    char* sym = strtok_r(NULL, "\t\n", &save);
    char* types = strtok_r(NULL, "\t\n", &save);
    char* sizes = strtok_r(NULL, "\t\n", &save);
    if (!key || !sym || !types || !sizes || strlen(types) != strlen(sizes) || strlen(types) > 64) continue;
    if (types[0] == '-') types = sizes = "";  // no parameters
    if (strspn(sizes, "12348") != strlen(sizes) || strspn(types, "uifd") != strlen(types)) continue;
    if (rt_n == cap) {
      int grown = cap ? 2 * cap : 1024;
      RtKernel* more = realloc(rt_index, (size_t)grown * sizeof *rt_index);
      if (!more) break;
      rt_index = more, cap = grown;
    }
    RtKernel* k = &rt_index[rt_n++];
    memset(k, 0, sizeof *k);
    k->key = strdup(key);
    k->sym = strdup(sym);
    k->n_params = (int)strlen(types);
    memcpy(k->types, types, (size_t)k->n_params + 1);
    for (int i = 0; i < k->n_params; i++) k->sizes[i] = (unsigned char)(sizes[i] - '0');
  }
  fclose(in);
}

// exec/build.sh's kx_sources.tsv: "NAME.cu\tHEX" for each of our sources it built (FNV-1a 64).
static char exec_sources[8][80];
static int exec_sources_n = 0;

static void exec_sources_load(const char* dir) {
  char path[4096], line[256];
  snprintf(path, sizeof path, "%s/kx_sources.tsv", dir);
  FILE* in = fopen(path, "r");
  if (!in) return;
  while (exec_sources_n < 8 && fgets(line, sizeof line, in)) {
    line[strcspn(line, "\n")] = 0;
    if (strlen(line) < sizeof exec_sources[0]) strcpy(exec_sources[exec_sources_n++], line);
  }
  fclose(in);
}

// NULL when the host build in MOCKCUDA_EXEC is of the source `f`'s PTX was compiled from (a
// PTX of candle's says nothing: its host build is of the version Cargo.lock pins), else why not.
static const char* exec_other_source(const Func* f) {
  if (!f->source[0])
    return strncmp(f->name, "keydiff_", 8) == 0
               ? "its PTX has no source mark (a binary built before build.rs marked it): rebuild it"
               : NULL;
  if (exec_sources_n == 0)
    return "MOCKCUDA_EXEC has no kx_sources.tsv (built before it was written): run exec/build.sh again";
  for (int i = 0; i < exec_sources_n; i++)
    if (strcmp(exec_sources[i], f->source) == 0) return NULL;
  return "another source";
}

static void exec_open(void) {
  const char* dir = getenv("MOCKCUDA_EXEC");
  DIR* d = dir ? opendir(dir) : NULL;
  if (!d) {
    fprintf(stderr, "mockcuda: MOCKCUDA_EXEC=%s is not a folder\n", dir ? dir : "");
    return;
  }
  struct dirent* e;
  while ((e = readdir(d)) != NULL && exec_n < 64) {
    if (strncmp(e->d_name, "libkx_", 6) != 0) continue;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      fprintf(stderr, "mockcuda: %s\n", dlerror());
      continue;
    }
    exec_libs[exec_n++] = h;
  }
  closedir(d);
  exec_index_load(dir);
  exec_sources_load(dir);
}

static CUresult exec_launch(Func* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, void** params) {
  pthread_once(&exec_once, exec_open);
  pthread_mutex_lock(&exec_lock);
  for (int i = 0; i < exec_n && !f->host_fn; i++) {
    void* fn = dlsym(exec_libs[i], f->name);
    if (fn) f->host_run = dlsym(exec_libs[i], "kx_launch"), f->host_fn = fn;
  }
  void (*fn)(void) = (void (*)(void))f->host_fn;
  KxLaunch run = (KxLaunch)f->host_run;
  pthread_mutex_unlock(&exec_lock);
  if (!fn || !run)
    return mock_error(CUDA_ERROR_NOT_FOUND, "%s: no host build of this kernel to run (MOCKCUDA_EXEC)", f->name);
  const char* other = exec_other_source(f);
  if (other && strcmp(other, "another source") != 0)
    return mock_error(CUDA_ERROR_INVALID_SOURCE, "%s: %s", f->name, other);
  if (other) {
    const char* tab = strchr(f->source, '\t');
    return mock_error(CUDA_ERROR_INVALID_SOURCE,
                      "%s: the binary's kernels come from another source than MOCKCUDA_EXEC's host "
                      "build (its PTX is of %.*s with FNV-1a 64 %s; see kx_sources.tsv there): "
                      "build both from one tree",
                      f->name, (int)(tab ? tab - f->source : 0), f->source, tab ? tab + 1 : f->source);
  }
  if (!params)
    return mock_unimplemented("cuLaunchKernel with arguments in `extra` (the executing mock takes kernelParams)");
  for (int k = 0; k < f->n_params; k++)
    if (k >= 64 || !f->types[k])
      return mock_error(CUDA_ERROR_NOT_SUPPORTED, "%s: parameter %d of a type the executing mock cannot pass",
                        f->name, k);
  char err[512] = "";
  if (run(fn, f->n_params, f->types, f->sizes, params, gx, gy, gz, bx, by, bz, shmem, f->plain, err, sizeof err))
    return mock_error(CUDA_ERROR_LAUNCH_FAILED, "%s: %s", f->name, err);
  return CUDA_SUCCESS;
}

// A launch through the runtime (mockcudart.c: candle's statically linked kernels, the GGUF
// matmuls), checked there, run here by its host build. `cache` (the caller's, per kernel)
// keeps what the lookup found.
CUresult mock_exec_runtime_launch(const char* name, void** cache, unsigned gx, unsigned gy, unsigned gz,
                                  unsigned bx, unsigned by, unsigned bz, unsigned shmem, void** params) {
  pthread_once(&exec_once, exec_open);
  pthread_mutex_lock(&exec_lock);
  Func* f = (Func*)*cache;
  if (!f) {
    for (int i = 0; i < rt_n && !f; i++) {
      if (strcmp(rt_index[i].key, name) != 0) continue;
      for (int j = 0; j < exec_n; j++) {
        void* fn = dlsym(exec_libs[j], rt_index[i].sym);
        if (!fn) continue;
        f = calloc(1, sizeof(Func));
        f->name = strdup(name);
        f->n_params = rt_index[i].n_params;
        memcpy(f->types, rt_index[i].types, sizeof f->types);
        memcpy(f->sizes, rt_index[i].sizes, sizeof f->sizes);
        f->host_fn = fn;
        f->host_run = dlsym(exec_libs[j], "kx_launch");
        break;
      }
    }
    *cache = f;
  }
  pthread_mutex_unlock(&exec_lock);
  if (!f)
    return mock_error(CUDA_ERROR_NOT_FOUND, "%s: no host build of this runtime-launched kernel to run (MOCKCUDA_EXEC)",
                      name);
  return exec_launch(f, gx, gy, gz, bx, by, bz, shmem, params);
}

CUresult cuLaunchKernel(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, CUstream s, void** params, void** extra) {
  (void)s;
  (void)extra;
  Func* f = (Func*)fn;
  const char* n = f ? f->name : "(null)";
  if (!f) return mock_error(CUDA_ERROR_INVALID_HANDLE, "launch of a null function");
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0)
    return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: launch with an empty grid (%u,%u,%u) or block (%u,%u,%u)",
                      n, gx, gy, gz, bx, by, bz);
  if (gy > 65535 || gz > 65535 || gx > 2147483647u)
    return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: grid (%u,%u,%u) past the limits (2^31-1, 65535, 65535)",
                      n, gx, gy, gz);
  unsigned long long threads = (unsigned long long)bx * by * bz;
  if (bx > 1024 || by > 1024 || bz > 64 || threads > 1024)
    return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: block (%u,%u,%u) past 1024 threads", n, bx, by, bz);
  if (f->maxntid && threads > f->maxntid)
    return mock_error(CUDA_ERROR_INVALID_VALUE,
                      "%s: %llu threads a block, past its __launch_bounds__ of %u (too many resources requested)",
                      n, threads, f->maxntid);
  int shared_limit = f->max_dynamic_shared > 49152 ? f->max_dynamic_shared : 49152;
  if ((int)shmem > shared_limit)
    return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: %u bytes of dynamic shared memory, past %d", n, shmem,
                      shared_limit);
  if (!params && !extra) return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: launch without arguments", n);
  // Every pointer parameter (see parse_pointers) is null or inside a live allocation (or just
  // past its end): not freed memory, not an offset past its buffer, not an integer in a
  // pointer's place.
  for (int k = 0; params && k < f->n_params && k < 64; k++) {
    if (!(f->pointers >> k & 1)) continue;
    unsigned long long v;
    memcpy(&v, params[k], sizeof v);
    // One past an allocation's end is a pointer too (an empty view at a buffer's end).
    if (v && !mock_device_range((uintptr_t)v, 1) && !mock_device_range((uintptr_t)v - 1, 1))
      return mock_error(CUDA_ERROR_INVALID_VALUE, "%s: pointer parameter %d (%#llx) is in no live allocation", n, k,
                        v);
  }
  __atomic_add_fetch(&f->launches, 1, __ATOMIC_RELAXED);
  const char* exec = getenv("MOCKCUDA_EXEC");
  if (exec && *exec) return exec_launch(f, gx, gy, gz, bx, by, bz, shmem, params);
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char** s) { return mock_error_name(e, s); }
CUresult cuGetErrorString(CUresult e, const char** s) { return mock_error_name(e, s); }

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute a, CUdeviceptr p) {
  if (a == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) {
    *(unsigned int*)data = mock_device_range((uintptr_t)p, 1) ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    return CUDA_SUCCESS;
  }
  return mock_unimplemented("cuPointerGetAttribute (this attribute)");
}

// ---------------------------------------------------------------------------------------
// The exit report.

__attribute__((destructor)) static void report(void) {
  FILE* out = mock_log();
  if (!out) return;
  // One write at the close, so that processes appending to the same log do not interleave.
  static char buf[1 << 20];
  setvbuf(out, buf, _IOFBF, sizeof buf);
  for (Module* m = modules; m; m = m->next)
    for (Func* f = m->funcs; f; f = f->next)
      if (f->launches) fprintf(out, "launch %s %llu\n", f->name, f->launches);
  fprintf(out, "calls alloc %llu free %llu memset %llu copy-htod %llu copy-dtoh %llu copy-dtod %llu sync %llu\n",
          n_alloc, n_free, n_memset, n_htod, n_dtoh, n_dtod, n_sync);
  fprintf(out, "bytes htod %llu dtoh %llu\n", b_htod, b_dtoh);
  fclose(out);
}
