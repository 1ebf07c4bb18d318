// A CPU emulation of the CUDA execution model, enough to run kernels/*.cu on a machine without a
// GPU: every CUDA thread of a block is a fiber (its own stack, see Context), blocks run one
// after another, and the fibers switch only at synchronisation points (__syncthreads and the
// warp-synchronous intrinsics), in an order drawn from a seed. The kernels' source is compiled
// unchanged by the host C++ compiler (kernels/emu/launch.cpp includes it);
// crates/keydiff-kernels (feature `emulate`) runs it against the CPU twins.
//
// What it checks beyond the kernels' arithmetic:
//   - launch configurations: block size <= 1024 and a multiple of 32, <= the kernel's
//     __launch_bounds__, grid.y/z <= 65535;
//   - warp-synchronous intrinsics: only full masks; every lane of the warp must reach the same
//     call (same source line, same count per lane), and none may have exited; otherwise the
//     launch fails;
//   - __syncthreads: a barrier that some threads never reach (divergent code) is a deadlock, and
//     the launch fails naming it;
//   - any schedule: results must not depend on the order threads run between barriers (the
//     tests run several seeds), and float atomics add in a different order for every seed;
//   - data races and uninitialised shared memory, whatever the schedule: every load and store
//     of the kernels goes through the memory checker of race.h (compiled in with
//     -fsanitize=thread, no runtime), which fails the launch on two unordered accesses to a
//     byte by different threads (one a write, not both atomic), and on a __shared__ byte read
//     before its block wrote it.
// Out-of-bounds accesses to global memory: the Rust wrappers hand the kernels buffers fenced by
// guard pages (crates/keydiff-kernels/src/fence.rs), and the memory checker reports accesses
// in a buffer's mapping outside the buffer (either side), outside the view a launch works on,
// or in another head's rows than the block's. Arrays of known size (the __shared__ ones)
// indexed out of bounds trap: build.rs compiles this with -fsanitize=bounds in trap mode.
// What it cannot check: loads the compiler removes, memcpy/memset calls under GCC (not
// instrumented; the kernels have none), the GPU's memory model beyond "ordered by a barrier or
// not" (fences, weaker orderings), timing, and anything about the real compiler or hardware.
// It complements the GPU run of scripts/gpu-check.sh (with compute-sanitizer); it does not
// replace it.
//
// Shared memory is one static thread_local per declaration, reused by every block (and launch)
// on the OS thread; CUDA leaves it undefined at a block's start, and the checker treats it so.

#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "race.h"

#ifndef KD_EMU_REAL_FP_TYPES
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
#endif
// KD_EMU_REAL_FP_TYPES: the toolkit's own cuda_fp16.h / cuda_bf16.h (host-compilable) give
// these types (and dim3, uint4 above) and their conversions instead (scripts/cuda/mock/exec:
// candle's kernels need their operators).
#ifndef KD_EMU_REAL_FP_TYPES
struct __half {
  uint16_t x;
};
struct __nv_bfloat16 {
  uint16_t x;
};
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Blocks run one after another on one OS thread (fibers share its thread-locals), so one
// thread-local static per declaration is the block's shared memory; other OS threads running
// other launches have their own. The race checker finds it by elimination (race.h).
#define __shared__ static thread_local

// The emulation's own functions are not instrumented (race.h), and those that kernel code calls
// also switch tracking off while they run: what they call from the standard library may be
// instrumented, and their accesses are not the kernel's.
#define KD_EMU_UNTRACKED __attribute__((no_sanitize("thread")))

namespace kd_emu {

struct Untracked {
  bool was;
  KD_EMU_UNTRACKED Untracked() : was(kd_race::tls.on) { kd_race::tls.on = false; }
  KD_EMU_UNTRACKED ~Untracked() { kd_race::tls.on = was; }
};

constexpr int kWarp = 32;
constexpr unsigned kMaxThreads = 1024;
constexpr size_t kStackBytes = 64 * 1024;

// The fibers' stacks: kStackBytes each, each above a guard page that nothing may touch, so
// that a thread that outgrows its stack faults (SIGSEGV) at once instead of writing over its
// neighbour's frames. (Frames larger than a page still meet the guard: the emulation is
// built with -fstack-clash-protection, which touches every page a frame takes.) A fresh
// reservation reads as zero; a reused one holds what the last launch left. Each reservation
// takes about two mappings a thread (guard and stack alternate), against the kernel's
// vm.max_map_count (65530 by default); a failure to map is std::bad_alloc, reported by the
// launch.
class Stacks {
 public:
  Stacks() = default;
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
  KD_EMU_UNTRACKED ~Stacks() { release(); }

