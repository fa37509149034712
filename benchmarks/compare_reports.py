"""Compare the report files of the working tree with those of a git revision: every number equal within a float
tolerance, every text equal; wall times, memory and dates left out (they differ between any two runs).

    python -m benchmarks.compare_reports --rev 425d766 [--rtol 1e-6] [--paths reports]

Used to check that a refactor changed no result (docs/ARCHITECTURE.md, issue 14): JSON is compared value by value,
CSV cell by cell (numbers within the tolerance), Markdown and other text line by line after masking the timing
lines; PNG figures are compared through the data files drawn in them (reports/plots, tau_sweep.csv).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd

# Keys and files whose values are measurements of a run, not results.
VOLATILE_KEY = re.compile(  # whole words (plural too): "Committee", "avg_speakers", "word_updates" are results
    r"(?<![a-z])(second|time|rss|peak|wall|written|commit|date|duration|mb|mib|elapsed"
    r"|speed|speedup|throughput|host|python|platform|cpu)s?(?![a-z])",
    re.I,
)
VOLATILE_FILE = re.compile(r"^reports/(timing/|tables/timing\.|bench/|mlflow/|mutation|reliability)|\.png$")
TEXT_SUFFIXES = (".json", ".csv", ".md", ".txt", ".tsv", ".jsonl")  # figures are compared through their data
TEXT_VOLATILE = re.compile(r"\d+(\.\d+)?\s*(s|min|MiB|MB|GB)\b|seconds|wall|peak RSS|timing", re.I)


def git_files(rev: str, prefix: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, prefix], capture_output=True, text=True, check=True
    ).stdout
    return [f for f in out.splitlines() if not VOLATILE_FILE.search(f) and f.endswith(TEXT_SUFFIXES)]


def git_text(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout


def same_number(a: float, b: float, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol)


def diff_json(a: Any, b: Any, rtol: float, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if VOLATILE_KEY.search(str(k)):
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'new' if k in b else 'old'}")
                continue
            out += diff_json(a[k], b[k], rtol, f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items -> {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff_json(x, y, rtol, f"{where}[{i}]")]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return [] if same_number(float(a), float(b), rtol) else [f"{where}: {a} -> {b}"]
    return [] if a == b else [f"{where}: {a!r} -> {b!r}"]


def diff_csv(old: str, new: str, rtol: float) -> list[str]:
    a, b = pd.read_csv(io.StringIO(old)), pd.read_csv(io.StringIO(new))
    keep = [c for c in a.columns if not VOLATILE_KEY.search(str(c))]
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return [f"shape/columns {a.shape} {list(a.columns)} -> {b.shape} {list(b.columns)}"]
    out = []
    for c in keep:
        for i, (x, y) in enumerate(zip(a[c], b[c])):
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                if not same_number(float(x), float(y), rtol):
                    out.append(f"row {i} {c}: {x} -> {y}")
            elif not (pd.isna(x) and pd.isna(y)) and x != y:
                out.append(f"row {i} {c}: {x!r} -> {y!r}")
    return out


def diff_text(old: str, new: str) -> list[str]:
    a = [line for line in old.splitlines() if not TEXT_VOLATILE.search(line)]
    b = [line for line in new.splitlines() if not TEXT_VOLATILE.search(line)]
    if a == b:
        return []
    changed = [f"- {x}\n+ {y}" for x, y in zip(a, b) if x != y][:3]
    return [f"{len(a)} -> {len(b)} lines; first differences:\n" + "\n".join(changed)]


def compare(rev: str, prefix: str, rtol: float) -> dict[str, list[str]]:
    problems: dict[str, list[str]] = {}
    for path in git_files(rev, prefix):
        new_path = Path(path)
        if not new_path.is_file():
            problems[path] = ["missing in the working tree"]
            continue
        old, new = git_text(rev, path), new_path.read_text()
        if path.endswith(".json"):
            found = diff_json(json.loads(old), json.loads(new), rtol)
        elif path.endswith(".csv"):
            found = diff_csv(old, new, rtol)
        else:
            found = diff_text(old, new)
        if found:
            problems[path] = found
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision whose committed report files are the reference")
    ap.add_argument("--paths", default="reports")
    ap.add_argument("--rtol", type=float, default=1e-6)
    args = ap.parse_args(argv)
    files = git_files(args.rev, args.paths)
    problems = compare(args.rev, args.paths, args.rtol)
    for path, found in problems.items():
        print(f"{path}:")
        for line in found[:10]:
            print(f"  {line}")
    print(
        f"compared {len(files)} files of {args.rev}:{args.paths} (timing, benchmark and figure files left out): "
        f"{len(files) - len(problems)} equal, {len(problems)} differ"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
