"""FedKD's gate: distil every target token (KD mode ``kd``)."""

from __future__ import annotations

import torch

from pipeline.modeling.gates.registry import TeacherRows, register_gate


@register_gate("every_token")
def gate(rows: TeacherRows, cfg) -> tuple[torch.Tensor, float]:
    return torch.ones(rows.entropy.shape, dtype=torch.bool, device=rows.entropy.device), float("nan")
