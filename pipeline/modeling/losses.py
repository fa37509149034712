"""Selective knowledge distillation loss (METHOD.md section 4).

For every non-padding target token y_t (teacher forcing), with q_g the global (teacher) and q_l the local
(student) distribution of the LM head:

    H(q_g)  = -sum_v q_g(v) log q_g(v)                         (whole vocabulary; natural log by default)
    gate_t  = H(q_g) < tau          (mode "selective"; "kd": always; "ce": never; "hard": a given mask)
              (the gates are pipeline/modeling/gates/, one module each; selective KD's is train.kd_gate)
    L_t     = (1 - lambda) CE(q_l, y_t) + lambda KL(q_g || q_l)   if gate_t
    L_t     = CE(q_l, y_t)                                          otherwise (weight 1, not 1 - lambda)
    loss    = mean of L_t over the batch's non-padding tokens      ("tokens"; "sequences" = mean of per-sequence means)

Temperature T (standard KD, Hinton et al. 2015): KL is taken between softmax(z / T) distributions and multiplied
by T^2, so its gradient keeps the scale of the T = 1 case; CE and the entropy gate always use T = 1 (the gate
asks how confident the teacher itself is). With the default T = 1 all three coincide with the equations above.

Cost: the vocabulary dominates, so the loss runs on packed [N, V] rows of real tokens, chunk by chunk, one exp pass
per distribution and chunk, with the student gradient in closed form in the same pass (``_FusedDistillation``;
checked against autograd in tests/test_losses.py). The gate is decided before the kernel, which takes it as a mask."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field, model_validator

from pipeline.common.config import config
from pipeline.experiments.methods import KdMode
from pipeline.experiments.train_config import LossSettings
from pipeline.modeling.batching import IGNORE_INDEX
from pipeline.modeling.gates.catalog import GATES, MODE_GATES, gate_of
from pipeline.modeling.gates.registry import GATE_SETTINGS, TeacherRows

GateName = Literal[tuple(GATES)]  # type: ignore[valid-type]  # every registered gate (pipeline.modeling.gates)


@config
class KDConfig(LossSettings):
    """The loss of one client step: the plan's `train` keys of the loss (pipeline.training.client_training), its
    method's KD mode and its tau."""

    kd_gate: GateName = "entropy"  # selective KD's; kd and hard have their own (gates.catalog.MODE_GATES)
    mode: KdMode = "selective"
    tau: Annotated[float, Field(allow_inf_nan=True)] = 5.0  # the gate's threshold (inf: every token)

    @model_validator(mode="after")
    def _tau_is_a_fraction_unless_absolute(self) -> KDConfig:
        if self.tau_scale != "absolute" and not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau={self.tau} must be in (0, 1] with tau_scale {self.tau_scale!r}")
        if self.mode == "selective" and self.kd_gate == MODE_GATES["hard"]:  # no mask: every step would fail
            raise ValueError(f"kd_gate={self.kd_gate!r} distils a given token mask, which only method hardkd has")
        if self.mode == "selective" and (settings := GATE_SETTINGS.get(self.kd_gate)):
            settings(tau=self.tau)  # the gate's own bounds on its threshold
        return self


@dataclass
class LossOutput:
    """The tensors stay where they were computed: reading them is a host sync, so a trainer reads a round's at once
    when its steps are done (pipeline.training.client_training._round_sums)."""

    loss: torch.Tensor  # scalar, differentiable
    ce_rows: torch.Tensor  # [N] CE per non-padding token
    kl_rows: torch.Tensor  # [N] KL per non-padding token (0 where not gated)
    gate_rows: torch.Tensor  # [N] bool, KD applied
    entropy_rows: torch.Tensor  # [N] H(q_g) per non-padding token (0 where no teacher)
    n_tokens: int  # non-padding target tokens
    threshold: float | torch.Tensor = float("nan")  # what the gate compared with (log_base units; a quantile: a tensor)

    def means(self, n_kd: int) -> torch.Tensor:
        """[the loss, mean CE, mean KL over the ``n_kd`` gated tokens (``gate_rows.sum()``, read already; 0 when none)]
        where they were computed, with no host sync: the gated rows' indices are sized on the host."""
        kd = self.kl_rows.index_select(0, torch.nonzero_static(self.gate_rows, size=n_kd).squeeze(1))
        return torch.stack((self.loss.detach().float(), self.ce_rows.mean(), kd.mean() if n_kd else kd.sum()))


