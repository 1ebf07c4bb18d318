#!/usr/bin/env bash
# One run on a GPU host (see GPU.md): environment, eviction-kernel parity and timing, the KV
# cache codecs against the CPU, CPU-vs-GPU model parity (eager attention, and flash when the
# binary has it; f16, q8_0, q4_0, q5_1 and fp8 caches, in bf16 and f32, and a bisect of the
# block caches' bf16 gap), GGUF weight types (candle's quantized matmuls) against the CPU and
# under batching, perplexity parity, batched passes against single runs on the device,
# prefix reuse on the device (bf16 and fp8 caches), the memory plan against the driver, a
# prompt cache saved and loaded on the device, speculative decoding on the device, a short
# TTFT sweep, batched decode, a prompt joining a decoding batch, the 8B-shaped eviction
# share, eager against flash attention, GGUF-typed decoding with bf16 and f32 rows into the
# quantized matmuls, then, as time allows, the kernels under compute-sanitizer.
# Build the binary here first (scripts/build-cuda.sh, or with FlashAttention-2
# `scripts/build-cuda.sh --flash`, which gives target/cuda-flash/release/keydiff: the TTFT steps
# then run flash, as users get it), carry it, then on the GPU host:
#   scripts/gpu-check.sh            (logs go to $OUT when set, else bench/gpu-check-logs/)
# Prints a summary table last. Needs no Rust toolchain and no network on the GPU host.
# Through the device tool (64 MiB travel, at most 8 files come back): compress the binary
# (stripped it is ~63 MB, gzipped ~20 MB; with flash 110 MB and 28 MB), write the logs
# elsewhere and pack them (target/cuda-flash/... for the flash build):
#   mkdir -p .gpu && strip -o /tmp/kd target/cuda/release/keydiff && gzip -c /tmp/kd > .gpu/keydiff.gz
#   (carry [".gpu"]) gunzip -c .gpu/keydiff.gz > /tmp/keydiff && chmod +x /tmp/keydiff;
#   d=$OUT; mkdir -p /tmp/gc; OUT=/tmp/gc KEYDIFF_BIN=/tmp/keydiff scripts/gpu-check.sh 2>&1 | tee /tmp/gc.log;
#   tar czf $d/gpu-check.tgz -C /tmp gc gc.log; cp /tmp/gc/summary.txt $d/
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=${KEYDIFF_BIN:-target/cuda/release/keydiff}
# Overrides for a dry run without a GPU: DEVICE=cpu PRESET=smollm2-135m PROMPT_LEN=512 BUDGET=256
device=${DEVICE:-cuda:0}
preset=${PRESET:-llama-3.2-3b}
plen=${PROMPT_LEN:-8192}
budget_n=${BUDGET:-6144}
out=${OUT:-bench/gpu-check-logs}
mkdir -p "$out" "$out/ttft"
summary=$out/summary.txt
errors=$out/errors.log
: > "$summary"; : > "$errors"
# Whole-run budget: TTFT configurations still pending past it are skipped (and said so).
deadline=${DEADLINE_S:-420}
# FLASH_PARITY_REQUIRED=0 runs the flash steps even where flash parity failed on the logits alone
# (scripts/cuda-mock-check.sh: kernels do not run there, so every comparison fails, and the
# flash host path of the TTFT steps is what it checks).
flash_required=${FLASH_PARITY_REQUIRED:-1}
note() { echo "$*" | tee -a "$summary"; }

# Libraries: the driver's libcuda, the rest from torch's CUDA 13 wheels (KEYDIFF_GPU_CHECK_LIBS=keep
# leaves LD_LIBRARY_PATH as it is: scripts/cuda-mock-check.sh's stand-ins).
if [ "${KEYDIFF_GPU_CHECK_LIBS:-}" != keep ] &&
   nvlib=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))' 2>/dev/null); then
  export LD_LIBRARY_PATH=$nvlib:${LD_LIBRARY_PATH:-}
fi

echo "== 1. environment"
note "started: $(date -u +%FT%TZ)"
nvidia-smi 2>&1 | tee "$out/env.log" || note "nvidia-smi: not available"
missing=$(ldd "$bin" | grep 'not found')
if [ -n "$missing" ]; then note "ldd: MISSING $missing"; exit 1; fi
note "ldd: all libraries found"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
note "gpu: $gpu"
note "binary: $bin, $("$bin" --version 2>/dev/null || echo "version unknown"); tree $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
# What the binary sees: each CUDA device, its compute capability and memory, what runs there.
timeout 30 "$bin" devices 2>> "$errors" | grep '^cuda' | while read -r line; do note "devices: $line"; done

echo "== 2. eviction kernels against the CPU references, then timed against copy bandwidth"
# Scoring, selection/plan, moves: odd sizes, d 64/128/256, f32/f16/bf16, n up to 131072 + 128.
# The cache codecs (five block types and fp8, from f32/f16/bf16): the device's bytes and values
# must be the CPU's exactly. The decode kernels (float caches in the queries' dtype, blocks and
# fp8 read in place; f32/f16/bf16 queries, d 64/128/256, one split and several; the cache
# encoded on the device) against eager attention on the CPU over the CPU codec's cache.
# Greedy sampling on the device (keydiff_argmax_rows_*: f32/f16/bf16 logits, vocabularies to
# 151,936, ties, NaN, strided views) against the host sampler's argmax, and sampled tokens
# (keydiff_sample_rows_*: temperature, top-k, top-p, min-p; rows without a finite logit)
# against the host's draw. Timing: 8 KV heads, d 128, bf16 (Llama-3.1-8B's KV shape), B = 128,
# n = N + B; each n with
# the selection on one block per head, on many (a launch per digit), and on many in one launch
# for few evictions (the engine takes that past 4096 slots when the candidates fit, B = 128
# always; many otherwise; n = 2176, a 2K budget, shows whether it should below 4096 too),
# each with 16-byte loads (the engine's for d 128); and scalar loads with the engine's split:
# 4 rows per n, as before this third split.
# Each at 8 heads (one layer) and at 256 (32 layers of 8: the engine evicts a chunk's layers
# together, as one eviction over every layer's heads; KeyDiff on float caches scores them
# together too).
timeout 200 "$bin" check-kernels --device "$device" --large --time-n 2176,4224,8320,32896,131200 \
    --time-layers 1,32 \
    > "$out/kernels.jsonl" 2> "$out/kernels.txt"
rc=$?
{ echo "kernels:"; sed 's/^/  /' "$out/kernels.txt"; } >> "$summary"
[ $rc = 0 ] && note "kernels: PASS" || note "kernels: FAIL (exit $rc)"

