"""Client-level differential privacy across organisations (params ``privacy.mode: client``, README "Privacy"):
Flower 1.41's DP strategy wrappers around the FedAvg-family strategy, the matching client mods, and what each
round records. The setting and the accountant are pipeline.privacy (:class:`FederationPrivacy`).

- Server-side clipping (``clipping_side: server``): ``DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping``
  clip every reply's update ``W_i - W`` to C on the server (which sees the updates in the clear: central DP
  trusts it), average, and add N(0, (z_u C / m)^2) to every coordinate.
- Client-side clipping (``clipping_side: client``): ``DifferentialPrivacyClientSide{Fixed,Adaptive}Clipping``
  send C in the train config; Flower's ``fixedclipping_mod`` / ``adaptiveclipping_mod`` on the ClientApp's train
  handler clip the reply against the weights received, so the server never holds an unclipped update (the
  precondition of secure aggregation); the server averages and adds the same noise.
- Under SecAgg+ (``privacy.secure_aggregation``, client-side clipping only: pipeline.privacy
  .secure_aggregation_refusal) the mod clips inside ``secaggplus_mod`` before the upload is masked, each client
  weighs 1 in the masked sum and its clipped bit is summed with it (pipeline.privacy.secure_aggregation); the
  secure step bypasses ``aggregate_train``, so the server hands the unmasked mean to the wrapper's
  :meth:`_FedmeetDP.release_secure_mean`, which adds the same noise from the same seeded generator.

What fedmeet changes in Flower's wrappers, and why:
- Uniform weights. FedAvg weights a reply by its ``num-examples``; the noise ``z C / m`` calibrates a mean in
  which each client weighs 1/m, so a client weighing more than that would be under-noised (Flower's own
  accountant refuses unequal weights). The wrappers below aggregate with weight 1 per reply; the clients'
  ``num-examples`` still reach the records.
- The noise and the adaptive clipped count come from a generator seeded per (experiment seed, round), not from
  numpy's global one: runs are reproducible and a resumed run draws what the uninterrupted one would have. The
  seed is in the plan, so the noise is not secret from whoever has the plan (as for DP-SGD's noise).
- Noise multiplier 0 adds nothing (Flower would draw N(0, 0 * inf) = NaN with the unclipped control, C = .inf).
- Adaptive clipping, two fixes. (1) The direction of C's update: Flower 1.41 multiplies C by
  ``exp(-lr (clipped fraction - target))``, which shrinks C when too many updates are clipped (C runs to 0, or to
  infinity); Andrew et al.'s rule ``C exp(-lr (unclipped fraction - target unclipped quantile))`` is, in the
  clipped fraction f and the target clipped quantile t, ``C exp(lr (f - t))``, whose fixed point clips a
  fraction t. (2) The noise: Flower updates C before it adds the round's noise, so the noise is scaled by next
  round's C, not by the C the updates were clipped to (under-noised whenever C shrinks); here it uses the
  round's C. The accounting of Flower's uncentred clipped count is pipeline.privacy's.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (DifferentialPrivacyClientSideAdaptiveClipping,
                                     DifferentialPrivacyClientSideFixedClipping,
                                     DifferentialPrivacyServerSideAdaptiveClipping,
                                     DifferentialPrivacyServerSideFixedClipping)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, compute_stdv, get_norm

from pipeline.experiments import Plan
from pipeline.federation.protocol import (ARRAYS_KEY, CLIPPED_KEY, CONFIG_KEY, METRICS_KEY, load_plan,
                                          plan_path_of)
from pipeline.privacy.secure_aggregation import is_legacy_fit
from pipeline.privacy.accounting import FederationPrivacy, federation_privacy, flower_adaptive_multiplier
from pipeline.privacy.settings import client_level_problem
from pipeline.training.seeds import derived_seed

log = logging.getLogger("fedmeet.federated")

UNIFORM_WEIGHT_KEY = "dp-unit-weight"
SAMPLING_STREAM = 1  # the Poisson sample's generator: [seed, round, 1] (the noise's is [seed, round])  # set by the server on each reply it aggregates under mode client


def sampled_per_round(population: int, fraction_train: float) -> int:
    """The expected number of clients per round, ``max(int(n * fraction_train), 1)`` (what Flower's FedAvg samples
    as a fixed count); under client-level DP each client joins with probability this / n."""
    return max(int(population * fraction_train), 1)


def poisson_sample(node_ids: list[int], rate: float, rng: np.random.Generator) -> list[int]:
    """Each node independently with probability ``rate`` (one uniform draw per node, in the given order)."""
    return [n for n, u in zip(node_ids, rng.random(len(node_ids))) if u < rate]


class _ChosenNodes:
    """A Grid that shows the inner strategy only the round's Poisson sample (it configures every node it sees)."""

    def __init__(self, grid, nodes: list[int]):
        self._grid, self._nodes = grid, list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self._nodes)

    def __getattr__(self, name):
        return getattr(self._grid, name)


