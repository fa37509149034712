"""MLflow helpers: one SQLite store per project, one MLflow experiment per study, one run per experiment.

The store is ``sqlite:///<repo root>/mlflow.db`` with artifacts in ``<repo root>/mlartifacts/`` (ARCHITECTURE.md),
so `dvc repro` and `dvc exp run` (which runs in a temporary workspace) log into the same place;
``MLFLOW_TRACKING_URI`` overrides it. With an ``http(s)://`` URI (an ``mlflow server``) the server chooses the
artifact location (``mlflow-artifacts:`` proxy), so a second machine's adapters reach the server, not its own disk.
mlflow is imported lazily: stages that never log start fast.

Each study's MLflow experiment opens in the UI's runs table (``mlflow.experimentKind``; MLflow 3 would otherwise
open the GenAI traces view, empty for us) and carries a description naming the study and its METHOD.md section,
given by whoever describes studies (pipeline.results.studies.study_description, passed in by the evaluation's
logging): the train stage logs without one, so a study's wording is no part of training's fingerprint.
Each run carries where it came from and the process that owns it (pipeline.results.run_identity), so a run whose
process died is marked KILLED when the same experiment starts again (:func:`close_dead_runs`).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import os
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

from pipeline.common.config import flatten, repo_root
from pipeline.results.run_identity import owner_alive, owner_tags

# MLflow rejects parameter values longer than this (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
_MAX_PARAM_CHARS = 6000

# The experiment tag MLflow 3.17's UI reads to pick an experiment's landing view (found in the installed UI bundle,
# mlflow/server/js/build: ExperimentKind "custom_model_development" = runs table, "genai_development" = traces).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # the experiment's (and run's) description in the UI


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def artifact_root() -> Path:
    return repo_root() / "mlartifacts"


def _is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


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


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URI (query options dropped); None for any other store."""
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0]) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _store_init_lock(uri: str):
    """Opening a SQLite store creates or migrates its tables; two processes doing that at once collide ("table
    already exists", "duplicate column"). They take turns: an exclusive flock on the store's directory (not on the
    database file, whose POSIX locks SQLite owns)."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    directory = path.parent
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


def experiment_tags(description: str | None = None) -> dict[str, str]:
    return {EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND} | ({NOTE_TAG: description} if description else {})


def experiment_id(study: str, description: str | None = None) -> str:
    """The MLflow experiment of a study: created on first use (runs-table view, ``description`` when given,
    artifacts under mlartifacts/ or the server's store); an existing one gets the view and the description it
    lacks and, when the checkout moved, its artifact locations rebased (:func:`rebase_artifacts`)."""
    client = _client()
    exp = client.get_experiment_by_name(study)
    if exp is None:
        location = None
        if not _is_remote(tracking_uri()):
            path = (artifact_root() / study).resolve()
            path.mkdir(parents=True, exist_ok=True)
            location = path.as_uri()
        try:
            return client.create_experiment(study, artifact_location=location, tags=experiment_tags(description))
        except Exception:  # another process created it in between
            exp = client.get_experiment_by_name(study)
            if exp is None:
                raise
    for key, value in experiment_tags(description).items():
        if exp.tags.get(key) != value:
            client.set_experiment_tag(exp.experiment_id, key, value)
    rebase_artifacts(exp.experiment_id, exp.name, exp.artifact_location)
    return exp.experiment_id


def rebase_artifacts(exp_id: str, study: str, location: str | None) -> bool:
    """Point a study's artifact location (and its runs') at this checkout's ``mlartifacts/<study>``.

    MLflow stores absolute ``file://`` locations (it resolves relative ones at creation), so a moved or copied
    checkout, whose mlflow.db travels with it, would log into the first folder. Only a store inside this checkout
    is rebased (a store shared by several checkouts keeps its locations), and only locations of our own layout
    (``.../mlartifacts/<study>``). MLflow has no API to change a location, hence the SQL. Returns True if changed."""
    db = _sqlite_path(tracking_uri())
    if db is None or not location or not location.startswith("file:"):
        return False
    root = repo_root().resolve()
    try:
        db.resolve().relative_to(root)
    except ValueError:
        return False
    from mlflow.utils.file_utils import local_file_uri_to_path

    old_path = Path(local_file_uri_to_path(location))
    if old_path.name != study or old_path.parent.name != "mlartifacts":
        return False
    new_path = (artifact_root() / study).resolve()
    if old_path == new_path:
        return False
    new_path.mkdir(parents=True, exist_ok=True)
    old_uri, new_uri = location.rstrip("/"), new_path.as_uri()
    with sqlite3.connect(db, timeout=60) as con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new_uri, int(exp_id)))
        rows = con.execute("SELECT run_uuid, artifact_uri FROM runs WHERE experiment_id = ?", (int(exp_id),))
        for run_uuid, uri in rows.fetchall():
            if uri and (uri == old_uri or uri.startswith(old_uri + "/")):
                con.execute("UPDATE runs SET artifact_uri = ? WHERE run_uuid = ?",
                            (new_uri + uri[len(old_uri):], run_uuid))
    return True


def close_dead_runs(exp_id: str, experiment: str, keep: str | None = None) -> list[str]:
    """Mark KILLED every RUNNING run of ``experiment`` whose process is gone (SIGKILL, power loss), except ``keep``.
    Returns their run ids."""
    client = _client()
    runs = client.search_runs([exp_id], filter_string=f"tags.experiment = '{experiment}' and "
                                                       "attributes.status = 'RUNNING'", max_results=1000)
    closed = []
    for run in runs:
        if run.info.run_id == keep or owner_alive(run.data.tags):
            continue
        client.set_tag(run.info.run_id, "fedmeet.end", "marked KILLED at the next start of the experiment: "
                                                       "its process was gone")
        client.set_terminated(run.info.run_id, status="KILLED")
        closed.append(run.info.run_id)
    return closed


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
        """Start a run (or reopen ``resume_run_id`` after an interrupted training) and log every parameter.
        Earlier runs of the same experiment (tag ``experiment``) left RUNNING by a dead process are marked KILLED."""
        client = _client()
        exp_id = experiment_id(study)
        logger = None
        if resume_run_id:
            try:
                client.get_run(resume_run_id)
            except Exception:
                pass  # run gone (store deleted): start a new one
            else:
                client.update_run(resume_run_id, status="RUNNING")
                logger = cls(resume_run_id)
                logger.set_tags(tags | owner_tags() | {"fedmeet.resumed": "true"})
        if logger is None:
            run = client.create_run(exp_id, run_name=run_name, tags=tags | owner_tags())
            logger = cls(run.info.run_id)
            logger.log_params(params)
        if tags.get("experiment"):
            close_dead_runs(exp_id, tags["experiment"], keep=logger.run_id)
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

    def metric_history(self, key: str) -> list:
        return self._client.get_metric_history(self.run_id, key)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        rows = [RunTag(k, str(v)) for k, v in sorted(tags.items())]
        for i in range(0, len(rows), 100):
            self._client.log_batch(self.run_id, tags=rows[i : i + 100])

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(local_path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self._client.set_terminated(self.run_id, status=status)