echo "== 3. CPU f32 vs GPU: small random Llama/Qwen shapes, multi-chunk prefill, with eviction"
parity_ok=1
# KNorm runs on the presets without q/k RMSNorm: after Qwen 3's k_norm (unit weights when
# random) every key has the same norm, so KNorm's scores tie and rounding picks (first GPU run,
# 2026-12-04: cosine 0.974 on tiny-qwen3 in bf16, selection differing in f32 too).
for dt in bf16 f32; do
  if ! timeout 150 "$bin" check-device --device "$device" --dtype "$dt" --attention eager --prompt-len 700 --chunk 64 \
      --budget 256 --policies keydiff,keydiff-mean,tova,tova-per-head,snapkv,h2o,sink \
      > "$out/parity-$dt.jsonl" 2>> "$errors"; then
    parity_ok=0
    tail -5 "$errors"
  fi
  if ! timeout 60 "$bin" check-device --device "$device" --dtype "$dt" --attention eager --prompt-len 700 --chunk 64 \
      --budget 256 --policies knorm --preset configs/tiny-llama.json --preset configs/tiny-qwen.json \
      > "$out/parity-$dt-knorm.jsonl" 2>> "$errors"; then
    parity_ok=0
    tail -5 "$errors"
  fi
done
# A cache of another dtype than the activations (--kv-dtype): bf16 activations, f16 cache.
if ! timeout 100 "$bin" check-device --device "$device" --dtype bf16 --kv-dtype f16 --attention eager \
    --prompt-len 700 --chunk 64 --budget 256 --policies keydiff,tova,h2o \
    > "$out/parity-bf16-kvf16.jsonl" 2>> "$errors"; then
  parity_ok=0
  tail -5 "$errors"
fi
# Quantized caches (--kv-dtype q8_0, q4_0, q5_1: the block quantize and dequantize kernels;
# fp8: candle's casts), bf16 activations, on presets whose heads hold whole blocks of 32. The
# CPU reference holds block types as they are (its codec is the kernels' twin), fp8 in f32.
# Coarse codes move KeyDiff's and TOVA's choices when bf16 activations land a value on
# another code (CPU dry runs in bf16 on tiny-qwen-d64 under KeyDiff: cosine 0.978 for fp8,
# 0.981 for q4_0, 0.978 for q5_1; 0.992 for q8_0), so those are checked under the policies
# that hold: q4_0 under TOVA and H2O (0.996, 0.999), q5_1 and fp8 under H2O, and all under the
# full cache.
for kvt in q8_0 q4_0 q5_1 fp8; do
  pol=keydiff,tova,h2o
  [[ $kvt == q4_0 ]] && pol=tova,h2o
  [[ $kvt == fp8 || $kvt == q5_1 ]] && pol=h2o
  if ! timeout 100 "$bin" check-device --device "$device" --dtype bf16 --kv-dtype "$kvt" \
      --attention eager --prompt-len 700 --chunk 64 --budget 256 --policies "$pol" \
      --preset configs/tiny-qwen-d64.json --preset configs/tiny-qwen3.json \
      > "$out/parity-bf16-kv$kvt.jsonl" 2>> "$errors"; then
    parity_ok=0
    tail -5 "$errors"
  fi
done
# The same caches under f32 activations: the device quantizes what the CPU quantizes up to
# matmul rounding, so a code rarely flips and the logits must agree closely. (The first GPU run
# found bf16 quantized caches at cosine 0.967-0.995 against 0.9995+ for the CPU in bf16.)
# fp8 is not a block type: the CPU reference holds it in f32 (check-device's `twin`), so its
# own rounding moves KeyDiff's choice (CPU dry run, 2026-12-05: cosine 0.977 on tiny-qwen-d64);
# it is checked under H2O and the full cache, as in bf16.
for kvt in q8_0 q4_0 q5_1 fp8; do
  pol=keydiff,tova,h2o
  [[ $kvt == fp8 ]] && pol=h2o
  if ! timeout 100 "$bin" check-device --device "$device" --dtype f32 --kv-dtype "$kvt" \
      --attention eager --prompt-len 700 --chunk 64 --budget 256 --policies "$pol" \
      --preset configs/tiny-qwen-d64.json --preset configs/tiny-qwen3.json \
      > "$out/parity-f32-kv$kvt.jsonl" 2>> "$errors"; then
    parity_ok=0
    tail -5 "$errors"
  fi
done
# Diagnostics, not pass/fail: which setting moves a bf16 q8_0 cache's gap (one chunk for the
# whole prompt; an f32 or f16 cache under bf16 activations, which reads the cache through the
# same cast; f16 activations), against the device's own bf16 cache on the same presets (the
# first run had no tiny-qwen-d64 baseline) and the same q8_0 run on this host's CPU (the CPU
# bf16 figures the first run was compared with were measured elsewhere, unlogged).
for a in "--dtype bf16 --kv-dtype q8_0 --chunk 700 --budget 768" \
         "--dtype bf16 --chunk 64 --budget 256" \
         "--dtype bf16 --kv-dtype f32 --chunk 64 --budget 256" \
         "--dtype f16 --kv-dtype q8_0 --chunk 64 --budget 256" \
         "--dtype f16 --kv-dtype f16 --chunk 64 --budget 256"; do
  tag=$(echo "$a" | tr -d -- '-' | tr ' ' '_')
  # shellcheck disable=SC2086
  timeout 60 "$bin" check-device --device "$device" $a --attention eager --prompt-len 700 \
      --policies h2o --preset configs/tiny-qwen3.json --preset configs/tiny-qwen-d64.json \
      > "$out/diag-$tag.jsonl" 2>> "$out/diag.err"
done
cpu_diag="$out/diag-cpu_dtype_bf16_kvdtype_q8_0_chunk_64_budget_256.jsonl"
timeout 60 "$bin" check-device --device cpu --dtype bf16 --kv-dtype q8_0 --chunk 64 --budget 256 \
    --attention eager --prompt-len 700 --policies h2o --preset configs/tiny-qwen3.json \
    --preset configs/tiny-qwen-d64.json > "$cpu_diag" 2>> "$out/diag.err"
python3 - "$out" >> "$summary" <<'PY'
import json, sys, glob
print("diagnostics (not pass/fail; CPU f32 reference with the same cache type):")
for f in sorted(glob.glob(sys.argv[1] + "/diag-*.jsonl")):
    for line in open(f):
        try:
            r = json.loads(line); d = r["diff"]
        except (ValueError, KeyError):
            print(f"  {f.split('/diag-')[1][:-6]:44} (a line cut short: the run timed out?)")
            continue
        print(f"  {f.split('/diag-')[1][:-6]:44} {r['preset'].split('/')[-1]:22} {r['policy']:6} {d['cosine']:9.6f} {d['max_rel']:9.2e}")
PY
python3 - "$out" >> "$summary" <<'PY'
import json, sys, glob
print("parity (CPU f32 reference):")
print(f"  {'dtype':5} {'kv':6} {'attn':5} {'preset':24} {'policy':14} {'cosine':>9} {'max_rel':>9} top1")
for f in sorted(glob.glob(sys.argv[1] + "/parity-*.jsonl")):
    for line in open(f):
        r = json.loads(line); d = r["diff"]
        print(f"  {r['dtype']:5} {r.get('kv_dtype', r['dtype']):6} {r.get('attention', 'eager'):5} {r['preset'].split('/')[-1]:24} {r['policy']:14} {d['cosine']:9.6f} {d['max_rel']:9.2e} {'same' if r['top1_equal'] else 'DIFF'}")
PY
[ $parity_ok = 1 ] && note "parity: PASS" || note "parity: FAIL"

