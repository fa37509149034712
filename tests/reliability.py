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
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.sources import HMNET_CHUNKS, HMNET_CORPUS, HMNET_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "mirror"


def hmnet_rel(dataset: str, split: str, k: int) -> str:
    corpus = HMNET_CORPUS[dataset]
    return f"{HMNET_PREFIX}ExampleRawData/meeting_summarization/{corpus}_proprec/{split}/split_{k}.jsonl.gz"


def hmnet_meeting(meeting_id: str) -> dict:
    return {"id": meeting_id,
            "meeting": [{"speaker": "A", "role": "PM", "utt": {"word": ["Hello", "."]}},
                        {"speaker": "B", "role": "", "utt": {"word": ["Hi"]}}],
            "summary": ["They greeted .", "Then they left ."]}


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
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=stage_env(**env),
                          capture_output=True, text=True, timeout=timeout)
    return Outcome(proc.returncode, proc.stderr)


def run_inprocess(main, args: list[str]) -> Outcome:
    """The same entry point in this process (``pipeline.cli.run(main, args)``), for the many cases where a new
    interpreter per case would cost seconds each: the error path (message, status, no traceback) is the same."""
    from pipeline.cli import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = run(main, args)
        except SystemExit as exc:  # argparse
            status = int(exc.code or 0)
    return Outcome(status, err.getvalue())


def mlflow_worker(name: str, go: str, steps: int) -> None:
    """One MLflow writer through pipeline.tracking's public API, as a train stage logs: a run with its parameters,
    a metric per step, tags, then finished. It starts writing when the file ``go`` appears (after its imports), so
    two workers hit the store together."""
    import time

    import mlflow  # noqa: F401  (imported before the start line, not raced against the other worker)

    from pipeline import tracking

    Path(go).with_name(f"ready-{name}").touch()
    while not Path(go).exists():
        time.sleep(0.01)
    run = tracking.RunLogger.start("concurrency", name, {"train": {"lr": 1e-3, "rounds": steps}, "who": name},
                                   {"experiment": name})
    for step in range(steps):
        run.log_metrics({"loss": 1.0 / (step + 1), "step_of": float(step)}, step)
    run.set_tags({"completed": "yes"})
    run.finish()
