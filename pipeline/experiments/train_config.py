"""The `train` params group (each key's comment lives in the params file): what a training run does."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from pipeline.common.config import BelowOne, Fraction, NonNegative, Positive, PositiveInt, config, from_dict
from pipeline.experiments.methods import STRATEGIES, STRATEGY_KEYS

# The loss's settings (LossSettings)
# The unit of H(q_g) and so of tau: nats ("e") or bits ("2"; a number from YAML is read as the base's name).
LogBase = Annotated[Literal["e", "2"], BeforeValidator(lambda v: str(v) if type(v) is int else v)]
UNITS = {"e": "nats", "2": "bits"}  # H(q_g)'s and an absolute tau's, by train.entropy_log_base
# How selective KD reads tau (params.yaml train.tau_scale; the entropy gate applies it)
TauScale = Literal["absolute", "max_entropy", "batch_quantile"]

# How the adapters travel (pipeline.federation.compression encodes them): a setting of the plan, it changes results.
TransferDtype = Literal["fp32", "fp16", "int8"]


@config
class JoinConfig:
    """When the post-addition study's new client joins (`train.join`): once the existing clients have converged
    (pipeline.training.stopping), at ``max_round`` at the latest."""

    min_rel_improvement: BelowOne = 0.01
    patience: PositiveInt = 1
    max_round: Annotated[int, Field(ge=2)] = 3  # round 1 has no earlier round


@config
class StopConfig:
    """When a run ends (`train.stop`): disabled, after its fixed ``train.rounds``; enabled, once its clients have
    converged (pipeline.training.stopping), after ``max_rounds`` at the latest (the plan's ``train.rounds``)."""

    enabled: bool = False
    min_rel_improvement: BelowOne = 0.005
    patience: PositiveInt = 3
    max_rounds: PositiveInt = 40


@config
class LossSettings:
    """The `train` keys of the loss: pipeline.modeling.losses.KDConfig is these and its method's mode and tau."""

    kd_lambda: Fraction = 0.2
    kd_temperature: Positive = 1.0
    kd_direction: Literal["teacher_to_student", "student_to_teacher"] = "teacher_to_student"
    entropy_log_base: LogBase = "e"
    tau_scale: TauScale = "absolute"
    kd_gate: str = "entropy"  # a registered gate (pipeline.modeling.gates), checked at planning time
    loss_normalisation: Literal["tokens", "sequences"] = "tokens"


@config
class TrainConfig(LossSettings):
    rounds: PositiveInt = 3
    local_epochs: PositiveInt = 1
    batch_size: PositiveInt = 8
    grad_accum_steps: PositiveInt = 1
    bucket_by_length: bool = True
    lr: NonNegative = 2.0e-4  # torch's AdamW refuses a negative lr or weight_decay
    weight_decay: NonNegative = 0.01
    decay_norm_and_bias: bool = False
    local_adapter: Literal["keep", "reset"] = "keep"
    centralized_steps: Literal["largest_client", "epoch"] = "largest_client"
    fraction_train: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    new_client: str = "SAMSum"
    join: JoinConfig = field(default_factory=JoinConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    max_train_examples_per_client: PositiveInt | None = 16
    max_valid_examples_per_client: PositiveInt | None = 6
    weight_by: Literal["full", "trained"] = "trained"
    transfer_dtype: TransferDtype = "fp32"
    transfer_delta: bool = False
    prefix_cache: bool = True
    # The server strategies' own `train` keys as the params file has them (proximal_mu, fedopt, ...: each strategy
    # declared in pipeline.experiments.methods reads its settings from them); built by :func:`train_config`.
    strategy_params: dict[str, Any] = field(default_factory=dict)


# Every key params `train` may hold for a plan: TrainConfig's and the declared strategies'.
TRAIN_KEYS = ({f.name for f in dataclasses.fields(TrainConfig)} - {"strategy_params"}) | STRATEGY_KEYS


def train_config(data: dict[str, Any] | None, where: str = "train") -> TrainConfig:
    """TrainConfig from a `train` mapping: the strategies' keys go to ``strategy_params``, each declared
    strategy's settings checked there (a bad value raises ConfigError naming ``where.<key>``)."""
    data = dict(data or {})
    strategy_params = {k: data.pop(k) for k in sorted(STRATEGY_KEYS & set(data))}
    for spec in STRATEGIES.values():
        spec.settings(strategy_params, where)
    return dataclasses.replace(from_dict(TrainConfig, data, where), strategy_params=strategy_params)
