"""Probability-margin gate: distil a token when the teacher clearly prefers one word, its top-1 probability minus its
top-2 probability >= tau (tau in (0, 1]; tau_scale does not apply). An alternative to the entropy gate that ignores
how the rest of the probability mass is spread. Selected per experiment with ``kd_gate: margin`` (selective KD)."""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from pipeline.common.config import config
from pipeline.modeling.gates.registry import TeacherRows, register_gate


@config(frozen=True)
class MarginSettings:
    tau: Annotated[float, Field(gt=0.0, le=1.0)]  # a probability margin


@register_gate("margin", MarginSettings)
def gate(rows: TeacherRows, cfg) -> tuple[torch.Tensor, float]:
    margins = []
    with torch.no_grad():
        for s in range(0, rows.logits.shape[0], rows.chunk_rows):
            top2 = torch.softmax(rows.logits[s : s + rows.chunk_rows].float(), dim=-1).topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
    margin = torch.cat(margins) if margins else torch.zeros(0, device=rows.logits.device)
    return margin >= cfg.tau, float(cfg.tau)
