#!/usr/bin/env python3
"""llama.cpp CPU baseline: prefill and decode tok/s on a GGUF model (via llama-cpp-python).

    .venv/bin/python scripts/bench_llamacpp.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompt-len 2048 --chunk 128 --decode 64 --threads 2 [--json] [--dump-tokens FILE]

Prompt: scripts/filler.py's deterministic text (seed --seed), tokenized by llama.cpp (BOS first
when the model adds one) and cut to exactly --prompt-len tokens. `--dump-tokens FILE` writes
those ids as a JSON array so another engine can be fed the very same ids.

Setup: n_batch = n_ubatch = chunk, n_threads = n_threads_batch = threads,
n_ctx = prompt_len + decode + 16. A short warm-up prompt is evaluated first (not timed).
Prefill = evaluating all prompt tokens in chunks; decode = `decode` single-token evaluations,
each token the argmax of the previous logits (no sampler). With --repeat N the fastest of N
prefills and of N decodes are reported. loadavg_1m is recorded: on 2 cores any other busy
process (a cargo build) distorts the numbers badly, so benchmark on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, str(Path(__file__).resolve().parent))
from filler import filler_text  # noqa: E402


def prompt_tokens(llm: Llama, n: int, seed: int) -> list[int]:
    words = max(64, n)
    while True:
        toks = llm.tokenize(filler_text(words, seed).encode("utf-8"), add_bos=True, special=False)
        if len(toks) >= n:
            return toks[:n]
        words *= 2


def main() -> None:
    ap = argparse.ArgumentParser(description="llama.cpp prefill/decode benchmark")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="filler text seed")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs; the fastest prefill and the fastest decode are reported")
    ap.add_argument("--flash-attn", action="store_true", help="enable llama.cpp flash attention")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--dump-tokens", metavar="FILE", help="write the prompt ids as a JSON array")
    args = ap.parse_args()

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    n_ctx = args.prompt_len + args.decode + 16
    llm = Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        n_batch=args.chunk,
        n_ubatch=args.chunk,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=args.flash_attn,
        logits_all=False,
        seed=0,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx

    def last_logits() -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    toks = prompt_tokens(llm, args.prompt_len, args.seed)
    if args.dump_tokens:
        Path(args.dump_tokens).write_text(json.dumps(toks) + "\n")
        log(f"wrote {len(toks)} prompt ids to {args.dump_tokens}")

    # Warm-up (not timed): a short prompt plus a few decode steps.
    llm.reset()
    llm.eval(toks[: min(len(toks), args.chunk)])
    for _ in range(4):
        llm.eval([int(np.argmax(last_logits()))])

    prefill_s = decode_s = float("inf")
    for _ in range(args.repeat):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks)
        nxt = int(np.argmax(last_logits()))
        t1 = time.perf_counter()
        generated = [nxt]
        for _ in range(args.decode):
            llm.eval([nxt])
            nxt = int(np.argmax(last_logits()))
            generated.append(nxt)
        t2 = time.perf_counter()
        prefill_s = min(prefill_s, t1 - t0)
        decode_s = min(decode_s, t2 - t1)
        log(f"run: prefill {t1 - t0:.3f} s, decode {t2 - t1:.3f} s")

    res = {
        "engine": "llama.cpp",
        "model": os.path.basename(args.model),
        "prompt_tokens": len(toks),
        "chunk": args.chunk,
        "threads": args.threads,
        "decode_tokens": args.decode,
        "flash_attn": args.flash_attn,
        "llama_cpp_python": llama_cpp.__version__,
        "prefill_s": round(prefill_s, 4),
        "prefill_tok_s": round(len(toks) / prefill_s, 2),
        "decode_s": round(decode_s, 4),
        "decode_tok_s": round(args.decode / decode_s, 2),
        "repeat": args.repeat,
        "loadavg_1m": os.getloadavg()[0],
    }
    log("generated: " + repr(llm.detokenize(generated[:16]).decode("utf-8", errors="replace")))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