echo "== 3a. perplexity on the GPU against the CPU: every logit row, log-softmax, the targets' NLL; prompt logprobs (device top-k) against them"
ppl_ok=1
for dt in f32 bf16; do
  if ! timeout 100 "$bin" check-device --device "$device" --dtype "$dt" --attention eager --prompt-len 700 \
      --chunk 64 --budget 256 --policies keydiff,tova --perplexity > "$out/ppl-$dt.jsonl" 2>> "$errors"; then
    ppl_ok=0
    tail -5 "$errors"
  fi
done
python3 - "$out" >> "$summary" <<'PY'
import json, sys, glob
print("perplexity (CPU f32 reference; per-token NLL, random weights: NLL ~ ln(vocab)):")
print(f"  {'dtype':5} {'preset':24} {'policy':10} {'max|dNLL|':>10} {'corr':>9} {'logprobs':>9}")
for f in sorted(glob.glob(sys.argv[1] + "/ppl-*.jsonl")):
    for line in open(f):
        r = json.loads(line); n = r["nll"]; lp = n.get("logprobs_max_abs")
        lp = f"{lp:9.1e}" if isinstance(lp, (int, float)) else f"{'-':>9}"
        print(f"  {r['dtype']:5} {r['preset'].split('/')[-1]:24} {r['policy']:10} {n['max_abs']:10.2e} {n['correlation']:9.6f} {lp}")
PY
[ $ppl_ok = 1 ] && note "perplexity parity: PASS" || note "perplexity parity: FAIL"

echo "== 3c. flash attention against the CPU (only binaries built with --features flash-attn)"
# Presets whose heads FlashAttention-2 takes (multiples of 8: 16, 64, 32; tiny-qwen's are 10),
# all within scripts/build-cuda.sh's default kernels (hdim32/64/128, bf16).
# The TTFT steps below run with `auto` (flash when the binary has it, as users get it), or
# with eager when this parity failed, so that a broken flash build still leaves the eviction
# numbers.
ttft_attention=auto flash_ok=0
if timeout 150 "$bin" check-device --device "$device" --dtype bf16 --attention flash --prompt-len 700 \
    --preset configs/tiny-llama.json --preset configs/tiny-qwen-d64.json \
    --preset configs/tiny-qwen3.json --preset configs/tiny-qwen3moe.json \
    --chunk 64 --budget 256 --policies keydiff,tova,snapkv,h2o,sink \
    > "$out/flash-bf16.jsonl" 2> "$out/flash.err"; then
  flash_rc=0
else
  flash_rc=$?
fi
# Its rows whether it passed or not: a failure's cosines say how far off flash is.
[ -s "$out/flash-bf16.jsonl" ] && python3 - "$out/flash-bf16.jsonl" >> "$summary" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    d = r["diff"]
    print(f"  bf16  {r.get('kv_dtype', 'bf16'):5} {r['attention']:5} {r['preset'].split('/')[-1]:24} {r['policy']:14} {d['cosine']:9.6f} {d['max_rel']:9.2e} {'same' if r['top1_equal'] else 'DIFF'}")
PY
if [ $flash_rc = 0 ]; then
  note "flash parity: PASS"
  flash_ok=1
elif grep -qF 'built without the `flash-attn` feature' "$out/flash.err"; then
  note "flash parity: not run (this binary was built without the flash-attn feature)"
elif [ "$flash_required" = 0 ] && [ "$(grep -c '^error' "$out/flash.err")" = 1 ] &&
    grep -q '^error: logits differ from the CPU' "$out/flash.err"; then
  note "flash parity: FAIL on the logits alone; the flash steps run all the same (FLASH_PARITY_REQUIRED=0)"
  flash_ok=1
else
  note "flash parity: FAIL (exit $flash_rc; the TTFT steps take eager)"; tail -5 "$out/flash.err" | tee -a "$errors"
  ttft_attention=eager
fi

echo "== 3d. batching on the device: a batch step and a mixed pass (decode rows + prompt chunks) against single runs"
# serve --max-batch runs all rows of a step through one matmul on a GPU (on the CPU each prompt
# chunk takes its own): every segment must equal its sequence alone within 2% of the logits'
# scale (bf16), with the caches' lengths and positions equal, under evicting policies too.
if timeout 90 "$bin" check-device --batch --device "$device" --dtype bf16 \
    --policies keydiff,tova,snapkv,h2o,sink > "$out/batch-bf16.jsonl" 2>> "$errors"; then
  batch_ok=1
else
  batch_ok=0; tail -5 "$errors"
fi
python3 - "$out/batch-bf16.jsonl" >> "$summary" <<'PY'
import json, sys
print("batch vs single (bf16, on the device; max |d| / scale over 3 batched rows + 5 mixed segments):")
for r in map(json.loads, open(sys.argv[1])):
    top = sum(s["top1_equal"] for s in r["segments"])
    print(f"  {r['attention']:5} {r['preset'].split('/')[-1]:24} {r['policy']:14} {r['max_rel']:9.2e} top1 {top}/{len(r['segments'])} {'ok' if r['pass'] else 'FAIL'}")
PY
[ $batch_ok = 1 ] && note "batch parity: PASS" || note "batch parity: FAIL"

echo "== 3g. GGUF weight types on the device (candle's quantized matmuls) against the CPU, and batching"
# Random models with their linears and embedding quantized as a GGUF file of each type holds
# them (--weight-type; never run on hardware before): the CPU f32 reference multiplies the
# dequantized blocks exactly (dense prefill copies; a mixture's experts, which keep none,
# through its quantized matmul), the device runs candle's quantized matmuls. Chunks of 64 rows
# under the full cache and H2O eviction, and for four types chunks of 8 rows under the full
# cache (CUDA's matrix-vector kernels take up to 8). The K types need widths of 256
# (tiny-qwen-d64). Then batching with quantized weights (decode rows of several sequences
# through one quantized matmul; a row changes kernel, MMVQ alone / MMQ in a step of more than
# 8 rows, so the tolerance is 5e-2, not 2e-2: 1-3% apart under the executing mock,
# bench/results/2026-12-07-executing-mock-gguf.md, which ran this whole step: 48/48 cosine >=
# 0.9974). keydiff hands bf16 rows to those matmuls; two types are also
# checked with the rows cast to f32 (KEYDIFF_CUDA_QMATMUL_F32=1), the path step 4d times
# against. KeyDiff is left out here: bf16's rounding alone moves its choice on tiny-qwen-d64
# (CPU dry run in bf16, 2026-12-05: cosine 0.984-0.994 for most types, as for its quantized
# caches); under H2O and the full cache the CPU in bf16 gave >= 0.99976.
weights_ok=1
: > "$out/weights-bf16.jsonl"; : > "$out/weights-f32rows-bf16.jsonl"; : > "$out/weights-batch-bf16.jsonl"
for t in q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k; do
  presets=(--preset configs/tiny-qwen-d64.json)
  [[ $t != *_k ]] && presets+=(--preset configs/tiny-llama.json --preset configs/tiny-qwen3moe.json)
  runs=("--prompt-len 700 --chunk 64 --budget 256 --policies h2o")
  [[ $t =~ ^(q4_0|q8_0|q4_k|q6_k)$ ]] && runs+=("--prompt-len 96 --chunk 8")
  for r in "${runs[@]}"; do
    # shellcheck disable=SC2086
    if ! timeout 60 "$bin" check-device --device "$device" --dtype bf16 --weight-type "$t" \
        --attention eager $r "${presets[@]}" >> "$out/weights-bf16.jsonl" 2>> "$errors"; then
      weights_ok=0
      tail -3 "$errors"
    fi
  done
