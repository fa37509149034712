"""Hard KD's gate (METHOD.md experiment 10): distil exactly the given tokens (the target nouns and verbs)."""

from __future__ import annotations

import torch

from pipeline.modeling.gates.registry import TeacherRows, register_gate


@register_gate("token_mask")
def gate(rows: TeacherRows, cfg) -> tuple[torch.Tensor, float]:
    if rows.mask is None:
        raise ValueError("distillation_loss: mode 'hard' needs hard_mask [B, T]")
    return rows.mask, float("nan")
