"""The `train` params group (the comments on each key live in the project's params file): what a training run
does, as the plan stage resolves it per experiment (pipeline.experiments keeps out of each plan the keys its method
ignores)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.common.config import ConfigError, from_dict
from pipeline.federation.compression import TRANSFER_DTYPES
from pipeline.federation.strategies import FedOptConfig
from pipeline.modeling.losses import TAU_SCALES


@dataclass
class JoinConfig:
    """When the new client of the post-addition study joins (`train.join`): once the existing clients
    have converged, i.e. their mean validation loss improved by less than ``min_rel_improvement`` (relative to the
    best earlier round) in each of the last ``patience`` rounds, and at ``max_round`` at the latest."""

    min_rel_improvement: float = 0.01
    patience: int = 1
    max_round: int = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_rel_improvement < 1.0:
            raise ValueError("train.join: min_rel_improvement must be in [0, 1)")
        if self.patience < 1:
            raise ValueError("train.join: patience must be >= 1")
        if self.max_round < 2:
            raise ValueError("train.join: max_round must be >= 2 (round 1 has no earlier round)")


@dataclass
class TrainConfig:
    """The `train` params (the comments on each default live in the project's params file)."""

    rounds: int = 3
    local_epochs: int = 1
    batch_size: int = 4
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
    loss_normalisation: str = "tokens"
    local_adapter: str = "keep"
    fraction_train: float = 1.0
    proximal_mu: float = 0.01
    fedopt: FedOptConfig = field(default_factory=FedOptConfig)
    new_client: str = "SAMSum"
    join: JoinConfig = field(default_factory=JoinConfig)
    max_train_examples_per_client: int | None = None
    max_valid_examples_per_client: int | None = None
    # FedAvg weight of a client: "full" = its whole train split |D_i| (the paper's data-size weights), "trained" =
    # the examples it trained on this round (differs only under max_train_examples_per_client).
    weight_by: str = "full"
    transfer_dtype: str = "fp32"  # adapter encoding on the wire (pipeline.federation.compression): fp32 | fp16 | int8
    # Lossy encodings as differences: uplink to the global received this round, downlink to the round-0 adapter
    # (ignored for fp32, which is exact).
    transfer_delta: bool = False
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.fedopt, dict):
            self.fedopt = from_dict(FedOptConfig, self.fedopt, "train.fedopt")
        if isinstance(self.join, dict):
            self.join = from_dict(JoinConfig, self.join, "train.join")
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
        ]
        for ok, problem in checks:
            if not ok:
                raise ConfigError(f"train: {problem}")
