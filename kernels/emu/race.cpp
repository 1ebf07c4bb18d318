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

// Per byte: the last writer and reader (global thread id + 1, 0: none), the barrier interval
// of each, and what else is known about earlier accesses since (flags).
enum : uint8_t {
  kWAtomic = 1,       // the last write was an atomic
  kWMultiThread = 2,  // another thread of the writer's block wrote atomically in its interval
  kWMultiBlock = 4,   // threads of several blocks wrote atomically
  kRMultiThread = 8,  // another thread of the reader's block read in its interval
  kRMultiBlock = 16,  // threads of several blocks read
};
struct Entry {
  uint32_t gen;  // valid when equal to its memory's current generation
  uint32_t w, w_epoch;
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
    if (e.gen != gen) e = Entry{gen, 0, 0, 0, 0, 0};
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

void check_byte(Launch& l, uintptr_t a, const Range* g, Kind kind, const void* pc) {
  const uint32_t x = tls.thread, e = tls.epoch;
  Entry& s = (g ? l.global : l.shared).at(a);
  const bool atomic = kind == kAtomic, write = kind != kRead;
  if (s.w) {
    const bool conflict =
        concurrent(l, s.w, s.w_epoch, x, e) || (s.flags & kWMultiBlock) ||
        ((s.flags & kWMultiThread) && l.block_of(s.w) == l.block_of(x) && s.w_epoch == e);
    if (conflict && !(atomic && (s.flags & kWAtomic))) {
      const bool known = concurrent(l, s.w, s.w_epoch, x, e);
      report(l,
             "data race on " + where(a, g) + ": " + l.who(x, e) + " " + verb(kind) +
                 " it, and " +
                 (known ? l.who(s.w, s.w_epoch) : std::string("another thread")) + " " +
                 ((s.flags & kWAtomic) ? "atomically updates" : "writes") +
                 " it, unordered (no __syncthreads between them, or different blocks)",
             pc);
    }
  }
  if (write && s.r) {
    const bool conflict =
        concurrent(l, s.r, s.r_epoch, x, e) || (s.flags & kRMultiBlock) ||
        ((s.flags & kRMultiThread) && l.block_of(s.r) == l.block_of(x) && s.r_epoch == e);
    if (conflict) {
      const bool known = concurrent(l, s.r, s.r_epoch, x, e);
      report(l,
             "data race on " + where(a, g) + ": " + l.who(x, e) + " " + verb(kind) +
                 " it, and " +
                 (known ? l.who(s.r, s.r_epoch) : std::string("another thread")) +
                 " reads it, unordered (no __syncthreads between them, or different blocks)",
             pc);
    }
  }
  if (!g && !s.w && kind != kWrite) {
    report(l,
           where(a, g) + " read before any thread of its block wrote it: " + l.who(x, e) +
               " " + verb(kind) + " it (uninitialised, or written without a __syncthreads between)",
           pc);
  }
  switch (kind) {
    case kRead:
      if (!s.r) {
        s.flags &= (uint8_t)~(kRMultiThread | kRMultiBlock);
      } else if (l.block_of(s.r) != l.block_of(x)) {
        s.flags |= kRMultiBlock;
      } else if (s.r_epoch == e) {
        if (s.r != x) s.flags |= kRMultiThread;
      } else {
        s.flags &= (uint8_t)~kRMultiThread;
      }
      s.r = x;
      s.r_epoch = e;
      break;
    case kWrite:
      // Earlier accesses are ordered before this one, or were reported.
      s.w = x;
      s.w_epoch = e;
      s.r = 0;
      s.flags = 0;
      break;
    case kAtomic:
      if (s.w && (s.flags & kWAtomic)) {
        if (l.block_of(s.w) != l.block_of(x) || (s.flags & kWMultiBlock)) {
          s.flags |= kWMultiBlock;
        } else if (s.w_epoch == e) {
          if (s.w != x) s.flags |= kWMultiThread;
        } else {
          s.flags &= (uint8_t)~kWMultiThread;
        }
      } else {
        s.flags &= (uint8_t)~(kWMultiThread | kWMultiBlock);
      }
      s.flags |= kWAtomic;
      s.w = x;
      s.w_epoch = e;
      break;
  }
}

// Where byte `off` of a view lies: its head and row, or false in padding or past the view.
bool locate(const View& v, uint64_t off, uint64_t& head, uint64_t& row) {
  head = v.heads > 1 ? off / v.head_stride : 0;
  if (head >= v.heads) return false;
  off -= head * v.head_stride;
  row = v.rows > 1 ? off / v.row_stride : 0;
  if (row >= v.rows) return false;
  off -= row * v.row_stride;
  return off < v.row_bytes;
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

void access(const void* p, size_t n, Kind kind) {
  check(p, n, kind, __builtin_return_address(0));
}

}  // namespace kd_race

extern "C" void kd_emu_track_global(const void* p, size_t n, uintptr_t map_lo, uintptr_t map_hi,
                                    const char* name, size_t name_len) {
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
                               int head_axis) {
  if (heads == 0 || rows == 0 || row_bytes == 0 || head_axis < -1 || head_axis > 1) return 1;
  // Rows inside a head, heads inside the buffer, nothing overlapping (128-bit products: no
  // wrap).
  const unsigned __int128 head_span =
      (unsigned __int128)(rows - 1) * row_stride + (unsigned __int128)row_bytes;
  if (rows > 1 && row_stride < row_bytes) return 1;
  if (heads > 1 && head_stride < head_span) return 1;
  const unsigned __int128 extent = (unsigned __int128)(heads - 1) * head_stride + head_span;
  std::lock_guard<std::mutex> g(kd_race::g_ranges_mu);
  for (kd_race::Range& r : kd_race::ranges()) {
    if (r.lo != (uintptr_t)p) continue;
    if (extent > (unsigned __int128)(r.hi - r.lo)) return 1;
    r.view = kd_race::View{heads, head_stride, rows, row_stride, row_bytes, head_axis};
    r.has_view = true;
    return 0;
  }
  return 1;
}

extern "C" void kd_emu_untrack_global(const void* p) {
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
