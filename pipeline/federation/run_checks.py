"""Checks around a deployed run: its run config before it starts (Flower refuses an unknown key only inside the
SuperLink and takes any TOML value for a known one), its status and MLflow run after it ends (``flwr run`` exits 0
whether the ServerApp returned or raised).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.common.config import ConfigError
from pipeline.federation.processes import FederationError

# Keys whose value is a count or a duration: a negative one has no meaning (0 = the default / "only at the end").
NON_NEGATIVE = ("evaluate-every", "round-timeout-s", "admission-timeout-s")


class RunConfigError(ConfigError):
    """A run config key or value the app does not accept (one line: the key and the problem)."""


# What the ServerApp reads (pipeline.federation.deployment), with the type of each value; pyproject.toml's
# [tool.flwr.app.config] declares the same keys with defaults of these types (tests/test_run_checks.py).
SERVER_KEYS: dict[str, type] = {"plan": str, "decoding": str, "evaluate": bool, "evaluate-every": int,
                                "mlflow": bool, "round-timeout-s": float, "admission-timeout-s": float,
                                # the ClientApps' run-time settings (pipeline.federation.protocol.client_cache_config)
                                "cache-dir": str, "cache-max-gb": float, "teacher-cache-gb": float}


_TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def check_run_config(values: dict[str, Any], keys: dict[str, type], source: str = "--run-config") -> None:
    """Every key of ``values`` is one of ``keys``, of its type (an integer is a number too), and the counts and
    durations are not negative; else :class:`RunConfigError` naming the first bad key."""
    for key, value in values.items():
        if key not in keys:
            raise RunConfigError(f"{source}: unknown key {key!r}; allowed: {sorted(keys)}")
        kind = keys[key]
        if not isinstance(value, (int, float) if kind is float else kind) or (
                kind in (int, float) and isinstance(value, bool)):  # a boolean is no number
            raise RunConfigError(f"{source}: {key}={value!r} must be {_TYPE_NAMES.get(kind, kind.__name__)}")
        if key in NON_NEGATIVE and value < 0:
            raise RunConfigError(f"{source}: {key}={value!r} must be >= 0")


def parse_run_status(text: str, run_id: int | None = None) -> tuple[str, str, str]:
    """(run id, status, details) of ``run_id`` - else of the run submitted last - in ``flwr ls --format json``
    output; raises FederationError when the SuperLink did not list it."""
    try:
        listed = json.loads(text)
    except json.JSONDecodeError:
        raise FederationError(f"`flwr ls` gave no run list: {' '.join(text.split())[-300:]}") from None
    if not listed.get("success"):  # flwr's JSON error: the SuperLink could not be asked at all
        raise FederationError("cannot reach the SuperLink: "
                              + " ".join(str(listed.get("error-message") or text).split())[-300:])
    runs = [r for r in (listed.get("runs") or []) if run_id is None or str(r.get("run-id")) == str(run_id)]
    if not runs:
        raise FederationError(f"the SuperLink lists no run{'' if run_id is None else f' {run_id}'}: "
                              f"{' '.join(text.split())[-300:]}")
    run = max(runs, key=lambda r: str(r.get("pending-at") or ""))  # Flower's run ids are random, not ordered
    details = str(run.get("status-details") or "")
    return str(run.get("run-id")), str(run.get("status", "")), "" if details == "N/A" else details  # N/A: none


def flwr(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """A ``flwr`` CLI command (the CLI beside this interpreter, whatever PATH says), its output captured."""
    cli = Path(sys.executable).parent / "flwr"
    return subprocess.run([str(cli) if cli.exists() else "flwr", *args], capture_output=True, text=True, **kwargs)


def close_left_running(workdir: Path, plan, reason: str) -> str | None:
    """Mark KILLED the MLflow run of ``plan``'s server (its id beside the server checkpoint) if it is RUNNING."""
    from pipeline.training.checkpoints import mlflow_run_id_path

    path = workdir / mlflow_run_id_path(plan)
    if not path.exists():
        return None
    from pipeline.results.tracking import _client

    run_id = path.read_text().strip()
    client = _client()
    if client.get_run(run_id).info.status != "RUNNING":
        return None
    client.set_tag(run_id, "fedmeet.end", f"marked KILLED by the local command: {reason}")
    client.set_terminated(run_id, status="KILLED")
    return run_id


def status_command(superlink: str | None, run_id: int | None, submitted: Path | None = None) -> int:
    """The manual recipe's check after ``flwr run``: one line with the status of the run ``submitted`` (what
    ``flwr run --format json`` printed) started, else ``run_id``, else the run submitted last; 0 only if it
    completed."""
    if submitted is not None:
        try:
            started = json.loads(submitted.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise FederationError(f"{submitted}: not the JSON `flwr run --format json` prints ({err})") from None
        if not (started.get("success") and started.get("run-id")):  # a refused run config, say
            print("no run started: " + " ".join(str(started.get("error-message") or "flwr run gave no run id")
                                                .split()))
            return 1
        run_id = int(started["run-id"])
    out = flwr("ls", *([superlink] if superlink else []), "--format", "json",
               *(["--run-id", str(run_id)] if run_id is not None else []), timeout=120)
    rid, status, details = parse_run_status(out.stdout, run_id)
    print(f"run {rid}: {status}" + (f" ({details})" if details else ""))
    return 0 if status == "finished:completed" else 1
