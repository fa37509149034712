"""Selective knowledge distillation loss (METHOD.md section 4).

For every non-padding target token y_t (teacher forcing), with q_g the global (teacher) and q_l the local
(student) distribution of the LM head:

    H(q_g)  = -sum_v q_g(v) log q_g(v)                         (whole vocabulary; natural log by default)
    gate_t  = H(q_g) < tau          (mode "selective"; "kd": always; "ce": never; "hard": a given mask)
    L_t     = (1 - lambda) CE(q_l, y_t) + lambda KL(q_g || q_l)   if gate_t
    L_t     = CE(q_l, y_t)                                          otherwise (weight 1, not 1 - lambda)
    loss    = mean of L_t over the batch's non-padding tokens      ("tokens"; "sequences" = mean of per-sequence means)

Temperature T (standard KD, Hinton et al. 2015): KL is taken between softmax(z / T) distributions and multiplied
by T^2, so its gradient keeps the scale of the T = 1 case; CE and the entropy gate always use T = 1 (the gate
asks how confident the teacher itself is). With the default T = 1 all three coincide with the equations above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.data import IGNORE_INDEX

MODES = ("ce", "kd", "selective", "hard")
KL_DIRECTIONS = ("teacher_to_student", "student_to_teacher")
LOG_BASES = ("e", "2")
NORMALISATIONS = ("tokens", "sequences")


@dataclass
class KDConfig:
    mode: str = "selective"  # ce | kd | selective | hard
    lam: float = 0.2  # lambda, weight of the KL term on gated tokens
    tau: float = 5.0  # entropy threshold (in units of log_base)
    temperature: float = 1.0
    kl_direction: str = "teacher_to_student"  # KL(q_g || q_l); the alternative is KL(q_l || q_g)
    log_base: str = "e"  # unit of H(q_g) and so of tau: nats ("e") or bits ("2")
    normalisation: str = "tokens"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("mode", self.mode, MODES),
            ("kl_direction", self.kl_direction, KL_DIRECTIONS),
            ("log_base", str(self.log_base), LOG_BASES),
            ("normalisation", self.normalisation, NORMALISATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"KDConfig.{name}={value!r}; expected one of {allowed}")
        self.log_base = str(self.log_base)
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"KDConfig.lam={self.lam} must be in [0, 1]")
        if self.temperature <= 0:
            raise ValueError(f"KDConfig.temperature={self.temperature} must be > 0")


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    ce_mean: float  # mean CE over non-padding tokens
    kd_mean: float  # mean KL over gated tokens (0.0 when none)
    entropy: torch.Tensor  # [B, T] H(q_g) (0 where padding or no teacher)
    gate: torch.Tensor  # [B, T] bool, KD applied (False on padding)
    n_tokens: int  # non-padding target tokens
    n_kd: int  # gated tokens


def _entropy_from_logp(logp: torch.Tensor, log_base: str) -> torch.Tensor:
    h = -(logp.exp() * logp).sum(dim=-1)
    return h / math.log(2.0) if str(log_base) == "2" else h


def _kl_from_logp(logp_l: torch.Tensor, logp_g: torch.Tensor, direction: str) -> torch.Tensor:
    if direction == "teacher_to_student":  # KL(q_g || q_l)
        return (logp_g.exp() * (logp_g - logp_l)).sum(dim=-1)
    if direction == "student_to_teacher":  # KL(q_l || q_g)
        return (logp_l.exp() * (logp_l - logp_g)).sum(dim=-1)
    raise ValueError(f"unknown KL direction {direction!r}; expected one of {KL_DIRECTIONS}")


def _ce_from_logp(logp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    valid = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (-picked).masked_fill(~valid, 0.0)


def token_entropy(logits: torch.Tensor, log_base: str = "e") -> torch.Tensor:
    """H(softmax(logits)) over the last dimension, in nats ("e") or bits ("2")."""
    return _entropy_from_logp(F.log_softmax(logits.float(), dim=-1), log_base)


def cross_entropy_tokens(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token CE(q_l, y_t) [B, T]; 0 on padding (labels == -100)."""
    return _ce_from_logp(F.log_softmax(logits.float(), dim=-1), labels)


