#!/usr/bin/env python3
"""The results page of a GPU check: the markdown to commit under bench/results/.

Reads what scripts/gpu-check.sh left (the folder with summary.txt, or the gpu-check.tgz that
scripts/gpu-device-run.sh packs) and prints a page with the run's provenance (when, machine,
binary and commit, command, wall time), one row per check with its result, and the summary
verbatim. What it cannot know (the device tool's own timing, what the failures mean) is left
for the person committing it to add.

  python3 scripts/gpu-results.py /path/to/gpu-check.tgz > bench/results/DATE-gpu-check.md
"""

import re
import sys
import tarfile
import tempfile
from pathlib import Path

# A check's line: `name: PASS (detail)`, `name: FAIL (exit 124)`, `name: not run (why)`.
STATUS = re.compile(
    r"^(?P<name>[a-z0-9][^:]*?): (?P<result>PASS|FAILED|FAIL|not run|skipped)"
    r"(?:\s*[:(]?\s*(?P<detail>.*?)\)?)?$"
)
# Lines that are facts of the run, not checks.
FACTS = ("started", "gpu", "gpu arch", "binary", "ldd", "memory plan", "elapsed")


def summary_of(path: Path) -> tuple[str, str]:
    """The summary's text and the name of the folder it came from."""
    if path.is_dir():
        return (path / "summary.txt").read_text(), path.name
    with tarfile.open(path) as tar, tempfile.TemporaryDirectory() as tmp:
        member = next(m for m in tar.getmembers() if m.name.endswith("summary.txt"))
        tar.extract(member, tmp, filter="data")
        return (Path(tmp) / member.name).read_text(), path.name


def fact(lines: list[str], key: str) -> str | None:
    for line in lines:
        if line.startswith(key + ": "):
            return line[len(key) + 2 :].strip()
    return None


def page(summary: str, source: str) -> str:
    lines = summary.splitlines()
    started = fact(lines, "started")
    day = started[:10] if started else "DATE"
    binary = fact(lines, "binary") or "unknown"
    commit = re.search(r"\(build ([0-9a-f]+(?:-dirty)?)", binary)
    rows = []
    for line in lines:
        m = STATUS.match(line)
        if not m or m["name"] in FACTS:
            continue
        result = "FAIL" if m["result"] == "FAILED" else m["result"]
        detail = (m["detail"] or "").replace("|", "\\|")
        rows.append(f"| {m['name']} | {result} | {detail} |")
    failed = sum(1 for r in rows if "| FAIL |" in r)
    out = [
        f"# GPU check, {day}",
        "",
        f"- **When**: {started or 'unknown (the check did not record its start)'} (UTC).",
        f"- **Machine**: {fact(lines, 'gpu') or 'unknown'}"
        + "".join(f"; {line[len('devices: '):]}" for line in lines if line.startswith("devices: "))
        + (f"; {fact(lines, 'gpu arch')}" if fact(lines, "gpu arch") else "")
        + ".",
        f"- **Binary**: {binary}; commit `{commit[1] if commit else 'unknown'}`.",
        "- **Command** (through the device tool, carry `[\".gpu\"]`): `bash scripts/gpu-device-run.sh`"
        " (runs `scripts/gpu-check.sh` with its defaults).",
        f"- **Wall time**: {fact(lines, 'elapsed') or 'unknown'} for the check.",
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
        summary, source = summary_of(path)
    except (OSError, StopIteration, tarfile.TarError) as e:
        print(f"error: {path}: no summary.txt in it ({e or 'not found'})", file=sys.stderr)
        return 1
    sys.stdout.write(page(summary, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
