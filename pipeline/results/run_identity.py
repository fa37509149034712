"""Who a tracked run is: where it came from (git commit and changed files, the DVC experiment), its name and the
process that owns it (host, pid and the pid's start time), so a run whose process died can be told from one still
running (pipeline.results.tracking marks it KILLED)."""
from __future__ import annotations

import os
import socket
import subprocess

# Run tags (besides the experiment's own: method, partition, seed, study, experiment, backbone, engine).
TAG_HOST, TAG_PID, TAG_PID_START = "fedmeet.host", "fedmeet.pid", "fedmeet.pid_start"


# ------------------------------------------------------------------------------------------------ provenance
def git_state() -> dict[str, str]:
    """Commit of the workspace (a DVC temporary workspace is a git checkout of the baseline) and whether tracked
    files differ from it. dvc.lock is left out: `dvc repro` rewrites it after each stage, which says nothing about
    the code or parameters the run used."""
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
    """The DVC experiment the run belongs to (DVC sets these for `dvc exp run`, queued and temporary runs too)."""
    names = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev"}
    return {tag: os.environ[var] for var, tag in names.items() if os.environ.get(var)}


def run_name(experiment: str) -> str:
    """The experiment, with the DVC experiment's name under `dvc exp run` (``fedselectkd-domain [tau-three]``): ablation
    points of one experiment tell apart in the UI and match their `dvc exp show` rows (their settings are params)."""
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
