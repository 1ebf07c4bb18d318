#!/usr/bin/env bash
# A question on a long document, with and without a saved prompt cache (`run --prompt-cache`):
# the document's cache is saved once (under a budget, and with a full cache), then the
# question (document + question) runs from the file with --prompt-cache-ro, against the same
# run without the file. Alternated, 3 rounds. Prints: mode, round, wall seconds of the whole
# process (load included), TTFT, prompt tokens, tokens from the file, file bytes, and whether
# the text equals the run without a file.
# Usage: scripts/bench-prompt-cache.sh [MODEL] [WORDS] [BUDGET]
# Results: bench/results/2026-12-03-prompt-cache-file.md.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/qwen2.5-coder-0.5b-instruct.gguf}
words=${2:-3000}
budget=${3:-1024}
bin=target/release/keydiff
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -c "import sys; sys.path.insert(0, 'scripts'); from filler import filler_text; print(filler_text($words, 7))" > "$tmp/doc.txt"
{ cat "$tmp/doc.txt"; printf '\nQuestion: which word came first in the text above? Answer:'; } > "$tmp/question.txt"
common=(-m "$model" --chunk 128 --json)
for cache in "budget:--budget $budget" "full:"; do
  name=${cache%%:*}
  # shellcheck disable=SC2206
  flags=(${cache#*:})
  file="$tmp/$name.kv"
  "$bin" run "${common[@]}" "${flags[@]}" -f "$tmp/doc.txt" -n 1 --prompt-cache "$file" > /dev/null 2>&1
  bytes=$(stat -c %s "$file")
  for r in 1 2 3; do
    for mode in without with; do
      extra=()
      [[ $mode == with ]] && extra=(--prompt-cache "$file" --prompt-cache-ro)
      start=$(date +%s.%N)
      "$bin" run "${common[@]}" "${flags[@]}" -f "$tmp/question.txt" -n 16 "${extra[@]}" > "$tmp/$mode.json" 2>/dev/null
      end=$(date +%s.%N)
      python3 - "$tmp" "$name" "$mode" "$r" "$start" "$end" "$bytes" <<'PY'
import json, sys
tmp, name, mode, r, start, end, size = sys.argv[1:]
v = json.load(open(f"{tmp}/{mode}.json"))
s = v["stats"]
same = ""
if mode == "with":
    same = v["text"] == json.load(open(f"{tmp}/without.json"))["text"]
print(name, mode, r, f"{float(end) - float(start):.2f}", f"{s['ttft_s']:.3f}", s["prompt_tokens"],
      s["prefix_tokens"], size if mode == "with" else "", same)
PY
    done
  done
done
