"""Who a tracked run is: where it came from (git commit and changed files, the DVC experiment), its name (the plan
settings that differ from the baseline commit's plan) and the process that owns it (host, pid and the pid's start
time), so a run whose process died can be told from one still running (pipeline.results.tracking marks it KILLED).
The run profile (preset) applied is pipeline.presets.preset_name: not imported here, so the train stage's code
holds no run-profile CLI."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from pipeline.common.config import flatten

# Run names longer than this are cut (the UI's table shows far less anyway).
_MAX_RUN_NAME_CHARS = 250

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


def _format_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    return str(v)


# Plan keys that identify rather than configure (the name already says them) or are derived hashes.
_NAME_IGNORED = ("experiment", "study", "paths.", "postags_md5", "extension_md5.")


def plan_differences(plan: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Plan settings whose value differs from the base plan's (or that the base lacks), flattened and sorted."""
    a, b = flatten(plan), flatten(base)
    out = {}
    for key in sorted(set(a) | set(b)):
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in _NAME_IGNORED):
            continue
        if key in a and (key not in b or a[key] != b[key]):
            out[key] = a[key]
    return out


def run_name(experiment: str, plan: dict[str, Any], base: dict[str, Any] | None) -> str:
    """``<experiment> key=value ...`` for the plan settings that differ from the base plan (e.g.
    ``fedselectkd-domain tau=3``), so ablation points of one experiment tell apart in the UI; ``train.`` is dropped
    from the keys. Deterministic: keys sorted, floats in shortest form."""
    if base is None:
        return experiment
    shown = {k.removeprefix("train."): v for k, v in plan_differences(plan, base).items()}
    parts = [f"{k}={_format_value(shown[k])}" for k in sorted(shown)]
    name = " ".join([experiment, *parts])
    return name if len(name) <= _MAX_RUN_NAME_CHARS else name[: _MAX_RUN_NAME_CHARS - 3] + "..."


def base_params(params_file: str, cwd: Path | None = None) -> dict[str, Any] | None:
    """The params file (``params_file``, relative to the repository root) of the commit the run is compared with:
    the DVC experiment's baseline when set, else HEAD."""
    import yaml

    rev = os.environ.get("DVC_EXP_BASELINE_REV") or "HEAD"
    text = _git("show", f"{rev}:{params_file}", cwd=cwd)
    if text is None:
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def base_plan(experiment: str, params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plan the base params (:func:`base_params`) give ``experiment`` (None when it has no such experiment or
    cannot)."""
    from pipeline.experiments import parse_entry, resolve_plan

    raw = ((params or {}).get("experiments") or {}).get(experiment)
    if raw is None:
        return None
    try:
        return resolve_plan(parse_entry(experiment, raw, params), params)
    except (ValueError, KeyError, TypeError):  # the base commit's params do not resolve with today's code
        return None


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