done
# The same through f32 rows (KEYDIFF_CUDA_QMATMUL_F32=1, the cast step 4d times against).
for t in q4_0 q4_k; do
  for r in "--prompt-len 700 --chunk 64 --budget 256 --policies h2o" "--prompt-len 96 --chunk 8"; do
    # shellcheck disable=SC2086
    if ! KEYDIFF_CUDA_QMATMUL_F32=1 timeout 60 "$bin" check-device --device "$device" --dtype bf16 \
        --weight-type "$t" --attention eager $r --preset configs/tiny-qwen-d64.json \
        >> "$out/weights-f32rows-bf16.jsonl" 2>> "$errors"; then
      weights_ok=0
      tail -3 "$errors"
    fi
  done
done
for a in "--weight-type q4_k --preset configs/tiny-qwen-d64.json" \
         "--weight-type q4_0 --preset configs/tiny-llama.json"; do
  # shellcheck disable=SC2086
  if ! timeout 60 "$bin" check-device --batch --device "$device" --dtype bf16 $a \
      --policies h2o,tova >> "$out/weights-batch-bf16.jsonl" 2>> "$errors"; then
    weights_ok=0
    tail -3 "$errors"
  fi
done
python3 - "$out" >> "$summary" <<'PY'
import json, sys
print("GGUF weight types (bf16 on the device, CPU f32 reference):")
print(f"  {'weights':7} {'preset':22} {'policy':8} {'chunk':>5} {'cosine':>9} {'max_rel':>9} top1")
for name, tag in (("weights-bf16.jsonl", ""), ("weights-f32rows-bf16.jsonl", " (rows cast to f32)")):
    try:
        rows = list(map(json.loads, open(sys.argv[1] + "/" + name)))
    except FileNotFoundError:
        rows = []
    for r in rows:
        d = r["diff"]
        print(f"  {r['weights']:7} {r['preset'].split('/')[-1]:22} {r['policy']:8} {r['chunk']:5} {d['cosine']:9.6f} {d['max_rel']:9.2e} {'same' if r['top1_equal'] else 'DIFF'}{tag}")
try:
    rows = list(map(json.loads, open(sys.argv[1] + "/weights-batch-bf16.jsonl")))
except FileNotFoundError:
    rows = []
for r in rows:
    top = sum(s["top1_equal"] for s in r["segments"])
    print(f"  batch {r['weights']:7} {r['preset'].split('/')[-1]:22} {r['policy']:8} {r['max_rel']:9.2e} top1 {top}/{len(r['segments'])} {'ok' if r['pass'] else 'FAIL'}")
PY
[ $weights_ok = 1 ] && note "weights parity: PASS" || note "weights parity: FAIL"

echo "== 3h. the decode path on the device (decode kernel, fused linears): decode steps against the CPU"
# --decode-steps runs the prompt's last tokens one at a time as generated tokens run: on a GPU
# keydiff's decode-attention kernel (float caches of the activations' dtype, where no
# probabilities are needed: full, sink, keydiff; flash too; h2o's statistics keep the eager
# path) and the fused q/k/v and gate/up matmuls, with decode-time eviction. Neither has run on
# hardware before. 1300 tokens under the full cache reach a split of each head's keys over 6
# blocks and the combine kernel. In f32 the device must match the CPU closely under KeyDiff
# too; in bf16 under the policies whose choice rounding cannot move. The residual add and
# RMSNorm kernel (keydiff_add_rms_norm_*) and the causal softmax run in every layer of both
# the prefill and the steps, and so do SwiGLU's product (keydiff_silu_mul_*), RoPE of the
# queries and keys (keydiff_rope_qk_*; tiny-qwen3 after its q/k norms) and the cache append
# (keydiff_append_rows); h2o's statistics come from the softmax with sums
# (keydiff_softmax_state_*, keydiff_softmax_sums_*), a step's too (chunks of one query). Then
# the same with all of them off (KEYDIFF_CUDA_DECODE_KERNEL=0 KEYDIFF_CUDA_FUSE=0
# KEYDIFF_CUDA_ADD_NORM=0 KEYDIFF_CUDA_SOFTMAX_KERNEL=0 KEYDIFF_CUDA_SOFTMAX_SUMS=0
# KEYDIFF_CUDA_SILU_MUL=0 KEYDIFF_CUDA_ROPE=0 KEYDIFF_CUDA_APPEND=0: candle's ops), for
# comparison. Quantized caches (q8_0, q4_0 and fp8, f32 activations, on the presets whose heads
# hold whole blocks of 32) run the decode kernel's form that reads blocks and fp8 rows in place
# (keydiff_decode_kvq_*; off, the eager path dequantizes the view) under the full cache, and
# the block types under KeyDiff too (the CPU reference holds blocks as they are, fp8 in f32:
# see the quantized caches of step 3).
decode_ok=1
: > "$out/decode-path.jsonl"
for on in 1 0; do
  for dt in f32 bf16 f32-q8_0 f32-q4_0 f32-fp8; do
    pol=sink,h2o; [ $dt = f32 ] && pol=keydiff,sink,h2o
    presets="--preset configs/tiny-llama.json --preset configs/tiny-qwen.json --preset configs/tiny-qwen-d64.json --preset configs/tiny-qwen3.json"
    runs=("--prompt-len 1300 --decode-steps 300" "--prompt-len 400 --decode-steps 200 --budget 96 --policies $pol")
    if [ "${dt#f32-}" != "$dt" ]; then
      presets="--preset configs/tiny-qwen-d64.json --preset configs/tiny-qwen3.json"
      runs=("--kv-dtype ${dt#f32-} --prompt-len 1300 --decode-steps 300")
      [ "$dt" = f32-fp8 ] ||
        runs+=("--kv-dtype ${dt#f32-} --prompt-len 1300 --decode-steps 300 --budget 1024 --policies keydiff")
    fi
    for r in "${runs[@]}"; do
      # shellcheck disable=SC2086
      if ! KEYDIFF_CUDA_DECODE_KERNEL=$on KEYDIFF_CUDA_FUSE=$on KEYDIFF_CUDA_ADD_NORM=$on \
          KEYDIFF_CUDA_SOFTMAX_KERNEL=$on KEYDIFF_CUDA_SOFTMAX_SUMS=$on KEYDIFF_CUDA_SILU_MUL=$on \
          KEYDIFF_CUDA_ROPE=$on KEYDIFF_CUDA_APPEND=$on timeout 90 "$bin" check-device \
          --device "$device" --dtype "${dt%%-*}" --attention eager --chunk 64 $r $presets \
          > "$out/decode-path.tmp"; then
        decode_ok=0
        tail -3 "$errors"
      fi
      sed "s/^{/{\"new_path\":$on,\"dtype\":\"$dt\",/" "$out/decode-path.tmp" >> "$out/decode-path.jsonl"
    done
  done
