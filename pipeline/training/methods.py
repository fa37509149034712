"""The methods compared (METHOD.md sections 6 and 7), selectable by name."""

from __future__ import annotations

from pipeline.common.config import ConfigError, config
from pipeline.federation.strategies.catalog import STRATEGIES
from pipeline.modeling.losses import KdMode


@config(frozen=True)
class MethodSpec:
    name: str
    federated: bool  # False: `single` (each client alone) and `centralized` (data pooled): no server
    kd_mode: KdMode  # the local path's loss: ce | kd (every token) | selective (H(q_g) < tau) | hard (nouns, verbs)
    two_adapters: bool  # the client keeps a global (teacher) adapter next to its local one
    local_from_global: bool = False  # AdaFedAvg: the server average overwrites the client adapter every round
    strategy: str | None = None  # the server algorithm (pipeline.federation.strategies) of federated methods
    pooled: bool = False  # centralized: every client's train data in one training set
    # New-client study: "post" = the new client joins once the others converged (train.join), "pre" = from round 1.
    new_client: str | None = None

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
        MethodSpec("single", federated=False, kd_mode="ce", two_adapters=False),
        MethodSpec("centralized", federated=False, kd_mode="ce", two_adapters=False, pooled=True),
        MethodSpec(
            "fedavg", federated=True, kd_mode="ce", two_adapters=False, local_from_global=True, strategy="fedavg"
        ),
        MethodSpec("fedkd", federated=True, kd_mode="kd", two_adapters=True, strategy="fedavg"),
        MethodSpec("fedselectkd", federated=True, kd_mode="selective", two_adapters=True, strategy="fedavg"),
        MethodSpec("hardkd", federated=True, kd_mode="hard", two_adapters=True, strategy="fedavg"),
        MethodSpec(
            "post_addition",
            federated=True,
            kd_mode="selective",
            two_adapters=True,
            strategy="fedavg",
            new_client="post",
        ),
        MethodSpec(
            "pre_addition", federated=True, kd_mode="selective", two_adapters=True, strategy="fedavg", new_client="pre"
        ),
    ]
}
# Table V (section 7.7) compares server algorithms: every registered strategy without a method above is a method of
# its own name, CE with one adapter set as AdaFedAvg **(our default)**, compared against `fedselectkd`.
METHODS.update(
    {
        name: MethodSpec(name, federated=True, kd_mode="ce", two_adapters=False, local_from_global=True, strategy=name)
        for name in STRATEGIES
        if name not in METHODS
    }
)


def get_method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; expected one of {sorted(METHODS)}")
    return METHODS[name]
