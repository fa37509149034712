"""Faults the tests inject on purpose."""

from __future__ import annotations

import contextlib

import pytest


class Killed(Exception):
    """Stands for the training process dying (the exception unwinds it as a kill would stop it)."""


@contextlib.contextmanager
def killed_after_checkpoint(monkeypatch, rnd: int = 1):
    """The run inside dies right after the server checkpoint of round ``rnd`` is written (and before anything
    that round logs afterwards); the block must end by that death. The real checkpoint writer is restored after."""
    from pipeline.federation import server_app

    real_save = server_app.save_server_checkpoint

    def save_then_die(plan, r, *args, **kwargs):
        real_save(plan, r, *args, **kwargs)
        if r == rnd:
            raise Killed(f"simulated kill after round {rnd}'s checkpoint")

    monkeypatch.setattr(server_app, "save_server_checkpoint", save_then_die)
    try:
        with pytest.raises(Killed):
            yield
    finally:
        monkeypatch.setattr(server_app, "save_server_checkpoint", real_save)


def kill_supernode(fed, name: str) -> None:
    """Kill a SuperNode of a local deployment and what it spawned (SIGKILL: no goodbye to the SuperLink, as in a
    crash)."""
    import signal

    fed.procs.stop(fed.supernodes[name], signal.SIGKILL)


def restart_supernode(fed, name: str, timeout_s: float = 150.0):
    """Start ``name``'s SuperNode again until the SuperLink accepts it. With SuperNode authentication the
    SuperLink refuses the key while the killed node still counts as online (until two 30 s heartbeats are
    missed); without it the new process gets a new node id at once."""
    import time

    from pipeline.federation.localhost import FederationError

    deadline = time.monotonic() + timeout_s
    while True:
        proc = fed.start_supernode(name)
        try:
            fed.wait_registered(proc)
            return proc
        except FederationError:
            fed.procs.stop(proc)
            if time.monotonic() > deadline:
                raise
            time.sleep(2.0)
