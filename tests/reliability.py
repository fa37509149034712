"""Shared helpers of the reliability tests (tests/test_reliability_*.py): a tiny complete mirror of the four
datasets, and a stage CLI run that returns what a user would see (exit status and stderr)."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.datasets.readers.hmnet import HMNET_CHUNKS, HMNET_CORPUS, HMNET_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "mirror"


def hmnet_rel(dataset: str, split: str, k: int) -> str:
    corpus = HMNET_CORPUS[dataset]
    return f"{HMNET_PREFIX}ExampleRawData/meeting_summarization/{corpus}_proprec/{split}/split_{k}.jsonl.gz"


def hmnet_meeting(meeting_id: str) -> dict:
    return {
        "id": meeting_id,
        "meeting": [
            {"speaker": "A", "role": "PM", "utt": {"word": ["Hello", "."]}},
            {"speaker": "B", "role": "", "utt": {"word": ["Hi"]}},
        ],
        "summary": ["They greeted .", "Then they left ."],
    }


def build_mirror(root: Path) -> Path:
    """A complete mirror in the upstream layout: the QMSum and SAMSum fixtures, and AMI/ICSI with every HMNet
    chunk the reader expects (one meeting each, so a real `python -m pipeline.ingest` accepts it)."""
    shutil.copytree(FIXTURES / "qmsum", root / "qmsum")
    shutil.copytree(FIXTURES / "samsum", root / "samsum")
    for dataset, chunks in HMNET_CHUNKS.items():
        for split, n in chunks.items():
            for k in range(n):
                path = root / dataset / hmnet_rel(dataset, split, k)
                path.parent.mkdir(parents=True, exist_ok=True)
                with gzip.open(path, "wt", encoding="utf-8") as fh:
                    fh.write(json.dumps(hmnet_meeting(f"{dataset}-{split}-{k}")) + "\n")
    return root


def write_params(path: Path, data_root: Path, **ingest) -> Path:
    """params.yaml with only the `ingest` group (the stage reads no other)."""
    group = {"data_root": str(data_root), "raw_dir": str(path.parent / "raw"), **ingest}
    path.write_text(yaml.safe_dump({"ingest": group}))
    return path


def read_lines(path: Path) -> list[bytes]:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.splitlines(keepends=True)


def write_lines(path: Path, lines: list[bytes]) -> None:
    data = b"".join(lines)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


PROGRESS = re.compile(r"\r?[\w-]+ \w+: \d+rec \[[^\]]*\]")


@dataclass
class Outcome:
    status: int
    stderr: str

    @property
    def lines(self) -> list[str]:
        """stderr lines, less the stage's progress bar (tqdm: ``<desc>: <n>rec [<time>, <rate>]``, redrawn with
        carriage returns): what is left is what the stage says."""
        out = []
        for line in self.stderr.splitlines():
            line = PROGRESS.sub("", line)
            if line.strip():
                out.append(line)
        return out


def stage_env(**extra: str) -> dict[str, str]:
    # No FEDMEET_* from the test run, and not PYTEST_CURRENT_TEST, which switches MLflow into its own test checks.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDMEET_") and k != "PYTEST_CURRENT_TEST"}
    # This worktree's code, whatever the shared venv's editable install points at.
    env.update(PYTHONPATH=str(REPO_ROOT), FLWR_TELEMETRY_ENABLED="0")
    env.update(extra)
    return env


def run_subprocess(module: str, args: list[str], cwd: Path, timeout: float = 120, **env: str) -> Outcome:
    """``python -m <module> <args>`` as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=stage_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Outcome(proc.returncode, proc.stderr)


def run_inprocess(main, args: list[str]) -> Outcome:
    """The same entry point in this process (``pipeline.common.cli.run(main, args)``), for the many cases where a new
    interpreter per case would cost seconds each: the error path (message, status, no traceback) is the same."""
    from pipeline.common.cli import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = run(main, args)
        except SystemExit as exc:  # argparse
            status = int(exc.code or 0)
    return Outcome(status, err.getvalue())