def _pack(logits: torch.Tensor, valid: torch.Tensor, name: str) -> torch.Tensor:
    """[B, T, V] -> the [N, V] rows at ``valid`` (row-major, as ``logits[valid]``); [N, V] is taken as packed."""
    n = int(valid.sum())
    if logits.shape[:-1] == valid.shape:
        return logits.reshape(-1, logits.shape[-1]) if n == valid.numel() else logits[valid]  # no copy if unpadded
    if logits.dim() == 2 and logits.shape[0] == n:
        return logits
    raise ValueError(
        f"distillation_loss: {name} must be [B, T, V] like the labels {tuple(valid.shape)} or packed "
        f"[N, V] with N = {n} non-padding tokens; got {tuple(logits.shape)}"
    )


def _softmax_lse(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(z) and logsumexp(z) over the last dim with one exp pass: lse = max - log p(argmax)."""
    m, idx = z.max(dim=-1, keepdim=True)
    p = torch.softmax(z, dim=-1)
    return p, (m - p.gather(-1, idx).log()).squeeze(-1)


class _FusedDistillation(torch.autograd.Function):
    """Each run's L = sum_t w_t [a_t CE_t + b_t T^2 KL_t] on packed rows, chunk by chunk (the [N, V] intermediates of
    one chunk stay in cache; one exp pass per distribution and chunk), with dL/dz_l written in the same pass:

        dCE/dz_l = q_l - onehot(y),   d(T^2 KL(p_g^T || q_l^T))/dz_l = T (q_l^T - p_g^T),
        d(T^2 KL(q_l^T || p_g^T))/dz_l = T q_l^T * (log q_l^T - log p_g^T - KL).

    The gate is given: ``gate`` [N] bool (False where no teacher), decided before the kernel; (a_t, b_t) are
    (``lam_off``, ``lam``) where gated, else (1, 0). ``z_g`` holds the first rows' teacher logits; ``spans`` are the
    runs' rows, whose losses come back as one vector."""

    @staticmethod
    def forward(
        ctx, z_l, z_g, y, row_weight, gate, lam, lam_off, t, direction, spans, run_of_row, chunk_rows, want_grad
    ):
        n, v = z_l.shape
        dev = z_l.device
        ce = torch.empty(n, device=dev)
        kl = torch.zeros(n, device=dev)
        grad = torch.empty(z_l.shape, dtype=z_l.dtype, device=dev) if want_grad else None
        taught = z_g.shape[0] if z_g is not None else 0
        starts = [*range(0, taught, chunk_rows), *range(taught, n, chunk_rows)]  # the rows with a teacher apart
        for s, e in zip(starts, [*starts[1:], n]):
            zl = z_l[s:e].float()
            y_c = y[s:e].unsqueeze(-1)
            q, lse_l = _softmax_lse(zl)
            ce[s:e] = lse_l - zl.gather(-1, y_c).squeeze(-1)
            g_c = gate[s:e]
            any_kd = s < taught and (z_l.is_cuda or bool(g_c.any()))  # skipped on the host only: no sync
            if any_kd:
                zg = z_g[s:e].float()
                zg_t, zl_t = (zg, zl) if t == 1.0 else (zg / t, zl / t)  # at T = 1 the student's pass is reused
                (p_t, lse_gt), (q_t, lse_lt) = _softmax_lse(zg_t), (q, lse_l) if t == 1.0 else _softmax_lse(zl_t)
                pt_dot_zgt = torch.linalg.vecdot(p_t, zg_t)
                if direction == "teacher_to_student":  # sum p (log p - log q)
                    kl_c = (lse_lt - lse_gt) + pt_dot_zgt - torch.linalg.vecdot(p_t, zl_t)
                else:  # sum q (log q - log p)
                    kl_c = (lse_gt - lse_lt) + torch.linalg.vecdot(q_t, zl_t) - torch.linalg.vecdot(q_t, zg_t)
                kl[s:e] = (kl_c * t * t).masked_fill(~g_c, 0.0)
            if want_grad:
                w = row_weight[s:e]
                a = (torch.where(g_c, lam_off[s:e], 1.0) * w).unsqueeze(-1)  # CE weight (1.0 * w is w exactly)
                b = (torch.where(g_c, lam[s:e], 0.0) * w * t).unsqueeze(-1) if any_kd else None  # KL (x T: dz/T)
                # written in place when the logits are float32; half-precision logits get a float32 chunk copied back
                gr = grad[s:e] if grad.dtype == torch.float32 else torch.empty(e - s, v, device=dev)
                if any_kd and direction == "teacher_to_student" and t == 1.0:
                    torch.mul(q, a + b, out=gr)  # a (q - onehot) + b (q - p), one pass
                    gr.addcmul_(p_t, b, value=-1.0)
                else:
                    torch.mul(q, a, out=gr)
                    if any_kd and direction == "teacher_to_student":
                        gr.add_(b * (q_t - p_t))
                    elif any_kd:
                        log_ratio = (zl_t - zg_t) - (lse_lt - lse_gt).unsqueeze(-1) - kl_c.unsqueeze(-1)
                        gr.add_(b * q_t * log_ratio)
                gr.scatter_add_(-1, y_c, -a)
                if gr.data_ptr() != grad[s:e].data_ptr():
                    grad[s:e] = gr
        rows = row_weight * (torch.where(gate, lam_off, 1.0) * ce + torch.where(gate, lam, 0.0) * kl)
        loss = torch.stack([rows[s:e].sum() for s, e in spans])  # each run's sum as alone: to the bit
        ctx.save_for_backward(grad if want_grad else torch.empty(0), run_of_row)
        ctx.mark_non_differentiable(ce, kl)
        return loss, ce, kl

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad, run_of_row = ctx.saved_tensors  # grad_loss: each run's loss's weight in the step
        scale = grad_loss if len(grad_loss) == 1 else grad_loss.index_select(0, run_of_row).unsqueeze(1)
        return (grad * scale.to(grad.dtype),) + (None,) * 12


