"""tools/mutation/report.py: verdict counts and scores from mutmut's meta files (a synthetic mutants/ dir).
A developer tool, so full lane only (marker `tools`)."""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path

import pytest

from tools.mutation import report

pytestmark = pytest.mark.tools


def _meta(root, module: str, codes: dict[int, int | None]) -> None:
    meta = root / "pipeline" / f"{module.replace('.', '/')}.py.meta"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(
        json.dumps({"exit_code_by_key": {f"pipeline.{module}.x_f__mutmut_{i}": c for i, c in codes.items()}})
    )


def test_counts_score_and_survivors_in_mutmut_order(tmp_path):
    # 1, 3: killed; 36: timeout; 0: survived; 33: no test reaches it; 35: suspicious; None: not run yet
    _meta(tmp_path, "modeling.losses", {10: 1, 2: 3, 3: 36, 4: 0, 11: 0, 6: 33, 7: 35, 8: None, 9: 1})
    r = report.collect(tmp_path)["modeling.losses"]
    assert r.made == 9 and r.counts["killed"] == 3 and r.counts["not run"] == 1
    assert r.score == pytest.approx(4 / 8)  # killed + timeout over the mutants run
    assert [n.rpartition("_")[2] for n in r.undetected] == ["4", "6", "7", "11"]
    assert "federation.strategies" not in report.collect(tmp_path)  # never generated: absent


def test_survivor_names_and_exit_2_without_results(tmp_path, capsys):
    assert report.main(["--mutants-dir", str(tmp_path)]) == 2
    _meta(tmp_path, "results.stats", {1: 1, 2: 0})
    assert report.main(["--mutants-dir", str(tmp_path), "--survivors"]) == 0
    assert capsys.readouterr().out.split() == ["pipeline.results.stats.x_f__mutmut_2"]


def test_the_committed_mutation_table_adds_up():
    """reports/mutation.md is the report's own table (`make mutants`): each row's verdicts add up to the mutants
    made, and its score is (killed + timeout) / (made - not run), n/a where none ran; it names the commit."""
    text = (Path(__file__).resolve().parents[1] / "reports/mutation.md").read_text(encoding="utf-8")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| pipe")]
    assert {r[0] for r in rows} >= {"pipeline/results/stats.py", "pipeline/training/stopping.py"}
    for module, made, killed, timeout, survived, no_tests, other, not_run, score, measured in rows:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC, [0-9a-f]{7,}", measured), module  # when, at which commit
        counts = [int(x) for x in (killed, timeout, survived, no_tests, other, not_run)]
        assert sum(counts) == int(made), module
        ran = int(made) - int(not_run)
        assert score == (f"{100 * (int(killed) + int(timeout)) / ran:.1f} %" if ran else "n/a"), module


def test_a_package_is_read_file_by_file(tmp_path, capsys):
    # federation.strategies is a folder (strategies/*.py): its files' meta, one row each; an __init__ is no row
    _meta(tmp_path, "federation.strategies.fednova", {1: 1, 2: 0})
    _meta(tmp_path, "federation.strategies.fedavg", {})
    _meta(tmp_path, "federation.strategies.__init__", {})
    got = report.collect(tmp_path)
    assert sorted(got) == ["federation.strategies.fedavg", "federation.strategies.fednova"]
    assert got["federation.strategies.fednova"].undetected == ["pipeline.federation.strategies.fednova.x_f__mutmut_2"]
    assert got["federation.strategies.fedavg"].made == 0 and got["federation.strategies.fedavg"].score is None
    out = tmp_path / "summary.md"
    assert report.main(["--mutants-dir", str(tmp_path), "--summary", str(out)]) == 0
    table = out.read_text()
    assert "| pipeline/federation/strategies/fednova.py | 2 | 1 | 0 | 1 | 0 | 0 | 0 | 50.0 % | " in table
    assert "| pipeline/federation/strategies/fedavg.py | 0 | 0 | 0 | 0 | 0 | 0 | 0 | n/a | " in table


