"""Stages `plan` and `train`: what enters each plan file (so DVC reruns only what a change affects), and the
train CLI end to end (outputs, DVC metrics/plots files, MLflow run with adapters as artifacts)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.test_federated import MODEL, TRAIN, workspace, ws  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]

ALL_METHODS = ["single", "centralized", "fedavg", "fedkd", "fedselectkd", "fedprox", "fedopt", "fednova", "hardkd",
               "post_addition", "pre_addition"]
TAU_METHODS = {"fedselectkd", "post_addition", "pre_addition"}


def _params(**top) -> dict:
    experiments = {m: {"method": m, "partition": "domain/seed0", "seed": 0, "study": "s"} for m in ALL_METHODS}
    experiments["tau-2"] = {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "tau",
                            "tau": 2.0}
    params = {"tau": 5.0, "model": dict(MODEL), "train": dict(TRAIN), "experiments": experiments}
    params.update(top)
    return params


def _plans(tmp_path: Path, params: dict, sub: str) -> dict[str, str]:
    from pipeline.plan import write_plans

    out = tmp_path / sub
    write_plans(params, out)
    return {p.stem: p.read_text() for p in sorted(out.glob("*.json"))}


def test_plan_has_tau_only_where_the_result_depends_on_it(tmp_path):
    plans = _plans(tmp_path, _params(), "a")
    for name, text in plans.items():
        plan = json.loads(text)
        assert ("tau" in plan) == (plan["method"] in TAU_METHODS), name
    assert json.loads(plans["fedselectkd"])["tau"] == 5.0
    assert json.loads(plans["tau-2"])["tau"] == 2.0  # the entry's override wins over the top-level tau
    # `dvc exp run -S tau=4`: exactly the plans that use the top-level tau change, tau-2 keeps its own
    changed = _plans(tmp_path, _params(tau=4.0), "b")
    differs = {n for n in plans if plans[n] != changed[n]}
    assert differs == TAU_METHODS


def test_plan_leaves_out_settings_a_method_does_not_read(tmp_path):
    base = _plans(tmp_path, _params(), "a")
    prox = _plans(tmp_path, _params(train={**TRAIN, "proximal_mu": 0.5}), "b")
    assert {n for n in base if base[n] != prox[n]} == {"fedprox"}
    kd = _plans(tmp_path, _params(train={**TRAIN, "kd_lambda": 0.5}), "c")
    assert {n for n in base if base[n] != kd[n]} == {"fedkd", "fedselectkd", "hardkd", "post_addition",
                                                      "pre_addition", "tau-2"}
    rounds = _plans(tmp_path, _params(train={**TRAIN, "rounds": 7}), "d")
    assert {n for n in base if base[n] != rounds[n]} == set(base)  # every method trains for `rounds`
    # the transfer encoding matters to every federated method, never to single/centralized
    federated = set(base) - {"single", "centralized"}
    int8 = _plans(tmp_path, _params(train={**TRAIN, "transfer_dtype": "int8"}), "e")
    assert {n for n in base if base[n] != int8[n]} == federated
    # delta encoding only matters for a lossy encoding (fp32 sends the weights exactly)
    delta32 = _plans(tmp_path, _params(train={**TRAIN, "transfer_delta": True}), "f")
    assert delta32 == base
    delta8 = _plans(tmp_path, _params(train={**TRAIN, "transfer_dtype": "int8", "transfer_delta": True}), "g")
    assert {n for n in int8 if int8[n] != delta8[n]} == federated
    # the FedAvg weighting only matters when a cap makes the trained count differ from |D_i|
    trained = _plans(tmp_path, _params(train={**TRAIN, "weight_by": "trained"}), "h")
    assert trained == base
    capped = _plans(tmp_path, _params(train={**TRAIN, "max_train_examples_per_client": 8}), "i")
    capped_trained = _plans(tmp_path, _params(train={**TRAIN, "max_train_examples_per_client": 8,
                                                     "weight_by": "trained"}), "j")
    assert {n for n in capped if capped[n] != capped_trained[n]} == federated


def test_train_config_rejects_bad_transfer_and_weighting():
    from pipeline.plan import TrainConfig

    for bad, message in [({"transfer_dtype": "bf16"}, "transfer_dtype"), ({"weight_by": "tokens"}, "weight_by"),
                         ({"transfer_delta": "yes"}, "transfer_delta")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**bad)


def test_plan_rejects_bad_entries(tmp_path):
    from pipeline.plan import write_plans

    bad = [
        ({"method": "fedavg", "partition": "domain/seed0", "lr_typo": 1}, "unknown key"),
        ({"method": "fedavg", "partition": "domain/seed0", "tau": 3.0}, "does not use it"),
        ({"method": "fedmagic", "partition": "domain/seed0"}, "unknown method"),
        ({"method": "fedavg", "partition": "domain"}, "<scheme>/seed<k>"),
        ({"partition": "domain/seed0"}, "missing required key"),
    ]
    for entry, message in bad:
        with pytest.raises(ValueError, match=message):
            write_plans({"tau": 5.0, "model": MODEL, "train": TRAIN, "experiments": {"x": entry}}, tmp_path / "p")
    with pytest.raises(ValueError, match="invalid experiment name"):
        write_plans({"tau": 5.0, "train": TRAIN, "experiments": {"plans": {"method": "fedavg",
                                                                            "partition": "domain/seed0"}}},
                    tmp_path / "p")


def test_default_experiments_resolve(tmp_path):
    """Every experiment of the repo's params.yaml makes a valid plan (method, partition, overrides)."""
    from pipeline.plan import read_plan, write_plans

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    written = write_plans(params, tmp_path / "plans")
    assert len(written) == len(params["experiments"]) >= 20
    studies = {read_plan(p).study for p in written}
    assert {"main", "iid", "noniid", "extreme", "sampling", "tau_sweep", "server", "new_client", "hardkd"} <= studies