  // Room for `threads` stacks (what is there is kept when it is enough); throws
  // std::bad_alloc when the pages cannot be had.
  KD_EMU_UNTRACKED void reserve(unsigned threads) {
    if (threads <= n_) return;
    release();
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    guard_ = page;
    slot_ = (kStackBytes + page - 1) / page * page + guard_;
    size_ = slot_ * threads;
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      size_ = 0;
      throw std::bad_alloc();
    }
    base_ = (char*)p;
    n_ = threads;
    for (unsigned t = 0; t < threads; ++t)
      if (mprotect(base_ + (size_t)t * slot_, guard_, PROT_NONE) != 0) {
        release();
        throw std::bad_alloc();
      }
  }
  // The lowest address of thread t's stack (it grows down from kStackBytes above).
  KD_EMU_UNTRACKED char* at(unsigned t) const { return base_ + (size_t)t * slot_ + guard_; }
  // The range all the stacks (and their guards) take.
  KD_EMU_UNTRACKED uintptr_t lo() const { return (uintptr_t)base_; }
  KD_EMU_UNTRACKED uintptr_t hi() const { return (uintptr_t)(base_ + size_); }

 private:
  KD_EMU_UNTRACKED void release() {
    if (base_) munmap(base_, size_);
    base_ = nullptr;
    size_ = 0;
    n_ = 0;
  }
  char* base_ = nullptr;
  size_t size_ = 0, slot_ = 0, guard_ = 0;
  unsigned n_ = 0;
};

// A fiber's saved context. On x86-64, a stack pointer: kd_emu_switch saves the callee-saved
// registers on the stack it leaves and restores them from the one it enters, with none of the
// signal-mask system calls swapcontext makes at every switch (most of the emulation's time
// went there). Elsewhere, or with KD_EMU_UCONTEXT defined, ucontext.
// (Not under CET shadow stacks: the switch returns on another stack than it was called on.)
#if defined(__x86_64__) && !defined(KD_EMU_UCONTEXT) && !defined(__CET__)
#define KD_EMU_FAST_SWITCH 1
struct Context {
  void* sp = nullptr;
};
#else
#define KD_EMU_FAST_SWITCH 0
struct Context {
  ucontext_t uc;
};
#endif

struct Fiber {
  Context ctx;
  dim3 tid;
  int lane = 0, warp = 0;
  bool done = false;
  uint64_t warp_calls = 0;  // warp-synchronous calls made so far
};

struct Warp {
  std::vector<int> waiters;
  uint64_t call = 0;  // the call number the current waiters are at
  const char* file = nullptr;  // and its source line
  int line = 0;
  int exited = 0;
  uint64_t vals[2][kWarp];
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<int> runnable;
  std::vector<int> bar_waiters;
  int live = 0;
  int cur = -1;
  uint32_t epoch = 0;     // barriers passed
  uint32_t first_id = 0;  // race-checker id of thread 0 (block linear index * threads + 1)
  Context sched;
  std::mt19937_64 rng;
  std::string error;
  const std::function<void()>* body = nullptr;
  // Threads run one after another as plain calls, with no fibers (scripts/cuda/mock/exec, for
  // kernels whose PTX has no barrier or warp-synchronous instruction): nothing may park.
  bool plain = false;
};

#if KD_EMU_FAST_SWITCH
// kd_emu_switch(from, to): pushes rbp, rbx, r12-r15, stores the stack pointer in *from, loads
// `to` and pops the same registers from it, then returns on that stack. Weak, so that every
// translation unit including this header may define it. (The SysV ABI leaves the other
// registers to the caller; the floating-point control state is the same on every fiber.)
extern "C" void kd_emu_switch(void** from, void* to);
asm(".pushsection .text\n"
    ".weak kd_emu_switch\n"
    ".type kd_emu_switch, @function\n"
    "kd_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size kd_emu_switch, .-kd_emu_switch\n"
    ".popsection\n");
#endif