def distillation_loss(
    logits_local: torch.Tensor,
    logits_global: torch.Tensor | None,
    labels: torch.Tensor,
    cfg: KDConfig,
    hard_mask: torch.Tensor | None = None,
) -> LossOutput:
    """The batch loss of the module docstring and per-token rows (entropy, gate ...: the labels' non-padding tokens,
    row-major). The logits are [B, T, V] (padding ignored) or packed [N, V] (``logits[labels != -100]``); computed in
    float32, :func:`chunk_rows_for` rows at a time (rows are independent: the chunking changes no result)."""
    valid = labels != IGNORE_INDEX
    z_l = _pack(logits_local, valid, "logits_local")
    z_g = _pack(logits_global.detach(), valid, "logits_global") if logits_global is not None else None
    return distillation_losses(z_l, z_g, [labels], [cfg], [hard_mask])[1][0]


def distillation_losses(
    z_l: torch.Tensor,
    z_g: torch.Tensor | None,
    labels: list[torch.Tensor],
    cfgs: list[KDConfig],
    hard_masks: list[torch.Tensor | None],
) -> tuple[torch.Tensor, list[LossOutput]]:
    """:func:`distillation_loss` of R runs at once, each run's output what it gives alone, to the bit
    (tests/test_losses.py). ``z_l``: the runs' packed student rows, run-major; ``z_g``: the packed teacher rows of
    the first runs (every run that distils among them); ``labels``, ``cfgs``, ``hard_masks``: a run each. One
    chunked pass over every run's rows and one gradient buffer, where a run's own call made ~100 operations and gave
    its slice of the logits a gradient of the whole group's size. Returns the runs' losses as one vector (backward
    through it: one gradient buffer) and each run's output (its ``loss`` an element of the vector)."""
    valids = [y != IGNORE_INDEX for y in labels]
    counts = [int(v.sum()) for v in valids]
    if 0 in counts:
        raise ValueError("distillation_loss: the batch has no non-padding target token")
    starts = [sum(counts[:r]) for r in range(len(cfgs) + 1)]
    taught = z_g.shape[0] if z_g is not None else 0  # rows with a teacher: those of the first runs
    if taught not in starts:
        raise ValueError(f"distillation_losses: {taught} teacher rows are not whole runs' rows ({starts})")
    runs_taught = starts.index(taught)
    if missing := [cfg.mode for cfg in cfgs[runs_taught:] if cfg.mode != "ce"]:
        raise ValueError(f"distillation_loss: mode {missing[0]!r} needs the global (teacher) logits")
    kernels = {(cfg.kd_temperature, cfg.kd_direction, cfg.entropy_log_base) for cfg in cfgs[:runs_taught]}
    if len(kernels) > 1:  # one kernel takes one temperature, direction and log base: each run alone
        alone = [
            distillation_losses(z_l[s:e], z_g[s:e] if s < taught else None, [y], [c], [h])[1][0]
            for y, c, h, s, e in zip(labels, cfgs, hard_masks, starts, starts[1:])
        ]
        return torch.stack([out.loss for out in alone]), alone
    t, direction, log_base = next(iter(kernels), (1.0, "teacher_to_student", "e"))
    dev, n = z_l.device, starts[-1]
    chunk_rows = chunk_rows_for(z_l)
    z_g = z_g.to(dev) if z_g is not None else None
    # w_t: the token's weight in its run's mean ("tokens": 1/N; "sequences": 1/(n_seq * len_b)); made on the host
    row_weight = torch.cat([_row_weights(*run) for run in zip(valids, counts, cfgs)]).to(dev, non_blocking=True)
    lam, lam_off, run_of_row = (
        torch.tensor(values).repeat_interleave(torch.tensor(counts)).to(dev, non_blocking=True)
        for values in ([float(c.kd_lambda) for c in cfgs], [1.0 - c.kd_lambda for c in cfgs], list(range(len(cfgs))))
    )
    y = torch.cat([y[v] for y, v in zip(labels, valids)]).to(dev, non_blocking=True)  # host labels: copied async
    entropy_p, gates, thresholds = torch.zeros(n, device=dev), [], [float("nan")] * len(cfgs)
    if taught:
        entropy_p[:taught] = teacher_entropy(z_g, log_base, chunk_rows)
    for r in range(runs_taught):
        s, e, cfg, hard_gate = starts[r], starts[r + 1], cfgs[r], None
        if (gate_rule := gate_of(cfg.mode, cfg.kd_gate)) is None:  # mode ce beside a teacher: its entropy only
            gates.append(torch.zeros(e - s, dtype=torch.bool, device=dev))
            continue
        if cfg.mode == "hard" and (mask := hard_masks[r]) is not None:  # without one, its gate says what is missing
            if mask.shape != labels[r].shape:
                raise ValueError(f"hard_mask shape {tuple(mask.shape)} != labels shape {tuple(labels[r].shape)}")
            hard_gate = mask.to(torch.bool).to(valids[r].device)[valids[r]]
        gate, thresholds[r] = gate_rule(TeacherRows(z_g[s:e], entropy_p[s:e], hard_gate, chunk_rows), cfg)
        gates.append(gate.to(device=dev, dtype=torch.bool))
    gate_p = torch.cat([*gates, torch.zeros(n - taught, dtype=torch.bool, device=dev)])  # no teacher: never gated
    spans = list(zip(starts, starts[1:]))
    args = (z_l, z_g, y, row_weight, gate_p, lam, lam_off, float(t), direction, spans, run_of_row)
    loss, ce, kl = _FusedDistillation.apply(*args, chunk_rows, torch.is_grad_enabled() and z_l.requires_grad)
    return loss, [
        LossOutput(loss[r], ce[s:e], kl[s:e], gate_p[s:e], entropy_p[s:e], counts[r], thresholds[r])
        for r, (s, e) in enumerate(spans)
    ]


