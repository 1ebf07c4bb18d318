#!/usr/bin/env python3
"""What continuous batching buys: C clients at once, each asking for M tokens (greedy,
`ignore_eos`) after its own short prompt, against two running `keydiff serve` of the same
model and cache settings, one with `--max-batch 1` (requests one at a time) and one with
`--max-batch K`. The rounds alternate between the two servers (never both at once), so that
drift on a noisy machine hits both alike.

Reports per server the median over rounds of the round's wall time, the aggregate decode
throughput (all generated tokens / wall time), the mean TTFT the clients waited for (time to
the first streamed token) and the engine's per-request decode tok/s; and the ratios measured
in this one run.

Usage: scripts/bench-batch.py --one http://127.0.0.1:8081 --batched http://127.0.0.1:8082
                              [--clients 4] [--tokens 64] [--rounds 3] [--json OUT]
Standard library only.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

TOPICS = ["the harbour", "the old mill", "the railway", "the library", "the orchard",
          "the bridge", "the market", "the lighthouse", "the school", "the river"]


def prompt(i: int) -> str:
    t = TOPICS[i % len(TOPICS)]
    return (f"Notes on {t}. The committee met on Tuesday to review the plans for {t}, "
            f"which had grown twice as fast as expected. Write a long report on {t}:")


def stream(url: str, body: dict, out: dict) -> None:
    """Streams one completion; records the time to the first token, the end and the
    final chunk's `keydiff` figures, or the error (raised again by the caller)."""
    try:
        _stream(url, body, out)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread
        out["error"] = e


def _stream(url: str, body: dict, out: dict) -> None:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]}")
    first = None
    for line in resp:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and chunk["choices"] and chunk["choices"][0].get("text"):
            first = time.perf_counter() - t0
        if "keydiff" in chunk:
            out["keydiff"] = chunk["keydiff"]
        if chunk.get("usage"):
            out["tokens"] = chunk["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError("the stream carried no text")
    out["ttft"] = first
    out["end"] = time.perf_counter() - t0


def round_(url: str, clients: int, tokens: int, r: int) -> dict:
    outs = [dict() for _ in range(clients)]
    threads = [threading.Thread(target=stream, args=(url, {
        "prompt": prompt(r * clients + i), "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
        outs[i])) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for o in outs:
        if "error" in o:
            raise SystemExit(f"{url}: {o['error']}")
    generated = sum(o["tokens"] for o in outs)
    assert generated == clients * tokens, generated
    return {"wall_s": wall, "tok_s": generated / wall,
            "ttft_s": statistics.mean(o["ttft"] for o in outs),
            "request_decode_tok_s": statistics.mean(o["keydiff"]["decode_tok_s"]
                                                    for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", required=True, help="URL of the server with --max-batch 1")
    ap.add_argument("--batched", required=True, help="URL of the server with --max-batch K")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = {"one": [], "batched": []}
    # Warm-up: one request each.
    for url in (a.one, a.batched):
        round_(url, 1, 4, 99)
    for r in range(a.rounds):
        order = [("one", a.one), ("batched", a.batched)]
        for kind, url in order if r % 2 == 0 else order[::-1]:
            rows[kind].append(round_(url, a.clients, a.tokens, r))
    keys = ("wall_s", "tok_s", "ttft_s", "request_decode_tok_s")
    med = {kind: {k: statistics.median(x[k] for x in rs) for k in keys}
           for kind, rs in rows.items()}
    print(f"{a.clients} clients x {a.tokens} tokens, {a.rounds} rounds (medians)")
    print(f"{'server':<9}{'wall s':>8}{'tok/s':>8}{'TTFT s':>8}{'req tok/s':>11}")
    for kind, m in med.items():
        print(f"{kind:<9}{m['wall_s']:>8.2f}{m['tok_s']:>8.1f}{m['ttft_s']:>8.2f}"
              f"{m['request_decode_tok_s']:>11.1f}")
    ratio = {k: med["batched"][k] / med["one"][k] for k in keys}
    print("ratio (batched / one): " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "median": med, "ratio": ratio, "args": vars(a)}, f,
                      indent=1)


if __name__ == "__main__":
    main()
