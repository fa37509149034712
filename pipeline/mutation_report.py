"""reports/mutation.md from mutmut's verdicts (``make mutants``; not part of the pipeline's stages).

mutmut 3 keeps one verdict per mutant in ``mutants/<module>.meta`` (a process exit code), but ``mutants/`` is
git-ignored and lives only as long as the machine: the verdicts are also kept in git, in
``reports/mutation-verdicts.json`` (per core module, mutmut's hash of every function and the exit code of every
mutant), and the run log in ``reports/mutation-runs.tsv``. ``--restore`` writes
the kept verdicts into ``mutants/`` before a run (mutmut itself then drops those of functions whose source changed),
and every report merges the verdicts of ``mutants/`` back into the file, so a module can be run in parts across
machines. A kept verdict counts only while its function's source is unchanged (mutmut's hash of it today): the
others are "not run".

This module counts the verdicts per core module and lists every mutant that no test caught, each with its diff and
either the reason it is equivalent (``tests/mutation_equivalent.yaml``: mutant name -> reason) or "not killed". With
a baseline (the counts and survivors of an earlier run, ``--save-baseline``) the report shows the score before and
after and which of the earlier survivors the new tests kill.

    python -m pipeline.mutation_report                       # merge mutants/ into the kept verdicts, write reports/mutation.md
    python -m pipeline.mutation_report --restore             # the kept verdicts into mutants/ (before `mutmut run`)
    python -m pipeline.mutation_report --save-baseline       # keep the current verdicts as the "before" run
    python -m pipeline.mutation_report --survivors modeling.losses  # names of modeling/losses.py's undetected mutants (to re-run)
    python -m pipeline.mutation_report --unfinished modeling.losses  # ... and those not run yet (to finish a module)

Score = detected / (made - equivalent - not run), detected = killed + timed out (a mutant that makes a test hang is
caught, by mutmut's time limit or pytest-timeout's); "no tests" mutants (no selected test reaches the function)
count as undetected.
"""
from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import atomic

MUTANTS_DIR = Path("mutants")
REPORT = Path("reports/mutation.md")
BASELINE = Path("reports/mutation-baseline.json")
EQUIVALENT = Path("tests/mutation_equivalent.yaml")
VERDICTS = Path("reports/mutation-verdicts.json")  # the verdicts kept in git (mutants/ is not)
RUNS = Path("reports/mutation-runs.tsv")  # one line per `make mutants` run of a module
# The core, in the order it is run and reported (pyproject.toml [tool.mutmut] only_mutate).
# Dotted below pipeline/, as mutmut names the mutants (pipeline.<module>.x_<function>__mutmut_<n>).
CORE = ("modeling.losses", "federation.strategies", "federation.compression", "partitioning.schemes",
        "results.scoring", "modeling.adapters", "datasets.sources", "datasets.readers", "federation.protocol",
        "training.checkpoints", "training.best_adapter", "training.history", "training.recorder", "training.publish",
        "training.client_training", "federation.client_app", "federation.server_app")
GOAL = 0.90

# mutmut 3's exit codes (mutmut.stats.status_by_exit_code), grouped as the report counts them.
KILLED_CODES = {1, 3}
SURVIVED_CODES = {0}
TIMEOUT_CODES = {36, 24, -24, 152, 255}
NO_TESTS_CODES = {33, 5}


def status(code: int | None) -> str:
    if code is None:
        return "not run"
    if code in KILLED_CODES:
        return "killed"
    if code in SURVIVED_CODES:
        return "survived"
    if code in TIMEOUT_CODES:
        return "timeout"
    if code in NO_TESTS_CODES:
        return "no tests"
    return "other"  # suspicious, segfault, skipped, interrupted: listed, never counted as detected


@dataclass
class ModuleResult:
    module: str
    made: int = 0
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    no_tests: int = 0
    other: int = 0
    not_run: int = 0
    equivalent: int = 0
    undetected: list[str] = field(default_factory=list)  # survived / no tests / other, equivalent ones included
    functions: dict[str, list[int]] = field(default_factory=dict)  # function -> [mutants run, mutants not run]

    @property
    def detected(self) -> int:
        return self.killed + self.timeout

    @property
    def scored(self) -> int:
        """Mutants the score is over: run, and not equivalent."""
        return self.made - self.not_run - self.equivalent

    @property
    def score(self) -> float | None:
        return self.detected / self.scored if self.scored > 0 else None


def load_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not all(isinstance(v, str) and v.strip() for v in data.values()):
        raise ValueError(f"{path}: expected a mapping of mutant name -> non-empty reason")
    return data


