"""Every KD gate, by name: importing this module registers each gate module below."""

from __future__ import annotations

from pipeline.modeling.gates import entropy, every_token, margin, token_mask  # noqa: F401 (they register)
from pipeline.modeling.gates.registry import GATES, Gate

# The gate of each KD mode; selective KD's is the configuration's `gate` (train.kd_gate, default entropy).
MODE_GATES = {"kd": "every_token", "hard": "token_mask"}


def gate_of(cfg) -> Gate | None:
    """The gate of a loss configuration (KDConfig), or None for mode ce (no KD); kd_gate is one of GATES (KDConfig's
    GateName)."""
    return None if cfg.mode == "ce" else GATES[MODE_GATES.get(cfg.mode, cfg.kd_gate)]
