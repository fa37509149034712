"""The `train` params group (the comments on each key live in the project's params file): what a training run
does, as the plan stage resolves it per experiment (pipeline.experiments keeps out of each plan the keys its method
ignores)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.common.config import ConfigError, from_dict
from pipeline.federation.compression import TRANSFER_DTYPES
from pipeline.federation.strategies.catalog import STRATEGIES, strategy_params_keys
from pipeline.modeling.gates.catalog import GATES
from pipeline.modeling.losses import TAU_SCALES


def _check_plateau_rule(group: str, min_rel_improvement: float, patience: int) -> None:
    """The settings of the plateau test train.join and train.stop share (pipeline.training.stopping)."""
    if not 0.0 <= min_rel_improvement < 1.0:
        raise ValueError(f"{group}: min_rel_improvement must be in [0, 1)")
    if patience < 1:
        raise ValueError(f"{group}: patience must be >= 1")


@dataclass
class JoinConfig:
    """When the new client of the post-addition study joins (`train.join`): once the existing clients
    have converged, i.e. their mean validation loss improved by less than ``min_rel_improvement`` (relative to the
    best earlier round) in each of the last ``patience`` rounds, and at ``max_round`` at the latest."""

    min_rel_improvement: float = 0.01
    patience: int = 1
    max_round: int = 3

    def __post_init__(self) -> None:
        _check_plateau_rule("train.join", self.min_rel_improvement, self.patience)
        if self.max_round < 2:
            raise ValueError("train.join: max_round must be >= 2 (round 1 has no earlier round)")


@dataclass
class StopConfig:
    """When a run ends (params `train.stop`): disabled, a run trains its fixed ``train.rounds``; enabled, it
    ends once the client-average validation loss has not improved by at least ``min_rel_improvement`` (relative
    to its best so far) in each of the last ``patience`` rounds (pipeline.training.stopping, the test `train.join`
    uses), and after ``max_rounds`` at the latest (the plan's ``train.rounds`` is then ``max_rounds``)."""

    enabled: bool = False
    min_rel_improvement: float = 0.005
    patience: int = 3
    max_rounds: int = 40

    def __post_init__(self) -> None:
        _check_plateau_rule("train.stop", self.min_rel_improvement, self.patience)
        if self.max_rounds < 1:
            raise ValueError("train.stop: max_rounds must be >= 1")


@dataclass
class TrainConfig:
    """The `train` params (the comments on each default live in the project's params file)."""

    rounds: int = 3
    local_epochs: int = 1
    batch_size: int = 8
    grad_accum_steps: int = 1
    bucket_by_length: bool = True
    lr: float = 2.0e-4
    weight_decay: float = 0.01
    # AdamW decay on LayerNorm weights and biases too (usual practice, and the default, leaves them undecayed).
    decay_norm_and_bias: bool = False
    kd_lambda: float = 0.2
    kd_temperature: float = 1.0
    kd_direction: str = "teacher_to_student"
    entropy_log_base: str = "e"
    tau_scale: str = "absolute"  # how selective KD reads tau (pipeline.modeling.losses.TAU_SCALES)
    # Selective KD's gate (pipeline/modeling/gates/<name>.py), reading tau as its threshold; plans carry it only when
    # it is not the paper's entropy gate (so the entropy-gated plans stay as they were).
    kd_gate: str = "entropy"
    loss_normalisation: str = "tokens"
    local_adapter: str = "keep"
    fraction_train: float = 1.0
    new_client: str = "SAMSum"
    join: JoinConfig = field(default_factory=JoinConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    max_train_examples_per_client: int | None = 16
    max_valid_examples_per_client: int | None = 6
    # FedAvg weight of a client: "trained" = the examples it trained on this round, "full" = its whole train split
    # |D_i| (the paper's data-size weights); they differ only under max_train_examples_per_client.
    weight_by: str = "trained"
    transfer_dtype: str = "fp32"  # adapter encoding on the wire (pipeline.federation.compression): fp32 | fp16 | int8
    # Lossy encodings as differences: uplink to the global received this round, downlink to the round-0 adapter
    # (ignored for fp32, which is exact).
    transfer_delta: bool = False
    prefix_cache: bool = True
    # The server strategies' own `train` keys as the params file has them (proximal_mu, fedopt, ...: each strategy
    # module of pipeline.federation.strategies reads its settings from them); built by :func:`train_config`.
    strategy_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.join, dict):
            self.join = from_dict(JoinConfig, self.join, "train.join")
        if isinstance(self.stop, dict):
            self.stop = from_dict(StopConfig, self.stop, "train.stop")
        checks = [
            (self.rounds >= 1, "rounds must be >= 1"),
            (self.local_epochs >= 1, "local_epochs must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.grad_accum_steps >= 1, "grad_accum_steps must be >= 1"),
            (0.0 < self.fraction_train <= 1.0, "fraction_train must be in (0, 1]"),
            (0.0 <= self.kd_lambda <= 1.0, "kd_lambda must be in [0, 1]"),
            (self.local_adapter in ("keep", "reset"), "local_adapter must be 'keep' or 'reset'"),
            (self.weight_by in ("full", "trained"), "weight_by must be 'full' or 'trained'"),
            (self.transfer_dtype in TRANSFER_DTYPES, f"transfer_dtype must be one of {TRANSFER_DTYPES}"),
            (isinstance(self.transfer_delta, bool), "transfer_delta must be true or false"),
            (self.tau_scale in TAU_SCALES, f"tau_scale must be one of {TAU_SCALES}"),
            (self.kd_gate in GATES, f"kd_gate must be one of {tuple(GATES)}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise ConfigError(f"train: {problem}")


def train_keys() -> set[str]:
    """Every key params `train` may hold for a plan: TrainConfig's and the registered strategies'."""
    return ({f.name for f in dataclasses.fields(TrainConfig)} - {"strategy_params"}) | strategy_params_keys()


def train_config(data: dict[str, Any] | None, where: str = "train") -> TrainConfig:
    """TrainConfig from a `train` mapping: the strategies' keys go to ``strategy_params``, each registered
    strategy's settings checked there (a bad value raises ConfigError naming ``where.<key>``)."""
    data = dict(data or {})
    owned = strategy_params_keys()
    strategy_params = {k: data.pop(k) for k in sorted(owned & set(data))}
    for spec in STRATEGIES.values():
        spec.settings(strategy_params, where)
    return dataclasses.replace(from_dict(TrainConfig, data, where), strategy_params=strategy_params)
