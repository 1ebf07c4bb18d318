#!/usr/bin/env bash
# Perplexity of one text under each policy × budget (and the full cache), one JSON line per
# run in OUT/results.jsonl and a markdown table on stdout.
# Usage: scripts/ppl-sweep.sh MODEL TEXT_FILE MAX_TOKENS BUDGETS POLICIES OUT [extra keydiff args]
#   e.g. scripts/ppl-sweep.sh models/qwen2.5-coder-0.5b-instruct.gguf \
#          /usr/share/common-licenses/GPL-3 4096 512,1024 keydiff,tova,snapkv,h2o,sink bench/out/ppl
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -ge 6 ] || { sed -n 2,7p "$0" >&2; exit 2; }
model=$1 text=$2 max=$3 budgets=$4 policies=$5 out=$6
shift 6
bin=target/release/keydiff
[ -x "$bin" ] || cargo build --release -p keydiff-cli
mkdir -p "$out"
: > "$out/results.jsonl"
run() { "$bin" perplexity -m "$model" -f "$text" --max-tokens "$max" --json "$@" | tee -a "$out/results.jsonl" >/dev/null; }
run "$@"
IFS=, read -ra bs <<< "$budgets"
IFS=, read -ra ps <<< "$policies"
for b in "${bs[@]}"; do
  for p in "${ps[@]}"; do
    run --budget "$b" --policy "$p" "$@"
  done
done
python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
full = next(r for r in rows if r["policy"] == "full")
print(f"| policy | budget | ppl | mean NLL ± se | ppl by quarter | vs full | s |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    q = " / ".join(f"{x:.2f}" for x in r["ppl_by_quarter"])
    print(f"| {r['policy']} | {r['budget'] or '-'} | {r['ppl']:.3f} | {r['mean_nll']:.4f} ± {r['nll_stderr']:.4f} "
          f"| {q} | {r['ppl'] / full['ppl']:.3f}× | {r['seconds']:.1f} |")
PY
