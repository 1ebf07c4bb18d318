#!/usr/bin/env bash
# Prefill/decode tok/s and weight bytes under each CPU weight option, alternating A B C C B A.
set -euo pipefail
K=target/release/keydiff
for m in smollm2:models/SmolLM2-135M-Instruct.Q4_1.gguf:300M qwen:models/qwen2.5-coder-0.5b-instruct.gguf:1G; do
  IFS=: read -r name path lim <<< "$m"
  $K tokenize -m "$path" -p "$(cat /usr/share/common-licenses/GPL-3)" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)[:1024]))' > /tmp/fb-$name.json
  for opt in fast decode stored stored decode fast; do
    case $opt in fast) extra=();; decode) extra=(--memory-limit "$lim");; stored) extra=(--as-stored);; esac
    $K run -m "$path" --prompt-tokens /tmp/fb-$name.json -n 64 --ignore-eos --json "${extra[@]}" 2>/dev/null \
      | python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print('$name', '$opt', round(s['prefill_tok_s'],1), round(s['decode_tok_s'],1), s['prompt_tokens'])"
  done
done
