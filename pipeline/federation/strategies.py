"""Server-side aggregation: Flower's own strategies, plus FedNova (Flower has none) and the glue around them.

METHOD.md section 5: FedAvg weighted by data size (`W = sum_i |D_i|/|D| W_i`), FedProx (the proximal term is
client-side; Flower's ``FedProx`` only ships ``mu`` in the train config), FedOPT (server optimiser on the
pseudo-gradient: Flower's ``FedAvgM`` = FedNLP's default server SGD with momentum, or ``FedAdam`` / ``FedYogi`` /
``FedAdagrad``) and FedNova (normalised averaging by the number of local steps, below).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

# Every reply's MetricRecord carries these two counts. "num-examples" is Flower's default weighting key: the
# client's |D_i| (its full train size, or the examples trained this round with train.weight_by: trained).
NUM_EXAMPLES_KEY = "num-examples"
NUM_STEPS_KEY = "num-steps"

# Attributes through which Flower's message strategies carry state from one round to the next
# (FedOpt family: current_arrays, m_t, v_t; FedAvgM: current_arrays, momentum_vector). A resumed run must
# restore them or the server optimiser would restart from zero moments. clipping_norm: Flower's DP wrappers
# (privacy.mode client); adaptive clipping moves it every round.
_STATEFUL_ATTRIBUTES = ("current_arrays", "m_t", "v_t", "momentum_vector", "clipping_norm")


@dataclass
class FedOptConfig:
    # Server optimiser for `fedopt`: "sgdm" = FedAvgM (FedNLP's default: server SGD, lr 1.0, momentum 0.9),
    # or "adam" | "yogi" | "adagrad" (Reddi et al. 2021, Flower's FedAdam/FedYogi/FedAdagrad).
    server_optimizer: str = "sgdm"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    beta_1: float = 0.9
    beta_2: float = 0.99
    # Adaptivity constant tau of Reddi et al. (named eps here: `tau` is the entropy threshold in this project).
    eps: float = 1.0e-3


def _fednova_class():
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    class FedNova(FedAvg):
        """FedNova (Wang et al., NeurIPS 2020): normalised averaging by the number of local steps.

        With client updates ``Delta_i = W - W_i`` after ``tau_i`` local steps and weights ``p_i = |D_i| / |D|``:
        ``d = sum_i p_i Delta_i / tau_i`` (each update normalised per step), ``tau_eff = sum_i p_i tau_i``,
        ``W_new = W - tau_eff * d``. Equal step counts give FedAvg exactly. Clients report ``num-steps``.
        """

        def configure_train(self, server_round, arrays, config, grid):
            # The update is taken relative to what was sent this round.
            self.current_arrays = {k: a.numpy() for k, a in arrays.items()}
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            valid, _ = self._check_and_log_replies(replies, is_train=True)
            if not valid:
                return None, None
            contents = [m.content for m in valid]
            for content in contents:
                metrics = next(iter(content.metric_records.values()))
                if NUM_STEPS_KEY not in metrics or metrics[NUM_STEPS_KEY] <= 0:
                    raise ValueError(f"FedNova: reply without a positive '{NUM_STEPS_KEY}' metric: {dict(metrics)}")
            weights = np.array(
                [float(next(iter(c.metric_records.values()))[self.weighted_by_key]) for c in contents]
            )
            p = weights / weights.sum()
            steps = np.array([float(next(iter(c.metric_records.values()))[NUM_STEPS_KEY]) for c in contents])
            tau_eff = float((p * steps).sum())
            new = {}
            for key, w_global in self.current_arrays.items():
                d = np.zeros_like(w_global, dtype=np.float64)
                for content, p_i, tau_i in zip(contents, p, steps):
                    w_i = next(iter(content.array_records.values()))[key].numpy()
                    d += p_i * (w_global.astype(np.float64) - w_i) / tau_i
                new[key] = Array(np.asarray(w_global - tau_eff * d, dtype=w_global.dtype))
            return ArrayRecord(new), self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    return FedNova


def build_strategy(name: str, *, fraction_train: float, proximal_mu: float, fedopt: FedOptConfig,
                   client_lr: float):
    """The Flower strategy for server algorithm ``name`` (fedavg | fedprox | fedopt | fednova).

    Flower samples ``max(int(n * fraction_train), min_train_nodes)`` nodes per round (0.67 of 3 -> 2); all
    clients are evaluated every round (``fraction_evaluate`` 1) so each keeps its best adapter.
    """
    from flwr.serverapp import strategy as fs

    common = dict(
        fraction_train=fraction_train,
        fraction_evaluate=1.0,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=1,
        weighted_by_key=NUM_EXAMPLES_KEY,
    )
    if name == "fedavg":
        return fs.FedAvg(**common)
    if name == "fedprox":
        return fs.FedProx(**common, proximal_mu=proximal_mu)
    if name == "fednova":
        return _fednova_class()(**common)
    if name == "fedopt":
        opt = fedopt.server_optimizer
        if opt == "sgdm":
            return fs.FedAvgM(**common, server_learning_rate=fedopt.server_lr, server_momentum=fedopt.server_momentum)
        adaptive = {"adam": fs.FedAdam, "yogi": fs.FedYogi, "adagrad": fs.FedAdagrad}
        if opt not in adaptive:
            raise ValueError(f"train.fedopt.server_optimizer: unknown {opt!r}; expected sgdm, adam, yogi or adagrad")
        kwargs = dict(eta=fedopt.server_lr, eta_l=client_lr, tau=fedopt.eps)
        if opt != "adagrad":
            kwargs.update(beta_1=fedopt.beta_1, beta_2=fedopt.beta_2)
        return adaptive[opt](**common, **kwargs)
    raise ValueError(f"unknown server strategy {name!r}; expected fedavg, fedprox, fedopt or fednova")


def strategy_state(strategy: Any) -> dict[str, Any]:
    """The round-to-round state of a Flower strategy (server optimiser moments), for checkpoints."""
    return {k: copy.deepcopy(getattr(strategy, k)) for k in _STATEFUL_ATTRIBUTES if hasattr(strategy, k)}


def restore_strategy_state(strategy: Any, state: dict[str, Any]) -> None:
    for key, value in state.items():
        if key not in _STATEFUL_ATTRIBUTES:
            raise ValueError(f"checkpoint: unexpected strategy state {key!r}")
        setattr(strategy, key, value)
