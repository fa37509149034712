"""The stacked adapters of several runs (pipeline/modeling/adapter_stack.py): on a run-major batch, each block is
what its run's own AdapterSet makes of it, forward and gradient, and the states come back unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.modeling.adapter_stack import AdapterStack
from pipeline.modeling.adapters import AdapterConfig, AdapterSet

HIDDEN, RUNS, ROWS = 12, 3, 4


def _sets(bias: bool = True) -> list[AdapterSet]:
    """Runs with distinct, non-trivial adapters (W_up non-zero, LayerNorms not the identity)."""
    norms = [nn.LayerNorm(HIDDEN, eps=1e-7), None]
    sets = []
    for r in range(RUNS):
        s = AdapterSet(HIDDEN, AdapterConfig(top_k=2, bottleneck=5, bias=bias, seed=r), norms)
        generator = torch.Generator().manual_seed(100 + r)
        with torch.no_grad():
            for p in s.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
        sets.append(s)
    return sets


@pytest.mark.parametrize("bias", [True, False])
def test_each_run_block_is_its_own_adapter_sets_output_and_gradient(bias):
    sets = _sets(bias)
    stack = AdapterStack([s.state() for s in sets], sets[0], "cpu")
    y = torch.randn(RUNS * ROWS, 7, HIDDEN, generator=torch.Generator().manual_seed(0))
    out = stack[1](stack[0](y))
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ((out - target) ** 2).sum().backward()
    for r, s in enumerate(sets):
        block = slice(r * ROWS, (r + 1) * ROWS)
        own = s[1](s[0](y[block]))
        assert torch.allclose(out[block], own, atol=1e-6, rtol=0)
        ((own - target[block]) ** 2).sum().backward()
        for key, p in s.leaves().items():  # sums over 28 rows of 12 units: float32 rounding relative to their size
            scale = float(p.grad.abs().max())
            assert torch.allclose(stack.parameter_of(key).grad[r], p.grad, atol=1e-6 * scale, rtol=0), key


def test_blocks_stay_whole_when_rows_are_repeated_in_place_as_beam_search_does():
    sets = _sets()
    stack = AdapterStack([s.state() for s in sets], sets[0], "cpu")
    y = torch.randn(RUNS * ROWS, 5, HIDDEN, generator=torch.Generator().manual_seed(2))
    beams = y.repeat_interleave(4, dim=0)  # HF generate's expansion: each row's beams next to it
    out = stack[0](beams)
    for r, s in enumerate(sets):
        block = slice(r * ROWS * 4, (r + 1) * ROWS * 4)
        assert torch.allclose(out[block], s[0](beams[block]), atol=1e-6, rtol=0)


def test_states_come_back_exactly_and_a_mismatch_is_named():
    sets = _sets()
    states = [s.state() for s in sets]
    back = AdapterStack(states, sets[0], "cpu").states()
    assert [sorted(b) for b in back] == [sorted(s) for s in states]
    assert all(torch.equal(b[k], s[k]) for b, s in zip(back, states) for k in s)
    with pytest.raises(ValueError, match="run 1's state keys"):
        AdapterStack([states[0], {k: v for k, v in states[1].items() if "up" not in k}], sets[0], "cpu")
    with pytest.raises(ValueError, match="rows are not 3 equal run blocks"):
        AdapterStack(states, sets[0], "cpu")[0](torch.zeros(4, HIDDEN))
