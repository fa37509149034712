"""Every server strategy, by name: importing this module registers each strategy module below."""

from __future__ import annotations

from typing import Any

from pipeline.experiments.methods import STRATEGIES, get_strategy
from pipeline.federation.strategies import fedavg, fednova, fedopt, fedprox, fedtrimmedavg  # noqa: F401 (register)
from pipeline.federation.strategies.registry import BUILDERS, NUM_EXAMPLES_KEY

if missing := sorted(set(STRATEGIES) - set(BUILDERS)):
    raise ValueError(f"declared strategies without a builder in pipeline/federation/strategies/: {missing}")


def build_strategy(name: str, strategy_params: dict[str, Any], *, fraction_train: float, client_lr: float):
    """The Flower strategy ``name`` with its settings read from ``strategy_params`` (the plan's strategy keys)."""
    spec = get_strategy(name)
    # every Flower strategy's keywords; all clients evaluate every round (each keeps its best adapter)
    common = dict(
        fraction_train=fraction_train,
        fraction_evaluate=1.0,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=1,
        weighted_by_key=NUM_EXAMPLES_KEY,
    )
    return BUILDERS[name](spec.settings(strategy_params), common, client_lr)
