#!/usr/bin/env bash
# Compile checks of all GPU code on a machine without a GPU (see GPU.md), so that CUDA code can
# never break unnoticed: the pinned CUDA 13.0 toolchain from PyPI, `nvcc -cubin` for sm_80 and
# sm_90 on every kernels/*.cu (and CUDA 11.8's and 12.2's NVRTC and ptxas on them), the
# flash-attn nvcc wrapper (scripts/cuda/test-flash-nvcc.sh), then clippy (which type-checks) of
# the whole engine with the `cuda` feature, warnings as errors, and of the `flash-attn` feature
# against an API stand-in.
# Uses its own target dir so the CPU build stays warm.
# The first run builds candle's CUDA kernels (~15-20 min on 2 cores); later runs are incremental.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
eval "$(scripts/cuda/toolchain.sh)"
echo "nvcc: $(nvcc --version | tail -1)"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
shopt -s nullglob
for f in kernels/*.cu; do
  for sm in 80 90; do
    nvcc -cubin -arch=sm_$sm -O3 -Werror all-warnings -o "$tmp/$(basename "$f" .cu)-sm$sm.cubin" "$f"
    echo "nvcc -cubin sm_$sm: $f ok"
  done
done
# The same kernels through older toolkits' front ends (NVRTC) and ptxas: CUDA 11.8 and 12.2,
# which users' drivers run (scripts/cuda/older-toolkits.sh).
bash scripts/cuda/older-toolkits.sh
# The nvcc wrapper that builds only some FlashAttention kernels (build-cuda.sh --flash), against
# candle-flash-attn's kernel files: which it builds, which it stubs, and two stubs compiled.
bash scripts/cuda/test-flash-nvcc.sh
export CARGO_TARGET_DIR=${CUDA_CHECK_TARGET_DIR:-target/cuda-check} CUDA_COMPUTE_CAP=90
# The engine and CLI, the CUDA variants of the device tests (tests/tests/devices.rs) and the
# kernel crate's tests, in one invocation: other package sets unify features differently and
# would rebuild candle's CUDA kernels (~15 min here).
pkgs=(-p keydiff-cli -p keydiff-tests -p keydiff-kernels -p keydiff-cache)
cargo clippy --release "${pkgs[@]}" --all-targets --features cuda -- -D warnings
echo "cargo clippy --features cuda: ok"
# The `flash-attn` feature: candle-flash-attn cannot be built here (its build script clones
# CUTLASS from GitHub and compiles 53 kernels; GPU.md), so a stand-in with its exact API
# (scripts/flash-attn-api) is patched in for this type-check only. Cargo.lock is restored after.
cp Cargo.lock "$tmp/Cargo.lock"
trap 'cp "$tmp/Cargo.lock" Cargo.lock; rm -rf "$tmp"' EXIT
cargo clippy --release "${pkgs[@]}" --all-targets --features cuda,keydiff-cli/flash-attn \
  --config 'patch.crates-io.candle-flash-attn.path="scripts/flash-attn-api"' -- -D warnings
echo "cargo clippy --features flash-attn (API stand-in): ok"