def test_train_cli_end_to_end(ws):
    import mlflow

    from pipeline import plan as plan_stage
    from pipeline import train as train_stage

    params = _params()
    params["experiments"] = {"cli-selectkd": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0,
                                              "study": "cli"}}
    Path("params.yaml").write_text(yaml.safe_dump(params))
    plan_stage.main(["--params", "params.yaml"])
    train_stage.main(["--experiment", "cli-selectkd"])

    metrics = json.loads(Path("reports/train/cli-selectkd/metrics.json").read_text())
    assert set(metrics["clients"]) == {"Academic", "Committee", "Product"}
    assert metrics["bytes_received"] > 0 and metrics["seconds_per_round"] > 0
    wide = json.loads(Path("reports/train/cli-selectkd/rounds.json").read_text())
    assert [r["round"] for r in wide] == [1, 2]
    assert {"Academic/val_loss", "Committee/kd_fraction", "Product/bytes_up", "val_loss_mean"} <= set(wide[0])
    gate = pd.read_parquet("models/cli-selectkd/gate_log.parquet")
    assert list(gate.columns) == ["client", "round", "example_id", "position", "token_id", "entropy", "kd_applied"]
    assert set(gate["round"]) == {1, 2}
    # KD applied exactly where the teacher's entropy is below tau (5.0)
    assert (gate["kd_applied"] == (gate["entropy"] < 5.0)).all()
    assert json.loads(Path("models/cli-selectkd/experiment.json").read_text())["tau"] == 5.0
    assert Path("reports/timing/train-cli-selectkd.json").exists()
    assert not Path("models/cli-selectkd/checkpoint").exists()

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(experiment_names=["cli"], output_format="list")[0]
    client = mlflow.MlflowClient()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "adapters/Academic")}
    assert artifacts == {"adapters/Academic/adapter_best.safetensors", "adapters/Academic/adapter_final.safetensors"}
    history = client.get_metric_history(run.info.run_id, "Committee.kd_fraction")
    assert [m.step for m in history] == [1, 2]
    assert run.data.params["train.kd_direction"] == "teacher_to_student"  # "(our default)" choices are logged
    # the gate log (client token ids) never goes to MLflow
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert not any("gate_log" in p for p in top)
