// The executing mock's runtime, linked into every kernel library that build.sh makes
// (libkx_<source>.so: one kernel source compiled for the host with prelude.h). The stand-in
// driver (mockcuda.c), when MOCKCUDA_EXEC names those libraries' folder, finds a launched
// kernel's host build by its name and runs it here, with the arguments the launch gave, over
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

#include <vector>

#include "prelude.h"

namespace {
thread_local std::vector<char> g_dynamic;
thread_local std::vector<char> g_stacks;
thread_local uint64_t g_seed = 0x6b6579646966ull;
}  // namespace

extern "C" void* kx_dynamic_shared() { return g_dynamic.data(); }

// Runs `fn` (a kernel of this library) over the grid with `args` (the launch's kernelParams:
// a pointer to each argument's value). `types[k]` is parameter k's kind as mockcuda.c reads it
// from the PTX ('u' / 'i' an unsigned / signed integer of sizes[k] bytes, 'u' also for a struct
// of that size: the half types and fp8, integer-class in the x86-64 ABI, as no kernel here
// takes a struct of floats by value; 'f' float; 'd' double). The PTX is the binary's and the
// host build the working tree's: they must come from the same kernels/keydiff.cu. Returns 0,
// or 1 with the error in `err`.
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
      const size_t need = (size_t)threads * kd_emu::kStackBytes;
      if (g_stacks.size() < need) g_stacks.resize(need);
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
