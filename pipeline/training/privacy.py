"""Example-level differential privacy inside each organisation: DP-SGD on what a client sends (params.yaml
`privacy`, README "Privacy").

The mechanism (Abadi et al. 2016), per optimizer step of a client's local training:

- Sampling: Poisson. Every training example joins the step's logical batch independently with probability
  ``q = batch_size * grad_accum_steps / n`` (opacus' ``UniformWithReplacementSampler``, the sampler of its
  ``DPDataLoader``); an epoch is ``ceil(n / (batch_size * grad_accum_steps))`` such steps, as without privacy.
  The logical batch (random size, possibly empty) is cut into micro-batches of ``train.batch_size`` for memory.
- Per-example loss: a function of the example alone, so that clipping bounds its whole contribution. The
  project's token mean over the effective batch divides by the batch's token count, which depends on the other
  examples (removing one rescales everyone's share), so it cannot be clipped per example. Instead, with
  ``train.loss_normalisation: tokens``, ``l_i = sum_t L_t / max_target_length`` (every token weighs the same, as
  in the token mean, over a public denominator); with ``sequences``, ``l_i = mean_t L_t``.
- Per-example gradients ``g_i`` of ``l_i`` (opacus' ``GradSampleHooks`` on the local adapter set), clipped as
  opacus' DPOptimizer clips: ``g_i * min(1, C / (||g_i|| + 1e-6))``, summed over the micro-batches of the step.
- Noise ``N(0, sigma^2 C^2)`` on every coordinate of the sum, then division by the expected batch size ``q n``
  (public). A data-independent term (the FedProx proximal gradient) is added after the noise; AdamW's moments and
  weight decay are post-processing.

The accountant (opacus RDP or PRV) composes ``(sigma, q, steps)`` over every step the client takes in every round
it trains; each client reports ``(epsilon, delta)`` with ``delta = 1 / n`` unless set. ``target_epsilon`` gives
the noise multiplier from the planned steps: every round, ``rounds * local_epochs * steps_per_epoch`` (a client
sampled in fewer rounds ends below the target). The noise comes from torch's seeded generator (reproducible
runs); it is not a cryptographic source (opacus' secure_mode needs torchcsprng, which is not installed).

Secure aggregation (``secure_aggregation: true``, the ``secagg`` settings; pipeline.federation.secure_aggregation) is
independent of the mode: the server receives the weighted sum of the uploads through Flower's SecAgg+ protocol
instead of each client's upload. Only methods whose server merely averages can use it (:func:`secure_aggregation_refusal`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from pipeline.common.config import to_dict

# The first adapter's input is the frozen prefix (no gradient): torch warns on every backward that opacus' full
# backward hook then sees only output gradients, which is all it needs.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs since no inputs require gradients")

MODES = ("none", "example")
ACCOUNTANTS = ("rdp", "prv")
SAMPLING = "poisson"


# SecAgg+ masks are drawn in [0, 2**32) (Flower's default modulus_range): the masked sum of the quantised uploads
# and of their integer weights must stay below it.
SECAGG_MODULUS = 2**32


@dataclass
class SecAggConfig:
    """params.yaml `privacy.secagg`: Flower's SecAggPlusWorkflow settings (comments in params.yaml). Flower's own
    rules: a float num_shares is a fraction of the clients sampled in the round, an int a count > 2; a float
    reconstruction_threshold is a fraction of num_shares, an int a count below an int num_shares."""

    num_shares: int | float = 1.0
    reconstruction_threshold: int | float = 0.67
    clipping_range: float = 8.0
    quantization_range: int = 2**22

    def __post_init__(self) -> None:
        if isinstance(self.num_shares, float) and not 0 < self.num_shares <= 1:
            raise ValueError(f"num_shares as a fraction of the sampled clients must be in (0, 1], "
                             f"got {self.num_shares}")
        if isinstance(self.num_shares, int) and self.num_shares != 1 and self.num_shares <= 2:
            raise ValueError(f"num_shares as a count must be > 2 (or a fraction), got {self.num_shares}")
        t = self.reconstruction_threshold
        if isinstance(t, float) and not 0 < t <= 1:
            raise ValueError(f"reconstruction_threshold as a fraction of num_shares must be in (0, 1], got {t}")
        counted = isinstance(self.num_shares, int) and self.num_shares > 1  # Flower reads an int 1 as 1.0
        if isinstance(t, int) and not (t >= 2 and (not counted or t < self.num_shares)):
            raise ValueError(f"reconstruction_threshold as a count must be >= 2 and < num_shares, got {t}")
        if not 0 < self.clipping_range < math.inf:
            raise ValueError(f"clipping_range must be a finite number > 0, got {self.clipping_range}")
        if not 1 < self.quantization_range < SECAGG_MODULUS:
            raise ValueError(f"quantization_range must be in (1, 2**32), got {self.quantization_range}")


@dataclass
class PrivacyConfig:
    """params.yaml `privacy` (the comments on each key live in params.yaml)."""

    mode: str = "none"
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    max_grad_norm: float = 1.0
    delta: float | None = None
    accountant: str = "rdp"
    secure_aggregation: bool = False
    secagg: SecAggConfig = field(default_factory=SecAggConfig)

    def __post_init__(self) -> None:
        if isinstance(self.secagg, dict):
            self.secagg = SecAggConfig(**self.secagg)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {list(ACCOUNTANTS)}, got {self.accountant!r}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (.inf = no clipping), got {self.max_grad_norm}")
        if self.noise_multiplier is not None and not (0 <= self.noise_multiplier < math.inf):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None and not (0 < self.target_epsilon < math.inf):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {self.target_epsilon}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1) (null = 1 / the client's training examples), got {self.delta}")
        if self.mode == "none":
            if self.noise_multiplier is not None or self.target_epsilon is not None:
                raise ValueError("noise_multiplier / target_epsilon are set but mode is 'none': set mode 'example' "
                                 "or leave them null")
            return
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(f"mode {self.mode!r} needs exactly one of noise_multiplier and target_epsilon "
                             f"(got {self.noise_multiplier} and {self.target_epsilon})")
        if math.isinf(self.max_grad_norm) and self.noise_multiplier != 0:
            # the noise std is sigma * C: unbounded clipping is only meaningful as the noise-free control
            raise ValueError("max_grad_norm .inf (no clipping) needs noise_multiplier 0 (noise std = sigma * C)")

    @property
    def enabled(self) -> bool:
        """DP-SGD on (``mode`` not none); secure aggregation is :attr:`secure_aggregation`."""
        return self.mode != "none"

    def plan_record(self) -> dict:
        """The group as a plan carries it: the SecAgg+ keys only when secure aggregation is on (plans without it
        keep their hash), the DP-SGD keys only when a mode is on."""
        record = to_dict(self)
        del record["secure_aggregation"], record["secagg"]
        if not self.enabled:
            record = {"mode": self.mode}
        if self.secure_aggregation:
            record |= {"secure_aggregation": True, "secagg": to_dict(self.secagg)}
        return record


def secure_aggregation_refusal(method, transfer_dtype: str) -> str | None:
    """Why ``method`` (a MethodSpec) cannot run under SecAgg+ with ``train.transfer_dtype``, or None. The server
    then sees only the weighted sum of the uploads, so it must need nothing else: FedAvg and FedProx (the proximal
    term is the client's) only average; FedOpt applies its server optimiser (momentum or Adam moments) to the
    average and FedNova normalises each client's update by that client's steps; `single` and `centralized` have no
    server. SecAgg+ quantises the fp32 upload itself, so the transfer stays fp32."""
    from pipeline.federation.strategies import AVERAGING_STRATEGIES

    if not method.federated:
        return f"method {method.name!r} trains without a server: there is no aggregate to protect"
    if method.strategy not in AVERAGING_STRATEGIES:
        return (f"method {method.name!r}'s server ({method.strategy}) does more than average the uploads, and "
                f"SecAgg+ gives it only their weighted sum (servers that average: {', '.join(AVERAGING_STRATEGIES)})")
    if transfer_dtype != "fp32":
        return (f"train.transfer_dtype is {transfer_dtype}: SecAgg+ quantises the fp32 upload itself "
                f"(privacy.secagg), so the transfer must be fp32")
    return None


# ----------------------------------------------------------------------------------------------- accounting
def sample_rate(n_examples: int, logical_batch: int) -> float:
    """Poisson rate q: each example joins a step with this probability (expected batch = the effective batch)."""
    if n_examples < 1:
        raise ValueError("sample_rate: no training example")
    return min(1.0, logical_batch / n_examples)


def steps_per_epoch(n_examples: int, logical_batch: int) -> int:
    return math.ceil(n_examples / logical_batch)


def epsilon(noise_multiplier: float, q: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """(epsilon, delta)-DP of ``steps`` Poisson-subsampled Gaussian steps (opacus' RDP accountant, with its
    RDP-to-DP conversion of Balle et al. 2020, or the PRV accountant of Gopi et al. 2021)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return _epsilon(float(noise_multiplier), float(q), int(steps), float(delta), accountant)


@lru_cache(maxsize=256)
def _epsilon(noise_multiplier: float, q: float, steps: int, delta: float, accountant: str) -> float:
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, q, steps)]
    return float(acc.get_epsilon(delta=delta))