done 2>> "$errors"
rm -f "$out/decode-path.tmp"
python3 - "$out/decode-path.jsonl" >> "$summary" <<'PY'
import json, sys
print("decode path (decode steps after a chunked prefill, eager; CPU f32 reference):")
print(f"  {'path':5} {'dtype':10} {'preset':22} {'policy':8} {'steps':>5} {'cosine':>9} {'max_rel':>9} top1")
for r in map(json.loads, open(sys.argv[1])):
    d = r["diff"]
    dt = r['dtype'] if r.get('kv_dtype', r['dtype']) == r['dtype'] else f"{r['dtype']}/{r['kv_dtype']}"
    print(f"  {'new' if r['new_path'] else 'old':5} {dt:10} {r['preset'].split('/')[-1]:22} {r['policy']:8} {r['decode_steps']:5} {d['cosine']:9.6f} {d['max_rel']:9.2e} {'same' if r['top1_equal'] else 'DIFF'}")
PY
[ $decode_ok = 1 ] && note "decode path parity: PASS" || note "decode path parity: FAIL"

echo "== 3b. prefix reuse on the device: the same answers as fresh prefills (tiny random, bf16; an fp8 cache)"
# KeyDiff is left out: its anchor sums with float atomics on the GPU, so two fresh runs may
# already differ in the last bits; the other policies' ops are deterministic. The fp8 runs
# (heads of 64: the fp8 cache kernels take multiples of 32) copy the kept prefix's fp8 rows,
# which goes through the cache kernels on CUDA (candle cannot copy strided fp8 there).
for kvt in bf16 fp8; do
  m=tiny-qwen; [ $kvt = fp8 ] && m=tiny-qwen-d64
  for mode in reuse fresh; do
    extra=(); [ $mode = fresh ] && extra=(--no-prefix-reuse)
    timeout 90 "$bin" eval passkey -m $m --random-weights --device "$device" --dtype bf16 \
        --kv-dtype $kvt --lengths 1000 --budgets 100,50%,75% --samples 2 --chunk 64 \
        --policies full,tova,snapkv,h2o,sink --out "$out/prefix-$kvt-$mode" "${extra[@]}" \
        > /dev/null 2>> "$errors" || note "prefix ($kvt, $mode): FAILED (exit $?)"
  done
  python3 - "$out" "$kvt" >> "$summary" <<'PY' || note "prefix reuse ($kvt): could not compare"
import json, sys
def load(m):
    return {(r["id"], r["policy"], r["budget"]): r
            for r in map(json.loads, open(f"{sys.argv[1]}/prefix-{sys.argv[2]}-{m}/records.jsonl"))}
a, b = load("reuse"), load("fresh")
same = [k for k in b if k in a and a[k]["prediction"] == b[k]["prediction"]
        and a[k]["evictions"] == b[k]["evictions"]]
reused = sum(1 for r in a.values() if r.get("prefix_tokens", 0) > 0)
# A device that computes nothing answers every sample alike, and alike in both modes.
answers = len({r["prediction"] for r in b.values()})
ok = len(same) == len(b) == len(a) and reused > 0 and answers > 1
print(f"prefix reuse ({sys.argv[2]} cache): {'PASS' if ok else 'FAIL'} ({len(same)}/{len(b)} records identical, {reused} started from a prefix, {answers} different answers)")
PY
done

echo "== 3d. the memory plan on the device: planned weights against what the load took"
# The plan is made from shapes before any tensor exists; the driver's free memory before and
# after the load says what it took (keydiff info). A limit of half the plan must be refused
# before anything is allocated.
if timeout 90 "$bin" info --random-weights -m "$preset" --device "$device" --dtype bf16 \
    > "$out/memory-info.json" 2>> "$errors"; then
  python3 - "$out/memory-info.json" >> "$summary" <<'PY' || note "memory plan: could not read keydiff info"
import json, sys
info = json.load(open(sys.argv[1]))
g = info.get("gpu")
if g:
    print(f"gpu arch: {g['name']} is compute {g['compute_capability']}, the binary targets "
          f"{g['build_target'] or 'an unrecorded architecture'}; what runs: {g['runs'] or 'unknown'}")
m = info["memory"]
plan, taken = m["planned_weight_bytes"], m["device_taken_by_load"]
gib = lambda b: f"{b / 2**30:.3f} GiB"
if taken is None:
    print(f"memory plan: weights planned {gib(plan)}, held {gib(m['weight_bytes'])}; no driver figure on this device")
else:
    print(f"memory plan: weights planned {gib(plan)}, the load took {gib(taken)} of device memory "
          f"({taken / plan:.3f}x the plan); {m['available']}")
PY
else
  note "memory plan: keydiff info FAILED (exit $?)"
fi
half=$(python3 -c 'import json,sys;print(json.load(open(sys.argv[1]))["memory"]["planned_weight_bytes"]//2)' \
    "$out/memory-info.json" 2>/dev/null || echo 1073741824)
if timeout 60 "$bin" run --random-weights -m "$preset" --device "$device" --dtype bf16 \
    --memory-limit "$half" -p "hi" -n 1 > /dev/null 2> "$out/memory-refusal.txt"; then
  note "memory refusal: FAIL (loaded under --memory-limit $half, half its planned weights)"
elif grep -q "not enough memory" "$out/memory-refusal.txt"; then
  note "memory refusal: PASS ($(grep -o 'need [0-9.]* [GMK]iB' "$out/memory-refusal.txt" | head -1) > $half bytes)"
else
  note "memory refusal: FAIL (another error)"; tail -3 "$out/memory-refusal.txt" | tee -a "$errors"
fi

# An ordinal past the machine's devices is refused naming the devices there are (counted by
# the driver), not with a bare driver error.
if [ "${device#cuda}" != "$device" ]; then
  if timeout 30 "$bin" info --random-weights -m tiny-qwen --device cuda:4096 > /dev/null \
      2> "$out/device-refusal.txt"; then
    note "device refusal: FAIL (cuda:4096 opened)"
  elif grep -q "device \`cuda:4096\`: this machine has [0-9]* CUDA device" "$out/device-refusal.txt"; then
    note "device refusal: PASS ($(grep -o 'this machine has [^;]*' "$out/device-refusal.txt" | head -1))"
  else
    note "device refusal: FAIL (another error)"; tail -3 "$out/device-refusal.txt" | tee -a "$errors"
  fi
fi

echo "== 3e. a prompt cache saved from the device and loaded back onto it (run --prompt-cache)"
# The cache's slots go to the host for the file and back to the device: the second run must
# take the first prompt's tokens from the file and answer.
pc_prompt="The lighthouse keeper wrote in his log every evening, and the log grew long. "
pc_prompt="$pc_prompt$pc_prompt$pc_prompt$pc_prompt"
rm -f "$out/prompt-cache.kv"
pc_args=(--random-weights -m tiny-qwen --device "$device" --dtype bf16 --budget 64 --chunk 32 --json)
if timeout 60 "$bin" run "${pc_args[@]}" -p "$pc_prompt" -n 4 --prompt-cache "$out/prompt-cache.kv" \
      > "$out/prompt-cache-1.json" 2>> "$errors" \
   && timeout 60 "$bin" run "${pc_args[@]}" -p "${pc_prompt}What did he write?" -n 4 \
      --prompt-cache "$out/prompt-cache.kv" --prompt-cache-ro > "$out/prompt-cache-2.json" 2>> "$errors"; then
  python3 - "$out" >> "$summary" <<'PY' || note "prompt cache file: could not read the runs"
