"""The params `privacy` group as a plan carries it and the refusals of what a privacy setting cannot protect."""

from __future__ import annotations

import math
from dataclasses import asdict, field
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pipeline.common.config import Fraction, NonNegative, Positive, config
from pipeline.experiments.methods import STRATEGIES

# Keys one mode reads and the other ignores (PrivacyConfig.plan_dict leaves them out)
EXAMPLE_KEYS = ("max_grad_norm",)
ADAPTIVE_KEYS = ("target_clipped_quantile", "clip_norm_lr", "clipped_count_stddev")
CLIENT_KEYS = ("clipping_side", "clipping", "clipping_norm") + ADAPTIVE_KEYS
# delta null: mode client, this (far below 1/N for every federation here, N <= 100; N >= 1e5 must set delta);
# mode example, min(this, 1 / (10 n)) for a client of n training examples
DEFAULT_DELTA = 1e-5
# The servers whose new global is the average of the replies and nothing more (FedProx's mu is the client's):
# mode client's noise calibrates that mean, and SecAgg+ gives the server that mean and no single reply.
AVERAGING_STRATEGIES = tuple(name for name, spec in STRATEGIES.items() if spec.averaging)
# SecAgg+ masks are drawn in [0, 2**32) (Flower's default modulus_range): the masked sum of the quantised uploads
# and of their integer weights must stay below it.
SECAGG_MODULUS = 2**32


Bound = Annotated[float, Field(gt=0, allow_inf_nan=True)]  # a clipping bound; .inf = no clipping


@config
class SecAggConfig:
    """params `privacy.secagg`: Flower's SecAggPlusWorkflow settings, checked by Flower's rules at params time."""

    num_shares: int | Annotated[float, Field(gt=0, le=1)] = 1.0
    reconstruction_threshold: int | Annotated[float, Field(gt=0, le=1)] = 0.67
    clipping_range: Positive = 8.0
    quantization_range: Annotated[int, Field(gt=1, lt=SECAGG_MODULUS)] = 2**22

    @model_validator(mode="after")
    def _counts(self) -> SecAggConfig:
        if isinstance(self.num_shares, int) and self.num_shares != 1 and self.num_shares <= 2:
            raise ValueError(f"num_shares as a count must be > 2 (or a fraction), got {self.num_shares}")
        counted = isinstance(self.num_shares, int) and self.num_shares > 1  # Flower reads an int 1 as 1.0
        t = self.reconstruction_threshold
        if isinstance(t, int) and not (t >= 2 and (not counted or t < self.num_shares)):
            raise ValueError(f"reconstruction_threshold as a count must be >= 2 and < num_shares, got {t}")
        return self


@config
class PrivacyConfig:
    """params `privacy` (the comments on each key live in the params file)."""

    mode: Literal["none", "example", "client"] = "none"
    noise_multiplier: NonNegative | None = None
    target_epsilon: Positive | None = None
    max_grad_norm: Bound = 1.0
    delta: Annotated[float, Field(gt=0, lt=1)] | None = None
    accountant: Literal["rdp", "prv"] = "rdp"
    # mode client only
    clipping_side: Literal["server", "client"] = "server"
    clipping: Literal["fixed", "adaptive"] = "fixed"
    clipping_norm: Bound | None = None
    target_clipped_quantile: Fraction = 0.5
    clip_norm_lr: Positive = 0.2
    clipped_count_stddev: NonNegative | None = None  # null = sampled clients / 20
    secure_aggregation: bool = False
    secagg: SecAggConfig = field(default_factory=SecAggConfig)

    @model_validator(mode="after")
    def _mode_needs(self) -> PrivacyConfig:
        if self.mode == "none":
            if self.noise_multiplier is not None or self.target_epsilon is not None:
                raise ValueError(
                    "noise_multiplier / target_epsilon are set but mode is 'none': set mode 'example' "
                    "or 'client', or leave them null"
                )
            return self
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                f"mode {self.mode!r} needs exactly one of noise_multiplier and target_epsilon "
                f"(got {self.noise_multiplier} and {self.target_epsilon})"
            )
        if self.mode == "example" and math.isinf(self.max_grad_norm) and self.noise_multiplier != 0:
            raise ValueError("max_grad_norm .inf (no clipping) needs noise_multiplier 0 (noise std = sigma * C)")
        if self.mode == "client":
            if self.clipping == "fixed" and self.clipping_norm is None:
                raise ValueError(
                    "clipping_norm must be set with mode client and clipping fixed: the bound C on "
                    "the L2 norm of a client's round update (no default fits every backbone)"
                )
            if self.clipping_norm == math.inf and (self.noise_multiplier != 0 or self.clipping == "adaptive"):
                raise ValueError(
                    "clipping_norm .inf (no clipping) needs clipping fixed and noise_multiplier 0 "
                    "(noise std = noise_multiplier x C / sampled clients)"
                )
        return self

    @property
    def enabled(self) -> bool:  # a DP mode; secure aggregation is secure_aggregation
        return self.mode != "none"

    def plan_dict(self) -> dict[str, Any]:
        """The group as a plan carries it: without the keys that change nothing (so they change no plan hash)."""
        drop = {"secure_aggregation", "secagg"}
        drop.update(CLIENT_KEYS if self.mode != "client" else EXAMPLE_KEYS)
        if self.mode == "client" and self.clipping != "adaptive":
            drop.update(ADAPTIVE_KEYS)
        record = {k: v for k, v in asdict(self).items() if k not in drop} if self.enabled else {"mode": self.mode}
        if self.secure_aggregation:
            record |= {"secure_aggregation": True, "secagg": asdict(self.secagg)}
        return record


