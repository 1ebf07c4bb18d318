#!/usr/bin/env python3
"""What prompt logprobs cost: `/v1/completions` with `max_tokens: 1` on the same prompt,
plain and with `echo` + `logprobs: K` (lm-evaluation-harness's log-likelihood request), in
alternation, against a running `keydiff serve` (start it with `--prompt-cache off`).

Prompt logprobs put every prompt row through the LM head (chunk x vocab logits per chunk
instead of one row) and take a log-softmax per row on the host. Reports, per kind, the
median client time and the engine's prefill seconds and TTFT (its `keydiff` object), and the
ratios of the medians measured in this one run.

Usage: scripts/bench-logprobs.py --url http://127.0.0.1:8080 [--prompt-words 1500]
                                 [--pairs 4] [--top 1] [--json OUT]
Standard library only.
"""
import argparse
import http.client
import json
import statistics
import time
import urllib.parse

FILLER = (
    "The committee met on a grey morning to review the quarterly figures, the maintenance "
    "schedule for the northern line, and a proposal to move the archive to the new building. "
)


def document(words: int, i: int) -> str:
    base = FILLER.split()
    return f"Document {i}. " + " ".join(base[k % len(base)] for k in range(words))


def post(url: str, body: dict) -> tuple[float, dict]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    wall = time.perf_counter() - t0
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {data}")
    return wall, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--prompt-words", type=int, default=1500)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--top", type=int, default=1, help="logprobs alternatives (0-20)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = {"plain": [], "echo+logprobs": []}
    for i in range(a.pairs):
        doc = document(a.prompt_words, i)
        plain = {"prompt": doc, "max_tokens": 1, "temperature": 0}
        scored = dict(plain, echo=True, logprobs=a.top)
        # Alternate which goes first, so drift on a noisy machine hits both kinds alike.
        order = [("plain", plain), ("echo+logprobs", scored)]
        for kind, body in order if i % 2 == 0 else order[::-1]:
            wall, data = post(a.url, body)
            k = data["keydiff"]
            lp = data["choices"][0]["logprobs"]
            if kind == "echo+logprobs":
                n = len(lp["token_logprobs"])
                assert n == k["prompt_tokens"] + 1, (n, k["prompt_tokens"])
            rows[kind].append({"wall_s": wall, "prefill_s": k["prefill_s"],
                               "ttft_s": k["ttft_s"], "prompt_tokens": k["prompt_tokens"],
                               "evictions": k["eviction"]["evictions"]})
    med = {kind: {key: statistics.median(r[key] for r in rs)
                  for key in ("wall_s", "prefill_s", "ttft_s")} for kind, rs in rows.items()}
    p = rows["plain"][0]
    print(f"prompt {p['prompt_tokens']} tokens, {a.pairs} pairs, evictions per request "
          f"{p['evictions']}, logprobs alternatives {a.top}")
    print(f"{'kind':<15}{'client s':>10}{'prefill s':>11}{'TTFT s':>9}")
    for kind, m in med.items():
        print(f"{kind:<15}{m['wall_s']:>10.3f}{m['prefill_s']:>11.3f}{m['ttft_s']:>9.3f}")
    ratio = {key: med["echo+logprobs"][key] / med["plain"][key]
             for key in ("wall_s", "prefill_s", "ttft_s")}
    print("ratio (echo+logprobs / plain): " +
          ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "median": med, "ratio": ratio, "args": vars(a)}, f,
                      indent=1)


if __name__ == "__main__":
    main()
