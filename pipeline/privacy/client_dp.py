"""Client-level DP (``privacy.mode: client``): :class:`ClientLevelDP`, a Flower ``Strategy`` around FedAvg/FedProx
with Flower's DP primitives, not its DP wrappers (docs/privacy.md says why), and the client's clipping mod."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import Strategy
from flwr.supercore.differential_privacy import (
    KEY_CLIPPING_NORM,
    KEY_NORM_BIT,
    adaptive_clip_inputs_inplace,
    compute_stdv,
    get_norm,
)

from pipeline.common import atomic
from pipeline.federation.protocol import (
    ARRAYS_KEY,
    CLIPPED_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    GridView,
    load_plan,
    plan_path_of,
)
from pipeline.privacy.accounting import FederationPrivacy
from pipeline.privacy.secure_aggregation import is_legacy_fit, keyed, upload_error
from pipeline.training.seeds import derived_seed

log = logging.getLogger("fedmeet.federated")

UNIFORM_WEIGHT_KEY = "dp-unit-weight"  # set by the server on each reply it aggregates under mode client
SAMPLING_STREAM = 1  # the Poisson sample's generator: [seed, round, 1] (the noise's is [seed, round])


def poisson_sample(node_ids: list[int], rate: float, rng: np.random.Generator) -> list[int]:
    """Each node independently with probability ``rate`` (one uniform draw per node, in the given order)."""
    return [n for n, u in zip(node_ids, rng.random(len(node_ids))) if u < rate]


class ClientLevelDP(Strategy):
    """DP-FedAvg around ``strategy`` (run with fraction_train 1); adaptive clipping moves :attr:`clipping_norm`."""

    def __init__(self, strategy, plan, setting: FederationPrivacy, releases=None):
        # {round: releases so far}, in the file ``releases`` before one leaves (fedavg's evaluate sends it before the
        # checkpoint; None: a KD method's leaves after it): a redo draws a fresh sample and noise, counted again
        self.releases_file = releases
        self.releases = json.loads(releases.read_text()) if releases and releases.exists() else {}
        self.strategy, self.setting, self.cfg = strategy, setting, plan.privacy
        self.seed = derived_seed(plan.seed, "client-dp-noise")
        self.client_side, self.adaptive = self.cfg.clipping_side == "client", self.cfg.clipping == "adaptive"
        # Flat clipping scales by min(1, C / ||update||): a Python float C raises ZeroDivisionError on an update of
        # norm exactly zero (and stops the server); numpy's C / 0 is inf, i.e. no scaling, as it should be.
        self.clipping_norm = np.float64(setting.clipping_norm)
        self._arrays: ArrayRecord | None = None  # the global the round's updates are taken against
        strategy.fraction_train = 1.0
        log.info(
            f"client-level DP, z={setting.noise_multiplier:.4g}, C={setting.clipping_norm}, {setting.sampled} of "
            f"{setting.population} clients per round, delta={setting.delta:g}"
        )

    def configure_train(self, server_round, arrays, config, grid):
        """Poisson sampling (seeded per round, apart from the noise): an empty sample is still accounted."""
        self._arrays = arrays
        rng = self._generator(server_round, SAMPLING_STREAM)
        chosen = poisson_sample(list(grid.get_node_ids()), self.setting.sample_rate, rng)  # the view: client order
        if not chosen:
            log.info("round %d: the Poisson sample of clients is empty: nothing to aggregate", server_round)
            return []
        if self.client_side:
            config[KEY_CLIPPING_NORM] = self.clipping_norm  # what the clients' mods clip to
        # the inner strategy configures every node it sees: it sees only the sample
        return self.strategy.configure_train(server_round, arrays, config, GridView(grid, chosen))

    def aggregate_train(self, server_round, replies):
        # A failed reply is left out (k counts the others, as a timed-out client's). Flower's DP wrappers release
        # nothing then, which tells that the secret Poisson sample held somebody (as an unchanged W would).
        replies, clipped = [reply for reply in replies if not reply.has_error()], 0
        base = self._arrays.to_numpy_ndarrays()  # the round's global W (read, never written)
        for reply in replies:
            metrics, received = reply.content[METRICS_KEY], reply.content[ARRAYS_KEY]
            metrics[UNIFORM_WEIGHT_KEY] = 1
            if not self.client_side:  # clipped here: W + clip(W_i - W)
                update = [np.subtract(a, w) for a, w in zip(received.to_numpy_ndarrays(), base, strict=True)]
                clipped += int(adaptive_clip_inputs_inplace(update, self.clipping_norm))
                reply.content[ARRAYS_KEY] = keyed(received.keys(), [w + u for w, u in zip(base, update, strict=True)])
            elif self.adaptive:  # its 0/1 mark checked (protocol.train_reply_metrics: a reply without it is left out)
                clipped += int(metrics[KEY_NORM_BIT])
        inner = self.strategy
        key, inner.weighted_by_key = inner.weighted_by_key, UNIFORM_WEIGHT_KEY
        try:
            mean, metrics = inner.aggregate_train(server_round, replies)
        finally:
            inner.weighted_by_key = key  # evaluate replies carry num-examples only
        return self.release_secure_mean(server_round, mean, clipped, len(replies)), metrics

    def release_secure_mean(
        self, server_round: int, mean: ArrayRecord | None, clipped_count: int, aggregated: int
    ) -> ArrayRecord | None:
        """Release the uniform mean of k = ``aggregated`` clipped updates (SecAgg+ calls it directly; k = 0: W): move
        C (adaptive), take the sum over the expected count m, ``W + (k / m)(mean - W)``, add N(0, (z_u C / m)^2)."""
        rng, norm, m = self._generator(server_round), self.clipping_norm, self.setting.sampled
        if self.releases_file is not None:
            self.releases[str(server_round)] = self.releases.get(str(server_round), 0) + 1
            atomic.write_json(self.releases_file, self.releases)
        if self.adaptive:  # f: the noisy count over m (public: the number that replied would tell who joined)
            noise = rng.normal(0.0, self.setting.count_stddev) if self.setting.count_stddev > 0 else 0.0
            fraction = float(clipped_count + noise) / float(m)
            self.clipping_norm *= math.exp(self.cfg.clip_norm_lr * (fraction - self.cfg.target_clipped_quantile))
        mean = mean or self._arrays  # nobody in the sum: W and the noise (an unchanged W tells the sample was empty)
        if aggregated not in (m, 0):
            k, arrays = aggregated, zip(mean.to_numpy_ndarrays(), self._arrays.to_numpy_ndarrays())
            mean = keyed(mean.keys(), [(w + (k / m) * (a.astype(np.float64) - w)).astype(a.dtype) for a, w in arrays])
        if (z := self.setting.update_noise_multiplier) == 0:
            return mean
        arrays, error = mean.to_numpy_ndarrays(), upload_error(self.cfg.secagg) if self.cfg.secure_aggregation else 0
        std = compute_stdv(z, norm + math.sqrt(sum(a.size for a in arrays)) * error, m)  # SecAgg+: a quantised upload
        return keyed(mean.keys(), [a + rng.normal(0.0, std, a.shape).astype(a.dtype) for a in arrays])

    def _generator(self, server_round: int, *stream: int) -> np.random.Generator:
        n = self.releases.get(str(server_round), 0)  # the round's releases before this one: a redo's n-th, [..., 2, n]
        return np.random.default_rng([self.seed, server_round, *stream, *([2, n] if n else [])])

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

    def clipped(self, reply: Message, global_arrays: ArrayRecord, clipping_norm: float) -> tuple[int, float] | None:
        """(clipped at the round's C or not, its update's norm); None for a client-side reply not within C."""
        norm = update_norm(reply.content[ARRAYS_KEY], global_arrays)
        if not self.client_side:
            return int(norm > clipping_norm), norm
        metrics = reply.content[METRICS_KEY]
        # Float32 rounding can move the norm of W + clip(W_i - W) - W off C by one ulp per coordinate of the reply
        # (the clipped update is added to weights near 1, whose ulp dwarfs a small update's coordinates).
        ulps = [np.spacing(np.abs(a)).astype(np.float64) for a in reply.content[ARRAYS_KEY].to_numpy_ndarrays()]
        slack = float(np.sqrt(sum(float(np.sum(u**2)) for u in ulps)))
        if CLIPPED_KEY not in metrics or norm > clipping_norm * (1 + 1e-6) + slack:
            return None
        return int(metrics[CLIPPED_KEY]), norm

    def record(
        self, rows: dict[str, dict[str, Any]], clipped: dict[str, tuple[float, float | None]], clipping_norm: float
    ) -> None:
        rnd = max(int(row["round"]) for row in rows.values())
        accounted = rnd + sum(n - 1 for r, n in self.releases.items() if int(r) <= rnd)  # a redone round's too
        for row in rows.values() if accounted > rnd else []:  # on every row of the round (the run record reads it)
            row["rounds_accounted"] = accounted
        eps, _ = self.setting.bound_after(accounted)  # every release so far, an empty sample too (Poisson sampling)
        this_round = {
            "clipping_norm": float(clipping_norm),
            "epsilon": None if eps == float("inf") else eps,
            "delta": self.setting.delta,
            "noise_multiplier": self.setting.noise_multiplier,
            "sample_rate": self.setting.sample_rate,
        }
        for name, (bit, norm) in clipped.items():
            rows[name].update(update_clipped=bit, update_norm=None if norm is None else float(norm), **this_round)


def update_norm(reply: ArrayRecord, reference: ArrayRecord) -> float:
    return get_norm([r - g for r, g in zip(reply.to_numpy_ndarrays(), reference.to_numpy_ndarrays())])


def client_dp_mod(msg: Message, context: Context, call_next):
    """With client-side clipping, Flower's fixed or adaptive clipping mod on the reply, marked ``dp-update-clipped``;
    otherwise, and for SecAgg+'s legacy FitIns (clipped inside legacy_fit), the message passes."""
    privacy = None if is_legacy_fit(msg) else load_plan(plan_path_of(msg, context)).privacy
    if privacy is None or privacy.mode != "client" or privacy.clipping_side != "client":
        return call_next(msg, context)
    received, config = msg.content[ARRAYS_KEY], msg.content[CONFIG_KEY]
    if KEY_CLIPPING_NORM in config:  # else Flower's mod answers with an error and calls nothing
        config[KEY_CLIPPING_NORM] = np.float64(config[KEY_CLIPPING_NORM])  # numpy's again after the wire

    def mark_clipped(m: Message, c: Context) -> Message:
        reply = call_next(m, c)
        if not reply.has_error():
            norm = update_norm(reply.content[ARRAYS_KEY], received)
            reply.content[METRICS_KEY][CLIPPED_KEY] = int(norm > float(config[KEY_CLIPPING_NORM]))
        return reply

    mod = adaptiveclipping_mod if privacy.clipping == "adaptive" else fixedclipping_mod
    return mod(msg, context, mark_clipped)