// Leaves `from` (its context saved there) for `to`; returns when something switches back.
KD_EMU_UNTRACKED inline void switch_to(Context& from, Context& to) {
#if KD_EMU_FAST_SWITCH
  kd_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// Per OS thread, so that launches on several threads (parallel tests) do not meet.
inline thread_local Block* g_block = nullptr;
// The fiber stacks (guards included) of the launch this OS thread runs, or [0, 0): a fault in
// there is a stack overflow (kd_emu_in_fiber_stacks, for crates/keydiff-kernels' fault handler).
inline thread_local uintptr_t g_stacks_lo = 0, g_stacks_hi = 0;
inline thread_local dim3 g_block_idx, g_block_dim, g_grid_dim;

KD_EMU_UNTRACKED inline Fiber& cur_fiber() { return g_block->fibers[g_block->cur]; }

// Back to the scheduler; returns when this fiber is made runnable again.
KD_EMU_UNTRACKED inline void park() {
  if (g_block->plain) {
    fprintf(stderr,
            "emulation: a barrier or warp-synchronous call in a kernel run without fibers\n");
    std::abort();
  }
  switch_to(cur_fiber().ctx, g_block->sched);
}

KD_EMU_UNTRACKED inline void release(std::vector<int>& waiters) {
  for (int i : waiters) g_block->runnable.push_back(i);
  waiters.clear();
}

// All live threads reached the barrier: they go on, in the next barrier interval.
KD_EMU_UNTRACKED inline void release_barrier() {
  g_block->epoch++;
  release(g_block->bar_waiters);
}

// Records the first error and parks the fiber for good: the block then ends as a deadlock, and
// the launch reports the error.
[[noreturn]] KD_EMU_UNTRACKED inline void fail(const std::string& msg) {
  if (g_block->error.empty()) g_block->error = msg;
  park();
  std::abort();  // never resumed
}

KD_EMU_UNTRACKED inline void syncthreads() {
  Untracked u;
  Block& b = *g_block;
  b.bar_waiters.push_back(b.cur);
  if ((int)b.bar_waiters.size() == b.live) release_barrier();
  park();
}

// All 32 lanes of the warp publish one value; returns the warp's 32 values. Double-buffered by
// call parity: a lane cannot reach call k + 2 (which rewrites this buffer) before every lane
// has reached call k + 1, i.e. has read call k.
KD_EMU_UNTRACKED inline const uint64_t* warp_exchange(unsigned mask, uint64_t v,
                                                      const char* what, const char* file,
                                                      int line) {
  if (mask != 0xffffffffu) fail(std::string(what) + ": only full warp masks are emulated");
  Block& b = *g_block;
  Fiber& f = cur_fiber();
  Warp& w = b.warps[f.warp];
  if (w.exited) fail(std::string(what) + " after a lane of the warp exited");
  if (w.waiters.empty()) {
    w.call = f.warp_calls;
    w.file = file;
    w.line = line;
  } else if (w.call != f.warp_calls || w.line != line || strcmp(w.file, file) != 0) {
    fail(std::string(what) + " at " + file + ":" + std::to_string(line) +
         ": lanes of the warp are at different warp-synchronous calls (diverged)");
  }
  const int parity = (int)(f.warp_calls & 1);
  f.warp_calls++;
  w.vals[parity][f.lane] = v;
  w.waiters.push_back(b.cur);
  if ((int)w.waiters.size() == kWarp) release(w.waiters);
  park();
  return w.vals[parity];
}

KD_EMU_UNTRACKED inline void trampoline() {
  Block& b = *g_block;
  (*b.body)();
  Fiber& f = cur_fiber();
  f.done = true;
  b.live--;
  Warp& w = b.warps[f.warp];
  w.exited++;
  if (!w.waiters.empty() && b.error.empty())
    b.error = "a lane exited while its warp waits in a warp-synchronous call";
  if (!b.bar_waiters.empty() && (int)b.bar_waiters.size() == b.live) release_barrier();
#if KD_EMU_FAST_SWITCH
  // Back to the scheduler for good: a finished fiber is never resumed.
  switch_to(f.ctx, b.sched);
  std::abort();
#endif
  // (ucontext: returns to the scheduler through uc_link)
}

#if KD_EMU_FAST_SWITCH
// A fiber that starts in trampoline on `stack`: its first switch pops six zeroed registers,
// then returns into trampoline with the stack aligned as after a call.
KD_EMU_UNTRACKED inline void init_context(Context& ctx, char* stack, Context* link) {
  (void)link;
  uintptr_t top = ((uintptr_t)(stack + kStackBytes)) & ~(uintptr_t)15;
  void** sp = (void**)top;
  *--sp = nullptr;  // where trampoline's return address would be (it never returns)
  *--sp = (void*)&trampoline;
  for (int i = 0; i < 6; ++i) *--sp = nullptr;
  ctx.sp = sp;
}
#else
// getcontext returns twice in general; kept out of launch's frame so that no local there can be
// clobbered (the context is only ever entered through makecontext's entry point).
KD_EMU_UNTRACKED __attribute__((noinline)) inline void init_context(Context& ctx, char* stack,
                                                                    Context* link) {
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = stack;
  ctx.uc.uc_stack.ss_size = kStackBytes;
  ctx.uc.uc_link = &link->uc;
  makecontext(&ctx.uc, trampoline, 0);
}
#endif

// What a launch's body calls: the kernel with its arguments, with the race checker tracking
// the kernel's accesses (and not the body's reads of its captures).
template <typename... P, typename... A>
KD_EMU_UNTRACKED inline void run_kernel(void (*kernel)(P...), A... args) {
  kd_race::tls.on = true;
  kernel(args...);
  kd_race::tls.on = false;
}

// Runs the blocks of a launch in a random order; returns "" or the first block's error.
KD_EMU_UNTRACKED inline std::string run_blocks(dim3 grid, dim3 block, std::mt19937_64& rng,
                                               const std::function<void()>& body,
                                               Stacks& stacks) {
  const unsigned threads = block.x * block.y * block.z;
  stacks.reserve(threads);
  std::vector<dim3> order;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.push_back(dim3{x, y, z});
  std::shuffle(order.begin(), order.end(), rng);
  g_grid_dim = grid;
  g_block_dim = block;
  Block b;
  b.body = &body;
  struct StacksScope {
    KD_EMU_UNTRACKED StacksScope(const Stacks& s) {
      g_stacks_lo = s.lo();
      g_stacks_hi = s.hi();
    }
    KD_EMU_UNTRACKED ~StacksScope() { g_stacks_lo = g_stacks_hi = 0; }
  } stacks_scope(stacks);
  for (const dim3& bi : order) {
    g_block_idx = bi;
    b.fibers.assign(threads, Fiber{});
    b.warps.assign(threads / kWarp, Warp{});
    b.runnable.clear();
    b.bar_waiters.clear();
    b.live = (int)threads;
    b.epoch = 0;
    b.first_id = (bi.x + grid.x * (bi.y + grid.y * bi.z)) * threads + 1;
    b.error.clear();
    b.rng.seed(rng());
    kd_race::begin_block();
    g_block = &b;
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = b.fibers[t];
      f.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
      f.lane = (int)(t % kWarp);
      f.warp = (int)(t / kWarp);
      init_context(f.ctx, stacks.at(t), &b.sched);
      b.runnable.push_back((int)t);
    }
    while (!b.runnable.empty()) {
      const size_t pick = (size_t)(b.rng() % b.runnable.size());
      std::swap(b.runnable[pick], b.runnable.back());
      b.cur = b.runnable.back();
      b.runnable.pop_back();
      kd_race::tls.thread = b.first_id + (uint32_t)b.cur;
      kd_race::tls.epoch = b.epoch;
      switch_to(b.sched, b.fibers[b.cur].ctx);
    }
    g_block = nullptr;
    if (b.live > 0 || !b.error.empty()) {
      int at_bar = (int)b.bar_waiters.size(), at_warp = 0;
      for (const Warp& w : b.warps) at_warp += (int)w.waiters.size();
      std::string msg = "block (" + std::to_string(bi.x) + ", " + std::to_string(bi.y) + ", " +
                        std::to_string(bi.z) + "): ";
      if (!b.error.empty()) msg += b.error + "; ";
      if (b.live > 0)
        msg += "deadlock, " + std::to_string(b.live) + " threads unfinished (" +
               std::to_string(at_bar) + " at __syncthreads, " + std::to_string(at_warp) +
               " in warp-synchronous calls)";
      return msg;
    }
  }
  return "";
}