@lru_cache(maxsize=64)
def noise_for_target(target_epsilon: float, delta: float, q: float, steps: int, accountant: str) -> float:
    """The smallest noise multiplier (opacus' binary search, to 0.01 in epsilon) whose epsilon after ``steps``
    is at most ``target_epsilon``."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=q,
                                      steps=steps, accountant=accountant, epsilon_tolerance=0.01))


@dataclass(frozen=True)
class ClientPrivacy:
    """A client's DP-SGD setting: fixed for all its rounds (its data size and the plan decide it)."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    logical_batch: int  # expected examples per step (q n); the divisor of the noisy sum
    steps_per_epoch: int
    planned_steps: int  # every round, every local epoch
    delta: float
    accountant: str
    n_examples: int

    def epsilon(self, steps: int) -> float:
        return epsilon(self.noise_multiplier, self.sample_rate, steps, self.delta, self.accountant)


def client_privacy(cfg: PrivacyConfig, n_examples: int, logical_batch: int, rounds: int, local_epochs: int,
                   where: str = "") -> ClientPrivacy:
    """Resolve sigma, q and delta for a client with ``n_examples`` training examples."""
    if n_examples < 2 and cfg.delta is None:
        raise ValueError(f"{where}: {n_examples} training example(s): delta = 1/n is meaningless; set privacy.delta")
    delta = cfg.delta if cfg.delta is not None else 1.0 / n_examples
    q = sample_rate(n_examples, logical_batch)
    per_epoch = steps_per_epoch(n_examples, logical_batch)
    planned = rounds * local_epochs * per_epoch
    if cfg.noise_multiplier is not None:
        sigma = float(cfg.noise_multiplier)
    else:
        try:
            sigma = noise_for_target(float(cfg.target_epsilon), delta, q, planned, cfg.accountant)
        except ValueError as exc:  # opacus: "The privacy budget is too low."
            raise ValueError(f"{where}: privacy.target_epsilon {cfg.target_epsilon} cannot be met with q={q:.4g} "
                             f"over {planned} steps ({exc})") from None
    return ClientPrivacy(sigma, float(cfg.max_grad_norm), q, min(logical_batch, n_examples), per_epoch, planned,
                         delta, cfg.accountant, n_examples)