def mlflow_worker(name: str, go: str, steps: int) -> None:
    """One MLflow writer through pipeline.results.tracking's public API, as a train stage logs: a run with its
    parameters, a metric per step, tags, then finished. It starts writing when the file ``go`` appears (after its
    imports), so two workers hit the store together."""
    import time

    import mlflow  # noqa: F401  (imported before the start line, not raced against the other worker)

    from pipeline.results import tracking

    Path(go).with_name(f"ready-{name}").touch()
    while not Path(go).exists():
        time.sleep(0.01)
    run = tracking.RunLogger.start(
        "concurrency", name, {"train": {"lr": 1e-3, "rounds": steps}, "who": name}, {"experiment": name}
    )
    for step in range(steps):
        run.log_metrics({"loss": 1.0 / (step + 1), "step_of": float(step)}, step)
    run.set_tags({"completed": "yes"})
    run.finish()


def stage_worker(name: str, go: str, argv: list[str]) -> None:
    """One train stage (``pipeline.train.main`` through ``pipeline.common.cli.run``, as ``python -m pipeline.train``
    runs it), started when the file ``go`` appears: the imports are done first, so two workers open the store and
    train at the same moment."""
    import time

    from pipeline import train
    from pipeline.common import cli

    Path(go).with_name(f"ready-{name}").touch()
    while not Path(go).exists():
        time.sleep(0.01)
    raise SystemExit(cli.run(train.main, argv))


# ---------------------------------------------------------------------- a federated run killed at named points
# Each kill point is installed in a child process just before it runs the train stage; the child SIGKILLs itself
# when the run reaches that point (nothing is timed: the point is a call the run makes).
def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_in_local_training(client: str, rnd: int, batch: int) -> None:
    """Inside ``client``'s round-``rnd`` training, at the loss of its ``batch``-th batch (after the optimizer steps
    of the batches before it; the round's clients train at the barrier, in groups, and write their gate logs once
    all have trained)."""
    from pipeline.modeling import losses
    from pipeline.training import local_batch

    real_group, real_loss = local_batch.train_group, losses.distillation_losses
    state = {"armed": False, "batches": 0}

    def train_group(jobs):
        state["armed"] = any((job.client, job.rnd) == (client, rnd) for job in jobs)
        try:
            return real_group(jobs)
        finally:
            state["armed"] = False

    def distillation_losses(*args, **kwargs):
        if state["armed"]:
            state["batches"] += 1
            if state["batches"] == batch:
                _die()
        return real_loss(*args, **kwargs)

    local_batch.train_group = train_group
    losses.distillation_losses = distillation_losses  # the group trainer looks it up at each call


def _kill_after_aggregation(rnd: int) -> None:
    """Right after the server's strategy aggregated round ``rnd`` (before the clients evaluate it)."""
    from pipeline.federation import server_app

    real_build = server_app.build_strategy

    def build_strategy(*args, **kwargs):
        strategy = real_build(*args, **kwargs)
        real_aggregate = strategy.aggregate_train

        def aggregate_train(server_round, replies):
            result = real_aggregate(server_round, replies)
            if server_round == rnd:
                _die()
            return result

        strategy.aggregate_train = aggregate_train
        return strategy

    server_app.build_strategy = build_strategy


def _kill_after_recording(rnd: int) -> None:
    """Between rounds: round ``rnd`` checkpointed and recorded (rounds.json, MLflow), round ``rnd + 1`` not begun."""
    from pipeline.training.history import TrainRecorder

    real = TrainRecorder.round_done

    def round_done(self, plan, entry, history):
        real(self, plan, entry, history)
        if entry.round == rnd:
            _die()

    TrainRecorder.round_done = round_done


def _kill_after_checkpoint(rnd: int) -> None:
    """After the server checkpointed round ``rnd``, before the round is recorded (rounds.json, MLflow)."""
    from pipeline.federation import server_app

    real = server_app.save_server_checkpoint

    def save_server_checkpoint(plan, server_round, *args, **kwargs):
        real(plan, server_round, *args, **kwargs)
        if server_round == rnd:
            _die()

    server_app.save_server_checkpoint = save_server_checkpoint


def _kill_in_write(name: str) -> None:
    """Inside the first atomic write of a file called ``name``, its temporary cut to half
    (pipeline/common/atomic.py)."""
    from pipeline.common.atomic import ENV_KILL

    os.environ[ENV_KILL] = name


