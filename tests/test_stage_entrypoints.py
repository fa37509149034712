"""Every stage module can run as ``python -m pipeline.<stage>``: the ``__main__`` block must not rebind a
module-level function (``from pipeline.common.cli import run`` once shadowed postag's ``run()``, and the stage
crashed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PIPELINE = Path(__file__).resolve().parents[1] / "pipeline"
STAGES = sorted(p for p in PIPELINE.glob("*.py") if "__main__" in p.read_text())


def _main_block_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {a.asname or a.name.split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.stem)
def test_main_block_does_not_shadow_module_functions(path):
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not (_main_block_names(tree) & defined), f"{path.name}: __main__ rebinds {_main_block_names(tree) & defined}"


def test_every_dvc_stage_module_has_a_main_block():
    # STAGES is what the glob finds with a __main__ block: a stage module that lost its block would drop out of the
    # check above (and `python -m` would import it and do nothing) while the test still passed.
    ran = set(re.findall(r"python -m pipeline\.(\w+)", (PIPELINE.parent / "dvc.yaml").read_text()))
    assert len(ran) == 10 and not ran - {p.stem for p in STAGES}, sorted(ran - {p.stem for p in STAGES})


def test_the_check_sees_a_shadowing_block():
    tree = ast.parse("def run():\n    pass\nif __name__ == '__main__':\n    from pipeline.common.cli import run\n")
    assert _main_block_names(tree) == {"run"}


def _python(code: str) -> list[str]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PIPELINE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_a_stage_process_freezes_its_imports_and_at_exit_what_it_made_and_keeps_collecting():
    """``cli.run`` from a stage's command line (no argv): the imports' objects are frozen, so no full collection
    scans them again; at exit what the work made is frozen too (no collection passes over it before the process
    ends); the collector stays on. Called with an argv (in-process: tests) it freezes nothing."""
    made = 200_000
    counts = _python(
        "import atexit, gc\n"
        "atexit.register(lambda: print(gc.get_freeze_count()))  # registered first: runs after cli.run's handler\n"
        "from pipeline.common.cli import run\n"
        "run(lambda argv: print(gc.get_freeze_count(), int(gc.isenabled())), [])\n"
        "kept = []\n"
        "run(lambda argv: print(gc.get_freeze_count(), int(gc.isenabled()))\n"
        f"    or kept.extend([] for _ in range({made})))\n"
    )
    in_process, enabled, frozen, enabled_after, at_exit = map(int, counts)
    assert in_process == 0 and enabled == enabled_after == 1
    assert frozen > 10_000  # the interpreter's and the imports' objects
    assert at_exit - frozen > 0.99 * made  # the work's lists (containers the collector tracks); a few others ended


@pytest.mark.parametrize(
    ("stage", "params", "named"),
    [
        ("backbone", {"backbone": {"warmup": {"steps": "many"}}}, "backbone.warmup.steps: expected "),
        ("examples", {"examples": {"link_min_jaccard": "high"}}, "examples.link_min_jaccard: expected "),
        ("postag", {"postag": {"batch_size": "big"}}, "postag.batch_size: expected "),
        ("postag", {"model": {"max_target_length": "long"}}, "model.max_target_length: expected "),
        # the backbone stage's own checks of its group and of the examples group it reads
        ("backbone", {"ingest": {"datasets": ["qmsum"]}}, "backbone.warmup.dataset='samsum' is not ingested"),
        (
            "backbone",
            {"backbone": {"warmup": {"dataset": "ami"}}, "ingest": {"datasets": ["ami", "qmsum"]}},
            "backbone.warmup.dataset='ami' trains on meetings that ['qmsum'] test on",
        ),
        ("backbone", {"ingest": {"datasets": ["samsum"]}, "examples": {"sep_token": None}}, "examples.sep_token: "),
    ],
)
def test_a_bad_value_of_a_stage_group_is_one_line_naming_the_params_file(tmp_path, capsys, stage, params, named):
    """The stage reads `--params` (a study's or a site's file, not always ./params.yaml): its line named the key
    only (`backbone.warmup.steps: ...`), so which file held the bad value was left to guess; evaluate names it."""
    import importlib

    import yaml

    from pipeline.common.cli import run as run_cli

    (path := tmp_path / "study" / "site.yaml").parent.mkdir()
    path.write_text(yaml.safe_dump(params))
    assert run_cli(importlib.import_module(f"pipeline.{stage}").main, ["--params", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path} {named}"), err


@pytest.mark.parametrize(
    "record",
    [
        {"experiment": "x", "clients": [], "mean": {}},  # not the shape the evaluate stage writes
        {"experiment": "x", "clients": {}, "mean": 5},
        {"experiment": "x", "clients": {"A": {"rouge1": 20.0}}, "mean": {"rouge1": 20.0}},  # a record without avg_rouge
    ],
)
def test_import_eval_of_a_malformed_record_is_one_line_before_any_mlflow_run(tmp_path, monkeypatch, capsys, record):
    # It was a TypeError or KeyError traceback from inside the MLflow logging, after a run of the record was opened
    # (left RUNNING in the store).
    import json

    from pipeline.common.cli import run as run_cli
    from pipeline.evaluate import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (path := tmp_path / "metrics.json").write_text(json.dumps(record))
    assert run_cli(main, ["import-eval", str(path)]) == 2
    assert f"{path}: not an evaluation record" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything was logged


@pytest.mark.parametrize("score", ["n/a", True, [20.0]])
def test_import_eval_of_a_record_with_a_score_that_is_no_number_is_one_line_before_any_mlflow_run(
    tmp_path, monkeypatch, capsys, score
):
    # A hand-edited record whose client ROUGE-2 is 'n/a': float()'s ValueError from inside the MLflow logging, the
    # record's run and its client runs left RUNNING in the store (a true was logged as 1.0).
    import json

    from pipeline.common.cli import run as run_cli
    from pipeline.evaluate import main
    from pipeline.results.scoring import SCORE_KEYS

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    scores = dict.fromkeys(SCORE_KEYS, 20.0)
    record = {"experiment": "x", "clients": {"A": scores | {"rouge2": score}}, "mean": scores}
    (path := tmp_path / "metrics.json").write_text(json.dumps(record))
    assert run_cli(main, ["import-eval", str(path)]) == 2
    assert f"{path}: not an evaluation record" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything was logged