def poisson_steps(n_examples: int, q: float, n_steps: int, seed: int) -> list[list[int]]:
    """The example indices of each step: opacus' Poisson sampler with a seeded generator."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    generator = torch.Generator().manual_seed(seed)
    return [list(idx) for idx in UniformWithReplacementSampler(num_samples=n_examples, sample_rate=q,
                                                               generator=generator, steps=n_steps)]


# ----------------------------------------------------------------------------------------------- the step
class DPSGDStep:
    """Per-example clipping, summing across micro-batches and Gaussian noise for one adapter set.

    Usage per step: for each micro-batch, ``backward`` the sum of its per-example losses, then
    :meth:`accumulate`; after the last one, :meth:`finish` writes ``(sum clipped + noise) / logical_batch`` into
    ``p.grad``. Call :meth:`close` when done (removes opacus' hooks from the shared model)."""

    def __init__(self, module: torch.nn.Module, setting: ClientPrivacy, seed: int):
        from opacus.grad_sample import GradSampleHooks

        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.setting = setting
        # sum reduction: grad_sample[i] is the gradient of example i's own loss l_i (no batch-size rescaling)
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction="sum")
        self._generator = torch.Generator(device=self.params[0].device).manual_seed(seed)
        self._summed: list[torch.Tensor] | None = None
        self.clipped = 0  # per-example gradients whose norm exceeded C (over every step)
        self.examples = 0  # per-example gradients clipped or not

    def per_example_norms(self) -> torch.Tensor:
        grads = [p.grad_sample for p in self.params]
        return torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in grads], dim=1).norm(2, dim=1)

    def accumulate(self) -> torch.Tensor:
        """Clip this micro-batch's per-example gradients, add them to the step's sum; returns their norms."""
        norms = self.per_example_norms()
        c = self.setting.max_grad_norm
        factor = (c / (norms + 1e-6)).clamp(max=1.0)  # opacus' DPOptimizer formula (C = inf -> 1)
        clipped = [torch.einsum("i,i...->...", factor.to(p.grad_sample.dtype), p.grad_sample) for p in self.params]
        self._summed = clipped if self._summed is None else [s + g for s, g in zip(self._summed, clipped)]
        self.clipped += int((norms > c).sum())
        self.examples += len(norms)
        for p in self.params:
            p.grad_sample = None  # consumed: opacus would otherwise stack the next micro-batch onto it
            p.grad = None  # the unclipped sum autograd also accumulated is never used
        return norms

    def finish(self) -> None:
        """p.grad = (sum of clipped per-example gradients + N(0, sigma^2 C^2)) / expected batch size."""
        s = self.setting
        std = s.noise_multiplier * s.max_grad_norm if s.noise_multiplier > 0 else 0.0  # 0 * inf stays 0
        summed = self._summed or [torch.zeros_like(p) for p in self.params]  # an empty Poisson batch: noise only
        for p, total in zip(self.params, summed):
            noise = torch.normal(0.0, std, size=p.shape, generator=self._generator, device=p.device) if std else 0.0
            p.grad = ((total + noise) / s.logical_batch).to(p.dtype)
        self._summed = None

    def close(self) -> None:
        self._hooks.cleanup()
        for p in self.params:
            for attr in ("grad_sample", "_current_grad_sample"):
                if hasattr(p, attr):
                    delattr(p, attr)
