#!/usr/bin/env bash
# Runs the GPU check (scripts/gpu-check.sh) with a CUDA build of keydiff on this machine, which
# has no GPU, over stand-in CUDA libraries (scripts/cuda/mock/): every host-side path of the
# engine's CUDA code runs (candle's CUDA backend, cudarc, our kernel wrappers, the model's and
# cache's CUDA branches, the CLI's device handling), and every driver, cuBLAS and cuRAND call is
# checked as the real library checks it. Kernels do not run, so numbers are meaningless (the
# parity steps fail, as they must); what counts is what the mock libraries refused
# (mockcuda: ERROR: a kernel name a module lacks, a launch past a kernel's limits, a copy or a
# matmul operand outside its allocation), what they do not implement (UNIMPLEMENTED), and the
# engine's own errors other than parity. Also lists which of our kernels were launched.
# Usage: scripts/cuda-mock-check.sh [OUT]   (default target/cuda-mock-check)
#   KEYDIFF_BIN: the CUDA binary (default target/cuda/release/keydiff, scripts/build-cuda.sh)
#   MOCKCUDA_MEM_GIB: the stand-in device's memory (default 14: this machine's RAM backs it)
# Exit status: 0 when the mock libraries reported nothing, 1 otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=$(realpath -m "${1:-target/cuda-mock-check}")
bin=$(realpath "${KEYDIFF_BIN:-target/cuda/release/keydiff}") || { echo "no CUDA binary: run scripts/build-cuda.sh" >&2; exit 2; }
libs=$(scripts/cuda/mock/build.sh "$out/libs" | tail -1) || exit 2
rm -rf "$out/gpu-check"; mkdir -p "$out/gpu-check"
log=$out/mock.log
: > "$log"
export LD_LIBRARY_PATH=$libs MOCKCUDA_LOG=$log MOCKCUDA_MEM_GIB=${MOCKCUDA_MEM_GIB:-14}
ldd "$bin" | grep -E 'libcuda|libcublas|libcurand|libnvrtc|libcudart' > "$out/ldd.txt"
if grep -v "$libs" "$out/ldd.txt"; then echo "the binary does not load the mock libraries" >&2; exit 2; fi
start=$(date +%s)
OUT=$out/gpu-check KEYDIFF_BIN=$bin timeout "${MOCK_CHECK_TIMEOUT_S:-3000}" bash scripts/gpu-check.sh \
  > "$out/gpu-check.log" 2>&1
echo "gpu-check exit: $? after $(( $(date +%s) - start )) s" | tee -a "$out/gpu-check.log"

# Our kernels: every entry of kernels/*.cu's PTX (the build's), launched or not.
ptx=$(ls -t "$(dirname "$bin")"/build/keydiff-kernels-*/out/*.ptx 2>/dev/null | head -1)
ours=$( [ -n "$ptx" ] && grep -oE '\.entry [A-Za-z0-9_]+' "$ptx" | awk '{print $2}' | sort -u)
launched=$(awk '$1 == "launch" {n[$2] += $3} END {for (k in n) print k, n[k]}' "$log" | sort)
{
  echo "== mock check of $bin"
  echo "when: $(date -u +%FT%TZ); wall: $(( $(date +%s) - start )) s"
  echo "== refused by the mock libraries (unique)"
  grep '^ERROR' "$log" | sed 's/ (pid [0-9]*)$//' | sort | uniq -c | sort -rn
  echo "== not implemented by the mock libraries (unique)"
  grep '^UNIMPLEMENTED' "$log" | sed 's/ (pid [0-9]*)$//' | sort | uniq -c | sort -rn
  echo "== kernels launched: $(echo "$launched" | grep -c .) names, $(echo "$launched" | awk '{s += $2} END {print s + 0}') launches"
  echo "$launched" | awk '{printf "  %s %s\n", $1, $2}'
  if [ -n "$ours" ]; then
    echo "== our kernels never launched ($(comm -23 <(echo "$ours") <(echo "$launched" | awk '{print $1}' | sort) | grep -c .) of $(echo "$ours" | grep -c .))"
    comm -23 <(echo "$ours") <(echo "$launched" | awk '{print $1}' | sort) | sed 's/^/  /'
  fi
  # Kernels do not run, so every comparison with the CPU fails; anything else is worth a look
  # (e.g. a prompt cache whose positions, written by a kernel, all read 0).
  echo "== the engine's errors (gpu-check errors.log), \"logits differ from the CPU\" aside"
  grep -iE 'error|panick' "$out/gpu-check/errors.log" | grep -v 'logits differ from the CPU' | cut -c1-300 | sort | uniq -c | sort -rn | head -60
} > "$out/report.txt"
cat "$out/report.txt"
! grep -qE '^(ERROR|UNIMPLEMENTED)' "$log"
