// The executing mock's runtime, linked into every kernel library that build.sh makes
// (libkx_<source>.so: one kernel source compiled for the host with prelude.h). The stand-in
// driver (mockcuda.c), when MOCKCUDA_EXEC names those libraries' folder, finds a launched
// kernel's host build by its name (a runtime-launched one through build.sh's index,
// kx_runtime.tsv) and runs it here, with the arguments the launch gave, over
// the CPU emulation of kernels/emu/cuda_emu.h: device memory is host memory in the stand-in,
// so a CUDA build of keydiff then computes real values without a GPU.
//
// Two ways to run a launch:
//   - fibers (cuda_emu.h's scheduler): a thread per fiber, switching at __syncthreads and the
//     warp-synchronous intrinsics; blocks in a random order drawn from the seed;
//   - plain (`plain` set: the kernel's PTX has no barrier and no warp-synchronous
//     instruction): each thread runs to its end as a plain call, blocks in order. Far
//     faster; a barrier reached all the same aborts the process (cuda_emu.h's park).
// Not checked here: races (no instrumentation), and anything about the real compiler or GPU.
#include <ffi.h>
#include <stdio.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "prelude.h"

namespace {
thread_local std::vector<char> g_dynamic;
thread_local kd_emu::Stacks g_stacks;  // reused launch to launch
thread_local uint64_t g_seed = 0x6b6579646966ull;
}  // namespace

extern "C" void* kx_dynamic_shared() { return g_dynamic.data(); }

// Runs `fn` (a kernel of this library) over the grid with `args` (the launch's kernelParams:
// a pointer to each argument's value). `types[k]` is parameter k's kind as mockcuda.c reads it
// from the PTX, or as kx_runtime.tsv gives it ('u' / 'i' an unsigned / signed integer of
// sizes[k] bytes, 'u' also for a struct of that size: the half types and fp8, integer-class
// in the x86-64 ABI, as no kernel here takes a struct of floats by value; 'f' float; 'd'
// double). The PTX is the binary's and the host build the working tree's: they must come from
// the same kernels/keydiff.cu (the stand-in driver checks: kx_sources.tsv against the mark
// build.rs leaves in the PTX). Returns 0, or 1 with the error in `err`.
extern "C" int kx_launch(void (*fn)(void), int n_params, const char* types,
                         const unsigned char* sizes, void** args, unsigned gx, unsigned gy,
                         unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                         int plain, char* err, size_t err_len) {
  const dim3 grid{gx, gy, gz}, block{bx, by, bz};
  const unsigned threads = bx * by * bz;
  std::string e;
  std::vector<ffi_type*> at((size_t)n_params);
  for (int k = 0; k < n_params && e.empty(); ++k) {
    switch (types[k]) {
      case 'f': at[k] = &ffi_type_float; break;
      case 'd': at[k] = &ffi_type_double; break;
      case 'u':
        at[k] = sizes[k] == 8   ? &ffi_type_uint64
                : sizes[k] == 4 ? &ffi_type_uint32
                : sizes[k] == 2 ? &ffi_type_uint16
                : sizes[k] == 1 ? &ffi_type_uint8
                                : nullptr;
        break;
      case 'i':  // signed: the caller extends 8- and 16-bit values by their sign
        at[k] = sizes[k] == 8   ? &ffi_type_sint64
                : sizes[k] == 4 ? &ffi_type_sint32
                : sizes[k] == 2 ? &ffi_type_sint16
                : sizes[k] == 1 ? &ffi_type_sint8
                                : nullptr;
        break;
      default: at[k] = nullptr;
    }
    if (!at[k]) e = "parameter " + std::to_string(k) + " of an unknown type";
  }
  ffi_cif cif_storage;
  ffi_cif* cif = &cif_storage;
  if (e.empty() && ffi_prep_cif(cif, FFI_DEFAULT_ABI, (unsigned)n_params, &ffi_type_void,
                                at.data()) != FFI_OK)
    e = "ffi_prep_cif failed";
  if (!e.empty()) {
    if (err_len) snprintf(err, err_len, "%s", e.c_str());
    return 1;
  }
  g_dynamic.assign(shmem ? shmem : 16, 0);
  if (plain) {
    kd_emu::Block b;
    b.plain = true;
    b.fibers.assign(threads, kd_emu::Fiber{});
    for (unsigned t = 0; t < threads; ++t) {
      b.fibers[t].tid = dim3{t % bx, (t / bx) % by, t / (bx * by)};
      b.fibers[t].lane = (int)(t % kd_emu::kWarp);
      b.fibers[t].warp = (int)(t / kd_emu::kWarp);
    }
    b.warps.assign((threads + kd_emu::kWarp - 1) / kd_emu::kWarp, kd_emu::Warp{});
    kd_emu::g_grid_dim = grid;
    kd_emu::g_block_dim = block;
    kd_emu::g_block = &b;
    for (unsigned z = 0; z < gz; ++z)
      for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
          kd_emu::g_block_idx = dim3{x, y, z};
          for (unsigned t = 0; t < threads; ++t) {
            b.cur = (int)t;
            ffi_call(cif, fn, nullptr, args);
          }
        }
    kd_emu::g_block = nullptr;
  } else {
    if (threads % kd_emu::kWarp != 0) {
      e = "a block of " + std::to_string(threads) + " threads (the fibers emulate whole warps)";
    } else {
      std::mt19937_64 rng(g_seed++);
      const std::function<void()> body = [&] { ffi_call(cif, fn, nullptr, args); };
      try {
        e = kd_emu::run_blocks(grid, block, rng, body, g_stacks);
      } catch (const std::exception& x) {
        e = std::string("emulation failed: ") + x.what();
      }
    }
  }
  if (e.empty()) return 0;
  if (err_len) snprintf(err, err_len, "%s", e.c_str());
  return 1;
}

