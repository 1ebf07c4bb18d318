#!/usr/bin/env bash
# Builds the stand-in CUDA libraries (see mockcuda.c) into DIR (default
# target/cuda-mock-libs): libcuda.so.1 (the mock driver), libcublas.so.13, libcublasLt.so.13,
# libcurand.so.10, libnvrtc.so.13 and libcudart.so.13. Each exports every symbol the real
# library does (the pinned toolchain's, scripts/cuda/toolchain.sh; libcuda's from
# libcuda.syms), with the same symbol version, so that a CUDA build of keydiff loads against
# them: the calls mockcuda.c and mockblas.c implement are checked, every other one is reported
# ("mockcuda: UNIMPLEMENTED ...") and refused with the library's "not supported" code.
# Usage: scripts/cuda/mock/build.sh [DIR]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${1:-$root/target/cuda-mock-libs}
eval "$("$here/../toolchain.sh")"
real=$CUDA_HOME/lib
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cflags=(-O1 -g -Wall -Wextra -Werror -fPIC -I "$CUDA_HOME/include" -I "$here")

# lib: name soname version code implemented-sources...
# `code`: what an unimplemented call returns (CUDA_ERROR_NOT_SUPPORTED 801,
# CUBLAS_STATUS_NOT_SUPPORTED 15, CURAND_STATUS_INTERNAL_ERROR 999, NVRTC_ERROR_INTERNAL_ERROR 11,
# cudaErrorNotSupported 801).
build() {
  local name=$1 soname=$2 version=$3 code=$4 src=$5 flag=$6
  local objs=()
  if [ -n "$src" ]; then
    gcc "${cflags[@]}" ${flag:+-D$flag} -c "$here/$src" -o "$work/$name.o"
    objs+=("$work/$name.o")
  fi
  # Every exported function of the real library; the implemented ones are left out.
  if [ "$name" = cuda ]; then
    syms=$(cat "$here/../libcuda.syms")
  else
    syms=$(nm -D --defined-only "$real/$soname" | awk '$2 == "T" || $2 == "W" {print $3}' | sed 's/@.*//' | sort -u)
  fi
  local have=""
  [ -n "$src" ] && have=$(nm --defined-only "$work/$name.o" | awk '$2 == "T" {print $3}' | sort -u)
  comm -23 <(echo "$syms" | sort -u) <(echo "$have") | grep -v '^$' | awk -v code="$code" -v lib="$name" '
    BEGIN { print "#include \"mockcommon.h\"" }
    { printf "int %s(void) { mock_note(\"%s: %s\"); return %s; }\n", $1, lib, $1, code }' \
    > "$work/$name-stubs.c"
  gcc "${cflags[@]}" -Wno-unused-function -c "$work/$name-stubs.c" -o "$work/$name-stubs.o"
  objs+=("$work/$name-stubs.o")
  local vflags=()
  if [ -n "$version" ]; then
    printf '%s { global: *; };\n' "$version" > "$work/$name.map"
    vflags=(-Wl,--version-script="$work/$name.map")
  fi
  local deps=()
  [ "$name" != cuda ] && deps=(-L "$out" -l:libcuda.so.1)
  gcc -shared -Wl,-soname,"$soname" "${vflags[@]}" -o "$out/$soname" "${objs[@]}" "${deps[@]}" -lm
}

build cuda libcuda.so.1 "" 801 mockcuda.c ""
build cublas libcublas.so.13 libcublas.so.13 15 mockblas.c MOCK_CUBLAS
build cublasLt libcublasLt.so.13 libcublasLt.so.13 15 "" ""
build curand libcurand.so.10 libcurand.so.10 999 mockblas.c MOCK_CURAND
build nvrtc libnvrtc.so.13 libnvrtc.so.13 11 "" ""
build cudart libcudart.so.13 libcudart.so.13 801 mockcudart.c ""
# FlashAttention's parameter block as mockcudart.c reads it, against the crate's own header
# (only where the cargo registry holds the version Cargo.lock pins: a build with flash-attn).
fa=$(awk '/^name = "candle-flash-attn"$/ {getline; print $3}' "$root/Cargo.lock" | tr -d '"' | head -1)
fa_h=""
for h in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-flash-attn-"$fa"/kernels/flash.h; do
  [ -n "$fa" ] && [ -f "$h" ] && fa_h=$h && break
done
if [ -n "$fa" ] && [ -n "$fa_h" ]; then
  g++ -std=c++17 -fsyntax-only -Wno-invalid-offsetof -I "$CUDA_HOME/include" -I "$(dirname "$fa_h")" -I "$here" \
    "$here/flashlayout.cpp"
else
  echo "mock build: FlashAttention's parameter layout not compared (no candle-flash-attn ${fa:-?} in the cargo registry)" >&2
fi
# The checks themselves, against known good and bad calls (their refusals print to stderr).
gcc "${cflags[@]}" -o "$work/selftest" "$here/selftest.c" -L "$out" -l:libcuda.so.1 -l:libcublas.so.13 \
  -l:libcudart.so.13
LD_LIBRARY_PATH=$out MOCKCUDA_LOG= MOCKCUDA_EXEC= "$work/selftest" 2> "$work/selftest.err" >&2 || {
  cat "$work/selftest.err" >&2
  exit 1
}
echo "$out"
