"""MLflow for comparison: runs logged by training and evaluation, read back through a real `mlflow server`'s REST API.

Starts ``mlflow server`` on a SQLite store in a tmp dir and a free port (bounded wait; the process group is always
killed), logs two training runs the way the train stage does and their evaluation through
``pipeline.evaluate.log_to_mlflow``, then checks via ``/api/2.0/mlflow/...`` that the study is one MLflow
experiment whose runs carry the names, tags and per-client metrics the compare view lines up.
Skipped, with the reason, when the server does not come up in time.
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

from pipeline.evaluate import EvaluateConfig, log_to_mlflow

# Bounded wait for the server; FEDMEET_MLFLOW_SERVER_TIMEOUT raises it on a slow machine.
STARTUP_TIMEOUT_S = float(os.environ.get("FEDMEET_MLFLOW_SERVER_TIMEOUT", "20"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def post(url: str, body: dict, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
           "--artifacts-destination", str(tmp_path / "served-artifacts"), "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    # No background job runner: it is not needed here and would be one more process to start and stop.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.skip(f"mlflow server exited with code {proc.returncode}: "
                            f"{log_path.read_text()[-500:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.skip(f"mlflow server did not answer {url}/health within {STARTUP_TIMEOUT_S:.0f} s "
                            "(slow or overloaded machine)")
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


def eval_record(tmp_path, name: str, r1: float) -> tuple[dict, object]:
    d = tmp_path / "eval" / name
    d.mkdir(parents=True)
    clients = {c: {"rouge1": r1 + i, "rouge2": 5.0, "rougeL": 15.0, "rougeLsum": 16.0,
                   "avg_rouge": (r1 + i + 5.0 + 16.0) / 3, "n": 4} for i, c in enumerate(("Academic", "Committee"))}
    mean = {k: sum(c[k] for c in clients.values()) / 2 for k in ("rouge1", "rouge2", "rougeL", "rougeLsum", "avg_rouge")}
    metrics = {"experiment": name, "backbone": "tiny-bart", "clients": clients, "mean": mean}
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "predictions.jsonl").write_text(json.dumps({"example_id": "x", "prediction": "private text"}) + "\n")
    return metrics, d


# Starting an MLflow server takes ~15 s on an idle 2-core machine (its fixture waits up to STARTUP_TIMEOUT_S).
@pytest.mark.timeout(300)
def test_runs_line_up_in_the_study_experiment(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("FEDMEET_ROOT", str(tmp_path))  # artifacts under tmp, never the repo's mlartifacts/
    from pipeline.tracking import RunLogger

    experiments = {
        "fedavg-s0": {"method": "fedavg", "partition": "domain/seed0", "seed": 0, "study": "main"},
        "fedselectkd-s0": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "main",
                           "tau": 5.0},
    }
    train_runs = {}
    for name, exp in experiments.items():
        tags = {"method": exp["method"], "partition": exp["partition"], "seed": str(exp["seed"]),
                "study": exp["study"], "experiment": name, "backbone": "tiny-bart"}
        logger = RunLogger.start(exp["study"], name, exp, tags)  # as the train stage does
        logger.log_metrics({"Academic.val_loss": 3.0}, step=1)
        logger.finish()
        train_runs[name] = logger.run_id

    # Evaluation finds each training run by its tag and logs into it; text only where asked for.
    for (name, exp), r1, text in zip(experiments.items(), (20.0, 25.0), (False, True)):
        metrics, eval_dir = eval_record(tmp_path, name, r1)
        run_id = log_to_mlflow(name, exp, metrics, eval_dir, EvaluateConfig(log_text_to_mlflow=text))
        assert run_id == train_runs[name]

    api = f"{mlflow_server}/api/2.0/mlflow"
    exp_id = get(f"{api}/experiments/get-by-name?experiment_name=main")["experiment"]["experiment_id"]
    found = post(f"{api}/runs/search", {"experiment_ids": [exp_id], "filter": "tags.study = 'main'",
                                        "order_by": ["attributes.run_name ASC"]})["runs"]
    assert [r["info"]["run_name"] for r in found] == ["fedavg-s0", "fedselectkd-s0"]
    for run, r1 in zip(found, (20.0, 25.0)):
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert metrics["eval.Academic.rouge1"] == pytest.approx(r1)
        assert metrics["eval.Committee.rouge1"] == pytest.approx(r1 + 1)
        assert metrics["eval.mean.rouge1"] == pytest.approx(r1 + 0.5)
        assert metrics["Academic.val_loss"] == pytest.approx(3.0)  # the training metrics share the run
        assert tags["seed"] == "0" and tags["partition"] == "domain/seed0" and tags["rouge_l_in_tables"] == "rougeLsum"

    selectkd = post(f"{api}/runs/search", {"experiment_ids": [exp_id],
                                           "filter": "tags.method = 'fedselectkd'"})["runs"]
    assert len(selectkd) == 1
    for run, text in zip(found, (False, True)):
        query = urllib.parse.urlencode({"run_id": run["info"]["run_id"], "path": "eval"})
        files = {f["path"] for f in get(f"{api}/artifacts/list?{query}").get("files", [])}
        assert "eval/metrics.json" in files
        assert ("eval/predictions.jsonl" in files) is text
