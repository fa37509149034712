"""The KD gate registry: which target tokens the local loss distils, decided from the teacher before the fused loss
kernel (pipeline.modeling.losses). A gate module (gates/<name>.py) registers ``gate(rows, cfg) -> (mask [N] bool,
threshold)`` with :func:`register_gate` (``cfg``: KDConfig; threshold NaN when it has none), and the settings class
of its threshold when tau means something else than the entropy gate's (a ``@config`` class with field ``tau``: its
bounds are checked wherever a KDConfig is built, so at planning time); ``catalog`` imports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TeacherRows:
    logits: torch.Tensor  # [N, V] the teacher's logits of the batch's N non-padding target tokens (no gradient)
    entropy: torch.Tensor  # [N] H(q_g) in the configuration's log_base units (float32)
    mask: torch.Tensor | None = None  # [N] bool, the given token mask (hard KD: the target nouns and verbs)
    chunk_rows: int = 128  # rows per pass, for a gate that runs over the logits again


Gate = Callable[[TeacherRows, Any], tuple[torch.Tensor, float]]
GATES: dict[str, Gate] = {}
GATE_SETTINGS: dict[str, type] = {}  # gate name -> the @config class that checks its tau


def register_gate(name: str, settings: type | None = None):
    """Decorator on a gate module's function: registers KD gate ``name`` (and the class checking its tau)."""

    def register(gate: Gate) -> Gate:
        if name in GATES:
            raise ValueError(f"KD gate {name!r} is registered twice")
        GATES[name] = gate
        if settings is not None:
            GATE_SETTINGS[name] = settings
        return gate

    return register
