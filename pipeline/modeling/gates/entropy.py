"""Selective KD's gate (METHOD.md section 4): distil a token when the teacher is confident, H(q_g) < threshold.
The threshold comes from ``tau`` as ``tau_scale`` reads it (pipeline.experiments.train_config.TauScale): an entropy
("absolute", the paper's 5 nats), a fraction of ln|V| ("max_entropy") or the tau-quantile of the batch's H(q_g)
("batch_quantile"), in ``entropy_log_base`` units."""

from __future__ import annotations

import math

import torch

from pipeline.modeling.gates.registry import TeacherRows, register_gate


@register_gate("entropy")
def gate(rows: TeacherRows, cfg) -> tuple[torch.Tensor, float | torch.Tensor]:
    if cfg.tau_scale == "absolute":
        threshold = float(cfg.tau)
    elif cfg.tau_scale == "max_entropy":
        to_unit = 1.0 / math.log(2.0) if cfg.entropy_log_base == "2" else 1.0
        threshold = float(cfg.tau * math.log(rows.logits.shape[-1]) * to_unit)
    else:  # batch_quantile: of the entropies the gate compares (another float32 evaluation differs in the last digits),
        threshold = torch.quantile(rows.entropy.double(), cfg.tau)  # left where it is (a read waits for a GPU)
    return rows.entropy < threshold, threshold