import json, os, sys
a, b = (json.load(open(f"{sys.argv[1]}/prompt-cache-{i}.json"))["stats"] for i in (1, 2))
ok = b["prefix_tokens"] == a["prompt_tokens"] > 0 and a["eviction"]["evictions"] > 0
size = os.path.getsize(f"{sys.argv[1]}/prompt-cache.kv")
print(f"prompt cache file: {'PASS' if ok else 'FAIL'} ({b['prefix_tokens']} of {b['prompt_tokens']} "
      f"prompt tokens from a {size}-byte file; the first run evicted {a['eviction']['evictions']} times)")
PY
else
  note "prompt cache file: FAILED (exit $?)"
fi

echo "== 3f. speculative decoding on the device (run --spec-type ngram, --spec-exact)"
# The verification pass appends, attends and evicts row by row on the device and takes back
# the rows not accepted: with --spec-exact the text must be token-by-token decoding's; without
# it, CUDA's several-row matmuls may round otherwise (recorded, not failed). TOVA, not KeyDiff,
# whose anchor sums with float atomics on the GPU (two plain runs may differ; see 3c).
sp_args=(--random-weights -m tiny-qwen --device "$device" --dtype bf16 --budget 64 --chunk 32
  --policy tova --json -p "$pc_prompt" -n 96)
if timeout 60 "$bin" run "${sp_args[@]}" > "$out/spec-plain.json" 2>> "$errors" \
   && timeout 60 "$bin" run "${sp_args[@]}" --spec-type ngram --spec-exact > "$out/spec-exact.json" 2>> "$errors" \
   && timeout 60 "$bin" run "${sp_args[@]}" --spec-type ngram > "$out/spec-fast.json" 2>> "$errors"; then
  python3 - "$out" >> "$summary" <<'PY' || note "speculative: could not read the runs"
import json, sys
a, b, c = (json.load(open(f"{sys.argv[1]}/spec-{m}.json")) for m in ("plain", "exact", "fast"))
sb, sc = b["stats"]["speculative"], c["stats"]["speculative"]
ok = a["text"] == b["text"] and sb["drafted"] > 0
print(f"speculative: {'PASS' if ok else 'FAIL'} (--spec-exact: same text {a['text'] == b['text']}, "
      f"{sb['accepted']}/{sb['drafted']} drafted tokens taken; without: same text "
      f"{a['text'] == c['text']}, {sc['accepted']}/{sc['drafted']}; decode tok/s plain "
      f"{a['stats']['decode_tok_s']:.0f}, exact {b['stats']['decode_tok_s']:.0f}, "
      f"fast {c['stats']['decode_tok_s']:.0f})")
PY
else
  note "speculative: FAILED (exit $?)"
fi

echo "== 4. TTFT sweep: $preset random weights, bf16, prompt $plen, budget $budget_n"
# One process: weights are initialised once; 1 warm-up and 2 measured runs per case,
# interleaved, then one profiled run per case for the breakdown (keydiff bench ttft).
left=$((deadline - SECONDS)); [ "$left" -lt 60 ] && left=60
if timeout "$left" "$bin" bench ttft --random-weights -m "$preset" --device "$device" --dtype bf16 \
    --attention "$ttft_attention" --prompt-len "$plen" --budget "$budget_n" --chunks 64,128,256 \
    --policies full,keydiff,tova,snapkv,h2o,sink --warmup 1 --reps 2 \
    --out "$out/ttft" > "$out/ttft/table.txt.tmp" 2>>"$errors"; then
  { echo "TTFT ($preset random weights, bf16, $ttft_attention attention, prompt $plen, budget $budget_n):"; cat "$out/ttft/table.txt.tmp"; } >> "$summary"
else
  note "ttft: FAILED or past the ${deadline}s budget (exit $?); see errors.log"
  cat "$out/ttft/table.txt.tmp" >> "$summary" 2>/dev/null
fi
rm -f "$out/ttft/table.txt.tmp"

echo "== 4f. eager prefill: keydiff's causal softmax and allocator settings against candle's ops and the driver's defaults ($preset, B = 128)"
# The first H200 run spent 5.8 s of a 6.6 s profiled 8B prefill in eager attention, ~10x its
# MLP: its scores went through four passes in f32 (cast, mask, softmax, cast back). Since then
# keydiff_causal_softmax_* does them in one launch (KEYDIFF_CUDA_SOFTMAX_KERNEL=0 turns it
# off), the device's memory pool keeps freed memory across synchronisations and cudarc's
# per-allocation events are off (KEYDIFF_CUDA_POOL_RETAIN=0 KEYDIFF_CUDA_EVENTS=1 restore the
# defaults). Where a policy needs statistics (h2o here), keydiff_softmax_state_* and
# keydiff_softmax_sums_* sum the probabilities as they write them in bf16, where the one-launch
# softmax wrote them in f32 for candle to sum and cast (KEYDIFF_CUDA_SOFTMAX_SUMS=0 goes back to
# that). Four processes, eager attention: all on; the sums kernels off; the softmax kernels
# off; the allocator as the driver leaves it.
left=$((deadline - SECONDS))
if [ "$left" -lt 110 ]; then
  note "eager prefill settings: skipped (${left}s left of the ${deadline}s budget)"
else
  mkdir -p "$out/eager"
  i=0
  for envs in "KEYDIFF_CUDA_SOFTMAX_KERNEL=1" "KEYDIFF_CUDA_SOFTMAX_SUMS=0" \
      "KEYDIFF_CUDA_SOFTMAX_KERNEL=0 KEYDIFF_CUDA_SOFTMAX_SUMS=0" \
      "KEYDIFF_CUDA_POOL_RETAIN=0 KEYDIFF_CUDA_EVENTS=1"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # the assignments, one word each
    if env $envs timeout 60 "$bin" bench ttft --random-weights -m "$preset" --device "$device" \
        --dtype bf16 --attention eager --prompt-len "$plen" --budget "$budget_n" --chunks 128 \
        --policies full,h2o --warmup 1 --reps 2 --out "$out/eager/$i" \
        > "$out/eager/table-$i.txt" 2>>"$errors"; then
      { echo "TTFT ($preset, bf16, eager, prompt $plen, budget $budget_n; $envs):"; cat "$out/eager/table-$i.txt"; } >> "$summary"
    else
      note "eager prefill ($envs): FAILED (exit $?); see errors.log"
    fi
  done
fi

echo "== 4b. batched decoding: 1 and 8 requests decoded together ($preset random weights, bf16)"
# Decode tok/s of the batch (bench decode --batch: the requests' decode steps, as serve
# --max-batch runs them; their prompts are prefilled first): on a GPU a step of 8 rows should
# cost little more than one.
left=$((deadline - SECONDS))
if [ "$left" -lt 60 ]; then
  note "batch: skipped (${left}s left of the ${deadline}s budget)"
