"""Training's fingerprint is training: what DVC hashes for a train stage holds no reporting, CLI, study description
or evaluation code, so editing one of those files reruns no training (issue 30, item 2)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from tests.test_dvc_layout import expand, extension_modules, import_closure

ROOT = Path(__file__).resolve().parents[1]
# Reporting, run-profile CLI, study descriptions (in evaluation.py) and evaluation (decoding, scoring, reading results).
NOT_TRAINING = (
    "pipeline/presets.py",
    "pipeline/results/scoring.py",
    "pipeline/results/evaluation.py",
    "pipeline/results/readers.py",
    "pipeline/report.py",
    "pipeline/analyze.py",
)


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


def test_train_stage_deps_are_its_import_closure_less_the_extension_modules(train_stages):
    closure = import_closure("pipeline.train")
    assert "pipeline/train.py" in closure and "pipeline/training/client_training.py" in closure
    extensions = extension_modules()
    assert {"pipeline/federation/strategies/fedtrimmedavg.py", "pipeline/modeling/gates/margin.py"} <= extensions
    assert extensions <= closure  # read by training, yet no train stage's dep: its plan carries their hash
    for stage, deps in train_stages.items():
        modules = set().union(*(expand(d) for d in deps if d.startswith("pipeline/")))
        assert modules == closure - extensions, stage
        assert len(deps) < 40, stage  # packages read whole are one folder dep each


def _plans(params) -> dict:
    from pipeline.planning import declared, resolve_plan

    return {exp.name: resolve_plan(exp, params) for exp in declared(params)}


@pytest.mark.parametrize(
    "module, runs",
    [
        ("pipeline.federation.strategies.fedtrimmedavg", lambda plan: False),  # no experiment runs it
        ("pipeline.modeling.gates.margin", lambda plan: False),
        ("pipeline.federation.strategies.fedprox", lambda plan: plan["method"] == "fedprox"),
        ("pipeline.modeling.gates.entropy", lambda plan: plan.get("tau") is not None),  # selective KD's gate
    ],
)
def test_editing_a_strategy_or_gate_changes_exactly_the_plans_of_the_experiments_that_run_it(
    tmp_path, monkeypatch, module, runs
):
    import importlib
    import sys

    from pipeline.common.config import load_params

    params = load_params(str(ROOT / "params.yaml"))
    before = _plans(params)
    importlib.import_module(module)
    edited = tmp_path / "edited.py"
    edited.write_text(Path(sys.modules[module].__file__).read_text() + "# an edit\n")
    monkeypatch.setattr(sys.modules[module], "__file__", str(edited))
    after = _plans(params)
    changed = {name for name in before if after[name] != before[name]}
    assert changed == {name for name, plan in before.items() if runs(plan)}
    assert all(after[name]["extension_md5"][module] != before[name]["extension_md5"][module] for name in changed)


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
