"""The accountant of both DP modes (opacus' RDP or PRV) and their resolved settings (mode example: a client's,
:class:`ClientPrivacy`; mode client: a federation's, :class:`FederationPrivacy`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache

from pipeline.common.config import ConfigError, from_dict
from pipeline.experiments.privacy import DEFAULT_DELTA, SECAGG_MODULUS, PrivacyConfig, SecAggConfig

log = logging.getLogger("fedmeet.privacy")


@lru_cache(maxsize=256)
def bound(noise_multiplier: float, q: float, steps: int, delta: float, accountant: str = "rdp") -> tuple[float, str]:
    """(epsilon, the accountant that gave it): (epsilon, delta)-DP of ``steps`` Poisson-subsampled Gaussian steps
    (opacus' RDP or PRV accountant; inf without noise). PRV's numerics overflow at extreme settings (z 0.5, q 0.5,
    1000 steps: inf, where RDP gives ~904) or it raises (a grid too large for memory at a tiny z, floating point at a
    tiny delta, a discretisation off its mean at q 1): RDP's bound, as valid, is then the one reported, named and
    logged."""
    if steps <= 0:
        return 0.0, accountant
    if noise_multiplier <= 0:
        return math.inf, accountant
    from opacus.accountants import create_accountant  # lazy for start-up time: importing opacus takes ~6 s

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(noise_multiplier), float(q), int(steps))]
    try:
        eps = float(acc.get_epsilon(delta=float(delta)))
    except (MemoryError, ValueError, RuntimeError):
        if accountant != "prv":
            raise
        eps = math.inf
    if accountant == "prv" and not math.isfinite(eps):
        eps, accountant = bound(noise_multiplier, q, steps, delta, "rdp")
        log.warning(
            f"PRV could not bound epsilon at z={noise_multiplier:g}, q={q:g}, {steps} steps, "
            f"delta={delta:g}: RDP's bound {eps:.6g} is reported"
        )
    return eps, accountant


@lru_cache(maxsize=64)
def noise_for_target(target_epsilon: float, delta: float, q: float, steps: int, accountant: str) -> float:
    """The smallest z whose epsilon after ``steps`` is at most the target (opacus' search, to 0.01); where PRV raises
    (as in :func:`bound`), RDP's z, as valid (and larger), named and logged."""
    from opacus.accountants.utils import get_noise_multiplier  # lazy, as above

    search = {"target_epsilon": target_epsilon, "target_delta": delta, "sample_rate": q, "steps": steps}
    try:
        return float(get_noise_multiplier(**search, accountant=accountant, epsilon_tolerance=0.01))
    except (MemoryError, ValueError, RuntimeError) as exc:
        if accountant != "prv" or "budget is too low" in str(exc):
            raise
        log.warning(f"PRV could not search z for epsilon {target_epsilon:g} at delta={delta:g} ({exc}): RDP's is used")
    return noise_for_target(target_epsilon, delta, q, steps, "rdp")


def _noise(cfg: PrivacyConfig, delta: float, q: float, steps: int, where: str, what: str) -> float:
    if cfg.noise_multiplier is not None:
        return float(cfg.noise_multiplier)
    try:
        return noise_for_target(float(cfg.target_epsilon), delta, q, steps, cfg.accountant)
    except ValueError as exc:  # opacus: "The privacy budget is too low."
        raise ConfigError(
            f"{where}: privacy.target_epsilon {cfg.target_epsilon} cannot be met with q={q:.4g} "
            f"over {steps} {what} ({exc})"
        ) from None


@dataclass(frozen=True)
class FederationPrivacy:
    """Client-level DP of a federated run: DP-FedAvg (McMahan et al. 2018), composed once per round."""

    noise_multiplier: float  # z per round (adaptive: bound_after composes z rebuilt from z_u and sigma_b, not this)
    update_noise_multiplier: float  # z_u: the noise on the mean update is z_u C / sampled (fixed: = z)
    count_stddev: float | None  # adaptive: sigma_b of the clipped count; None with fixed clipping
    clipping_norm: float  # fixed C, or adaptive clipping's initial C
    population: int
    sampled: int  # the expected number of clients per round (Poisson: q x population)
    delta: float
    accountant: str

    @property
    def sample_rate(self) -> float:
        return self.sampled / self.population

    def bound_after(self, rounds: int) -> tuple[float, str]:
        """(epsilon, its accountant: :func:`bound`) after ``rounds`` rounds, empty samples too (adaptive: the
        updates' and count's z combined)."""
        z = self.update_noise_multiplier
        if self.count_stddev is not None and z != 0:
            z = (z**-2 + self.count_stddev**-2) ** -0.5
        return bound(z, self.sample_rate, rounds, self.delta, self.accountant)


def federation_privacy(
    cfg: PrivacyConfig, population: int, sampled: int, rounds: int, where: str = "privacy"
) -> FederationPrivacy:
    delta = cfg.delta if cfg.delta is not None else DEFAULT_DELTA
    if delta >= 1 / population:
        # a mechanism that publishes one random client's data in the clear meets (0, 1/N)
        raise ConfigError(
            f"{where}: privacy.delta {delta:g} >= 1/{population} (1 / the number of clients) "
            f"promises nothing; set it well below"
        )
    z = _noise(cfg, delta, sampled / population, rounds, where, "rounds")
    count_stddev, z_u = None, z
    if cfg.clipping == "adaptive":
        count_stddev = cfg.clipped_count_stddev if cfg.clipped_count_stddev is not None else sampled / 20
        if z > 0 and not z < count_stddev:
            raise ConfigError(
                f"{where}: privacy.noise_multiplier {z:.4g} (adaptive clipping) needs "
                f"privacy.clipped_count_stddev > it (now {count_stddev:.4g}; null = sampled clients "
                f"/ 20): the count's noise alone must not exceed the budget"
            )
        # z_u, the updates' own, so that with the count's sigma_b the pair is a Gaussian mechanism of
        # (z_u^-2 + sigma_b^-2)^-1/2 = z: Flower's 0/1 norm bits have sensitivity 1, not Andrew et al.'s 1/2
        z_u = 0.0 if z == 0 else (z**-2 - count_stddev**-2) ** -0.5
    norm = cfg.clipping_norm if cfg.clipping_norm is not None else 0.1  # adaptive: Andrew et al.'s initial C
    return FederationPrivacy(z, z_u, count_stddev, float(norm), population, sampled, delta, cfg.accountant)


def sampled_per_round(population: int, fraction_train: float) -> int:
    """The expected number of clients per round (what Flower's FedAvg samples)."""
    return max(int(population * fraction_train), 1)


def secure_sum_problem(secagg: SecAggConfig, clients: int, first: int, fraction_train: float) -> str | None:
    """Why SecAgg+ cannot run over ``clients`` (``first`` from round 1): a sum of one upload, or one wrapping around."""
    if (per_round := sampled_per_round(first, fraction_train)) < 2:
        return (
            f"privacy.secure_aggregation needs at least 2 clients in every round's sum; {first} clients x "
            f"train.fraction_train {fraction_train} samples {per_round}"
        )
    said, t, shares = f"{secagg.reconstruction_threshold:g}", secagg.reconstruction_threshold, secagg.num_shares
    if isinstance(t, float) and isinstance(shares, int) and shares > 2:  # Flower's threshold of a count of shares
        t = max(round(t * shares), 2)
        said += f" of num_shares {shares} = {t}"
    if isinstance(t, int) and t > per_round:  # Flower's clients refuse the setup
        return (
            f"privacy.secagg.reconstruction_threshold {said} > the {per_round} clients of a round's sum: none unmasks"
        )
    if clients * secagg.quantization_range >= SECAGG_MODULUS:  # the masked sum of the uploads wraps the modulus
        return (
            f"privacy.secagg.quantization_range {secagg.quantization_range} x {clients} clients >= 2**32: the masked "
            f"sum would wrap around; lower it below {SECAGG_MODULUS // clients}"
        )
    return None


def check_client_plans(plans: dict[str, dict], file: str = "params.yaml") -> None:
    """:func:`federation_privacy` of each privacy.mode client plan and :func:`secure_sum_problem` of each SecAgg+ plan
    (resolved, not yet written: the plan stage's and `presets check`'s): they need only the plan's clients (N),
    train.fraction_train and rounds."""
    for plan in plans.values():
        privacy = plan.get("privacy", {})
        if privacy.get("mode") != "client" and not privacy.get("secure_aggregation"):
            continue  # neither setting: nothing here to check (its privacy group was checked when it was resolved)
        clients, t, where = plan.get("clients", []), plan["train"], f"{file} experiments.{plan['experiment']}"
        cfg, n = from_dict(PrivacyConfig, privacy, where), len(clients)
        first = len([c for c in clients if c != t.get("new_client")])  # post_addition's new client joins late
        if cfg.secure_aggregation and (problem := secure_sum_problem(cfg.secagg, n, first, t["fraction_train"])):
            raise ConfigError(f"{where}: {problem}")
        if cfg.mode == "client":
            federation_privacy(cfg, n, sampled_per_round(n, t["fraction_train"]), t["rounds"], where)


def server_setting(plan, population: int) -> FederationPrivacy:
    """Mode client: the federation's setting under ``plan`` (``population`` clients, Flower's sample of them)."""
    sampled = sampled_per_round(population, plan.train.fraction_train)
    return federation_privacy(plan.privacy, population, sampled, plan.train.rounds, plan.source or plan.experiment)


@dataclass(frozen=True)
class ClientPrivacy:
    """A client's DP-SGD setting: fixed for all its rounds (its data size and the plan decide it)."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float  # Poisson: each example joins a step with this probability
    logical_batch: int  # expected examples per step (q n); the divisor of the noisy sum
    steps_per_epoch: int
    delta: float
    accountant: str


def client_privacy(plan, n_examples: int, where: str = "") -> ClientPrivacy:
    """Mode example: sigma, q and delta of a client of n training examples under ``plan`` (its logical batch is
    batch_size x grad_accum_steps); a delta of 1/n or more is refused: publishing one random example in the clear
    meets (0, 1/n)."""
    cfg, t = plan.privacy, plan.train
    logical_batch = t.batch_size * t.grad_accum_steps
    if n_examples < 1:
        raise ConfigError(f"{where}: no training example")
    delta = cfg.delta if cfg.delta is not None else min(DEFAULT_DELTA, 1.0 / (10 * n_examples))
    if delta >= 1.0 / n_examples:
        raise ConfigError(
            f"{where}: privacy.delta {cfg.delta:g} >= 1/{n_examples} (1 / the client's training "
            f"examples) promises nothing; set it well below (null = min(1e-5, 1/(10 n)))"
        )
    q = min(1.0, logical_batch / n_examples)
    per_epoch = math.ceil(n_examples / logical_batch)
    planned = t.rounds * t.local_epochs * per_epoch  # every round, every local epoch: what the noise is calibrated to
    z = _noise(cfg, delta, q, planned, where, "steps")
    return ClientPrivacy(
        z, float(cfg.max_grad_norm), q, min(logical_batch, n_examples), per_epoch, float(delta), cfg.accountant
    )
