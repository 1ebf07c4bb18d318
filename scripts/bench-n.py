#!/usr/bin/env python3
"""What `n` > 1 buys: N completions of one long prompt as one request (`"n": N`, the prompt
prefilled once, the completions decoded together), against N requests of one completion each
sent one after another (each prefills the prompt; seeds seed + i, so that completion i of the
first is request i of the second). Rounds alternate between the two, so that drift on a noisy
machine hits both alike.

Reports the median wall time of each over the rounds and their ratio, measured in this run,
and checks that the two give the same texts (they must: completion i is the request alone
with seed + i).

Usage: scripts/bench-n.py --url http://127.0.0.1:8080 [--n 4] [--tokens 32]
                          [--sentences 120] [--rounds 3] [--json OUT]
Run the server with the prompt cache off (`--prompt-cache off`), or later requests of the
second kind reuse the first's prefill where nothing evicted. Standard library only.
"""
import argparse
import http.client
import json
import statistics
import time
import urllib.parse


def post(url: str, body: dict) -> dict:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]}")
    return json.loads(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sentences", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    doc = ("The committee met on Tuesday to review the plans for the harbour, which had "
           "grown twice as fast as expected. ") * a.sentences
    prompt = doc + "\nA new story. Once upon a time"
    base = {"prompt": prompt, "max_tokens": a.tokens, "temperature": 0.9, "ignore_eos": True}
    together, apart = [], []
    prompt_tokens = None
    for r in range(a.rounds):
        seed = a.seed + 1000 * r
        t0 = time.perf_counter()
        one = post(a.url, {**base, "n": a.n, "seed": seed})
        together.append(time.perf_counter() - t0)
        prompt_tokens = one["usage"]["prompt_tokens"]
        t0 = time.perf_counter()
        texts = [post(a.url, {**base, "seed": seed + i})["choices"][0]["text"]
                 for i in range(a.n)]
        apart.append(time.perf_counter() - t0)
        got = [c["text"] for c in sorted(one["choices"], key=lambda c: c["index"])]
        if got != texts:
            raise SystemExit(f"round {r}: n = {a.n} and {a.n} requests gave other texts")
        print(f"round {r}: n = {a.n} in {together[-1]:.2f} s, "
              f"{a.n} requests in {apart[-1]:.2f} s", flush=True)
    t, s = statistics.median(together), statistics.median(apart)
    print(f"\nprompt {prompt_tokens} tokens, {a.n} completions of {a.tokens} tokens, "
          f"median of {a.rounds} rounds:")
    print(f"| way | wall s |\n|---|---:|\n| one request, n = {a.n} | {t:.2f} |\n"
          f"| {a.n} requests, n = 1, one after another | {s:.2f} |")
    print(f"ratio: {s / t:.2f}x (same texts in every round)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "tokens": a.tokens, "prompt_tokens": prompt_tokens,
                       "together_s": together, "apart_s": apart}, f, indent=1)


if __name__ == "__main__":
    main()
