"""MLflow, laid out as docs/mlflow.md says. What leaves a client: adapter tensors, counts, metrics, its splits as
metadata (name, digest of the example ids)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import random
import socket
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from pipeline.common import atomic
from pipeline.common.config import ConfigError, flatten, repo_root
from pipeline.training.client_data import read_partition

PARENT_TAG = "mlflow.parentRunId"  # what nests a client's run under its experiment's run in the UI
MODEL_TAG = "fedmeet.model_id"  # a client run's LoggedModel
# The run tags a client's run repeats from its experiment's run. Not `experiment`: that tag finds experiment runs.
CHILD_TAGS = ("method", "partition", "seed", "study", "backbone", "engine")

# Who a tracked run is: git, the DVC experiment, its name, and the process that owns it (owner tags).
TAG_HOST, TAG_PID, TAG_PID_START = "fedmeet.host", "fedmeet.pid", "fedmeet.pid_start"


def git_state() -> dict[str, str]:
    """Commit of the workspace, and whether tracked files but dvc.lock (`dvc repro` rewrites it) differ from it."""
    git = functools.partial(subprocess.run, capture_output=True, text=True, timeout=30)
    try:
        commit = git(["git", "rev-parse", "HEAD"]).stdout.strip()
        status = git(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock"]).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if not commit:
        return {}
    changed = sorted(line[3:] for line in status.splitlines() if line.strip())
    tags = {"git.commit": commit, "mlflow.source.git.commit": commit, "git.dirty": str(bool(changed)).lower()}
    return tags | ({"git.changed": ", ".join(changed)[:500]} if changed else {})


def dvc_tags() -> dict[str, str]:
    names = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev"}
    return {tag: os.environ[var] for var, tag in names.items() if os.environ.get(var)}


def run_name(experiment: str) -> str:
    """The experiment, with the DVC experiment's name under `dvc exp run` (``fedselectkd-domain [tau-three]``)."""
    return f"{experiment} [{os.environ['DVC_EXP_NAME']}]" if os.environ.get("DVC_EXP_NAME") else experiment


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def owner_tags() -> dict[str, str]:
    """This process as a run's owner (the pid's start time tells a reused pid from the owner)."""
    pid = os.getpid()
    return {TAG_HOST: socket.gethostname(), TAG_PID: str(pid), TAG_PID_START: f"{_process_start(pid) or 0:.3f}"}


def owner_alive(tags: dict[str, str]) -> bool:
    """Whether a run's owner still runs; one of another host counts as alive, one without owner tags as dead."""
    if TAG_PID not in tags:
        return False
    if tags.get(TAG_HOST) != socket.gethostname():
        return True
    start = _process_start(int(tags[TAG_PID]))
    return start is not None and abs(start - float(tags.get(TAG_PID_START, 0))) < 1.0


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def artifact_dir(study: str) -> Path:
    (path := (repo_root() / "mlartifacts" / study).resolve()).mkdir(parents=True, exist_ok=True)
    return path


# SQLite takes one writer at a time: two stages logging at once (two `dvc exp run --queue` workers) may find the
# store locked beyond SQLite's own wait. Those calls are retried with backoff (~25 s in all) instead of failing.
_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8)
_LOCKED = ("database is locked", "database table is locked")
# Where a store keeps artifact locations besides its experiments: (table, location column).
_LOCATED = (("runs", "artifact_uri"), ("logged_models", "artifact_location"))


