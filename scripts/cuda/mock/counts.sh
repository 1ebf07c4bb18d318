#!/usr/bin/env bash
# Runs one command of a CUDA build over the mock CUDA libraries (build.sh) and prints what it
# asked of the device: kernel launches (in all, and the most frequent), allocations, copies each
# way (device-to-host copies wait for the stream: a decode step's host syncs), synchronisations
# and cuBLAS matmuls. Exact counts, not timings: the difference between two runs that differ by
# N decode steps, divided by N, is what one step costs in launches and syncs.
# Usage: scripts/cuda/mock/counts.sh [--top K] [--stdout FILE] -- COMMAND [ARGS...]
#   (the command's own output goes to FILE, default nowhere)
#   e.g. scripts/cuda/mock/counts.sh -- target/cuda-check/release/keydiff run --random-weights \
#          -m llama-3.2-3b --device cuda:0 --dtype bf16 -p "..." -n 64
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=12 keep=/dev/null
while [ $# -gt 0 ]; do
  case $1 in
    --top) top=$2; shift 2 ;;
    --stdout) keep=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--top K] [--stdout FILE] -- COMMAND [ARGS...]" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--top K] [--stdout FILE] -- COMMAND [ARGS...]" >&2; exit 2; }
libs=${MOCKCUDA_LIBS:-$(cd "$here/../../.." && pwd)/target/cuda-mock-libs}
# Built when missing or older than a source.
if [ ! -f "$libs/libcuda.so.1" ] || [ -n "$(find "$here" -newer "$libs/libcuda.so.1" -name '*.[ch]')" ]; then
  "$here/build.sh" "$libs" > /dev/null
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
LD_LIBRARY_PATH=$libs MOCKCUDA_LOG=$log MOCKCUDA_MEM_GIB=${MOCKCUDA_MEM_GIB:-14} "$@" > "$keep" || rc=$?
awk '
  $1 == "launch" { n[$2] += $3; total += $3 }
  $1 == "calls" { for (i = 2; i < NF; i += 2) calls[$i] += $(i + 1) }
  $1 == "bytes" { for (i = 2; i < NF; i += 2) bytes[$i] += $(i + 1) }
  $1 == "ERROR" || $1 == "UNIMPLEMENTED" { bad++ }
  END {
    # %.0f: mawk clamps %d to 2^31 - 1.
    printf "launches %.0f (%d kernels)\n", total, length(n)
    split("alloc free memset copy-htod copy-dtoh copy-dtod sync gemm", order, " ")
    for (i = 1; i <= 8; i++) printf "%s %.0f\n", order[i], calls[order[i]]
    printf "bytes-htod %.0f\nbytes-dtoh %.0f\nmock-errors %d\n", bytes["htod"], bytes["dtoh"], bad
  }' "$log"
awk '$1 == "launch" { n[$2] += $3 } END { for (k in n) printf "  %9.0f %s\n", n[k], k }' "$log" |
  sort -rn | head -n "$top"
exit $rc
