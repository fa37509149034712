"""Every KD gate, by name: importing this module registers each gate module below."""

from __future__ import annotations

from pipeline.modeling.gates import entropy, every_token, margin, token_mask  # noqa: F401 (they register)
from pipeline.modeling.gates.registry import GATES, Gate

# The gate of each KD mode; selective KD's is the configuration's `gate` (train.kd_gate, default entropy).
MODE_GATES = {"kd": "every_token", "hard": "token_mask"}


def gate_of(mode: str, kd_gate: str) -> Gate | None:
    """The gate of KD mode ``mode`` (selective: ``kd_gate``, one of GATES), or None for mode ce (no KD)."""
    return None if mode == "ce" else GATES[MODE_GATES.get(mode, kd_gate)]
