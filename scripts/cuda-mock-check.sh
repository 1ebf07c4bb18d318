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
# Usage: scripts/cuda-mock-check.sh [OUT]   (default target/cuda-mock-check; scripts/test.sh runs it)
#   KEYDIFF_BIN: a CUDA binary to check (e.g. scripts/build-cuda.sh's); unset, the CLI is built
#     with `--features cuda` in $CUDA_CHECK_TARGET_DIR (default target/cuda-check), with the
#     package set of scripts/check-cuda.sh's clippy, whose build scripts (candle's CUDA kernels)
#     it then reuses: ~5 min after check-cuda.sh on 2 cores.
#   PRESET, PROMPT_LEN, BUDGET: gpu-check.sh's TTFT shape (default here smollm2-135m, 512, 256,
#     gpu-check.sh's dry-run sizes: the whole check then takes ~4 min; set them empty for its own).
#   MOCKCUDA_MEM_GIB: the stand-in device's memory (default 14: this machine's RAM backs it).
#   MOCK_EXEC=0: leave out the executing mock's comparisons with the CPU (the end of this script;
#     its host builds come from this tree, so KEYDIFF_BIN must be built from the same kernels).
# Exit status: 0 when gpu-check.sh ran to its end, the mock libraries refused nothing and met
# no call they lack, every kernel of ours was launched (but those scripts/cuda/mock/
# not-launched.txt excuses) and nothing panicked, and the executing mock's CUDA path agreed with
# the CPU; 1 otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=$(realpath -m "${1:-target/cuda-mock-check}")
if [ -z "${KEYDIFF_BIN:-}" ]; then
  eval "$(scripts/cuda/toolchain.sh)"
  target=${CUDA_CHECK_TARGET_DIR:-target/cuda-check}
  CARGO_TARGET_DIR=$target CUDA_COMPUTE_CAP=90 cargo build --release -p keydiff-cli -p keydiff-tests \
    -p keydiff-kernels -p keydiff-cache --features cuda || exit 2
  KEYDIFF_BIN=$target/release/keydiff
fi
bin=$(realpath -e "$KEYDIFF_BIN") || { echo "no CUDA binary at $KEYDIFF_BIN" >&2; exit 2; }
export PRESET=${PRESET-smollm2-135m} PROMPT_LEN=${PROMPT_LEN-512} BUDGET=${BUDGET-256}
# Every parity fails here; a binary with flash-attn still takes flash in the TTFT steps.
export FLASH_PARITY_REQUIRED=0
libs=$(scripts/cuda/mock/build.sh "$out/libs" | tail -1) || exit 2
rm -rf "$out/gpu-check"; mkdir -p "$out/gpu-check"
log=$out/mock.log
: > "$log"
# KEYDIFF_GPU_CHECK_LIBS=keep: gpu-check.sh must not put torch's real CUDA libraries first.
export LD_LIBRARY_PATH=$libs MOCKCUDA_LOG=$log MOCKCUDA_MEM_GIB=${MOCKCUDA_MEM_GIB:-14} KEYDIFF_GPU_CHECK_LIBS=keep
ldd "$bin" | grep -E 'libcuda|libcublas|libcurand|libnvrtc|libcudart' > "$out/ldd.txt"
if grep -v "$libs" "$out/ldd.txt"; then echo "the binary does not load the mock libraries" >&2; exit 2; fi
start=$(date +%s)
OUT=$out/gpu-check KEYDIFF_BIN=$bin timeout "${MOCK_CHECK_TIMEOUT_S:-3000}" bash scripts/gpu-check.sh \
  > "$out/gpu-check.log" 2>&1
gc_rc=$?
echo "gpu-check exit: $gc_rc after $(( $(date +%s) - start )) s" | tee -a "$out/gpu-check.log"

