#!/usr/bin/env python3
"""Client-side latency of `keydiff serve`: what an OpenAI client sees against what the engine
measured for the same request (the `keydiff` object of the stream's last chunk).

Streams chat completions and records, per request:
  - client TTFT: from sending the request to the first content piece;
  - engine TTFT: the engine's `ttft_s` (tokenize + prefill + first sample);
  - queue + HTTP: client TTFT - engine TTFT (parsing, queueing, SSE delivery);
  - client decode tok/s: (completion tokens - 1) / (last piece - first piece), against the
    engine's decode tok/s.

--concurrency C sends C requests at once (they queue: the server runs one at a time), so the
TTFT of the k-th includes the k-1 before it.

--follow-up: each request is a two-turn conversation on its own document (the document
starts with the request's number, so nothing is shared between requests): the first turn asks
a question, the second sends the whole conversation again with a new question, as an OpenAI
chat client does. Reported per turn, with the prompt tokens the server reused from its prompt
cache (usage.prompt_tokens_details.cached_tokens). With --concurrency C, C conversations run
at once (their turns interleave at the server).

Usage: scripts/bench-serve.py --url http://127.0.0.1:8080 [--prompt-words 1500]
                              [--max-tokens 64] [--requests 5] [--concurrency 1] [--json OUT]
Standard library only.
"""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

FILLER = (
    "The committee met on a grey morning to review the quarterly figures, the maintenance "
    "schedule for the northern line, and a proposal to move the archive to the new building. "
)


def filler(words: int) -> str:
    base = FILLER.split()
    return " ".join(base[k % len(base)] for k in range(words))


def prompt(words: int, i: int) -> str:
    # A distinct question per request, so no cache of any kind could answer it.
    return f"{filler(words)}\n\nRequest {i}: summarise the text above in one sentence."


def document(words: int, i: int) -> str:
    return f"Document {i}. {filler(words)}"


def one(url: str, body: dict) -> dict:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    data = json.dumps(body)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=data,
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read().decode()}")
    first = last = None
    pieces = 0
    text = []
    stats = usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            break
        ev = json.loads(payload)
        if "error" in ev:
            raise SystemExit(f"stream error: {ev['error']}")
        if ev.get("usage"):
            usage = ev["usage"]
        if "keydiff" in ev:
            stats = ev["keydiff"]
        for ch in ev.get("choices", []):
            if ch.get("delta", {}).get("content"):
                text.append(ch["delta"]["content"])
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                pieces += 1
    conn.close()
    n = usage["completion_tokens"]
    span = (last - first) if (first is not None and last is not None) else 0.0
    return {
        "client_ttft_s": (first - t0) if first is not None else None,
        "engine_ttft_s": stats["ttft_s"],
        "overhead_s": (first - t0 - stats["ttft_s"]) if first is not None else None,
        "client_decode_tok_s": (n - 1) / span if span > 0 and n > 1 else None,
        "engine_decode_tok_s": stats["decode_tok_s"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": n,
        "pieces": pieces,
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "text": "".join(text),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--prompt-words", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--follow-up", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.follow_up:
        return follow_up(a)

    def body(i: int) -> dict:
        return {
            "messages": [{"role": "user", "content": prompt(a.prompt_words, i)}],
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    one(a.url, body(-1))  # warm-up
    rows = []
    lock = threading.Lock()
    i = 0
    while i < a.requests:
        batch = list(range(i, min(i + a.concurrency, a.requests)))
        threads = []
        for k in batch:
            def run(k=k):
                r = one(a.url, body(k))
                with lock:
                    rows.append(r)
            t = threading.Thread(target=run)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        i += len(batch)

    def col(key):
        return [r[key] for r in rows if r[key] is not None]

    def fmt(xs, scale=1.0, digits=1):
        if not xs:
            return "-"
        xs = sorted(x * scale for x in xs)
        return f"{statistics.median(xs):.{digits}f} ({xs[0]:.{digits}f}–{xs[-1]:.{digits}f})"

    print(f"{len(rows)} requests, concurrency {a.concurrency}, "
          f"prompt {rows[0]['prompt_tokens']} tokens, {a.max_tokens} generated; "
          "median (min–max)")
    print("| client TTFT ms | engine TTFT ms | queue + HTTP ms | client decode tok/s | "
          "engine decode tok/s |")
    print("|---|---|---|---|---|")
    print(f"| {fmt(col('client_ttft_s'), 1e3)} | {fmt(col('engine_ttft_s'), 1e3)} | "
          f"{fmt(col('overhead_s'), 1e3, 2)} | {fmt(col('client_decode_tok_s'))} | "
          f"{fmt(col('engine_decode_tok_s'))} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


def follow_up(a) -> None:
    def body(messages):
        return {"messages": messages, "max_tokens": a.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def conversation(i):
        doc = document(a.prompt_words, i)
        m = [{"role": "user", "content": f"{doc}\n\nWhat is this document about?"}]
        r1 = one(a.url, body(m))
        m += [{"role": "assistant", "content": r1["text"]},
              {"role": "user", "content": "Name one item on the committee's agenda."}]
        r2 = one(a.url, body(m))
        return r1, r2

    conversation(-1)  # warm-up
    rows = []
    lock = threading.Lock()
    for start in range(0, a.requests, a.concurrency):
        threads = []
        for i in range(start, min(start + a.concurrency, a.requests)):
            def run(i=i):
                r = conversation(i)
                with lock:
                    rows.append((i, r))
            t = threading.Thread(target=run)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    rows = [r for _, r in sorted(rows, key=lambda x: x[0])]
    print(f"{a.requests} two-turn conversations ({a.concurrency} at once), document "
          f"{a.prompt_words} words, {a.max_tokens} generated per turn; each row: turn 1 | turn 2")
    print("| turn | prompt tokens | cached tokens | client TTFT ms | engine TTFT ms |")
    print("|---|---|---|---|---|")
    for r1, r2 in rows:
        for t, r in (("1", r1), ("2", r2)):
            print(f"| {t} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                  f"{r['client_ttft_s'] * 1e3:.1f} | {r['engine_ttft_s'] * 1e3:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
