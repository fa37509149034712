"""The strategy registry: a strategy module (strategies/<name>.py) registers its builder and settings dataclass
with :func:`register_strategy`; only the chosen strategy's settings enter a plan. METHOD.md section 5."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.common.config import config, from_dict

# Every reply's MetricRecord carries these two counts; "num-examples" (the FedAvg weight) is Flower's default key.
NUM_EXAMPLES_KEY = "num-examples"
NUM_STEPS_KEY = "num-steps"

# Attributes through which Flower's strategies carry state from round to round (server optimiser moments; the DP
# wrappers' adaptive clipping_norm): a resumed run restores them, or the server optimiser would restart from zero.
_STATEFUL_ATTRIBUTES = ("current_arrays", "m_t", "v_t", "momentum_vector", "clipping_norm")


@config(frozen=True)
class NoSettings:
    """A strategy without settings of its own (FedAvg, FedNova): nothing enters the plan."""


@dataclass(frozen=True)
class StrategySpec:
    name: str
    # build(settings, common, client_lr) -> a Flower strategy; ``common``: catalog.build_strategy's
    build: Callable[[Any, dict[str, Any], float], Any]
    settings_cls: type = NoSettings
    # params train key holding the settings mapping; None: the settings' fields are flat train keys.
    group: str | None = None
    # The new global is the (weighted) mean of the replies and nothing more (what client-level DP and SecAgg+ need).
    averaging: bool = False
    # Clients add mu/2 ||W - W_global||^2 (the mu arrives in the train message's config, as Flower's FedProx sends it).
    proximal: bool = False

    @property
    def params_keys(self) -> tuple[str, ...]:
        """The params `train` keys this strategy owns."""
        if self.settings_cls is NoSettings:
            return ()
        if self.group is not None:
            return (self.group,)
        return tuple(f.name for f in dataclasses.fields(self.settings_cls))

    def settings(self, train_params: dict[str, Any], where: str = "train") -> Any:
        """The settings dataclass from the `train` params (defaults for keys left out); bad keys raise ConfigError."""
        if self.group is not None:
            return from_dict(self.settings_cls, train_params.get(self.group), f"{where}.{self.group}")
        return from_dict(self.settings_cls, {k: train_params[k] for k in self.params_keys if k in train_params}, where)

    def plan_entries(self, train_params: dict[str, Any]) -> dict[str, Any]:
        """The settings, defaults filled in, as the plan's `train` mapping carries them (the params file's keys)."""
        if self.settings_cls is NoSettings:
            return {}
        values = dataclasses.asdict(self.settings(train_params))
        return {self.group: values} if self.group is not None else values


STRATEGIES: dict[str, StrategySpec] = {}


def register_strategy(
    name: str,
    settings_cls: type = NoSettings,
    *,
    group: str | None = "",
    averaging: bool = False,
    proximal: bool = False,
):
    """Decorator on a strategy module's builder: registers strategy ``name`` with its settings dataclass, read from
    params ``train.<group>`` (``group`` defaults to ``name``; None = flat train keys)."""

    def register(build: Callable[[Any, dict[str, Any], float], Any]):
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} is registered twice")
        STRATEGIES[name] = StrategySpec(name, build, settings_cls, name if group == "" else group, averaging, proximal)
        return build

    return register


def strategy_state(strategy: Any) -> dict[str, Any]:
    return {k: copy.deepcopy(getattr(strategy, k)) for k in _STATEFUL_ATTRIBUTES if hasattr(strategy, k)}


def restore_strategy_state(strategy: Any, state: dict[str, Any]) -> None:
    for key, value in state.items():
        if key not in _STATEFUL_ATTRIBUTES:
            raise ValueError(f"checkpoint: unexpected strategy state {key!r}")
        setattr(strategy, key, value)