extern "C" void kx_keep(const void* kernel) { (void)kernel; }

// The host launch code that hostify.py keeps (never run here) refers to the runtime's
// cudaGetDevice: this weak one lets the library load where no libcudart is.
extern "C" __attribute__((weak)) cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------
// Inline PTX of the runtime-launched kernels (hostify.py rewrites their `asm` statements to
// kx_asm): the tensor-core instructions candle's MMQ (llama.cpp's mma.cuh) runs at sm_90 for
// the GGUF types, each lane publishing its fragment registers over the warp exchange and
// computing its own part of the result, with the fragment layouts of the PTX ISA ("Matrix
// Fragments for mma.m16n8k16 / m16n8k32", "ldmatrix"):
//   mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32, ...m16n8k32...,
//   ldmatrix.sync.aligned.m8n8.x2.b16, ...x4...
// These are the ones scripts/cuda-mock-check.sh and gpu-check.sh's GGUF step run (MOCKCUDA_LOG
// counts them: "asm ..." lines), so that an error in a layout shows as wrong logits. Any other
// instruction (mma.cuh's f16, bf16 and tf32 forms, movmatrix, .trans, pre-Ampere shapes:
// paths these kernels do not take here, so nothing would check their layouts) fails the
// launch.
namespace {

enum class Kind { kOther, kLdmatrix, kMma };

// One asm statement's instruction, decoded once.
struct Ptx {
  std::string op;
  std::vector<std::vector<int>> groups;  // operand numbers of each operand group
  Kind kind = Kind::kOther;
  int k = 0;                             // mma: m16n8kK
  unsigned long long* runs = nullptr;    // its count in g_asm_runs
};

// How often each instruction ran (by lane), written to MOCKCUDA_LOG at exit as
// "asm <instruction> <count>", beside the driver's "launch" lines.
std::mutex g_asm_lock;
std::map<std::string, unsigned long long> g_asm_runs;
struct AsmReport {
  ~AsmReport() {
    std::lock_guard<std::mutex> hold(g_asm_lock);
    const char* path = getenv("MOCKCUDA_LOG");
    FILE* out = path && !g_asm_runs.empty() ? fopen(path, "a") : nullptr;
    if (!out) return;
    for (const auto& e : g_asm_runs) fprintf(out, "asm %s %llu\n", e.first.c_str(), e.second);
    fclose(out);
  }
} g_asm_report;

// "op {%0, %1}, {%2}, [%3];" → op, the operand numbers of each group, and which of the
// emulated forms it is (kOther if none).
Ptx parse_ptx(const char* text) {
  Ptx p;
  const char* s = text;
  while (*s && *s != ' ' && *s != '\t') p.op += *s++;
  std::vector<int> cur;
  int depth = 0;
  for (; *s && *s != ';'; ++s) {
    if (*s == '{' || *s == '[') depth++;
    if (*s == '}' || *s == ']') depth--;
    if (*s == '%') {
      char* end;
      cur.push_back((int)strtol(s + 1, &end, 10));
      s = end - 1;
    } else if (*s == ',' && depth == 0) {
      p.groups.push_back(cur);
      cur.clear();
    }
  }
  if (!cur.empty()) p.groups.push_back(cur);
  const auto& g = p.groups;
  const auto sizes = [&](size_t d, size_t a, size_t b, size_t c) {
    return g.size() == 4 && g[0].size() == d && g[1].size() == a && g[2].size() == b && g[3].size() == c;
  };
  if ((p.op == "ldmatrix.sync.aligned.m8n8.x2.b16" && g.size() == 2 && g[0].size() == 2 && g[1].size() == 1) ||
      (p.op == "ldmatrix.sync.aligned.m8n8.x4.b16" && g.size() == 2 && g[0].size() == 4 && g[1].size() == 1)) {
    p.kind = Kind::kLdmatrix;
  } else if (p.op == "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32" && sizes(4, 2, 1, 4)) {
    p.kind = Kind::kMma, p.k = 16;
  } else if (p.op == "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" && sizes(4, 4, 2, 4)) {
    p.kind = Kind::kMma, p.k = 32;
  }
  return p;
}

// Every lane's `n` 32-bit values, as all[lane * n + i].
void gather(const uint32_t* mine, int n, std::vector<uint32_t>& all, const char* file, int line) {
  all.assign((size_t)kd_emu::kWarp * n, 0);
  for (int i = 0; i < n; i += 2) {
    const uint64_t v = (uint64_t)mine[i] | (i + 1 < n ? (uint64_t)mine[i + 1] << 32 : 0);
    const uint64_t* got = kd_emu::warp_exchange(0xffffffffu, v, "inline PTX", file, line);
    for (int l = 0; l < kd_emu::kWarp; ++l) {
      all[(size_t)l * n + i] = (uint32_t)got[l];
      if (i + 1 < n) all[(size_t)l * n + i + 1] = (uint32_t)(got[l] >> 32);
    }
  }
}

[[noreturn]] void asm_fail(const char* text, const char* file, int line, const char* why) {
  kd_emu::fail(std::string("inline PTX `") + text + "` at " + file + ":" + std::to_string(line) + ": " + why);
}

}  // namespace

