#!/usr/bin/env bash
# keydiff's kernels must build with the CUDA toolkits users have, not only with the pinned 13.0
# (a 13.0 toolkit needs driver 580 or later; most GPU hosts run CUDA 12 drivers, 535 and 550,
# and a build's PTX must not be newer than its host's driver). PyPI has no nvcc for CUDA 11 or
# 12, but it has NVRTC, the same front end as a library, the runtime's headers (cuda_fp16.h,
# cuda_bf16.h) and ptxas. So for each toolkit here, every kernels/*.cu goes to PTX through
# NVRTC for compute_80 and compute_90, then through that toolkit's ptxas to machine code for
# sm_80 and sm_90, warnings as errors at both steps (scripts/cuda/nvrtc-compile.py).
# NVRTC has no C library headers: a stand-in <stdint.h> (LP64, glibc's types) is given to it.
# Usage (from the project root): scripts/cuda/older-toolkits.sh   (installs once, ~120 MB)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
base=${KD_CUDA_OLDER_ROOT:-$HOME/.cache/keydiff/cuda-older}
# CUDA 11.8 (the first with sm_90 and cuda_fp8.h) and 12.2 (driver 535, a long-term branch).
toolkits=("cu11 11.8.89" "cu12 12.2.140")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/shim"
cat > "$tmp/shim/stdint.h" <<'EOF'
#pragma once
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;
EOF
shopt -s nullglob
for t in "${toolkits[@]}"; do
  read -r tag version <<< "$t"
  root=$base/$version
  if [ ! -f "$root/.done" ]; then
    python3 -m venv "$root/venv" >&2
    "$root/venv/bin/pip" install -q --no-deps "nvidia-cuda-nvrtc-$tag==$version" \
      "nvidia-cuda-runtime-$tag==$version" "nvidia-cuda-nvcc-$tag==$version" >&2
    touch "$root/.done"
  fi
  nv=$(ls -d "$root"/venv/lib/python3*/site-packages/nvidia)
  libs=("$nv"/cuda_nvrtc/lib/libnvrtc.so.*)
  [ ${#libs[@]} -eq 1 ] || { echo "CUDA $version: expected one libnvrtc.so.* in $nv/cuda_nvrtc/lib" >&2; exit 1; }
  ptxas=$nv/cuda_nvcc/bin/ptxas
  for f in kernels/*.cu; do
    for sm in 80 90; do
      ptx=$tmp/$(basename "$f" .cu)-$version-$sm.ptx
      LD_LIBRARY_PATH="$nv/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        python3 scripts/cuda/nvrtc-compile.py "${libs[0]}" "$sm" "$ptx" "$f" \
        "-I$nv/cuda_runtime/include" "-I$tmp/shim"
      "$ptxas" -arch=sm_$sm -O3 -Werror -o "${ptx%.ptx}.cubin" "$ptx"
      echo "CUDA $version (NVRTC + ptxas) sm_$sm: $f ok"
    done
  done
done
