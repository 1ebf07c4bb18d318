#!/usr/bin/env bash
# Checks scripts/cuda/flash-nvcc.sh against candle-flash-attn's own kernel files, without
# building FlashAttention (scripts/check-cuda.sh runs it in CI; needs the pinned nvcc on PATH):
# 1. With build-cuda.sh's default list, the 6 listed files go to nvcc as they are and the
#    other 46 (other head dims, fp16, the paged split-KV ones) become stubs.
# 2. A stub of each kind compiles for sm_90 and defines exactly the function its file defines,
#    so the library links and nothing else changes.
# A candle-flash-attn release that renames or reshapes its kernel files fails here, not in a
# two-hour build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
here=$PWD
fa=$(cargo metadata --format-version 1 --all-features 2>/dev/null | python3 -c '
import json, sys
m = json.load(sys.stdin)
print(next(p["manifest_path"] for p in m["packages"] if p["name"] == "candle-flash-attn"))')
fa=$(dirname "$fa")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail() { echo "test-flash-nvcc: $*" >&2; exit 1; }

export KEYDIFF_FLASH_KERNELS="hdim32_bf16 hdim64_bf16 hdim128_bf16" KEYDIFF_FLASH_LOG=$tmp/log
: > "$tmp/log"
(cd "$fa" && for f in kernels/flash_fwd_*_sm80.cu; do
  KEYDIFF_REAL_NVCC=true "$here/scripts/cuda/flash-nvcc.sh" -c -o "$tmp/x.o" "$f"
done)
built=$(grep '^built ' "$tmp/log" | sort | awk '{print $2}' | tr '\n' ' ')
want="flash_fwd_hdim128_bf16_causal_sm80.cu flash_fwd_hdim128_bf16_sm80.cu flash_fwd_hdim32_bf16_causal_sm80.cu flash_fwd_hdim32_bf16_sm80.cu flash_fwd_hdim64_bf16_causal_sm80.cu flash_fwd_hdim64_bf16_sm80.cu "
[ "$built" = "$want" ] || fail "built: $built; expected: $want"
stubs=$(grep -c '^stub ' "$tmp/log")
[ "$stubs" = 46 ] || fail "$stubs stubs, expected 46"
echo "flash-nvcc.sh: 6 kernel files built, 46 stubs, of candle-flash-attn $(basename "$fa")"

eval "$(scripts/cuda/cutlass.sh)"
inc=$(ls -d "$CUDAFORGE_HOME"/git/checkouts/cutlass-*/include | head -1)
for case in "flash_fwd_hdim96_fp16_causal_sm80.cu|run_mha_fwd_<cutlass::half_t, 96, true>" \
    "flash_fwd_splitkv_hdim64_bf16_sm80.cu|run_mha_fwd_splitkv_paged_<cutlass::bfloat16_t, 64, false>"; do
  f=${case%%|*} sym=${case#*|}
  (cd "$fa" && KEYDIFF_REAL_NVCC=$(command -v nvcc) "$here/scripts/cuda/flash-nvcc.sh" \
    -gencode arch=compute_90,code=sm_90 -c -o "$tmp/stub.o" -std=c++17 -I"$inc" \
    -Xcompiler -fPIC "kernels/$f")
  defined=$(nm -C --defined-only "$tmp/stub.o" | grep -c ' T ')
  nm -C --defined-only "$tmp/stub.o" | grep -qF " T void $sym(Flash_fwd_params&, CUstream_st*)" \
    && [ "$defined" = 1 ] || fail "the stub of $f does not define exactly $sym"
  echo "flash-nvcc.sh: the stub of $f compiles and defines $sym"
done