def _row_weights(valid: torch.Tensor, count: int, cfg: KDConfig) -> torch.Tensor:
    if cfg.loss_normalisation == "tokens":
        return torch.full((count,), 1.0 / count, device=valid.device)
    per_seq_tokens = valid.sum(dim=1)
    return 1.0 / (per_seq_tokens[valid.nonzero()[:, 0]].float() * int((per_seq_tokens > 0).sum()))


CHUNK_ROWS_HOST = 128  # a chunk's [rows, V] intermediates stay in a CPU's cache
CHUNK_BYTES_DEVICE = 2**29  # on a GPU a chunk is one launch per operation: as large as 512 MiB of float32 rows


def chunk_rows_for(logits: torch.Tensor) -> int:
    """Rows of [N, V] logits the loss takes at a time: few on a CPU, many on a GPU (each chunk launches its kernels
    again: 128-row chunks made a GPU round host-bound)."""
    if logits.device.type == "cpu":
        return CHUNK_ROWS_HOST
    return max(CHUNK_ROWS_HOST, CHUNK_BYTES_DEVICE // (4 * logits.shape[-1]))


def teacher_entropy(z_g: torch.Tensor, log_base: str, chunk_rows: int = 128) -> torch.Tensor:
    """H(q_g) [N] of the packed teacher rows, chunk by chunk, as ``lse - sum_v p z`` (one exp pass per chunk)."""
    inv_log2 = 1.0 / math.log(2.0) if log_base == "2" else 1.0
    out = torch.empty(z_g.shape[0], device=z_g.device)
    with torch.no_grad():
        for s in range(0, z_g.shape[0], chunk_rows):
            zg = z_g[s : s + chunk_rows].float()
            p, lse_g = _softmax_lse(zg)
            out[s : s + chunk_rows] = (lse_g - torch.linalg.vecdot(p, zg)) * inv_log2
    return out
