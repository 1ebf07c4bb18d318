#!/usr/bin/env bash
# nvcc for a FlashAttention build with only the kernels you name (scripts/build-cuda.sh --flash).
#
# candle-flash-attn compiles 52 kernel files, one per (head-dim bucket, dtype, causal) and the
# paged split-KV ones: ~5 h of CPU on our 2 cores and ~400 MB of object code, too much to build
# here or to carry to the GPU host. FlashAttention's own builds can leave head dims out
# (FLASH_ATTENTION_DISABLE_HDIM*); candle's build script cannot, so its builder runs this
# wrapper as nvcc (NVCC=...).
#
# KEYDIFF_FLASH_KERNELS lists what to build, as the kernel files name it: "hdim64_bf16
# hdim128_bf16" builds flash_fwd_hdim64_bf16{,_causal}_sm80.cu and the same for 128. Every
# other kernel file of candle-flash-attn (the paged split-KV ones too: keydiff never passes a
# block table) is compiled as a stub that defines the same function and, if it were ever
# called, prints which kernel is missing and aborts. keydiff-model reads the same variable at
# compile time (`attention::FLASH_KERNELS`) and never calls a stub: `--attention flash`
# refuses such a model when it is loaded, and `auto` takes eager for it.
#
# Unset or empty KEYDIFF_FLASH_KERNELS: every call goes to nvcc unchanged (all kernels).
# Calls for any other source (candle's own kernels, keydiff's) always do.
set -euo pipefail
real=${KEYDIFF_REAL_NVCC:-nvcc}
src=${!#}   # cudaforge passes the source file last, relative to the crate's directory
name=$(basename -- "$src")
if [ -z "${KEYDIFF_FLASH_KERNELS:-}" ] || [[ $name != flash_fwd_*_sm80.cu ]] \
  || [[ $(cd "$(dirname -- "$src")" 2>/dev/null && pwd) != */candle-flash-attn-*/kernels ]]; then
  exec "$real" "$@"
fi
# KEYDIFF_FLASH_LOG, when set, gets a line per kernel file: built or stub.
log() { [ -z "${KEYDIFF_FLASH_LOG:-}" ] || echo "$1 $name" >> "$KEYDIFF_FLASH_LOG"; }
if [[ $name =~ ^flash_fwd_(hdim[0-9]+_(bf16|fp16))(_causal)?_sm80\.cu$ ]]; then
  for k in $KEYDIFF_FLASH_KERNELS; do
    if [ "$k" = "${BASH_REMATCH[1]}" ]; then
      log built
      exec "$real" "$@"
    fi
  done
fi
log stub
# The stub: the file's own specialisation line, with a body that reports and aborts.
spec=$(grep -m1 -E '^void run_mha_fwd_(splitkv_paged_)?<' "$src") || {
  echo "flash-nvcc.sh: no run_mha_fwd_ specialisation in $src (candle-flash-attn changed?)" >&2
  exit 1
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
list=$(echo $KEYDIFF_FLASH_KERNELS | tr -d '"\\')   # one line, nothing that ends a C string
cat > "$tmp/$name" <<EOF
// Stub of $name (scripts/cuda/flash-nvcc.sh): not built into this binary.
#include <cstdio>
#include <cstdlib>
#include <cutlass/numeric_types.h>
#include "flash.h"

template<>
$spec
    fprintf(stderr, "candle-flash-attn: $name was not built into this binary "
                    "(KEYDIFF_FLASH_KERNELS=$list)\n");
    abort();
}
EOF
args=("${@:1:$#-1}")
"$real" "${args[@]}" -I "$(dirname -- "$src")" "$tmp/$name"
