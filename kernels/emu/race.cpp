// The emulation's memory checker (see race.h). Compiled without -fsanitize=thread: it defines
// the entry points that the instrumented kernels call.

#include "race.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace kd_race {

thread_local Tls tls;

namespace {

struct View {
  uint64_t heads = 0, head_stride = 0, rows = 0, row_stride = 0, row_bytes = 0;
  int head_axis = -1;
  bool heads_outer = true;  // heads hold rows (else rows hold heads: interleaved layouts)
};

struct Range {
  uintptr_t lo, hi;          // the buffer
  uintptr_t map_lo, map_hi;  // its mapping
  std::string name;
  bool has_view = false;
  View view;
};

std::mutex g_ranges_mu;
std::vector<Range>& ranges() {
  static std::vector<Range> r;
  return r;
}

// Per byte: the last plain write, the last atomic and the last plain read (global thread id +
// 1, 0: none), the barrier interval of each, and whether several threads or blocks share the
// atomic or read role since (flags). Plain writes are single: two unordered ones are a race,
// reported when the second comes.
enum : uint8_t {
  kAMultiThread = 1,  // another thread of the atomic's block updated in its interval
  kAMultiBlock = 2,   // threads of several blocks updated atomically
  kRMultiThread = 4,  // another thread of the reader's block read in its interval
  kRMultiBlock = 8,   // threads of several blocks read
};
struct Entry {
  uint32_t gen;  // valid when equal to its memory's current generation
  uint32_t w, w_epoch;
  uint32_t a, a_epoch;
  uint32_t r, r_epoch;
  uint8_t flags;
};

constexpr int kPageBits = 12;
constexpr size_t kPageBytes = size_t(1) << kPageBits;
struct Page {
  Entry e[kPageBytes];
};

struct FreePage {
  void operator()(Page* p) const { free(p); }
};

struct Shadow {
  std::unordered_map<uintptr_t, std::unique_ptr<Page, FreePage>> pages;
  uintptr_t last_key = ~uintptr_t(0);
  Page* last = nullptr;
  uint32_t gen = 1;

  Entry& at(uintptr_t a) {
    const uintptr_t key = a >> kPageBits;
    if (key != last_key) {
      auto& p = pages[key];
      if (!p) p.reset(static_cast<Page*>(calloc(1, sizeof(Page))));
      if (!p) abort();  // out of memory in a test helper: nothing sensible to return
      last_key = key;
      last = p.get();
    }
    Entry& e = last->e[a & (kPageBytes - 1)];
    if (e.gen != gen) e = Entry{gen, 0, 0, 0, 0, 0, 0, 0};
    return e;
  }
};

}  // namespace

struct Launch {
  unsigned gx, gy, gz, threads;
  uintptr_t stack_lo, stack_hi;
  std::vector<Range> globals;  // the fenced buffers live at the launch
  size_t last_global = 0;
  Shadow global, shared;
  std::string first;
  uint64_t findings = 0;

  // The buffer whose mapping holds `a`.
  const Range* global_of(uintptr_t a) {
    if (last_global < globals.size() && a >= globals[last_global].map_lo &&
        a < globals[last_global].map_hi)
      return &globals[last_global];
    for (size_t i = 0; i < globals.size(); ++i) {
      if (a >= globals[i].map_lo && a < globals[i].map_hi) {
        last_global = i;
        return &globals[i];
      }
    }
    return nullptr;
  }

  uint32_t block_of(uint32_t id) const { return (id - 1) / threads; }
  // blockIdx.x (axis 0) or .y (axis 1) of a thread.
  uint32_t block_coord(uint32_t id, int axis) const {
    const uint32_t l = block_of(id);
    return axis == 0 ? l % gx : (l / gx) % gy;
  }

