#!/usr/bin/env bash
# Decode speed of constrained generation against plain text: JSON mode, the JSON grammar of
# examples/grammars, and a JSON schema, on the two test models, 3 rounds, 64 tokens each.
# `--sample` samples with top-k 40 (the mask comes first every step) instead of greedy
# (sampled first, masked only on a miss). Prints: model, format, round, decode tok/s, stop.
# Results: bench/results/2026-12-03-grammar.md.
set -euo pipefail
cd "$(dirname "$0")/.."
sample=()
if [[ "${1:-}" == "--sample" ]]; then sample=(--temp 0.7 --top-k 40 --seed 1); fi
for m in models/SmolLM2-135M-Instruct.Q4_1.gguf models/qwen2.5-coder-0.5b-instruct.gguf; do
  for r in 1 2 3; do
    for f in text json grammar schema; do
      case $f in
        text) extra=();;
        json) extra=(--format json);;
        grammar) extra=(--grammar-file examples/grammars/json.gbnf);;
        schema) extra=(--json-schema-file examples/grammars/colours.schema.json);;
      esac
      target/release/keydiff run -m $m --chat \
        -p "Write a JSON object that maps twenty animals to their usual colours." \
        -n 64 "${sample[@]}" --json "${extra[@]}" 2>/dev/null | python3 -c "import json,sys; v=json.load(sys.stdin); s=v['stats']; print('$m', '$f', $r, s['decode_tok_s'], s['stop_reason'])"
    done
  done
done
