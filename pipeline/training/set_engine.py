"""The set engine: the runs of a set train together in one process, each in its own thread with its own round loop,
and a round barrier where their clients' work executes (docs/ARCHITECTURE.md, "Training and federation").

One thread runs at a time, handed a baton in the set's order, so no two runs ever touch process-wide state (the
model's adapters, Flower's task identity) at once. A run's thread runs its server code until it needs its clients
(its grid's :meth:`RoundBarrier.park`), or until it ends; when every run still training has parked, the barrier
executes all their client work in one call (:meth:`RoundBarrier.execute`), hands each run its replies and goes
round again; a run that has ended (its stop rule, its last round) leaves the barrier. Each run keeps its own random
generators (Python's, NumPy's, torch's), swapped in whenever its code or its clients' work runs, from the process's
state when the set starts: every run computes what it would alone in a fresh process, whatever else is in the set.
A run that raises stops the set (as a killed process would): the others unwind from their barrier with
:class:`SetAborted`, and the first error is raised; a stop the process is told (SIGTERM, Ctrl-C) reaches the run
working at that moment too.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class SetAborted(Exception):
    """Raised inside a run's thread at its barrier when another run of the set failed (the set stops)."""


def rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_state(state: tuple) -> None:
    python, numpy, cpu, cuda = state
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if cuda is None:  # a fresh process's CUDA generators: the default seed
            torch.cuda.manual_seed_all(torch.initial_seed())
        else:
            torch.cuda.set_rng_state_all(cuda)


@dataclass
class Work:
    """A run's client messages at the barrier: ``deliver(message) -> reply`` runs one (its grid's client call)."""

    deliver: Callable[[Any], Any]
    messages: list
    replies: list = field(default_factory=list)


class _Member:
    def __init__(self, name: str, target: Callable[[], Any], rng: tuple):
        self.name, self.target, self.rng = name, target, rng
        self.resume = threading.Event()  # the baton, handed to this run's thread
        self.paused = threading.Event()  # ... and handed back (parked at the barrier, or ended)
        self.work: Work | None = None
        self.done = False
        self.aborted = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"run-{name}", daemon=True)

    @contextlib.contextmanager
    def own_rng(self) -> Iterator[None]:
        set_rng_state(self.rng)
        try:
            yield
        finally:
            self.rng = rng_state()

    def _main(self) -> None:
        _LOCAL.member = self
        self.resume.wait()
        self.resume.clear()
        try:
            with self.own_rng():
                self.result = self.target()
        except BaseException as exc:  # noqa: BLE001 -- handed to the coordinator, which raises it
            self.error = exc
        finally:
            self.done = True
            self.paused.set()

    def step(self) -> None:
        """Hand this run the baton and wait until it parks or ends (called by the coordinator)."""
        self.paused.clear()
        self.resume.set()
        self.paused.wait()


_LOCAL = threading.local()  # the member whose thread this is


class RoundBarrier:
    """The round barrier of a set: :meth:`run` trains its runs, each a callable whose grid parks here."""

    def __init__(self):
        self.members: list[_Member] = []

    def park(self, deliver: Callable[[Any], Any], messages: list) -> list:
        """Called by a run's grid in its thread: wait at the barrier until ``messages`` have been delivered; their
        replies in order."""
        member: _Member = _LOCAL.member
        member.rng = rng_state()
        member.work = Work(deliver, list(messages))
        member.paused.set()
        member.resume.wait()
        member.resume.clear()
        if member.aborted:
            raise SetAborted(f"run {member.name}: another run of its set failed; the set stops")
        set_rng_state(member.rng)
        work, member.work = member.work, None
        return work.replies

    def execute(self, parked: list[_Member]) -> None:
        """Every parked run's client work, in the set's order, each with its own generators."""
        for member in parked:
            with member.own_rng():
                member.work.replies = [member.work.deliver(m) for m in member.work.messages]

    def run(self, targets: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run ``targets`` (name -> a callable training one run) as a set, each from this process's generators as they
        are now; their results by name."""
        start = rng_state()
        self.members = [_Member(name, target, start) for name, target in targets.items()]
        for member in self.members:
            member.thread.start()
        try:
            while active := [m for m in self.members if not m.done]:
                for member in active:
                    self._step(member)
                failed = [m for m in self.members if m.error is not None and not isinstance(m.error, SetAborted)]
                if failed:
                    raise failed[0].error
                self.execute([m for m in self.members if not m.done])
        finally:
            self._abort()
        return {m.name: m.result for m in self.members}

    @staticmethod
    def _step(member: _Member) -> None:
        """The member's turn. The process told to stop meanwhile (SIGTERM's SystemExit, Ctrl-C: raised in this, the
        main thread) stops the member too: the same exception is raised in its thread, where the run unwinds as
        killed (its MLflow run closed), before it goes on here."""
        try:
            member.step()
        except BaseException as exc:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(member.thread.ident), ctypes.py_object(type(exc)))
            member.paused.wait()
            raise

    def _abort(self) -> None:
        """Unwind every run still parked (its thread raises SetAborted at its barrier and closes what it opened)."""
        for member in self.members:
            if not member.done and member.paused.is_set():
                member.aborted = True
                member.step()
        for member in self.members:
            if member.done:
                member.thread.join()