  std::string who(uint32_t id, uint32_t epoch) const {
    const uint32_t l = block_of(id), t = (id - 1) % threads;
    char buf[160];
    snprintf(buf, sizeof buf, "thread %u of block (%u, %u, %u) after %u __syncthreads", t,
             l % gx, (l / gx) % gy, l / (gx * gy), epoch);
    return buf;
  }
};

namespace {

bool concurrent(const Launch& l, uint32_t a, uint32_t a_epoch, uint32_t b, uint32_t b_epoch) {
  return a != b && (l.block_of(a) != l.block_of(b) || a_epoch == b_epoch);
}

const char* verb(Kind k) {
  return k == kRead ? "reads" : k == kWrite ? "writes" : "atomically updates";
}

std::string where(uintptr_t a, const Range* g) {
  char buf[256];
  if (g)
    snprintf(buf, sizeof buf, "`%s` byte %zu", g->name.c_str(), (size_t)(a - g->lo));
  else
    snprintf(buf, sizeof buf, "__shared__ memory at %p", (void*)a);
  return buf;
}

// The kernel's instruction, as module+offset (for addr2line).
std::string site(const void* pc) {
  Dl_info info;
  char buf[256];
  if (pc && dladdr(pc, &info) && info.dli_fname) {
    const char* base = strrchr(info.dli_fname, '/');
    snprintf(buf, sizeof buf, " (at %s+%#zx)", base ? base + 1 : info.dli_fname,
             (size_t)((uintptr_t)pc - (uintptr_t)info.dli_fbase));
    return buf;
  }
  return "";
}

void report(Launch& l, std::string msg, const void* pc) {
  if (l.findings++ == 0) l.first = msg + site(pc);
}

// Whether an earlier access by `id` (at `epoch`), or by the others sharing its role (flags
// `multi_thread` / `multi_block`), may run concurrently with thread x at epoch e.
bool unordered(const Launch& l, uint32_t id, uint32_t epoch, bool multi_thread,
               bool multi_block, uint32_t x, uint32_t e) {
  return id && (concurrent(l, id, epoch, x, e) || multi_block ||
                (multi_thread && l.block_of(id) == l.block_of(x) && epoch == e));
}

void race(Launch& l, uintptr_t a, const Range* g, Kind kind, uint32_t other, uint32_t epoch,
          const char* other_verb, const void* pc) {
  const uint32_t x = tls.thread, e = tls.epoch;
  // `other` is the last of its role; when it is ordered with x, the race is with one before.
  const bool known = concurrent(l, other, epoch, x, e);
  report(l,
         "data race on " + where(a, g) + ": " + l.who(x, e) + " " + verb(kind) + " it, and " +
             (known ? l.who(other, epoch) : std::string("another thread")) + " " + other_verb +
             " it, unordered (no __syncthreads between them, or different blocks)",
         pc);
}

void update_role(const Launch& l, uint32_t& id, uint32_t& epoch, uint8_t& flags,
                 uint8_t multi_thread, uint8_t multi_block, uint32_t x, uint32_t e) {
  if (!id) {
    flags &= (uint8_t)~(multi_thread | multi_block);
  } else if (l.block_of(id) != l.block_of(x)) {
    flags |= multi_block;
  } else if (epoch == e) {
    if (id != x) flags |= multi_thread;
  } else {
    // A later interval of the same block: the earlier ones are ordered before x (and before
    // whatever x's block does next); other blocks' are kept by multi_block.
    flags &= (uint8_t)~multi_thread;
  }
  id = x;
  epoch = e;
}

void check_byte(Launch& l, uintptr_t a, const Range* g, Kind kind, const void* pc) {
  const uint32_t x = tls.thread, e = tls.epoch;
  Entry& s = (g ? l.global : l.shared).at(a);
  // Against the last plain write: every access.
  if (unordered(l, s.w, s.w_epoch, false, false, x, e))
    race(l, a, g, kind, s.w, s.w_epoch, "writes", pc);
  // Against atomics: plain accesses only.
  if (kind != kAtomic && unordered(l, s.a, s.a_epoch, s.flags & kAMultiThread,
                                   s.flags & kAMultiBlock, x, e))
    race(l, a, g, kind, s.a, s.a_epoch, "atomically updates", pc);
  // Against plain reads: writes and atomics.
  if (kind != kRead && unordered(l, s.r, s.r_epoch, s.flags & kRMultiThread,
                                 s.flags & kRMultiBlock, x, e))
    race(l, a, g, kind, s.r, s.r_epoch, "reads", pc);
  if (!g && !s.w && !s.a && kind != kWrite) {
    report(l,
           where(a, g) + " read before any thread of its block wrote it: " + l.who(x, e) + " " +
               verb(kind) + " it (uninitialised, or written without a __syncthreads between)",
           pc);
  }
  switch (kind) {
    case kRead:
      update_role(l, s.r, s.r_epoch, s.flags, kRMultiThread, kRMultiBlock, x, e);
      break;
    case kWrite:
      // Every earlier access is ordered before this one, or was reported.
      s.w = x;
      s.w_epoch = e;
      s.a = s.r = 0;
      s.flags = 0;
      break;
    case kAtomic:
      // The plain write and reads stay: they may be unordered with later accesses too (of
      // other blocks, or of this interval).
      update_role(l, s.a, s.a_epoch, s.flags, kAMultiThread, kAMultiBlock, x, e);
      break;
  }
}

// Index along one dimension of `count` at `stride`, taken off `off`; false past the end.
bool take(uint64_t& off, uint64_t count, uint64_t stride, uint64_t& idx) {
  idx = count > 1 ? off / stride : 0;
  if (idx >= count) return false;
  off -= idx * stride;
  return true;
}

// Where byte `off` of a view lies: its head and row, or false in padding or past the view.
bool locate(const View& v, uint64_t off, uint64_t& head, uint64_t& row) {
  const bool in = v.heads_outer
                      ? take(off, v.heads, v.head_stride, head) && take(off, v.rows, v.row_stride, row)
                      : take(off, v.rows, v.row_stride, row) && take(off, v.heads, v.head_stride, head);
  return in && off < v.row_bytes;
}

// Out of the buffer, out of the view, or in another head's rows: reported, true.
bool check_bounds(Launch& l, uintptr_t a, size_t n, const Range& g, Kind kind,
                  const void* pc) {
  const uint32_t x = tls.thread, e = tls.epoch;
  char buf[320];
  if (a < g.lo || a + n > g.hi) {
    snprintf(buf, sizeof buf,
             "`%s` (%zu bytes) accessed at byte offset %lld (%zu bytes): out of bounds: ",
             g.name.c_str(), (size_t)(g.hi - g.lo), (long long)(a - g.lo), n);
    report(l, buf + l.who(x, e) + " " + verb(kind) + " it", pc);
    return true;
  }
  if (!g.has_view) return false;
  const View& v = g.view;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t off = a + i - g.lo;
    uint64_t head = 0, row = 0;
    if (!locate(v, off, head, row)) {
      snprintf(buf, sizeof buf,
               "`%s` byte %llu: outside the view the launch works on (%llu heads x %llu rows "
               "x %llu bytes, strides %llu and %llu bytes): ",
               g.name.c_str(), (unsigned long long)off, (unsigned long long)v.heads,
               (unsigned long long)v.rows, (unsigned long long)v.row_bytes,
               (unsigned long long)v.head_stride, (unsigned long long)v.row_stride);
      report(l, buf + l.who(x, e) + " " + verb(kind) + " it", pc);
      return true;
    }
    if (v.head_axis >= 0 && head != l.block_coord(x, v.head_axis)) {
      snprintf(buf, sizeof buf, "`%s` byte %llu, in row %llu of head %llu: ", g.name.c_str(),
               (unsigned long long)off, (unsigned long long)row, (unsigned long long)head);
      report(l,
             buf + l.who(x, e) + " " + verb(kind) + " it, but its block works on head " +
                 std::to_string(l.block_coord(x, v.head_axis)),
             pc);
      return true;
    }
  }
  return false;
}

