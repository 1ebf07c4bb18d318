#!/usr/bin/env bash
# Decode speed of two keydiff binaries, alternated run by run: greedy, temperature only, and
# top-p, on the two test models, 3 rounds, 64 tokens each. Prints: model, sampling, binary
# (old/new), round, decode tok/s, stop. Usage: scripts/bench-sampler.sh OLD_BINARY NEW_BINARY.
# Results: bench/results/2026-12-03-sampler.md.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?old binary}
new=${2:?new binary}
for m in models/SmolLM2-135M-Instruct.Q4_1.gguf models/qwen2.5-coder-0.5b-instruct.gguf; do
  for r in 1 2 3; do
    # Truncation off unless named (the command line's defaults are llama-cli's 40/0.95/0.05).
    for s in "greedy:" "temp:--temp 0.7 --top-k 0 --top-p 1 --min-p 0 --seed 1" \
      "top-p:--temp 0.7 --top-k 0 --top-p 0.9 --min-p 0 --seed 1"; do
      for b in old new; do
        bin=$old; [[ $b == new ]] && bin=$new
        # shellcheck disable=SC2086
        "$bin" run -m $m --chat -p "Write a JSON object that maps twenty animals to their usual colours." \
          -n 64 ${s#*:} --json 2>/dev/null | python3 -c "import json,sys; v=json.load(sys.stdin); s=v['stats']; print('$m', '${s%%:*}', '$b', $r, s['decode_tok_s'], s['stop_reason'])"
      done
    done
  done
done
