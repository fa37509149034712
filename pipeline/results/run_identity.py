"""Who a tracked run is: where it came from (git commit and changed files, the DVC experiment), its name and the
process that owns it (host, pid and the pid's start time), so a run whose process died can be told from one still
running (pipeline.results.tracking marks it KILLED)."""
from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

# Run tags (besides the experiment's own: method, partition, seed, study, experiment, backbone, engine).
TAG_HOST, TAG_PID, TAG_PID_START = "fedmeet.host", "fedmeet.pid", "fedmeet.pid_start"


# ------------------------------------------------------------------------------------------------ provenance
def _git(*args: str, cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=30,
                             cwd=cwd or Path.cwd())
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return out.stdout


def git_state(cwd: Path | None = None) -> dict[str, str]:
    """Commit of the workspace (a DVC temporary workspace is a git checkout of the baseline) and whether tracked
    files differ from it. dvc.lock is left out: `dvc repro` rewrites it after each stage, which says nothing about
    the code or parameters the run used."""
    commit = (_git("rev-parse", "HEAD", cwd=cwd) or "").strip()
    if not commit:
        return {}
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock", cwd=cwd)
    changed = sorted(line[3:] for line in (status or "").splitlines() if line.strip())
    tags = {"git.commit": commit, "mlflow.source.git.commit": commit, "git.dirty": str(bool(changed)).lower()}
    if changed:
        tags["git.changed"] = ", ".join(changed)[:500]
    return tags


def dvc_tags() -> dict[str, str]:
    """The DVC experiment the run belongs to (DVC sets these for `dvc exp run`, queued and temporary runs too)."""
    names = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev"}
    return {tag: os.environ[var] for var, tag in names.items() if os.environ.get(var)}


def run_name(experiment: str) -> str:
    """The experiment's name, with the DVC experiment's under `dvc exp run` (``fedselectkd-domain [tau-three]``), so
    ablation points of one experiment tell apart in the UI and match their `dvc exp show` rows (the settings
    themselves are the run's parameters)."""
    return f"{experiment} [{os.environ['DVC_EXP_NAME']}]" if os.environ.get("DVC_EXP_NAME") else experiment


# ------------------------------------------------------------------------------------------------ processes
def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def owner_tags() -> dict[str, str]:
    """This process as the owner of a run (host, pid and the pid's start time, so a reused pid is not mistaken
    for the owner)."""
    pid = os.getpid()
    return {TAG_HOST: socket.gethostname(), TAG_PID: str(pid), TAG_PID_START: f"{_process_start(pid) or 0:.3f}"}


def owner_alive(tags: dict[str, str]) -> bool:
    """Whether the process that owns a run still runs. A run of another host, whose processes we cannot see, counts
    as alive; a run without owner tags (older fedmeet) as dead: nothing updates it any more."""
    if TAG_PID not in tags:
        return False
    if tags.get(TAG_HOST) != socket.gethostname():
        return True
    start = _process_start(int(tags[TAG_PID]))
    return start is not None and abs(start - float(tags.get(TAG_PID_START, 0))) < 1.0
