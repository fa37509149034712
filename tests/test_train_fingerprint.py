"""Training's fingerprint is training: what DVC hashes for a train stage holds no reporting, CLI, study description
or evaluation code, so editing one of those files reruns no training (issue 30, item 2)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from tests.test_dvc_layout import import_closure

ROOT = Path(__file__).resolve().parents[1]
# Reporting, run-profile CLI, study descriptions and evaluation (decoding, scoring, reading results).
NOT_TRAINING = ("pipeline/results/studies.py", "pipeline/presets.py", "pipeline/results/scoring.py",
                "pipeline/results/evaluation.py", "pipeline/results/readers.py", "pipeline/modeling/generation.py",
                "pipeline/report.py", "pipeline/analyze.py")


def _train_stages() -> dict[str, list[str]]:
    """Every train stage DVC runs (the foreach resolved by DVC itself) with the paths of its deps."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = [s for s in repo.index.stages if getattr(s, "name", "").startswith("train@")]
        return {s.name: [str(Path(d.def_path)) for d in s.deps] for s in stages}


@pytest.fixture(scope="module")
def train_stages() -> dict[str, list[str]]:
    return _train_stages()


def test_every_experiment_has_a_train_stage(train_stages):
    experiments = yaml.safe_load((ROOT / "params.yaml").read_text())["experiments"]
    assert set(train_stages) == {f"train@{name}" for name in experiments}


@pytest.mark.parametrize("path", NOT_TRAINING)
def test_an_edit_of_reporting_or_evaluation_code_changes_no_train_stage_deps(train_stages, path):
    # DVC decides whether a stage reruns from the hashes of its deps: a file that is none of them can change
    # without `dvc status` reporting any train stage.
    assert (ROOT / path).exists()
    for stage, deps in train_stages.items():
        assert path not in deps, stage
    # ...and the deps are honest: the file is outside what `python -m pipeline.train` can import
    assert path not in import_closure("pipeline.train")


def test_train_stage_deps_are_its_import_closure(train_stages):
    closure = import_closure("pipeline.train")
    assert "pipeline/train.py" in closure and "pipeline/training/client_training.py" in closure
    for stage, deps in train_stages.items():
        assert {d for d in deps if d.startswith("pipeline/")} == closure, stage


def test_the_deployed_client_app_keeps_federated_evaluation_outside_training():
    # the ClientApp `flwr run` loads answers query.summarize; the train stage's client app module does not score
    components = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    module, _, attr = components["clientapp"].partition(":")
    assert "pipeline/federation/client_app.py" in import_closure("pipeline.train")
    assert module.replace(".", "/") + ".py" not in import_closure("pipeline.train")
    assert "pipeline/results/scoring.py" in import_closure(module)
    import importlib

    app = getattr(importlib.import_module(module), attr)
    assert "query.summarize" in app._registered_funcs and "train.default" in app._registered_funcs
