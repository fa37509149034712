"""Differential privacy of what a client sends (params.yaml `privacy`, README "Privacy"): example-level DP-SGD
inside each organisation (mode ``example``, below), and the setting and accountant of client-level DP across
organisations (mode ``client``: :class:`FederationPrivacy`; the mechanism is Flower's DP strategy wrappers,
pipeline.federation.client_dp).

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

Secure aggregation (``secure_aggregation: true``, the ``secagg`` settings; pipeline.federation.secure_aggregation):
the server receives the weighted sum of the uploads through Flower's SecAgg+ protocol instead of each client's
upload. Only methods whose server merely averages can use it, and with mode client only client-side clipping
(:func:`secure_aggregation_refusal`).
"""
from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from pipeline.common.config import to_dict
from pipeline.federation.strategies.catalog import STRATEGIES

# The first adapter's input is the frozen prefix (no gradient): torch warns on every backward that opacus' full
# backward hook then sees only output gradients, which is all it needs.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs since no inputs require gradients")

MODES = ("none", "example", "client")
ACCOUNTANTS = ("rdp", "prv")
SAMPLING = "poisson"
CLIPPING_SIDES = ("server", "client")  # mode client: who clips a client's update (Flower wrapper or client mod)
CLIPPING_KINDS = ("fixed", "adaptive")  # mode client: fixed C, or Andrew et al.'s quantile-tracking C
# Keys one mode reads and the other ignores: a plan carries only its mode's keys (PrivacyConfig.plan_dict), so a
# key of the other mode changes no plan.
EXAMPLE_KEYS = ("max_grad_norm",)
CLIENT_KEYS = ("clipping_side", "clipping", "clipping_norm", "target_clipped_quantile", "clip_norm_lr",
               "clipped_count_stddev")