else
  mkdir -p "$out/batch"
  if timeout 60 "$bin" bench decode --random-weights -m "$preset" --device "$device" --dtype bf16 \
      --attention "$ttft_attention" \
      --prompt-len 1024 --budget 512 --chunks 128 --policies keydiff --gen-len 32 --batch 1,8 \
      --warmup 1 --reps 1 --out "$out/batch" > "$out/batch/table.txt" 2>>"$errors"; then
    { echo "batched decode ($preset random weights, bf16, prompt 1024, N = 512):"; grep -v '^#' "$out/batch/table.txt"; } >> "$summary"
  else
    note "batch: FAILED (exit $?); see errors.log"
  fi
fi

echo "== 4e. decode launches: keydiff's decode kernel and fused linears against the eager parts ($preset random weights, bf16)"
# Decode was launch-bound in the first H200 run (8.6 ms a token for 3B, 1.5 ms of weight
# reads). Since then a decode step's attention is keydiff's kernel (one launch where the eager
# path takes six), q/k/v and gate/up are one matmul each (FusedLinear), each residual add and
# the next norm one launch (keydiff_add_rms_norm_*: two launches fewer a layer), SwiGLU's
# silu(gate) · up one launch (keydiff_silu_mul_*), RoPE of q and k one launch
# (keydiff_rope_qk_*), the cache append one launch where candle took seven operations, one a
# host upload (keydiff_append_rows), and the allocator keeps freed memory and makes no events.
# Step 4b's runs again with the kernel off (KEYDIFF_CUDA_DECODE_KERNEL=0), with the linears
# unfused (KEYDIFF_CUDA_FUSE=0), with the allocator as the driver leaves it
# (KEYDIFF_CUDA_POOL_RETAIN=0 KEYDIFF_CUDA_EVENTS=1) and with the small kernels off
# (KEYDIFF_CUDA_ADD_NORM=0 KEYDIFF_CUDA_SILU_MUL=0 KEYDIFF_CUDA_ROPE=0 KEYDIFF_CUDA_APPEND=0:
# 20 operations a layer and step against 10 with them), with greedy's token read from the
# whole row of logits on the host (KEYDIFF_CUDA_ARGMAX=0; on: keydiff_argmax_rows_f32 picks it
# on the device and 4 bytes come back), sampled tokens (temperature 0.8, top-p 0.95) drawn on
# the device (keydiff_sample_rows_f32) and on the host (KEYDIFF_CUDA_SAMPLE=0: the row read
# and sorted as far as the draw goes), then a long cache (prompt 7680, within
# SmolLM2's 8192 for dry runs; full cache: the kernel splits each of 3B's 8 heads' keys over 31
# blocks) with the kernel on and off, and the same in a q8_0 cache (the kernel reads its blocks
# in place, keydiff_decode_kvq_*; off, each step dequantizes the view to f32, then casts it).
left=$((deadline - SECONDS))
if [ "$left" -lt 90 ]; then
  note "decode launches: skipped (${left}s left of the ${deadline}s budget)"
else
  mkdir -p "$out/decode"
  short="--prompt-len 1024 --budget 512 --chunks 128 --policies keydiff --batch 1,8"
  long="--prompt-len 7680 --chunks 512 --policies full --batch 1"
  i=0
  # kernel, fuse, allocator (1: keydiff's settings, 0: the driver's and cudarc's defaults),
  # the small kernels (residual add + RMSNorm, SwiGLU product, RoPE, cache append), tokens
  # picked on the device (greedy's argmax, sampling's draw)
  sampled="$short --temp 0.8 --top-p 0.95 --sample-seed 1"
  for run in "0 1 1 1 1 $short" "1 0 1 1 1 $short" "1 1 0 1 1 $short" "1 1 1 0 1 $short" \
      "1 1 1 1 0 $short" "1 1 1 1 1 $sampled" "1 1 1 1 0 $sampled" "1 1 1 1 1 $long" \
      "0 1 1 1 1 $long" "1 1 1 1 1 $long --kv-dtype q8_0" \
      "0 1 1 1 1 $long --kv-dtype q8_0"; do
    read -r kernel fuse alloc norm argmax r <<< "$run"
    i=$((i + 1))
    events=$((1 - alloc))
    alloc_name="keydiff's"; [ "$alloc" = 1 ] || alloc_name="the driver's"
    # shellcheck disable=SC2086
    if KEYDIFF_CUDA_DECODE_KERNEL=$kernel KEYDIFF_CUDA_FUSE=$fuse KEYDIFF_CUDA_POOL_RETAIN=$alloc \
        KEYDIFF_CUDA_EVENTS=$events KEYDIFF_CUDA_ADD_NORM=$norm KEYDIFF_CUDA_SILU_MUL=$norm \
        KEYDIFF_CUDA_ROPE=$norm KEYDIFF_CUDA_APPEND=$norm KEYDIFF_CUDA_ARGMAX=$argmax \
        KEYDIFF_CUDA_SAMPLE=$argmax timeout 60 "$bin" bench decode \
        --random-weights -m "$preset" --device "$device" --dtype bf16 --attention "$ttft_attention" \
        $r --gen-len 32 --warmup 1 --reps 1 --out "$out/decode/$i" > "$out/decode/table-$i.txt" 2>>"$errors"; then
      { echo "decode ($preset, bf16, $r; decode kernel $([ $kernel = 1 ] && echo on || echo off), linears $([ $fuse = 1 ] && echo fused || echo unfused), allocator $alloc_name, add+norm, silu·mul, RoPE and append kernels $([ $norm = 1 ] && echo on || echo off), tokens picked on the $([ $argmax = 1 ] && echo device || echo host)):"; grep -v '^#' "$out/decode/table-$i.txt"; } >> "$summary"
    else
      note "decode launches (kernel $kernel, fuse $fuse, allocator $alloc, small kernels $norm, argmax $argmax, $r): FAILED (exit $?); see errors.log"
    fi
  done
fi

echo "== 4c. a prompt joining 4 decoding requests: alone vs in the batch's steps ($preset random weights, bf16)"
# bench join: the running requests' longest gap between tokens and the joiner's TTFT, when its
# prompt is prefilled alone (the others wait) and a chunk per step beside their decode rows (as
# serve --max-batch runs it). On a GPU a mixed step should cost about one chunk: the longest
# gap falls from the whole prefill to about a chunk, at little cost to the joiner's TTFT.
left=$((deadline - SECONDS))
if [ "$left" -lt 60 ]; then
  note "join: skipped (${left}s left of the ${deadline}s budget)"
else
  mkdir -p "$out/join"
  if timeout 60 "$bin" bench join --random-weights -m "$preset" --device "$device" --dtype bf16 \
      --attention "$ttft_attention" \
      --prompt-len "$plen" --budget "$budget_n" --chunks 128 --policies keydiff --running 4 \
      --warmup 1 --reps 1 --out "$out/join" > "$out/join/table.txt" 2>>"$errors"; then
    { echo "join ($preset random weights, bf16, prompt $plen, N = $budget_n, 4 running):"; grep -v '^#' "$out/join/table.txt"; } >> "$summary"
  else
    note "join: FAILED (exit $?); see errors.log"
  fi
