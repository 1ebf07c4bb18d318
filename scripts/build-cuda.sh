#!/usr/bin/env bash
# Builds the CUDA binary to carry to a GPU host (see GPU.md): pinned CUDA 13.0 toolchain from
# PyPI, libcuda link stub, portable x86-64-v3 code, separate target dir.
# Usage: scripts/build-cuda.sh [compute_cap, default 90] [--flash]
#   --flash adds the `flash-attn` feature (FlashAttention-2 for the chunk attention). Its CUTLASS
#   headers come from PyPI (scripts/cuda/cutlass.sh); its 53 kernels take hours on 2 cores and
#   > 16 GB, and are kept in target/cuda/flash-attn-objs so that later builds reuse them.
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
if [ $features = flash-attn ]; then
  eval "$(scripts/cuda/cutlass.sh)"
  export CANDLE_FLASH_ATTN_BUILD_DIR=$PWD/target/cuda/flash-attn-objs
  mkdir -p "$CANDLE_FLASH_ATTN_BUILD_DIR"
fi
export CUDA_COMPUTE_CAP=$cap CARGO_TARGET_DIR=target/cuda RUSTFLAGS="-C target-cpu=x86-64-v3"
cargo build --release -p keydiff-cli --features $features
ls -la target/cuda/release/keydiff
