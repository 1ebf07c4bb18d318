"""Deterministic English filler text for benchmarks and long-context tests.

`filler_text(n_words, seed)` returns the same string for the same arguments on any machine and
any Python 3 version: it uses its own tiny PRNG (SplitMix64), not `random`, so the text can be
re-implemented bit-for-bit elsewhere (e.g. in Rust) if needed.

Sentences are 6..14 words drawn from a fixed word list, capitalised, ending in '.', joined by
single spaces, with a newline after every 8th sentence (paragraphs). The output has exactly
`n_words` words (the last sentence may be cut short; it still ends in '.').
"""

from __future__ import annotations

import sys

WORDS = (
    "the a of and to in is was that for on with as by at from it this be are were "
    "river mountain city garden library window morning evening market harbor village "
    "teacher farmer doctor sailor painter student engineer baker merchant traveler "
    "walked carried opened noticed remembered built found watched followed explained "
    "quiet bright ancient narrow heavy gentle distant careful simple golden "
    "slowly quickly often never always together again almost still early "
    "bridge letter story road music stone light water bread clock paper lamp "
    "because while after before although until since during under over near beyond"
).split()

_MASK = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform-ish integer in [0, n) (modulo bias is irrelevant here, but fixed)."""
        return self.next_u64() % n


def filler_text(n_words: int, seed: int = 0) -> str:
    rng = SplitMix64(seed)
    out: list[str] = []
    words_left = n_words
    n_sent = 0
    while words_left > 0:
        length = min(6 + rng.below(9), words_left)
        sent = [WORDS[rng.below(len(WORDS))] for _ in range(length)]
        sent[0] = sent[0].capitalize()
        text = " ".join(sent) + "."
        n_sent += 1
        words_left -= length
        if out:
            out.append("\n" if (n_sent - 1) % 8 == 0 else " ")
        out.append(text)
    return "".join(out)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(filler_text(n, s))