def secure_aggregation_refusal(method, transfer_dtype: str, cfg: PrivacyConfig) -> str | None:
    """Why ``method`` (a MethodSpec) cannot run under SecAgg+, or None: the server then sees only the weighted sum
    of the uploads, so it must need nothing else and cannot clip one."""
    if cfg.mode == "client" and cfg.clipping_side != "client":
        return (
            "privacy.mode client needs clipping_side client under SecAgg+: the server receives only the sum "
            "of the updates and cannot clip each one (the client clips its update before it is masked)"
        )
    if not method.federated:
        return f"method {method.name!r} trains without a server: there is no aggregate to protect"
    if method.strategy not in AVERAGING_STRATEGIES:
        return (
            f"method {method.name!r}'s server ({method.strategy}) does more than average the uploads, and "
            f"SecAgg+ gives it only their weighted sum (servers that average: {', '.join(AVERAGING_STRATEGIES)})"
        )
    if transfer_dtype != "fp32":
        return (
            f"train.transfer_dtype is {transfer_dtype}: SecAgg+ quantises the fp32 upload itself "
            f"(privacy.secagg), so the transfer must be fp32"
        )
    return None


def client_level_problem(method, transfer_dtype: str, cfg: PrivacyConfig) -> str | None:
    """Why mode client makes no sense for ``method`` (a MethodSpec), or None."""
    if not method.federated:
        what = "pools every client's data in one place" if method.pooled else "trains each client alone"
        return (
            f"method {method.name} {what}: no client update reaches a server aggregate, so there is no "
            f"client-level guarantee to give (mode example protects its examples in federated methods)"
        )
    if method.strategy not in AVERAGING_STRATEGIES:
        unbounded = "so one client's influence on the aggregate is not bounded by C / sampled clients"
        why = {
            "fednova": f"rescales each update by the client's own step count, {unbounded}",
            "fedtrimmedavg": f"takes a coordinate-wise trimmed mean over fewer clients than it sampled, {unbounded}",
        }.get(
            method.strategy,
            "applies an optimiser to the mean and keeps its un-noised state (momentum, moments) across rounds: "
            "neither the sensitivity C / sampled clients nor the composition holds",
        )
        return f"method {method.name}: its server {why}; use fedavg or fedprox"
    if method.new_client == "post":
        return (
            f"method {method.name}: the population grows when the new client joins mid-run, so the sampling "
            f"rate changes while the noise is calibrated to one sample size"
        )
    if cfg.clipping_side == "client" and transfer_dtype != "fp32":
        return (
            f"privacy.clipping_side client needs train.transfer_dtype fp32 (got {transfer_dtype}): Flower's "
            f"clipping mod clips the reply against the received arrays as they travel, encoded"
        )
    return None
