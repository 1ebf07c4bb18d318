#!/usr/bin/env python3
"""Writes llama.cpp reference fixtures for the parity tests:

    tests/fixtures/llamacpp/smollm2.json
    tests/fixtures/llamacpp/qwen.json

For each model and prompt: llama.cpp's token ids, the top-10 raw logits at the last prompt
position, and a 24-token greedy continuation (argmax of the raw logits, one token evaluated at a
time, no sampler and no penalties). Run it in the venv made by scripts/python-env.sh, after
scripts/fetch-models.sh:

    .venv/bin/python scripts/gen-fixtures.py [smollm2|qwen|all|rope|qwen3|qwen3moe]

`rope` writes the same for three prompts under RoPE scaling given as llama.cpp's context
parameters (`--rope-scaling`, `--rope-scale`, `--yarn-orig-ctx` of its CLI), for
tests/tests/rope.rs: tests/fixtures/llamacpp/{qwen-yarn,smollm2-yarn,smollm2-linear}.json.

`qwen3` writes tests/fixtures/llamacpp/tiny-qwen3.json for a tiny Qwen 3 with seeded random f32
weights and Qwen's tokenizer, whose GGUF `cargo run --release -p keydiff-tests --example
tiny-qwen3` writes (keydiff_tests::write_tiny_qwen3; the test writes the same bytes again).

`qwen3moe` writes tests/fixtures/llamacpp/tiny-qwen3moe.json and tiny-qwen3moe-q8_0.json for the
same model with a mixture of 8 experts (2 per token) in each layer, its experts stored as F32
and as Q8_0 (keydiff_tests::write_tiny_qwen3_moe; the example's `--moe [q8_0]`).

Deterministic: CPU, 2 threads, a fixed seed (unused: nothing is sampled).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

import llama_cpp
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from filler import filler_text  # noqa: E402

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen": "qwen2.5-coder-0.5b-instruct.gguf",
}
OUT_DIR = ROOT / "tests" / "fixtures" / "llamacpp"

N_CTX = 4096
N_BATCH = 512
N_THREADS = 2
SEED = 1234
TOP_K = 10
N_GREEDY = 24

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]

DIGITS = "In 1984, 12345 people paid $3.14159 each; call 555-0199 or 2024-11-30. Order #007 shipped 1,000,000 units (0.5%) at 23:59:59."

UNICODE = "Café naïve façade — 東京タワー は 333 m です 🚀✨ ¿Qué tal? Ελληνικά, русский, 한국어, عربى, 👩‍💻 and ﬁ ligature."

CODE = (
    "def merge_counts(a: dict, b: dict) -> dict:\n"
    '    """Merge two {key: count} maps."""\n'
    "    out = {k: v for k, v in a.items()}\n"
    "    for k, v in b.items():\n"
    "\tif k in out:\n"
    "\t\tout[k] += v  # tab-indented on purpose\n"
    "\telse:\n"
    "\t\tout[k] = v\n"
    "    return {k: out[k] for k in sorted(out)}\n"
    "\n"
    "print(merge_counts({'x': 1}, {\"x\": 2, 'y': [3, 4]}))\n"
)

PROSE = (
    "The lighthouse keeper had lived on the island for almost thirty years, and in that time he "
    "had learned to read the weather the way other people read the morning paper. A change in "
    "the color of the water, a certain stillness among the gulls, the smell of iron in the air: "
    "each of these told him something about the hours ahead. Visitors rarely came, and when they "
    "did they asked the same questions. Was he lonely? Did he miss the city? He would smile and "
    "point at the long row of notebooks on the shelf above his desk, where he had recorded every "
    "storm, every ship, and every unusual bird that had passed within sight of the tower. Loneliness, "
    "he told them, is a matter of attention. A man who watches the world carefully is never quite "
    "alone, because the world keeps answering him in small and surprising ways, and the answers "
    "are worth writing down."
)


def long_text() -> str:
    """~600 tokens of numbered sentences, deterministic (filler.py's generator)."""
    sentences = [s for s in re.split(r"(?<=\.)\s+", filler_text(395, seed=42)) if s]
    return "\n".join(f"{i + 1}. {s}" for i, s in enumerate(sentences)) + "\n"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chat_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment exactly as transformers builds it
    (transformers.utils.chat_template_utils._compile_jinja_template): sandboxed, immutable,
    trim_blocks and lstrip_blocks on, keep_trailing_newline off, loopcontrols, tojson without
    ASCII escaping, raise_exception and strftime_now globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now(timezone.utc).strftime(fmt)
    return env


# Name: (model, llama.cpp context parameters, the same as keydiff's --rope-* flags).
ROPE_VARIANTS = {
    # Qwen 2.5's model card: YaRN x4 from 32768 (128K).
    "qwen-yarn": ("qwen", dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
                               rope_freq_scale=0.25, yarn_orig_ctx=32768),
                  {"rope_scaling": "yarn", "rope_scale": 4.0, "yarn_orig_ctx": 32768}),
    # The interleaved (GGUF llama) rotation, an original context below the model's.
    "smollm2-yarn": ("smollm2", dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
                                     rope_freq_scale=0.25, yarn_orig_ctx=2048),
                     {"rope_scaling": "yarn", "rope_scale": 4.0, "yarn_orig_ctx": 2048}),
    "smollm2-linear": ("smollm2", dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
                                       rope_freq_scale=0.5),
                       {"rope_scaling": "linear", "rope_scale": 2.0}),
}
ROPE_PROMPTS = ("code", "prose", "long")