fi

echo "== 4d. GGUF-typed decoding: Q4_K weights (qwen3-0.6b's shape), bf16 rows into candle's quantized matmuls, and through f32"
# keydiff hands bf16 rows to candle's quantized matmuls, which take them (see step 3g); with
# KEYDIFF_CUDA_QMATMUL_F32=1 every such matmul casts to f32 and back, as before: two more
# launches for each of a decode step's ~200 linears (launch-bound at these sizes).
# Loading draws 0.6 G random values on the device, copies them to the host and quantizes them
# there on every core, in each run.
left=$((deadline - SECONDS))
if [ "$left" -lt 120 ]; then
  note "gguf decode: skipped (${left}s left of the ${deadline}s budget; it takes up to 120 s)"
else
  mkdir -p "$out/qdecode"
  for f32 in 0 1; do
    if KEYDIFF_CUDA_QMATMUL_F32=$f32 timeout 60 "$bin" bench decode --random-weights -m qwen3-0.6b \
        --weight-type q4_k --device "$device" --dtype bf16 --attention "$ttft_attention" \
        --prompt-len 512 --budget 256 --chunks 128 --policies keydiff --gen-len 64 --batch 1,8 \
        --warmup 1 --reps 1 --out "$out/qdecode/f32-$f32" > "$out/qdecode/table-$f32.txt" 2>>"$errors"; then
      { echo "gguf decode (qwen3-0.6b Q4_K random weights, bf16 activations, rows to the matmuls $([ $f32 = 1 ] && echo 'cast to f32' || echo 'in bf16')):"; grep -v '^#' "$out/qdecode/table-$f32.txt"; } >> "$summary"
    else
      note "gguf decode (KEYDIFF_CUDA_QMATMUL_F32=$f32): FAILED (exit $?); see errors.log"
    fi
  done
fi

echo "== 5. eviction share at Llama-3.1-8B's shape: N = 8192, B = 128, prompt 12288"
# The issue's target: eviction <= 5% of the B = 128 chunk time (see the breakdown columns).
# keydiff evicts its 32 layers together (the default) and, as keydiff/per-layer, each layer
# after its own attention: the difference is what launching the eviction once per chunk saves.
left=$((deadline - SECONDS))
if [ "${SKIP_8B:-0}" = 1 ] || [ "$left" -lt 90 ]; then
  note "8b: skipped (${left}s left of the ${deadline}s budget)"
else
  mkdir -p "$out/ttft8b"
  if timeout "$left" "$bin" bench ttft --random-weights -m llama-3.1-8b --device "$device" \
      --dtype bf16 --attention "$ttft_attention" --prompt-len 12288 --budget 8192 --chunks 128 --policies full,keydiff \
      --eviction together,per-layer \
      --warmup 1 --reps 2 --out "$out/ttft8b" > "$out/ttft8b/table.txt" 2>>"$errors"; then
    { echo "TTFT (llama-3.1-8b random weights, bf16, $ttft_attention attention, prompt 12288, budget 8192):"; cat "$out/ttft8b/table.txt"; } >> "$summary"
  else
    note "8b: FAILED or past the budget (exit $?); see errors.log"
  fi
fi
echo "== 5b. eager attention against flash, interleaved in one run ($preset, B = 128)"
# Only when the binary has flash and its parity passed: what FlashAttention-2 saves in TTFT,
# and what the policies that need attention statistics (H2O all of them, TOVA the last row)
# pay for their extra pass under flash, each policy's /full against full under its backend.
left=$((deadline - SECONDS))
if [ $flash_ok = 0 ]; then
  note "eager vs flash: not run (no flash in this binary, or its parity failed)"
elif [ "$left" -lt 60 ]; then
  note "eager vs flash: skipped (${left}s left of the ${deadline}s budget)"
else
  mkdir -p "$out/ttft-attention"
  if timeout "$left" "$bin" bench ttft --random-weights -m "$preset" --device "$device" --dtype bf16 \
      --compare-attention eager,flash --prompt-len "$plen" --budget "$budget_n" --chunks 128 \
      --policies full,keydiff,tova,h2o --warmup 1 --reps 2 \
      --out "$out/ttft-attention" > "$out/ttft-attention/table.txt" 2>>"$errors"; then
    { echo "TTFT ($preset random weights, bf16, eager against flash, prompt $plen, budget $budget_n):"; cat "$out/ttft-attention/table.txt"; } >> "$summary"
  else
    note "eager vs flash: FAILED or past the budget (exit $?); see errors.log"
  fi
fi

echo "== 6. the kernels under compute-sanitizer: racecheck, synccheck, memcheck"
# What the CPU emulation (kernels/emu) cannot see: shared-memory races between barriers, barrier
# misuse on the hardware, out-of-bounds device accesses. Parity cases only (no timing, no n >
# 131072: the tools slow kernels down 10-100x). racecheck and synccheck instrument only our
# keydiff_* kernels (--kernel-name kns=keydiff_; snapkv_pool is left to memcheck), memcheck
# every kernel. Last, because the results above come first: each tool gets at most 60 s and
# only while the run is within 60 s past its budget. Not fatal when the tool is missing or slow.
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
      "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/nvcc)")/compute-sanitizer" 2>/dev/null | head -1)
if [ -z "$san" ] || [ "$device" = cpu ]; then
  note "sanitizer: not run (no compute-sanitizer here, or no GPU)"
else
  for tool in racecheck synccheck memcheck; do
    left=$((deadline + 60 - SECONDS)); [ "$left" -gt 60 ] && left=60
    if [ "$left" -lt 15 ]; then note "sanitizer $tool: skipped (out of time)"; continue; fi
    filter=(--kernel-name kns=keydiff_); [ "$tool" = memcheck ] && filter=()
    log=$out/sanitizer-$tool.log
    sanitize() {
      timeout "$left" "$san" --tool "$tool" "$@" --error-exitcode 9 --print-limit 20 \
          "$bin" check-kernels --device "$device" --time-n > "$log" 2>&1
    }
    sanitize "${filter[@]}"; rc=$?
    # A tool version without this filter syntax: once more, unfiltered.
    if [ ${#filter[@]} -gt 0 ] && ! [[ $rc =~ ^(0|9|124)$ ]] && grep -qi "kernel-name" "$log"; then
      filter=(); sanitize; rc=$?
    fi
    last=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
    scope=$([ ${#filter[@]} -gt 0 ] && echo "keydiff_* kernels" || echo "all kernels")
    case $rc in
      0) note "sanitizer $tool ($scope): PASS ($last)" ;;
      124) note "sanitizer $tool ($scope): timed out after ${left} s (not a failure)" ;;
      9) note "sanitizer $tool ($scope): FAIL ($last)"
         grep -m 10 -E "Error|Hazard|hazard|Invalid" "$log" | tee -a "$errors" ;;
      *) note "sanitizer $tool ($scope): exit $rc"; tail -5 "$log" | tee -a "$errors" ;;
    esac
  done
fi
echo
note "elapsed: ${SECONDS}s"
echo "==================== summary ===================="
cat "$summary"
