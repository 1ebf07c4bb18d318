// The emulation's memory checker: a race detector and a check for __shared__ memory read before
// it is written, over every load and store of the kernels.
//
// kernels/emu/launch.cpp (with the kernels) is compiled with -fsanitize=thread, which makes
// the compiler call __tsan_read4(addr), __tsan_write8(addr), ... around every memory access.
// No ThreadSanitizer runtime is linked: race.cpp, compiled without instrumentation, defines
// those entry points and keeps a shadow word per byte the kernel touches, recording the last
// writer and reader (global thread id and barrier interval). Then:
//   - two accesses to a byte race when they come from different threads, at least one writes,
//     not both are atomics (atomicAdd, atomicOr), and nothing orders them: threads of one block
//     are ordered by __syncthreads only (warp-synchronous calls do not order memory), and
//     threads of different blocks never (no kernel here synchronises across blocks);
//   - a __shared__ byte read (or atomically updated) before any thread of its block wrote it is
//     an error: CUDA leaves shared memory undefined at the start of a block;
//   - a global access outside its buffer but inside the buffer's mapping (the slack before the
//     guard page) is out of bounds, reads included; one inside the buffer but outside the view
//     the launch works on (row padding, rows past the view), or in another head's rows than
//     the block's, is an error too.
// The first finding fails the launch with a message that names the threads, the block, the
// barrier interval and, for global memory, the fenced buffer and byte offset.
//
// Which memory is which: global memory is what the Rust wrappers fence
// (crates/keydiff-kernels/src/fence.rs registers each buffer with kd_emu_track_global, and
// the wrappers say which heads and rows of it a launch may touch: kd_emu_set_view);
// accesses to the fibers' own stacks are private; everything else a kernel touches is its
// __shared__ memory (the emulation's own state is read with tracking off: KD_EMU_UNTRACKED).
//
// What it does not see: accesses the compiler removes or keeps in registers (as on a GPU, they
// are not memory accesses), memory a kernel reaches outside fenced buffers other than its
// shared memory (treated as shared), and anything about the GPU's memory model beyond "ordered
// by a barrier or not".
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>

namespace kd_race {

struct Launch;

// The state the instrumentation hooks read, per OS thread (launches on several threads run
// independently).
struct Tls {
  // Set while a fiber runs kernel code; cleared by the emulation's own functions while they
  // run (Untracked), so that only the kernels' accesses are checked.
  bool on = false;
  Launch* launch = nullptr;  // the launch running on this thread, if it is checked
  uint32_t thread = 0;       // the running fiber: block linear index * threads + tid + 1
  uint32_t epoch = 0;        // __syncthreads its block has passed
};
extern thread_local Tls tls;

// Starts checking a launch of grid (gx, gy, gz) x `threads` on this OS thread; [stack_lo,
// stack_hi) holds the fibers' stacks. Returns an error (and checks nothing) when the launch has
// more threads than the 32-bit thread ids hold.
std::string begin_launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                         uintptr_t stack_lo, uintptr_t stack_hi);
// A new block begins: its shared memory is undefined again.
void begin_block();
// Ends the launch: "" or the first finding (and how many more there were).
std::string end_launch();

enum Kind { kRead = 0, kWrite = 1, kAtomic = 2 };
// An access the instrumentation does not see: the emulated atomics call it, with the kernel's
// instruction (their return address) for reports.
void access(const void* p, size_t n, Kind kind, const void* pc);

}  // namespace kd_race

// Global memory, as the Rust wrappers allocate it: the buffer [p, p + n) inside its mapping
// [map_lo, map_hi) (fence.rs), with its name for reports. An access to the mapping outside the
// buffer is reported as out of bounds (the guard pages beyond it fault).
// (noexcept: an allocation failure terminates, it cannot cross into Rust.)
extern "C" void kd_emu_track_global(const void* p, size_t n, uintptr_t map_lo, uintptr_t map_hi,
                                    const char* name, size_t name_len) noexcept;
extern "C" void kd_emu_untrack_global(const void* p) noexcept;
// What a launch may touch of a tracked buffer, in bytes: `heads` of `rows` rows of `row_bytes`
// (strides head_stride, row_stride; heads and rows must not overlap), and which block index
// names the head (0: blockIdx.x, 1: blockIdx.y; -1: any block may touch any head). An access
// to a byte outside every row (padding, rows past the view) or, for a block of head h, to
// another head's rows is reported. Heads may hold rows ([kv, n, d]) or rows heads
// ([n, kv, d]). Returns 0; 1 when the view does not fit the buffer (or no buffer starts at p);
// 2 when rows or heads overlap (a zero stride, say) or do not nest: then the view is not
// checked. A refused view also clears an earlier one.
extern "C" int kd_emu_set_view(const void* p, uint64_t heads, uint64_t head_stride,
                               uint64_t rows, uint64_t row_stride, uint64_t row_bytes,
                               int head_axis) noexcept;
