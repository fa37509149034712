"""Real federation: the deployed ServerApp's records, federated evaluation, local SuperLink/SuperNode runs.

The first tests drive ``pipeline.federated:server_app`` (what a SuperLink runs) over the in-process Grid; the
later ones start real ``flower-superlink`` / ``flower-supernode`` processes on 127.0.0.1 (pipeline.federation),
each stopped by its pid. Tiny BART workspace of tests/test_federated.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.test_federated import _final_adapters, workspace, write_plan  # noqa: F401  (fixtures)

pytestmark = pytest.mark.deployment

# Short greedy decoding: the federated and the central path must agree for any settings; these keep it fast.
EVALUATE = {"num_beams": 2, "max_target_length": 8, "min_target_length": 2, "batch_size": 2}


@pytest.fixture
def ws(workspace, monkeypatch):  # noqa: F811
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("FEDMEET_ROOT", str(workspace))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    (workspace / "deploy-params.yaml").write_text(json.dumps({"evaluate": EVALUATE}))  # JSON is YAML
    return workspace


def _serve_inprocess(plan_path: str, **run_config):
    """What a SuperLink does with the app: call server_app with a Grid and the run config."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    from pipeline import client_training
    from pipeline.federated import InProcessGrid, _load_plan, _set_server_identity, client_app, server_app

    names = client_training.client_names(_load_plan(plan_path))
    grid = InProcessGrid(client_app, [{"client-name": n, "plan": plan_path} for n in names])
    _set_server_identity(grid.run.run_id)
    server_app(grid=grid, context=Context(run_id=grid.run.run_id, node_id=SUPERLINK_NODE_ID, node_config={},
                                          state=RecordDict(),
                                          run_config={"plan": plan_path, "params": "deploy-params.yaml",
                                                      **run_config}))
    return grid


# Two full federated runs plus beam-search evaluation: ~18 s idle, several times that on a loaded 2-core machine.
@pytest.mark.timeout(300)
def test_deployed_server_records_like_the_engine_and_clients_evaluate_like_the_stage(ws):
    import mlflow
    from safetensors.torch import load_file

    from pipeline.config import from_dict
    from pipeline.evaluate import EvaluateConfig, evaluate_experiment
    from pipeline.train import run_experiment

    _serve_inprocess(write_plan("dep", "fedselectkd"))
    run_experiment(write_plan("dep-ref", "fedselectkd"))  # the in-process engine, same seed

    # Same adapters as the engine (the seed, not the experiment name, drives every random draw).
    a, b = _final_adapters("dep"), _final_adapters("dep-ref")
    assert a.keys() == b.keys() == {"Academic", "Committee", "Product"}
    for client in a:
        for k in a[client]:
            torch.testing.assert_close(a[client][k], b[client][k])
    rounds, ref_rounds = (json.loads(Path(f"models/{n}/rounds.json").read_text()) for n in ("dep", "dep-ref"))
    assert len(rounds) == len(ref_rounds) == 6  # 2 rounds x 3 clients
    for r, q in zip(rounds, ref_rounds):
        assert (r["round"], r["client"]) == (q["round"], q["client"])
        for key in ("train_loss", "val_loss", "bytes_up", "bytes_down", "weight_share"):
            assert r[key] == pytest.approx(q[key], rel=1e-6), key
    m, q = (json.loads(Path(f"reports/train/{n}/metrics.json").read_text()) for n in ("dep", "dep-ref"))
    for c in m["clients"]:
        assert m["clients"][c]["best_val_loss"] == pytest.approx(q["clients"][c]["best_val_loss"], rel=1e-6)
    assert m["bytes_received"] == q["bytes_received"] > 0

    # The server kept the final aggregate; the server checkpoint is gone (the run finished).
    glob = load_file("models/dep/global_adapter.safetensors")
    assert set(glob) == set(a["Academic"])
    assert not Path("models/dep/checkpoint/server.pt").exists()
    # Clients kept their best adapters, gate logs and round checkpoints on their own disk.
    for c in a:
        assert Path(f"models/dep/clients/{c}/adapter_best.safetensors").exists()
        assert sorted(p.name for p in Path(f"models/dep/clients/{c}/gate_log").iterdir()) == [
            "round001.parquet", "round002.parquet"]
        assert Path(f"models/dep/checkpoint/clients/{c}/round002.safetensors").exists()

    # Federated evaluation = the evaluate stage's central path on the same adapters and test sets.
    fed = json.loads(Path("reports/eval/dep/metrics.json").read_text())
    assert fed["evaluated_on"] == "clients" and fed["failed_clients"] == {}
    central = evaluate_experiment("dep", from_dict(EvaluateConfig, EVALUATE, "test"), mlflow_logging=False)
    assert fed["clients"].keys() == central["clients"].keys() == a.keys()
    for c in central["clients"]:
        for k in ("rouge1", "rouge2", "rougeL", "rougeLsum", "avg_rouge", "n", "n_test"):
            assert fed["clients"][c][k] == pytest.approx(central["clients"][c][k], abs=1e-9), (c, k)
    for k in central["mean"]:
        assert fed["mean"][k] == pytest.approx(central["mean"][k], abs=1e-9)
    assert fed["decoding"] == central["decoding"]
    assert any(v["avg_rouge"] > 0 for v in fed["clients"].values())  # something was actually scored

    # One MLflow run with what the server received: per-round client metrics, test ROUGE, the global adapter.
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["tests"], filter_string="tags.experiment = 'dep'")
    assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED" and runs.iloc[0]["tags.engine"] == "deployment"
    run = runs.iloc[0]
    assert run["metrics.Academic.val_loss"] == pytest.approx(rounds[-3]["val_loss"])
    assert run["metrics.eval.mean.avg_rouge"] == pytest.approx(fed["mean"]["avg_rouge"])
    arts = {f.path for f in mlflow.MlflowClient().list_artifacts(run["run_id"])}
    assert "global_adapter.safetensors" in arts and "rounds.json" in arts


def test_federated_evaluation_every_round_and_a_client_without_test_data(ws, monkeypatch):
    from pipeline import deployment

    calls = []
    real = deployment.federated_evaluate

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(deployment, "federated_evaluate", counting)
    _serve_inprocess(write_plan("dep-every", "fedavg", rounds=3), **{"evaluate-every": 1, "mlflow": False})
    assert len(calls) == 3  # after rounds 1 and 2, then the final evaluation after round 3
    assert all(set(c["clients"]) == {"Academic", "Committee", "Product"} for c in calls)
    assert all(not math.isnan(v["avg_rouge"]) for v in calls[-1]["clients"].values())
