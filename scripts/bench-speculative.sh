#!/usr/bin/env bash
# Speculative decoding by n-gram lookup (`--spec-type ngram`, and with `--spec-exact`) against
# token-by-token decoding, greedy, on three chat tasks: `doc` quotes a document (the first 900 words of the GPL-3 text,
# under --budget 512, so the prompt evicts), `code` rewrites a function it is given (textwrap's
# `dedent` from Python's standard library), `free` writes a story (nothing to copy).
# Alternated, 3 rounds. Prints: task, mode, round, generated tokens, decode tok/s, drafted and
# accepted tokens, and whether the text equals the token-by-token run's.
# Usage: scripts/bench-speculative.sh [MODEL] [MAX_TOKENS] [EXTRA FLAGS...]
# Results: bench/results/2026-12-04-speculative-ngram.md.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/qwen2.5-coder-0.5b-instruct.gguf}
n=${2:-200}
shift $(( $# < 2 ? $# : 2 ))
bin=target/release/keydiff
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp" <<'PY'
import inspect, sys, textwrap
tmp = sys.argv[1]
words = open("/usr/share/common-licenses/GPL-3").read().split()[:900]
with open(f"{tmp}/doc.txt", "w") as f:
    f.write(" ".join(words) + "\n\nQuote the first two sentences of the Preamble exactly.")
with open(f"{tmp}/code.txt", "w") as f:
    f.write(inspect.getsource(textwrap.dedent)
            + "\nRewrite this function with type hints and return the whole function.")
with open(f"{tmp}/free.txt", "w") as f:
    f.write("Write a short story about a lighthouse keeper who finds a message in a bottle.")
PY
for task in doc code free; do
  flags=()
  [[ $task == doc ]] && flags=(--budget 512)
  for r in 1 2 3; do
    for mode in plain ngram exact; do
      extra=()
      [[ $mode == ngram ]] && extra=(--spec-type ngram)
      [[ $mode == exact ]] && extra=(--spec-type ngram --spec-exact)
      "$bin" run -m "$model" --chat -f "$tmp/$task.txt" -n "$n" --json "${flags[@]}" \
        "${extra[@]}" "$@" > "$tmp/$mode.json" 2>/dev/null
      python3 - "$tmp" "$task" "$mode" "$r" <<'PY'
import json, sys
tmp, task, mode, r = sys.argv[1:]
v = json.load(open(f"{tmp}/{mode}.json"))
s = v["stats"]
c = s.get("speculative") or {"drafted": "", "accepted": ""}
same = ""
if mode != "plain":
    same = v["text"] == json.load(open(f"{tmp}/plain.json"))["text"]
print(task, mode, r, s["generated_tokens"], f"{s['decode_tok_s']:.1f}", c["drafted"],
      c["accepted"], same, flush=True)
PY
    done
  done
done
