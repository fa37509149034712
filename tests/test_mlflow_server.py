"""A second machine's view: a tiny training and its evaluation log to a real `mlflow server` over HTTP.

Starts ``mlflow server`` (SQLite backend, ``--artifacts-destination``, artifacts proxied) in a tmp dir on a free
port (bounded wait; the process group is always killed), trains and evaluates two tiny experiments with
``MLFLOW_TRACKING_URI=http://127.0.0.1:PORT``, then finds through ``/api/2.0/mlflow/...`` alone the runs, their
tags, per-round and evaluation metrics (with intervals) and their adapters, stored in the server's artifact
destination; and, with ``mlflow.search_logged_models``, a client's adapter by its test score. Marked
``integration`` (``.ci/run`` runs it with the rest of ``make test``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from tests.test_federated import workspace, write_plan  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

# Bounded wait for the server (a few seconds when idle; generous for a loaded 2-core CI box);
# FEDMEET_MLFLOW_SERVER_TIMEOUT raises it further.
STARTUP_TIMEOUT_S = float(os.environ.get("FEDMEET_MLFLOW_SERVER_TIMEOUT", "90"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def post(url: str, body: dict, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--artifacts-destination",
        str(tmp_path / "served-artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # No background job runner: it is not needed here and would be one more process to start and stop.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with code {proc.returncode}: {log_path.read_text()[-500:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"mlflow server did not answer {url}/health within {STARTUP_TIMEOUT_S:.0f} s "
                    f"(FEDMEET_MLFLOW_SERVER_TIMEOUT raises the wait): {log_path.read_text()[-500:]}"
                )
            time.sleep(0.3)
        yield url
    finally:
        # The server forks uvicorn workers: stop the whole process group we started.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def ws(workspace, mlflow_server, monkeypatch):  # noqa: F811
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("FEDMEET_ROOT", str(workspace))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    for var in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(var, raising=False)
    return workspace


# Starting an MLflow server takes ~15 s on an idle 2-core machine (its fixture waits up to STARTUP_TIMEOUT_S).
@pytest.mark.timeout(300)
def test_tiny_training_and_evaluation_reach_the_server(ws, mlflow_server, tmp_path):
    """As a second machine does: train and evaluate with MLFLOW_TRACKING_URI=http://HOST:PORT, then find the runs,
    their per-round and evaluation metrics and their adapters through the server alone."""
    from pipeline.results.evaluation import EvaluateConfig
    from pipeline.results.experiment_evaluation import evaluate_experiments
    from pipeline.results.stats import BootstrapConfig
    from pipeline.train import run_experiment

    runs = {"srv-fedavg": "fedavg", "srv-selectkd": "fedselectkd"}
    for name, method in runs.items():
        run_experiment(write_plan(name, method))
        evaluate_experiments(
            [name],
            EvaluateConfig(
                num_beams=1,
                max_target_length=8,
                min_target_length=2,
                batch_size=2,
                log_text_to_mlflow=(method == "fedselectkd"),
            ),
            eval_dir=tmp_path / "eval",
            bootstrap=BootstrapConfig(n_resamples=200),
        )

    api = f"{mlflow_server}/api/2.0/mlflow"
    exp = get(f"{api}/experiments/get-by-name?experiment_name=tests")["experiment"]
    exp_tags = {t["key"]: t["value"] for t in exp["tags"]}
    assert exp_tags["mlflow.experimentKind"] == "custom_model_development"  # opens in the runs table
    # The server chose the location: artifacts go through its proxy, not to this machine's mlartifacts/.
    assert exp["artifact_location"].startswith("mlflow-artifacts:")
    found = post(
        f"{api}/runs/search",
        {
            "experiment_ids": [exp["experiment_id"]],
            "filter": "tags.experiment LIKE 'srv-%'",
            "order_by": ["attributes.run_name ASC"],
        },
    )["runs"]
    assert [r["info"]["run_name"] for r in found] == ["srv-fedavg", "srv-selectkd"]
    served = tmp_path / "served-artifacts"  # the server fixture's --artifacts-destination (same tmp_path)
    for run, (name, method) in zip(found, runs.items()):
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["method"] == method and tags["experiment"] == name and len(tags["plan_hash"]) == 64
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        local = json.loads((tmp_path / "eval" / name / "metrics.json").read_text())
        for label, key in (
            ("ROUGE-1", "rouge1"),
            ("ROUGE-2", "rouge2"),
            ("ROUGE-L", "rougeL"),
            ("avg_ROUGE", "avg_rouge"),
        ):
            value = metrics[f"client_avg/{label}"]
            assert value == pytest.approx(local["mean"][key])
            # each client has one test example: no interval (docs/statistics.md), none logged; an interval's metrics:
            # tests/test_tracking.py, through the same log_to_mlflow
            assert key not in local["mean_ci"] and f"client_avg/{label}_ci_low" not in metrics
        children = post(
            f"{api}/runs/search",
            {
                "experiment_ids": [exp["experiment_id"]],
                "filter": f"tags.`mlflow.parentRunId` = '{run['info']['run_id']}'",
            },
        )["runs"]
        academic = [c for c in children if {"key": "client", "value": "Academic"} in c["data"]["tags"]]
        query = urllib.parse.urlencode({"run_id": academic[0]["info"]["run_id"], "metric_key": "val_loss"})
        history = get(f"{api}/metrics/get-history?{query}")["metrics"]
        assert sorted(m["step"] for m in history) == [1, 2]  # one point per round, in the client's run
        query = urllib.parse.urlencode({"run_id": run["info"]["run_id"], "path": "adapters/Academic"})
        files = {f["path"] for f in get(f"{api}/artifacts/list?{query}").get("files", [])}
        assert files == {"adapters/Academic/adapter_best.safetensors", "adapters/Academic/adapter_final.safetensors"}
        # The bytes live in the server's --artifacts-destination, and nothing went to the client's mlartifacts/.
        assert list(served.rglob(f"{run['info']['run_id']}/artifacts/adapters/Academic/adapter_best.safetensors"))
        assert not list((ws / "mlartifacts").rglob(run["info"]["run_id"]))
        query = urllib.parse.urlencode({"run_id": run["info"]["run_id"], "path": "eval"})
        files = {f["path"] for f in get(f"{api}/artifacts/list?{query}").get("files", [])}
        assert "eval/metrics.json" in files
        assert ("eval/predictions.jsonl" in files) is (method == "fedselectkd")  # text only where asked for


@pytest.mark.timeout(300)
def test_an_adapter_is_found_by_its_score_on_the_server(ws, mlflow_server, tmp_path):
    """The clients' best adapters are LoggedModels of the server's store, each with its evaluation's ROUGE: the one
    above a score is found with mlflow.search_logged_models and downloaded through the server."""
    import mlflow
    from safetensors.torch import load_file

    from pipeline.experiments.plans import read_plan
    from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow
    from pipeline.train import run_experiment

    run_experiment(write_plan("srv-scored", "fedavg"))
    # Tiny untrained models score 0 everywhere: the evaluation record gives each client a score of its own.
    avg = {"Academic": 12.0, "Committee": 31.0, "Product": 20.0}
    clients = {
        c: {k: v for k in ("rouge1", "rouge2", "rougeL", "rougeLsum", "avg_rouge")} | {"n": 2} for c, v in avg.items()
    }
    record = {"experiment": "srv-scored", "clients": clients, "mean": {k: 21.0 for k in clients["Academic"]}}
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "metrics.json").write_text(json.dumps(record))
    plan = read_plan("models/plans/srv-scored.json").to_json_dict()
    log_to_mlflow(plan, record, tmp_path / "eval", EvaluateConfig())

    mlflow.set_tracking_uri(mlflow_server)
    exp = mlflow.get_experiment_by_name("tests").experiment_id
    [best] = mlflow.search_logged_models(
        experiment_ids=[exp],
        output_format="list",
        filter_string="tags.experiment = 'srv-scored' AND metrics.avg_rouge > 25",
    )
    assert best.tags["client"] == "Committee" and best.name == "srv-scored-Committee"
    ranked = mlflow.search_logged_models(
        experiment_ids=[exp],
        filter_string="tags.experiment = 'srv-scored'",
        order_by=[{"field_name": "metrics.avg_rouge", "ascending": False}],
        output_format="list",
    )
    assert [m.tags["client"] for m in ranked] == ["Committee", "Product", "Academic"]
    folder = mlflow.artifacts.download_artifacts(f"models:/{best.model_id}", dst_path=str(tmp_path / "best"))
    got = load_file(f"{folder}/adapters/Committee/adapter_best.safetensors")
    want = load_file("models/srv-scored/clients/Committee/adapter_best.safetensors")
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