class _FedmeetDP:
    """Mixed into each Flower DP wrapper: Poisson sampling of clients and the public denominator, uniform weights,
    seeded noise, no noise at multiplier 0, and adaptive clipping's direction and noise scale (module
    docstring). The inner strategy runs with fraction_train 1: it configures every client of the sample."""

    seed: int
    sample_rate: float  # q: each client joins a round with this probability
    _rng: np.random.Generator
    _round_clipping_norm: float
    _round_arrays: ArrayRecord | None = None  # the global the round's updates are taken against
    _round_count: int = 0  # updates in this round's aggregate

    def _start_round(self, server_round: int) -> None:
        self._rng = np.random.default_rng([self.seed, server_round])
        self._round_clipping_norm = self.clipping_norm  # what this round's updates are clipped to

    def configure_train(self, server_round, arrays, config, grid):
        """Poisson sampling (a generator of its own per (experiment seed, round), apart from the noise's): an empty
        sample configures nobody, the round aggregates nothing and the accountant still counts it."""
        self._round_arrays = arrays
        rng = np.random.default_rng([self.seed, server_round, SAMPLING_STREAM])
        chosen = poisson_sample(sorted(grid.get_node_ids()), self.sample_rate, rng)
        if not chosen:
            log.info("round %d: the Poisson sample of clients is empty (q=%.4g): nothing to aggregate",
                     server_round, self.sample_rate)
            return []
        return super().configure_train(server_round, arrays, config, _ChosenNodes(grid, chosen))

    def aggregate_train(self, server_round, replies):
        self._start_round(server_round)
        replies = list(replies)
        self._round_count = sum(1 for reply in replies if not reply.has_error())
        for reply in replies:
            if not reply.has_error():
                next(iter(reply.content.metric_records.values()))[UNIFORM_WEIGHT_KEY] = 1
        inner = self.strategy
        key, inner.weighted_by_key = inner.weighted_by_key, UNIFORM_WEIGHT_KEY
        try:
            return super().aggregate_train(server_round, replies)
        finally:
            inner.weighted_by_key = key  # evaluate replies carry num-examples only

    def _public_denominator(self, mean: ArrayRecord) -> ArrayRecord:
        """The uniform mean of k updates as the sum over the expected count m: ``W + (k / m)(mean - W)``; the mean
        itself when k = m (the bits of a run whose every sampled client replied stay as they were)."""
        k, m = self._round_count, self.num_sampled_clients
        if k == m or k == 0 or self._round_arrays is None:
            return mean
        ref = self._round_arrays.to_numpy_ndarrays()
        return ArrayRecord({name: Array(np.asarray((w + (k / m) * (a.astype(np.float64) - w)).astype(a.dtype)))
                            for name, a, w in zip(mean.keys(), mean.to_numpy_ndarrays(), ref)})

    def release_secure_mean(self, server_round: int, mean: ArrayRecord, clipped_count: int,
                            aggregated: int) -> ArrayRecord:
        """Under SecAgg+ (client-side clipping only): what the client-side wrapper's ``aggregate_train`` does after
        the inner strategy's mean, for the uniform mean of ``aggregated`` clipped updates that SecAgg+ unmasked
        (the secure step bypasses ``aggregate_train``). In Flower's order and from the same seeded generator as
        the round in the clear: adaptive clipping's C update from the noisy count of clipped updates
        (``clipped_count``, summed under the same masks), then the noise N(0, (z C / m)^2) with the round's C."""
        self._start_round(server_round)
        self._round_count = aggregated
        if isinstance(self, DifferentialPrivacyClientSideAdaptiveClipping):
            self._geometric_update(self._noisy_fraction(clipped_count, aggregated))
        return self._add_noise_to_aggregated_arrays(mean)

    def _add_noise_to_aggregated_arrays(self, aggregated: ArrayRecord) -> ArrayRecord:
        aggregated = self._public_denominator(aggregated)
        if self.noise_multiplier == 0:
            return aggregated
        std = compute_stdv(self.noise_multiplier, self._round_clipping_norm, self.num_sampled_clients)
        log.info("client-level DP: noise std %.4g on the aggregate", std)
        return ArrayRecord({k: Array(np.asarray(a + self._rng.normal(0.0, std, a.shape).astype(a.dtype)))
                            for k, a in zip(aggregated.keys(), aggregated.to_numpy_ndarrays())})

    def _noisy_fraction(self, count: int, total: int) -> float:  # adaptive wrappers only
        # over the expected count m (public), not the k replies: k would tell who joined
        noise = self._rng.normal(0.0, self.clipped_count_stddev) if self.clipped_count_stddev > 0 else 0.0
        return float(count + noise) / float(self.num_sampled_clients)

    def _geometric_update(self, clipped_fraction: float) -> None:  # adaptive wrappers only
        self.clipping_norm *= math.exp(self.clip_norm_lr * (clipped_fraction - self.target_clipped_quantile))


