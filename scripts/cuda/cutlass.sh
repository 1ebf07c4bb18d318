#!/usr/bin/env bash
# CUTLASS headers for candle-flash-attn without GitHub (the `flash-attn` feature; see GPU.md).
# candle-flash-attn's build script asks cudaforge for CUTLASS at a pinned commit, and cudaforge
# clones it from GitHub unless its cache already holds a checkout whose `git rev-parse HEAD` is
# that commit. Our machines reach PyPI but no git host, so this puts the headers of the
# `nvidia-cutlass` wheel into that cache and names the pinned commit as their HEAD.
# Caveat: the wheel is CUTLASS 4.2, not the pinned commit (an older 3.x); candle's flash kernels
# compile against it with the pinned CUDA 13.0 nvcc (checked here on one kernel, sm_90), but the
# full 53-kernel build has not run on our machines.
# Usage: eval "$(scripts/cuda/cutlass.sh)"   # prepares once, then prints the export line
set -euo pipefail
pin=7d49e6c7e2f8896c47f586706e67e1fb215529dc   # CUTLASS_COMMIT of candle-flash-attn 0.11.1
wheel=nvidia-cutlass==4.2.0.0
home=${CUDAFORGE_HOME:-$HOME/.cache/keydiff/cudaforge}
dep=$home/git/checkouts/cutlass-${pin:0:16}
if [ ! -f "$dep/.done" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: "$wheel" -d "$tmp" >&2
  (cd "$tmp" && python3 -m zipfile -e ./*.whl x >&2)
  rm -rf "$dep"; mkdir -p "$dep"
  cp -r "$tmp/x/cutlass_library/source/include" "$dep/include"
  git -C "$dep" init -q
  echo "$pin" > "$dep/.git/HEAD"   # what cudaforge compares with the pinned commit
  [ "$(git -C "$dep" rev-parse HEAD)" = "$pin" ]
  echo "$wheel" > "$dep/.done"
  rm -rf "$tmp"
fi
echo "export CUDAFORGE_HOME=$home"