class Model:
    def __init__(self, path: Path, **rope) -> None:
        self.llm = Llama(
            model_path=str(path),
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            n_ubatch=N_BATCH,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            seed=SEED,
            logits_all=False,
            verbose=False,
            **rope,
        )
        self.n_vocab = self.llm.n_vocab()
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)

    def token_text(self, tok: int) -> str:
        return self.llm._model.token_get_text(tok)

    def is_eog(self, tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, tok))

    def last_logits(self) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32).copy()

    def run(self, tokens: list[int]) -> dict:
        llm = self.llm
        llm.reset()
        llm.eval(tokens)
        logits = self.last_logits()
        order = np.argsort(-logits, kind="stable")[:TOP_K]
        top = [[int(i), float(logits[i])] for i in order]
        greedy: list[int] = []
        gaps: list[float] = []
        for step in range(N_GREEDY):
            top2 = np.sort(logits)[-2:]
            gaps.append(float(top2[1] - top2[0]))
            greedy.append(int(np.argmax(logits)))
            if step + 1 == N_GREEDY:
                break
            llm.eval([greedy[-1]])
            logits = self.last_logits()
        first_eog = next((i for i, t in enumerate(greedy) if self.is_eog(t)), None)
        text = llm.detokenize(greedy, special=False).decode("utf-8", errors="replace")
        return {
            "top_logits": top,
            "greedy": greedy,
            # llama.cpp's gap between its first and second logit at each greedy step.
            "greedy_gaps": [round(g, 6) for g in gaps],
            "greedy_text": text,
            "greedy_first_eog": first_eog,
        }


def build(key: str, rope: dict | None = None, flags: dict | None = None,
          path: Path | None = None, ctx: dict | None = None) -> dict:
    fname = MODELS[key] if path is None else path.name
    path = ROOT / "models" / fname if path is None else path
    if not path.exists():
        sys.exit(f"gen-fixtures: {path} missing: run scripts/fetch-models.sh {key}")
    print(f"gen-fixtures: {key}: hashing {fname}", flush=True)
    sha = sha256_file(path)
    m = Model(path, **(rope or {}), **(ctx or {}))
    llm = m.llm
    md = llm.metadata
    bos, eos = llm.token_bos(), llm.token_eos()
    add_bos = bool(m.llm._model.add_bos_token())
    add_eos = bool(m.llm._model.add_eos_token())
    bos_text = m.token_text(bos) if bos >= 0 else ""
    eos_text = m.token_text(eos) if eos >= 0 else ""

    template = md.get("tokenizer.chat_template")
    if not template:
        sys.exit(f"gen-fixtures: {fname} has no tokenizer.chat_template")
    chat_text = chat_environment().from_string(template).render(
        messages=CHAT_MESSAGES,
        add_generation_prompt=True,
        bos_token=bos_text,
        eos_token=eos_text,
    )

    prompts = [
        ("digits", DIGITS, False),
        ("unicode", UNICODE, False),
        ("code", CODE, False),
        ("prose", PROSE, False),
        ("chat", chat_text, True),
        ("long", long_text(), False),
    ]
    if rope:
        prompts = [p for p in prompts if p[0] in ROPE_PROMPTS]
    out_prompts = []
    for name, text, special in prompts:
        toks = llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)
        toks_nobos = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        # What llama.cpp did: with add_special=true it prepends BOS only when the vocab says so.
        did_add_bos = len(toks) == len(toks_nobos) + 1 and toks[0] == bos
        assert did_add_bos == add_bos, (name, did_add_bos, add_bos)
        # The fixture's `tokens` must round-trip to `text` (no lossy normalisation).
        body = toks[1:] if did_add_bos else toks
        rt = llm.detokenize(body, special=special).decode("utf-8", errors="replace")
        entry = {
            "name": name,
            "text": text,
            "add_bos": did_add_bos,
            "special": special,
        }
        if name == "chat":
            entry["messages"] = CHAT_MESSAGES
            entry["starts_with_bos_text"] = bool(bos_text) and text.startswith(bos_text)
            entry["note"] = (
                "text is the chat template rendered with jinja2 as transformers does "
                "(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols), "
                "add_generation_prompt=true, bos_token/eos_token = vocab texts; tokenized with "
                "special=true so control-token texts become their ids"
            )
        print(f"gen-fixtures: {key}: {name}: {len(toks)} tokens"
              + ("" if rt == text else " (detokenized text differs from input)"), flush=True)
        entry["tokens"] = toks
        entry.update(m.run(toks))
        print(f"gen-fixtures: {key}: {name}: greedy -> {entry['greedy_text']!r}", flush=True)
        out_prompts.append(entry)

    out = {
        "model_file": fname,
        "gguf_sha256": sha,
        "llama_cpp_python": llama_cpp.__version__,
        "n_ctx": N_CTX,
        "n_batch": N_BATCH,
        "n_threads": N_THREADS,
        "architecture": md.get("general.architecture"),
        "file_type": int(md["general.file_type"]) if "general.file_type" in md else None,
        "n_vocab": m.n_vocab,
        "bos_id": bos,
        "eos_id": eos,
        "bos_text": bos_text,
        "eos_text": eos_text,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "tokenizer_model": md.get("tokenizer.ggml.model"),
        "tokenizer_pre": md.get("tokenizer.ggml.pre"),
        "greedy_note": (
            f"{N_GREEDY} argmax tokens of the raw logits, one token evaluated at a time, "
            "not stopped at end-of-generation tokens (greedy_first_eog is the index of the "
            "first one, or null); greedy_text is detokenized with special=false"
        ),
        "prompts": out_prompts,
    }
    if rope:
        out["llama_cpp_params"] = rope
        out["rope_flags"] = flags
    if ctx:
        out["llama_cpp_params"] = ctx
    return out