void check(const void* p, size_t n, Kind kind, const void* pc) {
  Launch* l = tls.launch;
  if (!l || !tls.on || n == 0) return;
  const uintptr_t a = (uintptr_t)p;
  if (a >= l->stack_lo && a < l->stack_hi) return;  // a fiber's own stack
  // The checker's own switch (Untracked sets it from instrumented code when inlined there).
  if (a < (uintptr_t)(&tls + 1) && a + n > (uintptr_t)&tls) return;
  // One access lies in one buffer (or none): the range is looked up once.
  const Range* g = l->global_of(a);
  if (g && check_bounds(*l, a, n, *g, kind, pc)) return;
  for (size_t i = 0; i < n; ++i) check_byte(*l, a + i, g, kind, pc);
}

}  // namespace

std::string begin_launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                         uintptr_t stack_lo, uintptr_t stack_hi) {
  const uint64_t total = (uint64_t)gx * gy * gz * threads;
  if (total >= 0xffffffffull)
    return "launch of " + std::to_string(total) +
           " threads: past the race checker's 32-bit thread ids";
  auto l = std::make_unique<Launch>();
  l->gx = gx;
  l->gy = gy;
  l->gz = gz;
  l->threads = threads;
  l->stack_lo = stack_lo;
  l->stack_hi = stack_hi;
  {
    std::lock_guard<std::mutex> g(g_ranges_mu);
    l->globals = ranges();
  }
  delete tls.launch;
  tls.launch = l.release();
  return "";
}