def _meta_path(module: str, mutants_dir: Path) -> Path:
    return mutants_dir / "pipeline" / f"{module.replace('.', '/')}.py.meta"


def _mangled(name: str) -> str:
    """The function a mutant belongs to as mutmut hashes it: ...x_f__mutmut_3 -> x_f, ...xǁCǁm__mutmut_1 -> xǁCǁm."""
    return name.partition("__mutmut_")[0].rpartition(".")[2]


def read_meta(mutants_dir: Path = MUTANTS_DIR) -> dict[str, dict[str, Any]]:
    """Per core module that mutants/ holds: mutmut's function hashes and verdicts (None: not run)."""
    found = {}
    for module in CORE:
        path = _meta_path(module, mutants_dir)
        if path.exists():
            data = json.loads(path.read_text())
            found[module] = {"hash_by_function_name": data.get("hash_by_function_name", {}),
                             "exit_code_by_key": data["exit_code_by_key"]}
    return found


def load_kept(path: Path = VERDICTS) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text())["modules"] if path.exists() else {}


def save_kept(kept: dict[str, dict[str, Any]], path: Path = VERDICTS) -> None:
    atomic.write_text(path, json.dumps({"modules": kept}, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def merge(kept: dict[str, dict[str, Any]], fresh: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The kept verdicts updated with mutants/'s: a module in ``fresh`` takes its mutants and hashes from there; a
    mutant it has not run keeps its kept verdict when its function's hash is the same in both (mutmut's own rule)."""
    merged = dict(kept)
    for module, new in fresh.items():
        old = kept.get(module, {})
        old_hashes, new_hashes = old.get("hash_by_function_name", {}), new["hash_by_function_name"]
        old_codes = old.get("exit_code_by_key", {})
        codes = {}
        for name, code in new["exit_code_by_key"].items():
            f = _mangled(name)
            if code is None and f in new_hashes and old_hashes.get(f) == new_hashes[f]:
                code = old_codes.get(name)
            codes[name] = code
        merged[module] = {"hash_by_function_name": dict(new_hashes), "exit_code_by_key": codes}
    return merged


def restore(kept: dict[str, dict[str, Any]], mutants_dir: Path = MUTANTS_DIR) -> int:
    """Write the kept verdicts into mutants/<module>.meta (a meta already there keeps what it ran and takes the
    kept verdicts of the rest), so that ``mutmut run`` goes on where the last machine stopped; mutmut drops the
    verdicts of functions whose source changed when it generates the mutants. Returns the verdicts restored."""
    present = read_meta(mutants_dir)
    restored = 0
    for module, entry in kept.items():
        path = _meta_path(module, mutants_dir)
        if module in present:
            meta = json.loads(path.read_text())
            meta["exit_code_by_key"] = merge({module: entry}, {module: present[module]})[module]["exit_code_by_key"]
        else:
            meta = {"exit_code_by_key": entry["exit_code_by_key"], "hash_by_function_name": entry["hash_by_function_name"],
                    "type_check_error_by_key": {}, "durations_by_key": {}, "estimated_durations_by_key": {}}
        restored += sum(code is not None for code in meta["exit_code_by_key"].values())
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(meta, indent=4))
    return restored


@dataclass
class Mutated:
    """What mutmut makes of one module's source today: its mutants, its hash of every function, the mutated code."""

    names: list[str]
    hashes: dict[str, str]
    code: str


def current_mutants(module: str) -> Mutated:
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    path = Path(_file(module))
    mutated = mutate_file_contents(str(path), path.read_text())
    return Mutated([get_mutant_name(path, n) for n in mutated.mutant_names], dict(mutated.hash_by_function_name),
                   mutated.code)


def in_force(kept: dict[str, dict[str, Any]], today: dict[str, Mutated]
             ) -> tuple[dict[str, dict[str, int | None]], dict[str, int]]:
    """Per module, today's mutants with the kept verdicts that still hold (their function's hash unchanged), the
    rest None; and per module how many kept verdicts were dropped because their function changed since."""
    codes: dict[str, dict[str, int | None]] = {}
    dropped: dict[str, int] = {}
    for module, mutated in today.items():
        if module not in kept:
            continue
        entry = kept[module]
        old_hashes, old_codes = entry["hash_by_function_name"], entry["exit_code_by_key"]
        same = {f for f, h in mutated.hashes.items() if old_hashes.get(f) == h}
        codes[module] = {n: old_codes.get(n) if _mangled(n) in same else None for n in mutated.names}
        dropped[module] = sum(c is not None and _mangled(n) not in same for n, c in old_codes.items())
    return codes, dropped


def collect(codes_by_module: dict[str, dict[str, int | None]], equivalent: dict[str, str] | None = None
            ) -> dict[str, ModuleResult]:
    """Per core module, the counts of mutmut's verdicts (modules never generated are absent)."""
    equivalent = equivalent or {}
    results: dict[str, ModuleResult] = {}
    for module in CORE:
        if module not in codes_by_module:
            continue
        r = ModuleResult(module)
        for name, code in sorted(codes_by_module[module].items(), key=lambda kv: _natural(kv[0])):
            r.made += 1
            s = status(code)
            counts = r.functions.setdefault(_function(name), [0, 0])
            counts[s == "not run"] += 1
            if s == "not run":
                r.not_run += 1
                continue
            setattr(r, s.replace(" ", "_"), getattr(r, s.replace(" ", "_")) + 1)
            if s in ("survived", "no tests", "other"):
                r.undetected.append(name)
                if name in equivalent:
                    r.equivalent += 1
        results[module] = r
    return results


def unfinished(codes: dict[str, int | None], equivalent: dict[str, str]) -> list[str]:
    """A module's mutants not run yet (equivalent ones too: their verdict is what says they survive) or not
    detected last time (equivalent ones left out), in mutmut's order."""
    return [name for name, code in sorted(codes.items(), key=lambda kv: _natural(kv[0]))
            if status(code) == "not run"
            or (name not in equivalent and status(code) in ("survived", "no tests", "other"))]


def _function(name: str) -> str:
    """The function of a mutant as the source spells it: x_f__mutmut_3 -> f, xǁCǁm__mutmut_1 -> C.m."""
    head = _mangled(name)
    return head.removeprefix("x_") if not head.startswith("xǁ") else head.removeprefix("xǁ").replace("ǁ", ".")


def _natural(name: str) -> tuple[str, int]:
    head, _, num = name.rpartition("__mutmut_")
    return head, int(num) if num.isdigit() else 0


def mutant_diffs(mutated: Mutated, names: list[str]) -> dict[str, str]:
    """The changed lines of each named mutant (mutmut's own diff, without the file header), read from the mutated
    code itself, so no mutants/ directory is needed."""
    import difflib

    import libcst as cst
    from mutmut.mutation.diff_apply import read_mutant_function, read_original_function

    tree = cst.parse_module(mutated.code)
    diffs = {}
    for name in names:
        before, after = (cst.Module([f]).code.strip().split("\n")
                         for f in (read_original_function(tree, name), read_mutant_function(tree, name)))
        diffs[name] = "\n".join(line for line in difflib.unified_diff(before, after, lineterm="")
                                 if line[:1] in "+-" and not line.startswith(("+++", "---")))
    return diffs


def _file(module: str) -> str:
    return f"pipeline/{module.replace('.', '/')}.py"


def _which(module: str, mutants: str) -> str:
    """A run's mutants as the report shows them: all, survivors, or the functions of its name patterns."""
    if mutants in ("all", "survivors", "unfinished"):
        return mutants
    if mutants.startswith("unfinished "):
        return "unfinished mutants of " + _which(module, mutants.removeprefix("unfinished "))
    prefix = f"pipeline.{module}."
    names = [p.removeprefix(prefix).removesuffix("__mutmut_*").removeprefix("x_") for p in mutants.split()]
    return "functions " + ", ".join(f"`{n}`" for n in names)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def read_runs(path: Path = RUNS) -> list[dict[str, str]]:
    """The runs `make mutants` logged: module, which mutants, start (epoch s), wall seconds, command, commit."""
    if not path.exists():
        return []
    runs = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 6:
            continue
        module, mutants, start, wall, command, commit = parts
        started = dt.datetime.fromtimestamp(int(start), dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        seconds = int(wall)
        runs.append({"module": module, "mutants": mutants, "started": started,
                     "wall": f"{seconds // 60} min {seconds % 60:02d} s", "command": command, "commit": commit})
    return runs


def _run_info() -> dict[str, Any]:
    from importlib.metadata import version

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stats = MUTANTS_DIR / "mutmut-stats.json"
    return {"mutmut": version("mutmut"), "commit": head or "unknown",
            "stats_time": json.loads(stats.read_text()).get("stats_time") if stats.exists() else None,
            "written": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "runs": read_runs()}


def before_score(baseline: dict[str, Any], now: ModuleResult) -> float | None:
    """The baseline run's score over the same mutants as today's (today's equivalent ones left out)."""
    scored = baseline["made"] - baseline["not_run"] - now.equivalent
    return (baseline["killed"] + baseline["timeout"]) / scored if scored > 0 else None


def render(results: dict[str, ModuleResult], equivalent: dict[str, str], baseline: dict[str, Any] | None,
           diffs: dict[str, str], info: dict[str, Any]) -> str:
    before = (baseline or {}).get("modules", {})
    lines = [
        "# Mutation testing of the core",
        "",
        f"Written by `python -m pipeline.mutation_report` ({info['written']}, commit {info['commit']}, "
        f"mutmut {info['mutmut']}) from the verdicts of the runs below, kept in `reports/mutation-verdicts.json` "
        "(mutmut's own `mutants/` lives only as long as a machine); a verdict counts while its function's source "
        "is what it was when the verdict was made (mutmut's hash of it), else the mutant counts as not run. "
        "pyproject.toml `[tool.mutmut]` selects the test files of the core without the end-to-end federated and "
        "training runs, the subprocess command-line tests and the real-data counts; mutmut runs, for each mutant, "
        "only the selected tests that reach the mutated function (fastest first, stopping at the first failure), "
        "each mutant in a fresh process forked from a server that has imported the tests. A mutant only an "
        "end-to-end run would catch counts as undetected: the scores are lower bounds.",
        "",
        "Score = (killed + timed out) / (made - equivalent - not run); a \"no tests\" mutant (no selected test "
        f"reaches its function) counts as not detected. Goal: {_pct(GOAL)} per module.",
        "",
        "| module | made | killed | survived | timed out | no tests | other | not run | equivalent | score "
        "| before new tests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for module in CORE:
        r = results.get(module)
        if r is None:
            lines.append(f"| {_file(module)} | not generated | | | | | | | | | |")
            continue
        lines.append(f"| {_file(module)} | {r.made} | {r.killed} | {r.survived} | {r.timeout} | {r.no_tests} | "
                     f"{r.other} | {r.not_run} | {r.equivalent} | {_pct(r.score)}{' (part run)' if 0 < r.not_run < r.made else ''} | "
                     f"{_pct(before_score(before.get(module), r)) if before.get(module) else '-'} |")
    runs = info.get("runs") or []
    if runs:
        lines += ["", "Runs (`reports/mutation-runs.tsv`, written by `make mutants`, one line per module and run: a single mutmut "
                  "run over the survivors of several modules is listed under each; \"stopped early\": interrupted "
                  "to add tests, its verdicts kept; wall time on a 2-core machine shared with other work):", "", "| module | mutants run | started (UTC) | wall | command | commit |",
                  "|---|---|---|---:|---|---|"]
        for r in runs:
            lines.append(f"| {_file(r['module'])} | {_which(r['module'], r['mutants'])} | {r['started']} | {r['wall']} | `{r['command']}` | "
                         f"{r['commit']} |")
    if before:
        lines += ["", "Baseline (\"before new tests\") runs, each with the tests of its commit: " + "; ".join(
            f"`{_file(m)}`: {b['run'].get('tests') or 'saved ' + b['run']['written'] + ' at commit ' + b['run']['commit']}"
            for m, b in before.items() if "run" in b)
            + ". The survivors of each were then re-run with the new tests (`make mutants MUTANTS=survivors`)."]
    partly = [m for m in CORE if m in results and 0 < results[m].not_run < results[m].made]
    if partly:
        lines += ["", "Scope of the modules run in part (the score counts only the mutants run):", ""]
        for m in partly:
            fns = results[m].functions
            done = [f"`{f}` ({n})" for f, (n, left) in fns.items() if n and not left]
            some = [f"`{f}` ({n} of {n + left})" for f, (n, left) in fns.items() if n and left]
            none = [f"`{f}` ({left})" for f, (n, left) in fns.items() if not n]
            lines.append(f"- `{_file(m)}`: {results[m].made - results[m].not_run} of {results[m].made} mutants run"
                         + (f"; every mutant of {', '.join(done)}" if done else "")
                         + (f"; part of {', '.join(some)}" if some else "")
                         + (f"; not run: {', '.join(none)}" if none else "") + ".")
    not_reached = [m for m in CORE if m not in results or results[m].not_run == results[m].made]
    if not_reached:
        lines += ["", "Not run yet: " + ", ".join(f"`{_file(m)}`" for m in not_reached) + "."]
    for module in CORE:
        r = results.get(module)
        if r is None or not r.undetected:
            continue
        earlier = set((before.get(module) or {}).get("undetected", []))
        lines += ["", f"## {_file(module)}: mutants no test detects", ""]
        for name in r.undetected:
            verdict = f"equivalent: {equivalent[name]}" if name in equivalent else "**not killed**"
            lines += [f"- `{name}`: {verdict}", "", "  ```diff",
                      *[f"  {line}" for line in diffs.get(name, "").splitlines()], "  ```"]
        killed_now = sorted(earlier - set(r.undetected), key=_natural)
        if killed_now:
            lines += ["", f"Killed by the new tests ({len(killed_now)} that survived the baseline run): "
                      + ", ".join(f"`{n.rpartition('.')[2]}`" for n in killed_now) + "."]
    for module in CORE:
        r = results.get(module)
        b = before.get(module)
        if r is None or not b:
            continue
        killed_now = sorted(set(b.get("undetected", [])) - set(r.undetected), key=_natural)
        if killed_now and not r.undetected:
            lines += ["", f"## {_file(module)}", "", f"Killed by the new tests ({len(killed_now)} that survived the "
                      "baseline run): " + ", ".join(f"`{n.rpartition('.')[2]}`" for n in killed_now) + "."]
    return "\n".join(lines) + "\n"


def baseline_record(results: dict[str, ModuleResult], info: dict[str, Any],
                    earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The baseline with the modules run since it was last saved added; a module already in it keeps its
    "before" numbers (modules are run one at a time, each baselined before its new tests)."""
    modules = dict((earlier or {}).get("modules", {}))
    for m, r in results.items():
        if m not in modules and r.not_run < r.made:
            modules[m] = {**asdict(r), "score": r.score, "run": {k: v for k, v in info.items() if k != "runs"}}
    return {"modules": modules}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restore", action="store_true",
                    help=f"write the verdicts kept in {VERDICTS} into {MUTANTS_DIR}/ (before `mutmut run`)")
    ap.add_argument("--save-baseline", action="store_true",
                    help=f"add the modules run since the last save to {BASELINE} (their 'before' verdicts)")
    ap.add_argument("--survivors", metavar="MODULE", help="print the names of MODULE's undetected mutants")
    ap.add_argument("--unfinished", metavar="MODULE",
                    help="print the names of MODULE's undetected and not yet run mutants")
    ap.add_argument("--match", nargs="*", default=None, metavar="PATTERN",
                    help="with --unfinished: only the names matching one of these mutmut name patterns")
    args = ap.parse_args(argv)
    equivalent = load_equivalent()
    kept = merge(load_kept(), read_meta())
    if args.restore:
        print(f"restored {restore(kept)} verdicts from {VERDICTS} into {MUTANTS_DIR}/")
        return 0
    if args.survivors or args.unfinished:
        module = args.survivors or args.unfinished
        codes, _ = in_force(kept, {module: current_mutants(module)} if module in CORE else {})
        if module not in codes:
            raise SystemExit(f"error: no verdicts for pipeline.{module} in {VERDICTS} or {MUTANTS_DIR}/")
        if args.survivors:
            names = [n for n in collect({module: codes[module]})[module].undetected if n not in equivalent]
        else:
            names = unfinished(codes[module], equivalent)
            if args.match:
                names = [n for n in names if any(fnmatch.fnmatch(n, p) for p in args.match)]
        print("\n".join(names))
        return 0
    today = {m: current_mutants(m) for m in CORE}
    codes, dropped = in_force(kept, today)
    results = collect(codes, equivalent)
    info = _run_info()
    if args.save_baseline:
        earlier = json.loads(BASELINE.read_text()) if BASELINE.exists() else None
        atomic.write_json(BASELINE, baseline_record(results, info, earlier))
        print(f"wrote {BASELINE}")
        return 0
    save_kept(kept)
    for m, n in dropped.items():
        if n:
            print(f"note: {n} kept verdict(s) of pipeline.{m} no longer count: their functions changed since",
                  file=sys.stderr)
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else None
    diffs = {n: d for m, r in results.items() for n, d in mutant_diffs(today[m], r.undetected).items()}
    detected = {n for m in results for n, c in codes[m].items() if status(c) in ("killed", "timeout")}
    stale = sorted(set(equivalent) & detected)
    if stale:  # an "equivalent" mutant that some test now kills: its reason was wrong or the code changed
        print(f"note: {len(stale)} mutant(s) in {EQUIVALENT} are detected now: {stale[:5]}", file=sys.stderr)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(REPORT, render(results, equivalent, baseline, diffs, info))
    for m, r in results.items():
        print(f"{m:18s} made {r.made:4d}  detected {r.detected:4d}  undetected {len(r.undetected) - r.equivalent:4d}"
              f"  equivalent {r.equivalent:3d}  not run {r.not_run:4d}  score {_pct(r.score)}")
    print(f"wrote {VERDICTS} and {REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