// Ends the race checker's launch on every way out of `launch` (exceptions included).
struct RaceScope {
  KD_EMU_UNTRACKED ~RaceScope() { kd_race::end_launch(); }
};

// Runs `body` as a kernel over grid x block. Returns "" or the first error: the emulation's
// (launch configuration, divergence, deadlock), else the race checker's (race.h).
KD_EMU_UNTRACKED inline std::string launch(dim3 grid, dim3 block, unsigned launch_bounds,
                                           uint64_t seed, const std::function<void()>& body) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || threads % kWarp != 0)
    return "block of " + std::to_string(threads) + " threads (emulated: 32..1024, whole warps)";
  if (launch_bounds && threads > launch_bounds)
    return "block of " + std::to_string(threads) + " threads exceeds __launch_bounds__(" +
           std::to_string(launch_bounds) + ")";
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
      grid.x > 0x7fffffffu)
    return "grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
           std::to_string(grid.z) + ") out of CUDA's limits";
  std::mt19937_64 rng(seed);
  Stacks stacks;
  stacks.reserve(threads);
  std::string e =
      kd_race::begin_launch(grid.x, grid.y, grid.z, threads, stacks.lo(), stacks.hi());
  if (!e.empty()) return e;
  RaceScope scope;
  e = run_blocks(grid, block, rng, body, stacks);
  const std::string findings = kd_race::end_launch();
  return e.empty() ? findings : e;
}

