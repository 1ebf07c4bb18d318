#!/usr/bin/env python3
"""The results page of a GPU check: the markdown to commit under bench/results/.

Reads what scripts/gpu-check.sh left: the gpu-check.tgz that scripts/gpu-device-run.sh packs,
the unpacked folder, or summary.txt itself. Prints a page with the run's provenance (when,
machine, binary and commit, command, wall time), one row per check with its result, whether
the check finished, and the summary verbatim. What it cannot know (the device tool's own
timing, what the failures mean) is left for the person committing it to add.

  python3 scripts/gpu-results.py /path/to/gpu-check.tgz > bench/results/DATE-gpu-check.md
"""

from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path

# A top-level line with something after its name: `name: PASS (detail)`, `name: FAIL (exit
# 124)`, `name: not run (why)`, `name: could not read the runs`. Table rows are indented, and
# headings (`parity (CPU f32 reference):`) end with a colon.
LINE = re.compile(r"^(?P<name>[a-z0-9][^:]*?): (?P<rest>\S.*)$")
# Facts of the run, not checks (a fact that failed is still a failure).
FACTS = ("started", "gpu", "gpu arch", "binary", "ldd", "memory plan", "elapsed", "devices")
WORDS = ("PASS", "FAILED", "FAIL", "not run", "skipped", "timed out", "not available")


def read(path: Path) -> tuple[str, str | None]:
    """The summary's text, and the check's exit line (`gpu-check exit: N`) when the log is
    there."""
    if path.is_dir():
        log = path.parent / "gc.log"
        return (path / "summary.txt").read_text(), exit_line(log.read_text()) if log.is_file() else None
    if not tarfile.is_tarfile(path):
        return path.read_text(), None
    with tarfile.open(path) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        name = next((n for n in members if n.endswith("summary.txt")), None)
        if name is None:
            raise FileNotFoundError("no summary.txt in it")
        text = tar.extractfile(members[name]).read().decode()
        log = next((n for n in members if n.endswith("gc.log")), None)
        exit_ = exit_line(tar.extractfile(members[log]).read().decode()) if log else None
        return text, exit_


def exit_line(log: str) -> str | None:
    found = re.findall(r"^gpu-check exit: (\d+)$", log, re.M)
    return found[-1] if found else None


def fact(lines: list[str], key: str) -> str | None:
    for line in lines:
        if line.startswith(key + ": "):
            return line[len(key) + 2 :].strip()
    return None


def verdict(rest: str) -> tuple[str, str]:
    """A check's result and detail from what follows its name."""
    for word in WORDS:
        if rest.startswith(word):
            result, detail = ("FAIL" if word == "FAILED" else word), rest[len(word) :].strip()
            break
    else:
        failed = re.search(r"\bFAIL|\bMISSING\b|\bcould not\b|\bexit \d+", rest)
        result, detail = ("FAIL" if failed else "info"), rest
    if result != "FAIL" and re.search(r"\bFAIL", detail):
        result = "FAIL"
    # Outer brackets that hold the whole detail, and only then.
    if detail.startswith("(") and detail.endswith(")") and balanced(detail[1:-1]):
        detail = detail[1:-1]
    return result, detail


def balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def page(summary: str, source: str, exit_: str | None) -> str:
    lines = summary.splitlines()
    started = fact(lines, "started")
    day = started[:10] if started else "DATE"
    binary = fact(lines, "binary") or "unknown"
    commit = re.search(r"\(build ([0-9a-f]+(?:-dirty)?)", binary)
    rows = []
    for line in lines:
        m = LINE.match(line)
        if not m or line.endswith(":"):
            continue
        name, rest = m["name"], m["rest"]
        result, detail = verdict(rest)
        if name in FACTS and result != "FAIL":
            continue
        cell = detail.replace("|", "\\|")
        rows.append(f"| {name} | {result} | {cell} |")
    failed = sum(1 for r in rows if "| FAIL |" in r)
    elapsed = fact(lines, "elapsed")
    if elapsed and exit_ in (None, "0"):
        finished = f"{elapsed} for the check"
    elif elapsed:
        finished = f"{elapsed} for the check, which exited with {exit_}"
    else:
        finished = (
            "**the check did not finish** (no `elapsed:` line"
            + (f"; it exited with {exit_}, 124 being the time limit" if exit_ else "")
            + "): the steps after the last one listed did not run"
        )
    devices = "".join(f"; {line[len('devices: '):]}" for line in lines if line.startswith("devices: "))
    arch = fact(lines, "gpu arch")
    out = [
        f"# GPU check, {day}",
        "",
        f"- **When**: {started or 'unknown (the check did not record its start)'} (UTC).",
        f"- **Machine**: {fact(lines, 'gpu') or 'unknown'}{devices}" + (f"; {arch}" if arch else "") + ".",
        f"- **Binary**: {binary}; commit `{commit[1] if commit else 'unknown'}`.",
        "- **Command** (through the device tool, carry `[\".gpu\"]`): `bash scripts/gpu-device-run.sh`"
        " (runs `scripts/gpu-check.sh` with its defaults).",
        f"- **Wall time**: {finished}.",
        f"- **Logs**: `{source}`.",
        "",
        "## Checks",
        "",
        f"{len(rows)} check{'' if len(rows) == 1 else 's'}, {failed} failed.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
        *rows,
        "",
        "## Summary, verbatim",
        "",
        "```text",
        summary.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path = Path(sys.argv[1])
    if not path.exists():
        print(f"error: {path}: no such file or folder", file=sys.stderr)
        return 1
    try:
        summary, exit_ = read(path)
    except (OSError, tarfile.TarError, UnicodeDecodeError) as e:
        print(f"error: {path}: no summary.txt in it ({str(e) or 'not found'})", file=sys.stderr)
        return 1
    sys.stdout.write(page(summary, path.name, exit_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
