cd /work/main
out=bench/results/2026-12-02-serve-shared
for mode in exact off; do
  target/release/keydiff serve --port 8191 --max-batch 4 --prompt-cache $mode > /tmp/serve-$mode.log 2>&1 &
  pid=$!
  for i in $(seq 60); do curl -s localhost:8191/health > /dev/null && break; sleep 1; done
  echo "== prompt cache $mode"
  python3 scripts/bench-serve.py --url http://127.0.0.1:8191 --requests 8 --concurrency 4 \
      --prompt-words 700 --max-tokens 16 --json $out/$mode.json
  curl -s localhost:8191/health; echo
  kill $pid; wait $pid 2>/dev/null
done
