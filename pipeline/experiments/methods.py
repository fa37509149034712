"""The methods compared (METHOD.md sections 6 and 7), selectable by name, and the server strategies a plan may name:
each strategy's settings dataclass (read from params `train`) and what privacy needs to know of its server. The
Flower builder of each strategy registers under the same name in pipeline/federation/strategies/. METHOD.md s. 5."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from pipeline.common.config import BelowOne, ConfigError, NonNegative, Positive, config, from_dict

# The local path's loss: ce | kd (every token) | selective (H(q_g) < tau) | hard (nouns, verbs)
KdMode = Literal["ce", "kd", "selective", "hard"]


@config(frozen=True)
class NoSettings:
    """A strategy without settings of its own (FedAvg, FedNova): nothing enters the plan."""


@config
class FedProxSettings:
    # params train.proximal_mu (a flat key, older than the registry; FedNLP tunes mu in {0.001, 0.01, 0.1, 1}).
    proximal_mu: NonNegative = 0.01


@config
class FedOptConfig:
    # Server optimiser for `fedopt`: "sgdm" = FedAvgM (FedNLP's default: server SGD, lr 1.0, momentum 0.9),
    # or "adam" | "yogi" | "adagrad" (Reddi et al. 2021, Flower's FedAdam/FedYogi/FedAdagrad).
    server_optimizer: Literal["sgdm", "adam", "yogi", "adagrad"] = "sgdm"
    server_lr: Positive | None = None  # None: Flower's default for the optimiser (resolved here, so plans hold it)
    server_momentum: BelowOne = 0.9
    beta_1: BelowOne = 0.9
    beta_2: BelowOne = 0.99
    eps: Positive = 1.0e-3  # Reddi et al.'s adaptivity constant tau (here `tau` is the entropy threshold)

    def __post_init__(self) -> None:
        self.server_lr = self.server_lr or dict(sgdm=1.0, adam=0.1, yogi=0.01, adagrad=0.1)[self.server_optimizer]


@config
class FedTrimmedAvgSettings:
    # Fraction cut from each end per coordinate (the params file's value; Flower's default 0.2 cuts nothing from 3
    # clients, 0.34 cuts one from each end, i.e. the coordinate-wise median of 3).
    beta: Annotated[float, Field(ge=0.0, lt=0.5)] = 0.34


@dataclass(frozen=True)
class StrategySpec:
    name: str
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
        return (self.group,) if self.group is not None else tuple(f.name for f in dataclasses.fields(self.settings_cls))

    def settings(self, train_params: dict[str, Any], where: str = "train") -> Any:
        """The settings dataclass from the `train` params (defaults for keys left out); bad keys raise ConfigError."""
        if self.group is not None:
            return from_dict(self.settings_cls, train_params.get(self.group), f"{where}.{self.group}")
        return from_dict(self.settings_cls, {k: train_params[k] for k in self.params_keys if k in train_params}, where)

    def plan_entries(self, train_params: dict[str, Any]) -> dict[str, Any]:
        """The settings, defaults filled in, as the plan's `train` mapping carries them (the params file's keys)."""
        values = dataclasses.asdict(self.settings(train_params))
        return {self.group: values} if self.group is not None else values


# Every server strategy, by name (its builder: pipeline/federation/strategies/<name>.py).
STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in [
        StrategySpec("fedavg", averaging=True),
        StrategySpec("fednova"),
        StrategySpec("fedopt", FedOptConfig, group="fedopt"),
        StrategySpec("fedprox", FedProxSettings, averaging=True, proximal=True),
        StrategySpec("fedtrimmedavg", FedTrimmedAvgSettings, group="fedtrimmedavg"),
    ]
}
# Every params `train` key a strategy owns (they are the strategies', not TrainConfig's).
STRATEGY_KEYS = frozenset(key for spec in STRATEGIES.values() for key in spec.params_keys)


def get_strategy(name: str) -> StrategySpec:
    if name not in STRATEGIES:
        raise ValueError(f"unknown server strategy {name!r}; expected one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


@config(frozen=True)
class MethodSpec:
    name: str
    federated: bool  # False: `single` (each client alone) and `centralized` (data pooled): no server
    kd_mode: KdMode
    local_from_global: bool = False  # AdaFedAvg: the server average overwrites the client adapter every round
    strategy: str | None = None  # the server algorithm (STRATEGIES) of federated methods
    pooled: bool = False  # centralized: every client's train data in one training set
    # New-client study: "post" = the new client joins once the others converged (train.join), "pre" = from round 1.
    new_client: str | None = None

    @property
    def two_adapters(self) -> bool:
        """The client keeps a global (teacher) adapter next to its local one: every KD method distils from it."""
        return self.kd_mode != "ce"

    @property
    def uses_tau(self) -> bool:
        """Only selective KD reads the entropy threshold: plans of other methods leave tau out."""
        return self.kd_mode == "selective"

    @property
    def proximal(self) -> bool:
        """FedProx: the client adds mu/2 ||W - W_global||^2 (its strategy says so)."""
        return self.strategy is not None and STRATEGIES[self.strategy].proximal

    @property
    def uses_postags(self) -> bool:
        return self.kd_mode == "hard"


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in [
        MethodSpec("single", federated=False, kd_mode="ce"),
        MethodSpec("centralized", federated=False, kd_mode="ce", pooled=True),
        MethodSpec("fedavg", federated=True, kd_mode="ce", local_from_global=True, strategy="fedavg"),
        MethodSpec("fedkd", federated=True, kd_mode="kd", strategy="fedavg"),
        MethodSpec("fedselectkd", federated=True, kd_mode="selective", strategy="fedavg"),
        MethodSpec("hardkd", federated=True, kd_mode="hard", strategy="fedavg"),
        MethodSpec("post_addition", federated=True, kd_mode="selective", strategy="fedavg", new_client="post"),
        MethodSpec("pre_addition", federated=True, kd_mode="selective", strategy="fedavg", new_client="pre"),
    ]
}
# Table V (section 7.7) compares server algorithms: every registered strategy without a method above is a method of
# its own name, CE with one adapter set as AdaFedAvg **(our default)**, compared against `fedselectkd`.
METHODS |= {
    name: MethodSpec(name, federated=True, kd_mode="ce", local_from_global=True, strategy=name)
    for name in STRATEGIES
    if name not in METHODS
}


def get_method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; expected one of {sorted(METHODS)}")
    return METHODS[name]
