#!/usr/bin/env python3
"""Decode speed and TTFT of tool calls through `keydiff serve`, by `tool_choice`.

Starts `target/release/keydiff serve` on a model (default Qwen2.5-Coder-0.5B), then asks the
same question with one tool (`get_weather`) `--rounds` times under each mode, alternating the
modes within a round so that the machine's drift falls on all of them alike:
  none      the tools are rendered, the reply is free text (here the model writes the call
            as text: the same tokens as a call, unconstrained);
  auto      free text until a call starts, then the calls' grammar (lazy grammar);
  required  the calls' grammar from the first token.
`--sample` samples (temperature 0.7, top-k 40: the grammar's mask comes first every step)
instead of greedy (sampled first, masked only on a miss). Prints one line per request and
the median decode tok/s and TTFT per mode.

Usage: scripts/bench-tools.py [--model PATH] [--rounds N] [--sample] [--port P]
"""
import argparse, json, statistics, subprocess, sys, time, urllib.request

p = argparse.ArgumentParser()
p.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct.gguf")
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--sample", action="store_true")
p.add_argument("--port", type=int, default=8097)
a = p.parse_args()

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
url = f"http://127.0.0.1:{a.port}"
server = subprocess.Popen(["target/release/keydiff", "serve", "-m", a.model, "--port", str(a.port),
                           "--prompt-cache", "off"], stderr=subprocess.DEVNULL)
try:
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/health")
            break
        except OSError:
            time.sleep(0.2)
    rows = {m: [] for m in ["none", "auto", "required"]}
    for r in range(a.rounds):
        for mode in rows:
            body = {"messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
                    "tools": [TOOL], "tool_choice": mode, "max_tokens": 64, "seed": r,
                    "temperature": 0.7 if a.sample else 0}
            if a.sample:
                body["top_k"] = 40
            req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            v = json.load(urllib.request.urlopen(req))
            s, c = v["keydiff"], v["choices"][0]
            calls = len(c["message"].get("tool_calls") or [])
            rows[mode].append((s["decode_tok_s"], s["ttft_s"]))
            print(mode, r, f"{s['decode_tok_s']:.1f} tok/s", f"ttft {s['ttft_s']:.3f} s",
                  s["generated_tokens"], "tokens", c["finish_reason"], f"{calls} call(s)", flush=True)
    print("median:")
    for mode, xs in rows.items():
        print(f"  {mode:9s} decode {statistics.median(x[0] for x in xs):.1f} tok/s,"
              f" ttft {statistics.median(x[1] for x in xs):.3f} s")
finally:
    server.terminate()
    server.wait()
