"""Who a tracked run is: where it came from (git, the DVC experiment), its name and the process that owns it."""
from __future__ import annotations

import os
import socket
import subprocess

# Run tags (besides the experiment's own: method, partition, seed, study, experiment, backbone, engine).
TAG_HOST, TAG_PID, TAG_PID_START = "fedmeet.host", "fedmeet.pid", "fedmeet.pid_start"


def git_state() -> dict[str, str]:
    """Commit of the workspace, and whether tracked files but dvc.lock (`dvc repro` rewrites it) differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)dvc.lock"], capture_output=True, text=True, timeout=30).stdout
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
    import psutil

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
