#!/usr/bin/env bash
# Builds the CUDA binary to carry to a GPU host (see GPU.md): pinned CUDA 13.0 toolchain from
# PyPI, libcuda link stub, portable x86-64-v3 code, separate target dir.
# Usage: scripts/build-cuda.sh [compute_cap, default 90] [--flash]
#   --flash adds the `flash-attn` feature (FlashAttention-2 for the chunk attention), built in
#   target/cuda-flash (binary target/cuda-flash/release/keydiff). Its CUTLASS headers come from
#   PyPI (scripts/cuda/cutlass.sh). All 52 of candle-flash-attn's kernels take ~5 h on 2 cores,
#   so only those KEYDIFF_FLASH_KERNELS names are built (scripts/cuda/flash-nvcc.sh; default
#   bf16 for head dims up to 32, 64 and 128: the test presets, SmolLM2, Llama 3.x, Qwen 2.5/3);
#   KEYDIFF_FLASH_KERNELS= (empty) builds them all. Objects are kept in
#   target/cuda-flash/flash-attn-objs so that later builds reuse them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cap=90 features=cuda
for arg in "$@"; do
  case $arg in
    --flash) features=flash-attn ;;
    [0-9]*) cap=$arg ;;
    *) echo "usage: $0 [compute_cap] [--flash]" >&2; exit 2 ;;
  esac
done
eval "$(scripts/cuda/toolchain.sh)"   # a copy of the shared pinned-toolchain script
target=target/cuda
if [ $features = flash-attn ]; then
  target=target/cuda-flash   # NVCC differs: its own target dir keeps target/cuda warm
  eval "$(scripts/cuda/cutlass.sh)"
  export CANDLE_FLASH_ATTN_BUILD_DIR=$PWD/$target/flash-attn-objs
  mkdir -p "$CANDLE_FLASH_ATTN_BUILD_DIR"
  KEYDIFF_REAL_NVCC=$(command -v nvcc)
  export KEYDIFF_REAL_NVCC NVCC=$PWD/scripts/cuda/flash-nvcc.sh
  export KEYDIFF_FLASH_KERNELS=${KEYDIFF_FLASH_KERNELS-hdim32_bf16 hdim64_bf16 hdim128_bf16}
  export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}   # its default is half the cores
  echo "flash kernels: ${KEYDIFF_FLASH_KERNELS:-all}" >&2
  # Cargo does not rerun candle-flash-attn's build script when the list changes, and its
  # builder's cache would keep the old stubs: a new list rebuilds that crate and its objects
  # (or the binary would call a stub it believes built).
  stamp=$target/flash-kernels.txt want="kernels: ${KEYDIFF_FLASH_KERNELS:-all}"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    rm -rf "$CANDLE_FLASH_ATTN_BUILD_DIR"; mkdir -p "$CANDLE_FLASH_ATTN_BUILD_DIR"
    CARGO_TARGET_DIR=$target cargo clean --release -p candle-flash-attn 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
  export KEYDIFF_FLASH_LOG=$PWD/$target/flash-kernels.log   # what flash-nvcc.sh built or stubbed
  : > "$KEYDIFF_FLASH_LOG"
fi
export CUDA_COMPUTE_CAP=$cap CARGO_TARGET_DIR=$target RUSTFLAGS="-C target-cpu=x86-64-v3"
cargo build --release -p keydiff-cli --features $features
ls -la $target/release/keydiff
