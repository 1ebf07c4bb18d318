#!/usr/bin/env bash
# Decode speed of KV cache types, alternating rounds so that drift hits each alike
# (bench/results/2026-12-04-kv-cache-types.md): a 16 KB prompt of the GPL v3 under
# --budget 2048, 64 greedy tokens, ROUNDS rounds (default 3) of each of TYPES (default f32,
# f16, q8_0, q4_0 and f16 keys beside q8_0 values; `k=A,v=B` for a split; a `:plain` suffix
# adds --no-kv-rotation).
# Usage: [TYPES="f32 q4_0"] scripts/bench-kv-decode.sh [MODEL]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL=${1:-models/qwen2.5-coder-0.5b-instruct.gguf}
PROMPT=$(mktemp)
trap 'rm -f "$PROMPT"' EXIT
head -c 16000 /usr/share/common-licenses/GPL-3 > "$PROMPT"
echo "model $MODEL, commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ), $(nproc) cores"
for r in $(seq "${ROUNDS:-3}"); do
  for kv in ${TYPES:-f32 f16 q8_0 q4_0 q4_0:plain k=f16,v=q8_0}; do
    plain=(); [[ $kv == *:plain ]] && { plain=(--no-kv-rotation); kv=${kv%:plain}; }
    if [[ $kv == k=*,v=* ]]; then
      k=${kv#k=}; k=${k%%,*}; flags=(--cache-type-k "$k" --cache-type-v "${kv#*,v=}" "${plain[@]}")
    else
      flags=(--kv-dtype "$kv" "${plain[@]}")
    fi
    line=$(target/release/keydiff run -m "$MODEL" -f "$PROMPT" -n 64 "${flags[@]}" --budget 2048 2>&1 >/dev/null | tail -1)
    echo "round $r | ${flags[*]} | $(grep -o 'decode [0-9.]* tok/s' <<< "$line")"
  done
done
