#!/usr/bin/env python3
"""First passkey retrieval sweep (issue: KV cache under a budget).

A 5-digit key is hidden at a random depth of ~L tokens of repeated filler (the classic
passkey task of Mohtashami & Jaggi 2023); the model is asked for it in a chat turn, greedy.
For each seed the same prompt is run under every policy and budget; a run is correct when the
answer contains the key.

    python3 scripts/passkey-sweep.py -m models/qwen2.5-coder-0.5b-instruct.gguf \
        --tokens 3000 --budgets 512,1024 --policies full,keydiff,tova,snapkv,h2o,sink \
        --seeds 10 --chunk 128 --out bench/results/passkey-qwen.json

It drives target/release/keydiff (one process per run) and prints a table.
"""
import argparse, json, random, subprocess, sys, time, os, platform

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")

def prompt(seed, words):
    rng = random.Random(seed)
    key = rng.randint(10000, 99999)
    n = max(1, words // len(FILLER.split()))
    depth = rng.randint(0, n - 1)
    parts = [FILLER] * n
    parts.insert(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    text = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it.\n" + "".join(parts) +
            "\nWhat is the pass key? Answer with the number only.")
    return key, depth / n, text

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=3000, help="approximate prompt length")
    ap.add_argument("--budgets", default="512,1024")
    ap.add_argument("--policies", default="full,keydiff,tova,snapkv,h2o,sink")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=0, help="resume a stopped sweep")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--bin", default="target/release/keydiff")
    ap.add_argument("--out")
    a = ap.parse_args()
    budgets = [int(b) for b in a.budgets.split(",")]
    policies = a.policies.split(",")
    # ~1.3 tokens per filler word for these BPE vocabularies
    words = int(a.tokens / 1.3)
    rows = []
    for seed in range(a.first_seed, a.seeds):
        key, depth, text = prompt(seed, words)
        runs = [("full", None)] if "full" in policies else []
        runs += [(p, b) for b in budgets for p in policies if p != "full"]
        for policy, budget in runs:
            cmd = [a.bin, "run", "-m", a.model, "--chat", "-p", text, "-n", "12", "--json",
                   "--chunk", str(a.chunk), "--policy", policy]
            if budget:
                cmd += ["--budget", str(budget)]
            t = time.time()
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                sys.exit(1)
            r = json.loads(out.stdout)
            ok = str(key) in r["text"]
            rows.append({"seed": seed, "key": key, "depth": round(depth, 3), "policy": policy,
                         "budget": budget, "correct": ok, "answer": r["text"],
                         "prompt_tokens": r["stats"]["prompt_tokens"],
                         "seconds": round(time.time() - t, 1)})
            print(f"seed {seed} depth {depth:.2f} {policy:8} budget {budget}: "
                  f"{'ok ' if ok else 'MISS'} {r['text']!r}", file=sys.stderr, flush=True)
        if a.out:  # after every seed, so that an interrupted sweep keeps what it measured
            save(a.out, rows)
    cells = {}
    for r in rows:
        cells.setdefault((r["policy"], r["budget"]), []).append(r["correct"])
    print(f"passkey, {a.model.split('/')[-1]}, ~{rows[0]['prompt_tokens']} tokens, "
          f"B={a.chunk}, {a.seeds} seeds")
    print(f"{'policy':10} " + " ".join(f"{'N=' + str(b):>8}" for b in budgets) + "   full")
    for p in policies:
        if p == "full":
            continue
        accs = [cells.get((p, b), []) for b in budgets]
        print(f"{p:10} " + " ".join(f"{sum(x)}/{len(x):<5}".rjust(8) for x in accs))
    if "full" in policies:
        f = cells[("full", None)]
        print(f"{'full':10} {sum(f)}/{len(f)}")

def save(path, rows):
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} cpus)",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip(),
            "command": " ".join(sys.argv), "seeds_done": len({r["seed"] for r in rows})}
    json.dump({"meta": meta, "runs": rows}, open(path, "w"), indent=1)

if __name__ == "__main__":
    main()
