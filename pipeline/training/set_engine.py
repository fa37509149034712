"""The set engine: the runs of a set train together in one process, each in its own thread with its own round loop,
and a round barrier where their clients' work executes (docs/ARCHITECTURE.md, "Training and federation").

One thread runs at a time, handed a baton in the set's order, so no two runs ever touch process-wide state (the
model's adapters, Flower's task identity) at once. A run's thread runs its server code until it needs its clients
(:func:`park`), or until it ends; when every run still training has parked, the barrier
executes all their client work (:func:`_execute`), hands each run its replies and goes round again; a
run that has ended (its stop rule, its last round) leaves the barrier. Each client message is delivered in a thread
of its own (the same baton): its local training waits in :func:`batched` until every delivery of the round has
reached its own or ended, and then all of them train in one call (pipeline.training.local_batch). Each run keeps
its own random generators (Python's, NumPy's, torch's), swapped in whenever its code or its clients' work runs, from the
process's state when the set starts: every run computes what it would alone in a fresh process, whatever else is in the
set. A run that raises stops the set (as a killed process would): the others unwind from their barrier with
:class:`SetAborted`, and the first error is raised; a stop the process is told (SIGTERM, Ctrl-C) reaches the run working
at that moment too.
"""

from __future__ import annotations

import ctypes
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
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
    """What a member parks with, done at the barrier: a run's client messages ``given`` (``call(message) -> reply``
    runs one, its grid's client call; ``result`` the replies), or a delivery's local training job ``given``
    (``call(jobs) -> results`` trains every delivery's at once; ``result`` its own)."""

    call: Callable
    given: Any
    result: Any = None


class _Member:
    """A thread handed the baton: a run of the set, or (``delivery``) one client message of a round."""

    def __init__(self, name: str, target: Callable[[], Any], rng: tuple, delivery: bool = False):
        self.name, self.target, self.rng, self.delivery = name, target, rng, delivery
        self.resume = threading.Event()  # the baton, handed to this run's thread
        self.paused = threading.Event()  # ... and handed back (parked at the barrier, or ended)
        self.work: Work | None = None
        self.done = False
        self.aborted = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"run-{name}", daemon=True)
        self.thread.start()  # it waits for the baton

    def _main(self) -> None:
        _LOCAL.member = self
        self.resume.wait()
        self.resume.clear()
        try:
            set_rng_state(self.rng)  # the run's own generators, kept when it ends
            self.result = self.target()
        except BaseException as exc:  # noqa: BLE001 -- handed to the coordinator, which raises it
            self.error = exc
        finally:
            self.rng = rng_state()
            self.done = True
            self.paused.set()

    def step(self) -> None:
        """Hand this run the baton and wait until it parks or ends (called by the coordinator)."""
        self.paused.clear()
        self.resume.set()
        self.paused.wait()

    def pause(self, work: Any) -> Any:
        """Called in this member's thread: hand the baton back with ``work`` and wait for it, done."""
        self.rng = rng_state()
        self.work = work
        self.paused.set()
        self.resume.wait()
        self.resume.clear()
        if self.aborted:
            raise SetAborted(f"run {self.name}: another run of its set failed; the set stops")
        set_rng_state(self.rng)
        work, self.work = self.work, None
        return work


_LOCAL = threading.local()  # the member whose thread this is


def run(targets: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run ``targets`` (name -> a callable training one run) as a set, each from this process's generators as they are
    now, their client work at the set's round barrier (:func:`park`); their results by name."""
    start = rng_state()
    members = [_Member(name, target, start) for name, target in targets.items()]
    deliveries: list[_Member] = []  # this round's client messages, while they are delivered
    try:
        while active := [m for m in members if not m.done]:
            for member in active:
                _step(member)
            if failed := [m for m in members if m.error is not None and not isinstance(m.error, SetAborted)]:
                raise failed[0].error
            _execute([m for m in members if not m.done], deliveries)
    finally:  # unwind every run still parked (its thread raises SetAborted at its barrier and closes what it opened)
        for member in deliveries + members:
            if not member.done and member.paused.is_set():
                member.aborted = True
                member.step()
        for member in deliveries + members:
            if member.done:
                member.thread.join()
    return {m.name: m.result for m in members}


def _execute(parked: list[_Member], deliveries: list[_Member]) -> None:
    """Every parked run's client messages, each in its own thread (``deliveries`` while they are delivered), in the
    set's order and each run's with its generators: a message's local training waits (:func:`batched`) until all have
    reached theirs or ended; they train in one call, and the deliveries end in the same order (those of one run see
    its generators as one after the other would: a delivery starts from where the one before it paused)."""
    by_run: dict[_Member, list[_Member]] = {member: [] for member in parked}
    for member, ds in by_run.items():
        for m in member.work.given:
            d = _Member(f"{member.name}-client", partial(member.work.call, m), member.rng, delivery=True)
            ds.append(d)
            deliveries.append(d)
            _step(d)
            member.rng = d.rng
    while waiting := [d for d in deliveries if not d.done]:
        for call in dict.fromkeys(d.work.call for d in waiting):  # e.g. training, validation
            same = [d for d in waiting if d.work.call is call]
            for d, result in zip(same, call([d.work.given for d in same])):
                d.work.result = result
        for d in waiting:
            _step(d)
    for member, ds in by_run.items():
        for d in ds:
            d.thread.join()
            if d.error is not None:
                raise d.error
        member.work.result = [d.result for d in ds]
        member.rng = ds[-1].rng if ds else member.rng
    deliveries.clear()


def _step(member: _Member) -> None:
    """The member's turn. The process told to stop meanwhile (SIGTERM's SystemExit, Ctrl-C: raised in this, the main
    thread) stops the member too: the same exception is raised in its thread, where the run unwinds as killed (its
    MLflow run closed), before it goes on here."""
    try:
        member.step()
    except BaseException as exc:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(member.thread.ident), ctypes.py_object(type(exc)))
        member.paused.wait()
        raise


def park(deliver: Callable[[Any], Any], messages: list) -> list:
    """``deliver`` of each of ``messages``, their replies in order: called by a run of a set (in its thread), at the
    barrier with the other runs' client work; elsewhere (a run alone), here, one after the other."""
    member = getattr(_LOCAL, "member", None)
    if member is None or member.delivery:
        return [deliver(m) for m in messages]
    return member.pause(Work(deliver, list(messages))).result


def batched(job: Any, run: Callable[[list], list]) -> Any:
    """``run([job])[0]``, or in a delivery at the barrier: ``job`` trained with every other delivery's of the round
    (``run`` gets them all, in the set's order, and returns each one's result or exception)."""
    member = getattr(_LOCAL, "member", None)
    result = member.pause(Work(run, job)).result if member is not None and member.delivery else run([job])[0]
    if isinstance(result, BaseException):
        raise result
    return result
