"""Selective KD's gate (METHOD.md section 4): distil a token when the teacher is confident, H(q_g) < threshold.
The threshold comes from ``tau`` as ``tau_scale`` reads it (pipeline.experiments.train_config.TauScale): an entropy
("absolute", the paper's 5 nats), a fraction of ln|V| ("max_entropy") or the tau-quantile of the batch's H(q_g)
("batch_quantile"), in ``entropy_log_base`` units."""

from __future__ import annotations

import math

import torch

from pipeline.modeling.gates.registry import TeacherRows, register_gate, token_entropy


@register_gate("entropy")
def gate(rows: TeacherRows, cfg) -> tuple[torch.Tensor, float]:
    z_g, chunk_rows = rows.logits, rows.chunk_rows
    if cfg.tau_scale == "absolute":
        threshold = float(cfg.tau)
    elif cfg.tau_scale == "max_entropy":
        to_unit = 1.0 / math.log(2.0) if cfg.entropy_log_base == "2" else 1.0
        threshold = float(cfg.tau * math.log(z_g.shape[-1]) * to_unit)
    else:
        with torch.no_grad():  # batch_quantile: one extra pass over the teacher rows for their entropies
            h = torch.cat(
                [
                    token_entropy(z_g[s : s + chunk_rows], cfg.entropy_log_base)
                    for s in range(0, z_g.shape[0], chunk_rows)
                ]
            )
            threshold = float(torch.quantile(h.double(), cfg.tau))
    return rows.entropy < threshold, threshold
