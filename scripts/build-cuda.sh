#!/usr/bin/env bash
# Builds the CUDA binary to carry to a GPU host (see GPU.md): pinned CUDA 13.0 toolchain from
# PyPI, libcuda link stub, portable x86-64-v3 code, separate target dir.
# Usage: scripts/build-cuda.sh [compute_cap, default 90]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
eval "$(scripts/cuda/toolchain.sh)"   # a copy of the shared pinned-toolchain script
export CUDA_COMPUTE_CAP=${1:-90} CARGO_TARGET_DIR=target/cuda RUSTFLAGS="-C target-cpu=x86-64-v3"
cargo build --release -p keydiff-cli --features cuda
ls -la target/cuda/release/keydiff
