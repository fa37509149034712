"""MLflow helpers: one SQLite store per project, one MLflow experiment per study, one run per experiment.

The store is ``sqlite:///<repo root>/mlflow.db`` with artifacts in ``<repo root>/mlartifacts/`` (ARCHITECTURE.md),
so `dvc repro` and `dvc exp run` (which runs in a temporary workspace) log into the same place;
``MLFLOW_TRACKING_URI`` overrides it. mlflow is imported lazily: stages that never log start fast.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from pipeline.config import flatten, repo_root

# MLflow rejects parameter values longer than this (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
_MAX_PARAM_CHARS = 6000


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def artifact_root() -> Path:
    return repo_root() / "mlartifacts"


# SQLite takes one writer at a time: two stages logging at once (two `dvc exp run --queue` workers) may find the
# store locked beyond SQLite's own wait. Those calls are retried with backoff (~25 s in all) instead of failing.
_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8)
_LOCKED = ("database is locked", "database table is locked")


def _retrying(call, *args, **kwargs):
    for delay in _BACKOFF_S + (None,):
        try:
            return call(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- only a locked store is retried
            if delay is None or not any(t in str(exc) for t in _LOCKED):
                raise
            time.sleep(delay * (1 + random.random()))  # jitter: two waiting writers do not retry in lockstep


@contextlib.contextmanager
def _store_init_lock(uri: str):
    """Opening a SQLite store creates or migrates its tables; two processes doing that at once collide ("table
    already exists", "duplicate column"). They take turns: an exclusive flock on the store's directory (not on the
    database file, whose POSIX locks SQLite owns)."""
    path = uri.removeprefix("sqlite:///").split("?", 1)[0] if uri.startswith("sqlite:///") else ""
    if not path:
        yield
        return
    directory = Path(path).parent
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


class _RetryingClient:
    """An MlflowClient whose calls are retried while the store is locked."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        return functools.partial(_retrying, attr) if callable(attr) else attr


def _client():
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    with _store_init_lock(uri):
        return _RetryingClient(_retrying(MlflowClient, tracking_uri=uri))


def experiment_id(study: str) -> str:
    """The MLflow experiment of a study, created on first use with its artifacts under mlartifacts/."""
    client = _client()
    exp = client.get_experiment_by_name(study)
    if exp is not None:
        return exp.experiment_id
    location = (artifact_root() / study).resolve()
    location.mkdir(parents=True, exist_ok=True)
    try:
        return client.create_experiment(study, artifact_location=location.as_uri())
    except Exception:  # another process created it in between
        exp = client.get_experiment_by_name(study)
        if exp is None:
            raise
        return exp.experiment_id


def _param_value(v: Any) -> str:
    s = "None" if v is None else str(v)
    return s if len(s) <= _MAX_PARAM_CHARS else s[: _MAX_PARAM_CHARS - 3] + "..."


class RunLogger:
    """An MLflow run addressed by id (no thread-local active run), so the Flower server thread can log to it."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._client = _client()

    @classmethod
    def start(cls, study: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
              resume_run_id: str | None = None) -> "RunLogger":
        """Start a run (or reopen ``resume_run_id`` after an interrupted training) and log every parameter."""
        client = _client()
        if resume_run_id:
            try:
                client.get_run(resume_run_id)
                client.update_run(resume_run_id, status="RUNNING")
                return cls(resume_run_id)
            except Exception:
                pass  # run gone (store deleted): start a new one
        run = client.create_run(experiment_id(study), run_name=run_name, tags=tags)
        logger = cls(run.info.run_id)
        logger.log_params(params)
        return logger

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = [Param(k, _param_value(v)) for k, v in sorted(flatten(params).items())]
        for i in range(0, len(flat), 100):  # log_batch takes at most 100 params per call
            self._client.log_batch(self.run_id, params=flat[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        rows = [
            Metric(k, float(v), now, step)
            for k, v in sorted(metrics.items())
            if v is not None and not (isinstance(v, float) and math.isnan(v))
        ]
        for i in range(0, len(rows), 1000):
            self._client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self._client.set_tag(self.run_id, k, str(v))

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(local_path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self._client.set_terminated(self.run_id, status=status)