# Our kernels: every entry of kernels/*.cu's PTX (the newest build's), launched or not, that the
# binary holds too (an older build's PTX may sit beside it).
ptx=$(ls -t "$(dirname "$bin")"/build/keydiff-kernels-*/out/*.ptx 2>/dev/null | head -1)
ours=$( [ -n "$ptx" ] && comm -12 <(grep -oE '\.entry [A-Za-z0-9_]+' "$ptx" | awk '{print $2}' | sort -u) \
  <(grep -aoE '\.entry [A-Za-z0-9_]+' "$bin" | awk '{print $2}' | sort -u))
launched=$(awk '$1 == "launch" {n[$2] += $3} END {for (k in n) print k, n[k]}' "$log" | sort)
never=$( [ -n "$ours" ] && comm -23 <(echo "$ours") <(echo "$launched" | awk '{print $1}' | sort))
excused=$(sed 's/#.*//' scripts/cuda/mock/not-launched.txt | awk 'NF {print $1}' | sort)
unexcused=$(comm -23 <(echo "$never" | grep . | sort) <(echo "$excused"))
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
    echo "== our kernels never launched ($(echo "$never" | grep -c .) of $(echo "$ours" | grep -c .))"
    echo "$never" | grep . | while read -r k; do
      if echo "$excused" | grep -qx "$k"; then echo "  $k (listed in scripts/cuda/mock/not-launched.txt)"
      else echo "  $k: NOT LISTED in scripts/cuda/mock/not-launched.txt"; fi
    done
    comm -12 <(echo "$excused") <(echo "$launched" | awk '{print $1}' | sort) |
      sed 's/^/  now launched, can leave not-launched.txt: /'
  fi
  echo "== Rust panics"
  grep -h 'panicked at' "$out/gpu-check.log" "$out/gpu-check/errors.log" | sort | uniq -c
  # Kernels do not run, so every comparison with the CPU fails; anything else is worth a look
  # (e.g. a prompt cache whose positions, written by a kernel, all read 0).
  echo "== the engine's errors (gpu-check errors.log), \"logits differ from the CPU\" aside"
  grep -iE 'error|panick' "$out/gpu-check/errors.log" | grep -v 'logits differ from the CPU' | cut -c1-300 | sort | uniq -c | sort -rn | head -60
} > "$out/report.txt"
cat "$out/report.txt"
status=0
if grep -qE '^(ERROR|UNIMPLEMENTED)' "$log"; then echo "FAIL: the mock libraries refused calls or lack some" >&2; status=1; fi
if [ -z "$ours" ]; then echo "FAIL: no PTX of kernels/*.cu beside $bin" >&2; status=1; fi
if [ -n "$unexcused" ]; then echo "FAIL: kernels of ours no step launched: $(echo $unexcused)" >&2; status=1; fi
if grep -q 'panicked at' "$out/gpu-check.log" "$out/gpu-check/errors.log"; then echo "FAIL: a Rust panic" >&2; status=1; fi
# gpu-check.sh itself fails here (every comparison with the CPU does); it must run to its end.
if [ $gc_rc -ge 124 ] || ! grep -q '^elapsed: ' "$out/gpu-check/summary.txt" 2>/dev/null; then
  echo "FAIL: gpu-check.sh did not run to its end (exit $gc_rc)" >&2; status=1
fi

# The executing mock: the same stand-ins, now running every kernel launched (its host build
# over the CPU emulation, scripts/cuda/mock/exec) and every matmul, so that the CUDA path
# computes real values here. check-device then compares them with the CPU's, as on a GPU:
# multi-chunk prefill with eviction and decode steps (the decode kernel, fused linears, the
# eviction kernels, the statistics kernels), in f32 (which must agree to rounding) and bf16,
# a block cache, a batch, and GGUF-typed weights through candle's quantized matmuls (MMVQ and
# MMQ, launched through the runtime; their inline PTX, tensor-core mma.sync and ldmatrix,
# emulated by exec/runtime.cpp); then check-kernels. FlashAttention's kernels have no host
# build (and the binary built here has no FlashAttention). ~3 min.
if [ "${MOCK_EXEC:-1}" = 1 ]; then
  kx=$(scripts/cuda/mock/exec/build.sh "$out/exec-libs" | tail -1) || exit 2
  exec_mock=$out/exec-mock.log exec_out=$out/exec.jsonl
  : > "$exec_mock"; : > "$exec_out"; : > "$out/exec.log"
  exec_rc=0
  run_exec() {
    echo "== check-device $*" >> "$out/exec.log"
    MOCKCUDA_EXEC=$kx MOCKCUDA_LOG=$exec_mock "$bin" check-device --device cuda:0 --budget 128 "$@" \
      2>> "$out/exec.log" | tee -a "$out/exec.log" | grep '^{' >> "$exec_out" || exec_rc=1
  }
  exec_start=$(date +%s)
  run_exec --dtype f32 --attention eager --policies keydiff,tova,snapkv,h2o --decode-steps 4 \
    --preset configs/tiny-llama.json --preset configs/tiny-qwen.json
  run_exec --dtype bf16 --policies keydiff,snapkv --decode-steps 4 --preset configs/tiny-qwen3.json \
    --preset configs/tiny-qwen3moe.json
  run_exec --dtype bf16 --kv-dtype q8_0 --policies keydiff --decode-steps 4 --preset configs/tiny-qwen-d64.json
  run_exec --dtype bf16 --batch --policies keydiff --preset configs/tiny-llama.json
  # GGUF weight types (gpu-check.sh's step 3g, three of its cases): chunks of 8 rows take
  # MMVQ, chunks of 64 MMQ (q4_k: its m16n8k32 mma and ldmatrix .x4; q6_k: m16n8k16 and .x2);
  # with H2O eviction, against the CPU's exact dequantized products.
  run_exec --dtype bf16 --weight-type q4_0 --attention eager --prompt-len 96 --chunk 8 \
    --preset configs/tiny-llama.json
  for t in q4_k q6_k; do
    run_exec --dtype bf16 --weight-type $t --attention eager --prompt-len 300 --chunk 64 --policies h2o \
      --preset configs/tiny-qwen-d64.json
  done
  # A batched step of quantized weights: its rows go through MMQ where each alone takes MMVQ,
  # so the batch check's tolerance is MAX_BATCH_REL_DIFF_QUANTIZED there (gpu-check.sh 3g).
  run_exec --dtype bf16 --batch --weight-type q4_0 --policies keydiff --preset configs/tiny-llama.json
  # And gpu-check.sh's kernel parity step (without its n = 131200 and its timings), through
  # the CUDA wrappers of keydiff-kernels this time: eviction kernels, codecs, decode kernels,
  # greedy and sampled tokens against the CPU.
  echo "== check-kernels --time-n" >> "$out/exec.log"
  MOCKCUDA_EXEC=$kx MOCKCUDA_LOG=$exec_mock "$bin" check-kernels --device cuda:0 --time-n \
    > "$out/exec-kernels.jsonl" 2>> "$out/exec.log" || exec_rc=1
  kernel_cases=$(grep -c '^{' "$out/exec-kernels.jsonl")
  echo "check-kernels: $kernel_cases cases" | tee -a "$out/exec.log"
  [ "$kernel_cases" -ge 100 ] || exec_rc=1
  # f32 must agree to rounding, not just to check-device's cosine of 0.99. A NaN or infinite
  # difference is written as null: never accepted.
  python3 - "$exec_out" <<'PY' || exec_rc=1
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def off(l):
    if "diff" in l:
        d = l["diff"]
        if d["cosine"] is None or d["max_rel"] is None or d["cosine"] < 0.99:
            return True
        return l.get("dtype") == "f32" and (d["max_rel"] > 1e-4 or not l["top1_equal"])
    return l.get("max_rel") is None or not l.get("pass")  # check-device --batch
