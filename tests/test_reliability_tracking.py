"""Two writers, one MLflow store (issue 15, item 5): two processes logging to the same SQLite store at once both
complete, and lose no run, parameter or metric (plain MLflow writers, and two train stages); a store that stays
locked is waited for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability import REPO_ROOT, stage_env

from tests.test_federated import DOMAINS, workspace, write_plan, ws  # noqa: F401  (fixtures)

# Real processes racing one store: full lane only (make test-all).
pytestmark = pytest.mark.slow

STEPS = 20


def start_worker(name: str, go: Path, env: dict) -> subprocess.Popen:
    code = f"from reliability import mlflow_worker; mlflow_worker({name!r}, {str(go)!r}, {STEPS})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=go.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def release_together(workers, ready_files, go, timeout: float) -> list[str]:
    """Wait (bounded) until every worker has written its ready file, start them all at once by creating ``go``,
    and check that each exits 0 without ever meeting a locked store; returns their outputs."""
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in ready_files):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), [
            w.communicate()[0][-2000:] for w in workers if w.poll() is not None
        ]
        time.sleep(0.02)
    go.touch()
    outputs = [w.communicate(timeout=timeout)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [o[-3000:] for o in outputs]
    assert not any("database is locked" in o for o in outputs)
    return outputs


def test_two_processes_log_to_one_fresh_store_at_once(tmp_path):
    """A fresh store is the hard case (an existing one is a subset): both processes create its tables at the same
    moment; before the fix one of them failed with "table ... already exists" or "duplicate column name"."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = stage_env(
        MLFLOW_TRACKING_URI=uri, FEDMEET_ROOT=str(tmp_path), PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}"
    )
    go = tmp_path / "go"
    workers = [start_worker(name, go, env) for name in ("a", "b")]
    release_together(workers, [tmp_path / f"ready-{n}" for n in ("a", "b")], go, timeout=180)

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("concurrency")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == ["a", "b"]
    for name, run in runs.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["who"] == name and run.data.params["train.rounds"] == str(STEPS)
        assert run.data.tags["completed"] == "yes"
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(STEPS))


def test_a_locked_store_is_retried_not_fatal(tmp_path, monkeypatch):
    """Beyond SQLite's own wait MLflow raises "database is locked": pipeline.results.tracking retries the call with
    backoff (here the store answers locked twice, then takes the write), and any other error is raised at once."""
    import sqlalchemy.exc
    from mlflow.tracking import MlflowClient

    from pipeline.results import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = tracking.RunLogger.start("locked", "r", {"x": 1}, {})
    real = MlflowClient.log_batch
    calls = []

    def locked_twice(self, *args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise sqlalchemy.exc.OperationalError("INSERT ...", {}, Exception("database is locked"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", locked_twice)
    run.log_metrics({"loss": 0.5}, step=3)
    assert len(calls) == 3
    history = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"]).get_metric_history(run.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(3, 0.5)]

    def broken(self, *args, **kwargs):
        calls.append(1)
        raise ValueError("no such run")

    monkeypatch.setattr(MlflowClient, "log_batch", broken)
    calls.clear()
    with pytest.raises(ValueError, match="no such run"):
        run.log_metrics({"loss": 0.4}, step=4)
    assert len(calls) == 1


# Written by both stages at the end of a run (step = the last round), not per round.
SUMMARY_METRICS = ("best_val_loss", "bytes_sent_total", "bytes_received_total", "peak_rss_mb")


@pytest.mark.timeout(240)
def test_two_train_stages_log_to_one_fresh_store_at_once(ws, tmp_path):
    """Two tiny trainings (a federated and a local one, 2 rounds, 3 clients), each a train stage
    (``pipeline.train.main`` through ``pipeline.common.cli``) in its own process, started together against one fresh
    SQLite store: both runs FINISHED, with every per-round metric of the stage's rounds.json, once per round."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    names = {"conc-fed": "fedavg", "conc-local": "single"}
    for name, method in names.items():
        write_plan(name, method)
    env = stage_env(
        MLFLOW_TRACKING_URI=uri,
        FEDMEET_ROOT=str(ws),
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}",
    )
    go = tmp_path / "go"
    workers = []
    for name in names:
        argv = ["--experiment", name, "--plans", str(ws / "models" / "plans")]
        code = f"from reliability import stage_worker; stage_worker({name!r}, {str(go)!r}, {argv!r})"
        workers.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                cwd=ws,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    release_together(workers, [tmp_path / f"ready-{n}" for n in names], go, timeout=200)

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tests")
    for name, method in names.items():
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.experiment = '{name}'")
        assert [r.info.status for r in runs] == ["FINISHED"], name
        run = runs[0]
        assert run.data.params["method"] == method and run.data.params["train.rounds"] == "2"
        history = {
            k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
            for k in run.data.metrics
            if not k.startswith("system/")
        }  # (MLflow's own system metrics)
        children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
        clients = {c.data.tags["client"]: c for c in children}
        assert sorted(clients) == sorted(DOMAINS) and all(c.info.status == "FINISHED" for c in children)
        rounds = json.loads((ws / "models" / name / "rounds.json").read_text())
        assert sorted({r["round"] for r in rounds}) == [1, 2] and len(rounds) == 2 * len(DOMAINS)
        for row in rounds:  # every client's losses of every round, in its run, as the stage recorded them
            for key in ("train_loss", "val_loss", "bytes_up", "bytes_down"):
                logged = client.get_metric_history(clients[row["client"]].info.run_id, key)
                assert (row["round"], row[key]) in [(m.step, m.value) for m in logged], (name, row["client"], key)
        per_round = [k for k in history if not k.endswith(SUMMARY_METRICS)]
        assert {"round_seconds", "bytes_sent", "val_loss_mean"} <= set(per_round)
        for key in per_round:  # each once per round: none lost, none doubled
            assert [step for step, _ in history[key]] == [1, 2], (name, key)
        adapters = {a.path for a in client.list_artifacts(run.info.run_id, "adapters/Academic")}
        assert adapters == {"adapters/Academic/adapter_best.safetensors", "adapters/Academic/adapter_final.safetensors"}