class ServerSideFixed(_FedmeetDP, DifferentialPrivacyServerSideFixedClipping):
    pass


class ClientSideFixed(_FedmeetDP, DifferentialPrivacyClientSideFixedClipping):
    pass


class ServerSideAdaptive(_FedmeetDP, DifferentialPrivacyServerSideAdaptiveClipping):
    pass


class ClientSideAdaptive(_FedmeetDP, DifferentialPrivacyClientSideAdaptiveClipping):
    pass


# The Flower 1.41 methods the wrappers above override or rely on (sha256 of their source, first 16 hex digits):
# tests/test_flower_overrides.py fails when one changes upstream, so that a maintainer re-checks the override
# (Flower has no public hook for the noise, the clipped fraction or C's update; the subclasses are the seam).
_FIXED = ("configure_train", "aggregate_train", "_add_noise_to_aggregated_arrays")
_ADAPTIVE = _FIXED + ("_noisy_fraction", "_geometric_update")
FLOWER_METHODS = {
    "FedAvg.configure_train": "1c8cad62dc921a66",  # configures every node its grid shows when fraction_train = 1
    **dict(zip((f"DifferentialPrivacyServerSideFixedClipping.{m}" for m in _FIXED),
               ("cca4c4bae7752bd5", "59e602ef32c7d7d5", "16ea4f0006dd4e4a"))),
    **dict(zip((f"DifferentialPrivacyClientSideFixedClipping.{m}" for m in _FIXED),
               ("5b565fcfea5a7f2b", "09ee66dc127451ef", "16ea4f0006dd4e4a"))),
    **dict(zip((f"DifferentialPrivacyServerSideAdaptiveClipping.{m}" for m in _ADAPTIVE),
               ("fb225fdecc3c2b34", "fba06bac9d5c1f6b", "bf9099d1c2d53327", "8fabee661038b17d", "6405cb317c8ee034"))),
    **dict(zip((f"DifferentialPrivacyClientSideAdaptiveClipping.{m}" for m in _ADAPTIVE),
               ("0ec9e6105dc9dae9", "71215369fc9eb429", "bf9099d1c2d53327", "8fabee661038b17d", "6405cb317c8ee034"))),
}

WRAPPERS = {("server", "fixed"): ServerSideFixed, ("client", "fixed"): ClientSideFixed,
            ("server", "adaptive"): ServerSideAdaptive, ("client", "adaptive"): ClientSideAdaptive}


def _safe_norm(c: float) -> np.float64:
    # Flower clips with min(1, C / ||update||): a client whose update is exactly zero makes a Python float raise
    # ZeroDivisionError (and stops the server); numpy's C / 0 is inf, i.e. no scaling, as it should be.
    return np.float64(c)


def wrap_strategy(strategy, plan: Plan, setting: FederationPrivacy):
    """The plan's Flower DP wrapper around ``strategy`` (FedAvg or FedProx)."""
    cfg = plan.privacy
    cls = WRAPPERS[(cfg.clipping_side, cfg.clipping)]
    norm = _safe_norm(setting.clipping_norm)
    if cfg.clipping == "fixed":
        wrapped = cls(strategy, setting.noise_multiplier, norm, setting.sampled)
    else:
        wrapped = cls(strategy, flower_adaptive_multiplier(setting.noise_multiplier, setting.count_stddev),
                      setting.sampled, initial_clipping_norm=norm,
                      target_clipped_quantile=cfg.target_clipped_quantile, clip_norm_lr=cfg.clip_norm_lr,
                      clipped_count_stddev=setting.count_stddev)
    wrapped.seed = derived_seed(plan.seed, "client-dp-noise")
    wrapped.sample_rate = setting.sample_rate
    strategy.fraction_train = 1.0  # the wrapper draws the Poisson sample; the inner strategy configures all of it
    return wrapped


def server_setting(plan: Plan, population: int) -> FederationPrivacy:
    """The run's client-level DP setting: the plan's group over ``population`` clients."""
    t = plan.train
    return federation_privacy(plan.privacy, population, sampled_per_round(population, t.fraction_train), t.rounds,
                              where=plan.source or plan.experiment)


# ----------------------------------------------------------------------------------------------- client side
def update_norm(reply: ArrayRecord, reference: ArrayRecord) -> float:
    """The L2 norm of ``reply - reference`` over all tensors (Flower's flat clipping norm)."""
    return get_norm([r - g for r, g in zip(reply.to_numpy_ndarrays(), reference.to_numpy_ndarrays())])