def _retrying(call, *args, **kwargs):
    for delay in _BACKOFF_S + (None,):
        try:
            return call(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- only a locked store is retried
            if delay is None or not any(t in str(exc) for t in _LOCKED):
                raise
            time.sleep(delay * (1 + random.random()))  # jitter: two waiting writers do not retry in lockstep


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0]) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _store_lock(uri: str):
    """Two processes on one SQLite store collide creating its tables ("duplicate column") and inserting the same
    dataset ("UNIQUE constraint failed"), which MLflow's own lock does not cover: a flock on the store's directory."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


class _RetryingClient:  # an MlflowClient whose calls are retried while the store is locked
    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        return functools.partial(_retrying, attr) if callable(attr) else attr


def _client():
    import mlflow  # lazy: importing mlflow takes ~1-2 s
    from mlflow.tracking import MlflowClient  # lazy, as above

    mlflow.set_tracking_uri(uri := tracking_uri())
    with _store_lock(uri):
        try:  # it opens the store: a file that is no database, an out-of-date schema are one line, no traceback
            return _RetryingClient(_retrying(MlflowClient, tracking_uri=uri))
        except Exception as exc:
            raise ConfigError(f"{uri}: the MLflow store cannot be opened: {' '.join(str(exc).split())[:300]}") from None


def find_runs(exp_id: str, where: str, order_by: list[str] | None = None) -> list:
    """The runs of the MLflow experiment ``exp_id`` that MLflow's filter ``where`` selects, in ``order_by``'s order."""
    return _client().search_runs([exp_id], where, order_by=order_by)


def experiment_id(study: str, description: str | None = None) -> str:
    """The MLflow experiment of a study, created on first use (an existing one: missing tags set, artifacts rebased)."""
    client = _client()
    # mlflow.experimentKind picks the UI's landing view (runs table, not GenAI traces); the note is its description
    tags = {"mlflow.experimentKind": "custom_model_development"}
    tags |= {"mlflow.note.content": description} if description else {}
    exp = client.get_experiment_by_name(study)
    if exp is None:
        location = None if tracking_uri().startswith(("http://", "https://")) else artifact_dir(study).as_uri()
        try:
            return client.create_experiment(study, artifact_location=location, tags=tags)
        except Exception:  # another process created it in between
            exp = client.get_experiment_by_name(study)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":  # MLflow keeps a deleted experiment's name: no new one, no run into it
        raise ConfigError(f"{tracking_uri()}: the MLflow experiment {study!r} is deleted; restore it or `mlflow gc` it")
    for key, value in tags.items():
        if exp.tags.get(key) != value:
            client.set_experiment_tag(exp.experiment_id, key, value)
    rebase_artifacts(exp.experiment_id, exp.name, exp.artifact_location)
    return exp.experiment_id


def rebase_artifacts(exp_id: str, study: str, location: str | None) -> None:
    """Point a study's artifact locations (its runs' and models' too) at this checkout's ``mlartifacts/<study>``
    when the store lives in the checkout; MLflow stores absolute locations and has no API to change them."""
    from mlflow.utils.file_utils import local_file_uri_to_path  # lazy: mlflow, as above

    db = _sqlite_path(tracking_uri())
    if db is None or not (location or "").startswith("file:") or not db.resolve().is_relative_to(repo_root().resolve()):
        return
    old = Path(local_file_uri_to_path(location))
    if old.name != study or old.parent.name != "mlartifacts" or old == artifact_dir(study):
        return  # not our layout, or already here
    old_uri, new_uri = location.rstrip("/"), artifact_dir(study).as_uri()
    with sqlite3.connect(db, timeout=60) as con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new_uri, int(exp_id)))
        for table, column in _LOCATED:  # old_uri itself, or a location under it: its tail kept (substr is 1-based)
            con.execute(
                f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE experiment_id = ? "
                f"AND ({column} = ? OR substr({column}, 1, ?) = ?)",
                (new_uri, len(old_uri) + 1, int(exp_id), old_uri, len(old_uri) + 1, old_uri + "/"),
            )


def split_dataset(partition: str, client: str, split: str, ids: list, source: str | Path):
    """A client's split as an MLflow dataset of metadata only: ``<partition>/<client>/<split>``, its ids' digest."""
    from mlflow.data.meta_dataset import MetaDataset  # lazy: mlflow, as above
    from mlflow.data.sources import LocalArtifactDatasetSource  # lazy, as above

    digest = hashlib.sha256(json.dumps([str(i) for i in ids]).encode()).hexdigest()[:16]
    return MetaDataset(LocalArtifactDatasetSource(str(source)), name=f"{partition}/{client}/{split}", digest=digest)


class RunLogger:
    """An MLflow run addressed by id (no thread-local active run, so the Flower server thread can log to it), and
    its clients' child runs: a metric ``<client>.<key>`` of a client with a run goes to that run as ``<key>``."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._client = _client()
        self._monitor = None
        self.datasets: dict[str, dict[str, Any]] = {}  # the clients' splits as MLflow datasets, by client and split
        self.train_sizes: dict[str, int] = {}
        self.exp_id = self._client.get_run(run_id).info.experiment_id
        children = self._client.search_runs([self.exp_id], f"tags.`{PARENT_TAG}` = '{run_id}'")
        self.children = {r.data.tags["client"]: r.info.run_id for r in children if "client" in r.data.tags}
        # each client's LoggedModel (its best adapter; the newest when a resumed run logged it again)
        self.models = {r.data.tags["client"]: r.data.tags[MODEL_TAG] for r in children if MODEL_TAG in r.data.tags}

    @classmethod
    def start(
        cls,
        study: str,
        run_name: str,
        params: dict[str, Any],
        tags: dict[str, str],
        run_id_file: Path | None = None,
        partition: str | Path | None = None,
        clients: tuple[str, ...] = (),
    ) -> RunLogger:
        """Start a run (or reopen the one ``run_id_file`` names; the run's id is written there) with its params, a
        child run per client of the ``partition`` file or of ``clients``, and MLflow's system metrics. Runs of the
        same experiment left RUNNING by a dead process (SIGKILL, power loss) are marked KILLED, with their clients'
        runs."""
        from mlflow.entities import DatasetInput, InputTag, Param  # lazy: mlflow, as above
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # lazy, as above

        listed = read_partition(partition)["clients"] if partition is not None else {}  # a bad file: before any run
        client, exp_id, resumed = _client(), experiment_id(study), False
        resume_run_id = run_id_file.read_text().strip() if run_id_file and run_id_file.exists() else None
        with contextlib.suppress(Exception):  # no run to resume, or it is gone (store or run deleted): a new one
            resumed = client.get_run(resume_run_id).info.lifecycle_stage == "active"
        if resumed:
            logger = cls(resume_run_id)
            for run_id in (resume_run_id, *logger.children.values()):
                client.update_run(run_id, status="RUNNING")
            logger.set_tags(tags | owner_tags() | {"fedmeet.resumed": "true"})
            if tags.get("git.dirty") == "false" and "git.changed" in client.get_run(resume_run_id).data.tags:
                client.delete_tag(resume_run_id, "git.changed")  # the tree is clean now (git.dirty false)
        else:
            logger = cls(client.create_run(exp_id, run_name=run_name, tags=tags | owner_tags()).info.run_id)
            # (a plan's longest value, its client list, is far below MLflow's 6000 characters)
            client.log_batch(logger.run_id, params=[Param(k, str(v)) for k, v in sorted(flatten(params).items())])
        for name, splits in ({c: {} for c in clients} | listed).items():
            logger.train_sizes[name] = len(splits.get("train", []))
            logger.datasets[name] = sets = {
                split: split_dataset(tags.get("partition", ""), name, split, splits[split], partition)
                for split in ("train", "valid")
                if split in splits
            }
            if name in logger.children:
                continue
            child_tags = {k: tags[k] for k in CHILD_TAGS if k in tags} | {PARENT_TAG: logger.run_id, "client": name}
            child = client.create_run(exp_id, run_name=f"{run_name}/{name}", tags=child_tags).info.run_id
            logger.children[name] = child
            inputs = [
                DatasetInput(d._to_mlflow_entity(), [InputTag("mlflow.data.context", s)]) for s, d in sets.items()
            ]
            with _store_lock(tracking_uri()):  # two trainings of one partition log the same datasets at once
                client.log_inputs(child, datasets=inputs)
        if tags.get("experiment"):
            running = f"tags.experiment = '{tags['experiment']}' and attributes.status = 'RUNNING'"
            gone = "marked KILLED at the next start of the experiment: its process was gone"
            for run in client.search_runs([exp_id], running):
                if run.info.run_id != logger.run_id and not owner_alive(run.data.tags):
                    end_if_running(run.info.run_id, gone)
        logger._monitor = SystemMetricsMonitor(logger.run_id, resume_logging=resumed, tracking_uri=tracking_uri())
        logger._monitor.start()
        if run_id_file is not None:
            atomic.write_text(run_id_file, logger.run_id)
        return logger

    def log_metrics(self, metrics: dict[str, float], step: int, model_id: str | None = None, dataset=None) -> None:
        """Log ``metrics`` at ``step`` (NaN, None left out; a client's to its run) for ``model_id`` on ``dataset``."""
        from mlflow.entities import Metric  # lazy: mlflow, as above

        now, rows = int(time.time() * 1000), {}
        data = {"dataset_name": dataset.name, "dataset_digest": dataset.digest} if dataset is not None else {}
        for key, v in sorted(metrics.items()):
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                client, _, rest = key.partition(".")
                run_id = self.children.get(client) if rest else None
                rows.setdefault(run_id or self.run_id, []).append(
                    Metric(rest if run_id else key, float(v), now, step, model_id=model_id, **data)
                )
        for run_id, batch in rows.items():
            self._client.log_batch(run_id, metrics=batch)

    def metric_history(self, key: str) -> list:
        return self._client.get_metric_history(self.run_id, key)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag  # lazy: mlflow, as above

        self._client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in sorted(tags.items())])

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_adapter_models(self, model_dir: Path, global_adapter: Path | None = None) -> None:
        """Each client's best adapter as a LoggedModel ``<experiment>-<client>`` of its client's run
        (``global_adapter``, a deployed server's aggregate, of this run), files ``adapters/<client>/`` and the plan."""
        plan = json.loads((model_dir / "experiment.json").read_text())
        tags = {k: str(plan[k]) for k in ("experiment", "method", "partition", "seed", "study")}
        adapters = {f.parent.name: f for f in sorted((model_dir / "clients").glob("*/adapter_best.safetensors"))}
        adapters |= {"global": global_adapter} if global_adapter is not None else {}
        for client, adapter in adapters.items():
            name, source = f"{plan['experiment']}-{client}", self.children.get(client, self.run_id)
            found = self._client.search_logged_models([self.exp_id], f"name = '{name}' AND source_run_id = '{source}'")
            # a killed attempt's (PENDING, or READY when killed at a later client's): finished, not doubled
            [model, *_] = [m for m in found if m.status in ("PENDING", "READY")] or [
                self._client.create_logged_model(
                    self.exp_id, name=name, source_run_id=source, tags=tags | {"client": client}
                )
            ]
            self._client.log_model_artifact(model.model_id, str(adapter), f"adapters/{client}")
            self._client.log_model_artifact(model.model_id, str(model_dir / "experiment.json"))
            self._client.finalize_logged_model(model.model_id, "READY")
            if client in self.children:
                self._client.set_tag(self.children[client], MODEL_TAG, model.model_id)
            if train := self.datasets.get(client, {}).get("train"):  # the model's link to the data it learnt from
                self.log_metrics({f"{client}.train_examples": self.train_sizes[client]}, 0, model.model_id, train)
            self.models[client] = model.model_id

    def finish(self, status: str = "FINISHED") -> None:
        if self._monitor is not None:
            self._monitor.finish()
        for run_id in (*self.children.values(), self.run_id):
            self._client.set_terminated(run_id, status=status)


