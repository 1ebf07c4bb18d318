#!/usr/bin/env bash
# Builds the executing mock's kernel libraries into DIR (default target/cuda-mock-exec): each
# kernel source the CUDA build launches (kernels/keydiff.cu, and candle-kernels' sources at
# the version Cargo.lock pins) compiled for the host with prelude.h and linked with
# runtime.cpp, as libkx_<source>.so. With MOCKCUDA_EXEC=DIR, the stand-in driver
# (../mockcuda.c) runs every launch with them (see runtime.cpp).
# Needs g++, libffi (Debian: libffi-dev) and the pinned toolkit's headers (../../toolchain.sh).
# Usage: scripts/cuda/mock/exec/build.sh [DIR]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../../.." && pwd)
out=${1:-$root/target/cuda-mock-exec}
eval "$("$here/../../toolchain.sh")"
ck=$(awk '/^name = "candle-kernels"$/ {getline; print $3}' "$root/Cargo.lock" | tr -d '"' | head -1)
src=""
for d in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-kernels-"$ck"/src; do
  [ -n "$ck" ] && [ -f "$d/unary.cu" ] && src=$d && break
done
[ -n "$src" ] || { echo "exec build: no candle-kernels ${ck:-?} in the cargo registry (cargo fetch)" >&2; exit 1; }
if ! echo '#include <ffi.h>' | g++ -E -x c++ - > /dev/null 2>&1; then
  echo "exec build: installing libffi-dev (Debian) for ffi.h" >&2
  { apt-get install -y -q libffi-dev || { apt-get update -q && apt-get install -y -q libffi-dev; }; } > /dev/null ||
    { echo "exec build: no ffi.h, and libffi-dev could not be installed" >&2; exit 1; }
fi
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(-std=c++17 -O1 -fPIC -ffp-contract=off -w -I "$here/include" -I "$CUDA_HOME/include"
  -I "$root/kernels/emu" -I "$here")
g++ "${flags[@]}" -c "$here/runtime.cpp" -o "$work/runtime.o"
g++ "${flags[@]}" -c "$root/kernels/emu/race.cpp" -o "$work/race.o"
lib() {  # name source [include dir]
  local name=$1 file=$2 inc=${3:-}
  # `extern __shared__ T name[];` (dynamic shared memory) becomes the launch's buffer.
  sed -E 's/extern __shared__ ([A-Za-z_0-9]+) ([A-Za-z_0-9]+)\[\];/\1* \2 = (\1*)kx_dynamic_shared();/' \
    "$file" > "$work/$name.cu"
  g++ "${flags[@]}" ${inc:+-I "$inc"} -x c++ -include "$here/prelude.h" -c "$work/$name.cu" -o "$work/$name.o"
  g++ -shared -o "$out/libkx_$name.so" "$work/$name.o" "$work/runtime.o" "$work/race.o" -lffi
}
lib keydiff "$root/kernels/keydiff.cu" &
pids=($!)
for f in affine binary cast fill indexing quantized reduce sort ternary unary; do
  lib "$f" "$src/$f.cu" "$src" &
  pids+=($!)
  # Two at a time (the build machines have two cores).
  if [ ${#pids[@]} -ge 2 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
echo "$out"
