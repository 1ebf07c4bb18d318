"""Full-cache perplexity of llama.cpp (llama-cpp-python) on the first N tokens of a text, by
quarter: the reference for keydiff's `perplexity` with policy full on the same text.
Usage: python llamacpp_ppl.py MODEL TEXT N"""
import sys
import numpy as np
from llama_cpp import Llama

model, text, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = Llama(model_path=model, n_ctx=n, n_batch=128, n_ubatch=128, n_threads=2,
            n_threads_batch=2, logits_all=True, verbose=False)
toks = llm.tokenize(open(text, "rb").read(), add_bos=True, special=False)[:n]
llm.eval(toks)
nll = []
for i in range(len(toks) - 1):
    row = np.asarray(llm.scores[i], dtype=np.float64)
    m = row.max()
    nll.append(m + np.log(np.exp(row - m).sum()) - row[toks[i + 1]])
nll = np.array(nll)
q = [np.exp(nll[p * len(nll) // 4:(p + 1) * len(nll) // 4].mean()) for p in range(4)]
print(f"{model}: {len(toks)} tokens, ppl {np.exp(nll.mean()):.4f}, mean NLL {nll.mean():.4f}, "
      f"by quarter {' / '.join(f'{x:.2f}' for x in q)}")
