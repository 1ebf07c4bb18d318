#!/usr/bin/env python3
"""Writes llama.cpp perplexity fixtures for the perplexity parity tests:

    tests/fixtures/llamacpp/ppl-smollm2.json
    tests/fixtures/llamacpp/ppl-qwen.json

For each model: the token ids of the first N_TOKENS tokens of a natural English text (the GNU
GPL v3, /usr/share/common-licenses/GPL-3 on Debian and Ubuntu; its sha256 is recorded), and
llama.cpp's negative log-likelihood of every token after the first, from the raw logits of one
full-cache pass (logits_all, n_ubatch = 128), in natural log, computed in float64. Run it in the
venv made by scripts/python-env.sh, after scripts/fetch-models.sh:

    .venv/bin/python scripts/gen-ppl-fixtures.py [smollm2|qwen|all]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import llama_cpp
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen": "qwen2.5-coder-0.5b-instruct.gguf",
}
OUT_DIR = ROOT / "tests" / "fixtures" / "llamacpp"
TEXT = Path("/usr/share/common-licenses/GPL-3")
N_TOKENS = 1024
N_UBATCH = 128
N_THREADS = 2


def build(key: str) -> dict:
    path = ROOT / "models" / MODELS[key]
    raw = TEXT.read_bytes()
    llm = Llama(
        model_path=str(path),
        n_ctx=2048,
        n_batch=N_UBATCH,
        n_ubatch=N_UBATCH,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        logits_all=True,
        verbose=False,
    )
    tokens = llm.tokenize(raw, add_bos=True, special=False)[:N_TOKENS]
    llm.reset()
    llm.eval(tokens)
    n_vocab = llm.n_vocab()
    logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float64).reshape(len(tokens), n_vocab)
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    nll = lse[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]]
    return {
        "model_file": MODELS[key],
        "text": str(TEXT),
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "llama_cpp_python": llama_cpp.__version__,
        "n_ubatch": N_UBATCH,
        "tokens": [int(t) for t in tokens],
        "mean_nll": float(nll.mean()),
        "nll": [round(float(x), 6) for x in nll],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", nargs="?", default="all", choices=["smollm2", "qwen", "all"])
    args = ap.parse_args()
    for key in MODELS if args.which == "all" else [args.which]:
        data = build(key)
        out = OUT_DIR / f"ppl-{key}.json"
        out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"{out}: {len(data['tokens'])} tokens, mean NLL {data['mean_nll']:.4f}, "
              f"ppl {np.exp(data['mean_nll']):.4f}")


if __name__ == "__main__":
    main()
