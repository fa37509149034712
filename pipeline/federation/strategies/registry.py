"""The strategy registry: a strategy module (strategies/<name>.py) registers its Flower builder with
:func:`register_strategy`; its settings dataclass is declared with it in pipeline.experiments.methods (only the chosen
strategy's settings enter a plan). METHOD.md section 5."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pipeline.experiments.methods import STRATEGIES

# Every reply's MetricRecord carries these two counts; "num-examples" (the FedAvg weight) is Flower's default key.
NUM_EXAMPLES_KEY = "num-examples"
NUM_STEPS_KEY = "num-steps"

# Attributes through which Flower's strategies carry state from round to round (server optimiser moments; the DP
# wrappers' adaptive clipping_norm): a resumed run restores them, or the server optimiser would restart from zero.
_STATEFUL_ATTRIBUTES = ("current_arrays", "m_t", "v_t", "momentum_vector", "clipping_norm")


BUILDERS: dict[str, Callable[[Any, dict[str, Any], float], Any]] = {}


def register_strategy(name: str):
    """Decorator on a strategy module's builder ``build(settings, common, client_lr) -> a Flower strategy``
    (``common``: catalog.build_strategy's) of strategy ``name``, declared with its settings and what its server does
    in pipeline.experiments.methods.STRATEGIES."""

    def register(build: Callable[[Any, dict[str, Any], float], Any]):
        if name not in STRATEGIES:
            raise ValueError(f"strategy {name!r} is not declared in pipeline.experiments.methods.STRATEGIES")
        if name in BUILDERS:
            raise ValueError(f"strategy {name!r} is registered twice")
        BUILDERS[name] = build
        return build

    return register


def strategy_state(strategy: Any) -> dict[str, Any]:
    return {k: copy.deepcopy(getattr(strategy, k)) for k in _STATEFUL_ATTRIBUTES if hasattr(strategy, k)}


def restore_strategy_state(strategy: Any, state: dict[str, Any]) -> None:
    for key, value in state.items():
        if key not in _STATEFUL_ATTRIBUTES:
            raise ValueError(f"checkpoint: unexpected strategy state {key!r}")
        setattr(strategy, key, value)
