#!/usr/bin/env bash
# KV cache types side by side on the CPU (bench/results/2026-12-04-kv-cache-types.md): for each
# of f32, f16, q8_0, q5_1, q5_0, q4_1, q4_0, fp8, f16 keys beside q8_0 values and q8_0 keys
# beside q4_0 values (TYPES="f16 k=f16,v=q8_0" picks; a `:plain` suffix adds --no-kv-rotation,
# quantized caches being Hadamard-rotated by default), the
# mean NLL of 1024 tokens of the GPL v3 (full cache, and under KeyDiff at --budget 512), then
# a 16 KB prompt under --budget 2048 with 64 greedy tokens: peak KV bytes, prefill and decode
# speed. Usage: scripts/bench-kv-types.sh [MODEL]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL=${1:-models/qwen2.5-coder-0.5b-instruct.gguf}
BIN=target/release/keydiff
TEXT=/usr/share/common-licenses/GPL-3
PROMPT=$(mktemp)
trap 'rm -f "$PROMPT"' EXIT
head -c 16000 "$TEXT" > "$PROMPT"
echo "model $MODEL, commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ), $(nproc) cores"
for kv in ${TYPES:-f32 f16 q8_0 q5_1 q5_0 q4_1 q4_0 fp8 k=f16,v=q8_0 k=q8_0,v=q4_0}; do
  label=$kv
  plain=(); [[ $kv == *:plain ]] && { plain=(--no-kv-rotation); kv=${kv%:plain}; }
  if [[ $kv == k=*,v=* ]]; then
    k=${kv#k=}; k=${k%%,*}; flags=(--cache-type-k "$k" --cache-type-v "${kv#*,v=}" "${plain[@]}")
  else
    flags=(--kv-dtype "$kv" "${plain[@]}")
  fi
  full=$($BIN perplexity -m "$MODEL" -f "$TEXT" --max-tokens 1024 "${flags[@]}" --json 2>/dev/null \
    | python3 -c 'import json,sys; print("%.5f" % json.load(sys.stdin)["mean_nll"])')
  kd=$($BIN perplexity -m "$MODEL" -f "$TEXT" --max-tokens 1024 "${flags[@]}" --budget 512 \
    --policy keydiff --json 2>/dev/null \
    | python3 -c 'import json,sys; print("%.5f" % json.load(sys.stdin)["mean_nll"])')
  line=$($BIN run -m "$MODEL" -f "$PROMPT" -n 64 "${flags[@]}" --budget 2048 2>&1 >/dev/null | tail -1)
  echo "$label | NLL full $full | NLL keydiff@512 $kd | $line"
done