void kx_asm(const char* text, const char* out_kinds, std::initializer_list<void*> outs_l,
            std::initializer_list<unsigned long long> ins_l, const char* file, int line) {
  // Node-based: other lanes, parked inside this function, hold references into it.
  static thread_local std::unordered_map<const char*, Ptx> cache;
  auto it = cache.find(text);
  if (it == cache.end()) {
    Ptx parsed = parse_ptx(text);
    std::lock_guard<std::mutex> hold(g_asm_lock);
    parsed.runs = &g_asm_runs[parsed.op];
    it = cache.emplace(text, std::move(parsed)).first;
  }
  const Ptx& p = it->second;
  __atomic_add_fetch(p.runs, 1, __ATOMIC_RELAXED);
  if (p.kind == Kind::kOther) asm_fail(text, file, line, "not emulated");
  void* const* outs = outs_l.begin();
  const unsigned long long* ins = ins_l.begin();
  const int n_out = (int)outs_l.size(), n_in = (int)ins_l.size();
  for (const char* k = out_kinds; *k; ++k)
    if (*k != 'r') asm_fail(text, file, line, "an output not of the r kind");
  for (const auto& grp : p.groups)
    for (int k : grp)
      if (k < 0 || k >= n_out + n_in) asm_fail(text, file, line, "an operand number past the operands");
  auto value = [&](int k) -> uint32_t { return k < n_out ? *(uint32_t*)outs[k] : (uint32_t)ins[k - n_out]; };
  auto set = [&](int k, uint32_t v) {
    if (k >= n_out) asm_fail(text, file, line, "writes an input");
    *(uint32_t*)outs[k] = v;
  };
  // The PTX ISA's groupID and threadID_in_group.
  const int lane = kd_emu::cur_fiber().lane;
  const int g = lane >> 2, t = lane & 3;

  if (p.kind == Kind::kLdmatrix) {
    // Lanes 8j..8j+7 give the rows of matrix j (8 b16 each); this lane gets, of each matrix,
    // row g's elements 2t and 2t + 1.
    const int ak = p.groups[1][0];
    if (ak < n_out) asm_fail(text, file, line, "the address is an output");
    const uint64_t* got = kd_emu::warp_exchange(0xffffffffu, ins[ak - n_out], "ldmatrix", file, line);
    uint64_t rows[kd_emu::kWarp];
    memcpy(rows, got, sizeof rows);
    const std::vector<int>& d = p.groups[0];
    for (size_t j = 0; j < d.size(); ++j) {
      uint32_t v;
      memcpy(&v, (const char*)(uintptr_t)rows[8 * j + g] + 4 * t, 4);
      set(d[j], v);
    }
    // As on the device, the whole warp has read before any lane goes on (and may write there).
    kd_emu::warp_exchange(0xffffffffu, 0, "ldmatrix", file, line);
    return;
  }

  // mma, s8 × s8 + s32 → s32 (m16n8kK, K = 16 or 32): A is 16 × K, row-major fragments of four
  // s8 a register; B is K × 8. Every lane's A and B registers, then what this lane's results
  // need: rows g and g + 8 of A (held by lanes 4g..4g+3) and columns 2t and 2t + 1 of B
  // (column c held by lanes 4c..4c+3).
  const std::vector<int>&D = p.groups[0], &A = p.groups[1], &B = p.groups[2], &C = p.groups[3];
  const int K = p.k, N = 8;
  uint32_t mine[6];
  int nr = 0;
  for (int k : A) mine[nr++] = value(k);
  for (int k : B) mine[nr++] = value(k);
  std::vector<uint32_t> all;
  gather(mine, nr, all, file, line);
  const auto byte = [&](int l, int reg, int i) { return (int)(int8_t)(all[(size_t)l * nr + reg] >> (8 * i)); };
  int a[16 * 32], b[32 * 8];
  for (int l = 4 * g; l < 4 * g + 4; ++l) {
    const int lt = l & 3;
    for (int i = 0; i < (int)A.size() * 4; ++i) {
      // a_i: row g for i % 8 < 4, else g + 8; column 4t + i % 4, + 16 for i >= 8.
      const int r = g + 8 * ((i >> 2) & 1), c = 4 * lt + (i & 3) + 16 * (i >= 8);
      a[r * K + c] = byte(l, i / 4, i % 4);
    }
  }
  for (int l = 8 * t; l < 8 * t + 8; ++l) {
    const int lt = l & 3;
    for (int i = 0; i < (int)B.size() * 4; ++i) {
      // b_i: row 4t + i % 4, + 16 for i >= 4; column g.
      const int r = 4 * lt + (i & 3) + 16 * (i >= 4);
      b[r * N + (l >> 2)] = byte(l, (int)A.size() + i / 4, i % 4);
    }
  }
  // This lane's accumulators: c_i at row g (i < 2) or g + 8, column 2t + i % 2. D may be C's
  // registers: C is read first.
  uint32_t cv[4], dv[4];
  for (int i = 0; i < 4; ++i) cv[i] = value(C[(size_t)i]);
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >> 1), c = 2 * t + (i & 1);
    int64_t acc = (int32_t)cv[i];
    for (int k = 0; k < K; ++k) acc += (int64_t)a[r * K + k] * b[k * N + c];
    dv[i] = (uint32_t)acc;  // wraps, as s32
  }
  for (int i = 0; i < 4; ++i) set(D[(size_t)i], dv[i]);
}