def test_a_run_of_one_module_keeps_the_other_modules_rows(tmp_path, monkeypatch):
    """`make mutants MODULES=x` runs x's mutants only: mutmut leaves every other core module's "not run", and the
    summary replaced their measured rows with rows of "not run" (a session restored them from git by hand). A
    module this run did not run keeps its last row; a module it ran gets its new one."""
    monkeypatch.setattr(report, "_commit", lambda: "abcdef1")
    out = tmp_path / "summary.md"
    _meta(tmp_path, "results.stats", {1: 1, 2: 0})
    _meta(tmp_path, "training.stopping", {1: None, 2: None})
    old_stopping = (
        "| pipeline/training/stopping.py | 2 | 2 | 0 | 0 | 0 | 0 | 0 | 100.0 % | 2026-01-01 00:00 UTC, 1234567 |"
    )
    old_stats = "| pipeline/results/stats.py | 2 | 0 | 0 | 0 | 0 | 0 | 2 | n/a | 2026-01-01 00:00 UTC, 1234567 |"
    out.write_text(f"# old\n\n{old_stopping}\n{old_stats}\n")
    assert report.main(["--mutants-dir", str(tmp_path), "--summary", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| pipeline/")]
    assert old_stopping in rows and old_stats not in rows  # stopping: not run now; stats: run now
    stats = next(r for r in rows if "stats" in r)
    assert stats.startswith("| pipeline/results/stats.py | 2 | 1 | 0 | 1 | 0 | 0 | 0 | 50.0 % | ")
    assert stats.endswith(", abcdef1 |")


def test_a_rewritten_summary_keeps_the_notes_below_its_table_and_the_rows_of_modules_without_mutants(
    tmp_path, monkeypatch
):
    """The summary was written as the table alone: the hand-written notes below it (which runs each row took, where
    the survivors' verdicts are) were lost, and a module mutmut makes no mutants of (a decorated file) got a new
    measured stamp though nothing of it was measured (this session's helper restored both by hand)."""
    monkeypatch.setattr(report, "_commit", lambda: "abcdef1")
    out = tmp_path / "summary.md"
    _meta(tmp_path, "results.stats", {1: 1, 2: 0})
    _meta(tmp_path, "federation.strategies.fedavg", {})
    old_fedavg = (
        "| pipeline/federation/strategies/fedavg.py | 0 | 0 | 0 | 0 | 0 | 0 | 0 | n/a | 2026-01-01 00:00 UTC, 1234567 |"
    )
    notes = "The stats row: see 1234567.\n\n| a table | in the notes |\n|---|---|\n\nLast line."
    out.write_text(f"# old\n\nintro\n\n{old_fedavg}\n\n{notes}\n")
    assert report.main(["--mutants-dir", str(tmp_path), "--summary", str(out)]) == 0
    text = out.read_text()
    assert text.endswith(f"\n\n{notes}\n") and text.count("The stats row") == 1
    rows = [line for line in text.splitlines() if line.startswith("| pipeline/")]
    assert rows[0] == old_fedavg and rows[1].endswith(", abcdef1 |") and len(rows) == 2
    # rewritten again: the same file but for the new row's stamp (the notes not doubled, nor the table taken for notes)
    assert report.main(["--mutants-dir", str(tmp_path), "--summary", str(out)]) == 0
    assert _unstamped(out.read_text()) == _unstamped(text)
    # a first summary (no file yet): the table alone, with a measured row for the module without mutants
    fresh = tmp_path / "fresh.md"
    assert report.main(["--mutants-dir", str(tmp_path), "--summary", str(fresh)]) == 0
    lines = fresh.read_text().splitlines()
    assert lines[-1].startswith("| pipeline/results/stats.py |")
    assert lines[-2].startswith("| pipeline/federation/strategies/fedavg.py | 0 |") and lines[-2].endswith(
        ", abcdef1 |"
    )


def _unstamped(text: str) -> str:
    return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC, abcdef1", "STAMP", text)


def test_mutmuts_copy_holds_every_local_package_its_tests_import():
    # `make mutants` runs the selected tests inside mutmut's copy (mutants/): source_paths, tests/ and also_copy only.
    # tests/test_compression imports benchmarks.communication, which the copy lacked: every mutant "failed to collect".
    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    copied = {Path(p).parts[0] for p in [*cfg["source_paths"], *cfg["also_copy"], "tests"]}
    needed = set()
    for test in (t for t in cfg["pytest_add_cli_args_test_selection"] if t.endswith(".py")):
        for node in ast.walk(ast.parse((root / test).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            needed |= {n.split(".")[0] for n in names if (root / n.split(".")[0]).is_dir()}
    assert needed and needed <= copied, f"mutmut's copy lacks {sorted(needed - copied)}: add it to also_copy"


def test_the_report_reads_the_modules_make_mutants_mutates():
    # a module mutmut mutates but the report's CORE lacks is left out of its table (training.stopping was)
    root = Path(__file__).resolve().parents[1]
    only = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]
    mutated = {p.removeprefix("pipeline/").removesuffix(".py").removesuffix("/*").replace("/", ".") for p in only}
    lines = (root / "Makefile").read_text().replace("\\\n", " ").splitlines()  # continued lines joined
    make = next(line for line in lines if line.startswith("MODULES ?="))
    assert set(report.CORE) == mutated == set(make.split("?=")[1].split())
