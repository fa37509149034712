"""Adapters of R runs stacked along a leading run dimension, applied to a run-major batch (docs/ARCHITECTURE.md,
"Training and federation"): the rows are R contiguous blocks of equal size, block r seen by run r's adapters, so
the backbone's frozen layers run once over all R runs' rows. HF ``generate`` keeps that layout (its beam expansion
repeats each row in place). Each stacked tensor is a leaf: one optimizer over them is each run's own optimizer
applied elementwise (AdamW has no cross-element term), when the runs share its settings."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pipeline.modeling.adapters import AdapterSet

_PARTS = ("down.weight", "down.bias", "up.weight", "up.bias", "norm.weight", "norm.bias")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [R, N, in] @ weight[r].T (+ bias[r])`` per run r (weight [R, out, in], as nn.Linear's)."""
    weight = weight.to(x.dtype)
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.to(x.dtype).unsqueeze(1), x, weight.transpose(1, 2))


class AdapterStack(nn.Module):
    """R runs' adapter sets as one: each ``AdapterSet.state()`` key's tensors stacked into a leaf [R, ...]."""

    def __init__(self, states: list[dict[str, torch.Tensor]], template: AdapterSet, device: torch.device | str):
        super().__init__()
        self.keys = list(template.leaves())  # the keys only: state() copies every tensor to the host
        for r, state in enumerate(states):
            if sorted(state) != sorted(self.keys):
                raise ValueError(f"adapter stack: run {r}'s state keys do not match the adapter set's")
        self.runs = len(states)
        stacked = {k: torch.stack([torch.as_tensor(s[k]) for s in states]).to(device, torch.float32) for k in self.keys}
        self.params = nn.ParameterDict({key.replace(".", "_"): nn.Parameter(t) for key, t in stacked.items()})
        self.eps = [adapter.norm.eps for adapter in template]

    def __getitem__(self, i: int) -> partial[torch.Tensor]:
        return partial(self.layer, i)

    def layer(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """Layer ``i``: ``Y_hat = LayerNorm(Y + ReLU(Y W_down) W_up)`` per run block of ``y``."""
        p = {part: self.params.get(f"layer{i}.{part}".replace(".", "_")) for part in _PARTS}
        r = self.runs
        if y.shape[0] % r:
            raise ValueError(f"adapter stack of {r} runs: {y.shape[0]} rows are not {r} equal run blocks")
        blocks = y.reshape(r, -1, y.shape[-1])  # [R, rows * positions, n]
        h = _linear(blocks, p["down.weight"], p["down.bias"]).relu()
        z = blocks + _linear(h, p["up.weight"], p["up.bias"])
        out = nn.functional.layer_norm(z, z.shape[-1:], eps=self.eps[i])
        out = torch.addcmul(p["norm.bias"].unsqueeze(1).to(out.dtype), out, p["norm.weight"].unsqueeze(1).to(out.dtype))
        return out.reshape(y.shape)

    def parameter_of(self, key: str) -> nn.Parameter:
        """The stacked leaf of ``AdapterSet.state()`` key ``key`` ([R, ...])."""
        return self.params[key.replace(".", "_")]

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Each run's adapters as ``AdapterSet.state()`` gives them (CPU float32 copies)."""
        cpu = {key: self.parameter_of(key).detach().to("cpu", torch.float32) for key in self.keys}
        return [{key: cpu[key][r].clone() for key in self.keys} for r in range(self.runs)]