bad = [l for l in lines if off(l)]
for l in bad:
    print("off:", l["preset"], l["policy"], l.get("diff", l.get("max_rel")), file=sys.stderr)
print(f"executing mock: {len(lines)} comparisons, {len(bad)} off", file=sys.stderr)
sys.exit(1 if bad or len(lines) < 28 else 0)
PY
  # Those GGUF cases ran candle's kernels, tensor cores included (not a fallback path).
  for want in 'launch mmvq_gguf_q4_0_bf16_plain_cuda8 ' 'launch _Z9mul_mat_qIL9ggml_type12E' \
      'launch _Z9mul_mat_qIL9ggml_type14E' 'asm mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 ' \
      'asm mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 ' 'asm ldmatrix.sync.aligned.m8n8.x4.b16 ' \
      'asm ldmatrix.sync.aligned.m8n8.x2.b16 '; do
    grep -q "^$want" "$exec_mock" || { echo "executing mock: no '$want' in $exec_mock" | tee -a "$out/exec.log"; exec_rc=1; }
  done
  # A binary whose kernels come from another kernels/keydiff.cu than the host build's is refused,
  # not run on the wrong code: its PTX's source mark (build.rs) against kx_sources.tsv.
  drift=$out/exec-drift
  rm -rf "$drift" && mkdir -p "$drift"
  for f in "$kx"/libkx_*.so "$kx"/kx_runtime.tsv; do ln -s "$f" "$drift/"; done
  printf 'keydiff.cu\t0123456789abcdef\n' > "$drift/kx_sources.tsv"
  : > "$out/exec-drift.log"
  if MOCKCUDA_EXEC=$drift MOCKCUDA_LOG=$out/exec-drift.log "$bin" check-device --device cuda:0 \
      --dtype f32 --budget 128 --policies keydiff --preset configs/tiny-llama.json > /dev/null 2>&1 ||
     ! grep -q "another source than MOCKCUDA_EXEC" "$out/exec-drift.log"; then
    echo "executing mock: a host build of another kernels/keydiff.cu was not refused" | tee -a "$out/exec.log"
    exec_rc=1
  fi
  echo "executing mock: $(( $(date +%s) - exec_start )) s, exit $exec_rc" | tee -a "$out/exec.log"
  if [ $exec_rc -ne 0 ]; then echo "FAIL: the CUDA path, run by the executing mock, differs from the CPU (see $out/exec.log)" >&2; status=1; fi
  if grep -qE '^(ERROR|UNIMPLEMENTED)' "$exec_mock"; then
    grep -E '^(ERROR|UNIMPLEMENTED)' "$exec_mock" | sort | uniq -c | head >&2
    echo "FAIL: the executing mock refused calls or lacks some" >&2; status=1
  fi
fi
exit $status
