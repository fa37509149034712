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


def test_a_set_reads_and_restores_cuda_generators_only_in_a_process_that_initialised_cuda(monkeypatch):
    """A run's generators (set_engine.rng_state) include CUDA's only once the process has initialised CUDA: on a
    GPU host a CPU run must not create a CUDA context just to save them. Restored: CUDA's saved state, or with none
    saved (CUDA initialised since), a fresh process's CUDA generators, seeded from torch.initial_seed()."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: calls.append("get") or ["cuda state"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda state: calls.append(("set", state)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(("seed", seed)))
    state = set_engine.rng_state()
    assert state[3] is None
    set_engine.set_rng_state(state)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    set_engine.set_rng_state(state)  # saved before CUDA was initialised: CUDA's default seed
    assert calls == [("seed", torch.initial_seed())]
    calls.clear()
    state = set_engine.rng_state()
    set_engine.set_rng_state(state)
    assert state[3] == ["cuda state"] and calls == ["get", ("set", ["cuda state"])]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host without CUDA
    calls.clear()
    assert set_engine.rng_state()[3] is None
    set_engine.set_rng_state(state)
    assert calls == []
