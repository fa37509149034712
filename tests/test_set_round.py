"""The set-round benchmark's clock (benchmarks/set_round.py) times the stacked calls without changing how the set's
barrier groups them."""

from __future__ import annotations

from benchmarks.set_round import _Clock
from pipeline.training import set_engine


def test_the_clock_leaves_every_delivery_of_a_round_in_one_stacked_call():
    calls: list[list[str]] = []

    def train(jobs):  # the stacked call: one result per job
        calls.append(list(jobs))
        return [job.upper() for job in jobs]

    def run(name):
        def target():
            return set_engine.park(lambda msg: set_engine.batched(msg, train), [name])

        return target

    clock = _Clock()
    undo = clock.install()
    try:
        results = set_engine.run({name: run(name) for name in ("a", "b", "c")})
    finally:
        undo()
    assert calls == [["a", "b", "c"]]
    assert results == {"a": ["A"], "b": ["B"], "c": ["C"]}
    assert clock.stacked > 0.0
