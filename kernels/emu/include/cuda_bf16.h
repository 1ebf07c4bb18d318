// Stand-in for the CUDA header under the CPU emulation: the types and conversions are in
// kernels/emu/cuda_emu.h.
#pragma once
#include "../cuda_emu.h"