void begin_block() {
  if (tls.launch) tls.launch->shared.gen++;
}

std::string end_launch() {
  Launch* l = tls.launch;
  tls.launch = nullptr;
  if (!l) return "";
  std::string r;
  if (l->findings) {
    r = l->first;
    if (l->findings > 1) r += " (" + std::to_string(l->findings - 1) + " more findings)";
  }
  delete l;
  return r;
}

void access(const void* p, size_t n, Kind kind, const void* pc) { check(p, n, kind, pc); }

}  // namespace kd_race

extern "C" void kd_emu_track_global(const void* p, size_t n, uintptr_t map_lo, uintptr_t map_hi,
                                    const char* name, size_t name_len) noexcept {
  std::lock_guard<std::mutex> g(kd_race::g_ranges_mu);
  kd_race::Range r;
  r.lo = (uintptr_t)p;
  r.hi = (uintptr_t)p + n;
  r.map_lo = map_lo;
  r.map_hi = map_hi;
  r.name.assign(name, name_len);
  kd_race::ranges().push_back(std::move(r));
}

extern "C" int kd_emu_set_view(const void* p, uint64_t heads, uint64_t head_stride,
                               uint64_t rows, uint64_t row_stride, uint64_t row_bytes,
                               int head_axis) noexcept {
  if (heads == 0 || rows == 0 || row_bytes == 0 || head_axis < -1 || head_axis > 1) return 1;
  using u128 = unsigned __int128;
  // The view's extent (128-bit: no wrap) must fit the buffer.
  const u128 extent = (u128)(heads - 1) * head_stride + (u128)(rows - 1) * row_stride + row_bytes;
  // Nested dimensions, the one of larger stride outside (heads outside rows, as in the cache,
  // or inside them, as in [n, kv, d] layouts); a dimension of 1 has no stride to speak of.
  const bool heads_outer = heads == 1 ? false : rows == 1 ? true : head_stride >= row_stride;
  const uint64_t in_count = heads_outer ? rows : heads, in_stride = heads_outer ? row_stride : head_stride;
  const uint64_t out_count = heads_outer ? heads : rows, out_stride = heads_outer ? head_stride : row_stride;
  const u128 inner_span = (u128)(in_count - 1) * in_stride + row_bytes;
  const bool disjoint = (in_count == 1 || in_stride >= row_bytes) &&
                        (out_count == 1 || (u128)out_stride >= inner_span);
  std::lock_guard<std::mutex> g(kd_race::g_ranges_mu);
  for (kd_race::Range& r : kd_race::ranges()) {
    if (r.lo != (uintptr_t)p) continue;
    r.has_view = false;  // a view that is refused replaces an earlier one with none
    if (extent > (u128)(r.hi - r.lo)) return 1;
    // Rows or heads that overlap (a stride of 0, say), or interleave without nesting, have no
    // single head and row per byte here: the view is not checked.
    if (!disjoint) return 2;
    r.view = kd_race::View{heads, head_stride, rows, row_stride, row_bytes, head_axis, heads_outer};
    r.has_view = true;
    return 0;
  }
  return 1;
}