def kd_tokens(
    logits_local: torch.Tensor,
    logits_global: torch.Tensor,
    temperature: float = 1.0,
    direction: str = "teacher_to_student",
) -> torch.Tensor:
    """Per-token T^2 * KL between the tempered distributions [B, T]; teacher_to_student = KL(q_g || q_l)."""
    logp_l = F.log_softmax(logits_local.float() / temperature, dim=-1)
    logp_g = F.log_softmax(logits_global.detach().float() / temperature, dim=-1)
    return _kl_from_logp(logp_l, logp_g, direction) * temperature**2


def distillation_loss(
    logits_local: torch.Tensor,
    logits_global: torch.Tensor | None,
    labels: torch.Tensor,
    cfg: KDConfig,
    hard_mask: torch.Tensor | None = None,
) -> LossOutput:
    valid = labels != IGNORE_INDEX
    n_tokens = int(valid.sum())
    if n_tokens == 0:
        raise ValueError("distillation_loss: the batch has no non-padding target token")
    # log-softmax of each distribution once (the vocabulary dimension dominates the cost)
    logp_l = F.log_softmax(logits_local.float(), dim=-1)
    logp_g = F.log_softmax(logits_global.detach().float(), dim=-1) if logits_global is not None else None
    ce = _ce_from_logp(logp_l, labels)

    # H(q_g) is recorded for every token whenever the teacher is given, also in "ce" mode (the gate log needs it)
    entropy = _entropy_from_logp(logp_g, cfg.log_base) if logp_g is not None else torch.zeros_like(ce)
    if cfg.mode == "ce":
        gate = torch.zeros_like(valid)
    elif logp_g is None:
        raise ValueError(f"distillation_loss: mode {cfg.mode!r} needs the global (teacher) logits")
    elif cfg.mode == "kd":
        gate = valid.clone()
    elif cfg.mode == "selective":
        gate = (entropy < cfg.tau) & valid
    else:  # hard
        if hard_mask is None:
            raise ValueError("distillation_loss: mode 'hard' needs hard_mask [B, T]")
        if hard_mask.shape != labels.shape:
            raise ValueError(f"hard_mask shape {tuple(hard_mask.shape)} != labels shape {tuple(labels.shape)}")
        gate = hard_mask.to(torch.bool).to(valid.device) & valid
    entropy = entropy.masked_fill(~valid, 0.0)

    if not gate.any():
        kl = torch.zeros_like(ce)
    elif cfg.temperature == 1.0:
        kl = _kl_from_logp(logp_l, logp_g, cfg.kl_direction).masked_fill(~gate, 0.0)
    else:
        kl = kd_tokens(logits_local, logits_global, cfg.temperature, cfg.kl_direction).masked_fill(~gate, 0.0)
    per_token = torch.where(gate, (1.0 - cfg.lam) * ce + cfg.lam * kl, ce).masked_fill(~valid, 0.0)

    if cfg.normalisation == "tokens":
        loss = per_token.sum() / n_tokens
    else:
        per_seq_tokens = valid.sum(dim=1)
        has = per_seq_tokens > 0
        loss = (per_token.sum(dim=1)[has] / per_seq_tokens[has]).mean()

    n_kd = int(gate.sum())
    return LossOutput(
        loss=loss,
        ce_mean=float(ce.detach()[valid].mean()),
        kd_mean=float(kl.detach()[gate].mean()) if n_kd else 0.0,
        entropy=entropy.detach(),
        gate=gate,
        n_tokens=n_tokens,
        n_kd=n_kd,
    )


def selective_kd_loss(logits_local, logits_global, labels, lam: float = 0.2, tau: float = 5.0, **kw) -> LossOutput:
    return distillation_loss(logits_local, logits_global, labels, KDConfig(mode="selective", lam=lam, tau=tau, **kw))


def hard_kd_loss(logits_local, logits_global, labels, mask, lam: float = 0.2, **kw) -> LossOutput:
    """KD exactly on ``mask`` tokens (e.g. target nouns and verbs, METHOD.md experiment 10)."""
    return distillation_loss(logits_local, logits_global, labels, KDConfig(mode="hard", lam=lam, **kw), hard_mask=mask)
