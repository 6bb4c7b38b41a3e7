"""Result rows of the benchmark scripts, written the moment they are measured.

Each stage appends JSON lines to <dir>/<stage>.jsonl (flushed per row, so a stage killed by its
time guard keeps what it measured); <dir> is $OUT when set (the device machine's folder that
comes back), else benchmarks/results/gpu/. `summarise` renders every stage as one Markdown file.
"""

from __future__ import annotations

import datetime
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def results_dir() -> str:
    d = os.environ.get("OUT") or os.path.join(HERE, "results", "gpu")
    os.makedirs(d, exist_ok=True)
    return d


class Rows:
    """Append-only writer of one stage's rows."""

    def __init__(self, stage: str):
        self.path = os.path.join(results_dir(), f"{stage}.jsonl")

    def add(self, **row) -> dict:
        row = {"time": datetime.datetime.now().isoformat(timespec="seconds"), **row}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        print(json.dumps(row), flush=True)
        return row


def summarise(directory: str | None = None) -> str:
    """Every <stage>.jsonl of the folder as Markdown tables (one per stage) -> summary.md."""
    d = directory or results_dir()
    parts = [f"# gpu_check results ({datetime.date.today().isoformat()})", ""]
    for path in sorted(glob.glob(os.path.join(d, "*.jsonl"))):
        rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
        if not rows:
            continue
        cols = list(dict.fromkeys(k for r in rows for k in r if k != "time"))
        parts += [f"## {os.path.basename(path)[:-6]}", "", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]
        parts += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
        parts.append("")
    text = "\n".join(parts)
    with open(os.path.join(d, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "/")


if __name__ == "__main__":
    print(summarise())
