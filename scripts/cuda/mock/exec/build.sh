#!/usr/bin/env bash
# Builds the executing mock's kernel libraries into DIR (default target/cuda-mock-exec): each
# kernel source the CUDA build launches (kernels/keydiff.cu, and candle-kernels' sources at
# the version Cargo.lock pins) compiled for the host with prelude.h and linked with
# runtime.cpp, as libkx_<source>.so; and candle's runtime-launched GGUF matmuls, rewritten
# by hostify.py, as libkx_gguf.so with its index kx_runtime.tsv. With MOCKCUDA_EXEC=DIR, the
# stand-in driver (../mockcuda.c) and runtime (../mockcudart.c) run every launch with them
# (see runtime.cpp). ~1 min on two cores.
# Needs g++, binutils (nm, c++filt), python3, libffi (Debian: libffi-dev) and the pinned
# toolkit's headers (../../toolchain.sh).
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
flags=(-std=c++17 -O1 -fPIC -ffp-contract=off -fstack-clash-protection -w -I "$here/include" -I "$CUDA_HOME/include"
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

# candle's runtime-launched GGUF matmuls (MMVQ for up to 8 rows, MMQ above, and their q8_1
# quantizers), which nvcc links into the binary as a static library: hostify.py turns their
# nvcc-only parts (launches in host code, inline PTX) into host code, and the index maps the
# names the binary registers them by to the symbols and parameter types here.
mkdir -p "$work/gguf/mmq_gguf"
for f in "$src"/mmvq_gguf.cu "$src"/mmq_gguf/*; do
  python3 "$here/hostify.py" "$f" "$work/gguf/${f#"$src"/}"
done
gguf=("$work/gguf/mmvq_gguf.cu" "$work/gguf/mmq_gguf/mmq_quantize.cu" "$work"/gguf/mmq_gguf/mmq_instance_*.cu)
pids=()
for f in "${gguf[@]}"; do
  g++ "${flags[@]}" -x c++ -include "$here/prelude.h" -c "$f" -o "${f%.cu}.o" &
  pids+=($!)
  if [ ${#pids[@]} -ge 2 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
g++ -shared -o "$out/libkx_gguf.so" "${gguf[@]/%.cu/.o}" "$work/runtime.o" "$work/race.o" -lffi
python3 "$here/hostify.py" --index "$out/libkx_gguf.so" > "$out/kx_runtime.tsv"
# Which kernels/keydiff.cu the host build is of (FNV-1a 64, as crates/keydiff-kernels/build.rs
# marks the binary's PTX): the stand-in driver refuses to run a binary's kernels on another's.
python3 - "$root/kernels/keydiff.cu" > "$out/kx_sources.tsv" <<'PY'
import sys
h = 0xcbf29ce484222325
for b in open(sys.argv[1], "rb").read():
    h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
print(f"keydiff.cu\t{h:016x}")
PY
echo "$out"