extern "C" void kd_emu_untrack_global(const void* p) noexcept {
  std::lock_guard<std::mutex> g(kd_race::g_ranges_mu);
  auto& r = kd_race::ranges();
  r.erase(std::remove_if(r.begin(), r.end(),
                         [&](const kd_race::Range& x) { return x.lo == (uintptr_t)p; }),
          r.end());
}

// The entry points -fsanitize=thread calls (GCC and Clang). Function entry and exit, and the
// module constructor's __tsan_init, need nothing here.
#define KD_PC __builtin_return_address(0)
#define KD_HOOKS(N)                                                                         \
  extern "C" void __tsan_read##N(void* p) { kd_race::check(p, N, kd_race::kRead, KD_PC); }  \
  extern "C" void __tsan_write##N(void* p) { kd_race::check(p, N, kd_race::kWrite, KD_PC); } \
  extern "C" void __tsan_unaligned_read##N(void* p) {                                       \
    kd_race::check(p, N, kd_race::kRead, KD_PC);                                            \
  }                                                                                         \
  extern "C" void __tsan_unaligned_write##N(void* p) {                                      \
    kd_race::check(p, N, kd_race::kWrite, KD_PC);                                           \
  }                                                                                         \
  extern "C" void __tsan_volatile_read##N(void* p) {                                        \
    kd_race::check(p, N, kd_race::kRead, KD_PC);                                            \
  }                                                                                         \
  extern "C" void __tsan_volatile_write##N(void* p) {                                       \
    kd_race::check(p, N, kd_race::kWrite, KD_PC);                                           \
  }
KD_HOOKS(1)
KD_HOOKS(2)
KD_HOOKS(4)
KD_HOOKS(8)
KD_HOOKS(16)
#undef KD_HOOKS

extern "C" void __tsan_read_range(void* p, size_t n) {
  kd_race::check(p, n, kd_race::kRead, KD_PC);
}
extern "C" void __tsan_write_range(void* p, size_t n) {
  kd_race::check(p, n, kd_race::kWrite, KD_PC);
}
// Clang replaces memset/memcpy/memmove in instrumented code with these.
extern "C" void* __tsan_memset(void* d, int c, size_t n) {
  kd_race::check(d, n, kd_race::kWrite, KD_PC);
  return memset(d, c, n);
}
extern "C" void* __tsan_memcpy(void* d, const void* s, size_t n) {
  kd_race::check(s, n, kd_race::kRead, KD_PC);
  kd_race::check(d, n, kd_race::kWrite, KD_PC);
  return memcpy(d, s, n);
}
extern "C" void* __tsan_memmove(void* d, const void* s, size_t n) {
  kd_race::check(s, n, kd_race::kRead, KD_PC);
  kd_race::check(d, n, kd_race::kWrite, KD_PC);
  return memmove(d, s, n);
}
extern "C" void __tsan_vptr_read(void**) {}
extern "C" void __tsan_vptr_update(void**, void*) {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_init() {}
#undef KD_PC
