"""Scores and survivors of the last `mutmut run` (`make mutants`), read from mutmut's own mutants/ directory.

An occasional tool, not part of the pipeline: run it after `mutmut run` to see, per core module, how many mutants
the tests detect, and every mutant they do not detect with its diff. A survivor is a prompt for review (a missing
test, or a mutant that cannot change behaviour); no list of "equivalent" mutants is kept, because mutmut numbers
mutants by position and the numbers shift with every edit.

    python -m tools.mutation.report                         # summary table + each survivor's diff, to stdout
    python -m tools.mutation.report --survivors             # only the survivors' names (to re-run them)
    python -m tools.mutation.report --summary reports/mutation.md   # also write the table there

Score = (killed + timed out) / (made - not run); "no tests" (no selected test reaches the mutated function) and
"other" (suspicious, interrupted, ...) count as undetected.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The numerical core, as pyproject.toml [tool.mutmut] only_mutate lists it (dotted below pipeline/).
CORE = (
    "modeling.losses",
    "federation.strategies",
    "federation.compression",
    "results.stats",
    "partitioning.schemes",
    "training.stopping",
    "training.local_batch",
    "training.set_engine",
    "privacy.accounting",
    "privacy.client_dp",
)

# mutmut 3's exit codes (mutmut.stats.status_by_exit_code), grouped as the report counts them.
_STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    33: "no tests",
    5: "no tests",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
}


def status(code: int | None) -> str:
    if code is None:
        return "not run"
    return _STATUS.get(code, "other")


@dataclass
class ModuleResult:
    module: str
    counts: dict[str, int] = field(default_factory=dict)
    undetected: list[str] = field(default_factory=list)

    @property
    def made(self) -> int:
        return sum(self.counts.values())

    @property
    def score(self) -> float | None:
        run = self.made - self.counts.get("not run", 0)
        detected = self.counts.get("killed", 0) + self.counts.get("timeout", 0)
        return detected / run if run else None


def _number(name: str) -> int:
    tail = name.rpartition("__mutmut_")[2]
    return int(tail) if tail.isdigit() else 0


def collect(mutants_dir: Path, modules: tuple[str, ...] = CORE) -> dict[str, ModuleResult]:
    """Per module that mutmut generated (mutants/pipeline/<module>.py.meta; of a package, each of its files with
    mutants, as ``<package>.<file>``), the verdict counts and survivors."""
    results = {}
    for module in modules:
        path = mutants_dir / "pipeline" / module.replace(".", "/")
        for meta in [path.with_name(path.name + ".py.meta"), *sorted(path.glob("*.py.meta"))]:
            if not meta.exists():
                continue
            name = module if meta.parent != path else f"{module}.{meta.name.removesuffix('.py.meta')}"
            r = ModuleResult(name)
            for key, code in sorted(
                json.loads(meta.read_text())["exit_code_by_key"].items(),
                key=lambda kv: (kv[0].rpartition("__mutmut_")[0], _number(kv[0])),
            ):
                s = status(code)
                r.counts[s] = r.counts.get(s, 0) + 1
                if s in ("survived", "no tests", "other"):
                    r.undetected.append(key)
            if meta.name != "__init__.py.meta":
                results[name] = r
    return results


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def table(results: dict[str, ModuleResult], measured: str, kept: dict[str, str] | None = None) -> str:
    """The score table, each row ``measured`` (when, at which commit); a module this run did not run (every mutant
    "not run", or none made: nothing of it is measured) keeps its row of ``kept`` (the last table's rows by module
    path), so a run of one module leaves the others' measurements as they were."""
    cols = ("killed", "timeout", "survived", "no tests", "other", "not run")
    lines = [
        "| module | made | " + " | ".join(cols) + " | score | measured |",
        "|---|" + "---:|" * (len(cols) + 2) + "---|",
    ]
    for m, r in results.items():
        path = f"pipeline/{m.replace('.', '/')}.py"
        if r.counts.get("not run", 0) == r.made and path in (kept or {}):
            lines.append(kept[path])
            continue
        counts = " | ".join(str(r.counts.get(c, 0)) for c in cols)
        lines.append(f"| {path} | {r.made} | {counts} | {_pct(r.score)} | {measured} |")
    return "\n".join(lines)


def previous(text: str) -> tuple[dict[str, str], str]:
    """A summary file's table rows that have the measured column, by module path, and what it holds below the table
    (the hand-written notes on its rows, kept when the table is rewritten); one reading of its first table."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [line for line in lines[start:end] if line.startswith("| pipeline/") and line.count("|") == 11]
    return {row.split("|")[1].strip(): row for row in rows}, "\n".join(lines[end:]).strip()


def diff(name: str) -> str:
    """mutmut's own diff of one mutant."""
    return subprocess.run([sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True).stdout


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return head or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants-dir", type=Path, default=Path("mutants"))
    ap.add_argument("--survivors", action="store_true", help="print only the undetected mutants' names")
    ap.add_argument("--summary", type=Path, help="also write the summary table (markdown) to this file")
    args = ap.parse_args(argv)
    results = collect(args.mutants_dir)
    if not results:
        print(f"{args.mutants_dir}: no mutmut results of the core modules (run `make mutants` first)", file=sys.stderr)
        return 2
    if args.survivors:
        print("\n".join(n for r in results.values() for n in r.undetected))
        return 0
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    kept, notes = previous(args.summary.read_text() if args.summary and args.summary.is_file() else "")
    summary = table(results, f"{stamp}, {_commit()}", kept)
    print(summary)
    for r in results.values():
        for name in r.undetected:
            print(f"\n## {name} (review: add a test, or convince yourself it cannot change behaviour)\n")
            print(diff(name).rstrip())
    if args.summary:
        args.summary.write_text(
            "# Mutation testing of the numerical core\n\nEach row is its module's last `make mutants` run (mutmut; "
            "`python -m tools.mutation.report` lists the survivors' diffs), measured when and at the commit its last "
            "column says; a run of some modules keeps the others' rows. A row made 0: mutmut 3 mutates no decorated "
            "function (boxed/mutmut#387), and that file's functions are registered by a decorator; their tests alone "
            "check them.\n\n" + summary + "\n" + (f"\n{notes}\n" if notes else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