def delete_run(run_id: str, unless_logged: str | None = None) -> None:
    """Delete an MLflow run and its clients' runs (an attempt holding nothing worth keeping: no ``unless_logged``)."""
    logger = RunLogger(run_id)
    if not (unless_logged and logger.metric_history(unless_logged)):
        for run in (*logger.children.values(), run_id):
            logger._client.delete_run(run)


def end_if_running(run_id: str, reason: str) -> bool:
    """Mark KILLED run ``run_id`` and its clients' runs, tagged ``fedmeet.end`` = ``reason``, if it is RUNNING;
    whether it was."""
    if (logger := RunLogger(run_id))._client.get_run(run_id).info.status != "RUNNING":
        return False
    logger.set_tags({"fedmeet.end": reason})
    logger.finish("KILLED")
    return True


def download_model(model: str, models_dir: Path) -> dict[str, str]:
    """A LoggedModel (its id ``m-...`` or ``models:/<id>``) downloaded into ``models_dir/<experiment>/`` as the train
    stage lays out its output (``clients/<client>/adapter_best.safetensors``, ``experiment.json``); its tags."""
    import mlflow  # lazy: importing mlflow takes ~1-2 s

    model_id = model.removeprefix("models:/").strip("/")
    try:
        tags = _client().get_logged_model(model_id).tags  # _client sets the tracking URI download_artifacts reads
    except mlflow.exceptions.MlflowException as exc:  # a mistyped id: one line, not MLflow's traceback
        raise ConfigError(f"{model}: no such LoggedModel in {tracking_uri()} ({exc.message})") from None
    if tags.get("client") == "global":  # a deployed server's aggregate: no client's adapter, no test set of its own
        raise ConfigError(f"{model}: a deployed run's global adapter; give a client's LoggedModel (<exp>-<client>)")
    folder = models_dir / tags["experiment"]
    mlflow.artifacts.download_artifacts(f"models:/{model_id}", dst_path=str(folder))
    (folder / "adapters").rename(folder / "clients")
    return tags
