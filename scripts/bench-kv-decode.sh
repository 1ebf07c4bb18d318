#!/usr/bin/env bash
# Decode speed of KV cache types, alternating rounds so that drift hits each alike
# (bench/results/2026-12-04-kv-cache-types.md): a 16 KB prompt of the GPL v3 under
# --budget 2048, 64 greedy tokens, ROUNDS rounds (default 3) of f32, f16, q8_0 and f16 keys
# beside q8_0 values. Usage: scripts/bench-kv-decode.sh [MODEL]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL=${1:-models/qwen2.5-coder-0.5b-instruct.gguf}
PROMPT=$(mktemp)
trap 'rm -f "$PROMPT"' EXIT
head -c 16000 /usr/share/common-licenses/GPL-3 > "$PROMPT"
echo "model $MODEL, commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ), $(nproc) cores"
for r in $(seq "${ROUNDS:-3}"); do
  for flags in "--kv-dtype f32" "--kv-dtype f16" "--kv-dtype q8_0" "--cache-type-k f16 --cache-type-v q8_0"; do
    # shellcheck disable=SC2086
    line=$(target/release/keydiff run -m "$MODEL" -f "$PROMPT" -n 64 $flags --budget 2048 2>&1 >/dev/null | tail -1)
    echo "round $r | $flags | $(grep -o 'decode [0-9.]* tok/s' <<< "$line")"
  done
done
