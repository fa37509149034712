"""The processes of a local deployment (pipeline.federation.localhost): each started in its own group and stopped
with the descendants it spawned, within bounded waits, also at interpreter exit; ports and waits on them."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HOST = "127.0.0.1"


class FederationError(RuntimeError):
    """A local deployment that could not start or did not finish, or a run none of whose clients trained (one line;
    pipeline.common.cli prints it)."""


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path
    descendants: set[int] = field(default_factory=set)  # pids seen under it (stopped with it)
    offset: int = 0  # the log's size when it started (an earlier run's lines come before: logs are appended)

    def alive(self) -> bool:
        return self.popen.poll() is None


class ProcessGroup:
    """The processes one deployment started; :meth:`stop_all` ends each one by its id, within bounded waits."""

    def __init__(self, log_dir: Path, env: dict[str, str], stop_timeout_s: float):
        self.log_dir, self.env, self.stop_timeout_s = log_dir, env, stop_timeout_s
        self.procs: list[Process] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop_all)  # a group not stopped yet is stopped at interpreter exit, whatever happened

    def start(self, name: str, argv: list[str], cwd: Path) -> Process:
        log = self.log_dir / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:  # the child has its own fd
            stdio = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": subprocess.STDOUT}
            popen = subprocess.Popen(argv, cwd=cwd, env=self.env, start_new_session=True, **stdio)
        self.procs.append(proc := Process(name, popen, log, offset=offset))
        return proc

    def stop(self, proc: Process, sig: int = signal.SIGTERM) -> None:
        """``sig`` to the process, its group and its descendants; SIGKILL to whatever is left after
        ``stop_timeout_s``; then reap it."""
        if proc.popen.returncode is not None:  # reaped already: its pid, and group id, may be another process's now
            return
        with contextlib.suppress(psutil.Error):  # Flower's SuperExec runs in its own session: a group kill misses it
            proc.descendants |= {p.pid for p in psutil.Process(proc.popen.pid).children(recursive=True)}
        pids = [proc.popen.pid, *sorted(proc.descendants)]
        for s in dict.fromkeys((sig, signal.SIGKILL)):
            for pid in pids:
                for kill in (os.killpg, os.kill):  # its group (children that kept it), then the pid itself
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        kill(pid, s)
            deadline = time.monotonic() + self.stop_timeout_s
            while time.monotonic() < deadline and any(_running(p) for p in pids):
                time.sleep(0.1)
            if not any(_running(p) for p in pids):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=self.stop_timeout_s)

    def stop_all(self) -> None:
        # A second Ctrl-C (or SIGTERM / SIGHUP: the local command's Ctrl-C too) must not cut the cleanup short.
        main = threading.current_thread() is threading.main_thread()
        stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if main else ()
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in stops}
        try:
            for proc in reversed(self.procs):
                self.stop(proc)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            atexit.unregister(self.stop_all)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_for(predicate, timeout_s: float, what: str, proc: Process) -> None:
    deadline = time.monotonic() + timeout_s
    while not (predicate() and proc.alive()):  # alive after: another process may answer for it (a taken port)
        if not proc.alive():
            tail = "\n".join(proc.log.read_text(errors="replace").splitlines()[-3:]) if proc.log.exists() else ""
            raise FederationError(
                f"{proc.name} exited (status {proc.popen.returncode}) before {what}; log {proc.log}: {tail!r}"
            )
        if time.monotonic() > deadline:
            raise FederationError(f"{what} did not happen within {timeout_s:.0f}s; log {proc.log}")
        time.sleep(0.2)


def port_open(port: int, p: Process) -> bool:  # p's own listener: not another's on a port taken meanwhile
    with contextlib.suppress(psutil.Error):
        return any(c.laddr.port == port and c.status == "LISTEN" for c in psutil.Process(p.popen.pid).net_connections())
    return False