def dump(data: dict) -> str:
    """Indented JSON, but every list of numbers (or of [id, logit] pairs) on one line."""
    text = json.dumps(data, ensure_ascii=False, indent=1)

    def one_line_str(s: str) -> str:
        return json.dumps(json.loads(s), separators=(", ", ": "))

    def one_line(m: re.Match) -> str:
        return one_line_str(m.group(0))

    # innermost lists holding only numbers, then lists of such lists
    # (only at a value position: after `": ` or at the start of a line, never inside a string)
    text = re.sub(r'(?m)(^\s*|(?<=[^\\]": ))\[[-0-9.eE,\s]*\]',
                  lambda m: m.group(1) + one_line_str(m.group(0)[len(m.group(1)):]), text)
    text = re.sub(r'(?<=[^\\]": )\[(?:\s*\[[-0-9.eE, ]*\],?)+\s*\]', one_line, text)
    assert json.loads(text) == data
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", nargs="?", default="all",
                    choices=["smollm2", "qwen", "all", "rope", "qwen3", "qwen3moe"])
    args = ap.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.which == "qwen3":
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tiny-qwen3.gguf"
            subprocess.run(["cargo", "run", "--release", "-q", "-p", "keydiff-tests",
                            "--example", "tiny-qwen3", "--", str(path)], check=True, cwd=ROOT)
            # An f32 KV cache (llama.cpp's default is f16), so that the two engines differ
            # by summation order only.
            f32 = llama_cpp.GGML_TYPE_F32
            data = build("tiny-qwen3", path=path, ctx=dict(type_k=f32, type_v=f32))
        data["model_file"] = "tiny-qwen3.gguf (keydiff_tests::write_tiny_qwen3)"
        out = OUT_DIR / "tiny-qwen3.json"
        out.write_text(dump(data) + "\n", encoding="utf-8")
        print(f"gen-fixtures: wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes)")
        return
    if args.which == "qwen3moe":
        for name, extra in [("tiny-qwen3moe", []), ("tiny-qwen3moe-q8_0", ["q8_0"])]:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{name}.gguf"
                subprocess.run(["cargo", "run", "--release", "-q", "-p", "keydiff-tests",
                                "--example", "tiny-qwen3", "--", str(path), "--moe", *extra],
                               check=True, cwd=ROOT)
                f32 = llama_cpp.GGML_TYPE_F32
                data = build(name, path=path, ctx=dict(type_k=f32, type_v=f32))
            data["model_file"] = (f"{name}.gguf (keydiff_tests::write_tiny_qwen3_moe, "
                                  f"experts {extra[0] if extra else 'f32'})")
            out = OUT_DIR / f"{name}.json"
            out.write_text(dump(data) + "\n", encoding="utf-8")
            print(f"gen-fixtures: wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes)")
        return
    if args.which == "rope":
        for name, (key, rope, flags) in ROPE_VARIANTS.items():
            data = build(key, rope, flags)
            out = OUT_DIR / f"{name}.json"
            out.write_text(dump(data) + "\n", encoding="utf-8")
            print(f"gen-fixtures: wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes)")
        return
    keys = list(MODELS) if args.which == "all" else [args.which]
    for key in keys:
        data = build(key)
        out = OUT_DIR / f"{key}.json"
        out.write_text(dump(data) + "\n", encoding="utf-8")
        print(f"gen-fixtures: wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
