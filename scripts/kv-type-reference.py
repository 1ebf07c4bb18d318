#!/usr/bin/env python3
"""Writes llama.cpp's perplexity under quantized KV caches, the reference of the quantized cache
tests (tests/tests/kv_dtype.rs):

    tests/fixtures/llamacpp/kv-cache-types.json

For each test model: llama.cpp's mean NLL of the first 1024 tokens of the GNU GPL v3 (the ids
of tests/fixtures/llamacpp/ppl-*.json, n_ubatch = 128, one full-cache pass, flash attention,
which llama.cpp needs for a quantized V cache) with the K and V caches in f16; both in q8_0,
q5_1, q5_0, q4_1 or q4_0; K only and V only in q8_0; and q8_0 keys beside q4_0 values.

Each case runs twice. llama.cpp (since ggml-org/llama.cpp#21038, 2026-04) stores a quantized
cache Hadamard-rotated: Q and K (and V, whose attention output is rotated back) are multiplied
per head by an orthonormal Hadamard matrix before K and V are quantized, which spreads outlier
channels over the whole block. keydiff does not rotate, so the tests compare against llama.cpp
with the rotation off (`LLAMA_ATTN_ROT_DISABLE=1`: the same codec on the same values); the
rotated numbers, llama.cpp's default, go under "rotated". Run it in the venv of
scripts/python-env.sh:

    .venv/bin/python scripts/kv-type-reference.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import llama_cpp
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "llamacpp"
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "qwen": "qwen2.5-coder-0.5b-instruct.gguf"}
# ggml_type numbers.
GGML = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8}
CASES = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("f16", "q8_0"), ("q5_1", "q5_1"),
         ("q5_0", "q5_0"), ("q4_1", "q4_1"), ("q4_0", "q4_0"), ("q8_0", "q4_0")]


def mean_nll(path: Path, tokens: list[int], type_k: str, type_v: str) -> float:
    llm = Llama(model_path=str(path), n_ctx=2048, n_batch=128, n_ubatch=128, n_threads=2,
                n_threads_batch=2, logits_all=True, verbose=False, flash_attn=True,
                type_k=GGML[type_k], type_v=GGML[type_v])
    llm.reset()
    llm.eval(tokens)
    lg = np.asarray(llm.scores[: len(tokens)], dtype=np.float64).reshape(len(tokens), llm.n_vocab())
    m = lg.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(lg - m).sum(axis=1, keepdims=True)))[:, 0]
    nll = lse[:-1] - lg[np.arange(len(tokens) - 1), tokens[1:]]
    return float(nll.mean())


def main() -> None:
    out = {"llama_cpp_python": llama_cpp.__version__, "n_ubatch": 128, "flash_attn": True,
           "attn_rot": "off (LLAMA_ATTN_ROT_DISABLE=1); llama.cpp's default under \"rotated\""}
    for key, file in MODELS.items():
        tokens = json.loads((FIXTURES / f"ppl-{key}.json").read_text())["tokens"]
        out[key] = {"model_file": file, "tokens": len(tokens), "rotated": {}}
        for rotated in (False, True):
            # Read by llama.cpp when each context's KV cache is made.
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if rotated else "1"
            into = out[key]["rotated"] if rotated else out[key]
            for k, v in CASES:
                into[f"k_{k}_v_{v}"] = round(mean_nll(ROOT / "models" / file, tokens, k, v), 6)
                print(key, "rotated" if rotated else "plain", k, v, into[f"k_{k}_v_{v}"], flush=True)
    (FIXTURES / "kv-cache-types.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