def rounding_slack(record: ArrayRecord) -> float:
    """How far float32 rounding can move the norm of ``W + clip(W_i - W) - W`` off C: one ulp per coordinate of
    the reply (the clipped update is added to weights near 1, whose ulp dwarfs a small update's coordinates)."""
    return float(np.sqrt(sum(float(np.sum(np.spacing(np.abs(a)).astype(np.float64) ** 2))
                             for a in record.to_numpy_ndarrays())))


def client_dp_mod(msg: Message, context: Context, call_next):
    """The train handler's mod: with client-side clipping in the plan, Flower's ``fixedclipping_mod`` (or
    ``adaptiveclipping_mod``) clips the reply; before that, the reply gets ``dp-update-clipped`` (whether its
    update exceeded C: a count, like the norm bit the adaptive mod adds). Otherwise it passes the message on, as
    it does SecAgg+'s legacy FitIns (the train handler clips that round inside legacy_fit, before the masking)."""
    if is_legacy_fit(msg):
        return call_next(msg, context)
    privacy = load_plan(plan_path_of(msg, context)).privacy
    if privacy is None or privacy.mode != "client" or privacy.clipping_side != "client":
        return call_next(msg, context)
    received = msg.content[ARRAYS_KEY]
    config = msg.content[CONFIG_KEY]

    def mark_clipped(m: Message, c: Context) -> Message:
        reply = call_next(m, c)
        if not reply.has_error() and KEY_CLIPPING_NORM in config:
            norm = update_norm(reply.content[ARRAYS_KEY], received)
            reply.content[METRICS_KEY][CLIPPED_KEY] = int(norm > float(config[KEY_CLIPPING_NORM]))
        return reply

    if KEY_CLIPPING_NORM in config:
        config[KEY_CLIPPING_NORM] = _safe_norm(config[KEY_CLIPPING_NORM])  # a float again after the wire
    mod = adaptiveclipping_mod if privacy.clipping == "adaptive" else fixedclipping_mod
    return mod(msg, context, mark_clipped)


# ----------------------------------------------------------------------------------------------- the record
class RoundPrivacy:
    """The server's side of one run: the setting, which updates were clipped, and the fields each round's rows get."""

    def __init__(self, plan: Plan, population: int):
        problem = client_level_problem(plan.spec, plan.train.transfer_dtype, plan.privacy)
        if problem:  # the plan stage refuses it; a plan file written by hand is refused here
            raise ValueError(f"{plan.source}: privacy.mode client: {problem}")
        self.setting = server_setting(plan, population)
        self.side = plan.privacy.clipping_side
        log.info("%s: client-level DP, z=%.4g, C=%s, %d of %d clients per round (q=%.4g), delta=%g",
                 plan.experiment, self.setting.noise_multiplier, self.setting.clipping_norm, self.setting.sampled,
                 population, self.setting.sample_rate, self.setting.delta)

    def clipped(self, reply: Message, global_arrays: ArrayRecord, clipping_norm: float) -> tuple[int, float] | None:
        """Whether this reply's update was (server side: will be) clipped at the round's C, and the norm of the
        update as received (server side: before clipping); None for a reply of client-side clipping that is not
        within C (a client without the mod): it must not be aggregated."""
        norm = update_norm(reply.content[ARRAYS_KEY], global_arrays)
        if self.side == "server":
            return int(norm > clipping_norm), norm
        metrics = reply.content[METRICS_KEY]
        if CLIPPED_KEY not in metrics or norm > clipping_norm * (1 + 1e-6) + rounding_slack(reply.content[ARRAYS_KEY]):
            return None
        return int(metrics[CLIPPED_KEY]), norm

    def record(self, rows: dict[str, dict[str, Any]], clipped: dict[str, tuple[float, float | None]],
               clipping_norm: float, history: list[dict[str, Any]]) -> float:
        """Add the round's fields to the rows of the clients whose update entered the released aggregate;
        returns epsilon after this round. ``update_norm`` is how C is chosen (a run with noise 0 and C .inf
        shows every update's norm); like the losses, it is an un-noised number of the experiment record. Under
        SecAgg+ the server knows neither: each row of the round gets the fraction of the round's updates that
        were clipped (their bits summed under the masks) and no norm."""
        rnd = max(int(row["round"]) for row in rows.values())
        eps = self.setting.epsilon_after(rnd)  # every round so far, an empty sample too (Poisson sampling)
        for name, (bit, norm) in clipped.items():
            rows[name].update({"update_clipped": bit, "update_norm": None if norm is None else float(norm),
                               "clipping_norm": float(clipping_norm),
                               "epsilon": None if eps == float("inf") else eps, "delta": self.setting.delta,
                               "noise_multiplier": self.setting.noise_multiplier,
                               "sample_rate": self.setting.sample_rate})
        return eps