ADAPTIVE_KEYS = ("target_clipped_quantile", "clip_norm_lr", "clipped_count_stddev")
# Mode client, delta null: far below 1/N for every federation here (N <= 100 clients); N >= 1e5 must set delta.
CLIENT_DELTA = 1e-5
ADAPTIVE_INITIAL_NORM = 0.1  # mode client, adaptive, clipping_norm null: Andrew et al.'s recommended start
# The server algorithms (pipeline.federation.strategies) whose new global is the average of the replies and
# nothing more (Flower's FedProx only adds `proximal-mu` to the train config; each registers `averaging`): mode
# client's noise calibrates that mean, and SecAgg+ gives the server that mean and no single reply.
AVERAGING_STRATEGIES = tuple(name for name, spec in STRATEGIES.items() if spec.averaging)


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
    # mode client only (params.yaml says what each means)
    clipping_side: str = "server"
    clipping: str = "fixed"
    clipping_norm: float | None = None
    target_clipped_quantile: float = 0.5
    clip_norm_lr: float = 0.2
    clipped_count_stddev: float | None = None
    # SecAgg+, independent of the mode (params.yaml)
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
        self._check_client_keys()
        if self.noise_multiplier is not None and not (0 <= self.noise_multiplier < math.inf):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None and not (0 < self.target_epsilon < math.inf):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {self.target_epsilon}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1) (null = 1 / the client's training examples), got {self.delta}")
        if self.mode == "none":
            if self.noise_multiplier is not None or self.target_epsilon is not None:
                raise ValueError("noise_multiplier / target_epsilon are set but mode is 'none': set mode 'example' "
                                 "or 'client', or leave them null")
            return
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(f"mode {self.mode!r} needs exactly one of noise_multiplier and target_epsilon "
                             f"(got {self.noise_multiplier} and {self.target_epsilon})")
        if self.mode == "example" and math.isinf(self.max_grad_norm) and self.noise_multiplier != 0:
            # the noise std is sigma * C: unbounded clipping is only meaningful as the noise-free control
            raise ValueError("max_grad_norm .inf (no clipping) needs noise_multiplier 0 (noise std = sigma * C)")
        if self.mode == "client":
            if self.clipping == "fixed" and self.clipping_norm is None:
                raise ValueError("clipping_norm must be set with mode client and clipping fixed: the bound C on "
                                 "the L2 norm of a client's round update (no default fits every backbone)")
            if self.clipping_norm is not None and math.isinf(self.clipping_norm) and (
                    self.noise_multiplier != 0 or self.clipping == "adaptive"):
                raise ValueError("clipping_norm .inf (no clipping) needs clipping fixed and noise_multiplier 0 "
                                 "(noise std = noise_multiplier x C / sampled clients)")

    def _check_client_keys(self) -> None:
        if self.clipping_side not in CLIPPING_SIDES:
            raise ValueError(f"clipping_side must be one of {list(CLIPPING_SIDES)}, got {self.clipping_side!r}")
        if self.clipping not in CLIPPING_KINDS:
            raise ValueError(f"clipping must be one of {list(CLIPPING_KINDS)}, got {self.clipping!r}")
        if self.clipping_norm is not None and not self.clipping_norm > 0:
            raise ValueError(f"clipping_norm must be > 0 (.inf = no clipping), got {self.clipping_norm}")
        if not 0 <= self.target_clipped_quantile <= 1:
            raise ValueError(f"target_clipped_quantile must be in [0, 1], got {self.target_clipped_quantile}")
        if not 0 < self.clip_norm_lr < math.inf:
            raise ValueError(f"clip_norm_lr must be a finite number > 0, got {self.clip_norm_lr}")
        if self.clipped_count_stddev is not None and not 0 <= self.clipped_count_stddev < math.inf:
            raise ValueError(f"clipped_count_stddev must be a finite number >= 0 (null = sampled clients / 20), "
                             f"got {self.clipped_count_stddev}")

    @property
    def enabled(self) -> bool:
        """DP-SGD on (``mode`` not none); secure aggregation is :attr:`secure_aggregation`."""
        return self.mode != "none"

    def plan_dict(self) -> dict[str, Any]:
        """The group as a plan carries it: the keys of the other mode (and adaptive clipping's, unless on) left
        out, so they change no plan and an example-mode plan keeps its hash; with mode none only the mode; the
        SecAgg+ keys only when secure aggregation is on (plans without it keep their hash)."""
        drop = {"secure_aggregation", "secagg"}
        drop.update(CLIENT_KEYS if self.mode != "client" else EXAMPLE_KEYS)
        if self.mode == "client" and self.clipping != "adaptive":
            drop.update(ADAPTIVE_KEYS)
        record = {k: v for k, v in to_dict(self).items() if k not in drop} if self.enabled else {"mode": self.mode}
        if self.secure_aggregation:
            record |= {"secure_aggregation": True, "secagg": to_dict(self.secagg)}
        return record


def secure_aggregation_refusal(method, transfer_dtype: str, cfg: PrivacyConfig | None = None) -> str | None:
    """Why ``method`` (a MethodSpec) cannot run under SecAgg+ with ``train.transfer_dtype`` and the privacy group
    ``cfg``, or None. The server then sees only the weighted sum of the uploads, so it must need nothing else:
    FedAvg and FedProx (the proximal term is the client's) only average; FedOpt applies its server optimiser
    (momentum or Adam moments) to the average and FedNova normalises each client's update by that client's steps;
    `single` and `centralized` have no server. SecAgg+ quantises the fp32 upload itself, so the transfer stays
    fp32. With client-level DP the server never holds an update, so it cannot clip one: the client clips
    (``clipping_side: client``) before SecAgg+ masks its upload."""
    if cfg is not None and cfg.mode == "client" and cfg.clipping_side != "client":
        return ("privacy.mode client needs clipping_side client under SecAgg+: the server receives only the sum "
                "of the updates and cannot clip each one (the client clips its update before it is masked)")
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


def epsilon_of_history(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str = "rdp") -> float:
    """epsilon of a composition of Poisson-subsampled Gaussian mechanisms, ``(noise multiplier, q, steps)`` each
    (opacus' accountants take such a history); unbounded if any of them has no noise."""
    history = tuple((float(s), float(q), int(n)) for s, q, n in history if n > 0)
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    return _history_epsilon(history, float(delta), accountant)


@lru_cache(maxsize=256)
def _history_epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


# ------------------------------------------------------------------------------------ client-level (mode client)
def adaptive_update_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """Adaptive clipping releases two Gaussian sums per round: the clipped updates (multiplier z_u) and the count of
    clipped updates (std sigma_b). Flower adds Andrew et al.'s split ``z_u = (z'^-2 - (2 sigma_b)^-2)^-1/2`` of
    the multiplier z' it is given; that split assumes the count's sensitivity is 1/2 (TF Privacy centres each bit
    at -0.5), but Flower counts uncentred 0/1 bits, sensitivity 1, so the pair is a Gaussian mechanism of
    multiplier ``(z_u^-2 + sigma_b^-2)^-1/2``. Here z (``noise_multiplier``) is that combined multiplier, the
    one the accountant composes; this returns z_u (needs ``z < sigma_b``)."""
    if noise_multiplier == 0:
        return 0.0
    return (noise_multiplier ** -2 - count_stddev ** -2) ** -0.5


def flower_adaptive_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """The z' to hand Flower's adaptive wrappers so that their update noise is :func:`adaptive_update_multiplier`
    (Flower computes ``z_u = (z'^-2 - (2 sigma_b)^-2)^-1/2`` from it)."""
    if noise_multiplier == 0:
        return 0.0
    return (adaptive_update_multiplier(noise_multiplier, count_stddev) ** -2 + (2 * count_stddev) ** -2) ** -0.5


@dataclass(frozen=True)
class FederationPrivacy:
    """Client-level DP of a federated run (mode client): one client's whole contribution to every aggregate.

    Per round Flower samples ``sampled`` of the ``population`` clients; each sampled update ``W_i - W`` is clipped
    to C, the uniform mean is taken and N(0, (z_u C / sampled)^2) added to every coordinate (Flower's
    ``compute_stdv``). The accountant treats a round as the Poisson-subsampled Gaussian mechanism of rate
    ``q = sampled / population`` on the sum of clipped updates (DP-FedAvg, McMahan et al. 2018) and composes the
    rounds that released an aggregate."""

    noise_multiplier: float  # z: what the accountant composes per round (adaptive: updates and count together)
    update_noise_multiplier: float  # z_u: the noise on the mean update is z_u C / sampled (fixed: = z)
    count_stddev: float | None  # adaptive: sigma_b of the clipped count; None with fixed clipping
    clipping_norm: float  # fixed C, or adaptive clipping's initial C
    population: int
    sampled: int
    rounds: int
    delta: float
    accountant: str

    @property
    def sample_rate(self) -> float:
        return self.sampled / self.population

    def round_multiplier(self, aggregated: int) -> float:
        """The effective multiplier of a round that averaged ``aggregated`` updates: the noise stays
        z_u C / sampled, the sensitivity of a mean over fewer grows to C / aggregated (a client that did not reply
        makes the others' share larger)."""
        z_u = self.update_noise_multiplier * min(aggregated, self.sampled) / self.sampled
        if self.count_stddev is None or z_u == 0:
            return z_u
        return (z_u ** -2 + self.count_stddev ** -2) ** -0.5

    def epsilon(self, aggregated_per_round: list[int]) -> float:
        """epsilon after the given rounds (replies averaged in each; 0 = no release that round)."""
        rounds = Counter(k for k in aggregated_per_round if k > 0)  # composition is order-free: group equal rounds
        return epsilon_of_history(tuple((self.round_multiplier(k), self.sample_rate, n)
                                        for k, n in sorted(rounds.items())), self.delta, self.accountant)


def client_level_problem(method, transfer_dtype: str, cfg: PrivacyConfig) -> str | None:
    """Why mode client makes no sense for ``method`` (a pipeline.training.methods.MethodSpec), or None."""
    if not method.federated:
        what = "pools every client's data in one place" if method.pooled else "trains each client alone"
        return (f"method {method.name} {what}: no client update reaches a server aggregate, so there is no "
                f"client-level guarantee to give (mode example protects its examples in federated methods)")
    if method.strategy == "fednova":
        return ("method fednova: its server rescales each update by the client's own step count and by their "
                "weighted mean, so one client's influence on the aggregate is not bounded by C / sampled clients; "
                "use fedavg or fedprox")
    if method.strategy not in AVERAGING_STRATEGIES:
        return (f"method {method.name}: its server applies an optimiser (momentum, adaptive moments) to the mean "
                f"and keeps that un-noised state from round to round, while Flower's wrappers add the noise to the "
                f"optimiser's output: neither the sensitivity C / sampled clients nor the composition holds; use "
                f"fedavg or fedprox")
    if method.new_client == "post":
        return (f"method {method.name}: the population grows when the new client joins mid-run, so the number "
                f"sampled per round and the sampling rate change, while the noise is calibrated to one fixed "
                f"sample size")
    if cfg.clipping_side == "client" and transfer_dtype != "fp32":
        return (f"privacy.clipping_side client needs train.transfer_dtype fp32 (got {transfer_dtype}): Flower's "
                f"clipping mod clips the reply against the received arrays as they travel, encoded")
    return None


def federation_privacy(cfg: PrivacyConfig, population: int, sampled: int, rounds: int,
                       where: str = "privacy") -> FederationPrivacy:
    """Resolve z (from ``target_epsilon`` over all planned rounds if set), delta and the adaptive split for a
    federation of ``population`` clients sampling ``sampled`` per round."""
    if not 1 <= sampled <= population:
        raise ValueError(f"{where}: {sampled} sampled clients of {population}")
    delta = cfg.delta if cfg.delta is not None else CLIENT_DELTA
    if delta >= 1 / population:
        # a mechanism that publishes one random client's data in the clear meets (0, 1/N)
        raise ValueError(f"{where}: privacy.delta {delta:g} >= 1/{population} (1 / the number of clients) "
                         f"promises nothing; set it well below")
    q = sampled / population
    if cfg.noise_multiplier is not None:
        z = float(cfg.noise_multiplier)
    else:
        try:
            z = noise_for_target(float(cfg.target_epsilon), delta, q, rounds, cfg.accountant)
        except ValueError as exc:
            raise ValueError(f"{where}: privacy.target_epsilon {cfg.target_epsilon} cannot be met with "
                             f"q={q:.4g} over {rounds} rounds ({exc})") from None
    count_stddev = None
    z_u = z
    if cfg.clipping == "adaptive":
        count_stddev = cfg.clipped_count_stddev if cfg.clipped_count_stddev is not None else sampled / 20
        if z > 0 and not z < count_stddev:
            raise ValueError(f"{where}: privacy.noise_multiplier {z:.4g} (adaptive clipping) needs "
                             f"privacy.clipped_count_stddev > it (now {count_stddev:.4g}; null = sampled clients "
                             f"/ 20): the count's noise alone must not exceed the budget")
        z_u = adaptive_update_multiplier(z, count_stddev)
    norm = cfg.clipping_norm if cfg.clipping_norm is not None else ADAPTIVE_INITIAL_NORM
    return FederationPrivacy(z, z_u, count_stddev, float(norm), population, sampled, rounds, delta, cfg.accountant)


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
