#!/bin/bash
# Two conversations at once against three servers; prints each table.
set -u
cd "$(git rev-parse --show-toplevel)"
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
run() {
  local port=$1; shift
  target/release/keydiff serve -m $M --port $port "$@" > /tmp/serve-$port.log 2>&1 &
  local pid=$!
  for i in $(seq 120); do curl -s http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  echo "## serve $*"
  python3 scripts/bench-serve.py --url http://127.0.0.1:$port --follow-up --requests 2 --concurrency 2 --prompt-words 800 --max-tokens 16 --json /tmp/kept-$port.json
  kill $pid; wait $pid 2>/dev/null
}
run 8191 --max-batch 2
run 8192 --max-batch 2 --prompt-cache off
run 8193 --max-batch 1
run 8194 --max-batch 2
run 8195 --max-batch 2 --prompt-cache off
run 8196 --max-batch 1