inline uint32_t f2u(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

}  // namespace kd_emu

namespace kd_emu {
// Values, read with tracking off: the emulation's state is not the kernel's memory.
KD_EMU_UNTRACKED inline dim3 thread_idx() {
  Untracked u;
  return cur_fiber().tid;
}
KD_EMU_UNTRACKED inline dim3 block_idx() {
  Untracked u;
  return g_block_idx;
}
KD_EMU_UNTRACKED inline dim3 block_dim() {
  Untracked u;
  return g_block_dim;
}
KD_EMU_UNTRACKED inline dim3 grid_dim() {
  Untracked u;
  return g_grid_dim;
}
}  // namespace kd_emu

#define threadIdx (::kd_emu::thread_idx())
#define blockIdx (::kd_emu::block_idx())
#define blockDim (::kd_emu::block_dim())
#define gridDim (::kd_emu::grid_dim())

KD_EMU_UNTRACKED inline void __syncthreads() { kd_emu::syncthreads(); }

namespace kd_emu {
// Any value of up to 64 bits travels as its bits (CUDA has overloads for int, unsigned, float,
// their 64-bit forms, and the half types).
template <typename T>
inline uint64_t to_bits(T x) {
  static_assert(sizeof(T) <= 8, "shuffles move values of up to 64 bits");
  uint64_t b = 0;
  memcpy(&b, &x, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T x;
  memcpy(&x, &b, sizeof(T));
  return x;
}
KD_EMU_UNTRACKED inline unsigned ballot(unsigned mask, int pred, const char* file, int line) {
  Untracked u;
  const uint64_t* v = warp_exchange(mask, pred ? 1 : 0, "__ballot_sync", file, line);
  unsigned r = 0;
  for (int l = 0; l < kWarp; ++l) r |= (v[l] ? 1u : 0u) << l;
  return r;
}
template <typename T>
KD_EMU_UNTRACKED inline unsigned match_any(unsigned mask, T x, const char* file, int line) {
  Untracked u;
  const uint64_t* v = warp_exchange(mask, to_bits(x), "__match_any_sync", file, line);
  unsigned r = 0;
  for (int l = 0; l < kWarp; ++l) r |= (v[l] == to_bits(x) ? 1u : 0u) << l;
  return r;
}
// Width 32 only (the kernels use no other); a lane mask >= 32 reads the lane itself, as CUDA.
template <typename T>
KD_EMU_UNTRACKED inline T shfl_xor(unsigned mask, T x, int lane_mask, const char* file,
                                   int line) {
  Untracked u;
  const uint64_t* v = warp_exchange(mask, to_bits(x), "__shfl_xor_sync", file, line);
  const int lane = cur_fiber().lane, src = lane ^ lane_mask;
  return src < kWarp ? from_bits<T>(v[src]) : x;
}
// Width 32 only; a source lane >= 32 wraps, as CUDA's `srcLane % width`.
template <typename T>
KD_EMU_UNTRACKED inline T shfl(unsigned mask, T x, int src, const char* file, int line) {
  Untracked u;
  const uint64_t* v = warp_exchange(mask, to_bits(x), "__shfl_sync", file, line);
  return from_bits<T>(v[src & (kWarp - 1)]);
}
template <typename T>
KD_EMU_UNTRACKED inline T shfl_up(unsigned mask, T x, unsigned delta, const char* file,
                                  int line) {
  Untracked u;
  const uint64_t* v = warp_exchange(mask, to_bits(x), "__shfl_up_sync", file, line);
  const int lane = cur_fiber().lane;
  return lane >= (int)delta ? from_bits<T>(v[lane - (int)delta]) : x;
}
}  // namespace kd_emu

// The call site goes with every warp-synchronous call, so that diverged lanes are caught.
#define __ballot_sync(m, p) ::kd_emu::ballot((m), (p), __FILE__, __LINE__)
#define __match_any_sync(m, x) ::kd_emu::match_any((m), (x), __FILE__, __LINE__)
#define __shfl_xor_sync(m, x, o) ::kd_emu::shfl_xor((m), (x), (o), __FILE__, __LINE__)
#define __shfl_up_sync(m, x, d) ::kd_emu::shfl_up((m), (x), (d), __FILE__, __LINE__)
#define __shfl_sync(m, x, l) ::kd_emu::shfl((m), (x), (l), __FILE__, __LINE__)

// Threads switch only at synchronisation points, so an atomic is a plain read-modify-write,
// which the race checker is told is atomic.
KD_EMU_UNTRACKED inline float atomicAdd(float* a, float v) {
  kd_race::access(a, sizeof *a, kd_race::kAtomic, __builtin_return_address(0));
  kd_emu::Untracked u;
  const float old = *a;
  *a = old + v;
  return old;
}
KD_EMU_UNTRACKED inline unsigned atomicAdd(unsigned* a, unsigned v) {
  kd_race::access(a, sizeof *a, kd_race::kAtomic, __builtin_return_address(0));
  kd_emu::Untracked u;
  const unsigned old = *a;
  *a = old + v;
  return old;
}
KD_EMU_UNTRACKED inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  kd_race::access(a, sizeof *a, kd_race::kAtomic, __builtin_return_address(0));
  kd_emu::Untracked u;
  const unsigned long long old = *a;
  *a = old + v;
  return old;
}
KD_EMU_UNTRACKED inline unsigned atomicOr(unsigned* a, unsigned v) {
  kd_race::access(a, sizeof *a, kd_race::kAtomic, __builtin_return_address(0));
  kd_emu::Untracked u;
  const unsigned old = *a;
  *a = old | v;
  return old;
}

