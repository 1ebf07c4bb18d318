#!/usr/bin/env bash
# keydiff against llama.cpp (llama-cpp-python) on the same GGUF files and the same prompt token
# ids, on the CPU, in one run. Prints prefill and decode tok/s of both and their ratios.
# Usage: scripts/bench-peers.sh [prompt_len=2048] [chunk=128] [decode=64]
# Run it on an idle machine: on 2 cores any other busy process distorts the numbers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
plen=${1:-2048}; chunk=${2:-128}; ndec=${3:-64}
scripts/fetch-models.sh >/dev/null
scripts/python-env.sh >/dev/null
cargo build --release -q -p keydiff-cli
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
results=$tmp/results.jsonl
for m in models/SmolLM2-135M-Instruct.Q4_1.gguf models/qwen2.5-coder-0.5b-instruct.gguf; do
  .venv/bin/python scripts/bench_llamacpp.py --model "$m" --prompt-len "$plen" --chunk "$chunk" \
    --decode "$ndec" --threads 2 --json --dump-tokens "$tmp/ids.json" | tail -1 > "$tmp/llama.json"
  target/release/keydiff run -m "$m" --prompt-tokens "$tmp/ids.json" -n $((ndec + 1)) \
    --ignore-eos --chunk "$chunk" --json > "$tmp/keydiff.json"
  python3 - "$m" "$tmp/llama.json" "$tmp/keydiff.json" >> "$results" <<'PY'
import json, sys
l = json.load(open(sys.argv[2])); k = json.load(open(sys.argv[3]))["stats"]
print(json.dumps({"model": sys.argv[1].split("/")[-1], "prompt_tokens": k["prompt_tokens"],
  "llama_prefill": l["prefill_tok_s"], "llama_decode": l["decode_tok_s"],
  "keydiff_prefill": k["prefill_tok_s"], "keydiff_decode": k["decode_tok_s"]}))
PY
done
echo "CPU, 2 threads, prompt $plen tokens, chunk $chunk, $ndec decode steps ($(date -u +%F), $(git rev-parse --short HEAD))"
python3 - "$results" <<'PY'
import json, sys
print(f"{'model':40} {'prefill tok/s (keydiff / llama.cpp = ratio)':46} decode tok/s (keydiff / llama.cpp = ratio)")
for line in open(sys.argv[1]):
    r = json.loads(line)
    p = f"{r['keydiff_prefill']:7.1f} / {r['llama_prefill']:7.1f} = {r['keydiff_prefill']/r['llama_prefill']:.2f}x"
    d = f"{r['keydiff_decode']:6.1f} / {r['llama_decode']:6.1f} = {r['keydiff_decode']/r['llama_decode']:.2f}x"
    print(f"{r['model']:40} {p:46} {d}")
PY