def _kill_in_artifact_upload() -> None:
    """Inside the first upload of an adapter to MLflow (after the final metrics were logged)."""
    from pipeline.results import tracking

    tracking.RunLogger.log_artifact = lambda self, *args, **kwargs: _die()


# name -> (where the run dies, installer); the round numbers fit a 3-round run of the Academic/Committee/Product
# domain partition (tests/test_federated.py).
KILL_POINTS = {
    "first-round": (
        "inside Committee's round-1 local training, before any checkpoint",
        lambda: _kill_in_local_training("Committee", 1, batch=2),
    ),
    "local-training": (
        "inside Product's round-2 local training, after its first optimizer step",
        lambda: _kill_in_local_training("Product", 2, batch=2),
    ),
    "aggregated": ("right after the server aggregated round 2", lambda: _kill_after_aggregation(2)),
    "checkpoint-write": (
        "inside the write of the server checkpoint (server.pt) of the round it trains",
        lambda: _kill_in_write("server.pt"),
    ),
    "between-rounds": ("after round 2 was checkpointed and recorded, before round 3", lambda: _kill_after_recording(2)),
    "before-recording": (
        "after round 3's checkpoint, before rounds.json and MLflow have round 3",
        lambda: _kill_after_checkpoint(3),
    ),
    "final-write": (
        "inside the write of metrics.json, after the gate logs were merged",
        lambda: _kill_in_write("metrics.json"),
    ),
    "artifact-upload": (
        "inside the upload of the adapters to MLflow, after the final metrics were logged",
        _kill_in_artifact_upload,
    ),
}


def _wait(pid: int, timeout: float) -> int | str:
    """The child's exit status (negative: killed by that signal), or "timeout" after killing it."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


def train_legs(legs: list[list[str]], plans: str, record: str, timeout: float) -> None:
    """Run the train stage once per leg ``[experiment, kill point or ""]``, each in its own process, one after the
    other, and write to ``record`` (JSON) how each ended and what it left: exit status (-9: SIGKILL), the server
    checkpoint's round, temporaries left in the outputs. Each leg is a fork of this process, made after the heavy
    imports (a fresh interpreter per leg would spend most of the test importing torch, transformers and MLflow on
    a shared 2-core machine); this process itself never opens a model or the MLflow store."""
    import traceback

    # Imported once, here, before the forks (transformers and MLflow import most of their modules lazily).
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    import torch
    import transformers.masking_utils  # noqa: F401
    from mlflow.tracking import MlflowClient  # noqa: F401
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, EncoderDecoderModel  # noqa: F401

    from pipeline import train
    from pipeline.common import cli  # noqa: F401
    from pipeline.experiments.plans import read_plan
    from pipeline.federation import engines  # noqa: F401  (Flower and the apps, imported before the forks)

    out = []
    for i, (experiment, point) in enumerate(legs):
        log_path = Path(record).with_name(f"leg{i}-{experiment}-{point or 'whole'}.log")
        pid = os.fork()
        if pid == 0:  # the leg
            status = 1
            try:
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                if point:
                    KILL_POINTS[point][1]()
                status = cli.run(train.main, ["--experiment", experiment, "--plans", plans])
            except BaseException:  # noqa: BLE001 -- reported in the leg's log, and as its status
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        status = _wait(pid, timeout)
        run_dir = Path(read_plan(Path(plans) / f"{experiment}.json").paths["out_dir"])
        ckpt = run_dir / "checkpoint" / "server.pt"
        out.append(
            {
                "experiment": experiment,
                "point": point,
                "status": status,
                "log": str(log_path),
                "checkpoint_round": torch.load(ckpt, weights_only=False)["round"] if ckpt.exists() else None,
                "run_dir_left": run_dir.exists(),
                "temporaries": sorted(
                    str(p)
                    for d in (run_dir, Path("models") / experiment, Path("reports/train") / experiment)
                    for p in d.rglob("*.tmp*")
                ),
            }
        )
        if status not in (0, -signal.SIGKILL):
            break  # a leg that failed otherwise: the rest would only repeat its error
    Path(record).write_text(json.dumps(out, indent=1))