// Blocks run one after another, so every write of a block is seen by the blocks after it; the
// fence orders nothing more here (the race checker does not model fences: values that blocks
// of one launch pass each other go through atomics).
inline void __threadfence() {}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline unsigned __float_as_uint(float x) { return kd_emu::f2u(x); }
inline float __uint_as_float(unsigned x) { return kd_emu::u2f(x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// Rounded single operations, never fused (the emulation builds with -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
// The device's rsqrtf is within 2 ulp of 1/sqrt(x); this is the correctly rounded quotient of
// the rounded root, within 1 ulp.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

#ifndef KD_EMU_REAL_FP_TYPES
inline float __bfloat162float(__nv_bfloat16 h) { return kd_emu::u2f((uint32_t)h.x << 16); }
// f32 -> bf16, round to nearest even, as the device's conversion (and `half::bf16::from_f32`);
// a NaN stays a (quiet) NaN of its sign.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t x = kd_emu::f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((x >> 16) | 0x40u)};
  return __nv_bfloat16{(uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
// f32 -> f16, round to nearest even, as the device's conversion (and `half::f16::from_f32`).
inline __half __float2half_rn(float f) {
  const uint32_t x = kd_emu::f2u(f);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return __half{(uint16_t)(sign | 0x7e00u)};  // NaN
  if (ax >= 0x47800000u) return __half{(uint16_t)(sign | 0x7c00u)};  // to infinity
  if (ax < 0x38800000u) {
    // Below 2^-14: a subnormal, v · 2^24 units (exact scaling), rounded to nearest even.
    return __half{(uint16_t)(sign | (uint32_t)nearbyintf(kd_emu::u2f(ax) * 16777216.0f))};
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach infinity
  return __half{(uint16_t)(sign | h)};
}
inline float __half2float(__half h) {
  const uint32_t sign = (uint32_t)(h.x & 0x8000u) << 16;
  const uint32_t exp = (h.x >> 10) & 0x1fu, mant = h.x & 0x3ffu;
  if (exp == 0) {
    const float m = ldexpf((float)mant, -24);
    return sign ? -m : m;
  }
  if (exp == 31) return kd_emu::u2f(sign | 0x7f800000u | (mant << 13));
  return kd_emu::u2f(sign | ((exp + 112u) << 23) | (mant << 13));
}
#endif  // KD_EMU_REAL_FP_TYPES
